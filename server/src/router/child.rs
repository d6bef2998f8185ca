//! The child's side of the router protocol: a child is a strata-server started by a router
//! (it finds LLAMA_SERVER_ROUTER_PORT set). It reports its state on stdout, one
//! `cmd_child_to_router:state:{json}` line each, and exits when the router writes the exit
//! command on its stdin, or when stdin closes (the router is gone).

use std::fs::File;
use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::api::info::{self, ServerInfo};
use crate::engine::{EngineHandle, State};

pub const CMD_EXIT: &str = "cmd_router_to_child:exit";
pub const CMD_STATE: &str = "cmd_child_to_router:state:";

const SLEEP_POLL: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildMode {
    Normal,
    /// Download the model, report the result, wait for the exit command.
    Download,
}

pub struct ChildLink {
    out: Mutex<File>,
    pub mode: ChildMode,
}

impl ChildLink {
    /// Some when this process was started by a router; takes stdout for the messages.
    pub fn from_env() -> Option<Arc<Self>> {
        crate::cli::env::upstream(crate::cli::env::Upstream::RouterPort)?;
        let out = match strata_ffi::reserve_stdout() {
            Ok(f) => f,
            Err(e) => {
                crate::log::info(&format!("srv child: {e}"));
                return None;
            }
        };
        let mode = match crate::cli::env::upstream(crate::cli::env::Upstream::ChildMode).as_deref() {
            Some("download") => ChildMode::Download,
            _ => ChildMode::Normal,
        };
        Some(Arc::new(Self { out: Mutex::new(out), mode }))
    }

    pub fn notify(&self, state: &str, payload: Value) {
        let line = format!("{CMD_STATE}{}\n", json!({"state": state, "payload": payload}));
        if let Ok(mut out) = self.out.lock() {
            let _ = out.write_all(line.as_bytes());
            let _ = out.flush();
        }
    }

    /// Exits the process on the router's exit command (status 0) or when stdin closes (1).
    pub fn watch_stdin(&self) {
        std::thread::spawn(|| {
            for line in std::io::stdin().lock().lines() {
                match line {
                    Ok(l) if l.contains(CMD_EXIT) => {
                        log("srv child: exit command received, exiting...");
                        std::process::exit(0);
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            log("srv child: EOF on stdin detected, forcing shutdown...");
            std::process::exit(1);
        });
    }

    /// Reports loading, then ready with the model's /v1/models entry once the engine is up,
    /// then every change between sleeping and awake.
    pub async fn follow_engine(self: Arc<Self>, engine: EngineHandle, info: Arc<ServerInfo>) {
        self.notify("loading", json!({}));
        self.watch_stdin();
        let mut state = engine.state_watch();
        loop {
            if *state.borrow_and_update() == State::Ready {
                break;
            }
            if state.changed().await.is_err() {
                return;
            }
        }
        let payload = engine.model().map(|m| info::model_info(&info, &m, engine.n_ctx_slot())).unwrap_or_else(|| json!({}));
        self.notify("ready", payload);
        let mut sleeping = false;
        loop {
            tokio::time::sleep(SLEEP_POLL).await;
            let now = engine.is_sleeping();
            if now != sleeping {
                sleeping = now;
                self.notify(if now { "sleeping" } else { "ready" }, json!({}));
            }
        }
    }
}

/// A line on stderr that cannot fail: once the router is gone, so is the reader of our stderr.
fn log(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A download child: fetch the model files the parsed flags name, report, wait to be stopped.
pub fn run_download(link: &ChildLink, mut params: strata_ffi::ServerParams) -> std::process::ExitCode {
    let result = match strata_ffi::router_download(&mut params) {
        Ok(()) => "download_finished",
        Err(e) => {
            log(&format!("srv child: download failed: {e}"));
            "download_failed"
        }
    };
    link.notify("downloading", json!({"result": result}));
    link.watch_stdin();
    loop {
        std::thread::park();
    }
}
