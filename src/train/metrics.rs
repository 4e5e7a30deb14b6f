//! The `--metrics-jsonl` observer: one JSON object per optimizer step and
//! one per evaluation, appended to a file.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::memory::{Category, MemoryStats};

use super::EvalReport;
use super::step::StepReport;

/// Appends metrics lines to a file; does nothing without one.
pub struct MetricsWriter {
    out: Option<(BufWriter<File>, PathBuf)>,
}

impl MetricsWriter {
    /// Opens `path` for appending (created when missing).
    pub fn open(path: Option<&Path>) -> Result<Self> {
        let out = match path {
            Some(p) => {
                let f = File::options()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| io_error(p, e))?;
                Some((BufWriter::new(f), p.to_path_buf()))
            }
            None => None,
        };
        Ok(MetricsWriter { out })
    }

    fn write(&mut self, line: std::fmt::Arguments<'_>) -> Result<()> {
        if let Some((w, p)) = self.out.as_mut() {
            writeln!(w, "{line}").map_err(|e| io_error(p, e))?;
        }
        Ok(())
    }

    /// The line of optimizer step `step` of `epoch`, which took `secs`.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        step: usize,
        epoch: usize,
        r: &StepReport,
        lr: f32,
        secs: f64,
        memory: &MemoryStats,
        predicted_peak: Option<usize>,
    ) -> Result<()> {
        if self.out.is_none() {
            return Ok(());
        }
        let gn = r.grad_norm.map_or("null".to_string(), |g| num(g as f64));
        let sc = r.scaled.map_or(
            if r.dropped.is_some() {
                ",\"skipped\":true".to_string()
            } else {
                String::new()
            },
            |s| {
                format!(
                    ",\"scale\":{},\"found_inf\":{},\"skipped\":{}",
                    num(s.scale as f64),
                    s.found_inf,
                    s.skipped
                )
            },
        );
        self.write(format_args!(
            "{{\"step\":{step},\"epoch\":{epoch},\"loss\":{},\"lr\":{},\"img_per_s\":{},\"grad_norm\":{gn}{sc},{}}}",
            num(r.loss),
            num(lr as f64),
            num(r.samples as f64 / secs),
            memory_fields(memory, predicted_peak)
        ))
    }

    /// The line of an evaluation after `epoch` (optimizer step `step`).
    pub fn eval(&mut self, epoch: usize, step: usize, e: &EvalReport) -> Result<()> {
        self.write(format_args!(
            "{{\"epoch\":{epoch},\"step\":{step},\"val_loss\":{},\"val_top1\":{},\"val_top5\":{}}}",
            num(e.loss),
            num(e.top1),
            e.top5.map_or("null".to_string(), num)
        ))
    }

    pub fn flush(&mut self) -> Result<()> {
        if let Some((w, p)) = self.out.as_mut() {
            w.flush().map_err(|e| io_error(p, e))?;
        }
        Ok(())
    }
}

fn io_error(p: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: p.display().to_string(),
        reason: e.to_string(),
    }
}

/// A JSON number, or null for NaN/inf (which JSON cannot hold).
fn num(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".into()
    }
}

fn memory_fields(m: &MemoryStats, predicted: Option<usize>) -> String {
    let mut s = format!("\"peak_bytes\":{}", m.peak_total);
    if let Some(p) = predicted {
        s += &format!(",\"predicted_peak_bytes\":{p}");
    }
    for c in Category::ALL {
        s += &format!(",\"peak_{}_bytes\":{}", c.name(), m.peak.get(c));
    }
    s
}
