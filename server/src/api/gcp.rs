//! Google Cloud (Vertex AI) custom-container compatibility, as llama-server offers it: with
//! `AIP_MODE=PREDICTION`, `AIP_PREDICT_ROUTE` (default `/predict`) takes `{"instances": [...]}`,
//! runs each instance on the route its `@requestFormat` names (a path, or its camelCase alias
//! such as `chatCompletions`), and answers `{"predictions": [...]}`; `AIP_HEALTH_ROUTE` adds a
//! health route and `AIP_HTTP_PORT` replaces the port.

use axum::body::{Body, Bytes};
use axum::http::Request;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::api::error::ApiError;
use crate::cli::env::{self, Upstream};

const MAX_INSTANCES: usize = 128;

/// The POST routes an instance may name.
const ROUTES: &[&str] = &[
    "/completion",
    "/completions",
    "/v1/completions",
    "/chat/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/apply-template",
    "/tokenize",
    "/detokenize",
    "/chat/completions/input_tokens",
    "/v1/chat/completions/input_tokens",
];

pub struct Gcp {
    pub health: Option<String>,
    pub predict: String,
    pub port: Option<u16>,
}

fn env_path(name: Upstream) -> Option<String> {
    let v = env::upstream(name).filter(|v| !v.is_empty())?;
    Some(if v.starts_with('/') { v } else { format!("/{v}") })
}

impl Gcp {
    pub fn from_env() -> Option<Self> {
        if env::upstream(Upstream::AipMode)? != "PREDICTION" {
            return None;
        }
        Some(Self {
            health: env_path(Upstream::AipHealthRoute),
            predict: env_path(Upstream::AipPredictRoute).unwrap_or_else(|| "/predict".into()),
            port: env::upstream(Upstream::AipHttpPort).and_then(|p| p.parse().ok()),
        })
    }
}

/// llama-server's alias for a path: without `/v1`, camelCase at `/`, `-` and `_`.
fn alias(path: &str) -> String {
    let s = path.strip_prefix("/v1").filter(|_| path.len() > 3).unwrap_or(path);
    let s = s.strip_prefix('/').unwrap_or(s);
    let mut out = String::new();
    let mut cap = false;
    for c in s.chars().take_while(|&c| c != ':') {
        if matches!(c, '/' | '-' | '_') {
            cap = true;
        } else {
            out.push(if cap { c.to_ascii_uppercase() } else { c });
            cap = false;
        }
    }
    out
}

fn error(e: ApiError) -> Value {
    e.body()
}

/// Adds the predict (and health) routes to `app`; instances run on `app` itself.
pub fn with_routes(app: Router, gcp: &Gcp, prefix: &str) -> Router {
    let inner = app.clone();
    let prefix = prefix.to_string();
    let mut app = app.route(&gcp.predict, post(move |body: Bytes| predict(inner.clone(), prefix.clone(), body)));
    if let Some(h) = &gcp.health {
        let inner = app.clone();
        app = app.route(h, get(move || async move { inner.oneshot(Request::get("/health").body(Body::empty()).unwrap()).await }));
    }
    app
}

async fn run_instance(app: Router, prefix: &str, instance: &Value) -> Value {
    let Some(obj) = instance.as_object() else {
        return error(ApiError::invalid("each instance must be a JSON object"));
    };
    let Some(format) = obj.get("@requestFormat").and_then(Value::as_str) else {
        return error(ApiError::invalid("each instance must include a string @requestFormat"));
    };
    let Some(path) = ROUTES.iter().find(|p| alias(p) == format || **p == format) else {
        return error(ApiError::invalid(format!("no handler registered for @requestFormat: {format}")));
    };
    let mut payload = obj.clone();
    payload.remove("@requestFormat");
    if payload.contains_key("stream") {
        payload.insert("stream".into(), json!(false));
    }
    let req = Request::post(format!("{prefix}{path}")).body(Body::from(Value::Object(payload).to_string())).unwrap();
    let Ok(res) = app.oneshot(req).await;
    let Ok(bytes) = res.into_body().collect().await.map(|b| b.to_bytes()) else {
        return error(ApiError::server("empty response from internal handler"));
    };
    if bytes.is_empty() {
        return Value::Null;
    }
    serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
}

async fn predict(app: Router, prefix: String, body: Bytes) -> Response {
    let bad = |m: &str| (axum::http::StatusCode::BAD_REQUEST, Json(json!({"error": ApiError::invalid(m).body()["error"]}))).into_response();
    let data: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad(&e.to_string()),
    };
    if !data.is_object() {
        return bad("request body must be a JSON object");
    }
    let Some(instances) = data.get("instances").and_then(Value::as_array) else {
        return bad("request body must include an array field named instances");
    };
    if instances.len() > MAX_INSTANCES {
        return bad(&format!("instances array exceeds maximum size of {MAX_INSTANCES}"));
    }
    let runs = instances.iter().map(|i| run_instance(app.clone(), &prefix, i));
    let predictions = futures_util::future::join_all(runs).await;
    Json(json!({"predictions": predictions})).into_response()
}

#[cfg(test)]
mod tests {
    use super::alias;

    #[test]
    fn aliases_are_llama_servers() {
        assert_eq!(alias("/v1/chat/completions"), "chatCompletions");
        assert_eq!(alias("/apply-template"), "applyTemplate");
        assert_eq!(alias("/completion"), "completion");
        assert_eq!(alias("/chat/completions/input_tokens"), "chatCompletionsInputTokens");
    }
}
