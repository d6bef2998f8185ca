//! A task's settings as llama-server's task_params::to_json writes them, for answers, /props and
//! /slots.

use serde_json::{json, Map, Value};

use super::task::TaskParams;

/// A float for the shim, which reads it back as a C float: JSON has no infinity, but 1e39 becomes
/// one again there.
pub fn f32_value(x: f32) -> Value {
    if x.is_infinite() {
        json!(x.signum() as f64 * 1e39)
    } else {
        json!(x)
    }
}

/// The settings only the full form of task_params::to_json has (not /props or /slots).
pub const FULL_ONLY: &[&str] = &["dry_sequence_breakers", "stop", "logit_bias", "grammar", "grammar_lazy", "grammar_triggers", "preserved_tokens"];

/// llama-server's task_params::to_json: `sampling` (from strata_ffi::sampling_settings) and
/// the task's own fields, in upstream's order; `metrics` is the shorter form of /props and
/// /slots. `n_predict` is the effective limit (the server's -n where the task gives none).
pub fn task_settings(sampling: &Value, p: &TaskParams, n_predict: i64, metrics: bool) -> Value {
    const SAMPLING_HEAD: &[&str] = &[
        "seed",
        "temperature",
        "dynatemp_range",
        "dynatemp_exponent",
        "top_k",
        "top_p",
        "min_p",
        "top_n_sigma",
        "xtc_probability",
        "xtc_threshold",
        "typical_p",
        "repeat_last_n",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "adaptive_target",
        "adaptive_decay",
    ];
    let s = |k: &str| sampling.get(k).cloned().unwrap_or(Value::Null);
    let reasoning_in_content = p.stream && p.reasoning_format == "deepseek-legacy";
    let lora: Vec<Value> = p.lora.iter().flatten().map(|(id, scale)| json!({"id": id, "scale": f32_value(*scale)})).collect();
    let mut out = Map::new();
    for &k in SAMPLING_HEAD {
        out.insert(k.into(), s(k));
    }
    for (k, v) in [
        ("stop", json!(p.stop)),
        ("max_tokens", json!(n_predict)),
        ("n_predict", json!(n_predict)),
        ("n_keep", json!(p.n_keep)),
        ("n_discard", json!(p.n_discard)),
        ("ignore_eos", s("ignore_eos")),
        ("stream", json!(p.stream)),
        ("logit_bias", s("logit_bias")),
        ("n_probs", s("n_probs")),
        ("min_keep", s("min_keep")),
        ("grammar", s("grammar")),
        ("grammar_lazy", s("grammar_lazy")),
        ("grammar_triggers", s("grammar_triggers")),
        ("preserved_tokens", s("preserved_tokens")),
        ("chat_format", s("chat_format")),
        ("reasoning_format", json!(p.reasoning_format)),
        ("reasoning_in_content", json!(reasoning_in_content)),
        ("generation_prompt", json!(p.sampling.get("generation_prompt").and_then(Value::as_str).unwrap_or(""))),
        ("samplers", s("samplers")),
        ("speculative.types", s("speculative.types")),
        ("timings_per_token", json!(p.timings_per_token)),
        ("post_sampling_probs", json!(p.post_sampling_probs)),
        ("backend_sampling", s("backend_sampling")),
        ("lora", Value::Array(lora)),
    ] {
        out.insert(k.into(), v);
    }
    if metrics {
        out.retain(|k, _| !FULL_ONLY.contains(&k.as_str()));
    }
    Value::Object(out)
}
