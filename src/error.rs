//! The one error type of the library. Variants carry the context a user needs
//! to act on the message (which op, which file, which shapes).

use crate::memory::BudgetReport;

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

    // === Memory ===
    #[error("{0}")]
    OutOfBudget(Box<BudgetReport>),
    #[error(
        "memory budget {} is too small: the smallest plan needs {} (micro-batch {micro_batch}, every stage recomputed as far as possible), of which {} are parameters, gradients and optimizer state",
        crate::memory::fmt_bytes(*budget),
        crate::memory::fmt_bytes(*needed),
        crate::memory::fmt_bytes(*persistent)
    )]
    BudgetTooSmall {
        budget: usize,
        needed: usize,
        micro_batch: usize,
        persistent: usize,
    },

    // === Input files ===
    #[error("{path}: {reason}")]
    BadWeights { path: String, reason: String },
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{path}: {reason}")]
    BadData { path: String, reason: String },

    // === Interruption ===
    #[error("interrupted after optimizer step {step}; {}", match checkpoint {
        Some(p) => format!("resume with --resume {p}"),
        None => "no --save-dir was given, so nothing was saved".to_string(),
    })]
    Interrupted {
        step: usize,
        checkpoint: Option<String>,
    },

    // === Numerics ===
    #[error("non-finite loss {loss} at step {step}")]
    NonFiniteLoss { step: usize, loss: f32 },
}

impl Error {
    pub fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            reason: reason.into(),
        }
    }
}
