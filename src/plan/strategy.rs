//! The named strategies of `--checkpoint` and the plans they stand for.

use std::str::FromStr;

use crate::error::{Error, Result};
use crate::exec::{Plan, Segment};
use crate::plan::CostModel;

/// What `--checkpoint` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Keep everything (the default).
    None,
    /// K segments of about equal saved bytes; the first K-1 keep only their
    /// input and are recomputed, the last is kept (its backward starts right
    /// after its forward, so recomputing it would save nothing).
    Segments(usize),
    /// Recompute the named parts of the torchvision hierarchy (`stem`,
    /// `layer1`…`layer4`, single blocks like `layer3.2`), each its own
    /// segment; everything else is kept.
    Stages(Vec<String>),
    /// The fastest plan that fits `--memory-budget`.
    Auto,
}

impl FromStr for Strategy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::invalid(
                "--checkpoint",
                format!("'{s}': {why} (use none, segments:K, stages:layer1,layer2 or auto)"),
            )
        };
        match s {
            "none" => return Ok(Strategy::None),
            "auto" => return Ok(Strategy::Auto),
            _ => {}
        }
        if let Some(k) = s.strip_prefix("segments:") {
            let k: usize = k.parse().map_err(|_| bad("K must be a whole number"))?;
            if k == 0 {
                return Err(bad("K must be at least 1"));
            }
            return Ok(Strategy::Segments(k));
        }
        if let Some(list) = s.strip_prefix("stages:") {
            let names: Vec<String> = list
                .split(',')
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect();
            if names.is_empty() {
                return Err(bad("no stage names"));
            }
            return Ok(Strategy::Stages(names));
        }
        Err(bad("unknown strategy"))
    }
}

/// Uniform K segments split by saved bytes: boundaries where the running
/// sum of saved bytes crosses j/K of the total. (PyTorch's
/// `checkpoint_sequential` splits by module count, which for ResNet-50 puts
/// the large early activations in one segment and makes K=4 worse than K=2.)
pub fn segments_plan(costs: &CostModel, k: usize) -> Plan {
    let n = costs.stages.len();
    // The head cannot be recomputed, so at most n-1 recomputed segments + 1.
    let k = k.clamp(1, n);
    if k == 1 {
        return Plan::from_flags(&vec![false; n], &vec![false; n]);
    }
    let total: usize = costs.stages.iter().map(|s| s.saved).sum();
    let mut bounds = vec![0];
    let mut acc = 0usize;
    for (i, s) in costs.stages.iter().enumerate() {
        let j = bounds.len(); // next boundary index
        if j < k && i > *bounds.last().expect("non-empty") && acc * k >= j * total {
            bounds.push(i);
        }
        acc += s.saved;
    }
    // Too few crossings (one stage dominates): split the tail one stage each.
    while bounds.len() < k {
        let last = *bounds.last().expect("non-empty");
        if last + 1 >= n - 1 {
            break;
        }
        bounds.push(last + 1);
    }
    let mut segments: Vec<Segment> = bounds
        .windows(2)
        .map(|w| Segment {
            start: w[0],
            end: w[1],
            recompute: true,
        })
        .collect();
    segments.push(Segment {
        start: *bounds.last().expect("non-empty"),
        end: n,
        recompute: false,
    });
    Plan { segments }
}

/// Recompute the named parts, each its own segment.
pub fn stages_plan(names: &[String], wanted: &[String]) -> Result<Plan> {
    let n = names.len();
    let mut recompute = vec![false; n];
    let mut starts = vec![false; n];
    for w in wanted {
        let hits: Vec<usize> = (0..n)
            .filter(|&i| names[i] == *w || names[i].starts_with(&format!("{w}.")))
            .collect();
        if w == "head" || hits.contains(&(n - 1)) {
            return Err(Error::invalid(
                "--checkpoint",
                "the head cannot be recomputed (it keeps only pooled features)",
            ));
        }
        let Some(&first) = hits.first() else {
            return Err(Error::invalid(
                "--checkpoint",
                format!(
                    "no stage named '{w}' (this model has stem, {} and head)",
                    layer_names(names)
                ),
            ));
        };
        for &i in &hits {
            if recompute[i] {
                return Err(Error::invalid(
                    "--checkpoint",
                    format!("'{w}' overlaps another name in the list"),
                ));
            }
            recompute[i] = true;
        }
        starts[first] = true;
    }
    Ok(Plan::from_flags(&recompute, &starts))
}

/// `layer1.0-2, layer2.0-3, …` for error messages.
fn layer_names(names: &[String]) -> String {
    let mut out: Vec<String> = Vec::new();
    for layer in 1..=4 {
        let prefix = format!("layer{layer}.");
        let count = names.iter().filter(|n| n.starts_with(&prefix)).count();
        if count > 0 {
            out.push(format!("layer{layer}.0-{}", count - 1));
        }
    }
    out.join(", ")
}
