use crate::error::{FfiError, Result};
use crate::model::Token;
use crate::sys;

/// An owned llama_batch of token inputs.
pub struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
    max_seq: usize,
}

// SAFETY: the batch owns its heap arrays exclusively; nothing else points into them.
unsafe impl Send for Batch {}

impl Batch {
    pub fn new(capacity: usize, max_seq: usize) -> Self {
        // SAFETY: allocates arrays for `capacity` tokens with up to `max_seq` sequence ids each.
        let raw = unsafe { sys::llama_batch_init(capacity as i32, 0, max_seq as i32) };
        Self { raw, capacity, max_seq }
    }

    pub fn len(&self) -> usize {
        self.raw.n_tokens as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    pub fn add(&mut self, token: Token, pos: i32, seq_ids: &[i32], logits: bool) -> Result<()> {
        let i = self.len();
        if i >= self.capacity {
            return Err(FfiError::BatchFull(self.capacity));
        }
        assert!(seq_ids.len() <= self.max_seq, "more sequence ids than the batch was built for");
        // SAFETY: i < capacity, and each per-token array was allocated with capacity entries
        // (seq_id[i] with max_seq entries) by llama_batch_init.
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos;
            *self.raw.n_seq_id.add(i) = seq_ids.len() as i32;
            let ids = *self.raw.seq_id.add(i);
            for (k, &s) in seq_ids.iter().enumerate() {
                *ids.add(k) = s;
            }
            *self.raw.logits.add(i) = logits as i8;
        }
        self.raw.n_tokens += 1;
        Ok(())
    }

    /// Asks for logits at the last token added.
    pub fn set_last_logits(&mut self, on: bool) {
        if let Some(i) = self.len().checked_sub(1) {
            // SAFETY: i < n_tokens <= capacity.
            unsafe { *self.raw.logits.add(i) = on as i8 };
        }
    }

    pub(crate) fn raw(&self) -> sys::llama_batch {
        self.raw
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: frees the arrays allocated by llama_batch_init, once.
        unsafe { sys::llama_batch_free(self.raw) }
    }
}
