//! CPU backend: GEMM through the `gemm` crate, threads through rayon.

mod gemm;

pub use self::gemm::{Accumulate, MatRef, gemm_f32};
