//! Image files to RGB bytes: JPEG (zune-jpeg) and PNG (png), chosen by the
//! file's magic bytes, never by its extension (a `.jpg` that is really a PNG
//! still decodes). Knows nothing of datasets, transforms or tensors.
//!
//! Conversions follow PIL's `Image.convert("RGB")`, which torchvision's
//! `ImageFolder` applies to every file: grayscale is replicated to three
//! channels, palettes are expanded, alpha is dropped (not composited), and
//! 16-bit samples keep their high byte.

use std::path::Path;

use png::{BitDepth, ColorType, Transformations};
use zune_jpeg::JpegDecoder;
use zune_jpeg::zune_core::bytestream::ZCursor;
use zune_jpeg::zune_core::colorspace::ColorSpace;
use zune_jpeg::zune_core::options::DecoderOptions;

use crate::error::{Error, Result};

/// A decoded image, interleaved RGB.
#[derive(Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub h: usize,
    pub w: usize,
    pub data: Vec<u8>, // (h, w, 3)
}

/// Shapes only: the pixels would flood a test failure message.
impl std::fmt::Debug for RgbImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RgbImage({}x{})", self.h, self.w)
    }
}

/// The largest side accepted. Guards the allocation a hostile header could
/// ask for; it is zune-jpeg's own default limit.
pub const MAX_SIDE: usize = 1 << 14;

/// The decoded bytes a file of `len` bytes may claim: a fixed allowance
/// plus 1100 per input byte (deflate cannot exceed 1032:1, and a JPEG needs
/// at least a few bits per 16x16 block). Without it a 100-byte header could
/// ask for 16384x16384x3 = 805 MB before the decoder finds the data missing.
pub fn max_decoded_bytes(len: usize) -> usize {
    (16usize << 20).saturating_add(len.saturating_mul(1100))
}

/// Refuses a header whose `h`x`w` image would decode to `claim` bytes,
/// more than [`max_decoded_bytes`] of a `len`-byte file.
fn check_claim(claim: usize, h: usize, w: usize, len: usize) -> std::result::Result<(), String> {
    if claim > max_decoded_bytes(len) {
        return Err(format!(
            "header claims {h}x{w} pixels ({claim} bytes decoded), more than a {len}-byte file can hold"
        ));
    }
    Ok(())
}

const JPEG_MAGIC: &[u8] = &[0xFF, 0xD8, 0xFF];
const PNG_MAGIC: &[u8] = &[0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1A, b'\n'];

/// Reads and decodes `path`.
pub fn load_rgb(path: &Path) -> Result<RgbImage> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    decode_rgb(&bytes, path)
}

/// Decodes the bytes of a JPEG or PNG file; `path` only names it in errors.
pub fn decode_rgb(bytes: &[u8], path: &Path) -> Result<RgbImage> {
    let bad = |reason: String| Error::BadData {
        path: path.display().to_string(),
        reason,
    };
    let img = if bytes.is_empty() {
        return Err(bad("empty file".into()));
    } else if bytes.starts_with(JPEG_MAGIC) {
        decode_jpeg(bytes).map_err(|r| bad(format!("bad JPEG: {r}")))?
    } else if bytes.starts_with(PNG_MAGIC) {
        decode_png(bytes).map_err(|r| bad(format!("bad PNG: {r}")))?
    } else {
        return Err(bad("not a JPEG or PNG file (unknown magic bytes)".into()));
    };
    if img.h == 0 || img.w == 0 {
        return Err(bad(format!("image has no pixels ({}x{})", img.h, img.w)));
    }
    Ok(img)
}

fn decode_jpeg(bytes: &[u8]) -> std::result::Result<RgbImage, String> {
    // Strict mode: a truncated or corrupt stream is an error, as in PIL
    // (without LOAD_TRUNCATED_IMAGES); the lenient default would fill the
    // missing rows with gray and train on them silently.
    let options = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_strict_mode(true)
        .set_max_width(MAX_SIDE)
        .set_max_height(MAX_SIDE);
    let mut d = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    d.decode_headers().map_err(|e| e.to_string())?;
    let (w, h) = d.dimensions().ok_or("no frame header")?;
    check_claim(h.saturating_mul(w).saturating_mul(3), h, w, bytes.len())?;
    let len = d.output_buffer_size().ok_or("image too large")?;
    if len != h * w * 3 {
        return Err(format!(
            "decoder would write {len} bytes for {h}x{w} RGB (colour space {:?})",
            d.output_colorspace()
        ));
    }
    let mut data = vec![0u8; len];
    d.decode_into(&mut data).map_err(|e| e.to_string())?;
    Ok(RgbImage { h, w, data })
}

fn decode_png(bytes: &[u8]) -> std::result::Result<RgbImage, String> {
    let mut d = png::Decoder::new(std::io::Cursor::new(bytes));
    // Palette → RGB(A), bit depths < 8 → 8, tRNS → alpha, 16 → 8 bits.
    d.set_transformations(Transformations::normalize_to_color8());
    let mut reader = d.read_info().map_err(|e| e.to_string())?;
    let (w, h) = reader.info().size();
    let (h, w) = (h as usize, w as usize);
    if h > MAX_SIDE || w > MAX_SIDE {
        return Err(format!("{h}x{w} exceeds the {MAX_SIDE} pixel side limit"));
    }
    let len = reader.output_buffer_size().ok_or("image too large")?;
    check_claim(len, h, w, bytes.len())?;
    let mut buf = vec![0u8; len];
    let frame = reader.next_frame(&mut buf).map_err(|e| e.to_string())?;
    if frame.bit_depth != BitDepth::Eight {
        return Err(format!("unexpected output depth {:?}", frame.bit_depth));
    }
    let channels = match frame.color_type {
        ColorType::Grayscale => 1,
        ColorType::GrayscaleAlpha => 2,
        ColorType::Rgb => 3,
        ColorType::Rgba => 4,
        ColorType::Indexed => return Err("palette was not expanded".into()),
    };
    let row_bytes = frame.line_size;
    if row_bytes < w * channels || buf.len() < row_bytes * h {
        return Err("short frame".into());
    }
    let mut data = Vec::with_capacity(h * w * 3);
    for row in buf.chunks_exact(row_bytes).take(h) {
        for px in row[..w * channels].chunks_exact(channels) {
            match channels {
                1 | 2 => data.extend_from_slice(&[px[0]; 3]),
                _ => data.extend_from_slice(&px[..3]),
            }
        }
    }
    Ok(RgbImage { h, w, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PNG of `w`x`h` pixels from raw samples.
    fn encode_png(
        w: u32,
        h: u32,
        color: ColorType,
        depth: BitDepth,
        palette: Option<Vec<u8>>,
        data: &[u8],
    ) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let mut e = png::Encoder::new(&mut out, w, h);
            e.set_color(color);
            e.set_depth(depth);
            if let Some(p) = palette {
                e.set_palette(p);
            }
            let mut wr = e.write_header().unwrap();
            wr.write_image_data(data).unwrap();
        }
        out
    }

    fn decode(bytes: &[u8]) -> RgbImage {
        decode_rgb(bytes, Path::new("test.png")).unwrap()
    }

    #[test]
    fn png_color_types_become_rgb() {
        let gray = encode_png(
            2,
            1,
            ColorType::Grayscale,
            BitDepth::Eight,
            None,
            &[10, 200],
        );
        assert_eq!(decode(&gray).data, vec![10, 10, 10, 200, 200, 200]);

        let ga = encode_png(
            2,
            1,
            ColorType::GrayscaleAlpha,
            BitDepth::Eight,
            None,
            &[7, 0, 9, 255],
        );
        assert_eq!(decode(&ga).data, vec![7, 7, 7, 9, 9, 9]);

        let rgba = encode_png(
            1,
            2,
            ColorType::Rgba,
            BitDepth::Eight,
            None,
            &[1, 2, 3, 0, 4, 5, 6, 128],
        );
        let img = decode(&rgba);
        assert_eq!((img.h, img.w), (2, 1));
        assert_eq!(img.data, vec![1, 2, 3, 4, 5, 6]);

        let rgb = encode_png(1, 1, ColorType::Rgb, BitDepth::Eight, None, &[9, 8, 7]);
        assert_eq!(decode(&rgb).data, vec![9, 8, 7]);
    }

    #[test]
    fn png_palette_low_and_high_bit_depths() {
        // 2-bit palette indices 2, 0, 1 packed into one byte: 10 00 01 00.
        let palette = vec![10, 11, 12, 20, 21, 22, 30, 31, 32];
        let pal = encode_png(
            3,
            1,
            ColorType::Indexed,
            BitDepth::Two,
            Some(palette),
            &[0b1000_0100],
        );
        assert_eq!(decode(&pal).data, vec![30, 31, 32, 10, 11, 12, 20, 21, 22]);

        // 1-bit grayscale expands to 0 / 255.
        let bits = encode_png(
            2,
            1,
            ColorType::Grayscale,
            BitDepth::One,
            None,
            &[0b0100_0000],
        );
        assert_eq!(decode(&bits).data, vec![0, 0, 0, 255, 255, 255]);

        // 16-bit keeps the high byte (big-endian samples).
        let deep = encode_png(
            1,
            1,
            ColorType::Rgb,
            BitDepth::Sixteen,
            None,
            &[0x12, 0x34, 0xAB, 0xCD, 0xFF, 0x00],
        );
        assert_eq!(decode(&deep).data, vec![0x12, 0xAB, 0xFF]);
    }

    #[test]
    fn errors_name_the_file_and_the_problem() {
        let p = Path::new("dir/cat.jpg");
        let msg = |b: &[u8]| decode_rgb(b, p).unwrap_err().to_string();
        assert_eq!(msg(&[]), "dir/cat.jpg: empty file");
        assert!(msg(b"GIF89a....").contains("unknown magic bytes"));
        assert!(msg(&[0xFF, 0xD8, 0xFF, 0xE0, 0, 16]).starts_with("dir/cat.jpg: bad JPEG: "));
        let png = encode_png(4, 4, ColorType::Rgb, BitDepth::Eight, None, &[5; 48]);
        let cut = msg(&png[..png.len() - 20]);
        assert!(cut.starts_with("dir/cat.jpg: bad PNG: "), "{cut}");
        assert!(matches!(decode_rgb(&[], p), Err(Error::BadData { .. })));
    }

    #[test]
    fn decoder_is_chosen_by_magic_bytes_not_extension() {
        let png = encode_png(1, 1, ColorType::Rgb, BitDepth::Eight, None, &[1, 2, 3]);
        let img = decode_rgb(&png, Path::new("really_a_png.jpg")).unwrap();
        assert_eq!(img.data, vec![1, 2, 3]);
    }
}
