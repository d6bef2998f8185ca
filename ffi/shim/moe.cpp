#include "common.hpp"

#include "ggml-cpu.h"

#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <string>

// ---- MoE experts ----------------------------------------------------------------------------

using cpu_traits_fn = const struct ggml_type_traits_cpu * (*)(enum ggml_type);

static cpu_traits_fn find_cpu_traits() {
    std::string path;
    dl_iterate_phdr([](struct dl_phdr_info * info, size_t, void * data) -> int {
        const char * name = info->dlpi_name;
        if (name == nullptr) {
            return 0;
        }
        const char * slash = strrchr(name, '/');
        const char * base = slash ? slash + 1 : name;
        if (strncmp(base, "libggml-cpu", strlen("libggml-cpu")) == 0) {
            *static_cast<std::string *>(data) = name;
            return 1;
        }
        return 0;
    }, &path);
    if (path.empty()) {
        return nullptr;
    }
    void * handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) {
        return nullptr;
    }
    return reinterpret_cast<cpu_traits_fn>(dlsym(handle, "ggml_get_type_traits_cpu"));
}

const struct ggml_type_traits_cpu * strata_cpu_type_traits(int type) {
    try {
        static cpu_traits_fn fn = find_cpu_traits();
        if (fn == nullptr || type < 0 || type >= GGML_TYPE_COUNT) {
            return nullptr;
        }
        return fn(static_cast<enum ggml_type>(type));
    } catch (...) {
        return nullptr;
    }
}
