//! llama-server's router mode. Started without a model, strata-server serves many: each model
//! runs in a child strata-server on a free loopback port, started on demand (or through
//! /models/load), and a request goes to the child its `model` field (or `?model=`) names.
//! The router answers /models, /props and the model management routes itself.

pub mod child;
mod models;
mod proxy;

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use axum::body::{Body, Bytes};
use axum::extract::{OriginalUri, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::api::body::parse_body;
use crate::api::error::{ApiError, ErrorType};
use crate::api::info::ServerInfo;
use crate::api::middleware::{gate, not_found, server_header, Gate};
use crate::api::native::health;
use models::{Models, RouterConfig};

pub use child::{run_download, ChildLink, ChildMode};

/// Routes a router forwards to the instance named by the `model` field of the JSON body.
const PROXY_POST: &[&str] = &[
    "/props",
    "/completion",
    "/completions",
    "/v1/completions",
    "/chat/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/control",
    "/v1/responses",
    "/responses",
    "/v1/audio/transcriptions",
    "/audio/transcriptions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/infill",
    "/embedding",
    "/embeddings",
    "/v1/embeddings",
    "/rerank",
    "/reranking",
    "/v1/rerank",
    "/v1/reranking",
    "/v1/systemone",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/chat/completions/input_tokens",
    "/v1/chat/completions/input_tokens",
    "/responses/input_tokens",
    "/v1/responses/input_tokens",
    "/lora-adapters",
    "/slots/{id_slot}",
];

/// Routes a router forwards to the instance named by the `model` query parameter.
const PROXY_GET: &[&str] = &["/metrics", "/lora-adapters", "/slots"];

/// Strata's own flags (aliases are already llama.cpp flags), for an instance's command line.
pub fn own_flag_args(strata: &crate::cli::flags::StrataArgs) -> Vec<String> {
    let mut out = Vec::new();
    for (name, value) in &strata.given {
        let Some(flag) = crate::cli::flags::FLAGS.iter().find(|f| f.name == *name && f.maps_to.is_none()) else { continue };
        out.push(name.to_string());
        if flag.kind != crate::cli::flags::Kind::Switch {
            out.push(value.clone());
        }
    }
    out
}

/// True when the parsed flags name no model: llama-server then runs as a router.
pub fn is_router(cfg: &Value) -> bool {
    ["model", "hf_repo", "docker_repo"].iter().all(|k| cfg[k].as_str().unwrap_or_default().is_empty())
}

#[derive(Clone)]
struct RouterApp {
    models: Arc<Models>,
    props: Arc<Value>,
    convs: Arc<crate::api::streams::ConvModels>,
}

pub fn serve(cfg: &Value, llama_args: &[String], strata_args: Vec<String>, hosts: Vec<String>, port: i64) -> Result<()> {
    let s = |k: &str| cfg[k].as_str().unwrap_or_default().to_string();
    let ui_settings = match s("ui_config_json").as_str() {
        "" => json!({}),
        text => serde_json::from_str(text).context("failed to parse UI config")?,
    };
    let router_cfg = RouterConfig {
        bin: std::env::current_exe().unwrap_or_else(|_| llama_args[0].clone().into()),
        llama_args: llama_args.to_vec(),
        strata_args,
        models_dir: s("models_dir"),
        models_preset: s("models_preset"),
        models_max: cfg["models_max"].as_i64().unwrap_or(4),
        models_autoload: cfg["models_autoload"].as_bool().unwrap_or(true),
        port: port as u16,
        hf_token: s("hf_token"),
        fake_timing: crate::cli::env::upstream_set(crate::cli::env::Upstream::FakeTiming),
    };
    let props = json!({
        "role": "router",
        "max_instances": router_cfg.models_max,
        "models_autoload": router_cfg.models_autoload,
        "model_alias": "llama-server",
        "model_path": "none",
        "default_generation_settings": {"params": null, "n_ctx": 0},
        "ui_settings": ui_settings,
        "build_info": crate::api::info::build_info(),
        "cors_proxy_enabled": cfg["ui_mcp_proxy"].as_bool().unwrap_or(false),
    });
    // llama-server's order: the HTTP server's set-up, the models, the security warnings, the bind
    let info = ServerInfo::from_params(cfg, String::new(), 0);
    crate::api::listen::check_hosts(&hosts, port)?;
    for _ in &hosts {
        crate::api::listen::log_tls(cfg);
        crate::api::ui::check(&info)?;
    }
    let http = crate::api::listen::Http::from_params(cfg, cfg["n_parallel"].as_i64().unwrap_or(-1));
    let rt = http.runtime()?;
    let tools = crate::agent::tools::Tools::from_params(cfg).context("tools setup failed")?;
    rt.block_on(async move {
        let models = Models::new(router_cfg).await.context("failed to initialize router models")?;
        let warn = |msg: &str| crate::log::srv(strata_ffi::Verbosity::Warn, "llama_server", msg);
        if info.cors_origins == "*" && info.api_keys.is_empty() {
            warn("security: no API key is set and CORS allows all origins (see https://github.com/ggml-org/llama.cpp/pull/25655)");
        }
        warn("security: router mode enabled - do not expose to untrusted environments");
        let agent = crate::agent::Agent::start(cfg, tools).await.context("MCP starting failed")?;
        let http = match http.with_tls(cfg) {
            Ok(h) => h,
            Err(e) => return Err(crate::api::listen::failed(Some(&e.to_string()), &hosts[0], port)),
        };
        crate::log::srv(strata_ffi::Verbosity::Info, "llama_server", "starting server in router mode. models will be automatically loaded on-demand");
        let listeners = match crate::api::listen::bind_all(&hosts, port, &http).await {
            Ok(l) => l,
            Err(e) => return Err(crate::api::listen::failed(Some(&format!("{:#}", e.error)), &e.host, port)),
        };
        let app = routes(RouterApp { models: models.clone(), props: Arc::new(props), convs: Arc::default() }, info, agent.routes);
        for l in listeners {
            crate::log::srv(strata_ffi::Verbosity::Info, "llama_server", &format!("listening on {}", l.describe(http.tls.is_some())?));
            tokio::spawn(crate::api::listen::accept_loop(l, app.clone(), http.clone()));
        }
        tokio::spawn({
            let models = models.clone();
            async move { models.load_startup_models().await }
        });
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        crate::log::cleaning_up();
        models.unload_all().await;
        agent.mcp.close_all().await;
        Ok(())
    })
}

/// `extra`: the routes that need no model (tools, CORS proxy), served by the router itself.
fn routes(app: RouterApp, info: ServerInfo, extra: Router) -> Router {
    let mut r = Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/props", get(get_props))
        .route("/models", get(list_models).post(download_model).delete(remove_model))
        .route("/v1/models", get(list_models))
        .route("/models/load", post(load_model))
        .route("/models/unload", post(unload_model))
        .route("/models/sse", get(models_sse))
        .route("/v1/stream", get(stream_get).delete(stream_delete))
        .route("/v1/streams/lookup", post(streams_lookup));
    for path in PROXY_POST {
        r = r.route(path, post(proxy_post));
    }
    for path in PROXY_GET {
        r = r.route(path, get(proxy_get));
    }
    let r = r.with_state(app).merge(extra);
    let prefix = info.api_prefix.clone();
    let r = if prefix.is_empty() { r } else { Router::new().nest(&prefix, r) };
    r.fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(crate::api::ui::Ui::new(&info), crate::api::ui::serve))
        .layer(axum::middleware::from_fn_with_state(Gate { info: Arc::new(info), engine: None }, gate))
        .layer(axum::middleware::map_response(server_header))
}

type Params = Query<HashMap<String, String>>;

fn autoload(app: &RouterApp, q: &HashMap<String, String>) -> bool {
    match q.get("autoload").map(String::as_str) {
        None | Some("") => app.models.cfg.models_autoload,
        Some(v) => v == "true" || v == "1",
    }
}

/// The canonical name of a model a request may use (aliases resolve).
async fn validate(app: &RouterApp, name: &str, autoload: bool) -> Result<String, ApiError> {
    if name.is_empty() {
        return Err(ApiError::invalid("model name is missing from the request"));
    }
    let meta = app.models.get_meta(name).await.ok_or_else(|| ApiError::invalid(format!("model '{name}' not found")))?;
    if !autoload && !meta.is_running() {
        return Err(ApiError::invalid("model is not loaded"));
    }
    Ok(meta.name)
}

struct Forward {
    method: Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
}

async fn route_to(app: &RouterApp, name: &str, autoload: bool, update_last_used: bool, fwd: Forward) -> Result<Response, ApiError> {
    let name = validate(app, name, autoload).await?;
    let ticket = if autoload { Some(app.models.ensure_ready(&name).await?) } else { None };
    let (port, guard) = app.models.begin_request(&name, update_last_used)?;
    drop(ticket);
    if app.models.cfg.fake_timing {
        tokio::time::sleep(models::FAKE_DELAY).await;
    }
    crate::log::info(&format!("srv router: proxying request to model {name} on port {port}"));
    Ok(proxy::forward(port, fwd.method, &fwd.uri, &fwd.headers, fwd.body, guard).await)
}

async fn proxy_get(State(app): State<RouterApp>, Query(q): Params, OriginalUri(uri): OriginalUri, headers: HeaderMap) -> Result<Response, ApiError> {
    let name = q.get("model").cloned().unwrap_or_default();
    let fwd = Forward { method: Method::GET, uri, headers, body: Bytes::new() };
    route_to(&app, &name, autoload(&app, &q), false, fwd).await
}

async fn proxy_post(
    State(app): State<RouterApp>,
    Query(q): Params,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let parsed = parse_body(&body)?;
    let name = parsed.get("model").and_then(Value::as_str).unwrap_or_default().to_string();
    let conv = crate::api::streams::conv_id(&headers);
    let autoload = autoload(&app, &q);
    let fwd = Forward { method: Method::POST, uri, headers, body };
    if conv.is_empty() {
        return route_to(&app, &name, autoload, true, fwd).await;
    }
    // a session request runs in a task of its own: a client dropping during a model load must
    // not cancel it, only a stop does (the session then receives the whole generation)
    tokio::spawn(async move { route_session(&app, &name, &conv, autoload, fwd).await }).await.map_err(|e| ApiError::server(e.to_string()))?
}

async fn route_session(app: &RouterApp, name: &str, conv: &str, autoload: bool, fwd: Forward) -> Result<Response, ApiError> {
    let name = validate(app, name, autoload).await?;
    let ticket = app.convs.remember(conv, &name);
    let ready = if autoload { Some(app.models.ensure_ready(&name).await?) } else { None };
    if !app.convs.alive(conv, ticket) {
        crate::log::info(&format!("srv router: request for conv_id={conv} cancelled while model name={name} was loading"));
        return Err(ApiError::invalid("request cancelled by a stop while the model was loading"));
    }
    let (port, guard) = app.models.begin_request(&name, true)?;
    drop(ready);
    if app.models.cfg.fake_timing {
        tokio::time::sleep(models::FAKE_DELAY).await;
    }
    crate::log::info(&format!("srv router: proxying request to model {name} on port {port}"));
    Ok(proxy::forward(port, fwd.method, &fwd.uri, &fwd.headers, fwd.body, guard).await)
}

/// The model serving a conversation's session and whether it is loaded.
async fn conv_owner(app: &RouterApp, conv: &str) -> Option<(String, models::Status)> {
    let name = app.convs.lookup(conv)?;
    let meta = app.models.get_meta(&name).await?;
    Some((meta.name, meta.status))
}

async fn stream_get(State(app): State<RouterApp>, Query(q): Params, OriginalUri(uri): OriginalUri, headers: HeaderMap) -> Result<Response, ApiError> {
    let conv = q.get("conv_id").cloned().unwrap_or_default();
    if conv.is_empty() {
        return Err(ApiError::invalid("Missing conversation id in path"));
    }
    match conv_owner(&app, &conv).await {
        Some((name, models::Status::Loaded)) => {
            let (port, guard) = app.models.begin_request(&name, false)?;
            Ok(proxy::forward(port, Method::GET, &uri, &headers, Bytes::new(), guard).await)
        }
        Some((_, models::Status::Loading | models::Status::Downloading | models::Status::Downloaded)) => {
            Err(ApiError::new(ErrorType::Unavailable, "Stream owner model is loading, retry later"))
        }
        _ => Err(ApiError::new(ErrorType::NotFound, "Stream not found or expired")),
    }
}

async fn stream_delete(State(app): State<RouterApp>, Query(q): Params, OriginalUri(uri): OriginalUri, headers: HeaderMap) -> Result<Response, ApiError> {
    let conv = q.get("conv_id").cloned().unwrap_or_default();
    if conv.is_empty() {
        return Err(ApiError::invalid("Missing conversation id in path"));
    }
    match conv_owner(&app, &conv).await {
        Some((name, models::Status::Loaded)) => {
            if let Ok((port, guard)) = app.models.begin_request(&name, false) {
                let res = proxy::forward(port, Method::DELETE, &uri, &headers, Bytes::new(), guard).await;
                let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await;
            }
        }
        Some((name, _)) => {
            crate::log::info(&format!("srv router: router stop for conv_id={conv} while model name={name} is loading, cancelling the pending request"))
        }
        None => crate::log::info(&format!("srv router: router stop for unknown conv_id={conv}, no owning child in the conv map")),
    }
    app.convs.forget(&conv);
    Ok(crate::api::streams::no_content())
}

async fn streams_lookup(State(app): State<RouterApp>, OriginalUri(uri): OriginalUri, headers: HeaderMap, body: Bytes) -> Json<Value> {
    let requested = crate::api::streams::requested_ids(&body).unwrap_or_default();
    let mut per_child: HashMap<String, Vec<String>> = HashMap::new();
    for id in requested {
        if let Some((name, models::Status::Loaded)) = conv_owner(&app, &id).await {
            per_child.entry(name).or_default().push(id);
        }
    }
    let mut out = Vec::new();
    for (name, ids) in per_child {
        let Ok((port, guard)) = app.models.begin_request(&name, false) else { continue };
        let body = Bytes::from(json!({"conversation_ids": ids}).to_string());
        let ask = async {
            let res = proxy::forward(port, Method::POST, &uri, &headers, body, guard).await;
            if res.status() != StatusCode::OK {
                return None;
            }
            axum::body::to_bytes(res.into_body(), usize::MAX).await.ok()
        };
        let Ok(Some(bytes)) = tokio::time::timeout(std::time::Duration::from_secs(2), ask).await else { continue };
        if let Ok(Value::Array(entries)) = serde_json::from_slice::<Value>(&bytes) {
            out.extend(entries.into_iter().filter(Value::is_object));
        }
    }
    Json(Value::Array(out))
}

async fn get_props(State(app): State<RouterApp>, q: Params, uri: OriginalUri, headers: HeaderMap) -> Result<Response, ApiError> {
    if q.get("model").is_none_or(String::is_empty) {
        return Ok(Json(app.props.as_ref().clone()).into_response());
    }
    proxy_get(State(app), q, uri, headers).await
}

async fn list_models(State(app): State<RouterApp>, Query(q): Params) -> Result<Json<Value>, ApiError> {
    if q.get("reload").is_some_and(|v| !v.is_empty()) {
        app.models.load_models().await.map_err(|e| ApiError::server(e.to_string()))?;
    }
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let data: Vec<Value> = app.models.all_meta().await.iter().filter(|m| !m.hidden).map(|m| m.to_json(created)).collect();
    Ok(Json(json!({"data": data, "object": "list"})))
}

fn model_field(body: &Bytes) -> Result<String, ApiError> {
    Ok(parse_body(body)?.get("model").and_then(Value::as_str).unwrap_or_default().to_string())
}

fn success() -> Json<Value> {
    Json(json!({"success": true}))
}

async fn load_model(State(app): State<RouterApp>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let name = model_field(&body)?;
    let meta = app.models.get_meta(&name).await.ok_or_else(|| ApiError::new(ErrorType::NotFound, "model is not found"))?;
    if meta.is_running() {
        return Err(ApiError::invalid("model is already running"));
    }
    app.models.load(&meta.name).await?;
    Ok(success())
}

async fn unload_model(State(app): State<RouterApp>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let name = model_field(&body)?;
    let meta = app.models.get_meta(&name).await.ok_or_else(|| ApiError::invalid("model is not found"))?;
    if !meta.is_running() && meta.status != models::Status::Downloading {
        return Err(ApiError::invalid("model is not running"));
    }
    app.models.unload(&meta.name).await;
    Ok(success())
}

async fn download_model(State(app): State<RouterApp>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let name = model_field(&body)?;
    if name.is_empty() {
        return Err(ApiError::invalid("model must be a non-empty string"));
    }
    let (repo, token) = (name.clone(), app.models.cfg.hf_token.clone());
    tokio::task::spawn_blocking(move || strata_ffi::router_check_repo(&repo, &token))
        .await
        .map_err(|e| ApiError::server(e.to_string()))?
        .map_err(|e| ApiError::server(e.to_string()))?;
    if app.models.has_model(&name) {
        return Err(ApiError::invalid(format!("model '{name}' already exists")));
    }
    crate::log::info(&format!("srv router: starting download for model '{name}'"));
    app.models.start_download(&name)?;
    Ok(success())
}

async fn remove_model(State(app): State<RouterApp>, Query(q): Params) -> Result<Json<Value>, ApiError> {
    let name = q.get("model").cloned().unwrap_or_default();
    if name.is_empty() {
        return Err(ApiError::invalid("model must be a non-empty string"));
    }
    app.models.remove(&name).await?;
    Ok(success())
}

/// Model events as server-sent events, one `data: {json}` each.
async fn models_sse(State(app): State<RouterApp>) -> Response {
    let rx = app.models.sse.subscribe();
    let events = futures_util::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(ev) => return Some((Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {ev}\n\n"))), rx)),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    (StatusCode::OK, [(axum::http::header::CONTENT_TYPE, "text/event-stream")], Body::from_stream(events)).into_response()
}
