// Calibrated GEMM dispatch: before ggml_cuda_mul_mat picks its kernel for a dense matmul, an
// application-registered chooser (Strata's table, STRATA_HIPBLASLT_TUNING) may ask for MMQ or
// for one cuBLASLt algorithm (hipBLASLt on HIP; by its index in the heuristic's list for that
// shape) with a workspace. Whatever does not apply (a layout BLASLt cannot take, an index the
// heuristic no longer returns, a library error) falls back to the backend's own choice and is
// reported.
// Proc addresses: ggml_backend_cuda_strata_gemm_register, ggml_backend_cuda_strata_gemm_device,
// ggml_backend_cuda_strata_gemm_algos.

#include <mutex>
#include <unordered_map>

#if defined(GGML_USE_HIP) && defined(STRATA_USE_HIPBLASLT)
#define STRATA_HAVE_BLASLT 1
#include <hipblaslt/hipblaslt.h>
// hipBLASLt mirrors cuBLASLt's calls; ggml's vendors/hip.h maps the enums and status codes.
#define cublasLtHandle_t                     hipblasLtHandle_t
#define cublasLtMatmulDesc_t                 hipblasLtMatmulDesc_t
#define cublasLtMatrixLayout_t               hipblasLtMatrixLayout_t
#define cublasLtMatmulPreference_t           hipblasLtMatmulPreference_t
#define cublasLtMatmulHeuristicResult_t      hipblasLtMatmulHeuristicResult_t
#define cublasLtCreate                       hipblasLtCreate
#define cublasLtMatmulDescCreate             hipblasLtMatmulDescCreate
#define cublasLtMatmulDescSetAttribute       hipblasLtMatmulDescSetAttribute
#define cublasLtMatrixLayoutCreate           hipblasLtMatrixLayoutCreate
#define cublasLtMatmulPreferenceCreate       hipblasLtMatmulPreferenceCreate
#define cublasLtMatmulPreferenceSetAttribute hipblasLtMatmulPreferenceSetAttribute
#define cublasLtMatmulPreferenceDestroy      hipblasLtMatmulPreferenceDestroy
#define cublasLtMatmulAlgoGetHeuristic       hipblasLtMatmulAlgoGetHeuristic
#define cublasLtMatmul                       hipblasLtMatmul
#define CUBLASLT_MATMUL_DESC_TRANSA          HIPBLASLT_MATMUL_DESC_TRANSA
#define CUBLASLT_MATMUL_DESC_TRANSB          HIPBLASLT_MATMUL_DESC_TRANSB
#define CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
// hipBLASLt takes hipDataType and hipblasComputeType_t, which vendors/hip.h maps only from HIP 6.5
#define STRATA_LT_COMPUTE_32F HIPBLAS_COMPUTE_32F
#define STRATA_LT_R_16F       HIP_R_16F
#define STRATA_LT_R_32F       HIP_R_32F
#elif !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
#define STRATA_HAVE_BLASLT 1
#include <cublasLt.h>
#define STRATA_LT_COMPUTE_32F CUBLAS_COMPUTE_32F
#define STRATA_LT_R_16F       CUDA_R_16F
#define STRATA_LT_R_32F       CUDA_R_32F
#endif

// dst[m, n] = src0[k, m]^T src1[k, n]: ggml's rows of k elements; leading dimensions in elements.
struct strata_gemm_desc {
    int32_t device;
    int32_t type_a;
    int32_t type_b;
    int32_t reserved;
    int64_t m, n, k;
    int64_t lda, ldb, ldc;
    int64_t batch;
};

enum { STRATA_GEMM_DEFAULT = 0, STRATA_GEMM_MMQ = 1, STRATA_GEMM_BLASLT = 2 };

struct strata_gemm_choice {
    int32_t  kind;
    int32_t  algo;
    uint64_t workspace;
};

// Outcomes reported for a tuned choice.
enum {
    STRATA_GEMM_TAKEN       = 0,
    STRATA_GEMM_FAIL_LAYOUT = 1, // strides, batch or types BLASLt cannot take here
    STRATA_GEMM_FAIL_ALGO   = 2, // the heuristic returns fewer algorithms for this shape now
    STRATA_GEMM_FAIL_LIB    = 3, // the library refused the call
    STRATA_GEMM_FAIL_TYPE   = 4, // MMQ has no kernel for this type, or no BLASLt in this build
};

typedef void (*strata_gemm_choose_t)(const strata_gemm_desc * desc, strata_gemm_choice * out);
typedef void (*strata_gemm_report_t)(const strata_gemm_desc * desc, int32_t kind, int32_t outcome);

static strata_gemm_choose_t strata_gemm_chooser  = nullptr;
static strata_gemm_report_t strata_gemm_reporter = nullptr;

static void ggml_backend_cuda_strata_gemm_register(strata_gemm_choose_t choose, strata_gemm_report_t report) {
    strata_gemm_chooser  = choose;
    strata_gemm_reporter = report;
}

static strata_gemm_desc strata_gemm_describe(int device, const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * dst) {
    strata_gemm_desc d = {};
    d.device = device;
    d.type_a = src0->type;
    d.type_b = src1->type;
    d.m      = src0->ne[1];
    d.n      = src1->ne[1];
    d.k      = src0->ne[0];
    d.lda    = (int64_t) (src0->nb[1] / ggml_type_size(src0->type)) * ggml_blck_size(src0->type);
    d.ldb    = (int64_t) (src1->nb[1] / ggml_type_size(src1->type)) * ggml_blck_size(src1->type);
    d.ldc    = (int64_t) (dst->nb[1] / ggml_type_size(dst->type));
    d.batch  = std::max(src0->ne[2] * src0->ne[3], src1->ne[2] * src1->ne[3]);
    return d;
}

#ifdef STRATA_HAVE_BLASLT

// Most algorithms asked of the heuristic per shape; a table's index is into this list.
#define STRATA_GEMM_MAX_ALGOS 32

// The descriptors and heuristic results of one shape and workspace limit.
struct strata_blaslt_plan {
    cublasLtMatmulDesc_t             op = nullptr;
    cublasLtMatrixLayout_t           a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulHeuristicResult_t  algos[STRATA_GEMM_MAX_ALGOS];
    int                              n_algos = 0;
};

static std::mutex strata_blaslt_mutex;
static cublasLtHandle_t strata_blaslt_handles[GGML_CUDA_MAX_DEVICES] = {};
static std::unordered_map<std::string, strata_blaslt_plan *> strata_blaslt_plans;

static cublasLtHandle_t strata_blaslt_handle(int device) {
    if (strata_blaslt_handles[device] == nullptr && cublasLtCreate(&strata_blaslt_handles[device]) != CUBLAS_STATUS_SUCCESS) {
        strata_blaslt_handles[device] = nullptr;
    }
    return strata_blaslt_handles[device];
}

// The plan for a contiguous f16 x f16 -> f32 product of this shape (A is src0 converted to f16,
// so its leading dimension is k), or nullptr when the library has none. Plans live as long as the
// process: there is one per tuned shape.
static strata_blaslt_plan * strata_blaslt_plan_for(const strata_gemm_desc & d, uint64_t workspace) {
    char key[160];
    snprintf(key, sizeof(key), "%d:%lld:%lld:%lld:%lld:%llu", d.device, (long long) d.m, (long long) d.n, (long long) d.k,
             (long long) d.ldc, (unsigned long long) workspace);
    std::lock_guard<std::mutex> lock(strata_blaslt_mutex);
    auto it = strata_blaslt_plans.find(key);
    if (it != strata_blaslt_plans.end()) {
        return it->second;
    }
    cublasLtHandle_t lt = strata_blaslt_handle(d.device);
    strata_blaslt_plan * p = nullptr;
    if (lt != nullptr) {
        p = new strata_blaslt_plan();
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        cublasLtMatmulPreference_t pref = nullptr;
        bool ok = cublasLtMatmulDescCreate(&p->op, STRATA_LT_COMPUTE_32F, STRATA_LT_R_32F) == CUBLAS_STATUS_SUCCESS
            && cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) == CUBLAS_STATUS_SUCCESS
            && cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) == CUBLAS_STATUS_SUCCESS
            && cublasLtMatrixLayoutCreate(&p->a, STRATA_LT_R_16F, d.k, d.m, d.k) == CUBLAS_STATUS_SUCCESS
            && cublasLtMatrixLayoutCreate(&p->b, STRATA_LT_R_16F, d.k, d.n, d.k) == CUBLAS_STATUS_SUCCESS
            && cublasLtMatrixLayoutCreate(&p->c, STRATA_LT_R_32F, d.m, d.n, d.ldc) == CUBLAS_STATUS_SUCCESS
            && cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS;
        if (ok) {
            const uint64_t ws = workspace;
            ok = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)) == CUBLAS_STATUS_SUCCESS;
#ifndef GGML_USE_HIP
            // ggml's buffers and pool give 128-byte alignment; the heuristic assumes 256 unless told
            const uint32_t align = 128;
            ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS
                && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS
                && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS
                && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS;
#endif
            ok = ok && cublasLtMatmulAlgoGetHeuristic(lt, p->op, p->a, p->b, p->c, p->c, pref, STRATA_GEMM_MAX_ALGOS, p->algos, &p->n_algos)
                == CUBLAS_STATUS_SUCCESS;
        }
        if (pref != nullptr) {
            cublasLtMatmulPreferenceDestroy(pref);
        }
        if (!ok) {
            p->n_algos = 0;
        }
    }
    strata_blaslt_plans[key] = p;
    return p;
}

// Runs the product with algorithm `algo` of the shape's heuristic list; false (and why in
// *outcome) when it cannot, having written nothing the default path does not overwrite.
static bool strata_blaslt_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst,
                                  const strata_gemm_desc & d, int algo, uint64_t workspace, int32_t * outcome) {
    if (d.batch != 1 || !ggml_is_contiguous(src0) || !ggml_is_contiguous(src1) || !ggml_is_contiguous(dst)
            || src1->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32) {
        *outcome = STRATA_GEMM_FAIL_LAYOUT;
        return false;
    }
    const to_fp16_cuda_t to_a = src0->type == GGML_TYPE_F16 ? nullptr : ggml_get_to_fp16_cuda(src0->type);
    const to_fp16_cuda_t to_b = ggml_get_to_fp16_cuda(GGML_TYPE_F32);
    if ((src0->type != GGML_TYPE_F16 && to_a == nullptr) || to_b == nullptr) {
        *outcome = STRATA_GEMM_FAIL_TYPE;
        return false;
    }
    strata_blaslt_plan * p = strata_blaslt_plan_for(d, workspace);
    if (p == nullptr || algo < 0 || algo >= p->n_algos) {
        *outcome = STRATA_GEMM_FAIL_ALGO;
        return false;
    }
    cudaStream_t stream = ctx.stream();
    ggml_cuda_pool_alloc<half> a_alloc(ctx.pool());
    ggml_cuda_pool_alloc<half> b_alloc(ctx.pool());
    ggml_cuda_pool_alloc<char> ws_alloc(ctx.pool());
    const half * a = (const half *) src0->data;
    if (to_a != nullptr) {
        to_a(src0->data, a_alloc.alloc(ggml_nelements(src0)), ggml_nelements(src0), stream);
        a = a_alloc.get();
    }
    to_b(src1->data, b_alloc.alloc(ggml_nelements(src1)), ggml_nelements(src1), stream);
    void * ws = workspace > 0 ? ws_alloc.alloc(workspace) : nullptr;
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t st = cublasLtMatmul(strata_blaslt_handle(d.device), p->op, &alpha, a, p->a, b_alloc.get(), p->b, &beta,
                                             dst->data, p->c, dst->data, p->c, &p->algos[algo].algo, ws, workspace, stream);
    if (st != CUBLAS_STATUS_SUCCESS) {
        *outcome = STRATA_GEMM_FAIL_LIB;
        return false;
    }
    return true;
}

#endif // STRATA_HAVE_BLASLT

// How many algorithms the heuristic returns for this shape within `workspace` bytes (the
// tuner's candidates); 0 without BLASLt.
static int ggml_backend_cuda_strata_gemm_algos(const strata_gemm_desc * d, uint64_t workspace) {
#ifdef STRATA_HAVE_BLASLT
    if (d == nullptr || d->device < 0 || d->device >= ggml_cuda_info().device_count) {
        return 0;
    }
    ggml_cuda_set_device(d->device);
    const strata_blaslt_plan * p = strata_blaslt_plan_for(*d, workspace);
    return p == nullptr ? 0 : p->n_algos;
#else
    GGML_UNUSED(d);
    GGML_UNUSED(workspace);
    return 0;
#endif
}

// What a table's validators compare: the device's architecture, the runtime's version and the
// BLASLt library's ("-" without one). False for a device that does not exist.
static bool ggml_backend_cuda_strata_gemm_device(int device, char * arch, char * runtime, char * blaslt, size_t len) {
    if (device < 0 || device >= ggml_cuda_info().device_count || len == 0) {
        return false;
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        (void) cudaGetLastError();
        return false;
    }
    int rt = 0;
#if defined(GGML_USE_HIP)
    (void) hipRuntimeGetVersion(&rt);
#else
    (void) cudaRuntimeGetVersion(&rt);
#endif
#if defined(GGML_USE_HIP)
    snprintf(arch, len, "%s", prop.gcnArchName);
#else
    snprintf(arch, len, "sm_%d%d", prop.major, prop.minor);
#endif
    snprintf(runtime, len, "%d", rt);
#if defined(STRATA_HAVE_BLASLT) && defined(GGML_USE_HIP)
    // hipBLASLt tells its version through a handle
    int lt_version = 0;
    ggml_cuda_set_device(device);
    std::lock_guard<std::mutex> lock(strata_blaslt_mutex);
    hipblasLtHandle_t lt = strata_blaslt_handle(device);
    if (lt != nullptr && hipblasLtGetVersion(lt, &lt_version) == HIPBLAS_STATUS_SUCCESS) {
        snprintf(blaslt, len, "%d", lt_version);
    } else {
        snprintf(blaslt, len, "-");
    }
#elif defined(STRATA_HAVE_BLASLT)
    snprintf(blaslt, len, "%zu", cublasLtGetVersion());
#else
    snprintf(blaslt, len, "-");
#endif
    return true;
}

// Called by ggml_cuda_mul_mat for a dense f32-output product; true when the registered chooser's
// choice ran, false to let the backend choose.
static bool strata_gemm_dispatch(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst) {
    if (strata_gemm_chooser == nullptr) {
        return false;
    }
    const strata_gemm_desc d = strata_gemm_describe(ctx.device, src0, src1, dst);
    strata_gemm_choice c = { STRATA_GEMM_DEFAULT, 0, 0 };
    strata_gemm_chooser(&d, &c);
    int32_t outcome = STRATA_GEMM_FAIL_TYPE;
    bool done = false;
    if (c.kind == STRATA_GEMM_MMQ) {
        const int cc = ggml_cuda_info().devices[ctx.device].cc;
        if (ggml_is_quantized(src0->type) && ggml_cuda_should_use_mmq(src0->type, cc, 1, 0)) {
            ggml_cuda_mul_mat_q(ctx, src0, src1, nullptr, dst);
            done = true;
        }
    } else if (c.kind == STRATA_GEMM_BLASLT) {
#ifdef STRATA_HAVE_BLASLT
        done = strata_blaslt_mul_mat(ctx, src0, src1, dst, d, c.algo, c.workspace, &outcome);
#endif
    } else {
        return false;
    }
    if (strata_gemm_reporter != nullptr) {
        strata_gemm_reporter(&d, c.kind, done ? STRATA_GEMM_TAKEN : outcome);
    }
    return done;
}
