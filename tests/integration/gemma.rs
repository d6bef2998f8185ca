use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};
use strata_ffi::{ChatTemplates, Model, ModelParams};

use crate::support::{golden, model, Server};

const PROMPT: &str = "The capital of France is";
const N_PREDICT: usize = 32;
const GEMMA: &str = "gemma3-270m-q4_k_m.gguf";

/// Builds tests/ref/greedy.c against the same libllama that strata-server uses.
fn reference_binary() -> PathBuf {
    let lib = strata_ffi::LLAMA_LIB_DIR;
    let src = PathBuf::from(strata_ffi::LLAMA_SRC_DIR);
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("greedy-ref");
    let status = Command::new("cc")
        .arg(crate::support::repo().join("tests/ref/greedy.c"))
        .arg("-o")
        .arg(&out)
        .arg(format!("-I{}", src.join("include").display()))
        .arg(format!("-I{}", src.join("ggml/include").display()))
        .arg(format!("-L{lib}"))
        .arg(format!("-Wl,-rpath,{lib}"))
        .args(["-lllama", "-lggml", "-lggml-base"])
        .status()
        .expect("run cc");
    assert!(status.success(), "compiling the C reference failed");
    out
}

fn reference_tokens() -> Vec<i64> {
    let out = Command::new(reference_binary()).args([model(GEMMA).to_str().unwrap(), PROMPT, &N_PREDICT.to_string()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().split_whitespace().map(|t| t.parse().unwrap()).collect()
}

#[test]
fn greedy_32_tokens_are_stable_and_equal_the_c_api() {
    let want = reference_tokens();
    assert_eq!(want.len(), N_PREDICT, "the reference stopped early: {want:?}");
    // The reference decodes the prompt in one batch; context checkpoints would split off its last
    // 4 tokens, and the quantized sums in another order flip a greedy choice.
    let server = Server::start(&["-m", model(GEMMA).to_str().unwrap(), "-c", "512", "--ctx-checkpoints", "0"], &[]);
    let req = json!({"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0.0, "return_tokens": true});
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (status, body) = server.post("/completion", &req);
        assert_eq!(status, 200, "{body}");
        let toks: Vec<i64> = body["tokens"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect();
        assert!(!body["content"].as_str().unwrap().is_empty());
        runs.push(toks);
    }
    assert_eq!(runs[0], runs[1], "two greedy runs differ");
    assert_eq!(runs[0], want, "strata-server and llama.cpp's C API differ");
}

/// Our template rendering against upstream llama-server's /apply-template (tools/golden), for the
/// model's own template and for a Jinja template from the pin.
#[test]
fn chat_template_equals_upstream_apply_template() {
    crate::support::quiet_llama_logs();
    let request: Value = serde_json::from_str(&golden("llama-server/gemma-apply-template.request.json")).unwrap();
    let inputs = json!({"messages": request["messages"], "add_generation_prompt": true, "use_jinja": true});
    let model = Model::load(&model(GEMMA), &ModelParams::default()).unwrap();
    let jinja_path = PathBuf::from(strata_ffi::LLAMA_SRC_DIR).join("models/templates/google-gemma-2-2b-it.jinja");
    let jinja = std::fs::read_to_string(jinja_path).unwrap();
    for (golden_name, tmpl) in [("gemma-apply-template", None), ("gemma-apply-template-jinja", Some(jinja.as_str()))] {
        let upstream: Value = serde_json::from_str(&golden(&format!("llama-server/{golden_name}.json"))).unwrap();
        let out = ChatTemplates::new(&model, tmpl).unwrap().apply(&inputs).unwrap();
        assert_eq!(out["prompt"], upstream["prompt"], "{golden_name}");
    }
}

/// llama.cpp's common_speculative through the shim, with the n-gram drafter: on a sequence
/// that repeats, the draft is the continuation of the repetition.
#[test]
fn ngram_speculative_drafts_the_repetition() {
    crate::support::quiet_llama_logs();
    use strata_ffi::{Context, ContextParams, ParseOutcome, ServerParams, Speculative};
    let gemma = model(GEMMA);
    let args: Vec<String> = ["strata-server", "-m", gemma.to_str().unwrap(), "--spec-type", "ngram-simple"].iter().map(|s| s.to_string()).collect();
    let ParseOutcome::Parsed(mut params) = ServerParams::parse(&args, None).unwrap() else { panic!("flags rejected") };
    let m = Model::load(&gemma, &ModelParams::default()).unwrap();
    let mut ctx = Context::new(&m, ContextParams::default().with_n_ctx(512)).unwrap();
    let mut spec = Speculative::new(&mut params, &mut ctx, 1).unwrap().expect("the settings give a drafter");

    let period: Vec<i32> = (1000..1020).collect();
    let history: Vec<i32> = period.iter().copied().cycle().take(period.len() * 6).collect();
    let last = period[0];
    spec.begin(0, &history).unwrap();
    let draft = spec.draft(0, &history, last, 16).unwrap();
    assert_eq!(draft.len(), 16, "{draft:?}");
    let expected: Vec<i32> = period.iter().copied().cycle().skip(1).take(16).collect();
    assert_eq!(draft, expected);
    spec.accept(0, 4).unwrap();

    // The drafter keeps its target context's pointer: given another context, or once the target
    // is freed, its calls fail instead of reaching it.
    let mut other = Context::new(&m, ContextParams::default().with_n_ctx(512)).unwrap();
    let batch = strata_ffi::Batch::new(1, 1);
    let e = spec.process(&mut other, &batch).unwrap_err();
    assert!(e.to_string().contains("made over another target context"), "{e}");
    drop(ctx);
    let e = spec.draft(0, &history, last, 16).unwrap_err();
    assert!(e.to_string().contains("target context was freed"), "{e}");
    assert!(spec.seq_rm(0, 0, -1).is_err());
}
