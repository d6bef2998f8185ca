use std::ptr::NonNull;
use std::sync::{Arc, Weak};

use crate::batch::Batch;
use crate::context::Context;
use crate::error::{FfiError, Result};
use crate::model::Token;
use crate::params::ServerParams;
use crate::sampler::Sampler;
use crate::shim_string::call;
use crate::sys;

/// llama.cpp's `common_speculative` drafter (n-gram, draft model or MTP, per --spec-type). It
/// keeps a pointer to the target context it was made over: once that context is gone, every
/// call that could reach it fails instead.
pub struct Speculative {
    ptr: NonNull<sys::strata_speculative>,
    target: Weak<()>,
}

// SAFETY: the drafter owns its state (and any draft context) exclusively; used via &mut only.
unsafe impl Send for Speculative {}

impl Speculative {
    /// None when the settings give no drafter (llama-server then serves without one).
    pub fn new(params: &mut ServerParams, target: &mut Context<'_>, n_seq: u32) -> Result<Option<Self>> {
        let ptr = call(|err| {
            // SAFETY: valid params and target context, which outlives the drafter in callers.
            let p = unsafe { sys::strata_speculative_init(params.as_mut_ptr(), target.as_ptr(), n_seq, err) };
            // SAFETY: err is the out-pointer the shim set or left NULL.
            (!p.is_null() || unsafe { (*err).is_null() }).then_some(NonNull::new(p))
        })?;
        Ok(ptr.map(|ptr| Self { ptr, target: Arc::downgrade(&target.alive) }))
    }

    /// The drafter, while its target context lives.
    fn live(&self) -> Result<*mut sys::strata_speculative> {
        match self.target.strong_count() {
            0 => Err(FfiError::Shim("the drafter's target context was freed".into())),
            _ => Ok(self.ptr.as_ptr()),
        }
    }

    /// As `live`, for a call given the target context: it must be the one the drafter was made over.
    fn live_with(&self, target: &Context<'_>) -> Result<*mut sys::strata_speculative> {
        match Weak::ptr_eq(&self.target, &Arc::downgrade(&target.alive)) {
            true => self.live(),
            false => Err(FfiError::Shim("the drafter was made over another target context".into())),
        }
    }

    pub fn begin(&mut self, seq: i32, prompt: &[Token]) -> Result<()> {
        let p = self.live()?;
        call(|err| {
            // SAFETY: prompt is valid for its length; the drafter copies it.
            unsafe { sys::strata_speculative_begin(p, seq, prompt.as_ptr(), prompt.len() as i32, err) }.then_some(())
        })
    }

    /// Up to `n_max` draft tokens following `last`, given the sequence so far.
    pub fn draft(&mut self, seq: i32, tokens: &[Token], last: Token, n_max: usize) -> Result<Vec<Token>> {
        let p = self.live()?;
        let mut out = vec![0 as Token; n_max];
        let n = call(|err| {
            // SAFETY: tokens and out are valid for their lengths; the shim writes at most n_max.
            let n = unsafe { sys::strata_speculative_draft(p, seq, tokens.as_ptr(), tokens.len() as i32, last, out.as_mut_ptr(), n_max as i32, err) };
            (n >= 0).then_some(n as usize)
        })?;
        out.truncate(n);
        Ok(out)
    }

    /// Feeds a decoded target batch to drafters that keep a context of their own in step with
    /// the target (draft model, MTP head); an error if that context failed to decode it.
    pub fn process(&mut self, target: &mut Context<'_>, batch: &Batch) -> Result<()> {
        let p = self.live_with(target)?;
        let raw = batch.raw();
        let n = batch.len();
        if n == 0 {
            return Ok(());
        }
        // SAFETY: every entry below n_tokens was written by Batch::add with at least one
        // sequence id (the engine always passes one).
        let seq: Vec<i32> = (0..n).map(|i| unsafe { **raw.seq_id.add(i) }).collect();
        call(|err| {
            // SAFETY: token/pos/logits arrays hold n_tokens entries; seq has n entries; the shim
            // copies them into its own batch.
            unsafe { sys::strata_speculative_process(p, target.as_ptr(), n as i32, raw.token, raw.pos, seq.as_ptr(), raw.logits, err) }.then_some(())
        })
    }

    /// Whether the drafter decodes in a context of its own, which must follow the target's
    /// sequence edits.
    pub fn has_context(&self) -> bool {
        // SAFETY: valid drafter.
        unsafe { sys::strata_speculative_has_context(self.ptr.as_ptr()) }
    }

    /// Bytes the draft context holds on the hot tier's device, as `moe::hot_device_use`: the
    /// weights (shared with the target where the drafter is the model's MTP head), its memory
    /// and its compute buffers. Zeros without a draft context.
    pub fn hot_device_use(&self, main_gpu: usize) -> Option<[u64; 3]> {
        let (mut m, mut c, mut k) = (0usize, 0usize, 0usize);
        let dev = crate::moe::hot_device(main_gpu);
        // SAFETY: valid drafter; the shim catches llama.cpp's exceptions.
        let rc = unsafe { sys::strata_speculative_device_memory(self.ptr.as_ptr(), dev, &mut m, &mut c, &mut k) };
        (rc == 0).then_some([m as u64, c as u64, k as u64])
    }

    /// How far the draft context can cut a sequence back (Partial without one). Clears the
    /// draft context's memory, so ask before serving.
    pub fn probe_seq_rm(&mut self) -> Result<crate::SeqRm> {
        let p = self.live()?;
        let kind = call(|err| {
            // SAFETY: valid drafter; the draft context, if any, is not used while the call runs.
            let k = unsafe { sys::strata_speculative_seq_rm_type(p, err) };
            (k >= 0).then_some(k)
        })?;
        Ok(crate::SeqRm::from_kind(kind, 0))
    }

    /// The drafter's part of a context checkpoint for `seq` (the draft context's partial state,
    /// and with `with_drafter` the drafter's own), for [`Speculative::restore`].
    pub fn checkpoint(&mut self, seq: i32, with_drafter: bool) -> Result<Vec<u8>> {
        let p = self.live()?;
        // SAFETY: valid drafter.
        let b = call(|err| NonNull::new(unsafe { sys::strata_speculative_checkpoint(p, seq, with_drafter, err) }))?;
        // SAFETY: b is a live buffer from the shim; it is copied, then freed once.
        unsafe {
            let out = std::slice::from_raw_parts(sys::strata_bytes_data(b.as_ptr()), sys::strata_bytes_size(b.as_ptr())).to_vec();
            sys::strata_bytes_free(b.as_ptr());
            Ok(out)
        }
    }

    /// Puts back what [`Speculative::checkpoint`] took; an error if it does not fit.
    pub fn restore(&mut self, seq: i32, data: &[u8]) -> Result<()> {
        let p = self.live()?;
        call(|err| {
            // SAFETY: valid drafter; data is readable for its length.
            unsafe { sys::strata_speculative_restore(p, seq, data.as_ptr(), data.len(), err) }.then_some(())
        })
    }

    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<()> {
        let p = self.live()?;
        call(|err| {
            // SAFETY: valid drafter; out-of-range positions are handled by llama.cpp.
            unsafe { sys::strata_speculative_seq_rm(p, seq, p0, p1, err) }.then_some(())
        })
    }

    pub fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        let p = self.live()?;
        call(|err| {
            // SAFETY: as seq_rm.
            unsafe { sys::strata_speculative_seq_add(p, seq, p0, p1, delta, err) }.then_some(())
        })
    }

    /// Whether acceptance follows set rates (--spec-synth-*) instead of the model.
    pub fn has_synth(&self) -> bool {
        // SAFETY: valid drafter.
        unsafe { sys::strata_speculative_has_synth(self.ptr.as_ptr()) }
    }

    /// Seeds `seq`'s synthetic acceptance from the sampler's requested seed.
    pub fn synth_seed(&mut self, seq: i32, sampler: &Sampler) -> Result<()> {
        let p = self.live()?;
        call(|err| {
            // SAFETY: valid drafter and sampler; seq < n_seq of the drafter (one per slot).
            unsafe { sys::strata_speculative_synth_seed(p, seq, sampler.as_ptr(), err) }.then_some(())
        })
    }

    /// As [`Sampler::sample_and_accept_n`], with synthetic acceptance.
    pub fn accept_synth(&mut self, seq: i32, sampler: &mut Sampler, ctx: &mut Context<'_>, idxs: &[i32], draft: &[Token]) -> Result<Vec<Token>> {
        let p = self.live_with(ctx)?;
        crate::sampler::verify(idxs, draft, |out, err| {
            // SAFETY: as sample_and_accept_n; out has room for draft.len() + 1 tokens.
            unsafe { sys::strata_speculative_accept_synth(p, seq, sampler.as_ptr(), ctx.as_ptr(), idxs.as_ptr(), draft.as_ptr(), draft.len() as i32, out, err) }
        })
    }

    /// The most tokens one draft can hold.
    pub fn n_max(&self) -> usize {
        // SAFETY: valid drafter.
        unsafe { sys::strata_speculative_n_max(self.ptr.as_ptr()) }.max(0) as usize
    }

    pub fn accept(&mut self, seq: i32, n_accepted: u16) -> Result<()> {
        let p = self.live()?;
        call(|err| {
            // SAFETY: valid drafter.
            unsafe { sys::strata_speculative_accept(p, seq, n_accepted, err) }.then_some(())
        })
    }
}

impl Drop for Speculative {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { sys::strata_speculative_free(self.ptr.as_ptr()) }
    }
}
