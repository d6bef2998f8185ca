// How a decode step can reach the cold experts of a tiered MoE layer without leaving the GPU's
// stream, measured on the device for the synthetic 80B-A3B (IQ3_XXS experts: gate and up 512
// rows of 784 bytes, down 2048 rows of 196 bytes, 1,204,224 bytes in all). Decides the decode
// mechanism (docs/expert-tiers.md, "Zero-copy decode").
//
//   nvcc -O2 -std=c++17 -arch=sm_90 tools/device/decodebench.cu -o decodebench && ./decodebench
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
// Prints one JSON object per measurement.
#include "bench.cuh"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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

// One layer's expert reads for the experts in ids (k of them): gate, up, down.
static void layer_reads(const unsigned char * base, const int * ids, int k, float * out, cudaStream_t s) {
    dim3 block(32, 2);
    read_rows<<<dim3(GATE_ROWS / 2, k), block, 0, s>>>(base, EXPERT, 0, GATE_ROW, GATE_ROWS, ids, out);
    read_rows<<<dim3(GATE_ROWS / 2, k), block, 0, s>>>(base, EXPERT, GATE_ROWS * GATE_ROW, GATE_ROW, GATE_ROWS, ids, out);
    read_rows<<<dim3(DOWN_ROWS / 2, k), block, 0, s>>>(base, EXPERT, 2 * GATE_ROWS * GATE_ROW, DOWN_ROW, DOWN_ROWS, ids, out);
}

// Stands in for a small elementwise op of a decode step (2,048 floats, one block).
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
    for (int k : {1, 2, 4, 8}) {
        for (int where = 0; where < 2; ++where) {
            const unsigned char * base = where ? dev : host_dev;
            // each rep reads other experts than the last (64 listed, 77 MB, more than the L2 holds)
            int rot = 0;
            double us = time_us(s, 50, [&] {
                layer_reads(base, ids + rot, k, out, s);
                rot = (rot + k) % (64 - k);
            });
            std::printf("{\"mechanism\":\"zero-copy\",\"from\":\"%s\",\"experts\":%d,\"us_per_layer\":%.1f,\"GB_per_s\":%.1f}\n",
                        where ? "vram" : "host", k, us, k * EXPERT / us / 1e3);
        }
    }
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
