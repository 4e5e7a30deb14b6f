#line 1 "batchnorm.cu"
// Batch normalisation over NHWC rows: x is (rows = n*h*w, c) row-major.
// Mirrors src/ops/batchnorm.rs (PyTorch semantics: batch mean and biased
// variance in training, running statistics with the unbiased variance).
//
// Per-channel reductions without atomics, in the CPU's exact order: rows are
// cut into chunks of BN_CHUNK_ROWS (the CPU's REDUCE_CHUNK_ROWS); one thread
// per (chunk, channel) sums its chunk in runs of BN_RUN_ROWS rows in f32,
// flushing each run into f64 (the CPU's channel_sums2), and writes the two
// f64 chunk totals to a workspace; a second kernel adds the chunks in order.
// So the statistics and the parameter gradients are the CPU's bits, and the
// workspace is a function of the shape (the planner can count it):
//   partial: (chunks = ceil(rows / BN_CHUNK_ROWS), 2, c) f64.
//
// Launch: the *_partial kernels take grid (chunks, ceil(c / BN_THREADS)),
// block BN_THREADS; the per-channel kernels one thread per channel; the
// per-element kernels one thread per element of x.

#define BN_CHUNK_ROWS 512  // == crate::ops::REDUCE_CHUNK_ROWS
#define BN_RUN_ROWS 32     // == F32_RUN_ROWS in src/ops/batchnorm.rs
#define BN_THREADS 128

// Mirrors the chunk loop of channel_sums2 with bn_batch_stats' row_fn:
// shifted sums (by the first row) of d = x - shift and d*d.
// partial: (chunks, 2, c) f64 out; x: (rows, c) f32 or bf16 (a stored
// activation, read in place).
template <typename X>
__device__ void bn_stats_partial_any(double* partial, const X* x, long long rows, int c) {
    long long chunk = blockIdx.x;
    int ch = blockIdx.y * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    long long r0 = chunk * BN_CHUNK_ROWS;
    long long r1 = min(r0 + BN_CHUNK_ROWS, rows);
    float shift = read_f32(x[ch]);
    double t0 = 0.0, t1 = 0.0;
    for (long long run = r0; run < r1; run += BN_RUN_ROWS) {
        long long end = min(run + BN_RUN_ROWS, r1);
        float s0 = 0.0f, s1 = 0.0f;
        for (long long r = run; r < end; r++) {
            float d = read_f32(x[r * c + ch]) - shift;
            s0 += d;
            s1 += d * d;
        }
        t0 += (double)s0;
        t1 += (double)s1;
    }
    partial[(chunk * 2 + 0) * c + ch] = t0;
    partial[(chunk * 2 + 1) * c + ch] = t1;
}

extern "C" __global__ void bn_stats_partial(double* partial, const float* x, long long rows,
                                            int c) {
    bn_stats_partial_any(partial, x, rows, c);
}

extern "C" __global__ void bn_stats_partial_bf16(double* partial, const bf16_t* x,
                                                 long long rows, int c) {
    bn_stats_partial_any(partial, x, rows, c);
}

// Mirrors the end of bn_batch_stats followed by bn_rstd (what the CPU
// backend's bn_batch_stats does): chunks added in order, then
// mean = shift + m, var = max(E[d^2] - m^2, 0), rstd = 1 / sqrt(var + eps).
// mean, var, rstd: (c) f32 out; partial: (chunks, 2, c); x: (rows, c).
// One thread per channel.
template <typename X>
__device__ void bn_stats_finish_any(float* mean, float* var, float* rstd, const double* partial,
                                    const X* x, long long rows, int c, float eps) {
    int ch = (int)global_index();
    if (ch >= c) return;
    long long chunks = (rows + BN_CHUNK_ROWS - 1) / BN_CHUNK_ROWS;
    double sum = 0.0, sum_sq = 0.0;
    for (long long k = 0; k < chunks; k++) {
        sum += partial[(k * 2 + 0) * c + ch];
        sum_sq += partial[(k * 2 + 1) * c + ch];
    }
    double m = sum / (double)rows;
    mean[ch] = (float)((double)read_f32(x[ch]) + m);
    float v = (float)fmax(sum_sq / (double)rows - m * m, 0.0);
    var[ch] = v;
    rstd[ch] = 1.0f / sqrtf(v + eps);
}

extern "C" __global__ void bn_stats_finish(float* mean, float* var, float* rstd,
                                           const double* partial, const float* x,
                                           long long rows, int c, float eps) {
    bn_stats_finish_any(mean, var, rstd, partial, x, rows, c, eps);
}

extern "C" __global__ void bn_stats_finish_bf16(float* mean, float* var, float* rstd,
                                                const double* partial, const bf16_t* x,
                                                long long rows, int c, float eps) {
    bn_stats_finish_any(mean, var, rstd, partial, x, rows, c, eps);
}

// Mirrors bn_update_running: running = (1 - momentum)*running +
// momentum*batch, the variance made unbiased by rows / (rows - 1) (f32).
// running_mean, running_var: (c) in/out; mean, var: (c). One thread per channel.
extern "C" __global__ void bn_update_running(float* running_mean, float* running_var,
                                             const float* mean, const float* var,
                                             long long rows, int c, float momentum) {
    int ch = (int)global_index();
    if (ch >= c) return;
    float unbias = rows > 1 ? (float)rows / (float)(rows - 1) : 1.0f;
    running_mean[ch] = (1.0f - momentum) * running_mean[ch] + momentum * mean[ch];
    running_var[ch] = (1.0f - momentum) * running_var[ch] + momentum * var[ch] * unbias;
}

// Mirrors the CPU backend's bn_running_stats (eval and frozen BN):
// mean = running_mean, rstd = 1 / sqrt(running_var + eps).
// mean, rstd: (c) out; running_mean, running_var: (c). One thread per channel.
extern "C" __global__ void bn_running_stats(float* mean, float* rstd, const float* running_mean,
                                            const float* running_var, int c, float eps) {
    int ch = (int)global_index();
    if (ch >= c) return;
    mean[ch] = running_mean[ch];
    rstd[ch] = 1.0f / sqrtf(running_var[ch] + eps);
}

// Mirrors fold_affine + normalise_row: y = x*scale + shift with
// scale = gamma*rstd, shift = beta - mean*scale, then max(., 0) when relu.
// (A -0.0 result may come out +0.0 or -0.0 on either side; same value.)
template <typename X>
__device__ __forceinline__ float bn_normalise(const X* x, long long i, int ch, const float* mean,
                                              const float* rstd, const float* gamma,
                                              const float* beta, int relu) {
    float scale = gamma[ch] * rstd[ch];
    float shift = beta[ch] - mean[ch] * scale;
    float v = read_f32(x[i]) * scale + shift;
    return relu ? fmaxf(v, 0.0f) : v;
}

// Mirrors bn_forward (f32 y, finished with `round`) and, when x_low is not
// null, bn_forward_keep_x (x_low = x in bf16, the copy a backward keeps).
// y: (rows, c) f32 out; x_low: (rows, c) bf16 out or null; x: (rows, c);
// mean, rstd, gamma, beta: (c). One thread per element.
template <typename X>
__device__ void bn_forward_f32_out(float* y, bf16_t* x_low, const X* x, const float* mean,
                                   const float* rstd, const float* gamma, const float* beta,
                                   long long rows, int c, int relu, int round) {
    long long i = global_index();
    if (i >= rows * c) return;
    int ch = (int)(i % c);
    y[i] = round_to(bn_normalise(x, i, ch, mean, rstd, gamma, beta, relu), round);
    if (x_low) x_low[i] = f32_to_bf16(read_f32(x[i]));
}

// Mirrors bn_forward_bf16 (bf16 y, each value normalised in f32 and rounded
// to nearest even as it is stored) and, with x_low, bn_forward_keep_x's
// BnOut::Bf16. y: (rows, c) bf16 out; the rest as bn_forward_f32_out.
template <typename X>
__device__ void bn_forward_bf16_out(bf16_t* y, bf16_t* x_low, const X* x, const float* mean,
                                    const float* rstd, const float* gamma, const float* beta,
                                    long long rows, int c, int relu) {
    long long i = global_index();
    if (i >= rows * c) return;
    int ch = (int)(i % c);
    y[i] = f32_to_bf16(bn_normalise(x, i, ch, mean, rstd, gamma, beta, relu));
    if (x_low) x_low[i] = f32_to_bf16(read_f32(x[i]));
}

// x f32 -> y f32 (x_low may be given).
extern "C" __global__ void bn_forward_xf32_yf32(float* y, bf16_t* x_low, const float* x,
                                               const float* mean, const float* rstd,
                                               const float* gamma, const float* beta,
                                               long long rows, int c, int relu, int round) {
    bn_forward_f32_out(y, x_low, x, mean, rstd, gamma, beta, rows, c, relu, round);
}

// x bf16 (a stored activation) -> y f32. x_low is unused (pass null).
extern "C" __global__ void bn_forward_xbf16_yf32(float* y, bf16_t* x_low, const bf16_t* x,
                                                const float* mean, const float* rstd,
                                                const float* gamma, const float* beta,
                                                long long rows, int c, int relu, int round) {
    bn_forward_f32_out(y, x_low, x, mean, rstd, gamma, beta, rows, c, relu, round);
}

// x f32 -> y bf16 (x_low may be given).
extern "C" __global__ void bn_forward_xf32_ybf16(bf16_t* y, bf16_t* x_low, const float* x,
                                                const float* mean, const float* rstd,
                                                const float* gamma, const float* beta,
                                                long long rows, int c, int relu) {
    bn_forward_bf16_out(y, x_low, x, mean, rstd, gamma, beta, rows, c, relu);
}

// x bf16 -> y bf16. x_low is unused (pass null).
extern "C" __global__ void bn_forward_xbf16_ybf16(bf16_t* y, bf16_t* x_low, const bf16_t* x,
                                                 const float* mean, const float* rstd,
                                                 const float* gamma, const float* beta,
                                                 long long rows, int c, int relu) {
    bn_forward_bf16_out(y, x_low, x, mean, rstd, gamma, beta, rows, c, relu);
}

// The backward kernels read dy, x and relu_out each as f32 or bf16 (a
// stored activation or a gradient handed between blocks in bf16), chosen
// per call by a flag (1 = bf16): the same loads for every thread, so no
// divergence, and one kernel instead of eight typed copies.
__device__ __forceinline__ float load_any(const void* p, long long i, int bf16) {
    return bf16 ? bf16_to_f32(((const bf16_t*)p)[i]) : ((const float*)p)[i];
}

// g = dy where the fused ReLU passed (relu_out > 0), or dy when relu_out is
// null.
__device__ __forceinline__ float bn_masked_grad(const void* dy, int dy_bf16,
                                                const void* relu_out, int o_bf16, long long i) {
    float d = load_any(dy, i, dy_bf16);
    return relu_out ? (load_any(relu_out, i, o_bf16) > 0.0f ? d : 0.0f) : d;
}

// Mirrors the first pass of bn_backward: per (chunk, channel), sum g and
// g*(x - mean) in the order of channel_sums2.
// partial: (chunks, 2, c) f64 out; dy: (rows, c); x: (rows, c);
// mean: (c) f32; relu_out: (rows, c) or null.
extern "C" __global__ void bn_backward_partial(double* partial, const void* dy, int dy_bf16,
                                               const void* x, int x_bf16, const float* mean,
                                               const void* relu_out, int o_bf16,
                                               long long rows, int c) {
    long long chunk = blockIdx.x;
    int ch = blockIdx.y * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    long long r0 = chunk * BN_CHUNK_ROWS;
    long long r1 = min(r0 + BN_CHUNK_ROWS, rows);
    float m = mean[ch];
    double t0 = 0.0, t1 = 0.0;
    for (long long run = r0; run < r1; run += BN_RUN_ROWS) {
        long long end = min(run + BN_RUN_ROWS, r1);
        float s0 = 0.0f, s1 = 0.0f;
        for (long long r = run; r < end; r++) {
            long long i = r * c + ch;
            float g = bn_masked_grad(dy, dy_bf16, relu_out, o_bf16, i);
            s0 += g;
            s1 += g * (load_any(x, i, x_bf16) - m);
        }
        t0 += (double)s0;
        t1 += (double)s1;
    }
    partial[(chunk * 2 + 0) * c + ch] = t0;
    partial[(chunk * 2 + 1) * c + ch] = t1;
}

// Mirrors the middle of bn_backward: chunks added in order; dbeta += sum g,
// dgamma += sum g*x_hat (both accumulate, either may be null: frozen BN);
// then the per-channel constants of dx = scale*g + coef*(x - mean) + bias,
// with coef = bias = 0 unless batch_stats (training).
// coefs: (3, c) f32 out = [scale; coef; bias]; dgamma, dbeta: (c) in/out or
// null; partial: (chunks, 2, c); rstd, gamma: (c). One thread per channel.
extern "C" __global__ void bn_backward_finish(float* coefs, float* dgamma, float* dbeta,
                                              const double* partial, const float* rstd,
                                              const float* gamma, long long rows, int c,
                                              int batch_stats) {
    int ch = (int)global_index();
    if (ch >= c) return;
    long long chunks = (rows + BN_CHUNK_ROWS - 1) / BN_CHUNK_ROWS;
    double sum_g = 0.0, sum_gxc = 0.0;
    for (long long k = 0; k < chunks; k++) {
        sum_g += partial[(k * 2 + 0) * c + ch];
        sum_gxc += partial[(k * 2 + 1) * c + ch];
    }
    double sum_gx = sum_gxc * (double)rstd[ch];
    if (dbeta) dbeta[ch] += (float)sum_g;
    if (dgamma) dgamma[ch] += (float)sum_gx;
    float scale = gamma[ch] * rstd[ch];
    float coef = 0.0f, bias = 0.0f;
    if (batch_stats) {
        float mean_g = (float)(sum_g / (double)rows);
        float mean_gx = (float)(sum_gx / (double)rows);
        coef = -scale * rstd[ch] * mean_gx;
        bias = -scale * mean_g;
    }
    coefs[ch] = scale;
    coefs[c + ch] = coef;
    coefs[2 * c + ch] = bias;
}

// Mirrors the second pass of bn_backward: dx = scale*g + coef*(x - mean) +
// bias (overwrites dx), finished with `round`.
// dx: (rows, c) f32 out; dy, x, relu_out (or null): (rows, c), typed by
// their flags; mean: (c); coefs: (3, c) from bn_backward_finish.
// One thread per element.
extern "C" __global__ void bn_backward_dx(float* dx, const void* dy, int dy_bf16, const void* x,
                                          int x_bf16, const float* mean, const void* relu_out,
                                          int o_bf16, const float* coefs, long long rows, int c,
                                          int round) {
    long long i = global_index();
    if (i >= rows * c) return;
    int ch = (int)(i % c);
    float g = bn_masked_grad(dy, dy_bf16, relu_out, o_bf16, i);
    float out = coefs[ch] * g + coefs[c + ch] * (load_any(x, i, x_bf16) - mean[ch]) +
                coefs[2 * c + ch];
    dx[i] = round_to(out, round);
}
