//! Writing a model's state_dict as a torchvision-loadable safetensors file.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, View};

use crate::error::{Error, Result};
use crate::nn::{ResNet, StateSlot};

/// One tensor ready to be written: little-endian bytes in PyTorch layout.
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Entry {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Every state_dict entry of `model` in torchvision names and layout: conv
/// weights OIHW, all parameters and running statistics F32, and
/// `num_batches_tracked` an I64 0-d tensor (shape `[]`), as `torch.save`
/// would write them. Values come through the backend's host copy, so a
/// model on a GPU saves as one on the CPU.
fn state_entries(model: &mut ResNet) -> Result<Vec<(String, Entry)>> {
    let mut out = Vec::new();
    let mut res = Ok(());
    model.visit_state(|slot| {
        if res.is_err() {
            return;
        }
        let name = slot.name().to_string();
        let entry = match slot {
            StateSlot::Param {
                param,
                torch_shape,
                layout,
            } => match crate::backend::copy_to_host(&param.value) {
                Ok(v) => Entry {
                    dtype: Dtype::F32,
                    bytes: f32_bytes(&layout.to_torch(&v, &torch_shape)),
                    shape: torch_shape,
                },
                Err(e) => {
                    res = Err(e);
                    return;
                }
            },
            StateSlot::Buffer { tensor, .. } => match crate::backend::copy_to_host(tensor) {
                Ok(v) => Entry {
                    dtype: Dtype::F32,
                    shape: vec![tensor.numel()],
                    bytes: f32_bytes(&v),
                },
                Err(e) => {
                    res = Err(e);
                    return;
                }
            },
            StateSlot::Count { value, .. } => Entry {
                dtype: Dtype::I64,
                shape: vec![],
                bytes: value.to_le_bytes().to_vec(),
            },
        };
        out.push((name, entry));
    });
    res.map(|()| out)
}

/// Writes every state_dict entry of `model` to `path` as safetensors, in
/// torchvision's names and layout, so that
/// `torchvision.models.resnet50().load_state_dict(safetensors.torch.load_file(path), strict=True)`
/// accepts it (see `tools/check_export.py`). Metadata: `format` = `pt`,
/// `generator` = `memfit`.
///
/// The write is atomic: the bytes go to a temporary file in the target's
/// directory, which is fsynced and renamed over `path`, then the directory is
/// fsynced. On any failure the previous file at `path` (if any) is left
/// intact and the error is an [`Error::Io`] naming `path`.
pub fn save_state_dict(model: &mut ResNet, path: &Path) -> Result<()> {
    let entries = state_entries(model)?;
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("generator".to_string(), "memfit".to_string()),
    ]);
    let bytes =
        safetensors::serialize(entries.iter().map(|(n, e)| (n.as_str(), e)), Some(metadata))
            .map_err(|e| io_err(path, format!("cannot serialise the state_dict: {e}")))?;
    drop(entries);
    write_atomic(path, &bytes)
}

/// [`save_state_dict`] plus extra f32 tensors (`(name, shape, values)`,
/// names that no state_dict entry uses) and metadata: a training-state
/// checkpoint. Atomic like `save_state_dict`.
pub fn save_state_dict_with(
    model: &mut ResNet,
    extras: &[(String, Vec<usize>, &[f32])],
    mut metadata: HashMap<String, String>,
    path: &Path,
) -> Result<()> {
    let mut entries = state_entries(model)?;
    for (name, shape, values) in extras {
        entries.push((
            name.clone(),
            Entry {
                dtype: Dtype::F32,
                shape: shape.clone(),
                bytes: f32_bytes(values),
            },
        ));
    }
    metadata.insert("format".to_string(), "pt".to_string());
    metadata.insert("generator".to_string(), "memfit".to_string());
    let bytes =
        safetensors::serialize(entries.iter().map(|(n, e)| (n.as_str(), e)), Some(metadata))
            .map_err(|e| io_err(path, format!("cannot serialise the checkpoint: {e}")))?;
    drop(entries);
    write_atomic(path, &bytes)
}

fn io_err(path: &Path, reason: String) -> Error {
    Error::Io {
        path: path.display().to_string(),
        reason,
    }
}

/// `path`'s directory ("." for a bare file name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory
/// (fsync, rename, fsync of the directory).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let Some(file_name) = path.file_name() else {
        return Err(io_err(path, "is not a file path".into()));
    };
    if path.is_dir() {
        return Err(io_err(path, "is a directory, expected a file path".into()));
    }
    let dir = parent_dir(path);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(
        ".{}.{}.{nanos}.tmp",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| {
            io_err(
                path,
                format!("cannot create a temporary file in '{}': {e}", dir.display()),
            )
        })?;
    let written = file
        .write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| format!("cannot write '{}': {e}", tmp.display()));
    drop(file);
    let renamed = written.and_then(|()| {
        fs::rename(&tmp, path)
            .map_err(|e| format!("cannot rename '{}' over it: {e}", tmp.display()))
    });
    if let Err(reason) = renamed {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(path, reason));
    }
    sync_dir(&dir).map_err(|e| {
        io_err(
            path,
            format!(
                "written, but cannot fsync directory '{}': {e}",
                dir.display()
            ),
        )
    })
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    // Directories cannot be opened for fsync on this platform; the rename
    // itself is what makes the replacement atomic.
    Ok(())
}
