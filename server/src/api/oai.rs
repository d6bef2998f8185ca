//! The OpenAI-compatible routes: /v1/completions, /v1/chat/completions and /apply-template,
//! with llama-server's request parsing (oaicompat_*_params_parse) and response shapes.

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use strata_ffi::{chat_msg_diffs, parse_chat_message};

use super::chat::{chat_prompt, fill_tool_call_ids};
use super::render::{now, random_string};
use crate::api::app::{loaded_model, App};
use crate::api::body::{parse_body, task_params, tokenize_prompts};
use crate::api::error::ApiError;
use crate::api::prompt_log;
use crate::api::render::{add_progress, collect_values, final_json, probs_json, timings_json};
use crate::api::sse::{ping_interval, stream_response, Sse};
use crate::api::values;
use crate::engine::generation::StopType;
use crate::engine::{Event, Final};

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
    let prompt = body.at("prompt")?;
    prompt_log::write(&app.info.prompts_log_dir, prompt);
    let prompts = tokenize_prompts(model.vocab(), prompt)?;
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
        return stream_response(rx, n, render, Sse::OpenAi, ping_interval(app.info.sse_ping_interval, &body)).await;
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
    let cmpl_id = values::lenient(&body, "id", |v| values::get_str(v).map(String::from), String::new());
    let action = values::lenient(&body, "action", |v| values::get_str(v).map(String::from), String::new());
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

pub async fn chat_completions(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let model = loaded_model(&app.engine)?;
    let verbose = body.get("verbose").and_then(Value::as_bool).unwrap_or(app.info.verbose);
    let include_usage = body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    let chat = chat_prompt(&app, &model, body.into_map())?;
    prompt_log::write(&app.info.prompts_log_dir, &json!(chat.prompt));
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
        return stream_response(rx, n_choices, render, Sse::OpenAi, ping_interval(app.info.sse_ping_interval, &chat.task_body)).await;
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
