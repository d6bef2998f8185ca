//! Sampling a slot's next token and emitting it: probabilities, stop conditions, events.

use std::time::Instant;

use strata_ffi::{Token, Verbosity};

use super::core::Engine;
use super::generation::StopType;
use super::task::{Event, Final, Partial, Timings, TokenProbs};
use crate::api::error::ApiError;

impl<'m> Engine<'m> {
    pub(super) fn sample(&mut self, id: usize, i: i32) {
        let slot = &mut self.slots[id];
        let a = slot.active.as_mut().unwrap();
        let begun = match self.spec.as_mut().filter(|_| a.t_gen.is_none()) {
            // the prompt is in the context now: drafters that follow the target start from it
            Some(spec) => spec.begin(id as i32, &slot.cache),
            None => Ok(()),
        };
        let sampled = begun.and_then(|()| a.sampler.sample(&mut self.ctx, i)).and_then(|t| a.sampler.accept(t, true).map(|()| t));
        match sampled {
            Ok(token) => {
                self.emit(id, token, i);
            }
            Err(e) => self.fail_slot(id, e),
        }
    }

    /// Accounts for one generated token (sampled from batch output `i`): stop conditions,
    /// streaming, and the final answer. Returns false once the slot has been released.
    pub(super) fn emit(&mut self, id: usize, token: Token, i: i32) -> bool {
        let vocab = self.ctx.model().vocab();
        let n_ctx_slot = self.n_ctx_slot;
        let ctx_shift = self.ctx_shift;
        let special = self.special;
        let slot = &mut self.slots[id];
        let a = slot.active.as_mut().unwrap();
        let now = Instant::now();
        if a.t_gen.is_none() {
            a.prompt_ms = (now - a.t_prompt).as_secs_f64() * 1e3;
            a.t_gen = Some(now);
            if let Ok(mut m) = self.metrics.lock() {
                m.on_prompt((a.task.prompt.len() - a.n_cached) as u64, (a.prompt_ms * 1e3) as u64);
                m.on_prompt_cached(a.n_cached as u64);
            }
        }
        a.n_decoded += 1;
        let is_eog = vocab.is_eog(token) && !a.task.params.ignore_eos;
        // special tokens show with -sp, and the task's preserved tokens always, as in llama-server
        let piece = vocab.token_to_piece(token, special || a.preserves(token));
        let probs = (a.task.params.n_probs > 0).then(|| {
            let n = a.task.params.n_probs.min(vocab.n_tokens() as usize);
            let (prob, ranked) = if a.task.params.post_sampling_probs {
                a.sampler.candidates(token, n).unwrap_or_default()
            } else {
                softmax_top(self.ctx.logits_ith(i).unwrap_or(&[]), n, token)
            };
            let top = ranked.iter().take(n).map(|&(t, p)| (t, vocab.token_to_piece(t, special), p)).collect();
            TokenProbs { token, piece: Vec::new(), prob, top }
        });
        let sent = a.gen.push(&piece, is_eog);
        // As llama-server: a token's entry carries the text sent with it, which may include the
        // bytes of tokens held back inside a UTF-8 character (those get no entry of their own).
        let probs = probs.filter(|_| sent.is_some()).map(|p| TokenProbs { piece: sent.clone().unwrap_or_default(), ..p });
        let text = sent.clone().unwrap_or_default();
        a.tokens.push(token);

        if !a.gen.finished() {
            if !ctx_shift && slot.cache.len() + 1 >= n_ctx_slot {
                a.truncated = true;
                a.gen.stop = StopType::Limit;
            } else if (a.n_predict_max != -1 && a.n_decoded as i64 >= a.n_predict_max as i64)
                || (a.gen.has_new_line
                    && a.task.params.t_max_predict_ms > 0
                    && a.t_gen.is_some_and(|t| t.elapsed().as_millis() as i64 > a.task.params.t_max_predict_ms))
            {
                a.gen.stop = StopType::Limit;
            }
        }
        if is_eog {
            a.gen.stop = StopType::Eos;
        }
        let n_prompt = a.task.prompt.len();
        if a.task.params.stream && sent.is_some() {
            let partial = Partial {
                index: a.task.index,
                content: String::from_utf8_lossy(&text).into_owned(),
                tokens: vec![token],
                n_decoded: a.n_decoded,
                n_prompt,
                n_cached: a.n_cached,
                probs: probs.clone(),
                timings: a.task.params.timings_per_token.then(|| a.timings(slot.cache.len())),
                progress: None,
            };
            if a.task.events.send(Event::Partial(partial)).is_err() {
                self.release(id);
                return false;
            }
        }
        if let Some(p) = probs {
            a.probs.push(p);
        }
        if !a.gen.finished() {
            a.sampled = Some(token);
            return true;
        }
        let predicted_ms = a.t_gen.map_or(0.0, |t| t.elapsed().as_secs_f64().max(1e-6) * 1e3);
        let timings = Timings {
            cache_n: a.n_cached,
            prompt_n: a.task.prompt.len() - a.n_cached,
            prompt_ms: a.prompt_ms,
            predicted_n: a.n_decoded,
            predicted_ms,
            draft_n: a.n_draft_total,
            draft_n_accepted: a.n_draft_accepted,
        };
        let drafts = (a.n_draft_total, a.n_draft_accepted, a.n_draft_steps);
        let task_id = a.task.id;
        if let Ok(mut m) = self.metrics.lock() {
            m.on_prediction(a.n_decoded as u64, a.n_decoded.saturating_sub(1) as u64, (predicted_ms * 1e3) as u64);
            m.on_drafts(drafts.0 as u64, drafts.1 as u64, drafts.2 as u64);
        }
        self.print_timings(id, &timings, task_id);
        if drafts.0 > 0 {
            let (n_draft, n_acc, steps) = drafts;
            let mean_len = if steps > 0 { 1.0 + n_acc as f64 / steps as f64 } else { 1.0 };
            let msg =
                format!("draft acceptance = {:0.5} ({n_acc:5} accepted / {n_draft:5} generated), mean len = {mean_len:5.2}", n_acc as f32 / n_draft as f32);
            crate::log::slot(Verbosity::Info, "print_timings", id, task_id as i64, &msg);
        }
        let a = self.release(id).unwrap();
        let stream = a.task.params.stream;
        let fin = Final {
            index: a.task.index,
            content: if stream { String::new() } else { a.gen.text() },
            tokens: if stream || !a.task.params.return_tokens { Vec::new() } else { a.tokens.clone() },
            id_slot: id,
            n_decoded: a.n_decoded,
            n_prompt,
            stop: a.gen.stop,
            stopping_word: a.gen.stopping_word.clone(),
            truncated: a.truncated,
            has_new_line: a.gen.has_new_line,
            timings,
            probs: if stream { Vec::new() } else { a.probs },
            settings: a.settings.clone().unwrap_or_default(),
        };
        if let (Err(e), true) = (&a.settings, a.task.params.settings_in_answer) {
            a.task.send_error(ApiError::server(e.clone()));
            return false;
        }
        let _ = a.task.events.send(Event::Final(Box::new(fin)));
        false
    }
}

/// The probability of `token` and the `n` most likely tokens, by softmax over all logits
/// (llama-server's get_token_probabilities).
pub(super) fn softmax_top(logits: &[f32], n: usize, token: Token) -> (f32, Vec<(Token, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let n = n.min(idx.len());
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
    }
    idx.truncate(n);
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let top = idx.iter().map(|&i| (i as Token, (logits[i] - max).exp() / sum)).collect();
    let prob = logits.get(token as usize).map_or(0.0, |&l| (l - max).exp() / sum);
    (prob, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_top_ranks_and_normalises() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let (p, top) = softmax_top(&logits, 2, 3);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
        let sum: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((top[0].1 - 3f32.exp() / sum).abs() < 1e-6);
        assert!((p - 1.0 / sum).abs() < 1e-6, "the sampled token's probability even outside the top");
        let (_, all) = softmax_top(&logits, 10, 0);
        assert_eq!(all.len(), 4);
        assert!((all.iter().map(|t| t.1).sum::<f32>() - 1.0).abs() < 1e-5);
    }
}
