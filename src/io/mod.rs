//! Weights in torchvision's state_dict layout, read from and written to
//! safetensors. Every problem with a file becomes an [`Error::BadWeights`]
//! naming the file and the tensor; a failed write is an [`Error::Io`] naming
//! the target.
//!
//! - [`TensorFile`]: a decoded safetensors file (F32 / I64 tensors), or a
//!   `torch.save` file (torchvision's `.pth`), read by [`pth`] without
//!   running any of its pickle.
//! - [`load_state_dict`], [`load_torchvision`], [`fc_rows`]: into a model.
//! - [`ModelMeta`]: what a file says it is (model, width, stem, classes).
//! - [`save_state_dict`]: out of a model, loadable by
//!   `torchvision.models.<name>().load_state_dict(..., strict=True)`.

mod load;
mod meta;
pub mod pth;
mod save;

pub use load::{STATE_EXTRAS_PREFIX, STATE_FILE_KEY, fc_rows, load_state_dict, load_torchvision};
pub use meta::{FolderInput, InputMeta, ModelMeta, guess_architecture, stem_flag};
pub(crate) use save::write_atomic;
pub use save::{save_state_dict, save_state_dict_with};

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};

/// Element data of one tensor in a file.
#[derive(Clone, Debug)]
pub enum RawData {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

#[derive(Clone, Debug)]
pub struct RawTensor {
    pub shape: Vec<usize>,
    pub data: RawData,
}

/// The tensors of a safetensors file, decoded into owned f32/i64 vectors.
pub struct TensorFile {
    pub path: String,
    pub tensors: BTreeMap<String, RawTensor>,
    pub metadata: BTreeMap<String, String>,
}

impl TensorFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path_s = path.as_ref().display().to_string();
        if path.as_ref().is_dir() {
            return Err(Error::Io {
                path: path_s,
                reason: "is a directory, expected a .safetensors file".into(),
            });
        }
        let bytes = std::fs::read(path.as_ref()).map_err(|e| Error::Io {
            path: path_s.clone(),
            reason: e.to_string(),
        })?;
        Self::parse(&path_s, &bytes)
    }

    pub fn parse(path: &str, bytes: &[u8]) -> Result<Self> {
        // By content, not extension: torch.save files (torchvision's .pth).
        if pth::sniff(bytes).is_some() {
            return Ok(TensorFile {
                path: path.to_string(),
                tensors: pth::read(path, bytes)?,
                metadata: BTreeMap::new(),
            });
        }
        let bad = |reason: String| Error::BadWeights {
            path: path.to_string(),
            reason,
        };
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
        let (_, meta) =
            SafeTensors::read_metadata(bytes).map_err(|e| bad(format!("bad header: {e}")))?;
        let metadata = meta
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let mut tensors = BTreeMap::new();
        for (name, view) in st.tensors() {
            let raw = view.data();
            let data = match view.dtype() {
                Dtype::F32 => RawData::F32(
                    raw.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                ),
                Dtype::I64 => RawData::I64(
                    raw.chunks_exact(8)
                        .map(|b| {
                            i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
                        })
                        .collect(),
                ),
                other => {
                    let hint = if matches!(other, Dtype::F16 | Dtype::BF16 | Dtype::F64) {
                        " (convert it first, e.g. `{k: v.float() for k, v in sd.items()}` \
                         for floating tensors)"
                    } else {
                        ""
                    };
                    return Err(bad(format!(
                        "tensor '{name}' has dtype {other:?}; only F32 and I64 are supported{hint}"
                    )));
                }
            };
            tensors.insert(
                name.to_string(),
                RawTensor {
                    shape: view.shape().to_vec(),
                    data,
                },
            );
        }
        Ok(TensorFile {
            path: path.to_string(),
            tensors,
            metadata,
        })
    }

    fn get(&self, name: &str) -> Result<&RawTensor> {
        self.tensors.get(name).ok_or_else(|| Error::BadWeights {
            path: self.path.clone(),
            reason: format!("tensor '{name}' is missing"),
        })
    }

    /// An f32 tensor's shape and values.
    pub fn f32(&self, name: &str) -> Result<(&[usize], &[f32])> {
        let t = self.get(name)?;
        match &t.data {
            RawData::F32(v) => Ok((&t.shape, v)),
            RawData::I64(_) => Err(Error::BadWeights {
                path: self.path.clone(),
                reason: format!("tensor '{name}' is I64, expected F32"),
            }),
        }
    }

    pub fn i64(&self, name: &str) -> Result<(&[usize], &[i64])> {
        let t = self.get(name)?;
        match &t.data {
            RawData::I64(v) => Ok((&t.shape, v)),
            RawData::F32(_) => Err(Error::BadWeights {
                path: self.path.clone(),
                reason: format!("tensor '{name}' is F32, expected I64"),
            }),
        }
    }
}

/// NCHW to NHWC.
pub fn nchw_to_nhwc(x: &[f32], n: usize, c: usize, h: usize, w: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for i in 0..n {
        for ch in 0..c {
            for y in 0..h {
                for xx in 0..w {
                    out[((i * h + y) * w + xx) * c + ch] = x[((i * c + ch) * h + y) * w + xx];
                }
            }
        }
    }
    out
}

/// NHWC to NCHW.
pub fn nhwc_to_nchw(x: &[f32], n: usize, h: usize, w: usize, c: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for i in 0..n {
        for ch in 0..c {
            for y in 0..h {
                for xx in 0..w {
                    out[((i * c + ch) * h + y) * w + xx] = x[((i * h + y) * w + xx) * c + ch];
                }
            }
        }
    }
    out
}
