//! The binary end to end: the README's main command (shortened), and clear
//! errors for bad input with no panic or backtrace reaching the user.

use std::process::Command;

fn memfit(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(args)
        .output()
        .expect("run memfit");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[track_caller]
fn assert_clean_error(args: &[&str], needle: &str) {
    let (code, _, err) = memfit(args);
    assert_ne!(code, 0, "{args:?} succeeded");
    assert!(
        err.contains(needle),
        "{args:?}: stderr lacks {needle:?}:\n{err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{args:?} panicked:\n{err}"
    );
}

#[test]
fn train_runs_and_learns_on_the_builtin_dataset() {
    let (code, out, err) = memfit(&[
        "--threads",
        "2",
        "train",
        "--epochs",
        "2",
        "--train-size",
        "256",
        "--val-size",
        "64",
        "--batch-size",
        "32",
        "--base-width",
        "8",
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(
        out.contains("epoch 1:") && out.contains("epoch 2:"),
        "{out}"
    );
    assert!(out.contains("tracked peak"), "{out}");
    // The loss of the second epoch is below chance level (ln 6 = 1.79).
    let loss: f64 = out
        .lines()
        .find(|l| l.starts_with("epoch 2:"))
        .and_then(|l| l.split("train loss ").nth(1))
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .expect("epoch 2 loss");
    assert!(loss < 1.5, "epoch 2 train loss {loss}");
}

#[test]
fn bench_step_reports_time_and_memory() {
    let (code, out, err) = memfit(&[
        "bench",
        "step",
        "--model",
        "resnet18",
        "--base-width",
        "8",
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--steps",
        "2",
        "--num-classes",
        "10",
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    for needle in [
        "s/step",
        "img/s",
        "tracked peak",
        "activations",
        "optimizer",
    ] {
        assert!(out.contains(needle), "missing {needle}:\n{out}");
    }
}

#[test]
fn bad_inputs_give_clear_errors() {
    assert_clean_error(
        &["train", "--memory-budget", "lots"],
        "'lots' is not a size",
    );
    assert_clean_error(&["train", "--memory-budget", "1MB"], "out of memory budget");
    assert_clean_error(
        &["train", "--model", "resnet51"],
        "unknown model 'resnet51'",
    );
    assert_clean_error(
        &["train", "--batch-size", "0", "--epochs", "1"],
        "batch size must be at least 1",
    );
    assert_clean_error(&["train", "--image-size", "1"], "too small");
    assert_clean_error(&["bench", "step", "--batch-size", "0"], "at least 1");
    assert_clean_error(&["train", "--no-such-flag"], "unexpected argument");
}
