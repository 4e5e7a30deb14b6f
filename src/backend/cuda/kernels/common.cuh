// Prepended to every kernel source by src/backend/cuda/mod.rs (NVRTC is given
// one string per module and no include path). Each .cu file starts with a
// #line directive, so NVRTC's log names the .cu file and its own line numbers.
//
// No CUDA headers: bf16 and f16 values travel as their 16-bit patterns, and
// the conversions are written out so they give the bits the CPU's do
// (src/device/cpu/bf16_convert.rs, the half crate).
//
// Numerics policy (see KERNEL_SOURCES in mod.rs): the sources are compiled
// with --fmad=false, --prec-div=true, --prec-sqrt=true, --ftz=false, so
// `a * b + c` rounds twice as it does in Rust, and / and sqrtf are IEEE
// correctly rounded. Elementwise kernels therefore give the CPU's bits;
// reductions say where their order differs.

typedef unsigned short bf16_t;  // bf16 bits
typedef unsigned short f16_t;   // IEEE half bits
typedef unsigned char u8;

// How a kernel finishes each value it writes (the CPU's RoundChunk /
// Precision::chunk_round): 0 = fp32 (nothing), 1 = round to bf16, 2 = to f16.
#define ROUND_NONE 0
#define ROUND_BF16 1
#define ROUND_F16 2

// Threads per block of the elementwise kernels (any value works; the
// reductions name their own fixed sizes).
#define ELEMENTWISE_THREADS 256

__device__ __forceinline__ bool is_nan_f32(float x) {
    return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u;
}

// Not inf and not NaN (Rust's f32::is_finite).
__device__ __forceinline__ bool is_finite_f32(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// Mirrors device::cpu::bf16_convert::bf16_bits_to_f32 (exact).
__device__ __forceinline__ float bf16_to_f32(bf16_t b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// Mirrors device::cpu::bf16_convert::f32_to_bf16_bits: round to nearest
// even; a NaN keeps its top bits and is made quiet (0x0040).
__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    unsigned int b = __float_as_uint(x);
    unsigned int rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    unsigned int nan = (b >> 16) | 0x0040u;
    return (bf16_t)(is_nan_f32(x) ? nan : rounded);
}

// IEEE f32 -> f16, round to nearest even, overflow to +-inf, f16 subnormals
// kept (the half crate / F16C do the same). A NaN stays NaN; its payload
// may differ from the CPU's.
__device__ __forceinline__ f16_t f32_to_f16(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// f16 -> f32 (exact).
__device__ __forceinline__ float f16_to_f32(f16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float round_to(float x, int round) {
    if (round == ROUND_BF16) return bf16_to_f32(f32_to_bf16(x));
    if (round == ROUND_F16) return f16_to_f32(f32_to_f16(x));
    return x;
}

// A value read as f32, whether stored as f32 or bf16 (the CPU's ReadF32).
__device__ __forceinline__ float read_f32(float v) { return v; }
__device__ __forceinline__ float read_f32(bf16_t v) { return bf16_to_f32(v); }

// The index of this thread in a 1-D grid, 64-bit (tensors may pass 2^31).
__device__ __forceinline__ long long global_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
