//! The only crate that calls llama.cpp. `sys` is the raw bindgen output; everything else is a
//! safe owning wrapper: each handle is a `NonNull`, a null return becomes a typed error, and
//! `Drop` frees it.

pub mod sys {
    #![allow(non_upper_case_globals, non_camel_case_types, non_snake_case, dead_code)]
    #![allow(clippy::all, clippy::undocumented_unsafe_blocks)]
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}

mod backend;
mod batch;
mod chat;
mod context;
mod decode_scope;
mod error;
pub mod gemm;
pub mod hooks;
pub mod kv;
mod lora;
mod model;
pub mod moe;
mod op_profile;
mod params;
pub mod ple;
mod router;
mod sampler;
mod shim_string;
mod speculative;
pub mod step_trace;
mod strata_hooks;

pub use backend::{common_init, flush_c_stdio, init_backend, load_backends, log, log_info, log_mute, set_log_callback, time_ms, LogLevel, Verbosity};
pub use batch::Batch;
pub use chat::{
    build_info, chat_msg_diffs, check_chat_parser, json_parse_error, json_schema_to_grammar, parse_chat_inputs, parse_chat_message, validate_filename,
    ChatTemplates,
};
pub use context::{Context, ContextParams, SeqRm, StateScope};
pub use error::{DecodeError, FfiError, Result};
pub use lora::LoraAdapter;
pub use model::{Model, ModelParams, Token, Vocab};
pub use params::{FitStatus, ParseOutcome, ServerParams};
pub use router::{reserve_stdout, resolve_models, router_check_repo, router_download, router_models, router_remove_cached};
pub use sampler::{logits_argmax, sampling_settings, Sampler};
pub use speculative::Speculative;
pub use strata_hooks::install_hooks;

/// Where the build put libllama and the backend modules (for tools that link the same build).
pub const LLAMA_LIB_DIR: &str = env!("STRATA_LLAMA_LIB_DIR");
/// The patched llama.cpp source tree this crate was built from.
pub const LLAMA_SRC_DIR: &str = env!("STRATA_LLAMA_SRC_DIR");
