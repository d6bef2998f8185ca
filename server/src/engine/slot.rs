//! What the engine does with slots as llama-server does: the slot actions (save, restore, erase),
//! which slot a task takes, moving slots through the prompt cache, releasing a finished task.

use std::time::Instant;

use serde_json::Value;
use strata_ffi::{Context, StateScope, Token, Verbosity};

use super::checkpoint::Checkpoint;
use super::core::{metrics_settings, Active, Engine, Slot};
use super::prompt_cache::common_prefix;
use super::prompt_cache::PromptCache;
use super::speculative::drafter_log;
use super::task::{SlotAction, Task, Timings};
use crate::api::error::ApiError;

/// Copies a slot's sequence and its checkpoints into the prompt cache; false if nothing was stored.
pub(super) fn save_slot(cache: &mut PromptCache, ctx: &Context<'_>, slot: &Slot) -> bool {
    let id = slot.id as i32;
    let size = ctx.seq_state_size(id, StateScope::Whole) + slot.checkpoints.iter().map(Checkpoint::size).sum::<usize>();
    cache.save(&slot.cache, size, || ctx.seq_state(id, StateScope::Whole), || slot.checkpoints.clone())
}

impl<'m> Engine<'m> {
    /// llama-server's get_slot_by_id: the id wraps around the slot count as an unsigned number,
    /// so every id finds a slot (-1 is the last of four).
    pub(super) fn slot_by_id(&self, id: i32) -> Option<usize> {
        let n = self.slots.len() as u64;
        (n > 0).then(|| ((id as i64 as u64) % n) as usize)
    }

    /// Runs `action` on slot `idx`; the answer names the slot id as it was asked.
    pub(super) fn slot_action(&mut self, action: SlotAction, idx: usize) -> Result<Value, ApiError> {
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
    /// get_available_slot, with its log line).
    pub(super) fn pick_slot(&self, task: &Task) -> Option<(usize, bool)> {
        let picked = self.choose_slot(task)?;
        crate::log::slot(Verbosity::Info, "get_availabl", picked.0, -1, &picked.2);
        Some((picked.0, picked.1))
    }

    fn choose_slot(&self, task: &Task) -> Option<(usize, bool, String)> {
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
                let f_keep = n as f32 / s.cache.len() as f32;
                let why = match asked {
                    Some(id) => format!("selected slot by id ({id})"),
                    None => format!(
                        "selected slot by LCP similarity, f_sim_best = {:.3} (> {:.3} thold), f_keep = {f_keep:.3}",
                        n as f32 / n_prompt,
                        self.slot_prompt_similarity
                    ),
                };
                // about to lose much of the slot's context: keep a copy in the prompt cache
                return Some((s.id, f_keep < 0.5, why));
            }
        }
        if let Some(id) = asked {
            return Some((id, false, format!("selected slot by id ({id})")));
        }
        // of equally old slots the last, as llama-server's `<=` scan picks it
        idle.rev().min_by_key(|s| s.last_used).map(|s| (s.id, true, format!("selected slot by LRU, t_last = {}", s.t_last_used)))
    }

    /// Saves slot `id`'s sequence to the prompt cache, then restores the cached prompt that
    /// serves `prompt` best, if one beats what the slot holds.
    pub(super) fn swap_through_prompt_cache(&mut self, id: usize, prompt: &[Token]) {
        let Some(cache) = self.prompt_cache.as_mut() else { return };
        crate::log::srv(Verbosity::Trace, "get_availabl", "updating prompt cache");
        let t0 = Instant::now();
        let ctx = &mut self.ctx;
        let slot = &mut self.slots[id];
        save_slot(cache, ctx, slot);
        if let Some(entry) = cache.take_best(&slot.cache, prompt) {
            if ctx.set_seq_state(id as i32, &entry.state, StateScope::Whole) {
                slot.cache = entry.tokens;
                slot.checkpoints = entry.checkpoints;
            } else {
                crate::log::slot(Verbosity::Warn, "prompt_load", id, -1, "failed to load prompt from cache");
                ctx.seq_rm(id as i32, -1, -1);
                slot.forget();
            }
        }
        cache.update();
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        crate::log::srv(Verbosity::Trace, "get_availabl", &format!("prompt cache update took {ms:.2} ms"));
    }

    /// Copies every idle slot to the prompt cache; with a unified KV cache also clears them,
    /// so the room goes to the slots that work.
    pub(super) fn cache_idle_slots(&mut self) {
        let Some(cache) = self.prompt_cache.as_mut() else { return };
        for slot in self.slots.iter_mut().filter(|s| s.active.is_none()) {
            let id = slot.id as i32;
            crate::log::slot(Verbosity::Trace, "process_sing", slot.id, -1, "saving idle slot to prompt cache");
            if save_slot(cache, &self.ctx, slot) {
                crate::log::slot(Verbosity::Debug, "process_sing", slot.id, -1, "__TEST_TAG_CACHE_IDLE_SLOT__");
                cache.update();
            }
            if self.kv_unified && !slot.cache.is_empty() {
                self.ctx.seq_rm(id, -1, -1);
                slot.forget();
            }
        }
    }

    /// A slot as llama-server's /slots shows it (its metrics form): the task it runs, or ran
    /// last, with that task's settings and progress.
    pub(super) fn slot_json(&self, id: usize) -> Value {
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

    pub(super) fn release(&mut self, id: usize) -> Option<Active<'m>> {
        let slot = &mut self.slots[id];
        slot.last_used = Instant::now();
        slot.t_last_used = strata_ffi::time_ms() * 1000;
        let a = slot.active.take()?;
        // the context must not keep the chain of a sampler that is about to be dropped
        self.ctx.set_backend_sampler(id as i32, None);
        slot.last = Some((a.task.id, metrics_settings(&a)));
        let msg = format!("stop processing: n_tokens = {}, truncated = {}", slot.cache.len(), a.truncated as i32);
        crate::log::slot(Verbosity::Info, "release", id, a.task.id as i64, &msg);
        if let Some(r) = self.shared.residency.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            r.request_done();
        }
        // Before the final answer goes out, so a client that reads /metrics right after it
        // sees the slot idle.
        self.publish();
        Some(a)
    }

    /// The timing lines llama-server prints when a request completes (never for a cancelled one).
    pub(super) fn print_timings(&self, id: usize, t: &Timings, task: u64) {
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
            crate::log::slot(Verbosity::Info, "print_timings", id, task as i64, &l);
        }
    }
}
