//! The `memfit` command line.

use std::ffi::OsString;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use std::path::PathBuf;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};

use memfit::data::{
    Dataset, ImageFolder, ImageFolderDataset, InMemoryDataset, SyntheticGratings, Transform,
    load_digits, load_fashion_mnist,
};
use memfit::exec::{LossOptions, forward_backward};
use memfit::io::{TensorFile, fc_rows, load_torchvision, save_state_dict};
use memfit::memory::{Category, MemoryStats, Pool, Tag, fmt_bytes, parse_bytes};
use memfit::nn::{BnPolicy, Precision, ResNet, ResNetConfig, StemKind};
use memfit::optim::{AdamW, GradScaler, LrSchedule, Schedule, Sgd};
use memfit::plan::{PlanRequest, Strategy, TimeModel, report, resolve, simulate_training};
use memfit::train::checkpoint::{check_save_dir, load_checkpoint};
use memfit::train::{NanPolicy, Optimizer, TrainOptions, evaluate, fit};

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
        if self.precision == "auto" {
            return Ok(None);
        }
        Ok(Some(self.precision.parse()?))
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

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OptimizerKind {
    Sgd,
    Adamw,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ScheduleKind {
    Constant,
    Step,
    Cosine,
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
    /// Channels of the stem and layer1 (torchvision: 64).
    #[arg(long, default_value_t = 16)]
    base_width: usize,
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
    #[arg(long, default_value_t = 16)]
    base_width: usize,
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
fn peak_rss_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn print_memory(stats: &MemoryStats) {
    println!(
        "tracked peak: {} (reserved now {})",
        fmt_bytes(stats.peak_total),
        fmt_bytes(stats.reserved)
    );
    println!("  {:<12} {:>12} {:>12}", "category", "at peak", "own peak");
    for c in Category::ALL {
        println!(
            "  {:<12} {:>12} {:>12}",
            c.name(),
            fmt_bytes(stats.at_peak.get(c)),
            fmt_bytes(stats.peak.get(c))
        );
    }
    if let Some(rss) = peak_rss_bytes() {
        println!("process peak RSS: {}", fmt_bytes(rss));
    }
}

/// What one `bench step` measured.
struct StepResult {
    plan: String,
    /// Forward FLOPs the plan recomputes over the FLOPs of a plain step
    /// (forward + backward = 3 forwards).
    recompute_fraction: f64,
    precision: Precision,
    micro_batch: usize,
    median_seconds: f64,
    measured: MemoryStats,
    predicted: usize,
}

fn bench_step(a: StepArgs) -> Result<()> {
    let r = measure_steps(&a, true)?;
    print_memory(&r.measured);
    println!(
        "predicted peak {} vs measured {}",
        fmt_bytes(r.predicted),
        fmt_bytes(r.measured.peak_total)
    );
    Ok(())
}

/// Runs warm-up + timed steps of `a` on a fixed synthetic batch.
fn measure_steps(a: &StepArgs, verbose: bool) -> Result<StepResult> {
    if a.batch_size == 0 || a.steps == 0 {
        bail!("--batch-size and --steps must be at least 1");
    }
    let budget = a
        .memory_budget
        .as_deref()
        .map(parse_bytes)
        .transpose()
        .context("--memory-budget")?;
    let pool = Pool::new();
    let mut config = ResNetConfig::by_name(&a.model.model)?;
    config.base_width = a.model.base_width;
    config.stem = a.model.stem.into();
    config.num_classes = a.model.num_classes;
    config.seed = a.model.seed;
    let fixed_precision = a.precision.parse()?;
    config.precision = fixed_precision.unwrap_or_default();
    config.recompute_bn_relu = a.precision.recompute_bn_relu;
    let mut model = ResNet::new(&pool, config)?;
    model.check_image_size(a.image_size, a.image_size)?;
    let params = model.param_count();
    let (n, s) = (a.batch_size, a.image_size);
    println!(
        "{} (base width {}, {:?} stem), {params} parameters, batch {n} at {s}x{s}, {} threads",
        a.model.model,
        a.model.base_width,
        StemKind::from(a.model.stem),
        rayon::current_num_threads()
    );
    let predicted_saved: usize = model.saved_bytes_per_stage(n, s, s).iter().sum();
    println!(
        "saved activations (closed form): {}",
        fmt_bytes(predicted_saved)
    );

    // A fixed synthetic batch, as the PyTorch baseline uses.
    let data = SyntheticGratings::generate(n, s, a.model.num_classes.min(1000), 1);
    let labels = data.labels.clone();
    let mut sgd = Sgd::new(0.1, 0.9, 0.0, false);
    let resolved = resolve(&PlanRequest {
        config: &model.config,
        bn: BnPolicy::Batch,
        optimizer: &Optimizer::Sgd(Sgd::new(0.1, 0.9, 0.0, false)),
        batch: n,
        micro_batch: a.micro_batch,
        image_size: s,
        budget,
        strategy: a.checkpoint.parse()?,
        auto_precision: fixed_precision.is_none(),
        time_model: a.time_model.parse()?,
    })?;
    model.set_precision(resolved.precision);
    let (plan, micro) = (resolved.plan.clone(), resolved.micro_batch);
    // The bench runs training steps only: predict those, without evaluation.
    let predicted = simulate_training(
        &model.config,
        BnPolicy::Batch,
        &Optimizer::Sgd(Sgd::new(0.1, 0.9, 0.0, false)),
        &plan,
        micro,
        s,
    )?
    .peak_total;
    println!(
        "plan {plan} at micro-batch {micro}, {}{}; predicted peak {}",
        resolved.precision,
        if resolved.recompute_bn_relu {
            ", BN+ReLU recomputed"
        } else {
            ""
        },
        fmt_bytes(predicted)
    );
    note_if_bf16_is_emulated(resolved.precision);
    pool.set_budget(budget);
    let mut times = Vec::new();
    let mut timed_from = pool.stats();
    for i in 0..a.warmup + a.steps {
        if i == a.warmup {
            pool.reset_peak();
            timed_from = pool.stats();
            memfit::profile::enable(a.profile);
        }
        let t = Instant::now();
        model.zero_grad();
        let mut loss = 0.0;
        let px = s * s * 3;
        for start in (0..n).step_by(micro) {
            let m = micro.min(n - start);
            let images = pool.from_f32(
                &[m, s, s, 3],
                &data.images[start * px..(start + m) * px],
                Category::Data,
                Tag::fixed("batch.images"),
            )?;
            let o = forward_backward(
                &mut model,
                &pool,
                &plan,
                images,
                &labels[start..start + m],
                LossOptions {
                    label_smoothing: 0.0,
                    window_samples: Some(n),
                    scale: None,
                },
            )?;
            loss += o.loss * m as f64 / n as f64;
        }
        sgd.step(&pool, &mut model)?;
        let secs = t.elapsed().as_secs_f64();
        let kind = if i < a.warmup { "warm-up" } else { "step" };
        if verbose {
            println!("{kind} {}: loss {loss:.4}, {secs:.3} s", i + 1);
        }
        if i >= a.warmup {
            times.push(secs);
        }
    }
    let total: f64 = times.iter().sum();
    // Memory the cache could not serve: fresh pages cost faults and zeroing.
    let now = pool.stats();
    let fresh = now.system_alloc_bytes - timed_from.system_alloc_bytes;
    let (fresh_n, reused) = (
        now.system_allocs - timed_from.system_allocs,
        now.reuses - timed_from.reuses,
    );
    println!(
        "system allocations per timed step: {:.1} ({}); {reused} of {} requests served from the cache",
        fresh_n as f64 / a.steps as f64,
        fmt_bytes(fresh / a.steps),
        reused + fresh_n
    );
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!("median {median:.3} s/step, {:.2} img/s", n as f64 / median);
    if a.profile {
        let totals = memfit::profile::totals();
        memfit::profile::enable(false);
        print_profile(&totals, total, a.steps);
    }
    let stages = &resolved.costs.stages;
    let forward: f64 = stages.iter().map(|st| st.forward_flops).sum();
    let recomputed: f64 = plan
        .segments
        .iter()
        .filter(|seg| seg.recompute)
        .flat_map(|seg| seg.start..seg.end)
        .map(|i| stages[i].forward_flops)
        .sum();
    Ok(StepResult {
        plan: plan.to_string(),
        recompute_fraction: recomputed / (3.0 * forward).max(1.0),
        precision: resolved.precision,
        micro_batch: micro,
        median_seconds: median,
        measured: pool.stats(),
        predicted,
    })
}

/// One row of `bench strategies`.
struct StrategyRow {
    name: String,
    checkpoint: String,
    micro_batch: Option<usize>,
    precision: &'static str,
    recompute_bn_relu: bool,
    /// For `auto`: this fraction of the no-plan row's measured peak.
    budget_fraction: Option<f64>,
}

/// The `--profile` table: seconds per step per op family, share of the
/// step, and GFLOP/s where the family does FLOPs.
fn print_profile(totals: &[(memfit::profile::Family, f64, f64)], total: f64, steps: usize) {
    let per = |x: f64| x / steps.max(1) as f64;
    println!("| op family | s/step | share | GFLOP/s |\n|---|---|---|---|");
    let mut accounted = 0.0;
    for (f, secs, flops) in totals {
        accounted += secs;
        let rate = if *flops > 0.0 && *secs > 0.0 {
            format!("{:.1}", flops / secs / 1e9)
        } else {
            "-".into()
        };
        println!(
            "| {} | {:.3} | {:.0}% | {rate} |",
            f.name(),
            per(*secs),
            100.0 * secs / total.max(1e-12)
        );
    }
    let rest = (total - accounted).max(0.0);
    println!(
        "| other (ReLU, pooling, add, loss, conversions, optimizer) | {:.3} | {:.0}% | - |",
        per(rest),
        100.0 * rest / total.max(1e-12)
    );
}

fn bench_strategies(a: StrategiesArgs) -> Result<()> {
    let quarter = (a.batch_size / 4).max(1);
    let row = |name: &str, checkpoint: &str| StrategyRow {
        name: name.to_string(),
        checkpoint: checkpoint.to_string(),
        micro_batch: None,
        precision: "fp32",
        recompute_bn_relu: false,
        budget_fraction: None,
    };
    let mut rows = vec![
        row("none", "none"),
        row("segments:2", "segments:2"),
        row("segments:4", "segments:4"),
        row("segments:8", "segments:8"),
        row("stages:layer1,layer2,layer4", "stages:layer1,layer2,layer4"),
        StrategyRow {
            precision: "bf16",
            ..row("bf16", "none")
        },
        StrategyRow {
            precision: "f16",
            ..row("f16", "none")
        },
        StrategyRow {
            micro_batch: Some(quarter),
            ..row(&format!("micro-batch {quarter}"), "none")
        },
        StrategyRow {
            recompute_bn_relu: true,
            ..row("BN+ReLU recompute", "none")
        },
    ];
    for f in [0.75, 0.5, 0.35] {
        rows.push(StrategyRow {
            budget_fraction: Some(f),
            ..row(&format!("auto @ {:.0}% of none", 100.0 * f), "auto")
        });
    }
    println!(
        "{} (base width {}), batch {} at {}x{}, {} threads, {} timed step(s) each, {} round(s)",
        a.model.model,
        a.model.base_width,
        a.batch_size,
        a.image_size,
        a.image_size,
        rayon::current_num_threads(),
        a.steps,
        a.rounds
    );
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    // Each row's results over the rounds, by row; a row whose budget is
    // below the smallest plan in the first round stays empty.
    let mut runs: Vec<Vec<StepResult>> = rows.iter().map(|_| Vec::new()).collect();
    let mut none_peak = None;
    for round in 0..a.rounds {
        for (r, run) in rows.iter().zip(&mut runs) {
            if round > 0 && run.is_empty() {
                continue;
            }
            let budget = match (r.budget_fraction, none_peak) {
                (Some(f), Some(peak)) => Some(format!("{}", (peak as f64 * f) as usize)),
                _ => None,
            };
            let step = StepArgs {
                model: a.model.clone(),
                image_size: a.image_size,
                batch_size: a.batch_size,
                steps: a.steps,
                warmup: a.warmup,
                memory_budget: budget,
                checkpoint: r.checkpoint.clone(),
                time_model: a.time_model.clone(),
                micro_batch: r.micro_batch,
                precision: PrecisionArgs {
                    precision: r.precision.to_string(),
                    recompute_bn_relu: r.recompute_bn_relu,
                },
                profile: false,
            };
            eprintln!(
                "running {} (round {} of {}) ...",
                r.name,
                round + 1,
                a.rounds
            );
            match measure_steps(&step, false) {
                Ok(m) => {
                    none_peak.get_or_insert(m.measured.peak_total);
                    run.push(m);
                }
                // A budget below the smallest plan is a result too, not a failure.
                Err(e) if r.budget_fraction.is_some() => eprintln!("{}: {e:#}", r.name),
                Err(e) => return Err(e),
            }
        }
    }
    let results: Vec<(String, StepResult)> = rows
        .iter()
        .zip(runs)
        .filter(|(_, run)| !run.is_empty())
        .map(|(r, run)| (r.name.clone(), median_round(&r.name, run)))
        .collect();
    let (base_peak, base_time) = (
        results[0].1.measured.peak_total as f64,
        results[0].1.median_seconds,
    );
    // A checkpoint plan should cost no more than the forward it recomputes
    // (plus 5% slack): bound = 1 + recomputed forward FLOPs / step FLOPs + 0.05.
    let header = "| strategy | plan | micro-batch | precision | peak | activations at peak | memory ratio | s/step | time ratio | recompute bound | predicted peak |";
    println!("{header}\n|---|---|---|---|---|---|---|---|---|---|---|");
    let mut csv = String::from(
        "tool,strategy,plan,micro_batch,precision,peak_bytes,activations_bytes,memory_ratio,seconds_per_step,time_ratio,recompute_bound,predicted_peak_bytes\n",
    );
    for (name, r) in &results {
        let m = &r.measured;
        let act = m.at_peak.get(Category::Activations);
        let (mr, tr) = (
            m.peak_total as f64 / base_peak,
            r.median_seconds / base_time,
        );
        let bound = (r.recompute_fraction > 0.0).then_some(1.0 + r.recompute_fraction + 0.05);
        let bound_cell = bound.map_or("-".to_string(), |b| {
            format!("{b:.2} ({})", if tr <= b { "within" } else { "over" })
        });
        println!(
            "| {name} | {} | {} | {} | {} | {} | {mr:.2} | {:.3} | {tr:.2} | {bound_cell} | {} |",
            r.plan,
            r.micro_batch,
            r.precision,
            fmt_bytes(m.peak_total),
            fmt_bytes(act),
            r.median_seconds,
            fmt_bytes(r.predicted)
        );
        csv += &format!(
            "memfit,\"{name}\",\"{}\",{},{},{},{act},{mr:.4},{:.4},{tr:.4},{},{}\n",
            r.plan,
            r.micro_batch,
            r.precision,
            m.peak_total,
            r.median_seconds,
            bound.map_or(String::new(), |b| format!("{b:.4}")),
            r.predicted
        );
    }
    csv += &pytorch_rows(&a)?;
    if let Some(path) = &a.csv {
        std::fs::write(path, csv).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The round with the median time (its plan, peak and time belong
/// together). Measured stage times can move `auto`'s plan between rounds:
/// that is said, not hidden.
fn median_round(name: &str, mut v: Vec<StepResult>) -> StepResult {
    let plans: std::collections::BTreeSet<&str> = v.iter().map(|r| r.plan.as_str()).collect();
    if plans.len() > 1 {
        println!(
            "{name}: the plan differed between rounds ({}); the median round's is reported",
            plans.into_iter().collect::<Vec<_>>().join(" | ")
        );
    }
    v.sort_by(|x, y| x.median_seconds.total_cmp(&y.median_seconds));
    v.swap_remove(v.len() / 2)
}

/// Prints the PyTorch baseline's rows for `a`'s configuration, when its
/// results file exists, and returns them as CSV lines.
fn pytorch_rows(a: &StrategiesArgs) -> Result<String> {
    let path = &a.pytorch_results;
    if !path.exists() {
        println!(
            "(no PyTorch baseline at {}: its rows are left out)",
            path.display()
        );
        return Ok(String::new());
    }
    let rows = memfit::baseline::load(path, a.image_size, a.batch_size)?;
    let Some(plain) = rows.iter().find(|r| r.strategy == "plain") else {
        println!(
            "(the PyTorch baseline {} has no plain run at {}x{} batch {})",
            path.display(),
            a.image_size,
            a.image_size,
            a.batch_size
        );
        return Ok(String::new());
    };
    println!(
        "\nPyTorch {} (from {}; another day, maybe another host: compare its ratios, each against its own plain run, not its times):",
        plain.torch,
        path.display()
    );
    println!(
        "| PyTorch strategy | nearest memfit row | micro-batch | peak | memory ratio | s/step | time ratio | runs timed / all |\n|---|---|---|---|---|---|---|---|"
    );
    let cell =
        |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
    let csv_cell = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
    let mut csv = String::new();
    for r in &rows {
        let mr = r.peak_bytes / plain.peak_bytes;
        let tr = r.seconds.zip(plain.seconds).map(|(s, p)| s / p);
        println!(
            "| {} | {} | {} | {} | {mr:.2} | {} | {} | {}/{} |",
            r.strategy,
            r.memfit_name,
            r.micro_batch,
            fmt_bytes(r.peak_bytes as usize),
            cell(r.seconds, 3),
            cell(tr, 2),
            r.clean_runs,
            r.runs
        );
        let precision = if r.strategy == "bf16" { "bf16" } else { "fp32" };
        csv += &format!(
            "pytorch,\"{}\",,{},{precision},{:.0},,{mr:.4},{},{},,\n",
            r.strategy,
            r.micro_batch,
            r.peak_bytes,
            csv_cell(r.seconds),
            csv_cell(tr),
        );
    }
    Ok(csv)
}

fn bench_max_batch(a: MaxBatchArgs) -> Result<()> {
    let budget = parse_bytes(&a.memory_budget).context("--memory-budget")?;
    let mut config = ResNetConfig::by_name(&a.model.model)?;
    config.base_width = a.model.base_width;
    config.stem = a.model.stem.into();
    config.num_classes = a.model.num_classes;
    let optimizer = Optimizer::Sgd(Sgd::new(0.1, 0.9, 0.0, false));
    let fits = |strategy: &str,
                precision: Precision,
                bn_relu: bool,
                batch: usize|
     -> Result<Option<usize>> {
        let config = ResNetConfig {
            precision,
            recompute_bn_relu: bn_relu,
            ..config.clone()
        };
        let request = PlanRequest {
            config: &config,
            bn: BnPolicy::Batch,
            optimizer: &optimizer,
            batch,
            micro_batch: Some(batch),
            image_size: a.image_size,
            budget: Some(budget),
            strategy: strategy.parse()?,
            auto_precision: false,
            // Only whether a plan fits matters here, and that is bytes alone.
            time_model: TimeModel::Flops,
        };
        match resolve(&request) {
            Ok(r) => Ok(Some(r.predicted.peak_total)),
            Err(memfit::Error::BudgetTooSmall { .. } | memfit::Error::InvalidArgument { .. }) => {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    };
    println!(
        "{} (base width {}), {}x{}, SGD with momentum, budget {}: largest batch with no accumulation",
        a.model.model,
        a.model.base_width,
        a.image_size,
        a.image_size,
        fmt_bytes(budget)
    );
    println!(
        "| strategy | precision | largest batch | predicted peak | vs none fp32 |\n|---|---|---|---|---|"
    );
    let mut none = None;
    let f32_ = Precision::F32;
    for (label, strategy, precision, bn_relu) in [
        ("none", "none", f32_, false),
        ("segments:2", "segments:2", f32_, false),
        ("segments:4", "segments:4", f32_, false),
        ("segments:8", "segments:8", f32_, false),
        (
            "stages:layer1,layer2,layer4",
            "stages:layer1,layer2,layer4",
            f32_,
            false,
        ),
        ("BN+ReLU recompute", "none", f32_, true),
        ("none", "none", Precision::BF16, false),
        ("auto", "auto", f32_, false),
        ("auto + BN+ReLU recompute", "auto", f32_, true),
        ("auto", "auto", Precision::BF16, false),
        ("auto + BN+ReLU recompute", "auto", Precision::BF16, true),
    ] {
        let fits = |batch| fits(strategy, precision, bn_relu, batch);
        // Bisect on the largest batch that fits (fitting is monotone in it).
        let (mut lo, mut hi) = (0usize, 1usize);
        while fits(hi)?.is_some() && hi < 1 << 16 {
            lo = hi;
            hi *= 2;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid)?.is_some() {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let peak = if lo > 0 { fits(lo)? } else { None };
        let base = *none.get_or_insert(lo);
        println!(
            "| {label} | {precision} | {lo} | {} | {} |",
            peak.map_or("-".to_string(), fmt_bytes),
            if base > 0 {
                format!("{:.2}x", lo as f64 / base as f64)
            } else {
                "-".to_string()
            }
        );
    }
    Ok(())
}

/// The datasets `train` and `eval` use.
struct Data {
    train: Box<dyn Dataset>,
    val: Box<dyn Dataset>,
    /// Side of the square images both yield.
    size: usize,
    /// Loader threads: only files are worth loading ahead.
    workers: usize,
}

/// (train, validation) sets at the requested image size.
fn load_data(a: &DataArgs, seed: u64) -> Result<Data> {
    // Before any data is generated or resized: a zero side would reach the
    // kernels as empty tensors.
    if a.image_size == Some(0) {
        bail!("--image-size must be at least 1");
    }
    let builtin = ["digits", "fashion-mnist", "synthetic"].contains(&a.data.as_str());
    if !builtin {
        return load_folders(a, seed);
    }
    if a.val_data.is_some() {
        bail!(
            "--val-data needs an image folder as --data, not '{}'",
            a.data
        );
    }
    let (train, val, native) = match a.data.as_str() {
        "digits" => {
            let (t, v) = load_digits(a.val_fraction, seed)?;
            (t, v, 32)
        }
        "fashion-mnist" => {
            let (t, v) = load_fashion_mnist()?;
            (t, v, 28)
        }
        _ => {
            if a.classes < 2 {
                bail!("--classes must be at least 2");
            }
            let size = a.image_size.unwrap_or(32);
            let t = SyntheticGratings::generate(
                a.train_size,
                size,
                a.classes,
                seed.wrapping_mul(2).wrapping_add(1),
            );
            let v = SyntheticGratings::generate(
                a.val_size,
                size,
                a.classes,
                seed.wrapping_mul(2).wrapping_add(2),
            );
            (t, v, size)
        }
    };
    let size = a.image_size.unwrap_or(native);
    let (train, val): (InMemoryDataset, InMemoryDataset) = (train.resized(size), val.resized(size));
    Ok(Data {
        train: Box::new(train),
        val: Box::new(val),
        size,
        workers: 0,
    })
}

/// `--data DIR` (and `--val-data DIR`): image folders decoded on the fly.
fn load_folders(a: &DataArgs, seed: u64) -> Result<Data> {
    let root = PathBuf::from(&a.data);
    if !root.is_dir() {
        bail!(
            "unknown dataset '{}' (choose digits, fashion-mnist, synthetic or an image folder)",
            a.data
        );
    }
    let size = a.image_size.unwrap_or(224);
    let folder = ImageFolder::scan(&root)?;
    let (train, val) = match &a.val_data {
        Some(v) => {
            let val = ImageFolder::scan(v)?;
            if val.classes != folder.classes {
                bail!(
                    "{}: class folders {:?} differ from those of {}: {:?} (labels would not match)",
                    v.display(),
                    val.classes,
                    root.display(),
                    folder.classes
                );
            }
            (folder, val)
        }
        None => folder.split(a.val_fraction, seed)?,
    };
    let (train_tf, val_tf) = if a.no_augment {
        (Transform::no_augment(size), Transform::no_augment(size))
    } else {
        (Transform::train(size), Transform::eval(size))
    };
    Ok(Data {
        train: Box::new(ImageFolderDataset {
            folder: train,
            transform: train_tf,
            seed,
        }),
        val: Box::new(ImageFolderDataset {
            folder: val,
            transform: val_tf,
            seed,
        }),
        size,
        workers: a.workers,
    })
}

fn build_model(
    pool: &Pool,
    name: &str,
    base_width: usize,
    stem: StemKind,
    classes: usize,
    seed: u64,
) -> Result<ResNet> {
    let mut config = ResNetConfig::by_name(name)?;
    config.base_width = base_width;
    config.stem = stem;
    config.num_classes = classes;
    config.seed = seed;
    Ok(ResNet::new(pool, config)?)
}

/// `train`, or with `plan_only` just the plan report (`memfit plan`).
fn train(a: TrainArgs, plan_only: bool) -> Result<()> {
    if a.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let budget = a
        .memory
        .memory_budget
        .as_deref()
        .map(parse_bytes)
        .transpose()
        .context("--memory-budget")?;
    let strategy: Strategy = a.memory.checkpoint.parse()?;
    let fixed_precision = a.memory.precision.parse()?;
    let micro_batch = match (a.memory.micro_batch, a.memory.accum_steps) {
        (Some(m), _) => Some(m),
        (None, Some(0)) => bail!("--accum-steps must be at least 1"),
        (None, Some(k)) => Some(a.batch_size.div_ceil(k)),
        (None, None) => None,
    };
    let bn = match a.memory.bn {
        BnKind::Batch => BnPolicy::Batch,
        BnKind::Frozen => BnPolicy::Frozen,
    };
    let pool = Pool::new();
    let data = load_data(&a.data, a.seed)?;
    let (train_set, val_set, size) = (&*data.train, &*data.val, data.size);
    let init = a.init.as_ref().map(TensorFile::open).transpose()?;
    // The dataset decides the classes; without --reset-head they must match --init's fc.
    let init_rows = match (&init, a.reset_head) {
        (Some(f), false) => fc_rows(f),
        _ => None,
    };
    let classes = a.num_classes.or(init_rows).unwrap_or(train_set.classes());
    if classes < train_set.classes() {
        bail!(
            "{} classes are too few: the dataset has labels 0..{}",
            classes,
            train_set.classes() - 1
        );
    }
    if let (Some(f), Some(rows)) = (&init, init_rows)
        && rows != classes
    {
        bail!(
            "{}: fc has {rows} classes but the model has {classes}; pass --reset-head to fine-tune with a new head",
            f.path
        );
    }
    if a.steps == Some(0) {
        bail!("--steps must be at least 1");
    }
    let mut model = build_model(
        &pool,
        &a.model,
        a.base_width,
        a.stem.into(),
        classes,
        a.seed,
    )?;
    if let Some(f) = &init {
        load_torchvision(&mut model, f, a.reset_head)?;
    }
    model.check_image_size(size, size)?;
    model.set_bn_policy(bn);
    model.set_precision(fixed_precision.unwrap_or_default());
    model.set_recompute_bn_relu(a.memory.precision.recompute_bn_relu);
    println!(
        "training {} (base width {}, {:?} stem, {} parameters) on {}: {} classes, {} train / {} val images at {size}x{size}",
        a.model,
        a.base_width,
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
    let schedule = match a.schedule {
        ScheduleKind::Constant => Schedule::Constant,
        ScheduleKind::Step => Schedule::Step {
            step_size: a.step_epochs * steps_per_epoch,
            gamma: a.gamma,
        },
        ScheduleKind::Cosine => Schedule::Cosine {
            total_steps,
            min_lr: 0.0,
        },
    };
    let mut lr_schedule = LrSchedule::new(schedule);
    if a.warmup_epochs > 0 {
        lr_schedule = lr_schedule.with_warmup(a.warmup_epochs * steps_per_epoch);
    }
    let mut optimizer = match a.optimizer {
        OptimizerKind::Sgd => Optimizer::Sgd(Sgd::new(
            a.lr,
            a.momentum,
            a.weight_decay.unwrap_or(5e-4),
            a.nesterov,
        )),
        OptimizerKind::Adamw => Optimizer::AdamW(AdamW::with_params(
            a.lr,
            (0.9, 0.999),
            1e-8,
            a.weight_decay.unwrap_or(0.01),
        )),
    };
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
        print!("{}", report(&resolved, a.batch_size));
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
    println!(
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
    note_if_bf16_is_emulated(resolved.precision);
    if a.memory.scaler_init.is_nan() || a.memory.scaler_init <= 0.0 {
        bail!("--scaler-init must be a positive number");
    }
    let scaler = (resolved.precision == Precision::F16)
        .then(|| GradScaler::new(a.memory.scaler_init, a.memory.scaler_growth_interval));
    // The hard budget from here on: the allocator refuses to cross it.
    pool.set_budget(budget);
    // Everything the continued run must share with the saved one. Not the
    // plan: gradients are bit-identical under every plan.
    let fingerprint = format!(
        "model={}; base_width={}; stem={:?}; classes={classes}; precision={}; bn_relu_recompute={}; bn={:?}; data={}; image_size={size}; batch_size={}; micro_batch={}; optimizer={:?}; lr={}; momentum={}; nesterov={}; weight_decay={:?}; schedule={:?}; warmup_epochs={}; total_steps={total_steps}; label_smoothing={}; clip_grad_norm={:?}; seed={}; shuffle={}",
        a.model,
        a.base_width,
        StemKind::from(a.stem),
        resolved.precision,
        resolved.recompute_bn_relu,
        bn,
        a.data.data,
        a.batch_size,
        resolved.micro_batch,
        a.optimizer,
        a.lr,
        a.momentum,
        a.nesterov,
        a.weight_decay,
        a.schedule,
        a.warmup_epochs,
        a.label_smoothing,
        a.clip_grad_norm,
        a.seed,
        !a.no_shuffle,
    );
    let mut scaler = scaler;
    let mut resume_step = 0;
    if let Some(from) = &a.resume {
        let r = load_checkpoint(from, &pool, &mut model, &mut optimizer, &fingerprint)?;
        println!(
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
        keep_checkpoints: a.keep_checkpoints,
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
            println!(
                "epoch {}: train loss {:.4}, train top-1 {:.1}%{eval}, lr {:.4}, {:.0} img/s, tracked peak {}",
                r.epoch,
                r.train_loss,
                100.0 * r.train_top1,
                r.lr,
                r.img_per_s,
                fmt_bytes(r.memory.peak_total)
            );
            if r.skipped > 0 {
                println!("skipped {} unreadable files", r.skipped);
            }
        },
    )?;
    println!("trained in {:.1} s", start.elapsed().as_secs_f64());
    if let Some(last) = reports.last() {
        print_memory(&last.memory);
        let (p, m) = (resolved.predicted.peak_total, last.memory.peak_total);
        println!(
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
        println!("memory trace written to {}", path.display());
    }
    if let Some(path) = &a.save_weights {
        save_state_dict(&mut model, path)?;
        println!("saved weights to {}", path.display());
    }
    Ok(())
}

/// PyTorch's rule for batch norm in training: every channel needs more than
/// one value (`Expected more than 1 value per channel when training`). With
/// 1x1 maps before the head that means micro-batches of at least 2; memfit
/// would otherwise normalise every value to 0 and train on nothing.
fn check_bn_values(
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
        bail!(
            "batch norm needs more than one value per channel in training, but {size}x{size} images leave {h}x{w} maps before the head and a micro-batch can hold 1 image (batch {batch}, micro-batch {micro}): use micro-batches of at least 2 images (and a batch size that is not 1 more than a multiple of them), larger images, or --bn frozen"
        );
    }
    Ok(())
}

/// The file `path` can be created: its folder exists and it is not a
/// folder itself.
fn check_output_file(path: &std::path::Path, flag: &str) -> Result<()> {
    if path.is_dir() {
        bail!(
            "{flag} {}: is a directory, expected a file path",
            path.display()
        );
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    if !dir.is_dir() {
        bail!(
            "{flag} {}: the folder '{}' does not exist or is not a directory",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

fn eval(a: EvalArgs) -> Result<()> {
    if a.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let pool = Pool::new();
    let data = load_data(&a.data, a.seed)?;
    let (val_set, size) = (&*data.val, data.size);
    if val_set.is_empty() {
        bail!("no validation images: pass --val-data, or a --val-fraction above 0");
    }
    let file = TensorFile::open(&a.weights)?;
    let classes = fc_rows(&file).unwrap_or(val_set.classes());
    let mut model = build_model(&pool, &a.model, a.base_width, a.stem.into(), classes, 0)?;
    load_torchvision(&mut model, &file, false)?;
    model.check_image_size(size, size)?;
    let e = evaluate(&mut model, &pool, val_set, a.batch_size, data.workers)?;
    println!(
        "{} images: loss {:.4}, top-1 {:.2}%, top-5 {:.2}%",
        e.samples,
        e.loss,
        100.0 * e.top1,
        100.0 * e.top5
    );
    if e.skipped > 0 {
        println!("skipped {} unreadable files", e.skipped);
    }
    Ok(())
}

/// bf16 saves memory on every CPU, but only runs faster where the CPU has
/// bf16 dot products; elsewhere its GEMMs are f32 products of rounded
/// operands. Said once, on stderr, so a user comparing speeds knows why.
fn note_if_bf16_is_emulated(precision: Precision) {
    if precision == Precision::BF16 && !memfit::device::cpu::bf16_gemm_available() {
        eprintln!(
            "note: this CPU has no AVX512-BF16, so bf16 GEMMs run as f32 products of bf16-rounded operands: the memory saving holds, the speed-up does not"
        );
    }
}
