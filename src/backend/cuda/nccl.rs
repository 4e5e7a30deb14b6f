//! The gradient all-reduce of data-parallel training on GPUs (feature
//! `nccl`): NCCL through cudarc's raw bindings, one process per GPU, the
//! sum queued on the device's one stream with the rest of the step, so it
//! is ordered after the backward that wrote the gradients and before the
//! optimizer that reads them, without a host round trip.
//!
//! The communicator is made once per process and device, on the first sum:
//! rank 0 asks NCCL for a unique id, the id's 128 bytes travel over the
//! run's [`Collective`] (MPI), and every rank joins with its rank and the
//! world size (`ncclCommInitRank`, with the device's context current).
//!
//! NOTHING HERE HAS RUN ON A GPU: it compiles against cudarc 0.19's NCCL
//! 2.28 bindings; the machine it was written on has neither a GPU nor
//! NCCL. `NCCL (libnccl.so.2)` missing at run time is an error naming it
//! (cudarc's loader would panic), checked before any call.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use cudarc::nccl::{result, sys};

use super::state::state;
use crate::device::Device;
use crate::dist::Collective;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A communicator of this process on one device. NCCL communicators may be
/// used from any thread, one call at a time: the map's lock orders them.
struct Comm(sys::ncclComm_t);

// SAFETY: an ncclComm_t is an opaque handle NCCL lets any thread use; every
// use goes through the mutex of `COMMS`.
unsafe impl Send for Comm {}

static COMMS: OnceLock<Mutex<HashMap<u32, Comm>>> = OnceLock::new();

fn nccl_error(op: &'static str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda {
        op,
        reason: format!("{e:?}"),
    }
}

/// Whether NCCL can be loaded; the error says what to install.
pub fn probe() -> Result<()> {
    // SAFETY: only asks the loader whether the library opens.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::CudaUnavailable {
            what: "NCCL (libnccl.so.2) was not found".into(),
            hint: "data-parallel training on GPUs needs NCCL 2.18 or newer: install libnccl2 (or \
                   put the folder holding libnccl.so.2 on LD_LIBRARY_PATH)"
                .into(),
        })
    }
}

/// The communicator of `ordinal` for the run `comm`, made on first use.
fn communicator(
    ordinal: u32,
    comm: &dyn Collective,
    comms: &mut HashMap<u32, Comm>,
) -> Result<sys::ncclComm_t> {
    if let Some(c) = comms.get(&ordinal) {
        return Ok(c.0);
    }
    probe()?;
    // Rank 0's id, broadcast as bytes (every rank takes part).
    let mut id_bytes = [0u8; 128];
    if comm.is_root() {
        let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
        for (b, c) in id_bytes.iter_mut().zip(id.internal.iter()) {
            *b = *c as u8;
        }
    }
    comm.broadcast_bytes(&mut id_bytes)?;
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    for (c, b) in id.internal.iter_mut().zip(id_bytes) {
        *c = b as _;
    }
    let st = state(ordinal)?;
    st.core
        .ctx
        .bind_to_thread()
        .map_err(|e| nccl_error("cuCtxSetCurrent", e))?;
    let mut handle = std::ptr::null_mut();
    // SAFETY: `handle` is written by NCCL; the id is the run's, identical
    // on every rank; the device's context is current.
    unsafe {
        result::comm_init_rank(&mut handle, comm.size() as i32, id, comm.rank() as i32)
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
    }
    comms.insert(ordinal, Comm(handle));
    Ok(handle)
}

/// `recv[..len]` = the sum over the ranks of `send[..len]`, both f32 pool
/// tensors on this process's GPU, queued on the device's stream.
pub fn all_reduce_sum(
    comm: &dyn Collective,
    recv: &mut Tensor,
    send: &Tensor,
    len: usize,
) -> Result<()> {
    let Device::Cuda(ordinal) = recv.device() else {
        return Err(Error::invalid(
            "nccl",
            "the buckets are not on a CUDA device",
        ));
    };
    let mut comms = COMMS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let handle = communicator(ordinal, comm, &mut comms)?;
    let st = state(ordinal)?;
    // SAFETY: both ranges are at least `len` f32 of pool storage on this
    // device (checked by `backend::all_reduce_sum`); the stream is the
    // device's one stream, so the sum is ordered with the step's kernels.
    unsafe {
        result::all_reduce(
            send.device_address() as *const c_void,
            recv.device_address() as *mut c_void,
            len,
            sys::ncclDataType_t::ncclFloat32,
            sys::ncclRedOp_t::ncclSum,
            handle,
            st.core.stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(|e| nccl_error("ncclAllReduce", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Here (no NCCL): the probe names the library and how to get it.
    #[test]
    fn a_missing_nccl_is_named() {
        match super::probe() {
            Ok(()) => println!("skipped: NCCL is installed here"),
            Err(e) => {
                let m = e.to_string();
                assert!(m.contains("libnccl.so.2") && m.contains("NCCL 2.18"), "{m}");
            }
        }
    }
}
