//! Per-expert tiers for MoE layers. llama.cpp places experts per layer; here each layer's
//! experts are split: a hot tier (the experts a profile ranks highest, copied into device
//! buffers with zero "pad" experts, one per routing position) and a cold tier (the rest, read
//! where llama.cpp mapped them or from a RAM copy). Routing stays in llama.cpp's graph; the MoE
//! hook rewrites each tiered layer so every selected expert is computed once, in its tier, and
//! the two partial results add up to the unsplit layer's result (each side is exactly zero
//! where the other computes).
//!
//! Who may touch a layer's tiers:
//! - Placement (`place`, once per model, before its contexts decode) builds them; `forget_model`
//!   drops them when llama.cpp frees the model, after every context over it is gone.
//! - Graph builds read them (`build_experts`), and the graph's custom ops (kernels, ring fills)
//!   read them and write only the tally's atomics and the ring's state under its lock.
//! - Everything that changes device memory or maps a graph reads (adaptation's swaps), or reads
//!   what a graph wrote (the routing logs), runs inside a decode of the model while its thread
//!   holds the model's gate with every context over it synchronised (crate::decode_scope): the
//!   functions take `decode_scope::Exclusive`, or run in decode_scope's hooks. Contexts of one
//!   model (a draft or MTP context beside the target) decode one at a time.
//! - The worker pool serves one graph at a time (its owner); the ring's copier thread is joined
//!   before the ring's memory goes.
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

pub(crate) use decode::{after_decode, logs_routing};
pub(crate) use place::hot_device;
pub use place::{has_gpu, hot_device_memory, hot_device_use, place};
pub(crate) use registry::{build_experts, extra_nodes, fail, forget_model, take_failure};
pub use registry::{expert_counts, hits, ring_stats, uploads};
pub use tensors::{expert_layers, trunk_layers};
pub(crate) use types::Exclusive;
pub use types::{ColdCopy, ExpertLayer, Lab, PlaceError, Placement, Plan, RingCounters, RingFault, Tally, Tier, OFFLOAD_MIN_BATCH};
