use std::ffi::{c_char, CStr, CString};

use crate::error::{FfiError, Result};
use crate::sys;

/// Takes ownership of a malloc'd string from the shim.
pub(crate) fn take(s: *mut c_char) -> Option<String> {
    if s.is_null() {
        return None;
    }
    // SAFETY: the shim returns NUL-terminated strings from malloc that we now own.
    let out = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
    // SAFETY: `s` came from the shim's malloc and is freed exactly once here.
    unsafe { sys::strata_string_free(s) };
    Some(out)
}

/// Runs a shim call that reports failure through `char ** err`.
pub(crate) fn call<T>(f: impl FnOnce(*mut *mut c_char) -> Option<T>) -> Result<T> {
    let mut err: *mut c_char = std::ptr::null_mut();
    match f(&mut err) {
        Some(v) => Ok(v),
        None => {
            let msg = take(err).unwrap_or_else(|| "unknown error".into());
            // SAFETY: reads a thread-local the failed call just set.
            let kind = unsafe { sys::strata_last_error_kind() } as u32;
            Err(match kind {
                sys::STRATA_ERROR_INVALID_ARGUMENT | sys::STRATA_ERROR_JSON => FfiError::BadInput(msg),
                _ => FfiError::Shim(msg),
            })
        }
    }
}

pub(crate) fn cstring(s: &str, what: &'static str) -> Result<CString> {
    CString::new(s).map_err(|_| FfiError::InteriorNul(what))
}
