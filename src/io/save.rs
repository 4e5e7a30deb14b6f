//! Writing a model's state_dict as a torchvision-loadable safetensors file.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorInfo;

use crate::error::{Error, Result};
use crate::nn::{ResNet, StateSlot};
use crate::tensor::Tensor;

/// One tensor of the file as the header describes it.
struct EntryInfo {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: usize,
}

/// Writes a tensor's values as little-endian f32 in bounded chunks (a
/// whole-tensor byte copy would double the tensor's footprint once more).
fn write_f32(out: &mut impl Write, v: &[f32]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(16 << 10);
    for chunk in v.chunks(4 << 10) {
        buf.clear();
        buf.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
        out.write_all(&buf)?;
    }
    Ok(())
}

/// The state_dict entries of `model` (torchvision names and layout: conv
/// weights OIHW, parameters and running statistics F32,
/// `num_batches_tracked` an I64 0-d tensor, as `torch.save` writes them),
/// described without copying any values.
fn state_infos(model: &mut ResNet) -> Vec<EntryInfo> {
    let mut out = Vec::new();
    model.visit_state(|slot| {
        let name = slot.name().to_string();
        let (dtype, shape) = match slot {
            StateSlot::Param { torch_shape, .. } => (Dtype::F32, torch_shape),
            StateSlot::Buffer { tensor, .. } => (Dtype::F32, vec![tensor.numel()]),
            StateSlot::Count { .. } => (Dtype::I64, vec![]),
        };
        let bytes = shape.iter().product::<usize>() * dtype.bitsize() / 8;
        out.push(EntryInfo {
            name,
            dtype,
            shape,
            bytes,
        });
    });
    out
}

/// The safetensors header for `infos` and `metadata`, in the order
/// `safetensors::serialize` lays the data out (descending dtype alignment,
/// then name), with the metadata keys sorted so equal states give equal
/// files; padded with spaces to a multiple of 8 bytes. Returns the header
/// and each entry's data offset by name.
fn header(
    infos: &[EntryInfo],
    metadata: &BTreeMap<String, String>,
) -> std::result::Result<(Vec<u8>, HashMap<String, usize>), String> {
    let mut order: Vec<&EntryInfo> = infos.iter().collect();
    order.sort_by(|a, b| b.dtype.cmp(&a.dtype).then(a.name.cmp(&b.name)));
    let mut text = String::from("{\"__metadata__\":");
    text.push_str(&serde_json::to_string(metadata).map_err(|e| e.to_string())?);
    let mut offsets = HashMap::new();
    let mut at = 0;
    for e in order {
        if offsets.insert(e.name.clone(), at).is_some() {
            return Err(format!("two tensors are named '{}'", e.name));
        }
        let info = TensorInfo {
            dtype: e.dtype,
            shape: e.shape.clone(),
            data_offsets: (at, at + e.bytes),
        };
        text.push(',');
        text.push_str(&serde_json::to_string(&e.name).map_err(|e| e.to_string())?);
        text.push(':');
        text.push_str(&serde_json::to_string(&info).map_err(|e| e.to_string())?);
        at += e.bytes;
    }
    text.push('}');
    let mut bytes = text.into_bytes();
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    Ok((bytes, offsets))
}

/// Streams `model`'s state_dict and `extras` into `file` as safetensors:
/// the header first, then each tensor copied to the host, converted and
/// written at its offset one at a time, so saving holds one tensor's copy
/// at most (the whole file used to be built in memory: `--save-dir`
/// doubled the resident set).
fn write_safetensors(
    file: &mut File,
    model: &mut ResNet,
    extras: &[(String, &Tensor)],
    metadata: &BTreeMap<String, String>,
) -> std::result::Result<(), String> {
    let mut infos = state_infos(model);
    for (name, t) in extras {
        infos.push(EntryInfo {
            name: name.clone(),
            dtype: Dtype::F32,
            shape: t.dims().to_vec(),
            bytes: t.numel() * 4,
        });
    }
    let (head, offsets) = header(&infos, metadata)?;
    let data_start = 8 + head.len() as u64;
    let io = |e: std::io::Error| e.to_string();
    {
        let mut w = BufWriter::new(&mut *file);
        w.write_all(&(head.len() as u64).to_le_bytes())
            .map_err(io)?;
        w.write_all(&head).map_err(io)?;
        w.flush().map_err(io)?;
    }
    let mut res: std::result::Result<(), String> = Ok(());
    let put = |file: &mut File,
               name: &str,
               write: &mut dyn FnMut(&mut BufWriter<&mut File>) -> std::io::Result<()>|
     -> std::result::Result<(), String> {
        let at = offsets[name] as u64;
        file.seek(SeekFrom::Start(data_start + at)).map_err(io)?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        write(&mut w).map_err(io)?;
        w.flush().map_err(io)
    };
    model.visit_state(|slot| {
        if res.is_err() {
            return;
        }
        let name = slot.name().to_string();
        res = match slot {
            StateSlot::Param {
                param,
                torch_shape,
                layout,
            } => crate::backend::copy_to_host(&param.value)
                .map_err(|e| e.to_string())
                .and_then(|v| {
                    let torch = layout.to_torch(&v, &torch_shape);
                    drop(v);
                    put(file, &name, &mut |w| write_f32(w, &torch))
                }),
            StateSlot::Buffer { tensor, .. } => crate::backend::copy_to_host(tensor)
                .map_err(|e| e.to_string())
                .and_then(|v| put(file, &name, &mut |w| write_f32(w, &v))),
            StateSlot::Count { value, .. } => {
                put(file, &name, &mut |w| w.write_all(&value.to_le_bytes()))
            }
        };
    });
    res?;
    for (name, t) in extras {
        let v = crate::backend::copy_to_host(t).map_err(|e| e.to_string())?;
        put(file, name, &mut |w| write_f32(w, &v))?;
    }
    Ok(())
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
    save_state_dict_with(model, &[], HashMap::new(), path)
}

/// [`save_state_dict`] plus extra f32 tensors (`(name, tensor)`, names that
/// no state_dict entry uses; on any device) and metadata: a training-state
/// checkpoint. Atomic like `save_state_dict`; the same state and metadata
/// give the same bytes.
pub fn save_state_dict_with(
    model: &mut ResNet,
    extras: &[(String, &Tensor)],
    metadata: HashMap<String, String>,
    path: &Path,
) -> Result<()> {
    let mut metadata: BTreeMap<String, String> = metadata.into_iter().collect();
    metadata.insert("format".to_string(), "pt".to_string());
    metadata.insert("generator".to_string(), "memfit".to_string());
    write_atomic(path, |file| {
        write_safetensors(file, model, extras, &metadata)
    })
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
pub(crate) fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut File) -> std::result::Result<(), String>,
) -> Result<()> {
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
    let written = write(&mut file)
        .and_then(|()| file.sync_all().map_err(|e| e.to_string()))
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
