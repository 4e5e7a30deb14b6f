//! Per-device state of the CUDA backend: the device's [`Core`] (primary
//! context and its ONE compute stream, event tracking off; owned by
//! `crate::device::cuda` so the pool below the backend can allocate, zero
//! and upload on the same stream) and a lazily filled cache of the NVRTC
//! modules of [`super::KERNEL_SOURCES`], compiled for the device's
//! `compute_XY` once per process.
//!
//! The cuBLAS handle lives here too (made on first use); cuDNN handles,
//! which cudarc does not let cross threads, are per thread in `dnn`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaFunction, CudaModule};

use crate::device::cuda::{Core, core, device_facts};
use crate::error::{Error, Result};

/// One device's backend state.
pub struct State {
    pub core: Arc<Core>,
    /// The virtual architecture kernels are compiled for, e.g. `compute_90`.
    pub arch: &'static str,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// The cuBLAS handle on the device's stream, made on first use
    /// (`dnn::cublas`). cuDNN handles are per thread (`dnn::cudnn`).
    pub(super) blas: OnceLock<cudarc::cublas::CudaBlas>,
}

/// The state of device `ordinal`, started on first use (probe first: a
/// missing library is `Error::CudaUnavailable`, never a loader panic).
pub fn state(ordinal: u32) -> Result<Arc<State>> {
    static STATES: OnceLock<Mutex<HashMap<u32, Arc<State>>>> = OnceLock::new();
    let map = STATES.get_or_init(Mutex::default);
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = map.get(&ordinal) {
        return Ok(s.clone());
    }
    let core = core(ordinal)?;
    // Once per device and process: a few bytes, kept for the process.
    let arch: &'static str =
        Box::leak(super::nvrtc_arch(device_facts(ordinal).compute_capability).into_boxed_str());
    let s = Arc::new(State {
        core,
        arch,
        modules: Mutex::default(),
        blas: OnceLock::new(),
    });
    map.insert(ordinal, s.clone());
    Ok(s)
}

impl State {
    /// Kernel `name` of source `module` (a name in `KERNEL_SOURCES`),
    /// compiling and loading the module the first time it is asked for.
    pub fn function(&self, module: &'static str, name: &str) -> Result<CudaFunction> {
        let m = {
            let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match modules.get(module) {
                Some(m) => m.clone(),
                None => {
                    let source = super::KERNEL_SOURCES
                        .iter()
                        .find(|(n, _)| *n == module)
                        .map(|(_, s)| *s)
                        .ok_or_else(|| Error::Cuda {
                            op: "load kernel module",
                            reason: format!("no kernel source named {module}"),
                        })?;
                    let ptx = super::compile(module, source, self.arch)?;
                    let m = self.core.ctx.load_module(ptx).map_err(|e| Error::Cuda {
                        op: "cuModuleLoadData",
                        reason: format!("{module}: {e:?}"),
                    })?;
                    modules.insert(module, m.clone());
                    m
                }
            }
        };
        m.load_function(name).map_err(|e| Error::Cuda {
            op: "cuModuleGetFunction",
            reason: format!("{module}.{name}: {e:?}"),
        })
    }
}
