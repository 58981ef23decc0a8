//! Leases: a process's local balance of one caller's units, charged at every level in advance.
//!
//! A call on a leasing tool (the default) asks the store for more than it costs — a *grant* —
//! through the same decision as any call: every level (tool, tenant, instance) is charged the
//! whole grant at once, all or nothing. What the call does not use is kept here, in this
//! process, under the caller's path; the caller's next calls are spent from it without
//! touching the store. So nothing is ever admitted that the store did not charge first:
//! capacity, ceilings and budgets stay exact however many processes hold leases.
//!
//! What a lease may cost is only under-use, bounded as `docs/leases.md` states: a grant holds
//! only the caller's own units (one that borrowed goes back at once), at most two grants per
//! caller path and process, each sized by the constants below, and a lease goes back when it
//! ends, idles, or its policy is reloaded.
//!
//! The table answers what it spent; the limiter builds the ticket.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use foldhash::fast::RandomState;
use hashbrown::HashTable;

use crate::admission::engine::Plan;
use crate::clock::Timestamp;
use crate::identity::Caller;
use crate::policy::ToolPolicy;
use crate::store::{Admission, CallKeys};

/// How long a lease's balance should last at the rate its caller spends.
const TARGET_US: f64 = 100_000.0;
/// A lease not drawn on for this long goes back to the store.
const IDLE_US: u64 = 100_000;
/// The longest a lease lives, however busy its caller.
const LIFETIME_US: u64 = 1_000_000;
/// A grant takes at most this part of the room left above it (the caller's quota left in
/// the window, the tool's pool) and of the smallest burst on its path.
const ROOM_PART: f64 = 0.25;
/// A grant is fetched ahead once less than this part of the current one is left.
const FETCH_AHEAD_AT: f64 = 0.5;
/// The shards are swept for idle leases at most this often.
const SWEEP_US: u64 = 50_000;
/// The most lease shards a limiter makes.
const MAX_SHARDS: usize = 16_384;
/// Tolerance for float comparisons, as in the engine.
const EPS: f64 = 1e-9;

/// A call's part of the admission it was admitted under: what it spent of a lease's grant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GrantShare {
    /// The call's share of the grant's charge at every level (its cost over the grant's).
    pub(crate) of: f64,
    /// The call's own cost, as asked (the grant's cost times `of` may round).
    pub(crate) cost: f64,
    /// The caller's quota left in the window as of the call, the units its lease still holds
    /// counted as its own.
    pub(crate) remaining: f64,
    /// Microseconds until the aligned window resets, as of the call.
    pub(crate) reset_in: f64,
}

/// A call spent from a lease: the grant, the call's part of it, and the next grant to fetch
/// ahead now, when it is time to.
pub(crate) struct Spent {
    pub(crate) grant: Arc<Admission>,
    pub(crate) part: GrantShare,
    /// Out of line: a fetch is due once in a grant, and the record of every call spent is
    /// copied on its way to the ticket.
    pub(crate) fetch: Option<Box<Fetch>>,
    /// The tool's period in whole seconds (a ticket's `RateLimit` window).
    pub(crate) window_secs: u64,
    /// The tool's unit.
    pub(crate) unit: crate::policy::Unit,
    /// When it was spent.
    pub(crate) at: Timestamp,
}

/// The next grant to fetch ahead for a lease: its size, and the lease's keys.
pub(crate) struct Fetch {
    pub(crate) size: f64,
    pub(crate) keys: CallKeys,
}

/// Units a lease gives back to the store: `factor` × the grant's charge (negative: a refund).
pub(crate) struct Return {
    pub(crate) grant: Arc<Admission>,
    pub(crate) factor: f64,
    pub(crate) units: f64,
}

impl Return {
    fn all(grant: Arc<Admission>, units: f64) -> Return {
        Return {
            grant,
            factor: -1.0,
            units,
        }
    }
}

/// What the table answers for a resolved call.
pub(crate) enum FromLease {
    /// Spent from the caller's lease.
    Hit(Spent),
    /// Not covered: ask the store for `grant` units (at least the call's cost; exactly its
    /// cost means an ordinary, unleased decision).
    Miss { grant: f64 },
}

/// What a lease knows of the policy it was granted under, so that a call can be spent from it
/// without resolving the call against the policy (see [`Leases::spend`]).
#[derive(Clone, Debug)]
pub(crate) struct GrantTerms {
    /// The limiter's policy version the lease is valid under.
    version: u64,
    /// The tier and plan of the caller that was granted the lease.
    tier: Option<Arc<str>>,
    plan: Option<Arc<str>>,
    /// Whether the caller's tenant limits its instances: a call of another instance is
    /// charged at its own instance then, not from this lease.
    instances_limited: bool,
    /// The smallest burst on the path (a grant takes a part of it at most).
    burst: f64,
}

impl GrantTerms {
    pub(crate) fn new(version: u64, caller: &Caller, plan: &Plan<'_>) -> Self {
        let mut burst = plan.tool.burst.min(plan.tenant.policy.burst);
        if let Some(i) = plan.instance {
            burst = burst.min(i.policy.burst);
        }
        GrantTerms {
            version,
            tier: caller.tier_arc().cloned(),
            plan: caller.plan_arc().cloned(),
            instances_limited: !plan.untenanted && plan.tenant.policy.has_instances(),
            burst,
        }
    }

    /// Whether a call of `caller` under policy `version` resolves to the path it was granted
    /// to (`tenant_wide`: its tenant's lease, from one of its instances).
    fn covers(&self, version: u64, caller: &Caller, tenant_wide: bool) -> bool {
        self.version == version
            && self.tier.as_deref() == caller.tier()
            && self.plan.as_deref() == caller.plan()
            && !(tenant_wide && self.instances_limited)
    }
}

/// Whether calls of this plan may be leased: the tool allows it and no level on the path caps
/// calls in flight (a permit is per call, and must be counted where every process sees it).
pub(crate) fn eligible(plan: &Plan<'_>) -> bool {
    plan.tool.lease_max > 1.0 && plan.cost <= plan.tool.lease_max && !plan.capped()
}

/// Whether an admitted grant drew, at the tenant or the instance, more than that level's own
/// share and floor (it borrowed idle capacity lent by others): such units are never leased.
pub(crate) fn borrowed(grant: &Admission) -> bool {
    grant.charge.levels[1..]
        .iter()
        .any(|l| l.present && l.ceiling > l.share + EPS)
}

/// Every lease this process holds, sharded by caller path.
pub(crate) struct Leases {
    /// Made at the first grant: a limiter whose tools never lease holds none.
    shards: std::sync::OnceLock<Box<[Padded]>>,
    /// The hash's seed, random per limiter.
    seed: RandomState,
    /// The marks of every tool ever granted a lease ([`tool_marks`]): a call of another tool
    /// looks for no lease before the policy is read.
    tools: AtomicU64,
    /// When the shards were last swept (µs).
    swept_at: AtomicU64,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("held", &self.held())
            .finish_non_exhaustive()
    }
}

#[repr(align(128))]
struct Padded(Mutex<Shard>);

#[derive(Default)]
struct Shard {
    leases: HashTable<Lease>,
}

struct Lease {
    keys: CallKeys,
    /// The tool policy the grant was decided under: a reload ends the lease.
    tool: Arc<ToolPolicy>,
    terms: GrantTerms,
    /// The grant as the store admitted it; `None` once nothing is left to return.
    grant: Option<Arc<Admission>>,
    granted: f64,
    left: f64,
    /// When the lease ends (µs): its aligned window's or a budget window's end, or its life.
    until: u64,
    started: u64,
    last: u64,
    /// The room the last grant left above the caller: the next takes a part of it at most.
    room: f64,
    /// Set after a refused or borrowing grant: the next one is one call's cost.
    cool: bool,
    /// The next grant, fetched ahead while this one is spent.
    next: Option<Spare>,
    /// A grant is being fetched ahead for this lease.
    refreshing: bool,
}

/// A grant fetched ahead of need, whole until its lease runs out.
struct Spare {
    grant: Arc<Admission>,
    granted: f64,
    until: u64,
    room: f64,
    tool: Arc<ToolPolicy>,
}

impl Lease {
    /// Spends `c` from the current grant at `now`, if the grant is current and holds enough;
    /// the size of the next grant to fetch ahead, when it is time to and `can_fetch`.
    fn spend(&mut self, c: f64, now: u64, can_fetch: impl FnOnce() -> bool) -> Option<Spent> {
        if !(now >= self.started && now < self.until && self.left + EPS >= c) {
            return None;
        }
        let grant = self.grant.clone()?;
        self.left = (self.left - c).max(0.0);
        self.last = now;
        let part = part_of(&grant, self.granted, self.left, c, now);
        let due = self.next.is_none()
            && !self.refreshing
            && !self.cool
            && self.left < self.granted * FETCH_AHEAD_AT
            && can_fetch();
        let size = due.then(|| size(c, self, now)).filter(|size| *size > c);
        self.refreshing |= size.is_some();
        let fetch = size.map(|size| {
            let keys = self.keys.clone();
            Box::new(Fetch { size, keys })
        });
        let window_secs = self.tool.period().as_secs_ceil();
        Some(Spent {
            grant,
            part,
            fetch,
            window_secs,
            unit: self.tool.unit(),
            at: Timestamp(now),
        })
    }

    /// Moves on to the grant fetched ahead, if it is current and holds `c`: spent from.
    fn spend_next(&mut self, c: f64, now: u64, returns: &mut Vec<Return>) -> Option<Spent> {
        let n = self.next.take_if(|n| {
            Arc::ptr_eq(&n.tool, &self.tool) && now < n.until && n.granted + EPS >= c
        })?;
        self.give_back_current(returns);
        self.grant = Some(n.grant);
        (self.granted, self.left, self.until, self.room) = (n.granted, n.granted, n.until, n.room);
        (self.started, self.last) = (now, now);
        self.spend(c, now, || false)
    }

    /// Pushes what is left of the current grant, and the whole next one, for a return.
    fn give_back(&mut self, out: &mut Vec<Return>) {
        self.give_back_current(out);
        if let Some(n) = self.next.take() {
            out.push(Return::all(n.grant, n.granted));
        }
    }

    /// Pushes what is left of the current grant for a return.
    fn give_back_current(&mut self, out: &mut Vec<Return>) {
        let Some(grant) = self.grant.take() else {
            return;
        };
        let left = std::mem::take(&mut self.left);
        if left > EPS {
            out.push(Return {
                factor: -left / self.granted,
                units: left,
                grant,
            });
        }
    }
}

/// The next grant for a caller whose lease runs out at `now`: what it spent over the lease's
/// life, stretched to [`TARGET_US`], at most twice the last grant, within the room the last
/// grant left and the path's bursts, and the tool's `max`; in whole calls.
fn size(c: f64, l: &Lease, now: u64) -> f64 {
    let life = now.saturating_sub(l.started).max(1) as f64;
    let spent = (l.granted - l.left).max(c);
    let want = (spent * TARGET_US / life)
        .min(2.0 * l.granted)
        .min(l.terms.burst * ROOM_PART)
        .min(l.room * ROOM_PART)
        .min(l.tool.lease_max);
    // A grant that would leave less than one more call is one call's cost (a fraction left
    // over would only go back).
    let calls = if c > 0.0 { (want / c).floor() } else { 1.0 };
    if calls >= 2.0 {
        calls * c
    } else {
        c
    }
}

impl Leases {
    pub(crate) fn new() -> Self {
        Leases {
            shards: std::sync::OnceLock::new(),
            seed: RandomState::default(),
            tools: AtomicU64::new(0),
            swept_at: AtomicU64::new(0),
        }
    }

    /// The shards, made on first use: enough that threads deciding for distinct callers
    /// seldom share one (each on cache lines of its own): 2,048 a core, at most
    /// [`MAX_SHARDS`].
    fn shards(&self) -> &[Padded] {
        self.shards.get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
            let n = cores.saturating_mul(2048).next_power_of_two();
            (0..n.clamp(512, MAX_SHARDS))
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect()
        })
    }

    fn shard(&self, hash: u64) -> MutexGuard<'_, Shard> {
        let shards = self.shards();
        lock(&shards[(hash >> 48) as usize & (shards.len() - 1)].0)
    }

    /// Spends `cost` from the lease of `caller` calling `tool`, before the call is resolved
    /// against the policy: only while the policy is the version the lease was granted under,
    /// the caller has its tier and plan (so the call would resolve to the lease's path), the
    /// lease is current and holds enough, and no sweep is due. `None`: the call goes the whole
    /// way (where it may still be spent from the lease).
    pub(crate) fn spend(
        &self,
        version: u64,
        tool: &str,
        caller: &Caller,
        cost: f64,
        now: impl FnOnce() -> Timestamp,
        can_fetch: impl Fn() -> bool,
    ) -> Option<Spent> {
        let marks = tool_marks(tool);
        if self.tools.load(Relaxed) & marks != marks || !(cost.is_finite() && cost >= 0.0) {
            return None;
        }
        let mut path = Path::of_caller(tool, caller);
        let now = now().as_micros();
        if now >= self.swept_at.load(Relaxed).saturating_add(SWEEP_US) {
            return None;
        }
        // The caller's own path, then (a tenant that does not limit its instances has one
        // lease for all of them) the tenant-wide one.
        for tenant_wide in [false, true] {
            if tenant_wide {
                path.instance.take()?;
            }
            let hash = hash_path(&self.seed, path);
            let mut shard = self.shard(hash);
            let Some(l) = shard.leases.find_mut(hash, |l| path.is(&l.keys)) else {
                continue;
            };
            if !(l.terms.covers(version, caller, tenant_wide) && cost <= l.tool.lease_max) {
                return None;
            }
            return l.spend(cost, now, &can_fetch);
        }
        None
    }

    /// Spends `plan`'s cost from its caller's lease, or says how much to ask the store for.
    /// Leases that ended on the way are pushed to `returns`.
    pub(crate) fn take(
        &self,
        plan: &Plan<'_>,
        can_fetch: impl FnOnce() -> bool,
        returns: &mut Vec<Return>,
    ) -> FromLease {
        let (now, c) = (plan.now.as_micros(), plan.cost);
        let path = Path::of_plan(plan);
        let hash = hash_path(&self.seed, path);
        let mut shard = self.shard(hash);
        self.maybe_sweep(&mut shard, now, returns);
        let Some(l) = shard.leases.find_mut(hash, |l| path.is(&l.keys)) else {
            return FromLease::Miss { grant: c };
        };
        let same = Arc::ptr_eq(&l.tool, plan.tool) && now >= l.started;
        // From the current grant, or, when it is spent, the next one if it was fetched in time.
        let spent = same.then(|| {
            l.spend(c, now, can_fetch)
                .or_else(|| l.spend_next(c, now, returns))
        });
        if let Some(spent) = spent.flatten() {
            return FromLease::Hit(spent);
        }
        // Sized on what the caller spent of it, before what is left goes back.
        let grant = size(c, l, now);
        l.give_back(returns);
        if !same || l.cool || now >= l.last.saturating_add(IDLE_US) {
            l.cool = false;
            return FromLease::Miss { grant: c };
        }
        FromLease::Miss { grant }
    }

    /// Keeps what a grant of `granted` units left after its first call (`plan`'s cost) as the
    /// caller's lease, and answers that call's admission: spent from the grant (now shared)
    /// when units are left for the lease, the grant itself when none are. A lease this one
    /// replaces is pushed to `returns`.
    pub(crate) fn granted(
        &self,
        plan: &Plan<'_>,
        terms: GrantTerms,
        grant: Arc<Admission>,
        granted: f64,
        returns: &mut Vec<Return>,
    ) -> Result<(Arc<Admission>, GrantShare), Arc<Admission>> {
        let now = plan.now.as_micros();
        let left = (granted - plan.cost).max(0.0);
        // One call's cost: an ordinary decision, of which only the history is kept (the next
        // grant is sized on it). Otherwise the grant is shared from here on by the lease and
        // every call spent from it.
        let kept = (left > EPS).then(|| grant.clone());
        let lease = Lease {
            keys: plan.keys(),
            tool: plan.tool.clone(),
            terms,
            room: grant.remaining.min(grant.slack).max(0.0),
            until: kept.as_deref().map_or(now, |g| ends(g, now)),
            grant: kept,
            granted,
            left,
            started: now,
            last: now,
            cool: false,
            next: None,
            refreshing: false,
        };
        // Written only when new: every call's lease check reads this line.
        let marks = tool_marks(plan.tool.name());
        if self.tools.load(Relaxed) & marks != marks {
            self.tools.fetch_or(marks, Relaxed);
        }
        let one_call = granted <= plan.cost;
        self.put(lease, one_call, returns);
        if left > EPS {
            let part = part_of(&grant, granted, left, plan.cost, now);
            Ok((grant, part))
        } else {
            Err(grant)
        }
    }

    /// Puts `lease` in the table: a lease of the same path gives back what its current
    /// grant holds, and keeps its next grant if fetched under the same policy (and, after a
    /// grant of `one_call`, its coolness: a call decided alone after a refused or borrowing
    /// grant makes the next one a call too).
    fn put(&self, mut lease: Lease, one_call: bool, returns: &mut Vec<Return>) {
        let hash = hash_keys(&self.seed, &lease.keys);
        let mut shard = self.shard(hash);
        if let Some(old) = shard.leases.find_mut(hash, |l| l.keys == lease.keys) {
            old.give_back_current(returns);
            match old.next.take() {
                Some(n) if Arc::ptr_eq(&n.tool, &lease.tool) => lease.next = Some(n),
                Some(n) => returns.push(Return::all(n.grant, n.granted)),
                None => {}
            }
            lease.refreshing = old.refreshing;
            lease.cool = old.cool && one_call;
            *old = lease;
            return;
        }
        let seed = &self.seed;
        shard
            .leases
            .insert_unique(hash, lease, |l| hash_keys(seed, &l.keys));
    }

    /// Runs `f` on the lease of `path`, if there is one.
    fn renew(&self, path: Path<'_>, f: impl FnOnce(&mut Lease)) {
        let hash = hash_path(&self.seed, path);
        if self.shards.get().is_none() {
            return;
        }
        if let Some(l) = self.shard(hash).leases.find_mut(hash, |l| path.is(&l.keys)) {
            f(l);
        }
    }

    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    /// Keeps a grant fetched ahead as the next one of the caller's lease, or hands it back
    /// for a return when the lease it was fetched for is gone (idle, ended, reloaded).
    pub(crate) fn fetched(
        &self,
        plan: &Plan<'_>,
        grant: Arc<Admission>,
        granted: f64,
    ) -> Option<Return> {
        let now = plan.now.as_micros();
        let mut spare = Some(Spare {
            room: grant.remaining.min(grant.slack).max(0.0),
            until: ends(&grant, now),
            grant,
            granted,
            tool: plan.tool.clone(),
        });
        self.renew(Path::of_plan(plan), |l| {
            if l.refreshing && Arc::ptr_eq(&l.tool, plan.tool) && l.next.is_none() {
                l.refreshing = false;
                l.next = spare.take();
            }
        });
        spare.map(|s| Return::all(s.grant, s.granted))
    }

    /// A grant fetched ahead for the lease of `keys` was not kept (refused, borrowed, or the
    /// store failed); `cool`: the next grant is one call's cost.
    pub(crate) fn fetch_failed(&self, keys: &CallKeys, cool: bool) {
        self.renew(Path::of(keys), |l| {
            l.refreshing = false;
            l.cool |= cool;
        });
    }

    /// Puts back what a call spent from its lease when the call is not admitted after all
    /// (another tool it is charged to refused it): into the lease while it holds that grant,
    /// else pushed to `returns` to go back to the store.
    pub(crate) fn unspend(&self, spent: Spent, returns: &mut Vec<Return>) {
        let mut back = Some(spent);
        let keys = back.as_ref().map(|s| s.grant.keys.clone()).expect("spent");
        self.renew(Path::of(&keys), |l| {
            let Some(s) =
                back.take_if(|s| l.grant.as_ref().is_some_and(|g| Arc::ptr_eq(g, &s.grant)))
            else {
                return;
            };
            l.left = (l.left + s.part.cost).min(l.granted);
            l.refreshing &= s.fetch.is_none();
        });
        if let Some(s) = back {
            returns.push(Return {
                factor: -s.part.of,
                units: s.part.cost,
                grant: s.grant,
            });
        }
    }

    /// A grant above one call's cost was refused or had to borrow: the caller's next grant
    /// is one call's cost.
    pub(crate) fn cool(&self, plan: &Plan<'_>) {
        self.renew(Path::of_plan(plan), |l| l.cool = true);
    }

    /// Sweeps every shard for leases that ended or went idle, at most every [`SWEEP_US`]:
    /// with any traffic at all, an idle caller's balance goes back within
    /// [`IDLE_US`] + [`SWEEP_US`]. (A shard another thread holds is left for the next sweep.)
    fn maybe_sweep(&self, own: &mut Shard, now: u64, returns: &mut Vec<Return>) {
        let due = self.swept_at.load(Relaxed);
        let claimed = now >= due.saturating_add(SWEEP_US)
            && self
                .swept_at
                .compare_exchange(due, now, Relaxed, Relaxed)
                .is_ok();
        if !claimed {
            return;
        }
        sweep(own, now, returns);
        for s in self.shards.get().map_or(&[][..], |s| &s[..]) {
            if let Ok(mut other) = s.0.try_lock() {
                sweep(&mut other, now, returns);
            }
        }
    }

    /// Every lease, ended: what each holds goes back.
    pub(crate) fn drain(&self) -> Vec<Return> {
        let mut out = Vec::new();
        for s in self.shards.get().map_or(&[][..], |s| &s[..]) {
            let mut s = lock(&s.0);
            for l in s.leases.iter_mut() {
                l.give_back(&mut out);
            }
            s.leases.clear();
        }
        out
    }

    /// Units held in leases now.
    pub(crate) fn held(&self) -> f64 {
        let mut units = 0.0;
        for s in self.shards.get().map_or(&[][..], |s| &s[..]) {
            for l in lock(&s.0).leases.iter() {
                let current = if l.grant.is_some() { l.left } else { 0.0 };
                units += current + l.next.as_ref().map_or(0.0, |n| n.granted);
            }
        }
        units
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn sweep(shard: &mut Shard, now: u64, returns: &mut Vec<Return>) {
    shard.leases.retain(|l| {
        let idle = now >= l.last.saturating_add(IDLE_US) || now >= l.until;
        if idle {
            l.give_back(returns);
        }
        // An idle lease's history is forgotten with it: the next grant starts at one call.
        !idle
    });
}

/// A caller's path (tool, tenant, instance), borrowed: what its lease is found by.
#[derive(Clone, Copy, Debug)]
struct Path<'a> {
    tool: &'a str,
    tenant: &'a str,
    instance: Option<&'a str>,
    untenanted: bool,
}

impl<'a> Path<'a> {
    fn of_caller(tool: &'a str, caller: &'a Caller) -> Self {
        match caller.tenant() {
            Some(tenant) => Path {
                tool,
                tenant,
                instance: caller.instance(),
                untenanted: false,
            },
            None => Path {
                tool,
                tenant: caller.instance().unwrap_or(""),
                instance: None,
                untenanted: true,
            },
        }
    }

    fn of_plan(plan: &'a Plan<'a>) -> Self {
        Path {
            tool: plan.tool.name(),
            tenant: plan.tenant.name,
            instance: plan.instance.map(|i| &**i.name),
            untenanted: plan.untenanted,
        }
    }

    fn of(k: &'a CallKeys) -> Self {
        Path {
            tool: &k.tool,
            tenant: &k.tenant,
            instance: k.instance.as_deref(),
            untenanted: k.untenanted,
        }
    }

    /// Whether `k` are this path's keys.
    fn is(&self, k: &CallKeys) -> bool {
        k.are(self.tool, self.tenant, self.instance, self.untenanted)
    }
}

fn hash_keys(seed: &RandomState, k: &CallKeys) -> u64 {
    hash_path(seed, Path::of(k))
}

/// A tool's two marks in [`Leases::tools`], picked by its name's length and its first,
/// middle and last bytes (read without hashing the whole name). A tool whose marks are not
/// both set has never been granted a lease; two tools that share both marks only look for a
/// lease in vain.
fn tool_marks(tool: &str) -> u64 {
    let b = tool.as_bytes();
    let n = b.len();
    let byte = |i: usize| u64::from(b.get(i).copied().unwrap_or(0));
    let mix = (n as u64 | byte(0) << 16 | byte(n / 2) << 24 | byte(n.wrapping_sub(1)) << 32)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    1 << (mix >> 58) | 1 << ((mix >> 52) & 63)
}

/// A path's hash, from a seed random per limiter.
fn hash_path(seed: &RandomState, p: Path<'_>) -> u64 {
    seed.hash_one((p.tool, p.tenant, p.instance, p.untenanted))
}

/// When a grant must end, on the clock of the limiter that asked for it at `now`: the end of
/// its aligned window, of any budget window it was charged in, or its lifetime. The store may
/// keep its own time (Redis's): each end is a span from the grant's own instant laid from
/// `now`, so a lease ends early rather than late whatever the two clocks say.
fn ends(grant: &Admission, now: u64) -> u64 {
    let at = grant.at.as_micros();
    let mut until = now.saturating_add(LIFETIME_US);
    until = until.min(now.saturating_add(grant.reset_in.max(0.0) as u64));
    for l in grant.charge.levels.iter().filter(|l| l.present) {
        for (period, start) in l.budgets.iter() {
            let end = period.end_of(Timestamp(start as u64)).as_micros();
            until = until.min(now.saturating_add(end.saturating_sub(at)));
        }
    }
    until
}

/// A call's part of a grant it is spent from: its share of what the grant charged at each
/// level (so settling or refunding the call corrects the store by that share exactly), and
/// the grant's figures as of the call, the units still held counted as the caller's.
fn part_of(grant: &Admission, granted: f64, left: f64, cost: f64, now: u64) -> GrantShare {
    let since = now.saturating_sub(grant.at.as_micros()) as f64;
    GrantShare {
        of: if granted > 0.0 { cost / granted } else { 0.0 },
        cost,
        remaining: grant.remaining + left,
        reset_in: (grant.reset_in - since).max(0.0),
    }
}

#[cfg(test)]
mod tests;
