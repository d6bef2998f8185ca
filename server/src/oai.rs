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
use crate::http::{add_progress, 
    collect, collect_values, final_json, loaded_model, parse_body, probs_json, stream_response, task_params, timings_json,
    tokenize_prompts, App, Sse,
};

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

/// The fields both OAI routes reject or rewrite before the common parsing.
fn oai_common(body: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(Value::String(s)) = body.get("stop") {
        let s = s.clone();
        body.insert("stop".into(), json!([s]));
    }
    if !body.contains_key("n_predict") {
        if let Some(v) = body.get("max_completion_tokens").or_else(|| body.get("max_tokens")).cloned() {
            body.insert("n_predict".into(), v);
        }
    }
    Ok(())
}

pub async fn completions(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    let mut body = parse_body(&body)?;
    let model = loaded_model(&app.engine)?;
    let prompt = body.get("prompt").cloned().ok_or_else(|| ApiError::server("\"prompt\" is required"))?;
    if body.get("echo").and_then(Value::as_bool).unwrap_or(false) {
        return Err(ApiError::server("Only no echo is supported"));
    }
    for p in ["best_of", "suffix"] {
        if body.contains_key(p) {
            return Err(ApiError::server(format!("Unsupported param: {p}")));
        }
    }
    oai_common(&mut body)?;
    let prompts = tokenize_prompts(model.vocab(), &prompt)?;
    let params = task_params(&body, Some(model.vocab()), &app.eog(&model), app.info.n_keep)?;
    let n = prompts.len();
    let id = format!("chatcmpl-{}", random_string());
    let alias = app.engine.model_alias().to_string();
    let fingerprint = strata_ffi::build_info();
    let rx = app.engine.submit(prompts, params.clone())?;
    let post = params.post_sampling_probs;
    let verbose = body.get("verbose").and_then(Value::as_bool).unwrap_or(app.info.verbose);
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
            Event::Final(f) => vec![with_verbose(verbose, f, &alias, "", json!({
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
            }))],
            Event::Embedding(_) => Vec::new(),
            Event::Error(e) => vec![e.body()],
        }
    };
    if params.stream {
        return stream_response(rx, n, render, Sse::OpenAi).await;
    }
    collect(rx, n, render).await
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

/// Media parts need a multimodal projector, which strata-server does not load yet: the same
/// refusals llama-server gives without one.
fn check_media(parts: &[Value]) -> Result<(), ApiError> {
    for p in parts {
        let what = match p.get("type").and_then(Value::as_str) {
            Some("image_url") => "image",
            Some("input_audio") => "audio",
            Some("input_video" | "video_url") => "video",
            _ => continue,
        };
        return Err(ApiError::server(format!(
            "{what} input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
        )));
    }
    Ok(())
}

pub fn chat_prompt(app: &App, model: &Arc<Model>, mut body: Map<String, Value>) -> Result<ChatPrompt, ApiError> {
    let info = &app.info;
    let tools = body.get("tools").cloned().unwrap_or(Value::Null);
    let has_tools = tools.as_array().is_some_and(|t| !t.is_empty());
    let tool_choice = body.get("tool_choice").and_then(Value::as_str).unwrap_or("auto").to_string();
    if !info.use_jinja {
        if has_tools {
            return Err(ApiError::server("tools param requires --jinja flag"));
        }
        if tool_choice != "auto" {
            return Err(ApiError::server("tool_choice param requires --jinja flag"));
        }
    }
    oai_common(&mut body)?;
    let mut json_schema = body.get("json_schema").cloned().unwrap_or(Value::Null);
    let grammar = body.get("grammar").and_then(Value::as_str).unwrap_or("").to_string();
    if !json_schema.is_null() && !grammar.is_empty() {
        return Err(ApiError::server("Cannot use both json_schema and grammar"));
    }
    if let Some(rf) = body.get("response_format") {
        let ty = rf.get("type").and_then(Value::as_str).unwrap_or("");
        match ty {
            "json_object" => {
                if rf.get("schema").is_some() || json_schema.is_null() {
                    json_schema = rf.get("schema").cloned().unwrap_or(json!({}));
                }
            }
            "json_schema" => json_schema = rf.get("json_schema").and_then(|w| w.get("schema")).cloned().unwrap_or(json!({})),
            "" | "text" => {}
            other => {
                return Err(ApiError::invalid(format!(
                    "response_format type must be one of \"text\" or \"json_object\", but got: {other}"
                )))
            }
        }
    }
    if json_schema.as_object().is_some_and(Map::is_empty) {
        json_schema = json!({"type": "object"});
    }
    let messages = body.get("messages").ok_or_else(|| ApiError::invalid("'messages' is required"))?;
    let Value::Array(msgs) = messages else {
        return Err(ApiError::invalid("Expected 'messages' to be an array"));
    };
    for m in msgs {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if role != "assistant" && m.get("content").is_none() {
            return Err(ApiError::invalid("All non-assistant messages must contain 'content'"));
        }
        if role == "assistant" && m.get("content").is_none() && m.get("tool_calls").is_none() {
            return Err(ApiError::invalid("Assistant message must contain either 'content' or 'tool_calls'!"));
        }
        match m.get("content") {
            None | Some(Value::String(_) | Value::Null) => {}
            Some(Value::Array(parts)) => check_media(parts)?,
            Some(_) => return Err(ApiError::invalid("Expected 'content' to be a string or an array")),
        }
    }
    let mut add_generation_prompt = body.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true);
    let mut continue_final = body.get("continue_final_message").cloned().unwrap_or(Value::Bool(false));
    let continues = |v: &Value| v.as_bool().unwrap_or(false) || matches!(v.as_str(), Some("content" | "reasoning_content"));
    if !continues(&continue_final) && msgs.last().and_then(|m| m.get("role")).and_then(Value::as_str) == Some("assistant") {
        if msgs.len() >= 2 && msgs[msgs.len() - 2].get("role").and_then(Value::as_str) == Some("assistant") {
            return Err(ApiError::invalid("Cannot have 2 or more assistant messages at the end of the list."));
        }
        continue_final = Value::Bool(true);
        add_generation_prompt = false;
    }
    if continues(&continue_final) && add_generation_prompt {
        return Err(ApiError::invalid("Cannot set both add_generation_prompt and continue_final_message to true."));
    }
    if has_tools && tool_choice != "none" && body.contains_key("grammar") {
        return Err(ApiError::invalid("Cannot use custom grammar constraints with tools."));
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let mut n_probs = None;
    if body.get("logprobs").and_then(Value::as_bool).unwrap_or(false) {
        if has_tools && stream {
            return Err(ApiError::invalid("logprobs is not supported with tools + stream"));
        }
        n_probs = Some(body.get("top_logprobs").and_then(Value::as_i64).unwrap_or(20));
    } else if body.get("top_logprobs").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid("top_logprobs requires logprobs to be set to true"));
    }
    let reasoning_format = body.get("reasoning_format").and_then(Value::as_str).unwrap_or(&info.reasoning_format).to_string();
    let mut kwargs = body.get("chat_template_kwargs").cloned().unwrap_or(json!({}));
    let mut enable_thinking = info.enable_reasoning != 0;
    match kwargs.get("enable_thinking") {
        Some(Value::Bool(b)) => enable_thinking = *b,
        Some(Value::String(_)) => {
            return Err(ApiError::invalid("invalid type for \"enable_thinking\" (expected boolean, got string)"))
        }
        _ => {}
    }
    if let Some(effort) = body.get("reasoning_effort").and_then(Value::as_str) {
        if effort == "none" {
            enable_thinking = false;
            if let Some(k) = kwargs.as_object_mut() {
                k.remove("reasoning_effort");
            }
        } else if !effort.is_empty() {
            kwargs["reasoning_effort"] = json!(effort);
        }
    }
    let inputs = json!({
        "messages": messages,
        "tools": tools,
        "tool_choice": tool_choice,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
        "use_jinja": info.use_jinja,
        "enable_thinking": enable_thinking,
        "reasoning_format": reasoning_format,
        "parallel_tool_calls": body.get("parallel_tool_calls").and_then(Value::as_bool).unwrap_or(false),
        "json_schema": if json_schema.is_null() { String::new() } else { json_schema.to_string() },
        "grammar": grammar,
        "chat_template_kwargs": kwargs,
    });
    let applied = chat_templates(app, model)?.apply(&inputs).map_err(|e| ApiError::invalid(e.to_string()))?;

    let mut task_body = body.clone();
    if let Some(n) = n_probs {
        task_body.insert("n_probs".into(), json!(n));
    }
    if let Some(g) = applied["grammar"].as_str().filter(|g| !g.is_empty()) {
        task_body.insert("grammar".into(), json!(g));
        task_body.insert("grammar_type".into(), json!(3));
    }
    task_body.insert("grammar_lazy".into(), applied["grammar_lazy"].clone());
    task_body.insert("grammar_triggers".into(), applied["grammar_triggers"].clone());
    task_body.insert("generation_prompt".into(), applied["generation_prompt"].clone());
    task_body.insert("message_delimiters".into(), applied["message_delimiters"].clone());
    let mut stops: Vec<Value> = task_body.get("stop").and_then(Value::as_array).cloned().unwrap_or_default();
    stops.extend(applied["additional_stops"].as_array().cloned().unwrap_or_default());
    task_body.insert("stop".into(), Value::Array(stops));
    let parser = json!({
        "format": applied["format"],
        "reasoning_format": reasoning_format,
        "generation_prompt": applied["generation_prompt"],
        "parse_tool_calls": has_tools && tool_choice != "none",
        "parser": applied["parser"],
    });
    Ok(ChatPrompt { prompt: applied["prompt"].as_str().unwrap_or_default().to_string(), task_body, parser })
}

pub async fn apply_template(AxState(app): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    app.engine.wake().await;
    let model = loaded_model(&app.engine)?;
    let chat = chat_prompt(&app, &model, body)?;
    Ok(Json(json!({"prompt": chat.prompt})))
}

/// How many tokens a chat request's prompt takes (the `input_tokens` routes).
pub async fn chat_input_tokens(AxState(app): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    app.engine.wake().await;
    let model = loaded_model(&app.engine)?;
    let chat = chat_prompt(&app, &model, body)?;
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
    let n_choices = body.get("n").and_then(Value::as_u64).unwrap_or(1).max(1) as usize;
    let chat = chat_prompt(&app, &model, body)?;
    let prompt = tokenize_prompts(model.vocab(), &json!(chat.prompt))?.remove(0);
    let params = task_params(&chat.task_body, Some(model.vocab()), &app.eog(&model), app.info.n_keep)?;
    let id = format!("chatcmpl-{}", random_string());
    let alias = app.engine.model_alias().to_string();
    let fingerprint = strata_ffi::build_info();
    // __verbose shows the prompt as its tokens read back, as llama-server does.
    let prompt_text = model.vocab().detokenize(&prompt, false, true);
    let rx = app.engine.submit(vec![prompt; n_choices], params.clone())?;
    let parser = chat.parser;
    let parse = move |text: &str, partial: bool| -> Value {
        parse_chat_message(text, partial, &parser).unwrap_or_else(|_| json!({"role": "assistant", "content": text}))
    };
    let chunk = {
        let (id, alias, fingerprint) = (id.clone(), alias.clone(), fingerprint.clone());
        move |choices: Value| {
            json!({"choices": choices, "created": now(), "id": id, "model": alias, "system_fingerprint": fingerprint, "object": "chat.completion.chunk"})
        }
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
                    let mut out: Vec<Value> =
                        chat_msg_diffs(&c.prev, &msg).unwrap_or_default().into_iter().map(|d| delta(f.index, d)).collect();
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
                Event::Embedding(_) => Vec::new(),
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
