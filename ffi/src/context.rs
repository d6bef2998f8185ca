use std::ptr::NonNull;

use crate::batch::Batch;
use crate::error::{DecodeError, FfiError, Result};
use crate::model::{Model, Token};
use crate::params::ServerParams;
use crate::shim_string::call;
use crate::sys;

#[derive(Clone, Copy)]
pub struct ContextParams {
    pub(crate) raw: sys::llama_context_params,
}

impl ContextParams {
    pub(crate) fn from_raw(raw: sys::llama_context_params) -> Self {
        Self { raw }
    }

    pub fn with_n_ctx(mut self, n: u32) -> Self {
        self.raw.n_ctx = n;
        self
    }

    pub fn with_n_batch(mut self, n: u32) -> Self {
        self.raw.n_batch = n;
        self.raw.n_ubatch = self.raw.n_ubatch.min(n);
        self
    }

    pub fn with_threads(mut self, n: i32) -> Self {
        self.raw.n_threads = n;
        self.raw.n_threads_batch = n;
        self
    }

    /// Runs every node on its own and writes per-op times of each large batch to `path`
    /// (diagnostics: it disables kernel fusion and adds a synchronisation per node).
    pub fn with_op_profile(mut self, path: &std::path::Path) -> std::io::Result<Self> {
        crate::op_profile::install(&mut self.raw, path)?;
        Ok(self)
    }
}

impl Default for ContextParams {
    fn default() -> Self {
        // SAFETY: returns a plain struct of defaults.
        Self::from_raw(unsafe { sys::llama_context_default_params() })
    }
}

/// A llama_context over a borrowed model. Owned by one thread at a time (the engine thread).
pub struct Context<'m> {
    ptr: NonNull<sys::llama_context>,
    model: &'m Model,
    /// The CPU threadpools attached to the context, freed after it.
    threadpools: Option<NonNull<sys::strata_threadpools>>,
    /// -bs: the per-sequence sampler chains the context was made with, freed after it.
    backend_samplers: Option<NonNull<sys::strata_backend_samplers>>,
    /// Dropped with the context: a drafter made over it (which keeps its pointer) checks it.
    pub(crate) alive: std::sync::Arc<()>,
}

// SAFETY: a llama_context may be used from any thread as long as it is used by one at a time;
// `&mut self` on every mutating call and the absence of Sync enforce that. Its threadpools are
// reached only through it.
unsafe impl Send for Context<'_> {}

impl<'m> Context<'m> {
    pub fn new(model: &'m Model, params: ContextParams) -> Result<Self> {
        // SAFETY: valid model and params; null on failure.
        let ptr = unsafe { sys::llama_init_from_model(model.as_ptr(), params.raw) };
        NonNull::new(ptr).map(|ptr| Self { ptr, model, threadpools: None, backend_samplers: None, alive: std::sync::Arc::new(()) }).ok_or(FfiError::ContextInit)
    }

    /// As `new`, with the server's -bs: each sequence's sampler chain (from the flags' sampling
    /// settings) is part of the context's graph from the start, as in llama-server.
    pub fn for_server(model: &'m Model, mut params: ContextParams, server: &ServerParams) -> Result<Self> {
        let samplers = call(|err| {
            // SAFETY: valid model and params; the samplers outlive the context (Drop frees them after it).
            let b = unsafe { sys::strata_backend_samplers_init(model.as_ptr(), server.as_ptr(), &mut params.raw, err) };
            Some(NonNull::new(b))
        })?;
        match Self::new(model, params) {
            Ok(mut c) => {
                c.backend_samplers = samplers;
                Ok(c)
            }
            Err(e) => {
                if let Some(b) = samplers {
                    // SAFETY: made above; the context that would have used it was not made.
                    unsafe { sys::strata_backend_samplers_free(b.as_ptr()) }
                }
                Err(e)
            }
        }
    }

    /// Whether the context was made with backend samplers (-bs); only such a context samples in
    /// its graph.
    pub fn backend_sampling(&self) -> bool {
        self.backend_samplers.is_some()
    }

    /// Makes `sampler`'s chain sample sequence `seq` in the context's graph (None: sample it on
    /// the CPU). The sampler must be detached before it is dropped. Returns whether the graph
    /// samples the sequence now.
    pub fn set_backend_sampler(&mut self, seq: i32, sampler: Option<&crate::Sampler>) -> bool {
        let s = sampler.map_or(std::ptr::null(), |s| s.as_ptr().cast_const());
        // SAFETY: valid context; the caller keeps the sampler alive while it is attached.
        unsafe { sys::strata_sampler_attach(self.ptr.as_ptr(), seq, s) }
    }

    /// What llama-server's common_init_from_params does once its context exists: --prio for
    /// this thread and the CPU threadpools of the -t/-C/--cpu-strict/--poll flags (and their
    /// -batch forms), then the KV-shift check, control vectors, the reranking vocabulary checks
    /// and the warm-up run (--warmup). May clear `params`' ctx_shift and fill its control
    /// vector layer range.
    pub fn init_from_params(&mut self, params: &mut ServerParams) -> Result<()> {
        if self.threadpools.is_none() {
            let pools = call(|err| {
                // SAFETY: valid params and context; the pools are freed after the context (Drop).
                NonNull::new(unsafe { sys::strata_threadpools_init(params.as_ptr(), self.ptr.as_ptr(), err) })
            })?;
            self.threadpools = Some(pools);
        }
        call(|err| {
            // SAFETY: valid, exclusively borrowed params and context.
            unsafe { sys::strata_context_setup(params.as_mut_ptr(), self.ptr.as_ptr(), err) }.then_some(())
        })
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    pub fn as_ptr(&mut self) -> *mut sys::llama_context {
        self.ptr.as_ptr()
    }

    pub fn n_ctx(&self) -> u32 {
        // SAFETY: valid context.
        unsafe { sys::llama_n_ctx(self.ptr.as_ptr()) }
    }

    pub fn n_ubatch(&self) -> u32 {
        // SAFETY: valid context.
        unsafe { sys::llama_n_ubatch(self.ptr.as_ptr()) }
    }

    pub fn n_batch(&self) -> u32 {
        // SAFETY: valid context.
        unsafe { sys::llama_n_batch(self.ptr.as_ptr()) }
    }

    /// Decodes `batch`. On a model with expert tiers the batch has finished on the device when
    /// this returns, and its routing is counted (crate::decode_scope).
    pub fn decode(&mut self, batch: &Batch) -> Result<(), DecodeError> {
        let t0 = std::time::Instant::now();
        crate::op_profile::batch_start();
        // SAFETY: valid context; the batch's arrays are valid for its n_tokens.
        let rc = unsafe { sys::llama_decode(self.ptr.as_ptr(), batch.raw()) };
        crate::op_profile::batch_end(batch.raw().n_tokens, t0.elapsed());
        if crate::step_trace::active() {
            let launched = std::time::Instant::now();
            // SAFETY: valid context.
            unsafe { sys::llama_synchronize(self.ptr.as_ptr()) };
            crate::step_trace::step(batch.raw().n_tokens, t0, launched, std::time::Instant::now());
        }
        if rc == crate::decode_scope::FAILED {
            if let Some(why) = crate::decode_scope::take_failure() {
                return Err(DecodeError::Io(why));
            }
        }
        DecodeError::check(rc)
    }

    /// The token the context's graph sampled for the i-th output of the last decode (a sequence
    /// with a backend sampler attached), None where it sampled nothing.
    pub fn sampled_token(&mut self, i: i32) -> Option<Token> {
        // SAFETY: valid context.
        let t = unsafe { sys::llama_get_sampled_token_ith(self.ptr.as_ptr(), i) };
        (t != sys::LLAMA_TOKEN_NULL).then_some(t)
    }

    /// Logits of the i-th output of the last decode (negative i counts from the end).
    pub fn logits_ith(&mut self, i: i32) -> Option<&[f32]> {
        let n_vocab = self.model.vocab().n_tokens() as usize;
        // SAFETY: valid context; null when i has no logits.
        let p = unsafe { sys::llama_get_logits_ith(self.ptr.as_ptr(), i) };
        // SAFETY: a non-null result points at n_vocab floats owned by the context, valid until
        // the next decode, which needs &mut self.
        (!p.is_null()).then(|| unsafe { std::slice::from_raw_parts(p, n_vocab) })
    }

    /// The smallest position the memory still holds for `seq` (-1 when empty); a sliding-window
    /// cache drops positions that fell out of its window.
    pub fn seq_pos_min(&self, seq: i32) -> i32 {
        // SAFETY: valid context; its memory lives as long as the context.
        unsafe { sys::llama_memory_seq_pos_min(sys::llama_get_memory(self.ptr.as_ptr()), seq) }
    }

    /// The largest position sequence `seq` holds, -1 if empty.
    pub fn seq_pos_max(&self, seq: i32) -> i32 {
        // SAFETY: valid context; its memory lives as long as the context.
        unsafe { sys::llama_memory_seq_pos_max(sys::llama_get_memory(self.ptr.as_ptr()), seq) }
    }

    /// llama_pooling_type of this context (0 = none: one embedding per token).
    pub fn pooling_type(&self) -> i32 {
        // SAFETY: valid context.
        unsafe { sys::llama_pooling_type(self.ptr.as_ptr()) as i32 }
    }

    /// The embedding of batch output `i` (pooling none), n_embd_out floats.
    pub fn embeddings_ith(&mut self, i: i32) -> Option<&[f32]> {
        let n = self.model.n_embd_out().max(0) as usize;
        // SAFETY: valid context; null when i has no embedding.
        let p = unsafe { sys::llama_get_embeddings_ith(self.ptr.as_ptr(), i) };
        // SAFETY: a non-null result points at n_embd_out floats owned by the context, valid
        // until the next decode, which needs &mut self.
        (!p.is_null()).then(|| unsafe { std::slice::from_raw_parts(p, n) })
    }

    /// The pooled embedding of sequence `seq` (pooling mean/cls/last), or its rank scores
    /// (pooling rank: n_cls_out floats).
    pub fn embeddings_seq(&mut self, seq: i32) -> Option<&[f32]> {
        let n = if self.pooling_type() == sys::LLAMA_POOLING_TYPE_RANK {
            // SAFETY: valid model.
            unsafe { sys::llama_model_n_cls_out(self.model.as_ptr()) as usize }
        } else {
            self.model.n_embd_out().max(0) as usize
        };
        // SAFETY: valid context; null when the sequence has no pooled embedding.
        let p = unsafe { sys::llama_get_embeddings_seq(self.ptr.as_ptr(), seq) };
        // SAFETY: as embeddings_ith.
        (!p.is_null()).then(|| unsafe { std::slice::from_raw_parts(p, n) })
    }

    /// Removes positions [p0, p1) of sequence `seq` from the KV cache (p1 < 0: to the end).
    /// Returns false when the memory cannot remove a partial range (recurrent models).
    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> bool {
        // SAFETY: valid context; the memory handle lives as long as it.
        unsafe { sys::llama_memory_seq_rm(sys::llama_get_memory(self.ptr.as_ptr()), seq, p0, p1) }
    }

    /// Shifts positions [p0, p1) of sequence `seq` by `delta` (context shift).
    pub fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) {
        // SAFETY: valid context; the memory handle lives as long as it.
        unsafe { sys::llama_memory_seq_add(sys::llama_get_memory(self.ptr.as_ptr()), seq, p0, p1, delta) }
    }

    /// Whether the memory supports shifting positions (not recurrent or some SWA caches).
    pub fn can_shift(&self) -> bool {
        // SAFETY: valid context; the memory handle lives as long as it.
        unsafe { sys::llama_memory_can_shift(sys::llama_get_memory(self.ptr.as_ptr())) }
    }

    /// How many compute graphs were reused instead of rebuilt (llama_perf_context).
    pub fn graphs_reused(&self) -> i32 {
        // SAFETY: valid context; returns a plain struct.
        unsafe { sys::llama_perf_context(self.ptr.as_ptr()) }.n_reused
    }

    /// Saves sequence `seq` (its KV state and `tokens`) to `path`; returns the bytes written
    /// (0 on failure).
    pub fn save_seq(&mut self, path: &std::path::Path, seq: i32, tokens: &[Token]) -> usize {
        let Ok(c) = crate::shim_string::cstring(&path.to_string_lossy(), "path") else { return 0 };
        // SAFETY: valid context, C string and token slice for the call.
        unsafe { sys::llama_state_seq_save_file(self.ptr.as_ptr(), c.as_ptr(), seq, tokens.as_ptr(), tokens.len()) }
    }

    /// The size in bytes of sequence `seq`'s state, whole or partial.
    pub fn seq_state_size(&self, seq: i32, scope: StateScope) -> usize {
        // SAFETY: valid context; the size query has no other preconditions.
        unsafe { sys::llama_state_seq_get_size_ext(self.ptr.as_ptr(), seq, scope.flags()) }
    }

    /// A copy of sequence `seq`'s state, or None if it cannot be read.
    pub fn seq_state(&self, seq: i32, scope: StateScope) -> Option<Vec<u8>> {
        let size = self.seq_state_size(seq, scope);
        let mut data = Vec::new();
        data.try_reserve_exact(size).ok()?;
        data.resize(size, 0);
        // SAFETY: valid context; data has room for exactly `size` bytes.
        let n = unsafe { sys::llama_state_seq_get_data_ext(self.ptr.as_ptr(), data.as_mut_ptr(), size, seq, scope.flags()) };
        (n == size).then_some(data)
    }

    /// Puts back a state taken by [`Context::seq_state`] with the same scope; false if it does
    /// not fit or does not match this context.
    pub fn set_seq_state(&mut self, seq: i32, data: &[u8], scope: StateScope) -> bool {
        // SAFETY: valid context; data is a readable slice of data.len() bytes.
        let n = unsafe { sys::llama_state_seq_set_data_ext(self.ptr.as_ptr(), data.as_ptr(), data.len(), seq, scope.flags()) };
        n == data.len()
    }

    /// How this context's memory can cut a sequence back. Clears the memory (it decodes two
    /// tokens to find out), so ask before serving.
    pub fn probe_seq_rm(&mut self) -> Result<SeqRm> {
        let kind = crate::shim_string::call(|err| {
            // SAFETY: valid context.
            let k = unsafe { sys::strata_context_seq_rm_type(self.ptr.as_ptr(), err) };
            (k >= 0).then_some(k)
        })?;
        // SAFETY: valid context.
        Ok(SeqRm::from_kind(kind, unsafe { sys::llama_n_rs_seq(self.ptr.as_ptr()) } as usize))
    }

    /// Loads a saved sequence into `seq`: (bytes read, tokens), or None when the file is not a
    /// valid save for this context or its tokens do not fit in `max_tokens`.
    pub fn load_seq(&mut self, path: &std::path::Path, seq: i32, max_tokens: usize) -> Option<(usize, Vec<Token>)> {
        let c = crate::shim_string::cstring(&path.to_string_lossy(), "path").ok()?;
        let mut tokens = vec![0 as Token; max_tokens.max(1)];
        let mut n = 0usize;
        // SAFETY: valid context and C string; tokens has room for max_tokens entries.
        let read = unsafe { sys::llama_state_seq_load_file(self.ptr.as_ptr(), c.as_ptr(), seq, tokens.as_mut_ptr(), tokens.len(), &mut n) };
        if read == 0 || n > max_tokens {
            return None;
        }
        tokens.truncate(n);
        Some((read, tokens))
    }
}

/// Which part of a sequence's state to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateScope {
    /// Everything: KV cache and recurrent state.
    Whole,
    /// Only what cannot be cut back by position: recurrent state and sliding-window cells (a
    /// context checkpoint).
    Partial,
}

impl StateScope {
    fn flags(self) -> sys::llama_state_seq_flags {
        (match self {
            StateScope::Whole => sys::LLAMA_STATE_SEQ_FLAGS_NONE,
            StateScope::Partial => sys::LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
        }) as sys::llama_state_seq_flags
    }
}

/// How far a context's memory can remove the tail of a sequence (common_context_can_seq_rm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqRm {
    /// Not at all (no memory).
    No,
    /// Any tail.
    Partial,
    /// Only whole sequences (recurrent state without snapshots).
    WholeOnly,
    /// Tails of at most this many positions (recurrent-state snapshots, llama_n_rs_seq).
    Bounded(usize),
}

impl SeqRm {
    /// From common_context_seq_rm_type and the context's llama_n_rs_seq.
    pub(crate) fn from_kind(kind: i32, n_rs_seq: usize) -> Self {
        match kind {
            1 => SeqRm::Partial,
            2 => SeqRm::WholeOnly,
            3 => SeqRm::Bounded(n_rs_seq),
            _ => SeqRm::No,
        }
    }
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the context and free it once, before the borrowed model.
        unsafe { sys::llama_free(self.ptr.as_ptr()) }
        if let Some(pools) = self.threadpools.take() {
            // SAFETY: the pools were attached to the context just freed and nothing else uses them.
            unsafe { sys::strata_threadpools_free(pools.as_ptr()) }
        }
        if let Some(b) = self.backend_samplers.take() {
            // SAFETY: the chains belonged to the context just freed and nothing else uses them.
            unsafe { sys::strata_backend_samplers_free(b.as_ptr()) }
        }
    }
}
