use std::ffi::{c_char, c_int, CString};
use std::ptr::NonNull;

use crate::error::{FfiError, Result};
use crate::shim_string;
use crate::sys;

/// llama-server's parsed command line (common_params), owned.
pub struct ServerParams {
    ptr: NonNull<sys::strata_params>,
}

// SAFETY: common_params is plain data owned exclusively by this handle; nothing in llama.cpp
// keeps a pointer to it, so moving it to another thread is sound.
unsafe impl Send for ServerParams {}

/// What --fit did (common_params_fit_status); its log lines say why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FitStatus {
    /// -fit off.
    Off,
    /// The params fit free device memory (possibly unchanged).
    Fitted,
    /// No params were found that fit; loading goes on with the closest.
    NoFit,
    /// The fit could not run (llama.cpp logged why); loading goes on unchanged.
    Error,
}

pub enum ParseOutcome {
    Parsed(ServerParams),
    /// Upstream's message is already on stderr; upstream exits with status 1.
    Rejected,
}

impl ServerParams {
    /// Parses argv (argv[0] included) with llama.cpp's own parser for LLAMA_EXAMPLE_SERVER.
    /// `--help` prints upstream's text, calls `usage`, and exits 0 inside, as upstream does.
    pub fn parse(args: &[String], usage: Option<extern "C" fn(c_int, *mut *mut c_char)>) -> Result<ParseOutcome> {
        let owned: Vec<CString> = args.iter().map(|a| shim_string::cstring(a, "argument")).collect::<Result<_>>()?;
        let mut argv: Vec<*mut c_char> = owned.iter().map(|a| a.as_ptr() as *mut c_char).collect();
        argv.push(std::ptr::null_mut());
        // SAFETY: argv is a NULL-terminated array of valid C strings that outlive the call;
        // common_params_parse does not keep pointers into it.
        let ptr =
            unsafe { sys::strata_params_parse(owned.len() as c_int, argv.as_mut_ptr(), usage.map(|f| f as unsafe extern "C" fn(c_int, *mut *mut c_char))) };
        Ok(match NonNull::new(ptr) {
            Some(ptr) => ParseOutcome::Parsed(Self { ptr }),
            None => ParseOutcome::Rejected,
        })
    }

    pub(crate) fn as_ptr(&self) -> *const sys::strata_params {
        self.ptr.as_ptr()
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut sys::strata_params {
        self.ptr.as_ptr()
    }

    /// llama-server's own post-parse adjustments (-np auto = 4 slots with unified KV, ...).
    pub fn apply_server_defaults(&mut self) -> Result<()> {
        shim_string::call(|err| {
            // SAFETY: valid, exclusively borrowed handle.
            unsafe { sys::strata_params_server_defaults(self.as_mut_ptr(), err) }.then_some(())
        })
    }

    /// The server-relevant fields (see params_json in the shim).
    pub fn to_json(&self) -> Result<serde_json::Value> {
        let s = shim_string::call(|err| {
            // SAFETY: valid handle; the returned string is owned by us.
            shim_string::take(unsafe { sys::strata_params_json(self.as_ptr(), err) })
        })?;
        Ok(serde_json::from_str(&s)?)
    }

    /// The llama.cpp model and context parameters these options make, for the target and for
    /// the draft (`model`, `context`, `draft_model`, `draft_context`).
    pub fn llama_params_json(&mut self) -> Result<serde_json::Value> {
        let s = shim_string::call(|err| {
            // SAFETY: valid, exclusively borrowed handle; the returned string is owned by us.
            shim_string::take(unsafe { sys::strata_params_llama_json(self.as_mut_ptr(), err) })
        })?;
        Ok(serde_json::from_str(&s)?)
    }

    /// llama-server's start-up lines about the build and the log's verbosity; the devices too
    /// where `devices` (a router owns none).
    pub fn print_info(&self, devices: bool) {
        // SAFETY: valid handle; the call only reads it and logs.
        unsafe { sys::strata_params_print_info(self.as_ptr(), devices) }
    }

    /// llama-server's parameters before any option, in [`Self::to_json`]'s shape.
    pub fn defaults_json() -> Result<serde_json::Value> {
        let s = shim_string::call(|err| {
            // SAFETY: no arguments; the returned string is owned by us.
            shim_string::take(unsafe { sys::strata_params_default_json(err) })
        })?;
        Ok(serde_json::from_str(&s)?)
    }

    /// --fit: fits the model and context params to free device memory (before the model loads)
    /// and keeps the result for every context made from these params.
    pub fn fit(&mut self) -> Result<FitStatus> {
        let status = shim_string::call(|err| {
            // SAFETY: valid, exclusively borrowed handle.
            let s = unsafe { sys::strata_params_fit(self.as_mut_ptr(), err) };
            (s != -2).then_some(s)
        })?;
        Ok(match status {
            -1 => FitStatus::Off,
            0 => FitStatus::Fitted,
            1 => FitStatus::NoFit,
            _ => FitStatus::Error,
        })
    }

    /// The loaded model's sampling defaults (general.sampling.*) under the command line's, and
    /// the end-of-generation logit biases (applied with --ignore-eos, and per request).
    pub fn init_sampling(&mut self, model: &crate::Model) -> Result<()> {
        shim_string::call(|err| {
            // SAFETY: valid handle and model for the call; nothing keeps a pointer to the model.
            unsafe { sys::strata_params_init_sampling(self.as_mut_ptr(), model.as_ptr(), err) }.then_some(())
        })
    }

    /// The physical batch size (-ub) of the contexts made from these parameters from now on.
    pub fn set_n_ubatch(&mut self, n: u32) {
        // SAFETY: valid, exclusively borrowed handle.
        unsafe { sys::strata_params_set_n_ubatch(self.as_mut_ptr(), n as i32) }
    }

    pub fn model_params(&mut self) -> Result<crate::ModelParams<'_>> {
        let mut err = std::ptr::null_mut();
        // SAFETY: valid handle; the returned struct may point into common_params (tensor
        // overrides, devices), which lives as long as self.
        let raw = unsafe { sys::strata_params_model(self.as_mut_ptr(), &mut err) };
        match shim_string::take(err) {
            Some(e) => Err(FfiError::Shim(e)),
            None => Ok(crate::ModelParams::from_raw(raw)),
        }
    }

    pub fn context_params(&self) -> Result<crate::ContextParams> {
        let mut err = std::ptr::null_mut();
        // SAFETY: valid handle.
        let raw = unsafe { sys::strata_params_context(self.as_ptr(), &mut err) };
        match shim_string::take(err) {
            Some(e) => Err(FfiError::Shim(e)),
            None => Ok(crate::ContextParams::from_raw(raw)),
        }
    }
}

impl Drop for ServerParams {
    fn drop(&mut self) {
        // SAFETY: we own the handle and free it once.
        unsafe { sys::strata_params_free(self.ptr.as_ptr()) }
    }
}
