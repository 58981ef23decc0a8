//! The in-process store: state in a sharded map, one short lock per shard a decision touches.

use std::future::{ready, Future};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{
    AtomicU32, AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwap;
use foldhash::fast::RandomState;
use hashbrown::HashTable;

use super::{Admission, CallKeys, Decision, Store, StoreError};
use crate::admission::engine::{self, NodeState, Plan};
use crate::admission::Refusal;
use crate::clock::Timestamp;
use crate::key::{same_bytes, same_name};

mod instances;
mod memo;
mod packed;
use instances::Instances;
use packed::Packed;

/// Keeps admission state in this process.
///
/// Tenants (with their instances inside them) are spread over independently locked shards;
/// each tool's state sits behind a lock of its own that every tenant entry points to. A
/// decision locks its tenant's shard, then its tool: one hash lookup, two short locks, no
/// global lock and no lock-order cycle. Idle state is swept out once it is equivalent to fresh
/// state (buckets full, windows closed, no permits held, no longer counted as a template
/// caller: the counts live in the parents' states), and template callers are bounded by `max_tenants` / `max_instances`, so an
/// identity flood cannot grow memory without limit.
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

/// A value on cache lines of its own.
#[repr(align(128))]
struct Line<T>(T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

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
    /// The count of template tenants (kept in the tool's state), published after each
    /// decision under the lock, read without it as a first guess. On its own line: the lock's
    /// line moves between threads on every decision, this one only when the count changes.
    published: Line<[AtomicU32; 1 + crate::policy::MAX_PLANS]>,
    /// The tool's period (µs, as `f64` bits) as of the last decision: a packed state's window
    /// is worked out with it when it is read outside a decision.
    period: AtomicU64,
    /// How many times units or permits were given back to the tool or below it (refunds,
    /// corrections, releases): a refusal remembered before one may no longer stand.
    given_back: AtomicU64,
    inner: Line<Mutex<ToolEntry>>,
}

#[derive(Default)]
struct ToolEntry {
    state: NodeState,
    expires: u64,
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
            && same_bytes(self.state.name(), tenant.as_bytes())
            && same_name(&self.tool.name, tool)
    }

    /// Drops idle instances; whether the tenant itself can go.
    fn sweep(&mut self, now: u64) -> bool {
        self.instances.retain(|i| alive(i, now));
        !alive(&self.state, now) && self.instances.is_empty()
    }
}

/// The cell of the tool `name`, if it has one.
fn find_tool<'t>(tools: &'t [Arc<ToolCell>], name: &str) -> Option<&'t Arc<ToolCell>> {
    tools.iter().find(|c| *c.name == *name)
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
    let mut s = h.build_hasher();
    tool.hash(&mut s);
    tenant.hash(&mut s);
    untenanted.hash(&mut s);
    s.finish()
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
        let tools = self
            .tools
            .load()
            .iter()
            .filter(|t| lock(&t.inner).state.live)
            .count();
        tenants + tools
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
                t.state = NodeState::default();
            }
        }
    }

    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        // High bits: the table inside the shard indexes by the low ones.
        &self.shards[(hash >> 40) as usize & (self.shards.len() - 1)].0
    }

    /// The cell of `tool`, created on first use.
    fn tool_cell(&self, tool: &str) -> Arc<ToolCell> {
        if let Some(c) = find_tool(&self.tools.load(), tool) {
            return c.clone();
        }
        let _adding = self.adding_tool.lock().unwrap_or_else(|e| e.into_inner());
        let tools = self.tools.load_full();
        if let Some(c) = find_tool(&tools, tool) {
            return c.clone();
        }
        let cell = Arc::new(ToolCell {
            name: Arc::from(tool),
            published: Line(Default::default()),
            period: AtomicU64::new(1f64.to_bits()),
            given_back: AtomicU64::new(0),
            inner: Line(Mutex::new(ToolEntry::default())),
        });
        let mut next = Vec::with_capacity(tools.len() + 1);
        next.extend(tools.iter().cloned());
        next.push(cell.clone());
        self.tools.store(Arc::new(next));
        cell
    }
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

/// Publishes the tool's count of template tenants; written only when it moved, so the cache
/// line is not dirtied on every decision.
fn publish(cell: &ToolCell, plan: &Plan<'_>, counted: engine::Counted) {
    for (p, &n) in cell
        .published
        .iter()
        .zip(counted.slots(1 + plan.tool.plans.len()))
    {
        if p.load(Relaxed) != n {
            p.store(n, Relaxed);
        }
    }
}

/// The counts [`publish`] last published for `plan`'s tool.
fn published(cell: &ToolCell, plan: &Plan<'_>) -> engine::Counted {
    let mut counts = [0u32; 1 + crate::policy::MAX_PLANS];
    let n = 1 + plan.tool.plans.len();
    for (c, p) in counts[..n].iter_mut().zip(cell.published.iter()) {
        *c = p.load(Relaxed);
    }
    engine::Counted::of(&counts[..n])
}

/// `x` µs rounded up; `u64::MAX` (never) past some 285,000 years, or when not a number.
fn micros_ceil(x: f64) -> u64 {
    if x.is_nan() || x >= 9.0e18 {
        return u64::MAX;
    }
    // The cast truncates; one more when that dropped a fraction. Cheaper than `f64::ceil`,
    // which is a library call on baseline x86-64, and through `i64` (one instruction there;
    // `as u64` takes a dozen).
    let t = x.max(0.0) as i64;
    (t + i64::from((t as f64) < x)) as u64
}

/// The tool's period in µs, as the engine counts it.
fn period_of(plan: &Plan<'_>) -> f64 {
    plan.tool.period.as_micros() as f64
}

/// A call's keys as the store is handed them: lent, or named by the plan (made only for an
/// answer to keep, or a refusal to remember).
#[derive(Copy, Clone)]
enum Keys<'a> {
    Lent(&'a CallKeys),
    Planned(&'a Plan<'a>),
}

impl Keys<'_> {
    fn tool(&self) -> &str {
        match self {
            Keys::Lent(k) => &k.tool,
            Keys::Planned(p) => p.tool.name(),
        }
    }

    fn tenant(&self) -> &str {
        match self {
            Keys::Lent(k) => &k.tenant,
            Keys::Planned(p) => p.tenant.name,
        }
    }

    fn instance(&self) -> Option<&str> {
        match self {
            Keys::Lent(k) => k.instance.as_deref(),
            Keys::Planned(p) => p.instance.as_ref().map(|i| &**i.name),
        }
    }

    fn untenanted(&self) -> bool {
        match self {
            Keys::Lent(k) => k.untenanted,
            Keys::Planned(p) => p.untenanted,
        }
    }

    /// Whether `k` are these keys.
    fn are(&self, k: &CallKeys) -> bool {
        k.untenanted == self.untenanted()
            && same_name(&k.tenant, self.tenant())
            && match (k.instance.as_deref(), self.instance()) {
                (Some(a), Some(b)) => same_name(a, b),
                (a, b) => a.is_none() && b.is_none(),
            }
            && same_name(&k.tool, self.tool())
    }

    /// The keys, for an answer or a remembered refusal to keep.
    fn keep(self) -> CallKeys {
        match self {
            Keys::Lent(k) => k.clone(),
            Keys::Planned(p) => p.keys(),
        }
    }
}

/// Decides a call with the tenant's and the instance's states unpacked (fresh when not
/// stored). Locks the tool. Admitted: the states are written (the tool's in its cell) and the
/// tenant's and the instance's expiries come back with the admission.
fn decide_on(
    cell: &ToolCell,
    tenant_state: &mut NodeState,
    inst_state: Option<&mut NodeState>,
    plan: &Plan<'_>,
    keys: Keys<'_>,
) -> Result<(Arc<Admission>, [u64; 2]), Refusal> {
    // Everything below the tool is worked out before the tool is locked, with the tool's
    // count of template tenants as last published; under the lock, the count is checked and
    // the first half redone in the rare case it moved. The tool's lock is held only for the
    // tool's own part.
    // Every tenant's share depends on how many template tenants count (listed ones too).
    let templates = plan.tool.has_templates();
    let guess = if templates {
        published(cell, plan)
    } else {
        engine::Counted::default()
    };
    // Never at a time before the states' own (see `engine::decided_at`).
    let below_states: &[&NodeState] = match inst_state.as_deref() {
        Some(i) => &[&*tenant_state, i],
        None => &[&*tenant_state],
    };
    let mut plan = Plan {
        now: engine::decided_at(plan.now, below_states),
        ..*plan
    };
    let plan = &mut plan;
    let mut below = engine::Below::new();
    engine::below(&mut below, plan, tenant_state, inst_state.as_deref(), guess);
    let mut tool = lock(&cell.inner);
    let ToolEntry {
        state: tool_state,
        expires: tool_expires,
    } = &mut *tool;
    let later = engine::decided_at(plan.now, &[&*tool_state]);
    if later != plan.now {
        plan.now = later;
        engine::below(&mut below, plan, tenant_state, inst_state.as_deref(), guess);
    }
    if templates {
        let actual = below.tenants_counted_in(plan, tool_state);
        if actual != guess {
            engine::below(
                &mut below,
                plan,
                tenant_state,
                inst_state.as_deref(),
                actual,
            );
        }
    }
    let mut top = engine::Top::default();
    if let Err(r) = engine::above(plan, &mut below, tool_state, &mut top) {
        if templates {
            publish(cell, plan, below.tenants_counted());
        }
        return Err(r);
    }
    *tool_expires = micros_ceil(top.expires());
    if templates {
        publish(cell, plan, below.tenants_counted_in(plan, tool_state));
    }
    drop(tool);
    // The answer, filled in below (a fresh record: nothing else holds it, so no copy).
    let mut shared = Arc::new(Admission::blank(keys.keep(), plan.now));
    let a = Arc::make_mut(&mut shared);
    let expires = engine::commit_below(
        plan,
        &mut below,
        &top,
        tenant_state,
        inst_state,
        engine::Report {
            charge: &mut a.charge,
            remaining: &mut a.remaining,
            quota: &mut a.quota,
            reset_in: &mut a.reset_in,
            slack: &mut a.slack,
            views: &mut a.views,
        },
    );
    Ok((shared, [micros_ceil(expires[1]), micros_ceil(expires[2])]))
}

/// Decides a call of a tenant whose packed state is `tenant` (`None`: not stored) with its
/// `instances`, and writes the states back if it is admitted. A fresh tenant's packed state
/// comes back to be stored.
fn decide_packed(
    cell: &ToolCell,
    tenant: Option<&mut Packed>,
    instances: &mut Instances,
    plan: &Plan<'_>,
    keys: Keys<'_>,
) -> (Result<Arc<Admission>, Refusal>, Option<Packed>) {
    let period = period_of(plan);
    let mut states = [NodeState::default(), NodeState::default()];
    let [tenant_state, inst_state] = &mut states;
    if let Some(p) = tenant.as_deref() {
        p.read(tenant_state, period);
    }
    let slot = match (plan.instance.is_some(), keys.instance()) {
        (true, Some(name)) => Some(instances.find(name)),
        _ => None,
    };
    if let Some(Ok(at)) = slot {
        instances.as_slice()[at].read(inst_state, period);
    }
    let (admission, expires) = match decide_on(
        cell,
        tenant_state,
        slot.is_some().then_some(&mut *inst_state),
        plan,
        keys,
    ) {
        Ok(a) => a,
        Err(refused) => return (Err(refused), None),
    };
    // The keys are the answer's now.
    let keys = &admission.keys;
    let fresh = match tenant {
        Some(p) => {
            p.store(tenant_state, expires[0], period);
            None
        }
        None => Some(Packed::new(
            &keys.tenant,
            keys.untenanted,
            tenant_state,
            expires[0],
            period,
        )),
    };
    match (slot, keys.instance.as_deref()) {
        (Some(Ok(at)), _) => instances.as_mut_slice()[at].store(inst_state, expires[1], period),
        (Some(Err(at)), Some(name)) => {
            instances.insert(at, Packed::new(name, false, inst_state, expires[1], period))
        }
        _ => {}
    }
    (Ok(admission), fresh)
}

impl MemoryStore {
    /// Decides at once: the memory store never waits.
    pub(crate) fn decide_sync(&self, plan: &Plan<'_>, keys: &CallKeys) -> Decision {
        self.decide_keys(plan, Keys::Lent(keys))
    }

    /// Decides at once, with the keys lent or named by the plan.
    fn decide_keys(&self, plan: &Plan<'_>, keys: Keys<'_>) -> Decision {
        let now = plan.now.as_micros();
        let (tool_name, tenant, untenanted) = (keys.tool(), keys.tenant(), keys.untenanted());
        let hash = hash_tenant(&self.hasher, tool_name, tenant, untenanted);
        // Where the call's refusal is remembered (its instance hashed only when needed).
        let set = || memo::set_of(hash, keys.instance().map_or(0, |i| self.hasher.hash_one(i)));
        let mut shard = lock(self.shard(hash));
        let shard = &mut *shard;
        if self.remember && shard.memo.holds_any() {
            if let Some(r) = shard.memo.recall(set(), plan, |k| keys.are(k)) {
                return Decision::Refused(r);
            }
        }
        shard.ops += 1;
        if shard.ops.is_multiple_of(SWEEP_EVERY) {
            sweep_shard(shard, now);
        }
        // The store's answer: the admission, or the refusal, remembered when it may be
        // (`given_back`: the tool's count read before the call was decided).
        let answer = |decided: Result<Arc<Admission>, Refusal>,
                      memo: &mut memo::Memo,
                      cell: &Arc<ToolCell>,
                      given_back: u64| match decided {
            Ok(a) => Decision::Admitted(a),
            Err(r) => {
                if self.remember {
                    let same = |k: &CallKeys| keys.are(k);
                    memo.remember(set, plan, same, || keys.keep(), cell, given_back, &r);
                }
                Decision::Refused(r)
            }
        };
        let found = shard
            .tenants
            .find_mut(hash, |e| e.is(tool_name, tenant, untenanted));
        if let Some(entry) = found {
            let TenantEntry {
                tool,
                state,
                instances,
            } = &mut **entry;
            note_period(tool, plan);
            let given_back = tool.given_back.load(Acquire);
            let decided = decide_packed(tool, Some(state), instances, plan, keys).0;
            return answer(decided, &mut shard.memo, tool, given_back);
        }
        let tool = self.tool_cell(tool_name);
        note_period(&tool, plan);
        let given_back = tool.given_back.load(Acquire);
        let mut instances = Instances::None;
        let (decided, fresh) = decide_packed(&tool, None, &mut instances, plan, keys);
        let decision = answer(decided, &mut shard.memo, &tool, given_back);
        if let Some(state) = fresh {
            let hasher = &self.hasher;
            let entry = Box::new(TenantEntry {
                tool,
                state,
                instances,
            });
            shard.tenants.insert_unique(hash, entry, |e| {
                hash_tenant(hasher, &e.tool.name, tenant_name(e), e.state.untenanted())
            });
        }
        decision
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
                let mut s = NodeState::default();
                p.read(&mut s, period);
                let before = s;
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

/// A stored tenant's name (written from a `&str`, so valid UTF-8).
fn tenant_name(e: &TenantEntry) -> &str {
    std::str::from_utf8(e.state.name()).unwrap_or_default()
}

/// Remembers the tool's period for reading packed states outside a decision.
fn note_period(cell: &ToolCell, plan: &Plan<'_>) {
    let bits = period_of(plan).to_bits();
    if cell.period.load(Relaxed) != bits {
        cell.period.store(bits, Relaxed);
    }
}

impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn decide<'a>(
        &'a self,
        plan: &'a Plan<'a>,
        keys: &'a CallKeys,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + 'a {
        ready(Ok(self.decide_sync(plan, keys)))
    }

    fn decide_now(&self, plan: &Plan<'_>, keys: &CallKeys) -> Option<Result<Decision, StoreError>> {
        Some(Ok(self.decide_sync(plan, keys)))
    }

    fn decide_now_planned(&self, plan: &Plan<'_>) -> Option<Result<Decision, StoreError>> {
        Some(Ok(self.decide_keys(plan, Keys::Planned(plan))))
    }

    fn adjust<'a>(
        &'a self,
        admission: &'a Admission,
        factor: f64,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        ready(self.adjust_now(admission, factor, now).unwrap_or(Ok(())))
    }

    fn adjust_now(
        &self,
        admission: &Admission,
        factor: f64,
        now: Timestamp,
    ) -> Option<Result<(), StoreError>> {
        self.update(&admission.keys, |level, s| {
            engine::adjust(s, &admission.charge, level, factor, now)
        });
        Some(Ok(()))
    }

    fn release<'a>(
        &'a self,
        admission: &'a Admission,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        self.update(&admission.keys, |level, s| {
            if admission.charge.levels[level].permit {
                engine::release(s);
            }
        });
        ready(Ok(()))
    }

    fn inspect<'a>(
        &'a self,
        keys: &'a CallKeys,
    ) -> impl Future<Output = Result<[Option<NodeState>; 3], StoreError>> + Send + 'a {
        let mut out: [Option<NodeState>; 3] = Default::default();
        self.update(keys, |level, s| out[level] = Some(*s));
        ready(Ok(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::engine::LevelRef;

    /// A policy with one tool `t` at `rate` whose tenants a template governs (at most ten),
    /// with `tenant` added to the template.
    fn tool_t(rate: &str, tenant: &str) -> crate::Policy {
        crate::Policy::from_toml_str(&format!(
            "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = {{ {rate} }}\n\
             [tool.default_tenant]\nmax_tenants = 10\n{tenant}"
        ))
        .expect("valid")
    }

    /// Two calls whose hashes pick the same set are both remembered (one in each of its
    /// slots); a third takes the slot of the refusal whose wait ends first.
    #[test]
    fn calls_that_meet_in_a_set_are_remembered_side_by_side() {
        let policy = tool_t("limit = 60, per = \"1m\"", "");
        let tool = policy.tool("t").expect("listed");
        let store = MemoryStore::new();
        let cell = store.tool_cell("t");
        let names: Vec<Arc<str>> = ["a", "b", "c"].into_iter().map(Arc::from).collect();
        let plans: Vec<Plan<'_>> = names
            .iter()
            .map(|n| Plan {
                now: Timestamp(1_767_225_600_000_000),
                cost: 1.0,
                tool,
                tenant: LevelRef {
                    name: n,
                    policy: tool.tenant(n).expect("the template"),
                },
                instance: None,
                untenanted: false,
            })
            .collect();
        let mut memo = memo::Memo::default();
        // Waits of 3 s, 2 s and 5 s.
        for (p, secs) in plans.iter().zip([3, 2, 5]) {
            let mut r = Refusal::new(crate::Reason::RateLimited, "t");
            r.retryable = true;
            r.not_before = Some(std::time::Duration::from_secs(secs));
            let keys = Keys::Planned(p);
            memo.remember(|| 7, p, |k| keys.are(k), || keys.keep(), &cell, 0, &r);
            if secs == 2 {
                let first = Keys::Planned(&plans[0]);
                assert!(
                    memo.recall(7, &plans[0], |k| first.are(k)).is_some(),
                    "a stays"
                );
                assert!(memo.recall(7, p, |k| keys.are(k)).is_some(), "b beside it");
            }
        }
        let mut recalled = |p: &Plan<'_>| {
            let keys = Keys::Planned(p);
            memo.recall(7, p, |k| keys.are(k)).is_some()
        };
        assert!(recalled(&plans[0]), "a's wait ends last of the two: kept");
        assert!(
            !recalled(&plans[1]),
            "b's wait ended first: its slot went to c"
        );
        assert!(recalled(&plans[2]));
    }

    /// A refused call with a sure wait is remembered and the same call answered from memory
    /// until that wait is over (its time left as `retry_after`); a store told not to
    /// remembers nothing and decides every call.
    #[test]
    fn a_refusal_with_a_sure_wait_is_remembered_for_that_wait() {
        let policy = tool_t("limit = 60, per = \"1m\"", "ceiling = 1\nburst = 1\n");
        let tool = policy.tool("t").expect("listed");
        let name = Arc::from("a");
        let plan_at = |us: u64| Plan {
            now: Timestamp(1_767_225_600_000_000 + us),
            cost: 1.0,
            tool,
            tenant: LevelRef {
                name: &name,
                policy: tool.tenant("a").expect("the template"),
            },
            instance: None,
            untenanted: false,
        };
        let keys = CallKeys {
            tool: Arc::from("t"),
            tenant: name.clone(),
            instance: None,
            untenanted: false,
        };
        let remembered = |s: &MemoryStore| s.shards.iter().any(|p| lock(&p.0).memo.holds_any());
        for on in [true, false] {
            let store = MemoryStore::new().refusal_cache(on);
            assert!(matches!(
                store.decide_sync(&plan_at(0), &keys),
                Decision::Admitted(_)
            ));
            let Decision::Refused(first) = store.decide_sync(&plan_at(0), &keys) else {
                panic!("a ceiling of 1: refused");
            };
            let sure = first.not_before.expect("a rate refusal has a sure wait");
            assert!(sure >= std::time::Duration::from_millis(1), "{sure:?}");
            assert_eq!(remembered(&store), on);
            let Decision::Refused(again) = store.decide_sync(&plan_at(1_000), &keys) else {
                panic!("within the sure wait: refused");
            };
            if on {
                assert_eq!(
                    again.retry_after,
                    Some(sure - std::time::Duration::from_millis(1))
                );
                assert_eq!((again.reason, again.scope), (first.reason, first.scope));
            }
        }
    }

    /// The keys a plan names are the ones the answer keeps, and find the same records as keys
    /// lent; a store that cannot answer at once answers nothing for a plan either.
    #[test]
    fn the_keys_a_plan_names_are_kept_by_the_answer() {
        let policy = tool_t("limit = 2, per = \"1s\"", "");
        let tool = policy.tool("t").expect("listed");
        let plan = Plan {
            now: Timestamp(1_767_225_600_000_000),
            cost: 1.0,
            tool,
            tenant: LevelRef {
                name: &Arc::from("a"),
                policy: tool.tenant("a").expect("the template"),
            },
            instance: None,
            untenanted: false,
        };
        let keys = CallKeys {
            tool: Arc::from("t"),
            tenant: Arc::from("a"),
            instance: None,
            untenanted: false,
        };
        let store = MemoryStore::new();
        assert_eq!(plan.keys(), keys);
        match store.decide_now_planned(&plan) {
            Some(Ok(Decision::Admitted(a))) => assert_eq!(a.keys, keys),
            _ => panic!("admitted at once"),
        }
        // The same tenant's record, whichever way the keys came: the second of two calls in a
        // limit of 2 is admitted, the third refused.
        assert!(matches!(
            store.decide_now(&plan, &keys),
            Some(Ok(Decision::Admitted(_)))
        ));
        assert!(matches!(
            store.decide_now_planned(&plan),
            Some(Ok(Decision::Refused(_)))
        ));

        /// A store that always needs I/O, with the trait's own `decide_now_planned`.
        struct Remote;
        impl Store for Remote {
            fn decide<'a>(
                &'a self,
                _: &'a Plan<'a>,
                _: &'a CallKeys,
            ) -> impl Future<Output = Result<Decision, StoreError>> + Send + 'a {
                ready(Err(StoreError::Unavailable("never at once".into())))
            }
            fn adjust<'a>(
                &'a self,
                _: &'a Admission,
                _: f64,
                _: Timestamp,
            ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
                ready(Ok(()))
            }
            fn release<'a>(
                &'a self,
                _: &'a Admission,
            ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
                ready(Ok(()))
            }
            fn inspect<'a>(
                &'a self,
                _: &'a CallKeys,
            ) -> impl Future<Output = Result<[Option<NodeState>; 3], StoreError>> + Send + 'a
            {
                ready(Ok([None, None, None]))
            }
        }
        assert!(
            Remote.decide_now_planned(&plan).is_none(),
            "a store that needs I/O answers nothing at once"
        );
    }
}
