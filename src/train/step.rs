//! One optimizer step of training: the micro-batches of a window through
//! the executor, then the policies that decide what reaches the weights
//! (the loss scaler, the NaN policy, gradient clipping) and the optimizer.
//! The training loop, `memfit bench` and anything else that trains call
//! this, so there is one training step in the library.

use crate::backend;
use crate::error::{Error, Result};
use crate::exec::{LossOptions, Plan, StepOutput, forward_backward};
use crate::memory::{Category, Pool, Tag};
use crate::nn::{ResNet, StateSlot};
use crate::optim::{GradScaler, Optimizer, ScalerStep, clip_grad_norm};
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
    /// dropped (kept across steps so steady-state steps allocate nothing).
    saved_buffers: BnState,
    /// Data-parallel training (see [`super::dist`]): `None` in one process.
    pub dist: Option<GradSync>,
}

impl TrainStep {
    pub fn new(policy: StepPolicy, scaler: Option<GradScaler>) -> Self {
        TrainStep {
            policy,
            scaler,
            saved_buffers: BnState::default(),
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
        model.zero_grad();
        // Without a scaler a non-finite step is dropped or stops the run;
        // the forward has already moved the BN running statistics by then,
        // so keep them to put back.
        if self.scaler.is_none() {
            save_buffers(model, &mut self.saved_buffers)?;
        }
        // The loss of every micro-batch is normalised by the window's
        // sample count, so an uneven last window weighs each sample as a
        // full one would.
        let mut out = StepOutput {
            loss: 0.0,
            correct: 0,
        };
        let micro = self.policy.micro_batch.max(1);
        let px = images.len() / labels.len().max(1);
        for (micro_images, micro_labels) in images.chunks(micro * px).zip(labels.chunks(micro)) {
            let x = gather(pool, image_hw, micro_images)?;
            let o = forward_backward(
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
            )?;
            out.loss += o.loss * micro_labels.len() as f64 / n as f64;
            out.correct += o.correct;
        }
        if inject_inf {
            inject_inf_grad(model);
        }
        // Once per optimizer step, after the last micro-batch: the summed
        // gradients, loss and hits, and rank 0's BN running statistics, are
        // then the same on every rank, so every decision below agrees.
        if let Some(d) = self.dist.as_mut() {
            d.sum_grads(pool, model)?;
            let mut sums = [0.0; 2];
            d.comm.sum_f64(&[out.loss, out.correct as f64], &mut sums)?;
            out.loss = sums[0];
            out.correct = sums[1] as usize;
            broadcast_buffers(d.comm.as_ref(), model)?;
        }
        // The scaler decides about non-finite values under f16: the step is
        // skipped and the scale backs off. Without one, a non-finite loss
        // or gradient stops the run before it reaches the weights, or with
        // `NanPolicy::Skip` the step is dropped.
        let bad = if self.scaler.is_some() {
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
        if bad.is_some() {
            restore_buffers(model, &self.saved_buffers)?;
        }
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
        // Unscale exactly once per optimizer step, before clipping.
        let scaled = match self.scaler.as_mut() {
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
        let skip = bad.is_some() || scaled.is_some_and(|s| s.skipped);
        let grad_norm = if skip {
            None
        } else {
            self.policy
                .clip_grad_norm
                .map(|max| clip_grad_norm(model, max))
                .transpose()?
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

/// Copies every batch norm running statistic and counter into `out`, on
/// the host (the roll-back copy is small; it is taken every step trained
/// without a loss scaler, into buffers kept from the last step).
fn save_buffers(model: &mut ResNet, out: &mut BnState) -> Result<()> {
    out.stats.clear();
    out.counts.clear();
    let mut res = Ok(());
    model.visit_state(|slot| match slot {
        StateSlot::Buffer { tensor, .. } => {
            let at = out.stats.len();
            out.stats.resize(at + tensor.numel(), 0.0);
            if let Err(e) = backend::copy_to_host_into(&mut out.stats[at..], tensor) {
                res = Err(e);
            }
        }
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
