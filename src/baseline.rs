//! The measured PyTorch baseline (`../shared/baselines/pytorch/results.jsonl`,
//! written by its `resnet_mem.py`), summarised per strategy so that
//! `memfit bench strategies` can print PyTorch's rows next to its own.
//!
//! The baseline was measured on another day and maybe another host, so only
//! its *ratios* (each strategy against PyTorch's own plain run) compare with
//! memfit's; absolute times do not.

use std::path::Path;

use crate::error::{Error, Result};

/// One PyTorch strategy at one image size and batch, over all its runs.
#[derive(Clone, Debug, PartialEq)]
pub struct BaselineRow {
    /// The baseline's name: plain, ckpt-seq-4, bf16, accum-4, ...
    pub strategy: String,
    /// memfit's name for the nearest strategy (ckpt-seq-K splits by module
    /// count, memfit's segments:K by saved bytes).
    pub memfit_name: &'static str,
    pub micro_batch: usize,
    /// Median over runs of the step's allocator peak plus parameters,
    /// gradients and momentum (what memfit's tracked peak counts), bytes.
    pub peak_bytes: f64,
    /// Median s/step over the runs no other process disturbed (another
    /// process used at most 2% of the CPUs while timed); None if none was.
    pub seconds: Option<f64>,
    /// Runs used for the timing / all runs.
    pub clean_runs: usize,
    pub runs: usize,
    pub torch: String,
}

/// Other processes' CPU share above which a run's timing is left out (the
/// baseline's own `summarize.py` rule).
const CLEAN_OTHER_CPU: f64 = 0.02;

const MIB: f64 = 1024.0 * 1024.0;

fn memfit_name(strategy: &str) -> Option<&'static str> {
    Some(match strategy {
        "plain" => "none",
        "ckpt-seq-2" => "segments:2",
        "ckpt-seq-4" => "segments:4",
        "ckpt-seq-8" => "segments:8",
        "ckpt-layers" => "stages:layer1,layer2,layer4",
        "bf16" => "bf16",
        "accum-4" => "micro-batch 4",
        _ => return None,
    })
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    })
}

/// The rows of `text` (JSON lines) for `image_size`² and `batch`, in the
/// order of [`memfit_name`]'s table, runs with a `glibc-…` malloc tag left
/// out (a different allocator setting). Lines that are not such records are
/// an error naming the line.
pub fn summarise(text: &str, image_size: usize, batch: usize) -> Result<Vec<BaselineRow>> {
    struct Run {
        strategy: String,
        micro_batch: usize,
        peak_bytes: f64,
        seconds: f64,
        clean: bool,
        torch: String,
    }
    let bad = |line: usize, why: String| Error::BadData {
        path: format!("baseline line {line}"),
        reason: why,
    };
    let mut runs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(i + 1, e.to_string()))?;
        let num = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_f64)
                .ok_or_else(|| bad(i + 1, format!("no number '{k}'")))
        };
        let text_of = |k: &str| v.get(k).and_then(serde_json::Value::as_str).unwrap_or("");
        if num("res")? as usize != image_size || num("batch")? as usize != batch {
            continue;
        }
        if text_of("tag").starts_with("glibc") {
            continue;
        }
        runs.push(Run {
            strategy: text_of("strategy").to_string(),
            micro_batch: num("micro_batch")? as usize,
            peak_bytes: (num("alloc_peak_step_MB")? + num("params_grads_momentum_MB")?) * MIB,
            seconds: num("s_per_step_median")?,
            clean: num("timed_other_cpu_frac")? <= CLEAN_OTHER_CPU,
            torch: text_of("torch").to_string(),
        });
    }
    let order = [
        "plain",
        "ckpt-seq-2",
        "ckpt-seq-4",
        "ckpt-seq-8",
        "ckpt-layers",
        "bf16",
        "accum-4",
    ];
    let mut rows = Vec::new();
    for name in order {
        let mine: Vec<&Run> = runs.iter().filter(|r| r.strategy == name).collect();
        let Some(first) = mine.first() else { continue };
        let clean: Vec<f64> = mine.iter().filter(|r| r.clean).map(|r| r.seconds).collect();
        rows.push(BaselineRow {
            strategy: name.to_string(),
            memfit_name: memfit_name(name).expect("listed above"),
            micro_batch: first.micro_batch,
            peak_bytes: median(mine.iter().map(|r| r.peak_bytes).collect()).expect("non-empty"),
            clean_runs: clean.len(),
            seconds: median(clean),
            runs: mine.len(),
            torch: first.torch.clone(),
        });
    }
    Ok(rows)
}

/// [`summarise`] of the file at `path`.
pub fn load(path: &Path, image_size: usize, batch: usize) -> Result<Vec<BaselineRow>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    summarise(&text, image_size, batch).map_err(|e| match e {
        Error::BadData { path: at, reason } => Error::BadData {
            path: format!("{} ({at})", path.display()),
            reason,
        },
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(strategy: &str, tag: &str, res: usize, secs: f64, other: f64, peak: f64) -> String {
        format!(
            r#"{{"strategy": "{strategy}", "tag": "{tag}", "res": {res}, "batch": 16, "micro_batch": 16, "s_per_step_median": {secs}, "timed_other_cpu_frac": {other}, "alloc_peak_step_MB": {peak}, "params_grads_momentum_MB": 292.5, "torch": "2.15.0"}}"#
        )
    }

    #[test]
    fn medians_of_clean_runs_per_strategy_in_table_order() {
        let text = [
            line("ckpt-seq-2", "grid", 224, 3.0, 0.01, 800.0),
            line("plain", "grid", 224, 10.0, 0.5, 1300.0), // disturbed: timing left out
            line("plain", "pass2", 224, 2.0, 0.0, 1300.0),
            line("plain", "pass3", 224, 4.0, 0.0, 1400.0),
            line("plain", "glibc-mmap64k", 224, 9.0, 0.0, 9999.0), // other malloc
            line("plain", "grid", 128, 1.0, 0.0, 500.0),           // other size
            line("fwdbwd", "grid", 224, 1.0, 0.0, 500.0),          // not a strategy
            String::new(),
        ]
        .join("\n");
        let rows = summarise(&text, 224, 16).unwrap();
        assert_eq!(rows.len(), 2);
        let plain = &rows[0];
        assert_eq!(
            (plain.strategy.as_str(), plain.memfit_name),
            ("plain", "none")
        );
        assert_eq!((plain.clean_runs, plain.runs), (2, 3));
        assert_eq!(plain.seconds, Some(3.0));
        assert_eq!(plain.peak_bytes, (1300.0 + 292.5) * MIB);
        assert_eq!(rows[1].memfit_name, "segments:2");
        assert_eq!(rows[1].seconds, Some(3.0));
    }

    #[test]
    fn a_broken_line_is_named() {
        let text = format!("{}\n{{not json", line("plain", "grid", 224, 1.0, 0.0, 1.0));
        let msg = summarise(&text, 224, 16).unwrap_err().to_string();
        assert!(msg.contains("line 2"), "{msg}");
        let msg = summarise(r#"{"res": 224}"#, 224, 16)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("'batch'"), "{msg}");
    }
}
