#line 1 "loss.cu"
// Softmax cross-entropy with label smoothing, forward and backward in one
// pass, and the top-1 count. Mirrors
// src/ops/cross_entropy.rs::cross_entropy_forward_backward_over plus what
// the CPU backend's cross_entropy does after it (the optional loss scale,
// the rounding, argmax_rows).
//
// One thread per row, in f64 and in the CPU's order within the row: the
// classifier's rows are few (the batch) and this runs once per step, so a
// sequential row is cheap and keeps the CPU's arithmetic. Intended
// differences: CUDA's double exp/log are within 1-2 ulp of the host libm's,
// so a gradient can differ from the CPU's in its last f32 bit (rarely); the
// loss adds per-row sums (each in the CPU's order) instead of one running
// sum over the whole batch, so it agrees to about 1e-15 relative.
// Labels are checked on the host before upload (the CPU's errors).

// row_loss: (n) f64 out, -sum_c target*log p of each row; row_correct: (n)
// out, 1 when the row's first largest logit is its label; dlogits:
// (n, classes) f32 out = ((p - target) / divisor) * scale, rounded;
// logits: (n, classes) f32; labels: (n) int32 in [0, classes).
// has_scale = 0: no scale (the CPU's None). Launch: one thread per row.
extern "C" __global__ void cross_entropy_forward_backward(
    double* row_loss, int* row_correct, float* dlogits, const float* logits, const int* labels,
    int n, int classes, float smoothing, long long divisor, int has_scale, float scale,
    int round) {
    int row = (int)global_index();
    if (row >= n) return;
    const float* z = logits + (long long)row * classes;
    float* d = dlogits + (long long)row * classes;
    int label = labels[row];
    // max: the CPU's fold with f32::max (a NaN is skipped), then widened.
    float mx = __int_as_float(0xff800000);
    for (int c = 0; c < classes; c++) mx = fmaxf(mx, z[c]);
    double zmax = (double)mx;
    double sum_exp = 0.0;
    for (int c = 0; c < classes; c++) sum_exp += exp((double)z[c] - zmax);
    double log_z = zmax + log(sum_exp);
    double eps = (double)smoothing;
    double total = 0.0;
    for (int c = 0; c < classes; c++) {
        double target = eps / (double)classes + (c == label ? 1.0 - eps : 0.0);
        double logp = (double)z[c] - log_z;
        total -= target * logp;
        float g = (float)((exp(logp) - target) / (double)divisor);
        if (has_scale) g *= scale;
        d[c] = round_to(g, round);
    }
    row_loss[row] = total;
    // argmax_rows: the first index whose logit is strictly larger than the
    // best so far (ties and NaNs never replace it).
    int best = 0;
    for (int c = 0; c < classes; c++)
        if (z[c] > z[best]) best = c;
    row_correct[row] = best == label;
}

// The batch's mean loss (rows added in order) and correct count, added into
// a step's totals: *acc_loss += mean (weighted = 0) or += mean * num / den
// (a micro-batch's share of its window, in the host's order of operations),
// *acc_correct += the count. So the losses of every micro-batch of an
// optimizer step reach the host in one read at its end. acc_loss: (1) f64
// in/out; acc_correct: (1) int in/out; both zeroed once per step by the
// caller; row_loss, row_correct: (n). Launch: one thread (n is the batch).
extern "C" __global__ void cross_entropy_reduce_add(double* acc_loss, int* acc_correct,
                                                    const double* row_loss,
                                                    const int* row_correct, int n,
                                                    int weighted, long long num,
                                                    long long den) {
    if (global_index() != 0) return;
    double total = 0.0;
    int count = 0;
    for (int r = 0; r < n; r++) {
        total += row_loss[r];
        count += row_correct[r];
    }
    double mean = total / (double)n;
    double share = weighted ? mean * (double)num / (double)den : mean;
    *acc_loss = *acc_loss + share;
    *acc_correct += count;
}
