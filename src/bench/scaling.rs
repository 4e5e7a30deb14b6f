//! `memfit bench scaling`: the same `bench step` on 1, 2, … processes
//! (data-parallel, launched with `mpirun`), alternated over rounds, as one
//! table of step time, images per second over the whole batch, speed-up
//! against the first row, and the time rank 0 spent summing gradients.
//!
//! Each row is a child process of this binary (`memfit --threads T bench
//! step ARGS`, under the launcher for more than one process), so every row
//! starts as a user's run would; its report is parsed from its stdout (the
//! lines [`super::step::measure_steps_on`] writes).

use std::process::Command;

use crate::error::{Error, Result};

/// What to run.
#[derive(Clone, Debug)]
pub struct ScalingOptions {
    /// The memfit binary to run (the current one).
    pub exe: std::path::PathBuf,
    /// Process counts, one row each (1 runs without the launcher).
    pub processes: Vec<usize>,
    /// `--threads` of each process.
    pub threads: usize,
    /// Also a row of one process with `processes.max() × threads` threads:
    /// the same cores as the largest row, shared by threads instead.
    pub one_process_all_threads: bool,
    /// The launcher and its flags, before `-np N` (`mpirun`).
    pub launcher: Vec<String>,
    /// `bench step`'s flags, passed as they are.
    pub step_args: Vec<String>,
    /// Every row is run this many times, rows alternating; each reports
    /// its median round.
    pub rounds: usize,
}

/// One configuration's result (its median round).
#[derive(Clone, Debug, PartialEq)]
pub struct ScalingRow {
    pub processes: usize,
    pub threads: usize,
    pub seconds_per_step: f64,
    pub img_per_s: f64,
    /// Rank 0's median all-reduce seconds per step (more than one
    /// process).
    pub allreduce_seconds: Option<f64>,
    /// Rank 0's tracked peak, as printed.
    pub peak: String,
}

/// What one `bench step` run printed that the table needs.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    pub seconds_per_step: f64,
    pub img_per_s: f64,
    pub allreduce_seconds: Option<f64>,
    pub peak: String,
}

/// Reads a [`StepReport`] back from `bench step`'s stdout.
pub fn parse_step_report(stdout: &str) -> Option<StepReport> {
    let mut time = None;
    let mut allreduce = None;
    let mut peak = None;
    for line in stdout.lines() {
        if let Some(rest) = line.strip_prefix("median ") {
            // "median 0.123 s/step, 456.78 img/s"
            let (secs, rest) = rest.split_once(" s/step, ")?;
            let rate = rest.strip_suffix(" img/s")?;
            time = Some((secs.parse().ok()?, rate.parse().ok()?));
        } else if let Some(rest) = line.strip_prefix("gradient all-reduce (rank 0): median ") {
            allreduce = Some(rest.split_once(" s/step")?.0.parse().ok()?);
        } else if let Some(rest) = line.strip_prefix("predicted peak ") {
            peak = Some(rest.split_once(" vs measured ")?.1.to_string());
        }
    }
    let (seconds_per_step, img_per_s) = time?;
    Some(StepReport {
        seconds_per_step,
        img_per_s,
        allreduce_seconds: allreduce,
        peak: peak?,
    })
}

/// The command line of one row.
fn row_command(o: &ScalingOptions, processes: usize, threads: usize) -> Command {
    let mut cmd;
    if processes > 1 {
        let (launcher, flags) = o
            .launcher
            .split_first()
            .map_or(("mpirun", &[][..]), |(l, f)| (l.as_str(), f));
        cmd = Command::new(launcher);
        cmd.args(flags)
            .arg("-np")
            .arg(processes.to_string())
            .arg(&o.exe);
    } else {
        cmd = Command::new(&o.exe);
    }
    cmd.args(["--threads", &threads.to_string(), "bench", "step"])
        .args(&o.step_args);
    cmd
}

/// Runs every row `rounds` times (rows alternating, so host noise falls on
/// all of them alike), reporting each run on `progress`.
pub fn run_scaling(o: &ScalingOptions, progress: &mut dyn FnMut(&str)) -> Result<Vec<ScalingRow>> {
    if o.processes.is_empty() || o.processes.contains(&0) || o.threads == 0 || o.rounds == 0 {
        return Err(Error::Usage(
            "--processes needs counts of at least 1, and --threads-per-process and --rounds at least 1"
                .into(),
        ));
    }
    let mut configs: Vec<(usize, usize)> = o.processes.iter().map(|&p| (p, o.threads)).collect();
    let most = o.processes.iter().copied().max().unwrap_or(1);
    if o.one_process_all_threads && most > 1 {
        configs.push((1, most * o.threads));
    }
    let mut runs: Vec<Vec<StepReport>> = vec![Vec::new(); configs.len()];
    for round in 1..=o.rounds {
        for (i, &(p, t)) in configs.iter().enumerate() {
            let mut cmd = row_command(o, p, t);
            progress(&format!(
                "round {round}/{}: {p} process(es) x {t} thread(s): {cmd:?}",
                o.rounds
            ));
            let out = cmd.output().map_err(|e| {
                Error::Usage(format!(
                    "could not start {:?}: {e} (for more than one process bench scaling runs the launcher, --launcher; is Open MPI installed?)",
                    cmd.get_program()
                ))
            })?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            if !out.status.success() {
                return Err(Error::Usage(format!(
                    "{p} process(es) x {t} thread(s) failed ({}):\n{}{}",
                    out.status,
                    stdout,
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            let report = parse_step_report(&stdout).ok_or_else(|| {
                Error::Usage(format!(
                    "{p} process(es): no step time in the output of bench step (is this memfit built with --features mpi?):\n{stdout}"
                ))
            })?;
            if p > 1 && report.allreduce_seconds.is_none() {
                return Err(Error::Usage(format!(
                    "{p} processes were launched but bench step ran as one (this memfit is built without --features mpi, or the launcher did not start an MPI job):\n{stdout}"
                )));
            }
            progress(&format!(
                "  {:.3} s/step, {:.2} img/s",
                report.seconds_per_step, report.img_per_s
            ));
            runs[i].push(report);
        }
    }
    Ok(configs
        .iter()
        .zip(runs)
        .map(|(&(processes, threads), mut r)| {
            r.sort_by(|a, b| a.seconds_per_step.total_cmp(&b.seconds_per_step));
            let m = r.swap_remove(r.len() / 2);
            ScalingRow {
                processes,
                threads,
                seconds_per_step: m.seconds_per_step,
                img_per_s: m.img_per_s,
                allreduce_seconds: m.allreduce_seconds,
                peak: m.peak,
            }
        })
        .collect())
}

/// The markdown table: speed-up against the first row.
pub fn format_scaling(rows: &[ScalingRow]) -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "| processes | threads each | s/step | img/s (whole batch) | speed-up | all-reduce s/step | all-reduce share | tracked peak per process |\n|---|---|---|---|---|---|---|---|\n",
    );
    let base = rows.first().map_or(1.0, |r| r.img_per_s);
    for r in rows {
        let (ar, share) = match r.allreduce_seconds {
            Some(a) => (
                format!("{a:.3}"),
                format!("{:.0}%", 100.0 * a / r.seconds_per_step.max(1e-12)),
            ),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} | {:.2} | {:.2}x | {ar} | {share} | {} |",
            r.processes,
            r.threads,
            r.seconds_per_step,
            r.img_per_s,
            r.img_per_s / base.max(1e-12),
            r.peak
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_report_is_read_back() {
        let out = "resnet18 ...\nmedian 0.250 s/step, 64.00 img/s\ngradient all-reduce (rank 0): median 0.020 s/step (8% of the step), 2.68 MiB in buckets of up to 25.00 MiB\ntracked peak: 1 MiB\npredicted peak 22.30 MiB vs measured 22.30 MiB\n";
        assert_eq!(
            parse_step_report(out),
            Some(StepReport {
                seconds_per_step: 0.25,
                img_per_s: 64.0,
                allreduce_seconds: Some(0.02),
                peak: "22.30 MiB".to_string()
            })
        );
        // One process: no all-reduce line.
        let one = "median 1.5 s/step, 10.5 img/s\npredicted peak 1 KiB vs measured 2 KiB\n";
        assert_eq!(
            parse_step_report(one),
            Some(StepReport {
                seconds_per_step: 1.5,
                img_per_s: 10.5,
                allreduce_seconds: None,
                peak: "2 KiB".to_string()
            })
        );
        assert_eq!(parse_step_report("median nonsense"), None);
        let t = format_scaling(&[
            ScalingRow {
                processes: 1,
                threads: 1,
                seconds_per_step: 1.0,
                img_per_s: 16.0,
                allreduce_seconds: None,
                peak: "1 MiB".into(),
            },
            ScalingRow {
                processes: 2,
                threads: 1,
                seconds_per_step: 0.6,
                img_per_s: 26.0,
                allreduce_seconds: Some(0.06),
                peak: "1 MiB".into(),
            },
        ]);
        assert!(
            t.contains("| 2 | 1 | 0.600 | 26.00 | 1.62x | 0.060 | 10% | 1 MiB |"),
            "{t}"
        );
    }
}
