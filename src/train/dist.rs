//! Data-parallel training (see [`crate::dist`]): what the training step
//! and the loop do when several processes train one model.
//!
//! - Rank 0's weights and BN running statistics are broadcast before the
//!   first step ([`broadcast_state`]), so every rank starts equal.
//! - Every rank loads the same global window (the same seeded permutation)
//!   and trains on its shard ([`crate::dist::shard`]); each micro-batch's
//!   loss is divided by the window's global sample count, so the sum over
//!   ranks is the gradient of one big batch.
//! - After the last micro-batch of the window (never on the others) the
//!   gradients are summed across ranks ([`GradSync::sum_grads`]): flattened
//!   in visit order and summed in fixed buckets of
//!   [`crate::dist::BUCKET_BYTES`], so the result does not depend on
//!   timing and every rank holds the same bits.
//! - BN: each rank normalises with its own shard's batch statistics (as
//!   PyTorch DDP); after the sum, rank 0's running statistics replace every
//!   rank's (DDP's `broadcast_buffers`), so evaluation and checkpoints agree.
//! - The window's loss and top-1 hits are summed too, so the NaN policy
//!   and the loss scaler see the same loss, gradients and BN statistics on
//!   every rank and decide the same way without another message.

use std::rc::Rc;

use crate::backend;
use crate::dist::{BUCKET_BYTES, Collective};
use crate::error::Result;
use crate::nn::{ResNet, StateSlot};

/// The gradient all-reduce of a step and its host buffers (kept across
/// steps, so steady-state steps allocate nothing here).
pub struct GradSync {
    pub comm: Rc<dyn Collective>,
    flat: Vec<f32>,
    summed: Vec<f32>,
    /// Seconds the last step spent summing gradients (copies included).
    pub last_sync_secs: f64,
}

impl GradSync {
    pub fn new(comm: Rc<dyn Collective>) -> Self {
        GradSync {
            comm,
            flat: Vec::new(),
            summed: Vec::new(),
            last_sync_secs: 0.0,
        }
    }

    /// Replaces every trainable gradient by its sum over the ranks.
    pub fn sum_grads(&mut self, model: &mut ResNet) -> Result<()> {
        let t0 = std::time::Instant::now();
        self.flat.clear();
        let mut res = Ok(());
        model.visit_params(|p| {
            if !p.frozen && res.is_ok() {
                let at = self.flat.len();
                self.flat.resize(at + p.grad.numel(), 0.0);
                res = backend::copy_to_host_into(&mut self.flat[at..], &p.grad);
            }
        });
        res?;
        self.summed.resize(self.flat.len(), 0.0);
        let bucket = BUCKET_BYTES / std::mem::size_of::<f32>();
        for (send, recv) in self.flat.chunks(bucket).zip(self.summed.chunks_mut(bucket)) {
            self.comm.sum_f32(send, recv)?;
        }
        let mut at = 0;
        let mut res = Ok(());
        let summed = &self.summed;
        model.visit_params(|p| {
            if !p.frozen && res.is_ok() {
                let len = p.grad.numel();
                res = backend::copy_from_host(&mut p.grad, &summed[at..at + len]);
                at += len;
            }
        });
        res?;
        self.last_sync_secs = t0.elapsed().as_secs_f64();
        Ok(())
    }
}

/// Replaces this rank's BN running statistics by rank 0's.
pub fn broadcast_buffers(comm: &dyn Collective, model: &mut ResNet) -> Result<()> {
    broadcast(comm, model, false)
}

/// Replaces this rank's weights, BN running statistics and counters by
/// rank 0's: every rank starts from the same model.
pub fn broadcast_state(comm: &dyn Collective, model: &mut ResNet) -> Result<()> {
    broadcast(comm, model, true)
}

fn broadcast(comm: &dyn Collective, model: &mut ResNet, params: bool) -> Result<()> {
    if comm.size() <= 1 {
        return Ok(());
    }
    let mut res = Ok(());
    let bcast = |t: &mut crate::tensor::Tensor| -> Result<()> {
        let mut v = backend::copy_to_host(t)?;
        comm.broadcast_f32(&mut v)?;
        backend::copy_from_host(t, &v)
    };
    model.visit_state(|slot| {
        if res.is_err() {
            return;
        }
        match slot {
            StateSlot::Param { param, .. } if params => res = bcast(&mut param.value),
            StateSlot::Buffer { tensor, .. } => res = bcast(tensor),
            StateSlot::Count { value, .. } if params => {
                // Counters are exact in f32 far beyond any run's steps.
                let mut v = [*value as f32];
                res = comm.broadcast_f32(&mut v);
                *value = v[0] as i64;
            }
            _ => {}
        }
    });
    res
}

/// Whether `flag` is set on any rank (every rank gets the same answer: a
/// stop signal that reached one rank stops all of them at the same step).
pub fn any_rank(comm: &dyn Collective, flag: bool) -> Result<bool> {
    if comm.size() <= 1 {
        return Ok(flag);
    }
    let mut sum = [0.0];
    comm.sum_f64(&[flag as u8 as f64], &mut sum)?;
    Ok(sum[0] > 0.0)
}

/// [`super::fit`] as one rank of a data-parallel run over `comm` (from
/// [`crate::dist::world`]): every rank calls it with the same options and
/// data. Rank 0's initial weights are broadcast; each rank trains on its
/// shard of every global window ([`crate::dist::shard`]: earlier ranks
/// take the extra samples of an uneven window); the reports (loss, top-1)
/// are of the whole window on every rank. Only rank 0 draws progress,
/// calls `on_epoch`, and writes metrics, memory traces and training state.
#[allow(clippy::too_many_arguments)]
pub fn fit_distributed(
    model: &mut ResNet,
    pool: &crate::memory::Pool,
    optimizer: &mut super::Optimizer,
    train: &dyn crate::data::Dataset,
    val: &dyn crate::data::Dataset,
    opts: &super::TrainOptions,
    comm: Rc<dyn Collective>,
    on_epoch: impl FnMut(&super::EpochReport),
) -> Result<Vec<super::EpochReport>> {
    // Loader threads borrow the datasets: one scope spans the run.
    std::thread::scope(|scope| {
        super::fit_in(
            scope, model, pool, optimizer, train, val, opts, comm, on_epoch,
        )
    })
}
