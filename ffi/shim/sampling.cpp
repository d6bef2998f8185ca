#include "common.hpp"

#include "chat.h"
#include "speculative.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

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
