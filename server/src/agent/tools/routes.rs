//! `GET /tools` and `POST /tools`; without `--tools` both answer 403, as llama-server does.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::params::{not_an_object, object, required_str, wrong_type};
use super::{Call, Sink, ToolError, Tools, HEADER_PARAMS};
use crate::api::error::{ApiError, ErrorType};

/// Stream events a slow client may leave unread before the tool waits for it.
const STREAM_BACKLOG: usize = 64;

impl IntoResponse for ToolError {
    fn into_response(self) -> Response {
        let (status, kind) = match &self {
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, ErrorType::InvalidRequest),
            // llama-server's HTTP layer answers every 404 with its generic body
            Self::NotFound(_) => return ApiError::new(ErrorType::NotFound, "File Not Found").into_response(),
            Self::Failed(msg) => {
                crate::log::srv(strata_ffi::Verbosity::Info, "handle_post", &format!("got exception: {msg}"));
                (StatusCode::INTERNAL_SERVER_ERROR, ErrorType::Server)
            }
        };
        // unlike other routes, llama-server's /tools sends the error object without an "error" wrapper
        let body = ApiError::new(kind, self.to_string()).body()["error"].take();
        (status, Json(body)).into_response()
    }
}

struct Request {
    tool: String,
    params: Map<String, Value>,
    stream: bool,
}

fn parse(body: &[u8], headers: &HeaderMap) -> Result<Request, ToolError> {
    let body = crate::api::body::parse_json(body).map_err(ToolError::BadRequest)?;
    let obj = object(&body)?;
    let tool = required_str(obj, "tool")?;
    let mut params = match obj.get("params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(other) => return Err(not_an_object("at()", other)),
    };
    let stream = match obj.get("stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(wrong_type("boolean", other)),
    };
    for (key, header) in HEADER_PARAMS {
        params.remove(key);
        let value = headers.get(header).and_then(|v| v.to_str().ok()).unwrap_or("");
        if !value.is_empty() {
            params.insert(key.to_string(), Value::String(value.to_string()));
        }
    }
    Ok(Request { tool, params, stream })
}

/// `POST /tools` for a built-in tool.
pub(crate) async fn call(tools: Arc<Tools>, headers: HeaderMap, body: Bytes) -> Response {
    match run(tools, headers, body).await {
        Ok(res) => res,
        Err(e) => e.into_response(),
    }
}

async fn run(tools: Arc<Tools>, headers: HeaderMap, body: Bytes) -> Result<Response, ToolError> {
    let mut req = parse(&body, &headers)?;
    if !req.params.contains_key("runtime") && tools.has_runtime() {
        let t = tools.clone();
        if let Some(spec) = blocking(move || t.default_runtime()).await? {
            req.params.insert("runtime".into(), Value::String(spec));
        }
    }
    tools.find(&req.tool, req.stream)?;
    let call = Call { params: req.params };
    if !req.stream {
        let value = blocking(move || tools.find(&req.tool, false)?.invoke(&call, None)).await?;
        return Ok(Json(value).into_response());
    }

    let (tx, mut rx) = mpsc::channel::<Bytes>(STREAM_BACKLOG);
    tokio::task::spawn_blocking(move || {
        let mut sink = SseSink { tx, pending: Vec::new() };
        let outcome = tools.find(&req.tool, true).and_then(|tool| tool.invoke(&call, Some(&mut sink)));
        sink.finish(outcome.err().map(|e| e.to_string()));
    });
    let body = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|c| c.map(Ok::<_, std::convert::Infallible>)));
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/event-stream")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(body))
        .expect("static response parts are valid"))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ToolError> + Send + 'static) -> Result<T, ToolError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ToolError::Failed(format!("tool call panicked: {e}")))?
}

/// Sends `data: {"chunk": ...}` events; a multi-byte character split across reads is held back
/// until it is whole.
struct SseSink {
    tx: mpsc::Sender<Bytes>,
    pending: Vec<u8>,
}

impl SseSink {
    fn send(&self, event: &Value) {
        let _ = self.tx.blocking_send(Bytes::from(format!("data: {event}\n\n")));
    }

    fn finish(mut self, error: Option<String>) {
        if !self.pending.is_empty() {
            let rest = String::from_utf8_lossy(&std::mem::take(&mut self.pending)).into_owned();
            self.send(&json!({"chunk": rest}));
        }
        let mut done = json!({"done": true});
        if let Some(e) = error {
            done["error"] = Value::String(e);
        }
        self.send(&done);
    }
}

impl Sink for SseSink {
    fn push(&mut self, chunk: &[u8]) {
        self.pending.extend_from_slice(chunk);
        let keep = incomplete_utf8_tail(&self.pending);
        let whole: Vec<u8> = self.pending.drain(..self.pending.len() - keep).collect();
        if !whole.is_empty() {
            self.send(&json!({"chunk": String::from_utf8_lossy(&whole)}));
        }
    }

    fn alive(&self) -> bool {
        !self.tx.is_closed()
    }
}

/// How many trailing bytes start a UTF-8 sequence that the next read will complete.
fn incomplete_utf8_tail(bytes: &[u8]) -> usize {
    for back in 1..=bytes.len().min(3) {
        let b = bytes[bytes.len() - back];
        if b & 0xC0 == 0x80 {
            continue;
        }
        let len = match b {
            0xF0..=0xF7 => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
        return if len > back { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request as HttpRequest;
    use axum::Router;
    use tower::ServiceExt;

    #[test]
    fn holds_back_a_split_character() {
        let euro = "€".as_bytes();
        assert_eq!(incomplete_utf8_tail(b"abc"), 0);
        assert_eq!(incomplete_utf8_tail(&euro[..1]), 1);
        assert_eq!(incomplete_utf8_tail(&[b"a", &euro[..2]].concat()), 2);
        assert_eq!(incomplete_utf8_tail(euro), 0);
        assert_eq!(incomplete_utf8_tail(&[0x80, 0x80, 0x80]), 0);
    }

    #[test]
    fn headers_replace_what_the_model_sent() {
        let mut headers = HeaderMap::new();
        headers.insert("x-tool-cwd", "/from/header".parse().unwrap());
        let body = br#"{"tool":"read_file","params":{"path":"a","cwd":"/model","runtime":"ssh:x","resp_type":"base64"}}"#;
        let req = parse(body, &headers).unwrap();
        assert_eq!(req.params["cwd"], "/from/header");
        assert!(!req.params.contains_key("runtime") && !req.params.contains_key("resp_type"));
        assert!(!req.stream);
    }

    #[test]
    fn malformed_requests_are_bad_requests() {
        let h = HeaderMap::new();
        let err = |b: &[u8]| parse(b, &h).err().unwrap().to_string();
        assert_eq!(err(br#"{"params":{}}"#), "[json.exception.out_of_range.403] key 'tool' not found");
        assert_eq!(err(br#"{"tool":1}"#), "[json.exception.type_error.302] type must be string, but is number");
        assert_eq!(err(br#"{"tool":"x","stream":"yes"}"#), "[json.exception.type_error.302] type must be boolean, but is string");
        assert!(err(b"not json").starts_with("[json.exception.parse_error.101]"));
    }

    async fn send(app: Router, method: &str, body: &str, headers: &[(&str, &str)]) -> (StatusCode, String) {
        let mut req = HttpRequest::builder().method(method).uri("/tools");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let res = app.oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let status = res.status();
        let bytes = axum::body::to_bytes(res.into_body(), usize::MAX).await.unwrap();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    /// The /tools routes as the server mounts them, without MCP servers.
    async fn routes(tools: Option<Arc<Tools>>) -> Router {
        let mcp = crate::agent::mcp::McpManager::start("", "").await.unwrap();
        crate::agent::tools::http::routes(tools, Arc::new(mcp))
    }

    async fn app() -> Router {
        routes(Some(Arc::new(Tools::new(&["all".into()], "").unwrap()))).await
    }

    #[tokio::test]
    async fn disabled_without_tools() {
        let (s, body) = send(routes(None).await, "GET", "", &[]).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        assert_eq!(body, r#"{"error":{"message":"this feature is disabled","type":"feature_disabled"}}"#);
    }

    #[tokio::test]
    async fn runtime_header_errors_are_server_errors() {
        let call = r#"{"tool":"exec_shell_command","params":{"command":"echo hi"}}"#;
        let (s, body) = send(app().await, "POST", call, &[("x-tool-runtime", "docker-container:--privileged")]).await;
        assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body, r#"{"code":500,"message":"invalid container id: --privileged","type":"server_error"}"#);
        let (s, body) = send(app().await, "POST", call, &[("x-tool-runtime", "fake:x")]).await;
        assert_eq!((s, body.contains("unknown tool runtime: fake:x")), (StatusCode::INTERNAL_SERVER_ERROR, true));
    }

    #[tokio::test]
    async fn unknown_tools_and_non_streaming_streams_are_not_found() {
        let (s, _) = send(app().await, "POST", r#"{"tool":"nope"}"#, &[]).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        let (s, _) = send(app().await, "POST", r#"{"tool":"read_file","stream":true,"params":{"path":"x"}}"#, &[]).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn streams_shell_output_then_done() {
        let call = r#"{"tool":"exec_shell_command","stream":true,"params":{"command":"echo hello"}}"#;
        let (s, body) = send(app().await, "POST", call, &[]).await;
        assert_eq!(s, StatusCode::OK);
        let events: Vec<Value> = body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(|e| serde_json::from_str(e).unwrap()).collect();
        assert_eq!(events.last().unwrap(), &json!({"done": true}));
        let text: String = events.iter().filter_map(|e| e["chunk"].as_str()).collect();
        assert_eq!(text, "hello\n\n[exit code: 0]");
    }

    #[tokio::test]
    async fn lists_enabled_tools() {
        let (s, body) = send(app().await, "GET", "", &[]).await;
        assert_eq!(s, StatusCode::OK);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v.as_array().unwrap().len(), 7);
    }
}
