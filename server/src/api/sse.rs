//! Streamed responses: server-sent events in the native, OpenAI and Anthropic framings.

use crate::api::error::ApiError;
use crate::engine::Event;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Value};
use tokio::sync::mpsc;

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
    Ok(Response::builder().status(StatusCode::OK).header("content-type", "text/event-stream").body(crate::api::streams::wrap_body(body)).unwrap())
}
