//! Forwards one request to a model instance on the loopback interface and streams its answer
//! back, as llama-server's router does: hop-by-hop and CORS headers are left to the router.

use axum::body::{Body, Bytes};
use axum::http::header::{HeaderName, HOST};
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use http_body_util::{BodyDataStream, Full};
use hyper_util::rt::TokioIo;

use super::models::RequestGuard;

const CHILD_ADDR: &str = "127.0.0.1";

fn strip_response_header(name: &str) -> bool {
    matches!(name, "server" | "transfer-encoding" | "content-length" | "keep-alive" | "connection") || name.starts_with("access-control-")
}

fn strip_request_header(name: &str) -> bool {
    matches!(name, "accept-encoding" | "transfer-encoding" | "content-length" | "connection" | "keep-alive" | "host")
}

fn proxy_error(msg: impl std::fmt::Display) -> Response {
    crate::log::warn(&format!("srv router: http client error: {msg}"));
    (StatusCode::INTERNAL_SERVER_ERROR, format!("proxy error: {msg}")).into_response()
}

/// Sends the request to the instance on `port`; `guard` lives until the answer is fully sent.
pub async fn forward(port: u16, method: Method, uri: &Uri, headers: &HeaderMap, body: Bytes, guard: RequestGuard) -> Response {
    let stream = match tokio::net::TcpStream::connect((CHILD_ADDR, port)).await {
        Ok(s) => s,
        Err(e) => return proxy_error(e),
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
        Ok(pair) => pair,
        Err(e) => return proxy_error(e),
    };
    tokio::spawn(conn);

    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut req = Request::builder().method(method).uri(path);
    if let Some(h) = req.headers_mut() {
        for (k, v) in headers {
            if !strip_request_header(k.as_str()) {
                h.append(k.clone(), v.clone());
            }
        }
        if let Ok(host) = HeaderValue::from_str(&format!("{CHILD_ADDR}:{port}")) {
            h.insert(HOST, host);
        }
    }
    let req = match req.body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => return proxy_error(e),
    };
    let res = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => return proxy_error(e),
    };
    let (parts, incoming) = res.into_parts();
    let data = BodyDataStream::new(incoming).map(move |chunk| {
        let _in_flight = &guard;
        chunk
    });
    let mut out = Response::new(Body::from_stream(data));
    *out.status_mut() = parts.status;
    for (k, v) in &parts.headers {
        if !strip_response_header(k.as_str()) {
            out.headers_mut().append(HeaderName::clone(k), v.clone());
        }
    }
    out
}
