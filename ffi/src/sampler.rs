use std::ptr::NonNull;

use serde_json::Value;

use crate::context::Context;
use crate::error::Result;
use crate::model::{Model, Token};
use crate::params::ServerParams;
use crate::shim_string::{call, cstring};
use crate::sys;

/// llama.cpp's `common_sampler`: the server's sampler chain, grammar included.
pub struct Sampler {
    ptr: NonNull<sys::strata_sampler>,
}

// SAFETY: the sampler owns its state exclusively and is used by one thread at a time (&mut).
unsafe impl Send for Sampler {}

impl Sampler {
    /// Defaults from the parsed flags (or llama.cpp's defaults), overridden by `overrides`
    /// whose keys are common_params_sampling's field names.
    pub fn new(model: &Model, defaults: Option<&ServerParams>, overrides: &Value) -> Result<Self> {
        let ovr = cstring(&overrides.to_string(), "sampling overrides")?;
        let params = defaults.map_or(std::ptr::null(), |p| p.as_ptr());
        let ptr = call(|err| {
            // SAFETY: valid model, params (or null) and C string for the call.
            NonNull::new(unsafe { sys::strata_sampler_init(model.as_ptr(), params, ovr.as_ptr(), err) })
        })?;
        Ok(Self { ptr })
    }

    pub fn sample(&mut self, ctx: &mut Context<'_>, idx: i32) -> Token {
        // SAFETY: valid sampler and context; idx refers to an output of the last decode.
        unsafe { sys::strata_sampler_sample(self.ptr.as_ptr(), ctx.as_ptr(), idx) }
    }

    /// Verifies a draft decoded at batch indices `idxs` (the last sampled token's, then one
    /// per draft token): samples at each index while the sample equals the draft token there.
    /// Returns the samples (at least one; the matched draft tokens, then the first new token),
    /// all already accepted by the sampler.
    pub fn sample_and_accept_n(&mut self, ctx: &mut Context<'_>, idxs: &[i32], draft: &[Token]) -> Vec<Token> {
        assert_eq!(idxs.len(), draft.len() + 1, "one batch index per draft token, plus the last sampled one");
        let mut out = vec![0 as Token; idxs.len()];
        // SAFETY: idxs has draft.len() + 1 entries, out has room for as many; the indices refer
        // to outputs of the last decode.
        let n = unsafe {
            sys::strata_sampler_sample_and_accept_n(
                self.ptr.as_ptr(),
                ctx.as_ptr(),
                idxs.as_ptr(),
                draft.as_ptr(),
                draft.len() as i32,
                out.as_mut_ptr(),
            )
        };
        out.truncate(n.max(0) as usize);
        out
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::strata_sampler {
        self.ptr.as_ptr()
    }

    pub fn accept(&mut self, token: Token, accept_grammar: bool) {
        // SAFETY: valid sampler.
        unsafe { sys::strata_sampler_accept(self.ptr.as_ptr(), token, accept_grammar) }
    }

    pub fn reset(&mut self) {
        // SAFETY: valid sampler.
        unsafe { sys::strata_sampler_reset(self.ptr.as_ptr()) }
    }

    /// After `sample`: the probability the sampler chain gave `token`, and its `n_max` most
    /// likely candidates with theirs (zero-probability ones left out).
    pub fn candidates(&mut self, token: Token, n_max: usize) -> (f32, Vec<(Token, f32)>) {
        let mut ids = vec![0 as Token; n_max];
        let mut probs = vec![0f32; n_max];
        let mut token_prob = 0f32;
        // SAFETY: both buffers hold n_max entries; the shim writes at most that many.
        let n = unsafe {
            sys::strata_sampler_candidates(self.ptr.as_ptr(), token, &mut token_prob, ids.as_mut_ptr(), probs.as_mut_ptr(), n_max as i32)
        };
        let n = (n.max(0) as usize).min(n_max);
        (token_prob, ids.into_iter().zip(probs).take(n).collect())
    }

    pub fn seed(&self) -> u32 {
        // SAFETY: valid sampler.
        unsafe { sys::strata_sampler_seed(self.ptr.as_ptr()) }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { sys::strata_sampler_free(self.ptr.as_ptr()) }
    }
}
