//! How the KV cache is read and where it lives: which batches of a QSA layer attend over each
//! token's selected cells, gathered from the cache (patches/0011), instead of a mask over every
//! cell; and the K and V of QSA layers placed in page-locked host memory that the GPU reads in
//! place (patches/0012), so that a long context does not take the card's memory.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::sys;

static QSA_GATHER_MAX: AtomicU32 = AtomicU32::new(0);
static SPARSE_TO_HOST: AtomicBool = AtomicBool::new(false);
static HOST_BYTES: AtomicU64 = AtomicU64::new(0);

/// QSA attention of batches of up to `max_tokens` tokens gathers the selected cells (0: never).
/// Set before the contexts that should build such graphs are made.
pub fn set_qsa_gather(max_tokens: u32) {
    QSA_GATHER_MAX.store(max_tokens, Ordering::Relaxed);
}

pub(crate) fn qsa_gather(n_tokens: u32) -> bool {
    n_tokens <= QSA_GATHER_MAX.load(Ordering::Relaxed)
}

/// Whether layer `il` of `model` attends over only the cells its indexer selects (QSA).
pub fn layer_sparse(model: &crate::Model, il: i32) -> bool {
    sparse(model.as_ptr(), il)
}

fn sparse(model: *const sys::llama_model, il: i32) -> bool {
    // SAFETY: llama.cpp checks the layer range; the hooks pass a live model.
    !model.is_null() && unsafe { sys::strata_model_layer_sparse_attn(model, il) }
}

/// The K and V of sparse-attention layers of the contexts made after this call live in host
/// memory (page-locked and mapped into the device on a GPU; the indexer's keys stay where
/// llama.cpp puts them). Set before making the contexts.
pub fn set_sparse_kv_host(on: bool) {
    SPARSE_TO_HOST.store(on, Ordering::Relaxed);
}

/// Bytes of KV cache placed in host memory by the contexts made so far (live or freed).
pub fn host_bytes() -> u64 {
    HOST_BYTES.load(Ordering::Relaxed)
}

pub(crate) fn claim(model: *const sys::llama_model, il: i32, name_tag: &CStr) -> bool {
    SPARSE_TO_HOST.load(Ordering::Relaxed) && name_tag.is_empty() && sparse(model, il)
}

type MappedOwn = unsafe extern "C" fn(i32, sys::ggml_backend_buffer_t) -> sys::ggml_backend_buffer_t;

/// Allocates the tensors of `ctx` as ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft) would,
/// in host memory: on a GPU a page-locked buffer of the device's host type that a mapped buffer
/// of the device's own type owns (patches/0005's mapped buffers), so the device's kernels read
/// and write it in place; on the CPU a buffer of `buft` itself. Null where any step fails.
pub(crate) fn alloc(ctx: *mut sys::ggml_context, buft: sys::ggml_backend_buffer_type_t) -> sys::ggml_backend_buffer_t {
    // SAFETY: ctx holds the cache's unallocated tensors and buft is a live buffer type; every
    // tensor is placed inside the buffer that is returned, or the buffer is freed.
    unsafe {
        let align = sys::ggml_backend_buft_get_alignment(buft).max(1);
        let mut total = 0usize;
        let mut placed: Vec<(*mut sys::ggml_tensor, usize)> = Vec::new();
        let mut views = Vec::new();
        let mut t = sys::ggml_get_first_tensor(ctx);
        while !t.is_null() {
            if (*t).view_src.is_null() {
                let off = total.next_multiple_of(align);
                placed.push((t, off));
                total = off + sys::ggml_backend_buft_get_alloc_size(buft, t);
            } else {
                views.push(t);
            }
            t = sys::ggml_get_next_tensor(ctx, t);
        }
        if placed.is_empty() {
            return std::ptr::null_mut();
        }
        let dev = sys::ggml_backend_buft_get_device(buft);
        let gpu = !dev.is_null() && sys::ggml_backend_dev_type(dev) != sys::GGML_BACKEND_DEVICE_TYPE_CPU;
        let buf = if gpu {
            let host_buft = sys::ggml_backend_dev_host_buffer_type(dev);
            let Some(own) = crate::backend::proc_address(dev, c"ggml_backend_cuda_mapped_buffer_own") else {
                return std::ptr::null_mut();
            };
            if host_buft.is_null() {
                return std::ptr::null_mut();
            }
            let host = sys::ggml_backend_buft_alloc_buffer(host_buft, total);
            if host.is_null() {
                return std::ptr::null_mut();
            }
            let own = std::mem::transmute::<*mut c_void, MappedOwn>(own);
            let mbuf = own(crate::moe::ring::device_index(dev), host);
            if mbuf.is_null() {
                sys::ggml_backend_buffer_free(host);
                return std::ptr::null_mut();
            }
            mbuf
        } else {
            sys::ggml_backend_buft_alloc_buffer(buft, total)
        };
        if buf.is_null() {
            return std::ptr::null_mut();
        }
        let base = sys::ggml_backend_buffer_get_base(buf) as usize;
        let ok = placed.iter().all(|&(t, off)| sys::ggml_backend_tensor_alloc(buf, t, (base + off) as *mut c_void) == sys::GGML_STATUS_SUCCESS)
            && views.iter().all(|&v| sys::ggml_backend_view_init(v) == sys::GGML_STATUS_SUCCESS);
        if !ok {
            sys::ggml_backend_buffer_free(buf);
            return std::ptr::null_mut();
        }
        HOST_BYTES.fetch_add(total as u64, Ordering::Relaxed);
        buf
    }
}
