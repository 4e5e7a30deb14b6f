//! The buffers data-parallel training sums gradients through
//! (`train::dist::GradSync`): one bucket to send and one to receive, from
//! the memory pool, so the planner counts them exactly as the step
//! allocates them ([`GradBuckets::new`] is called by both).

use crate::dist::bucket_elements;
use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::tensor::Tensor;

/// The send and receive buffers of one all-reduce bucket (f32, category
/// workspace, kept for the whole run).
pub struct GradBuckets {
    pub send: Tensor,
    pub recv: Tensor,
}

impl GradBuckets {
    /// Both buffers for a model of `grad_elements` trainable gradient
    /// elements ([`bucket_elements`] each).
    pub fn new(pool: &Pool, grad_elements: usize) -> Result<Self> {
        let len = bucket_elements(grad_elements).max(1);
        Ok(GradBuckets {
            send: pool.empty_f32(&[len], Category::Workspace, Tag::fixed("dist.bucket.send"))?,
            recv: pool.empty_f32(&[len], Category::Workspace, Tag::fixed("dist.bucket.recv"))?,
        })
    }

    /// Bytes both buffers take for `grad_elements` gradient elements.
    pub fn bytes(grad_elements: usize) -> usize {
        2 * bucket_elements(grad_elements).max(1) * std::mem::size_of::<f32>()
    }
}
