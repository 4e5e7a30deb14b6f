//! The CUDA arm of the backend boundary: one function per op of
//! `backend/mod.rs`, on pool tensors whose storage is device memory of one
//! device, queued on that device's one stream.
//!
//! NOTHING HERE HAS RUN ON A GPU: it compiles, and the kernels it launches
//! compile with NVRTC (tests/cuda_kernels.rs), but no launch has been made
//! and no cuDNN or cuBLAS call has been issued. tests/cuda_vs_cpu.rs holds
//! the comparisons with the CPU backend that a GPU session must run.
//!
//! Every op of the boundary is wired:
//! * NVRTC kernels (launch shapes as their comments in `kernels/` state):
//!   BN running-statistic update, BN running stats, BN forward (with and
//!   without the bf16 keep-copy), add+ReLU with mask, add_assign, ReLU mask
//!   forward/backward, max and average pooling forward/backward, rounding,
//!   widen/narrow, copy_rounded, SGD, AdamW, scale.
//! * Two-phase kernels with pool scratch ([`Tensor::scratch`]: category
//!   workspace, from the pool of the op's output, freed on return): BN
//!   batch statistics and BN backward (chunk partial sums, f64), the
//!   cross-entropy (labels uploaded as i32, per-row losses; one 16-byte
//!   read for loss and count), sum of squares (block partials; one 8-byte
//!   read), unscale and all_finite (a zeroed 4-byte flag; one read each).
//! * cuDNN (`dnn`): convolution forward / backward-data (beta = 1 into
//!   `dx`) / backward-filter, NHWC, pinned deterministic algorithms; the
//!   HWIO weight is transposed into the planned workspace (`conv.cu`). f32:
//!   strict fp32 unless `dnn::set_allow_tf32`; f16, and bf16 on a card
//!   without bf16 tensor cores, run as f32 convolutions of operands the
//!   layers rounded. bf16 on compute capability 8.0 and up
//!   (`Capabilities::reads_bf16`): cuDNN in bf16 with f32 accumulation on
//!   tensor cores, bf16 activations read and written in place, f32 operands
//!   (the image, a stage's f32 gradients) staged through the workspace one
//!   tile of images at a time (`conv_ws`); BN, the residual add, the ReLU
//!   masks and the max-pool backward read bf16 in place.
//! * cuBLAS sgemm (`dnn`): linear forward and backward, bias by `linear.cu`.
//! * Host copies, device copies, synchronise.
//!
//! See `docs/architecture.md`, "How to add a backend".

use std::ffi::c_void;

use super::conv_ws::ConvWs;
use super::dnn;
use super::state::{State, state};
use crate::accounting::Tag;
use crate::backend::ConvPass;
use crate::backend::scratch::{self, BN_CHUNK_ROWS, SQ_CHUNK};
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

/// Whether `t` is stored as bf16 (else f32) for a kernel that has both
/// variants; any other type is an error, not a kernel reading 4 bytes per
/// element of a 2-byte buffer.
fn is_bf16(op: &'static str, t: &Tensor) -> Result<bool> {
    match t.dtype() {
        DType::BF16 => Ok(true),
        DType::F32 => Ok(false),
        other => Err(Error::invalid(
            op,
            format!("{} is {other:?}; this kernel reads f32 or bf16", t.tag()),
        )),
    }
}

/// An error unless `t` is stored as f32, for the kernels and copies that
/// take only f32 (the CPU's versions panic on another type).
fn f32_only(op: &'static str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 => Ok(()),
        other => Err(Error::invalid(
            op,
            format!("{} is {other:?}; this takes f32 only", t.tag()),
        )),
    }
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

/// The workspace a convolution on CUDA device `ordinal` is given, as
/// (f32, elements): the regions of [`ConvWs`] (the weight in cuDNN's NHWC
/// filter layout, its gradient for the backward, and under bf16 the
/// staging of f32 operands one tile of images at a time) followed by
/// cuDNN's own workspace for the algorithms chosen for the tile's
/// geometries ([`dnn::cudnn_workspace_bytes`]), cuDNN's exact answer,
/// cached with the choice, so the call is given what the plan counted. A
/// query that fails on a GPU that is here is an error naming the geometry.
/// Only with no GPU here at all (planning for a card this machine lacks,
/// which `setup::plan_device` announces) is cuDNN's part the documented
/// bound [`CUDNN_DEFAULT_WORKSPACE`]. The planner's meta device calls this
/// too, so it counts what the call will use. `input` and `output` are how
/// the input and the forward's output are stored.
pub fn conv2d_workspace(
    ordinal: u32,
    g: &ConvGeom,
    pass: ConvPass,
    input: DType,
    output: DType,
    p: Precision,
) -> Result<(DType, usize)> {
    let ws = ConvWs::new(g, pass, conv_dtype(ordinal, p), input, output);
    let cudnn = match state(ordinal) {
        Ok(st) => dnn::cudnn_workspace_bytes(&st, &ws.geometries(g), pass, ws.dtype)?,
        Err(Error::CudaUnavailable { .. }) if crate::device::cuda::no_gpu_here() => {
            CUDNN_DEFAULT_WORKSPACE
        }
        Err(e) => return Err(e),
    };
    Ok((DType::F32, ws.bytes(cudnn).div_ceil(4)))
}

pub use dnn::CUDNN_DEFAULT_WORKSPACE;

// ---------------------------------------------------------------------------
// Convolution (cuDNN) and linear (cuBLAS)

/// The type cuDNN runs a convolution of precision `p` in on device
/// `ordinal`: bf16 in and out with f32 accumulation (tensor cores) under
/// bf16 where the card has bf16 convolutions (compute capability 8.0 and
/// up: `Capabilities::reads_bf16`); else f32. An f32 convolution of
/// operands the layers rounded to bf16 or f16 (fp32, or TF32, whose
/// 10-bit mantissa holds a bf16 or f16 value exactly) is the
/// low-precision convolution with f32 accumulation; a bf16 one then
/// rounds its output, as the CPU's does, and an f16 one leaves that to the
/// layer.
fn conv_dtype(ordinal: u32, p: Precision) -> DType {
    if p.bf16_in_place(Device::Cuda(ordinal).capabilities()) {
        DType::BF16
    } else {
        DType::F32
    }
}

/// One convolution call's workspace: the layout, the aligned base address
/// of its regions and cuDNN's region, checked against what cuDNN asks for
/// the tile's geometries (never allocated here: it was planned).
struct Workspace {
    base: u64,
    cudnn: u64,
    cudnn_bytes: usize,
}

impl Workspace {
    fn new(
        op: &'static str,
        st: &State,
        ws: &Tensor,
        g: &ConvGeom,
        pass: ConvPass,
        layout: ConvWs,
    ) -> Result<Self> {
        let need = dnn::cudnn_workspace_bytes(st, &layout.geometries(g), pass, layout.dtype)?;
        let addr = ws.device_address();
        let base = dnn::regions_base(addr);
        let front = (base - addr) as usize + layout.cudnn;
        let have = ws.storage_bytes().saturating_sub(front);
        if need > have || ws.storage_bytes() < front {
            return Err(Error::Cuda {
                op,
                reason: format!(
                    "cuDNN asks for {need} B of workspace after {front} B of regions, {} B were \
                     planned ({}); the plan was made without this GPU's answer",
                    ws.storage_bytes(),
                    ws.tag()
                ),
            });
        }
        Ok(Workspace {
            base,
            cudnn: base + layout.cudnn as u64,
            cudnn_bytes: have,
        })
    }

    /// The address of the region at offset `at`.
    fn at(&self, at: usize) -> u64 {
        self.base + at as u64
    }
}

/// `hwio_to_ohwi` (the weight `hwio` into the OHWI region at `region`, in
/// `dtype`) or, with `add_back`, `ohwi_add_to_hwio` (the OHWI gradient at
/// `region`, in `dtype`, added into the f32 HWIO gradient `hwio`).
fn transpose_weight(
    st: &State,
    region: u64,
    hwio: &Tensor,
    g: &ConvGeom,
    dtype: DType,
    add_back: bool,
) -> Result<()> {
    let op = "conv weight layout";
    f32_only(op, hwio)?;
    let bf16 = dtype == DType::BF16;
    let (name, mut args) = match (add_back, bf16) {
        (false, false) => ("hwio_to_ohwi", vec![Arg::Ptr(region), ptr(hwio)]),
        (false, true) => ("hwio_to_ohwi_bf16", vec![Arg::Ptr(region), ptr(hwio)]),
        (true, false) => ("ohwi_add_to_hwio", vec![ptr(hwio), Arg::Ptr(region)]),
        (true, true) => ("ohwi_bf16_add_to_hwio", vec![ptr(hwio), Arg::Ptr(region)]),
    };
    args.extend([
        i32_arg(op, g.kh * g.kw)?,
        i32_arg(op, g.cin)?,
        i32_arg(op, g.cout)?,
    ]);
    launch(st, "conv", name, hwio.numel(), &args)
}

/// `cast.cu`'s narrowing (f32 to bf16) or widening of `n` elements
/// between device addresses.
fn cast(st: &State, to_bf16: bool, dst: u64, src: u64, n: usize) -> Result<()> {
    let name = if to_bf16 {
        "cast_f32_to_bf16"
    } else {
        "cast_bf16_to_f32"
    };
    launch(st, "cast", name, n, &[Arg::Ptr(dst), Arg::Ptr(src), n64(n)])
}

/// One tile of a convolution's images (`first..first + images`) in the
/// convolution's type `dtype`: where its operands are for cuDNN.
struct Tile<'a> {
    op: &'static str,
    st: &'a State,
    dtype: DType,
    first: usize,
    images: usize,
}

impl Tile<'_> {
    /// Where the tile's part of `t` (`image` elements per image) is: in
    /// place when `t` is stored in the convolution's type, else the staging
    /// region at `stage` (filled by narrowing first when `fill`).
    fn operand(&self, t: &Tensor, stage: Option<u64>, image: usize, fill: bool) -> Result<u64> {
        let (op, dtype) = (self.op, self.dtype);
        let offset = (self.first * image * t.dtype().unit_bytes()) as u64;
        if t.dtype() == dtype {
            return Ok(t.device_address() + offset);
        }
        if t.dtype() != DType::F32 || dtype != DType::BF16 {
            return Err(Error::invalid(
                op,
                format!(
                    "{} is {:?}; a {dtype:?} convolution takes it as {dtype:?} or f32",
                    t.tag(),
                    t.dtype()
                ),
            ));
        }
        let Some(stage) = stage else {
            return Err(Error::Cuda {
                op,
                reason: format!("no staging region was planned for {}", t.tag()),
            });
        };
        if fill {
            cast(
                self.st,
                true,
                stage,
                t.device_address() + offset,
                self.images * image,
            )?;
        }
        Ok(stage)
    }
}

/// cuDNN forward with the geometry's chosen algorithm (alpha 1, beta 0:
/// `y` overwritten) on the OHWI copy of `w` made in `ws`, in the type of
/// [`conv_dtype`]; under bf16 one tile of images at a time where an
/// operand is f32 ([`ConvWs`]).
pub fn conv2d_forward(
    y: &mut Tensor,
    x: &Tensor,
    w: &Tensor,
    g: &ConvGeom,
    ws: &mut Tensor,
    p: Precision,
) -> Result<()> {
    let op = "conv2d_forward";
    let ordinal = ordinal(y)?;
    let st = state(ordinal)?;
    let dtype = conv_dtype(ordinal, p);
    if dtype == DType::F32 {
        for t in [&*y, x] {
            f32_only(op, t)?;
        }
    }
    let layout = ConvWs::new(g, ConvPass::Forward, dtype, x.dtype(), y.dtype());
    let wsp = Workspace::new(op, &st, ws, g, ConvPass::Forward, layout)?;
    let w_t = wsp.at(layout.w);
    transpose_weight(&st, w_t, w, g, dtype, false)?;
    let (in_image, out_image) = (g.h * g.w * g.cin, g.oh() * g.ow() * g.cout);
    // Each kernel and cuDNN call runs in order on the device's one stream,
    // so a staging region is reused only after the call reading it.
    for (first, images) in layout.tiles(g.n) {
        let geom = ConvGeom { n: images, ..*g };
        let tile = Tile {
            op,
            st: &st,
            dtype,
            first,
            images,
        };
        let stage = |at: Option<usize>| at.map(|a| wsp.at(a));
        let xa = tile.operand(x, stage(layout.x), in_image, true)?;
        let ya = tile.operand(y, stage(layout.y), out_image, false)?;
        dnn::conv_forward(
            &st,
            &geom,
            dtype,
            &dnn::ConvArgs {
                x: xa,
                w: w_t,
                y: ya,
                ws: wsp.cudnn,
                ws_bytes: wsp.cudnn_bytes,
            },
        )?;
        if y.dtype() != dtype {
            let offset = (first * out_image * 4) as u64;
            cast(
                &st,
                false,
                y.device_address() + offset,
                ya,
                images * out_image,
            )?;
        }
    }
    // As the CPU's bf16 convolution: its output comes back rounded (a
    // bf16 cuDNN output is rounded once already, as the CPU's bf16 one).
    if p == Precision::BF16 && dtype == DType::F32 {
        round(y, p)?;
    }
    Ok(())
}

/// cuDNN backward-data with the geometry's chosen algorithm into `dx`
/// (accumulating, as the CPU's dgrad does) and backward-filter into the
/// OHWI region of `ws` (beta = 0), then added into `dw` (HWIO) by
/// `ohwi_add_to_hwio`. In f32 one call each, beta = 1 into `dx`. In bf16
/// one tile of images at a time: `dy` narrowed into its region (unless
/// stored in bf16), backward-data into the `dx` region then added into the
/// f32 `dx` and rounded to bf16 (`add_assign`), backward-filter of the
/// tile added into `dw`. Under `--profile` the two halves are timed as
/// conv dgrad and conv wgrad (host time: what enqueueing them costs).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    dx: Option<&mut Tensor>,
    dw: &mut Tensor,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    g: &ConvGeom,
    ws: &mut Tensor,
    p: Precision,
) -> Result<()> {
    use crate::profile::{Family, timed};
    let op = "conv2d_backward";
    let ordinal = ordinal(dw)?;
    let st = state(ordinal)?;
    let dtype = conv_dtype(ordinal, p);
    if dtype == DType::F32 {
        for t in [dy, x] {
            f32_only(op, t)?;
        }
    }
    if let Some(dx) = dx.as_deref() {
        f32_only(op, dx)?;
    }
    let layout = ConvWs::new(g, ConvPass::Backward, dtype, x.dtype(), DType::F32);
    let wsp = Workspace::new(op, &st, ws, g, ConvPass::Backward, layout)?;
    let w_t = wsp.at(layout.w);
    let Some(dw_at) = layout.dw else {
        return Err(Error::Cuda {
            op,
            reason: "the backward layout has no weight-gradient region".into(),
        });
    };
    let dw_t = wsp.at(dw_at);
    let mut dx = dx;
    if dx.is_some() {
        timed(Family::ConvDgrad, 0, || {
            transpose_weight(&st, w_t, w, g, dtype, false)
        })?;
    }
    let (in_image, out_image) = (g.h * g.w * g.cin, g.oh() * g.ow() * g.cout);
    let stage = |at: Option<usize>| at.map(|a| wsp.at(a));
    for (first, images) in layout.tiles(g.n) {
        let geom = ConvGeom { n: images, ..*g };
        let tile = Tile {
            op,
            st: &st,
            dtype,
            first,
            images,
        };
        let dya = tile.operand(dy, stage(layout.y), out_image, true)?;
        if let Some(dx) = dx.as_deref_mut() {
            timed(Family::ConvDgrad, 0, || -> Result<()> {
                let in_place = dtype == DType::F32;
                let dxa = if in_place {
                    dx.device_address()
                } else {
                    stage(layout.dx).ok_or_else(|| Error::Cuda {
                        op,
                        reason: "no staging region was planned for dx".into(),
                    })?
                };
                dnn::conv_backward_data(
                    &st,
                    &geom,
                    dtype,
                    if in_place { 1.0 } else { 0.0 },
                    &dnn::ConvArgs {
                        x: dxa,
                        w: w_t,
                        y: dya,
                        ws: wsp.cudnn,
                        ws_bytes: wsp.cudnn_bytes,
                    },
                )?;
                if in_place {
                    // As the CPU's: dx (with what it accumulated) comes back rounded.
                    if p == Precision::BF16 {
                        round(dx, p)?;
                    }
                    return Ok(());
                }
                // dx += the tile's bf16 gradient, rounded to bf16 as the CPU's.
                let at = dx.device_address() + (first * in_image * 4) as u64;
                let n = images * in_image;
                launch(
                    &st,
                    "relu",
                    "add_assign_bf16",
                    n,
                    &[Arg::Ptr(at), Arg::Ptr(dxa), n64(n), Arg::I32(round_arg(p))],
                )
            })?;
        }
        // The data pass before it is ordered on the same stream, so reusing
        // the cuDNN region is safe.
        timed(Family::ConvWgrad, 0, || -> Result<()> {
            let xa = tile.operand(x, stage(layout.x), in_image, true)?;
            dnn::conv_backward_filter(
                &st,
                &geom,
                dtype,
                &dnn::ConvArgs {
                    x: xa,
                    w: dw_t,
                    y: dya,
                    ws: wsp.cudnn,
                    ws_bytes: wsp.cudnn_bytes,
                },
            )?;
            transpose_weight(&st, dw_t, dw, g, dtype, true)
        })?;
    }
    Ok(())
}

/// cuBLAS's workspace from the pool of `t` ([`scratch::cublas_workspace`]),
/// set on the handle; held by the caller until its GEMMs are queued.
fn cublas_workspace(st: &State, t: &Tensor) -> Result<Tensor> {
    let bytes = scratch::cublas_workspace_for(t);
    let held = t.scratch(bytes, Tag::fixed("cublas workspace"), false)?;
    let align = scratch::CUBLAS_ALIGN as u64;
    let at = held.device_address().next_multiple_of(align);
    dnn::set_cublas_workspace(st, at, bytes - scratch::CUBLAS_ALIGN)?;
    Ok(held)
}

/// `y = x·wᵀ + b`: `bias_rows` fills `y` with `b`, then one sgemm with
/// beta = 1. Row-major (n, out) `y` is column-major (out × n) `yᵀ = w·xᵀ`.
pub fn linear_forward(
    y: &mut Tensor,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    p: Precision,
) -> Result<()> {
    let op = "linear_forward";
    let st = state(ordinal(y)?)?;
    let (n, fout) = (y.dims()[0], y.dims()[1]);
    let fin = w.dims()[1];
    launch(
        &st,
        "linear",
        "bias_rows",
        n * fout,
        &[ptr(y), ptr(b), n64(n), i32_arg(op, fout)?],
    )?;
    let _workspace = cublas_workspace(&st, y)?;
    dnn::sgemm(
        &st,
        true,
        false,
        (fout, n, fin),
        w.device_address(),
        fin,
        x.device_address(),
        fin,
        1.0,
        y.device_address(),
        fout,
    )?;
    round(y, p)
}

/// `dw += dyᵀ·x` (sgemm, beta = 1), `db += Σ dy` (`bias_grad`, the CPU's
/// order and bits), `dx = dy·w` (sgemm, beta = 0), rounded to `p`.
pub fn linear_backward(
    dx: &mut Tensor,
    dw: &mut Tensor,
    db: &mut Tensor,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    p: Precision,
) -> Result<()> {
    let op = "linear_backward";
    let st = state(ordinal(dx)?)?;
    let (fout, fin) = (w.dims()[0], w.dims()[1]);
    let n = dy.dims()[0];
    let _workspace = cublas_workspace(&st, dx)?;
    // Column-major: dwᵀ (in × out) += xᵀ (in × n) · dy (n × out).
    dnn::sgemm(
        &st,
        false,
        true,
        (fin, fout, n),
        x.device_address(),
        fin,
        dy.device_address(),
        fout,
        1.0,
        dw.device_address(),
        fin,
    )?;
    launch(
        &st,
        "linear",
        "bias_grad",
        fout,
        &[ptr(db), ptr(dy), n64(n), i32_arg(op, fout)?],
    )?;
    // Column-major: dxᵀ (in × n) = wᵀ (in × out) · dyᵀ (out × n).
    dnn::sgemm(
        &st,
        false,
        false,
        (fin, n, fout),
        w.device_address(),
        fin,
        dy.device_address(),
        fout,
        0.0,
        dx.device_address(),
        fin,
    )?;
    round(dx, p)
}

// ---------------------------------------------------------------------------
// Batch norm

/// `BN_THREADS` of batchnorm.cu.
const BN_THREADS: u32 = 128;

fn bn_partial_grid(op: &'static str, rows: usize, c: usize) -> Result<(u32, u32, u32)> {
    let chunks = u32::try_from(rows.div_ceil(BN_CHUNK_ROWS))
        .map_err(|_| Error::invalid(op, format!("{rows} rows")))?;
    let cblocks = u32::try_from(c.div_ceil(BN_THREADS as usize))
        .map_err(|_| Error::invalid(op, format!("{c} channels")))?;
    Ok((chunks, cblocks, 1))
}

/// The two-phase statistics of batchnorm.cu (`bn_stats_partial`, then
/// `bn_stats_finish`: the CPU's bits) with the partial sums in a pool
/// scratch of [`scratch::bn_partial`].
pub fn bn_batch_stats(
    mean: &mut Tensor,
    var: &mut Tensor,
    rstd: &mut Tensor,
    x: &Tensor,
    eps: f32,
) -> Result<()> {
    let op = "bn_batch_stats";
    let st = state(ordinal(mean)?)?;
    let c = mean.numel();
    let rows = x.numel().checked_div(c).unwrap_or(0);
    if rows == 0 {
        return Ok(());
    }
    let partial = x.scratch(
        scratch::bn_partial(rows, c),
        Tag::fixed("bn partial sums"),
        false,
    )?;
    let x_bf16 = is_bf16(op, x)?;
    launch_shape(
        &st,
        "batchnorm",
        if x_bf16 {
            "bn_stats_partial_bf16"
        } else {
            "bn_stats_partial"
        },
        bn_partial_grid(op, rows, c)?,
        (BN_THREADS, 1, 1),
        &[ptr(&partial), ptr(x), n64(rows), i32_arg(op, c)?],
    )?;
    launch(
        &st,
        "batchnorm",
        if x_bf16 {
            "bn_stats_finish_bf16"
        } else {
            "bn_stats_finish"
        },
        c,
        &[
            ptr(mean),
            ptr(var),
            ptr(rstd),
            ptr(&partial),
            ptr(x),
            n64(rows),
            i32_arg(op, c)?,
            Arg::F32(eps),
        ],
    )
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
    let y_bf16 = is_bf16("bn_forward", y)?;
    let name = match (is_bf16("bn_forward", x)?, y_bf16) {
        (true, false) => "bn_forward_xbf16_yf32",
        (true, true) => "bn_forward_xbf16_ybf16",
        (false, false) => "bn_forward_xf32_yf32",
        (false, true) => "bn_forward_xf32_ybf16",
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

/// The BN backward of batchnorm.cu: `bn_backward_partial_*` (chunk sums in
/// a pool scratch of [`scratch::bn_partial`]), `bn_backward_finish` (dgamma,
/// dbeta and the per-channel coefficients, (3, c) f32 in a second scratch),
/// then `bn_backward_dx_*`.
#[allow(clippy::too_many_arguments)]
pub fn bn_backward(
    dx: &mut Tensor,
    dgamma: Option<&mut Tensor>,
    dbeta: Option<&mut Tensor>,
    dy: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    relu_out: Option<&Tensor>,
    batch_stats: bool,
    p: Precision,
) -> Result<()> {
    let op = "bn_backward";
    let st = state(ordinal(dx)?)?;
    let c = mean.numel();
    let rows = dx.numel().checked_div(c).unwrap_or(0);
    if rows == 0 {
        return Ok(());
    }
    f32_only(op, dx)?;
    let flag = |t: Option<&Tensor>| -> Result<i32> {
        Ok(match t {
            Some(t) => i32::from(is_bf16(op, t)?),
            None => 0,
        })
    };
    let (dy_bf16, x_bf16, o_bf16) = (flag(Some(dy))?, flag(Some(x))?, flag(relu_out)?);
    let partial = dx.scratch(
        scratch::bn_partial(rows, c),
        Tag::fixed("bn partial sums"),
        false,
    )?;
    let coefs = dx.scratch(
        scratch::bn_coefs(c),
        Tag::fixed("bn backward coefficients"),
        false,
    )?;
    launch_shape(
        &st,
        "batchnorm",
        "bn_backward_partial",
        bn_partial_grid(op, rows, c)?,
        (BN_THREADS, 1, 1),
        &[
            ptr(&partial),
            ptr(dy),
            Arg::I32(dy_bf16),
            ptr(x),
            Arg::I32(x_bf16),
            ptr(mean),
            opt_ptr(relu_out),
            Arg::I32(o_bf16),
            n64(rows),
            i32_arg(op, c)?,
        ],
    )?;
    launch(
        &st,
        "batchnorm",
        "bn_backward_finish",
        c,
        &[
            ptr(&coefs),
            opt_ptr(dgamma.as_deref()),
            opt_ptr(dbeta.as_deref()),
            ptr(&partial),
            ptr(rstd),
            ptr(gamma),
            n64(rows),
            i32_arg(op, c)?,
            Arg::I32(i32::from(batch_stats)),
        ],
    )?;
    launch(
        &st,
        "batchnorm",
        "bn_backward_dx",
        rows * c,
        &[
            ptr(dx),
            ptr(dy),
            Arg::I32(dy_bf16),
            ptr(x),
            Arg::I32(x_bf16),
            ptr(mean),
            opt_ptr(relu_out),
            Arg::I32(o_bf16),
            ptr(&coefs),
            n64(rows),
            i32_arg(op, c)?,
            Arg::I32(round_arg(p)),
        ],
    )
}

// ---------------------------------------------------------------------------
// ReLU, residual add, pooling

pub fn add_relu_forward(
    z: &mut Tensor,
    residual: &Tensor,
    mask: &mut Tensor,
    p: Precision,
) -> Result<()> {
    let op = "add_relu_forward";
    let st = state(ordinal(z)?)?;
    let n = z.numel();
    let r_bf16 = is_bf16(op, residual)?;
    if is_bf16(op, z)? {
        // The sum stored in bf16 (the CPU's add_relu_forward_bf16).
        let name = if r_bf16 {
            "add_relu_forward_zbf16_bf16"
        } else {
            "add_relu_forward_zbf16_f32"
        };
        let args = [ptr(z), ptr(mask), ptr(residual), n64(n)];
        return launch(&st, "relu", name, n.div_ceil(8), &args);
    }
    let name = if r_bf16 {
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
    let op = "add_assign";
    f32_only(op, acc)?;
    let st = state(ordinal(acc)?)?;
    let n = acc.numel();
    let name = if is_bf16(op, x)? {
        "add_assign_bf16"
    } else {
        "add_assign"
    };
    let args = [ptr(acc), ptr(x), n64(n), Arg::I32(round_arg(p))];
    launch(&st, "relu", name, n, &args)
}

pub fn relu_mask_forward(x: &mut Tensor, mask: &mut Tensor) -> Result<()> {
    f32_only("relu_mask_forward", x)?;
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
    let name = if is_bf16("relu_mask_backward_inplace", d)? {
        "relu_mask_backward_inplace_bf16"
    } else {
        "relu_mask_backward_inplace"
    };
    launch(
        &st,
        "relu",
        name,
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
    f32_only("maxpool_forward", x)?;
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
    let op = "maxpool_backward";
    f32_only(op, dx)?;
    let st = state(ordinal(dx)?)?;
    let name = match (is_bf16(op, dy)?, is_bf16(op, x)?) {
        (false, false) => "maxpool_backward",
        (true, false) => "maxpool_backward_dybf16",
        (false, true) => "maxpool_backward_xbf16",
        (true, true) => "maxpool_backward_dybf16_xbf16",
    };
    let mut args = vec![ptr(dx), ptr(dy), ptr(x)];
    args.extend(pool_args(g)?);
    args.push(Arg::I32(round_arg(p)));
    launch(&st, "pool", name, dx.numel(), &args)
}

/// (n, hw, c) of an NHWC tensor.
fn n_hw_c(t: &Tensor) -> (usize, usize, usize) {
    let (n, h, w, c) = t.shape().nhwc();
    (n, h * w, c)
}

pub fn avgpool_forward(y: &mut Tensor, x: &Tensor, p: Precision) -> Result<()> {
    let op = "avgpool_forward";
    f32_only(op, x)?;
    let st = state(ordinal(y)?)?;
    let (n, hw, c) = n_hw_c(x);
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
    let op = "avgpool_backward";
    f32_only(op, dy)?;
    let st = state(ordinal(dx)?)?;
    let (n, hw, c) = n_hw_c(dx);
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

/// loss.cu's `cross_entropy_forward_backward` (one thread per row) and
/// `cross_entropy_reduce_add`, with the labels uploaded as i32 into a pool
/// scratch: the loss and the count are added into a step's totals on the
/// device (nothing comes back to the host). `share`: `Some((num, den))`
/// adds `mean * num / den`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_add(
    totals: &Tensor,
    d_logits: &mut Tensor,
    logits: &Tensor,
    labels: &[usize],
    smoothing: f32,
    divisor: usize,
    scale: Option<f32>,
    p: Precision,
    share: Option<(usize, usize)>,
) -> Result<()> {
    let op = "cross_entropy";
    let st = state(ordinal(d_logits)?)?;
    let (n, classes) = (logits.dims()[0], logits.dims()[1]);
    if labels.len() != n {
        return Err(Error::ShapeMismatch {
            op,
            expected: format!("{n} labels"),
            got: labels.len().to_string(),
        });
    }
    // The CPU's checks, before anything is uploaded.
    if divisor < n {
        return Err(Error::invalid(
            op,
            format!("divisor {divisor} is smaller than the batch of {n}"),
        ));
    }
    if let Some(&bad) = labels.iter().find(|&&l| l >= classes) {
        return Err(Error::invalid(
            op,
            format!("label {bad} out of range for {classes} classes"),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let wide = |v: usize, what: &str| {
        i64::try_from(v).map_err(|_| Error::invalid(op, format!("{what} {v}")))
    };
    let (num, den) = share.unwrap_or((1, 1));
    let (num, den) = (wide(num, "share")?, wide(den, "share")?);
    let labels32: Vec<i32> = labels.iter().map(|&l| l as i32).collect();
    let held = d_logits.scratch(scratch::cross_entropy(n), Tag::fixed("loss scratch"), false)?;
    let base = held.device_address();
    let (l, rl, rc) = scratch::cross_entropy_offsets(n);
    let (labels_at, row_loss, row_correct) = (base + l as u64, base + rl as u64, base + rc as u64);
    st.core.upload(labels_at, &labels32)?;
    let divisor = wide(divisor, "divisor")?;
    launch(
        &st,
        "loss",
        "cross_entropy_forward_backward",
        n,
        &[
            Arg::Ptr(row_loss),
            Arg::Ptr(row_correct),
            ptr(d_logits),
            ptr(logits),
            Arg::Ptr(labels_at),
            i32_arg(op, n)?,
            i32_arg(op, classes)?,
            Arg::F32(smoothing),
            Arg::I64(divisor),
            Arg::I32(i32::from(scale.is_some())),
            Arg::F32(scale.unwrap_or(1.0)),
            Arg::I32(round_arg(p)),
        ],
    )?;
    let totals = totals.device_address();
    launch(
        &st,
        "loss",
        "cross_entropy_reduce_add",
        1,
        &[
            Arg::Ptr(totals + scratch::TOTALS_LOSS as u64),
            Arg::Ptr(totals + scratch::TOTALS_CORRECT as u64),
            Arg::Ptr(row_loss),
            Arg::Ptr(row_correct),
            i32_arg(op, n)?,
            Arg::I32(i32::from(share.is_some())),
            Arg::I64(num),
            Arg::I64(den),
        ],
    )
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
    // The CPU's scalars (the widened hyper-parameters, in f64).
    let k = crate::ops::optim_update::adamw_scalars(t, lr, beta1, beta2, weight_decay);
    let args = [
        ptr(value),
        ptr(exp_avg),
        ptr(exp_avg_sq),
        ptr(grad),
        n64(n),
        Arg::F32(k.decay),
        Arg::F32(k.w1),
        Arg::F32(k.w2),
        Arg::F32(k.beta2),
        Arg::F32(k.neg_step),
        Arg::F32(k.bc2_sqrt),
        Arg::F32(eps),
        Arg::I32(i32::from(k.apply_decay)),
    ];
    launch(&st, "optim", "adamw_update", n, &args)
}

/// The block size of reduce.cu's `sum_squares_partial` (`SQ_THREADS`).
const SQ_THREADS: u32 = 256;

/// `*acc += Σ x²` of `t` on the device, where `acc` is the f64 at byte
/// `at` of `acc_in` (reduce.cu's `sum_squares_partial` and
/// `sum_squares_finish_add`; partials in a pool scratch): a clipping norm
/// over many tensors without a read per tensor.
pub fn sum_squares_add(acc_in: &Tensor, at: usize, t: &Tensor) -> Result<()> {
    let op = "sum_squares";
    let st = state(ordinal(t)?)?;
    let n = t.numel();
    if n == 0 {
        return Ok(());
    }
    let blocks = n.div_ceil(SQ_CHUNK);
    let held = t.scratch(
        scratch::sum_squares_partials(n),
        Tag::fixed("sum_squares partials"),
        false,
    )?;
    let partial = held.device_address();
    let grid = u32::try_from(blocks).map_err(|_| Error::invalid(op, format!("{n} values")))?;
    launch_shape(
        &st,
        "reduce",
        "sum_squares_partial",
        (grid, 1, 1),
        (SQ_THREADS, 1, 1),
        &[Arg::Ptr(partial), ptr(t), n64(n)],
    )?;
    launch(
        &st,
        "reduce",
        "sum_squares_finish_add",
        1,
        &[
            Arg::Ptr(acc_in.device_address() + at as u64),
            Arg::Ptr(partial),
            n64(blocks),
        ],
    )
}

pub fn scale(t: &mut Tensor, c: f32) -> Result<()> {
    let st = state(ordinal(t)?)?;
    let n = t.numel();
    launch(&st, "reduce", "scale", n, &[ptr(t), n64(n), Arg::F32(c)])
}

/// reduce.cu's `unscale`: `t *= inv` (the caller holds `t` mutably),
/// storing 1 into the totals' flag (byte [`scratch::TOTALS_FLAG`]) when a
/// result is inf or NaN; nothing is read.
pub fn unscale_into(totals: &Tensor, t: &mut Tensor, inv: f32) -> Result<()> {
    let st = state(ordinal(t)?)?;
    let n = t.numel();
    let flag = totals.device_address() + scratch::TOTALS_FLAG as u64;
    launch(
        &st,
        "reduce",
        "unscale",
        n,
        &[ptr(t), Arg::Ptr(flag), n64(n), Arg::F32(inv)],
    )
}

/// reduce.cu's `all_finite`: stores 1 into the totals' flag when a value
/// of `t` is inf or NaN; nothing is read.
pub fn check_finite_into(totals: &Tensor, t: &Tensor) -> Result<()> {
    let st = state(ordinal(t)?)?;
    let n = t.numel();
    let flag = totals.device_address() + scratch::TOTALS_FLAG as u64;
    launch(
        &st,
        "reduce",
        "all_finite",
        n,
        &[Arg::Ptr(flag), ptr(t), n64(n)],
    )
}

/// The step's totals ([`scratch::STEP_TOTALS`] bytes) on the host: the
/// one read of an optimizer step.
pub fn read_totals(totals: &Tensor) -> Result<[u64; scratch::STEP_TOTALS / 8]> {
    let st = state(ordinal(totals)?)?;
    let mut host = [0u64; scratch::STEP_TOTALS / 8];
    st.core.download(&mut host, totals.device_address())?;
    Ok(host)
}

// ---------------------------------------------------------------------------
// Host copies, device copies, synchronisation

pub fn copy_from_host(t: &mut Tensor, values: &[f32]) -> Result<()> {
    f32_only("copy_from_host", t)?;
    let st = state(ordinal(t)?)?;
    Ok(st.core.upload(t.device_address(), values)?)
}

pub fn copy_to_host_into(dst: &mut [f32], t: &Tensor) -> Result<()> {
    f32_only("copy_to_host", t)?;
    let st = state(ordinal(t)?)?;
    st.core.download(dst, t.device_address())?;
    Ok(())
}

/// `bytes` from device address `src` to `dst` on the device's one stream.
fn copy_device(st: &State, dst: u64, src: u64, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    st.core.ctx.bind_to_thread().map_err(|e| Error::Cuda {
        op: "cuCtxSetCurrent",
        reason: format!("{e:?}"),
    })?;
    // SAFETY: the callers pass ranges inside pool storage on this device;
    // ordered on its one stream.
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, st.core.stream.cu_stream())
    }
    .map_err(|e| Error::Cuda {
        op: "cuMemcpyDtoDAsync",
        reason: format!("{e:?}"),
    })
}

pub fn copy_range(
    dst: &mut Tensor,
    dst_at: usize,
    src: &Tensor,
    src_at: usize,
    len: usize,
) -> Result<()> {
    f32_only("copy_range", dst)?;
    f32_only("copy_range", src)?;
    let st = state(ordinal(dst)?)?;
    // The caller (backend::copy_range) checked both ranges.
    let f = std::mem::size_of::<f32>() as u64;
    copy_device(
        &st,
        dst.device_address() + dst_at as u64 * f,
        src.device_address() + src_at as u64 * f,
        len * f as usize,
    )
}

pub fn copy(dst: &mut Tensor, src: &Tensor) -> Result<()> {
    f32_only("copy", dst)?;
    f32_only("copy", src)?;
    let st = state(ordinal(dst)?)?;
    let bytes = dst.storage_bytes().min(src.storage_bytes());
    copy_device(&st, dst.device_address(), src.device_address(), bytes)
}

pub fn synchronize(ordinal: u32) -> Result<()> {
    Ok(state(ordinal)?.core.synchronize()?)
}
