//! A task starting on a slot: prompt reuse (common prefix, --cache-reuse chunks, checkpoints,
//! the prompt cache), adapters and aLoRA, the sampler.

use std::sync::Arc;

use strata_ffi::{Context, Sampler, Speculative, StateScope, Token, Verbosity};

use super::checkpoint::{self, Checkpoint};
use super::core::{exception, Engine};
use super::core::{Active, Slot};
use super::generation::StopType;
use super::prompt_cache::common_prefix;
use super::speculative::drafter_log;
use super::task::{listed_scale, Event, Final, Task, TaskKind, Timings};
use crate::api::error::{ApiError, ErrorType};

impl<'m> Engine<'m> {
    pub(super) fn start(&mut self, id: usize, task: Task) {
        let n_prompt = task.prompt.len();
        if n_prompt == 0 && task.params.kind != TaskKind::Completion {
            task.send_error(ApiError::invalid("the prompt is empty"));
            return;
        }
        let n_vocab = self.ctx.model().vocab().n_tokens();
        if task.prompt.iter().any(|&t| !(0..n_vocab).contains(&t)) {
            task.send_error(ApiError::invalid("Prompt contains invalid tokens"));
            return;
        }
        if task.params.kind != TaskKind::Completion {
            launched(id, &task);
            self.start_embedding(id, task);
            return;
        }
        let model = self.ctx.model();
        let sampler = match Sampler::new(model, Some(self.params), &task.params.sampling) {
            Ok(mut s) => {
                if !self.sampler_argmax {
                    s.set_argmax(false);
                }
                s
            }
            Err(e) => {
                let msg = format!("Failed to initialize samplers: {e}");
                task.send_error(ApiError::invalid(msg));
                return;
            }
        };
        launched(id, &task);
        let n_predict = if task.params.n_predict != -1 { task.params.n_predict } else { self.n_predict_default };
        let settings = strata_ffi::sampling_settings(Some(self.params), &task.params.sampling, task.params.chat_format)
            .map(|s| Arc::new(super::settings::task_settings(&s, &task.params, n_predict as i64, false)))
            .map_err(|e| e.to_string());
        if n_prompt == 0 {
            // llama-server answers an empty prompt with an empty completion
            crate::log::slot(Verbosity::Warn, "update_slots", id, task.id as i64, "empty prompt - releasing slot");
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
            // llama-server launched the slot before it checked the size, and releases it now,
            // before the request's reader hears of the error
            task.log_error(&err);
            let msg = format!("stop processing: n_tokens = {}, truncated = 0", self.slots[id].cache.len());
            crate::log::slot(Verbosity::Info, "release", id, task.id as i64, &msg);
            let _ = task.events.send(Event::Error(err.with("n_prompt_tokens", n_prompt).with("n_ctx", self.n_ctx_slot)));
            return;
        }
        let mut lora = self.lora_scales(&task.params.lora);
        let requested = lora.clone();
        let alora = match self.alora_start(&mut lora, &task.prompt, id, task.id) {
            Ok(a) => a,
            Err(e) => {
                task.send_error(e);
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
                crate::log::slot(Verbosity::Warn, "update_slots", id, task.id as i64, &msg);
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
                    crate::log::slot(Verbosity::Trace, "operator()", id, task.id as i64, &msg);
                }
                None => {
                    let msg = "forcing full prompt re-processing due to lack of cache data (likely due to SWA or hybrid/recurrent memory, see https://github.com/ggml-org/llama.cpp/pull/13194#issuecomment-2868343055)";
                    crate::log::slot(Verbosity::Trace, "update_slots", id, task.id as i64, msg);
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
                task.send_error(exception(e));
                return;
            }
        }
        slot.cache.truncate(keep);
        strata_ffi::ple::prefetch(self.ctx.model().as_ptr(), &task.prompt, keep, self.n_ubatch);
        let n_predict_max = if task.params.n_predict != -1 { task.params.n_predict } else { self.n_predict_default };
        let mut sampler = sampler;
        if let Err(e) = task.prompt.iter().try_for_each(|&t| sampler.accept(t, false)) {
            task.send_error(exception(e));
            return;
        }
        let starts = if self.checkpoints.is_some() { checkpoint::user_starts(&task.prompt, &task.params.message_delimiters) } else { Vec::new() };
        // llama-server samples in the graph unless the request wants the probabilities before
        // sampling, which only the CPU chain gives
        let backend = self.ctx.backend_sampling() && sampler.backend() && (task.params.n_probs == 0 || task.params.post_sampling_probs);
        self.ctx.set_backend_sampler(id as i32, backend.then_some(&sampler));
        let mut active = Active::new(task, sampler, settings, n_predict_max, keep, lora);
        active.user_starts = starts;
        active.alora = alora;
        slot.active = Some(active);
        let a = slot.active.as_ref().expect("just started");
        if !a.begin(keep) {
            self.release(id);
        }
    }

    /// Where an aLoRA request's adapter starts: the last occurrence of its invocation tokens in
    /// the prompt. One without them runs without the adapter (its scale set to 0).
    pub(super) fn alora_start(&self, lora: &mut [f32], prompt: &[Token], id: usize, task: u64) -> Result<Option<(usize, usize)>, ApiError> {
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
                crate::log::slot(Verbosity::Debug, "launch_slot_", id, task as i64, &format!("alora {i} activated starting at {start}"));
                Ok(Some((i, start)))
            }
            None => {
                crate::log::slot(Verbosity::Debug, "launch_slot_", id, task as i64, &format!("alora {i} requested, but not found. deactivating"));
                lora[i] = 0.0;
                Ok(None)
            }
        }
    }

    /// The adapter scales for a task: its own (unlisted adapters at 0), else the global ones.
    pub(super) fn lora_scales(&self, asked: &Option<Vec<(i64, f32)>>) -> Vec<f32> {
        match asked {
            Some(list) => (0..self.adapters.len()).map(|i| listed_scale(list, i)).collect(),
            None => self.shared.lora.lock().map(|l| l.iter().map(|a| a.scale).collect()).unwrap_or_default(),
        }
    }
}

/// llama-server's --cache-reuse: past the common prefix, finds chunks of at least `min_chunk`
/// tokens that the cached sequence and the new prompt share, and moves their KV entries (by
/// position shifting) to where the prompt has them. Returns the new number of reusable tokens;
/// `cache` then holds exactly those.
pub(super) fn reuse_chunks(
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
    crate::log::slot(Verbosity::Debug, "update_slots", id, -1, &format!("trying to reuse chunks with size > {min_chunk}, n_past = {n_past}"));
    while head_c < cache.len() && head_p < prompt.len() {
        let n_match = cache[head_c..].iter().zip(&prompt[head_p..]).take_while(|(a, b)| a == b).count();
        if n_match < min_chunk {
            head_c += 1;
            continue;
        }
        let msg = format!("reusing chunk with size {n_match}, shifting KV cache [{head_c}, {}) -> [{head_p}, {})", head_c + n_match, head_p + n_match);
        crate::log::slot(Verbosity::Trace, "update_slots", id, -1, &msg);
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
    crate::log::slot(Verbosity::Debug, "update_slots", id, -1, &format!("after context reuse, new n_past = {head_p}"));
    head_p
}

/// Whether the enabled adapters (non-zero scale) are all aLoRAs, and there is one.
pub(super) fn all_alora(invocations: &[Vec<Token>], scales: &[f32]) -> bool {
    let mut enabled = scales.iter().zip(invocations).filter(|(&s, _)| s != 0.0).peekable();
    enabled.peek().is_some() && enabled.all(|(_, inv)| !inv.is_empty())
}

/// Adds a context checkpoint of slot's sequence as it stands (covering its first `n_tokens`).
pub(super) fn take_checkpoint(
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
        crate::log::slot(Verbosity::Warn, "create_check", slot.id, task as i64, "failed to copy the sequence state for a context checkpoint");
        return;
    };
    let spec = match spec.map(|s| s.checkpoint(id, true)).transpose() {
        Ok(s) => s,
        Err(e) => {
            crate::log::slot(Verbosity::Warn, "create_check", slot.id, task as i64, &format!("failed to copy the drafter state for a context checkpoint: {e}"));
            return;
        }
    };
    checkpoint::push(&mut slot.checkpoints, policy, slot.id, Checkpoint { n_tokens, pos_min, pos_max, task, tgt, spec });
}

/// llama-server's line for a task that has its slot and sampler.
fn launched(id: usize, task: &Task) {
    crate::log::slot(Verbosity::Info, "launch_slot_", id, task.id as i64, &format!("processing task, is_child = {}", task.is_child() as i32));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_alora_needs_every_enabled_adapter_to_be_one() {
        let inv = vec![vec![5, 6], Vec::new(), vec![7]];
        assert!(all_alora(&inv, &[1.0, 0.0, 0.0]));
        assert!(all_alora(&inv, &[1.0, 0.0, 0.5]), "two aLoRAs: all_alora, rejected later");
        assert!(!all_alora(&inv, &[1.0, 1.0, 0.0]), "a plain adapter is enabled");
        assert!(!all_alora(&inv, &[0.0, 0.0, 0.0]), "none enabled");
    }
}
