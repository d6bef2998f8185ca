//! One engine step: build a batch from every slot's sampled token and prompt chunks, decode it
//! once, then sample, verify drafts and send events.

use std::collections::VecDeque;

use strata_ffi::{DecodeError, SeqRm, StateScope, Verbosity};

use super::checkpoint::Checkpoint;
use super::core::{exception, Engine};
use super::speculative::{draft_max, drafter_log};
use super::start::take_checkpoint;
use super::task::TaskKind;
use crate::api::error::ApiError;

impl<'m> Engine<'m> {
    /// llama-server's context shift: when a generating slot's context is full, keep the first
    /// n_keep tokens, drop the next n_discard (half the rest by default), and slide the others
    /// back.
    pub(super) fn shift_if_full(&mut self, id: usize) {
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
        crate::log::slot(Verbosity::Info, "update_slots", id, task_id as i64, &msg);
    }

    /// One batch: admit, build, decode, sample. Returns whether anything was decoded.
    pub(super) fn step(&mut self) -> bool {
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
        // An embedding or rerank prompt is decoded alone: its sums run over the whole batch (attention,
        // pooling) in SIMD lanes, so where it lands in the batch would change its rounding.
        let alone = self.slots.iter().position(|s| s.cache.is_empty() && s.active.as_ref().is_some_and(|a| a.task.params.kind != TaskKind::Completion));
        for slot in &mut self.slots {
            let Some(a) = slot.active.as_mut() else { continue };
            a.i_batch = None;
            // With more generating slots than -b, the rest wait for the next step.
            if self.batch.len() >= capacity || alone.is_some() {
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
                        let mut n_max = draft_max(a, slot.cache.len(), self.n_ctx_slot).min(room).min(spec.n_max());
                        // the synthetic drafter stands for a chosen acceptance rate: it drafts every step
                        let backs_off = spec.has_context() && !spec.has_synth();
                        if n_max > 0 && backs_off && !a.backoff.should_draft() {
                            n_max = 0;
                        }
                        let id = slot.id as i32;
                        let drafted = (|| {
                            // a draft context that cannot cut drafted tokens back gets its state back instead
                            let saved = (self.draft_seq_rm == SeqRm::WholeOnly && n_max > 0).then(|| spec.checkpoint(id, false)).transpose()?;
                            let draft = if n_max > 0 { spec.draft(id, &slot.cache, t, n_max)? } else { Vec::new() };
                            if n_max > 0 && draft.is_empty() {
                                a.backoff.record(0);
                            }
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
                strata_ffi::ple::after_token(self.ctx.model().as_ptr(), &slot.cache);
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
        // -nocb: prompts wait for a step with no generated token to decode
        let prompts_join = alone.is_none() && (self.cont_batching || self.batch.is_empty());
        for slot in &mut self.slots {
            let Some(a) = slot.active.as_mut() else { continue };
            let n_prompt = a.task.prompt.len();
            if a.task.params.kind != TaskKind::Completion {
                // the whole prompt, which start_embedding has checked fits one ubatch
                a.prompt_in_batch = alone == Some(slot.id);
                if a.prompt_in_batch {
                    batch_lora = Some(a.lora.clone());
                    a.i_batch = Some(0);
                    for (pos, &t) in a.task.prompt.iter().enumerate() {
                        self.batch.add(t, pos as i32, &[slot.id as i32], true).expect("batch has room");
                        slot.cache.push(t);
                    }
                }
                continue;
            }
            if !prompts_join {
                a.prompt_in_batch = false;
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
            if !a.send_progress(slot.cache.len()) {
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
    pub(super) fn decode_batch(&mut self) -> bool {
        let res = self.ctx.decode(&self.batch);
        if let Some(r) = self.shared.residency.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            r.after_step();
        }
        let io_msg;
        let msg = match res {
            Err(DecodeError::NoKvCacheSlot) => "Context size has been exceeded.",
            Err(DecodeError::InvalidBatch) => "Invalid input batch.",
            Err(DecodeError::Aborted) => "Decoding was aborted.",
            Err(DecodeError::Fatal(_)) => "Compute error.",
            Err(DecodeError::Io(e)) => {
                io_msg = format!("Compute error: {e}.");
                &io_msg
            }
            // The draft model (or MTP head) sees every target batch, prompts included.
            Ok(()) => match self.spec.as_mut().map(|spec| spec.process(&mut self.ctx, &self.batch)) {
                None | Some(Ok(())) => return true,
                Some(Err(e)) => {
                    crate::log::srv(Verbosity::Error, "update_slots", &format!("failed to process speculative batch: {e}"));
                    "failed to process speculative batch"
                }
            },
        };
        for id in 0..self.slots.len() {
            if let Some(a) = self.release(id) {
                a.task.send_error(ApiError::server(msg));
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
    pub(super) fn fail_slot(&mut self, id: usize, e: strata_ffi::FfiError) {
        let err = exception(e);
        let task = self.slots[id].active.as_ref().map_or(-1, |a| a.task.id as i64);
        crate::log::slot(Verbosity::Error, "operator()", id, task, &err.message);
        if let Some(a) = self.release(id) {
            a.task.send_error(err);
        }
        self.ctx.seq_rm(id as i32, -1, -1);
        if let Some(spec) = self.spec.as_mut() {
            drafter_log(spec.seq_rm(id as i32, -1, -1), id);
        }
        self.slots[id].forget();
    }

    /// Decodes again, in one batch, the accepted draft tokens that checkpoint restores dropped.
    pub(super) fn decode_replays(&mut self) {
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
}
