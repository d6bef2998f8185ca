// Expert windows: a buffer whose virtual range is `head` bytes of its own memory followed by a
// "ring" allocation that many windows map, so that one mul_mat_id addresses a layer's resident
// experts and the experts just copied into the shared ring as one tensor. Also a copy stream per
// device for host-to-device copies that overlap the compute stream. Proc addresses
// ggml_backend_cuda_ring_new/_free, ggml_backend_cuda_window_new, ggml_backend_cuda_copy_h2d/_wait.
#if defined(GGML_USE_HIP)
#define GGML_CU_OK hipSuccess
#else
#define GGML_CU_OK CUDA_SUCCESS
#endif

struct ggml_cuda_ring {
    int    device;
    size_t size;
#if defined(GGML_USE_VMM)
    CUmemGenericAllocationHandle handle;
#endif
};

// Returns nullptr where the device has no virtual memory management or the memory is short.
static void * ggml_backend_cuda_ring_new(int device, size_t size) {
#if !defined(GGML_USE_VMM)
    GGML_UNUSED(device);
    GGML_UNUSED(size);
    return nullptr;
#else
    if (device < 0 || device >= ggml_cuda_info().device_count || !ggml_cuda_info().devices[device].vmm || size == 0) {
        return nullptr;
    }
    ggml_cuda_set_device(device);
    const size_t granularity = ggml_cuda_info().devices[device].vmm_granularity;
    size = GGML_PAD(size, granularity);
    CUmemAllocationProp prop = {};
    prop.type          = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id   = ggml_cuda_get_physical_device(device);
    CUmemGenericAllocationHandle handle;
    if (cuMemCreate(&handle, size, &prop, 0) != GGML_CU_OK) {
        return nullptr;
    }
    return new ggml_cuda_ring{ device, size, handle };
#endif
}

// The ring's memory lives on while windows map it.
static void ggml_backend_cuda_ring_free(void * ring) {
    ggml_cuda_ring * r = (ggml_cuda_ring *) ring;
    if (r == nullptr) {
        return;
    }
#if defined(GGML_USE_VMM)
    CU_CHECK(cuMemRelease(r->handle));
#endif
    delete r;
}

static size_t ggml_backend_cuda_ring_size(void * ring) {
    return ring ? ((ggml_cuda_ring *) ring)->size : 0;
}

// A buffer of head + ring size bytes: [base, base + head) its own, then the ring. nullptr on failure.
static ggml_backend_buffer_t ggml_backend_cuda_window_new(void * ring, size_t head) {
#if !defined(GGML_USE_VMM)
    GGML_UNUSED(ring);
    GGML_UNUSED(head);
    return nullptr;
#else
    ggml_cuda_ring * r = (ggml_cuda_ring *) ring;
    if (r == nullptr) {
        return nullptr;
    }
    const int device = r->device;
    ggml_cuda_set_device(device);
    const size_t granularity = ggml_cuda_info().devices[device].vmm_granularity;
    const size_t head_mapped = GGML_PAD(head, granularity);
    const size_t total = head_mapped + r->size;
    CUdeviceptr va = 0;
    if (cuMemAddressReserve(&va, total, granularity, 0, 0) != GGML_CU_OK) {
        return nullptr;
    }
    bool head_ok = true;
    if (head_mapped > 0) {
        CUmemAllocationProp prop = {};
        prop.type          = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id   = ggml_cuda_get_physical_device(device);
        CUmemGenericAllocationHandle handle;
        head_ok = cuMemCreate(&handle, head_mapped, &prop, 0) == GGML_CU_OK;
        if (head_ok) {
            head_ok = cuMemMap(va, head_mapped, 0, handle, 0) == GGML_CU_OK;
            CU_CHECK(cuMemRelease(handle));
        }
    }
    const CUdeviceptr ring_va = (CUdeviceptr) ((char *) va + head_mapped);
    const bool ring_ok = head_ok && cuMemMap(ring_va, r->size, 0, r->handle, 0) == GGML_CU_OK;
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id   = ggml_cuda_get_physical_device(device);
    access.flags         = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    const bool access_ok = ring_ok && cuMemSetAccess(va, total, &access, 1) == GGML_CU_OK;
    const size_t ring_size = r->size;
    auto unmap = [va, ring_va, head_mapped, ring_size, head_ok, ring_ok, total]() {
        if (ring_ok) {
            CU_CHECK(cuMemUnmap(ring_va, ring_size));
        }
        if (head_ok && head_mapped > 0) {
            CU_CHECK(cuMemUnmap(va, head_mapped));
        }
        CU_CHECK(cuMemAddressFree(va, total));
    };
    if (!access_ok) {
        unmap();
        return nullptr;
    }
    ggml_backend_cuda_buffer_context * ctx = new ggml_backend_cuda_buffer_context(device, (void *) ((char *) ring_va - head));
    ctx->release = unmap;
    return ggml_backend_buffer_init(ggml_backend_cuda_buffer_type(device), ggml_backend_cuda_buffer_interface, ctx, head + r->size);
#endif
}

static cudaStream_t ggml_cuda_copy_stream(int device) {
    static std::mutex mutex;
    static cudaStream_t streams[GGML_CUDA_MAX_DEVICES] = {};
    std::lock_guard<std::mutex> lock(mutex);
    if (streams[device] == nullptr) {
        ggml_cuda_set_device(device);
        CUDA_CHECK(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking));
    }
    return streams[device];
}

// Queues a host-to-device copy on the device's copy stream; src should be page-locked.
static bool ggml_backend_cuda_copy_h2d(int device, void * dst, const void * src, size_t size) {
    if (device < 0 || device >= ggml_cuda_info().device_count) {
        return false;
    }
    cudaStream_t stream = ggml_cuda_copy_stream(device);
    ggml_cuda_set_device(device);
    return cudaMemcpyAsync(dst, src, size, cudaMemcpyHostToDevice, stream) == cudaSuccess;
}

// Waits for every copy queued on the device's copy stream.
static bool ggml_backend_cuda_copy_wait(int device) {
    if (device < 0 || device >= ggml_cuda_info().device_count) {
        return false;
    }
    cudaStream_t stream = ggml_cuda_copy_stream(device);
    ggml_cuda_set_device(device);
    return cudaStreamSynchronize(stream) == cudaSuccess;
}
