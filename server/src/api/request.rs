//! llama-server's completion request schema (the pin's `tools/server/server-schema.cpp`) as one
//! Rust table, evaluated field by field in upstream's order, so that a request is accepted,
//! clamped or refused exactly as llama-server does it, with its messages.
//!
//! Values convert as llama.cpp's JSON library does (api::values). A field's error reads
//! `Field '<name>': <why>` and is a 400.
//! "Soft" limits clamp, "hard" limits refuse. A value that would reach an assertion in llama.cpp
//! (an unknown grammar trigger type) is refused here with a 400 where upstream aborts.
//!
//! The result is a normalized object: canonical field names (an alias becomes its field's first
//! name) with values of the right type and range, and token-level fields already tokenized.

use serde_json::{json, Map, Value};
use strata_ffi::{Token, Vocab};

use super::values::{at, elements, get_bool, get_f32, get_i32, get_i64, get_str, get_strings, get_u32, lenient, limited, strtol};
use crate::api::error::ApiError;
use crate::engine::settings::f32_value;

type Handler = fn(&mut Eval<'_>, &Map<String, Value>) -> Result<(), String>;

#[derive(Clone, Copy)]
enum Kind {
    Bool,
    I32 {
        min: i32,
        max: i32,
        hard: bool,
    },
    I64 {
        min: i64,
        max: i64,
        hard: bool,
    },
    U32,
    F32 {
        min: f32,
        max: f32,
        hard: bool,
    },
    /// 1 up to the server's -np (n_cmpl).
    UpToParallel,
    /// An object whose fields are evaluated in it (stream_options).
    Nested(&'static [Field]),
    Custom(Handler),
}

#[derive(Clone, Copy)]
struct Field {
    /// The field's name, then its aliases in the order upstream tries them.
    names: &'static [&'static str],
    kind: Kind,
}

const fn soft_i32(min: i32, max: i32) -> Kind {
    Kind::I32 { min, max, hard: false }
}
const fn hard_i32(min: i32, max: i32) -> Kind {
    Kind::I32 { min, max, hard: true }
}
const fn soft_f32(min: f32, max: f32) -> Kind {
    Kind::F32 { min, max, hard: false }
}
const ANY_I32: Kind = soft_i32(i32::MIN, i32::MAX);
const ANY_F32: Kind = soft_f32(f32::MIN, f32::MAX);

const fn f(names: &'static [&'static str], kind: Kind) -> Field {
    Field { names, kind }
}

const STREAM_OPTIONS: &[Field] = &[f(&["include_usage"], Kind::Bool)];

/// Upstream's order: when several fields are wrong, the first one in this list is reported.
const FIELDS: &[Field] = &[
    f(&["verbose"], Kind::Bool),
    f(&["timings_per_token"], Kind::Bool),
    f(&["stream"], Kind::Bool),
    f(&["stream_options"], Kind::Nested(STREAM_OPTIONS)),
    f(&["cache_prompt"], Kind::Bool),
    f(&["return_tokens"], Kind::Bool),
    f(&["return_progress"], Kind::Bool),
    f(&["sse_ping_interval"], hard_i32(-1, i32::MAX)),
    f(&["n_predict", "max_completion_tokens", "max_tokens"], hard_i32(-1, i32::MAX)),
    f(&["n_indent"], hard_i32(0, i32::MAX)),
    f(&["n_keep"], hard_i32(-1, i32::MAX)),
    f(&["n_discard"], hard_i32(0, i32::MAX)),
    f(&["n_cmpl", "n"], Kind::UpToParallel),
    f(&["n_cache_reuse"], hard_i32(0, i32::MAX)),
    f(&["t_max_predict_ms"], Kind::I64 { min: -1, max: i64::MAX, hard: true }),
    f(&["response_fields"], Kind::Custom(response_fields)),
    f(&["top_k"], soft_i32(0, i32::MAX)),
    f(&["top_p"], soft_f32(0.0, 1.0)),
    f(&["min_p"], soft_f32(0.0, 1.0)),
    f(&["top_n_sigma"], ANY_F32),
    f(&["xtc_probability"], soft_f32(0.0, 1.0)),
    f(&["xtc_threshold"], soft_f32(0.0, 1.0)),
    f(&["typical_p"], ANY_F32),
    f(&["temperature"], soft_f32(0.0, f32::INFINITY)),
    f(&["dynatemp_range"], ANY_F32),
    f(&["dynatemp_exponent"], ANY_F32),
    f(&["repeat_last_n"], hard_i32(0, i32::MAX)),
    f(&["repeat_penalty"], ANY_F32),
    f(&["frequency_penalty"], ANY_F32),
    f(&["presence_penalty"], ANY_F32),
    f(&["dry_multiplier"], ANY_F32),
    f(&["dry_base"], Kind::Custom(dry_base)),
    f(&["dry_allowed_length"], hard_i32(0, i32::MAX)),
    f(&["dry_penalty_last_n"], hard_i32(0, i32::MAX)),
    f(&["mirostat"], soft_i32(0, 2)),
    f(&["mirostat_tau"], ANY_F32),
    f(&["mirostat_eta"], ANY_F32),
    f(&["adaptive_target"], soft_f32(f32::MIN, 1.0)),
    f(&["adaptive_decay"], Kind::F32 { min: 0.0, max: 0.99, hard: true }),
    f(&["seed"], Kind::U32),
    f(&["n_probs", "logprobs"], ANY_I32),
    f(&["min_keep"], hard_i32(0, i32::MAX)),
    f(&["backend_sampling"], Kind::Bool),
    f(&["post_sampling_probs"], Kind::Bool),
    f(&["lora"], Kind::Custom(lora)),
    f(&["dry_sequence_breakers"], Kind::Custom(dry_sequence_breakers)),
    f(&["json_schema", "grammar"], Kind::Custom(grammar)),
    f(&["grammar_lazy"], Kind::Bool),
    f(&["chat_format"], Kind::Custom(chat_format)),
    f(&["reasoning_format"], Kind::Custom(reasoning_format)),
    f(&["generation_prompt"], Kind::Custom(generation_prompt)),
    f(&["parse_tool_calls"], Kind::Bool),
    f(&["chat_parser"], Kind::Custom(chat_parser)),
    f(&["continue_final_message"], Kind::Custom(continue_final_message)),
    f(&["echo"], Kind::Bool),
    f(&["preserved_tokens"], Kind::Custom(preserved_tokens)),
    f(&["grammar_triggers"], Kind::Custom(grammar_triggers)),
    f(&["reasoning_control"], Kind::Bool),
    f(&["reasoning_budget_tokens"], hard_i32(-1, i32::MAX)),
    f(&["reasoning_budget_start_tag"], Kind::Custom(reasoning_budget_start)),
    f(&["reasoning_budget_end_tags", "reasoning_budget_end_tag"], Kind::Custom(reasoning_budget_end)),
    f(&["reasoning_budget_message"], Kind::Custom(reasoning_budget_message)),
    f(&["logit_bias"], Kind::Custom(logit_bias)),
    f(&["ignore_eos"], Kind::Custom(ignore_eos)),
    f(&["stop"], Kind::Custom(stop)),
    f(&["samplers"], Kind::Custom(samplers)),
];

/// Grammar trigger types of the pin (common_grammar_trigger_type).
pub const TRIGGER_TOKEN: i64 = 0;
pub const TRIGGER_WORD: i64 = 1;
const TRIGGER_PATTERN_FULL: i64 = 3;

/// Grammar types of the pin (common_grammar_type): a user's grammar, one made from a JSON
/// schema, or a chat template's tool-call grammar.
pub const GRAMMAR_USER: i64 = 1;
pub const GRAMMAR_OUTPUT_FORMAT: i64 = 2;
pub const GRAMMAR_TOOL_CALLS: i64 = 3;

/// What a field handler can see besides the request.
pub struct Context<'a> {
    pub vocab: Option<Vocab<'a>>,
    /// The server's -np (the bound of n_cmpl).
    pub n_parallel: i32,
    /// The server's --dry-base, which a dry_base below 1 falls back to.
    pub dry_base_default: f32,
    /// Turns a JSON schema into a grammar (the pin's json_schema_to_grammar).
    pub schema_to_grammar: &'a dyn Fn(&Value) -> Result<String, String>,
    /// Checks a chat parser definition (the pin's common_peg_arena::load).
    pub check_chat_parser: &'a dyn Fn(&str) -> Result<(), String>,
}

struct Eval<'a> {
    ctx: &'a Context<'a>,
    out: Map<String, Value>,
}

impl Eval<'_> {
    fn set(&mut self, key: &str, v: Value) {
        self.out.insert(key.to_string(), v);
    }

    fn tokenize(&self, text: &str, parse_special: bool) -> Result<Vec<Token>, String> {
        let vocab = self.ctx.vocab.ok_or("no vocabulary")?;
        vocab.tokenize(text, false, parse_special).map_err(|e| e.to_string())
    }
}

/// Evaluates `body` against the schema: the normalized fields, or the first field's error.
pub fn eval(body: &Map<String, Value>, ctx: &Context<'_>) -> Result<Map<String, Value>, ApiError> {
    let mut ev = Eval { ctx, out: Map::new() };
    eval_fields(&mut ev, FIELDS, body, "")?;
    Ok(ev.out)
}

fn eval_fields(ev: &mut Eval<'_>, fields: &[Field], body: &Map<String, Value>, prefix: &str) -> Result<(), ApiError> {
    for field in fields {
        if let Kind::Nested(sub) = field.kind {
            if let Some(Value::Object(inner)) = body.get(field.names[0]) {
                eval_fields(ev, sub, inner, field.names[0])?;
            }
            continue;
        }
        let Some(&name) = field.names.iter().find(|n| body.get(**n).is_some_and(|v| !v.is_null())) else { continue };
        let key = if prefix.is_empty() { field.names[0].to_string() } else { format!("{prefix}.{}", field.names[0]) };
        let v = &body[name];
        let result = match field.kind {
            Kind::Bool => get_bool(v).map(Value::from),
            Kind::I32 { min, max, hard } => get_i32(v).and_then(|x| limited(x, min, max, hard)).map(Value::from),
            Kind::UpToParallel => get_i32(v).and_then(|x| limited(x, 1, ev.ctx.n_parallel, true)).map(Value::from),
            Kind::I64 { min, max, hard } => get_i64(v).and_then(|x| limited(x, min, max, hard)).map(Value::from),
            Kind::U32 => get_u32(v).map(Value::from),
            Kind::F32 { min, max, hard } => get_f32(v).and_then(|x| limited(x, min, max, hard)).map(f32_value),
            Kind::Custom(handler) => handler(ev, body).map(|()| Value::Null),
            Kind::Nested(_) => unreachable!(),
        };
        match result {
            Ok(Value::Null) => {}
            Ok(value) => ev.set(&key, value),
            Err(why) => return Err(ApiError::invalid(format!("Field '{name}': {why}"))),
        }
    }
    Ok(())
}

fn response_fields(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let fields = lenient(body, "response_fields", get_strings, Vec::new());
    ev.set("response_fields", json!(fields));
    Ok(())
}

fn dry_base(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let v = get_f32(&body["dry_base"])?;
    ev.set("dry_base", f32_value(if v < 1.0 { ev.ctx.dry_base_default } else { v }));
    Ok(())
}

fn lora(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let Value::Array(entries) = &body["lora"] else {
        return Err("Error: 'lora' must be an array of objects with 'id' and 'scale' fields".into());
    };
    let list = parse_lora(entries);
    ev.set("lora", Value::Array(list.into_iter().map(|(id, s)| json!({"id": id, "scale": f32_value(s)})).collect()));
    Ok(())
}

/// llama-server's parse_lora_request: `[{"id", "scale"}, ...]` as a map from id to scale (id -1
/// and scale 0 where missing or mistyped, the last entry for an id winning), in id order.
pub fn parse_lora(entries: &[Value]) -> Vec<(i64, f32)> {
    let mut map = std::collections::BTreeMap::new();
    for e in entries {
        let e = e.as_object();
        let id = e.map_or(-1, |o| lenient(o, "id", get_i32, -1));
        let scale = e.map_or(0.0, |o| lenient(o, "scale", get_f32, 0.0));
        map.insert(id as i64, scale);
    }
    map.into_iter().collect()
}

fn dry_sequence_breakers(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let breakers = lenient(body, "dry_sequence_breakers", get_strings, Vec::new());
    if breakers.is_empty() {
        return Err("Error: dry_sequence_breakers must be a non-empty array of strings".into());
    }
    ev.set("dry_sequence_breakers", json!(breakers));
    Ok(())
}

fn grammar(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    if body.contains_key("json_schema") && !body.contains_key("grammar") {
        let mut schema = body["json_schema"].clone();
        if schema.as_object().is_some_and(Map::is_empty) {
            schema = json!({"type": "object"});
        }
        let g = (ev.ctx.schema_to_grammar)(&schema).map_err(|e| format!("\"json_schema\": {e}"))?;
        check_repetitions(&g).map_err(|e| format!("\"json_schema\": {e}"))?;
        ev.set("grammar", json!(g));
        ev.set("grammar_type", json!(GRAMMAR_OUTPUT_FORMAT));
        return Ok(());
    }
    let g = lenient(body, "grammar", |v| get_str(v).map(String::from), String::new());
    if !g.is_empty() {
        check_repetitions(&g)?;
        let tool_calls = lenient(body, "grammar_type", get_str, "") == "tool_calls";
        ev.set("grammar", json!(g));
        ev.set("grammar_type", json!(if tool_calls { GRAMMAR_TOOL_CALLS } else { GRAMMAR_USER }));
    }
    Ok(())
}

/// Refuses a GBNF repetition `{m,n}` with n < m. llama.cpp's grammar parser counts the optional
/// copies as n - m in an unsigned integer, so it adds rules until the process runs out of memory
/// (llama-server is killed); a JSON schema with minLength above maxLength produces one too.
pub fn check_repetitions(grammar: &str) -> Result<(), String> {
    let b = grammar.as_bytes();
    let mut i = 0;
    let int = |i: &mut usize| -> Option<u128> {
        let start = *i;
        while *i < b.len() && b[*i].is_ascii_digit() {
            *i += 1;
        }
        (*i > start).then(|| grammar[start..*i].parse::<u128>().unwrap_or(u128::MAX))
    };
    let space = |i: &mut usize| {
        while *i < b.len() && matches!(b[*i], b' ' | b'\t' | b'\r' | b'\n') {
            *i += 1;
        }
    };
    while i < b.len() {
        match b[i] {
            // a literal, a character class or a token: skip to its end, escapes included
            open @ (b'"' | b'[' | b'<') => {
                let close = match open {
                    b'"' => b'"',
                    b'[' => b']',
                    _ => b'>',
                };
                i += 1;
                while i < b.len() && b[i] != close {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'#' => {
                while i < b.len() && b[i] != b'\n' && b[i] != b'\r' {
                    i += 1;
                }
            }
            b'{' => {
                i += 1;
                space(&mut i);
                let Some(min) = int(&mut i) else { continue };
                space(&mut i);
                if i < b.len() && b[i] == b',' {
                    i += 1;
                    space(&mut i);
                    if let Some(max) = int(&mut i) {
                        if max < min {
                            return Err(format!("grammar repetition {{{min},{max}}} has a maximum below its minimum"));
                        }
                    }
                }
            }
            _ => i += 1,
        }
    }
    Ok(())
}

fn chat_format(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    ev.set("chat_format", json!(get_i32(&body["chat_format"])?));
    Ok(())
}

pub const REASONING_FORMATS: &[&str] = &["none", "auto", "deepseek", "deepseek-legacy"];

fn reasoning_format(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let name = get_str(&body["reasoning_format"])?;
    if !REASONING_FORMATS.contains(&name) {
        return Err(format!("Unknown reasoning format: {name}"));
    }
    ev.set("reasoning_format", json!(name));
    Ok(())
}

fn generation_prompt(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    ev.set("generation_prompt", json!(get_str(&body["generation_prompt"])?));
    Ok(())
}

fn chat_parser(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let p = get_str(&body["chat_parser"])?;
    (ev.ctx.check_chat_parser)(p)?;
    ev.set("chat_parser", json!(p));
    Ok(())
}

fn continue_final_message(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let v = &body["continue_final_message"];
    let on = v.as_bool() == Some(true) || matches!(v.as_str(), Some("reasoning_content" | "content"));
    ev.set("continue_final_message", json!(on));
    Ok(())
}

fn preserved_tokens(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let mut ids = Vec::new();
    for t in elements(&body["preserved_tokens"]) {
        let toks = ev.tokenize(get_str(t)?, true)?;
        if let [one] = toks[..] {
            ids.push(one);
        }
    }
    ev.set("preserved_tokens", json!(ids));
    Ok(())
}

fn grammar_triggers(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let preserved: Vec<Token> =
        ev.out.get("preserved_tokens").and_then(Value::as_array).map(|a| a.iter().filter_map(|t| t.as_i64()).map(|t| t as Token).collect()).unwrap_or_default();
    let mut out = Vec::new();
    for t in elements(&body["grammar_triggers"]) {
        let ty = get_i32(at(t, "type")?)? as i64;
        let value = get_str(at(t, "value")?)?.to_string();
        // upstream aborts the process on these when the sampler is made
        if !(TRIGGER_TOKEN..=TRIGGER_PATTERN_FULL).contains(&ty) {
            return Err(format!("unknown grammar trigger type {ty} (0 token, 1 word, 2 pattern, 3 full pattern)"));
        }
        if ty == TRIGGER_TOKEN {
            // an id outside the vocabulary can never be sampled, so it never triggers
            let token = get_i32(at(t, "token")?)?;
            out.push(json!({"type": ty, "value": value, "token": token}));
        } else if ty == TRIGGER_WORD {
            match ev.tokenize(&value, true)?[..] {
                [token] => {
                    if !preserved.contains(&token) {
                        return Err(format!("Grammar trigger word should be marked as preserved token: {value}"));
                    }
                    out.push(json!({"type": TRIGGER_TOKEN, "value": value, "token": token}));
                }
                _ => out.push(json!({"type": TRIGGER_WORD, "value": value})),
            }
        } else {
            out.push(json!({"type": ty, "value": value}));
        }
    }
    let lazy = ev.out.get("grammar_lazy").and_then(Value::as_bool).unwrap_or(false);
    if lazy && out.is_empty() {
        return Err("Error: no triggers set for lazy grammar!".into());
    }
    ev.set("grammar_triggers", Value::Array(out));
    Ok(())
}

fn reasoning_budget_start(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let toks = ev.tokenize(get_str(&body["reasoning_budget_start_tag"])?, true)?;
    ev.set("reasoning_budget_start", json!(toks));
    Ok(())
}

fn reasoning_budget_end(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let tags: Vec<&Value> = match body.get("reasoning_budget_end_tags") {
        Some(v) => elements(v),
        None => vec![&body["reasoning_budget_end_tag"]],
    };
    let mut ends = Vec::new();
    for t in tags {
        let tag = get_str(t)?;
        if !tag.is_empty() {
            ends.push(ev.tokenize(tag, true)?);
        }
    }
    ev.set("reasoning_budget_end", json!(ends));
    Ok(())
}

fn reasoning_budget_message(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let first_end = ev.out.get("reasoning_budget_end").and_then(|e| e.get(0)).cloned();
    let Some(Value::Array(end)) = first_end else { return Ok(()) };
    let message = lenient(body, "reasoning_budget_message", get_str, "");
    let mut forced: Vec<Value> = Vec::new();
    if !message.is_empty() {
        forced.extend(ev.tokenize(message, true)?.into_iter().map(Value::from));
    }
    forced.extend(end);
    ev.set("reasoning_budget_forced", Value::Array(forced));
    Ok(())
}

/// [[token or text, bias], ...] or {"token or text": bias}; a bias of false bans the token; text
/// means each of its tokens; out-of-range ids and malformed entries are dropped.
fn logit_bias(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let n_vocab = ev.ctx.vocab.map_or(0, |v| v.n_tokens());
    let bias_of = |b: &Value| match b {
        Value::Number(_) => get_f32(b).ok().map(f32_value),
        Value::Bool(false) => Some(json!(false)),
        _ => None,
    };
    let mut out = Vec::new();
    let add_text = |ev: &Eval<'_>, text: &str, b: Value, out: &mut Vec<Value>| -> Result<(), String> {
        for t in ev.tokenize(text, false)? {
            out.push(json!([t, b.clone()]));
        }
        Ok(())
    };
    match &body["logit_bias"] {
        Value::Array(items) => {
            for el in items {
                let Some([k, b]) = el.as_array().map(Vec::as_slice) else { continue };
                let Some(b) = bias_of(b) else { continue };
                if k.is_i64() || k.is_u64() {
                    let t = get_i32(k)?;
                    if (0..n_vocab).contains(&t) {
                        out.push(json!([t, b]));
                    }
                } else if let Some(text) = k.as_str() {
                    add_text(ev, text, b, &mut out)?;
                }
            }
        }
        Value::Object(m) => {
            for (k, b) in m {
                let Some(b) = bias_of(b) else { continue };
                match strtol(k) {
                    Some(t) => {
                        if (0..n_vocab as i64).contains(&t) {
                            out.push(json!([t, b]));
                        }
                    }
                    None => add_text(ev, k, b, &mut out)?,
                }
            }
        }
        _ => {}
    }
    ev.set("logit_bias", Value::Array(out));
    Ok(())
}

/// The end-of-generation bans it brings are added by the shim, to the request's logit biases or,
/// without any, to the server's (llama-server appends its logit_bias_eog to the inherited ones).
fn ignore_eos(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let on = get_bool(&body["ignore_eos"])?;
    ev.set("ignore_eos", json!(on));
    Ok(())
}

fn stop(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    let mut words = Vec::new();
    match &body["stop"] {
        Value::Array(items) => {
            for w in items {
                // nlohmann's empty(): true for null and for an empty array or object only
                let empty = match w {
                    Value::Null => true,
                    Value::Array(a) => a.is_empty(),
                    Value::Object(o) => o.is_empty(),
                    _ => false,
                };
                if !empty {
                    words.push(get_str(w)?.to_string());
                }
            }
        }
        Value::String(s) => words.push(s.clone()),
        _ => {}
    }
    // no effective stop strings: the server's own (-r) stay
    if !words.is_empty() {
        ev.set("stop", json!(words));
    }
    Ok(())
}

fn samplers(ev: &mut Eval<'_>, body: &Map<String, Value>) -> Result<(), String> {
    match &body["samplers"] {
        v @ Value::Array(_) => ev.set("samplers", json!(get_strings(v)?)),
        Value::String(s) => ev.set("samplers", json!(s)),
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::values::stoi;

    fn eval_plain(body: Value) -> Result<Map<String, Value>, String> {
        let no_schema = |_: &Value| -> Result<String, String> { Ok("root ::= \"{}\"".into()) };
        let no_parser = |_: &str| -> Result<(), String> { Ok(()) };
        let ctx = Context { vocab: None, n_parallel: 4, dry_base_default: 1.75, schema_to_grammar: &no_schema, check_chat_parser: &no_parser };
        eval(body.as_object().unwrap(), &ctx).map_err(|e| e.message)
    }

    #[test]
    fn numbers_convert_as_nlohmann_does() {
        assert_eq!(get_i32(&json!(true)), Ok(1));
        assert_eq!(get_i32(&json!(3.9)), Ok(3));
        assert_eq!(get_i32(&json!(-3.9)), Ok(-3));
        assert_eq!(get_i32(&json!(1e300)), Ok(i32::MIN));
        assert_eq!(get_i32(&json!(2147483648u64)), Ok(i32::MIN));
        assert_eq!(get_i32(&json!(4294967297u64)), Ok(1));
        assert_eq!(get_u32(&json!(-1)), Ok(u32::MAX));
        assert_eq!(get_u32(&json!(-1.0)), Ok(u32::MAX));
        assert_eq!(get_i64(&json!(true)), Err("[json.exception.type_error.302] type must be number, but is boolean".into()));
        assert_eq!(get_i64(&json!(1e300)), Ok(i64::MIN));
        assert_eq!(get_f32(&json!(1e39)), Ok(f32::INFINITY));
        assert_eq!(get_bool(&json!(1)), Err("[json.exception.type_error.302] type must be boolean, but is number".into()));
    }

    #[test]
    fn soft_limits_clamp_and_hard_limits_refuse() {
        let out = eval_plain(json!({"mirostat": 7, "top_p": 3.0, "temperature": -1})).unwrap();
        assert_eq!(out["mirostat"], 2);
        assert_eq!(out["top_p"], 1.0);
        assert_eq!(out["temperature"], 0.0);
        assert_eq!(eval_plain(json!({"n_predict": -5})).unwrap_err(), "Field 'n_predict': Value must be between -1 <= value <= 2147483647, but got -5");
        assert_eq!(
            eval_plain(json!({"adaptive_decay": 1.5})).unwrap_err(),
            "Field 'adaptive_decay': Value must be between 0.000000 <= value <= 0.990000, but got 1.500000"
        );
        assert_eq!(eval_plain(json!({"n": 5})).unwrap_err(), "Field 'n': Value must be between 1 <= value <= 4, but got 5");
    }

    #[test]
    fn aliases_and_order_follow_upstream() {
        let out = eval_plain(json!({"max_tokens": 9, "logprobs": 3})).unwrap();
        assert_eq!(out["n_predict"], 9);
        assert_eq!(out["n_probs"], 3);
        // n_predict comes before its aliases, and before the later n_keep
        let out = eval_plain(json!({"n_predict": 2, "max_tokens": "x"})).unwrap();
        assert_eq!(out["n_predict"], 2);
        let err = eval_plain(json!({"n_keep": -9, "stream": "yes"})).unwrap_err();
        assert_eq!(err, "Field 'stream': [json.exception.type_error.302] type must be boolean, but is string");
        // null means absent
        assert!(!eval_plain(json!({"n_predict": null})).unwrap().contains_key("n_predict"));
    }

    #[test]
    fn handlers_refuse_what_upstream_refuses() {
        assert_eq!(eval_plain(json!({"reasoning_format": "x"})).unwrap_err(), "Field 'reasoning_format': Unknown reasoning format: x");
        assert_eq!(
            eval_plain(json!({"dry_sequence_breakers": []})).unwrap_err(),
            "Field 'dry_sequence_breakers': Error: dry_sequence_breakers must be a non-empty array of strings"
        );
        assert_eq!(eval_plain(json!({"lora": {}})).unwrap_err(), "Field 'lora': Error: 'lora' must be an array of objects with 'id' and 'scale' fields");
        assert_eq!(eval_plain(json!({"stop": ["a", 5]})).unwrap_err(), "Field 'stop': [json.exception.type_error.302] type must be string, but is number");
        assert_eq!(eval_plain(json!({"stop": ["a", null, []]})).unwrap()["stop"], json!(["a"]));
        assert_eq!(eval_plain(json!({"dry_base": 0.5})).unwrap()["dry_base"], 1.75);
    }

    #[test]
    fn triggers_that_would_abort_llama_cpp_are_refused() {
        let err = eval_plain(json!({"grammar_triggers": [{"type": 99, "value": "x"}]})).unwrap_err();
        assert!(err.starts_with("Field 'grammar_triggers': unknown grammar trigger type 99"), "{err}");
        let err = eval_plain(json!({"grammar_triggers": [5]})).unwrap_err();
        assert_eq!(err, "Field 'grammar_triggers': [json.exception.type_error.304] cannot use at() with number");
        let err = eval_plain(json!({"grammar_lazy": true, "grammar_triggers": []})).unwrap_err();
        assert_eq!(err, "Field 'grammar_triggers': Error: no triggers set for lazy grammar!");
    }

    #[test]
    fn repetitions_whose_maximum_is_below_the_minimum_are_refused() {
        assert!(check_repetitions("root ::= \"a\"{5,2}").unwrap_err().contains("{5,2}"));
        assert!(check_repetitions("root ::= [a-z]{ 3 , 1 } x").is_err());
        for fine in [
            "root ::= \"a\"{2,5}",
            "root ::= \"a\"{3}",
            "root ::= \"a\"{3,}",
            "root ::= \"{5,2}\"",
            "root ::= [{5,2}]",
            "root ::= \"\\\"{5,2}\"",
            "# {5,2}\nroot ::= \"a\"",
        ] {
            assert_eq!(check_repetitions(fine), Ok(()), "{fine}");
        }
        let err = eval_plain(json!({"grammar": "root ::= \"a\"{9,1}"})).unwrap_err();
        assert_eq!(err, "Field 'grammar': grammar repetition {9,1} has a maximum below its minimum");
    }

    #[test]
    fn strtol_reads_like_c() {
        assert_eq!(strtol("42"), Some(42));
        assert_eq!(strtol(" -3"), Some(-3));
        assert_eq!(strtol("4x"), None);
        assert_eq!(strtol(""), Some(0));
        assert_eq!(strtol("hello"), None);
        assert_eq!(stoi(" 5abc"), Some(5));
        assert_eq!(stoi("-1"), Some(-1));
        assert_eq!(stoi("x"), None);
        assert_eq!(stoi("99999999999"), None);
        assert_eq!(strtol("99999999999"), Some(1215752191));
        assert_eq!(strtol("99999999999999999999"), Some(-1));
        assert_eq!(strtol("-99999999999999999999"), Some(0));
    }
}
