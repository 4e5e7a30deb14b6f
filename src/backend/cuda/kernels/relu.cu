#line 1 "relu.cu"
// ReLU with a packed bit mask, the residual add+ReLU, and gradient
// accumulation. Mirrors src/ops/relu.rs and src/ops/add.rs.
//
// Mask layout (as src/ops/relu.rs): bit j of byte b is element 8*b + j
// (least significant bit first); the unused high bits of a last, partial
// byte are 0. One thread per mask byte writes the whole byte, so no two
// threads touch the same byte and no atomics are needed.
// Launch: one thread per mask byte (ceil(n / 8)) for the mask kernels, one
// per element for add_assign.

// Mirrors add_relu_forward: x = max(x + residual, 0) in place, bit =
// (x + residual > 0), then `round`. The residual is read as f32 (it may be a
// stored bf16 block input).
// x: (n) f32 in/out; mask: (ceil(n/8)) bytes out; residual: (n).
template <typename R>
__device__ void add_relu_forward(float* x, u8* mask, const R* residual, long long n, int round) {
    long long b = global_index();
    if (b * 8 >= n) return;
    unsigned int bits = 0;
    for (int j = 0; j < 8; j++) {
        long long i = b * 8 + j;
        if (i >= n) break;
        float s = x[i] + read_f32(residual[i]);
        bool pos = s > 0.0f;
        bits |= (unsigned int)pos << j;
        x[i] = round_to(pos ? s : 0.0f, round);
    }
    mask[b] = (u8)bits;
}

extern "C" __global__ void add_relu_forward_f32(float* x, u8* mask, const float* residual,
                                               long long n, int round) {
    add_relu_forward(x, mask, residual, n, round);
}

extern "C" __global__ void add_relu_forward_bf16(float* x, u8* mask, const bf16_t* residual,
                                                long long n, int round) {
    add_relu_forward(x, mask, residual, n, round);
}

// Mirrors add_relu_forward_bf16 (the sum stored in bf16, as the CPU keeps it
// where the device reads bf16): s = x + residual in f32, x = bf16(max(s, 0))
// to nearest even, bit = (s > 0).
// x: (n) bf16 in/out; mask: (ceil(n/8)) bytes out; residual: (n).
template <typename R>
__device__ void add_relu_forward_to_bf16(bf16_t* x, u8* mask, const R* residual, long long n) {
    long long b = global_index();
    if (b * 8 >= n) return;
    unsigned int bits = 0;
    for (int j = 0; j < 8; j++) {
        long long i = b * 8 + j;
        if (i >= n) break;
        float s = bf16_to_f32(x[i]) + read_f32(residual[i]);
        bool pos = s > 0.0f;
        bits |= (unsigned int)pos << j;
        x[i] = f32_to_bf16(pos ? s : 0.0f);
    }
    mask[b] = (u8)bits;
}

extern "C" __global__ void add_relu_forward_zbf16_f32(bf16_t* x, u8* mask, const float* residual,
                                                     long long n) {
    add_relu_forward_to_bf16(x, mask, residual, n);
}

extern "C" __global__ void add_relu_forward_zbf16_bf16(bf16_t* x, u8* mask,
                                                      const bf16_t* residual, long long n) {
    add_relu_forward_to_bf16(x, mask, residual, n);
}

// Mirrors relu_mask_forward: x = max(x, 0) in place, bit = (x > 0).
// x: (n) f32 in/out; mask: (ceil(n/8)) bytes out.
extern "C" __global__ void relu_mask_forward(float* x, u8* mask, long long n) {
    long long b = global_index();
    if (b * 8 >= n) return;
    unsigned int bits = 0;
    for (int j = 0; j < 8; j++) {
        long long i = b * 8 + j;
        if (i >= n) break;
        bool pos = x[i] > 0.0f;
        bits |= (unsigned int)pos << j;
        x[i] = pos ? x[i] : 0.0f;
    }
    mask[b] = (u8)bits;
}

// Mirrors relu_mask_backward_inplace: d = 0 where the mask bit is clear.
// d: (n) f32 or bf16 in/out (zero is zero bits in both); mask: (ceil(n/8)) bytes.
template <typename D>
__device__ void relu_mask_backward(D* d, const u8* mask, long long n) {
    long long b = global_index();
    if (b * 8 >= n) return;
    unsigned int m = mask[b];
    for (int j = 0; j < 8; j++) {
        long long i = b * 8 + j;
        if (i >= n) break;
        if (((m >> j) & 1u) == 0) d[i] = (D)0;
    }
}

extern "C" __global__ void relu_mask_backward_inplace(float* d, const u8* mask, long long n) {
    relu_mask_backward(d, mask, n);
}

extern "C" __global__ void relu_mask_backward_inplace_bf16(bf16_t* d, const u8* mask,
                                                          long long n) {
    relu_mask_backward(d, mask, n);
}

// Mirrors add::add_assign: acc += x, then `round`.
// acc: (n) f32 in/out; x: (n) f32 or bf16. One thread per element.
template <typename X>
__device__ void add_assign_any(float* acc, const X* x, long long n, int round) {
    long long i = global_index();
    if (i >= n) return;
    acc[i] = round_to(acc[i] + read_f32(x[i]), round);
}

extern "C" __global__ void add_assign(float* acc, const float* x, long long n, int round) {
    add_assign_any(acc, x, n, round);
}

extern "C" __global__ void add_assign_bf16(float* acc, const bf16_t* x, long long n, int round) {
    add_assign_any(acc, x, n, round);
}
