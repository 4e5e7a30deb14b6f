// The one door to oneDNN (Debian's libdnnl-dev, 2.x C API), compiled only
// with the `onednn` cargo feature. One call: a strided f32 GEMM
//   C (m, n, row stride ldc) [+]= A (m, k) · B (k, n)
// with f32 storage throughout. With `bf16` set, oneDNN may compute in bf16
// with f32 accumulation (fpmath mode bf16: AMX or AVX512-BF16 on CPUs that
// have them). memfit only asks for that when both operands already hold
// bf16-representable values, so the down-conversion is exact and the result
// is the one a bf16 GEMM with f32 accumulation gives.
//
// Primitive creation goes through oneDNN's own primitive cache, so a shape
// seen before costs a cache lookup, not a JIT compilation.
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <stdint.h>
#include <stddef.h>

static dnnl_engine_t engine;
static dnnl_stream_t stream;

int memfit_dnnl_init(int threads) {
    if (threads > 0) omp_set_num_threads(threads);
    if (engine) return 0;
    // oneDNN 2.x keeps AMX behind an opt-in; ask for it (it falls back to
    // the best ISA the CPU has when AMX is absent).
    dnnl_set_max_cpu_isa(dnnl_cpu_isa_avx512_core_amx);
    if (dnnl_engine_create(&engine, dnnl_cpu, 0) != dnnl_success) return 1;
    if (dnnl_stream_create(&stream, engine, dnnl_stream_default_flags) != dnnl_success) return 2;
    return 0;
}

// Returns 0 on success, else a dnnl_status_t (+100 to keep 0 unambiguous).
// `bf16`: A and B hold bf16 values (uint16_t), else f32.
int memfit_dnnl_gemm(int64_t m, int64_t n, int64_t k,
                     const void *a, int64_t a_rs, int64_t a_cs,
                     const void *b, int64_t b_rs, int64_t b_cs,
                     float *c, int64_t ldc, int accumulate, int bf16,
                     const char **impl) {
    dnnl_data_type_t in_dt = bf16 ? dnnl_bf16 : dnnl_f32;
    dnnl_status_t st;
    dnnl_memory_desc_t a_md, b_md, c_md;
    dnnl_dims_t a_dims = {m, k}, a_str = {a_rs, a_cs};
    dnnl_dims_t b_dims = {k, n}, b_str = {b_rs, b_cs};
    dnnl_dims_t c_dims = {m, n}, c_str = {ldc, 1};
    if ((st = dnnl_memory_desc_init_by_strides(&a_md, 2, a_dims, in_dt, a_str))) return 100 + st;
    if ((st = dnnl_memory_desc_init_by_strides(&b_md, 2, b_dims, in_dt, b_str))) return 100 + st;
    if ((st = dnnl_memory_desc_init_by_strides(&c_md, 2, c_dims, dnnl_f32, c_str))) return 100 + st;
    dnnl_matmul_desc_t desc;
    if ((st = dnnl_matmul_desc_init(&desc, &a_md, &b_md, NULL, &c_md))) return 100 + st;

    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t ops = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t prim = NULL;
    dnnl_memory_t am = NULL, bm = NULL, cm = NULL;
    int rc = 0;
#define TRY(x) do { if ((st = (x)) != dnnl_success) { rc = 100 + st; goto done; } } while (0)
    TRY(dnnl_primitive_attr_create(&attr));
    if (accumulate) {
        TRY(dnnl_post_ops_create(&ops));
        TRY(dnnl_post_ops_append_sum(ops, 1.0f));
        TRY(dnnl_primitive_attr_set_post_ops(attr, ops));
    }
    TRY(dnnl_primitive_desc_create(&pd, &desc, attr, engine, NULL));
    if (impl) dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, impl);
    TRY(dnnl_primitive_create(&prim, pd));
    TRY(dnnl_memory_create(&am, &a_md, engine, (void *)a));
    TRY(dnnl_memory_create(&bm, &b_md, engine, (void *)b));
    TRY(dnnl_memory_create(&cm, &c_md, engine, c));
    dnnl_exec_arg_t args[3] = {
        {DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
    TRY(dnnl_primitive_execute(prim, stream, 3, args));
    TRY(dnnl_stream_wait(stream));
done:
    if (am) dnnl_memory_destroy(am);
    if (bm) dnnl_memory_destroy(bm);
    if (cm) dnnl_memory_destroy(cm);
    if (prim) dnnl_primitive_destroy(prim);
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (ops) dnnl_post_ops_destroy(ops);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return rc;
#undef TRY
}
