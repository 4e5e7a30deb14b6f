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

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaStream, result as drv, sys as drv_sys};

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
    /// `LD_LIBRARY_PATH`, the ld.so cache, the system folders). Asked of
    /// the loader once per process: the answer tries up to about 15 file
    /// names (about 0.65 ms when they fail), and the backend asks before
    /// every convolution and GEMM.
    pub fn is_present(self) -> bool {
        static PRESENT: [OnceLock<bool>; 5] = [const { OnceLock::new() }; 5];
        let index = match self {
            Library::Driver => 0,
            Library::Nvrtc => 1,
            Library::Cublas => 2,
            Library::CublasLt => 3,
            Library::Cudnn => 4,
        };
        // SAFETY: each call only tries to dlopen the library's file names
        // and closes what it opened; no symbol is called.
        *PRESENT[index].get_or_init(|| unsafe {
            match self {
                Library::Driver => cudarc::driver::sys::is_culib_present(),
                Library::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                Library::Cublas => cudarc::cublas::sys::is_culib_present(),
                Library::CublasLt => cudarc::cublaslt::sys::is_culib_present(),
                Library::Cudnn => cudarc::cudnn::sys::is_culib_present(),
            }
        })
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

/// Whether this machine has no GPU to use at all: a library the backend
/// loads is missing, or the driver sees no device. Unlike the other probe
/// failures (a wrong ordinal, an unsupported card, a busy or failing GPU),
/// planning for a GPU elsewhere is then what a user can mean.
pub fn no_gpu_here() -> bool {
    first_missing_library().is_some()
        || matches!(&device_facts(0).probe, Err(m) if m.what == NO_DEVICE)
}

/// What [`probe`] says when the driver sees no GPU at all.
const NO_DEVICE: &str = "no CUDA device";

/// The driver part of [`probe`], after the libraries were found.
fn query_device(ordinal: usize) -> Result<CudaInfo, Missing> {
    use cudarc::driver::{CudaContext, DriverError, sys::CUresult};
    let driver_err = |op: &str, e: DriverError| {
        if e.0 == CUresult::CUDA_ERROR_NO_DEVICE {
            return Missing {
                what: NO_DEVICE.into(),
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

// ---------------------------------------------------------------------------
// Device facts for capabilities and planning

/// The compute capability a plan for a CUDA device assumes when the probe
/// fails (a plan made on a machine without that GPU, e.g. CI): an H100/H200
/// (9.0), the GPU the checks in `../shared/gpu/FACTS.md` ran on.
pub const DEFAULT_COMPUTE_CAPABILITY: (u32, u32) = (9, 0);

/// What the rest of the crate needs to know about CUDA device `ordinal`,
/// whether or not it is here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFacts {
    /// The probe's compute capability, or [`DEFAULT_COMPUTE_CAPABILITY`].
    pub compute_capability: (u32, u32),
    /// What the probe found, or why it failed (then every fact above is
    /// the documented default).
    pub probe: std::result::Result<CudaInfo, Missing>,
}

impl DeviceFacts {
    /// One line saying where the facts come from.
    pub fn source(&self) -> String {
        match &self.probe {
            Ok(info) => format!("probed: {info}"),
            Err(m) => format!(
                "no CUDA device here ({}); assuming the documented default, compute capability \
                 {}.{}",
                m.what, DEFAULT_COMPUTE_CAPABILITY.0, DEFAULT_COMPUTE_CAPABILITY.1
            ),
        }
    }
}

/// Whether a GPU of compute capability `cc` has native bf16 arithmetic
/// (Ampere, 8.0, and newer): cuDNN's bf16 convolutions on tensor cores,
/// which the backend runs under bf16 there (`Capabilities::cuda`'s
/// `reads_bf16`).
pub fn hardware_bf16(cc: (u32, u32)) -> bool {
    cc >= (8, 0)
}

/// [`DeviceFacts`] of device `ordinal`, probed once per process.
pub fn device_facts(ordinal: u32) -> DeviceFacts {
    static FACTS: OnceLock<Mutex<HashMap<u32, DeviceFacts>>> = OnceLock::new();
    let map = FACTS.get_or_init(Mutex::default);
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    map.entry(ordinal)
        .or_insert_with(|| {
            let probe = probe(ordinal as usize);
            DeviceFacts {
                compute_capability: probe
                    .as_ref()
                    .map_or(DEFAULT_COMPUTE_CAPABILITY, |i| i.compute_capability),
                probe,
            }
        })
        .clone()
}

// ---------------------------------------------------------------------------
// The device's context, its one stream, and raw device memory

/// A driver call that failed on a device that the probe accepted.
/// `crate::error` turns it into `Error::Cuda`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallError {
    pub op: &'static str,
    pub reason: String,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.op, self.reason)
    }
}

fn call_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CallError {
    move |e| CallError {
        op,
        reason: format!("{e:?}"),
    }
}

/// A device's primary context and its one compute stream. Everything the
/// backend queues goes to this stream, in order, so no event is needed:
/// cudarc's per-slice event tracking is turned off.
pub struct Core {
    pub ordinal: u32,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// The page-locked buffers uploads go through ([`Core::upload`]).
    staging: Mutex<Staging>,
    /// The smallest size and alignment of a mapping of device memory
    /// (`cuMemGetAllocationGranularity`; 2 MiB on current cards).
    pub granularity: usize,
}

/// Pinned memory of device `ordinal`, as `cuMemCreate` asks.
fn device_memory(ordinal: u32) -> drv_sys::CUmemAllocationProp {
    // SAFETY: a plain C struct of integers and one pointer; all zeros is
    // its documented default.
    let mut prop: drv_sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = drv_sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = drv_sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal as i32;
    prop
}

/// The device's mapping granularity, or why its memory cannot be mapped
/// page by page (no virtual memory management: the pool needs it).
fn mapping_granularity(ctx: &CudaContext, ordinal: u32) -> std::result::Result<usize, CallError> {
    let vmm = ctx
        .attribute(
            drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
        )
        .map_err(call_err("cuDeviceGetAttribute"))?;
    if vmm == 0 {
        return Err(CallError {
            op: "cuMemCreate",
            reason: format!(
                "device {ordinal} does not support virtual memory management, which memfit's \
                 pool maps device memory with"
            ),
        });
    }
    let prop = device_memory(ordinal);
    let mut granularity = 0usize;
    // SAFETY: `prop` is a valid description; writes one usize.
    unsafe {
        drv_sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            drv_sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()
    .map_err(call_err("cuMemGetAllocationGranularity"))?;
    Ok(granularity.max(1))
}

/// Page-locked host buffers for uploads, used in turn: an upload copies
/// the caller's values into the next slot on the host and queues the copy
/// from there, so it returns without waiting for the stream (a copy from
/// pageable memory would). A slot is refilled only after the copy queued
/// from it has run (its event), which bounds how far the host runs ahead
/// of the GPU to [`STAGING_SLOTS`] uploads; with a batch's images and
/// labels alternating, the images of micro-batch k wait for those of k-2.
/// A slot grows to the largest upload through it (a training run holds
/// about two batches of images pinned, as PyTorch's `pin_memory`); the
/// bytes are host memory, outside the device pool.
#[derive(Default)]
struct Staging {
    slots: Vec<StagingSlot>,
    next: usize,
}

/// How many uploads may be queued and not yet run.
pub const STAGING_SLOTS: usize = 4;

struct StagingSlot {
    /// `cuMemHostAlloc` memory of `bytes`, or null before the first use.
    ptr: *mut u8,
    bytes: usize,
    /// Recorded after the copy queued from this slot.
    copied: cudarc::driver::CudaEvent,
    used: bool,
}

// SAFETY: the pointer is page-locked host memory owned by the slot and
// only touched under the `Core`'s staging lock.
unsafe impl Send for StagingSlot {}

impl Drop for StagingSlot {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // The copy from it may still be queued.
            let _ = self.copied.synchronize();
            // SAFETY: from cuMemHostAlloc, freed once.
            let _ = unsafe { drv::free_host(self.ptr.cast()) };
        }
    }
}

/// Why a device could not be started: missing, or a call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartError {
    Missing(Missing),
    Call(CallError),
}

/// The [`Core`] of device `ordinal`, started once per process: probe first
/// (so a missing library is an error, never a loader panic), then the
/// primary context and one non-blocking stream.
pub fn core(ordinal: u32) -> std::result::Result<Arc<Core>, StartError> {
    static CORES: OnceLock<Mutex<HashMap<u32, Arc<Core>>>> = OnceLock::new();
    let map = CORES.get_or_init(Mutex::default);
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = map.get(&ordinal) {
        return Ok(c.clone());
    }
    // The cached probe: each probe retains and releases the primary
    // context, which the driver tears down when nothing else holds it.
    device_facts(ordinal).probe.map_err(StartError::Missing)?;
    let ctx = CudaContext::new(ordinal as usize)
        .map_err(|e| StartError::Call(call_err("cuDevicePrimaryCtxRetain")(e)))?;
    // SAFETY: the backend orders all its work on the one stream below, so
    // the events cudarc would record per slice are not needed (and it
    // allocates no CudaSlice: storage is the pool's raw device memory).
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx
        .new_stream()
        .map_err(|e| StartError::Call(call_err("cuStreamCreate")(e)))?;
    let granularity = catch_unwind(AssertUnwindSafe(|| mapping_granularity(&ctx, ordinal)))
        .unwrap_or_else(|_| {
            Err(CallError {
                op: "cuMemGetAllocationGranularity",
                reason: "the driver lacks the virtual memory calls".into(),
            })
        })
        .map_err(StartError::Call)?;
    let core = Arc::new(Core {
        ordinal,
        ctx,
        stream,
        staging: Mutex::new(Staging::default()),
        granularity,
    });
    map.insert(ordinal, core.clone());
    Ok(core)
}

impl Core {
    /// Device memory in use on the whole card and its size, bytes
    /// (`cuMemGetInfo`: everything allocated, by this process and others).
    pub fn memory_in_use(&self) -> std::result::Result<(usize, usize), CallError> {
        self.bind()?;
        let (free, total) = self.ctx.mem_get_info().map_err(call_err("cuMemGetInfo"))?;
        Ok((total.saturating_sub(free), total))
    }

    fn bind(&self) -> std::result::Result<(), CallError> {
        self.ctx
            .bind_to_thread()
            .map_err(call_err("cuCtxSetCurrent"))
    }

    /// `bytes` of device addresses (a multiple of [`Core::granularity`])
    /// with no memory behind them (`cuMemAddressReserve`): memory is mapped
    /// into them page by page ([`Core::map_zeroed`]), as PyTorch's
    /// expandable segments do, so a pool's address space can be larger
    /// than the memory it holds.
    pub fn reserve_addresses(&self, bytes: usize) -> std::result::Result<u64, CallError> {
        self.bind()?;
        let mut at: drv_sys::CUdeviceptr = 0;
        // SAFETY: a plain reservation; the context is current.
        unsafe { drv_sys::cuMemAddressReserve(&mut at, bytes, self.granularity, 0, 0) }
            .result()
            .map_err(call_err("cuMemAddressReserve"))?;
        Ok(at)
    }

    /// Gives back addresses from [`Core::reserve_addresses`], nothing
    /// mapped in them any more.
    pub fn free_addresses(&self, at: u64, bytes: usize) -> std::result::Result<(), CallError> {
        self.bind()?;
        // SAFETY: exactly one reservation, every page unmapped.
        unsafe { drv_sys::cuMemAddressFree(at, bytes) }
            .result()
            .map_err(call_err("cuMemAddressFree"))
    }

    /// Backs `bytes` of reserved addresses at `at` with fresh device memory
    /// (`cuMemCreate`, `cuMemMap`, read-write access for this device),
    /// zeroed by a memset queued on the stream. Returns the memory's
    /// handle, for [`Core::unmap`]. Out of memory is `CUDA_ERROR_OUT_OF_MEMORY`
    /// from `cuMemCreate`.
    pub fn map_zeroed(&self, at: u64, bytes: usize) -> std::result::Result<u64, CallError> {
        self.bind()?;
        let prop = device_memory(self.ordinal);
        let mut handle: drv_sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `prop` is a valid description; the context is current.
        unsafe { drv_sys::cuMemCreate(&mut handle, bytes, &prop, 0) }
            .result()
            .map_err(call_err("cuMemCreate"))?;
        // SAFETY: `at..at + bytes` lies in a reservation of ours where
        // nothing is mapped (the arena maps each page once).
        let mapped = unsafe { drv_sys::cuMemMap(at, bytes, 0, handle, 0) }
            .result()
            .map_err(call_err("cuMemMap"));
        if let Err(e) = mapped {
            // SAFETY: the handle is ours and mapped nowhere.
            let _ = unsafe { drv_sys::cuMemRelease(handle) };
            return Err(e);
        }
        let access = drv_sys::CUmemAccessDesc {
            location: prop.location,
            flags: drv_sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range was mapped just above.
        let granted = unsafe { drv_sys::cuMemSetAccess(at, bytes, &access, 1) }
            .result()
            .map_err(call_err("cuMemSetAccess"))
            .and_then(|()| self.memset_zero(at, bytes));
        if let Err(e) = granted {
            // SAFETY: mapped above, used by nothing yet.
            let _ = unsafe { drv_sys::cuMemUnmap(at, bytes) };
            let _ = unsafe { drv_sys::cuMemRelease(handle) };
            return Err(e);
        }
        Ok(handle)
    }

    /// Gives back the memory of pages from [`Core::map_zeroed`], as (address,
    /// bytes, handle), once the stream is idle (queued kernels may still
    /// use them; unmapping does not wait). The addresses stay reserved.
    pub fn unmap(&self, pages: &[(u64, usize, u64)]) -> std::result::Result<(), CallError> {
        if pages.is_empty() {
            return Ok(());
        }
        self.bind()?;
        self.synchronize()?;
        for &(at, bytes, handle) in pages {
            // SAFETY: mapped by map_zeroed with this size and handle; the
            // stream is idle and no block in use covers them.
            unsafe { drv_sys::cuMemUnmap(at, bytes) }
                .result()
                .map_err(call_err("cuMemUnmap"))?;
            // SAFETY: the handle is ours, now mapped nowhere.
            unsafe { drv_sys::cuMemRelease(handle) }
                .result()
                .map_err(call_err("cuMemRelease"))?;
        }
        Ok(())
    }

    /// Zeroes `bytes` at `ptr`, queued on the stream.
    pub fn memset_zero(&self, ptr: u64, bytes: usize) -> std::result::Result<(), CallError> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: [ptr, ptr + bytes) is device memory the caller owns.
        unsafe { drv::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
            .map_err(call_err("cuMemsetD8Async"))
    }

    /// Copies `src` to device address `dst`, ordered after the queued work,
    /// through a page-locked staging slot ([`Staging`]): returns once `src`
    /// is copied on the host (the slice may go after), without waiting for
    /// the stream unless the slot's previous copy has not run yet.
    pub fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> std::result::Result<(), CallError> {
        let bytes = std::mem::size_of_val(src);
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if staging.slots.len() < STAGING_SLOTS {
            let copied = self
                .ctx
                .new_event(None)
                .map_err(call_err("cuEventCreate"))?;
            staging.slots.push(StagingSlot {
                ptr: std::ptr::null_mut(),
                bytes: 0,
                copied,
                used: false,
            });
        }
        let at = staging.next % staging.slots.len();
        staging.next = staging.next.wrapping_add(1);
        let slot = &mut staging.slots[at];
        if slot.used {
            slot.copied
                .synchronize()
                .map_err(call_err("cuEventSynchronize"))?;
        }
        if slot.bytes < bytes {
            if !slot.ptr.is_null() {
                // SAFETY: from cuMemHostAlloc; its last copy has run (above).
                unsafe { drv::free_host(slot.ptr.cast()) }.map_err(call_err("cuMemFreeHost"))?;
                slot.ptr = std::ptr::null_mut();
                slot.bytes = 0;
            }
            let want = bytes.next_power_of_two();
            // SAFETY: a plain page-locked allocation (write-combined: the
            // host only writes it, the copy engine reads it).
            let ptr = unsafe { drv::malloc_host(want, drv_sys::CU_MEMHOSTALLOC_WRITECOMBINED) }
                .map_err(call_err("cuMemHostAlloc"))?;
            slot.ptr = ptr.cast();
            slot.bytes = want;
        }
        // SAFETY: the slot holds at least `bytes`; no copy reads it now
        // (its last one has run); `src` is `bytes` of plain values.
        let staged = unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr().cast::<u8>(), slot.ptr, bytes);
            std::slice::from_raw_parts(slot.ptr, bytes)
        };
        // SAFETY: dst holds at least `bytes` (the caller's storage); the
        // staged bytes stay until the event below has passed.
        unsafe { drv::memcpy_htod_async(dst, staged, self.stream.cu_stream()) }
            .map_err(call_err("cuMemcpyHtoDAsync"))?;
        slot.used = true;
        if let Err(e) = slot.copied.record(&self.stream) {
            // Without the event the slot's next user could not wait for
            // this copy: wait for it now.
            let _ = self.synchronize();
            return Err(call_err("cuEventRecord")(e));
        }
        Ok(())
    }

    /// Copies device address `src` into `dst` after the queued work.
    pub fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> std::result::Result<(), CallError> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: src holds at least size_of_val(dst) bytes; the stream is
        // synchronised before dst is read.
        unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(call_err("cuMemcpyDtoHAsync"))?;
        self.synchronize()
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> std::result::Result<(), CallError> {
        self.stream
            .synchronize()
            .map_err(call_err("cuStreamSynchronize"))
    }
}
