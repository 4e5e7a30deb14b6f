//! The cuDNN functions memfit calls: handles, tensor / filter /
//! convolution descriptors, algorithm ranking and workspace sizes, and the
//! three convolution passes, checked as cuDNN documents them and computed
//! with memfit's CPU convolution.
//!
//! Supported here: what memfit uses (NHWC float tensors and filters, and
//! NHWC bf16 ones with a float compute type, cuDNN's PSEUDO_BFLOAT16
//! configuration: operands widened exactly, f32 accumulation, the result
//! blended in f32 and rounded to bf16 to nearest even as it is stored;
//! cross-correlation, equal padding and stride in both directions, no
//! dilation, one group); anything else the real library accepts is
//! refused with `CUDNN_STATUS_NOT_SUPPORTED` and a message saying so.
//! Algorithms: forward IMPLICIT_GEMM and IMPLICIT_PRECOMP_GEMM, backward
//! data ALGO_0 (not deterministic) and ALGO_1, backward filter ALGO_0 and
//! ALGO_3 (not deterministic) and ALGO_1; the rest are NOT_SUPPORTED for
//! NHWC float, as on the real library. Workspace sizes are a fixed formula
//! per algorithm (odd byte counts, as cuDNN's are), checked at the call,
//! and the workspace is scribbled by every call that is given one.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};

use cudarc::cudnn::sys::{
    cudaStream_t, cudnnConvolutionBwdDataAlgo_t, cudnnConvolutionBwdDataAlgoPerf_t,
    cudnnConvolutionBwdFilterAlgo_t, cudnnConvolutionBwdFilterAlgoPerf_t,
    cudnnConvolutionDescriptor_t, cudnnConvolutionFwdAlgo_t, cudnnConvolutionFwdAlgoPerf_t,
    cudnnConvolutionMode_t, cudnnDataType_t, cudnnDeterminism_t, cudnnFilterDescriptor_t,
    cudnnHandle_t, cudnnMathType_t, cudnnStatus_t, cudnnTensorDescriptor_t, cudnnTensorFormat_t,
};
use memfit::device::cpu::{GemmMath, bf16_bits_to_f32, f32_to_bf16_bits};
use memfit::ops::conv2d::{ConvGeom, ConvInput, conv2d_backward, conv2d_forward};

use crate::memory::DeviceMemory;
use crate::queue::Op;
use crate::state::{Fake, fake};

type Status = cudnnStatus_t;
const OK: Status = cudnnStatus_t::CUDNN_STATUS_SUCCESS;

/// (format, type, n, c, h, w) as set.
#[derive(Clone, Copy, Debug)]
pub struct Tensor4d {
    pub format: cudnnTensorFormat_t,
    pub dtype: cudnnDataType_t,
    pub dims: [usize; 4],
}

#[derive(Clone, Copy, Debug)]
pub struct Conv2d {
    pub pad: [i32; 2],
    pub stride: [i32; 2],
    pub dilation: [i32; 2],
    pub mode: cudnnConvolutionMode_t,
    pub compute: cudnnDataType_t,
    pub math: cudnnMathType_t,
}

#[derive(Default)]
pub struct Dnn {
    pub handles: HashMap<usize, ()>,
    /// None until set.
    pub tensors: HashMap<usize, Option<Tensor4d>>,
    pub filters: HashMap<usize, Option<Tensor4d>>,
    pub convs: HashMap<usize, Option<Conv2d>>,
}

fn refuse(s: Status, why: String) -> Status {
    eprintln!("fake cuDNN: {why}");
    s
}

fn bad(why: String) -> Status {
    refuse(cudnnStatus_t::CUDNN_STATUS_BAD_PARAM, why)
}

fn unsupported(why: String) -> Status {
    refuse(
        cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED,
        format!(
            "{why} (the fake cuDNN supports what memfit uses: NHWC float, cross-correlation, no dilation)"
        ),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnGetVersion() -> usize {
    91400
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnGetErrorString(s: Status) -> *const c_char {
    let name: &'static str = Box::leak(format!("{s:?} (fake cuDNN)\0").into_boxed_str());
    name.as_ptr().cast()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnCreate(handle: *mut cudnnHandle_t) -> Status {
    let mut f = fake();
    if !f.initialised {
        return cudnnStatus_t::CUDNN_STATUS_NOT_INITIALIZED;
    }
    let id = f.handle();
    f.dnn.handles.insert(id, ());
    unsafe { handle.write(id as cudnnHandle_t) };
    OK
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnDestroy(handle: cudnnHandle_t) -> Status {
    match fake().dnn.handles.remove(&(handle as usize)) {
        Some(()) => OK,
        None => bad(format!("cudnnDestroy: {handle:p} is not a handle")),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetStream(handle: cudnnHandle_t, stream: cudaStream_t) -> Status {
    let f = fake();
    if !f.dnn.handles.contains_key(&(handle as usize)) {
        return bad(format!("cudnnSetStream: {handle:p} is not a handle"));
    }
    if !stream.is_null() && !f.streams.contains_key(&(stream as usize)) {
        return bad(format!("cudnnSetStream: {stream:p} is not a stream"));
    }
    OK
}

macro_rules! create_destroy {
    ($create:ident, $destroy:ident, $ty:ty, $map:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $create(d: *mut $ty) -> Status {
            let mut f = fake();
            let id = f.handle();
            f.dnn.$map.insert(id, None);
            unsafe { d.write(id as $ty) };
            OK
        }

        #[unsafe(no_mangle)]
        pub extern "C" fn $destroy(d: $ty) -> Status {
            match fake().dnn.$map.remove(&(d as usize)) {
                Some(_) => OK,
                None => bad(format!(
                    "{}: {:p} is not a descriptor",
                    stringify!($destroy),
                    d
                )),
            }
        }
    };
}

create_destroy!(
    cudnnCreateTensorDescriptor,
    cudnnDestroyTensorDescriptor,
    cudnnTensorDescriptor_t,
    tensors
);
create_destroy!(
    cudnnCreateFilterDescriptor,
    cudnnDestroyFilterDescriptor,
    cudnnFilterDescriptor_t,
    filters
);
create_destroy!(
    cudnnCreateConvolutionDescriptor,
    cudnnDestroyConvolutionDescriptor,
    cudnnConvolutionDescriptor_t,
    convs
);

fn dims4(op: &str, n: c_int, c: c_int, h: c_int, w: c_int) -> Result<[usize; 4], Status> {
    if n <= 0 || c <= 0 || h <= 0 || w <= 0 {
        return Err(bad(format!(
            "{op}: dimensions {n}x{c}x{h}x{w} must all be positive"
        )));
    }
    Ok([n as usize, c as usize, h as usize, w as usize])
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetTensor4dDescriptor(
    d: cudnnTensorDescriptor_t,
    format: cudnnTensorFormat_t,
    dtype: cudnnDataType_t,
    n: c_int,
    c: c_int,
    h: c_int,
    w: c_int,
) -> Status {
    let mut f = fake();
    let dims = match dims4("cudnnSetTensor4dDescriptor", n, c, h, w) {
        Ok(d) => d,
        Err(s) => return s,
    };
    if format == cudnnTensorFormat_t::CUDNN_TENSOR_NCHW_VECT_C {
        return bad("cudnnSetTensor4dDescriptor: NCHW_VECT_C is for 8-bit integer types".into());
    }
    match f.dnn.tensors.get_mut(&(d as usize)) {
        Some(slot) => {
            *slot = Some(Tensor4d {
                format,
                dtype,
                dims,
            });
            OK
        }
        None => bad(format!(
            "cudnnSetTensor4dDescriptor: {d:p} is not a tensor descriptor"
        )),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetFilter4dDescriptor(
    d: cudnnFilterDescriptor_t,
    dtype: cudnnDataType_t,
    format: cudnnTensorFormat_t,
    k: c_int,
    c: c_int,
    h: c_int,
    w: c_int,
) -> Status {
    let mut f = fake();
    let dims = match dims4("cudnnSetFilter4dDescriptor", k, c, h, w) {
        Ok(d) => d,
        Err(s) => return s,
    };
    match f.dnn.filters.get_mut(&(d as usize)) {
        Some(slot) => {
            *slot = Some(Tensor4d {
                format,
                dtype,
                dims,
            });
            OK
        }
        None => bad(format!(
            "cudnnSetFilter4dDescriptor: {d:p} is not a filter descriptor"
        )),
    }
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn cudnnSetConvolution2dDescriptor(
    d: cudnnConvolutionDescriptor_t,
    pad_h: c_int,
    pad_w: c_int,
    u: c_int,
    v: c_int,
    dil_h: c_int,
    dil_w: c_int,
    mode: cudnnConvolutionMode_t,
    compute: cudnnDataType_t,
) -> Status {
    let mut f = fake();
    if pad_h < 0 || pad_w < 0 || u <= 0 || v <= 0 || dil_h <= 0 || dil_w <= 0 {
        return bad(format!(
            "cudnnSetConvolution2dDescriptor: padding {pad_h},{pad_w} stride {u},{v} dilation {dil_h},{dil_w}"
        ));
    }
    match f.dnn.convs.get_mut(&(d as usize)) {
        Some(slot) => {
            let math = slot.map_or(cudnnMathType_t::CUDNN_DEFAULT_MATH, |c| c.math);
            *slot = Some(Conv2d {
                pad: [pad_h, pad_w],
                stride: [u, v],
                dilation: [dil_h, dil_w],
                mode,
                compute,
                math,
            });
            OK
        }
        None => bad(format!(
            "cudnnSetConvolution2dDescriptor: {d:p} is not a convolution descriptor"
        )),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetConvolutionMathType(
    d: cudnnConvolutionDescriptor_t,
    math: cudnnMathType_t,
) -> Status {
    let mut f = fake();
    match f.dnn.convs.get_mut(&(d as usize)) {
        Some(Some(c)) => {
            c.math = math;
            OK
        }
        Some(None) => bad("cudnnSetConvolutionMathType: the descriptor is not set yet".into()),
        None => bad(format!(
            "cudnnSetConvolutionMathType: {d:p} is not a convolution descriptor"
        )),
    }
}

/// A convolution as the four descriptors describe it, checked.
#[derive(Clone, Copy, Debug)]
struct Problem {
    geom: ConvGeom,
    math: cudnnMathType_t,
    /// bf16 data (else float).
    bf16: bool,
}

/// Checks the descriptors agree (cuDNN's BAD_PARAM cases) and are what
/// this fake computes (NOT_SUPPORTED otherwise).
fn problem(
    f: &Fake,
    op: &str,
    handle: cudnnHandle_t,
    x: cudnnTensorDescriptor_t,
    w: cudnnFilterDescriptor_t,
    conv: cudnnConvolutionDescriptor_t,
    y: cudnnTensorDescriptor_t,
) -> Result<Problem, Status> {
    if !f.dnn.handles.contains_key(&(handle as usize)) {
        return Err(bad(format!("{op}: {handle:p} is not a handle")));
    }
    let get_t = |d: usize, what: &str| match f.dnn.tensors.get(&d) {
        Some(Some(t)) => Ok(*t),
        _ => Err(bad(format!(
            "{op}: the {what} descriptor {d:#x} is not a set tensor descriptor"
        ))),
    };
    let xt = get_t(x as usize, "input")?;
    let yt = get_t(y as usize, "output")?;
    let wt = match f.dnn.filters.get(&(w as usize)) {
        Some(Some(t)) => *t,
        _ => return Err(bad(format!("{op}: {w:p} is not a set filter descriptor"))),
    };
    let ct = match f.dnn.convs.get(&(conv as usize)) {
        Some(Some(c)) => *c,
        _ => {
            return Err(bad(format!(
                "{op}: {conv:p} is not a set convolution descriptor"
            )));
        }
    };
    if xt.dtype != wt.dtype || xt.dtype != yt.dtype {
        return Err(bad(format!(
            "{op}: data types differ: x {:?}, w {:?}, y {:?}",
            xt.dtype, wt.dtype, yt.dtype
        )));
    }
    let [n, c, h, wd] = xt.dims;
    let [k, fc, r, s] = wt.dims;
    if fc != c {
        return Err(bad(format!(
            "{op}: the filter has {fc} input channels, the input {c}"
        )));
    }
    // cudnnGetConvolution2dForwardOutputDim.
    let out = |len: usize, pad: i32, stride: i32, dil: i32, kern: usize| -> Option<usize> {
        let span = (dil as usize) * (kern - 1) + 1;
        let padded = len + 2 * pad as usize;
        (padded >= span).then(|| (padded - span) / stride as usize + 1)
    };
    let (Some(oh), Some(ow)) = (
        out(h, ct.pad[0], ct.stride[0], ct.dilation[0], r),
        out(wd, ct.pad[1], ct.stride[1], ct.dilation[1], s),
    ) else {
        return Err(bad(format!(
            "{op}: the {r}x{s} filter is larger than the padded {h}x{wd} input"
        )));
    };
    if yt.dims != [n, k, oh, ow] {
        return Err(bad(format!(
            "{op}: the output descriptor is {:?}, the convolution gives {:?}",
            yt.dims,
            [n, k, oh, ow]
        )));
    }
    let bf16 = match xt.dtype {
        cudnnDataType_t::CUDNN_DATA_FLOAT => false,
        cudnnDataType_t::CUDNN_DATA_BFLOAT16 => true,
        other => return Err(unsupported(format!("{op}: data type {other:?}"))),
    };
    if ct.compute != cudnnDataType_t::CUDNN_DATA_FLOAT {
        return Err(bad(format!(
            "{op}: {:?} data needs a float compute type, not {:?}",
            xt.dtype, ct.compute
        )));
    }
    let nhwc = cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
    if xt.format != nhwc || yt.format != nhwc || wt.format != nhwc {
        return Err(unsupported(format!(
            "{op}: formats x {:?}, w {:?}, y {:?}",
            xt.format, wt.format, yt.format
        )));
    }
    if ct.mode != cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION
        || ct.dilation != [1, 1]
        || ct.pad[0] != ct.pad[1]
        || ct.stride[0] != ct.stride[1]
    {
        return Err(unsupported(format!("{op}: {ct:?}")));
    }
    Ok(Problem {
        geom: ConvGeom {
            n,
            h,
            w: wd,
            cin: c,
            cout: k,
            kh: r,
            kw: s,
            stride: ct.stride[0] as usize,
            pad: ct.pad[0] as usize,
        },
        math: ct.math,
        bf16,
    })
}

// ---------------------------------------------------------------------------
// Algorithms and workspaces

fn fwd_workspace(g: &ConvGeom, a: cudnnConvolutionFwdAlgo_t) -> Option<usize> {
    use cudnnConvolutionFwdAlgo_t as A;
    match a {
        A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM => Some(0),
        // Precomputed offsets of one filter's taps (131 bytes measured for a
        // 3x3 on the H200: odd, as here).
        A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM => Some(8 * g.kh * g.kw + 59),
        _ => None,
    }
}

fn data_workspace(g: &ConvGeom, a: cudnnConvolutionBwdDataAlgo_t) -> Option<usize> {
    use cudnnConvolutionBwdDataAlgo_t as A;
    match a {
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 => Some(0),
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1 => Some(4 * g.cin + 17),
        _ => None,
    }
}

fn filter_workspace(g: &ConvGeom, a: cudnnConvolutionBwdFilterAlgo_t) -> Option<usize> {
    use cudnnConvolutionBwdFilterAlgo_t as A;
    match a {
        A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 => Some(0),
        // A split-K partial weight gradient (2.2 MB measured at 64->64 3x3).
        A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 => Some(4 * 4 * g.kh * g.kw * g.cin * g.cout + 3),
        A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3 => Some(4 * g.cout + 5),
        _ => None,
    }
}

fn fwd_deterministic(_: cudnnConvolutionFwdAlgo_t) -> bool {
    true
}

fn data_deterministic(a: cudnnConvolutionBwdDataAlgo_t) -> bool {
    a != cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0
}

fn filter_deterministic(a: cudnnConvolutionBwdFilterAlgo_t) -> bool {
    a == cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1
}

fn write_size(out: *mut usize, op: &str, ws: Option<usize>) -> Status {
    match ws {
        Some(b) => {
            unsafe { out.write(b) };
            OK
        }
        None => unsupported(format!("{op}: the algorithm does not serve NHWC float")),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolutionForwardWorkspaceSize(
    handle: cudnnHandle_t,
    x: cudnnTensorDescriptor_t,
    w: cudnnFilterDescriptor_t,
    conv: cudnnConvolutionDescriptor_t,
    y: cudnnTensorDescriptor_t,
    algo: cudnnConvolutionFwdAlgo_t,
    size: *mut usize,
) -> Status {
    let op = "cudnnGetConvolutionForwardWorkspaceSize";
    let f = fake();
    match problem(&f, op, handle, x, w, conv, y) {
        Ok(p) => write_size(size, op, fwd_workspace(&p.geom, algo)),
        Err(s) => s,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardDataWorkspaceSize(
    handle: cudnnHandle_t,
    w: cudnnFilterDescriptor_t,
    dy: cudnnTensorDescriptor_t,
    conv: cudnnConvolutionDescriptor_t,
    dx: cudnnTensorDescriptor_t,
    algo: cudnnConvolutionBwdDataAlgo_t,
    size: *mut usize,
) -> Status {
    let op = "cudnnGetConvolutionBackwardDataWorkspaceSize";
    let f = fake();
    match problem(&f, op, handle, dx, w, conv, dy) {
        Ok(p) => write_size(size, op, data_workspace(&p.geom, algo)),
        Err(s) => s,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardFilterWorkspaceSize(
    handle: cudnnHandle_t,
    x: cudnnTensorDescriptor_t,
    dy: cudnnTensorDescriptor_t,
    conv: cudnnConvolutionDescriptor_t,
    dw: cudnnFilterDescriptor_t,
    algo: cudnnConvolutionBwdFilterAlgo_t,
    size: *mut usize,
) -> Status {
    let op = "cudnnGetConvolutionBackwardFilterWorkspaceSize";
    let f = fake();
    match problem(&f, op, handle, x, dw, conv, dy) {
        Ok(p) => write_size(size, op, filter_workspace(&p.geom, algo)),
        Err(s) => s,
    }
}

/// Fills cuDNN's ranking: the algorithms serving the problem first (the
/// one with less workspace first), then those that do not, NOT_SUPPORTED.
macro_rules! ranking {
    ($name:ident, $algo:ty, $perf:ident, $all:expr, $ws:ident, $det:ident, ($xd:ident, $wd:ident, $yd:ident), $a:ty, $b:ty, $c:ty, $order:expr) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            handle: cudnnHandle_t,
            d0: $a,
            d1: $b,
            conv: cudnnConvolutionDescriptor_t,
            d2: $c,
            requested: c_int,
            returned: *mut c_int,
            results: *mut $perf,
        ) -> Status {
            let op = stringify!($name);
            if requested <= 0 || returned.is_null() || results.is_null() {
                return bad(format!("{op}: requested {requested} results"));
            }
            let f = fake();
            let ($xd, $wd, $yd) = $order(d0, d1, d2);
            let p = match problem(&f, op, handle, $xd, $wd, conv, $yd) {
                Ok(p) => p,
                Err(s) => return s,
            };
            let all: &[$algo] = &$all;
            let mut rows: Vec<(bool, usize, $algo)> = all
                .iter()
                .map(|&a| match $ws(&p.geom, a) {
                    Some(b) => (true, b, a),
                    None => (false, 0, a),
                })
                .collect();
            rows.sort_by_key(|&(ok, b, _)| (!ok, b));
            let n = rows.len().min(requested as usize);
            for (i, &(ok, bytes, algo)) in rows[..n].iter().enumerate() {
                let perf = $perf {
                    algo,
                    status: if ok {
                        OK
                    } else {
                        cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED
                    },
                    time: if ok { 1.0 + i as f32 } else { -1.0 },
                    memory: bytes,
                    determinism: if $det(algo) {
                        cudnnDeterminism_t::CUDNN_DETERMINISTIC
                    } else {
                        cudnnDeterminism_t::CUDNN_NON_DETERMINISTIC
                    },
                    mathType: p.math,
                    reserved: [0; 3],
                };
                unsafe { results.add(i).write(perf) };
            }
            unsafe { returned.write(n as c_int) };
            OK
        }
    };
}

use cudnnConvolutionBwdDataAlgo_t as D;
use cudnnConvolutionBwdFilterAlgo_t as W;
use cudnnConvolutionFwdAlgo_t as F;

ranking!(
    cudnnGetConvolutionForwardAlgorithm_v7,
    F,
    cudnnConvolutionFwdAlgoPerf_t,
    [
        F::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        F::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        F::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        F::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        F::CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        F::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        F::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        F::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ],
    fwd_workspace,
    fwd_deterministic,
    (x, w, y),
    cudnnTensorDescriptor_t,
    cudnnFilterDescriptor_t,
    cudnnTensorDescriptor_t,
    |a, b, c| (a, b, c)
);

ranking!(
    cudnnGetConvolutionBackwardDataAlgorithm_v7,
    D,
    cudnnConvolutionBwdDataAlgoPerf_t,
    [
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ],
    data_workspace,
    data_deterministic,
    (x, w, y),
    cudnnFilterDescriptor_t,
    cudnnTensorDescriptor_t,
    cudnnTensorDescriptor_t,
    // (filter, dy, dx) -> (x, w, y)
    |w, dy, dx| (dx, w, dy)
);

ranking!(
    cudnnGetConvolutionBackwardFilterAlgorithm_v7,
    W,
    cudnnConvolutionBwdFilterAlgoPerf_t,
    [
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
    ],
    filter_workspace,
    filter_deterministic,
    (x, w, y),
    cudnnTensorDescriptor_t,
    cudnnTensorDescriptor_t,
    cudnnFilterDescriptor_t,
    // (x, dy, dw) -> (x, w, y)
    |x, dy, dw| (x, dw, dy)
);

// ---------------------------------------------------------------------------
// The passes

/// The workspace given to a call: enough for the algorithm, device memory.
fn check_workspace(
    f: &Fake,
    op: &str,
    need: Option<usize>,
    ws: *mut c_void,
    bytes: usize,
) -> Result<Option<(u64, usize)>, Status> {
    let Some(need) = need else {
        return Err(unsupported(format!(
            "{op}: the algorithm does not serve NHWC float"
        )));
    };
    if bytes < need {
        return Err(bad(format!(
            "{op}: {bytes} bytes of workspace given, the algorithm needs {need}"
        )));
    }
    if bytes == 0 {
        return Ok(None);
    }
    if ws.is_null() {
        return Err(bad(format!("{op}: a null workspace of {bytes} bytes")));
    }
    f.mem
        .check(ws as u64, bytes)
        .map_err(|why| bad(format!("{op}: workspace: {why}")))?;
    Ok(Some((ws as u64, bytes)))
}

/// KRSC (cout, kh, kw, cin) -> HWIO (kh, kw, cin, cout), memfit's CPU layout.
fn krsc_to_hwio(w: &[f32], g: &ConvGeom) -> Vec<f32> {
    let (co, khw, ci) = (g.cout, g.kh * g.kw, g.cin);
    let mut out = vec![0.0; w.len()];
    for o in 0..co {
        for t in 0..khw {
            for i in 0..ci {
                out[(t * ci + i) * co + o] = w[(o * khw + t) * ci + i];
            }
        }
    }
    out
}

fn hwio_to_krsc(w: &[f32], g: &ConvGeom) -> Vec<f32> {
    let (co, khw, ci) = (g.cout, g.kh * g.kw, g.cin);
    let mut out = vec![0.0; w.len()];
    for o in 0..co {
        for t in 0..khw {
            for i in 0..ci {
                out[(o * khw + t) * ci + i] = w[(t * ci + i) * co + o];
            }
        }
    }
    out
}

/// `dst = alpha * value + beta * dst` (beta 0: dst is not read, as cuDNN),
/// in f32; bf16 data is read widened and stored rounded to nearest even.
fn blend(
    mem: &mut DeviceMemory,
    dst: u64,
    value: &[f32],
    alpha: f32,
    beta: f32,
    bf16: bool,
) -> Result<(), String> {
    let out: Vec<f32> = if beta == 0.0 {
        value.iter().map(|v| alpha * v).collect()
    } else {
        let old = read_any(mem, dst, value.len(), bf16)?;
        value
            .iter()
            .zip(&old)
            .map(|(v, o)| alpha * v + beta * o)
            .collect()
    };
    if !bf16 {
        return mem.write_f32(dst, &out);
    }
    let bytes: Vec<u8> = out
        .iter()
        .flat_map(|&v| f32_to_bf16_bits(v).to_le_bytes())
        .collect();
    mem.write(dst, &bytes)
}

/// `len` values at `at`, f32 or bf16 (widened exactly).
fn read_any(mem: &DeviceMemory, at: u64, len: usize, bf16: bool) -> Result<Vec<f32>, String> {
    if !bf16 {
        return mem.read_f32(at, len);
    }
    let mut bytes = vec![0u8; len * 2];
    mem.read(at, &mut bytes)?;
    Ok(bytes
        .chunks_exact(2)
        .map(|c| bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
        .collect())
}

fn enqueue(
    mut f: std::sync::MutexGuard<'_, Fake>,
    what: String,
    run: crate::queue::Compute,
) -> Status {
    match f.enqueue(Op::Compute { what, run }) {
        Ok(()) => OK,
        Err(_) => cudnnStatus_t::CUDNN_STATUS_EXECUTION_FAILED,
    }
}

/// Reads alpha and beta: host floats for float data.
unsafe fn scalars(alpha: *const c_void, beta: *const c_void) -> Result<(f32, f32), Status> {
    if alpha.is_null() || beta.is_null() {
        return Err(bad("alpha and beta must be host pointers to floats".into()));
    }
    Ok(unsafe { (*alpha.cast::<f32>(), *beta.cast::<f32>()) })
}

/// What each convolution pass checks before it queues work, in cuDNN's
/// order: the descriptors (named x, w, y as the forward pass names them),
/// the workspace `algo` needs (`need`: None for an algorithm this fake does
/// not run), and alpha and beta.
struct Pass {
    f: std::sync::MutexGuard<'static, Fake>,
    g: ConvGeom,
    bf16: bool,
    workspace: Option<(u64, usize)>,
    alpha: f32,
    beta: f32,
}

#[allow(clippy::too_many_arguments)]
unsafe fn check_pass(
    op: &str,
    handle: cudnnHandle_t,
    xd: cudnnTensorDescriptor_t,
    wd: cudnnFilterDescriptor_t,
    conv: cudnnConvolutionDescriptor_t,
    yd: cudnnTensorDescriptor_t,
    need: impl FnOnce(&ConvGeom) -> Option<usize>,
    ws: *mut c_void,
    ws_bytes: usize,
    alpha: *const c_void,
    beta: *const c_void,
) -> Result<Pass, Status> {
    let f = fake();
    let pr = problem(&f, op, handle, xd, wd, conv, yd)?;
    let g = pr.geom;
    let workspace = check_workspace(&f, op, need(&g), ws, ws_bytes)?;
    let (alpha, beta) = unsafe { scalars(alpha, beta) }?;
    Ok(Pass {
        f,
        g,
        bf16: pr.bf16,
        workspace,
        alpha,
        beta,
    })
}

/// Overwrites the workspace as the pass runs: the real library leaves
/// whatever it likes there, so nothing may rely on its contents.
fn scribble(mem: &mut DeviceMemory, workspace: Option<(u64, usize)>) -> Result<(), String> {
    match workspace {
        Some((at, bytes)) => mem.fill(at, 0xFF, bytes),
        None => Ok(()),
    }
}

/// `len` values at `at` (bf16 widened), an error naming the operand `what`.
fn read(
    mem: &DeviceMemory,
    at: u64,
    len: usize,
    bf16: bool,
    what: &str,
) -> Result<Vec<f32>, String> {
    read_any(mem, at, len, bf16).map_err(|e| format!("{what}: {e}"))
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cudnnConvolutionForward(
    handle: cudnnHandle_t,
    alpha: *const c_void,
    xd: cudnnTensorDescriptor_t,
    x: *const c_void,
    wd: cudnnFilterDescriptor_t,
    w: *const c_void,
    conv: cudnnConvolutionDescriptor_t,
    algo: cudnnConvolutionFwdAlgo_t,
    ws: *mut c_void,
    ws_bytes: usize,
    beta: *const c_void,
    yd: cudnnTensorDescriptor_t,
    y: *mut c_void,
) -> Status {
    let op = "cudnnConvolutionForward";
    let Pass {
        f,
        g,
        bf16,
        workspace,
        alpha,
        beta,
    } = match unsafe {
        check_pass(
            op,
            handle,
            xd,
            wd,
            conv,
            yd,
            |g| fwd_workspace(g, algo),
            ws,
            ws_bytes,
            alpha,
            beta,
        )
    } {
        Ok(p) => p,
        Err(s) => return s,
    };
    let (x, w, y) = (x as u64, w as u64, y as u64);
    let run = move |mem: &mut DeviceMemory| -> Result<(), String> {
        scribble(mem, workspace)?;
        let xv = read(mem, x, g.input_len(), bf16, "x")?;
        let wv = read(mem, w, g.weight_len(), bf16, "w")?;
        let mut yv = vec![0.0; g.output_len()];
        let mut scratch = vec![0.0; g.forward_workspace_len()];
        conv2d_forward(
            &mut yv,
            ConvInput::F32(&xv),
            &krsc_to_hwio(&wv, &g),
            &g,
            &mut scratch,
            GemmMath::F32,
        );
        blend(mem, y, &yv, alpha, beta, bf16).map_err(|e| format!("y: {e}"))
    };
    enqueue(f, format!("{op} {g:?} {algo:?}"), Box::new(run))
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cudnnConvolutionBackwardData(
    handle: cudnnHandle_t,
    alpha: *const c_void,
    wd: cudnnFilterDescriptor_t,
    w: *const c_void,
    dyd: cudnnTensorDescriptor_t,
    dy: *const c_void,
    conv: cudnnConvolutionDescriptor_t,
    algo: cudnnConvolutionBwdDataAlgo_t,
    ws: *mut c_void,
    ws_bytes: usize,
    beta: *const c_void,
    dxd: cudnnTensorDescriptor_t,
    dx: *mut c_void,
) -> Status {
    let op = "cudnnConvolutionBackwardData";
    let Pass {
        f,
        g,
        bf16,
        workspace,
        alpha,
        beta,
    } = match unsafe {
        check_pass(
            op,
            handle,
            dxd,
            wd,
            conv,
            dyd,
            |g| data_workspace(g, algo),
            ws,
            ws_bytes,
            alpha,
            beta,
        )
    } {
        Ok(p) => p,
        Err(s) => return s,
    };
    let (w, dy, dx) = (w as u64, dy as u64, dx as u64);
    let run = move |mem: &mut DeviceMemory| -> Result<(), String> {
        scribble(mem, workspace)?;
        let wv = read(mem, w, g.weight_len(), bf16, "w")?;
        let dyv = read(mem, dy, g.output_len(), bf16, "dy")?;
        let mut dxv = vec![0.0; g.input_len()];
        // memfit's backward computes both gradients; the weight's is dropped
        // (its input is zeros: backward data does not read x).
        let zeros = vec![0.0; g.input_len()];
        let mut dw_unused = vec![0.0; g.weight_len()];
        let mut scratch = vec![0.0; g.backward_workspace_len()];
        conv2d_backward(
            Some(&mut dxv),
            &mut dw_unused,
            &dyv,
            ConvInput::F32(&zeros),
            &krsc_to_hwio(&wv, &g),
            &g,
            &mut scratch,
            GemmMath::F32,
        );
        blend(mem, dx, &dxv, alpha, beta, bf16).map_err(|e| format!("dx: {e}"))
    };
    enqueue(f, format!("{op} {g:?} {algo:?}"), Box::new(run))
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cudnnConvolutionBackwardFilter(
    handle: cudnnHandle_t,
    alpha: *const c_void,
    xd: cudnnTensorDescriptor_t,
    x: *const c_void,
    dyd: cudnnTensorDescriptor_t,
    dy: *const c_void,
    conv: cudnnConvolutionDescriptor_t,
    algo: cudnnConvolutionBwdFilterAlgo_t,
    ws: *mut c_void,
    ws_bytes: usize,
    beta: *const c_void,
    dwd: cudnnFilterDescriptor_t,
    dw: *mut c_void,
) -> Status {
    let op = "cudnnConvolutionBackwardFilter";
    let Pass {
        f,
        g,
        bf16,
        workspace,
        alpha,
        beta,
    } = match unsafe {
        check_pass(
            op,
            handle,
            xd,
            dwd,
            conv,
            dyd,
            |g| filter_workspace(g, algo),
            ws,
            ws_bytes,
            alpha,
            beta,
        )
    } {
        Ok(p) => p,
        Err(s) => return s,
    };
    let (x, dy, dw) = (x as u64, dy as u64, dw as u64);
    let run = move |mem: &mut DeviceMemory| -> Result<(), String> {
        scribble(mem, workspace)?;
        let xv = read(mem, x, g.input_len(), bf16, "x")?;
        let dyv = read(mem, dy, g.output_len(), bf16, "dy")?;
        let mut dw_hwio = vec![0.0; g.weight_len()];
        let w_unused = vec![0.0; g.weight_len()];
        let mut scratch = vec![0.0; g.backward_workspace_len()];
        conv2d_backward(
            None,
            &mut dw_hwio,
            &dyv,
            ConvInput::F32(&xv),
            &w_unused,
            &g,
            &mut scratch,
            GemmMath::F32,
        );
        blend(mem, dw, &hwio_to_krsc(&dw_hwio, &g), alpha, beta, bf16)
            .map_err(|e| format!("dw: {e}"))
    };
    enqueue(f, format!("{op} {g:?} {algo:?}"), Box::new(run))
}
