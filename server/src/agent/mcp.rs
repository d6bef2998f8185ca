//! MCP servers (Model Context Protocol) as llama-server runs them: each server from the
//! Cursor-style `{"mcpServers": {...}}` config is a child process speaking NDJSON JSON-RPC 2.0
//! over stdio. Warmup spawns each once to list its tools, which /tools then serves as
//! `<server>_<tool>`; a call (re)spawns the server lazily and keeps it for later calls.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use serde_json::{json, Map, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{mpsc, watch, Mutex};
use tokio::task::JoinHandle;
use tokio::time::Instant;

const PROTOCOL_VERSION: &str = "2024-11-05";
const DEFAULT_TIMEOUT_MS: u64 = 30_000;
/// Tool discovery at startup is capped per server so one that never answers can't stall startup.
const WARMUP_TIMEOUT: Duration = Duration::from_secs(10);
/// A server that failed to spawn is not retried before this.
const SPAWN_COOLDOWN: Duration = Duration::from_secs(5);
/// A longer line from a child is dropped, so one that never writes '\n' can't grow memory.
const MAX_LINE_BYTES: usize = 8 * 1024 * 1024;
/// Frames read but not yet consumed; notifications arriving between calls would otherwise pile up.
const MAX_QUEUED_FRAMES: usize = 65_536;
const STDERR_TAIL_BYTES: usize = 4096;
const JSONRPC_INTERNAL_ERROR: i64 = -32603;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("failed to open MCP config file: {0}")]
    Open(String),
    #[error("failed to parse MCP config JSON: {0}")]
    Parse(String),
}

/// One entry of `mcpServers`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    pub name: String,
    pub command: String,
    pub args: Vec<String>,
    /// Set over the inherited environment.
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    /// Per-request limit for every RPC sent to this server.
    pub timeout: Duration,
}

/// Parses `{"mcpServers": {...}}`. No `mcpServers` object means no servers; entries without a
/// command are skipped.
pub fn parse_config(text: &str) -> Result<Vec<ServerConfig>, ConfigError> {
    let root: Value = serde_json::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
    let Some(servers) = root.get("mcpServers").and_then(Value::as_object) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (name, cfg) in servers {
        let sc = parse_entry(name, cfg).map_err(ConfigError::Parse)?;
        if sc.command.is_empty() {
            crate::log::info(&format!("mcp: server '{name}' has no command, skipping"));
            continue;
        }
        out.push(sc);
    }
    Ok(out)
}

fn parse_entry(name: &str, cfg: &Value) -> Result<ServerConfig, String> {
    let string_at = |key: &str| -> Result<String, String> {
        match cfg.get(key) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(format!("server '{name}': \"{key}\" must be a string")),
        }
    };
    let strings =
        |v: &Value, what: &str| -> Result<String, String> { v.as_str().map(String::from).ok_or_else(|| format!("server '{name}': {what} must be strings")) };
    let timeout_ms = match cfg.get("timeout_ms") {
        None | Some(Value::Null) => DEFAULT_TIMEOUT_MS,
        Some(v) => v.as_u64().ok_or_else(|| format!("server '{name}': \"timeout_ms\" must be a non-negative integer"))?,
    };
    let args = match cfg.get("args").and_then(Value::as_array) {
        Some(a) => a.iter().map(|v| strings(v, "args")).collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let env = match cfg.get("env").and_then(Value::as_object) {
        Some(m) => m.iter().map(|(k, v)| Ok((k.clone(), strings(v, "env values")?))).collect::<Result<_, String>>()?,
        None => BTreeMap::new(),
    };
    Ok(ServerConfig { name: name.to_string(), command: string_at("command")?, args, env, cwd: string_at("cwd")?, timeout: Duration::from_millis(timeout_ms) })
}

/// A tool advertised by an MCP server.
#[derive(Debug, Clone)]
pub struct ToolDef {
    pub server: String,
    /// The server's own name for it, without the `<server>_` prefix.
    pub name: String,
    pub description: String,
    pub input_schema: Value,
}

impl ToolDef {
    /// The name /tools lists and calls it by.
    pub fn public_name(&self) -> String {
        format!("{}_{}", self.server, self.name)
    }

    /// The function-calling definition a chat request's `tools` takes.
    pub fn definition(&self) -> Value {
        let parameters = if self.input_schema.is_object() { self.input_schema.clone() } else { json!({}) };
        json!({
            "type": "function",
            "function": {"name": self.public_name(), "description": self.description, "parameters": parameters},
        })
    }
}

/// Normalises a `tools/call` result to the /tools answer: text parts joined by newlines, or an
/// error when the server flagged one.
pub fn result_to_response(result: &Value) -> Value {
    let text = result
        .get("content")
        .and_then(Value::as_array)
        .map(|parts| {
            parts
                .iter()
                .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                .map(|p| p.get("text").and_then(Value::as_str).unwrap_or_default())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default();
    if result.get("isError").and_then(Value::as_bool).unwrap_or(false) {
        let msg = if text.is_empty() { "MCP tool returned an error".to_string() } else { text };
        return json!({"error": msg});
    }
    json!({"plain_text_response": text})
}

fn rpc_error_message(reply: &Value) -> String {
    match reply.get("error") {
        Some(Value::Object(e)) => e.get("message").and_then(Value::as_str).unwrap_or("unknown error").to_string(),
        Some(Value::String(s)) => s.clone(),
        _ => "unknown error".to_string(),
    }
}

fn rpc_failure(message: &str) -> Value {
    json!({"error": {"code": JSONRPC_INTERNAL_ERROR, "message": message}})
}

/// Splits a byte stream into NDJSON lines, bounding how long one line may get.
#[derive(Default)]
struct LineSplitter {
    buf: Vec<u8>,
    /// Inside an over-long line: bytes are dropped up to its newline.
    skipping: bool,
}

impl LineSplitter {
    fn push(&mut self, chunk: &[u8], mut on_line: impl FnMut(String)) {
        for &b in chunk {
            if b == b'\n' {
                if !self.skipping {
                    let mut line = std::mem::take(&mut self.buf);
                    if line.last() == Some(&b'\r') {
                        line.pop();
                    }
                    if !line.is_empty() {
                        on_line(String::from_utf8_lossy(&line).into_owned());
                    }
                }
                self.buf.clear();
                self.skipping = false;
            } else if !self.skipping {
                self.buf.push(b);
                if self.buf.len() > MAX_LINE_BYTES {
                    crate::log::info(&format!("mcp: dropping oversized line (> {MAX_LINE_BYTES} bytes) from child pipe"));
                    self.buf = Vec::new();
                    self.skipping = true;
                }
            }
        }
    }
}

async fn pump_lines(mut src: impl AsyncRead + Unpin, mut on_line: impl FnMut(String)) {
    let mut splitter = LineSplitter::default();
    let mut chunk = vec![0u8; 4096];
    loop {
        match src.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => splitter.push(&chunk[..n], &mut on_line),
        }
    }
}

/// What only the caller holding the session lock may touch.
struct Session {
    stdin: ChildStdin,
    frames: mpsc::Receiver<String>,
    next_id: u64,
    initialized: bool,
    tools: Option<Vec<ToolDef>>,
    last_error: String,
}

/// One running MCP server.
struct StdioTransport {
    name: String,
    timeout: Duration,
    session: Mutex<Session>,
    /// Cleared on stdout EOF, on a failed write and by close(); read without the session lock.
    alive: Arc<AtomicBool>,
    child: StdMutex<Option<Child>>,
    pumps: StdMutex<Vec<JoinHandle<()>>>,
    stderr_tail: Arc<StdMutex<String>>,
}

impl StdioTransport {
    fn spawn(cfg: &ServerConfig) -> std::io::Result<Arc<Self>> {
        let mut cmd = Command::new(&cfg.command);
        cmd.args(&cfg.args).envs(&cfg.env).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        if !cfg.cwd.is_empty() {
            cmd.current_dir(&cfg.cwd);
        }
        let mut child = cmd.spawn()?;
        let (Some(stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take()) else {
            return Err(std::io::Error::other("child pipes missing"));
        };
        let alive = Arc::new(AtomicBool::new(true));
        let (tx, frames) = mpsc::channel(MAX_QUEUED_FRAMES);
        let reader = tokio::spawn({
            let alive = alive.clone();
            async move {
                pump_lines(stdout, |line| {
                    let _ = tx.try_send(line);
                })
                .await;
                alive.store(false, Ordering::SeqCst);
            }
        });
        let stderr_tail = Arc::new(StdMutex::new(String::new()));
        let errlog = tokio::spawn({
            let tail = stderr_tail.clone();
            pump_lines(stderr, move |line| {
                let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                t.push_str(&line);
                t.push('\n');
                if t.len() > STDERR_TAIL_BYTES {
                    let mut cut = t.len() - STDERR_TAIL_BYTES;
                    while !t.is_char_boundary(cut) {
                        cut += 1;
                    }
                    t.drain(..cut);
                }
            })
        });
        Ok(Arc::new(Self {
            name: cfg.name.clone(),
            timeout: cfg.timeout,
            session: Mutex::new(Session { stdin, frames, next_id: 1, initialized: false, tools: None, last_error: String::new() }),
            alive,
            child: StdMutex::new(Some(child)),
            pumps: StdMutex::new(vec![reader, errlog]),
            stderr_tail,
        }))
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    fn diagnostics(&self) -> String {
        let mut out = self.session.try_lock().map(|s| s.last_error.clone()).unwrap_or_default();
        let tail = self.stderr_tail.lock().unwrap_or_else(|e| e.into_inner());
        if !tail.is_empty() {
            if !out.is_empty() {
                out.push_str("; ");
            }
            out.push_str("last stderr: ");
            out.push_str(tail.trim_end());
        }
        out
    }

    /// Kills the child and stops reading its pipes; a grandchild that inherited them can keep
    /// them open, so the readers are aborted rather than left waiting for EOF.
    async fn close(&self) {
        self.alive.store(false, Ordering::SeqCst);
        for pump in self.pumps.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            pump.abort();
        }
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut child) = child {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Sends one request and waits for the reply with its id, skipping notifications, stale
    /// replies of timed-out requests and malformed frames.
    async fn rpc(&self, s: &mut Session, method: &str, params: Option<Value>, stop: &Stop) -> Value {
        let id = s.next_id;
        s.next_id += 1;
        let mut request = json!({"jsonrpc": "2.0", "id": id, "method": method});
        if let Some(p) = params {
            request["params"] = p;
        }
        let exchange = async {
            if !self.write_frame(s, &request).await {
                return rpc_failure("transport closed");
            }
            while let Some(frame) = s.frames.recv().await {
                let Ok(reply) = serde_json::from_str::<Value>(&frame) else { continue };
                if reply.get("id").and_then(Value::as_u64) == Some(id) {
                    return reply;
                }
            }
            rpc_failure("transport closed")
        };
        tokio::select! {
            reply = tokio::time::timeout(self.timeout.min(stop.remaining()), exchange) => {
                reply.unwrap_or_else(|_| rpc_failure("request timed out"))
            }
            _ = stop.cancelled() => rpc_failure("cancelled"),
        }
    }

    async fn write_frame(&self, s: &mut Session, msg: &Value) -> bool {
        let mut line = msg.to_string();
        line.push('\n');
        let ok = s.stdin.write_all(line.as_bytes()).await.is_ok() && s.stdin.flush().await.is_ok();
        if !ok {
            self.alive.store(false, Ordering::SeqCst);
        }
        ok
    }

    async fn ensure_init(&self, s: &mut Session, stop: &Stop) -> bool {
        if s.initialized {
            return true;
        }
        let params = json!({
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "llama.cpp", "version": "1.0"},
        });
        let reply = self.rpc(s, "initialize", Some(params), stop).await;
        if reply.get("result").is_none() {
            s.last_error = format!("initialize failed: {}", rpc_error_message(&reply));
            return false;
        }
        self.write_frame(s, &json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await;
        s.initialized = true;
        true
    }

    async fn list_tools(&self, stop: &Stop) -> Vec<ToolDef> {
        let mut s = self.session.lock().await;
        if !self.ensure_init(&mut s, stop).await {
            return Vec::new();
        }
        if let Some(tools) = &s.tools {
            return tools.clone();
        }
        let reply = self.rpc(&mut s, "tools/list", None, stop).await;
        let Some(result) = reply.get("result") else {
            s.last_error = format!("tools/list failed: {}", rpc_error_message(&reply));
            return Vec::new();
        };
        let str_of = |t: &Value, k: &str| t.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        let tools: Vec<ToolDef> = result
            .get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|t| ToolDef {
                server: self.name.clone(),
                name: str_of(t, "name"),
                description: str_of(t, "description"),
                input_schema: t.get("inputSchema").cloned().unwrap_or(Value::Null),
            })
            .collect();
        s.tools = Some(tools.clone());
        tools
    }

    async fn call_tool(&self, tool: &str, arguments: Value, stop: &Stop) -> Value {
        let mut s = self.session.lock().await;
        if !self.ensure_init(&mut s, stop).await {
            return json!({"error": s.last_error});
        }
        let reply = self.rpc(&mut s, "tools/call", Some(json!({"name": tool, "arguments": arguments})), stop).await;
        if reply.get("error").is_some() {
            return json!({"error": rpc_error_message(&reply)});
        }
        match reply.get("result") {
            Some(result) => result_to_response(result),
            None => json!({"error": "invalid response from MCP server"}),
        }
    }
}

/// Cancels waits on shutdown, and optionally at a deadline.
#[derive(Clone)]
struct Stop {
    shutdown: watch::Receiver<bool>,
    deadline: Option<Instant>,
}

impl Stop {
    fn remaining(&self) -> Duration {
        self.deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()))
    }

    async fn cancelled(&self) {
        let mut rx = self.shutdown.clone();
        if rx.wait_for(|&stopping| stopping).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[derive(Default)]
struct Pool {
    live: HashMap<String, Arc<StdioTransport>>,
    /// Servers that failed to spawn, and when they may be tried again.
    cooling: HashMap<String, Instant>,
}

/// The configured MCP servers, their discovered tools and their running processes.
pub struct McpManager {
    configs: Vec<ServerConfig>,
    registry: Vec<ToolDef>,
    pool: StdMutex<Pool>,
    shutdown: watch::Sender<bool>,
}

impl McpManager {
    /// Reads the config from the file and/or the inline JSON (names must be unique across both),
    /// then lists every server's tools. Config errors are fatal; a server that fails is logged.
    pub async fn start(config_path: &str, config_json: &str) -> Result<Self, ConfigError> {
        let mut configs: Vec<ServerConfig> = Vec::new();
        let mut sources = Vec::new();
        if !config_path.is_empty() {
            let text = std::fs::read_to_string(Path::new(config_path)).map_err(|_| ConfigError::Open(config_path.to_string()))?;
            sources.push(text);
        }
        if !config_json.is_empty() {
            sources.push(config_json.to_string());
        }
        for text in &sources {
            let parsed = parse_config(text)?;
            if parsed.is_empty() {
                crate::log::info("mcp: config: no servers found in JSON");
            }
            for sc in parsed {
                if configs.iter().any(|c| c.name == sc.name) {
                    crate::log::info(&format!("mcp: config: duplicate server name '{}', skipping", sc.name));
                    continue;
                }
                configs.push(sc);
            }
        }
        let (shutdown, _) = watch::channel(false);
        let mut mgr = Self { configs, registry: Vec::new(), pool: StdMutex::default(), shutdown };
        let found = futures_util::future::join_all(mgr.configs.iter().map(|c| mgr.warmup(c))).await;
        mgr.registry = found.into_iter().flatten().collect();
        Ok(mgr)
    }

    async fn warmup(&self, cfg: &ServerConfig) -> Vec<ToolDef> {
        let t = match StdioTransport::spawn(cfg) {
            Ok(t) => t,
            Err(e) => {
                crate::log::warn(&format!("mcp: warmup: failed to spawn '{}': {e}", cfg.name));
                return Vec::new();
            }
        };
        let stop = Stop { shutdown: self.shutdown.subscribe(), deadline: Some(Instant::now() + WARMUP_TIMEOUT) };
        let tools = t.list_tools(&stop).await;
        crate::log::info(&format!("mcp: warmup: '{}' discovered {} tools", cfg.name, tools.len()));
        if tools.is_empty() && !t.diagnostics().is_empty() {
            crate::log::info(&format!("mcp: warmup: '{}': {}", cfg.name, t.diagnostics()));
        }
        t.close().await;
        tools
    }

    /// True when the config named no server.
    pub fn is_empty(&self) -> bool {
        self.configs.is_empty()
    }

    /// The tools found at warmup, in config order.
    pub fn tools(&self) -> &[ToolDef] {
        &self.registry
    }

    /// Calls a tool, (re)spawning its server as needed. Answers the /tools result shape:
    /// `{"plain_text_response": ...}` or `{"error": ...}`.
    pub async fn call_tool(&self, server: &str, tool: &str, arguments: Value) -> Value {
        let Some(t) = self.transport(server).await else {
            return json!({"error": format!("MCP server unavailable: {server}")});
        };
        let stop = Stop { shutdown: self.shutdown.subscribe(), deadline: None };
        t.call_tool(tool, arguments, &stop).await
    }

    /// Makes in-flight calls return and refuses new ones.
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    async fn transport(&self, name: &str) -> Option<Arc<StdioTransport>> {
        let mut retired = None;
        let found = {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            self.pick_or_spawn(&mut pool, name, &mut retired)
        };
        if let Some(old) = retired {
            old.close().await;
        }
        found
    }

    fn pick_or_spawn(&self, pool: &mut Pool, name: &str, retired: &mut Option<Arc<StdioTransport>>) -> Option<Arc<StdioTransport>> {
        if *self.shutdown.borrow() {
            return None;
        }
        let now = Instant::now();
        if let Some(&until) = pool.cooling.get(name) {
            if now < until {
                return None;
            }
            pool.cooling.remove(name);
        }
        if let Some(t) = pool.live.get(name) {
            if t.is_alive() {
                return Some(t.clone());
            }
            crate::log::warn(&format!("mcp: '{name}' is no longer alive: {}", t.diagnostics()));
            *retired = pool.live.remove(name);
        }
        let cfg = self.configs.iter().find(|c| c.name == name)?;
        match StdioTransport::spawn(cfg) {
            Ok(t) => {
                pool.live.insert(name.to_string(), t.clone());
                Some(t)
            }
            Err(e) => {
                crate::log::warn(&format!("mcp: '{name}': failed to start: {e}"));
                pool.cooling.insert(name.to_string(), now + SPAWN_COOLDOWN);
                None
            }
        }
    }

    /// Kills every running server.
    pub async fn close_all(&self) {
        self.shutdown();
        let live: Vec<_> = self.pool.lock().unwrap_or_else(|e| e.into_inner()).live.drain().map(|(_, t)| t).collect();
        for t in live {
            t.close().await;
        }
    }
}

/// Looks a tool up by its public name; that name can't be split, as both halves may contain '_'.
pub fn find_tool<'a>(tools: &'a [ToolDef], public_name: &str) -> Option<&'a ToolDef> {
    tools.iter().find(|t| t.public_name() == public_name)
}

/// The /tools listing entry of an MCP tool, as llama-server writes it.
pub fn listing_entry(def: &ToolDef) -> Value {
    let name = def.public_name();
    let mut m = Map::new();
    m.insert("display_name".into(), json!(name));
    m.insert("tool".into(), json!(name));
    m.insert("type".into(), json!("mcp"));
    m.insert("permissions".into(), json!({"write": false}));
    m.insert("uses_cwd".into(), json!(false));
    m.insert("definition".into(), def.definition());
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_reads_cursor_format() {
        let cfg = parse_config(
            r#"{"mcpServers": {
                "fs": {"command": "npx", "args": ["-y", "srv"], "env": {"A": "1"}, "cwd": "/tmp", "timeout_ms": 500},
                "nocmd": {"args": []},
                "plain": {"command": "x"}
            }}"#,
        )
        .unwrap();
        assert_eq!(cfg.len(), 2);
        assert_eq!(cfg[0].name, "fs");
        assert_eq!(cfg[0].args, ["-y", "srv"]);
        assert_eq!(cfg[0].env.get("A").map(String::as_str), Some("1"));
        assert_eq!(cfg[0].cwd, "/tmp");
        assert_eq!(cfg[0].timeout, Duration::from_millis(500));
        assert_eq!(cfg[1].name, "plain");
        assert_eq!(cfg[1].timeout, Duration::from_millis(DEFAULT_TIMEOUT_MS));
    }

    #[test]
    fn config_without_servers_is_empty_and_bad_json_fails() {
        assert!(parse_config(r#"{"other": 1}"#).unwrap().is_empty());
        assert!(matches!(parse_config("not valid json"), Err(ConfigError::Parse(_))));
        assert!(matches!(parse_config(r#"{"mcpServers": {"a": {"command": "x", "args": [1]}}}"#), Err(ConfigError::Parse(_))));
    }

    #[test]
    fn result_text_parts_are_joined_and_errors_surface() {
        let r = json!({"content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]});
        assert_eq!(result_to_response(&r), json!({"plain_text_response": "a\nb"}));
        assert_eq!(result_to_response(&json!({"isError": true, "content": []})), json!({"error": "MCP tool returned an error"}));
        assert_eq!(result_to_response(&json!({"isError": true, "content": [{"type": "text", "text": "boom"}]})), json!({"error": "boom"}));
    }

    #[test]
    fn splitter_drops_oversized_lines_and_resyncs() {
        let mut s = LineSplitter::default();
        let mut got = Vec::new();
        s.push(b"{\"a\":1}\r\n\n{\"b\"", |l| got.push(l));
        s.push(b":2}\n", |l| got.push(l));
        s.push(&vec![b'x'; MAX_LINE_BYTES + 1], |l| got.push(l));
        s.push(b"tail\nok\n", |l| got.push(l));
        assert_eq!(got, ["{\"a\":1}", "{\"b\":2}", "ok"]);
    }

    #[test]
    fn definition_falls_back_to_empty_schema() {
        let def = ToolDef { server: "my_srv".into(), name: "do_it".into(), description: "d".into(), input_schema: Value::Null };
        assert_eq!(def.definition()["function"]["parameters"], json!({}));
        assert_eq!(def.definition()["function"]["name"], "my_srv_do_it");
        assert!(find_tool(std::slice::from_ref(&def), "my_srv_do_it").is_some());
    }
}
