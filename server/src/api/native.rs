//! llama-server's own routes: completion, tokenize, detokenize, models, props, slots, metrics,
//! LoRA adapters, health.

use super::app::{loaded_model, App};
use super::body::{flag, parse_body, parse_json, piece, task_params, tokenize_mixed, tokenize_prompts};
use super::prompt_log;
use super::render::{collect, final_json_with_probs, partial_json, select_fields};
use super::request;
use super::sse::{ping_interval, stream_response, Sse};
use crate::api::error::{ApiError, ErrorType};
use crate::api::info::{self};
use crate::api::values;
use crate::engine::{Event, SlotAction};
use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::http::header::{HeaderName, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use strata_ffi::{Model, Token};

pub async fn lora_adapters(AxState(app): AxState<App>) -> Json<Value> {
    let list = app.engine.lora_adapters();
    Json(Value::Array(
        list.iter()
            .enumerate()
            .map(|(id, a)| {
                let mut entry = json!({"id": id, "path": a.path, "scale": a.scale, "task_name": a.task_name, "prompt_prefix": a.prompt_prefix});
                if !a.alora_tokens.is_empty() {
                    entry["alora_invocation_string"] = json!(a.alora_string);
                    entry["alora_invocation_tokens"] = json!(a.alora_tokens);
                }
                entry
            })
            .collect(),
    ))
}

/// Sets the scales tasks without their own `lora` field use; unlisted adapters get 0.
pub async fn set_lora_adapters(AxState(app): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let Value::Array(entries) = parse_json(&body).map_err(ApiError::invalid)? else {
        return Err(ApiError::invalid("Request body must be an array"));
    };
    app.engine.set_lora_scales(&request::parse_lora(&entries));
    Ok(Json(json!({"success": true})))
}

/// Audio input needs a multimodal projector with audio, which strata-server does not load.
pub async fn transcriptions() -> ApiError {
    ApiError::new(ErrorType::NotSupported, "The current model does not support audio input.")
}

/// strata-server serves no decision models (llama.cpp's SystemOne heads).
pub async fn systemone() -> ApiError {
    ApiError::new(ErrorType::NotSupported, "This model is not a decision model")
}

/// Loading is answered by the gate, as llama-server's middleware does; a failed load exits.
pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn completion(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let model = loaded_model(&app.engine)?;
    let prompt = body.at("prompt")?;
    prompt_log::write(&app.info.prompts_log_dir, prompt);
    let prompts = tokenize_prompts(model.vocab(), prompt)?;
    run_completion(&app, model, &body, prompts).await
}

/// Runs prompts as llama-server's own (non-OpenAI) completion and answers in its format.
pub async fn run_completion(app: &App, model: Arc<Model>, body: &Map<String, Value>, prompts: Vec<Vec<Token>>) -> Result<Response, ApiError> {
    let mut params = task_params(app, &model, body)?;
    params.settings_in_answer = true;
    let stream = params.stream;
    let n_cmpl = params.n_cmpl;
    let n = prompts.len() * n_cmpl;
    let alias = app.engine.model_alias().to_string();
    let rx = app.engine.submit(prompts.clone(), params.clone())?;
    let post = params.post_sampling_probs;
    let fields: Vec<String> =
        body.get("response_fields").and_then(Value::as_array).map(|a| a.iter().filter_map(|f| f.as_str().map(String::from)).collect()).unwrap_or_default();
    let render = move |ev: &Event| match ev {
        Event::Partial(p) => vec![partial_json(p, post)],
        Event::Final(f) => {
            // the prompt read back, streamed or not, as llama-server does; the engine has checked
            // its token ids by now
            let prompt = model.vocab().detokenize(&prompts[f.index / n_cmpl], false, true).unwrap_or_default();
            let v = final_json_with_probs(f, &alias, &prompt, post);
            vec![select_fields(v, &fields)]
        }
        Event::Begin | Event::Embedding(_) => Vec::new(),
        Event::Error(e) => vec![e.body()],
    };
    if stream {
        return stream_response(rx, n, render, Sse::Plain, ping_interval(app.info.sse_ping_interval, body)).await;
    }
    collect(rx, n, render).await
}

pub async fn models(AxState(app): AxState<App>) -> Result<Json<Value>, ApiError> {
    let model = loaded_model(&app.engine)?;
    Ok(Json(info::models(&app.info, &model, app.engine.n_ctx_slot())))
}

pub async fn props(AxState(app): AxState<App>) -> Result<Json<Value>, ApiError> {
    let model = loaded_model(&app.engine)?;
    let vocab = model.vocab();
    let piece = |t| if t == -1 { String::new() } else { String::from_utf8_lossy(&vocab.token_to_piece(t, true)).into_owned() };
    let tmpls = crate::api::chat::chat_templates(&app, &model)?;
    let m = info::ModelProps {
        ftype: model.ftype_name(),
        chat_template: tmpls.source("").map_err(ApiError::from_llama)?,
        chat_template_tool_use: tmpls.source("tool_use").map_err(ApiError::from_llama)?,
        chat_template_caps: tmpls.caps().map_err(ApiError::from_llama)?,
        bos: piece(vocab.bos()),
        eos: piece(vocab.eos()),
    };
    let sleeping = app.engine.is_sleeping();
    Ok(Json(info::props(&app.info, app.engine.n_ctx_slot(), &m, app.engine.default_settings(), sleeping)))
}

pub async fn slot_action(
    AxState(app): AxState<App>,
    axum::extract::Path(id_slot): axum::extract::Path<String>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    if app.info.slot_save_path.is_empty() {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support slots action. Start it with `--slot-save-path`"));
    }
    let id = values::stoi(&id_slot).ok_or_else(|| ApiError::invalid("Invalid slot ID"))?;
    let action = q.get("action").map(String::as_str).unwrap_or("");
    let file = || -> Result<(String, std::path::PathBuf), ApiError> {
        let body = parse_body(&body)?;
        let name = values::get_str(body.at("filename")?).map_err(ApiError::invalid)?;
        if !strata_ffi::validate_filename(name) {
            return Err(ApiError::invalid("Invalid filename"));
        }
        Ok((name.to_string(), std::path::PathBuf::from(format!("{}{name}", app.info.slot_save_path))))
    };
    let action = match action {
        "save" => {
            let (filename, path) = file()?;
            SlotAction::Save { id, filename, path }
        }
        "restore" => {
            let (filename, path) = file()?;
            SlotAction::Restore { id, filename, path }
        }
        "erase" => SlotAction::Erase { id },
        _ => return Err(ApiError::invalid("Invalid action")),
    };
    Ok(Json(app.engine.slot_action(action).await?))
}

pub async fn metrics(AxState(app): AxState<App>) -> Result<Response, ApiError> {
    if !app.info.endpoint_metrics {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support metrics endpoint. Start it with `--metrics`"));
    }
    let metrics = app.engine.metrics();
    let mut m = metrics.lock().map_err(|_| ApiError::server("metrics are unavailable"))?;
    let body = m.scrape() + &app.engine.expert_metrics() + &app.engine.ple_metrics();
    Ok(([(CONTENT_TYPE, "text/plain; version=0.0.4".to_string()), (HeaderName::from_static("process-start-time-unix"), m.t_start.to_string())], body)
        .into_response())
}

pub async fn post_props(AxState(app): AxState<App>) -> Result<Json<Value>, ApiError> {
    if !app.info.endpoint_props {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support changing global properties. Start it with `--props`"));
    }
    Ok(Json(json!({"success": true})))
}

pub async fn slots(
    AxState(app): AxState<App>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    if !app.info.endpoint_slots {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support slots endpoint. Start it with `--slots`"));
    }
    let (slots, n_idle) = app.engine.slots().await?;
    if q.get("fail_on_no_slot").is_some_and(|v| !v.is_empty()) && n_idle == 0 {
        return Err(ApiError::new(ErrorType::Unavailable, "no slot available"));
    }
    Ok(Json(Value::Array(slots)))
}

pub async fn tokenize(AxState(App { engine, .. }): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    engine.wake().await;
    let model = loaded_model(&engine)?;
    let vocab = model.vocab();
    let Some(content) = body.get("content") else {
        return Ok(Json(json!({"tokens": []})));
    };
    let tokens = tokenize_mixed(vocab, content, flag(&body, "add_special", false), flag(&body, "parse_special", true))?;
    if !flag(&body, "with_pieces", false) {
        return Ok(Json(json!({"tokens": tokens})));
    }
    let mut pieces = Vec::with_capacity(tokens.len());
    for &t in &tokens {
        let piece = match String::from_utf8(piece(vocab, t)?) {
            Ok(s) => Value::from(s),
            Err(e) => Value::from(e.into_bytes()),
        };
        pieces.push(json!({"id": t, "piece": piece}));
    }
    Ok(Json(json!({"tokens": pieces})))
}

pub async fn detokenize(AxState(App { engine, .. }): AxState<App>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = parse_body(&body)?;
    engine.wake().await;
    let model = loaded_model(&engine)?;
    let tokens: Vec<Token> = match body.get("tokens") {
        None => Vec::new(),
        Some(Value::Array(items)) => items.iter().map(|t| values::get_i32(t).map_err(ApiError::invalid)).collect::<Result<_, _>>()?,
        Some(v) => return Err(ApiError::invalid(values::type_error("array", v))),
    };
    let mut bytes = Vec::new();
    for &t in &tokens {
        bytes.extend(piece(model.vocab(), t)?);
    }
    Ok(Json(json!({"content": String::from_utf8_lossy(&bytes)})))
}
