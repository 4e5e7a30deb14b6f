//! The network as a chain of stages (stem, residual blocks, head), each with
//! an explicit forward that returns what its backward needs (`*Saved`), a
//! backward that consumes it, and an exact closed-form `saved_bytes`.

mod block;
mod head;
mod layers;
pub mod precision;
pub mod reference;
mod resnet;
mod stem;

pub use block::{BasicBlock, BasicSaved, Bottleneck, BottleneckSaved};
pub use head::{Head, HeadSaved};
pub use layers::{BatchNorm, BnStats, Conv, Linear};
pub use precision::Precision;
pub use resnet::{
    BlockKind, LayerMut, ResNet, ResNetConfig, Saved, Stage, StateSlot, WeightLayout,
};
pub use stem::{Stem, StemKind, StemSaved};

use rand::{RngExt, rngs::ChaCha8Rng};

use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::tensor::Tensor;

/// How a forward pass treats batch norm and what it keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Batch statistics (unless BN is frozen), running stats advance, and
    /// the stage returns what its backward needs.
    Train,
    /// The forward replayed in backward by a checkpoint plan: the same batch
    /// statistics and outputs as `Train` (bit for bit), but the running
    /// statistics and `num_batches_tracked` stay as they are, so they
    /// advance once per micro-batch however often a stage is recomputed.
    Recompute,
    /// Running statistics, nothing saved.
    Eval,
}

impl Mode {
    /// Whether the stage returns what its backward needs.
    pub fn saves(self) -> bool {
        self != Mode::Eval
    }
}

/// What every layer of a step needs to know besides its own weights: the
/// pool its tensors come from, the precision of activations and how batch
/// norm behaves. Built once per step from the model ([`ResNet::ctx`]) and
/// passed down, instead of a copy of the precision and BN policy in every
/// stage and layer. Dereferences to the pool, so `ctx.empty_f32(…)` and
/// helpers taking `&Pool` accept it as is.
#[derive(Clone, Copy)]
pub struct Ctx<'a> {
    pub pool: &'a Pool,
    /// Compute and storage type of activations.
    pub precision: Precision,
    /// How batch norm layers behave in training.
    pub bn: BnPolicy,
}

impl<'a> Ctx<'a> {
    /// fp32 with batch statistics: PyTorch's defaults.
    pub fn new(pool: &'a Pool) -> Self {
        Ctx {
            pool,
            precision: Precision::F32,
            bn: BnPolicy::Batch,
        }
    }
}

impl std::ops::Deref for Ctx<'_> {
    type Target = Pool;
    fn deref(&self) -> &Pool {
        self.pool
    }
}

/// How batch norm layers behave in training.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BnPolicy {
    /// PyTorch's `model.train()`: batch statistics, running stats updated.
    #[default]
    Batch,
    /// Running statistics and no affine gradients (fine-tuning with tiny
    /// micro-batches).
    Frozen,
}

/// A trainable tensor and its gradient (which accumulates until zeroed).
pub struct Param {
    pub name: String,
    pub value: Tensor,
    pub grad: Tensor,
    /// Excluded from optimizer updates (PyTorch's `requires_grad=False`),
    /// e.g. BN affine parameters under `BnPolicy::Frozen`.
    pub frozen: bool,
}

impl Param {
    pub fn new(pool: &Pool, name: &str, dims: &[usize], values: &[f32]) -> Result<Self> {
        let prefix: std::sync::Arc<str> = name.into();
        Ok(Param {
            name: name.to_string(),
            value: pool.from_f32(dims, values, Category::Params, Tag::new(&prefix, ""))?,
            grad: pool.zeros_f32(dims, Category::Grads, Tag::new(&prefix, "grad"))?,
            frozen: false,
        })
    }
}

/// Standard normal samples (Box-Muller), deterministic for a seeded rng.
pub(crate) fn normal(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
            let u2: f64 = rng.random::<f64>();
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32 * std
        })
        .collect()
}

/// Uniform samples in [-bound, bound).
pub(crate) fn uniform(rng: &mut ChaCha8Rng, n: usize, bound: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * bound)
        .collect()
}
