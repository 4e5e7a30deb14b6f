//! The cuBLAS functions memfit calls: handles, stream, math mode,
//! workspace and `cublasSgemm_v2`, checked as cuBLAS documents them and
//! computed with memfit's CPU GEMM.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};

use cudarc::cublas::sys::{
    cublasHandle_t, cublasMath_t, cublasOperation_t, cublasStatus_t, cudaStream_t,
};
use memfit::device::cpu::{Accumulate, MatRef, gemm_f32};

use crate::queue::Op;
use crate::state::fake;

pub struct BlasHandle {
    /// A region the caller gave with `cublasSetWorkspace_v2`.
    pub workspace: Option<(u64, usize)>,
}

#[derive(Default)]
pub struct Blas {
    pub handles: HashMap<usize, BlasHandle>,
}

fn refuse(why: String) -> cublasStatus_t {
    eprintln!("fake cuBLAS: {why}");
    cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasCreate_v2(handle: *mut cublasHandle_t) -> cublasStatus_t {
    let mut f = fake();
    if !f.initialised || f.sticky.is_some() {
        return cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED;
    }
    let id = f.handle();
    f.blas.handles.insert(id, BlasHandle { workspace: None });
    unsafe { handle.write(id as cublasHandle_t) };
    cublasStatus_t::CUBLAS_STATUS_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasDestroy_v2(handle: cublasHandle_t) -> cublasStatus_t {
    match fake().blas.handles.remove(&(handle as usize)) {
        Some(_) => cublasStatus_t::CUBLAS_STATUS_SUCCESS,
        None => cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasSetStream_v2(
    handle: cublasHandle_t,
    stream: cudaStream_t,
) -> cublasStatus_t {
    let f = fake();
    if !f.blas.handles.contains_key(&(handle as usize)) {
        return cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED;
    }
    if !stream.is_null() && !f.streams.contains_key(&(stream as usize)) {
        return refuse(format!("cublasSetStream: {stream:p} is not a stream"));
    }
    cublasStatus_t::CUBLAS_STATUS_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasSetMathMode(handle: cublasHandle_t, _mode: cublasMath_t) -> cublasStatus_t {
    if !fake().blas.handles.contains_key(&(handle as usize)) {
        return cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED;
    }
    cublasStatus_t::CUBLAS_STATUS_SUCCESS
}

/// cuBLAS documents the workspace as at least 256-byte aligned device
/// memory; the fake also checks it lies inside one allocation.
#[unsafe(no_mangle)]
pub extern "C" fn cublasSetWorkspace_v2(
    handle: cublasHandle_t,
    ws: *mut c_void,
    bytes: usize,
) -> cublasStatus_t {
    let mut f = fake();
    let addr = ws as u64;
    if bytes > 0 {
        if !addr.is_multiple_of(256) {
            return refuse(format!(
                "cublasSetWorkspace: {addr:#x} is not 256-byte aligned"
            ));
        }
        if let Err(why) = f.mem.check(addr, bytes) {
            return refuse(format!("cublasSetWorkspace: {why}"));
        }
    }
    match f.blas.handles.get_mut(&(handle as usize)) {
        Some(h) => {
            h.workspace = (bytes > 0).then_some((addr, bytes));
            cublasStatus_t::CUBLAS_STATUS_SUCCESS
        }
        None => cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasGetStatusString(s: cublasStatus_t) -> *const c_char {
    let name: &'static str = Box::leak(format!("{s:?} (fake cuBLAS)\0").into_boxed_str());
    name.as_ptr().cast()
}

/// Column-major `C = alpha op(A) op(B) + beta C`, (m, n) = (m, k)(k, n).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasSgemm_v2(
    handle: cublasHandle_t,
    transa: cublasOperation_t,
    transb: cublasOperation_t,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
) -> cublasStatus_t {
    let mut f = fake();
    let Some(hd) = f.blas.handles.get(&(handle as usize)) else {
        return cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED;
    };
    let workspace = hd.workspace;
    let t = |op: cublasOperation_t| match op {
        cublasOperation_t::CUBLAS_OP_N => Some(false),
        cublasOperation_t::CUBLAS_OP_T | cublasOperation_t::CUBLAS_OP_C => Some(true),
        _ => None,
    };
    let (Some(ta), Some(tb)) = (t(transa), t(transb)) else {
        return refuse("cublasSgemm: transa/transb must be N, T or C".into());
    };
    if m < 0 || n < 0 || k < 0 {
        return refuse(format!("cublasSgemm: m, n, k = {m}, {n}, {k}"));
    }
    let (m, n, k) = (m as usize, n as usize, k as usize);
    // Stored shapes (rows, cols) of A and B, column-major.
    let a_rows = if ta { k } else { m };
    let b_rows = if tb { n } else { k };
    let (a_cols, b_cols) = (if ta { m } else { k }, if tb { k } else { n });
    if (lda as i64) < a_rows.max(1) as i64
        || (ldb as i64) < b_rows.max(1) as i64
        || (ldc as i64) < m.max(1) as i64
    {
        return refuse(format!(
            "cublasSgemm: lda {lda} (needs >= {}), ldb {ldb} (>= {}), ldc {ldc} (>= {})",
            a_rows.max(1),
            b_rows.max(1),
            m.max(1)
        ));
    }
    if alpha.is_null() || beta.is_null() {
        return refuse(
            "cublasSgemm: alpha and beta are host pointers (CUBLAS_POINTER_MODE_HOST)".into(),
        );
    }
    if m == 0 || n == 0 {
        return cublasStatus_t::CUBLAS_STATUS_SUCCESS;
    }
    // SAFETY: host scalars (pointer mode host, checked non-null above).
    let (alpha, beta) = unsafe { (*alpha, *beta) };
    let (lda, ldb, ldc) = (lda as usize, ldb as usize, ldc as usize);
    let extent = |rows: usize, cols: usize, ld: usize| {
        if cols == 0 || rows == 0 {
            0
        } else {
            (cols - 1) * ld + rows
        }
    };
    let (a, b, c) = (a as u64, b as u64, c as u64);
    let run = move |mem: &mut crate::memory::DeviceMemory| -> Result<(), String> {
        if let Some((at, bytes)) = workspace {
            // cuBLAS owns its workspace during the call: scribbled, so that
            // data the caller keeps there is seen to be lost.
            mem.fill(at, 0xFF, bytes)?;
        }
        let av = mem
            .read_f32(a, extent(a_rows, a_cols, lda))
            .map_err(|e| format!("A: {e}"))?;
        let bv = mem
            .read_f32(b, extent(b_rows, b_cols, ldb))
            .map_err(|e| format!("B: {e}"))?;
        let mut cv = if beta != 0.0 {
            mem.read_f32(c, extent(m, n, ldc))
                .map_err(|e| format!("C: {e}"))?
        } else {
            vec![0.0; extent(m, n, ldc)]
        };
        // C^T (n, m) row-major = op(B)^T (n, k) · op(A)^T (k, m).
        let lhs = MatRef {
            data: &bv,
            rows: n,
            cols: k,
            rs: if tb { 1 } else { ldb },
            cs: if tb { ldb } else { 1 },
        };
        let rhs = MatRef {
            data: &av,
            rows: k,
            cols: m,
            rs: if ta { 1 } else { lda },
            cs: if ta { lda } else { 1 },
        };
        let mut ct = vec![0.0f32; n * m];
        gemm_f32(&mut ct, lhs, rhs, Accumulate::No);
        for j in 0..n {
            for i in 0..m {
                let at = i + j * ldc;
                let prod = alpha * ct[j * m + i];
                cv[at] = if beta != 0.0 {
                    prod + beta * cv[at]
                } else {
                    prod
                };
            }
        }
        if beta == 0.0 {
            // Only the m rows of each column are C; the rows between (ldc > m)
            // are not the call's to write.
            for j in 0..n {
                let col = &cv[j * ldc..j * ldc + m];
                mem.write_f32(c + (j * ldc * 4) as u64, col)?;
            }
            Ok(())
        } else {
            mem.write_f32(c, &cv)
        }
    };
    match f.enqueue(Op::Compute {
        what: format!("cublasSgemm (m {m}, n {n}, k {k})"),
        run: Box::new(run),
    }) {
        Ok(()) => cublasStatus_t::CUBLAS_STATUS_SUCCESS,
        Err(_) => cublasStatus_t::CUBLAS_STATUS_EXECUTION_FAILED,
    }
}
