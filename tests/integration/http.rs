use serde_json::json;

use crate::support::{model, Server};

#[test]
fn tokenize_and_detokenize_round_trip() {
    let server = Server::start(&["-m", model("gemma3-270m-q4_k_m.gguf").to_str().unwrap(), "-c", "512"], &[]);
    let (status, body) = server.post("/tokenize", &json!({"content": "Hello world, héllo"}));
    assert_eq!(status, 200, "{body}");
    let tokens = body["tokens"].clone();
    assert!(tokens.as_array().unwrap().len() >= 4, "{body}");
    let (_, with_bos) = server.post("/tokenize", &json!({"content": "Hello", "add_special": true}));
    let (_, without) = server.post("/tokenize", &json!({"content": "Hello"}));
    assert_eq!(with_bos["tokens"].as_array().unwrap().len(), without["tokens"].as_array().unwrap().len() + 1);

    let (_, pieces) = server.post("/tokenize", &json!({"content": "Hello world", "with_pieces": true}));
    let joined: String = pieces["tokens"].as_array().unwrap().iter().map(|p| p["piece"].as_str().unwrap()).collect();
    assert_eq!(joined, "Hello world");

    let (status, body) = server.post("/detokenize", &json!({"tokens": tokens}));
    assert_eq!(status, 200);
    assert_eq!(body["content"], "Hello world, héllo");

    let (status, body) = server.post("/detokenize", &json!({"tokens": [1, 99999999]}));
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let (status, _) = server.post("/tokenize", &json!({"content": {"not": "text"}}));
    assert_eq!(status, 400);
    let (status, body) = server.post("/completion", &json!({"prompt": "Hi", "n_predict": 2}));
    assert_eq!(status, 200, "the server must keep answering after bad input: {body}");
}
