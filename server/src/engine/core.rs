//! The engine state: the context, the slots, the queue of tasks waiting for a slot, and the jobs
//! that are not tasks (slot actions, control).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_ffi::{Batch, Context, LoraAdapter, Model, Sampler, SeqRm, ServerParams, Speculative, Token, Verbosity};
use tokio::sync::oneshot;

use super::admission::Admission;
use super::checkpoint::{self, Checkpoint};
use super::generation::Generation;
use super::metrics::Metrics;
use super::prompt_cache::PromptCache;
use super::task::{Event, Job, LoraInfo, Partial, Progress, SlotAction, Task, Timings, TokenProbs};
use crate::api::error::ApiError;
use crate::cli::config::ServerConfig;
use crate::experts::Residency;

pub(super) struct Engine<'m> {
    /// Declared before `ctx`, which it points into, so that it is dropped first.
    pub(super) spec: Option<Speculative>,
    pub(super) ctx: Context<'m>,
    pub(super) params: &'m ServerParams,
    pub(super) slots: Vec<Slot<'m>>,
    pub(super) batch: Batch,
    pub(super) n_ctx_slot: usize,
    pub(super) n_predict_default: i32,
    /// -sp: generated special tokens are sent as their text.
    pub(super) special: bool,
    /// -cb: prompts join batches that hold generated tokens (-nocb: they wait for a batch
    /// of their own).
    pub(super) cont_batching: bool,
    pub(super) sampler_argmax: bool,
    pub(super) ctx_shift: bool,
    pub(super) pending: VecDeque<Task>,
    pub(super) slot_actions: VecDeque<(SlotAction, oneshot::Sender<Result<Value, ApiError>>)>,
    pub(super) metrics: Arc<std::sync::Mutex<Metrics>>,
    pub(super) shared: &'m Shared,
    pub(super) prompt_cache: Option<PromptCache>,
    pub(super) cache_idle_slots: bool,
    pub(super) kv_unified: bool,
    pub(super) slot_prompt_similarity: f32,
    pub(super) n_cache_reuse: i32,
    pub(super) adapters: &'m [LoraAdapter<'m>],
    /// The adapter scales the context decodes with now.
    pub(super) applied_lora: Vec<f32>,
    /// Each adapter's aLoRA invocation tokens (empty for plain adapters).
    pub(super) alora_tokens: Vec<Vec<Token>>,
    /// How far the context can cut a sequence back.
    pub(super) seq_rm: SeqRm,
    /// The same for the drafter's context.
    pub(super) draft_seq_rm: SeqRm,
    /// Sliding-window size the cache keeps (0 with --swa-full or without SWA).
    pub(super) n_swa: usize,
    pub(super) n_ubatch: usize,
    /// Context checkpoints, when the memory needs them and --ctx-checkpoints allows.
    pub(super) checkpoints: Option<checkpoint::Policy>,
    /// Accepted draft tokens to decode again after a checkpoint restore, per slot.
    pub(super) replays: Vec<(usize, Vec<Token>)>,
}

impl<'m> Engine<'m> {
    pub(super) fn new(
        ctx: Context<'m>,
        spec: Option<Speculative>,
        [seq_rm, draft_seq_rm]: [SeqRm; 2],
        cfg: &'m EngineConfig,
        flags: &ServerConfig,
        shared: &'m Shared,
        adapters: &'m [LoraAdapter<'m>],
    ) -> Self {
        let metrics = shared.metrics.clone();
        let n_parallel = cfg.n_parallel.max(1);
        let n_ctx = ctx.n_ctx() as usize;
        let n_ctx_seq = if cfg.kv_unified { n_ctx } else { n_ctx / n_parallel };
        let n_ctx_slot = slot_context(n_ctx_seq, flags.kv_unified_per_slot, ctx.model().n_ctx_train());
        let batch = Batch::new(ctx.n_batch().max(1) as usize, 1);
        let ctx_shift = cfg.ctx_shift && ctx.can_shift();
        if cfg.ctx_shift && !ctx_shift {
            crate::log::srv(strata_ffi::Verbosity::Info, "load_model", "ctx_shift is not supported by this context, it will be disabled");
        }
        crate::log::srv(
            Verbosity::Info,
            "load_model",
            &format!("initializing, n_slots = {n_parallel}, n_ctx_slot = {n_ctx_slot}, kv_unified = '{}'", cfg.kv_unified),
        );
        let now = Instant::now();
        for id in 0..n_parallel {
            crate::log::slot(Verbosity::Trace, "load_model", id, -1, &format!("new slot, n_ctx = {n_ctx_slot}"));
        }
        let slots = (0..n_parallel)
            .map(|id| Slot {
                id,
                cache: Vec::new(),
                draft_stale: false,
                lora: Vec::new(),
                last_used: now,
                t_last_used: -1,
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
                crate::log::srv(
                    Verbosity::Warn,
                    "load_model",
                    "prompt cache (--cache-ram) is off with a draft model: strata-server does not keep the drafter's state in it",
                );
                None
            }
            0 => {
                crate::log::srv(Verbosity::Trace, "load_model", "prompt cache is disabled - use `--cache-ram N` to enable it");
                None
            }
            mib => {
                let limit = if mib < 0 { "no limit".to_string() } else { format!("{mib} MiB") };
                crate::log::srv(Verbosity::Trace, "load_model", &format!("prompt cache is enabled, size limit: {limit}"));
                crate::log::srv(Verbosity::Trace, "load_model", "use `--cache-ram 0` to disable the prompt cache");
                crate::log::srv(Verbosity::Trace, "load_model", "for more info see https://github.com/ggml-org/llama.cpp/pull/16391");
                Some(PromptCache::new(mib, n_ctx))
            }
        };
        let mut n_cache_reuse = cfg.n_cache_reuse;
        if n_cache_reuse > 0 && !ctx.can_shift() {
            crate::log::srv(Verbosity::Warn, "load_model", "cache_reuse is not supported by this context, it will be disabled");
            n_cache_reuse = 0;
        }
        let mut cache_idle_slots = cfg.cache_idle_slots;
        if cache_idle_slots {
            if prompt_cache.is_none() {
                if cfg.cache_ram_mib == 0 {
                    crate::log::srv(Verbosity::Warn, "init", "--cache-idle-slots requires --cache-ram, disabling");
                }
                cache_idle_slots = false;
            } else {
                let what = if cfg.kv_unified { "saved to prompt cache and cleared" } else { "saved to prompt cache" };
                crate::log::srv(Verbosity::Trace, "init", &format!("idle slots will be {what} upon starting a new task"));
                crate::log::srv(Verbosity::Debug, "init", "__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__");
            }
        }
        let n_swa = if cfg.swa_full { 0 } else { ctx.model().n_swa().max(0) as usize };
        if seq_rm == SeqRm::No {
            crate::log::srv(Verbosity::Warn, "load_model", "speculative decoding not supported by this context");
        }
        if seq_rm == SeqRm::WholeOnly {
            crate::log::srv(Verbosity::Trace, "load_model", "speculative decoding will use checkpoints");
        }
        let needs_checkpoints = matches!(seq_rm, SeqRm::WholeOnly | SeqRm::Bounded(_)) || n_swa > 0;
        let checkpoints =
            (cfg.n_ctx_checkpoints > 0 && needs_checkpoints).then_some(checkpoint::Policy { max: cfg.n_ctx_checkpoints, min_step: cfg.checkpoint_min_step });
        if cfg.n_ctx_checkpoints > 0 {
            let msg = format!("context checkpoints enabled, max = {}, min spacing = {}", cfg.n_ctx_checkpoints, cfg.checkpoint_min_step);
            crate::log::srv(Verbosity::Trace, "load_model", &msg);
        } else {
            crate::log::srv(Verbosity::Trace, "load_model", "context checkpoints disabled");
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
            special: flags.special,
            cont_batching: flags.cont_batching,
            sampler_argmax: cfg.sampler_argmax,
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

    pub(super) fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.slot_actions.is_empty() && self.slots.iter().all(|s| s.active.is_none())
    }

    pub(super) fn take(&mut self, job: Job) {
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
    pub(super) fn control(&mut self, cmpl_id: &str, action: &str) -> Value {
        let refused = |message: &str| serde_json::json!({"success": false, "message": message});
        let live = self.slots.iter_mut().filter_map(|s| s.active.as_mut()).find(|a| a.task.params.cmpl_id == cmpl_id);
        let Some(a) = live else {
            let msg = format!("control {action} on unknown completion id={cmpl_id}, no live slot");
            crate::log::srv(Verbosity::Warn, "process_single_task", &msg);
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
    pub(super) fn run_slot_actions(&mut self) {
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

    /// The request gauges of /metrics.
    pub(super) fn publish(&self) {
        if let Ok(mut m) = self.metrics.lock() {
            m.n_processing = self.slots.iter().filter(|s| s.active.is_some()).count();
            m.n_deferred = self.pending.len();
        }
    }
}

/// A slot's context as llama-server's n_ctx_slot gives it: the context's per-sequence size,
/// capped by --kv-unified-per-slot (0: no cap) and by the model's training context; the caps
/// are logged as llama-server's load_model does.
pub(super) fn slot_context(n_ctx_seq: usize, per_slot: i32, n_ctx_train: i32) -> usize {
    let per_slot = usize::try_from(per_slot).unwrap_or(0);
    if per_slot > 0 && n_ctx_seq > per_slot {
        crate::log::srv(Verbosity::Info, "load_model", &format!("capping per-slot context ({n_ctx_seq}) to --kv-unified-per-slot ({per_slot})"));
    } else if per_slot > n_ctx_seq {
        let msg = format!(
            "--kv-unified-per-slot ({per_slot}) exceeds the per-slot pool capacity ({n_ctx_seq}) - cap has no effect, slots are limited to {n_ctx_seq} (raise the KV pool with -c, or unset -c to size it to n_parallel * kv_unified_per_slot)"
        );
        crate::log::srv(Verbosity::Warn, "load_model", &msg);
    }
    let capped = if per_slot > 0 { n_ctx_seq.min(per_slot) } else { n_ctx_seq };
    let n_ctx_train = usize::try_from(n_ctx_train).unwrap_or(0);
    if capped > n_ctx_train {
        let msg = format!("the slot context ({capped}) exceeds the training context of the model ({n_ctx_train}) - capping");
        crate::log::srv(Verbosity::Warn, "load_model", &msg);
    }
    capped.min(n_ctx_train)
}

/// A task's settings in the metrics form /slots shows.
pub(super) fn metrics_settings(a: &Active) -> Value {
    let mut params = a.settings.as_deref().cloned().unwrap_or_default();
    if let Value::Object(p) = &mut params {
        p.retain(|k, _| !super::settings::FULL_ONLY.contains(&k.as_str()));
    }
    params
}

/// An exception llama.cpp threw for a request, as llama-server reports it (a 500).
pub(super) fn exception(e: strata_ffi::FfiError) -> ApiError {
    ApiError::server(format!("got exception: {e}"))
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
    /// --ple-mode ssd: how the PLE table's rows are read from the file.
    pub ple: Option<strata_ffi::ple::PleConfig>,
    /// --kv-resident N.
    pub kv_resident: Option<u64>,
    /// STRATA_HIPBLASLT_TUNING / STRATA_PREFILL_MMQ: the GEMM dispatch, when either is set.
    pub gemm: Option<crate::gemm::GemmConfig>,
    /// --max-queued: most tasks waiting for a slot before requests get 503.
    pub max_queued: usize,
    /// The model file is mapped (llama.cpp's load mode), which the expert tiers rely on.
    pub use_mmap: bool,
    /// --main-gpu: the GPU that holds the hot expert tier.
    pub main_gpu: usize,
    /// STRATA_SAMPLER_ARGMAX (default on): greedy sampling answers from a scan of the logits.
    pub sampler_argmax: bool,
    /// STRATA_STEP_TRACE: where the host's time around decode steps is written.
    pub step_trace: Option<PathBuf>,
    /// STRATA_OP_PROFILE: where per-op times of prompt batches are written.
    pub op_profile: Option<PathBuf>,
}

/// What the engine publishes for handlers.
pub(super) struct Shared {
    /// The expert tiers, once placed; the engine updates it each step.
    pub(super) residency: Arc<std::sync::Mutex<Option<Residency>>>,
    /// A task's settings when it sets none (the metrics form /props shows).
    pub(super) default_settings: Arc<OnceLock<Value>>,
    pub(super) lora: Arc<std::sync::Mutex<Vec<LoraInfo>>>,
    pub(super) sleeping: Arc<std::sync::atomic::AtomicBool>,
    pub(super) model: Arc<OnceLock<Arc<Model>>>,
    pub(super) n_ctx_slot: Arc<OnceLock<usize>>,
    pub(super) metrics: Arc<std::sync::Mutex<Metrics>>,
    pub(super) admission: Arc<Admission>,
}

pub(super) struct Active<'m> {
    pub(super) task: Task,
    pub(super) sampler: Sampler<'m>,
    /// llama-server's task_params::to_json for this task, or why it cannot be written.
    pub(super) settings: Result<Arc<Value>, String>,
    pub(super) gen: Generation,
    pub(super) n_predict_max: i32,
    pub(super) n_cached: usize,
    /// The last sampled token, to be decoded next step.
    pub(super) sampled: Option<Token>,
    pub(super) i_batch: Option<i32>,
    pub(super) tokens: Vec<Token>,
    pub(super) probs: Vec<TokenProbs>,
    pub(super) n_decoded: usize,
    pub(super) truncated: bool,
    pub(super) t_prompt: Instant,
    pub(super) prompt_ms: f64,
    pub(super) t_gen: Option<Instant>,
    /// Prompt tokens went into the current batch.
    pub(super) prompt_in_batch: bool,
    /// The adapter scales this task decodes with.
    pub(super) lora: Vec<f32>,
    /// Draft tokens in the current batch, after the sampled token, and the batch indices of
    /// the sampled token and each draft token.
    pub(super) draft: Vec<Token>,
    pub(super) draft_i_batch: Vec<i32>,
    pub(super) n_draft_total: usize,
    pub(super) n_draft_accepted: usize,
    pub(super) n_draft_steps: usize,
    pub(super) backoff: super::backoff::Backoff,
    /// The slot's partial state from before the current draft, when rejecting part of it
    /// cannot be undone by cutting the sequence back.
    pub(super) spec_ckpt: Option<Checkpoint>,
    /// Prompt positions where a user message starts (ascending).
    pub(super) user_starts: Vec<usize>,
    /// The active aLoRA and where its invocation starts in the prompt: the prompt before it is
    /// decoded without the adapter, so that it matches a plain prompt's cache.
    pub(super) alora: Option<(usize, usize)>,
}

impl<'m> Active<'m> {
    pub(super) fn new(task: Task, sampler: Sampler<'m>, settings: Result<Arc<Value>, String>, n_predict_max: i32, n_cached: usize, lora: Vec<f32>) -> Self {
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
            backoff: Default::default(),
            spec_ckpt: None,
            user_starts: Vec::new(),
            alora: None,
        }
    }

    /// Whether the task lists `token` among its preserved tokens (a chat template's markers).
    pub(super) fn preserves(&self, token: Token) -> bool {
        self.task.params.sampling.get("preserved_tokens").and_then(Value::as_array).is_some_and(|p| p.iter().any(|t| t.as_i64() == Some(token as i64)))
    }

    pub(super) fn timings(&self, n_cache: usize) -> Timings {
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
    pub(super) fn begin(&self, n_cache: usize) -> bool {
        let p = &self.task.params;
        match (p.stream, p.return_progress) {
            (true, true) => self.send_progress(n_cache),
            (true, false) => self.task.events.send(Event::Begin).is_ok(),
            (false, _) => true,
        }
    }

    pub(super) fn send_progress(&self, n_cache: usize) -> bool {
        let p = &self.task.params;
        if !(p.stream && p.return_progress) {
            return true;
        }
        let partial = Partial {
            index: self.task.index,
            content: String::new(),
            tokens: Vec::new(),
            n_decoded: self.n_decoded,
            n_prompt: self.task.prompt.len(),
            n_cached: self.n_cached,
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

pub(super) struct Slot<'m> {
    pub(super) id: usize,
    /// Tokens of this slot's sequence now in the KV cache.
    pub(super) cache: Vec<Token>,
    /// The draft model's context no longer holds `cache` (the slot was restored from a file).
    pub(super) draft_stale: bool,
    /// Adapter scales `cache` was computed with.
    pub(super) lora: Vec<f32>,
    pub(super) last_used: Instant,
    /// llama-server's t_last_used (ggml's clock, us) as its log shows it: -1 until first used.
    pub(super) t_last_used: i64,
    pub(super) active: Option<Active<'m>>,
    /// Context checkpoints of `cache`, oldest first.
    pub(super) checkpoints: Vec<Checkpoint>,
    /// The first position of `cache` decoded with `lora` (an aLoRA's starts before its
    /// invocation; earlier ones had no adapter).
    pub(super) adapter_from: usize,
    /// The id and settings (metrics form) of the task this slot ran last, for `/slots`.
    pub(super) last: Option<(u64, Value)>,
}

impl Slot<'_> {
    /// Forgets the cached tokens (the caller drops them from the KV cache).
    pub(super) fn forget(&mut self) {
        self.cache.clear();
        self.checkpoints.clear();
    }
}
