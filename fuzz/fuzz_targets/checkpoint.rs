//! Training checkpoints through `load_checkpoint` (format version,
//! fingerprint, metadata numbers, loss-scaler state, optimizer buffers)
//! into a tiny ResNet-18 with SGD momentum. The fingerprint is taken from
//! the input's own metadata so the fuzzer gets past that check; the bytes
//! go through a file because `load_checkpoint` reads a path.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memfit::io::TensorFile;
use memfit::memory::Pool;
use memfit::nn::{ResNet, ResNetConfig};
use memfit::optim::Sgd;
use memfit::train::Optimizer;
use memfit::train::checkpoint::load_checkpoint;

fuzz_target!(|data: &[u8]| {
    let fingerprint = match TensorFile::parse("fuzz", data) {
        Ok(f) => f.metadata.get("fingerprint").cloned().unwrap_or_default(),
        Err(_) => String::new(),
    };
    let path = std::env::temp_dir().join(format!("memfit-fuzz-ckpt-{}.safetensors", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let pool = Pool::new();
    let mut config = ResNetConfig::by_name("resnet18").unwrap();
    config.base_width = 2;
    config.num_classes = 6;
    let mut model = ResNet::new(&pool, config).unwrap();
    let mut opt = Optimizer::Sgd(Sgd::new(0.1, 0.9, 0.0, false));
    let _ = load_checkpoint(&path, &pool, &mut model, &mut opt, &fingerprint);
});
