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

// dst: (cout, khw, cin) f32 out; src: (khw, cin, cout) f32.
extern "C" __global__ void hwio_to_ohwi(float* dst, const float* src, int khw, int cin,
                                        int cout) {
    long long i = global_index();
    long long total = (long long)khw * cin * cout;
    if (i >= total) return;
    long long per_out = (long long)khw * cin;
    int o = (int)(i / per_out);
    long long rem = i % per_out;  // s * cin + ci
    dst[i] = src[rem * cout + o];
}

// dst: (khw, cin, cout) f32 in/out, dst += the transpose of src;
// src: (cout, khw, cin) f32.
extern "C" __global__ void ohwi_add_to_hwio(float* dst, const float* src, int khw, int cin,
                                            int cout) {
    long long i = global_index();
    long long total = (long long)khw * cin * cout;
    if (i >= total) return;
    int o = (int)(i % cout);
    long long rem = i / cout;  // s * cin + ci
    dst[i] += src[(long long)o * khw * cin + rem];
}
