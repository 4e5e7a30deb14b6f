//! Which cuDNN algorithm a convolution geometry runs with, and the exact
//! workspace it asks for: the pure part of `dnn`'s per-geometry cache (its
//! key, the choice from cuDNN's answers and the fallback order, the line
//! the GPU check prints), with no cuDNN call in it, so that tests check it
//! on machines without a GPU (tests/cuda_plan.rs). `dnn` asks cuDNN and
//! feeds the answers in here.
//!
//! The policy: the pinned algorithm of each pass (deterministic, so a
//! recomputed activation gets the same bits, and the same one on every
//! GPU) unless cuDNN refuses its workspace query for the geometry; then
//! the first algorithm of cuDNN's own ranking (`cudnnGet*Algorithm_v7`,
//! ordered by expected speed) whose status is success, that cuDNN reports
//! deterministic, and whose workspace query answers. The workspace counted
//! is that query's answer for the chosen algorithm (never the ranking's
//! `memory` estimate, never a default), so the planner counts what the
//! call will be given.

use std::fmt;

use crate::ops::conv2d::ConvGeom;
use crate::tensor::DType;

/// The memory layout of a convolution's activations and filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Activations (n, h, w, c); the filter as (cout, kh, kw, cin).
    Nhwc,
}

/// Everything cuDNN's descriptors of one convolution depend on, so one
/// cache entry serves every call of that geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvKey {
    pub geom: ConvGeom,
    pub dtype: DType,
    pub layout: Layout,
    /// For f32: TF32 tensor-core math allowed (`CUDNN_TENSOR_OP_MATH`),
    /// else strict fp32 (`CUDNN_FMA_MATH`): the math type changes which
    /// algorithms cuDNN accepts and what they ask for. bf16 always runs
    /// `CUDNN_TENSOR_OP_MATH` (this is false).
    pub tf32: bool,
}

impl ConvKey {
    /// The key of an f32 NHWC convolution (a bf16 one is this with
    /// `dtype: DType::BF16`).
    pub fn f32_nhwc(geom: &ConvGeom, tf32: bool) -> Self {
        ConvKey {
            geom: *geom,
            dtype: DType::F32,
            layout: Layout::Nhwc,
            tf32,
        }
    }
}

impl fmt::Display for ConvKey {
    /// `n64 56x56x64 -> 56x56x64 k3x3 s1 p1 f32 nhwc tf32`: batch, input
    /// (h x w x c), output, kernel, stride, padding, type, layout, math.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = &self.geom;
        write!(
            f,
            "n{} {}x{}x{} -> {}x{}x{} k{}x{} s{} p{} {} {} {}",
            g.n,
            g.h,
            g.w,
            g.cin,
            g.oh(),
            g.ow(),
            g.cout,
            g.kh,
            g.kw,
            g.stride,
            g.pad,
            format!("{:?}", self.dtype).to_lowercase(),
            match self.layout {
                Layout::Nhwc => "nhwc",
            },
            match (self.dtype, self.tf32) {
                (DType::F32, true) => "tf32",
                (DType::F32, false) => "fma",
                _ => "tensor-op",
            }
        )
    }
}

/// The three cuDNN passes of a convolution, each with its own algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    Forward,
    BackwardData,
    BackwardFilter,
}

impl Pass {
    pub const ALL: [Pass; 3] = [Pass::Forward, Pass::BackwardData, Pass::BackwardFilter];

    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "fwd",
            Pass::BackwardData => "bwd-data",
            Pass::BackwardFilter => "bwd-filter",
        }
    }
}

/// One row of cuDNN's ranking (`cudnnConvolution*AlgoPerf_t`) as plain
/// values: the algorithm, its status (`Err` holds the status's name),
/// whether cuDNN reports it deterministic, and its workspace estimate.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate<A> {
    pub algo: A,
    pub status: Result<(), String>,
    pub deterministic: bool,
    pub memory_bytes: usize,
}

/// The algorithm a pass runs with and the workspace (bytes) cuDNN asked
/// for it; `refused_pinned` holds why the pinned one was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice<A> {
    pub algo: A,
    pub workspace_bytes: usize,
    pub refused_pinned: Option<String>,
}

/// Chooses a pass's algorithm (see the module doc): `pinned` when
/// `pinned_workspace` (cuDNN's workspace query for it) answered, else the
/// first of `ranking()` (asked only then) that succeeded, is deterministic,
/// is not `pinned`, and whose `workspace` query answers. The error says
/// why the pinned algorithm and every candidate were refused.
pub fn choose<A: Copy + PartialEq + fmt::Debug>(
    pinned: A,
    pinned_workspace: Result<usize, String>,
    ranking: impl FnOnce() -> Result<Vec<Candidate<A>>, String>,
    mut workspace: impl FnMut(A) -> Result<usize, String>,
) -> Result<Choice<A>, String> {
    let refused = match pinned_workspace {
        Ok(bytes) => {
            return Ok(Choice {
                algo: pinned,
                workspace_bytes: bytes,
                refused_pinned: None,
            });
        }
        Err(e) => format!("pinned {} refused ({e})", algo_name(pinned)),
    };
    let ranking = ranking().map_err(|e| format!("{refused}; cuDNN's ranking failed ({e})"))?;
    let mut why = Vec::new();
    for c in &ranking {
        let name = algo_name(c.algo);
        if c.algo == pinned {
            continue;
        }
        if let Err(status) = &c.status {
            why.push(format!("{name}: {status}"));
            continue;
        }
        // Never trade the bit-identical recompute for speed.
        if !c.deterministic {
            why.push(format!("{name}: not deterministic"));
            continue;
        }
        match workspace(c.algo) {
            Ok(bytes) => {
                return Ok(Choice {
                    algo: c.algo,
                    workspace_bytes: bytes,
                    refused_pinned: Some(refused),
                });
            }
            Err(e) => why.push(format!("{name}: workspace query {e}")),
        }
    }
    if why.is_empty() {
        why.push("none offered".into());
    }
    Err(format!(
        "{refused}; no deterministic algorithm cuDNN ranks answers ({})",
        why.join(", ")
    ))
}

/// A cuDNN algorithm's short name: `IMPLICIT_PRECOMP_GEMM` for
/// `CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM`, `ALGO_1` for
/// `CUDNN_CONVOLUTION_BWD_DATA_ALGO_1` (the text after the pass prefix).
pub fn algo_name<A: fmt::Debug>(algo: A) -> String {
    let full = format!("{algo:?}");
    for prefix in [
        "CUDNN_CONVOLUTION_FWD_ALGO_",
        "CUDNN_CONVOLUTION_BWD_DATA_",
        "CUDNN_CONVOLUTION_BWD_FILTER_",
    ] {
        if let Some(rest) = full.strip_prefix(prefix) {
            return rest.to_string();
        }
    }
    full
}

/// One pass of a cached geometry as the check prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassLine {
    pub pass: Pass,
    pub algo: String,
    pub workspace_bytes: usize,
    pub fallback: bool,
}

/// One line per geometry for the GPU check's summary:
/// `cudnn conv KEY: fwd IMPLICIT_PRECOMP_GEMM 0 B; bwd-data ALGO_0
/// (fallback) 4096 B; ...` (a pass not used yet is left out).
pub fn format_line(key: &ConvKey, passes: &[PassLine]) -> String {
    let parts: Vec<String> = passes
        .iter()
        .map(|p| {
            format!(
                "{} {}{} {} B",
                p.pass.name(),
                p.algo,
                if p.fallback { " (fallback)" } else { "" },
                p.workspace_bytes
            )
        })
        .collect();
    format!("cudnn conv {key}: {}", parts.join("; "))
}
