//! The in-process store: state in a sharded map, one short lock per shard a decision touches.

use std::hash::BuildHasher;
use std::sync::atomic::{
    AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwap;
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
/// Tenants (with their instances inside them) are spread over independently locked shards;
/// each tool's state sits behind a lock of its own that every tenant entry points to. A
/// decision finds its tenant with one hash lookup, locks its shard, then its tool: two short
/// locks, no global lock and no lock-order cycle. Idle state is swept out once it is
/// equivalent to fresh state (buckets full, windows closed, no permits held, no longer counted
/// as a template caller: the counts live in the parents' states), and template callers are
/// bounded by `max_tenants` / `max_instances`, so an identity flood cannot grow memory without
/// limit.
///
/// ```
/// use tower_fairshare::MemoryStore;
/// let store = MemoryStore::new();
/// assert_eq!(store.len(), 0);
/// ```
pub struct MemoryStore {
    shards: Box<[Padded]>,
    tools: ArcSwap<Vec<Arc<ToolCell>>>,
    /// Serialises adding a tool (rare: once per tool name).
    adding_tool: Mutex<()>,
    hasher: RandomState,
    /// Whether refusals with a sure wait are remembered (see [`MemoryStore::refusal_cache`]).
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

/// A shard on a cache line of its own, so threads locking neighbouring shards do not share one.
#[repr(align(128))]
struct Padded(Mutex<Shard>);

#[derive(Default)]
struct Shard {
    tenants: HashTable<Box<TenantEntry>>,
    ops: u64,
    /// Refusals remembered for the calls of this shard's tenants.
    memo: memo::Memo,
}

/// One tool's state.
struct ToolCell {
    name: Arc<str>,
    /// The tool's period (µs, as `f64` bits) as of the last decision: a packed state's window
    /// is worked out with it when it is read outside a decision.
    period: AtomicU64,
    /// How many times units or permits were given back to the tool or below it (refunds,
    /// corrections, releases): a refusal remembered before one may no longer stand.
    given_back: AtomicU64,
    inner: Mutex<ToolEntry>,
}

#[derive(Default)]
struct ToolEntry {
    state: NodeState,
    /// Its unlisted tenants counted per plan (they expire with its state).
    plans: PlanCounts,
    expires: u64,
}

impl ToolEntry {
    /// Puts the tool's state (and counts) in `snap`, for a call to be decided on.
    fn read_into(&self, snap: &mut Snapshot) {
        (snap.tool, snap.plans) = (self.state, self.plans);
    }

    /// Keeps the tool's state (and counts) as `call` committed them to `snap`.
    fn write_from(&mut self, snap: &Snapshot, call: &engine::Deciding<'_, '_>) {
        (self.state, self.plans) = (snap.tool, snap.plans);
        self.expires = micros_ceil(call.tool_expires());
    }
}

/// A tenant (or an untenanted caller) of one tool, with its instances: packed states, each
/// holding its name.
struct TenantEntry {
    tool: Arc<ToolCell>,
    state: Packed,
    /// Sorted by name; one is held inline.
    instances: Instances,
}

impl TenantEntry {
    fn is(&self, tool: &str, tenant: &str, untenanted: bool) -> bool {
        self.state.untenanted() == untenanted
            && self.state.name() == tenant.as_bytes()
            && *self.tool.name == *tool
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

const SWEEP_EVERY: u64 = 4096;

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

fn hash_tenant(h: &RandomState, tool: &str, tenant: &str, untenanted: bool) -> u64 {
    h.hash_one((tool, tenant, untenanted))
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
            shards: (0..n)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect(),
            tools: ArcSwap::from_pointee(Vec::new()),
            adding_tool: Mutex::new(()),
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
        let tenants: usize = self
            .shards
            .iter()
            .map(|s| {
                let s = lock(&s.0);
                s.tenants
                    .iter()
                    .map(|t| 1 + t.instances.len())
                    .sum::<usize>()
            })
            .sum();
        let tools = self.tools.load();
        let live = tools.iter().filter(|t| lock(&t.inner).state.live).count();
        tenants + live
    }

    /// Whether no state is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every state that is equivalent to fresh state at `now`. Runs by itself every few
    /// thousand decisions per shard; call it to bound memory at a moment of your choosing.
    pub fn sweep(&self, now: Timestamp) {
        let now = now.as_micros();
        for s in self.shards.iter() {
            sweep_shard(&mut lock(&s.0), now);
        }
        for t in self.tools.load().iter() {
            let mut t = lock(&t.inner);
            if t.state.live && t.expires <= now && t.state.in_flight <= 0.0 {
                *t = ToolEntry::default();
            }
        }
    }

    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        &self.shards[self.shard_index(hash)].0
    }

    /// The shard a tenant's hash falls in: its high bits (the table inside the shard indexes
    /// by the low ones).
    fn shard_index(&self, hash: u64) -> usize {
        (hash >> 40) as usize & (self.shards.len() - 1)
    }

    /// Adds the entry of a tenant new to `shard` (of `hash`, on the tool `cell`), with the
    /// states an admitted call left it and its instance.
    #[allow(clippy::too_many_arguments)]
    fn add_tenant(
        &self,
        shard: &mut Shard,
        hash: u64,
        cell: Arc<ToolCell>,
        plan: &Plan<'_>,
        snap: &Snapshot,
        expires: [u64; 3],
        period: f64,
    ) {
        let state = Packed::new(
            plan.tenant.name,
            plan.untenanted,
            &snap.tenant,
            expires[1],
            period,
        );
        let mut entry = Box::new(TenantEntry {
            tool: cell,
            state,
            instances: Instances::None,
        });
        write_back(&mut entry, plan, snap, None, expires, period);
        let hasher = &self.hasher;
        shard.tenants.insert_unique(hash, entry, |e| {
            hash_tenant(hasher, &e.tool.name, tenant_name(e), e.state.untenanted())
        });
    }

    /// The cell of `tool`, created on first use.
    fn tool_cell(&self, tool: &str) -> Arc<ToolCell> {
        if let Some(c) = find_tool(&self.tools.load(), tool) {
            return c.clone();
        }
        let _adding = lock(&self.adding_tool);
        let tools = self.tools.load_full();
        if let Some(c) = find_tool(&tools, tool) {
            return c.clone();
        }
        let cell = Arc::new(ToolCell {
            name: Arc::from(tool),
            period: AtomicU64::new(1f64.to_bits()),
            given_back: AtomicU64::new(0),
            inner: Mutex::new(ToolEntry::default()),
        });
        let mut next = Vec::with_capacity(tools.len() + 1);
        next.extend(tools.iter().cloned());
        next.push(cell.clone());
        self.tools.store(Arc::new(next));
        cell
    }

    /// Decides one call: its tenant found with one lookup (with its instances in it), a
    /// remembered refusal given again, or the engine run on the states under the tool's lock
    /// and written back if it admits.
    fn decide_now(&self, plan: &Plan<'_>) -> Decision {
        let (tool, tenant, untenanted) = (plan.tool.name(), &**plan.tenant.name, plan.untenanted);
        let hash = hash_tenant(&self.hasher, tool, tenant, untenanted);
        // The memo's set of the call, worked out only when a refusal is looked for or kept.
        let set = || {
            let instance_hash = plan.instance.map_or(0, |i| self.hasher.hash_one(&**i.name));
            memo::set_of(hash, instance_hash)
        };
        let mut shard = lock(self.shard(hash));
        let shard = &mut *shard;
        if self.remember && shard.memo.holds_any() {
            if let Some(r) = shard.memo.recall(set(), plan) {
                return Decision::Refused(r);
            }
        }
        shard.ops += 1;
        if shard.ops.is_multiple_of(SWEEP_EVERY) {
            sweep_shard(shard, plan.now.as_micros());
        }
        let found = shard
            .tenants
            .find_mut(hash, |e| e.is(tool, tenant, untenanted));
        // The tool's cell: its tenant's (borrowed), or a new tenant's (made on first use).
        let new_cell;
        let cell = match &found {
            Some(entry) => &entry.tool,
            None => {
                new_cell = self.tool_cell(tool);
                &new_cell
            }
        };
        let period = note_period(cell, plan);
        let entry = found.as_deref().map(|e| &**e);
        let slot = entry.and_then(|e| plan.instance.map(|i| e.instances.find(i.name)));
        let mut snap = stored(entry, slot, period);
        let given_back = cell.given_back.load(Acquire);
        match decide_under(cell, plan, &mut snap) {
            Ok(admitted) => {
                let expires = admitted.expires.map(micros_ceil);
                match found {
                    Some(entry) => write_back(entry, plan, &snap, slot, expires, period),
                    None => {
                        let cell = cell.clone();
                        self.add_tenant(shard, hash, cell, plan, &snap, expires, period)
                    }
                }
                Decision::Admitted(Admissions::one(admitted.admission))
            }
            Err(r) => {
                if self.remember {
                    shard.memo.remember(set(), plan, cell, given_back, &r);
                }
                Decision::Refused(r)
            }
        }
    }

    /// Runs `f` on each stored level of `keys` (0 tool, 1 tenant, 2 instance), writing back
    /// what it changed.
    fn update(&self, keys: &CallKeys, mut f: impl FnMut(usize, &mut NodeState)) {
        let hash = hash_tenant(&self.hasher, &keys.tool, &keys.tenant, keys.untenanted);
        let mut shard = lock(self.shard(hash));
        let entry = shard
            .tenants
            .find_mut(hash, |e| e.is(&keys.tool, &keys.tenant, keys.untenanted));
        let cell = match &entry {
            Some(e) => Some(e.tool.clone()),
            None => find_tool(&self.tools.load(), &keys.tool).cloned(),
        };
        let Some(cell) = cell else {
            return;
        };
        let mut changed = false;
        {
            let mut tool = lock(&cell.inner);
            if tool.state.live {
                let before = tool.state;
                f(0, &mut tool.state);
                changed = tool.state != before;
            }
        }
        if let Some(entry) = entry {
            let period = f64::from_bits(cell.period.load(Relaxed));
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
        // Counted once the change is in place: a decision that reads the count after this
        // sees the change, and one that read it before remembers nothing past it.
        if changed {
            cell.given_back.fetch_add(1, Release);
        }
    }
}

/// A call's tenant and instance states as stored in its tenant's `entry`, its instance at
/// `slot` (fresh where none is); the tool's is read under its lock.
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

/// Decides `plan` on `snap`, its states read, checked and written under the tool's lock;
/// admitted, the tool's state is written, and the call's answer made once the lock is let
/// go (callers of one tool wait for each other only while its state is worked on).
fn decide_under(
    cell: &ToolCell,
    plan: &Plan<'_>,
    snap: &mut Snapshot,
) -> Result<engine::Admitted, crate::Refusal> {
    let mut tool = lock(&cell.inner);
    tool.read_into(snap);
    let mut call = engine::Deciding::new(plan, snap);
    call.commit(snap)?;
    tool.write_from(snap, &call);
    drop(tool);
    Ok(call.answer(snap))
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

/// Notes the tool's period for reading packed states outside a decision; the period.
fn note_period(cell: &ToolCell, plan: &Plan<'_>) -> f64 {
    let period = plan.tool.period.as_micros() as f64;
    if cell.period.load(Relaxed) != period.to_bits() {
        cell.period.store(period.to_bits(), Relaxed);
    }
    period
}

/// The cell of the tool `name`, if it has one.
fn find_tool<'t>(tools: &'t [Arc<ToolCell>], name: &str) -> Option<&'t Arc<ToolCell>> {
    tools.iter().find(|c| *c.name == *name)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock cannot leave a half-written decision: states are written
    // only after the pure decision returns. So a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn sweep_shard(s: &mut Shard, now: u64) {
    s.tenants.retain(|t| !t.sweep(now));
    s.memo.sweep(now);
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
        if let Some(cell) = find_tool(&self.tools.load(), &keys.tool) {
            out.plans = lock(&cell.inner).plans;
        }
        Answer::Now(Ok(out))
    }
}

#[cfg(test)]
mod tests;
