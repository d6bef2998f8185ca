//! HTTP routes. Handlers never touch llama.cpp: they validate, then ask the engine.

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};

use std::sync::Arc;

use strata_ffi::{Model, Token, Vocab};

use crate::engine::{CompletionRequest, EngineHandle, Prompt, State, StopType};
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
    "grammar",
];

pub fn router(engine: EngineHandle) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/completion", post(completion))
        .route("/completions", post(completion))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .layer(axum::middleware::map_response(server_header))
        .with_state(engine)
}

async fn server_header(mut res: Response) -> Response {
    res.headers_mut().insert("server", HeaderValue::from_static("llama.cpp"));
    res
}

async fn not_found() -> ApiError {
    ApiError::new(ErrorType::NotFound, "File Not Found")
}

async fn health(AxState(engine): AxState<EngineHandle>) -> Response {
    match engine.state() {
        State::Ready => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        State::Loading => ApiError::new(ErrorType::Unavailable, "Loading model").into_response(),
        State::Failed(msg) => ApiError::server(format!("failed to load model: {msg}")).into_response(),
    }
}

fn parse_body(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::invalid("request body must be a JSON object")),
        Err(e) => Err(ApiError::invalid(format!("invalid JSON in request body: {e}"))),
    }
}

fn parse_prompt(v: Option<&Value>) -> Result<Prompt, ApiError> {
    match v {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) if items.iter().all(Value::is_i64) => {
            Ok(Prompt::Tokens(items.iter().map(|t| t.as_i64().unwrap() as i32).collect()))
        }
        Some(_) => Err(ApiError::invalid("\"prompt\" must be a string or an array of token ids")),
        None => Err(ApiError::invalid("\"prompt\" is required")),
    }
}

pub fn completion_request(body: &Map<String, Value>) -> Result<CompletionRequest, ApiError> {
    let prompt = parse_prompt(body.get("prompt"))?;
    let n_predict = match body.get("n_predict").or_else(|| body.get("max_tokens")) {
        None | Some(Value::Null) => -1,
        Some(v) => v.as_i64().ok_or_else(|| ApiError::invalid("\"n_predict\" must be an integer"))? as i32,
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
    Ok(CompletionRequest { prompt, n_predict, sampling: Value::Object(sampling) })
}

async fn completion(AxState(engine): AxState<EngineHandle>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let req = completion_request(&parse_body(&body)?)?;
    if engine.state() != State::Ready {
        return Err(ApiError::new(ErrorType::Unavailable, "Loading model"));
    }
    let r = engine.complete(req).await?;
    let per_second = |n: usize, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    let per_token = |n: usize, ms: f64| if n > 0 { ms / n as f64 } else { 0.0 };
    Ok(Json(json!({
        "index": 0,
        "content": r.content,
        "tokens": r.tokens,
        "id_slot": 0,
        "stop": true,
        "model": r.model_alias,
        "tokens_predicted": r.tokens.len(),
        "tokens_evaluated": r.n_prompt,
        "truncated": false,
        "stop_type": match r.stop { StopType::Eos => "eos", StopType::Limit => "limit" },
        "stopping_word": "",
        "tokens_cached": r.n_prompt + r.tokens.len(),
        "timings": {
            "cache_n": 0,
            "prompt_n": r.n_prompt,
            "prompt_ms": r.prompt_ms,
            "prompt_per_token_ms": per_token(r.n_prompt, r.prompt_ms),
            "prompt_per_second": per_second(r.n_prompt, r.prompt_ms),
            "predicted_n": r.tokens.len(),
            "predicted_ms": r.predicted_ms,
            "predicted_per_token_ms": per_token(r.tokens.len(), r.predicted_ms),
            "predicted_per_second": per_second(r.tokens.len(), r.predicted_ms),
        },
    })))
}

fn loaded_model(engine: &EngineHandle) -> Result<Arc<Model>, ApiError> {
    engine.model().ok_or_else(|| ApiError::new(ErrorType::Unavailable, "Loading model"))
}

fn flag(body: &Map<String, Value>, key: &str, default: bool) -> bool {
    body.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// A prompt given as a string, or an array mixing strings and token ids; only a leading string
/// gets the special (BOS) tokens, as in llama-server's tokenize_mixed.
fn tokenize_mixed(vocab: Vocab<'_>, prompt: &Value, add_special: bool, parse_special: bool) -> Result<Vec<Token>, ApiError> {
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

async fn tokenize(AxState(engine): AxState<EngineHandle>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
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

async fn detokenize(AxState(engine): AxState<EngineHandle>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
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
    use crate::engine::{CompletionResult, Job};
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tokio::sync::{mpsc, watch};
    use tower::ServiceExt;

    /// A scripted engine: answers every completion with "hi" after the given state.
    fn engine(state: State) -> EngineHandle {
        let (tx, mut rx) = mpsc::channel::<Job>(4);
        let (_state_tx, state_rx) = watch::channel(state);
        tokio::spawn(async move {
            let _keep = _state_tx;
            while let Some(Job::Completion(req, reply)) = rx.recv().await {
                let n = match req.prompt { Prompt::Text(t) => t.len(), Prompt::Tokens(t) => t.len() };
                let _ = reply.send(Ok(CompletionResult {
                    content: "hi".into(),
                    tokens: vec![1, 2],
                    n_prompt: n,
                    stop: StopType::Limit,
                    prompt_ms: 1.0,
                    predicted_ms: 2.0,
                    model_alias: "m".into(),
                }));
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
        let (s, v, server) = call(router(engine(State::Loading)), "GET", "/health", "").await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(v, json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}));
        assert_eq!(server.as_deref(), Some("llama.cpp"));
        let (s, v, _) = call(router(engine(State::Ready)), "GET", "/health", "").await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v, json!({"status": "ok"}));
    }

    #[tokio::test]
    async fn completion_answers_with_content_and_timings() {
        let (s, v, _) = call(router(engine(State::Ready)), "POST", "/completion", r#"{"prompt":"abc","n_predict":2}"#).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["content"], "hi");
        assert_eq!(v["tokens_predicted"], 2);
        assert_eq!(v["tokens_evaluated"], 3);
        assert_eq!(v["timings"]["predicted_n"], 2);
    }

    #[tokio::test]
    async fn bad_input_gets_llama_cpp_error_shape() {
        for body in ["{not json", "[1,2]", r#"{"prompt": 5}"#, r#"{"n_predict": 3}"#, r#"{"prompt":"x","n_predict":"many"}"#] {
            let (s, v, _) = call(router(engine(State::Ready)), "POST", "/completion", body).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
            assert_eq!(v["error"]["code"], 400);
        }
    }

    #[tokio::test]
    async fn unknown_route_is_404_in_llama_cpp_shape() {
        let (s, v, _) = call(router(engine(State::Ready)), "GET", "/nope", "").await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert_eq!(v["error"]["type"], "not_found_error");
    }

    #[test]
    fn sampling_fields_are_renamed_for_common() {
        let body = json!({"prompt": "x", "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.1});
        let req = completion_request(body.as_object().unwrap()).unwrap();
        assert_eq!(req.sampling, json!({"top_k": 1, "temp": 0.0, "penalty_repeat": 1.1}));
    }
}
