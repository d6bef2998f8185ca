//! The built-in tools `--tools` enables: minimal file and shell access for an agent.

use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};

use super::edit::{self, Edit};
use super::io::{ListKind, NOT_A_DIRECTORY};
use super::params::{bool_or, int_or, object, required, required_str, str_or};
use super::{Call, Sink, Tool, ToolError};

/// Every built-in tool, in the order `GET /tools` lists them.
pub fn all() -> Vec<Box<dyn Tool>> {
    vec![
        Box::new(ReadFile),
        Box::new(FileGlobSearch),
        Box::new(GrepSearch),
        Box::new(ExecShellCommand),
        Box::new(WriteFile),
        Box::new(EditFile),
        Box::new(GetInfo),
    ]
}

fn function(name: &str, description: &str, parameters: Value) -> Value {
    json!({"type": "function", "function": {"name": name, "description": description, "parameters": parameters}})
}

/// A failure the model should read: a 200 answer carrying `error`.
fn failure(message: impl Into<String>) -> Result<Value, ToolError> {
    Ok(json!({"error": message.into()}))
}

const READ_FILE_MAX: usize = 16 * 1024;
const READ_FILE_MAX_BASE64: u64 = 32 * 1024 * 1024;
const TRUNCATED: &str = "[output truncated]";

/// Lines as C++ `getline` yields them: a final newline does not start another line.
fn lines(content: &[u8]) -> impl Iterator<Item = &[u8]> {
    let body = content.strip_suffix(b"\n").unwrap_or(content);
    let empty = content.is_empty();
    body.split(|&b| b == b'\n').filter(move |_| !empty)
}

struct ReadFile;

impl Tool for ReadFile {
    fn name(&self) -> &str {
        "read_file"
    }

    fn display_name(&self) -> &str {
        "Read file"
    }

    fn uses_cwd(&self) -> bool {
        true
    }

    fn definition(&self) -> Value {
        function(
            self.name(),
            "Read the contents of a file. Optionally specify a 1-based line range. If append_loc is true, each line is prefixed with its line number (e.g. \"1\u{2192}...\").",
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path to the file"},
                    "start_line": {"type": "integer", "description": "First line to read, 1-based (default: 1)"},
                    "end_line": {"type": "integer", "description": "Last line to read, 1-based inclusive (default: end of file)"},
                    "append_loc": {"type": "boolean", "description": "Prefix each line with its line number"},
                },
                "required": ["path"],
            }),
        )
    }

    fn invoke(&self, call: &Call, _: Option<&mut dyn Sink>) -> Result<Value, ToolError> {
        let p = &call.params;
        let path = required_str(p, "path")?;
        let start_line = int_or(p, "start_line", 1);
        let end_line = int_or(p, "end_line", -1);
        let append_loc = bool_or(p, "append_loc", false);
        let io = call.io()?;

        let Some(size) = io.file_size(&path) else {
            return failure(format!("cannot stat file: {path}"));
        };
        if call.resp_type() == "base64" {
            if size > READ_FILE_MAX_BASE64 {
                return failure(format!("file too large ({size} bytes, max {READ_FILE_MAX_BASE64})"));
            }
            let Some(content) = io.read(&path) else {
                return failure(format!("failed to open file: {path}"));
            };
            let encoded = base64::engine::general_purpose::STANDARD.encode(&content);
            return Ok(json!({"base64": encoded, "size_bytes": content.len()}));
        }
        if size > READ_FILE_MAX as u64 && end_line == -1 {
            return failure(format!("file too large ({size} bytes, max {READ_FILE_MAX}). Use start_line/end_line to read a portion."));
        }
        let Some(content) = io.read(&path) else {
            return failure(format!("failed to open file: {path}"));
        };

        let mut out: Vec<u8> = Vec::new();
        for (lineno, line) in (1i64..).zip(lines(&content)) {
            if lineno < start_line {
                continue;
            }
            if end_line != -1 && lineno > end_line {
                break;
            }
            let prefix = if append_loc { format!("{lineno}\u{2192}") } else { String::new() };
            if out.len() + prefix.len() + line.len() + 1 > READ_FILE_MAX {
                out.extend_from_slice(TRUNCATED.as_bytes());
                break;
            }
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(line);
            out.push(b'\n');
        }
        Ok(json!({"plain_text_response": String::from_utf8_lossy(&out)}))
    }
}

const GLOB_MAX_RESULTS: i64 = 100;

struct FileGlobSearch;

impl Tool for FileGlobSearch {
    fn name(&self) -> &str {
        "file_glob_search"
    }

    fn display_name(&self) -> &str {
        "File search"
    }

    fn uses_cwd(&self) -> bool {
        true
    }

    fn definition(&self) -> Value {
        function(
            self.name(),
            "Recursively search for files matching a glob pattern under a directory. Automatically skips files ignored by .gitignore (when the directory is inside a git repo) and common junk directories (.git, node_modules, build, dist, etc.) otherwise. A pattern with no '/' (e.g. \"*.cpp\") matches the file's basename at any depth. A pattern containing '/' matches the full relative path; unless already anchored with \"**/\" or a leading '/', it is automatically prefixed with \"**/\". Use type=\"dir\" or \"all\" to also list directories; directory entries are suffixed with '/' in the output. Note: directory listings do not apply .gitignore filtering.",
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Base directory to search in"},
                    "include": {"type": "string", "description": "Glob pattern for files to include (e.g. \"*.cpp\" or \"src/**/*.cpp\"). Default: **"},
                    "exclude": {"type": "string", "description": "Glob pattern for files to exclude"},
                    "type": {"type": "string", "description": "Entry type to return: \"file\" (default), \"dir\" or \"all\""},
                    "max_depth": {"type": "integer", "description": "Maximum depth to descend into subdirectories (default: 0 = unlimited; 1 = direct children only)"},
                    "limit": {"type": "integer", "description": format!("Maximum number of results to return, capped at {GLOB_MAX_RESULTS} (default {GLOB_MAX_RESULTS})")},
                },
                "required": ["path"],
            }),
        )
    }

    fn invoke(&self, call: &Call, _: Option<&mut dyn Sink>) -> Result<Value, ToolError> {
        let p = &call.params;
        let io = call.io()?;
        let path = required_str(p, "path")?;
        let base = io.resolve(&path);
        let include = str_or(p, "include", "**");
        let exclude = str_or(p, "exclude", "");
        let kind = str_or(p, "type", "file");
        let max_depth = int_or(p, "max_depth", 0).max(0) as usize;
        let limit = int_or(p, "limit", GLOB_MAX_RESULTS);
        if limit < 1 {
            return failure(format!("invalid limit: {limit} (expected 1 or more)"));
        }
        let limit = limit.min(GLOB_MAX_RESULTS) as usize;
        let kind = match kind.as_str() {
            "file" => ListKind::Files,
            "dir" => ListKind::Dirs,
            "all" => ListKind::All,
            other => return failure(format!("invalid type: {other} (expected \"file\", \"dir\" or \"all\")")),
        };

        let Some(listing) = io.list(&base, max_depth, kind) else {
            return failure(format!("{NOT_A_DIRECTORY}: {path}"));
        };
        let matches: Vec<_> = listing
            .entries
            .iter()
            .filter(|e| super::glob::path_glob_match(&include, &e.rel))
            .filter(|e| exclude.is_empty() || !super::glob::path_glob_match(&exclude, &e.rel))
            .collect();
        let total = matches.len();
        let shown = &matches[..total.min(limit)];

        let mut text = String::new();
        let mut entries = Vec::with_capacity(shown.len());
        for e in shown {
            text += &e.rel;
            text += if e.is_dir { "/\n" } else { "\n" };
            entries.push(json!({"path": e.rel, "type": if e.is_dir { "dir" } else { "file" }}));
        }
        text += &format!("\n---\nTotal matches: {total}\n");
        if total > shown.len() {
            text += &format!("[{} results limit reached ({total} total matches). Refine the glob pattern to narrow the search.]\n", shown.len());
        }
        if listing.truncated {
            text += "[results truncated: time budget or unreadable directory]\n";
        }
        // `base` is absolute, so a client (the web UI's picker) can join the relative entries
        Ok(json!({"plain_text_response": text, "entries": entries, "base": base}))
    }
}

const GREP_MAX_RESULTS: usize = 100;

struct GrepSearch;

impl Tool for GrepSearch {
    fn name(&self) -> &str {
        "grep_search"
    }

    fn display_name(&self) -> &str {
        "Grep search"
    }

    fn uses_cwd(&self) -> bool {
        true
    }

    fn definition(&self) -> Value {
        function(
            self.name(),
            "Search for a pattern in files under a path. Returns matching lines with file paths (and, unless searching a single file, paths relative to the given directory). Automatically skips files ignored by .gitignore (when the directory is inside a git repo) and common junk directories (.git, node_modules, build, dist, etc.) otherwise. include/exclude: a pattern with no '/' matches the basename at any depth; a pattern containing '/' matches the full relative path (auto-anchored with \"**/\" unless already anchored).",
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "File or directory to search in"},
                    "pattern": {"type": "string", "description": "Pattern to search for (regular expression unless literal is true)"},
                    "include": {"type": "string", "description": "Glob pattern to filter files (default: **)"},
                    "exclude": {"type": "string", "description": "Glob pattern to exclude files"},
                    "return_line_numbers": {"type": "boolean", "description": "If true, include line numbers in results"},
                    "literal": {"type": "boolean", "description": "Treat pattern as a literal string instead of a regular expression (default: false)"},
                    "ignore_case": {"type": "boolean", "description": "Case-insensitive search (default: false)"},
                    "context_lines": {"type": "integer", "description": "Number of lines of context to show before and after each match (default: 0)"},
                },
                "required": ["path", "pattern"],
            }),
        )
    }

    fn invoke(&self, call: &Call, _: Option<&mut dyn Sink>) -> Result<Value, ToolError> {
        let p = &call.params;
        let path = required_str(p, "path")?;
        let pattern = required_str(p, "pattern")?;
        let include = str_or(p, "include", "**");
        let exclude = str_or(p, "exclude", "");
        let show_lineno = bool_or(p, "return_line_numbers", false);
        let literal = bool_or(p, "literal", false);
        let ignore_case = bool_or(p, "ignore_case", false);
        let ctx = int_or(p, "context_lines", 0).max(0) as usize;

        let source = if literal { regex::escape(&pattern) } else { pattern };
        let re = match regex::bytes::RegexBuilder::new(&source).case_insensitive(ignore_case).build() {
            Ok(re) => re,
            Err(e) => return failure(format!("invalid regex: {e}")),
        };

        let io = call.io()?;
        let abs = io.resolve(&path);
        let files: Vec<(String, String)> = if io.is_file(&abs) {
            vec![(abs, path)]
        } else if io.is_dir(&abs) {
            let Some(listing) = io.list(&abs, 0, ListKind::Files) else {
                return failure(format!("{NOT_A_DIRECTORY}: {path}"));
            };
            listing
                .entries
                .into_iter()
                .filter(|e| super::glob::path_glob_match(&include, &e.rel))
                .filter(|e| exclude.is_empty() || !super::glob::path_glob_match(&exclude, &e.rel))
                .map(|e| (format!("{}/{}", abs.trim_end_matches('/'), e.rel), e.rel))
                .collect()
        } else {
            return failure(format!("path does not exist: {path}"));
        };

        let show_num = show_lineno || ctx > 0;
        let mut out: Vec<u8> = Vec::new();
        let mut total = 0usize;
        let mut limit_reached = false;
        'files: for (file, display) in &files {
            let Some(content) = io.read(file) else { continue };
            let lines: Vec<&[u8]> = lines(&content).collect();
            for (i, line) in lines.iter().enumerate() {
                if total >= GREP_MAX_RESULTS {
                    limit_reached = true;
                    break 'files;
                }
                if !re.is_match(line) {
                    continue;
                }
                let (from, to) = (i.saturating_sub(ctx), (i + ctx).min(lines.len() - 1));
                for (j, shown) in lines.iter().enumerate().take(to + 1).skip(from) {
                    let sep = if j == i { ':' } else { '-' };
                    out.extend_from_slice(format!("{display}{sep}").as_bytes());
                    if show_num {
                        out.extend_from_slice(format!("{}{sep}", j + 1).as_bytes());
                    }
                    out.extend_from_slice(shown);
                    out.push(b'\n');
                }
                if ctx > 0 {
                    out.extend_from_slice(b"--\n");
                }
                total += 1;
            }
        }
        let mut text = String::from_utf8_lossy(&out).into_owned();
        text += &format!("\n---\nTotal matches: {total}\n");
        if limit_reached {
            text += &format!("[{GREP_MAX_RESULTS} matches limit reached. Narrow the path/pattern/include to see more.]\n");
        }
        Ok(json!({"plain_text_response": text}))
    }
}

const SHELL_MAX_OUTPUT: usize = 16 * 1024;
const SHELL_MAX_TIMEOUT_SECS: i64 = 60;
const SHELL_DEFAULT_TIMEOUT_SECS: i64 = 10;

struct ExecShellCommand;

impl Tool for ExecShellCommand {
    fn name(&self) -> &str {
        "exec_shell_command"
    }

    fn display_name(&self) -> &str {
        "Execute shell command"
    }

    fn writes(&self) -> bool {
        true
    }

    fn streams(&self) -> bool {
        true
    }

    fn uses_cwd(&self) -> bool {
        true
    }

    fn definition(&self) -> Value {
        function(
            self.name(),
            "Execute a shell command and return its output (stdout and stderr combined).",
            json!({
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "Shell command to execute"},
                    "timeout": {"type": "integer", "description": format!("Timeout in seconds (default {SHELL_DEFAULT_TIMEOUT_SECS}, max {SHELL_MAX_TIMEOUT_SECS})")},
                    "max_output_size": {"type": "integer", "description": format!("Maximum output size in bytes (default {SHELL_MAX_OUTPUT})")},
                },
                "required": ["command"],
            }),
        )
    }

    fn invoke(&self, call: &Call, sink: Option<&mut dyn Sink>) -> Result<Value, ToolError> {
        let p = &call.params;
        let command = required_str(p, "command")?;
        let timeout = int_or(p, "timeout", SHELL_DEFAULT_TIMEOUT_SECS).clamp(0, SHELL_MAX_TIMEOUT_SECS);
        let max_output = usize::try_from(int_or(p, "max_output_size", SHELL_MAX_OUTPUT as i64)).map_or(SHELL_MAX_OUTPUT, |n| n.min(SHELL_MAX_OUTPUT));
        let timeout = Duration::from_secs(timeout as u64);
        let argv = vec!["sh".to_string(), "-c".to_string(), command];
        let io = call.io()?;

        let Some(sink) = sink else {
            let res = io.run(&argv, max_output, timeout, None);
            let mut text = res.text();
            text += &exit_note(res.exit_code, res.timed_out);
            return Ok(json!({"plain_text_response": text}));
        };
        let mut forward = |chunk: &[u8]| {
            sink.push(chunk);
            sink.alive()
        };
        let res = io.run(&argv, max_output, timeout, Some(&mut forward));
        if sink.alive() {
            sink.push(exit_note(res.exit_code, res.timed_out).as_bytes());
        }
        Ok(Value::Null)
    }
}

fn exit_note(exit_code: i32, timed_out: bool) -> String {
    let mut note = format!("\n[exit code: {exit_code}]");
    if timed_out {
        note += " [exit due to timed out]";
    }
    note
}

struct WriteFile;

impl Tool for WriteFile {
    fn name(&self) -> &str {
        "write_file"
    }

    fn display_name(&self) -> &str {
        "Write file"
    }

    fn writes(&self) -> bool {
        true
    }

    fn uses_cwd(&self) -> bool {
        true
    }

    fn definition(&self) -> Value {
        function(
            self.name(),
            "Write content to a file, creating it (including parent directories) if it does not exist. May use with edit_file for more complex edits.",
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path of the file to write"},
                    "content": {"type": "string", "description": "Content to write"},
                },
                "required": ["path", "content"],
            }),
        )
    }

    fn invoke(&self, call: &Call, _: Option<&mut dyn Sink>) -> Result<Value, ToolError> {
        let path = required_str(&call.params, "path")?;
        let content = required_str(&call.params, "content")?;
        if !call.io()?.write(&path, content.as_bytes()) {
            return failure(format!("failed to write file: {path}"));
        }
        Ok(json!({"result": "file written successfully", "path": path, "bytes": content.len()}))
    }
}

struct EditFile;

impl Tool for EditFile {
    fn name(&self) -> &str {
        "edit_file"
    }

    fn display_name(&self) -> &str {
        "Edit file"
    }

    fn writes(&self) -> bool {
        true
    }

    fn uses_cwd(&self) -> bool {
        true
    }

    fn definition(&self) -> Value {
        function(
            self.name(),
            "Edit a file using exact text replacement. Each edits[].old_text must be unique in the file and is matched against the original content, not incrementally. Merge nearby changes into one edit instead of overlapping edits. Use write_file to replace the whole file.",
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path to the file to edit"},
                    "edits": {
                        "type": "array",
                        "description": "One or more exact text replacements to apply",
                        "items": {
                            "type": "object",
                            "properties": {
                                "old_text": {"type": "string", "description": "Exact text to find; must be unique in the file and must not overlap with other edits"},
                                "new_text": {"type": "string", "description": "Text to replace old_text with"},
                            },
                            "required": ["old_text", "new_text"],
                        },
                    },
                },
                "required": ["path", "edits"],
            }),
        )
    }

    fn invoke(&self, call: &Call, _: Option<&mut dyn Sink>) -> Result<Value, ToolError> {
        let path = required_str(&call.params, "path")?;
        let list = match required(&call.params, "edits")? {
            Value::Array(items) if !items.is_empty() => items,
            _ => return failure("\"edits\" must be a non-empty array"),
        };
        let mut edits = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            let item = object(item)?;
            let old_text = required_str(item, "old_text")?;
            let new_text = required_str(item, "new_text")?;
            if old_text.is_empty() {
                return failure(format!("edits[{i}].old_text must not be empty"));
            }
            edits.push(Edit { old_text: old_text.into_bytes(), new_text: new_text.into_bytes() });
        }

        let io = call.io()?;
        let Some(original) = io.read(&path) else {
            return failure(format!("failed to open file: {path}"));
        };
        let updated = match edit::apply(&original, &edits) {
            Ok(c) => c,
            Err(e) => return failure(e.message(&path)),
        };
        if updated == original {
            return failure("no changes made: the replacement(s) produced identical content");
        }
        if !io.write(&path, &updated) {
            return failure(format!("failed to write file: {path}"));
        }
        Ok(json!({"result": "file edited successfully", "path": path, "edits_applied": edits.len()}))
    }
}

const GET_INFO_MAX_OUTPUT: usize = 4096;
const GET_INFO_TIMEOUT: Duration = Duration::from_secs(5);

struct GetInfo;

impl Tool for GetInfo {
    fn name(&self) -> &str {
        "get_info"
    }

    fn display_name(&self) -> &str {
        "Get Runtime Info"
    }

    fn uses_cwd(&self) -> bool {
        true
    }

    fn definition(&self) -> Value {
        function(self.name(), "Returns runtime info: the OS name/version and the current working directory", json!({"type": "object", "properties": {}}))
    }

    fn invoke(&self, call: &Call, _: Option<&mut dyn Sink>) -> Result<Value, ToolError> {
        let io = call.io()?;
        let run = |argv: &[&str]| {
            let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
            let res = io.run(&argv, GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT, None);
            if res.ok() {
                res.text().trim().to_string()
            } else {
                "unknown".to_string()
            }
        };
        let os = run(&["uname", "-a"]);
        let mut cwd = call.cwd().to_string();
        if cwd.is_empty() {
            cwd = if io.is_isolated() { run(&["pwd"]) } else { std::env::current_dir().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default() };
        }
        Ok(json!({"os": os, "cwd": cwd}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(content: &str) -> Vec<String> {
        lines(content.as_bytes()).map(|l| String::from_utf8(l.to_vec()).unwrap()).collect()
    }

    #[test]
    fn lines_split_like_getline() {
        assert!(text("").is_empty());
        assert_eq!(text("a"), ["a"]);
        assert_eq!(text("a\n"), ["a"]);
        assert_eq!(text("a\n\n"), ["a", ""]);
        assert_eq!(text("a\r\nb"), ["a\r", "b"]);
    }

    #[test]
    fn exit_note_marks_timeouts() {
        assert_eq!(exit_note(0, false), "\n[exit code: 0]");
        assert_eq!(exit_note(1, true), "\n[exit code: 1] [exit due to timed out]");
    }
}
