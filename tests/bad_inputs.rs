//! The bad-input matrix of the robustness issue, through the binary: every
//! case exits non-zero (or, for unreadable images, trains and counts them),
//! names the file and the problem, and shows no panic or backtrace.
//! Library-level checks of the same parsers are in tests/io.rs, data.rs and
//! folder.rs; this file is about what a user sees.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{TempDir, assert_no_panic, memfit, memfit_env, png};
use memfit::io::save_state_dict;
use memfit::memory::Pool;
use memfit::nn::{ResNet, ResNetConfig};
use safetensors::{Dtype, View};

/// Runs `args`, checks it fails cleanly with every `needles` in stderr, and
/// returns (stdout, stderr).
#[track_caller]
fn fails_with(args: &[&str], env: &[(&str, &Path)], needles: &[&str]) -> (String, String) {
    let (code, out, err) = memfit_env(args, env);
    assert_ne!(code, 0, "{args:?} succeeded:\n{out}\n{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: stderr lacks {n:?}:\n{err}");
    }
    assert_no_panic(&format!("{args:?}"), &err);
    (out, err)
}

// ---------- weights: --init F and eval --weights F ----------

/// The flags that make `eval` and `train` build the model of [`good_weights`].
const MODEL: [&str; 10] = [
    "--base-width",
    "8",
    "--data",
    "synthetic",
    "--image-size",
    "16",
    "--val-size",
    "8",
    "--batch-size",
    "8",
];

/// A valid resnet18 (width 8, 6 classes) weights file, as eval expects it.
fn good_weights(dir: &Path) -> PathBuf {
    let pool = Pool::new();
    let mut config = ResNetConfig::by_name("resnet18").unwrap();
    config.base_width = 8;
    config.num_classes = 6;
    let mut model = ResNet::new(&pool, config).unwrap();
    let path = dir.join("good.safetensors");
    save_state_dict(&mut model, &path).unwrap();
    path
}

struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn read_raw(path: &Path) -> BTreeMap<String, Raw> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                Raw {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    bytes: v.data().to_vec(),
                },
            )
        })
        .collect()
}

fn write_raw(path: &Path, entries: &BTreeMap<String, Raw>) {
    let bytes = safetensors::serialize(entries.iter().map(|(n, r)| (n.as_str(), r)), None).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// Both ways a weights file enters memfit fail on `path` with `needles`.
#[track_caller]
fn weights_rejected(path: &Path, needles: &[&str]) {
    let p = path.to_str().unwrap();
    let mut with_path = vec![p];
    with_path.extend_from_slice(needles);
    let mut eval = vec!["eval", "--weights", p];
    eval.extend(MODEL);
    fails_with(&eval, &[], &with_path);
    let mut train = vec!["train", "--steps", "1", "--init", p];
    train.extend(MODEL);
    let (out, _) = fails_with(&train, &[], &with_path);
    assert!(!out.contains("epoch 1"), "trained before failing:\n{out}");
}

#[test]
fn bad_weight_files_are_refused_by_init_and_eval() {
    let t = TempDir::new("bad-weights");
    let good = good_weights(&t.0);
    // The good file passes both ways: the failures below are the files'.
    let g = good.to_str().unwrap();
    let mut eval = vec!["eval", "--weights", g];
    eval.extend(MODEL);
    let (code, out, err) = memfit(&eval);
    assert_eq!(code, 0, "{out}\n{err}");
    let mut train = vec!["train", "--steps", "1", "--init", g];
    train.extend(MODEL);
    let (code, out, err) = memfit(&train);
    assert_eq!(code, 0, "{out}\n{err}");

    let bytes = std::fs::read(&good).unwrap();
    let invalid = "not a valid safetensors file";
    let truncated = t.write("truncated.safetensors", &bytes[..bytes.len() / 2]);
    weights_rejected(&truncated, &[invalid]);
    let zero = t.write("zero.safetensors", b"");
    weights_rejected(&zero, &[invalid]);
    let mut garbage = 16u64.to_le_bytes().to_vec();
    garbage.extend_from_slice(b"{this is no json");
    weights_rejected(&t.write("garbage.safetensors", &garbage), &[invalid]);
    // A header length far beyond the file: refused without allocating it.
    let mut huge = (1u64 << 40).to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    weights_rejected(&t.write("huge.safetensors", &huge), &[invalid]);
    weights_rejected(&t.0, &["is a directory"]);
    weights_rejected(&t.0.join("nope.safetensors"), &["No such file"]);

    let entries = || read_raw(&good);
    for (dtype, width) in [(Dtype::F64, 8), (Dtype::F16, 2)] {
        let mut e = entries();
        let w = e.get_mut("bn1.weight").unwrap();
        w.dtype = dtype;
        w.bytes = vec![0; w.shape[0] * width];
        let p = t.0.join(format!("{dtype:?}.safetensors"));
        write_raw(&p, &e);
        let d = format!("dtype {dtype:?}");
        weights_rejected(&p, &["'bn1.weight'", &d, "only F32 and I64"]);
    }

    let mut e = entries();
    e.remove("layer1.0.bn1.running_var");
    let p = t.0.join("missing.safetensors");
    write_raw(&p, &e);
    weights_rejected(&p, &["missing 'layer1.0.bn1.running_var'"]);

    let mut e = entries();
    e.insert(
        "extra.weight".into(),
        Raw {
            dtype: Dtype::F32,
            shape: vec![1],
            bytes: vec![0; 4],
        },
    );
    let p = t.0.join("unexpected.safetensors");
    write_raw(&p, &e);
    weights_rejected(&p, &["unexpected 'extra.weight'"]);

    let mut e = entries();
    e.get_mut("conv1.weight").unwrap().shape = vec![7, 7, 3, 8];
    let p = t.0.join("shape.safetensors");
    write_raw(&p, &e);
    weights_rejected(
        &p,
        &["'conv1.weight' has shape [7, 7, 3, 8], expected [8, 3, 7, 7]"],
    );

    let mut e = BTreeMap::new();
    e.insert(
        "foo".to_string(),
        Raw {
            dtype: Dtype::F32,
            shape: vec![2],
            bytes: vec![0; 8],
        },
    );
    let p = t.0.join("foo.safetensors");
    write_raw(&p, &e);
    weights_rejected(
        &p,
        &[
            "does not look like a torchvision ResNet state_dict",
            "'foo'",
        ],
    );
}

// ---------- data: image folders ----------

const FOLDER_RUN: [&str; 14] = [
    "train",
    "--image-size",
    "16",
    "--base-width",
    "8",
    "--epochs",
    "1",
    "--batch-size",
    "2",
    "--val-fraction",
    "0",
    "--no-augment",
    "--workers",
    "0",
];

fn folder_run(root: &str) -> Vec<&str> {
    let mut a = FOLDER_RUN.to_vec();
    a.extend(["--data", root]);
    a
}

#[test]
fn corrupt_and_zero_byte_images_are_skipped_with_warnings_naming_them() {
    let t = TempDir::new("bad-images");
    let good = png(4, 4);
    t.write("a/good1.png", &good);
    t.write("a/good2.png", &good);
    t.write("b/good3.png", &good);
    t.write("b/good4.png", &good);
    let zero = t.write("a/zero.jpg", b"");
    let cut = t.write("b/cut.png", &good[..good.len() / 2]);
    let fake = t.write("b/fake.jpg", &[0xFF, 0xD8, 0xFF, 0xE0, 0, 16, 1, 2, 3]);
    let (code, out, err) = memfit(&folder_run(t.0.to_str().unwrap()));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_no_panic("bad images", &err);
    for (p, why) in [
        (&zero, "empty file"),
        (&cut, "bad PNG"),
        (&fake, "bad JPEG"),
    ] {
        let w = format!("warning: skipping {}: {why}", p.display());
        assert_eq!(err.matches(&w).count(), 1, "{w}:\n{err}");
    }
    assert!(out.contains("skipped 3 unreadable files"), "{out}");
}

#[test]
fn a_folder_of_only_unreadable_images_is_an_error_not_a_nan_run() {
    let t = TempDir::new("all-bad");
    t.write("a/zero.png", b"");
    t.write("b/text.jpg", b"hello");
    let root = t.0.to_str().unwrap();
    fails_with(
        &folder_run(root),
        &[],
        &[
            "epoch 1: all 2 images were unreadable",
            "nothing to train on",
        ],
    );
}

#[test]
fn folders_without_images_are_errors_naming_the_folder() {
    let t = TempDir::new("no-images");
    let root = t.0.to_str().unwrap().to_string();
    fails_with(&folder_run(&root), &[], &[&root, "no class folders found"]);
    t.write("cats/a.png", &png(4, 4));
    t.write("dogs/readme.txt", b"no images here");
    fails_with(
        &folder_run(&root),
        &[],
        &[
            &root,
            "no .jpg, .jpeg or .png images in the class folder(s) dogs",
        ],
    );
}

/// chmod 000 only bites for a user without CAP_DAC_OVERRIDE; as root (CI
/// often is) the file stays readable and there is nothing to test.
#[cfg(unix)]
#[test]
fn unreadable_permissions_are_skipped_or_refused() {
    use std::os::unix::fs::PermissionsExt;
    let t = TempDir::new("perm");
    let good = png(4, 4);
    for f in ["a/1.png", "a/2.png", "b/3.png", "b/4.png"] {
        t.write(f, &good);
    }
    let locked = t.write("a/locked.png", &good);
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
    if std::fs::read(&locked).is_ok() {
        eprintln!("skipped: running as root, permissions are not enforced");
        return;
    }
    let (code, out, err) = memfit(&folder_run(t.0.to_str().unwrap()));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        err.contains(&format!("warning: skipping {}", locked.display()))
            && err.contains("Permission denied"),
        "{err}"
    );
    // A class folder that cannot be listed stops the scan, naming it.
    let dir = t.0.join("b");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o000)).unwrap();
    let (_, err) = fails_with(
        &folder_run(t.0.to_str().unwrap()),
        &[],
        &["Permission denied"],
    );
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(err.contains(&dir.display().to_string()), "{err}");
}

// ---------- data: IDX files (through --data fashion-mnist) ----------

fn idx(magic: u32, dims: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut b = magic.to_be_bytes().to_vec();
    for d in dims {
        b.extend_from_slice(&d.to_be_bytes());
    }
    b.extend_from_slice(payload);
    b
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

const IMAGES: u32 = 0x0803;
const LABELS: u32 = 0x0801;

/// A complete tiny Fashion-MNIST folder (4 train, 2 test images of 28x28),
/// with `replace` written over one of its files.
fn fashion_dir(t: &TempDir, replace: Option<(&str, Vec<u8>)>) -> PathBuf {
    let dir = t.0.join("fashion");
    let _ = std::fs::remove_dir_all(&dir);
    let px = vec![100u8; 28 * 28];
    for (prefix, n) in [("train", 4u32), ("t10k", 2)] {
        let images = idx(IMAGES, &[n, 28, 28], &px.repeat(n as usize));
        let labels = idx(LABELS, &[n], &(0..n as u8).collect::<Vec<_>>());
        t.write(
            &format!("fashion/{prefix}-images-idx3-ubyte.gz"),
            &gzip(&images),
        );
        t.write(&format!("fashion/{prefix}-labels-idx1-ubyte"), &labels);
    }
    if let Some((name, bytes)) = replace {
        t.write(&format!("fashion/{name}"), &bytes);
    }
    dir
}

#[test]
fn bad_idx_files_are_refused_naming_the_file() {
    let t = TempDir::new("bad-idx");
    let run = [
        "train",
        "--data",
        "fashion-mnist",
        "--steps",
        "1",
        "--batch-size",
        "4",
        "--base-width",
        "8",
    ];
    let env = "MEMFIT_FASHION_MNIST_DIR";
    // The untouched folder trains: each failure below is the file's.
    let dir = fashion_dir(&t, None);
    let (code, out, err) = memfit_env(&run, &[(env, &dir)]);
    assert_eq!(code, 0, "{out}\n{err}");

    let px = vec![7u8; 28 * 28];
    let images = "train-images-idx3-ubyte.gz";
    let labels = "train-labels-idx1-ubyte";
    let full = gzip(&idx(IMAGES, &[4, 28, 28], &px.repeat(4)));
    let cases: Vec<(&str, Vec<u8>, Vec<&str>)> = vec![
        (
            images,
            gzip(&idx(LABELS, &[4], &[0; 4])),
            vec!["wrong IDX magic 0x00000801", "this is an IDX labels file"],
        ),
        (
            images,
            gzip(&idx(IMAGES, &[5, 28, 28], &px.repeat(4))),
            vec!["truncated: header says 5x28x28"],
        ),
        (
            images,
            gzip(&idx(IMAGES, &[3, 28, 28], &px.repeat(4))),
            vec!["trailing data"],
        ),
        (
            images,
            full[..full.len() / 2].to_vec(),
            vec!["bad gzip data"],
        ),
        (
            labels,
            idx(LABELS, &[4], &[0, 1, 10, 2]),
            vec!["label 10 at index 2 is out of range for 10 classes"],
        ),
        (
            labels,
            idx(LABELS, &[3], &[0, 1, 2]),
            vec!["3 labels, but", "has 4 images"],
        ),
        (labels, Vec::new(), vec!["empty file (0 bytes)"]),
    ];
    for (name, bytes, needles) in cases {
        let dir = fashion_dir(&t, Some((name, bytes)));
        let file = dir.join(name).display().to_string();
        let mut all = vec![file.as_str()];
        all.extend(needles);
        fails_with(&run, &[(env, &dir)], &all);
    }
}

// ---------- config ----------

#[test]
fn memory_budgets_parse_or_are_rejected() {
    for ok in ["4GiB", "512MB", "1.5GiB"] {
        let (code, out, err) = memfit(&["plan", "--memory-budget", ok]);
        assert_eq!(code, 0, "{ok}: {out}\n{err}");
    }
    for bad in [
        "--memory-budget=-1GiB",
        "--memory-budget=4XB",
        "--memory-budget=GiB",
        "--memory-budget=",
    ] {
        let value = bad.split_once('=').unwrap().1;
        fails_with(&["plan", bad], &[], &[&format!("'{value}' is not a size")]);
    }
    // Separated, a leading '-' reads as a flag: clap refuses it.
    fails_with(
        &["plan", "--memory-budget", "-1GiB"],
        &[],
        &["unexpected argument '-1'"],
    );
}

#[test]
fn sizes_and_batches_that_cannot_work_are_refused_before_training() {
    let tiny = [
        "--data",
        "synthetic",
        "--train-size",
        "16",
        "--val-size",
        "8",
        "--base-width",
        "8",
    ];
    let with = |extra: &[&'static str]| {
        let mut a = vec!["train", "--steps", "1"];
        a.extend(tiny);
        a.extend(extra);
        a
    };
    for data in ["synthetic", "digits"] {
        fails_with(
            &["train", "--data", data, "--image-size", "0"],
            &[],
            &["--image-size must be at least 1"],
        );
    }
    fails_with(&with(&["--image-size", "1"]), &[], &["1x1 is too small"]);
    fails_with(
        &with(&["--batch-size", "8", "--micro-batch", "0"]),
        &[],
        &["micro-batch 0 must be between 1 and the batch size 8"],
    );
    fails_with(
        &with(&["--batch-size", "8", "--micro-batch", "9"]),
        &[],
        &["micro-batch 9 must be between 1 and the batch size 8"],
    );
    fails_with(
        &with(&["--accum-steps", "0"]),
        &[],
        &["--accum-steps must be at least 1"],
    );
    fails_with(
        &["eval", "--weights", "w.safetensors", "--batch-size", "0"],
        &[],
        &["--batch-size must be at least 1"],
    );
    // torchvision's ResNet-50 takes 8x8 images (1x1 maps from layer2 on),
    // and so does memfit ...
    let (code, out, err) = memfit(&with(&[
        "--model",
        "resnet50",
        "--image-size",
        "8",
        "--batch-size",
        "4",
    ]));
    assert_eq!(code, 0, "{out}\n{err}");
    // ... but batch norm then needs two images per micro-batch, as in PyTorch.
    for extra in [
        ["--batch-size", "4", "--micro-batch", "1"],
        ["--batch-size", "5", "--micro-batch", "2"],
    ] {
        let mut a = with(&["--model", "resnet50", "--image-size", "8"]);
        a.extend(extra);
        let (out, _) = fails_with(
            &a,
            &[],
            &[
                "batch norm needs more than one value per channel",
                "1x1 maps",
            ],
        );
        assert!(!out.contains("epoch 1"), "{out}");
    }
}

// ---------- disk ----------

/// The run of the disk tests: 4 steps, a checkpoint every 2.
fn ckpt_run(dir: &str) -> Vec<&str> {
    vec![
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
        "--steps",
        "4",
        "--save-dir",
        dir,
        "--save-every-steps",
        "2",
        "--keep-checkpoints",
        "5",
    ]
}

/// A real write failure: the second run resumes from step 2 under a file
/// size limit (RLIMIT_FSIZE, SIGXFSZ ignored so the write returns EFBIG),
/// so its checkpoint at step 4 cannot be written.
#[cfg(unix)]
#[test]
fn a_failed_checkpoint_write_keeps_the_previous_one_and_stops() {
    let t = TempDir::new("efbig");
    let dir = t.0.join("ckpt");
    let d = dir.to_str().unwrap();
    let (code, out, err) = memfit(&ckpt_run(d));
    assert_eq!(code, 0, "{out}\n{err}");
    let two = dir.join("ckpt-00000002.safetensors");
    let four = dir.join("ckpt-00000004.safetensors");
    std::fs::remove_file(&four).unwrap();
    let before = std::fs::read(&two).unwrap();
    assert!(before.len() > 200 * 1024, "{}", before.len());

    // bash's `ulimit -f` counts 1024-byte blocks (dash's 512: hence bash);
    // 100 KiB is far below one checkpoint.
    let mut args = ckpt_run(d);
    args.extend(["--resume", d]);
    let out = Command::new("bash")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 100; exec \"$@\"")
        .arg("bash")
        .arg(common::memfit_bin())
        .args(&args)
        .output()
        .expect("run bash");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_no_panic("EFBIG", &err);
    for n in [
        four.display().to_string(),
        "cannot save the checkpoint".into(),
        "File too large".into(),
        "training stopped".into(),
        format!("The last good checkpoint is {}", two.display()),
    ] {
        assert!(err.contains(&n), "stderr lacks {n:?}:\n{err}");
    }
    assert_eq!(
        std::fs::read(&two).unwrap(),
        before,
        "the old checkpoint changed"
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["ckpt-00000002.safetensors"], "temporary file left?");
    // Resuming from it without the limit finishes the run.
    let (code, out, err) = memfit(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(four.exists());
}

#[test]
fn an_unusable_save_dir_or_weights_path_fails_before_training() {
    let t = TempDir::new("save-dir");
    let plain = t.write("plain", b"a file");
    let under = plain.join("ckpt");
    for (dir, why) in [
        (&under, "cannot create the checkpoint directory"),
        (&plain, "exists and is not a directory"),
    ] {
        let d = dir.to_str().unwrap();
        let (out, _) = fails_with(&ckpt_run(d), &[], &[d, why]);
        assert!(!out.contains("epoch 1"), "trained first:\n{out}");
    }
    let ok = t.0.join("ok");
    let mut a = ckpt_run(ok.to_str().unwrap());
    let w = under.join("w.safetensors");
    a.extend(["--save-weights", w.to_str().unwrap()]);
    let (out, _) = fails_with(
        &a,
        &[],
        &["--save-weights", "does not exist or is not a directory"],
    );
    assert!(!out.contains("epoch 1"), "trained first:\n{out}");
}

/// A SIGKILL in the middle of a write leaves its temporary file; the next
/// run into that directory removes it (and only it) before training.
#[test]
fn temporaries_of_killed_writes_are_removed_by_the_next_run() {
    let t = TempDir::new("stale-tmp");
    let dir = t.0.join("ckpt");
    let stale = dir.join(".ckpt-00000002.safetensors.12345.678.tmp");
    let other = dir.join(".keep-me.tmp");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(&stale, b"half a checkpoint").unwrap();
    std::fs::write(&other, b"not ours").unwrap();
    let (code, out, err) = memfit(&ckpt_run(dir.to_str().unwrap()));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(!stale.exists(), "stale temporary kept");
    assert!(other.exists(), "a file that is not ours was removed");
}

#[cfg(unix)]
#[test]
fn a_read_only_save_dir_fails_before_training_where_enforced() {
    use std::os::unix::fs::PermissionsExt;
    let t = TempDir::new("ro-save-dir");
    let dir = t.0.join("ro");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    let probe = dir.join("probe");
    let enforced = std::fs::write(&probe, b"").is_err();
    let _ = std::fs::remove_file(&probe);
    if !enforced {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        eprintln!("skipped: running as root, permissions are not enforced");
        return;
    }
    let (out, _) = fails_with(
        &ckpt_run(dir.to_str().unwrap()),
        &[],
        &[
            dir.to_str().unwrap(),
            "cannot write checkpoints into this directory",
        ],
    );
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(!out.contains("epoch 1"), "{out}");
}

// ---------- numerics ----------

/// A huge learning rate makes the tiny net diverge within a few steps; the
/// run stops at the first non-finite step, names it, and the newest
/// checkpoint is that of the step before (nothing non-finite was saved).
#[test]
fn a_diverging_run_stops_naming_the_step_and_keeps_the_last_good_checkpoint() {
    let t = TempDir::new("nan");
    let dir = t.0.join("ckpt");
    let d = dir.to_str().unwrap();
    let args = [
        "train",
        "--data",
        "synthetic",
        "--train-size",
        "64",
        "--val-size",
        "8",
        "--image-size",
        "16",
        "--base-width",
        "8",
        "--batch-size",
        "8",
        "--steps",
        "8",
        "--lr",
        "1e4",
        "--weight-decay",
        "0",
        "--schedule",
        "constant",
        "--save-dir",
        d,
        "--save-every-steps",
        "1",
    ];
    let (_, err) = fails_with(
        &args,
        &[],
        &[
            "non-finite",
            "at optimizer step",
            "the step was not applied",
        ],
    );
    let step: usize = err
        .split("at optimizer step ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no step in {err}"));
    assert!(
        step >= 2,
        "diverged at step {step}: no checkpoint before it"
    );
    let last = dir.join(format!("ckpt-{:08}.safetensors", step - 1));
    assert!(
        err.contains(&format!("The last good checkpoint is {}", last.display())),
        "{err}"
    );
    assert!(last.exists());
    assert!(!dir.join(format!("ckpt-{step:08}.safetensors")).exists());
    // Every value in it is finite.
    let f = memfit::io::TensorFile::open(&last).unwrap();
    for (name, t) in &f.tensors {
        if let memfit::io::RawData::F32(v) = &t.data {
            assert!(v.iter().all(|x| x.is_finite()), "{name}");
        }
    }
}

// ---------- checkpoints ----------

/// A checkpoint edited by hand (or by a bad disk) is refused on --resume,
/// naming the file: a non-positive loss scale, optimizer buffers of the
/// wrong size, and a plain weights file.
#[test]
fn corrupt_checkpoints_are_refused_on_resume_naming_the_file() {
    let t = TempDir::new("bad-ckpt");
    let dir = t.0.join("ckpt");
    let d = dir.to_str().unwrap();
    let mut run = ckpt_run(d);
    run.extend(["--precision", "f16"]);
    let (code, out, err) = memfit(&run);
    assert_eq!(code, 0, "{out}\n{err}");
    let good = dir.join("ckpt-00000004.safetensors");
    let bytes = std::fs::read(&good).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta: std::collections::HashMap<String, String> = meta.metadata().clone().unwrap();
    let entries = read_raw(&good);
    let rewrite = |name: &str,
                   entries: &BTreeMap<String, Raw>,
                   meta: &std::collections::HashMap<String, String>| {
        let p = t.0.join(name);
        let b = safetensors::serialize(
            entries.iter().map(|(n, r)| (n.as_str(), r)),
            Some(meta.clone()),
        )
        .unwrap();
        std::fs::write(&p, b).unwrap();
        p
    };
    let resume = |p: &Path, needles: &[&str]| {
        let mut a = run.clone();
        a.extend(["--resume", p.to_str().unwrap()]);
        let mut all = vec![p.to_str().unwrap()];
        all.extend_from_slice(needles);
        fails_with(&a, &[], &all);
    };
    for scale in ["NaN", "-1", "0", "inf"] {
        let mut m = meta.clone();
        m.insert("scaler_scale".into(), scale.into());
        let p = rewrite(&format!("scale-{scale}.safetensors"), &entries, &m);
        resume(
            &p,
            &[&format!("scaler_scale '{scale}' is not a positive number")],
        );
    }
    let mut e = read_raw(&good);
    let m0 = e.get_mut("optimizer.momentum.0").expect("momentum buffer");
    m0.shape = vec![1];
    m0.bytes.truncate(4);
    let p = rewrite("short-momentum.safetensors", &e, &meta);
    resume(&p, &["optimizer state does not match the model"]);
    resume(
        &good_weights(&t.0),
        &["is a weights file, not a training checkpoint"],
    );
    // The untouched checkpoint still resumes (the run is already complete).
    let mut a = run.clone();
    a.extend(["--resume", good.to_str().unwrap()]);
    let (code, out, err) = memfit(&a);
    assert_eq!(code, 0, "{out}\n{err}");
}
