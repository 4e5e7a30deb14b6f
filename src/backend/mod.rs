//! The backend boundary: every computation the layers, the executor, the
//! optimizer and the training loop ask for, at the fused-op granularity the
//! planner's byte accounting is written against.
//!
//! Each function takes pool tensors (never host slices) and dispatches on
//! the device of its first output's storage, candle-style: a `match` per
//! op, one arm per device. The CPU arm (`cpu`) hands host slices to the
//! kernels in [`crate::ops`]; the meta arm does nothing, because a meta
//! tensor has no bytes (the pool already counted them), except that on a
//! meta device standing for a CUDA device it allocates (and drops) the
//! pool scratch the CUDA arm would take inside the op ([`scratch`]), so a
//! plan counts it. The CUDA arm (`cuda`, behind the `cuda` / `cuda-12`
//! features; never run on a GPU yet) sits beside them.
//!
//! Why free functions with a `match` and not a trait object: the set of
//! devices is closed and small, the ops are few (about 30), and a `match`
//! keeps every device's version of an op one grep away; a device that
//! lacks an op fails to compile instead of panicking at run time.
//!
//! Conventions: outputs first, then inputs, then options; shapes come from
//! the tensors. Results are `Result` because device kernels can fail
//! (launch errors); the CPU's cannot. Functions that return a value to the
//! host (loss, norms, finiteness) are the only places where a device step
//! synchronises with the host.

mod cpu;
/// The CUDA arm: kernel sources and their NVRTC compilation, per-device
/// state (stream, library handles, compiled modules) and one function per
/// op (`cuda::ops`).
#[cfg(any(feature = "cuda", feature = "cuda-12"))]
pub mod cuda;
/// The pool scratch the CUDA arm takes per op, and its meta accounting.
pub mod scratch;
mod totals;

pub use totals::{
    StepTotals, Totals, check_finite_add, cross_entropy_add, sum_squares_add, unscale_add,
};

use crate::device::{Capabilities, Device};
use crate::error::{Error, Result};
use crate::ops::conv2d::ConvGeom;
use crate::ops::maxpool::PoolGeom;
#[cfg(any(feature = "cuda", feature = "cuda-12"))]
use crate::profile::Family;
use crate::tensor::{DType, Precision, Tensor};

/// Which pass of a convolution a workspace is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPass {
    Forward,
    /// Input and weight gradient together.
    Backward,
}

/// The workspace a convolution needs on `device`: (element type, elements).
/// The layers allocate it from the pool, so it is counted like any tensor;
/// a meta device answers as its target would. On CUDA it is cuDNN's exact
/// answer for the algorithm chosen for the geometry, and an error when a
/// GPU that is here cannot size it.
pub fn conv2d_workspace(device: Device, g: &ConvGeom, pass: ConvPass) -> Result<(DType, usize)> {
    conv2d_workspace_for(device, g, pass, DType::F32, DType::F32, Precision::F32)
}

/// [`conv2d_workspace`] for an input stored as `input` and a forward
/// output stored as `output`, in precision `p`. On the CPU a bf16 input is
/// widened tile by tile when the GEMM is f32 (a pointwise convolution
/// needs workspace for that), and a bf16 output is computed one f32 tile of
/// rows at a time.
pub fn conv2d_workspace_for(
    device: Device,
    g: &ConvGeom,
    pass: ConvPass,
    input: DType,
    output: DType,
    p: Precision,
) -> Result<(DType, usize)> {
    match device.target() {
        crate::device::Target::Cpu => {
            let widens = ConvGeom::widens(input, p.gemm_math());
            Ok(match pass {
                ConvPass::Forward => {
                    let out = if output == DType::BF16 {
                        g.output_tile_len()
                    } else {
                        0
                    };
                    (DType::F32, g.forward_workspace_len_for(widens) + out)
                }
                ConvPass::Backward => (DType::F32, g.backward_workspace_len_for(widens)),
            })
        }
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        crate::device::Target::Cuda(n) => cuda::ops::conv2d_workspace(n, g, pass, input, output, p),
    }
}

/// A CUDA arm's host time under `--profile`: what the call takes to
/// enqueue its work, no synchronisation (see `profile::Family`).
#[cfg(any(feature = "cuda", feature = "cuda-12"))]
fn host_timed<R>(family: Family, work: impl FnOnce() -> R) -> R {
    crate::profile::timed(family, 0, work)
}

thread_local! {
    static HOST_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times backend calls on this thread have returned a device's
/// value to the host: each one waits for all the work queued before it.
/// Counted on a CUDA device and on a meta device standing for one (what
/// the CUDA arm would read), so a test on the CPU can hold a training step
/// to its one read; the CPU's values are on the host already.
pub fn host_reads() -> u64 {
    HOST_READS.with(std::cell::Cell::get)
}

/// Counts one read from `device` in [`host_reads`], unless it is the CPU.
fn note_host_read(device: Device) {
    if device.target() != crate::device::Target::Cpu {
        HOST_READS.with(|c| c.set(c.get() + 1));
    }
}

/// What `t`'s device can do.
pub fn capabilities(t: &Tensor) -> Capabilities {
    t.device().capabilities()
}

// ---------------------------------------------------------------------------
// Convolution

/// `y (n,oh,ow,cout) = conv(x (n,h,w,cin), w (kh,kw,cin,cout))` in the
/// arithmetic of `p`. `x` is f32, or bf16 where the device reads it in
/// place (see `Conv::reads_in_place`); `w` is already rounded to `p` unless
/// the device rounds operands itself. A bf16 convolution returns `y`
/// rounded to bf16, or stored in bf16 where the device reads bf16
/// (`Capabilities::reads_bf16`: the layer allocates `y` so).
pub fn conv2d_forward(
    y: &mut Tensor,
    x: &Tensor,
    w: &Tensor,
    g: &ConvGeom,
    ws: &mut Tensor,
    p: Precision,
) -> Result<()> {
    match y.device() {
        Device::Cpu => cpu::conv2d_forward(y, x, w, g, ws, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::ConvForward, || {
            cuda::ops::conv2d_forward(y, x, w, g, ws, p)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// Accumulates the weight gradient into `dw` and adds the input gradient
/// into `dx` when given (accumulating, for residual fan-in). A bf16
/// convolution returns `dx` rounded to bf16.
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
    match dw.device() {
        Device::Cpu => cpu::conv2d_backward(dx, dw, dy, x, w, g, ws, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => cuda::ops::conv2d_backward(dx, dw, dy, x, w, g, ws, p)?,
        Device::Meta(_) => {}
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Batch norm (x: (rows, c); statistics (c) in f32)

/// Batch mean, biased variance and `rstd = 1/sqrt(var + eps)` of f32 `x`.
pub fn bn_batch_stats(
    mean: &mut Tensor,
    var: &mut Tensor,
    rstd: &mut Tensor,
    x: &Tensor,
    eps: f32,
) -> Result<()> {
    match mean.device() {
        Device::Cpu => cpu::bn_batch_stats(mean, var, rstd, x, eps),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::BatchNorm, || {
            cuda::ops::bn_batch_stats(mean, var, rstd, x, eps)
        })?,
        Device::Meta(_) => scratch::count_on_meta(
            x,
            &[scratch::bn_partial(
                x.numel().checked_div(mean.numel()).unwrap_or(0),
                mean.numel(),
            )],
        )?,
    }
    Ok(())
}

/// Running statistics move towards the batch's (momentum, unbiased
/// variance over `rows`).
pub fn bn_update_running(
    running_mean: &mut Tensor,
    running_var: &mut Tensor,
    mean: &Tensor,
    var: &Tensor,
    rows: usize,
    momentum: f32,
) -> Result<()> {
    match running_mean.device() {
        Device::Cpu => cpu::bn_update_running(running_mean, running_var, mean, var, rows, momentum),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::BatchNorm, || {
            cuda::ops::bn_update_running(running_mean, running_var, mean, var, rows, momentum)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// The statistics of the running estimates: `mean = running_mean`,
/// `rstd = 1/sqrt(running_var + eps)`.
pub fn bn_running_stats(
    mean: &mut Tensor,
    rstd: &mut Tensor,
    running_mean: &Tensor,
    running_var: &Tensor,
    eps: f32,
) -> Result<()> {
    match mean.device() {
        Device::Cpu => cpu::bn_running_stats(mean, rstd, running_mean, running_var, eps),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::BatchNorm, || {
            cuda::ops::bn_running_stats(mean, rstd, running_mean, running_var, eps)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `y = (x - mean)·rstd·gamma + beta`, then ReLU when `relu`. `x` is f32 or
/// bf16 (read in place); `y` is f32 (rounded to `p`) or bf16.
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
    match y.device() {
        Device::Cpu => cpu::bn_forward(y, x, mean, rstd, gamma, beta, relu, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::BatchNorm, || {
            cuda::ops::bn_forward(y, x, mean, rstd, gamma, beta, relu, p)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// [`bn_forward`] of an f32 `x` that also writes `x_low`, the bf16 copy of
/// `x` the backward keeps, in the same pass.
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
    match y.device() {
        Device::Cpu => cpu::bn_forward_keep_x(y, x_low, x, mean, rstd, gamma, beta, relu, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::BatchNorm, || {
            cuda::ops::bn_forward_keep_x(y, x_low, x, mean, rstd, gamma, beta, relu, p)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// The gradients of a BN forward. `dx` is overwritten (rounded to `p`);
/// `dgamma`, `dbeta` accumulate when given (not under frozen BN). `x` and
/// `relu_out` (the forward's output when a ReLU followed) are f32 or bf16.
/// `batch_stats`: the statistics came from the batch, so the gradient
/// flows through them.
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
    match dx.device() {
        Device::Cpu => cpu::bn_backward(
            dx,
            dgamma,
            dbeta,
            dy,
            x,
            mean,
            rstd,
            gamma,
            relu_out,
            batch_stats,
            p,
        ),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::BatchNorm, || {
            cuda::ops::bn_backward(
                dx,
                dgamma,
                dbeta,
                dy,
                x,
                mean,
                rstd,
                gamma,
                relu_out,
                batch_stats,
                p,
            )
        })?,
        Device::Meta(_) => {
            let (c, rows) = (
                mean.numel(),
                dx.numel().checked_div(mean.numel()).unwrap_or(0),
            );
            scratch::count_on_meta(dx, &[scratch::bn_partial(rows, c), scratch::bn_coefs(c)])?
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// ReLU, residual add, pooling, linear

/// `z = relu(z + residual)` (rounded to `p`), `mask` = one bit per element,
/// set where the output is positive. `residual` is f32 or bf16.
pub fn add_relu_forward(
    z: &mut Tensor,
    residual: &Tensor,
    mask: &mut Tensor,
    p: Precision,
) -> Result<()> {
    match z.device() {
        Device::Cpu => cpu::add_relu_forward(z, residual, mask, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Add, || {
            cuda::ops::add_relu_forward(z, residual, mask, p)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `acc += x`, rounded to `p`.
pub fn add_assign(acc: &mut Tensor, x: &Tensor, p: Precision) -> Result<()> {
    match acc.device() {
        Device::Cpu => cpu::add_assign(acc, x, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Add, || cuda::ops::add_assign(acc, x, p))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `x = relu(x)` in place; `mask` = one bit per element, set where x > 0.
pub fn relu_mask_forward(x: &mut Tensor, mask: &mut Tensor) -> Result<()> {
    match x.device() {
        Device::Cpu => cpu::relu_mask_forward(x, mask),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Relu, || cuda::ops::relu_mask_forward(x, mask))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `d = d · mask` in place (the ReLU backward from its bit mask).
pub fn relu_mask_backward_inplace(d: &mut Tensor, mask: &Tensor) -> Result<()> {
    match d.device() {
        Device::Cpu => cpu::relu_mask_backward_inplace(d, mask),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Relu, || {
            cuda::ops::relu_mask_backward_inplace(d, mask)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// Max pooling of f32 `x` into `y` (geometry `g`).
pub fn maxpool_forward(y: &mut Tensor, x: &Tensor, g: &PoolGeom) -> Result<()> {
    match y.device() {
        Device::Cpu => cpu::maxpool_forward(y, x, g),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Pool, || cuda::ops::maxpool_forward(y, x, g))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `dx` (overwritten, rounded to `p`) of a max pooling of `x`.
pub fn maxpool_backward(
    dx: &mut Tensor,
    dy: &Tensor,
    x: &Tensor,
    g: &PoolGeom,
    p: Precision,
) -> Result<()> {
    match dx.device() {
        Device::Cpu => cpu::maxpool_backward(dx, dy, x, g, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Pool, || {
            cuda::ops::maxpool_backward(dx, dy, x, g, p)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// Global average pooling: `y (n,c)` of f32 `x (n,h,w,c)`, rounded to `p`.
pub fn avgpool_forward(y: &mut Tensor, x: &Tensor, p: Precision) -> Result<()> {
    match y.device() {
        Device::Cpu => cpu::avgpool_forward(y, x, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Pool, || cuda::ops::avgpool_forward(y, x, p))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `dx (n,h,w,c)` (overwritten, rounded to `p`) of a global average pooling.
pub fn avgpool_backward(dx: &mut Tensor, dy: &Tensor, p: Precision) -> Result<()> {
    match dx.device() {
        Device::Cpu => cpu::avgpool_backward(dx, dy, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Pool, || cuda::ops::avgpool_backward(dx, dy, p))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `y (n,out) = x (n,in) · wᵀ + b`, rounded to `p` (`w` already rounded).
pub fn linear_forward(
    y: &mut Tensor,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    p: Precision,
) -> Result<()> {
    match y.device() {
        Device::Cpu => cpu::linear_forward(y, x, w, b, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Linear, || cuda::ops::linear_forward(y, x, w, b, p))?,
        Device::Meta(_) => scratch::count_on_meta(y, &[scratch::cublas_workspace_for(y)])?,
    }
    Ok(())
}

/// `dw += dyᵀ·x`, `db += Σ dy`, `dx = dy·w` (overwritten, rounded to `p`).
pub fn linear_backward(
    dx: &mut Tensor,
    dw: &mut Tensor,
    db: &mut Tensor,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    p: Precision,
) -> Result<()> {
    match dx.device() {
        Device::Cpu => cpu::linear_backward(dx, dw, db, dy, x, w, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Linear, || {
            cuda::ops::linear_backward(dx, dw, db, dy, x, w, p)
        })?,
        Device::Meta(_) => scratch::count_on_meta(dx, &[scratch::cublas_workspace_for(dx)])?,
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Loss

/// What the loss returns to the host: the batch's mean loss and how many
/// rows' top-1 prediction is the label (zero on the meta device).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossOutput {
    pub loss: f64,
    pub correct: usize,
}

/// Softmax cross-entropy of `logits (n, classes)` against `labels` (label
/// smoothing `smoothing`), writing `d_logits` as the gradient of the summed
/// loss divided by `divisor` samples, times `scale` when given (the loss
/// scaler), rounded to `p` (the gradient reaching a low-type linear).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy(
    d_logits: &mut Tensor,
    logits: &Tensor,
    labels: &[usize],
    smoothing: f32,
    divisor: usize,
    scale: Option<f32>,
    p: Precision,
) -> Result<LossOutput> {
    let mut totals = StepTotals::for_op(d_logits)?;
    cross_entropy_add(
        &mut totals,
        d_logits,
        logits,
        labels,
        smoothing,
        divisor,
        scale,
        p,
        None,
    )?;
    let t = totals.read()?;
    Ok(LossOutput {
        loss: t.loss,
        correct: t.correct,
    })
}

// ---------------------------------------------------------------------------
// Precision: rounding and conversions

/// Rounds every value of f32 `t` to the nearest value of `p` (no-op for fp32).
pub fn round(t: &mut Tensor, p: Precision) -> Result<()> {
    match t.device() {
        Device::Cpu => cpu::round(t, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Copies, || cuda::ops::round(t, p))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `dst` (f32) = `src` (f32, bf16 or f16), exactly.
pub fn widen(dst: &mut Tensor, src: &Tensor) -> Result<()> {
    match dst.device() {
        Device::Cpu => cpu::widen(dst, src),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Copies, || cuda::ops::widen(dst, src))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `dst` (bf16 or f16) = `src` (f32 values already representable in it).
pub fn narrow(dst: &mut Tensor, src: &Tensor) -> Result<()> {
    match dst.device() {
        Device::Cpu => cpu::narrow(dst, src),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Copies, || cuda::ops::narrow(dst, src))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `dst = round(src, p)`, both f32.
pub fn copy_rounded(dst: &mut Tensor, src: &Tensor, p: Precision) -> Result<()> {
    match dst.device() {
        Device::Cpu => cpu::copy_rounded(dst, src, p),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Copies, || cuda::ops::copy_rounded(dst, src, p))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Optimizer updates and gradient checks (one parameter tensor per call)

/// One SGD step on `value` (PyTorch semantics; `momentum_buf` is None when
/// momentum is 0; `first` initialises it with the gradient).
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
    match value.device() {
        Device::Cpu => cpu::sgd_update(
            value,
            grad,
            momentum_buf,
            first,
            lr,
            momentum,
            weight_decay,
            nesterov,
        ),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Optimizer, || {
            cuda::ops::sgd_update(
                value,
                grad,
                momentum_buf,
                first,
                lr,
                momentum,
                weight_decay,
                nesterov,
            )
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// One AdamW step on `value` at step `t` (1-based).
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
    match value.device() {
        Device::Cpu => cpu::adamw_update(
            value,
            grad,
            exp_avg,
            exp_avg_sq,
            t,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        ),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Optimizer, || {
            cuda::ops::adamw_update(
                value,
                grad,
                exp_avg,
                exp_avg_sq,
                t,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            )
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// Σ x² of f32 `t`, summed in f64 in index order (a gradient norm's part):
/// [`sum_squares_add`] into totals of its own, read at once.
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    let mut totals = StepTotals::for_op(t)?;
    sum_squares_add(&mut totals, t)?;
    Ok(totals.read()?.sum_squares)
}

/// `t *= c`.
pub fn scale(t: &mut Tensor, c: f32) -> Result<()> {
    match t.device() {
        Device::Cpu => cpu::scale(t, c),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Optimizer, || cuda::ops::scale(t, c))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// The scaler's unscale: `t *= inv`, and whether any result is inf or NaN
/// ([`unscale_add`] into totals of its own, read at once).
pub fn unscale(t: &mut Tensor, inv: f32) -> Result<bool> {
    let mut totals = StepTotals::for_op(t)?;
    unscale_add(&mut totals, t, inv)?;
    Ok(totals.read()?.non_finite)
}

/// Whether every value of f32 `t` is finite ([`check_finite_add`] into
/// totals of its own, read at once).
pub fn all_finite(t: &Tensor) -> Result<bool> {
    let mut totals = StepTotals::for_op(t)?;
    check_finite_add(&mut totals, t)?;
    Ok(!totals.read()?.non_finite)
}

// ---------------------------------------------------------------------------
// Copies between the host and a device, and synchronisation

/// Writes host values into f32 `t` (nothing on the meta device).
pub fn copy_from_host(t: &mut Tensor, values: &[f32]) -> Result<()> {
    if values.len() != t.numel() {
        return Err(Error::ShapeMismatch {
            op: "copy_from_host",
            expected: format!("{} values for {:?}", t.numel(), t.dims()),
            got: values.len().to_string(),
        });
    }
    match t.device() {
        Device::Cpu => cpu::copy_from_host(t, values),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Copies, || cuda::ops::copy_from_host(t, values))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// Writes the values of f32 `t` into the host slice `dst` (zeros on the
/// meta device), so a caller that copies every step can reuse its buffer.
pub fn copy_to_host_into(dst: &mut [f32], t: &Tensor) -> Result<()> {
    if dst.len() != t.numel() {
        return Err(Error::ShapeMismatch {
            op: "copy_to_host",
            expected: format!("{} values for {:?}", t.numel(), t.dims()),
            got: dst.len().to_string(),
        });
    }
    note_host_read(t.device());
    match t.device() {
        Device::Cpu => cpu::copy_to_host_into(dst, t),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => {
            host_timed(Family::DeviceReads, || cuda::ops::copy_to_host_into(dst, t))?
        }
        Device::Meta(_) => dst.fill(0.0),
    }
    Ok(())
}

/// The values of f32 `t` on the host (zeros on the meta device).
pub fn copy_to_host(t: &Tensor) -> Result<Vec<f32>> {
    let mut out = vec![0.0; t.numel()];
    copy_to_host_into(&mut out, t)?;
    Ok(out)
}

/// `dst = src` for two f32 tensors of the same length.
pub fn copy(dst: &mut Tensor, src: &Tensor) -> Result<()> {
    match dst.device() {
        Device::Cpu => cpu::copy(dst, src),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Copies, || cuda::ops::copy(dst, src))?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `dst[dst_at..dst_at + len] = src[src_at..src_at + len]` for two f32
/// tensors (elements): how gradients are packed into and unpacked from the
/// data-parallel all-reduce buckets.
pub fn copy_range(
    dst: &mut Tensor,
    dst_at: usize,
    src: &Tensor,
    src_at: usize,
    len: usize,
) -> Result<()> {
    if dst_at + len > dst.numel() || src_at + len > src.numel() {
        return Err(Error::ShapeMismatch {
            op: "copy_range",
            expected: format!(
                "{len} values within {} ({}) and {} ({})",
                dst.tag(),
                dst.numel(),
                src.tag(),
                src.numel()
            ),
            got: format!("offsets {dst_at} and {src_at}"),
        });
    }
    match dst.device() {
        Device::Cpu => cpu::copy_range(dst, dst_at, src, src_at, len),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => host_timed(Family::Copies, || {
            cuda::ops::copy_range(dst, dst_at, src, src_at, len)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// `recv[..len]` = the sum over every rank of `comm` of its `send[..len]`
/// (f32 tensors; data-parallel gradient buckets). On the CPU the
/// collective reads and writes the pool's bytes in place; on the meta
/// device nothing moves (a plan only counts the buckets). On CUDA,
/// NCCL sums on the device's stream (feature `nccl`; without it an error,
/// refused before training starts).
pub fn all_reduce_sum(
    comm: &dyn crate::dist::Collective,
    recv: &mut Tensor,
    send: &Tensor,
    len: usize,
) -> Result<()> {
    if len > send.numel() || len > recv.numel() {
        return Err(Error::ShapeMismatch {
            op: "all_reduce_sum",
            expected: format!("at most {} values", send.numel().min(recv.numel())),
            got: len.to_string(),
        });
    }
    match recv.device() {
        Device::Cpu => cpu::all_reduce_sum(comm, recv, send, len),
        #[cfg(feature = "nccl")]
        Device::Cuda(_) => cuda::nccl::all_reduce_sum(comm, recv, send, len),
        #[cfg(all(any(feature = "cuda", feature = "cuda-12"), not(feature = "nccl")))]
        Device::Cuda(_) => Err(Error::invalid(
            "data-parallel training",
            "summing gradients on a CUDA device needs NCCL: rebuild with --features nccl",
        )),
        Device::Meta(_) => Ok(()),
    }
}

/// Waits until every kernel queued on `device` has finished (the CPU's run
/// synchronously: nothing to wait for).
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cpu | Device::Meta(_) => Ok(()),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(n) => cuda::ops::synchronize(n),
    }
}
