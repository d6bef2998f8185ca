//! HTTP routes. Handlers never touch llama.cpp: they validate, then ask the engine.

pub mod anthropic;
pub mod app;
pub mod body;
pub mod chat;
pub mod embeddings;
pub mod error;
pub mod gcp;
pub mod infill;
pub mod info;
pub mod listen;
pub mod middleware;
pub mod native;
pub mod oai;
pub mod prompt_log;
pub mod render;
pub mod request;
pub mod responses;
pub mod sse;
pub mod streams;
pub mod tls;
pub mod ui;
pub mod values;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;

use self::app::App;
use self::info::ServerInfo;
use self::middleware::{buffer_body, gate, not_found, server_header, Gate, BODY_LIMIT};
use self::native::{
    completion, detokenize, health, lora_adapters, metrics, models, post_props, props, set_lora_adapters, slot_action, slots, systemone, tokenize,
    transcriptions,
};
use crate::engine::EngineHandle;

#[cfg(test)]
pub fn router(engine: EngineHandle, info: ServerInfo, gcp: Option<&gcp::Gcp>) -> Router {
    router_with(engine, info, gcp, Router::new())
}

/// `extra` holds routes that need no model (tools, CORS proxy); they sit behind the same gate.
pub fn router_with(engine: EngineHandle, info: ServerInfo, gcp: Option<&gcp::Gcp>, extra: Router) -> Router {
    let app = App::new(engine, info);
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
        .route("/infill", post(infill::infill))
        .route("/tokenize", post(tokenize))
        .route("/embedding", post(embeddings::embeddings))
        .route("/embeddings", post(embeddings::embeddings))
        .route("/v1/embeddings", post(embeddings::embeddings_oai))
        .route("/rerank", post(embeddings::rerank))
        .route("/reranking", post(embeddings::rerank))
        .route("/v1/rerank", post(embeddings::rerank))
        .route("/v1/reranking", post(embeddings::rerank))
        .route("/detokenize", post(detokenize))
        .route("/v1/chat/completions/control", post(oai::control))
        .route("/v1/audio/transcriptions", post(transcriptions))
        .route("/audio/transcriptions", post(transcriptions))
        .route("/v1/systemone", post(systemone))
        .with_state(app.clone())
        .merge(streams::routes())
        .merge(extra);
    // --api-prefix puts every route under one path, as llama-server does.
    let prefix = app.info.api_prefix.clone();
    let routes = if prefix.is_empty() { routes } else { Router::new().nest(&prefix, routes) };
    let routes = match gcp {
        Some(g) => gcp::with_routes(routes, g, &prefix),
        None => routes,
    };
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(ui::Ui::new(&app.info), ui::serve))
        .layer(axum::middleware::from_fn_with_state(Gate { info: app.info.clone(), engine: Some(app.engine.clone()) }, gate))
        // the body is read before the gate answers, so that a refused request leaves the connection usable
        .layer(axum::middleware::from_fn(buffer_body))
        .layer(axum::middleware::map_response(server_header))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::body::{params_from_fields, parse_body};
    use crate::api::error::ErrorType;
    use crate::engine::generation::StopType;
    use crate::engine::Job;
    use crate::engine::{Event, Final, State, TaskParams, Timings};
    use axum::body::Body;
    use axum::body::Bytes;
    use axum::http::Request;
    use axum::http::StatusCode;
    use http_body_util::BodyExt;
    use serde_json::{json, Map, Value};
    use tokio::sync::mpsc;
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
            n_parallel: 4,
            dry_base_default: 1.75,
            schema_to_grammar: &schema_to_grammar,
            check_chat_parser: &check_chat_parser,
        };
        let params = |body: Value| request::eval(body.as_object().unwrap(), &ctx).map(|f| params_from_fields(&f, &Map::new(), None, TaskParams::default()));
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

        // the server's -r and --no-cache-prompt are the defaults a request may override
        let info = ServerInfo { antiprompt: vec!["User:".into()], cache_prompt: false, n_keep: 5, ..Default::default() };
        let with_server = |body: Value| params_from_fields(&request::eval(body.as_object().unwrap(), &ctx).unwrap(), &Map::new(), None, info.task_defaults());
        let p = with_server(json!({}));
        assert_eq!((p.stop, p.cache_prompt, p.n_keep), (vec!["User:".to_string()], false, 5));
        assert_eq!(with_server(json!({"stop": [null, []]})).stop, ["User:"], "no effective stop string of its own");
        assert_eq!(with_server(json!({"stop": ["END"], "cache_prompt": true})).stop, ["END"]);
        assert!(with_server(json!({"cache_prompt": true})).cache_prompt);
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
