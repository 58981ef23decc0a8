//! The limiter: policy + store + clock. Resolves who is calling what, asks the store, and
//! turns the answer into an admission or a typed refusal. The layer is a thin shell over it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;
use std::task::Poll;

use arc_swap::ArcSwap;

use crate::admission::engine::{LevelRef, Plan};
use crate::admission::{Reason, Refusal, Scope};
use crate::clock::{Clock, SystemClock};
use crate::identity::{Caller, Cost};
use crate::lease::{self, Leases, Part, Take};
use crate::policy::{OnStoreError, Policy, ToolPolicy};
use crate::store::{Admission, CallKeys, Decision, MemoryStore, Store, StoreError};
use crate::telemetry;

/// How many of a tool's tenants the metrics label by name unless told otherwise.
const DEFAULT_TENANT_LABELS: usize = 1_000;

/// Decides calls against a [`Policy`], with state in a [`Store`] and time from a [`Clock`].
///
/// Cheap to clone: clones share policy, store and clock.
///
/// ```
/// use tower_fairshare::{Caller, Cost, Limiter, Policy};
///
/// # tokio_test_block_on(async {
/// let policy = Policy::from_toml_str(r#"
///     [[tool]]
///     name = "generate_report"
///     unit = "calls"
///     rate = { limit = 600, per = "1m" }
///     [tool.default_tenant]
///     ceiling = 3
///     burst = 3
/// "#).unwrap();
/// let limiter = Limiter::new(policy);
/// let acme = Caller::new("acme").with_instance("shared-agent");
/// for _ in 0..3 {
///     assert!(limiter.admit(&acme, "generate_report", Cost::default()).await.is_ok());
/// }
/// let refusal = limiter.admit(&acme, "generate_report", Cost::default()).await.unwrap_err();
/// assert_eq!(refusal.reason.as_str(), "rate_limited");
/// // Another tenant presenting the same instance id has its own, untouched allowance.
/// let globex = Caller::new("globex").with_instance("shared-agent");
/// assert!(limiter.admit(&globex, "generate_report", Cost::default()).await.is_ok());
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Debug)]
pub struct Limiter<S = MemoryStore, C = SystemClock> {
    inner: Arc<Inner<S, C>>,
}

impl<S, C> Clone for Limiter<S, C> {
    fn clone(&self) -> Self {
        Limiter {
            inner: self.inner.clone(),
        }
    }
}

#[derive(Debug)]
struct Inner<S, C> {
    /// Read on every decision, written on reload: an `ArcSwap`, so readers on many threads
    /// never contend on a lock.
    policy: ArcSwap<Policy>,
    /// The version of the policy in force (see `Policy::version`), written after the policy:
    /// a call that reads its lease's version here is spent without reading the policy.
    version: AtomicU64,
    /// Held while a policy is put in force, so that versions follow the order of the stores.
    reloading: std::sync::Mutex<()>,
    store: S,
    clock: C,
    instance_labels: bool,
    tenant_labels: usize,
    /// Refusals counted and kept for the console (off until one is made).
    recorder: crate::console::Recorder,
    /// Which refusals get an `info` line (one per caller per window).
    refusal_lines: telemetry::RefusalLines,
    /// The busiest unlisted callers of each tool, named in metrics and the console.
    busiest: telemetry::busiest::Busiest,
    /// Units of callers' own allocations this process holds, charged in advance (tools with
    /// `lease = { max = N }`).
    leases: Leases,
    on_drop: fn(&mut Inner<S, C>),
}

impl<S, C> Drop for Inner<S, C> {
    fn drop(&mut self) {
        (self.on_drop)(self)
    }
}

/// Gives every lease back to a store that can take it at once, when the limiter goes; a store
/// that needs I/O gets them back when its leases lapse (call [`Limiter::return_leases`] before
/// dropping). A function pointer in `Inner`, made where the bounds hold, so the types
/// themselves need none.
fn give_back_on_drop<S: Store, C: Clock>(inner: &mut Inner<S, C>) {
    let now = inner.clock.now();
    for r in inner.leases.drain() {
        let _ = inner.store.adjust_now(&r.grant, r.factor, now);
    }
}

/// An admitted call: what to correct, refund or release later, and the figures of its
/// `RateLimit` headers.
///
/// ```
/// use tower_fairshare::{Caller, Cost, Limiter, Policy};
///
/// let policy = Policy::from_toml_str(r#"
///     [[tool]]
///     name = "search"
///     unit = "calls"
///     rate = { limit = 600, per = "1m" }
///     [tool.tenants.acme]
///     ceiling = 60
/// "#).unwrap();
/// let limiter = Limiter::new(policy);
/// let ticket = limiter
///     .try_admit(&Caller::new("acme"), "search", Cost(1.0))
///     .expect("the in-process store answers at once")
///     .expect("admitted");
/// assert_eq!(ticket.cost(), Some(1.0));
/// assert_eq!(ticket.quota(), Some(60.0));
/// assert_eq!(ticket.remaining(), Some(59.0));
/// assert_eq!(ticket.part(), 1.0, "decided on its own, not spent from a lease");
/// ```
#[derive(Clone, Debug)]
pub struct Ticket {
    admission: Option<Charged>,
    shadow_refusal: Option<Refusal>,
    window_secs: u64,
}

/// What the store charged for an admitted call.
#[derive(Clone, Debug)]
enum Charged {
    /// The call's own admission.
    Own(Arc<Admission>),
    /// Spent from a lease: the lease's grant and the call's part of it.
    Leased(Arc<Admission>, Part),
}

impl Ticket {
    /// What the store charged for this call: the call's own admission, or, for a call spent
    /// from a lease, the lease's grant, of which the call took [`part`](Self::part). `None`
    /// when the call went through unmetered (the store was unreachable and the tool fails
    /// open) or, in shadow mode, when it would have been refused.
    pub fn admission(&self) -> Option<&Admission> {
        match self.admission.as_ref()? {
            Charged::Own(a) => Some(a),
            Charged::Leased(g, _) => Some(g),
        }
    }

    /// A call spent from a lease's `grant`: its `part` of it.
    pub(crate) fn leased(grant: Arc<Admission>, part: Part, window_secs: u64) -> Ticket {
        Ticket {
            admission: Some(Charged::Leased(grant, part)),
            shadow_refusal: None,
            window_secs,
        }
    }

    /// The call's part of a lease's grant, if it was spent from one.
    fn leased_part(&self) -> Option<Part> {
        match &self.admission {
            Some(Charged::Leased(_, p)) => Some(*p),
            _ => None,
        }
    }

    /// The call's share of [`admission`](Self::admission)'s charge at every level: 1 for a
    /// call decided on its own, its cost over the grant's for a call spent from a lease.
    pub fn part(&self) -> f64 {
        self.leased_part().map_or(1.0, |p| p.of)
    }

    /// What the call was charged, in the tool's units (its cost); `None` when unmetered.
    pub fn cost(&self) -> Option<f64> {
        let a = self.admission()?;
        Some(self.leased_part().map_or(a.charge.cost, |p| p.cost))
    }

    /// Units of the caller's quota left in the current aligned window as of this call (the
    /// `r` of the `RateLimit` header; units a lease holds for the caller count as its own).
    pub fn remaining(&self) -> Option<f64> {
        let a = self.admission()?;
        Some(self.leased_part().map_or(a.remaining, |p| p.remaining))
    }

    /// The caller's ceiling per period (the `q` of `RateLimit-Policy`).
    pub fn quota(&self) -> Option<f64> {
        self.admission().map(|a| a.quota)
    }

    /// How long until the aligned window resets, as of this call.
    pub fn reset_in(&self) -> Option<std::time::Duration> {
        let a = self.admission()?;
        let us = self.leased_part().map_or(a.reset_in, |p| p.reset_in);
        Some(std::time::Duration::from_micros(us.max(0.0).ceil() as u64))
    }

    /// In shadow mode (`enforce = false`), the refusal that would have been returned.
    pub fn shadow_refusal(&self) -> Option<&Refusal> {
        self.shadow_refusal.as_ref()
    }

    /// The tool's period in whole seconds (the `w` of `RateLimit-Policy`).
    pub fn window_secs(&self) -> u64 {
        self.window_secs
    }

    /// Whether the call holds concurrency permits to give back (a call spent from a lease
    /// never does: no level on a leased path caps calls in flight).
    pub fn holds_permits(&self) -> bool {
        matches!(&self.admission, Some(Charged::Own(a)) if a.charge.holds_permits())
    }

    /// The level whose allowance the caller draws on: `instance` when instances are limited
    /// separately, `tenant` otherwise.
    pub fn scope(&self) -> Scope {
        match self.admission() {
            Some(a) if a.keys.instance.is_some() => Scope::Instance,
            _ => Scope::Tenant,
        }
    }

    /// The ticket's permits, taken out of it (what is left reads as unmetered).
    pub(crate) fn take_permits(&mut self) -> Ticket {
        Ticket {
            admission: self.admission.take(),
            shadow_refusal: None,
            window_secs: self.window_secs,
        }
    }
}

impl Limiter<MemoryStore, SystemClock> {
    /// A limiter with an in-process store and the system clock.
    pub fn new(policy: Policy) -> Self {
        Limiter::with_store(policy, MemoryStore::new(), SystemClock)
    }
}

impl<S: Store, C: Clock> Limiter<S, C> {
    /// A limiter over `store`, reading time from `clock`.
    pub fn with_store(mut policy: Policy, store: S, clock: C) -> Self {
        policy.version = 0;
        store.policy_in_force(&policy);
        Limiter {
            inner: Arc::new(Inner {
                policy: ArcSwap::from_pointee(policy),
                version: AtomicU64::new(0),
                reloading: std::sync::Mutex::new(()),
                store,
                clock,
                instance_labels: false,
                tenant_labels: DEFAULT_TENANT_LABELS,
                recorder: Default::default(),
                refusal_lines: Default::default(),
                busiest: Default::default(),
                leases: Leases::new(),
                on_drop: give_back_on_drop::<S, C>,
            }),
        }
    }

    /// Adds the `instance` label to decision metrics (off by default: label cardinality is a
    /// production hazard). Like every label, its values are names the policy lists (the first
    /// [`tenant_labels`](Self::tenant_labels) instances of a tenant), `other` for the rest and
    /// for a template's instances, `unknown` for an instance the policy refuses, `none` for a
    /// caller without one. Call before cloning the limiter.
    pub fn instance_labels(mut self, yes: bool) -> Self {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.instance_labels = yes,
            None => {
                tracing::warn!("instance_labels must be set before the limiter is cloned; ignored")
            }
        }
        self
    }

    /// How many of a tool's tenants (and of a tenant's instances) the metrics label by name,
    /// in the order the policy lists them (default 1,000). The rest, and every caller a
    /// template governs but the tool's busiest (a top-K of at most 10, see
    /// [`telemetry::busiest`](crate::telemetry::busiest)), share the label `other`; callers and
    /// tools the policy does not know are `unknown`. A flood of made-up names adds no series:
    /// a tool has at most this many tenant label values plus twelve at once. Call before
    /// cloning the limiter.
    pub fn tenant_labels(mut self, max: usize) -> Self {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.tenant_labels = max,
            None => {
                tracing::warn!("tenant_labels must be set before the limiter is cloned; ignored")
            }
        }
        self
    }

    /// The policy in force.
    pub fn policy(&self) -> Arc<Policy> {
        self.inner.policy.load_full()
    }

    /// Replaces the policy. State is keyed by names, so usage so far, windows and permits
    /// carry over; the new limits apply from the next decision.
    ///
    /// Leases end with the policy they were granted under: what they hold goes back to the
    /// store now (to a store that needs I/O for it, with the next decision).
    pub fn set_policy(&self, mut policy: Policy) {
        {
            let _one_at_a_time = self
                .inner
                .reloading
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let version = self.inner.version.load(Relaxed) + 1;
            policy.version = version;
            let policy = Arc::new(policy);
            self.inner.recorder.retain(&policy);
            self.inner
                .busiest
                .retain(|tool| policy.tool(tool).is_some());
            self.inner.store.policy_in_force(&policy);
            self.inner.policy.store(policy);
            self.inner.version.store(version, Release);
        }
        self.give_back_now(self.inner.leases.drain(), self.inner.clock.now());
    }

    /// Loads the policy file at `path` and, only if it is valid, puts it in force (see
    /// [`set_policy`](Self::set_policy)). An invalid file changes nothing: the error is
    /// returned (and logged) and the old policy stays.
    pub fn reload_from_path(
        &self,
        path: impl AsRef<std::path::Path>,
    ) -> Result<(), crate::PolicyError> {
        let path = path.as_ref();
        match Policy::from_path(path) {
            Ok(p) => {
                for w in p.warnings() {
                    tracing::warn!(file = %path.display(), "policy warning: {w}");
                }
                self.set_policy(p);
                tracing::info!(file = %path.display(), "policy reloaded");
                Ok(())
            }
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, "policy file rejected; keeping the policy in force");
                Err(e)
            }
        }
    }

    /// What the console counts and keeps.
    pub(crate) fn recorder(&self) -> &crate::console::Recorder {
        &self.inner.recorder
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// The clock.
    pub fn clock(&self) -> &C {
        &self.inner.clock
    }

    /// Decides one call of `tool` by `caller`, costing `cost`, and commits it if admitted.
    ///
    /// Order: identity → tool and tier (no counter touched on denial) → concurrency → every
    /// rate and budget, checked and committed atomically.
    pub fn admit<'a>(
        &'a self,
        caller: &'a Caller,
        tool: &'a str,
        cost: Cost,
    ) -> impl Future<Output = Result<Ticket, Refusal>> + Send + 'a {
        Admit {
            limiter: self,
            caller,
            tool,
            cost,
            step: Step::Start,
        }
    }

    /// The first step of [`admit`](Self::admit), when it is first polled: the answer when it
    /// needs no waiting (and whether it is to spend a unit of the runtime's cooperative
    /// budget first), or the part that waits, boxed.
    fn admit_first<'a>(&'a self, caller: &'a Caller, tool: &'a str, cost: Cost) -> Step<'a> {
        // (A call spent from its lease was answered by `Admit::poll`.)
        match self.admit_at_once(caller, tool, cost, true) {
            // A decision on a leasing path may not wait: it spends a unit of tokio's
            // cooperative budget, so a task that loops on leased decisions still lets the
            // runtime run its other tasks (a store's own among them).
            Ok((outcome, leased)) if !self.inner.leases.has_pending() => {
                Step::Answer(outcome, leased)
            }
            // Leases that ended on the way, which the store could not take back at once: given
            // back before the answer, as by any leasing call that waits.
            Ok(done) => Step::Waiting(Box::pin(self.give_back_and_answer(done))),
            // A call that waits for a store's I/O (or applies returns parked for one). That part
            // is boxed, so that a call decided at once (in memory, or from a lease) moves a
            // small future, not one sized for the store's round trip.
            Err(deferred) => {
                Step::Waiting(Box::pin(self.admit_waiting(caller, tool, cost, deferred)))
            }
        }
    }

    /// Applies the returns parked for a call that can wait, then answers with `done` (an
    /// outcome and whether it was admitted on a leasing path). Returns not applied when this
    /// future is dropped are parked again for the next call.
    async fn give_back_and_answer(&self, done: (Outcome, bool)) -> Result<Ticket, Refusal> {
        self.give_back_waiting(self.inner.leases.take_pending(), self.inner.clock.now())
            .await;
        #[cfg(feature = "tokio")]
        if done.1 {
            tokio::task::coop::consume_budget().await;
        }
        done.0
    }

    /// A call spent from its caller's lease before the policy is read (see
    /// [`Leases::spend`]), recorded, its ticket written to `answer`; `false` when it is not,
    /// and goes the whole way.
    #[inline(always)]
    fn spend_leased(&self, caller: &Caller, tool: &str, cost: Cost, answer: &mut Answer) -> bool {
        let leases = &self.inner.leases;
        if !leases.may_hold(tool) {
            return false;
        }
        let version = self.inner.version.load(Acquire);
        let now = || self.inner.clock.now();
        let may_fetch_ahead = || self.may_fetch_ahead();
        let mut fetch = None;
        let spent = leases.spend(
            version,
            tool,
            caller,
            cost.0,
            now,
            may_fetch_ahead,
            &mut fetch,
            answer,
        );
        if !spent {
            return false;
        }
        if let Some(f) = fetch {
            self.fetch_ahead(caller, tool, &f.1, f.0);
        }
        if let Poll::Ready(Ok(ticket)) = answer {
            trace_admitted(caller, tool, cost, ticket);
        }
        if let Poll::Ready(outcome) = answer {
            let policy = self.inner.policy.load();
            self.report_busy(&policy, caller, tool, cost, outcome, 0);
            #[cfg(feature = "metrics")]
            self.count(&policy, caller, tool, outcome);
        }
        true
    }

    /// The part of [`admit`](Self::admit) that needs no waiting, for a call not spent from its
    /// lease by [`spend_leased`](Self::spend_leased): the outcome, recorded, and
    /// whether it was admitted on a leasing path; or, when the store needs I/O (or returns
    /// parked earlier are to be applied first), where the part that waits starts (nothing
    /// recorded yet).
    fn admit_at_once(
        &self,
        caller: &Caller,
        tool: &str,
        cost: Cost,
        can_wait: bool,
    ) -> Result<(Outcome, bool), Deferred> {
        let policy = self.inner.policy.load();
        let now = self.inner.clock.now();
        let mut leased = false;
        let outcome = match self.prepare_at(&policy, caller, tool, cost, Some(now)) {
            Err(r) => Err(r),
            Ok(p) => match self.decide_at_once(&p, caller, tool, can_wait) {
                AtOnce::Done(decided) => {
                    leased = lease::eligible(&p.plan) && decided.admitted();
                    self.conclude(p, caller, tool, decided)
                }
                AtOnce::Wait(waiting) => {
                    let now = p.plan.now;
                    drop(p);
                    return Err(Deferred {
                        policy,
                        now,
                        waiting,
                    });
                }
            },
        };
        self.record(&policy, caller, tool, cost, &outcome);
        Ok((outcome, leased))
    }

    /// The part of [`admit`](Self::admit) that waits for the store, under the policy and at
    /// the time the call was first seen.
    async fn admit_waiting(
        &self,
        caller: &Caller,
        tool: &str,
        cost: Cost,
        d: Deferred,
    ) -> Result<Ticket, Refusal> {
        let policy = &d.policy;
        let outcome = match self.prepare_at(policy, caller, tool, cost, Some(d.now)) {
            Err(r) => Err(r),
            Ok(p) => {
                let decided = self.decide_waiting(&p, caller, tool, d.waiting).await;
                #[cfg(feature = "tokio")]
                if lease::eligible(&p.plan) && decided.admitted() {
                    tokio::task::coop::consume_budget().await;
                }
                self.conclude(p, caller, tool, decided)
            }
        };
        self.record(policy, caller, tool, cost, &outcome);
        outcome
    }

    /// Decides one call like [`admit`](Self::admit), without waiting: `Some` when the store
    /// can answer at once (the in-process store always can), `None` when it needs I/O — then
    /// nothing has been decided or recorded, and [`admit`](Self::admit) is the way.
    ///
    /// ```
    /// use tower_fairshare::{Caller, Cost, Limiter, Policy};
    ///
    /// let policy = Policy::from_toml_str(r#"
    ///     [[tool]]
    ///     name = "search"
    ///     unit = "calls"
    ///     rate = { limit = 60, per = "1m" }
    ///     [tool.default_tenant]
    ///     ceiling = 1
    ///     burst = 1
    /// "#).unwrap();
    /// let limiter = Limiter::new(policy);
    /// let acme = Caller::new("acme");
    /// assert!(matches!(limiter.try_admit(&acme, "search", Cost::default()), Some(Ok(_))));
    /// assert!(matches!(limiter.try_admit(&acme, "search", Cost::default()), Some(Err(_))));
    /// ```
    pub fn try_admit(
        &self,
        caller: &Caller,
        tool: &str,
        cost: Cost,
    ) -> Option<Result<Ticket, Refusal>> {
        let mut answer = Poll::Pending;
        if self.spend_leased(caller, tool, cost, &mut answer) {
            if let Poll::Ready(outcome) = answer {
                return Some(outcome);
            }
        }
        match self.admit_at_once(caller, tool, cost, false) {
            Ok((outcome, _)) => Some(outcome),
            Err(d) => {
                // Nothing decided; what leases gave back on the way waits for a call that can
                // wait.
                for r in d.waiting.returns {
                    self.inner.leases.park(r);
                }
                None
            }
        }
    }

    /// Decides a call as far as it can without waiting: on a store that answers at once, or
    /// from the caller's lease. `Wait` when the store needs I/O, or when a call that can wait
    /// is to apply returns parked earlier first (nothing was decided; what leases gave back
    /// on the way comes with it).
    fn decide_at_once(
        &self,
        p: &Prepared<'_>,
        caller: &Caller,
        tool: &str,
        can_wait: bool,
    ) -> AtOnce {
        let store = &self.inner.store;
        if !lease::eligible(&p.plan) {
            let started = telemetry::Started::now();
            // The store makes the keys from the plan where it needs them.
            return match store.decide_now_planned(&p.plan) {
                Some(d) => {
                    started.record(store.kind());
                    AtOnce::Done(Decided::Store(d))
                }
                None => AtOnce::Wait(Waiting::default()),
            };
        }
        let leases = &self.inner.leases;
        if can_wait && leases.has_pending() {
            // Returns parked for a call that can wait: this one applies them.
            return AtOnce::Wait(Waiting::default());
        }
        // Fetched by a task of its own: a call that cannot wait (`try_admit`, which the layer
        // tries first) fetches ahead too.
        let may_fetch_ahead = self.may_fetch_ahead();
        let mut returns = Vec::new();
        let ask = match leases.take(&p.plan, p.path(), &mut returns, may_fetch_ahead) {
            Take::Hit(a, part, fetch) => {
                self.give_back_now(returns, p.plan.now);
                return AtOnce::Done(self.spent(p, caller, tool, a, part, fetch));
            }
            Take::Miss { grant } => grant,
        };
        let started = telemetry::Started::now();
        let mut ask = ask;
        let decided = loop {
            let plan = Plan {
                cost: ask,
                ..p.plan
            };
            let Some(d) = store.decide_now(&plan, p.keys()) else {
                return AtOnce::Wait(Waiting {
                    ask: Some(ask),
                    returns,
                });
            };
            match self.granted(p, ask, d, &mut returns) {
                Next::Done(d) => break d,
                Next::Alone(None) => {}
                Next::Alone(Some(grant)) => {
                    // Never kept (see `grant_waiting`); a store that cannot correct at once
                    // gets it back with a later call.
                    if store.adjust_now(&grant, -1.0, p.plan.now).is_none() {
                        returns.push(lease::Return {
                            grant,
                            factor: -1.0,
                            units: 0.0,
                        });
                    }
                }
            }
            ask = p.plan.cost;
        };
        started.record(store.kind());
        self.give_back_now(returns, p.plan.now);
        AtOnce::Done(decided)
    }

    /// A call spent from its lease's `grant`: counted, and the next grant fetched ahead when
    /// the lease asks for it (`fetch`, its size).
    #[inline]
    fn spent(
        &self,
        p: &Prepared<'_>,
        caller: &Caller,
        tool: &str,
        grant: Arc<Admission>,
        part: Part,
        fetch: Option<f64>,
    ) -> Decided {
        telemetry::lease_hit(p.plan.tool.name_arc(), p.plan.cost);
        if let Some(size) = fetch {
            self.fetch_ahead(caller, tool, p.keys(), size);
        }
        Decided::Lease(grant, part)
    }

    /// Gives back what leases returned without making the call wait: at once where the store
    /// can; otherwise by a task of its own on the tokio runtime; with no runtime, parked for
    /// the next call that can wait (see [`admit`](Self::admit)), which applies them first.
    fn give_back_now(&self, returns: Vec<lease::Return>, now: crate::clock::Timestamp) {
        if returns.is_empty() {
            return;
        }
        let mut later = Vec::new();
        for r in returns {
            match self.inner.store.adjust_now(&r.grant, r.factor, now) {
                Some(_) => telemetry::lease_returned(&r.grant.keys.tool, r.units),
                None => later.push(r),
            }
        }
        if later.is_empty() {
            return;
        }
        #[cfg(feature = "tokio")]
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let this = self.clone();
            rt.spawn(async move { this.give_back_waiting(later, now).await });
            return;
        }
        for r in later {
            self.inner.leases.park(r);
        }
    }

    /// Gives back what leases returned, waiting for the store; what is not applied when this
    /// future is dropped is parked for the next call that can wait.
    async fn give_back_waiting(&self, returns: Vec<lease::Return>, now: crate::clock::Timestamp) {
        let mut returns = Parked {
            leases: &self.inner.leases,
            returns,
        };
        while let Some(r) = returns.returns.pop() {
            telemetry::lease_returned(&r.grant.keys.tool, r.units);
            let _ = self.inner.store.adjust(&r.grant, r.factor, now).await;
        }
    }

    /// The part of a decision that waits for the store: the whole decision on a tool that
    /// does not lease; on one that does, the grant [`decide_at_once`](Self::decide_at_once)
    /// could not get at once (or the whole call, when returns were parked for it to apply).
    /// Returns the leases gave back are applied before it answers.
    async fn decide_waiting(
        &self,
        p: &Prepared<'_>,
        caller: &Caller,
        tool: &str,
        w: Waiting,
    ) -> Decided {
        let store = &self.inner.store;
        if !lease::eligible(&p.plan) {
            let started = telemetry::Started::now();
            let d = store.decide(&p.plan, p.keys()).await;
            started.record(store.kind());
            return Decided::Store(d);
        }
        let leases = &self.inner.leases;
        // Returns not yet applied when this future is dropped are parked for the next call.
        let mut returns = Parked {
            leases,
            returns: w.returns,
        };
        returns.returns.extend(leases.take_pending());
        let decided = match w.ask {
            Some(ask) => self.grant_waiting(p, ask, &mut returns.returns).await,
            None => match leases.take(
                &p.plan,
                p.path(),
                &mut returns.returns,
                self.may_fetch_ahead(),
            ) {
                Take::Hit(a, part, fetch) => self.spent(p, caller, tool, a, part, fetch),
                Take::Miss { grant } => self.grant_waiting(p, grant, &mut returns.returns).await,
            },
        };
        // Not waited for: a leasing call waits for no more than its own decision.
        self.give_back_now(std::mem::take(&mut returns.returns), p.plan.now);
        decided
    }

    /// A call on a leasing tool decided at the store, asking for `ask` units (a grant for
    /// the caller's lease when more than the call's cost).
    async fn grant_waiting(
        &self,
        p: &Prepared<'_>,
        ask: f64,
        returns: &mut Vec<lease::Return>,
    ) -> Decided {
        let store = &self.inner.store;
        let started = telemetry::Started::now();
        let mut ask = ask;
        let d = loop {
            let plan = Plan {
                cost: ask,
                ..p.plan
            };
            let d = store.decide(&plan, p.keys()).await;
            match self.granted(p, ask, d, returns) {
                Next::Done(d) => break d,
                Next::Alone(None) => {}
                Next::Alone(Some(grant)) => {
                    // Never kept, even if giving it back fails: a correction that timed
                    // out may still be applied, and a lease must not spend units the
                    // store no longer counts. (If it was not applied, the units stay
                    // charged: under-use, never over-admission.)
                    if let Err(e) = store.adjust(&grant, -1.0, p.plan.now).await {
                        tracing::warn!(error = %e, "could not give back a grant that borrowed");
                    }
                }
            }
            ask = p.plan.cost;
        };
        started.record(store.kind());
        d
    }

    /// Whether grants can be fetched ahead here: on a tokio runtime (they are fetched by a task
    /// of their own, so no call waits for one).
    fn may_fetch_ahead(&self) -> bool {
        #[cfg(feature = "tokio")]
        return tokio::runtime::Handle::try_current().is_ok();
        #[cfg(not(feature = "tokio"))]
        false
    }

    /// Fetches the next grant of `caller`'s lease on `tool` (`size` units) in a task of its
    /// own: kept as the lease's next grant if it is admitted within the caller's own share,
    /// given back otherwise.
    fn fetch_ahead(&self, caller: &Caller, tool: &str, keys: &CallKeys, size: f64) {
        #[cfg(feature = "tokio")]
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (this, caller, tool) = (self.clone(), caller.clone(), tool.to_owned());
            let keys = keys.clone();
            rt.spawn(async move {
                if !this.fetch(&caller, &tool, &keys, size).await {
                    this.inner.leases.fetch_failed(&keys, false);
                }
            });
            return;
        }
        let _ = (caller, tool, size);
        self.inner.leases.fetch_failed(keys, false);
    }

    /// A grant fetched ahead for the lease of `keys`; whether the lease's fetch is settled
    /// (kept, or given up with the lease told so).
    #[cfg(feature = "tokio")]
    async fn fetch(&self, caller: &Caller, tool: &str, keys: &CallKeys, size: f64) -> bool {
        let policy = self.inner.policy.load_full();
        let (leases, store) = (&self.inner.leases, &self.inner.store);
        let Ok(p) = self.prepare(&policy, caller, tool, Cost(size)) else {
            return false;
        };
        if p.keys() != keys {
            return false;
        }
        let back = match store.decide(&p.plan, p.keys()).await {
            Ok(Decision::Admitted(a)) if !lease::borrowed(&a) => {
                let back = leases.fetched(&p.plan, p.keys(), a, size);
                if back.is_none() {
                    telemetry::lease_granted(p.plan.tool.name_arc(), size, size);
                }
                back
            }
            Ok(Decision::Admitted(a)) => {
                leases.fetch_failed(p.keys(), true);
                Some(lease::Return {
                    grant: a,
                    factor: -1.0,
                    units: 0.0,
                })
            }
            Ok(Decision::Refused(_)) => {
                leases.fetch_failed(p.keys(), true);
                None
            }
            Err(_) => return false,
        };
        if let Some(r) = back {
            let _ = store.adjust(&r.grant, r.factor, p.plan.now).await;
        }
        true
    }

    /// What follows the store's answer `d` to a call asking for `ask` units (more than the
    /// call's cost: a grant for a lease).
    fn granted(
        &self,
        p: &Prepared<'_>,
        ask: f64,
        d: Result<Decision, StoreError>,
        returns: &mut Vec<lease::Return>,
    ) -> Next {
        let leases = &self.inner.leases;
        let alone = ask <= p.plan.cost;
        match d {
            Ok(Decision::Admitted(a)) if alone || !lease::borrowed(&a) => {
                Next::Done(self.keep(p, a, ask, returns))
            }
            // Units lent by others are never leased: all back, and the call decided alone.
            Ok(Decision::Admitted(a)) => {
                leases.cool(p.keys());
                Next::Alone(Some(a))
            }
            Ok(Decision::Refused(_)) if !alone => {
                leases.cool(p.keys());
                Next::Alone(None)
            }
            d => Next::Done(Decided::Store(d)),
        }
    }

    /// Keeps an admitted grant of `ask` units as the caller's lease; the call's admission.
    fn keep(
        &self,
        p: &Prepared<'_>,
        grant: Arc<Admission>,
        ask: f64,
        returns: &mut Vec<lease::Return>,
    ) -> Decided {
        if ask > p.plan.cost {
            telemetry::lease_granted(p.plan.tool.name_arc(), ask, ask - p.plan.cost);
        }
        match self
            .inner
            .leases
            .granted(&p.plan, p.keys(), p.known(), grant, ask, returns)
        {
            Ok((grant, part)) => Decided::Lease(grant, part),
            Err(own) => Decided::Store(Ok(Decision::Admitted(own))),
        }
    }

    /// Units charged at the store and not yet spent, held in this limiter's leases now (what
    /// leasing may leave unused at most; see the crate's notes on leases).
    pub fn leased_units(&self) -> f64 {
        self.inner.leases.held().0
    }

    /// Gives back every unit this limiter holds in leases (each refunded through every level
    /// it was charged at): for a graceful shutdown, before the limiter is dropped. Dropping
    /// the limiter gives them back too, to a store that needs no I/O for it.
    pub async fn return_leases(&self) {
        self.give_back_waiting(self.inner.leases.drain(), self.inner.clock.now())
            .await;
    }

    /// For a graceful shutdown, once the server takes no more calls and those in flight have
    /// ended: gives back every unit held in leases and waits for the store's background work
    /// (permits of the calls that ended given back, refunds of callers that left), so that a
    /// replica that stops leaves nothing for the permit TTL to clean up.
    pub async fn shutdown(&self) {
        self.return_leases().await;
        self.inner.store.flush().await;
    }

    /// Everything before the store: who is charged for what, at what time.
    pub(crate) fn prepare<'p>(
        &self,
        policy: &'p Policy,
        caller: &'p Caller,
        tool: &str,
        cost: Cost,
    ) -> Result<Prepared<'p>, Refusal> {
        self.prepare_at(policy, caller, tool, cost, None)
    }

    /// [`prepare`](Self::prepare) at `now` (the clock's time when `None`).
    fn prepare_at<'p>(
        &self,
        policy: &'p Policy,
        caller: &'p Caller,
        tool: &str,
        cost: Cost,
        now: Option<crate::clock::Timestamp>,
    ) -> Result<Prepared<'p>, Refusal> {
        let (tp, tenant, instance, untenanted) = resolve(policy, caller, tool)?;
        let c = cost.0;
        if !(c.is_finite() && c >= 0.0) {
            let mut r = denial(Reason::PermissionDenied, tool, caller, "invalid_cost");
            r.retryable = false;
            return Err(r);
        }
        Ok(Prepared {
            plan: Plan {
                now: now.unwrap_or_else(|| self.inner.clock.now()),
                cost: c,
                tool: tp,
                tenant,
                instance,
                untenanted,
            },
            caller,
            version: policy.version,
            keys: std::sync::OnceLock::new(),
        })
    }

    /// The store's answer as a ticket or a refusal, with shadow mode and the store-error
    /// policy applied.
    fn conclude(&self, p: Prepared<'_>, caller: &Caller, tool: &str, decided: Decided) -> Outcome {
        let tp = p.plan.tool;
        let window_secs = tp.period().as_secs_ceil();
        let store = &self.inner.store;
        let decided = match decided {
            Decided::Lease(grant, part) => return Ok(Ticket::leased(grant, part, window_secs)),
            Decided::Store(d) => d,
        };
        match decided {
            Ok(Decision::Admitted(a)) => Ok(Ticket {
                admission: Some(Charged::Own(a)),
                shadow_refusal: None,
                window_secs,
            }),
            Ok(Decision::Refused(mut r)) => {
                // Name the caller's instance even when instances are not limited separately.
                if let (None, false, Some(i)) =
                    (r.instance(), p.plan.untenanted, caller.instance_arc())
                {
                    r.set_instance(Some(i.clone()));
                }
                if tp.enforce() {
                    Err(r)
                } else {
                    Ok(Ticket {
                        admission: None,
                        shadow_refusal: Some(r),
                        window_secs,
                    })
                }
            }
            Err(e) => match tp.on_store_error() {
                OnStoreError::Allow => {
                    if let Some(held_back) = telemetry::let_through("store_fallback", tool) {
                        tracing::warn!(tool, store = store.kind(), error = %e, held_back, "rate-limit store failed; letting the call through unmetered (on_store_error = allow)");
                    }
                    telemetry::store_error(tp.name_arc(), store.kind(), "allow");
                    Ok(Ticket {
                        admission: None,
                        shadow_refusal: None,
                        window_secs,
                    })
                }
                OnStoreError::Deny => {
                    if let Some(held_back) = telemetry::let_through("store_fallback", tool) {
                        tracing::error!(tool, store = store.kind(), error = %e, held_back, "rate-limit store failed; refusing the call (on_store_error = deny)");
                    }
                    telemetry::store_error(tp.name_arc(), store.kind(), "deny");
                    let mut r = denial(Reason::StoreUnavailable, tool, caller, "store");
                    r.retryable = true;
                    r.retry_after = Some(std::time::Duration::from_secs(1));
                    Err(r)
                }
            },
        }
    }

    /// The metric labels of `caller` calling `tool`: names the policy lists, or words.
    #[cfg(feature = "metrics")]
    fn labels(&self, policy: &Policy, caller: &Caller, tool: &str) -> telemetry::Labels {
        use telemetry::busiest::Kind;
        use telemetry::LabelValue;
        let cap = self.inner.tenant_labels;
        // Listed callers by name (the first `cap`), unlisted ones while they are among the
        // busiest (their own name: what the caller claimed, bounded by the top-K).
        let named = |p: &crate::policy::LevelPolicy, busy: bool, claimed: Option<&Arc<str>>| match (
            p.template, claimed,
        ) {
            (false, _) if p.position < cap => LabelValue::Name(p.name.clone()),
            (true, Some(name)) if busy => LabelValue::Name(name.clone()),
            _ => LabelValue::OTHER,
        };
        let Some(tp) = policy.tool(tool) else {
            return telemetry::Labels {
                tool: LabelValue::UNKNOWN,
                tenant: LabelValue::UNKNOWN,
                instance: self.inner.instance_labels.then_some(LabelValue::UNKNOWN),
            };
        };
        let tenant_policy = match caller.tenant() {
            Some(t) => tp.tenant_on(t, caller.plan()).ok(),
            None if !tp.require_tenant() => tp.default_tenant(),
            None => None,
        };
        let busiest = &self.inner.busiest;
        let tenant = tenant_policy.map_or(LabelValue::UNKNOWN, |p| {
            let busy = p.template
                && busiest.is_named(tool, Kind::Tenant, (caller.tenant().unwrap_or(""), None));
            named(p, busy, caller.tenant_arc())
        });
        let instance = self.inner.instance_labels.then(|| {
            match (tenant_policy, caller.instance()) {
                (_, None) => LabelValue::Word("none"),
                (Some(p), Some(i)) if p.has_instances() => {
                    p.instance(i).map_or(LabelValue::UNKNOWN, |ip| {
                        let key = (caller.tenant().unwrap_or(""), Some(i));
                        let busy = ip.template && busiest.is_named(tool, Kind::Instance, key);
                        named(ip, busy, caller.instance_arc())
                    })
                }
                // Instances the policy does not limit separately have no names of their own.
                (Some(_), Some(_)) => LabelValue::OTHER,
                (None, Some(_)) => LabelValue::UNKNOWN,
            }
        });
        telemetry::Labels {
            tool: LabelValue::Name(tp.name_arc().clone()),
            tenant,
            instance,
        }
    }

    /// Metrics, the decision event, and the tool's busiest unlisted callers.
    fn record(&self, policy: &Policy, caller: &Caller, tool: &str, cost: Cost, outcome: &Outcome) {
        let tenant = caller.tenant().unwrap_or("");
        let instance = caller.instance().unwrap_or("");
        let mut refusals_in_window = 0;
        match outcome {
            Ok(t) => match (t.admission(), &t.shadow_refusal) {
                (Some(_), _) => trace_admitted(caller, tool, cost, t),
                (None, Some(r)) => {
                    self.event(policy, r, [tool, tenant, instance], cost, "shadow");
                }
                (None, None) => {}
            },
            Err(r) => {
                refusals_in_window =
                    self.event(policy, r, [tool, tenant, instance], cost, "refused");
                self.inner
                    .recorder
                    .refused(policy, caller, tool, r, || self.inner.clock.now());
            }
        }
        self.report_busy(policy, caller, tool, cost, outcome, refusals_in_window);
        #[cfg(feature = "metrics")]
        self.count(policy, caller, tool, outcome);
    }

    /// Reports a decision of a caller a template governs to the tool's busiest when it
    /// crosses a step: its use in the window a multiple of `STEP` units, or its
    /// `refusals_in_window` (this one included) a multiple of `STEP`. Only while someone
    /// reads them: the metrics are compiled in or a console was made.
    fn report_busy(
        &self,
        policy: &Policy,
        caller: &Caller,
        tool: &str,
        cost: Cost,
        outcome: &Outcome,
        refusals_in_window: u64,
    ) {
        use telemetry::busiest::{Kind, STEP};
        if !self.counts_busiest() {
            return;
        }
        let weight = match outcome {
            Err(_) if refusals_in_window > 0 && refusals_in_window.is_multiple_of(STEP as u64) => {
                [STEP, STEP]
            }
            Ok(t) => {
                let (Some(quota), Some(left)) = (t.quota(), t.remaining()) else {
                    return;
                };
                let used = (quota - left).max(0.0);
                if (used / STEP).floor() <= ((used - cost.0) / STEP).floor() {
                    return;
                }
                [STEP, 0.0]
            }
            Err(_) => return,
        };
        let (Some(tp), Some(tenant)) = (policy.tool(tool), caller.tenant_arc()) else {
            return;
        };
        let Ok(tenant_policy) = tp.tenant_on(tenant, caller.plan()) else {
            return;
        };
        let secs = self.inner.clock.now().as_micros() / 1_000_000;
        let board = &self.inner.busiest;
        if tenant_policy.template {
            board.report(tp.name_arc(), Kind::Tenant, (tenant, None), weight, secs);
        }
        if let Some(i) = caller.instance_arc() {
            if tenant_policy.instance(i).is_some_and(|ip| ip.template) {
                board.report(
                    tp.name_arc(),
                    Kind::Instance,
                    (tenant, Some(i)),
                    weight,
                    secs,
                );
            }
        }
    }

    /// Whether anyone reads the busiest callers: metrics compiled in, or a console made.
    fn counts_busiest(&self) -> bool {
        cfg!(feature = "metrics") || self.inner.recorder.is_on()
    }

    /// The busiest unlisted callers of `tool` now: template tenants, then template instances.
    pub(crate) fn busiest(&self, tool: &str) -> [Vec<telemetry::busiest::BusyCaller>; 2] {
        use telemetry::busiest::Kind;
        let secs = self.inner.clock.now().as_micros() / 1_000_000;
        let board = &self.inner.busiest;
        [
            board.named(tool, Kind::Tenant, secs),
            board.named(tool, Kind::Instance, secs),
        ]
    }

    /// The decision event of a refusal (or a shadow refusal); the caller's refusals in the
    /// window so far.
    fn event(
        &self,
        policy: &Policy,
        r: &Refusal,
        [tool, tenant, instance]: [&str; 3],
        cost: Cost,
        outcome: &'static str,
    ) -> u64 {
        // Nothing to keep when nobody reads the lines nor the busiest callers.
        let logged = tracing::enabled!(target: "tower_fairshare::decision", tracing::Level::INFO);
        if !logged && !self.counts_busiest() {
            return 0;
        }
        let now = self.inner.clock.now().as_micros();
        let period = policy
            .tool(tool)
            .map_or(1, |tp| tp.period().as_micros().max(1));
        self.inner.refusal_lines.event(
            r,
            [tool, tenant, instance],
            cost.0,
            outcome,
            [now / period, now / 1_000_000],
        )
    }

    /// The decision's metrics.
    #[cfg(feature = "metrics")]
    fn count(&self, policy: &Policy, caller: &Caller, tool: &str, outcome: &Outcome) {
        let labels = self.labels(policy, caller, tool);
        let scope = |r: &Refusal| r.scope.map_or("none", |s| s.as_str());
        match outcome {
            Ok(t) => match (t.admission(), &t.shadow_refusal) {
                (Some(a), _) => {
                    telemetry::decision(&labels, "admitted", "none", "none");
                    telemetry::headroom(&labels, a.slack, t.remaining().unwrap_or(a.remaining));
                }
                (None, Some(r)) => {
                    telemetry::decision(&labels, "shadow", r.reason.as_str(), scope(r))
                }
                (None, None) => {
                    telemetry::decision(&labels, "unmetered", "store_unavailable", "none")
                }
            },
            Err(r) => telemetry::decision(&labels, "refused", r.reason.as_str(), scope(r)),
        }
    }

    /// The store keys `caller`'s calls of `tool` are charged to, or the refusal its identity
    /// alone earns (unknown tool, tier, missing tenant).
    pub fn call_keys(&self, caller: &Caller, tool: &str) -> Result<CallKeys, Refusal> {
        let policy = self.policy();
        resolve(&policy, caller, tool).map(|(tp, tenant, instance, untenanted)| {
            CallKeys::of(tp, &tenant, instance.as_ref(), untenanted)
        })
    }

    /// Corrects an admitted call's charge to its actual cost.
    pub async fn settle(&self, ticket: &Ticket, actual: Cost) {
        let (Some(a), Some(cost)) = (ticket.admission(), ticket.cost()) else {
            return;
        };
        let part = ticket.part();
        if cost <= 0.0 || !actual.0.is_finite() || actual.0 < 0.0 {
            return;
        }
        // The call's charge is `part` of the admission's, so `factor` of the call's is
        // `factor × part` of the admission's.
        let factor = actual.0 / cost - 1.0;
        if factor != 0.0 {
            if let Err(e) = self
                .inner
                .store
                .adjust(a, factor * part, self.inner.clock.now())
                .await
            {
                if let Some(held_back) = telemetry::let_through("correct", &a.keys.tool) {
                    tracing::warn!(tool = %a.keys.tool, error = %e, held_back, "could not correct a charge");
                }
            }
        }
    }

    /// Gives back an admitted call's whole charge. Only for calls the inner service provably
    /// did not run.
    pub async fn refund(&self, ticket: &Ticket) {
        if let Some(a) = ticket.admission() {
            if let Err(e) = self
                .inner
                .store
                .adjust(a, -ticket.part(), self.inner.clock.now())
                .await
            {
                if let Some(held_back) = telemetry::let_through("refund", &a.keys.tool) {
                    tracing::warn!(tool = %a.keys.tool, error = %e, held_back, "could not refund a charge");
                }
            }
        }
    }

    /// Returns the concurrency permits an admitted call holds.
    pub async fn release(&self, ticket: &Ticket) {
        if let (true, Some(a)) = (ticket.holds_permits(), ticket.admission()) {
            if let Err(e) = self.inner.store.release(a).await {
                if let Some(held_back) = telemetry::let_through("release", &a.keys.tool) {
                    tracing::warn!(tool = %a.keys.tool, error = %e, held_back, "could not release a permit");
                }
            }
        }
    }
}

/// The decision event of an admitted call (the check that anyone listens, inline; the event,
/// not).
#[inline(always)]
fn trace_admitted(caller: &Caller, tool: &str, cost: Cost, t: &Ticket) {
    if tracing::enabled!(target: "tower_fairshare::decision", tracing::Level::DEBUG) {
        trace_admitted_event(caller, tool, cost, t);
    }
}

#[cold]
#[inline(never)]
fn trace_admitted_event(caller: &Caller, tool: &str, cost: Cost, t: &Ticket) {
    let Some(a) = t.admission() else {
        return;
    };
    let v = if a.keys.instance.is_some() {
        a.views[1]
    } else {
        a.views[0]
    };
    tracing::debug!(
        target: "tower_fairshare::decision",
        tool,
        tenant = caller.tenant().unwrap_or(""),
        instance = caller.instance().unwrap_or(""),
        cost = cost.0, outcome = "admitted",
        weight = v.weight, floor = v.floor, share = v.share, ceiling = v.ceiling,
        remaining = t.remaining().unwrap_or(a.remaining), slack = a.slack,
        at_us = a.at.as_micros(), leased = t.leased_part().is_some(),
    );
}

fn fill_caller(r: &mut Refusal, caller: &Caller) {
    r.set_caller(caller.tenant_arc().cloned(), caller.instance_arc().cloned());
}

fn denial(reason: Reason, tool: &str, caller: &Caller, what: &'static str) -> Refusal {
    let mut r = Refusal::new(reason, tool);
    fill_caller(&mut r, caller);
    r.scope = Some(Scope::Tool);
    r.detail = Some(what);
    r
}

/// A decision as it travels inside the limiter (a `Refusal` is one pointer: nothing to box).
type Outcome = Result<Ticket, Refusal>;

/// What a call was decided with.
enum Decided {
    /// The store's answer: a call decided on its own (or the first call of a grant no lease
    /// keeps).
    Store(Result<Decision, StoreError>),
    /// Spent from a lease: its grant, and the call's part of it.
    Lease(Arc<Admission>, Part),
}

impl Decided {
    fn admitted(&self) -> bool {
        matches!(
            self,
            Decided::Lease(..) | Decided::Store(Ok(Decision::Admitted(_)))
        )
    }
}

/// Returns a leasing call has still to apply: parked for a later call if its future is
/// dropped first, so none is lost.
struct Parked<'a> {
    leases: &'a Leases,
    returns: Vec<lease::Return>,
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        for r in self.returns.drain(..) {
            self.leases.park(r);
        }
    }
}

/// What [`Limiter::decide_at_once`] got to.
enum AtOnce {
    /// Decided.
    Done(Decided),
    /// The store needs I/O.
    Wait(Waiting),
}

/// The future of [`Limiter::admit`]: decides when first polled; waits only for a store's
/// I/O (boxed) or, on a leasing path, for a unit of tokio's cooperative budget.
struct Admit<'a, S, C> {
    limiter: &'a Limiter<S, C>,
    caller: &'a Caller,
    tool: &'a str,
    cost: Cost,
    step: Step<'a>,
}

/// Where an [`Admit`] is.
enum Step<'a> {
    /// Not polled yet: nothing decided.
    Start,
    /// Decided: the answer, once a unit of the runtime's cooperative budget is spent when the
    /// flag says so.
    Answer(Result<Ticket, Refusal>, bool),
    /// The part that waits for the store.
    Waiting(Pin<Box<dyn Future<Output = Result<Ticket, Refusal>> + Send + 'a>>),
    /// Answered.
    Done,
}

impl<S: Store, C: Clock> Future for Admit<'_, S, C> {
    type Output = Result<Ticket, Refusal>;

    /// Every way out writes the one `answer` it returns: a leased call's ticket is written
    /// where the caller receives it, not moved there through the steps between.
    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let mut answer = Poll::Pending;
        self.get_mut().poll_into(cx, &mut answer);
        answer
    }
}

/// What [`Admit`] answers when polled.
pub(crate) type Answer = Poll<Result<Ticket, Refusal>>;

impl<S: Store, C: Clock> Admit<'_, S, C> {
    #[inline(always)]
    fn poll_into(&mut self, cx: &mut std::task::Context<'_>, answer: &mut Answer) {
        if let Step::Start = self.step {
            let l = self.limiter;
            // Most calls on a leasing path: spent from the caller's lease, answered from here
            // (not moved through `step`) once a unit of the cooperative budget is spent.
            if !l.inner.leases.has_pending()
                && l.spend_leased(self.caller, self.tool, self.cost, answer)
            {
                #[cfg(feature = "tokio")]
                match tokio::task::coop::poll_proceed(cx) {
                    Poll::Ready(unit) => unit.made_progress(),
                    Poll::Pending => {
                        if let Poll::Ready(a) = std::mem::replace(answer, Poll::Pending) {
                            self.step = Step::Answer(a, true);
                        }
                    }
                }
                return;
            }
            match l.admit_first(self.caller, self.tool, self.cost) {
                // Most calls: answered at once.
                Step::Answer(a, false) => {
                    self.step = Step::Done;
                    *answer = Poll::Ready(a);
                    return;
                }
                step => self.step = step,
            }
        }
        #[cfg(feature = "tokio")]
        if let Step::Answer(_, true) = self.step {
            // Answered just below once the unit is spent.
            match tokio::task::coop::poll_proceed(cx) {
                Poll::Ready(unit) => unit.made_progress(),
                Poll::Pending => return,
            }
        }
        match std::mem::replace(&mut self.step, Step::Done) {
            Step::Answer(a, _) => *answer = Poll::Ready(a),
            Step::Waiting(mut f) => match f.as_mut().poll(cx) {
                Poll::Ready(a) => *answer = Poll::Ready(a),
                Poll::Pending => self.step = Step::Waiting(f),
            },
            Step::Start | Step::Done => panic!("`Limiter::admit` polled after it answered"),
        }
    }
}

/// A call [`Limiter::admit_at_once`] left for the part that waits: the policy and the time it
/// was first seen under, and where it stopped.
struct Deferred {
    policy: arc_swap::Guard<Arc<Policy>>,
    now: crate::clock::Timestamp,
    waiting: Waiting,
}

/// Where a decision that waits for the store starts.
#[derive(Default)]
struct Waiting {
    /// The units to ask the store for (a grant, or the call's cost); `None`: nothing was
    /// done, the call is decided from the start.
    ask: Option<f64>,
    /// What leases gave back on the way, to apply.
    returns: Vec<lease::Return>,
}

/// What a leasing call does after the store answered.
enum Next {
    /// The answer.
    Done(Decided),
    /// Decide the call alone, after giving back this grant (it borrowed), if any.
    Alone(Option<Arc<Admission>>),
}

/// A call resolved and timed, ready for the store.
pub(crate) struct Prepared<'p> {
    pub(crate) plan: Plan<'p>,
    caller: &'p Caller,
    /// The version of the policy it was resolved under.
    version: u64,
    /// The store keys, made (sharing the caller's names) when a store is asked: a call spent
    /// from a lease needs none.
    keys: std::sync::OnceLock<CallKeys>,
}

impl Prepared<'_> {
    /// The call's path, borrowed: what its lease is found by.
    pub(crate) fn path(&self) -> lease::Path<'_> {
        lease::Path {
            tool: self.plan.tool.name(),
            tenant: self.plan.tenant.name,
            instance: self.plan.instance.map(|i| &**i.name),
            untenanted: self.plan.untenanted,
        }
    }

    /// What a lease granted to this call knows of the policy.
    fn known(&self) -> lease::Known {
        lease::Known::new(self.version, self.caller, &self.plan)
    }

    /// The store keys of the call.
    pub(crate) fn keys(&self) -> &CallKeys {
        self.keys.get_or_init(|| self.plan.keys())
    }
}

/// The name of an untenanted caller that gave no client id.
static NO_NAME: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(""));

type Resolved<'p> = (
    &'p Arc<ToolPolicy>,
    LevelRef<'p>,
    Option<LevelRef<'p>>,
    bool,
);

/// Who is charged for `caller` calling `tool`: the identity and tool checks of the order of
/// operations, before any counter is touched.
fn resolve<'p>(
    policy: &'p Policy,
    caller: &'p Caller,
    tool: &str,
) -> Result<Resolved<'p>, Refusal> {
    let Some(tp) = policy.tool(tool) else {
        // The name comes from the caller (a URL path, a tool call): it is echoed cut short.
        let mut r = Refusal::new(Reason::PermissionDenied, crate::admission::echoed(tool));
        r.detail = Some("unknown_tool");
        fill_caller(&mut r, caller);
        return Err(r);
    };
    // Identity before permission: a caller without one is 401 whatever the tool's tier.
    if caller.tenant().is_none() && tp.require_tenant() {
        return Err(denial(
            Reason::UnidentifiedCaller,
            tool,
            caller,
            "missing_tenant",
        ));
    }
    if !tp.allows_tier(caller.tier()) {
        return Err(denial(Reason::PermissionDenied, tool, caller, "tier"));
    }
    let (tenant_name, untenanted, tenant_policy) = match caller.tenant_arc() {
        Some(t) => match tp.tenant_on(t, caller.plan()) {
            Ok(p) => (t, false, p),
            Err(why) => return Err(denial(Reason::PermissionDenied, tool, caller, why)),
        },
        None if tp.require_tenant() => {
            return Err(denial(
                Reason::UnidentifiedCaller,
                tool,
                caller,
                "missing_tenant",
            ))
        }
        None => match tp.default_tenant() {
            Some(p) => (caller.instance_arc().unwrap_or(&NO_NAME), true, p),
            None => {
                return Err(denial(
                    Reason::UnidentifiedCaller,
                    tool,
                    caller,
                    "missing_tenant",
                ))
            }
        },
    };
    let instance = match (untenanted, caller.instance_arc()) {
        (false, Some(i)) if tenant_policy.has_instances() => match tenant_policy.instance(i) {
            Some(p) => Some(LevelRef { name: i, policy: p }),
            None => {
                return Err(denial(
                    Reason::PermissionDenied,
                    tool,
                    caller,
                    "unlisted_instance",
                ))
            }
        },
        _ => None,
    };
    Ok((
        tp,
        LevelRef {
            name: tenant_name,
            policy: tenant_policy,
        },
        instance,
        untenanted,
    ))
}
