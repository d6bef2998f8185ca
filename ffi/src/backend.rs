use std::ffi::{c_char, c_void, CStr};
use std::sync::{Once, OnceLock};

use crate::error::Result;
use crate::params::ServerParams;
use crate::shim_string::call;
use crate::sys;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
    Cont,
}

static BACKEND: OnceLock<Result<(), String>> = OnceLock::new();
static LOADED: Once = Once::new();
static LOG_SINK: OnceLock<fn(LogLevel, &str)> = OnceLock::new();

/// Loads the backend modules (CPU, and CUDA/HIP where built) once per process. Argument
/// parsing does this too; model loading needs it when no arguments were parsed.
pub fn load_backends() {
    // SAFETY: ggml_backend_load_all only reads the filesystem and registers backends; Once
    // keeps it from running concurrently with itself.
    LOADED.call_once(|| unsafe { sys::ggml_backend_load_all() });
}

/// llama_backend_init (+ NUMA from the parsed flags), once per process; a failure is kept and
/// reported to every caller.
pub fn init_backend(params: Option<&ServerParams>) -> Result<()> {
    load_backends();
    let done = BACKEND.get_or_init(|| match params {
        Some(p) => call(|err| {
            // SAFETY: the params handle is valid for the duration of the call.
            unsafe { sys::strata_backend_init(p.as_ptr(), err) }.then_some(())
        })
        .map_err(|e| e.to_string()),
        None => {
            // SAFETY: no preconditions.
            unsafe { sys::llama_backend_init() };
            Ok(())
        }
    });
    done.clone().map_err(crate::FfiError::Shim)
}

extern "C" fn log_trampoline(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    let Some(sink) = LOG_SINK.get() else { return };
    if text.is_null() {
        return;
    }
    // SAFETY: ggml passes a NUL-terminated message valid for this call.
    let msg = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let level = match level {
        sys::GGML_LOG_LEVEL_DEBUG => LogLevel::Debug,
        sys::GGML_LOG_LEVEL_WARN => LogLevel::Warn,
        sys::GGML_LOG_LEVEL_ERROR => LogLevel::Error,
        sys::GGML_LOG_LEVEL_CONT => LogLevel::Cont,
        _ => LogLevel::Info,
    };
    sink(level, &msg);
}

/// Routes llama.cpp's and ggml's logs to `sink` (the first sink set wins). Not used by the
/// server, which keeps llama.cpp's own log format via common_init.
pub fn set_log_callback(sink: fn(LogLevel, &str)) {
    let _ = LOG_SINK.set(sink);
    // SAFETY: the trampoline is a 'static extern "C" fn that tolerates any thread.
    unsafe {
        sys::llama_log_set(Some(log_trampoline), std::ptr::null_mut());
    }
}

/// llama.cpp's common_init(): its logger (format, colours, verbosity) and the build info line.
pub fn common_init() -> Result<()> {
    call(|err| {
        // SAFETY: no preconditions; sets up process-wide logging state.
        unsafe { sys::strata_common_init(err) }.then_some(())
    })
}

/// Flushes C stdio, so that Rust output lands after what llama.cpp printed.
pub fn flush_c_stdio() {
    // SAFETY: fflush(NULL) has no preconditions.
    unsafe { sys::strata_stdio_flush() }
}

/// Writes one INFO line through llama.cpp's logger, so it reads like llama-server's own.
pub fn log_info(line: &str) {
    log(Verbosity::Info, line);
}

/// Verbosity levels of llama.cpp's common logger (common/log.h's LOG_LEVEL_*).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verbosity {
    Error = 1,
    Warn = 2,
    Info = 3,
    Trace = 4,
    Debug = 5,
}

/// Writes one line through llama.cpp's logger at `level` (shown only at that verbosity or more).
pub fn log(level: Verbosity, line: &str) {
    let Ok(c) = std::ffi::CString::new(line) else { return };
    // SAFETY: a valid NUL-terminated string for the duration of the call.
    unsafe { sys::strata_log(level as i32, c.as_ptr()) }
}

/// The address a device's backend gives for `name` (a function a patch adds), None when its
/// build has no such function.
pub(crate) fn proc_address(dev: sys::ggml_backend_dev_t, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dev is a registered device and name is NUL-terminated.
    let p = unsafe { sys::ggml_backend_reg_get_proc_address(sys::ggml_backend_dev_backend_reg(dev), name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// ggml's clock in milliseconds (ggml_time_ms: CLOCK_MONOTONIC on Linux), which llama-server
/// names files by.
pub fn time_ms() -> i64 {
    // SAFETY: no preconditions; it reads the clock.
    unsafe { sys::ggml_time_ms() }
}

/// Drops llama.cpp's log lines that start with `prefix`, for advice that does not apply to
/// how Strata loads the model; every other line is logged as before.
pub fn log_mute(prefix: &str) {
    let Ok(c) = std::ffi::CString::new(prefix) else { return };
    // SAFETY: a valid C string; the shim copies it.
    unsafe { sys::strata_log_mute(c.as_ptr()) }
}
