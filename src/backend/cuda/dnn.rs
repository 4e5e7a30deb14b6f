//! cuDNN convolutions and cuBLAS GEMMs on pool memory: the handles, the
//! per-geometry cache of descriptors and algorithms, and the workspace
//! arithmetic the planner and the ops share. Part of the CUDA arm (`ops`
//! calls in here); never run on a GPU yet.
//!
//! cuDNN is called through cudarc's `result`/`sys` layer on raw handles
//! and descriptors of our own: cudarc's safe wrappers keep theirs private,
//! and the algorithm ranking (`cudnnGet*Algorithm_v7`) needs them.
//!
//! Per convolution geometry ([`ConvKey`]: shape, stride, padding, type,
//! layout, math) this thread keeps the four descriptors, built once (a
//! ResNet-50 step runs about 160 convolutions over a few dozen
//! geometries), and the process keeps the algorithm chosen per pass with
//! cuDNN's exact workspace for it ([`conv_algo::choose`]: the pinned
//! deterministic algorithm unless cuDNN refuses it, then the best
//! deterministic one cuDNN ranks). The choice is process-wide, so the
//! planner (on whatever thread) and every call agree on it; a geometry no
//! algorithm serves is [`Error::ConvAlgorithm`] naming it, never a default.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cudnn::result as dnn;
use cudarc::cudnn::sys::{
    self as dsys, cudnnConvolutionBwdDataAlgo_t, cudnnConvolutionBwdFilterAlgo_t,
    cudnnConvolutionFwdAlgo_t, cudnnConvolutionMode_t, cudnnDataType_t, cudnnDeterminism_t,
    cudnnMathType_t, cudnnStatus_t, cudnnTensorFormat_t,
};

pub use super::conv_algo::{self, Choice, ConvKey, Pass};
use super::state::State;
use crate::backend::ConvPass;
use crate::device::cuda::Library;
use crate::error::{Error, Result};
use crate::ops::conv2d::ConvGeom;
use crate::tensor::DType;

/// The pinned, deterministic algorithms, tried first for every geometry
/// (never cuDNN's heuristic first pick: the same algorithm on every GPU,
/// so a recomputed activation gets the same bits).
pub const FWD_ALGO: cudnnConvolutionFwdAlgo_t =
    cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
pub const BWD_DATA_ALGO: cudnnConvolutionBwdDataAlgo_t =
    cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
pub const BWD_FILTER_ALGO: cudnnConvolutionBwdFilterAlgo_t =
    cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;

/// The planning bound for cuDNN's own workspace per convolution (4 MiB),
/// used only when no GPU is here to ask (a plan made on a machine without
/// one, which `setup::plan_device` announces): above what FACTS.md
/// measured on the H200 for the pinned algorithms at ResNet-50 sizes
/// (implicit-GEMM forward 131 B, weight gradient 2.2 MB). With a GPU the
/// workspace is cuDNN's exact answer for the chosen algorithm, and a
/// failed query is an error.
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
/// effect at the next call (the math type is part of [`ConvKey`]).
pub fn set_allow_tf32(on: bool) {
    ALLOW_TF32.store(on, Ordering::Relaxed);
}

pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(Ordering::Relaxed)
}

fn cudnn_err(op: &'static str) -> impl Fn(dnn::CudnnError) -> Error {
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

fn ci(v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::invalid("cudnn", format!("{v} does not fit an int")))
}

// ---------------------------------------------------------------------------
// Handles and descriptors

/// A cuDNN handle bound to a device's one stream, destroyed on drop.
struct Handle(dsys::cudnnHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made by cudnnCreate, destroyed once, here.
        let _ = unsafe { dnn::destroy_handle(self.0) };
    }
}

thread_local! {
    // cuDNN handles must not be used by two threads at once: one per
    // thread and device.
    static HANDLES: RefCell<HashMap<u32, Rc<Handle>>> = RefCell::default();
    // This thread's descriptors per (device, geometry), built once.
    static DESCS: RefCell<HashMap<(u32, ConvKey), Rc<Descs>>> = RefCell::default();
}

/// This thread's cuDNN handle for `st`'s device, on its stream.
fn handle(st: &State) -> Result<Rc<Handle>> {
    if !Library::Cudnn.is_present() {
        return Err(Library::Cudnn.missing().into());
    }
    bind(st)?;
    if let Some(h) = HANDLES.with(|m| m.borrow().get(&st.core.ordinal).cloned()) {
        return Ok(h);
    }
    let h = Handle(dnn::create_handle().map_err(cudnn_err("cudnnCreate"))?);
    // SAFETY: a live handle and the device's live stream.
    unsafe { dnn::set_stream(h.0, st.core.stream.cu_stream() as dsys::cudaStream_t) }
        .map_err(cudnn_err("cudnnSetStream"))?;
    let h = Rc::new(h);
    HANDLES.with(|m| m.borrow_mut().insert(st.core.ordinal, h.clone()));
    Ok(h)
}

/// The descriptors of one convolution: NHWC f32 activations, the filter
/// in cuDNN's NHWC filter layout (cout, kh, kw, cin), cross-correlation
/// (what the CPU computes), strict fp32 unless the key allows TF32. Each
/// is destroyed on drop (a null one was never made).
struct Descs {
    x: dsys::cudnnTensorDescriptor_t,
    w: dsys::cudnnFilterDescriptor_t,
    y: dsys::cudnnTensorDescriptor_t,
    conv: dsys::cudnnConvolutionDescriptor_t,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each was made by its create call and is destroyed once,
        // here; destroying a descriptor needs no handle.
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.y.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.y);
            }
            if !self.w.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
        }
    }
}

fn build_descs(key: &ConvKey) -> Result<Descs> {
    let g = &key.geom;
    let nhwc = match key.layout {
        conv_algo::Layout::Nhwc => cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
    };
    // bf16 data with a float compute type is cuDNN's PSEUDO_BFLOAT16
    // configuration: bf16 in and out, f32 accumulation, tensor cores.
    let dt = match key.dtype {
        crate::tensor::DType::F32 => cudnnDataType_t::CUDNN_DATA_FLOAT,
        crate::tensor::DType::BF16 => cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        other => {
            return Err(Error::invalid(
                "cudnn",
                format!("{key}: no cuDNN convolution for {other:?} yet"),
            ));
        }
    };
    let e = cudnn_err("cudnnSet*Descriptor");
    let mut d = Descs {
        x: std::ptr::null_mut(),
        w: std::ptr::null_mut(),
        y: std::ptr::null_mut(),
        conv: std::ptr::null_mut(),
    };
    d.x = dnn::create_tensor_descriptor().map_err(&e)?;
    d.y = dnn::create_tensor_descriptor().map_err(&e)?;
    d.w = dnn::create_filter_descriptor().map_err(&e)?;
    d.conv = dnn::create_convolution_descriptor().map_err(&e)?;
    let math = if key.tf32 || key.dtype != crate::tensor::DType::F32 {
        cudnnMathType_t::CUDNN_TENSOR_OP_MATH
    } else {
        cudnnMathType_t::CUDNN_FMA_MATH
    };
    // SAFETY: live descriptors made above; plain values. cuDNN takes 4-d
    // dims in NCHW order whatever the format.
    unsafe {
        dnn::set_tensor4d_descriptor(d.x, nhwc, dt, [ci(g.n)?, ci(g.cin)?, ci(g.h)?, ci(g.w)?])
            .map_err(&e)?;
        dnn::set_tensor4d_descriptor(
            d.y,
            nhwc,
            dt,
            [ci(g.n)?, ci(g.cout)?, ci(g.oh())?, ci(g.ow())?],
        )
        .map_err(&e)?;
        dnn::set_filter4d_descriptor(
            d.w,
            dt,
            nhwc,
            [ci(g.cout)?, ci(g.cin)?, ci(g.kh)?, ci(g.kw)?],
        )
        .map_err(&e)?;
        dnn::set_convolution2d_descriptor(
            d.conv,
            ci(g.pad)?,
            ci(g.pad)?,
            ci(g.stride)?,
            ci(g.stride)?,
            1,
            1,
            cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
            cudnnDataType_t::CUDNN_DATA_FLOAT,
        )
        .map_err(&e)?;
        dnn::set_convolution_math_type(d.conv, math)
            .map_err(cudnn_err("cudnnSetConvolutionMathType"))?;
    }
    Ok(d)
}

/// This thread's descriptors of `key` on `st`'s device, built on first use.
fn descs(st: &State, key: &ConvKey) -> Result<Rc<Descs>> {
    let k = (st.core.ordinal, *key);
    if let Some(d) = DESCS.with(|m| m.borrow().get(&k).cloned()) {
        return Ok(d);
    }
    let d = Rc::new(build_descs(key)?);
    DESCS.with(|m| m.borrow_mut().insert(k, d.clone()));
    Ok(d)
}

// ---------------------------------------------------------------------------
// The algorithm per geometry and pass

/// What the process chose for one geometry, per pass as first asked.
#[derive(Default)]
struct Chosen {
    /// Order of first use, for the listing.
    seq: usize,
    fwd: Option<Choice<cudnnConvolutionFwdAlgo_t>>,
    data: Option<Choice<cudnnConvolutionBwdDataAlgo_t>>,
    filter: Option<Choice<cudnnConvolutionBwdFilterAlgo_t>>,
}

fn chosen() -> &'static Mutex<HashMap<(u32, ConvKey), Chosen>> {
    static CHOSEN: OnceLock<Mutex<HashMap<(u32, ConvKey), Chosen>>> = OnceLock::new();
    CHOSEN.get_or_init(Mutex::default)
}

type Answer<T> = std::result::Result<T, String>;

fn status(s: cudnnStatus_t) -> Answer<()> {
    if s == cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("{s:?}"))
    }
}

fn query<T>(r: std::result::Result<T, dnn::CudnnError>) -> Answer<T> {
    r.map_err(|e| format!("{:?}", e.0))
}

/// Asks cuDNN for `pass` of `key` (pinned workspace, then its ranking if
/// needed) and chooses ([`conv_algo::choose`]).
fn ask<A: Copy + PartialEq + std::fmt::Debug>(
    key: &ConvKey,
    pass: Pass,
    pinned: A,
    ws: impl FnMut(A) -> Answer<usize>,
    ranking: impl FnOnce() -> Answer<Vec<conv_algo::Candidate<A>>>,
) -> Result<Choice<A>> {
    let mut ws = ws;
    let pinned_ws = ws(pinned);
    conv_algo::choose(pinned, pinned_ws, ranking, ws).map_err(|reason| Error::ConvAlgorithm {
        geometry: key.to_string(),
        pass: pass.name(),
        reason,
    })
}

/// The forward algorithm and workspace of `key` on `st`'s device.
pub fn forward_choice(st: &State, key: &ConvKey) -> Result<Choice<cudnnConvolutionFwdAlgo_t>> {
    let k = (st.core.ordinal, *key);
    if let Some(c) = lock().get(&k).and_then(|c| c.fwd.clone()) {
        return Ok(c);
    }
    let h = handle(st)?;
    let d = descs(st, key)?;
    let c = ask(
        key,
        Pass::Forward,
        FWD_ALGO,
        // SAFETY (both closures): a live handle and descriptors; cuDNN
        // writes at most `count` results.
        |a| {
            query(unsafe {
                dnn::get_convolution_forward_workspace_size(h.0, d.x, d.w, d.conv, d.y, a)
            })
        },
        || {
            const N: usize = cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as usize;
            let mut got: c_int = 0;
            let mut perf =
                [unsafe { std::mem::zeroed::<dsys::cudnnConvolutionFwdAlgoPerf_t>() }; N];
            query(unsafe {
                dnn::get_convolution_forward_algorithm(
                    h.0,
                    d.x,
                    d.w,
                    d.conv,
                    d.y,
                    N as c_int,
                    &mut got,
                    perf.as_mut_ptr(),
                )
            })?;
            Ok(perf[..(got.max(0) as usize).min(N)]
                .iter()
                .map(|p| conv_algo::Candidate {
                    algo: p.algo,
                    status: status(p.status),
                    deterministic: p.determinism == cudnnDeterminism_t::CUDNN_DETERMINISTIC,
                    memory_bytes: p.memory,
                })
                .collect())
        },
    )?;
    Ok(record(k, |e| e.fwd.get_or_insert(c).clone()))
}

/// The backward-data algorithm and workspace of `key` on `st`'s device.
pub fn backward_data_choice(
    st: &State,
    key: &ConvKey,
) -> Result<Choice<cudnnConvolutionBwdDataAlgo_t>> {
    let k = (st.core.ordinal, *key);
    if let Some(c) = lock().get(&k).and_then(|c| c.data.clone()) {
        return Ok(c);
    }
    let h = handle(st)?;
    let d = descs(st, key)?;
    let c = ask(
        key,
        Pass::BackwardData,
        BWD_DATA_ALGO,
        // SAFETY: as in forward_choice.
        |a| {
            query(unsafe {
                dnn::get_convolution_backward_data_workspace_size(h.0, d.w, d.y, d.conv, d.x, a)
            })
        },
        || {
            const N: usize =
                cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as usize;
            let mut got: c_int = 0;
            let mut perf =
                [unsafe { std::mem::zeroed::<dsys::cudnnConvolutionBwdDataAlgoPerf_t>() }; N];
            query(unsafe {
                dnn::get_convolution_backward_data_algorithm(
                    h.0,
                    d.w,
                    d.y,
                    d.conv,
                    d.x,
                    N as c_int,
                    &mut got,
                    perf.as_mut_ptr(),
                )
            })?;
            Ok(perf[..(got.max(0) as usize).min(N)]
                .iter()
                .map(|p| conv_algo::Candidate {
                    algo: p.algo,
                    status: status(p.status),
                    deterministic: p.determinism == cudnnDeterminism_t::CUDNN_DETERMINISTIC,
                    memory_bytes: p.memory,
                })
                .collect())
        },
    )?;
    Ok(record(k, |e| e.data.get_or_insert(c).clone()))
}

/// The backward-filter algorithm and workspace of `key` on `st`'s device.
pub fn backward_filter_choice(
    st: &State,
    key: &ConvKey,
) -> Result<Choice<cudnnConvolutionBwdFilterAlgo_t>> {
    let k = (st.core.ordinal, *key);
    if let Some(c) = lock().get(&k).and_then(|c| c.filter.clone()) {
        return Ok(c);
    }
    let h = handle(st)?;
    let d = descs(st, key)?;
    let c = ask(
        key,
        Pass::BackwardFilter,
        BWD_FILTER_ALGO,
        // SAFETY: as in forward_choice.
        |a| {
            query(unsafe {
                dnn::get_convolution_backward_filter_workspace_size(h.0, d.x, d.y, d.conv, d.w, a)
            })
        },
        || {
            const N: usize =
                cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT as usize;
            let mut got: c_int = 0;
            let mut perf =
                [unsafe { std::mem::zeroed::<dsys::cudnnConvolutionBwdFilterAlgoPerf_t>() }; N];
            query(unsafe {
                dnn::get_convolution_backward_filter_algorithm(
                    h.0,
                    d.x,
                    d.y,
                    d.conv,
                    d.w,
                    N as c_int,
                    &mut got,
                    perf.as_mut_ptr(),
                )
            })?;
            Ok(perf[..(got.max(0) as usize).min(N)]
                .iter()
                .map(|p| conv_algo::Candidate {
                    algo: p.algo,
                    status: status(p.status),
                    deterministic: p.determinism == cudnnDeterminism_t::CUDNN_DETERMINISTIC,
                    memory_bytes: p.memory,
                })
                .collect())
        },
    )?;
    Ok(record(k, |e| e.filter.get_or_insert(c).clone()))
}

fn lock() -> std::sync::MutexGuard<'static, HashMap<(u32, ConvKey), Chosen>> {
    chosen().lock().unwrap_or_else(|e| e.into_inner())
}

/// Stores a choice unless another thread stored one first (then that one
/// is returned: every thread runs a geometry with the same algorithm).
fn record<R>(k: (u32, ConvKey), f: impl FnOnce(&mut Chosen) -> R) -> R {
    let mut m = lock();
    let next = m.len();
    f(m.entry(k).or_insert_with(|| Chosen {
        seq: next,
        ..Chosen::default()
    }))
}

/// The key of `g` run in `dtype` (f32: the TF32 setting; bf16: tensor
/// cores), NHWC.
pub fn key(g: &ConvGeom, dtype: DType) -> ConvKey {
    match dtype {
        DType::F32 => ConvKey::f32_nhwc(g, allow_tf32()),
        other => ConvKey {
            dtype: other,
            ..ConvKey::f32_nhwc(g, false)
        },
    }
}

/// cuDNN's own workspace (bytes) for `pass` of each geometry of `geoms`
/// in `dtype` with the chosen algorithms, the largest: per geometry the
/// forward's, or the larger of backward-data's and backward-filter's (they
/// run one after the other on the same region).
pub fn cudnn_workspace_bytes(
    st: &State,
    geoms: &[ConvGeom],
    pass: ConvPass,
    dtype: DType,
) -> Result<usize> {
    let mut most = 0;
    for g in geoms {
        let k = key(g, dtype);
        most = most.max(match pass {
            ConvPass::Forward => forward_choice(st, &k)?.workspace_bytes,
            ConvPass::Backward => backward_data_choice(st, &k)?
                .workspace_bytes
                .max(backward_filter_choice(st, &k)?.workspace_bytes),
        });
    }
    Ok(most)
}

/// One line per geometry chosen so far in this process, in order of first
/// use ([`conv_algo::format_line`]): what the GPU check prints.
pub fn conv_choice_lines() -> Vec<String> {
    let m = lock();
    let mut rows: Vec<_> = m.iter().collect();
    rows.sort_by_key(|(_, c)| c.seq);
    rows.into_iter()
        .map(|((_, key), c)| {
            let mut passes = Vec::new();
            let mut add = |pass, algo: String, ws: usize, fallback: bool| {
                passes.push(conv_algo::PassLine {
                    pass,
                    algo,
                    workspace_bytes: ws,
                    fallback,
                })
            };
            if let Some(f) = &c.fwd {
                add(
                    Pass::Forward,
                    conv_algo::algo_name(f.algo),
                    f.workspace_bytes,
                    f.refused_pinned.is_some(),
                );
            }
            if let Some(f) = &c.data {
                add(
                    Pass::BackwardData,
                    conv_algo::algo_name(f.algo),
                    f.workspace_bytes,
                    f.refused_pinned.is_some(),
                );
            }
            if let Some(f) = &c.filter {
                add(
                    Pass::BackwardFilter,
                    conv_algo::algo_name(f.algo),
                    f.workspace_bytes,
                    f.refused_pinned.is_some(),
                );
            }
            conv_algo::format_line(key, &passes)
        })
        .collect()
}

// ---------------------------------------------------------------------------
// The convolution calls, on pool addresses

/// Where a call's operands and workspace are: device addresses of pool
/// storage on `st`'s device, shaped as `g` describes (NHWC, in the call's
/// type; the filter in (cout, kh, kw, cin)).
pub struct ConvArgs {
    pub x: u64,
    pub w: u64,
    pub y: u64,
    pub ws: u64,
    pub ws_bytes: usize,
}

fn vp(a: u64) -> *mut c_void {
    a as *mut c_void
}

/// `y = conv(x, w)` (alpha 1, beta 0) in `dtype` with the chosen forward
/// algorithm.
pub fn conv_forward(st: &State, g: &ConvGeom, dtype: DType, a: &ConvArgs) -> Result<()> {
    let k = key(g, dtype);
    let c = forward_choice(st, &k)?;
    let (h, d) = (handle(st)?, descs(st, &k)?);
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: every address is pool storage on this device of the size
    // the descriptors describe (the same geometry), at least
    // `c.workspace_bytes` of workspace (checked by the caller against the
    // plan); the handle is bound to the device's one stream.
    unsafe {
        dnn::convolution_forward(
            h.0,
            (&alpha as *const f32).cast(),
            d.x,
            vp(a.x),
            d.w,
            vp(a.w),
            d.conv,
            c.algo,
            vp(a.ws),
            a.ws_bytes,
            (&beta as *const f32).cast(),
            d.y,
            vp(a.y),
        )
    }
    .map_err(cudnn_err("cudnnConvolutionForward"))
}

/// `dx = conv_transpose(dy, w) + beta·dx` (alpha 1; beta 1 accumulates,
/// as the CPU's dgrad) in `dtype` with the chosen backward-data algorithm;
/// `a.x` is `dx` and `a.y` is `dy`.
pub fn conv_backward_data(
    st: &State,
    g: &ConvGeom,
    dtype: DType,
    beta: f32,
    a: &ConvArgs,
) -> Result<()> {
    let k = key(g, dtype);
    let c = backward_data_choice(st, &k)?;
    let (h, d) = (handle(st)?, descs(st, &k)?);
    let alpha = 1.0f32;
    // SAFETY: as in conv_forward.
    unsafe {
        dnn::convolution_backward_data(
            h.0,
            (&alpha as *const f32).cast(),
            d.w,
            vp(a.w),
            d.y,
            vp(a.y),
            d.conv,
            c.algo,
            vp(a.ws),
            a.ws_bytes,
            (&beta as *const f32).cast(),
            d.x,
            vp(a.x),
        )
    }
    .map_err(cudnn_err("cudnnConvolutionBackwardData"))
}

/// `w = dgrad_w(x, dy)` (alpha 1, beta 0: overwritten; the caller adds it
/// into the HWIO gradient) in `dtype` with the chosen backward-filter
/// algorithm; `a.w` is the OHWI gradient region and `a.y` is `dy`.
pub fn conv_backward_filter(st: &State, g: &ConvGeom, dtype: DType, a: &ConvArgs) -> Result<()> {
    let k = key(g, dtype);
    let c = backward_filter_choice(st, &k)?;
    let (h, d) = (handle(st)?, descs(st, &k)?);
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: as in conv_forward.
    unsafe {
        dnn::convolution_backward_filter(
            h.0,
            (&alpha as *const f32).cast(),
            d.x,
            vp(a.x),
            d.y,
            vp(a.y),
            d.conv,
            c.algo,
            vp(a.ws),
            a.ws_bytes,
            (&beta as *const f32).cast(),
            d.w,
            vp(a.w),
        )
    }
    .map_err(cudnn_err("cudnnConvolutionBackwardFilter"))
}

/// Where the regions of a workspace at device address `addr` start: the
/// address rounded up to [`WS_ALIGN`] (within the slack
/// [`super::conv_ws::ConvWs::bytes`] counts).
pub fn regions_base(addr: u64) -> u64 {
    addr.next_multiple_of(WS_ALIGN as u64)
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
