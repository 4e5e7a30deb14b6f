//! Small files whose headers claim huge contents are refused from the size
//! of the file, before anything that large is allocated (found while
//! writing the fuzz targets in fuzz/; regressions found by the fuzzer are
//! in tests/fuzz_regressions.rs).

use std::path::Path;

use memfit::data::{decode_rgb, max_decoded_bytes, parse_idx_images};

fn fixture(rel: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(rel),
    )
    .unwrap()
}

/// A real JPEG with its frame header (SOF0..SOF2) patched to `h`x`w`.
fn jpeg_claiming(h: u16, w: u16) -> Vec<u8> {
    let mut b = fixture("photos/val/space/rocket.jpg");
    let sof = (2..b.len() - 9)
        .find(|&i| b[i] == 0xFF && (0xC0..=0xC2).contains(&b[i + 1]))
        .expect("no SOF marker");
    b[sof + 5..sof + 7].copy_from_slice(&h.to_be_bytes());
    b[sof + 7..sof + 9].copy_from_slice(&w.to_be_bytes());
    b
}

fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let mut crc = flate2::Crc::new();
    crc.update(kind);
    crc.update(data);
    out.extend_from_slice(&crc.sum().to_be_bytes());
}

/// A PNG header for an RGB `side`x`side` image followed by a few bytes of
/// (empty) image data.
fn png_claiming(side: u32) -> Vec<u8> {
    let mut b = vec![0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1A, b'\n'];
    let mut ihdr = side.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&side.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB
    png_chunk(&mut b, b"IHDR", &ihdr);
    png_chunk(
        &mut b,
        b"IDAT",
        &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01],
    );
    png_chunk(&mut b, b"IEND", &[]);
    b
}

#[test]
fn images_claiming_more_pixels_than_their_bytes_can_hold_are_refused() {
    let p = Path::new("big.img");
    for bytes in [jpeg_claiming(16000, 16000), png_claiming(16000)] {
        assert!(16000 * 16000 * 3 > max_decoded_bytes(bytes.len()));
        let msg = decode_rgb(&bytes, p).unwrap_err().to_string();
        assert!(
            msg.starts_with("big.img: ") && msg.contains("header claims 16000x16000 pixels"),
            "{msg}"
        );
    }
    // Within the allowance the claim goes to the decoder. (zune-jpeg, even
    // in strict mode, decodes this one: it pads the missing scan data.)
    if let Err(e) = decode_rgb(&jpeg_claiming(300, 300), p) {
        assert!(!e.to_string().contains("header claims"), "{e}");
    }
}

#[test]
fn a_gzip_bomb_is_inflated_only_as_far_as_its_idx_header_says() {
    use std::io::Write;
    // Header: 1 image of 2x2, then 256 MiB of zeros (under 1 MiB compressed).
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let mut head = 0x0803u32.to_be_bytes().to_vec();
    for d in [1u32, 2, 2] {
        head.extend_from_slice(&d.to_be_bytes());
    }
    e.write_all(&head).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..256 {
        e.write_all(&zeros).unwrap();
    }
    let gz = e.finish().unwrap();
    assert!(gz.len() < 1 << 20, "{}", gz.len());
    let msg = parse_idx_images(gz, Path::new("bomb.gz"))
        .unwrap_err()
        .to_string();
    // 1 MiB of slack is read past the declared 4 bytes, not 256 MiB.
    assert!(
        msg.contains("trailing data") && msg.contains(&format!("{} extra", 1 << 20)),
        "{msg}"
    );
}
