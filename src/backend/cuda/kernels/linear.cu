#line 1 "linear.cu"
// The linear layer's bias around cuBLAS's GEMMs (src/ops/linear.rs).
//
// linear_forward computes y = x * w^T with beta = 1 on top of y filled with
// the bias by bias_rows, so each output is b + (x * w^T) in cuBLAS's
// summation order (the CPU's GEMM adds in its own order: equal to about
// 1e-6 relative, not bit for bit).
//
// bias_grad mirrors linear_backward's bias loop: db[o] += dy[r][o] for
// r = 0, 1, ... in order, in f32: the CPU's bits.

// y: (n, out) f32 out, every row = b; b: (out). One thread per element.
extern "C" __global__ void bias_rows(float* y, const float* b, long long n, int out) {
    long long i = global_index();
    if (i >= n * out) return;
    y[i] = b[i % out];
}

// db: (out) in/out; dy: (n, out). One thread per output feature.
extern "C" __global__ void bias_grad(float* db, const float* dy, long long n, int out) {
    int o = (int)global_index();
    if (o >= out) return;
    float d = db[o];
    for (long long r = 0; r < n; r++) d += dy[r * out + o];
    db[o] = d;
}
