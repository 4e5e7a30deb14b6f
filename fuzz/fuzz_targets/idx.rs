//! IDX bytes (plain or gzip) through the image and label parsers, then into
//! a dataset.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use memfit::data::{idx_to_dataset, parse_idx_images, parse_idx_labels};

fuzz_target!(|data: &[u8]| {
    let p = Path::new("fuzz.idx");
    if let Ok(im) = parse_idx_images(data.to_vec(), p) {
        let labels = vec![0u8; im.n];
        let _ = idx_to_dataset(&im, &labels, 10, 0.5, 0.25, "fuzz.idx");
    }
    let _ = parse_idx_labels(data.to_vec(), p);
});
