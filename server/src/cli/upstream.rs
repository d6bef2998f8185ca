//! Every option of the pinned llama-server's `--help`, and what strata-server does with it: one
//! row per help entry, in its order. Tests walk the table against the help text and check each
//! row's evidence; start-up refuses the refused ones by name. docs/llama-server-flags.md is
//! written from it.

use serde_json::Value;

use Class::{Honoured, Inert, Refused};

// the evidence and samples are read by the tests that walk the table
#[cfg_attr(not(test), allow(dead_code))]
pub struct U {
    /// The spellings as llama-server's `--help` lists them.
    pub option: &'static str,
    pub class: Class,
    /// Arguments that give the option a value other than its default (none where that needs
    /// the network); `{dir}` is a directory of test files.
    pub sample: &'static [&'static str],
}

#[cfg_attr(not(test), allow(dead_code))]
pub enum Class {
    /// Strata does what llama-server does, shown by: `test:PATH::NAME` (a test), or
    /// `model:FIELD` / `context:FIELD` / `draft_model:FIELD` / `draft_context:FIELD` (the sample
    /// changes that field of the llama.cpp parameters strata-server loads with), or
    /// `sampling:KEY` (the sample changes the requests' default sampling settings), or
    /// `backend:numa` (the sample changes what start-up hands llama_numa_init).
    Honoured(&'static str),
    /// Start-up stops, naming the option, when the parsed parameters' `key` differs from its
    /// default.
    Refused { key: &'static str, why: &'static str },
    /// llama-server does nothing with it either: the pin's line (`PATH:LINE` in the unpatched
    /// pin) that shows it, with that line's text.
    Inert { pin: &'static str, text: &'static str, why: &'static str },
}

const MULTIMODAL: &str = "strata-server does not serve images, audio or video yet (no multimodal projector is loaded); leave out the multimodal options, and with -hf add --no-mmproj to serve the text model alone";

pub const TABLE: &[U] = &[
    U {
        option: "-h, --help, --usage",
        class: Honoured("test:tests/integration/cli.rs::help_is_upstreams_followed_by_the_strata_section"),
        sample: &["--help"],
    },
    U { option: "--version", class: Honoured("test:tests/integration/cli.rs::version_is_strata_then_upstreams"), sample: &["--version"] },
    U { option: "-cl, --cache-list", class: Honoured("test:tests/integration/cli.rs::exit_options_print_what_upstream_prints"), sample: &["-cl"] },
    U {
        option: "--completion-bash",
        class: Honoured("test:tests/integration/cli.rs::exit_options_print_what_upstream_prints"),
        sample: &["--completion-bash"],
    },
    U { option: "-t, --threads", class: Honoured("context:n_threads"), sample: &["-t", "3"] },
    U { option: "-tb, --threads-batch", class: Honoured("context:n_threads_batch"), sample: &["-tb", "5"] },
    U { option: "-C, --cpu-mask", class: Honoured("test:tests/python/test_init_parity.py::test_cpu_masks_pin_the_compute_threads_as_upstream_does"), sample: &["-C", "0x1"] },
    U { option: "-Cr, --cpu-range", class: Honoured("test:tests/python/test_init_parity.py::test_cpu_masks_pin_the_compute_threads_as_upstream_does"), sample: &["-Cr", "0-1"] },
    U { option: "--cpu-strict", class: Honoured("test:tests/python/test_init_parity.py::test_cpu_masks_pin_the_compute_threads_as_upstream_does"), sample: &["--cpu-strict", "1"] },
    U { option: "--prio", class: Honoured("test:tests/python/test_init_parity.py::test_prio_lowers_the_compute_threads_as_upstream_does"), sample: &["--prio", "2"] },
    U { option: "--poll", class: Inert {
            pin: "ggml/src/ggml-cpu/ggml-cpu.c:3176",
            text: "#ifndef GGML_USE_OPENMP",
            why: "ggml's threads poll only in builds without OpenMP, and both servers are built with it (GGML_OPENMP); strata-server hands the value to the same threadpool call",
        }, sample: &["--poll", "0"] },
    U { option: "-Cb, --cpu-mask-batch", class: Honoured("test:tests/python/test_init_parity.py::test_batch_masks_pin_prompt_batches_and_the_single_token_masks_generation"), sample: &["-Cb", "0xc"] },
    U { option: "-Crb, --cpu-range-batch", class: Honoured("test:tests/python/test_init_parity.py::test_batch_masks_pin_prompt_batches_and_the_single_token_masks_generation"), sample: &["-Crb", "2-3"] },
    U { option: "--cpu-strict-batch", class: Honoured("test:tests/python/test_init_parity.py::test_batch_masks_pin_prompt_batches_and_the_single_token_masks_generation"), sample: &["--cpu-strict-batch", "1"] },
    U { option: "--prio-batch", class: Honoured("test:tests/python/test_init_parity.py::test_batch_masks_pin_prompt_batches_and_the_single_token_masks_generation"), sample: &["--prio-batch", "2"] },
    U { option: "--poll-batch", class: Inert {
            pin: "ggml/src/ggml-cpu/ggml-cpu.c:3176",
            text: "#ifndef GGML_USE_OPENMP",
            why: "ggml's threads poll only in builds without OpenMP, and both servers are built with it (GGML_OPENMP); strata-server hands the value to the same threadpool call",
        }, sample: &["--poll-batch", "0"] },
    U { option: "-c, --ctx-size", class: Honoured("test:tests/integration/cli.rs::llama_arg_ctx_size_env_is_honoured"), sample: &["-c", "512"] },
    U {
        option: "-n, --predict, --n-predict",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_prefix_keys_props_ui_config_predict_and_slot_similarity"),
        sample: &["-n", "5"],
    },
    U {
        option: "-b, --batch-size",
        class: Honoured("test:tests/integration/http.rs::infill_builds_upstreams_prompt_and_refuses_models_without_fim"),
        sample: &["-b", "256"],
    },
    U { option: "-ub, --ubatch-size", class: Honoured("context:n_ubatch"), sample: &["-ub", "128"] },
    U {
        option: "--keep",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_keep_is_the_default_n_keep_of_the_context_shift"),
        sample: &["--keep", "4"],
    },
    U { option: "--swa-full", class: Honoured("context:swa_full"), sample: &["--swa-full"] },
    U { option: "-fa, --flash-attn", class: Honoured("context:flash_attn_type"), sample: &["-fa", "off"] },
    U { option: "--perf, --no-perf", class: Honoured("context:no_perf"), sample: &["--no-perf"] },
    U { option: "-e, --escape, --no-escape", class: Honoured("sampling:dry_sequence_breakers"), sample: &["--no-escape", "--dry-sequence-breaker", "a\\nb"] },
    U { option: "--rope-scaling", class: Honoured("context:rope_scaling_type"), sample: &["--rope-scaling", "yarn"] },
    U { option: "--rope-scale", class: Honoured("context:rope_freq_scale"), sample: &["--rope-scale", "2"] },
    U { option: "--rope-freq-base", class: Honoured("context:rope_freq_base"), sample: &["--rope-freq-base", "20000"] },
    U { option: "--rope-freq-scale", class: Honoured("context:rope_freq_scale"), sample: &["--rope-freq-scale", "0.5"] },
    U { option: "--yarn-orig-ctx", class: Honoured("context:yarn_orig_ctx"), sample: &["--yarn-orig-ctx", "2048"] },
    U { option: "--yarn-ext-factor", class: Honoured("context:yarn_ext_factor"), sample: &["--yarn-ext-factor", "0.5"] },
    U { option: "--yarn-attn-factor", class: Honoured("context:yarn_attn_factor"), sample: &["--yarn-attn-factor", "0.9"] },
    U { option: "--yarn-beta-slow", class: Honoured("context:yarn_beta_slow"), sample: &["--yarn-beta-slow", "2"] },
    U { option: "--yarn-beta-fast", class: Honoured("context:yarn_beta_fast"), sample: &["--yarn-beta-fast", "16"] },
    U { option: "-kvo, --kv-offload, -nkvo, --no-kv-offload", class: Honoured("context:offload_kqv"), sample: &["-nkvo"] },
    U { option: "--repack, -nr, --no-repack", class: Honoured("model:use_extra_bufts"), sample: &["-nr"] },
    U { option: "--no-host", class: Honoured("model:no_host"), sample: &["--no-host"] },
    U { option: "-ctk, --cache-type-k", class: Honoured("context:type_k"), sample: &["-ctk", "q8_0"] },
    U { option: "-ctv, --cache-type-v", class: Honoured("context:type_v"), sample: &["-ctv", "q8_0"] },
    U {
        option: "-dt, --defrag-thold",
        class: Inert { pin: "common/arg.cpp:2539", text: "GGML_UNUSED(params);", why: "the handler only warns that it is deprecated" },
        sample: &["-dt", "0.1"],
    },
    U {
        option: "--rpc",
        class: Honoured("test:tests/integration/rpc.rs::two_rpc_servers_give_the_cpu_tokens"),
        sample: &["--rpc", "127.0.0.1:50052", "-ngl", "99"],
    },
    U { option: "-lm, --load-mode", class: Honoured("model:load_mode"), sample: &["-lm", "none"] },
    U { option: "-lzm, --lazy-mode", class: Honoured("model:lazy_mode"), sample: &["-lzm", "off"] },
    U { option: "--numa", class: Honoured("backend:numa"), sample: &["--numa", "distribute"] },
    U { option: "-dev, --device", class: Honoured("model:devices"), sample: &["-dev", "none"] },
    U { option: "--list-devices", class: Honoured("test:tests/integration/cli.rs::exit_options_print_what_upstream_prints"), sample: &["--list-devices"] },
    U { option: "-ot, --override-tensor", class: Honoured("model:tensor_buft_overrides"), sample: &["-ot", "blk\\.0\\.ffn_.*=CPU"] },
    U { option: "-cmoe, --cpu-moe", class: Honoured("model:tensor_buft_overrides"), sample: &["-cmoe"] },
    U { option: "-ncmoe, --n-cpu-moe", class: Honoured("model:tensor_buft_overrides"), sample: &["-ncmoe", "2"] },
    U { option: "-ncffn, --n-cpu-ffn", class: Honoured("model:tensor_buft_overrides"), sample: &["-ncffn", "2"] },
    U { option: "-ngl, --gpu-layers, --n-gpu-layers", class: Honoured("model:n_gpu_layers"), sample: &["-ngl", "0"] },
    U { option: "-sm, --split-mode", class: Honoured("model:split_mode"), sample: &["-sm", "none"] },
    U { option: "-ts, --tensor-split", class: Honoured("model:tensor_split"), sample: &["-ts", "3,1"] },
    U { option: "-mg, --main-gpu", class: Honoured("model:main_gpu"), sample: &["-mg", "1"] },
    U { option: "-fit, --fit", class: Honoured("test:tests/python/test_init_parity.py::test_fit_on_the_cpu_sizes_the_context_as_upstream_does"), sample: &["-fit", "off"] },
    U { option: "-fitt, --fit-target", class: Honoured("test:tests/python/test_init_parity.py::test_fit_on_the_cpu_sizes_the_context_as_upstream_does"), sample: &["-fitt", "2048"] },
    U { option: "-fitc, --fit-ctx", class: Honoured("test:tests/python/test_init_parity.py::test_fit_on_the_cpu_sizes_the_context_as_upstream_does"), sample: &["-fitc", "8192"] },
    U { option: "--check-tensors", class: Honoured("model:check_tensors"), sample: &["--check-tensors"] },
    U { option: "--override-kv", class: Honoured("model:kv_overrides"), sample: &["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"] },
    U { option: "--op-offload, --no-op-offload", class: Honoured("context:op_offload"), sample: &["--no-op-offload"] },
    U { option: "--lora", class: Honoured("test:tests/integration/engine.rs::lora_scales_global_and_per_request"), sample: &["--lora", "a.gguf"] },
    U {
        option: "--lora-scaled",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_lora_scaled_applies_the_adapter_at_its_scale"),
        sample: &["--lora-scaled", "a.gguf:0.5"],
    },
    U { option: "--control-vector", class: Honoured("test:tests/python/test_init_parity.py::test_control_vectors_steer_generation_as_upstream_does"), sample: &["--control-vector", "cv.gguf"] },
    U { option: "--control-vector-scaled", class: Honoured("test:tests/python/test_init_parity.py::test_control_vectors_steer_generation_as_upstream_does"), sample: &["--control-vector-scaled", "cv.gguf:0.8"] },
    U { option: "--control-vector-layer-range", class: Honoured("test:tests/python/test_init_parity.py::test_control_vectors_steer_generation_as_upstream_does"), sample: &["--control-vector-layer-range", "2", "10"] },
    U {
        option: "-m, --model",
        class: Honoured("test:tests/integration/http.rs::infill_builds_upstreams_prompt_and_refuses_models_without_fim"),
        sample: &["-m", "tiny-llama-fim.gguf"],
    },
    U {
        option: "-mu, --model-url",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_model_url_downloads_to_the_model_path"),
        sample: &["-m", "/tmp/x.gguf", "-mu", "http://host/x.gguf"],
    },
    U {
        option: "-dr, --docker-repo",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_docker_repo_fails_as_upstream_does"),
        sample: &["-dr", "gemma3"],
    },
    U {
        option: "-hf, -hfr, --hf-repo",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_hf_repo_file_token_and_offline"),
        sample: &["-hf", "ggml-org/tinygemma3-GGUF:Q8_0"],
    },
    U {
        option: "-hff, --hf-file",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_hf_repo_file_token_and_offline"),
        sample: &["-hf", "org/repo", "-hff", "m.gguf"],
    },
    U {
        option: "-hft, --hf-token",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_hf_repo_file_token_and_offline"),
        sample: &["-hft", "hf_xxx"],
    },
    U { option: "--log-disable", class: Honoured("test:tests/integration/cli.rs::log_options_shape_strata_lines_as_upstreams"), sample: &["--log-disable"] },
    U {
        option: "--log-file",
        class: Honoured("test:tests/integration/cli.rs::log_options_shape_strata_lines_as_upstreams"),
        sample: &["--log-file", "/tmp/s.log"],
    },
    U {
        option: "--log-jsonl, --no-log-jsonl",
        class: Honoured("test:tests/integration/cli.rs::log_options_shape_strata_lines_as_upstreams"),
        sample: &["--log-jsonl"],
    },
    U {
        option: "--log-colors",
        class: Honoured("test:tests/integration/cli.rs::log_options_shape_strata_lines_as_upstreams"),
        sample: &["--log-colors", "off"],
    },
    U {
        option: "-v, --verbose, --log-verbose",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_chat_completion.py::test_chat_template"),
        sample: &["-v"],
    },
    U { option: "--offline", class: Honoured("test:tests/python/test_flags_upstream.py::test_hf_repo_file_token_and_offline"), sample: &["--offline"] },
    U {
        option: "-lv, --verbosity, --log-verbosity",
        class: Honoured("test:tests/integration/checkpoints.rs::a_hybrid_model_resumes_a_shared_prefix_from_a_checkpoint"),
        sample: &["-lv", "4"],
    },
    U {
        option: "--log-prefix, --no-log-prefix",
        class: Honoured("test:tests/integration/cli.rs::log_options_shape_strata_lines_as_upstreams"),
        sample: &["--log-prefix"],
    },
    U {
        option: "--log-timestamps, --no-log-timestamps",
        class: Honoured("test:tests/integration/cli.rs::log_options_shape_strata_lines_as_upstreams"),
        sample: &["--log-timestamps"],
    },
    U { option: "--spec-draft-type-k, -ctkd, --cache-type-k-draft", class: Honoured("draft_context:type_k"), sample: &["-md", "d.gguf", "-ctkd", "q8_0"] },
    U { option: "--spec-draft-type-v, -ctvd, --cache-type-v-draft", class: Honoured("draft_context:type_v"), sample: &["-md", "d.gguf", "-ctvd", "q8_0"] },
    U { option: "--samplers", class: Honoured("sampling:samplers"), sample: &["--samplers", "top_k;temperature"] },
    U { option: "-s, --seed", class: Honoured("sampling:seed"), sample: &["-s", "42"] },
    U { option: "--sampler-seq, --sampling-seq", class: Honoured("sampling:samplers"), sample: &["--sampler-seq", "kt"] },
    U { option: "--ignore-eos", class: Honoured("test:tests/python/test_init_parity.py::test_ignore_eos_bans_the_end_of_generation_as_upstream_does"), sample: &["--ignore-eos"] },
    U { option: "--temp, --temperature", class: Honoured("sampling:temperature"), sample: &["--temp", "0.3"] },
    U { option: "--top-k", class: Honoured("sampling:top_k"), sample: &["--top-k", "7"] },
    U { option: "--top-p", class: Honoured("sampling:top_p"), sample: &["--top-p", "0.5"] },
    U { option: "--min-p", class: Honoured("sampling:min_p"), sample: &["--min-p", "0.2"] },
    U { option: "--top-nsigma, --top-n-sigma", class: Honoured("sampling:top_n_sigma"), sample: &["--top-nsigma", "1.5"] },
    U { option: "--xtc-probability", class: Honoured("sampling:xtc_probability"), sample: &["--xtc-probability", "0.5"] },
    U { option: "--xtc-threshold", class: Honoured("sampling:xtc_threshold"), sample: &["--xtc-threshold", "0.2"] },
    U { option: "--typical, --typical-p", class: Honoured("sampling:typical_p"), sample: &["--typical", "0.9"] },
    U { option: "--repeat-last-n", class: Honoured("sampling:repeat_last_n"), sample: &["--repeat-last-n", "16"] },
    U { option: "--repeat-penalty", class: Honoured("sampling:repeat_penalty"), sample: &["--repeat-penalty", "1.3"] },
    U { option: "--presence-penalty", class: Honoured("sampling:presence_penalty"), sample: &["--presence-penalty", "0.5"] },
    U { option: "--frequency-penalty", class: Honoured("sampling:frequency_penalty"), sample: &["--frequency-penalty", "0.5"] },
    U { option: "--dry-multiplier", class: Honoured("sampling:dry_multiplier"), sample: &["--dry-multiplier", "0.8"] },
    U { option: "--dry-base", class: Honoured("sampling:dry_base"), sample: &["--dry-base", "2.0"] },
    U { option: "--dry-allowed-length", class: Honoured("sampling:dry_allowed_length"), sample: &["--dry-allowed-length", "4"] },
    U { option: "--dry-penalty-last-n", class: Honoured("sampling:dry_penalty_last_n"), sample: &["--dry-penalty-last-n", "32"] },
    U { option: "--dry-sequence-breaker", class: Honoured("sampling:dry_sequence_breakers"), sample: &["--dry-sequence-breaker", "x"] },
    U { option: "--adaptive-target", class: Honoured("sampling:adaptive_target"), sample: &["--adaptive-target", "0.5", "--samplers", "top_k;adaptive_p"] },
    U { option: "--adaptive-decay", class: Honoured("sampling:adaptive_decay"), sample: &["--adaptive-decay", "0.5"] },
    U { option: "--dynatemp-range", class: Honoured("sampling:dynatemp_range"), sample: &["--dynatemp-range", "0.5"] },
    U { option: "--dynatemp-exp", class: Honoured("sampling:dynatemp_exponent"), sample: &["--dynatemp-exp", "2"] },
    U { option: "--mirostat", class: Honoured("sampling:mirostat"), sample: &["--mirostat", "2"] },
    U { option: "--mirostat-lr", class: Honoured("sampling:mirostat_eta"), sample: &["--mirostat-lr", "0.2"] },
    U { option: "--mirostat-ent", class: Honoured("sampling:mirostat_tau"), sample: &["--mirostat-ent", "3"] },
    U { option: "-l, --logit-bias", class: Honoured("sampling:logit_bias"), sample: &["-l", "15043+1"] },
    U { option: "--grammar", class: Honoured("sampling:grammar"), sample: &["--grammar", "root ::= \"a\""] },
    U { option: "--grammar-file", class: Honoured("sampling:grammar"), sample: &["--grammar-file", "{dir}/g.gbnf"] },
    U { option: "-j, --json-schema", class: Honoured("sampling:grammar"), sample: &["-j", "{\"type\":\"object\"}"] },
    U { option: "-jf, --json-schema-file", class: Honoured("sampling:grammar"), sample: &["-jf", "{dir}/schema.json"] },
    U { option: "-bs, --backend-sampling", class: Honoured("test:tests/integration/sampling.rs::backend_sampling_samples_in_the_graph_and_detaches"), sample: &["-bs"] },
    U {
        option: "--spec-draft-hf, -hfd, -hfrd, --hf-repo-draft",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_hf_repo_draft_is_downloaded_and_drafts"),
        sample: &["-hf", "u/m", "-hfd", "u/d"],
    },
    U {
        option: "--spec-draft-threads, -td, --threads-draft",
        class: Honoured("draft_context:n_threads"),
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf", "-td", "3"],
    },
    U {
        option: "--spec-draft-threads-batch, -tbd, --threads-batch-draft",
        class: Honoured("draft_context:n_threads_batch"),
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf", "-td", "3", "-tbd", "5"],
    },
    U {
        option: "--spec-draft-cpu-mask, -Cd, --cpu-mask-draft",
        class: Inert {
            pin: "common/speculative.cpp:2554",
            text: "result.cpuparams.n_threads       = params_spec.cpuparams.n_threads;",
            why: "the draft takes only its thread count from its own CPU options",
        },
        sample: &["-Cd", "0x3"],
    },
    U {
        option: "--spec-draft-cpu-range, -Crd, --cpu-range-draft",
        class: Inert {
            pin: "common/speculative.cpp:2554",
            text: "result.cpuparams.n_threads       = params_spec.cpuparams.n_threads;",
            why: "the draft takes only its thread count from its own CPU options",
        },
        sample: &["-Crd", "0-1"],
    },
    U {
        option: "--spec-draft-cpu-strict, --cpu-strict-draft",
        class: Inert {
            pin: "common/speculative.cpp:2554",
            text: "result.cpuparams.n_threads       = params_spec.cpuparams.n_threads;",
            why: "the draft takes only its thread count from its own CPU options",
        },
        sample: &["--cpu-strict-draft", "1"],
    },
    U {
        option: "--spec-draft-prio, --prio-draft",
        class: Inert {
            pin: "common/speculative.cpp:2554",
            text: "result.cpuparams.n_threads       = params_spec.cpuparams.n_threads;",
            why: "the draft takes only its thread count from its own CPU options",
        },
        sample: &["--prio-draft", "2"],
    },
    U {
        option: "--spec-draft-poll, --poll-draft",
        class: Inert {
            pin: "common/speculative.cpp:2554",
            text: "result.cpuparams.n_threads       = params_spec.cpuparams.n_threads;",
            why: "the draft takes only its thread count from its own CPU options",
        },
        sample: &["--poll-draft", "0"],
    },
    U {
        option: "--spec-draft-cpu-mask-batch, -Cbd, --cpu-mask-batch-draft",
        class: Inert {
            pin: "common/speculative.cpp:2555",
            text: "result.cpuparams_batch.n_threads = params_spec.cpuparams_batch.n_threads;",
            why: "the draft takes only its batch thread count from its own CPU options",
        },
        sample: &["-Cbd", "0x3"],
    },
    U {
        option: "--spec-draft-cpu-strict-batch, --cpu-strict-batch-draft",
        class: Inert {
            pin: "common/speculative.cpp:2555",
            text: "result.cpuparams_batch.n_threads = params_spec.cpuparams_batch.n_threads;",
            why: "the draft takes only its batch thread count from its own CPU options",
        },
        sample: &["--cpu-strict-batch-draft", "1"],
    },
    U {
        option: "--spec-draft-prio-batch, --prio-batch-draft",
        class: Inert {
            pin: "common/speculative.cpp:2555",
            text: "result.cpuparams_batch.n_threads = params_spec.cpuparams_batch.n_threads;",
            why: "the draft takes only its batch thread count from its own CPU options",
        },
        sample: &["--prio-batch-draft", "2"],
    },
    U {
        option: "--spec-draft-poll-batch, --poll-batch-draft",
        class: Inert {
            pin: "common/speculative.cpp:2555",
            text: "result.cpuparams_batch.n_threads = params_spec.cpuparams_batch.n_threads;",
            why: "the draft takes only its batch thread count from its own CPU options",
        },
        sample: &["--poll-batch-draft", "0"],
    },
    U {
        option: "--spec-draft-override-tensor, -otd, --override-tensor-draft",
        class: Honoured("draft_model:tensor_buft_overrides"),
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf", "-otd", "ffn_.*=CPU"],
    },
    U {
        option: "--spec-draft-cpu-moe, -cmoed, --cpu-moe-draft",
        class: Honoured("draft_model:tensor_buft_overrides"),
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf", "-cmoed"],
    },
    U {
        option: "--spec-draft-n-cpu-moe, --spec-draft-ncmoe, -ncmoed, --n-cpu-moe-draft",
        class: Honoured("draft_model:tensor_buft_overrides"),
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf", "-ncmoed", "2"],
    },
    U {
        option: "--spec-draft-n-max",
        class: Honoured("context:n_outputs_max_per_seq"),
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf", "--spec-draft-n-max", "2"],
    },
    U {
        option: "--spec-draft-n-min",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_draft_model_n_min_and_p_min_drop_drafts"),
        sample: &["--spec-draft-n-min", "2"],
    },
    U {
        option: "--spec-synth-len",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_mtp_synthetic_acceptance_and_draft_backend_sampling"),
        sample: &["--spec-type", "draft-mtp", "--spec-synth-len", "2.5"],
    },
    U {
        option: "--spec-synth-rates",
        class: Honoured("test:tools/compat/side-by-side.json::draft-mtp synthetic"),
        sample: &["--spec-type", "draft-mtp", "--spec-synth-rates", "0.9,0.6,0.3"],
    },
    U {
        option: "--spec-draft-p-split, --draft-p-split",
        class: Inert { pin: "common/arg.cpp:4203", text: "params.speculative.draft.p_split = std::stof(value);", why: "written here and read nowhere" },
        sample: &["--spec-draft-p-split", "0.3"],
    },
    U {
        option: "--spec-draft-p-min, --draft-p-min",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_draft_model_n_min_and_p_min_drop_drafts"),
        sample: &["--spec-draft-p-min", "0.5"],
    },
    U {
        option: "--spec-draft-backend-sampling, --no-spec-draft-backend-sampling",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_mtp_synthetic_acceptance_and_draft_backend_sampling"),
        sample: &["--spec-type", "draft-mtp", "--no-spec-draft-backend-sampling"],
    },
    U {
        option: "--spec-draft-sampling",
        class: Refused { key: "spec_draft_probabilistic", why: "strata-server verifies drafts greedily; probabilistic (rejection-sampled) verification is not built in, leave the default greedy" },
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf", "--spec-draft-sampling", "probabilistic"],
    },
    U {
        option: "--spec-draft-device, -devd, --device-draft",
        class: Honoured("draft_model:devices"),
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf", "-devd", "none"],
    },
    U {
        option: "--spec-draft-ngl, -ngld, --gpu-layers-draft, --n-gpu-layers-draft",
        class: Honoured("draft_model:n_gpu_layers"),
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf", "-ngld", "0"],
    },
    U {
        option: "--spec-draft-model, -md, --model-draft",
        class: Honoured("test:tests/integration/engine.rs::speculative_decoding_keeps_greedy_output"),
        sample: &["--spec-type", "draft-simple", "-md", "d.gguf"],
    },
    U {
        option: "--spec-type",
        class: Honoured("test:tests/integration/checkpoints.rs::speculation_on_a_hybrid_model_keeps_greedy_output"),
        sample: &["--spec-type", "draft-mtp"],
    },
    U {
        option: "--spec-ngram-mod-n-min",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_ngram_mod_match_and_min"),
        sample: &["--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "8"],
    },
    U {
        option: "--spec-ngram-mod-n-max",
        class: Honoured("context:n_outputs_max_per_seq"),
        sample: &["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "16"],
    },
    U {
        option: "--spec-ngram-mod-n-match",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_ngram_mod_match_and_min"),
        sample: &["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "8"],
    },
    U {
        option: "--spec-ngram-simple-size-n",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_ngram_simple_size_and_min_hits"),
        sample: &["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4"],
    },
    U {
        option: "--spec-ngram-simple-size-m",
        class: Honoured("context:n_outputs_max_per_seq"),
        sample: &["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "8"],
    },
    U {
        option: "--spec-ngram-simple-min-hits",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_ngram_simple_size_and_min_hits"),
        sample: &["--spec-type", "ngram-simple", "--spec-ngram-simple-min-hits", "2"],
    },
    U {
        option: "--spec-ngram-map-k-size-n",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_ngram_map_k_size_and_min_hits"),
        sample: &["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "4"],
    },
    U {
        option: "--spec-ngram-map-k-size-m",
        class: Honoured("context:n_outputs_max_per_seq"),
        sample: &["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-m", "8"],
    },
    U {
        option: "--spec-ngram-map-k-min-hits",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_ngram_map_k_size_and_min_hits"),
        sample: &["--spec-type", "ngram-map-k", "--spec-ngram-map-k-min-hits", "2"],
    },
    U {
        option: "--spec-ngram-map-k4v-size-n",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_ngram_map_k4v_size_and_min_hits"),
        sample: &["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "4"],
    },
    U {
        option: "--spec-ngram-map-k4v-size-m",
        class: Honoured("context:n_outputs_max_per_seq"),
        sample: &["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-m", "8"],
    },
    U {
        option: "--spec-ngram-map-k4v-min-hits",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_ngram_map_k4v_size_and_min_hits"),
        sample: &["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-min-hits", "2"],
    },
    U {
        option: "--draft, --draft-n, --draft-max",
        class: Honoured("test:tests/integration/cli.rs::removed_flag_fails_like_upstream"),
        sample: &["--draft-max", "4"],
    },
    U {
        option: "--draft-min, --draft-n-min",
        class: Honoured("test:tests/integration/cli.rs::exit_options_print_what_upstream_prints"),
        sample: &["--draft-min", "2"],
    },
    U {
        option: "--spec-ngram-size-n",
        class: Honoured("test:tests/integration/cli.rs::exit_options_print_what_upstream_prints"),
        sample: &["--spec-ngram-size-n", "4"],
    },
    U {
        option: "--spec-ngram-size-m",
        class: Honoured("test:tests/integration/cli.rs::exit_options_print_what_upstream_prints"),
        sample: &["--spec-ngram-size-m", "8"],
    },
    U {
        option: "--spec-ngram-min-hits",
        class: Honoured("test:tests/integration/cli.rs::exit_options_print_what_upstream_prints"),
        sample: &["--spec-ngram-min-hits", "2"],
    },
    U {
        option: "-lcs, --lookup-cache-static",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_lookup_caches_static_and_dynamic"),
        sample: &["--spec-type", "ngram-cache", "-lcs", "static.bin"],
    },
    U {
        option: "-lcd, --lookup-cache-dynamic",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_lookup_caches_static_and_dynamic"),
        sample: &["--spec-type", "ngram-cache", "-lcd", "dynamic.bin"],
    },
    U { option: "--kv-unified-per-slot", class: Honoured("test:tests/python/test_server_flags.py::test_slot_context_caps_as_upstream"), sample: &["--kv-unified-per-slot", "256"] },
    U {
        option: "-ctxcp, --ctx-checkpoints, --swa-checkpoints",
        class: Honoured("test:tests/integration/checkpoints.rs::a_hybrid_model_resumes_a_shared_prefix_from_a_checkpoint"),
        sample: &["--ctx-checkpoints", "0"],
    },
    U {
        option: "-cms, --checkpoint-min-step",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_checkpoint_min_step_0_checkpoints_every_user_turn"),
        sample: &["-cms", "0"],
    },
    U {
        option: "-cram, --cache-ram",
        class: Honoured("test:tests/integration/engine.rs::an_evicted_prompt_comes_back_from_the_ram_cache"),
        sample: &["--cache-ram", "0"],
    },
    U { option: "-kvu, --kv-unified, -no-kvu, --no-kv-unified", class: Honoured("context:kv_unified"), sample: &["-np", "2", "-kvu"] },
    U {
        option: "--cache-idle-slots, --no-cache-idle-slots",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_kv_keep_only_active.py::test_disabled_with_flag"),
        sample: &["--no-cache-idle-slots"],
    },
    U {
        option: "--context-shift, --no-context-shift",
        class: Honoured("test:tests/integration/engine.rs::context_shift_keeps_generating_past_a_full_context"),
        sample: &["--context-shift"],
    },
    U { option: "-r, --reverse-prompt", class: Honoured("test:tests/python/test_server_flags.py::test_reverse_prompts_are_the_default_stop_strings"), sample: &["-r", "User:"] },
    U { option: "-sp, --special", class: Honoured("test:tests/python/test_server_flags.py::test_special_tokens_and_preserved_tokens_render_as_upstream"), sample: &["-sp"] },
    U { option: "--warmup, --no-warmup", class: Honoured("test:tests/python/test_init_parity.py::test_warmup_runs_by_default_and_after_every_wake"), sample: &["--no-warmup"] },
    U { option: "--spm-infill", class: Honoured("test:tests/python/test_flags_upstream.py::test_skip_chat_parsing_and_spm_infill"), sample: &["--spm-infill"] },
    U { option: "--pooling", class: Honoured("context:pooling_type"), sample: &["--embeddings", "--pooling", "mean"] },
    U { option: "-np, --parallel", class: Honoured("context:n_seq_max"), sample: &["-np", "3"] },
    U { option: "-cb, --cont-batching, -nocb, --no-cont-batching", class: Honoured("test:tests/python/test_server_flags.py::test_no_cont_batching_keeps_prompts_out_of_generating_batches"), sample: &["-nocb"] },
    U { option: "-mm, --mmproj", class: Refused { key: "mmproj", why: MULTIMODAL }, sample: &["-mm", "mmproj.gguf"] },
    U { option: "-mmu, --mmproj-url", class: Refused { key: "mmproj_url", why: MULTIMODAL }, sample: &["-mmu", "https://example.org/mmproj.gguf"] },
    U { option: "--mmproj-auto, --no-mmproj, --no-mmproj-auto", class: Refused { key: "mmproj", why: MULTIMODAL }, sample: &[] },
    U { option: "--mmproj-offload, --no-mmproj-offload", class: Refused { key: "mmproj_use_gpu", why: MULTIMODAL }, sample: &["--no-mmproj-offload"] },
    U { option: "-mmdev, --mmproj-device", class: Refused { key: "mmproj_device", why: MULTIMODAL }, sample: &["-mmdev", "none"] },
    U { option: "--image-min-tokens", class: Refused { key: "image_min_tokens", why: MULTIMODAL }, sample: &["--image-min-tokens", "64"] },
    U { option: "--image-max-tokens", class: Refused { key: "image_max_tokens", why: MULTIMODAL }, sample: &["--image-max-tokens", "256"] },
    U { option: "--mtmd-batch-max-tokens", class: Refused { key: "mtmd_batch_max_tokens", why: MULTIMODAL }, sample: &["--mtmd-batch-max-tokens", "512"] },
    U { option: "--video-fps", class: Refused { key: "video_fps", why: MULTIMODAL }, sample: &["--video-fps", "2"] },
    U {
        option: "--video-timestamp-interval",
        class: Refused { key: "video_timestamp_interval_ms", why: MULTIMODAL },
        sample: &["--video-timestamp-interval", "1000"],
    },
    U { option: "--video-ffmpeg-dir", class: Refused { key: "video_ffmpeg_bin_dir", why: MULTIMODAL }, sample: &["--video-ffmpeg-dir", "/opt/ffmpeg/bin"] },
    U {
        option: "-a, --alias",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_basic.py::test_server_model_aliases_and_tags"),
        sample: &["-a", "tinyllama-2,fim,code"],
    },
    U {
        option: "--tags",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_basic.py::test_server_model_aliases_and_tags"),
        sample: &["--tags", "chat,fim,small"],
    },
    U {
        option: "--embd-normalize",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_embd_normalize_sets_the_default_normalisation"),
        sample: &["--embd-normalize", "-1"],
    },
    U {
        option: "--host",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_basic.py::test_server_multiple_addresses"),
        sample: &["--host", "127.0.0.1,::1"],
    },
    U {
        option: "--port",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_basic.py::test_server_start_simple"),
        sample: &["--port", "8181"],
    },
    U {
        option: "--reuse-port",
        class: Honoured("test:tests/python/test_http_flags.py::test_reuse_port_lets_a_second_server_bind_the_same_port"),
        sample: &["--reuse-port"],
    },
    U { option: "--path", class: Honoured("test:tests/integration/ui.rs::path_serves_a_directory_instead"), sample: &["--path", "./public"] },
    U {
        option: "--cors-origins",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_security.py::test_cors_origins_localhost_reflects"),
        sample: &["--cors-origins", "localhost"],
    },
    U {
        option: "--cors-methods",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_cors_methods_headers_credentials_ui_config_file_and_no_agent"),
        sample: &["--cors-methods", "GET,POST"],
    },
    U {
        option: "--cors-headers",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_cors_methods_headers_credentials_ui_config_file_and_no_agent"),
        sample: &["--cors-headers", "Authorization"],
    },
    U {
        option: "--cors-credentials, --no-cors-credentials",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_cors_methods_headers_credentials_ui_config_file_and_no_agent"),
        sample: &["--no-cors-credentials"],
    },
    U {
        option: "--api-prefix",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_prefix_keys_props_ui_config_predict_and_slot_similarity"),
        sample: &["--api-prefix", "/api"],
    },
    U {
        option: "--ui-config, --webui-config",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_prefix_keys_props_ui_config_predict_and_slot_similarity"),
        sample: &["--ui-config", "{\"theme\":\"dark\"}"],
    },
    U {
        option: "--ui-config-file, --webui-config-file",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_cors_methods_headers_credentials_ui_config_file_and_no_agent"),
        sample: &["--ui-config-file", "ui.json"],
    },
    U {
        option: "--ui-mcp-proxy, --webui-mcp-proxy, --no-ui-mcp-proxy, --no-webui-mcp-proxy",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_proxy.py::test_mcp_proxy_custom_port"),
        sample: &["--ui-mcp-proxy"],
    },
    U {
        option: "--tools",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_tools_builtin.py::test_tools_builtin_read_file"),
        sample: &["--tools", "all"],
    },
    U {
        option: "--tools-runtime",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_tools_runtime_runs_the_tools_in_the_named_container_or_refuses_a_bad_target"),
        sample: &["--tools", "all", "--tools-runtime", "docker-container:abc123"],
    },
    U {
        option: "--mcp-servers-config",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_mcp_servers.py::test_mcp_tools_via_json_config_file"),
        sample: &["--tools", "all", "--mcp-servers-config", "mcp.json"],
    },
    U {
        option: "--mcp-servers-json",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_mcp_servers.py::test_mcp_tools_listed_in_tools_endpoint"),
        sample: &["--tools", "all", "--mcp-servers-json", "{\"mcpServers\":{}}"],
    },
    U {
        option: "-ag, --agent, -no-ag, --no-agent",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_agent_enables_the_tools_the_proxy_and_localhost_cors"),
        sample: &["-ag"],
    },
    U {
        option: "--ui, --webui, --no-ui, --no-webui",
        class: Honoured("test:tests/integration/ui.rs::no_ui_answers_404_and_retires_the_service_worker"),
        sample: &["--no-ui"],
    },
    U { option: "--embedding, --embeddings", class: Honoured("context:embeddings"), sample: &["--embeddings"] },
    U {
        option: "--rerank, --reranking",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_rerank.py::test_rerank_top_n"),
        sample: &["--rerank"],
    },
    U {
        option: "--api-key",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_security.py::test_incorrect_api_key"),
        sample: &["--api-key", "sk-1,sk-2"],
    },
    U {
        option: "--api-key-file",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_prefix_keys_props_ui_config_predict_and_slot_similarity"),
        sample: &["--api-key-file", "keys.txt"],
    },
    U {
        option: "--ssl-key-file",
        class: Honoured("test:tests/python/test_tls.py::test_keep_alive_api_key_and_cors_over_tls"),
        sample: &["--ssl-key-file", "key.pem", "--ssl-cert-file", "cert.pem"],
    },
    U { option: "--ssl-cert-file", class: Honoured("test:tests/python/test_tls.py::test_a_bad_key_or_certificate_stops_start_up"), sample: &[] },
    U {
        option: "--chat-template-kwargs",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_template_kwargs_reasoning_effort_and_no_prefill_assistant"),
        sample: &["--chat-template-kwargs", "{\"k\":\"v\"}"],
    },
    U {
        option: "-to, --timeout",
        class: Honoured("test:server/src/api/listen.rs::a_client_that_stops_reading_is_dropped_after_the_write_timeout"),
        sample: &["-to", "5"],
    },
    U {
        option: "--sse-ping-interval",
        class: Honoured("test:tests/python/test_http_flags.py::test_a_stream_silent_past_the_ping_interval_sends_sse_comments"),
        sample: &["--sse-ping-interval", "2"],
    },
    U {
        option: "--threads-http",
        class: Honoured("test:tests/python/test_http_flags.py::test_threads_http_sets_the_http_runtimes_workers"),
        sample: &["--threads-http", "4"],
    },
    U { option: "--cache-prompt, --no-cache-prompt", class: Honoured("test:tests/python/test_server_flags.py::test_cache_prompt_default_comes_from_the_server"), sample: &["--no-cache-prompt"] },
    U {
        option: "--cache-reuse",
        class: Honoured("test:tests/integration/engine.rs::cache_reuse_shifts_a_shared_tail_into_place"),
        sample: &["--cache-reuse", "4"],
    },
    U {
        option: "--metrics",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_metrics.py::test_metrics_prometheus_format"),
        sample: &["--metrics"],
    },
    U {
        option: "--props",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_prefix_keys_props_ui_config_predict_and_slot_similarity"),
        sample: &["--props"],
    },
    U {
        option: "--slots, --no-slots",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_basic.py::test_server_slots"),
        sample: &["--no-slots"],
    },
    U {
        option: "--slot-save-path",
        class: Honoured("test:tests/integration/engine.rs::slots_save_erase_restore_and_no_path_escapes"),
        sample: &["--slot-save-path", "/tmp/slots"],
    },
    U { option: "--media-path", class: Refused { key: "media_path", why: MULTIMODAL }, sample: &["--media-path", "/tmp"] },
    U {
        option: "--models-dir",
        class: Honoured("test:tests/integration/router.rs::router_lists_routes_and_unloads_a_models_dir_model"),
        sample: &["--models-dir", "./models"],
    },
    U {
        option: "--models-preset",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_router.py::test_router_unload_model"),
        sample: &["--models-preset", "presets.ini"],
    },
    U {
        option: "--models-max",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_router.py::test_router_models_max_evicts_lru"),
        sample: &["--models-max", "1"],
    },
    U {
        option: "--models-autoload, --no-models-autoload",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_router.py::test_router_no_models_autoload"),
        sample: &["--no-models-autoload"],
    },
    U {
        option: "--jinja, --no-jinja",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_chat_completion.py::test_chat_template"),
        sample: &["--no-jinja"],
    },
    U {
        option: "--reasoning-format",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_reasoning_format_none_and_reasoning_budget_with_its_message"),
        sample: &["--reasoning-format", "none"],
    },
    U {
        option: "-rea, --reasoning",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_template.py::test_reasoning"),
        sample: &["--reasoning", "off"],
    },
    U {
        option: "--reasoning-effort",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_template_kwargs_reasoning_effort_and_no_prefill_assistant"),
        sample: &["--reasoning-effort", "high"],
    },
    U {
        option: "--reasoning-budget",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_reasoning_format_none_and_reasoning_budget_with_its_message"),
        sample: &["--reasoning-budget", "0"],
    },
    U {
        option: "--reasoning-budget-message",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_reasoning_format_none_and_reasoning_budget_with_its_message"),
        sample: &["--reasoning-budget-message", "Done."],
    },
    U {
        option: "--reasoning-preserve, --no-reasoning-preserve",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_no_reasoning_preserve_drops_earlier_reasoning"),
        sample: &["--no-reasoning-preserve"],
    },
    U {
        option: "--chat-template",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_chat_completion.py::test_chat_template"),
        sample: &["--chat-template", "chatml"],
    },
    U {
        option: "--chat-template-file",
        class: Honoured("test:vendor/llama.cpp/tools/server/tests/unit/test_template.py::test_date_inside_prompt"),
        sample: &["--jinja", "--chat-template-file", "t.jinja"],
    },
    U {
        option: "--skip-chat-parsing, --no-skip-chat-parsing",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_skip_chat_parsing_and_spm_infill"),
        sample: &["--skip-chat-parsing"],
    },
    U {
        option: "--prefill-assistant, --no-prefill-assistant",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_template_kwargs_reasoning_effort_and_no_prefill_assistant"),
        sample: &["--no-prefill-assistant"],
    },
    U {
        option: "-sps, --slot-prompt-similarity",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_prefix_keys_props_ui_config_predict_and_slot_similarity"),
        sample: &["-sps", "0.5"],
    },
    U {
        option: "--lora-init-without-apply",
        class: Inert {
            pin: "tools/server/server-context.cpp:3059",
            text: "common_set_adapter_lora(ctx_tgt, slot_batched->lora);",
            why: "llama-server applies each slot's adapters (the --lora scales unless a request sets them) before every batch",
        },
        sample: &["--lora", "x.gguf", "--lora-init-without-apply"],
    },
    U {
        option: "--sleep-idle-seconds",
        class: Honoured("test:tests/integration/engine.rs::sleep_idle_seconds_frees_the_context_and_a_request_wakes_it"),
        sample: &["--sleep-idle-seconds", "1"],
    },
    U { option: "--log-prompts-dir", class: Honoured("test:tests/python/test_server_flags.py::test_log_prompts_dir_writes_each_routes_prompt_as_upstream"), sample: &["--log-prompts-dir", "/tmp/prompts"] },
    U {
        option: "--embd-gemma-default",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_preset_downloads_its_model_and_sets_its_parameters"),
        sample: &["--embd-gemma-default"],
    },
    U {
        option: "--fim-qwen-1.5b-default",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_preset_downloads_its_model_and_sets_its_parameters"),
        sample: &["--fim-qwen-1.5b-default"],
    },
    U {
        option: "--fim-qwen-3b-default",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_preset_downloads_its_model_and_sets_its_parameters"),
        sample: &["--fim-qwen-3b-default"],
    },
    U {
        option: "--fim-qwen-7b-default",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_preset_downloads_its_model_and_sets_its_parameters"),
        sample: &["--fim-qwen-7b-default"],
    },
    U {
        option: "--fim-qwen-7b-spec",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_preset_downloads_its_model_and_sets_its_parameters"),
        sample: &["--fim-qwen-7b-spec"],
    },
    U {
        option: "--fim-qwen-14b-spec",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_preset_downloads_its_model_and_sets_its_parameters"),
        sample: &["--fim-qwen-14b-spec"],
    },
    U {
        option: "--fim-qwen-30b-default",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_preset_downloads_its_model_and_sets_its_parameters"),
        sample: &["--fim-qwen-30b-default"],
    },
    U { option: "--gpt-oss-20b-default", class: Honoured("sampling:min_p"), sample: &["--gpt-oss-20b-default"] },
    U { option: "--gpt-oss-120b-default", class: Honoured("sampling:min_p"), sample: &["--gpt-oss-120b-default"] },
    U { option: "--vision-gemma-4b-default", class: Refused { key: "mmproj", why: MULTIMODAL }, sample: &[] },
    U { option: "--vision-gemma-12b-default", class: Refused { key: "mmproj", why: MULTIMODAL }, sample: &[] },
    U {
        option: "--spec-default",
        class: Honoured("test:tests/python/test_flags_upstream.py::test_spec_default_is_ngram_mod_with_its_sizes"),
        sample: &["--spec-default"],
    },
];

/// The options the parsed parameters (`cfg`, in the shim's JSON) set that strata-server
/// refuses, each as a start-up error; `defaults` are llama-server's before any option.
pub fn refusals(cfg: &Value, defaults: &Value) -> Vec<String> {
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for u in TABLE {
        let Class::Refused { key, why } = u.class else { continue };
        if cfg[key] != defaults[key] && !seen.contains(&key) {
            seen.push(key);
            out.push(format!("{}: {why}", u.option));
        }
    }
    out
}

/// The table as markdown, for docs/llama-server-flags.md.
#[cfg(test)]
fn markdown() -> String {
    let mut s = String::from(
        "# llama-server's options in strata-server\n\nGenerated from `server/src/cli/upstream.rs`, the table that start-up and the tests read \
         (`STRATA_BLESS=1 cargo test -p strata-server docs_upstream` rewrites it). One row per entry of the pinned \
         llama-server's `--help`. *honoured*: strata-server does what llama-server does, and the evidence shows it \
         (a test, or the llama.cpp parameter or default sampling setting the option reaches); *refused*: start-up \
         stops with an error naming the option; *inert*: llama-server does nothing with it either (the pin's line).\n\n\
         | option | class | evidence |\n|---|---|---|\n",
    );
    for u in TABLE {
        let (class, evidence) = match u.class {
            Class::Honoured(e) => ("honoured", format!("`{e}`")),
            Class::Refused { why, .. } => ("refused", why.to_string()),
            Class::Inert { pin, why, .. } => ("inert", format!("{why} (`{pin}`)")),
        };
        s.push_str(&format!("| `{}` | {class} | {evidence} |\n", u.option));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};
    use strata_ffi::{ParseOutcome, ServerParams};

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
    }

    /// The spellings of each option line of a `--help` text.
    fn help_options(help: &str) -> Vec<String> {
        let mut out = Vec::new();
        for line in help.lines().filter(|l| l.starts_with('-') && !l.starts_with("-----")) {
            let mut names: Vec<&str> = Vec::new();
            for t in line.split_whitespace() {
                if !t.starts_with('-') || names.last().is_some_and(|n| !n.ends_with(',')) {
                    break;
                }
                names.push(t);
            }
            out.push(names.iter().map(|n| n.trim_end_matches(',')).collect::<Vec<_>>().join(", "));
        }
        out
    }

    #[test]
    fn the_table_is_upstreams_help_row_for_row() {
        let help = std::fs::read_to_string(repo().join("tests/golden/llama-server/help.stdout")).unwrap();
        let options = help_options(&help);
        let table: Vec<&str> = TABLE.iter().map(|u| u.option).collect();
        for (i, (h, t)) in options.iter().zip(&table).enumerate() {
            assert_eq!(h, t, "row {i}: the help lists {h:?}, the table {t:?}");
        }
        assert_eq!(options.len(), table.len(), "the help has {} options, the table {} rows", options.len(), table.len());
    }

    const PARAMETER_KINDS: &[&str] = &["model", "context", "draft_model", "draft_context", "backend", "sampling"];

    #[test]
    fn every_honoured_row_has_evidence_of_a_known_kind() {
        for u in TABLE {
            let Class::Honoured(e) = u.class else { continue };
            let kind = e.split_once(':').map_or("", |(k, _)| k);
            assert!(kind == "test" || PARAMETER_KINDS.contains(&kind), "{}: evidence {e:?}", u.option);
        }
    }

    #[test]
    fn every_named_test_exists() {
        for u in TABLE {
            let Class::Honoured(e) = u.class else { continue };
            let Some(t) = e.strip_prefix("test:") else { continue };
            let (path, name) = t.split_once("::").unwrap_or_else(|| panic!("{}: {e} is not test:PATH::NAME", u.option));
            let text = std::fs::read_to_string(repo().join(path)).unwrap_or_else(|err| panic!("{}: {path}: {err}", u.option));
            let def = if path.ends_with(".rs") {
                format!("fn {name}(")
            } else if path.ends_with(".py") {
                format!("def {name}(")
            } else {
                format!("\"{name}\"")
            };
            assert!(text.contains(&def), "{}: {path} has no {def}", u.option);
        }
    }

    /// The pin as published, before the patch series.
    fn pristine() -> PathBuf {
        let out = std::process::Command::new("bash").arg(repo().join("vendor/fetch")).arg("--pristine").output().unwrap();
        assert!(out.status.success(), "vendor/fetch --pristine: {}", String::from_utf8_lossy(&out.stderr));
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    }

    #[test]
    fn every_inert_row_names_the_pins_line() {
        let pin_root = pristine();
        for u in TABLE {
            let Class::Inert { pin, text, .. } = u.class else { continue };
            let (path, line) = pin.rsplit_once(':').unwrap();
            let src = std::fs::read_to_string(pin_root.join(path)).unwrap();
            let got = src.lines().nth(line.parse::<usize>().unwrap() - 1).unwrap_or_default();
            assert!(got.contains(text), "{}: {pin} is {got:?}, not {text:?}", u.option);
        }
    }

    fn parse(args: &[&str]) -> ServerParams {
        let argv: Vec<String> = std::iter::once("strata-server").chain(args.iter().copied()).map(String::from).collect();
        match ServerParams::parse(&argv, None).unwrap() {
            ParseOutcome::Parsed(p) => p,
            ParseOutcome::Rejected => panic!("llama.cpp's parser rejected {args:?}"),
        }
    }

    /// Test files the samples name as `{dir}/...`.
    fn sample_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("strata-upstream-table-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("g.gbnf"), "root ::= \"a\"\n").unwrap();
        std::fs::write(dir.join("schema.json"), "{\"type\": \"object\"}").unwrap();
        dir
    }

    fn sample(u: &U, dir: &Path) -> Vec<String> {
        u.sample.iter().map(|a| a.replace("{dir}", &dir.display().to_string())).collect()
    }

    /// The sample without the row's own option (and its value): what the option is compared with.
    fn without_own(u: &U, args: &[String]) -> Vec<String> {
        let own: Vec<&str> = u.option.split(", ").collect();
        let mut out = Vec::new();
        let mut it = args.iter().peekable();
        while let Some(a) = it.next() {
            if own.contains(&a.as_str()) {
                it.next_if(|v| !v.starts_with('-'));
            } else {
                out.push(a.clone());
            }
        }
        out
    }

    /// Each row whose evidence is a field of llama.cpp's parameters or of the default sampling
    /// settings: its sample changes that field against the same arguments without the option.
    #[test]
    fn every_parameter_row_reaches_llama_cpps_parameters() {
        let dir = sample_dir();
        let mut checked = 0;
        for u in TABLE {
            let Class::Honoured(e) = u.class else { continue };
            let Some((kind, field)) = e.split_once(':').filter(|(k, _)| PARAMETER_KINDS.contains(k)) else { continue };
            assert!(!u.sample.is_empty(), "{}: no sample", u.option);
            let args = sample(u, &dir);
            let view = |args: &[String]| {
                let mut p = parse(&args.iter().map(String::as_str).collect::<Vec<_>>());
                p.apply_server_defaults().unwrap();
                if kind == "sampling" {
                    strata_ffi::sampling_settings(Some(&p), &serde_json::json!({}), 0).unwrap()[field].clone()
                } else {
                    p.llama_params_json().unwrap()[kind][field].clone()
                }
            };
            let (got, want) = (view(&args), view(&without_own(u, &args)));
            assert!(!got.is_null(), "{}: {e}: no such field", u.option);
            assert_ne!(got, want, "{}: {args:?} leaves {e} at {want}", u.option);
            checked += 1;
        }
        assert!(checked > 80, "{checked}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refusals_name_the_option_and_only_for_changed_keys() {
        let defaults = ServerParams::defaults_json().unwrap();
        assert!(refusals(&parse(&[]).to_json().unwrap(), &defaults).is_empty());
        assert!(refusals(&parse(&["-dev", "none", "--no-mmproj"]).to_json().unwrap(), &defaults).is_empty());
        let r = refusals(&parse(&["--image-max-tokens", "9"]).to_json().unwrap(), &defaults);
        assert_eq!(r.len(), 1, "{r:?}");
        assert!(r[0].starts_with("--image-max-tokens: strata-server does not serve images"), "{r:?}");
        for u in TABLE {
            if let Class::Refused { key, .. } = u.class {
                assert!(defaults.get(key).is_some(), "{}: the shim's JSON has no {key}", u.option);
            }
        }
    }

    /// strata-server started with each refused row's sample stops before loading, naming it;
    /// every refused key has a row with a sample that starts without the network.
    #[test]
    fn every_refused_option_stops_start_up_naming_it() {
        let exe = std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().join("strata-server");
        let mut shown = Vec::new();
        for u in TABLE {
            let Class::Refused { key, why } = u.class else { continue };
            if u.sample.is_empty() {
                continue;
            }
            let out = std::process::Command::new(&exe).args(["-m", "absent.gguf", "--port", "0"]).args(u.sample).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{}: {stderr}", u.option);
            // -mmdev none is --no-mmproj-offload by value: either name will do
            let named = TABLE.iter().any(|v| {
                matches!(v.class, Class::Refused { key: k, why: w } if k == key || w == why) && stderr.contains(&format!("E srv  llama_server: {}: ", v.option))
            });
            assert!(named, "{}: {stderr}", u.option);
            shown.push(key);
        }
        for u in TABLE {
            if let Class::Refused { key, .. } = u.class {
                assert!(shown.contains(&key), "{}: no row refusing {key} has a sample", u.option);
            }
        }
    }

    #[test]
    fn docs_upstream_flags_md_is_the_table() {
        let path = repo().join("docs/llama-server-flags.md");
        if std::env::var_os("STRATA_BLESS").is_some() {
            std::fs::write(&path, markdown()).unwrap();
        }
        assert_eq!(std::fs::read_to_string(&path).unwrap_or_default(), markdown(), "run with STRATA_BLESS=1 to rewrite {}", path.display());
    }
}
