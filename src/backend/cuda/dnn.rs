//! cuDNN convolutions and cuBLAS GEMMs on pool memory: the handles, the
//! descriptors, the pinned algorithms and the workspace arithmetic the
//! planner and the ops share. Part of the CUDA arm (`ops` calls in here);
//! never run on a GPU yet.
//!
//! cudarc's safe cuDNN API launches on values that implement its
//! `DevicePtr` traits; pool storage is a raw device address, so [`Raw`]
//! wraps one (no events: the backend orders everything on the device's
//! one stream, which the cuDNN and cuBLAS handles are bound to).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cudnn::sys::{
    cudnnConvolutionBwdDataAlgo_t, cudnnConvolutionBwdFilterAlgo_t, cudnnConvolutionFwdAlgo_t,
    cudnnConvolutionMode_t, cudnnMathType_t, cudnnTensorFormat_t,
};
use cudarc::cudnn::{
    ConvBackwardData, ConvBackwardFilter, ConvDescriptor, ConvForward, Cudnn, FilterDescriptor,
    TensorDescriptor,
};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::state::State;
use crate::backend::ConvPass;
use crate::device::cuda::Library;
use crate::error::{Error, Result};
use crate::ops::conv2d::ConvGeom;

/// The pinned, deterministic algorithms (never cuDNN's heuristic pick, so
/// the workspace the planner counted is the one the call asks for, and a
/// recomputed activation gets the same bits).
pub const FWD_ALGO: cudnnConvolutionFwdAlgo_t =
    cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
pub const BWD_DATA_ALGO: cudnnConvolutionBwdDataAlgo_t =
    cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
pub const BWD_FILTER_ALGO: cudnnConvolutionBwdFilterAlgo_t =
    cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;

/// The planning default for cuDNN's own workspace per convolution (4 MiB),
/// used when no GPU answers the query (a plan made on a machine without
/// one): above what FACTS.md measured on the H200 for the pinned
/// algorithms' kind at ResNet-50 sizes (implicit-GEMM forward 131 B,
/// weight gradient 2.2 MB). A call whose query asks for more than the
/// workspace it was given fails with an error naming both sizes.
pub const CUDNN_DEFAULT_WORKSPACE: usize = 4 << 20;

/// Alignment of each region of a convolution's workspace (bytes).
pub const WS_ALIGN: usize = 256;

static ALLOW_TF32: AtomicBool = AtomicBool::new(false);

/// Lets cuDNN use TF32 tensor cores for fp32 convolutions (10-bit mantissa
/// products), as PyTorch's `torch.backends.cudnn.allow_tf32` (on there by
/// default; the CLI turns it on unless `--strict-fp32`). Off by default in
/// the library: strict fp32 (`CUDNN_FMA_MATH`). The linear layer's GEMMs
/// stay strict fp32 either way, as PyTorch's matmuls by default
/// (`torch.backends.cuda.matmul.allow_tf32 = False`). Process-wide; takes
/// effect at the next call.
pub fn set_allow_tf32(on: bool) {
    ALLOW_TF32.store(on, Ordering::Relaxed);
}

pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(Ordering::Relaxed)
}

/// Pool storage as cudarc's device-pointer traits see it.
pub struct Raw<'a> {
    pub addr: u64,
    pub bytes: usize,
    pub stream: &'a Arc<CudaStream>,
}

impl<T> DeviceSlice<T> for Raw<'_> {
    fn len(&self) -> usize {
        self.bytes / std::mem::size_of::<T>()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for Raw<'_> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.addr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for Raw<'_> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.addr, SyncOnDrop::Record(None))
    }
}

fn cudnn_err(op: &'static str) -> impl Fn(cudarc::cudnn::CudnnError) -> Error {
    move |e| Error::Cuda {
        op,
        reason: format!("{e:?}"),
    }
}

fn bind(st: &State) -> Result<()> {
    st.core.ctx.bind_to_thread().map_err(|e| Error::Cuda {
        op: "cuCtxSetCurrent",
        reason: format!("{e:?}"),
    })
}

thread_local! {
    // cuDNN handles are not Send (cudarc): one per thread and device,
    // bound to the device's one stream.
    static CUDNN: RefCell<HashMap<u32, Arc<Cudnn>>> = RefCell::default();
}

/// This thread's cuDNN handle for `st`'s device, on its stream.
pub fn cudnn(st: &State) -> Result<Arc<Cudnn>> {
    if !Library::Cudnn.is_present() {
        return Err(Library::Cudnn.missing().into());
    }
    bind(st)?;
    CUDNN.with(|m| {
        if let Some(h) = m.borrow().get(&st.core.ordinal) {
            return Ok(h.clone());
        }
        let h = Cudnn::new(st.core.stream.clone()).map_err(cudnn_err("cudnnCreate"))?;
        m.borrow_mut().insert(st.core.ordinal, h.clone());
        Ok(h)
    })
}

/// The descriptors of one convolution: NHWC f32 activations, the filter
/// in cuDNN's NHWC filter layout (cout, kh, kw, cin), cross-correlation
/// (what the CPU computes), strict fp32 unless TF32 was allowed.
pub struct ConvDescs {
    pub x: TensorDescriptor<f32>,
    pub w: FilterDescriptor<f32>,
    pub y: TensorDescriptor<f32>,
    pub conv: ConvDescriptor<f32>,
}

fn ci(v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::invalid("cudnn", format!("{v} does not fit an int")))
}

pub fn conv_descs(h: &Arc<Cudnn>, g: &ConvGeom) -> Result<ConvDescs> {
    let nhwc = cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
    let e = cudnn_err("cudnnSet*Descriptor");
    // cuDNN takes 4-d dims in NCHW order whatever the format.
    let x = h
        .create_4d_tensor::<f32>(nhwc, [ci(g.n)?, ci(g.cin)?, ci(g.h)?, ci(g.w)?])
        .map_err(&e)?;
    let w = h
        .create_4d_filter::<f32>(nhwc, [ci(g.cout)?, ci(g.cin)?, ci(g.kh)?, ci(g.kw)?])
        .map_err(&e)?;
    let y = h
        .create_4d_tensor::<f32>(nhwc, [ci(g.n)?, ci(g.cout)?, ci(g.oh())?, ci(g.ow())?])
        .map_err(&e)?;
    let mut conv = h
        .create_conv2d::<f32>(
            [ci(g.pad)?, ci(g.pad)?],
            [ci(g.stride)?, ci(g.stride)?],
            [1, 1],
            cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
        )
        .map_err(&e)?;
    let math = if allow_tf32() {
        cudnnMathType_t::CUDNN_TENSOR_OP_MATH
    } else {
        cudnnMathType_t::CUDNN_FMA_MATH
    };
    conv.set_math_type(math)
        .map_err(cudnn_err("cudnnSetConvolutionMathType"))?;
    Ok(ConvDescs { x, w, y, conv })
}

/// cuDNN's own workspace (bytes) for `pass` with the pinned algorithms:
/// the forward's, or the larger of backward-data's and backward-filter's
/// (they run one after the other on the same region).
pub fn cudnn_workspace_bytes(d: &ConvDescs, pass: ConvPass) -> Result<usize> {
    let e = cudnn_err("cudnnGetConvolution*WorkspaceSize");
    Ok(match pass {
        ConvPass::Forward => ConvForward {
            conv: &d.conv,
            x: &d.x,
            w: &d.w,
            y: &d.y,
        }
        .get_workspace_size(FWD_ALGO)
        .map_err(&e)?,
        ConvPass::Backward => {
            let data = ConvBackwardData {
                conv: &d.conv,
                dx: &d.x,
                w: &d.w,
                dy: &d.y,
            }
            .get_workspace_size(BWD_DATA_ALGO)
            .map_err(&e)?;
            let filter = ConvBackwardFilter {
                conv: &d.conv,
                x: &d.x,
                dw: &d.w,
                dy: &d.y,
            }
            .get_workspace_size(BWD_FILTER_ALGO)
            .map_err(&e)?;
            data.max(filter)
        }
    })
}

/// Bytes of the transposed-weight regions at the front of a convolution's
/// workspace: [`WS_ALIGN`] of slack to align the regions (a pool block is
/// only 64-byte aligned; see [`regions_base`]), then the weight in OHWI
/// (both passes) and, for the backward, the OHWI weight gradient cuDNN
/// writes before it is added into `dw`, each a multiple of [`WS_ALIGN`].
pub fn weight_regions_bytes(g: &ConvGeom, pass: ConvPass) -> usize {
    let one = weight_region_bytes(g);
    WS_ALIGN
        + match pass {
            ConvPass::Forward => one,
            ConvPass::Backward => 2 * one,
        }
}

/// One OHWI weight region, rounded up to [`WS_ALIGN`].
pub fn weight_region_bytes(g: &ConvGeom) -> usize {
    (g.kh * g.kw * g.cin * g.cout * 4).next_multiple_of(WS_ALIGN)
}

/// Where the regions of a workspace at device address `addr` start: the
/// address rounded up to [`WS_ALIGN`] (within the slack
/// [`weight_regions_bytes`] counts).
pub fn regions_base(addr: u64) -> u64 {
    addr.next_multiple_of(WS_ALIGN as u64)
}

/// cuDNN's workspace for `g` on device `st`, asked of cuDNN.
pub fn query_cudnn_bytes(st: &State, g: &ConvGeom, pass: ConvPass) -> Result<usize> {
    let h = cudnn(st)?;
    let d = conv_descs(&h, g)?;
    cudnn_workspace_bytes(&d, pass)
}

// ---------------------------------------------------------------------------
// cuBLAS

/// The device's cuBLAS handle on its stream. Its workspace is pool memory
/// the caller sets before each call ([`set_cublas_workspace`]).
pub fn cublas(st: &State) -> Result<&CudaBlas> {
    if !Library::Cublas.is_present() {
        return Err(Library::Cublas.missing().into());
    }
    bind(st)?;
    if st.blas.get().is_none() {
        let b = CudaBlas::new(st.core.stream.clone()).map_err(|e| Error::Cuda {
            op: "cublasCreate",
            reason: format!("{e:?}"),
        })?;
        let _ = st.blas.set(b);
    }
    let b = st.blas.get().expect("set above");
    // Strict fp32 always (see `set_allow_tf32`).
    let mode = cublasMath_t::CUBLAS_DEFAULT_MATH;
    // SAFETY: a live handle; the mode is a plain enum.
    unsafe { cudarc::cublas::sys::cublasSetMathMode(*b.handle(), mode) }
        .result()
        .map_err(|e| Error::Cuda {
            op: "cublasSetMathMode",
            reason: format!("{e:?}"),
        })?;
    Ok(b)
}

/// Gives cuBLAS `bytes` of workspace at device address `at` (pool memory,
/// 256-byte aligned) for the calls queued until the next one; the pool
/// memory may be reused after them in stream order.
pub fn set_cublas_workspace(st: &State, at: u64, bytes: usize) -> Result<()> {
    let blas = cublas(st)?;
    // SAFETY: a live handle; [at, at + bytes) is pool memory on this
    // device that outlives the calls queued with it (stream order).
    unsafe {
        cudarc::cublas::sys::cublasSetWorkspace_v2(
            *blas.handle(),
            at as *mut std::ffi::c_void,
            bytes,
        )
    }
    .result()
    .map_err(|e| Error::Cuda {
        op: "cublasSetWorkspace",
        reason: format!("{e:?}"),
    })
}

/// Column-major `c (m×n) = alpha·op(a)·op(b) + beta·c` (cuBLAS sgemm) on
/// device addresses; `ta`/`tb` transpose `a`/`b`.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    st: &State,
    ta: bool,
    tb: bool,
    (m, n, k): (usize, usize, usize),
    a: u64,
    lda: usize,
    b: u64,
    ldb: usize,
    beta: f32,
    c: u64,
    ldc: usize,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let blas = cublas(st)?;
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let alpha = 1.0f32;
    // SAFETY: a, b, c are pool storage on this device holding the
    // matrices the dimensions describe (the callers derive both from the
    // tensors' shapes); alpha and beta outlive the call (host pointer
    // mode); the handle is bound to the device's one stream.
    unsafe {
        cudarc::cublas::result::sgemm(
            *blas.handle(),
            op(ta),
            op(tb),
            ci(m)?,
            ci(n)?,
            ci(k)?,
            &alpha,
            a as *const f32,
            ci(lda)?,
            b as *const f32,
            ci(ldb)?,
            &beta,
            c as *mut f32,
            ci(ldc)?,
        )
    }
    .map_err(|e| Error::Cuda {
        op: "cublasSgemm",
        reason: format!("{e:?}"),
    })
}
