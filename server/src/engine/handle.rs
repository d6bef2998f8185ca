//! The engine's handle: how handlers submit tasks and read what the engine publishes.

use std::sync::{Arc, OnceLock};

use serde_json::Value;
use strata_ffi::{Model, Token};
use tokio::sync::{mpsc, oneshot, watch};

use super::admission::Admission;
use super::core::{EngineConfig, Shared};
use super::metrics::Metrics;
use super::run::run;
use super::task::{listed_scale, Event, Job, LoraInfo, SlotAction, State, Task, TaskParams};
use crate::api::error::{ApiError, ErrorType};
use crate::experts::Residency;

/// Jobs other than tasks (slot actions, control, wake) the channel holds beyond the task bound.
const OTHER_JOBS: usize = 64;

#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Job>,
    state: watch::Receiver<State>,
    /// The loaded model, for the read-only work handlers do themselves (tokenizing).
    model: Arc<OnceLock<Arc<Model>>>,
    model_alias: Arc<str>,
    n_ctx_slot: Arc<OnceLock<usize>>,
    next_task_id: Arc<std::sync::atomic::AtomicU64>,
    metrics: Arc<std::sync::Mutex<Metrics>>,
    sleeping: Arc<std::sync::atomic::AtomicBool>,
    /// The LoRA adapters and their global scales.
    lora: Arc<std::sync::Mutex<Vec<LoraInfo>>>,
    /// A task's settings when it sets none, once the model is loaded.
    default_settings: Arc<OnceLock<Value>>,
    admission: Arc<Admission>,
    residency: Arc<std::sync::Mutex<Option<Residency>>>,
}

impl EngineHandle {
    pub fn model_alias(&self) -> &str {
        &self.model_alias
    }

    pub fn state(&self) -> State {
        self.state.borrow().clone()
    }

    pub fn n_ctx_slot(&self) -> usize {
        self.n_ctx_slot.get().copied().unwrap_or(0)
    }

    /// Whether the engine has freed its context after --sleep-idle-seconds of idleness.
    pub fn is_sleeping(&self) -> bool {
        self.sleeping.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn metrics(&self) -> Arc<std::sync::Mutex<Metrics>> {
        self.metrics.clone()
    }

    pub fn state_watch(&self) -> watch::Receiver<State> {
        self.state.clone()
    }

    pub fn model(&self) -> Option<Arc<Model>> {
        self.model.get().cloned()
    }

    /// Queues one task per prompt; the events of all arrive on the returned channel, each
    /// tagged with its prompt's index. Dropping the receiver cancels them all.
    pub fn submit(&self, prompts: Vec<Vec<Token>>, params: TaskParams) -> Result<Results, ApiError> {
        let (events, rx) = mpsc::unbounded_channel();
        let n_cmpl = params.n_cmpl.max(1);
        let n_tasks = prompts.len() * n_cmpl;
        self.admission.try_admit(n_tasks).map_err(|f| {
            let mut e = ApiError::new(
                ErrorType::Unavailable,
                format!("server is busy: {} tasks are waiting for a slot (--max-queued {}); try again later", f.queued, f.bound),
            );
            e.retry_after = Some(super::admission::RETRY_AFTER_S);
            e
        })?;
        let mut sent = 0;
        let mut ids = Vec::with_capacity(n_tasks);
        for (p, prompt) in prompts.into_iter().enumerate() {
            for j in 0..n_cmpl {
                let mut params = params.clone();
                if j > 0 {
                    params.id_slot = -1;
                    if let Some(seed) = params.sampling.get("seed").and_then(Value::as_u64).filter(|&s| s != u32::MAX as u64) {
                        params.sampling["seed"] = (seed as u32).wrapping_add(j as u32).into();
                    }
                }
                let id = self.next_task_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                ids.push(id);
                let task = Task { id, index: p * n_cmpl + j, prompt: prompt.clone(), params, events: events.clone() };
                if let Err(e) = self.tx.try_send(Job::Task(Box::new(task))) {
                    self.admission.leave(n_tasks - sent);
                    return Err(match e {
                        mpsc::error::TrySendError::Full(_) => ApiError::new(ErrorType::Unavailable, "server is busy, try again later"),
                        mpsc::error::TrySendError::Closed(_) => ApiError::server("engine has stopped"),
                    });
                }
                sent += 1;
            }
        }
        Ok(Results { rx, ids, finished: 0, stopped: false })
    }

    /// Wakes a sleeping engine and waits until its context is back, as any request that
    /// llama-server routes through its task queue does.
    pub async fn wake(&self) {
        if !self.is_sleeping() {
            return;
        }
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Job::Wake(reply)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Runs a slot action once its slot is idle.
    pub async fn slot_action(&self, action: SlotAction) -> Result<Value, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.tx.try_send(Job::Slot(action, reply)).map_err(|_| ApiError::new(ErrorType::Unavailable, "server is busy, try again later"))?;
        rx.await.map_err(|_| ApiError::server("engine dropped the request"))?
    }

    /// A control action on the live completion `cmpl_id`; the engine's answer.
    pub async fn control(&self, cmpl_id: String, action: String) -> Result<Value, ApiError> {
        let (reply, rx) = oneshot::channel();
        let job = Job::Control { cmpl_id, action, reply };
        self.tx.try_send(job).map_err(|_| ApiError::new(ErrorType::Unavailable, "server is busy, try again later"))?;
        rx.await.map_err(|_| ApiError::server("engine dropped the request"))
    }

    /// The slots as `/slots` shows them, asked of the engine between steps as llama-server
    /// does; and how many are idle.
    pub async fn slots(&self) -> Result<(Vec<Value>, usize), ApiError> {
        let (reply, rx) = oneshot::channel();
        self.tx.try_send(Job::Slots(reply)).map_err(|_| ApiError::new(ErrorType::Unavailable, "server is busy, try again later"))?;
        rx.await.map_err(|_| ApiError::server("engine dropped the request"))
    }

    /// The settings a task that sets none runs with (/props' default_generation_settings).
    pub fn default_settings(&self) -> Value {
        self.default_settings.get().cloned().unwrap_or(Value::Null)
    }

    pub fn lora_adapters(&self) -> Vec<LoraInfo> {
        self.lora.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// POST /lora-adapters: every adapter gets the scale given for its id, or 0.
    pub fn set_lora_scales(&self, scales: &[(i64, f32)]) {
        if let Ok(mut l) = self.lora.lock() {
            for (i, a) in l.iter_mut().enumerate() {
                a.scale = listed_scale(scales, i);
            }
        }
    }

    /// The expert residency's `strata:*` lines for /metrics (empty without expert tiers).
    pub fn expert_metrics(&self) -> String {
        self.residency.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(Residency::metrics_text).unwrap_or_default()
    }

    /// The `strata:ple_*` and `strata:gemm_*` lines for /metrics (empty unless a PLE table is read
    /// from the file or the GEMM dispatch is installed).
    pub fn ple_metrics(&self) -> String {
        crate::ple::metrics_text(strata_ffi::ple::stats()) + &crate::gemm::metrics_text()
    }

    /// A handle over a caller-made channel, for HTTP tests with a scripted engine.
    #[cfg(test)]
    pub fn from_parts(tx: mpsc::Sender<Job>, state: watch::Receiver<State>) -> Self {
        Self {
            tx,
            state,
            model: Arc::default(),
            model_alias: "m".into(),
            n_ctx_slot: Arc::default(),
            next_task_id: Arc::default(),
            metrics: Arc::default(),
            sleeping: Arc::default(),
            lora: Arc::default(),
            default_settings: Arc::default(),
            admission: Arc::new(Admission::new(crate::engine::DEFAULT_MAX_QUEUED)),
            residency: Arc::default(),
        }
    }
}

/// Starts the engine thread; the model loads on it while the HTTP server already answers.
/// Engine threads that have not yet dropped their model and contexts.
static RUNNING: (std::sync::Mutex<usize>, std::sync::Condvar) = (std::sync::Mutex::new(0), std::sync::Condvar::new());

/// Waits until every engine thread has ended (their handles dropped), at most `timeout`.
pub fn wait_stopped(timeout: std::time::Duration) {
    let deadline = std::time::Instant::now() + timeout;
    let Ok(mut n) = RUNNING.0.lock() else { return };
    while *n > 0 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return;
        }
        n = match RUNNING.1.wait_timeout(n, left) {
            Ok((n, _)) => n,
            Err(_) => return,
        };
    }
}

pub fn spawn(cfg: EngineConfig) -> EngineHandle {
    let admission = Arc::new(Admission::new(cfg.max_queued));
    let (tx, rx) = mpsc::channel(cfg.max_queued.saturating_add(OTHER_JOBS));
    let (state_tx, state_rx) = watch::channel(State::Loading);
    let model = Arc::new(OnceLock::new());
    let n_ctx_slot = Arc::new(OnceLock::new());
    let metrics: Arc<std::sync::Mutex<Metrics>> = Arc::default();
    let sleeping: Arc<std::sync::atomic::AtomicBool> = Arc::default();
    let lora: Arc<std::sync::Mutex<Vec<LoraInfo>>> = Arc::default();
    let default_settings: Arc<OnceLock<Value>> = Arc::default();
    let residency: Arc<std::sync::Mutex<Option<Residency>>> = Arc::default();
    let shared = Shared {
        residency: residency.clone(),
        default_settings: default_settings.clone(),
        sleeping: sleeping.clone(),
        model: model.clone(),
        n_ctx_slot: n_ctx_slot.clone(),
        metrics: metrics.clone(),
        lora: lora.clone(),
        admission: admission.clone(),
    };
    let model_alias = cfg.model_alias.as_str().into();
    RUNNING.0.lock().map(|mut n| *n += 1).ok();
    std::thread::Builder::new()
        .name("strata-engine".into())
        .spawn(move || {
            run(cfg, rx, state_tx, &shared);
            drop(shared);
            if let Ok(mut n) = RUNNING.0.lock() {
                *n -= 1;
                RUNNING.1.notify_all();
            }
        })
        .expect("spawn engine thread");
    EngineHandle {
        tx,
        state: state_rx,
        model,
        model_alias,
        n_ctx_slot,
        next_task_id: Arc::default(),
        metrics,
        sleeping,
        lora,
        default_settings,
        admission,
        residency,
    }
}

/// The events of one request's tasks, read as llama-server's response reader reads them: an
/// error, or a reader dropped before every task has finished (a client gone), cancels all of the
/// request's tasks with its log lines. The engine drops a task once nobody reads its events.
pub struct Results {
    rx: mpsc::UnboundedReceiver<Event>,
    ids: Vec<u64>,
    finished: usize,
    stopped: bool,
}

impl Results {
    pub async fn recv(&mut self) -> Option<Event> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    pub fn poll_recv(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Event>> {
        let polled = self.rx.poll_recv(cx);
        match &polled {
            std::task::Poll::Ready(Some(Event::Final(_) | Event::Embedding(_))) => self.finished += 1,
            std::task::Poll::Ready(Some(Event::Error(_))) => self.stop(),
            _ => {}
        }
        polled
    }

    fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        if self.finished < self.ids.len() {
            for id in &self.ids {
                crate::log::srv(strata_ffi::Verbosity::Warn, "stop", &format!("cancel task, id_task = {id}"));
            }
        } else {
            crate::log::srv(strata_ffi::Verbosity::Debug, "stop", "all tasks already finished, no need to cancel");
        }
    }
}

impl Drop for Results {
    fn drop(&mut self) {
        self.stop();
    }
}
