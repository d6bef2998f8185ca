use std::ptr::NonNull;

use crate::context::Context;
use crate::error::Result;
use crate::model::Token;
use crate::params::ServerParams;
use crate::shim_string::call;
use crate::sys;

/// llama.cpp's `common_speculative` drafter (n-gram, draft model or MTP, per --spec-type).
pub struct Speculative {
    ptr: NonNull<sys::strata_speculative>,
}

// SAFETY: the drafter owns its state (and any draft context) exclusively; used via &mut only.
unsafe impl Send for Speculative {}

impl Speculative {
    pub fn new(params: &mut ServerParams, target: &mut Context<'_>, n_seq: u32) -> Result<Self> {
        let ptr = call(|err| {
            // SAFETY: valid params and target context, which outlives the drafter in callers.
            NonNull::new(unsafe { sys::strata_speculative_init(params.as_mut_ptr(), target.as_ptr(), n_seq, err) })
        })?;
        Ok(Self { ptr })
    }

    pub fn begin(&mut self, seq: i32, prompt: &[Token]) {
        // SAFETY: prompt is valid for its length; the drafter copies it.
        unsafe { sys::strata_speculative_begin(self.ptr.as_ptr(), seq, prompt.as_ptr(), prompt.len() as i32) }
    }

    /// Up to `n_max` draft tokens following `last`, given the sequence so far.
    pub fn draft(&mut self, seq: i32, tokens: &[Token], last: Token, n_max: usize) -> Vec<Token> {
        let mut out = vec![0 as Token; n_max];
        // SAFETY: tokens and out are valid for their lengths; the shim writes at most n_max.
        let n = unsafe {
            sys::strata_speculative_draft(
                self.ptr.as_ptr(),
                seq,
                tokens.as_ptr(),
                tokens.len() as i32,
                last,
                out.as_mut_ptr(),
                n_max as i32,
            )
        };
        out.truncate(n.max(0) as usize);
        out
    }

    pub fn accept(&mut self, seq: i32, n_accepted: u16) {
        // SAFETY: valid drafter.
        unsafe { sys::strata_speculative_accept(self.ptr.as_ptr(), seq, n_accepted) }
    }
}

impl Drop for Speculative {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { sys::strata_speculative_free(self.ptr.as_ptr()) }
    }
}
