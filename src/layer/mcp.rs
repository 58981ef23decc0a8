//! MCP mode: a fair share per tool of an MCP server's `tools/call`, and refusals a model
//! reads (see [`McpLayer`]).

mod jsonrpc;

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use tower_layer::Layer;
use tower_service::Service;

pub use jsonrpc::REFUSED as MCP_REFUSED;

use super::body::ResponseBody;
use super::layer::{FairShareLayer, Shared};
use super::refusal::{admitted_headers, render};
pub use super::request::BufferedBody;
use super::request::{identify, read_body, Answer, Unread};
use super::Held;
use crate::identity::Cost;
use crate::Refusal;

/// The largest body read by default: 4 MiB.
const MAX_BODY: usize = 4 << 20;

/// How a refused `tools/call` is answered (see [`McpLayer`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum McpRefusals {
    /// A tool result with `isError: true`, the advice as text and the refusal as
    /// `structuredContent` (the default: the model sees it).
    #[default]
    ToolResult,
    /// A JSON-RPC error, code [`MCP_REFUSED`], the advice as `message` and the refusal as
    /// `data` (the client sees it; a model sees what its client passes on).
    Error,
}

/// The policy tool an MCP tool name is called as (`None`: not metered).
type ToolMap = dyn Fn(&str) -> Option<Arc<str>> + Send + Sync;

/// The cost of a `tools/call`, from the call itself.
type CostOf = dyn Fn(&McpCall<'_>) -> Cost + Send + Sync;

/// A `tools/call` as [`McpLayer::cost_with`] sees it.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct McpCall<'a> {
    /// The MCP tool's name (`params.name`).
    pub name: &'a str,
    /// Its arguments as the client sent them (`params.arguments`, JSON), if any.
    pub arguments: Option<&'a str>,
}

#[derive(Clone)]
struct Options {
    max_body: usize,
    refusals: McpRefusals,
    tool: Option<Arc<ToolMap>>,
    cost: Option<Arc<CostOf>>,
    others: Option<Arc<str>>,
}

buffered_layer! {
    /// [`FairShareLayer`] in MCP mode ([`FairShareLayer::mcp`]). Cheap to clone.
    ///
    /// An MCP server over streamable HTTP has one endpoint; the tool a request calls is in its
    /// JSON-RPC body (`params.name` of `tools/call`). [`FairShareLayer::mcp`] reads the body (at
    /// most [`McpLayer::max_body`] bytes), decides a `tools/call` as a call of that tool — tiers,
    /// nested levels, budgets, concurrency, the [`Cost`] extension — and hands the request on with
    /// its body byte for byte unchanged. Every other message (`initialize`, `tools/list`, `ping`,
    /// notifications, responses, `GET` and `DELETE` on the endpoint) passes unmetered, unless
    /// [`meter_others`](McpLayer::meter_others) names a tool to count them as.
    ///
    /// A refused `tools/call` is answered in the protocol's own terms, HTTP 200: by default a tool
    /// result with `isError: true`, a text saying what was limited, for whom and when to retry
    /// (or that retrying will not help), and the refusal's JSON as `structuredContent` — the
    /// tool-execution error MCP defines so that the model sees it. With
    /// [`McpRefusals::Error`], a JSON-RPC error of code [`MCP_REFUSED`] with the refusal as `data`.
    /// A caller with no identity gets the layer's HTTP 401 with its `WWW-Authenticate`.
    ///
    /// What is not a message this server takes is answered with the JSON-RPC error a client
    /// expects, HTTP 400, and never reaches the server or charges anything: a body that is not
    /// JSON (`-32700`), not JSON-RPC 2.0 or a `tools/call` without an id (`-32600`), a
    /// `tools/call` without a tool name (`-32602`), a body past the limit (HTTP 413, `-32600`). A
    /// JSON-RPC batch (an array, which the current protocol revision no longer has) passes
    /// unmetered when none of its members is a `tools/call`; one that holds a `tools/call` is
    /// refused with `-32600`, so no call escapes its limit inside a batch.
    ///
    /// An admitted call's concurrency permits are held until the response ends — an SSE stream
    /// until its last event — and given back when the client goes away.
    ///
    /// ```
    /// use tower_fairshare::{FairShareLayer, Limiter, McpRefusals, Policy};
    ///
    /// # let policy = Policy::from_toml_str("[[tool]]\nname = \"generate_report\"\nunit = \"calls\"\nrate = { limit = 60, per = \"1m\" }\n[tool.default_tenant]\n").unwrap();
    /// let layer = FairShareLayer::new(Limiter::new(policy))
    ///     .mcp()                              // the tool is `params.name` of `tools/call`
    ///     .max_body(1 << 20)                  // read at most 1 MiB of a request
    ///     .refusals(McpRefusals::ToolResult); // the default: the model reads the refusal
    /// // axum: Router::new().nest_service("/mcp", mcp_service).layer(layer)
    /// # let _ = layer;
    /// ```
    layer McpLayer;

    /// A service behind an [`McpLayer`]: its requests reach it with their body read, as
    /// `Request<BufferedBody>`.
    service FairShareMcp;

    /// The future of [`FairShareMcp`]'s response.
    future McpFuture of ResponseBody;

    serve serve;
}

impl fmt::Debug for McpLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpLayer")
            .field("max_body", &self.options.max_body)
            .field("refusals", &self.options.refusals)
            .field("others", &self.options.others)
            .finish_non_exhaustive()
    }
}

impl FairShareLayer {
    /// MCP mode: the tool of a request is the `params.name` of its JSON-RPC `tools/call`
    /// body, and refusals are answered in JSON-RPC (see [`McpLayer`]). Identity, headers,
    /// enforcement and the challenge are this layer's.
    pub fn mcp(self) -> McpLayer {
        McpLayer {
            shared: self.shared,
            options: Arc::new(Options {
                max_body: MAX_BODY,
                refusals: McpRefusals::default(),
                tool: None,
                cost: None,
                others: None,
            }),
        }
    }
}

impl McpLayer {
    /// The most bytes of a request body read (default 4 MiB): past it the request is
    /// answered 413 with a JSON-RPC error, nothing charged, the server not called.
    pub fn max_body(self, bytes: usize) -> Self {
        self.with(|o| o.max_body = bytes)
    }

    /// How a refused `tools/call` is answered (default [`McpRefusals::ToolResult`]).
    pub fn refusals(self, how: McpRefusals) -> Self {
        self.with(|o| o.refusals = how)
    }

    /// The policy's tool for MCP tool `name` is `prefix` + `name` (e.g. `"crm."`: the MCP
    /// tool `lookup` is the policy's `crm.lookup`).
    pub fn tool_prefix(self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        self.map_tool(move |name| Some(Arc::from(format!("{prefix}{name}"))))
    }

    /// The policy's tool for an MCP tool name is what `f` says; `None` lets the call through
    /// unmetered. (Without it: the same name. A name the policy does not know is refused.)
    pub fn map_tool<F>(self, f: F) -> Self
    where
        F: Fn(&str) -> Option<Arc<str>> + Send + Sync + 'static,
    {
        let f: Arc<ToolMap> = Arc::new(f);
        self.with(|o| o.tool = Some(f))
    }

    /// The cost of each `tools/call` is what `f` says of it (its tool and arguments), instead
    /// of the request's [`Cost`] extension (default 1).
    ///
    /// ```
    /// use tower_fairshare::{Cost, FairShareLayer, Limiter, Policy};
    ///
    /// # let policy = Policy::from_toml_str("[[tool]]\nname = \"generate_report\"\nunit = \"calls\"\nrate = { limit = 60, per = \"1m\" }\n[tool.default_tenant]\n").unwrap();
    /// // A report over several quarters costs one unit a quarter.
    /// let layer = FairShareLayer::new(Limiter::new(policy)).mcp().cost_with(|call| {
    ///     let args: serde_json::Value = call
    ///         .arguments
    ///         .and_then(|a| serde_json::from_str(a).ok())
    ///         .unwrap_or_default();
    ///     Cost(args["quarters"].as_f64().unwrap_or(1.0).max(1.0))
    /// });
    /// # let _ = layer;
    /// ```
    pub fn cost_with<F>(self, f: F) -> Self
    where
        F: Fn(&McpCall<'_>) -> Cost + Send + Sync + 'static,
    {
        let f: Arc<CostOf> = Arc::new(f);
        self.with(|o| o.cost = Some(f))
    }

    /// Counts every message that is not a `tools/call` (`initialize`, `tools/list`,
    /// notifications, `GET` streams) as a call of the policy's `tool`; one refused gets the
    /// layer's HTTP refusal (429 with `Retry-After` and the refusal's JSON).
    pub fn meter_others(self, tool: impl Into<Arc<str>>) -> Self {
        let tool = tool.into();
        self.with(|o| o.others = Some(tool))
    }
}

/// One request: its body read, its message found, decided, and handed on or answered.
async fn serve<S, B, ResB>(
    mut inner: S,
    shared: Arc<Shared>,
    options: Arc<Options>,
    req: Request<B>,
) -> Result<Answer<ResB>, S::Error>
where
    S: Service<Request<BufferedBody>, Response = Response<ResB>>,
    B: Body,
    ResB: http_body::Body,
{
    let (parts, body) = req.into_parts();
    let body = match read_request(body, options.max_body).await {
        Ok(b) => b,
        Err(answer) => return Ok(answer),
    };
    let found = match find_call(&parts.method, &body, &options) {
        Ok(f) => f,
        Err(answer) => return Ok(answer),
    };
    let Some(tool) = found.tool else {
        let res = inner
            .call(Request::from_parts(parts, BufferedBody(Some(body))))
            .await?;
        return Ok(res.map(|b| ResponseBody::inner(b, None)));
    };
    let caller = match identify(&shared, &parts) {
        Ok(c) => c,
        Err(res) => return Ok((*res).map(|b| ResponseBody::refusal(Some(b)))),
    };
    let cost = found
        .cost
        .or_else(|| parts.extensions.get::<Cost>().copied())
        .unwrap_or_default();
    let outcome = match shared.limiter.begin(&caller, &tool, cost) {
        crate::limiter::Begun::Done(outcome) => outcome,
        crate::limiter::Begun::Waiting(rest) => rest.await,
    };
    let held = match outcome {
        Ok(ticket) => Some(Held::new(ticket, &shared.limiter)),
        Err(refusal) if !shared.enforce => {
            tracing::info!(reason = refusal.reason.as_str(), tool = %refusal.tool(), "shadow mode: would refuse");
            None
        }
        Err(refusal) => return Ok(refused(&shared, &options, found.id.as_deref(), &refusal)),
    };
    let res = inner
        .call(Request::from_parts(parts, BufferedBody(Some(body))))
        .await?;
    Ok(admitted(&shared, res, held))
}

/// The request's body, or the JSON-RPC answer to one past the limit or that could not be read.
async fn read_request<B: Body, ResB>(body: B, max: usize) -> Result<Bytes, Answer<ResB>> {
    let (status, message) = match read_body(body, max).await {
        Ok(b) => return Ok(b),
        Err(Unread::TooLarge) => (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {max} bytes, the most this server reads"),
        ),
        Err(Unread::Failed) => (
            StatusCode::BAD_REQUEST,
            "the request body could not be read".to_owned(),
        ),
    };
    let body = jsonrpc::error(None, jsonrpc::INVALID_REQUEST, &message, None);
    Err(answer(status, body))
}

/// What a request asks to be decided: the policy's tool (`None`: unmetered), the id to answer
/// a `tools/call` with, and its cost if the options price it.
struct Found {
    tool: Option<Arc<str>>,
    id: Option<Box<serde_json::value::RawValue>>,
    cost: Option<Cost>,
}

/// The call in a request's body, or the JSON-RPC error for a body this server does not take.
fn find_call<ResB>(method: &Method, body: &[u8], options: &Options) -> Result<Found, Answer<ResB>> {
    let message = if method == Method::POST {
        jsonrpc::read(body)
    } else {
        jsonrpc::Message::Other
    };
    match message {
        jsonrpc::Message::Invalid { id, code, message } => Err(answer(
            StatusCode::BAD_REQUEST,
            jsonrpc::error(id, code, message, None),
        )),
        jsonrpc::Message::ToolCall {
            id,
            name,
            arguments,
        } => {
            let tool = match &options.tool {
                Some(map) => map(&name),
                None => Some(Arc::from(&*name)),
            };
            let call = McpCall {
                name: &name,
                arguments: arguments.map(serde_json::value::RawValue::get),
            };
            Ok(Found {
                tool,
                id: Some(id.to_owned()),
                cost: options.cost.as_ref().map(|f| f(&call)),
            })
        }
        jsonrpc::Message::Other => Ok(Found {
            tool: options.others.clone(),
            id: None,
            cost: None,
        }),
    }
}

/// An admitted call's response: its charge settled to a `Cost` it reports, the RateLimit
/// headers if asked, and its permits (if any) in the body, so that a stream holds them until
/// it ends or the client leaves.
fn admitted<ResB>(shared: &Shared, mut res: Response<ResB>, held: Option<Held>) -> Answer<ResB> {
    let Some(held) = held else {
        return res.map(|b| ResponseBody::inner(b, None));
    };
    if let Some(actual) = res.extensions().get::<Cost>().copied() {
        shared.limiter.settle(held.ticket().clone(), actual);
    }
    if shared.headers {
        admitted_headers(held.ticket(), res.headers_mut());
    }
    let held = held.holds_permits().then(|| Box::new(held));
    res.map(|b| ResponseBody::inner(b, held))
}

/// The answer to a refused call: for a `tools/call`, the JSON-RPC answer the options say;
/// for a caller with no identity, and for any other message [`McpLayer::meter_others`]
/// meters, the layer's HTTP refusal (401 with the challenge, 429, ...).
fn refused<ResB>(
    shared: &Shared,
    options: &Options,
    id: Option<&serde_json::value::RawValue>,
    refusal: &Refusal,
) -> Response<ResponseBody<ResB>> {
    let (Some(id), false) = (id, refusal.reason == crate::Reason::UnidentifiedCaller) else {
        let mut res = render(refusal, false);
        if res.status() == StatusCode::UNAUTHORIZED {
            res.headers_mut()
                .insert(WWW_AUTHENTICATE, shared.challenge.clone());
        }
        return res.map(ResponseBody::refusal);
    };
    let body = match options.refusals {
        McpRefusals::ToolResult => jsonrpc::tool_error(id, refusal),
        McpRefusals::Error => jsonrpc::refusal_error(id, refusal),
    };
    let mut res = answer(StatusCode::OK, body);
    if refusal.retryable {
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(refusal.retry_after_secs()));
    }
    res
}

/// A JSON answer of this layer's own.
fn answer<ResB>(status: StatusCode, body: Bytes) -> Response<ResponseBody<ResB>> {
    let mut res = Response::new(ResponseBody::refusal(Some(body)));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}
