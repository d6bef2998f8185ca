// Host ops: custom ops that an application registers to run on the CPU in stream order, so
// that a graph which needs a host step between two device ops stays one device split (and one
// CUDA graph). The sources are copied to pinned staging, the op runs in a host callback, and its
// result is copied back. The op must not call the CUDA API.
static std::mutex                     ggml_cuda_host_ops_mutex;
static std::vector<ggml_custom_op_t> ggml_cuda_host_ops;

static void ggml_backend_cuda_register_host_op(ggml_custom_op_t fun) {
    std::lock_guard<std::mutex> lock(ggml_cuda_host_ops_mutex);
    if (std::find(ggml_cuda_host_ops.begin(), ggml_cuda_host_ops.end(), fun) == ggml_cuda_host_ops.end()) {
        ggml_cuda_host_ops.push_back(fun);
    }
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
};

static void ggml_cuda_host_op_run(void * data) {
    ggml_cuda_host_op_state * st = (ggml_cuda_host_op_state *) data;
    st->fun(&st->dst, 0, 1, st->userdata);
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
            st->fun      = p->fun;
            st->userdata = p->userdata;
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
                st->staged[i] = !ggml_cuda_tensor_on_host(dst->src[i]);
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
    for (int i = 0; i < GGML_MAX_SRC && dst->src[i]; ++i) {
        if (st->staged[i]) {
            CUDA_CHECK(cudaMemcpyAsync(st->src[i].data, dst->src[i]->data, ggml_nbytes(dst->src[i]), cudaMemcpyDeviceToHost, stream));
        }
    }
    CUDA_CHECK(cudaLaunchHostFunc(stream, ggml_cuda_host_op_run, st));
    CUDA_CHECK(cudaMemcpyAsync(dst->data, st->dst.data, ggml_nbytes(dst), cudaMemcpyHostToDevice, stream));
}
