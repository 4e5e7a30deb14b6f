//! Optional time per op family, for `memfit bench step --profile`: where a
//! step's time goes and the GFLOP/s each convolution pass reaches, so the
//! gap to the machine's GEMM peak is visible; on CUDA the host time each
//! family's calls take to enqueue their work, so launch overhead is
//! visible. Off by default; when off a timed region costs one relaxed
//! atomic load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The op families a step's time is split into ("other" is the rest).
/// On the CPU only the first four are timed (the kernels run in the
/// call). On CUDA every backend op is timed, as *host* time: the time the
/// call takes to enqueue its work on the stream (descriptor lookups,
/// argument packing, the launch itself), without synchronising per op, so
/// launch overhead is visible beside the step time; a read from the
/// device waits for everything queued before it, so reads are a family of
/// their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Convolution forward (im2col + GEMM; on CUDA: the weight transpose
    /// and the cuDNN call).
    ConvForward,
    /// Convolution input gradient (GEMM + col2im).
    ConvDgrad,
    /// Convolution weight gradient (im2col + GEMM).
    ConvWgrad,
    /// Batch norm forward, backward and statistics.
    BatchNorm,
    /// ReLU masks forward and backward (CUDA only).
    Relu,
    /// Residual add (+ReLU) and gradient accumulation (CUDA only).
    Add,
    /// Max and average pooling forward and backward (CUDA only).
    Pool,
    /// The linear layer, forward and backward (CUDA only).
    Linear,
    /// Cross-entropy into the step totals (CUDA only).
    Loss,
    /// SGD/AdamW updates, scaling, unscale, finite checks and norms
    /// (CUDA only).
    Optimizer,
    /// Rounding, widening/narrowing, device-to-device and host-to-device
    /// copies (CUDA only).
    Copies,
    /// Reads from the device (the step totals, copies to the host): each
    /// waits for the work queued before it (CUDA only).
    DeviceReads,
}

impl Family {
    pub const ALL: [Family; 12] = [
        Family::ConvForward,
        Family::ConvDgrad,
        Family::ConvWgrad,
        Family::BatchNorm,
        Family::Relu,
        Family::Add,
        Family::Pool,
        Family::Linear,
        Family::Loss,
        Family::Optimizer,
        Family::Copies,
        Family::DeviceReads,
    ];

    /// The families the CPU times (the rest are timed on CUDA only).
    pub const CPU: [Family; 4] = [
        Family::ConvForward,
        Family::ConvDgrad,
        Family::ConvWgrad,
        Family::BatchNorm,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Family::ConvForward => "conv fwd",
            Family::ConvDgrad => "conv dgrad",
            Family::ConvWgrad => "conv wgrad",
            Family::BatchNorm => "batch norm",
            Family::Relu => "relu",
            Family::Add => "add",
            Family::Pool => "pool",
            Family::Linear => "linear",
            Family::Loss => "loss",
            Family::Optimizer => "optimizer",
            Family::Copies => "copies",
            Family::DeviceReads => "device reads (wait)",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

const N: usize = Family::ALL.len();

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static FLOPS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static CALLS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

/// Turns timing on or off and clears the counters.
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
    reset();
}

pub fn reset() {
    for i in 0..N {
        NANOS[i].store(0, Ordering::Relaxed);
        FLOPS[i].store(0, Ordering::Relaxed);
        CALLS[i].store(0, Ordering::Relaxed);
    }
}

/// Runs `work`, adding its wall time, `flops` and one call to `family`
/// when enabled. A timed region inside another of the same family counts
/// twice: the callers time disjoint regions.
#[inline]
pub fn timed<R>(family: Family, flops: u64, work: impl FnOnce() -> R) -> R {
    if !ON.load(Ordering::Relaxed) {
        return work();
    }
    let t = Instant::now();
    let r = work();
    let i = family.index();
    NANOS[i].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    FLOPS[i].fetch_add(flops, Ordering::Relaxed);
    CALLS[i].fetch_add(1, Ordering::Relaxed);
    r
}

/// What one family accumulated since the last reset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FamilyTotal {
    pub family: Family,
    pub seconds: f64,
    pub flops: f64,
    /// Timed calls (on CUDA: host calls that enqueue work).
    pub calls: u64,
}

/// Every family's totals since the last reset, in [`Family::ALL`] order.
pub fn totals() -> Vec<FamilyTotal> {
    Family::ALL
        .iter()
        .map(|&f| {
            let i = f.index();
            FamilyTotal {
                family: f,
                seconds: NANOS[i].load(Ordering::Relaxed) as f64 * 1e-9,
                flops: FLOPS[i].load(Ordering::Relaxed) as f64,
                calls: CALLS[i].load(Ordering::Relaxed),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_regions_add_up_only_when_enabled() {
        // Other tests may run convolutions concurrently, so only lower bounds
        // on this family's counters are asserted while timing is on.
        enable(false);
        timed(Family::BatchNorm, 1_000, || ());
        assert_eq!(totals()[Family::BatchNorm.index()].flops, 0.0);
        enable(true);
        let v = timed(Family::BatchNorm, 1_000, || {
            std::thread::sleep(std::time::Duration::from_millis(2));
            7
        });
        assert_eq!(v, 7);
        let t = totals()[Family::BatchNorm.index()];
        enable(false);
        assert_eq!(t.family, Family::BatchNorm);
        assert!(t.seconds >= 0.002, "{}", t.seconds);
        assert!(t.flops >= 1_000.0, "{}", t.flops);
        assert!(t.calls >= 1, "{}", t.calls);
    }
}
