//! The tiers' shared types: what a plan asks for, what placement reports, the per-layer
//! counters and the matrices of a layer. A leaf: it imports nothing else of `moe`.

use std::ffi::c_void;
use std::sync::atomic::AtomicU64;

use crate::sys;
use strata_residency::adapt::Policy;

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

pub use strata_residency::plan::ColdCopy;

/// What to place: hot experts per layer (by layer index) and where the cold ones are read.
#[derive(Clone, Debug)]
pub struct Plan {
    pub hot: Vec<(i32, Vec<u32>)>,
    pub cold: ColdCopy,
    /// Layers whose cold experts stay where llama.cpp mapped them although `cold` is a RAM copy:
    /// the memory guard admitted only part of the copy.
    pub mapped: Vec<i32>,
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
    pub adapt: Option<AdaptPlan>,
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
    /// `--resident-cpu-experts` keeps a pageable copy on a GPU, so that decode computes cold
    /// experts on the CPU (`pageable-copy`; the product path page-locks it where the guard allows).
    pub pageable_copy: bool,
    /// A fault the ring's copier injects into itself (`ring-fault=copy:N|die:N|no-thread`).
    pub ring_fault: Option<RingFault>,
    /// QSA layers attend over each token's gathered cells in batches of up to this many tokens
    /// (`qsa-gather=N`; 0: the masked attention over every cell).
    pub qsa_gather: u32,
}

/// Faults the prefill ring's copier injects into itself for tests (`STRATA_LAB=ring-fault=...`),
/// counting the copy jobs of prompt batches from 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingFault {
    /// The n-th job's copies fail (`copy:N`).
    Copy(u64),
    /// The copier thread panics on taking the n-th job (`die:N`).
    Die(u64),
    /// The copier thread cannot be started (`no-thread`).
    NoThread,
}

/// Proof that the calling thread holds a model's decode gate (crate::decode_scope) and that no
/// graph of any context over the model is in flight: what adaptation's swaps need.
pub(crate) struct Exclusive<'a> {
    pub(crate) model: usize,
    _held: std::marker::PhantomData<&'a ()>,
}

impl Exclusive<'_> {
    /// # Safety
    /// The caller holds `model`'s decode gate, every context over the model has synchronised,
    /// and the proof does not outlive the gate.
    pub(crate) unsafe fn new(model: usize) -> Self {
        Self { model, _held: std::marker::PhantomData }
    }
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
    pub(crate) hits: [AtomicU64; 3],
    pub(crate) per_expert: Vec<AtomicU64>,
    /// Cold experts copied to the staging slots in decode (`--pcie-frac`).
    pub uploads: AtomicU64,
}

impl Tally {
    pub(crate) fn new(n_expert: usize) -> Self {
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
    pub(crate) fn iter(&self) -> impl Iterator<Item = T> {
        [self.up, self.gate, self.down, self.gate_up].into_iter().flatten()
    }
    pub(crate) fn map<U>(&self, mut f: impl FnMut(T) -> Option<U>) -> Option<Mats<U>> {
        let mut one = |t: Option<T>| -> Option<Option<U>> {
            match t {
                Some(t) => f(t).map(Some),
                None => Some(None),
            }
        };
        Some(Mats { up: one(self.up)?, gate: one(self.gate)?, down: one(self.down)?, gate_up: one(self.gate_up)? })
    }
}

pub(crate) type T = *mut sys::ggml_tensor;

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
    #[error("the model's experts are placed already (graphs of its contexts point at those tiers)")]
    Placed,
}

/// What `--adapt-every` asks for.
#[derive(Clone, Debug)]
pub struct AdaptPlan {
    /// Batches per interval (0: off).
    pub every: u64,
    pub policy: Policy,
    /// The profile's selections per expert, by layer (the policy's prior); empty: an even prior.
    pub prior: Vec<(i32, Vec<u64>)>,
}

/// One weight matrix of a cold expert, as the kernels read it.
#[derive(Clone, Copy)]
pub(crate) struct ColdMat {
    pub data: *const u8,
    pub nb1: usize,
    pub nb2: usize,
    pub traits: CpuTraits,
}

/// The CPU backend's routines for one weight type.
#[derive(Clone, Copy)]
pub(crate) struct CpuTraits {
    pub vec_dot: unsafe extern "C" fn(i32, *mut f32, usize, *const c_void, usize, *const c_void, usize, i32),
    pub from_float: Option<unsafe extern "C" fn(*const f32, *mut c_void, i64)>,
    pub vec_dot_type: sys::ggml_type,
}

impl CpuTraits {
    pub(crate) fn of(ty: sys::ggml_type) -> Option<Self> {
        // SAFETY: returns a pointer into a static table of the CPU module, or NULL.
        let t = unsafe { sys::strata_cpu_type_traits(ty as i32).as_ref()? };
        let vec_dot = t.vec_dot?;
        let from_float = if t.vec_dot_type == sys::GGML_TYPE_F32 {
            None
        } else {
            // SAFETY: as above; the input is converted with the dot-product type's routine.
            Some(unsafe { sys::strata_cpu_type_traits(t.vec_dot_type as i32).as_ref()? }.from_float?)
        };
        Some(Self { vec_dot, from_float, vec_dot_type: t.vec_dot_type })
    }

    /// Bytes of one input row of `n` values in this matrix's dot-product type.
    pub(crate) fn row_bytes(&self, n: usize) -> usize {
        // SAFETY: pure size computation for a valid type.
        unsafe { sys::ggml_row_size(self.vec_dot_type, n as i64) }
    }

    /// Converts `x` into the dot-product type in `out` (resized as needed).
    pub(crate) fn quantize(&self, x: &[f32], out: &mut Vec<u8>) {
        let n = self.row_bytes(x.len());
        out.resize(n, 0);
        match self.from_float {
            // SAFETY: out holds exactly one row of x.len() values in vec_dot_type.
            Some(f) => unsafe { f(x.as_ptr(), out.as_mut_ptr().cast(), x.len() as i64) },
            // SAFETY: F32 rows are the floats themselves; out is x.len()*4 bytes.
            None => unsafe { std::ptr::copy_nonoverlapping(x.as_ptr().cast::<u8>(), out.as_mut_ptr(), n) },
        }
    }

    /// Dot product of weight row `w` with the converted input `xq` (`n` values).
    pub(crate) fn dot(&self, n: usize, w: *const u8, xq: &[u8]) -> f32 {
        let mut s = 0.0f32;
        // SAFETY: w points at one row of n values of the weight type; xq is one row in vec_dot_type.
        unsafe { (self.vec_dot)(n as i32, &mut s, 0, w.cast(), 0, xq.as_ptr().cast(), 0, 1) };
        s
    }
}
