//! memfit: train ResNet-family image classifiers inside a memory budget.
//!
//! The layers, bottom up (see `shared/DESIGN.md`): [`memory`] (the tracked
//! pool every tensor buffer comes from), [`tensor`], [`device`] (CPU GEMM),
//! [`ops`] (kernels with explicit forward/backward and f64 references),
//! [`nn`] (stages of the ResNet chain), [`exec`] (runs the chain under a
//! plan), [`optim`]. Beside them: [`setup`] (the model a command builds
//! from its flags, and the checks before a run), [`bench`] (the
//! benchmarks behind `memfit bench`), [`run`] (the `train`, `plan` and
//! `eval` commands as calls) and [`data::registry`] (datasets by
//! name).

pub mod accounting;
pub mod backend;
pub mod baseline;
pub mod bench;
pub mod data;
pub mod device;
pub mod dist;
pub mod error;
pub mod exec;
pub mod io;
pub mod memory;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod plan;
pub mod profile;
pub mod run;
pub mod setup;
pub mod tensor;
pub mod train;

pub use error::{Error, Result};
