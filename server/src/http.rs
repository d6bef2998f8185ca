//! HTTP routes. Handlers never touch llama.cpp: they validate, then ask the engine.

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};

use std::sync::{Arc, OnceLock};

use strata_ffi::{ChatTemplates, Model, Token, Vocab};

use axum::extract::Request;
use axum::http::header::{HeaderName, CONTENT_TYPE};
use axum::http::Method;
use axum::middleware::Next;
use tokio::sync::mpsc;

use crate::info::{self, origin_is_localhost, ServerInfo};
use crate::{anthropic, oai, responses};

use crate::engine::{EngineHandle, Event, Final, Partial, SlotAction, State, TaskParams, Timings, TokenProbs};
use crate::error::{ApiError, ErrorType};

/// Request fields that map onto common_params_sampling fields under another name.
const SAMPLING_RENAMES: &[(&str, &str)] = &[
    ("temperature", "temp"),
    ("typical_p", "typ_p"),
    ("repeat_last_n", "penalty_last_n"),
    ("repeat_penalty", "penalty_repeat"),
    ("frequency_penalty", "penalty_freq"),
    ("presence_penalty", "penalty_present"),
];

const SAMPLING_FIELDS: &[&str] = &[
    "seed", "n_probs", "min_keep", "top_k", "top_p", "min_p", "xtc_probability", "xtc_threshold",
    "dynatemp_range", "dynatemp_exponent", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "top_n_sigma", "ignore_eos",
    "grammar", "grammar_type", "grammar_lazy", "grammar_triggers", "generation_prompt",
];

#[derive(Clone)]
pub struct App {
    pub engine: EngineHandle,
    pub info: Arc<ServerInfo>,
    /// The model's chat templates, made on first use after loading.
    pub chat: Arc<OnceLock<Result<Arc<ChatTemplates>, String>>>,
    eog: Arc<OnceLock<Vec<Token>>>,
}

impl App {
    /// The model's end-of-generation tokens.
    pub fn eog(&self, model: &Model) -> Vec<Token> {
        let v = model.vocab();
        self.eog.get_or_init(|| (0..v.n_tokens()).filter(|&t| v.is_eog(t)).collect()).clone()
    }
}

#[cfg(test)]
pub fn router(engine: EngineHandle, info: ServerInfo, gcp: Option<&crate::gcp::Gcp>) -> Router {
    router_with(engine, info, gcp, Router::new())
}

/// `extra` holds routes that need no model (tools, CORS proxy); they sit behind the same gate.
pub fn router_with(engine: EngineHandle, info: ServerInfo, gcp: Option<&crate::gcp::Gcp>, extra: Router) -> Router {
    let app = App { engine, info: Arc::new(info), chat: Arc::default(), eog: Arc::default() };
    let routes = Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/models", get(models))
        .route("/v1/models", get(models))
        .route("/props", get(props).post(post_props))
        .route("/slots", get(slots))
        .route("/lora-adapters", get(lora_adapters).post(set_lora_adapters))
        .route("/slots/{id_slot}", post(slot_action))
        .route("/metrics", get(metrics))
        .route("/completion", post(completion))
        .route("/completions", post(completion))
        .route("/v1/completions", post(oai::completions))
        .route("/chat/completions", post(oai::chat_completions))
        .route("/v1/chat/completions", post(oai::chat_completions))
        .route("/apply-template", post(oai::apply_template))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/chat/completions/input_tokens", post(oai::chat_input_tokens))
        .route("/v1/chat/completions/input_tokens", post(oai::chat_input_tokens))
        .route("/responses", post(responses::responses))
        .route("/v1/responses", post(responses::responses))
        .route("/responses/input_tokens", post(responses::input_tokens))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route("/infill", post(crate::infill::infill))
        .route("/tokenize", post(tokenize))
        .route("/embedding", post(crate::embeddings::embeddings))
        .route("/embeddings", post(crate::embeddings::embeddings))
        .route("/v1/embeddings", post(crate::embeddings::embeddings_oai))
        .route("/rerank", post(crate::embeddings::rerank))
        .route("/reranking", post(crate::embeddings::rerank))
        .route("/v1/rerank", post(crate::embeddings::rerank))
        .route("/v1/reranking", post(crate::embeddings::rerank))
        .route("/detokenize", post(detokenize))
        .with_state(app.clone())
        .merge(crate::streams::routes())
        .merge(extra);
    // --api-prefix puts every route under one path, as llama-server does.
    let prefix = app.info.api_prefix.clone();
    let routes = if prefix.is_empty() { routes } else { Router::new().nest(&prefix, routes) };
    let routes = match gcp {
        Some(g) => crate::gcp::with_routes(routes, g, &prefix),
        None => routes,
    };
    routes
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(crate::ui::Ui::new(&app.info), crate::ui::serve))
        .layer(axum::middleware::from_fn_with_state(Gate { info: app.info.clone(), engine: Some(app.engine.clone()) }, gate))
        .layer(axum::middleware::map_response(server_header))
}

/// What the gate middleware checks against; a router (no engine of its own) is always ready.
#[derive(Clone)]
pub struct Gate {
    pub info: Arc<ServerInfo>,
    pub engine: Option<EngineHandle>,
}

const PUBLIC_PATHS: &[&str] = &["/health", "/v1/health"];

/// llama-server matches its public paths literally, so under --api-prefix they need a key too.
fn is_public(path: &str) -> bool {
    PUBLIC_PATHS.contains(&path) || crate::ui::is_frontend_path(path)
}

fn header<'a>(req: &'a Request, name: &str) -> &'a str {
    req.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
}

/// The bodies llama-server's middleware writes itself (fields in its order).
fn middleware_error(status: StatusCode, message: &str, ty: &str) -> Response {
    let body = json!({"error": {"message": message, "type": ty, "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

/// llama-server's pre-routing: CORS (and OPTIONS preflight), 503 while loading, API keys.
pub async fn gate(AxState(g): AxState<Gate>, req: Request, next: Next) -> Response {
    let info = &g.info;
    let origin = header(&req, "origin").to_string();
    let allow_origin = if info.cors_credentials && info.cors_origins == "*" {
        Some(origin.clone())
    } else if info.cors_origins == "localhost" {
        (!origin.is_empty() && origin_is_localhost(&origin)).then(|| origin.clone())
    } else {
        Some(info.cors_origins.clone())
    };
    let mut res = if req.method() == Method::OPTIONS {
        let mut r = ([(CONTENT_TYPE, "text/html")], "").into_response();
        let h = r.headers_mut();
        let creds = if info.cors_credentials { "true" } else { "false" };
        for (k, v) in [
            ("access-control-allow-credentials", creds),
            ("access-control-allow-methods", info.cors_methods.as_str()),
            ("access-control-allow-headers", info.cors_headers.as_str()),
        ] {
            if let Ok(v) = HeaderValue::from_str(v) {
                h.insert(k, v);
            }
        }
        r
    } else if g.engine.as_ref().is_some_and(|e| e.state() != State::Ready) && !crate::ui::is_frontend_path(req.uri().path()) {
        middleware_error(StatusCode::SERVICE_UNAVAILABLE, "Loading model", "unavailable_error")
    } else if !info.api_keys.is_empty() && !is_public(req.uri().path()) && !api_key_ok(&req, &info.api_keys) {
        middleware_error(StatusCode::UNAUTHORIZED, "Invalid API Key", "authentication_error")
    } else {
        let conv = crate::streams::conv_id(req.headers());
        crate::streams::CONV_ID.scope(Some(conv), next.run(req)).await
    };
    if let Some(o) = allow_origin.and_then(|o| HeaderValue::from_str(&o).ok()) {
        res.headers_mut().insert("access-control-allow-origin", o);
    }
    res
}

fn api_key_ok(req: &Request, keys: &[String]) -> bool {
    let mut key = header(req, "authorization");
    if key.is_empty() {
        key = header(req, "x-api-key");
    }
    let key = key.strip_prefix("Bearer ").unwrap_or(key);
    keys.iter().any(|k| k == key)
}

/// Marks an answer whose Content-Type goes out as set: a file, not JSON that Strata wrote.
#[derive(Clone, Copy)]
pub struct Verbatim;

/// What llama-server's HTTP layer does to every answer: its Server header, UTF-8 JSON, unbuffered
/// event streams, and one body for every 404.
pub async fn server_header(mut res: Response) -> Response {
    if res.extensions().get::<Verbatim>().is_some() {
        res.headers_mut().insert("server", HeaderValue::from_static("llama.cpp"));
        return res;
    }
    const NOT_FOUND_BODY: &str = r#"{"error":{"message":"File Not Found","type":"not_found_error","code":404}}"#;
    if res.status() == StatusCode::NOT_FOUND {
        let headers = std::mem::take(res.headers_mut());
        res = (StatusCode::NOT_FOUND, NOT_FOUND_BODY).into_response();
        for (k, v) in headers.iter().filter(|(k, _)| k.as_str().starts_with("access-control-")) {
            res.headers_mut().insert(k.clone(), v.clone());
        }
        res.headers_mut().insert("content-type", HeaderValue::from_static("application/json; charset=utf-8"));
    }
    let h = res.headers_mut();
    h.insert("server", HeaderValue::from_static("llama.cpp"));
    match h.get("content-type").map(HeaderValue::as_bytes) {
        Some(b"application/json") => {
            h.insert("content-type", HeaderValue::from_static("application/json; charset=utf-8"));
        }
        Some(b"text/event-stream") if !h.contains_key("x-accel-buffering") => {
            h.insert("x-accel-buffering", HeaderValue::from_static("no"));
        }
        _ => {}
    }
    res
}

/// `[{"id": N, "scale": S}, ...]` as llama-server's parse_lora_request reads it (id -1 and scale
/// 0 when missing).
fn lora_list(entries: &[Value]) -> Vec<(i64, f32)> {
    entries
        .iter()
        .map(|e| (e.get("id").and_then(Value::as_i64).unwrap_or(-1), e.get("scale").and_then(Value::as_f64).unwrap_or(0.0) as f32))
        .collect()
}

async fn lora_adapters(AxState(app): AxState<App>) -> Json<Value> {
    let list = app.engine.lora_adapters();
    Json(Value::Array(
        list.iter()
            .enumerate()
            .map(|(id, a)| {
                let mut entry = json!({"id": id, "path": a.path, "scale": a.scale, "task_name": a.task_name, "prompt_prefix": a.prompt_prefix});
                if !a.alora_tokens.is_empty() {
                    entry["alora_invocation_string"] = json!(a.alora_string);
                    entry["alora_invocation_tokens"] = json!(a.alora_tokens);
                }
                entry
            })
            .collect(),
    ))
}

/// Sets the scales tasks without their own `lora` field use; unlisted adapters get 0.
async fn set_lora_adapters(AxState(app): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body: Value = serde_json::from_slice(&body).map_err(|e| ApiError::invalid(e.to_string()))?;
    let Value::Array(entries) = body else {
        return Err(ApiError::invalid("Request body must be an array"));
    };
    app.engine.set_lora_scales(&lora_list(&entries));
    Ok(Json(json!({"success": true})))
}

pub async fn not_found() -> ApiError {
    ApiError::new(ErrorType::NotFound, "File Not Found")
}

/// Loading is answered by the gate, as llama-server's middleware does; a failed load exits.
pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub fn parse_body(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::invalid("request body must be a JSON object")),
        Err(e) => Err(ApiError::invalid(format!("invalid JSON in request body: {e}"))),
    }
}

fn int_field(body: &Map<String, Value>, key: &str, default: i64) -> Result<i64, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_i64().ok_or_else(|| ApiError::invalid(format!("\"{key}\" must be an integer"))),
    }
}

fn stop_strings(body: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    match body.get("stop") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(String::from).ok_or_else(|| ApiError::invalid("\"stop\" must be a string or an array of strings")))
            .collect(),
        Some(_) => Err(ApiError::invalid("\"stop\" must be a string or an array of strings")),
    }
}

/// The chat template's message delimiters (`[{role, delimiter}]`, which the chat endpoints add and
/// any completion request may carry), tokenized: (starts a user message, tokens).
fn message_delimiters(list: Option<&Value>, vocab: Vocab<'_>) -> Vec<(bool, Vec<Token>)> {
    let Some(Value::Array(list)) = list else { return Vec::new() };
    list.iter()
        .filter_map(|d| {
            let text = d.get("delimiter")?.as_str()?;
            let tokens = vocab.tokenize(text, false, true).ok().filter(|t| !t.is_empty())?;
            Some((d.get("role").and_then(Value::as_str) == Some("user"), tokens))
        })
        .collect()
}

/// The request's fields for one task. `vocab` resolves logit_bias entries given as text,
/// `eog` (the model's end-of-generation tokens) is banned when ignore_eos is set, as upstream,
/// and `n_keep_default` is the server's --keep.
pub fn task_params(body: &Map<String, Value>, vocab: Option<Vocab<'_>>, eog: &[Token], n_keep_default: i64) -> Result<TaskParams, ApiError> {
    let n_predict = match body.get("n_predict") {
        Some(v) if !v.is_null() => int_field(body, "n_predict", -1)?,
        _ => int_field(body, "max_tokens", -1)?,
    };
    let mut sampling = Map::new();
    for &f in SAMPLING_FIELDS {
        if let Some(v) = body.get(f) {
            sampling.insert(f.to_string(), v.clone());
        }
    }
    for &(from, to) in SAMPLING_RENAMES {
        if let Some(v) = body.get(from) {
            sampling.insert(to.to_string(), v.clone());
        }
    }
    let ignore_eos = flag(body, "ignore_eos", false);
    let mut bias = vocab.map(|v| logit_bias(body.get("logit_bias"), v)).unwrap_or_default();
    if ignore_eos {
        bias.extend(eog.iter().map(|&t| json!([t, false])));
    }
    if !bias.is_empty() {
        sampling.insert("logit_bias".into(), Value::Array(bias));
    }
    Ok(TaskParams {
        kind: crate::engine::TaskKind::Completion,
        message_delimiters: vocab.map(|v| message_delimiters(body.get("message_delimiters"), v)).unwrap_or_default(),
        lora: match body.get("lora") {
            None | Some(Value::Null) => None,
            Some(Value::Array(entries)) => Some(lora_list(entries)),
            Some(_) => {
                return Err(ApiError::invalid("Field 'lora': Error: 'lora' must be an array of objects with 'id' and 'scale' fields"))
            }
        },
        n_predict: n_predict.clamp(-1, i32::MAX as i64) as i32,
        stop: stop_strings(body)?,
        stream: flag(body, "stream", false),
        cache_prompt: flag(body, "cache_prompt", true),
        id_slot: int_field(body, "id_slot", -1)? as i32,
        return_tokens: flag(body, "return_tokens", false),
        ignore_eos,
        t_max_predict_ms: int_field(body, "t_max_predict_ms", -1)?,
        n_keep: int_field(body, "n_keep", n_keep_default)? as i32,
        n_discard: int_field(body, "n_discard", 0)? as i32,
        n_cache_reuse: match body.get("n_cache_reuse") {
            None | Some(Value::Null) => -1,
            Some(_) => match int_field(body, "n_cache_reuse", 0)? {
                v if (0..=i32::MAX as i64).contains(&v) => v as i32,
                v => {
                    let msg = format!("Field 'n_cache_reuse': Value must be between 0 <= value <= {}, but got {v}", i32::MAX);
                    return Err(ApiError::invalid(msg));
                }
            },
        },
        n_probs: match body.get("n_probs") {
            Some(v) if !v.is_null() => int_field(body, "n_probs", 0)?,
            _ => body.get("logprobs").and_then(Value::as_i64).unwrap_or(0),
        }
        .max(0) as usize,
        post_sampling_probs: flag(body, "post_sampling_probs", false),
        timings_per_token: flag(body, "timings_per_token", false),
        return_progress: flag(body, "return_progress", false),
        sampling: Value::Object(sampling),
    })
}

/// llama-server's logit_bias: [[token or text, bias], ...] or {"token or text": bias}; a bias
/// of false bans the token; text means each of its tokens; out-of-range ids are dropped.
fn logit_bias(v: Option<&Value>, vocab: Vocab<'_>) -> Vec<Value> {
    let n_vocab = vocab.n_tokens();
    let bias_of = |b: &Value| match b {
        Value::Number(n) => n.as_f64().map(|f| json!(f)),
        Value::Bool(false) => Some(json!(false)),
        _ => None,
    };
    let mut out = Vec::new();
    let mut add = |key: &Value, b: &Value| {
        let Some(b) = bias_of(b) else { return };
        let tokens = match key {
            Value::Number(n) => n.as_i64().map(|t| vec![t as Token]).unwrap_or_default(),
            Value::String(s) => match s.parse::<Token>() {
                Ok(t) => vec![t],
                Err(_) => vocab.tokenize(s, false, false).unwrap_or_default(),
            },
            _ => Vec::new(),
        };
        for t in tokens.into_iter().filter(|&t| (0..n_vocab).contains(&t)) {
            out.push(json!([t, b.clone()]));
        }
    };
    match v {
        Some(Value::Array(items)) => {
            for el in items {
                if let Some([k, b]) = el.as_array().map(Vec::as_slice) {
                    if k.is_string() || k.is_i64() {
                        add(k, b);
                    }
                }
            }
        }
        Some(Value::Object(m)) => {
            for (k, b) in m {
                add(&Value::String(k.clone()), b);
            }
        }
        _ => {}
    }
    out
}

pub fn timings_json(t: &Timings) -> Value {
    let mut v = json!({
        "cache_n": t.cache_n,
        "prompt_n": t.prompt_n,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": t.prompt_per_token_ms(),
        "prompt_per_second": t.prompt_per_second(),
        "predicted_n": t.predicted_n,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": t.predicted_per_token_ms(),
        "predicted_per_second": t.predicted_per_second(),
    });
    if t.draft_n > 0 {
        v["draft_n"] = json!(t.draft_n);
        v["draft_n_accepted"] = json!(t.draft_n_accepted);
    }
    v
}

/// llama-server's completion_probabilities entries.
pub fn probs_json(probs: &[TokenProbs], post_sampling: bool) -> Value {
    let (p_key, top_key) = if post_sampling { ("prob", "top_probs") } else { ("logprob", "top_logprobs") };
    let value = |p: f32| if post_sampling { p } else if p == 0.0 { f32::MIN } else { p.ln() };
    let text = |b: &[u8]| String::from_utf8_lossy(&b[..crate::generation::complete_utf8_len(b)]).into_owned();
    let entry = |t: Token, b: &[u8], p: f32| {
        let mut m = Map::new();
        m.insert("id".into(), json!(t));
        m.insert("token".into(), json!(text(b)));
        m.insert("bytes".into(), json!(b));
        m.insert(p_key.into(), json!(value(p)));
        m
    };
    Value::Array(
        probs
            .iter()
            .map(|tp| {
                let mut m = entry(tp.token, &tp.piece, tp.prob);
                let top: Vec<Value> = tp.top.iter().map(|(t, b, p)| Value::Object(entry(*t, b, *p))).collect();
                m.insert(top_key.into(), Value::Array(top));
                Value::Object(m)
            })
            .collect(),
    )
}

fn partial_json(p: &Partial, post_sampling: bool) -> Value {
    let mut v = partial_json_base(p);
    if let Some(tp) = &p.probs {
        v["completion_probabilities"] = probs_json(std::slice::from_ref(tp), post_sampling);
    }
    v
}

fn partial_json_base(p: &Partial) -> Value {
    let mut v = json!({
        "index": p.index,
        "content": p.content,
        "tokens": p.tokens,
        "stop": false,
        "id_slot": p.id_slot,
        "tokens_predicted": p.n_decoded,
        "tokens_evaluated": p.n_prompt,
    });
    add_progress(&mut v, p);
    v
}

/// The `timings` (with timings_per_token) and `prompt_progress` (with return_progress) a
/// streamed chunk carries.
pub fn add_progress(v: &mut Value, p: &Partial) {
    if let Some(t) = &p.timings {
        v["timings"] = timings_json(t);
    }
    if let Some(pr) = &p.progress {
        v["prompt_progress"] = json!({
            "total": pr.total, "cache": pr.cache, "processed": pr.processed, "time_ms": pr.time_ms,
        });
    }
}

/// (name in llama-server's generation_settings, name in common_params_sampling)
const SETTINGS: &[(&str, &str)] = &[
    ("seed", "seed"),
    ("temperature", "temp"),
    ("dynatemp_range", "dynatemp_range"),
    ("dynatemp_exponent", "dynatemp_exponent"),
    ("top_k", "top_k"),
    ("top_p", "top_p"),
    ("min_p", "min_p"),
    ("top_n_sigma", "top_n_sigma"),
    ("xtc_probability", "xtc_probability"),
    ("xtc_threshold", "xtc_threshold"),
    ("typical_p", "typ_p"),
    ("repeat_last_n", "penalty_last_n"),
    ("repeat_penalty", "penalty_repeat"),
    ("presence_penalty", "penalty_present"),
    ("frequency_penalty", "penalty_freq"),
    ("dry_multiplier", "dry_multiplier"),
    ("dry_base", "dry_base"),
    ("dry_allowed_length", "dry_allowed_length"),
    ("dry_penalty_last_n", "dry_penalty_last_n"),
    ("mirostat", "mirostat"),
    ("mirostat_tau", "mirostat_tau"),
    ("mirostat_eta", "mirostat_eta"),
    ("adaptive_target", "adaptive_target"),
    ("adaptive_decay", "adaptive_decay"),
];

/// llama-server's generation_settings: the server's sampling defaults with this request's
/// overrides, under the names and in the order llama-server reports them.
pub fn generation_settings(defaults: &Value, p: &TaskParams) -> Value {
    let field = |f: &str| p.sampling.get(f).or_else(|| defaults.get(f)).cloned().unwrap_or(Value::Null);
    let mut out = Map::new();
    for &(name, f) in SETTINGS {
        out.insert(name.into(), field(f));
    }
    let logit_bias: Vec<Value> = p
        .sampling
        .get("logit_bias")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|e| json!({"bias": if e[1] == json!(false) { Value::Null } else { e[1].clone() }, "token": e[0]}))
                .collect()
        })
        .unwrap_or_default();
    for (k, v) in [
        ("stop", json!(p.stop)),
        ("max_tokens", json!(p.n_predict)),
        ("n_predict", json!(p.n_predict)),
        ("n_keep", json!(p.n_keep)),
        ("n_discard", json!(p.n_discard)),
        ("ignore_eos", json!(p.ignore_eos)),
        ("stream", json!(p.stream)),
        ("logit_bias", Value::Array(logit_bias)),
        ("n_probs", json!(p.n_probs)),
        ("min_keep", field("min_keep")),
        ("grammar", field("grammar")),
        ("grammar_lazy", p.sampling.get("grammar_lazy").cloned().unwrap_or(json!(false))),
        ("timings_per_token", json!(p.timings_per_token)),
        ("post_sampling_probs", json!(p.post_sampling_probs)),
    ] {
        out.insert(k.into(), v);
    }
    Value::Object(out)
}

/// Keeps only the named fields ("a/b" reaches into objects), keyed by their paths, as
/// llama-server's response_fields.
fn select_fields(v: Value, fields: &[String]) -> Value {
    if fields.is_empty() {
        return v;
    }
    let mut out = Map::new();
    for f in fields {
        let found = f.split('/').try_fold(&v, |cur, k| cur.get(k));
        if let Some(x) = found {
            out.insert(f.clone(), x.clone());
        }
    }
    Value::Object(out)
}

pub fn final_json(f: &Final, model: &str, prompt: &str) -> Value {
    json!({
        "index": f.index,
        "content": f.content,
        "tokens": f.tokens,
        "id_slot": f.id_slot,
        "stop": true,
        "model": model,
        "tokens_predicted": f.n_decoded,
        "tokens_evaluated": f.n_prompt,
        "generation_settings": Value::Null,
        "prompt": prompt,
        "has_new_line": f.has_new_line,
        "truncated": f.truncated,
        "stop_type": f.stop.as_str(),
        "stopping_word": f.stopping_word,
        "tokens_cached": f.n_prompt + f.n_decoded.saturating_sub(1),
        "timings": timings_json(&f.timings),
    })
}

fn final_json_with_probs(f: &Final, model: &str, prompt: &str, post_sampling: bool) -> Value {
    let mut v = final_json(f, model, prompt);
    if !f.probs.is_empty() {
        v["completion_probabilities"] = probs_json(&f.probs, post_sampling);
    }
    v
}

/// Streams events as llama-server does: the first is awaited (an error there is a plain HTTP
/// error), the rest go out as SSE `data:` lines until every task has finished; an error
/// mid-stream ends it. `done` is the closing line, if the API has one (`data: [DONE]`).
/// How a stream is framed: llama-server's own routes end without a marker, the OpenAI ones
/// with `data: [DONE]`, the Anthropic one with named events (`event:` + `data:`), the
/// Responses one with named events but OpenAI-framed errors and no closing marker.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Sse {
    Plain,
    OpenAi,
    Anthropic,
    Responses,
}

fn sse_write(out: &mut String, style: Sse, v: &Value) {
    match (style, v.get("event").and_then(Value::as_str), v.get("data")) {
        (Sse::Anthropic | Sse::Responses, Some(ev), Some(data)) => out.push_str(&format!("event: {ev}\ndata: {data}\n\n")),
        _ => out.push_str(&format!("data: {v}\n\n")),
    }
}

pub async fn stream_response(
    mut rx: mpsc::UnboundedReceiver<Event>,
    n_tasks: usize,
    mut render: impl FnMut(&Event) -> Vec<Value> + Send + 'static,
    style: Sse,
) -> Result<Response, ApiError> {
    let first = rx.recv().await.ok_or_else(|| ApiError::server("engine dropped the request"))?;
    if let Event::Error(e) = first {
        return Err(e);
    }
    let mut remaining = n_tasks;
    let mut next = Some(first);
    let mut finished = false;
    let body = futures_util::stream::poll_fn(move |cx| {
        if finished {
            return std::task::Poll::Ready(None);
        }
        let ev = match next.take() {
            Some(ev) => ev,
            None => match rx.poll_recv(cx) {
                std::task::Poll::Pending => return std::task::Poll::Pending,
                std::task::Poll::Ready(None) => return std::task::Poll::Ready(None),
                std::task::Poll::Ready(Some(ev)) => ev,
            },
        };
        let mut out = String::new();
        match &ev {
            Event::Error(e) => {
                let err = match style {
                    Sse::Anthropic => json!({"event": "error", "data": e.body()["error"]}),
                    _ => json!({"error": e.body()["error"]}),
                };
                sse_write(&mut out, style, &err);
                finished = true;
            }
            other => {
                for v in render(other) {
                    sse_write(&mut out, style, &v);
                }
                if matches!(other, Event::Final(_)) {
                    remaining -= 1;
                    if remaining == 0 {
                        finished = true;
                        if style == Sse::OpenAi {
                            out.push_str("data: [DONE]\n\n");
                        }
                    }
                }
            }
        }
        std::task::Poll::Ready(Some(Ok::<_, std::convert::Infallible>(Bytes::from(out))))
    });
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/event-stream")
        .body(crate::streams::wrap_body(body))
        .unwrap())
}

/// Every prompt of a request: a string, tokens, mixed strings and tokens, a
/// `{"prompt_string": ...}` object, or an array of those (llama-server's tokenize_input_prompts).
pub fn tokenize_prompts(vocab: Vocab<'_>, prompt: &Value) -> Result<Vec<Vec<Token>>, ApiError> {
    let is_multi = matches!(prompt, Value::Array(items) if !items.iter().any(Value::is_i64));
    let one = |p: &Value| -> Result<Vec<Token>, ApiError> {
        match p {
            Value::String(_) | Value::Array(_) => tokenize_mixed(vocab, p, true, true),
            Value::Object(o) if o.contains_key("prompt_string") => {
                if o.contains_key("multimodal_data") {
                    return Err(ApiError::server("Multimodal data provided, but model does not support multimodal requests."));
                }
                tokenize_mixed(vocab, &o["prompt_string"], true, true)
            }
            _ => Err(ApiError::invalid(
                "\"prompt\" elements must be a string, a list of tokens, a JSON object containing a prompt string, or a list of mixed strings & tokens.",
            )),
        }
    };
    let prompts = if is_multi {
        prompt.as_array().unwrap().iter().map(one).collect::<Result<Vec<_>, _>>()?
    } else {
        vec![one(prompt)?]
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("\"prompt\" must not be empty"));
    }
    Ok(prompts)
}

async fn completion(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let model = loaded_model(&app.engine)?;
    let prompt_value = body.get("prompt").ok_or_else(|| ApiError::invalid("\"prompt\" is required"))?;
    let prompts = tokenize_prompts(model.vocab(), prompt_value)?;
    run_completion(&app, model, &body, prompts).await
}

/// Runs prompts as llama-server's own (non-OpenAI) completion and answers in its format.
pub async fn run_completion(app: &App, model: Arc<Model>, body: &Map<String, Value>, prompts: Vec<Vec<Token>>) -> Result<Response, ApiError> {
    let params = task_params(body, Some(model.vocab()), &app.eog(&model), app.info.n_keep)?;
    let stream = params.stream;
    let n = prompts.len();
    let alias = app.engine.model_alias().to_string();
    let rx = app.engine.submit(prompts.clone(), params.clone())?;
    let post = params.post_sampling_probs;
    let settings = generation_settings(&app.info.sampling, &params);
    let fields: Vec<String> = body
        .get("response_fields")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|f| f.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let render = move |ev: &Event| match ev {
        Event::Partial(p) => vec![partial_json(p, post)],
        Event::Final(f) => {
            // The prompt text is only in non-streamed answers, as llama-server does.
            let prompt = if stream { String::new() } else { model.vocab().detokenize(&prompts[f.index], false, true) };
            let mut v = final_json_with_probs(f, &alias, &prompt, post);
            v["generation_settings"] = settings.clone();
            vec![select_fields(v, &fields)]
        }
        Event::Embedding(_) => Vec::new(),
        Event::Error(e) => vec![e.body()],
    };
    if stream {
        return stream_response(rx, n, render, Sse::Plain).await;
    }
    collect(rx, n, render).await
}

/// Waits for every task's final event and returns their rendered JSON, in prompt order.
pub async fn collect_values(
    mut rx: mpsc::UnboundedReceiver<Event>,
    n: usize,
    mut render: impl FnMut(&Event) -> Vec<Value>,
) -> Result<Vec<Value>, ApiError> {
    let mut results: Vec<Option<Value>> = vec![None; n];
    while results.iter().any(Option::is_none) {
        match rx.recv().await.ok_or_else(|| ApiError::server("engine dropped the request"))? {
            Event::Partial(_) => {}
            Event::Error(e) => return Err(e),
            ev @ Event::Final(_) => {
                let Event::Final(f) = &ev else { unreachable!() };
                results[f.index] = render(&ev).pop();
            }
            ev @ Event::Embedding(_) => {
                let Event::Embedding(e) = &ev else { unreachable!() };
                results[e.index] = render(&ev).pop();
            }
        }
    }
    Ok(results.into_iter().flatten().collect())
}

/// The answer for one prompt, or an array for several, as llama-server gives them.
pub async fn collect(rx: mpsc::UnboundedReceiver<Event>, n: usize, render: impl FnMut(&Event) -> Vec<Value>) -> Result<Response, ApiError> {
    let mut results = collect_values(rx, n, render).await?;
    Ok(Json(if n == 1 { results.remove(0) } else { Value::Array(results) }).into_response())
}

async fn models(AxState(app): AxState<App>) -> Result<Json<Value>, ApiError> {
    let model = loaded_model(&app.engine)?;
    Ok(Json(info::models(&app.info, &model, app.engine.n_ctx_slot())))
}

async fn props(AxState(app): AxState<App>) -> Result<Json<Value>, ApiError> {
    let model = loaded_model(&app.engine)?;
    let vocab = model.vocab();
    let piece = |t| String::from_utf8_lossy(&vocab.token_to_piece(t, true)).into_owned();
    let template = model.meta("tokenizer.chat_template").unwrap_or_default();
    let sleeping = app.engine.is_sleeping();
    Ok(Json(info::props(&app.info, app.engine.n_ctx_slot(), &template, &piece(vocab.bos()), &piece(vocab.eos()), sleeping)))
}

async fn slot_action(
    AxState(app): AxState<App>,
    axum::extract::Path(id_slot): axum::extract::Path<String>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    if app.info.slot_save_path.is_empty() {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support slots action. Start it with `--slot-save-path`"));
    }
    let id: usize = id_slot.parse().map_err(|_| ApiError::invalid("Invalid slot ID"))?;
    let action = q.get("action").map(String::as_str).unwrap_or("");
    let file = || -> Result<(String, std::path::PathBuf), ApiError> {
        let body = parse_body(&body)?;
        let name = body.get("filename").and_then(Value::as_str).ok_or_else(|| ApiError::invalid("\"filename\" is required"))?;
        if !strata_ffi::validate_filename(name) {
            return Err(ApiError::invalid("Invalid filename"));
        }
        Ok((name.to_string(), std::path::PathBuf::from(format!("{}{name}", app.info.slot_save_path))))
    };
    let action = match action {
        "save" => {
            let (filename, path) = file()?;
            SlotAction::Save { id, filename, path }
        }
        "restore" => {
            let (filename, path) = file()?;
            SlotAction::Restore { id, filename, path }
        }
        "erase" => SlotAction::Erase { id },
        _ => return Err(ApiError::invalid("Invalid action")),
    };
    Ok(Json(app.engine.slot_action(action).await?))
}

async fn metrics(AxState(app): AxState<App>) -> Result<Response, ApiError> {
    if !app.info.endpoint_metrics {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support metrics endpoint. Start it with `--metrics`"));
    }
    let metrics = app.engine.metrics();
    let mut m = metrics.lock().map_err(|_| ApiError::server("metrics are unavailable"))?;
    let body = m.scrape() + &crate::experts::metrics_text();
    Ok(([(CONTENT_TYPE, "text/plain; version=0.0.4".to_string()), (HeaderName::from_static("process-start-time-unix"), m.t_start.to_string())], body)
        .into_response())
}

async fn post_props(AxState(app): AxState<App>) -> Result<Json<Value>, ApiError> {
    if !app.info.endpoint_props {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support changing global properties. Start it with `--props`"));
    }
    Ok(Json(json!({"success": true})))
}

async fn slots(AxState(app): AxState<App>) -> Result<Json<Value>, ApiError> {
    if !app.info.endpoint_slots {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support slots endpoint. Start it with `--slots`"));
    }
    let n_ctx = app.engine.n_ctx_slot();
    let slots: Vec<Value> = app
        .engine
        .slots_busy()
        .iter()
        .enumerate()
        .map(|(id, &busy)| json!({"id": id, "n_ctx": n_ctx, "speculative": app.info.speculative, "is_processing": busy}))
        .collect();
    Ok(Json(Value::Array(slots)))
}

pub fn loaded_model(engine: &EngineHandle) -> Result<Arc<Model>, ApiError> {
    engine.model().ok_or_else(|| ApiError::new(ErrorType::Unavailable, "Loading model"))
}

fn flag(body: &Map<String, Value>, key: &str, default: bool) -> bool {
    body.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// A prompt given as a string, or an array mixing strings and token ids; only a leading string
/// gets the special (BOS) tokens, as in llama-server's tokenize_mixed.
pub fn tokenize_mixed(vocab: Vocab<'_>, prompt: &Value, add_special: bool, parse_special: bool) -> Result<Vec<Token>, ApiError> {
    let text = |s: &str, special: bool| vocab.tokenize(s, special, parse_special).map_err(|e| ApiError::invalid(e.to_string()));
    match prompt {
        Value::String(s) => text(s, add_special),
        Value::Array(items) => {
            let mut out = Vec::new();
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) => out.extend(text(s, add_special && i == 0)?),
                    v => out.push(token_id(v)?),
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::invalid("\"content\" must be a string or an array")),
    }
}

fn token_id(v: &Value) -> Result<Token, ApiError> {
    v.as_i64()
        .and_then(|t| Token::try_from(t).ok())
        .ok_or_else(|| ApiError::invalid(format!("invalid token id: {v}")))
}

async fn tokenize(AxState(App { engine, .. }): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    engine.wake().await;
    let model = loaded_model(&engine)?;
    let vocab = model.vocab();
    let Some(content) = body.get("content") else {
        return Ok(Json(json!({"tokens": []})));
    };
    let tokens = tokenize_mixed(vocab, content, flag(&body, "add_special", false), flag(&body, "parse_special", true))?;
    if !flag(&body, "with_pieces", false) {
        return Ok(Json(json!({"tokens": tokens})));
    }
    let pieces: Vec<Value> = tokens
        .iter()
        .map(|&t| {
            let bytes = vocab.token_to_piece(t, true);
            let piece = match String::from_utf8(bytes) {
                Ok(s) => Value::from(s),
                Err(e) => Value::from(e.into_bytes()),
            };
            json!({"id": t, "piece": piece})
        })
        .collect();
    Ok(Json(json!({"tokens": pieces})))
}

async fn detokenize(AxState(App { engine, .. }): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    engine.wake().await;
    let model = loaded_model(&engine)?;
    let tokens: Vec<Token> = match body.get("tokens") {
        None => Vec::new(),
        Some(Value::Array(items)) => items.iter().map(token_id).collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid("\"tokens\" must be an array of token ids")),
    };
    let vocab = model.vocab();
    let n_vocab = vocab.n_tokens();
    if let Some(bad) = tokens.iter().find(|&&t| t < 0 || t >= n_vocab) {
        return Err(ApiError::invalid(format!("token id {bad} is out of range (vocabulary size {n_vocab})")));
    }
    let bytes: Vec<u8> = tokens.iter().flat_map(|&t| vocab.token_to_piece(t, true)).collect();
    Ok(Json(json!({"content": String::from_utf8_lossy(&bytes)})))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Job;
    use crate::generation::StopType;
    use axum::http::Request;
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tokio::sync::watch;
    use tower::ServiceExt;

    /// A scripted engine: answers every task with the text "hi" in two tokens.
    fn engine(state: State) -> EngineHandle {
        let (tx, mut rx) = mpsc::channel::<Job>(4);
        let (state_tx, state_rx) = watch::channel(state);
        tokio::spawn(async move {
            let _keep = state_tx;
            while let Some(job) = rx.recv().await {
                let Job::Task(task) = job else { continue };
                let fin = Final {
                    index: task.index,
                    content: "hi".into(),
                    tokens: vec![1, 2],
                    id_slot: 0,
                    n_decoded: 2,
                    n_prompt: task.prompt.len(),
                    stop: StopType::Limit,
                    stopping_word: String::new(),
                    truncated: false,
                    has_new_line: false,
                    timings: Timings::default(),
                    probs: Vec::new(),
                };
                let _ = task.events.send(Event::Final(Box::new(fin)));
            }
        });
        EngineHandle::from_parts(tx, state_rx)
    }

    async fn call(app: Router, method: &str, uri: &str, body: &str) -> (StatusCode, Value, Option<String>) {
        let req = Request::builder().method(method).uri(uri).body(Body::from(body.to_string())).unwrap();
        let res = app.oneshot(req).await.unwrap();
        let status = res.status();
        let server = res.headers().get("server").map(|v| v.to_str().unwrap().to_string());
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap(), server)
    }

    #[tokio::test]
    async fn health_is_503_while_loading_then_ok() {
        let (s, v, server) = call(router(engine(State::Loading), ServerInfo::default(), None), "GET", "/health", "").await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(v, json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}));
        assert_eq!(server.as_deref(), Some("llama.cpp"));
        let (s, v, _) = call(router(engine(State::Ready), ServerInfo::default(), None), "GET", "/health", "").await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v, json!({"status": "ok"}));
    }

    #[tokio::test]
    async fn completion_before_the_model_is_loaded_is_503() {
        let (s, v, _) = call(router(engine(State::Loading), ServerInfo::default(), None), "POST", "/completion", r#"{"prompt":"abc"}"#).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(v["error"]["message"], "Loading model");
    }

    #[tokio::test]
    async fn malformed_json_gets_the_llama_cpp_error_shape() {
        for body in ["{not json", "[1,2]"] {
            let (s, v, _) = call(router(engine(State::Ready), ServerInfo::default(), None), "POST", "/completion", body).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
            assert_eq!(v["error"]["code"], 400);
        }
    }

    #[tokio::test]
    async fn unknown_route_is_404_in_llama_cpp_shape() {
        let (s, v, _) = call(router(engine(State::Ready), ServerInfo::default(), None), "GET", "/nope", "").await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert_eq!(v["error"]["type"], "not_found_error");
    }

    #[test]
    fn request_fields_become_task_params() {
        let body = json!({"prompt": "x", "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.1, "max_tokens": 7, "stop": "END", "stream": true});
        let p = task_params(body.as_object().unwrap(), None, &[], 0).unwrap();
        assert_eq!(p.sampling, json!({"top_k": 1, "temp": 0.0, "penalty_repeat": 1.1}));
        assert_eq!(p.n_predict, 7);
        assert_eq!(p.stop, ["END"]);
        assert!(p.stream && p.cache_prompt);
        let bad = json!({"n_predict": "many"});
        assert_eq!(task_params(bad.as_object().unwrap(), None, &[], 0).unwrap_err().kind, ErrorType::InvalidRequest);
        let bad = json!({"stop": 3});
        assert!(task_params(bad.as_object().unwrap(), None, &[], 0).is_err());
    }

    async fn call_with(app: Router, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Bytes) {
        let res = app.oneshot(req).await.unwrap();
        let (status, headers) = (res.status(), res.headers().clone());
        (status, headers, res.into_body().collect().await.unwrap().to_bytes())
    }

    #[tokio::test]
    async fn api_keys_guard_everything_but_health() {
        let info = ServerInfo { api_keys: vec!["sk-secret".into()], cors_origins: "*".into(), cors_credentials: true, ..Default::default() };
        let get = |uri: &str, key: Option<(&str, &str)>| {
            let mut b = Request::builder().uri(uri);
            if let Some((h, v)) = key {
                b = b.header(h, v);
            }
            b.body(Body::empty()).unwrap()
        };
        let app = || router(engine(State::Ready), info.clone(), None);
        let (s, _, body) = call_with(app(), get("/models", None)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        assert_eq!(&body[..], br#"{"error":{"message":"Invalid API Key","type":"authentication_error","code":401}}"#);
        let (s, _, _) = call_with(app(), get("/models", Some(("authorization", "Bearer wrong")))).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        let (s, _, _) = call_with(app(), get("/health", None)).await;
        assert_eq!(s, StatusCode::OK);
        let (s, _, _) = call_with(app(), get("/nope", Some(("authorization", "Bearer sk-secret")))).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "a valid key passes the gate");
        let (s, _, _) = call_with(app(), get("/nope", Some(("x-api-key", "sk-secret")))).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "the Anthropic header works too");
    }

    #[tokio::test]
    async fn ui_paths_need_no_key_and_load_while_the_model_does() {
        let info = ServerInfo { api_keys: vec!["sk-secret".into()], ui: true, ..Default::default() };
        let get = |uri: &str| Request::builder().uri(uri).body(Body::empty()).unwrap();
        for state in [State::Loading, State::Ready] {
            let (s, _, _) = call_with(router(engine(state.clone()), info.clone(), None), get("/")).await;
            assert!(s != StatusCode::UNAUTHORIZED && s != StatusCode::SERVICE_UNAVAILABLE, "{s}");
        }
        let (s, _, _) = call_with(router(engine(State::Loading), info.clone(), None), get("/models")).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        let (s, _, _) = call_with(router(engine(State::Ready), info, None), get("/models")).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    }

    #[tokio::test]
    async fn cors_preflight_and_origin_reflection() {
        let info = ServerInfo {
            cors_origins: "localhost".into(),
            cors_methods: "GET, POST".into(),
            cors_headers: "*".into(),
            ..Default::default()
        };
        let preflight = |origin: &str| {
            Request::builder().method("OPTIONS").uri("/completions").header("origin", origin).body(Body::empty()).unwrap()
        };
        let (s, h, _) = call_with(router(engine(State::Ready), info.clone(), None), preflight("http://localhost:3000")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h["access-control-allow-origin"], "http://localhost:3000");
        assert_eq!(h["access-control-allow-methods"], "GET, POST");
        let (_, h, _) = call_with(router(engine(State::Ready), info, None), preflight("http://evil.example")).await;
        assert!(h.get("access-control-allow-origin").is_none());
    }
}

