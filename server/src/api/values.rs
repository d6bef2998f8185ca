//! Reading JSON values as llama-server's nlohmann::json conversions do. A boolean is a number
//! for 32-bit fields but not for 64-bit ones, a float truncates into an integer the way x86's
//! `cvttsd2si` does, an integer wraps into a narrower one; a value of the wrong kind is a
//! `[json.exception.type_error.302]`.

use serde_json::{Map, Value};

/// nlohmann's name for a value's type, as its errors print it.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

pub fn type_error(expected: &str, v: &Value) -> String {
    format!("[json.exception.type_error.302] type must be {expected}, but is {}", type_name(v))
}

/// The integer x86's truncating conversion gives for `f` in a signed field of `bits` bits:
/// the truncated value when it fits, else the "integer indefinite" value (the minimum).
fn truncate_f64(f: f64, bits: u32) -> i64 {
    let t = f.trunc();
    let lim = 2f64.powi(bits as i32 - 1);
    if t.is_nan() || t < -lim || t >= lim {
        if bits == 64 {
            i64::MIN
        } else {
            i32::MIN as i64
        }
    } else {
        t as i64
    }
}

/// `get<int32_t>()`.
pub fn get_i32(v: &Value) -> Result<i32, String> {
    match v {
        Value::Bool(b) => Ok(*b as i32),
        Value::Number(n) => Ok(if let Some(i) = n.as_i64() {
            i as i32
        } else if let Some(u) = n.as_u64() {
            u as i32
        } else {
            truncate_f64(n.as_f64().unwrap_or(0.0), 32) as i32
        }),
        _ => Err(type_error("number", v)),
    }
}

/// `get<int64_t>()`: the library's own integer type, which takes no boolean.
pub fn get_i64(v: &Value) -> Result<i64, String> {
    match v {
        Value::Number(n) => Ok(if let Some(i) = n.as_i64() {
            i
        } else if let Some(u) = n.as_u64() {
            u as i64
        } else {
            truncate_f64(n.as_f64().unwrap_or(0.0), 64)
        }),
        _ => Err(type_error("number", v)),
    }
}

/// `get<uint32_t>()`: compilers convert a double through a 64-bit signed integer.
pub fn get_u32(v: &Value) -> Result<u32, String> {
    match v {
        Value::Bool(b) => Ok(*b as u32),
        Value::Number(n) => Ok(if let Some(i) = n.as_i64() {
            i as u32
        } else if let Some(u) = n.as_u64() {
            u as u32
        } else {
            truncate_f64(n.as_f64().unwrap_or(0.0), 64) as u32
        }),
        _ => Err(type_error("number", v)),
    }
}

/// `get<float>()`.
pub fn get_f32(v: &Value) -> Result<f32, String> {
    match v {
        Value::Bool(b) => Ok(*b as i32 as f32),
        Value::Number(n) => Ok(if let Some(i) = n.as_i64() {
            i as f32
        } else if let Some(u) = n.as_u64() {
            u as f32
        } else {
            n.as_f64().unwrap_or(0.0) as f32
        }),
        _ => Err(type_error("number", v)),
    }
}

pub fn get_bool(v: &Value) -> Result<bool, String> {
    v.as_bool().ok_or_else(|| type_error("boolean", v))
}

pub fn get_str(v: &Value) -> Result<&str, String> {
    v.as_str().ok_or_else(|| type_error("string", v))
}

/// `get<std::vector<std::string>>()`.
pub fn get_strings(v: &Value) -> Result<Vec<String>, String> {
    match v {
        Value::Array(items) => items.iter().map(|s| get_str(s).map(String::from)).collect(),
        _ => Err(type_error("array", v)),
    }
}

/// What iterating a value gives in nlohmann: an array's or object's elements, a scalar once,
/// null never.
pub fn elements(v: &Value) -> Vec<&Value> {
    match v {
        Value::Null => Vec::new(),
        Value::Array(a) => a.iter().collect(),
        Value::Object(o) => o.values().collect(),
        other => vec![other],
    }
}

/// `at(key)` on `v`, with nlohmann's errors for a missing key or a non-object.
pub fn at<'a>(v: &'a Value, key: &str) -> Result<&'a Value, String> {
    match v {
        Value::Object(o) => o.get(key).ok_or_else(|| format!("[json.exception.out_of_range.403] key '{key}' not found")),
        other => Err(format!("[json.exception.type_error.304] cannot use at() with {}", type_name(other))),
    }
}

/// llama-server's `json_value(body, key, default)`: a value of the wrong type, or null, gives
/// the default (upstream logs a warning and goes on).
pub fn lenient<'a, T>(body: &'a Map<String, Value>, key: &str, get: impl Fn(&'a Value) -> Result<T, String>, default: T) -> T {
    match body.get(key) {
        Some(v) if !v.is_null() => get(v).unwrap_or(default),
        _ => default,
    }
}

/// `std::to_string` of a number, as a hard limit's message prints it.
pub trait Printed {
    fn printed(&self) -> String;
}

impl Printed for i32 {
    fn printed(&self) -> String {
        self.to_string()
    }
}

impl Printed for i64 {
    fn printed(&self) -> String {
        self.to_string()
    }
}

impl Printed for f32 {
    fn printed(&self) -> String {
        format!("{:.6}", *self as f64)
    }
}

pub fn limited<T: PartialOrd + Copy + Printed>(v: T, min: T, max: T, hard: bool) -> Result<T, String> {
    if !hard {
        // std::max(min, std::min(max, v))
        let hi = if max < v { max } else { v };
        return Ok(if hi < min { min } else { hi });
    }
    if v < min || v > max {
        return Err(format!("Value must be between {} <= value <= {}, but got {}", min.printed(), max.printed(), v.printed()));
    }
    Ok(v)
}

/// C++'s `std::stoi`: leading whitespace, a sign and digits, anything after them ignored;
/// None where it throws (no digits, out of int's range).
pub fn stoi(s: &str) -> Option<i32> {
    let t = s.trim_start_matches([' ', '\t', '\n', '\x0B', '\x0C', '\r']);
    let (sign, rest) = match t.as_bytes().first() {
        Some(b'-') => ("-", &t[1..]),
        Some(b'+') => ("", &t[1..]),
        _ => ("", t),
    };
    let digits = &rest[..rest.bytes().take_while(u8::is_ascii_digit).count()];
    if digits.is_empty() {
        return None;
    }
    format!("{sign}{digits}").parse::<i32>().ok()
}

/// C's `strtol(s, &end, 10)` when it consumes the whole string (as a 32-bit llama_token).
pub fn strtol(s: &str) -> Option<i64> {
    let t = s.trim_start_matches(|c: char| c.is_ascii_whitespace());
    let (neg, digits) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return if s.is_empty() { Some(0) } else { None };
    }
    // out of range, strtol gives LONG_MIN or LONG_MAX
    let v = format!("{}{digits}", if neg { "-" } else { "" }).parse::<i64>().unwrap_or(if neg { i64::MIN } else { i64::MAX });
    Some(v as i32 as i64)
}
