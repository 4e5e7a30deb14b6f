//! The `--metrics-jsonl` and `--metrics-csv` observer: one JSON object (one
//! CSV row) per optimizer step and one per evaluation, appended to a file.
//!
//! The CSV file is one table: a header when the file is new, then a row per
//! step with the `val_*` columns empty, and a row per evaluation with only
//! `step`, `epoch` and the `val_*` columns filled.
//!
//! Every row is flushed as it is written, so a killed run loses none; a
//! resumed run first drops the rows after the step it resumes from (the
//! killed run wrote them after its last checkpoint, and they are about to
//! be trained again), so the file holds each step once.

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
    csv: Option<(BufWriter<File>, PathBuf)>,
    /// The step a resumed run continues after.
    resumed: Option<usize>,
}

/// Opens `p` for appending (created when missing); true if it was empty.
fn open_append(p: &Path) -> Result<(BufWriter<File>, bool)> {
    let f = File::options()
        .create(true)
        .append(true)
        .open(p)
        .map_err(|e| io_error(p, e))?;
    let empty = f.metadata().map_err(|e| io_error(p, e))?.len() == 0;
    Ok((BufWriter::new(f), empty))
}

/// The CSV header: the step columns, then the evaluation's.
fn csv_header() -> String {
    let mut h = "step,epoch,loss,lr,img_per_s,grad_norm,scale,found_inf,skipped,peak_bytes,predicted_peak_bytes".to_string();
    for c in Category::ALL {
        h += &format!(",peak_{}_bytes", c.name());
    }
    h + ",val_loss,val_top1,val_top5"
}

/// The optimizer step of a metrics line: JSONL's `"step"`, CSV's first
/// column. None for a line that is neither (the CSV header, a line cut
/// short by a kill).
fn line_step(line: &str, csv: bool) -> Option<usize> {
    if csv {
        let (first, rest) = line.split_once(',')?;
        // A whole row has every column: a row cut short is dropped.
        if rest.split(',').count() + 1 != csv_header().split(',').count() {
            return None;
        }
        first.parse().ok()
    } else {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        v.get("step")?.as_u64().map(|s| s as usize)
    }
}

/// Keeps the lines of the metrics file `p` up to optimizer step `last` (and
/// a CSV's header), dropping later ones and any line cut short: what a run
/// resumed after step `last` finds of the run that was killed. Rewritten
/// through a temporary file, so a kill now leaves the old file or the new.
fn keep_through(p: &Path, last: usize, csv: bool) -> Result<()> {
    let text = match std::fs::read_to_string(p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error(p, e)),
    };
    let mut kept = String::with_capacity(text.len());
    for (i, line) in text.lines().enumerate() {
        let header = csv && i == 0 && line == csv_header();
        if header || line_step(line, csv).is_some_and(|s| s <= last) {
            kept += line;
            kept.push('\n');
        }
    }
    if kept == text {
        return Ok(());
    }
    crate::io::write_atomic(p, |f| {
        f.write_all(kept.as_bytes()).map_err(|e| e.to_string())
    })
}

impl MetricsWriter {
    /// Opens `path` for appending (created when missing); with `resumed`
    /// (the step a resumed run continues after), the rows after it are
    /// dropped first.
    pub fn open(path: Option<&Path>, resumed: Option<usize>) -> Result<Self> {
        let out = match path {
            Some(p) => {
                if let Some(last) = resumed {
                    keep_through(p, last, false)?;
                }
                Some((open_append(p)?.0, p.to_path_buf()))
            }
            None => None,
        };
        Ok(MetricsWriter {
            out,
            csv: None,
            resumed,
        })
    }

    /// Also appends CSV rows to `path` (the header first if it is empty).
    pub fn with_csv(mut self, path: Option<&Path>) -> Result<Self> {
        if let Some(p) = path {
            if let Some(last) = self.resumed {
                keep_through(p, last, true)?;
            }
            let (mut w, empty) = open_append(p)?;
            if empty {
                writeln!(w, "{}", csv_header()).map_err(|e| io_error(p, e))?;
            }
            self.csv = Some((w, p.to_path_buf()));
        }
        Ok(self)
    }

    /// Whether anything is written (else the callers need not gather the
    /// values).
    pub fn is_on(&self) -> bool {
        self.out.is_some() || self.csv.is_some()
    }

    fn write_csv(&mut self, row: std::fmt::Arguments<'_>) -> Result<()> {
        if let Some((w, p)) = self.csv.as_mut() {
            writeln!(w, "{row}")
                .and_then(|()| w.flush())
                .map_err(|e| io_error(p, e))?;
        }
        Ok(())
    }

    fn write(&mut self, line: std::fmt::Arguments<'_>) -> Result<()> {
        if let Some((w, p)) = self.out.as_mut() {
            writeln!(w, "{line}")
                .and_then(|()| w.flush())
                .map_err(|e| io_error(p, e))?;
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
        if self.csv.is_some() {
            let opt = |v: Option<String>| v.unwrap_or_default();
            let mut row = format!(
                "{step},{epoch},{},{},{},{},{},{},{},{},{}",
                r.loss,
                lr,
                r.samples as f64 / secs,
                opt(r.grad_norm.map(|g| g.to_string())),
                opt(r.scaled.map(|s| s.scale.to_string())),
                opt(r.scaled.map(|s| s.found_inf.to_string())),
                r.scaled.map_or(r.dropped.is_some(), |s| s.skipped),
                memory.peak_total,
                opt(predicted_peak.map(|p| p.to_string())),
            );
            for c in Category::ALL {
                row += &format!(",{}", memory.peak.get(c));
            }
            self.write_csv(format_args!("{row},,,"))?;
        }
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
        if self.csv.is_some() {
            // Empty step columns: 9 after epoch, the memory ones, then val_*.
            let empty = ",".repeat(9 + Category::ALL.len());
            self.write_csv(format_args!(
                "{step},{epoch}{empty},{},{},{}",
                e.loss,
                e.top1,
                e.top5.map_or(String::new(), |t| t.to_string())
            ))?;
        }
        self.write(format_args!(
            "{{\"epoch\":{epoch},\"step\":{step},\"val_loss\":{},\"val_top1\":{},\"val_top5\":{}}}",
            num(e.loss),
            num(e.top1),
            e.top5.map_or("null".to_string(), num)
        ))
    }

    pub fn flush(&mut self) -> Result<()> {
        for (w, p) in self.out.iter_mut().chain(self.csv.iter_mut()) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_rows_have_as_many_columns_as_the_header() {
        let header = csv_header().split(',').count();
        // step,epoch + 9 step columns + memory + 3 val columns.
        assert_eq!(header, 2 + 9 + Category::ALL.len() + 3);
    }
}
