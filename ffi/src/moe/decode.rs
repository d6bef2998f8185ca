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

/// Whether a ubatch of `n_tokens` rows, `n_outputs` of them output rows, may have written
/// routing logs: a layer of it computed at most MAX_TOKENS rows (the last layer computes only
/// the output rows).
pub(crate) fn logs_routing(n_tokens: u32, n_outputs: i32) -> bool {
    let few = |n: i64| (1..=super::zero_copy::MAX_TOKENS).contains(&n);
    ZERO_COPY.load(Ordering::Relaxed) && (few(i64::from(n_tokens)) || few(i64::from(n_outputs)))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicI32, AtomicU8, AtomicUsize};
    use std::sync::{Arc, Mutex};

    use super::super::layer::LayerTiers;
    use super::super::tensors::Owned;
    use super::super::types::{Mats, Tally, Tier, T};
    use super::super::zero_copy::on_host::{layer, read_log, write_log};
    use super::super::zero_copy::ZeroCopy;
    use super::*;

    /// Experts 1 and 3 hot, 0, 2 and 4 cold (rows 2, 0, 1), routed 2 per token.
    const HOT: [i32; 5] = [-1, 1, -1, 0, -1];
    const COLD: [i32; 5] = [2, -1, 0, -1, 1];

    fn tiers(model: usize, zero_copy: Option<ZeroCopy>, owned: Owned) -> LayerTiers {
        LayerTiers {
            model,
            layer: 7,
            n_embd: 3,
            n_ff: 2,
            activation: AtomicU8::new(0),
            hot: None,
            cold_tensors: Mats { up: None, gate: None, down: None, gate_up: None },
            cold: Mats { up: None, gate: None, down: None, gate_up: None },
            cold_rows: COLD.iter().map(|&r| AtomicI32::new(r)).collect(),
            hot_slots: Mutex::new(HOT.to_vec()),
            n_hot: 2,
            ram_copy: true,
            cold_map: None,
            cold_mask: None,
            cold_tier: Tier::Ram,
            n_cold: 3,
            cold_threads: 0,
            count_only: false,
            flat_from: i64::MAX,
            n_used: 2,
            cold_share_prior: 0.6,
            staging: None,
            pcie_frac: 0.0,
            tally: Arc::new(Tally::new(HOT.len())),
            window: None,
            ring: None,
            ring_other: None,
            max_passes: 1,
            passes: AtomicUsize::new(1),
            zero_copy,
            _owned: owned,
        }
    }

    /// A registered zero-copy layer of `model` and its log.
    fn zero_copy_layer(model: usize) -> (Arc<LayerTiers>, T) {
        let l = layer(HOT.len(), 2, 3, 2, 7);
        (Arc::new(tiers(model, Some(l.zc), l.owned)), l.log)
    }

    fn counts(lt: &LayerTiers) -> (Vec<u64>, [u64; 3]) {
        (lt.tally.per_expert.iter().map(|c| c.load(Ordering::Relaxed)).collect(), lt.tally.hits.each_ref().map(|c| c.load(Ordering::Relaxed)))
    }

    #[test]
    fn after_decode_tallies_what_the_models_zero_copy_layers_logged_and_empties_their_logs() {
        // Unique model ids and registry keys: the addresses of live allocations.
        let ids: Vec<Box<u8>> = (0..5).map(Box::new).collect();
        let id = |i: usize| &*ids[i] as *const u8 as usize;
        let (model, other) = (id(0), id(1));
        let (a, a_log) = zero_copy_layer(model);
        let b = Arc::new(tiers(model, None, Owned::default()));
        let (c, c_log) = zero_copy_layer(other);
        {
            let mut r = REGISTRY.write().unwrap();
            let map = r.get_or_insert_with(HashMap::new);
            for (k, lt) in [(id(2), &a), (id(3), &b), (id(4), &c)] {
                map.insert(k, lt.clone());
            }
        }
        // Two tokens of layer A routed to (1, 0) and (4, 1); one of C's to (2, 2).
        write_log(a_log, &[1.0, 0.0, 4.0, 1.0]);
        write_log(c_log, &[2.0, 2.0]);
        after_decode(model);
        assert_eq!(counts(&a), (vec![1, 2, 0, 0, 1], [2, 2, 0]), "1 twice hot; 0 and 4 in the RAM copy");
        assert!(read_log(a_log).iter().all(|&v| v == -1.0), "the log is empty for the next step");
        assert_eq!(counts(&b), (vec![0; 5], [0; 3]), "a layer without zero-copy has no log");
        assert_eq!(counts(&c), (vec![0; 5], [0; 3]), "another model's layer is not read");
        assert_eq!(&read_log(c_log)[..2], [2.0, 2.0]);
        after_decode(model);
        assert_eq!(counts(&a).1, [2, 2, 0], "each step is counted once");
        after_decode(other);
        assert_eq!(counts(&c), (vec![0, 0, 2, 0, 0], [0, 2, 0]));
        let mut r = REGISTRY.write().unwrap();
        let map = r.as_mut().expect("registered");
        for k in 2..5 {
            map.remove(&id(k));
        }
    }
}
