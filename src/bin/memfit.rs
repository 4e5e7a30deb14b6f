//! The `memfit` command line.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::rc::Rc;

use anyhow::{Context, Result, bail};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use memfit::bench::{
    ScalingOptions, StepOptions, StrategiesOptions, format_max_batch_header, format_max_batch_row,
    format_scaling, format_strategies, largest_batch, max_batch_strategies, measure_steps_on,
    pytorch_rows, run_scaling, run_strategies,
};
use memfit::data::DataOptions;
use memfit::dist::Collective;
use memfit::memory::{MemoryStats, fmt_bytes, parse_bytes};
use memfit::nn::{BnPolicy, StemKind};
use memfit::run::{self, EvalConfig, MemoryConfig, TrainConfig};
use memfit::setup::{self, ModelSpec};
use memfit::train::NanPolicy;

/// Exit status when standard output's reader has gone (`memfit … | head`):
/// what a shell reports for a program that SIGPIPE ended (128 + 13).
const BROKEN_PIPE_EXIT: i32 = 141;

/// Standard output for everything the commands print. Rust ignores
/// SIGPIPE, so a closed pipe is an error on write; this ends the program
/// quietly then, as SIGPIPE would, instead of panicking. Other errors are
/// returned.
struct Stdout;

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        quiet_on_broken_pipe(std::io::stdout().write(buf))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        quiet_on_broken_pipe(std::io::stdout().flush())
    }
}

fn quiet_on_broken_pipe<T>(r: std::io::Result<T>) -> std::io::Result<T> {
    if let Err(e) = &r
        && e.kind() == std::io::ErrorKind::BrokenPipe
    {
        std::process::exit(BROKEN_PIPE_EXIT);
    }
    r
}

/// Writes to [`Stdout`]; any error but a closed pipe (a full disk) ends the
/// program with a message, as `println!` would have but without a panic.
fn emit(args: std::fmt::Arguments) {
    if let Err(e) = Stdout.write_fmt(args) {
        eprintln!("error: writing to standard output: {e}");
        std::process::exit(1);
    }
}

/// `println!` through [`emit`].
macro_rules! outln {
    ($($arg:tt)*) => {
        emit(format_args!("{}\n", format_args!($($arg)*)))
    };
}

#[derive(Parser)]
#[command(
    name = "memfit",
    version = env!("MEMFIT_VERSION"),
    about = "Train ResNet image classifiers inside a memory budget"
)]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a ResNet (default: a small ResNet-18 on the embedded digits).
    #[command(args_override_self = true)]
    Train(TrainArgs),
    /// Loss, top-1 and top-5 of saved weights on a dataset's validation split
    /// (the one `train` evaluates on with the same data flags).
    #[command(args_override_self = true)]
    Eval(EvalArgs),
    /// Show the memory plan `train` would use with the same flags (per
    /// stage: kept or recomputed) and its predicted peak per category,
    /// without training. train's other flags (--epochs, --save-dir,
    /// --metrics-jsonl, ...) are accepted, so one --config file serves both,
    /// and ignored with a warning; --resume DIR plans the saved run.
    #[command(args_override_self = true)]
    Plan(TrainArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Clone, Copy, ValueEnum)]
enum BnKind {
    /// Batch statistics, running stats updated (PyTorch's train mode).
    Batch,
    /// Running statistics and frozen affine parameters (fine-tuning with
    /// tiny micro-batches).
    Frozen,
}

#[derive(Args)]
struct MemoryArgs {
    /// Refuse to hold more than this many bytes (e.g. 4GiB, 512MB); with
    /// --checkpoint auto, the budget the plan must fit.
    #[arg(long)]
    memory_budget: Option<String>,
    /// none, segments:K (K segments of equal saved bytes, the first K-1
    /// recomputed), stages:layer1,layer2,layer4 (recompute those parts of
    /// the torchvision hierarchy, e.g. stem, layer3, layer3.2) or auto (the
    /// fastest plan and largest micro-batch that fit --memory-budget).
    #[arg(long, default_value = "none")]
    checkpoint: String,
    /// Stage times for --checkpoint auto: measured (time one forward of
    /// each stage on this machine at the chosen micro-batch, about a second
    /// for ResNet-50 at batch 16) or flops (modelled from FLOPs and bytes;
    /// no run, the same plan on every machine).
    #[arg(long, default_value = "measured")]
    time_model: String,
    /// Samples per forward/backward; --batch-size stays the samples per
    /// optimizer step (gradients accumulate). Default: the whole batch.
    #[arg(long, conflicts_with = "accum_steps")]
    micro_batch: Option<usize>,
    /// Split each batch into this many micro-batches instead.
    #[arg(long)]
    accum_steps: Option<usize>,
    /// Batch norm in training.
    #[arg(long, value_enum, default_value = "batch")]
    bn: BnKind,
    /// Write the allocator timeline of the first two optimizer steps as CSV
    /// (seconds, event, category, tensor, bytes, live_total).
    #[arg(long)]
    memory_trace: Option<PathBuf>,
    #[command(flatten)]
    precision: PrecisionArgs,
    /// f16 loss scaler (PyTorch's GradScaler): initial scale.
    #[arg(long, default_value_t = 65536.0)]
    scaler_init: f32,
    /// f16 loss scaler: consecutive clean steps before the scale doubles.
    #[arg(long, default_value_t = 2000)]
    scaler_growth_interval: u32,
}

#[derive(Args, Clone)]
struct PrecisionArgs {
    /// fp32, bf16 or f16: convolutions and matmuls on low-type operands with
    /// f32 accumulation, saved activations stored in the low type; BN
    /// statistics, loss and master weights stay f32; f16 trains with a
    /// dynamic loss scaler. auto: whichever of fp32 and bf16 fits
    /// --memory-budget with the least modelled time per image (bf16's speed
    /// on this device's bf16 arithmetic, the plan's recomputation), fp32
    /// on a tie; the plan says why.
    #[arg(long, default_value = "fp32")]
    precision: String,
    /// Recompute BN+ReLU outputs in backward from the kept convolution
    /// outputs instead of storing them (cheap recompute inside blocks).
    #[arg(long)]
    recompute_bn_relu: bool,
    /// On a GPU, fp32 convolutions in strict fp32. Default: TF32 tensor
    /// cores, as PyTorch's cuDNN convolutions (torch.backends.cudnn.allow_tf32).
    /// No effect on the CPU.
    #[arg(long)]
    strict_fp32: bool,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Time forward + backward + SGD steps on synthetic data and report the
    /// tracked memory peak per category.
    Step(StepArgs),
    /// One `bench step` per memory strategy (none, segments:2/4/8,
    /// stages:layer1,layer2,layer4, micro-batch batch/4), as one table of
    /// measured peak, memory and time ratios vs none, and predicted peak.
    Strategies(StrategiesArgs),
    /// The largest batch (no accumulation) whose predicted peak fits a
    /// budget, per strategy; predicted on the shapes-only simulator, no
    /// training.
    MaxBatch(MaxBatchArgs),
    /// `bench step` on 1, 2, … data-parallel processes (launched with
    /// mpirun; this memfit must be built with `--features mpi`), rows
    /// alternated over rounds: step time, images per second of the whole
    /// batch, speed-up, and the time spent summing gradients. The flags
    /// after `--` are bench step's, e.g. `memfit bench scaling --processes
    /// 1,2 -- --model resnet50 --image-size 128 --batch-size 32`.
    Scaling(ScalingArgs),
}

#[derive(Args)]
struct ScalingArgs {
    /// Process counts, one row each (1 runs without the launcher).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    processes: Vec<usize>,
    /// Threads of each process.
    #[arg(long, default_value_t = 1)]
    threads_per_process: usize,
    /// Leave out the row of one process with as many threads as the
    /// largest row has cores (processes x threads).
    #[arg(long)]
    no_threads_row: bool,
    /// The launcher and its flags, before `-np N` (split on spaces). As
    /// root on one machine: `mpirun --allow-run-as-root --oversubscribe
    /// --bind-to none --mca btl self,vader`.
    #[arg(long, default_value = "mpirun --bind-to none")]
    launcher: String,
    /// Runs of every row, rows alternating; each row reports its median.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// `bench step`'s flags (after `--`), passed to every row as they are.
    #[arg(last = true)]
    step_args: Vec<String>,
}

#[derive(Args)]
struct MaxBatchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Side of the square synthetic images.
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    /// The budget, e.g. 4GiB.
    #[arg(long)]
    memory_budget: String,
}

#[derive(Args)]
struct StrategiesArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Side of the square synthetic images.
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    /// Samples per optimizer step.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Timed steps per strategy.
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Untimed steps per strategy first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Run the whole list of strategies this many times, one row after the
    /// other in each round, and report each row's median round: host noise
    /// then falls on every row alike instead of on whichever ran during it.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Also write the table as CSV here (with the PyTorch rows, if any).
    #[arg(long)]
    csv: Option<PathBuf>,
    /// The PyTorch baseline's results (JSON lines of resnet_mem.py); its
    /// rows for this image size and batch are printed after memfit's when
    /// the file exists.
    #[arg(long, default_value = "../shared/baselines/pytorch/results.jsonl")]
    pytorch_results: PathBuf,
    /// Stage times for --checkpoint auto: measured (time one forward of
    /// each stage on this machine at the chosen micro-batch, about a second
    /// for ResNet-50 at batch 16) or flops (modelled from FLOPs and bytes;
    /// no run, the same plan on every machine).
    #[arg(long, default_value = "measured")]
    time_model: String,
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// resnet18, resnet34, resnet50, resnet101 or resnet152.
    #[arg(long, default_value = "resnet50")]
    model: String,
    /// Channels of the stem and layer1 (torchvision: 64).
    #[arg(long, default_value_t = 64)]
    base_width: usize,
    /// imagenet (conv 7x7 stride 2 + max pool, torchvision) or small
    /// (conv 3x3 stride 1, no max pool: for 28x28 / 32x32 images).
    #[arg(long, value_enum, default_value = "imagenet")]
    stem: StemArg,
    /// Classes of the head.
    #[arg(long, default_value_t = 1000)]
    num_classes: usize,
    /// Seeds the weights and the synthetic batches.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// cpu, cuda (GPU 0), cuda:N, or auto: a GPU when one works and the
    /// CUDA backend is complete in this build, else the CPU.
    #[arg(long, default_value = "auto")]
    device: String,
}

#[derive(Args)]
struct StepArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Side of the square synthetic images.
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    /// Samples per optimizer step.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Untimed steps first (buffers are allocated in the first one).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Refuse to hold more than this many bytes (e.g. 4GiB, 512MB).
    #[arg(long)]
    memory_budget: Option<String>,
    /// Memory plan, as for train: none, segments:K, stages:..., auto.
    #[arg(long, default_value = "none")]
    checkpoint: String,
    /// Stage times for --checkpoint auto: measured (time one forward of
    /// each stage on this machine at the chosen micro-batch, about a second
    /// for ResNet-50 at batch 16) or flops (modelled from FLOPs and bytes;
    /// no run, the same plan on every machine).
    #[arg(long, default_value = "measured")]
    time_model: String,
    /// Samples per forward/backward (gradients accumulate over the batch).
    #[arg(long)]
    micro_batch: Option<usize>,
    #[command(flatten)]
    precision: PrecisionArgs,
    /// Also print the time per op family (conv forward, dgrad, wgrad, batch
    /// norm, the rest) per step and the GFLOP/s of each convolution pass; on
    /// a GPU, the host time per op family (conv, bn, relu, add, pool, linear,
    /// loss, optimizer, copies, device reads) with calls per step, and the
    /// cuDNN algorithm and workspace per convolution geometry.
    #[arg(long)]
    profile: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum StemArg {
    Imagenet,
    Small,
}

impl From<StemArg> for StemKind {
    fn from(s: StemArg) -> Self {
        match s {
            StemArg::Imagenet => StemKind::ImageNet,
            StemArg::Small => StemKind::Small,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum NanPolicyArg {
    Stop,
    Skip,
}

#[derive(Clone, Copy, ValueEnum)]
enum OptimizerKind {
    Sgd,
    Adamw,
}

impl From<OptimizerKind> for setup::OptimizerKind {
    fn from(k: OptimizerKind) -> Self {
        match k {
            OptimizerKind::Sgd => setup::OptimizerKind::Sgd,
            OptimizerKind::Adamw => setup::OptimizerKind::Adamw,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum ScheduleKind {
    Constant,
    Step,
    Cosine,
}

impl From<ScheduleKind> for setup::ScheduleKind {
    fn from(k: ScheduleKind) -> Self {
        match k {
            ScheduleKind::Constant => setup::ScheduleKind::Constant,
            ScheduleKind::Step => setup::ScheduleKind::Step,
            ScheduleKind::Cosine => setup::ScheduleKind::Cosine,
        }
    }
}

impl ModelArgs {
    fn spec(&self) -> ModelSpec {
        ModelSpec {
            name: self.model.clone(),
            base_width: self.base_width,
            stem: self.stem.into(),
            num_classes: self.num_classes,
            seed: self.seed,
        }
    }
}

impl DataArgs {
    fn options(&self) -> DataOptions {
        DataOptions {
            data: self.data.clone(),
            val_data: self.val_data.clone(),
            image_size: self.image_size,
            workers: self.workers,
            no_augment: self.no_augment,
            classes: self.classes,
            train_size: self.train_size,
            val_size: self.val_size,
            val_fraction: self.val_fraction,
        }
    }
}

#[derive(Args)]
struct DataArgs {
    /// digits (embedded, scikit-learn's 8x8 handwritten digits),
    /// fashion-mnist (Debian's dataset-fashion-mnist), synthetic (gratings),
    /// or the path of an image folder in torchvision's ImageFolder layout,
    /// root/<class>/**/<image>.{jpg,jpeg,png} (write ./digits for a folder
    /// named like a built-in set).
    #[arg(long, default_value = "digits")]
    data: String,
    /// Validation image folder (same class folders as --data). Default for a
    /// folder --data: the seeded --val-fraction split of it.
    #[arg(long)]
    val_data: Option<PathBuf>,
    /// Side of the square network input; images are resized (bilinear) to it.
    /// Default: 32 for digits and synthetic, 28 for fashion-mnist, 224 for
    /// image folders.
    #[arg(long)]
    image_size: Option<usize>,
    /// Image folders: threads decoding and augmenting batches ahead of the
    /// training step (0: on the training thread). Results do not depend on
    /// it. The built-in sets are in memory and always load on the training
    /// thread.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Image folders: no random crop or flip. Training and validation images
    /// are resized (shorter side) to --image-size and centre-cropped.
    /// Without it, training uses RandomResizedCrop (scale 0.08-1, ratio
    /// 3/4-4/3) and a horizontal flip, and validation resizes the shorter
    /// side to image-size*256/224 and centre-crops; all are normalised with
    /// the ImageNet mean and std.
    #[arg(long)]
    no_augment: bool,
    /// Classes of the synthetic gratings. Default: --num-classes when given,
    /// else 6.
    #[arg(long)]
    classes: Option<usize>,
    /// Images of the synthetic training set.
    #[arg(long, default_value_t = 3072)]
    train_size: usize,
    /// Images of the synthetic validation set.
    #[arg(long, default_value_t = 768)]
    val_size: usize,
    /// Fraction held out for validation from the digits, or from an image
    /// folder given without --val-data (a shuffle seeded by --seed, so the
    /// split is the same on every run with that seed; 0: no validation).
    #[arg(long, default_value_t = 0.2)]
    val_fraction: f32,
}

#[derive(Args)]
struct TrainArgs {
    /// Read flags from a TOML file (keys are flag names: `lr = 0.1`,
    /// `batch_size = 64`, `nesterov = true`); flags on the command line
    /// override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// resnet18, resnet34, resnet50, resnet101 or resnet152 (torchvision's
    /// architectures). Default with --init (train) or --weights (eval):
    /// the model the file's metadata names.
    #[arg(long, default_value = "resnet18")]
    model: String,
    /// Channels of the stem and layer1. Default: 64, torchvision's (so
    /// --model resnet50 is torchvision's ResNet-50, 25,557,032 parameters
    /// with 1000 classes), except 16 on the embedded digits (--data digits,
    /// the default run).
    #[arg(long)]
    base_width: Option<usize>,
    /// imagenet (conv 7x7 stride 2 + max pool, torchvision) or small
    /// (conv 3x3 stride 1, no max pool: for 28x28 / 32x32 images).
    #[arg(long, value_enum, default_value = "imagenet")]
    stem: StemArg,
    #[command(flatten)]
    data: DataArgs,
    /// Passes over the training set.
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Train for this many optimizer steps instead of --epochs (the LR
    /// schedule spans them).
    #[arg(long, conflicts_with = "epochs")]
    steps: Option<usize>,
    /// Classes of the head. Default: the fc rows of --init (without
    /// --reset-head), else the dataset's class count.
    #[arg(long)]
    num_classes: Option<usize>,
    /// Samples per optimizer step (split by --micro-batch or --accum-steps
    /// into forward/backward passes whose gradients accumulate).
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// sgd (with momentum, PyTorch's SGD) or adamw.
    #[arg(long, value_enum, default_value = "sgd")]
    optimizer: OptimizerKind,
    /// Peak learning rate (after --warmup-epochs; --schedule decays it).
    /// Default for SGD: the linear scaling rule of the reference ImageNet
    /// recipe, 0.1 per 256 images of --batch-size (the effective batch,
    /// whatever the micro-batch and the processes); for AdamW 0.001
    /// (PyTorch's default).
    #[arg(long)]
    lr: Option<f32>,
    /// SGD momentum (AdamW does not use it: its betas are 0.9, 0.999).
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    /// SGD: Nesterov momentum.
    #[arg(long)]
    nesterov: bool,
    /// Default 5e-4 for SGD; AdamW uses 0.01 unless given.
    #[arg(long)]
    weight_decay: Option<f32>,
    /// LR schedule over the run's optimizer steps: constant, step (see
    /// --step-epochs, --gamma) or cosine (to 0 at the last step).
    #[arg(long, value_enum, default_value = "cosine")]
    schedule: ScheduleKind,
    /// Linear warmup before the schedule, in epochs. Default: none, except
    /// when the default SGD LR is above 0.1 (batches above 256), which warms
    /// up over 5 epochs (at most a quarter of the run), as the large-batch
    /// recipe does.
    #[arg(long)]
    warmup_epochs: Option<usize>,
    /// Step schedule: multiply the LR by --gamma every this many epochs.
    #[arg(long, default_value_t = 30)]
    step_epochs: usize,
    /// Step schedule: the LR factor every --step-epochs.
    #[arg(long, default_value_t = 0.1)]
    gamma: f32,
    /// Label smoothing of the cross-entropy loss (PyTorch's
    /// label_smoothing), 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    label_smoothing: f32,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    clip_grad_norm: Option<f32>,
    /// Seeds the initial weights, the shuffle, the augmentation and the
    /// validation split.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep the dataset's order instead of shuffling every epoch.
    #[arg(long)]
    no_shuffle: bool,
    /// Evaluate every N epochs (and after the last).
    #[arg(long, default_value_t = 1)]
    eval_every: usize,
    /// Append one JSON object per optimizer step and per evaluation.
    #[arg(long)]
    metrics_jsonl: Option<PathBuf>,
    /// Append the same metrics as CSV: a header (when the file is new),
    /// one row per optimizer step, and one row per evaluation with the
    /// training columns empty and val_loss, val_top1, val_top5 filled.
    #[arg(long)]
    metrics_csv: Option<PathBuf>,
    /// When standard error is not a terminal (a log file, a pipe): write a
    /// progress line (step, epoch, loss, LR, img/s, tracked peak, ETA)
    /// every N optimizer steps. Default: about every 30 s. On a terminal a
    /// progress bar is drawn instead (and these lines only with the flag).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    log_every: Option<u64>,
    /// Start from a torchvision-layout state_dict (.safetensors), memfit's
    /// saved weights or a checkpoint; --model, --base-width and --stem
    /// default to those the file's metadata names.
    #[arg(long)]
    init: Option<PathBuf>,
    /// With --init: keep a fresh fc for this dataset's classes.
    #[arg(long)]
    reset_head: bool,
    /// Write the trained weights (torchvision layout) here.
    #[arg(long)]
    save_weights: Option<PathBuf>,
    /// Write training-state checkpoints (weights, optimizer state, loss
    /// scaler, step, the run's flags) to this directory: after every
    /// --save-every-steps / --save-every-epochs, at the end, and on Ctrl-C /
    /// SIGTERM. A directory holding another run's checkpoints is refused.
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// With --save-dir: also save every this many optimizer steps.
    #[arg(long)]
    save_every_steps: Option<usize>,
    /// Default with --save-dir: every epoch.
    #[arg(long)]
    save_every_epochs: Option<usize>,
    /// Checkpoints kept in --save-dir (the newest).
    #[arg(long, default_value_t = 3)]
    keep_checkpoints: usize,
    /// What a non-finite loss or gradient does in fp32/bf16: stop (with the
    /// step; the last checkpoint stays the last good one) or skip the step.
    /// f16's loss scaler skips overflowing steps by itself.
    #[arg(long, value_enum, default_value = "stop")]
    nan_policy: NanPolicyArg,
    /// Continue a run from a checkpoint file or the newest one in a
    /// directory (which must hold one run's). The run's flags are saved in
    /// its checkpoints: flags not given are taken from there, and a flag
    /// given with another value is refused unless changing it is safe
    /// (--epochs, --steps, --workers, --eval-every, --metrics-jsonl,
    /// --save-*, --keep-checkpoints, --memory-budget, --checkpoint,
    /// --time-model, --nan-policy, --memory-trace).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// cpu, cuda (GPU 0), cuda:N, or auto: a GPU when one works and the
    /// CUDA backend is complete in this build, else the CPU. A resumed run
    /// may change it.
    #[arg(long, default_value = "auto")]
    device: String,
    #[command(flatten)]
    memory: MemoryArgs,
}

#[derive(Args)]
struct EvalArgs {
    /// Read flags from a TOML file, as for train.
    #[arg(long)]
    config: Option<PathBuf>,
    /// resnet18, resnet34, resnet50, resnet101 or resnet152 (torchvision's
    /// architectures). Default with --init (train) or --weights (eval):
    /// the model the file's metadata names.
    #[arg(long, default_value = "resnet18")]
    model: String,
    /// Channels of the stem and layer1. Default: 64, torchvision's (so
    /// --model resnet50 is torchvision's ResNet-50, 25,557,032 parameters
    /// with 1000 classes), except 16 on the embedded digits (--data digits,
    /// the default run).
    #[arg(long)]
    base_width: Option<usize>,
    /// imagenet (conv 7x7 stride 2 + max pool, torchvision) or small
    /// (conv 3x3 stride 1, no max pool: for 28x28 / 32x32 images).
    #[arg(long, value_enum, default_value = "imagenet")]
    stem: StemArg,
    /// Weights to evaluate (torchvision layout, .safetensors; memfit's
    /// weights and checkpoints name their model, width, stem and classes,
    /// so those flags are not needed, and an image folder's classes are
    /// matched to the model's by name).
    #[arg(long)]
    weights: PathBuf,
    #[command(flatten)]
    data: DataArgs,
    /// Images per forward pass.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Seeds the validation split (use the training run's --seed).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// cpu, cuda (GPU 0), cuda:N, or auto (a GPU when one works and the
    /// CUDA backend is complete in this build, else the CPU).
    #[arg(long, default_value = "auto")]
    device: String,
}

fn main() {
    // The data-parallel world, once `train` or `bench step` started it.
    let mut world: Option<Rc<dyn Collective>> = None;
    if let Err(e) = run(&mut world) {
        match world.filter(|c| c.size() > 1) {
            // The other processes may be waiting for this one in a
            // collective: end them all.
            Some(c) => {
                eprintln!("error: process {} of {}: {e:#}", c.rank(), c.size());
                c.abort(1)
            }
            None => {
                match e.downcast_ref::<memfit::Error>() {
                    // Not a failure to report but a stop asked for: say
                    // where the state went and the command that continues.
                    Some(memfit::Error::Interrupted {
                        step,
                        saved_state: Some(p),
                    }) => eprintln!(
                        "interrupted after optimizer step {step}; the run's state is saved in {p}\nto resume: {}",
                        resume_command(std::env::args().collect(), p)
                    ),
                    _ => eprintln!("error: {e:#}"),
                }
                std::process::exit(1);
            }
        }
    }
}

/// The command line `args` (argv) with `--resume STATE` in place of any
/// `--resume` it had, quoted for a POSIX shell.
fn resume_command(args: Vec<String>, state: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "--resume" {
            it.next();
        } else if !a.starts_with("--resume=") {
            out.push(a);
        }
    }
    out.extend(["--resume".to_string(), state.to_string()]);
    out.iter()
        .map(|a| shell_quote(a))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `a` as one word for a POSIX shell.
fn shell_quote(a: &str) -> String {
    let plain = !a.is_empty()
        && a.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', "'\\''"))
    }
}

/// The processes of this run: under `mpirun`/`srun` (built with `--features
/// mpi`) MPI's world, checked at start-up (every process there within
/// `MEMFIT_DIST_TIMEOUT` seconds, with the same command line); otherwise
/// one process.
fn world(slot: &mut Option<Rc<dyn Collective>>) -> Result<Rc<dyn Collective>> {
    if let Some(c) = slot {
        return Ok(c.clone());
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let comm = memfit::dist::start(&args)?;
    *slot = Some(comm.clone());
    Ok(comm)
}

/// `--config FILE.toml` (on train, plan and eval): each key is a flag of the
/// subcommand (`batch_size = 64` or `batch-size = 64` is `--batch-size 64`,
/// `nesterov = true` is `--nesterov`). They are placed right after the
/// subcommand, so flags given on the command line override them.
fn expand_config(mut args: Vec<OsString>) -> Result<Vec<OsString>> {
    let Some(i) = args
        .iter()
        .position(|a| a == "--config" || a.to_string_lossy().starts_with("--config="))
    else {
        return Ok(args);
    };
    let arg = args.remove(i).to_string_lossy().to_string();
    let path = match arg.strip_prefix("--config=") {
        Some(p) => p.to_string(),
        None if i < args.len() => args.remove(i).to_string_lossy().to_string(),
        None => bail!("--config needs a file"),
    };
    let sub = args
        .iter()
        .position(|a| matches!(a.to_str(), Some("train" | "plan" | "eval")))
        .ok_or_else(|| anyhow::anyhow!("--config works with train, plan and eval"))?;
    let sub_name = args[sub].to_string_lossy().to_string();
    let command = command();
    let known: Vec<String> = command
        .find_subcommand(&sub_name)
        .map(|c| {
            c.get_arguments()
                .filter_map(|a| a.get_long().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let text = std::fs::read_to_string(&path).with_context(|| format!("--config {path}"))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| anyhow::anyhow!("{path}: not valid TOML: {e}"))?;
    let mut flags: Vec<OsString> = Vec::new();
    for (key, value) in table {
        let long = key.replace('_', "-");
        if !known.contains(&long) || long == "help" {
            bail!(
                "{path}: unknown key '{key}' (not a flag of memfit {sub_name}; see memfit {sub_name} --help)"
            );
        }
        let flag = OsString::from(format!("--{long}"));
        match value {
            toml::Value::Boolean(true) => flags.push(flag),
            toml::Value::Boolean(false) => {}
            toml::Value::String(v) => flags.extend([flag, v.into()]),
            toml::Value::Integer(v) => flags.extend([flag, v.to_string().into()]),
            toml::Value::Float(v) => flags.extend([flag, v.to_string().into()]),
            other => bail!(
                "{path}: key '{key}' holds a value of type {}; use a string, number or boolean",
                other.type_str()
            ),
        }
    }
    args.splice(sub + 1..sub + 1, flags);
    Ok(args)
}

fn run(slot: &mut Option<Rc<dyn Collective>>) -> Result<()> {
    let args = expand_config(std::env::args_os().collect())?;
    let (cli, matches) = parse(args.clone());
    if let Some(t) = cli.threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .context("starting the thread pool")?;
    }
    match cli.command {
        Command::Train(a) => {
            let comm = world(slot)?;
            train(a, &args, &matches, "train", Some(comm))
        }
        Command::Plan(a) => train(a, &args, &matches, "plan", None),
        Command::Eval(a) => eval(a, &matches),
        Command::Bench(BenchCommand::Step(a)) => {
            let comm = world(slot)?;
            bench_step(a, comm)
        }
        Command::Bench(BenchCommand::Strategies(a)) => bench_strategies(a),
        Command::Bench(BenchCommand::MaxBatch(a)) => bench_max_batch(a),
        Command::Bench(BenchCommand::Scaling(a)) => bench_scaling(a),
    }
}

fn print_memory(stats: &MemoryStats) -> Result<()> {
    Ok(run::write_memory(&mut Stdout, stats)?)
}

/// `--memory-budget`'s bytes.
fn parse_budget(s: Option<&str>) -> Result<Option<usize>> {
    let budget = s.map(parse_bytes).transpose().context("--memory-budget")?;
    if let Some(w) = budget
        .and_then(|b| memfit::memory::budget_warning(b, memfit::memory::physical_memory_bytes()))
    {
        eprintln!("warning: {w}");
    }
    Ok(budget)
}

fn bench_step(a: StepArgs, comm: Rc<dyn Collective>) -> Result<()> {
    // Before the budget is parsed, as ever (measure_steps checks it too).
    if a.batch_size == 0 || a.steps == 0 {
        bail!("--batch-size and --steps must be at least 1");
    }
    let opts = StepOptions {
        model: a.model.spec(),
        image_size: a.image_size,
        batch_size: a.batch_size,
        steps: a.steps,
        warmup: a.warmup,
        memory_budget: parse_budget(a.memory_budget.as_deref())?,
        checkpoint: a.checkpoint,
        time_model: a.time_model,
        micro_batch: a.micro_batch,
        precision: a.precision.precision,
        recompute_bn_relu: a.precision.recompute_bn_relu,
        profile: a.profile,
        device: a.model.device.clone(),
        strict_fp32: a.precision.strict_fp32,
    };
    let root = comm.is_root();
    let r = measure_steps_on(&opts, true, &mut Stdout, comm)?;
    if !root {
        return Ok(());
    }
    print_memory(&r.measured)?;
    outln!(
        "predicted peak {} vs measured {}",
        fmt_bytes(r.predicted),
        fmt_bytes(r.measured.peak_total)
    );
    outln!(
        "reserved peak (held from the system): predicted {} vs measured {}",
        fmt_bytes(r.predicted_reserved),
        fmt_bytes(r.measured.reserved_peak)
    );
    Ok(())
}

fn bench_strategies(a: StrategiesArgs) -> Result<()> {
    let opts = StrategiesOptions {
        model: a.model.spec(),
        image_size: a.image_size,
        batch_size: a.batch_size,
        steps: a.steps,
        warmup: a.warmup,
        rounds: a.rounds,
        time_model: a.time_model,
        device: a.model.device.clone(),
    };
    let results = run_strategies(&opts, &mut Stdout, &mut |line| eprintln!("{line}"))?;
    let (table, mut csv) = format_strategies(&results);
    emit(format_args!("{table}"));
    let (baseline, baseline_csv) = pytorch_rows(&a.pytorch_results, a.image_size, a.batch_size)?;
    emit(format_args!("{baseline}"));
    csv += &baseline_csv;
    if let Some(path) = &a.csv {
        std::fs::write(path, csv).with_context(|| format!("writing {}", path.display()))?;
        outln!("wrote {}", path.display());
    }
    Ok(())
}

fn bench_scaling(a: ScalingArgs) -> Result<()> {
    let opts = ScalingOptions {
        exe: std::env::current_exe().context("finding this memfit binary")?,
        processes: a.processes,
        threads: a.threads_per_process,
        one_process_all_threads: !a.no_threads_row,
        launcher: a.launcher.split_whitespace().map(str::to_string).collect(),
        step_args: a.step_args,
        rounds: a.rounds,
    };
    let rows = run_scaling(&opts, &mut |line| eprintln!("{line}"))?;
    emit(format_args!("{}", format_scaling(&rows)));
    Ok(())
}

fn bench_max_batch(a: MaxBatchArgs) -> Result<()> {
    let budget = parse_bytes(&a.memory_budget).context("--memory-budget")?;
    let mut config = a.model.spec().config()?;
    // Predicted for the device's target (its workspaces and capabilities).
    // (A GPU this machine lacks is planned for on the meta device.)
    config.target = setup::plan_device(&a.model.device, true, false)?.0.target();
    emit(format_args!(
        "{}",
        format_max_batch_header(&a.model.model, a.model.base_width, a.image_size, budget)
    ));
    let mut none = None;
    for s in max_batch_strategies() {
        let row = largest_batch(&config, a.image_size, budget, &s)?;
        let base = *none.get_or_insert(row.batch);
        emit(format_args!("{}", format_max_batch_row(&row, base)));
    }
    Ok(())
}

/// The flags of `sub` (train, plan) in `m`, as the command line gave or
/// defaulted them (long name → value), and those given on the command line
/// (or by --config). Not --config, --resume, --help, --threads.
fn flag_map(m: &ArgMatches, sub: &str) -> (BTreeMap<String, String>, BTreeSet<String>) {
    let (mut values, mut given) = (BTreeMap::new(), BTreeSet::new());
    let command = command();
    let Some(c) = command.find_subcommand(sub) else {
        return (values, given);
    };
    for arg in c.get_arguments() {
        let (id, Some(long)) = (arg.get_id().as_str(), arg.get_long()) else {
            continue;
        };
        if ["config", "resume", "help", "threads"].contains(&long) {
            continue;
        }
        if let Some(raw) = m.get_raw(id) {
            let v: Vec<String> = raw.map(|r| r.to_string_lossy().into_owned()).collect();
            values.insert(long.to_string(), v.join(","));
        }
        if m.value_source(id) == Some(ValueSource::CommandLine) {
            given.insert(long.to_string());
        }
    }
    (values, given)
}

/// Flags of `train` that `plan` accepts (one argument struct serves both,
/// so one `--config` file does too) but does not use: they change how long
/// a run trains, what it reports or where it saves, not its memory plan.
/// `plan --help` hides them; `plan` warns when one is given.
const PLAN_IGNORES: &[&str] = &[
    "clip-grad-norm",
    "epochs",
    "eval-every",
    "gamma",
    "keep-checkpoints",
    "label-smoothing",
    "log-every",
    "lr",
    "memory-trace",
    "metrics-csv",
    "metrics-jsonl",
    "nan-policy",
    "no-shuffle",
    "save-dir",
    "save-every-epochs",
    "save-every-steps",
    "save-weights",
    "scaler-growth-interval",
    "scaler-init",
    "schedule",
    "step-epochs",
    "steps",
    "strict-fp32",
    "warmup-epochs",
    "workers",
];

/// The command-line interface: [`Cli`] with [`PLAN_IGNORES`] hidden from
/// `plan --help`.
fn command() -> clap::Command {
    Cli::command().mut_subcommand("plan", |mut c| {
        for long in PLAN_IGNORES {
            c = c.mut_arg(long.replace('-', "_"), |a| a.hide(true));
        }
        c
    })
}

/// Parses the command line.
fn parse(args: Vec<OsString>) -> (Cli, ArgMatches) {
    let matches = command().get_matches_from(args);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    (cli, matches)
}

/// `train` (with the run's processes) and `plan` (`comm` None): with
/// `--resume` of a run that saved its flags, the flags not given again are
/// the saved ones (re-parsed with them).
fn train(
    a: TrainArgs,
    args: &[OsString],
    matches: &ArgMatches,
    sub: &str,
    comm: Option<Rc<dyn Collective>>,
) -> Result<()> {
    let plan_only = comm.is_none();
    let root = comm.as_ref().is_none_or(|c| c.is_root());
    let comm = comm.unwrap_or_else(|| Rc::new(memfit::dist::Single));
    let m = matches.subcommand_matches(sub).context("subcommand")?;
    let (values, given) = flag_map(m, sub);
    if plan_only {
        let ignored: Vec<String> = PLAN_IGNORES
            .iter()
            .filter(|f| given.contains(**f))
            .map(|f| format!("--{f}"))
            .collect();
        if !ignored.is_empty() && root {
            eprintln!(
                "warning: plan ignores {} (they change training, not the memory plan)",
                ignored.join(", ")
            );
        }
    }
    if let Some(from) = &a.resume
        && let Some(saved) = run::saved_flags(from)
    {
        let merged = run::merge_resumed_flags(&saved, &values, &given)?;
        for note in merged.notes.iter().filter(|_| root) {
            eprintln!("note: {note}");
        }
        if !merged.take.is_empty() {
            let at = args.iter().position(|x| x == sub).context("subcommand")? + 1;
            let mut args = args.to_vec();
            let mut extra: Vec<OsString> = Vec::new();
            for (k, v) in merged.take {
                extra.push(format!("--{k}").into());
                if v != "true" {
                    extra.push(v.into());
                }
            }
            args.splice(at..at, extra);
            let (cli, matches) = parse(args);
            let a = match cli.command {
                Command::Train(a) | Command::Plan(a) => a,
                _ => bail!("unexpected subcommand"),
            };
            let m = matches.subcommand_matches(sub).context("subcommand")?;
            let (values, _) = flag_map(m, sub);
            return Ok(run::train_on(
                &a.config(m, values),
                plan_only,
                comm,
                &mut Stdout,
            )?);
        }
    }
    Ok(run::train_on(
        &a.config(m, values),
        plan_only,
        comm,
        &mut Stdout,
    )?)
}

/// `--model`, `--stem`: None unless given (then the weights' metadata or
/// the defaults decide).
fn given<T>(m: &ArgMatches, id: &str, v: T) -> Option<T> {
    (m.value_source(id) == Some(ValueSource::CommandLine)).then_some(v)
}

impl TrainArgs {
    fn config(&self, m: &ArgMatches, flags: BTreeMap<String, String>) -> TrainConfig {
        TrainConfig {
            model: given(m, "model", self.model.clone()),
            base_width: self.base_width,
            stem: given(m, "stem", self.stem.into()),
            data: self.data.options(),
            epochs: self.epochs,
            steps: self.steps,
            num_classes: self.num_classes,
            batch_size: self.batch_size,
            optimizer: self.optimizer.into(),
            lr: self.lr,
            momentum: self.momentum,
            nesterov: self.nesterov,
            weight_decay: self.weight_decay,
            schedule: self.schedule.into(),
            warmup_epochs: self.warmup_epochs,
            step_epochs: self.step_epochs,
            gamma: self.gamma,
            label_smoothing: self.label_smoothing,
            clip_grad_norm: self.clip_grad_norm,
            seed: self.seed,
            shuffle: !self.no_shuffle,
            eval_every: self.eval_every,
            metrics_jsonl: self.metrics_jsonl.clone(),
            metrics_csv: self.metrics_csv.clone(),
            log_every: self.log_every.map(|n| n as usize),
            init: self.init.clone(),
            reset_head: self.reset_head,
            save_weights: self.save_weights.clone(),
            save_dir: self.save_dir.clone(),
            save_every_steps: self.save_every_steps,
            save_every_epochs: self.save_every_epochs,
            keep_checkpoints: self.keep_checkpoints,
            nan_policy: match self.nan_policy {
                NanPolicyArg::Stop => NanPolicy::Stop,
                NanPolicyArg::Skip => NanPolicy::Skip,
            },
            resume: self.resume.clone(),
            device: self.device.clone(),
            memory: MemoryConfig {
                memory_budget: self.memory.memory_budget.clone(),
                checkpoint: self.memory.checkpoint.clone(),
                time_model: self.memory.time_model.clone(),
                micro_batch: self.memory.micro_batch,
                accum_steps: self.memory.accum_steps,
                bn: match self.memory.bn {
                    BnKind::Batch => BnPolicy::Batch,
                    BnKind::Frozen => BnPolicy::Frozen,
                },
                memory_trace: self.memory.memory_trace.clone(),
                precision: self.memory.precision.precision.clone(),
                recompute_bn_relu: self.memory.precision.recompute_bn_relu,
                strict_fp32: self.memory.precision.strict_fp32,
                scaler_init: self.memory.scaler_init,
                scaler_growth_interval: self.memory.scaler_growth_interval,
            },
            flags,
        }
    }
}

fn eval(a: EvalArgs, matches: &ArgMatches) -> Result<()> {
    let m = matches.subcommand_matches("eval").context("subcommand")?;
    let config = EvalConfig {
        model: given(m, "model", a.model.clone()),
        base_width: a.base_width,
        stem: given(m, "stem", a.stem.into()),
        weights: a.weights.clone(),
        data: a.data.options(),
        batch_size: a.batch_size,
        seed: a.seed,
        device: a.device.clone(),
    };
    Ok(run::eval(&config, &mut Stdout)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every argument of every command and subcommand, with its path.
    fn arguments(c: &clap::Command, path: &str, out: &mut Vec<(String, clap::Arg)>) {
        for a in c.get_arguments() {
            out.push((format!("{path} --{}", a.get_id()), a.clone()));
        }
        for sub in c.get_subcommands() {
            arguments(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    #[test]
    fn every_flag_of_every_command_has_help() {
        let mut c = command();
        c.build();
        let mut all = Vec::new();
        arguments(&c, "memfit", &mut all);
        assert!(all.len() > 50, "{}", all.len());
        let missing: Vec<&String> = all
            .iter()
            .filter(|(_, a)| a.get_help().is_none_or(|h| h.to_string().trim().is_empty()))
            .map(|(p, _)| p)
            .collect();
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }

    #[test]
    fn plan_hides_only_flags_train_has() {
        let c = command();
        c.clone().debug_assert();
        let plan = c.find_subcommand("plan").unwrap();
        let train = c.find_subcommand("train").unwrap();
        for long in PLAN_IGNORES {
            let id = long.replace('-', "_");
            assert!(
                plan.get_arguments()
                    .any(|a| a.get_id() == id.as_str() && a.is_hide_set())
            );
            assert!(
                train
                    .get_arguments()
                    .any(|a| a.get_id() == id.as_str() && !a.is_hide_set())
            );
        }
    }
}
