// Mapped host buffers: a buffer of the device's own type whose memory is page-locked host memory
// that kernels read over the bus (zero-copy). Tensors in it are weights of the device to ggml's
// scheduler, so a decode step that reads a few cold experts from host memory stays one graph on
// the device. Proc address ggml_backend_cuda_mapped_buffer_new.

// `host` must come from the device's host buffer type (cudaMallocHost/hipHostMalloc), which is
// mapped into the device's address space; the buffer does not own it. nullptr when the device
// cannot address it.
static ggml_backend_buffer_t ggml_backend_cuda_mapped_buffer_new(int device, void * host, size_t size) {
    if (device < 0 || device >= ggml_cuda_info().device_count || host == nullptr || size == 0) {
        return nullptr;
    }
    ggml_cuda_set_device(device);
    void * dev_ptr = nullptr;
    if (cudaHostGetDevicePointer(&dev_ptr, host, 0) != cudaSuccess || dev_ptr == nullptr) {
        (void) cudaGetLastError();
        return nullptr;
    }
    ggml_backend_cuda_buffer_context * ctx = new ggml_backend_cuda_buffer_context(device, dev_ptr);
    ctx->release = []() {};
    return ggml_backend_buffer_init(ggml_backend_cuda_buffer_type(device), ggml_backend_cuda_buffer_interface, ctx, size);
}

// The same over all of `host`, a buffer of the device's host buffer type, which the mapped buffer
// then owns and frees with itself (a KV cache placed in host memory frees only its own buffers).
// nullptr when the device cannot address it; `host` is then still the caller's.
static ggml_backend_buffer_t ggml_backend_cuda_mapped_buffer_own(int device, ggml_backend_buffer_t host) {
    if (host == nullptr) {
        return nullptr;
    }
    ggml_backend_buffer_t buf = ggml_backend_cuda_mapped_buffer_new(device, ggml_backend_buffer_get_base(host), ggml_backend_buffer_get_size(host));
    if (buf == nullptr) {
        return nullptr;
    }
    static_cast<ggml_backend_cuda_buffer_context *>(buf->context)->release = [host]() { ggml_backend_buffer_free(host); };
    return buf;
}
