//! Model instances: spawning a child server for a model, following its state and output, and
//! stopping, unloading or removing it.

use crate::api::error::ApiError;
use crate::cli::env::{CHILD_MODE, ROUTER_PORT};
use crate::router::child::{CMD_EXIT, CMD_STATE};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

use super::{default_architecture, free_port, now_ms, ChildCmd, Inner, Instance, Meta, Models, SpawnMode, Status, DEFAULT_STOP_TIMEOUT_S, FAKE_DELAY};

impl Models {
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
        crate::log::info(&format!("srv router: models_max limit reached, removing LRU name={victim}"));
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
            crate::log::info(&format!("srv router: model {name} is not ready"));
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
        crate::log::info(&format!("srv router: spawning server instance with name={} on port {port}", meta.name));
        crate::log::info(&format!("srv router: spawning server instance with args:\n  {}", meta.args.join("\n  ")));

        let mut cmd = tokio::process::Command::new(&meta.args[0]);
        cmd.args(&meta.args[1..])
            .env(ROUTER_PORT, self.cfg.port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if mode == SpawnMode::Download {
            cmd.env(CHILD_MODE, "download").env("LLAMA_ARG_HF_REPO", &meta.name);
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
                        None => crate::log::warn(&format!("srv router: [{port:5}] unexpected output on the command pipe: {l}")),
                    },
                    _ => stdout = None,
                },
                line = async { stderr.as_mut().unwrap().next_line().await }, if stderr.is_some() => match line {
                    Ok(Some(l)) => crate::log::info(&format!("[{port:5}] {l}")),
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
                    crate::log::warn(&format!("srv router: force-killing model instance name={name} after timeout"));
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
            crate::log::info(&format!("[{port:5}] {l}"));
        }
        let code = status.ok().and_then(|s| s.code()).unwrap_or(1);
        crate::log::info(&format!("srv router: instance name={name} exited with status {code}"));
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
            crate::log::warn(&format!("srv router: failed to parse child state update for name={name}: {msg}"));
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
            other => crate::log::warn(&format!("srv router: unexpected state '{other}' from model instance name={name}")),
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
                    crate::log::info(&format!("srv router: cancelling download for model name={name}"));
                    if let Some(ctl) = &inst.ctl {
                        let _ = ctl.send(ChildCmd::Stop { send_exit: true, timeout: Duration::from_secs(inst.meta.stop_timeout) });
                    }
                    true
                }
                _ if inst.meta.is_running() => {
                    crate::log::info(&format!("srv router: stopping model instance name={name}"));
                    let loading = inst.meta.status == Status::Loading;
                    if loading {
                        crate::log::warn(&format!("srv router: model name={name} is still loading, force-killing"));
                        if let Some(ctl) = &inst.ctl {
                            let _ = ctl.send(ChildCmd::Kill);
                        }
                    }
                    self.request_stop(&mut inner, name, !loading);
                    false
                }
                _ => {
                    crate::log::info(&format!("srv router: model instance name={name} is not running"));
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
        crate::log::info(&format!("srv router: removing model name={name} from cache ({})", if ok { "succeeded" } else { "partial" }));
        self.bump();
        self.notify_sse("model_remove", name, None);
        Ok(())
    }
}
