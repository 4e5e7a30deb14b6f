//! The training loop over a [`Dataset`]: shuffled mini-batches (made by a
//! [`Loader`], on background threads if asked), the optimizer with its LR
//! schedule (advanced once per optimizer step), optional gradient clipping,
//! evaluation (loss, top-1, top-5), one JSON line (CSV row) per step and
//! per evaluation in a metrics file, and progress on stderr: a bar on a
//! terminal, a line every `--log-every` steps (or ~30 s) otherwise.

pub mod dist;
pub mod metrics;
pub mod state;
pub mod step;

use std::io::IsTerminal;
use std::path::PathBuf;

use rand::{SeedableRng, rngs::ChaCha8Rng, seq::SliceRandom};

use crate::backend;
use crate::data::{Dataset, Loader, Part};
use crate::error::{Error, Result};
use crate::exec::{Plan, forward_eval};
use crate::memory::{Category, MemoryStats, Pool, Tag, write_timeline_csv};
use crate::nn::{Precision, ResNet};
pub use crate::optim::Optimizer;
use crate::optim::{GradScaler, LrSchedule};
pub use dist::fit_distributed;
use metrics::MetricsWriter;
use state::{EpochSums, StateSaving};
use step::{StepPolicy, TrainStep, gather};

pub struct TrainOptions {
    pub epochs: usize,
    /// Stop after this many optimizer steps (the last epoch may be partial).
    pub max_steps: Option<usize>,
    /// Show progress on stderr: a bar per epoch on a terminal, else a
    /// line every [`TrainOptions::log_every`] steps.
    pub progress: bool,
    /// With `progress`: a line every this many optimizer steps (on a
    /// terminal too, above the bar). None: on a terminal the bar only,
    /// otherwise a line about every [`LOG_INTERVAL`].
    pub log_every: Option<usize>,
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
    /// The same metrics as CSV (see [`metrics`]).
    pub metrics_csv: Option<PathBuf>,
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
    /// Save training state (checkpoints) as this says (see [`state`]).
    pub saving: Option<StateSaving>,
    /// Optimizer steps already taken by the run being resumed: their
    /// windows are skipped (the data order is replayed, nothing computed).
    pub resume_step: usize,
    /// The running sums of the epoch the resumed state was saved in: that
    /// epoch's line then reports all of its steps, not only those after the
    /// restart.
    pub resume_sums: Option<EpochSums>,
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
    /// None with 5 classes or fewer, where every label is in the top 5.
    pub top5: Option<f64>,
    /// Images evaluated; fewer than the set's length by `skipped`.
    pub samples: usize,
    /// Unreadable images left out.
    pub skipped: usize,
}

impl EvalReport {
    /// "12.34%", or "n/a" with 5 classes or fewer (always 100%).
    pub fn top5_text(&self) -> String {
        self.top5
            .map_or("n/a".to_string(), |t| format!("{:.2}%", 100.0 * t))
    }
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
    evaluate_on(model, pool, data, batch_size, workers, &crate::dist::Single)
}

/// [`evaluate`] as one rank of a data-parallel run: each rank evaluates
/// its shard ([`crate::dist::shard`]) of `data` and the sums are added
/// across ranks, so every rank gets the report of the whole set (the
/// ranks' running BN statistics are equal: rank 0's are broadcast after
/// every step).
pub fn evaluate_on(
    model: &mut ResNet,
    pool: &Pool,
    data: &dyn Dataset,
    batch_size: usize,
    workers: usize,
    comm: &dyn crate::dist::Collective,
) -> Result<EvalReport> {
    let classes = model.config.num_classes;
    let (mut loss, mut top1, mut top5) = (0.0, 0, 0);
    let (mut samples, mut skipped) = (0, 0);
    let order: Vec<usize> = crate::dist::shard(data.len(), comm.rank(), comm.size()).collect();
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
    if comm.size() > 1 {
        let mut sums = [0.0; 5];
        comm.sum_f64(
            &[
                loss,
                top1 as f64,
                top5 as f64,
                samples as f64,
                skipped as f64,
            ],
            &mut sums,
        )?;
        loss = sums[0];
        (top1, top5, samples, skipped) = (
            sums[1] as usize,
            sums[2] as usize,
            sums[3] as usize,
            sums[4] as usize,
        );
    }
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
        top5: (classes > 5).then(|| top5 as f64 / n),
        samples,
        skipped,
    })
}

/// How often a progress line is written without a terminal and without
/// `log_every`.
pub const LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// When to write a progress line: every `every` optimizer steps, or (with
/// none, off a terminal) when [`LOG_INTERVAL`] has passed since the last.
struct LogLines {
    every: Option<usize>,
    terminal: bool,
    last: std::time::Instant,
}

impl LogLines {
    fn due(&mut self, step: usize, now: std::time::Instant) -> bool {
        let due = match self.every {
            Some(k) => step.is_multiple_of(k.max(1)),
            None => !self.terminal && now.duration_since(self.last) >= LOG_INTERVAL,
        };
        if due {
            self.last = now;
        }
        due
    }
}

/// Images per second as the epoch line and progress show them: `412`, or
/// `3.6` below 100 (ResNet-50 at 224 on a few cores).
pub fn fmt_rate(img_per_s: f64) -> String {
    if img_per_s < 100.0 {
        format!("{img_per_s:.1}")
    } else {
        format!("{img_per_s:.0}")
    }
}

/// `1h02m03s`, `4m05s`, `6s`.
fn fmt_duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
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
    let comm: std::rc::Rc<dyn crate::dist::Collective> = std::rc::Rc::new(crate::dist::Single);
    fit_distributed(model, pool, optimizer, train, val, opts, comm, on_epoch)
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
    comm: std::rc::Rc<dyn crate::dist::Collective>,
    mut on_epoch: impl FnMut(&EpochReport),
) -> Result<Vec<EpochReport>> {
    // Distributed (train/dist.rs): only rank 0 prints and writes files.
    let root = comm.is_root();
    let saving_here = opts.saving.as_ref().filter(|_| root);
    let trace_here = opts.memory_trace.as_ref().filter(|_| root);
    if opts.batch_size == 0 {
        return Err(Error::invalid("train", "batch size must be at least 1"));
    }
    if train.is_empty() {
        return Err(Error::invalid("train", "the training set is empty"));
    }
    let resumed = (opts.resume_step > 0).then_some(opts.resume_step);
    let mut metrics = MetricsWriter::open(opts.metrics_jsonl.as_deref().filter(|_| root), resumed)?
        .with_csv(opts.metrics_csv.as_deref().filter(|_| root))?;
    let terminal = std::io::stderr().is_terminal();
    let mut log = LogLines {
        every: opts.log_every,
        terminal,
        last: std::time::Instant::now(),
    };
    let steps_per_epoch = train.len().div_ceil(opts.batch_size);
    let total_steps = opts
        .max_steps
        .unwrap_or(opts.epochs * steps_per_epoch)
        .min(opts.epochs * steps_per_epoch);
    // The ETA's rate: steps taken in this process over their time.
    let run_start = std::time::Instant::now();
    let micro = opts
        .micro_batch
        .unwrap_or(opts.batch_size)
        .clamp(1, opts.batch_size);
    let mut trainer = TrainStep::new(
        StepPolicy {
            plan: match &opts.plan {
                Some(p) => p.clone(),
                None => Plan::keep_all(model),
            },
            micro_batch: micro,
            label_smoothing: opts.label_smoothing,
            clip_grad_norm: opts.clip_grad_norm,
            nan_policy: opts.nan_policy,
        },
        opts.scaler.clone(),
    )
    .distributed(comm.clone());
    dist::broadcast_state(comm.as_ref(), model)?;
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut reports = Vec::new();
    if trace_here.is_some() {
        pool.record_timeline(true);
    }
    let mut step = 0;
    let save = |saving: &StateSaving,
                model: &mut ResNet,
                optimizer: &Optimizer,
                step: usize,
                scaler: Option<&GradScaler>,
                sums: EpochSums| {
        state::save_state(saving, model, optimizer, step, scaler, sums)
    };
    let loader = Loader {
        data: train,
        batch_size: opts.batch_size,
        workers: opts.workers,
    };
    // Each rank loads only its shard of every window.
    let part = Part {
        rank: comm.rank(),
        ranks: comm.size(),
    };
    for epoch in 1..=opts.epochs {
        let mut order: Vec<usize> = (0..train.len()).collect();
        if opts.shuffle {
            order.shuffle(&mut rng);
        }
        let start = std::time::Instant::now();
        let (mut loss_sum, mut correct, mut seen, mut skipped) = (0.0, 0, 0, 0);
        // Images trained on in this process (the rate counts only them).
        let mut seen_here = 0;
        // The steps of this epoch before the restart count in its line.
        if let Some(s) = opts.resume_sums.filter(|s| s.epoch == epoch) {
            (loss_sum, correct, seen) = (s.loss_sum, s.correct, s.seen);
        }
        let bar = progress_bar(
            opts.progress && root && terminal,
            order.len().div_ceil(opts.batch_size),
            epoch,
        );
        let mut lr = opts.base_lr;
        // Per-step time includes waiting for the batch.
        let mut t0 = std::time::Instant::now();
        for batch in loader.epoch_part(scope, order, epoch, part) {
            let batch = batch?;
            // Readable and skipped samples of the whole window (every rank).
            let (n, window_skipped) =
                dist::window_counts(comm.as_ref(), batch.labels.len(), batch.skipped)?;
            skipped += window_skipped;
            // A window whose every image is unreadable makes no step.
            if n == 0 {
                t0 = std::time::Instant::now();
                continue;
            }
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
            step += 1;
            let out = trainer
                .run(
                    model,
                    pool,
                    optimizer,
                    &batch.images,
                    train.image_hw(),
                    &batch.labels,
                    n,
                    step,
                    opts.inject_inf_steps.contains(&step),
                )
                .map_err(|e| match e {
                    // The last saved state stays the last good one.
                    Error::NonFiniteLoss {
                        step, loss, what, ..
                    } => Error::NonFiniteLoss {
                        step,
                        loss,
                        what,
                        last_good: opts
                            .saving
                            .as_ref()
                            .and_then(|s| state::newest_state(&s.dir))
                            .map(|p| p.display().to_string()),
                    },
                    other => other,
                })?;
            if let Some(what) = out.dropped {
                eprintln!(
                    "warning: step {step}: non-finite {what} (loss {}), step skipped",
                    out.loss
                );
            }
            if step == TRACE_STEPS
                && let Some(path) = trace_here
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
            seen_here += n;
            let sums = EpochSums {
                epoch,
                loss_sum,
                correct,
                seen,
            };
            let step_secs = t0.elapsed().as_secs_f64();
            bar.inc(1);
            let now = std::time::Instant::now();
            let line_due = opts.progress && root && log.due(step, now);
            if (opts.progress && root && terminal) || line_due || metrics.is_on() {
                let stats = pool.stats();
                let progress = format!(
                    "loss {:.4}, lr {lr:.4}, {} img/s, tracked peak {}",
                    loss_sum / seen as f64,
                    fmt_rate(seen_here as f64 / start.elapsed().as_secs_f64()),
                    crate::memory::fmt_bytes(stats.peak_total)
                );
                if line_due {
                    let done_here = step - opts.resume_step;
                    let per_step = now.duration_since(run_start).as_secs_f64() / done_here as f64;
                    let eta = fmt_duration(per_step * total_steps.saturating_sub(step) as f64);
                    let line =
                        format!("step {step}/{total_steps} (epoch {epoch}), {progress}, ETA {eta}");
                    if terminal {
                        bar.println(line);
                    } else {
                        eprintln!("{line}");
                    }
                }
                if opts.progress && root && terminal {
                    bar.set_message(progress);
                }
                metrics.step(
                    step,
                    epoch,
                    &out,
                    lr,
                    step_secs,
                    &stats,
                    opts.predicted_peak,
                )?;
            }
            if let Some(saving) = saving_here
                && saving.every_steps.is_some_and(|k| step % k.max(1) == 0)
            {
                save(
                    saving,
                    model,
                    optimizer,
                    step,
                    trainer.scaler.as_ref(),
                    sums,
                )?;
            }
            if dist::any_rank(
                comm.as_ref(),
                opts.stop
                    .as_ref()
                    .is_some_and(|f| f.load(std::sync::atomic::Ordering::SeqCst)),
            )? {
                bar.finish_and_clear();
                let saved_state = match saving_here {
                    Some(saving) => Some(
                        save(
                            saving,
                            model,
                            optimizer,
                            step,
                            trainer.scaler.as_ref(),
                            sums,
                        )?
                        .display()
                        .to_string(),
                    ),
                    None => None,
                };
                return Err(Error::Interrupted { step, saved_state });
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
        let eval =
            if (epoch % opts.eval_every.max(1) == 0 || epoch == opts.epochs) && !val.is_empty() {
                // Evaluate in micro-batches too: a full batch without saved
                // tensors can still need more than the budget allows.
                let e = evaluate_on(model, pool, val, micro, opts.workers, comm.as_ref())?;
                skipped += e.skipped;
                metrics.eval(epoch, step, &e)?;
                Some(e)
            } else {
                None
            };
        metrics.flush()?;
        let report = EpochReport {
            epoch,
            train_loss: loss_sum / seen as f64,
            train_top1: correct as f64 / seen as f64,
            lr,
            eval,
            img_per_s: seen_here as f64 / secs,
            memory: pool.stats(),
            skipped,
        };
        if root {
            on_epoch(&report);
        }
        reports.push(report);
        if let Some(saving) = saving_here
            && (saving.every_epochs.is_some_and(|k| epoch % k.max(1) == 0)
                || epoch == opts.epochs
                || opts.max_steps.is_some_and(|m| step >= m))
        {
            let sums = EpochSums {
                epoch,
                loss_sum,
                correct,
                seen,
            };
            save(
                saving,
                model,
                optimizer,
                step,
                trainer.scaler.as_ref(),
                sums,
            )?;
        }
        if opts.max_steps.is_some_and(|m| step >= m) {
            break;
        }
    }
    if step < TRACE_STEPS
        && let Some(path) = trace_here
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

    #[test]
    fn log_lines_every_k_steps_or_every_interval_off_a_terminal() {
        let t = std::time::Instant::now();
        let mut every = LogLines {
            every: Some(3),
            terminal: false,
            last: t,
        };
        let due: Vec<usize> = (1..=7).filter(|&s| every.due(s, t)).collect();
        assert_eq!(due, [3, 6]);
        let mut timed = LogLines {
            every: None,
            terminal: false,
            last: t,
        };
        assert!(!timed.due(1, t + LOG_INTERVAL / 2));
        assert!(timed.due(2, t + LOG_INTERVAL));
        assert!(!timed.due(3, t + LOG_INTERVAL * 3 / 2));
        assert!(timed.due(4, t + LOG_INTERVAL * 2));
        // On a terminal the bar shows progress; lines only when asked.
        let mut bar = LogLines {
            every: None,
            terminal: true,
            last: t,
        };
        assert!(!bar.due(1, t + LOG_INTERVAL * 10));
        assert_eq!(fmt_duration(6.4), "6s");
        assert_eq!(
            (fmt_rate(3.62), fmt_rate(412.4)),
            ("3.6".into(), "412".into())
        );
        assert_eq!(fmt_duration(245.0), "4m05s");
        assert_eq!(fmt_duration(3723.0), "1h02m03s");
    }
}
