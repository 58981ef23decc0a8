//! Refusals counted and kept for the console: by tool, tenant and reason, and the last
//! [`RECENT_REFUSALS`] of each tenant. Off until a console is made; bounded by the policy (one
//! tally per listed tenant, one per tool for every other caller).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;

use crate::admission::{Reason, Refusal};
use crate::clock::Timestamp;
use crate::identity::Caller;
use crate::policy::{LevelPolicy, Policy};

/// How many recent refusals the console keeps per tenant (per tool).
pub const RECENT_REFUSALS: usize = 64;

/// Every reason, in the order the console counts them.
const REASONS: [Reason; 6] = [
    Reason::RateLimited,
    Reason::CapExceeded,
    Reason::ConcurrencyExceeded,
    Reason::PermissionDenied,
    Reason::UnidentifiedCaller,
    Reason::StoreUnavailable,
];

/// Refusal counts by reason name, the reasons seen only.
pub(crate) fn by_reason(counts: [u64; REASONS.len()]) -> HashMap<&'static str, u64> {
    REASONS
        .iter()
        .zip(counts)
        .filter(|(_, n)| *n > 0)
        .map(|(r, n)| (r.as_str(), n))
        .collect()
}

fn reason_index(r: Reason) -> usize {
    REASONS.iter().position(|x| *x == r).unwrap_or(0)
}

/// The name a listed tenant or instance goes by on the console; `None`: every other caller
/// (`other`).
pub(crate) fn listed(p: Option<&LevelPolicy>) -> Option<&Arc<str>> {
    p.filter(|p| !p.template).map(|p| &p.name)
}

/// Why a call was, or would be, refused: the fields a kept refusal ([`RecentRefusal`]) and an
/// [`Explanation`](crate::console::Explanation) share.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
#[non_exhaustive]
pub struct Why {
    /// Why (`rate_limited`, `cap_exceeded`, `concurrency_exceeded`, ...).
    pub reason: Option<&'static str>,
    /// The level whose limit binds: `tool`, `tenant` or `instance`.
    pub binding: Option<&'static str>,
    /// The window of that limit (`1m`, `day`, `in_flight`, ...).
    pub window: Option<String>,
    /// The limit.
    pub limit: Option<f64>,
    /// What is used of it.
    pub used: Option<f64>,
    /// How long until the call could pass, ms: the `Retry-After` (absent when it never can,
    /// e.g. a cost above the limit).
    pub retry_after_ms: Option<u64>,
    /// When that is (RFC 3339): the earliest time the decision expects the call to pass if
    /// nothing else changes meanwhile.
    pub earliest: Option<String>,
    /// A wait the call surely cannot pass before, whatever else happens, ms (absent: none
    /// known).
    pub not_before_ms: Option<u64>,
}

impl Why {
    pub(crate) fn of(r: &Refusal, at: Timestamp) -> Why {
        Slim::of(r).why(at)
    }
}

/// What a kept refusal holds of a [`Refusal`]: not the caller's names.
struct Slim {
    reason: Reason,
    scope: Option<crate::Scope>,
    window: Option<std::sync::Arc<str>>,
    limit: Option<f64>,
    used: Option<f64>,
    retry_after: Option<std::time::Duration>,
    not_before: Option<std::time::Duration>,
}

impl Slim {
    fn of(r: &Refusal) -> Slim {
        Slim {
            reason: r.reason,
            scope: r.scope,
            window: r.window_shared(),
            limit: r.limit,
            used: r.used,
            retry_after: r.retry_after,
            not_before: r.not_before,
        }
    }

    fn why(&self, at: Timestamp) -> Why {
        Why {
            reason: Some(self.reason.as_str()),
            binding: self.scope.map(|s| s.as_str()),
            window: self.window.as_deref().map(str::to_owned),
            limit: self.limit,
            used: self.used,
            retry_after_ms: self.retry_after.map(|d| d.as_millis() as u64),
            earliest: self.retry_after.map(|d| at.saturating_add(d).to_rfc3339()),
            not_before_ms: self.not_before.map(|d| d.as_millis() as u64),
        }
    }
}

/// One refusal as the console keeps it ([`Console::recent_refusals`](crate::console::Console::recent_refusals)).
#[derive(Clone, Debug, Serialize, PartialEq)]
#[non_exhaustive]
pub struct RecentRefusal {
    /// When (RFC 3339).
    pub at: String,
    /// The instance, as the console names it: its name if the policy lists it, `other` if
    /// not, `none` for a caller without one.
    pub instance: String,
    /// Why.
    #[serde(flatten)]
    pub why: Why,
}

/// A refusal as it is kept: raw, so keeping it formats nothing.
struct Kept {
    at: Timestamp,
    instance: Option<Arc<str>>,
    has_instance: bool,
    refusal: Slim,
}

impl Kept {
    fn show(&self) -> RecentRefusal {
        RecentRefusal {
            at: self.at.to_rfc3339(),
            instance: match (&self.instance, self.has_instance) {
                (Some(name), _) => name.to_string(),
                (None, true) => "other".to_owned(),
                (None, false) => "none".to_owned(),
            },
            why: self.refusal.why(self.at),
        }
    }
}

#[derive(Default)]
struct Tally {
    by_reason: [u64; REASONS.len()],
    recent: VecDeque<Kept>,
}

impl Tally {
    fn keep(&mut self, k: Kept) {
        self.by_reason[reason_index(k.refusal.reason)] += 1;
        if self.recent.len() == RECENT_REFUSALS {
            self.recent.pop_back();
        }
        self.recent.push_front(k);
    }
}

/// One tool's tallies: a listed tenant's by its name, every other caller's together.
#[derive(Default)]
struct ToolTallies {
    named: HashMap<Arc<str>, Tally>,
    other: Tally,
}

impl ToolTallies {
    fn get(&self, tenant: Option<&str>) -> Option<&Tally> {
        match tenant {
            Some(t) => self.named.get(t),
            None => Some(&self.other),
        }
    }
}

/// Refusals counted and kept for the console (off until a console is made), by tool: as many
/// entries as the policy lists tenants, plus one per tool for everyone else.
#[derive(Default)]
pub(crate) struct Recorder {
    on: AtomicBool,
    tallies: Mutex<HashMap<Arc<str>, ToolTallies>>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("on", &self.on.load(Ordering::Relaxed))
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Recorder {
    pub(crate) fn start(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    /// Whether a console was made (what it shows is kept from then on).
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Counts and keeps a refusal of `caller` calling `tool` at `now` (a tool the policy
    /// does not know is not kept: it has no page). Off (one relaxed load) until a console is
    /// made.
    #[inline]
    pub(crate) fn refused(
        &self,
        policy: &Policy,
        caller: &Caller,
        tool: &str,
        r: &Refusal,
        now: impl FnOnce() -> Timestamp,
    ) {
        if self.on.load(Ordering::Relaxed) {
            self.keep(policy, caller, tool, r, now());
        }
    }

    fn keep(&self, policy: &Policy, caller: &Caller, tool: &str, r: &Refusal, at: Timestamp) {
        let Some(tp) = policy.tool(tool) else { return };
        let tenant_policy = caller.tenant().and_then(|t| tp.tenant(t));
        let instance = match (tenant_policy, caller.instance()) {
            (Some(p), Some(i)) if p.has_instances() => listed(p.instance(i)).cloned(),
            _ => None,
        };
        let kept = Kept {
            at,
            instance,
            has_instance: caller.instance().is_some(),
            refusal: Slim::of(r),
        };
        let mut tallies = lock(&self.tallies);
        let tool = match tallies.get_mut(tp.name()) {
            Some(t) => t,
            None => tallies.entry(tp.name_arc().clone()).or_default(),
        };
        match listed(tenant_policy) {
            Some(name) => match tool.named.get_mut(&**name) {
                Some(t) => t.keep(kept),
                None => tool.named.entry(name.clone()).or_default().keep(kept),
            },
            None => tool.other.keep(kept),
        }
    }

    /// Drops what was kept for tools and tenants `policy` no longer lists (on reload).
    pub(crate) fn retain(&self, policy: &Policy) {
        let mut tallies = lock(&self.tallies);
        tallies.retain(|tool, t| match policy.tool(tool) {
            None => false,
            Some(tp) => {
                t.named.retain(|name, _| listed(tp.tenant(name)).is_some());
                true
            }
        });
    }

    /// Refusals by reason of `tenant` (`None`: every caller the policy does not list).
    pub(crate) fn counts(&self, tool: &str, tenant: Option<&str>) -> [u64; REASONS.len()] {
        lock(&self.tallies)
            .get(tool)
            .and_then(|t| t.get(tenant))
            .map_or([0; REASONS.len()], |t| t.by_reason)
    }

    /// The refusals kept for `tenant`, newest first.
    pub(crate) fn recent(&self, tool: &str, tenant: Option<&str>) -> Vec<RecentRefusal> {
        lock(&self.tallies)
            .get(tool)
            .and_then(|t| t.get(tenant))
            .map_or_else(Vec::new, |t| t.recent.iter().map(Kept::show).collect())
    }
}
