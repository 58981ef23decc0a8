//! The limiter: policy + store + clock. Resolves who is calling what, asks the store (or the
//! caller's lease), and turns the answer into a ticket or a typed refusal. The layer is a thin
//! shell over it.
//!
//! A call goes one way: [`Limiter::begin`] does every step that needs no waiting and answers,
//! or hands back the rest — the store's I/O and what follows it — as a future that owns what
//! it needs. [`Limiter::admit`]'s future ([`Admit`]) begins the call at its first poll and
//! awaits the rest; [`Limiter::try_admit`] answers only what needs no waiting.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;

use arc_swap::ArcSwap;

mod admit;
mod together;
pub use admit::Admit;
pub use together::MAX_TOOLS_PER_CALL;

use crate::admission::engine::{OwnedPlan, Plan};
use crate::admission::Refusal;
use crate::clock::{Clock, SystemClock, Timestamp};
use crate::identity::{Caller, Cost};
use crate::lease::{self, FromLease, Leases};
use crate::policy::{OnStoreError, Policy};
use crate::store::{Admission, Answer, CallKeys, Decision, MemoryStore, Store, StoreError};
use crate::telemetry::decisions::{Decisions, Outcome};
use crate::telemetry::{self, busiest::BusyCaller, recorder::Recorder};
use crate::ticket::Charged;
pub use crate::ticket::Ticket;

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
    /// Read on every decision, written on reload: readers never contend on a lock.
    policy: ArcSwap<Policy>,
    /// The version of the policy in force, written after the policy: a call that reads its
    /// lease's version here is spent without reading the policy.
    version: AtomicU64,
    /// Held while a policy is put in force, so that versions follow the order of the stores.
    reloading: std::sync::Mutex<()>,
    store: S,
    clock: C,
    /// What is recorded of each decision: events, metrics, the console's tallies.
    decisions: Decisions,
    /// Units of callers' own allocations this process holds, charged in advance.
    leases: Leases,
    on_drop: fn(&mut Inner<S, C>),
}

impl<S, C> Drop for Inner<S, C> {
    fn drop(&mut self) {
        (self.on_drop)(self)
    }
}

/// Gives every lease back when the limiter goes: at once to a store that can take it so, on
/// the runtime to one that needs I/O (call [`Limiter::return_leases`] before dropping to wait
/// for it). A function pointer in `Inner`, made where the bounds hold.
fn give_back_on_drop<S: Store, C: Clock>(inner: &mut Inner<S, C>) {
    give_back_to(&inner.store, inner.leases.drain(), inner.clock.now());
}

/// Gives `returns` back to `store` (counted), without waiting: at once to a store that can
/// take them so, on the runtime to one that needs I/O.
fn give_back_to<S: Store>(store: &S, returns: Vec<lease::Return>, now: Timestamp) {
    for r in returns {
        telemetry::lease_returned(&r.grant.keys.tool, r.units);
        if let Answer::Later(f) = store.adjust(&r.grant, r.factor, now) {
            spawn_or_drop(f);
        }
    }
}

/// How a call goes once it is begun: answered, or the rest of it to wait for.
pub(crate) enum Begun {
    /// Answered.
    Done(Outcome),
    /// The store's I/O, and what follows it.
    Waiting(Waiting),
}

/// The rest of a call that waits for the store: its I/O and what follows it.
pub(crate) type Waiting = Pin<Box<dyn Future<Output = Outcome> + Send>>;

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
                decisions: Decisions::default(),
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
            Some(inner) => inner.decisions.instance_labels = yes,
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
    /// tools the policy does not know are `unknown`. Call before cloning the limiter.
    pub fn tenant_labels(mut self, max: usize) -> Self {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.decisions.tenant_labels = max,
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
    /// carry over; the new limits apply from the next decision. Leases end with the policy
    /// they were granted under: what they hold goes back to the store now.
    pub fn set_policy(&self, mut policy: Policy) {
        {
            let _one_at_a_time = lock(&self.inner.reloading);
            let version = self.inner.version.load(Relaxed) + 1;
            policy.version = version;
            let policy = Arc::new(policy);
            self.inner.decisions.retain(&policy);
            self.inner.store.policy_in_force(&policy);
            self.inner.policy.store(policy);
            self.inner.version.store(version, Release);
        }
        self.give_back(self.inner.leases.drain(), self.inner.clock.now());
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

    /// The store.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// The clock.
    pub fn clock(&self) -> &C {
        &self.inner.clock
    }

    /// What the console counts and keeps.
    pub(crate) fn recorder(&self) -> &Recorder {
        &self.inner.decisions.recorder
    }

    /// The busiest unlisted callers of `tool` now: template tenants, then template instances.
    pub(crate) fn busiest(&self, tool: &str) -> [Vec<BusyCaller>; 2] {
        self.inner.decisions.busiest(tool, self.inner.clock.now())
    }

    /// Decides one call of `tool` by `caller`, costing `cost`, and commits it if admitted:
    /// await the [`Admit`] future it returns (nothing is decided until it is polled).
    ///
    /// Order: identity → tool and tier (no counter touched on denial) → concurrency → every
    /// rate and budget, checked and committed atomically.
    ///
    /// With the `tokio` feature each call spends a unit of the task's cooperative budget
    /// before it is decided, like any awaited operation: a task that loops on calls answered
    /// at once (spent from a lease, or decided in memory) still lets the runtime run its
    /// other tasks.
    pub fn admit<'a>(&'a self, caller: &'a Caller, tool: &'a str, cost: Cost) -> Admit<'a, S, C> {
        Admit::new(self, caller, tool, cost)
    }

    /// Decides one call like [`admit`](Self::admit), when that needs no waiting: `Some` when
    /// the store answers at once (the in-process store always does) or the call is spent
    /// from its lease; `None` when the store would have to be waited for — then nothing has
    /// been decided or recorded, and [`admit`](Self::admit) is the way.
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
    pub fn try_admit(&self, caller: &Caller, tool: &str, cost: Cost) -> Option<Outcome> {
        match self.begin(caller, tool, cost) {
            Begun::Done(outcome) => Some(outcome),
            // Not started: the store's work runs only when awaited.
            Begun::Waiting(_) => None,
        }
    }

    /// Every step of a call that needs no waiting: spent from the caller's lease, refused by
    /// who it is, or decided by a store that answers at once; otherwise the rest of it.
    pub(crate) fn begin(&self, caller: &Caller, tool: &str, cost: Cost) -> Begun {
        let inner = &*self.inner;
        // Most calls of a busy caller: spent from its lease before the policy is read.
        let version = inner.version.load(Acquire);
        let now = || inner.clock.now();
        if let Some(spent) = inner
            .leases
            .spend(version, tool, caller, cost.0, now, can_fetch)
        {
            return Begun::Done(self.spent(caller, tool, cost, spent, None));
        }
        let policy = inner.policy.load();
        let now = inner.clock.now();
        let plan = match caller.charged_as(&policy, tool, cost, now) {
            Ok(plan) => plan,
            Err(r) => {
                let outcome = self.finish(&policy, caller, tool, cost, Err(r), now);
                return Begun::Done(outcome);
            }
        };
        let mut ask = plan.cost;
        if lease::eligible(&plan) {
            let mut returns = Vec::new();
            let taken = inner.leases.take(&plan, can_fetch, &mut returns);
            self.give_back(returns, plan.now);
            match taken {
                FromLease::Hit(spent) => {
                    let ticket = self.spent(caller, tool, cost, spent, Some(&policy));
                    return Begun::Done(ticket);
                }
                FromLease::Miss { grant } => ask = grant,
            }
        }
        self.ask(&policy, caller, &plan, ask)
    }

    /// Asks the store to decide `plan` for `ask` units (a grant for the caller's lease when
    /// more than its cost): its answer, or the rest of the call to wait for.
    fn ask(&self, policy: &Arc<Policy>, caller: &Caller, plan: &Plan<'_>, ask: f64) -> Begun {
        let started = telemetry::Started::now();
        let asked = Plan { cost: ask, ..*plan };
        match self.inner.store.decide(std::slice::from_ref(&asked)) {
            Answer::Now(d) => {
                started.record(self.inner.store.kind());
                self.answered(policy, caller, plan, ask, d)
            }
            Answer::Later(answer) => {
                let rest = Rest {
                    limiter: self.clone(),
                    policy: policy.clone(),
                    caller: caller.clone(),
                    plan: OwnedPlan::of(plan),
                    ask,
                    started,
                };
                Begun::Waiting(Box::pin(rest.finish(answer)))
            }
        }
    }

    /// What follows the store's answer `d` to a call of `plan` asking for `ask` units: the
    /// call's outcome, or (a grant that was refused or borrowed: given back) the call asked
    /// again alone.
    fn answered(
        &self,
        policy: &Arc<Policy>,
        caller: &Caller,
        plan: &Plan<'_>,
        ask: f64,
        d: Result<Decision, StoreError>,
    ) -> Begun {
        match self.decided(caller, plan, ask, d) {
            Ok(decided) => Begun::Done(self.conclude(policy, caller, plan, decided)),
            Err(back) => {
                self.give_back_grant(back, plan.now);
                self.ask(policy, caller, plan, plan.cost)
            }
        }
    }

    /// What the store's answer `d` decided: the call's charge, refusal or failure, or (a
    /// grant that was refused or borrowed) the grant to give back before the call is decided
    /// alone.
    fn decided(
        &self,
        caller: &Caller,
        plan: &Plan<'_>,
        ask: f64,
        d: Result<Decision, StoreError>,
    ) -> Result<Decided, Option<Arc<Admission>>> {
        let alone = ask <= plan.cost;
        let leases = &self.inner.leases;
        match d.map(Decision::into_first) {
            Ok(Ok(a)) if lease::eligible(plan) && (alone || !lease::borrowed(&a)) => {
                let mut returns = Vec::new();
                let charged = self.keep(caller, plan, a, ask, &mut returns);
                self.give_back(returns, plan.now);
                Ok(Decided::Own(charged))
            }
            // Units lent by others are never leased: all back, and the call decided alone.
            Ok(Ok(a)) if !alone => {
                leases.cool(plan);
                Err(Some(a))
            }
            Ok(Err(_)) if !alone => {
                leases.cool(plan);
                Err(None)
            }
            Ok(Ok(a)) => Ok(Decided::Own(Charged::Own(a))),
            Ok(Err(r)) => Ok(Decided::Refused(r)),
            Err(e) => Ok(Decided::Failed(e)),
        }
    }

    /// What the store admitted (`a`, for `ask` units) charged the call of `plan`: on a leasing
    /// tool what the grant holds beyond the call is kept as the caller's lease, and the call
    /// is spent from it. Leases this one replaces are pushed to `returns`.
    fn keep(
        &self,
        caller: &Caller,
        plan: &Plan<'_>,
        a: Arc<Admission>,
        ask: f64,
        returns: &mut Vec<lease::Return>,
    ) -> Charged {
        if !lease::eligible(plan) {
            return Charged::Own(a);
        }
        if ask > plan.cost {
            telemetry::lease_granted(plan.tool.name_arc(), ask, ask - plan.cost);
        }
        let terms = lease::GrantTerms::new(self.inner.version.load(Acquire), caller, plan);
        match self.inner.leases.granted(plan, terms, a, ask, returns) {
            Ok((grant, part)) => Charged::Leased(grant, part),
            Err(own) => Charged::Own(own),
        }
    }

    /// A call spent from its lease's grant: its ticket, recorded, and the next grant fetched
    /// ahead when the lease asks for it. (`policy`: the policy in force, when it was read.)
    fn spent(
        &self,
        caller: &Caller,
        tool: &str,
        cost: Cost,
        spent: lease::Spent,
        policy: Option<&Arc<Policy>>,
    ) -> Outcome {
        let inner = &*self.inner;
        if let Some(f) = spent.fetch {
            self.fetch_ahead(caller, tool, f.keys, f.size);
        }
        let ticket = Ticket::of(
            Charged::Leased(spent.grant, spent.part),
            spent.window_secs,
            spent.unit,
        );
        let load = || match policy {
            Some(p) => arc_swap::Guard::from_inner(p.clone()),
            None => inner.policy.load(),
        };
        inner
            .decisions
            .record_leased(load, caller, tool, cost, &ticket, spent.at);
        Ok(ticket)
    }

    /// The store's answer as a ticket or a refusal, with shadow mode and the store-error
    /// policy applied, recorded.
    fn conclude(
        &self,
        policy: &Policy,
        caller: &Caller,
        plan: &Plan<'_>,
        decided: Decided,
    ) -> Outcome {
        let tp = plan.tool;
        let window_secs = tp.period().as_secs_ceil();
        let tool = tp.name();
        let outcome = match decided {
            Decided::Own(charged) => Ok(Ticket::of(charged, window_secs, tp.unit())),
            Decided::Refused(mut r) => {
                // Name the caller's instance even when instances are not limited separately.
                if let (None, false, Some(i)) =
                    (r.instance(), plan.untenanted, caller.instance_arc())
                {
                    r.set_instance(Some(i.clone()));
                }
                match tp.enforce() {
                    true => Err(r),
                    false => Ok(Ticket::uncharged(Some(r), window_secs, tp.unit())),
                }
            }
            Decided::Failed(e) => self.store_failed(caller, tp, e),
        };
        self.finish(policy, caller, tool, Cost(plan.cost), outcome, plan.now)
    }

    /// A call the store could not decide: let through unmetered, or refused, as the tool's
    /// `on_store_error` says; logged (a few lines a second) and counted.
    fn store_failed(
        &self,
        caller: &Caller,
        tp: &crate::policy::ToolPolicy,
        e: StoreError,
    ) -> Outcome {
        let (tool, kind) = (tp.name(), self.inner.store.kind());
        let allow = tp.on_store_error() == OnStoreError::Allow;
        if let Some(held_back) = telemetry::let_through("store_fallback", tool) {
            if allow {
                tracing::warn!(tool, store = kind, error = %e, held_back, "rate-limit store failed; letting the call through unmetered (on_store_error = allow)");
            } else {
                tracing::error!(tool, store = kind, error = %e, held_back, "rate-limit store failed; refusing the call (on_store_error = deny)");
            }
        }
        telemetry::store_error(tp.name_arc(), kind, if allow { "allow" } else { "deny" });
        if allow {
            return Ok(Ticket::uncharged(
                None,
                tp.period().as_secs_ceil(),
                tp.unit(),
            ));
        }
        let mut r = caller.denial(crate::Reason::StoreUnavailable, tool, "store");
        r.retryable = true;
        r.retry_after = Some(std::time::Duration::from_secs(1));
        Err(r)
    }

    /// Records the outcome of a call decided at `now`; the outcome.
    fn finish(
        &self,
        policy: &Policy,
        caller: &Caller,
        tool: &str,
        cost: Cost,
        outcome: Outcome,
        now: Timestamp,
    ) -> Outcome {
        self.inner
            .decisions
            .record(policy, caller, tool, cost, &outcome, now);
        outcome
    }

    /// Fetches the next grant of `caller`'s lease on `tool` (`size` units) in a task of its
    /// own: kept as the lease's next grant if it is admitted within the caller's own share,
    /// given back otherwise.
    fn fetch_ahead(&self, caller: &Caller, tool: &str, keys: CallKeys, size: f64) {
        #[cfg(feature = "tokio")]
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (this, caller, tool) = (self.clone(), caller.clone(), tool.to_owned());
            rt.spawn(async move { this.fetch(&caller, &tool, &keys, size).await });
            return;
        }
        let _ = (caller, tool, size);
        self.inner.leases.fetch_failed(&keys, false);
    }

    /// A grant of `size` units fetched ahead for the lease of `keys`.
    #[cfg(feature = "tokio")]
    async fn fetch(&self, caller: &Caller, tool: &str, keys: &CallKeys, size: f64) {
        let leases = &self.inner.leases;
        let policy = self.inner.policy.load_full();
        let plan = match caller.charged_as(&policy, tool, Cost(size), self.inner.clock.now()) {
            Ok(plan) if plan.keys() == *keys => plan,
            _ => return leases.fetch_failed(keys, false),
        };
        let decided = self.inner.store.decide(std::slice::from_ref(&plan)).await;
        let back = match decided.map(Decision::into_first) {
            Ok(Ok(a)) if !lease::borrowed(&a) => {
                let back = leases.fetched(&plan, a, size);
                if back.is_none() {
                    telemetry::lease_granted(plan.tool.name_arc(), size, size);
                }
                back.map(|r| r.grant)
            }
            Ok(Ok(a)) => {
                leases.fetch_failed(keys, true);
                Some(a)
            }
            Ok(Err(_)) => return leases.fetch_failed(keys, true),
            Err(_) => return leases.fetch_failed(keys, false),
        };
        if let Some(grant) = back {
            let _ = self.inner.store.adjust(&grant, -1.0, plan.now).await;
        }
    }

    /// Gives back what leases returned, without waiting: at once where the store can, by a
    /// task of its own on the tokio runtime otherwise.
    fn give_back(&self, returns: Vec<lease::Return>, now: Timestamp) {
        give_back_to(&self.inner.store, returns, now);
    }

    /// Gives back a grant that borrowed (never kept), without waiting. A correction that
    /// fails leaves its units charged: under-use, never over-admission.
    fn give_back_grant(&self, grant: Option<Arc<Admission>>, now: Timestamp) {
        if let Some(grant) = grant {
            if let Answer::Later(f) = self.inner.store.adjust(&grant, -1.0, now) {
                spawn_or_drop(f);
            }
        }
    }

    /// Units charged at the store and not yet spent, held in this limiter's leases now (what
    /// leasing may leave unused at most; see the crate's notes on leases).
    pub fn leased_units(&self) -> f64 {
        self.inner.leases.held()
    }

    /// Gives back every unit this limiter holds in leases (each refunded through every level
    /// it was charged at), and waits for the store to take them: for a graceful shutdown.
    pub async fn return_leases(&self) {
        let now = self.inner.clock.now();
        for r in self.inner.leases.drain() {
            telemetry::lease_returned(&r.grant.keys.tool, r.units);
            let _ = self.inner.store.adjust(&r.grant, r.factor, now).await;
        }
    }

    /// For a graceful shutdown, once the server takes no more calls and those in flight have
    /// ended: gives back every unit held in leases and waits for the store's background work
    /// (permits of the calls that ended given back, refunds of callers that left), so that a
    /// replica that stops leaves nothing for the permit TTL to clean up.
    pub async fn shutdown(&self) {
        self.return_leases().await;
        let _ = self.inner.store.flush().await;
    }

    /// Who `caller` calling `tool` at now is charged as, costing `cost`, or the refusal its
    /// identity alone earns: for [`explain`](Self::explain).
    pub(crate) fn plan<'p>(
        &self,
        policy: &'p Policy,
        caller: &'p Caller,
        tool: &str,
        cost: Cost,
    ) -> Result<Plan<'p>, Refusal> {
        caller.charged_as(policy, tool, cost, self.inner.clock.now())
    }

    /// The store keys `caller`'s calls of `tool` are charged to, or the refusal its identity
    /// alone earns (unknown tool, tier, missing tenant).
    pub fn call_keys(&self, caller: &Caller, tool: &str) -> Result<CallKeys, Refusal> {
        let policy = self.policy();
        self.plan(&policy, caller, tool, Cost(0.0))
            .map(|p| p.keys())
    }

    /// Corrects an admitted call's charge to its actual cost.
    pub async fn settle(&self, ticket: &Ticket, actual: Cost) {
        let (Some(a), Some(cost)) = (ticket.admission_arc(), ticket.cost()) else {
            return;
        };
        if cost <= 0.0 || !actual.0.is_finite() || actual.0 < 0.0 {
            return;
        }
        // The call's charge is `part` of the admission's: `factor` of the call's is
        // `factor × part` of the admission's.
        let factor = (actual.0 / cost - 1.0) * ticket.part();
        if factor != 0.0 {
            let now = self.inner.clock.now();
            warn_failed("correct", a, self.inner.store.adjust(a, factor, now).await);
        }
    }

    /// Gives back an admitted call's whole charge. Only for calls the inner service provably
    /// did not run.
    pub async fn refund(&self, ticket: &Ticket) {
        if let Some(a) = ticket.admission_arc() {
            let now = self.inner.clock.now();
            warn_failed(
                "refund",
                a,
                self.inner.store.adjust(a, -ticket.part(), now).await,
            );
        }
    }

    /// Returns the concurrency permits an admitted call holds.
    pub async fn release(&self, ticket: &Ticket) {
        if let (true, Some(a)) = (ticket.holds_permits(), ticket.admission_arc()) {
            warn_failed("release", a, self.inner.store.release(a).await);
        }
    }
}

/// The rest of a call that waits for the store: it owns what it needs.
struct Rest<S, C> {
    limiter: Limiter<S, C>,
    policy: Arc<Policy>,
    caller: Caller,
    plan: OwnedPlan,
    ask: f64,
    started: telemetry::Started,
}

impl<S: Store, C: Clock> Rest<S, C> {
    async fn finish(self, answer: crate::store::Pending<Decision>) -> Outcome {
        let d = answer.await;
        let l = &self.limiter;
        self.started.record(l.inner.store.kind());
        let plan = self.plan.plan();
        match l.answered(&self.policy, &self.caller, &plan, self.ask, d) {
            Begun::Done(outcome) => outcome,
            Begun::Waiting(rest) => rest.await,
        }
    }
}

/// What a call was decided with.
enum Decided {
    /// Admitted: its own admission, or its part of a lease's grant.
    Own(Charged),
    Refused(Refusal),
    Failed(StoreError),
}

/// Whether grants can be fetched ahead here: on a tokio runtime (they are fetched by a task of
/// their own, so no call waits for one).
fn can_fetch() -> bool {
    #[cfg(feature = "tokio")]
    return tokio::runtime::Handle::try_current().is_ok();
    #[cfg(not(feature = "tokio"))]
    false
}

/// Runs store work nobody waits for on the tokio runtime; without one it is dropped (a lease
/// given back so leaves its units charged: under-use, never over-admission).
fn spawn_or_drop(work: crate::store::Pending<()>) {
    #[cfg(feature = "tokio")]
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(work);
        return;
    }
    drop(work);
    tracing::warn!("store work (a lease given back) could not finish: the store waits for I/O and no tokio runtime is available");
}

/// Logs a failed correction or release (a few lines a second per tool).
fn warn_failed(what: &'static str, a: &Admission, r: Result<(), StoreError>) {
    if let Err(e) = r {
        if let Some(held_back) = telemetry::let_through(what, &a.keys.tool) {
            tracing::warn!(tool = %a.keys.tool, error = %e, held_back, "could not {what} a charge or permit");
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
