use std::ptr::NonNull;

use serde_json::Value;

use crate::error::Result;
use crate::model::Model;
use crate::shim_string::{call, cstring, take};
use crate::sys;

/// A model's chat templates as llama.cpp's `common_chat_templates`.
pub struct ChatTemplates {
    ptr: NonNull<sys::strata_chat_templates>,
}

// SAFETY: common_chat_templates is immutable after init; apply() reads it without mutation,
// so it may move between threads.
unsafe impl Send for ChatTemplates {}
// SAFETY: see Send; apply/source take `const common_chat_templates *`.
unsafe impl Sync for ChatTemplates {}

impl ChatTemplates {
    /// The model's own template, or `override_tmpl` (a --chat-template value) when given.
    pub fn new(model: &Model, override_tmpl: Option<&str>) -> Result<Self> {
        let ovr = override_tmpl.map(|t| cstring(t, "chat template")).transpose()?;
        let ovr_ptr = ovr.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        let ptr = call(|err| {
            // SAFETY: model is valid; ovr_ptr is null or a valid C string for the call.
            NonNull::new(unsafe { sys::strata_chat_templates_init(model.as_ptr(), ovr_ptr, err) })
        })?;
        Ok(Self { ptr })
    }

    /// common_chat_templates_apply over OpenAI-shaped inputs (see strata_shim.h for the keys).
    pub fn apply(&self, inputs: &Value) -> Result<Value> {
        let inputs = cstring(&inputs.to_string(), "chat inputs")?;
        let out = call(|err| {
            // SAFETY: valid handle and C string; the result is a malloc'd string we own.
            take(unsafe { sys::strata_chat_templates_apply(self.ptr.as_ptr(), inputs.as_ptr(), err) })
        })?;
        Ok(serde_json::from_str(&out)?)
    }

    /// Whether the template reacts to enable_thinking (llama-server turns thinking on only then).
    pub fn supports_thinking(&self) -> bool {
        // SAFETY: valid handle.
        unsafe { sys::strata_chat_templates_support_thinking(self.ptr.as_ptr()) }
    }

    /// The template's capabilities (llama-server's chat_template_caps): name -> supported.
    pub fn caps(&self) -> Result<Value> {
        let s = call(|err| {
            // SAFETY: valid handle; the result is owned by us.
            take(unsafe { sys::strata_chat_templates_caps(self.ptr.as_ptr(), err) })
        })?;
        Ok(serde_json::from_str(&s)?)
    }

    pub fn source(&self, variant: &str) -> Result<String> {
        let v = cstring(variant, "template variant")?;
        call(|err| {
            // SAFETY: valid handle and C string; the result is owned by us.
            take(unsafe { sys::strata_chat_templates_source(self.ptr.as_ptr(), v.as_ptr(), err) })
        })
    }
}

impl Drop for ChatTemplates {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { sys::strata_chat_templates_free(self.ptr.as_ptr()) }
    }
}

/// common_chat_parse: model output text into an OpenAI-shaped assistant message.
pub fn parse_chat_message(text: &str, is_partial: bool, parser: &Value) -> Result<Value> {
    let text = cstring(text, "generated text")?;
    let parser = cstring(&parser.to_string(), "parser params")?;
    let out = call(|err| {
        // SAFETY: valid C strings for the call; the result is owned by us.
        take(unsafe { sys::strata_chat_parse(text.as_ptr(), is_partial, parser.as_ptr(), err) })
    })?;
    Ok(serde_json::from_str(&out)?)
}

/// OpenAI stream deltas from one state of an assistant message to the next.
pub fn chat_msg_diffs(prev: &Value, new: &Value) -> Result<Vec<Value>> {
    let prev = cstring(&prev.to_string(), "message")?;
    let new = cstring(&new.to_string(), "message")?;
    let out = call(|err| {
        // SAFETY: valid C strings for the call; the result is owned by us.
        take(unsafe { sys::strata_chat_msg_diffs(prev.as_ptr(), new.as_ptr(), err) })
    })?;
    Ok(serde_json::from_str(&out)?)
}

/// llama_build_info(), llama-server's `system_fingerprint`.
pub fn build_info() -> String {
    // SAFETY: returns a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(sys::strata_build_info()) }.to_string_lossy().into_owned()
}

/// llama.cpp's JSON-schema-to-GBNF conversion.
pub fn json_schema_to_grammar(schema: &Value) -> Result<String> {
    let schema = cstring(&schema.to_string(), "json schema")?;
    call(|err| {
        // SAFETY: valid C string; the result is owned by us.
        take(unsafe { sys::strata_json_schema_to_grammar(schema.as_ptr(), err) })
    })
}

/// The messages, tools and tool_choice of a chat request as llama.cpp parses them (see
/// strata_chat_parse_inputs in the shim): its summary, or its exception.
pub fn parse_chat_inputs(inputs: &Value) -> Result<Value> {
    let c = cstring(&inputs.to_string(), "chat inputs")?;
    let s = call(|err| {
        // SAFETY: valid C string; the result is owned by us.
        take(unsafe { sys::strata_chat_parse_inputs(c.as_ptr(), err) })
    })?;
    Ok(serde_json::from_str(&s)?)
}

/// Whether a chat parser definition (as a template's apply gives it) loads.
pub fn check_chat_parser(parser: &str) -> Result<()> {
    let p = cstring(parser, "chat parser")?;
    call(|err| {
        // SAFETY: valid C string for the call.
        unsafe { sys::strata_chat_parser_check(p.as_ptr(), err) }.then_some(())
    })
}

/// llama.cpp's message for a body its JSON parser refuses; None when it parses.
pub fn json_parse_error(data: &[u8]) -> Option<String> {
    // SAFETY: data is valid for its length; the result is owned by us.
    take(unsafe { sys::strata_json_parse_error(data.as_ptr().cast(), data.len()) })
}

/// common's fs_validate_filename: a plain file name without separators or traversal.
pub fn validate_filename(name: &str) -> bool {
    let Ok(c) = cstring(name, "file name") else { return false };
    // SAFETY: valid C string for the call.
    unsafe { sys::strata_validate_filename(c.as_ptr()) }
}
