//! What handlers and the engine exchange: tasks, their parameters, and the events a task sends back.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;
use strata_ffi::Token;
use tokio::sync::{mpsc, oneshot};

use super::generation::StopType;
use crate::api::error::ApiError;

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

impl Default for TaskParams {
    /// A task that sets nothing: the server's defaults.
    fn default() -> Self {
        TaskParams {
            kind: TaskKind::Completion,
            message_delimiters: Vec::new(),
            lora: None,
            n_predict: -1,
            stop: Vec::new(),
            stream: false,
            cache_prompt: true,
            id_slot: -1,
            cmpl_id: String::new(),
            n_cmpl: 1,
            chat_format: 0,
            reasoning_format: String::new(),
            settings_in_answer: false,
            return_tokens: false,
            ignore_eos: false,
            t_max_predict_ms: -1,
            n_keep: 0,
            n_discard: 0,
            n_cache_reuse: -1,
            n_probs: 0,
            post_sampling_probs: false,
            timings_per_token: false,
            return_progress: false,
            sampling: Value::Object(serde_json::Map::new()),
        }
    }
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

impl Task {
    /// Ends the task with an error, logged as llama-server's send_error logs it.
    pub fn send_error(&self, err: ApiError) {
        self.log_error(&err);
        let _ = self.events.send(Event::Error(err));
    }

    /// llama-server's send_error line for this task.
    pub fn log_error(&self, err: &ApiError) {
        crate::log::srv(strata_ffi::Verbosity::Error, "send_error", &format!("task id = {}, error: {}", self.id, err.message));
    }

    /// A further completion of a request's prompt (`n_cmpl` > 1), in llama-server's terms a child task.
    pub fn is_child(&self) -> bool {
        self.params.n_cmpl > 1 && !self.index.is_multiple_of(self.params.n_cmpl)
    }
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
    pub n_decoded: usize,
    pub n_prompt: usize,
    /// Prompt tokens taken from the cache rather than decoded.
    pub n_cached: usize,
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

/// Adapter `i`'s scale in an (id, scale) list: the last entry for it wins, unlisted is 0.
pub fn listed_scale(list: &[(i64, f32)], i: usize) -> f32 {
    list.iter().rev().find(|(id, _)| *id == i as i64).map_or(0.0, |&(_, s)| s)
}
