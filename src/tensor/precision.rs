//! The compute and storage type of activations under mixed precision. What
//! each precision means for the arithmetic is in `crate::nn::precision`;
//! how a device rounds and converts is in its backend.

use std::str::FromStr;

use crate::device::Capabilities;
use crate::error::{Error, Result};
use crate::tensor::DType;

/// The compute and storage type of activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum Precision {
    #[default]
    F32,
    BF16,
    F16,
}

impl Precision {
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::BF16, Precision::F16];

    /// Whether a GEMM on a device with `caps` rounds its operands to this
    /// type itself (the native bf16 kernel packs with round-to-nearest-even,
    /// as rounding first would), so callers need not pass pre-rounded copies.
    pub fn gemm_rounds_operands(self, caps: Capabilities) -> bool {
        self == Precision::BF16 && caps.native_bf16
    }

    /// Whether kernels on a device with `caps` read and write this type's
    /// activations in bf16 in place (`Capabilities::reads_bf16`), so the
    /// layers store bf16 rather than f32 copies.
    pub fn bf16_in_place(self, caps: Capabilities) -> bool {
        self == Precision::BF16 && caps.reads_bf16
    }

    /// Storage type of saved activations.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::BF16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "fp32",
            Precision::BF16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    pub fn is_low(self) -> bool {
        self != Precision::F32
    }

    /// Bytes per stored activation element.
    pub fn bytes(self) -> usize {
        self.dtype().storage_bytes(1)
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fp32" | "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::BF16),
            "f16" | "fp16" => Ok(Precision::F16),
            _ => Err(Error::invalid(
                "precision",
                format!("unknown precision '{s}' (choose fp32, bf16 or f16)"),
            )),
        }
    }
}
