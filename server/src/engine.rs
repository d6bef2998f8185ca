//! The engine thread: the only owner of the llama context. HTTP handlers send it tasks over a
//! bounded channel, each with its own event channel; a readiness watch gates `/health`.
//!
//! Continuous batching as in llama-server: `n_parallel` slots share one context, one sequence
//! each. Every step builds a single batch from the sampled token of each generating slot and
//! prompt chunks of the others, decodes it once, samples per slot, and sends events. A task
//! whose event channel is closed (client gone) is cancelled at the next step.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_ffi::{Batch, Context, DecodeError, LoraAdapter, Model, Sampler, SeqRm, ServerParams, Speculative, StateScope, Token, Verbosity};
use tokio::sync::{mpsc, oneshot, watch};

use crate::admission::Admission;
use crate::checkpoint::{self, Checkpoint};
use crate::error::{ApiError, ErrorType};
use crate::generation::{Generation, StopType};
use crate::metrics::Metrics;
use crate::prompt_cache::PromptCache;

/// Jobs other than tasks (slot actions, control, wake) the channel holds beyond the task bound.
const OTHER_JOBS: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Loading,
    Ready,
    Failed(String),
}

/// What a task asks of its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TaskKind {
    #[default]
    Completion,
    /// Embeddings (/embedding, /v1/embeddings), normalised as common_embd_normalize does.
    Embedding { normalize: i32 },
    /// A rerank score (/rerank): the first output of the model's classifier head.
    Rerank,
}

/// A LoRA adapter given with --lora / --lora-scaled, as /lora-adapters lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraInfo {
    pub path: String,
    /// The scale tasks without a `lora` field use (POST /lora-adapters sets it).
    pub scale: f32,
    pub task_name: String,
    pub prompt_prefix: String,
    /// An activated LoRA's invocation tokens (empty for a plain adapter) and their text.
    pub alora_tokens: Vec<Token>,
    pub alora_string: String,
}

#[derive(Debug, Clone)]
pub struct TaskParams {
    pub kind: TaskKind,
    /// Tokenized chat message delimiters, in the template's order of preference: (starts a user
    /// message, tokens). Context checkpoints are also taken where user messages start.
    pub message_delimiters: Vec<(bool, Vec<Token>)>,
    /// Per-request adapter scales by adapter id; adapters not listed get 0. None: the global
    /// scales.
    pub lora: Option<Vec<(i64, f32)>>,
    /// -1: the server's --n-predict.
    pub n_predict: i32,
    pub stop: Vec<String>,
    pub stream: bool,
    pub cache_prompt: bool,
    /// -1: any slot.
    pub id_slot: i32,
    /// The OpenAI completion id the answer carries, by which control actions find the task.
    pub cmpl_id: String,
    /// Completions per prompt (the request's n); the copies after the first sample with the
    /// seed plus their position, as llama-server's child tasks do.
    pub n_cmpl: usize,
    /// The chat template's output format (common_chat_format), for parsing and reporting.
    pub chat_format: i32,
    /// The reasoning format's name (none, auto, deepseek, deepseek-legacy).
    pub reasoning_format: String,
    /// The answer carries the task's settings (generation_settings): settings that cannot be
    /// written (an unknown chat_format) then fail the task at its end, as in llama-server.
    pub settings_in_answer: bool,
    pub return_tokens: bool,
    pub ignore_eos: bool,
    pub t_max_predict_ms: i64,
    /// Prompt tokens kept when the context shifts (-1: all of the prompt).
    pub n_keep: i32,
    /// Tokens dropped per shift (0: half of what is not kept).
    pub n_discard: i32,
    /// Smallest cached chunk moved by KV shifting to where the new prompt has it (0: none,
    /// -1: the server's --cache-reuse).
    pub n_cache_reuse: i32,
    /// Report the top n_probs tokens of each step (0 = none).
    pub n_probs: usize,
    /// Probabilities after the sampler chain instead of the raw softmax.
    pub post_sampling_probs: bool,
    /// Timings in every streamed chunk, not only the last.
    pub timings_per_token: bool,
    /// Streamed prompt-processing progress: one chunk at the start and one per prompt batch.
    pub return_progress: bool,
    /// common_params_sampling overrides (see strata_ffi::Sampler::new).
    pub sampling: Value,
}

pub struct Task {
    /// llama-server's task id, as its log lines show it.
    pub id: u64,
    /// Position of this prompt in a multi-prompt request.
    pub index: usize,
    pub prompt: Vec<Token>,
    pub params: TaskParams,
    pub events: mpsc::UnboundedSender<Event>,
}

/// What `/slots/{id}?action=` asks of a slot; done when the slot is idle.
#[derive(Debug, Clone)]
/// `id` is the slot id as asked; it reaches a slot as llama-server's get_slot_by_id does.
pub enum SlotAction {
    Save { id: i32, filename: String, path: PathBuf },
    Restore { id: i32, filename: String, path: PathBuf },
    Erase { id: i32 },
}

pub enum Job {
    Task(Box<Task>),
    Slot(SlotAction, oneshot::Sender<Result<Value, ApiError>>),
    /// Answered once the engine is awake (its context re-created after sleeping).
    Wake(oneshot::Sender<()>),
    /// A live completion's control action (`/v1/chat/completions/control`): its answer.
    Control {
        cmpl_id: String,
        action: String,
        reply: oneshot::Sender<Value>,
    },
    /// The slots as `/slots` shows them, and how many are idle.
    Slots(oneshot::Sender<(Vec<Value>, usize)>),
}

#[derive(Debug, Clone, Default)]
pub struct Timings {
    pub cache_n: usize,
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    /// Speculative decoding: tokens drafted, and how many of them the model accepted.
    pub draft_n: usize,
    pub draft_n_accepted: usize,
}

/// Rates as llama-server computes them: generation counts decode steps, and the first token is
/// free (it comes from the logits of the last prompt batch).
impl Timings {
    fn gen_steps(&self) -> usize {
        self.predicted_n.saturating_sub(1)
    }

    pub fn prompt_per_token_ms(&self) -> f64 {
        if self.prompt_n > 0 {
            self.prompt_ms / self.prompt_n as f64
        } else {
            0.0
        }
    }

    pub fn prompt_per_second(&self) -> f64 {
        if self.prompt_ms > 0.0 {
            1e3 / self.prompt_ms * self.prompt_n as f64
        } else {
            0.0
        }
    }

    pub fn predicted_per_token_ms(&self) -> f64 {
        if self.gen_steps() > 0 {
            self.predicted_ms / self.gen_steps() as f64
        } else {
            0.0
        }
    }

    pub fn predicted_per_second(&self) -> f64 {
        if self.predicted_ms > 0.0 {
            1e3 / self.predicted_ms * self.gen_steps() as f64
        } else {
            0.0
        }
    }
}

/// One generated token with its probability and the most likely alternatives.
#[derive(Debug, Clone)]
pub struct TokenProbs {
    pub token: Token,
    pub piece: Vec<u8>,
    pub prob: f32,
    pub top: Vec<(Token, Vec<u8>, f32)>,
}

#[derive(Debug, Clone)]
pub struct Partial {
    pub index: usize,
    pub content: String,
    pub tokens: Vec<Token>,
    pub id_slot: usize,
    pub n_decoded: usize,
    pub n_prompt: usize,
    pub probs: Option<TokenProbs>,
    pub timings: Option<Timings>,
    /// Set on prompt-progress chunks, which carry no token.
    pub progress: Option<Progress>,
}

#[derive(Debug, Clone)]
pub struct Progress {
    pub total: usize,
    pub cache: usize,
    pub processed: usize,
    pub time_ms: u64,
}

#[derive(Debug, Clone)]
pub struct Final {
    pub index: usize,
    pub content: String,
    pub tokens: Vec<Token>,
    pub id_slot: usize,
    pub n_decoded: usize,
    pub n_prompt: usize,
    pub stop: StopType,
    pub stopping_word: String,
    pub truncated: bool,
    pub has_new_line: bool,
    pub timings: Timings,
    /// Per-token probabilities (non-streamed answers with n_probs > 0).
    pub probs: Vec<TokenProbs>,
    /// The settings the task ran with (llama-server's generation_settings).
    pub settings: Arc<Value>,
}

/// The answer to an embedding or rerank task.
#[derive(Debug, Clone)]
pub struct Embedding {
    pub index: usize,
    pub n_tokens: usize,
    /// One pooled vector, or one per prompt token when the context does not pool.
    pub data: Vec<Vec<f32>>,
    /// Rerank tasks: the relevance score.
    pub score: f32,
}

#[derive(Debug)]
pub enum Event {
    /// A streamed task has passed its checks and starts: the answer's status is 200 from here
    /// on, and a later failure is an error event in the stream (llama-server's is_begin).
    Begin,
    Partial(Partial),
    Final(Box<Final>),
    Embedding(Embedding),
    Error(ApiError),
}

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
    pub fn submit(&self, prompts: Vec<Vec<Token>>, params: TaskParams) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        let (events, rx) = mpsc::unbounded_channel();
        let n_cmpl = params.n_cmpl.max(1);
        let n_tasks = prompts.len() * n_cmpl;
        self.admission.try_admit(n_tasks).map_err(|f| {
            let mut e = ApiError::new(
                ErrorType::Unavailable,
                format!("server is busy: {} tasks are waiting for a slot (--max-queued {}); try again later", f.queued, f.bound),
            );
            e.retry_after = Some(crate::admission::RETRY_AFTER_S);
            e
        })?;
        let mut sent = 0;
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
        Ok(rx)
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
            admission: Arc::new(Admission::new(crate::admission::DEFAULT_MAX_QUEUED)),
        }
    }
}

pub struct EngineConfig {
    pub params: ServerParams,
    pub model_path: PathBuf,
    pub model_alias: String,
    pub n_parallel: usize,
    pub kv_unified: bool,
    pub n_predict_default: i32,
    /// --sleep-idle-seconds: free the context after this long without work.
    pub sleep_idle: Option<Duration>,
    /// --context-shift: drop old tokens instead of stopping when a slot's context is full.
    pub ctx_shift: bool,
    /// --cache-ram in MiB: -1 no limit, 0 no host-RAM prompt cache.
    pub cache_ram_mib: i32,
    /// --cache-idle-slots: copy idle slots to the prompt cache when a task starts (and, with a
    /// unified KV cache, clear them to make room).
    pub cache_idle_slots: bool,
    /// --ctx-checkpoints: most context checkpoints kept per slot (0 = none).
    pub n_ctx_checkpoints: usize,
    /// --checkpoint-min-step: least distance in tokens between two checkpoints.
    pub checkpoint_min_step: usize,
    /// --swa-full: the sliding-window cache keeps every position, so needs no checkpoints.
    pub swa_full: bool,
    /// --slot-prompt-similarity: reuse a slot whose cache shares this fraction of the prompt.
    pub slot_prompt_similarity: f32,
    /// A drafter is configured (--spec-type other than none, or a draft model).
    pub speculative: bool,
    /// --cache-reuse: default smallest chunk reused by KV shifting (0 = off).
    pub n_cache_reuse: i32,
    /// --lora / --lora-scaled: adapter files and their initial scales.
    pub lora: Vec<(PathBuf, f32)>,
    /// The MoE expert residency flags, when any is given.
    pub experts: Option<crate::experts::ExpertConfig>,
    /// --max-queued: most tasks waiting for a slot before requests get 503.
    pub max_queued: usize,
    /// The model file is mapped (llama.cpp's load mode), which the expert tiers rely on.
    pub use_mmap: bool,
    /// --main-gpu: the GPU that holds the hot expert tier.
    pub main_gpu: usize,
}

/// Starts the engine thread; the model loads on it while the HTTP server already answers.
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
    let shared = Shared {
        default_settings: default_settings.clone(),
        sleeping: sleeping.clone(),
        model: model.clone(),
        n_ctx_slot: n_ctx_slot.clone(),
        metrics: metrics.clone(),
        lora: lora.clone(),
        admission: admission.clone(),
    };
    let model_alias = cfg.model_alias.as_str().into();
    std::thread::Builder::new().name("strata-engine".into()).spawn(move || run(cfg, rx, state_tx, &shared)).expect("spawn engine thread");
    EngineHandle { tx, state: state_rx, model, model_alias, n_ctx_slot, next_task_id: Arc::default(), metrics, sleeping, lora, default_settings, admission }
}

/// What the engine publishes for handlers.
struct Shared {
    /// A task's settings when it sets none (the metrics form /props shows).
    default_settings: Arc<OnceLock<Value>>,
    lora: Arc<std::sync::Mutex<Vec<LoraInfo>>>,
    sleeping: Arc<std::sync::atomic::AtomicBool>,
    model: Arc<OnceLock<Arc<Model>>>,
    n_ctx_slot: Arc<OnceLock<usize>>,
    metrics: Arc<std::sync::Mutex<Metrics>>,
    admission: Arc<Admission>,
}

fn run(mut cfg: EngineConfig, mut rx: mpsc::Receiver<Job>, state: watch::Sender<State>, shared: &Shared) {
    if let Err(e) = strata_ffi::init_backend(Some(&cfg.params)) {
        let _ = state.send(State::Failed(e.to_string()));
        return;
    }
    let prepared = match cfg.experts.as_ref().map(|e| crate::experts::prepare(e, &cfg.model_path, cfg.use_mmap)).transpose() {
        Ok(p) => p,
        Err(e) => {
            let _ = state.send(State::Failed(e));
            return;
        }
    };
    let model = match cfg.params.model_params().and_then(|mparams| Model::load(&cfg.model_path, &mparams)) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            let _ = state.send(State::Failed(e.to_string()));
            return;
        }
    };
    let _ = shared.model.set(model.clone());
    // /props shows a default-made task's settings: the server's sampling, nothing else of its
    // flags (no speculative types, no reasoning format, no -n)
    let mut base = crate::http::params_from_fields(&serde_json::Map::new(), &serde_json::Map::new(), None, 0);
    base.reasoning_format = "none".into();
    match strata_ffi::sampling_settings(Some(&cfg.params), &serde_json::json!({}), 0) {
        Ok(mut s) => {
            s["speculative.types"] = "none".into();
            let _ = shared.default_settings.set(crate::request::task_settings(&s, &base, -1, true));
        }
        Err(e) => {
            let _ = state.send(State::Failed(e.to_string()));
            return;
        }
    }
    let mut adapters = Vec::new();
    let mut infos = Vec::new();
    for (path, scale) in &cfg.lora {
        match LoraAdapter::load(&model, path) {
            Ok(a) => {
                infos.push(LoraInfo {
                    path: path.to_string_lossy().into_owned(),
                    scale: *scale,
                    task_name: a.meta("adapter.lora.task_name"),
                    prompt_prefix: a.meta("adapter.lora.prompt_prefix"),
                    alora_string: a
                        .alora_invocation_tokens()
                        .iter()
                        .map(|&t| String::from_utf8_lossy(&model.vocab().token_to_piece(t, true)).into_owned())
                        .collect(),
                    alora_tokens: a.alora_invocation_tokens(),
                });
                adapters.push(a);
            }
            Err(e) => {
                let _ = state.send(State::Failed(e.to_string()));
                return;
            }
        }
    }
    if let Ok(mut l) = shared.lora.lock() {
        *l = infos;
    }
    let mut woken_by: Option<Job> = None;
    let mut placed = false;
    loop {
        let ctx = match cfg.params.context_params().and_then(|p| Context::new(&model, with_op_profile(p))) {
            Ok(c) => c,
            Err(e) => {
                let _ = state.send(State::Failed(e.to_string()));
                return;
            }
        };
        let mut ctx = ctx;
        if let Some(p) = prepared.as_ref().filter(|_| !placed) {
            if let Err(e) = crate::experts::place(p, &model, cfg.main_gpu) {
                let _ = state.send(State::Failed(e));
                return;
            }
            placed = true;
        }
        let spec = match new_speculative(&mut cfg, &mut ctx) {
            Ok(s) => s,
            Err(e) => {
                let _ = state.send(State::Failed(e));
                return;
            }
        };
        let mut spec = spec;
        let probed = ctx.probe_seq_rm().and_then(|s| Ok((s, spec.as_mut().map_or(Ok(SeqRm::Partial), Speculative::probe_seq_rm)?)));
        let (seq_rm, draft_seq_rm) = match probed {
            Ok(p) => p,
            Err(e) => {
                let _ = state.send(State::Failed(e.to_string()));
                return;
            }
        };
        let mut engine = Engine::new(ctx, spec, [seq_rm, draft_seq_rm], &cfg, shared, &adapters);
        let _ = shared.n_ctx_slot.set(engine.n_ctx_slot);
        shared.sleeping.store(false, std::sync::atomic::Ordering::Relaxed);
        let _ = state.send(State::Ready);
        if let Some(job) = woken_by.take() {
            engine.take(job);
        }
        match serve_jobs(&mut engine, &mut rx, shared, cfg.sleep_idle) {
            Some(job) => woken_by = Some(job),
            None => return,
        }
    }
}

/// llama-server's --cache-reuse: past the common prefix, finds chunks of at least `min_chunk`
/// tokens that the cached sequence and the new prompt share, and moves their KV entries (by
/// position shifting) to where the prompt has them. Returns the new number of reusable tokens;
/// `cache` then holds exactly those.
fn reuse_chunks(
    ctx: &mut Context<'_>,
    mut spec: Option<&mut Speculative>,
    id: usize,
    cache: &mut Vec<Token>,
    prompt: &[Token],
    n_past: usize,
    min_chunk: usize,
) -> usize {
    let seq = id as i32;
    let (mut head_c, mut head_p) = (n_past, n_past);
    slot_log_at(Verbosity::Debug, "update_slots", id, -1, &format!("trying to reuse chunks with size > {min_chunk}, n_past = {n_past}"));
    while head_c < cache.len() && head_p < prompt.len() {
        let n_match = cache[head_c..].iter().zip(&prompt[head_p..]).take_while(|(a, b)| a == b).count();
        if n_match < min_chunk {
            head_c += 1;
            continue;
        }
        let msg = format!("reusing chunk with size {n_match}, shifting KV cache [{head_c}, {}) -> [{head_p}, {})", head_c + n_match, head_p + n_match);
        slot_log_at(Verbosity::Trace, "update_slots", id, -1, &msg);
        let shift = head_p as i32 - head_c as i32;
        ctx.seq_rm(seq, head_p as i32, head_c as i32);
        ctx.seq_add(seq, head_c as i32, (head_c + n_match) as i32, shift);
        if let Some(s) = spec.as_deref_mut() {
            drafter_log(s.seq_rm(seq, head_p as i32, head_c as i32).and_then(|()| s.seq_add(seq, head_c as i32, (head_c + n_match) as i32, shift)), id);
        }
        head_c += n_match;
        head_p += n_match;
    }
    cache.clear();
    cache.extend_from_slice(&prompt[..head_p]);
    slot_log_at(Verbosity::Debug, "update_slots", id, -1, &format!("after context reuse, new n_past = {head_p}"));
    head_p
}

/// Adapter `i`'s scale in an (id, scale) list: the last entry for it wins, unlisted is 0.
fn listed_scale(list: &[(i64, f32)], i: usize) -> f32 {
    list.iter().rev().find(|(id, _)| *id == i as i64).map_or(0.0, |&(_, s)| s)
}

/// llama.cpp's common_embd_normalize: -1 none, 0 max-absolute to the int16 range, 2 euclidean,
/// other p: p-norm.
pub fn normalize_embedding(v: &[f32], norm: i32) -> Vec<f32> {
    let sum: f64 = match norm {
        -1 => 1.0,
        0 => v.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64)) / 32760.0,
        2 => v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt(),
        p => v.iter().map(|&x| (x.abs() as f64).powi(p)).sum::<f64>().powf(1.0 / p as f64),
    };
    let scale = if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 };
    v.iter().map(|&x| x * scale).collect()
}

/// Whether the enabled adapters (non-zero scale) are all aLoRAs, and there is one.
fn all_alora(invocations: &[Vec<Token>], scales: &[f32]) -> bool {
    let mut enabled = scales.iter().zip(invocations).filter(|(&s, _)| s != 0.0).peekable();
    enabled.peek().is_some() && enabled.all(|(_, inv)| !inv.is_empty())
}

/// Copies a slot's sequence and its checkpoints into the prompt cache; false if nothing was stored.
fn save_slot(cache: &mut PromptCache, ctx: &Context<'_>, slot: &Slot) -> bool {
    let id = slot.id as i32;
    let size = ctx.seq_state_size(id, StateScope::Whole) + slot.checkpoints.iter().map(Checkpoint::size).sum::<usize>();
    cache.save(&slot.cache, size, || ctx.seq_state(id, StateScope::Whole), || slot.checkpoints.clone())
}

/// Adds a context checkpoint of slot's sequence as it stands (covering its first `n_tokens`).
fn take_checkpoint(
    ctx: &Context<'_>,
    spec: Option<&mut Speculative>,
    slot: &mut Slot,
    policy: checkpoint::Policy,
    n_tokens: usize,
    pos_min: i32,
    pos_max: i32,
) {
    let id = slot.id as i32;
    let task = slot.active.as_ref().map_or(0, |a| a.task.id);
    checkpoint::make_room(&mut slot.checkpoints, policy, slot.id, task, n_tokens);
    let Some(tgt) = ctx.seq_state(id, StateScope::Partial) else {
        slot_log_at(Verbosity::Warn, "create_check", slot.id, task as i64, "failed to copy the sequence state for a context checkpoint");
        return;
    };
    let spec = match spec.map(|s| s.checkpoint(id, true)).transpose() {
        Ok(s) => s,
        Err(e) => {
            slot_log_at(Verbosity::Warn, "create_check", slot.id, task as i64, &format!("failed to copy the drafter state for a context checkpoint: {e}"));
            return;
        }
    };
    checkpoint::push(&mut slot.checkpoints, policy, slot.id, Checkpoint { n_tokens, pos_min, pos_max, task, tgt, spec });
}

/// The longest draft that fits: room in the slot's context (one token kept free for a context
/// shift) and in what is left of n_predict (llama-server's get_n_draft_max).
fn draft_max(a: &Active, n_cached: usize, n_ctx_slot: usize) -> usize {
    let mut n = n_ctx_slot as i64 - n_cached as i64 - 2;
    if a.n_predict_max >= 0 {
        n = n.min(a.n_predict_max as i64 - a.n_decoded as i64 - 1);
    }
    n.max(0) as usize
}

/// The drafter llama-server would set up for these flags, if any.
fn new_speculative(cfg: &mut EngineConfig, ctx: &mut Context<'_>) -> Result<Option<Speculative>, String> {
    if !cfg.speculative {
        return Ok(None);
    }
    let n_seq = cfg.n_parallel.max(1) as u32;
    match Speculative::new(&mut cfg.params, ctx, n_seq) {
        Ok(s) => {
            srv_log(Verbosity::Trace, "load_model", "speculative decoding context initialized");
            Ok(Some(s))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// What a wait for work ended with.
enum Wait {
    Job(Job),
    Idle,
    Closed,
}

fn wait_for_job(rx: &mut mpsc::Receiver<Job>, limit: Option<Duration>) -> Wait {
    let Some(limit) = limit else {
        return rx.blocking_recv().map_or(Wait::Closed, Wait::Job);
    };
    let t0 = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(job) => return Wait::Job(job),
            Err(mpsc::error::TryRecvError::Disconnected) => return Wait::Closed,
            Err(mpsc::error::TryRecvError::Empty) if t0.elapsed() >= limit => return Wait::Idle,
            Err(mpsc::error::TryRecvError::Empty) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Runs the engine until the channel closes (None), or, with --sleep-idle-seconds, until it
/// has been idle that long: then the context (KV cache, compute buffers) is freed and the job
/// that wakes the server is returned. The weights stay loaded.
fn serve_jobs(engine: &mut Engine<'_>, rx: &mut mpsc::Receiver<Job>, shared: &Shared, sleep_idle: Option<Duration>) -> Option<Job> {
    loop {
        if engine.is_idle() {
            match wait_for_job(rx, sleep_idle) {
                Wait::Job(job) => engine.take(job),
                Wait::Closed => return None,
                Wait::Idle => {
                    shared.sleeping.store(true, std::sync::atomic::Ordering::Relaxed);
                    strata_ffi::log_info("srv  handle_sleep: entering sleeping state\n");
                    return rx.blocking_recv();
                }
            }
        }
        while let Ok(job) = rx.try_recv() {
            engine.take(job);
        }
        engine.run_slot_actions();
        let worked = engine.step();
        engine.publish();
        if !worked && !engine.pending.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

struct Active {
    task: Task,
    sampler: Sampler,
    /// llama-server's task_params::to_json for this task, or why it cannot be written.
    settings: Result<Arc<Value>, String>,
    gen: Generation,
    n_predict_max: i32,
    n_cached: usize,
    /// The last sampled token, to be decoded next step.
    sampled: Option<Token>,
    i_batch: Option<i32>,
    tokens: Vec<Token>,
    probs: Vec<TokenProbs>,
    n_decoded: usize,
    truncated: bool,
    t_prompt: Instant,
    prompt_ms: f64,
    t_gen: Option<Instant>,
    /// Prompt tokens went into the current batch.
    prompt_in_batch: bool,
    /// The adapter scales this task decodes with.
    lora: Vec<f32>,
    /// Draft tokens in the current batch, after the sampled token, and the batch indices of
    /// the sampled token and each draft token.
    draft: Vec<Token>,
    draft_i_batch: Vec<i32>,
    n_draft_total: usize,
    n_draft_accepted: usize,
    n_draft_steps: usize,
    /// The slot's partial state from before the current draft, when rejecting part of it
    /// cannot be undone by cutting the sequence back.
    spec_ckpt: Option<Checkpoint>,
    /// Prompt positions where a user message starts (ascending).
    user_starts: Vec<usize>,
    /// The active aLoRA and where its invocation starts in the prompt: the prompt before it is
    /// decoded without the adapter, so that it matches a plain prompt's cache.
    alora: Option<(usize, usize)>,
}

impl Active {
    fn new(task: Task, sampler: Sampler, settings: Result<Arc<Value>, String>, n_predict_max: i32, n_cached: usize, lora: Vec<f32>) -> Self {
        Active {
            gen: Generation::new(task.params.stop.clone()),
            task,
            sampler,
            settings,
            n_predict_max,
            n_cached,
            sampled: None,
            i_batch: None,
            tokens: Vec::new(),
            probs: Vec::new(),
            n_decoded: 0,
            truncated: false,
            t_prompt: Instant::now(),
            prompt_ms: 0.0,
            t_gen: None,
            prompt_in_batch: false,
            lora,
            draft: Vec::new(),
            draft_i_batch: Vec::new(),
            n_draft_total: 0,
            n_draft_accepted: 0,
            n_draft_steps: 0,
            spec_ckpt: None,
            user_starts: Vec::new(),
            alora: None,
        }
    }

    fn timings(&self, n_cache: usize) -> Timings {
        Timings {
            cache_n: self.n_cached,
            prompt_n: n_cache.min(self.task.prompt.len()) - self.n_cached,
            prompt_ms: self.prompt_ms,
            predicted_n: self.n_decoded,
            predicted_ms: self.t_gen.map_or(0.0, |t| t.elapsed().as_secs_f64().max(1e-6) * 1e3),
            draft_n: self.n_draft_total,
            draft_n_accepted: self.n_draft_accepted,
        }
    }

    /// A prompt-progress chunk for a streamed task that asked for one; false if the client
    /// is gone.
    /// At the slot's start: a streamed task's first event, the 0% progress chunk with
    /// return_progress, else Begin. False when the client has gone.
    fn begin(&self, id_slot: usize, n_cache: usize) -> bool {
        let p = &self.task.params;
        match (p.stream, p.return_progress) {
            (true, true) => self.send_progress(id_slot, n_cache),
            (true, false) => self.task.events.send(Event::Begin).is_ok(),
            (false, _) => true,
        }
    }

    fn send_progress(&self, id_slot: usize, n_cache: usize) -> bool {
        let p = &self.task.params;
        if !(p.stream && p.return_progress) {
            return true;
        }
        let partial = Partial {
            index: self.task.index,
            content: String::new(),
            tokens: Vec::new(),
            id_slot,
            n_decoded: self.n_decoded,
            n_prompt: self.task.prompt.len(),
            probs: None,
            timings: p.timings_per_token.then(|| self.timings(n_cache)),
            progress: Some(Progress {
                total: self.task.prompt.len(),
                cache: self.n_cached,
                processed: n_cache,
                time_ms: self.t_prompt.elapsed().as_millis() as u64,
            }),
        };
        self.task.events.send(Event::Partial(partial)).is_ok()
    }
}

struct Slot {
    id: usize,
    /// Tokens of this slot's sequence now in the KV cache.
    cache: Vec<Token>,
    /// The draft model's context no longer holds `cache` (the slot was restored from a file).
    draft_stale: bool,
    /// Adapter scales `cache` was computed with.
    lora: Vec<f32>,
    last_used: Instant,
    active: Option<Active>,
    /// Context checkpoints of `cache`, oldest first.
    checkpoints: Vec<Checkpoint>,
    /// The first position of `cache` decoded with `lora` (an aLoRA's starts before its
    /// invocation; earlier ones had no adapter).
    adapter_from: usize,
    /// The id and settings (metrics form) of the task this slot ran last, for `/slots`.
    last: Option<(u64, Value)>,
}

impl Slot {
    /// Forgets the cached tokens (the caller drops them from the KV cache).
    fn forget(&mut self) {
        self.cache.clear();
        self.checkpoints.clear();
    }
}

struct Engine<'m> {
    /// Declared before `ctx`, which it points into, so that it is dropped first.
    spec: Option<Speculative>,
    ctx: Context<'m>,
    params: &'m ServerParams,
    slots: Vec<Slot>,
    batch: Batch,
    n_ctx_slot: usize,
    n_predict_default: i32,
    ctx_shift: bool,
    pending: VecDeque<Task>,
    slot_actions: VecDeque<(SlotAction, oneshot::Sender<Result<Value, ApiError>>)>,
    metrics: Arc<std::sync::Mutex<Metrics>>,
    shared: &'m Shared,
    prompt_cache: Option<PromptCache>,
    cache_idle_slots: bool,
    kv_unified: bool,
    slot_prompt_similarity: f32,
    n_cache_reuse: i32,
    adapters: &'m [LoraAdapter<'m>],
    /// The adapter scales the context decodes with now.
    applied_lora: Vec<f32>,
    /// Each adapter's aLoRA invocation tokens (empty for plain adapters).
    alora_tokens: Vec<Vec<Token>>,
    /// How far the context can cut a sequence back.
    seq_rm: SeqRm,
    /// The same for the drafter's context.
    draft_seq_rm: SeqRm,
    /// Sliding-window size the cache keeps (0 with --swa-full or without SWA).
    n_swa: usize,
    n_ubatch: usize,
    /// Context checkpoints, when the memory needs them and --ctx-checkpoints allows.
    checkpoints: Option<checkpoint::Policy>,
    /// Accepted draft tokens to decode again after a checkpoint restore, per slot.
    replays: Vec<(usize, Vec<Token>)>,
}

/// The probability of `token` and the `n` most likely tokens, by softmax over all logits
/// (llama-server's get_token_probabilities).
fn softmax_top(logits: &[f32], n: usize, token: Token) -> (f32, Vec<(Token, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let n = n.min(idx.len());
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
    }
    idx.truncate(n);
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let top = idx.iter().map(|&i| (i as Token, (logits[i] - max).exp() / sum)).collect();
    let prob = logits.get(token as usize).map_or(0.0, |&l| (l - max).exp() / sum);
    (prob, top)
}

/// A slot log line in llama-server's format: `slot <func>: id <slot> | task <task> | <msg>`.
/// A task's settings in the metrics form /slots shows.
fn metrics_settings(a: &Active) -> Value {
    let mut params = a.settings.as_deref().cloned().unwrap_or_default();
    if let Value::Object(p) = &mut params {
        p.retain(|k, _| !crate::request::FULL_ONLY.contains(&k.as_str()));
    }
    params
}

/// An exception llama.cpp threw for a request, as llama-server reports it (a 500).
fn exception(e: strata_ffi::FfiError) -> ApiError {
    ApiError::server(format!("got exception: {e}"))
}

/// Logs a failed drafter call; true when it failed. The drafter's copy of the slot's sequence
/// is then unreliable: drafts may be poor until it is rebuilt, but the target decides every
/// token, so the request goes on.
fn drafter_log(r: strata_ffi::Result<()>, slot: usize) -> bool {
    match r {
        Ok(()) => false,
        Err(e) => {
            slot_log_at(Verbosity::Warn, "update_slots", slot, -1, &format!("drafter call failed: {e}"));
            true
        }
    }
}

fn slot_log(func: &str, slot: usize, task: u64, msg: &str) {
    slot_log_at(Verbosity::Info, func, slot, task as i64, msg);
}

pub(crate) fn slot_log_at(level: Verbosity, func: &str, slot: usize, task: i64, msg: &str) {
    let func = &func[..func.len().min(12)];
    strata_ffi::log(level, &format!("slot {func:>12}: id {slot:2} | task {task} | {msg}\n"));
}

fn srv_log(level: Verbosity, func: &str, msg: &str) {
    let func = &func[..func.len().min(12)];
    strata_ffi::log(level, &format!("srv  {func:>12}: {msg}\n"));
}

pub(crate) fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<'m> Engine<'m> {
    fn new(
        ctx: Context<'m>,
        spec: Option<Speculative>,
        [seq_rm, draft_seq_rm]: [SeqRm; 2],
        cfg: &'m EngineConfig,
        shared: &'m Shared,
        adapters: &'m [LoraAdapter<'m>],
    ) -> Self {
        let metrics = shared.metrics.clone();
        let n_parallel = cfg.n_parallel.max(1);
        let n_ctx = ctx.n_ctx() as usize;
        let n_ctx_slot = if cfg.kv_unified { n_ctx } else { n_ctx / n_parallel };
        let batch = Batch::new(ctx.n_batch().max(1) as usize, 1);
        let ctx_shift = cfg.ctx_shift && ctx.can_shift();
        if cfg.ctx_shift && !ctx_shift {
            strata_ffi::log_info("srv  load_model: ctx_shift is not supported by this context, it will be disabled\n");
        }
        let now = Instant::now();
        let slots = (0..n_parallel)
            .map(|id| Slot {
                id,
                cache: Vec::new(),
                draft_stale: false,
                lora: Vec::new(),
                last_used: now,
                active: None,
                checkpoints: Vec::new(),
                adapter_from: 0,
                last: None,
            })
            .collect();
        let draft_ctx = spec.as_ref().is_some_and(Speculative::has_context);
        let prompt_cache = match cfg.cache_ram_mib {
            // The draft model's context keeps its own copy of each sequence, which the cache
            // does not hold.
            _ if draft_ctx => {
                srv_log(Verbosity::Trace, "load_model", "prompt cache is disabled with a draft model");
                None
            }
            0 => {
                srv_log(Verbosity::Trace, "load_model", "prompt cache is disabled - use `--cache-ram N` to enable it");
                None
            }
            mib => {
                let limit = if mib < 0 { "no limit".to_string() } else { format!("{mib} MiB") };
                srv_log(Verbosity::Trace, "load_model", &format!("prompt cache is enabled, size limit: {limit}"));
                srv_log(Verbosity::Trace, "load_model", "use `--cache-ram 0` to disable the prompt cache");
                Some(PromptCache::new(mib, n_ctx))
            }
        };
        let mut n_cache_reuse = cfg.n_cache_reuse;
        if n_cache_reuse > 0 && !ctx.can_shift() {
            srv_log(Verbosity::Warn, "load_model", "cache_reuse is not supported by this context, it will be disabled");
            n_cache_reuse = 0;
        }
        let mut cache_idle_slots = cfg.cache_idle_slots;
        if cache_idle_slots {
            if prompt_cache.is_none() {
                srv_log(Verbosity::Warn, "init", "--cache-idle-slots requires --cache-ram, disabling");
                cache_idle_slots = false;
            } else {
                let what = if cfg.kv_unified { "saved to prompt cache and cleared" } else { "saved to prompt cache" };
                srv_log(Verbosity::Trace, "init", &format!("idle slots will be {what} upon starting a new task"));
                srv_log(Verbosity::Debug, "init", "__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__");
            }
        }
        let n_swa = if cfg.swa_full { 0 } else { ctx.model().n_swa().max(0) as usize };
        if seq_rm == SeqRm::No {
            srv_log(Verbosity::Warn, "load_model", "speculative decoding not supported by this context");
        }
        if seq_rm == SeqRm::WholeOnly {
            srv_log(Verbosity::Trace, "load_model", "speculative decoding will use checkpoints");
        }
        let needs_checkpoints = matches!(seq_rm, SeqRm::WholeOnly | SeqRm::Bounded(_)) || n_swa > 0;
        let checkpoints =
            (cfg.n_ctx_checkpoints > 0 && needs_checkpoints).then_some(checkpoint::Policy { max: cfg.n_ctx_checkpoints, min_step: cfg.checkpoint_min_step });
        if cfg.n_ctx_checkpoints > 0 {
            let msg = format!("context checkpoints enabled, max = {}, min spacing = {}", cfg.n_ctx_checkpoints, cfg.checkpoint_min_step);
            srv_log(Verbosity::Trace, "load_model", &msg);
        } else {
            srv_log(Verbosity::Trace, "load_model", "context checkpoints disabled");
        }
        let n_ubatch = ctx.n_ubatch().max(1) as usize;
        Self {
            spec,
            ctx,
            params: &cfg.params,
            slots,
            batch,
            n_ctx_slot,
            n_predict_default: cfg.n_predict_default,
            ctx_shift,
            pending: VecDeque::new(),
            slot_actions: VecDeque::new(),
            metrics,
            shared,
            prompt_cache,
            cache_idle_slots,
            kv_unified: cfg.kv_unified,
            slot_prompt_similarity: cfg.slot_prompt_similarity,
            n_cache_reuse,
            adapters,
            applied_lora: Vec::new(),
            alora_tokens: adapters.iter().map(LoraAdapter::alora_invocation_tokens).collect(),
            seq_rm,
            draft_seq_rm,
            n_swa,
            n_ubatch,
            checkpoints,
            replays: Vec::new(),
        }
    }

    fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.slot_actions.is_empty() && self.slots.iter().all(|s| s.active.is_none())
    }

    fn take(&mut self, job: Job) {
        match job {
            Job::Task(t) => self.pending.push_back(*t),
            Job::Slot(a, reply) => self.slot_actions.push_back((a, reply)),
            Job::Wake(reply) => {
                let _ = reply.send(());
            }
            Job::Control { cmpl_id, action, reply } => {
                let _ = reply.send(self.control(&cmpl_id, &action));
            }
            Job::Slots(reply) => {
                let slots = (0..self.slots.len()).map(|id| self.slot_json(id)).collect();
                let n_idle = self.slots.iter().filter(|s| s.active.is_none()).count();
                let _ = reply.send((slots, n_idle));
            }
        }
    }

    /// Acts on a live completion at once, never deferred (llama-server's SERVER_TASK_TYPE_CONTROL).
    fn control(&mut self, cmpl_id: &str, action: &str) -> Value {
        let refused = |message: &str| serde_json::json!({"success": false, "message": message});
        let live = self.slots.iter_mut().filter_map(|s| s.active.as_mut()).find(|a| a.task.params.cmpl_id == cmpl_id);
        let Some(a) = live else {
            let msg = format!("control {action} on unknown completion id={cmpl_id}, no live slot");
            srv_log(Verbosity::Warn, "process_single_task", &msg);
            return refused("no active completion for this id");
        };
        if action != "reasoning_end" {
            return refused("unknown control action");
        }
        if a.task.params.sampling.get("reasoning_control").and_then(Value::as_bool) != Some(true) {
            return refused("reasoning control not enabled for this completion");
        }
        match a.sampler.end_reasoning() {
            Ok(_) => serde_json::json!({"success": true}),
            Err(e) => refused(&e.to_string()),
        }
    }

    /// Slot actions whose slot is idle run now; the others wait, as llama-server defers them.
    fn run_slot_actions(&mut self) {
        let mut waiting = VecDeque::new();
        while let Some((action, reply)) = self.slot_actions.pop_front() {
            let id = match &action {
                SlotAction::Save { id, .. } | SlotAction::Restore { id, .. } | SlotAction::Erase { id } => *id,
            };
            let Some(idx) = self.slot_by_id(id) else {
                let _ = reply.send(Err(ApiError::invalid("Invalid slot ID")));
                continue;
            };
            if self.slots[idx].active.is_some() {
                waiting.push_back((action, reply));
                continue;
            }
            let _ = reply.send(self.slot_action(action, idx));
        }
        self.slot_actions = waiting;
    }

    /// llama-server's get_slot_by_id: the id wraps around the slot count as an unsigned number,
    /// so every id finds a slot (-1 is the last of four).
    fn slot_by_id(&self, id: i32) -> Option<usize> {
        let n = self.slots.len() as u64;
        (n > 0).then(|| ((id as i64 as u64) % n) as usize)
    }

    /// Runs `action` on slot `idx`; the answer names the slot id as it was asked.
    fn slot_action(&mut self, action: SlotAction, idx: usize) -> Result<Value, ApiError> {
        let t0 = Instant::now();
        let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
        match action {
            SlotAction::Save { id, filename, path } => {
                let n = self.ctx.save_seq(&path, idx as i32, &self.slots[idx].cache);
                if n == 0 {
                    return Err(ApiError::server("Unable to save slot"));
                }
                Ok(serde_json::json!({
                    "id_slot": id, "filename": filename, "n_saved": self.slots[idx].cache.len(),
                    "n_written": n, "timings": {"save_ms": ms(t0)},
                }))
            }
            SlotAction::Restore { id, filename, path } => {
                let n_vocab = self.ctx.model().vocab().n_tokens();
                let restored = self.ctx.load_seq(&path, idx as i32, self.n_ctx_slot);
                let ok = restored.filter(|(_, toks)| toks.iter().all(|&t| (0..n_vocab).contains(&t)));
                let Some((n_read, tokens)) = ok else {
                    self.ctx.seq_rm(idx as i32, 0, -1);
                    self.slots[idx].forget();
                    return Err(ApiError::invalid("Unable to restore slot: No available space in KV cache or invalid slot save file"));
                };
                let n = tokens.len();
                self.slots[idx].forget();
                self.slots[idx].cache = tokens;
                if let Some(spec) = self.spec.as_mut().filter(|s| s.has_context()) {
                    drafter_log(spec.seq_rm(idx as i32, -1, -1), idx);
                    self.slots[idx].draft_stale = true;
                }
                Ok(serde_json::json!({
                    "id_slot": id, "filename": filename, "n_restored": n,
                    "n_read": n_read, "timings": {"restore_ms": ms(t0)},
                }))
            }
            SlotAction::Erase { id } => {
                let n = self.slots[idx].cache.len();
                self.ctx.seq_rm(idx as i32, 0, -1);
                if let Some(spec) = self.spec.as_mut() {
                    drafter_log(spec.seq_rm(idx as i32, -1, -1), idx);
                }
                self.slots[idx].forget();
                Ok(serde_json::json!({"id_slot": id, "n_erased": n}))
            }
        }
    }

    /// The idle slot for a task, and whether its cache should go through the prompt cache
    /// first: the slot asked for, else the one whose cache shares the most of the prompt (above
    /// the similarity threshold), else the least recently used (llama-server's
    /// get_available_slot).
    fn pick_slot(&self, task: &Task) -> Option<(usize, bool)> {
        let asked = (task.params.id_slot != -1).then(|| self.slot_by_id(task.params.id_slot)).flatten();
        if let Some(id) = asked {
            self.slots.get(id).filter(|s| s.active.is_none())?;
        }
        let idle = self.slots.iter().filter(|s| s.active.is_none() && asked.is_none_or(|id| id == s.id));
        if self.slot_prompt_similarity != 0.0 {
            let n_prompt = task.prompt.len().max(1) as f32;
            let similar = idle
                .clone()
                .filter(|s| !s.cache.is_empty())
                .map(|s| (s, common_prefix(&s.cache, &task.prompt)))
                .filter(|&(_, n)| n as f32 / n_prompt > self.slot_prompt_similarity)
                // the first of equally similar slots
                .rev()
                .max_by_key(|&(_, n)| n);
            if let Some((s, n)) = similar {
                // about to lose much of the slot's context: keep a copy in the prompt cache
                return Some((s.id, (n as f32) / (s.cache.len() as f32) < 0.5));
            }
        }
        if let Some(id) = asked {
            return Some((id, false));
        }
        // of equally old slots the last, as llama-server's `<=` scan picks it
        idle.rev().min_by_key(|s| s.last_used).map(|s| (s.id, true))
    }

    /// Saves slot `id`'s sequence to the prompt cache, then restores the cached prompt that
    /// serves `prompt` best, if one beats what the slot holds.
    fn swap_through_prompt_cache(&mut self, id: usize, prompt: &[Token]) {
        let Some(cache) = self.prompt_cache.as_mut() else { return };
        srv_log(Verbosity::Trace, "get_availabl", "updating prompt cache");
        let t0 = Instant::now();
        let ctx = &mut self.ctx;
        let slot = &mut self.slots[id];
        save_slot(cache, ctx, slot);
        if let Some(entry) = cache.take_best(&slot.cache, prompt) {
            if ctx.set_seq_state(id as i32, &entry.state, StateScope::Whole) {
                slot.cache = entry.tokens;
                slot.checkpoints = entry.checkpoints;
            } else {
                slot_log_at(Verbosity::Warn, "prompt_load", id, -1, "failed to load prompt from cache");
                ctx.seq_rm(id as i32, -1, -1);
                slot.forget();
            }
        }
        cache.update();
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        srv_log(Verbosity::Trace, "get_availabl", &format!("prompt cache update took {ms:.2} ms"));
    }

    /// Copies every idle slot to the prompt cache; with a unified KV cache also clears them,
    /// so the room goes to the slots that work.
    fn cache_idle_slots(&mut self) {
        let Some(cache) = self.prompt_cache.as_mut() else { return };
        for slot in self.slots.iter_mut().filter(|s| s.active.is_none()) {
            let id = slot.id as i32;
            slot_log_at(Verbosity::Trace, "process_sing", slot.id, -1, "saving idle slot to prompt cache");
            if save_slot(cache, &self.ctx, slot) {
                slot_log_at(Verbosity::Debug, "process_sing", slot.id, -1, "__TEST_TAG_CACHE_IDLE_SLOT__");
                cache.update();
            }
            if self.kv_unified && !slot.cache.is_empty() {
                self.ctx.seq_rm(id, -1, -1);
                slot.forget();
            }
        }
    }

    fn start(&mut self, id: usize, task: Task) {
        let n_prompt = task.prompt.len();
        if n_prompt == 0 && task.params.kind != TaskKind::Completion {
            let _ = task.events.send(Event::Error(ApiError::invalid("the prompt is empty")));
            return;
        }
        let n_vocab = self.ctx.model().vocab().n_tokens();
        if task.prompt.iter().any(|&t| !(0..n_vocab).contains(&t)) {
            let _ = task.events.send(Event::Error(ApiError::invalid("Prompt contains invalid tokens")));
            return;
        }
        if task.params.kind != TaskKind::Completion {
            self.start_embedding(id, task);
            return;
        }
        let model = self.ctx.model();
        let sampler = match Sampler::new(model, Some(self.params), &task.params.sampling) {
            Ok(s) => s,
            Err(e) => {
                let msg = format!("Failed to initialize samplers: {e}");
                let _ = task.events.send(Event::Error(ApiError::invalid(msg)));
                return;
            }
        };
        let n_predict = if task.params.n_predict != -1 { task.params.n_predict } else { self.n_predict_default };
        let settings = strata_ffi::sampling_settings(Some(self.params), &task.params.sampling, task.params.chat_format)
            .map(|s| Arc::new(crate::request::task_settings(&s, &task.params, n_predict as i64, false)))
            .map_err(|e| e.to_string());
        if n_prompt == 0 {
            // llama-server answers an empty prompt with an empty completion
            slot_log_at(Verbosity::Warn, "update_slots", id, task.id as i64, "empty prompt - releasing slot");
            let fin = Final {
                index: task.index,
                content: String::new(),
                tokens: Vec::new(),
                id_slot: id,
                n_decoded: 0,
                n_prompt: 0,
                stop: StopType::None,
                stopping_word: String::new(),
                truncated: false,
                has_new_line: false,
                timings: Timings::default(),
                probs: Vec::new(),
                settings: settings.clone().unwrap_or_default(),
            };
            let _ = task.events.send(match settings {
                Err(e) if task.params.settings_in_answer => Event::Error(ApiError::server(e)),
                _ => Event::Final(Box::new(fin)),
            });
            return;
        }
        if n_prompt >= self.n_ctx_slot {
            let err = ApiError::new(
                ErrorType::ExceedContextSize,
                format!("request ({n_prompt} tokens) exceeds the available context size ({} tokens), try increasing it", self.n_ctx_slot),
            );
            let _ = task.events.send(Event::Error(err.with("n_prompt_tokens", n_prompt).with("n_ctx", self.n_ctx_slot)));
            return;
        }
        let mut lora = self.lora_scales(&task.params.lora);
        let requested = lora.clone();
        let alora = match self.alora_start(&mut lora, &task.prompt, id, task.id) {
            Ok(a) => a,
            Err(e) => {
                let _ = task.events.send(Event::Error(e));
                return;
            }
        };
        let slot = &mut self.slots[id];
        // how much of the cache an aLoRA task may keep after other scales made it
        let mut adapter_cap = usize::MAX;
        if slot.lora != lora {
            // the cached KV was computed with other adapter scales; a cache made without adapters,
            // or before an aLoRA's invocation, serves an aLoRA request up to its own invocation
            let slot_alora = all_alora(&self.alora_tokens, &slot.lora);
            let keep_for_alora = (slot.lora.iter().all(|&s| s == 0.0) || slot_alora) && all_alora(&self.alora_tokens, &requested);
            if slot_alora {
                adapter_cap = slot.adapter_from;
            }
            if !slot.cache.is_empty() && !keep_for_alora {
                self.ctx.seq_rm(id as i32, -1, -1);
                if let Some(spec) = self.spec.as_mut() {
                    drafter_log(spec.seq_rm(id as i32, -1, -1), id);
                }
                slot.forget();
            }
            slot.lora = lora.clone();
        }
        let reusable = task.params.cache_prompt && !slot.draft_stale;
        slot.draft_stale = false;
        let mut keep = if reusable { common_prefix(&slot.cache, &task.prompt) } else { 0 }.min(adapter_cap);
        // the token before an aLoRA's invocation is decoded with the adapter
        slot.adapter_from = alora.map_or(0, |(_, start)| start.saturating_sub(1));
        if alora.is_some() {
            keep = keep.min(slot.adapter_from);
        }
        let n_cache_reuse = if task.params.n_cache_reuse < 0 { self.n_cache_reuse } else { task.params.n_cache_reuse };
        if reusable && n_cache_reuse > 0 {
            if self.ctx.can_shift() {
                keep = reuse_chunks(&mut self.ctx, self.spec.as_mut(), id, &mut slot.cache, &task.prompt, keep, n_cache_reuse as usize);
            } else {
                let msg = format!("cache reuse is not supported - ignoring n_cache_reuse = {n_cache_reuse}");
                slot_log_at(Verbosity::Warn, "update_slots", id, task.id as i64, &msg);
            }
        }
        // Sliding-window cells and recurrent state hold only the latest positions: the kept
        // prefix is usable as is only if they still reach back far enough, else from the nearest
        // context checkpoint, else not at all.
        let mut pos_next = keep as i32;
        let pos_min_thold = (pos_next - self.n_swa as i32 - i32::from(keep == n_prompt)).max(0);
        if keep > 0 && self.ctx.seq_pos_min(id as i32) >= pos_min_thold {
            let found = checkpoint::find(&slot.checkpoints, pos_next, pos_min_thold);
            let restored = found.filter(|&i| {
                let c = &slot.checkpoints[i];
                let spec_ok = match (self.spec.as_mut(), &c.spec) {
                    (Some(spec), Some(data)) => spec.restore(id as i32, data).is_ok(),
                    _ => true,
                };
                spec_ok && self.ctx.set_seq_state(id as i32, &c.tgt, StateScope::Partial)
            });
            match restored {
                Some(i) => {
                    let c = &slot.checkpoints[i];
                    pos_next = pos_next.min((c.pos_min + 1).max(c.pos_max));
                    keep = (pos_next.max(0) as usize).min(c.n_tokens);
                    let msg = format!(
                        "restored context checkpoint (pos_min = {}, pos_max = {}, n_tokens = {}, n_past = {keep}, size = {:.3} MiB)",
                        c.pos_min,
                        c.pos_max,
                        c.n_tokens,
                        c.size() as f64 / (1024.0 * 1024.0)
                    );
                    slot_log_at(Verbosity::Trace, "operator()", id, task.id as i64, &msg);
                }
                None => {
                    let msg = "forcing full prompt re-processing due to lack of cache data (likely due to SWA or hybrid/recurrent memory, see https://github.com/ggml-org/llama.cpp/pull/13194#issuecomment-2868343055)";
                    slot_log_at(Verbosity::Trace, "update_slots", id, task.id as i64, msg);
                    pos_next = 0;
                    keep = 0;
                }
            }
        }
        checkpoint::invalidate(&mut slot.checkpoints, pos_next, self.n_swa, id, task.id);
        // At least one prompt token must be decoded to get logits for the first sample.
        keep = keep.min(n_prompt - 1);
        if !self.ctx.seq_rm(id as i32, keep as i32, -1) {
            self.ctx.seq_rm(id as i32, 0, -1);
            keep = 0;
        }
        if let Some(spec) = self.spec.as_mut() {
            let seeded = spec.seq_rm(id as i32, keep as i32, -1).and_then(|()| match spec.has_synth() {
                true => spec.synth_seed(id as i32, &sampler),
                false => Ok(()),
            });
            if let Err(e) = seeded {
                let _ = task.events.send(Event::Error(exception(e)));
                return;
            }
        }
        slot.cache.truncate(keep);
        let n_predict_max = if task.params.n_predict != -1 { task.params.n_predict } else { self.n_predict_default };
        let mut sampler = sampler;
        if let Err(e) = task.prompt.iter().try_for_each(|&t| sampler.accept(t, false)) {
            let _ = task.events.send(Event::Error(exception(e)));
            return;
        }
        let starts = if self.checkpoints.is_some() { checkpoint::user_starts(&task.prompt, &task.params.message_delimiters) } else { Vec::new() };
        let mut active = Active::new(task, sampler, settings, n_predict_max, keep, lora);
        active.user_starts = starts;
        active.alora = alora;
        slot.active = Some(active);
        let a = slot.active.as_ref().expect("just started");
        if !a.begin(id, keep) {
            self.release(id);
        }
    }

    /// Where an aLoRA request's adapter starts: the last occurrence of its invocation tokens in
    /// the prompt. One without them runs without the adapter (its scale set to 0).
    fn alora_start(&self, lora: &mut [f32], prompt: &[Token], id: usize, task: u64) -> Result<Option<(usize, usize)>, ApiError> {
        if !all_alora(&self.alora_tokens, lora) {
            return Ok(None);
        }
        let enabled: Vec<usize> = (0..lora.len()).filter(|&i| lora[i] != 0.0).collect();
        let [i] = enabled[..] else {
            return Err(ApiError::invalid("Cannot run multiple aLoRAs in a single request"));
        };
        let invocation = &self.alora_tokens[i];
        match prompt.windows(invocation.len()).rposition(|w| w == invocation.as_slice()) {
            Some(start) => {
                slot_log_at(Verbosity::Debug, "launch_slot_", id, task as i64, &format!("alora {i} activated starting at {start}"));
                Ok(Some((i, start)))
            }
            None => {
                slot_log_at(Verbosity::Debug, "launch_slot_", id, task as i64, &format!("alora {i} requested, but not found. deactivating"));
                lora[i] = 0.0;
                Ok(None)
            }
        }
    }

    /// The adapter scales for a task: its own (unlisted adapters at 0), else the global ones.
    fn lora_scales(&self, asked: &Option<Vec<(i64, f32)>>) -> Vec<f32> {
        match asked {
            Some(list) => (0..self.adapters.len()).map(|i| listed_scale(list, i)).collect(),
            None => self.shared.lora.lock().map(|l| l.iter().map(|a| a.scale).collect()).unwrap_or_default(),
        }
    }

    /// Embedding and rerank tasks: the whole prompt goes into one ubatch (the model may attend
    /// both ways), nothing is kept from earlier prompts, and the sequence is dropped afterwards.
    fn start_embedding(&mut self, id: usize, task: Task) {
        let n_prompt = task.prompt.len();
        let n_ubatch = self.ctx.n_ubatch() as usize;
        if n_prompt > n_ubatch {
            let msg = format!("input ({n_prompt} tokens) is too large to process. increase the physical batch size (current batch size: {n_ubatch})");
            let _ = task.events.send(Event::Error(ApiError::server(msg)));
            return;
        }
        if n_prompt > self.n_ctx_slot {
            let msg = format!("input ({n_prompt} tokens) is larger than the max context size ({} tokens). skipping", self.n_ctx_slot);
            let _ = task.events.send(Event::Error(ApiError::new(ErrorType::ExceedContextSize, msg)));
            return;
        }
        let sampler = match Sampler::new(self.ctx.model(), Some(self.params), &Value::Null) {
            Ok(s) => s,
            Err(e) => {
                let _ = task.events.send(Event::Error(ApiError::server(e.to_string())));
                return;
            }
        };
        self.ctx.seq_rm(id as i32, -1, -1);
        let lora = self.lora_scales(&task.params.lora);
        let slot = &mut self.slots[id];
        slot.forget();
        slot.lora = lora.clone();
        slot.active = Some(Active::new(task, sampler, Ok(Arc::default()), 0, 0, lora));
    }

    /// Reads a finished embedding or rerank task's result from the last decode, answers it and
    /// frees the slot's sequence.
    fn finish_embedding(&mut self, id: usize) {
        let pooled = self.ctx.pooling_type() != 0;
        let (kind, first, n_tokens, index) = {
            let a = self.slots[id].active.as_ref().expect("an embedding slot is active");
            (a.task.params.kind, a.i_batch.unwrap_or(0), a.task.prompt.len(), a.task.index)
        };
        let n_embd = self.ctx.model().n_embd_out().max(0) as usize;
        let mut out = Embedding { index, n_tokens, data: Vec::new(), score: 0.0 };
        match kind {
            TaskKind::Rerank => {
                let score = match self.ctx.embeddings_seq(id as i32) {
                    Some(e) if !e.is_empty() => e[0],
                    _ => self.ctx.embeddings_ith(first + n_tokens as i32 - 1).and_then(|e| e.first().copied()).unwrap_or(-1e6),
                };
                out.score = score;
            }
            TaskKind::Embedding { normalize } if pooled => {
                let v = self.ctx.embeddings_seq(id as i32).map(<[f32]>::to_vec).unwrap_or_else(|| vec![0.0; n_embd]);
                out.data.push(normalize_embedding(&v, normalize));
            }
            TaskKind::Embedding { .. } => {
                for i in 0..n_tokens as i32 {
                    let v = self.ctx.embeddings_ith(first + i).map(<[f32]>::to_vec).unwrap_or_else(|| vec![0.0; n_embd]);
                    out.data.push(v);
                }
            }
            TaskKind::Completion => unreachable!("completions are sampled"),
        }
        let a = self.release(id).expect("an embedding slot is active");
        if let Ok(mut m) = self.metrics.lock() {
            // no token is sampled, but the prompt was decoded
            m.on_prompt(n_tokens as u64, a.t_prompt.elapsed().as_micros() as u64);
        }
        self.ctx.seq_rm(id as i32, -1, -1);
        self.slots[id].forget();
        let _ = a.task.events.send(Event::Embedding(out));
    }

    /// A slot as llama-server's /slots shows it (its metrics form): the task it runs, or ran
    /// last, with that task's settings and progress.
    fn slot_json(&self, id: usize) -> Value {
        let slot = &self.slots[id];
        let mut v = serde_json::json!({
            "id": id,
            "n_ctx": self.n_ctx_slot,
            "speculative": self.spec.is_some(),
            "is_processing": slot.active.is_some(),
        });
        // an idle slot keeps its last task's id and settings; its counters start again
        let task = match (&slot.active, &slot.last) {
            (Some(a), _) => {
                let n_remain = if a.n_predict_max == -1 { -1 } else { a.n_predict_max as i64 - a.n_decoded as i64 };
                let processed = a.task.prompt.len().saturating_sub(a.n_cached);
                Some((a.task.id, metrics_settings(a), processed, a.n_cached, true, a.gen.has_new_line, n_remain, a.n_decoded))
            }
            (None, Some((id, params))) => Some((*id, params.clone(), 0, 0, false, false, -1, 0)),
            (None, None) => None,
        };
        if let Some((id_task, params, processed, cached, has_next, has_new_line, n_remain, n_decoded)) = task {
            v["id_task"] = id_task.into();
            v["n_prompt_tokens"] = slot.cache.len().into();
            v["n_prompt_tokens_processed"] = processed.into();
            v["n_prompt_tokens_cache"] = cached.into();
            v["params"] = params;
            v["next_token"] = serde_json::json!([{
                "has_next_token": has_next,
                "has_new_line": has_new_line,
                "n_remain": n_remain,
                "n_decoded": n_decoded,
            }]);
        }
        v
    }

    fn release(&mut self, id: usize) -> Option<Active> {
        let slot = &mut self.slots[id];
        slot.last_used = Instant::now();
        let a = slot.active.take()?;
        slot.last = Some((a.task.id, metrics_settings(&a)));
        let msg = format!("stop processing: n_tokens = {}, truncated = {}", slot.cache.len(), a.truncated as i32);
        slot_log("release", id, a.task.id, &msg);
        crate::experts::request_done();
        // Before the final answer goes out, so a client that reads /metrics right after it
        // sees the slot idle.
        self.publish();
        Some(a)
    }

    /// The request gauges of /metrics.
    fn publish(&self) {
        if let Ok(mut m) = self.metrics.lock() {
            m.n_processing = self.slots.iter().filter(|s| s.active.is_some()).count();
            m.n_deferred = self.pending.len();
        }
    }

    /// llama-server's context shift: when a generating slot's context is full, keep the first
    /// n_keep tokens, drop the next n_discard (half the rest by default), and slide the others
    /// back.
    fn shift_if_full(&mut self, id: usize) {
        let bos = self.ctx.model().vocab().add_bos();
        let n_ctx = self.n_ctx_slot as i64;
        let slot = &mut self.slots[id];
        let Some(a) = slot.active.as_mut() else { return };
        let n_tokens = slot.cache.len() as i64;
        if a.t_gen.is_none() || n_tokens + 1 < n_ctx {
            return;
        }
        let mut n_keep = if a.task.params.n_keep < 0 { a.task.prompt.len() as i64 } else { a.task.params.n_keep as i64 };
        if bos {
            n_keep += 1;
        }
        let n_keep = n_keep.min(n_ctx - 4).max(0);
        let n_left = n_tokens - n_keep;
        let n_discard = if a.task.params.n_discard != 0 { a.task.params.n_discard as i64 } else { n_left / 2 };
        let n_discard = n_discard.clamp(0, (n_left - 1).max(0));
        let msg = format!("slot context shift, n_keep = {n_keep}, n_left = {n_left}, n_discard = {n_discard}");
        let task_id = a.task.id;
        a.truncated = true;
        self.ctx.seq_rm(id as i32, n_keep as i32, (n_keep + n_discard) as i32);
        self.ctx.seq_add(id as i32, (n_keep + n_discard) as i32, n_tokens as i32, -(n_discard as i32));
        if let Some(spec) = self.spec.as_mut() {
            let shifted = spec
                .seq_rm(id as i32, n_keep as i32, (n_keep + n_discard) as i32)
                .and_then(|()| spec.seq_add(id as i32, (n_keep + n_discard) as i32, n_tokens as i32, -(n_discard as i32)));
            if drafter_log(shifted, id) {
                slot.draft_stale = true;
            }
        }
        slot.cache.drain(n_keep as usize..(n_keep + n_discard) as usize);
        // checkpoints past the kept head hold positions the shift moved
        slot.checkpoints.retain(|c| c.n_tokens <= n_keep as usize);
        slot_log("update_slots", id, task_id, &msg);
    }

    /// The timing lines llama-server prints when a request completes (never for a cancelled one).
    fn print_timings(&self, id: usize, t: &Timings, task: u64) {
        let (pp, pn, gp, gn) = (t.prompt_ms, t.prompt_n, t.predicted_ms, t.predicted_n);
        let lines = [
            format!(
                "prompt eval time = {pp:10.2} ms / {pn:5} tokens ({:8.2} ms per token, {:8.2} tokens per second)",
                t.prompt_per_token_ms(),
                t.prompt_per_second()
            ),
            format!(
                "       eval time = {gp:10.2} ms / {gn:5} tokens ({:8.2} ms per token, {:8.2} tokens per second)",
                t.predicted_per_token_ms(),
                t.predicted_per_second()
            ),
            format!("      total time = {:10.2} ms / {:5} tokens", pp + gp, pn + gn),
            format!("   graphs reused = {:10}", self.ctx.graphs_reused()),
        ];
        for l in lines {
            slot_log("print_timings", id, task, &l);
        }
    }

    /// One batch: admit, build, decode, sample. Returns whether anything was decoded.
    fn step(&mut self) -> bool {
        // Admit in arrival order; a task waiting for a particular busy slot does not hold back
        // the ones behind it.
        let mut waiting = VecDeque::new();
        while let Some(task) = self.pending.pop_front() {
            if task.events.is_closed() {
                // The client went away while the task waited: it never takes a slot.
                self.shared.admission.leave(1);
                continue;
            }
            match self.pick_slot(&task) {
                Some((id, update_cache)) => {
                    self.shared.admission.leave(1);
                    if update_cache {
                        self.swap_through_prompt_cache(id, &task.prompt);
                    }
                    self.start(id, task);
                    if self.cache_idle_slots && self.slots[id].active.is_some() {
                        self.cache_idle_slots();
                    }
                }
                None => waiting.push_back(task),
            }
        }
        self.pending = waiting;
        for id in 0..self.slots.len() {
            if self.slots[id].active.as_ref().is_some_and(|a| a.task.events.is_closed()) {
                self.release(id);
            }
        }

        if self.ctx_shift {
            for id in 0..self.slots.len() {
                self.shift_if_full(id);
            }
        }
        self.batch.clear();
        let capacity = self.ctx.n_batch() as usize;
        // One batch decodes with one set of adapter scales; slots asking for others wait.
        let mut batch_lora: Option<Vec<f32>> = None;
        let mut failed = Vec::new();
        for slot in &mut self.slots {
            let Some(a) = slot.active.as_mut() else { continue };
            a.i_batch = None;
            // With more generating slots than -b, the rest wait for the next step.
            if self.batch.len() >= capacity {
                continue;
            }
            if a.sampled.is_some() && batch_lora.as_ref().is_some_and(|l| *l != a.lora) {
                continue;
            }
            if let Some(t) = a.sampled.take() {
                batch_lora.get_or_insert_with(|| a.lora.clone());
                let room = capacity - self.batch.len() - 1;
                let draft = match self.spec.as_mut().filter(|_| self.seq_rm != SeqRm::No) {
                    Some(spec) => {
                        let n_max = draft_max(a, slot.cache.len(), self.n_ctx_slot).min(room).min(spec.n_max());
                        let id = slot.id as i32;
                        let drafted = (|| {
                            // a draft context that cannot cut drafted tokens back gets its state back instead
                            let saved = (self.draft_seq_rm == SeqRm::WholeOnly && n_max > 0).then(|| spec.checkpoint(id, false)).transpose()?;
                            let draft = if n_max > 0 { spec.draft(id, &slot.cache, t, n_max)? } else { Vec::new() };
                            if let Some(state) = saved {
                                spec.restore(id, &state)?;
                            }
                            // Drafting decodes into the draft context; it gets this batch next, as the target does.
                            spec.seq_rm(id, slot.cache.len() as i32, -1)?;
                            Ok::<_, strata_ffi::FfiError>(draft)
                        })();
                        match drafted {
                            Ok(d) => d,
                            Err(e) => {
                                failed.push((slot.id, e));
                                continue;
                            }
                        }
                    }
                    None => Vec::new(),
                };
                // A context that cannot drop a rejected draft's tail is restored from a copy.
                let needs_ckpt = match self.seq_rm {
                    SeqRm::WholeOnly => !draft.is_empty(),
                    SeqRm::Bounded(n) => draft.len() > n,
                    _ => false,
                };
                a.spec_ckpt = None;
                if needs_ckpt {
                    let id = slot.id as i32;
                    let (pos_min, pos_max) = (self.ctx.seq_pos_min(id), self.ctx.seq_pos_max(id));
                    let spec_state = match self.spec.as_mut().map(|s| s.checkpoint(id, true)).transpose() {
                        Ok(s) => s,
                        Err(e) => {
                            failed.push((slot.id, e));
                            continue;
                        }
                    };
                    a.spec_ckpt = self.ctx.seq_state(id, StateScope::Partial).map(|tgt| Checkpoint {
                        n_tokens: slot.cache.len(),
                        pos_min,
                        pos_max,
                        task: a.task.id,
                        tgt,
                        spec: spec_state,
                    });
                }
                let i0 = self.batch.len() as i32;
                a.i_batch = Some(i0);
                self.batch.add(t, slot.cache.len() as i32, &[slot.id as i32], true).expect("batch has room");
                slot.cache.push(t);
                for &d in &draft {
                    self.batch.add(d, slot.cache.len() as i32, &[slot.id as i32], true).expect("batch has room");
                    slot.cache.push(d);
                }
                a.n_draft_total += draft.len();
                a.draft_i_batch = if draft.is_empty() { Vec::new() } else { (i0..=i0 + draft.len() as i32).collect() };
                a.draft = draft;
            }
        }
        for (id, e) in failed {
            self.fail_slot(id, e);
        }
        for slot in &mut self.slots {
            let Some(a) = slot.active.as_mut() else { continue };
            let n_prompt = a.task.prompt.len();
            let lora_ok = batch_lora.as_ref().is_none_or(|l| *l == a.lora);
            if a.task.params.kind != TaskKind::Completion {
                // the whole prompt in this batch, or wait for one with room
                a.prompt_in_batch = lora_ok && slot.cache.is_empty() && self.batch.len() + n_prompt <= capacity;
                if a.prompt_in_batch {
                    batch_lora.get_or_insert_with(|| a.lora.clone());
                    a.i_batch = Some(self.batch.len() as i32);
                    for (pos, &t) in a.task.prompt.iter().enumerate() {
                        self.batch.add(t, pos as i32, &[slot.id as i32], true).expect("batch has room");
                        slot.cache.push(t);
                    }
                }
                continue;
            }
            // an aLoRA's uncached prompt before its invocation goes without the adapter
            let mut scales = a.lora.clone();
            let mut n_end = n_prompt;
            if let Some((i, start)) = a.alora.filter(|&(_, start)| start > slot.cache.len() + 1) {
                scales[i] = 0.0;
                n_end = start - 1;
            }
            let lora_ok = batch_lora.as_ref().is_none_or(|l| *l == scales);
            a.prompt_in_batch = lora_ok && a.t_gen.is_none() && slot.cache.len() < n_prompt && self.batch.len() < capacity;
            if !a.prompt_in_batch {
                continue;
            }
            batch_lora.get_or_insert(scales);
            let n_start = slot.cache.len();
            // The last 4 + n_ubatch and the last 4 tokens start batches of their own, so that
            // checkpoints can be taken just before them.
            // and so do user messages, the last one always, the others when spaced apart
            let breaks = [(4 + self.n_ubatch).min(capacity), 4.min(capacity)];
            let last_user = a.user_starts.last().copied();
            let min_step = self.checkpoints.map_or(0, |p| p.min_step);
            let spaced = |list: &[Checkpoint], pos: usize| list.last().is_none_or(|c| pos > c.n_tokens + min_step);
            while slot.cache.len() < n_end && self.batch.len() < capacity {
                let pos = slot.cache.len();
                let t = a.task.prompt[pos];
                let last = pos + 1 == n_prompt;
                self.batch.add(t, pos as i32, &[slot.id as i32], last).expect("batch has room");
                slot.cache.push(t);
                if last {
                    a.i_batch = Some(self.batch.len() as i32 - 1);
                }
                let next = slot.cache.len();
                if self.checkpoints.is_some() {
                    let user = a.user_starts.binary_search(&next).is_ok() && (Some(next) == last_user || spaced(&slot.checkpoints, next));
                    if user || breaks.contains(&(n_prompt - next)) {
                        break;
                    }
                }
            }
            if self.checkpoints.is_some() {
                // taken before the decode: the state covers the tokens before this batch
                let near_end = n_prompt < slot.cache.len() + self.n_ubatch;
                let at_user = a.user_starts.binary_search(&n_start).is_ok();
                let wanted = near_end || (at_user && (Some(n_start) == last_user || spaced(&slot.checkpoints, n_start)));
                let pos_min = self.ctx.seq_pos_min(slot.id as i32);
                if let Some(policy) = self.checkpoints.filter(|_| wanted && pos_min >= 0) {
                    let pos_max = self.ctx.seq_pos_max(slot.id as i32);
                    take_checkpoint(&self.ctx, self.spec.as_mut(), slot, policy, n_start, pos_min, pos_max);
                }
            }
        }
        if self.batch.is_empty() {
            return false;
        }
        if let Some(lora) = batch_lora.filter(|l| !self.adapters.is_empty() && *l != self.applied_lora) {
            self.ctx.set_lora(self.adapters, &lora);
            self.applied_lora = lora;
        }
        if !self.decode_batch() {
            return true;
        }
        if let Ok(mut m) = self.metrics.lock() {
            let busy = self.slots.iter().filter(|s| s.active.is_some()).count() as u64;
            let longest = self.slots.iter().map(|s| s.cache.len() as u64).max().unwrap_or(0);
            m.on_decode(busy, longest);
        }
        for id in 0..self.slots.len() {
            let slot = &mut self.slots[id];
            let Some(a) = slot.active.as_mut().filter(|a| a.prompt_in_batch) else { continue };
            a.prompt_ms = a.t_prompt.elapsed().as_secs_f64() * 1e3;
            if !a.send_progress(id, slot.cache.len()) {
                self.release(id);
            }
        }
        for id in 0..self.slots.len() {
            let Some(a) = self.slots[id].active.as_ref() else { continue };
            if a.task.params.kind != TaskKind::Completion {
                if a.prompt_in_batch {
                    self.finish_embedding(id);
                }
                continue;
            }
            if !a.draft.is_empty() {
                self.verify_draft(id);
            } else if let Some(i) = a.i_batch {
                self.sample(id, i);
            }
        }
        self.decode_replays();
        true
    }

    /// Decodes the batch in the target context and in the drafter's. On failure every
    /// processing slot fails and its sequence is dropped, as in llama-server; returns false.
    fn decode_batch(&mut self) -> bool {
        let res = self.ctx.decode(&self.batch);
        crate::experts::after_step();
        let msg = match res {
            Err(DecodeError::NoKvCacheSlot) => "Context size has been exceeded.",
            Err(DecodeError::InvalidBatch) => "Invalid input batch.",
            Err(DecodeError::Aborted) => "Decoding was aborted.",
            Err(DecodeError::Fatal(_)) => "Compute error.",
            // The draft model (or MTP head) sees every target batch, prompts included.
            Ok(()) => match self.spec.as_mut().map(|spec| spec.process(&mut self.ctx, &self.batch)) {
                None | Some(Ok(())) => return true,
                Some(Err(e)) => {
                    srv_log(Verbosity::Error, "update_slots", &format!("failed to process speculative batch: {e}"));
                    "failed to process speculative batch"
                }
            },
        };
        for id in 0..self.slots.len() {
            if let Some(a) = self.release(id) {
                let _ = a.task.events.send(Event::Error(ApiError::server(msg)));
                self.ctx.seq_rm(id as i32, -1, -1);
                if let Some(spec) = self.spec.as_mut() {
                    drafter_log(spec.seq_rm(id as i32, -1, -1), id);
                }
                self.slots[id].forget();
            }
        }
        false
    }

    /// A llama.cpp call failed for one slot (an exception caught at the shim): its request
    /// ends with the message and its sequence is dropped, as llama-server's slot loop does.
    fn fail_slot(&mut self, id: usize, e: strata_ffi::FfiError) {
        let err = exception(e);
        let task = self.slots[id].active.as_ref().map_or(-1, |a| a.task.id as i64);
        slot_log_at(Verbosity::Error, "operator()", id, task, &err.message);
        if let Some(a) = self.release(id) {
            let _ = a.task.events.send(Event::Error(err));
        }
        self.ctx.seq_rm(id as i32, -1, -1);
        if let Some(spec) = self.spec.as_mut() {
            drafter_log(spec.seq_rm(id as i32, -1, -1), id);
        }
        self.slots[id].forget();
    }

    /// Decodes again, in one batch, the accepted draft tokens that checkpoint restores dropped.
    fn decode_replays(&mut self) {
        if self.replays.is_empty() {
            return;
        }
        self.batch.clear();
        let replays = std::mem::take(&mut self.replays);
        for (id, tokens) in &replays {
            let slot = &mut self.slots[*id];
            for &t in tokens {
                self.batch.add(t, slot.cache.len() as i32, &[*id as i32], false).expect("replays fit the batch they came from");
                slot.cache.push(t);
            }
        }
        if !self.decode_batch() {
            // slots that finished with this batch hold no usable sequence either
            for (id, _) in replays {
                self.ctx.seq_rm(id as i32, -1, -1);
                self.slots[id].forget();
            }
        }
    }

    /// Checks a slot's draft against the model's own samples: keeps the matching prefix, drops
    /// the rest from the KV cache, and emits every accepted token plus the model's next one.
    fn verify_draft(&mut self, id: usize) {
        let slot = &mut self.slots[id];
        let a = slot.active.as_mut().expect("a drafting slot is active");
        let draft = std::mem::take(&mut a.draft);
        let idxs = std::mem::take(&mut a.draft_i_batch);
        let accepted = match self.spec.as_mut().filter(|s| s.has_synth()) {
            Some(spec) => spec.accept_synth(id as i32, &mut a.sampler, &mut self.ctx, &idxs, &draft),
            None => a.sampler.sample_and_accept_n(&mut self.ctx, &idxs, &draft),
        };
        let n_accepted = accepted.as_ref().map_or(0, |a| a.len().saturating_sub(1));
        let accepted = match accepted.and_then(|acc| match self.spec.as_mut() {
            Some(spec) => spec.accept(id as i32, n_accepted as u16).map(|()| acc),
            None => Ok(acc),
        }) {
            Ok(acc) => acc,
            Err(e) => {
                self.fail_slot(id, e);
                return;
            }
        };
        let slot = &mut self.slots[id];
        let a = slot.active.as_mut().expect("a drafting slot is active");
        a.n_draft_accepted += n_accepted;
        a.n_draft_steps += 1;
        // The cache holds the sampled token and the whole draft; keep the accepted part.
        let keep = slot.cache.len() - draft.len() + n_accepted;
        let n_rollback = draft.len() - n_accepted;
        let too_far = match self.seq_rm {
            SeqRm::WholeOnly => n_rollback > 0,
            SeqRm::Bounded(n) => n_rollback > n,
            _ => false,
        };
        let ckpt = a.spec_ckpt.take();
        match ckpt.filter(|_| too_far) {
            Some(c) => {
                // back to the state before the draft; the accepted tokens are decoded again
                // once every slot has read this batch's outputs
                self.ctx.set_seq_state(id as i32, &c.tgt, StateScope::Partial);
                self.ctx.seq_rm(id as i32, c.n_tokens as i32, -1);
                if let Some(spec) = self.spec.as_mut() {
                    let restored = c.spec.as_ref().map_or(Ok(()), |data| spec.restore(id as i32, data));
                    if drafter_log(restored.and_then(|()| spec.seq_rm(id as i32, c.n_tokens as i32, -1)), id) {
                        slot.draft_stale = true;
                    }
                }
                self.replays.push((id, slot.cache[c.n_tokens..keep].to_vec()));
                slot.cache.truncate(c.n_tokens);
            }
            None => {
                slot.cache.truncate(keep);
                self.ctx.seq_rm(id as i32, keep as i32, -1);
                if let Some(spec) = self.spec.as_mut() {
                    if drafter_log(spec.seq_rm(id as i32, keep as i32, -1), id) {
                        slot.draft_stale = true;
                    }
                }
            }
        }
        for (k, &token) in accepted.iter().enumerate() {
            if !self.emit(id, token, idxs[k]) {
                return;
            }
        }
    }

    fn sample(&mut self, id: usize, i: i32) {
        let slot = &mut self.slots[id];
        let a = slot.active.as_mut().unwrap();
        let begun = match self.spec.as_mut().filter(|_| a.t_gen.is_none()) {
            // the prompt is in the context now: drafters that follow the target start from it
            Some(spec) => spec.begin(id as i32, &slot.cache),
            None => Ok(()),
        };
        let sampled = begun.and_then(|()| a.sampler.sample(&mut self.ctx, i)).and_then(|t| a.sampler.accept(t, true).map(|()| t));
        match sampled {
            Ok(token) => {
                self.emit(id, token, i);
            }
            Err(e) => self.fail_slot(id, e),
        }
    }

    /// Accounts for one generated token (sampled from batch output `i`): stop conditions,
    /// streaming, and the final answer. Returns false once the slot has been released.
    fn emit(&mut self, id: usize, token: Token, i: i32) -> bool {
        let vocab = self.ctx.model().vocab();
        let n_ctx_slot = self.n_ctx_slot;
        let ctx_shift = self.ctx_shift;
        let slot = &mut self.slots[id];
        let a = slot.active.as_mut().unwrap();
        let now = Instant::now();
        if a.t_gen.is_none() {
            a.prompt_ms = (now - a.t_prompt).as_secs_f64() * 1e3;
            a.t_gen = Some(now);
            if let Ok(mut m) = self.metrics.lock() {
                m.on_prompt((a.task.prompt.len() - a.n_cached) as u64, (a.prompt_ms * 1e3) as u64);
                m.on_prompt_cached(a.n_cached as u64);
            }
        }
        a.n_decoded += 1;
        let is_eog = vocab.is_eog(token) && !a.task.params.ignore_eos;
        let piece = vocab.token_to_piece(token, false);
        let probs = (a.task.params.n_probs > 0).then(|| {
            let n = a.task.params.n_probs.min(vocab.n_tokens() as usize);
            let (prob, ranked) = if a.task.params.post_sampling_probs {
                a.sampler.candidates(token, n).unwrap_or_default()
            } else {
                softmax_top(self.ctx.logits_ith(i).unwrap_or(&[]), n, token)
            };
            let top = ranked.iter().take(n).map(|&(t, p)| (t, vocab.token_to_piece(t, false), p)).collect();
            TokenProbs { token, piece: Vec::new(), prob, top }
        });
        let sent = a.gen.push(&piece, is_eog);
        // As llama-server: a token's entry carries the text sent with it, which may include the
        // bytes of tokens held back inside a UTF-8 character (those get no entry of their own).
        let probs = probs.filter(|_| sent.is_some()).map(|p| TokenProbs { piece: sent.clone().unwrap_or_default(), ..p });
        let text = sent.clone().unwrap_or_default();
        a.tokens.push(token);

        if !a.gen.finished() {
            if !ctx_shift && slot.cache.len() + 1 >= n_ctx_slot {
                a.truncated = true;
                a.gen.stop = StopType::Limit;
            } else if (a.n_predict_max != -1 && a.n_decoded as i64 >= a.n_predict_max as i64)
                || (a.gen.has_new_line
                    && a.task.params.t_max_predict_ms > 0
                    && a.t_gen.is_some_and(|t| t.elapsed().as_millis() as i64 > a.task.params.t_max_predict_ms))
            {
                a.gen.stop = StopType::Limit;
            }
        }
        if is_eog {
            a.gen.stop = StopType::Eos;
        }
        let n_prompt = a.task.prompt.len();
        if a.task.params.stream && sent.is_some() {
            let partial = Partial {
                index: a.task.index,
                content: String::from_utf8_lossy(&text).into_owned(),
                tokens: vec![token],
                id_slot: id,
                n_decoded: a.n_decoded,
                n_prompt,
                probs: probs.clone(),
                timings: a.task.params.timings_per_token.then(|| a.timings(slot.cache.len())),
                progress: None,
            };
            if a.task.events.send(Event::Partial(partial)).is_err() {
                self.release(id);
                return false;
            }
        }
        if let Some(p) = probs {
            a.probs.push(p);
        }
        if !a.gen.finished() {
            a.sampled = Some(token);
            return true;
        }
        let predicted_ms = a.t_gen.map_or(0.0, |t| t.elapsed().as_secs_f64().max(1e-6) * 1e3);
        let timings = Timings {
            cache_n: a.n_cached,
            prompt_n: a.task.prompt.len() - a.n_cached,
            prompt_ms: a.prompt_ms,
            predicted_n: a.n_decoded,
            predicted_ms,
            draft_n: a.n_draft_total,
            draft_n_accepted: a.n_draft_accepted,
        };
        let drafts = (a.n_draft_total, a.n_draft_accepted, a.n_draft_steps);
        let task_id = a.task.id;
        if let Ok(mut m) = self.metrics.lock() {
            m.on_prediction(a.n_decoded as u64, a.n_decoded.saturating_sub(1) as u64, (predicted_ms * 1e3) as u64);
            m.on_drafts(drafts.0 as u64, drafts.1 as u64, drafts.2 as u64);
        }
        self.print_timings(id, &timings, task_id);
        if drafts.0 > 0 {
            let (n_draft, n_acc, steps) = drafts;
            let mean_len = if steps > 0 { 1.0 + n_acc as f64 / steps as f64 } else { 1.0 };
            let msg =
                format!("draft acceptance = {:0.5} ({n_acc:5} accepted / {n_draft:5} generated), mean len = {mean_len:5.2}", n_acc as f32 / n_draft as f32);
            slot_log("print_timings", id, task_id, &msg);
        }
        let a = self.release(id).unwrap();
        let stream = a.task.params.stream;
        let fin = Final {
            index: a.task.index,
            content: if stream { String::new() } else { a.gen.text() },
            tokens: if stream || !a.task.params.return_tokens { Vec::new() } else { a.tokens.clone() },
            id_slot: id,
            n_decoded: a.n_decoded,
            n_prompt,
            stop: a.gen.stop,
            stopping_word: a.gen.stopping_word.clone(),
            truncated: a.truncated,
            has_new_line: a.gen.has_new_line,
            timings,
            probs: if stream { Vec::new() } else { a.probs },
            settings: a.settings.clone().unwrap_or_default(),
        };
        if let (Err(e), true) = (&a.settings, a.task.params.settings_in_answer) {
            let _ = a.task.events.send(Event::Error(ApiError::server(e.clone())));
            return false;
        }
        let _ = a.task.events.send(Event::Final(Box::new(fin)));
        false
    }
}

/// STRATA_OP_PROFILE=FILE: per-op times of each prompt batch (diagnostics; runs the graph node by node).
fn with_op_profile(p: strata_ffi::ContextParams) -> strata_ffi::ContextParams {
    let Some(path) = std::env::var_os("STRATA_OP_PROFILE") else { return p };
    match p.with_op_profile(std::path::Path::new(&path)) {
        Ok(p) => p,
        Err(e) => {
            strata_ffi::log(strata_ffi::Verbosity::Warn, &format!("STRATA_OP_PROFILE: cannot write {}: {e}\n", path.to_string_lossy()));
            p
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_top_ranks_and_normalises() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let (p, top) = softmax_top(&logits, 2, 3);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
        let sum: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((top[0].1 - 3f32.exp() / sum).abs() < 1e-6);
        assert!((p - 1.0 / sum).abs() < 1e-6, "the sampled token's probability even outside the top");
        let (_, all) = softmax_top(&logits, 10, 0);
        assert_eq!(all.len(), 4);
        assert!((all.iter().map(|t| t.1).sum::<f32>() - 1.0).abs() < 1e-5);
    }

    #[test]
    fn all_alora_needs_every_enabled_adapter_to_be_one() {
        let inv = vec![vec![5, 6], Vec::new(), vec![7]];
        assert!(all_alora(&inv, &[1.0, 0.0, 0.0]));
        assert!(all_alora(&inv, &[1.0, 0.0, 0.5]), "two aLoRAs: all_alora, rejected later");
        assert!(!all_alora(&inv, &[1.0, 1.0, 0.0]), "a plain adapter is enabled");
        assert!(!all_alora(&inv, &[0.0, 0.0, 0.0]), "none enabled");
    }

    #[test]
    fn common_prefix_counts_equal_leading_tokens() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[5, 6], &[5, 6]), 2);
    }
}
