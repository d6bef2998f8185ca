//! `--spec N` as the seed's line types it: N draft tokens a step, with no drafter named. Where
//! llama.cpp's flags name none (no `--spec-type`, no draft model), a model with an MTP head drafts
//! with it (the seed's "matching MTP runtime": `--spec-type draft-mtp`, which also makes
//! llama.cpp load the head); otherwise nothing drafts, and start-up says so.

use std::path::Path;

use serde_json::Value;

use super::flags::StrataArgs;

/// What `--spec` comes to: llama.cpp arguments to add (empty: none) and the start-up line.
#[derive(Debug, PartialEq, Eq)]
pub struct Drafting {
    pub args: Vec<String>,
    pub line: String,
}

/// For parsed parameters `cfg` (ServerParams::to_json) and Strata's flags; None without `--spec`.
pub fn decide(a: &StrataArgs, cfg: &Value) -> Option<Drafting> {
    let n = a.given.iter().rev().find(|(name, _)| *name == "--spec").map(|(_, v)| v.clone())?;
    let spec = &cfg["speculative"];
    if spec["enabled"].as_bool() == Some(true) {
        let types: Vec<&str> = spec["types"].as_str().unwrap_or_default().split(',').filter(|t| !t.is_empty() && *t != "none").collect();
        let by = if spec["has_draft_model"].as_bool() == Some(true) { "the draft model".to_string() } else { format!("--spec-type {}", types.join(",")) };
        return Some(Drafting { args: Vec::new(), line: format!("--spec {n}: up to {n} draft tokens a step, drafted by {by}") });
    }
    let path = cfg["model"].as_str().unwrap_or_default();
    let line = match mtp_layers(Path::new(path)) {
        Ok(l) if l > 0 => {
            return Some(Drafting {
                args: vec!["--spec-type".into(), "draft-mtp".into()],
                line: format!("--spec {n}: up to {n} draft tokens a step, drafted by the model's MTP head ({l} layer(s); --spec-type draft-mtp)"),
            });
        }
        Ok(_) => format!("--spec {n}: nothing drafts: the model has no MTP head, and no --spec-type or draft model (-md) is given"),
        Err(why) => format!("--spec {n}: nothing drafts: {why}, and no --spec-type or draft model (-md) is given"),
    };
    Some(Drafting { args: Vec::new(), line })
}

/// The model file's MTP (NextN) layers, from its header.
fn mtp_layers(path: &Path) -> Result<u64, String> {
    if path.as_os_str().is_empty() {
        return Err("the model is not on disk before it is downloaded, so its MTP head is not known".into());
    }
    let info = strata_residency::gguf::read_info(path).map_err(|e| format!("the model's header could not be read ({e})"))?;
    let arch = info.get("general.architecture").and_then(|v| v.as_str()).unwrap_or_default();
    Ok(info.get(&format!("{arch}.nextn_predict_layers")).and_then(|v| v.as_u64()).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn args(n: &str) -> StrataArgs {
        super::super::flags::split(&["strata-server".into(), "--spec".into(), n.into()]).unwrap().0
    }

    #[test]
    fn without_spec_nothing_changes_and_a_named_drafter_is_kept() {
        let none = super::super::flags::split(&["strata-server".into()]).unwrap().0;
        assert_eq!(decide(&none, &json!({})), None);
        let cfg = json!({"model": "/nonexistent.gguf", "speculative": {"enabled": true, "has_draft_model": false, "types": "draft-simple"}});
        let d = decide(&args("4"), &cfg).unwrap();
        assert!(d.args.is_empty());
        assert_eq!(d.line, "--spec 4: up to 4 draft tokens a step, drafted by --spec-type draft-simple");
    }

    #[test]
    fn a_model_that_cannot_be_read_drafts_nothing_and_says_why() {
        let cfg = json!({"model": "/nonexistent.gguf", "speculative": {"enabled": false}});
        let d = decide(&args("3"), &cfg).unwrap();
        assert!(d.args.is_empty());
        assert!(d.line.starts_with("--spec 3: nothing drafts: the model's header could not be read"), "{}", d.line);
        let d = decide(&args("3"), &json!({"model": "", "speculative": {"enabled": false}})).unwrap();
        assert!(d.line.contains("not on disk before it is downloaded"), "{}", d.line);
    }
}
