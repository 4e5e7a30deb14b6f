//! Optional time per op family, for `memfit bench step --profile`: where a
//! step's time goes and the GFLOP/s each convolution pass reaches, so the
//! gap to the machine's GEMM peak is visible. Off by default; when off a
//! timed region costs one relaxed atomic load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The op families a step's time is split into ("other" is the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Convolution forward (im2col + GEMM).
    ConvForward,
    /// Convolution input gradient (GEMM + col2im).
    ConvDgrad,
    /// Convolution weight gradient (im2col + GEMM).
    ConvWgrad,
    /// Batch norm forward, backward and statistics.
    BatchNorm,
}

impl Family {
    pub const ALL: [Family; 4] = [
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
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];
static FLOPS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Turns timing on or off and clears the counters.
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
    reset();
}

pub fn reset() {
    for i in 0..4 {
        NANOS[i].store(0, Ordering::Relaxed);
        FLOPS[i].store(0, Ordering::Relaxed);
    }
}

/// Runs `work`, adding its wall time and `flops` to `family` when enabled.
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
    r
}

/// (family, seconds, flops) accumulated since the last reset.
pub fn totals() -> Vec<(Family, f64, f64)> {
    Family::ALL
        .iter()
        .map(|&f| {
            let i = f.index();
            (
                f,
                NANOS[i].load(Ordering::Relaxed) as f64 * 1e-9,
                FLOPS[i].load(Ordering::Relaxed) as f64,
            )
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
        assert_eq!(totals()[Family::BatchNorm.index()].2, 0.0);
        enable(true);
        let v = timed(Family::BatchNorm, 1_000, || {
            std::thread::sleep(std::time::Duration::from_millis(2));
            7
        });
        assert_eq!(v, 7);
        let (family, seconds, flops) = totals()[Family::BatchNorm.index()];
        enable(false);
        assert_eq!(family, Family::BatchNorm);
        assert!(seconds >= 0.002, "{seconds}");
        assert!(flops >= 1_000.0, "{flops}");
    }
}
