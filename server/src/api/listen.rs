//! Listening sockets (TCP or a Unix socket), TLS, and the HTTP/1.1 connection settings
//! llama-server's clients expect.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::api::tls::TlsAcceptor;

pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// What every connection gets from llama-server's flags: `--timeout` (read and write),
/// `--reuse-port`, `--threads-http`, and TLS from `--ssl-key-file`/`--ssl-cert-file`.
#[derive(Clone)]
pub struct Http {
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    pub reuse_port: bool,
    /// The runtime's worker threads: `--threads-http`, or llama-server's default pool size.
    pub threads: usize,
    /// Connections served at once: llama-server's HTTP pool grows to its threads + 1024 and
    /// queues the rest; here the rest wait to be accepted.
    pub connections: Arc<tokio::sync::Semaphore>,
    pub tls: Option<TlsAcceptor>,
}

impl Http {
    /// The settings in the parsed parameters' JSON (`n_parallel`: the slots, as llama-server
    /// counts them in router mode too), without TLS: [`Self::with_tls`] reads its files.
    pub fn from_params(cfg: &serde_json::Value, n_parallel: i64) -> Self {
        // llama-server's timeouts are whole seconds; 0 or less leaves a socket without one
        let secs = |key: &str| Duration::from_secs(cfg[key].as_u64().filter(|&s| s > 0).unwrap_or(u32::MAX as u64));
        // llama-server's pool: --threads-http, else the slots + 4 or the cores - 1, the larger
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as i64);
        let threads = cfg["n_threads_http"].as_i64().filter(|&n| n >= 1).unwrap_or((n_parallel + 4).max(cpus - 1)).max(1) as usize;
        Self {
            read_timeout: secs("timeout_read"),
            write_timeout: secs("timeout_write"),
            reuse_port: cfg["reuse_port"].as_bool().unwrap_or(false),
            threads,
            connections: Arc::new(tokio::sync::Semaphore::new(threads + 1024)),
            tls: None,
        }
    }

    /// TLS from `--ssl-key-file` and `--ssl-cert-file`; a bad key or certificate is an error.
    pub fn with_tls(mut self, cfg: &serde_json::Value) -> Result<Self, crate::api::tls::TlsError> {
        let path = |key: &str| cfg[key].as_str().unwrap_or("");
        self.tls = crate::api::tls::acceptor(path("ssl_file_key"), path("ssl_file_cert"))?;
        Ok(self)
    }

    /// The runtime that serves HTTP (and, in router mode, proxies).
    pub fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(self.threads).enable_all().build()?;
        crate::log::srv(strata_ffi::Verbosity::Trace, "init", &format!("using {} threads for HTTP server", rt.metrics().num_workers()));
        Ok(rt)
    }
}

/// What llama-server's set-up of each listener logs about TLS, before it reads the files.
pub fn log_tls(cfg: &serde_json::Value) {
    let (key, cert) = (cfg["ssl_file_key"].as_str().unwrap_or(""), cfg["ssl_file_cert"].as_str().unwrap_or(""));
    let line = if key.is_empty() || cert.is_empty() { "running without SSL".to_string() } else { format!("running with SSL: key = {key}, cert = {cert}") };
    crate::log::srv(strata_ffi::Verbosity::Trace, "init_listene", &line);
}

/// llama-server's check of `--host` and `--port` before it binds: several TCP addresses need a
/// fixed port.
pub fn check_hosts(hosts: &[String], port: i64) -> Result<()> {
    let tcp = hosts.iter().filter(|h| !h.ends_with(".sock")).count();
    if port == 0 && tcp > 1 {
        crate::log::srv(strata_ffi::Verbosity::Error, "init", "--port 0 is not supported with multiple TCP addresses");
        anyhow::bail!("failed to initialize HTTP server");
    }
    Ok(())
}

/// The HTTP server could not start: llama-server's lines (after `why`, where there is one), as
/// an error already logged.
pub fn failed(why: Option<&str>, host: &str, port: i64) -> anyhow::Error {
    use strata_ffi::Verbosity;
    if let Some(why) = why {
        crate::log::srv(Verbosity::Error, "start", why);
    }
    crate::log::srv(Verbosity::Error, "start", &format!("couldn't bind HTTP server socket, hostname: {host}, port: {port}"));
    crate::log::cleaning_up();
    crate::log::srv(Verbosity::Error, "llama_server", "exiting due to HTTP server error");
    crate::log::Logged.into()
}

/// A host that could not be bound.
pub struct BindError {
    pub host: String,
    pub error: anyhow::Error,
}

/// One listener per host, as llama-server binds them: with several TCP addresses an IPv6
/// wildcard does not also claim the IPv4 one.
pub async fn bind_all(hosts: &[String], port: i64, http: &Http) -> Result<Vec<Listener>, BindError> {
    let tcp = hosts.iter().filter(|h| !h.ends_with(".sock")).count();
    let mut out = Vec::with_capacity(hosts.len());
    for host in hosts {
        let bound = match u16::try_from(port) {
            Ok(p) => Listener::bind(host, p, http, tcp > 1).await,
            Err(e) => Err(e.into()),
        };
        out.push(bound.map_err(|error| BindError { host: host.clone(), error })?);
    }
    Ok(out)
}

impl Listener {
    /// A host ending in `.sock` is a Unix socket path, as with llama-server. TCP sockets get
    /// SO_REUSEADDR, and SO_REUSEPORT with `--reuse-port`, as cpp-httplib's do.
    pub async fn bind(host: &str, port: u16, http: &Http, v6only: bool) -> Result<Self> {
        if host.ends_with(".sock") {
            return Ok(Self::Unix(tokio::net::UnixListener::bind(host).with_context(|| host.to_string())?));
        }
        let addr = host.trim_start_matches('[').trim_end_matches(']');
        let mut last = None;
        for sa in tokio::net::lookup_host((addr, port)).await.with_context(|| format!("{host}: no such address"))? {
            match bind_tcp(sa, http.reuse_port, v6only) {
                Ok(l) => return Ok(Self::Tcp(l)),
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or_else(|| anyhow::anyhow!("{host}: no address"), |e| anyhow::Error::from(e).context(format!("{host}:{port}"))))
    }

    pub fn describe(&self, tls: bool) -> Result<String> {
        Ok(match self {
            Self::Tcp(l) => format!("{}://{}", if tls { "https" } else { "http" }, l.local_addr()?),
            Self::Unix(l) => format!("unix://{}", l.local_addr()?.as_pathname().map(|p| p.display().to_string()).unwrap_or_default()),
        })
    }
}

fn bind_tcp(sa: std::net::SocketAddr, reuse_port: bool, v6only: bool) -> std::io::Result<tokio::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(sa), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if sa.is_ipv6() && v6only {
        socket.set_only_v6(true)?;
    }
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&sa.into())?;
    socket.listen(1024)?;
    tokio::net::TcpListener::from_std(socket.into())
}

/// HTTP/1.1 with header names in title case, as llama-server (cpp-httplib) writes them: some
/// clients, the pin's own tests among them, look headers up case-sensitively. A client that
/// does not finish a request head (or a TLS handshake) within the read timeout is disconnected,
/// so idle or trickling connections cannot pile up; one that stops reading for the write
/// timeout while a response waits to be written is disconnected too.
pub async fn accept_loop(listener: Listener, app: axum::Router, http: Http) {
    loop {
        let Ok(permit) = http.connections.clone().acquire_owned().await else { return };
        let accepted = match &listener {
            Listener::Tcp(l) => l.accept().await.map(|(s, _)| serve_connection(s, app.clone(), &http, permit)),
            Listener::Unix(l) => l.accept().await.map(|(s, _)| serve_connection(s, app.clone(), &http, permit)),
        };
        if accepted.is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn serve_connection<S>(stream: S, app: axum::Router, http: &Http, permit: tokio::sync::OwnedSemaphorePermit)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let http = http.clone();
    tokio::spawn(async move {
        let _permit = permit;
        connection(stream, app, &http).await;
    });
}

/// One client connection, served until it ends or a timeout drops it.
async fn connection<S>(stream: S, app: axum::Router, http: &Http)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut stream = tokio_io_timeout::TimeoutStream::new(stream);
    stream.set_write_timeout(Some(http.write_timeout));
    let stream = Box::pin(stream);
    match &http.tls {
        None => serve_http(stream, app, http.read_timeout).await,
        Some(tls) => {
            // a client speaking plain HTTP here fails the handshake and is closed unanswered, as with OpenSSL
            if let Ok(Ok(s)) = tokio::time::timeout(http.read_timeout, tls.accept(stream)).await {
                serve_http(s, app, http.read_timeout).await;
            }
        }
    }
}

async fn serve_http<S>(stream: S, app: axum::Router, read_timeout: Duration)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper_util::service::TowerToHyperService::new(app);
    let io = hyper_util::rt::TokioIo::new(stream);
    let _ = hyper::server::conn::http1::Builder::new()
        .title_case_headers(true)
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(read_timeout)
        .serve_connection(io, svc)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt as _;

    fn http(write_timeout: Duration) -> Http {
        Http {
            read_timeout: Duration::from_secs(60),
            write_timeout,
            reuse_port: false,
            threads: 1,
            connections: Arc::new(tokio::sync::Semaphore::new(1)),
            tls: None,
        }
    }

    /// A client that asks for a large answer and stops reading: the connection ends after the
    /// write timeout, and not before (the same client with a long timeout is still connected).
    #[tokio::test]
    async fn a_client_that_stops_reading_is_dropped_after_the_write_timeout() {
        let app = axum::Router::new().route("/big", axum::routing::get(|| async { "x".repeat(1 << 20) }));
        let mut ends = Vec::new();
        for timeout in [Duration::from_millis(300), Duration::from_secs(60)] {
            let (mut client, server) = tokio::io::duplex(4096);
            let http = http(timeout);
            let app = app.clone();
            let served = tokio::spawn(async move { connection(server, app, &http).await });
            client.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
            ends.push(tokio::time::timeout(Duration::from_secs(3), served).await.is_ok());
            drop(client);
        }
        assert_eq!(ends, [true, false], "dropped with a 300 ms write timeout, still connected with 60 s");
    }
}
