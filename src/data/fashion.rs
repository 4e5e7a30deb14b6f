//! Fashion-MNIST (Zalando, MIT licence) from the files installed by Debian's
//! `dataset-fashion-mnist` package, which puts the four gzipped IDX files in
//! [`FASHION_MNIST_DEBIAN_DIR`]. The environment variable
//! [`FASHION_MNIST_ENV`] points elsewhere (a folder with the same four files,
//! gzipped or not).

use std::path::{Path, PathBuf};

use super::InMemoryDataset;
use super::idx::{idx_to_dataset, read_idx_images, read_idx_labels};
use crate::error::{Error, Result};

/// Where `apt-get install dataset-fashion-mnist` puts the files.
pub const FASHION_MNIST_DEBIAN_DIR: &str = "/usr/share/datasets/fashion-mnist";
/// Overrides [`FASHION_MNIST_DEBIAN_DIR`] when set and non-empty.
pub const FASHION_MNIST_ENV: &str = "MEMFIT_FASHION_MNIST_DIR";
/// Per-pixel mean of the Fashion-MNIST training images, in [0, 1] units.
pub const FASHION_MNIST_MEAN: f32 = 0.2860;
/// Per-pixel standard deviation of the Fashion-MNIST training images.
pub const FASHION_MNIST_STD: f32 = 0.3530;
pub const FASHION_MNIST_CLASSES: usize = 10;

/// The four IDX files of Fashion-MNIST.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FashionMnistFiles {
    pub train_images: PathBuf,
    pub train_labels: PathBuf,
    pub test_images: PathBuf,
    pub test_labels: PathBuf,
}

/// Finds Fashion-MNIST in `$MEMFIT_FASHION_MNIST_DIR` if set, else in the
/// Debian install folder. The error says how to install it.
pub fn fashion_mnist_files() -> Result<FashionMnistFiles> {
    match std::env::var_os(FASHION_MNIST_ENV) {
        Some(d) if !d.is_empty() => fashion_mnist_files_in(Path::new(&d)),
        _ => fashion_mnist_files_in(Path::new(FASHION_MNIST_DEBIAN_DIR)),
    }
}

/// Finds the four Fashion-MNIST files in `dir` (each as `NAME.gz` or `NAME`).
pub fn fashion_mnist_files_in(dir: &Path) -> Result<FashionMnistFiles> {
    let mut missing = Vec::new();
    let mut find = |name: &str| {
        let gz = dir.join(format!("{name}.gz"));
        let plain = dir.join(name);
        if gz.is_file() {
            gz
        } else if plain.is_file() {
            plain
        } else {
            missing.push(format!("{name}[.gz]"));
            gz
        }
    };
    let files = FashionMnistFiles {
        train_images: find("train-images-idx3-ubyte"),
        train_labels: find("train-labels-idx1-ubyte"),
        test_images: find("t10k-images-idx3-ubyte"),
        test_labels: find("t10k-labels-idx1-ubyte"),
    };
    if missing.is_empty() {
        return Ok(files);
    }
    Err(Error::Io {
        path: dir.display().to_string(),
        reason: format!(
            "Fashion-MNIST not found (missing {}). Install it with \
             `sudo apt-get install dataset-fashion-mnist` (files go to {FASHION_MNIST_DEBIAN_DIR}), \
             or set {FASHION_MNIST_ENV} to a folder holding the four IDX files",
            missing.join(", ")
        ),
    })
}

/// Loads Fashion-MNIST as (train, test): 60,000 and 10,000 images of 28×28,
/// 10 classes, normalised with mean 0.2860 and std 0.3530, 3 channels.
pub fn load_fashion_mnist() -> Result<(InMemoryDataset, InMemoryDataset)> {
    let f = fashion_mnist_files()?;
    let train = load_pair(&f.train_images, &f.train_labels)?;
    let test = load_pair(&f.test_images, &f.test_labels)?;
    Ok((train, test))
}

fn load_pair(images: &Path, labels: &Path) -> Result<InMemoryDataset> {
    let im = read_idx_images(images)?;
    let lb = read_idx_labels(labels)?;
    if lb.len() != im.n {
        return Err(Error::BadData {
            path: labels.display().to_string(),
            reason: format!(
                "{} labels, but {} has {} images",
                lb.len(),
                images.display(),
                im.n
            ),
        });
    }
    idx_to_dataset(
        &im,
        &lb,
        FASHION_MNIST_CLASSES,
        FASHION_MNIST_MEAN,
        FASHION_MNIST_STD,
        &labels.display().to_string(),
    )
}
