use std::marker::PhantomData;
use std::ptr::NonNull;

use serde_json::Value;

use crate::context::Context;
use crate::error::Result;
use crate::model::{Model, Token};
use crate::params::ServerParams;
use crate::shim_string::{call, cstring, take};
use crate::sys;

/// llama.cpp's `common_sampler`: the server's sampler chain, grammar included. It reads the
/// vocabulary of the model it was made for, which must outlive it (`'m`).
pub struct Sampler<'m> {
    ptr: NonNull<sys::strata_sampler>,
    _model: PhantomData<&'m Model>,
}

// SAFETY: the sampler owns its state exclusively and is used by one thread at a time (&mut);
// the model it reads is Sync.
unsafe impl Send for Sampler<'_> {}

impl<'m> Sampler<'m> {
    /// Defaults from the parsed flags (or llama.cpp's defaults), overridden by `overrides`
    /// whose keys are common_params_sampling's field names.
    pub fn new(model: &'m Model, defaults: Option<&ServerParams>, overrides: &Value) -> Result<Self> {
        let ovr = cstring(&overrides.to_string(), "sampling overrides")?;
        let params = defaults.map_or(std::ptr::null(), |p| p.as_ptr());
        let ptr = call(|err| {
            // SAFETY: valid model, params (or null) and C string for the call.
            NonNull::new(unsafe { sys::strata_sampler_init(model.as_ptr(), params, ovr.as_ptr(), err) })
        })?;
        Ok(Self { ptr, _model: PhantomData })
    }

    pub fn sample(&mut self, ctx: &mut Context<'_>, idx: i32) -> Result<Token> {
        crate::step_trace::sampling(|| {
            call(|err| {
                // SAFETY: valid sampler and context; idx refers to an output of the last decode.
                let t = unsafe { sys::strata_sampler_sample(self.ptr.as_ptr(), ctx.as_ptr(), idx, err) };
                (t != sys::LLAMA_TOKEN_NULL).then_some(t)
            })
        })
    }

    /// Verifies a draft decoded at batch indices `idxs` (the last sampled token's, then one
    /// per draft token): samples at each index while the sample equals the draft token there.
    /// Returns the samples (at least one; the matched draft tokens, then the first new token),
    /// all already accepted by the sampler.
    pub fn sample_and_accept_n(&mut self, ctx: &mut Context<'_>, idxs: &[i32], draft: &[Token]) -> Result<Vec<Token>> {
        crate::step_trace::sampling(|| {
            verify(idxs, draft, |out, err| {
                // SAFETY: idxs has draft.len() + 1 entries, out room for as many; the indices
                // refer to outputs of the last decode.
                unsafe { sys::strata_sampler_sample_and_accept_n(self.ptr.as_ptr(), ctx.as_ptr(), idxs.as_ptr(), draft.as_ptr(), draft.len() as i32, out, err) }
            })
        })
    }

    /// Lets `sample` answer from a scan of the logits where the chain's settings make it pick
    /// their first, only, highest value (on by default; off runs the chain every time).
    pub fn set_argmax(&mut self, enabled: bool) {
        // SAFETY: valid sampler.
        unsafe { sys::strata_sampler_set_argmax(self.ptr.as_ptr(), enabled) }
    }

    /// Whether the settings ask for backend sampling (-bs, or a request's backend_sampling) and
    /// allow it: no grammar, no reasoning budget.
    pub fn backend(&self) -> bool {
        // SAFETY: valid sampler.
        unsafe { sys::strata_sampler_backend(self.ptr.as_ptr()) }
    }

    /// Whether `sample` may answer from a scan of the logits (see `set_argmax`).
    pub fn argmax(&self) -> bool {
        // SAFETY: valid sampler.
        unsafe { sys::strata_sampler_argmax(self.ptr.as_ptr()) }
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::strata_sampler {
        self.ptr.as_ptr()
    }

    pub fn accept(&mut self, token: Token, accept_grammar: bool) -> Result<()> {
        call(|err| {
            // SAFETY: valid sampler.
            unsafe { sys::strata_sampler_accept(self.ptr.as_ptr(), token, accept_grammar, err) }.then_some(())
        })
    }

    pub fn reset(&mut self) -> Result<()> {
        call(|err| {
            // SAFETY: valid sampler.
            unsafe { sys::strata_sampler_reset(self.ptr.as_ptr(), err) }.then_some(())
        })
    }

    /// After `sample`: the probability the sampler chain gave `token`, and its `n_max` most
    /// likely candidates with theirs (zero-probability ones left out).
    pub fn candidates(&mut self, token: Token, n_max: usize) -> Result<(f32, Vec<(Token, f32)>)> {
        let n_max = n_max.min(i32::MAX as usize);
        let mut ids = vec![0 as Token; n_max];
        let mut probs = vec![0f32; n_max];
        let mut token_prob = 0f32;
        let n = call(|err| {
            // SAFETY: both buffers hold n_max entries; the shim writes at most that many.
            let n =
                unsafe { sys::strata_sampler_candidates(self.ptr.as_ptr(), token, &mut token_prob, ids.as_mut_ptr(), probs.as_mut_ptr(), n_max as i32, err) };
            (n >= 0).then_some((n as usize).min(n_max))
        })?;
        Ok((token_prob, ids.into_iter().zip(probs).take(n).collect()))
    }

    /// Forces the end of the reasoning section (samplers made with reasoning_control); false
    /// when there is none to end.
    pub fn end_reasoning(&mut self) -> Result<bool> {
        let mut err = std::ptr::null_mut();
        // SAFETY: valid sampler.
        let ended = unsafe { sys::strata_sampler_reasoning_end(self.ptr.as_ptr(), &mut err) };
        match crate::shim_string::take(err) {
            Some(e) => Err(crate::FfiError::Shim(e)),
            None => Ok(ended),
        }
    }

    pub fn seed(&self) -> u32 {
        // SAFETY: valid sampler.
        unsafe { sys::strata_sampler_seed(self.ptr.as_ptr()) }
    }
}

/// A draft verification through the shim: `f` writes at most draft.len() + 1 accepted tokens to
/// its buffer and returns how many (-1 with `err` set on failure).
pub(crate) fn verify(idxs: &[i32], draft: &[Token], f: impl FnOnce(*mut Token, *mut *mut std::ffi::c_char) -> i32) -> Result<Vec<Token>> {
    assert_eq!(idxs.len(), draft.len() + 1, "one batch index per draft token, plus the last sampled one");
    let mut out = vec![0 as Token; idxs.len()];
    let n = call(|err| {
        let n = f(out.as_mut_ptr(), err);
        (n >= 0).then_some(n as usize)
    })?;
    out.truncate(n.min(idxs.len()));
    Ok(out)
}

/// The sampling settings a task with `overrides` (as for [`Sampler::new`]) runs with, under
/// llama-server's names (its task_params::to_json); `chat_format` is named from its value.
pub fn sampling_settings(defaults: Option<&ServerParams>, overrides: &Value, chat_format: i32) -> Result<Value> {
    let ovr = cstring(&overrides.to_string(), "sampling overrides")?;
    let params = defaults.map_or(std::ptr::null(), |p| p.as_ptr());
    let s = call(|err| {
        // SAFETY: valid params (or null) and C string for the call; the result is owned by us.
        take(unsafe { sys::strata_sampling_json(params, ovr.as_ptr(), chat_format, err) })
    })?;
    Ok(serde_json::from_str(&s)?)
}

impl Drop for Sampler<'_> {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { sys::strata_sampler_free(self.ptr.as_ptr()) }
    }
}

/// The index of the highest logit, and whether no other logit equals it; None when a logit is
/// NaN or the highest is not finite. What greedy sampling's scan answers from.
pub fn logits_argmax(logits: &[f32]) -> Option<(usize, bool)> {
    let n = i32::try_from(logits.len()).ok()?;
    let mut unique = false;
    // SAFETY: the slice holds n floats; unique is a valid out-pointer.
    let i = unsafe { sys::strata_logits_argmax(logits.as_ptr(), n, &mut unique) };
    usize::try_from(i).ok().map(|i| (i, unique))
}

#[cfg(test)]
mod tests {
    use super::logits_argmax;

    /// Plain first-index-of-maximum, the chain's answer for a unique top.
    fn reference(x: &[f32]) -> Option<(usize, bool)> {
        if x.is_empty() || x.iter().any(|v| v.is_nan()) {
            return None;
        }
        let top = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !top.is_finite() {
            return None;
        }
        let first = x.iter().position(|&v| v == top)?;
        Some((first, x.iter().filter(|&&v| v == top).count() == 1))
    }

    #[test]
    fn the_scan_finds_the_first_top_logit_anywhere_in_vectors_of_any_length() {
        let mut seed = 0x9e37_79b9_u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed % 20_000) as f32 / 1000.0 - 10.0
        };
        for n in [1usize, 2, 3, 15, 16, 17, 31, 64, 65, 1000, 151_936] {
            let base: Vec<f32> = (0..n).map(|_| next()).collect();
            assert_eq!(logits_argmax(&base), reference(&base), "n {n}");
            for at in [0, n / 2, n - 1] {
                let mut x = base.clone();
                x[at] = 50.0;
                assert_eq!(logits_argmax(&x), Some((at, true)), "n {n}, top at {at}");
                // a second equal top later makes it tied; the first stays the answer
                if at + 1 < n {
                    x[n - 1] = 50.0;
                    assert_eq!(logits_argmax(&x), Some((at, false)), "n {n}, tie with the last");
                }
            }
        }
    }

    #[test]
    fn nan_infinite_tops_and_empty_logits_are_left_to_the_chain() {
        let mut x = vec![0.5f32; 100];
        x[7] = 2.0;
        assert_eq!(logits_argmax(&x), Some((7, true)));
        x[93] = f32::NAN;
        assert_eq!(logits_argmax(&x), None, "a NaN anywhere");
        x[93] = f32::INFINITY;
        assert_eq!(logits_argmax(&x), None, "an infinite top");
        x[93] = f32::NEG_INFINITY;
        assert_eq!(logits_argmax(&x), Some((7, true)), "banned tokens are fine");
        assert_eq!(logits_argmax(&[f32::NEG_INFINITY; 40]), None, "every token banned");
        assert_eq!(logits_argmax(&[]), None);
    }
}
