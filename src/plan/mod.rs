//! Memory plans: which stages keep what their backward needs and which are
//! recomputed from a checkpoint, chosen by strategy or by a budget.
//!
//! * [`Strategy`]: `none`, `segments:K`, `stages:layer1,layer2,layer4`, `auto`.
//! * [`CostModel`]: for one micro-batch size and image size, the exact bytes
//!   of every stage (input, output, saved, forward and backward local peaks)
//!   and its forward FLOPs. The bytes are not derived by hand: each stage is
//!   run once on a shapes-only pool ([`Pool::shapes_only`]), which does the
//!   real allocation sequence without memory or arithmetic, so they are
//!   exactly what the executor will allocate.
//! * [`CostModel::predict`] composes those numbers along a plan the way
//!   [`crate::exec::forward_backward`] runs it, giving the step's peak.
//! * [`CostModel::best_plan`]: a dynamic program over the chain (rotor-like,
//!   for a single level of checkpoints) that picks the segments to keep or
//!   recompute so the peak fits a budget with the least recomputed forward
//!   time. Uniform K-segment plans are points of its search space, so it is
//!   never worse than them under the model.
//! * [`simulate`]: the whole run (two optimizer steps and an evaluation
//!   batch) on a shapes-only pool, per category; the prediction `memfit plan`
//!   prints and `memfit train` compares with the measured peak.

mod calibrate;
mod dp;
mod precision;
mod resolve;
mod simulate;
mod strategy;

pub use calibrate::{TimeModel, stage_forward_seconds};
pub use precision::{bf16_time_ratio, seconds_per_image};
pub use resolve::{PlanRequest, Resolved, report, resolve};
pub use simulate::{Simulation, simulate, simulate_training};
pub use strategy::{Strategy, segments_plan, stages_plan};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::exec::{Plan, forward_eval};
use crate::memory::{Category, Pool, Tag};
use crate::nn::{BnPolicy, Mode, ResNet, ResNetConfig};
use crate::optim::Optimizer;
use crate::tensor::DType;

/// Bytes and FLOPs of one stage for one micro-batch.
#[derive(Clone, Debug, PartialEq)]
pub struct StageCost {
    pub name: String,
    /// The input tensor (images for the stem).
    pub input: usize,
    pub output: usize,
    /// What a training forward keeps (including the input, except for the
    /// head, which frees it).
    pub saved: usize,
    /// Peak bytes during the forward, counting the input, above what was
    /// live before the input existed.
    pub forward_peak: usize,
    /// Peak during the backward above what was live before the forward's
    /// input existed; counts the saved tensors and the output gradient.
    pub backward_peak: usize,
    pub forward_flops: f64,
    /// The forward timed on this machine ([`calibrate`]), when it was.
    pub measured_seconds: Option<f64>,
}

impl StageCost {
    /// Forward seconds as the planner sees them: measured when calibrated,
    /// else modelled (FLOPs at a sustained 100 GFLOP/s plus the saved bytes
    /// written at 10 GB/s). Only ratios matter to the planner.
    pub fn forward_seconds(&self) -> f64 {
        self.measured_seconds
            .unwrap_or(self.forward_flops / 1e11 + self.saved as f64 / 1e10)
    }
}

/// Per-stage costs of one configuration plus what every plan pays.
#[derive(Clone, Debug)]
pub struct CostModel {
    pub micro_batch: usize,
    pub image_size: usize,
    pub stages: Vec<StageCost>,
    /// Parameters, gradients and optimizer state, live for the whole run.
    pub persistent: usize,
    /// Peak of an evaluation forward above `persistent`.
    pub eval_peak: usize,
}

/// A plan with its predicted peak and modelled time.
#[derive(Clone, Debug)]
pub struct Choice {
    pub plan: Plan,
    pub micro_batch: usize,
    /// Predicted peak of the whole run (training steps and evaluation).
    pub peak: usize,
    /// Modelled seconds of recomputed forward per micro-batch.
    pub recompute_seconds: f64,
}

fn train_config(config: &ResNetConfig) -> ResNetConfig {
    config.clone()
}

impl CostModel {
    /// Measures every stage on a shapes-only pool: a fresh model of
    /// `config`, a micro-batch of `micro_batch` images of `image_size`², and
    /// the optimizer's state after one step.
    pub fn measure(
        config: &ResNetConfig,
        bn: BnPolicy,
        optimizer: &Optimizer,
        micro_batch: usize,
        image_size: usize,
    ) -> Result<CostModel> {
        if micro_batch == 0 {
            return Err(Error::invalid("plan", "micro-batch must be at least 1"));
        }
        let pool = Pool::on(Device::Meta(config.target));
        let mut model = ResNet::new(&pool, train_config(config))?;
        model.set_bn_policy(bn);
        model.check_image_size(image_size, image_size)?;
        let mut opt = optimizer.fresh();
        opt.step(&pool, &mut model)?;
        let persistent = pool.live_bytes();
        let dims = model.stage_inputs(image_size, image_size);
        let n = micro_batch;
        let mut stages = Vec::with_capacity(model.stages.len());
        let ctx = model.ctx(&pool);
        // Each stage's input is stored as the stage before it stores its
        // output (bf16 under bf16 where the device reads it in place): the
        // checkpoints the DP weighs are those tensors.
        let mut input_dtype = DType::F32;
        for (i, stage) in model.stages.iter_mut().enumerate() {
            let (h, w, c) = dims[i];
            let category = if i == 0 {
                Category::Data
            } else {
                Category::Activations
            };
            let before = pool.live_bytes();
            pool.reset_peak();
            let x = pool.empty(
                &[n, h, w, c],
                input_dtype,
                category,
                Tag::fixed("plan.input"),
            )?;
            let input = x.bytes();
            let (y, saved) = stage.forward(&ctx, x, Mode::Train)?;
            input_dtype = y.dtype();
            let forward_peak = pool.stats().peak_total - before;
            let saved = saved.ok_or_else(|| Error::invalid("plan", "stage saved nothing"))?;
            let saved_bytes = saved.bytes();
            let output = y.bytes();
            let d = pool.empty_f32(y.dims(), Category::Activations, Tag::fixed("plan.d_out"))?;
            drop(y);
            pool.reset_peak();
            let d_in = stage.backward(&ctx, saved, d)?;
            let backward_peak = pool.stats().peak_total - before;
            drop(d_in);
            stages.push(StageCost {
                name: stage.name(),
                input,
                output,
                saved: saved_bytes,
                forward_peak,
                backward_peak,
                forward_flops: stage.forward_flops(n, h, w),
                measured_seconds: None,
            });
        }
        let eval_peak = eval_local_peak(&mut model, &pool, n, image_size)?;
        Ok(CostModel {
            micro_batch,
            image_size,
            stages,
            persistent,
            eval_peak,
        })
    }

    /// Peak of a training step under `plan`, composed from the stage costs
    /// in the executor's order (see `exec::forward_backward`).
    pub fn predict(&self, plan: &Plan) -> usize {
        let mut peak = 0;
        let mut retained = 0; // saved bytes and checkpoints of finished segments
        let mut bump = |v: usize| peak = peak.max(v);
        for seg in &plan.segments {
            let s = &self.stages[seg.start..seg.end];
            if seg.recompute {
                bump(retained + s[0].forward_peak);
                for st in &s[1..] {
                    bump(retained + s[0].input + st.forward_peak);
                }
                retained += s[0].input;
            } else {
                for st in s {
                    bump(retained + st.forward_peak);
                    retained += st.saved;
                }
            }
        }
        // Logits and their gradient.
        let logits = self.stages.last().map_or(0, |s| s.output);
        bump(retained + 2 * logits);
        for seg in plan.segments.iter().rev() {
            let s = &self.stages[seg.start..seg.end];
            let own: usize = if seg.recompute {
                s[0].input
            } else {
                s.iter().map(|st| st.saved).sum()
            };
            retained -= own; // what the earlier segments still hold
            let mut inner: usize = s.iter().map(|st| st.saved).sum();
            if seg.recompute {
                // The replay runs while the segment's output gradient waits.
                let d_out = s.last().map_or(0, |st| st.output);
                let mut acc = 0;
                for st in s {
                    bump(retained + d_out + acc + st.forward_peak);
                    acc += st.saved;
                }
            }
            for st in s.iter().rev() {
                inner -= st.saved;
                bump(retained + inner + st.backward_peak);
            }
        }
        self.persistent + peak.max(self.eval_peak)
    }

    /// Whether the stage times were measured on this machine.
    pub fn is_calibrated(&self) -> bool {
        self.stages.iter().all(|s| s.measured_seconds.is_some())
    }

    /// Replaces the modelled stage times by measured ones (chain order).
    pub fn set_measured_seconds(&mut self, seconds: &[f64]) -> Result<()> {
        if seconds.len() != self.stages.len() {
            return Err(Error::invalid(
                "plan",
                format!(
                    "{} stage times for {} stages",
                    seconds.len(),
                    self.stages.len()
                ),
            ));
        }
        for (st, &t) in self.stages.iter_mut().zip(seconds) {
            st.measured_seconds = Some(t);
        }
        Ok(())
    }

    /// [`set_measured_seconds`](Self::set_measured_seconds) with the times
    /// of [`stage_forward_seconds`] for this micro-batch and image size.
    pub fn calibrate(
        &mut self,
        config: &ResNetConfig,
        bn: BnPolicy,
        budget: Option<usize>,
    ) -> Result<()> {
        let seconds = stage_forward_seconds(config, bn, self.micro_batch, self.image_size, budget)?;
        self.set_measured_seconds(&seconds)
    }

    /// Seconds of forward recomputation a plan adds per micro-batch.
    pub fn recompute_seconds(&self, plan: &Plan) -> f64 {
        plan.segments
            .iter()
            .filter(|s| s.recompute)
            .flat_map(|s| &self.stages[s.start..s.end])
            .map(StageCost::forward_seconds)
            .sum()
    }

    /// Seconds of one forward + backward (backward ≈ 2 forwards)
    /// with no recomputation.
    pub fn step_seconds(&self) -> f64 {
        3.0 * self
            .stages
            .iter()
            .map(StageCost::forward_seconds)
            .sum::<f64>()
    }

    /// The plan with the least recomputation whose predicted peak fits
    /// `budget`, or `None` when none does.
    pub fn best_plan(&self, budget: usize) -> Option<Choice> {
        let plan = dp::best_plan(self, budget)?;
        Some(Choice {
            peak: self.predict(&plan),
            recompute_seconds: self.recompute_seconds(&plan),
            micro_batch: self.micro_batch,
            plan,
        })
    }

    /// The smallest predicted peak any plan reaches at this micro-batch.
    pub fn min_peak(&self) -> usize {
        let keep = self.predict(&Plan {
            segments: vec![crate::exec::Segment {
                start: 0,
                end: self.stages.len(),
                recompute: false,
            }],
        });
        let (mut lo, mut hi) = (self.persistent, keep);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.best_plan(mid).is_some() {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        hi
    }
}

/// Peak of one evaluation batch above what was live before it.
fn eval_local_peak(model: &mut ResNet, pool: &Pool, n: usize, size: usize) -> Result<usize> {
    let before = pool.live_bytes();
    pool.reset_peak();
    eval_batch(model, pool, n, size)?;
    Ok(pool.stats().peak_total - before)
}

/// What `train::evaluate` allocates for one batch.
pub(crate) fn eval_batch(model: &mut ResNet, pool: &Pool, n: usize, size: usize) -> Result<()> {
    let images = pool.empty_f32(
        &[n, size, size, 3],
        Category::Data,
        Tag::fixed("batch.images"),
    )?;
    let logits = forward_eval(model, pool, images)?;
    let scratch = pool.empty_f32(
        logits.dims(),
        Category::Workspace,
        Tag::fixed("eval.d_logits"),
    )?;
    drop((logits, scratch));
    Ok(())
}

/// The DP's plan for `costs` under `budget`, checked by the simulator (the
/// step as it runs, evaluation included, its arena shaped by the budget).
/// The cost model composes per-stage measurements taken on f32 inputs; a
/// whole step can allocate more (on a GPU under bf16, the f32 copies a
/// replayed stage makes of its bf16-stored input), and its arena can hold
/// more than its live bytes (fragmentation: a large block for which no free
/// block is large enough takes a segment beyond the budget). So a plan the
/// simulator puts over the budget, live or reserved, is planned again with
/// the DP's cap at its modelled peak less the overshoot, until one checks
/// out or none is left, and then the uniform K-segment plans are tried.
/// The choice's peak is the simulator's.
fn checked_best_plan(
    costs: &CostModel,
    config: &ResNetConfig,
    bn: BnPolicy,
    optimizer: &Optimizer,
    budget: usize,
) -> Result<Option<Choice>> {
    // The simulator's peak of a plan, if the run fits the budget with it.
    let fitting_peak = |plan: &Plan| -> Result<std::result::Result<usize, usize>> {
        let simulated = simulate_under(costs, config, bn, optimizer, plan, budget)?;
        let needs = simulated.peak_total.max(simulated.reserved_peak);
        Ok(if needs <= budget {
            Ok(simulated.peak_total)
        } else {
            Err(needs)
        })
    };
    let mut cap = budget;
    // Each round lowers the cap below the rejected plan's modelled peak,
    // so the DP must choose another plan (more recomputation) or none.
    for _ in 0..costs.stages.len() * 2 + 2 {
        let Some(mut choice) = costs.best_plan(cap) else {
            break;
        };
        match fitting_peak(&choice.plan)? {
            Ok(peak) => {
                choice.peak = peak;
                return Ok(Some(choice));
            }
            Err(needs) => match choice.peak.checked_sub((needs - budget).max(1)) {
                Some(lower) => cap = lower,
                None => break,
            },
        }
    }
    // Fragmentation does not follow the modelled peak: where every plan
    // the DP offered fragments past the budget, a uniform K-segment plan
    // may still fit (its blocks come and go in another order). The fastest
    // that fits, so auto is never behind `--checkpoint segments:K`.
    let mut best: Option<Choice> = None;
    for k in 1..=costs.stages.len() {
        let plan = segments_plan(costs, k);
        let recompute_seconds = costs.recompute_seconds(&plan);
        if best
            .as_ref()
            .is_some_and(|b| b.recompute_seconds <= recompute_seconds)
        {
            continue;
        }
        if let Ok(peak) = fitting_peak(&plan)? {
            best = Some(Choice {
                plan,
                micro_batch: costs.micro_batch,
                peak,
                recompute_seconds,
            });
        }
    }
    Ok(best)
}

/// The run of `plan` at `costs`' micro-batch and image size, its arena
/// shaped by `budget`.
fn simulate_under(
    costs: &CostModel,
    config: &ResNetConfig,
    bn: BnPolicy,
    optimizer: &Optimizer,
    plan: &Plan,
    budget: usize,
) -> Result<crate::memory::MemoryStats> {
    Simulation {
        budget: Some(budget),
        ..Simulation::new(
            config,
            bn,
            optimizer,
            plan,
            costs.micro_batch,
            costs.image_size,
        )
    }
    .run()
}

/// The budget the least-memory plan of `costs` needs: its modelled peak,
/// or more where the simulator says the run holds more (its whole step, or
/// the pages its blocks round up to).
fn smallest_need(
    costs: &CostModel,
    config: &ResNetConfig,
    bn: BnPolicy,
    optimizer: &Optimizer,
) -> Result<usize> {
    let least = costs.min_peak();
    let Some(choice) = costs.best_plan(least) else {
        return Ok(least);
    };
    let simulated = simulate_under(costs, config, bn, optimizer, &choice.plan, least)?;
    Ok(least.max(simulated.peak_total).max(simulated.reserved_peak))
}

/// Micro-batch sizes worth trying for an effective batch: the batch itself
/// and every power of two below it, largest first.
pub fn micro_batch_candidates(batch: usize) -> Vec<usize> {
    let mut v = vec![batch];
    let mut m = batch.next_power_of_two() / 2;
    while m >= 1 {
        if m < batch {
            v.push(m);
        }
        m /= 2;
    }
    v
}

/// `--checkpoint auto`: the largest micro-batch (keeping BN's batches as
/// large as memory allows, since smaller ones change the statistics while
/// recomputation does not) for which some plan fits, with that size's
/// fastest plan and its cost model. `micro_batch` fixes the size instead of
/// searching. Which sizes fit depends on bytes alone; under
/// [`TimeModel::Measured`] the chosen size's stages are then timed and the
/// plan chosen again with those times.
#[allow(clippy::too_many_arguments)]
pub fn auto_plan(
    config: &ResNetConfig,
    bn: BnPolicy,
    optimizer: &Optimizer,
    batch: usize,
    micro_batch: Option<usize>,
    image_size: usize,
    budget: usize,
    time: TimeModel,
) -> Result<(Choice, CostModel)> {
    let candidates = match micro_batch {
        Some(m) => vec![m],
        None => micro_batch_candidates(batch),
    };
    let mut smallest: Option<CostModel> = None;
    let checked = |costs: &CostModel| checked_best_plan(costs, config, bn, optimizer, budget);
    for &m in &candidates {
        let mut costs = CostModel::measure(config, bn, optimizer, m, image_size)?;
        let Some(modelled) = checked(&costs)? else {
            smallest = Some(costs);
            continue;
        };
        if time == TimeModel::Flops {
            return Ok((modelled, costs));
        }
        costs.calibrate(config, bn, Some(budget))?;
        // Feasibility does not depend on the times, only the choice does;
        // the modelled choice stays if the timed one does not check out.
        let choice = checked(&costs)?.unwrap_or(modelled);
        return Ok((choice, costs));
    }
    let model = smallest.ok_or_else(|| Error::invalid("plan", "no micro-batch candidates"))?;
    let needed = smallest_need(&model, config, bn, optimizer)?;
    if needed <= budget {
        // The live bytes fit, but every plan tried scatters its blocks so
        // that the pool would hold more than the budget.
        return Err(Error::Fragmented {
            budget,
            live: model.min_peak(),
            micro_batch: model.micro_batch,
        });
    }
    Err(Error::BudgetTooSmall {
        budget,
        needed,
        micro_batch: model.micro_batch,
        persistent: model.persistent,
    })
}
