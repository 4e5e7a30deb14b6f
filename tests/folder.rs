//! Image folders on disk: torchvision's scan rules (class order, file order,
//! extensions, hidden names, errors), lazy decoding with corrupt files
//! skipped and counted, and the photo fixtures made by
//! `tools/make_photo_fixtures.py`.

use std::path::{Path, PathBuf};

mod common;

use common::TempDir;
use memfit::Error;
use memfit::data::{
    Dataset, ImageFolder, ImageFolderDataset, Loader, Transform, decode_rgb, load_rgb, skip_warning,
};

/// An 8-bit RGB PNG of `w`x`h` filled with `rgb`.
fn png_bytes(w: u32, h: u32, rgb: [u8; 3]) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut e = png::Encoder::new(&mut out, w, h);
        e.set_color(png::ColorType::Rgb);
        e.set_depth(png::BitDepth::Eight);
        let mut wr = e.write_header().unwrap();
        let data: Vec<u8> = (0..w * h).flat_map(|_| rgb).collect();
        wr.write_image_data(&data).unwrap();
    }
    out
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn rel(root: &Path, p: &Path) -> String {
    p.strip_prefix(root).unwrap().display().to_string()
}

#[test]
fn scan_orders_classes_and_files_as_torchvision() {
    let t = TempDir::new("order");
    // Written in no particular order; scanning never opens the files.
    for f in [
        "zebra/b.png",
        "zebra/B.jpg",
        "zebra/sub/c.JPEG",
        "zebra/sub/deeper/g.png",
        "zebra/sub-2/d.Png",
        "zebra/notes.txt",
        "zebra/.hidden/e.png",
        "zebra/._b.jpg",
        "apple/y.jpg",
        "Apple/x.jpg",
        ".git/z.png",
        "root_file.jpg",
    ] {
        t.write(f, b"");
    }
    let folder = ImageFolder::scan(&t.0).unwrap();
    // Code-point order: upper case first; hidden folders are no class.
    assert_eq!(folder.classes, vec!["Apple", "apple", "zebra"]);
    let got: Vec<(String, usize)> = folder
        .samples
        .iter()
        .map(|s| (rel(&t.0, &s.path), s.label))
        .collect();
    // sorted(os.walk()) orders folders by full path: "sub-2" < "sub/deeper"
    // because '-' < '/'.
    let want = [
        ("Apple/x.jpg", 0),
        ("apple/y.jpg", 1),
        ("zebra/B.jpg", 2),
        ("zebra/b.png", 2),
        ("zebra/sub/c.JPEG", 2),
        ("zebra/sub-2/d.Png", 2),
        ("zebra/sub/deeper/g.png", 2),
    ];
    let want: Vec<(String, usize)> = want.iter().map(|&(p, l)| (p.into(), l)).collect();
    assert_eq!(got, want);
}

#[test]
fn empty_root_and_empty_class_are_errors_that_say_so() {
    let t = TempDir::new("empty");
    let e = ImageFolder::scan(&t.0).unwrap_err();
    assert!(matches!(e, Error::BadData { .. }), "{e:?}");
    assert!(e.to_string().contains("no class folders found"), "{e}");

    // Only a hidden folder and loose files: still no class.
    t.write(".cache/a.png", b"");
    t.write("loose.png", b"");
    let e = ImageFolder::scan(&t.0).unwrap_err().to_string();
    assert!(e.contains("no class folders found"), "{e}");

    t.write("cats/a.png", b"");
    t.write("dogs/readme.txt", b"");
    std::fs::create_dir_all(t.0.join("eels/.thumbs")).unwrap();
    t.write("eels/.thumbs/x.png", b"");
    let e = ImageFolder::scan(&t.0).unwrap_err().to_string();
    assert!(
        e.contains("no .jpg, .jpeg or .png images in the class folder(s) dogs, eels"),
        "{e}"
    );

    let missing = t.0.join("nope");
    let e = ImageFolder::scan(&missing).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e:?}");
    assert!(e.to_string().contains("nope"), "{e}");
}

#[test]
fn corrupt_and_zero_byte_files_are_skipped_and_counted() {
    let t = TempDir::new("corrupt");
    let good = png_bytes(3, 2, [10, 20, 30]);
    t.write("a/good.png", &good);
    let empty = t.write("a/empty.jpg", b"");
    let cut = t.write("b/cut.png", &good[..good.len() / 2]);
    let text = t.write("b/text.jpg", b"hello, not an image");
    let folder = ImageFolder::scan(&t.0).unwrap();
    let names: Vec<String> = folder.samples.iter().map(|s| rel(&t.0, &s.path)).collect();
    assert_eq!(
        names,
        ["a/empty.jpg", "a/good.png", "b/cut.png", "b/text.jpg"]
    );

    let img = folder.load(1).expect("good.png decodes");
    assert_eq!((img.h, img.w), (2, 3));
    assert_eq!(&img.data[..3], &[10, 20, 30]);
    for i in [0, 2, 3] {
        assert!(folder.load(i).is_none(), "{}", names[i]);
    }
    assert_eq!(folder.skipped(), 3);
    assert!(folder.load(0).is_none());
    assert_eq!(folder.skipped(), 4, "every failed load counts");

    // The warning names the file and the reason.
    for (p, reason) in [
        (&empty, "empty file"),
        (&cut, "bad PNG"),
        (&text, "unknown magic bytes"),
    ] {
        let w = skip_warning(&load_rgb(p).unwrap_err());
        let head = format!("warning: skipping {}: ", p.display());
        assert!(w.starts_with(&head) && w.contains(reason), "{w}");
    }
}

#[test]
fn split_is_deterministic_disjoint_and_keeps_classes() {
    let t = TempDir::new("split");
    for i in 0..10 {
        t.write(&format!("c{}/{i}.png", i % 3), b"");
    }
    let folder = ImageFolder::scan(&t.0).unwrap();
    let (train, val) = folder.split(0.3, 5).unwrap();
    assert_eq!((train.len(), val.len()), (7, 3));
    assert_eq!(train.classes, folder.classes);
    let (train2, val2) = folder.split(0.3, 5).unwrap();
    assert_eq!(
        (train.samples.clone(), val.samples.clone()),
        (train2.samples, val2.samples)
    );
    let mut all: Vec<_> = train.samples.iter().chain(&val.samples).cloned().collect();
    all.sort_by(|a, b| a.path.cmp(&b.path));
    let mut want = folder.samples.clone();
    want.sort_by(|a, b| a.path.cmp(&b.path));
    assert_eq!(all, want);
    let (_, none) = folder.split(0.0, 5).unwrap();
    assert!(none.is_empty());
    assert!(folder.split(1.0, 5).is_err());
}

/// Our decoders against Pillow's on the photo fixtures (`expected.tsv`):
/// exact for PNG, within 1.5 levels of mean for JPEG.
#[test]
fn photo_fixtures_decode_like_pillow() {
    let root = fixtures().join("photos");
    let table = std::fs::read_to_string(root.join("expected.tsv")).unwrap();
    let mut checked = 0;
    for line in table.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split('\t').collect();
        let path = root.join(f[0]);
        let img = load_rgb(&path).unwrap_or_else(|e| panic!("{e}"));
        let (h, w): (usize, usize) = (f[1].parse().unwrap(), f[2].parse().unwrap());
        assert_eq!((img.h, img.w), (h, w), "{}", f[0]);
        let tol = if f[0].ends_with(".png") { 1e-5 } else { 1.5 };
        for c in 0..3 {
            let want: f64 = f[3 + c].parse().unwrap();
            let got = img
                .data
                .iter()
                .skip(c)
                .step_by(3)
                .map(|&v| v as f64)
                .sum::<f64>()
                / (h * w) as f64;
            assert!(
                (got - want).abs() <= tol,
                "{} channel {c}: {got} vs {want}",
                f[0]
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 13);
    for part in ["train", "val"] {
        let folder = ImageFolder::scan(root.join(part)).unwrap();
        assert_eq!(folder.classes, ["cat", "coffee", "space"]);
        assert!((0..folder.len()).all(|i| folder.load(i).is_some()));
        assert_eq!(folder.skipped(), 0);
    }
    let truncated = fixtures().join("photos_corrupt/cat/truncated.jpg");
    let bytes = std::fs::read(&truncated).unwrap();
    let e = decode_rgb(&bytes, &truncated).unwrap_err().to_string();
    assert!(e.contains("truncated.jpg: bad JPEG"), "{e}");
}

/// Real files, random crops and flips: the batches do not depend on the
/// number of loader threads, and change with the epoch.
#[test]
fn folder_batches_are_identical_for_workers_0_1_3() {
    let folder = ImageFolder::scan(fixtures().join("photos/train")).unwrap();
    let data = ImageFolderDataset {
        folder,
        transform: Transform::train(24),
        seed: 11,
    };
    assert_eq!(
        (data.len(), data.classes(), data.image_hw()),
        (9, 3, (24, 24))
    );
    let order = vec![4, 0, 8, 2, 6, 1, 7, 3, 5];
    let run = |workers, epoch| {
        Loader {
            data: &data,
            batch_size: 4,
            workers,
        }
        .collect_epoch(order.clone(), epoch)
        .unwrap()
    };
    let reference = run(0, 1);
    assert_eq!(reference.len(), 3);
    assert_eq!(reference[0].labels, vec![1, 0, 2, 0]);
    assert_eq!(reference[0].images.len(), 4 * 24 * 24 * 3);
    assert!(reference.iter().all(|b| b.skipped == 0));
    assert_eq!(run(1, 1), reference);
    assert_eq!(run(3, 1), reference);
    assert_ne!(run(3, 2), reference, "another epoch, other crops");

    // The eval transform is deterministic.
    let eval = ImageFolderDataset {
        transform: Transform::eval(24),
        ..data.clone()
    };
    let a = Loader {
        data: &eval,
        batch_size: 4,
        workers: 2,
    }
    .collect_epoch(order.clone(), 1);
    let b = Loader {
        data: &eval,
        batch_size: 4,
        workers: 0,
    }
    .collect_epoch(order.clone(), 7);
    assert_eq!(a.unwrap(), b.unwrap());
}

#[test]
fn loader_drops_unreadable_files_from_their_batch() {
    let folder = ImageFolder::scan(fixtures().join("photos_corrupt")).unwrap();
    let names: Vec<String> = folder
        .samples
        .iter()
        .map(|s| rel(&fixtures().join("photos_corrupt"), &s.path))
        .collect();
    assert_eq!(names, ["cat/ok.jpg", "cat/truncated.jpg", "coffee/ok.png"]);
    let data = ImageFolderDataset {
        folder,
        transform: Transform::no_augment(16),
        seed: 0,
    };
    for workers in [0, 2] {
        let before = data.skipped();
        let batches = Loader {
            data: &data,
            batch_size: 2,
            workers,
        }
        .collect_epoch(vec![0, 1, 2], 0)
        .unwrap();
        assert_eq!(batches.len(), 2);
        assert_eq!(
            (batches[0].labels.clone(), batches[0].skipped),
            (vec![0], 1)
        );
        assert_eq!(batches[0].images.len(), 16 * 16 * 3);
        assert_eq!(
            (batches[1].labels.clone(), batches[1].skipped),
            (vec![1], 0)
        );
        assert_eq!(data.skipped(), before + 1);
    }
}
