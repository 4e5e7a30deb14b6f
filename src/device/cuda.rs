//! Whether CUDA works here, asked without panicking: which NVIDIA libraries
//! load, how many GPUs there are, and what the chosen one is (name, compute
//! capability, memory). Built only with the `cuda` (CUDA 13) or `cuda-12`
//! feature.
//!
//! cudarc loads every library at run time and *panics* when one is missing
//! ("Unable to dynamically load …"). So [`probe`] first asks each library
//! module's `is_culib_present()`, which only tries to open the file, and
//! returns a [`Missing`] that names the library and how to get it. The
//! driver calls after that run under `catch_unwind`, because cudarc also
//! panics on a symbol an old driver lacks.
//!
//! This module knows nothing of tensors, pools or kernels; `crate::error`
//! turns a [`Missing`] into `Error::CudaUnavailable` (the error type sits
//! above `device` in the import order, so it is not named here).

use std::panic::{AssertUnwindSafe, catch_unwind};

// With both features, cudarc fails to compile first (its CUDA 12 and 13
// bindings conflict); this names the cause should cudarc ever accept both.
#[cfg(all(feature = "cuda", feature = "cuda-12"))]
compile_error!(
    "features `cuda` (CUDA 13) and `cuda-12` (CUDA 12.8) exclude each other: turn on one of them"
);

/// The CUDA major version this build's bindings speak.
pub const CUDA_MAJOR: u32 = if cfg!(feature = "cuda-12") { 12 } else { 13 };

/// Something CUDA needs that is not here: `what` names it, `hint` says how
/// to get it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missing {
    pub what: String,
    pub hint: String,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.what, self.hint)
    }
}

/// The libraries the CUDA backend loads, in the order [`probe`] checks them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// libcuda.so.1, installed with the NVIDIA driver.
    Driver,
    /// libnvrtc: compiles the backend's kernels at run time.
    Nvrtc,
    /// libcublas: the linear layer's GEMMs.
    Cublas,
    /// libcublasLt: GEMMs with an explicit workspace.
    CublasLt,
    /// libcudnn: convolutions.
    Cudnn,
}

impl Library {
    pub const ALL: [Library; 5] = [
        Library::Driver,
        Library::Nvrtc,
        Library::Cublas,
        Library::CublasLt,
        Library::Cudnn,
    ];

    /// Whether the library can be opened (the loader's search path:
    /// `LD_LIBRARY_PATH`, the ld.so cache, the system folders).
    pub fn is_present(self) -> bool {
        // SAFETY: each call only tries to dlopen the library's file names
        // and closes what it opened; no symbol is called.
        unsafe {
            match self {
                Library::Driver => cudarc::driver::sys::is_culib_present(),
                Library::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                Library::Cublas => cudarc::cublas::sys::is_culib_present(),
                Library::CublasLt => cudarc::cublaslt::sys::is_culib_present(),
                Library::Cudnn => cudarc::cudnn::sys::is_culib_present(),
            }
        }
    }

    /// What is missing and how to get it, for this build's CUDA version.
    pub fn missing(self) -> Missing {
        let v = CUDA_MAJOR;
        let (what, hint) = match self {
            Library::Driver => (
                "libcuda.so.1 (the NVIDIA driver) not found".to_string(),
                if v >= 13 {
                    "install the NVIDIA driver (580 or newer for CUDA 13); CUDA 13 needs a Turing \
                     or newer GPU (compute capability >= 7.5); for an older GPU build memfit with \
                     --features cuda-12"
                        .to_string()
                } else {
                    "install the NVIDIA driver (570 or newer for CUDA 12.8)".to_string()
                },
            ),
            Library::Nvrtc => (
                format!("libnvrtc.so.{v} (NVRTC, the CUDA runtime compiler) not found"),
                format!(
                    "install the CUDA {v} toolkit's NVRTC (e.g. apt install cuda-nvrtc-{v}-0, \
                     or pip install \"nvidia-cuda-nvrtc>={v},<{}\") and put the folder holding \
                     libnvrtc.so.{v} on LD_LIBRARY_PATH",
                    v + 1
                ),
            ),
            Library::Cublas | Library::CublasLt => {
                let name = if self == Library::Cublas {
                    "libcublas"
                } else {
                    "libcublasLt"
                };
                (
                    format!("{name}.so.{v} (cuBLAS) not found"),
                    format!(
                        "install cuBLAS for CUDA {v} (e.g. apt install libcublas-{v}-0, or the \
                         CUDA {v} toolkit) and put its folder (e.g. \
                         /usr/local/cuda-{v}/targets/x86_64-linux/lib) on LD_LIBRARY_PATH"
                    ),
                )
            }
            Library::Cudnn => (
                "libcudnn.so.9 (cuDNN) not found".to_string(),
                format!(
                    "install cuDNN 9 (e.g. apt install libcudnn9-cuda-{v}) or put its folder on \
                     LD_LIBRARY_PATH"
                ),
            ),
        };
        Missing { what, hint }
    }
}

/// The first library in [`Library::ALL`] that cannot be loaded.
pub fn first_missing_library() -> Option<Missing> {
    Library::ALL
        .into_iter()
        .find(|l| !l.is_present())
        .map(Library::missing)
}

/// What [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaInfo {
    /// The device asked for.
    pub ordinal: usize,
    /// CUDA devices the driver sees.
    pub device_count: usize,
    pub name: String,
    /// (major, minor), e.g. (9, 0) for an H200.
    pub compute_capability: (u32, u32),
    pub total_bytes: usize,
    /// Free memory after the primary context was made current (so the
    /// context's own footprint is already taken out).
    pub free_bytes: usize,
}

impl std::fmt::Display for CudaInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "cuda:{} {} (compute capability {}.{}), {:.1} GiB, {:.1} GiB free",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            gib(self.total_bytes),
            gib(self.free_bytes)
        )
    }
}

/// Checks that CUDA works for device `ordinal`: every library the backend
/// loads (driver, NVRTC, cuBLAS, cuBLASLt, cuDNN, in that order), then the
/// driver's device count, then the device's name, compute capability and
/// memory. Never panics; the first thing missing is the error.
///
/// Makes the device's primary context current (what the backend will use;
/// cudarc's `CudaContext::new` on the same ordinal retains the same one).
pub fn probe(ordinal: usize) -> Result<CudaInfo, Missing> {
    if let Some(m) = first_missing_library() {
        return Err(m);
    }
    match catch_unwind(AssertUnwindSafe(|| query_device(ordinal))) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Missing {
                what: "the NVIDIA driver failed while probing".into(),
                hint: format!(
                    "{msg}; the driver may be older than CUDA {CUDA_MAJOR} needs: update it"
                ),
            })
        }
    }
}

/// The driver part of [`probe`], after the libraries were found.
fn query_device(ordinal: usize) -> Result<CudaInfo, Missing> {
    use cudarc::driver::{CudaContext, DriverError, sys::CUresult};
    let driver_err = |op: &str, e: DriverError| {
        if e.0 == CUresult::CUDA_ERROR_NO_DEVICE {
            return Missing {
                what: "no CUDA device".into(),
                hint: "the NVIDIA driver is installed but sees no GPU (check nvidia-smi and \
                       CUDA_VISIBLE_DEVICES)"
                    .into(),
            };
        }
        Missing {
            what: format!("CUDA driver call {op} failed ({e:?})"),
            hint: format!(
                "check nvidia-smi: the driver or the GPU is not usable (CUDA {CUDA_MAJOR} needs \
                 driver {} or newer)",
                if CUDA_MAJOR >= 13 { 580 } else { 570 }
            ),
        }
    };
    let count = CudaContext::device_count().map_err(|e| driver_err("cuDeviceGetCount", e))?;
    let count = usize::try_from(count).unwrap_or(0);
    if count == 0 {
        return Err(driver_err(
            "cuDeviceGetCount",
            DriverError(CUresult::CUDA_ERROR_NO_DEVICE),
        ));
    }
    if ordinal >= count {
        return Err(Missing {
            what: format!("no CUDA device {ordinal}"),
            hint: format!(
                "the driver sees {count} device(s), numbered 0 to {}",
                count - 1
            ),
        });
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuCtxRetain", e))?;
    let name = ctx.name().map_err(|e| driver_err("cuDeviceGetName", e))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| driver_err("cuDeviceGetAttribute", e))?;
    let (free_bytes, total_bytes) = ctx
        .mem_get_info()
        .map_err(|e| driver_err("cuMemGetInfo", e))?;
    let cc = (major.max(0) as u32, minor.max(0) as u32);
    if CUDA_MAJOR >= 13 && cc < (7, 5) {
        return Err(Missing {
            what: format!(
                "{name} (compute capability {}.{}) is not supported by CUDA 13",
                cc.0, cc.1
            ),
            hint: "CUDA 13 starts at Turing (compute capability 7.5): build memfit with \
                   --features cuda-12 and use a CUDA 12 driver and libraries"
                .into(),
        });
    }
    Ok(CudaInfo {
        ordinal,
        device_count: count,
        name,
        compute_capability: cc,
        total_bytes,
        free_bytes,
    })
}
