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

// Stores a ReLU output: into an f32 x rounded as `round` says (the CPU's
// emulation of a low-precision store), into a bf16 x to nearest even.
__device__ __forceinline__ void store_relu(float* p, float v, int round) { *p = round_to(v, round); }
__device__ __forceinline__ void store_relu(bf16_t* p, float v, int) { *p = f32_to_bf16(v); }

// Mirrors add_relu_forward (f32 x) and add_relu_forward_bf16 (bf16 x: the
// sum stored in bf16, as the CPU keeps it where the device reads bf16):
// s = x + residual in f32, x = max(s, 0) in place (stored by store_relu),
// bit = (s > 0). The residual is read as f32 (it may be a stored bf16 block
// input).
// x: (n) f32 or bf16 in/out; mask: (ceil(n/8)) bytes out; residual: (n).
template <typename X, typename R>
__device__ void add_relu_forward(X* x, u8* mask, const R* residual, long long n, int round) {
    long long b = global_index();
    if (b * 8 >= n) return;
    unsigned int bits = 0;
    for (int j = 0; j < 8; j++) {
        long long i = b * 8 + j;
        if (i >= n) break;
        float s = read_f32(x[i]) + read_f32(residual[i]);
        bool pos = s > 0.0f;
        bits |= (unsigned int)pos << j;
        store_relu(&x[i], pos ? s : 0.0f, round);
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

extern "C" __global__ void add_relu_forward_zbf16_f32(bf16_t* x, u8* mask, const float* residual,
                                                     long long n) {
    add_relu_forward(x, mask, residual, n, 0);
}

extern "C" __global__ void add_relu_forward_zbf16_bf16(bf16_t* x, u8* mask,
                                                      const bf16_t* residual, long long n) {
    add_relu_forward(x, mask, residual, n, 0);
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
