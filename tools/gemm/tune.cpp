// The measuring half of tools/tune-gemm: times every candidate kernel of each dense matmul shape
// on the GPU through ggml's own CUDA backend with Strata's dispatch (patches/0006), checks each
// candidate's result against the default kernel's, and writes the table STRATA_HIPBLASLT_TUNING
// reads (docs/gemm-dispatch.md).
//
//   tune-gemm SHAPES TABLE [--reps N] [--tol T] [--min-speedup S] [--max-workspace BYTES] [--cpu-smoke 1]
//
// SHAPES has one `TYPE M N K` per line (the weight's ggml type name, dst[M, N] = W[K, M]^T X[K, N]).
// Candidates: the backend's default, MMQ for quantized weights, and every algorithm cuBLASLt's
// heuristic returns for the shape. A candidate whose result differs from the default's by more
// than T (max |diff| / max |default|) is rejected; the fastest remaining one is written when it
// beats the default by S. One log line per candidate goes to stdout. `--cpu-smoke 1` runs the
// shapes on the CPU backend with the default candidate only and writes no rows (a check of this
// program where there is no GPU).

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

// Mirrors kernels/cuda/gemm-dispatch.cuh.
struct strata_gemm_desc {
    int32_t device, type_a, type_b, reserved;
    int64_t m, n, k, lda, ldb, ldc, batch;
};
struct strata_gemm_choice {
    int32_t  kind;
    int32_t  algo;
    uint64_t workspace;
};
typedef void (*choose_t)(const strata_gemm_desc *, strata_gemm_choice *);
typedef void (*report_t)(const strata_gemm_desc *, int32_t, int32_t);
typedef void (*register_fn_t)(choose_t, report_t);
typedef bool (*device_t)(int, char *, char *, char *, size_t);
typedef int (*algos_t)(const strata_gemm_desc *, uint64_t);

static strata_gemm_choice g_forced = { 0, 0, 0 };
static int g_reports = 0;
static int g_failed  = 0;

static void choose(const strata_gemm_desc *, strata_gemm_choice * out) {
    *out = g_forced;
}

static void report(const strata_gemm_desc *, int32_t, int32_t outcome) {
    g_reports++;
    if (outcome != 0) {
        g_failed++;
    }
}

// Matmuls per graph: one graph launch is long next to one small product.
static const int COPIES = 8;

struct Candidate {
    std::string name;
    strata_gemm_choice choice;
};

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: tune-gemm SHAPES TABLE [--reps N] [--tol T] [--min-speedup S] [--max-workspace BYTES]\n");
        return 2;
    }
    int reps = 20;
    double tol = 0.02, min_speedup = 1.03;
    uint64_t max_ws = 64ull << 20;
    bool cpu_smoke = false;
    for (int i = 3; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tol")) tol = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--min-speedup")) min_speedup = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--max-workspace")) max_ws = strtoull(argv[i + 1], nullptr, 10);
        else if (!strcmp(argv[i], "--cpu-smoke")) cpu_smoke = atoi(argv[i + 1]) != 0;
        else { fprintf(stderr, "tune-gemm: unknown option %s\n", argv[i]); return 2; }
    }
    // A replayed CUDA graph would keep the first candidate's kernel.
    setenv("GGML_CUDA_DISABLE_GRAPHS", "1", 1);
    ggml_backend_load_all();
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(cpu_smoke ? GGML_BACKEND_DEVICE_TYPE_CPU : GGML_BACKEND_DEVICE_TYPE_GPU);
    if (dev == nullptr) {
        fprintf(stderr, "tune-gemm: no GPU backend was loaded\n");
        return 1;
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto reg_fn    = (register_fn_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cuda_strata_gemm_register");
    auto device_fn = (device_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cuda_strata_gemm_device");
    auto algos_fn  = (algos_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cuda_strata_gemm_algos");
    char arch[64] = "cpu", runtime[64] = "-", blaslt[64] = "-";
    if (!cpu_smoke) {
        if (!reg_fn || !device_fn || !algos_fn) {
            fprintf(stderr, "tune-gemm: the GPU backend has no Strata GEMM dispatch (patches/0006)\n");
            return 1;
        }
        if (!device_fn(0, arch, runtime, blaslt, sizeof(arch))) {
            fprintf(stderr, "tune-gemm: device 0 did not describe itself\n");
            return 1;
        }
        reg_fn(choose, report);
    }
    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    printf("device %s: arch %s runtime %s blaslt %s\n", ggml_backend_dev_description(dev), arch, runtime, blaslt);

    std::ifstream shapes(argv[1]);
    if (!shapes) {
        fprintf(stderr, "tune-gemm: cannot read %s\n", argv[1]);
        return 1;
    }
    std::ostringstream table;
    table << "strata-gemm-table 1\nvalidator arch " << arch << "\nvalidator runtime " << runtime << "\nvalidator blaslt " << blaslt
          << "\n# type_a type_b m n k lda ldb ldc choice algo workspace speedup\n";
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::string line;
    int rows = 0;
    while (std::getline(shapes, line)) {
        std::istringstream ls(line);
        std::string tname;
        int64_t m, n, k;
        if (line.empty() || line[0] == '#' || !(ls >> tname >> m >> n >> k)) {
            continue;
        }
        ggml_type type = GGML_TYPE_COUNT;
        for (int t = 0; t < GGML_TYPE_COUNT; t++) {
            const char * nm = ggml_type_name((ggml_type) t);
            if (nm && tname == nm) {
                type = (ggml_type) t;
            }
        }
        if (type == GGML_TYPE_COUNT || k % ggml_blck_size(type) != 0) {
            printf("%s %lld %lld %lld: skipped (unknown type or k not a multiple of its block)\n", tname.c_str(), (long long) m, (long long) n, (long long) k);
            continue;
        }
        ggml_init_params ip = { ggml_tensor_overhead() * (COPIES + 4) + ggml_graph_overhead(), nullptr, true };
        ggml_context * ctx = ggml_init(ip);
        ggml_tensor * w = ggml_new_tensor_2d(ctx, type, k, m);
        ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
        ggml_cgraph * gf = ggml_new_graph(ctx);
        std::vector<ggml_tensor *> outs;
        for (int c = 0; c < COPIES; c++) {
            outs.push_back(ggml_mul_mat(ctx, w, x));
            ggml_build_forward_expand(gf, outs.back());
        }
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        std::vector<float> wf(k * m), xf(k * n);
        for (auto & v : wf) v = normal(rng) / std::sqrt((float) k);
        for (auto & v : xf) v = normal(rng);
        std::vector<uint8_t> wq(ggml_nbytes(w));
        std::vector<float> imatrix(k, 1.0f);
        ggml_quantize_chunk(type, wf.data(), wq.data(), 0, m, k, ggml_quantize_requires_imatrix(type) ? imatrix.data() : nullptr);
        ggml_backend_tensor_set(w, wq.data(), 0, wq.size());
        ggml_backend_tensor_set(x, xf.data(), 0, xf.size() * sizeof(float));

        strata_gemm_desc d = { 0, (int32_t) type, GGML_TYPE_F32, 0, m, n, k, k, k, m, 1 };
        std::vector<Candidate> cands = { { "default", { 0, 0, 0 } } };
        if (ggml_is_quantized(type) && !cpu_smoke) {
            cands.push_back({ "mmq", { 1, 0, 0 } });
        }
        const int n_algos = cpu_smoke ? 0 : algos_fn(&d, max_ws);
        for (int a = 0; a < n_algos; a++) {
            cands.push_back({ "blaslt " + std::to_string(a), { 2, a, max_ws } });
        }
        std::vector<float> ref(m * n), got(m * n);
        double t_default = 0, best_t = 0;
        const Candidate * best = nullptr;
        for (const Candidate & c : cands) {
            g_forced = c.choice;
            g_reports = g_failed = 0;
            ggml_backend_graph_compute(backend, gf);
            ggml_backend_synchronize(backend);
            if (c.choice.kind != 0 && (g_reports == 0 || g_failed > 0)) {
                printf("%s %lld %lld %lld %s: did not run (fell back)\n", tname.c_str(), (long long) m, (long long) n, (long long) k, c.name.c_str());
                continue;
            }
            ggml_backend_tensor_get(outs[0], got.data(), 0, got.size() * sizeof(float));
            std::vector<double> ts;
            for (int r = 0; r < reps; r++) {
                auto t0 = std::chrono::steady_clock::now();
                ggml_backend_graph_compute(backend, gf);
                ggml_backend_synchronize(backend);
                ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / COPIES);
            }
            const double t = median(ts);
            double err = 0, scale = 0;
            if (c.choice.kind == 0) {
                ref = got;
                t_default = t;
            } else {
                for (size_t i = 0; i < got.size(); i++) {
                    err = std::max(err, (double) std::fabs(got[i] - ref[i]));
                    scale = std::max(scale, (double) std::fabs(ref[i]));
                }
                err /= std::max(scale, 1e-30);
            }
            const bool ok = c.choice.kind == 0 || (std::isfinite(err) && err <= tol);
            printf("%s %lld %lld %lld %s: %.2f us, %.1f TFLOP/s, rel err %.2e%s\n", tname.c_str(), (long long) m, (long long) n, (long long) k,
                   c.name.c_str(), t * 1e6, 2.0 * m * n * k / t / 1e12, err, ok ? "" : " (rejected)");
            if (ok && c.choice.kind != 0 && (best == nullptr || t < best_t)) {
                best = &c;
                best_t = t;
            }
        }
        if (best != nullptr && t_default / best_t >= min_speedup) {
            char row[256];
            snprintf(row, sizeof(row), "%s f32 %lld %lld %lld %lld %lld %lld %s %s %llu %.3f\n", tname.c_str(), (long long) m, (long long) n,
                     (long long) k, (long long) k, (long long) k, (long long) m, best->choice.kind == 1 ? "mmq" : "blaslt",
                     best->choice.kind == 1 ? "-" : std::to_string(best->choice.algo).c_str(),
                     (unsigned long long) (best->choice.kind == 1 ? 0 : best->choice.workspace), t_default / best_t);
            table << row;
            rows++;
            printf("%s %lld %lld %lld: %s, %.3fx the default\n", tname.c_str(), (long long) m, (long long) n, (long long) k, best->name.c_str(), t_default / best_t);
        } else {
            printf("%s %lld %lld %lld: the default stays\n", tname.c_str(), (long long) m, (long long) n, (long long) k);
        }
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
    std::ofstream(argv[2]) << table.str();
    printf("%d rows written to %s\n", rows, argv[2]);
    ggml_backend_free(backend);
    return 0;
}
