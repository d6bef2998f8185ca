//! Speculative decoding on a slot: how long a draft may be, verifying it against the target, and
//! keeping the drafter's context in step.

use strata_ffi::{Context, SeqRm, Speculative, StateScope, Verbosity};

use super::core::Active;
use super::core::Engine;
use super::core::EngineConfig;

/// The longest draft that fits: room in the slot's context (one token kept free for a context
/// shift) and in what is left of n_predict (llama-server's get_n_draft_max).
pub(super) fn draft_max(a: &Active, n_cached: usize, n_ctx_slot: usize) -> usize {
    let mut n = n_ctx_slot as i64 - n_cached as i64 - 2;
    if a.n_predict_max >= 0 {
        n = n.min(a.n_predict_max as i64 - a.n_decoded as i64 - 1);
    }
    n.max(0) as usize
}

/// The drafter llama-server would set up for these flags, if any.
pub(super) fn new_speculative(cfg: &mut EngineConfig, ctx: &mut Context<'_>) -> Result<Option<Speculative>, String> {
    if !cfg.speculative {
        return Ok(None);
    }
    let n_seq = cfg.n_parallel.max(1) as u32;
    match Speculative::new(&mut cfg.params, ctx, n_seq) {
        Ok(Some(s)) => {
            crate::log::srv(Verbosity::Trace, "load_model", "speculative decoding context initialized");
            Ok(Some(s))
        }
        Ok(None) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Logs a failed drafter call; true when it failed. The drafter's copy of the slot's sequence
/// is then unreliable: drafts may be poor until it is rebuilt, but the target decides every
/// token, so the request goes on.
pub(super) fn drafter_log(r: strata_ffi::Result<()>, slot: usize) -> bool {
    match r {
        Ok(()) => false,
        Err(e) => {
            crate::log::slot(Verbosity::Warn, "update_slots", slot, -1, &format!("drafter call failed: {e}"));
            true
        }
    }
}

impl<'m> Engine<'m> {
    /// Checks a slot's draft against the model's own samples: keeps the matching prefix, drops
    /// the rest from the KV cache, and emits every accepted token plus the model's next one.
    pub(super) fn verify_draft(&mut self, id: usize) {
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
        a.backoff.record(n_accepted);
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
}
