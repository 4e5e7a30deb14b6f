//! `memfit bench strategies`: one [`measure_steps`] per memory strategy
//! (plain, segments, stages, low precision, micro-batches, BN+ReLU
//! recompute, auto at fractions of the plain peak), over rounds, as one
//! table of measured peak and time against the plain row, with the
//! PyTorch baseline's rows beside it when its results file exists.

use std::io::Write;
use std::path::Path;

use super::outln;
use super::step::{StepOptions, StepResult, measure_steps};
use crate::error::{Error, Result};
use crate::memory::{Category, fmt_bytes};
use crate::setup::ModelSpec;

/// The table's configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct StrategiesOptions {
    pub model: ModelSpec,
    pub image_size: usize,
    pub batch_size: usize,
    /// Timed steps per strategy.
    pub steps: usize,
    pub warmup: usize,
    /// Times the whole list runs, one row after the other in each round;
    /// each row reports its median round.
    pub rounds: usize,
    /// Stage times for `auto`: measured or flops.
    pub time_model: String,
    /// `--device`: cpu, cuda, cuda:N or auto.
    pub device: String,
}

/// One row of `bench strategies`.
#[derive(Clone, Debug, PartialEq)]
pub struct StrategyRow {
    pub name: String,
    pub checkpoint: String,
    pub micro_batch: Option<usize>,
    pub precision: &'static str,
    pub recompute_bn_relu: bool,
    /// For `auto`: this fraction of the no-plan row's measured peak.
    pub budget_fraction: Option<f64>,
}

/// The rows, plain first (the others' ratios are against it).
pub fn strategy_rows(batch_size: usize) -> Vec<StrategyRow> {
    let quarter = (batch_size / 4).max(1);
    let row = |name: &str, checkpoint: &str| StrategyRow {
        name: name.to_string(),
        checkpoint: checkpoint.to_string(),
        micro_batch: None,
        precision: "fp32",
        recompute_bn_relu: false,
        budget_fraction: None,
    };
    let mut rows = vec![
        row("none", "none"),
        row("segments:2", "segments:2"),
        row("segments:4", "segments:4"),
        row("segments:8", "segments:8"),
        row("stages:layer1,layer2,layer4", "stages:layer1,layer2,layer4"),
        StrategyRow {
            precision: "bf16",
            ..row("bf16", "none")
        },
        StrategyRow {
            precision: "f16",
            ..row("f16", "none")
        },
        // --precision auto: the planner weighs bf16's modelled speed here
        // against fp32's (plan::bf16_time_ratio).
        StrategyRow {
            precision: "auto",
            ..row("precision auto", "none")
        },
        StrategyRow {
            micro_batch: Some(quarter),
            ..row(&format!("micro-batch {quarter}"), "none")
        },
        StrategyRow {
            recompute_bn_relu: true,
            ..row("BN+ReLU recompute", "none")
        },
    ];
    for f in [0.75, 0.5, 0.35] {
        rows.push(StrategyRow {
            budget_fraction: Some(f),
            ..row(&format!("auto @ {:.0}% of none", 100.0 * f), "auto")
        });
    }
    rows
}

/// Measures every row of [`strategy_rows`] `a.rounds` times and returns
/// each measured row's median round, by name, in row order (plain first).
/// The steps' reports go to `out`; `progress` hears which row runs and why
/// an `auto` row whose budget is below the smallest plan has no result.
pub fn run_strategies(
    a: &StrategiesOptions,
    out: &mut dyn Write,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<(String, StepResult)>> {
    let rows = strategy_rows(a.batch_size);
    outln!(
        out,
        "{} (base width {}), batch {} at {}x{}, {} threads, {} timed step(s) each, {} round(s)",
        a.model.name,
        a.model.base_width,
        a.batch_size,
        a.image_size,
        a.image_size,
        rayon::current_num_threads(),
        a.steps,
        a.rounds
    );
    if a.rounds == 0 {
        return Err(Error::Usage("--rounds must be at least 1".into()));
    }
    // Each row's results over the rounds, by row; a row whose budget is
    // below the smallest plan in the first round stays empty.
    let mut runs: Vec<Vec<StepResult>> = rows.iter().map(|_| Vec::new()).collect();
    let mut none_peak = None;
    for round in 0..a.rounds {
        for (r, run) in rows.iter().zip(&mut runs) {
            if round > 0 && run.is_empty() {
                continue;
            }
            let budget = match (r.budget_fraction, none_peak) {
                (Some(f), Some(peak)) => Some((peak as f64 * f) as usize),
                _ => None,
            };
            let step = StepOptions {
                model: a.model.clone(),
                image_size: a.image_size,
                batch_size: a.batch_size,
                steps: a.steps,
                warmup: a.warmup,
                memory_budget: budget,
                checkpoint: r.checkpoint.clone(),
                time_model: a.time_model.clone(),
                micro_batch: r.micro_batch,
                precision: r.precision.to_string(),
                recompute_bn_relu: r.recompute_bn_relu,
                profile: false,
                device: a.device.clone(),
                strict_fp32: false,
            };
            progress(&format!(
                "running {} (round {} of {}) ...",
                r.name,
                round + 1,
                a.rounds
            ));
            match measure_steps(&step, false, out) {
                Ok(m) => {
                    none_peak.get_or_insert(m.measured.peak_total);
                    run.push(m);
                }
                // A budget below the smallest plan is a result too, not a failure.
                Err(e) if r.budget_fraction.is_some() => progress(&format!("{}: {e}", r.name)),
                Err(e) => return Err(e),
            }
        }
    }
    let mut results = Vec::new();
    for (r, run) in rows.iter().zip(runs) {
        if !run.is_empty() {
            results.push((r.name.clone(), median_round(&r.name, run, out)?));
        }
    }
    Ok(results)
}

/// The round with the median time (its plan, peak and time belong
/// together). Measured stage times can move `auto`'s plan between rounds:
/// that is said on `out`, not hidden.
fn median_round(name: &str, mut v: Vec<StepResult>, out: &mut dyn Write) -> Result<StepResult> {
    let plans: std::collections::BTreeSet<&str> = v.iter().map(|r| r.plan.as_str()).collect();
    if plans.len() > 1 {
        outln!(
            out,
            "{name}: the plan differed between rounds ({}); the median round's is reported",
            plans.into_iter().collect::<Vec<_>>().join(" | ")
        );
    }
    v.sort_by(|x, y| x.median_seconds.total_cmp(&y.median_seconds));
    Ok(v.swap_remove(v.len() / 2))
}

/// The table of [`run_strategies`]' results (markdown, one line per row)
/// and the same as CSV lines under a header. A checkpoint plan should cost
/// no more than the forward it recomputes (plus 5% slack): its bound is
/// 1 + recomputed forward FLOPs / step FLOPs + 0.05.
pub fn format_strategies(results: &[(String, StepResult)]) -> (String, String) {
    use std::fmt::Write as _;
    let (base_peak, base_time) = (
        results[0].1.measured.peak_total as f64,
        results[0].1.median_seconds,
    );
    let header = "| strategy | plan | micro-batch | precision | peak | activations at peak | memory ratio | s/step | time ratio | recompute bound | predicted peak |";
    let mut table = format!("{header}\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    let mut csv = String::from(
        "tool,strategy,plan,micro_batch,precision,peak_bytes,activations_bytes,memory_ratio,seconds_per_step,time_ratio,recompute_bound,predicted_peak_bytes\n",
    );
    for (name, r) in results {
        let m = &r.measured;
        let act = m.at_peak.get(Category::Activations);
        let (mr, tr) = (
            m.peak_total as f64 / base_peak,
            r.median_seconds / base_time,
        );
        let bound = (r.recompute_fraction > 0.0).then_some(1.0 + r.recompute_fraction + 0.05);
        let bound_cell = bound.map_or("-".to_string(), |b| {
            format!("{b:.2} ({})", if tr <= b { "within" } else { "over" })
        });
        let _ = writeln!(
            table,
            "| {name} | {} | {} | {} | {} | {} | {mr:.2} | {:.3} | {tr:.2} | {bound_cell} | {} |",
            r.plan,
            r.micro_batch,
            r.precision,
            fmt_bytes(m.peak_total),
            fmt_bytes(act),
            r.median_seconds,
            fmt_bytes(r.predicted)
        );
        csv += &format!(
            "memfit,\"{name}\",\"{}\",{},{},{},{act},{mr:.4},{:.4},{tr:.4},{},{}\n",
            r.plan,
            r.micro_batch,
            r.precision,
            m.peak_total,
            r.median_seconds,
            bound.map_or(String::new(), |b| format!("{b:.4}")),
            r.predicted
        );
    }
    (table, csv)
}

/// The PyTorch baseline's rows for this image size and batch, when its
/// results file exists: the text to print (a note when there is nothing to
/// show) and the rows as CSV lines for [`format_strategies`]' CSV.
pub fn pytorch_rows(path: &Path, image_size: usize, batch_size: usize) -> Result<(String, String)> {
    use std::fmt::Write as _;
    if !path.exists() {
        return Ok((
            format!(
                "(no PyTorch baseline at {}: its rows are left out)\n",
                path.display()
            ),
            String::new(),
        ));
    }
    let rows = crate::baseline::load(path, image_size, batch_size)?;
    let Some(plain) = rows.iter().find(|r| r.strategy == "plain") else {
        return Ok((
            format!(
                "(the PyTorch baseline {} has no plain run at {}x{} batch {})\n",
                path.display(),
                image_size,
                image_size,
                batch_size
            ),
            String::new(),
        ));
    };
    let mut text = format!(
        "\nPyTorch {} (from {}; another day, maybe another host: compare its ratios, each against its own plain run, not its times):\n",
        plain.torch,
        path.display()
    );
    text += "| PyTorch strategy | nearest memfit row | micro-batch | peak | memory ratio | s/step | time ratio | runs timed / all |\n|---|---|---|---|---|---|---|---|\n";
    let cell =
        |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
    let csv_cell = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
    let mut csv = String::new();
    for r in &rows {
        let mr = r.peak_bytes / plain.peak_bytes;
        let tr = r.seconds.zip(plain.seconds).map(|(s, p)| s / p);
        let _ = writeln!(
            text,
            "| {} | {} | {} | {} | {mr:.2} | {} | {} | {}/{} |",
            r.strategy,
            r.memfit_name,
            r.micro_batch,
            fmt_bytes(r.peak_bytes as usize),
            cell(r.seconds, 3),
            cell(tr, 2),
            r.clean_runs,
            r.runs
        );
        let precision = if r.strategy == "bf16" { "bf16" } else { "fp32" };
        csv += &format!(
            "pytorch,\"{}\",,{},{precision},{:.0},,{mr:.4},{},{},,\n",
            r.strategy,
            r.micro_batch,
            r.peak_bytes,
            csv_cell(r.seconds),
            csv_cell(tr),
        );
    }
    Ok((text, csv))
}
