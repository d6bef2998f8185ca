//! `/embedding(s)`, `/v1/embeddings` and `/rerank` (+ aliases), as llama-server answers them:
//! one engine task per input, results in input order.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Map, Value};
use strata_ffi::{Model, Token};

use crate::api::app::{loaded_model, App};
use crate::api::body::{parse_body, tokenize_mixed, tokenize_prompts};
use crate::api::error::{ApiError, ErrorType};
use crate::api::render::collect_values;
use crate::engine::{Event, TaskKind, TaskParams};

/// llama_pooling_type values.
const POOLING_NONE: i64 = 0;
const POOLING_RANK: i64 = 4;

/// The pooling the context runs with: --pooling, else the model's own.
fn pooling_type(app: &App, model: &Model) -> i64 {
    match app.info.pooling_type {
        t if t >= 0 => t,
        _ => {
            model.meta("general.architecture").and_then(|arch| model.meta(&format!("{arch}.pooling_type"))).and_then(|v| v.parse().ok()).unwrap_or(POOLING_NONE)
        }
    }
}

pub async fn embeddings(State(app): State<App>, body: Bytes) -> Result<Response, ApiError> {
    run_embeddings(app, body, false).await
}

pub async fn embeddings_oai(State(app): State<App>, body: Bytes) -> Result<Response, ApiError> {
    run_embeddings(app, body, true).await
}

async fn run_embeddings(app: App, body: Bytes, mut oai: bool) -> Result<Response, ApiError> {
    if !app.info.embedding {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support embeddings. Start it with `--embeddings`"));
    }
    let model = loaded_model(&app.engine)?;
    let pooling = pooling_type(&app, &model);
    if oai && pooling == POOLING_NONE {
        return Err(ApiError::invalid("Pooling type 'none' is not OAI compatible. Please use a different pooling type"));
    }
    let body = parse_body(&body)?;
    let prompt = if let Some(p) = body.get("input") {
        p
    } else if let Some(p) = body.get("content") {
        oai = false;
        p
    } else {
        return Err(ApiError::invalid("\"input\" or \"content\" must be provided"));
    };
    let base64 = match body.get("encoding_format") {
        None => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(Value::String(f)) if f == "float" => false,
        Some(_) => return Err(ApiError::invalid("The format to return the embeddings in. Can be either float or base64")),
    };
    let prompts = embedding_prompts(&model, prompt)?;
    if prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::invalid("Input content cannot be empty"));
    }
    let normalize = match body.get("embd_normalize") {
        None => app.info.embd_normalize,
        Some(v) => v.as_i64().ok_or_else(|| ApiError::invalid("\"embd_normalize\" must be an integer"))? as i32,
    };
    let params = TaskParams { kind: TaskKind::Embedding { normalize }, ..TaskParams::default() };
    let n = prompts.len();
    let rx = app.engine.submit(prompts, params)?;
    let results = collect_values(rx, n, |ev| match ev {
        Event::Embedding(e) if oai => vec![json!({
            "index": e.index, "embedding": e.data.first().cloned().unwrap_or_default(), "tokens_evaluated": e.n_tokens,
        })],
        Event::Embedding(e) => vec![json!({"index": e.index, "embedding": e.data})],
        _ => Vec::new(),
    })
    .await?;
    if !oai {
        return Ok(Json(Value::Array(results)).into_response());
    }
    let mut n_tokens = 0;
    let data: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, r)| {
            n_tokens += r["tokens_evaluated"].as_u64().unwrap_or(0);
            if base64 {
                let floats: Vec<u8> = r["embedding"].as_array().into_iter().flatten().flat_map(|x| (x.as_f64().unwrap_or(0.0) as f32).to_le_bytes()).collect();
                let encoded = base64::engine::general_purpose::STANDARD.encode(floats);
                json!({"embedding": encoded, "index": i, "object": "embedding", "encoding_format": "base64"})
            } else {
                json!({"embedding": r["embedding"], "index": i, "object": "embedding"})
            }
        })
        .collect();
    Ok(Json(json!({
        "model": body.get("model").cloned().unwrap_or_else(|| json!(app.engine.model_alias())),
        "object": "list",
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "data": data,
    }))
    .into_response())
}

/// The inputs of an embedding request: as /completion's prompts, plus OpenAI content arrays
/// (`{"content": [{"type": "text", "text": ...}, ...]}`, the text parts joined).
fn embedding_prompts(model: &Model, input: &Value) -> Result<Vec<Vec<Token>>, ApiError> {
    let vocab = model.vocab();
    let entry = |p: &Value| -> Result<Vec<Token>, ApiError> {
        match p.as_object().and_then(|o| o.get("content")) {
            Some(content) => content_array_tokens(model, content),
            None => Ok(tokenize_prompts(vocab, p)?.remove(0)),
        }
    };
    let prompts = match input {
        Value::Array(items) if !items.iter().any(Value::is_number) => items.iter().map(entry).collect::<Result<Vec<_>, _>>()?,
        p => vec![entry(p)?],
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("\"input\" must not be empty"));
    }
    Ok(prompts)
}

fn content_array_tokens(model: &Model, content: &Value) -> Result<Vec<Token>, ApiError> {
    let parts = content.as_array().ok_or_else(|| ApiError::invalid("\"content\" must be an array"))?;
    let mut text = String::new();
    for p in parts {
        match p.get("type").and_then(Value::as_str).unwrap_or("") {
            "text" => text.push_str(p.get("text").and_then(Value::as_str).unwrap_or("")),
            "image_url" => return Err(ApiError::server("image input is not supported - hint: if this is unexpected, you may need to provide the mmproj")),
            "input_audio" => return Err(ApiError::server("audio input is not supported - hint: if this is unexpected, you may need to provide the mmproj")),
            "input_video" | "video_url" => {
                return Err(ApiError::server("video input is not supported - hint: if this is unexpected, you may need to provide the mmproj"))
            }
            _ => return Err(ApiError::invalid("unsupported content[].type")),
        }
    }
    tokenize_mixed(model.vocab(), &Value::String(text), true, true)
}

/// llama-server's format_prompt_rerank: the model's "rerank" template, else
/// [BOS] query [EOS] [SEP] document [EOS] as the vocabulary asks.
fn rerank_prompt(model: &Model, query: &str, doc: &str) -> Result<Vec<Token>, ApiError> {
    let vocab = model.vocab();
    if let Some(t) = model.named_template("rerank") {
        let text = t.replace("{query}", query).replace("{document}", doc);
        return tokenize_mixed(vocab, &Value::String(text), false, true);
    }
    let q = tokenize_mixed(vocab, &Value::String(query.into()), false, false)?;
    let d = tokenize_mixed(vocab, &Value::String(doc.into()), false, false)?;
    let eos = if vocab.eos() >= 0 { Some(vocab.eos()) } else { vocab.sep() };
    let mut out = Vec::with_capacity(q.len() + d.len() + 4);
    if vocab.add_bos() {
        out.push(vocab.bos());
    }
    out.extend(q);
    if vocab.add_eos() {
        out.extend(eos);
    }
    if vocab.add_sep() {
        out.extend(vocab.sep());
    }
    out.extend(d);
    if vocab.add_eos() {
        out.extend(eos);
    }
    Ok(out)
}

pub async fn rerank(State(app): State<App>, body: Bytes) -> Result<Response, ApiError> {
    let model = loaded_model(&app.engine)?;
    // as llama-server: the command line's pooling, not the model's, decides
    if !app.info.embedding || app.info.pooling_type != POOLING_RANK {
        return Err(ApiError::new(ErrorType::NotSupported, "This server does not support reranking. Start it with `--reranking`"));
    }
    let body = parse_body(&body)?;
    let tei = body.contains_key("texts");
    let query = match body.get("query") {
        Some(Value::String(q)) => q.clone(),
        Some(_) => return Err(ApiError::invalid("\"query\" must be a string")),
        None => return Err(ApiError::invalid("\"query\" must be provided")),
    };
    let docs: Vec<String> = body
        .get("documents")
        .or_else(|| body.get("texts"))
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|d| d.as_str().map(String::from)).collect())
        .unwrap_or_default();
    if docs.is_empty() {
        return Err(ApiError::invalid("\"documents\" must be a non-empty string array"));
    }
    let top_n = body.get("top_n").and_then(Value::as_i64).unwrap_or(docs.len() as i64).max(0) as usize;
    let prompts = docs.iter().map(|d| rerank_prompt(&model, &query, d)).collect::<Result<Vec<_>, _>>()?;
    let params = TaskParams { kind: TaskKind::Rerank, ..TaskParams::default() };
    let n = prompts.len();
    let rx = app.engine.submit(prompts, params)?;
    let ranks = collect_values(rx, n, |ev| match ev {
        Event::Embedding(e) => vec![json!({"index": e.index, "score": e.score, "tokens_evaluated": e.n_tokens})],
        _ => Vec::new(),
    })
    .await?;
    let label = if tei { "score" } else { "relevance_score" };
    let return_text = tei && body.get("return_text").and_then(Value::as_bool).unwrap_or(false);
    let mut n_tokens = 0;
    let mut results: Vec<Value> = ranks
        .iter()
        .map(|r| {
            n_tokens += r["tokens_evaluated"].as_u64().unwrap_or(0);
            let index = r["index"].as_u64().unwrap_or(0) as usize;
            let mut e = Map::new();
            e.insert("index".into(), json!(index));
            e.insert(label.into(), r["score"].clone());
            if return_text {
                e.insert("text".into(), json!(docs[index]));
            }
            Value::Object(e)
        })
        .collect();
    // stable, as std::sort is not: equal scores keep document order
    results.sort_by(|a, b| b[label].as_f64().unwrap_or(0.0).total_cmp(&a[label].as_f64().unwrap_or(0.0)));
    results.truncate(top_n);
    if tei {
        return Ok(Json(Value::Array(results)).into_response());
    }
    Ok(Json(json!({
        "model": body.get("model").cloned().unwrap_or_else(|| json!(app.engine.model_alias())),
        "object": "list",
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "results": results,
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use crate::engine::normalize_embedding;

    #[test]
    fn normalisation_matches_common_embd_normalize() {
        let v = [3.0f32, -4.0];
        assert_eq!(normalize_embedding(&v, -1), vec![3.0, -4.0]);
        assert_eq!(normalize_embedding(&v, 2), vec![0.6, -0.8]);
        let taxicab = normalize_embedding(&v, 1);
        assert!((taxicab[0] - 3.0 / 7.0).abs() < 1e-6 && (taxicab[1] + 4.0 / 7.0).abs() < 1e-6);
        let int16 = normalize_embedding(&v, 0);
        assert!((int16[1] + 32760.0).abs() < 1e-2, "{int16:?}");
        assert_eq!(normalize_embedding(&[0.0, 0.0], 2), vec![0.0, 0.0]);
    }
}
