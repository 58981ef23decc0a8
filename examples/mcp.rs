//! An MCP tool server (the official Rust SDK, `rmcp`, over streamable HTTP) behind the
//! fair-share layer in MCP mode: every `tools/call` is decided as a call of its tool, with the
//! policy in `examples/mcp/policy.toml`; `initialize`, `tools/list` and the rest pass.
//!
//! Agents authenticate with an API key (`Authorization: Bearer <key>`). Each key names a
//! tenant and an agent instance; here the two tenants run the same agent, `report-agent`, and
//! still have allowances of their own.
//!
//! ```text
//! cargo run --example mcp
//! # MCP endpoint: http://127.0.0.1:8090/mcp (keys: sk-acme, sk-globex)
//! ```
//!
//! A refused call reaches the model as a tool result with `isError: true` and a text saying
//! when it may try again.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{ServerCapabilities, ServerConfig};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{schemars, tool, tool_handler, tool_router, ServerHandler};
use tower_fairshare::{Caller, FairShareLayer, Limiter, Policy, Store};

/// The policy beside this example.
pub const POLICY: &str = include_str!("mcp/policy.toml");

/// API keys: (key, tenant, agent instance). Both tenants run the same agent.
pub const KEYS: [(&str, &str, &str); 2] = [
    ("sk-acme", "acme", "report-agent"),
    ("sk-globex", "globex", "report-agent"),
];

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub struct ReportRequest {
    /// What the report is about.
    pub topic: String,
    /// How long the report takes to write, in milliseconds (default 50).
    #[serde(default)]
    pub millis: Option<u64>,
}

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub struct LookupRequest {
    /// The customer's id.
    pub id: String,
}

/// The MCP server: two tools.
#[derive(Debug, Clone)]
pub struct Tools {
    tool_router: ToolRouter<Self>,
}

impl Default for Tools {
    fn default() -> Self {
        Tools {
            tool_router: Self::tool_router(),
        }
    }
}

#[tool_router]
impl Tools {
    #[tool(description = "Write a report on a topic (slow and expensive)")]
    async fn generate_report(
        &self,
        Parameters(ReportRequest { topic, millis }): Parameters<ReportRequest>,
    ) -> String {
        tokio::time::sleep(Duration::from_millis(millis.unwrap_or(50))).await;
        format!("A report on {topic}.")
    }

    #[tool(description = "Look a customer up by id (cheap)")]
    fn lookup_customer(
        &self,
        Parameters(LookupRequest { id }): Parameters<LookupRequest>,
    ) -> String {
        format!("Customer {id}: active.")
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }
}

/// The app's auth: a known API key becomes the request's [`Caller`]; without one the
/// fair-share layer answers 401.
pub async fn authenticate(mut req: Request, next: Next) -> Response {
    let key = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let caller = KEYS
        .iter()
        .find(|(k, _, _)| Some(*k) == key)
        .map(|(_, tenant, instance)| Caller::new(*tenant).with_instance(*instance));
    req.extensions_mut().remove::<Caller>();
    if let Some(caller) = caller {
        req.extensions_mut().insert(caller);
    }
    next.run(req).await
}

/// The MCP endpoint at `/mcp`, every `tools/call` decided by `limiter`.
pub fn app<S: Store, C: tower_fairshare::Clock>(limiter: Limiter<S, C>) -> Router {
    let mcp = StreamableHttpService::new(
        || Ok(Tools::default()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let metered = tower::Layer::layer(&FairShareLayer::new(limiter).mcp(), mcp);
    Router::new()
        .nest_service("/mcp", metered)
        // Outermost: the caller is known before the fair-share layer looks for it.
        .layer(middleware::from_fn(authenticate))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let policy = Policy::from_toml_str(POLICY).expect("the example's policy is valid");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:8090").await?;
    println!(
        "MCP endpoint: http://{}/mcp (keys: sk-acme, sk-globex)",
        listener.local_addr()?
    );
    axum::serve(listener, app(Limiter::new(policy))).await
}
