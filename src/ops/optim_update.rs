//! The optimizer update kernels, one parameter tensor per call, in the
//! exact operation order of PyTorch's single-tensor code paths. The
//! optimizers in `crate::optim` own the state and call these through the
//! backend boundary.

/// Widens a hyper-parameter the way a user typed it: `0.9f32` becomes the
/// `f64` 0.9 (what PyTorch's Python float holds), not 0.89999997615814.
/// Used for the scalars PyTorch computes in double precision.
pub fn widen(x: f32) -> f64 {
    format!("{x}").parse().unwrap_or(x as f64)
}

/// One SGD update of one parameter tensor, PyTorch's exact order:
/// `d = g + wd·w`; momentum `μ != 0`: `buf = d` when `first`, else
/// `buf = μ·buf + d` (dampening 0), then `d = d + μ·buf` (Nesterov) or
/// `d = buf`; finally `w -= lr·d`. `buf` is ignored (may be `None`) when
/// `momentum == 0`.
#[allow(clippy::too_many_arguments)]
pub fn sgd_update(
    w: &mut [f32],
    g: &[f32],
    buf: Option<&mut [f32]>,
    first: bool,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
) {
    assert_eq!(w.len(), g.len(), "sgd_update: weight/grad length");
    let (mu, wd) = (momentum, weight_decay);
    match buf {
        Some(buf) if mu != 0.0 => {
            assert_eq!(buf.len(), w.len(), "sgd_update: buffer length");
            for ((w, &g), b) in w.iter_mut().zip(g).zip(buf.iter_mut()) {
                let d = g + wd * *w;
                *b = if first { d } else { mu * *b + d };
                let step = if nesterov { d + mu * *b } else { *b };
                *w -= lr * step;
            }
        }
        _ => {
            assert!(mu == 0.0, "sgd_update: momentum needs a buffer");
            for (w, &g) in w.iter_mut().zip(g) {
                *w -= lr * (g + wd * *w);
            }
        }
    }
}

/// The per-step scalars of [`adamw_update`], made on the host in f64 from
/// the widened hyper-parameters as PyTorch's Python floats; every device's
/// update takes these (the CUDA kernel too), so they cannot drift apart.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    /// `1 - lr·wd`, applied to the weight first when `apply_decay`.
    pub decay: f32,
    /// The lerp weight of the first moment, `1 - β1`.
    pub w1: f32,
    /// `1 - β2`.
    pub w2: f32,
    pub beta2: f32,
    /// `-lr / (1 - β1^t)`.
    pub neg_step: f32,
    /// `sqrt(1 - β2^t)`.
    pub bc2_sqrt: f32,
    pub apply_decay: bool,
}

/// [`AdamWScalars`] for step `t` (1-based).
pub fn adamw_scalars(t: u64, lr: f32, beta1: f32, beta2: f32, weight_decay: f32) -> AdamWScalars {
    let (lr64, b1, b2) = (widen(lr), widen(beta1), widen(beta2));
    let ti = i32::try_from(t).unwrap_or(i32::MAX);
    let bc1 = 1.0 - b1.powi(ti);
    let bc2 = 1.0 - b2.powi(ti);
    AdamWScalars {
        decay: (1.0 - lr64 * widen(weight_decay)) as f32,
        w1: (1.0 - b1) as f32,
        w2: (1.0 - b2) as f32,
        beta2,
        neg_step: (-(lr64 / bc1)) as f32,
        bc2_sqrt: bc2.sqrt() as f32,
        apply_decay: weight_decay != 0.0,
    }
}

/// One AdamW update of one parameter tensor at step `t` (1-based, already
/// incremented), in the order of PyTorch's `_single_tensor_adam`:
///
/// ```text
/// w *= 1 - lr·wd                          (decoupled decay, first)
/// m  = lerp(m, g, 1-β1)                    (= β1·m + (1-β1)·g)
/// v  = β2·v + (1-β2)·g·g
/// bc1 = 1 - β1^t,  bc2 = 1 - β2^t          (f64, like PyTorch's Python floats)
/// denom = sqrt(v) / sqrt(bc2) + eps
/// w += -(lr / bc1) · m / denom
/// ```
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    w: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    t: u64,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
) {
    assert!(t >= 1, "adamw_update: step count starts at 1");
    let n = w.len();
    assert!(
        g.len() == n && m.len() == n && v.len() == n,
        "adamw_update: lengths"
    );
    let AdamWScalars {
        decay,
        w1,
        w2,
        beta2: b2f,
        neg_step,
        bc2_sqrt,
        apply_decay,
    } = adamw_scalars(t, lr, beta1, beta2, weight_decay);
    for i in 0..n {
        let gi = g[i];
        let mut wi = w[i];
        if apply_decay {
            wi *= decay;
        }
        // torch lerp: weight < 0.5 ? self + weight*(end-self) : end - (end-self)*(1-weight)
        let mi = m[i];
        let mi = if w1.abs() < 0.5 {
            mi + w1 * (gi - mi)
        } else {
            gi - (gi - mi) * (1.0 - w1)
        };
        let vi = v[i] * b2f + w2 * gi * gi;
        let denom = vi.sqrt() / bc2_sqrt + eps;
        wi += neg_step * mi / denom;
        m[i] = mi;
        v[i] = vi;
        w[i] = wi;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalars come from the hyper-parameters as typed (0.9, not the
    /// f32 0.89999997615814): with the raw widening `w1`, `w2`, the step
    /// and the bias correction all get other bits (the CUDA launch once
    /// made them so; both now share `adamw_scalars`).
    #[test]
    fn adamw_scalars_widen_the_hyper_parameters_as_typed() {
        let k = adamw_scalars(1, 1e-3, 0.9, 0.999, 0.01);
        assert_eq!(k.w1, (1.0 - 0.9f64) as f32);
        assert_eq!(k.w2, (1.0 - 0.999f64) as f32);
        assert_eq!(k.neg_step, (-(1e-3f64 / (1.0 - 0.9f64))) as f32);
        assert_eq!(k.bc2_sqrt, (1.0 - 0.999f64).sqrt() as f32);
        assert_eq!(k.decay, (1.0 - 1e-3f64 * 0.01) as f32);
        let raw_w1 = (1.0 - f64::from(0.9f32)) as f32;
        assert_ne!(k.w1.to_bits(), raw_w1.to_bits());
        assert!(k.apply_decay && !adamw_scalars(1, 1e-3, 0.9, 0.999, 0.0).apply_decay);
    }
}
