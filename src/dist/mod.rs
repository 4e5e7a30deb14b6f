//! Collectives for data-parallel training across processes: the small
//! interface the training step uses ([`Collective`]), a single-process
//! implementation that is always compiled ([`Single`], every call a no-op)
//! and, under the `mpi` feature, one on MPI through the `mpi` crate (rsmpi,
//! Open MPI or MPICH) in [`mpi`].
//!
//! What a distributed run synchronises (see `src/train/dist.rs`): rank 0's
//! initial weights, the gradients once per optimizer step (summed in fixed
//! buckets in visit order), the loss/accuracy sums and non-finite flags,
//! and rank 0's BN running statistics after each step. Everything else is
//! per process: the memory pool and budget, BN batch statistics, loaders.

use std::rc::Rc;

use crate::error::{Error, Result};

#[cfg(feature = "mpi")]
pub mod mpi;

/// Gradients are summed in buckets of this many bytes (as PyTorch DDP's
/// 25 MB), always cut at the same offsets of the flat gradient, so a sum
/// never depends on timing.
pub const BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// The collectives a data-parallel step needs. Every rank must make the
/// same calls in the same order with buffers of the same length.
pub trait Collective {
    /// This process's rank, 0-based.
    fn rank(&self) -> usize;
    /// Processes in the run.
    fn size(&self) -> usize;
    /// Replaces `buf` on every rank by rank 0's.
    fn broadcast_f32(&self, buf: &mut [f32]) -> Result<()>;
    /// `recv` = the element-wise sum of every rank's `send` (same lengths).
    fn sum_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<()>;
    /// As [`Collective::sum_f32`] for f64 (small reports: loss, counts,
    /// flags).
    fn sum_f64(&self, send: &[f64], recv: &mut [f64]) -> Result<()>;
    /// Whether every rank passed the same `v` (a configuration hash).
    fn all_equal(&self, v: u64) -> Result<bool>;
    /// Waits for every rank.
    fn barrier(&self) -> Result<()>;
    /// Whether this is rank 0, the one that prints and writes files.
    fn is_root(&self) -> bool {
        self.rank() == 0
    }
}

/// One process: rank 0 of 1; every collective leaves its buffer as it is.
#[derive(Clone, Copy, Debug, Default)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn broadcast_f32(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn sum_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn sum_f64(&self, send: &[f64], recv: &mut [f64]) -> Result<()> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_equal(&self, _v: u64) -> Result<bool> {
        Ok(true)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

/// The world this process runs in: MPI's when built with `mpi` and
/// launched by `mpirun`/`srun` (or run alone: a singleton world of one),
/// otherwise [`Single`]. Call once per process.
pub fn world() -> Result<Rc<dyn Collective>> {
    #[cfg(feature = "mpi")]
    {
        Ok(Rc::new(mpi::Mpi::init()?))
    }
    #[cfg(not(feature = "mpi"))]
    {
        Ok(Rc::new(Single))
    }
}

/// Ends every rank with the same clear error when the ranks' configuration
/// fingerprints differ (never a hang: every rank takes part in the one
/// comparison and then all fail together).
pub fn check_same_config(comm: &dyn Collective, fingerprint: &str) -> Result<()> {
    // FNV-1a: stable across processes and builds.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in fingerprint.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    if comm.all_equal(h)? {
        Ok(())
    } else {
        Err(Error::invalid(
            "distributed run",
            format!(
                "the {} ranks were started with different configurations (rank {} has {fingerprint}); start every rank with the same flags",
                comm.size(),
                comm.rank()
            ),
        ))
    }
}

/// The half-open range of a window of `n` samples that `rank` of `size`
/// trains on: `[⌈rank·n/size⌉, ⌈(rank+1)·n/size⌉)`. Contiguous, in the
/// window's order, covering it exactly; when `n` is not a multiple of
/// `size` the earlier ranks take the extra samples (rank 0, whose BN
/// running statistics every rank keeps, always has some), and with `n < size`
/// the last
/// ranks get none (they still take part in every collective).
pub fn shard(n: usize, rank: usize, size: usize) -> std::ops::Range<usize> {
    let size = size.max(1);
    (rank * n).div_ceil(size)..((rank + 1) * n).div_ceil(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_window_in_order() {
        for n in 0..20 {
            for size in 1..5 {
                let mut next = 0;
                for r in 0..size {
                    let s = shard(n, r, size);
                    assert_eq!(s.start, next);
                    next = s.end;
                }
                assert_eq!(next, n);
            }
        }
        assert_eq!(shard(10, 0, 3), 0..4);
        assert_eq!(shard(10, 2, 3), 7..10);
        assert_eq!(shard(1, 0, 3), 0..1);
    }

    #[test]
    fn a_single_process_collective_is_the_identity() {
        let c = Single;
        let mut r = [0.0; 2];
        c.sum_f32(&[1.0, 2.0], &mut r).unwrap();
        assert_eq!(r, [1.0, 2.0]);
        assert!(check_same_config(&c, "x").is_ok());
    }
}
