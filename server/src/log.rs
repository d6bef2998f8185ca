//! Every log line of strata-server goes through llama.cpp's logger (so --log-file, --log-colors,
//! verbosity and ggml's own lines all apply alike), in llama-server's formats: `srv  <func>:`,
//! `slot <func>: id .. | task .. |`, or a line as given.

use strata_ffi::Verbosity;

/// A server line: `srv  <func>: <msg>`, the function name right-aligned in 12 columns.
pub fn srv(level: Verbosity, func: &str, msg: &str) {
    let func = &func[..func.len().min(12)];
    strata_ffi::log(level, &format!("srv  {func:>12}: {msg}\n"));
}

/// A slot line: `slot <func>: id <slot> | task <task> | <msg>` (task -1 when there is none).
pub fn slot(level: Verbosity, func: &str, slot: usize, task: i64, msg: &str) {
    let func = &func[..func.len().min(12)];
    strata_ffi::log(level, &format!("slot {func:>12}: id {slot:2} | task {task} | {msg}\n"));
}

/// A line as given (router and agent lines, a child's output).
pub fn line(level: Verbosity, msg: &str) {
    strata_ffi::log(level, &format!("{msg}\n"));
}

pub fn info(msg: &str) {
    line(Verbosity::Info, msg);
}

pub fn warn(msg: &str) {
    line(Verbosity::Warn, msg);
}

/// An error already logged in llama-server's lines: start-up ends with status 1, saying no more.
#[derive(Debug, thiserror::Error)]
#[error("start-up failed")]
pub struct Logged;

/// llama-server's line on every exit once the HTTP server is set up.
pub fn cleaning_up() {
    srv(Verbosity::Info, "operator()", "operator(): cleaning up before exit...");
}
