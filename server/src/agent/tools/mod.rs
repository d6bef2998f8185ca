//! Built-in tools for agents (`--tools`), served as llama-server serves them: `GET /tools`
//! lists the enabled tools, `POST /tools` runs one, answering once or as a stream of output.
//! Each call runs on the host or in an isolate (`x-tool-runtime`, `--tools-runtime`), relative
//! to a working directory the client picks (`x-tool-cwd`), never one the model picks.

mod builtin;
mod edit;
mod glob;
pub mod http;
mod io;
pub(crate) mod params;
mod process;
mod routes;
mod runtime;

use std::sync::Arc;

use serde_json::{json, Map, Value};

pub(crate) use routes::call;

use io::ToolIo;

/// How a tool call fails outside the tool itself; a tool's own failures are answers carrying
/// `error`, for the model to read.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The request's JSON is malformed or lacks a field (400).
    #[error("{0}")]
    BadRequest(String),
    /// No enabled tool by that name, or it cannot stream (404).
    #[error("{0}")]
    NotFound(String),
    /// The call could not run: a rejected runtime, a container that would not start (500).
    #[error("{0}")]
    Failed(String),
}

/// One call's parameters, with `cwd`, `runtime` and `resp_type` set from the request's headers
/// only.
pub struct Call {
    pub params: Map<String, Value>,
}

/// Keys the server sets from headers; the model's own values for them are dropped.
const HEADER_PARAMS: [(&str, &str); 3] = [("cwd", "x-tool-cwd"), ("runtime", "x-tool-runtime"), ("resp_type", "x-resp-type")];

impl Call {
    fn field(&self, key: &str) -> &str {
        self.params.get(key).and_then(Value::as_str).unwrap_or("")
    }

    pub fn cwd(&self) -> &str {
        self.field("cwd")
    }

    pub fn runtime(&self) -> &str {
        self.field("runtime")
    }

    pub fn resp_type(&self) -> &str {
        self.field("resp_type")
    }

    pub fn io(&self) -> Result<Box<dyn ToolIo>, ToolError> {
        io::for_call(self.cwd(), self.runtime())
    }
}

/// Where a streaming call's output goes as it is produced.
pub trait Sink {
    fn push(&mut self, chunk: &[u8]);
    /// False once the client has gone: the tool should stop.
    fn alive(&self) -> bool;
}

pub trait Tool: Send + Sync {
    fn name(&self) -> &str;
    fn display_name(&self) -> &str;
    fn source(&self) -> &'static str {
        "server"
    }
    fn writes(&self) -> bool {
        false
    }
    fn streams(&self) -> bool {
        false
    }
    fn uses_cwd(&self) -> bool {
        false
    }
    /// The OpenAI function definition offered to the model.
    fn definition(&self) -> Value;
    /// With a sink, output goes there and the returned value is not used.
    fn invoke(&self, call: &Call, sink: Option<&mut dyn Sink>) -> Result<Value, ToolError>;

    fn describe(&self) -> Value {
        json!({
            "display_name": self.display_name(),
            "tool": self.name(),
            "type": self.source(),
            "permissions": {"write": self.writes()},
            "uses_cwd": self.uses_cwd(),
            "definition": self.definition(),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("unknown tool \"{name}\". available tools: {available}")]
    UnknownTool { name: String, available: String },
    #[error("{0}")]
    Runtime(#[from] ToolError),
}

pub struct Tools {
    tools: Vec<Box<dyn Tool>>,
    runtime: Option<runtime::Runtime>,
}

impl Tools {
    /// The tools `--tools` enables (`all` for every one), or None when it names none.
    pub fn from_params(cfg: &Value) -> Result<Option<Arc<Self>>, SetupError> {
        let enabled: Vec<String> = cfg["server_tools"].as_array().map(|a| a.iter().filter_map(Value::as_str).map(String::from).collect()).unwrap_or_default();
        if enabled.is_empty() {
            return Ok(None);
        }
        let runtime = cfg["server_tools_runtime"].as_str().unwrap_or("");
        Self::new(&enabled, runtime).map(|t| Some(Arc::new(t)))
    }

    pub fn new(enabled: &[String], runtime_spec: &str) -> Result<Self, SetupError> {
        let runtime = if runtime_spec.is_empty() { None } else { Some(runtime::Runtime::from_spec(runtime_spec)?) };
        let all = builtin::all();
        if let Some(name) = enabled.iter().find(|n| *n != "all" && !all.iter().any(|t| t.name() == n.as_str())) {
            let available = all.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ");
            return Err(SetupError::UnknownTool { name: name.clone(), available });
        }
        let every = enabled.iter().any(|n| n == "all");
        let tools = all.into_iter().filter(|t| every || enabled.iter().any(|n| n == t.name())).collect();
        Ok(Self { tools, runtime })
    }

    pub fn has_runtime(&self) -> bool {
        self.runtime.is_some()
    }

    pub(crate) fn describe(&self) -> Value {
        Value::Array(self.tools.iter().map(|t| t.describe()).collect())
    }

    fn find(&self, name: &str, stream: bool) -> Result<&dyn Tool, ToolError> {
        let tool = self.tools.iter().find(|t| t.name() == name).ok_or_else(|| ToolError::NotFound(format!("unknown tool \"{name}\"")))?;
        if stream && !tool.streams() {
            return Err(ToolError::NotFound(format!("tool \"{name}\" does not support stream = true")));
        }
        Ok(tool.as_ref())
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.tools.iter().any(|t| t.name() == name)
    }

    /// The runtime a call without `x-tool-runtime` uses; may start a container, so it blocks.
    fn default_runtime(&self) -> Result<Option<String>, ToolError> {
        self.runtime.as_ref().map(runtime::Runtime::spec).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(t: &Tools) -> Vec<&str> {
        t.tools.iter().map(|t| t.name()).collect()
    }

    #[test]
    fn enables_all_or_the_named_tools() {
        let all = Tools::new(&["all".into()], "").unwrap();
        assert_eq!(names(&all), ["read_file", "file_glob_search", "grep_search", "exec_shell_command", "write_file", "edit_file", "get_info"]);
        let some = Tools::new(&["write_file".into(), "read_file".into()], "").unwrap();
        assert_eq!(names(&some), ["read_file", "write_file"]);
    }

    #[test]
    fn rejects_unknown_tools_and_runtimes_at_startup() {
        let err = Tools::new(&["read_file".into(), "web_search".into()], "").err().unwrap();
        assert!(err.to_string().starts_with("unknown tool \"web_search\". available tools: read_file, file_glob_search"));
        let err = Tools::new(&["all".into()], "ssh:-oProxyCommand=x").err().unwrap();
        assert_eq!(err.to_string(), "invalid ssh target: -oProxyCommand=x");
        assert!(Tools::new(&["all".into()], "docker-container:abc123").unwrap().has_runtime());
    }

    #[test]
    fn only_streaming_tools_stream() {
        let t = Tools::new(&["all".into()], "").unwrap();
        assert!(t.find("exec_shell_command", true).is_ok());
        assert!(matches!(t.find("read_file", true), Err(ToolError::NotFound(_))));
        assert!(matches!(t.find("nope", false), Err(ToolError::NotFound(_))));
    }

    #[test]
    fn describes_tools_in_llama_server_shape() {
        let t = Tools::new(&["exec_shell_command".into()], "").unwrap();
        let d = &t.describe()[0];
        assert_eq!(d["tool"], "exec_shell_command");
        assert_eq!(d["type"], "server");
        assert_eq!(d["permissions"]["write"], true);
        assert_eq!(d["uses_cwd"], true);
        assert_eq!(d["definition"]["function"]["parameters"]["required"], json!(["command"]));
    }
}
