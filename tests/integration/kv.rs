//! How the KV cache is read and where it lives: QSA layers (the tiny qwen4exp's sparse attention)
//! attending over each token's gathered cells (patches/0011, STRATA_LAB=qsa-gather=N) keep the
//! masked attention's output, in decode and in prompt batches, with an f16 and a q8_0 cache; and
//! with `--kv-resident N` their K and V are placed by Strata (patches/0012) with the same output,
//! in several slots at once, across a context shift and through a slot file.

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

/// Several slots at once, the prompt cache, a context shift and a slot saved and restored, each
/// with the QSA layers' cache placed by Strata, give what the cache in its usual place gives.
#[test]
fn kv_resident_keeps_slots_context_shift_and_slot_files() {
    let m = model(MODEL);
    let ms = m.to_str().unwrap();
    let dir = tmp("kv-slots");
    let prompts: Vec<String> = (0..2).map(|k| (0..100).map(|i| format!("w{k}x{i} alpha beta ")).collect()).collect();
    let run = |extra: &[&str], save: &str| {
        // two slots of 1,024 tokens each
        let mut args = vec!["-m", ms, "-c", "2048", "-np", "2", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "--context-shift"];
        let slots = dir.join(save);
        std::fs::create_dir_all(&slots).unwrap();
        args.extend_from_slice(&["--slot-save-path", slots.to_str().unwrap()]);
        args.extend_from_slice(extra);
        let s = Server::start(&args, &[]);
        let alone: Vec<Value> = prompts.iter().map(|p| generate(&s, p)).collect();
        let together: Vec<Value> = std::thread::scope(|sc| {
            let h: Vec<_> = prompts.iter().map(|p| sc.spawn(|| generate(&s, p))).collect();
            h.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (a, t) in alone.iter().zip(&together) {
            assert_eq!(a["tokens"], t["tokens"], "{extra:?}: a request alone and beside another");
        }
        // past the slot's 1,024 tokens: the context shifts where the model's memory can (both placements alike)
        let long = json!({"prompt": prompts[0], "n_predict": 700, "temperature": 0, "cache_prompt": false, "ignore_eos": true,
                          "n_probs": 3, "return_tokens": true});
        let (status, shifted) = s.post("/completion", &long);
        // a slot saved, restored into the other slot, continued from its cache
        let body = json!({"prompt": prompts[1], "n_predict": 16, "temperature": 0, "cache_prompt": true, "id_slot": 0,
                          "ignore_eos": true, "return_tokens": true});
        let (st, first) = s.post("/completion", &body);
        assert_eq!(st, 200, "{first}");
        let (st, saved) = s.post("/slots/0?action=save", &json!({"filename": "slot0.bin"}));
        assert_eq!(st, 200, "{extra:?}: save {saved}");
        let (st, restored) = s.post("/slots/1?action=restore", &json!({"filename": "slot0.bin"}));
        assert_eq!(st, 200, "{extra:?}: restore {restored}");
        assert_eq!(saved["n_saved"], restored["n_restored"], "{extra:?}: {saved} {restored}");
        assert_eq!(saved["n_written"], restored["n_read"], "{extra:?}: {saved} {restored}");
        assert!(saved["n_saved"].as_u64().unwrap() > 600, "{saved}");
        // the restored slot serves (a recurrent model re-reads a prompt it cannot extend, as upstream)
        let mut again = body.clone();
        again["id_slot"] = json!(1);
        let (st, next) = s.post("/completion", &again);
        assert_eq!(st, 200, "{next}");
        assert_eq!(first["tokens"], next["tokens"], "{extra:?}: the restored slot answers as the saved one did");
        let first = saved["n_written"].clone();
        (alone, status, shifted, first)
    };
    let (plain, plain_status, plain_shift, plain_first) = run(&[], "plain");
    let (placed, status, shift, first) = run(&["--kv-resident", "64"], "placed");
    for (a, b) in plain.iter().zip(&placed) {
        let d = max_difference(a, b, "--kv-resident 64, two slots");
        assert!(d <= TOL, "log-probabilities differ by {d}");
    }
    assert_eq!(plain_status, status, "the context shift: {plain_shift} against {shift}");
    if status == 200 {
        // the pin does not shift this model's cache (its memory cannot shift): both stop at the slot's end alike
        let n = |v: &Value| v["tokens"].as_array().unwrap().len();
        assert_eq!((n(&plain_shift), plain_shift["truncated"].clone()), (n(&shift), shift["truncated"].clone()), "{shift}");
        let d = max_difference(&plain_shift, &shift, "--kv-resident 64, a shifted context");
        assert!(d <= TOL, "log-probabilities differ by {d} across the context shift");
    }
    // a slot file holds the same bytes wherever the cache lives
    assert_eq!(plain_first, first);
}
