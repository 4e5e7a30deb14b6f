//! torchvision `.pth` files (torch.save archives) as weights, read by the
//! restricted unpickler of `src/io/pth.rs`. The fixtures in
//! `tests/fixtures/pth/` are made by `tools/make_pth_fixtures.py` (torch
//! 2.15.0, torchvision 0.29.2; see tests/fixtures/pth/README.md): files
//! written by torch.save with safetensors twins of the same tensors, and
//! hand-written hostile and broken ones.

mod common;

use std::path::PathBuf;

use common::{TempDir, assert_no_panic, memfit};
use memfit::io::{RawData, TensorFile, load_torchvision, save_state_dict};
use memfit::memory::Pool;
use memfit::nn::{ResNet, ResNetConfig};

/// What the hostile fixture's pickle would run under Python's pickle.
const EXECUTED_MARKER: &str = "/tmp/memfit-pth-fixture-executed";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(format!(
        "{}/tests/fixtures/pth/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
}

fn open(name: &str) -> TensorFile {
    TensorFile::open(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The error of opening `name`, which must name the file.
fn open_err(name: &str) -> String {
    let path = fixture(name);
    let msg = match TensorFile::open(&path) {
        Ok(_) => panic!("{name} opened"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains(path.to_str().unwrap()), "{msg}");
    msg
}

/// Same names, shapes, dtypes and bits.
#[track_caller]
fn assert_identical(got: &TensorFile, want: &TensorFile) {
    let names = |f: &TensorFile| f.tensors.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{} vs {}", got.path, want.path);
    for (name, w) in &want.tensors {
        let g = &got.tensors[name];
        assert_eq!(g.shape, w.shape, "{name}: shape");
        match (&g.data, &w.data) {
            (RawData::F32(g), RawData::F32(w)) => {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(g), bits(w), "{name}: values");
            }
            (RawData::I64(g), RawData::I64(w)) => assert_eq!(g, w, "{name}: values"),
            _ => panic!("{name}: dtype differs"),
        }
    }
}

fn count(file: &TensorFile, name: &str) -> i64 {
    let (shape, v) = file.i64(name).unwrap();
    assert!(shape.is_empty(), "{name}: shape {shape:?}, torch saves 0-d");
    v[0]
}

fn resnet50_w2(classes: usize) -> ResNetConfig {
    ResNetConfig {
        base_width: 2,
        num_classes: classes,
        ..ResNetConfig::resnet50()
    }
}

/// (a) torch.save of a bottleneck ResNet reads bit-identical to the
/// safetensors the same script wrote from the same state_dict.
#[test]
fn zip_pth_is_bit_identical_to_its_safetensors_twin() {
    let pth = open("resnet50_w2.pth");
    assert_identical(&pth, &open("resnet50_w2.safetensors"));
    assert_eq!(pth.tensors.len(), 320);
    assert_eq!(count(&pth, "layer3.5.bn3.num_batches_tracked"), 7);
}

/// (b) num_batches_tracked are I64 0-d tensors with their counted value;
/// (e) the legacy (torch < 1.6, non-zip) file of the same state_dict reads
/// the same.
#[test]
fn counts_and_the_legacy_format_read_exactly() {
    let want = open("resnet18_w2.safetensors");
    let zip = open("resnet18_w2.pth");
    let legacy = open("resnet18_w2_legacy.pth");
    assert_identical(&zip, &want);
    assert_identical(&legacy, &want);
    assert_eq!(count(&zip, "bn1.num_batches_tracked"), 3);
    assert_eq!(count(&legacy, "layer4.1.bn2.num_batches_tracked"), 3);
}

/// f16, bf16 and f64 storages become f32 (as `.float()` does), strided views
/// (a transpose, a slice with a storage offset) are gathered, empty and 0-d
/// tensors keep their shapes.
#[test]
fn other_dtypes_and_views_read_as_torch_converts_them() {
    let pth = open("mixed.pth");
    assert_identical(&pth, &open("mixed.safetensors"));
    assert_eq!(pth.tensors["transposed"].shape, [4, 5]);
    assert_eq!(pth.tensors["rows"].shape, [2, 4]);
    assert_eq!(pth.tensors["empty"].shape, [0, 3]);
    assert_eq!(pth.i64("scalar").unwrap(), (&[][..], &[42][..]));
}

/// The strict loader and --reset-head work on a .pth as on safetensors: the
/// model loaded from either saves the same bytes.
#[test]
fn a_pth_loads_into_the_model_like_its_safetensors_twin() {
    let t = TempDir::new("pth-model");
    let pool = Pool::new();
    let mut saved = Vec::new();
    for name in ["resnet50_w2.pth", "resnet50_w2.safetensors"] {
        let mut model = ResNet::new(&pool, resnet50_w2(10)).unwrap();
        load_torchvision(&mut model, &open(name), false).unwrap();
        let out = t.0.join(format!("{name}.out.safetensors"));
        save_state_dict(&mut model, &out).unwrap();
        saved.push(TensorFile::open(&out).unwrap());
    }
    assert_identical(&saved[0], &saved[1]);

    // Fine-tuning: a 6-class head, the file's 10-class head skipped.
    let mut model = ResNet::new(&pool, resnet50_w2(6)).unwrap();
    let file = open("resnet50_w2.pth");
    let err = load_torchvision(&mut model, &file, false).unwrap_err();
    assert!(err.to_string().contains("--reset-head"), "{err}");
    load_torchvision(&mut model, &file, true).unwrap();
}

/// The reader is chosen by content: a .pth under any name loads, and the
/// old "not a valid safetensors file: header too large" is gone.
#[test]
fn the_format_is_chosen_by_content_not_extension() {
    let t = TempDir::new("pth-ext");
    let bytes = std::fs::read(fixture("resnet18_w2.pth")).unwrap();
    for name in ["w.safetensors", "w.bin", "w"] {
        let p = t.write(name, &bytes);
        let f = TensorFile::open(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_identical(&f, &open("resnet18_w2.safetensors"));
    }
    // A pickle that is not a torch.save file says so.
    let p = t.write("plain.pkl", b"\x80\x02}q\x00.");
    let msg = TensorFile::open(&p).err().unwrap().to_string();
    assert!(msg.contains("not a torch.save file"), "{msg}");
    assert!(!msg.contains("safetensors"), "{msg}");
}

/// (c) A pickle naming os.system is refused at that global, which the
/// message names; nothing runs (the command would create a file).
#[test]
fn a_foreign_global_is_refused_and_nothing_runs() {
    let _ = std::fs::remove_file(EXECUTED_MARKER);
    let msg = open_err("foreign_global.pth");
    assert!(msg.contains("'os.system'"), "{msg}");
    assert!(msg.contains("nothing from the file was run"), "{msg}");
    assert!(!std::path::Path::new(EXECUTED_MARKER).exists());

    // torch.save(model) names the module's class; the hint says what to save.
    let msg = open_err("whole_model.pth");
    assert!(
        msg.contains("'torch.nn.modules.container.Sequential'"),
        "{msg}"
    );
    assert!(msg.contains("model.state_dict()"), "{msg}");

    // A checkpoint dict is not a state_dict; the hint names the key.
    let msg = open_err("checkpoint_dict.pth");
    assert!(msg.contains("torch.save(ckpt['model']"), "{msg}");
}

/// (d) A truncated zip is a clear error; so is every other cut of a real
/// file, zip or legacy, and a flipped byte in any place: never a panic, never
/// a wrong load.
#[test]
fn truncated_and_corrupt_files_are_clear_errors() {
    let msg = open_err("truncated.pth");
    assert!(msg.contains("truncated or corrupt"), "{msg}");

    for name in ["resnet18_w2.pth", "resnet18_w2_legacy.pth", "mixed.pth"] {
        let bytes = std::fs::read(fixture(name)).unwrap();
        let step = (bytes.len() / 200).max(1);
        for n in (0..bytes.len()).step_by(step) {
            if let Ok(f) = TensorFile::parse(name, &bytes[..n]) {
                panic!("{name} cut at {n} opened with {} tensors", f.tensors.len());
            }
        }
        // A flipped byte: an error, or (in padding or the pickle's memo
        // numbering) the same tensors.
        let want = open(name);
        for at in (0..bytes.len()).step_by(step) {
            let mut b = bytes.clone();
            b[at] ^= 0x5a;
            if let Ok(f) = TensorFile::parse(name, &b) {
                let same = f.tensors.len() == want.tensors.len()
                    && f.tensors.iter().all(|(k, t)| {
                        want.tensors.get(k).is_some_and(|w| {
                            w.shape == t.shape && format!("{:?}", w.data) == format!("{:?}", t.data)
                        })
                    });
                // A flip in a legacy file's storage bytes has no checksum
                // to catch it; a zip's CRC does.
                assert!(
                    same || name.ends_with("legacy.pth"),
                    "{name}: byte {at} flipped loads different tensors"
                );
            }
        }
    }
}

// ---------- through the binary ----------

const R50_W2: [&str; 16] = [
    "--model",
    "resnet50",
    "--base-width",
    "2",
    "--data",
    "synthetic",
    "--image-size",
    "32",
    "--batch-size",
    "2",
    "--train-size",
    "4",
    "--val-size",
    "2",
    "--classes",
    "10",
];

fn run_ok(args: &[&str]) -> String {
    let (code, out, err) = memfit(args);
    assert_eq!(code, 0, "{args:?}:\n{out}\n{err}");
    assert_no_panic(&format!("{args:?}"), &err);
    out
}

#[test]
fn train_init_and_eval_weights_take_a_pth() {
    let p = fixture("resnet50_w2.pth");
    let p = p.to_str().unwrap();
    let mut eval = vec!["eval", "--weights", p];
    eval.extend(R50_W2);
    let out = run_ok(&eval);
    assert!(out.lines().any(|l| l.starts_with("2 images: ")), "{out}");

    let mut train = vec!["train", "--steps", "1", "--init", p];
    train.extend(R50_W2);
    run_ok(&train);

    // Fine-tuning on 6 classes from the 10-class file.
    let mut args = vec!["train", "--steps", "1", "--init", p, "--reset-head"];
    args.extend(&R50_W2[..14]);
    args.extend(["--classes", "6"]);
    run_ok(&args);

    // A legacy file: ResNet-18 with base width 2.
    let legacy = fixture("resnet18_w2_legacy.pth");
    let mut eval = vec!["eval", "--weights", legacy.to_str().unwrap()];
    eval.extend(["--model", "resnet18"]);
    eval.extend(&R50_W2[2..]);
    run_ok(&eval);
}

#[test]
fn the_binary_refuses_bad_pth_files_clearly() {
    let _ = std::fs::remove_file(EXECUTED_MARKER);
    let cases = [
        ("foreign_global.pth", "'os.system'"),
        ("truncated.pth", "truncated or corrupt"),
        ("whole_model.pth", "model.state_dict()"),
    ];
    for (name, needle) in cases {
        let p = fixture(name);
        let p = p.to_str().unwrap();
        for head in [
            vec!["eval", "--weights", p],
            vec!["train", "--steps", "1", "--init", p],
        ] {
            let mut args = head.clone();
            args.extend(R50_W2);
            let (code, out, err) = memfit(&args);
            assert_ne!(code, 0, "{args:?} succeeded:\n{out}");
            assert!(err.contains(p) && err.contains(needle), "{args:?}:\n{err}");
            assert!(!err.contains("safetensors"), "{args:?}:\n{err}");
            assert!(!out.contains("epoch 1"), "{args:?} trained:\n{out}");
            assert_no_panic(&format!("{args:?}"), &err);
        }
    }
    assert!(!std::path::Path::new(EXECUTED_MARKER).exists());
}
