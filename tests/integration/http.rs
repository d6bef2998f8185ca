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

    // llama.cpp throws std::out_of_range for the id; llama-server answers 500 with its message
    let (status, body) = server.post("/detokenize", &json!({"tokens": [1, 99999999]}));
    assert_eq!(status, 500, "{body}");
    assert_eq!(body["error"]["type"], "server_error");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("vector::_M_range_check: __n (which is 99999999)"), "{body}");
    let (status, _) = server.post("/tokenize", &json!({"content": {"not": "text"}}));
    assert_eq!(status, 400);
    let (status, body) = server.post("/completion", &json!({"prompt": "Hi", "n_predict": 2}));
    assert_eq!(status, 200, "the server must keep answering after bad input: {body}");

    // /props names the pin's build, then Strata's version and the commit it was built from
    let (_, props) = server.get("/props");
    let head = std::process::Command::new("git").args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "--short=12", "HEAD"]).output().unwrap();
    let commit = if head.status.success() { String::from_utf8_lossy(&head.stdout).trim().to_string() } else { "unknown".into() };
    let want = format!(" strata-server-{}-{commit}", env!("CARGO_PKG_VERSION"));
    let build = props["build_info"].as_str().unwrap();
    assert!(build.starts_with("b11434-") && build.ends_with(&want), "{build} (want ...{want})");
}

/// The infill prompt (FIM layout, truncation, extra context) equals the pinned llama-server's for
/// the same request (tools/golden), and bad requests get its errors.
#[test]
fn infill_builds_upstreams_prompt_and_refuses_models_without_fim() {
    let fim = model("tiny-llama-fim.gguf");
    // (golden, server flags): the second leaves room for the extra context chunks.
    for (name, flags) in [("infill", vec!["-c", "512"]), ("infill-extra", vec!["-c", "4096", "-b", "256", "-ub", "256"])] {
        let mut args = vec!["-m", fim.to_str().unwrap()];
        args.extend(flags);
        let server = Server::start(&args, &[]);
        let req: serde_json::Value = serde_json::from_str(&crate::support::golden(&format!("llama-server/{name}.request.json"))).unwrap();
        let upstream: serde_json::Value = serde_json::from_str(&crate::support::golden(&format!("llama-server/{name}.json"))).unwrap();
        let (status, body) = server.post("/infill", &req);
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["prompt"], upstream["prompt"], "{name}");
        assert_eq!(body["tokens_evaluated"], upstream["tokens_evaluated"], "{name}");
        assert_eq!(body["tokens_predicted"], 4);
    }
    let server = Server::start(&["-m", fim.to_str().unwrap()], &[]);

    for (bad, msg) in [
        // llama-server's own checks of these do not stop its handler: the JSON lookup fails
        (json!({"input_suffix": "x"}), "[json.exception.out_of_range.403] key 'input_prefix' not found"),
        (json!({"input_prefix": "x"}), "[json.exception.out_of_range.403] key 'input_suffix' not found"),
        (json!({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]}), "extra_context chunk must contain"),
    ] {
        let (status, body) = server.post("/infill", &bad);
        assert_eq!(status, 400, "{body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(msg), "{body}");
    }

    let plain = Server::start(&["-m", model("tiny-llama.gguf").to_str().unwrap()], &[]);
    let (status, body) = plain.post("/infill", &json!({"input_prefix": "a", "input_suffix": "b"}));
    assert_eq!(status, 501, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("Infill is not supported by this model"));
}
