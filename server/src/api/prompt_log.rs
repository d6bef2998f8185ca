//! --log-prompts-dir: every completion request's prompt in a file of its own, named and written
//! as llama-server's handle_completions_impl does it, before the prompt is tokenized.

use std::path::Path;

use serde_json::Value;

/// Writes `prompt` to `<dir>/<ms>.txt`, `<ms>` being ggml's clock (ggml_time_ms) in 12 digits:
/// a string's bytes up to its first NUL (llama-server writes it through c_str()), anything else
/// as JSON indented by two spaces. Nothing happens when `dir` is empty; a file that cannot be
/// written is logged and the request goes on.
pub fn write(dir: &str, prompt: &Value) {
    if dir.is_empty() {
        return;
    }
    let path = Path::new(dir).join(format!("{:012}.txt", strata_ffi::time_ms()));
    if std::fs::write(&path, contents(prompt)).is_err() {
        crate::log::srv(strata_ffi::Verbosity::Error, "handle_compl", &format!("failed to create {}", path.display()));
    }
}

fn contents(prompt: &Value) -> Vec<u8> {
    match prompt {
        Value::String(s) => s.as_bytes().split(|&b| b == 0).next().unwrap_or_default().to_vec(),
        other => serde_json::to_vec_pretty(other).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::contents;

    #[test]
    fn strings_stop_at_nul_and_the_rest_is_indented_json() {
        assert_eq!(contents(&json!("a\nb\u{0}c")), b"a\nb");
        assert_eq!(contents(&json!([1, 2])), b"[\n  1,\n  2\n]");
        assert_eq!(contents(&json!(["x", 3, {"prompt_string": "é"}])), "[\n  \"x\",\n  3,\n  {\n    \"prompt_string\": \"é\"\n  }\n]".as_bytes());
    }
}
