//! The agent features the Web UI uses: built-in tools (--tools), MCP servers
//! (--mcp-servers-config / --mcp-servers-json) and the CORS proxy (--ui-mcp-proxy), as routes
//! that need no model.

pub mod cors_proxy;
pub mod mcp;
pub mod tools;

use std::sync::Arc;

use axum::Router;
use serde_json::Value;

use self::mcp::{ConfigError, McpManager};
use self::tools::http as tools_http;
use self::tools::Tools;

pub struct Agent {
    pub routes: Router,
    pub mcp: Arc<McpManager>,
}

impl Agent {
    /// Starts the configured MCP servers long enough to list their tools, then builds the routes.
    /// `tools`: the built-in tools --tools enables, if any.
    pub async fn start(cfg: &Value, tools: Option<Arc<Tools>>) -> Result<Self, ConfigError> {
        let s = |k: &str| cfg[k].as_str().unwrap_or_default().to_string();
        let mcp = Arc::new(McpManager::start(&s("mcp_servers_config"), &s("mcp_servers_json")).await?);
        let builtin = tools.is_some();
        let proxy = cfg["ui_mcp_proxy"].as_bool().unwrap_or(false);

        let mut enabled = Vec::new();
        if proxy {
            enabled.push("MCP proxy (experimental)");
        }
        if builtin {
            enabled.push("server tools (experimental)");
        }
        if !s("server_tools_runtime").is_empty() {
            enabled.push("tools runtime (experimental)");
        }
        if !mcp.is_empty() {
            enabled.push("MCP servers (experimental)");
        }
        if !enabled.is_empty() {
            crate::log::warn(&format!("srv  security: {} enabled - do not expose to untrusted environments", enabled.join(", ")));
        }

        let routes = cors_proxy::routes(proxy).merge(tools_http::routes(tools, mcp.clone()));
        Ok(Self { routes, mcp })
    }
}
