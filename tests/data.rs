//! Datasets: the IDX reader (round trips and every error), IDX → dataset
//! conversion, the embedded digits, and Fashion-MNIST when it is installed.

use std::io::Write;

mod common;

use common::TempDir;
use memfit::Error;
use memfit::data::{
    DIGITS_LEN, IdxImages, fashion_mnist_files, fashion_mnist_files_in, idx_to_dataset,
    load_digits, load_fashion_mnist, read_idx_images, read_idx_labels,
};

fn idx_bytes(magic: u32, dims: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut b = magic.to_be_bytes().to_vec();
    for d in dims {
        b.extend_from_slice(&d.to_be_bytes());
    }
    b.extend_from_slice(payload);
    b
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// 5 images of 3×4 with distinct pixel values, and 5 labels.
fn sample() -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let pixels: Vec<u8> = (0..5 * 3 * 4).map(|i| (i * 7 % 256) as u8).collect();
    let labels = vec![0u8, 3, 1, 2, 3];
    let images = idx_bytes(0x0803, &[5, 3, 4], &pixels);
    let labels_file = idx_bytes(0x0801, &[5], &labels);
    (pixels, images, labels_file)
}

fn err_msg(r: memfit::Result<impl std::fmt::Debug>) -> (Error, String) {
    let e = r.expect_err("expected an error");
    let m = e.to_string();
    (e, m)
}

#[test]
fn idx_round_trip_plain_and_gzip() {
    let dir = TempDir::new("roundtrip");
    let (pixels, images, labels) = sample();
    for gz in [false, true] {
        let (im_b, lb_b) = if gz {
            (gzip(&images), gzip(&labels))
        } else {
            (images.clone(), labels.clone())
        };
        assert_eq!(im_b.starts_with(&[0x1f, 0x8b]), gz);
        let ip = dir.write(&format!("images-{gz}"), &im_b);
        let lp = dir.write(&format!("labels-{gz}"), &lb_b);
        let im = read_idx_images(&ip).unwrap();
        assert_eq!(
            im,
            IdxImages {
                pixels: pixels.clone(),
                n: 5,
                rows: 3,
                cols: 4
            }
        );
        assert_eq!(read_idx_labels(&lp).unwrap(), vec![0, 3, 1, 2, 3]);
    }
}

#[test]
fn idx_wrong_magic() {
    let dir = TempDir::new("magic");
    let (_, images, labels) = sample();
    let lp = dir.write("labels.idx", &labels);
    let ip = dir.write("images.idx", &images);

    // A labels file read as images, and the other way round.
    let (e, m) = err_msg(read_idx_images(&lp));
    assert!(matches!(e, Error::BadData { .. }), "{e:?}");
    assert!(m.contains("labels.idx"), "{m}");
    assert!(m.contains("wrong IDX magic 0x00000801"), "{m}");
    assert!(m.contains("expected 0x00000803"), "{m}");
    let (_, m) = err_msg(read_idx_labels(&ip));
    assert!(m.contains("images.idx"), "{m}");
    assert!(
        m.contains("0x00000803") && m.contains("expected 0x00000801"),
        "{m}"
    );

    // Something that is not IDX at all (and also not gzip).
    let p = dir.write("text.idx", b"hello world, not an idx file");
    let (_, m) = err_msg(read_idx_images(&p));
    assert!(
        m.contains("text.idx") && m.contains("wrong IDX magic 0x68656c6c"),
        "{m}"
    );
    assert!(m.contains("not an IDX file"), "{m}");

    // Same inside gzip.
    let p = dir.write("gz-labels.idx.gz", &gzip(&labels));
    let (_, m) = err_msg(read_idx_images(&p));
    assert!(
        m.contains("gz-labels.idx.gz") && m.contains("0x00000801"),
        "{m}"
    );
}

#[test]
fn idx_truncated_and_trailing_data() {
    let dir = TempDir::new("sizes");
    let (_, images, labels) = sample();

    let short = &images[..images.len() - 3];
    for (name, bytes) in [("short.idx", short.to_vec()), ("short.gz", gzip(short))] {
        let p = dir.write(name, &bytes);
        let (e, m) = err_msg(read_idx_images(&p));
        assert!(matches!(e, Error::BadData { .. }), "{e:?}");
        assert!(m.contains(name), "{m}");
        assert!(m.contains("truncated"), "{m}");
        assert!(
            m.contains("5x3x4 = 60 bytes") && m.contains("only 57"),
            "{m}"
        );
    }

    let mut long = labels.clone();
    long.extend_from_slice(&[1, 2]);
    for (name, bytes) in [("long.idx", long.clone()), ("long.gz", gzip(&long))] {
        let p = dir.write(name, &bytes);
        let (_, m) = err_msg(read_idx_labels(&p));
        assert!(m.contains(name), "{m}");
        assert!(m.contains("trailing data") && m.contains("2 extra"), "{m}");
    }

    // Shorter than the magic.
    let p = dir.write("tiny.idx", &[0, 0, 8]);
    let (_, m) = err_msg(read_idx_labels(&p));
    assert!(m.contains("tiny.idx") && m.contains("truncated"), "{m}");
}

#[test]
fn idx_zero_byte_missing_and_bad_gzip() {
    let dir = TempDir::new("empty");
    let p = dir.write("empty.idx", b"");
    let (e, m) = err_msg(read_idx_images(&p));
    assert!(matches!(e, Error::BadData { .. }), "{e:?}");
    assert!(m.contains("empty.idx") && m.contains("0 bytes"), "{m}");

    let p = dir.0.join("does-not-exist.idx");
    let (e, m) = err_msg(read_idx_labels(&p));
    assert!(matches!(e, Error::Io { .. }), "{e:?}");
    assert!(m.contains("does-not-exist.idx"), "{m}");

    // gzip magic followed by garbage.
    let p = dir.write("garbage.gz", &[0x1f, 0x8b, 0xff, 0x00, 0x12, 0x34]);
    let (e, m) = err_msg(read_idx_images(&p));
    assert!(matches!(e, Error::BadData { .. }), "{e:?}");
    assert!(m.contains("garbage.gz") && m.contains("bad gzip"), "{m}");

    // A gzip stream cut in the middle.
    let (_, images, _) = sample();
    let gz = gzip(&images);
    let p = dir.write("cut.gz", &gz[..gz.len() / 2]);
    let (_, m) = err_msg(read_idx_images(&p));
    assert!(m.contains("cut.gz") && m.contains("bad gzip"), "{m}");
}

#[test]
fn idx_to_dataset_values_and_checks() {
    let im = IdxImages {
        pixels: vec![0, 255, 128, 64, 10, 20, 30, 40],
        n: 2,
        rows: 2,
        cols: 2,
    };
    let (mean, std) = (0.2860f32, 0.3530f32);
    let ds = idx_to_dataset(&im, &[9, 0], 10, mean, std, "lbl.idx").unwrap();
    assert_eq!((ds.len(), ds.h, ds.w, ds.classes), (2, 2, 2, 10));
    assert_eq!(ds.labels, vec![9, 0]);
    assert_eq!(ds.images.len(), 2 * 2 * 2 * 3);
    for (i, &p) in im.pixels.iter().enumerate() {
        let want = (p as f32 / 255.0 - mean) / std;
        for c in 0..3 {
            let got = ds.images[i * 3 + c];
            assert!(
                (got - want).abs() < 1e-5,
                "pixel {i} ch {c}: {got} vs {want}"
            );
        }
    }
    assert_eq!(ds.image(1).len(), 12);

    let (e, m) = err_msg(idx_to_dataset(&im, &[9, 10], 10, mean, std, "lbl.idx"));
    assert!(matches!(e, Error::BadData { .. }), "{e:?}");
    assert!(m.contains("lbl.idx"), "{m}");
    assert!(
        m.contains("label 10 at index 1") && m.contains("10 classes"),
        "{m}"
    );

    let (_, m) = err_msg(idx_to_dataset(&im, &[1, 2, 3], 10, mean, std, "lbl.idx"));
    assert!(
        m.contains("lbl.idx") && m.contains("3 labels for 2 images"),
        "{m}"
    );
}

#[test]
fn fashion_mnist_missing_folder_says_how_to_install() {
    let dir = TempDir::new("nofashion");
    let (e, m) = err_msg(fashion_mnist_files_in(&dir.0));
    assert!(matches!(e, Error::Io { .. }), "{e:?}");
    assert!(
        m.contains("sudo apt-get install dataset-fashion-mnist"),
        "{m}"
    );
    assert!(m.contains("MEMFIT_FASHION_MNIST_DIR"), "{m}");
    assert!(m.contains("train-images-idx3-ubyte"), "{m}");

    // Plain and gzipped files are both found.
    let (_, images, labels) = sample();
    dir.write("train-images-idx3-ubyte.gz", &gzip(&images));
    dir.write("train-labels-idx1-ubyte", &labels);
    dir.write("t10k-images-idx3-ubyte", &images);
    let (_, m) = err_msg(fashion_mnist_files_in(&dir.0));
    assert!(
        m.contains("t10k-labels-idx1-ubyte") && !m.contains("train-images"),
        "{m}"
    );
    dir.write("t10k-labels-idx1-ubyte.gz", &gzip(&labels));
    let f = fashion_mnist_files_in(&dir.0).unwrap();
    assert!(f.train_images.ends_with("train-images-idx3-ubyte.gz"));
    assert!(f.train_labels.ends_with("train-labels-idx1-ubyte"));
    assert_eq!(read_idx_images(&f.test_images).unwrap().n, 5);
    assert_eq!(read_idx_labels(&f.test_labels).unwrap().len(), 5);
}

fn histogram(labels: &[usize]) -> Vec<usize> {
    let mut h = vec![0; 10];
    for &l in labels {
        h[l] += 1;
    }
    h
}

#[test]
fn digits_split_sizes_histogram_and_determinism() {
    let (train, val) = load_digits(0.2, 7).unwrap();
    assert_eq!(train.len() + val.len(), DIGITS_LEN);
    assert_eq!(DIGITS_LEN, 1797);
    assert_eq!(val.len(), 359); // round(1797 * 0.2)
    assert_eq!(train.len(), 1438);
    for ds in [&train, &val] {
        assert_eq!((ds.h, ds.w, ds.classes), (8, 8, 10));
        assert_eq!(ds.images.len(), ds.len() * 8 * 8 * 3);
        assert!(ds.labels.iter().all(|&l| l < 10));
    }
    // The class counts of sklearn's digits, over both splits together.
    let mut all = train.labels.clone();
    all.extend_from_slice(&val.labels);
    assert_eq!(
        histogram(&all),
        vec![178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    );
    assert_eq!(histogram(&all).iter().sum::<usize>(), 1797);
    // Every class appears in the validation set of a 20% split.
    assert!(histogram(&val.labels).iter().all(|&c| c > 0));

    // Same seed, same split; another seed, another split.
    let (train2, val2) = load_digits(0.2, 7).unwrap();
    assert_eq!(train.labels, train2.labels);
    assert_eq!(val.labels, val2.labels);
    assert_eq!(train.images, train2.images);
    assert_eq!(val.images, val2.images);
    let (_, val3) = load_digits(0.2, 8).unwrap();
    assert_ne!(val.images, val3.images);

    // No validation set.
    let (t0, v0) = load_digits(0.0, 1).unwrap();
    assert_eq!((t0.len(), v0.len()), (1797, 0));
}

#[test]
fn digits_are_normalised_and_three_channel() {
    let (train, val) = load_digits(0.5, 3).unwrap();
    let all: Vec<f64> = train
        .images
        .iter()
        .chain(&val.images)
        .map(|&v| v as f64)
        .collect();
    let n = all.len() as f64;
    let mean = all.iter().sum::<f64>() / n;
    let var = all.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    assert!(mean.abs() < 1e-5, "mean {mean}");
    assert!((var.sqrt() - 1.0).abs() < 1e-4, "std {}", var.sqrt());
    for px in train.images.chunks_exact(3) {
        assert!(px[0] == px[1] && px[1] == px[2]);
    }
    // The value of a 0 pixel is the smallest value, and there are 17 levels.
    let mut levels: Vec<f32> = all.iter().map(|&v| v as f32).collect();
    levels.sort_by(f32::total_cmp);
    levels.dedup();
    assert_eq!(levels.len(), 17);
}

#[test]
fn fashion_mnist_if_installed() {
    let files = match fashion_mnist_files() {
        Ok(f) => f,
        Err(e) => {
            println!("skipping Fashion-MNIST test: {e}");
            return;
        }
    };
    let im = read_idx_images(&files.test_images).unwrap();
    assert_eq!((im.n, im.rows, im.cols), (10000, 28, 28));
    let (train, test) = load_fashion_mnist().unwrap();
    assert_eq!(train.len(), 60000);
    assert_eq!(test.len(), 10000);
    for ds in [&train, &test] {
        assert_eq!((ds.h, ds.w, ds.classes), (28, 28, 10));
        assert_eq!(ds.images.len(), ds.len() * 28 * 28 * 3);
    }
    assert_eq!(histogram(&train.labels), vec![6000; 10]);
    assert_eq!(histogram(&test.labels), vec![1000; 10]);
    // Normalised with the training set's own statistics: mean ~0, std ~1.
    let n = train.images.len() as f64;
    let mean = train.images.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = train
        .images
        .iter()
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    assert!(mean.abs() < 0.01, "mean {mean}");
    assert!((var.sqrt() - 1.0).abs() < 0.01, "std {}", var.sqrt());
}
