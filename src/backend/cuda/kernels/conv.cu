#line 1 "conv.cu"
// Weight layout conversions around cuDNN's NHWC convolutions. The layers
// store a convolution's weight HWIO, (kh, kw, cin, cout): the CPU GEMM's
// right operand (src/ops/conv2d.rs). cuDNN's NHWC filter layout is OHWI,
// (cout, kh, kw, cin). The backend transposes the weight into a workspace
// copy before each cuDNN call, and adds the OHWI weight gradient cuDNN
// writes back into the HWIO gradient (the CPU's wgrad accumulates, so this
// does too). Pure data movement and one f32 add per element: exact.
//
// khw = kh * kw. Launch: one thread per weight element.

//
// Under bf16 the cuDNN convolution is bf16 in and out (fp32 accumulation),
// so the OHWI copy is written in bf16 (exact: the layers hand a weight
// already rounded to bf16) and the OHWI gradient cuDNN writes is bf16,
// widened (exactly) as it is added into the f32 HWIO gradient.

__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_as(bf16_t* p, float v) { *p = f32_to_bf16(v); }

// dst: (cout, khw, cin) out; src: (khw, cin, cout) f32.
template <typename T>
__device__ void hwio_to_ohwi_any(T* dst, const float* src, int khw, int cin, int cout) {
    long long i = global_index();
    long long total = (long long)khw * cin * cout;
    if (i >= total) return;
    long long per_out = (long long)khw * cin;
    int o = (int)(i / per_out);
    long long rem = i % per_out;  // s * cin + ci
    store_as(&dst[i], src[rem * cout + o]);
}

extern "C" __global__ void hwio_to_ohwi(float* dst, const float* src, int khw, int cin,
                                        int cout) {
    hwio_to_ohwi_any(dst, src, khw, cin, cout);
}

extern "C" __global__ void hwio_to_ohwi_bf16(bf16_t* dst, const float* src, int khw, int cin,
                                             int cout) {
    hwio_to_ohwi_any(dst, src, khw, cin, cout);
}

// dst: (khw, cin, cout) f32 in/out, dst += the transpose of src;
// src: (cout, khw, cin) f32 or bf16.
template <typename T>
__device__ void ohwi_add_to_hwio_any(float* dst, const T* src, int khw, int cin, int cout) {
    long long i = global_index();
    long long total = (long long)khw * cin * cout;
    if (i >= total) return;
    int o = (int)(i % cout);
    long long rem = i / cout;  // s * cin + ci
    dst[i] += read_f32(src[(long long)o * khw * cin + rem]);
}

extern "C" __global__ void ohwi_add_to_hwio(float* dst, const float* src, int khw, int cin,
                                            int cout) {
    ohwi_add_to_hwio_any(dst, src, khw, cin, cout);
}

extern "C" __global__ void ohwi_bf16_add_to_hwio(float* dst, const bf16_t* src, int khw,
                                                 int cin, int cout) {
    ohwi_add_to_hwio_any(dst, src, khw, cin, cout);
}
