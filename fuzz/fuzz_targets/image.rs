//! Image bytes through the JPEG / PNG decoders (chosen by magic bytes). The
//! first byte picks the format so both decoders get fuzzed from any seed.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use memfit::data::decode_rgb;

const JPEG: &[u8] = &[0xFF, 0xD8, 0xFF];
const PNG: &[u8] = &[0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1A, b'\n'];

fuzz_target!(|data: &[u8]| {
    let p = Path::new("fuzz.img");
    let _ = decode_rgb(data, p);
    // The same bytes behind each magic, for inputs that lack one.
    if let Some((&pick, rest)) = data.split_first() {
        let magic = if pick & 1 == 0 { JPEG } else { PNG };
        if !rest.starts_with(magic) {
            let mut v = magic.to_vec();
            v.extend_from_slice(rest);
            if let Ok(img) = decode_rgb(&v, p) {
                assert_eq!(img.data.len(), img.h * img.w * 3);
            }
        }
    }
});
