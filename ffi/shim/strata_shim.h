#pragma once

// extern "C" entry points over llama.cpp's C++ `common` library, so that Strata parses flags,
// applies chat templates, samples and drafts exactly as the pinned llama-server does.
// Strings returned as `char *` are malloc'd: free them with strata_string_free. Functions that
// can fail take `char ** err` and, on failure, return NULL (or false, or the documented
// sentinel) and set *err. No C++ exception leaves this interface: every entry point that calls
// into llama.cpp catches them and reports them through err (or its failure value).

#include <stdbool.h>
#include <stdint.h>

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

void strata_string_free(char * s);

// Bytes a context holds on device `dev`: the model's weights there, the context's memory (KV
// cache, recurrent state, outputs) and its compute buffers. 0, or -1 on an exception.
int strata_device_memory(const struct llama_context * ctx, ggml_backend_dev_t dev, size_t * model, size_t * context, size_t * compute);

// What kind of C++ exception the last failed call on this thread caught: llama-server answers
// std::invalid_argument and JSON errors with 400 and anything else with 500.
#define STRATA_ERROR_OTHER            0
#define STRATA_ERROR_INVALID_ARGUMENT 1
#define STRATA_ERROR_JSON             2
int strata_last_error_kind(void);

// fflush(NULL): llama.cpp prints with C stdio, so Rust output that must follow it flushes first.
void strata_stdio_flush(void);

// common_init(): llama.cpp's logger, build info line.
bool strata_common_init(char ** err);

// One INFO line through llama.cpp's logger (its prefix, timestamps and verbosity filter).
void strata_log_info(const char * text);
// level: 1 error, 2 warning, 3 info, 4 trace, 5 debug (common/log.h's LOG_LEVEL_*)
void strata_log(int level, const char * text);

// NULL when `data` is valid JSON to llama.cpp's parser, else the parser's message, as
// llama-server answers a malformed body with it.
char * strata_json_parse_error(const char * data, size_t len);

// ---- arguments ------------------------------------------------------------------------------

typedef struct strata_params strata_params;

// Called after upstream's --help text, before the process exits 0.
typedef void (*strata_usage_fn)(int argc, char ** argv);

// common_params_parse(argc, argv, LLAMA_EXAMPLE_SERVER): flags, LLAMA_ARG_* variables and
// presets exactly as llama-server reads them. Returns NULL when upstream would exit 1 (the
// message is already on stderr). --help/--completion print and exit(0), as upstream does.
strata_params * strata_params_parse(int argc, char ** argv, strata_usage_fn usage);
void            strata_params_free(strata_params * p);

// The adjustments llama-server's main makes after parsing: n_batch for embeddings, -np auto
// (4 slots, unified KV), the KV pool from --kv-unified-per-slot, the model name as alias, and
// the outputs a step may ask for.
bool strata_params_server_defaults(strata_params * p, char ** err);

// The fields the server reads, as a JSON object (see params_json in strata_shim.cpp).
char * strata_params_json(const strata_params * p, char ** err);

struct llama_model_params   strata_params_model(strata_params * p, char ** err);
struct llama_context_params strata_params_context(const strata_params * p, char ** err);
// The model and context parameters of the target and of the draft as JSON (for tests).
char * strata_params_llama_json(strata_params * p, char ** err);
// Drops llama.cpp's log lines that start with prefix (advice that does not apply to Strata).
void strata_log_mute(const char * prefix);
// llama-server's start-up lines about the build, the log's verbosity and (print_devices) the devices.
void strata_params_print_info(const strata_params * p, bool print_devices);
// llama-server's parameters before any option, as strata_params_json writes them.
char * strata_params_default_json(char ** err);

// llama_backend_init() and llama_numa_init(params.numa), as llama-server's main does.
bool strata_backend_init(const strata_params * p, char ** err);

// ---- model and context set-up ---------------------------------------------------------------

// What common_init_from_params does besides making the model and context, for a server that
// makes them itself.

// --fit (on by default): common_fit_params over the model and context params (and a draft or MTP
// context's), before the model loads; the fitted layer count, context size, split and overrides
// go back into p. Returns common_params_fit_status (0 fitted, 1 could not fit, 2 error), -1 when
// --fit is off, -2 with *err on an exception.
int32_t strata_params_fit(strata_params * p, char ** err);

// The physical batch size of the contexts made from p afterwards (the target's and a draft's).
void strata_params_set_n_ubatch(strata_params * p, int32_t n_ubatch);

// Once the model is loaded: its general.sampling.* defaults for the settings the command line
// left alone, the end-of-generation logit biases, and --ignore-eos's use of them.
bool strata_params_init_sampling(strata_params * p, const struct llama_model * model, char ** err);

// --prio for the calling thread, and the CPU threadpools of -t/-C/-Cr/--cpu-strict/--poll (and
// their -batch forms) attached to ctx; free them after the context.
typedef struct strata_threadpools strata_threadpools;
strata_threadpools * strata_threadpools_init(const strata_params * p, struct llama_context * ctx, char ** err);
void                 strata_threadpools_free(strata_threadpools * t);

// Once a context exists: the KV-shift check, control vectors, the reranking vocabulary checks
// and the warm-up run, stopping where common_init_from_params returns early (a control vector
// that does not load, a vocabulary that cannot rerank). False with *err on an exception.
bool strata_context_setup(strata_params * p, struct llama_context * ctx, char ** err);

// ---- chat templates -------------------------------------------------------------------------

typedef struct strata_chat_templates strata_chat_templates;

// tmpl_override: --chat-template text or NULL for the model's own.
strata_chat_templates * strata_chat_templates_init(const struct llama_model * model, const char * tmpl_override, char ** err);
void                    strata_chat_templates_free(strata_chat_templates * t);

// inputs_json: {"messages": [OpenAI messages], "tools": [...], "tool_choice": "auto",
// "add_generation_prompt": true, "continue_final_message": false, "use_jinja": true, "enable_thinking": true,
// "reasoning_format": "none", "parallel_tool_calls": false, "json_schema": "...",
// "grammar": "...", "chat_template_kwargs": {"k": "json value"}, "add_bos": false, "add_eos": false}
// Returns {"prompt", "format", "grammar", "grammar_lazy", "generation_prompt",
// "grammar_triggers": [{"type", "value", "token"}], "preserved_tokens", "additional_stops",
// "supports_thinking", "thinking_start_tag", "thinking_end_tags", "parser"}.
char * strata_chat_templates_apply(const strata_chat_templates * t, const char * inputs_json, char ** err);

// What llama-server's chat request parsing reads of the messages, tools and tool_choice before
// applying the template, failing as it does (the same exceptions, in the same order):
// inputs_json {"messages", "tools", "tool_choice": string}. Returns {"roles": [...],
// "last_has_tool_calls": bool, "n_tools": n, "tool_choice_none": bool}.
char * strata_chat_parse_inputs(const char * inputs_json, char ** err);

// The template source text ("" when none); variant "" or "tool_use".
char * strata_chat_templates_source(const strata_chat_templates * t, const char * variant, char ** err);

// common_chat_templates_get_caps as a JSON object of booleans (llama-server's chat_template_caps).
char * strata_chat_templates_caps(const strata_chat_templates * t, char ** err);

// Whether the template reacts to enable_thinking (false when it cannot be rendered).
bool strata_chat_templates_support_thinking(const strata_chat_templates * t);

// Whether `parser` (a chat parser definition, as apply returns it) loads.
bool strata_chat_parser_check(const char * parser, char ** err);

// parser_json: {"format": int, "reasoning_format": "none", "reasoning_in_content": false,
// "generation_prompt": "", "parse_tool_calls": true, "parser": "<from apply>"}.
// Returns the OpenAI-shaped assistant message.
char * strata_chat_parse(const char * text, bool is_partial, const char * parser_json, char ** err);

// The OpenAI stream deltas between two assistant messages (OpenAI-shaped JSON objects), as
// common_chat_msg_diff::compute_diffs and llama-server's delta JSON give them: a JSON array.
char * strata_chat_msg_diffs(const char * prev_msg_json, const char * new_msg_json, char ** err);

// common's fs_validate_filename: a plain file name, no separators, no traversal, valid UTF-8.
bool strata_validate_filename(const char * filename);

// llama_build_info(): llama-server's system_fingerprint.
const char * strata_build_info(void);

// ---- grammar --------------------------------------------------------------------------------

char * strata_json_schema_to_grammar(const char * schema_json, char ** err);

// ---- sampling -------------------------------------------------------------------------------

typedef struct strata_sampler strata_sampler;

// The server's sampling defaults from p, overridden by overrides_json whose keys are
// common_params_sampling's field names (temp, top_k, top_p, min_p, seed, grammar, ...);
// "logit_bias" is [[token, bias], ...] where a bias of false bans the token.
// The sampling settings a task with these overrides runs with, under llama-server's names
// (its task_params::to_json): seed, temperature, ..., samplers, "speculative.types",
// backend_sampling; chat_format is named from its common_chat_format value.
char * strata_sampling_json(const strata_params * p, const char * overrides_json, int32_t chat_format, char ** err);

strata_sampler * strata_sampler_init(const struct llama_model * model, const strata_params * p, const char * overrides_json, char ** err);
void             strata_sampler_free(strata_sampler * s);
// LLAMA_TOKEN_NULL on failure (a grammar that rejects every candidate throws, for one).
llama_token      strata_sampler_sample(strata_sampler * s, struct llama_context * ctx, int32_t idx, char ** err);
// Verifies a draft: samples at idxs[0..=n_draft] and accepts while the samples match the draft.
// Writes the accepted tokens plus the first sampled non-matching (or next) token to out
// (room for n_draft + 1); returns how many, -1 on failure.
int32_t strata_sampler_sample_and_accept_n(strata_sampler * s, struct llama_context * ctx, const int32_t * idxs,
                                           const llama_token * draft, int32_t n_draft, llama_token * out, char ** err);
// The first index of the highest of n logits, with *unique set to whether no other logit has that
// value; -1 when a logit is NaN or the highest is not finite (or n is 0).
int32_t          strata_logits_argmax(const float * x, int32_t n, bool * unique);
// Whether sampling may answer from a scan of the logits where the chain would pick their first,
// only, highest value (the chain's settings allow it: greedy, nothing that changes or drops the top
// token); enabled by default, and only ever where the settings allow it.
void             strata_sampler_set_argmax(strata_sampler * s, bool enabled);
bool             strata_sampler_argmax(const strata_sampler * s);
bool             strata_sampler_accept(strata_sampler * s, llama_token token, bool accept_grammar, char ** err);
bool             strata_sampler_reset(strata_sampler * s, char ** err);
uint32_t         strata_sampler_seed(const strata_sampler * s);
// Ends the reasoning section now (the budget sampler forces its end tag), for a sampler made
// with reasoning_control; false when there is nothing to end.
bool             strata_sampler_reasoning_end(strata_sampler * s, char ** err);
// The candidates left after the last sample (sorted, probabilities set): writes the first
// n_max ids and probabilities and the probability of `token` (0 if it is not among them);
// returns how many were written, -1 on failure.
int32_t          strata_sampler_candidates(strata_sampler * s, llama_token token, float * token_prob,
                                           llama_token * ids, float * probs, int32_t n_max, char ** err);

// -bs: one sampler chain per sequence, made from p's sampling settings, written into cparams
// (samplers, n_samplers) so that the context builds its sampling graph with them, as
// common_init_from_params does. Null (and no error) without -bs. Free it after the context.
typedef struct strata_backend_samplers strata_backend_samplers;
strata_backend_samplers * strata_backend_samplers_init(const struct llama_model * model, const strata_params * p,
                                                       struct llama_context_params * cparams, char ** err);
void                      strata_backend_samplers_free(strata_backend_samplers * b);
// Whether s may sample in the context's graph: its settings ask for backend sampling and it has
// no grammar or reasoning budget (llama.cpp's common_sampler_init turns it off for those).
bool             strata_sampler_backend(const strata_sampler * s);
// Sets s's chain as sequence seq's backend sampler (s null: none); false where the context keeps
// sampling that sequence on the CPU.
bool             strata_sampler_attach(struct llama_context * ctx, int32_t seq, const strata_sampler * s);

// ---- speculative decoding -------------------------------------------------------------------

typedef struct strata_speculative strata_speculative;

// common_speculative_init over p's speculative settings for n_seq sequences; ctx_tgt is the
// target context (MTP and draft models need it). Returns NULL with *err on failure, and NULL
// without *err when the settings give no drafter or the drafter fails to start (logged, as
// llama-server logs it and serves without one; with synthetic acceptance that is a failure).
strata_speculative * strata_speculative_init(strata_params * p, struct llama_context * ctx_tgt, uint32_t n_seq, char ** err);
void                 strata_speculative_free(strata_speculative * s);
bool                 strata_speculative_begin(strata_speculative * s, llama_seq_id seq, const llama_token * prompt, int32_t n_prompt, char ** err);
// Drafts up to n_max tokens after `last` for seq; writes them to out, returns the count (-1 on failure).
int32_t              strata_speculative_draft(strata_speculative * s, llama_seq_id seq, const llama_token * prompt, int32_t n_prompt,
                                              llama_token last, llama_token * out, int32_t n_max, char ** err);
// Feeds a target batch (token, position, first sequence id, output flag per entry) to the drafters
// that keep their own context in step with the target (draft model, MTP); false on failure.
bool strata_speculative_process(strata_speculative * s, struct llama_context * ctx_tgt, int32_t n_tokens,
                                const llama_token * tokens, const llama_pos * pos, const llama_seq_id * seq,
                                const int8_t * output, char ** err);
// Whether a drafter has its own context (draft model, MTP head); seq_rm/seq_add keep its
// sequences in step with the target's (no-ops without one).
bool strata_speculative_has_context(const strata_speculative * s);
// What the draft context holds on `dev`, as strata_device_memory; zeros without a draft context.
int  strata_speculative_device_memory(const strata_speculative * s, ggml_backend_dev_t dev, size_t * model, size_t * context, size_t * compute);
bool strata_speculative_seq_rm(strata_speculative * s, llama_seq_id seq, llama_pos p0, llama_pos p1, char ** err);
bool strata_speculative_seq_add(strata_speculative * s, llama_seq_id seq, llama_pos p0, llama_pos p1, llama_pos delta, char ** err);
// --spec-synth-*: acceptance decided by set rates instead of the model (benchmarking).
bool strata_speculative_has_synth(const strata_speculative * s);
// Seeds sequence seq's acceptance RNG from the sampler's requested seed (random if default).
bool strata_speculative_synth_seed(strata_speculative * s, llama_seq_id seq, const strata_sampler * smpl, char ** err);
// As strata_sampler_sample_and_accept_n, with synthetic acceptance.
int32_t strata_speculative_accept_synth(strata_speculative * s, llama_seq_id seq, strata_sampler * smpl,
                                        struct llama_context * ctx, const int32_t * idxs,
                                        const llama_token * draft, int32_t n_draft, llama_token * out, char ** err);
// The most draft tokens any configured drafter proposes.
int32_t strata_speculative_n_max(const strata_speculative * s);
bool                 strata_speculative_accept(strata_speculative * s, llama_seq_id seq, uint16_t n_accepted, char ** err);
// A context checkpoint's share of the drafter: the part of the draft context's sequence that
// cannot be cut back (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) and, with_drafter, the drafter's own
// state, as one buffer; restore puts back what it holds. NULL/false on failure.
typedef struct strata_bytes strata_bytes;
strata_bytes *  strata_speculative_checkpoint(strata_speculative * s, llama_seq_id seq, bool with_drafter, char ** err);
bool            strata_speculative_restore(strata_speculative * s, llama_seq_id seq, const uint8_t * data, size_t n, char ** err);
const uint8_t * strata_bytes_data(const strata_bytes * b);
size_t          strata_bytes_size(const strata_bytes * b);
void            strata_bytes_free(strata_bytes * b);

// ---- context memory -------------------------------------------------------------------------

// common_context_can_seq_rm: 0 no sequence removal, 1 partial, 2 whole sequences only,
// 3 partial within llama_n_rs_seq positions. Clears the context's memory. -1 on failure.
int32_t strata_context_seq_rm_type(struct llama_context * ctx, char ** err);
// The same for the draft context (1 without one). Clears the draft context's memory.
int32_t strata_speculative_seq_rm_type(strata_speculative * s, char ** err);

// ---- vocabulary -----------------------------------------------------------------------------

// llama_tokenize, llama_token_to_piece and llama_detokenize with their exceptions caught (a
// token id outside the vocabulary throws): INT32_MIN and *err on failure, else their results.
int32_t strata_tokenize(const struct llama_vocab * vocab, const char * text, int32_t len, llama_token * out,
                        int32_t n_max, bool add_special, bool parse_special, char ** err);
int32_t strata_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t len,
                              int32_t lstrip, bool special, char ** err);
int32_t strata_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens, char * text,
                          int32_t len, bool remove_special, bool unparse_special, char ** err);

// ---- router mode ----------------------------------------------------------------------------

// The models a router offers (Hugging Face cache, models_dir, models_preset INI, in that order
// of precedence), each cascaded over the router's own arguments as llama-server's router does:
// [{"name", "source": "cache|models_dir|preset", "args": [child arguments, no binary, no port],
//   "ini": "preset text" or null, "aliases", "tags", "stop_timeout": "", "load_on_startup", "hidden"}]
char * strata_router_models(int argc, char ** argv, const char * models_dir, const char * models_preset, char ** err);

// Validates a Hugging Face repo[:quant] by fetching its metadata (as POST /models does).
bool strata_router_check_repo(const char * repo, const char * hf_token, char ** err);

// Resolves (downloading if needed) the model files params name; a download child runs this.
bool strata_router_download(strata_params * p, char ** err);
// What llama-server does before loading in single-model mode: downloads what -hf/-mu/-hfd name
// and infers --spec-type from the draft model's file when none was given.
bool strata_params_resolve_models(strata_params * p, char ** err);

// Removes a cached Hugging Face model from disk; false when nothing was removed.
bool strata_router_remove_cached(const char * repo);

// Keeps the process's stdout for messages to a router: returns a duplicate of it and points
// fd 1 at stderr, so llama.cpp's own prints go to the log. -1 on failure.
int strata_reserve_stdout(void);

// ---- MoE experts ----------------------------------------------------------------------------

// The CPU backend's kernels for one ggml type (from_float, vec_dot), or NULL when the CPU
// backend module is not loaded. The CPU backend is a run-time module here, so it is looked up.
const struct ggml_type_traits_cpu * strata_cpu_type_traits(int type);

#ifdef __cplusplus
}
#endif
