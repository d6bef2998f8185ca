//! A chat request's prompt: messages, tools and options through the model's chat template, as
//! llama-server's oaicompat_chat_params_parse builds it; every dialect's chat route uses it.

use std::sync::Arc;

use serde_json::{json, Map, Value};
use strata_ffi::{ChatTemplates, Model};

use crate::api::app::App;
use crate::api::error::ApiError;
use crate::api::render::random_string;
use crate::api::request;
use crate::api::values;

/// The chat request turned into a prompt and the parameters that go with it.
pub struct ChatPrompt {
    pub prompt: String,
    pub task_body: Map<String, Value>,
    pub parser: Value,
}

pub fn chat_templates(app: &App, model: &Arc<Model>) -> Result<Arc<ChatTemplates>, ApiError> {
    let t = app.chat.get_or_init(|| {
        let ovr = (!app.info.chat_template.is_empty()).then_some(app.info.chat_template.as_str());
        ChatTemplates::new(model, ovr).map(Arc::new).map_err(|e| e.to_string())
    });
    t.clone().map_err(ApiError::server)
}

/// A message's content parts, checked as llama-server loads their media: without a multimodal
/// projector every media part is refused (500, as upstream), and a part of another type than
/// text is a 400.
fn check_media(parts: &[Value]) -> Result<(), ApiError> {
    for p in parts {
        let ty = p.as_object().map_or(String::new(), |o| values::lenient(o, "type", |v| values::get_str(v).map(String::from), String::new()));
        let what = match ty.as_str() {
            "image_url" => "image",
            "input_audio" => "audio",
            "input_video" | "video_url" => "video",
            "text" => continue,
            _ => return Err(ApiError::invalid("unsupported content[].type")),
        };
        return Err(ApiError::server(format!("{what} input is not supported - hint: if this is unexpected, you may need to provide the mmproj")));
    }
    Ok(())
}

/// A JSON library `json_value(body, key, default)` for a string.
fn lenient_str(body: &Map<String, Value>, key: &str, default: &str) -> String {
    values::lenient(body, key, |v| values::get_str(v).map(String::from), default.to_string())
}

/// llama-server's oaicompat_chat_params_parse: the chat request's checks, in its order and with
/// its statuses (std::invalid_argument and JSON errors are 400, other exceptions 500), the
/// template applied, and the body the completion schema then reads.
pub fn chat_prompt(app: &App, model: &Arc<Model>, mut body: Map<String, Value>) -> Result<ChatPrompt, ApiError> {
    let info = &app.info;
    let tools = body.get("tools").cloned().unwrap_or(Value::Null);
    let has_tools = tools.as_array().is_some_and(|t| !t.is_empty());
    let stream = values::lenient(&body, "stream", values::get_bool, false);
    let tool_choice = lenient_str(&body, "tool_choice", "auto");
    if !info.use_jinja {
        if has_tools {
            return Err(ApiError::server("tools param requires --jinja flag"));
        }
        if tool_choice != "auto" {
            return Err(ApiError::server("tool_choice param requires --jinja flag"));
        }
    }
    let mut stop = match body.get("stop") {
        Some(Value::String(s)) => json!([s]),
        Some(v) if !v.is_null() => v.clone(),
        _ => json!([]),
    };
    let mut json_schema = body.get("json_schema").cloned().unwrap_or(Value::Null);
    let grammar = lenient_str(&body, "grammar", "");
    if !json_schema.is_null() && !grammar.is_empty() {
        return Err(ApiError::server("Cannot use both json_schema and grammar"));
    }
    if body.contains_key("response_format") {
        let rf = match body.get("response_format") {
            Some(v) if !v.is_null() => v.clone(),
            _ => json!({}),
        };
        let empty = Map::new();
        let rf_obj = rf.as_object().unwrap_or(&empty);
        let ty = lenient_str(rf_obj, "type", "");
        let object_at = |o: &Map<String, Value>, k: &str| match o.get(k) {
            Some(v) if !v.is_null() => v.clone(),
            _ => json!({}),
        };
        match ty.as_str() {
            "json_object" => {
                let schema_empty =
                    json_schema.is_null() || json_schema.as_object().is_some_and(Map::is_empty) || json_schema.as_array().is_some_and(Vec::is_empty);
                if rf_obj.contains_key("schema") || schema_empty {
                    json_schema = object_at(rf_obj, "schema");
                }
            }
            "json_schema" => {
                let wrapper = object_at(rf_obj, "json_schema");
                json_schema = object_at(wrapper.as_object().unwrap_or(&empty), "schema");
            }
            "" | "text" => {}
            other => return Err(ApiError::invalid(format!("response_format type must be one of \"text\" or \"json_object\", but got: {other}"))),
        }
    }
    if json_schema.as_object().is_some_and(Map::is_empty) {
        json_schema = json!({"type": "object"});
    }
    let messages = body.get("messages").cloned().ok_or_else(|| ApiError::invalid("'messages' is required"))?;
    let Value::Array(msgs) = &messages else {
        return Err(ApiError::invalid("Expected 'messages' to be an array"));
    };
    for m in msgs {
        let o = m.as_object();
        let has = |k: &str| o.is_some_and(|o| o.contains_key(k));
        let role = o.map_or(String::new(), |o| lenient_str(o, "role", ""));
        if role != "assistant" && !has("content") {
            return Err(ApiError::invalid("All non-assistant messages must contain 'content'"));
        }
        if role == "assistant" {
            if !has("content") && !has("tool_calls") {
                return Err(ApiError::invalid("Assistant message must contain either 'content' or 'tool_calls'!"));
            }
            if !has("content") {
                continue;
            }
        }
        match &m["content"] {
            Value::String(_) | Value::Null => {}
            Value::Array(parts) => check_media(parts)?,
            _ => return Err(ApiError::invalid("Expected 'content' to be a string or an array")),
        }
    }
    let parsed = strata_ffi::parse_chat_inputs(&json!({"messages": messages, "tools": tools, "tool_choice": tool_choice})).map_err(ApiError::from_llama)?;
    let roles: Vec<&str> = parsed["roles"].as_array().map(|r| r.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let tmpls = chat_templates(app, model)?;
    let caps = tmpls.caps().map_err(ApiError::from_llama)?;
    let parallel_default = caps["supports_parallel_tool_calls"].as_bool().unwrap_or(false);
    let parallel_tool_calls = values::lenient(&body, "parallel_tool_calls", values::get_bool, parallel_default);
    let mut add_generation_prompt = values::lenient(&body, "add_generation_prompt", values::get_bool, true);
    let continues = |v: &Value| v.as_bool() == Some(true) || matches!(v.as_str(), Some("content" | "reasoning_content"));
    let mut continue_final = body.get("continue_final_message").cloned().unwrap_or(Value::Bool(false));
    if !continues(&continue_final) && info.prefill_assistant && roles.last() == Some(&"assistant") {
        if roles.len() >= 2 && roles[roles.len() - 2] == "assistant" {
            return Err(ApiError::invalid("Cannot have 2 or more assistant messages at the end of the list."));
        }
        continue_final = Value::Bool(true);
        add_generation_prompt = false;
    }
    if continues(&continue_final) && add_generation_prompt {
        return Err(ApiError::invalid("Cannot set both add_generation_prompt and continue_final_message to true."));
    }
    if continues(&continue_final) && roles.last() == Some(&"assistant") && parsed["last_has_tool_calls"] == json!(true) {
        return Err(ApiError::invalid("Cannot continue an assistant message that contains tool calls."));
    }
    let mut reasoning_format = info.reasoning_format.clone();
    if let Some(v) = body.get("reasoning_format") {
        let name = values::get_str(v).map_err(ApiError::invalid)?;
        if !request::REASONING_FORMATS.contains(&name) {
            return Err(ApiError::server(format!("Unknown reasoning format: {name}")));
        }
        reasoning_format = name.to_string();
    }
    let mut enable_thinking = info.enable_reasoning != 0 && info.use_jinja && tmpls.supports_thinking();
    let tools_apply = parsed["n_tools"].as_u64().unwrap_or(0) > 0 && parsed["tool_choice_none"] != json!(true);
    if tools_apply && body.contains_key("grammar") {
        return Err(ApiError::invalid("Cannot use custom grammar constraints with tools."));
    }
    // the server's --chat-template-kwargs under the request's own, each as JSON text
    let mut kwargs: Map<String, Value> = info.default_template_kwargs.clone();
    let asked = match body.get("chat_template_kwargs") {
        Some(v) if !v.is_null() => v.clone(),
        _ => json!({}),
    };
    for (k, v) in kwarg_items(&asked) {
        kwargs.insert(k, Value::String(v.to_string()));
    }
    match kwargs.get("enable_thinking").and_then(Value::as_str) {
        Some("true") => enable_thinking = true,
        Some("false") => enable_thinking = false,
        Some(s) if s.starts_with('"') => return Err(ApiError::invalid("invalid type for \"enable_thinking\" (expected boolean, got string)")),
        _ => {}
    }
    if body.contains_key("reasoning_effort") {
        let effort = lenient_str(&body, "reasoning_effort", "");
        if effort == "none" {
            enable_thinking = false;
            kwargs.remove("reasoning_effort");
        } else if !effort.is_empty() {
            kwargs.insert("reasoning_effort".into(), Value::String(json!(effort).to_string()));
        }
    }
    // the shim takes the kwargs as JSON values and writes them back as text
    let kwargs_values: Map<String, Value> =
        kwargs.iter().map(|(k, v)| (k.clone(), v.as_str().and_then(|t| serde_json::from_str(t).ok()).unwrap_or(Value::Null))).collect();
    let inputs = json!({
        "messages": messages,
        "tools": tools,
        "tool_choice": tool_choice,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
        "use_jinja": info.use_jinja,
        "enable_thinking": enable_thinking,
        "reasoning_format": reasoning_format,
        "parallel_tool_calls": parallel_tool_calls,
        "json_schema": if json_schema.is_null() { String::new() } else { json_schema.to_string() },
        "grammar": grammar,
        "chat_template_kwargs": kwargs_values,
        "force_pure_content": info.force_pure_content,
    });
    let applied = tmpls.apply(&inputs).map_err(ApiError::from_llama)?;

    let mut task = Map::new();
    if tools_apply {
        task.insert("parse_tool_calls".into(), json!(true));
    }
    task.insert("chat_format".into(), applied["format"].clone());
    task.insert("prompt".into(), applied["prompt"].clone());
    if let Some(g) = applied["grammar"].as_str().filter(|g| !g.is_empty()) {
        task.insert("grammar".into(), json!(g));
        task.insert("grammar_type".into(), json!("tool_calls"));
    }
    task.insert("grammar_lazy".into(), applied["grammar_lazy"].clone());
    let triggers: Vec<Value> = applied["grammar_triggers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| match t["type"].as_i64() {
            Some(request::TRIGGER_TOKEN) => json!({"type": t["type"], "value": t["value"], "token": t["token"]}),
            _ => json!({"type": t["type"], "value": t["value"]}),
        })
        .collect();
    task.insert("grammar_triggers".into(), Value::Array(triggers));
    task.insert("preserved_tokens".into(), applied["preserved_tokens"].clone());
    task.insert("generation_prompt".into(), applied["generation_prompt"].clone());
    let additional = applied["additional_stops"].as_array().cloned().unwrap_or_default();
    if !additional.is_empty() {
        match stop.as_array_mut() {
            Some(list) => list.extend(additional),
            None => return Err(ApiError::invalid(format!("[json.exception.type_error.308] cannot use push_back() with {}", values::type_name(&stop)))),
        }
    }
    task.insert("stop".into(), stop);
    if applied["parser"].as_str().is_some_and(|p| !p.is_empty()) {
        task.insert("chat_parser".into(), applied["parser"].clone());
    }
    task.insert("message_delimiters".into(), applied["message_delimiters"].clone());
    let mut budget =
        values::lenient(&body, "reasoning_budget_tokens", values::get_i32, values::lenient(&body, "thinking_budget_tokens", values::get_i32, -1)) as i64;
    if budget == -1 {
        budget = info.reasoning_budget;
    }
    if applied["thinking_end_tags"].as_array().is_some_and(|t| !t.is_empty()) {
        task.insert("reasoning_budget_tokens".into(), json!(budget));
        task.insert("reasoning_budget_start_tag".into(), applied["thinking_start_tag"].clone());
        task.insert("reasoning_budget_end_tags".into(), applied["thinking_end_tags"].clone());
        task.insert("reasoning_budget_message".into(), json!(lenient_str(&body, "reasoning_budget_message", &info.reasoning_budget_message)));
        task.insert("reasoning_control".into(), json!(values::lenient(&body, "reasoning_control", values::get_bool, false)));
    }
    if values::lenient(&body, "logprobs", values::get_bool, false) {
        if has_tools && stream {
            return Err(ApiError::invalid("logprobs is not supported with tools + stream"));
        }
        task.insert("n_probs".into(), json!(values::lenient(&body, "top_logprobs", values::get_i32, 20)));
    } else if body.get("top_logprobs").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid("top_logprobs requires logprobs to be set to true"));
    }
    // every other field goes through as given, for the completion schema (n_predict wins over
    // what was set from max_tokens)
    for (k, v) in std::mem::take(&mut body) {
        if !task.contains_key(&k) || k == "n_predict" {
            task.insert(k, v);
        }
    }
    let parser = json!({
        "format": applied["format"],
        "reasoning_format": reasoning_format,
        "generation_prompt": applied["generation_prompt"],
        "parse_tool_calls": tools_apply,
        "parser": applied["parser"],
    });
    Ok(ChatPrompt { prompt: applied["prompt"].as_str().unwrap_or_default().to_string(), task_body: task, parser })
}

/// What iterating `items()` gives in the JSON library: an object's entries, an array's
/// elements keyed by index, a scalar once under "".
fn kwarg_items(v: &Value) -> Vec<(String, Value)> {
    match v {
        Value::Object(o) => o.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        Value::Array(a) => a.iter().enumerate().map(|(i, v)| (i.to_string(), v.clone())).collect(),
        Value::Null => Vec::new(),
        other => vec![(String::new(), other.clone())],
    }
}

/// Gives tool calls without an id one, and keeps ids stable across stream updates.
pub fn fill_tool_call_ids(msg: &mut Value, ids: &mut Vec<String>) {
    let Some(calls) = msg.get_mut("tool_calls").and_then(Value::as_array_mut) else { return };
    for (i, call) in calls.iter_mut().enumerate() {
        if ids.len() <= i {
            ids.push(call.get("id").and_then(Value::as_str).filter(|s| !s.is_empty()).map_or_else(random_string, String::from));
        }
        call["id"] = json!(ids[i]);
    }
}
