//! The local refusal cache: after a refusal that names a retry time, the same call on this
//! replica is refused without a Redis command until then, so a parasite's flood costs no
//! round trips.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::builder::TimeSource;
use crate::admission::engine::Plan;
use crate::admission::{Reason, Refusal};
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

    /// Remembers a refusal for `not_before`: the engine's lower bound of when the same call
    /// could pass (the refusal's own retry time is an estimate, which may be later).
    pub(super) fn remember(
        &self,
        keys: &CallKeys,
        plan: &Plan<'_>,
        r: &Refusal,
        not_before: Duration,
        sent: Instant,
        time: TimeSource,
    ) {
        // Only waits the script can bound: a concurrency slot or a template-caller slot can free
        // up at any moment.
        let cacheable = match r.reason {
            Reason::RateLimited => true,
            Reason::CapExceeded => r.window.as_deref() != Some("callers"),
            _ => false,
        };
        if !(cacheable && r.retryable && not_before >= Duration::from_millis(1)) {
            return;
        }
        // Concurrency is checked before rates: where a cap applies, a slot taken meanwhile
        // changes the answer, and only Redis knows.
        let capped = plan.tool.max_concurrency.is_some()
            || plan.tenant.policy.max_concurrency.is_some()
            || plan
                .instance
                .is_some_and(|i| i.policy.max_concurrency.is_some());
        if capped {
            return;
        }
        let wait = not_before;
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
                // The same call: a different cost may pass, or never pass.
                if (plan.cost - c.cost).abs() > crate::admission::engine::EPS {
                    return None;
                }
                let mut r = c.refusal.clone();
                r.retry_after = Some(left);
                Some(r)
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
