//! Softmax cross-entropy on logits, mean over the batch, with optional label
//! smoothing (PyTorch: target = (1-ε)·onehot + ε/classes).

use crate::error::{Error, Result};

/// Returns the mean loss and writes `dlogits` = d(loss)/d(logits), i.e.
/// (softmax - target) / n.
pub fn cross_entropy_forward_backward(
    dlogits: &mut [f32],
    logits: &[f32],
    labels: &[usize],
    classes: usize,
    smoothing: f32,
) -> Result<f64> {
    let n = labels.len();
    cross_entropy_forward_backward_over(dlogits, logits, labels, classes, smoothing, n)
}

/// As [`cross_entropy_forward_backward`], but the gradient is that of the
/// summed loss divided by `divisor` samples: the micro-batch of an
/// accumulation window passes the window's sample count, so k micro-batches
/// give each sample exactly the gradient one big batch would (the division
/// happens in f64 per element, before rounding). The returned loss is still
/// this batch's mean.
pub fn cross_entropy_forward_backward_over(
    dlogits: &mut [f32],
    logits: &[f32],
    labels: &[usize],
    classes: usize,
    smoothing: f32,
    divisor: usize,
) -> Result<f64> {
    let n = labels.len();
    if divisor < n {
        return Err(Error::invalid(
            "cross_entropy",
            format!("divisor {divisor} is smaller than the batch of {n}"),
        ));
    }
    if logits.len() != n * classes {
        return Err(Error::ShapeMismatch {
            op: "cross_entropy",
            expected: format!("{n}x{classes} logits"),
            got: logits.len().to_string(),
        });
    }
    if let Some(&bad) = labels.iter().find(|&&l| l >= classes) {
        return Err(Error::invalid(
            "cross_entropy",
            format!("label {bad} out of range for {classes} classes"),
        ));
    }
    let eps = smoothing as f64;
    let mut total = 0.0;
    for (i, &label) in labels.iter().enumerate() {
        let row = &logits[i * classes..][..classes];
        let drow = &mut dlogits[i * classes..][..classes];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let sum_exp: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
        let log_z = max + sum_exp.ln();
        for (c, (&v, d)) in row.iter().zip(drow.iter_mut()).enumerate() {
            let target = eps / classes as f64 + if c == label { 1.0 - eps } else { 0.0 };
            let logp = v as f64 - log_z;
            total -= target * logp;
            *d = ((logp.exp() - target) / divisor as f64) as f32;
        }
    }
    Ok(total / n as f64)
}

pub fn cross_entropy_ref(logits: &[f64], labels: &[usize], classes: usize, smoothing: f64) -> f64 {
    let n = labels.len();
    let mut total = 0.0;
    for (i, &label) in labels.iter().enumerate() {
        let row = &logits[i * classes..][..classes];
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        for (c, &v) in row.iter().enumerate() {
            let target =
                smoothing / classes as f64 + if c == label { 1.0 - smoothing } else { 0.0 };
            total -= target * (v.exp() / z).ln();
        }
    }
    total / n as f64
}

/// Index of the largest logit of each row.
pub fn argmax_rows(logits: &[f32], classes: usize) -> Vec<usize> {
    logits
        .chunks_exact(classes)
        .map(|row| {
            row.iter()
                .enumerate()
                .fold(0, |best, (i, &v)| if v > row[best] { i } else { best })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    #[test]
    fn matches_reference_and_finite_differences() {
        let mut r = rng(70);
        let (n, classes) = (4, 6);
        let logits: Vec<f32> = rand_vec(&mut r, n * classes)
            .iter()
            .map(|v| v * 3.0)
            .collect();
        let labels = vec![0, 5, 2, 2];
        for smoothing in [0.0f32, 0.1] {
            let mut d = vec![0.0; logits.len()];
            let loss = cross_entropy_forward_backward(&mut d, &logits, &labels, classes, smoothing)
                .unwrap();
            let l64 = to_f64(&logits);
            let want = cross_entropy_ref(&l64, &labels, classes, smoothing as f64);
            assert!((loss - want).abs() < 1e-6, "{loss} vs {want}");
            let fd = finite_diff(&l64, 1e-6, |p| {
                cross_entropy_ref(p, &labels, classes, smoothing as f64)
            });
            assert_close("dlogits", &d, &fd, 1e-6, 1e-5);
        }
    }

    #[test]
    fn bad_labels_are_errors() {
        let mut d = vec![0.0; 4];
        let e = cross_entropy_forward_backward(&mut d, &[0.0; 4], &[0, 2], 2, 0.0).unwrap_err();
        assert!(
            e.to_string().contains("label 2 out of range for 2 classes"),
            "{e}"
        );
    }
}
