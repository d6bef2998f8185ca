//! Listening sockets (TCP or a Unix socket) and the HTTP/1.1 connection settings llama-server's
//! clients expect.

use anyhow::{Context as _, Result};

pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

impl Listener {
    /// A host ending in `.sock` is a Unix socket path, as with llama-server.
    pub async fn bind(host: &str, port: u16) -> Result<Self> {
        if host.ends_with(".sock") {
            let l = tokio::net::UnixListener::bind(host).with_context(|| format!("couldn't bind HTTP server socket, hostname: {host}"))?;
            return Ok(Self::Unix(l));
        }
        let addr = host.trim_start_matches('[').trim_end_matches(']');
        let l =
            tokio::net::TcpListener::bind((addr, port)).await.with_context(|| format!("couldn't bind HTTP server socket, hostname: {host}, port: {port}"))?;
        Ok(Self::Tcp(l))
    }

    pub fn describe(&self) -> Result<String> {
        Ok(match self {
            Self::Tcp(l) => format!("http://{}", l.local_addr()?),
            Self::Unix(l) => format!("unix://{}", l.local_addr()?.as_pathname().map(|p| p.display().to_string()).unwrap_or_default()),
        })
    }
}

/// The read timeout of `--timeout` (llama-server's, 600 s by default), in the config's JSON.
pub fn read_timeout(cfg: &serde_json::Value) -> std::time::Duration {
    std::time::Duration::from_secs(cfg["timeout_read"].as_u64().filter(|&s| s > 0).unwrap_or(600))
}

/// HTTP/1.1 with header names in title case, as llama-server (cpp-httplib) writes them: some
/// clients, the pin's own tests among them, look headers up case-sensitively. A client that
/// does not finish a request head within `read_timeout` is disconnected, so idle or trickling
/// connections cannot pile up.
pub async fn accept_loop(listener: Listener, app: axum::Router, read_timeout: std::time::Duration) {
    loop {
        let accepted = match &listener {
            Listener::Tcp(l) => l.accept().await.map(|(s, _)| serve_connection(s, app.clone(), read_timeout)),
            Listener::Unix(l) => l.accept().await.map(|(s, _)| serve_connection(s, app.clone(), read_timeout)),
        };
        if accepted.is_err() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

fn serve_connection<S>(stream: S, app: axum::Router, read_timeout: std::time::Duration)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper_util::service::TowerToHyperService::new(app);
    tokio::spawn(async move {
        let io = hyper_util::rt::TokioIo::new(stream);
        let _ = hyper::server::conn::http1::Builder::new()
            .title_case_headers(true)
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(read_timeout)
            .serve_connection(io, svc)
            .await;
    });
}
