//! A labelled image set on disk in torchvision's `ImageFolder` layout,
//! `root/<class>/**/<image>`, scanned once; images are decoded lazily, one
//! at a time, by [`ImageFolder::load`]. Knows nothing of transforms,
//! batches or threads.
//!
//! The scan follows `torchvision.datasets.folder` so that labels match a
//! PyTorch run on the same folder:
//! - classes are the sub-directory names of `root`, sorted (by code point,
//!   as Python's `sorted`); the label is the index in that list;
//! - each class folder is walked recursively (symlinks followed), folders in
//!   sorted order of their full path and files by name within each, which
//!   is the order of `sorted(os.walk(...))`;
//! - files count when their extension is `.jpg`, `.jpeg` or `.png`, in any
//!   case. torchvision also takes .bmp, .gif, .webp, .tif/.tiff, .ppm,
//!   .pgm and .pbm, which memfit cannot decode: those are left out with a
//!   warning and counted ([`ImageFolder::left_out`]), never silently;
//! - an entry that is neither a directory nor a regular file (a FIFO,
//!   socket or device, whatever its name) is never opened: reading a FIFO
//!   would block the run for good. It is left out with a warning too;
//! - no class folder, or a class folder without images, is an error.
//!
//! One deliberate difference: names starting with `.` (folders and files)
//! are ignored at every level, so `.git`, `.ipynb_checkpoints` and macOS
//! `._photo.jpg` resource forks neither become classes nor samples.

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::decode::{RgbImage, load_rgb};
use super::seeded_split;
use crate::error::{Error, Result};

/// Extensions (lower case, no dot) of the files a class folder contributes.
pub const IMAGE_EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// torchvision's other image extensions (`IMG_EXTENSIONS`), which memfit
/// cannot decode: such files are left out with a warning.
pub const UNSUPPORTED_IMAGE_EXTENSIONS: [&str; 7] =
    ["bmp", "gif", "webp", "tif", "tiff", "ppm", "pgm"];

/// A file the scan left out, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftOut {
    pub path: PathBuf,
    pub reason: &'static str,
}

/// One image: where it is and its class index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub path: PathBuf,
    pub label: usize,
}

/// The scanned folder. Decoding failures found by [`ImageFolder::load`] are
/// counted in [`ImageFolder::skipped`], shared by all threads loading from it.
#[derive(Debug)]
pub struct ImageFolder {
    pub root: PathBuf,
    /// Sorted class names; `classes[label]`.
    pub classes: Vec<String>,
    pub samples: Vec<Sample>,
    /// Files that look like images but that the scan left out (formats
    /// memfit cannot decode, entries that are not regular files).
    pub left_out: Vec<LeftOut>,
    skipped: AtomicUsize,
}

impl Clone for ImageFolder {
    fn clone(&self) -> Self {
        ImageFolder {
            root: self.root.clone(),
            classes: self.classes.clone(),
            samples: self.samples.clone(),
            left_out: self.left_out.clone(),
            skipped: AtomicUsize::new(self.skipped()),
        }
    }
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

fn is_hidden(name: &OsString) -> bool {
    name.as_encoded_bytes().first() == Some(&b'.')
}

fn has_extension(name: &OsString, extensions: &[&str]) -> bool {
    let name = name.to_string_lossy().to_lowercase();
    extensions
        .iter()
        .any(|ext| name.len() > ext.len() + 1 && name.ends_with(&format!(".{ext}")))
}

fn is_image(name: &OsString) -> bool {
    has_extension(name, &IMAGE_EXTENSIONS)
}

/// What a directory entry is, symlinks followed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Dir,
    /// A regular file, or an entry whose target cannot be read (a dangling
    /// link: decoding it fails with a warning like any unreadable file).
    File,
    /// A FIFO, socket or device: never opened.
    Special,
}

/// The visible entries of `dir` as (name, kind), symlinks followed.
fn list(dir: &Path) -> Result<Vec<(OsString, Kind)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        let entry = entry.map_err(|e| io_err(dir, e))?;
        let name = entry.file_name();
        if is_hidden(&name) {
            continue;
        }
        let kind = match std::fs::metadata(entry.path()) {
            Ok(m) if m.is_dir() => Kind::Dir,
            Ok(m) if !m.is_file() => Kind::Special,
            _ => Kind::File,
        };
        out.push((name, kind));
    }
    Ok(out)
}

/// Image files under `class_dir` in `sorted(os.walk(class_dir))` order;
/// what looks like an image but cannot be read is added to `left_out`.
fn walk_class(class_dir: &Path, left_out: &mut Vec<LeftOut>) -> Result<Vec<PathBuf>> {
    // (folder, its image files sorted by name), gathered depth-first, then
    // ordered by the folder's full path as os.walk's sort does.
    let mut folders: Vec<(PathBuf, Vec<OsString>)> = Vec::new();
    let mut stack = vec![class_dir.to_path_buf()];
    // Canonical paths already walked: a symlink loop is walked once.
    let mut seen = HashSet::new();
    while let Some(dir) = stack.pop() {
        if !seen.insert(std::fs::canonicalize(&dir).map_err(|e| io_err(&dir, e))?) {
            continue;
        }
        let mut files = Vec::new();
        for (name, kind) in list(&dir)? {
            let decodable = is_image(&name);
            let image_like = decodable || has_extension(&name, &UNSUPPORTED_IMAGE_EXTENSIONS);
            match kind {
                Kind::Dir => stack.push(dir.join(&name)),
                Kind::Special if image_like => left_out.push(LeftOut {
                    path: dir.join(&name),
                    reason: "not a regular file (a FIFO, socket or device): never opened",
                }),
                Kind::File if decodable => files.push(name),
                Kind::File if image_like => left_out.push(LeftOut {
                    path: dir.join(&name),
                    reason: "a format memfit cannot decode (only JPEG and PNG)",
                }),
                _ => {}
            }
        }
        files.sort();
        folders.push((dir, files));
    }
    folders.sort_by(|a, b| {
        a.0.as_os_str()
            .as_encoded_bytes()
            .cmp(b.0.as_os_str().as_encoded_bytes())
    });
    Ok(folders
        .into_iter()
        .flat_map(|(dir, files)| files.into_iter().map(move |f| dir.join(f)))
        .collect())
}

/// `warning: skipping <path>: <reason>`, the line printed for a file that
/// cannot be decoded.
pub fn skip_warning(err: &Error) -> String {
    format!("warning: skipping {err}")
}

impl ImageFolder {
    /// Lists `root/<class>/**/*.{jpg,jpeg,png}` by torchvision's rules (see
    /// the module doc). Reads directories only; no image is opened.
    pub fn scan(root: impl AsRef<Path>) -> Result<ImageFolder> {
        let root = root.as_ref();
        let meta = std::fs::metadata(root).map_err(|e| io_err(root, e))?;
        if !meta.is_dir() {
            return Err(io_err(root, "not a directory"));
        }
        let mut class_names: Vec<OsString> = list(root)?
            .into_iter()
            .filter_map(|(name, kind)| (kind == Kind::Dir).then_some(name))
            .collect();
        class_names.sort();
        if class_names.is_empty() {
            return Err(Error::BadData {
                path: root.display().to_string(),
                reason: "no class folders found: an image folder holds one sub-folder per class, root/<class>/<image>.jpg".into(),
            });
        }
        let mut samples = Vec::new();
        let mut empty = Vec::new();
        let mut left_out = Vec::new();
        for (label, name) in class_names.iter().enumerate() {
            let files = walk_class(&root.join(name), &mut left_out)?;
            if files.is_empty() {
                empty.push(name.to_string_lossy().into_owned());
            }
            samples.extend(files.into_iter().map(|path| Sample { path, label }));
        }
        left_out.sort_by(|a, b| a.path.cmp(&b.path));
        for l in &left_out {
            eprintln!("warning: leaving out {}: {}", l.path.display(), l.reason);
        }
        if !left_out.is_empty() {
            eprintln!(
                "warning: {} file(s) under {} left out (see above)",
                left_out.len(),
                root.display()
            );
        }
        if !empty.is_empty() {
            return Err(Error::BadData {
                path: root.display().to_string(),
                reason: format!(
                    "no .jpg, .jpeg or .png images in the class folder(s) {}",
                    empty.join(", ")
                ),
            });
        }
        Ok(ImageFolder {
            root: root.to_path_buf(),
            classes: class_names
                .iter()
                .map(|n| n.to_string_lossy().into_owned())
                .collect(),
            samples,
            left_out,
            skipped: AtomicUsize::new(0),
        })
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Decodes sample `i`. A file that cannot be read or decoded gives
    /// `None`, after a [`skip_warning`] on stderr and one more
    /// [`ImageFolder::skipped`]: one bad file among thousands should not end
    /// a run. It is retried (and warned about) each time it is loaded.
    pub fn load(&self, i: usize) -> Option<RgbImage> {
        match load_rgb(&self.samples[i].path) {
            Ok(img) => Some(img),
            Err(e) => {
                eprintln!("{}", skip_warning(&e));
                self.skipped.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Loads that failed so far, over all threads (a file failing in two
    /// epochs counts twice).
    pub fn skipped(&self) -> usize {
        self.skipped.load(Ordering::Relaxed)
    }

    /// Deterministic (train, val) split for a folder without a separate
    /// validation folder: [`seeded_split`], as for the embedded digits. Both
    /// keep all classes and the scan order.
    pub fn split(&self, val_fraction: f32, seed: u64) -> Result<(ImageFolder, ImageFolder)> {
        let (train, val) = seeded_split(self.len(), val_fraction, seed, "ImageFolder::split")?;
        let subset = |idx: &[usize]| {
            let mut idx = idx.to_vec();
            idx.sort_unstable();
            ImageFolder {
                root: self.root.clone(),
                classes: self.classes.clone(),
                samples: idx.iter().map(|&i| self.samples[i].clone()).collect(),
                left_out: Vec::new(),
                skipped: AtomicUsize::new(0),
            }
        };
        Ok((subset(&train), subset(&val)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_are_case_insensitive_and_need_a_stem() {
        for yes in ["a.jpg", "b.JPG", "c.JpEg", "d.png", "e.PNG", "x.y.jpeg"] {
            assert!(is_image(&yes.into()), "{yes}");
        }
        for no in ["jpg", "a.gif", "a.jpg.txt", "a_jpg", "a.pn"] {
            assert!(!is_image(&no.into()), "{no}");
        }
    }

    #[test]
    fn hidden_names_start_with_a_dot() {
        assert!(is_hidden(&".git".into()));
        assert!(is_hidden(&"._cat.jpg".into()));
        assert!(!is_hidden(&"cat.jpg".into()));
    }
}
