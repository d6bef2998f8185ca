//! Streamed responses: server-sent events in the native, OpenAI and Anthropic framings.

use crate::api::error::ApiError;
use crate::engine::Event;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Map, Value};
use std::future::Future as _;
use std::time::Duration;

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

pub fn sse_write(out: &mut String, style: Sse, v: &Value) {
    match (style, v.get("event").and_then(Value::as_str), v.get("data")) {
        (Sse::Anthropic | Sse::Responses, Some(ev), Some(data)) => out.push_str(&format!("event: {ev}\ndata: {data}\n\n")),
        _ => out.push_str(&format!("data: {v}\n\n")),
    }
}

/// The keep-alive of a stream: `--sse-ping-interval`, or the request's `sse_ping_interval`;
/// none at 0 or below.
pub fn ping_interval(server_default: i32, body: &Map<String, Value>) -> Option<Duration> {
    let secs = body.get("sse_ping_interval").and_then(Value::as_i64).unwrap_or(server_default.into());
    (secs > 0).then(|| Duration::from_secs(secs as u64))
}

/// An SSE comment: clients and proxies that drop a silent connection see bytes.
const PING: &str = ":\n\n";

/// `ping`: after the first event, a stream that stays silent that long sends [`PING`], and
/// again after each further such wait, as llama-server's streams do.
pub async fn stream_response(
    mut rx: crate::engine::Results,
    n_tasks: usize,
    mut render: impl FnMut(&Event) -> Vec<Value> + Send + 'static,
    style: Sse,
    ping: Option<Duration>,
) -> Result<Response, ApiError> {
    let first = rx.recv().await.ok_or_else(|| ApiError::server("engine dropped the request"))?;
    if let Event::Error(e) = first {
        return Err(e);
    }
    let mut remaining = n_tasks;
    let mut next = Some(first);
    let mut finished = false;
    let mut silence = ping.map(|d| Box::pin(tokio::time::sleep(d)));
    let body = futures_util::stream::poll_fn(move |cx| {
        if finished {
            return std::task::Poll::Ready(None);
        }
        let first_event = next.is_some();
        let ev = match next.take() {
            Some(ev) => ev,
            None => match rx.poll_recv(cx) {
                std::task::Poll::Pending => {
                    if let (Some(timer), Some(d)) = (silence.as_mut(), ping) {
                        if timer.as_mut().poll(cx).is_ready() {
                            timer.as_mut().reset(tokio::time::Instant::now() + d);
                            return std::task::Poll::Ready(Some(Ok(Bytes::from_static(PING.as_bytes()))));
                        }
                    }
                    return std::task::Poll::Pending;
                }
                std::task::Poll::Ready(None) => return std::task::Poll::Ready(None),
                std::task::Poll::Ready(Some(ev)) => ev,
            },
        };
        if let (Some(timer), Some(d)) = (silence.as_mut(), ping) {
            timer.as_mut().reset(tokio::time::Instant::now() + d);
        }
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
            // a later task's start: llama-server writes its empty result as JSON null
            Event::Begin if !first_event && matches!(style, Sse::Plain | Sse::OpenAi) => out.push_str("data: null\n\n"),
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
    Ok(Response::builder().status(StatusCode::OK).header("content-type", "text/event-stream").body(crate::api::streams::wrap_body(body)).unwrap())
}
