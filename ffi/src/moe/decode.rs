//! Decode's bookkeeping of zero-copy layers: the routing each step logged, counted after the
//! step, and the tables written from the record of where each expert is.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::kernels;
use super::registry::REGISTRY;

/// Counts the selections that zero-copy decode steps of `model` logged since the last call.
/// Called after a batch's graph has finished (Context::decode synchronises its context first).
pub(crate) fn after_decode(model: usize) {
    let Ok(r) = REGISTRY.read() else { return };
    let mut sel = Vec::new();
    for lt in r.as_ref().into_iter().flat_map(HashMap::values).filter(|lt| lt.model == model) {
        if let Some(z) = lt.zero_copy.as_ref() {
            sel.clear();
            z.take_log(&mut sel);
            if !sel.is_empty() {
                kernels::tally(lt, &sel);
            }
        }
    }
}

/// Set once a tiered layer decodes with zero-copy reads (its log needs reading after a batch).
pub(crate) static ZERO_COPY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(crate) fn zero_copy_active() -> bool {
    ZERO_COPY.load(Ordering::Relaxed)
}
