//! [`FairShareLayer`]: configuration, shared by every service it wraps.

use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::select::{Identify, Identity, RequestHead, ToolSelector};
use super::service::FairShare;
use super::Limits;
use crate::clock::Clock;
use crate::limiter::Limiter;
use crate::store::Store;

/// Applies fair-share admission to a service. Cheap to clone.
///
/// ```
/// use tower_fairshare::{FairShareLayer, Limiter, Policy};
///
/// let policy = Policy::from_toml_str(r#"
///     [[tool]]
///     name = "web_search"
///     unit = "calls"
///     rate = { limit = 600, per = "1m" }
///     [tool.default_tenant]
/// "#).unwrap();
/// let layer = FairShareLayer::new(Limiter::new(policy))
///     .tool("web_search")     // every request through this layer calls `web_search`
///     .headers(true);         // RateLimit headers on admitted responses too
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct FairShareLayer {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) limiter: Arc<dyn Limits>,
    pub(crate) identify: Identity,
    pub(crate) tool: ToolSelector,
    pub(crate) headers: bool,
    pub(crate) enforce: bool,
    /// `WWW-Authenticate` on a 401.
    pub(crate) challenge: http::HeaderValue,
    /// The app's own refusal responses, if it shapes them.
    pub(crate) on_refusal: Option<RefusalHandler>,
}

/// Shapes a refusal into a response: the refusal, and whether the request is gRPC.
pub(crate) type RefusalHandler =
    Arc<dyn Fn(&crate::Refusal, bool) -> http::Response<bytes::Bytes> + Send + Sync>;

impl fmt::Debug for FairShareLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairShareLayer")
            .field("tool", &self.shared.tool)
            .field("headers", &self.shared.headers)
            .field("enforce", &self.shared.enforce)
            .finish_non_exhaustive()
    }
}

impl FairShareLayer {
    /// A layer deciding with `limiter`. By default the caller is the [`Caller`](crate::Caller)
    /// extension and the tool is taken from paths `/tools/{name}`.
    pub fn new<S: Store, C: Clock>(limiter: Limiter<S, C>) -> Self {
        FairShareLayer {
            shared: Arc::new(Shared {
                limiter: Arc::new(limiter),
                identify: Identity::Extension,
                tool: ToolSelector::Path(Arc::from("/tools/")),
                headers: false,
                enforce: true,
                challenge: super::refusal::DEFAULT_CHALLENGE,
                on_refusal: None,
            }),
        }
    }

    fn with(self, f: impl FnOnce(&mut Shared)) -> Self {
        let s = &*self.shared;
        let mut next = Shared {
            limiter: s.limiter.clone(),
            identify: s.identify.clone(),
            tool: s.tool.clone(),
            headers: s.headers,
            enforce: s.enforce,
            challenge: s.challenge.clone(),
            on_refusal: s.on_refusal.clone(),
        };
        f(&mut next);
        FairShareLayer {
            shared: Arc::new(next),
        }
    }

    /// Every request calls `tool`.
    pub fn tool(self, tool: impl Into<Arc<str>>) -> Self {
        let t = tool.into();
        self.with(|s| s.tool = ToolSelector::Fixed(t))
    }

    /// The tool is the path segment after `prefix` (`"/tools/"` → `/tools/web_search/...` is
    /// `web_search`). Other paths pass through unmetered.
    pub fn tool_from_path(self, prefix: impl Into<Arc<str>>) -> Self {
        let p = prefix.into();
        self.with(|s| s.tool = ToolSelector::Path(p))
    }

    /// The tool is the [`ToolName`](crate::ToolName) request extension; requests without one
    /// pass through unmetered.
    pub fn tool_from_extension(self) -> Self {
        self.with(|s| s.tool = ToolSelector::Extension)
    }

    /// The tool is whatever `f` says; `None` passes the request through unmetered.
    pub fn tool_with<F>(self, f: F) -> Self
    where
        F: Fn(&RequestHead<'_>) -> Option<Arc<str>> + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        self.with(|s| s.tool = ToolSelector::With(f))
    }

    /// Identify callers with `identify` instead of the `Caller` extension.
    pub fn identify_with(self, identify: impl Identify) -> Self {
        let i: Arc<dyn Identify> = Arc::new(identify);
        self.with(|s| s.identify = Identity::With(i))
    }

    /// Identify callers with `f`, which may also reject a request with a response of its own
    /// (an expired token, a revoked key, your 401 with your challenge): that response is sent
    /// as it is, nothing is decided or charged, and the inner service is not called.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode};
    /// use tower_fairshare::{Caller, FairShareLayer, Limiter, Policy};
    ///
    /// # let policy = Policy::from_toml_str("[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 60, per = \"1m\" }\n[tool.default_tenant]\n").unwrap();
    /// let layer = FairShareLayer::new(Limiter::new(policy)).identify_or_reject(|head| {
    ///     match head.headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
    ///         Some(key) if key.starts_with("sk-") => Ok(Caller::new(&key[3..])),
    ///         _ => {
    ///             let mut res = Response::new(Bytes::from_static(b"{\"error\":\"bad_key\"}"));
    ///             *res.status_mut() = StatusCode::UNAUTHORIZED;
    ///             Err(Box::new(res))
    ///         }
    ///     }
    /// });
    /// ```
    pub fn identify_or_reject<F>(self, f: F) -> Self
    where
        F: Fn(&RequestHead<'_>) -> Result<crate::Caller, Box<http::Response<bytes::Bytes>>>
            + Send
            + Sync
            + 'static,
    {
        self.identify_with(super::select::Rejecting(f))
    }

    /// Send `RateLimit-Policy` / `RateLimit` on admitted responses too (refusals always have
    /// them). `q` is the caller's ceiling per period `w`; `r` is what is left of it in the
    /// current aligned window, counting down to the window's end `t` (a burst limit or a busy
    /// tool may still make a call wait inside the window: the refusal's `Retry-After` says how
    /// long).
    pub fn headers(self, yes: bool) -> Self {
        self.with(|s| s.headers = yes)
    }

    /// The `WWW-Authenticate` challenge of a 401 (a request with no identity), which HTTP
    /// requires: your auth layer's scheme, e.g. `Bearer realm="api"` or `ApiKey
    /// header="x-api-key"`. Default: `Bearer`.
    ///
    /// ```
    /// use http::HeaderValue;
    /// use tower_fairshare::{FairShareLayer, Limiter, Policy};
    ///
    /// # let policy = Policy::from_toml_str("[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 60, per = \"1m\" }\n[tool.default_tenant]\n").unwrap();
    /// let layer = FairShareLayer::new(Limiter::new(policy))
    ///     .challenge(HeaderValue::from_static("ApiKey header=\"x-api-key\""));
    /// ```
    pub fn challenge(self, value: http::HeaderValue) -> Self {
        self.with(|s| s.challenge = value)
    }

    /// Shapes refusals yourself: `f` gets the refusal and whether the request is gRPC, and
    /// returns the response to send instead of the built-in one
    /// ([`default_refusal_response`](crate::default_refusal_response), which it may start
    /// from). A 401 without a `WWW-Authenticate` gets the layer's
    /// [`challenge`](Self::challenge). The inner service is never called for a refusal.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode};
    /// use tower_fairshare::{FairShareLayer, Limiter, Policy};
    ///
    /// # let policy = Policy::from_toml_str("[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 60, per = \"1m\" }\n[tool.default_tenant]\n").unwrap();
    /// let layer = FairShareLayer::new(Limiter::new(policy)).refusal_response(|refusal, grpc| {
    ///     if grpc {
    ///         return tower_fairshare::default_refusal_response(refusal, grpc);
    ///     }
    ///     let mut res = Response::new(Bytes::from(format!("try again: {}", refusal.reason.as_str())));
    ///     *res.status_mut() = tower_fairshare::http_status(refusal.reason);
    ///     res
    /// });
    /// ```
    pub fn refusal_response<F>(self, f: F) -> Self
    where
        F: Fn(&crate::Refusal, bool) -> http::Response<bytes::Bytes> + Send + Sync + 'static,
    {
        let f: RefusalHandler = Arc::new(f);
        self.with(|s| s.on_refusal = Some(f))
    }

    /// `false`: shadow mode for every tool behind this layer — decide and record, never refuse.
    pub fn enforce(self, yes: bool) -> Self {
        self.with(|s| s.enforce = yes)
    }
}

impl<S> Layer<S> for FairShareLayer {
    type Service = FairShare<S>;

    fn layer(&self, inner: S) -> FairShare<S> {
        FairShare {
            inner,
            shared: self.shared.clone(),
        }
    }
}
