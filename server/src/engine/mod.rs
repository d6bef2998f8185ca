//! The engine thread: the only owner of the llama context. HTTP handlers send it tasks over a
//! bounded channel, each with its own event channel; a readiness watch gates `/health`.
//!
//! Continuous batching as in llama-server: `n_parallel` slots share one context, one sequence
//! each. Every step builds a single batch from the sampled token of each generating slot and
//! prompt chunks of the others, decodes it once, samples per slot, and sends events. A task
//! whose event channel is closed (client gone) is cancelled at the next step.

mod admission;
mod backoff;
mod checkpoint;
mod core;
mod embed;
pub mod generation;
mod handle;
pub mod metrics;
mod prompt_cache;
mod run;
mod sample;
pub mod settings;
mod slot;
mod speculative;
mod start;
mod step;
mod task;

pub use admission::DEFAULT_MAX_QUEUED;
pub use core::EngineConfig;
#[cfg(test)]
pub use embed::normalize_embedding;
pub use handle::{spawn, wait_stopped, EngineHandle, Results};
pub use task::*;
