//! Leases: a process's local balance of one caller's units, charged at every level in advance.
//!
//! A call on a tool with `lease = { max = N }` asks the store for more than it costs — a
//! *grant* — through the same decision as any call: every level (tool, tenant, instance) is
//! charged the whole grant at once, all or nothing, its floors, shares, ceilings, budgets and
//! template counts included. What the call does not use is kept here, in this process, under
//! the caller's path; the caller's next calls spend it without touching the store (no tool
//! lock, no Redis command). So nothing is ever admitted that the store did not charge first:
//! capacity, ceilings and budgets stay exact however many processes hold leases.
//!
//! What a lease may cost is only under-use: units charged and not yet spent. They are bounded:
//! - a grant only ever holds the caller's **own** units (its floor and its own share): a grant
//!   that had to borrow idle capacity from others is given back at once and the call decided
//!   alone, so no lease ever parks units lent by someone else, and no caller's floor is ever
//!   held in another caller's lease;
//! - one lease per caller path per process, of at most `max` units, and on a tokio runtime
//!   the next grant, fetched ahead by a task of its own once half of the current one is spent
//!   (so a busy caller's calls do not wait for the store): at most two grants per path;
//! - a grant grows from one call's cost, doubling at most, with what the caller spent in the
//!   last ~100 ms, and stays at one call's cost while the caller, its tenant or the tool is
//!   near its limit (a quarter of the room left, a quarter of the smallest burst on the path)
//!   or a grant was just refused: a small limit (`3 per minute`) is decided call by call
//!   exactly as without leases;
//! - a lease lives until the end of its aligned window or of any budget window it was charged
//!   in, and at most a second; it goes back to the store (refunded through every level) when
//!   it ends, when its caller is idle for 100 ms, on policy reload, and when the limiter is
//!   dropped or told to return its leases.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;

use foldhash::fast::RandomState;
use hashbrown::HashTable;

use crate::admission::engine::Plan;
use crate::clock::Timestamp;
use crate::identity::Caller;
use crate::key::{same_name, short_name_words};
use crate::limiter::{Answer, Ticket};
use crate::policy::ToolPolicy;
use crate::store::{Admission, CallKeys};

/// How long a lease's balance should last at the rate its caller spends: the grant is sized
/// to what the caller spent over about this long.
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
/// A shard is swept for idle leases at most this often.
const SWEEP_US: u64 = 50_000;
/// The most lease shards a limiter makes (2 MiB of them).
const MAX_SHARDS: usize = 16_384;
/// Tolerance for float comparisons, as in the engine.
const EPS: f64 = 1e-9;

/// A call's part of the admission it was admitted under: what it spent of a lease's grant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Part {
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

/// A caller's path (tool, tenant, instance), borrowed: what its lease is found by.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Path<'a> {
    pub(crate) tool: &'a str,
    pub(crate) tenant: &'a str,
    pub(crate) instance: Option<&'a str>,
    pub(crate) untenanted: bool,
}

impl<'a> Path<'a> {
    fn of(k: &'a CallKeys) -> Self {
        Path {
            tool: &k.tool,
            tenant: &k.tenant,
            instance: k.instance.as_deref(),
            untenanted: k.untenanted,
        }
    }

    /// Whether `k` are this path's keys.
    #[inline(always)]
    fn is(&self, k: &CallKeys) -> bool {
        self.is_below_tool(k) && same_name(&k.tool, self.tool)
    }

    /// Whether `k` are this path's keys, the tool's name aside.
    #[inline(always)]
    fn is_below_tool(&self, k: &CallKeys) -> bool {
        k.untenanted == self.untenanted
            && same_name(&k.tenant, self.tenant)
            && match (k.instance.as_deref(), self.instance) {
                (Some(a), Some(b)) => same_name(a, b),
                (a, b) => a.is_none() && b.is_none(),
            }
    }
}

/// Units a lease gives back to the store: `factor` × the grant's charge (negative: a refund).
pub(crate) struct Return {
    pub(crate) grant: Arc<Admission>,
    pub(crate) factor: f64,
    pub(crate) units: f64,
}

/// What the table answers for a call.
pub(crate) enum Take {
    /// Spent from the caller's lease: the grant and the call's part of it, and, once half of
    /// the grant is spent and the caller may fetch ahead, the size of the next grant to fetch
    /// now (in the background) so that the caller never waits for one.
    Hit(Arc<Admission>, Part, Option<f64>),
    /// Not covered: ask the store for `grant` units (at least the call's cost; exactly its
    /// cost means an ordinary, unleased decision).
    Miss { grant: f64 },
}

/// What a lease knows of the policy it was granted under, so that a call can be spent from it
/// without resolving the call against the policy (see [`Leases::spend`]).
#[derive(Clone, Debug)]
pub(crate) struct Known {
    /// The limiter's policy version the lease is valid under: the version read before the
    /// policy the grant was decided under was loaded (a later policy never has an earlier
    /// version).
    pub(crate) version: u64,
    /// The tier of the caller that was granted the lease (a tool may allow some tiers only).
    pub(crate) tier: Option<Arc<str>>,
    /// The plan the caller granted the lease carried (an unlisted tenant's template is its
    /// plan's).
    pub(crate) caller_plan: Option<Arc<str>>,
    /// Whether the caller's tenant limits its instances: a call of another instance is
    /// charged at its own instance then, not from this lease.
    instances_limited: bool,
    /// The smallest burst on the path (a grant takes a part of it at most).
    burst: f64,
    /// The tool's window, in whole seconds (a ticket's `RateLimit` window).
    window_secs: u64,
}

impl Known {
    pub(crate) fn new(version: u64, caller: &Caller, plan: &Plan<'_>) -> Self {
        let mut burst = plan.tool.burst.min(plan.tenant.policy.burst);
        if let Some(i) = plan.instance {
            burst = burst.min(i.policy.burst);
        }
        Known {
            version,
            tier: caller.tier_arc().cloned(),
            caller_plan: caller.plan_arc().cloned(),
            instances_limited: !plan.untenanted && plan.tenant.policy.has_instances(),
            burst,
            window_secs: plan.tool.period().as_secs_ceil(),
        }
    }
}

/// The next grant to fetch ahead for a call spent from its lease without the policy at hand
/// (see [`Leases::spend`]): its size and the lease's keys. Seldom made: boxed.
pub(crate) type FetchAhead = Option<Box<(f64, CallKeys)>>;

/// Every lease this process holds, sharded by caller path.
pub(crate) struct Leases {
    /// Made at the first leasing call: a limiter whose policy never leases holds none.
    shards: std::sync::OnceLock<Box<[Padded]>>,
    /// The hash's seed, random per limiter (see [`hash_path`]).
    seed: u64,
    /// One bit per tool name that was ever granted a lease (see [`tool_bit`]): a call of a
    /// tool whose bit is clear looks for no lease before the policy is read.
    tools: AtomicU64,
    /// Returns that could not be applied where they were decided (a store that needs I/O,
    /// in a call that cannot wait): the next call that can wait applies them.
    pending: Mutex<Vec<Return>>,
    has_pending: AtomicBool,
    /// When the shards were last swept (µs).
    swept_at: AtomicU64,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("shards", &self.shards.get().map_or(0, |s| s.len()))
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
    /// What a call needs to be spent from the lease without the policy at hand (see
    /// [`Leases::spend`]).
    known: Known,
    /// The grant as the store admitted it; `None` once nothing is left to return.
    grant: Option<Arc<Admission>>,
    granted: f64,
    left: f64,
    /// When the lease ends (µs): its aligned window's or a budget window's end, or its
    /// lifetime.
    until: u64,
    started: u64,
    last: u64,
    /// The room the last grant left above the caller (its quota left in the window, the
    /// tool's pool): the next grant takes at most a part of it.
    room: f64,
    /// Set after a refused or borrowing grant: the next one is one call's cost.
    cool: bool,
    /// The next grant, fetched ahead while this one is spent (see [`Take::Hit`]).
    next: Option<Spare>,
    /// A grant is being fetched ahead for this lease.
    refreshing: bool,
    /// The current grant cannot be fetched ahead of (a call past the point found no runtime
    /// to fetch it on); cleared with each grant.
    unfetchable: bool,
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
    /// Spends `c` from the current grant at `now`, if the grant is current and holds enough:
    /// the grant, the call's part of it, and the size of the next grant to fetch ahead now
    /// when it is time to (`may_fetch_ahead` is asked only then).
    #[inline(always)]
    fn spend(
        &mut self,
        c: f64,
        now: u64,
        may_fetch_ahead: impl FnOnce() -> bool,
    ) -> Option<(Arc<Admission>, Part, Option<f64>)> {
        if !(now >= self.started && now < self.until && self.left + EPS >= c) {
            return None;
        }
        let grant = self.grant.clone()?;
        self.left = (self.left - c).max(0.0);
        self.last = now;
        let part = part_of(&grant, self.granted, self.left, c, now);
        let ahead = (self.next.is_none()
            && !self.refreshing
            && !self.cool
            && !self.unfetchable
            && self.left < self.granted * FETCH_AHEAD_AT
            && {
                // Asked once a grant: where no grant can be fetched ahead (no runtime), the
                // rest of this one is spent without asking again.
                self.unfetchable = !may_fetch_ahead();
                !self.unfetchable
            })
        .then(|| Leases::size(c, self.tool.lease_max, self, now))
        .filter(|size| *size > c);
        self.refreshing |= ahead.is_some();
        Some((grant, part, ahead))
    }

    /// Pushes what is left of the current grant, and the whole next one, for a return,
    /// leaving the lease empty (its history stays).
    fn give_back(&mut self, out: &mut Vec<Return>) {
        self.give_back_current(out);
        if let Some(n) = self.next.take() {
            out.push(Return {
                factor: -1.0,
                units: n.granted,
                grant: n.grant,
            });
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a lease granted under `a` may be spent under `b`: the same policy, not a reload.
fn same_policy(a: &Arc<ToolPolicy>, b: &Arc<ToolPolicy>) -> bool {
    Arc::ptr_eq(a, b)
}

/// Whether calls of this plan may be leased: the tool allows it and no level on the path caps
/// calls in flight (a permit is per call, and must be counted where every process sees it).
pub(crate) fn eligible(plan: &Plan<'_>) -> bool {
    plan.tool.lease_max > 1.0
        && plan.cost <= plan.tool.lease_max
        && plan.tool.max_concurrency.is_none()
        && plan.tenant.policy.max_concurrency.is_none()
        && plan
            .instance
            .is_none_or(|i| i.policy.max_concurrency.is_none())
}

impl Leases {
    pub(crate) fn new() -> Self {
        Leases {
            shards: std::sync::OnceLock::new(),
            seed: RandomState::default().hash_one(0x5eed_u64),
            tools: AtomicU64::new(0),
            pending: Mutex::new(Vec::new()),
            has_pending: AtomicBool::new(false),
            swept_at: AtomicU64::new(0),
        }
    }

    /// The shards, made on first use: enough that threads deciding for distinct callers
    /// seldom share one (each is on cache lines of its own, 128 bytes). Two threads cycling
    /// over `k` callers each share about `k² / n` of `n` shards, and every call on a shared
    /// one moves its lines between the cores: 2,048 a core (4,096 on two cores, 512 KiB), at most
    /// [`MAX_SHARDS`].
    fn shards(&self) -> &[Padded] {
        self.shards.get_or_init(|| {
            let n = std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .saturating_mul(2048)
                .next_power_of_two()
                .clamp(512, MAX_SHARDS);
            (0..n)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect()
        })
    }

    /// The shards if any lease was ever made.
    fn made(&self) -> &[Padded] {
        self.shards.get().map_or(&[], |s| &s[..])
    }

    fn hash(&self, k: &CallKeys) -> u64 {
        hash_path(self.seed, Path::of(k))
    }

    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        shard_of(self.shards(), hash)
    }

    /// Whether a lease of `tool` may be held: `false` when no lease was ever granted, or none
    /// of a tool with a name as long (see [`tool_bit`]).
    #[inline]
    pub(crate) fn may_hold(&self, tool: &str) -> bool {
        self.tools.load(Relaxed) & tool_bit(tool) != 0
    }

    /// Spends `cost` from the lease of `caller` calling `tool`, before the call is resolved
    /// against the policy, when nothing else is needed: the policy is the version the lease
    /// was granted under (`version`, so the call would resolve to the lease's path as the
    /// call that was granted it did), the caller has the tier it was granted to, and the lease
    /// is current and holds enough. `false`: the call goes the whole way (where it may still
    /// be spent from the lease). The next grant is fetched ahead as by [`Leases::take`].
    /// The caller checks [`may_hold`](Self::may_hold) first; `now` is read once the path is
    /// hashed. The ticket is written to `answer` here, where the call's part is worked out
    /// (`answer` is where the caller receives it: it is not moved again); the grant to fetch
    /// ahead, if any, is left in `fetch`. Whether the call was spent.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn spend(
        &self,
        version: u64,
        tool: &str,
        caller: &Caller,
        cost: f64,
        now: impl FnOnce() -> Timestamp,
        may_fetch_ahead: impl Fn() -> bool,
        fetch: &mut FetchAhead,
        answer: &mut Answer,
    ) -> bool {
        let Some(shards) = self.shards.get() else {
            return false;
        };
        if !(cost.is_finite() && cost >= 0.0) {
            return false;
        }
        let tier = caller.tier();
        let path = match caller.tenant() {
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
        };
        let caller_plan = caller.plan();
        let valid = |l: &Lease| {
            l.known.version == version
                && l.known.tier.as_deref() == tier
                && l.known.caller_plan.as_deref() == caller_plan
        };
        let hash = hash_path(self.seed, path);
        // The clock is read once the path is hashed: the counter's latency and the hash's
        // overlap.
        let now = now().as_micros();
        // Leases to sweep: the whole way does that.
        if now >= self.swept_at.load(Relaxed).saturating_add(SWEEP_US) {
            return false;
        }
        // The caller's own path, then (for a tenant that does not limit its instances: one
        // path for all of them) the tenant-wide one.
        let (mut path, mut hash, mut tenant_wide) = (path, hash, false);
        loop {
            if self.spend_at(
                shards,
                path,
                hash,
                &valid,
                tenant_wide,
                cost,
                now,
                &may_fetch_ahead,
                fetch,
                answer,
            ) {
                return true;
            }
            if tenant_wide || path.instance.is_none() {
                return false;
            }
            path = Path {
                instance: None,
                ..path
            };
            hash = hash_path(self.seed, path);
            tenant_wide = true;
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn spend_at(
        &self,
        shards: &[Padded],
        path: Path<'_>,
        hash: u64,
        valid: &impl Fn(&Lease) -> bool,
        tenant_wide: bool,
        c: f64,
        now: u64,
        may_fetch_ahead: impl FnOnce() -> bool,
        fetch: &mut FetchAhead,
        answer: &mut Answer,
    ) -> bool {
        let mut shard = lock(shard_of(shards, hash));
        let Some(l) = shard.leases.find_mut(hash, |l| path.is(&l.keys)) else {
            return false;
        };
        if !(valid(l) && !(tenant_wide && l.known.instances_limited) && c <= l.tool.lease_max) {
            return false;
        }
        let Some((grant, part, ahead)) = l.spend(c, now, may_fetch_ahead) else {
            return false;
        };
        crate::telemetry::lease_hit(l.tool.name_arc(), c);
        if let Some(size) = ahead {
            *fetch = Some(Box::new((size, l.keys.clone())));
        }
        *answer = Poll::Ready(Ok(Ticket::leased(grant, part, l.known.window_secs)));
        true
    }

    /// Spends `plan`'s cost from its caller's lease, or says how much to ask the store for.
    /// Leases that ended on the way are pushed to `returns`.
    pub(crate) fn take(
        &self,
        plan: &Plan<'_>,
        path: Path<'_>,
        returns: &mut Vec<Return>,
        may_fetch_ahead: bool,
    ) -> Take {
        let now = plan.now.as_micros();
        let c = plan.cost;
        let hash = hash_path(self.seed, path);
        let mut shard = lock(self.shard(hash));
        self.maybe_sweep(&mut shard, now, returns);
        // A lease of the same tool policy has the same tool name: compared by pointer first.
        let found = shard.leases.find_mut(hash, |l| {
            if Arc::ptr_eq(&l.tool, plan.tool) {
                path.is_below_tool(&l.keys)
            } else {
                path.is(&l.keys)
            }
        });
        let Some(l) = found else {
            return Take::Miss { grant: c };
        };
        let same = same_policy(&l.tool, plan.tool) && now >= l.started;
        if same {
            if let Some((g, part, ahead)) = l.spend(c, now, || may_fetch_ahead) {
                return Take::Hit(g, part, ahead);
            }
        }
        // The current grant is spent: the next one, if it was fetched in time.
        let next_fits = l.next.as_ref().is_some_and(|n| {
            same && same_policy(&n.tool, plan.tool) && now < n.until && n.granted + EPS >= c
        });
        if next_fits {
            l.give_back_current(returns);
            let n = l.next.take().expect("checked");
            let left = (n.granted - c).max(0.0);
            let part = part_of(&n.grant, n.granted, left, c, now);
            let grant = n.grant.clone();
            l.grant = Some(n.grant);
            l.granted = n.granted;
            l.left = left;
            l.until = n.until;
            l.room = n.room;
            l.started = now;
            l.last = now;
            l.unfetchable = false;
            return Take::Hit(grant, part, None);
        }
        // Sized on what the caller spent of it, before what is left goes back.
        let size = Self::size(c, plan.tool.lease_max, l, now);
        l.give_back(returns);
        if !same || l.cool || now >= l.last.saturating_add(IDLE_US) {
            l.cool = false;
            return Take::Miss { grant: c };
        }
        Take::Miss { grant: size }
    }

    /// Keeps a grant fetched ahead as the next one of the caller's lease, or hands it back for
    /// a return when the lease it was fetched for is gone (idle, ended, reloaded, replaced).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn fetched(
        &self,
        plan: &Plan<'_>,
        keys: &CallKeys,
        grant: Arc<Admission>,
        granted: f64,
    ) -> Option<Return> {
        let now = plan.now.as_micros();
        let hash = self.hash(keys);
        let mut shard = lock(self.shard(hash));
        match shard.leases.find_mut(hash, |l| l.keys == *keys) {
            Some(l) if l.refreshing && same_policy(&l.tool, plan.tool) && l.next.is_none() => {
                l.refreshing = false;
                l.next = Some(Spare {
                    room: grant.remaining.min(grant.slack).max(0.0),
                    until: ends(&grant, now),
                    grant,
                    granted,
                    tool: plan.tool.clone(),
                });
                None
            }
            _ => Some(Return {
                factor: -1.0,
                units: granted,
                grant,
            }),
        }
    }

    /// A grant fetched ahead was not kept (refused, borrowed, or the store failed): the next
    /// one is fetched when the lease runs out, one call's cost if `cool`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn fetch_failed(&self, keys: &CallKeys, cool: bool) {
        let hash = self.hash(keys);
        let mut shard = lock(self.shard(hash));
        if let Some(l) = shard.leases.find_mut(hash, |l| l.keys == *keys) {
            l.refreshing = false;
            l.cool |= cool;
        }
    }

    /// The next grant for a caller whose lease ran out: what it spent over the last
    /// lease's life, stretched to [`TARGET_US`], at most twice the last grant, within the
    /// room the last grant left and the path's bursts, and `max`.
    fn size(c: f64, max: f64, l: &Lease, now: u64) -> f64 {
        let life = now.saturating_sub(l.started).max(1) as f64;
        let spent = (l.granted - l.left).max(c);
        let mut want = (spent * TARGET_US / life).min(2.0 * l.granted);
        want = want.min(l.known.burst * ROOM_PART);
        want = want.min(l.room * ROOM_PART);
        want = want.min(max);
        // Whole calls: a grant that would leave less than one more call is one call's cost
        // (a fraction left over would only go back).
        let calls = if c > 0.0 { (want / c).floor() } else { 1.0 };
        if calls >= 2.0 {
            calls * c
        } else {
            c
        }
    }

    /// Keeps what a grant of `granted` units left after its first call (`plan`'s cost) as the
    /// caller's lease, and answers that call's admission: spent from the grant (now shared)
    /// when units are left for the lease, the grant itself when none are. A lease this one
    /// replaces (another thread's grant for the same caller, decided meanwhile) is pushed to
    /// `returns`.
    pub(crate) fn granted(
        &self,
        plan: &Plan<'_>,
        keys: &CallKeys,
        known: Known,
        grant: Arc<Admission>,
        granted: f64,
        returns: &mut Vec<Return>,
    ) -> Result<(Arc<Admission>, Part), Arc<Admission>> {
        let now = plan.now.as_micros();
        let left = (granted - plan.cost).max(0.0);
        // The room the grant left above the caller: its quota left in the window, the tool's
        // pool. The next grant takes a part of it at most.
        let room = grant.remaining.min(grant.slack).max(0.0);
        let (call, grant) = if left > EPS {
            // Shared from here on by the lease and every call spent from it.
            let part = part_of(&grant, granted, left, plan.cost, now);
            (Ok((grant.clone(), part)), Some(grant))
        } else {
            // One call's cost: an ordinary decision; only its history is kept.
            (Err(grant), None)
        };
        let until = grant.as_deref().map_or(now, |g| ends(g, now));
        let bit = tool_bit(&keys.tool);
        if self.tools.load(Relaxed) & bit == 0 {
            self.tools.fetch_or(bit, Relaxed);
        }
        let hash = self.hash(keys);
        let mut shard = lock(self.shard(hash));
        match shard.leases.find_mut(hash, |l| l.keys == *keys) {
            Some(l) => {
                // What is left of the current grant goes back; a grant fetched ahead (or on its
                // way) under the same policy stays the next one, any other goes back too. The
                // lease is renewed in place: its keys and (under the same policy) its tool stay,
                // so a busy caller's grants write no count shared with other callers' threads.
                l.give_back_current(returns);
                if !Arc::ptr_eq(&l.tool, plan.tool) {
                    l.tool = plan.tool.clone();
                }
                l.known = known;
                l.granted = granted;
                l.left = left;
                l.grant = grant;
                l.until = until;
                l.started = now;
                l.last = now;
                l.room = room;
                l.unfetchable = false;
                match l.next.take() {
                    Some(n) if same_policy(&n.tool, &l.tool) => l.next = Some(n),
                    Some(n) => returns.push(Return {
                        factor: -1.0,
                        units: n.granted,
                        grant: n.grant,
                    }),
                    None => {}
                }
                // A call decided alone after a refused or borrowing grant: the next one too.
                l.cool = l.cool && granted <= plan.cost;
            }
            None => {
                let lease = Lease {
                    keys: keys.clone(),
                    tool: plan.tool.clone(),
                    known,
                    granted,
                    left,
                    grant,
                    until,
                    started: now,
                    last: now,
                    room,
                    cool: false,
                    next: None,
                    refreshing: false,
                    unfetchable: false,
                };
                let seed = self.seed;
                shard
                    .leases
                    .insert_unique(hash, lease, |l| hash_keys(seed, &l.keys));
            }
        }
        call
    }

    /// Notes that a grant above one call's cost was refused or had to borrow: the caller's
    /// next grant is one call's cost.
    pub(crate) fn cool(&self, keys: &CallKeys) {
        let hash = self.hash(keys);
        let mut shard = lock(self.shard(hash));
        if let Some(l) = shard.leases.find_mut(hash, |l| l.keys == *keys) {
            l.cool = true;
        }
    }

    /// Sweeps every shard for leases that ended or went idle, at most every [`SWEEP_US`]
    /// (the first call after that does it; a shard another thread holds is left for the next
    /// sweep): with any traffic at all, an idle caller's balance goes back within
    /// [`IDLE_US`] + [`SWEEP_US`].
    fn maybe_sweep(&self, own: &mut Shard, now: u64, returns: &mut Vec<Return>) {
        let due = self.swept_at.load(Relaxed);
        if now < due.saturating_add(SWEEP_US)
            || self
                .swept_at
                .compare_exchange(due, now, Relaxed, Relaxed)
                .is_err()
        {
            return;
        }
        sweep(own, now, returns);
        for s in self.made() {
            if let Ok(mut other) = s.0.try_lock() {
                sweep(&mut other, now, returns);
            }
        }
    }

    /// Every lease, ended: what each holds goes back.
    pub(crate) fn drain(&self) -> Vec<Return> {
        let mut out = self.take_pending();
        for s in self.made() {
            let mut s = lock(&s.0);
            for l in s.leases.iter_mut() {
                l.give_back(&mut out);
            }
            s.leases.clear();
        }
        out
    }

    /// Returns parked for a call that can wait.
    pub(crate) fn park(&self, r: Return) {
        lock(&self.pending).push(r);
        self.has_pending.store(true, Relaxed);
    }

    /// Whether returns are parked for a call that can wait.
    #[inline]
    pub(crate) fn has_pending(&self) -> bool {
        self.has_pending.load(Relaxed)
    }

    /// The parked returns, if any.
    pub(crate) fn take_pending(&self) -> Vec<Return> {
        if !self.has_pending.load(Relaxed) {
            return Vec::new();
        }
        let mut p = lock(&self.pending);
        self.has_pending.store(false, Relaxed);
        std::mem::take(&mut *p)
    }

    /// Units held in leases now, and how many leases hold any.
    pub(crate) fn held(&self) -> (f64, usize) {
        let mut units = 0.0;
        let mut n = 0;
        for s in self.made() {
            for l in lock(&s.0).leases.iter() {
                let next = l.next.as_ref().map_or(0.0, |n| n.granted);
                if (l.grant.is_some() && l.left > EPS) || next > 0.0 {
                    units += l.left + next;
                    n += 1;
                }
            }
        }
        (units, n)
    }
}

fn shard_of(shards: &[Padded], hash: u64) -> &Mutex<Shard> {
    &shards[(hash >> 48) as usize & (shards.len() - 1)].0
}

fn hash_keys(h: u64, k: &CallKeys) -> u64 {
    hash_path(h, Path::of(k))
}

/// The bit of a tool in [`Leases::tools`]: by the length of its name (free to compute; tools
/// whose names are as long share a bit, and only look for a lease in vain).
fn tool_bit(tool: &str) -> u64 {
    1 << (tool.len() % 64)
}

/// A path's hash: each name folded on its own, a word at a time (names are short), with its
/// length and its place in the path, then the three together: the names' folds do not wait
/// for one another. From a seed random per limiter. The table compares whole names after it,
/// so the hash only spreads paths; it is what a call computes before it finds its lease.
#[inline(always)]
fn hash_path(seed: u64, p: Path<'_>) -> u64 {
    const K: [u64; 4] = [
        0x9e37_79b9_7f4a_7c15,
        0xc2b2_ae3d_27d4_eb4f,
        0x1656_67b1_9e37_79f9,
        0x85eb_ca77_c2b2_ae63,
    ];
    let shape = match (p.untenanted, p.instance) {
        (true, _) => 1,
        (false, None) => 2,
        (false, Some(_)) => 3,
    };
    let tool = hash_name(seed, K[0], p.tool);
    let tenant = hash_name(seed.rotate_left(21) ^ shape, K[1], p.tenant);
    let instance = p
        .instance
        .map_or(0, |i| hash_name(seed.rotate_left(42), K[2], i));
    fold(tool ^ instance.rotate_left(29), tenant ^ K[3])
}

/// `name`'s fold, from `h` and the constant `k` of its place in a path (see [`hash_path`]).
#[inline(always)]
fn hash_name(h: u64, k: u64, name: &str) -> u64 {
    let b = name.as_bytes();
    let n = b.len();
    let (x, y) = short_name_words(b).unwrap_or_else(|| {
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let mut h = h;
        let mut at = 0;
        while at + 16 < n {
            h = fold(h ^ word(at), k ^ word(at + 8));
            at += 16;
        }
        (h ^ word(n - 16), word(n - 8))
    });
    fold(h ^ x ^ ((n as u64) << 56), k ^ y)
}

/// Multiplies `a` by `b` and folds the 128-bit product's halves together.
#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = (a as u128).wrapping_mul(b as u128);
    (p as u64) ^ ((p >> 64) as u64)
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

/// When a grant must end, on the clock of the limiter that asked for it at `now` (before the
/// store decided): the end of its aligned window, of any budget window it was charged in, or
/// its lifetime. The store may keep its own time (Redis's): each end is taken as a span from
/// the grant's own instant and laid from `now`, which is earlier, so a lease ends early
/// rather than late whatever the two clocks say.
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
#[inline(always)]
fn part_of(grant: &Admission, granted: f64, left: f64, cost: f64, now: u64) -> Part {
    let since = now.saturating_sub(grant.at.as_micros()) as f64;
    Part {
        of: if granted > 0.0 { cost / granted } else { 0.0 },
        cost,
        remaining: grant.remaining + left,
        reset_in: (grant.reset_in - since).max(0.0),
    }
}

/// Whether an admitted grant drew, at the tenant or the instance, more than that level's own
/// share and floor (it borrowed idle capacity lent by others): such units are never leased.
pub(crate) fn borrowed(grant: &Admission) -> bool {
    grant.charge.levels[1..]
        .iter()
        .any(|l| l.present && l.ceiling > l.share + EPS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paths that differ in any name, in where a name stands, or in their shape hash apart:
    /// 20,100 paths of short and long names (every length branch of the hash), no two the
    /// same hash, and the shards they fall in evenly used.
    #[test]
    fn paths_hash_apart_and_spread_over_the_shards() {
        let seed = 0x1234_5678_9abc_def0;
        let names: Vec<String> = (0..100)
            .map(|i| match i % 4 {
                0 => format!("t{i}"),
                1 => format!("team-{i}"),
                2 => format!("tenant-number-{i}"),
                _ => format!("a-rather-long-tenant-name-{i}-of-some-org"),
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        let mut shards = vec![0u32; 512];
        let mut paths = 0;
        for (a, tenant) in names.iter().enumerate() {
            for (b, other) in names.iter().enumerate().take(100) {
                let instance = (a != b).then_some(other.as_str());
                for (tool, untenanted) in [("search", false), ("report", false), ("search", true)] {
                    if untenanted && instance.is_some() {
                        continue;
                    }
                    let p = Path {
                        tool,
                        tenant,
                        instance,
                        untenanted,
                    };
                    let h = hash_path(seed, p);
                    assert!(
                        seen.insert(h),
                        "two paths hash alike: {tool} {tenant} {instance:?}"
                    );
                    shards[(h >> 48) as usize & 511] += 1;
                    paths += 1;
                }
            }
        }
        assert!(paths >= 20_000, "{paths} paths");
        let (min, max) = (shards.iter().min().unwrap(), shards.iter().max().unwrap());
        let mean = paths as f64 / 512.0;
        assert!(
            f64::from(*min) > mean * 0.3 && f64::from(*max) < mean * 1.7,
            "shards used unevenly: {min}..{max} around {mean}"
        );
        // A name moved to another place in the path is another path.
        let swap = |t: &str, i: &str| {
            hash_path(
                seed,
                Path {
                    tool: "search",
                    tenant: t,
                    instance: Some(i),
                    untenanted: false,
                },
            )
        };
        assert_ne!(swap("acme", "bot"), swap("bot", "acme"));
    }

    fn grant(at: u64, reset_in: f64) -> Admission {
        Admission {
            keys: CallKeys {
                tool: Arc::from("t"),
                tenant: Arc::from("a"),
                instance: None,
                untenanted: false,
            },
            charge: Default::default(),
            remaining: 0.0,
            quota: 0.0,
            reset_in,
            slack: 0.0,
            views: Default::default(),
            at: Timestamp(at),
            call: 0,
        }
    }

    /// Leases holding one grant of 10 units (one of them spent by the call that asked) for
    /// tenant `a` of the tool `t` that `policy` lists, under policy version 3 and `tier`,
    /// swept at `now` (a sweep due would send a call the whole way).
    fn granted_to_a(policy: &str, tier: Option<&str>, now: u64) -> Leases {
        let policy = crate::Policy::from_toml_str(policy).expect("valid");
        let tool = policy.tool("t").expect("listed");
        let plan = Plan {
            now: Timestamp(now),
            cost: 1.0,
            tool,
            tenant: crate::admission::engine::LevelRef {
                name: &Arc::from("a"),
                policy: tool.tenant("a").expect("the template"),
            },
            instance: None,
            untenanted: false,
        };
        let leases = Leases::new();
        let g = grant(now, 500_000.0);
        let caller = match tier {
            Some(t) => Caller::new("a").with_tier(t),
            None => Caller::new("a"),
        };
        let known = Known::new(3, &caller, &plan);
        let mut back = Vec::new();
        let call = leases.granted(&plan, &g.keys, known, Arc::new(g.clone()), 10.0, &mut back);
        assert!(call.is_ok() && back.is_empty());
        leases.swept_at.store(now, Relaxed);
        leases
    }

    /// One unit of tool `t` spent from `caller`'s lease at `at` under policy `version`.
    fn spend_one(leases: &Leases, version: u64, caller: &Caller, at: Timestamp) -> bool {
        leases.spend(
            version,
            "t",
            caller,
            1.0,
            || at,
            || false,
            &mut None,
            &mut Poll::Pending,
        )
    }

    /// The tool `t` with leases and a template tenant.
    const LEASING: &str =
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 1000, per = \"1s\" }\n\
         lease = { max = 64 }\n[tool.default_tenant]\nmax_tenants = 10\n";

    /// A lease is spent before the call is resolved only under the policy version and for the
    /// tier it was granted under: a grant decided under a policy that was replaced meanwhile
    /// (its version is not the limiter's any more) is never spent that way.
    #[test]
    fn a_lease_is_spent_unresolved_only_under_its_version_and_tier() {
        let now = 1_767_225_600_000_000;
        let leases = granted_to_a(LEASING, Some("gold"), now);
        let gold = Caller::new("a").with_tier("gold");
        let at = Timestamp(now + 10);
        let spend = |version, caller: &Caller| spend_one(&leases, version, caller, at);
        assert!(!spend(4, &gold), "a later policy version");
        assert!(!spend(3, &Caller::new("a")), "another tier");
        assert!(spend(3, &gold));
        assert_eq!(leases.held().0, 8.0);
    }

    /// A tenant that does not limit its instances has one lease for all of them: a call from
    /// any of its instances is spent from it before the call is resolved. A tenant that does
    /// limit them never lends an instance its tenant-wide lease.
    #[test]
    fn instances_of_a_tenant_that_does_not_limit_them_spend_its_one_lease() {
        let now = 1_767_225_600_000_000;
        let at = Timestamp(now + 10);
        for (limits_instances, spent) in [(false, true), (true, false)] {
            let mut policy = String::from(LEASING);
            if limits_instances {
                policy.push_str("[tool.default_tenant.default_instance]\nmax_instances = 10\n");
            }
            let leases = granted_to_a(&policy, None, now);
            let bot = Caller::new("a").with_instance("bot");
            let hit = spend_one(&leases, 3, &bot, at);
            assert_eq!(hit, spent, "instances limited: {limits_instances}");
            assert_eq!(leases.held().0, if spent { 8.0 } else { 9.0 });
        }
    }

    /// The store's clock (Redis's) may run ahead of the limiter's: a lease still ends when
    /// the window ends by the store's count, on the limiter's clock — early, never late.
    #[test]
    fn a_lease_ends_on_the_callers_clock_whatever_the_stores_says() {
        let now = 1_767_225_600_000_000;
        // Decided 300 ms ahead of the caller's clock, 50 ms before its window ends.
        assert_eq!(ends(&grant(now + 300_000, 50_000.0), now), now + 50_000);
        // Behind it: the same span from the caller's instant (it ends early).
        assert_eq!(ends(&grant(now - 300_000, 50_000.0), now), now + 50_000);
        // A long window: the lifetime ends it first.
        assert_eq!(ends(&grant(now, 1e12), now), now + LIFETIME_US);
    }
}
