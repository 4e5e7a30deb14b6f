//! What a command assembles before it runs, shared by `train`, `plan`,
//! `eval` and the benchmarks: the model from its name and flags (one
//! builder, so every command builds the same network from the same flags),
//! the default width, and the checks on a configuration that no single
//! layer can make. It knows the zoo and the shapes, not the command line's
//! parser or the training loop.

use std::path::Path;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::io::{TensorFile, fc_rows};
use crate::memory::Pool;
use crate::nn::{BnPolicy, Precision, ResNet, ResNetConfig, StemKind};
pub use crate::optim::{OptimizerKind, ScheduleKind, lr_schedule};

/// torchvision's width of the stem and layer1: `--model resnet50` is then
/// torchvision's ResNet-50 (25,557,032 parameters).
pub const TORCHVISION_BASE_WIDTH: usize = 64;

/// The width of the default run on the embedded 8×8 digits, where a quarter
/// of torchvision's width learns as well in a fraction of the time.
pub const DIGITS_BASE_WIDTH: usize = 16;

/// The base width when none is given: [`DIGITS_BASE_WIDTH`] for the
/// embedded digits (`--data digits`), [`TORCHVISION_BASE_WIDTH`] for every
/// other dataset.
pub fn default_base_width(data: &str) -> usize {
    if data == "digits" {
        DIGITS_BASE_WIDTH
    } else {
        TORCHVISION_BASE_WIDTH
    }
}

/// `fp32`, `bf16`, `f16` (and their aliases) as that precision; `auto` as
/// None (the planner chooses).
pub fn parse_precision(s: &str) -> Result<Option<Precision>> {
    if s == "auto" {
        return Ok(None);
    }
    Ok(Some(s.parse()?))
}

/// bf16 saves memory on every CPU, but only runs faster where the CPU has
/// bf16 dot products; elsewhere its GEMMs are f32 products of rounded
/// operands. The note a command prints once (on stderr) so that a user
/// comparing speeds knows why; None where it does not apply.
pub fn bf16_emulation_note(precision: Precision) -> Option<String> {
    use crate::device::cpu::{Bf16Path, bf16_path_kind, dot_to_fma_rate};
    if precision != Precision::BF16 || bf16_path_kind() != Bf16Path::F32 {
        return None;
    }
    use crate::device::cpu::{BF16_PATH_VAR, MIN_DOT_TO_FMA_RATE};
    let why = match dot_to_fma_rate() {
        None => "this CPU has no AVX512-BF16".to_string(),
        Some(rate) if rate >= MIN_DOT_TO_FMA_RATE => format!("{BF16_PATH_VAR}=f32 is set"),
        Some(rate) => format!(
            "this CPU's vdpbf16ps runs at {rate:.2}x the f32 FMA's flop rate, below the f32 GEMM's speed"
        ),
    };
    Some(format!(
        "note: {why}, so bf16 GEMMs run as f32 products of bf16-rounded operands: the memory saving holds, a speed-up over fp32 does not"
    ))
}

/// The micro-batch asked for: `micro_batch`, or a `batch` split into
/// `accum_steps`; None: the planner's choice (the whole batch, or with
/// `auto` the largest that fits).
pub fn requested_micro_batch(
    batch: usize,
    micro_batch: Option<usize>,
    accum_steps: Option<usize>,
) -> Result<Option<usize>> {
    match (micro_batch, accum_steps) {
        (Some(m), _) => Ok(Some(m)),
        (None, Some(0)) => Err(Error::Usage("--accum-steps must be at least 1".into())),
        (None, Some(k)) => Ok(Some(batch.div_ceil(k))),
        (None, None) => Ok(None),
    }
}

/// The classes of the head: `num_classes`, else the rows of `init`'s fc
/// (unless `reset_head`), else the dataset's. Too few for the dataset's
/// labels, or a mismatch with `init`'s fc without `reset_head`, is an
/// error.
pub fn head_classes(
    dataset_classes: usize,
    num_classes: Option<usize>,
    init: Option<&TensorFile>,
    reset_head: bool,
) -> Result<usize> {
    // The dataset decides the classes; without reset_head they must match init's fc.
    let init_rows = match (init, reset_head) {
        (Some(f), false) => fc_rows(f),
        _ => None,
    };
    let classes = num_classes.or(init_rows).unwrap_or(dataset_classes);
    if classes < dataset_classes {
        return Err(Error::Usage(format!(
            "{} classes are too few: the dataset has {dataset_classes} classes (labels 0 to {})",
            classes,
            dataset_classes - 1
        )));
    }
    if let (Some(f), Some(rows)) = (init, init_rows)
        && rows != classes
    {
        return Err(Error::BadWeights {
            path: f.path.clone(),
            reason: format!(
                "fc has {rows} classes but the model has {classes}; pass --reset-head to fine-tune with a new head"
            ),
        });
    }
    Ok(classes)
}

/// A zoo model with the flags every command shares.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// resnet18, resnet34, resnet50, resnet101 or resnet152.
    pub name: String,
    /// Channels of the stem and layer1.
    pub base_width: usize,
    pub stem: StemKind,
    pub num_classes: usize,
    /// Seeds the initial weights.
    pub seed: u64,
}

impl ModelSpec {
    /// The zoo's configuration for `name` with this spec's fields; the
    /// rest (precision, batch norm, recomputation) at their defaults.
    pub fn config(&self) -> Result<ResNetConfig> {
        let mut config = ResNetConfig::by_name(&self.name)?;
        config.base_width = self.base_width;
        config.stem = self.stem;
        config.num_classes = self.num_classes;
        config.seed = self.seed;
        Ok(config)
    }

    /// A freshly initialised model, for the pool's device.
    pub fn build(&self, pool: &Pool) -> Result<ResNet> {
        let mut config = self.config()?;
        config.target = pool.device().target();
        ResNet::new(pool, config)
    }
}

/// The device for `--device FLAG` ([`crate::device::select`]). In a build
/// with CUDA support the choice and its reason go to stderr when `say`
/// (a CPU-only build has one choice, and says nothing). On a GPU, fp32
/// convolutions run in TF32 as PyTorch's do by default
/// (`torch.backends.cudnn.allow_tf32`), unless `strict_fp32`.
pub fn pick_device(flag: &str, say: bool, strict_fp32: bool) -> Result<Device> {
    let (device, note) = crate::device::select(flag)?;
    if say && cfg!(any(feature = "cuda", feature = "cuda-12")) {
        eprintln!("{note}");
    }
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    if matches!(device, Device::Cuda(_)) {
        crate::backend::cuda::dnn::set_allow_tf32(!strict_fp32);
    }
    #[cfg(not(any(feature = "cuda", feature = "cuda-12")))]
    let _ = strict_fp32;
    Ok(device)
}

/// The device a plan is made for (`memfit plan`, `bench max-batch`): as
/// [`pick_device`], except that a `--device cuda[:N]` this machine cannot
/// use because it has none (no driver, library or device here: planning on
/// a laptop for a cluster's card) plans on the meta device standing for
/// that GPU, with a note naming what is missing and what is assumed in its
/// place; a GPU that is here but unusable (a wrong number, an unsupported
/// or failing card) stays an error. Returns
/// the device and whether it is such a stand-in (whose stages cannot be
/// timed). A build without CUDA support still refuses `--device cuda`.
pub fn plan_device(flag: &str, say: bool, strict_fp32: bool) -> Result<(Device, bool)> {
    match pick_device(flag, say, strict_fp32) {
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Err(Error::CudaUnavailable { what, hint }) => {
            let Some(n) =
                crate::device::cuda_ordinal(flag).filter(|_| crate::device::cuda::no_gpu_here())
            else {
                return Err(Error::CudaUnavailable { what, hint });
            };
            if say {
                let (major, minor) = crate::device::cuda::device_facts(n).compute_capability;
                eprintln!(
                    "note: no usable GPU here ({what}); planning for cuda:{n} without it: compute \
                     capability {major}.{minor}, cuDNN's workspace at its documented bound of {} \
                     per convolution, stage times from FLOPs",
                    crate::memory::fmt_bytes(crate::backend::cuda::ops::CUDNN_DEFAULT_WORKSPACE)
                );
            }
            Ok((Device::Meta(crate::device::Target::Cuda(n)), true))
        }
        other => other.map(|d| (d, false)),
    }
}

/// On a GPU, what the card holds beyond the pool: the CUDA context, the
/// cuDNN and cuBLAS handles and their own workspaces, the compiled
/// kernels (and any other process's memory): the card's memory in use less
/// the pool's reserved segments, on a line of its own, so a user sees what
/// a card needs in total. None on the CPU.
pub fn gpu_memory_line(pool: &Pool) -> Option<String> {
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    if let Device::Cuda(n) = pool.device() {
        let line = match crate::device::cuda::core(n)
            .map_err(|e| format!("{e:?}"))
            .and_then(|c| c.memory_in_use().map_err(|e| format!("{e:?}")))
        {
            Ok((used, total)) => {
                let reserved = pool.stats().reserved;
                format!(
                    "GPU memory outside the pool: {} (CUDA context, cuDNN/cuBLAS handles, kernels, other processes); card: {} in use of {}",
                    crate::memory::fmt_bytes(used.saturating_sub(reserved)),
                    crate::memory::fmt_bytes(used),
                    crate::memory::fmt_bytes(total)
                )
            }
            Err(e) => format!("GPU memory outside the pool: not measured ({e})"),
        };
        return Some(line);
    }
    let _ = pool;
    None
}

/// The device of this process: with more than one process on a machine,
/// `--device cuda` means one GPU per process, the process's local rank
/// (`cuda:N` and `cpu` stay as given).
pub fn per_process_device(flag: &str, processes: usize) -> String {
    device_of_local_rank(flag, processes, crate::dist::local_rank())
}

fn device_of_local_rank(flag: &str, processes: usize, local: Option<usize>) -> String {
    match (flag.trim(), local) {
        ("cuda", Some(local)) if processes > 1 => format!("cuda:{local}"),
        (f, _) => f.to_string(),
    }
}

/// PyTorch's rule for batch norm in training: every channel needs more than
/// one value (`Expected more than 1 value per channel when training`). With
/// 1x1 maps before the head that means micro-batches of at least 2; memfit
/// would otherwise normalise every value to 0 and train on nothing.
pub fn check_bn_values(
    model: &ResNet,
    bn: BnPolicy,
    batch: usize,
    micro: usize,
    size: usize,
) -> Result<()> {
    if bn != BnPolicy::Batch {
        return Ok(());
    }
    let inputs = model.stage_inputs(size, size);
    // The head's input: the smallest map any batch norm sees.
    let (h, w, _) = inputs[inputs.len() - 2];
    let smallest = micro.min(match batch % micro {
        0 => micro,
        r => r,
    });
    if smallest * h * w < 2 {
        return Err(Error::Usage(format!(
            "batch norm needs more than one value per channel in training, but {size}x{size} images leave {h}x{w} maps before the head and a micro-batch can hold 1 image (batch {batch}, micro-batch {micro}): use micro-batches of at least 2 images (and a batch size that is not 1 more than a multiple of them), larger images, or --bn frozen"
        )));
    }
    Ok(())
}

/// The file `path` can be created: its folder exists and it is not a
/// folder itself. `flag` names the option that gave it.
pub fn check_output_file(path: &Path, flag: &str) -> Result<()> {
    if path.is_dir() {
        return Err(Error::Usage(format!(
            "{flag} {}: is a directory, expected a file path",
            path.display()
        )));
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(Error::Usage(format!(
            "{flag} {}: the folder '{}' does not exist or is not a directory",
            path.display(),
            dir.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_gpu_per_process_on_a_machine() {
        assert_eq!(device_of_local_rank("cuda", 4, Some(3)), "cuda:3");
        // One process, a numbered GPU, the CPU or no launcher: as given.
        assert_eq!(device_of_local_rank("cuda", 1, Some(3)), "cuda");
        assert_eq!(device_of_local_rank("cuda:1", 4, Some(3)), "cuda:1");
        assert_eq!(device_of_local_rank("cpu", 4, Some(3)), "cpu");
        assert_eq!(device_of_local_rank("cuda", 4, None), "cuda");
    }

    #[test]
    fn only_the_digits_default_to_a_narrow_network() {
        assert_eq!(default_base_width("digits"), 16);
        for data in ["synthetic", "fashion-mnist", "./digits", "/data/imagenet"] {
            assert_eq!(default_base_width(data), 64, "{data}");
        }
    }

    #[test]
    fn the_default_resnet50_is_torchvisions() {
        let spec = ModelSpec {
            name: "resnet50".into(),
            base_width: TORCHVISION_BASE_WIDTH,
            stem: StemKind::ImageNet,
            num_classes: 1000,
            seed: 0,
        };
        let mut model = spec.build(&Pool::new()).unwrap();
        assert_eq!(model.param_count(), 25_557_032);
    }
}
