//! The host-RAM prompt cache (`--cache-ram`): copies of slot sequence states, so that a prompt
//! that left the KV cache can be restored instead of recomputed.
//!
//! Same policy as llama-server's server_prompt_cache: an entry is a prompt's tokens and its
//! sequence state; saving skips a prompt already covered by an entry and drops entries the new
//! prompt covers; loading picks the entry with the best (kept fraction, similarity) pair among
//! those that keep at least a quarter of themselves; eviction is oldest first, by a byte limit
//! and by a token limit that grows with what fits in the byte limit.

use std::collections::VecDeque;

use strata_ffi::{Token, Verbosity};

use super::checkpoint::Checkpoint;

const MIB: f64 = 1024.0 * 1024.0;

pub struct Entry {
    pub tokens: Vec<Token>,
    pub state: Vec<u8>,
    /// The slot's context checkpoints of `tokens`.
    pub checkpoints: Vec<Checkpoint>,
}

impl Entry {
    fn size(&self) -> usize {
        self.state.len() + self.checkpoints.iter().map(Checkpoint::size).sum::<usize>()
    }
}

pub struct PromptCache {
    entries: VecDeque<Entry>,
    /// In bytes, 0 = no limit.
    limit_size: usize,
    /// In tokens, 0 = no limit.
    limit_tokens: usize,
}

impl PromptCache {
    /// `limit_mib` < 0 means no byte limit; `limit_tokens` is the context size.
    pub fn new(limit_mib: i32, limit_tokens: usize) -> Self {
        let limit_size = if limit_mib < 0 { 0 } else { limit_mib as usize * 1024 * 1024 };
        Self { entries: VecDeque::new(), limit_size, limit_tokens }
    }

    pub fn size(&self) -> usize {
        self.entries.iter().map(Entry::size).sum()
    }

    pub fn n_tokens(&self) -> usize {
        self.entries.iter().map(|e| e.tokens.len()).sum()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    /// Stores `tokens` with the state `read` returns (`state_size` bytes) and the checkpoints
    /// `checkpoints` returns. Returns false, storing nothing, when the prompt is empty or
    /// already covered, too large, or the copy failed.
    pub fn save(&mut self, tokens: &[Token], state_size: usize, read: impl FnOnce() -> Option<Vec<u8>>, checkpoints: impl FnOnce() -> Vec<Checkpoint>) -> bool {
        if tokens.is_empty() {
            return false;
        }
        if self.entries.iter().any(|e| common_prefix(&e.tokens, tokens) == tokens.len()) {
            crate::log::srv(Verbosity::Trace, "alloc", " - prompt is already in the cache, skipping");
            return false;
        }
        if self.limit_size > 0 && state_size > self.limit_size {
            crate::log::srv(
                Verbosity::Warn,
                "alloc",
                &format!(" - prompt state size {:.3} MiB exceeds cache size limit {:.3} MiB, skipping", state_size as f64 / MIB, self.limit_size as f64 / MIB),
            );
            return false;
        }
        self.entries.retain(|e| {
            let covered = common_prefix(&e.tokens, tokens) == e.tokens.len();
            if covered {
                crate::log::srv(Verbosity::Trace, "alloc", &format!(" - removing obsolete cached prompt with length {}", e.tokens.len()));
            }
            !covered
        });
        if self.limit_size > 0 {
            while !self.entries.is_empty() && self.size() + state_size > self.limit_size {
                self.pop_oldest("making room for prompt cache entry, removing oldest entry");
            }
        }
        let Some(state) = read() else {
            crate::log::srv(Verbosity::Error, "alloc", "failed to copy the prompt state for the prompt cache");
            self.limit_size = ((self.size() as f64 * 0.4) as usize).max(1);
            self.update();
            return false;
        };
        self.entries.push_back(Entry { tokens: tokens.to_vec(), state, checkpoints: checkpoints() });
        true
    }

    /// Takes out the entry that serves `new` better than the slot's current `cached` tokens,
    /// if any.
    pub fn take_best(&mut self, cached: &[Token], new: &[Token]) -> Option<Entry> {
        let lcp = common_prefix(cached, new);
        let mut best_keep = if cached.is_empty() { -1.0 } else { lcp as f32 / cached.len() as f32 };
        let mut best_sim = lcp as f32 / new.len().max(1) as f32;
        crate::log::srv(Verbosity::Trace, "load", &format!(" - looking for better prompt, base f_keep = {best_keep:.3}, f_sim = {best_sim:.3}"));
        let mut best = None;
        for (i, e) in self.entries.iter().enumerate() {
            let lcp = common_prefix(&e.tokens, new);
            let keep = lcp as f32 / e.tokens.len() as f32;
            let sim = lcp as f32 / new.len().max(1) as f32;
            crate::log::srv(
                Verbosity::Trace,
                "load",
                &format!("   - prompt with length {:7}, lcp = {lcp:7}, f_keep = {keep:.3}, f_sim = {sim:.3}", e.tokens.len()),
            );
            if keep < 0.25 {
                continue;
            }
            if best_keep < keep && best_sim < sim {
                best_keep = keep;
                best_sim = sim;
                best = Some(i);
            }
        }
        let i = best?;
        crate::log::srv(Verbosity::Trace, "load", &format!(" - found better prompt with f_keep = {best_keep:.3}, f_sim = {best_sim:.3}"));
        self.entries.remove(i)
    }

    /// Evicts oldest entries until both limits hold.
    pub fn update(&mut self) {
        if self.limit_size > 0 {
            while !self.entries.is_empty() && self.size() > self.limit_size {
                self.pop_oldest("cache size limit reached, removing oldest entry");
            }
        }
        let per_token = (self.size() as f32 / self.n_tokens().max(1) as f32).max(1.0);
        let limit_tokens = if self.limit_size > 0 { self.limit_tokens.max((self.limit_size as f32 / per_token) as usize) } else { self.limit_tokens };
        if self.limit_tokens > 0 {
            while !self.entries.is_empty() && self.n_tokens() > limit_tokens {
                self.pop_oldest("cache token limit reached, removing oldest entry");
            }
        }
        crate::log::srv(
            Verbosity::Trace,
            "update",
            &format!(
                " - cache state: {} prompts, {:.3} MiB (limits: {:.3} MiB, {} tokens, {} est)",
                self.entries.len(),
                self.size() as f64 / MIB,
                self.limit_size as f64 / MIB,
                self.limit_tokens,
                limit_tokens
            ),
        );
    }

    fn pop_oldest(&mut self, why: &str) {
        if let Some(e) = self.entries.pop_front() {
            crate::log::srv(Verbosity::Warn, "update", &format!(" - {why} (size = {:.3} MiB)", e.size() as f64 / MIB));
        }
    }
}

pub(crate) fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
#[cfg(test)]
mod tests {
    use super::*;

    fn state(n: usize) -> impl FnOnce() -> Option<Vec<u8>> {
        move || Some(vec![7; n])
    }

    #[test]
    fn covered_prompts_are_skipped_and_obsolete_entries_replaced() {
        let mut c = PromptCache::new(-1, 0);
        assert!(c.save(&[1, 2, 3], 10, state(10), Vec::new));
        assert!(!c.save(&[1, 2], 10, state(10), Vec::new), "a prefix of an entry is already cached");
        assert!(c.save(&[1, 2, 3, 4], 12, state(12), Vec::new));
        assert_eq!(c.len(), 1, "the shorter entry the new one covers is dropped");
        assert_eq!(c.size(), 12);
        assert!(!c.save(&[], 1, state(1), Vec::new));
    }

    #[test]
    fn byte_limit_evicts_oldest_and_refuses_oversized() {
        let mib = 1024 * 1024;
        let mut c = PromptCache::new(2, 0);
        assert!(!c.save(&[9], 3 * mib, state(3 * mib), Vec::new), "larger than the whole cache");
        assert!(c.save(&[1], mib, state(mib), Vec::new));
        assert!(c.save(&[2], mib, state(mib), Vec::new));
        assert!(c.save(&[3], mib, state(mib), Vec::new));
        assert_eq!(c.len(), 2);
        assert!(c.take_best(&[], &[1]).is_none(), "the oldest entry was evicted");
        assert!(c.take_best(&[], &[3]).is_some());
    }

    #[test]
    fn take_best_prefers_more_kept_and_more_similar() {
        let mut c = PromptCache::new(-1, 0);
        c.save(&[1, 2, 3, 4, 5, 6, 7, 8], 8, state(8), Vec::new);
        c.save(&[1, 2, 9, 9], 4, state(4), Vec::new);
        // a slot that would keep all of its tokens is not replaced, even by a longer match
        assert!(c.take_best(&[1, 2, 3, 4, 5, 6], &[1, 2, 3, 4, 5, 6, 7, 8]).is_none());
        assert!(c.take_best(&[1, 2, 3, 4, 5, 6, 0], &[1, 2, 3, 4, 5, 6, 7, 8]).is_some());
        let e = c.take_best(&[], &[1, 2, 9, 9, 5]).expect("an empty slot takes any useful entry");
        assert_eq!(e.tokens, vec![1, 2, 9, 9]);
        assert_eq!(c.len(), 0);
        c.save(&[5, 6, 7, 8], 4, state(4), Vec::new);
        assert!(c.take_best(&[], &[1, 2]).is_none(), "an entry keeping under a quarter is never used");
    }

    #[test]
    fn failed_copy_shrinks_the_limit() {
        let mut c = PromptCache::new(-1, 0);
        c.save(&[1], 100, state(100), Vec::new);
        assert!(!c.save(&[2], 100, || None, Vec::new));
        assert_eq!(c.limit_size, 40);
        assert_eq!(c.len(), 0, "the shrunken limit evicts what no longer fits");
    }

    #[test]
    fn token_limit_grows_with_the_byte_limit() {
        let mut c = PromptCache::new(-1, 4);
        c.save(&[1, 2, 3], 3, state(3), Vec::new);
        c.save(&[4, 5, 6], 3, state(3), Vec::new);
        c.update();
        assert_eq!(c.len(), 1, "no byte limit: the token limit is the context size");
        let mut c = PromptCache::new(1, 4);
        c.save(&[1, 2, 3], 3, state(3), Vec::new);
        c.save(&[4, 5, 6], 3, state(3), Vec::new);
        c.update();
        assert_eq!(c.len(), 2, "1 MiB at 1 byte per token allows far more than 4 tokens");
    }
}
