use std::io::Read;

use serde_json::{json, Value};

use crate::support::{model, Server};

fn llama() -> Server {
    let m = model("tiny-llama.gguf");
    Server::start(&["-m", m.to_str().unwrap(), "-c", "512", "-np", "1"], &[])
}

/// A streamed answer's events as (name, data), checking each `event:` line names its data's
/// type and that no `[DONE]` marker follows, as llama-server frames this API.
fn events(server: &Server, body: &Value) -> Vec<(String, Value)> {
    let res = ureq::post(&format!("{}/v1/responses", server.base)).send_json(body.clone()).expect("stream request");
    assert_eq!(res.header("content-type"), Some("text/event-stream"));
    let mut raw = String::new();
    res.into_reader().read_to_string(&mut raw).unwrap();
    assert!(!raw.contains("[DONE]"), "{raw}");
    raw.split("\n\n")
        .filter(|frame| !frame.is_empty())
        .map(|frame| {
            let (name, data) = frame.split_once('\n').unwrap_or_else(|| panic!("two lines per event: {frame:?}"));
            let name = name.strip_prefix("event: ").unwrap_or_else(|| panic!("event line: {frame:?}")).to_string();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect()
}

#[test]
fn responses_whole_and_streamed() {
    let server = llama();
    let req = json!({
        "input": [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}],
        "max_output_tokens": 6,
        "temperature": 0.0,
    });
    let (status, whole) = server.post("/v1/responses", &req);
    assert_eq!(status, 200, "{whole}");
    assert!(whole["id"].as_str().unwrap().starts_with("resp_"), "{whole}");
    assert_eq!((&whole["object"], &whole["status"]), (&json!("response"), &json!("completed")));
    let msg = &whole["output"][0];
    assert!(msg["id"].as_str().unwrap().starts_with("msg_"), "{whole}");
    assert_eq!((&msg["type"], &msg["role"]), (&json!("message"), &json!("assistant")));
    let text = msg["content"][0]["text"].as_str().unwrap().to_string();
    let usage = &whole["usage"];
    assert_eq!(usage["output_tokens"], 6);
    assert_eq!(usage["total_tokens"], usage["input_tokens"].as_u64().unwrap() + 6);

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let evs = events(&server, &sreq);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names.iter().filter(|n| **n == "response.output_text.delta").count();
    assert!(deltas > 0, "{names:?}");
    let mut expected = vec!["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"];
    expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    expected.extend(["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]);
    assert_eq!(names, expected);

    let resp_id = evs[0].1["response"]["id"].as_str().unwrap();
    assert!(resp_id.starts_with("resp_"));
    assert_eq!(evs[1].1["response"]["id"], resp_id);
    let msg_id = evs[2].1["item"]["id"].as_str().unwrap();
    assert!(msg_id.starts_with("msg_"));
    for (name, data) in &evs[3..evs.len() - 2] {
        assert_eq!(data["item_id"], msg_id, "{name}");
    }
    let streamed: String = evs.iter().filter_map(|(_, d)| d["delta"].as_str()).collect();
    assert_eq!(streamed, text, "greedy streamed text matches the whole answer");
    let done = &evs.last().unwrap().1;
    assert_eq!(done["response"]["id"], resp_id);
    assert_eq!(done["response"]["output"][0]["id"], msg_id);
    assert_eq!(done["response"]["output"][0]["content"][0]["text"], streamed.as_str());
    assert_eq!(done["response"]["usage"]["output_tokens"], 6);
    assert!(done["timings"]["predicted_per_second"].is_number(), "{done}");
}

#[test]
fn responses_function_call_round_trip_input() {
    let server = llama();
    let input = json!([
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]);
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let req = json!({"input": input, "tools": tools, "instructions": "Be brief.", "max_output_tokens": 2, "temperature": 0.0});
    let (status, whole) = server.post("/v1/responses", &req);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["usage"]["output_tokens"], 2);

    let (status, counted) = server.post("/v1/responses/input_tokens", &req);
    assert_eq!(status, 200, "{counted}");
    assert_eq!(counted["object"], "response.input_tokens");
    assert_eq!(counted["input_tokens"], whole["usage"]["input_tokens"]);

    let (status, err) = server.post("/v1/responses", &json!({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"text": "x"}]}]}));
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["message"], "Output of tool call missing 'type' field");
}
