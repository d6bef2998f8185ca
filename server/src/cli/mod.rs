//! The command line: Strata's own flags (one table for parsing, `--help` and warnings) and
//! llama.cpp's parsed parameters as a typed configuration.

pub mod config;
pub mod env;
pub mod flags;
pub mod lab;
pub mod spec;
pub mod upstream;
