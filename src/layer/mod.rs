//! The tower middleware: [`FairShareLayer`] → [`FairShare`] → [`ResponseFuture`].
//!
//! The service identifies the caller (by default the [`Caller`](crate::Caller) the app's auth
//! layer put in the request extensions), selects the tool, asks the [`Limiter`](crate::Limiter)
//! and either calls the inner service or answers with a refusal — before the inner service
//! runs. Refusals are responses, not errors: the service keeps `Error = S::Error`, so an axum
//! `Infallible` service stays infallible. `poll_ready` only forwards to the inner service;
//! admission is decided in `call`, and all state is shared through `Arc`, so clones of the
//! service share one budget.
//!
//! Order of operations: identify → select tool → tool and tier check (no counter touched on
//! denial) → concurrency → every rate and budget, checked and committed atomically → inner
//! service → cost correction and permit release.
//!
//! A request the tool selector does not map to a tool (e.g. a path outside `/tools/`) passes
//! through unmetered. A tool the policy does not know is refused with 403
//! `permission_denied`.

#[macro_use]
mod request;
mod body;
mod generic;
#[allow(clippy::module_inception)]
mod layer;
mod mcp;
mod model;
mod refusal;
mod select;
mod service;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Waker};

pub use body::ResponseBody;
pub use generic::{Describe, Described, DescribedFuture, DescribedLayer, FairShareError};
pub use layer::FairShareLayer;
pub use mcp::{BufferedBody, FairShareMcp, McpCall, McpFuture, McpLayer, McpRefusals, MCP_REFUSED};
pub use model::{FairShareModel, MeteredBody, ModelCallLayer, ModelFuture, Usage};
/// The refusal response the layer sends, for `IntoResponse for Refusal` (feature `axum`).
#[cfg(feature = "axum")]
pub(crate) use refusal::response as refusal_response;
pub use refusal::{default_refusal_response, grpc_code, http_status, RATELIMIT, RATELIMIT_POLICY};
#[cfg(feature = "tonic")]
pub(crate) use refusal::{retry_delay, status_details};
pub use select::{CallerFromExtensions, Identify, RequestHead, ToolName};
pub use service::{FairShare, ResponseFuture};

use crate::clock::Clock;
use crate::identity::{Caller, Cost};
use crate::limiter::{Begun, Limiter, Ticket};
use crate::store::Store;

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The outcome of a call charged to several tools: a ticket per tool, or the refusal.
pub(crate) type AllOutcome = Result<Vec<Ticket>, crate::Refusal>;

/// The limiter, with its store and clock types erased, as the layer uses it.
pub(crate) trait Limits: Send + Sync + 'static {
    /// Every step of a call that needs no waiting (see [`Limiter::begin`]).
    fn begin(&self, caller: &Caller, tool: &str, cost: Cost) -> Begun;
    /// Decides a call charged to several tools at once (see [`Limiter::admit_all`]).
    fn admit_all(&self, caller: Caller, charges: Vec<(Arc<str>, Cost)>) -> BoxFuture<AllOutcome>;
    /// Gives back the permits of a call that ended, without waiting for the store.
    fn release(&self, ticket: Ticket);
    /// Corrects a call's charge to its `actual` cost, without waiting for the store.
    fn settle(&self, ticket: Ticket, actual: Cost);
}

impl<S: Store, C: Clock> Limits for Limiter<S, C> {
    fn begin(&self, caller: &Caller, tool: &str, cost: Cost) -> Begun {
        Limiter::begin(self, caller, tool, cost)
    }

    fn admit_all(&self, caller: Caller, charges: Vec<(Arc<str>, Cost)>) -> BoxFuture<AllOutcome> {
        let this = self.clone();
        Box::pin(async move {
            let charges: Vec<(&str, Cost)> = charges.iter().map(|(t, c)| (&**t, *c)).collect();
            this.admit_all(&caller, &charges).await
        })
    }

    fn release(&self, ticket: Ticket) {
        let this = self.clone();
        finish_in_background(Box::pin(async move { this.release(&ticket).await }));
    }

    fn settle(&self, ticket: Ticket, actual: Cost) {
        let this = self.clone();
        finish_in_background(Box::pin(async move { this.settle(&ticket, actual).await }));
    }
}

/// Runs store work that nobody waits for: at once when the store answers at once (the memory
/// store always does), otherwise on the tokio runtime.
fn finish_in_background(mut fut: BoxFuture<()>) {
    if fut
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_ready()
    {
        return;
    }
    #[cfg(feature = "tokio")]
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(fut);
        return;
    }
    tracing::warn!(
        "store work (permit release or cost correction) could not finish: the store waits, and no tokio runtime is available (enable the `tokio` feature)"
    );
}

/// An admitted call's ticket; when the ticket holds concurrency permits, they are given back
/// when this is dropped.
pub(crate) struct Held {
    ticket: Ticket,
    /// Set when the ticket holds permits.
    permits: Option<Arc<dyn Limits>>,
}

impl Held {
    #[inline]
    pub(crate) fn new(ticket: Ticket, limiter: &Arc<dyn Limits>) -> Held {
        let holds = ticket.holds_permits();
        Held {
            ticket,
            permits: holds.then(|| limiter.clone()),
        }
    }

    pub(crate) fn ticket(&self) -> &Ticket {
        &self.ticket
    }

    /// Whether dropping this gives permits back: only then does it need to outlive the call.
    pub(crate) fn holds_permits(&self) -> bool {
        self.permits.is_some()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(limiter) = self.permits.take() {
            limiter.release(self.ticket.take_permits());
        }
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("holds_permits", &self.holds_permits())
            .finish_non_exhaustive()
    }
}
