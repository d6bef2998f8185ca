//! Greedy sampling answered from a scan of the logits (STRATA_SAMPLER_ARGMAX), against
//! llama.cpp's sampler chain; -bs sampling in the context's graph.

use serde_json::{json, Value};
use strata_ffi::{Model, ModelParams, Sampler};

use crate::support::{model, Server};

#[test]
fn the_scan_is_on_only_where_the_chain_picks_the_top_logit() {
    let m = Model::load(&model("tiny-qwen3moe.gguf"), &ModelParams::vocab_only()).unwrap();
    let on = |ovr: Value| Sampler::new(&m, None, &ovr).unwrap().argmax();
    // llama.cpp's defaults sample at temperature 0.8 from the top 40
    assert!(!on(json!({})));
    assert!(on(json!({"temp": 0.0})));
    assert!(on(json!({"top_k": 1})), "top-k 1 before the temperature");
    assert!(on(json!({"temp": 0.0, "logit_bias": [[1, false], [2, 3.5]]})), "biases are applied to the scan");
    assert!(on(json!({"temp": -1.0, "penalty_last_n": 0, "penalty_repeat": 1.3})), "penalties over no tokens");
    assert!(on(json!({"temp": 0.0, "samplers": ["temperature", "top_k"]})));
    for (ovr, why) in [
        (json!({"temp": 0.0, "penalty_repeat": 1.1}), "a repeat penalty changes logits"),
        (json!({"temp": 0.0, "penalty_present": 0.5}), "a presence penalty changes logits"),
        (json!({"temp": 0.0, "dry_multiplier": 0.8}), "DRY changes logits"),
        (json!({"temp": 0.0, "xtc_probability": 0.5, "xtc_threshold": 0.1}), "XTC drops the top tokens"),
        (json!({"temp": 0.0, "typ_p": 0.9}), "typical-p can drop the top token"),
        (json!({"temp": 0.0, "top_n_sigma": 1.0}), "top-n-sigma"),
        (json!({"temp": 0.0, "mirostat": 2}), "mirostat"),
        (json!({"temp": 0.0, "dynatemp_range": 0.5}), "a dynamic temperature above zero"),
        (json!({"top_k": 1, "samplers": ["temperature", "top_k"]}), "scaling before top-k 1 can tie the top"),
        (json!({"temp": 0.0, "grammar": "root ::= \"a\""}), "a grammar"),
        (json!({"top_k": 2, "temp": 0.5}), "sampling"),
    ] {
        assert!(!on(ovr), "{why}");
    }
    let mut s = Sampler::new(&m, None, &json!({"temp": 0.0})).unwrap();
    s.set_argmax(false);
    assert!(!s.argmax());
}

fn answers(server: &Server) -> Vec<Value> {
    let prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"];
    let mut out = Vec::new();
    for (i, extra) in [
        json!({"top_k": 1}),
        json!({"temperature": 0}),
        json!({"temperature": 0, "ignore_eos": true}),
        json!({"temperature": 0, "n_probs": 3, "post_sampling_probs": true}),
        json!({"temperature": 0, "n_probs": 3, "logit_bias": [[11, -2.0], [12, 1.5]]}),
        json!({"temperature": 0.9, "seed": 42}),
    ]
    .into_iter()
    .enumerate()
    {
        let mut body = json!({"prompt": prompts[i % prompts.len()], "n_predict": 48, "return_tokens": true, "cache_prompt": false});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, mut v) = server.post("/completion", &body);
        assert_eq!(status, 200, "{v}");
        v.as_object_mut().unwrap().remove("timings");
        out.push(v);
    }
    out
}

#[test]
fn greedy_answers_are_the_chains_with_the_scan_on() {
    let m = model("tiny-qwen3moe.gguf");
    let args = ["-m", m.to_str().unwrap(), "-c", "1024", "-np", "1"];
    let chain = answers(&Server::start(&args, &[("STRATA_SAMPLER_ARGMAX", "0")]));
    let scan = answers(&Server::start(&args, &[]));
    for (a, b) in chain.iter().zip(&scan) {
        assert_eq!(a, b);
    }
    assert!(chain[0]["tokens"].as_array().is_some_and(|t| t.len() == 48), "{}", chain[0]);
}

#[test]
fn a_bad_sampler_argmax_value_stops_the_server() {
    let m = model("tiny-qwen3moe.gguf");
    let out = crate::support::run_server(&["-m", m.to_str().unwrap()], &[("STRATA_SAMPLER_ARGMAX", "yes")]);
    assert_eq!(out.status, 1);
    assert!(out.stderr.contains("STRATA_SAMPLER_ARGMAX: invalid value 'yes'"), "{}", out.stderr);
}

fn server_params(extra: &[&str]) -> strata_ffi::ServerParams {
    let m = model("tiny-qwen3moe.gguf");
    let mut args = vec!["strata-server", "-m", m.to_str().unwrap(), "-c", "512", "-np", "2"];
    args.extend_from_slice(extra);
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let strata_ffi::ParseOutcome::Parsed(p) = strata_ffi::ServerParams::parse(&args, None).unwrap() else { panic!("flags rejected") };
    p
}

/// Decodes `prompt` on sequence `seq` and returns (the graph's sample, the sampler's answer).
fn decode_and_sample(ctx: &mut strata_ffi::Context<'_>, s: &mut Sampler, seq: i32, prompt: &[i32]) -> (Option<i32>, i32) {
    let mut batch = strata_ffi::Batch::new(prompt.len(), 1);
    for (i, &t) in prompt.iter().enumerate() {
        batch.add(t, i as i32, &[seq], i + 1 == prompt.len()).unwrap();
    }
    ctx.decode(&batch).unwrap();
    let graph = ctx.sampled_token(-1);
    (graph, s.sample(ctx, -1).unwrap())
}

#[test]
fn backend_sampling_samples_in_the_graph_and_detaches() {
    crate::support::quiet_llama_logs();
    use strata_ffi::Context;
    let m = Model::load(&model("tiny-qwen3moe.gguf"), &ModelParams::default()).unwrap();
    let prompt = m.vocab().tokenize("The capital of France is", true, false).unwrap();
    let bs = server_params(&["-bs"]);
    let mut ctx = Context::for_server(&m, bs.context_params().unwrap().with_threads(2), &bs).unwrap();
    assert!(ctx.backend_sampling());
    let mut s = Sampler::new(&m, Some(&bs), &json!({"seed": 11, "top_k": 5})).unwrap();
    assert!(s.backend());
    assert!(ctx.set_backend_sampler(1, Some(&s)));
    let (graph, chosen) = decode_and_sample(&mut ctx, &mut s, 1, &prompt);
    assert_eq!(graph, Some(chosen), "the sampler answers with the graph's token");
    assert!(!ctx.set_backend_sampler(1, None));
    ctx.seq_rm(1, 0, -1);
    let (graph, _) = decode_and_sample(&mut ctx, &mut s, 1, &prompt);
    assert_eq!(graph, None, "a detached sequence is sampled on the CPU");

    let grammar = Sampler::new(&m, Some(&bs), &json!({"grammar": "root ::= \"a\""})).unwrap();
    assert!(!grammar.backend(), "a grammar keeps sampling on the CPU, as common_sampler_init decides");
    let off = Sampler::new(&m, Some(&bs), &json!({"backend_sampling": false})).unwrap();
    assert!(!off.backend());

    let plain = server_params(&[]);
    assert!(!Context::for_server(&m, plain.context_params().unwrap().with_threads(2), &plain).unwrap().backend_sampling());
}
