//! What llama.cpp's parser sets for the preset flags, read without downloading anything: the
//! preset's own fields, which a later flag can still override. tests/python/test_flags_upstream.py
//! starts both servers on the presets against a stand-in for Hugging Face.

use serde_json::{json, Value};
use strata_ffi::{ParseOutcome, ServerParams};

fn parsed(args: &[&str]) -> Value {
    let args: Vec<String> = std::iter::once("strata-server").chain(args.iter().copied()).map(String::from).collect();
    let ParseOutcome::Parsed(p) = ServerParams::parse(&args, None).unwrap() else { panic!("flags rejected: {args:?}") };
    p.to_json().unwrap()
}

/// The fields a test compares, in one object.
fn fields(v: &Value) -> Value {
    json!({
        "hf_repo": v["hf_repo"], "port": v["port"], "n_ctx": v["n_ctx"], "n_batch": v["n_batch"], "n_ubatch": v["n_ubatch"],
        "n_parallel": v["n_parallel"], "n_cache_reuse": v["n_cache_reuse"], "embedding": v["embedding"],
        "draft": v["speculative"]["has_draft_model"], "speculative": v["speculative"]["enabled"],
    })
}

#[test]
fn presets_set_their_model_port_batches_and_drafter() {
    crate::support::quiet_llama_logs();
    let defaults = fields(&parsed(&[]));
    assert_eq!(defaults["port"], 8080);
    assert_eq!(defaults["draft"], false);
    let fim = |repo: &str, draft: bool| {
        json!({"hf_repo": repo, "port": 8012, "n_ctx": 0, "n_batch": 1024, "n_ubatch": 1024, "n_parallel": defaults["n_parallel"],
               "n_cache_reuse": 256, "embedding": false, "draft": draft, "speculative": draft})
    };
    let cases = [
        (
            "--embd-gemma-default",
            json!({"hf_repo": "ggml-org/embeddinggemma-300M-qat-q4_0-GGUF", "port": 8011, "n_ctx": 2048 * 32, "n_batch": 2048,
                   "n_ubatch": 2048, "n_parallel": 32, "n_cache_reuse": 0, "embedding": true, "draft": false, "speculative": false}),
        ),
        ("--fim-qwen-1.5b-default", fim("ggml-org/Qwen2.5-Coder-1.5B-Q8_0-GGUF", false)),
        ("--fim-qwen-3b-default", fim("ggml-org/Qwen2.5-Coder-3B-Q8_0-GGUF", false)),
        ("--fim-qwen-7b-default", fim("ggml-org/Qwen2.5-Coder-7B-Q8_0-GGUF", false)),
        ("--fim-qwen-7b-spec", fim("ggml-org/Qwen2.5-Coder-7B-Q8_0-GGUF", true)),
        ("--fim-qwen-14b-spec", fim("ggml-org/Qwen2.5-Coder-14B-Q8_0-GGUF", true)),
        ("--fim-qwen-30b-default", fim("ggml-org/Qwen3-Coder-30B-A3B-Instruct-Q8_0-GGUF", false)),
    ];
    for (preset, want) in cases {
        assert_eq!(fields(&parsed(&[preset])), want, "{preset}");
    }
    // a flag after the preset wins, as upstream parses left to right
    assert_eq!(parsed(&["--fim-qwen-1.5b-default", "--port", "9000"])["port"], 9000);

    let spec = parsed(&["--spec-default"]);
    // the preset pushes onto the default list, which holds "none": common_speculative_init skips it
    assert_eq!(spec["speculative"]["types"], "none,ngram-mod");
    assert_eq!(spec["speculative"]["enabled"], true);
}
