//! The model's expert tensors, and the tensors and buffers the tiers allocate and fill: expert
//! slots, maps, masks.

use std::ptr::null_mut;

use super::types::{ExpertLayer, Mats, PlaceError, T};
use crate::model::Model;
use crate::sys;

/// Allocates tensors shaped like `src` with `n_slots` experts, plus an i32 expert map, in one
/// buffer of `buft`.
pub(crate) struct Alloc {
    pub(crate) ctx: *mut sys::ggml_context,
}

impl Alloc {
    pub(crate) fn new(n_tensors: usize) -> Self {
        let params = sys::ggml_init_params {
            // SAFETY: no preconditions.
            mem_size: unsafe { sys::ggml_tensor_overhead() } * (n_tensors + 1),
            mem_buffer: null_mut(),
            no_alloc: true,
        };
        // SAFETY: valid params; no_alloc contexts only hold tensor metadata.
        Self { ctx: unsafe { sys::ggml_init(params) } }
    }

    pub(crate) fn like(&self, src: T, n_slots: usize, name: &str) -> T {
        // SAFETY: src is a live 3-d model tensor; ctx has room for the metadata.
        unsafe {
            let s = &*src;
            let t = sys::ggml_new_tensor_3d(self.ctx, s.type_, s.ne[0], s.ne[1], n_slots as i64);
            set_name(t, name);
            t
        }
    }

    pub(crate) fn map(&self, n_expert: usize, name: &str) -> T {
        // SAFETY: ctx has room for the metadata.
        unsafe {
            let t = sys::ggml_new_tensor_2d(self.ctx, sys::GGML_TYPE_I32, 1, n_expert as i64);
            set_name(t, name);
            t
        }
    }

    /// One u64 per expert id (patches/0007's table of expert pointers), as i32 pairs.
    pub(crate) fn table(&self, n_expert: usize, name: &str) -> T {
        // SAFETY: ctx has room for the metadata.
        unsafe {
            let t = sys::ggml_new_tensor_2d(self.ctx, sys::GGML_TYPE_I32, 2, n_expert as i64);
            set_name(t, name);
            t
        }
    }

    pub(crate) fn map_per_position(&self, n_expert: usize, n_used: usize, name: &str) -> T {
        // SAFETY: ctx has room for the metadata.
        unsafe {
            let t = sys::ggml_new_tensor_3d(self.ctx, sys::GGML_TYPE_I32, 1, n_expert as i64, n_used as i64);
            set_name(t, name);
            t
        }
    }

    pub(crate) fn mask(&self, n_expert: usize, name: &str) -> T {
        // SAFETY: ctx has room for the metadata.
        unsafe {
            let t = sys::ggml_new_tensor_2d(self.ctx, sys::GGML_TYPE_F32, 1, n_expert as i64);
            set_name(t, name);
            t
        }
    }

    pub(crate) fn commit(self, buft: sys::ggml_backend_buffer_type_t, owned: &mut Owned, what: &str) -> Result<(), PlaceError> {
        owned.ctxs.push(self.ctx);
        // SAFETY: ctx holds only unallocated tensors; buft is a valid buffer type.
        let (buf, bytes, device) = unsafe {
            let bytes = sys::ggml_backend_alloc_ctx_tensors_from_buft_size(self.ctx, buft) as u64;
            let buf = sys::ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, buft);
            let device = std::ffi::CStr::from_ptr(sys::ggml_backend_buft_name(buft)).to_string_lossy().into_owned();
            (buf, bytes, device)
        };
        if buf.is_null() {
            return Err(PlaceError::Alloc { what: what.into(), bytes, device });
        }
        // SAFETY: valid buffer; weights usage makes the scheduler treat these as weights.
        unsafe { sys::ggml_backend_buffer_set_usage(buf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS) };
        owned.bufs.push(buf);
        Ok(())
    }
}

pub(crate) fn set_name(t: T, name: &str) {
    if let Ok(c) = std::ffi::CString::new(name) {
        // SAFETY: valid tensor; ggml copies the name.
        unsafe { sys::ggml_set_name(t, c.as_ptr()) };
    }
}

/// Copies experts `order[i]` of each source matrix into slot i of its destination (same shape
/// but the expert count), one transfer per run of consecutive experts.
pub(crate) fn copy_experts(src: &Mats<T>, dst: &Mats<T>, order: &[usize]) {
    let mut i = 0;
    while i < order.len() {
        let mut n = 1;
        while i + n < order.len() && order[i + n] == order[i] + n {
            n += 1;
        }
        for (s, d) in src.iter().zip(dst.iter()) {
            // SAFETY: s is a host-readable model tensor holding experts order[i]..order[i]+n; d has
            // slots i..i+n and the same per-expert stride.
            unsafe {
                let nb2 = (*s).nb[2];
                debug_assert_eq!(nb2, (*d).nb[2]);
                sys::ggml_backend_tensor_set(d, (*s).data.cast::<u8>().add(order[i] * nb2).cast(), i * nb2, n * nb2);
            }
        }
        i += n;
    }
}

pub(crate) fn zero_expert(dst: T, slot: usize) {
    // SAFETY: dst has > slot experts.
    unsafe {
        let nb2 = (*dst).nb[2];
        sys::ggml_backend_tensor_memset(dst, 0, slot * nb2, nb2);
    }
}

pub(crate) fn set_mask(t: T, mask: &[f32]) {
    // SAFETY: t is an f32 tensor of mask.len() elements.
    unsafe { sys::ggml_backend_tensor_set(t, mask.as_ptr().cast(), 0, std::mem::size_of_val(mask)) };
}

/// The hot tier's map [1, n_expert, n_used]: slice j sends expert e to its slot, or a cold one
/// to pad n_hot + j (so that no slot repeats within a token, as grouped GPU kernels need).
pub(crate) fn hot_map_of(hot_slots: &[i32], n_hot: usize, n_used: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(hot_slots.len() * n_used);
    for j in 0..n_used {
        out.extend(hot_slots.iter().map(|&s| if s >= 0 { s } else { (n_hot + j) as i32 }));
    }
    out
}

/// The RAM copy's map for prompt batches: expert -> its row, or the zero pad row n_cold when hot.
pub(crate) fn copy_map_of(cold_rows: &[i32], n_cold: usize) -> Vec<i32> {
    cold_rows.iter().map(|&r| if r >= 0 { r } else { n_cold as i32 }).collect()
}

pub(crate) fn set_map(t: T, map: &[i32]) {
    // SAFETY: t is an i32 tensor of map.len() elements.
    unsafe { sys::ggml_backend_tensor_set(t, map.as_ptr().cast(), 0, std::mem::size_of_val(map)) };
}

/// Blocks of a loaded model's trunk, without its NextN (MTP) layers.
pub fn trunk_layers(model: &Model) -> i32 {
    // SAFETY: a Model is a loaded model.
    unsafe { sys::llama_model_n_layer(model.as_ptr()) }
}

/// Blocks of a loaded model: the trunk, then the NextN (MTP) layers, which may have experts too.
pub(crate) fn n_blocks(model: *const sys::llama_model) -> i32 {
    // SAFETY: the caller passes a loaded model.
    unsafe { sys::llama_model_n_layer(model) + sys::llama_model_n_layer_nextn(model) }.max(0)
}

/// The routed-expert tensors of block `il` of a loaded model, or None without experts.
pub(crate) fn expert_tensors(model: *const sys::llama_model, il: i32) -> Option<Mats<T>> {
    let mut out = sys::strata_expert_tensors { up_exps: null_mut(), gate_exps: null_mut(), down_exps: null_mut(), gate_up_exps: null_mut() };
    // SAFETY: the caller passes a loaded model; out is a valid pointer.
    if !unsafe { sys::strata_model_expert_tensors(model, il, &mut out) } || out.down_exps.is_null() {
        return None;
    }
    let nn = |t: T| (!t.is_null()).then_some(t);
    Some(Mats { up: nn(out.up_exps), gate: nn(out.gate_exps), down: nn(out.down_exps), gate_up: nn(out.gate_up_exps) })
}

pub(crate) fn buffer_name(t: T) -> String {
    // SAFETY: t is a live model tensor; a tensor without a buffer has none to name.
    unsafe {
        let b = (*t).buffer;
        if b.is_null() {
            return String::new();
        }
        std::ffi::CStr::from_ptr(sys::ggml_backend_buffer_name(b)).to_string_lossy().into_owned()
    }
}

/// The model's MoE layers (those with routed-expert tensors), in layer order.
pub fn expert_layers(model: &Model) -> Vec<ExpertLayer> {
    let mut out = Vec::new();
    for il in 0..n_blocks(model.as_ptr()) {
        let Some(m) = expert_tensors(model.as_ptr(), il) else { continue };
        let Some(down) = m.down else { continue };
        // SAFETY: live model tensors.
        let (d, bytes, host) = unsafe {
            let d = &*down;
            let bytes: usize = m.iter().map(|t| (*t).nb[2]).sum();
            let host = m.iter().all(|t| !(*t).buffer.is_null() && sys::ggml_backend_buffer_is_host((*t).buffer));
            (d, bytes, host)
        };
        out.push(ExpertLayer {
            layer: il,
            n_expert: d.ne[2] as usize,
            n_embd: d.ne[1] as usize,
            n_ff: d.ne[0] as usize,
            expert_bytes: bytes,
            host,
            buffer: buffer_name(down),
        });
    }
    out
}

/// ggml contexts and buffers made for the tiers, freed with the layer.
#[derive(Default)]
pub(crate) struct Owned {
    pub(crate) ctxs: Vec<*mut sys::ggml_context>,
    pub(crate) bufs: Vec<sys::ggml_backend_buffer_t>,
}

impl Drop for Owned {
    fn drop(&mut self) {
        for &b in &self.bufs {
            // SAFETY: allocated by placement, freed once here.
            unsafe { sys::ggml_backend_buffer_free(b) };
        }
        for &c in &self.ctxs {
            // SAFETY: as above.
            unsafe { sys::ggml_free(c) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hot_map_sends_each_cold_expert_to_its_positions_own_pad() {
        // Experts 1 and 3 hot in slots 0 and 1; 2 routing positions, so pads are slots 2 and 3.
        let hot_slots = [-1, 0, -1, 1];
        assert_eq!(hot_map_of(&hot_slots, 2, 2), [2, 0, 2, 1, 3, 0, 3, 1]);
    }

    #[test]
    fn the_copy_map_sends_hot_experts_to_the_zero_pad_row() {
        assert_eq!(copy_map_of(&[0, -1, 1, -1], 2), [0, 2, 1, 2]);
    }
}
