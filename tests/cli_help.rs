//! The binary's flags and messages: help for every flag, `plan` listing and
//! using only what it uses, refused flag combinations, progress lines in
//! logs and metrics as CSV. (The walk of every argument of every command
//! for help text is a unit test of the binary: `cargo test --bin memfit`.)

mod common;

use common::{TempDir, assert_clean_error, assert_no_panic, memfit};

/// A small training run: a width-4 ResNet-18 on 64 synthetic images.
const TINY: &[&str] = &[
    "--threads",
    "2",
    "train",
    "--data",
    "synthetic",
    "--base-width",
    "4",
    "--train-size",
    "64",
    "--val-size",
    "16",
    "--batch-size",
    "16",
];

fn tiny(extra: &[&str]) -> (i32, String, String) {
    let args: Vec<&str> = TINY.iter().chain(extra).copied().collect();
    memfit(&args)
}

#[test]
fn reset_head_without_init_is_refused() {
    for sub in ["train", "plan"] {
        assert_clean_error(&[sub, "--reset-head"], "--reset-head needs --init");
    }
}

#[test]
fn plan_help_lists_only_what_plan_uses() {
    let (code, out, err) = memfit(&["plan", "--help"]);
    assert_eq!(code, 0, "{err}");
    for used in ["--memory-budget", "--batch-size", "--checkpoint", "--model"] {
        assert!(out.contains(used), "plan --help lacks {used}:\n{out}");
    }
    for ignored in [
        "--save-dir",
        "--metrics-jsonl",
        "--metrics-csv",
        "--save-weights",
        "--epochs",
        "--log-every",
    ] {
        assert!(
            !out.lines().any(|l| l.trim_start().starts_with(ignored)),
            "plan --help lists {ignored}:\n{out}"
        );
    }
    // train's help still lists them.
    let (code, out, _) = memfit(&["train", "--help"]);
    assert_eq!(code, 0);
    for flag in ["--save-dir", "--metrics-csv", "--log-every"] {
        assert!(
            out.lines().any(|l| l.trim_start().starts_with(flag)),
            "train --help lacks {flag}"
        );
    }
    // --model names the models.
    assert!(out.contains("resnet152"), "{out}");
}

#[test]
fn plan_warns_about_the_flags_it_ignores() {
    let dir = TempDir::new("plan-ignored");
    let save = dir.0.join("ckpt");
    let jsonl = dir.0.join("m.jsonl");
    let (code, out, err) = memfit(&[
        "plan",
        "--base-width",
        "4",
        "--save-dir",
        save.to_str().unwrap(),
        "--metrics-jsonl",
        jsonl.to_str().unwrap(),
        "--epochs",
        "3",
    ]);
    assert_no_panic("plan", &err);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("predicted"), "{out}");
    assert!(
        err.contains("warning: plan ignores --epochs, --metrics-jsonl, --save-dir"),
        "{err}"
    );
    // Nothing was written.
    assert!(!save.exists() && !jsonl.exists());
    // One --config file serves train and plan: plan warns about its
    // training keys instead of refusing them.
    let toml = dir.write(
        "run.toml",
        b"base_width = 4\nbatch_size = 8\nepochs = 2\nlog_every = 5\n",
    );
    let (code, out, err) = memfit(&["plan", "--config", toml.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("predicted"), "{out}");
    assert!(
        err.contains("warning: plan ignores --epochs, --log-every"),
        "{err}"
    );
    // A plan with only plan flags warns about nothing.
    let (code, _, err) = memfit(&["plan", "--base-width", "4", "--batch-size", "8"]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("ignores"), "{err}");
}

#[test]
fn without_a_terminal_a_line_every_log_every_steps() {
    // stderr is a pipe here, not a terminal.
    let (code, _, err) = tiny(&["--steps", "4", "--log-every", "2"]);
    assert_no_panic("train", &err);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(lines[0].starts_with("step 2/4 (epoch 1)"), "{err}");
    assert!(lines[1].starts_with("step 4/4 (epoch 1)"), "{err}");
    for key in ["loss ", "lr ", "img/s", "tracked peak ", "ETA "] {
        assert!(lines[0].contains(key), "{key}: {}", lines[0]);
    }
    // The default (every ~30 s) prints nothing in a run this short.
    let (code, _, err) = tiny(&["--steps", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.lines().any(|l| l.starts_with("step ")), "{err}");
    assert_clean_error(&["train", "--log-every", "0"], "--log-every");
}

#[test]
fn metrics_csv_has_a_header_a_row_per_step_and_eval_rows() {
    let dir = TempDir::new("metrics-csv");
    let csv = dir.0.join("m.csv");
    let (code, _, err) = tiny(&["--epochs", "2", "--metrics-csv", csv.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&csv).unwrap();
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split(',').collect()).collect();
    let header = &rows[0];
    assert_eq!(&header[..5], ["step", "epoch", "loss", "lr", "img_per_s"]);
    for col in ["peak_bytes", "val_loss", "val_top1", "val_top5"] {
        assert!(header.contains(&col), "{col}: {header:?}");
    }
    assert!(rows.iter().all(|r| r.len() == header.len()), "{text}");
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    // 64 training images at batch 16: 4 steps per epoch, 2 epochs, and an
    // evaluation row after each epoch.
    let steps: Vec<_> = rows[1..]
        .iter()
        .filter(|r| !r[col("loss")].is_empty())
        .collect();
    let evals: Vec<_> = rows[1..]
        .iter()
        .filter(|r| !r[col("val_loss")].is_empty())
        .collect();
    assert_eq!(steps.len(), 8, "{text}");
    assert_eq!(evals.len(), 2, "{text}");
    assert_eq!(steps[7][col("step")], "8");
    let loss: f64 = steps[0][col("loss")].parse().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "{text}");
    let top1: f64 = evals[1][col("val_top1")].parse().unwrap();
    assert!((0.0..=1.0).contains(&top1), "{text}");
    // A second run appends rows without a second header.
    let (code, _, err) = tiny(&["--steps", "1", "--metrics-csv", csv.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(text.lines().filter(|l| l.starts_with("step,")).count(), 1);
}

/// `memfit --version` names the commit it was built from (in a git
/// checkout, as CI's clean clone is), so a bug report says what ran.
#[test]
fn version_names_the_commit() {
    let (code, out, err) = memfit(&["--version"]);
    assert_eq!(code, 0, "{err}");
    let line = out.trim();
    let version = concat!("memfit ", env!("CARGO_PKG_VERSION"));
    assert!(line.starts_with(version), "{line}");
    let in_git = std::process::Command::new("git")
        .args(["rev-parse", "--short=7", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    match in_git {
        Some(head) => assert!(
            line.contains(&format!("({head}")),
            "{line} should name HEAD {head}"
        ),
        None => assert_eq!(line, version),
    }
}
