#include "common.hpp"

#include "fit.h"
#include "log.h"
#include "speculative.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

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

void strata_params_set_n_ubatch(strata_params * p, int32_t n_ubatch) {
    p->params.n_ubatch = n_ubatch;
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
