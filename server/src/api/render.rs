//! Engine events as llama-server's native JSON: timings, probabilities, partial and final results.

use axum::response::{IntoResponse, Response};
use axum::Json;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::api::error::ApiError;
use crate::engine::{Event, Final, Partial, Timings, TokenProbs};
use serde_json::{json, Map, Value};
use strata_ffi::Token;

pub fn timings_json(t: &Timings) -> Value {
    let mut v = json!({
        "cache_n": t.cache_n,
        "prompt_n": t.prompt_n,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": t.prompt_per_token_ms(),
        "prompt_per_second": t.prompt_per_second(),
        "predicted_n": t.predicted_n,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": t.predicted_per_token_ms(),
        "predicted_per_second": t.predicted_per_second(),
    });
    if t.draft_n > 0 {
        v["draft_n"] = json!(t.draft_n);
        v["draft_n_accepted"] = json!(t.draft_n_accepted);
    }
    v
}

/// llama-server's completion_probabilities entries.
pub fn probs_json(probs: &[TokenProbs], post_sampling: bool) -> Value {
    let (p_key, top_key) = if post_sampling { ("prob", "top_probs") } else { ("logprob", "top_logprobs") };
    let value = |p: f32| {
        if post_sampling {
            p
        } else if p == 0.0 {
            f32::MIN
        } else {
            p.ln()
        }
    };
    let text = |b: &[u8]| String::from_utf8_lossy(&b[..crate::engine::generation::complete_utf8_len(b)]).into_owned();
    let entry = |t: Token, b: &[u8], p: f32| {
        let mut m = Map::new();
        m.insert("id".into(), json!(t));
        m.insert("token".into(), json!(text(b)));
        m.insert("bytes".into(), json!(b));
        m.insert(p_key.into(), json!(value(p)));
        m
    };
    Value::Array(
        probs
            .iter()
            .map(|tp| {
                let mut m = entry(tp.token, &tp.piece, tp.prob);
                let top: Vec<Value> = tp.top.iter().map(|(t, b, p)| Value::Object(entry(*t, b, *p))).collect();
                m.insert(top_key.into(), Value::Array(top));
                Value::Object(m)
            })
            .collect(),
    )
}

pub fn partial_json(p: &Partial, post_sampling: bool) -> Value {
    let mut v = partial_json_base(p);
    if let Some(tp) = &p.probs {
        v["completion_probabilities"] = probs_json(std::slice::from_ref(tp), post_sampling);
    }
    v
}

pub fn partial_json_base(p: &Partial) -> Value {
    let mut v = json!({
        "index": p.index,
        "content": p.content,
        "tokens": p.tokens,
        "stop": false,
        // llama-server's partial results never carry their slot
        "id_slot": -1,
        "tokens_predicted": p.n_decoded,
        "tokens_evaluated": p.n_prompt,
    });
    add_progress(&mut v, p);
    v
}

/// The `timings` (with timings_per_token) and `prompt_progress` (with return_progress) a
/// streamed chunk carries.
pub fn add_progress(v: &mut Value, p: &Partial) {
    if let Some(t) = &p.timings {
        v["timings"] = timings_json(t);
    }
    if let Some(pr) = &p.progress {
        v["prompt_progress"] = json!({
            "total": pr.total, "cache": pr.cache, "processed": pr.processed, "time_ms": pr.time_ms,
        });
    }
}

/// Keeps only the named fields ("a/b" reaches into objects), keyed by their paths, as
/// llama-server's response_fields.
pub fn select_fields(v: Value, fields: &[String]) -> Value {
    if fields.is_empty() {
        return v;
    }
    let mut out = Map::new();
    for f in fields {
        let found = f.split('/').try_fold(&v, |cur, k| cur.get(k));
        if let Some(x) = found {
            out.insert(f.clone(), x.clone());
        }
    }
    Value::Object(out)
}

pub fn final_json(f: &Final, model: &str, prompt: &str) -> Value {
    json!({
        "index": f.index,
        "content": f.content,
        "tokens": f.tokens,
        "id_slot": f.id_slot,
        "stop": true,
        "model": model,
        "tokens_predicted": f.n_decoded,
        "tokens_evaluated": f.n_prompt,
        "generation_settings": *f.settings,
        "prompt": prompt,
        "has_new_line": f.has_new_line,
        "truncated": f.truncated,
        "stop_type": f.stop.as_str(),
        "stopping_word": f.stopping_word,
        "tokens_cached": f.n_prompt + f.n_decoded.saturating_sub(1),
        "timings": timings_json(&f.timings),
    })
}

pub fn final_json_with_probs(f: &Final, model: &str, prompt: &str, post_sampling: bool) -> Value {
    let mut v = final_json(f, model, prompt);
    if !f.probs.is_empty() {
        v["completion_probabilities"] = probs_json(&f.probs, post_sampling);
    }
    v
}

/// Waits for every task's final event and returns their rendered JSON, in prompt order.
pub async fn collect_values(mut rx: crate::engine::Results, n: usize, mut render: impl FnMut(&Event) -> Vec<Value>) -> Result<Vec<Value>, ApiError> {
    let mut results: Vec<Option<Value>> = vec![None; n];
    while results.iter().any(Option::is_none) {
        match rx.recv().await.ok_or_else(|| ApiError::server("engine dropped the request"))? {
            Event::Begin | Event::Partial(_) => {}
            Event::Error(e) => return Err(e),
            ev @ Event::Final(_) => {
                let Event::Final(f) = &ev else { unreachable!() };
                results[f.index] = render(&ev).pop();
            }
            ev @ Event::Embedding(_) => {
                let Event::Embedding(e) = &ev else { unreachable!() };
                results[e.index] = render(&ev).pop();
            }
        }
    }
    Ok(results.into_iter().flatten().collect())
}

/// The answer for one prompt, or an array for several, as llama-server gives them.
pub async fn collect(rx: crate::engine::Results, n: usize, render: impl FnMut(&Event) -> Vec<Value>) -> Result<Response, ApiError> {
    let mut results = collect_values(rx, n, render).await?;
    Ok(Json(if n == 1 { results.remove(0) } else { Value::Array(results) }).into_response())
}

const ALNUM: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// 32 random alphanumerics, as llama-server's random_string().
pub fn random_string() -> String {
    let mut seed = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        ^ (std::process::id() as u64).rotate_left(32)
        ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed);
    (0..32)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ALNUM[(seed % ALNUM.len() as u64) as usize] as char
        })
        .collect()
}

static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
