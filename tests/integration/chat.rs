use serde_json::json;
use strata_ffi::{json_schema_to_grammar, parse_chat_message, ChatTemplates, Model, ModelParams};

use crate::support::model;

/// Tool calls through the pin's chat machinery: the Qwen3 template advertises the tool, and the
/// parser returned with the prompt turns the model's tool-call text back into OpenAI shape.
#[test]
fn qwen3_tool_call_round_trip() {
    crate::support::quiet_llama_logs();
    let m = Model::load(&model("tiny-qwen3moe.gguf"), &ModelParams::default()).unwrap();
    let tmpl = ChatTemplates::new(&m, None).unwrap();
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    }}]);
    let applied = tmpl
        .apply(&json!({
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": tools,
            "tool_choice": "auto",
            "add_generation_prompt": true,
        }))
        .unwrap();
    let prompt = applied["prompt"].as_str().unwrap();
    assert!(prompt.contains("get_weather"), "{prompt}");
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");

    let parser = json!({
        "format": applied["format"],
        "generation_prompt": applied["generation_prompt"],
        "parser": applied["parser"],
        "reasoning_format": "none",
    });
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let msg = parse_chat_message(text, false, &parser).unwrap();
    assert_eq!(msg["role"], "assistant");
    let call = &msg["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{msg}");
    let args: serde_json::Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    let plain = parse_chat_message("It is sunny.", false, &parser).unwrap();
    assert_eq!(plain["content"], "It is sunny.", "{plain}");
}

#[test]
fn json_schema_becomes_a_gbnf_grammar() {
    let g = json_schema_to_grammar(&json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})).unwrap();
    assert!(g.contains("root ::="), "{g}");
    assert!(g.contains("\"\\\"n\\\"\""), "{g}");
    let err = json_schema_to_grammar(&json!({"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}})).unwrap_err();
    assert!(!err.to_string().is_empty());
}
