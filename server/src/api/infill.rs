//! `/infill`: fill-in-the-middle with the model's FIM tokens, in llama-server's repo-level
//! layout (`[FIM_REP]project [FIM_SEP]file chunk ... [FIM_PRE]prefix [FIM_SUF]suffix [FIM_MID]`).

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::response::Response;
use serde_json::Value;
use strata_ffi::{Token, Vocab};

use crate::api::app::{loaded_model, App};
use crate::api::body::{parse_body, tokenize_mixed};
use crate::api::error::{ApiError, ErrorType};
use crate::api::native::run_completion;
use crate::api::prompt_log;

/// Separates extra chunks for models without a file-separator token ("\n\n--- snippet ---\n\n").
const CHUNK_SEPARATOR: &str = "\n\n--- snippet ---\n\n";

pub struct InfillLimits {
    pub n_batch: usize,
    pub n_predict: i64,
    pub n_ctx: usize,
    pub spm: bool,
}

fn text_tokens(vocab: Vocab<'_>, s: &str) -> Vec<Token> {
    vocab.tokenize(s, false, false).unwrap_or_default()
}

/// llama-server's format_prompt_infill.
pub fn format_prompt(
    vocab: Vocab<'_>,
    prefix: &Value,
    suffix: &Value,
    extra: &[Value],
    limits: &InfillLimits,
    prompt: &[Token],
) -> Result<Vec<Token>, ApiError> {
    let (pre, suf, mid) = match (vocab.fim_pre(), vocab.fim_suf(), vocab.fim_mid()) {
        (Some(p), Some(s), Some(m)) => (p, s, m),
        _ => return Err(ApiError::server("the model has no fill-in-the-middle tokens")),
    };
    let mut extra_tokens = Vec::new();
    if let Some(rep) = vocab.fim_rep() {
        extra_tokens.push(rep);
        extra_tokens.extend(text_tokens(vocab, "myproject\n"));
    }
    for chunk in extra {
        let text = chunk.get("text").and_then(Value::as_str).unwrap_or("");
        let filename = chunk.get("filename").and_then(Value::as_str).unwrap_or("tmp");
        match vocab.fim_sep() {
            Some(sep) => {
                extra_tokens.push(sep);
                extra_tokens.extend(text_tokens(vocab, &format!("{filename}\n")));
            }
            None => extra_tokens.extend(text_tokens(vocab, CHUNK_SEPARATOR)),
        }
        extra_tokens.extend(text_tokens(vocab, text));
    }
    if let Some(sep) = vocab.fim_sep() {
        extra_tokens.push(sep);
        extra_tokens.extend(text_tokens(vocab, "filename\n"));
    }

    let mut tokens_prefix = tokenize_mixed(vocab, prefix, false, false)?;
    let mut tokens_suffix = tokenize_mixed(vocab, suffix, false, false)?;
    // The FIM part fits in one batch, prefix:suffix = 3:1; extra chunks fill the rest.
    let n_batch = limits.n_batch as i64;
    let n_prefix_take = (tokens_prefix.len() as i64).min(3 * (n_batch / 4));
    let n_suffix_take = (tokens_suffix.len() as i64).min((n_batch / 4 - (2 + prompt.len() as i64)).max(0));
    let n_extra_take = ((limits.n_ctx as i64 - n_batch - 2 * limits.n_predict).max(0)).min(extra_tokens.len() as i64);

    tokens_prefix.drain(..tokens_prefix.len() - n_prefix_take as usize);
    tokens_suffix.truncate(n_suffix_take as usize);
    tokens_prefix.insert(0, pre);
    tokens_prefix.extend_from_slice(prompt);
    tokens_suffix.insert(0, suf);

    let (mut inp, end) = if limits.spm { (tokens_suffix, tokens_prefix) } else { (tokens_prefix, tokens_suffix) };
    if vocab.add_bos() {
        inp.insert(0, vocab.bos());
    }
    let extra_start = extra_tokens.len() - n_extra_take as usize;
    inp.splice(0..0, extra_tokens[extra_start..].iter().copied());
    inp.extend(end);
    inp.push(mid);
    Ok(inp)
}

pub async fn infill(AxState(app): AxState<App>, body: Bytes) -> Result<Response, ApiError> {
    let model = loaded_model(&app.engine)?;
    // the model is checked before the body is read, as llama-server does
    check_fim(model.vocab())?;
    let body = parse_body(&body)?;
    let limits = InfillLimits { n_batch: app.info.n_batch, n_predict: app.info.n_predict, n_ctx: app.engine.n_ctx_slot(), spm: app.info.spm_infill };
    let tokens = infill_tokens(model.vocab(), &body, &limits)?;
    prompt_log::write(&app.info.prompts_log_dir, &serde_json::json!(tokens));
    run_completion(&app, model.clone(), &body, vec![tokens]).await
}

fn check_fim(vocab: Vocab<'_>) -> Result<(), ApiError> {
    let mut missing = String::new();
    for (tok, what) in [(vocab.fim_pre(), "prefix"), (vocab.fim_suf(), "suffix"), (vocab.fim_mid(), "middle")] {
        if tok.is_none() {
            missing.push_str(&format!("{what} token is missing. "));
        }
    }
    if !missing.is_empty() {
        return Err(ApiError::new(ErrorType::NotSupported, format!("Infill is not supported by this model: {missing}")));
    }
    Ok(())
}

/// The request checks llama-server makes, then the prompt. llama-server's own checks of
/// `prompt`, `input_prefix` and `input_suffix` do not stop its handler: a prompt that is no
/// string counts as none, and a missing prefix or suffix fails later on the JSON lookup.
fn infill_tokens(vocab: Vocab<'_>, body: &crate::api::body::Body, limits: &InfillLimits) -> Result<Vec<Token>, ApiError> {
    let extra = match body.get("input_extra") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => {
            return Err(ApiError::invalid("\"input_extra\" must be an array of {\"filename\": string, \"text\": string}"));
        }
    };
    for chunk in &extra {
        if !chunk.get("text").is_some_and(Value::is_string) {
            return Err(ApiError::invalid("extra_context chunk must contain a \"text\" field with a string value"));
        }
        if chunk.get("filename").is_some_and(|f| !f.is_string()) {
            return Err(ApiError::invalid("extra_context chunk's \"filename\" field must be a string"));
        }
    }
    let prompt_text = body.get("prompt").and_then(Value::as_str).unwrap_or("");
    let prompt = vocab.tokenize(prompt_text, false, true).map_err(|e| ApiError::invalid(e.to_string()))?;
    format_prompt(vocab, body.at("input_prefix")?, body.at("input_suffix")?, &extra, limits, &prompt)
}
