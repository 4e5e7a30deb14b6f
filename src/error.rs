//! The one error type of the library. Variants carry the context a user needs
//! to act on the message (which op, which file, which shapes).

use crate::accounting::BudgetReport;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // === Shape errors ===
    #[error("{op}: shape mismatch, expected {expected}, got {got}")]
    ShapeMismatch {
        op: &'static str,
        expected: String,
        got: String,
    },
    #[error("{op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },
    /// Options a command cannot run with (a value out of range, two that
    /// contradict each other). The message is whole and names the flags.
    #[error("{0}")]
    Usage(String),

    // === Memory ===
    #[error("{0}")]
    OutOfBudget(Box<BudgetReport>),
    #[error(
        "memory budget {} is too small: the smallest plan needs {} (micro-batch {micro_batch}, every stage recomputed as far as possible), of which {} are parameters, gradients and optimizer state",
        crate::accounting::fmt_bytes(*budget),
        crate::accounting::fmt_bytes(*needed),
        crate::accounting::fmt_bytes(*persistent)
    )]
    BudgetTooSmall {
        budget: usize,
        needed: usize,
        micro_batch: usize,
        persistent: usize,
    },
    /// Plans whose live bytes fit, but whose blocks fragment device memory
    /// past the budget (no free block for a large buffer).
    #[error(
        "memory budget {} holds the least-memory plan's {} live bytes at micro-batch {micro_batch}, but not its fragmentation: a large buffer would find no free block and the pool would go past the budget (try a smaller --micro-batch or a larger budget)",
        crate::accounting::fmt_bytes(*budget),
        crate::accounting::fmt_bytes(*live)
    )]
    Fragmented {
        budget: usize,
        live: usize,
        micro_batch: usize,
    },
    /// The system refused host memory (an `mmap` of a pool segment).
    #[error(
        "the system refused {} of host memory for the pool",
        crate::accounting::fmt_bytes(*bytes)
    )]
    HostMemory { bytes: usize },

    // === Input files ===
    #[error("{path}: {reason}")]
    BadWeights { path: String, reason: String },
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{path}: {reason}")]
    BadData { path: String, reason: String },

    #[error(
        "{what}: all {skipped} images were unreadable (see the warnings above); nothing to {verb}"
    )]
    NoReadableImages {
        /// "epoch 3" or "validation".
        what: String,
        skipped: usize,
        verb: &'static str,
    },

    /// Writing a command's report failed (e.g. its reader went away).
    #[error("writing the output: {0}")]
    Output(std::io::Error),

    // === Devices ===
    /// A CUDA library, driver or device is missing (or the build has no
    /// CUDA). `what` names it; `hint` says how to get it.
    #[error("{what}: {hint}")]
    CudaUnavailable { what: String, hint: String },
    /// A CUDA call failed on a device that the probe accepted (out of
    /// device memory, a launch error, a cuDNN or cuBLAS status).
    #[error("CUDA: {op} failed: {reason}")]
    Cuda { op: &'static str, reason: String },
    /// cuDNN refused the pinned algorithm of a convolution pass and offered
    /// no deterministic one whose workspace it would size: the geometry
    /// (shape, stride, padding, type, layout, math) and why each failed.
    #[error("cuDNN has no usable algorithm for convolution {geometry} ({pass}): {reason}")]
    ConvAlgorithm {
        geometry: String,
        pass: &'static str,
        reason: String,
    },
    /// NVRTC rejected a kernel source; `log` is its compiler log.
    #[error("NVRTC could not compile kernel source {kernel} for {arch}:\n{log}")]
    KernelCompile {
        kernel: String,
        arch: String,
        log: String,
    },

    // === Interruption ===
    #[error("interrupted after optimizer step {step}; {}", match saved_state {
        Some(p) => format!("resume with --resume {p}"),
        None => "no --save-dir was given, so nothing was saved".to_string(),
    })]
    Interrupted {
        step: usize,
        /// The training state file saved on the way out.
        saved_state: Option<String>,
    },

    /// A training state file (a "checkpoint" in messages and flags) could
    /// not be written. Training stops: going on would
    /// leave the run unprotected without anyone noticing.
    #[error(
        "{path}: cannot save the checkpoint: {reason}; training stopped. {}",
        last_good_sentence(last_good)
    )]
    StateWrite {
        path: String,
        reason: String,
        /// The newest checkpoint still on disk (untouched by the failure).
        last_good: Option<String>,
    },

    // === Numerics ===
    #[error(
        "non-finite {what} at optimizer step {step} (loss {loss}); the step was not applied. {}",
        last_good_sentence(last_good)
    )]
    NonFiniteLoss {
        step: usize,
        loss: f32,
        /// What was non-finite first: the loss, a gradient or a batch norm
        /// running statistic.
        what: &'static str,
        /// The newest checkpoint in the save directory, if any.
        last_good: Option<String>,
    },
}

/// The end of a message about a run that stopped: where it can go on from.
fn last_good_sentence(last_good: &Option<String>) -> String {
    match last_good {
        Some(p) => format!("The last good checkpoint is {p} (resume with --resume {p})"),
        None => "No checkpoint was saved before this point".to_string(),
    }
}

#[cfg(any(feature = "cuda", feature = "cuda-12"))]
impl From<crate::device::cuda::Missing> for Error {
    fn from(m: crate::device::cuda::Missing) -> Self {
        Error::CudaUnavailable {
            what: m.what,
            hint: m.hint,
        }
    }
}

impl From<crate::device::SelectError> for Error {
    fn from(e: crate::device::SelectError) -> Self {
        match e {
            crate::device::SelectError::Usage(m) => Error::Usage(m),
            crate::device::SelectError::Unavailable { what, hint } => {
                Error::CudaUnavailable { what, hint }
            }
        }
    }
}

#[cfg(any(feature = "cuda", feature = "cuda-12"))]
impl From<crate::device::cuda::CallError> for Error {
    fn from(e: crate::device::cuda::CallError) -> Self {
        Error::Cuda {
            op: e.op,
            reason: e.reason,
        }
    }
}

#[cfg(any(feature = "cuda", feature = "cuda-12"))]
impl From<crate::device::cuda::StartError> for Error {
    fn from(e: crate::device::cuda::StartError) -> Self {
        match e {
            crate::device::cuda::StartError::Missing(m) => m.into(),
            crate::device::cuda::StartError::Call(c) => c.into(),
        }
    }
}

impl Error {
    pub fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            reason: reason.into(),
        }
    }
}
