//! Every option of the pinned llama-server's `--help`, and what strata-server does with it: one
//! row per help entry, in its order. Tests walk the table against the help text and check each
//! row's evidence; start-up refuses the refused ones by name. docs/llama-server-flags.md is
//! written from it.

use serde_json::Value;

// the evidence and samples are read by the tests that walk the table
#[cfg_attr(not(test), allow(dead_code))]
pub struct U {
    /// The spellings as llama-server's `--help` lists them.
    pub option: &'static str,
    pub class: Class,
    /// Arguments that give the option a value other than its default (none where that needs
    /// the network); `{dir}` is a directory of test files.
    pub sample: &'static [&'static str],
}

#[cfg_attr(not(test), allow(dead_code))]
pub enum Class {
    /// Strata does what llama-server does, shown by: `test:PATH::NAME` (a test), or
    /// `model:FIELD` / `context:FIELD` / `draft_model:FIELD` / `draft_context:FIELD` (the sample
    /// changes that field of the llama.cpp parameters strata-server loads with), or
    /// `sampling:KEY` (the sample changes the requests' default sampling settings), or
    /// `backend:numa` (the sample changes what start-up hands llama_numa_init).
    Honoured(&'static str),
    /// Start-up stops, naming the option, when the parsed parameters' `key` differs from its
    /// default.
    Refused { key: &'static str, why: &'static str },
    /// llama-server does nothing with it either: the pin's line (`PATH:LINE` in the unpatched
    /// pin) that shows it, with that line's text.
    Inert { pin: &'static str, text: &'static str, why: &'static str },
}

mod common;
mod server;

/// The table in `--help`'s order: the common options, then sampling and the server's own.
pub fn table() -> impl Iterator<Item = &'static U> {
    common::ROWS.iter().chain(server::ROWS.iter())
}

/// The options the parsed parameters (`cfg`, in the shim's JSON) set that strata-server
/// refuses, each as a start-up error; `defaults` are llama-server's before any option.
pub fn refusals(cfg: &Value, defaults: &Value) -> Vec<String> {
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for u in table() {
        let Class::Refused { key, why } = u.class else { continue };
        if cfg[key] != defaults[key] && !seen.contains(&key) {
            seen.push(key);
            out.push(format!("{}: {why}", u.option));
        }
    }
    out
}

/// The table as markdown, for docs/llama-server-flags.md.
#[cfg(test)]
fn markdown() -> String {
    let mut s = String::from(
        "# llama-server's options in strata-server\n\nGenerated from `server/src/cli/upstream/`, the table that start-up and the tests read \
         (`STRATA_BLESS=1 cargo test -p strata-server docs_upstream` rewrites it). One row per entry of the pinned \
         llama-server's `--help`. *honoured*: strata-server does what llama-server does, and the evidence shows it \
         (a test, or the llama.cpp parameter or default sampling setting the option reaches); *refused*: start-up \
         stops with an error naming the option; *inert*: llama-server does nothing with it either (the pin's line).\n\n\
         | option | class | evidence |\n|---|---|---|\n",
    );
    for u in table() {
        let (class, evidence) = match u.class {
            Class::Honoured(e) => ("honoured", format!("`{e}`")),
            Class::Refused { why, .. } => ("refused", why.to_string()),
            Class::Inert { pin, why, .. } => ("inert", format!("{why} (`{pin}`)")),
        };
        s.push_str(&format!("| `{}` | {class} | {evidence} |\n", u.option));
    }
    s
}

#[cfg(test)]
mod tests;
