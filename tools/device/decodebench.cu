// How a decode step can reach the cold experts of a tiered MoE layer without leaving the GPU's
// stream, measured on the device for the synthetic 80B-A3B (IQ3_XXS experts: gate and up 512
// rows of 784 bytes, down 2048 rows of 196 bytes, 1,204,224 bytes in all). Decides the decode
// mechanism (docs/expert-tiers.md, "Zero-copy decode").
//
//   nvcc -O2 -std=c++17 -arch=sm_90 tools/device/decodebench.cu -lcuda -o decodebench && ./decodebench
//
// (a) zero-copy: a kernel shaped like CUDA's MMVQ (a block per row pair, 16-byte loads along the
//     row) reads k experts' rows from page-locked host memory over the bus, against the same
//     from VRAM; per layer, and per token over 48 layers as one CUDA graph.
// (b) a flag in mapped memory: the GPU writes "ready", a CPU thread spinning on it answers
//     "done", and a one-thread kernel spinning on that flag holds the stream: the hand-off a CPU
//     worker computing the cold experts would cost per layer, without the CPU's own work.
// (c) today's split: per layer the stream is synchronised, 8 KiB (the hidden state) go to the
//     host and back, and the next kernel is launched.
// (d) the zero-copy layer's extra small kernels (routing copy, id remaps, the add, the log copy):
//     the per-token graph of (a) with E tiny kernels more per layer, so the cost of one small
//     kernel inside a CUDA graph decides whether merging the two tiers' mul_mat_id is worth it.
// (e) one tensor for both tiers: a virtual range mapping VRAM for the hot experts and then host
//     memory from cuMemCreate on the host's NUMA node for the cold ones, so one kernel over the
//     routing's own slots reads either and a decode layer needs no second mul_mat_id, remap or
//     add. Says whether the driver allows it (and host access to the cold part, to fill it in
//     place), the per-layer read costs through it, and the per-token graph with one set of
//     kernels per layer against (a)'s two.
// (f) the workers inside the step (host ops answered through a mailbox; the mechanism was
//     removed, see docs/lab.md): per layer the launch's copies (8 KiB and 32 bytes to the host)
//     and post, not waited for; the hot experts (8 read from VRAM, as in (a)); the join's copy
//     (4 bytes), post and wait; its result (n_embd x n_used f32, 64 KiB) back and an add. A host
//     thread answers the posts in order and, for each join, spins until W us after its launch
//     (the workers' arithmetic); one CUDA graph of 48 layers, against the hot reads alone, for
//     W = 0, 15 and 40.
// (g) staged (the mechanism was removed, see docs/lab.md): per layer one wide-load kernel
//     copies the k cold experts' gate and up from host memory into VRAM, (a)'s kernels read them
//     there, then the same for down; per layer against (a)'s reads over the bus, and per token as
//     (a)'s graph.
// (h) the routing log: per layer the step's 8 expert ids copied into page-locked host memory that
//     the device maps, as a 32-byte memcpy node (ggml-cuda's i32 to i32 copy) against a kernel
//     converting them to f32 there; the per-token graph of 48 layers of 8 reads from VRAM with
//     each, against none.
// Prints one JSON object per measurement.
#include "bench.cuh"

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

static const int LAYERS = 48;
static const int N_EXPERT = 512;
static const size_t GATE_ROWS = 512, GATE_ROW = 784, DOWN_ROWS = 2048, DOWN_ROW = 196;
static const size_t EXPERT = 2 * GATE_ROWS * GATE_ROW + DOWN_ROWS * DOWN_ROW;

// Reads rows [2 per block] of the experts ids[blockIdx.y]; one partial sum per row written.
__global__ void read_rows(const unsigned char * base, size_t expert_stride, size_t mat_offset, size_t row_bytes,
                          int rows, const int * ids, float * out) {
    const int row = blockIdx.x * 2 + threadIdx.y;
    if (row >= rows) {
        return;
    }
    const unsigned char * r = base + size_t(ids[blockIdx.y]) * expert_stride + mat_offset + size_t(row) * row_bytes;
    unsigned acc = 0;
    for (size_t i = threadIdx.x * 4; i + 4 <= row_bytes; i += 32 * 4) {
        acc += *(const unsigned *) (r + i);
    }
    for (int o = 16; o > 0; o >>= 1) {
        acc += __shfl_xor_sync(0xffffffff, acc, o);
    }
    if (threadIdx.x == 0) {
        out[blockIdx.y * rows + row] = float(acc);
    }
}

// Copies bytes at offset off of each of the k experts ids[0..k) from base into consecutive slots
// of stage, 16 bytes a load, every block at once.
__global__ void stage_copy(const unsigned char * base, const int * ids, int k, size_t off, size_t bytes, unsigned char * stage) {
    const size_t units = bytes / 16;
    for (size_t u = (size_t) blockIdx.x * blockDim.x + threadIdx.x; u < k * units; u += (size_t) gridDim.x * blockDim.x) {
        const size_t q = u / units;
        ((int4 *) (stage + q * bytes))[u % units] = ((const int4 *) (base + size_t(ids[q]) * EXPERT + off))[u % units];
    }
}

// (g): the k experts' gate and up staged, read from VRAM, then their down the same way.
static void staged_layer(const unsigned char * host, const int * ids, int k, const int * slots, unsigned char * stage, float * out,
                         cudaStream_t s) {
    const size_t gu = 2 * GATE_ROWS * GATE_ROW, down = DOWN_ROWS * DOWN_ROW;
    const int blocks_gu = (int) std::min<size_t>((k * gu / 16 + 255) / 256, 4096);
    const int blocks_d  = (int) std::min<size_t>((k * down / 16 + 255) / 256, 4096);
    dim3 block(32, 2);
    stage_copy<<<blocks_gu, 256, 0, s>>>(host, ids, k, 0, gu, stage);
    read_rows<<<dim3(GATE_ROWS / 2, k), block, 0, s>>>(stage, gu, 0, GATE_ROW, GATE_ROWS, slots, out);
    read_rows<<<dim3(GATE_ROWS / 2, k), block, 0, s>>>(stage, gu, GATE_ROWS * GATE_ROW, GATE_ROW, GATE_ROWS, slots, out);
    stage_copy<<<blocks_d, 256, 0, s>>>(host, ids, k, gu, down, stage + 8 * gu);
    read_rows<<<dim3(DOWN_ROWS / 2, k), block, 0, s>>>(stage + 8 * gu, down, 0, DOWN_ROW, DOWN_ROWS, slots, out);
}

// One layer's expert reads for the experts in ids (k of them): gate, up, down.
static void layer_reads(const unsigned char * base, const int * ids, int k, float * out, cudaStream_t s) {
    dim3 block(32, 2);
    read_rows<<<dim3(GATE_ROWS / 2, k), block, 0, s>>>(base, EXPERT, 0, GATE_ROW, GATE_ROWS, ids, out);
    read_rows<<<dim3(GATE_ROWS / 2, k), block, 0, s>>>(base, EXPERT, GATE_ROWS * GATE_ROW, GATE_ROW, GATE_ROWS, ids, out);
    read_rows<<<dim3(DOWN_ROWS / 2, k), block, 0, s>>>(base, EXPERT, 2 * GATE_ROWS * GATE_ROW, DOWN_ROW, DOWN_ROWS, ids, out);
}

// Stands in for a small elementwise op of a decode step (2,048 floats, one block).
__global__ void log_ids(const int * ids, float * log) {
    if (threadIdx.x < 8) {
        log[threadIdx.x] = float(ids[threadIdx.x]);
    }
}

__global__ void small_op(float * x) {
    for (int i = threadIdx.x; i < 2048; i += blockDim.x) {
        x[i] = x[i] * 0.5f + 1.0f;
    }
}

__global__ void signal(volatile int * flag, int v) {
    __threadfence_system();
    *flag = v;
}

__global__ void wait_for(volatile int * flag, int v) {
    while (*flag != v) {
    }
}

// (f)'s mailbox, as the removed host ops kept one per stream: posts counted in device memory, a
// ring of what was posted in mapped host memory.
struct mailbox {
    unsigned long long req;
    unsigned long long done;
    int kind[64];
};

__global__ void mb_post(mailbox * mb, unsigned long long * seq, int kind) {
    const unsigned long long n = seq[0] + 1;
    seq[0] = n;
    *(volatile int *) &mb->kind[n % 64] = kind;
    __threadfence_system();
    *(volatile unsigned long long *) &mb->req = n;
    __threadfence_system();
}

__global__ void mb_wait(mailbox * mb, const unsigned long long * seq) {
    const unsigned long long n = seq[0];
    while (*(volatile unsigned long long *) &mb->done < n) {
        __nanosleep(64);
    }
}

// Median microseconds per call of f over reps (after a warm-up), timed with events on s.
template <typename F> static double time_us(cudaStream_t s, int reps, F f) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<double> v;
    for (int i = 0; i < reps + 3; ++i) {
        CK(cudaEventRecord(a, s));
        f();
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (i >= 3) {
            v.push_back(ms * 1e3);
        }
    }
    return median(v);
}

// Per layer, k experts (1, 2, 4, 8) read from `base` by the ids listed at `ids` (64 of them, 77 MB,
// more than the L2 holds: each rep reads other experts than the last); one line each.
static void per_layer_reads(cudaStream_t s, const char * mechanism, const char * from, const unsigned char * base, const int * ids, float * out) {
    for (int k : {1, 2, 4, 8}) {
        int rot = 0;
        double us = time_us(s, 50, [&] {
            layer_reads(base, ids + rot, k, out, s);
            rot = (rot + k) % (64 - k);
        });
        std::printf("{\"mechanism\":\"%s\",\"from\":\"%s\",\"experts\":%d,\"us_per_layer\":%.1f,\"GB_per_s\":%.1f}\n", mechanism, from, k, us,
                    k * EXPERT / us / 1e3);
    }
}

// Median microseconds of one launch of the CUDA graph that `record` captures on stream s.
template <typename F> static double graph_us(cudaStream_t s, F record) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    record();
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    const double us = time_us(s, 50, [&] { CK(cudaGraphLaunch(ge, s)); });
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return us;
}

static bool cu_ok(CUresult r, const char * what) {
    if (r == CUDA_SUCCESS) {
        return true;
    }
    const char * msg = nullptr;
    cuGetErrorString(r, &msg);
    std::printf("{\"mechanism\":\"one-range\",\"supported\":false,\"step\":\"%s\",\"error\":\"%s\"}\n", what, msg ? msg : "?");
    return false;
}

// (e): H hot slots in VRAM, then 64 cold experts in host memory, one stride for all.
static void one_range(cudaStream_t s, const unsigned char * fill, float * out) {
    CUdevice cu_dev;
    if (!cu_ok(cuDeviceGet(&cu_dev, 0), "cuDeviceGet")) {
        return;
    }
    int numa = -1;
    (void) cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, cu_dev);
    CUmemAllocationProp dprop = {};
    dprop.type          = CU_MEM_ALLOCATION_TYPE_PINNED;
    dprop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    dprop.location.id   = 0;
    CUmemAllocationProp hprop = dprop;
    hprop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    hprop.location.id   = numa < 0 ? 0 : numa;
    size_t gd = 0, gh = 0;
    if (!cu_ok(cuMemGetAllocationGranularity(&gd, &dprop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "granularity device") ||
        !cu_ok(cuMemGetAllocationGranularity(&gh, &hprop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "granularity host")) {
        return;
    }
    const size_t g = std::max(gd, gh);
    const size_t hot_bytes = (64 * EXPERT + g - 1) / g * g;
    const size_t cold_bytes = (65 * EXPERT + g - 1) / g * g;
    const int H = int(hot_bytes / EXPERT);  // slots below H are in VRAM; the tensor starts so that slot H starts the host part
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle hot_h, cold_h;
    if (!cu_ok(cuMemAddressReserve(&va, hot_bytes + cold_bytes, g, 0, 0), "reserve") ||
        !cu_ok(cuMemCreate(&hot_h, hot_bytes, &dprop, 0), "create device") ||
        !cu_ok(cuMemCreate(&cold_h, cold_bytes, &hprop, 0), "create host numa") ||
        !cu_ok(cuMemMap(va, hot_bytes, 0, hot_h, 0), "map device") ||
        !cu_ok(cuMemMap(va + hot_bytes, cold_bytes, 0, cold_h, 0), "map host")) {
        return;
    }
    CUmemAccessDesc acc = {};
    acc.location = dprop.location;
    acc.flags    = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (!cu_ok(cuMemSetAccess(va, hot_bytes + cold_bytes, &acc, 1), "device access")) {
        return;
    }
    CUmemAccessDesc hacc = {};
    hacc.location = hprop.location;
    hacc.flags    = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    const bool host_access = cuMemSetAccess(va + hot_bytes, cold_bytes, &hacc, 1) == CUDA_SUCCESS;
    const unsigned char * base = (const unsigned char *) (va + hot_bytes) - size_t(H) * EXPERT;
    CK(cudaMemcpy((void *) (va + hot_bytes), fill, 64 * EXPERT, cudaMemcpyHostToDevice));
    CK(cudaMemcpy((void *) base, fill, size_t(H) * EXPERT, cudaMemcpyHostToDevice));
    std::printf("{\"mechanism\":\"one-range\",\"supported\":true,\"granularity\":%zu,\"hot_slots\":%d,\"numa\":%d,\"host_access\":%s}\n", g, H,
                numa, host_access ? "true" : "false");

    // Per layer: k experts from the host part, and k from the VRAM part, through the one range.
    std::vector<int> h_ids(64 + LAYERS * 8);
    int * ids;
    CK(cudaMalloc(&ids, h_ids.size() * sizeof(int)));
    for (int where = 0; where < 2; ++where) {
        for (int i = 0; i < 64; ++i) {
            h_ids[i] = where ? (i * 97 + 13) % H : H + (i * 31 + 7) % 64;
        }
        CK(cudaMemcpy(ids, h_ids.data(), 64 * sizeof(int), cudaMemcpyHostToDevice));
        per_layer_reads(s, "one-range", where ? "vram" : "host", base, ids, out);
    }
    // Per token: 48 layers of 8 selections, c of them cold, one set of kernels per layer.
    for (int c : {0, 1, 3}) {
        for (int l = 0; l < LAYERS; ++l) {
            for (int j = 0; j < 8; ++j) {
                h_ids[l * 8 + j] = j < c ? H + (l * 8 + j) % 64 : (l * 8 + j * 7) % H;
            }
        }
        CK(cudaMemcpy(ids, h_ids.data(), LAYERS * 8 * sizeof(int), cudaMemcpyHostToDevice));
        double us = graph_us(s, [&] {
            for (int l = 0; l < LAYERS; ++l) {
                layer_reads(base, ids + l * 8, 8, out, s);
            }
        });
        std::printf("{\"mechanism\":\"one-range\",\"graph_layers\":%d,\"cold_per_layer\":%d,\"us_per_token\":%.1f}\n", LAYERS, c, us);
    }
    CK(cudaFree(ids));
    (void) cuMemUnmap(va, hot_bytes + cold_bytes);
    (void) cuMemRelease(hot_h);
    (void) cuMemRelease(cold_h);
    (void) cuMemAddressFree(va, hot_bytes + cold_bytes);
}

int main() {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const size_t bytes = N_EXPERT * EXPERT;
    unsigned char *host, *dev;
    CK(cudaMallocHost(&host, bytes));
    CK(cudaMalloc(&dev, bytes));
    for (size_t i = 0; i < bytes; i += 4096) {
        host[i] = (unsigned char) i;
    }
    CK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
    unsigned char * host_dev = nullptr;
    CK(cudaHostGetDevicePointer((void **) &host_dev, host, 0));
    int * ids;
    float * out;
    CK(cudaMalloc(&ids, 64 * sizeof(int)));
    CK(cudaMalloc(&out, 64 * DOWN_ROWS * sizeof(float)));
    std::vector<int> h_ids(64);
    for (int i = 0; i < 64; ++i) {
        h_ids[i] = (i * 97 + 13) % N_EXPERT;
    }
    CK(cudaMemcpy(ids, h_ids.data(), 64 * sizeof(int), cudaMemcpyHostToDevice));

    // (a) per layer, k experts, from host memory over the bus and from VRAM
    per_layer_reads(s, "zero-copy", "host", host_dev, ids, out);
    per_layer_reads(s, "zero-copy", "vram", dev, ids, out);
    // (a) per token: 48 layers of k cold experts each, captured as one CUDA graph
    for (int k : {0, 1, 3}) {
        double us = graph_us(s, [&] {
            for (int l = 0; l < LAYERS; ++l) {
                layer_reads(dev, ids + (l * 8) % 56, 8 - k, out, s);  // the hot experts, from VRAM
                if (k > 0) {
                    layer_reads(host_dev, ids + (l * k) % (64 - k), k, out, s);
                }
            }
        });
        std::printf("{\"mechanism\":\"zero-copy\",\"graph_layers\":%d,\"cold_per_layer\":%d,\"us_per_token\":%.1f}\n", LAYERS, k, us);
    }

    // (g) staged: per layer k cold experts copied into VRAM by one kernel per projection, read there
    {
        unsigned char * stage;
        CK(cudaMalloc(&stage, 8 * EXPERT));
        int * slots;
        const int h_slots[8] = {0, 1, 2, 3, 4, 5, 6, 7};
        CK(cudaMalloc(&slots, sizeof(h_slots)));
        CK(cudaMemcpy(slots, h_slots, sizeof(h_slots), cudaMemcpyHostToDevice));
        for (int k : {1, 2, 4, 8}) {
            int rot = 0;
            const double us = time_us(s, 50, [&] {
                staged_layer(host_dev, ids + rot, k, slots, stage, out, s);
                rot = (rot + k) % (64 - k);
            });
            std::printf("{\"mechanism\":\"staged\",\"from\":\"host\",\"experts\":%d,\"us_per_layer\":%.1f,\"GB_per_s\":%.1f}\n", k, us,
                        k * EXPERT / us / 1e3);
        }
        for (int k : {1, 3}) {
            const double us = graph_us(s, [&] {
                for (int l = 0; l < LAYERS; ++l) {
                    layer_reads(dev, ids + (l * 8) % 56, 8 - k, out, s);
                    staged_layer(host_dev, ids + (l * k) % (64 - k), k, slots, stage, out, s);
                }
            });
            std::printf("{\"mechanism\":\"staged\",\"graph_layers\":%d,\"cold_per_layer\":%d,\"us_per_token\":%.1f}\n", LAYERS, k, us);
        }
        CK(cudaFree(stage));
        CK(cudaFree(slots));
    }

    // (d) the per-token graph with 1 cold expert a layer and E small kernels more per layer
    float * scratch;
    CK(cudaMalloc(&scratch, 2048 * sizeof(float)));
    CK(cudaMemset(scratch, 0, 2048 * sizeof(float)));
    for (int extra : {0, 4, 7, 10}) {
        double us = graph_us(s, [&] {
            for (int l = 0; l < LAYERS; ++l) {
                layer_reads(dev, ids + (l * 8) % 56, 7, out, s);
                layer_reads(host_dev, ids + l % 63, 1, out, s);
                for (int e = 0; e < extra; ++e) {
                    small_op<<<1, 256, 0, s>>>(scratch);
                }
            }
        });
        std::printf("{\"mechanism\":\"small-kernels\",\"graph_layers\":%d,\"extra_per_layer\":%d,\"us_per_token\":%.1f}\n", LAYERS, extra, us);
    }

    // (h) the routing log per layer: none, a memcpy node, a conversion kernel
    {
        float * log_host;
        CK(cudaMallocHost(&log_host, LAYERS * 8 * sizeof(float)));
        float * log_dev;
        CK(cudaHostGetDevicePointer((void **) &log_dev, log_host, 0));
        const char * forms[] = {"none", "memcpy", "kernel"};
        for (int form = 0; form < 3; ++form) {
            double us = graph_us(s, [&] {
                for (int l = 0; l < LAYERS; ++l) {
                    layer_reads(dev, ids + (l * 8) % 56, 8, out, s);
                    if (form == 1) {
                        CK(cudaMemcpyAsync(log_dev + l * 8, ids + (l * 8) % 56, 8 * sizeof(int), cudaMemcpyDeviceToDevice, s));
                    } else if (form == 2) {
                        log_ids<<<1, 32, 0, s>>>(ids + (l * 8) % 56, log_dev + l * 8);
                    }
                }
            });
            std::printf("{\"mechanism\":\"routing-log\",\"graph_layers\":%d,\"form\":\"%s\",\"us_per_token\":%.1f}\n", LAYERS, forms[form], us);
        }
        CK(cudaFreeHost(log_host));
    }

    // (e) both tiers in one virtual range
    one_range(s, host, out);

    // (b) a flag hand-off per layer: GPU -> CPU thread -> GPU, within the stream
    int * flags;
    CK(cudaMallocHost(&flags, 2 * sizeof(int)));
    flags[0] = flags[1] = 0;
    int * flags_dev;
    CK(cudaHostGetDevicePointer((void **) &flags_dev, flags, 0));
    std::atomic<bool> stop{false};
    std::thread cpu([&] {
        volatile int * f = flags;
        int seen = 0;
        while (!stop.load(std::memory_order_relaxed)) {
            int v = f[0];
            if (v != seen) {
                seen = v;
                f[1] = v;
            }
        }
    });
    {
        int v = 0;
        double us = time_us(s, 50, [&] {
            for (int l = 0; l < LAYERS; ++l) {
                ++v;
                signal<<<1, 1, 0, s>>>(flags_dev, v);
                wait_for<<<1, 1, 0, s>>>(flags_dev + 1, v);
            }
        });
        std::printf("{\"mechanism\":\"flag-wait\",\"layers\":%d,\"us_per_token\":%.1f,\"us_per_layer\":%.2f}\n", LAYERS, us, us / LAYERS);
    }
    stop = true;
    cpu.join();

    // (f) the workers inside the step: launch posted (not waited for), hot experts, join waited for
    {
        mailbox * mb;
        CK(cudaHostAlloc((void **) &mb, sizeof(mailbox), cudaHostAllocMapped));
        std::memset(mb, 0, sizeof(mailbox));
        mailbox * mb_dev;
        CK(cudaHostGetDevicePointer((void **) &mb_dev, mb, 0));
        unsigned long long * seq;
        CK(cudaMalloc(&seq, sizeof(unsigned long long)));
        CK(cudaMemset(seq, 0, sizeof(unsigned long long)));
        CK(cudaDeviceSynchronize());
        char *h_src, *h_res;
        float *d_x, *d_res;
        CK(cudaMallocHost(&h_src, 16384));
        CK(cudaMallocHost(&h_res, 65536));
        CK(cudaMalloc(&d_x, 16384));
        CK(cudaMalloc(&d_res, 65536));
        std::atomic<int> work_us{0};
        std::atomic<bool> halt{false};
        std::thread host([&] {
            unsigned long long seen = 0;
            double launched = 0;
            while (!halt.load(std::memory_order_relaxed)) {
                const unsigned long long r = __atomic_load_n(&mb->req, __ATOMIC_ACQUIRE);
                while (seen < r) {
                    ++seen;
                    if (__atomic_load_n(&mb->kind[seen % 64], __ATOMIC_ACQUIRE) == 0) {
                        launched = now_s();
                    } else {
                        while (now_s() < launched + work_us.load() * 1e-6) {
                        }
                    }
                    __atomic_store_n(&mb->done, seen, __ATOMIC_RELEASE);
                }
            }
        });
        const double hot = graph_us(s, [&] {
            for (int l = 0; l < LAYERS; ++l) {
                layer_reads(dev, ids + (l * 8) % 56, 8, out, s);
            }
        });
        std::printf("{\"mechanism\":\"workers-in-step\",\"graph_layers\":%d,\"hand_off\":false,\"us_per_token\":%.1f}\n", LAYERS, hot);
        for (int w : {0, 15, 40}) {
            work_us = w;
            const double us = graph_us(s, [&] {
                for (int l = 0; l < LAYERS; ++l) {
                    CK(cudaMemcpyAsync(h_src, d_x, 8192, cudaMemcpyDeviceToHost, s));
                    CK(cudaMemcpyAsync(h_src + 8192, ids, 32, cudaMemcpyDeviceToHost, s));
                    mb_post<<<1, 1, 0, s>>>(mb_dev, seq, 0);
                    layer_reads(dev, ids + (l * 8) % 56, 8, out, s);
                    CK(cudaMemcpyAsync(h_src + 12288, d_x, 4, cudaMemcpyDeviceToHost, s));
                    mb_post<<<1, 1, 0, s>>>(mb_dev, seq, 1);
                    mb_wait<<<1, 1, 0, s>>>(mb_dev, seq);
                    CK(cudaMemcpyAsync(d_res, h_res, 65536, cudaMemcpyHostToDevice, s));
                    small_op<<<1, 256, 0, s>>>(d_x);
                }
            });
            std::printf("{\"mechanism\":\"workers-in-step\",\"graph_layers\":%d,\"hand_off\":true,\"cpu_work_us\":%d,\"us_per_token\":%.1f,"
                        "\"us_per_layer_over_hot\":%.2f}\n",
                        LAYERS, w, us, (us - hot) / LAYERS);
        }
        halt = true;
        host.join();
    }

    // (c) today's scheduler split per layer: sync, 8 KiB to the host and back, relaunch
    {
        float *h_state, *d_state;
        CK(cudaMallocHost(&h_state, 8192));
        CK(cudaMalloc(&d_state, 8192));
        std::vector<double> v;
        for (int rep = 0; rep < 23; ++rep) {
            double t0 = now_s();
            for (int l = 0; l < LAYERS; ++l) {
                layer_reads(dev, ids, 1, out, s);
                CK(cudaMemcpyAsync(h_state, d_state, 8192, cudaMemcpyDeviceToHost, s));
                CK(cudaStreamSynchronize(s));
                CK(cudaMemcpyAsync(d_state, h_state, 8192, cudaMemcpyHostToDevice, s));
            }
            CK(cudaStreamSynchronize(s));
            if (rep >= 3) {
                v.push_back((now_s() - t0) * 1e6);
            }
        }
        const double token_us = median(v);
        double base = time_us(s, 20, [&] {
            for (int l = 0; l < LAYERS; ++l) {
                layer_reads(dev, ids, 1, out, s);
            }
        });
        std::printf("{\"mechanism\":\"split\",\"layers\":%d,\"us_per_token\":%.1f,\"us_per_layer_over_reads\":%.2f}\n", LAYERS,
                    token_us, (token_us - base) / LAYERS);
    }
    return 0;
}
