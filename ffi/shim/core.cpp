#include "common.hpp"

#include "log.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

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
