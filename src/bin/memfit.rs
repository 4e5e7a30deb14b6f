//! The `memfit` command line.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};

use memfit::bench::{
    StepOptions, StrategiesOptions, format_max_batch_header, format_max_batch_row,
    format_strategies, largest_batch, max_batch_strategies, measure_steps, pytorch_rows,
    run_strategies,
};
use memfit::data::{DataOptions, load_data};
use memfit::io::{TensorFile, fc_rows, load_torchvision, save_state_dict};
use memfit::memory::{Category, MemoryStats, Pool, fmt_bytes, parse_bytes};
use memfit::nn::{BnPolicy, Precision, StemKind};
use memfit::optim::GradScaler;
use memfit::plan::{PlanRequest, Strategy, report, resolve};
use memfit::setup::{
    self, ModelSpec, bf16_emulation_note, check_bn_values, check_output_file, default_base_width,
    head_classes, lr_schedule, parse_precision, requested_micro_batch,
};
use memfit::train::state::{FingerprintInputs, check_save_dir, load_state, run_fingerprint};
use memfit::train::{NanPolicy, TrainOptions, evaluate, fit};

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
    version,
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
    /// without training.
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
    /// dynamic loss scaler. auto: fp32 unless bf16 fits --memory-budget
    /// where fp32 does not (or, with --checkpoint auto, fits a larger
    /// micro-batch or less recomputation).
    #[arg(long, default_value = "fp32")]
    precision: String,
    /// Recompute BN+ReLU outputs in backward from the kept convolution
    /// outputs instead of storing them (cheap recompute inside blocks).
    #[arg(long)]
    recompute_bn_relu: bool,
}

impl PrecisionArgs {
    /// The fixed precision, or None for auto.
    fn parse(&self) -> Result<Option<Precision>> {
        Ok(parse_precision(&self.precision)?)
    }
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
}

#[derive(Args)]
struct MaxBatchArgs {
    #[command(flatten)]
    model: ModelArgs,
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
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Timed steps per strategy.
    #[arg(long, default_value_t = 2)]
    steps: usize,
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
    #[arg(long, default_value_t = 1000)]
    num_classes: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
struct StepArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 224)]
    image_size: usize,
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
    /// norm, the rest) per step and the GFLOP/s of each convolution pass.
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

    /// --base-width, or its default for this dataset.
    fn base_width(&self, flag: Option<usize>) -> usize {
        flag.unwrap_or_else(|| default_base_width(&self.data))
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
    /// Classes of the synthetic gratings.
    #[arg(long, default_value_t = 6)]
    classes: usize,
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
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    #[arg(long, value_enum, default_value = "sgd")]
    optimizer: OptimizerKind,
    #[arg(long, default_value_t = 0.05)]
    lr: f32,
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    #[arg(long)]
    nesterov: bool,
    /// Default 5e-4 for SGD; AdamW uses 0.01 unless given.
    #[arg(long)]
    weight_decay: Option<f32>,
    #[arg(long, value_enum, default_value = "cosine")]
    schedule: ScheduleKind,
    /// Linear warmup before the schedule, in epochs.
    #[arg(long, default_value_t = 0)]
    warmup_epochs: usize,
    /// Step schedule: multiply the LR by --gamma every this many epochs.
    #[arg(long, default_value_t = 30)]
    step_epochs: usize,
    #[arg(long, default_value_t = 0.1)]
    gamma: f32,
    #[arg(long, default_value_t = 0.0)]
    label_smoothing: f32,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    clip_grad_norm: Option<f32>,
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
    /// Start from a torchvision-layout state_dict (.safetensors).
    #[arg(long)]
    init: Option<PathBuf>,
    /// With --init: keep a fresh fc for this dataset's classes.
    #[arg(long)]
    reset_head: bool,
    /// Write the trained weights (torchvision layout) here.
    #[arg(long)]
    save_weights: Option<PathBuf>,
    /// Write training-state checkpoints (weights, optimizer state, loss
    /// scaler, step) to this directory: after every --save-every-steps /
    /// --save-every-epochs, at the end, and on Ctrl-C / SIGTERM.
    #[arg(long)]
    save_dir: Option<PathBuf>,
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
    /// directory; every other flag must match the original run.
    #[arg(long)]
    resume: Option<PathBuf>,
    #[command(flatten)]
    memory: MemoryArgs,
}

#[derive(Args)]
struct EvalArgs {
    /// Read flags from a TOML file, as for train.
    #[arg(long)]
    config: Option<PathBuf>,
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
    /// Weights to evaluate (torchvision layout, .safetensors).
    #[arg(long)]
    weights: PathBuf,
    #[command(flatten)]
    data: DataArgs,
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
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
    let command = Cli::command();
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

fn run() -> Result<()> {
    let cli = Cli::parse_from(expand_config(std::env::args_os().collect())?);
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
        Command::Train(a) => train(a, false),
        Command::Plan(a) => train(a, true),
        Command::Eval(a) => eval(a),
        Command::Bench(BenchCommand::Step(a)) => bench_step(a),
        Command::Bench(BenchCommand::Strategies(a)) => bench_strategies(a),
        Command::Bench(BenchCommand::MaxBatch(a)) => bench_max_batch(a),
    }
}

/// Peak resident set size of this process, from /proc (Linux only).
fn print_memory(stats: &MemoryStats) {
    outln!(
        "tracked peak: {} (reserved now {})",
        fmt_bytes(stats.peak_total),
        fmt_bytes(stats.reserved)
    );
    outln!("  {:<12} {:>12} {:>12}", "category", "at peak", "own peak");
    for c in Category::ALL {
        outln!(
            "  {:<12} {:>12} {:>12}",
            c.name(),
            fmt_bytes(stats.at_peak.get(c)),
            fmt_bytes(stats.peak.get(c))
        );
    }
    if let Some(rss) = memfit::memory::process_peak_rss_bytes() {
        outln!("process peak RSS: {}", fmt_bytes(rss));
    }
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

fn bench_step(a: StepArgs) -> Result<()> {
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
    };
    let r = measure_steps(&opts, true, &mut Stdout)?;
    print_memory(&r.measured);
    outln!(
        "predicted peak {} vs measured {}",
        fmt_bytes(r.predicted),
        fmt_bytes(r.measured.peak_total)
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

fn bench_max_batch(a: MaxBatchArgs) -> Result<()> {
    let budget = parse_bytes(&a.memory_budget).context("--memory-budget")?;
    let config = a.model.spec().config()?;
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

/// `train`, or with `plan_only` just the plan report (`memfit plan`).
fn train(a: TrainArgs, plan_only: bool) -> Result<()> {
    if a.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let budget = parse_budget(a.memory.memory_budget.as_deref())?;
    let strategy: Strategy = a.memory.checkpoint.parse()?;
    let fixed_precision = a.memory.precision.parse()?;
    let micro_batch =
        requested_micro_batch(a.batch_size, a.memory.micro_batch, a.memory.accum_steps)?;
    let bn = match a.memory.bn {
        BnKind::Batch => BnPolicy::Batch,
        BnKind::Frozen => BnPolicy::Frozen,
    };
    let pool = Pool::new();
    let data = load_data(&a.data.options(), a.seed)?;
    let (train_set, val_set, size) = (&*data.train, &*data.val, data.size);
    let init = a.init.as_ref().map(TensorFile::open).transpose()?;
    let classes = head_classes(
        train_set.classes(),
        a.num_classes,
        init.as_ref(),
        a.reset_head,
    )?;
    if a.steps == Some(0) {
        bail!("--steps must be at least 1");
    }
    let base_width = a.data.base_width(a.base_width);
    let mut model = ModelSpec {
        name: a.model.clone(),
        base_width,
        stem: a.stem.into(),
        num_classes: classes,
        seed: a.seed,
    }
    .build(&pool)?;
    if let Some(f) = &init {
        load_torchvision(&mut model, f, a.reset_head)?;
    }
    model.check_image_size(size, size)?;
    model.set_bn_policy(bn);
    model.set_precision(fixed_precision.unwrap_or_default());
    model.set_recompute_bn_relu(a.memory.precision.recompute_bn_relu);
    outln!(
        "training {} (base width {}, {:?} stem, {} parameters) on {}: {} classes, {} train / {} val images at {size}x{size}",
        a.model,
        base_width,
        StemKind::from(a.stem),
        model.param_count(),
        a.data.data,
        classes,
        train_set.len(),
        val_set.len(),
    );
    let steps_per_epoch = train_set.len().div_ceil(a.batch_size.max(1));
    let epochs = match a.steps {
        Some(steps) => steps.div_ceil(steps_per_epoch),
        None => a.epochs,
    };
    let total_steps = a.steps.unwrap_or(steps_per_epoch * a.epochs);
    let lr_schedule = lr_schedule(
        a.schedule.into(),
        steps_per_epoch,
        total_steps,
        a.step_epochs,
        a.gamma,
        a.warmup_epochs,
    );
    let mut optimizer =
        setup::OptimizerKind::from(a.optimizer).build(a.lr, a.momentum, a.weight_decay, a.nesterov);
    let resolved = resolve(&PlanRequest {
        config: &model.config,
        bn,
        optimizer: &optimizer,
        batch: a.batch_size,
        micro_batch,
        image_size: size,
        budget,
        strategy,
        auto_precision: fixed_precision.is_none(),
        time_model: a.memory.time_model.parse()?,
    })?;
    model.set_precision(resolved.precision);
    if plan_only {
        emit(format_args!("{}", report(&resolved, a.batch_size)));
        return Ok(());
    }
    check_bn_values(&model, bn, a.batch_size, resolved.micro_batch, size)?;
    // Where the results go is checked before the first step, not after the
    // last one.
    if let Some(dir) = &a.save_dir {
        check_save_dir(dir)?;
    }
    if let Some(path) = &a.save_weights {
        check_output_file(path, "--save-weights")?;
    }
    outln!(
        "plan: {} at micro-batch {} x {} step(s), {}{}; predicted peak {}",
        resolved.plan,
        resolved.micro_batch,
        resolved.accum_steps(a.batch_size),
        resolved.precision,
        if resolved.recompute_bn_relu {
            ", BN+ReLU recomputed"
        } else {
            ""
        },
        fmt_bytes(resolved.predicted.peak_total)
    );
    if let Some(note) = bf16_emulation_note(resolved.precision) {
        eprintln!("{note}");
    }
    if a.memory.scaler_init.is_nan() || a.memory.scaler_init <= 0.0 {
        bail!("--scaler-init must be a positive number");
    }
    let scaler = (resolved.precision == Precision::F16)
        .then(|| GradScaler::new(a.memory.scaler_init, a.memory.scaler_growth_interval));
    // The hard budget from here on: the allocator refuses to cross it.
    pool.set_budget(budget);
    let fingerprint = run_fingerprint(&FingerprintInputs {
        model: &a.model,
        base_width,
        stem: a.stem.into(),
        classes,
        precision: resolved.precision,
        recompute_bn_relu: resolved.recompute_bn_relu,
        bn,
        data: &a.data.data,
        image_size: size,
        batch_size: a.batch_size,
        micro_batch: resolved.micro_batch,
        optimizer: a.optimizer.into(),
        lr: a.lr,
        momentum: a.momentum,
        nesterov: a.nesterov,
        weight_decay: a.weight_decay,
        schedule: a.schedule.into(),
        warmup_epochs: a.warmup_epochs,
        total_steps,
        label_smoothing: a.label_smoothing,
        clip_grad_norm: a.clip_grad_norm,
        seed: a.seed,
        shuffle: !a.no_shuffle,
    });
    let mut scaler = scaler;
    let mut resume_step = 0;
    if let Some(from) = &a.resume {
        let r = load_state(from, &pool, &mut model, &mut optimizer, &fingerprint)?;
        outln!(
            "resuming from {} after optimizer step {}",
            r.path.display(),
            r.step
        );
        resume_step = r.step;
        if r.scaler.is_some() {
            scaler = r.scaler;
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing a signal handler")?;
    }
    let opts = TrainOptions {
        epochs,
        max_steps: a.steps,
        progress: true,
        batch_size: a.batch_size,
        micro_batch: Some(resolved.micro_batch),
        plan: Some(resolved.plan.clone()),
        predicted_peak: Some(resolved.predicted.peak_total),
        memory_trace: a.memory.memory_trace.clone(),
        seed: a.seed,
        shuffle: !a.no_shuffle,
        label_smoothing: a.label_smoothing,
        base_lr: a.lr,
        schedule: lr_schedule,
        clip_grad_norm: a.clip_grad_norm,
        eval_every: a.eval_every,
        metrics_jsonl: a.metrics_jsonl.clone(),
        scaler,
        inject_inf_steps: Vec::new(),
        nan_policy: match a.nan_policy {
            NanPolicyArg::Stop => NanPolicy::Stop,
            NanPolicyArg::Skip => NanPolicy::Skip,
        },
        workers: data.workers,
        save_every_epochs: a
            .save_every_epochs
            .or((a.save_every_steps.is_none()).then_some(1)),
        save_dir: a.save_dir.clone(),
        save_every_steps: a.save_every_steps,
        keep_states: a.keep_checkpoints,
        fingerprint,
        resume_step,
        stop: Some(stop),
    };
    let start = Instant::now();
    let reports = fit(
        &mut model,
        &pool,
        &mut optimizer,
        train_set,
        val_set,
        &opts,
        |r| {
            let eval = r.eval.map_or(String::new(), |e| {
                format!(
                    ", val loss {:.4}, val top-1 {:.2}%, top-5 {:.2}%",
                    e.loss,
                    100.0 * e.top1,
                    100.0 * e.top5
                )
            });
            outln!(
                "epoch {}: train loss {:.4}, train top-1 {:.1}%{eval}, lr {:.4}, {:.0} img/s, tracked peak {}",
                r.epoch,
                r.train_loss,
                100.0 * r.train_top1,
                r.lr,
                r.img_per_s,
                fmt_bytes(r.memory.peak_total)
            );
            if r.skipped > 0 {
                outln!("skipped {} unreadable files", r.skipped);
            }
        },
    )?;
    outln!("trained in {:.1} s", start.elapsed().as_secs_f64());
    if let Some(last) = reports.last() {
        print_memory(&last.memory);
        let (p, m) = (resolved.predicted.peak_total, last.memory.peak_total);
        outln!(
            "predicted peak {} vs measured {} ({:+.2}%){}",
            fmt_bytes(p),
            fmt_bytes(m),
            100.0 * (m as f64 - p as f64) / p.max(1) as f64,
            // The prediction is of the steady state: from the second step
            // on, the optimizer state is live during forward and backward.
            if total_steps.saturating_sub(resume_step) < 2 {
                "; the prediction is for the steady state from step 2, this run took fewer steps"
            } else {
                ""
            }
        );
    }
    if let Some(path) = &a.memory.memory_trace {
        outln!("memory trace written to {}", path.display());
    }
    if let Some(path) = &a.save_weights {
        save_state_dict(&mut model, path)?;
        outln!("saved weights to {}", path.display());
    }
    Ok(())
}

fn eval(a: EvalArgs) -> Result<()> {
    if a.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let pool = Pool::new();
    let data = load_data(&a.data.options(), a.seed)?;
    let (val_set, size) = (&*data.val, data.size);
    if val_set.is_empty() {
        bail!("no validation images: pass --val-data, or a --val-fraction above 0");
    }
    let file = TensorFile::open(&a.weights)?;
    let classes = fc_rows(&file).unwrap_or(val_set.classes());
    let mut model = ModelSpec {
        name: a.model.clone(),
        base_width: a.data.base_width(a.base_width),
        stem: a.stem.into(),
        num_classes: classes,
        seed: 0,
    }
    .build(&pool)?;
    load_torchvision(&mut model, &file, false)?;
    model.check_image_size(size, size)?;
    let e = evaluate(&mut model, &pool, val_set, a.batch_size, data.workers)?;
    outln!(
        "{} images: loss {:.4}, top-1 {:.2}%, top-5 {:.2}%",
        e.samples,
        e.loss,
        100.0 * e.top1,
        100.0 * e.top5
    );
    if e.skipped > 0 {
        outln!("skipped {} unreadable files", e.skipped);
    }
    Ok(())
}
