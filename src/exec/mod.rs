//! Runs the stage chain forward and backward for one batch under a [`Plan`]
//! and accumulates parameter gradients into the model's `grad` tensors.
//!
//! The plan has one entry per stage so recompute strategies (checkpointed
//! segments, selective recompute) slot in without changing the loop's shape;
//! today every stage keeps what its backward needs.

use crate::error::{Error, Result};
use crate::memory::{Category, Pool, Tag};
use crate::nn::{Mode, ResNet, Saved};
use crate::ops::cross_entropy::cross_entropy_forward_backward;
use crate::tensor::Tensor;

/// What to do with one stage's saved tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagePlan {
    /// Keep everything the backward needs from the forward.
    Keep,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub stages: Vec<StagePlan>,
}

impl Plan {
    pub fn keep_all(model: &ResNet) -> Self {
        Plan {
            stages: vec![StagePlan::Keep; model.stages.len()],
        }
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
}

/// Index of the largest logit of each row.
pub fn argmax_rows(logits: &[f32], classes: usize) -> Vec<usize> {
    logits
        .chunks_exact(classes)
        .map(|row| {
            row.iter()
                .enumerate()
                .fold(0, |best, (i, &v)| if v > row[best] { i } else { best })
        })
        .collect()
}

/// Forward and backward of one batch: `images` (n, h, w, 3) is consumed,
/// gradients accumulate into the parameters' `grad`.
pub fn forward_backward(
    model: &mut ResNet,
    pool: &Pool,
    plan: &Plan,
    images: Tensor,
    labels: &[usize],
    loss_opts: LossOptions,
) -> Result<StepOutput> {
    if plan.stages.len() != model.stages.len() {
        return Err(Error::invalid(
            "exec",
            format!(
                "plan has {} stages, model {}",
                plan.stages.len(),
                model.stages.len()
            ),
        ));
    }
    let n = images.dims()[0];
    if labels.len() != n {
        return Err(Error::ShapeMismatch {
            op: "exec",
            expected: format!("{n} labels"),
            got: labels.len().to_string(),
        });
    }
    let mut saved: Vec<Saved> = Vec::with_capacity(model.stages.len());
    let mut x = images;
    for (stage, step) in model.stages.iter_mut().zip(&plan.stages) {
        match step {
            StagePlan::Keep => {
                let (y, s) = stage.forward(pool, x, Mode::Train)?;
                saved.push(s.ok_or_else(|| {
                    Error::invalid("exec", "training forward returned no saved state")
                })?);
                x = y;
            }
        }
    }
    let logits = x;
    let classes = model.config.num_classes;
    let mut d_logits = pool.empty_f32(
        logits.dims(),
        Category::Activations,
        Tag::fixed("loss.d_logits"),
    )?;
    let loss = cross_entropy_forward_backward(
        d_logits.f32_mut(),
        logits.f32(),
        labels,
        classes,
        loss_opts.label_smoothing,
    )?;
    let correct = argmax_rows(logits.f32(), classes)
        .iter()
        .zip(labels)
        .filter(|(p, l)| p == l)
        .count();
    drop(logits);

    let mut d = d_logits;
    for stage in model.stages.iter_mut().rev() {
        let s = saved
            .pop()
            .ok_or_else(|| Error::invalid("exec", "saved state missing"))?;
        match stage.backward(pool, s, d)? {
            Some(g) => d = g,
            None => break,
        }
    }
    Ok(StepOutput { loss, correct })
}

/// Evaluation forward: running BN statistics, nothing saved. Returns the
/// logits (n, classes).
pub fn forward_eval(model: &mut ResNet, pool: &Pool, images: Tensor) -> Result<Tensor> {
    let mut x = images;
    for stage in model.stages.iter_mut() {
        x = stage.forward(pool, x, Mode::Eval)?.0;
    }
    Ok(x)
}
