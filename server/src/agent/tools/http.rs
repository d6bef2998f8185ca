//! GET/POST /tools: the catalogue of tools the server runs on a client's behalf, and calls to
//! them. Enabled by --tools or by MCP servers; otherwise both answer 403, as llama-server's do.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Map, Value};

use crate::agent::cors_proxy::feature_disabled;
use crate::agent::mcp::{self, McpManager};
use crate::agent::tools::{self, Tools};
use crate::api::error::{ApiError, ErrorType};
use crate::api::values::type_error;

/// Request parameters that only the matching header may set.
const HEADER_PARAMS: &[(&str, &str)] = &[("cwd", "x-tool-cwd"), ("runtime", "x-tool-runtime"), ("resp_type", "x-resp-type")];

struct Catalogue {
    builtin: Option<Arc<Tools>>,
    mcp: Arc<McpManager>,
    /// MCP tools under their public names, minus any that collided with an earlier one.
    mcp_tools: Vec<mcp::ToolDef>,
}

/// The /tools routes: the built-in tools --tools enables first, then the MCP servers' tools.
pub fn routes(builtin: Option<Arc<Tools>>, mcp: Arc<McpManager>) -> Router {
    if builtin.is_none() && mcp.is_empty() {
        return Router::new().route("/tools", get(feature_disabled).post(feature_disabled));
    }
    let mut seen: std::collections::HashSet<String> = builtin
        .as_ref()
        .map(|b| b.describe().as_array().into_iter().flatten().filter_map(|t| t["tool"].as_str().map(String::from)).collect())
        .unwrap_or_default();
    let mut mcp_tools = Vec::new();
    for def in mcp.tools() {
        let name = def.public_name();
        if !seen.insert(name.clone()) {
            crate::log::info(&format!("srv  tools: MCP tool \"{name}\" from server \"{}\" collides with an existing tool, skipping", def.server));
            continue;
        }
        mcp_tools.push(def.clone());
    }
    if !mcp_tools.is_empty() {
        crate::log::info(&format!("srv  tools: added {} MCP tools", mcp_tools.len()));
    }
    let cat = Arc::new(Catalogue { builtin, mcp, mcp_tools });
    Router::new().route("/tools", get(list).post(call)).with_state(cat)
}

async fn list(State(cat): State<Arc<Catalogue>>) -> Json<Value> {
    let mut all = cat.builtin.as_ref().and_then(|b| b.describe().as_array().cloned()).unwrap_or_default();
    all.extend(cat.mcp_tools.iter().map(mcp::listing_entry));
    Json(Value::Array(all))
}

/// The body's fields, with llama-server's (nlohmann's) wording for a missing or mistyped one.
struct CallRequest {
    tool: String,
    params: Value,
    stream: bool,
}

fn parse_call(body: &Bytes) -> Result<CallRequest, ApiError> {
    let v = crate::api::body::parse_json(body).map_err(ApiError::invalid)?;
    let tool = match v.get("tool") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(ApiError::invalid(type_error("string", other))),
        None => return Err(ApiError::invalid("[json.exception.out_of_range.403] key 'tool' not found")),
    };
    let params = v.get("params").cloned().unwrap_or_else(|| Value::Object(Map::new()));
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    Ok(CallRequest { tool, params, stream })
}

/// Drops the header-only parameters from the body and sets them from the headers instead.
fn apply_header_params(params: &mut Value, headers: &HeaderMap) {
    let Value::Object(m) = params else { return };
    for (param, header) in HEADER_PARAMS {
        m.remove(*param);
        if let Some(v) = headers.get(*header).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty()) {
            m.insert((*param).to_string(), Value::String(v.to_string()));
        }
    }
}

async fn call(State(cat): State<Arc<Catalogue>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(builtin) = cat.builtin.as_ref() {
        let name = serde_json::from_slice::<Value>(&body).ok().and_then(|v| v["tool"].as_str().map(String::from));
        // A built-in tool, or a request only the built-in parser can answer precisely.
        if cat.mcp_tools.is_empty() || name.as_deref().is_none_or(|n| builtin.has(n)) {
            return tools::call(builtin.clone(), headers, body).await;
        }
    }
    let mut req = match parse_call(&body) {
        Ok(r) => r,
        Err(e) => return bare_error(e),
    };
    apply_header_params(&mut req.params, &headers);
    // llama-server's HTTP layer turns every 404 into its generic "File Not Found" body.
    let Some(def) = mcp::find_tool(&cat.mcp_tools, &req.tool).filter(|_| !req.stream) else {
        return ApiError::new(ErrorType::NotFound, "File Not Found").into_response();
    };
    Json(cat.mcp.call_tool(&def.server, &def.name, req.params).await).into_response()
}

/// llama-server's /tools writes the error object without the `{"error": ...}` wrapper.
fn bare_error(e: ApiError) -> Response {
    let status = if e.kind == ErrorType::InvalidRequest { StatusCode::BAD_REQUEST } else { StatusCode::INTERNAL_SERVER_ERROR };
    (status, Json(e.body()["error"].take())).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn header_params_replace_body_ones() {
        let mut params = serde_json::json!({"cwd": "/etc", "runtime": "x", "message": "hi"});
        let mut h = HeaderMap::new();
        h.insert("x-tool-cwd", HeaderValue::from_static("/work"));
        apply_header_params(&mut params, &h);
        assert_eq!(params, serde_json::json!({"message": "hi", "cwd": "/work"}));
    }

    #[test]
    fn call_body_errors_use_llama_server_wording() {
        let err = |b: &'static str| parse_call(&Bytes::from_static(b.as_bytes())).err().unwrap().message;
        assert_eq!(err(r#"{"params": {}}"#), "[json.exception.out_of_range.403] key 'tool' not found");
        assert_eq!(err(r#"{"tool": 3}"#), "[json.exception.type_error.302] type must be string, but is number");
        let ok = parse_call(&Bytes::from_static(br#"{"tool": "a_b"}"#)).unwrap();
        assert_eq!((ok.tool.as_str(), ok.params, ok.stream), ("a_b", serde_json::json!({}), false));
    }
}
