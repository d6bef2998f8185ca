// Copy paths for a ring of GPU expert slots, measured on the device: how fast cold experts of
// the synthetic 80B-A3B (IQ3_XXS, 1,204,224 bytes each) reach the GPU, and whether those
// copies overlap with compute. Decides the prompt path's design (docs/prefill-ring.md).
//
//   nvcc -O2 -std=c++17 -arch=sm_90 tools/device/ringbench.cu -o ringbench && ./ringbench [GIB]
//
// GIB: size of the pageable "RAM copy" experts are gathered from (default 16). Prints one JSON
// object per line, then a table.
#include "bench.cuh"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

static const size_t EXPERT = 1204224;  // gate + up + down of one expert, IQ3_XXS, d=2048, ff=512

// A kernel that keeps every SM busy for about `iters` steps of dependent FMAs: the compute a
// copy must hide behind.
__global__ void busy(float * out, int iters) {
    float a = threadIdx.x * 1e-3f, b = 1.0001f;
    for (int i = 0; i < iters; i++) {
        a = fmaf(a, b, 1e-7f);
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = a;
}

struct Row {
    std::string what;
    int experts;
    double ms;
    double gbps;
};

static void print(const Row & r) {
    std::printf("{\"what\": \"%s\", \"experts\": %d, \"ms\": %.4f, \"GB_per_s\": %.2f}\n", r.what.c_str(), r.experts, r.ms, r.gbps);
    std::fflush(stdout);
}

int main(int argc, char ** argv) {
    const double ram_gib = argc > 1 ? std::atof(argv[1]) : 16.0;
    const int counts[] = {1, 8, 32, 96, 256, 512};
    const int max_k = 512;
    std::vector<Row> rows;

    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("{\"device\": \"%s\", \"sms\": %d, \"async_engines\": %d}\n", prop.name, prop.multiProcessorCount, prop.asyncEngineCount);

    unsigned char * dev = nullptr;
    CK(cudaMalloc(&dev, EXPERT * max_k));
    unsigned char * pinned = nullptr;
    CK(cudaHostAlloc(&pinned, EXPERT * max_k, cudaHostAllocDefault));
    std::vector<unsigned char> pageable(EXPERT * max_k);
    std::mt19937_64 rng(42);
    for (size_t i = 0; i < pageable.size(); i += 8) {
        uint64_t x = rng();
        std::memcpy(&pageable[i], &x, std::min<size_t>(8, pageable.size() - i));
    }
    std::memcpy(pinned, pageable.data(), pageable.size());
    cudaStream_t copy, comp;
    CK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&comp, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    auto timed = [&](cudaStream_t s, auto && body) {
        std::vector<double> ms;
        for (int rep = 0; rep < 7; rep++) {
            CK(cudaEventRecord(e0, s));
            body();
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float t = 0;
            CK(cudaEventElapsedTime(&t, e0, e1));
            ms.push_back(t);
        }
        return median(ms);
    };

    // 1. pinned staging -> device, one copy of k contiguous experts, and k copies of one each
    for (int k : counts) {
        double ms = timed(copy, [&] { CK(cudaMemcpyAsync(dev, pinned, EXPERT * k, cudaMemcpyHostToDevice, copy)); });
        rows.push_back({"pinned_one_copy", k, ms, EXPERT * k / ms / 1e6});
        ms = timed(copy, [&] {
            for (int i = 0; i < k; i++) {
                CK(cudaMemcpyAsync(dev + EXPERT * i, pinned + EXPERT * i, EXPERT, cudaMemcpyHostToDevice, copy));
            }
        });
        rows.push_back({"pinned_per_expert", k, ms, EXPERT * k / ms / 1e6});
    }

    // 2. pageable -> device (what ggml_backend_tensor_set does with a malloc'd source)
    for (int k : counts) {
        std::vector<double> ms;
        for (int rep = 0; rep < 5; rep++) {
            double t0 = now_s();
            CK(cudaMemcpy(dev, pageable.data(), EXPERT * k, cudaMemcpyHostToDevice));
            ms.push_back((now_s() - t0) * 1e3);
        }
        double m = median(ms);
        rows.push_back({"pageable_sync", k, m, EXPERT * k / m / 1e6});
    }

    // 3. gathering scattered experts of a large pageable RAM copy into the staging buffer
    const size_t n_ram = std::max<size_t>(max_k, size_t(ram_gib * (1ull << 30)) / EXPERT);
    std::vector<unsigned char> ram(n_ram * EXPERT);
    for (size_t i = 0; i < ram.size(); i += 4096) {
        ram[i] = (unsigned char) i;
    }
    std::vector<size_t> picks(n_ram);
    std::iota(picks.begin(), picks.end(), 0);
    std::shuffle(picks.begin(), picks.end(), rng);
    for (int threads : {1, 4, 8, 15}) {
        for (int k : {96, 512}) {
            std::vector<double> ms;
            for (int rep = 0; rep < 5; rep++) {
                size_t base = size_t(rep) * k % (n_ram - k);
                double t0 = now_s();
                std::vector<std::thread> pool;
                for (int t = 0; t < threads; t++) {
                    pool.emplace_back([&, t] {
                        for (int i = t; i < k; i += threads) {
                            std::memcpy(pinned + EXPERT * i, ram.data() + EXPERT * picks[base + i], EXPERT);
                        }
                    });
                }
                for (auto & th : pool) {
                    th.join();
                }
                ms.push_back((now_s() - t0) * 1e3);
            }
            double m = median(ms);
            rows.push_back({"gather_" + std::to_string(threads) + "threads", k, m, EXPERT * k / m / 1e6});
        }
    }

    // 4. copies on one stream while a compute kernel runs on another: does either slow down?
    float * sink = nullptr;
    const int blocks = prop.multiProcessorCount * 4, tpb = 256;
    CK(cudaMalloc(&sink, sizeof(float) * blocks * tpb));
    int iters = 1 << 16;
    double busy_ms = timed(comp, [&] { busy<<<blocks, tpb, 0, comp>>>(sink, iters); CK(cudaGetLastError()); });
    while (busy_ms < 20.0) {
        iters *= 2;
        busy_ms = timed(comp, [&] { busy<<<blocks, tpb, 0, comp>>>(sink, iters); CK(cudaGetLastError()); });
    }
    rows.push_back({"compute_alone", 0, busy_ms, 0});
    {
        const int k = 512;
        std::vector<double> both, copy_ms;
        cudaEvent_t c0, c1;
        CK(cudaEventCreate(&c0));
        CK(cudaEventCreate(&c1));
        for (int rep = 0; rep < 7; rep++) {
            CK(cudaDeviceSynchronize());
            CK(cudaEventRecord(e0, comp));
            busy<<<blocks, tpb, 0, comp>>>(sink, iters);
            CK(cudaGetLastError());
            CK(cudaEventRecord(c0, copy));
            CK(cudaMemcpyAsync(dev, pinned, EXPERT * k, cudaMemcpyHostToDevice, copy));
            CK(cudaEventRecord(c1, copy));
            CK(cudaEventRecord(e1, comp));
            CK(cudaDeviceSynchronize());
            float t = 0, c = 0;
            CK(cudaEventElapsedTime(&t, e0, e1));
            CK(cudaEventElapsedTime(&c, c0, c1));
            both.push_back(t);
            copy_ms.push_back(c);
        }
        rows.push_back({"compute_during_copy", k, median(both), 0});
        rows.push_back({"copy_during_compute", k, median(copy_ms), EXPERT * k / median(copy_ms) / 1e6});
    }

    for (const auto & r : rows) {
        print(r);
    }
    std::printf("\n%-24s %8s %10s %10s\n", "what", "experts", "ms", "GB/s");
    for (const auto & r : rows) {
        std::printf("%-24s %8d %10.3f %10.2f\n", r.what.c_str(), r.experts, r.ms, r.gbps);
    }
    return 0;
}
