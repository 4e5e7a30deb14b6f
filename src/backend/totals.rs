//! What an optimizer step returns to the host — the window's loss and
//! top-1 count, whether a gradient (or BN statistic) is inf or NaN, and the
//! clipping norm's sum of squares — accumulated where the step runs and
//! read once, after the last backward is queued.
//!
//! Why: on a GPU every value read back waits for the work queued before it.
//! A read per gradient tensor (a finite check, an unscale, a norm) is a
//! few hundred stalls per ResNet-50 step, and a loss read between the
//! forward and the backward leaves the GPU idle while the host queues the
//! backward. On CUDA the totals are 24 bytes of pool memory the kernels add
//! into ([`scratch::STEP_TOTALS`]); on the CPU they are host numbers
//! computed by the same kernels as before, so every CPU result is
//! unchanged bit for bit; on a meta device standing for CUDA the bytes are
//! held so a plan counts them, and reads return zeros.

use super::{cpu, note_host_read, scratch};
use crate::device::{Device, Target};
use crate::error::Result;
use crate::memory::Pool;
use crate::tensor::{Precision, Tensor};

/// The host's view of a step's totals.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Totals {
    /// The losses added with [`cross_entropy_add`] (each its share).
    pub loss: f64,
    /// Samples whose top-1 prediction was right.
    pub correct: usize,
    /// Some value checked or unscaled into these totals was inf or NaN.
    pub non_finite: bool,
    /// Σ x² over the tensors added with [`sum_squares_add`], tensor by
    /// tensor in call order (each tensor's sum in the device's order).
    pub sum_squares: f64,
}

/// A step's totals: held for the step, read once ([`StepTotals::read`]).
pub struct StepTotals {
    host: Totals,
    /// The device's bytes (CUDA, or held for the count on a meta device
    /// standing for CUDA); `None` where the host keeps the totals.
    device: Option<Tensor>,
}

impl StepTotals {
    /// Zeroed totals for work on `pool`'s device (a step's: held across
    /// its micro-batches).
    pub fn new(pool: &Pool) -> Result<Self> {
        Self::zeroed(pool.device(), || {
            pool.zeros_f32(
                &[scratch::STEP_TOTALS / 4],
                crate::memory::Category::Workspace,
                crate::memory::Tag::fixed("step totals"),
            )
        })
    }

    /// Zeroed totals for one op on `like`'s device, from the pool of
    /// `like` (pool scratch, as the op's own).
    pub fn for_op(like: &Tensor) -> Result<Self> {
        Self::zeroed(like.device(), || {
            like.scratch(
                scratch::STEP_TOTALS,
                crate::memory::Tag::fixed("op totals"),
                true,
            )
        })
    }

    /// Host totals on the CPU; on a GPU (or a meta device standing for one)
    /// the device bytes `alloc` makes.
    fn zeroed(device: Device, alloc: impl FnOnce() -> Result<Tensor>) -> Result<Self> {
        let device = match device.target() {
            Target::Cpu => None,
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Target::Cuda(_) => Some(alloc()?),
        };
        #[cfg(not(any(feature = "cuda", feature = "cuda-12")))]
        let _ = alloc;
        Ok(StepTotals {
            host: Totals::default(),
            device,
        })
    }

    /// The totals on the host: one read on CUDA (it waits for everything
    /// queued so far), none on the CPU.
    pub fn read(&self) -> Result<Totals> {
        let Some(t) = &self.device else {
            return Ok(self.host);
        };
        note_host_read(t.device());
        match t.device() {
            #[cfg(any(feature = "cuda", feature = "cuda-12"))]
            Device::Cuda(_) => {
                // Host time here is the wait for the queued work.
                let w = crate::profile::timed(crate::profile::Family::DeviceReads, 0, || {
                    super::cuda::ops::read_totals(t)
                })?;
                let word = |at: usize| w[at / 8];
                let half = |at: usize| (word(at) >> (8 * (at % 8))) as u32;
                Ok(Totals {
                    loss: f64::from_bits(word(scratch::TOTALS_LOSS)),
                    sum_squares: f64::from_bits(word(scratch::TOTALS_SUM_SQUARES)),
                    correct: half(scratch::TOTALS_CORRECT) as usize,
                    non_finite: half(scratch::TOTALS_FLAG) != 0,
                })
            }
            // A meta device has no values: zeros, as its other reads.
            _ => Ok(self.host),
        }
    }

    /// The device bytes for a CUDA op on `t`.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    fn on_device(&self, t: &Tensor) -> Result<&Tensor> {
        self.device.as_ref().ok_or_else(|| {
            crate::error::Error::invalid(
                "step totals",
                format!(
                    "totals kept on the host for a tensor on {}",
                    t.device().name()
                ),
            )
        })
    }
}

/// [`super::cross_entropy`] whose mean loss and top-1 count are added into
/// `totals` instead of returned: `share = Some((num, den))` adds
/// `loss * num / den` (a micro-batch's part of its window's mean, in that
/// order of operations), `None` adds the loss.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_add(
    totals: &mut StepTotals,
    d_logits: &mut Tensor,
    logits: &Tensor,
    labels: &[usize],
    smoothing: f32,
    divisor: usize,
    scale: Option<f32>,
    p: Precision,
    share: Option<(usize, usize)>,
) -> Result<()> {
    match d_logits.device() {
        Device::Cpu => {
            let o = cpu::cross_entropy(d_logits, logits, labels, smoothing, divisor, scale, p)?;
            totals.host.loss += match share {
                Some((num, den)) => o.loss * num as f64 / den as f64,
                None => o.loss,
            };
            totals.host.correct += o.correct;
        }
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => crate::profile::timed(crate::profile::Family::Loss, 0, || {
            super::cuda::ops::cross_entropy_add(
                totals.on_device(d_logits)?,
                d_logits,
                logits,
                labels,
                smoothing,
                divisor,
                scale,
                p,
                share,
            )
        })?,
        Device::Meta(_) => {
            scratch::count_on_meta(d_logits, &[scratch::cross_entropy(labels.len())])?;
        }
    }
    Ok(())
}

/// The scaler's unscale, `t *= inv`, noting in `totals` whether a result
/// is inf or NaN.
pub fn unscale_add(totals: &mut StepTotals, t: &mut Tensor, inv: f32) -> Result<()> {
    match t.device() {
        Device::Cpu => totals.host.non_finite |= cpu::unscale(t, inv),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => crate::profile::timed(crate::profile::Family::Optimizer, 0, || {
            super::cuda::ops::unscale_into(totals.on_device(t)?, t, inv)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// Notes in `totals` whether a value of f32 `t` is inf or NaN.
pub fn check_finite_add(totals: &mut StepTotals, t: &Tensor) -> Result<()> {
    match t.device() {
        Device::Cpu => totals.host.non_finite |= !cpu::all_finite(t),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => crate::profile::timed(crate::profile::Family::Optimizer, 0, || {
            super::cuda::ops::check_finite_into(totals.on_device(t)?, t)
        })?,
        Device::Meta(_) => {}
    }
    Ok(())
}

/// Adds Σ x² of f32 `t` (in f64) into `totals`' sum of squares.
pub fn sum_squares_add(totals: &mut StepTotals, t: &Tensor) -> Result<()> {
    match t.device() {
        Device::Cpu => totals.host.sum_squares += cpu::sum_squares(t),
        #[cfg(any(feature = "cuda", feature = "cuda-12"))]
        Device::Cuda(_) => crate::profile::timed(crate::profile::Family::Optimizer, 0, || {
            super::cuda::ops::sum_squares_add(totals.on_device(t)?, scratch::TOTALS_SUM_SQUARES, t)
        })?,
        Device::Meta(_) => {
            scratch::count_on_meta(t, &[scratch::sum_squares_partials(t.numel())])?;
        }
    }
    Ok(())
}
