//! A level's record in Redis: its version, when it may go, and its `NodeState`. Written and read by Rust only: the scripts compare the
//! version's 8 bytes and copy whole records, they never look inside.
//!
//! Layout, little-endian: `u64` version (random per write: a record that expired and was
//! made again never takes an old version back), then doubles: expires (µs, the decisions'
//! clock: the state is equivalent to a fresh one from then on, template counts included), t,
//! floor, share, ceiling, window, total, non_floor, floor_used, in_flight, template_window,
//! template_in_window, template_counted, the number of budget counters, and per counter its
//! period code, start and used.

use crate::admission::engine::{BudgetCounter, Budgets, NodeState};
use crate::policy::BudgetPeriod;
use crate::store::StoreError;

const FIXED: usize = 8 + 8 * 14;

/// A level's record.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Record {
    pub(super) version: u64,
    pub(super) expires: f64,
    pub(super) state: NodeState,
}

/// A budget period in a record: 1 hour, 2 day, 3 month.
pub(super) fn period_code(p: BudgetPeriod) -> f64 {
    (p.index() + 1) as f64
}

fn period_of(code: f64) -> Option<BudgetPeriod> {
    usize::try_from(code as i64)
        .ok()
        .and_then(|c| c.checked_sub(1))
        .and_then(|i| BudgetPeriod::ALL.get(i).copied())
}

impl Record {
    pub(super) fn encode(&self) -> Vec<u8> {
        let s = &self.state;
        let mut out = Vec::with_capacity(FIXED + 24 * s.budgets.len());
        out.extend_from_slice(&self.version.to_le_bytes());
        for x in [
            self.expires,
            s.t,
            s.floor,
            s.share,
            s.ceiling,
            s.window,
            s.total,
            s.non_floor,
            s.floor_used,
            s.in_flight,
            s.template_window,
            s.template_in_window,
            s.template_counted,
            s.budgets.len() as f64,
        ] {
            out.extend_from_slice(&x.to_le_bytes());
        }
        for b in &s.budgets {
            for x in [period_code(b.period), b.start, b.used] {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        out
    }

    /// `None` for a missing key; an error for bytes that are not a record.
    pub(super) fn decode(bytes: &[u8]) -> Result<Record, StoreError> {
        let bad = |what: &str| StoreError::Protocol(format!("a stored state is {what}"));
        if bytes.len() < FIXED || !(bytes.len() - FIXED).is_multiple_of(24) {
            return Err(bad("not a record of this layout"));
        }
        let f = |i: usize| {
            let at = 8 + 8 * i;
            f64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
        };
        let nb = f(13);
        if nb < 0.0 || (bytes.len() - FIXED) / 24 != nb as usize {
            return Err(bad("cut short"));
        }
        if nb > 3.0 {
            return Err(bad("holding more than one budget counter per period"));
        }
        let mut budgets = Budgets::default();
        for k in 0..nb as usize {
            let g = |j: usize| f(14 + 3 * k + j);
            budgets.set(BudgetCounter {
                period: period_of(g(0)).ok_or_else(|| bad("of an unknown budget period"))?,
                start: g(1),
                used: g(2),
            });
        }
        Ok(Record {
            version: u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
            expires: f(0),
            state: NodeState {
                live: true,
                t: f(1),
                floor: f(2),
                share: f(3),
                ceiling: f(4),
                window: f(5),
                total: f(6),
                non_floor: f(7),
                floor_used: f(8),
                in_flight: f(9),
                template_window: f(10),
                template_in_window: f(11),
                template_counted: f(12),
                budgets,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn a_record_round_trips_bit_for_bit(
            version in any::<u64>(),
            xs in prop::collection::vec(any::<f64>(), 13),
            budgets in prop::collection::vec((0usize..3, any::<f64>(), any::<f64>()), 0..4),
        ) {
            let periods = [BudgetPeriod::Hour, BudgetPeriod::Day, BudgetPeriod::Month];
            let r = Record {
                version,
                expires: xs[0],
                state: NodeState {
                    live: true,
                    t: xs[1], floor: xs[2], share: xs[3], ceiling: xs[4], window: xs[5],
                    total: xs[6], non_floor: xs[7], floor_used: xs[8], in_flight: xs[9],
                    template_window: xs[10], template_in_window: xs[11],
                    template_counted: xs[12],
                    budgets: budgets
                        .iter()
                        .map(|&(p, start, used)| BudgetCounter { period: periods[p], start, used })
                        .collect(),
                },
            };
            let back = Record::decode(&r.encode()).unwrap();
            prop_assert_eq!(back.encode(), r.encode());
        }

        #[test]
        fn anything_else_is_an_error_not_a_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = Record::decode(&bytes);
        }
    }
}
