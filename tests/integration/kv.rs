//! How the KV cache is read and where it lives: QSA layers (the tiny qwen4exp's sparse attention)
//! attending over each token's gathered cells (patches/0011, STRATA_LAB=qsa-gather=N) keep the
//! masked attention's output, in decode and in prompt batches, with an f16 and a q8_0 cache; and
//! with `--kv-resident N` their K and V are placed by Strata (patches/0012) with the same output.

use serde_json::{json, Value};

use crate::experts::tmp;
use crate::support::{model, Server};

const MODEL: &str = "tiny-qwen4exp.gguf";
/// Largest |difference| of a top-3 log-probability: the gathered cells are summed in another
/// order, and the CPU's flash attention accumulates an f16 cache's values in f16.
const TOL: f64 = 0.01;

fn generate(s: &Server, prompt: &str) -> Value {
    let body = json!({"prompt": prompt, "n_predict": 32, "temperature": 0, "n_probs": 3, "cache_prompt": false,
                      "ignore_eos": true, "return_tokens": true});
    let (status, v) = s.post("/completion", &body);
    assert_eq!(status, 200, "{v}");
    v
}

/// Each generated token's top-3, or None where it has none (a token that ends inside a UTF-8
/// character; the next token's entry carries its bytes).
fn by_step(v: &Value) -> Vec<Option<&Vec<Value>>> {
    let entries = v["completion_probabilities"].as_array().unwrap();
    let mut j = 0;
    let mut out = Vec::new();
    for tok in v["tokens"].as_array().unwrap() {
        if j < entries.len() && &entries[j]["id"] == tok {
            out.push(entries[j]["top_logprobs"].as_array());
            j += 1;
        } else {
            out.push(None);
        }
    }
    out
}

/// The largest |difference| of the top-3 log-probabilities while the two answers agree. Where
/// the greedy tokens part, the reference's first two must be a near tie (within TOL): the tiny
/// model's random weights give flat distributions whose ties another summation order may flip.
fn max_difference(a: &Value, b: &Value, what: &str) -> f64 {
    let (ta, tb) = (a["tokens"].as_array().unwrap(), b["tokens"].as_array().unwrap());
    assert_eq!(ta.len(), tb.len(), "{what}");
    let (sa, sb) = (by_step(a), by_step(b));
    let agree = ta.iter().zip(tb).take_while(|(x, y)| x == y).count();
    if agree < ta.len() {
        let top = sa[agree].unwrap_or_else(|| panic!("{what}: the greedy tokens part at {agree}, a step without log-probabilities"));
        let gap = top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap();
        assert!(gap <= TOL && agree >= 8, "{what}: the greedy tokens part at {agree} where the reference's margin is {gap}");
    }
    let mut d: f64 = 0.0;
    for (x, y) in sa.iter().zip(&sb).take(agree) {
        let (Some(x), Some(y)) = (x, y) else { continue };
        for (ex, ey) in x.iter().zip(y.iter()) {
            if ex["id"] == ey["id"] {
                d = d.max((ex["logprob"].as_f64().unwrap() - ey["logprob"].as_f64().unwrap()).abs());
            }
        }
    }
    d
}

#[test]
fn qsa_attention_over_gathered_cells_keeps_the_output() {
    let m = model(MODEL);
    let ms = m.to_str().unwrap();
    let dir = tmp("qsa-gather");
    // 800 tokens: the indexer keeps 8 blocks of 4 cells and the tail, far fewer than the context
    let prompt: String = (0..150).map(|i| format!("word{i} alpha beta ")).collect();
    for cache in ["f16", "q8_0"] {
        let run = |lab: &str| {
            let profile = dir.join(format!("ops-{cache}-{}.jsonl", lab.len()));
            let profile_s = profile.to_str().unwrap().to_string();
            let args = ["-m", ms, "-c", "4096", "-fa", "on", "-b", "64", "-ub", "64", "-ctk", cache, "-ctv", cache, "--mmap-experts"];
            let s = Server::start(&args, &[("STRATA_LAB", lab), ("STRATA_OP_PROFILE", &profile_s)]);
            let out = generate(&s, &prompt);
            drop(s);
            (out, std::fs::read_to_string(&profile).unwrap_or_default())
        };
        let (masked, masked_ops) = run("");
        let (gathered, gathered_ops) = run("qsa-gather=64");
        let what = format!("{cache} cache");
        assert!(masked["timings"]["prompt_n"].as_u64().unwrap() > 700, "{what}: {masked}");
        // the prompt's 64-token batches took the gathered form, and only with the item
        assert!(gathered_ops.contains("\"indexer_gather\""), "{what}: no gathered attention in the prompt batches' ops");
        assert!(!masked_ops.contains("\"indexer_gather\""), "{what}: gathered attention without the item");
        let d = max_difference(&masked, &gathered, &what);
        assert!(d <= TOL, "{what}: log-probabilities differ by {d}");
    }
}

#[test]
fn kv_resident_places_the_qsa_layers_cache_and_keeps_the_output() {
    let m = model(MODEL);
    let ms = m.to_str().unwrap();
    let prompt: String = (0..150).map(|i| format!("word{i} alpha beta ")).collect();
    let run = |extra: &[&str]| {
        let mut args = vec!["-m", ms, "-c", "4096", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"];
        args.extend_from_slice(extra);
        let s = Server::start(&args, &[]);
        let log = s.log.lock().unwrap().clone();
        let out = generate(&s, &prompt);
        // a second request reuses the cached prompt in the placed cache
        let again = generate(&s, &prompt);
        assert_eq!(out["tokens"], again["tokens"], "{extra:?}: the same request twice");
        (out, log)
    };
    let (plain, _) = run(&[]);
    let (placed, log) = run(&["--kv-resident", "64"]);
    assert!(log.contains("--kv-resident 64: the K and V of 2 QSA layers (0.5 MiB for 4096 tokens a sequence) live in host memory"), "{log}");
    let d = max_difference(&plain, &placed, "--kv-resident 64");
    assert!(d <= TOL, "log-probabilities differ by {d}");
    // without flash attention nothing gathers: said, with what a step then reads
    let (_, log) = run(&["--kv-resident", "64", "-fa", "off", "-ctk", "f16", "-ctv", "f16"]);
    assert!(log.contains("flash attention is off (-fa off), which the gather of each token's selected cells needs"), "{log}");
    // a context within N moves nothing, and says so
    let (_, log) = run(&["--kv-resident", "8192"]);
    assert!(log.contains("--kv-resident 8192: a sequence's 4096 tokens fit: the KV cache stays on the card"), "{log}");
}
