//! MoE expert residency, the parts that need no llama.cpp: reading and validating the expert
//! tensors of a GGUF file, the ranked expert profile, the placement policy and its run-time adaptation, and the memory guard
//! that decides whether a RAM copy of the experts fits. Pure Rust, so each part is unit-tested and fuzzed alone.

#![forbid(unsafe_code)]

pub mod adapt;
pub mod direct_io;
pub mod gguf;
pub mod memguard;
pub mod plan;
pub mod profile;
