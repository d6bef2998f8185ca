//! The OpenAI Responses API (`/v1/responses`, `/v1/responses/input_tokens`), as llama-server
//! offers it: the request becomes a chat completion request, the answer comes back as a
//! `response` object or as its stream of named events.

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
use crate::api::render::{add_progress, collect_values, timings_json};
use crate::api::render::{now, random_string};
use crate::api::sse::{ping_interval, stream_response, Sse};
use crate::engine::{Event, Final, Partial};

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn text_part(text: &Value) -> Value {
    json!({"text": text, "type": "text"})
}

/// A user, system or developer message's content parts in chat form.
fn input_parts(parts: &[Value]) -> Result<Vec<Value>, ApiError> {
    parts
        .iter()
        .map(|part| match str_of(part, "type").unwrap_or("") {
            "input_text" => part.get("text").map(text_part).ok_or_else(|| ApiError::invalid("'Input text' requires 'text'")),
            "input_image" => part
                .get("image_url")
                .map(|url| json!({"image_url": {"url": url}, "type": "image_url"}))
                .ok_or_else(|| ApiError::invalid("'image_url' is required")),
            "input_file" => Err(ApiError::invalid("'input_file' is not supported by llamacpp at this moment")),
            _ => Err(ApiError::invalid("'type' must be one of 'input_text', 'input_image', or 'input_file'")),
        })
        .collect()
}

/// An assistant output message's content parts in chat form.
fn output_parts(parts: &[Value]) -> Result<Vec<Value>, ApiError> {
    parts
        .iter()
        .map(|part| match str_of(part, "type").unwrap_or("") {
            "output_text" | "input_text" => {
                str_of(part, "text").map(|t| text_part(&json!(t))).ok_or_else(|| ApiError::invalid("'Output text' requires 'text'"))
            }
            "refusal" => {
                str_of(part, "refusal").map(|r| json!({"refusal": r, "type": "refusal"})).ok_or_else(|| ApiError::invalid("'Refusal' requires 'refusal'"))
            }
            _ => Err(ApiError::invalid("'type' must be one of 'output_text' or 'refusal'")),
        })
        .collect()
}

/// A function_call_output's array output in chat form.
fn tool_output_parts(parts: &[Value]) -> Result<Vec<Value>, ApiError> {
    parts
        .iter()
        .map(|part| {
            let mut part = part.clone();
            match part.get("type").ok_or_else(|| ApiError::invalid("Output of tool call missing 'type' field"))?.as_str() {
                Some("input_text") => part["type"] = json!("text"),
                Some("input_image") => {
                    let url = part.get("image_url").cloned().ok_or_else(|| ApiError::invalid("'image_url' is required"))?;
                    part["type"] = json!("image_url");
                    part["image_url"] = json!({"url": url});
                }
                _ => return Err(ApiError::invalid("Output of tool call should be 'Input text' or 'Input image'")),
            }
            Ok(part)
        })
        .collect()
}

/// One input item as chat messages: appended, or merged into the assistant message before it.
fn push_item(messages: &mut Vec<Value>, mut item: Value) -> Result<(), ApiError> {
    let merge_prev = messages.last().is_some_and(|m| str_of(m, "role") == Some("assistant"));
    if let Some(Value::String(s)) = item.get("content") {
        item["content"] = json!([{"text": s, "type": "input_text"}]);
    }
    let role = str_of(&item, "role").unwrap_or("").to_string();
    let ty = str_of(&item, "type").unwrap_or("").to_string();
    let has_str = |k: &str| str_of(&item, k).is_some();

    if let (Some(Value::Array(parts)), "user" | "system" | "developer") = (item.get("content"), role.as_str()) {
        let content = input_parts(parts)?;
        let obj = item.as_object_mut().expect("an item with content is an object");
        obj.remove("type");
        obj.remove("status");
        obj.insert("content".into(), Value::Array(content));
        messages.push(item);
    } else if role == "assistant" && ty == "message" {
        let content = match item.get("content") {
            Some(Value::Array(parts)) => output_parts(parts)?,
            _ => Vec::new(),
        };
        match messages.last_mut() {
            Some(prev) if merge_prev => {
                if !prev.get("content").is_some_and(Value::is_array) {
                    prev["content"] = json!([]);
                }
                prev["content"].as_array_mut().expect("set to an array above").extend(content);
            }
            _ => {
                let obj = item.as_object_mut().expect("an item with a role is an object");
                obj.remove("status");
                obj.remove("type");
                obj.insert("content".into(), Value::Array(content));
                messages.push(item);
            }
        }
    } else if ty == "function_call" && has_str("arguments") && has_str("call_id") && has_str("name") {
        let call = json!({
            "function": {"arguments": item["arguments"], "name": item["name"]},
            "id": item["call_id"],
            "type": "function",
        });
        match messages.last_mut() {
            Some(prev) if merge_prev => {
                if !prev.get("tool_calls").is_some_and(Value::is_array) {
                    prev["tool_calls"] = json!([]);
                }
                prev["tool_calls"].as_array_mut().expect("set to an array above").push(call);
            }
            _ => messages.push(json!({"role": "assistant", "tool_calls": [call]})),
        }
    } else if ty == "function_call_output" && has_str("call_id") && matches!(item.get("output"), Some(Value::String(_) | Value::Array(_))) {
        let content = match &item["output"] {
            Value::Array(parts) => Value::Array(tool_output_parts(parts)?),
            s => s.clone(),
        };
        messages.push(json!({"content": content, "role": "tool", "tool_call_id": item["call_id"]}));
    } else if ty == "reasoning" && item.get("summary").is_some_and(Value::is_array) {
        let Some(Value::Array(content)) = item.get("content") else {
            return Err(ApiError::invalid("item['content'] is not an array"));
        };
        let first = content.first().ok_or_else(|| ApiError::invalid("item['content'] is empty"))?;
        let text = str_of(first, "text").ok_or_else(|| ApiError::invalid("item['content']['text'] is not a string"))?;
        match messages.last_mut() {
            Some(prev) if merge_prev => prev["reasoning_content"] = json!(text),
            _ => messages.push(json!({"role": "assistant", "content": [], "reasoning_content": text})),
        }
    } else {
        return Err(ApiError::invalid("Cannot determine type of 'item'"));
    }
    Ok(())
}

/// llama-server's server_chat_convert_responses_to_chatcmpl: the Responses request as a chat
/// completion request.
pub fn to_chat(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let input = body.get("input").ok_or_else(|| ApiError::invalid("'input' is required"))?;
    if body.get("previous_response_id").and_then(Value::as_str).is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("llama.cpp does not support 'previous_response_id'."));
    }
    let mut out = body.clone();
    out.remove("input");
    let mut messages = Vec::new();
    if let Some(instructions) = out.remove("instructions") {
        messages.push(json!({"role": "system", "content": instructions.as_str().unwrap_or("")}));
    }
    match input {
        Value::String(_) => messages.push(json!({"role": "user", "content": input})),
        Value::Array(items) => {
            for item in items {
                push_item(&mut messages, item.clone())?;
            }
        }
        _ => return Err(ApiError::invalid("'input' must be a string or array of objects")),
    }
    out.insert("messages".into(), Value::Array(messages));

    if let Some(tools) = out.remove("tools") {
        let Value::Array(tools) = tools else {
            return Err(ApiError::invalid("'tools' must be an array of objects"));
        };
        // Built-in tools (web_search, mcp, ...) have no chat completions equivalent.
        let tools: Vec<Value> = tools
            .into_iter()
            .filter(|t| str_of(t, "type") == Some("function"))
            .map(|mut t| {
                let f = t.as_object_mut().expect("a typed tool is an object");
                f.remove("type");
                f.entry("strict").or_insert(json!(true));
                json!({"type": "function", "function": t})
            })
            .collect();
        if !tools.is_empty() {
            out.insert("tools".into(), Value::Array(tools));
        }
    }
    if let Some(max) = out.remove("max_output_tokens") {
        out.insert("max_tokens".into(), max);
    }
    if let Some(reasoning) = out.remove("reasoning") {
        if let Some(effort) = reasoning.get("effort") {
            out.insert("reasoning_effort".into(), effort.clone());
        }
    }
    Ok(out)
}

/// A named stream event; its data starts with its `type`, as llama-server writes it.
fn event(name: &str, data: Value) -> Value {
    let mut d = Map::new();
    d.insert("type".into(), json!(name));
    if let Value::Object(fields) = data {
        d.extend(fields);
    }
    json!({"event": name, "data": d})
}

fn str_field<'a>(msg: &'a Value, key: &str) -> &'a str {
    str_of(msg, key).unwrap_or("")
}

fn tool_calls(msg: &Value) -> &[Value] {
    msg.get("tool_calls").and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

fn function_call_item(call: &Value, status: &str) -> Value {
    let id = str_field(call, "id");
    json!({
        "id": format!("fc_{id}"),
        "type": "function_call",
        "status": status,
        "arguments": call.pointer("/function/arguments").and_then(Value::as_str).unwrap_or(""),
        "call_id": format!("call_{id}"),
        "name": call.pointer("/function/name").and_then(Value::as_str).unwrap_or(""),
    })
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "annotations": [], "logprobs": [], "text": text})
}

fn usage(f: &Final) -> Value {
    json!({
        "input_tokens": f.n_prompt,
        "output_tokens": f.n_decoded,
        "total_tokens": f.n_decoded + f.n_prompt,
        "input_tokens_details": {"cached_tokens": f.timings.cache_n},
    })
}

/// The non-streamed answer: one `response` object.
fn response_json(f: &Final, msg: &Value, resp_id: &str, model: &str) -> Value {
    let mut output = Vec::new();
    let reasoning = str_field(msg, "reasoning_content");
    if !reasoning.is_empty() {
        output.push(json!({
            "id": format!("rs_{}", random_string()),
            "summary": [],
            "type": "reasoning",
            "content": [{"text": reasoning, "type": "reasoning_text"}],
            "encrypted_content": "",
            "status": "completed",
        }));
    }
    let calls = tool_calls(msg);
    // A message the parser found nothing in is the raw generated text.
    let content = match str_field(msg, "content") {
        "" if reasoning.is_empty() && calls.is_empty() => f.content.as_str(),
        c => c,
    };
    if !content.is_empty() {
        output.push(json!({
            "content": [output_text(content)],
            "id": format!("msg_{}", random_string()),
            "role": str_of(msg, "role").unwrap_or("assistant"),
            "status": "completed",
            "type": "message",
        }));
    }
    output.extend(calls.iter().map(|c| function_call_item(c, "completed")));
    let t = now();
    json!({
        "completed_at": t,
        "created_at": t,
        "id": resp_id,
        "model": model,
        "object": "response",
        "output": output,
        "status": "completed",
        "usage": usage(f),
    })
}

/// One streamed answer's ids and what its events have opened so far.
struct Stream {
    resp_id: String,
    reasoning_id: String,
    message_id: String,
    model: String,
    created: bool,
    reasoning_started: bool,
    text_started: bool,
    /// The function call whose arguments are streaming.
    fc_id: String,
    text: String,
    prev: Value,
    call_ids: Vec<String>,
}

impl Stream {
    fn new(resp_id: String, model: String) -> Self {
        Stream {
            resp_id,
            reasoning_id: format!("rs_{}", random_string()),
            message_id: format!("msg_{}", random_string()),
            model,
            created: false,
            reasoning_started: false,
            text_started: false,
            fc_id: String::new(),
            text: String::new(),
            prev: json!({}),
            call_ids: Vec::new(),
        }
    }

    fn in_progress(&self, name: &str) -> Value {
        event(name, json!({"response": {"id": self.resp_id, "object": "response", "status": "in_progress"}}))
    }

    fn partial(&mut self, p: &Partial, msg: Value) -> Vec<Value> {
        let mut out = Vec::new();
        if !self.created {
            out.push(self.in_progress("response.created"));
            out.push(self.in_progress("response.in_progress"));
            self.created = p.progress.is_some() || p.n_decoded == 1;
        } else if p.progress.is_some() {
            out.push(self.in_progress("response.in_progress"));
        }
        for d in chat_msg_diffs(&self.prev, &msg).unwrap_or_default() {
            if let Some(r) = str_of(&d, "reasoning_content") {
                if !self.reasoning_started {
                    self.reasoning_started = true;
                    out.push(event(
                        "response.output_item.added",
                        json!({"item": {
                            "id": self.reasoning_id, "summary": [], "type": "reasoning", "content": [],
                            "encrypted_content": "", "status": "in_progress",
                        }}),
                    ));
                }
                out.push(event("response.reasoning_text.delta", json!({"delta": r, "item_id": self.reasoning_id})));
            }
            if let Some(c) = str_of(&d, "content") {
                if !self.text_started {
                    self.text_started = true;
                    out.push(event(
                        "response.output_item.added",
                        json!({"item": {
                            "content": [], "id": self.message_id, "role": "assistant", "status": "in_progress", "type": "message",
                        }}),
                    ));
                    out.push(event(
                        "response.content_part.added",
                        json!({
                            "item_id": self.message_id, "part": {"type": "output_text", "text": ""},
                        }),
                    ));
                }
                out.push(event("response.output_text.delta", json!({"item_id": self.message_id, "delta": c})));
            }
            let Some(call) = d.pointer("/tool_calls/0") else { continue };
            if call.pointer("/function/name").and_then(Value::as_str).is_some_and(|n| !n.is_empty()) {
                out.push(event("response.output_item.added", json!({"item": function_call_item(call, "in_progress")})));
                self.fc_id = str_field(call, "id").to_string();
            }
            if let Some(args) = call.pointer("/function/arguments").and_then(Value::as_str).filter(|a| !a.is_empty()) {
                out.push(event("response.function_call_arguments.delta", json!({"delta": args, "item_id": format!("fc_{}", self.fc_id)})));
            }
        }
        self.prev = msg;
        if let Some(last) = out.last_mut() {
            add_progress(&mut last["data"], p);
        }
        out
    }

    fn finish(&self, f: &Final, msg: &Value) -> Vec<Value> {
        let (mut out, mut output) = (Vec::new(), Vec::new());
        let reasoning = str_field(msg, "reasoning_content");
        if !reasoning.is_empty() {
            let item = json!({
                "id": self.reasoning_id, "summary": [], "type": "reasoning",
                "content": [{"text": reasoning, "type": "reasoning_text"}], "encrypted_content": "",
            });
            out.push(event("response.output_item.done", json!({"item": item})));
            output.push(item);
        }
        let content = str_field(msg, "content");
        if !content.is_empty() {
            let part = output_text(content);
            out.push(event("response.output_text.done", json!({"item_id": self.message_id, "text": content})));
            out.push(event("response.content_part.done", json!({"item_id": self.message_id, "part": part})));
            let item = json!({"type": "message", "status": "completed", "id": self.message_id, "content": [part], "role": "assistant"});
            out.push(event("response.output_item.done", json!({"item": item})));
            output.push(item);
        }
        for call in tool_calls(msg) {
            let item = function_call_item(call, "completed");
            out.push(event("response.output_item.done", json!({"item": item})));
            output.push(item);
        }
        let mut done = event(
            "response.completed",
            json!({"response": {
                "id": self.resp_id, "object": "response", "created_at": now(), "status": "completed",
                "model": self.model, "output": output, "usage": usage(f),
            }}),
        );
        done["data"]["timings"] = timings_json(&f.timings);
        out.push(done);
        out
    }
}

pub async fn responses(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let model = loaded_model(&app.engine)?;
    let chat = chat_prompt(&app, &model, to_chat(&body)?)?;
    prompt_log::write(&app.info.prompts_log_dir, &json!(chat.prompt));
    let prompt = tokenize_prompts(model.vocab(), &json!(chat.prompt))?.remove(0);
    let mut params = task_params(&app, &model, &chat.task_body)?;
    let alias = app.engine.model_alias().to_string();
    let resp_id = format!("resp_{}", random_string());
    params.cmpl_id = resp_id.clone();
    params.n_cmpl = 1;
    let rx = app.engine.submit(vec![prompt], params.clone())?;
    let parser = chat.parser;
    let parse = move |text: &str, partial: bool, ids: &mut Vec<String>| -> Value {
        let mut msg = parse_chat_message(text, partial, &parser).unwrap_or_else(|_| json!({"role": "assistant", "content": text}));
        fill_tool_call_ids(&mut msg, ids);
        msg
    };
    if params.stream {
        let mut s = Stream::new(resp_id, alias);
        let render = move |ev: &Event| -> Vec<Value> {
            match ev {
                Event::Partial(p) => {
                    s.text.push_str(&p.content);
                    let msg = parse(&s.text, true, &mut s.call_ids);
                    s.partial(p, msg)
                }
                Event::Final(f) => {
                    let msg = parse(&s.text, false, &mut s.call_ids);
                    s.finish(f, &msg)
                }
                Event::Begin | Event::Error(_) | Event::Embedding(_) => Vec::new(),
            }
        };
        return stream_response(rx, 1, render, Sse::Responses, ping_interval(app.info.sse_ping_interval, &body)).await;
    }
    let render = move |ev: &Event| -> Vec<Value> {
        let Event::Final(f) = ev else { return Vec::new() };
        let msg = parse(&f.content, false, &mut Vec::new());
        vec![response_json(f, &msg, &resp_id, &alias)]
    };
    let mut answer = collect_values(rx, 1, render).await?;
    Ok(Json(answer.remove(0)).into_response())
}

/// How many tokens a Responses request's prompt takes.
pub async fn input_tokens(AxState(app): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    app.engine.wake().await;
    let model = loaded_model(&app.engine)?;
    let chat = chat_prompt(&app, &model, to_chat(&body)?)?;
    let n = tokenize_prompts(model.vocab(), &json!(chat.prompt))?.remove(0).len();
    Ok(Json(json!({"input_tokens": n, "object": "response.input_tokens"})))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::generation::StopType;
    use crate::engine::{Progress, Timings};

    fn convert(body: Value) -> Result<Map<String, Value>, ApiError> {
        to_chat(body.as_object().unwrap())
    }

    #[test]
    fn function_call_round_trip_becomes_chat_messages() {
        let chat = convert(json!({
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
                {"type": "message", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "warm"}]},
            ],
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}, {"type": "web_search"}],
            "max_output_tokens": 16,
            "reasoning": {"effort": "low"},
        }))
        .unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"text": "Weather in Paris?", "type": "text"}]},
                {"role": "assistant", "content": [{"text": "Checking.", "type": "text"}], "reasoning_content": "look it up",
                 "tool_calls": [{"function": {"arguments": "{\"city\":\"Paris\"}", "name": "weather"}, "id": "c1", "type": "function"}]},
                {"content": "sunny", "role": "tool", "tool_call_id": "c1"},
                {"content": [{"type": "text", "text": "warm"}], "role": "tool", "tool_call_id": "c1"},
            ])
        );
        assert_eq!(chat["tools"], json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "strict": true}}]));
        assert_eq!(chat["max_tokens"], 16);
        assert_eq!(chat["reasoning_effort"], "low");
        for gone in ["input", "instructions", "max_output_tokens", "reasoning"] {
            assert!(!chat.contains_key(gone), "{gone}");
        }
        assert_eq!(chat["model"], "m");
    }

    #[test]
    fn unconvertible_input_is_a_400() {
        for (body, message) in [
            (json!({}), "'input' is required"),
            (json!({"input": 1}), "'input' must be a string or array of objects"),
            (json!({"input": "x", "previous_response_id": "resp_1"}), "llama.cpp does not support 'previous_response_id'."),
            (json!({"input": [{"role": "assistant", "content": "no type"}]}), "Cannot determine type of 'item'"),
            (json!({"input": "x", "tools": {}}), "'tools' must be an array of objects"),
        ] {
            let e = convert(body).unwrap_err();
            assert_eq!((e.kind, e.message.as_str()), (crate::api::error::ErrorType::InvalidRequest, message));
        }
    }

    fn partial(n_decoded: usize, progress: bool) -> Partial {
        Partial {
            index: 0,
            content: String::new(),
            tokens: Vec::new(),
            n_decoded,
            n_prompt: 4,
            n_cached: 0,
            probs: None,
            timings: None,
            progress: progress.then_some(Progress { total: 4, cache: 0, processed: 4, time_ms: 1 }),
        }
    }

    fn names(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["event"].as_str().unwrap()).collect()
    }

    #[test]
    fn stream_opens_each_item_once_and_closes_them_in_order() {
        let mut s = Stream::new("resp_1".into(), "m".into());
        let call = |args: &str| json!([{"id": "abc", "type": "function", "function": {"name": "weather", "arguments": args}}]);
        let progress = s.partial(&partial(0, true), json!({"role": "assistant", "content": null}));
        assert_eq!(names(&progress), ["response.created", "response.in_progress"]);
        assert_eq!(progress[1]["data"]["prompt_progress"]["total"], 4);

        let first = s.partial(&partial(1, false), json!({"role": "assistant", "content": null, "reasoning_content": "Hm"}));
        assert_eq!(names(&first), ["response.output_item.added", "response.reasoning_text.delta"]);
        let text = s.partial(&partial(2, false), json!({"role": "assistant", "reasoning_content": "Hm", "content": "Hi"}));
        assert_eq!(names(&text), ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]);
        let calls = s.partial(&partial(3, false), json!({"role": "assistant", "reasoning_content": "Hm", "content": "Hi", "tool_calls": call("{\"ci")}));
        assert_eq!(names(&calls), ["response.output_item.added", "response.function_call_arguments.delta"]);
        assert_eq!(calls[0]["data"]["item"]["call_id"], "call_abc");
        assert_eq!(calls[1]["data"]["item_id"], "fc_abc");

        let full = json!({"role": "assistant", "reasoning_content": "Hm", "content": "Hi", "tool_calls": call("{\"city\":1}")});
        let f = Final {
            index: 0,
            content: String::new(),
            tokens: Vec::new(),
            id_slot: 0,
            n_decoded: 5,
            n_prompt: 4,
            stop: StopType::Eos,
            stopping_word: String::new(),
            truncated: false,
            has_new_line: false,
            timings: Timings { cache_n: 1, ..Default::default() },
            probs: Vec::new(),
            settings: Default::default(),
        };
        let done = s.finish(&f, &full);
        assert_eq!(
            names(&done),
            [
                "response.output_item.done",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let completed = &done[5]["data"];
        assert_eq!(
            completed["response"]["usage"],
            json!({"input_tokens": 4, "output_tokens": 5, "total_tokens": 9, "input_tokens_details": {"cached_tokens": 1}})
        );
        assert_eq!(completed["response"]["output"][2]["arguments"], "{\"city\":1}");
        assert!(completed["timings"].is_object());
    }
}
