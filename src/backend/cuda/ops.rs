//! The CUDA arm of the backend boundary: one function per op of
//! `backend/mod.rs`, on pool tensors whose storage is device memory of one
//! device, queued on that device's one stream.
//!
//! NOTHING HERE HAS RUN ON A GPU: it compiles, and the kernels it launches
//! compile with NVRTC (tests/cuda_kernels.rs), but no launch has been made.
//!
//! Wired (NVRTC kernels, launch shapes as their comments in `kernels/`
//! state): BN running-statistic update, BN running stats, BN forward (with
//! and without the bf16 keep-copy), add+ReLU with mask, add_assign, ReLU
//! mask forward/backward, max and average pooling forward/backward,
//! rounding, widen/narrow, copy_rounded, SGD, AdamW, scale, host copies,
//! device copies, synchronise.
//!
//! Not wired yet, an `Error::Cuda` naming the op: convolutions (cuDNN
//! NHWC), linear (cuBLAS), and the ops whose kernels need pool scratch the
//! boundary does not pass yet (BN batch statistics and BN backward: chunk
//! partial sums; cross-entropy: per-row losses; sum of squares: block
//! partials; unscale and all_finite: a device flag). See
//! `docs/architecture.md`, "How to add a backend".

use std::ffi::c_void;

use super::state::{State, state};
use crate::backend::{ConvPass, LossOutput};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::ops::conv2d::ConvGeom;
use crate::ops::maxpool::PoolGeom;
use crate::tensor::{DType, Precision, Tensor};

/// Threads per block of the one-thread-per-item kernels.
const THREADS: u32 = 256;

/// The `round` argument of the kernels (`ROUND_*` in common.cuh).
fn round_arg(p: Precision) -> i32 {
    match p {
        Precision::F32 => 0,
        Precision::BF16 => 1,
        Precision::F16 => 2,
    }
}

fn not_yet(op: &'static str, what: &str) -> Error {
    Error::Cuda {
        op,
        reason: format!(
            "not implemented on CUDA yet ({what}); train on the CPU (--device cpu) until the CUDA \
             backend has it"
        ),
    }
}

fn ordinal(t: &Tensor) -> Result<u32> {
    match t.device() {
        Device::Cuda(n) => Ok(n),
        other => Err(Error::invalid(
            "cuda backend",
            format!("{}: tensor on {}, not a CUDA device", t.tag(), other.name()),
        )),
    }
}

/// One kernel argument, in an 8-byte slot (the kernel reads the first
/// `sizeof(T)` bytes; x86-64 and aarch64 are little-endian).
#[derive(Clone, Copy)]
enum Arg {
    /// A device address (0 for a null pointer).
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
}

impl Arg {
    fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I64(v) => v as u64,
            Arg::I32(v) => u64::from(v as u32),
            Arg::F32(v) => u64::from(v.to_bits()),
        }
    }
}

fn ptr(t: &Tensor) -> Arg {
    Arg::Ptr(t.device_address())
}

fn opt_ptr(t: Option<&Tensor>) -> Arg {
    Arg::Ptr(t.map_or(0, Tensor::device_address))
}

fn n64(n: usize) -> Arg {
    Arg::I64(n as i64)
}

fn i32_arg(op: &'static str, v: usize) -> Result<Arg> {
    i32::try_from(v)
        .map(Arg::I32)
        .map_err(|_| Error::invalid(op, format!("{v} does not fit a kernel's int")))
}

/// Launches kernel `name` of module `module` with a 1-D grid of `items`
/// threads (rounded up to whole blocks of [`THREADS`]).
fn launch(st: &State, module: &'static str, name: &str, items: usize, args: &[Arg]) -> Result<()> {
    if items == 0 {
        return Ok(());
    }
    let blocks = u32::try_from(items.div_ceil(THREADS as usize))
        .map_err(|_| Error::invalid("cuda launch", format!("{name}: {items} threads")))?;
    launch_shape(st, module, name, (blocks, 1, 1), (THREADS, 1, 1), args)
}

fn launch_shape(
    st: &State,
    module: &'static str,
    name: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: &[Arg],
) -> Result<()> {
    let f = st.function(module, name)?;
    let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| std::ptr::from_mut(s).cast::<c_void>())
        .collect();
    st.core.ctx.bind_to_thread().map_err(|e| Error::Cuda {
        op: "cuCtxSetCurrent",
        reason: format!("{e:?}"),
    })?;
    // SAFETY: the arguments match the kernel's parameter list (each call
    // site mirrors the signature in kernels/*.cu); every address is pool
    // storage of the right length on this device, alive until the stream
    // has run the kernel (the pool frees a segment only after
    // synchronising); `slots` outlives the call, which copies the values.
    unsafe {
        cudarc::driver::result::launch_kernel(
            f.cu_function(),
            grid,
            block,
            0,
            st.core.stream.cu_stream(),
            &mut params,
        )
    }
    .map_err(|e| Error::Cuda {
        op: "cuLaunchKernel",
        reason: format!("{module}.{name}: {e:?}"),
    })
}

// ---------------------------------------------------------------------------
// Workspaces the meta device answers identically

/// cuDNN's workspace for a convolution on CUDA device `ordinal`, as
/// (f32, elements). The convolution is not wired yet (see the module doc),
/// so this is the documented planning default: the weight in cuDNN's NHWC
/// filter layout (cout, kh, kw, cin) in f32, plus the weight gradient in
/// that layout for the backward pass, plus [`CUDNN_DEFAULT_WORKSPACE`]
/// bytes for cuDNN itself (an upper bound of what FACTS.md measured on the
/// H200 for implicit-GEMM forward, 131 B, and weight gradient, 2.2 MB, at
/// ResNet-50 sizes). When the convolutions are wired, this asks cuDNN for
/// the pinned algorithm's size when the device is here.
pub fn conv2d_workspace(_ordinal: u32, g: &ConvGeom, pass: ConvPass) -> (DType, usize) {
    let w = g.kh * g.kw * g.cin * g.cout;
    let bytes = match pass {
        ConvPass::Forward => w * 4 + CUDNN_DEFAULT_WORKSPACE,
        ConvPass::Backward => 2 * w * 4 + CUDNN_DEFAULT_WORKSPACE,
    };
    (DType::F32, bytes.div_ceil(4))
}

/// The planning default for cuDNN's own workspace per convolution (4 MiB).
pub const CUDNN_DEFAULT_WORKSPACE: usize = 4 << 20;

// ---------------------------------------------------------------------------
// Convolution and linear (not wired)

pub fn conv2d_forward(
    _y: &mut Tensor,
    _x: &Tensor,
    _w: &Tensor,
    _g: &ConvGeom,
    _ws: &mut Tensor,
    _p: Precision,
) -> Result<()> {
    Err(not_yet("conv2d_forward", "cuDNN NHWC convolution"))
}

#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    _dx: Option<&mut Tensor>,
    _dw: &mut Tensor,
    _dy: &Tensor,
    _x: &Tensor,
    _w: &Tensor,
    _g: &ConvGeom,
    _ws: &mut Tensor,
    _p: Precision,
) -> Result<()> {
    Err(not_yet("conv2d_backward", "cuDNN NHWC convolution"))
}

pub fn linear_forward(
    _y: &mut Tensor,
    _x: &Tensor,
    _w: &Tensor,
    _b: &Tensor,
    _p: Precision,
) -> Result<()> {
    Err(not_yet("linear_forward", "cuBLAS sgemm"))
}

pub fn linear_backward(
    _dx: &mut Tensor,
    _dw: &mut Tensor,
    _db: &mut Tensor,
    _dy: &Tensor,
    _x: &Tensor,
    _w: &Tensor,
    _p: Precision,
) -> Result<()> {
    Err(not_yet("linear_backward", "cuBLAS sgemm"))
}

// ---------------------------------------------------------------------------
// Batch norm

pub fn bn_batch_stats(
    _mean: &mut Tensor,
    _var: &mut Tensor,
    _rstd: &mut Tensor,
    _x: &Tensor,
    _eps: f32,
) -> Result<()> {
    Err(not_yet(
        "bn_batch_stats",
        "needs a pool scratch for chunk partial sums",
    ))
}

pub fn bn_update_running(
    running_mean: &mut Tensor,
    running_var: &mut Tensor,
    mean: &Tensor,
    var: &Tensor,
    rows: usize,
    momentum: f32,
) -> Result<()> {
    let st = state(ordinal(running_mean)?)?;
    let c = mean.numel();
    let args = [
        ptr(running_mean),
        ptr(running_var),
        ptr(mean),
        ptr(var),
        n64(rows),
        i32_arg("bn_update_running", c)?,
        Arg::F32(momentum),
    ];
    launch(&st, "batchnorm", "bn_update_running", c, &args)
}

pub fn bn_running_stats(
    mean: &mut Tensor,
    rstd: &mut Tensor,
    running_mean: &Tensor,
    running_var: &Tensor,
    eps: f32,
) -> Result<()> {
    let st = state(ordinal(mean)?)?;
    let c = mean.numel();
    let args = [
        ptr(mean),
        ptr(rstd),
        ptr(running_mean),
        ptr(running_var),
        i32_arg("bn_running_stats", c)?,
        Arg::F32(eps),
    ];
    launch(&st, "batchnorm", "bn_running_stats", c, &args)
}

/// The BN forward kernels: y f32 or bf16, x f32 or bf16, x_low optional.
#[allow(clippy::too_many_arguments)]
fn bn_forward_any(
    y: &mut Tensor,
    x_low: Option<&Tensor>,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    relu: bool,
    p: Precision,
) -> Result<()> {
    let st = state(ordinal(y)?)?;
    let c = mean.numel();
    let n = x.numel();
    let rows = n.checked_div(c).unwrap_or(0);
    let y_bf16 = y.dtype() == DType::BF16;
    let name = match (x.dtype(), y_bf16) {
        (DType::BF16, false) => "bn_forward_xbf16_yf32",
        (DType::BF16, true) => "bn_forward_xbf16_ybf16",
        (_, false) => "bn_forward_xf32_yf32",
        (_, true) => "bn_forward_xf32_ybf16",
    };
    let mut args = vec![
        ptr(y),
        opt_ptr(x_low),
        ptr(x),
        ptr(mean),
        ptr(rstd),
        ptr(gamma),
        ptr(beta),
        n64(rows),
        i32_arg("bn_forward", c)?,
        Arg::I32(i32::from(relu)),
    ];
    if !y_bf16 {
        args.push(Arg::I32(round_arg(p)));
    }
    launch(&st, "batchnorm", name, n, &args)
}

#[allow(clippy::too_many_arguments)]
pub fn bn_forward(
    y: &mut Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    relu: bool,
    p: Precision,
) -> Result<()> {
    bn_forward_any(y, None, x, mean, rstd, gamma, beta, relu, p)
}

#[allow(clippy::too_many_arguments)]
pub fn bn_forward_keep_x(
    y: &mut Tensor,
    x_low: &mut Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    relu: bool,
    p: Precision,
) -> Result<()> {
    bn_forward_any(y, Some(x_low), x, mean, rstd, gamma, beta, relu, p)
}

#[allow(clippy::too_many_arguments)]
pub fn bn_backward(
    _dx: &mut Tensor,
    _dgamma: Option<&mut Tensor>,
    _dbeta: Option<&mut Tensor>,
    _dy: &Tensor,
    _x: &Tensor,
    _mean: &Tensor,
    _rstd: &Tensor,
    _gamma: &Tensor,
    _relu_out: Option<&Tensor>,
    _batch_stats: bool,
    _p: Precision,
) -> Result<()> {
    Err(not_yet(
        "bn_backward",
        "needs a pool scratch for chunk partial sums",
    ))
}

// ---------------------------------------------------------------------------
// ReLU, residual add, pooling

pub fn add_relu_forward(
    z: &mut Tensor,
    residual: &Tensor,
    mask: &mut Tensor,
    p: Precision,
) -> Result<()> {
    let st = state(ordinal(z)?)?;
    let n = z.numel();
    let name = if residual.dtype() == DType::BF16 {
        "add_relu_forward_bf16"
    } else {
        "add_relu_forward_f32"
    };
    let args = [
        ptr(z),
        ptr(mask),
        ptr(residual),
        n64(n),
        Arg::I32(round_arg(p)),
    ];
    launch(&st, "relu", name, n.div_ceil(8), &args)
}

pub fn add_assign(acc: &mut Tensor, x: &Tensor, p: Precision) -> Result<()> {
    let st = state(ordinal(acc)?)?;
    let n = acc.numel();
    let args = [ptr(acc), ptr(x), n64(n), Arg::I32(round_arg(p))];
    launch(&st, "relu", "add_assign", n, &args)
}

pub fn relu_mask_forward(x: &mut Tensor, mask: &mut Tensor) -> Result<()> {
    let st = state(ordinal(x)?)?;
    let n = x.numel();
    launch(
        &st,
        "relu",
        "relu_mask_forward",
        n.div_ceil(8),
        &[ptr(x), ptr(mask), n64(n)],
    )
}

pub fn relu_mask_backward_inplace(d: &mut Tensor, mask: &Tensor) -> Result<()> {
    let st = state(ordinal(d)?)?;
    let n = d.numel();
    launch(
        &st,
        "relu",
        "relu_mask_backward_inplace",
        n.div_ceil(8),
        &[ptr(d), ptr(mask), n64(n)],
    )
}

fn pool_args(g: &PoolGeom) -> Result<Vec<Arg>> {
    let op = "pool";
    Ok(vec![
        i32_arg(op, g.n)?,
        i32_arg(op, g.h)?,
        i32_arg(op, g.w)?,
        i32_arg(op, g.c)?,
        i32_arg(op, g.k)?,
        i32_arg(op, g.stride)?,
        i32_arg(op, g.pad)?,
        i32_arg(op, g.oh())?,
        i32_arg(op, g.ow())?,
    ])
}

pub fn maxpool_forward(y: &mut Tensor, x: &Tensor, g: &PoolGeom) -> Result<()> {
    let st = state(ordinal(y)?)?;
    let mut args = vec![ptr(y), ptr(x)];
    args.extend(pool_args(g)?);
    launch(&st, "pool", "maxpool_forward", y.numel(), &args)
}

pub fn maxpool_backward(
    dx: &mut Tensor,
    dy: &Tensor,
    x: &Tensor,
    g: &PoolGeom,
    p: Precision,
) -> Result<()> {
    let st = state(ordinal(dx)?)?;
    let mut args = vec![ptr(dx), ptr(dy), ptr(x)];
    args.extend(pool_args(g)?);
    args.push(Arg::I32(round_arg(p)));
    launch(&st, "pool", "maxpool_backward", dx.numel(), &args)
}

/// (n, hw, c) of an NHWC tensor.
fn n_hw_c(t: &Tensor) -> (usize, usize, usize) {
    let (n, h, w, c) = t.shape().nhwc();
    (n, h * w, c)
}

pub fn avgpool_forward(y: &mut Tensor, x: &Tensor, p: Precision) -> Result<()> {
    let st = state(ordinal(y)?)?;
    let (n, hw, c) = n_hw_c(x);
    let op = "avgpool_forward";
    let args = [
        ptr(y),
        ptr(x),
        i32_arg(op, n)?,
        i32_arg(op, hw)?,
        i32_arg(op, c)?,
        Arg::I32(round_arg(p)),
    ];
    launch(&st, "pool", op, n * c, &args)
}

pub fn avgpool_backward(dx: &mut Tensor, dy: &Tensor, p: Precision) -> Result<()> {
    let st = state(ordinal(dx)?)?;
    let (n, hw, c) = n_hw_c(dx);
    let op = "avgpool_backward";
    let args = [
        ptr(dx),
        ptr(dy),
        i32_arg(op, n)?,
        i32_arg(op, hw)?,
        i32_arg(op, c)?,
        Arg::I32(round_arg(p)),
    ];
    launch(&st, "pool", op, dx.numel(), &args)
}

// ---------------------------------------------------------------------------
// Loss

pub fn cross_entropy(
    _d_logits: &mut Tensor,
    _logits: &Tensor,
    _labels: &[usize],
    _smoothing: f32,
    _divisor: usize,
    _scale: Option<f32>,
    _p: Precision,
) -> Result<LossOutput> {
    Err(not_yet(
        "cross_entropy",
        "needs pool scratch for labels and per-row losses",
    ))
}

// ---------------------------------------------------------------------------
// Precision

pub fn round(t: &mut Tensor, p: Precision) -> Result<()> {
    if p == Precision::F32 {
        return Ok(());
    }
    let st = state(ordinal(t)?)?;
    let n = t.numel();
    launch(
        &st,
        "cast",
        "round_inplace",
        n,
        &[ptr(t), n64(n), Arg::I32(round_arg(p))],
    )
}

pub fn widen(dst: &mut Tensor, src: &Tensor) -> Result<()> {
    let st = state(ordinal(dst)?)?;
    let n = dst.numel();
    let name = match src.dtype() {
        DType::BF16 => "cast_bf16_to_f32",
        DType::F16 => "cast_f16_to_f32",
        DType::F32 => return copy(dst, src),
        other => {
            return Err(Error::invalid(
                "widen",
                format!("{}: cannot widen {other:?}", src.tag()),
            ));
        }
    };
    launch(&st, "cast", name, n, &[ptr(dst), ptr(src), n64(n)])
}

pub fn narrow(dst: &mut Tensor, src: &Tensor) -> Result<()> {
    let st = state(ordinal(dst)?)?;
    let n = dst.numel();
    let name = match dst.dtype() {
        DType::BF16 => "cast_f32_to_bf16",
        DType::F16 => "cast_f32_to_f16",
        other => {
            return Err(Error::invalid(
                "narrow",
                format!("{}: cannot narrow f32 to {other:?}", dst.tag()),
            ));
        }
    };
    launch(&st, "cast", name, n, &[ptr(dst), ptr(src), n64(n)])
}

pub fn copy_rounded(dst: &mut Tensor, src: &Tensor, p: Precision) -> Result<()> {
    let st = state(ordinal(dst)?)?;
    let n = dst.numel();
    let args = [ptr(dst), ptr(src), n64(n), Arg::I32(round_arg(p))];
    launch(&st, "cast", "copy_rounded", n, &args)
}

// ---------------------------------------------------------------------------
// Optimizer updates and checks

#[allow(clippy::too_many_arguments)]
pub fn sgd_update(
    value: &mut Tensor,
    grad: &Tensor,
    momentum_buf: Option<&mut Tensor>,
    first: bool,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
) -> Result<()> {
    let st = state(ordinal(value)?)?;
    let n = value.numel();
    let args = [
        ptr(value),
        opt_ptr(momentum_buf.as_deref()),
        ptr(grad),
        n64(n),
        Arg::I32(i32::from(first)),
        Arg::F32(lr),
        Arg::F32(momentum),
        Arg::F32(weight_decay),
        Arg::I32(i32::from(nesterov)),
    ];
    launch(&st, "optim", "sgd_update", n, &args)
}

#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    value: &mut Tensor,
    grad: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    t: u64,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
) -> Result<()> {
    if t == 0 {
        return Err(Error::invalid("adamw_update", "step count starts at 1"));
    }
    let st = state(ordinal(value)?)?;
    let n = value.numel();
    // The scalars exactly as src/ops/optim_update.rs makes them.
    let (lr64, b1, b2) = (f64::from(lr), f64::from(beta1), f64::from(beta2));
    let decay = (1.0 - lr64 * f64::from(weight_decay)) as f32;
    let w1 = (1.0 - b1) as f32;
    let w2 = (1.0 - b2) as f32;
    let ti = i32::try_from(t).unwrap_or(i32::MAX);
    let bc1 = 1.0 - b1.powi(ti);
    let bc2 = 1.0 - b2.powi(ti);
    let neg_step = (-(lr64 / bc1)) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let args = [
        ptr(value),
        ptr(exp_avg),
        ptr(exp_avg_sq),
        ptr(grad),
        n64(n),
        Arg::F32(decay),
        Arg::F32(w1),
        Arg::F32(w2),
        Arg::F32(beta2),
        Arg::F32(neg_step),
        Arg::F32(bc2_sqrt),
        Arg::F32(eps),
        Arg::I32(i32::from(weight_decay != 0.0)),
    ];
    launch(&st, "optim", "adamw_update", n, &args)
}

pub fn sum_squares(_t: &Tensor) -> Result<f64> {
    Err(not_yet(
        "sum_squares",
        "needs a pool scratch for block partials",
    ))
}

pub fn scale(t: &mut Tensor, c: f32) -> Result<()> {
    let st = state(ordinal(t)?)?;
    let n = t.numel();
    launch(&st, "reduce", "scale", n, &[ptr(t), n64(n), Arg::F32(c)])
}

pub fn unscale(_t: &mut Tensor, _inv: f32) -> Result<bool> {
    Err(not_yet(
        "unscale",
        "needs a pool scratch for the found-inf flag",
    ))
}

pub fn all_finite(_t: &Tensor) -> Result<bool> {
    Err(not_yet("all_finite", "needs a pool scratch for the flag"))
}

// ---------------------------------------------------------------------------
// Host copies, device copies, synchronisation

pub fn copy_from_host(t: &mut Tensor, values: &[f32]) -> Result<()> {
    let st = state(ordinal(t)?)?;
    Ok(st.core.upload(t.device_address(), values)?)
}

pub fn copy_to_host(t: &Tensor) -> Result<Vec<f32>> {
    let st = state(ordinal(t)?)?;
    let mut out = vec![0.0f32; t.numel()];
    st.core.download(&mut out, t.device_address())?;
    Ok(out)
}

pub fn copy(dst: &mut Tensor, src: &Tensor) -> Result<()> {
    let st = state(ordinal(dst)?)?;
    let bytes = dst.storage_bytes().min(src.storage_bytes());
    if bytes == 0 {
        return Ok(());
    }
    st.core.ctx.bind_to_thread().map_err(|e| Error::Cuda {
        op: "cuCtxSetCurrent",
        reason: format!("{e:?}"),
    })?;
    // SAFETY: both ranges are pool storage of at least `bytes` on this
    // device, ordered on its one stream.
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(
            dst.device_address(),
            src.device_address(),
            bytes,
            st.core.stream.cu_stream(),
        )
    }
    .map_err(|e| Error::Cuda {
        op: "cuMemcpyDtoDAsync",
        reason: format!("{e:?}"),
    })
}

pub fn synchronize(ordinal: u32) -> Result<()> {
    Ok(state(ordinal)?.core.synchronize()?)
}
