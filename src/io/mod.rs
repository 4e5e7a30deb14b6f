//! Weights in torchvision's state_dict layout, read from safetensors.
//! Every problem with a file becomes an [`Error::BadWeights`] naming the
//! file and the tensor.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::nn::{ResNet, StateSlot, WeightLayout};
use crate::ops::conv2d::oihw_to_hwio;

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
        let bytes = std::fs::read(path.as_ref()).map_err(|e| Error::Io {
            path: path_s.clone(),
            reason: e.to_string(),
        })?;
        Self::parse(&path_s, &bytes)
    }

    pub fn parse(path: &str, bytes: &[u8]) -> Result<Self> {
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
                    return Err(bad(format!(
                        "tensor '{name}' has dtype {other:?}; only F32 and I64 are supported"
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

/// Loads a torchvision-layout state_dict into `model`. Names, shapes and
/// dtypes are checked; every missing, unexpected or mis-shaped entry is
/// listed in one error. Keys starting with one of `ignore_prefixes` are
/// skipped (a file may carry other tensors).
pub fn load_state_dict(
    model: &mut ResNet,
    file: &TensorFile,
    ignore_prefixes: &[&str],
) -> Result<()> {
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    model.visit_state(|slot| {
        let name = slot.name().to_string();
        seen.insert(name.clone());
        let Some(t) = file.tensors.get(&name) else {
            problems.push(format!("missing '{name}'"));
            return;
        };
        match (slot, &t.data) {
            (
                StateSlot::Param {
                    param,
                    torch_shape,
                    layout,
                },
                RawData::F32(v),
            ) => {
                if t.shape != torch_shape {
                    problems.push(format!(
                        "'{name}' has shape {:?}, expected {torch_shape:?}",
                        t.shape
                    ));
                    return;
                }
                let values = match layout {
                    WeightLayout::Plain => v.clone(),
                    WeightLayout::Hwio => oihw_to_hwio(
                        v,
                        torch_shape[0],
                        torch_shape[1],
                        torch_shape[2],
                        torch_shape[3],
                    ),
                };
                param.value.f32_mut().copy_from_slice(&values);
            }
            (StateSlot::Buffer { data, .. }, RawData::F32(v)) => {
                if t.shape != [data.len()] {
                    problems.push(format!(
                        "'{name}' has shape {:?}, expected [{}]",
                        t.shape,
                        data.len()
                    ));
                    return;
                }
                data.copy_from_slice(v);
            }
            (StateSlot::Count { value, .. }, RawData::I64(v)) => {
                // torch saves a 0-d tensor; accept [] and [1].
                if v.len() != 1 {
                    problems.push(format!("'{name}' holds {} values, expected one", v.len()));
                    return;
                }
                *value = v[0];
            }
            (StateSlot::Count { .. }, RawData::F32(_)) => {
                problems.push(format!("'{name}' is F32, expected I64"))
            }
            (_, RawData::I64(_)) => problems.push(format!("'{name}' is I64, expected F32")),
        }
    });
    for name in file.tensors.keys() {
        if !seen.contains(name) && !ignore_prefixes.iter().any(|p| name.starts_with(p)) {
            problems.push(format!("unexpected '{name}'"));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::BadWeights {
            path: file.path.clone(),
            reason: format!(
                "does not match the model ({} problems):\n  {}",
                problems.len(),
                problems.join("\n  ")
            ),
        })
    }
}
