//! The router's model registry: which models exist, which child serves each, and the
//! `--models-max` scheduler. A request for a model that is not running joins a FIFO queue (one
//! entry per model, shared by all its requests); the head of the queue loads its model once a
//! slot is free, and idle models are evicted, least recently used first, while queued models
//! outnumber the free slots. A model serving a request, or wanted by a queued one, is never evicted.

mod instances;

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc, watch};

use crate::api::error::ApiError;

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
                crate::log::warn(&format!("srv router: invalid stop-timeout value '{s}', using default {DEFAULT_STOP_TIMEOUT_S} seconds"));
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
            crate::log::info(&format!("srv router: (reload) unloading model name={name} (source updated or removed)"));
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
                            crate::log::info(&format!("srv router: (reload) {e}, skipping"));
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
            crate::log::info(&format!("srv router: (startup) loading model {name}"));
            if let Err(e) = self.load(&name).await {
                crate::log::info(&format!("srv router: (startup) {name}: {}", e.message));
            }
        }
    }

    async fn reload_if_needed(self: &Arc<Self>) {
        if self.lock().need_reload {
            if let Err(e) = self.load_models().await {
                crate::log::warn(&format!("srv router: reloading the model list failed: {e}"));
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
            crate::log::info(&format!("srv router: evicting idle LRU name={victim} for a queued request"));
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
        crate::log::info(&format!("srv router: waiting until model name={} is fully loaded...", meta.name));
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
                crate::log::info(&format!("srv router: slot available, loading queued model name={}", slot.name));
                let ok = match self.load(&slot.name).await {
                    Ok(()) => true,
                    Err(e) => {
                        crate::log::warn(&format!("srv router: queued load of name={} did not go through: {}", slot.name, e.message));
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
    let info = |msg: &str| crate::log::srv(strata_ffi::Verbosity::Info, "operator()", msg);
    info(&format!("Available models ({}):", inner.models.len()));
    if inner.models.is_empty() {
        info("  no models found on the system (visit https://llama.app/models for suggestions)");
    }
    for i in inner.models.values() {
        let mut extra = String::new();
        if !i.meta.aliases.is_empty() {
            extra += &format!(" (aliases: {})", i.meta.aliases.iter().cloned().collect::<Vec<_>>().join(", "));
        }
        if !i.meta.tags.is_empty() {
            extra += &format!(" [tags: {}]", i.meta.tags.iter().cloned().collect::<Vec<_>>().join(", "));
        }
        info(&format!("  [{:>10}] {}{extra}", i.meta.source, i.meta.name));
    }
}

/// A loopback port nothing listens on now, as llama-server picks one for each instance.
fn free_port() -> Option<u16> {
    std::net::TcpListener::bind(("127.0.0.1", 0)).ok()?.local_addr().ok().map(|a| a.port())
}
