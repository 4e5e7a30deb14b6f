//! The training loop over a [`Dataset`]: shuffled mini-batches (made by a
//! [`Loader`], on background threads if asked), the optimizer with its LR
//! schedule (advanced once per optimizer step), optional gradient clipping,
//! evaluation (loss, top-1, top-5), one JSON line per step and per
//! evaluation in a metrics file.

pub mod checkpoint;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use rand::{SeedableRng, rngs::ChaCha8Rng, seq::SliceRandom};

use crate::backend;
use crate::data::{Dataset, Loader};
use crate::error::{Error, Result};
use crate::exec::{LossOptions, Plan, StepOutput, forward_backward, forward_eval};
use crate::memory::{Category, MemoryStats, Pool, Tag, write_timeline_csv};
use crate::nn::{Precision, ResNet, StateSlot};
pub use crate::optim::Optimizer;
use crate::optim::{GradScaler, LrSchedule, ScalerStep, clip_grad_norm};
use crate::tensor::Tensor;

pub struct TrainOptions {
    pub epochs: usize,
    /// Stop after this many optimizer steps (the last epoch may be partial).
    pub max_steps: Option<usize>,
    /// Draw a progress bar per epoch on stderr (hidden when it is not a
    /// terminal).
    pub progress: bool,
    /// Samples per optimizer step (the effective batch).
    pub batch_size: usize,
    /// Samples per forward/backward; the window of `batch_size` samples is
    /// split into micro-batches of this size whose gradients accumulate.
    /// `None`: the whole batch at once.
    pub micro_batch: Option<usize>,
    /// What each stage keeps or recomputes.
    pub plan: Option<Plan>,
    pub seed: u64,
    pub shuffle: bool,
    pub label_smoothing: f32,
    pub base_lr: f32,
    pub schedule: LrSchedule,
    pub clip_grad_norm: Option<f32>,
    /// Evaluate every this many epochs (and always after the last).
    pub eval_every: usize,
    pub metrics_jsonl: Option<PathBuf>,
    /// The planner's predicted peak, recorded beside the measured one.
    pub predicted_peak: Option<usize>,
    /// Write the allocator timeline of the first [`TRACE_STEPS`] optimizer
    /// steps here as CSV.
    pub memory_trace: Option<PathBuf>,
    /// Dynamic loss scaling (f16): `None` trains unscaled.
    pub scaler: Option<GradScaler>,
    /// Test hook: at these optimizer steps (1-based) one gradient element
    /// is set to inf after the backward, as an f16 overflow would.
    pub inject_inf_steps: Vec<usize>,
    /// What a non-finite loss or gradient does without a loss scaler.
    pub nan_policy: NanPolicy,
    /// Threads loading batches ahead of the step (decoding, augmenting);
    /// 0 loads each batch on the training thread when it is needed. The
    /// batches are the same for any count.
    pub workers: usize,
    /// Write training-state checkpoints here (see [`checkpoint`]).
    pub save_dir: Option<PathBuf>,
    /// Save after every this many optimizer steps.
    pub save_every_steps: Option<usize>,
    /// Save after every this many epochs.
    pub save_every_epochs: Option<usize>,
    /// Checkpoints kept in `save_dir` (the newest).
    pub keep_checkpoints: usize,
    /// What must match for a checkpoint to resume this run (`key=value; …`).
    pub fingerprint: String,
    /// Optimizer steps already taken by the run being resumed: their
    /// windows are skipped (the data order is replayed, nothing computed).
    pub resume_step: usize,
    /// Set (by a signal handler) to stop after the current step, save a
    /// checkpoint and return [`Error::Interrupted`].
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// Optimizer steps a `--memory-trace` covers: the first allocates the
/// optimizer state, the second shows the steady state.
pub const TRACE_STEPS: usize = 2;

/// Loss and accuracy on a validation set.
#[derive(Clone, Copy, Debug)]
pub struct EvalReport {
    pub loss: f64,
    pub top1: f64,
    pub top5: f64,
    /// Images evaluated; fewer than the set's length by `skipped`.
    pub samples: usize,
    /// Unreadable images left out.
    pub skipped: usize,
}

/// One epoch's summary.
#[derive(Clone, Debug)]
pub struct EpochReport {
    pub epoch: usize,
    pub train_loss: f64,
    pub train_top1: f64,
    pub lr: f32,
    pub eval: Option<EvalReport>,
    pub img_per_s: f64,
    pub memory: MemoryStats,
    /// Unreadable images left out this epoch, training and evaluation.
    pub skipped: usize,
}

/// Copies loaded images (n, h, w, 3) into a pool tensor, where the budget
/// sees them.
fn gather(pool: &Pool, (h, w): (usize, usize), images: &[f32]) -> Result<Tensor> {
    let n = images.len() / (h * w * 3).max(1);
    let mut t = pool.empty_f32(&[n, h, w, 3], Category::Data, Tag::fixed("batch.images"))?;
    backend::copy_from_host(&mut t, images)?;
    Ok(t)
}

/// `--nan-policy`: what a non-finite loss or gradient does (fp32, bf16;
/// f16's loss scaler handles overflow itself).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NanPolicy {
    /// Stop with an error naming the step; nothing non-finite reaches the
    /// weights.
    #[default]
    Stop,
    /// Drop the step (no optimizer update) with a warning and go on.
    Skip,
}

/// Whether every trainable gradient is finite.
fn grads_finite(model: &mut ResNet) -> Result<bool> {
    let mut ok = Ok(true);
    model.visit_params(|p| {
        if matches!(ok, Ok(true)) && !p.frozen {
            ok = backend::all_finite(&p.grad);
        }
    });
    ok
}

/// What a forward changes besides the saved tensors: the batch norm running
/// statistics and `num_batches_tracked`. Kept across steps (cleared and
/// refilled, so steady-state steps allocate nothing).
#[derive(Default)]
struct BnState {
    stats: Vec<f32>,
    counts: Vec<i64>,
}

/// Copies every batch norm running statistic and counter into `out` (on
/// the host: the roll-back copy is small, and taken once per step only
/// under `--nan-policy skip`).
fn save_buffers(model: &mut ResNet, out: &mut BnState) -> Result<()> {
    out.stats.clear();
    out.counts.clear();
    let mut res = Ok(());
    model.visit_state(|slot| match slot {
        StateSlot::Buffer { tensor, .. } => match backend::copy_to_host(tensor) {
            Ok(v) => out.stats.extend_from_slice(&v),
            Err(e) => res = Err(e),
        },
        StateSlot::Count { value, .. } => out.counts.push(*value),
        StateSlot::Param { .. } => {}
    });
    res
}

/// Puts back what [`save_buffers`] copied: a dropped step leaves no trace.
fn restore_buffers(model: &mut ResNet, from: &BnState) -> Result<()> {
    let (mut at, mut count) = (0, from.counts.iter());
    let mut res = Ok(());
    model.visit_state(|slot| match slot {
        StateSlot::Buffer { tensor, .. } => {
            let len = tensor.numel();
            if let Err(e) = backend::copy_from_host(tensor, &from.stats[at..at + len]) {
                res = Err(e);
            }
            at += len;
        }
        StateSlot::Count { value, .. } => {
            if let Some(c) = count.next() {
                *value = *c;
            }
        }
        StateSlot::Param { .. } => {}
    });
    res
}

/// Whether every batch norm running statistic is finite. A forward whose
/// activations overflow can leave the loss and the gradients finite (the
/// normalised output saturates) and still poison the running variance,
/// which only evaluation would reveal.
fn buffers_finite(model: &mut ResNet) -> Result<bool> {
    let mut ok = Ok(true);
    model.visit_state(|slot| {
        if let StateSlot::Buffer { tensor, .. } = slot
            && matches!(ok, Ok(true))
        {
            ok = backend::all_finite(tensor);
        }
    });
    ok
}

/// The test hook of [`TrainOptions::inject_inf_steps`]: the first trainable
/// gradient element becomes inf.
fn inject_inf(model: &mut ResNet) {
    let mut done = false;
    model.visit_params(|p| {
        if !done && !p.frozen {
            // A test hook, so a host round trip is fine.
            if let Ok(mut g) = backend::copy_to_host(&p.grad) {
                g[0] = f32::INFINITY;
                done = backend::copy_from_host(&mut p.grad, &g).is_ok();
            }
        }
    });
}

/// Whether `label` is among the `k` largest logits of `row` (ties count
/// against the label, so a constant row is never "correct").
fn in_top_k(row: &[f32], label: usize, k: usize) -> bool {
    let v = row[label];
    row.iter()
        .enumerate()
        .filter(|&(i, &x)| x > v || (x == v && i < label))
        .count()
        < k
}

/// Mean loss, top-1 and top-5 with running BN statistics, over the
/// readable images of `data` in index order, loaded by `workers` threads.
pub fn evaluate(
    model: &mut ResNet,
    pool: &Pool,
    data: &dyn Dataset,
    batch_size: usize,
    workers: usize,
) -> Result<EvalReport> {
    let classes = model.config.num_classes;
    let (mut loss, mut top1, mut top5) = (0.0, 0, 0);
    let (mut samples, mut skipped) = (0, 0);
    let order: Vec<usize> = (0..data.len()).collect();
    let loader = Loader {
        data,
        batch_size: batch_size.max(1),
        workers,
    };
    std::thread::scope(|scope| -> Result<()> {
        for batch in loader.epoch(scope, order, 0) {
            let batch = batch?;
            skipped += batch.skipped;
            if batch.labels.is_empty() {
                continue;
            }
            let (images, labels) = (gather(pool, data.image_hw(), &batch.images)?, batch.labels);
            samples += labels.len();
            let logits = forward_eval(model, pool, images)?;
            let mut scratch = pool.empty_f32(
                logits.dims(),
                Category::Workspace,
                Tag::fixed("eval.d_logits"),
            )?;
            let n = labels.len();
            let out = backend::cross_entropy(
                &mut scratch,
                &logits,
                &labels,
                0.0,
                n,
                None,
                Precision::F32,
            )?;
            loss += out.loss * n as f64;
            // The logits are small: top-k runs on a host copy.
            let host_logits = backend::copy_to_host(&logits)?;
            for (row, &l) in host_logits.chunks_exact(classes).zip(&labels) {
                top1 += in_top_k(row, l, 1) as usize;
                top5 += in_top_k(row, l, 5) as usize;
            }
        }
        Ok(())
    })?;
    // Zeros for loss and accuracy would read as a result.
    if samples == 0 && skipped > 0 {
        return Err(Error::NoReadableImages {
            what: "validation".into(),
            skipped,
            verb: "evaluate",
        });
    }
    let n = samples.max(1) as f64;
    Ok(EvalReport {
        loss: loss / n,
        top1: top1 as f64 / n,
        top5: top5 as f64 / n,
        samples,
        skipped,
    })
}

/// A JSON number, or null for NaN/inf (which JSON cannot hold).
fn num(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".into()
    }
}

fn memory_fields(m: &MemoryStats, predicted: Option<usize>) -> String {
    let mut s = format!("\"peak_bytes\":{}", m.peak_total);
    if let Some(p) = predicted {
        s += &format!(",\"predicted_peak_bytes\":{p}");
    }
    for c in Category::ALL {
        s += &format!(",\"peak_{}_bytes\":{}", c.name(), m.peak.get(c));
    }
    s
}

/// One epoch's bar: `epoch 3 [=====>    ] 120/469 loss …, lr …, img/s, peak …`.
fn progress_bar(on: bool, steps: usize, epoch: usize) -> indicatif::ProgressBar {
    if !on {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(steps as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed}<{eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(format!("epoch {epoch}"));
    bar
}

/// Trains `model`; calls `on_epoch` after each epoch.
#[allow(clippy::too_many_arguments)]
pub fn fit(
    model: &mut ResNet,
    pool: &Pool,
    optimizer: &mut Optimizer,
    train: &dyn Dataset,
    val: &dyn Dataset,
    opts: &TrainOptions,
    on_epoch: impl FnMut(&EpochReport),
) -> Result<Vec<EpochReport>> {
    // Loader threads borrow the datasets: one scope spans the run.
    std::thread::scope(|scope| fit_in(scope, model, pool, optimizer, train, val, opts, on_epoch))
}

#[allow(clippy::too_many_arguments)]
fn fit_in<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    model: &mut ResNet,
    pool: &Pool,
    optimizer: &mut Optimizer,
    train: &'env dyn Dataset,
    val: &'env dyn Dataset,
    opts: &TrainOptions,
    mut on_epoch: impl FnMut(&EpochReport),
) -> Result<Vec<EpochReport>> {
    if opts.batch_size == 0 {
        return Err(Error::invalid("train", "batch size must be at least 1"));
    }
    if train.is_empty() {
        return Err(Error::invalid("train", "the training set is empty"));
    }
    let mut metrics = match &opts.metrics_jsonl {
        Some(p) => Some(BufWriter::new(
            File::options()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| Error::Io {
                    path: p.display().to_string(),
                    reason: e.to_string(),
                })?,
        )),
        None => None,
    };
    let metrics_err = |e: std::io::Error| Error::Io {
        path: opts
            .metrics_jsonl
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        reason: e.to_string(),
    };
    let plan = match &opts.plan {
        Some(p) => p.clone(),
        None => Plan::keep_all(model),
    };
    let micro = opts
        .micro_batch
        .unwrap_or(opts.batch_size)
        .clamp(1, opts.batch_size);
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut scaler = opts.scaler.clone();
    let mut reports = Vec::new();
    if opts.memory_trace.is_some() {
        pool.record_timeline(true);
    }
    let mut step = 0;
    let mut saved_buffers = BnState::default();
    let save = |dir: &PathBuf,
                model: &mut ResNet,
                optimizer: &Optimizer,
                step: usize,
                scaler: Option<&GradScaler>| {
        checkpoint::save_checkpoint(
            dir,
            model,
            optimizer,
            step,
            scaler,
            &opts.fingerprint,
            opts.keep_checkpoints,
        )
    };
    let loader = Loader {
        data: train,
        batch_size: opts.batch_size,
        workers: opts.workers,
    };
    for epoch in 1..=opts.epochs {
        let mut order: Vec<usize> = (0..train.len()).collect();
        if opts.shuffle {
            order.shuffle(&mut rng);
        }
        let start = std::time::Instant::now();
        let (mut loss_sum, mut correct, mut seen, mut skipped) = (0.0, 0, 0, 0);
        let bar = progress_bar(opts.progress, order.len().div_ceil(opts.batch_size), epoch);
        let mut lr = opts.base_lr;
        // Per-step time includes waiting for the batch.
        let mut t0 = std::time::Instant::now();
        for batch in loader.epoch(scope, order, epoch) {
            let batch = batch?;
            skipped += batch.skipped;
            // A window whose every image is unreadable makes no step.
            if batch.labels.is_empty() {
                t0 = std::time::Instant::now();
                continue;
            }
            let n = batch.labels.len();
            if step < opts.resume_step {
                // Done before the run was resumed: replay the order only.
                step += 1;
                bar.inc(1);
                t0 = std::time::Instant::now();
                continue;
            }
            lr = opts.schedule.lr_at(opts.base_lr, step);
            optimizer.set_lr(lr);
            if opts.max_steps.is_some_and(|m| step >= m) {
                break;
            }
            model.zero_grad();
            // Without a scaler a non-finite step is dropped or stops the
            // run; the forward has already moved the BN running statistics
            // by then, so keep them to put back.
            if scaler.is_none() {
                save_buffers(model, &mut saved_buffers)?;
            }
            // One optimizer step per window; the loss of every micro-batch
            // is normalised by the window's sample count, so an uneven last
            // window weighs each sample as a full one would.
            let mut out = StepOutput {
                loss: 0.0,
                correct: 0,
            };
            let px = batch.images.len() / n;
            for (micro_images, labels) in batch
                .images
                .chunks(micro * px)
                .zip(batch.labels.chunks(micro))
            {
                let images = gather(pool, train.image_hw(), micro_images)?;
                let o = forward_backward(
                    model,
                    pool,
                    &plan,
                    images,
                    labels,
                    LossOptions {
                        label_smoothing: opts.label_smoothing,
                        window_samples: Some(n),
                        scale: scaler.as_ref().map(|s| s.scale),
                    },
                )?;
                out.loss += o.loss * labels.len() as f64 / n as f64;
                out.correct += o.correct;
            }
            step += 1;
            if opts.inject_inf_steps.contains(&step) {
                inject_inf(model);
            }
            // The scaler decides about non-finite values under f16: the
            // step is skipped and the scale backs off. Without one, a
            // non-finite loss or gradient stops the run before it reaches
            // the weights (the last checkpoint stays the last good one), or
            // with `NanPolicy::Skip` the step is dropped.
            let bad = if scaler.is_some() {
                None
            } else if !out.loss.is_finite() {
                Some("loss")
            } else if !grads_finite(model)? {
                Some("gradient")
            } else if !buffers_finite(model)? {
                Some("batch norm running statistic")
            } else {
                None
            };
            let non_finite = bad.is_some();
            if non_finite {
                restore_buffers(model, &saved_buffers)?;
            }
            if let Some(what) = bad
                && opts.nan_policy == NanPolicy::Stop
            {
                return Err(Error::NonFiniteLoss {
                    step,
                    loss: out.loss as f32,
                    what,
                    last_good: opts
                        .save_dir
                        .as_deref()
                        .and_then(checkpoint::newest_checkpoint)
                        .map(|p| p.display().to_string()),
                });
            }
            if non_finite {
                eprintln!(
                    "warning: step {step}: non-finite {} (loss {}), step skipped",
                    bad.unwrap_or("value"),
                    out.loss
                );
            }
            // Unscale exactly once per optimizer step, before clipping.
            let scaled = match scaler.as_mut() {
                Some(s) => {
                    let found_inf = s.unscale(model)?;
                    Some(ScalerStep {
                        scale: s.scale,
                        found_inf,
                        skipped: found_inf,
                    })
                }
                None => None,
            };
            let skip = non_finite || scaled.is_some_and(|s| s.skipped);
            let grad_norm = if skip {
                None
            } else {
                opts.clip_grad_norm
                    .map(|max| clip_grad_norm(model, max))
                    .transpose()?
            };
            if !skip {
                optimizer.step(pool, model)?;
            }
            if let (Some(s), Some(st)) = (scaler.as_mut(), scaled) {
                s.update(st.found_inf);
            }
            if step == TRACE_STEPS
                && let Some(path) = &opts.memory_trace
            {
                write_timeline_csv(&pool.timeline(), path)?;
                pool.record_timeline(false);
            }
            // A skipped f16 step's inf loss would poison the epoch's mean.
            if out.loss.is_finite() {
                loss_sum += out.loss * n as f64;
            }
            correct += out.correct;
            seen += n;
            bar.inc(1);
            bar.set_message(format!(
                "loss {:.4}, lr {lr:.4}, {:.0} img/s, peak {}",
                loss_sum / seen as f64,
                seen as f64 / start.elapsed().as_secs_f64(),
                crate::memory::fmt_bytes(pool.stats().peak_total)
            ));
            if let Some(w) = metrics.as_mut() {
                let secs = t0.elapsed().as_secs_f64();
                let gn = grad_norm.map_or("null".to_string(), |g| num(g as f64));
                let sc = scaled.map_or(
                    if non_finite {
                        ",\"skipped\":true".to_string()
                    } else {
                        String::new()
                    },
                    |s| {
                        format!(
                            ",\"scale\":{},\"found_inf\":{},\"skipped\":{}",
                            num(s.scale as f64),
                            s.found_inf,
                            s.skipped
                        )
                    },
                );
                writeln!(
                    w,
                    "{{\"step\":{step},\"epoch\":{epoch},\"loss\":{},\"lr\":{},\"img_per_s\":{},\"grad_norm\":{gn}{sc},{}}}",
                    num(out.loss),
                    num(lr as f64),
                    num(n as f64 / secs),
                    memory_fields(&pool.stats(), opts.predicted_peak)
                )
                .map_err(metrics_err)?;
            }
            if let Some(dir) = &opts.save_dir
                && opts.save_every_steps.is_some_and(|k| step % k.max(1) == 0)
            {
                save(dir, model, optimizer, step, scaler.as_ref())?;
            }
            if opts
                .stop
                .as_ref()
                .is_some_and(|f| f.load(std::sync::atomic::Ordering::SeqCst))
            {
                bar.finish_and_clear();
                let checkpoint = match &opts.save_dir {
                    Some(dir) => Some(
                        save(dir, model, optimizer, step, scaler.as_ref())?
                            .display()
                            .to_string(),
                    ),
                    None => None,
                };
                return Err(Error::Interrupted { step, checkpoint });
            }
            t0 = std::time::Instant::now();
        }
        bar.finish_and_clear();
        if step <= opts.resume_step && opts.resume_step > 0 {
            continue; // an epoch finished before the resumed run began
        }
        // Every window was empty: going on would report NaN and succeed.
        if seen == 0 && skipped > 0 {
            return Err(Error::NoReadableImages {
                what: format!("epoch {epoch}"),
                skipped,
                verb: "train on",
            });
        }
        let secs = start.elapsed().as_secs_f64();
        let eval = if (epoch % opts.eval_every.max(1) == 0 || epoch == opts.epochs)
            && !val.is_empty()
        {
            // Evaluate in micro-batches too: a full batch without saved
            // tensors can still need more than the budget allows.
            let e = evaluate(model, pool, val, micro, opts.workers)?;
            skipped += e.skipped;
            if let Some(w) = metrics.as_mut() {
                writeln!(
                    w,
                    "{{\"epoch\":{epoch},\"step\":{step},\"val_loss\":{},\"val_top1\":{},\"val_top5\":{}}}",
                    num(e.loss),
                    num(e.top1),
                    num(e.top5)
                )
                .map_err(metrics_err)?;
            }
            Some(e)
        } else {
            None
        };
        if let Some(w) = metrics.as_mut() {
            w.flush().map_err(metrics_err)?;
        }
        let report = EpochReport {
            epoch,
            train_loss: loss_sum / seen as f64,
            train_top1: correct as f64 / seen as f64,
            lr,
            eval,
            img_per_s: seen as f64 / secs,
            memory: pool.stats(),
            skipped,
        };
        on_epoch(&report);
        reports.push(report);
        if let Some(dir) = &opts.save_dir
            && (opts
                .save_every_epochs
                .is_some_and(|k| epoch % k.max(1) == 0)
                || epoch == opts.epochs
                || opts.max_steps.is_some_and(|m| step >= m))
        {
            save(dir, model, optimizer, step, scaler.as_ref())?;
        }
        if opts.max_steps.is_some_and(|m| step >= m) {
            break;
        }
    }
    if step < TRACE_STEPS
        && let Some(path) = &opts.memory_trace
    {
        write_timeline_csv(&pool.timeline(), path)?;
        pool.record_timeline(false);
    }
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_counts_ties_against_the_label() {
        let row = [0.1, 0.5, 0.5, 0.2];
        assert!(in_top_k(&row, 1, 1));
        assert!(!in_top_k(&row, 2, 1)); // tied with an earlier class
        assert!(in_top_k(&row, 2, 2));
        assert!(!in_top_k(&row, 0, 3));
        assert!(in_top_k(&row, 0, 4));
        assert!(!in_top_k(&[1.0; 6], 3, 3));
    }
}
