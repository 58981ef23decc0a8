//! # tower-fairshare
//!
//! Fair-share rate limiting for services that many tenants — and their AI agents — share.
//! Every tenant keeps its guaranteed floor, spare capacity is split by weight, idle capacity
//! is lent but never a floor, and one runaway agent instance cannot starve its teammates.
//!
//! ```
//! use tower_fairshare::{Caller, Cost, Limiter, Policy};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let policy = Policy::from_toml_str(r#"
//!     [[tool]]
//!     name = "web_search"
//!     unit = "calls"
//!     rate = { limit = 600, per = "1m" }
//!
//!     [tool.tenants.team-research]
//!     weight = 6
//!     floor = 100
//!
//!     [tool.tenants.team-support]
//!     weight = 2
//!     floor = 60
//! "#)?;
//! let limiter = Limiter::new(policy);
//! let caller = Caller::new("team-research");
//! match limiter.admit(&caller, "web_search", Cost::default()).await {
//!     Ok(_ticket) => { /* call the tool */ }
//!     Err(refusal) => println!("{}", refusal.to_json()),
//! }
//! # Ok::<(), tower_fairshare::PolicyError>(())
//! # }).unwrap();
//! ```
//!
//! ## Semantics in one screen
//!
//! A tool has capacity C per period P. Each tenant (and each instance inside a tenant) has a
//! **floor** (guaranteed units per P, reserved: never lent), a **weight** (its share of the
//! spare `S = C − Σ floors` is `S × w / Σw`), a **ceiling** (default floor + share) and a
//! **burst** (the most it takes at one instant above its floor). A call passes only if it
//! passes every level — tool, tenant, instance, every calendar budget, every concurrency cap
//! — and a refusal charges nothing anywhere. See [`admission::engine`] for the algorithm.
//!
//! ## Features
//!
//! * `memory` (default) — the in-process [`MemoryStore`].
//! * `cli` — the `fairshare` command: `check` and `simulate`.

#![forbid(unsafe_code)]
// A `Refusal` is the product's answer, not an exceptional error: it is returned by value so
// callers can match on it without unboxing.
#![allow(clippy::result_large_err)]
#![deny(missing_docs)]
#![warn(missing_debug_implementations, unreachable_pub, rust_2018_idioms)]

pub mod admission;
pub mod chart;
mod clock;
mod identity;
#[cfg(any(feature = "axum", feature = "tonic"))]
mod integrations;
pub mod key;
mod layer;
mod limiter;
pub mod policy;
pub mod simulate;
pub mod store;
pub mod telemetry;

pub use admission::{Reason, Refusal, Scope};
pub use clock::{Clock, ManualClock, SystemClock, Timestamp};
pub use identity::{Caller, Cost};
pub use layer::{
    grpc_code, http_status, CallerFromExtensions, Describe, Described, DescribedFuture,
    DescribedLayer, FairShare, FairShareError, FairShareLayer, Identify, RequestHead, ResponseBody,
    ResponseFuture, ToolName, RATELIMIT, RATELIMIT_POLICY,
};
pub use limiter::{Limiter, Ticket};
pub use policy::{
    BudgetPeriod, InstanceBuilder, OnStoreError, Period, Policy, PolicyBuilder, PolicyError,
    TenantBuilder, ToolBuilder, Unit,
};
pub use store::{MemoryStore, Store, StoreError};
