//! llama.cpp's parsed parameters, typed. The shim writes `common_params` as JSON; this reads the
//! keys strata-server's start-up uses, every one required, so a key renamed or dropped on either
//! side fails at start (and in the test that parses the defaults) instead of taking a default.

use std::path::PathBuf;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct ServerConfig {
    pub model: PathBuf,
    /// --alias: the first names the model in responses.
    pub model_alias: Vec<String>,
    pub hostnames: Vec<String>,
    pub port: i64,
    pub n_predict: i32,
    pub n_parallel: i32,
    pub kv_unified: bool,
    pub n_batch: i32,
    pub sleep_idle_seconds: i64,
    pub ctx_shift: bool,
    pub load_mode: LoadMode,
    pub main_gpu: i32,
    pub cache_ram_mib: i32,
    pub cache_idle_slots: bool,
    pub n_ctx_checkpoints: i32,
    pub checkpoint_min_step: i32,
    pub swa_full: bool,
    pub slot_prompt_similarity: f32,
    pub speculative: SpeculativeConfig,
    pub n_cache_reuse: i32,
    pub lora_adapters: Vec<LoraConfig>,
    /// -sp: generated special tokens are rendered as their text.
    pub special: bool,
    /// -cb / -nocb: prompts join batches that already hold generated tokens.
    pub cont_batching: bool,
    /// --kv-unified-per-slot: most context one slot may use (0: no cap).
    pub kv_unified_per_slot: i32,
    /// --ui-config / --ui-config-file: JSON handed to the web UI ("": none).
    pub ui_config_json: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SpeculativeConfig {
    /// A drafter is configured (a draft model or a --spec-type other than none).
    pub enabled: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct LoraConfig {
    pub path: PathBuf,
    pub scale: f32,
}

/// llama.cpp's `llama_load_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "i64")]
pub enum LoadMode {
    Auto,
    None,
    Mmap,
    Mlock,
    MmapMlock,
    DirectIo,
}

impl TryFrom<i64> for LoadMode {
    type Error = String;

    fn try_from(v: i64) -> Result<Self, String> {
        Ok(match v {
            -1 => Self::Auto,
            0 => Self::None,
            1 => Self::Mmap,
            2 => Self::Mlock,
            3 => Self::MmapMlock,
            4 => Self::DirectIo,
            other => return Err(format!("unknown llama_load_mode {other}")),
        })
    }
}

impl LoadMode {
    /// Whether the model file is mapped (auto maps where the device allows, as llama.cpp does).
    pub fn maps_the_file(self) -> bool {
        matches!(self, Self::Auto | Self::Mmap | Self::MmapMlock)
    }
}

impl ServerConfig {
    pub fn from_json(v: &serde_json::Value) -> Result<Self, String> {
        Self::deserialize(v).map_err(|e| format!("llama.cpp's parsed parameters: {e}"))
    }

    /// The name responses give the model: the first --alias, else the model path.
    pub fn alias(&self) -> String {
        self.model_alias.first().cloned().unwrap_or_else(|| self.model.to_string_lossy().into_owned())
    }

    pub fn sleep_idle(&self) -> Option<std::time::Duration> {
        u64::try_from(self.sleep_idle_seconds).ok().filter(|&s| s > 0).map(std::time::Duration::from_secs)
    }
}

#[cfg(test)]
mod tests {
    use strata_ffi::{ParseOutcome, ServerParams};

    use super::*;

    fn parsed(args: &[&str]) -> ServerConfig {
        let args: Vec<String> = std::iter::once("strata-server").chain(args.iter().copied()).map(String::from).collect();
        let ParseOutcome::Parsed(p) = ServerParams::parse(&args, None).unwrap() else { panic!("flags rejected") };
        ServerConfig::from_json(&p.to_json().unwrap()).unwrap()
    }

    #[test]
    fn the_shims_json_has_every_key_with_its_type() {
        let c = parsed(&[]);
        assert_eq!(c.port, 8080);
        assert_eq!(c.n_predict, -1);
        assert!(c.lora_adapters.is_empty());
        assert!(!c.speculative.enabled);
        assert!(!c.special && c.cont_batching);
        assert_eq!((c.kv_unified_per_slot, c.ui_config_json.as_str()), (0, ""));
        let c = parsed(&["-m", "x.gguf", "--alias", "a,b", "-np", "3", "-b", "64", "--port", "9", "--sleep-idle-seconds", "5", "--load-mode", "none"]);
        assert_eq!(c.alias(), "a");
        assert_eq!((c.n_parallel, c.n_batch, c.port), (3, 64, 9));
        assert_eq!(c.sleep_idle(), Some(std::time::Duration::from_secs(5)));
        assert!(!c.load_mode.maps_the_file(), "{:?}", c.load_mode);
        assert_eq!(parsed(&["-m", "x.gguf"]).alias(), "x.gguf");
        let c = parsed(&["-sp", "-nocb", "--kv-unified-per-slot", "256", "--ui-config", "{x"]);
        assert!(c.special && !c.cont_batching);
        assert_eq!((c.kv_unified_per_slot, c.ui_config_json.as_str()), (256, "{x"));
    }

    #[test]
    fn a_missing_or_mistyped_key_is_an_error_not_a_default() {
        let mut v = ServerParams::parse(&["strata-server".to_string()], None)
            .ok()
            .and_then(|o| if let ParseOutcome::Parsed(p) = o { p.to_json().ok() } else { None })
            .unwrap();
        v.as_object_mut().unwrap().remove("n_parallel");
        assert!(ServerConfig::from_json(&v).unwrap_err().contains("n_parallel"));
        let mut v2 = v.clone();
        v2["n_parallel"] = serde_json::json!(1);
        v2["load_mode"] = serde_json::json!(9);
        assert!(ServerConfig::from_json(&v2).unwrap_err().contains("llama_load_mode 9"));
        v2["load_mode"] = serde_json::json!(1);
        v2["kv_unified"] = serde_json::json!("yes");
        assert!(ServerConfig::from_json(&v2).is_err());
    }
}
