//! A newcomer's first hour loses nothing and prints nothing misleading
//! (issue 28): metrics survive `kill -9` and a resumed run writes each step
//! once; `eval` scores a whole folder at the size the weights were trained
//! at; the default learning rate follows the linear scaling rule and says
//! so; synthetic labels follow `--num-classes`; bad `--resume` files, zero
//! epochs and Ctrl-C say the right thing. Each through the binary.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{TempDir, assert_no_panic, memfit};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// A tiny synthetic run's data and model flags (16 px gratings, width 8).
const SMALL: [&str; 10] = [
    "--data",
    "synthetic",
    "--train-size",
    "32",
    "--val-size",
    "8",
    "--image-size",
    "16",
    "--base-width",
    "8",
];

/// `sub` with [`SMALL`] and `extra`: (exit code, stdout, stderr).
fn small(sub: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![sub];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(extra);
    memfit(&args)
}

/// The optimizer steps of the step rows of a JSONL metrics file, in order.
fn jsonl_steps(text: &str) -> (Vec<u64>, usize) {
    let (mut steps, mut evals) = (Vec::new(), 0);
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| {
            panic!("not JSON ({e}): {line}");
        });
        if v.get("val_loss").is_some() {
            evals += 1;
        } else {
            steps.push(v["step"].as_u64().unwrap());
        }
    }
    (steps, evals)
}

/// The same of a CSV metrics file (a row with an empty loss column is an
/// evaluation's); every row has the header's columns.
fn csv_steps(text: &str) -> (Vec<u64>, usize) {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("a header").split(',').collect();
    let loss = header.iter().position(|c| *c == "loss").unwrap();
    let (mut steps, mut evals) = (Vec::new(), 0);
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells.len(), header.len(), "{line}");
        if cells[loss].is_empty() {
            evals += 1;
        } else {
            steps.push(cells[0].parse().unwrap());
        }
    }
    (steps, evals)
}

/// `kill -9` in the middle of a run: the metrics rows written so far are
/// on disk (they were flushed), and the resumed run drops the rows after
/// its checkpoint before training those steps again, so each of the 40
/// steps is in both files exactly once, with the one evaluation at the end.
#[test]
fn metrics_survive_kill_9_and_a_resumed_run_writes_each_step_once() {
    let t = TempDir::new("kill9-metrics");
    let (save, jsonl, csv) = (t.0.join("run"), t.0.join("m.jsonl"), t.0.join("m.csv"));
    let flags: Vec<String> = [
        "train",
        "--steps",
        "40",
        "--batch-size",
        "16",
        "--base-width",
        "8",
        "--save-dir",
        save.to_str().unwrap(),
        "--save-every-steps",
        "3",
        "--metrics-jsonl",
        jsonl.to_str().unwrap(),
        "--metrics-csv",
        csv.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let mut child = Command::new(common::memfit_bin())
        .args(&flags)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run memfit");
    // Kill once 5 rows and a checkpoint are on disk: rows only a buffer
    // held would be lost by the kill.
    let start = Instant::now();
    loop {
        let rows = std::fs::read_to_string(&jsonl).map_or(0, |s| s.lines().count());
        let ckpt = std::fs::read_dir(&save).is_ok_and(|d| d.count() > 0);
        if rows >= 5 && ckpt {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before 5 metrics rows reached the disk");
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "fewer than 5 metrics rows on disk after 120 s: rows are not flushed as written"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().expect("kill -9");
    child.wait().unwrap();
    let (killed_steps, _) = jsonl_steps(&std::fs::read_to_string(&jsonl).unwrap());
    assert!(killed_steps.len() >= 5, "{killed_steps:?}");

    let mut resume: Vec<&str> = flags.iter().map(String::as_str).collect();
    resume.extend(["--resume", save.to_str().unwrap()]);
    let (code, out, err) = memfit(&resume);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.contains("resuming from"), "{out}");
    let want: Vec<u64> = (1..=40).collect();
    let (steps, evals) = jsonl_steps(&std::fs::read_to_string(&jsonl).unwrap());
    assert_eq!(steps, want, "JSONL step rows after the resume");
    assert_eq!(evals, 1);
    let (steps, evals) = csv_steps(&std::fs::read_to_string(&csv).unwrap());
    assert_eq!(steps, want, "CSV step rows after the resume");
    assert_eq!(evals, 1);
}

/// The "N images: loss L, top-1 T%" line of `eval`.
fn result_line(out: &str) -> &str {
    out.lines()
        .find(|l| l.contains(" images: loss "))
        .unwrap_or_else(|| panic!("no result line in:\n{out}"))
}

/// `eval --data DIR` scores every image of DIR (the hold-out is a `train`
/// notion), at the image size and with the transform the weights were
/// trained with when `--image-size` is not given; `--val-data DIR` alone
/// is the same folder.
#[test]
fn eval_scores_the_whole_folder_at_the_weights_training_size() {
    let t = TempDir::new("eval-folder");
    let w = t.0.join("w.safetensors");
    let train = fixture("photos/train");
    let train_s = train.to_str().unwrap();
    let (code, _, err) = memfit(&[
        "train",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--data",
        train_s,
        "--val-fraction",
        "0",
        "--image-size",
        "32",
        "--base-width",
        "8",
        "--save-weights",
        w.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    let ws = w.to_str().unwrap();
    let eval = |extra: &[&str]| {
        let mut args = vec!["eval", "--weights", ws];
        args.extend_from_slice(extra);
        let (code, out, err) = memfit(&args);
        assert_eq!(code, 0, "{args:?}: stderr:\n{err}");
        out
    };
    let plain = eval(&["--data", train_s]);
    // All 9 photos of the folder, not a 20% hold-out of it.
    assert!(result_line(&plain).starts_with("9 images:"), "{plain}");
    assert!(
        plain.contains("at 32x32 (the size it was trained at)"),
        "{plain}"
    );
    let explicit = eval(&["--data", train_s, "--image-size", "32"]);
    assert_eq!(result_line(&plain), result_line(&explicit));
    let val_only = eval(&["--val-data", train_s]);
    assert_eq!(result_line(&plain), result_line(&val_only));
    // At another size the model sees other inputs: another loss.
    let at_64 = eval(&["--data", train_s, "--image-size", "64"]);
    assert_ne!(result_line(&plain), result_line(&at_64));
    // The weights say what they were trained on.
    let bytes = std::fs::read(&w).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let meta = &header["__metadata__"];
    assert_eq!(meta["memfit_image_size"], "32");
    assert_eq!(meta["memfit_eval_resize"], "36");
    assert_eq!(meta["memfit_normalize_mean"], "[0.485,0.456,0.406]");
    assert_eq!(meta["memfit_normalize_std"], "[0.229,0.224,0.225]");
}

/// The line a train run prints about its learning rate.
fn lr_line(out: &str) -> &str {
    out.lines()
        .find(|l| l.starts_with("lr "))
        .unwrap_or_else(|| panic!("no lr line in:\n{out}"))
}

/// Without `--lr`, SGD takes 0.1 per 256 images of the batch (the
/// reference recipe's linear scaling rule, whatever the micro-batch) and
/// says so; `--lr` overrides and says that; the rate is the one trained
/// with (the metrics' `lr` of a constant schedule).
#[test]
fn the_default_lr_follows_the_linear_scaling_rule_and_says_so() {
    let t = TempDir::new("default-lr");
    let m = t.0.join("m.jsonl");
    let run = |extra: &[&str]| {
        let mut args = vec!["--steps", "1", "--schedule", "constant"];
        args.extend_from_slice(extra);
        let (code, out, err) = small("train", &args);
        assert_eq!(code, 0, "{args:?}: stderr:\n{err}");
        out
    };
    let out = run(&[
        "--batch-size",
        "16",
        "--micro-batch",
        "4",
        "--metrics-jsonl",
        m.to_str().unwrap(),
    ]);
    assert_eq!(
        lr_line(&out),
        "lr 0.00625 = 0.1 x batch 16 / 256 (the linear scaling rule; --lr overrides)"
    );
    let row: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&m).unwrap().lines().next().unwrap()).unwrap();
    assert_eq!(row["lr"].as_f64().unwrap() as f32, 0.00625);
    let out = run(&["--batch-size", "16", "--lr", "0.3"]);
    assert_eq!(lr_line(&out), "lr 0.3 (--lr)");
    let out = run(&["--batch-size", "8", "--optimizer", "adamw"]);
    assert_eq!(lr_line(&out), "lr 0.001 (AdamW's default; --lr overrides)");
}

/// Large batches: above 0.1 the scaled rate warms up (5 epochs, at most a
/// quarter of the run), unless --warmup-epochs says otherwise.
#[test]
fn a_scaled_lr_above_a_tenth_warms_up() {
    use memfit::optim::OptimizerKind;
    use memfit::run::default_lr;
    let c = default_lr(OptimizerKind::Sgd, 1024, 90, None, None);
    assert_eq!((c.lr, c.warmup_epochs), (0.4, 5));
    assert!(c.why.contains("warmed up over 5 epochs"), "{}", c.why);
    assert_eq!(
        default_lr(OptimizerKind::Sgd, 1024, 8, None, None).warmup_epochs,
        2
    );
    assert_eq!(
        default_lr(OptimizerKind::Sgd, 1024, 90, None, Some(0)).warmup_epochs,
        0
    );
    assert_eq!(
        default_lr(OptimizerKind::Sgd, 256, 90, None, None).warmup_epochs,
        0
    );
    assert_eq!(
        default_lr(OptimizerKind::Sgd, 1024, 90, Some(0.1), None).warmup_epochs,
        0
    );
}

/// `--data synthetic --num-classes 5` makes 5 classes of gratings; a head
/// too small for a real dataset names the dataset's class count.
#[test]
fn synthetic_labels_follow_num_classes() {
    let (code, out, err) = small(
        "train",
        &["--num-classes", "5", "--batch-size", "8", "--steps", "1"],
    );
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.contains(": 5 classes,"), "{out}");
    let (code, _, err) = memfit(&["plan", "--num-classes", "5"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("5 classes are too few: the dataset has 10 classes (labels 0 to 9)"),
        "{err}"
    );
}

/// `--resume` of a weights file is refused before anything is planned or
/// printed; `--epochs 0` is refused; `plan` says it plans.
#[test]
fn refusals_come_before_any_report_and_plan_says_it_plans() {
    let t = TempDir::new("resume-weights");
    let w = t.0.join("w.safetensors");
    let with = |sub: &str, extra: &[&str]| {
        let mut args = vec!["--batch-size", "8"];
        args.extend_from_slice(extra);
        small(sub, &args)
    };
    let (code, _, err) = with(
        "train",
        &["--steps", "1", "--save-weights", w.to_str().unwrap()],
    );
    assert_eq!(code, 0, "stderr:\n{err}");
    for sub in ["train", "plan"] {
        let (code, out, err) = with(sub, &["--resume", w.to_str().unwrap()]);
        assert_ne!(code, 0, "{sub}: {out}");
        assert!(
            err.contains("is a weights file, not a training checkpoint"),
            "{sub}: {err}"
        );
        assert_eq!(out, "", "{sub} printed before refusing");
        assert_no_panic(sub, &err);
    }
    // Nothing to score is said before the weights are read.
    let (code, _, err) = memfit(&[
        "eval",
        "--weights",
        w.to_str().unwrap(),
        "--val-fraction",
        "0",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("no images to evaluate in the digits validation split"),
        "{err}"
    );
    let (code, out, err) = with("train", &["--epochs", "0"]);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("--epochs must be at least 1"), "{err}");
    assert_eq!(out, "");
    let (code, out, err) = with("plan", &[]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.starts_with("planning resnet18 "), "{out}");
}

/// A flag given on resume that the saved run did not set reads as such,
/// not "(the saved run's (not set))".
#[test]
fn resume_notes_name_a_flag_the_saved_run_did_not_set() {
    let saved = BTreeMap::from([("lr".to_string(), "0.1".to_string())]);
    let now = BTreeMap::from([
        ("lr".to_string(), "0.1".to_string()),
        ("steps".to_string(), "30".to_string()),
        ("clip-grad-norm".to_string(), "1".to_string()),
    ]);
    let given = BTreeSet::from(["steps".to_string()]);
    let merged = memfit::run::merge_resumed_flags(&saved, &now, &given).unwrap();
    assert_eq!(
        merged.notes,
        ["--steps 30 (the saved run did not set it): accepted, it may change on resume"]
    );
    let given = BTreeSet::from(["clip-grad-norm".to_string()]);
    let err = memfit::run::merge_resumed_flags(&saved, &now, &given)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("--clip-grad-norm 1: the saved run did not set it;"),
        "{err}"
    );
    assert!(!err.contains("(not set)"), "{err}");
}

/// tools/plot_metrics.py keeps every loss label inside the image, beside
/// the rotated axis title, however large the loss (a diverged run's).
#[test]
fn plot_metrics_fits_large_loss_labels() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: no python3");
        return;
    }
    let t = TempDir::new("plot");
    let m = t.write(
        "m.jsonl",
        b"{\"step\":1,\"epoch\":1,\"loss\":123456.7}\n\
          {\"epoch\":1,\"step\":1,\"val_loss\":234567.8,\"val_top1\":0.1,\"val_top5\":null}\n\
          {\"step\":2,\"epoch\":2,\"loss\":2.5}\n",
    );
    let svg = t.0.join("m.svg");
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/plot_metrics.py"))
        .args([&m, &svg])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&svg).unwrap();
    let mut labels = 0;
    for l in text.lines().filter(|l| l.contains("text-anchor=\"end\"")) {
        let x: f64 = l
            .split("x=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let label = l.split('>').nth(1).unwrap().split('<').next().unwrap();
        // 8 px a character of the 13 px font, clear of the axis title,
        // whose rotated glyphs reach x = 18 + 9.
        assert!(
            x - 8.0 * label.len() as f64 >= 28.0,
            "{label} at x={x} is clipped"
        );
        labels += 1;
    }
    assert_eq!(labels, 6);
}
