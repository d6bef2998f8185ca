//! Reading a tool call's JSON the way llama-server does: a missing or mistyped required field is
//! a bad request worded as llama.cpp's JSON library words it; an optional field of the wrong
//! type falls back to its default.

use serde_json::{Map, Value};

use super::ToolError;
use crate::api::values::{type_error, type_name};

pub fn key_not_found(key: &str) -> ToolError {
    ToolError::BadRequest(format!("[json.exception.out_of_range.403] key '{key}' not found"))
}

pub fn wrong_type(expected: &str, got: &Value) -> ToolError {
    ToolError::BadRequest(type_error(expected, got))
}

pub fn not_an_object(op: &str, got: &Value) -> ToolError {
    let code = if op == "at()" { 304 } else { 306 };
    ToolError::BadRequest(format!("[json.exception.type_error.{code}] cannot use {op} with {}", type_name(got)))
}

/// `v` as an object, for an `at()` lookup on it.
pub fn object(v: &Value) -> Result<&Map<String, Value>, ToolError> {
    v.as_object().ok_or_else(|| not_an_object("at()", v))
}

pub fn required<'a>(map: &'a Map<String, Value>, key: &str) -> Result<&'a Value, ToolError> {
    map.get(key).ok_or_else(|| key_not_found(key))
}

pub fn required_str(map: &Map<String, Value>, key: &str) -> Result<String, ToolError> {
    let v = required(map, key)?;
    v.as_str().map(String::from).ok_or_else(|| wrong_type("string", v))
}

pub fn str_or(map: &Map<String, Value>, key: &str, default: &str) -> String {
    map.get(key).and_then(Value::as_str).unwrap_or(default).to_string()
}

pub fn bool_or(map: &Map<String, Value>, key: &str, default: bool) -> bool {
    map.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// Integers also accept a float (truncated) or a boolean, as the C++ conversion does.
pub fn int_or(map: &Map<String, Value>, key: &str, default: i64) -> i64 {
    match map.get(key) {
        Some(Value::Number(n)) => n.as_i64().or_else(|| n.as_f64().map(|f| f as i64)).unwrap_or(default),
        Some(Value::Bool(b)) => i64::from(*b),
        _ => default,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn required_fields_word_errors_like_llama_cpp() {
        let m = json!({"path": 3}).as_object().unwrap().clone();
        assert_eq!(required_str(&m, "tool").unwrap_err().to_string(), "[json.exception.out_of_range.403] key 'tool' not found");
        assert_eq!(required_str(&m, "path").unwrap_err().to_string(), "[json.exception.type_error.302] type must be string, but is number");
        assert_eq!(object(&json!([1])).unwrap_err().to_string(), "[json.exception.type_error.304] cannot use at() with array");
    }

    #[test]
    fn optional_fields_fall_back_on_wrong_types() {
        let m = json!({"a": "x", "b": 2.9, "c": true, "d": null}).as_object().unwrap().clone();
        assert_eq!(int_or(&m, "a", 7), 7);
        assert_eq!(int_or(&m, "b", 7), 2);
        assert_eq!(int_or(&m, "c", 7), 1);
        assert_eq!(int_or(&m, "d", 7), 7);
        assert!(bool_or(&m, "b", true));
        assert_eq!(str_or(&m, "b", "dflt"), "dflt");
        assert_eq!(str_or(&m, "a", "dflt"), "x");
    }
}
