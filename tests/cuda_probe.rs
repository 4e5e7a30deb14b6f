//! The CUDA probe never panics, and on a machine without the NVIDIA driver
//! names libcuda and the driver in `memfit::Error::CudaUnavailable`.

#![cfg(any(feature = "cuda", feature = "cuda-12"))]

use memfit::Error;
use memfit::device::cuda::{Library, probe};

#[test]
fn probe_names_what_is_missing_or_describes_the_gpu() {
    let result = std::panic::catch_unwind(|| probe(0));
    let result = result.expect("the probe panicked");
    match result {
        Ok(info) => {
            // A machine with a working GPU: the description is filled in.
            println!("probe: {info}");
            assert!(info.device_count >= 1 && !info.name.is_empty());
            assert!(info.total_bytes > 0 && info.free_bytes <= info.total_bytes);
        }
        Err(missing) => {
            let err = Error::from(missing.clone());
            let msg = err.to_string();
            println!("probe: {msg}");
            assert!(matches!(err, Error::CudaUnavailable { .. }));
            assert!(!missing.hint.is_empty());
            if !Library::Driver.is_present() {
                // This is the case on the CI machines (no NVIDIA driver).
                assert!(msg.contains("libcuda.so.1"), "{msg}");
                assert!(msg.contains("NVIDIA driver"), "{msg}");
            }
        }
    }
}

#[test]
fn every_library_has_a_message_with_a_hint() {
    for lib in Library::ALL {
        let m = lib.missing();
        assert!(m.what.contains(".so"), "{m}");
        assert!(m.hint.contains("install"), "{m}");
    }
    assert!(Library::Cudnn.missing().hint.contains("libcudnn9-cuda-"));
}
