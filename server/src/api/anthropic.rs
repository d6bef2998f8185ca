//! The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`), as llama-server
//! offers it: the request becomes an OpenAI chat request, the answer is shaped back.

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use strata_ffi::{chat_msg_diffs, parse_chat_message};

use crate::api::app::{loaded_model, App};
use crate::api::body::{parse_body, task_params, tokenize_prompts};
use crate::api::chat::{chat_prompt, fill_tool_call_ids};
use crate::api::error::ApiError;
use crate::api::prompt_log;
use crate::api::render::collect_values;
use crate::api::render::random_string;
use crate::api::sse::{ping_interval, stream_response, Sse};
use crate::engine::generation::StopType;
use crate::engine::{Event, Final};

/// A `x-anthropic-billing-header:` system prefix carries a per-request `cch=XXXXX;` hash that
/// would defeat prompt caching; llama-server masks it with `f`s.
fn normalize_billing_header(text: &mut String) {
    const PREFIX: &str = "x-anthropic-billing-header:";
    const CCH_LEN: usize = 5;
    if !text.starts_with(PREFIX) {
        return;
    }
    let Some(at) = text[PREFIX.len()..].find("cch=").map(|i| i + PREFIX.len() + 4) else { return };
    if text.as_bytes().get(at + CCH_LEN) == Some(&b';') && text.is_char_boundary(at) && text.is_char_boundary(at + CCH_LEN) {
        text.replace_range(at..at + CCH_LEN, &"f".repeat(CCH_LEN));
    }
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

fn image_part(source: &Value) -> Option<Value> {
    let url = match str_of(source, "type") {
        "base64" => {
            let media = source.get("media_type").and_then(Value::as_str).unwrap_or("image/jpeg");
            format!("data:{media};base64,{}", str_of(source, "data"))
        }
        "url" => str_of(source, "url").to_string(),
        _ => return None,
    };
    Some(json!({"type": "image_url", "image_url": {"url": url}}))
}

fn tool_result(block: &Value) -> Value {
    let id = str_of(block, "tool_use_id");
    let content = match block.get("content") {
        Some(Value::String(s)) => json!(s),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            let mut converted = Vec::new();
            let mut has_images = false;
            for c in parts {
                match str_of(c, "type") {
                    "text" => {
                        text.push_str(str_of(c, "text"));
                        converted.push(json!({"type": "text", "text": str_of(c, "text")}));
                    }
                    "image" => {
                        has_images = true;
                        converted.extend(image_part(c.get("source").unwrap_or(&Value::Null)));
                    }
                    _ => {}
                }
            }
            if has_images {
                Value::Array(converted)
            } else {
                json!(text)
            }
        }
        _ => json!(""),
    };
    json!({"role": "tool", "tool_call_id": id, "content": content})
}

/// llama-server's server_chat_convert_anthropic_to_oai.
pub fn to_openai(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let mut messages = Vec::new();
    match body.get("system") {
        Some(Value::String(s)) => {
            let mut s = s.clone();
            normalize_billing_header(&mut s);
            messages.push(json!({"role": "system", "content": s}));
        }
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for b in blocks.iter().filter(|b| str_of(b, "type") == "text") {
                let mut t = str_of(b, "text").to_string();
                normalize_billing_header(&mut t);
                text.push_str(&t);
            }
            messages.push(json!({"role": "system", "content": text}));
        }
        _ => {}
    }
    let msgs = body.get("messages").ok_or_else(|| ApiError::server("'messages' is required"))?;
    for msg in msgs.as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let role = str_of(msg, "role");
        let Some(content) = msg.get("content") else {
            if role != "assistant" {
                messages.push(msg.clone());
            }
            continue;
        };
        let Some(blocks) = content.as_array() else {
            messages.push(msg.clone());
            continue;
        };
        let (mut parts, mut tool_calls, mut results) = (Vec::new(), Vec::new(), Vec::new());
        let mut reasoning = String::new();
        for block in blocks {
            match str_of(block, "type") {
                "text" => parts.push(block.clone()),
                "thinking" => reasoning.push_str(str_of(block, "thinking")),
                "image" => parts.extend(image_part(block.get("source").unwrap_or(&Value::Null))),
                "tool_use" => tool_calls.push(json!({
                    "id": str_of(block, "id"),
                    "type": "function",
                    "function": {"name": str_of(block, "name"), "arguments": block.get("input").cloned().unwrap_or(json!({})).to_string()},
                })),
                "tool_result" => results.push(tool_result(block)),
                _ => {}
            }
        }
        if !parts.is_empty() || !tool_calls.is_empty() || !reasoning.is_empty() {
            let mut m = json!({"role": role});
            m["content"] = if parts.is_empty() { json!("") } else { Value::Array(parts) };
            if !tool_calls.is_empty() {
                m["tool_calls"] = Value::Array(tool_calls);
            }
            if !reasoning.is_empty() {
                m["reasoning_content"] = json!(reasoning);
            }
            messages.push(m);
        }
        messages.extend(results);
    }
    let mut out = Map::new();
    out.insert("messages".into(), Value::Array(messages));
    if let Some(Value::Array(tools)) = body.get("tools") {
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": str_of(t, "name"),
                    "description": str_of(t, "description"),
                    "parameters": t.get("input_schema").cloned().unwrap_or(json!({})),
                }})
            })
            .collect();
        out.insert("tools".into(), Value::Array(tools));
    }
    if let Some(tc) = body.get("tool_choice").filter(|t| t.is_object()) {
        match str_of(tc, "type") {
            "auto" => {
                out.insert("tool_choice".into(), json!("auto"));
            }
            "any" | "tool" => {
                out.insert("tool_choice".into(), json!("required"));
            }
            _ => {}
        }
    }
    if let Some(stops) = body.get("stop_sequences") {
        out.insert("stop".into(), stops.clone());
    }
    out.insert("max_tokens".into(), body.get("max_tokens").cloned().unwrap_or(json!(4096)));
    for key in ["temperature", "top_p", "top_k", "stream", "chat_template_kwargs"] {
        if let Some(v) = body.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    if let Some(thinking) = body.get("thinking") {
        if str_of(thinking, "type") == "enabled" {
            let budget = thinking.get("budget_tokens").cloned().unwrap_or(json!(10000));
            out.insert("thinking_budget_tokens".into(), budget);
        }
    }
    Ok(out)
}

fn stop_reason(f: &Final, has_tool_calls: bool) -> &'static str {
    match f.stop {
        StopType::Word | StopType::Eos if has_tool_calls => "tool_use",
        StopType::Word | StopType::Eos => "end_turn",
        _ => "max_tokens",
    }
}

fn stop_sequence(f: &Final) -> Value {
    if f.stopping_word.is_empty() {
        Value::Null
    } else {
        json!(f.stopping_word)
    }
}

fn has_calls(msg: &Value) -> bool {
    msg.get("tool_calls").and_then(Value::as_array).is_some_and(|c| !c.is_empty())
}

fn event(name: &str, data: Value) -> Value {
    json!({"event": name, "data": data})
}

fn block_start(index: usize, block: Value) -> Value {
    event("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": block}))
}

fn block_delta(index: usize, delta: Value) -> Value {
    event("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": delta}))
}

fn block_stop(index: usize) -> Value {
    event("content_block_stop", json!({"type": "content_block_stop", "index": index}))
}

/// Block state across one streamed answer: which blocks were opened.
#[derive(Default)]
struct Blocks {
    thinking: bool,
    text: bool,
}

/// The events for one batch of OpenAI-shaped deltas. `has_reasoning` says whether the
/// message has reasoning at all (it shifts the text block's index); `tool_starts_on_name`
/// is llama-server's partial-chunk rule (a tool block opens when its name arrives).
fn delta_events(deltas: &[Value], blocks: &mut Blocks, has_reasoning: bool, msg: &Value, partial: bool, out: &mut Vec<Value>) {
    let text_index = usize::from(has_reasoning);
    let mut tools_started = std::collections::BTreeSet::new();
    for d in deltas {
        if let Some(r) = d.get("reasoning_content").and_then(Value::as_str) {
            if !blocks.thinking {
                out.push(block_start(0, json!({"type": "thinking", "thinking": ""})));
                blocks.thinking = true;
            }
            out.push(block_delta(0, json!({"type": "thinking_delta", "thinking": r})));
        }
        if let Some(c) = d.get("content").and_then(Value::as_str) {
            if !blocks.text {
                out.push(block_start(text_index, json!({"type": "text", "text": ""})));
                blocks.text = true;
            }
            out.push(block_delta(text_index, json!({"type": "text_delta", "text": c})));
        }
        let Some(call) = d.get("tool_calls").and_then(|t| t.get(0)) else { continue };
        let i = call["index"].as_u64().unwrap_or(0) as usize;
        let has_text = if partial { blocks.text } else { msg.get("content").and_then(Value::as_str).is_some_and(|c| !c.is_empty()) };
        let index = usize::from(has_reasoning) + usize::from(has_text) + i;
        let name = call.pointer("/function/name").and_then(Value::as_str).unwrap_or("");
        let opens = if partial { !name.is_empty() } else { tools_started.insert(i) };
        if opens {
            let (id, name) = if partial {
                (str_of(call, "id").to_string(), name.to_string())
            } else {
                let full = &msg["tool_calls"][i];
                (str_of(full, "id").to_string(), full.pointer("/function/name").and_then(Value::as_str).unwrap_or("").to_string())
            };
            out.push(block_start(index, json!({"type": "tool_use", "id": id, "name": name})));
        }
        if let Some(args) = call.pointer("/function/arguments").and_then(Value::as_str).filter(|a| !a.is_empty()) {
            out.push(block_delta(index, json!({"type": "input_json_delta", "partial_json": args})));
        }
    }
}

fn content_blocks(msg: &Value) -> Vec<Value> {
    let mut blocks = Vec::new();
    if let Some(r) = msg.get("reasoning_content").and_then(Value::as_str).filter(|r| !r.is_empty()) {
        blocks.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if let Some(c) = msg.get("content").and_then(Value::as_str).filter(|c| !c.is_empty()) {
        blocks.push(json!({"type": "text", "text": c}));
    }
    for call in msg.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
        let args = call.pointer("/function/arguments").and_then(Value::as_str).unwrap_or("{}");
        let input: Value = serde_json::from_str(args).unwrap_or(json!({}));
        blocks.push(json!({
            "type": "tool_use",
            "id": str_of(call, "id"),
            "name": call.pointer("/function/name").and_then(Value::as_str).unwrap_or(""),
            "input": input,
        }));
    }
    blocks
}

pub async fn messages(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let model = loaded_model(&app.engine)?;
    let chat = chat_prompt(&app, &model, to_openai(&body)?)?;
    prompt_log::write(&app.info.prompts_log_dir, &json!(chat.prompt));
    let prompt = tokenize_prompts(model.vocab(), &json!(chat.prompt))?.remove(0);
    let mut params = task_params(&app, &model, &chat.task_body)?;
    let id = format!("chatcmpl-{}", random_string());
    params.cmpl_id = id.clone();
    params.n_cmpl = 1;
    let alias = app.engine.model_alias().to_string();
    let rx = app.engine.submit(vec![prompt], params.clone())?;
    let parser = chat.parser;
    let parse = move |text: &str, partial: bool| -> Value {
        parse_chat_message(text, partial, &parser).unwrap_or_else(|_| json!({"role": "assistant", "content": text}))
    };
    if params.stream {
        let (mut text, mut prev, mut ids, mut blocks) = (String::new(), json!({}), Vec::new(), Blocks::default());
        let render = move |ev: &Event| -> Vec<Value> {
            let mut out = Vec::new();
            match ev {
                Event::Partial(p) => {
                    if p.n_decoded == 1 {
                        out.push(event(
                            "message_start",
                            json!({"type": "message_start", "message": {
                                "id": id, "type": "message", "role": "assistant", "content": [], "model": alias,
                                "stop_reason": null, "stop_sequence": null,
                                "usage": {"cache_read_input_tokens": p.n_cached, "input_tokens": p.n_prompt - p.n_cached, "output_tokens": 0},
                            }}),
                        ));
                    }
                    text.push_str(&p.content);
                    let mut msg = parse(&text, true);
                    fill_tool_call_ids(&mut msg, &mut ids);
                    let deltas = chat_msg_diffs(&prev, &msg).unwrap_or_default();
                    let has_reasoning = msg.get("reasoning_content").and_then(Value::as_str).is_some_and(|r| !r.is_empty());
                    delta_events(&deltas, &mut blocks, has_reasoning, &msg, true, &mut out);
                    prev = msg;
                }
                Event::Final(f) => {
                    let mut msg = parse(&text, false);
                    fill_tool_call_ids(&mut msg, &mut ids);
                    let deltas = chat_msg_diffs(&prev, &msg).unwrap_or_default();
                    let has_thinking = msg.get("reasoning_content").and_then(Value::as_str).is_some_and(|r| !r.is_empty());
                    let has_text = msg.get("content").and_then(Value::as_str).is_some_and(|c| !c.is_empty());
                    // As llama-server: the final chunk opens blocks for its own deltas afresh.
                    delta_events(&deltas, &mut Blocks::default(), has_thinking, &msg, false, &mut out);
                    if has_thinking {
                        out.push(block_delta(0, json!({"type": "signature_delta", "signature": ""})));
                        out.push(block_stop(0));
                    }
                    if has_text {
                        out.push(block_stop(usize::from(has_thinking)));
                    }
                    let n_calls = msg.get("tool_calls").and_then(Value::as_array).map_or(0, Vec::len);
                    for i in 0..n_calls {
                        out.push(block_stop(usize::from(has_thinking) + usize::from(has_text) + i));
                    }
                    out.push(event(
                        "message_delta",
                        json!({
                            "type": "message_delta",
                            "delta": {"stop_reason": stop_reason(f, has_calls(&msg)), "stop_sequence": stop_sequence(f)},
                            "usage": {"output_tokens": f.n_decoded},
                        }),
                    ));
                    out.push(event("message_stop", json!({"type": "message_stop"})));
                }
                Event::Begin | Event::Embedding(_) => {}
                Event::Error(e) => out.push(event("error", e.body()["error"].clone())),
            }
            out
        };
        return stream_response(rx, 1, render, Sse::Anthropic, ping_interval(app.info.sse_ping_interval, &body)).await;
    }
    let render = move |ev: &Event| -> Vec<Value> {
        let Event::Final(f) = ev else { return Vec::new() };
        let mut msg = parse(&f.content, false);
        fill_tool_call_ids(&mut msg, &mut Vec::new());
        vec![json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "content": content_blocks(&msg),
            "model": alias,
            "stop_reason": stop_reason(f, has_calls(&msg)),
            "stop_sequence": stop_sequence(f),
            "usage": {
                "cache_read_input_tokens": f.timings.cache_n,
                "input_tokens": f.n_prompt - f.timings.cache_n,
                "output_tokens": f.n_decoded,
            },
        })]
    };
    let mut answer = collect_values(rx, 1, render).await?;
    Ok(Json(answer.remove(0)).into_response())
}

pub async fn count_tokens(AxState(app): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    app.engine.wake().await;
    let model = loaded_model(&app.engine)?;
    let chat = chat_prompt(&app, &model, to_openai(&body)?)?;
    let n = tokenize_prompts(model.vocab(), &json!(chat.prompt))?.remove(0).len();
    Ok(Json(json!({"input_tokens": n})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_system_blocks_tools_and_results() {
        let body = json!({
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}}
                ]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]}]}
            ],
            "tools": [{"name": "weather", "description": "w", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "stop_sequences": ["END"],
        });
        let oai = to_openai(body.as_object().unwrap()).unwrap();
        let m = oai["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[2]["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "t1", "content": "sunny"}));
        assert_eq!(oai["tools"][0]["function"]["parameters"], json!({"type": "object"}));
        assert_eq!(oai["tool_choice"], "required");
        assert_eq!(oai["stop"], json!(["END"]));
        assert_eq!(oai["max_tokens"], 4096);
    }

    #[test]
    fn billing_header_hash_is_masked() {
        let mut s = "x-anthropic-billing-header: v=1; cch=a1b2c; x=2\nYou are helpful.".to_string();
        normalize_billing_header(&mut s);
        assert_eq!(s, "x-anthropic-billing-header: v=1; cch=fffff; x=2\nYou are helpful.");
        let mut other = "plain system text cch=a1b2c;".to_string();
        normalize_billing_header(&mut other);
        assert_eq!(other, "plain system text cch=a1b2c;");
    }
}
