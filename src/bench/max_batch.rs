//! `memfit bench max-batch`: per memory strategy, the largest batch (no
//! accumulation) whose predicted peak and reserved memory fit a budget.
//! Predicted on the shapes-only simulator: nothing trains.

use crate::error::{Error, Result};
use crate::memory::fmt_bytes;
use crate::nn::{BnPolicy, Precision, ResNetConfig};
use crate::optim::Sgd;
use crate::plan::{PlanRequest, TimeModel, resolve};
use crate::train::Optimizer;

/// One strategy of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct MaxBatchStrategy {
    pub label: &'static str,
    /// As `--checkpoint` takes it.
    pub strategy: &'static str,
    pub precision: Precision,
    pub recompute_bn_relu: bool,
}

/// The strategies of the table, in its order: plain fp32 first (the
/// others' ratios are against it).
pub fn max_batch_strategies() -> Vec<MaxBatchStrategy> {
    let row = |label, strategy, precision, recompute_bn_relu| MaxBatchStrategy {
        label,
        strategy,
        precision,
        recompute_bn_relu,
    };
    let f32_ = Precision::F32;
    vec![
        row("none", "none", f32_, false),
        row("segments:2", "segments:2", f32_, false),
        row("segments:4", "segments:4", f32_, false),
        row("segments:8", "segments:8", f32_, false),
        row(
            "stages:layer1,layer2,layer4",
            "stages:layer1,layer2,layer4",
            f32_,
            false,
        ),
        row("BN+ReLU recompute", "none", f32_, true),
        row("none", "none", Precision::BF16, false),
        row("auto", "auto", f32_, false),
        row("auto + BN+ReLU recompute", "auto", f32_, true),
        row("auto", "auto", Precision::BF16, false),
        row("auto + BN+ReLU recompute", "auto", Precision::BF16, true),
    ]
}

/// What [`largest_batch`] found for one strategy.
#[derive(Clone, Debug, PartialEq)]
pub struct MaxBatchRow {
    pub strategy: MaxBatchStrategy,
    /// 0 when not even one image fits.
    pub batch: usize,
    /// The predicted peak at that batch.
    pub predicted_peak: Option<usize>,
    /// The memory its pool is predicted to hold from the system (live
    /// blocks and the free ones between them), at most the budget.
    pub predicted_reserved: Option<usize>,
}

/// The largest batch of `config` at `image_size`² whose predicted peak and
/// reserved memory under `s` (SGD with momentum) fit `budget` bytes, by
/// bisection (fitting is taken as monotone in the batch), up to 2^16.
pub fn largest_batch(
    config: &ResNetConfig,
    image_size: usize,
    budget: usize,
    s: &MaxBatchStrategy,
) -> Result<MaxBatchRow> {
    let optimizer = Optimizer::Sgd(Sgd::new(0.1, 0.9, 0.0, false));
    let fits = |batch: usize| -> Result<Option<(usize, usize)>> {
        let config = ResNetConfig {
            precision: s.precision,
            recompute_bn_relu: s.recompute_bn_relu,
            ..config.clone()
        };
        let request = PlanRequest {
            config: &config,
            bn: BnPolicy::Batch,
            optimizer: &optimizer,
            batch,
            micro_batch: Some(batch),
            image_size,
            budget: Some(budget),
            strategy: s.strategy.parse()?,
            auto_precision: false,
            // Only whether a plan fits matters here, and that is bytes alone.
            time_model: TimeModel::Flops,
            processes: 1,
        };
        match resolve(&request) {
            Ok(r) => Ok(Some((r.predicted.peak_total, r.predicted.reserved_peak))),
            Err(
                Error::BudgetTooSmall { .. }
                | Error::Fragmented { .. }
                | Error::InvalidArgument { .. },
            ) => Ok(None),
            Err(e) => Err(e),
        }
    };
    let (mut lo, mut hi) = (0usize, 1usize);
    while fits(hi)?.is_some() && hi < 1 << 16 {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)?.is_some() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let predicted = if lo > 0 { fits(lo)? } else { None };
    Ok(MaxBatchRow {
        strategy: s.clone(),
        batch: lo,
        predicted_peak: predicted.map(|p| p.0),
        predicted_reserved: predicted.map(|p| p.1),
    })
}

/// The table's header: what was asked, and the column names.
pub fn format_max_batch_header(
    model: &str,
    base_width: usize,
    image_size: usize,
    budget: usize,
) -> String {
    format!(
        "{model} (base width {base_width}), {image_size}x{image_size}, SGD with momentum, budget {}: largest batch with no accumulation\n| strategy | precision | largest batch | predicted peak | reserved | vs none fp32 |\n|---|---|---|---|---|---|\n",
        fmt_bytes(budget)
    )
}

/// One line of the table; `base` is the first row's batch.
pub fn format_max_batch_row(r: &MaxBatchRow, base: usize) -> String {
    format!(
        "| {} | {} | {} | {} | {} | {} |\n",
        r.strategy.label,
        r.strategy.precision,
        r.batch,
        r.predicted_peak.map_or("-".to_string(), fmt_bytes),
        r.predicted_reserved.map_or("-".to_string(), fmt_bytes),
        if base > 0 {
            format!("{:.2}x", r.batch as f64 / base as f64)
        } else {
            "-".to_string()
        }
    )
}
