//! # tower-fairshare
//!
//! Fair-share rate limiting for a tool that many tenants — and their AI agents — share.
//! Every tenant keeps its guaranteed floor, spare capacity is split by weight, idle capacity
//! is lent but never a floor, and one runaway agent instance cannot starve its teammates.
//!
//! ## Quick start (axum)
//!
//! ```no_run
//! use axum::{extract::Request, middleware::{self, Next}, response::Response, routing::post, Router};
//! use tower_fairshare::{Caller, FairShareLayer, Limiter, Policy};
//!
//! // Your auth layer decides who is calling and puts it in the request extensions. Never
//! // take it from the body: whoever sets the caller chooses who gets charged.
//! async fn auth(mut req: Request, next: Next) -> Response {
//!     if let Some(key) = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()) {
//!         let caller = match key {
//!             "sk-acme" => Some(Caller::new("acme").with_instance("report-agent")),
//!             _ => None,
//!         };
//!         if let Some(c) = caller {
//!             req.extensions_mut().insert(c);
//!         }
//!     }
//!     next.run(req).await
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let limiter = Limiter::new(Policy::from_path("policy.toml")?);
//! let app: Router = Router::new()
//!     .route("/tools/{name}", post(|| async { "ok" }))
//!     // Refuses before the handler runs: 429/403/401/503 with a JSON body, Retry-After and
//!     // RateLimit headers. The tool is the `{name}` path segment.
//!     .layer(FairShareLayer::new(limiter).tool_from_path("/tools/").headers(true))
//!     .layer(middleware::from_fn(auth));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```
//!
//! The [`Limiter`] can also be called directly, and [`DescribedLayer`] limits services that
//! are not HTTP. [`Limiter::console`] is the operator's view — a live page, and
//! [`Limiter::explain`]: why a caller is (or would be) throttled — as a service to mount.
//!
//! ## Semantics in one screen
//!
//! A tool has capacity C per period P. Each tenant (and each instance inside a tenant) has a
//! **floor** (guaranteed units per P, reserved: never lent), a **weight** (its share of the
//! spare `S = C − Σ floors` is `S × w / Σw`), a **ceiling** (default floor + share) and a
//! **burst** (the most it takes at one instant above its floor). A call passes only if it
//! passes every level — tool, tenant, instance, every calendar budget, every concurrency cap
//! — and a refusal charges nothing anywhere. Idle share is lent to busy callers, highest
//! weight first, each up to its ceiling. See [`admission::engine`] for the algorithm and
//! `docs/semantics.md` in the repository for what the property tests prove.
//!
//! ## Features
//!
//! * `memory` (default) — the in-process [`MemoryStore`] (always built; the feature names it).
//! * `redis` — `RedisStore`: state shared by every replica; a tool's calls decided in batches,
//!   one round trip a batch (a caller alone: one a call).
//! * `redis-tls` — `rediss://` for `RedisStore`, with a private CA and client certificates.
//! * `redis-bb8` — a bb8 pool for `RedisStore`.
//! * `quanta` — a faster [`SystemClock`] (the CPU's time-stamp counter between wall-clock
//!   reads).
//! * `metrics` — counters, gauges and histograms through the `metrics` facade
//!   ([`telemetry`]).
//! * `axum`, `tonic` — `IntoResponse` / `From<Refusal> for Status` for handlers that call the
//!   limiter themselves.
//! * `tokio` — finish permit releases and cost corrections on the runtime when a store
//!   cannot do it at once (implied by `redis`).
//!
//! The `fairshare` command (check a policy, simulate load, serve a gateway, run the demo) is a
//! crate of its own, so a service that depends on this library compiles none of it:
//! `cargo install --path fairshare` in a clone of the repository, or `cargo run -p fairshare`.
//!
//! MSRV: 1.88 (declared, and checked against every locked dependency in CI).

#![forbid(unsafe_code)]
// A `Refusal` is the product's answer, not an exceptional error: it is returned by value so
// callers can match on it without unboxing.
#![allow(clippy::result_large_err)]
#![deny(missing_docs)]
// A function reads whole: at most 80 lines of code (`clippy.toml`).
#![warn(clippy::too_many_lines)]
#![warn(missing_debug_implementations, unreachable_pub, rust_2018_idioms)]

pub mod admission;
mod clock;
pub mod console;
mod identity;
#[cfg(any(feature = "axum", feature = "tonic"))]
mod integrations;
mod key;
mod layer;
mod lease;
mod limiter;
pub mod policy;
pub mod store;
pub mod telemetry;
mod ticket;

pub use admission::{Reason, Refusal, RefusalDetails, Scope};
pub use clock::{Clock, ManualClock, SystemClock, Timestamp};
pub use console::{Console, Explanation};
pub use identity::{Caller, Cost};
pub use layer::{
    default_refusal_response, grpc_code, http_status, BufferedBody, CallerFromExtensions, Describe,
    Described, DescribedFuture, DescribedLayer, FairShare, FairShareError, FairShareLayer,
    FairShareMcp, FairShareModel, Identify, McpCall, McpFuture, McpLayer, McpRefusals, MeteredBody,
    ModelCallLayer, ModelFuture, RequestHead, ResponseBody, ResponseFuture, ToolName, Usage,
    MCP_REFUSED, RATELIMIT, RATELIMIT_POLICY,
};
pub use limiter::{Admit, Limiter, Ticket, MAX_TOOLS_PER_CALL};
pub use policy::{
    BudgetPeriod, InstanceBuilder, OnStoreError, Period, Policy, PolicyBuilder, PolicyError,
    TenantBuilder, ToolBuilder, Unit, UnknownPlan, MAX_PLANS,
};
#[cfg(feature = "redis")]
pub use store::RedisStore;
pub use store::{MemoryStore, PolicyDisagreement, Store, StoreError};
