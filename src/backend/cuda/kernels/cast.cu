#line 1 "cast.cu"
// Casts between f32 and the 16-bit types, and rounding in place. Mirrors the
// CPU backend's narrow / widen / round / copy_rounded (src/backend/cpu.rs),
// which call src/device/cpu/bf16_convert.rs and the half crate. Same bits,
// except the payload of an f16 NaN (it stays a NaN).
// Launch: one thread per element.

// narrow to bf16: dst = bf16(src), nearest even. dst: (n) bf16 out; src: (n).
extern "C" __global__ void cast_f32_to_bf16(bf16_t* dst, const float* src, long long n) {
    long long i = global_index();
    if (i >= n) return;
    dst[i] = f32_to_bf16(src[i]);
}

// narrow to f16: dst = f16(src), nearest even, overflow to +-inf.
// dst: (n) f16 out; src: (n).
extern "C" __global__ void cast_f32_to_f16(f16_t* dst, const float* src, long long n) {
    long long i = global_index();
    if (i >= n) return;
    dst[i] = f32_to_f16(src[i]);
}

// widen from bf16 (exact). dst: (n) f32 out; src: (n) bf16.
extern "C" __global__ void cast_bf16_to_f32(float* dst, const bf16_t* src, long long n) {
    long long i = global_index();
    if (i >= n) return;
    dst[i] = bf16_to_f32(src[i]);
}

// widen from f16 (exact). dst: (n) f32 out; src: (n) f16.
extern "C" __global__ void cast_f16_to_f32(float* dst, const f16_t* src, long long n) {
    long long i = global_index();
    if (i >= n) return;
    dst[i] = f16_to_f32(src[i]);
}

// Mirrors round / round_slice: v = f32(bf16(v)) or f32(f16(v)) in place
// (round = ROUND_BF16 or ROUND_F16; ROUND_NONE leaves v). v: (n) in/out.
extern "C" __global__ void round_inplace(float* v, long long n, int round) {
    long long i = global_index();
    if (i >= n) return;
    v[i] = round_to(v[i], round);
}

// Mirrors copy_rounded: dst = src, rounded. dst: (n) out; src: (n).
extern "C" __global__ void copy_rounded(float* dst, const float* src, long long n, int round) {
    long long i = global_index();
    if (i >= n) return;
    dst[i] = round_to(src[i], round);
}
