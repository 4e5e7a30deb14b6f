#line 1 "optim.cu"
// Optimizer updates, one parameter tensor per launch, in the exact
// operation order of src/ops/optim_update.rs (PyTorch's single-tensor
// paths), so a step gives the CPU's bits.
// Launch: one thread per element.

// Mirrors sgd_update. With momentum != 0 (buf not null):
//   d = g + wd*w;  buf = first ? d : mu*buf + d;
//   step = nesterov ? d + mu*buf : buf;  w -= lr*step.
// Without momentum (momentum == 0; buf may be null then):
//   w -= lr*(g + wd*w).
// w: (n) in/out; buf: (n) in/out or null; g: (n).
extern "C" __global__ void sgd_update(float* w, float* buf, const float* g, long long n,
                                      int first, float lr, float momentum, float weight_decay,
                                      int nesterov) {
    long long i = global_index();
    if (i >= n) return;
    float mu = momentum, wd = weight_decay;
    if (buf && mu != 0.0f) {
        float d = g[i] + wd * w[i];
        float b = first ? d : mu * buf[i] + d;
        buf[i] = b;
        float step = nesterov ? d + mu * b : b;
        w[i] -= lr * step;
    } else {
        w[i] -= lr * (g[i] + wd * w[i]);
    }
}

// Mirrors the element loop of adamw_update. The scalars are the CPU's, made
// on the host exactly as adamw_update makes them (in f64 from the widened
// hyper-parameters, then cast):
//   decay = f32(1 - lr*wd), w1 = f32(1 - beta1), w2 = f32(1 - beta2),
//   beta2 (f32 as given), neg_step = f32(-(lr / (1 - beta1^t))),
//   bc2_sqrt = f32(sqrt(1 - beta2^t)), eps, apply_decay = (wd != 0).
// Per element: w *= decay (when apply_decay); m = lerp(m, g, w1) as torch
// (w1 < 0.5: m + w1*(g - m), else g - (g - m)*(1 - w1));
// v = v*beta2 + w2*g*g; denom = sqrt(v)/bc2_sqrt + eps; w += neg_step*m/denom.
// w, m, v: (n) in/out; g: (n).
extern "C" __global__ void adamw_update(float* w, float* m, float* v, const float* g,
                                        long long n, float decay, float w1, float w2,
                                        float beta2, float neg_step, float bc2_sqrt, float eps,
                                        int apply_decay) {
    long long i = global_index();
    if (i >= n) return;
    float gi = g[i];
    float wi = w[i];
    if (apply_decay) wi *= decay;
    float mi = m[i];
    mi = fabsf(w1) < 0.5f ? mi + w1 * (gi - mi) : gi - (gi - mi) * (1.0f - w1);
    float vi = v[i] * beta2 + w2 * gi * gi;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    wi += neg_step * mi / denom;
    m[i] = mi;
    v[i] = vi;
    w[i] = wi;
}
