//! Model calls: a request charged to several tools at once (requests and tokens), its tokens
//! reserved from an estimate and settled to what the call used when its response body ends
//! (see [`ModelCallLayer`]).

mod body;
mod json;
#[cfg(test)]
mod tests;
mod usage;

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, WWW_AUTHENTICATE};
use http::{Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

pub use body::MeteredBody;
pub use usage::Usage;

use super::layer::{FairShareLayer, Shared};
use super::refusal::{admitted_headers, render};
use super::request::{identify, read_body, BufferedBody, Unread};
use super::select::RequestHead;
use super::Held;
use crate::identity::Cost;
use crate::limiter::Ticket;
use crate::Refusal;
use body::Meter;
use usage::UsageReader;

/// The largest request body read by default: 4 MiB.
const MAX_BODY: usize = 4 << 20;
/// Output tokens estimated for a request that does not bound them.
const DEFAULT_OUTPUT: f64 = 1024.0;

/// Estimates a request's tokens from its head and its body (JSON, when it is).
type Estimator = dyn Fn(&RequestHead<'_>, Option<&serde_json::Value>) -> f64 + Send + Sync;

#[derive(Clone)]
struct Options {
    max_body: usize,
    requests: Vec<Arc<str>>,
    tokens: Vec<Arc<str>>,
    estimate: Option<Arc<Estimator>>,
    trailer: Option<HeaderName>,
    openai: bool,
}

buffered_layer! {
    /// [`FairShareLayer`] for model calls ([`FairShareLayer::model_calls`]). Cheap to clone.
    ///
    /// Each request is one call of every [`requests`](Self::requests) tool and costs its tokens
    /// at every [`tokens`](Self::tokens) tool — all of them decided together
    /// ([`Limiter::admit_all`](crate::Limiter::admit_all)): admitted only if each tool allows it,
    /// at every level, and a refusal charges none of them. The tools must share a
    /// [group](crate::policy::ToolPolicy::group).
    ///
    /// **Reserve.** Before the model runs, the tokens are not known: the call reserves an
    /// estimate — the request's [`Cost`] extension if it has one, else what
    /// [`estimate_tokens`](Self::estimate_tokens) says of the request, else the request's own
    /// bound: its `max_tokens` (`max_completion_tokens`, `max_output_tokens`; 1,024 when it has
    /// none) plus a quarter of its body's bytes for the prompt. The body is read for it (at most
    /// [`max_body`](Self::max_body) bytes; past it, 413) and handed on byte for byte unchanged.
    ///
    /// **Settle.** The service behind the layer gets a [`Usage`] handle in the request's
    /// extensions and reports the tokens as it learns them; a [`usage_trailer`](Self::usage_trailer)
    /// reports them, or (on by default, [`openai_usage`](Self::openai_usage)) the layer reads
    /// them from an OpenAI-compatible response as it passes: a JSON body's `usage`, or the last
    /// server-sent event that carries one. When the response body ends, the token charge is
    /// settled at every level to what was reported last: an over-estimate given back, an
    /// under-estimate charged in full — beyond what was left, as debt the caller pays before its
    /// next call passes (its buckets go below empty and refill from there; a budget it overran
    /// refuses until its window ends). A body cut off (the client went away, the stream failed)
    /// is settled to what was reported before; with nothing reported the estimate stands. Each
    /// settlement is a decision event (target `tower_fairshare::decision`) saying which.
    ///
    /// **Refusals** are the layer's HTTP refusals (429 and the refusal's JSON), naming the tool
    /// and level that refused and the unit of its limit; the `RateLimit` headers of an admitted
    /// call (with [`headers`](FairShareLayer::headers)) are those of the tool whose limit is
    /// closest to binding, in its unit (`qu="tokens"`).
    ///
    /// ```
    /// use tower_fairshare::{FairShareLayer, Limiter, Policy};
    ///
    /// # let policy = Policy::from_toml_str(r#"
    /// # [[tool]]
    /// # name = "chat.requests"
    /// # group = "chat"
    /// # unit = "calls"
    /// # rate = { limit = 600, per = "1m" }
    /// # [tool.default_tenant]
    /// # [[tool]]
    /// # name = "chat.tokens"
    /// # group = "chat"
    /// # unit = "tokens"
    /// # rate = { limit = 100000, per = "1m" }
    /// # [tool.default_tenant]
    /// # "#).unwrap();
    /// let layer = FairShareLayer::new(Limiter::new(policy))
    ///     .headers(true)
    ///     .model_calls()
    ///     .requests("chat.requests") // one call each
    ///     .tokens("chat.tokens");    // the estimate, settled to the usage
    /// // axum: Router::new().route("/v1/chat/completions", post(proxy)).layer(layer)
    /// # let _ = layer;
    /// ```
    layer ModelCallLayer;

    /// A service behind a [`ModelCallLayer`]: its requests reach it with their body read, as
    /// `Request<BufferedBody>`, and a [`Usage`] handle in their extensions.
    service FairShareModel;

    /// The future of [`FairShareModel`]'s response.
    future ModelFuture of MeteredBody;

    serve serve;
}

impl fmt::Debug for ModelCallLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelCallLayer")
            .field("requests", &self.options.requests)
            .field("tokens", &self.options.tokens)
            .field("max_body", &self.options.max_body)
            .finish_non_exhaustive()
    }
}

impl FairShareLayer {
    /// Model-call mode: each request charged to several tools at once, its tokens reserved
    /// from an estimate and settled to the usage when the response ends (see
    /// [`ModelCallLayer`]). Identity, headers, enforcement and the challenge are this layer's.
    pub fn model_calls(self) -> ModelCallLayer {
        ModelCallLayer {
            shared: self.shared,
            options: Arc::new(Options {
                max_body: MAX_BODY,
                requests: Vec::new(),
                tokens: Vec::new(),
                estimate: None,
                trailer: None,
                openai: true,
            }),
        }
    }
}

impl ModelCallLayer {
    /// Every request is one call of the policy's `tool` (a tool counted in calls).
    pub fn requests(self, tool: impl Into<Arc<str>>) -> Self {
        let tool = tool.into();
        self.with(|o| o.requests.push(tool))
    }

    /// Every request costs its tokens at the policy's `tool`: the estimate, settled to the
    /// usage when the response ends.
    pub fn tokens(self, tool: impl Into<Arc<str>>) -> Self {
        let tool = tool.into();
        self.with(|o| o.tokens.push(tool))
    }

    /// The tokens a request is estimated at, from its head and its body (parsed, when it is
    /// JSON), for a request without a [`Cost`] extension. With one set, every such request's
    /// body is parsed whole; without, the layer reads only the request's output bound.
    ///
    /// ```
    /// use tower_fairshare::{FairShareLayer, Limiter, Policy};
    ///
    /// # let policy = Policy::from_toml_str("[[tool]]\nname = \"t\"\nunit = \"tokens\"\nrate = { limit = 6000, per = \"1m\" }\n[tool.default_tenant]\n").unwrap();
    /// // Every answer is at most 512 tokens here; prompts are counted by the proxy's tokenizer.
    /// let layer = FairShareLayer::new(Limiter::new(policy))
    ///     .model_calls()
    ///     .tokens("t")
    ///     .estimate_tokens(|_head, body| {
    ///         let prompt = body.map_or(0, |b| b["messages"].to_string().len() / 4);
    ///         prompt as f64 + 512.0
    ///     });
    /// # let _ = layer;
    /// ```
    pub fn estimate_tokens<F>(self, f: F) -> Self
    where
        F: Fn(&RequestHead<'_>, Option<&serde_json::Value>) -> f64 + Send + Sync + 'static,
    {
        let f: Arc<Estimator> = Arc::new(f);
        self.with(|o| o.estimate = Some(f))
    }

    /// The most bytes of a request body read (default 4 MiB): past it the request is
    /// answered 413, nothing charged, the service not called.
    pub fn max_body(self, bytes: usize) -> Self {
        self.with(|o| o.max_body = bytes)
    }

    /// A response trailer that reports the call's tokens (a number): for a service that
    /// counts them itself and sends them when its stream ends.
    pub fn usage_trailer(self, name: HeaderName) -> Self {
        self.with(|o| o.trailer = Some(name))
    }

    /// Whether the layer reads the usage of OpenAI-compatible responses as they pass (default
    /// on): a JSON body's `usage`, or the last server-sent event that carries one
    /// (`stream_options.include_usage`; the Responses API's `response.usage`).
    pub fn openai_usage(self, yes: bool) -> Self {
        self.with(|o| o.openai = yes)
    }
}

type Answer<ResB> = Response<MeteredBody<ResB>>;

/// One model call: its body read, its caller identified, its tools decided together, the
/// service called with a usage handle, and its response metered.
async fn serve<S, B, ResB>(
    mut inner: S,
    shared: Arc<Shared>,
    options: Arc<Options>,
    req: Request<B>,
) -> Result<Answer<ResB>, S::Error>
where
    S: Service<Request<BufferedBody>, Response = Response<ResB>>,
    B: http_body::Body,
    ResB: http_body::Body,
{
    let (mut parts, body) = req.into_parts();
    let body = match read_body(body, options.max_body).await {
        Ok(b) => b,
        Err(why) => return Ok(unread(why, options.max_body)),
    };
    let caller = match identify(&shared, &parts) {
        Ok(c) => c,
        Err(res) => return Ok((*res).map(|b| MeteredBody::refusal(Some(b)))),
    };
    let estimate = estimate(&options, &parts, &body);
    let charges = charges(&options, estimate);
    let tickets = match shared.limiter.admit_all(caller, charges).await {
        Ok(tickets) => Some(tickets),
        Err(refusal) if !shared.enforce => {
            tracing::info!(reason = refusal.reason.as_str(), tool = %refusal.tool(), "shadow mode: would refuse");
            None
        }
        Err(refusal) => return Ok(refused(&shared, &refusal)),
    };
    let usage = Usage::default();
    parts.extensions.insert(usage.clone());
    let mut res = inner
        .call(Request::from_parts(parts, BufferedBody(Some(body))))
        .await?;
    let Some(tickets) = tickets else {
        return Ok(res.map(|b| MeteredBody::metered(b, None)));
    };
    if let Some(actual) = res.extensions().get::<Cost>() {
        usage.report(actual.0);
    }
    if shared.headers {
        if let Some(binding) = binding(&tickets) {
            admitted_headers(binding, res.headers_mut());
        }
    }
    let reader = options
        .openai
        .then(|| UsageReader::of(res.headers().get(CONTENT_TYPE)))
        .flatten();
    let meter = meter(&shared, &options, tickets, estimate, usage, reader);
    Ok(res.map(|b| MeteredBody::metered(b, Some(meter))))
}

/// The tokens the call reserves: its `Cost` extension, the layer's estimator, or the
/// request's own bound.
fn estimate(options: &Options, parts: &http::request::Parts, body: &[u8]) -> f64 {
    if let Some(c) = parts.extensions.get::<Cost>() {
        return c.0;
    }
    if let Some(f) = &options.estimate {
        let json: Option<serde_json::Value> = serde_json::from_slice(body).ok();
        let head = RequestHead {
            method: &parts.method,
            uri: &parts.uri,
            headers: &parts.headers,
            extensions: &parts.extensions,
        };
        return f(&head, json.as_ref());
    }
    let output = json::output_bound(body).unwrap_or(DEFAULT_OUTPUT);
    (body.len() as f64 / 4.0).ceil() + output.max(0.0)
}

/// What the call is charged: a call of each requests tool, the estimate at each tokens tool.
fn charges(options: &Options, estimate: f64) -> Vec<(Arc<str>, Cost)> {
    let calls = options.requests.iter().map(|t| (t.clone(), Cost(1.0)));
    let tokens = options.tokens.iter().map(|t| (t.clone(), Cost(estimate)));
    calls.chain(tokens).collect()
}

/// The ticket whose limit binds first: the least of its quota left.
fn binding(tickets: &[Ticket]) -> Option<&Ticket> {
    let left = |t: &Ticket| match (t.remaining(), t.quota()) {
        (Some(r), Some(q)) if q > 0.0 => r / q,
        _ => f64::INFINITY,
    };
    tickets.iter().min_by(|a, b| left(a).total_cmp(&left(b)))
}

/// What the admitted call keeps until its body ends.
fn meter(
    shared: &Arc<Shared>,
    options: &Options,
    tickets: Vec<Ticket>,
    estimate: f64,
    usage: Usage,
    reader: Option<UsageReader>,
) -> Meter {
    let n = options.requests.len();
    let mut settled = Vec::new();
    let mut permits = Vec::new();
    for (i, ticket) in tickets.into_iter().enumerate() {
        if i >= n {
            settled.push(ticket.clone());
        }
        let held = Held::new(ticket, &shared.limiter);
        if held.holds_permits() {
            permits.push(held);
        }
    }
    Meter {
        limiter: shared.limiter.clone(),
        settled,
        estimate,
        usage,
        reader,
        trailer: options.trailer.clone(),
        permits,
    }
}

/// A refused call: the layer's HTTP refusal.
fn refused<ResB>(shared: &Shared, refusal: &Refusal) -> Answer<ResB> {
    let mut res = match &shared.on_refusal {
        Some(f) => f(refusal, false).map(Some),
        None => render(refusal, false),
    };
    if res.status() == StatusCode::UNAUTHORIZED && !res.headers().contains_key(WWW_AUTHENTICATE) {
        res.headers_mut()
            .insert(WWW_AUTHENTICATE, shared.challenge.clone());
    }
    res.map(MeteredBody::refusal)
}

/// The answer to a body that could not be read or is past the limit.
fn unread<ResB>(why: Unread, max: usize) -> Answer<ResB> {
    let (status, message) = match why {
        Unread::TooLarge => (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {max} bytes, the most this server reads"),
        ),
        Unread::Failed => (
            StatusCode::BAD_REQUEST,
            "the request body could not be read".to_owned(),
        ),
    };
    let json = serde_json::json!({ "error": "invalid_request", "detail": message });
    let mut res = Response::new(MeteredBody::refusal(Some(Bytes::from(json.to_string()))));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}
