//! Gradient-norm clipping with `torch.nn.utils.clip_grad_norm_` semantics
//! (L2 norm, `error_if_nonfinite=False`).

use crate::backend::{self, StepTotals};
use crate::error::Result;
use crate::nn::ResNet;

/// Total L2 norm of all gradients: squares summed in f64 (per tensor, then
/// over tensors in visit order), then the square root is rounded to f32.
pub fn grad_norm(model: &mut ResNet) -> Result<f32> {
    let mut sum = 0.0f64;
    let mut err = None;
    model.visit_params(|p| match backend::sum_squares(&p.grad) {
        Ok(s) => sum += s,
        Err(e) => err = err.take().or(Some(e)),
    });
    err.map_or(Ok(norm_of(sum)), Err)
}

/// [`grad_norm`]'s sum of squares added into a step's totals, in the same
/// order (tensor by tensor, in visit order), so the norm comes back with
/// the step's one read instead of a read per tensor.
pub fn grad_sum_squares_into(model: &mut ResNet, totals: &mut StepTotals) -> Result<()> {
    let mut err = None;
    model.visit_params(|p| {
        if err.is_none()
            && let Err(e) = backend::sum_squares_add(totals, &p.grad)
        {
            err = Some(e);
        }
    });
    err.map_or(Ok(()), Err)
}

/// The total norm from the summed squares: the f64 square root rounded to
/// f32.
pub fn norm_of(sum_squares: f64) -> f32 {
    sum_squares.sqrt() as f32
}

/// The factor the gradients are multiplied by: `min(max_norm/(total+1e-6), 1)`
/// computed in f32 like PyTorch's tensor arithmetic (NaN stays NaN).
fn clip_coef(max_norm: f32, total_norm: f32) -> f32 {
    let coef = max_norm / (total_norm + 1e-6);
    if coef > 1.0 { 1.0 } else { coef }
}

fn sum_sq(g: &[f32]) -> f64 {
    g.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

/// `clip_grad_norm_(model.parameters(), max_norm)`: computes the total L2
/// norm of every parameter gradient, scales all gradients by
/// `min(max_norm / (total_norm + 1e-6), 1)` and returns the total norm
/// BEFORE clipping. Call it after the last micro-batch's backward and
/// before the optimizer step.
pub fn clip_grad_norm(model: &mut ResNet, max_norm: f32) -> Result<f32> {
    let total = grad_norm(model)?;
    clip_to(model, max_norm, total)?;
    Ok(total)
}

/// The scaling half of [`clip_grad_norm`], given the total norm (from
/// [`grad_norm`], or [`norm_of`] a step's totals): queued on the device,
/// nothing read.
pub fn clip_to(model: &mut ResNet, max_norm: f32, total_norm: f32) -> Result<()> {
    let c = clip_coef(max_norm, total_norm);
    if c == 1.0 {
        return Ok(());
    }
    let mut err = None;
    model.visit_params(|p| {
        if let Err(e) = backend::scale(&mut p.grad, c) {
            err = err.take().or(Some(e));
        }
    });
    err.map_or(Ok(()), Err)
}

/// [`clip_grad_norm`] over raw gradient slices.
pub fn clip_grad_norm_slices(grads: &mut [&mut [f32]], max_norm: f32) -> f32 {
    let total = grads.iter().map(|g| sum_sq(g)).sum::<f64>().sqrt() as f32;
    let c = clip_coef(max_norm, total);
    if c != 1.0 {
        for g in grads.iter_mut() {
            g.iter_mut().for_each(|x| *x *= c);
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clips_only_above_max_norm() {
        let (mut a, mut b) = (vec![3.0f32], vec![4.0f32]);
        let n = clip_grad_norm_slices(&mut [&mut a, &mut b], 1.0);
        assert_eq!(n, 5.0);
        assert!((a[0] - 0.6).abs() < 1e-6 && (b[0] - 0.8).abs() < 1e-6);
        let n = clip_grad_norm_slices(&mut [&mut a, &mut b], 10.0);
        assert!((n - 1.0).abs() < 1e-6);
        assert!((a[0] - 0.6).abs() < 1e-6, "unchanged below max_norm");
    }
}
