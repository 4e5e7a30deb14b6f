//! Runs the stage chain forward and backward for one batch under a [`Plan`]
//! and accumulates parameter gradients into the model's `grad` tensors.
//!
//! A plan cuts the chain into segments. A kept segment stores what each
//! stage's backward needs; a recomputed segment stores only its input (the
//! checkpoint) and, when backward reaches it, replays its forward in
//! [`Mode::Recompute`] (same batch statistics and outputs, running stats
//! untouched) and then runs the stages' backward as usual. Kernels are
//! deterministic, so gradients are bit-identical whatever the plan.

use std::fmt;

mod rollback;
pub use rollback::BnRollback;

use crate::backend::{self, StepTotals};
use crate::error::{Error, Result};
use crate::memory::{Category, Pool, Tag};
use crate::nn::{Mode, ResNet, Saved};
use crate::tensor::Tensor;

/// A run of consecutive stages `start..end` and what happens to what they save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub start: usize,
    pub end: usize,
    /// Keep only the input; replay the forward in backward.
    pub recompute: bool,
}

/// Segments covering the chain in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub segments: Vec<Segment>,
}

impl Plan {
    /// One kept segment: everything saved, nothing recomputed.
    pub fn keep_all(model: &ResNet) -> Self {
        Self::keep_all_len(model.stages.len())
    }

    /// [`Plan::keep_all`] for a chain of `stages` stages.
    pub fn keep_all_len(stages: usize) -> Self {
        Plan {
            segments: vec![Segment {
                start: 0,
                end: stages,
                recompute: false,
            }],
        }
    }

    /// Builds a plan from per-stage flags: consecutive kept stages merge;
    /// `segment_starts[i]` marks where a recomputed segment begins.
    pub fn from_flags(recompute: &[bool], segment_starts: &[bool]) -> Self {
        let mut segments: Vec<Segment> = Vec::new();
        for (i, &r) in recompute.iter().enumerate() {
            let extend = match segments.last() {
                Some(last) => last.recompute == r && !(r && segment_starts[i]),
                None => false,
            };
            if extend {
                segments.last_mut().expect("checked").end = i + 1;
            } else {
                segments.push(Segment {
                    start: i,
                    end: i + 1,
                    recompute: r,
                });
            }
        }
        Plan { segments }
    }

    /// Whether stage `i` is recomputed.
    pub fn recomputes(&self, i: usize) -> bool {
        self.segments
            .iter()
            .any(|s| s.recompute && (s.start..s.end).contains(&i))
    }

    /// Number of recomputed segments (checkpoints kept).
    pub fn checkpoints(&self) -> usize {
        self.segments.iter().filter(|s| s.recompute).count()
    }

    /// Checks the plan covers `stages` stages in order and never recomputes
    /// the head (which keeps no input to replay from).
    pub fn validate(&self, stages: usize) -> Result<()> {
        let mut next = 0;
        for s in &self.segments {
            if s.start != next || s.end <= s.start {
                return Err(Error::invalid(
                    "plan",
                    format!("segments must cover the chain in order, got {self}"),
                ));
            }
            next = s.end;
        }
        if next != stages {
            return Err(Error::invalid(
                "plan",
                format!("plan covers {next} stages, the model has {stages}"),
            ));
        }
        if self.recomputes(stages - 1) {
            return Err(Error::invalid(
                "plan",
                "the head cannot be recomputed (it keeps only pooled features)",
            ));
        }
        Ok(())
    }
}

/// `keep[0..17] recompute[17..20]` style, stage indices.
impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.segments.iter().enumerate() {
            if i > 0 {
                write!(f, " ")?;
            }
            let kind = if s.recompute { "recompute" } else { "keep" };
            write!(f, "{kind}[{}..{}]", s.start, s.end)?;
        }
        Ok(())
    }
}

/// Result of one forward + backward.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// Mean cross-entropy over the batch.
    pub loss: f64,
    /// Samples whose top-1 prediction was right.
    pub correct: usize,
}

/// Options of the loss.
#[derive(Clone, Copy, Debug, Default)]
pub struct LossOptions {
    pub label_smoothing: f32,
    /// Samples in the whole accumulation window this batch belongs to (the
    /// gradient is of the window's mean loss); `None` = this batch alone.
    pub window_samples: Option<usize>,
    /// The loss scaler's factor (f16): the gradient is of `scale · loss`;
    /// `None` = 1. The returned loss is unscaled.
    pub scale: Option<f32>,
}

/// What the forward left for the backward, one entry per segment.
enum Tape {
    Kept(Vec<Saved>),
    Checkpoint(Tensor),
}

fn saved_or_err(s: Option<Saved>) -> Result<Saved> {
    s.ok_or_else(|| Error::invalid("exec", "training forward returned no saved state"))
}

/// Forward and backward of one batch: `images` (n, h, w, 3) is consumed,
/// gradients accumulate into the parameters' `grad`. Returns the loss and
/// hits (one read from a GPU, after the backward is queued).
pub fn forward_backward(
    model: &mut ResNet,
    pool: &Pool,
    plan: &Plan,
    images: Tensor,
    labels: &[usize],
    loss_opts: LossOptions,
) -> Result<StepOutput> {
    let mut totals = StepTotals::new(pool)?;
    forward_backward_into(
        &mut totals,
        model,
        pool,
        plan,
        images,
        labels,
        loss_opts,
        None,
    )?;
    let t = totals.read()?;
    Ok(StepOutput {
        loss: t.loss,
        correct: t.correct,
    })
}

/// [`forward_backward`] adding the loss and hits into `totals` (nothing
/// returns to the host): `share = Some((num, den))` adds the loss times
/// `num / den`, a micro-batch's part of its window's mean.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_into(
    totals: &mut StepTotals,
    model: &mut ResNet,
    pool: &Pool,
    plan: &Plan,
    images: Tensor,
    labels: &[usize],
    loss_opts: LossOptions,
    share: Option<(usize, usize)>,
) -> Result<()> {
    plan.validate(model.stages.len())?;
    let n = images.dims()[0];
    if labels.len() != n {
        return Err(Error::ShapeMismatch {
            op: "exec",
            expected: format!("{n} labels"),
            got: labels.len().to_string(),
        });
    }
    let ctx = model.ctx(pool);
    let mut tape: Vec<Tape> = Vec::with_capacity(plan.segments.len());
    let mut x = images;
    for seg in &plan.segments {
        let stages = &mut model.stages[seg.start..seg.end];
        if seg.recompute {
            let mut checkpoint = None;
            for stage in stages.iter_mut() {
                let (y, s) = stage.forward(&ctx, x, Mode::Train)?;
                let s = saved_or_err(s)?;
                if checkpoint.is_none() {
                    checkpoint = Some(s.into_input().ok_or_else(|| {
                        Error::invalid("exec", "this stage cannot start a recomputed segment")
                    })?);
                }
                x = y;
            }
            tape.push(Tape::Checkpoint(checkpoint.expect("segment is not empty")));
        } else {
            let mut kept = Vec::with_capacity(stages.len());
            for stage in stages.iter_mut() {
                let (y, s) = stage.forward(&ctx, x, Mode::Train)?;
                kept.push(saved_or_err(s)?);
                x = y;
            }
            tape.push(Tape::Kept(kept));
        }
    }
    let logits = x;
    let mut d_logits = pool.empty_f32(
        logits.dims(),
        Category::Activations,
        Tag::fixed("loss.d_logits"),
    )?;
    // The gradient reaching a low-type linear is of the low type.
    backend::cross_entropy_add(
        totals,
        &mut d_logits,
        &logits,
        labels,
        loss_opts.label_smoothing,
        loss_opts.window_samples.unwrap_or(n),
        loss_opts.scale,
        model.precision(),
        share,
    )?;
    drop(logits);

    let mut d = Some(d_logits);
    for (seg, entry) in plan.segments.iter().zip(tape).rev() {
        let stages = &mut model.stages[seg.start..seg.end];
        let mut saved = match entry {
            Tape::Kept(saved) => saved,
            Tape::Checkpoint(input) => {
                let mut saved = Vec::with_capacity(stages.len());
                let mut x = input;
                for stage in stages.iter_mut() {
                    let (y, s) = stage.forward(&ctx, x, Mode::Recompute)?;
                    saved.push(saved_or_err(s)?);
                    x = y;
                }
                drop(x); // the segment output: the next segment already used it
                saved
            }
        };
        for stage in stages.iter_mut().rev() {
            let s = saved
                .pop()
                .ok_or_else(|| Error::invalid("exec", "saved state missing"))?;
            let grad_out = d
                .take()
                .ok_or_else(|| Error::invalid("exec", "gradient missing"))?;
            d = stage.backward(&ctx, s, grad_out)?;
        }
    }
    Ok(())
}

/// Evaluation forward: running BN statistics, nothing saved. Returns the
/// logits (n, classes).
pub fn forward_eval(model: &mut ResNet, pool: &Pool, images: Tensor) -> Result<Tensor> {
    let ctx = model.ctx(pool);
    let mut x = images;
    for stage in model.stages.iter_mut() {
        x = stage.forward(&ctx, x, Mode::Eval)?.0;
    }
    Ok(x)
}
