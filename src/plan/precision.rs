//! How fast bf16 runs against fp32 on a target: the cost `--precision auto`
//! weighs beside memory.
//!
//! Under `--time-model measured` the stage times of each precision are
//! timed on this machine and speak for themselves. The FLOPs model counts
//! the same FLOPs in either precision, so there bf16's time is fp32's times
//! the ratio measured for this kind of hardware (medians of `memfit bench
//! step`, ResNet-50 at 128² and 224², batch 16, docs/results.md):
//! - AMX (`tdpbf16ps`): 0.62–0.74 on a 2-core Xeon, taken as 0.68;
//! - AVX512-BF16 (`vdpbf16ps`): 0.69–0.70 on a 2-core EPYC, taken as 0.70;
//! - the f32 GEMM on rounded operands (no bf16 instructions, or a slow
//!   `vdpbf16ps`), plus the rounding passes: 1.04–1.12 on a 2-core Zen 3,
//!   1.03–1.09 on the 2-core Xeon whose `vdpbf16ps` runs at half the FMA's
//!   rate, taken as 1.08;
//! - a GPU with bf16 tensor cores: 0.47, PyTorch's bf16 autocast against
//!   its TF32 fp32 on the H200 (4625 against 2190 img/s at batch 256,
//!   ../shared/gpu/FACTS.md). memfit's own GPU speed has not been measured;
//! - an older GPU (bf16 as fp32 of rounded operands): 1.05.

use crate::device::Target;

/// bf16's step time over fp32's on `target`, and where the figure comes
/// from (for the plan's report).
pub fn bf16_time_ratio(target: Target) -> (f64, String) {
    match target {
        Target::Cpu => {
            use crate::device::cpu::{Bf16Path, bf16_path_kind};
            let path = bf16_path_kind();
            let ratio = match path {
                Bf16Path::Amx => 0.68,
                Bf16Path::Avx512Bf16 => 0.70,
                Bf16Path::F32 => 1.08,
            };
            (
                ratio,
                format!(
                    "measured on CPUs with this CPU's bf16 path, {}",
                    path.describe()
                ),
            )
        }
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Target::Cuda(n) => {
            if crate::device::Capabilities::cuda(n).reads_bf16 {
                (
                    0.47,
                    format!(
                        "PyTorch's bf16 autocast against TF32 on an H200; cuda:{n} has bf16 tensor \
                         cores (memfit's GPU speed is not measured yet)"
                    ),
                )
            } else {
                (
                    1.05,
                    format!(
                        "cuda:{n} has no bf16 tensor cores: bf16 runs as fp32 of rounded operands"
                    ),
                )
            }
        }
    }
}

/// Modelled seconds per image of a step: one forward and backward of each
/// micro-batch plus its recomputation, at fp32's rates times `ratio`.
pub fn seconds_per_image(
    step_seconds: f64,
    recompute_seconds: f64,
    micro_batch: usize,
    ratio: f64,
) -> f64 {
    ratio * (step_seconds + recompute_seconds) / micro_batch.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_ratio_follows_its_bf16_path() {
        let (ratio, why) = bf16_time_ratio(Target::Cpu);
        let path = crate::device::cpu::bf16_path_kind();
        assert_eq!(
            ratio < 1.0,
            path != crate::device::cpu::Bf16Path::F32,
            "{why}"
        );
        assert!(why.contains(path.describe()), "{why}");
    }

    #[test]
    fn time_per_image_counts_recomputation_and_the_micro_batch() {
        assert_eq!(seconds_per_image(3.0, 1.0, 4, 1.0), 1.0);
        assert_eq!(seconds_per_image(3.0, 1.0, 4, 0.5), 0.5);
        assert_eq!(seconds_per_image(3.0, 0.0, 1, 1.0), 3.0);
    }
}
