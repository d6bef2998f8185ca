//! `--adapt-every N`: the hot tier follows the routing at run time. Every N batches the
//! selections each tiered layer counted since the last interval go to the policy
//! (residency::adapt: recent use mixed with the profile's rank, with hysteresis), and the swaps
//! it returns exchange an expert of the hot tier with one of the RAM copy: the two change places,
//! so the copy keeps its size and nothing is read from the model file.
//!
//! A swap runs between batches, when no graph reads either expert: the hot expert's rows go
//! through a page-locked staging buffer into the freed row of the copy, the cold expert's rows
//! into the hot slot (straight from a page-locked or host-side copy, else through the staging
//! buffer), and the layer's maps (hot tier, copy, zero-copy decode's expert tables, the prefill
//! ring's record) are rewritten. At most [`SWAPS_PER_BATCH`] run after one batch, so an
//! interval's swaps spread over the following steps instead of stalling one.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use strata_residency::adapt::{Adapter, Start, Swap};

use super::layer::LayerTiers;
use super::tensors::{copy_map_of, hot_map_of, set_map};
use super::types::{Exclusive, PlaceError, T};
use crate::sys;

/// Swaps made after one batch at most (each moves two experts over the bus).
pub const SWAPS_PER_BATCH: usize = 8;

pub use super::types::AdaptPlan;

/// Adaptation's counters, summed over models (for /metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdaptCounters {
    pub intervals: u64,
    /// Swaps made (both experts of each moved).
    pub swaps: u64,
    /// Bytes moved by swaps, both directions.
    pub bytes: u64,
    /// Time the host spent on swaps' copies (and the prefill ring's settling before them), not
    /// counting the wait for the batch before them.
    pub copy_micros: u64,
    /// Time the host spent rewriting the swapped layers' maps.
    pub map_micros: u64,
    /// Swaps the last interval planned.
    pub last_interval: u64,
    /// Planned swaps waiting for the next batches.
    pub pending: u64,
}

struct State {
    model: usize,
    every: u64,
    batches: u64,
    adapter: Adapter,
    layers: Vec<Arc<LayerTiers>>,
    /// Per layer, the tally's per-expert counts at the last interval.
    seen: Vec<Vec<u64>>,
    pending: VecDeque<Swap>,
    staging: StagingBuf,
    /// The hot slot is filled from the RAM copy directly: the copy is page-locked, or the hot
    /// tier is host memory too.
    direct: bool,
    counters: AdaptCounters,
}

// SAFETY: the staging buffer and the layers' tensors are only touched under the STATES lock,
// between batches.
unsafe impl Send for State {}

/// Two expert matrices' worth of host memory (page-locked on a GPU) that swaps copy through.
struct StagingBuf {
    buf: sys::ggml_backend_buffer_t,
    base: *mut u8,
    /// Bytes of each of the two halves.
    half: usize,
}

impl Drop for StagingBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `start`, freed once here.
        unsafe { sys::ggml_backend_buffer_free(self.buf) };
    }
}

static STATES: Mutex<Vec<State>> = Mutex::new(Vec::new());
static ON: AtomicBool = AtomicBool::new(false);

fn nb2(t: T) -> usize {
    // SAFETY: live tensor.
    unsafe { (*t).nb[2] }
}

/// Starts adaptation for the tiered `layers` of `model`. Returns how many layers adapt, and why
/// the others cannot.
pub(super) fn start(
    model: usize,
    plan: &AdaptPlan,
    layers: &[Arc<LayerTiers>],
    dev: sys::ggml_backend_dev_t,
    gpu: bool,
    pinned: bool,
) -> Result<(usize, Option<String>), PlaceError> {
    let mut off = None;
    let eligible: Vec<Arc<LayerTiers>> = layers
        .iter()
        .filter(|lt| {
            let ok = lt.ram_copy && lt.hot.is_some() && lt.n_cold > 0;
            if !ok && !lt.ram_copy && lt.n_cold > 0 {
                off.get_or_insert_with(|| "cold experts read from the model file, not a RAM copy".to_string());
            }
            ok
        })
        .cloned()
        .collect();
    if eligible.is_empty() {
        return Ok((0, off));
    }
    let half = eligible.iter().flat_map(|lt| lt.hot.as_ref().expect("eligible").mats.iter()).map(nb2).max().unwrap_or(0);
    // SAFETY: valid device; the host buffer type is NULL where the device has none.
    let buft = unsafe {
        let b = if gpu { sys::ggml_backend_dev_host_buffer_type(dev) } else { std::ptr::null_mut() };
        if b.is_null() {
            sys::ggml_backend_dev_buffer_type(sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU))
        } else {
            b
        }
    };
    // SAFETY: valid buffer type.
    let buf = unsafe { sys::ggml_backend_buft_alloc_buffer(buft, 2 * half) };
    if buf.is_null() {
        return Err(PlaceError::Alloc { what: "the expert swap staging buffer".into(), bytes: 2 * half as u64, device: "host".into() });
    }
    // SAFETY: valid buffer.
    let staging = StagingBuf { buf, base: unsafe { sys::ggml_backend_buffer_get_base(buf) }.cast(), half };
    let starts = eligible
        .iter()
        .map(|lt| {
            let hot_slots = lt.hot_slots.lock().unwrap_or_else(|e| e.into_inner());
            let mut hot = vec![0u32; lt.n_hot];
            for (e, &s) in hot_slots.iter().enumerate() {
                if let Some(h) = usize::try_from(s).ok().and_then(|s| hot.get_mut(s)) {
                    *h = e as u32;
                }
            }
            let profile_hits = plan.prior.iter().find(|(l, _)| *l == lt.layer).map(|(_, h)| h.clone());
            Start { layer: lt.layer, n_expert: lt.n_expert(), hot, profile_hits }
        })
        .collect();
    let seen = eligible.iter().map(|lt| counts(lt)).collect();
    let n = eligible.len();
    let mut states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    states.retain(|s| s.model != model);
    states.push(State {
        model,
        every: plan.every,
        batches: 0,
        adapter: Adapter::new(plan.policy, starts),
        layers: eligible,
        seen,
        pending: VecDeque::new(),
        staging,
        direct: pinned || !gpu,
        counters: AdaptCounters::default(),
    });
    ON.store(true, Ordering::Relaxed);
    Ok((n, off))
}

fn counts(lt: &LayerTiers) -> Vec<u64> {
    lt.tally.per_expert.iter().map(|c| c.load(Ordering::Relaxed)).collect()
}

/// Drops the adaptation of a model being freed.
pub(crate) fn forget_model(model: usize) {
    STATES.lock().unwrap_or_else(|e| e.into_inner()).retain(|s| s.model != model);
}

/// After each batch a context of the model decoded (the draft context of an MTP head
/// included): counts it, ends an interval every N batches, and makes up to [`SWAPS_PER_BATCH`]
/// of the planned swaps, while `ex` proves that no graph of the model is in flight.
pub(crate) fn after_batch(ex: &Exclusive<'_>) {
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    let mut states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    for st in states.iter_mut().filter(|st| st.model == ex.model) {
        st.batches += 1;
        if st.batches % st.every == 0 {
            st.interval();
        }
        if !st.pending.is_empty() {
            st.run(SWAPS_PER_BATCH);
        }
    }
}

/// Adaptation's counters over every model (None: no model adapts).
pub fn counters() -> Option<AdaptCounters> {
    let states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = None::<AdaptCounters>;
    for st in states.iter() {
        let o = out.get_or_insert_with(AdaptCounters::default);
        let c = &st.counters;
        o.intervals += c.intervals;
        o.swaps += c.swaps;
        o.bytes += c.bytes;
        o.copy_micros += c.copy_micros;
        o.map_micros += c.map_micros;
        o.last_interval += c.last_interval;
        o.pending += st.pending.len() as u64;
    }
    out
}

impl State {
    fn interval(&mut self) {
        for (lt, seen) in self.layers.iter().zip(self.seen.iter_mut()) {
            let now = counts(lt);
            let delta: Vec<u64> = now.iter().zip(seen.iter()).map(|(n, s)| n.saturating_sub(*s)).collect();
            self.adapter.observe_counts(lt.layer, &delta);
            *seen = now;
        }
        // No more than the batches until the next interval can make: the queue stays bounded.
        let room = (self.every as usize).saturating_mul(SWAPS_PER_BATCH).saturating_sub(self.pending.len());
        let swaps = self.adapter.interval_at_most(room);
        self.counters.intervals += 1;
        self.counters.last_interval = swaps.len() as u64;
        self.pending.extend(swaps);
    }

    fn run(&mut self, max: usize) {
        let t0 = std::time::Instant::now();
        let mut settled = Vec::new();
        let mut touched: Vec<&Arc<LayerTiers>> = Vec::new();
        for sw in next_swaps(&mut self.pending, max) {
            let Some(lt) = self.layers.iter().find(|lt| lt.layer == sw.layer) else { continue };
            if let Some((ring, _)) = lt.ring.as_ref() {
                if !settled.iter().any(|r| Arc::ptr_eq(r, ring)) {
                    ring.settle();
                    settled.push(ring.clone());
                }
            }
            if let Some(bytes) = exchange(lt, &sw, &self.staging, self.direct) {
                self.counters.swaps += 1;
                self.counters.bytes += bytes;
                if !touched.iter().any(|t| Arc::ptr_eq(t, lt)) {
                    touched.push(lt);
                }
            }
        }
        let t1 = std::time::Instant::now();
        // Each changed layer's maps once, after all of its swaps: no graph runs in between.
        for lt in touched {
            publish(lt);
        }
        self.counters.copy_micros += (t1 - t0).as_micros() as u64;
        self.counters.map_micros += t1.elapsed().as_micros() as u64;
    }
}

/// Takes up to `max` swaps from the front of `pending`, each taken layer's later swaps with it: a
/// layer's maps are rewritten once after its swaps, so fewer layers a batch means fewer rewrites.
/// A layer's swaps keep their order (a later one may move an expert an earlier one brought in);
/// those of different layers are independent.
fn next_swaps(pending: &mut VecDeque<Swap>, max: usize) -> Vec<Swap> {
    let mut out = Vec::new();
    while out.len() < max {
        let Some(first) = pending.pop_front() else { break };
        let layer = first.layer;
        out.push(first);
        let mut i = 0;
        while i < pending.len() && out.len() < max {
            if pending[i].layer == layer {
                out.extend(pending.remove(i));
            } else {
                i += 1;
            }
        }
    }
    out
}

/// Exchanges hot slot `sw.slot` (expert `sw.out`) with the RAM copy's row of `sw.into` and
/// records where both now are; [`publish`] then rewrites the layer's maps. Returns the bytes
/// moved, or None when the layer no longer matches the plan (nothing changed then).
fn exchange(lt: &LayerTiers, sw: &Swap, st: &StagingBuf, direct: bool) -> Option<u64> {
    let hot = lt.hot.as_ref()?;
    let (out, into) = (sw.out as usize, sw.into as usize);
    let mut hot_slots = lt.hot_slots.lock().unwrap_or_else(|e| e.into_inner());
    let row = lt.cold_row(sw.into as i32)?;
    if hot_slots.get(out).copied() != Some(sw.slot as i32) || lt.cold_row(sw.out as i32).is_some() {
        return None;
    }
    let mut bytes = 0u64;
    for (h, c) in hot.mats.iter().zip(lt.cold_tensors.iter()) {
        let n = nb2(h);
        debug_assert!(n == nb2(c) && n <= st.half);
        // SAFETY: c is the RAM copy (host memory) with > row experts; h has > slot experts of
        // the same stride; the staging halves hold n bytes each; no graph runs between batches.
        unsafe {
            let ram = (*c).data.cast::<u8>().add(row * n);
            let (a, b) = (st.base, st.base.add(st.half));
            sys::ggml_backend_tensor_get(h, b.cast(), sw.slot * n, n);
            if direct {
                sys::ggml_backend_tensor_set(h, ram.cast(), sw.slot * n, n);
            } else {
                std::ptr::copy_nonoverlapping(ram, a, n);
                sys::ggml_backend_tensor_set(h, a.cast(), sw.slot * n, n);
            }
            std::ptr::copy_nonoverlapping(b, ram, n);
        }
        bytes += 2 * n as u64;
    }
    hot_slots[out] = -1;
    hot_slots[into] = sw.slot as i32;
    lt.cold_rows[into].store(-1, Ordering::Relaxed);
    lt.cold_rows[out].store(row as i32, Ordering::Relaxed);
    Some(bytes)
}

/// Writes a layer's maps from its record of where each expert is: the per-position hot map, the
/// prompt path's copy map, zero-copy decode's tables, the prefill ring's record.
fn publish(lt: &LayerTiers) {
    let Some(hot) = lt.hot.as_ref() else { return };
    let hot_slots = lt.hot_slots.lock().unwrap_or_else(|e| e.into_inner());
    let cold_rows: Vec<i32> = lt.cold_rows.iter().map(|r| r.load(Ordering::Relaxed)).collect();
    set_map(hot.map, &hot_map_of(&hot_slots, lt.n_hot, lt.n_used));
    if let Some(m) = lt.cold_map {
        set_map(m, &copy_map_of(&cold_rows, lt.n_cold));
    }
    if let Some((ring, i)) = lt.ring.as_ref() {
        ring.reassign(*i, cold_rows, hot_slots.clone());
    }
    drop(hot_slots);
    lt.write_decode_maps();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sw(layer: i32, slot: usize) -> Swap {
        Swap { layer, slot, out: slot as u32, into: 100 + slot as u32 }
    }

    #[test]
    fn a_batch_takes_each_layer_s_swaps_together_in_their_order() {
        let mut q: VecDeque<Swap> = [sw(1, 0), sw(2, 0), sw(1, 1), sw(3, 0), sw(2, 1), sw(1, 2)].into();
        assert_eq!(next_swaps(&mut q, 4), [sw(1, 0), sw(1, 1), sw(1, 2), sw(2, 0)]);
        assert_eq!(Vec::from(q.clone()), [sw(3, 0), sw(2, 1)]);
        assert_eq!(next_swaps(&mut q, 8), [sw(3, 0), sw(2, 1)]);
        assert!(next_swaps(&mut q, 8).is_empty());
    }
}
