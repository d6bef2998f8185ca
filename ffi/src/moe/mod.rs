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
mod decode;
mod graph;
mod kernels;
mod layer;
mod place;
mod pool;
mod prefill;
mod registry;
pub mod ring;
mod tensors;
mod types;
mod zero_copy;

pub(crate) use decode::{after_decode, zero_copy_active};
pub use place::{has_gpu, hot_device_memory, place};
pub(crate) use registry::{build_experts, extra_nodes, forget_model};
pub use registry::{expert_counts, hits, ring_stats, uploads};
pub use tensors::{expert_layers, trunk_layers};
pub use types::{ColdCopy, ExpertLayer, Lab, PlaceError, Placement, Plan, RingCounters, Tally, Tier, OFFLOAD_MIN_BATCH};
