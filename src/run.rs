//! The `train`, `plan` and `eval` commands as library calls: a
//! [`TrainConfig`] (the resolved flags of a run) is checked, planned and
//! trained by [`train`], a [`EvalConfig`] evaluated by [`eval`]; both
//! write their report lines to a writer. The command line only parses
//! flags into these structs.
//!
//! Also here: what `memfit train --resume DIR` alone needs. Every state
//! file holds the run's flags ([`RUN_CONFIG_KEY`], a JSON object of flag
//! name to value); [`merge_resumed_flags`] says which of them a resumed
//! run takes over, which flags given again differ (refused) and which may
//! change ([`SAFE_TO_CHANGE`]).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use crate::data::{Data, DataOptions, Dataset, FolderReading, load_data, load_eval_data};
use crate::dist::{Collective, Single, check_same_config};
use crate::error::{Error, Result};
use crate::io::{
    FolderInput, InputMeta, ModelMeta, TensorFile, fc_rows, load_torchvision, save_state_dict_with,
};
use crate::memory::{Category, MemoryStats, Pool, fmt_bytes, parse_bytes};
use crate::nn::{BnPolicy, StemKind};
use crate::optim::{GradScaler, OptimizerKind, ScheduleKind};
use crate::plan::{PlanRequest, Strategy, report, resolve};
use crate::setup::{
    ModelSpec, bf16_emulation_note, check_bn_values, check_output_file, default_base_width,
    gpu_memory_line, head_classes, lr_schedule, parse_precision, per_process_device, pick_device,
    plan_device, requested_micro_batch,
};
use crate::train::state::{
    self, FingerprintInputs, RUN_CONFIG_KEY, StateSaving, check_save_dir, check_save_dir_owner,
    load_state_ignoring, new_run_id, run_fingerprint,
};
use crate::train::{NanPolicy, TrainOptions, evaluate, fit_distributed};

/// The model of a run when neither `--model` nor `--init`'s metadata says.
pub const DEFAULT_MODEL: &str = "resnet18";

/// Everything `memfit train` (and `plan`) runs with: the flags, parsed.
/// `None` for `model`, `base_width` and `stem`: not given (then `--init`'s
/// metadata decides, else the defaults).
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub model: Option<String>,
    pub base_width: Option<usize>,
    pub stem: Option<StemKind>,
    pub data: DataOptions,
    pub epochs: usize,
    pub steps: Option<usize>,
    pub num_classes: Option<usize>,
    pub batch_size: usize,
    pub optimizer: OptimizerKind,
    /// None: [`default_lr`].
    pub lr: Option<f32>,
    pub momentum: f32,
    pub nesterov: bool,
    pub weight_decay: Option<f32>,
    pub schedule: ScheduleKind,
    /// None: [`default_lr`]'s.
    pub warmup_epochs: Option<usize>,
    pub step_epochs: usize,
    pub gamma: f32,
    pub label_smoothing: f32,
    pub clip_grad_norm: Option<f32>,
    pub seed: u64,
    pub shuffle: bool,
    pub eval_every: usize,
    pub metrics_jsonl: Option<PathBuf>,
    /// `--metrics-csv`: the same metrics as CSV.
    pub metrics_csv: Option<PathBuf>,
    /// `--log-every`: a progress line every this many optimizer steps
    /// when stderr is not a terminal (None: about every 30 s).
    pub log_every: Option<usize>,
    pub init: Option<PathBuf>,
    pub reset_head: bool,
    pub save_weights: Option<PathBuf>,
    pub save_dir: Option<PathBuf>,
    pub save_every_steps: Option<usize>,
    pub save_every_epochs: Option<usize>,
    pub keep_checkpoints: usize,
    pub nan_policy: NanPolicy,
    pub resume: Option<PathBuf>,
    /// `--device`: cpu, cuda, cuda:N or auto.
    pub device: String,
    pub memory: MemoryConfig,
    /// The flags as the command line gave them or defaulted them (long
    /// name without `--` → value), saved in every state file so that
    /// `--resume DIR` alone continues the run. The model's architecture is
    /// written into it as resolved.
    pub flags: BTreeMap<String, String>,
}

/// The memory and precision flags of a run.
#[derive(Clone, Debug)]
pub struct MemoryConfig {
    /// `--memory-budget` as given (parsed by [`train`]).
    pub memory_budget: Option<String>,
    pub checkpoint: String,
    pub time_model: String,
    pub micro_batch: Option<usize>,
    pub accum_steps: Option<usize>,
    pub bn: BnPolicy,
    pub memory_trace: Option<PathBuf>,
    pub precision: String,
    pub recompute_bn_relu: bool,
    /// `--strict-fp32`: no TF32 in fp32 convolutions on a GPU.
    pub strict_fp32: bool,
    pub scaler_init: f32,
    pub scaler_growth_interval: u32,
}

/// `memfit eval`'s flags.
#[derive(Clone, Debug)]
pub struct EvalConfig {
    pub model: Option<String>,
    pub base_width: Option<usize>,
    pub stem: Option<StemKind>,
    pub weights: PathBuf,
    pub data: DataOptions,
    pub batch_size: usize,
    pub seed: u64,
    /// `--device`: cpu, cuda, cuda:N or auto.
    pub device: String,
}

/// Flags a resumed run may change: they say how long to train, how to
/// report and where to save, not what is trained; the memory plan (every
/// plan computes the same gradients); the device (as PyTorch's
/// `map_location`); and the start (`--init`), which a resumed run does not
/// use.
pub const SAFE_TO_CHANGE: &[&str] = &[
    "device",
    "strict-fp32",
    "epochs",
    "steps",
    "workers",
    "eval-every",
    "metrics-jsonl",
    "metrics-csv",
    "log-every",
    "save-every-steps",
    "save-every-epochs",
    "keep-checkpoints",
    "save-dir",
    "save-weights",
    "memory-trace",
    "memory-budget",
    "checkpoint",
    "time-model",
    "nan-policy",
];

/// Flags of which one excludes the other: when one is given on resume,
/// the saved value of the other is not taken over.
const EXCLUSIVE: [(&str, &str); 2] = [("epochs", "steps"), ("micro-batch", "accum-steps")];

/// What a resumed run takes over from the saved flags.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResumedFlags {
    /// Flags (long name, value; `"true"` for a switch) to add to the
    /// command line: the saved values of the flags not given again.
    pub take: Vec<(String, String)>,
    /// Safe changes, said to the user: `--epochs 20 (the saved run's 10)`.
    pub notes: Vec<String>,
}

/// Two values of a flag are the same if equal as text or as numbers.
fn same_value(a: &str, b: &str) -> bool {
    a == b || matches!((a.parse::<f64>(), b.parse::<f64>()), (Ok(x), Ok(y)) if x == y)
}

/// Compares the flags of a resumed run (`now`, every flag's value given or
/// defaulted; `given`, those on the command line) with the saved ones: a
/// flag given with another value than saved is an error naming it, unless
/// it is in [`SAFE_TO_CHANGE`] (then a note); flags not given take the
/// saved value.
pub fn merge_resumed_flags(
    saved: &BTreeMap<String, String>,
    now: &BTreeMap<String, String>,
    given: &BTreeSet<String>,
) -> Result<ResumedFlags> {
    let mut out = ResumedFlags::default();
    let mut refused = Vec::new();
    let keys: BTreeSet<&String> = saved.keys().chain(now.keys()).collect();
    for key in keys {
        let (s, n) = (saved.get(key), now.get(key));
        let differs = match (s, n) {
            (Some(a), Some(b)) => !same_value(a, b),
            (None, None) => false,
            // A switch not set is "false".
            (Some(v), None) | (None, Some(v)) => v != "false",
        };
        if given.contains(key.as_str()) {
            if !differs {
                continue;
            }
            let now_s = n.map_or("not set", String::as_str);
            // Said so that it reads whether or not the saved run set it.
            let was = match s {
                Some(v) => format!("the saved run's {v}"),
                None => "the saved run did not set it".into(),
            };
            if SAFE_TO_CHANGE.contains(&key.as_str()) {
                out.notes.push(format!(
                    "--{key} {now_s} ({was}): accepted, it may change on resume"
                ));
            } else {
                refused.push(match s {
                    Some(v) => format!("--{key} {now_s} differs from the saved run's {v}"),
                    None => format!("--{key} {now_s}: {was}"),
                });
            }
        } else if differs && let Some(v) = s {
            let excluded = EXCLUSIVE
                .iter()
                .any(|(a, b)| (key == a && given.contains(*b)) || (key == b && given.contains(*a)));
            if !excluded {
                out.take.push((key.clone(), v.clone()));
            }
        }
    }
    if !refused.is_empty() {
        return Err(Error::Usage(format!(
            "{}; a resumed run keeps the flags it was started with (drop them, or start a new run with another --save-dir). Flags that may change: {}",
            refused.join("; "),
            SAFE_TO_CHANGE
                .iter()
                .map(|f| format!("--{f}"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(out)
}

/// The saved flags of the run `--resume FROM` continues, if its state file
/// holds them (files of older versions do not: their flags must be given
/// again).
pub fn saved_flags(from: &std::path::Path) -> Option<BTreeMap<String, String>> {
    let file = state::resume_file(from).ok()?;
    let meta = state::read_metadata(&file).ok()?;
    let v: serde_json::Value = serde_json::from_str(meta.get(RUN_CONFIG_KEY)?).ok()?;
    Some(
        v.as_object()?
            .iter()
            .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
            .collect(),
    )
}

fn io_out(e: std::io::Error) -> Error {
    Error::Output(e)
}

macro_rules! line {
    ($out:expr, $($arg:tt)*) => {
        writeln!($out, $($arg)*).map_err(io_out)?
    };
}

/// The tracked peak per category and the process's peak RSS.
pub fn write_memory(out: &mut dyn Write, stats: &MemoryStats) -> Result<()> {
    line!(
        out,
        "tracked peak: {} (reserved now {})",
        fmt_bytes(stats.peak_total),
        fmt_bytes(stats.reserved)
    );
    line!(
        out,
        "  {:<12} {:>12} {:>12}",
        "category",
        "at peak",
        "own peak"
    );
    for c in Category::ALL {
        line!(
            out,
            "  {:<12} {:>12} {:>12}",
            c.name(),
            fmt_bytes(stats.at_peak.get(c)),
            fmt_bytes(stats.peak.get(c))
        );
    }
    if let Some(rss) = crate::memory::process_peak_rss_bytes() {
        line!(out, "process peak RSS: {}", fmt_bytes(rss));
    }
    Ok(())
}

/// `--memory-budget`'s bytes.
pub fn parse_budget(s: Option<&str>) -> Result<Option<usize>> {
    s.map(parse_bytes)
        .transpose()
        .map_err(|e| Error::Usage(format!("--memory-budget: {e}")))
}

/// A flag's value: as given, else the file's metadata, else the default.
/// Given and different from the file's is an error naming both.
fn from_flag_or_file<T: PartialEq + std::fmt::Display>(
    flag: &str,
    given: Option<T>,
    file: Option<(T, &str)>,
    default: impl FnOnce() -> T,
) -> Result<T> {
    match (given, file) {
        (Some(g), Some((f, path))) if g != f => Err(Error::Usage(format!(
            "{flag} {g} contradicts {path}, which holds a model with {flag} {f} (drop {flag} to use the file's)"
        ))),
        (Some(g), _) => Ok(g),
        (None, Some((f, _))) => Ok(f),
        (None, None) => Ok(default()),
    }
}

struct StemFlag(StemKind);

impl PartialEq for StemFlag {
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}

impl std::fmt::Display for StemFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(crate::io::stem_flag(self.0))
    }
}

/// Model, base width and stem: the flags, else the file's metadata, else
/// the defaults.
fn architecture(
    model: Option<&String>,
    base_width: Option<usize>,
    stem: Option<StemKind>,
    file: Option<&TensorFile>,
    data: &str,
) -> Result<(String, usize, StemKind)> {
    let meta = file.and_then(ModelMeta::of_file);
    let path = file.map_or("", |f| f.path.as_str());
    let m = meta.as_ref();
    let name = from_flag_or_file(
        "--model",
        model.cloned(),
        m.map(|m| (m.model.clone(), path)),
        || DEFAULT_MODEL.to_string(),
    )?;
    let width = from_flag_or_file(
        "--base-width",
        base_width,
        m.map(|m| (m.base_width, path)),
        || default_base_width(data),
    )?;
    let stem = from_flag_or_file(
        "--stem",
        stem.map(StemFlag),
        m.map(|m| (StemFlag(m.stem), path)),
        || StemFlag(StemKind::ImageNet),
    )?;
    Ok((name, width, stem.0))
}

/// The learning rate a run uses and why (printed).
#[derive(Clone, Debug, PartialEq)]
pub struct LrChoice {
    pub lr: f32,
    pub warmup_epochs: usize,
    /// "0.025 = 0.1 x 64 / 256 (...)": the value and where it came from.
    pub why: String,
}

/// The reference recipe's rate per 256 images of batch (Goyal et al.,
/// "Accurate, Large Minibatch SGD"; torchvision's ResNet recipe).
pub const SGD_LR_PER_256: f32 = 0.1;
/// AdamW's default (PyTorch's), not scaled with the batch.
pub const ADAMW_LR: f32 = 1e-3;

/// `--lr` and `--warmup-epochs` when given; else for SGD the linear
/// scaling rule, `0.1 × batch / 256` (`batch` is the effective batch of an
/// optimizer step, whatever its split into micro-batches or processes),
/// warmed up over 5 epochs (at most a quarter of a run of `epochs`) when
/// that is above 0.1, as the large-batch recipe does; for AdamW 0.001.
pub fn default_lr(
    optimizer: OptimizerKind,
    batch: usize,
    epochs: usize,
    lr: Option<f32>,
    warmup_epochs: Option<usize>,
) -> LrChoice {
    let (lr, mut why, large) = match (lr, optimizer) {
        (Some(lr), _) => (lr, format!("{lr} (--lr)"), false),
        (None, OptimizerKind::Sgd) => {
            let lr = SGD_LR_PER_256 * batch as f32 / 256.0;
            (
                lr,
                format!(
                    "{lr} = {SGD_LR_PER_256} x batch {batch} / 256 (the linear scaling rule; --lr overrides)"
                ),
                lr > SGD_LR_PER_256,
            )
        }
        (None, OptimizerKind::Adamw) => (
            ADAMW_LR,
            format!("{ADAMW_LR} (AdamW's default; --lr overrides)"),
            false,
        ),
    };
    let chosen = warmup_epochs.is_none() && large;
    let warmup_epochs = match warmup_epochs {
        Some(w) => w,
        None if large => (epochs / 4).min(5),
        None => 0,
    };
    if warmup_epochs > 0 {
        why += &format!(
            ", warmed up over {warmup_epochs} epoch{}{}",
            if warmup_epochs == 1 { "" } else { "s" },
            if chosen {
                " (the recipe warms up a scaled lr above 0.1)"
            } else {
                ""
            }
        );
    }
    LrChoice {
        lr,
        warmup_epochs,
        why,
    }
}

/// The class names of a dataset's labels, if it has any (image folders).
fn class_names(data: &Data) -> Option<Vec<String>> {
    data.class_names.clone()
}

/// `memfit train`, or with `plan_only` just the plan report (`memfit
/// plan`). Report lines go to `out`; notes and warnings to stderr.
pub fn train(a: &TrainConfig, plan_only: bool, out: &mut dyn Write) -> Result<()> {
    train_on(a, plan_only, Rc::new(Single), out)
}

/// [`train`] as one process of a data-parallel run over `comm` (see
/// `train::dist`): every process calls it with the same flags. Each plans
/// for its shard of the batch (`⌈batch / processes⌉` samples, the bucket
/// buffers of the gradient sum counted) within its own `--memory-budget`;
/// the processes' configurations are compared before the first step;
/// only rank 0 writes report lines, notes and files.
pub fn train_on(
    a: &TrainConfig,
    plan_only: bool,
    comm: Rc<dyn Collective>,
    out: &mut dyn Write,
) -> Result<()> {
    let (root, processes) = (comm.is_root(), comm.size());
    let mut sink = std::io::sink();
    let out: &mut dyn Write = if root { out } else { &mut sink };
    if a.batch_size == 0 {
        return Err(Error::Usage("--batch-size must be at least 1".into()));
    }
    if a.batch_size < processes {
        return Err(Error::Usage(format!(
            "--batch-size {} is smaller than the {processes} processes of the run: each process trains on its share of every batch, so the batch needs at least one sample per process",
            a.batch_size
        )));
    }
    // What one process trains on per optimizer step (rank 0's share, the
    // largest when the batch does not divide evenly).
    let shard_batch = a.batch_size.div_ceil(processes);
    if a.reset_head && a.init.is_none() {
        return Err(Error::Usage(
            "--reset-head needs --init: it replaces the classifier (fc) of the weights --init \
             loads; without --init every layer, the head included, starts fresh"
                .into(),
        ));
    }
    if a.steps == Some(0) {
        return Err(Error::Usage("--steps must be at least 1".into()));
    }
    if a.steps.is_none() && a.epochs == 0 {
        return Err(Error::Usage(
            "--epochs must be at least 1 (0 would train nothing)".into(),
        ));
    }
    // A --resume file that is no training state is refused before anything
    // is planned or printed.
    if let Some(from) = &a.resume {
        let file = state::resume_file(from)?;
        let meta = state::read_metadata(&file)?;
        state::check_state_format(&file, meta.get(crate::io::STATE_FILE_KEY))?;
    }
    let budget = parse_budget(a.memory.memory_budget.as_deref())?;
    let strategy: Strategy = a.memory.checkpoint.parse()?;
    let fixed_precision = parse_precision(&a.memory.precision)?;
    let micro_batch =
        requested_micro_batch(shard_batch, a.memory.micro_batch, a.memory.accum_steps)?;
    if let Some(m) = micro_batch.filter(|&m| processes > 1 && m > shard_batch) {
        return Err(Error::Usage(format!(
            "--micro-batch {m} is larger than each process's share of the batch ({shard_batch} of {} over {processes} processes)",
            a.batch_size
        )));
    }
    let bn = a.memory.bn;
    let device_flag = per_process_device(&a.device, processes);
    // A plan may be made for a GPU this machine does not have.
    let (device, stand_in) = if plan_only {
        plan_device(&device_flag, root, a.memory.strict_fp32)?
    } else {
        (
            pick_device(&device_flag, root, a.memory.strict_fp32)?,
            false,
        )
    };
    if processes > 1 && device != crate::device::Device::Cpu && !cfg!(feature = "nccl") {
        return Err(Error::Usage(format!(
            "--device {}: data-parallel training on GPUs needs NCCL: rebuild with --features nccl, or use --device cpu",
            a.device
        )));
    }
    // A host budget the machine cannot hold bounds nothing (a GPU's budget
    // is checked against the card by the pool).
    if let Some(w) = budget
        .filter(|_| root && device == crate::device::Device::Cpu)
        .and_then(|b| crate::memory::budget_warning(b, crate::memory::physical_memory_bytes()))
    {
        eprintln!("warning: {w}");
    }
    let pool = Pool::on(device);
    // The arena is shaped by the budget from the first allocation (the
    // weights), as the planner's simulation shapes it: one segment of the
    // budget holds the whole run. The budget itself is enforced once the
    // plan is made.
    pool.shape_segments_by(budget);
    // Synthetic gratings have as many classes as the head unless --classes
    // says otherwise.
    let data_opts = DataOptions {
        classes: a.data.classes.or(a.num_classes),
        ..a.data.clone()
    };
    let data = load_data(&data_opts, a.seed)?;
    let (train_set, val_set, size) = (&*data.train, &*data.val, data.size);
    let init = a.init.as_ref().map(TensorFile::open).transpose()?;
    let classes = head_classes(
        train_set.classes(),
        a.num_classes,
        init.as_ref(),
        a.reset_head,
    )?;
    let (model_name, base_width, stem) = architecture(
        a.model.as_ref(),
        a.base_width,
        a.stem,
        init.as_ref(),
        &a.data.data,
    )?;
    let spec = ModelSpec {
        name: model_name.clone(),
        base_width,
        stem,
        num_classes: classes,
        seed: a.seed,
    };
    let mut model = spec.build(&pool)?;
    if let Some(f) = &init {
        load_torchvision(&mut model, f, a.reset_head)?;
    }
    model.check_image_size(size, size)?;
    model.set_bn_policy(bn);
    model.set_precision(fixed_precision.unwrap_or_default());
    model.set_recompute_bn_relu(a.memory.recompute_bn_relu);
    line!(
        out,
        "{} {} (base width {}, {:?} stem, {} parameters) on {}: {} classes, {} train / {} val images at {size}x{size}",
        if plan_only { "planning" } else { "training" },
        model_name,
        base_width,
        stem,
        model.param_count(),
        a.data.data,
        classes,
        train_set.len(),
        val_set.len(),
    );
    if processes > 1 {
        line!(
            out,
            "data-parallel over {processes} processes: each trains on up to {shard_batch} of every batch of {} and plans its own memory",
            a.batch_size
        );
    }
    let steps_per_epoch = train_set.len().div_ceil(a.batch_size.max(1));
    let epochs = match a.steps {
        Some(steps) => steps.div_ceil(steps_per_epoch),
        None => a.epochs,
    };
    let total_steps = a.steps.unwrap_or(steps_per_epoch * a.epochs);
    let lr = default_lr(a.optimizer, a.batch_size, epochs, a.lr, a.warmup_epochs);
    if !plan_only {
        line!(out, "lr {}", lr.why);
    }
    let lr_schedule = lr_schedule(
        a.schedule,
        steps_per_epoch,
        total_steps,
        a.step_epochs,
        a.gamma,
        lr.warmup_epochs,
    );
    let mut optimizer = a
        .optimizer
        .build(lr.lr, a.momentum, a.weight_decay, a.nesterov);
    let resolved = resolve(&PlanRequest {
        config: &model.config,
        bn,
        optimizer: &optimizer,
        batch: shard_batch,
        micro_batch,
        image_size: size,
        budget,
        strategy,
        auto_precision: fixed_precision.is_none(),
        // A GPU that is not here cannot time its stages.
        time_model: match a.memory.time_model.parse()? {
            _ if stand_in => crate::plan::TimeModel::Flops,
            t => t,
        },
        processes,
    })?;
    model.set_precision(resolved.precision);
    if plan_only {
        write!(out, "{}", report(&resolved, shard_batch)).map_err(io_out)?;
        return Ok(());
    }
    check_bn_values(&model, bn, shard_batch, resolved.micro_batch, size)?;
    // The state file a resumed run continues, and its run (None: a file of
    // the format before run ids).
    let resumed_meta = match &a.resume {
        Some(from) => {
            let file = state::resume_file(from)?;
            state::read_metadata(&file).ok()
        }
        None => None,
    };
    let resumed_id = resumed_meta
        .as_ref()
        .and_then(|m| m.get(state::RUN_ID_KEY).cloned());
    // Where the results go is checked before the first step, not after the
    // last one; a folder holding another run's files is refused.
    // (A --resume file that is no state file is refused below, by name.)
    let resumes_a_state = resumed_meta
        .as_ref()
        .is_some_and(|m| m.contains_key(crate::io::STATE_FILE_KEY));
    if let Some(dir) = &a.save_dir {
        check_save_dir(dir)?;
        if a.resume.is_none() || resumes_a_state {
            check_save_dir_owner(
                dir,
                resumed_id.as_deref(),
                resumed_id.is_none() && a.resume.is_some(),
            )?;
        }
    }
    if let Some(path) = &a.save_weights {
        check_output_file(path, "--save-weights")?;
    }
    line!(
        out,
        "plan: {} at micro-batch {} x {} step(s), {}{}; predicted peak {}",
        resolved.plan,
        resolved.micro_batch,
        resolved.accum_steps(shard_batch),
        resolved.precision,
        if resolved.recompute_bn_relu {
            ", BN+ReLU recomputed"
        } else {
            ""
        },
        fmt_bytes(resolved.predicted.peak_total)
    );
    if let Some(why) = &resolved.precision_choice {
        line!(out, "{why}");
    }
    if let Some(note) = bf16_emulation_note(resolved.precision).filter(|_| root) {
        eprintln!("{note}");
    }
    if a.memory.scaler_init.is_nan() || a.memory.scaler_init <= 0.0 {
        return Err(Error::Usage(
            "--scaler-init must be a positive number".into(),
        ));
    }
    let scaler = crate::optim::uses_loss_scaler(resolved.precision)
        .then(|| GradScaler::new(a.memory.scaler_init, a.memory.scaler_growth_interval));
    // The hard budget from here on: the allocator refuses to cross it.
    pool.set_budget(budget);
    let fingerprint = run_fingerprint(&FingerprintInputs {
        model: &model_name,
        base_width,
        stem,
        classes,
        precision: resolved.precision,
        recompute_bn_relu: resolved.recompute_bn_relu,
        bn,
        data: &a.data.data,
        image_size: size,
        batch_size: a.batch_size,
        micro_batch: resolved.micro_batch,
        optimizer: a.optimizer,
        lr: lr.lr,
        momentum: a.momentum,
        nesterov: a.nesterov,
        weight_decay: a.weight_decay,
        schedule: a.schedule,
        warmup_epochs: lr.warmup_epochs,
        total_steps,
        label_smoothing: a.label_smoothing,
        clip_grad_norm: a.clip_grad_norm,
        seed: a.seed,
        shuffle: a.shuffle,
        processes,
    });
    // Every process must train the same run on the same data: compared
    // before the first step, an error on every process if not.
    if processes > 1 {
        check_same_config(
            comm.as_ref(),
            &format!(
                "{fingerprint}; train_images={}; val_images={}; plan={}",
                train_set.len(),
                val_set.len(),
                resolved.plan
            ),
        )?;
    }
    let mut scaler = scaler;
    let (mut resume_step, mut resume_sums) = (0, None);
    if let Some(from) = &a.resume {
        // A run that saved its flags was checked flag by flag (more steps
        // are allowed: the schedule then spans the new total).
        let ignore: &[&str] = if resumed_meta
            .as_ref()
            .is_some_and(|m| m.contains_key(RUN_CONFIG_KEY))
        {
            &["total_steps"]
        } else {
            &[]
        };
        let r = load_state_ignoring(
            from,
            &pool,
            &mut model,
            &mut optimizer,
            &fingerprint,
            ignore,
        )?;
        line!(
            out,
            "resuming from {} after optimizer step {}",
            r.path.display(),
            r.step
        );
        resume_step = r.step;
        resume_sums = r.sums;
        if r.scaler.is_some() {
            scaler = r.scaler;
        }
    }
    let meta = ModelMeta {
        model: model_name.clone(),
        base_width,
        stem,
        num_classes: classes,
        class_names: class_names(&data),
        input: Some(InputMeta {
            image_size: size,
            folder: data.eval_transform.map(|t| FolderInput {
                eval_resize: match t.augment {
                    crate::data::transform::Augment::CenterCrop { resize } => resize,
                    crate::data::transform::Augment::RandomResizedCrop { .. } => size,
                },
                mean: t.mean,
                std: t.std,
            }),
        }),
    };
    let mut flags = a.flags.clone();
    flags.insert("model".into(), model_name.clone());
    flags.insert("base-width".into(), base_width.to_string());
    flags.insert("stem".into(), crate::io::stem_flag(stem).to_string());
    flags.insert("num-classes".into(), classes.to_string());
    // The rate the run trains at, default or not: a resumed run keeps it.
    flags.insert("lr".into(), lr.lr.to_string());
    flags.insert("warmup-epochs".into(), lr.warmup_epochs.to_string());
    let mut state_meta = meta.to_metadata();
    state_meta.insert(
        RUN_CONFIG_KEY.into(),
        serde_json::Value::from(serde_json::Map::from_iter(
            flags
                .into_iter()
                .map(|(k, v)| (k, serde_json::Value::from(v))),
        ))
        .to_string(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).map_err(|e| Error::Io {
            path: "signal handler".into(),
            reason: format!("installing a signal handler: {e}"),
        })?;
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
        shuffle: a.shuffle,
        label_smoothing: a.label_smoothing,
        base_lr: lr.lr,
        schedule: lr_schedule,
        clip_grad_norm: a.clip_grad_norm,
        eval_every: a.eval_every,
        metrics_jsonl: a.metrics_jsonl.clone(),
        metrics_csv: a.metrics_csv.clone(),
        log_every: a.log_every,
        scaler,
        inject_inf_steps: Vec::new(),
        nan_policy: a.nan_policy,
        workers: data.workers,
        saving: a.save_dir.as_ref().map(|dir| StateSaving {
            dir: dir.clone(),
            every_steps: a.save_every_steps,
            every_epochs: a
                .save_every_epochs
                .or(a.save_every_steps.is_none().then_some(1)),
            keep: a.keep_checkpoints,
            fingerprint,
            // A resumed run keeps its id; one resumed from a file without
            // an id takes a new one (the old files stay as they are).
            run_id: resumed_id.clone().unwrap_or_else(new_run_id),
            metadata: state_meta,
        }),
        resume_step,
        resume_sums,
        stop: Some(stop),
    };
    let start = Instant::now();
    let mut failed = None;
    let reports = fit_distributed(
        &mut model,
        &pool,
        &mut optimizer,
        train_set,
        val_set,
        &opts,
        comm.clone(),
        |r| {
            if failed.is_some() {
                return;
            }
            let eval = r.eval.map_or(String::new(), |e| {
                format!(
                    ", val loss {:.4}, val top-1 {:.2}%, top-5 {}",
                    e.loss,
                    100.0 * e.top1,
                    e.top5_text()
                )
            });
            let mut w = || -> std::io::Result<()> {
                writeln!(
                    out,
                    "epoch {}: train loss {:.4}, train top-1 {:.1}%{eval}, lr {:.4}, {} img/s, tracked peak {}",
                    r.epoch,
                    r.train_loss,
                    100.0 * r.train_top1,
                    r.lr,
                    crate::train::fmt_rate(r.img_per_s),
                    fmt_bytes(r.memory.peak_total)
                )?;
                if r.skipped > 0 {
                    writeln!(out, "skipped {} unreadable files", r.skipped)?;
                }
                Ok(())
            };
            if let Err(e) = w() {
                failed = Some(e);
            }
        },
    )?;
    if let Some(e) = failed {
        return Err(io_out(e));
    }
    line!(out, "trained in {:.1} s", start.elapsed().as_secs_f64());
    if let Some(last) = reports.last() {
        write_memory(out, &last.memory)?;
        if let Some(line) = gpu_memory_line(&pool) {
            line!(out, "{line}");
        }
        let (p, m) = (resolved.predicted.peak_total, last.memory.peak_total);
        line!(
            out,
            "predicted peak {} vs measured {} ({:+.2}%), reserved {} vs {}{}",
            fmt_bytes(p),
            fmt_bytes(m),
            100.0 * (m as f64 - p as f64) / p.max(1) as f64,
            fmt_bytes(resolved.predicted.reserved_peak),
            fmt_bytes(last.memory.reserved_peak),
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
        line!(out, "memory trace written to {}", path.display());
    }
    if let Some(path) = a.save_weights.as_ref().filter(|_| root) {
        save_state_dict_with(&mut model, &[], meta.to_metadata(), path)?;
        line!(out, "saved weights to {}", path.display());
    }
    Ok(())
}

/// A dataset whose labels are mapped (an image folder's class indices to
/// those of a model with more classes).
struct Relabeled<'a> {
    inner: &'a dyn Dataset,
    /// The model's class of each of `inner`'s labels.
    map: Vec<usize>,
    classes: usize,
}

impl Dataset for Relabeled<'_> {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn classes(&self) -> usize {
        self.classes
    }
    fn image_hw(&self) -> (usize, usize) {
        self.inner.image_hw()
    }
    fn label(&self, i: usize) -> usize {
        self.map[self.inner.label(i)]
    }
    fn load(&self, i: usize, epoch: usize, position: usize, out: &mut [f32]) -> Result<bool> {
        self.inner.load(i, epoch, position, out)
    }
    fn skipped(&self) -> usize {
        self.inner.skipped()
    }
}

/// Each of the folder's classes' index among the model's, by name; a
/// folder class the model does not know is an error naming it.
fn class_map(folder: &[String], model: &[String], data: &str, weights: &str) -> Result<Vec<usize>> {
    let mut map = Vec::with_capacity(folder.len());
    let mut unknown = Vec::new();
    for name in folder {
        match model.iter().position(|m| m == name) {
            Some(i) => map.push(i),
            None => unknown.push(format!("'{name}'")),
        }
    }
    if !unknown.is_empty() {
        return Err(Error::Usage(format!(
            "{data}: the class folder(s) {} are not classes of the model in {weights} (its classes: {})",
            unknown.join(", "),
            model.join(", ")
        )));
    }
    Ok(map)
}

/// `memfit eval`: loss, top-1 and top-5 of saved weights on a dataset's
/// validation split. The model's architecture comes from the flags, else
/// from the file's metadata; an image folder's classes are matched to the
/// model's by name when the file names them.
pub fn eval(a: &EvalConfig, out: &mut dyn Write) -> Result<()> {
    if a.batch_size == 0 {
        return Err(Error::Usage("--batch-size must be at least 1".into()));
    }
    let pool = Pool::on(pick_device(&a.device, true, false)?);
    let file = TensorFile::open(&a.weights)?;
    // The input the weights were trained on, unless the flags say another.
    let input = ModelMeta::input_of_file(&file);
    let reading = input
        .as_ref()
        .and_then(|i| i.folder)
        .map(|f| FolderReading {
            eval_resize: f.eval_resize,
            mean: f.mean,
            std: f.std,
        });
    let data = load_eval_data(
        &a.data,
        a.seed,
        input.as_ref().map(|i| i.image_size),
        reading,
    )?;
    let (val_set, size) = (&*data.set, data.size);
    if val_set.is_empty() {
        return Err(Error::Usage(format!(
            "no images to evaluate in {}{}",
            data.what,
            if a.data.data == "digits" {
                " (pass --val-fraction above 0, or an image folder as --data)"
            } else {
                ""
            }
        )));
    }
    let at = match (a.data.image_size, &input) {
        (None, Some(_)) => format!(" at {size}x{size} (the size it was trained at)"),
        _ => format!(" at {size}x{size}"),
    };
    line!(
        out,
        "evaluating {} on {}{at}",
        a.weights.display(),
        data.what
    );
    let (name, base_width, stem) = architecture(
        a.model.as_ref(),
        a.base_width,
        a.stem,
        Some(&file),
        &a.data.data,
    )?;
    let classes = fc_rows(&file).unwrap_or(val_set.classes());
    let mut model = ModelSpec {
        name,
        base_width,
        stem,
        num_classes: classes,
        seed: 0,
    }
    .build(&pool)?;
    load_torchvision(&mut model, &file, false)?;
    model.check_image_size(size, size)?;
    let mapped;
    let val_set: &dyn Dataset = match (
        ModelMeta::of_file(&file).and_then(|m| m.class_names),
        data.class_names.clone(),
    ) {
        (Some(model_names), Some(folder)) if model_names != folder => {
            mapped = Relabeled {
                inner: val_set,
                map: class_map(&folder, &model_names, &a.data.data, &file.path)?,
                classes,
            };
            &mapped
        }
        _ => val_set,
    };
    let e = evaluate(&mut model, &pool, val_set, a.batch_size, data.workers)?;
    line!(
        out,
        "{} images: loss {:.4}, top-1 {:.2}%, top-5 {}",
        e.samples,
        e.loss,
        100.0 * e.top1,
        e.top5_text()
    );
    if e.skipped > 0 {
        line!(out, "skipped {} unreadable files", e.skipped);
    }
    Ok(())
}
