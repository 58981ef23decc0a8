//! Where admission state lives. One atomic "check every level and commit" call per decision.
//!
//! [`MemoryStore`] keeps state in this process (the default); a Redis store shares it between
//! replicas. Every store runs the same pure decision ([`crate::admission::engine::decide`]) and
//! passes the same conformance suite.

mod memory;
#[cfg(feature = "redis")]
pub mod redis;

use std::future::Future;
use std::sync::Arc;

#[cfg(feature = "redis")]
pub use self::redis::RedisStore;
pub use memory::MemoryStore;

use crate::admission::engine::{Charge, LevelRef, LevelView, NodeState, Plan};
use crate::admission::Refusal;
use crate::clock::Timestamp;
use crate::policy::ToolPolicy;

/// Identifies the levels of one admitted call, so the store can find them again to correct
/// the charge or release permits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CallKeys {
    /// Tool name.
    pub tool: Arc<str>,
    /// Tenant name, or the untenanted caller's id.
    pub tenant: Arc<str>,
    /// Instance name, when instances are limited separately.
    pub instance: Option<Arc<str>>,
    /// Whether `tenant` is an untenanted caller.
    pub untenanted: bool,
}

impl CallKeys {
    /// The keys of a call of `tool` charged to `tenant` and `instance` as resolved, sharing
    /// the caller's names: no string is copied.
    pub(crate) fn of(
        tool: &Arc<ToolPolicy>,
        tenant: &LevelRef<'_>,
        instance: Option<&LevelRef<'_>>,
        untenanted: bool,
    ) -> CallKeys {
        CallKeys {
            tool: tool.name_arc().clone(),
            tenant: tenant.name.clone(),
            instance: instance.map(|i| i.name.clone()),
            untenanted,
        }
    }

    /// The injective store keys of the tool, tenant and instance levels.
    pub fn encoded(&self) -> [Option<String>; 3] {
        use crate::key;
        [
            Some(key::tool_key(&self.tool)),
            Some(if self.untenanted {
                key::untenanted_key(&self.tool, &self.tenant)
            } else {
                key::tenant_key(&self.tool, &self.tenant)
            }),
            self.instance
                .as_ref()
                .map(|i| key::instance_key(&self.tool, &self.tenant, i)),
        ]
    }
}

/// An admitted call, as the store reports it.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Admission {
    /// Which levels were charged.
    pub keys: CallKeys,
    /// What was charged where.
    pub charge: Charge,
    /// Units of the caller's quota (its ceiling per period, [`quota`](Self::quota)) left in
    /// the current aligned window: the `r` of the `RateLimit` header, stated against `q`.
    pub remaining: f64,
    /// The caller's ceiling per period.
    pub quota: f64,
    /// Microseconds until the aligned window resets.
    pub reset_in: f64,
    /// Pool tokens left at the tool: the slack to lend.
    pub slack: f64,
    /// Tenant and instance numbers at the time of the decision.
    pub views: [LevelView; 2],
    /// When the store decided (its clock, or the caller's).
    pub at: Timestamp,
    /// The store's name for this call, unique across replicas: what its concurrency permits
    /// are held under (0 for a store that needs none, like [`MemoryStore`]).
    pub call: u128,
}

impl Admission {
    /// An answer for `keys` decided at `at`, every figure zero, for a store to fill in.
    /// (Rarely made: the memory store mostly writes over a record its thread kept.)
    pub(crate) fn blank(keys: CallKeys, at: Timestamp) -> Admission {
        Admission {
            keys,
            at,
            ..Admission::default()
        }
    }
}

/// The store's answer.
#[derive(Clone, Debug)]
pub enum Decision {
    /// Admitted and committed.
    Admitted(Arc<Admission>),
    /// Refused; nothing was charged.
    Refused(Refusal),
}

/// A store could not decide. Backend errors convert into this one enum.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend did not answer in time.
    #[error("the rate-limit store did not answer within {0:?}: check its health and network, or raise the timeout")]
    Timeout(std::time::Duration),
    /// The backend could not be reached or failed.
    #[error("the rate-limit store is unavailable: {0}")]
    Unavailable(String),
    /// The backend answered something this crate does not understand.
    #[error("the rate-limit store answered unexpectedly: {0}")]
    Protocol(String),
}

/// Keeps admission state and applies decisions atomically.
///
/// A store implements one atomic operation per decision: read the state of every level the
/// call touches, run [`decide`](crate::admission::engine::decide), and write the result back,
/// without any other decision interleaving. Corrections and permit releases are separate,
/// later calls.
///
/// **Cancellation.** The future of [`decide`](Self::decide) may be dropped at any await point
/// (a client disconnects, a timeout fires). A store whose decision can still take effect after
/// that — a command already sent to a server — must finish it and, if it was admitted, give
/// back what it charged and the permits it took: no path may leak a permit or a unit.
/// [`MemoryStore`] decides without awaiting; the Redis store finishes abandoned decisions in
/// the background.
pub trait Store: Send + Sync + 'static {
    /// A short name for metrics labels (`memory`, `redis`, ...).
    fn kind(&self) -> &'static str {
        "custom"
    }

    /// Decides one call and commits it if admitted.
    fn decide<'a>(
        &'a self,
        plan: &'a Plan<'a>,
        keys: &'a CallKeys,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + 'a;

    /// Decides one call without waiting, when this store can (the in-process store always
    /// can); `None` when the answer needs I/O, and then nothing has been done: use
    /// [`decide`](Self::decide). Lets callers skip allocating a future. The default is `None`.
    fn decide_now(&self, plan: &Plan<'_>, keys: &CallKeys) -> Option<Result<Decision, StoreError>> {
        let _ = (plan, keys);
        None
    }

    /// [`decide_now`](Self::decide_now) for the call's own keys, the ones the plan names
    /// ([`Plan::keys`]), which the store makes only where it needs them: a store that finds
    /// its levels by the plan's names makes them once, for its answer to keep
    /// ([`Admission::keys`]), and not at all for a refusal (each copy writes three reference
    /// counts, and three more when it is dropped). `None` as for `decide_now`. The default
    /// makes the keys and lends them to `decide_now`.
    fn decide_now_planned(&self, plan: &Plan<'_>) -> Option<Result<Decision, StoreError>> {
        self.decide_now(plan, &plan.keys())
    }

    /// Corrects an admitted call's charge by `factor` × what it charged (−1.0 refunds it
    /// entirely; 0.5 charges half again). Never touches a window that has closed.
    fn adjust<'a>(
        &'a self,
        admission: &'a Admission,
        factor: f64,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// Corrects a charge like [`adjust`](Self::adjust) without waiting, when this store can
    /// (the in-process store always can); `None` when it needs I/O, and then nothing has been
    /// done. The default is `None`.
    fn adjust_now(
        &self,
        admission: &Admission,
        factor: f64,
        now: Timestamp,
    ) -> Option<Result<(), StoreError>> {
        let _ = (admission, factor, now);
        None
    }

    /// Returns the concurrency permits an admitted call took.
    fn release<'a>(
        &'a self,
        admission: &'a Admission,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// The stored state of the tool, tenant and instance levels of `keys` (`None` where
    /// nothing is stored), as the store holds it: not brought up to date. For diagnostics and
    /// tests.
    fn inspect<'a>(
        &'a self,
        keys: &'a CallKeys,
    ) -> impl Future<Output = Result<[Option<NodeState>; 3], StoreError>> + Send + 'a;

    /// The same states as [`inspect`](Self::inspect), as a decision at `now` reads them: calls
    /// in flight are the permits that have not lapsed by then (a store whose permits never
    /// lapse, like the memory store, answers as `inspect`). Writes nothing. What
    /// [`Limiter::explain`](crate::Limiter::explain) and the console read.
    fn inspect_at<'a>(
        &'a self,
        keys: &'a CallKeys,
        now: Timestamp,
    ) -> impl Future<Output = Result<[Option<NodeState>; 3], StoreError>> + Send + 'a {
        let _ = now;
        self.inspect(keys)
    }

    /// Told the policy this process enforces, when the limiter is made and at every reload.
    /// A store shared by replicas publishes each tool's [fingerprint](crate::policy::ToolPolicy::fingerprint)
    /// so that replicas enforcing different policies are found (see
    /// [`policy_disagreements`](Self::policy_disagreements)). The default does nothing.
    fn policy_in_force(&self, policy: &crate::Policy) {
        let _ = policy;
    }

    /// The tools whose policy the live replicas sharing this store enforce differently, as
    /// last checked (a store of one process, the default, has none).
    fn policy_disagreements(&self) -> Vec<PolicyDisagreement> {
        Vec::new()
    }

    /// Waits until the work this store finishes in the background is done — permits of calls
    /// that ended given back, charges of callers that left refunded — for a graceful shutdown
    /// ([`Limiter::shutdown`](crate::Limiter::shutdown)). The default has none to wait for.
    fn flush(&self) -> impl Future<Output = ()> + Send + '_ {
        std::future::ready(())
    }
}

impl<S: Store> Store for Arc<S> {
    fn kind(&self) -> &'static str {
        (**self).kind()
    }
    fn decide<'a>(
        &'a self,
        plan: &'a Plan<'a>,
        keys: &'a CallKeys,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + 'a {
        (**self).decide(plan, keys)
    }
    fn decide_now(&self, plan: &Plan<'_>, keys: &CallKeys) -> Option<Result<Decision, StoreError>> {
        (**self).decide_now(plan, keys)
    }
    fn decide_now_planned(&self, plan: &Plan<'_>) -> Option<Result<Decision, StoreError>> {
        (**self).decide_now_planned(plan)
    }
    fn adjust<'a>(
        &'a self,
        admission: &'a Admission,
        factor: f64,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        (**self).adjust(admission, factor, now)
    }
    fn adjust_now(
        &self,
        admission: &Admission,
        factor: f64,
        now: Timestamp,
    ) -> Option<Result<(), StoreError>> {
        (**self).adjust_now(admission, factor, now)
    }
    fn release<'a>(
        &'a self,
        admission: &'a Admission,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        (**self).release(admission)
    }
    fn inspect<'a>(
        &'a self,
        keys: &'a CallKeys,
    ) -> impl Future<Output = Result<[Option<NodeState>; 3], StoreError>> + Send + 'a {
        (**self).inspect(keys)
    }
    fn inspect_at<'a>(
        &'a self,
        keys: &'a CallKeys,
        now: Timestamp,
    ) -> impl Future<Output = Result<[Option<NodeState>; 3], StoreError>> + Send + 'a {
        (**self).inspect_at(keys, now)
    }
    fn flush(&self) -> impl Future<Output = ()> + Send + '_ {
        (**self).flush()
    }
    fn policy_in_force(&self, policy: &crate::Policy) {
        (**self).policy_in_force(policy)
    }
    fn policy_disagreements(&self) -> Vec<PolicyDisagreement> {
        (**self).policy_disagreements()
    }
}

/// Replicas sharing a store that enforce different policies for one tool: during a rolling
/// reload for a moment, for good when one replica was given another file.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PolicyDisagreement {
    /// The tool.
    pub tool: String,
    /// This replica's fingerprint of the tool's policy; `None` when its policy has no such
    /// tool.
    pub fingerprint: Option<u64>,
    /// Each fingerprint the live replicas enforce (`None`: they have no such tool) with how
    /// many replicas, this one included.
    pub replicas: Vec<(Option<u64>, usize)>,
    /// How long this replica has seen them disagree.
    pub for_how_long: std::time::Duration,
    /// Whether that is longer than the grace time a rolling reload is given.
    pub past_grace: bool,
}
