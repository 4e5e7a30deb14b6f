//! The batch norm running statistics (and `num_batches_tracked`) from
//! before a training step, to put back when the step is dropped: a forward
//! moves them before anyone knows whether the step's loss and gradients
//! are finite.
//!
//! On the CPU the copy goes to host vectors kept across steps (nothing
//! from the pool). On a GPU it is one pool tensor filled device to device
//! at the step's start and given back once the step is kept, so nothing is
//! read back to the host; a meta device standing for a GPU holds the same
//! bytes, so a plan counts them (`plan::simulate` runs this too).

use crate::backend;
use crate::device::Target;
use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::{ResNet, StateSlot};
use crate::tensor::Tensor;

/// A step's roll-back copy of the BN buffers.
#[derive(Default)]
pub struct BnRollback {
    /// Host copy of the statistics, in visit order (CPU targets).
    stats: Vec<f32>,
    counts: Vec<i64>,
    /// Device copy of the statistics, in visit order (GPU targets).
    device: Option<Tensor>,
}

impl BnRollback {
    /// Copies every running statistic and counter of `model`, replacing
    /// what an earlier step saved.
    pub fn save(&mut self, pool: &Pool, model: &mut ResNet) -> Result<()> {
        self.stats.clear();
        self.counts.clear();
        self.device = None;
        let on_host = pool.device().target() == Target::Cpu;
        if !on_host {
            let len = buffer_len(model);
            self.device = Some(pool.empty_f32(
                &[len],
                Category::Workspace,
                Tag::fixed("bn roll-back copy"),
            )?);
        }
        let (mut at, mut res) = (0, Ok(()));
        model.visit_state(|slot| match slot {
            StateSlot::Buffer { tensor, .. } => {
                let len = tensor.numel();
                let copied = match self.device.as_mut() {
                    Some(copy) => backend::copy_range(copy, at, tensor, 0, len),
                    None => {
                        self.stats.resize(at + len, 0.0);
                        backend::copy_to_host_into(&mut self.stats[at..], tensor)
                    }
                };
                if res.is_ok() {
                    res = copied;
                }
                at += len;
            }
            StateSlot::Count { value, .. } => self.counts.push(*value),
            StateSlot::Param { .. } => {}
        });
        res
    }

    /// Puts back what [`BnRollback::save`] copied: a dropped step leaves no
    /// trace.
    pub fn restore(&self, model: &mut ResNet) -> Result<()> {
        let (mut at, mut count) = (0, self.counts.iter());
        let mut res = Ok(());
        model.visit_state(|slot| match slot {
            StateSlot::Buffer { tensor, .. } => {
                let len = tensor.numel();
                let put = match self.device.as_ref() {
                    Some(copy) => backend::copy_range(tensor, 0, copy, at, len),
                    None => backend::copy_from_host(tensor, &self.stats[at..at + len]),
                };
                if res.is_ok() {
                    res = put;
                }
                at += len;
            }
            StateSlot::Count { value, .. } => {
                if let Some(c) = count.next() {
                    *value = *c;
                }
            }
            StateSlot::Param { .. } => {}
        });
        res
    }

    /// Gives a device copy back to the pool once the step is kept (the
    /// host vectors stay, so steady-state CPU steps allocate nothing).
    pub fn release(&mut self) {
        self.device = None;
    }
}

/// Running-statistic values of `model`, over all its BN layers.
fn buffer_len(model: &mut ResNet) -> usize {
    let mut len = 0;
    model.visit_state(|slot| {
        if let StateSlot::Buffer { tensor, .. } = slot {
            len += tensor.numel();
        }
    });
    len
}
