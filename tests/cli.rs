//! The binary end to end: the README's main command (shortened), and clear
//! errors for bad input with no panic or backtrace reaching the user.

mod common;

use std::process::Command;

use common::{assert_clean_error, assert_no_panic, memfit};

/// The number after `key` in `s`, up to the next ',' or '%'.
fn field(s: &str, key: &str) -> Option<String> {
    s.split(key)
        .nth(1)
        .and_then(|t| t.split([',', '%']).next())
        .map(str::to_string)
}

/// `memfit eval`'s loss and top-1 equal those of a train epoch line.
#[track_caller]
fn assert_eval_matches_val(eval_out: &str, val_line: &str) {
    for (eval_key, val_key) in [("top-1 ", "val top-1 "), ("loss ", "val loss ")] {
        assert_eq!(
            field(eval_out, eval_key),
            field(val_line, val_key),
            "{eval_out} vs {val_line}"
        );
    }
}

#[test]
fn train_runs_and_learns_on_the_embedded_digits() {
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
    assert!(
        out.contains("tracked peak") && out.contains("val top-1"),
        "{out}"
    );
    // The default data is the embedded digits; after two epochs the loss is
    // well below chance level (ln 10 = 2.30).
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
fn train_on_synthetic_writes_metrics_and_weights_that_eval_reads() {
    let dir = std::env::temp_dir().join(format!("memfit-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (metrics, weights) = (dir.join("m.jsonl"), dir.join("w.safetensors"));
    let (code, out, err) = memfit(&[
        "train",
        "--data",
        "synthetic",
        "--train-size",
        "128",
        "--val-size",
        "64",
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--base-width",
        "8",
        "--classes",
        "4",
        "--metrics-jsonl",
        metrics.to_str().unwrap(),
        "--save-weights",
        weights.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    let text = std::fs::read_to_string(&metrics).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // 128 / 32 = 4 steps per epoch, 2 epochs, plus 2 evaluations.
    assert_eq!(
        lines.iter().filter(|l| l.contains("\"loss\"")).count(),
        8,
        "{text}"
    );
    assert_eq!(
        lines.iter().filter(|l| l.contains("\"val_top1\"")).count(),
        2,
        "{text}"
    );
    assert!(
        lines[0].starts_with("{\"step\":1,\"epoch\":1,")
            && lines[0].contains("\"peak_activations_bytes\":")
    );
    let val_line = out
        .lines()
        .rfind(|l| l.contains("val top-1"))
        .unwrap()
        .to_string();
    let (code, eval_out, err) = memfit(&[
        "eval",
        "--data",
        "synthetic",
        "--val-size",
        "64",
        "--base-width",
        "8",
        "--classes",
        "4",
        "--weights",
        weights.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    // Same validation set and weights: the same top-1 as the last epoch.
    assert_eval_matches_val(&eval_out, &val_line);
    std::fs::remove_dir_all(&dir).ok();
}

/// `memfit bench step` on a tiny ResNet-18 (base width 8, 32×32, 10
/// classes), followed by `extra` (batch size, steps, flags).
fn tiny_bench_step(extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "bench",
        "step",
        "--model",
        "resnet18",
        "--base-width",
        "8",
        "--image-size",
        "32",
        "--num-classes",
        "10",
    ];
    args.extend_from_slice(extra);
    memfit(&args)
}

#[test]
fn bench_step_reports_time_and_memory() {
    let (code, out, err) = tiny_bench_step(&["--batch-size", "4", "--steps", "2"]);
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
fn bf16_says_when_its_gemms_are_emulated() {
    let run = |precision| {
        tiny_bench_step(&[
            "--batch-size",
            "2",
            "--steps",
            "1",
            "--precision",
            precision,
        ])
    };
    let note = "bf16 GEMMs run as f32 products";
    let native = memfit::device::cpu::bf16_gemm_available();
    let (code, _, err) = run("bf16");
    assert_eq!(code, 0, "stderr:\n{err}");
    // The note appears exactly where this CPU has no bf16 dot products.
    assert_eq!(
        err.contains(note),
        !native,
        "native bf16: {native}; stderr:\n{err}"
    );
    let (code, _, err) = run("fp32");
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(!err.contains(note), "fp32 run:\n{err}");
}

#[test]
fn bench_step_profile_splits_time_by_op_family() {
    let (code, out, err) = tiny_bench_step(&["--batch-size", "4", "--steps", "1", "--profile"]);
    assert_eq!(code, 0, "stderr:\n{err}");
    for family in [
        "conv fwd",
        "conv dgrad",
        "conv wgrad",
        "batch norm",
        "other",
    ] {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("| {family}")))
            .unwrap_or_else(|| panic!("no {family} row:\n{out}"));
        // Every convolution pass did work, so its GFLOP/s column is a number.
        if family.starts_with("conv") {
            let rate: f64 = line.split('|').nth(4).unwrap().trim().parse().unwrap();
            assert!(rate > 0.0, "{line}");
        }
    }
}

#[test]
fn bad_inputs_give_clear_errors() {
    assert_clean_error(
        &["train", "--memory-budget", "lots"],
        "'lots' is not a size",
    );
    // The planner refuses a budget the plan cannot fit before training starts.
    assert_clean_error(
        &["train", "--memory-budget", "1MB"],
        "needs 17.82 MiB but the budget is 976.56 KiB",
    );
    assert_clean_error(
        &["train", "--precision", "int8"],
        "unknown precision 'int8'",
    );
    assert_clean_error(
        &["train", "--model", "resnet51"],
        "unknown model 'resnet51'",
    );
    assert_clean_error(
        &["train", "--batch-size", "0", "--epochs", "1"],
        "--batch-size must be at least 1",
    );
    assert_clean_error(&["train", "--image-size", "1"], "too small");
    assert_clean_error(&["bench", "step", "--batch-size", "0"], "at least 1");
    assert_clean_error(&["train", "--no-such-flag"], "unexpected argument");
    assert_clean_error(
        &["train", "--data", "imagenet"],
        "unknown dataset 'imagenet'",
    );
    assert_clean_error(
        &["eval", "--weights", "/nonexistent/w.safetensors"],
        "/nonexistent/w.safetensors",
    );
}

/// The measured peak of a real (short) run under a budgeted auto plan is the
/// predicted one, and it stays within the budget.
#[test]
fn train_with_auto_plan_meets_its_prediction_and_budget() {
    let base = [
        "--threads",
        "2",
        "train",
        "--epochs",
        "1",
        "--data",
        "synthetic",
        "--train-size",
        "64",
        "--val-size",
        "16",
        "--batch-size",
        "32",
        "--base-width",
        "8",
    ];
    let mut args = base.to_vec();
    args.extend(["--checkpoint", "auto", "--memory-budget", "9MiB"]);
    let (code, out, err) = memfit(&args);
    assert_eq!(code, 0, "stderr:\n{err}\nstdout:\n{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("predicted peak"))
        .unwrap_or_else(|| panic!("no prediction line:\n{out}"));
    assert!(line.contains("(+0.00%)"), "{line}");
    // The pool holds from the system what the simulation said, within the
    // budget.
    let (predicted, measured) = common::reserved_figures(line);
    assert_eq!(predicted, measured, "{line}");
    let reserved_mib: f64 = measured.trim_end_matches(" MiB").parse().unwrap();
    assert!(reserved_mib <= 9.0, "{line}");
    let plan = out.lines().find(|l| l.starts_with("plan:")).unwrap();
    assert!(plan.contains("recompute") || plan.contains("x 2"), "{plan}");

    // A budget far below parameters + gradients + momentum is refused up
    // front with the size that would fit.
    let mut args = base.to_vec();
    args.extend(["--checkpoint", "auto", "--memory-budget", "1MiB"]);
    assert_clean_error(&args, "smallest plan needs");
    let mut args = base.to_vec();
    args.extend(["--checkpoint", "sometimes"]);
    assert_clean_error(&args, "segments:K");
    let mut args = base.to_vec();
    args.extend(["--memory-budget", "lots"]);
    assert_clean_error(&args, "--memory-budget");
}

#[test]
fn plan_prints_stages_and_predicted_categories() {
    let (code, out, err) = memfit(&[
        "plan",
        "--data",
        "synthetic",
        "--batch-size",
        "64",
        "--micro-batch",
        "16",
        "--checkpoint",
        "stages:layer1,layer3",
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.contains("micro-batch 16 x 4"), "{out}");
    let layer1 = out.lines().find(|l| l.starts_with("layer1.0")).unwrap();
    assert!(layer1.contains("checkpoint input"), "{layer1}");
    let layer2 = out.lines().find(|l| l.starts_with("layer2.0")).unwrap();
    assert!(layer2.ends_with("keep"), "{layer2}");
    for cat in [
        "params",
        "grads",
        "optimizer",
        "activations",
        "workspace",
        "data",
    ] {
        assert!(
            out.lines().any(|l| l.trim_start().starts_with(cat)),
            "{cat}:\n{out}"
        );
    }
}

#[test]
fn bench_strategies_tables_every_strategy_with_its_prediction() {
    let csv = std::env::temp_dir().join(format!("memfit-strategies-{}.csv", std::process::id()));
    // A PyTorch baseline for this configuration, in resnet_mem.py's format.
    let baseline =
        std::env::temp_dir().join(format!("memfit-baseline-{}.jsonl", std::process::id()));
    let run = |strategy: &str, secs: f64, peak: f64| {
        format!(
            r#"{{"strategy": "{strategy}", "tag": "grid", "res": 96, "batch": 4, "micro_batch": 4, "s_per_step_median": {secs}, "timed_other_cpu_frac": 0.0, "alloc_peak_step_MB": {peak}, "params_grads_momentum_MB": 1.0, "torch": "2.15.0"}}"#
        )
    };
    std::fs::write(
        &baseline,
        [run("plain", 2.0, 9.0), run("ckpt-seq-2", 2.5, 4.0)].join("\n"),
    )
    .unwrap();
    let (code, out, err) = memfit(&[
        "--threads",
        "2",
        "bench",
        "strategies",
        "--model",
        "resnet18",
        "--base-width",
        "4",
        "--num-classes",
        "10",
        "--image-size",
        "96",
        "--batch-size",
        "4",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--csv",
        csv.to_str().unwrap(),
        "--pytorch-results",
        baseline.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.contains("1 timed step(s) each, 2 round(s)"), "{out}");
    assert!(err.contains("running none (round 2 of 2)"), "{err}");
    let (ours, theirs) = out.split_once("\nPyTorch 2.15.0").expect("PyTorch rows");
    // PyTorch's rows: its own ratios against its plain run.
    assert!(
        theirs.contains("| plain | none | 4 | 10.00 MiB | 1.00 | 2.000 | 1.00 | 1/1 |"),
        "{theirs}"
    );
    assert!(
        theirs.contains("| ckpt-seq-2 | segments:2 | 4 | 5.00 MiB | 0.50 | 2.500 | 1.25 | 1/1 |"),
        "{theirs}"
    );
    let rows: Vec<&str> = ours
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| strategy"))
        .collect();
    // 10 fixed rows plus the auto rows whose budget some plan fits.
    assert!((10..=13).contains(&rows.len()), "{out}");
    for name in [
        "| bf16 |",
        "| f16 |",
        "| precision auto |",
        "| BN+ReLU recompute |",
        "| auto @ 75% of none |",
    ] {
        assert!(out.contains(name), "missing {name}: {out}");
    }
    for row in &rows {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        // | strategy | plan | micro | precision | peak | act | mem ratio | s | time ratio | bound | predicted |
        assert_eq!(cells[5], cells[11], "measured vs predicted peak: {row}");
        // Only plans that recompute part of the forward get a time bound,
        // and it lies between 1.05 and 1.05 + 1/3 (at most the whole
        // forward of a 3-forward step is recomputed).
        let recomputes = cells[2].contains("recompute[");
        if recomputes {
            let bound: f64 = cells[10].split(' ').next().unwrap().parse().unwrap();
            assert!(bound > 1.05 && bound <= 1.05 + 1.0 / 3.0 + 1e-9, "{row}");
        } else {
            assert_eq!(cells[10], "-", "{row}");
        }
    }
    assert!(rows[0].contains("| 1.00 |"), "{}", rows[0]);
    let written = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(written.lines().count(), rows.len() + 3, "{written}");
    assert_eq!(
        written
            .lines()
            .filter(|l| l.starts_with("pytorch,"))
            .count(),
        2
    );
    std::fs::remove_file(&csv).ok();
    std::fs::remove_file(&baseline).ok();
}

#[test]
fn bench_max_batch_grows_with_recomputation() {
    let (code, out, err) = memfit(&[
        "bench",
        "max-batch",
        "--model",
        "resnet18",
        "--base-width",
        "8",
        "--num-classes",
        "10",
        "--image-size",
        "64",
        "--memory-budget",
        "64MiB",
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    let batch_at = |name: &str, precision: &str| -> usize {
        let row = out
            .lines()
            .find(|l| l.starts_with(&format!("| {name} | {precision} |")))
            .unwrap_or_else(|| panic!("no {name} row:\n{out}"));
        row.split('|').nth(3).unwrap().trim().parse().unwrap()
    };
    let batch = |name: &str| batch_at(name, "fp32");
    // Two-byte activations and BN+ReLU recompute fit more than no plan,
    // and auto more again; under auto, bf16 (two-byte activations and
    // activation gradients, no f32 copies) fits more than fp32. BN+ReLU
    // recompute on top of auto need not gain: once auto has recomputed what
    // it can, the peak is a block's backward, which the recomputed BN+ReLU
    // output adds to (and its blocks fragment the arena differently).
    assert!(batch_at("none", "bf16") > batch("none"), "{out}");
    assert!(batch("BN+ReLU recompute") > batch("none"), "{out}");
    assert!(
        batch_at("auto", "bf16") >= batch_at("none", "bf16"),
        "{out}"
    );
    assert!(batch_at("auto", "bf16") > batch("auto"), "{out}");
    assert!(
        batch_at("auto + BN+ReLU recompute", "bf16") > batch("auto + BN+ReLU recompute"),
        "{out}"
    );
    // Every row's pool stays within the budget, free blocks included: a
    // batch whose buffers fragment the arena past it does not fit.
    for row in out
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| strategy"))
    {
        let reserved = row.split('|').nth(5).unwrap().trim();
        let mib: f64 = reserved.trim_end_matches(" MiB").parse().unwrap();
        assert!(mib <= 64.0, "{row}");
    }
    let none = batch("none");
    assert!(none > 0, "{out}");
    for s in [
        "segments:2",
        "segments:4",
        "segments:8",
        "stages:layer1,layer2,layer4",
    ] {
        assert!(batch(s) >= none, "{s}:\n{out}");
        assert!(batch("auto") >= batch(s), "auto vs {s}:\n{out}");
    }
    assert!(batch("segments:4") > none, "{out}");
}

#[test]
fn steps_stop_training_after_that_many_optimizer_steps() {
    let metrics = std::env::temp_dir().join(format!("memfit-steps-{}.jsonl", std::process::id()));
    std::fs::remove_file(&metrics).ok();
    let (code, out, err) = memfit(&[
        "--threads",
        "2",
        "train",
        "--data",
        "synthetic",
        "--train-size",
        "64",
        "--val-size",
        "16",
        "--batch-size",
        "16",
        "--base-width",
        "4",
        "--steps",
        "6",
        "--num-classes",
        "8",
        "--metrics-jsonl",
        metrics.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    // 4 steps per epoch: epoch 1 and a partial epoch 2, then stop.
    assert!(
        out.contains("epoch 2:") && !out.contains("epoch 3:"),
        "{out}"
    );
    let text = std::fs::read_to_string(&metrics).unwrap();
    let steps = text.lines().filter(|l| l.contains("\"loss\"")).count();
    assert_eq!(steps, 6, "{text}");
    std::fs::remove_file(&metrics).ok();
    assert_clean_error(
        &["train", "--num-classes", "3"],
        "3 classes are too few: the dataset has 10 classes",
    );
    assert_clean_error(&["train", "--steps", "0"], "--steps must be at least 1");
}

fn fixture(rel: &str) -> String {
    format!("{}/tests/fixtures/{rel}", env!("CARGO_MANIFEST_DIR"))
}

/// Real photos end to end (`tools/make_photo_fixtures.py`): a few steps on
/// an image folder with a separate validation folder, then `eval` of the
/// saved weights gives the last epoch's validation numbers.
#[test]
fn train_and_eval_on_an_image_folder() {
    let dir = std::env::temp_dir().join(format!("memfit-cli-folder-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let weights = dir.join("w.safetensors");
    let (train, val) = (fixture("photos/train"), fixture("photos/val"));
    let data_flags = [
        "--data",
        &train,
        "--val-data",
        &val,
        "--image-size",
        "32",
        "--base-width",
        "8",
    ];
    let mut args = vec![
        "--threads",
        "2",
        "train",
        "--steps",
        "2",
        "--batch-size",
        "4",
    ];
    args.extend(data_flags);
    args.extend(["--save-weights", weights.to_str().unwrap()]);
    let (code, out, err) = memfit(&args);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(
        out.contains("3 classes, 9 train / 4 val images at 32x32"),
        "{out}"
    );
    let val_line = out
        .lines()
        .rfind(|l| l.starts_with("epoch 1:") && l.contains("val top-1"))
        .unwrap_or_else(|| panic!("{out}"))
        .to_string();
    assert!(!out.contains("skipped"), "{out}");

    let mut args = vec!["eval", "--weights", weights.to_str().unwrap()];
    args.extend(data_flags);
    let (code, eval_out, err) = memfit(&args);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(
        eval_out.lines().any(|l| l.starts_with("4 images: ")),
        "{eval_out}"
    );
    assert_eval_matches_val(&eval_out, &val_line);
    std::fs::remove_dir_all(&dir).ok();
}

/// The metrics of a folder run do not depend on --workers.
#[test]
fn image_folder_runs_are_identical_for_any_worker_count() {
    let dir = std::env::temp_dir().join(format!("memfit-cli-workers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let train = fixture("photos/train");
    let run = |workers: &str| {
        let metrics = dir.join(format!("m{workers}.jsonl"));
        let (code, _, err) = memfit(&[
            "--threads",
            "2",
            "train",
            "--data",
            &train,
            "--val-fraction",
            "0.34",
            "--image-size",
            "32",
            "--base-width",
            "8",
            "--epochs",
            "2",
            "--batch-size",
            "3",
            "--workers",
            workers,
            "--metrics-jsonl",
            metrics.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "stderr:\n{err}");
        // Everything but the timing.
        std::fs::read_to_string(&metrics)
            .unwrap()
            .lines()
            .map(|l| {
                l.split(',')
                    .filter(|f| !f.starts_with("\"img_per_s\""))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect::<Vec<_>>()
    };
    let reference = run("0");
    // 9 images, 3 held out: 6 / 3 = 2 steps per epoch, plus an evaluation.
    assert_eq!(reference.len(), 6, "{reference:?}");
    assert_eq!(run("1"), reference);
    assert_eq!(run("3"), reference);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn unreadable_files_are_skipped_with_a_warning_and_a_count() {
    let (code, out, err) = memfit(&[
        "--threads",
        "2",
        "train",
        "--data",
        &fixture("photos_corrupt"),
        "--val-fraction",
        "0",
        "--image-size",
        "32",
        "--base-width",
        "8",
        "--epochs",
        "2",
        "--batch-size",
        "2",
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    let warning = format!(
        "warning: skipping {}: bad JPEG",
        fixture("photos_corrupt/cat/truncated.jpg")
    );
    assert_eq!(err.matches(&warning).count(), 2, "{err}");
    assert_eq!(
        out.matches("skipped 1 unreadable files").count(),
        2,
        "{out}"
    );
    assert!(out.contains("3 train / 0 val images"), "{out}");
}

#[test]
fn bad_image_folders_give_clear_errors() {
    let empty = std::env::temp_dir().join(format!("memfit-cli-empty-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    assert_clean_error(
        &["train", "--data", empty.to_str().unwrap()],
        "no class folders found",
    );
    std::fs::remove_dir_all(&empty).ok();
    assert_clean_error(
        &[
            "train",
            "--data",
            &fixture("photos/train"),
            "--val-data",
            &fixture("photos_corrupt"),
        ],
        "differ from those of",
    );
    assert_clean_error(
        &["train", "--val-data", &fixture("photos/val")],
        "--val-data needs an image folder as --data",
    );
    assert_clean_error(
        &[
            "eval",
            "--weights",
            "/nonexistent/w.safetensors",
            "--data",
            &fixture("photos/train"),
        ],
        "/nonexistent/w.safetensors: No such file or directory",
    );
}

/// Mixed precision end to end: f16 trains with the loss scaler (its state
/// in the metrics), bf16 without, and `plan` reports the precision.
#[test]
fn mixed_precision_trains_and_reports_its_scaler() {
    let dir = std::env::temp_dir().join(format!("memfit_cli_mp_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = dir.join("f16.jsonl");
    let m = metrics.to_str().unwrap();
    let (code, out, err) = memfit(&[
        "train",
        "--steps",
        "2",
        "--batch-size",
        "32",
        "--precision",
        "f16",
        "--scaler-init",
        "256",
        "--metrics-jsonl",
        m,
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.contains("f16"), "{out}");
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(text.contains("\"scale\":256,"), "{text}");
    let (code, out, err) = memfit(&["plan", "--precision", "bf16", "--recompute-bn-relu"]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(
        out.contains("bf16") && out.contains("BN+ReLU outputs are recomputed"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--config FILE.toml` supplies flags; the command line overrides them;
/// unknown keys and unsupported values are clear errors.
#[test]
fn a_toml_config_supplies_flags_that_the_command_line_overrides() {
    let dir = std::env::temp_dir().join(format!("memfit_cli_cfg_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("run.toml");
    std::fs::write(
        &cfg,
        "batch_size = 32\nsteps = 2\nlr = 0.02\nnesterov = true\n",
    )
    .unwrap();
    let c = cfg.to_str().unwrap();
    let (code, out, err) = memfit(&["plan", "--config", c]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.contains("= batch 32"), "{out}");
    let (code, out, err) = memfit(&["plan", "--config", c, "--batch-size", "8"]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.contains("= batch 8"), "the command line wins: {out}");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "bach_size = 32\n").unwrap();
    assert_clean_error(
        &["train", "--config", bad.to_str().unwrap()],
        "unknown key 'bach_size'",
    );
    std::fs::write(&bad, "lr = [0.1]\n").unwrap();
    assert_clean_error(
        &["train", "--config", bad.to_str().unwrap()],
        "holds a value of type array",
    );
    std::fs::write(&bad, "lr = \n").unwrap();
    assert_clean_error(
        &["train", "--config", bad.to_str().unwrap()],
        "not valid TOML",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A real SIGTERM: the run saves the step it was on and exits 1 saying how
/// to resume; resuming with the same flags finishes the run.
#[test]
fn sigterm_saves_a_checkpoint_and_the_run_resumes() {
    let dir = std::env::temp_dir().join(format!("memfit_cli_sig_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let save = dir.to_str().unwrap().to_string();
    let flags = [
        "train",
        "--steps",
        "400",
        "--batch-size",
        "16",
        "--save-dir",
        &save,
        "--save-every-steps",
        "1",
    ];
    let child = Command::new(common::memfit_bin())
        .args(flags)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run memfit");
    // Wait for the first checkpoint, so the signal lands mid-training.
    let start = std::time::Instant::now();
    while !dir.join("ckpt-00000001.safetensors").exists() {
        assert!(start.elapsed().as_secs() < 60, "no checkpoint within 60 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr:\n{err}");
    assert!(
        err.contains("interrupted after optimizer step") && err.contains("--resume"),
        "{err}"
    );
    assert_no_panic("SIGTERM", &err);
    // Not an "error:" but the whole command that continues the run: this
    // command line with --resume and the saved state.
    assert!(!err.contains("error:"), "{err}");
    let command = err
        .lines()
        .find_map(|l| l.strip_prefix("to resume: "))
        .unwrap_or_else(|| panic!("no resume command in:\n{err}"));
    let words: Vec<&str> = command.split(' ').collect();
    assert_eq!(
        words[0],
        common::memfit_bin().to_str().unwrap(),
        "{command}"
    );
    assert_eq!(words[1..words.len() - 2], flags, "{command}");
    assert_eq!(words[words.len() - 2], "--resume", "{command}");
    let state = words[words.len() - 1];
    assert!(
        state.starts_with(&save) && std::path::Path::new(state).is_file(),
        "{command}"
    );
    let (code, out, err) = memfit(&words[1..]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.contains("resuming from"), "{out}");
    assert!(out.contains("trained in"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--model resnet50` is torchvision's ResNet-50 on every dataset but the
/// embedded digits, with no --base-width; the default digits run keeps its
/// narrow network, and `eval` reads its weights with no --base-width too.
#[test]
fn base_width_defaults_to_torchvisions_except_on_the_digits() {
    let (code, out, err) = memfit(&[
        "plan",
        "--model",
        "resnet50",
        "--data",
        "synthetic",
        "--num-classes",
        "1000",
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(
        out.contains("(base width 64, ImageNet stem, 25557032 parameters)"),
        "{out}"
    );
    // The default run: ResNet-18 at width 16 on the digits, as before.
    let (code, out, err) = memfit(&["plan"]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(
        out.starts_with(
            "planning resnet18 (base width 16, ImageNet stem, 703386 parameters) on digits"
        ),
        "{out}"
    );
    // An explicit width still wins.
    let (code, out, err) = memfit(&["plan", "--data", "synthetic", "--base-width", "8"]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(out.contains("(base width 8,"), "{out}");

    let dir = std::env::temp_dir().join(format!("memfit_cli_width_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let weights = dir.join("w.safetensors");
    let w = weights.to_str().unwrap();
    let (code, out, err) = memfit(&[
        "--threads",
        "2",
        "train",
        "--steps",
        "1",
        "--batch-size",
        "16",
        "--save-weights",
        w,
    ]);
    assert_eq!(code, 0, "stderr:\n{err}");
    let val_line = out.lines().find(|l| l.contains("val top-1")).unwrap();
    let (code, eval_out, err) = memfit(&["--threads", "2", "eval", "--weights", w]);
    assert_eq!(code, 0, "stderr:\n{err}");
    assert_eval_matches_val(&eval_out, val_line);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `memfit … | head`: a reader that has gone ends the program quietly with
/// the shell's SIGPIPE status, not a panic (exit 101) and a backtrace. The
/// pipe's read end is closed before the program starts, so its first
/// write fails.
#[test]
fn a_closed_stdout_ends_the_program_quietly() {
    for args in [
        &["plan"][..],
        &[
            "bench",
            "max-batch",
            "--model",
            "resnet18",
            "--base-width",
            "8",
            "--image-size",
            "32",
            "--memory-budget",
            "64MiB",
        ][..],
        &[
            "bench",
            "step",
            "--model",
            "resnet18",
            "--base-width",
            "8",
            "--image-size",
            "32",
            "--num-classes",
            "10",
            "--batch-size",
            "2",
            "--steps",
            "1",
        ][..],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(common::memfit_bin())
            .args(args)
            .env("RUST_BACKTRACE", "1")
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .expect("run memfit");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_no_panic(&format!("{args:?} into a closed pipe"), &err);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_ne!(out.status.code(), Some(101), "{args:?}: {err}");
        assert_eq!(out.status.code(), Some(141), "{args:?}: {err}");
        assert!(err.is_empty(), "{args:?}: {err}");
    }
}

/// `--precision auto` weighs speed beside memory: with room for both,
/// bf16 where this CPU's bf16 arithmetic is modelled faster than fp32
/// (AMX or AVX512-BF16), else fp32; under a budget only bf16 fits, bf16.
/// The plan says which and why.
#[test]
fn precision_auto_chooses_by_modelled_speed_and_memory() {
    let plan = |budget: Option<&str>| {
        let mut args = vec![
            "plan",
            "--model",
            "resnet50",
            "--data",
            "synthetic",
            "--image-size",
            "64",
            "--batch-size",
            "32",
            "--time-model",
            "flops",
            "--precision",
            "auto",
        ];
        if let Some(b) = budget {
            args.extend(["--memory-budget", b]);
        }
        let (code, out, err) = memfit(&args);
        assert_eq!(code, 0, "stderr:\n{err}");
        out.lines()
            .find(|l| l.starts_with("precision auto: "))
            .unwrap_or_else(|| panic!("no precision line\n{out}"))
            .to_string()
    };
    let native = memfit::device::Device::Cpu.capabilities().native_bf16;
    let both = plan(None);
    let want = if native { "bf16" } else { "fp32" };
    assert!(
        both.starts_with(&format!(
            "precision auto: {want} (both fit; bf16 modelled at "
        )),
        "{both}"
    );
    assert!(both.contains(memfit::device::cpu::bf16_path()), "{both}");
    // fp32's peak is 484.77 MiB, bf16's 381.02 MiB.
    let tight = plan(Some("430MiB"));
    assert!(
        tight.starts_with("precision auto: bf16 (only bf16 fits;"),
        "{tight}"
    );
}
