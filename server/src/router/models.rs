//! The router's model registry: which models exist, which child serves each, and the
//! `--models-max` scheduler. A request for a model that is not running joins a FIFO queue (one
//! entry per model, shared by all its requests); the head of the queue loads its model once a
//! slot is free, and idle models are evicted, least recently used first, while queued models
//! outnumber the free slots. A model serving a request, or wanted by a queued one, is never evicted.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{broadcast, mpsc, watch};

use super::child::{CMD_EXIT, CMD_STATE, ENV_CHILD_MODE, ENV_ROUTER_PORT};
use crate::error::ApiError;

const DEFAULT_STOP_TIMEOUT_S: u64 = 10;
const WAIT_SLICE: Duration = Duration::from_millis(200);
const SSE_BACKLOG: usize = 256;
/// With LLAMA_SERVER_DEBUG_FAKE_TIMING set, loads and proxied requests each take this much
/// longer, as in llama-server, so that scheduling can be tested with tiny models.
pub const FAKE_DELAY: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Downloading,
    Downloaded,
    Unloaded,
    Loading,
    Loaded,
    Sleeping,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Downloading => "downloading",
            Self::Downloaded => "downloaded",
            Self::Unloaded => "unloaded",
            Self::Loading => "loading",
            Self::Loaded => "loaded",
            Self::Sleeping => "sleeping",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Meta {
    pub name: String,
    pub source: String,
    pub aliases: BTreeSet<String>,
    pub tags: BTreeSet<String>,
    /// The instance's arguments, without the binary and the port.
    pub base_args: Vec<String>,
    /// The full command line of the last spawn (or the one a spawn would use).
    pub args: Vec<String>,
    pub ini: Option<String>,
    pub port: u16,
    pub status: Status,
    pub last_used: u128,
    pub loaded_info: Value,
    pub exit_code: i32,
    pub stop_timeout: u64,
    pub hidden: bool,
    pub load_on_startup: bool,
    pub architecture: Value,
}

impl Meta {
    pub fn is_running(&self) -> bool {
        matches!(self.status, Status::Loaded | Status::Loading | Status::Sleeping)
    }

    fn is_ready_or_sleep(&self) -> bool {
        matches!(self.status, Status::Loaded | Status::Sleeping)
    }

    pub fn is_failed(&self) -> bool {
        self.status == Status::Unloaded && self.exit_code != 0
    }

    fn from_json(v: &Value) -> Option<Self> {
        let strings = |k: &str| -> Vec<String> { v[k].as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect()).unwrap_or_default() };
        let stop_timeout = match v["stop_timeout"].as_str().unwrap_or("") {
            "" => DEFAULT_STOP_TIMEOUT_S,
            s => s.trim().parse().unwrap_or_else(|_| {
                eprintln!("srv router: invalid stop-timeout value '{s}', using default {DEFAULT_STOP_TIMEOUT_S} seconds");
                DEFAULT_STOP_TIMEOUT_S
            }),
        };
        Some(Self {
            name: v["name"].as_str()?.to_string(),
            source: v["source"].as_str().unwrap_or("preset").to_string(),
            aliases: strings("aliases").into_iter().collect(),
            tags: strings("tags").into_iter().collect(),
            base_args: strings("args"),
            args: Vec::new(),
            ini: v["ini"].as_str().map(String::from),
            port: 0,
            status: Status::Unloaded,
            last_used: 0,
            loaded_info: json!({}),
            exit_code: 0,
            stop_timeout,
            hidden: v["hidden"].as_bool().unwrap_or(false),
            load_on_startup: v["load_on_startup"].as_bool().unwrap_or(false),
            architecture: default_architecture(),
        })
    }

    /// This model's entry in the router's /models.
    pub fn to_json(&self, created: u64) -> Value {
        let mut status = json!({"value": self.status.as_str(), "args": self.args});
        if let Some(ini) = &self.ini {
            status["preset"] = json!(ini);
        }
        if self.is_failed() {
            status["exit_code"] = json!(self.exit_code);
            status["failed"] = json!(true);
        }
        let mut out = json!({
            "id": self.name,
            "aliases": self.aliases,
            "tags": self.tags,
            "object": "model",
            "owned_by": "llamacpp",
            "created": created,
            "status": status,
            "architecture": self.architecture,
            "source": self.source,
            "can_remove": self.source == "cache",
        });
        if self.is_running() {
            if let (Some(o), Some(info)) = (out.as_object_mut(), self.loaded_info.as_object()) {
                for (k, v) in info {
                    o.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
        }
        out
    }
}

fn default_architecture() -> Value {
    json!({"input_modalities": ["text"], "output_modalities": ["text"]})
}

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SpawnMode {
    Normal,
    Download,
}

enum ChildCmd {
    /// Ask the child to exit; force-kill after the timeout.
    Stop {
        send_exit: bool,
        timeout: Duration,
    },
    Kill,
}

struct Instance {
    meta: Meta,
    /// Requests being proxied to it.
    req_count: usize,
    ctl: Option<mpsc::UnboundedSender<ChildCmd>>,
    /// Which spawn this entry belongs to; a late report from an older child is ignored.
    spawn_id: u64,
}

struct QueueEntry {
    name: String,
    waiters: usize,
    /// One of the waiters is loading the model right now.
    loading: bool,
}

#[derive(Default)]
struct Inner {
    models: BTreeMap<String, Instance>,
    /// Asked to stop, still counted as running until their exit is seen.
    stopping: HashSet<String>,
    queue: VecDeque<QueueEntry>,
    need_reload: bool,
    reloading: bool,
    next_spawn: u64,
}

impl Inner {
    fn resolve(&self, name: &str) -> Option<&Instance> {
        self.models.get(name).or_else(|| self.models.values().find(|i| i.meta.aliases.contains(name)))
    }

    fn count_running(&self) -> usize {
        self.models.values().filter(|i| i.meta.is_running()).count()
    }

    fn queued(&self, name: &str) -> bool {
        self.queue.iter().any(|e| e.name == name)
    }
}

#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub bin: PathBuf,
    /// The router's llama.cpp arguments (argv[0] included), the base of every instance's.
    pub llama_args: Vec<String>,
    /// Strata's own flags, passed through to every instance.
    pub strata_args: Vec<String>,
    pub models_dir: String,
    pub models_preset: String,
    pub models_max: i64,
    pub models_autoload: bool,
    pub port: u16,
    pub hf_token: String,
    pub fake_timing: bool,
}

pub struct Models {
    inner: Mutex<Inner>,
    changed: watch::Sender<u64>,
    pub sse: broadcast::Sender<Value>,
    pub cfg: RouterConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("{0}")]
    Models(#[from] strata_ffi::FfiError),
    #[error("{0}")]
    Config(String),
}

impl Models {
    pub async fn new(cfg: RouterConfig) -> Result<Arc<Self>, RouterError> {
        let (sse, _) = broadcast::channel(SSE_BACKLOG);
        let models = Arc::new(Self { inner: Mutex::default(), changed: watch::channel(0).0, sse, cfg });
        models.load_models().await?;
        Ok(models)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    async fn wait_change(&self, rx: &mut watch::Receiver<u64>) {
        let _ = tokio::time::timeout(WAIT_SLICE, rx.changed()).await;
    }

    pub fn notify_sse(&self, event: &str, model: &str, data: Option<Value>) {
        let mut msg = json!({"model": model, "event": event});
        if let Some(d) = data {
            msg["data"] = d;
        }
        let _ = self.sse.send(msg);
    }

    fn read_sources(&self) -> Result<Vec<Meta>, RouterError> {
        let list = strata_ffi::router_models(&self.cfg.llama_args, &self.cfg.models_dir, &self.cfg.models_preset)?;
        let mut out: Vec<Meta> = list.as_array().map(|a| a.iter().filter_map(Meta::from_json).collect()).unwrap_or_default();
        for m in &mut out {
            m.args = self.command_line(&m.base_args, m.port);
        }
        Ok(out)
    }

    fn command_line(&self, base: &[String], port: u16) -> Vec<String> {
        let mut args = vec![self.cfg.bin.to_string_lossy().into_owned()];
        args.extend(base.iter().cloned());
        args.extend(["--port".to_string(), port.to_string()]);
        args.extend(self.cfg.strata_args.iter().cloned());
        args
    }

    /// (Re)reads the model list. On a reload, running models whose source changed or went
    /// away are unloaded first; models that are not running take their new settings.
    pub async fn load_models(self: &Arc<Self>) -> Result<(), RouterError> {
        let this = self.clone();
        let fresh = tokio::task::spawn_blocking(move || this.read_sources()).await.map_err(|e| RouterError::Config(e.to_string()))??;
        let first = {
            let mut inner = self.lock();
            inner.need_reload = false;
            inner.models.is_empty()
        };
        if first {
            let mut inner = self.lock();
            for m in fresh {
                check_names(&inner, &m).map_err(RouterError::Config)?;
                inner.models.insert(m.name.clone(), Instance { meta: m, req_count: 0, ctl: None, spawn_id: 0 });
            }
            let startup = inner.models.values().filter(|i| i.meta.load_on_startup).count();
            if self.cfg.models_max > 0 && startup as i64 > self.cfg.models_max {
                return Err(RouterError::Config(format!("number of models to load on startup ({startup}) exceeds models_max ({})", self.cfg.models_max)));
            }
            log_models(&inner);
            return Ok(());
        }

        let by_name: BTreeMap<String, Meta> = fresh.into_iter().map(|m| (m.name.clone(), m)).collect();
        let to_unload: Vec<String> = {
            let mut inner = self.lock();
            inner.reloading = true;
            inner
                .models
                .values()
                .filter(|i| i.meta.is_running())
                .filter(|i| by_name.get(&i.meta.name).is_none_or(|m| m.base_args != i.meta.base_args))
                .map(|i| i.meta.name.clone())
                .collect()
        };
        for name in &to_unload {
            eprintln!("srv router: (reload) unloading model name={name} (source updated or removed)");
            self.unload(name).await;
        }
        let mut rx = self.changed.subscribe();
        while self.lock().models.iter().any(|(n, i)| to_unload.contains(n) && i.meta.is_running()) {
            self.wait_change(&mut rx).await;
        }
        {
            let mut inner = self.lock();
            inner.models.retain(|name, i| match i.meta.status {
                Status::Downloading => true,
                Status::Downloaded => false,
                _ => by_name.contains_key(name),
            });
            for (name, fresh) in &by_name {
                match inner.models.get(name).map(|i| i.meta.is_running() || i.meta.status == Status::Downloading) {
                    Some(true) => {}
                    Some(false) => {
                        let mut m = fresh.clone();
                        inner.models.remove(name);
                        m.aliases.retain(|a| !inner.models.contains_key(a) && !inner.models.values().any(|i| i.meta.aliases.contains(a)));
                        inner.models.insert(name.clone(), Instance { meta: m, req_count: 0, ctl: None, spawn_id: 0 });
                    }
                    None => {
                        if let Err(e) = check_names(&inner, fresh) {
                            eprintln!("srv router: (reload) {e}, skipping");
                            continue;
                        }
                        inner.models.insert(name.clone(), Instance { meta: fresh.clone(), req_count: 0, ctl: None, spawn_id: 0 });
                    }
                }
            }
            inner.reloading = false;
            log_models(&inner);
        }
        self.bump();
        self.notify_sse("models_reload", "*", None);
        Ok(())
    }

    /// Starts the models marked load-on-startup.
    pub async fn load_startup_models(self: &Arc<Self>) {
        let names: Vec<String> = self.lock().models.values().filter(|i| i.meta.load_on_startup).map(|i| i.meta.name.clone()).collect();
        for name in names {
            eprintln!("srv router: (startup) loading model {name}");
            if let Err(e) = self.load(&name).await {
                eprintln!("srv router: (startup) {name}: {}", e.message);
            }
        }
    }

    async fn reload_if_needed(self: &Arc<Self>) {
        if self.lock().need_reload {
            if let Err(e) = self.load_models().await {
                eprintln!("srv router: reloading the model list failed: {e}");
            }
        }
    }

    pub fn has_model(&self, name: &str) -> bool {
        self.lock().resolve(name).is_some()
    }

    pub async fn get_meta(self: &Arc<Self>, name: &str) -> Option<Meta> {
        self.reload_if_needed().await;
        self.lock().resolve(name).map(|i| i.meta.clone())
    }

    pub async fn all_meta(self: &Arc<Self>) -> Vec<Meta> {
        self.reload_if_needed().await;
        self.lock().models.values().map(|i| i.meta.clone()).collect()
    }

    fn has_capacity(&self, inner: &Inner) -> bool {
        self.cfg.models_max <= 0 || (inner.count_running() as i64) < self.cfg.models_max
    }

    fn pick_victim(&self, inner: &Inner) -> Option<String> {
        inner
            .models
            .values()
            .filter(|i| i.req_count == 0 && i.meta.is_ready_or_sleep())
            .filter(|i| !inner.stopping.contains(&i.meta.name) && !inner.queued(&i.meta.name))
            .min_by_key(|i| i.meta.last_used)
            .map(|i| i.meta.name.clone())
    }

    /// Evicts idle models while queued requests outnumber the slots free or being freed.
    fn tick(&self, inner: &mut Inner) {
        if self.cfg.models_max <= 0 || inner.queue.is_empty() {
            return;
        }
        let running = inner.count_running() as i64;
        let stopping = inner.models.values().filter(|i| i.meta.is_running() && inner.stopping.contains(&i.meta.name)).count() as i64;
        let needed = inner.queue.iter().filter(|e| !e.loading).count() as i64;
        let claimed = inner.queue.iter().filter(|e| e.loading && inner.models.get(&e.name).is_some_and(|i| !i.meta.is_running())).count() as i64;
        let mut free = self.cfg.models_max - running + stopping - claimed;
        while free < needed {
            let Some(victim) = self.pick_victim(inner) else { return };
            eprintln!("srv router: evicting idle LRU name={victim} for a queued request");
            self.request_stop(inner, &victim, true);
            free += 1;
        }
    }

    fn join_queue(&self, inner: &mut Inner, name: &str) {
        if let Some(e) = inner.queue.iter_mut().find(|e| e.name == name) {
            e.waiters += 1;
        } else {
            inner.queue.push_back(QueueEntry { name: name.to_string(), waiters: 1, loading: false });
        }
        self.tick(inner);
    }

    fn leave_queue(&self, inner: &mut Inner, name: &str) {
        if let Some(pos) = inner.queue.iter().position(|e| e.name == name) {
            inner.queue[pos].waiters -= 1;
            if inner.queue[pos].waiters == 0 {
                inner.queue.remove(pos);
            }
        }
        self.tick(inner);
    }

    fn try_claim(&self, inner: &mut Inner, name: &str) -> bool {
        let head_is_ours = inner.queue.front().is_some_and(|e| e.name == name && !e.loading);
        if !head_is_ours || !self.has_capacity(inner) {
            return false;
        }
        if let Some(e) = inner.queue.front_mut() {
            e.loading = true;
        }
        true
    }

    fn request_stop(&self, inner: &mut Inner, name: &str, send_exit: bool) {
        let Some(inst) = inner.models.get(name) else { return };
        if inner.stopping.contains(name) {
            return;
        }
        let timeout = Duration::from_secs(inst.meta.stop_timeout);
        if let Some(ctl) = &inst.ctl {
            let _ = ctl.send(ChildCmd::Stop { send_exit, timeout });
        }
        inner.stopping.insert(name.to_string());
    }

    /// Frees a slot for a direct load when the limit is reached, waiting for the victim to exit.
    async fn unload_lru(self: &Arc<Self>) {
        if self.cfg.models_max <= 0 {
            return;
        }
        let victim = {
            let inner = self.lock();
            if self.has_capacity(&inner) {
                return;
            }
            self.pick_victim(&inner)
        };
        let Some(victim) = victim else { return };
        eprintln!("srv router: models_max limit reached, removing LRU name={victim}");
        self.unload(&victim).await;
        let mut rx = self.changed.subscribe();
        while self.lock().models.get(&victim).is_some_and(|i| i.meta.status != Status::Unloaded) {
            self.wait_change(&mut rx).await;
        }
    }

    pub async fn load(self: &Arc<Self>, name: &str) -> Result<(), ApiError> {
        if self.cfg.fake_timing {
            tokio::time::sleep(FAKE_DELAY).await;
        }
        if !self.has_model(name) {
            return Err(ApiError::server(format!("model name={name} is not found")));
        }
        self.unload_lru().await;
        let mut rx = self.changed.subscribe();
        while self.lock().reloading {
            self.wait_change(&mut rx).await;
        }
        let mut inner = self.lock();
        let Some(inst) = inner.models.get(name) else { return Ok(()) };
        if inst.meta.status != Status::Unloaded {
            eprintln!("srv router: model {name} is not ready");
            return Ok(());
        }
        if self.cfg.models_max > 0 && inner.count_running() as i64 >= self.cfg.models_max {
            return Err(ApiError::server("model limit reached, try again later"));
        }
        let meta = inst.meta.clone();
        self.spawn(&mut inner, meta, SpawnMode::Normal)
    }

    /// Starts a child that downloads a Hugging Face model into the cache.
    pub fn start_download(self: &Arc<Self>, repo: &str) -> Result<(), ApiError> {
        let meta = Meta {
            name: repo.to_string(),
            source: "cache".into(),
            aliases: BTreeSet::new(),
            tags: BTreeSet::new(),
            base_args: vec!["--host".into(), "127.0.0.1".into(), "--alias".into(), repo.to_string()],
            args: Vec::new(),
            ini: None,
            port: 0,
            status: Status::Unloaded,
            last_used: 0,
            loaded_info: json!({}),
            exit_code: 0,
            stop_timeout: DEFAULT_STOP_TIMEOUT_S,
            hidden: false,
            load_on_startup: false,
            architecture: default_architecture(),
        };
        let mut inner = self.lock();
        self.spawn(&mut inner, meta, SpawnMode::Download)
    }

    fn spawn(self: &Arc<Self>, inner: &mut Inner, mut meta: Meta, mode: SpawnMode) -> Result<(), ApiError> {
        let port = free_port().ok_or_else(|| ApiError::server("failed to get a port number"))?;
        meta.port = port;
        meta.status = if mode == SpawnMode::Download { Status::Downloading } else { Status::Loading };
        meta.loaded_info = json!({});
        meta.last_used = now_ms();
        meta.args = self.command_line(&meta.base_args, port);
        eprintln!("srv router: spawning server instance with name={} on port {port}", meta.name);
        eprintln!("srv router: spawning server instance with args:\n  {}", meta.args.join("\n  "));

        let mut cmd = tokio::process::Command::new(&meta.args[0]);
        cmd.args(&meta.args[1..])
            .env(ENV_ROUTER_PORT, self.cfg.port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if mode == SpawnMode::Download {
            cmd.env(ENV_CHILD_MODE, "download").env("LLAMA_ARG_HF_REPO", &meta.name);
        }
        let child = cmd.spawn().map_err(|e| ApiError::server(format!("failed to spawn server instance: {e}")))?;

        if let Some(old) = inner.models.get(&meta.name).and_then(|i| i.ctl.as_ref()) {
            let _ = old.send(ChildCmd::Kill);
        }
        inner.next_spawn += 1;
        let spawn_id = inner.next_spawn;
        let (ctl, ctl_rx) = mpsc::unbounded_channel();
        let name = meta.name.clone();
        self.notify_sse("model_status", &name, Some(json!({"status": meta.status.as_str()})));
        inner.models.insert(name.clone(), Instance { meta, req_count: 0, ctl: Some(ctl), spawn_id });
        tokio::spawn(self.clone().watch_child(name, spawn_id, port, child, ctl_rx, mode));
        self.bump();
        Ok(())
    }

    /// Forwards the child's logs, handles its state messages and stop requests, and records its exit.
    async fn watch_child(
        self: Arc<Self>,
        name: String,
        spawn_id: u64,
        port: u16,
        mut child: tokio::process::Child,
        mut ctl: mpsc::UnboundedReceiver<ChildCmd>,
        mode: SpawnMode,
    ) {
        let mut stdin = child.stdin.take();
        let mut stdout = child.stdout.take().map(|s| BufReader::new(s).lines());
        let mut stderr = child.stderr.take().map(|s| BufReader::new(s).lines());
        let mut deadline: Option<tokio::time::Instant> = None;
        let status = loop {
            tokio::select! {
                line = async { stdout.as_mut().unwrap().next_line().await }, if stdout.is_some() => match line {
                    Ok(Some(l)) => match l.strip_prefix(CMD_STATE) {
                        Some(msg) => self.handle_child_state(&name, spawn_id, msg),
                        None => eprintln!("srv router: [{port:5}] unexpected output on the command pipe: {l}"),
                    },
                    _ => stdout = None,
                },
                line = async { stderr.as_mut().unwrap().next_line().await }, if stderr.is_some() => match line {
                    Ok(Some(l)) => eprintln!("[{port:5}] {l}"),
                    _ => stderr = None,
                },
                cmd = ctl.recv() => match cmd {
                    Some(ChildCmd::Stop { send_exit, timeout }) => {
                        if send_exit {
                            if let Some(w) = stdin.as_mut() {
                                let _ = w.write_all(format!("{CMD_EXIT}\n").as_bytes()).await;
                                let _ = w.flush().await;
                            }
                        }
                        deadline = Some(tokio::time::Instant::now() + timeout);
                    }
                    Some(ChildCmd::Kill) => {
                        let _ = child.start_kill();
                    }
                    None => {
                        let _ = child.start_kill();
                    }
                },
                _ = async { tokio::time::sleep_until(deadline.unwrap()).await }, if deadline.is_some() => {
                    eprintln!("srv router: force-killing model instance name={name} after timeout");
                    let _ = child.start_kill();
                    deadline = None;
                }
                st = child.wait() => break st,
            }
        };
        while let Some(Ok(Some(l))) = match stderr.as_mut() {
            Some(s) => Some(s.next_line().await),
            None => None,
        } {
            eprintln!("[{port:5}] {l}");
        }
        let code = status.ok().and_then(|s| s.code()).unwrap_or(1);
        eprintln!("srv router: instance name={name} exited with status {code}");
        self.on_child_exit(&name, spawn_id, mode, code);
    }

    fn on_child_exit(&self, name: &str, spawn_id: u64, mode: SpawnMode, code: i32) {
        let mut inner = self.lock();
        let current = inner.models.get(name).is_some_and(|i| i.spawn_id == spawn_id);
        if !current || mode == SpawnMode::Download {
            inner.stopping.remove(name);
            drop(inner);
            self.bump();
            return;
        }
        drop(inner);
        self.update_status(name, Status::Unloaded, code, None, None);
    }

    fn handle_child_state(&self, name: &str, spawn_id: u64, msg: &str) {
        let Ok(data) = serde_json::from_str::<Value>(msg) else {
            eprintln!("srv router: failed to parse child state update for name={name}: {msg}");
            return;
        };
        if self.lock().models.get(name).is_none_or(|i| i.spawn_id != spawn_id) {
            return;
        }
        let payload = data.get("payload").cloned().unwrap_or(json!({}));
        match data["state"].as_str().unwrap_or("") {
            "downloading" => match payload["result"].as_str() {
                Some(r @ ("download_finished" | "download_failed")) => {
                    {
                        let mut inner = self.lock();
                        if let Some(i) = inner.models.get_mut(name) {
                            i.meta.status = Status::Downloaded;
                            if let Some(ctl) = &i.ctl {
                                let _ = ctl.send(ChildCmd::Stop { send_exit: true, timeout: Duration::from_secs(i.meta.stop_timeout) });
                            }
                        }
                        inner.need_reload = true;
                    }
                    self.bump();
                    self.notify_sse(r, name, None);
                }
                _ => {
                    let url = payload["url"].as_str().unwrap_or("").to_string();
                    if url.is_empty() {
                        return;
                    }
                    let info = {
                        let mut inner = self.lock();
                        let Some(i) = inner.models.get_mut(name) else { return };
                        i.meta.loaded_info["progress"][url] = json!({"done": payload["downloaded"], "total": payload["total"]});
                        i.meta.loaded_info.clone()
                    };
                    self.notify_sse("download_progress", name, Some(info));
                }
            },
            "loading" => self.update_status(name, Status::Loading, 0, None, Some(payload)),
            "ready" => {
                let info = payload.as_object().is_some_and(|o| !o.is_empty()).then_some(payload);
                self.update_status(name, Status::Loaded, 0, info, Some(json!({})));
            }
            "sleeping" => self.update_status(name, Status::Sleeping, 0, None, None),
            other => eprintln!("srv router: unexpected state '{other}' from model instance name={name}"),
        }
    }

    fn update_status(&self, name: &str, status: Status, exit_code: i32, loaded_info: Option<Value>, progress: Option<Value>) {
        {
            let mut inner = self.lock();
            if let Some(i) = inner.models.get_mut(name) {
                i.meta.status = status;
                i.meta.exit_code = exit_code;
                if let Some(info) = &loaded_info {
                    i.meta.loaded_info = info.clone();
                    for key in ["input_modalities", "output_modalities"] {
                        let m = &info["architecture"][key];
                        if m.as_array().is_some_and(|a| a.iter().all(Value::is_string)) {
                            i.meta.architecture[key] = m.clone();
                        }
                    }
                }
                if status == Status::Unloaded {
                    inner.stopping.remove(name);
                    if let Some(i) = inner.models.get_mut(name) {
                        i.ctl = None;
                    }
                }
                self.tick(&mut inner);
            }
        }
        let mut data = json!({"status": status.as_str()});
        if status == Status::Unloaded {
            data["exit_code"] = json!(exit_code);
        }
        if let Some(info) = loaded_info {
            data["info"] = info;
        }
        if let Some(p) = progress.filter(|p| !p.is_null()) {
            data["progress"] = p;
        }
        self.notify_sse("status_change", name, Some(data));
        self.bump();
    }

    pub async fn unload(self: &Arc<Self>, name: &str) {
        let mut rx = self.changed.subscribe();
        let downloading = {
            let mut inner = self.lock();
            let Some(inst) = inner.models.get(name) else { return };
            match inst.meta.status {
                Status::Downloading => {
                    eprintln!("srv router: cancelling download for model name={name}");
                    if let Some(ctl) = &inst.ctl {
                        let _ = ctl.send(ChildCmd::Stop { send_exit: true, timeout: Duration::from_secs(inst.meta.stop_timeout) });
                    }
                    true
                }
                _ if inst.meta.is_running() => {
                    eprintln!("srv router: stopping model instance name={name}");
                    let loading = inst.meta.status == Status::Loading;
                    if loading {
                        eprintln!("srv router: model name={name} is still loading, force-killing");
                        if let Some(ctl) = &inst.ctl {
                            let _ = ctl.send(ChildCmd::Kill);
                        }
                    }
                    self.request_stop(&mut inner, name, !loading);
                    false
                }
                _ => {
                    eprintln!("srv router: model instance name={name} is not running");
                    false
                }
            }
        };
        while downloading && self.lock().models.get(name).is_some_and(|i| i.meta.status == Status::Downloading) {
            self.wait_change(&mut rx).await;
        }
    }

    pub async fn unload_all(self: &Arc<Self>) {
        let names: Vec<String> = self.lock().models.keys().cloned().collect();
        for name in &names {
            self.unload(name).await;
        }
        let mut rx = self.changed.subscribe();
        while self.lock().models.values().any(|i| i.meta.is_running() || i.meta.status == Status::Downloading) {
            self.wait_change(&mut rx).await;
        }
    }

    /// Stops a cache model and deletes its files.
    pub async fn remove(self: &Arc<Self>, name: &str) -> Result<(), ApiError> {
        {
            let inner = self.lock();
            let inst = inner.models.get(name).ok_or_else(|| ApiError::server(format!("model name={name} is not found")))?;
            if inst.meta.source != "cache" {
                return Err(ApiError::server(format!("model name={name} is not removable (not from cache)")));
            }
        }
        self.unload(name).await;
        let mut rx = self.changed.subscribe();
        while self.lock().models.get(name).is_some_and(|i| !matches!(i.meta.status, Status::Unloaded | Status::Downloaded)) {
            self.wait_change(&mut rx).await;
        }
        let repo = name.to_string();
        let ok = tokio::task::spawn_blocking(move || strata_ffi::router_remove_cached(&repo)).await.unwrap_or(false);
        self.lock().models.remove(name);
        eprintln!("srv router: removing model name={name} from cache ({})", if ok { "succeeded" } else { "partial" });
        self.bump();
        self.notify_sse("model_remove", name, None);
        Ok(())
    }

    /// Makes sure the model is running, loading it (through the queue when --models-max is
    /// reached) and waiting until it is ready. Hold the ticket until the request is under way
    /// (`begin_request`): while it lives the model stays queued, so it cannot be evicted.
    pub async fn ensure_ready(self: &Arc<Self>, name: &str) -> Result<ReadyTicket, ApiError> {
        let meta = self.get_meta(name).await.ok_or_else(|| ApiError::server(format!("model name={name} is not found")))?;
        let mut rx = self.changed.subscribe();
        let mut slot = QueueSlot { models: self.clone(), name: meta.name.clone(), queued: false };
        {
            let mut inner = self.lock();
            let stopping = inner.stopping.contains(&meta.name);
            if !stopping && meta.is_ready_or_sleep() {
                return Ok(ReadyTicket { _slot: slot });
            }
            if inner.models.get(&meta.name).is_some_and(|i| i.meta.status == Status::Unloaded) {
                self.join_queue(&mut inner, &meta.name);
                slot.queued = true;
            }
        }
        eprintln!("srv router: waiting until model name={} is fully loaded...", meta.name);
        let (mut did_load, mut saw_loading) = (false, false);
        loop {
            let claim = {
                let mut inner = self.lock();
                let Some(inst) = inner.models.get(&slot.name) else { break };
                let status = inst.meta.status;
                let failed = inst.meta.is_failed();
                if inner.stopping.contains(&slot.name) {
                    if !slot.queued {
                        self.join_queue(&mut inner, &slot.name);
                        slot.queued = true;
                    }
                    false
                } else {
                    match status {
                        Status::Loaded | Status::Sleeping | Status::Downloading | Status::Downloaded => break,
                        Status::Loading => saw_loading = true,
                        Status::Unloaded if did_load || saw_loading => {
                            if failed {
                                return Err(ApiError::server(format!("model name={} failed to load", slot.name)));
                            }
                            break;
                        }
                        Status::Unloaded if !slot.queued => break,
                        Status::Unloaded => {}
                    }
                    status == Status::Unloaded && self.try_claim(&mut inner, &slot.name)
                }
            };
            if claim {
                eprintln!("srv router: slot available, loading queued model name={}", slot.name);
                let ok = match self.load(&slot.name).await {
                    Ok(()) => true,
                    Err(e) => {
                        eprintln!("srv router: queued load of name={} did not go through: {}", slot.name, e.message);
                        false
                    }
                };
                did_load |= ok;
                let mut inner = self.lock();
                if !ok {
                    if let Some(e) = inner.queue.iter_mut().find(|e| e.name == slot.name) {
                        e.loading = false;
                    }
                }
                self.tick(&mut inner);
                continue;
            }
            self.wait_change(&mut rx).await;
        }
        Ok(ReadyTicket { _slot: slot })
    }

    /// Marks a request as in flight on the model; the guard ends it.
    pub fn begin_request(self: &Arc<Self>, name: &str, update_last_used: bool) -> Result<(u16, RequestGuard), ApiError> {
        let mut inner = self.lock();
        let inst = inner.models.get_mut(name).ok_or_else(|| ApiError::server(format!("model name={name} is not found")))?;
        if !inst.meta.is_running() {
            return Err(ApiError::invalid(format!("model name={name} is not running")));
        }
        if update_last_used {
            inst.meta.last_used = now_ms();
        }
        inst.req_count += 1;
        Ok((inst.meta.port, RequestGuard { models: self.clone(), name: name.to_string() }))
    }
}

/// See `Models::ensure_ready`.
pub struct ReadyTicket {
    _slot: QueueSlot,
}

/// Leaves the load queue when a waiting request ends, however it ends (the client may go away).
struct QueueSlot {
    models: Arc<Models>,
    name: String,
    queued: bool,
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        if self.queued {
            let mut inner = self.models.lock();
            self.models.leave_queue(&mut inner, &self.name);
            drop(inner);
            self.models.bump();
        }
    }
}

/// One request proxied to a model; while any is alive the model is not evicted.
pub struct RequestGuard {
    models: Arc<Models>,
    name: String,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        let mut inner = self.models.lock();
        if let Some(i) = inner.models.get_mut(&self.name) {
            i.req_count = i.req_count.saturating_sub(1);
            if i.req_count == 0 {
                self.models.tick(&mut inner);
            }
        }
        drop(inner);
        self.models.bump();
    }
}

fn check_names(inner: &Inner, m: &Meta) -> Result<(), String> {
    if inner.models.contains_key(&m.name) {
        return Err(format!("model '{}' appears multiple times", m.name));
    }
    if let Some(other) = inner.models.values().find(|i| i.meta.aliases.contains(&m.name)) {
        return Err(format!("model name '{}' conflicts with alias of model '{}'", m.name, other.meta.name));
    }
    for alias in &m.aliases {
        if inner.models.contains_key(alias) {
            return Err(format!("alias '{alias}' for model '{}' conflicts with existing model name", m.name));
        }
        if let Some(other) = inner.models.values().find(|i| i.meta.aliases.contains(alias)) {
            return Err(format!("alias '{alias}' for model '{}' conflicts with alias of model '{}'", m.name, other.meta.name));
        }
    }
    Ok(())
}

fn log_models(inner: &Inner) {
    eprintln!("srv router: Available models ({}):", inner.models.len());
    if inner.models.is_empty() {
        eprintln!("srv router:   no models found on the system");
    }
    for i in inner.models.values() {
        let mut extra = String::new();
        if !i.meta.aliases.is_empty() {
            extra += &format!(" (aliases: {})", i.meta.aliases.iter().cloned().collect::<Vec<_>>().join(", "));
        }
        if !i.meta.tags.is_empty() {
            extra += &format!(" [tags: {}]", i.meta.tags.iter().cloned().collect::<Vec<_>>().join(", "));
        }
        eprintln!("srv router:   [{:>10}] {}{extra}", i.meta.source, i.meta.name);
    }
}

/// A loopback port nothing listens on now, as llama-server picks one for each instance.
fn free_port() -> Option<u16> {
    std::net::TcpListener::bind(("127.0.0.1", 0)).ok()?.local_addr().ok().map(|a| a.port())
}
