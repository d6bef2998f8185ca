// Host ops: custom ops that an application registers to run on the CPU in stream order, so
// that a graph which needs a host step between two device ops stays one device split (and one
// CUDA graph). The sources are copied to pinned staging, the op runs on the host, and its result
// is copied back. The op must not call the CUDA API.
//
// The host step runs in a host callback, or, after ggml_backend_host_ops_by_flag(true), on a
// host thread of this file that spins on a mailbox in mapped memory: a one-thread kernel posts
// the op there and a second one holds the stream until the host answers. A callback's latency
// is tens of microseconds; the mailbox's a few, which is what a step with one host op per layer
// needs. An op registered with ggml_backend_register_host_op_async is only posted: the stream
// goes on at once and its output is not copied back (an op that starts host work whose result a
// later op collects); the host runs every stream's posts in order.
#include <chrono>
#include <thread>

static std::mutex                     ggml_cuda_host_ops_mutex;
static std::vector<ggml_custom_op_t> ggml_cuda_host_ops;
static std::vector<ggml_custom_op_t> ggml_cuda_host_ops_async;

static void ggml_backend_cuda_register_host_op(ggml_custom_op_t fun) {
    std::lock_guard<std::mutex> lock(ggml_cuda_host_ops_mutex);
    if (std::find(ggml_cuda_host_ops.begin(), ggml_cuda_host_ops.end(), fun) == ggml_cuda_host_ops.end()) {
        ggml_cuda_host_ops.push_back(fun);
    }
}

static void ggml_backend_register_host_op_async(ggml_custom_op_t fun) {
    ggml_backend_cuda_register_host_op(fun);
    std::lock_guard<std::mutex> lock(ggml_cuda_host_ops_mutex);
    if (std::find(ggml_cuda_host_ops_async.begin(), ggml_cuda_host_ops_async.end(), fun) == ggml_cuda_host_ops_async.end()) {
        ggml_cuda_host_ops_async.push_back(fun);
    }
}

static bool ggml_cuda_host_op_is_async(ggml_custom_op_t fun) {
    std::lock_guard<std::mutex> lock(ggml_cuda_host_ops_mutex);
    return std::find(ggml_cuda_host_ops_async.begin(), ggml_cuda_host_ops_async.end(), fun) != ggml_cuda_host_ops_async.end();
}

// The output of an op registered with ggml_backend_register_host_op_async.
static bool ggml_cuda_is_async_output(const ggml_tensor * t) {
    return t->op == GGML_OP_CUSTOM && ggml_cuda_host_op_is_async(((const ggml_custom_op_params *) t->op_params)->fun);
}

// GGML_CUDA_HOST_OP_COPY_NODES=1: a mailbox op's copies as copy nodes of their own (the form
// before its kernels did them; for comparison).
static bool ggml_cuda_host_op_copy_nodes() {
    static const bool on = [] {
        const char * v = getenv("GGML_CUDA_HOST_OP_COPY_NODES");
        return v != nullptr && strcmp(v, "1") == 0;
    }();
    return on;
}

static bool ggml_cuda_is_host_op(const ggml_tensor * op) {
    if (op->op != GGML_OP_CUSTOM) {
        return false;
    }
    const ggml_custom_op_params * p = (const ggml_custom_op_params *) op->op_params;
    std::lock_guard<std::mutex> lock(ggml_cuda_host_ops_mutex);
    return std::find(ggml_cuda_host_ops.begin(), ggml_cuda_host_ops.end(), p->fun) != ggml_cuda_host_ops.end();
}

// Host copies of one node's tensors; captured CUDA graphs keep pointers to it, so it lives until exit.
struct ggml_cuda_host_op_state {
    ggml_custom_op_t fun;
    void *           userdata;
    ggml_tensor      dst;
    ggml_tensor      src[GGML_MAX_SRC];
    bool             staged[GGML_MAX_SRC];
    bool             async;
    // the staging as the host and as the device address it
    char *           stage;
    char *           stage_dev;
};

static void ggml_cuda_host_op_run(void * data) {
    ggml_cuda_host_op_state * st = (ggml_cuda_host_op_state *) data;
    st->fun(&st->dst, 0, 1, st->userdata);
}

// The mailbox of one stream: a ring of posted ops. `req` counts posts and `done` the posts the
// host has run; the device's own count of posts (`seq`, device memory) lets a captured CUDA graph
// replay the same kernels every step. A post waits while the ring is full (asynchronous posts
// that nothing waited for).
static constexpr unsigned long long GGML_CUDA_HOST_POSTS = 64;

struct ggml_cuda_host_mailbox_mem {
    unsigned long long        req;
    unsigned long long        done;
    ggml_cuda_host_op_state * st[GGML_CUDA_HOST_POSTS];
};

struct ggml_cuda_host_mailbox {
    ggml_cuda_host_mailbox_mem * host;
    ggml_cuda_host_mailbox_mem * dev;
    // device memory: [0] posts, [1] the last `done` a kernel read (so a post reads the host's
    // only when the ring may be full)
    unsigned long long *         seq;
    int                          device;
    cudaStream_t                 stream;
};

static std::atomic<bool>                    ggml_cuda_host_ops_flag{false};
static constexpr int                        GGML_CUDA_HOST_MAILBOXES = 64;
static ggml_cuda_host_mailbox               ggml_cuda_host_mailboxes[GGML_CUDA_HOST_MAILBOXES];
static std::atomic<int>                     ggml_cuda_host_mailbox_count{0};

static void ggml_backend_host_ops_by_flag(bool on) {
    ggml_cuda_host_ops_flag.store(on);
}

// Traps after a minute: a host that never answers (its thread gone) would hang the device.
static __device__ void ggml_cuda_host_op_until(const volatile unsigned long long * done, unsigned long long at_least) {
#if defined(GGML_USE_HIP)
    const long long t0 = wall_clock64();
    while (*done < at_least) {
        __builtin_amdgcn_s_sleep(1);
        // wall_clock64 runs at 100 MHz on RDNA3
        if (wall_clock64() - t0 > 6000000000LL) {
            __builtin_trap();
        }
    }
#else
    unsigned long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (*done < at_least) {
        __nanosleep(64);
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > 60ull * 1000000000ull) {
            printf("ggml-cuda: a host op was not answered within 60 s\n");
            __trap();
        }
    }
#endif
}

static __device__ void ggml_cuda_host_op_post_one(ggml_cuda_host_mailbox_mem * mb, unsigned long long * seq, ggml_cuda_host_op_state * st) {
    const unsigned long long s = seq[0] + 1;
    seq[0] = s;
    if (s > GGML_CUDA_HOST_POSTS && seq[1] < s - GGML_CUDA_HOST_POSTS) {
        ggml_cuda_host_op_until(&mb->done, s - GGML_CUDA_HOST_POSTS);
        seq[1] = *(volatile unsigned long long *) &mb->done;
    }
    *(ggml_cuda_host_op_state * volatile *) &mb->st[s % GGML_CUDA_HOST_POSTS] = st;
    __threadfence_system();
    *(volatile unsigned long long *) &mb->req = s;
    __threadfence_system();
}

// Until the host has run this stream's last post (and every one before it).
static __device__ void ggml_cuda_host_op_wait_one(ggml_cuda_host_mailbox_mem * mb, unsigned long long * seq) {
    ggml_cuda_host_op_until(&mb->done, seq[0]);
    seq[1] = seq[0];
    __threadfence_system();
}

static __global__ void ggml_cuda_host_op_post(ggml_cuda_host_mailbox_mem * mb, unsigned long long * seq, ggml_cuda_host_op_state * st) {
    ggml_cuda_host_op_post_one(mb, seq, st);
}

// Holds the stream until the host has run this stream's last post.
static __global__ void ggml_cuda_host_op_wait(ggml_cuda_host_mailbox_mem * mb, unsigned long long * seq) {
    ggml_cuda_host_op_wait_one(mb, seq);
}

// A host op's copies done by its own kernels: the sources into their staging before the post,
// the result out of its staging after the wait. One node where copies would add one each (a
// node costs a decode step about 2 us in a CUDA graph, and a layer of host ops had seven).
static constexpr int GGML_CUDA_HOST_OP_KERNEL_COPIES = 4;

struct ggml_cuda_host_op_copies {
    const char * from[GGML_CUDA_HOST_OP_KERNEL_COPIES];
    char *       to[GGML_CUDA_HOST_OP_KERNEL_COPIES];
    unsigned int bytes[GGML_CUDA_HOST_OP_KERNEL_COPIES];
    int          count;
};

// By every thread of the block. Host memory is read with .cv loads: the same staging is read
// every step, and a line the device cached from the last one would be stale.
static __device__ void ggml_cuda_host_op_copy(char * to, const char * from, unsigned int bytes, bool from_host) {
    if (((((uintptr_t) to) | ((uintptr_t) from) | bytes) & 15) == 0) {
        int4 *       t = (int4 *) to;
        const int4 * f = (const int4 *) from;
        for (unsigned int i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
#if defined(GGML_USE_HIP)
            const volatile int * v = (const volatile int *) (f + i);
            t[i] = from_host ? make_int4(v[0], v[1], v[2], v[3]) : f[i];
#else
            t[i] = from_host ? __ldcv(f + i) : f[i];
#endif
        }
    } else {
        for (unsigned int i = threadIdx.x; i < bytes; i += blockDim.x) {
            to[i] = from_host ? *(const volatile char *) (from + i) : from[i];
        }
    }
}


// Copies the sources into their staging, posts the op and, unless `result_bytes` is 0, holds
// the stream until the host has run it and copies its result out.
static __global__ void ggml_cuda_host_op_post_copies(ggml_cuda_host_mailbox_mem * mb, unsigned long long * seq, ggml_cuda_host_op_state * st,
                                                     ggml_cuda_host_op_copies in, bool wait, char * result, const char * result_stage,
                                                     unsigned int result_bytes) {
    for (int i = 0; i < in.count; ++i) {
        ggml_cuda_host_op_copy(in.to[i], in.from[i], in.bytes[i], false);
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        ggml_cuda_host_op_post_one(mb, seq, st);
        if (wait) {
            ggml_cuda_host_op_wait_one(mb, seq);
        }
    }
    if (!wait) {
        return;
    }
    __syncthreads();
    ggml_cuda_host_op_copy(result, result_stage, result_bytes, true);
}

// Answers every stream's posts: runs the op, then raises `done`. Spins while posts come (a
// decode step posts one per layer); after a quiet while it sleeps between looks.
static void ggml_cuda_host_op_server() {
    unsigned long long seen[GGML_CUDA_HOST_MAILBOXES] = {};
    auto last = std::chrono::steady_clock::now();
    for (;;) {
        bool any = false;
        const int n = ggml_cuda_host_mailbox_count.load(std::memory_order_acquire);
        for (int i = 0; i < n; ++i) {
            ggml_cuda_host_mailbox_mem * mb = ggml_cuda_host_mailboxes[i].host;
            const unsigned long long r = __atomic_load_n(&mb->req, __ATOMIC_ACQUIRE);
            while (seen[i] < r) {
                seen[i]++;
                ggml_cuda_host_op_run(__atomic_load_n(&mb->st[seen[i] % GGML_CUDA_HOST_POSTS], __ATOMIC_ACQUIRE));
                __atomic_store_n(&mb->done, seen[i], __ATOMIC_RELEASE);
                any = true;
            }
        }
        const auto now = std::chrono::steady_clock::now();
        if (any) {
            last = now;
        } else if (now - last > std::chrono::milliseconds(20)) {
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }
}

// The mailbox of (device, stream), made on first use; the server starts with the first.
static ggml_cuda_host_mailbox * ggml_cuda_host_mailbox_for(int device, cudaStream_t stream) {
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    const int n = ggml_cuda_host_mailbox_count.load();
    for (int i = 0; i < n; ++i) {
        if (ggml_cuda_host_mailboxes[i].device == device && ggml_cuda_host_mailboxes[i].stream == stream) {
            return &ggml_cuda_host_mailboxes[i];
        }
    }
    GGML_ASSERT(n < GGML_CUDA_HOST_MAILBOXES && "too many streams with host ops");
    ggml_cuda_host_mailbox & mb = ggml_cuda_host_mailboxes[n];
    mb.device = device;
    mb.stream = stream;
    CUDA_CHECK(cudaHostAlloc((void **) &mb.host, sizeof(ggml_cuda_host_mailbox_mem), cudaHostAllocMapped | cudaHostAllocPortable));
    memset(mb.host, 0, sizeof(ggml_cuda_host_mailbox_mem));
    CUDA_CHECK(cudaHostGetDevicePointer((void **) &mb.dev, mb.host, 0));
    CUDA_CHECK(cudaMalloc((void **) &mb.seq, 2 * sizeof(unsigned long long)));
    // Synchronous, so the first post (on a non-blocking stream) reads zeros.
    const unsigned long long zero[2] = { 0, 0 };
    CUDA_CHECK(cudaMemcpy(mb.seq, zero, sizeof(zero), cudaMemcpyHostToDevice));
    ggml_cuda_host_mailbox_count.store(n + 1, std::memory_order_release);
    if (n == 0) {
        std::thread(ggml_cuda_host_op_server).detach();
    }
    return &mb;
}

static bool ggml_cuda_tensor_on_host(const ggml_tensor * t) {
    const ggml_backend_buffer_t buf = t->view_src ? t->view_src->buffer : t->buffer;
    return buf != nullptr && ggml_backend_buffer_is_host(buf);
}

static void ggml_cuda_op_host(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    static std::mutex mutex;
    static std::map<std::vector<int64_t>, ggml_cuda_host_op_state *> states;

    const ggml_custom_op_params * p = (const ggml_custom_op_params *) dst->op_params;
    // The same addresses and shapes always map to the same staging, so replays stay valid.
    std::vector<int64_t> key = { (int64_t) (intptr_t) p->fun, (int64_t) (intptr_t) p->userdata, (int64_t) (intptr_t) dst->data, dst->type };
    const auto add_shape = [&](const ggml_tensor * t) {
        for (int d = 0; d < GGML_MAX_DIMS; ++d) {
            key.push_back(t->ne[d]);
            key.push_back((int64_t) t->nb[d]);
        }
    };
    add_shape(dst);
    for (int i = 0; i < GGML_MAX_SRC && dst->src[i]; ++i) {
        key.push_back((int64_t) (intptr_t) dst->src[i]->data);
        key.push_back(dst->src[i]->type);
        add_shape(dst->src[i]);
    }

    ggml_cuda_host_op_state * st = nullptr;
    {
        std::lock_guard<std::mutex> lock(mutex);
        auto it = states.find(key);
        if (it != states.end()) {
            st = it->second;
        } else {
            const auto padded = [](size_t n) { return GGML_PAD(n, 64); };
            size_t size = padded(ggml_nbytes(dst));
            for (int i = 0; i < GGML_MAX_SRC && dst->src[i]; ++i) {
                if (!ggml_cuda_tensor_on_host(dst->src[i])) {
                    size += padded(ggml_nbytes(dst->src[i]));
                }
            }
            char * stage = nullptr;
            CUDA_CHECK(cudaMallocHost((void **) &stage, size));
            st = new ggml_cuda_host_op_state{};
            st->stage = stage;
            CUDA_CHECK(cudaHostGetDevicePointer((void **) &st->stage_dev, stage, 0));
            st->fun      = p->fun;
            st->userdata = p->userdata;
            st->async    = ggml_cuda_host_op_is_async(p->fun);
            st->dst      = *dst;
            st->dst.data   = stage;
            st->dst.buffer = nullptr;
            size_t off = padded(ggml_nbytes(dst));
            for (int i = 0; i < GGML_MAX_SRC; ++i) {
                st->dst.src[i] = nullptr;
                if (!dst->src[i]) {
                    continue;
                }
                st->src[i]    = *dst->src[i];
                // An asynchronous host op's output is never copied back: the op that takes it as
                // a source only waits for it (its host copy is not read).
                st->staged[i] = !ggml_cuda_tensor_on_host(dst->src[i]) && !ggml_cuda_is_async_output(dst->src[i]);
                if (st->staged[i]) {
                    st->src[i].data   = stage + off;
                    st->src[i].buffer = nullptr;
                    off += padded(ggml_nbytes(dst->src[i]));
                }
                st->dst.src[i] = &st->src[i];
            }
            states.emplace(key, st);
            // Staging grows with distinct shapes and addresses only; a count that keeps growing means churn.
            if (states.size() >= 64 && (states.size() & (states.size() - 1)) == 0) {
                GGML_LOG_INFO("%s: %zu staging areas for host ops\n", __func__, states.size());
            }
        }
    }

    cudaStream_t stream = ctx.stream();
    if (ggml_cuda_host_ops_flag.load() && !ggml_cuda_host_op_copy_nodes()) {
        ggml_cuda_host_op_copies in = {};
        bool fits = ggml_nbytes(dst) < (1u << 31);
        for (int i = 0; i < GGML_MAX_SRC && dst->src[i] && fits; ++i) {
            if (!st->staged[i]) {
                continue;
            }
            fits = in.count < GGML_CUDA_HOST_OP_KERNEL_COPIES && ggml_nbytes(dst->src[i]) < (1u << 31);
            if (fits) {
                in.from[in.count]  = (const char *) dst->src[i]->data;
                in.to[in.count]    = st->stage_dev + ((char *) st->src[i].data - st->stage);
                in.bytes[in.count] = (unsigned int) ggml_nbytes(dst->src[i]);
                in.count++;
            }
        }
        if (fits) {
            ggml_cuda_host_mailbox * mb = ggml_cuda_host_mailbox_for(ctx.device, stream);
            const char * result_stage = st->stage_dev + ((char *) st->dst.data - st->stage);
            ggml_cuda_host_op_post_copies<<<1, 256, 0, stream>>>(mb->dev, mb->seq, st, in, !st->async, (char *) dst->data, result_stage,
                                                                  st->async ? 0u : (unsigned int) ggml_nbytes(dst));
            CUDA_CHECK(cudaGetLastError());
            return;
        }
    }
    for (int i = 0; i < GGML_MAX_SRC && dst->src[i]; ++i) {
        if (st->staged[i]) {
            CUDA_CHECK(cudaMemcpyAsync(st->src[i].data, dst->src[i]->data, ggml_nbytes(dst->src[i]), cudaMemcpyDeviceToHost, stream));
        }
    }
    if (ggml_cuda_host_ops_flag.load()) {
        ggml_cuda_host_mailbox * mb = ggml_cuda_host_mailbox_for(ctx.device, stream);
        ggml_cuda_host_op_post<<<1, 1, 0, stream>>>(mb->dev, mb->seq, st);
        CUDA_CHECK(cudaGetLastError());
        if (st->async) {
            return;
        }
        ggml_cuda_host_op_wait<<<1, 1, 0, stream>>>(mb->dev, mb->seq);
        CUDA_CHECK(cudaGetLastError());
    } else {
        CUDA_CHECK(cudaLaunchHostFunc(stream, ggml_cuda_host_op_run, st));
    }
    CUDA_CHECK(cudaMemcpyAsync(dst->data, st->dst.data, ggml_nbytes(dst), cudaMemcpyHostToDevice, stream));
}
