//! What this replica admitted at each level of a tool in the windows still open: the counters
//! it writes back when Redis loses the tool's state (a restart without persistence, a flush).
//!
//! Every replica keeps its own ledger of what its landed writes counted — window counters and
//! budget counters, level by level — so that after a loss the live replicas together put back
//! everything they admitted, each its own part, once. What a replica that died with Redis had
//! admitted is lost with it: that is the bound a budget can be exceeded by.

use std::collections::HashMap;

use crate::admission::engine::{
    aligned_window, count_in_window, roll_window, BudgetCounter, Charge, NodeState,
};
use crate::clock::Timestamp;

/// The most levels one tool's ledger counts; past it, new levels are not counted (their part
/// is not restored after a loss).
const LEDGER_MAX: usize = 100_000;

/// One level's counts: the counters of its record this replica added to, and the tool's
/// period they are counted in.
#[derive(Clone, Debug, Default)]
struct Counted {
    counters: NodeState,
    period_us: f64,
}

/// What this replica's landed writes counted at each level (by record key) in the windows
/// still open.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    levels: HashMap<String, Counted>,
    /// How many levels it held after it last forgot closed windows.
    kept: usize,
}

impl Ledger {
    /// Counts an admitted call's `charge` at `level`, whose record is `key`, in the tool's
    /// period (µs).
    pub(super) fn admitted(&mut self, key: &str, charge: &Charge, level: usize, period_us: f64) {
        if !self.levels.contains_key(key) && self.levels.len() >= LEDGER_MAX {
            return;
        }
        let c = self.levels.entry(key.to_owned()).or_default();
        c.period_us = period_us;
        count(&mut c.counters, charge, level, 1.0);
    }

    /// Counts a correction of an admitted call (`factor` × its charge at `level`: a refund, a
    /// settled cost) at the level whose record is `key`, if it is counted.
    pub(super) fn corrected(&mut self, key: &str, charge: &Charge, level: usize, factor: f64) {
        if let Some(c) = self.levels.get_mut(key) {
            count(&mut c.counters, charge, level, factor);
        }
    }

    /// Forgets the levels whose every window has closed by `now`, once the ledger has doubled
    /// since it last did.
    pub(super) fn forget_closed(&mut self, now: Timestamp) {
        if self.levels.len() < 2 * self.kept.max(512) {
            return;
        }
        self.levels.retain(|_, c| c.restores(now));
        self.kept = self.levels.len();
    }

    /// The record keys of the levels that have something to restore at `now`.
    pub(super) fn keys(&self, now: Timestamp) -> Vec<String> {
        let mut keys: Vec<String> = self
            .levels
            .iter()
            .filter(|(_, c)| c.restores(now))
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort();
        keys
    }

    /// `state` (`None`: lost) with what this replica counted at `key` in the windows open at
    /// `now` added, and when the result is as good as fresh (µs); `None` when there is
    /// nothing to add.
    pub(super) fn restored(
        &self,
        key: &str,
        state: Option<NodeState>,
        now: Timestamp,
    ) -> Option<(NodeState, f64)> {
        let c = self.levels.get(key).filter(|c| c.restores(now))?;
        let mut s = state.unwrap_or_default();
        let mine = &c.counters;
        let window = aligned_window(now.as_micros() as f64, c.period_us);
        let mut until = 0.0f64;
        if mine.window == window && mine.total > 0.0 {
            roll_window(&mut s, window);
            s.total += mine.total;
            s.non_floor += mine.non_floor;
            s.floor_used += mine.floor_used;
            until = until.max((window + 1.0) * c.period_us);
        }
        for b in mine.budgets.iter().filter(|b| open(b, now) && b.used > 0.0) {
            let mut merged = *b;
            if let Some(have) = s.budgets.iter().find(|x| x.period == b.period) {
                if have.start == b.start {
                    merged.used += have.used;
                }
            }
            s.budgets.set(merged);
            until = until.max(b.period.end_of(Timestamp(b.start as u64)).as_micros() as f64);
        }
        Some((s, until))
    }
}

impl Counted {
    /// Whether anything it counts is in a window open at `now`.
    fn restores(&self, now: Timestamp) -> bool {
        let c = &self.counters;
        let window = aligned_window(now.as_micros() as f64, self.period_us);
        (c.window == window && c.total > 0.0)
            || c.budgets.iter().any(|b| open(b, now) && b.used > 0.0)
    }
}

/// Whether a budget counter's window is the one open at `now`.
fn open(b: &BudgetCounter, now: Timestamp) -> bool {
    b.period.window(now).0.as_micros() as f64 == b.start
}

/// Adds `factor` × `charge`'s counts at `level` to `counters`, moving them on to a newer
/// window or budget window than the one they hold (an older one is not counted any more).
fn count(counters: &mut NodeState, charge: &Charge, level: usize, factor: f64) {
    let lc = &charge.levels[level];
    if !lc.present {
        return;
    }
    if charge.window > counters.window {
        roll_window(counters, charge.window);
    }
    if charge.window == counters.window {
        count_in_window(counters, charge, level, factor);
    }
    for (period, start) in lc.budgets.iter() {
        let units = charge.cost * factor;
        let counter = match counters.budgets.iter().find(|b| b.period == period) {
            Some(b) if b.start == start => BudgetCounter {
                used: (b.used + units).max(0.0),
                ..*b
            },
            Some(b) if b.start > start => continue,
            _ => BudgetCounter {
                period,
                start,
                used: units.max(0.0),
            },
        };
        counters.budgets.set(counter);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::admission::engine::LevelCharge;
    use crate::policy::BudgetPeriod;

    const PERIOD: f64 = 60_000_000.0;
    /// 2026-01-01T00:00:00Z, aligned to every window.
    const EPOCH: u64 = 1_767_225_600_000_000;

    fn charge(cost: f64, at: Timestamp, floor: f64) -> Charge {
        let mut c = Charge {
            cost,
            window: aligned_window(at.as_micros() as f64, PERIOD),
            levels: Default::default(),
        };
        c.levels[1] = LevelCharge {
            present: true,
            floor,
            ceiling: cost - floor,
            budgets: crate::admission::engine::ChargedBudgets::at(
                at.as_micros(),
                [BudgetPeriod::Hour],
            ),
            ..LevelCharge::default()
        };
        c
    }

    proptest! {
        /// Restored into a lost record, a ledger gives back what its admissions and corrections
        /// counted in the windows still open: the hour's budget counts every call of the hour,
        /// the window counters those of the current minute, and nothing of a closed window.
        #[test]
        fn a_lost_record_gets_back_what_was_counted_in_open_windows(
            calls in proptest::collection::vec((0u64..7_200, 1u32..5, 0u32..2, any::<bool>()), 1..60),
            now_s in 3_600u64..7_200,
        ) {
            let mut ledger = Ledger::default();
            let now = Timestamp(EPOCH + now_s * 1_000_000);
            let (mut hour, mut minute) = (0.0, 0.0);
            let mut calls = calls;
            calls.sort();
            for (at_s, cost, floor, refunded) in calls.into_iter().filter(|c| c.0 <= now_s) {
                let at = Timestamp(EPOCH + at_s * 1_000_000);
                let c = charge(f64::from(cost), at, f64::from(floor.min(cost)));
                ledger.admitted("k", &c, 1, PERIOD);
                let kept = if refunded {
                    ledger.corrected("k", &c, 1, -1.0);
                    0.0
                } else {
                    f64::from(cost)
                };
                if at_s >= 3_600 {
                    hour += kept;
                }
                if at_s / 60 == now_s / 60 {
                    minute += kept;
                }
            }
            match ledger.restored("k", None, now) {
                None => prop_assert!(hour == 0.0 && minute == 0.0),
                Some((s, until)) => {
                    let used = s.budgets.iter().find(|b| b.period == BudgetPeriod::Hour).map_or(0.0, |b| b.used);
                    prop_assert_eq!(used, hour);
                    prop_assert_eq!(s.total, minute);
                    prop_assert!(until > now.as_micros() as f64);
                }
            }
        }
    }

    /// Restored into a record other replicas wrote since the loss, a ledger adds to what they
    /// counted in the same windows and replaces what they hold for closed ones.
    #[test]
    fn a_restore_adds_to_the_counts_of_the_same_windows() {
        let now = Timestamp(EPOCH + 90 * 1_000_000);
        let mut ledger = Ledger::default();
        ledger.admitted("k", &charge(3.0, now, 1.0), 1, PERIOD);
        let mut theirs = NodeState {
            window: aligned_window(now.as_micros() as f64, PERIOD),
            total: 2.0,
            ..NodeState::default()
        };
        theirs.budgets.set(BudgetCounter {
            period: BudgetPeriod::Hour,
            start: BudgetPeriod::Hour.window(now).0.as_micros() as f64,
            used: 2.0,
        });
        let (s, _) = ledger.restored("k", Some(theirs), now).unwrap();
        assert_eq!(s.total, 5.0);
        assert_eq!(s.floor_used, 1.0);
        assert_eq!(s.budgets[0].used, 5.0);
        assert!(ledger.restored("other", None, now).is_none());
        let next_hour = Timestamp(EPOCH + 3_700 * 1_000_000);
        assert!(
            ledger.restored("k", None, next_hour).is_none(),
            "its hour closed"
        );
        assert!(ledger.keys(next_hour).is_empty());
    }
}
