//! Kernels with explicit forward and backward passes on NHWC slices.
//!
//! Conventions (one file per op, each with a naive f64 `*_ref` beside the
//! fast kernel and tests against it and against finite differences):
//! * outputs come first in a signature, then inputs, then geometry;
//! * parameter gradients always accumulate (`+=`), so gradient accumulation
//!   over micro-batches is free; input gradients are overwritten unless the
//!   doc says they accumulate (conv dgrad does, for residual fan-in);
//! * kernels never allocate tensors: callers pass workspaces sized by the
//!   op's `*_workspace_len`, so every byte is visible to the pool;
//! * reductions run over fixed-size chunks combined in a fixed order, so
//!   results do not depend on the number of threads.

pub mod add;
pub mod avgpool;
pub mod batchnorm;
pub mod conv2d;
pub mod cross_entropy;
pub mod linear;
pub mod maxpool;
pub mod optim_update;
pub mod relu;

#[cfg(test)]
pub(crate) mod testutil;

/// An element a kernel reads as f32: f32 itself, or bf16 (an activation as
/// the bf16 mode stores it, widened exactly in registers: the bits an f32
/// copy would hold).
pub trait ReadF32: Copy + Send + Sync {
    fn f32(self) -> f32;
}

impl ReadF32 for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl ReadF32 for half::bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        crate::device::cpu::bf16_bits_to_f32(self.to_bits())
    }
}

/// How a kernel finishes each chunk of its output while the chunk is still
/// in cache: the mixed-precision rounding (`Precision::chunk_round` in
/// `nn`), or nothing under fp32. Rounding is elementwise, so rounding chunk
/// by chunk gives the bits a separate pass over the whole output would,
/// without reading and writing the output a second time.
pub type RoundChunk = Option<fn(&mut [f32])>;

/// Rows per chunk for per-channel reductions: fixed, so the summation order
/// (and therefore the result) is the same whatever the thread count.
pub(crate) const REDUCE_CHUNK_ROWS: usize = 512;
