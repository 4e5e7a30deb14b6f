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

/// Elements of each of the two all-reduce buffers (send, receive) for a
/// model with `grad_elements` trainable gradient elements: one bucket, or
/// less for a model smaller than that. They come from the memory pool
/// (category workspace), so a plan counts them.
pub fn bucket_elements(grad_elements: usize) -> usize {
    grad_elements.min(BUCKET_BYTES / std::mem::size_of::<f32>())
}

/// The collectives a data-parallel step needs. Every rank must make the
/// same calls in the same order with buffers of the same length.
pub trait Collective {
    /// This process's rank, 0-based.
    fn rank(&self) -> usize;
    /// Processes in the run.
    fn size(&self) -> usize;
    /// Replaces `buf` on every rank by rank 0's.
    fn broadcast_f32(&self, buf: &mut [f32]) -> Result<()>;
    /// As [`Collective::broadcast_f32`] for bytes (NCCL's unique id).
    fn broadcast_bytes(&self, buf: &mut [u8]) -> Result<()>;
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
    /// Ends every process of the run with exit status `code` (MPI_Abort):
    /// what a process that fails does, so that the others, which may be
    /// waiting in a collective for it, end too instead of hanging.
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
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
    fn broadcast_bytes(&self, _buf: &mut [u8]) -> Result<()> {
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

/// This process's rank among those of the run on its machine, from the
/// launcher's environment (Open MPI, MPICH/Hydra, Slurm): which GPU a
/// process takes when one process per GPU is started with `--device cuda`.
pub fn local_rank() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

/// Seconds [`Watchdog`] waits at start-up unless `MEMFIT_DIST_TIMEOUT`
/// says otherwise.
pub const DEFAULT_START_TIMEOUT_SECS: u64 = 120;

/// `MEMFIT_DIST_TIMEOUT` (whole seconds, at least 1), else
/// [`DEFAULT_START_TIMEOUT_SECS`].
pub fn start_timeout() -> Result<std::time::Duration> {
    let secs = match std::env::var("MEMFIT_DIST_TIMEOUT") {
        Err(_) => DEFAULT_START_TIMEOUT_SECS,
        Ok(v) => v
            .trim()
            .parse()
            .ok()
            .filter(|&s: &u64| s >= 1)
            .ok_or_else(|| {
                Error::Usage(format!(
                    "MEMFIT_DIST_TIMEOUT={v}: expected whole seconds, at least 1"
                ))
            })?,
    };
    Ok(std::time::Duration::from_secs(secs))
}

/// A timeout on the start of a distributed run: MPI's start-up and the
/// first collective wait for every process, for ever if one never comes (it
/// failed to start, or died before MPI started). Unless disarmed within the
/// time, this thread prints what happened and ends the process with status
/// 1, which makes `mpirun`/`srun` end the others.
pub struct Watchdog {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Watchdog {
    /// Starts the clock; `what` names the wait in the message.
    pub fn arm(what: &'static str, timeout: std::time::Duration) -> Watchdog {
        use std::sync::atomic::Ordering;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = done.clone();
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            while start.elapsed() < timeout {
                if flag.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            if !flag.load(Ordering::SeqCst) {
                eprintln!(
                    "error: {what} did not complete within {} s: a process of the run did not start, or died (see the launcher's messages); every process ends. MEMFIT_DIST_TIMEOUT=SECONDS waits longer",
                    timeout.as_secs()
                );
                std::process::exit(1);
            }
        });
        Watchdog { done }
    }

    /// Every process arrived: the clock stops.
    pub fn disarm(self) {
        self.done.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Start-up of a distributed run: MPI's world (under the `mpi` feature)
/// and one collective that every process must reach, both under a
/// [`Watchdog`]; `command_line` (the arguments after the program's name)
/// must be the same on every process.
pub fn start(command_line: &[String]) -> Result<Rc<dyn Collective>> {
    if cfg!(not(feature = "mpi")) {
        return Ok(Rc::new(Single));
    }
    let watchdog = Watchdog::arm("the start of the distributed run", start_timeout()?);
    let comm = world()?;
    if comm.size() > 1 {
        let same = comm.all_equal(fnv1a(command_line.join("\u{1f}").as_bytes()))?;
        if !same {
            return Err(Error::Usage(format!(
                "the {} processes were started with different command lines (this one: {}); start every process with the same arguments",
                comm.size(),
                command_line.join(" ")
            )));
        }
    }
    watchdog.disarm();
    Ok(comm)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    h
}

/// Ends every rank with the same clear error when the ranks' configuration
/// fingerprints differ (never a hang: every rank takes part in the one
/// comparison and then all fail together).
pub fn check_same_config(comm: &dyn Collective, fingerprint: &str) -> Result<()> {
    // FNV-1a: stable across processes and builds.
    if comm.all_equal(fnv1a(fingerprint.as_bytes()))? {
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
