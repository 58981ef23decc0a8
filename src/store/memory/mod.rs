//! The in-process store: each tool's state, with its tenants', behind one short lock.

use std::hash::BuildHasher;
use std::sync::atomic::{
    AtomicU64,
    Ordering::{Relaxed, Release},
};
use std::sync::{Arc, Mutex, MutexGuard};

use foldhash::fast::RandomState;
use hashbrown::HashTable;

use super::{Admission, Admissions, Answer, CallKeys, Decision, Store};
use crate::admission::engine::{self, NodeState, Plan, PlanCounts, Snapshot, Stored};
use crate::clock::Timestamp;

mod instances;
mod memo;
mod packed;
mod together;
use instances::Instances;
use packed::Packed;

/// Keeps admission state in this process.
///
/// Tools are spread over independently locked shards by name, and each tool keeps its
/// tenants (with their instances inside them) in its own tables: a decision locks its tool's
/// shard, finds its tenant with one hash lookup and decides — one short lock, which every
/// decision of that tool needs anyway. Refusals the store remembers sit apart, under locks of
/// their own, so a caller looping on a refused call does not take its tool's lock. Idle state
/// is swept out once it is equivalent to fresh state (buckets full, windows closed, no permits
/// held, no longer counted as a template caller: the counts live in the parents' states), a
/// part of a tool's tenants every few thousand decisions, and template callers are bounded by
/// `max_tenants` / `max_instances`, so an identity flood cannot grow memory without limit.
///
/// ```
/// use tower_fairshare::MemoryStore;
/// let store = MemoryStore::new();
/// assert_eq!(store.len(), 0);
/// ```
pub struct MemoryStore {
    shards: Box<[Padded<Mutex<Shard>>]>,
    /// Refusals remembered (see [`MemoryStore::refusal_cache`]).
    memo: memo::Memo,
    hasher: RandomState,
    /// Whether refusals with a sure wait are remembered.
    remember: bool,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .field("states", &self.len())
            .finish()
    }
}

/// A value on cache lines of its own, so threads locking neighbours do not share one.
#[repr(align(128))]
struct Padded<T>(T);

/// The tools whose names fall in one shard (most shards hold one or none).
#[derive(Default)]
struct Shard {
    tools: Vec<ToolEntry>,
}

impl Shard {
    /// The entry of the tool `name`, added on first use.
    fn tool(&mut self, name: &str) -> &mut ToolEntry {
        match self.tools.iter().position(|t| *t.name == *name) {
            Some(at) => &mut self.tools[at],
            None => {
                self.tools.push(ToolEntry::new(name));
                self.tools.last_mut().expect("just pushed")
            }
        }
    }

    /// The entry of the tool `name`, if it was ever called.
    fn find(&mut self, name: &str) -> Option<&mut ToolEntry> {
        self.tools.iter_mut().find(|t| *t.name == *name)
    }
}

/// One tool's state and its tenants'.
struct ToolEntry {
    name: Box<str>,
    state: NodeState,
    /// Its unlisted tenants counted per plan (they expire with its state).
    plans: PlanCounts,
    expires: u64,
    /// The tool's period (µs) as of the last decision: a packed state's window is worked out
    /// with it when it is read outside a decision.
    period: f64,
    /// How many times units or permits were given back to the tool or below it (refunds,
    /// corrections, releases): a refusal remembered before one may no longer stand. Read by
    /// the memo without this entry's lock.
    given_back: Arc<AtomicU64>,
    /// Its tenants, spread over a few tables by hash (each swept, and grown, on its own).
    tenants: [HashTable<Box<TenantEntry>>; TABLES],
    /// Decisions made, for sweeping.
    ops: u64,
}

/// Tables of tenants per tool.
const TABLES: usize = 16;
const SWEEP_EVERY: u64 = 4096;

impl ToolEntry {
    fn new(name: &str) -> Self {
        ToolEntry {
            name: name.into(),
            state: NodeState::default(),
            plans: PlanCounts::default(),
            expires: 0,
            period: 1.0,
            given_back: Arc::new(AtomicU64::new(0)),
            tenants: Default::default(),
            ops: 0,
        }
    }

    /// The table a tenant of hash `hash` is kept in.
    fn table(&mut self, hash: u64) -> &mut HashTable<Box<TenantEntry>> {
        &mut self.tenants[table_index(hash)]
    }

    /// Counts a decision; every [`SWEEP_EVERY`] decisions, sweeps one table in turn.
    fn count(&mut self, now: u64) {
        self.ops += 1;
        if self.ops.is_multiple_of(SWEEP_EVERY) {
            let at = (self.ops / SWEEP_EVERY) as usize % TABLES;
            self.tenants[at].retain(|t| !t.sweep(now));
        }
    }

    /// Levels whose state is held: the tool's, its tenants' and their instances'.
    fn len(&self) -> usize {
        let tenants = self.tenants.iter().flat_map(|t| t.iter());
        usize::from(self.state.live) + tenants.map(|t| 1 + t.instances.len()).sum::<usize>()
    }

    /// Drops every state equivalent to fresh state at `now`.
    fn sweep(&mut self, now: u64) {
        for t in &mut self.tenants {
            t.retain(|t| !t.sweep(now));
        }
        if self.state.live && self.expires <= now && self.state.in_flight <= 0.0 {
            (self.state, self.plans, self.expires) = Default::default();
        }
    }
}

/// A tenant (or an untenanted caller) of one tool, with its instances: packed states, each
/// holding its name.
struct TenantEntry {
    state: Packed,
    /// Sorted by name; one is held inline.
    instances: Instances,
}

impl TenantEntry {
    fn is(&self, tenant: &str, untenanted: bool) -> bool {
        self.state.untenanted() == untenanted && self.state.name() == tenant.as_bytes()
    }

    /// Drops idle instances; whether the tenant itself can go.
    fn sweep(&mut self, now: u64) -> bool {
        self.instances.retain(|i| alive(i, now));
        !alive(&self.state, now) && self.instances.is_empty()
    }
}

/// Whether a stored state still differs from a fresh one: its expiry (from the engine) covers
/// the buckets, the windows, the budgets and the template counts; permits held are counted
/// apart.
fn alive(p: &Packed, now: u64) -> bool {
    p.expires() > now || p.in_flight() > 0.0
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

/// Where a call's states are: its tool's hash (which picks the shard) and its tenant's (in
/// that tool's tables).
#[derive(Clone, Copy)]
struct Place {
    tool: u64,
    tenant: u64,
}

impl Place {
    fn of(h: &RandomState, tool: &str, tenant: &str, untenanted: bool) -> Place {
        Place {
            tool: h.hash_one(tool),
            tenant: hash_tenant(h, tenant, untenanted),
        }
    }

    /// The tag a refusal of this place's call from `instance` is remembered under.
    fn tag(&self, h: &RandomState, instance: Option<&str>) -> u64 {
        memo::tag(h.hash_one((self.tool, self.tenant, instance)))
    }
}

fn hash_tenant(h: &RandomState, tenant: &str, untenanted: bool) -> u64 {
    h.hash_one((tenant, untenanted))
}

impl MemoryStore {
    /// A store with one shard per 4 hardware threads' worth of contention headroom (at
    /// least 16 shards).
    pub fn new() -> Self {
        let n = std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .saturating_mul(4)
            .next_power_of_two()
            .max(16);
        Self::with_shards(n)
    }

    /// A store with `n` shards (rounded up to a power of two).
    pub fn with_shards(n: usize) -> Self {
        let n = n.max(1).next_power_of_two();
        MemoryStore {
            shards: (0..n).map(|_| Padded(Mutex::default())).collect(),
            memo: memo::Memo::new(n),
            hasher: RandomState::default(),
            remember: true,
        }
    }

    /// Whether to remember refusals (default on). After a refusal whose wait the engine can
    /// bound — a rate or a calendar budget, on a path without a concurrency cap — the same
    /// call (same caller, tool, cost and policy) is refused from memory until that sure wait
    /// is over, without being decided again: a caller that loops on a refused call costs a
    /// lookup per call. Anything given back to the tool (a refund, a correction downwards, a
    /// permit or a lease returned) forgets the tool's remembered refusals, and a reload
    /// decides afresh, so no call is refused that a decision would admit. A remembered
    /// refusal carries the reason and figures of the first one and the time left of its sure
    /// wait as `retry_after`; a decision made now might name another limit (a sibling spent
    /// the tenant's budget meanwhile) and a later estimate.
    ///
    /// ```
    /// use tower_fairshare::MemoryStore;
    /// let store = MemoryStore::new().refusal_cache(false);
    /// # let _ = store;
    /// ```
    pub fn refusal_cache(mut self, on: bool) -> Self {
        self.remember = on;
        self
    }

    /// Number of levels (tools, tenants, instances) whose state is held now.
    pub fn len(&self) -> usize {
        let tools =
            |s: &Padded<Mutex<Shard>>| lock(&s.0).tools.iter().map(ToolEntry::len).sum::<usize>();
        self.shards.iter().map(tools).sum::<usize>()
    }

    /// Whether no state is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every state that is equivalent to fresh state at `now`. Runs by itself, a part of
    /// a tool's tenants every few thousand decisions; call it to bound memory at a moment of
    /// your choosing.
    pub fn sweep(&self, now: Timestamp) {
        let now = now.as_micros();
        for s in self.shards.iter() {
            lock(&s.0).tools.iter_mut().for_each(|t| t.sweep(now));
        }
        self.memo.sweep(now);
    }

    /// The shard of the tool whose name hashes to `hash`.
    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        &self.shards[self.shard_index(hash)].0
    }

    fn shard_index(&self, hash: u64) -> usize {
        (hash >> 40) as usize & (self.shards.len() - 1)
    }

    /// Decides one call: a remembered refusal given again, or the engine run on its tool's,
    /// tenant's and instance's states under the tool's shard lock, written back if it admits.
    fn decide_now(&self, plan: &Plan<'_>) -> Decision {
        let (tool, tenant, untenanted) = (plan.tool.name(), &**plan.tenant.name, plan.untenanted);
        let at = Place::of(&self.hasher, tool, tenant, untenanted);
        let instance = plan.instance.map(|i| &**i.name);
        let looks = self.remember && self.memo.holds_any();
        let tag = || at.tag(&self.hasher, instance);
        if let Some(r) = looks.then(tag).and_then(|tag| self.memo.recall(tag, plan)) {
            return Decision::Refused(r);
        }
        let mut shard = lock(self.shard(at.tool));
        let entry = shard.tool(tool);
        entry.count(plan.now.as_micros());
        entry.period = plan.tool.period.as_micros() as f64;
        let count = entry.given_back.load(Relaxed);
        match decide_in(entry, &self.hasher, at.tenant, plan) {
            Ok(admission) => Decision::Admitted(Admissions::one(admission)),
            Err(r) => {
                if self.remember {
                    self.memo
                        .remember(tag(), plan, &entry.given_back, count, &r);
                }
                Decision::Refused(r)
            }
        }
    }

    /// Runs `f` on each stored level of `keys` (0 tool, 1 tenant, 2 instance), writing back
    /// what it changed.
    fn update(&self, keys: &CallKeys, mut f: impl FnMut(usize, &mut NodeState)) {
        let at = Place::of(&self.hasher, &keys.tool, &keys.tenant, keys.untenanted);
        let mut shard = lock(self.shard(at.tool));
        let Some(tool) = shard.find(&keys.tool) else {
            return;
        };
        let before = tool.state;
        if tool.state.live {
            f(0, &mut tool.state);
        }
        let mut changed = tool.state != before;
        let period = tool.period;
        let table = tool.table(at.tenant);
        if let Some(entry) = table.find_mut(at.tenant, |e| e.is(&keys.tenant, keys.untenanted)) {
            let mut each = |level: usize, p: &mut Packed| {
                let before = p.state(period);
                let mut s = before;
                f(level, &mut s);
                if s != before {
                    p.store(&s, p.expires(), period);
                    changed = true;
                }
            };
            each(1, &mut entry.state);
            if let Some(name) = keys.instance.as_deref() {
                if let Ok(at) = entry.instances.find(name) {
                    each(2, &mut entry.instances.as_mut_slice()[at]);
                }
            }
        }
        // Counted once the change is in place: a remembered refusal read against the count
        // after this is forgotten.
        if changed {
            tool.given_back.fetch_add(1, Release);
        }
    }
}

/// Decides `plan` on its states in its tool's `entry` (its tenant's hash: `hash`); admitted,
/// every state is written back (its tenant added if new) and the answer returned.
fn decide_in(
    entry: &mut ToolEntry,
    hasher: &RandomState,
    hash: u64,
    plan: &Plan<'_>,
) -> Result<Arc<Admission>, crate::Refusal> {
    let period = entry.period;
    let ToolEntry {
        state,
        plans,
        expires,
        tenants,
        ..
    } = entry;
    let table = &mut tenants[table_index(hash)];
    let found = table.find_mut(hash, |e| e.is(plan.tenant.name, plan.untenanted));
    let slot = found
        .as_deref()
        .and_then(|e| plan.instance.map(|i| e.instances.find(i.name)));
    let mut snap = stored(found.as_deref().map(|e| &**e), slot, period);
    (snap.tool, snap.plans) = (*state, *plans);
    let admitted = engine::decide(plan, &mut snap)?;
    let ends = admitted.expires.map(micros_ceil);
    (*state, *plans, *expires) = (snap.tool, snap.plans, ends[0]);
    match found {
        Some(e) => write_back(e, plan, &snap, slot, ends, period),
        None => add_tenant(table, hasher, hash, plan, &snap, ends, period),
    }
    Ok(admitted.admission)
}

/// A call's tenant and instance states as stored in its tenant's `entry`, its instance at
/// `slot` (fresh where none is); the tool's are the caller's to fill in.
fn stored(
    entry: Option<&TenantEntry>,
    slot: Option<Result<usize, usize>>,
    period: f64,
) -> Snapshot {
    let instance = match (entry, slot) {
        (Some(e), Some(Ok(at))) => Some(&e.instances.as_slice()[at]),
        _ => None,
    };
    Snapshot {
        tool: NodeState::default(),
        tenant: Packed::state_of(entry.map(|e| &e.state), period),
        instance: Packed::state_of(instance, period),
        plans: PlanCounts::default(),
    }
}

/// Adds to `table` the entry of a tenant new there (of `hash`), with the states an admitted
/// call left it and its instance.
fn add_tenant(
    table: &mut HashTable<Box<TenantEntry>>,
    hasher: &RandomState,
    hash: u64,
    plan: &Plan<'_>,
    snap: &Snapshot,
    expires: [u64; 3],
    period: f64,
) {
    let (name, untenanted) = (plan.tenant.name, plan.untenanted);
    let state = Packed::new(name, untenanted, &snap.tenant, expires[1], period);
    let mut entry = Box::new(TenantEntry {
        state,
        instances: Instances::None,
    });
    write_back(&mut entry, plan, snap, None, expires, period);
    table.insert_unique(hash, entry, |e| {
        hash_tenant(hasher, tenant_name(e), e.state.untenanted())
    });
}

/// Writes an admitted call's tenant and instance states into its tenant's `entry`; `slot`
/// is where its instance is or goes (`None`: the tenant is new).
fn write_back(
    entry: &mut TenantEntry,
    plan: &Plan<'_>,
    snap: &Snapshot,
    slot: Option<Result<usize, usize>>,
    [_, tenant, instance]: [u64; 3],
    period: f64,
) {
    entry.state.store(&snap.tenant, tenant, period);
    let Some(i) = plan.instance else {
        return;
    };
    match slot {
        Some(Ok(at)) => entry.instances.as_mut_slice()[at].store(&snap.instance, instance, period),
        _ => {
            let at = entry.instances.find(i.name).unwrap_or_else(|at| at);
            let p = Packed::new(i.name, false, &snap.instance, instance, period);
            entry.instances.insert(at, p);
        }
    }
}

/// The table of a tool's tenants that a tenant of hash `hash` is kept in: its high bits (a
/// table indexes by others).
fn table_index(hash: u64) -> usize {
    (hash >> 40) as usize % TABLES
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock cannot leave a half-written decision: states are written
    // only after the pure decision returns. So a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `x` µs rounded up; `u64::MAX` (never) past some 285,000 years, or when not a number.
fn micros_ceil(x: f64) -> u64 {
    if x.is_nan() || x >= 9.0e18 {
        return u64::MAX;
    }
    x.max(0.0).ceil() as u64
}

/// A stored tenant's name (written from a `&str`, so valid UTF-8).
fn tenant_name(e: &TenantEntry) -> &str {
    std::str::from_utf8(e.state.name()).unwrap_or_default()
}

/// Whether `k` are the keys of the call `plan` makes.
fn keys_of(k: &CallKeys, plan: &Plan<'_>) -> bool {
    let instance = plan.instance.map(|i| &**i.name);
    k.are(
        plan.tool.name(),
        plan.tenant.name,
        instance,
        plan.untenanted,
    )
}

impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn decide(&self, plans: &[Plan<'_>]) -> Answer<Decision> {
        Answer::Now(Ok(match plans {
            [plan] => self.decide_now(plan),
            plans => together::decide(self, plans),
        }))
    }

    fn adjust(&self, admission: &Arc<Admission>, factor: f64, now: Timestamp) -> Answer<()> {
        self.update(&admission.keys, |level, s| {
            engine::adjust(s, &admission.charge, level, factor, now)
        });
        Answer::Now(Ok(()))
    }

    fn release(&self, admission: &Arc<Admission>) -> Answer<()> {
        self.update(&admission.keys, |level, s| {
            if admission.charge.levels[level].permit {
                engine::release(s);
            }
        });
        Answer::Now(Ok(()))
    }

    fn inspect(&self, keys: &CallKeys) -> Answer<Stored> {
        let mut out = Stored::default();
        self.update(keys, |level, s| out.levels[level] = Some(*s));
        let hash = self.hasher.hash_one(&*keys.tool);
        if let Some(tool) = lock(self.shard(hash)).find(&keys.tool) {
            out.plans = tool.plans;
        }
        Answer::Now(Ok(out))
    }
}

#[cfg(test)]
mod tests;
