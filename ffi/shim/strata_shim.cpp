#include "strata_shim.h"

#include "arg.h"
#include "build-info.h"
#include "chat.h"
#include "common.h"
#include "json-schema-to-grammar.h"
#include "json.h"
#include "log.h"
#include "sampling.h"
#include "speculative.h"
#include "preset.h"
#include "download.h"
#include "fit.h"
#include "ggml-cpu.h"

#include <dlfcn.h>
#include <link.h>
#include <unistd.h>
#include <set>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>

using json = nlohmann::ordered_json;

struct strata_params {
    common_params params;
};

struct strata_chat_templates {
    common_chat_templates_ptr tmpls;
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

struct strata_speculative {
    common_speculative_init_result_ptr init;
    common_speculative *               spec = nullptr;
    llama_tokens                       prompt;
    llama_tokens                       result;
    std::vector<std::mt19937>          synth_rng; // per sequence, for --spec-synth-* acceptance
};

static char * dup_string(const std::string & s) {
    char * out = static_cast<char *>(std::malloc(s.size() + 1));
    if (out) {
        std::memcpy(out, s.data(), s.size());
        out[s.size()] = '\0';
    }
    return out;
}

static void set_err(char ** err, const std::string & msg) {
    if (err) {
        *err = dup_string(msg);
    }
}

// The class of the last exception guarded() caught on this thread (strata_last_error_kind).
static thread_local int g_error_kind = STRATA_ERROR_OTHER;

// Runs f, turning any C++ exception into *err and the fallback value.
template <typename T, typename F>
static T guarded(char ** err, T fallback, F && f) {
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

int strata_last_error_kind(void) {
    return g_error_kind;
}

void strata_string_free(char * s) {
    std::free(s);
}

void strata_stdio_flush(void) {
    try {
        common_log_flush(common_log_main());
    } catch (...) {
    }
    std::fflush(nullptr);
}

bool strata_common_init(char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_init();
        return true;
    });
}

// A log line that cannot be written is dropped: logging must never fail a request.
void strata_log_info(const char * text) {
    try {
        LOG_INF("%s", text);
    } catch (...) {
    }
}

void strata_log(int level, const char * text) {
    try {
        switch (level) {
            case 1:  LOG_ERR("%s", text); break;
            case 2:  LOG_WRN("%s", text); break;
            case 4:  LOG_TRC("%s", text); break;
            case 5:  LOG_DBG("%s", text); break;
            default: LOG_INF("%s", text); break;
        }
    } catch (...) {
    }
}

// llama.cpp's lines that start with these are dropped; the rest go to the logger as before.
static std::vector<std::string> g_log_muted;
static ggml_log_callback g_log_next = nullptr;
static void * g_log_next_data = nullptr;

static void log_filter(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    for (const auto & m : g_log_muted) {
        if (text != nullptr && std::strncmp(text, m.c_str(), m.size()) == 0) {
            return;
        }
    }
    if (g_log_next != nullptr) {
        g_log_next(level, text, g_log_next_data);
    }
}

void strata_log_mute(const char * prefix) {
    try {
        if (g_log_muted.empty()) {
            llama_log_get(&g_log_next, &g_log_next_data);
            llama_log_set(log_filter, nullptr);
        }
        g_log_muted.emplace_back(prefix);
    } catch (...) {
    }
}

// ---- JSON -----------------------------------------------------------------------------------

char * strata_json_parse_error(const char * data, size_t len) {
    try {
        (void) common_json::parse(std::string(data, len));
        return nullptr;
    } catch (const std::exception & e) {
        return dup_string(e.what());
    } catch (...) {
        return dup_string("unknown JSON error");
    }
}

// ---- arguments ------------------------------------------------------------------------------

strata_params * strata_params_parse(int argc, char ** argv, strata_usage_fn usage) {
    auto * p = new strata_params;
    try {
        if (common_params_parse(argc, argv, p->params, LLAMA_EXAMPLE_SERVER, usage)) {
            return p;
        }
    } catch (const std::exception & e) {
        fprintf(stderr, "error: %s\n", e.what());
    } catch (...) {
        fprintf(stderr, "error: unknown C++ exception while parsing arguments\n");
    }
    delete p;
    return nullptr;
}

static void params_server_defaults(strata_params * p) {
    common_params & params = p->params;
    if (params.embedding && params.n_batch > params.n_ubatch) {
        LOG_WRN("embeddings enabled with n_batch (%d) > n_ubatch (%d)\n", params.n_batch, params.n_ubatch);
        LOG_WRN("setting n_batch = n_ubatch = %d to avoid assertion failure\n", params.n_ubatch);
        params.n_batch = params.n_ubatch;
    }
    if (params.n_parallel < 0) {
        LOG_TRC("srv  %12.*s: n_parallel is set to auto, using n_parallel = 4 and kv_unified = true\n", 12, "llama_server");
        params.n_parallel = 4;
        params.kv_unified = true;
    }
    const bool ctx_pool_auto_sized = params.kv_unified_per_slot > 0 && params.n_ctx == 0 &&
                                     (uint32_t) params.fit_params_min_ctx != UINT32_MAX;
    if (ctx_pool_auto_sized) {
        params.n_ctx = params.n_parallel * params.kv_unified_per_slot;
    }
    const std::string model_name = params.model.get_name();
    if (params.model_alias.empty() && !model_name.empty()) {
        params.model_alias.insert(model_name);
    }
    // Outputs a step may ask for: one per slot, plus drafts (llama-server's server_output_limits).
    const bool pooled = params.embedding ||
        (params.pooling_type != LLAMA_POOLING_TYPE_UNSPECIFIED && params.pooling_type != LLAMA_POOLING_TYPE_NONE);
    if (pooled) {
        params.n_outputs_max         = params.n_batch;
        params.n_outputs_max_per_seq = 1;
    } else {
        const auto limits = common_speculative_get_output_limits(
            params.n_batch, params.n_parallel, common_speculative_n_max(&params.speculative));
        params.n_outputs_max         = std::max<int32_t>(1, limits.total);
        params.n_outputs_max_per_seq = std::max<int32_t>(1, limits.per_seq);
    }
}

bool strata_params_server_defaults(strata_params * p, char ** err) {
    return guarded<bool>(err, false, [&]() {
        params_server_defaults(p);
        return true;
    });
}

void strata_params_free(strata_params * p) {
    delete p;
}

static json sampling_json(const common_params_sampling & s) {
    return json{
        {"seed", s.seed},
        {"n_probs", s.n_probs},
        {"min_keep", s.min_keep},
        {"top_k", s.top_k},
        {"top_p", s.top_p},
        {"min_p", s.min_p},
        {"xtc_probability", s.xtc_probability},
        {"xtc_threshold", s.xtc_threshold},
        {"typ_p", s.typ_p},
        {"temp", s.temp},
        {"dynatemp_range", s.dynatemp_range},
        {"dynatemp_exponent", s.dynatemp_exponent},
        {"penalty_last_n", s.penalty_last_n},
        {"penalty_repeat", s.penalty_repeat},
        {"penalty_freq", s.penalty_freq},
        {"penalty_present", s.penalty_present},
        {"dry_multiplier", s.dry_multiplier},
        {"dry_base", s.dry_base},
        {"dry_allowed_length", s.dry_allowed_length},
        {"dry_penalty_last_n", s.dry_penalty_last_n},
        {"mirostat", s.mirostat},
        {"mirostat_tau", s.mirostat_tau},
        {"mirostat_eta", s.mirostat_eta},
        {"top_n_sigma", s.top_n_sigma},
        {"adaptive_target", s.adaptive_target},
        {"adaptive_decay", s.adaptive_decay},
        {"ignore_eos", s.ignore_eos},
        {"grammar", s.grammar.grammar},
    };
}

static char * params_json(const strata_params * p) {
    const common_params & c = p->params;
    json j = {
        {"model", c.model.path},
        {"model_alias", json(c.model_alias)},
        {"hostnames", c.hostnames},
        {"port", c.port},
        {"api_prefix", c.api_prefix},
        {"api_keys", c.api_keys},
        {"cors_origins", c.cors_origins},
        {"cors_methods", c.cors_methods},
        {"cors_headers", c.cors_headers},
        {"cors_credentials", c.cors_credentials},
        {"model_tags", json(c.model_tags)},
        {"public_path", c.public_path},
        {"ui", c.ui},
        {"timeout_read", c.timeout_read},
        {"timeout_write", c.timeout_write},
        {"n_threads_http", c.n_threads_http},
        {"load_mode", (int) c.load_mode},
        {"main_gpu", c.main_gpu},
        {"n_ctx", c.n_ctx},
        {"n_batch", c.n_batch},
        {"n_ubatch", c.n_ubatch},
        {"n_keep", c.n_keep},
        {"n_parallel", c.n_parallel},
        {"kv_unified", c.kv_unified},
        {"n_predict", c.n_predict},
        {"spm_infill", c.spm_infill},
        {"n_cache_reuse", c.n_cache_reuse},
        {"cache_ram_mib", c.cache_ram_mib},
        {"cache_idle_slots", c.cache_idle_slots},
        {"n_ctx_checkpoints", c.n_ctx_checkpoints},
        {"checkpoint_min_step", c.checkpoint_min_step},
        {"swa_full", c.swa_full},
        {"slot_prompt_similarity", c.slot_prompt_similarity},
        {"speculative", {
            {"types", common_speculative_type_name_str(c.speculative.types)},
            {"has_draft_model", c.speculative.has_dft()},
            {"enabled", c.speculative.has_dft() ||
                        std::any_of(c.speculative.types.begin(), c.speculative.types.end(),
                                    [](common_speculative_type t) { return t != COMMON_SPECULATIVE_TYPE_NONE; })},
        }},
        {"ctx_shift", c.ctx_shift},
        {"cont_batching", c.cont_batching},
        {"antiprompt", c.antiprompt},
        {"special", c.special},
        {"cache_prompt", c.cache_prompt},
        {"kv_unified_per_slot", c.kv_unified_per_slot},
        {"path_prompts_log_dir", c.path_prompts_log_dir},
        {"chat_template", c.chat_template},
        {"use_jinja", c.use_jinja},
        {"enable_chat_template", c.enable_chat_template},
        {"reasoning_format", common_reasoning_format_name(c.reasoning_format)},
        {"enable_reasoning", c.enable_reasoning},
        {"sleep_idle_seconds", c.sleep_idle_seconds},
        {"slot_save_path", c.slot_save_path},
        {"endpoint_slots", c.endpoint_slots},
        {"endpoint_props", c.endpoint_props},
        {"endpoint_metrics", c.endpoint_metrics},
        {"embedding", c.embedding},
        {"pooling_type", (int) c.pooling_type},
        {"lora_adapters", [&] {
            json a = json::array();
            for (const auto & la : c.lora_adapters) {
                a.push_back({{"path", la.path}, {"scale", la.scale}});
            }
            return a;
        }()},
        {"embd_normalize", c.embd_normalize},
        {"verbosity", c.verbosity},
        {"fit_params", c.fit_params},
        {"sampling", sampling_json(c.sampling)},
    };
    // agent features: built-in tools, MCP servers, the Web UI's CORS proxy
    j["ui_mcp_proxy"] = c.ui_mcp_proxy;
    j["prefill_assistant"] = c.prefill_assistant;
    j["force_pure_content"] = c.force_pure_content_parser;
    j["default_template_kwargs"] = c.default_template_kwargs;
    j["reasoning_budget"] = c.sampling.reasoning_budget_tokens;
    j["reasoning_budget_message"] = c.sampling.reasoning_budget_message;
    j["server_tools"] = c.server_tools;
    j["server_tools_runtime"] = c.server_tools_runtime;
    j["mcp_servers_config"] = c.mcp_servers_config;
    j["mcp_servers_json"] = c.mcp_servers_json;
    // router mode
    j["hf_repo"]         = c.model.hf_repo;
    j["docker_repo"]     = c.model.docker_repo;
    j["models_dir"]      = c.models_dir;
    j["models_preset"]   = c.models_preset;
    j["models_max"]      = c.models_max;
    j["models_autoload"] = c.models_autoload;
    j["ui_config_json"]  = c.ui_config_json;
    j["hf_token"]        = c.hf_token;
    // HTTP: TLS, sockets, SSE keep-alive
    j["ssl_file_key"]      = c.ssl_file_key;
    j["ssl_file_cert"]     = c.ssl_file_cert;
    j["reuse_port"]        = c.reuse_port;
    j["sse_ping_interval"] = c.sse_ping_interval;
    // multimodal input, which strata-server refuses at start-up
    j["mmproj"]                      = c.mmproj.path;
    j["mmproj_url"]                  = c.mmproj.url;
    // the projector's device follows -dev (-dev none turns its offload off) unless -mmdev names another
    j["mmproj_use_gpu"]              = c.mmproj_use_gpu || (!c.devices.empty() && c.devices.front() == nullptr && c.mmproj_device == nullptr);
    j["mmproj_device"]               = c.mmproj_device != nullptr && (c.devices.empty() || c.devices.front() != c.mmproj_device)
                                           ? ggml_backend_dev_name(c.mmproj_device) : "";
    j["image_min_tokens"]            = c.image_min_tokens;
    j["image_max_tokens"]            = c.image_max_tokens;
    j["mtmd_batch_max_tokens"]       = c.mtmd_batch_max_tokens;
    j["video_fps"]                   = c.video_fps;
    j["video_timestamp_interval_ms"] = c.video_timestamp_interval_ms;
    j["video_ffmpeg_bin_dir"]        = c.video_ffmpeg_bin_dir;
    j["media_path"]                  = c.media_path;
    // sampling on the backend and probabilistic draft verification, refused at start-up too
    j["backend_sampling"]            = c.sampling.backend_sampling;
    j["spec_draft_probabilistic"]    = c.speculative.draft.probabilistic;
    return dup_string(j.dump());
}

char * strata_params_json(const strata_params * p, char ** err) {
    return guarded<char *>(err, nullptr, [&]() { return params_json(p); });
}

// What llama.cpp gets from the parsed options: the model and context parameters of the target
// and of the draft (as common_base_params_to_speculative makes them), for tests that check an
// option reaches them.
static json model_params_view(const llama_model_params & m) {
    // null: every device; [] (-dev none): none
    json devices = m.devices == nullptr ? json(nullptr) : json::array();
    for (auto * d = m.devices; d != nullptr && *d != nullptr; ++d) {
        devices.push_back(ggml_backend_dev_name(*d));
    }
    json overrides = json::array();
    for (auto * o = m.tensor_buft_overrides; o != nullptr && o->pattern != nullptr; ++o) {
        overrides.push_back(std::string(o->pattern) + "=" + (o->buft ? ggml_backend_buft_name(o->buft) : "?"));
    }
    json kv = json::array();
    for (auto * o = m.kv_overrides; o != nullptr && o->key[0] != 0; ++o) {
        kv.push_back(o->key);
    }
    json split = json::array();
    for (size_t i = 0; m.tensor_split != nullptr && i < llama_max_devices(); ++i) {
        split.push_back(m.tensor_split[i]);
    }
    return {
        {"devices", devices}, {"tensor_buft_overrides", overrides}, {"n_gpu_layers", m.n_gpu_layers},
        {"split_mode", (int) m.split_mode}, {"load_mode", (int) m.load_mode}, {"lazy_mode", (int) m.lazy_mode},
        {"main_gpu", m.main_gpu}, {"tensor_split", split}, {"kv_overrides", kv}, {"vocab_only", m.vocab_only},
        {"check_tensors", m.check_tensors}, {"use_extra_bufts", m.use_extra_bufts}, {"no_host", m.no_host},
        {"no_alloc", m.no_alloc}, {"load_mtp", m.load_mtp},
    };
}

static json context_params_view(const llama_context_params & c) {
    return {
        {"n_ctx", c.n_ctx}, {"n_batch", c.n_batch}, {"n_ubatch", c.n_ubatch}, {"n_seq_max", c.n_seq_max},
        {"n_rs_seq", c.n_rs_seq}, {"n_outputs_max", c.n_outputs_max}, {"n_outputs_max_per_seq", c.n_outputs_max_per_seq},
        {"n_threads", c.n_threads}, {"n_threads_batch", c.n_threads_batch}, {"ctx_type", (int) c.ctx_type},
        {"rope_scaling_type", (int) c.rope_scaling_type}, {"pooling_type", (int) c.pooling_type},
        {"attention_type", (int) c.attention_type}, {"flash_attn_type", (int) c.flash_attn_type},
        {"rope_freq_base", c.rope_freq_base}, {"rope_freq_scale", c.rope_freq_scale},
        {"yarn_ext_factor", c.yarn_ext_factor}, {"yarn_attn_factor", c.yarn_attn_factor},
        {"yarn_beta_fast", c.yarn_beta_fast}, {"yarn_beta_slow", c.yarn_beta_slow}, {"yarn_orig_ctx", c.yarn_orig_ctx},
        {"type_k", ggml_type_name(c.type_k)}, {"type_v", ggml_type_name(c.type_v)}, {"embeddings", c.embeddings},
        {"offload_kqv", c.offload_kqv}, {"no_perf", c.no_perf}, {"op_offload", c.op_offload},
        {"swa_full", c.swa_full}, {"kv_unified", c.kv_unified},
    };
}

char * strata_params_llama_json(strata_params * p, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        common_params draft = common_base_params_to_speculative(p->params);
        json j = {
            {"model", model_params_view(common_model_params_to_llama(p->params))},
            {"context", context_params_view(common_context_params_to_llama(p->params))},
            {"draft_model", model_params_view(common_model_params_to_llama(draft))},
            {"draft_context", context_params_view(common_context_params_to_llama(draft))},
            // what strata_backend_init hands llama_numa_init
            {"backend", {{"numa", (int) p->params.numa}}},
        };
        return dup_string(j.dump());
    });
}

void strata_params_print_info(const strata_params * p, bool print_devices) {
    try {
        common_params_print_info(p->params, print_devices);
    } catch (...) {
    }
}

// The parameters before any option: llama-server's defaults for comparing the parsed ones.
char * strata_params_default_json(char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        strata_params p;
        common_params_parser_init(p.params, LLAMA_EXAMPLE_SERVER);
        return params_json(&p);
    });
}

struct llama_model_params strata_params_model(strata_params * p, char ** err) {
    return guarded<llama_model_params>(err, llama_model_default_params(), [&]() { return common_model_params_to_llama(p->params); });
}

struct llama_context_params strata_params_context(const strata_params * p, char ** err) {
    return guarded<llama_context_params>(err, llama_context_default_params(), [&]() { return common_context_params_to_llama(p->params); });
}

bool strata_backend_init(const strata_params * p, char ** err) {
    return guarded<bool>(err, false, [&]() {
        llama_backend_init();
        llama_numa_init(p->params.numa);
        return true;
    });
}

// ---- model and context set-up (what common_init_from_params does around llama.h's calls) ----

// common.h's COM_* lines name the function that logs them: these stand in for upstream's.
#define STRATA_COM_LOG(LEVEL, func, fmt, ...) LEVEL("cmn  %12.*s: " fmt, 12, func, __VA_ARGS__)
static const char * const COMMON_INIT_RESULT = "common_init_result";
static const char * const COMMON_INIT_FROM_PARAMS = "common_init_from_params";

static int32_t params_fit(common_params & params) {
    if (!params.fit_params) {
        return -1;
    }
    auto mparams = common_model_params_to_llama(params);
    auto cparams = common_context_params_to_llama(params);

    STRATA_COM_LOG(LOG_TRC, COMMON_INIT_RESULT, "%s", "fitting params to device memory ...\n");
    STRATA_COM_LOG(LOG_TRC, COMMON_INIT_RESULT, "%s", "(for bugs during this step try to reproduce them with -fit off, or provide --verbose logs if the bug only occurs with -fit on)\n");

    // the draft context is created from the same base params and follows the main context, fit both together
    const bool has_draft = params.speculative.has_dft();
    const bool spec_mtp  = std::find(params.speculative.types.begin(), params.speculative.types.end(),
        COMMON_SPECULATIVE_TYPE_DRAFT_MTP) != params.speculative.types.end();

    common_params params_dft = common_base_params_to_speculative(params);

    auto mparams_dft = common_model_params_to_llama(params_dft);
    auto cparams_dft = common_context_params_to_llama(params_dft);
    if (spec_mtp) {
        cparams_dft.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    }
    cparams_dft.n_rs_seq = 0;

    const common_fit_extra_model extra = {
        /*.path_model   =*/ params_dft.model.path.c_str(),
        /*.mparams      =*/ &mparams_dft,
        /*.cparams      =*/ &cparams_dft,
        /*.shares_model =*/ !has_draft, // an MTP context runs on the weights of the main model
    };

    const common_params_fit_status status = common_fit_params(params.model.path.c_str(), &mparams, &cparams,
        params.tensor_split,
        params.tensor_buft_overrides.data(),
        params.fit_params_target.data(),
        params.fit_params_min_ctx,
        has_draft || spec_mtp ? &extra : nullptr,
        params.verbosity >= LOG_LEVEL_DEBUG ? GGML_LOG_LEVEL_DEBUG : GGML_LOG_LEVEL_ERROR);

    // The split and the overrides were written in place; the rest goes back into the params, which
    // every later context (a wake from sleep, the draft's) is made from.
    params.n_gpu_layers = mparams.n_gpu_layers;
    params.n_ctx        = cparams.n_ctx;
    return static_cast<int32_t>(status);
}

int32_t strata_params_fit(strata_params * p, char ** err) {
    return guarded<int32_t>(err, -2, [&]() { return params_fit(p->params); });
}

// common.cpp's common_init_sampler_from_model, which is static there: the model file's
// general.sampling.* values replace the defaults of the settings the command line left alone.
static void sampler_defaults_from_model(const llama_model * model, common_params_sampling & sparams) {
    const uint64_t config = sparams.user_sampling_config;

    auto get_int32 = [&](const char * key, int32_t & dst, uint64_t user_config) {
        if (config & user_config) {
            return;
        }
        char buf[64] = {0};
        if (llama_model_meta_val_str(model, key, buf, sizeof(buf)) > 0) {
            char * end = nullptr;
            int32_t v = strtol(buf, &end, 10);
            if (end && end != buf) {
                dst = v;
            }
        }
    };

    auto get_float = [&](const char * key, float & dst, uint64_t user_config) {
        if (config & user_config) {
            return;
        }
        char buf[128] = {0};
        if (llama_model_meta_val_str(model, key, buf, sizeof(buf)) > 0) {
            char * end = nullptr;
            float v = strtof(buf, &end);
            if (end && end != buf) {
                dst = v;
            }
        }
    };

    if (!(config & common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_SAMPLERS)) {
        char buf[512] = {0};
        if (llama_model_meta_val_str(model, llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_SEQUENCE), buf, sizeof(buf)) > 0) {
            const std::vector<std::string> sampler_names = string_split<std::string>(std::string(buf), ';');
            if (!sampler_names.empty()) {
                sparams.samplers = common_sampler_types_from_names(sampler_names);
            }
        }
    }

    get_int32(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_TOP_K),           sparams.top_k,           common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_TOP_K);
    get_float(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_TOP_P),           sparams.top_p,           common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_TOP_P);
    get_float(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_MIN_P),           sparams.min_p,           common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_MIN_P);
    get_float(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_XTC_PROBABILITY), sparams.xtc_probability, common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_XTC_PROBABILITY);
    get_float(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_XTC_THRESHOLD),   sparams.xtc_threshold,   common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_XTC_THRESHOLD);
    get_float(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_TEMP),            sparams.temp,            common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_TEMP);
    get_int32(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_PENALTY_LAST_N),  sparams.penalty_last_n,  common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_PENALTY_LAST_N);
    get_float(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_PENALTY_REPEAT),  sparams.penalty_repeat,  common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_PENALTY_REPEAT);
    get_int32(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_MIROSTAT),        sparams.mirostat,        common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_MIROSTAT);
    get_float(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_MIROSTAT_TAU),    sparams.mirostat_tau,    common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_MIROSTAT_TAU);
    get_float(llama_model_meta_key_str(LLAMA_MODEL_META_KEY_SAMPLING_MIROSTAT_ETA),    sparams.mirostat_eta,    common_params_sampling_config::COMMON_PARAMS_SAMPLING_CONFIG_MIROSTAT_ETA);
}

static void params_init_sampling(common_params & params, const llama_model * model) {
    const llama_vocab * vocab = llama_model_get_vocab(model);

    sampler_defaults_from_model(model, params.sampling);

    if (params.sampling.ignore_eos && llama_vocab_eos(vocab) == LLAMA_TOKEN_NULL) {
        STRATA_COM_LOG(LOG_WRN, COMMON_INIT_RESULT, "%s", "vocab does not have an EOS token, ignoring --ignore-eos\n");
        params.sampling.ignore_eos = false;
    }

    params.sampling.logit_bias_eog.clear();
    for (llama_token i = 0; i < llama_vocab_n_tokens(vocab); i++) {
        if (llama_vocab_is_eog(vocab, i)) {
            STRATA_COM_LOG(LOG_TRC, COMMON_INIT_RESULT, "added %s logit bias = %f\n", common_token_to_piece(vocab, i).c_str(), -INFINITY);
            params.sampling.logit_bias_eog.push_back({i, -INFINITY});
        }
    }

    if (params.sampling.ignore_eos) {
        params.sampling.logit_bias.insert(
                params.sampling.logit_bias.end(),
                params.sampling.logit_bias_eog.begin(), params.sampling.logit_bias_eog.end());
    }
}

bool strata_params_init_sampling(strata_params * p, const struct llama_model * model, char ** err) {
    return guarded<bool>(err, false, [&]() {
        params_init_sampling(p->params, model);
        return true;
    });
}

struct strata_threadpools {
    common_threadpools pools;
};

strata_threadpools * strata_threadpools_init(const strata_params * p, struct llama_context * ctx, char ** err) {
    return guarded<strata_threadpools *>(err, nullptr, [&]() {
        set_process_priority(p->params.cpuparams.priority);
        auto * t = new strata_threadpools;
        t->pools.init(ctx, p->params);
        return t;
    });
}

void strata_threadpools_free(strata_threadpools * t) {
    try {
        delete t;
    } catch (...) {
    }
}

// The rest of common_init_from_params once the context exists; each early return there skips
// what follows it, as here. The LoRA adapters are the engine's to apply, per batch.
static void context_setup(common_params & params, llama_context * lctx) {
    const llama_model * model = llama_get_model(lctx);
    const llama_vocab * vocab = llama_model_get_vocab(model);

    if (params.ctx_shift && !llama_memory_can_shift(llama_get_memory(lctx))) {
        STRATA_COM_LOG(LOG_WRN, COMMON_INIT_FROM_PARAMS, "%s", "KV cache shifting is not supported for this context, disabling KV cache shifting\n");
        params.ctx_shift = false;
    }

    if (!params.control_vectors.empty()) {
        if (params.control_vector_layer_start <= 0) params.control_vector_layer_start = 1;
        if (params.control_vector_layer_end   <= 0) params.control_vector_layer_end   = llama_model_n_layer(model);

        const auto cvec = common_control_vector_load(params.control_vectors);
        if (cvec.n_embd == -1) {
            return;
        }

        int err = llama_set_adapter_cvec(
                lctx,
                cvec.data.data(),
                cvec.data.size(),
                cvec.n_embd,
                params.control_vector_layer_start,
                params.control_vector_layer_end);
        if (err) {
            return;
        }
    }

    if (llama_pooling_type(lctx) == LLAMA_POOLING_TYPE_RANK) {
        bool ok = true;

        if (llama_vocab_bos(vocab) == LLAMA_TOKEN_NULL) {
            STRATA_COM_LOG(LOG_WRN, COMMON_INIT_FROM_PARAMS, "%s", "vocab does not have a  BOS token, reranking will not work\n");
            ok = false;
        }

        bool has_eos = llama_vocab_eos(vocab) != LLAMA_TOKEN_NULL;
        bool has_sep = llama_vocab_sep(vocab) != LLAMA_TOKEN_NULL;
        bool has_rerank_prompt = llama_model_chat_template(model, "rerank") != NULL;

        if (!has_eos && !has_sep && !has_rerank_prompt) {
            STRATA_COM_LOG(LOG_WRN, COMMON_INIT_FROM_PARAMS, "%s", "vocab does not have an EOS token, SEP token, or rerank prompt. Reranking will not work\n");
            ok = false;
        } else if (!has_eos) {
            STRATA_COM_LOG(LOG_WRN, COMMON_INIT_FROM_PARAMS, "%s", "vocab does not have an EOS token, using SEP token as fallback\n");
        }

        if (!ok) {
            return;
        }
    }

    if (params.warmup) {
        STRATA_COM_LOG(LOG_TRC, COMMON_INIT_FROM_PARAMS, "%s", "warming up the model with an empty run - please wait ... (--no-warmup to disable)\n");

        std::vector<llama_token> tmp;
        llama_token bos = llama_vocab_bos(vocab);
        llama_token eos = llama_vocab_eos(vocab);

        // some models (e.g. T5) don't have a BOS token
        if (bos != LLAMA_TOKEN_NULL) {
            tmp.push_back(bos);
        }
        if (eos != LLAMA_TOKEN_NULL) {
            tmp.push_back(eos);
        }
        if (tmp.empty()) {
            tmp.push_back(0);
        }

        if (llama_model_has_encoder(model)) {
            common_batch batch = common_batch_get_one(lctx, tmp);
            llama_process(lctx, LLAMA_PROCESS_TYPE_ENCODE, batch.get());
            llama_token decoder_start_token_id = llama_model_decoder_start_token(model);
            if (decoder_start_token_id == LLAMA_TOKEN_NULL) {
                decoder_start_token_id = bos;
            }
            tmp.clear();
            tmp.push_back(decoder_start_token_id);
        }
        if (llama_model_has_decoder(model)) {
            tmp.resize(std::min(tmp.size(), (size_t) params.n_batch));
            common_batch batch = common_batch_get_one(lctx, tmp);
            llama_process(lctx, LLAMA_PROCESS_TYPE_DECODE, batch.get());
        }
        llama_memory_clear(llama_get_memory(lctx), true);
        llama_synchronize(lctx);
        llama_perf_context_reset(lctx);
    }
}

bool strata_context_setup(strata_params * p, struct llama_context * ctx, char ** err) {
    return guarded<bool>(err, false, [&]() {
        context_setup(p->params, ctx);
        return true;
    });
}

// ---- chat templates -------------------------------------------------------------------------

strata_chat_templates * strata_chat_templates_init(const struct llama_model * model, const char * tmpl_override, char ** err) {
    return guarded<strata_chat_templates *>(err, nullptr, [&]() -> strata_chat_templates * {
        auto t = common_chat_templates_init(model, tmpl_override ? tmpl_override : "");
        if (!t) {
            set_err(err, "failed to initialise chat templates");
            return nullptr;
        }
        return new strata_chat_templates{std::move(t)};
    });
}

void strata_chat_templates_free(strata_chat_templates * t) {
    delete t;
}

static common_chat_templates_inputs inputs_from_json(const json & j) {
    common_chat_templates_inputs in;
    in.messages = common_chat_msgs_parse_oaicompat(common_json::parse(j.at("messages").dump()));
    if (j.contains("tools") && !j.at("tools").is_null()) {
        in.tools = common_chat_tools_parse_oaicompat(common_json::parse(j.at("tools").dump()));
    }
    if (j.contains("tool_choice")) {
        in.tool_choice = common_chat_tool_choice_parse_oaicompat(j.at("tool_choice").get<std::string>());
    }
    in.add_generation_prompt = j.value("add_generation_prompt", true);
    if (j.contains("continue_final_message")) {
        in.continue_final_message = common_chat_continuation_parse(common_json::parse(j.at("continue_final_message").dump()));
    }
    in.use_jinja             = j.value("use_jinja", true);
    in.enable_thinking       = j.value("enable_thinking", true);
    in.parallel_tool_calls   = j.value("parallel_tool_calls", false);
    in.json_schema           = j.value("json_schema", std::string());
    in.grammar               = j.value("grammar", std::string());
    in.add_bos               = j.value("add_bos", false);
    in.force_pure_content    = j.value("force_pure_content", false);
    in.add_eos               = j.value("add_eos", false);
    in.reasoning_format      = common_reasoning_format_from_name(j.value("reasoning_format", std::string("none")));
    if (j.contains("chat_template_kwargs")) {
        for (const auto & [k, v] : j.at("chat_template_kwargs").items()) {
            in.chat_template_kwargs[k] = v.dump();
        }
    }
    return in;
}

static json trigger_json(const common_grammar_trigger & t) {
    return json{{"type", static_cast<int>(t.type)}, {"value", t.value}, {"token", t.token}};
}

char * strata_chat_templates_apply(const strata_chat_templates * t, const char * inputs_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() -> char * {
        const common_chat_params out = common_chat_templates_apply(t->tmpls.get(), inputs_from_json(json::parse(inputs_json)));
        json triggers = json::array();
        for (const auto & tr : out.grammar_triggers) {
            triggers.push_back(trigger_json(tr));
        }
        json delimiters = json::array();
        for (const auto & d : out.message_delimiters.delimiters) {
            delimiters.push_back({{"role", common_chat_role_to_string(d.role)}, {"delimiter", d.delimiter}});
        }
        json j = {
            {"prompt", out.prompt},
            {"format", static_cast<int>(out.format)},
            {"format_name", common_chat_format_name(out.format)},
            {"grammar", out.grammar},
            {"grammar_lazy", out.grammar_lazy},
            {"generation_prompt", out.generation_prompt},
            {"message_delimiters", delimiters},
            {"grammar_triggers", triggers},
            {"preserved_tokens", out.preserved_tokens},
            {"additional_stops", out.additional_stops},
            {"supports_thinking", out.supports_thinking},
            {"thinking_start_tag", out.thinking_start_tag},
            {"thinking_end_tags", out.thinking_end_tags},
            {"parser", out.parser},
        };
        return dup_string(j.dump());
    });
}

char * strata_chat_parse_inputs(const char * inputs_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        const json j = json::parse(inputs_json);
        const auto msgs  = common_chat_msgs_parse_oaicompat(common_json::parse(j.at("messages").dump()));
        const auto tools = common_chat_tools_parse_oaicompat(common_json::parse(j.at("tools").dump()));
        const auto choice = common_chat_tool_choice_parse_oaicompat(j.at("tool_choice").get<std::string>());
        json roles = json::array();
        for (const auto & m : msgs) {
            roles.push_back(m.role);
        }
        const json out = {
            {"roles", roles},
            {"last_has_tool_calls", !msgs.empty() && !msgs.back().tool_calls.empty()},
            {"n_tools", tools.size()},
            {"tool_choice_none", choice == COMMON_CHAT_TOOL_CHOICE_NONE},
        };
        return dup_string(out.dump());
    });
}

char * strata_chat_templates_source(const strata_chat_templates * t, const char * variant, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        return dup_string(common_chat_templates_source(t->tmpls.get(), variant ? variant : ""));
    });
}

char * strata_chat_templates_caps(const strata_chat_templates * t, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        json caps = json::object();
        for (const auto & [k, v] : common_chat_templates_get_caps(t->tmpls.get())) {
            caps[k] = v;
        }
        return dup_string(caps.dump());
    });
}

bool strata_chat_templates_support_thinking(const strata_chat_templates * t) {
    try {
        return common_chat_templates_support_enable_thinking(t->tmpls.get());
    } catch (...) {
        return false;
    }
}

bool strata_chat_parser_check(const char * parser, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_chat_parser_params pp;
        pp.parser.load(parser);
        return true;
    });
}

char * strata_chat_parse(const char * text, bool is_partial, const char * parser_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() -> char * {
        const json j = json::parse(parser_json);
        common_chat_parser_params pp;
        pp.format               = static_cast<common_chat_format>(j.value("format", 0));
        pp.reasoning_format     = common_reasoning_format_from_name(j.value("reasoning_format", std::string("none")));
        pp.reasoning_in_content = j.value("reasoning_in_content", false);
        pp.generation_prompt    = j.value("generation_prompt", std::string());
        pp.parse_tool_calls     = j.value("parse_tool_calls", true);
        const std::string parser = j.value("parser", std::string());
        if (!parser.empty()) {
            pp.parser.load(parser);
        }
        const common_chat_msg msg = common_chat_parse(text, is_partial, pp);
        return dup_string(msg.to_json_oaicompat().dump());
    });
}

static common_chat_msg msg_from_json(const char * text) {
    const json j = json::parse(text);
    if (j.is_null() || j.empty()) {
        return common_chat_msg();
    }
    json m = j;
    if (!m.contains("role")) {
        m["role"] = "assistant";
    }
    auto msgs = common_chat_msgs_parse_oaicompat(common_json::parse(json::array({m}).dump()));
    return msgs.empty() ? common_chat_msg() : msgs.front();
}

char * strata_chat_msg_diffs(const char * prev_msg_json, const char * new_msg_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() -> char * {
        const auto diffs = common_chat_msg_diff::compute_diffs(msg_from_json(prev_msg_json), msg_from_json(new_msg_json));
        json out = json::array();
        for (const auto & d : diffs) {
            json delta = json::object();
            if (!d.reasoning_content_delta.empty()) {
                delta["reasoning_content"] = d.reasoning_content_delta;
            }
            if (!d.content_delta.empty()) {
                delta["content"] = d.content_delta;
            }
            if (d.tool_call_index != std::string::npos) {
                json tool_call;
                tool_call["index"] = d.tool_call_index;
                if (!d.tool_call_delta.id.empty()) {
                    tool_call["id"]   = d.tool_call_delta.id;
                    tool_call["type"] = "function";
                }
                if (!d.tool_call_delta.name.empty() || !d.tool_call_delta.arguments.empty()) {
                    json function = json::object();
                    if (!d.tool_call_delta.name.empty()) {
                        function["name"] = d.tool_call_delta.name;
                    }
                    if (!d.tool_call_delta.arguments.empty()) {
                        function["arguments"] = d.tool_call_delta.arguments;
                    }
                    tool_call["function"] = function;
                }
                delta["tool_calls"] = json::array({tool_call});
            }
            out.push_back(delta);
        }
        return dup_string(out.dump());
    });
}

bool strata_validate_filename(const char * filename) {
    try {
        return fs_validate_filename(filename);
    } catch (...) {
        return false;
    }
}

const char * strata_build_info(void) {
    return llama_build_info();
}

// ---- grammar --------------------------------------------------------------------------------

char * strata_json_schema_to_grammar(const char * schema_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() -> char * {
        return dup_string(json_schema_to_grammar(common_json::parse(schema_json)));
    });
}

// ---- sampling -------------------------------------------------------------------------------

template <typename T>
static void take(const json & j, const char * key, T & field) {
    if (j.contains(key) && !j.at(key).is_null()) {
        field = j.at(key).get<T>();
    }
}

// The values arrive validated and normalized by the server's request schema.
static void apply_sampling_overrides(common_params_sampling & s, const json & j) {
    take(j, "seed", s.seed);
    take(j, "n_probs", s.n_probs);
    take(j, "min_keep", s.min_keep);
    take(j, "top_k", s.top_k);
    take(j, "top_p", s.top_p);
    take(j, "min_p", s.min_p);
    take(j, "xtc_probability", s.xtc_probability);
    take(j, "xtc_threshold", s.xtc_threshold);
    take(j, "typ_p", s.typ_p);
    take(j, "temp", s.temp);
    take(j, "dynatemp_range", s.dynatemp_range);
    take(j, "dynatemp_exponent", s.dynatemp_exponent);
    take(j, "penalty_last_n", s.penalty_last_n);
    take(j, "penalty_repeat", s.penalty_repeat);
    take(j, "penalty_freq", s.penalty_freq);
    take(j, "penalty_present", s.penalty_present);
    take(j, "dry_multiplier", s.dry_multiplier);
    take(j, "dry_base", s.dry_base);
    take(j, "dry_allowed_length", s.dry_allowed_length);
    take(j, "dry_penalty_last_n", s.dry_penalty_last_n);
    take(j, "adaptive_target", s.adaptive_target);
    take(j, "adaptive_decay", s.adaptive_decay);
    take(j, "mirostat", s.mirostat);
    take(j, "mirostat_tau", s.mirostat_tau);
    take(j, "mirostat_eta", s.mirostat_eta);
    take(j, "top_n_sigma", s.top_n_sigma);
    take(j, "ignore_eos", s.ignore_eos);
    take(j, "grammar_lazy", s.grammar_lazy);
    take(j, "generation_prompt", s.generation_prompt);
    take(j, "backend_sampling", s.backend_sampling);
    take(j, "dry_sequence_breakers", s.dry_sequence_breakers);
    take(j, "reasoning_budget_tokens", s.reasoning_budget_tokens);
    take(j, "reasoning_budget_start", s.reasoning_budget_start);
    take(j, "reasoning_budget_end", s.reasoning_budget_end);
    take(j, "reasoning_budget_forced", s.reasoning_budget_forced);
    take(j, "reasoning_control", s.reasoning_control);
    if (j.contains("samplers")) {
        const json & v = j.at("samplers");
        s.samplers = v.is_string() ? common_sampler_types_from_chars(v.get<std::string>())
                                   : common_sampler_types_from_names(v.get<std::vector<std::string>>());
    }
    if (j.contains("grammar") && j.at("grammar").is_string() && !j.at("grammar").get<std::string>().empty()) {
        const int type = j.value("grammar_type", static_cast<int>(COMMON_GRAMMAR_TYPE_USER));
        s.grammar = common_grammar(static_cast<common_grammar_type>(type), j.at("grammar").get<std::string>());
    }
    if (j.contains("grammar_triggers")) {
        s.grammar_triggers.clear();
        for (const auto & t : j.at("grammar_triggers")) {
            common_grammar_trigger tr;
            tr.type  = static_cast<common_grammar_trigger_type>(t.at("type").get<int>());
            tr.value = t.value("value", std::string());
            tr.token = t.value("token", LLAMA_TOKEN_NULL);
            s.grammar_triggers.push_back(tr);
        }
    }
    if (j.contains("preserved_tokens")) {
        for (const auto & t : j.at("preserved_tokens")) {
            s.preserved_tokens.insert(t.get<llama_token>());
        }
    }
    if (j.contains("logit_bias")) {
        s.logit_bias.clear();
        for (const auto & e : j.at("logit_bias")) {
            // false bans the token: JSON has no -infinity.
            const float bias = e.at(1).is_boolean() ? -INFINITY : e.at(1).get<float>();
            s.logit_bias.push_back({e.at(0).get<llama_token>(), bias});
        }
    }
    // a request's ignore_eos adds the end-of-generation bans to the biases it runs with, its own
    // or else the server's
    if (j.contains("ignore_eos") && !j.at("ignore_eos").is_null() && s.ignore_eos) {
        s.logit_bias.insert(s.logit_bias.end(), s.logit_bias_eog.begin(), s.logit_bias_eog.end());
    }
}

static common_params_sampling sampling_params(const strata_params * p, const char * overrides_json) {
    common_params_sampling s = p ? p->params.sampling : common_params_sampling();
    if (overrides_json && *overrides_json) {
        apply_sampling_overrides(s, json::parse(overrides_json));
    }
    return s;
}

char * strata_sampling_json(const strata_params * p, const char * overrides_json, int32_t chat_format, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        const common_params_sampling s = sampling_params(p, overrides_json);
        std::vector<std::string> samplers;
        for (const auto & t : s.samplers) {
            samplers.push_back(common_sampler_type_to_str(t));
        }
        json logit_bias = json::array();
        for (const auto & lb : s.logit_bias) {
            logit_bias.push_back({{"bias", lb.bias}, {"token", lb.token}});
        }
        json triggers = json::array();
        for (const auto & t : s.grammar_triggers) {
            json tj = {{"type", (int) t.type}, {"value", t.value}};
            if (t.type == COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN) {
                tj["token"] = (int) t.token;
            }
            triggers.push_back(tj);
        }
        const auto spec_types = p ? p->params.speculative.types : std::vector<common_speculative_type>{};
        const json out = {
            {"seed", s.seed},
            {"temperature", s.temp},
            {"dynatemp_range", s.dynatemp_range},
            {"dynatemp_exponent", s.dynatemp_exponent},
            {"top_k", s.top_k},
            {"top_p", s.top_p},
            {"min_p", s.min_p},
            {"top_n_sigma", s.top_n_sigma},
            {"xtc_probability", s.xtc_probability},
            {"xtc_threshold", s.xtc_threshold},
            {"typical_p", s.typ_p},
            {"repeat_last_n", s.penalty_last_n},
            {"repeat_penalty", s.penalty_repeat},
            {"presence_penalty", s.penalty_present},
            {"frequency_penalty", s.penalty_freq},
            {"dry_multiplier", s.dry_multiplier},
            {"dry_base", s.dry_base},
            {"dry_allowed_length", s.dry_allowed_length},
            {"dry_penalty_last_n", s.dry_penalty_last_n},
            {"dry_sequence_breakers", s.dry_sequence_breakers},
            {"mirostat", s.mirostat},
            {"mirostat_tau", s.mirostat_tau},
            {"mirostat_eta", s.mirostat_eta},
            {"adaptive_target", s.adaptive_target},
            {"adaptive_decay", s.adaptive_decay},
            {"ignore_eos", s.ignore_eos},
            {"logit_bias", logit_bias},
            {"n_probs", s.n_probs},
            {"min_keep", s.min_keep},
            {"grammar", common_grammar_value(s.grammar)},
            {"grammar_lazy", s.grammar_lazy},
            {"grammar_triggers", triggers},
            {"preserved_tokens", s.preserved_tokens},
            {"chat_format", common_chat_format_name(static_cast<common_chat_format>(chat_format))},
            {"samplers", samplers},
            {"speculative.types", common_speculative_type_name_str(spec_types)},
            {"backend_sampling", s.backend_sampling},
        };
        return dup_string(out.dump());
    });
}

// Whether the chain common_sampler_init builds from p always selects the first token of highest
// (biased) logit when that token is the only one with that logit: the samplers before the one
// that reduces the candidates to it (top-k 1, or temperature <= 0) leave the logits as they are
// and keep that token; the ones after it cannot drop it. Penalties, DRY, XTC, typical and top-n-sigma
// must be off, since they change or drop the top token; grammars, the reasoning budget, mirostat
// and backend sampling take the chain. (One draw in 2^64 of the chain's last sampler, exactly 0,
// picks token 0 over an unsorted vocabulary when top-k is off; the scan picks the top.)
static bool sampler_is_argmax(const common_params_sampling & p) {
    if (p.mirostat != 0 || p.backend_sampling || !common_grammar_value(p.grammar).empty()) {
        return false;
    }
    if (!p.reasoning_budget_start.empty() && !p.reasoning_budget_end.empty() &&
        (p.grammar_lazy || p.reasoning_budget_tokens >= 0 || p.reasoning_control)) {
        return false;
    }
    bool reduced = false;
    for (const auto t : p.samplers) {
        switch (t) {
            case COMMON_SAMPLER_TYPE_PENALTIES:
                if (!(p.penalty_last_n == 0 || (p.penalty_repeat == 1.0f && p.penalty_freq == 0.0f && p.penalty_present == 0.0f))) {
                    return false;
                }
                break;
            case COMMON_SAMPLER_TYPE_DRY:
                if (!(p.dry_multiplier == 0.0f || p.dry_base < 1.0f || p.dry_penalty_last_n == 0)) {
                    return false;
                }
                break;
            case COMMON_SAMPLER_TYPE_XTC:
                if (!(p.xtc_probability <= 0.0f || p.xtc_threshold > 0.5f)) {
                    return false;
                }
                break;
            case COMMON_SAMPLER_TYPE_TYPICAL_P:
                if (p.typ_p < 1.0f) {
                    return false;
                }
                break;
            case COMMON_SAMPLER_TYPE_TOP_N_SIGMA:
                if (p.top_n_sigma > 0.0f) {
                    return false;
                }
                break;
            case COMMON_SAMPLER_TYPE_TOP_K:
                reduced |= p.top_k == 1;
                break;
            case COMMON_SAMPLER_TYPE_TOP_P:
            case COMMON_SAMPLER_TYPE_MIN_P:
                break;
            case COMMON_SAMPLER_TYPE_TEMPERATURE:
                if (p.temp <= 0.0f && p.dynatemp_range <= 0.0f) {
                    reduced = true;
                } else if (!reduced) {
                    return false;  // scaling first could round the top logit into a tie
                }
                break;
            default:
                return false;
        }
    }
    return reduced;
}

// GCC's vector types: the compiler does not vectorise a max over floats by itself.
typedef float   strata_f32x4 __attribute__((vector_size(16)));
typedef int32_t strata_i32x4 __attribute__((vector_size(16)));

int32_t strata_logits_argmax(const float * x, int32_t n, bool * unique) {
    *unique = false;
    if (n <= 0) {
        return -1;
    }
    constexpr int32_t L = 4, U = 4, W = L * U;
    const int32_t     m = n - n % W;
    const auto        load = [x](int32_t i) {
        strata_f32x4 v;
        std::memcpy(&v, x + i, sizeof(v));
        return v;
    };
    strata_f32x4 top_v[U], sum_v[U];
    for (int32_t u = 0; u < U; u++) {
        top_v[u] = strata_f32x4{} - INFINITY;
        sum_v[u] = strata_f32x4{};
    }
    for (int32_t i = 0; i < m; i += W) {
        for (int32_t u = 0; u < U; u++) {
            const strata_f32x4 v = load(i + u * L);
            top_v[u]             = v > top_v[u] ? v : top_v[u];
            sum_v[u] += v;  // NaN in, NaN out: one check at the end
        }
    }
    float top = -INFINITY, sum = 0.0f;
    for (int32_t u = 0; u < U; u++) {
        for (int32_t l = 0; l < L; l++) {
            top = top_v[u][l] > top ? top_v[u][l] : top;
            sum += sum_v[u][l];
        }
    }
    for (int32_t i = m; i < n; i++) {
        top = x[i] > top ? x[i] : top;
        sum += x[i];
    }
    // a NaN sum is a NaN logit or infinities of both signs (logits or overflowed sums): the chain decides
    if (std::isnan(sum) || !std::isfinite(top)) {
        return -1;
    }
    const strata_f32x4 top4 = strata_f32x4{} + top;
    strata_i32x4       same_v[U] = {};
    int32_t            found     = -1;
    for (int32_t i = 0; i < m; i += W) {
        strata_i32x4 hit = {};
        for (int32_t u = 0; u < U; u++) {
            const strata_i32x4 eq = load(i + u * L) == top4;
            same_v[u] -= eq;
            hit |= eq;
        }
        if (found < 0 && (hit[0] | hit[1] | hit[2] | hit[3])) {
            found = i;
        }
    }
    int32_t same = 0;
    for (int32_t u = 0; u < U; u++) {
        same += same_v[u][0] + same_v[u][1] + same_v[u][2] + same_v[u][3];
    }
    for (int32_t i = m; i < n; i++) {
        same += x[i] == top;
    }
    int32_t i = found < 0 ? m : found;
    while (x[i] != top) {
        i++;
    }
    *unique = same == 1;
    return i;
}

// The chain's answer from a scan of the logits, or LLAMA_TOKEN_NULL where the chain must decide:
// the top token is tied, biased, or not above every biased token (or there are many biases).
static llama_token sampler_scan(const strata_sampler * s, const float * logits, int32_t n_vocab) {
    bool          unique = false;
    const int32_t top    = s->bias.size() > 64 ? -1 : strata_logits_argmax(logits, n_vocab, &unique);
    if (top < 0 || !unique) {
        return LLAMA_TOKEN_NULL;
    }
    for (const auto & lb : s->bias) {
        if (lb.token < 0 || lb.token >= n_vocab) {
            continue;
        }
        if (lb.token == top) {
            return LLAMA_TOKEN_NULL;
        }
        float v = logits[lb.token];
        for (const auto & other : s->bias) {
            v += other.token == lb.token ? other.bias : 0.0f;
        }
        if (!(v < logits[top])) {
            return LLAMA_TOKEN_NULL;
        }
    }
    return top;
}

strata_sampler * strata_sampler_init(const struct llama_model * model, const strata_params * p, const char * overrides_json, char ** err) {
    return guarded<strata_sampler *>(err, nullptr, [&]() -> strata_sampler * {
        auto * s = new strata_sampler;
        s->params = sampling_params(p, overrides_json);
        s->smpl = common_sampler_init(model, s->params);
        if (!s->smpl) {
            delete s;
            set_err(err, "failed to initialise the sampler (invalid grammar?)");
            return nullptr;
        }
        s->argmax_ok = sampler_is_argmax(s->params);
        s->argmax    = s->argmax_ok;
        s->bias   = s->params.logit_bias;
        int32_t             n_suppress = 0;
        const llama_token * suppress   = llama_vocab_get_suppress_tokens(llama_model_get_vocab(model), &n_suppress);
        for (int32_t i = 0; i < n_suppress; i++) {
            s->bias.push_back({ suppress[i], -INFINITY });
        }
        return s;
    });
}

void strata_sampler_free(strata_sampler * s) {
    if (s) {
        common_sampler_free(s->smpl);
        delete s;
    }
}

llama_token strata_sampler_sample(strata_sampler * s, struct llama_context * ctx, int32_t idx, char ** err) {
    return guarded<llama_token>(err, LLAMA_TOKEN_NULL, [&]() {
        s->scanned = LLAMA_TOKEN_NULL;
        if (s->argmax) {
            llama_synchronize(ctx);
            const bool    backend = llama_get_sampled_token_ith(ctx, idx) != LLAMA_TOKEN_NULL || llama_get_sampled_logits_ith(ctx, idx) ||
                                 llama_get_sampled_probs_ith(ctx, idx);
            const float * logits  = backend ? nullptr : llama_get_logits_ith(ctx, idx);
            if (logits) {
                s->scanned = sampler_scan(s, logits, llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx))));
            }
            if (s->scanned != LLAMA_TOKEN_NULL) {
                return s->scanned;
            }
        }
        return common_sampler_sample(s->smpl, ctx, idx);
    });
}

struct strata_backend_samplers {
    std::vector<common_sampler_ptr>       smpl;
    std::vector<llama_sampler_seq_config> seq;
};

strata_backend_samplers * strata_backend_samplers_init(const struct llama_model * model, const strata_params * p,
                                                       struct llama_context_params * cparams, char ** err) {
    return guarded<strata_backend_samplers *>(err, nullptr, [&]() -> strata_backend_samplers * {
        if (!p->params.sampling.backend_sampling) {
            return nullptr;
        }
        auto b = std::make_unique<strata_backend_samplers>();
        for (uint32_t i = 0; i < cparams->n_seq_max; ++i) {
            common_params_sampling sp = p->params.sampling;
            b->smpl.emplace_back(common_sampler_init(model, sp));
            if (!b->smpl.back()) {
                throw std::runtime_error("failed to initialise the backend samplers");
            }
            b->seq.push_back({ static_cast<llama_seq_id>(i), common_sampler_get(b->smpl.back().get()) });
        }
        cparams->samplers   = b->seq.data();
        cparams->n_samplers = b->seq.size();
        return b.release();
    });
}

void strata_backend_samplers_free(strata_backend_samplers * b) {
    delete b;
}

bool strata_sampler_backend(const strata_sampler * s) {
    const auto & p = s->params;
    const bool rbudget = !p.reasoning_budget_start.empty() && !p.reasoning_budget_end.empty() &&
                         (p.grammar_lazy || p.reasoning_budget_tokens >= 0 || p.reasoning_control);
    return p.backend_sampling && common_grammar_value(p.grammar).empty() && !rbudget;
}

bool strata_sampler_attach(struct llama_context * ctx, int32_t seq, const strata_sampler * s) {
    try {
        return llama_set_sampler(ctx, seq, s ? common_sampler_get(s->smpl) : nullptr) && s;
    } catch (...) {
        // the backend could not take the chain: the CPU samples the sequence
        return false;
    }
}

void strata_sampler_set_argmax(strata_sampler * s, bool enabled) {
    s->argmax = enabled && s->argmax_ok;
}

bool strata_sampler_argmax(const strata_sampler * s) {
    return s->argmax;
}

int32_t strata_sampler_sample_and_accept_n(strata_sampler * s, struct llama_context * ctx, const int32_t * idxs,
                                           const llama_token * draft, int32_t n_draft, llama_token * out, char ** err) {
    return guarded<int32_t>(err, -1, [&]() {
        const std::vector<int> i(idxs, idxs + n_draft + 1);
        const llama_tokens d(draft, draft + n_draft);
        s->scanned = LLAMA_TOKEN_NULL;
        const auto accepted = common_sampler_sample_and_accept_n(s->smpl, ctx, i, d);
        const int32_t n = std::min<int32_t>(n_draft + 1, static_cast<int32_t>(accepted.size()));
        std::memcpy(out, accepted.data(), sizeof(llama_token) * n);
        return n;
    });
}

bool strata_sampler_accept(strata_sampler * s, llama_token token, bool accept_grammar, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_sampler_accept(s->smpl, token, accept_grammar);
        return true;
    });
}

bool strata_sampler_reset(strata_sampler * s, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_sampler_reset(s->smpl);
        s->scanned = LLAMA_TOKEN_NULL;
        return true;
    });
}

int32_t strata_sampler_candidates(strata_sampler * s, llama_token token, float * token_prob,
                                  llama_token * ids, float * probs, int32_t n_max, char ** err) {
    return guarded<int32_t>(err, -1, [&]() {
        if (s->scanned != LLAMA_TOKEN_NULL) {
            // the chain would have left the scanned token alone with probability 1 (others at 0)
            *token_prob = token == s->scanned ? 1.0f : 0.0f;
            if (n_max < 1) {
                return 0;
            }
            ids[0]   = s->scanned;
            probs[0] = 1.0f;
            return 1;
        }
        const llama_token_data_array * cur = common_sampler_get_candidates(s->smpl, true);
        *token_prob = 0.0f;
        int32_t written = 0;
        for (size_t i = 0; i < cur->size; i++) {
            if (cur->data[i].id == token) {
                *token_prob = cur->data[i].p;
            }
            // Samplers differ in whether they keep zero-probability candidates; drop them all.
            if (written < n_max && cur->data[i].p > 0.0f) {
                ids[written]   = cur->data[i].id;
                probs[written] = cur->data[i].p;
                written++;
            }
        }
        return written;
    });
}

bool strata_sampler_reasoning_end(strata_sampler * s, char ** err) {
    return guarded<bool>(err, false, [&]() { return common_sampler_reasoning_budget_force(s->smpl); });
}

uint32_t strata_sampler_seed(const strata_sampler * s) {
    try {
        return common_sampler_get_seed(s->smpl);
    } catch (...) {
        return s->params.seed;
    }
}

// ---- speculative decoding -------------------------------------------------------------------

strata_speculative * strata_speculative_init(strata_params * p, struct llama_context * ctx_tgt, uint32_t n_seq, char ** err) {
    return guarded<strata_speculative *>(err, nullptr, [&]() -> strata_speculative * {
        common_params & params = p->params;
        auto * s = new strata_speculative;
        const auto & types = params.speculative.types;
        const bool spec_mtp = std::find(types.begin(), types.end(), COMMON_SPECULATIVE_TYPE_DRAFT_MTP) != types.end();
        // A draft model or an MTP head needs its own context, made as llama-server makes it.
        if (params.speculative.has_dft() || spec_mtp) {
            llama_model * model_tgt = const_cast<llama_model *>(llama_get_model(ctx_tgt));
            common_params params_dft = common_base_params_to_speculative(params);
            s->init = common_speculative_init_from_params(params_dft, model_tgt, ctx_tgt);
            if (params.speculative.has_dft() && s->init->model() == nullptr) {
                delete s;
                set_err(err, "failed to load draft model, '" + params_dft.model.path + "'");
                return nullptr;
            }
            if (s->init->context() == nullptr) {
                delete s;
                set_err(err, "failed to create the draft/MTP context");
                return nullptr;
            }
            params.speculative.draft.ctx_tgt = ctx_tgt;
            params.speculative.draft.ctx_dft = s->init->context();
        }
        const bool synth = params.speculative.has_synth();
        try {
            s->spec = common_speculative_init(params.speculative, n_seq);
        } catch (const std::exception & e) {
            // As llama-server: a drafter that cannot start leaves the server without one, unless
            // synthetic acceptance needs it.
            LOG_ERR("srv  %12.*s: failed to initialize speculative decoding context: %s\n", 12, "load_model", e.what());
            if (synth) {
                params.speculative.draft.ctx_dft = nullptr;
                delete s;
                set_err(err, std::string("failed to initialize speculative decoding context: ") + e.what());
                return nullptr;
            }
        }
        s->synth_rng.resize(n_seq);
        if (!s->spec) {
            // As llama-server: no drafter for these settings serves without speculative decoding.
            params.speculative.draft.ctx_dft = nullptr;
            delete s;
            if (synth) {
                set_err(err, "synthetic acceptance requires an initialized speculative decoding context");
            }
            return nullptr;
        }
        return s;
    });
}

void strata_speculative_free(strata_speculative * s) {
    if (s) {
        common_speculative_free(s->spec);
        delete s;
    }
}

bool strata_speculative_begin(strata_speculative * s, llama_seq_id seq, const llama_token * prompt, int32_t n_prompt, char ** err) {
    return guarded<bool>(err, false, [&]() {
        s->prompt.assign(prompt, prompt + n_prompt);
        common_speculative_begin(s->spec, seq, s->prompt);
        return true;
    });
}

static int32_t speculative_draft(strata_speculative * s, llama_seq_id seq, const llama_token * prompt, int32_t n_prompt,
                                 llama_token last, llama_token * out, int32_t n_max) {
    s->prompt.assign(prompt, prompt + n_prompt);
    s->result.clear();
    common_speculative_draft_params & dp = common_speculative_get_draft_params(s->spec, seq);
    dp.drafting = true;
    dp.n_max    = n_max;
    dp.pos0     = n_prompt;
    dp.id_last  = last;
    dp.prompt   = &s->prompt;
    dp.result   = &s->result;
    common_speculative_draft(s->spec);
    const int32_t n = std::min<int32_t>(n_max, static_cast<int32_t>(s->result.size()));
    std::memcpy(out, s->result.data(), sizeof(llama_token) * n);
    return n;
}

int32_t strata_speculative_draft(strata_speculative * s, llama_seq_id seq, const llama_token * prompt, int32_t n_prompt,
                                 llama_token last, llama_token * out, int32_t n_max, char ** err) {
    return guarded<int32_t>(err, -1, [&]() { return speculative_draft(s, seq, prompt, n_prompt, last, out, n_max); });
}

bool strata_speculative_process(strata_speculative * s, struct llama_context * ctx_tgt, int32_t n_tokens,
                                const llama_token * tokens, const llama_pos * pos, const llama_seq_id * seq,
                                const int8_t * output, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_batch batch(ctx_tgt);
        for (int32_t i = 0; i < n_tokens; ++i) {
            batch.add(tokens[i], pos[i], seq[i], output[i] != 0);
        }
        if (!common_speculative_process(s->spec, batch)) {
            set_err(err, "failed to process speculative batch");
            return false;
        }
        return true;
    });
}

static llama_context * draft_context(const strata_speculative * s) {
    return s->init ? s->init->context() : nullptr;
}

bool strata_speculative_has_context(const strata_speculative * s) {
    return draft_context(s) != nullptr;
}

bool strata_speculative_seq_rm(strata_speculative * s, llama_seq_id seq, llama_pos p0, llama_pos p1, char ** err) {
    return guarded<bool>(err, false, [&]() {
        if (llama_context * ctx = draft_context(s)) {
            llama_memory_seq_rm(llama_get_memory(ctx), seq, p0, p1);
        }
        return true;
    });
}

bool strata_speculative_seq_add(strata_speculative * s, llama_seq_id seq, llama_pos p0, llama_pos p1, llama_pos delta, char ** err) {
    return guarded<bool>(err, false, [&]() {
        if (llama_context * ctx = draft_context(s)) {
            llama_memory_seq_add(llama_get_memory(ctx), seq, p0, p1, delta);
        }
        return true;
    });
}

bool strata_speculative_has_synth(const strata_speculative * s) {
    try {
        return !common_speculative_get_synth_probs(s->spec).empty();
    } catch (...) {
        return false;
    }
}

bool strata_speculative_synth_seed(strata_speculative * s, llama_seq_id seq, const strata_sampler * smpl, char ** err) {
    return guarded<bool>(err, false, [&]() {
        const uint32_t seed = smpl->params.seed == LLAMA_DEFAULT_SEED ? std::random_device{}() : smpl->params.seed;
        s->synth_rng.at(seq).seed(seed);
        return true;
    });
}

// Synthetic acceptance (llama-server's server_sample_and_accept_synth): draft token i is taken
// with probability synth_probs[i] regardless of the model, for measuring speed at a set
// acceptance rate; a drafted end-of-generation token is never taken.
static int32_t speculative_accept_synth(strata_speculative * s, llama_seq_id seq, strata_sampler * smpl,
                                        struct llama_context * ctx, const int32_t * idxs,
                                        const llama_token * draft, int32_t n_draft, llama_token * out) {
    const auto & probs = common_speculative_get_synth_probs(s->spec);
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    std::uniform_real_distribution<double> dist(0.0, 1.0);
    auto & rng = s->synth_rng.at(seq);
    int32_t n = 0;
    for (int32_t i = 0; i < n_draft; ++i) {
        const llama_token id = common_sampler_sample(smpl->smpl, ctx, idxs[i]);
        const bool take = i < (int32_t) probs.size() && dist(rng) < probs[i];
        if (take && !llama_vocab_is_eog(vocab, draft[i])) {
            common_sampler_accept(smpl->smpl, draft[i], false);
            out[n++] = draft[i];
            continue;
        }
        common_sampler_accept(smpl->smpl, id, true);
        out[n++] = id;
        return n;
    }
    const llama_token id = common_sampler_sample(smpl->smpl, ctx, idxs[n_draft]);
    common_sampler_accept(smpl->smpl, id, true);
    out[n++] = id;
    return n;
}

int32_t strata_speculative_accept_synth(strata_speculative * s, llama_seq_id seq, strata_sampler * smpl,
                                        struct llama_context * ctx, const int32_t * idxs,
                                        const llama_token * draft, int32_t n_draft, llama_token * out, char ** err) {
    return guarded<int32_t>(err, -1, [&]() { return speculative_accept_synth(s, seq, smpl, ctx, idxs, draft, n_draft, out); });
}

int32_t strata_speculative_n_max(const strata_speculative * s) {
    try {
        return common_speculative_n_max(s->spec);
    } catch (...) {
        return 0;
    }
}

bool strata_speculative_accept(strata_speculative * s, llama_seq_id seq, uint16_t n_accepted, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_speculative_accept(s->spec, seq, n_accepted);
        return true;
    });
}

struct strata_bytes {
    std::vector<uint8_t> data;
};

static strata_bytes * speculative_checkpoint(strata_speculative * s, llama_seq_id seq, bool with_drafter) {
    auto * b = new strata_bytes;
    const llama_state_seq_flags flags = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;
    uint64_t n_dft = 0;
    std::vector<uint8_t> dft;
    if (llama_context * ctx = draft_context(s)) {
        dft.resize(llama_state_seq_get_size_ext(ctx, seq, flags));
        if (llama_state_seq_get_data_ext(ctx, dft.data(), dft.size(), seq, flags) != dft.size()) {
            delete b;
            return nullptr;
        }
        n_dft = dft.size();
    }
    // layout: n_dft (u64), with_drafter (u8), draft context state, drafter state
    std::vector<uint8_t> spec;
    if (with_drafter) {
        common_speculative_get_state(s->spec, seq, spec);
    }
    const size_t head = sizeof(n_dft) + 1;
    b->data.resize(head + dft.size() + spec.size());
    std::memcpy(b->data.data(), &n_dft, sizeof(n_dft));
    b->data[sizeof(n_dft)] = with_drafter ? 1 : 0;
    std::copy(dft.begin(), dft.end(), b->data.begin() + head);
    std::copy(spec.begin(), spec.end(), b->data.begin() + head + dft.size());
    return b;
}

static bool speculative_restore(strata_speculative * s, llama_seq_id seq, const uint8_t * data, size_t n) {
    uint64_t n_dft = 0;
    const size_t head = sizeof(n_dft) + 1;
    if (n < head) {
        return false;
    }
    std::memcpy(&n_dft, data, sizeof(n_dft));
    if (n_dft > n - head) {
        return false;
    }
    const bool with_drafter = data[sizeof(n_dft)] != 0;
    const uint8_t * dft = data + head;
    if (n_dft > 0) {
        llama_context * ctx = draft_context(s);
        if (!ctx || llama_state_seq_set_data_ext(ctx, dft, n_dft, seq, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) != n_dft) {
            return false;
        }
    }
    if (with_drafter) {
        const std::vector<uint8_t> spec(dft + n_dft, data + n);
        common_speculative_set_state(s->spec, seq, spec);
    }
    return true;
}

strata_bytes * strata_speculative_checkpoint(strata_speculative * s, llama_seq_id seq, bool with_drafter, char ** err) {
    return guarded<strata_bytes *>(err, nullptr, [&]() {
        strata_bytes * b = speculative_checkpoint(s, seq, with_drafter);
        if (!b) {
            set_err(err, "failed to read the draft context's state");
        }
        return b;
    });
}

bool strata_speculative_restore(strata_speculative * s, llama_seq_id seq, const uint8_t * data, size_t n, char ** err) {
    return guarded<bool>(err, false, [&]() {
        if (!speculative_restore(s, seq, data, n)) {
            set_err(err, "failed to restore the drafter's state");
            return false;
        }
        return true;
    });
}

const uint8_t * strata_bytes_data(const strata_bytes * b) {
    return b->data.data();
}

size_t strata_bytes_size(const strata_bytes * b) {
    return b->data.size();
}

void strata_bytes_free(strata_bytes * b) {
    delete b;
}

// ---- context memory -------------------------------------------------------------------------

int32_t strata_speculative_seq_rm_type(strata_speculative * s, char ** err) {
    return guarded<int32_t>(err, -1, [&]() {
        llama_context * ctx = draft_context(s);
        return ctx ? static_cast<int32_t>(common_context_can_seq_rm(ctx)) : 1;
    });
}

int32_t strata_context_seq_rm_type(struct llama_context * ctx, char ** err) {
    return guarded<int32_t>(err, -1, [&]() { return static_cast<int32_t>(common_context_can_seq_rm(ctx)); });
}

// ---- vocabulary -----------------------------------------------------------------------------

// llama.h's tokenizer calls throw for ids outside the vocabulary (std::vector::at).

int32_t strata_tokenize(const struct llama_vocab * vocab, const char * text, int32_t len, llama_token * out,
                        int32_t n_max, bool add_special, bool parse_special, char ** err) {
    return guarded<int32_t>(err, INT32_MIN, [&]() {
        return llama_tokenize(vocab, text, len, out, n_max, add_special, parse_special);
    });
}

int32_t strata_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t len,
                              int32_t lstrip, bool special, char ** err) {
    return guarded<int32_t>(err, INT32_MIN, [&]() { return llama_token_to_piece(vocab, token, buf, len, lstrip, special); });
}

int32_t strata_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens, char * text,
                          int32_t len, bool remove_special, bool unparse_special, char ** err) {
    return guarded<int32_t>(err, INT32_MIN, [&]() {
        return llama_detokenize(vocab, tokens, n_tokens, text, len, remove_special, unparse_special);
    });
}

// ---- router mode ----------------------------------------------------------------------------

// Options a router keeps to itself: TLS, keys and the model list belong to the router only.
static void router_unset_reserved(common_preset & preset, bool model_args) {
    for (const char * env : {"LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE", "LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE",
                             "LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_MODELS_MAX", "LLAMA_ARG_MODELS_PRESET", "LLAMA_ARG_MODELS_AUTOLOAD"}) {
        preset.unset_option(env);
    }
    if (model_args) {
        for (const char * env : {"LLAMA_ARG_MODEL", "LLAMA_ARG_MMPROJ", "LLAMA_ARG_ALIAS", "LLAMA_ARG_HF_REPO"}) {
            preset.unset_option(env);
        }
    }
}

static std::set<std::string> router_csv_set(const common_preset & preset, const char * env) {
    std::set<std::string> out;
    std::string csv;
    if (preset.get_option(env, csv)) {
        for (auto & item : string_split<std::string>(csv, ',')) {
            item = string_strip(item);
            if (!item.empty()) {
                out.insert(item);
            }
        }
    }
    return out;
}

char * strata_router_models(int argc, char ** argv, const char * models_dir, const char * models_preset, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        common_preset_context ctx(LLAMA_EXAMPLE_SERVER);
        common_preset base = ctx.load_from_args(argc, argv);
        router_unset_reserved(base, true);
        base.unset_option("LLAMA_ARG_LOG_FILE");

        common_presets cached = ctx.load_from_cache();
        common_presets local;
        if (models_dir && *models_dir) {
            local = ctx.load_from_models_dir(models_dir);
        }
        common_preset global;
        common_presets custom;
        if (models_preset && *models_preset) {
            custom = ctx.load_from_ini(models_preset, global);
        }
        cached = ctx.cascade(global, cached);
        local  = ctx.cascade(global, local);
        custom = ctx.cascade(global, custom);

        common_presets all;
        std::map<std::string, std::string> source;
        for (const auto & [name, p] : cached) { all[name] = p; source[name] = "cache"; }
        for (const auto & [name, p] : local)  { all[name] = p; source[name] = "models_dir"; }
        for (const auto & [name, p] : custom) {
            if (all.count(name)) { all[name].merge(p); } else { all[name] = p; }
            source[name] = "preset";
        }

        std::set<std::string> deduped_paths;
        for (const auto & [name, p] : custom) {
            std::string val;
            if (!p.get_option(COMMON_ARG_PRESET_DEDUP_CACHE_MODELS, val) || !common_arg_utils::is_truthy(val)) {
                continue;
            }
            for (auto [repo_env, file_env] : {std::pair{"LLAMA_ARG_HF_REPO", "LLAMA_ARG_HF_FILE"},
                                              std::pair{"LLAMA_ARG_SPEC_DRAFT_HF_REPO", "LLAMA_ARG_SPEC_DRAFT_MODEL"}}) {
                std::string repo, file;
                if (p.get_option(repo_env, repo) && !repo.empty()) {
                    p.get_option(file_env, file);
                    std::string path = common_download_resolve_path(repo, file);
                    if (!path.empty()) {
                        deduped_paths.insert(path);
                    }
                }
            }
        }

        const bool colors = common_log_get_colors(common_log_main());
        json out = json::array();
        for (auto & [name, p] : all) {
            p.merge(base);
            router_unset_reserved(p, false);
            std::set<std::string> aliases = router_csv_set(p, "LLAMA_ARG_ALIAS");
            std::set<std::string> tags    = router_csv_set(p, "LLAMA_ARG_TAGS");
            p.unset_option("LLAMA_ARG_PORT");
            p.set_option(ctx, "LLAMA_ARG_HOST", "127.0.0.1");
            p.set_option(ctx, "LLAMA_ARG_ALIAS", name);
            p.set_option(ctx, "LLAMA_ARG_LOG_COLORS", colors ? "on" : "off");
            common_preset shown = p;
            for (const char * env : {"LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "LLAMA_ARG_ALIAS", "LLAMA_ARG_TAGS"}) {
                shown.unset_option(env);
            }
            std::string stop_timeout, on_startup;
            p.get_option(COMMON_ARG_PRESET_STOP_TIMEOUT, stop_timeout);
            p.get_option(COMMON_ARG_PRESET_LOAD_ON_STARTUP, on_startup);
            bool hidden = false;
            if (source[name] == "cache" && !deduped_paths.empty()) {
                std::string path = common_download_resolve_path(name);
                hidden = !path.empty() && deduped_paths.count(path) > 0;
            }
            out.push_back({
                {"name", name},
                {"source", source[name]},
                {"args", p.to_args()},
                {"ini", p.name.empty() ? json(nullptr) : json(shown.to_ini())},
                {"aliases", aliases},
                {"tags", tags},
                {"stop_timeout", stop_timeout},
                {"load_on_startup", !on_startup.empty() && common_arg_utils::is_truthy(on_startup)},
                {"hidden", hidden},
            });
        }
        return dup_string(out.dump());
    });
}

bool strata_router_check_repo(const char * repo, const char * hf_token, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_params c;
        c.model.hf_repo = repo;
        c.hf_token      = hf_token;
        common_models_handler_init(c, LLAMA_EXAMPLE_SERVER);
        return true;
    });
}

bool strata_router_download(strata_params * p, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_models_handler handler = common_models_handler_init(p->params, LLAMA_EXAMPLE_SERVER);
        common_models_handler_apply(handler, p->params);
        return true;
    });
}

bool strata_params_resolve_models(strata_params * p, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_models_handler handler;
        if (!p->params.model.hf_repo.empty()) {
            handler = common_models_handler_init(p->params, LLAMA_EXAMPLE_SERVER);
        }
        common_models_handler_apply(handler, p->params);
        return true;
    });
}

bool strata_router_remove_cached(const char * repo) {
    try {
        return common_download_remove(repo);
    } catch (...) {
        return false;
    }
}

int strata_reserve_stdout(void) {
    std::fflush(stdout);
    int fd = dup(STDOUT_FILENO);
    if (fd < 0 || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
        return -1;
    }
    return fd;
}

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
