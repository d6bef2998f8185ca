//! The engine thread: the only owner of the model and the llama context. HTTP handlers send it
//! requests over a bounded channel, each with its own reply channel; a readiness watch gates
//! `/health`.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use serde_json::Value;
use strata_ffi::{Batch, Context, Model, Sampler, ServerParams, Token};
use tokio::sync::{mpsc, oneshot, watch};

use crate::error::{ApiError, ErrorType};

/// Requests waiting for the engine; beyond this, handlers answer 503 at once.
pub const QUEUE_DEPTH: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Loading,
    Ready,
    Failed(String),
}

#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<Token>),
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub n_predict: i32,
    /// common_params_sampling overrides (see strata_ffi::Sampler::new).
    pub sampling: Value,
}

#[derive(Debug, Clone, PartialEq)]
pub enum StopType {
    Eos,
    Limit,
}

#[derive(Debug, Clone)]
pub struct CompletionResult {
    pub content: String,
    pub tokens: Vec<Token>,
    pub n_prompt: usize,
    pub stop: StopType,
    pub prompt_ms: f64,
    pub predicted_ms: f64,
    pub model_alias: String,
}

pub enum Job {
    Completion(CompletionRequest, oneshot::Sender<Result<CompletionResult, ApiError>>),
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Job>,
    state: watch::Receiver<State>,
    /// The loaded model, for the read-only work handlers do themselves (tokenizing).
    model: Arc<OnceLock<Arc<Model>>>,
}

impl EngineHandle {
    pub fn state(&self) -> State {
        self.state.borrow().clone()
    }

    pub fn model(&self) -> Option<Arc<Model>> {
        self.model.get().cloned()
    }

    pub async fn complete(&self, req: CompletionRequest) -> Result<CompletionResult, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.tx.try_send(Job::Completion(req, reply)).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ApiError::new(ErrorType::Unavailable, "server is busy, try again later"),
            mpsc::error::TrySendError::Closed(_) => ApiError::server("engine has stopped"),
        })?;
        rx.await.map_err(|_| ApiError::server("engine dropped the request"))?
    }

    /// A handle over a caller-made channel, for HTTP tests with a scripted engine.
    #[cfg(test)]
    pub fn from_parts(tx: mpsc::Sender<Job>, state: watch::Receiver<State>) -> Self {
        Self { tx, state, model: Arc::default() }
    }
}

pub struct EngineConfig {
    pub params: ServerParams,
    pub model_path: PathBuf,
    pub model_alias: String,
    pub n_predict_default: i32,
}

/// Starts the engine thread; the model loads on it while the HTTP server already answers.
pub fn spawn(cfg: EngineConfig) -> EngineHandle {
    let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
    let (state_tx, state_rx) = watch::channel(State::Loading);
    let model = Arc::new(OnceLock::new());
    let shared = model.clone();
    std::thread::Builder::new()
        .name("strata-engine".into())
        .spawn(move || run(cfg, rx, state_tx, &shared))
        .expect("spawn engine thread");
    EngineHandle { tx, state: state_rx, model }
}

fn run(mut cfg: EngineConfig, mut rx: mpsc::Receiver<Job>, state: watch::Sender<State>, shared: &OnceLock<Arc<Model>>) {
    strata_ffi::init_backend(Some(&cfg.params));
    let mparams = cfg.params.model_params();
    let model = match Model::load(&cfg.model_path, &mparams) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            let _ = state.send(State::Failed(e.to_string()));
            return;
        }
    };
    let cparams = cfg.params.context_params();
    let mut ctx = match Context::new(&model, cparams) {
        Ok(c) => c,
        Err(e) => {
            let _ = state.send(State::Failed(e.to_string()));
            return;
        }
    };
    let _ = shared.set(model.clone());
    let _ = state.send(State::Ready);
    while let Some(job) = rx.blocking_recv() {
        match job {
            Job::Completion(req, reply) => {
                if reply.is_closed() {
                    continue;
                }
                let out = complete(&mut ctx, &cfg, &req);
                let _ = reply.send(out);
            }
        }
    }
}

fn complete(ctx: &mut Context<'_>, cfg: &EngineConfig, req: &CompletionRequest) -> Result<CompletionResult, ApiError> {
    let model = ctx.model();
    let vocab = model.vocab();
    let prompt = match &req.prompt {
        Prompt::Text(t) => vocab.tokenize(t, true, true).map_err(|e| ApiError::invalid(e.to_string()))?,
        Prompt::Tokens(t) => t.clone(),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty"));
    }
    let n_ctx = ctx.n_ctx() as usize;
    if prompt.len() >= n_ctx {
        return Err(ApiError::new(
            ErrorType::ExceedContextSize,
            format!("request ({} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it", prompt.len()),
        ));
    }
    let mut sampler = Sampler::new(model, Some(&cfg.params), &req.sampling).map_err(|e| ApiError::invalid(e.to_string()))?;
    ctx.clear_memory();

    let t0 = Instant::now();
    let n_batch = ctx.n_batch() as usize;
    let mut batch = Batch::new(n_batch.max(1), 1);
    for (c, chunk) in prompt.chunks(n_batch).enumerate() {
        batch.clear();
        for (i, &t) in chunk.iter().enumerate() {
            batch.add(t, (c * n_batch + i) as i32, &[0], false).map_err(|e| ApiError::server(e.to_string()))?;
        }
        if (c + 1) * n_batch >= prompt.len() {
            batch.set_last_logits(true);
        }
        ctx.decode(&batch).map_err(|e| ApiError::server(e.to_string()))?;
    }
    for &t in &prompt {
        sampler.accept(t, false);
    }
    let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;

    let t1 = Instant::now();
    let n_predict = if req.n_predict < 0 { cfg.n_predict_default } else { req.n_predict };
    let limit = if n_predict < 0 { usize::MAX } else { n_predict as usize };
    let mut tokens = Vec::new();
    let mut bytes = Vec::new();
    let mut stop = StopType::Limit;
    let mut pos = prompt.len();
    while tokens.len() < limit && pos < n_ctx {
        let t = sampler.sample(ctx, -1);
        sampler.accept(t, true);
        if vocab.is_eog(t) {
            stop = StopType::Eos;
            break;
        }
        tokens.push(t);
        bytes.extend(vocab.token_to_piece(t, false));
        batch.clear();
        batch.add(t, pos as i32, &[0], true).map_err(|e| ApiError::server(e.to_string()))?;
        ctx.decode(&batch).map_err(|e| ApiError::server(e.to_string()))?;
        pos += 1;
    }
    Ok(CompletionResult {
        content: String::from_utf8_lossy(&bytes).into_owned(),
        tokens,
        n_prompt: prompt.len(),
        stop,
        prompt_ms,
        predicted_ms: t1.elapsed().as_secs_f64() * 1e3,
        model_alias: cfg.model_alias.clone(),
    })
}
