//! Safetensors bytes through memfit's weights parser, then (when they parse)
//! through the strict torchvision loader and the training-state loader's
//! checks, into a tiny ResNet-18.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memfit::io::{TensorFile, load_state_dict, load_torchvision};
use memfit::memory::Pool;
use memfit::nn::{ResNet, ResNetConfig};

fuzz_target!(|data: &[u8]| {
    let Ok(file) = TensorFile::parse("fuzz.safetensors", data) else {
        return;
    };
    let pool = Pool::new();
    let mut config = ResNetConfig::by_name("resnet18").unwrap();
    config.base_width = 2;
    config.num_classes = 3;
    let mut model = ResNet::new(&pool, config).unwrap();
    let _ = memfit::io::fc_rows(&file);
    let _ = load_torchvision(&mut model, &file, false);
    let _ = load_torchvision(&mut model, &file, true);
    let _ = load_state_dict(&mut model, &file, &["optimizer."]);
});
