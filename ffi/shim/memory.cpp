// What a context holds on one device, from llama.cpp's own accounting of its buffers.

#include "strata_shim.h"

#include "llama-ext.h"

int strata_device_memory(const struct llama_context * ctx, ggml_backend_dev_t dev, size_t * model, size_t * context, size_t * compute) {
    try {
        *model = *context = *compute = 0;
        // the CPU's own buffer types name no device: host memory is the CPU device's
        const bool cpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
        for (const auto & [buft, mb] : llama_get_memory_breakdown(ctx)) {
            const ggml_backend_dev_t d = ggml_backend_buft_get_device(buft);
            const bool host = ggml_backend_buft_is_host(buft);
            // a GPU's page-locked host buffers live in RAM, not on the card
            const bool on_dev = cpu ? host && (d == nullptr || d == dev) : d == dev && !host;
            if (!on_dev) {
                continue;
            }
            *model += mb.model;
            *context += mb.context;
            *compute += mb.compute;
        }
        return 0;
    } catch (...) {
        return -1;
    }
}
