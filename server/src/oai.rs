//! The OpenAI-compatible routes: /v1/completions, /v1/chat/completions and /apply-template,
//! with llama-server's request parsing (oaicompat_*_params_parse) and response shapes.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use strata_ffi::{chat_msg_diffs, parse_chat_message, ChatTemplates, Model};

use crate::engine::{Event, Final};
use crate::error::ApiError;
use crate::generation::StopType;
use crate::http::{
    add_progress, collect_values, final_json, loaded_model, parse_body, probs_json, stream_response, task_params, timings_json, tokenize_prompts, App, Sse,
};
use crate::request;

const ALNUM: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// 32 random alphanumerics, as llama-server's random_string().
pub fn random_string() -> String {
    let mut seed = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        ^ (std::process::id() as u64).rotate_left(32)
        ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed);
    (0..32)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ALNUM[(seed % ALNUM.len() as u64) as usize] as char
        })
        .collect()
}

static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn finish_reason(f: &Final, has_tool_calls: bool) -> &'static str {
    match f.stop {
        StopType::Word | StopType::Eos if has_tool_calls => "tool_calls",
        StopType::Word | StopType::Eos => "stop",
        _ => "length",
    }
}

/// Adds llama-server's debugging `__verbose` (the /completion answer for `prompt`) when asked,
/// then the timings, in upstream's order.
fn with_verbose(verbose: bool, f: &Final, model: &str, prompt: &str, mut v: Value) -> Value {
    if verbose {
        v["__verbose"] = final_json(f, model, prompt);
    }
    v["timings"] = timings_json(&f.timings);
    v
}

fn usage(f: &Final) -> Value {
    json!({
        "completion_tokens": f.n_decoded,
        "prompt_tokens": f.n_prompt,
        "total_tokens": f.n_decoded + f.n_prompt,
        "prompt_tokens_details": {"cached_tokens": f.timings.cache_n},
    })
}

pub async fn completions(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    // llama-server reads /v1/completions as its own /completion (max_tokens and the other OpenAI
    // names are the schema's aliases), only the answer is shaped differently
    let body = parse_body(&body)?;
    let model = loaded_model(&app.engine)?;
    let prompts = tokenize_prompts(model.vocab(), body.at("prompt")?)?;
    let mut params = task_params(&app, &model, &body)?;
    let n = prompts.len() * params.n_cmpl;
    let id = format!("chatcmpl-{}", random_string());
    params.cmpl_id = id.clone();
    let verbose = body.get("verbose").and_then(Value::as_bool).unwrap_or(app.info.verbose);
    params.settings_in_answer = verbose;
    let alias = app.engine.model_alias().to_string();
    let fingerprint = strata_ffi::build_info();
    let rx = app.engine.submit(prompts, params.clone())?;
    let post = params.post_sampling_probs;
    let render = move |ev: &Event| -> Vec<Value> {
        match ev {
            Event::Partial(p) => {
                let mut v = json!({
                    "choices": [{"text": p.content, "index": p.index, "logprobs": null, "finish_reason": null}],
                    "created": now(),
                    "model": alias,
                    "system_fingerprint": fingerprint,
                    "object": "text_completion",
                    "id": id,
                });
                add_progress(&mut v, p);
                vec![v]
            }
            Event::Final(f) => vec![with_verbose(
                verbose,
                f,
                &alias,
                "",
                json!({
                    "choices": [{
                        "text": f.content,
                        "index": f.index,
                        "logprobs": if f.probs.is_empty() { Value::Null } else { json!({"content": probs_json(&f.probs, post)}) },
                        "finish_reason": finish_reason(f, false),
                    }],
                    "created": now(),
                    "model": alias,
                    "system_fingerprint": fingerprint,
                    "object": "text_completion",
                    "usage": usage(f),
                    "id": id,
                }),
            )],
            Event::Begin | Event::Embedding(_) => Vec::new(),
            Event::Error(e) => vec![e.body()],
        }
    };
    if params.stream {
        return stream_response(rx, n, render, Sse::OpenAi).await;
    }
    // several answers become the choices of the first, as llama-server merges them
    let mut results = collect_values(rx, n, render).await?.into_iter();
    let mut answer = results.next().unwrap_or(Value::Null);
    for r in results {
        if let (Some(choices), Some(c)) = (answer["choices"].as_array_mut(), r["choices"].get(0)) {
            choices.push(c.clone());
        }
    }
    Ok(Json(answer).into_response())
}

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
        let ty = p.as_object().map_or(String::new(), |o| request::lenient(o, "type", |v| request::get_str(v).map(String::from), String::new()));
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
    request::lenient(body, key, |v| request::get_str(v).map(String::from), default.to_string())
}

/// llama-server's oaicompat_chat_params_parse: the chat request's checks, in its order and with
/// its statuses (std::invalid_argument and JSON errors are 400, other exceptions 500), the
/// template applied, and the body the completion schema then reads.
pub fn chat_prompt(app: &App, model: &Arc<Model>, mut body: Map<String, Value>) -> Result<ChatPrompt, ApiError> {
    let info = &app.info;
    let tools = body.get("tools").cloned().unwrap_or(Value::Null);
    let has_tools = tools.as_array().is_some_and(|t| !t.is_empty());
    let stream = request::lenient(&body, "stream", request::get_bool, false);
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
    let parallel_tool_calls = request::lenient(&body, "parallel_tool_calls", request::get_bool, parallel_default);
    let mut add_generation_prompt = request::lenient(&body, "add_generation_prompt", request::get_bool, true);
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
        let name = request::get_str(v).map_err(ApiError::invalid)?;
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
            None => return Err(ApiError::invalid(format!("[json.exception.type_error.308] cannot use push_back() with {}", request::type_name(&stop)))),
        }
    }
    task.insert("stop".into(), stop);
    if applied["parser"].as_str().is_some_and(|p| !p.is_empty()) {
        task.insert("chat_parser".into(), applied["parser"].clone());
    }
    task.insert("message_delimiters".into(), applied["message_delimiters"].clone());
    let mut budget =
        request::lenient(&body, "reasoning_budget_tokens", request::get_i32, request::lenient(&body, "thinking_budget_tokens", request::get_i32, -1)) as i64;
    if budget == -1 {
        budget = info.reasoning_budget;
    }
    if applied["thinking_end_tags"].as_array().is_some_and(|t| !t.is_empty()) {
        task.insert("reasoning_budget_tokens".into(), json!(budget));
        task.insert("reasoning_budget_start_tag".into(), applied["thinking_start_tag"].clone());
        task.insert("reasoning_budget_end_tags".into(), applied["thinking_end_tags"].clone());
        task.insert("reasoning_budget_message".into(), json!(lenient_str(&body, "reasoning_budget_message", &info.reasoning_budget_message)));
        task.insert("reasoning_control".into(), json!(request::lenient(&body, "reasoning_control", request::get_bool, false)));
    }
    if request::lenient(&body, "logprobs", request::get_bool, false) {
        if has_tools && stream {
            return Err(ApiError::invalid("logprobs is not supported with tools + stream"));
        }
        task.insert("n_probs".into(), json!(request::lenient(&body, "top_logprobs", request::get_i32, 20)));
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

pub async fn apply_template(AxState(app): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    app.engine.wake().await;
    let model = loaded_model(&app.engine)?;
    let chat = chat_prompt(&app, &model, body.into_map())?;
    Ok(Json(json!({"prompt": chat.prompt})))
}

/// `/v1/chat/completions/control`: acts on a live completion by its id (`reasoning_end` ends its
/// reasoning section now, for completions made with reasoning_control).
pub async fn control(AxState(app): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    let cmpl_id = request::lenient(&body, "id", |v| request::get_str(v).map(String::from), String::new());
    let action = request::lenient(&body, "action", |v| request::get_str(v).map(String::from), String::new());
    if cmpl_id.is_empty() {
        return Err(ApiError::invalid("missing completion id"));
    }
    if action != "reasoning_end" {
        return Err(ApiError::invalid("unknown control action"));
    }
    Ok(Json(app.engine.control(cmpl_id, action).await?))
}

/// How many tokens a chat request's prompt takes (the `input_tokens` routes).
pub async fn chat_input_tokens(AxState(app): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    app.engine.wake().await;
    let model = loaded_model(&app.engine)?;
    let chat = chat_prompt(&app, &model, body.into_map())?;
    let n = tokenize_prompts(model.vocab(), &json!(chat.prompt))?.remove(0).len();
    Ok(Json(json!({"input_tokens": n, "object": "response.input_tokens"})))
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

pub async fn chat_completions(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let model = loaded_model(&app.engine)?;
    let verbose = body.get("verbose").and_then(Value::as_bool).unwrap_or(app.info.verbose);
    let include_usage = body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    let chat = chat_prompt(&app, &model, body.into_map())?;
    let prompt = tokenize_prompts(model.vocab(), &json!(chat.prompt))?.remove(0);
    let mut params = task_params(&app, &model, &chat.task_body)?;
    let n_choices = params.n_cmpl;
    let id = format!("chatcmpl-{}", random_string());
    params.cmpl_id = id.clone();
    params.settings_in_answer = verbose;
    let alias = app.engine.model_alias().to_string();
    let fingerprint = strata_ffi::build_info();
    // __verbose shows the prompt as its tokens read back, as llama-server does.
    let prompt_text = model.vocab().detokenize(&prompt, false, true).map_err(|e| ApiError::server(e.to_string()))?;
    let rx = app.engine.submit(vec![prompt], params.clone())?;
    let parser = chat.parser;
    let parse = move |text: &str, partial: bool| -> Value {
        parse_chat_message(text, partial, &parser).unwrap_or_else(|_| json!({"role": "assistant", "content": text}))
    };
    let chunk = {
        let (id, alias, fingerprint) = (id.clone(), alias.clone(), fingerprint.clone());
        move |choices: Value| json!({"choices": choices, "created": now(), "id": id, "model": alias, "system_fingerprint": fingerprint, "object": "chat.completion.chunk"})
    };
    let post = params.post_sampling_probs;
    if params.stream {
        /// Per choice: the text so far, the message last sent, the tool call ids given out.
        #[derive(Default)]
        struct Choice {
            text: String,
            prev: Value,
            ids: Vec<String>,
        }
        let mut choices: Vec<Choice> = (0..n_choices).map(|_| Choice { prev: json!({}), ..Default::default() }).collect();
        let render = move |ev: &Event| -> Vec<Value> {
            let delta = |index: usize, d: Value| chunk(json!([{"finish_reason": null, "index": index, "delta": d}]));
            match ev {
                Event::Partial(p) => {
                    let c = &mut choices[p.index];
                    let mut out = Vec::new();
                    if p.n_decoded == 1 || p.progress.is_some() {
                        out.push(delta(p.index, json!({"role": "assistant", "content": null})));
                    }
                    c.text.push_str(&p.content);
                    let mut msg = parse(&c.text, true);
                    fill_tool_call_ids(&mut msg, &mut c.ids);
                    out.extend(chat_msg_diffs(&c.prev, &msg).unwrap_or_default().into_iter().map(|d| delta(p.index, d)));
                    c.prev = msg;
                    if let (Some(last), Some(tp)) = (out.last_mut(), &p.probs) {
                        last["choices"][0]["logprobs"] = json!({"content": probs_json(std::slice::from_ref(tp), post)});
                    }
                    if let Some(last) = out.last_mut() {
                        add_progress(last, p);
                    }
                    out
                }
                Event::Final(f) => {
                    let c = &mut choices[f.index];
                    let mut msg = parse(&c.text, false);
                    fill_tool_call_ids(&mut msg, &mut c.ids);
                    let mut out: Vec<Value> = chat_msg_diffs(&c.prev, &msg).unwrap_or_default().into_iter().map(|d| delta(f.index, d)).collect();
                    let has_calls = msg.get("tool_calls").and_then(Value::as_array).is_some_and(|c| !c.is_empty());
                    out.push(chunk(json!([{"finish_reason": finish_reason(f, has_calls), "index": f.index, "delta": {}}])));
                    if include_usage {
                        let mut u = chunk(json!([]));
                        u["usage"] = usage(f);
                        out.push(u);
                    }
                    if let Some(last) = out.last_mut() {
                        last["timings"] = timings_json(&f.timings);
                    }
                    out
                }
                Event::Begin | Event::Embedding(_) => Vec::new(),
                Event::Error(e) => vec![e.body()],
            }
        };
        return stream_response(rx, n_choices, render, Sse::OpenAi).await;
    }
    let render = move |ev: &Event| -> Vec<Value> {
        let Event::Final(f) = ev else { return Vec::new() };
        let mut msg = parse(&f.content, false);
        fill_tool_call_ids(&mut msg, &mut Vec::new());
        let has_calls = msg.get("tool_calls").and_then(Value::as_array).is_some_and(|c| !c.is_empty());
        let mut choice = json!({"finish_reason": finish_reason(f, has_calls), "index": f.index, "message": msg});
        if !f.probs.is_empty() {
            choice["logprobs"] = json!({"content": probs_json(&f.probs, post)});
        }
        let res = json!({
            "choices": [choice],
            "created": now(),
            "model": alias,
            "system_fingerprint": fingerprint,
            "object": "chat.completion",
            "usage": usage(f),
            "id": id,
        });
        vec![with_verbose(verbose, f, &alias, &prompt_text, res)]
    };
    let mut parts = collect_values(rx, n_choices, render).await?;
    let mut merged = parts.remove(0);
    // Several choices are one answer: their choices in order, completion tokens summed.
    for p in parts {
        let add = p["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        merged["choices"].as_array_mut().unwrap().push(p["choices"][0].clone());
        for k in ["completion_tokens", "total_tokens"] {
            merged["usage"][k] = json!(merged["usage"][k].as_u64().unwrap_or(0) + add);
        }
    }
    Ok(Json(merged).into_response())
}
