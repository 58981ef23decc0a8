//! The local refusal cache: after a refusal that names a retry time, the same call on this
//! replica is refused without a Redis command until then, so a parasite's flood costs no
//! round trips.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::builder::TimeSource;
use crate::admission::engine::Plan;
use crate::admission::Refusal;
use crate::policy::ToolPolicy;
use crate::store::CallKeys;

#[derive(Debug)]
pub(super) struct RefusalCache {
    map: Mutex<HashMap<CallKeys, Cached>>,
    capacity: usize,
}

/// How many refusals are remembered between two sweeps of the expired ones.
const SWEEP_EVERY: usize = 256;

#[derive(Debug)]
struct Cached {
    refusal: Refusal,
    /// The policy it was decided under: a reload decides afresh.
    policy: Arc<ToolPolicy>,
    cost: f64,
    /// Injected clock: valid from `from` until `until` (µs of the plan's clock).
    from: u64,
    until: u64,
    /// Redis clock: valid until this local instant.
    until_instant: Instant,
}

impl RefusalCache {
    pub(super) fn new(capacity: usize) -> Self {
        RefusalCache {
            map: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<CallKeys, Cached>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers a refusal for as long as the same call surely cannot pass (see
    /// `Refusal::remember_for`; the refusal's own retry time is an estimate, which may be
    /// later).
    pub(super) fn remember(
        &self,
        keys: &CallKeys,
        plan: &Plan<'_>,
        r: &Refusal,
        sent: Instant,
        time: TimeSource,
    ) {
        let Some(wait) = r.remember_for(plan) else {
            return;
        };
        let now = plan.now.as_micros();
        let until = now.saturating_add(wait.as_micros() as u64);
        // Redis decided after `sent`, so `sent + wait` is never later than the true time.
        let until_instant = sent + wait;
        let mut map = self.lock();
        // Forget what has expired now and then, so the cache holds the callers refused now,
        // not every caller ever refused.
        if (map.len() >= self.capacity || map.len() % SWEEP_EVERY == SWEEP_EVERY - 1)
            && !map.contains_key(keys)
        {
            let now_i = Instant::now();
            map.retain(|_, c| {
                c.until_instant > now_i && (time == TimeSource::Redis || c.until > now)
            });
            if map.len() >= self.capacity {
                return;
            }
        }
        map.insert(
            keys.clone(),
            Cached {
                refusal: r.clone(),
                policy: plan.tool.clone(),
                cost: plan.cost,
                from: now,
                until,
                until_instant,
            },
        );
    }

    pub(super) fn lookup(
        &self,
        keys: &CallKeys,
        plan: &Plan<'_>,
        time: TimeSource,
    ) -> Option<Refusal> {
        let mut map = self.lock();
        let c = map.get(keys)?;
        let left = match time {
            TimeSource::Injected => {
                let now = plan.now.as_micros();
                (now >= c.from && now < c.until).then(|| Duration::from_micros(c.until - now))
            }
            TimeSource::Redis => c.until_instant.checked_duration_since(Instant::now()),
        };
        match left {
            Some(left) if !left.is_zero() => {
                if !Refusal::stands_for(&c.policy, c.cost, plan) {
                    return None;
                }
                Some(c.refusal.again(left))
            }
            _ => {
                map.remove(keys);
                None
            }
        }
    }

    /// Forgets the refusals whose time is over (on this host's clock), and gives the memory
    /// back when most of it is unused.
    pub(super) fn sweep(&self) {
        let now = Instant::now();
        let mut map = self.lock();
        map.retain(|_, c| c.until_instant > now);
        if map.capacity() > 4 * map.len().max(64) {
            map.shrink_to_fit();
        }
    }

    /// Forgets every refusal of `tool`: a refund there may let them pass sooner.
    pub(super) fn forget_tool(&self, tool: &str) {
        self.lock().retain(|k, _| &*k.tool != tool);
    }
}
