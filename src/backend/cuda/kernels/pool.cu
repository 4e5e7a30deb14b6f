#line 1 "pool.cu"
// Max pooling (the stem's 3x3, stride 2, pad 1; any k, stride, pad work) and
// global average pooling, NHWC. Mirrors src/ops/maxpool.rs and
// src/ops/avgpool.rs, with the same bits: the same comparisons in the same
// scan order, and gradients added in the CPU's order.

// Input rows (or columns) [*lo, *hi) of the window starting at output
// position o: PoolGeom::window.
__device__ __forceinline__ void pool_window(int o, int stride, int pad, int k, int lim, int* lo,
                                            int* hi) {
    int start = o * stride - pad;
    *lo = min(max(start, 0), lim);
    *hi = min(max(start + k, 0), lim);
}

// Mirrors maxpool_forward: the maximum of each window in row-major scan
// order; padding counts as -inf; a NaN wins and then stays (v > o || isnan).
// y: (n, oh, ow, c) out; x: (n, h, w, c). One thread per element of y.
extern "C" __global__ void maxpool_forward(float* y, const float* x, int n, int h, int w, int c,
                                           int k, int stride, int pad, int oh, int ow) {
    long long i = global_index();
    if (i >= (long long)n * oh * ow * c) return;
    int ch = (int)(i % c);
    long long t = i / c;
    int ox = (int)(t % ow);
    t /= ow;
    int oy = (int)(t % oh);
    long long b = t / oh;
    int y0, y1, x0, x1;
    pool_window(oy, stride, pad, k, h, &y0, &y1);
    pool_window(ox, stride, pad, k, w, &x0, &x1);
    float o = __int_as_float(0xff800000);  // -inf
    for (int iy = y0; iy < y1; iy++) {
        for (int ix = x0; ix < x1; ix++) {
            float v = x[((b * h + iy) * w + ix) * c + ch];
            if (v > o || is_nan_f32(v)) o = v;
        }
    }
    y[i] = o;
}

// Mirrors maxpool_backward (then the backend's rounding): each output's
// gradient goes to the first maximum of its window (strict >, NaN taken,
// the window's first element taken when all are -inf). Instead of the CPU's
// scatter, each input element gathers: it visits the windows that contain
// it in the CPU's output order (oy, then ox), recomputes each window's
// argmax, and adds dy where it is the argmax: no atomics, the CPU's sums.
// dx: (n, h, w, c) out (overwritten); dy: (n, oh, ow, c); x: (n, h, w, c);
// dy and x f32 or bf16 (read in place). One thread per element of dx.
template <typename D, typename X>
__device__ void maxpool_backward_any(float* dx, const D* dy, const X* x, int n, int h, int w,
                                     int c, int k, int stride, int pad, int oh, int ow,
                                     int round) {
    long long i = global_index();
    if (i >= (long long)n * h * w * c) return;
    int ch = (int)(i % c);
    long long t = i / c;
    int ix = (int)(t % w);
    t /= w;
    int iy = (int)(t % h);
    long long b = t / h;
    // Windows containing iy: oy*stride - pad <= iy < oy*stride - pad + k.
    int ay = iy + pad - k + 1, ax = ix + pad - k + 1;
    int oy0 = ay <= 0 ? 0 : (ay + stride - 1) / stride;
    int ox0 = ax <= 0 ? 0 : (ax + stride - 1) / stride;
    int oy1 = min((iy + pad) / stride, oh - 1);
    int ox1 = min((ix + pad) / stride, ow - 1);
    int me = iy * w + ix;
    float acc = 0.0f;
    for (int oy = oy0; oy <= oy1; oy++) {
        for (int ox = ox0; ox <= ox1; ox++) {
            int y0, y1, x0, x1;
            pool_window(oy, stride, pad, k, h, &y0, &y1);
            pool_window(ox, stride, pad, k, w, &x0, &x1);
            float best = __int_as_float(0xff800000);
            int arg = -1;  // the CPU's NONE
            for (int wy = y0; wy < y1; wy++) {
                for (int wx = x0; wx < x1; wx++) {
                    float v = read_f32(x[((b * h + wy) * w + wx) * c + ch]);
                    if (v > best || is_nan_f32(v) || arg < 0) {
                        best = v;
                        arg = wy * w + wx;
                    }
                }
            }
            if (arg == me) acc += read_f32(dy[((b * oh + oy) * ow + ox) * c + ch]);
        }
    }
    dx[i] = round_to(acc, round);
}

extern "C" __global__ void maxpool_backward(float* dx, const float* dy, const float* x, int n, int h,
    int w, int c, int k, int stride, int pad, int oh, int ow, int round) {
    maxpool_backward_any(dx, dy, x, n, h, w, c, k, stride, pad, oh, ow, round);
}

extern "C" __global__ void maxpool_backward_dybf16(float* dx, const bf16_t* dy, const float* x, int n, int h,
    int w, int c, int k, int stride, int pad, int oh, int ow, int round) {
    maxpool_backward_any(dx, dy, x, n, h, w, c, k, stride, pad, oh, ow, round);
}

extern "C" __global__ void maxpool_backward_xbf16(float* dx, const float* dy, const bf16_t* x, int n, int h,
    int w, int c, int k, int stride, int pad, int oh, int ow, int round) {
    maxpool_backward_any(dx, dy, x, n, h, w, c, k, stride, pad, oh, ow, round);
}

extern "C" __global__ void maxpool_backward_dybf16_xbf16(float* dx, const bf16_t* dy, const bf16_t* x, int n, int h,
    int w, int c, int k, int stride, int pad, int oh, int ow, int round) {
    maxpool_backward_any(dx, dy, x, n, h, w, c, k, stride, pad, oh, ow, round);
}

// Mirrors avgpool_forward (then the backend's rounding): y = f32(sum in f64
// over the pixels in order / hw).
// y: (n, c) out; x: (n, hw, c). One thread per element of y.
extern "C" __global__ void avgpool_forward(float* y, const float* x, int n, int hw, int c,
                                           int round) {
    long long i = global_index();
    if (i >= (long long)n * c) return;
    int ch = (int)(i % c);
    long long b = i / c;
    double acc = 0.0;
    for (int p = 0; p < hw; p++) acc += (double)x[(b * hw + p) * c + ch];
    y[i] = round_to((float)(acc / (double)hw), round);
}

// Mirrors avgpool_backward (then the backend's rounding): dx = dy * (1/hw),
// overwriting dx.
// dx: (n, hw, c) out; dy: (n, c). One thread per element of dx.
extern "C" __global__ void avgpool_backward(float* dx, const float* dy, int n, int hw, int c,
                                            int round) {
    long long i = global_index();
    if (i >= (long long)n * hw * c) return;
    int ch = (int)(i % c);
    long long b = i / ((long long)hw * c);
    float inv = 1.0f / (float)hw;
    dx[i] = round_to(dy[b * c + ch] * inv, round);
}
