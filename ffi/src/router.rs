//! What llama-server's router mode needs from `common`: the model list (presets, models dir,
//! Hugging Face cache), downloads, and the child's command channel.

use std::ffi::{c_char, c_int};
use std::os::fd::FromRawFd;

use serde_json::Value;

use crate::error::{FfiError, Result};
use crate::shim_string::{call, cstring, take};
use crate::{sys, ServerParams};

/// The models a router offers, each with the arguments its instance starts with (see
/// `strata_router_models` in the shim). `args` is the router's llama.cpp command line, argv[0]
/// included.
pub fn router_models(args: &[String], models_dir: &str, models_preset: &str) -> Result<Value> {
    let owned: Vec<_> = args.iter().map(|a| cstring(a, "argument")).collect::<Result<_>>()?;
    let mut argv: Vec<*mut c_char> = owned.iter().map(|a| a.as_ptr() as *mut c_char).collect();
    argv.push(std::ptr::null_mut());
    let dir = cstring(models_dir, "models dir")?;
    let preset = cstring(models_preset, "models preset")?;
    let text = call(|err| {
        // SAFETY: argv is a NULL-terminated array of C strings that outlive the call, which
        // copies what it keeps; the result is owned by us.
        take(unsafe { sys::strata_router_models(owned.len() as c_int, argv.as_mut_ptr(), dir.as_ptr(), preset.as_ptr(), err) })
    })?;
    Ok(serde_json::from_str(&text)?)
}

/// Checks that a Hugging Face repo[:quant] can be downloaded (fetches its metadata).
pub fn router_check_repo(repo: &str, hf_token: &str) -> Result<()> {
    let repo = cstring(repo, "repo")?;
    let token = cstring(hf_token, "hf token")?;
    // SAFETY: valid C strings for the duration of the call.
    call(|err| unsafe { sys::strata_router_check_repo(repo.as_ptr(), token.as_ptr(), err) }.then_some(()))
}

/// Downloads (or finds in the cache) the model files `params` names.
pub fn router_download(params: &mut ServerParams) -> Result<()> {
    // SAFETY: valid, exclusively borrowed handle.
    call(|err| unsafe { sys::strata_router_download(params.as_mut_ptr(), err) }.then_some(()))
}

/// Resolves the model files of single-model mode as llama-server does before loading: downloads
/// (-hf, -mu, -hfd) and the speculative type a draft model's file implies.
pub fn resolve_models(params: &mut ServerParams) -> Result<()> {
    // SAFETY: valid, exclusively borrowed handle.
    call(|err| unsafe { sys::strata_params_resolve_models(params.as_mut_ptr(), err) }.then_some(()))
}

/// Removes a cached Hugging Face model; false when there was nothing to remove.
pub fn router_remove_cached(repo: &str) -> bool {
    let Ok(repo) = cstring(repo, "repo") else { return false };
    // SAFETY: valid C string for the duration of the call.
    unsafe { sys::strata_router_remove_cached(repo.as_ptr()) }
}

/// Takes the process's stdout for messages to the router and sends fd 1 to stderr, so that
/// nothing else written there can be mistaken for a message.
pub fn reserve_stdout() -> Result<std::fs::File> {
    // SAFETY: plain dup/dup2 on the standard descriptors.
    let fd = unsafe { sys::strata_reserve_stdout() };
    if fd < 0 {
        return Err(FfiError::Shim(format!("could not reserve stdout: {}", std::io::Error::last_os_error())));
    }
    // SAFETY: fd is a fresh descriptor from dup that nothing else owns.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}
