#line 1 "reduce.cu"
// Norms, scaling and finiteness checks over one tensor: what the optimizer's
// clipping and the GradScaler ask of the CPU backend (sum_squares, scale,
// unscale, all_finite in src/backend/cpu.rs).
//
// sum_squares accumulates f32 squares (each exact in f64) in f64, in a fixed
// order that does not depend on the GPU: block b sums elements
// [b*SQ_CHUNK, (b+1)*SQ_CHUNK) with SQ_THREADS threads (thread t takes
// t, t + SQ_THREADS, ...) and a fixed shared-memory tree; a second kernel
// adds the blocks in order. The CPU adds the elements one by one, so the
// two agree to about 1e-15 relative, not bit for bit.
// Workspace: partial, (ceil(n / SQ_CHUNK)) f64.
//
// The flags (found_inf, found_non_finite) are device ints the caller zeroes
// once per step; kernels only ever store 1 into them, so racing stores are
// harmless and the result does not depend on order. The host reads them
// once per optimizer step.

#define SQ_THREADS 256
#define SQ_CHUNK 8192

// partial: (ceil(n / SQ_CHUNK)) f64 out; x: (n) f32.
// Launch: grid ceil(n / SQ_CHUNK), block exactly SQ_THREADS.
extern "C" __global__ void sum_squares_partial(double* partial, const float* x, long long n) {
    __shared__ double lane[SQ_THREADS];
    long long start = (long long)blockIdx.x * SQ_CHUNK;
    long long end = min(start + SQ_CHUNK, n);
    double acc = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += SQ_THREADS) {
        double v = (double)x[i];
        acc += v * v;
    }
    lane[threadIdx.x] = acc;
    __syncthreads();
    for (int stride = SQ_THREADS / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) lane[threadIdx.x] += lane[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = lane[0];
}

// *acc += the sum of the blocks in order: a clipping norm's sum over many
// tensors accumulated on the device in the host's order (tensor by
// tensor), read once per optimizer step (a lone sum starts from a zeroed
// acc). acc: (1) f64 in/out, zeroed by the
// caller. Launch: one thread.
extern "C" __global__ void sum_squares_finish_add(double* acc, const double* partial,
                                                  long long blocks) {
    if (global_index() != 0) return;
    double total = 0.0;
    for (long long b = 0; b < blocks; b++) total += partial[b];
    *acc += total;
}

// Mirrors scale: x *= c. x: (n) in/out. One thread per element.
extern "C" __global__ void scale(float* x, long long n, float c) {
    long long i = global_index();
    if (i >= n) return;
    x[i] *= c;
}

// Mirrors unscale: x *= inv, and *found_inf = 1 when a result is inf or NaN.
// x: (n) in/out; found_inf: (1) int, zeroed by the caller. One thread per
// element.
extern "C" __global__ void unscale(float* x, int* found_inf, long long n, float inv) {
    long long i = global_index();
    if (i >= n) return;
    float v = x[i] * inv;
    x[i] = v;
    if (!is_finite_f32(v)) *found_inf = 1;
}

// Mirrors all_finite: *found_non_finite = 1 when an element is inf or NaN;
// all finite <=> it stays 0. x: (n); found_non_finite: (1) int, zeroed by
// the caller. One thread per element.
extern "C" __global__ void all_finite(int* found_non_finite, const float* x, long long n) {
    long long i = global_index();
    if (i >= n) return;
    if (!is_finite_f32(x[i])) *found_non_finite = 1;
}
