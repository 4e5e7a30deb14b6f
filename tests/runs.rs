//! Runs own what they write, `--resume DIR` alone continues a run, and
//! weights say what they are (issue 20): each through the binary, checking
//! the message, the exit status, that nothing panicked and nothing was lost.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use common::{TempDir, assert_no_panic, memfit};

/// A small synthetic run: 32 images in batches of 8 (4 steps an epoch),
/// constant LR so a longer run repeats a shorter one's first steps.
fn run_flags(save_dir: &str, steps: &str) -> Vec<String> {
    [
        "train",
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
        "--batch-size",
        "8",
        "--schedule",
        "constant",
        "--steps",
        steps,
        "--save-dir",
        save_dir,
        "--save-every-steps",
        "2",
        "--keep-checkpoints",
        "5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run(args: &[String]) -> (i32, String, String) {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    memfit(&a)
}

#[track_caller]
fn ok(args: &[String]) -> String {
    let (code, out, err) = run(args);
    assert_eq!(code, 0, "{args:?}\n{out}\n{err}");
    assert_no_panic("run", &err);
    out
}

#[track_caller]
fn fails(args: &[String], needles: &[&str]) -> String {
    let (code, out, err) = run(args);
    assert_eq!(code, 1, "{args:?} did not fail as expected:\n{out}\n{err}");
    assert_no_panic("run", &err);
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}:\n{err}");
    }
    assert!(!out.contains("epoch 1"), "trained first:\n{out}");
    err
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Every file in `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

/// A safetensors file's tensors (name, dtype, shape, bytes) and metadata.
type Raw = (
    Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    HashMap<String, String>,
);

fn read_raw(path: &Path) -> Raw {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    (tensors, meta.metadata().clone().unwrap_or_default())
}

fn write_raw(path: &Path, raw: &Raw) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = raw
        .0
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, Some(raw.1.clone())).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// The state_dict tensors of a file (no optimizer buffers), as bytes.
fn weights_of(path: &Path) -> BTreeMap<String, Vec<u8>> {
    read_raw(path)
        .0
        .into_iter()
        .filter(|(n, ..)| !n.starts_with("optimizer."))
        .map(|(n, _, _, b)| (n, b))
        .collect()
}

/// "train loss X, train top-1 Y%" of the `epoch N:` line.
fn epoch_train_metrics(out: &str, epoch: usize) -> String {
    let line = out
        .lines()
        .rfind(|l| l.starts_with(&format!("epoch {epoch}:")))
        .unwrap_or_else(|| panic!("no epoch {epoch} line in\n{out}"));
    line.split(", val").next().unwrap().to_string()
}

#[test]
fn a_second_run_into_a_folder_is_refused_and_the_first_runs_files_are_intact() {
    let t = TempDir::new("runs-own");
    let dir = t.0.join("ckpt");
    let d = dir.to_str().unwrap();
    ok(&run_flags(d, "4"));
    let before = snapshot(&dir);
    assert_eq!(before.len(), 2, "{before:?}");
    // Another run (other flags, or the same flags: a new run either way).
    let mut other = run_flags(d, "6");
    other.extend(strs(&["--lr", "0.1"]));
    for args in [other, run_flags(d, "4")] {
        fails(
            &args,
            &[
                &format!("--save-dir {d} holds the checkpoints of another run"),
                &format!("memfit train --resume {d}"),
                "choose another --save-dir",
            ],
        );
        assert_eq!(snapshot(&dir), before, "the first run's files changed");
    }
    // A file of the format before run ids is another run's too.
    let legacy = t.0.join("legacy");
    std::fs::create_dir_all(&legacy).unwrap();
    let mut raw = read_raw(&dir.join("ckpt-00000004.safetensors"));
    raw.1
        .retain(|k, _| !["run_id", "run_config"].contains(&k.as_str()));
    write_raw(&legacy.join("ckpt-00000004.safetensors"), &raw);
    let l = legacy.to_str().unwrap();
    fails(
        &run_flags(l, "4"),
        &["holds the checkpoints of another run"],
    );
    // A folder holding the files of two runs: --resume names them both.
    let mixed = t.0.join("mixed");
    let m = mixed.to_str().unwrap();
    ok(&run_flags(m, "2"));
    std::fs::copy(
        dir.join("ckpt-00000004.safetensors"),
        mixed.join("ckpt-00000004.safetensors"),
    )
    .unwrap();
    let err = fails(
        &strs(&["train", "--resume", m]),
        &[
            "holds the checkpoints of 2 runs",
            "ckpt-00000002",
            "ckpt-00000004",
        ],
    );
    assert!(err.contains("naming its file"), "{err}");
    assert_eq!(snapshot(&dir), before);
}

#[test]
fn resume_dir_alone_continues_the_run_and_reports_the_whole_epoch() {
    let t = TempDir::new("resume-alone");
    // Uninterrupted: 4 steps, one epoch.
    let full = t.0.join("full");
    let whole = ok(&run_flags(full.to_str().unwrap(), "4"));
    // Stopped after step 2, mid-epoch, then `--resume DIR` with only the
    // longer --steps (a safe change, said on stderr).
    let part = t.0.join("part");
    let p = part.to_str().unwrap();
    ok(&run_flags(p, "2"));
    let (code, resumed, err) = run(&strs(&["train", "--resume", p, "--steps", "4"]));
    assert_eq!(code, 0, "{resumed}\n{err}");
    assert!(resumed.contains("resuming from"), "{resumed}");
    assert!(
        err.contains("--steps 4 (the saved run's 2)"),
        "no note on the changed --steps:\n{err}"
    );
    assert!(
        resumed.contains("on synthetic: 6 classes, 32 train"),
        "{resumed}"
    );
    // The epoch line counts the steps before the restart too.
    assert_eq!(
        epoch_train_metrics(&resumed, 1),
        epoch_train_metrics(&whole, 1)
    );
    let name = "ckpt-00000004.safetensors";
    assert_eq!(weights_of(&part.join(name)), weights_of(&full.join(name)));
    // A defining flag given again with another value is refused, naming it.
    // (The saved --lr is the default the run resolved: 0.1 x 8 / 256.)
    for (flag, value, saved) in [("--lr", "0.1", "0.003125"), ("--batch-size", "4", "8")] {
        fails(
            &strs(&["train", "--resume", p, flag, value]),
            &[&format!(
                "{flag} {value} differs from the saved run's {saved}"
            )],
        );
    }
    // The same value again is fine.
    ok(&strs(&[
        "train",
        "--resume",
        p,
        "--lr",
        "0.003125",
        "--base-width",
        "8",
    ]));
}

/// Files saved before runs had ids and saved their flags resume as before:
/// with every flag given again, compared by the fingerprint.
#[test]
fn state_files_of_the_previous_format_still_resume_with_their_flags() {
    let t = TempDir::new("resume-legacy");
    let dir = t.0.join("ckpt");
    let d = dir.to_str().unwrap();
    ok(&run_flags(d, "4"));
    std::fs::remove_file(dir.join("ckpt-00000004.safetensors")).unwrap();
    let path = dir.join("ckpt-00000002.safetensors");
    let mut raw = read_raw(&path);
    raw.1.retain(|k, _| {
        !k.starts_with("memfit_")
            && !k.starts_with("epoch")
            && !["run_id", "run_config"].contains(&k.as_str())
            || k == "memfit_checkpoint"
    });
    write_raw(&path, &raw);
    // Alone, the defaults differ from the saved run: refused by name.
    let (code, _, err) = run(&strs(&["train", "--resume", d]));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("incompatible run"), "{err}");
    let mut again = run_flags(d, "4");
    again.extend(strs(&["--resume", d]));
    let out = ok(&again);
    assert!(out.contains("resuming from"), "{out}");
    assert!(dir.join("ckpt-00000004.safetensors").exists());
    assert!(path.exists(), "the old file was removed");
}

/// A state file is a weights file: eval and --init read it, with the
/// architecture from its metadata; flags that contradict it are refused.
#[test]
fn state_files_and_saved_weights_carry_their_architecture() {
    let t = TempDir::new("meta");
    let dir = t.0.join("ckpt");
    let d = dir.to_str().unwrap();
    ok(&run_flags(d, "4"));
    let state = dir.join("ckpt-00000004.safetensors");
    let s = state.to_str().unwrap();
    let data = [
        "--data",
        "synthetic",
        "--image-size",
        "16",
        "--val-size",
        "8",
    ];
    let mut eval = strs(&["eval", "--weights", s]);
    eval.extend(strs(&data));
    let out = ok(&eval);
    assert!(out.lines().any(|l| l.starts_with("8 images: ")), "{out}");
    let mut contradict = eval.clone();
    contradict.extend(strs(&["--base-width", "16"]));
    fails(
        &contradict,
        &["--base-width 16 contradicts", "--base-width 8"],
    );
    // --init from the state file, no --base-width: the file's width.
    let w = t.0.join("w.safetensors");
    let mut init = strs(&["train", "--steps", "1", "--init", s, "--save-weights"]);
    init.push(w.to_str().unwrap().into());
    init.extend(strs(&data));
    init.extend(strs(&["--train-size", "16", "--batch-size", "8"]));
    let out = ok(&init);
    assert!(out.contains("(base width 8,"), "{out}");
    // The saved weights carry it too.
    let meta = read_raw(&w).1;
    assert_eq!(meta.get("memfit_base_width").map(String::as_str), Some("8"));
    assert_eq!(
        meta.get("memfit_model").map(String::as_str),
        Some("resnet18")
    );
    // Without metadata, today's refusal, with a hint of what the file is.
    let mut raw = read_raw(&w);
    raw.1.retain(|k, _| !k.starts_with("memfit_"));
    let bare = t.0.join("bare.safetensors");
    write_raw(&bare, &raw);
    let mut eval = strs(&["eval", "--weights", bare.to_str().unwrap()]);
    eval.extend(strs(&data));
    fails(
        &eval,
        &[
            "problems",
            "this looks like a resnet18 at base width 8",
            "--base-width 8",
        ],
    );
}

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

fn copy_classes(from: &Path, to: &Path, classes: &[&str]) {
    for c in classes {
        std::fs::create_dir_all(to.join(c)).unwrap();
        for e in std::fs::read_dir(from.join(c)).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, to.join(c).join(p.file_name().unwrap())).unwrap();
        }
    }
}

/// "N images: loss L, top-1 T%": (N, correct, N * L).
fn eval_counts(out: &str) -> (usize, usize, f64) {
    let out = out
        .lines()
        .find(|l| l.contains(" images: loss "))
        .unwrap_or_else(|| panic!("no result line in {out}"));
    let n: usize = out.split(" images").next().unwrap().parse().unwrap();
    let loss: f64 = out
        .split("loss ")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let top1: f64 = out
        .split("top-1 ")
        .nth(1)
        .unwrap()
        .split('%')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    (
        n,
        (top1 * n as f64 / 100.0).round() as usize,
        loss * n as f64,
    )
}

/// A folder with some of the model's classes is scored with the model's
/// labels for them (by name), and a class the model lacks is an error.
#[test]
fn eval_maps_class_folders_to_the_models_classes_by_name() {
    let t = TempDir::new("eval-classes");
    let w = t.0.join("w.safetensors");
    let (train, val) = (fixture("photos/train"), fixture("photos/val"));
    ok(&strs(&[
        "train",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--data",
        train.to_str().unwrap(),
        "--val-data",
        val.to_str().unwrap(),
        "--image-size",
        "32",
        "--base-width",
        "8",
        "--save-weights",
        w.to_str().unwrap(),
    ]));
    let eval = |folder: &Path| {
        let f = folder.to_str().unwrap();
        strs(&[
            "eval",
            "--weights",
            w.to_str().unwrap(),
            "--data",
            f,
            "--val-data",
            f,
            "--image-size",
            "32",
        ])
    };
    let all = eval_counts(&ok(&eval(&val)));
    let (first, rest) = (t.0.join("cat"), t.0.join("coffee-space"));
    copy_classes(&val, &first, &["cat"]);
    copy_classes(&val, &rest, &["coffee", "space"]);
    let a = eval_counts(&ok(&eval(&first)));
    let b = eval_counts(&ok(&eval(&rest)));
    assert_eq!(a.0 + b.0, all.0);
    assert_eq!(a.1 + b.1, all.1, "{a:?} + {b:?} vs {all:?}");
    assert!((a.2 + b.2 - all.2).abs() < 1e-3, "{a:?} + {b:?} vs {all:?}");
    let zebra = t.0.join("zebra");
    copy_classes(&val, &zebra, &["cat"]);
    std::fs::rename(zebra.join("cat"), zebra.join("zebra")).unwrap();
    fails(
        &eval(&zebra),
        &["'zebra'", "not classes of the model", "cat, coffee, space"],
    );
}
