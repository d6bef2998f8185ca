//! The tiered layers of every loaded model, found by the MoE hook through their down tensor,
//! and the counters summed over them for /metrics.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};

use super::layer::LayerTiers;
use super::ring;
use super::tensors::{expert_tensors, n_blocks};
use super::types::RingCounters;
use super::{adapt, graph};
use crate::hooks::MoeExperts;
use crate::model::Model;
use crate::sys;

/// Tiered layers keyed by the address of their down_exps tensor (unique per model and layer).
pub(crate) static REGISTRY: RwLock<Option<HashMap<usize, Arc<LayerTiers>>>> = RwLock::new(None);

/// Drops the tiers of a model being freed.
pub(crate) fn forget_model(model: *const sys::llama_model) {
    adapt::forget_model(model as usize);
    crate::decode_scope::forget(model as usize);
    FAILURES.lock().unwrap_or_else(|e| e.into_inner()).retain(|(m, _)| *m != model as usize);
    if let Ok(mut r) = REGISTRY.write() {
        if let Some(map) = r.as_mut() {
            map.retain(|_, lt| lt.model != model as usize);
        }
    }
}

/// Why a batch a context of the model is decoding cannot be right, by model.
static FAILURES: std::sync::Mutex<Vec<(usize, String)>> = std::sync::Mutex::new(Vec::new());

/// Records that the batch being decoded over `model` computed without data it needed (its first
/// reason is kept).
pub(crate) fn fail(model: usize, why: &str) {
    let mut f = FAILURES.lock().unwrap_or_else(|e| e.into_inner());
    if !f.iter().any(|(m, _)| *m == model) {
        f.push((model, why.to_string()));
    }
}

/// Why the batch just decoded over `model` failed, if it did (cleared by asking).
pub(crate) fn take_failure(model: usize) -> Option<String> {
    let mut f = FAILURES.lock().unwrap_or_else(|e| e.into_inner());
    let i = f.iter().position(|(m, _)| *m == model)?;
    Some(f.swap_remove(i).1)
}

/// The tiered experts of one layer, or None for a layer without tiers.
pub(crate) fn build_experts(args: &MoeExperts<'_>) -> Option<std::ptr::NonNull<sys::ggml_tensor>> {
    let key = args.raw().down_exps as usize;
    let lt = REGISTRY.read().ok()?.as_ref()?.get(&key)?.clone();
    graph::build(args.raw(), &lt)
}

/// Graph nodes the tiers may add to one graph of `model`.
pub(crate) fn extra_nodes(model: *const sys::llama_model) -> u32 {
    if model.is_null() {
        return 0;
    }
    // llama.cpp passes a loaded model, live for the call.
    let n = (0..n_blocks(model)).filter(|&il| expert_tensors(model, il).is_some()).count();
    n as u32 * graph::EXTRA_NODES_PER_LAYER
}

/// Selections per tier summed over every tiered layer of every model (for /metrics).
pub fn hits() -> [u64; 3] {
    let mut out = [0u64; 3];
    if let Ok(r) = REGISTRY.read() {
        for lt in r.as_ref().into_iter().flat_map(HashMap::values) {
            for (o, h) in out.iter_mut().zip(&lt.tally.hits) {
                *o += h.load(Ordering::Relaxed);
            }
        }
    }
    out
}

/// Cold experts uploaded to staging slots (`--pcie-frac`) over every tiered layer.
pub fn uploads() -> u64 {
    REGISTRY.read().map_or(0, |r| r.as_ref().into_iter().flat_map(HashMap::values).map(|lt| lt.tally.uploads.load(Ordering::Relaxed)).sum())
}

/// Every prefill ring built, for /metrics (dropped with the last layer that uses it).
pub(crate) static RINGS: std::sync::Mutex<Vec<std::sync::Weak<ring::Ring>>> = std::sync::Mutex::new(Vec::new());

pub fn ring_stats() -> Option<RingCounters> {
    let mut rings = RINGS.lock().unwrap_or_else(|e| e.into_inner());
    rings.retain(|w| w.strong_count() > 0);
    let mut out = None::<RingCounters>;
    for ring in rings.iter().filter_map(std::sync::Weak::upgrade) {
        let s = &ring.stats;
        let o = out.get_or_insert_with(RingCounters::default);
        o.h2d_bytes += s.h2d_bytes.load(Ordering::Relaxed);
        o.h2d_bytes_last_batch += s.h2d_bytes_last_batch.load(Ordering::Relaxed);
        o.hits += s.hits.load(Ordering::Relaxed);
        o.fills += s.fills.load(Ordering::Relaxed);
        o.stalls += s.stalls.load(Ordering::Relaxed);
        o.batches += s.batches.load(Ordering::Relaxed);
        o.waves += s.waves.load(Ordering::Relaxed);
    }
    out
}

/// Selections per (layer, expert) of `model` since it was attached, by layer.
pub fn expert_counts(model: &Model) -> Vec<(i32, Vec<u64>)> {
    let mut out: Vec<(i32, Vec<u64>)> = Vec::new();
    if let Ok(r) = REGISTRY.read() {
        for lt in r.as_ref().into_iter().flat_map(HashMap::values).filter(|lt| lt.model == model.as_ptr() as usize) {
            out.push((lt.layer, lt.tally.per_expert.iter().map(|c| c.load(Ordering::Relaxed)).collect()));
        }
    }
    out.sort_by_key(|(l, _)| *l);
    out
}
