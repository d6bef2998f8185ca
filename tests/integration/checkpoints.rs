//! Context checkpoints on a hybrid model (recurrent state plus attention, Qwen3.5 MoE with a
//! NextN head): prompt reuse resumes from a checkpoint, and speculative decoding (the MTP head,
//! or a draft model whose rejected tokens are undone by restoring a checkpoint) keeps greedy
//! output.

use serde_json::{json, Value};

use crate::support::{model, Server};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog and then runs into the forest where";

fn hybrid(extra: &[&str]) -> Server {
    let m = model("tiny-qwen35moe-mtp.gguf");
    let mut args = vec!["-m", m.to_str().unwrap(), "-c", "2048", "-np", "1"];
    args.extend_from_slice(extra);
    Server::start(&args, &[])
}

fn greedy(prompt: impl Into<Value>, n: usize, cache_prompt: bool) -> Value {
    json!({"prompt": prompt.into(), "n_predict": n, "temperature": 0, "return_tokens": true, "cache_prompt": cache_prompt})
}

fn cache_n(v: &Value) -> u64 {
    v["timings"]["cache_n"].as_u64().unwrap_or_else(|| panic!("{v}"))
}

/// Recurrent state cannot be cut back to a shared prefix; the checkpoint taken 4 tokens before
/// the end of the previous prompt can be restored instead. Without checkpoints the prompt is
/// processed again. Either way the tokens are those of a fresh prompt.
#[test]
fn a_hybrid_model_resumes_a_shared_prefix_from_a_checkpoint() {
    let server = hybrid(&["-lv", "4"]);
    let (_, first) = server.post("/completion", &greedy(PROMPT, 8, true));
    let n_first = first["tokens_evaluated"].as_u64().unwrap();
    let longer = format!("{PROMPT} it found a small house");
    let (_, reused) = server.post("/completion", &greedy(longer.as_str(), 8, true));
    assert_eq!(cache_n(&reused), n_first - 4, "{}", reused["timings"]);
    assert!(server.log.lock().unwrap().contains("restored context checkpoint"), "the checkpoint was restored");
    let (_, fresh) = server.post("/completion", &greedy(longer.as_str(), 8, false));
    assert_eq!(cache_n(&fresh), 0);
    assert_eq!(reused["tokens"], fresh["tokens"], "a restored checkpoint continues exactly like a fresh prompt");

    let none = hybrid(&["--ctx-checkpoints", "0"]);
    none.post("/completion", &greedy(PROMPT, 8, true));
    let (_, again) = none.post("/completion", &greedy(longer.as_str(), 8, true));
    assert_eq!(cache_n(&again), 0, "without checkpoints nothing is reusable");
    assert_eq!(again["tokens"], fresh["tokens"]);
}

/// A chat prompt gets a checkpoint where each user message starts (the template's message
/// delimiters): editing the last user message resumes from the one before it, as llama-server
/// does (26 tokens with this template).
#[test]
fn an_edited_last_user_message_resumes_from_its_checkpoint() {
    let server = hybrid(&[]);
    let chat = |last: &str| {
        json!({"messages": [
            {"role": "system", "content": "Book"},
            {"role": "user", "content": "What is the best book"},
            {"role": "assistant", "content": "Some book that is good"},
            {"role": "user", "content": last}],
            "max_tokens": 4, "temperature": 0})
    };
    let (_, first) = server.post("/v1/chat/completions", &chat("Why that one?"));
    assert_eq!(cache_n(&first), 0);
    let (_, edited) = server.post("/v1/chat/completions", &chat("Tell me more."));
    assert_eq!(cache_n(&edited), 26, "{}", edited["timings"]);
}

/// Speculation on a model whose recurrent state cannot drop rejected draft tokens: the MTP
/// head (the context keeps a few recurrent-state snapshots to roll back to), a draft model
/// the target always rejects and one it always accepts (the target restores a checkpoint and
/// decodes the accepted tokens again) all give the tokens of plain decoding; a prompt that
/// continues the generated text then reuses the cache and still matches a fresh prompt.
#[test]
fn speculation_on_a_hybrid_model_keeps_greedy_output() {
    let m = model("tiny-qwen35moe-mtp.gguf");
    let other = model("tiny-qwen35moe-draft.gguf");
    let plain = hybrid(&[]);
    let (_, want) = plain.post("/completion", &greedy(PROMPT, 24, true));
    assert!(want["timings"].get("draft_n").is_none(), "{want}");
    let mut tokens: Vec<Value> = plain.post("/tokenize", &json!({"content": PROMPT, "add_special": true})).1["tokens"].as_array().unwrap().clone();
    tokens.extend(want["tokens"].as_array().unwrap().iter().cloned());
    let (_, want_next) = plain.post("/completion", &greedy(tokens.clone(), 8, false));
    drop(plain);

    let setups: [(&str, Vec<&str>, Option<bool>); 3] = [
        ("draft-mtp", vec!["--spec-type", "draft-mtp"], None),
        ("other draft model", vec!["--spec-type", "draft-simple", "-md", other.to_str().unwrap()], Some(false)),
        ("the model as its draft", vec!["--spec-type", "draft-simple", "-md", m.to_str().unwrap()], Some(true)),
    ];
    for (what, args, all_accepted) in setups {
        let server = hybrid(&args);
        let (_, got) = server.post("/completion", &greedy(PROMPT, 24, true));
        assert_eq!(got["tokens"], want["tokens"], "{what}");
        let (drafted, accepted) = (got["timings"]["draft_n"].as_u64().unwrap(), got["timings"]["draft_n_accepted"].as_u64().unwrap());
        assert!(drafted > 0, "{what}: {got}");
        if let Some(all) = all_accepted {
            assert_eq!(accepted == drafted, all, "{what}: {accepted}/{drafted}");
            assert_eq!(accepted == 0, !all, "{what}: {accepted}/{drafted}");
        }
        let (_, next) = server.post("/completion", &greedy(tokens.clone(), 8, true));
        assert!(cache_n(&next) > 0, "{what}: {}", next["timings"]);
        assert_eq!(next["tokens"], want_next["tokens"], "{what}: the state left by speculation continues like a fresh prompt");
    }
}
