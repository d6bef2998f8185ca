//! A request body as llama-server reads it: JSON parsing, the task parameters of a completion,
//! and prompts given as text, tokens or a mix.

use super::app::App;
use super::request;
use crate::api::error::ApiError;
use crate::api::values;
use crate::engine::TaskParams;
use axum::body::Bytes;
use serde_json::{Map, Value};
use strata_ffi::{Model, Token, Vocab};

/// Request fields that map onto common_params_sampling fields under another name.
pub const SAMPLING_RENAMES: &[(&str, &str)] = &[
    ("temperature", "temp"),
    ("typical_p", "typ_p"),
    ("repeat_last_n", "penalty_last_n"),
    ("repeat_penalty", "penalty_repeat"),
    ("frequency_penalty", "penalty_freq"),
    ("presence_penalty", "penalty_present"),
];

/// The schema's normalized fields that go to the sampler under their own names.
pub const SAMPLING_FIELDS: &[&str] = &[
    "seed",
    "n_probs",
    "min_keep",
    "top_k",
    "top_p",
    "min_p",
    "xtc_probability",
    "xtc_threshold",
    "dynatemp_range",
    "dynatemp_exponent",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "adaptive_target",
    "adaptive_decay",
    "top_n_sigma",
    "ignore_eos",
    "grammar",
    "grammar_type",
    "grammar_lazy",
    "grammar_triggers",
    "preserved_tokens",
    "logit_bias",
    "generation_prompt",
    "backend_sampling",
    "dry_sequence_breakers",
    "samplers",
    "reasoning_budget_tokens",
    "reasoning_budget_start",
    "reasoning_budget_end",
    "reasoning_budget_forced",
    "reasoning_control",
];

/// A request body as llama-server reads it: any JSON value. Lookups in a non-object find
/// nothing (the JSON library's `contains`), and [`Body::at`] fails with the library's message.
pub struct Body {
    map: Map<String, Value>,
    /// The JSON library's name for the top-level value's type.
    kind: &'static str,
}

impl std::ops::Deref for Body {
    type Target = Map<String, Value>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl std::ops::DerefMut for Body {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.map
    }
}

impl Body {
    /// `body.at(key)`: the value, or llama.cpp's JSON error for a missing key or a body that
    /// is no object.
    pub fn at(&self, key: &str) -> Result<&Value, ApiError> {
        if self.kind != "object" {
            return Err(ApiError::invalid(format!("[json.exception.type_error.304] cannot use at() with {}", self.kind)));
        }
        self.map.get(key).ok_or_else(|| ApiError::invalid(format!("[json.exception.out_of_range.403] key '{key}' not found")))
    }

    pub fn into_map(self) -> Map<String, Value> {
        self.map
    }
}

/// Parses JSON as llama-server does: a leading UTF-8 byte order mark is skipped, and text its
/// parser refuses gets that parser's message (a 400 there).
pub fn parse_json(bytes: &[u8]) -> Result<Value, String> {
    let data = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    serde_json::from_slice::<Value>(data).map_err(|e| strata_ffi::json_parse_error(bytes).unwrap_or_else(|| e.to_string()))
}

/// A request body, parsed as [`parse_json`] does.
pub fn parse_body(bytes: &Bytes) -> Result<Body, ApiError> {
    let parsed = parse_json(bytes).map_err(|e| {
        let e = ApiError::invalid(e);
        // llama-server's handlers throw here, and its wrapper logs what it answers
        crate::log::srv(strata_ffi::Verbosity::Warn, "operator()", &format!("got exception: {}", e.body()));
        e
    })?;
    match parsed {
        Value::Object(map) => Ok(Body { map, kind: "object" }),
        other => Ok(Body { map: Map::new(), kind: values::type_name(&other) }),
    }
}

/// The chat template's message delimiters (`[{role, delimiter}]`, which the chat endpoints add and
/// any completion request may carry), tokenized: (starts a user message, tokens).
pub fn message_delimiters(list: Option<&Value>, vocab: Vocab<'_>) -> Vec<(bool, Vec<Token>)> {
    let Some(Value::Array(list)) = list else { return Vec::new() };
    list.iter()
        .filter_map(|d| {
            let text = d.get("delimiter")?.as_str()?;
            let tokens = vocab.tokenize(text, false, true).ok().filter(|t| !t.is_empty())?;
            Some((d.get("role").and_then(Value::as_str) == Some("user"), tokens))
        })
        .collect()
}

/// The request's fields for one task, evaluated by llama-server's schema (crate::api::request): a
/// wrong type or a value past a hard limit is a 400 naming the field, as upstream answers.
pub fn task_params(app: &App, model: &Model, body: &Map<String, Value>) -> Result<TaskParams, ApiError> {
    let schema_to_grammar = |s: &Value| strata_ffi::json_schema_to_grammar(s).map_err(|e| e.to_string());
    let check_chat_parser = |p: &str| strata_ffi::check_chat_parser(p).map_err(|e| e.to_string());
    let ctx = request::Context {
        vocab: Some(model.vocab()),
        n_parallel: app.info.n_parallel as i32,
        dry_base_default: app.info.sampling.get("dry_base").and_then(Value::as_f64).unwrap_or(1.75) as f32,
        schema_to_grammar: &schema_to_grammar,
        check_chat_parser: &check_chat_parser,
    };
    let fields = request::eval(body, &ctx)?;
    let mut params = params_from_fields(&fields, body, Some(model.vocab()), app.info.task_defaults());
    if params.reasoning_format.is_empty() {
        params.reasoning_format = app.info.reasoning_format.clone();
    }
    // copies of a prompt offset the seed, the server's own when the request gives none
    if params.n_cmpl > 1 && params.sampling.get("seed").is_none() {
        params.sampling["seed"] = app.info.sampling.get("seed").cloned().unwrap_or(Value::Null);
    }
    Ok(params)
}

/// TaskParams from the schema's normalized `fields`; an absent field keeps its value in `d`, the
/// server's defaults (ServerInfo::task_defaults). `body` holds what the schema does not cover
/// (id_slot, the chat template's message_delimiters).
pub fn params_from_fields(fields: &Map<String, Value>, body: &Map<String, Value>, vocab: Option<Vocab<'_>>, d: TaskParams) -> TaskParams {
    let int = |k: &str, default: i64| fields.get(k).and_then(Value::as_i64).unwrap_or(default);
    let flag = |k: &str, default: bool| fields.get(k).and_then(Value::as_bool).unwrap_or(default);
    let mut sampling = Map::new();
    for &f in SAMPLING_FIELDS {
        if let Some(v) = fields.get(f) {
            sampling.insert(f.to_string(), v.clone());
        }
    }
    for &(from, to) in SAMPLING_RENAMES {
        if let Some(v) = fields.get(from) {
            sampling.insert(to.to_string(), v.clone());
        }
    }
    let lora = fields
        .get("lora")
        .and_then(Value::as_array)
        .map(|entries| entries.iter().map(|e| (e["id"].as_i64().unwrap_or(-1), e["scale"].as_f64().unwrap_or(0.0) as f32)).collect());
    let stop = fields.get("stop").and_then(Value::as_array).map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect());
    TaskParams {
        message_delimiters: vocab.map(|v| message_delimiters(body.get("message_delimiters"), v)).unwrap_or_default(),
        lora,
        n_predict: int("n_predict", d.n_predict.into()) as i32,
        // no stop strings of its own (none, or only empty ones): the server's -r
        stop: stop.unwrap_or_else(|| d.stop.clone()),
        stream: flag("stream", d.stream),
        cache_prompt: flag("cache_prompt", d.cache_prompt),
        id_slot: values::lenient(body, "id_slot", values::get_i32, d.id_slot),
        n_cmpl: int("n_cmpl", d.n_cmpl as i64).max(1) as usize,
        chat_format: int("chat_format", d.chat_format.into()) as i32,
        reasoning_format: fields.get("reasoning_format").and_then(Value::as_str).unwrap_or_default().to_string(),
        return_tokens: flag("return_tokens", d.return_tokens),
        ignore_eos: flag("ignore_eos", d.ignore_eos),
        t_max_predict_ms: int("t_max_predict_ms", d.t_max_predict_ms),
        n_keep: int("n_keep", d.n_keep.into()) as i32,
        n_discard: int("n_discard", d.n_discard.into()) as i32,
        n_cache_reuse: int("n_cache_reuse", d.n_cache_reuse.into()) as i32,
        n_probs: int("n_probs", d.n_probs as i64).max(0) as usize,
        post_sampling_probs: flag("post_sampling_probs", d.post_sampling_probs),
        timings_per_token: flag("timings_per_token", d.timings_per_token),
        return_progress: flag("return_progress", d.return_progress),
        sampling: Value::Object(sampling),
        ..d
    }
}

/// Every prompt of a request: a string, tokens, mixed strings and tokens, a
/// `{"prompt_string": ...}` object, or an array of those (llama-server's tokenize_input_prompts).
/// Every refusal is a 400, as in llama-server's completion handler.
pub fn tokenize_prompts(vocab: Vocab<'_>, prompt: &Value) -> Result<Vec<Vec<Token>>, ApiError> {
    let prompts = match prompt {
        Value::Array(items) if !items.iter().any(is_integer) => items.iter().map(|p| subprompt(vocab, p)).collect::<Result<Vec<_>, _>>()?,
        _ => vec![subprompt(vocab, prompt)?],
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("\"prompt\" must not be empty"));
    }
    Ok(prompts)
}

/// The JSON library's is_number_integer: an integer, not a float.
pub fn is_integer(v: &Value) -> bool {
    v.is_i64() || v.is_u64()
}

/// One prompt (llama-server's tokenize_input_subprompt).
pub fn subprompt(vocab: Vocab<'_>, p: &Value) -> Result<Vec<Token>, ApiError> {
    let items = p.as_array().map(Vec::as_slice).unwrap_or_default();
    let mixed = items.iter().any(Value::is_string) && items.iter().any(is_integer);
    if p.is_string() || mixed {
        return tokenize_mixed(vocab, p, true, true);
    }
    if p.is_array() && items.iter().all(is_integer) {
        return items.iter().map(|t| values::get_i32(t).map_err(ApiError::invalid)).collect();
    }
    match p.as_object() {
        Some(o) if o.contains_key("prompt_string") => {
            if o.contains_key("multimodal_data") {
                return Err(ApiError::invalid("Multimodal data provided, but model does not support multimodal requests."));
            }
            tokenize_mixed(vocab, &o["prompt_string"], true, true)
        }
        _ => Err(ApiError::invalid(
            "\"prompt\" elements must be a string, a list of tokens, a JSON object containing a prompt string, or a list of mixed strings & tokens.",
        )),
    }
}

/// A prompt given as a string, or an array mixing strings and token ids; only a leading string
/// gets the special (BOS) tokens, as in llama-server's tokenize_mixed. Ids convert as the JSON
/// library converts them (a float truncates); anything else is its type error.
pub fn tokenize_mixed(vocab: Vocab<'_>, prompt: &Value, add_special: bool, parse_special: bool) -> Result<Vec<Token>, ApiError> {
    let text = |s: &str, special: bool| vocab.tokenize(s, special, parse_special).map_err(|e| ApiError::invalid(e.to_string()));
    match prompt {
        Value::Array(items) => {
            let mut out = Vec::new();
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) => out.extend(text(s, add_special && i == 0)?),
                    v => out.push(values::get_i32(v).map_err(ApiError::invalid)?),
                }
            }
            Ok(out)
        }
        v => text(values::get_str(v).map_err(ApiError::invalid)?, add_special),
    }
}

/// llama-server's json_value for a boolean: a missing, null or mistyped field is the default.
pub fn flag(body: &Map<String, Value>, key: &str, default: bool) -> bool {
    values::lenient(body, key, values::get_bool, default)
}

/// A token's text as llama-server's `common_token_to_piece` gives it; an id outside the
/// vocabulary is llama.cpp's exception, a 500 there.
pub fn piece(vocab: Vocab<'_>, t: Token) -> Result<Vec<u8>, ApiError> {
    vocab.try_token_to_piece(t, true).map_err(ApiError::from_llama)
}
