#include "common.hpp"

#include "log.h"
#include "speculative.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

struct strata_speculative {
    common_speculative_init_result_ptr init;
    common_speculative *               spec = nullptr;
    llama_tokens                       prompt;
    llama_tokens                       result;
    std::vector<std::mt19937>          synth_rng; // per sequence, for --spec-synth-* acceptance
};

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

int strata_speculative_device_memory(const strata_speculative * s, ggml_backend_dev_t dev, size_t * model, size_t * context, size_t * compute) {
    try {
        *model = *context = *compute = 0;
        const llama_context * ctx = draft_context(s);
        return ctx ? strata_device_memory(ctx, dev, model, context, compute) : 0;
    } catch (...) {
        return -1;
    }
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
