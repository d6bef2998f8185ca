//! Resumable streams, as llama-server's server-stream does: a streamed generation whose request
//! carries `X-Conversation-Id` writes its SSE bytes into a per-conversation session that outlives
//! the client connection. `GET /v1/stream?conv_id=..&from=N` replays and follows it,
//! `POST /v1/streams/lookup` reports on sessions the caller names, `DELETE /v1/stream?conv_id=..`
//! stops and evicts one. The router keeps a conv id -> model map (`ConvModels`) to reach the
//! child owning a session.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::Query;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::{Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::api::error::{ApiError, ErrorType};

const TTL_SECONDS: i64 = 300;
const MAX_BYTES: usize = 4 * 1024 * 1024;

tokio::task_local! {
    /// The `X-Conversation-Id` of the request being handled (set by the gate).
    pub static CONV_ID: Option<String>;
}

fn now_seconds() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The request's `X-Conversation-Id`, empty when absent.
pub fn conv_id(headers: &HeaderMap) -> String {
    headers.get("x-conversation-id").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string()
}

/// The conv id of the request in flight on this task, if any.
pub fn current_conv_id() -> Option<String> {
    CONV_ID.try_with(|c| c.clone()).ok().flatten().filter(|c| !c.is_empty())
}

#[derive(Default)]
struct Buf {
    data: Vec<u8>,
    /// Bytes dropped from the front once the cap was reached.
    dropped: usize,
    done: bool,
    completed: i64,
}

pub struct Session {
    conv_id: String,
    started: i64,
    buf: Mutex<Buf>,
    cancelled: AtomicBool,
    changed: watch::Sender<u64>,
}

impl Session {
    fn new(conv_id: String) -> Self {
        Session { conv_id, started: now_seconds(), buf: Mutex::default(), cancelled: AtomicBool::new(false), changed: watch::Sender::new(0) }
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    fn append(&self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        {
            let mut b = self.buf.lock().unwrap();
            if b.done {
                return;
            }
            b.data.extend_from_slice(bytes);
            if b.data.len() > MAX_BYTES {
                let cut = b.data.len() - MAX_BYTES;
                b.data.drain(..cut);
                b.dropped += cut;
            }
        }
        self.bump();
    }

    fn finalize(&self) {
        {
            let mut b = self.buf.lock().unwrap();
            if b.done {
                return;
            }
            b.done = true;
            b.completed = now_seconds();
        }
        self.bump();
    }

    fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        self.finalize();
    }

    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    fn info(&self) -> Value {
        let b = self.buf.lock().unwrap();
        json!({
            "conversation_id": self.conv_id,
            "is_done": b.done,
            "total_bytes": b.dropped + b.data.len(),
            "started_at": self.started,
            "completed_at": b.completed,
        })
    }

    /// The bytes from `offset` on as a stream that follows the session until it is done.
    fn reader(self: Arc<Self>, offset: usize) -> impl Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static {
        let rx = self.changed.subscribe();
        futures_util::stream::unfold((self, rx, offset), |(s, mut rx, mut offset)| async move {
            loop {
                rx.borrow_and_update();
                let (chunk, done) = {
                    let b = s.buf.lock().unwrap();
                    if offset < b.dropped {
                        return None;
                    }
                    let local = offset - b.dropped;
                    let chunk = (local < b.data.len()).then(|| Bytes::copy_from_slice(&b.data[local..]));
                    (chunk, b.done)
                };
                if let Some(chunk) = chunk {
                    offset += chunk.len();
                    return Some((Ok(chunk), (s, rx, offset)));
                }
                if done || rx.changed().await.is_err() {
                    return None;
                }
            }
        })
    }
}

static SESSIONS: LazyLock<Mutex<HashMap<String, Arc<Session>>>> = LazyLock::new(Mutex::default);

fn gc(map: &mut HashMap<String, Arc<Session>>) {
    let cutoff = now_seconds() - TTL_SECONDS;
    map.retain(|_, s| {
        let completed = s.buf.lock().unwrap().completed;
        completed == 0 || completed > cutoff
    });
}

/// Installs a new session for `conv_id`, cancelling any previous one.
fn create_or_replace(conv_id: &str) -> Arc<Session> {
    let fresh = Arc::new(Session::new(conv_id.to_string()));
    let previous = {
        let mut map = SESSIONS.lock().unwrap();
        gc(&mut map);
        map.insert(conv_id.to_string(), fresh.clone())
    };
    if let Some(p) = previous {
        p.cancel();
    }
    fresh
}

fn lookup_session(conv_id: &str) -> Option<Arc<Session>> {
    SESSIONS.lock().unwrap().get(conv_id).cloned()
}

fn evict_and_cancel(conv_id: &str) {
    let s = SESSIONS.lock().unwrap().remove(conv_id);
    match s {
        Some(s) => s.cancel(),
        None => crate::log::info(&format!("srv stream: stop on unknown stream session, conv_id={conv_id} matched nothing")),
    }
}

/// Wraps a streamed answer's body: with a conversation id on the request, the body is pumped into
/// a session by a task of its own (so generation goes on when the client leaves, until a stop)
/// and the client reads the session from its start.
pub fn wrap_body<S>(body: S) -> Body
where
    S: Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
{
    let Some(conv) = current_conv_id() else {
        return Body::from_stream(body);
    };
    let session = create_or_replace(&conv);
    let producer = session.clone();
    tokio::spawn(async move {
        let mut body = std::pin::pin!(body);
        let mut cancel_rx = producer.changed.subscribe();
        loop {
            if producer.is_cancelled() {
                break;
            }
            tokio::select! {
                item = body.next() => match item {
                    Some(Ok(chunk)) => producer.append(&chunk),
                    _ => break,
                },
                r = cancel_rx.changed() => if r.is_err() { break },
            }
        }
        producer.finalize();
    });
    Body::from_stream(session.reader(0))
}

fn error(kind: ErrorType, msg: &str) -> Response {
    ApiError::new(kind, msg).into_response()
}

type Params = Query<HashMap<String, String>>;

fn param<'a>(q: &'a HashMap<String, String>, k: &str) -> &'a str {
    q.get(k).map(String::as_str).unwrap_or_default()
}

async fn stream_get(Query(q): Params) -> Response {
    let conv = param(&q, "conv_id");
    if conv.is_empty() {
        return error(ErrorType::InvalidRequest, "Missing conversation id in path");
    }
    let Some(session) = lookup_session(conv) else {
        return error(ErrorType::NotFound, "Stream not found or expired");
    };
    let from = match param(&q, "from") {
        "" => 0,
        s => match s.parse::<usize>() {
            Ok(n) => n,
            Err(_) => return error(ErrorType::InvalidRequest, "Invalid 'from' offset"),
        },
    };
    if from < session.buf.lock().unwrap().dropped {
        return error(ErrorType::InvalidRequest, "Stream offset lost, please restart");
    }
    (StatusCode::OK, [(axum::http::header::CONTENT_TYPE, "text/event-stream")], Body::from_stream(session.reader(from))).into_response()
}

/// The conversation ids a lookup body names, or the parse error.
pub fn requested_ids(body: &[u8]) -> Result<Vec<String>, String> {
    let v = crate::api::body::parse_json(body)?;
    Ok(v["conversation_ids"].as_array().map(|a| a.iter().filter_map(Value::as_str).filter(|s| !s.is_empty()).map(String::from).collect()).unwrap_or_default())
}

async fn streams_lookup(body: Bytes) -> Response {
    let requested = match requested_ids(&body) {
        Ok(r) => r,
        Err(e) => {
            let body = json!({"error": {"message": format!("invalid body: {e}"), "type": "invalid_request_error"}});
            return (StatusCode::BAD_REQUEST, axum::Json(body)).into_response();
        }
    };
    let all: Vec<Arc<Session>> = SESSIONS.lock().unwrap().values().cloned().collect();
    let mut out = Vec::new();
    for id in &requested {
        let prefix = format!("{id}::");
        for s in &all {
            if s.conv_id == *id || s.conv_id.starts_with(&prefix) {
                out.push(s.info());
            }
        }
    }
    axum::Json(Value::Array(out)).into_response()
}

pub fn no_content() -> Response {
    (StatusCode::NO_CONTENT, [(axum::http::header::CONTENT_TYPE, "application/json")]).into_response()
}

async fn stream_delete(Query(q): Params) -> Response {
    let conv = param(&q, "conv_id");
    if conv.is_empty() {
        return error(ErrorType::InvalidRequest, "Missing conversation id in path");
    }
    evict_and_cancel(conv);
    no_content()
}

/// The session routes of a model instance.
pub fn routes() -> Router {
    Router::new().route("/v1/stream", get(stream_get).delete(stream_delete)).route("/v1/streams/lookup", post(streams_lookup))
}

/// Router side: which model serves a conversation's session. A registration returns a ticket;
/// a stop (forget) or a newer registration invalidates it, which cancels a request parked in a
/// model load.
#[derive(Default)]
pub struct ConvModels {
    next: AtomicU64,
    map: Mutex<HashMap<String, (String, u64)>>,
}

impl ConvModels {
    pub fn remember(&self, conv: &str, model: &str) -> u64 {
        if conv.is_empty() || model.is_empty() {
            return 0;
        }
        let ticket = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.map.lock().unwrap().insert(conv.to_string(), (model.to_string(), ticket));
        ticket
    }

    pub fn alive(&self, conv: &str, ticket: u64) -> bool {
        self.map.lock().unwrap().get(conv).is_some_and(|(_, t)| *t == ticket)
    }

    pub fn lookup(&self, conv: &str) -> Option<String> {
        self.map.lock().unwrap().get(conv).map(|(m, _)| m.clone())
    }

    pub fn forget(&self, conv: &str) {
        self.map.lock().unwrap().remove(conv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn session_replays_and_follows() {
        let s = Arc::new(Session::new("c".into()));
        s.append(b"data: 1\n\n");
        let reader = s.clone().reader(0);
        s.append(b"data: 2\n\n");
        s.finalize();
        let all: Vec<Bytes> = reader.map(|r| r.unwrap()).collect().await;
        assert_eq!(all.concat(), b"data: 1\n\ndata: 2\n\n");
        let tail: Vec<Bytes> = s.clone().reader(9).map(|r| r.unwrap()).collect().await;
        assert_eq!(tail.concat(), b"data: 2\n\n");
    }

    #[test]
    fn tickets() {
        let c = ConvModels::default();
        let t = c.remember("a::m", "m");
        assert!(c.alive("a::m", t));
        c.forget("a::m");
        assert!(!c.alive("a::m", t));
        assert_eq!(c.remember("", "m"), 0);
    }
}
