//! A CUDA driver, cuBLAS and cuDNN of memfit's own, so that the CUDA
//! backend's host code runs unchanged in CI on machines without a GPU.
//! Not part of the product: tests and CI only.
//!
//! cudarc loads `libcuda.so`, `libcublas.so` and `libcudnn.so` with dlopen
//! and looks every function up by name when it is first called; this one
//! library exports the functions memfit calls, and `tools/fakecuda.sh`
//! links it under those names into a folder that goes first on
//! `LD_LIBRARY_PATH`. NVRTC is the real one (from PyPI): the kernels that
//! run are the PTX it compiles from `src/backend/cuda/kernels/*.cu`.
//!
//! What it models, and where it is stricter than it needs to be:
//! - Device memory ([`memory`]): host memory behind addresses that are not
//!   host pointers (non-canonical on x86-64, so a host dereference of a
//!   device address faults at once), each allocation apart from the next so
//!   an overrun is an error naming the address, never a neighbour's bytes.
//!   Every allocation and free can be logged (`FAKECUDA_LOG=path`) and
//!   `cuMemGetInfo` answers exactly what is allocated.
//! - Kernels: `memfit-ptx` interprets the PTX; a fault names the kernel,
//!   block, thread, instruction and address.
//! - Streams ([`queue`]): work is queued and runs at the next
//!   synchronisation (stream, event, context, a copy to pageable memory),
//!   as on a GPU that is behind; a copy from page-locked memory whose host
//!   bytes change before it runs is an error (the real driver would copy
//!   the new bytes). `CUDA_LAUNCH_BLOCKING=1` runs each call at once.
//!   One fault makes every later call fail, as a real context does.
//! - cuBLAS ([`blas`]) and cuDNN ([`dnn`]): every descriptor, layout,
//!   stride, algorithm and workspace is checked as the real libraries
//!   document; the arithmetic is memfit's CPU kernels.
//!
//! What it does not model: TF32 or cuDNN's own numerics (strict fp32
//! here), real algorithm speed or choice, concurrency between streams,
//! warps, timing.

pub mod blas;
pub mod dnn;
pub mod driver;
pub mod memory;
pub mod queue;
pub mod state;
