//! Integration tests against the real pinned llama.cpp, real GGUF files and real HTTP on
//! loopback. Models come from tools/setup (.cache/models); nothing here needs a network or GPU.

mod chat;
mod checkpoints;
mod cli;
mod default_model;
mod engine;
mod experts;
mod fetch;
mod flags;
mod gemm;
mod gemma;
mod hooks;
mod http;
mod init;
mod kv;
mod ple;
mod responses;
mod router;
mod rpc;
mod sampling;
mod seed;
mod soundness;
mod stress;
mod support;
mod tokenizer;
mod ui;
