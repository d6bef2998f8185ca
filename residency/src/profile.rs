//! The ranked expert profile (format v1, docs/expert-profile.md).
//!
//! A profile lists every (layer, expert) pair of an MoE model, most often routed first, counted
//! over a corpus; the server keeps a prefix of that list resident in VRAM. This is the
//! popularity-based placement of Fiddler (Kamahori et al., 2024), kept as plain JSON so it can be
//! inspected and diffed. Parsing is strict and bounded: a profile that does not
//! match its model is rejected instead of silently placing the wrong experts.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Write as _;

use serde_json::{Map, Value};

use crate::gguf::ExpertLayout;

pub const FORMAT: &str = "strata-expert-profile";
pub const VERSION: u64 = 1;
/// Far above any real profile (512 experts x 100 layers is about 1 MiB).
pub const MAX_PROFILE_BYTES: usize = 256 << 20;
const SHA256_HEX_LEN: usize = 64;
const SHORT_HASH: usize = 12;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("the profile is {len} bytes; profiles larger than {MAX_PROFILE_BYTES} bytes are rejected")]
    TooLarge { len: usize },
    #[error("the profile is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("this is not a strata expert profile (format is {0}, expected {FORMAT:?})")]
    Format(String),
    #[error("expert profile version {0} is not supported (this build reads version {VERSION})")]
    Version(u64),
    #[error("profile field {field} {problem}")]
    Field { field: String, problem: String },
    #[error("profile field {0} is not part of format version {VERSION}")]
    UnknownField(String),
    #[error("ranked[{index}]: {problem}")]
    Entry { index: usize, problem: String },
    #[error("ranked[{index}] has {hits} hits, more than the {previous} of the entry before it; entries must be sorted by hits, highest first")]
    NotSorted { index: usize, hits: u64, previous: u64 },
    #[error("ranked lists layer {layer} expert {expert} more than once")]
    Duplicate { layer: u32, expert: u32 },
    #[error("ranked lists {found} of the {n_expert} experts of layer {layer}; each listed layer needs all of them")]
    IncompleteLayer { layer: u32, found: usize, n_expert: u32 },
    #[error("ranked is empty")]
    Empty,
    #[error("this profile was made for another model (model sha256 {profile}… in the profile, {model}… for this model)")]
    OtherModel { profile: String, model: String },
    #[error("the profile's {what} is {profile}, but the model's is {model}")]
    Mismatch { what: &'static str, profile: String, model: String },
    #[error("the profile's MoE layers {profile:?} differ from the model's {model:?}")]
    Layers { profile: Vec<u32>, model: Vec<u32> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Entry {
    pub layer: u32,
    pub expert: u32,
    pub hits: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    pub model_sha256: String,
    pub arch: String,
    pub n_layer: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    /// Tokens routed while counting.
    pub tokens: u64,
    pub source: String,
    /// Most hits first; ties by (layer, expert).
    pub ranked: Vec<Entry>,
}

fn field_error(field: &str, problem: impl Into<String>) -> ProfileError {
    ProfileError::Field { field: field.to_string(), problem: problem.into() }
}

fn take<'a>(object: &'a Map<String, Value>, field: &str, path: &str) -> Result<&'a Value, ProfileError> {
    object.get(field).ok_or_else(|| field_error(path, "is missing"))
}

fn reject_unknown(object: &Map<String, Value>, known: &[&str], prefix: &str) -> Result<(), ProfileError> {
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err(ProfileError::UnknownField(format!("{prefix}{key}"))),
        None => Ok(()),
    }
}

fn as_u64(value: &Value, path: &str) -> Result<u64, ProfileError> {
    value.as_u64().ok_or_else(|| field_error(path, "must be a non-negative integer"))
}

fn as_u32(value: &Value, path: &str, min: u32) -> Result<u32, ProfileError> {
    value
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n >= min)
        .ok_or_else(|| field_error(path, format!("must be an integer from {min} to {}", u32::MAX)))
}

fn as_str<'a>(value: &'a Value, path: &str) -> Result<&'a str, ProfileError> {
    value.as_str().ok_or_else(|| field_error(path, "must be a string"))
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == SHA256_HEX_LEN && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn short(hash: &str) -> String {
    hash.chars().take(SHORT_HASH).collect()
}

impl Profile {
    pub fn parse(bytes: &[u8]) -> Result<Profile, ProfileError> {
        if bytes.len() > MAX_PROFILE_BYTES {
            return Err(ProfileError::TooLarge { len: bytes.len() });
        }
        let root: Value = serde_json::from_slice(bytes)?;
        let root = root.as_object().ok_or_else(|| field_error("(top level)", "must be a JSON object"))?;

        let format = take(root, "format", "format")?;
        if format.as_str() != Some(FORMAT) {
            return Err(ProfileError::Format(format.to_string()));
        }
        let version = as_u64(take(root, "version", "version")?, "version")?;
        if version != VERSION {
            return Err(ProfileError::Version(version));
        }
        reject_unknown(root, &["format", "version", "model", "tokens", "source", "ranked"], "")?;

        let model = take(root, "model", "model")?.as_object().ok_or_else(|| field_error("model", "must be an object"))?;
        reject_unknown(model, &["sha256", "arch", "n_layer", "n_expert", "n_expert_used"], "model.")?;
        let model_sha256 = as_str(take(model, "sha256", "model.sha256")?, "model.sha256")?;
        if !is_sha256_hex(model_sha256) {
            return Err(field_error("model.sha256", "must be 64 lowercase hex digits"));
        }
        let arch = as_str(take(model, "arch", "model.arch")?, "model.arch")?;
        let n_layer = as_u32(take(model, "n_layer", "model.n_layer")?, "model.n_layer", 1)?;
        let n_expert = as_u32(take(model, "n_expert", "model.n_expert")?, "model.n_expert", 1)?;
        let n_expert_used = as_u32(take(model, "n_expert_used", "model.n_expert_used")?, "model.n_expert_used", 1)?;
        if n_expert_used > n_expert {
            return Err(field_error("model.n_expert_used", format!("is {n_expert_used}, more than n_expert {n_expert}")));
        }

        let tokens = as_u64(take(root, "tokens", "tokens")?, "tokens")?;
        let source = as_str(take(root, "source", "source")?, "source")?;
        let ranked = take(root, "ranked", "ranked")?.as_array().ok_or_else(|| field_error("ranked", "must be an array"))?;
        let ranked = ranked.iter().enumerate().map(|(index, item)| parse_entry(index, item, n_layer, n_expert)).collect::<Result<Vec<_>, _>>()?;

        let profile = Profile {
            model_sha256: model_sha256.to_string(),
            arch: arch.to_string(),
            n_layer,
            n_expert,
            n_expert_used,
            tokens,
            source: source.to_string(),
            ranked,
        };
        profile.check_ranking()?;
        Ok(profile)
    }

    fn check_ranking(&self) -> Result<(), ProfileError> {
        if self.ranked.is_empty() {
            return Err(ProfileError::Empty);
        }
        for (index, e) in self.ranked.iter().enumerate() {
            check_bounds(index, e.layer.into(), e.expert.into(), self.n_layer, self.n_expert)?;
        }
        for (index, pair) in self.ranked.windows(2).enumerate() {
            if pair[1].hits > pair[0].hits {
                return Err(ProfileError::NotSorted { index: index + 1, hits: pair[1].hits, previous: pair[0].hits });
            }
        }
        let mut seen = HashSet::with_capacity(self.ranked.len());
        for e in &self.ranked {
            if !seen.insert((e.layer, e.expert)) {
                return Err(ProfileError::Duplicate { layer: e.layer, expert: e.expert });
            }
        }
        for (layer, found) in self.per_layer_counts() {
            if found != self.n_expert as usize {
                return Err(ProfileError::IncompleteLayer { layer, found, n_expert: self.n_expert });
            }
        }
        Ok(())
    }

    fn per_layer_counts(&self) -> BTreeMap<u32, usize> {
        let mut counts = BTreeMap::new();
        for e in &self.ranked {
            *counts.entry(e.layer).or_insert(0) += 1;
        }
        counts
    }

    /// The layers the profile ranks, ascending.
    pub fn layers(&self) -> Vec<u32> {
        self.ranked.iter().map(|e| e.layer).collect::<BTreeSet<_>>().into_iter().collect()
    }

    /// The profile as JSON, one ranked entry per line.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(256 + self.ranked.len() * 24);
        let _ = writeln!(out, "{{\"format\": {}, \"version\": {VERSION},", Value::from(FORMAT));
        let _ = writeln!(
            out,
            " \"model\": {{\"sha256\": {}, \"arch\": {}, \"n_layer\": {}, \"n_expert\": {}, \"n_expert_used\": {}}},",
            Value::from(self.model_sha256.as_str()),
            Value::from(self.arch.as_str()),
            self.n_layer,
            self.n_expert,
            self.n_expert_used,
        );
        let _ = writeln!(out, " \"tokens\": {},", self.tokens);
        let _ = writeln!(out, " \"source\": {},", Value::from(self.source.as_str()));
        out.push_str(" \"ranked\": [");
        for (i, e) in self.ranked.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(out, "{sep}\n  [{}, {}, {}]", e.layer, e.expert, e.hits);
        }
        out.push_str("\n ]}\n");
        out
    }

    /// Ranks `counts` (per layer, the hits of each expert in expert order) by hits, highest
    /// first, ties by (layer, expert). Each layer is expected to list all `n_expert` experts;
    /// [`Profile::parse`] and [`Profile::check`] reject a profile where one does not.
    #[allow(clippy::too_many_arguments)]
    pub fn from_counts(
        model_sha256: &str,
        arch: &str,
        n_layer: u32,
        n_expert: u32,
        n_expert_used: u32,
        tokens: u64,
        source: &str,
        counts: &[(u32, Vec<u64>)],
    ) -> Profile {
        let mut ranked: Vec<Entry> = counts
            .iter()
            .flat_map(|(layer, hits)| hits.iter().enumerate().map(move |(expert, &hits)| Entry { layer: *layer, expert: expert as u32, hits }))
            .collect();
        ranked.sort_by(|a, b| b.hits.cmp(&a.hits).then(a.layer.cmp(&b.layer)).then(a.expert.cmp(&b.expert)));
        Profile { model_sha256: model_sha256.to_string(), arch: arch.to_string(), n_layer, n_expert, n_expert_used, tokens, source: source.to_string(), ranked }
    }

    /// Checks that this profile was made for the model with this layout and hash, and covers
    /// every expert of each of its MoE layers.
    pub fn check(&self, layout: &ExpertLayout, model_sha256: &str) -> Result<(), ProfileError> {
        if self.model_sha256 != model_sha256 {
            return Err(ProfileError::OtherModel { profile: short(&self.model_sha256), model: short(model_sha256) });
        }
        let mismatch = |what, profile: String, model: String| Err(ProfileError::Mismatch { what, profile, model });
        if self.arch != layout.arch {
            return mismatch("architecture", self.arch.clone(), layout.arch.clone());
        }
        if self.n_layer != layout.n_layer {
            return mismatch("layer count", self.n_layer.to_string(), layout.n_layer.to_string());
        }
        if self.n_expert != layout.n_expert {
            return mismatch("expert count", self.n_expert.to_string(), layout.n_expert.to_string());
        }
        if self.n_expert_used != layout.n_expert_used {
            return mismatch("used expert count", self.n_expert_used.to_string(), layout.n_expert_used.to_string());
        }
        let model_layers: Vec<u32> = layout.layers.iter().map(|l| l.layer).collect();
        let profile_layers = self.layers();
        if profile_layers != model_layers {
            return Err(ProfileError::Layers { profile: profile_layers, model: model_layers });
        }
        self.check_ranking()
    }
}

fn parse_entry(index: usize, item: &Value, n_layer: u32, n_expert: u32) -> Result<Entry, ProfileError> {
    let problem = |problem: String| ProfileError::Entry { index, problem };
    let triple = match item.as_array() {
        Some(triple) if triple.len() == 3 => triple,
        _ => return Err(problem("must be [layer, expert, hits]".into())),
    };
    let number = |i: usize, name: &str| triple[i].as_u64().ok_or_else(|| problem(format!("{name} must be a non-negative integer")));
    let (layer, expert, hits) = (number(0, "layer")?, number(1, "expert")?, number(2, "hits")?);
    check_bounds(index, layer, expert, n_layer, n_expert)?;
    Ok(Entry { layer: layer as u32, expert: expert as u32, hits })
}

fn check_bounds(index: usize, layer: u64, expert: u64, n_layer: u32, n_expert: u32) -> Result<(), ProfileError> {
    let problem = if layer >= u64::from(n_layer) {
        format!("layer {layer} is not below n_layer {n_layer}")
    } else if expert >= u64::from(n_expert) {
        format!("expert {expert} is not below n_expert {n_expert}")
    } else {
        return Ok(());
    };
    Err(ProfileError::Entry { index, problem })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::gguf::ExpertLayer;

    const SHA: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const OTHER_SHA: &str = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";

    /// Layers 1 and 3 of 4 are MoE, with 3 experts each.
    fn sample() -> Profile {
        Profile::from_counts(SHA, "qwen3moe", 4, 3, 2, 100, "wiki \"test\" ∑", &[(3, vec![5, 70, 5]), (1, vec![5, 0, 90])])
    }

    fn layout() -> ExpertLayout {
        let layer = |layer| ExpertLayer { layer, n_ff: 32, mats: Vec::new() };
        ExpertLayout { arch: "qwen3moe".into(), n_layer: 4, n_expert: 3, n_expert_used: 2, n_embd: 64, layers: vec![layer(1), layer(3)] }
    }

    fn sample_json() -> Value {
        serde_json::from_str(&sample().to_json()).expect("sample json")
    }

    fn parse_value(value: &Value) -> Result<Profile, ProfileError> {
        Profile::parse(value.to_string().as_bytes())
    }

    fn entries(profile: &Profile) -> Vec<(u32, u32, u64)> {
        profile.ranked.iter().map(|e| (e.layer, e.expert, e.hits)).collect()
    }

    #[test]
    fn from_counts_ranks_by_hits_then_layer_then_expert() {
        let profile = sample();
        assert_eq!(entries(&profile), [(1, 2, 90), (3, 1, 70), (1, 0, 5), (3, 0, 5), (3, 2, 5), (1, 1, 0)]);
        assert_eq!(profile.layers(), [1, 3]);
    }

    #[test]
    fn round_trip() {
        let profile = sample();
        let text = profile.to_json();
        assert_eq!(text.lines().filter(|l| l.trim_start().starts_with('[')).count(), profile.ranked.len());
        assert_eq!(Profile::parse(text.as_bytes()).expect("round trip"), profile);
        let value: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(value["format"], FORMAT);
        assert_eq!(value["model"]["sha256"], SHA);
        assert_eq!(value["ranked"][0], json!([1, 2, 90]));
    }

    #[test]
    fn wrong_format_and_version_are_rejected() {
        let mut v = sample_json();
        v["format"] = json!("llama-profile");
        let err = parse_value(&v).unwrap_err();
        assert!(matches!(err, ProfileError::Format(_)), "{err}");
        assert!(err.to_string().contains("llama-profile"), "{err}");

        let mut v = sample_json();
        v["version"] = json!(2);
        assert!(matches!(parse_value(&v), Err(ProfileError::Version(2))));

        let mut v = sample_json();
        v["version"] = json!("1");
        assert!(matches!(parse_value(&v), Err(ProfileError::Field { field, .. }) if field == "version"));

        assert!(matches!(Profile::parse(b"[1, 2]"), Err(ProfileError::Field { .. })));
        assert!(matches!(Profile::parse(b"{\"format\": "), Err(ProfileError::Json(_))));
        assert!(matches!(Profile::parse(b"\xff\xfe"), Err(ProfileError::Json(_))));
        let deep = "[".repeat(100_000);
        assert!(matches!(Profile::parse(deep.as_bytes()), Err(ProfileError::Json(_))));
    }

    #[test]
    fn oversized_input_is_rejected_before_parsing() {
        let big = vec![b' '; MAX_PROFILE_BYTES + 1];
        assert!(matches!(Profile::parse(&big), Err(ProfileError::TooLarge { .. })));
    }

    #[test]
    fn bad_fields_are_rejected() {
        let cases: [(&str, Value); 11] = [
            ("/extra", json!(1)),
            ("/model/extra", json!(1)),
            ("/model/sha256", json!(SHA.to_uppercase())),
            ("/model/sha256", json!("abc")),
            ("/model/n_layer", json!(0)),
            ("/model/n_expert", json!(1u64 << 32)),
            ("/model/n_expert_used", json!(4)),
            ("/model/arch", json!(7)),
            ("/tokens", json!(-1)),
            ("/source", Value::Null),
            ("/ranked", json!({})),
        ];
        for (pointer, replacement) in cases {
            let mut v = sample_json();
            let (parent, key) = pointer.rsplit_once('/').expect("pointer");
            v.pointer_mut(parent).and_then(Value::as_object_mut).expect("parent").insert(key.into(), replacement);
            let err = parse_value(&v).unwrap_err();
            assert!(matches!(err, ProfileError::Field { .. } | ProfileError::UnknownField(_)), "{pointer}: {err}");
        }
        let mut v = sample_json();
        v.as_object_mut().expect("object").remove("tokens");
        assert!(matches!(parse_value(&v), Err(ProfileError::Field { field, problem }) if field == "tokens" && problem == "is missing"));
    }

    #[test]
    fn bad_entries_are_rejected() {
        let with_ranked = |ranked: Value| {
            let mut v = sample_json();
            v["ranked"] = ranked;
            parse_value(&v).unwrap_err()
        };
        let err = with_ranked(json!([[1, 2, 90], [1, 2]]));
        assert!(matches!(err, ProfileError::Entry { index: 1, .. }), "{err}");
        let err = with_ranked(json!([[1, 2, 9.5]]));
        assert!(matches!(err, ProfileError::Entry { index: 0, .. }), "{err}");
        let err = with_ranked(json!([[4, 0, 9]]));
        assert!(err.to_string().contains("layer 4 is not below n_layer 4"), "{err}");
        let err = with_ranked(json!([[1, 3, 9]]));
        assert!(err.to_string().contains("expert 3 is not below n_expert 3"), "{err}");
        let err = with_ranked(json!([[1, 0, 5], [1, 1, 6], [1, 2, 0]]));
        assert!(matches!(err, ProfileError::NotSorted { index: 1, hits: 6, previous: 5 }), "{err}");
        let err = with_ranked(json!([[1, 0, 5], [1, 0, 5], [1, 2, 0]]));
        assert!(matches!(err, ProfileError::Duplicate { layer: 1, expert: 0 }), "{err}");
        let err = with_ranked(json!([[1, 0, 5], [1, 1, 5], [1, 2, 0], [3, 0, 0]]));
        assert!(matches!(err, ProfileError::IncompleteLayer { layer: 3, found: 1, n_expert: 3 }), "{err}");
        assert!(matches!(with_ranked(json!([])), ProfileError::Empty));
    }

    #[test]
    fn check_accepts_the_matching_model() {
        sample().check(&layout(), SHA).expect("matching profile");
    }

    #[test]
    fn check_rejects_another_model() {
        let err = sample().check(&layout(), OTHER_SHA).unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, ProfileError::OtherModel { .. }));
        assert!(message.contains("another model") && message.contains(&SHA[..12]) && message.contains(&OTHER_SHA[..12]));
        assert!(!message.contains(SHA), "{message}");

        let mut more_experts = layout();
        more_experts.n_expert = 4;
        assert!(matches!(sample().check(&more_experts, SHA), Err(ProfileError::Mismatch { what: "expert count", .. })));
        let mut more_layers = layout();
        more_layers.n_layer = 5;
        assert!(matches!(sample().check(&more_layers, SHA), Err(ProfileError::Mismatch { what: "layer count", .. })));
    }

    #[test]
    fn check_needs_exactly_the_moe_layers_complete() {
        let mut extra_layer = layout();
        extra_layer.layers.push(ExpertLayer { layer: 2, n_ff: 32, mats: Vec::new() });
        extra_layer.layers.sort_by_key(|l| l.layer);
        let err = sample().check(&extra_layer, SHA).unwrap_err();
        assert!(matches!(&err, ProfileError::Layers { profile, model } if profile == &[1, 3] && model == &[1, 2, 3]), "{err}");

        let mut fewer = layout();
        fewer.layers.truncate(1);
        assert!(matches!(sample().check(&fewer, SHA), Err(ProfileError::Layers { .. })));

        let short = Profile::from_counts(SHA, "qwen3moe", 4, 3, 2, 100, "", &[(1, vec![1, 2, 3]), (3, vec![4, 5])]);
        assert!(matches!(short.check(&layout(), SHA), Err(ProfileError::IncompleteLayer { layer: 3, found: 2, .. })));
        let long = Profile::from_counts(SHA, "qwen3moe", 4, 3, 2, 100, "", &[(1, vec![1, 2, 3]), (3, vec![4, 5, 6, 7])]);
        assert!(matches!(long.check(&layout(), SHA), Err(ProfileError::Entry { .. })));
    }
}
