//! An embedded real dataset: scikit-learn's 8×8 handwritten digits (1,797
//! images, 10 classes, pixel values 0..16), a copy of the test set of the UCI
//! ML "Optical Recognition of Handwritten Digits" dataset by E. Alpaydin and
//! C. Kaynak, CC BY 4.0. Source and attribution: `assets/README.md`.

use std::io::Read;

use super::{InMemoryDataset, seeded_split};
use crate::error::{Error, Result};
use flate2::read::GzDecoder;

/// `sklearn/datasets/data/digits.csv.gz`: one image a line, 64 pixels then
/// the label.
static DIGITS_CSV_GZ: &[u8] = include_bytes!("../../assets/digits.csv.gz");
const DIGITS_NAME: &str = "assets/digits.csv.gz (embedded)";

pub const DIGITS_LEN: usize = 1797;
pub const DIGITS_SIZE: usize = 8;
pub const DIGITS_CLASSES: usize = 10;
const PIXELS: usize = DIGITS_SIZE * DIGITS_SIZE;

/// The embedded digits split into (train, val): a seeded shuffle (ChaCha8)
/// of all 1,797 images, the first `round(1797 · val_fraction)` of which form
/// the validation set, in shuffled order. Pixels are scaled by 1/16, then
/// normalised with the mean and std of all 1,797 images, and replicated to 3
/// channels (8×8×3).
pub fn load_digits(val_fraction: f32, seed: u64) -> Result<(InMemoryDataset, InMemoryDataset)> {
    let (pixels, labels) = parse_digits_csv_gz(DIGITS_CSV_GZ, DIGITS_NAME)?;
    let (mean, std) = mean_std(&pixels);
    let (train_idx, val_idx) = seeded_split(labels.len(), val_fraction, seed, "load_digits")?;
    let build = |idx: &[usize]| {
        let mut images = Vec::with_capacity(idx.len() * PIXELS * 3);
        for &i in idx {
            for &p in &pixels[i * PIXELS..(i + 1) * PIXELS] {
                let v = ((p as f64 / 16.0 - mean) / std) as f32;
                images.extend_from_slice(&[v, v, v]);
            }
        }
        InMemoryDataset {
            images,
            labels: idx.iter().map(|&i| labels[i] as usize).collect(),
            h: DIGITS_SIZE,
            w: DIGITS_SIZE,
            classes: DIGITS_CLASSES,
        }
    };
    Ok((build(&train_idx), build(&val_idx)))
}

/// Mean and (population) std of all pixels scaled by 1/16.
fn mean_std(pixels: &[u8]) -> (f64, f64) {
    let n = pixels.len().max(1) as f64;
    let mean = pixels.iter().map(|&p| p as f64 / 16.0).sum::<f64>() / n;
    let var = pixels
        .iter()
        .map(|&p| (p as f64 / 16.0 - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, var.sqrt().max(f64::MIN_POSITIVE))
}

fn bad(name: &str, reason: impl Into<String>) -> Error {
    Error::BadData {
        path: name.to_string(),
        reason: reason.into(),
    }
}

/// Parses the gzipped CSV into (pixels 0..16, row-major (n, 64); labels 0..9)
/// and checks it has exactly [`DIGITS_LEN`] rows.
fn parse_digits_csv_gz(gz: &[u8], name: &str) -> Result<(Vec<u8>, Vec<u8>)> {
    let mut text = String::new();
    GzDecoder::new(gz)
        .read_to_string(&mut text)
        .map_err(|e| bad(name, format!("bad gzip / UTF-8 data: {e}")))?;
    let (pixels, labels) = parse_digits_csv(&text, name)?;
    if labels.len() != DIGITS_LEN {
        return Err(bad(
            name,
            format!("{} images, expected {DIGITS_LEN}", labels.len()),
        ));
    }
    Ok((pixels, labels))
}

fn parse_digits_csv(text: &str, name: &str) -> Result<(Vec<u8>, Vec<u8>)> {
    let mut pixels = Vec::with_capacity(DIGITS_LEN * PIXELS);
    let mut labels = Vec::with_capacity(DIGITS_LEN);
    for (ln, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != PIXELS + 1 {
            return Err(bad(
                name,
                format!(
                    "line {}: {} fields, expected {} (64 pixels and a label)",
                    ln + 1,
                    fields.len(),
                    PIXELS + 1
                ),
            ));
        }
        for (j, f) in fields.iter().enumerate() {
            let (max, what) = if j < PIXELS {
                (16, "pixel")
            } else {
                (9, "label")
            };
            let v = parse_int(f).filter(|&v| v <= max).ok_or_else(|| {
                bad(
                    name,
                    format!(
                        "line {} field {}: {what} {:?} is not an integer in 0..={max}",
                        ln + 1,
                        j + 1,
                        f.trim()
                    ),
                )
            })?;
            if j < PIXELS {
                pixels.push(v);
            } else {
                labels.push(v);
            }
        }
    }
    Ok((pixels, labels))
}

/// An integer written as `7` or `7.0`.
fn parse_int(s: &str) -> Option<u8> {
    let s = s.trim();
    if let Ok(v) = s.parse::<u8>() {
        return Some(v);
    }
    let f = s.parse::<f64>().ok()?;
    (f.fract() == 0.0 && (0.0..=255.0).contains(&f)).then_some(f as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_file_parses() {
        let (p, l) = parse_digits_csv_gz(DIGITS_CSV_GZ, DIGITS_NAME).unwrap();
        assert_eq!(p.len(), DIGITS_LEN * 64);
        assert_eq!(l.len(), DIGITS_LEN);
        assert!(p.iter().all(|&v| v <= 16));
        assert_eq!(*p.iter().max().unwrap(), 16);
        // The first image of sklearn's load_digits() is a 0.
        assert_eq!(l[0], 0);
        assert_eq!(&p[..8], &[0, 0, 5, 13, 9, 1, 0, 0]);
    }

    #[test]
    fn bad_csv_is_bad_data() {
        let e = parse_digits_csv("1,2,3\n", "t.csv").unwrap_err();
        assert!(matches!(e, Error::BadData { .. }));
        assert!(e.to_string().contains("line 1: 3 fields"), "{e}");

        let mut row = vec!["0"; 64];
        row.push("10");
        let e = parse_digits_csv(&row.join(","), "t.csv").unwrap_err();
        assert!(e.to_string().contains("label \"10\""), "{e}");

        let mut row = vec!["0"; 64];
        row[5] = "17";
        row.push("3");
        let e = parse_digits_csv(&row.join(","), "t.csv").unwrap_err();
        assert!(
            e.to_string().contains("line 1 field 6: pixel \"17\""),
            "{e}"
        );

        let mut row = vec!["1.0"; 64];
        row.push("3");
        let (p, l) = parse_digits_csv(&row.join(","), "t.csv").unwrap();
        assert_eq!((p.len(), l), (64, vec![3]));

        let e = parse_digits_csv_gz(b"not gzip", "t.csv.gz").unwrap_err();
        assert!(e.to_string().contains("t.csv.gz: bad gzip"), "{e}");
    }

    #[test]
    fn bad_val_fraction() {
        for f in [-0.1f32, 1.0, f32::NAN] {
            assert!(load_digits(f, 0).is_err());
        }
    }
}
