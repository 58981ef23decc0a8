//! The local refusal cache: after a refusal that names a retry time, the same call on this
//! replica is refused without a Redis command until then, so a runaway caller's flood costs no
//! round trips.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use super::builder::TimeSource;
use crate::admission::engine::Plan;
use crate::admission::{Kept, Refusal};
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
    /// Injected clock: valid for the times it keeps.
    kept: Kept,
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
        let Some(kept) = Kept::new(r, plan) else {
            return;
        };
        let now = plan.now.as_micros();
        // Redis decided after `sent`, so `sent + wait` is never later than the true time.
        let until_instant = sent + kept.wait();
        let mut map = self.lock();
        // Forget what has expired now and then, so the cache holds the callers refused now,
        // not every caller ever refused.
        if (map.len() >= self.capacity || map.len() % SWEEP_EVERY == SWEEP_EVERY - 1)
            && !map.contains_key(keys)
        {
            let now_i = Instant::now();
            map.retain(|_, c| {
                c.until_instant > now_i && (time == TimeSource::Redis || c.kept.until() > now)
            });
            if map.len() >= self.capacity {
                return;
            }
        }
        map.insert(
            keys.clone(),
            Cached {
                kept,
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
            TimeSource::Injected => c.kept.left_at(plan.now),
            TimeSource::Redis => c.until_instant.checked_duration_since(Instant::now()),
        };
        match left {
            Some(left) if !left.is_zero() => {
                if !c.kept.stands_for(plan) {
                    return None;
                }
                Some(c.kept.again(left))
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

    /// Forgets every refusal of the tools of `slot` (a group, or a tool alone): a refund
    /// there may let them pass sooner.
    pub(super) fn forget_slot(&self, slot: &str) {
        self.lock().retain(|k, _| &**k.slot() != slot);
    }
}
