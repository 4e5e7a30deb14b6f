//! The work queued on streams, run in order at the next synchronisation.
//!
//! One queue in enqueue order serves every stream: a schedule a GPU could
//! run (it never runs a later call before an earlier one), so a program
//! that orders its streams correctly gets its results, and one that reads
//! results without synchronising sees the work not done yet.

use std::sync::Arc;

/// The context has failed (the failure is in `Fake::sticky`).
#[derive(Debug)]
pub struct Failed;

use crate::memory::DeviceMemory;
use crate::state::Fake;

/// A compute call of cuBLAS or cuDNN, run when the queue reaches it.
pub type Compute = Box<dyn FnOnce(&mut DeviceMemory) -> Result<(), String> + Send>;

pub enum Op {
    Fill {
        dst: u64,
        value: u8,
        len: usize,
    },
    /// From pageable memory: the bytes were copied when the call was made
    /// (the real driver stages them before returning).
    Upload {
        dst: u64,
        data: Vec<u8>,
    },
    /// From page-locked memory: read when the copy runs; `snapshot` holds
    /// the bytes at the call, to catch a host write in between.
    UploadPinned {
        dst: u64,
        src: usize,
        len: usize,
        snapshot: Vec<u8>,
    },
    /// To page-locked memory, written when the copy runs.
    DownloadPinned {
        dst: usize,
        src: u64,
        len: usize,
    },
    Copy {
        dst: u64,
        src: u64,
        len: usize,
    },
    Launch {
        module: Arc<memfit_ptx::Module>,
        kernel: String,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        params: Vec<Vec<u8>>,
    },
    Record {
        event: usize,
    },
    Compute {
        what: String,
        run: Compute,
    },
}

/// Why queued work failed: the message, and whether it was a kernel's
/// illegal address (CUDA_ERROR_ILLEGAL_ADDRESS) or another failure.
pub struct Failure {
    pub illegal_address: bool,
    pub what: String,
}

impl Fake {
    /// Runs one queued call.
    fn run_op(&mut self, op: Op) -> Result<(), Failure> {
        let plain = |what: String| Failure {
            illegal_address: false,
            what,
        };
        match op {
            Op::Fill { dst, value, len } => self
                .mem
                .fill(dst, value, len)
                .map_err(|e| plain(format!("cuMemsetD8Async: {e}"))),
            Op::Upload { dst, data } => self
                .mem
                .write(dst, &data)
                .map_err(|e| plain(format!("cuMemcpyHtoDAsync: {e}"))),
            Op::UploadPinned {
                dst,
                src,
                len,
                snapshot,
            } => {
                if !self.pinned.contains(src, len) {
                    return Err(plain(format!(
                        "cuMemcpyHtoDAsync from page-locked {src:#x} ({len} bytes): the host \
                         memory was freed before the queued copy ran"
                    )));
                }
                // SAFETY: [src, src + len) is a live page-locked block
                // owned by this library (checked above).
                let now = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
                if now != snapshot.as_slice() {
                    return Err(plain(format!(
                        "cuMemcpyHtoDAsync from page-locked {src:#x} ({len} bytes): the host \
                         bytes changed after the call and before the queued copy ran (a real \
                         GPU would copy the new bytes): wait for the copy (an event) before \
                         reusing its buffer"
                    )));
                }
                self.mem
                    .write(dst, now)
                    .map_err(|e| plain(format!("cuMemcpyHtoDAsync: {e}")))
            }
            Op::DownloadPinned { dst, src, len } => {
                if !self.pinned.contains(dst, len) {
                    return Err(plain(format!(
                        "cuMemcpyDtoHAsync to page-locked {dst:#x} ({len} bytes): the host \
                         memory was freed before the queued copy ran"
                    )));
                }
                // SAFETY: a live page-locked block of this library.
                let out = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
                self.mem
                    .read(src, out)
                    .map_err(|e| plain(format!("cuMemcpyDtoHAsync: {e}")))
            }
            Op::Copy { dst, src, len } => {
                let mut tmp = vec![0u8; len];
                self.mem
                    .read(src, &mut tmp)
                    .and_then(|()| self.mem.write(dst, &tmp))
                    .map_err(|e| plain(format!("cuMemcpyDtoDAsync: {e}")))
            }
            Op::Launch {
                module,
                kernel,
                grid,
                block,
                shared,
                params,
            } => {
                let k = module
                    .kernel(&kernel)
                    .expect("cuModuleGetFunction checked the name");
                match memfit_ptx::launch(k, grid, block, shared, &params, &mut self.mem) {
                    Ok(stats) => {
                        self.launches += 1;
                        self.instructions += stats.instructions;
                        Ok(())
                    }
                    Err(fault) => Err(Failure {
                        illegal_address: true,
                        what: format!("kernel fault: {fault}"),
                    }),
                }
            }
            Op::Record { event } => {
                if let Some(e) = self.events.get_mut(&event) {
                    e.pending = e.pending.saturating_sub(1);
                }
                Ok(())
            }
            Op::Compute { what, run } => {
                run(&mut self.mem).map_err(|e| plain(format!("{what}: {e}")))
            }
        }
    }

    /// Runs everything queued, in order. The first failure ends the
    /// context (every later call fails, as on a GPU); it is printed once.
    pub fn flush(&mut self) -> Result<(), Failed> {
        if self.sticky.is_some() {
            self.queue.clear();
            return Err(Failed);
        }
        while let Some(op) = self.queue.pop_front() {
            if let Err(f) = self.run_op(op) {
                self.fail(f);
                self.queue.clear();
                return Err(Failed);
            }
        }
        Ok(())
    }

    /// Queues `op`; under `CUDA_LAUNCH_BLOCKING=1` runs it at once.
    pub fn enqueue(&mut self, op: Op) -> Result<(), Failed> {
        if self.sticky.is_some() {
            return Err(Failed);
        }
        self.queue.push_back(op);
        if self.blocking {
            self.flush()?;
        }
        Ok(())
    }
}
