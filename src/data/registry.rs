//! The datasets a command names: `digits`, `fashion-mnist`, `synthetic`
//! or the path of an image folder, turned into a (train, validation) pair
//! at one image size. Knows the built-in sets and the folder layout, not
//! the model or the command line's parser.

use std::path::PathBuf;

use super::{
    Dataset, ImageFolder, ImageFolderDataset, InMemoryDataset, SyntheticGratings, Transform,
    load_digits, load_fashion_mnist,
};
use crate::error::{Error, Result};

/// What to load; the fields are those of `memfit train`'s data flags.
#[derive(Clone, Debug, PartialEq)]
pub struct DataOptions {
    /// `digits`, `fashion-mnist`, `synthetic`, or an image folder's path.
    pub data: String,
    /// A separate validation image folder (only with a folder `data`).
    pub val_data: Option<PathBuf>,
    /// Side of the square network input. None: 32 for digits and
    /// synthetic, 28 for fashion-mnist, 224 for image folders.
    pub image_size: Option<usize>,
    /// Image folders: threads decoding batches ahead of the step.
    pub workers: usize,
    /// Image folders: resize and centre-crop only, no random crop or flip.
    pub no_augment: bool,
    /// Classes of the synthetic gratings (None: [`SYNTHETIC_CLASSES`]).
    pub classes: Option<usize>,
    /// Images of the synthetic training set.
    pub train_size: usize,
    /// Images of the synthetic validation set.
    pub val_size: usize,
    /// Fraction held out for validation from the digits, or from an image
    /// folder without `val_data`.
    pub val_fraction: f32,
}

/// Classes of the synthetic gratings when neither `--classes` nor
/// `--num-classes` says.
pub const SYNTHETIC_CLASSES: usize = 6;

/// The datasets `train` and `eval` use.
pub struct Data {
    pub train: Box<dyn Dataset>,
    pub val: Box<dyn Dataset>,
    /// Side of the square images both yield.
    pub size: usize,
    /// Loader threads: only files are worth loading ahead.
    pub workers: usize,
    /// The class of each label, for image folders (their class folders'
    /// names); None for the built-in sets.
    pub class_names: Option<Vec<String>>,
    /// Image folders: the transform of the validation images (what a
    /// model trained here must be evaluated with); None for the built-in
    /// sets, which are stored normalised.
    pub eval_transform: Option<Transform>,
}

/// The set `memfit eval` scores and how it reads it.
pub struct EvalData {
    pub set: Box<dyn Dataset>,
    /// Side of the square images it yields.
    pub size: usize,
    pub workers: usize,
    pub class_names: Option<Vec<String>>,
    /// What it is, for the report: "the whole folder test/" or "digits'
    /// validation split".
    pub what: String,
}

/// How an evaluated image folder is read when the weights say (see
/// `io::FolderInput`): the shorter side before the centre crop, and the
/// per-channel normalisation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FolderReading {
    pub eval_resize: usize,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

/// The set `memfit eval` scores: an image folder (`--val-data`, as in the
/// flags of the `train` run, else a folder `--data`) whole, since the hold-out is a notion of `train`; a
/// built-in set's validation (digits) or test (fashion-mnist) split.
/// `image_size` is the side to use when the flag is not given (the
/// weights' own), `reading` how the weights say folders were read.
pub fn load_eval_data(
    a: &DataOptions,
    seed: u64,
    image_size: Option<usize>,
    reading: Option<FolderReading>,
) -> Result<EvalData> {
    let builtin = ["digits", "fashion-mnist", "synthetic"].contains(&a.data.as_str());
    let folder = match (&a.val_data, builtin) {
        (Some(v), true) => v.clone(),
        (Some(v), false) => {
            // train's flags reused: --val-data is the set to score.
            if v.as_path() != std::path::Path::new(&a.data) {
                eprintln!(
                    "note: eval scores --val-data {}; --data {} is not used",
                    v.display(),
                    a.data
                );
            }
            v.clone()
        }
        (None, false) => PathBuf::from(&a.data),
        (None, true) => {
            let opts = DataOptions {
                image_size: a.image_size.or(image_size),
                ..a.clone()
            };
            let data = load_data(&opts, seed)?;
            let what = match a.data.as_str() {
                "fashion-mnist" => "the fashion-mnist test set".to_string(),
                d => format!("the {d} validation split"),
            };
            return Ok(EvalData {
                set: data.val,
                size: data.size,
                workers: data.workers,
                class_names: data.class_names,
                what,
            });
        }
    };
    if a.image_size == Some(0) {
        return Err(Error::Usage("--image-size must be at least 1".into()));
    }
    if !folder.is_dir() {
        return Err(Error::Usage(format!(
            "{}: no such directory (an image folder holds one sub-folder per class)",
            folder.display()
        )));
    }
    let size = a.image_size.or(image_size).unwrap_or(224);
    let mut transform = if a.no_augment {
        Transform::no_augment(size)
    } else {
        Transform::eval(size)
    };
    if let Some(r) = reading {
        transform.mean = r.mean;
        transform.std = r.std;
        // The weights' crop ratio at the size evaluated (their own resize
        // when the size is theirs), unless --no-augment asks for none.
        if !a.no_augment {
            let trained = image_size.unwrap_or(size).max(1);
            transform.augment = super::transform::Augment::CenterCrop {
                resize: r.eval_resize * size / trained,
            };
        }
    }
    let scanned = ImageFolder::scan(&folder)?;
    let class_names = Some(scanned.classes.clone());
    let what = format!("the whole folder {}", folder.display());
    Ok(EvalData {
        set: Box::new(ImageFolderDataset {
            folder: scanned,
            transform,
            seed,
        }),
        size,
        workers: a.workers,
        class_names,
        what,
    })
}

/// (train, validation) sets at the requested image size.
pub fn load_data(a: &DataOptions, seed: u64) -> Result<Data> {
    // Before any data is generated or resized: a zero side would reach the
    // kernels as empty tensors.
    if a.image_size == Some(0) {
        return Err(Error::Usage("--image-size must be at least 1".into()));
    }
    // The share held out of a training set that has no validation split of
    // its own (digits, an image folder without --val-data).
    if !(a.val_fraction.is_finite() && (0.0..1.0).contains(&a.val_fraction)) {
        return Err(Error::Usage(format!(
            "--val-fraction must be at least 0 and below 1 (the share of the training images held out for validation), got {}",
            a.val_fraction
        )));
    }
    let builtin = ["digits", "fashion-mnist", "synthetic"].contains(&a.data.as_str());
    if !builtin {
        return load_folders(a, seed);
    }
    if a.val_data.is_some() {
        return Err(Error::Usage(format!(
            "--val-data needs an image folder as --data, not '{}'",
            a.data
        )));
    }
    let (train, val, native) = match a.data.as_str() {
        "digits" => {
            let (t, v) = load_digits(a.val_fraction, seed)?;
            (t, v, 32)
        }
        "fashion-mnist" => {
            let (t, v) = load_fashion_mnist()?;
            (t, v, 28)
        }
        _ => {
            let classes = a.classes.unwrap_or(SYNTHETIC_CLASSES);
            if classes < 2 {
                return Err(Error::Usage("--classes must be at least 2".into()));
            }
            // Made per index when the loader asks (the same images as
            // generating them all): the set costs no memory.
            let size = a.image_size.unwrap_or(32);
            let train = SyntheticGratings::on_demand(
                a.train_size,
                size,
                classes,
                seed.wrapping_mul(2).wrapping_add(1),
            );
            let val = SyntheticGratings::on_demand(
                a.val_size,
                size,
                classes,
                seed.wrapping_mul(2).wrapping_add(2),
            );
            return Ok(Data {
                train: Box::new(train),
                val: Box::new(val),
                size,
                workers: 0,
                class_names: None,
                eval_transform: None,
            });
        }
    };
    let size = a.image_size.unwrap_or(native);
    let (train, val): (InMemoryDataset, InMemoryDataset) = (train.resized(size), val.resized(size));
    Ok(Data {
        train: Box::new(train),
        val: Box::new(val),
        size,
        workers: 0,
        class_names: None,
        eval_transform: None,
    })
}

/// A folder `data` (and `val_data`): image folders decoded on the fly.
fn load_folders(a: &DataOptions, seed: u64) -> Result<Data> {
    let root = PathBuf::from(&a.data);
    if !root.is_dir() {
        let looks_like_a_path = a.data.contains(['/', '\\']) || a.data.starts_with('.');
        return Err(Error::Usage(if root.exists() {
            format!(
                "--data {}: not a directory (an image folder holds one sub-folder per class)",
                a.data
            )
        } else if looks_like_a_path {
            format!("--data: no such directory: {}", a.data)
        } else {
            format!(
                "unknown dataset '{}' (choose digits, fashion-mnist, synthetic or an image folder; no such directory either)",
                a.data
            )
        }));
    }
    let size = a.image_size.unwrap_or(224);
    let folder = ImageFolder::scan(&root)?;
    let (train, val) = match &a.val_data {
        Some(v) => {
            let val = ImageFolder::scan(v)?;
            if val.classes != folder.classes {
                return Err(Error::BadData {
                    path: v.display().to_string(),
                    reason: format!(
                        "class folders {:?} differ from those of {}: {:?} (labels would not match)",
                        val.classes,
                        root.display(),
                        folder.classes
                    ),
                });
            }
            (folder, val)
        }
        None => folder.split(a.val_fraction, seed)?,
    };
    let (train_tf, val_tf) = if a.no_augment {
        (Transform::no_augment(size), Transform::no_augment(size))
    } else {
        (Transform::train(size), Transform::eval(size))
    };
    let class_names = Some(val.classes.clone());
    Ok(Data {
        class_names,
        train: Box::new(ImageFolderDataset {
            folder: train,
            transform: train_tf,
            seed,
        }),
        val: Box::new(ImageFolderDataset {
            folder: val,
            transform: val_tf,
            seed,
        }),
        size,
        workers: a.workers,
        eval_transform: Some(val_tf),
    })
}
