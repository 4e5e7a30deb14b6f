//! Saved training state (called "checkpoints" in the flags, the messages
//! and the file names, `--save-dir`, `--keep-checkpoints`, `ckpt-*`; in
//! the code "state", because `--checkpoint` and `exec`'s checkpoints mean
//! activation recomputation, as in PyTorch): one safetensors file per save,
//! `DIR/ckpt-00001234.safetensors` (the optimizer step it was taken after),
//! holding the state_dict in torchvision's names and layout (so a checkpoint
//! is also a weights file), the optimizer's buffers (`optimizer.*`), and in
//! the metadata the format version, the step, the loss-scaler state, a
//! fingerprint of everything that must match to resume, the run's id (a
//! run deletes and overwrites only its own files), the running sums of the
//! epoch in progress, and what the caller adds (the run's configuration,
//! the model's architecture and class names).
//!
//! What is *not* stored, because it is recomputed exactly: the data order
//! (the shuffle RNG is replayed from the seed), augmentation randomness
//! (seeded per sample from seed, epoch and position) and the LR (a function
//! of the step). A run resumed from step S therefore continues with the same
//! windows, bit for bit; an accumulation window in progress when a run died
//! was never saved, so it is redone from its start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::io::{TensorFile, load_state_dict, save_state_dict_with};
use crate::memory::Pool;
use crate::nn::{BnPolicy, Precision, ResNet, StemKind};
use crate::optim::{GradScaler, Optimizer};
use crate::optim::{OptimizerKind, ScheduleKind};

/// Bumped whenever the layout changes; older files are refused.
pub const FORMAT_VERSION: &str = "1";

const PREFIX: &str = "ckpt-";
const SUFFIX: &str = ".safetensors";

/// Where a resumed run starts.
#[derive(Clone, Debug, PartialEq)]
pub struct Resume {
    /// Optimizer steps already taken.
    pub step: usize,
    pub scaler: Option<GradScaler>,
    pub path: PathBuf,
    /// The run's id (None: a file saved before runs had ids).
    pub run_id: Option<String>,
    /// The running sums of the epoch the state was saved in (None in
    /// files saved before they were kept).
    pub sums: Option<EpochSums>,
}

/// `DIR/ckpt-<step>.safetensors`.
pub fn state_path(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!("{PREFIX}{step:08}{SUFFIX}"))
}

/// The checkpoints in `dir`, oldest first.
pub fn list_states(dir: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::Io {
        path: dir.display().to_string(),
        reason: e.to_string(),
    })?;
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(step) = name
            .strip_prefix(PREFIX)
            .and_then(|s| s.strip_suffix(SUFFIX))
            .and_then(|s| s.parse::<usize>().ok())
        {
            out.push((step, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// The newest checkpoint in `dir`, if it holds any.
pub fn newest_state(dir: &Path) -> Option<PathBuf> {
    list_states(dir).ok()?.pop().map(|(_, p)| p)
}

/// Checks, before training starts, that checkpoints can be written to `dir`
/// (creating it if needed): a run should not train for hours and then find
/// out. Writes and removes a small probe file.
pub fn check_save_dir(dir: &Path) -> Result<()> {
    let bad = |reason: String| Error::Io {
        path: dir.display().to_string(),
        reason,
    };
    if dir.exists() && !dir.is_dir() {
        return Err(bad("--save-dir exists and is not a directory".into()));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| bad(format!("cannot create the checkpoint directory: {e}")))?;
    remove_stale_temporaries(dir);
    let probe = dir.join(format!(".memfit-write-probe-{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"probe"));
    let _ = std::fs::remove_file(&probe);
    written.map_err(|e| bad(format!("cannot write checkpoints into this directory: {e}")))
}

/// Removes the temporary files of checkpoint writes that a killed run left
/// (`.ckpt-<step>.safetensors.<pid>.<nanos>.tmp`, see `write_atomic`).
/// Called before a run starts writing: one run owns a save directory
/// ([`check_save_dir_owner`] refuses another run's).
fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with(&format!(".{PREFIX}")) && name.ends_with(".tmp") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// How a run saves its state (`--save-dir` and its cadence).
#[derive(Clone, Debug, Default)]
pub struct StateSaving {
    pub dir: PathBuf,
    /// Save after every this many optimizer steps.
    pub every_steps: Option<usize>,
    /// Save after every this many epochs.
    pub every_epochs: Option<usize>,
    /// State files of this run kept in `dir` (the newest).
    pub keep: usize,
    /// What must match for a state file to resume this run (`key=value; …`).
    pub fingerprint: String,
    /// The run's id: its files are its own, the only ones it overwrites or
    /// deletes ([`new_run_id`]).
    pub run_id: String,
    /// More metadata for every file (the run's configuration, the model's
    /// architecture and class names).
    pub metadata: HashMap<String, String>,
}

/// The running sums of the epoch a state was saved in, so that a resumed
/// run reports the loss and top-1 of the whole epoch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EpochSums {
    pub epoch: usize,
    /// Sum over the epoch's samples of their loss.
    pub loss_sum: f64,
    pub correct: usize,
    pub seen: usize,
}

/// A fresh run id: 16 hex digits from the clock and the process id.
pub fn new_run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!(
        "{:016x}",
        nanos ^ (u64::from(std::process::id())).rotate_left(48)
    )
}

/// The `__metadata__` of a safetensors file, reading its header only.
pub fn read_metadata(path: &Path) -> Result<HashMap<String, String>> {
    use std::io::Read;
    let bad = |reason: String| Error::BadWeights {
        path: path.display().to_string(),
        reason,
    };
    let mut f = std::fs::File::open(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let len = u64::from_le_bytes(len);
    if len > 100_000_000 {
        return Err(bad("not a valid safetensors file: header too large".into()));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let v: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("not a valid safetensors header: {e}")))?;
    Ok(v.get("__metadata__")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect()
        })
        .unwrap_or_default())
}

/// One state file in a directory.
#[derive(Clone, Debug, PartialEq)]
pub struct StateFile {
    pub step: usize,
    pub path: PathBuf,
    /// The run that wrote it; None for files of the format before run ids
    /// (or unreadable ones): they belong to "another run".
    pub run_id: Option<String>,
}

/// The state files in `dir` with their runs, oldest first.
pub fn states_with_runs(dir: &Path) -> Result<Vec<StateFile>> {
    Ok(list_states(dir)?
        .into_iter()
        .map(|(step, path)| {
            let run_id = read_metadata(&path)
                .ok()
                .and_then(|m| m.get(RUN_ID_KEY).cloned());
            StateFile { step, path, run_id }
        })
        .collect())
}

/// Metadata keys of a state file beyond the format's first version.
pub const RUN_ID_KEY: &str = "run_id";
pub const RUN_CONFIG_KEY: &str = "run_config";
const EPOCH_KEYS: [&str; 4] = ["epoch", "epoch_loss_sum", "epoch_correct", "epoch_seen"];

/// The runs of `files`, each with its newest file, in the order they appear.
fn runs(files: &[StateFile]) -> Vec<(Option<String>, &StateFile)> {
    let mut out: Vec<(Option<String>, &StateFile)> = Vec::new();
    for f in files {
        match out.iter_mut().find(|(id, _)| *id == f.run_id) {
            Some(r) => r.1 = f,
            None => out.push((f.run_id.clone(), f)),
        }
    }
    out
}

fn describe_runs(runs: &[(Option<String>, &StateFile)]) -> String {
    runs.iter()
        .map(|(id, f)| {
            format!(
                "run {} (newest {}, after step {})",
                id.as_deref()
                    .unwrap_or("without an id, saved by an older memfit"),
                f.path.display(),
                f.step
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Refuses, before training, a save directory holding state files of
/// another run than `run_id` (None: a new run, which owns no files yet):
/// writing there would overwrite them, and clean-up would mix the runs.
/// `legacy_ok`: the run resumes a file saved before runs had ids, so the
/// id-less files count as its own (they are never deleted).
pub fn check_save_dir_owner(dir: &Path, run_id: Option<&str>, legacy_ok: bool) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    let files = states_with_runs(dir)?;
    let foreign: Vec<StateFile> = files
        .into_iter()
        .filter(|f| match (&f.run_id, run_id) {
            (Some(a), Some(b)) => a != b,
            (None, _) => !legacy_ok,
            (Some(_), None) => true,
        })
        .collect();
    if foreign.is_empty() {
        return Ok(());
    }
    let others = runs(&foreign);
    let resume = if others.len() == 1 {
        format!("memfit train --resume {}", dir.display())
    } else {
        format!(
            "memfit train --resume {}",
            others
                .last()
                .map(|(_, f)| f.path.display().to_string())
                .unwrap_or_default()
        )
    };
    Err(Error::Usage(format!(
        "--save-dir {} holds the checkpoints of another run ({}); this run would overwrite or delete them. \
         To continue that run: {resume}; to start a new one, choose another --save-dir",
        dir.display(),
        describe_runs(&others)
    )))
}

/// The state file `--resume FROM` names: FROM itself, or the newest file
/// in the directory FROM, which must hold the files of one run only.
/// Refuses a `--resume` file that is no training state of this format
/// (`format`: its `memfit_checkpoint` metadata), naming the file.
pub fn check_state_format(path: &Path, format: Option<&String>) -> Result<()> {
    let bad = |reason: String| Error::BadWeights {
        path: path.display().to_string(),
        reason,
    };
    match format.map(String::as_str) {
        Some(FORMAT_VERSION) => Ok(()),
        Some(v) => Err(bad(format!(
            "checkpoint format {v}, this memfit reads format {FORMAT_VERSION}"
        ))),
        None => Err(bad(
            "is a weights file, not a training checkpoint (use --init to start from weights)"
                .into(),
        )),
    }
}

pub fn resume_file(from: &Path) -> Result<PathBuf> {
    if !from.is_dir() {
        return Ok(from.to_path_buf());
    }
    let files = states_with_runs(from)?;
    let all = runs(&files);
    // A run resumed from a file of the format before run ids writes files
    // with an id beside the id-less ones: its newest file continues it.
    if all.len() == 2
        && all.iter().any(|(id, _)| id.is_none())
        && let Some(newest) = files.last()
        && newest.run_id.is_some()
    {
        return Ok(newest.path.clone());
    }
    match all.len() {
        0 => Err(Error::Io {
            path: from.display().to_string(),
            reason: "holds no checkpoint (ckpt-*.safetensors) to resume from".into(),
        }),
        1 => Ok(all[0].1.path.clone()),
        _ => Err(Error::Usage(format!(
            "--resume {} holds the checkpoints of {} runs: {}. Resume one of them by naming its file",
            from.display(),
            all.len(),
            describe_runs(&all)
        ))),
    }
}

/// Writes the state after optimizer step `step` (atomically: a failed write
/// leaves the previous checkpoints as they were, and the error, an
/// [`Error::StateWrite`], names the newest of them), then deletes all
/// but the newest `saving.keep` of this run's files (never another run's).
/// `sums`: the epoch's running sums at this step.
pub fn save_state(
    saving: &StateSaving,
    model: &mut ResNet,
    optimizer: &Optimizer,
    step: usize,
    scaler: Option<&GradScaler>,
    sums: EpochSums,
) -> Result<PathBuf> {
    let dir = &saving.dir;
    let path = state_path(dir, step);
    let failed = |reason: String| Error::StateWrite {
        path: path.display().to_string(),
        reason,
        last_good: newest_state(dir).map(|p| p.display().to_string()),
    };
    std::fs::create_dir_all(dir).map_err(|e| {
        failed(format!(
            "cannot create the checkpoint directory '{}': {e}",
            dir.display()
        ))
    })?;
    if path.exists() {
        let owner = read_metadata(&path)
            .ok()
            .and_then(|m| m.get(RUN_ID_KEY).cloned());
        if owner.as_deref() != Some(saving.run_id.as_str()) {
            return Err(failed(format!(
                "the file belongs to another run ({}); it is kept",
                owner.as_deref().unwrap_or("without an id")
            )));
        }
    }
    let (buffers, steps) = optimizer.state();
    // The optimizer state, on whatever device it lives: the writer copies
    // one tensor at a time to the host.
    let extras: Vec<(String, &crate::tensor::Tensor)> =
        buffers.iter().map(|(n, t)| (n.clone(), *t)).collect();
    let mut meta = saving.metadata.clone();
    meta.extend([
        ("memfit_checkpoint".to_string(), FORMAT_VERSION.to_string()),
        ("step".to_string(), step.to_string()),
        ("optimizer_steps".to_string(), steps.to_string()),
        ("fingerprint".to_string(), saving.fingerprint.clone()),
        (RUN_ID_KEY.to_string(), saving.run_id.clone()),
        (EPOCH_KEYS[0].to_string(), sums.epoch.to_string()),
        // The bits, so the resumed sum is exactly this one.
        (
            EPOCH_KEYS[1].to_string(),
            format!("{:016x}", sums.loss_sum.to_bits()),
        ),
        (EPOCH_KEYS[2].to_string(), sums.correct.to_string()),
        (EPOCH_KEYS[3].to_string(), sums.seen.to_string()),
    ]);
    if let Some(s) = scaler {
        meta.insert("scaler_scale".into(), format!("{:e}", s.scale));
        meta.insert("scaler_growth_tracker".into(), s.growth_tracker.to_string());
        meta.insert(
            "scaler_growth_interval".into(),
            s.growth_interval.to_string(),
        );
    }
    // The write is atomic, so on failure the older checkpoints are as they
    // were; the error says which one to resume from.
    save_state_dict_with(model, &extras, meta, &path).map_err(|e| match e {
        Error::Io { reason, .. } => failed(reason),
        other => other,
    })?;
    let ours: Vec<PathBuf> = states_with_runs(dir)?
        .into_iter()
        .filter(|f| f.run_id.as_deref() == Some(saving.run_id.as_str()))
        .map(|f| f.path)
        .collect();
    for old in ours
        .iter()
        .take(ours.len().saturating_sub(saving.keep.max(1)))
    {
        let _ = std::fs::remove_file(old);
    }
    Ok(path)
}

/// Keys older checkpoints recorded that no longer have to match. `plan`:
/// gradients are bit-identical under every memory plan, and with measured
/// stage times a resumed run may choose another one.
const RETIRED_KEYS: [&str; 1] = ["plan"];

/// Everything a continued run must share with the saved one, as
/// [`run_fingerprint`] writes it. Not the plan: gradients are
/// bit-identical under every plan.
#[derive(Clone, Debug, PartialEq)]
pub struct FingerprintInputs<'a> {
    pub model: &'a str,
    pub base_width: usize,
    pub stem: StemKind,
    pub classes: usize,
    pub precision: Precision,
    pub recompute_bn_relu: bool,
    pub bn: BnPolicy,
    /// The dataset as the run named it (`digits`, a folder's path, ...).
    pub data: &'a str,
    pub image_size: usize,
    pub batch_size: usize,
    pub micro_batch: usize,
    pub optimizer: OptimizerKind,
    pub lr: f32,
    pub momentum: f32,
    pub nesterov: bool,
    /// As given (None: the optimizer's default).
    pub weight_decay: Option<f32>,
    pub schedule: ScheduleKind,
    pub warmup_epochs: usize,
    pub total_steps: usize,
    pub label_smoothing: f32,
    pub clip_grad_norm: Option<f32>,
    pub seed: u64,
    pub shuffle: bool,
    /// Processes of a data-parallel run (each normalises BN over its own
    /// shard, so a run resumes only with as many): in the text only when
    /// more than one, so that one process's text is as it always was.
    pub processes: usize,
}

/// The fingerprint saved with every checkpoint and compared by
/// [`load_state`]: `key=value` pairs joined by `"; "`. Its text is
/// fixed: checkpoints saved by earlier versions must still resume, so a
/// key is never renamed or reformatted (a test pins it).
pub fn run_fingerprint(f: &FingerprintInputs) -> String {
    let stem = match f.stem {
        StemKind::ImageNet => "ImageNet",
        StemKind::Small => "Small",
    };
    let bn = match f.bn {
        BnPolicy::Batch => "Batch",
        BnPolicy::Frozen => "Frozen",
    };
    let processes = if f.processes > 1 {
        format!("; processes={}", f.processes)
    } else {
        String::new()
    };
    format!(
        "model={}; base_width={}; stem={stem}; classes={}; precision={}; bn_relu_recompute={}; bn={bn}; data={}; image_size={}; batch_size={}; micro_batch={}; optimizer={}; lr={}; momentum={}; nesterov={}; weight_decay={:?}; schedule={}; warmup_epochs={}; total_steps={}; label_smoothing={}; clip_grad_norm={:?}; seed={}; shuffle={}{processes}",
        f.model,
        f.base_width,
        f.classes,
        f.precision,
        f.recompute_bn_relu,
        f.data,
        f.image_size,
        f.batch_size,
        f.micro_batch,
        f.optimizer.fingerprint_name(),
        f.lr,
        f.momentum,
        f.nesterov,
        f.weight_decay,
        f.schedule.fingerprint_name(),
        f.warmup_epochs,
        f.total_steps,
        f.label_smoothing,
        f.clip_grad_norm,
        f.seed,
        f.shuffle,
    )
}

/// The differences between two fingerprints (`key=value` pairs joined by
/// `; `), as `key: saved A, now B`.
fn fingerprint_diff(saved: &str, now: &str) -> Vec<String> {
    let parse = |s: &str| -> Vec<(String, String)> {
        let mut kv: Vec<(String, String)> = s
            .split("; ")
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        // One process writes no `processes` key.
        if !s.is_empty() && !kv.iter().any(|(k, _)| k == "processes") {
            kv.push(("processes".into(), "1".into()));
        }
        kv
    };
    let (a, b) = (parse(saved), parse(now));
    let mut out = Vec::new();
    for (k, v) in &b {
        match a.iter().find(|(ka, _)| ka == k) {
            Some((_, va)) if va != v => out.push(format!("{k}: checkpoint {va}, now {v}")),
            None => out.push(format!("{k}: not in the checkpoint, now {v}")),
            _ => {}
        }
    }
    for (k, v) in &a {
        if !b.iter().any(|(kb, _)| kb == k) && !RETIRED_KEYS.contains(&k.as_str()) {
            out.push(format!("{k}: checkpoint {v}, not set now"));
        }
    }
    out
}

/// Loads `from` (a checkpoint file, or a directory: its newest checkpoint)
/// into `model` and `optimizer`, after checking the format version and that
/// `fingerprint` matches the one saved (the error names every difference).
pub fn load_state(
    from: &Path,
    pool: &Pool,
    model: &mut ResNet,
    optimizer: &mut Optimizer,
    fingerprint: &str,
) -> Result<Resume> {
    load_state_ignoring(from, pool, model, optimizer, fingerprint, &[])
}

/// [`load_state`], with the fingerprint keys `ignore` allowed to differ
/// (`total_steps` when a run is resumed for more steps).
pub fn load_state_ignoring(
    from: &Path,
    pool: &Pool,
    model: &mut ResNet,
    optimizer: &mut Optimizer,
    fingerprint: &str,
    ignore: &[&str],
) -> Result<Resume> {
    let path = resume_file(from)?;
    let file = TensorFile::open(&path)?;
    let bad = |reason: String| Error::BadWeights {
        path: path.display().to_string(),
        reason,
    };
    let meta = |k: &str| file.metadata.get(k).cloned();
    check_state_format(&path, file.metadata.get(crate::io::STATE_FILE_KEY))?;
    let saved = meta("fingerprint").unwrap_or_default();
    let diff: Vec<String> = fingerprint_diff(&saved, fingerprint)
        .into_iter()
        .filter(|d| !ignore.iter().any(|k| d.starts_with(&format!("{k}: "))))
        .collect();
    if !diff.is_empty() {
        return Err(bad(format!(
            "was written by an incompatible run: {}",
            diff.join("; ")
        )));
    }
    let number = |k: &str| -> Result<u64> {
        meta(k)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(format!("metadata '{k}' is missing or not a number")))
    };
    let step = number("step")? as usize;
    let steps = number("optimizer_steps")?;
    let scaler = match meta("scaler_scale") {
        Some(s) => Some(GradScaler {
            // A NaN, zero or negative scale would silently skip or corrupt
            // every following step.
            scale: s
                .parse()
                .ok()
                .filter(|v: &f32| v.is_finite() && *v > 0.0)
                .ok_or_else(|| bad(format!("scaler_scale '{s}' is not a positive number")))?,
            growth_tracker: number("scaler_growth_tracker")? as u32,
            ..GradScaler::new(1.0, number("scaler_growth_interval")? as u32)
        }),
        None => None,
    };
    load_state_dict(model, &file, &["optimizer."])?;
    optimizer
        .load_state(pool, model, steps, |name| {
            file.f32(name).ok().map(|(_, v)| v.to_vec())
        })
        .map_err(|e| match e {
            // The pool's own refusals (a budget) stay as they are.
            Error::ShapeMismatch { .. } | Error::InvalidArgument { .. } => {
                bad(format!("optimizer state does not match the model: {e}"))
            }
            other => other,
        })?;
    let sums = match (
        meta(EPOCH_KEYS[0]).and_then(|v| v.parse().ok()),
        meta(EPOCH_KEYS[1]).and_then(|v| u64::from_str_radix(&v, 16).ok()),
        meta(EPOCH_KEYS[2]).and_then(|v| v.parse().ok()),
        meta(EPOCH_KEYS[3]).and_then(|v| v.parse().ok()),
    ) {
        (Some(epoch), Some(bits), Some(correct), Some(seen)) => Some(EpochSums {
            epoch,
            loss_sum: f64::from_bits(bits),
            correct,
            seen,
        }),
        _ => None,
    };
    Ok(Resume {
        step,
        scaler,
        run_id: meta(RUN_ID_KEY),
        path,
        sums,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text earlier versions saved (the binary's `format!` before the
    /// fingerprint moved here, at commit eb7909c): it must not change, or
    /// their checkpoints stop resuming.
    #[test]
    fn the_fingerprint_text_is_that_of_saved_runs() {
        let mut f = FingerprintInputs {
            model: "resnet18",
            base_width: 16,
            stem: StemKind::ImageNet,
            classes: 10,
            precision: Precision::F32,
            recompute_bn_relu: false,
            bn: BnPolicy::Batch,
            data: "digits",
            image_size: 32,
            batch_size: 64,
            micro_batch: 64,
            optimizer: OptimizerKind::Sgd,
            lr: 0.05,
            momentum: 0.9,
            nesterov: false,
            weight_decay: None,
            schedule: ScheduleKind::Cosine,
            warmup_epochs: 0,
            total_steps: 230,
            label_smoothing: 0.0,
            clip_grad_norm: None,
            seed: 0,
            shuffle: true,
            processes: 1,
        };
        assert_eq!(
            run_fingerprint(&f),
            "model=resnet18; base_width=16; stem=ImageNet; classes=10; precision=fp32; bn_relu_recompute=false; bn=Batch; data=digits; image_size=32; batch_size=64; micro_batch=64; optimizer=Sgd; lr=0.05; momentum=0.9; nesterov=false; weight_decay=None; schedule=Cosine; warmup_epochs=0; total_steps=230; label_smoothing=0; clip_grad_norm=None; seed=0; shuffle=true"
        );
        f.stem = StemKind::Small;
        f.precision = Precision::BF16;
        f.recompute_bn_relu = true;
        f.bn = BnPolicy::Frozen;
        f.optimizer = OptimizerKind::Adamw;
        f.weight_decay = Some(0.01);
        f.schedule = ScheduleKind::Step;
        f.clip_grad_norm = Some(1.5);
        f.shuffle = false;
        assert_eq!(
            run_fingerprint(&f),
            "model=resnet18; base_width=16; stem=Small; classes=10; precision=bf16; bn_relu_recompute=true; bn=Frozen; data=digits; image_size=32; batch_size=64; micro_batch=64; optimizer=Adamw; lr=0.05; momentum=0.9; nesterov=false; weight_decay=Some(0.01); schedule=Step; warmup_epochs=0; total_steps=230; label_smoothing=0; clip_grad_norm=Some(1.5); seed=0; shuffle=false"
        );
        f.schedule = ScheduleKind::Constant;
        assert!(run_fingerprint(&f).contains("; schedule=Constant;"));
        // A data-parallel run adds its process count; a resume with
        // another count, either way, is named.
        f.processes = 2;
        let two = run_fingerprint(&f);
        assert!(two.ends_with("; shuffle=false; processes=2"));
        f.processes = 1;
        let one = run_fingerprint(&f);
        assert_eq!(
            fingerprint_diff(&one, &two),
            ["processes: checkpoint 1, now 2"]
        );
        assert_eq!(
            fingerprint_diff(&two, &one),
            ["processes: checkpoint 2, now 1"]
        );
    }

    #[test]
    fn fingerprint_differences_are_named() {
        let d = fingerprint_diff(
            "model=resnet18; batch=64; lr=0.1",
            "model=resnet50; batch=64",
        );
        assert_eq!(
            d,
            vec![
                "model: checkpoint resnet18, now resnet50".to_string(),
                "lr: checkpoint 0.1, not set now".to_string()
            ]
        );
        assert!(fingerprint_diff("a=1; b=2", "a=1; b=2").is_empty());
        assert!(fingerprint_diff("a=1; plan=keep[0..10]", "a=1").is_empty());
        assert_eq!(fingerprint_diff("a=1; b=2", "a=1").len(), 1);
    }
}
