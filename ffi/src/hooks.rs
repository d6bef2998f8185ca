//! The Rust side of the hook ABI that patches/0001, 0004, 0010, 0011 and 0012 add to llama.cpp (`strata-hooks.h`).
//! Strata modules implement [`Hooks`]; [`install`] hands llama.cpp a table of trampolines
//! (crate::strata_hooks installs Strata's own).

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::sys;

/// Callbacks from inside llama.cpp. They run on whatever thread loads models or builds graphs.
pub trait Hooks: Send + Sync + 'static {
    fn model_loaded(&self, _model: *const sys::llama_model) {}
    fn model_freed(&self, _model: *const sys::llama_model) {}
    /// Builds the weighted sum over the selected experts into `args.graph()`, or returns None
    /// to let llama.cpp build it as usual.
    fn moe_experts(&self, _args: &MoeExperts<'_>) -> Option<NonNull<sys::ggml_tensor>> {
        None
    }
    /// Graph nodes that `moe_experts` may add to one graph of `model` beyond llama.cpp's own.
    fn graph_extra_nodes(&self, _model: *const sys::llama_model) -> u32 {
        0
    }
    /// Whether `ple_rows` supplies the rows of `model`'s PLE table `table`.
    fn ple_serves(&self, _model: *const sys::llama_model, _table: *const sys::ggml_tensor) -> bool {
        false
    }
    /// Writes the rows a ubatch needs; false lets llama.cpp read them from the table.
    fn ple_rows(&self, _args: &mut PleRows<'_>) -> bool {
        false
    }
    /// Before a context over `model` decodes a batch (patches/0010), on the calling thread.
    fn decode_begin(&self, _model: *const sys::llama_model) {}
    /// After each ubatch's graph of such a decode was submitted (it may still run): `n_tokens`
    /// rows, `n_outputs` of them output rows (the only ones the last layer's FFN computes).
    fn ubatch_done(&self, _model: *const sys::llama_model, _sched: sys::ggml_backend_sched_t, _n_tokens: u32, _n_outputs: i32) {}
    /// When the decode returns `ret`: what llama_decode returns instead.
    fn decode_end(&self, _model: *const sys::llama_model, _ctx: *mut sys::llama_context, ret: i32) -> i32 {
        ret
    }
    /// Whether layer `il`'s QSA attention of an `n_tokens` batch gathers each token's selected
    /// cells from the KV cache instead of masking every cell (patches/0011).
    fn qsa_gather(&self, _model: *const sys::llama_model, _il: i32, _n_tokens: u32) -> bool {
        false
    }
    /// Whether layer `il`'s K and V of the KV cache tagged `name_tag` are placed by `kv_alloc`
    /// (patches/0012).
    fn kv_claim(&self, _model: *const sys::llama_model, _il: i32, _name_tag: &std::ffi::CStr) -> bool {
        false
    }
    /// Allocates every tensor of `ctx` (claimed K and V of one buffer type `buft`) in a buffer the
    /// cache then owns; null to leave them to `buft`.
    fn kv_alloc(&self, _model: *const sys::llama_model, _ctx: *mut sys::ggml_context, _buft: sys::ggml_backend_buffer_type_t) -> sys::ggml_backend_buffer_t {
        std::ptr::null_mut()
    }
}

/// One ubatch's PLE rows to supply, valid for the duration of the callback.
pub struct PleRows<'a> {
    raw: &'a sys::strata_ple_rows_args,
}

impl<'a> PleRows<'a> {
    pub fn model(&self) -> *const sys::llama_model {
        self.raw.model
    }
    pub fn table(&self) -> *const sys::ggml_tensor {
        self.raw.table
    }
    pub fn row_bytes(&self) -> usize {
        self.raw.row_bytes
    }
    /// The rows wanted, in order (repeats allowed).
    pub fn rows(&self) -> &'a [i32] {
        if self.raw.rows.is_null() || self.raw.n_rows <= 0 {
            return &[];
        }
        // SAFETY: llama.cpp passes n_rows valid row indices for the duration of the call.
        unsafe { std::slice::from_raw_parts(self.raw.rows, self.raw.n_rows as usize) }
    }
    /// Where the rows go: `rows().len() * row_bytes()` bytes.
    pub fn dst(&mut self) -> &mut [u8] {
        if self.raw.dst.is_null() || self.raw.n_rows <= 0 {
            return &mut [];
        }
        // SAFETY: llama.cpp passes a host buffer of n_rows * row_bytes bytes that nothing else
        // touches during the call; this view is the only one made of it.
        unsafe { std::slice::from_raw_parts_mut(self.raw.dst as *mut u8, self.raw.n_rows as usize * self.raw.row_bytes) }
    }
}

/// One MoE layer's routed-expert inputs, valid for the duration of the callback.
pub struct MoeExperts<'a> {
    raw: &'a sys::strata_moe_experts_args,
}

impl MoeExperts<'_> {
    pub fn layer(&self) -> i32 {
        self.raw.il
    }
    pub fn n_expert(&self) -> i64 {
        self.raw.n_expert
    }
    pub fn n_expert_used(&self) -> i64 {
        self.raw.n_expert_used
    }
    pub fn raw(&self) -> &sys::strata_moe_experts_args {
        self.raw
    }
}

#[derive(Debug, thiserror::Error)]
#[error("llama.cpp rejected the hook table: it speaks hook ABI {library}, Strata speaks {ours}")]
pub struct AbiMismatch {
    pub library: u32,
    pub ours: u32,
}

fn hooks_from(user_data: *mut c_void) -> &'static dyn Hooks {
    // SAFETY: user_data is the leaked Box<Arc<dyn Hooks>> made by `install`, never freed.
    let arc: &'static Arc<dyn Hooks> = unsafe { &*(user_data as *const Arc<dyn Hooks>) };
    arc.as_ref()
}

extern "C" fn model_loaded(user_data: *mut c_void, model: *const sys::llama_model) {
    let _ = catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).model_loaded(model)));
}

extern "C" fn model_freed(user_data: *mut c_void, model: *const sys::llama_model) {
    let _ = catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).model_freed(model)));
}

extern "C" fn moe_experts(user_data: *mut c_void, args: *const sys::strata_moe_experts_args) -> *mut sys::ggml_tensor {
    if args.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: llama.cpp passes a pointer to a live args struct for the duration of the call.
    let args = MoeExperts { raw: unsafe { &*args } };
    catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).moe_experts(&args))).ok().flatten().map_or(std::ptr::null_mut(), NonNull::as_ptr)
}

extern "C" fn graph_extra_nodes(user_data: *mut c_void, model: *const sys::llama_model) -> u32 {
    catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).graph_extra_nodes(model))).unwrap_or(0)
}

extern "C" fn ple_serves(user_data: *mut c_void, model: *const sys::llama_model, table: *const sys::ggml_tensor) -> bool {
    catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).ple_serves(model, table))).unwrap_or(false)
}

extern "C" fn ple_rows(user_data: *mut c_void, args: *const sys::strata_ple_rows_args) -> bool {
    if args.is_null() {
        return false;
    }
    // SAFETY: llama.cpp passes a pointer to a live args struct for the duration of the call.
    let mut args = PleRows { raw: unsafe { &*args } };
    catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).ple_rows(&mut args))).unwrap_or(false)
}

extern "C" fn decode_begin(user_data: *mut c_void, model: *const sys::llama_model) {
    let _ = catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).decode_begin(model)));
}

extern "C" fn ubatch_done(user_data: *mut c_void, model: *const sys::llama_model, sched: sys::ggml_backend_sched_t, n_tokens: u32, n_outputs: i32) {
    let _ = catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).ubatch_done(model, sched, n_tokens, n_outputs)));
}

extern "C" fn decode_end(user_data: *mut c_void, model: *const sys::llama_model, ctx: *mut sys::llama_context, ret: i32) -> i32 {
    // A hook that panicked fails the batch (llama_decode's compute error).
    catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).decode_end(model, ctx, ret))).unwrap_or(-3)
}

extern "C" fn qsa_gather(user_data: *mut c_void, model: *const sys::llama_model, il: i32, n_tokens: u32) -> bool {
    catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).qsa_gather(model, il, n_tokens))).unwrap_or(false)
}

extern "C" fn kv_claim(user_data: *mut c_void, model: *const sys::llama_model, il: i32, name_tag: *const std::ffi::c_char) -> bool {
    if name_tag.is_null() {
        return false;
    }
    // SAFETY: llama.cpp passes a NUL-terminated tag that lives for the call.
    let tag = unsafe { std::ffi::CStr::from_ptr(name_tag) };
    catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).kv_claim(model, il, tag))).unwrap_or(false)
}

extern "C" fn kv_alloc(
    user_data: *mut c_void,
    model: *const sys::llama_model,
    ctx: *mut sys::ggml_context,
    buft: sys::ggml_backend_buffer_type_t,
) -> sys::ggml_backend_buffer_t {
    catch_unwind(AssertUnwindSafe(|| hooks_from(user_data).kv_alloc(model, ctx, buft))).unwrap_or(std::ptr::null_mut())
}

/// Installs `hooks` process-wide, replacing any earlier set. Call before loading models.
pub fn install(hooks: Arc<dyn Hooks>) -> Result<(), AbiMismatch> {
    // Leaked on purpose: llama.cpp keeps every installed table alive for the process lifetime.
    let user_data = Box::into_raw(Box::new(hooks)) as *mut c_void;
    let table = sys::strata_hooks {
        abi_version: sys::STRATA_HOOKS_ABI_VERSION,
        struct_size: std::mem::size_of::<sys::strata_hooks>() as u32,
        user_data,
        model_loaded: Some(model_loaded),
        model_freed: Some(model_freed),
        moe_experts: Some(moe_experts),
        graph_extra_nodes: Some(graph_extra_nodes),
        ple_serves: Some(ple_serves),
        ple_rows: Some(ple_rows),
        decode_begin: Some(decode_begin),
        decode_end: Some(decode_end),
        ubatch_done: Some(ubatch_done),
        qsa_gather: Some(qsa_gather),
        kv_claim: Some(kv_claim),
        kv_alloc: Some(kv_alloc),
    };
    // SAFETY: the table is copied by llama.cpp; the trampolines and user_data live forever.
    if unsafe { sys::strata_hooks_set(&table) } != 0 {
        // SAFETY: no preconditions.
        let library = unsafe { sys::strata_hooks_abi_version() };
        return Err(AbiMismatch { library, ours: sys::STRATA_HOOKS_ABI_VERSION });
    }
    INSTALLED.store(true, std::sync::atomic::Ordering::Release);
    Ok(())
}

static INSTALLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a hook table is installed.
pub fn installed() -> bool {
    INSTALLED.load(std::sync::atomic::Ordering::Acquire)
}

/// Removes the installed hooks; llama.cpp behaves as upstream again.
pub fn clear() {
    INSTALLED.store(false, std::sync::atomic::Ordering::Release);
    // SAFETY: NULL is the documented way to remove the hooks.
    unsafe { sys::strata_hooks_set(std::ptr::null()) };
}
