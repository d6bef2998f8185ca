//! One tiered layer as the graph builder, the kernels, the ring and adaptation see it.

use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};
use std::sync::Arc;

use super::tensors::Owned;
use super::types::{Activation, ColdMat, Mats, Tally, Tier, T};
use super::{ring, zero_copy};
use crate::sys;

/// `--pcie-frac`: device slots that a decode step fills with some of its cold experts (then
/// computed there instead of on the CPU), plus one zero pad per routing position.
pub(crate) struct Staging {
    pub mats: Mats<T>,
    /// Upload slots; the pads follow them.
    pub slots: usize,
}

impl Staging {
    /// Copies cold row `row` of every matrix into staging slot `slot` (a synchronous copy).
    pub(crate) fn fill(&self, slot: usize, cold: &Mats<ColdMat>, row: usize) {
        for (c, d) in cold.iter().zip(self.mats.iter()) {
            // SAFETY: c addresses the cold tensor's host data with row < its experts; d has more
            // than `slot` experts of the same stride.
            unsafe { sys::ggml_backend_tensor_set(d, c.data.add(row * c.nb2).cast(), slot * c.nb2, c.nb2) };
        }
    }
}

/// The hot tier of a layer: its experts plus one zero pad per routing position, and the map
/// [1, n_expert, n_used] i32 whose slice j sends expert e to its slot, or a cold one to pad j
/// (so that no slot repeats within a token, as grouped GPU kernels need).
pub(crate) struct Hot {
    pub mats: Mats<T>,
    pub map: T,
}

/// One layer's tiers, shared by the graph builder and the kernels.
pub(crate) struct LayerTiers {
    pub(crate) model: usize,
    pub layer: i32,
    pub n_embd: usize,
    pub n_ff: usize,
    /// The layer's Activation, as the graph builder last saw it.
    pub(crate) activation: AtomicU8,
    pub hot: Option<Hot>,
    /// The cold weight tensors (for graph sources) and how the kernels read them.
    pub cold_tensors: Mats<T>,
    pub cold: Mats<ColdMat>,
    /// expert -> row in the cold tensors, or -1 for a hot expert (changed by adaptation between
    /// batches only).
    pub(crate) cold_rows: Vec<AtomicI32>,
    /// expert -> hot slot, or -1 for a cold expert (adaptation's record; graphs read the maps).
    pub(crate) hot_slots: std::sync::Mutex<Vec<i32>>,
    /// Experts the hot tier holds (its pads follow them).
    pub(crate) n_hot: usize,
    /// The cold tensors are a RAM copy made at placement (not llama.cpp's own tensors).
    pub(crate) ram_copy: bool,
    /// expert -> row in the cold tensors for prompt batches: hot experts go to the pad row of the
    /// RAM copy, or with the mapping to a stand-in cold expert whose result `cold_mask` zeroes.
    pub cold_map: Option<T>,
    /// expert -> 1.0 (cold) or 0.0 (hot), f32; only when the cold tier is the mapping.
    pub cold_mask: Option<T>,
    pub cold_tier: Tier,
    /// Experts in the cold tier (0: the hot tier holds the whole layer).
    pub n_cold: usize,
    pub cold_threads: i32,
    pub count_only: bool,
    /// Batches of at least this many tokens run the cold tier's mul_mat_id pass with one expert
    /// per column.
    pub flat_from: i64,
    pub n_used: usize,
    /// Expected share of selections in the cold tier before the tally has enough of its own.
    pub(crate) cold_share_prior: f64,
    pub staging: Option<Staging>,
    pub pcie_frac: f64,
    pub tally: Arc<Tally>,
    /// The window tensors ([hot slots | pads | ring], patches/0002) and the ring with this
    /// layer's index in it, when prompt batches may use the prefill ring.
    pub window: Option<Mats<T>>,
    pub ring: Option<(Arc<ring::Ring>, usize)>,
    /// Tensors over the ring's other half (odd passes of a layer in waves), when it may take them.
    pub ring_other: Option<Mats<T>>,
    /// The most passes through the ring, and those the graph being computed has.
    pub(crate) max_passes: usize,
    pub(crate) passes: std::sync::atomic::AtomicUsize,
    /// Decode steps read the cold experts from the page-locked copy on the GPU.
    pub(crate) zero_copy: Option<zero_copy::ZeroCopy>,
    pub(crate) _owned: Owned,
}

// SAFETY: the raw tensor pointers refer to buffers owned by `_owned` or by the model, which
// outlives the registry entry (forget_model drops it first); no pointer is tied to a thread.
unsafe impl Send for LayerTiers {}
// SAFETY: after placement the fields change only through atomics and mutexes; the memory behind
// the tensors changes only in adaptation, which takes decode_scope::Exclusive.
unsafe impl Sync for LayerTiers {}

impl LayerTiers {
    /// The cold row of expert `e`, or None when it is hot (or out of range).
    pub(crate) fn activation(&self) -> Activation {
        match self.activation.load(Ordering::Relaxed) {
            1 => Activation::Gelu,
            2 => Activation::Relu,
            _ => Activation::Silu,
        }
    }

    pub(crate) fn set_activation(&self, a: Activation) {
        self.activation.store(a as u8, Ordering::Relaxed);
    }

    /// The window slots of the zero pads when prompt batches may take the ring.
    pub(crate) fn ring_pads(&self) -> Option<std::ops::Range<i32>> {
        let (ring, i) = self.ring.as_ref()?;
        let first = ring.first_slot(*i)? as i32;
        Some(first - self.n_used as i32..first)
    }

    pub(crate) fn n_expert(&self) -> usize {
        self.cold_rows.len()
    }

    /// Writes zero-copy decode's tables from the record of where each expert is.
    pub(crate) fn write_decode_maps(&self) {
        let Some(z) = self.zero_copy.as_ref() else { return };
        let hot: Vec<i32> = self.hot_slots.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let cold: Vec<i32> = self.cold_rows.iter().map(|r| r.load(Ordering::Relaxed)).collect();
        z.table.write(self.hot.as_ref().map(|h| &h.mats), &z.mats, &hot, &cold);
    }

    pub(crate) fn cold_row(&self, e: i32) -> Option<usize> {
        let row = self.cold_rows.get(usize::try_from(e).ok()?)?.load(Ordering::Relaxed);
        usize::try_from(row).ok()
    }
}
