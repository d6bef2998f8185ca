use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::{model, Server};

const LOAD_TIMEOUT: Duration = Duration::from_secs(120);

fn status_of(server: &Server, id: &str) -> String {
    let (code, body) = server.get("/models");
    assert_eq!(code, 200, "{body}");
    let entry = body["data"].as_array().unwrap().iter().find(|m| m["id"] == id).unwrap_or_else(|| panic!("{id} not listed: {body}"));
    entry["status"]["value"].as_str().unwrap().to_string()
}

fn wait_for(server: &Server, id: &str, want: &str) {
    let t0 = Instant::now();
    while status_of(server, id) != want {
        assert!(t0.elapsed() < LOAD_TIMEOUT, "{id} never became {want}:\n{}", server.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn router_lists_routes_and_unloads_a_models_dir_model() {
    let dir = std::env::temp_dir().join(format!("strata-router-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("tiny-llama.gguf");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(model("tiny-llama.gguf"), &link).unwrap();

    let server =
        Server::start(&["--models-dir", dir.to_str().unwrap(), "--models-max", "1", "-c", "256", "-np", "1"], &[("LLAMA_CACHE", dir.to_str().unwrap())]);

    let (code, props) = server.get("/props");
    assert_eq!(code, 200);
    assert_eq!(props["role"], "router");
    assert_eq!(props["max_instances"], 1);

    let (_, list) = server.get("/v1/models");
    let entry: &Value = &list["data"][0];
    assert_eq!(entry["id"], "tiny-llama");
    assert_eq!(entry["source"], "models_dir");
    assert_eq!(entry["status"]["value"], "unloaded");

    let (code, body) = server.post("/completion", &json!({"model": "nope", "prompt": "x"}));
    assert_eq!(code, 400);
    assert_eq!(body["error"]["message"], "model 'nope' not found");

    let (code, body) = server.post("/completion", &json!({"model": "tiny-llama", "prompt": "Once upon a time", "n_predict": 4, "temperature": 0}));
    assert_eq!(code, 200, "{body}\n{}", server.log.lock().unwrap());
    assert_eq!(body["tokens_predicted"], 4, "{body}");
    assert_eq!(status_of(&server, "tiny-llama"), "loaded");

    let (code, body) = server.post("/models/load", &json!({"model": "tiny-llama"}));
    assert_eq!((code, body["error"]["message"].as_str()), (400, Some("model is already running")));

    let (code, body) = server.post("/models/unload", &json!({"model": "tiny-llama"}));
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["success"], true);
    wait_for(&server, "tiny-llama", "unloaded");

    let (code, body) = server.post("/models/unload", &json!({"model": "tiny-llama"}));
    assert_eq!((code, body["error"]["message"].as_str()), (400, Some("model is not running")));
    let _ = std::fs::remove_dir_all(&dir);
}
