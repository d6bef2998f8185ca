//! Embedding and reranking tasks: one pass over the prompt, pooled or per-token output.

use std::sync::Arc;

use serde_json::Value;
use strata_ffi::Sampler;

use super::core::Active;
use super::core::Engine;
use super::task::{Embedding, Event, Task, TaskKind};
use crate::api::error::{ApiError, ErrorType};

impl<'m> Engine<'m> {
    /// Embedding and rerank tasks: the whole prompt goes into one ubatch (the model may attend
    /// both ways), nothing is kept from earlier prompts, and the sequence is dropped afterwards.
    pub(super) fn start_embedding(&mut self, id: usize, task: Task) {
        let n_prompt = task.prompt.len();
        let n_ubatch = self.ctx.n_ubatch() as usize;
        if n_prompt > n_ubatch {
            let msg = format!("input ({n_prompt} tokens) is too large to process. increase the physical batch size (current batch size: {n_ubatch})");
            task.send_error(ApiError::server(msg));
            return;
        }
        if n_prompt > self.n_ctx_slot {
            let msg = format!("input ({n_prompt} tokens) is larger than the max context size ({} tokens). skipping", self.n_ctx_slot);
            task.send_error(ApiError::new(ErrorType::ExceedContextSize, msg));
            return;
        }
        let sampler = match Sampler::new(self.ctx.model(), Some(self.params), &Value::Null) {
            Ok(s) => s,
            Err(e) => {
                task.send_error(ApiError::server(e.to_string()));
                return;
            }
        };
        self.ctx.seq_rm(id as i32, -1, -1);
        let lora = self.lora_scales(&task.params.lora);
        let slot = &mut self.slots[id];
        slot.forget();
        slot.lora = lora.clone();
        slot.active = Some(Active::new(task, sampler, Ok(Arc::default()), 0, 0, lora));
    }

    /// Reads a finished embedding or rerank task's result from the last decode, answers it and
    /// frees the slot's sequence.
    pub(super) fn finish_embedding(&mut self, id: usize) {
        let pooled = self.ctx.pooling_type() != 0;
        let (kind, first, n_tokens, index) = {
            let a = self.slots[id].active.as_ref().expect("an embedding slot is active");
            (a.task.params.kind, a.i_batch.unwrap_or(0), a.task.prompt.len(), a.task.index)
        };
        let n_embd = self.ctx.model().n_embd_out().max(0) as usize;
        let mut out = Embedding { index, n_tokens, data: Vec::new(), score: 0.0 };
        match kind {
            TaskKind::Rerank => {
                let score = match self.ctx.embeddings_seq(id as i32) {
                    Some(e) if !e.is_empty() => e[0],
                    _ => self.ctx.embeddings_ith(first + n_tokens as i32 - 1).and_then(|e| e.first().copied()).unwrap_or(-1e6),
                };
                out.score = score;
            }
            TaskKind::Embedding { normalize } if pooled => {
                let v = self.ctx.embeddings_seq(id as i32).map(<[f32]>::to_vec).unwrap_or_else(|| vec![0.0; n_embd]);
                out.data.push(normalize_embedding(&v, normalize));
            }
            TaskKind::Embedding { .. } => {
                for i in 0..n_tokens as i32 {
                    let v = self.ctx.embeddings_ith(first + i).map(<[f32]>::to_vec).unwrap_or_else(|| vec![0.0; n_embd]);
                    out.data.push(v);
                }
            }
            TaskKind::Completion => unreachable!("completions are sampled"),
        }
        let a = self.release(id).expect("an embedding slot is active");
        if let Ok(mut m) = self.metrics.lock() {
            // no token is sampled, but the prompt was decoded
            m.on_prompt(n_tokens as u64, a.t_prompt.elapsed().as_micros() as u64);
        }
        self.ctx.seq_rm(id as i32, -1, -1);
        self.slots[id].forget();
        let _ = a.task.events.send(Event::Embedding(out));
    }
}

/// llama.cpp's common_embd_normalize: -1 none, 0 max-absolute to the int16 range, 2 euclidean,
/// other p: p-norm.
pub fn normalize_embedding(v: &[f32], norm: i32) -> Vec<f32> {
    let sum: f64 = match norm {
        -1 => 1.0,
        0 => v.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64)) / 32760.0,
        2 => v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt(),
        p => v.iter().map(|&x| (x.abs() as f64).powi(p)).sum::<f64>().powf(1.0 / p as f64),
    };
    let scale = if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 };
    v.iter().map(|&x| x * scale).collect()
}
