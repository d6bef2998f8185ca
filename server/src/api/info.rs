//! What the server tells about itself: /models, /v1/models, /props, /slots, and the settings
//! the HTTP middleware needs (API keys, CORS).

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use strata_ffi::Model;

use crate::engine::TaskParams;

/// Settings read once from the parsed flags.
#[derive(Debug, Clone, Default)]
pub struct ServerInfo {
    pub model_alias: String,
    pub model_aliases: Vec<String>,
    pub model_tags: Vec<String>,
    pub model_path: String,
    pub n_parallel: usize,
    pub api_keys: Vec<String>,
    pub cors_origins: String,
    pub cors_methods: String,
    pub cors_headers: String,
    pub cors_credentials: bool,
    pub endpoint_slots: bool,
    pub endpoint_props: bool,
    pub endpoint_metrics: bool,
    pub ui: bool,
    /// --path: a directory served instead of the built-in UI.
    pub public_path: String,
    pub sampling: Value,
    pub use_jinja: bool,
    pub chat_template: String,
    pub reasoning_format: String,
    pub enable_reasoning: i64,
    pub slot_save_path: String,
    pub api_prefix: String,
    /// --keep: prompt tokens kept on a context shift.
    pub n_keep: i64,
    /// -r: the stop strings of a task that gives none.
    pub antiprompt: Vec<String>,
    /// --cache-prompt / --no-cache-prompt: a task's cache_prompt when it gives none.
    pub cache_prompt: bool,
    /// --log-prompts-dir: where each completion's prompt is written ("": nowhere).
    pub prompts_log_dir: String,
    pub n_batch: usize,
    pub n_predict: i64,
    /// --sse-ping-interval: seconds a stream may stay silent before a keep-alive comment.
    pub sse_ping_interval: i32,
    /// --embeddings: the embedding routes answer (and --pooling / --embd-normalize for them).
    pub embedding: bool,
    pub pooling_type: i64,
    pub embd_normalize: i32,
    /// --spm-infill: suffix before prefix in infill prompts.
    pub spm_infill: bool,
    /// llama-server adds `__verbose` to OpenAI answers at verbosity above 9.
    pub verbose: bool,
    /// --ui-mcp-proxy: the web UI's CORS proxy is on.
    pub ui_mcp_proxy: bool,
    /// --ui-config: settings handed to the web UI.
    pub ui_settings: Value,
    /// A trailing assistant message is continued (--no-prefill-assistant turns it off).
    pub prefill_assistant: bool,
    pub force_pure_content: bool,
    /// --chat-template-kwargs, each value as JSON text.
    pub default_template_kwargs: serde_json::Map<String, Value>,
    /// --reasoning-budget (-1: none) and the message forced before its end tag.
    pub reasoning_budget: i64,
    pub reasoning_budget_message: String,
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect()).unwrap_or_default()
}

impl ServerInfo {
    pub fn from_params(cfg: &Value, model_alias: String, n_parallel: usize) -> Self {
        let s = |k: &str| cfg[k].as_str().unwrap_or_default().to_string();
        let b = |k: &str| cfg[k].as_bool().unwrap_or(false);
        Self {
            model_alias,
            model_aliases: strings(&cfg["model_alias"]),
            embedding: cfg["embedding"].as_bool().unwrap_or(false),
            pooling_type: cfg["pooling_type"].as_i64().unwrap_or(-1),
            embd_normalize: cfg["embd_normalize"].as_i64().unwrap_or(2) as i32,
            model_tags: strings(&cfg["model_tags"]),
            model_path: s("model"),
            n_parallel,
            api_keys: strings(&cfg["api_keys"]),
            cors_origins: s("cors_origins"),
            cors_methods: s("cors_methods"),
            cors_headers: s("cors_headers"),
            cors_credentials: b("cors_credentials"),
            endpoint_slots: b("endpoint_slots"),
            endpoint_props: b("endpoint_props"),
            endpoint_metrics: b("endpoint_metrics"),
            ui: b("ui"),
            public_path: s("public_path"),
            sampling: cfg["sampling"].clone(),
            use_jinja: b("use_jinja"),
            chat_template: s("chat_template"),
            reasoning_format: s("reasoning_format"),
            enable_reasoning: cfg["enable_reasoning"].as_i64().unwrap_or(-1),
            slot_save_path: s("slot_save_path"),
            api_prefix: s("api_prefix"),
            n_keep: cfg["n_keep"].as_i64().unwrap_or(0),
            antiprompt: strings(&cfg["antiprompt"]),
            cache_prompt: cfg["cache_prompt"].as_bool().unwrap_or(true),
            prompts_log_dir: s("path_prompts_log_dir"),
            n_batch: cfg["n_batch"].as_u64().unwrap_or(2048) as usize,
            n_predict: cfg["n_predict"].as_i64().unwrap_or(-1),
            sse_ping_interval: cfg["sse_ping_interval"].as_i64().unwrap_or(30) as i32,
            spm_infill: b("spm_infill"),
            verbose: cfg["verbosity"].as_i64().unwrap_or(0) > 9,
            ui_mcp_proxy: b("ui_mcp_proxy"),
            prefill_assistant: cfg["prefill_assistant"].as_bool().unwrap_or(true),
            force_pure_content: b("force_pure_content"),
            default_template_kwargs: cfg["default_template_kwargs"].as_object().cloned().unwrap_or_default(),
            reasoning_budget: cfg["reasoning_budget"].as_i64().unwrap_or(-1),
            reasoning_budget_message: s("reasoning_budget_message"),
            ui_settings: cfg["ui_config_json"].as_str().and_then(|s| serde_json::from_str(s).ok()).unwrap_or_else(|| json!({})),
        }
    }

    /// A completion task's parameters before its request sets any: the server's flags.
    pub fn task_defaults(&self) -> TaskParams {
        TaskParams { n_keep: self.n_keep as i32, stop: self.antiprompt.clone(), cache_prompt: self.cache_prompt, ..TaskParams::default() }
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The marker that stands for a media item in a prompt, random per process unless
/// LLAMA_MEDIA_MARKER pins it (llama-server's get_media_marker).
pub fn media_marker() -> &'static str {
    static MARKER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MARKER.get_or_init(|| match crate::cli::env::upstream(crate::cli::env::Upstream::MediaMarker) {
        Some(m) if !m.is_empty() => m,
        _ => format!("<__media_{}__>", crate::api::render::random_string()),
    })
}

pub fn model_info(info: &ServerInfo, model: &Model, n_ctx_slot: usize) -> Value {
    json!({
        "id": info.model_alias,
        "aliases": info.model_aliases,
        "tags": info.model_tags,
        "object": "model",
        // no multimodal projector and no decision heads: text in, text out
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "created": now(),
        "owned_by": "llamacpp",
        "meta": {
            "vocab_type": model.vocab().kind(),
            "n_vocab": model.vocab().n_tokens(),
            "n_ctx": n_ctx_slot,
            "n_ctx_train": model.n_ctx_train(),
            "n_embd": model.n_embd_inp(),
            "n_params": model.n_params(),
            "size": model.size(),
            "ftype": model.ftype_name(),
        },
    })
}

pub fn models(info: &ServerInfo, model: &Model, n_ctx_slot: usize) -> Value {
    json!({
        "models": [{
            "name": info.model_alias,
            "model": info.model_alias,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": "",
                "families": [""],
                "parameter_size": "",
                "quantization_level": "",
            },
        }],
        "object": "list",
        "data": [model_info(info, model, n_ctx_slot)],
    })
}

/// What /props reports of the loaded model and its chat templates.
pub struct ModelProps {
    pub ftype: String,
    pub chat_template: String,
    /// The tool-use variant of the template ("" when the model has none).
    pub chat_template_tool_use: String,
    pub chat_template_caps: Value,
    pub bos: String,
    pub eos: String,
}

/// llama-server's /props; `settings` is a default task's (EngineHandle::default_settings).
/// /props' build_info: the pin's build, then Strata's version and commit.
pub fn build_info() -> String {
    format!("{} strata-server-{}-{}", strata_ffi::build_info(), env!("CARGO_PKG_VERSION"), env!("STRATA_GIT_COMMIT"))
}

pub fn props(info: &ServerInfo, n_ctx_slot: usize, m: &ModelProps, settings: Value, is_sleeping: bool) -> Value {
    let mut v = json!({
        "default_generation_settings": {"params": settings, "n_ctx": n_ctx_slot},
        "total_slots": info.n_parallel,
        "model_alias": info.model_alias,
        "model_ftype": m.ftype,
        "model_path": info.model_path,
        "modalities": {"vision": false, "video": false, "audio": false},
        "media_marker": media_marker(),
        "endpoint_slots": info.endpoint_slots,
        "endpoint_props": info.endpoint_props,
        "endpoint_metrics": info.endpoint_metrics,
        "ui": info.ui,
        "ui_settings": info.ui_settings,
        "chat_template": m.chat_template,
        "chat_template_caps": m.chat_template_caps,
        "bos_token": m.bos,
        "eos_token": m.eos,
        "build_info": build_info(),
        "is_sleeping": is_sleeping,
        "cors_proxy_enabled": info.ui_mcp_proxy,
    });
    if info.use_jinja && !m.chat_template_tool_use.is_empty() {
        v["chat_template_tool_use"] = json!(m.chat_template_tool_use);
    }
    v
}

/// Whether an Origin header names this machine (llama-server's `--cors-origins localhost`).
pub fn origin_is_localhost(origin: &str) -> bool {
    let rest = origin.split_once("://").map_or(origin, |(_, r)| r);
    let host_port = rest.split('/').next().unwrap_or("");
    let host = if let Some(v6) = host_port.strip_prefix('[') { v6.split(']').next().unwrap_or("") } else { host_port.split(':').next().unwrap_or("") };
    matches!(host, "localhost" | "127.0.0.1" | "::1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn localhost_origins() {
        for o in ["http://localhost", "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]", "http://[::1]:3000"] {
            assert!(origin_is_localhost(o), "{o}");
        }
        for o in ["http://example.com", "http://localhost.evil.com", "http://127.0.0.2", "null", ""] {
            assert!(!origin_is_localhost(o), "{o}");
        }
    }

    fn info(args: &[&str]) -> ServerInfo {
        let args: Vec<String> = std::iter::once("strata-server").chain(args.iter().copied()).map(String::from).collect();
        let strata_ffi::ParseOutcome::Parsed(p) = strata_ffi::ServerParams::parse(&args, None).unwrap() else { panic!("flags rejected") };
        ServerInfo::from_params(&p.to_json().unwrap(), String::new(), 1)
    }

    #[test]
    fn reverse_prompts_and_cache_prompt_are_the_task_defaults() {
        let d = info(&[]).task_defaults();
        assert!(d.stop.is_empty() && d.cache_prompt);
        let d = info(&["-r", "User:", "--reverse-prompt", "###", "--no-cache-prompt", "--keep", "3"]).task_defaults();
        assert_eq!((d.stop, d.cache_prompt, d.n_keep), (vec!["User:".to_string(), "###".to_string()], false, 3));
        assert!(info(&["--no-cache-prompt", "--cache-prompt"]).task_defaults().cache_prompt);
    }
}
