//! HTTP routes. Handlers never touch llama.cpp: they validate, then ask the engine.

use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
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
use crate::{anthropic, oai, request, responses};

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

/// The schema's normalized fields that go to the sampler under their own names.
const SAMPLING_FIELDS: &[&str] = &[
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
        .route("/v1/chat/completions/control", post(oai::control))
        .route("/v1/audio/transcriptions", post(transcriptions))
        .route("/audio/transcriptions", post(transcriptions))
        .route("/v1/systemone", post(systemone))
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
        .method_not_allowed_fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn(buffer_body))
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
    let Value::Array(entries) = parse_json(&body).map_err(ApiError::invalid)? else {
        return Err(ApiError::invalid("Request body must be an array"));
    };
    app.engine.set_lora_scales(&request::parse_lora(&entries));
    Ok(Json(json!({"success": true})))
}

/// A wrong method on a known route is "not found" too, as cpp-httplib routes by method and path.
pub async fn not_found() -> ApiError {
    ApiError::new(ErrorType::NotFound, "File Not Found")
}

/// The largest request body, as llama-server's (cpp-httplib's CPPHTTPLIB_PAYLOAD_MAX_LENGTH).
pub const BODY_LIMIT: usize = 100 * 1024 * 1024;

/// Reads the whole body before routing, as cpp-httplib does: a body over the limit gets 413 and
/// a body that cannot be read (bad chunked framing, a client gone) 400, both without content.
pub async fn buffer_body(req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    match axum::body::to_bytes(body, BODY_LIMIT).await {
        Ok(bytes) => next.run(Request::from_parts(parts, axum::body::Body::from(bytes))).await,
        Err(e) => {
            let too_large = std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            let status = if too_large { StatusCode::PAYLOAD_TOO_LARGE } else { StatusCode::BAD_REQUEST };
            status.into_response()
        }
    }
}

/// Audio input needs a multimodal projector with audio, which strata-server does not load.
async fn transcriptions() -> ApiError {
    ApiError::new(ErrorType::NotSupported, "The current model does not support audio input.")
}

/// strata-server serves no decision models (llama.cpp's SystemOne heads).
async fn systemone() -> ApiError {
    ApiError::new(ErrorType::NotSupported, "This model is not a decision model")
}

/// Loading is answered by the gate, as llama-server's middleware does; a failed load exits.
pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

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
    match parse_json(bytes).map_err(ApiError::invalid)? {
        Value::Object(map) => Ok(Body { map, kind: "object" }),
        other => Ok(Body { map: Map::new(), kind: request::type_name(&other) }),
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

/// The request's fields for one task, evaluated by llama-server's schema (crate::request): a
/// wrong type or a value past a hard limit is a 400 naming the field, as upstream answers.
pub fn task_params(app: &App, model: &Model, body: &Map<String, Value>) -> Result<TaskParams, ApiError> {
    let eog = app.eog(model);
    let schema_to_grammar = |s: &Value| strata_ffi::json_schema_to_grammar(s).map_err(|e| e.to_string());
    let check_chat_parser = |p: &str| strata_ffi::check_chat_parser(p).map_err(|e| e.to_string());
    let ctx = request::Context {
        vocab: Some(model.vocab()),
        eog: &eog,
        n_parallel: app.info.n_parallel as i32,
        dry_base_default: app.info.sampling.get("dry_base").and_then(Value::as_f64).unwrap_or(1.75) as f32,
        schema_to_grammar: &schema_to_grammar,
        check_chat_parser: &check_chat_parser,
    };
    let fields = request::eval(body, &ctx)?;
    let mut params = params_from_fields(&fields, body, Some(model.vocab()), app.info.n_keep);
    if params.reasoning_format.is_empty() {
        params.reasoning_format = app.info.reasoning_format.clone();
    }
    // copies of a prompt offset the seed, the server's own when the request gives none
    if params.n_cmpl > 1 && params.sampling.get("seed").is_none() {
        params.sampling["seed"] = app.info.sampling.get("seed").cloned().unwrap_or(Value::Null);
    }
    Ok(params)
}

/// TaskParams from the schema's normalized `fields`; an absent field keeps the server's default
/// (`n_keep_default` is --keep). `body` holds what the schema does not cover (id_slot, the chat
/// template's message_delimiters).
pub fn params_from_fields(fields: &Map<String, Value>, body: &Map<String, Value>, vocab: Option<Vocab<'_>>, n_keep_default: i64) -> TaskParams {
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
        kind: crate::engine::TaskKind::Completion,
        message_delimiters: vocab.map(|v| message_delimiters(body.get("message_delimiters"), v)).unwrap_or_default(),
        lora,
        n_predict: int("n_predict", -1) as i32,
        stop: stop.unwrap_or_default(),
        stream: flag("stream", false),
        cache_prompt: flag("cache_prompt", true),
        id_slot: request::lenient(body, "id_slot", request::get_i32, -1),
        cmpl_id: String::new(),
        n_cmpl: int("n_cmpl", 1).max(1) as usize,
        chat_format: int("chat_format", 0) as i32,
        settings_in_answer: false,
        reasoning_format: fields.get("reasoning_format").and_then(Value::as_str).unwrap_or_default().to_string(),
        return_tokens: flag("return_tokens", false),
        ignore_eos: flag("ignore_eos", false),
        t_max_predict_ms: int("t_max_predict_ms", -1),
        n_keep: int("n_keep", n_keep_default) as i32,
        n_discard: int("n_discard", 0) as i32,
        n_cache_reuse: int("n_cache_reuse", -1) as i32,
        n_probs: int("n_probs", 0).max(0) as usize,
        post_sampling_probs: flag("post_sampling_probs", false),
        timings_per_token: flag("timings_per_token", false),
        return_progress: flag("return_progress", false),
        sampling: Value::Object(sampling),
    }
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
    let value = |p: f32| {
        if post_sampling {
            p
        } else if p == 0.0 {
            f32::MIN
        } else {
            p.ln()
        }
    };
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
        "generation_settings": *f.settings,
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
    Ok(Response::builder().status(StatusCode::OK).header("content-type", "text/event-stream").body(crate::streams::wrap_body(body)).unwrap())
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
fn is_integer(v: &Value) -> bool {
    v.is_i64() || v.is_u64()
}

/// One prompt (llama-server's tokenize_input_subprompt).
fn subprompt(vocab: Vocab<'_>, p: &Value) -> Result<Vec<Token>, ApiError> {
    let items = p.as_array().map(Vec::as_slice).unwrap_or_default();
    let mixed = items.iter().any(Value::is_string) && items.iter().any(is_integer);
    if p.is_string() || mixed {
        return tokenize_mixed(vocab, p, true, true);
    }
    if p.is_array() && items.iter().all(is_integer) {
        return items.iter().map(|t| request::get_i32(t).map_err(ApiError::invalid)).collect();
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

async fn completion(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let model = loaded_model(&app.engine)?;
    let prompts = tokenize_prompts(model.vocab(), body.at("prompt")?)?;
    run_completion(&app, model, &body, prompts).await
}

/// Runs prompts as llama-server's own (non-OpenAI) completion and answers in its format.
pub async fn run_completion(app: &App, model: Arc<Model>, body: &Map<String, Value>, prompts: Vec<Vec<Token>>) -> Result<Response, ApiError> {
    let mut params = task_params(app, &model, body)?;
    params.settings_in_answer = true;
    let stream = params.stream;
    let n_cmpl = params.n_cmpl;
    let n = prompts.len() * n_cmpl;
    let alias = app.engine.model_alias().to_string();
    let rx = app.engine.submit(prompts.clone(), params.clone())?;
    let post = params.post_sampling_probs;
    let fields: Vec<String> =
        body.get("response_fields").and_then(Value::as_array).map(|a| a.iter().filter_map(|f| f.as_str().map(String::from)).collect()).unwrap_or_default();
    let render = move |ev: &Event| match ev {
        Event::Partial(p) => vec![partial_json(p, post)],
        Event::Final(f) => {
            // The prompt text is only in non-streamed answers, as llama-server does.
            // the engine has checked the prompt's token ids by now
            let prompt = if stream { String::new() } else { model.vocab().detokenize(&prompts[f.index / n_cmpl], false, true).unwrap_or_default() };
            let v = final_json_with_probs(f, &alias, &prompt, post);
            vec![select_fields(v, &fields)]
        }
        Event::Begin | Event::Embedding(_) => Vec::new(),
        Event::Error(e) => vec![e.body()],
    };
    if stream {
        return stream_response(rx, n, render, Sse::Plain).await;
    }
    collect(rx, n, render).await
}

/// Waits for every task's final event and returns their rendered JSON, in prompt order.
pub async fn collect_values(mut rx: mpsc::UnboundedReceiver<Event>, n: usize, mut render: impl FnMut(&Event) -> Vec<Value>) -> Result<Vec<Value>, ApiError> {
    let mut results: Vec<Option<Value>> = vec![None; n];
    while results.iter().any(Option::is_none) {
        match rx.recv().await.ok_or_else(|| ApiError::server("engine dropped the request"))? {
            Event::Begin | Event::Partial(_) => {}
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
    let piece = |t| if t == -1 { String::new() } else { String::from_utf8_lossy(&vocab.token_to_piece(t, true)).into_owned() };
    let tmpls = oai::chat_templates(&app, &model)?;
    let m = info::ModelProps {
        ftype: model.ftype_name(),
        chat_template: tmpls.source("").map_err(ApiError::from_llama)?,
        chat_template_tool_use: tmpls.source("tool_use").map_err(ApiError::from_llama)?,
        chat_template_caps: tmpls.caps().map_err(ApiError::from_llama)?,
        bos: piece(vocab.bos()),
        eos: piece(vocab.eos()),
    };
    let sleeping = app.engine.is_sleeping();
    Ok(Json(info::props(&app.info, app.engine.n_ctx_slot(), &m, app.engine.default_settings(), sleeping)))
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
    let id = request::stoi(&id_slot).ok_or_else(|| ApiError::invalid("Invalid slot ID"))?;
    let action = q.get("action").map(String::as_str).unwrap_or("");
    let file = || -> Result<(String, std::path::PathBuf), ApiError> {
        let body = parse_body(&body)?;
        let name = request::get_str(body.at("filename")?).map_err(ApiError::invalid)?;
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

async fn slots(
    AxState(app): AxState<App>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    if !app.info.endpoint_slots {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support slots endpoint. Start it with `--slots`"));
    }
    let (slots, n_idle) = app.engine.slots().await?;
    if q.get("fail_on_no_slot").is_some_and(|v| !v.is_empty()) && n_idle == 0 {
        return Err(ApiError::new(ErrorType::Unavailable, "no slot available"));
    }
    Ok(Json(Value::Array(slots)))
}

pub fn loaded_model(engine: &EngineHandle) -> Result<Arc<Model>, ApiError> {
    engine.model().ok_or_else(|| ApiError::new(ErrorType::Unavailable, "Loading model"))
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
                    v => out.push(request::get_i32(v).map_err(ApiError::invalid)?),
                }
            }
            Ok(out)
        }
        v => text(request::get_str(v).map_err(ApiError::invalid)?, add_special),
    }
}

/// llama-server's json_value for a boolean: a missing, null or mistyped field is the default.
fn flag(body: &Map<String, Value>, key: &str, default: bool) -> bool {
    request::lenient(body, key, request::get_bool, default)
}

/// A token's text as llama-server's `common_token_to_piece` gives it; an id outside the
/// vocabulary is llama.cpp's exception, a 500 there.
fn piece(vocab: Vocab<'_>, t: Token) -> Result<Vec<u8>, ApiError> {
    vocab.try_token_to_piece(t, true).map_err(ApiError::from_llama)
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
    let mut pieces = Vec::with_capacity(tokens.len());
    for &t in &tokens {
        let piece = match String::from_utf8(piece(vocab, t)?) {
            Ok(s) => Value::from(s),
            Err(e) => Value::from(e.into_bytes()),
        };
        pieces.push(json!({"id": t, "piece": piece}));
    }
    Ok(Json(json!({"tokens": pieces})))
}

async fn detokenize(AxState(App { engine, .. }): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    engine.wake().await;
    let model = loaded_model(&engine)?;
    let tokens: Vec<Token> = match body.get("tokens") {
        None => Vec::new(),
        Some(Value::Array(items)) => items.iter().map(|t| request::get_i32(t).map_err(ApiError::invalid)).collect::<Result<_, _>>()?,
        Some(v) => return Err(ApiError::invalid(request::type_error("array", v))),
    };
    let mut bytes = Vec::new();
    for &t in &tokens {
        bytes.extend(piece(model.vocab(), t)?);
    }
    Ok(Json(json!({"content": String::from_utf8_lossy(&bytes)})))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Job;
    use crate::generation::StopType;
    use axum::body::Body;
    use axum::http::Request;
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
                    settings: Default::default(),
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
        for body in ["{not json", "", "{\"a\": 1} x"] {
            let (s, v, _) = call(router(engine(State::Ready), ServerInfo::default(), None), "POST", "/completion", body).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
            assert_eq!(v["error"]["code"], 400);
            // llama.cpp's own parser's message
            assert!(v["error"]["message"].as_str().unwrap().starts_with("[json.exception.parse_error.101] parse error at line 1"), "{v}");
        }
    }

    #[test]
    fn bodies_that_are_no_object_fail_lookups_as_the_json_library_does() {
        let body = parse_body(&Bytes::from_static(b"[1,2]")).unwrap();
        assert!(body.get("prompt").is_none());
        assert_eq!(body.at("prompt").unwrap_err().message, "[json.exception.type_error.304] cannot use at() with array");
        let body = parse_body(&Bytes::from_static(b"\xEF\xBB\xBF{\"a\": 1}")).unwrap();
        assert_eq!(body.at("a").unwrap(), &json!(1));
        assert_eq!(body.at("b").unwrap_err().message, "[json.exception.out_of_range.403] key 'b' not found");
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
        let schema_to_grammar = |_: &Value| Ok(String::new());
        let check_chat_parser = |_: &str| Ok(());
        let ctx = request::Context {
            vocab: None,
            eog: &[],
            n_parallel: 4,
            dry_base_default: 1.75,
            schema_to_grammar: &schema_to_grammar,
            check_chat_parser: &check_chat_parser,
        };
        let params = |body: Value| request::eval(body.as_object().unwrap(), &ctx).map(|f| params_from_fields(&f, &Map::new(), None, 0));
        let p = params(body).unwrap();
        assert_eq!(p.sampling, json!({"top_k": 1, "temp": 0.0, "penalty_repeat": 1.100000023841858}));
        assert_eq!(p.n_predict, 7);
        assert_eq!(p.stop, ["END"]);
        assert!(p.stream && p.cache_prompt);
        let bad = params(json!({"n_predict": "many"})).unwrap_err();
        assert_eq!(bad.kind, ErrorType::InvalidRequest);
        assert_eq!(bad.message, "Field 'n_predict': [json.exception.type_error.302] type must be number, but is string");
        // llama-server ignores a stop that is neither a string nor an array
        assert!(params(json!({"stop": 3})).unwrap().stop.is_empty());
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
        let info = ServerInfo { cors_origins: "localhost".into(), cors_methods: "GET, POST".into(), cors_headers: "*".into(), ..Default::default() };
        let preflight = |origin: &str| Request::builder().method("OPTIONS").uri("/completions").header("origin", origin).body(Body::empty()).unwrap();
        let (s, h, _) = call_with(router(engine(State::Ready), info.clone(), None), preflight("http://localhost:3000")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h["access-control-allow-origin"], "http://localhost:3000");
        assert_eq!(h["access-control-allow-methods"], "GET, POST");
        let (_, h, _) = call_with(router(engine(State::Ready), info, None), preflight("http://evil.example")).await;
        assert!(h.get("access-control-allow-origin").is_none());
    }
}
