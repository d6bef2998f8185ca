//! Strata's modules that need no llama.cpp: reading and validating the expert tensors of a GGUF
//! file, the ranked expert profile, the placement policy and its run-time adaptation, the memory
//! guard that decides whether a RAM copy of the experts fits, a direct-I/O read pool for tables
//! kept on SSD, and the calibrated GEMM table's format and guards. Pure Rust, so each part is
//! unit-tested (and the parsers fuzzed) alone.

#![forbid(unsafe_code)]

pub mod adapt;
pub mod direct_io;
pub mod gemm;
pub mod gguf;
pub mod memguard;
pub mod plan;
pub mod ple;
pub mod profile;
