//! The model tools/serve serves: the published Gemma 3 270M with Gemma's chat template written
//! into it by tools/fetch-gemma. Chats to it, from an API client or from the web UI, are
//! rendered in Gemma's turns, not in llama.cpp's ChatML fallback.

use std::path::PathBuf;

use serde_json::{json, Value};

use crate::support::{model, repo, Server};

const DEFAULT: &str = "gemma3-270m-q4_k_m-chat.gguf";
const QUESTION: &str = "What is the capital of France?";
/// The pretrained model rarely ends its turn by itself; a short answer keeps the test cheap.
const MAX_TOKENS: u64 = 16;
/// What a chat format leaves in an answer when the model does not speak it.
const DEBRIS: [&str; 3] = ["<|im", "<start_of_turn>", "<end_of_turn>"];

fn start() -> Server {
    let serve = std::fs::read_to_string(repo().join("tools/serve")).unwrap();
    assert!(serve.contains(DEFAULT), "tools/serve no longer serves {DEFAULT}");
    Server::start(&["-m", model(DEFAULT).to_str().unwrap(), "-c", "512"], &[])
}

fn assert_clean(content: &str) {
    assert!(!content.trim().is_empty(), "empty answer");
    for marker in DEBRIS {
        assert!(!content.contains(marker), "template debris {marker:?} in the answer {content:?}");
    }
}

#[test]
fn a_chat_is_prompted_in_gemmas_turns_and_answered_without_template_debris() {
    let server = start();
    let pin_template = PathBuf::from(strata_ffi::LLAMA_SRC_DIR).join("models/templates/google-gemma-2-2b-it.jinja");
    let (_, props) = server.get("/props");
    assert_eq!(props["chat_template"].as_str(), Some(std::fs::read_to_string(pin_template).unwrap().as_str()));

    let messages = json!([{"role": "user", "content": QUESTION}]);
    let (status, rendered) = server.post("/apply-template", &json!({"messages": messages}));
    assert_eq!(status, 200, "{rendered}");
    let prompt = format!("<start_of_turn>user\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n");
    assert_eq!(rendered["prompt"].as_str(), Some(prompt.as_str()));
    let (_, tokens) = server.post("/tokenize", &json!({"content": prompt, "add_special": true}));

    let (status, body) = server.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], tokens["tokens"].as_array().unwrap().len(), "the chat was not prompted with {prompt:?}");
    let choice = &body["choices"][0];
    assert!(matches!(choice["finish_reason"].as_str(), Some("stop" | "length")), "{body}");
    assert_clean(choice["message"]["content"].as_str().unwrap());
}

/// The request the web UI (the pin's tools/ui, chat.service.ts) sends for a first message with its
/// default settings, plus a max_tokens and a seed as the UI's settings can add them.
#[test]
fn the_web_uis_first_message_streams_an_answer_without_template_debris() {
    let server = start();
    let request = json!({
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": true,
        "timings_per_token": true,
        "return_progress": true,
        "sse_ping_interval": 1,
        "reasoning_format": "auto",
        "reasoning_control": true,
        "max_tokens": MAX_TOKENS,
        "seed": 1,
    });
    let chunks = server.post_stream("/v1/chat/completions", &request);
    let choices: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"].get(0)).collect();
    let content: String = choices.iter().filter_map(|c| c["delta"]["content"].as_str()).collect();
    assert_clean(&content);
    let finish = choices.iter().find_map(|c| c["finish_reason"].as_str());
    assert!(matches!(finish, Some("stop" | "length")), "no finish_reason in {chunks:?}");
}
