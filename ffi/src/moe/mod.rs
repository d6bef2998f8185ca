//! Per-expert tiers for MoE layers. llama.cpp places experts per layer; here each layer's
//! experts are split: a hot tier (the experts a profile ranks highest, copied into device
//! buffers with zero "pad" experts, one per routing position) and a cold tier (the rest, read
//! where llama.cpp mapped them or from a RAM copy). Routing stays in llama.cpp's graph; the MoE
//! hook rewrites each tiered layer so every selected expert is computed once, in its tier, and
//! the two partial results add up to the unsplit layer's result (each side is exactly zero
//! where the other computes).
//!
//! Decode batches, and prompt batches (>= [`OFFLOAD_MIN_BATCH`] tokens) expected to select few
//! cold experts, compute the cold ones with CPU kernels (kernels.rs). Other prompt batches run
//! the cold tier as a mul_mat_id on its host tensors, which ggml's scheduler offloads to the GPU
//! copying only the experts used; hot selections go to the RAM copy's zero pad expert, or with
//! the mapping to a stand-in cold expert masked to zero.

pub mod adapt;
mod graph;
mod kernels;
mod pool;
pub mod ring;
mod zero_copy;

use std::collections::HashMap;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, RwLock};

use crate::hooks::MoeExperts;
use crate::model::Model;
use crate::sys;
use kernels::{ColdMat, CpuTraits};
use strata_residency::plan;

/// Batches of at least this many tokens are offloaded by ggml's scheduler (CUDA's threshold).
pub const OFFLOAD_MIN_BATCH: i64 = 32;

/// Where an expert lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// Device buffers of the hot tier ("vram"; host memory on a machine without a GPU).
    Hot = 0,
    /// The RAM copy of the cold experts.
    Ram = 1,
    /// The experts as llama.cpp loaded them (normally the file mapping).
    Mapped = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Hot, Tier::Ram, Tier::Mapped];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Hot => "vram",
            Tier::Ram => "ram",
            Tier::Mapped => "mmap",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Activation {
    Silu = 0,
    Gelu = 1,
    Relu = 2,
}

/// One MoE layer of a loaded model, as llama.cpp placed it.
#[derive(Clone, Debug)]
pub struct ExpertLayer {
    pub layer: i32,
    pub n_expert: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    /// Bytes of one expert (all its matrices).
    pub expert_bytes: usize,
    /// Whether the expert data can be read from the host (mapped or in RAM), which tiering needs.
    pub host: bool,
    /// The buffer llama.cpp put the experts in ("CPU_Mapped", "CPU", "CUDA0", ...).
    pub buffer: String,
}

/// Where the cold experts are read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColdCopy {
    /// Where llama.cpp put them (the file mapping with mmap).
    Mapped,
    /// A pageable RAM copy.
    Ram,
    /// A page-locked RAM copy (the GPU backend's host buffer type).
    PinnedRam,
}

/// What to place: hot experts per layer (by layer index) and where the cold ones are read.
#[derive(Clone, Debug)]
pub struct Plan {
    pub hot: Vec<(i32, Vec<u32>)>,
    pub cold: ColdCopy,
    /// Workers of the dedicated pool that computes cold experts in decode, overlapping the GPU
    /// (<= 0: no pool; the CPU backend's own threads compute them between the GPU's work).
    pub cold_threads: i32,
    /// Only count selections (profile recording); llama.cpp computes every layer as usual.
    pub count_only: bool,
    /// Per layer, the cold expert that prompt batches compute (masked out) in place of hot ones
    /// when the cold tier is the mapping: best the most-selected cold one, which such a batch
    /// uploads anyway. Layers not listed use their lowest-numbered cold expert.
    pub stand_in: Vec<(i32, u32)>,
    /// Experts routed per token: the hot tier keeps one zero pad expert per routing position.
    pub n_used: usize,
    /// Per layer, the expected share of selections that miss the hot tier (from the profile),
    /// until the layer has counted enough of its own. Layers not listed: cold experts / all.
    pub cold_share: Vec<(i32, f64)>,
    /// Share of each decode step's cold selections uploaded to staging slots instead of computed
    /// on the CPU (0: none).
    pub pcie_frac: f64,
    /// Slots per half of the prefill ring (0: no ring). Layers with more cold experts than a
    /// half keep the prompt path without it.
    pub ring_half: usize,
    /// `--adapt-every`: exchange experts between the hot tier and the RAM copy at run time.
    pub adapt: Option<adapt::AdaptPlan>,
    pub lab: Lab,
}

/// Settings for tests and experiments (`STRATA_LAB`, docs/lab.md); the product path is the
/// default of each.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Lab {
    /// Every batch's cold tier as a flat mul_mat_id of one expert per column (`flat-ids`): the
    /// graph a GPU builds from 4 tokens, on the CPU.
    pub flat_ids: bool,
    /// The prefill ring built on the CPU (`emulate-ring`).
    pub emulate_ring: bool,
    /// Zero-copy decode on a machine without a GPU (`zero-copy`): the CPU's mul_mat_id reads the
    /// RAM copy through the same tables of pointers a GPU's kernels read.
    pub zero_copy_on_cpu: bool,
    /// Where the ring writes its per-layer timeline (`ring-trace=FILE`).
    pub ring_trace: Option<std::path::PathBuf>,
    /// The most passes through the ring a layer's prompt batch may take (`ring-waves=N`; None:
    /// ring::DEFAULT_PASSES).
    pub ring_waves: Option<usize>,
    /// The ring's copier issues at most this many bytes before it waits for them
    /// (`ring-pace-kib=N`; Some(0): a job's copies at once; None: ring::DEVICE_PACE on a device,
    /// none in the emulation).
    pub ring_copy_pace: Option<usize>,
    /// The least chance of use for which the ring prefetches a cold expert
    /// (`ring-prefetch-min-p=P`; None: ring::PREFETCH_MIN_P).
    pub ring_prefetch_min_p: Option<f64>,
}

/// Experts and bytes per tier after placement.
#[derive(Clone, Debug, Default)]
pub struct Placement {
    pub experts: [u64; 3],
    pub bytes: [u64; 3],
    /// The device that holds the hot tier ("CUDA0", or "CPU" without a GPU).
    pub hot_device: String,
    /// Workers of the cold-expert pool (0: none).
    pub workers: usize,
    /// The prefill ring, when one was built: a line for the start-up log.
    pub ring: Option<String>,
    /// Tiered layers whose decode reads cold experts over the bus (zero-copy), and why the
    /// others do not (empty when all do or none was asked to).
    pub zero_copy_layers: usize,
    pub zero_copy_off: Option<String>,
    /// Tiered layers whose hot tier adapts at run time (`--adapt-every`), and why others do not.
    pub adapt_layers: usize,
    pub adapt_off: Option<String>,
}

/// Selections counted per tier and per expert since the model was attached.
pub struct Tally {
    hits: [AtomicU64; 3],
    per_expert: Vec<AtomicU64>,
    /// Cold experts copied to the staging slots in decode (`--pcie-frac`).
    pub uploads: AtomicU64,
}

impl Tally {
    fn new(n_expert: usize) -> Self {
        Self { hits: Default::default(), per_expert: (0..n_expert).map(|_| AtomicU64::new(0)).collect(), uploads: AtomicU64::new(0) }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Mats<T> {
    pub up: Option<T>,
    pub gate: Option<T>,
    pub down: Option<T>,
    pub gate_up: Option<T>,
}

impl<T: Copy> Mats<T> {
    fn iter(&self) -> impl Iterator<Item = T> {
        [self.up, self.gate, self.down, self.gate_up].into_iter().flatten()
    }
    fn map<U>(&self, mut f: impl FnMut(T) -> Option<U>) -> Option<Mats<U>> {
        let mut one = |t: Option<T>| -> Option<Option<U>> {
            match t {
                Some(t) => f(t).map(Some),
                None => Some(None),
            }
        };
        Some(Mats { up: one(self.up)?, gate: one(self.gate)?, down: one(self.down)?, gate_up: one(self.gate_up)? })
    }
}

type T = *mut sys::ggml_tensor;

/// `--pcie-frac`: device slots that a decode step fills with some of its cold experts (then
/// computed there instead of on the CPU), plus one zero pad per routing position.
pub(crate) struct Staging {
    pub mats: Mats<T>,
    /// Upload slots; the pads follow them.
    pub slots: usize,
}

impl Staging {
    /// Copies cold row `row` of every matrix into staging slot `slot` (a synchronous copy).
    pub(crate) fn fill(&self, slot: usize, cold: &Mats<kernels::ColdMat>, row: usize) {
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
    model: usize,
    pub layer: i32,
    pub n_embd: usize,
    pub n_ff: usize,
    /// The layer's Activation, as the graph builder last saw it.
    activation: AtomicU8,
    pub hot: Option<Hot>,
    /// The cold weight tensors (for graph sources) and how the kernels read them.
    pub cold_tensors: Mats<T>,
    pub cold: Mats<ColdMat>,
    /// expert -> row in the cold tensors, or -1 for a hot expert (changed by adaptation between
    /// batches only).
    cold_rows: Vec<AtomicI32>,
    /// expert -> hot slot, or -1 for a cold expert (adaptation's record; graphs read the maps).
    hot_slots: std::sync::Mutex<Vec<i32>>,
    /// Experts the hot tier holds (its pads follow them).
    n_hot: usize,
    /// The cold tensors are a RAM copy made at placement (not llama.cpp's own tensors).
    ram_copy: bool,
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
    cold_share_prior: f64,
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
    max_passes: usize,
    passes: std::sync::atomic::AtomicUsize,
    /// Decode steps read the cold experts from the page-locked copy on the GPU.
    zero_copy: Option<zero_copy::ZeroCopy>,
    _owned: Owned,
}

// SAFETY: the raw tensor pointers refer to buffers owned by `_owned` or by the model, which
// outlives the registry entry; they are only read after placement.
unsafe impl Send for LayerTiers {}
// SAFETY: see Send; mutation after placement goes through atomics only.
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

    /// Whether a batch of `n_tok` tokens computes its cold selections on the CPU workers (as
    /// decode does) rather than as a second mul_mat_id pass that uploads the used cold experts:
    /// yes while the expected cold (token, expert) pairs are few for the workers.
    pub(crate) fn cold_on_cpu(&self, n_tok: i64) -> bool {
        let expected = n_tok as f64 * self.n_used as f64 * self.cold_share();
        expected <= (COLD_PAIRS_PER_WORKER * self.cold_threads.max(COLD_MIN_WORKERS)) as f64
    }

    /// The share of selections that miss the hot tier: the layer's own once it has counted
    /// enough, the profile's before.
    fn cold_share(&self) -> f64 {
        let (hot, cold) = (self.tally.hits[Tier::Hot as usize].load(Ordering::Relaxed), self.tally.hits[self.cold_tier as usize].load(Ordering::Relaxed));
        if hot + cold >= COLD_SHARE_MIN_COUNT {
            cold as f64 / (hot + cold) as f64
        } else {
            self.cold_share_prior
        }
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
        let passes = if self.ring_other.is_none() || ring.half == 0 {
            1
        } else {
            let worst = self.cold_used_at_most(n_tok).div_ceil(ring.half).max(1);
            if worst <= self.max_passes {
                worst
            } else {
                ((distinct * PASS_MARGIN / ring.half as f64).ceil() as usize).clamp(1, self.max_passes)
            }
        };
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

/// Passes through the ring planned for this many times the expected distinct cold experts.
const PASS_MARGIN: f64 = 1.25;
/// Selections a layer counts before its own cold share replaces the profile's.
const COLD_SHARE_MIN_COUNT: u64 = 4096;
/// Cold (token, expert) pairs per CPU worker up to which a prompt batch keeps them on the CPU.
/// A pair costs the CPU about one expert's weights read once; a second GPU pass costs a whole
/// batch of mul_mat_id plus the uploads. Not yet calibrated on a GPU.
const COLD_PAIRS_PER_WORKER: i32 = 8;
/// Workers assumed without a pool (the CPU backend's own threads).
const COLD_MIN_WORKERS: i32 = 4;

/// ggml contexts and buffers made for the tiers, freed with the layer.
#[derive(Default)]
struct Owned {
    ctxs: Vec<*mut sys::ggml_context>,
    bufs: Vec<sys::ggml_backend_buffer_t>,
}

impl Drop for Owned {
    fn drop(&mut self) {
        for &b in &self.bufs {
            // SAFETY: allocated by placement, freed once here.
            unsafe { sys::ggml_backend_buffer_free(b) };
        }
        for &c in &self.ctxs {
            // SAFETY: as above.
            unsafe { sys::ggml_free(c) };
        }
    }
}

/// Tiered layers keyed by the address of their down_exps tensor (unique per model and layer).
static REGISTRY: RwLock<Option<HashMap<usize, Arc<LayerTiers>>>> = RwLock::new(None);

/// Drops the tiers of a model being freed.
pub(crate) fn forget_model(model: *const sys::llama_model) {
    adapt::forget_model(model as usize);
    if let Ok(mut r) = REGISTRY.write() {
        if let Some(map) = r.as_mut() {
            map.retain(|_, lt| lt.model != model as usize);
        }
    }
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

/// Blocks of a loaded model's trunk, without its NextN (MTP) layers.
pub fn trunk_layers(model: &Model) -> i32 {
    // SAFETY: a Model is a loaded model.
    unsafe { sys::llama_model_n_layer(model.as_ptr()) }
}

/// Blocks of a loaded model: the trunk, then the NextN (MTP) layers, which may have experts too.
fn n_blocks(model: *const sys::llama_model) -> i32 {
    // SAFETY: the caller passes a loaded model.
    unsafe { sys::llama_model_n_layer(model) + sys::llama_model_n_layer_nextn(model) }.max(0)
}

/// The routed-expert tensors of block `il` of a loaded model, or None without experts.
fn expert_tensors(model: *const sys::llama_model, il: i32) -> Option<Mats<T>> {
    let mut out = sys::strata_expert_tensors { up_exps: null_mut(), gate_exps: null_mut(), down_exps: null_mut(), gate_up_exps: null_mut() };
    // SAFETY: the caller passes a loaded model; out is a valid pointer.
    if !unsafe { sys::strata_model_expert_tensors(model, il, &mut out) } || out.down_exps.is_null() {
        return None;
    }
    let nn = |t: T| (!t.is_null()).then_some(t);
    Some(Mats { up: nn(out.up_exps), gate: nn(out.gate_exps), down: nn(out.down_exps), gate_up: nn(out.gate_up_exps) })
}

fn buffer_name(t: T) -> String {
    // SAFETY: t is a live model tensor; a tensor without a buffer has none to name.
    unsafe {
        let b = (*t).buffer;
        if b.is_null() {
            return String::new();
        }
        std::ffi::CStr::from_ptr(sys::ggml_backend_buffer_name(b)).to_string_lossy().into_owned()
    }
}

/// The model's MoE layers (those with routed-expert tensors), in layer order.
pub fn expert_layers(model: &Model) -> Vec<ExpertLayer> {
    let mut out = Vec::new();
    for il in 0..n_blocks(model.as_ptr()) {
        let Some(m) = expert_tensors(model.as_ptr(), il) else { continue };
        let Some(down) = m.down else { continue };
        // SAFETY: live model tensors.
        let (d, bytes, host) = unsafe {
            let d = &*down;
            let bytes: usize = m.iter().map(|t| (*t).nb[2]).sum();
            let host = m.iter().all(|t| !(*t).buffer.is_null() && sys::ggml_backend_buffer_is_host((*t).buffer));
            (d, bytes, host)
        };
        out.push(ExpertLayer {
            layer: il,
            n_expert: d.ne[2] as usize,
            n_embd: d.ne[1] as usize,
            n_ff: d.ne[0] as usize,
            expert_bytes: bytes,
            host,
            buffer: buffer_name(down),
        });
    }
    out
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
static ZERO_COPY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(crate) fn zero_copy_active() -> bool {
    ZERO_COPY.load(Ordering::Relaxed)
}

/// Cold experts uploaded to staging slots (`--pcie-frac`) over every tiered layer.
pub fn uploads() -> u64 {
    REGISTRY.read().map_or(0, |r| r.as_ref().into_iter().flat_map(HashMap::values).map(|lt| lt.tally.uploads.load(Ordering::Relaxed)).sum())
}

/// Counters of the prefill ring, summed over the rings of every model (None: no ring).
#[derive(Clone, Copy, Debug, Default)]
pub struct RingCounters {
    pub h2d_bytes: u64,
    pub h2d_bytes_last_batch: u64,
    pub hits: u64,
    pub fills: u64,
    pub stalls: u64,
    pub batches: u64,
    pub waves: u64,
}

/// Every prefill ring built, for /metrics (dropped with the last layer that uses it).
static RINGS: std::sync::Mutex<Vec<std::sync::Weak<ring::Ring>>> = std::sync::Mutex::new(Vec::new());

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

#[derive(Debug, thiserror::Error)]
pub enum PlaceError {
    #[error("Strata's hooks are not installed in llama.cpp (install_hooks before loading the model)")]
    NoHooks,
    #[error("layer {0} has no routed-expert tensors")]
    NoLayer(i32),
    #[error("layer {layer}: expert {expert} out of range (the layer has {n_expert})")]
    ExpertRange { layer: i32, expert: u32, n_expert: usize },
    #[error("layer {layer}: the experts are in buffer {buffer}, which the host cannot read; load them on the CPU (strata-server adds --cpu-moe)")]
    NotHost { layer: i32, buffer: String },
    #[error("the CPU backend has no kernels for weight type {0}")]
    NoCpuKernels(String),
    #[error("layer {0}: unsupported MoE activation for expert tiers")]
    Activation(i32),
    #[error("allocating {what} ({bytes} bytes) on {device} failed")]
    Alloc { what: String, bytes: u64, device: String },
}

/// The device for the hot tier: the `main_gpu`-th GPU, or the CPU when there is none.
fn hot_device(main_gpu: usize) -> sys::ggml_backend_dev_t {
    let mut gpus = Vec::new();
    // SAFETY: enumerating registered devices has no preconditions.
    unsafe {
        for i in 0..sys::ggml_backend_dev_count() {
            let d = sys::ggml_backend_dev_get(i);
            if sys::ggml_backend_dev_type(d) == sys::GGML_BACKEND_DEVICE_TYPE_GPU {
                gpus.push(d);
            }
        }
        gpus.get(main_gpu).or(gpus.first()).copied().unwrap_or_else(|| sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU))
    }
}

/// (free, total) bytes of the device that would hold the hot tier.
pub fn hot_device_memory(main_gpu: usize) -> (u64, u64, String) {
    let d = hot_device(main_gpu);
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid device and out pointers.
    let name = unsafe {
        sys::ggml_backend_dev_memory(d, &mut free, &mut total);
        std::ffi::CStr::from_ptr(sys::ggml_backend_dev_name(d)).to_string_lossy().into_owned()
    };
    (free as u64, total as u64, name)
}

/// Whether the hot tier would live in device memory (a GPU is present).
pub fn has_gpu() -> bool {
    // SAFETY: no preconditions.
    unsafe { sys::ggml_backend_dev_type(hot_device(0)) == sys::GGML_BACKEND_DEVICE_TYPE_GPU }
}

fn type_name(ty: sys::ggml_type) -> String {
    // SAFETY: returns a static string for any type.
    unsafe { std::ffi::CStr::from_ptr(sys::ggml_type_name(ty)).to_string_lossy().into_owned() }
}

/// The batch size from which the cold tier's mul_mat_id pass gives one expert per column. Its
/// map repeats an id within a token (the pad row, the stand-in), which the grouped CUDA/HIP
/// kernels do not allow; their vector kernels (always used below 4 tokens for quantized
/// weights) and the CPU do. `flat_ids` flattens every batch (tests of that graph).
fn flat_from(gpu: bool, quantized: bool, flat_ids: bool) -> i64 {
    if flat_ids {
        return 1;
    }
    match (gpu, quantized) {
        (false, _) => i64::MAX,
        (true, true) => 4,
        (true, false) => 1,
    }
}

/// Allocates tensors shaped like `src` with `n_slots` experts, plus an i32 expert map, in one
/// buffer of `buft`.
struct Alloc {
    ctx: *mut sys::ggml_context,
}

impl Alloc {
    fn new(n_tensors: usize) -> Self {
        let params = sys::ggml_init_params {
            // SAFETY: no preconditions.
            mem_size: unsafe { sys::ggml_tensor_overhead() } * (n_tensors + 1),
            mem_buffer: null_mut(),
            no_alloc: true,
        };
        // SAFETY: valid params; no_alloc contexts only hold tensor metadata.
        Self { ctx: unsafe { sys::ggml_init(params) } }
    }

    fn like(&self, src: T, n_slots: usize, name: &str) -> T {
        // SAFETY: src is a live 3-d model tensor; ctx has room for the metadata.
        unsafe {
            let s = &*src;
            let t = sys::ggml_new_tensor_3d(self.ctx, s.type_, s.ne[0], s.ne[1], n_slots as i64);
            set_name(t, name);
            t
        }
    }

    fn map(&self, n_expert: usize, name: &str) -> T {
        // SAFETY: ctx has room for the metadata.
        unsafe {
            let t = sys::ggml_new_tensor_2d(self.ctx, sys::GGML_TYPE_I32, 1, n_expert as i64);
            set_name(t, name);
            t
        }
    }

    /// One u64 per expert id (patches/0007's table of expert pointers), as i32 pairs.
    fn table(&self, n_expert: usize, name: &str) -> T {
        // SAFETY: ctx has room for the metadata.
        unsafe {
            let t = sys::ggml_new_tensor_2d(self.ctx, sys::GGML_TYPE_I32, 2, n_expert as i64);
            set_name(t, name);
            t
        }
    }

    fn map_per_position(&self, n_expert: usize, n_used: usize, name: &str) -> T {
        // SAFETY: ctx has room for the metadata.
        unsafe {
            let t = sys::ggml_new_tensor_3d(self.ctx, sys::GGML_TYPE_I32, 1, n_expert as i64, n_used as i64);
            set_name(t, name);
            t
        }
    }

    fn mask(&self, n_expert: usize, name: &str) -> T {
        // SAFETY: ctx has room for the metadata.
        unsafe {
            let t = sys::ggml_new_tensor_2d(self.ctx, sys::GGML_TYPE_F32, 1, n_expert as i64);
            set_name(t, name);
            t
        }
    }

    fn commit(self, buft: sys::ggml_backend_buffer_type_t, owned: &mut Owned, what: &str) -> Result<(), PlaceError> {
        owned.ctxs.push(self.ctx);
        // SAFETY: ctx holds only unallocated tensors; buft is a valid buffer type.
        let (buf, bytes, device) = unsafe {
            let bytes = sys::ggml_backend_alloc_ctx_tensors_from_buft_size(self.ctx, buft) as u64;
            let buf = sys::ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, buft);
            let device = std::ffi::CStr::from_ptr(sys::ggml_backend_buft_name(buft)).to_string_lossy().into_owned();
            (buf, bytes, device)
        };
        if buf.is_null() {
            return Err(PlaceError::Alloc { what: what.into(), bytes, device });
        }
        // SAFETY: valid buffer; weights usage makes the scheduler treat these as weights.
        unsafe { sys::ggml_backend_buffer_set_usage(buf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS) };
        owned.bufs.push(buf);
        Ok(())
    }
}

fn set_name(t: T, name: &str) {
    if let Ok(c) = std::ffi::CString::new(name) {
        // SAFETY: valid tensor; ggml copies the name.
        unsafe { sys::ggml_set_name(t, c.as_ptr()) };
    }
}

/// Copies experts `order[i]` of each source matrix into slot i of its destination (same shape
/// but the expert count), one transfer per run of consecutive experts.
fn copy_experts(src: &Mats<T>, dst: &Mats<T>, order: &[usize]) {
    let mut i = 0;
    while i < order.len() {
        let mut n = 1;
        while i + n < order.len() && order[i + n] == order[i] + n {
            n += 1;
        }
        for (s, d) in src.iter().zip(dst.iter()) {
            // SAFETY: s is a host-readable model tensor holding experts order[i]..order[i]+n; d has
            // slots i..i+n and the same per-expert stride.
            unsafe {
                let nb2 = (*s).nb[2];
                debug_assert_eq!(nb2, (*d).nb[2]);
                sys::ggml_backend_tensor_set(d, (*s).data.cast::<u8>().add(order[i] * nb2).cast(), i * nb2, n * nb2);
            }
        }
        i += n;
    }
}

fn zero_expert(dst: T, slot: usize) {
    // SAFETY: dst has > slot experts.
    unsafe {
        let nb2 = (*dst).nb[2];
        sys::ggml_backend_tensor_memset(dst, 0, slot * nb2, nb2);
    }
}

fn set_mask(t: T, mask: &[f32]) {
    // SAFETY: t is an f32 tensor of mask.len() elements.
    unsafe { sys::ggml_backend_tensor_set(t, mask.as_ptr().cast(), 0, std::mem::size_of_val(mask)) };
}

/// The hot tier's map [1, n_expert, n_used]: slice j sends expert e to its slot, or a cold one
/// to pad n_hot + j (so that no slot repeats within a token, as grouped GPU kernels need).
fn hot_map_of(hot_slots: &[i32], n_hot: usize, n_used: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(hot_slots.len() * n_used);
    for j in 0..n_used {
        out.extend(hot_slots.iter().map(|&s| if s >= 0 { s } else { (n_hot + j) as i32 }));
    }
    out
}

/// The RAM copy's map for prompt batches: expert -> its row, or the zero pad row n_cold when hot.
fn copy_map_of(cold_rows: &[i32], n_cold: usize) -> Vec<i32> {
    cold_rows.iter().map(|&r| if r >= 0 { r } else { n_cold as i32 }).collect()
}

fn set_map(t: T, map: &[i32]) {
    // SAFETY: t is an i32 tensor of map.len() elements.
    unsafe { sys::ggml_backend_tensor_set(t, map.as_ptr().cast(), 0, std::mem::size_of_val(map)) };
}

/// A layer's ring tensors: its windows, the hot tensors within them, and (for passes in waves)
/// tensors over the other half of the ring.
type Windows = (Mats<T>, Mats<T>, Option<Mats<T>>);
/// Per matrix: the window, hot and other-half tensors.
type WindowParts = (T, T, Option<T>);

/// Allocates a layer's windows: per matrix, `head_slots` experts of its own (hot experts, then
/// pads) followed by the ring. Returns the window tensors ([head_slots + ring slots]), the hot
/// tensors over their first `head_slots` experts, and with `other` tensors over the ring's other
/// half alone.
fn windows(r: &ring::Ring, src: &Mats<T>, head_slots: usize, half: usize, il: &i32, other: bool, owned: &mut Owned) -> Result<Windows, PlaceError> {
    let a = Alloc::new(12);
    owned.ctxs.push(a.ctx);
    let mut kind = 0usize;
    let mut err = None;
    let pair = |t: T| -> Option<WindowParts> {
        let m = kind;
        kind += 1;
        // SAFETY: t is a live 3-d model tensor.
        let nb2 = unsafe { (*t).nb[2] };
        let head = head_slots * nb2;
        let ring_bytes = r.ring_bytes(m).unwrap_or(half * nb2);
        // A device ring has a spare slot (Ring::new_device) that covers the row padding quantized
        // tensors are allocated with; the slots the window addresses stop before it.
        let ring_slots = if r.emulated { half } else { ring_bytes / nb2 - 1 };
        let Some(mem) = r.window(m, r.next_index(), head, ring_bytes) else {
            err = Some(PlaceError::Alloc {
                what: format!("layer {il} expert window"),
                bytes: (head + ring_bytes) as u64,
                device: "the hot tier's device".into(),
            });
            return None;
        };
        let buf = match mem {
            ring::WindowMem::Device(b) | ring::WindowMem::Host(b) => b,
        };
        owned.bufs.push(buf);
        let win = a.like(t, head_slots + ring_slots, &format!("blk.{il}.exps.window"));
        let hot = a.like(t, head_slots, &format!("blk.{il}.exps.hot"));
        let alloc_err = || PlaceError::Alloc {
            what: format!("layer {il} expert window tensors"),
            bytes: (head + ring_bytes) as u64,
            device: "the hot tier's device".into(),
        };
        // SAFETY: buf holds head + ring_bytes bytes from its base; both tensors start there and fit.
        unsafe {
            sys::ggml_backend_buffer_set_usage(buf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            let base = sys::ggml_backend_buffer_get_base(buf);
            if sys::ggml_backend_tensor_alloc(buf, win, base) != sys::GGML_STATUS_SUCCESS
                || sys::ggml_backend_tensor_alloc(buf, hot, base) != sys::GGML_STATUS_SUCCESS
            {
                err = Some(alloc_err());
                return None;
            }
        }
        // The other half alone: a window with no head of its own.
        let rest = if other {
            let Some(ring::WindowMem::Device(b) | ring::WindowMem::Host(b)) = r.window(m, r.next_index() + 1, 0, ring_bytes) else {
                err = Some(alloc_err());
                return None;
            };
            owned.bufs.push(b);
            let t = a.like(t, ring_slots, &format!("blk.{il}.exps.ring_other"));
            // SAFETY: b holds ring_bytes bytes from its base; the tensor fits.
            unsafe {
                sys::ggml_backend_buffer_set_usage(b, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
                if sys::ggml_backend_tensor_alloc(b, t, sys::ggml_backend_buffer_get_base(b)) != sys::GGML_STATUS_SUCCESS {
                    err = Some(alloc_err());
                    return None;
                }
            }
            Some(t)
        } else {
            None
        };
        Some((win, hot, rest))
    };
    let parts = src.map(pair);
    match (parts, err) {
        (Some(p), None) => {
            let rest = other.then(|| p.map(|(_, _, o)| o)).flatten();
            let part = |f: fn(&WindowParts) -> T| p.map(|x| Some(f(&x))).expect("infallible");
            Ok((part(|x| x.0), part(|x| x.1), rest))
        }
        (_, Some(e)) => Err(e),
        (None, None) => Err(PlaceError::Alloc { what: format!("layer {il} expert window"), bytes: 0, device: "the hot tier's device".into() }),
    }
}

/// Starts the ring's copier, measures the copy and CPU rates that the cost model compares, and
/// returns the start-up log line.
fn start_ring(
    r: &Arc<ring::Ring>,
    entries: &[(usize, Arc<LayerTiers>)],
    dev: sys::ggml_backend_dev_t,
    gpu: bool,
    plan: &Plan,
    expert_bytes: usize,
) -> Result<String, PlaceError> {
    let n_layers = entries.iter().filter(|(_, lt)| lt.ring.is_some()).count();
    let staging_buft = if gpu {
        // SAFETY: valid device; NULL when it has no page-locked host memory.
        let b = unsafe { sys::ggml_backend_dev_host_buffer_type(dev) };
        (!b.is_null()).then_some(b)
    } else {
        // SAFETY: the CPU device exists whenever the CPU backend is loaded.
        Some(unsafe { sys::ggml_backend_dev_buffer_type(sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU)) })
    };
    let pace = match plan.lab.ring_copy_pace {
        Some(0) => None,
        Some(b) => Some(b),
        None => (!r.emulated).then_some(ring::DEVICE_PACE),
    };
    r.start(staging_buft, expert_bytes, pace, plan.lab.ring_prefetch_min_p).map_err(|e| PlaceError::Alloc { what: e, bytes: 0, device: "host".into() })?;
    let copy = r.measure_copy(64);
    let workers = plan.cold_threads.max(COLD_MIN_WORKERS) as f64;
    let ringed = entries.iter().map(|(_, lt)| lt).find(|lt| lt.ring.is_some());
    let cpu = ringed.and_then(|lt| ring::measure_cpu(lt, 16));
    let source = match plan.cold {
        ColdCopy::PinnedRam => "straight from the page-locked RAM copy",
        ColdCopy::Ram => "through a page-locked staging buffer from the RAM copy",
        ColdCopy::Mapped => "through a page-locked staging buffer from the file mapping",
    };
    let what = if r.emulated {
        "emulated on the CPU (STRATA_LAB=emulate-ring)".to_string()
    } else {
        format!("{:.2} GiB on the device", r.bytes as f64 / (1u64 << 30) as f64)
    };
    let mut line =
        format!("prefill ring: {} slots in two halves ({what}), {n_layers} of {} tiered layers windowed, copies {source}", 2 * r.half, entries.len());
    if let (Some(c), Some(p)) = (copy, cpu) {
        let handoff = (2 * ringed.map_or(0, |lt| lt.n_embd) * std::mem::size_of::<f32>()) as f64;
        let model = ring::CostModel { copy_bytes_per_s: c, cpu_pairs_per_s: p * workers, expert_bytes: expert_bytes as f64, handoff_bytes_per_token: handoff };
        *r.cost.lock().unwrap_or_else(|e| e.into_inner()) = Some(model);
        line += &format!(
            "; cost model: copy {:.1} GB/s, CPU {:.0} cold pairs/s ({:.0} per thread x {workers}), {handoff:.0} bytes a token to the CPU and back; a prompt batch takes the ring when copying its expected cold experts is quicker than moving its hidden states to the CPU and computing its cold pairs there",
            c / 1e9,
            p * workers,
            p
        );
    } else {
        line += "; cost model not measured (no cold expert to time): prompt batches always take the ring";
    }
    line += &format!("; prefetch: cold experts used with a chance of at least {}", r.prefetch_min_p());
    line += &match pace {
        Some(b) => format!("; copies paced, {} KiB at a time", b >> 10),
        None => "; copies unpaced".to_string(),
    };
    if r.emulated {
        line += "; emulated, every prompt batch takes it";
    }
    Ok(line)
}

/// Places `plan` on `model`: allocates and fills the hot tier (and the RAM copy), registers the
/// layers with the MoE hook. Layers without an entry in the plan are left to llama.cpp. Call
/// before the first graph that should use the tiers is built, with Strata's hooks installed
/// (crate::install_hooks) before the model was loaded.
pub fn place(model: &Model, plan: &Plan, main_gpu: usize) -> Result<Placement, PlaceError> {
    if !crate::hooks::installed() {
        return Err(PlaceError::NoHooks);
    }
    let layers = expert_layers(model);
    let dev = hot_device(main_gpu);
    // SAFETY: valid device.
    let gpu = unsafe { sys::ggml_backend_dev_type(dev) == sys::GGML_BACKEND_DEVICE_TYPE_GPU };
    let workers = if plan.cold_threads > 0 && !plan.count_only { pool::get(plan.cold_threads as usize).workers() } else { 0 };
    // SAFETY: valid device.
    let (hot_buft, dev_name) =
        unsafe { (sys::ggml_backend_dev_buffer_type(dev), std::ffi::CStr::from_ptr(sys::ggml_backend_dev_name(dev)).to_string_lossy().into_owned()) };
    let cold_buft = match plan.cold {
        ColdCopy::Mapped => None,
        // SAFETY: the CPU device exists whenever the CPU backend is loaded.
        ColdCopy::Ram => Some(unsafe { sys::ggml_backend_dev_buffer_type(sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU)) }),
        ColdCopy::PinnedRam => {
            // SAFETY: valid device; NULL when it has no pinned host memory.
            let b = unsafe { sys::ggml_backend_dev_host_buffer_type(dev) };
            if b.is_null() {
                return Err(PlaceError::Alloc { what: "page-locked RAM copy".into(), bytes: 0, device: dev_name });
            }
            Some(b)
        }
    };
    let mut placement = Placement { hot_device: dev_name.clone(), workers, ..Default::default() };
    let emulate = plan.lab.emulate_ring;
    let trace = plan.lab.ring_trace.as_deref();
    let ring = if plan.ring_half > 0 && !plan.count_only && (gpu || emulate) {
        // One ring per matrix kind, as large as the widest layer's experts of that kind.
        let mut max_nb2: Vec<usize> = Vec::new();
        for (il, _) in &plan.hot {
            if let Some(m) = expert_tensors(model.as_ptr(), *il) {
                // SAFETY: live model tensors.
                let nb2: Vec<usize> = m.iter().map(|t| unsafe { (*t).nb[2] }).collect();
                if max_nb2.is_empty() {
                    max_nb2 = nb2;
                } else if max_nb2.len() == nb2.len() {
                    max_nb2.iter_mut().zip(nb2).for_each(|(a, b)| *a = (*a).max(b));
                }
            }
        }
        let pinned = plan.cold == ColdCopy::PinnedRam;
        if !gpu {
            Some(ring::Ring::new_emulated(plan.ring_half, pinned, trace))
        } else {
            let r = ring::Ring::new_device(dev, plan.ring_half, &max_nb2, pinned, trace);
            if r.is_none() {
                placement.ring = Some(format!("prefill ring: off ({dev_name} has no expert windows: patches/0002 missing, no virtual memory management, or too little memory for {} slots)", 2 * plan.ring_half));
            }
            r
        }
    } else {
        None
    };
    // Decode reads cold experts over the bus wherever the GPU can address them: a page-locked
    // RAM copy. Elsewhere the CPU computes them (on a GPU machine, measured slower than reading
    // them: 111 against 149 t/s on an H100 at 24 GiB).
    let zero_copy_wanted =
        !plan.count_only && plan.cold != ColdCopy::Mapped && (if gpu { plan.cold == ColdCopy::PinnedRam } else { plan.lab.zero_copy_on_cpu });
    if gpu && !plan.count_only && plan.cold != ColdCopy::PinnedRam {
        placement.zero_copy_off = Some("the cold experts are not a page-locked copy (--resident-experts)".into());
    }
    let mut max_expert_bytes = 0usize;
    let mut entries = Vec::new();
    for (il, hot_ids) in &plan.hot {
        let info = layers.iter().find(|l| l.layer == *il).ok_or(PlaceError::NoLayer(*il))?;
        if !info.host && !plan.count_only {
            return Err(PlaceError::NotHost { layer: *il, buffer: info.buffer.clone() });
        }
        let src = expert_tensors(model.as_ptr(), *il).ok_or(PlaceError::NoLayer(*il))?;
        let n_expert = info.n_expert;
        let mut slot_of = vec![-1i32; n_expert];
        for (slot, &e) in hot_ids.iter().enumerate() {
            let cell = slot_of.get_mut(e as usize).ok_or(PlaceError::ExpertRange { layer: *il, expert: e, n_expert })?;
            *cell = slot as i32;
        }
        let hot_list: Vec<usize> = slot_of.iter().enumerate().filter(|(_, s)| **s >= 0).map(|(e, _)| e).collect();
        let n_hot = hot_list.len();
        let cold_list: Vec<usize> = slot_of.iter().enumerate().filter(|(_, s)| **s < 0).map(|(e, _)| e).collect();
        let mut owned = Owned::default();

        // SAFETY: live tensor.
        let quantized = src.down.is_some_and(|t| unsafe { sys::ggml_is_quantized((*t).type_) });
        // The GPU's vector kernels skip ids only for quantized weights.
        let zc_wanted = zero_copy_wanted && (quantized || !gpu);
        // A layer without cold experts still gets a RAM copy (its zero pad) where decode reads
        // through the mapping: its routing log lives there, so counting needs no CPU op in a step.
        let copy = cold_buft.filter(|_| !cold_list.is_empty() || zc_wanted);
        let zc_layer = zc_wanted && copy.is_some();
        // Device side: the hot experts plus a zero pad expert, and the expert -> slot maps.
        let a = Alloc::new(12);
        let n_used = plan.n_used.max(1);
        let n_cold = cold_list.len();
        // With the ring, the hot experts and pads live in windows: [hot | pads | ring] per matrix.
        let windowed = ring.as_ref().filter(|_| n_cold > 0 && (copy.is_some() || info.host));
        // Passes in waves need the backend to skip ids of -1: the CPU's kernels do, a GPU's
        // only for quantized experts (patches/0005).
        let max_passes = if quantized || !gpu { plan.lab.ring_waves.unwrap_or(ring::DEFAULT_PASSES).clamp(1, ring::MAX_PASSES) } else { 1 };
        let (mut window, mut ring_other) = (None, None);
        let hot_mats = match windowed {
            Some(r) => {
                let (w, h, o) = windows(r, &src, n_hot + n_used, plan.ring_half, il, max_passes > 1, &mut owned)?;
                (window, ring_other) = (Some(w), o);
                (n_hot > 0).then_some(h)
            }
            None => (n_hot > 0).then(|| src.map(|t| Some(a.like(t, n_hot + n_used, &format!("blk.{il}.exps.hot")))).expect("infallible")),
        };
        let hot_map = hot_mats.as_ref().map(|_| a.map_per_position(n_expert, n_used, &format!("blk.{il}.exps.hot_map")));
        let mapped_cold = copy.is_none() && !cold_list.is_empty() && !plan.count_only;
        let cold_map = (copy.is_some() || mapped_cold).then(|| a.map(n_expert, &format!("blk.{il}.exps.cold_map")));
        let cold_mask = mapped_cold.then(|| a.mask(n_expert, &format!("blk.{il}.exps.cold_mask")));
        let cold_share_prior = plan.cold_share.iter().find(|(l, _)| l == il).map_or(n_cold as f64 / n_expert as f64, |&(_, c)| c);
        let tables = zc_layer.then(|| src.map(|_| Some(a.table(n_expert, &format!("blk.{il}.exps.table")))).expect("infallible"));
        let staging_mats = (plan.pcie_frac > 0.0 && !cold_list.is_empty() && !plan.count_only)
            .then(|| src.map(|t| Some(a.like(t, 2 * n_used, &format!("blk.{il}.exps.staging")))).expect("infallible"));
        if hot_map.is_some() || cold_map.is_some() || staging_mats.is_some() || (windowed.is_none() && hot_mats.is_some()) {
            a.commit(hot_buft, &mut owned, &format!("layer {il} hot experts"))?;
        } else {
            owned.ctxs.push(a.ctx);
        }
        // Host side: the RAM copy of the cold experts plus a zero pad expert.
        let mut log = None;
        let copy_mats = copy.map(|buft| -> Result<Mats<T>, PlaceError> {
            let a = Alloc::new(6);
            let mats = src.map(|t| Some(a.like(t, n_cold + 1, &format!("blk.{il}.exps.cold")))).expect("infallible");
            log = zc_layer.then(|| zero_copy::log_tensor(&a, n_used, *il));
            a.commit(buft, &mut owned, &format!("layer {il} RAM copy of cold experts"))?;
            Ok(mats)
        });
        let copy_mats = copy_mats.transpose()?;
        let zero_copy = match (copy_mats.as_ref(), log, tables) {
            (Some(m), Some(log), Some(tables)) => match zero_copy::ZeroCopy::new(dev, gpu, m, log, (&src, tables, n_expert), *il, &mut owned) {
                Ok(z) => Some(z),
                Err(e) => {
                    placement.zero_copy_off.get_or_insert(e);
                    None
                }
            },
            _ => None,
        };

        let mut hot_slots = vec![-1i32; n_expert];
        for (slot, &e) in hot_list.iter().enumerate() {
            hot_slots[e] = slot as i32;
        }
        let hot = match (hot_mats, hot_map) {
            (Some(mats), Some(map)) => {
                copy_experts(&src, &mats, &hot_list);
                (0..n_used).for_each(|j| mats.iter().for_each(|d| zero_expert(d, n_hot + j)));
                set_map(map, &hot_map_of(&hot_slots, n_hot, n_used));
                Some(Hot { mats, map })
            }
            _ => None,
        };
        let staging = staging_mats.map(|mats| {
            (n_used..2 * n_used).for_each(|j| mats.iter().for_each(|d| zero_expert(d, j)));
            Staging { mats, slots: n_used }
        });
        let mut cold_rows = vec![-1i32; n_expert];
        let ram_copy = copy_mats.is_some() && cold_map.is_some();
        let (cold_tensors, cold_tier) = match (copy_mats, cold_map) {
            (Some(mats), Some(map)) => {
                for (row, &e) in cold_list.iter().enumerate() {
                    cold_rows[e] = row as i32;
                }
                copy_experts(&src, &mats, &cold_list);
                mats.iter().for_each(|d| zero_expert(d, n_cold));
                set_map(map, &copy_map_of(&cold_rows, n_cold));
                (mats, Tier::Ram)
            }
            (_, map) => {
                for &e in &cold_list {
                    cold_rows[e] = e as i32;
                }
                if let (Some(map), Some(mask)) = (map, cold_mask) {
                    let listed = plan.stand_in.iter().find(|(l, _)| l == il).map(|&(_, e)| e as usize);
                    let stand_in = listed.filter(|&e| cold_rows.get(e).is_some_and(|&r| r >= 0)).unwrap_or(cold_list[0]);
                    let rows: Vec<i32> = cold_rows.iter().map(|&r| if r >= 0 { r } else { stand_in as i32 }).collect();
                    let keep: Vec<f32> = cold_rows.iter().map(|&r| if r >= 0 { 1.0 } else { 0.0 }).collect();
                    set_map(map, &rows);
                    set_mask(mask, &keep);
                }
                (src, if info.buffer.contains("Mapped") { Tier::Mapped } else { Tier::Ram })
            }
        };
        let cold = cold_tensors
            .map(|t| {
                // SAFETY: live tensor in a host buffer.
                let (ty, data, nb1, nb2) = unsafe { ((*t).type_, (*t).data as *const u8, (*t).nb[1], (*t).nb[2]) };
                Some(ColdMat { data, nb1, nb2, traits: CpuTraits::of(ty)? })
            })
            .ok_or_else(|| {
                // SAFETY: live tensor.
                let ty = unsafe { (*src.down.expect("down")).type_ };
                PlaceError::NoCpuKernels(type_name(ty))
            })?;

        placement.experts[Tier::Hot as usize] += n_hot as u64;
        placement.bytes[Tier::Hot as usize] += (n_hot * info.expert_bytes) as u64;
        placement.experts[cold_tier as usize] += cold_list.len() as u64;
        placement.bytes[cold_tier as usize] += (cold_list.len() * info.expert_bytes) as u64;
        let key = src.down.map_or(0, |t| t as usize);
        placement.zero_copy_layers += usize::from(zero_copy.is_some());
        if zero_copy.is_some() {
            ZERO_COPY.store(true, Ordering::Relaxed);
        }
        let tally = Arc::new(Tally::new(n_expert));
        let ring_entry = match (windowed, window.as_ref()) {
            (Some(r), Some(w)) => {
                // SAFETY: live tensors: the cold source (RAM copy or mapping) and the windows.
                let (srcs, dsts) = unsafe {
                    let srcs: Vec<(usize, usize)> = cold_tensors.iter().map(|t| ((*t).data as usize, (*t).nb[2])).collect();
                    let dsts: Vec<usize> = w.iter().map(|t| (*t).data as usize + (n_hot + n_used) * (*t).nb[2]).collect();
                    let others: Vec<usize> = ring_other.iter().flat_map(Mats::iter).map(|t| (*t).data as usize).collect();
                    (srcs, [dsts, others])
                };
                max_expert_bytes = max_expert_bytes.max(info.expert_bytes);
                let idx = r.register(ring::RingLayer::new(n_hot + n_used, srcs, dsts, cold_rows.clone(), hot_slots.clone(), tally.clone(), n_used));
                Some((r.clone(), idx))
            }
            _ => None,
        };
        entries.push((
            key,
            Arc::new(LayerTiers {
                model: model.as_ptr() as usize,
                layer: *il,
                n_embd: info.n_embd,
                n_ff: info.n_ff,
                activation: AtomicU8::new(Activation::Silu as u8),
                hot,
                cold_tensors,
                cold,
                cold_rows: cold_rows.into_iter().map(AtomicI32::new).collect(),
                hot_slots: std::sync::Mutex::new(hot_slots),
                n_hot,
                ram_copy,
                cold_map,
                cold_mask,
                cold_tier,
                n_cold: cold_list.len(),
                cold_threads: plan.cold_threads,
                count_only: plan.count_only,
                flat_from: flat_from(gpu, quantized, plan.lab.flat_ids),
                n_used,
                cold_share_prior,
                staging,
                pcie_frac: plan.pcie_frac,
                tally,
                window,
                ring: ring_entry,
                ring_other,
                max_passes,
                passes: std::sync::atomic::AtomicUsize::new(1),
                zero_copy,
                _owned: owned,
            }),
        ));
        if let Some((_, lt)) = entries.last() {
            lt.write_decode_maps();
        }
    }
    if let Some(a) = plan.adapt.as_ref().filter(|a| a.every > 0 && !plan.count_only) {
        let layers: Vec<Arc<LayerTiers>> = entries.iter().map(|(_, lt)| lt.clone()).collect();
        (placement.adapt_layers, placement.adapt_off) = adapt::start(model.as_ptr() as usize, a, &layers, dev, gpu, plan.cold == ColdCopy::PinnedRam)?;
    }
    if let Some(r) = ring.as_ref().filter(|_| !entries.iter().any(|(_, lt)| lt.ring.is_some())) {
        placement.ring = Some(format!("prefill ring: off (no tiered layer's cold experts fit a half of the {} slots)", 2 * r.half));
    } else if let Some(r) = ring.as_ref() {
        placement.ring = Some(start_ring(r, &entries, dev, gpu, plan, max_expert_bytes)?);
        RINGS.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(r));
    }
    let mut r = REGISTRY.write().expect("registry poisoned");
    let map = r.get_or_insert_with(HashMap::new);
    for (key, lt) in entries {
        map.insert(key, lt);
    }
    Ok(placement)
}
