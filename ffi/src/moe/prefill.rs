//! What a prompt batch does with a tiered layer: the prefill ring or the CPU for its cold
//! selections, and how many passes through the ring, by the cost model and the layer's counts.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::layer::LayerTiers;
use super::types::{Mats, Tier, T};
use super::{kernels, ring};
use crate::sys;
use strata_residency::plan;

/// Passes through the ring planned for this many times the expected distinct cold experts.
pub(crate) const PASS_MARGIN: f64 = 1.25;
/// Selections a layer counts before its own cold share replaces the profile's.
pub(crate) const COLD_SHARE_MIN_COUNT: u64 = 4096;
/// Cold (token, expert) pairs per CPU worker up to which a prompt batch keeps them on the CPU.
/// A pair costs the CPU about one expert's weights read once; a second GPU pass costs a whole
/// batch of mul_mat_id plus the uploads. Not yet calibrated on a GPU.
pub(crate) const COLD_PAIRS_PER_WORKER: i32 = 8;
/// Workers assumed without a pool (the CPU backend's own threads).
pub(crate) const COLD_MIN_WORKERS: i32 = 4;

impl LayerTiers {
    /// Whether a batch of `n_tok` tokens computes its cold selections on the CPU workers (as
    /// decode does) rather than as a second mul_mat_id pass that uploads the used cold experts:
    /// yes while the expected cold (token, expert) pairs are few for the workers.
    pub(crate) fn cold_on_cpu(&self, n_tok: i64) -> bool {
        cold_pairs_fit_the_cpu(n_tok, self.n_used, self.cold_share(), self.cold_threads)
    }

    /// The share of selections that miss the hot tier: the layer's own once it has counted
    /// enough, the profile's before.
    fn cold_share(&self) -> f64 {
        let (hot, cold) = (self.tally.hits[Tier::Hot as usize].load(Ordering::Relaxed), self.tally.hits[self.cold_tier as usize].load(Ordering::Relaxed));
        cold_share(hot, cold, self.cold_share_prior)
    }

    /// Whether a prompt batch of `n_tok` tokens takes the prefill ring: the layer has a window
    /// and the cost model (copy rate, CPU rate, measured at start-up) finds copying the
    /// expected distinct cold experts quicker than computing the cold pairs on the CPU.
    /// Also sets the passes the batch's graph takes through the ring: enough for every cold
    /// expert the batch could use when the configured number allows (then the graph needs no CPU
    /// part, whose hand-off of the batch's hidden state costs even when it has nothing to do),
    /// else enough for the expected distinct cold experts with a margin.
    pub(crate) fn ring_preferred(&self, n_tok: i64) -> bool {
        let Some((ring, i)) = self.ring.as_ref().filter(|_| self.window.is_some()) else { return false };
        let (on, distinct) = self.ring_cheaper(ring, n_tok);
        ring.set_active(*i, on);
        let passes = if self.ring_other.is_none() { 1 } else { ring_passes(self.cold_used_at_most(n_tok), distinct, ring.half, self.max_passes) };
        self.passes.store(passes, Ordering::Relaxed);
        on
    }

    /// The most distinct cold experts a batch of `n_tok` tokens can select.
    pub(crate) fn cold_used_at_most(&self, n_tok: i64) -> usize {
        self.n_cold.min(self.n_used * usize::try_from(n_tok).unwrap_or(0))
    }

    /// The tensors pass `k` through the ring computes from: the window (its own half) for even
    /// passes, the other half's for odd ones.
    pub(crate) fn pass_mats(&self, k: usize) -> Option<&Mats<T>> {
        if k.is_multiple_of(2) {
            self.window.as_ref()
        } else {
            self.ring_other.as_ref()
        }
    }

    /// Passes through the ring of the graph being computed.
    pub(crate) fn ring_passes(&self) -> usize {
        self.passes.load(Ordering::Relaxed).max(1)
    }

    /// Whether the ring is quicker for a batch, and the distinct cold experts it is expected to use.
    fn ring_cheaper(&self, ring: &ring::Ring, n_tok: i64) -> (bool, f64) {
        let draws = n_tok as f64 * self.n_used as f64;
        let all = (self.n_cold as f64).min(draws);
        // The emulation tests the ring's graph and accounting; the choice is the device's.
        if ring.emulated {
            return (true, all);
        }
        let Some(cost) = *ring.cost.lock().unwrap_or_else(|e| e.into_inner()) else { return (true, all) };
        let total: u64 = self.tally.per_expert.iter().map(|c| c.load(Ordering::Relaxed)).sum();
        let q: Vec<f64> = if total >= COLD_SHARE_MIN_COUNT {
            (0..self.n_expert())
                .filter(|&e| self.cold_row(e as i32).is_some())
                .map(|e| self.tally.per_expert[e].load(Ordering::Relaxed) as f64 / total as f64)
                .collect()
        } else {
            vec![self.cold_share_prior / self.n_cold.max(1) as f64; self.n_cold]
        };
        let distinct = plan::expected_distinct(q.iter().copied(), draws);
        (plan::batch_prefers_ring(&cost, n_tok as f64, self.n_used as f64, self.cold_share(), q.into_iter()), distinct)
    }
}

/// The custom op of a tiered layer's prompt batch, its first pass through the ring. Sources:
/// sel [n_used, n_tok] i32, then a cold host tensor (it places the op on the CPU). Writes dst
/// [n_used, n_tok] i32: each selection's slot in the layer's window: its hot slot, its ring slot,
/// -1 where a later pass computes it, or (a cold expert no pass has room for) the zero pad of
/// its position, which the CPU part computes instead.
///
/// # Safety
/// Called by ggml as a custom op: `dst` is the op's live tensor with the sources listed above,
/// and `userdata` the layer's `LayerTiers`, alive for the graph. A panic here aborts (it cannot
/// unwind through ggml's C frames).
pub(crate) unsafe extern "C" fn fill(dst: *mut sys::ggml_tensor, ith: i32, nth: i32, userdata: *mut c_void) {
    // SAFETY: as fill_only.
    unsafe { fill_only(dst, ith, nth, userdata) };
    if ith == 0 {
        // SAFETY: userdata is the layer's LayerTiers; sel is the first source, contiguous i32.
        unsafe { kernels::tally(&*(userdata as *const LayerTiers), kernels::ids(&*(*dst).src[0])) };
    }
}

/// [`fill`] without counting the selections, for graphs whose CPU part counts them.
///
/// # Safety
/// As [`fill`].
pub(crate) unsafe extern "C" fn fill_only(dst: *mut sys::ggml_tensor, ith: i32, _nth: i32, userdata: *mut c_void) {
    if ith == 0 {
        // SAFETY: as fill.
        unsafe { fill_pass_at(dst, 0, userdata) };
    }
}

/// Pass `K` (>= 1) of a layer in waves: each selection's slot in this pass's tensors, or -1.
/// Sources: sel, a view of the previous pass's output (so the scheduler runs this step after
/// that pass has computed, when the half it used is free), then a cold host tensor.
///
/// # Safety
/// As [`fill`].
pub(crate) unsafe extern "C" fn fill_pass<const K: usize>(dst: *mut sys::ggml_tensor, ith: i32, _nth: i32, userdata: *mut c_void) {
    if ith == 0 {
        // SAFETY: as fill.
        unsafe { fill_pass_at(dst, K, userdata) };
    }
}

/// The fill op of pass `k`, for the graph builder.
pub(crate) fn fill_op(k: usize) -> sys::ggml_custom_op_t {
    let f: unsafe extern "C" fn(*mut sys::ggml_tensor, i32, i32, *mut c_void) = match k {
        0 => fill_only,
        1 => fill_pass::<1>,
        2 => fill_pass::<2>,
        3 => fill_pass::<3>,
        4 => fill_pass::<4>,
        5 => fill_pass::<5>,
        6 => fill_pass::<6>,
        _ => fill_pass::<7>,
    };
    Some(f)
}

/// # Safety
/// `dst` is a fill op's live tensor (sel its first source) and `userdata` the layer's `LayerTiers`.
unsafe fn fill_pass_at(dst: *mut sys::ggml_tensor, k: usize, userdata: *mut c_void) {
    // SAFETY: userdata is the layer's LayerTiers, kept alive by the registry while graphs exist.
    let lt = unsafe { &*(userdata as *const LayerTiers) };
    // SAFETY: the graph builder gave this op sel as its first source; dst is i32 of sel's shape.
    let (sel, out) = unsafe {
        let sel = &*(*dst).src[0];
        (kernels::ids(sel), std::slice::from_raw_parts_mut((*dst).data as *mut i32, (sel.ne[0] * sel.ne[1]) as usize))
    };
    let Some((ring, i)) = lt.ring.as_ref() else { return };
    let ((cols, n_as), skips) = match ring.fill(*i, k, lt.ring_passes(), sel, out) {
        Some(r) => r,
        None => {
            // The graph runs on with this pass computing nothing (every id skipped); the batch
            // then fails (decode_scope) and the layer's wrong result reaches no one.
            let why = "the prefill ring could not copy cold experts to the device";
            crate::backend::log(crate::backend::Verbosity::Error, &format!("prefill ring: {why}\n"));
            super::fail(lt.model, why);
            out.fill(-1);
            ((0, 0), true)
        }
    };
    // The pass's mul_mat_ids run next (a later split of this graph, on this thread): tell the
    // backend how little of the tensors this pass uses, and whether some ids are -1 (patches/0003,
    // patches/0005).
    if let Some(w) = lt.pass_mats(k) {
        for t in w.iter() {
            // SAFETY: the tensors are the layer's own, alive while it is; nothing else writes
            // their op_params, and the graph that reads them runs on this thread after this op.
            unsafe {
                (*t).op_params[0] = cols;
                (*t).op_params[1] = n_as;
                (*t).op_params[2] = i32::from(skips);
            }
        }
    }
}

/// Measures the CPU's cold (token, expert) pair rate on one thread with `n` cold experts of
/// `lt` (a zero input; the time does not depend on the values).
pub(crate) fn measure_cpu(lt: &LayerTiers, n: usize) -> Option<f64> {
    let rows: Vec<i32> = (0..lt.n_expert() as i32).filter(|&e| lt.cold_row(e).is_some()).take(n).collect();
    if rows.is_empty() {
        return None;
    }
    let n_used = rows.len();
    let x = vec![0.0f32; lt.n_embd];
    let items: Vec<(usize, usize, usize)> = rows.iter().enumerate().filter_map(|(k, &e)| Some((0, k, lt.cold_row(e)?))).collect();
    let mut h = vec![0.0f32; lt.n_ff * n_used];
    let mut y = vec![0.0f32; lt.n_embd * n_used];
    let t0 = Instant::now();
    kernels::gate_up_rows(lt, |_| &x[..], &items, n_used, h.as_mut_ptr(), 0, items.len() * lt.n_ff);
    kernels::down_rows(lt, h.as_ptr(), &rows, &[], None, n_used, y.as_mut_ptr(), 0, lt.n_embd);
    let s = t0.elapsed().as_secs_f64();
    (s > 0.0).then(|| rows.len() as f64 / s)
}

/// Whether a prompt batch's expected cold (token, expert) pairs are few enough for the CPU
/// workers (`threads`; the CPU backend's own when there is no pool).
fn cold_pairs_fit_the_cpu(n_tok: i64, n_used: usize, cold_share: f64, threads: i32) -> bool {
    n_tok as f64 * n_used as f64 * cold_share <= (COLD_PAIRS_PER_WORKER * threads.max(COLD_MIN_WORKERS)) as f64
}

/// The share of a layer's selections that missed the hot tier: its own count once it has
/// enough, else the profile's `prior`.
fn cold_share(hot: u64, cold: u64, prior: f64) -> f64 {
    if hot + cold >= COLD_SHARE_MIN_COUNT {
        cold as f64 / (hot + cold) as f64
    } else {
        prior
    }
}

/// Passes through a ring of `half` slots a half for a batch that can use at most `at_most` cold
/// experts and is expected to use `distinct`: all it could use when `max_passes` allows, else the
/// expected ones with a margin.
fn ring_passes(at_most: usize, distinct: f64, half: usize, max_passes: usize) -> usize {
    if half == 0 {
        return 1;
    }
    let worst = at_most.div_ceil(half).max(1);
    if worst <= max_passes {
        worst
    } else {
        ((distinct * PASS_MARGIN / half as f64).ceil() as usize).clamp(1, max_passes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_batch_keeps_few_expected_cold_pairs_on_the_cpu() {
        // 8 pairs a worker, at least 4 workers: 32 pairs without a pool.
        assert!(cold_pairs_fit_the_cpu(32, 8, 0.125, 0));
        assert!(!cold_pairs_fit_the_cpu(33, 8, 0.125, 0));
        assert!(cold_pairs_fit_the_cpu(64, 8, 0.125, 8), "a pool of 8 takes 64 pairs");
        assert!(cold_pairs_fit_the_cpu(4096, 8, 0.0, 0), "nothing cold");
    }

    #[test]
    fn the_cold_share_is_the_profiles_until_the_layer_has_counted_enough() {
        assert_eq!(cold_share(100, 100, 0.2), 0.2);
        assert_eq!(cold_share(3072, 1024, 0.2), 0.25);
    }

    #[test]
    fn passes_cover_every_usable_cold_expert_when_allowed_else_the_expected_ones() {
        assert_eq!(ring_passes(10, 10.0, 0, 4), 1, "no ring half");
        assert_eq!(ring_passes(3, 3.0, 8, 4), 1);
        assert_eq!(ring_passes(30, 12.0, 8, 4), 4, "30 fit in 4 passes of 8");
        // 100 usable do not fit 4 passes: the 12 expected with a 1.25 margin take 2.
        assert_eq!(ring_passes(100, 12.0, 8, 4), 2);
        assert_eq!(ring_passes(100, 90.0, 8, 4), 4, "capped by the configured passes");
    }
}
