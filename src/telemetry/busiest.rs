//! The busiest unlisted callers of each tool, by name: the tenants (and instances) a template
//! governs that decide the most calls, admitted or refused, so that the metrics and the
//! console can name a noisy neighbour among thousands of tenants that come from tokens,
//! while every other unlisted caller stays `other`.
//!
//! Each tool keeps 40 counters (the Space-Saving algorithm: a caller not counted takes
//! the smallest counter and inherits its count as its possible over-count), halved every
//! [`AGE_SECS`] seconds of the limiter's clock. A caller is *named* while it is among the
//! [`K`] largest and at least [`MIN_CALLS`] of its decisions (and 1 % of the tool's, over the
//! same aging) are surely its own. A flood of new identities, each calling a few times, never
//! reaches that: it names nobody, and adds no label value.
//!
//! Counting costs a decision nothing in the common case: a caller is reported only each time
//! its use in the window crosses a multiple of [`STEP`] units, and each [`STEP`]th refusal of
//! it in a window, with that weight; callers that never get that busy never touch the board.
//! The names in force are a snapshot read without a lock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Callers of a tool named at once at most.
pub const K: usize = 10;
/// Counters kept per tool.
const SLOTS: usize = 4 * K;
/// Decisions a caller must surely have had (over the aging) to be named.
pub const MIN_CALLS: f64 = 32.0;
/// Every this many seconds, every count halves.
pub const AGE_SECS: u64 = 60;
/// A caller is reported once per this many units used, and per this many refusals.
pub const STEP: f64 = 16.0;

/// Which board of a tool: template tenants, or template instances (of any tenant).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Tenant,
    Instance,
}

type Key = (Arc<str>, Option<Arc<str>>);

/// One busy caller, as the console shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BusyCaller {
    /// The tenant.
    pub tenant: String,
    /// The instance (for a template instance).
    pub instance: Option<String>,
    /// Its decisions, aged (halved every minute), at most this many more than it had.
    pub decisions: f64,
    /// Of which refused.
    pub refused: f64,
}

#[derive(Default, Debug)]
pub(crate) struct Busiest {
    tools: Mutex<HashMap<(Arc<str>, u8), Board>>,
    /// The callers named now, of every tool: read by every decision that needs a label.
    named: arc_swap::ArcSwap<Vec<Named>>,
}

/// A caller named at a tool.
#[derive(Clone, Debug, PartialEq)]
struct Named {
    tool: Arc<str>,
    kind: Kind,
    key: Key,
}

#[derive(Debug, Default)]
struct Board {
    aged_at: u64,
    total: f64,
    slots: Vec<Slot>,
    index: HashMap<Key, usize>,
}

#[derive(Debug)]
struct Slot {
    key: Key,
    count: f64,
    refused: f64,
    over: f64,
}

impl Busiest {
    /// Counts `decisions` decisions of an unlisted caller at `tool` (`refused` of them
    /// refusals), at `secs` of the limiter's clock, and renews the names in force.
    pub(crate) fn report(
        &self,
        tool: &Arc<str>,
        kind: Kind,
        key: (&Arc<str>, Option<&Arc<str>>),
        [decisions, refused]: [f64; 2],
        secs: u64,
    ) {
        let mut tools = self.tools.lock().unwrap_or_else(|e| e.into_inner());
        let board = tools.entry((tool.clone(), kind as u8)).or_default();
        let aged = board.age(secs);
        let at = board.slot_of((key.0.clone(), key.1.cloned()));
        let slot = &mut board.slots[at];
        slot.count += decisions;
        slot.refused += refused;
        board.total += decisions;
        // The names in force change when this caller's standing does, or with the aging;
        // others' standings are renewed at their own next report.
        let (tenant, instance): (&str, Option<&str>) = (key.0, key.1.map(|i| &**i));
        if !aged && board.named(at) == self.is_named(tool, kind, (tenant, instance)) {
            return;
        }
        let mut named: Vec<Named> = self
            .named
            .load()
            .iter()
            .filter(|n| !(n.tool == *tool && n.kind == kind))
            .cloned()
            .collect();
        named.extend(
            (0..board.slots.len())
                .filter(|&i| board.named(i))
                .map(|i| Named {
                    tool: tool.clone(),
                    kind,
                    key: board.slots[i].key.clone(),
                }),
        );
        self.named.store(Arc::new(named));
    }

    /// Whether this caller is named at `tool` now (no lock: the snapshot of the last report).
    pub(crate) fn is_named(
        &self,
        tool: &str,
        kind: Kind,
        (tenant, instance): (&str, Option<&str>),
    ) -> bool {
        let named = self.named.load();
        !named.is_empty()
            && named.iter().any(|n| {
                n.kind == kind
                    && &*n.tool == tool
                    && &*n.key.0 == tenant
                    && n.key.1.as_deref() == instance
            })
    }

    /// The callers named now at `tool`, busiest first.
    pub(crate) fn named(&self, tool: &str, kind: Kind, secs: u64) -> Vec<BusyCaller> {
        let mut tools = self.tools.lock().unwrap_or_else(|e| e.into_inner());
        let Some(board) = tools.get_mut(&(Arc::from(tool), kind as u8)) else {
            return Vec::new();
        };
        board.age(secs);
        let mut out: Vec<(f64, BusyCaller)> = (0..board.slots.len())
            .filter(|&i| board.named(i))
            .map(|i| {
                let s = &board.slots[i];
                let caller = BusyCaller {
                    tenant: s.key.0.to_string(),
                    instance: s.key.1.as_deref().map(str::to_owned),
                    decisions: s.count,
                    refused: s.refused,
                };
                (s.count, caller)
            })
            .collect();
        out.sort_by(|a, b| b.0.total_cmp(&a.0));
        out.into_iter().map(|(_, c)| c).collect()
    }

    /// Forgets the tools the policy no longer has.
    pub(crate) fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut tools = self.tools.lock().unwrap_or_else(|e| e.into_inner());
        tools.retain(|(tool, _), _| keep(tool));
        let named = self.named.load();
        if named.iter().any(|n| !keep(&n.tool)) {
            let kept = named.iter().filter(|n| keep(&n.tool)).cloned().collect();
            self.named.store(Arc::new(kept));
        }
    }
}

impl Board {
    /// Halves every count once per [`AGE_SECS`] passed since the last aging; whether it did.
    fn age(&mut self, secs: u64) -> bool {
        let steps = secs.saturating_sub(self.aged_at) / AGE_SECS;
        if steps == 0 {
            return false;
        }
        self.aged_at += steps * AGE_SECS;
        let f = 0.5f64.powi(steps.min(64) as i32);
        self.total *= f;
        for s in &mut self.slots {
            s.count *= f;
            s.refused *= f;
            s.over *= f;
        }
        true
    }

    /// The counter of `key`: its own, a new one while there are fewer than [`SLOTS`], else the
    /// smallest, taken over (its count stays, as what the new caller may be over-counted by).
    fn slot_of(&mut self, key: Key) -> usize {
        if let Some(&at) = self.index.get(&key) {
            return at;
        }
        if self.slots.len() < SLOTS {
            self.slots.push(Slot {
                key: key.clone(),
                count: 0.0,
                refused: 0.0,
                over: 0.0,
            });
            self.index.insert(key, self.slots.len() - 1);
            return self.slots.len() - 1;
        }
        let at = (0..self.slots.len())
            .min_by(|&a, &b| self.slots[a].count.total_cmp(&self.slots[b].count))
            .unwrap_or(0);
        let s = &mut self.slots[at];
        self.index.remove(&s.key);
        s.key = key.clone();
        s.over = s.count;
        s.refused = 0.0;
        self.index.insert(key, at);
        at
    }

    /// Whether the caller at slot `at` is named: among the [`K`] largest, and surely busy.
    fn named(&self, at: usize) -> bool {
        let s = &self.slots[at];
        let sure = s.count - s.over;
        if sure < MIN_CALLS || sure < 0.01 * self.total {
            return false;
        }
        // Ties go to the counter kept longest (the lower slot).
        let ahead = self
            .slots
            .iter()
            .enumerate()
            .filter(|(i, o)| o.count > s.count || (o.count == s.count && *i < at))
            .count();
        ahead < K
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    /// A heavy hitter among thousands of one-call identities is named within its first
    /// hundred calls; the identities never are; an idle caller ages out.
    #[test]
    fn a_heavy_hitter_is_named_and_a_flood_is_not() {
        let b = Busiest::default();
        let tool = name("t");
        let heavy = name("heavy");
        let mut named_at = None;
        for k in 0..10_000u64 {
            let id = name(&format!("id-{k}"));
            b.report(&tool, Kind::Tenant, (&id, None), [1.0, 0.0], k / 1000);
            assert!(
                !b.is_named("t", Kind::Tenant, (&id, None)),
                "a one-call identity named at {k}"
            );
            if k % 10 == 0 {
                b.report(&tool, Kind::Tenant, (&heavy, None), [1.0, 1.0], k / 1000);
                if b.is_named("t", Kind::Tenant, ("heavy", None)) {
                    named_at.get_or_insert(k);
                }
            }
        }
        assert!(named_at.is_some_and(|k| k < 2_000), "{named_at:?}");
        let named = b.named("t", Kind::Tenant, 10);
        assert_eq!(named.len(), 1, "{named:?}");
        assert_eq!(named[0].tenant, "heavy");
        assert!(named[0].refused > 0.0);
        // Ten minutes idle: its count has halved ten times.
        assert!(b.named("t", Kind::Tenant, 10 + 600).is_empty());
    }

    /// At most K named at once, whatever the number of busy callers.
    #[test]
    fn at_most_k_are_named() {
        let b = Busiest::default();
        let tool = name("t");
        let callers: Vec<Arc<str>> = (0..3 * K).map(|i| name(&format!("busy-{i}"))).collect();
        for _ in 0..100 {
            for c in &callers {
                b.report(&tool, Kind::Tenant, (c, None), [1.0, 0.0], 0);
            }
        }
        assert!(b.named("t", Kind::Tenant, 0).len() <= K);
    }
}
