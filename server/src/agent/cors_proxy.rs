//! /cors-proxy: lets the Web UI reach MCP servers over HTTP that send no CORS headers. Only
//! headers the caller names explicitly, as `x-llama-server-proxy-header-<name>`, are forwarded,
//! so the caller's own credentials (API key, cookies) never leave this server.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Query;
use axum::http::header::{CONTENT_TYPE, HOST, LOCATION};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use serde_json::json;

use crate::api::error::ApiError;

const FORWARD_PREFIX: &str = "x-llama-server-proxy-header-";
/// llama-server's proxy waits this long to connect and for each read or write.
const IO_TIMEOUT: Duration = Duration::from_secs(600);
const MAX_REDIRECTS: usize = 10;
/// What llama-server labels a proxied answer that names no content type.
const DEFAULT_CONTENT_TYPE: &str = "application/json; charset=utf-8";

/// The /cors-proxy routes: the proxy itself when enabled (--ui-mcp-proxy), else 403.
pub fn routes(enabled: bool) -> Router {
    if enabled {
        Router::new().route("/cors-proxy", get(proxy_get).post(proxy_post))
    } else {
        Router::new().route("/cors-proxy", get(feature_disabled).post(feature_disabled))
    }
}

/// llama-server's answer on a route whose feature is off.
pub async fn feature_disabled() -> Response {
    let body = json!({"error": {"message": "this feature is disabled", "type": "feature_disabled"}});
    (StatusCode::FORBIDDEN, Json(body)).into_response()
}

#[derive(Debug, thiserror::Error)]
enum ProxyError {
    #[error("{0}")]
    BadUrl(String),
    #[error("invalid port in target URL")]
    BadPort,
    #[error("HTTPS requested but CPPHTTPLIB_OPENSSL_SUPPORT is not defined")]
    NoTls,
    #[error("{0}")]
    Upstream(String),
}

impl From<ProxyError> for ApiError {
    fn from(e: ProxyError) -> Self {
        match e {
            ProxyError::BadPort => ApiError::invalid(e.to_string()),
            _ => ApiError::server(e.to_string()),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Target {
    scheme: String,
    host: String,
    port: u16,
    /// Path and query, always starting with '/'.
    path: String,
}

impl Target {
    /// The Host header: the port only when it isn't the scheme's default.
    fn authority(&self) -> String {
        let host = if self.host.contains(':') { format!("[{}]", self.host) } else { self.host.clone() };
        let default = (self.scheme == "http" && self.port == 80) || (self.scheme == "https" && self.port == 443);
        if default {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }
}

/// Parses an absolute http(s) URL the way llama-server's proxy does, refusing credentials in it.
fn parse_target(url: &str) -> Result<Target, ProxyError> {
    let bad = |m: String| ProxyError::BadUrl(m);
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("invalid URL: no scheme".into()))?;
    if scheme != "http" && scheme != "https" {
        return Err(bad(format!("unsupported URL scheme: {scheme}")));
    }
    let (userinfo, rest) = match rest.find('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let (authority, path) = match rest.find('/') {
        Some(slash) => (&rest[..slash], &rest[slash..]),
        None => (rest, "/"),
    };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let close = v6.find(']').ok_or_else(|| bad(format!("invalid IPv6 URL authority: {authority}")))?;
        (&v6[..close], v6[close + 1..].strip_prefix(':'))
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port.filter(|p| !p.is_empty()) {
        Some(p) => p.parse().map_err(|_| ProxyError::BadPort)?,
        None if scheme == "http" => 80,
        None => 443,
    };
    if host.is_empty() {
        return Err(bad("invalid target URL: missing host".into()));
    }
    if userinfo.is_some_and(|u| u.split_once(':').is_some_and(|(_, pw)| !pw.is_empty())) {
        return Err(bad("authentication in target URL is not supported".into()));
    }
    Ok(Target { scheme: scheme.into(), host: host.into(), port, path: path.into() })
}

/// The headers to send upstream: only the explicitly named ones, minus those the proxy sets.
fn forwarded_headers(incoming: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    incoming
        .iter()
        .filter_map(|(k, v)| {
            let name = k.as_str().strip_prefix(FORWARD_PREFIX)?;
            if name.is_empty() || matches!(name, "accept-encoding" | "transfer-encoding" | "content-length" | "host") {
                return None;
            }
            Some((HeaderName::from_bytes(name.as_bytes()).ok()?, v.clone()))
        })
        .collect()
}

/// Response headers not passed back: the connection's own, and CORS, which this server sets.
fn strip_response_header(name: &str) -> bool {
    matches!(name, "server" | "transfer-encoding" | "content-length" | "keep-alive" | "connection") || name.starts_with("access-control-")
}

async fn proxy_get(Query(q): Query<HashMap<String, String>>, headers: HeaderMap) -> Result<Response, ApiError> {
    proxy(Method::GET, q, headers, Bytes::new()).await
}

async fn proxy_post(Query(q): Query<HashMap<String, String>>, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    proxy(Method::POST, q, headers, body).await
}

async fn proxy(method: Method, q: HashMap<String, String>, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let mut target = parse_target(q.get("url").map(String::as_str).unwrap_or_default())?;
    let forward = forwarded_headers(&headers);
    let mut method = method;
    let mut body = body;
    for _ in 0..=MAX_REDIRECTS {
        crate::log::info(&format!("srv  proxy: proxying {method} request to {}://{}{}", target.scheme, target.authority(), target.path));
        let res = match send(&method, &target, &forward, body.clone()).await {
            Ok(res) => res,
            Err(ProxyError::Upstream(e)) => return Ok(client_error(&e)),
            Err(e) => return Err(e.into()),
        };
        if res.status().is_redirection() {
            if let Some(next) = res.headers().get(LOCATION).and_then(|l| l.to_str().ok()) {
                target = redirect_target(&target, next)?;
                if res.status() == StatusCode::SEE_OTHER {
                    method = Method::GET;
                    body = Bytes::new();
                }
                continue;
            }
        }
        return Ok(relay(res));
    }
    Ok(client_error("too many redirects"))
}

/// A failed upstream exchange is answered like llama-server's proxy: 500 and a bare text body.
fn client_error(e: &str) -> Response {
    crate::log::warn(&format!("srv  proxy: http client error: {e}"));
    let mut res = Response::new(Body::from(format!("proxy error: {e}")));
    *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    res.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(DEFAULT_CONTENT_TYPE));
    res
}

fn redirect_target(from: &Target, location: &str) -> Result<Target, ProxyError> {
    if location.contains("://") {
        return parse_target(location);
    }
    let path = if location.starts_with('/') {
        location.to_string()
    } else {
        let dir = from.path.split('?').next().unwrap_or("/");
        format!("{}{location}", &dir[..=dir.rfind('/').unwrap_or(0)])
    };
    Ok(Target { path, ..from.clone() })
}

async fn send(
    method: &Method,
    target: &Target,
    forward: &[(HeaderName, HeaderValue)],
    body: Bytes,
) -> Result<hyper::Response<hyper::body::Incoming>, ProxyError> {
    if target.scheme == "https" {
        return Err(ProxyError::NoTls);
    }
    let up = |e: &dyn std::fmt::Display| ProxyError::Upstream(e.to_string());
    let stream = tokio::time::timeout(IO_TIMEOUT, tokio::net::TcpStream::connect((target.host.as_str(), target.port)))
        .await
        .map_err(|_| ProxyError::Upstream("connection timed out".into()))?
        .map_err(|e| up(&e))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| up(&e))?;
    tokio::spawn(conn);
    let mut req = Request::builder().method(method.clone()).uri(target.path.as_str());
    for (k, v) in forward {
        req = req.header(k, v);
    }
    let req = req.header(HOST, target.authority()).body(Full::new(body)).map_err(|e| up(&e))?;
    tokio::time::timeout(IO_TIMEOUT, sender.send_request(req)).await.map_err(|_| ProxyError::Upstream("read timed out".into()))?.map_err(|e| up(&e))
}

fn relay(res: hyper::Response<hyper::body::Incoming>) -> Response {
    let (parts, body) = res.into_parts();
    let mut out = Response::new(Body::new(body));
    *out.status_mut() = parts.status;
    for (k, v) in &parts.headers {
        if !strip_response_header(k.as_str()) {
            out.headers_mut().append(k, v.clone());
        }
    }
    if !out.headers().contains_key(CONTENT_TYPE) {
        out.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(DEFAULT_CONTENT_TYPE));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_targets_like_llama_server() {
        let t = parse_target("http://127.0.0.1:9000/models?x=1").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.path.as_str()), ("127.0.0.1", 9000, "/models?x=1"));
        assert_eq!(t.authority(), "127.0.0.1:9000");
        let t = parse_target("http://example.com").unwrap();
        assert_eq!((t.port, t.path.as_str(), t.authority().as_str()), (80, "/", "example.com"));
        let t = parse_target("https://[::1]:8443/a").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.authority().as_str()), ("::1", 8443, "[::1]:8443"));
        assert!(parse_target("http://user@host/").is_ok());
        let err = |u: &str| parse_target(u).unwrap_err().to_string();
        assert_eq!(err(""), "invalid URL: no scheme");
        assert_eq!(err("ftp://x/"), "unsupported URL scheme: ftp");
        assert_eq!(err("http:///path"), "invalid target URL: missing host");
        assert_eq!(err("http://u:pw@host/"), "authentication in target URL is not supported");
        assert!(matches!(parse_target("http://host:port/"), Err(ProxyError::BadPort)));
    }

    #[test]
    fn forwards_only_explicit_headers() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "Bearer key"),
            ("cookie", "s=1"),
            ("x-api-key", "key"),
            ("x-llama-server-proxy-header-authorization", "Bearer explicit"),
            ("x-llama-server-proxy-header-accept", "application/json"),
            ("x-llama-server-proxy-header-content-length", "5"),
            ("x-llama-server-proxy-header-", "empty"),
        ] {
            h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        let mut got: Vec<_> = forwarded_headers(&h).into_iter().map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_string())).collect();
        got.sort();
        assert_eq!(got, [("accept".to_string(), "application/json".to_string()), ("authorization".into(), "Bearer explicit".into())]);
    }

    #[test]
    fn relative_redirects_resolve_against_the_target() {
        let from = parse_target("http://h:1/a/b?q").unwrap();
        assert_eq!(redirect_target(&from, "/c").unwrap().path, "/c");
        assert_eq!(redirect_target(&from, "c").unwrap().path, "/a/c");
        assert_eq!(redirect_target(&from, "http://o/x").unwrap().host, "o");
    }
}
