//! From the user's request (strategy, batch, micro-batch, budget) to the
//! plan a run uses, its predicted peak, and the report `memfit plan` prints.

use std::fmt::Write;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::exec::Plan;
use crate::memory::{Category, MemoryStats, Pool, fmt_bytes};
use crate::nn::{BnPolicy, Precision, ResNet, ResNetConfig};
use crate::optim::{GradBuckets, Optimizer};
use crate::plan::{
    CostModel, Simulation, Strategy, TimeModel, auto_plan, bf16_time_ratio, seconds_per_image,
    segments_plan, stages_plan, train_config,
};

/// What a run asks of the planner.
pub struct PlanRequest<'a> {
    pub config: &'a ResNetConfig,
    pub bn: BnPolicy,
    pub optimizer: &'a Optimizer,
    /// Samples per optimizer step.
    pub batch: usize,
    /// Fixed micro-batch; `None` lets `auto` choose (other strategies then
    /// use the whole batch).
    pub micro_batch: Option<usize>,
    pub image_size: usize,
    pub budget: Option<usize>,
    pub strategy: Strategy,
    /// `--precision auto`: choose between fp32 and bf16 (`config.precision`
    /// is ignored): the one that fits with the least modelled time per
    /// image (its plan's forward, backward and recomputation; bf16's at
    /// [`bf16_time_ratio`] of fp32's unless the stage times were measured),
    /// fp32 on a tie.
    pub auto_precision: bool,
    /// Where `auto`'s stage times come from (other strategies need none).
    pub time_model: TimeModel,
    /// Processes of a data-parallel run (1: one). The plan is per
    /// process: `batch` is this process's shard of the global batch, and
    /// with more than one the gradient all-reduce buckets are counted.
    pub processes: usize,
}

/// The plan a run will use and what it is predicted to cost.
pub struct Resolved {
    pub strategy: Strategy,
    /// The precision the plan was made for (the model must use it).
    pub precision: Precision,
    /// Whether BN+ReLU outputs are recomputed in backward.
    pub recompute_bn_relu: bool,
    pub plan: Plan,
    pub micro_batch: usize,
    pub costs: CostModel,
    /// The whole run simulated on a shapes-only pool.
    pub predicted: MemoryStats,
    /// Under `--precision auto`, why this precision: one line for the
    /// report.
    pub precision_choice: Option<String>,
}

impl Resolved {
    /// Micro-batches per optimizer step (the last window of an epoch may
    /// have fewer).
    pub fn accum_steps(&self, batch: usize) -> usize {
        batch.div_ceil(self.micro_batch)
    }
}

pub fn resolve(req: &PlanRequest<'_>) -> Result<Resolved> {
    if !req.auto_precision {
        return resolve_for(req, req.config);
    }
    let (ratio, why) = bf16_time_ratio(req.config.target);
    let mut fits: Vec<(Resolved, f64)> = Vec::new();
    let mut first_err = None;
    for p in [Precision::F32, Precision::BF16] {
        let config = ResNetConfig {
            precision: p,
            ..req.config.clone()
        };
        match resolve_for(req, &config) {
            Ok(r) => {
                let c = &r.costs;
                // Measured stage times are this precision's own.
                let speed = if p == Precision::BF16 && !c.is_calibrated() {
                    ratio
                } else {
                    1.0
                };
                let t = seconds_per_image(
                    c.step_seconds(),
                    c.recompute_seconds(&r.plan),
                    r.micro_batch,
                    speed,
                );
                fits.push((r, t));
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    let times: Vec<(Precision, f64)> = fits.iter().map(|(r, t)| (r.precision, *t)).collect();
    // fp32 first: a tie keeps it.
    let Some((mut best, _)) = fits
        .into_iter()
        .reduce(|a, b| if b.1 < a.1 { b } else { a })
    else {
        return Err(first_err.expect("two precisions were tried"));
    };
    let detail = match times.as_slice() {
        [(_, f32_t), (_, bf16_t)] => format!(
            "both fit; bf16 modelled at {:.2} of fp32's time per image",
            bf16_t / f32_t
        ),
        [(p, _)] => format!("only {p} fits"),
        _ => String::new(),
    };
    let rates = if best.costs.is_calibrated() {
        "stage times measured in each precision".to_string()
    } else {
        format!("bf16 at {ratio:.2} of fp32's time: {why}")
    };
    best.precision_choice = Some(format!(
        "precision auto: {} ({detail}; {rates})",
        best.precision
    ));
    Ok(best)
}

fn resolve_for(req: &PlanRequest<'_>, config: &ResNetConfig) -> Result<Resolved> {
    if req.batch == 0 {
        return Err(Error::invalid("plan", "batch size must be at least 1"));
    }
    if let Some(m) = req.micro_batch
        && (m == 0 || m > req.batch)
    {
        return Err(Error::invalid(
            "plan",
            format!(
                "micro-batch {m} must be between 1 and the batch size {}",
                req.batch
            ),
        ));
    }
    let (plan, micro, costs) = match &req.strategy {
        Strategy::Auto => {
            let budget = req
                .budget
                .ok_or_else(|| Error::invalid("--checkpoint", "auto needs --memory-budget"))?;
            // The all-reduce buckets are live through every steady-state
            // step: what is left of the budget is the step's.
            let buckets = if req.processes > 1 {
                let pool = Pool::on(Device::Meta(config.target));
                let mut model = ResNet::new(&pool, train_config(config))?;
                model.set_bn_policy(req.bn);
                GradBuckets::bytes(model.trainable_count())
            } else {
                0
            };
            let (choice, costs) = auto_plan(
                config,
                req.bn,
                req.optimizer,
                req.batch,
                req.micro_batch,
                req.image_size,
                budget.saturating_sub(buckets),
                req.time_model,
            )?;
            (choice.plan, choice.micro_batch, costs)
        }
        other => {
            let micro = req.micro_batch.unwrap_or(req.batch);
            let costs = CostModel::measure(config, req.bn, req.optimizer, micro, req.image_size)?;
            let n = costs.stages.len();
            let plan = match other {
                Strategy::None => Plan::keep_all_len(n),
                Strategy::Segments(k) => segments_plan(&costs, *k),
                Strategy::Stages(names) => {
                    let all: Vec<String> = costs.stages.iter().map(|s| s.name.clone()).collect();
                    stages_plan(&all, names)?
                }
                Strategy::Auto => unreachable!("handled above"),
            };
            (plan, micro, costs)
        }
    };
    let predicted = Simulation {
        processes: req.processes,
        budget: req.budget,
        ..Simulation::new(config, req.bn, req.optimizer, &plan, micro, req.image_size)
    }
    .run()?;
    if let Some(budget) = req.budget
        && predicted.peak_total > budget
    {
        return Err(Error::invalid(
            "--memory-budget",
            format!(
                "plan {plan} at micro-batch {micro} needs {} but the budget is {} (try --checkpoint auto, a smaller --micro-batch, or a larger budget)",
                fmt_bytes(predicted.peak_total),
                fmt_bytes(budget)
            ),
        ));
    }
    if let Some(budget) = req.budget
        && predicted.reserved_peak > budget
    {
        return Err(Error::invalid(
            "--memory-budget",
            format!(
                "plan {plan} at micro-batch {micro} needs {} live, but its memory fragments: a buffer finds no free block large enough, and the pool would hold {} from the system, over the budget of {} (try --checkpoint auto, a smaller --micro-batch, or a larger budget)",
                fmt_bytes(predicted.peak_total),
                fmt_bytes(predicted.reserved_peak),
                fmt_bytes(budget)
            ),
        ));
    }
    Ok(Resolved {
        strategy: req.strategy.clone(),
        precision: config.precision,
        recompute_bn_relu: config.recompute_bn_relu,
        plan,
        micro_batch: micro,
        costs,
        predicted,
        precision_choice: None,
    })
}

/// The per-stage plan and the predicted bytes, as `memfit plan` prints them.
pub fn report(r: &Resolved, batch: usize) -> String {
    let mut s = String::new();
    let c = &r.costs;
    let _ = writeln!(
        s,
        "micro-batch {} x {} accumulation step(s) = batch {batch}, {}x{} images, {}, plan {}",
        r.micro_batch,
        r.accum_steps(batch),
        c.image_size,
        c.image_size,
        r.precision,
        r.plan
    );
    if let Some(why) = &r.precision_choice {
        let _ = writeln!(s, "{why}");
    }
    if r.recompute_bn_relu {
        let _ = writeln!(
            s,
            "BN+ReLU outputs are recomputed in backward from the kept BN inputs"
        );
    }
    let calibrated = c.is_calibrated();
    let _ = writeln!(
        s,
        "{:<10} {:>10} {:>11} {:>11} {:>9} {:>10}  action",
        "stage",
        "input",
        "saved",
        "fwd GFLOP",
        if calibrated { "fwd ms" } else { "model ms" },
        "kept"
    );
    for (i, st) in c.stages.iter().enumerate() {
        let seg = r
            .plan
            .segments
            .iter()
            .find(|g| (g.start..g.end).contains(&i))
            .expect("plans cover every stage");
        let (kept, action) = if !seg.recompute {
            (st.saved, "keep".to_string())
        } else if i == seg.start {
            (
                st.input,
                format!("checkpoint input, recompute {}..{}", seg.start, seg.end),
            )
        } else {
            (0, "recompute".to_string())
        };
        let _ = writeln!(
            s,
            "{:<10} {:>10} {:>11} {:>11.3} {:>9.1} {:>10}  {action}",
            st.name,
            fmt_bytes(st.input),
            fmt_bytes(st.saved),
            st.forward_flops / 1e9,
            1e3 * st.forward_seconds(),
            fmt_bytes(kept),
        );
    }
    let p = &r.predicted;
    let _ = writeln!(
        s,
        "predicted peak {} (per category at the peak / own peak):",
        fmt_bytes(p.peak_total)
    );
    let _ = writeln!(
        s,
        "  {:<12} {:>12}  (held from the system, free blocks' pages included)",
        "reserved",
        fmt_bytes(p.reserved_peak)
    );
    for cat in Category::ALL {
        let _ = writeln!(
            s,
            "  {:<12} {:>12} {:>12}",
            cat.name(),
            fmt_bytes(p.at_peak.get(cat)),
            fmt_bytes(p.peak.get(cat))
        );
    }
    if !p.largest_at_peak.is_empty() {
        let _ = writeln!(s, "largest buffers at the peak:");
        for (tag, cat, bytes) in &p.largest_at_peak {
            let _ = writeln!(s, "  {:>12}  {:<11} {tag}", fmt_bytes(*bytes), cat.name());
        }
    }
    let base = c.step_seconds();
    let extra = c.recompute_seconds(&r.plan) + 0.0; // an empty f64 sum is -0.0
    let _ = writeln!(
        s,
        "{} step time: {:.2} s per micro-batch + {:.2} s recomputed forward ({:+.0}%)",
        if calibrated {
            "estimated (3x the measured forward)"
        } else {
            "modelled (from FLOPs)"
        },
        base,
        extra,
        100.0 * extra / base.max(1e-12)
    );
    s
}
