//! The in-process store: state in a sharded map, one short lock per shard a decision touches.

use std::collections::{BTreeSet, HashMap};
use std::future::{ready, Future};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

use foldhash::fast::RandomState;

use super::{Admission, CallKeys, Decision, Store, StoreError};
use crate::admission::engine::{self, NodeState, Snapshot, Tracking, Verdict};
use crate::admission::Plan;
use crate::clock::Timestamp;

/// Keeps admission state in this process.
///
/// State is spread over independently locked shards; a decision locks only the (at most
/// three) shards holding its tool, tenant and instance, always in ascending order, so there is
/// no global lock and no deadlock. Idle state is swept out once it is equivalent to fresh
/// state (buckets full, windows closed, no permits held), and template callers are bounded by
/// `max_tenants` / `max_instances`, so an identity flood cannot grow memory without limit.
///
/// ```
/// use tower_fairshare::MemoryStore;
/// let store = MemoryStore::new();
/// assert_eq!(store.len(), 0);
/// ```
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
}

/// A level's key: structured, so injective by construction, and built from the caller's
/// shared strings without allocating.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct NodeKey {
    kind: u8,
    tool: Arc<str>,
    tenant: Option<Arc<str>>,
    instance: Option<Arc<str>>,
}

fn node_keys(k: &CallKeys) -> [Option<NodeKey>; 3] {
    [
        Some(NodeKey {
            kind: 0,
            tool: k.tool.clone(),
            tenant: None,
            instance: None,
        }),
        Some(NodeKey {
            kind: if k.untenanted { 3 } else { 1 },
            tool: k.tool.clone(),
            tenant: Some(k.tenant.clone()),
            instance: None,
        }),
        k.instance.as_ref().map(|i| NodeKey {
            kind: 2,
            tool: k.tool.clone(),
            tenant: Some(k.tenant.clone()),
            instance: Some(i.clone()),
        }),
    ]
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<NodeKey, Entry, RandomState>,
    ops: u64,
}

#[derive(Debug)]
struct Entry {
    state: NodeState,
    expires: u64,
    tracker: Option<Tracker>,
}

/// Template children seen recently, with when each stops counting.
#[derive(Debug, Default)]
struct Tracker {
    by_member: HashMap<NodeKey, u64, RandomState>,
    by_expiry: BTreeSet<(u64, NodeKey)>,
}

impl Tracker {
    fn prune(&mut self, now: u64) {
        while let Some((at, _)) = self.by_expiry.first() {
            if *at > now {
                break;
            }
            let (_, m) = self.by_expiry.pop_first().expect("non-empty");
            self.by_member.remove(&m);
        }
    }

    fn tracking(&mut self, member: &NodeKey, now: u64) -> Tracking {
        self.prune(now);
        Tracking {
            count: self.by_member.len() as u64,
            tracked: self.by_member.contains_key(member),
        }
    }

    fn touch(&mut self, member: &NodeKey, until: u64) {
        match self.by_member.get_mut(member) {
            Some(old) if *old == until => {}
            Some(old) => {
                let member = self
                    .by_expiry
                    .take(&(*old, member.clone()))
                    .map_or_else(|| member.clone(), |(_, m)| m);
                *old = until;
                self.by_expiry.insert((until, member));
            }
            None => {
                self.by_member.insert(member.clone(), until);
                self.by_expiry.insert((until, member.clone()));
            }
        }
    }

    fn last(&self) -> u64 {
        self.by_expiry.last().map_or(0, |(at, _)| *at)
    }
}

const SWEEP_EVERY: u64 = 4096;

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
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
            shards: (0..n).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::default(),
        }
    }

    /// Number of levels (tools, tenants, instances) whose state is held now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).map.len()).sum()
    }

    /// Whether no state is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every state that is equivalent to fresh state at `now`. Runs by itself every few
    /// thousand decisions per shard; call it to bound memory at a moment of your choosing.
    pub fn sweep(&self, now: Timestamp) {
        for s in self.shards.iter() {
            sweep_shard(&mut lock(s), now.as_micros());
        }
    }

    fn shard_of(&self, key: &NodeKey) -> usize {
        (self.hasher.hash_one(key) as usize) & (self.shards.len() - 1)
    }

    /// Locks the shards of `keys` in ascending order and runs `f` with them.
    fn with_keys<R>(&self, keys: &[Option<NodeKey>; 3], f: impl FnOnce(&mut Locked<'_>) -> R) -> R {
        let idx = [
            keys[0].as_ref().map(|k| self.shard_of(k)),
            keys[1].as_ref().map(|k| self.shard_of(k)),
            keys[2].as_ref().map(|k| self.shard_of(k)),
        ];
        let mut order = [usize::MAX; 3];
        let mut n = 0;
        for i in idx.iter().flatten() {
            if !order[..n].contains(i) {
                order[n] = *i;
                n += 1;
            }
        }
        order[..n].sort_unstable();
        let mut guards: [Option<(usize, MutexGuard<'_, Shard>)>; 3] = [None, None, None];
        for (slot, &i) in guards.iter_mut().zip(&order[..n]) {
            *slot = Some((i, lock(&self.shards[i])));
        }
        let mut locked = Locked { guards, idx };
        f(&mut locked)
    }
}

fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard cannot leave a half-written decision: states are written
    // only after the pure decision returns. So a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn sweep_shard(s: &mut Shard, now: u64) {
    s.map.retain(|_, e| {
        e.expires > now
            || e.state.in_flight > 0.0
            || e.tracker.as_ref().is_some_and(|t| t.last() > now)
    });
}

struct Locked<'a> {
    guards: [Option<(usize, MutexGuard<'a, Shard>)>; 3],
    idx: [Option<usize>; 3],
}

impl Locked<'_> {
    fn shard(&mut self, level: usize) -> Option<&mut Shard> {
        let i = self.idx[level]?;
        self.guards
            .iter_mut()
            .flatten()
            .find(|(j, _)| *j == i)
            .map(|(_, g)| &mut **g)
    }
}

fn micros_ceil(x: f64) -> u64 {
    if x.is_finite() {
        x.max(0.0).ceil() as u64
    } else {
        u64::MAX
    }
}

impl MemoryStore {
    fn decide_now(&self, plan: &Plan<'_>, keys: &CallKeys) -> Decision {
        let encoded = node_keys(keys);
        let now = plan.now.as_micros();
        let tenant_key = encoded[1].clone().expect("a tenant level");
        let instance_key = encoded[2].clone();
        self.with_keys(&encoded, |l| {
            let mut snap = Snapshot::default();
            for (level, key) in encoded.iter().enumerate() {
                let Some(k) = key.as_ref() else {
                    continue;
                };
                let shard = l.shard(level).expect("locked");
                let e = shard.map.get_mut(k);
                let state = e.as_ref().map(|e| e.state.clone()).unwrap_or_default();
                match level {
                    0 => {
                        snap.tool = state;
                        if plan.tenant.policy.template {
                            snap.tenant_tracking = e
                                .and_then(|e| e.tracker.as_mut())
                                .map_or(Tracking::default(), |t| t.tracking(&tenant_key, now));
                        }
                    }
                    1 => {
                        snap.tenant = state;
                        if let (Some(i), Some(ik)) = (plan.instance, instance_key.as_ref()) {
                            if i.policy.template {
                                snap.instance_tracking = e
                                    .and_then(|e| e.tracker.as_mut())
                                    .map_or(Tracking::default(), |t| t.tracking(ik, now));
                            }
                        }
                    }
                    _ => snap.instance = state,
                }
            }
            match engine::decide(plan, &snap) {
                Verdict::Refuse(r) => Decision::Refused(r),
                Verdict::Admit(a) => {
                    let a = *a;
                    let states = [a.tool, a.tenant, a.instance];
                    for (level, state) in states.into_iter().enumerate() {
                        let Some(k) = encoded[level].as_ref() else {
                            continue;
                        };
                        let expires = micros_ceil(a.expires[level]);
                        let shard = l.shard(level).expect("locked");
                        shard.ops += 1;
                        let entry = match shard.map.get_mut(k) {
                            Some(e) => {
                                e.state = state;
                                e
                            }
                            None => shard.map.entry(k.clone()).or_insert(Entry {
                                state,
                                expires: 0,
                                tracker: None,
                            }),
                        };
                        entry.expires = expires;
                        let track = match level {
                            0 => a.track_tenant_until.map(|u| (&tenant_key, u)),
                            1 => a
                                .track_instance_until
                                .zip(instance_key.as_ref())
                                .map(|(u, k)| (k, u)),
                            _ => None,
                        };
                        if let Some((member, until)) = track {
                            entry
                                .tracker
                                .get_or_insert_with(Tracker::default)
                                .touch(member, micros_ceil(until));
                        }
                        if shard.ops % SWEEP_EVERY == 0 {
                            sweep_shard(shard, now);
                        }
                    }
                    Decision::Admitted(Box::new(Admission {
                        keys: keys.clone(),
                        charge: a.charge,
                        remaining: a.remaining,
                        quota: a.quota,
                        reset_in: a.reset_in,
                        slack: a.slack,
                        views: a.views,
                        at: plan.now,
                    }))
                }
            }
        })
    }

    fn update(&self, admission: &Admission, mut f: impl FnMut(usize, &mut NodeState)) {
        let encoded = node_keys(&admission.keys);
        self.with_keys(&encoded, |l| {
            for (level, key) in encoded.iter().enumerate() {
                let Some(k) = key.as_ref() else {
                    continue;
                };
                if let Some(e) = l.shard(level).and_then(|s| s.map.get_mut(k)) {
                    f(level, &mut e.state);
                }
            }
        });
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
        ready(Ok(self.decide_now(plan, keys)))
    }

    fn adjust<'a>(
        &'a self,
        admission: &'a Admission,
        factor: f64,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        self.update(admission, |level, s| {
            engine::adjust(s, &admission.charge, level, factor, now)
        });
        ready(Ok(()))
    }

    fn release<'a>(
        &'a self,
        admission: &'a Admission,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        self.update(admission, |level, s| {
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
        let encoded = node_keys(keys);
        let states = self.with_keys(&encoded, |l| {
            let mut out: [Option<NodeState>; 3] = Default::default();
            for (level, slot) in out.iter_mut().enumerate() {
                if let Some(k) = encoded[level].as_ref() {
                    *slot = l
                        .shard(level)
                        .and_then(|s| s.map.get(k))
                        .map(|e| e.state.clone());
                }
            }
            out
        });
        ready(Ok(states))
    }
}
