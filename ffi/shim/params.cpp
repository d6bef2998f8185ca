#include "common.hpp"

#include "arg.h"
#include "chat.h"
#include "log.h"
#include "speculative.h"

#include <algorithm>
#include <cstdio>
#include <string>

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
