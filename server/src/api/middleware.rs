//! What runs around every route: the API key gate, llama-server's Server header, the body limit
//! and the JSON 404.

use crate::api::error::{ApiError, ErrorType};
use crate::api::info::{origin_is_localhost, ServerInfo};
use crate::engine::{EngineHandle, State};
use axum::extract::Request;
use axum::extract::State as AxState;
use axum::http::header::CONTENT_TYPE;
use axum::http::Method;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;

/// What the gate middleware checks against; a router (no engine of its own) is always ready.
#[derive(Clone)]
pub struct Gate {
    pub info: Arc<ServerInfo>,
    pub engine: Option<EngineHandle>,
}

pub const PUBLIC_PATHS: &[&str] = &["/health", "/v1/health"];

/// llama-server matches its public paths literally, so under --api-prefix they need a key too.
pub fn is_public(path: &str) -> bool {
    PUBLIC_PATHS.contains(&path) || crate::api::ui::is_frontend_path(path)
}

pub fn header<'a>(req: &'a Request, name: &str) -> &'a str {
    req.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
}

/// The bodies llama-server's middleware writes itself (fields in its order).
pub fn middleware_error(status: StatusCode, message: &str, ty: &str) -> Response {
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
    } else if g.engine.as_ref().is_some_and(|e| e.state() != State::Ready) && !crate::api::ui::is_frontend_path(req.uri().path()) {
        middleware_error(StatusCode::SERVICE_UNAVAILABLE, "Loading model", "unavailable_error")
    } else if !info.api_keys.is_empty() && !is_public(req.uri().path()) && !api_key_ok(&req, &info.api_keys) {
        middleware_error(StatusCode::UNAUTHORIZED, "Invalid API Key", "authentication_error")
    } else {
        let conv = crate::api::streams::conv_id(req.headers());
        crate::api::streams::CONV_ID.scope(Some(conv), next.run(req)).await
    };
    if let Some(o) = allow_origin.and_then(|o| HeaderValue::from_str(&o).ok()) {
        res.headers_mut().insert("access-control-allow-origin", o);
    }
    res
}

pub fn api_key_ok(req: &Request, keys: &[String]) -> bool {
    let mut key = header(req, "authorization");
    if key.is_empty() {
        key = header(req, "x-api-key");
    }
    let key = key.strip_prefix("Bearer ").unwrap_or(key);
    keys.iter().any(|k| k == key)
}

/// What llama-server's HTTP layer does to every answer: its Server header, UTF-8 JSON, unbuffered
/// event streams, and one body for every 404.
pub async fn server_header(mut res: Response) -> Response {
    if res.extensions().get::<crate::api::ui::Verbatim>().is_some() {
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
