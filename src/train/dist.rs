//! Data-parallel training (see [`crate::dist`]): what the training step
//! and the loop do when several processes train one model.
//!
//! - Rank 0's weights and BN running statistics are broadcast before the
//!   first step ([`broadcast_state`]), so every rank starts equal.
//! - Every rank draws the same seeded permutation and loads only its shard
//!   of each window ([`crate::dist::shard`], [`crate::data::Part`]); the
//!   window's readable sample count is summed ([`window_counts`]) and each
//!   micro-batch's loss is divided by it, so the sum over ranks is the
//!   gradient of one big batch.
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
use crate::dist::Collective;
use crate::error::Result;
use crate::memory::Pool;
use crate::nn::{ResNet, StateSlot};
use crate::optim::GradBuckets;
use crate::tensor::Tensor;

/// The gradient all-reduce of a step and its two bucket buffers (pool
/// tensors, category workspace, allocated at the first sum and kept, so a
/// plan counts them and steady-state steps allocate nothing here).
pub struct GradSync {
    pub comm: Rc<dyn Collective>,
    buckets: Option<GradBuckets>,
    /// Seconds the last step spent summing gradients (copies included).
    pub last_sync_secs: f64,
}

impl GradSync {
    pub fn new(comm: Rc<dyn Collective>) -> Self {
        GradSync {
            comm,
            buckets: None,
            last_sync_secs: 0.0,
        }
    }

    /// Replaces every trainable gradient by its sum over the ranks: the
    /// gradients, flattened in visit order, are cut into buckets at fixed
    /// offsets; each bucket is packed, summed and unpacked in turn.
    pub fn sum_grads(&mut self, pool: &Pool, model: &mut ResNet) -> Result<()> {
        let t0 = std::time::Instant::now();
        let total = model.trainable_count();
        if self.buckets.is_none() {
            self.buckets = Some(GradBuckets::new(pool, total)?);
        }
        let Some(GradBuckets { send, recv }) = self.buckets.as_mut() else {
            unreachable!("allocated above");
        };
        let bucket = send.numel();
        let mut first = 0;
        while first < total {
            let last = (first + bucket).min(total);
            // The part of each gradient that falls in [first, last).
            let mut each = |f: &mut dyn FnMut(&mut Tensor, usize, usize, usize) -> Result<()>| {
                let (mut at, mut res) = (0, Ok(()));
                model.visit_params(|p| {
                    if p.frozen || res.is_err() {
                        return;
                    }
                    let (start, end) = (at.max(first), (at + p.grad.numel()).min(last));
                    if start < end {
                        res = f(&mut p.grad, start - at, start - first, end - start);
                    }
                    at += p.grad.numel();
                });
                res
            };
            each(&mut |g, g_at, b_at, len| backend::copy_range(send, b_at, g, g_at, len))?;
            backend::all_reduce_sum(self.comm.as_ref(), recv, send, last - first)?;
            each(&mut |g, g_at, b_at, len| backend::copy_range(g, g_at, recv, b_at, len))?;
            first = last;
        }
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

/// The readable and skipped samples of a whole window, from this rank's
/// counts of its shard (one small sum; none in a world of one).
pub fn window_counts(
    comm: &dyn Collective,
    readable: usize,
    skipped: usize,
) -> Result<(usize, usize)> {
    if comm.size() <= 1 {
        return Ok((readable, skipped));
    }
    let mut sums = [0.0; 2];
    comm.sum_f64(&[readable as f64, skipped as f64], &mut sums)?;
    Ok((sums[0] as usize, sums[1] as usize))
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
