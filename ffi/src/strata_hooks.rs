//! The hook table Strata installs in llama.cpp: the expert tiers (crate::moe), PLE rows
//! (crate::ple), the scope of every decode (crate::decode_scope) and the KV cache's reads
//! (crate::kv), each a no-op until its module has work for a model.

use std::ptr::NonNull;
use std::sync::{Arc, Once};

use crate::hooks::{self, AbiMismatch, Hooks, MoeExperts, PleRows};
use crate::sys;

/// Strata's own hooks: MoE expert tiers and PLE rows, each a no-op until its module has work.
struct Strata;

impl Hooks for Strata {
    fn model_freed(&self, model: *const sys::llama_model) {
        crate::moe::forget_model(model);
        crate::ple::forget_model(model);
    }

    fn moe_experts(&self, args: &MoeExperts<'_>) -> Option<NonNull<sys::ggml_tensor>> {
        crate::moe::build_experts(args)
    }

    fn graph_extra_nodes(&self, model: *const sys::llama_model) -> u32 {
        crate::moe::extra_nodes(model)
    }

    fn ple_serves(&self, model: *const sys::llama_model, table: *const sys::ggml_tensor) -> bool {
        crate::ple::serves(model, table)
    }

    fn ple_rows(&self, args: &mut PleRows<'_>) -> bool {
        crate::ple::fill(args)
    }

    fn decode_begin(&self, model: *const sys::llama_model) {
        crate::decode_scope::begin(model);
    }

    fn ubatch_done(&self, model: *const sys::llama_model, sched: sys::ggml_backend_sched_t, n_tokens: u32, n_outputs: i32) {
        crate::decode_scope::ubatch_done(model, sched, n_tokens, n_outputs);
    }

    fn decode_end(&self, model: *const sys::llama_model, ctx: *mut sys::llama_context, ret: i32) -> i32 {
        crate::decode_scope::end(model, ctx, ret)
    }

    fn qsa_gather(&self, _model: *const sys::llama_model, _il: i32, n_tokens: u32) -> bool {
        crate::kv::qsa_gather(n_tokens)
    }

    fn kv_claim(&self, model: *const sys::llama_model, il: i32, name_tag: &std::ffi::CStr) -> bool {
        crate::kv::claim(model, il, name_tag)
    }

    fn kv_alloc(&self, _model: *const sys::llama_model, ctx: *mut sys::ggml_context, buft: sys::ggml_backend_buffer_type_t) -> sys::ggml_backend_buffer_t {
        crate::kv::alloc(ctx, buft)
    }
}

static INSTALL: Once = Once::new();

/// Installs Strata's hooks once per process. Call before loading the models and creating the
/// contexts that use expert tiers or PLE rows: contexts size their graphs by them.
pub fn install_hooks() -> Result<(), AbiMismatch> {
    let mut res = Ok(());
    INSTALL.call_once(|| res = hooks::install(Arc::new(Strata)));
    res
}
