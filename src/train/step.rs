//! One optimizer step of training: the micro-batches of a window through
//! the executor, then the policies that decide what reaches the weights
//! (the loss scaler, the NaN policy, gradient clipping) and the optimizer.
//! The training loop, `memfit bench` and anything else that trains call
//! this, so there is one training step in the library.

use crate::backend::{self, StepTotals};
use crate::error::{Error, Result};
use crate::exec::{BnRollback, LossOptions, Plan, StepOutput, forward_backward_into};
use crate::memory::{Category, Pool, Tag};
use crate::nn::{ResNet, StateSlot};
use crate::optim::{GradScaler, Optimizer, ScalerStep, clip_to, grad_sum_squares_into, norm_of};
use crate::tensor::Tensor;

use super::NanPolicy;
use super::dist::{GradSync, broadcast_buffers};

/// What decides an optimizer step besides the data: fixed for a run.
#[derive(Clone, Debug)]
pub struct StepPolicy {
    /// What each stage keeps or recomputes.
    pub plan: Plan,
    /// Samples per forward/backward (the window is split into these).
    pub micro_batch: usize,
    pub label_smoothing: f32,
    pub clip_grad_norm: Option<f32>,
    /// What a non-finite loss or gradient does without a loss scaler.
    pub nan_policy: NanPolicy,
}

/// What a step reports to the loop and its observers.
#[derive(Clone, Copy, Debug)]
pub struct StepReport {
    /// The window's mean loss (inf or NaN when the step overflowed).
    pub loss: f64,
    /// Top-1 hits in the window.
    pub correct: usize,
    /// Samples in the window.
    pub samples: usize,
    /// The total gradient norm before clipping, when clipping ran.
    pub grad_norm: Option<f32>,
    /// The scaler's decision, under f16.
    pub scaled: Option<ScalerStep>,
    /// Without a scaler: what was non-finite, when the step was dropped
    /// under [`NanPolicy::Skip`].
    pub dropped: Option<&'static str>,
}

/// The training step: the policy and the state it keeps across steps.
pub struct TrainStep {
    pub policy: StepPolicy,
    /// Dynamic loss scaling (f16): `None` trains unscaled.
    pub scaler: Option<GradScaler>,
    /// BN running statistics before the step, to put back when a step is
    /// dropped (its host vectors are kept across steps so steady-state CPU
    /// steps allocate nothing).
    saved_buffers: BnRollback,
    /// Data-parallel training (see [`super::dist`]): `None` in one process.
    pub dist: Option<GradSync>,
}

impl TrainStep {
    pub fn new(policy: StepPolicy, scaler: Option<GradScaler>) -> Self {
        TrainStep {
            policy,
            scaler,
            saved_buffers: BnRollback::default(),
            dist: None,
        }
    }

    /// This step as one rank of a data-parallel run: each call trains on
    /// the rank's shard of the window it is given and sums the gradients
    /// across ranks. A world of one changes nothing.
    pub fn distributed(mut self, comm: std::rc::Rc<dyn crate::dist::Collective>) -> Self {
        self.dist = (comm.size() > 1).then(|| GradSync::new(comm));
        self
    }

    /// One optimizer step over a window of `window` samples, of which this
    /// process trains on `labels.len()` whose images (n, h, w, 3, on the
    /// host) are `images`: all of them in one process; under
    /// [`TrainStep::distributed`] this rank's shard, `window` being the sum
    /// over the ranks. `step` is the 1-based number of this optimizer step;
    /// `inject_inf` sets one gradient element to inf after the backward (a
    /// test hook, as an f16 overflow).
    ///
    /// Under [`NanPolicy::Stop`] a non-finite loss, gradient or BN running
    /// statistic is an [`Error::NonFiniteLoss`] and nothing reaches the
    /// weights (its `last_good` is for the caller to fill).
    ///
    /// On a GPU the step reads from the device once ([`StepTotals`]): the
    /// window's loss and hits, the found-inf (or non-finite) flag and the
    /// clipping norm come back together after the last backward, the
    /// unscale and the checks are queued, and everything after is queued
    /// without a read (a dropped step reads once more, to name what was
    /// non-finite).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        model: &mut ResNet,
        pool: &Pool,
        optimizer: &mut Optimizer,
        images: &[f32],
        image_hw: (usize, usize),
        labels: &[usize],
        window: usize,
        step: usize,
        inject_inf: bool,
    ) -> Result<StepReport> {
        let n = window;
        // Before the first forward: see Optimizer::allocate_state.
        optimizer.allocate_state(pool, model)?;
        model.zero_grad();
        // Without a scaler a non-finite step is dropped or stops the run;
        // the forward has already moved the BN running statistics by then,
        // so keep them to put back.
        if self.scaler.is_none() {
            self.saved_buffers.save(pool, model)?;
        }
        // The loss of every micro-batch is normalised by the window's
        // sample count, so an uneven last window weighs each sample as a
        // full one would; each adds its share into the step's totals.
        let mut totals = StepTotals::new(pool)?;
        let micro = self.policy.micro_batch.max(1);
        let px = images.len() / labels.len().max(1);
        for (micro_images, micro_labels) in images.chunks(micro * px).zip(labels.chunks(micro)) {
            let x = gather(pool, image_hw, micro_images)?;
            forward_backward_into(
                &mut totals,
                model,
                pool,
                &self.policy.plan,
                x,
                micro_labels,
                LossOptions {
                    label_smoothing: self.policy.label_smoothing,
                    window_samples: Some(n),
                    scale: self.scaler.as_ref().map(|s| s.scale),
                },
                Some((micro_labels.len(), n)),
            )?;
        }
        if inject_inf {
            inject_inf_grad(model);
        }
        // Once per optimizer step, after the last micro-batch: the summed
        // gradients and rank 0's BN running statistics are then the same
        // on every rank, so every flag below agrees.
        if let Some(d) = self.dist.as_mut() {
            d.sum_grads(pool, model)?;
            broadcast_buffers(d.comm.as_ref(), model)?;
        }
        // Queued, not read: the scaler's unscale (exactly once per
        // optimizer step, before clipping) or, without one, the finite
        // checks of every gradient and BN running statistic, then the
        // clipping norm's squares.
        match self.scaler.as_ref() {
            Some(s) => s.unscale_into(model, &mut totals)?,
            None => {
                grads_finite_into(model, &mut totals)?;
                buffers_finite_into(model, &mut totals)?;
            }
        }
        if self.policy.clip_grad_norm.is_some() {
            grad_sum_squares_into(model, &mut totals)?;
        }
        // The step's one read.
        let read = totals.read()?;
        drop(totals);
        let mut out = StepOutput {
            loss: read.loss,
            correct: read.correct,
        };
        if let Some(d) = self.dist.as_mut() {
            let mut sums = [0.0; 2];
            d.comm.sum_f64(&[out.loss, out.correct as f64], &mut sums)?;
            out.loss = sums[0];
            out.correct = sums[1] as usize;
        }
        // The scaler decides about non-finite values under f16: the step is
        // skipped and the scale backs off. Without one, a non-finite loss
        // or gradient stops the run before it reaches the weights, or with
        // `NanPolicy::Skip` the step is dropped.
        let bad = if self.scaler.is_some() {
            None
        } else if !out.loss.is_finite() {
            Some("loss")
        } else if read.non_finite {
            // Naming it is a courtesy: a failure here must not keep the
            // statistics from being put back.
            Some(name_non_finite(pool, model).unwrap_or("gradient or batch norm statistic"))
        } else {
            None
        };
        let restored = match bad {
            Some(_) => self.saved_buffers.restore(model),
            None => Ok(()),
        };
        self.saved_buffers.release();
        restored?;
        if let Some(what) = bad
            && self.policy.nan_policy == NanPolicy::Stop
        {
            return Err(Error::NonFiniteLoss {
                step,
                loss: out.loss as f32,
                what,
                last_good: None,
            });
        }
        let scaled = self.scaler.as_ref().map(|s| ScalerStep {
            scale: s.scale,
            found_inf: read.non_finite,
            skipped: read.non_finite,
        });
        let skip = bad.is_some() || scaled.is_some_and(|s| s.skipped);
        let grad_norm = match self.policy.clip_grad_norm {
            Some(max) if !skip => {
                let total = norm_of(read.sum_squares);
                clip_to(model, max, total)?;
                Some(total)
            }
            _ => None,
        };
        if !skip {
            optimizer.step(pool, model)?;
        }
        if let (Some(s), Some(st)) = (self.scaler.as_mut(), scaled) {
            s.update(st.found_inf);
        }
        Ok(StepReport {
            loss: out.loss,
            correct: out.correct,
            samples: n,
            grad_norm,
            scaled,
            dropped: bad,
        })
    }
}

/// Copies loaded images (n, h, w, 3) into a pool tensor, where the budget
/// sees them.
pub(super) fn gather(pool: &Pool, (h, w): (usize, usize), images: &[f32]) -> Result<Tensor> {
    let n = images.len() / (h * w * 3).max(1);
    let mut t = pool.empty_f32(&[n, h, w, 3], Category::Data, Tag::fixed("batch.images"))?;
    backend::copy_from_host(&mut t, images)?;
    Ok(t)
}

/// Notes in `totals` whether a trainable gradient is inf or NaN.
fn grads_finite_into(model: &mut ResNet, totals: &mut StepTotals) -> Result<()> {
    let mut res = Ok(());
    model.visit_params(|p| {
        if res.is_ok() && !p.frozen {
            res = backend::check_finite_add(totals, &p.grad);
        }
    });
    res
}

/// Notes in `totals` whether a batch norm running statistic is inf or NaN.
/// A forward whose activations overflow can leave the loss and the
/// gradients finite (the normalised output saturates) and still poison the
/// running variance, which only evaluation would reveal.
fn buffers_finite_into(model: &mut ResNet, totals: &mut StepTotals) -> Result<()> {
    let mut res = Ok(());
    model.visit_state(|slot| {
        if let StateSlot::Buffer { tensor, .. } = slot
            && res.is_ok()
        {
            res = backend::check_finite_add(totals, tensor);
        }
    });
    res
}

/// What a dropped step found non-finite, gradients checked before the BN
/// statistics (one more read, on a step that is dropped anyway).
fn name_non_finite(pool: &Pool, model: &mut ResNet) -> Result<&'static str> {
    let mut grads = StepTotals::new(pool)?;
    grads_finite_into(model, &mut grads)?;
    Ok(if grads.read()?.non_finite {
        "gradient"
    } else {
        "batch norm running statistic"
    })
}

/// The test hook of [`TrainOptions::inject_inf_steps`]: the first trainable
/// gradient element becomes inf.
fn inject_inf_grad(model: &mut ResNet) {
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
