use std::ffi::{c_char, CString};
use std::path::Path;
use std::ptr::NonNull;

use crate::context::Context;
use crate::error::{FfiError, Result};
use crate::model::Model;
use crate::sys;

/// A LoRA adapter loaded for one model; applied to a context with a scale per batch.
pub struct LoraAdapter<'m> {
    ptr: NonNull<sys::llama_adapter_lora>,
    _model: std::marker::PhantomData<&'m Model>,
}

impl<'m> LoraAdapter<'m> {
    pub fn load(model: &'m Model, path: &Path) -> Result<Self> {
        let c = CString::new(path.to_string_lossy().as_bytes()).map_err(|_| FfiError::Load(path.display().to_string()))?;
        // SAFETY: valid model and C string; null on failure.
        let raw = unsafe { sys::llama_adapter_lora_init(model.as_ptr(), c.as_ptr()) };
        let ptr = NonNull::new(raw).ok_or_else(|| FfiError::Load(path.display().to_string()))?;
        Ok(Self { ptr, _model: std::marker::PhantomData })
    }

    /// A string metadata value of the adapter's GGUF (empty when absent).
    pub fn meta(&self, key: &str) -> String {
        let Ok(k) = CString::new(key) else { return String::new() };
        let mut buf = vec![0u8; 1024];
        // SAFETY: valid adapter and key; buf has buf.len() bytes for the NUL-terminated value.
        let n = unsafe { sys::llama_adapter_meta_val_str(self.ptr.as_ptr(), k.as_ptr(), buf.as_mut_ptr() as *mut c_char, buf.len()) };
        if n < 0 {
            return String::new();
        }
        buf.truncate((n as usize).min(buf.len() - 1));
        String::from_utf8_lossy(&buf).into_owned()
    }
}

impl LoraAdapter<'_> {
    /// The tokens that invoke an activated LoRA (aLoRA); empty for a plain adapter.
    pub fn alora_invocation_tokens(&self) -> Vec<crate::model::Token> {
        // SAFETY: valid adapter; the array it returns holds the count it reports and lives as
        // long as the adapter.
        unsafe {
            let n = sys::llama_adapter_get_alora_n_invocation_tokens(self.ptr.as_ptr()) as usize;
            let p = sys::llama_adapter_get_alora_invocation_tokens(self.ptr.as_ptr());
            if n == 0 || p.is_null() {
                return Vec::new();
            }
            std::slice::from_raw_parts(p, n).to_vec()
        }
    }
}

impl Drop for LoraAdapter<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the adapter and free it once, while its model is alive ('m).
        unsafe { sys::llama_adapter_lora_free(self.ptr.as_ptr()) }
    }
}

impl Context<'_> {
    /// Sets the adapters applied to the next decodes, with their scales (llama.cpp keeps the
    /// context as it is when nothing changed).
    pub fn set_lora(&mut self, adapters: &[LoraAdapter<'_>], scales: &[f32]) {
        assert_eq!(adapters.len(), scales.len(), "one scale per adapter");
        let mut ptrs: Vec<*mut sys::llama_adapter_lora> = adapters.iter().map(|a| a.ptr.as_ptr()).collect();
        let mut scales = scales.to_vec();
        // SAFETY: valid context; ptrs and scales hold adapters.len() entries for the call, and the
        // adapters belong to this context's model.
        unsafe { sys::llama_set_adapters_lora(self.as_ptr(), ptrs.as_mut_ptr(), ptrs.len(), scales.as_mut_ptr()) };
    }
}
