//! IDX files, the format of MNIST and Fashion-MNIST: a big-endian header
//! (magic `0x0000 TT NN` with element type `TT` = 0x08 for u8 and `NN`
//! dimensions, then `NN` u32 sizes) followed by the raw elements. Files may
//! be gzip-compressed (detected by the gzip magic bytes `1f 8b`).
//!
//! Every check on the file contents returns [`Error::BadData`] naming the
//! file and the problem; nothing here panics on bad input.

use std::io::Read;
use std::path::Path;

use flate2::read::GzDecoder;

use super::InMemoryDataset;
use crate::error::{Error, Result};

/// Magic of a u8 IDX file with three dimensions (n, rows, cols): images.
pub const IDX_IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic of a u8 IDX file with one dimension (n): labels.
pub const IDX_LABELS_MAGIC: u32 = 0x0000_0801;

/// u8 images read from an IDX file, row-major `(n, rows, cols)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxImages {
    pub pixels: Vec<u8>,
    pub n: usize,
    pub rows: usize,
    pub cols: usize,
}

/// Reads an IDX u8 image file (magic 0x00000803), gzip or plain.
pub fn read_idx_images(path: &Path) -> Result<IdxImages> {
    let (dims, payload) = read_idx(path, IDX_IMAGES_MAGIC, "images")?;
    images_from(path, dims, payload)
}

fn images_from(path: &Path, dims: Vec<usize>, payload: Vec<u8>) -> Result<IdxImages> {
    let (n, rows, cols) = (dims[0], dims[1], dims[2]);
    if (rows == 0 || cols == 0) && n > 0 {
        return Err(bad(path, format!("images of size {rows}x{cols}")));
    }
    Ok(IdxImages {
        pixels: payload,
        n,
        rows,
        cols,
    })
}

/// Reads an IDX u8 label file (magic 0x00000801), gzip or plain.
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>> {
    let (_, payload) = read_idx(path, IDX_LABELS_MAGIC, "labels")?;
    Ok(payload)
}

/// Turns IDX grayscale images and labels into an [`InMemoryDataset`]:
/// u8 → f32 in [0, 1], then `(v - mean) / std`, replicated to 3 channels
/// (NHWC). `path` names the source in error messages.
pub fn idx_to_dataset(
    images: &IdxImages,
    labels: &[u8],
    classes: usize,
    mean: f32,
    std: f32,
    path: &str,
) -> Result<InMemoryDataset> {
    if !(std.is_finite() && std > 0.0 && mean.is_finite()) {
        return Err(Error::invalid(
            "idx_to_dataset",
            format!("normalisation needs a finite mean and std > 0, got mean {mean}, std {std}"),
        ));
    }
    let plane = images.rows.checked_mul(images.cols);
    let total = plane.and_then(|p| p.checked_mul(images.n));
    if total != Some(images.pixels.len()) {
        return Err(Error::BadData {
            path: path.to_string(),
            reason: format!(
                "{} pixel bytes do not make {} images of {}x{}",
                images.pixels.len(),
                images.n,
                images.rows,
                images.cols
            ),
        });
    }
    if labels.len() != images.n {
        return Err(Error::BadData {
            path: path.to_string(),
            reason: format!(
                "{} labels for {} images; the counts must match",
                labels.len(),
                images.n
            ),
        });
    }
    if let Some((i, &l)) = labels
        .iter()
        .enumerate()
        .find(|&(_, &l)| l as usize >= classes)
    {
        return Err(Error::BadData {
            path: path.to_string(),
            reason: format!(
                "label {l} at index {i} is out of range for {classes} classes (must be < {classes})"
            ),
        });
    }
    let scale = 1.0 / (255.0 * std);
    let shift = mean / std;
    let mut out = Vec::with_capacity(images.pixels.len() * 3);
    for &p in &images.pixels {
        let v = p as f32 * scale - shift;
        out.extend_from_slice(&[v, v, v]);
    }
    Ok(InMemoryDataset {
        images: out,
        labels: labels.iter().map(|&l| l as usize).collect(),
        h: images.rows,
        w: images.cols,
        classes,
    })
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::BadData {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// Parses the bytes of an IDX u8 image file (plain or gzip); `path` only
/// names it in errors. The file-free entry point of [`read_idx_images`].
pub fn parse_idx_images(bytes: Vec<u8>, path: &Path) -> Result<IdxImages> {
    let (dims, payload) = parse_idx(bytes, path, IDX_IMAGES_MAGIC, "images")?;
    images_from(path, dims, payload)
}

/// Parses the bytes of an IDX u8 label file (plain or gzip).
pub fn parse_idx_labels(bytes: Vec<u8>, path: &Path) -> Result<Vec<u8>> {
    Ok(parse_idx(bytes, path, IDX_LABELS_MAGIC, "labels")?.1)
}

/// How far past the size its header declares a gzip stream is inflated:
/// enough to count a few stray bytes, never a decompression bomb.
const GZIP_SLACK: usize = 1 << 20;

/// Inflates at most `limit` bytes of `raw`.
fn gunzip(raw: &[u8], limit: usize, path: &Path) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    GzDecoder::new(raw)
        .take(limit as u64)
        .read_to_end(&mut out)
        .map_err(|e| bad(path, format!("bad gzip data: {e}")))?;
    Ok(out)
}

/// The element count an IDX header declares, if `head` holds a whole one.
fn declared_len(head: &[u8], ndims: usize) -> Option<usize> {
    (0..ndims).try_fold(1usize, |acc, d| {
        let o = 4 + 4 * d;
        let b = head.get(o..o + 4)?;
        acc.checked_mul(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    })
}

/// Reads the whole file (gunzipping if needed), checks the magic and that the
/// element count in the header matches the bytes after it exactly. Returns
/// the dimensions and the element bytes.
fn read_idx(path: &Path, expected_magic: u32, what: &str) -> Result<(Vec<usize>, Vec<u8>)> {
    let raw = std::fs::read(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        reason: format!("cannot read IDX {what} file: {e}"),
    })?;
    parse_idx(raw, path, expected_magic, what)
}

/// [`read_idx`] on bytes. A gzip stream is inflated only as far as its
/// header says (plus [`GZIP_SLACK`]), so a small hostile file cannot make
/// it allocate gigabytes.
fn parse_idx(
    raw: Vec<u8>,
    path: &Path,
    expected_magic: u32,
    what: &str,
) -> Result<(Vec<usize>, Vec<u8>)> {
    if raw.is_empty() {
        return Err(bad(
            path,
            format!("empty file (0 bytes), expected IDX {what}"),
        ));
    }
    let gz = raw.starts_with(&[0x1f, 0x8b]);
    let data = if gz {
        let header = 4 + 4 * (expected_magic & 0xff) as usize;
        let head = gunzip(&raw, header, path)?;
        let limit = declared_len(&head, (expected_magic & 0xff) as usize)
            .and_then(|n| n.checked_add(header + GZIP_SLACK))
            .unwrap_or(header);
        let out = gunzip(&raw, limit, path)?;
        if out.is_empty() {
            return Err(bad(
                path,
                format!("gzip stream decompresses to 0 bytes, expected IDX {what}"),
            ));
        }
        out
    } else {
        raw
    };
    let src = if gz { " (after gunzip)" } else { "" };
    if data.len() < 4 {
        return Err(bad(
            path,
            format!(
                "truncated: {} bytes{src}, too short for the 4-byte IDX magic",
                data.len()
            ),
        ));
    }
    let magic = u32::from_be_bytes([data[0], data[1], data[2], data[3]]);
    if magic != expected_magic {
        let hint = match magic {
            IDX_IMAGES_MAGIC => " (this is an IDX images file)",
            IDX_LABELS_MAGIC => " (this is an IDX labels file)",
            _ if data[0] != 0 || data[1] != 0 => " (not an IDX file)",
            _ => "",
        };
        return Err(bad(
            path,
            format!(
                "wrong IDX magic 0x{magic:08x}, expected 0x{expected_magic:08x} (u8 {what}){hint}"
            ),
        ));
    }
    let ndims = (expected_magic & 0xff) as usize;
    let header = 4 + 4 * ndims;
    if data.len() < header {
        return Err(bad(
            path,
            format!(
                "truncated header: {} bytes{src}, the {ndims}-dimensional IDX header needs {header}",
                data.len()
            ),
        ));
    }
    let dims: Vec<usize> = (0..ndims)
        .map(|d| {
            let o = 4 + 4 * d;
            u32::from_be_bytes([data[o], data[o + 1], data[o + 2], data[o + 3]]) as usize
        })
        .collect();
    let shape = dims
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("x");
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(path, format!("header dimensions {shape} overflow")))?;
    let have = data.len() - header;
    if have < expected {
        return Err(bad(
            path,
            format!(
                "truncated: header says {shape} = {expected} bytes of {what}, \
                 but only {have} follow the header{src}"
            ),
        ));
    }
    if have > expected {
        return Err(bad(
            path,
            format!(
                "trailing data: header says {shape} = {expected} bytes of {what}, \
                 but {have} follow the header{src} ({} extra)",
                have - expected
            ),
        ));
    }
    let mut data = data;
    data.drain(..header);
    Ok((dims, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "memfit-idx-unit-{name}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn header_only_empty_set_is_fine() {
        let dir = tmp("empty-set");
        let p = dir.join("e.idx");
        let mut b = IDX_IMAGES_MAGIC.to_be_bytes().to_vec();
        for d in [0u32, 28, 28] {
            b.extend_from_slice(&d.to_be_bytes());
        }
        std::fs::write(&p, &b).unwrap();
        let im = read_idx_images(&p).unwrap();
        assert_eq!((im.n, im.rows, im.cols, im.pixels.len()), (0, 28, 28, 0));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn short_header_is_truncated() {
        let dir = tmp("short-header");
        let p = dir.join("s.idx");
        let mut b = IDX_IMAGES_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&[0, 0, 0, 1, 0, 0]);
        std::fs::write(&p, &b).unwrap();
        let msg = read_idx_images(&p).unwrap_err().to_string();
        assert!(msg.contains("truncated header"), "{msg}");
        assert!(msg.contains("s.idx"), "{msg}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn normalisation_values() {
        let im = IdxImages {
            pixels: vec![0, 255, 51, 102],
            n: 1,
            rows: 2,
            cols: 2,
        };
        let ds = idx_to_dataset(&im, &[3], 4, 0.5, 0.25, "x").unwrap();
        let want = [-2.0f32, 2.0, -1.2, -0.4];
        assert_eq!(ds.images.len(), 12);
        for (i, w) in want.iter().enumerate() {
            for c in 0..3 {
                assert!((ds.images[i * 3 + c] - w).abs() < 1e-5, "{:?}", ds.images);
            }
        }
        let err = idx_to_dataset(&im, &[3], 4, 0.5, 0.0, "x").unwrap_err();
        assert!(err.to_string().contains("std > 0"), "{err}");
        let bad_len = IdxImages {
            pixels: vec![0; 3],
            ..im
        };
        let err = idx_to_dataset(&bad_len, &[3], 4, 0.5, 0.25, "x.idx").unwrap_err();
        assert!(err.to_string().contains("x.idx"), "{err}");
    }
}
