#pragma once

// What the shim's translation units share: handle types used by several, string results, the exception fence.

#include "strata_shim.h"

#include "common.h"
#include "json.h"
#include "sampling.h"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

using json = nlohmann::ordered_json;

struct strata_params {
    common_params params;
};

struct strata_sampler {
    common_params_sampling params;
    common_sampler *       smpl = nullptr;
    // The chain picks the first token of highest logit whenever that token is unique: a scan of
    // the logits answers instead of the chain (see sampler_is_argmax).
    bool                          argmax_ok = false;  // the settings allow it
    bool                          argmax    = false;  // in use
    std::vector<llama_logit_bias> bias;  // the chain's logit biases, suppressed tokens included
    llama_token                   scanned = LLAMA_TOKEN_NULL;  // the last sample, when the scan gave it
};

static inline char * dup_string(const std::string & s) {
    char * out = static_cast<char *>(std::malloc(s.size() + 1));
    if (out) {
        std::memcpy(out, s.data(), s.size());
        out[s.size()] = '\0';
    }
    return out;
}

static inline void set_err(char ** err, const std::string & msg) {
    if (err) {
        *err = dup_string(msg);
    }
}

// The class of the last exception guarded() caught on this thread (strata_last_error_kind).
inline thread_local int g_error_kind = STRATA_ERROR_OTHER;

// Runs f, turning any C++ exception into *err and the fallback value.
template <typename T, typename F>
static inline T guarded(char ** err, T fallback, F && f) {
    g_error_kind = STRATA_ERROR_OTHER;
    try {
        return f();
    } catch (const std::invalid_argument & e) {
        g_error_kind = STRATA_ERROR_INVALID_ARGUMENT;
        set_err(err, e.what());
    } catch (const common_json_error & e) {
        g_error_kind = STRATA_ERROR_JSON;
        set_err(err, e.what());
    } catch (const nlohmann::ordered_json::exception & e) {
        g_error_kind = STRATA_ERROR_JSON;
        set_err(err, e.what());
    } catch (const std::exception & e) {
        set_err(err, e.what());
    } catch (...) {
        set_err(err, "unknown C++ exception");
    }
    return fallback;
}
