//! `memfit train` and `memfit bench step` under `mpirun` (feature `mpi`;
//! `.ci/run` installs Open MPI): what a user launching a data-parallel run
//! sees, through the binary.
//! - Two processes train, resume and save; only rank 0 prints and writes;
//!   the per-process peak (the gradient buckets counted) is predicted to
//!   the byte; a memory plan changes no bit of the weights.
//! - A resume with another process count is refused, naming it.
//! - Different command lines, a process that fails alone, and a process
//!   that never starts each end every process with a message, never a hang.
//!
//! Skipped (with a note) when `mpirun` is not on the PATH.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;

use common::{TempDir, png};
use memfit::io::{RawData, TensorFile};

fn mpirun_available() -> bool {
    let found = Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipped: mpirun not found");
    }
    found
}

/// A private Open MPI session directory for one launch. The tests run in
/// parallel, and two `mpirun`s creating `/tmp/ompi.<host>.<uid>` at the same
/// moment make one fail with "mkdir ... File exists" (Open MPI 4's
/// session_dir.c); each launch gets its own base instead. The name is kept
/// short because Open MPI puts Unix sockets under it (108-byte limit).
struct OmpiTmp(std::path::PathBuf);

impl OmpiTmp {
    fn new() -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mfo-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("creating an Open MPI session directory");
        OmpiTmp(dir)
    }

    /// Points `cmd` (and the processes it starts) at this directory.
    fn apply<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.env("TMPDIR", &self.0)
            .env("OMPI_MCA_orte_tmpdir_base", &self.0)
    }
}

impl Drop for OmpiTmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `mpirun` with the flags this machine needs (root, loopback, no binding
/// for threaded ranks), then `args`, in `dir`, killed after `limit`.
fn mpirun(dir: &Path, args: &[&str], limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let session = OmpiTmp::new();
    let out = session
        .apply(&mut Command::new("timeout"))
        .arg(limit.as_secs().to_string())
        .args([
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
            "--mca",
            "btl",
            "self,vader",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running timeout/mpirun");
    (out, start.elapsed())
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The memfit binary (`common::memfit_bin`), as the `&str` mpirun's
/// argument lists take.
fn bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| common::memfit_bin().to_string_lossy().into_owned())
}

/// Every tensor of two weight files, bitwise.
fn same_tensors(a: &Path, b: &Path) -> bool {
    let (a, b) = (TensorFile::open(a).unwrap(), TensorFile::open(b).unwrap());
    assert!(!a.tensors.is_empty());
    a.tensors.keys().eq(b.tensors.keys())
        && a.tensors
            .iter()
            .all(|(n, t)| match (&t.data, &b.tensors[n].data) {
                (RawData::F32(x), RawData::F32(y)) => {
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
                }
                (RawData::I64(x), RawData::I64(y)) => x == y,
                _ => false,
            })
}

#[test]
fn two_processes_train_resume_and_report_once() {
    if !mpirun_available() {
        return;
    }
    let dir = TempDir::new("mpi-train");
    let d = dir.0.as_path();
    let train = |extra: &[&str]| {
        let mut args = vec!["-np", "2", bin(), "--threads", "1", "train", "--steps", "6"];
        args.extend_from_slice(extra);
        mpirun(d, &args, Duration::from_secs(120))
    };
    let (o, _) = train(&["--save-dir", "run", "--save-weights", "plain.safetensors"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    // Rank 0 alone reports: one of each line.
    assert_eq!(out.matches("training resnet18").count(), 1, "{out}");
    assert_eq!(out.matches("trained in").count(), 1, "{out}");
    assert!(
        out.contains(
            "data-parallel over 2 processes: each trains on up to 32 of every batch of 64"
        ),
        "{out}"
    );
    // The bucket buffers are in the plan: predicted = measured.
    assert!(
        out.contains("vs measured") && out.contains("(+0.00%)"),
        "{out}"
    );
    assert!(d.join("plain.safetensors").exists());

    // A plan recomputes, and changes no bit.
    let (o, _) = train(&[
        "--checkpoint",
        "segments:2",
        "--save-weights",
        "segments.safetensors",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(same_tensors(
        &d.join("plain.safetensors"),
        &d.join("segments.safetensors")
    ));

    // One process cannot continue a run of two: named.
    let one = Command::new(bin())
        .args(["--threads", "1", "train", "--resume", "run", "--steps", "8"])
        .current_dir(d)
        .output()
        .unwrap();
    let (_, err) = text(&one);
    assert!(!one.status.success());
    assert!(err.contains("processes: checkpoint 2, now 1"), "{err}");

    // Two can.
    let (o, _) = mpirun(
        d,
        &[
            "-np",
            "2",
            bin(),
            "--threads",
            "1",
            "train",
            "--resume",
            "run",
            "--steps",
            "8",
        ],
        Duration::from_secs(120),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert_eq!(
        out.matches("resuming from").count(),
        1,
        "only rank 0 reports: {out}"
    );
    assert!(out.contains("after optimizer step 6"), "{out}");
}

#[test]
fn different_command_lines_end_every_process() {
    if !mpirun_available() {
        return;
    }
    let dir = TempDir::new("mpi-mismatch");
    let (o, took) = mpirun(
        &dir.0,
        &[
            "-np",
            "1",
            bin(),
            "train",
            "--steps",
            "1",
            "--batch-size",
            "32",
            ":",
            "-np",
            "1",
            bin(),
            "train",
            "--steps",
            "1",
            "--batch-size",
            "16",
        ],
        Duration::from_secs(60),
    );
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}\n{err}");
    assert!(took < Duration::from_secs(50), "ended by the timeout");
    assert!(
        err.contains("were started with different command lines"),
        "{err}"
    );
}

#[test]
fn a_process_that_fails_alone_ends_the_others() {
    if !mpirun_available() {
        return;
    }
    // The same command line; the data folder exists for rank 0 only (as
    // on a node that lacks it).
    let dir = TempDir::new("mpi-one-fails");
    for class in ["cat", "dog"] {
        for i in 0..4 {
            dir.write(&format!("a/imgs/{class}/{i}.png"), &png(12, 12));
        }
    }
    std::fs::create_dir_all(dir.0.join("b")).unwrap();
    let (with, without) = (dir.0.join("a"), dir.0.join("b"));
    let args = [
        "train",
        "--data",
        "imgs",
        "--image-size",
        "8",
        "--stem",
        "small",
        "--batch-size",
        "4",
        "--steps",
        "200",
    ];
    let (wa, wb) = (with.to_str().unwrap(), without.to_str().unwrap());
    let mut all = vec!["-np", "1", "-wdir", wa, bin()];
    all.extend_from_slice(&args);
    all.extend_from_slice(&[":", "-np", "1", "-wdir", wb, bin()]);
    all.extend_from_slice(&args);
    let (o, took) = mpirun(&dir.0, &all, Duration::from_secs(60));
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}\n{err}");
    assert!(took < Duration::from_secs(50), "ended by the timeout");
    assert!(err.contains("error: process 1 of 2: "), "{err}");
    assert!(err.contains("imgs"), "{err}");
}

#[test]
fn a_process_that_never_starts_ends_the_run_after_the_timeout() {
    if !mpirun_available() {
        return;
    }
    let dir = TempDir::new("mpi-never-starts");
    let (o, took) = mpirun(
        &dir.0,
        &[
            "-x",
            "MEMFIT_DIST_TIMEOUT=3",
            "-np",
            "1",
            bin(),
            "train",
            "--steps",
            "1",
            ":",
            "-np",
            "1",
            "sleep",
            "45",
        ],
        Duration::from_secs(60),
    );
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        took < Duration::from_secs(30),
        "the watchdog did not fire: {took:?}"
    );
    assert!(
        err.contains("the start of the distributed run did not complete within 3 s"),
        "{err}"
    );
}

#[test]
fn bench_step_reports_the_all_reduce_for_two_processes() {
    if !mpirun_available() {
        return;
    }
    let dir = TempDir::new("mpi-bench");
    let (o, _) = mpirun(
        &dir.0,
        &[
            "-np",
            "2",
            bin(),
            "--threads",
            "1",
            "bench",
            "step",
            "--model",
            "resnet18",
            "--base-width",
            "8",
            "--image-size",
            "32",
            "--batch-size",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
        ],
        Duration::from_secs(120),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("2 processes (4 images each)"), "{out}");
    assert_eq!(
        out.matches("gradient all-reduce (rank 0): median").count(),
        1
    );
    let line = out
        .lines()
        .find(|l| l.starts_with("predicted peak"))
        .unwrap();
    let (p, m) = line
        .trim_start_matches("predicted peak ")
        .split_once(" vs measured ")
        .unwrap();
    assert_eq!(p, m, "{out}");
}

#[test]
fn bench_scaling_tables_one_and_two_processes() {
    if !mpirun_available() {
        return;
    }
    let dir = TempDir::new("mpi-scaling");
    let session = OmpiTmp::new();
    let out = session
        .apply(&mut Command::new(bin()))
        .args([
            "bench",
            "scaling",
            "--launcher",
            "mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader",
            "--",
            "--model",
            "resnet18",
            "--base-width",
            "8",
            "--image-size",
            "32",
            "--batch-size",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
        ])
        .current_dir(&dir.0)
        .output()
        .unwrap();
    let (out, err) = text(&out);
    assert!(
        out.contains("| processes | threads each | s/step |"),
        "{out}\n{err}"
    );
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("| ")).collect();
    // Header, then 1 x 1, 2 x 1 (with an all-reduce time), 1 x 2.
    assert_eq!(rows.len(), 4, "{out}");
    assert!(rows[1].starts_with("| 1 | 1 | ") && rows[1].contains("| 1.00x | - | - |"));
    assert!(rows[2].starts_with("| 2 | 1 | ") && !rows[2].contains("| - | - |"));
    assert!(rows[3].starts_with("| 1 | 2 | "));
}
