//! The one device this library fakes, and everything it holds.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::memory::{DeviceMemory, Pinned};
use crate::queue::{Failure, Op};

/// What the fake device says it is.
pub const DEVICE_NAME: &str = "memfit fake CUDA device (PTX interpreter, tests only)";

pub struct Event {
    /// Records queued and not yet run.
    pub pending: usize,
}

/// Everything the driver, cuBLAS and cuDNN hold, behind one lock.
pub struct Fake {
    pub mem: DeviceMemory,
    pub pinned: Pinned,
    pub queue: VecDeque<Op>,
    pub events: HashMap<usize, Event>,
    pub modules: HashMap<usize, Arc<memfit_ptx::Module>>,
    /// A function handle: its module and kernel name.
    pub functions: HashMap<usize, (Arc<memfit_ptx::Module>, String)>,
    pub streams: HashMap<usize, ()>,
    pub blas: crate::blas::Blas,
    pub dnn: crate::dnn::Dnn,
    next_handle: usize,
    /// The failure that ended the context, if one did.
    pub sticky: Option<Failure>,
    /// `CUDA_LAUNCH_BLOCKING=1`: run each queued call at once.
    pub blocking: bool,
    /// The compute capability reported (`FAKECUDA_CC`, default 9.0).
    pub cc: (i32, i32),
    pub initialised: bool,
    pub launches: u64,
    pub instructions: u64,
}

impl Fake {
    fn from_env() -> Fake {
        let total = std::env::var("FAKECUDA_MEMORY_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(16usize << 30);
        let log = std::env::var_os("FAKECUDA_LOG").and_then(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok()
        });
        let cc = std::env::var("FAKECUDA_CC")
            .ok()
            .and_then(|v| {
                let (a, b) = v.split_once('.')?;
                Some((a.parse().ok()?, b.parse().ok()?))
            })
            .unwrap_or((9, 0));
        Fake {
            mem: DeviceMemory::new(total, log),
            pinned: Pinned::default(),
            queue: VecDeque::new(),
            events: HashMap::new(),
            modules: HashMap::new(),
            functions: HashMap::new(),
            streams: HashMap::new(),
            blas: Default::default(),
            dnn: Default::default(),
            next_handle: 0x1000,
            sticky: None,
            blocking: std::env::var("CUDA_LAUNCH_BLOCKING").as_deref() == Ok("1"),
            cc,
            initialised: false,
            launches: 0,
            instructions: 0,
        }
    }

    /// A new opaque handle value (never null, never a host pointer).
    pub fn handle(&mut self) -> usize {
        self.next_handle += 16;
        self.next_handle
    }

    /// Ends the context with `f`, printing why (the only place a test
    /// sees what a kernel or a library call did wrong).
    pub fn fail(&mut self, f: Failure) {
        eprintln!("fake CUDA: {}", f.what);
        if self.sticky.is_none() {
            self.sticky = Some(f);
        }
    }
}

pub fn fake() -> MutexGuard<'static, Fake> {
    static FAKE: OnceLock<Mutex<Fake>> = OnceLock::new();
    FAKE.get_or_init(|| Mutex::new(Fake::from_env()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// What the library saw, for tests (`fakecuda_stats`, looked up with
/// dlsym in the already loaded libcuda.so).
#[repr(C)]
pub struct FakeStats {
    pub live_bytes: u64,
    pub peak_bytes: u64,
    pub allocs: u64,
    pub frees: u64,
    pub launches: u64,
    pub instructions: u64,
    /// 1 when a failure has ended the context.
    pub failed: u64,
}

/// # Safety
/// `out` points to a writable `FakeStats`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_stats(out: *mut FakeStats) {
    let f = fake();
    let s = FakeStats {
        live_bytes: f.mem.live_bytes as u64,
        peak_bytes: f.mem.peak_bytes as u64,
        allocs: f.mem.allocs_made,
        frees: f.mem.frees_made,
        launches: f.launches,
        instructions: f.instructions,
        failed: f.sticky.is_some() as u64,
    };
    // SAFETY: the caller's contract.
    unsafe { out.write(s) };
}
