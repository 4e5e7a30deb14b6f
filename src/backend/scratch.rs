//! The pool scratch the CUDA arm takes inside an op ([`Tensor::scratch`]),
//! in bytes, as plain arithmetic on the op's shape: the CUDA arm allocates
//! these, and a meta device standing in for a CUDA device allocates the
//! same (and drops them) so a plan counts them in its peak. Built in every
//! configuration so the meta accounting does not depend on the feature.
//!
//! [`Tensor::scratch`]: crate::tensor::Tensor::scratch

use crate::error::Result;
use crate::tensor::Tensor;

/// `BN_CHUNK_ROWS` of kernels/batchnorm.cu (== `ops::REDUCE_CHUNK_ROWS`).
pub const BN_CHUNK_ROWS: usize = 512;
/// `SQ_CHUNK` of kernels/reduce.cu.
pub const SQ_CHUNK: usize = 8192;

/// BN chunk partial sums: (ceil(rows / BN_CHUNK_ROWS), 2, c) f64.
pub fn bn_partial(rows: usize, c: usize) -> usize {
    rows.div_ceil(BN_CHUNK_ROWS) * 2 * c * 8
}

/// BN backward's per-channel coefficients: (3, c) f32.
pub fn bn_coefs(c: usize) -> usize {
    3 * c * 4
}

fn a16(b: usize) -> usize {
    b.next_multiple_of(16)
}

/// Cross-entropy over `n` rows: labels (i32), per-row losses (f64) and
/// per-row hits (i32), each region starting on 16 bytes (the loss and the
/// count go to a [`STEP_TOTALS`]). Offsets: see [`cross_entropy_offsets`].
pub fn cross_entropy(n: usize) -> usize {
    if n == 0 {
        return 0; // nothing to compute, nothing taken
    }
    a16(4 * n) + a16(8 * n) + a16(4 * n)
}

/// Byte offsets of (labels, row losses, row hits) in [`cross_entropy`]'s
/// scratch.
pub fn cross_entropy_offsets(n: usize) -> (usize, usize, usize) {
    let row_loss = a16(4 * n);
    (0, row_loss, row_loss + a16(8 * n))
}

/// Sum of squares over `n` values added into totals: the block partials
/// (f64).
pub fn sum_squares_partials(n: usize) -> usize {
    n.div_ceil(SQ_CHUNK) * 8
}

/// What one optimizer step returns to the host, accumulated on the device
/// ([`crate::backend::StepTotals`]): f64 loss at [`TOTALS_LOSS`], f64 sum
/// of squares at [`TOTALS_SUM_SQUARES`], i32 correct count at
/// [`TOTALS_CORRECT`], i32 non-finite flag at [`TOTALS_FLAG`]; held for
/// the whole step and read once.
pub const STEP_TOTALS: usize = 24;
pub const TOTALS_LOSS: usize = 0;
pub const TOTALS_SUM_SQUARES: usize = 8;
pub const TOTALS_CORRECT: usize = 16;
pub const TOTALS_FLAG: usize = 20;

/// Alignment cuBLAS asks of a workspace it is given (bytes).
pub const CUBLAS_ALIGN: usize = 256;

/// cuBLAS's workspace for the linear layer's GEMMs on a GPU of compute
/// capability `cc`, taken from the pool (so the tracked peak holds it) and
/// set on the handle before each call: the size cuBLAS gives its own
/// default workspace (32 MiB from Hopper on, 4 MiB before), plus
/// [`CUBLAS_ALIGN`] to align it inside pool memory.
pub fn cublas_workspace(cc: (u32, u32)) -> usize {
    let mib = if cc.0 >= 9 { 32 } else { 4 };
    (mib << 20) + CUBLAS_ALIGN
}

/// [`cublas_workspace`] for `t`'s device (a CUDA device, or a meta device
/// standing for one; 0 for the CPU, which has none).
pub fn cublas_workspace_for(t: &Tensor) -> usize {
    match t.device().target() {
        crate::device::Target::Cpu => 0,
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        crate::device::Target::Cuda(n) => {
            cublas_workspace(crate::device::cuda::device_facts(n).compute_capability)
        }
    }
}

/// On a meta device standing in for a CUDA device: allocates scratch of
/// each size in `bytes` (all live at once, as in the CUDA arm) from `t`'s
/// pool and drops them, so the plan's peak holds them. Nothing for any
/// other device.
pub fn count_on_meta(t: &Tensor, bytes: &[usize]) -> Result<()> {
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    if let crate::device::Device::Meta(crate::device::Target::Cuda(_)) = t.device() {
        let tag = || crate::accounting::Tag::fixed("cuda op scratch");
        let held = bytes
            .iter()
            .map(|&b| t.scratch(b, tag(), false))
            .collect::<Result<Vec<_>>>()?;
        drop(held);
    }
    #[cfg(not(any(feature = "cuda", feature = "cuda-12")))]
    let _ = (t, bytes);
    Ok(())
}
