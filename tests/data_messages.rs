//! What a new user's data mistakes produce through the binary: a clear
//! message naming the flag or path, an exit status, no panic, no hang
//! (issue 20, "Messages and help", the data items).

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{TempDir, assert_clean_error, assert_no_panic, memfit, png};

#[test]
fn a_missing_or_wrong_data_path_is_named() {
    assert_clean_error(
        &["train", "--data", "/nonexistent/photos/train"],
        "no such directory: /nonexistent/photos/train",
    );
    let dir = TempDir::new("data-file");
    let file = dir.write("train.csv", b"not a folder");
    let file = file.to_str().unwrap();
    assert_clean_error(&["train", "--data", file], "not a directory");
    // A bare word is still "unknown dataset", as before.
    assert_clean_error(
        &["train", "--data", "imagenet"],
        "unknown dataset 'imagenet'",
    );
}

#[test]
fn val_fraction_out_of_range_is_a_clear_error() {
    for v in ["1", "1.5", "-0.1", "NaN"] {
        let flag = format!("--val-fraction={v}");
        assert_clean_error(
            &["train", &flag, "--epochs", "1"],
            "--val-fraction must be at least 0 and below 1",
        );
    }
}

/// A folder with a PNG per class, plus a .webp and a .bmp (formats memfit
/// cannot decode) and a FIFO named like an image: the run finishes, says
/// what it left out and why, and never opens the FIFO (which would block).
#[test]
fn unsupported_formats_and_special_files_are_left_out_loudly_never_opened() {
    let dir = TempDir::new("left-out");
    for class in ["cat", "dog"] {
        for i in 0..2 {
            dir.write(&format!("{class}/{i}.png"), &png(8, 8));
        }
    }
    dir.write("cat/extra.webp", b"RIFF....WEBPVP8 ");
    dir.write("dog/old.BMP", b"BM......");
    let fifo = dir.0.join("dog/pipe.png");
    let made = Command::new("mkfifo").arg(&fifo).status();
    let have_fifo = made.is_ok_and(|s| s.success());
    if !have_fifo {
        println!("mkfifo unavailable: checking the formats only");
    }
    let root = dir.0.to_str().unwrap();
    let mut child = Command::new(common::memfit_bin())
        .args([
            "train",
            "--data",
            root,
            "--image-size",
            "8",
            "--base-width",
            "4",
            "--epochs",
            "1",
            "--batch-size",
            "2",
            "--val-fraction",
            "0",
            "--no-augment",
            "--workers",
            "0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Opening the FIFO would block forever: fail instead of hanging CI.
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("the run hung (did it open the FIFO?)");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the run failed:\n{err}");
    assert_no_panic("left-out run", &err);
    assert!(
        err.contains("extra.webp: a format memfit cannot decode"),
        "{err}"
    );
    assert!(
        err.contains("old.BMP: a format memfit cannot decode"),
        "{err}"
    );
    let n = if have_fifo { 3 } else { 2 };
    if have_fifo {
        assert!(err.contains("pipe.png: not a regular file"), "{err}");
    }
    assert!(
        err.contains(&format!("{n} file(s) under {root} left out")),
        "{err}"
    );
}

/// With 5 classes or fewer every label is in the top 5: the epoch line
/// says "n/a" instead of a meaningless 100%; with more it gives a number.
#[test]
fn top5_is_not_applicable_with_five_classes_or_fewer() {
    let run = |classes: &str| {
        let (code, out, err) = memfit(&[
            "train",
            "--data",
            "synthetic",
            "--classes",
            classes,
            "--train-size",
            "16",
            "--val-size",
            "16",
            "--image-size",
            "16",
            "--base-width",
            "4",
            "--batch-size",
            "8",
            "--epochs",
            "1",
        ]);
        assert_eq!(code, 0, "{err}");
        out
    };
    let few = run("3");
    assert!(few.contains("top-5 n/a"), "{few}");
    let many = run("8");
    assert!(
        !many.contains("top-5 n/a") && many.contains("top-5 "),
        "{many}"
    );
}

/// `--device` on every command that computes: a name that is no device is a
/// flag error listing the forms; `cuda` in a build without CUDA says how to
/// get it (with CUDA but no GPU: what is missing), never a panic.
#[test]
fn device_flags_name_what_is_wrong() {
    for sub in [
        &["train", "--steps", "1"][..],
        &["bench", "step", "--steps", "1"][..],
        &["bench", "max-batch", "--memory-budget", "1GiB"][..],
    ] {
        let mut args = sub.to_vec();
        args.extend(["--device", "gpu"]);
        assert_clean_error(&args, "unknown device 'gpu': use cpu, cuda, cuda:N");
        let mut args = sub.to_vec();
        args.extend(["--device", "cuda:1"]);
        let (code, _, err) = memfit(&args);
        assert_ne!(code, 0, "{args:?}");
        assert_no_panic(&format!("{args:?}"), &err);
        assert!(
            err.contains("this memfit build has no CUDA support: rebuild with --features cuda")
                || err.contains("CUDA"),
            "{args:?}: {err}"
        );
    }
    // The default (auto) and cpu train on the CPU.
    let (code, out, err) = memfit(&[
        "train",
        "--device",
        "cpu",
        "--data",
        "synthetic",
        "--train-size",
        "8",
        "--val-size",
        "4",
        "--image-size",
        "16",
        "--base-width",
        "4",
        "--batch-size",
        "4",
        "--steps",
        "1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("epoch 1"), "{out}");
}
