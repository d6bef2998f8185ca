// Experts read through tables of pointers (ggml_expert_table) whose entries for some experts
// point into mapped host memory: a decode step's selected ones can be staged into VRAM first, by
// one kernel with wide loads over every selected expert's bytes at once, instead of the vector
// kernels reading them row by row over the bus. The weight tensor names that host range in
// op_params[6..9] (low and high device address); without it nothing is staged.
//
// The kernel lists the distinct selected experts whose entry lies in the range (every block, a
// few dozen ids), block 0 writes per-call copies of the tables with those entries pointing at
// their staging slots, and all blocks copy. The shared tables are not written: the application
// rewrites them between steps.

static inline bool ggml_expert_table_host_range(const ggml_tensor * t, uintptr_t * lo, uintptr_t * hi) {
    uint64_t a;
    uint64_t b;
    memcpy(&a, &t->op_params[6], sizeof(a));
    memcpy(&b, &t->op_params[8], sizeof(b));
    *lo = (uintptr_t) a;
    *hi = (uintptr_t) b;
    return a < b;
}

static constexpr int GGML_CUDA_STAGE_MAX_IDS = 64;

static __global__ void ggml_cuda_stage_table_experts(const int32_t * ids, int n_per_col, int n_cols, int64_t ids_s1,
                                                     const void * const * tab_a, const void * const * tab_b, const void ** out_a,
                                                     const void ** out_b, int n_expert, size_t bytes, uintptr_t lo, uintptr_t hi, char * stage) {
    __shared__ int list[GGML_CUDA_STAGE_MAX_IDS];
    __shared__ int count;
    if (threadIdx.x == 0) {
        int c = 0;
        for (int t = 0; t < n_cols; ++t) {
            for (int k = 0; k < n_per_col; ++k) {
                const int e = ids[t * ids_s1 + k];
                if (e < 0 || e >= n_expert) {
                    continue;
                }
                const uintptr_t p = (uintptr_t) tab_a[e];
                // (unaligned entries stay where they are: the vector kernels read them in place)
                if (p < lo || p >= hi || (p & 15) != 0 || (tab_b && ((uintptr_t) tab_b[e] & 15) != 0)) {
                    continue;
                }
                bool seen = false;
                for (int j = 0; j < c; ++j) {
                    seen |= list[j] == e;
                }
                if (!seen && c < GGML_CUDA_STAGE_MAX_IDS) {
                    list[c++] = e;
                }
            }
        }
        count = c;
    }
    __syncthreads();
    const int c = count;
    if (blockIdx.x == 0) {
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            out_a[e] = tab_a[e];
            if (out_b) {
                out_b[e] = tab_b[e];
            }
        }
        __syncthreads();
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            out_a[list[j]] = stage + (size_t) j * bytes;
            if (out_b) {
                out_b[list[j]] = stage + (size_t) (c + j) * bytes;
            }
        }
    }
    // 16-byte units of slot q: expert list[q % c] of matrix a (q < c) or b
    const size_t units = bytes / 16;
    const size_t total = (size_t) c * (out_b ? 2 : 1) * units;
    for (size_t u = (size_t) blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (size_t) gridDim.x * blockDim.x) {
        const size_t q   = u / units;
        const size_t off = u % units;
        const int    e   = list[q % c];
        const int4 * from = (const int4 *) (q < (size_t) c ? tab_a[e] : tab_b[e]) + off;
        ((int4 *) (stage + q * bytes))[off] = *from;
    }
}

// Stages the host-resident experts that `ids` select from src0's table (and the fused gate's),
// and points fusion's tables at per-call copies. Needs 16-byte multiples; otherwise a no-op.
static void ggml_cuda_stage_table_experts_for(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * gate,
                                              const ggml_tensor * ids, ggml_cuda_mm_fusion_args_device & fusion,
                                              ggml_cuda_pool_alloc<char> & stage, ggml_cuda_pool_alloc<const void *> & tables) {
    uintptr_t lo;
    uintptr_t hi;
    if (fusion.x_table == nullptr || !ggml_expert_table_host_range(src0, &lo, &hi)) {
        return;
    }
    const size_t bytes  = src0->nb[2];
    const int    n_ids  = (int) (ids->ne[0] * ids->ne[1]);
    const int    n_mats = fusion.gate_table ? 2 : 1;
    if (bytes % 16 != 0 || n_ids > GGML_CUDA_STAGE_MAX_IDS || (gate && gate->nb[2] != bytes)) {
        return;
    }
    const int n_expert = (int) src0->ne[2];
    const size_t slots = (size_t) std::min(n_ids, n_expert);
    char *        st = stage.alloc(ctx.pool(), slots * n_mats * bytes);
    const void ** tb = tables.alloc(ctx.pool(), (size_t) n_expert * n_mats);
    const size_t  units = slots * n_mats * (bytes / 16);
    const int     blocks = (int) std::min<size_t>((units + 255) / 256, 4096);
    ggml_cuda_stage_table_experts<<<blocks, 256, 0, ctx.stream()>>>(
        (const int32_t *) ids->data, (int) ids->ne[0], (int) ids->ne[1], (int64_t) (ids->nb[1] / sizeof(int32_t)), fusion.x_table,
        fusion.gate_table, tb, n_mats == 2 ? tb + n_expert : nullptr, n_expert, bytes, lo, hi, st);
    CUDA_CHECK(cudaGetLastError());
    fusion.x_table    = tb;
    fusion.gate_table = n_mats == 2 ? tb + n_expert : nullptr;
}
