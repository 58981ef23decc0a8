//! A level's record in Redis: its version, when it may go, and its `NodeState`. Written and read by Rust only: the scripts compare the
//! version's 8 bytes and copy whole records, they never look inside.
//!
//! **Formats.** The layout below is format 1. Every later format keeps the first 8 bytes (the
//! version the scripts compare) and ends with an 8-byte trailer, `FSRF` and the format number
//! as a little-endian `u32`, so a replica tells a format it does not know from a broken record
//! and says so. Which format a replica writes is agreed among the replicas (`replicas`); a
//! replica reads every format it knows, so a layout change migrates each record as it is next
//! written.
//!
//! Layout, little-endian: `u64` version (random per write: a record that expired and was
//! made again never takes an old version back), then doubles: expires (µs, the decisions'
//! clock: the state is equivalent to a fresh one from then on, template counts included), t,
//! floor, share, ceiling, window, total, non_floor, floor_used, in_flight, template_window,
//! template_in_window, template_counted, the number of budget counters, and per counter its
//! period code, start and used; then, only for a tool whose tenants on plans are counted, the
//! number of plans counted and per plan its two counts (a record without it is read as
//! counting none: records written before plans existed read unchanged).

use crate::admission::engine::{BudgetCounter, Budgets, NodeState, PlanCounts};
use crate::policy::BudgetPeriod;
use crate::store::StoreError;

const FIXED: usize = 8 + 8 * 14;

/// The newest record format this version writes.
pub(super) const FORMAT: u8 = 1;
/// The oldest record format this version reads and writes.
pub(super) const OLDEST_FORMAT: u8 = 1;
/// What ends a record of format 2 or later, before its format number.
const TRAILER: &[u8; 4] = b"FSRF";

/// The format of a record: its trailer's, or 1 without one.
fn format_of(bytes: &[u8]) -> u32 {
    match bytes.len().checked_sub(8).map(|at| &bytes[at..]) {
        Some(t) if t[..4] == *TRAILER => u32::from_le_bytes(t[4..].try_into().expect("4 bytes")),
        _ => 1,
    }
}

/// A level's record.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Record {
    pub(super) version: u64,
    pub(super) expires: f64,
    pub(super) state: NodeState,
    /// A tool's unlisted tenants counted per plan (none at a tenant or an instance).
    pub(super) plans: PlanCounts,
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
    /// The record's bytes in `format` (see the module docs).
    pub(super) fn encode(&self, format: u8) -> Vec<u8> {
        #[cfg(test)]
        if format == tests::NEXT {
            let mut out = self.encode_v1();
            out.extend_from_slice(TRAILER);
            out.extend_from_slice(&u32::from(format).to_le_bytes());
            return out;
        }
        debug_assert_eq!(format, FORMAT, "only format 1 exists");
        self.encode_v1()
    }

    fn encode_v1(&self) -> Vec<u8> {
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
        let plans = self.plans.len();
        if plans > 0 {
            out.extend_from_slice(&(plans as f64).to_le_bytes());
            for p in 0..plans {
                let (in_window, counted) = self.plans.get(p);
                for x in [in_window, counted] {
                    out.extend_from_slice(&f64::from(x).to_le_bytes());
                }
            }
        }
        out
    }

    /// The plans' counts after `at`, the end of the budget counters: none, or their number
    /// and two counts each.
    fn plans(bytes: &[u8], at: usize) -> Result<PlanCounts, StoreError> {
        let bad = |what: &str| StoreError::Protocol(format!("a stored state is {what}"));
        let mut plans = PlanCounts::default();
        let rest = &bytes[at..];
        if rest.is_empty() {
            return Ok(plans);
        }
        let f = |i: usize| {
            rest.get(8 * i..8 * i + 8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
        };
        let n = f(0).ok_or_else(|| bad("cut short"))?;
        if !(1.0..=crate::policy::MAX_PLANS as f64).contains(&n) || n.fract() != 0.0 {
            return Err(bad("counting an impossible number of plans"));
        }
        let n = n as usize;
        if rest.len() != 8 + 16 * n {
            return Err(bad("not a record of this layout"));
        }
        let count = |x: f64| (x >= 0.0 && x <= f64::from(u32::MAX)).then_some(x as u32);
        for p in 0..n {
            let (a, b) = (f(1 + 2 * p), f(2 + 2 * p));
            match (a.and_then(count), b.and_then(count)) {
                (Some(a), Some(b)) => plans.set(p, a, b),
                _ => return Err(bad("holding a plan count that is not a count")),
            }
        }
        Ok(plans)
    }

    /// The record in `bytes`, in any format up to `newest` this version reads; an error for
    /// bytes that are not a record, and for a format it does not read.
    pub(super) fn decode(bytes: &[u8], newest: u8) -> Result<Record, StoreError> {
        match format_of(bytes) {
            1 => Self::decode_v1(bytes),
            #[cfg(test)]
            f if f == u32::from(tests::NEXT) && newest >= tests::NEXT => {
                Self::decode_v1(&bytes[..bytes.len() - 8])
            }
            f => Err(StoreError::Protocol(format!(
                "a stored state is in record format {f}, and this replica reads formats up to {newest}: a newer replica wrote it while this one was not announced; upgrade this replica"
            ))),
        }
    }

    fn decode_v1(bytes: &[u8]) -> Result<Record, StoreError> {
        let bad = |what: &str| StoreError::Protocol(format!("a stored state is {what}"));
        if bytes.len() < FIXED {
            return Err(bad("not a record of this layout"));
        }
        let f = |i: usize| {
            let at = 8 + 8 * i;
            f64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
        };
        let nb = f(13);
        if !(0.0..=3.0).contains(&nb) {
            return Err(bad("holding more than one budget counter per period"));
        }
        let budgets_end = FIXED + 24 * nb as usize;
        if bytes.len() < budgets_end {
            return Err(bad("cut short"));
        }
        let plans = Self::plans(bytes, budgets_end)?;
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
            plans,
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A record format the tests write and read, one past the newest real one: what the
    /// migration tests bump the layout to (format 1 with a trailer).
    pub(crate) const NEXT: u8 = FORMAT + 1;

    proptest! {
        #[test]
        fn a_record_round_trips_bit_for_bit(
            version in any::<u64>(),
            xs in prop::collection::vec(any::<f64>(), 13),
            budgets in prop::collection::vec((0usize..3, any::<f64>(), any::<f64>()), 0..4),
            plans in prop::collection::vec((any::<u32>(), any::<u32>()), 0..=crate::policy::MAX_PLANS),
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
                plans: {
                    let mut p = PlanCounts::default();
                    for (i, &(a, b)) in plans.iter().enumerate() {
                        p.set(i, a, b);
                    }
                    p
                },
            };
            let back = Record::decode(&r.encode(FORMAT), FORMAT).unwrap();
            prop_assert_eq!(back.encode(FORMAT), r.encode(FORMAT));
            let next = Record::decode(&r.encode(NEXT), NEXT).unwrap();
            prop_assert_eq!(next.encode(FORMAT), r.encode(FORMAT));
            prop_assert_eq!(back.plans, r.plans);
        }

        /// A record of a level without plan counts is written as before plans existed, byte
        /// for byte (the layout every earlier version reads), and one written so is read
        /// with every number kept and no plan counted.
        #[test]
        fn a_record_without_plans_keeps_the_earlier_layout(
            xs in prop::collection::vec(any::<f64>(), 13),
            budgets in prop::collection::vec((0usize..3, -1e9f64..1e9, -1e9f64..1e9), 0..4),
        ) {
            // The earlier layout, written out field by field.
            let mut old = 7u64.to_le_bytes().to_vec();
            let nb = budgets.iter().map(|b| b.0).collect::<std::collections::BTreeSet<_>>();
            for x in xs.iter().chain([nb.len() as f64].iter()) {
                old.extend_from_slice(&x.to_le_bytes());
            }
            for &p in &nb {
                let (_, start, used) = budgets.iter().find(|b| b.0 == p).copied().unwrap();
                for x in [(p + 1) as f64, start, used] {
                    old.extend_from_slice(&x.to_le_bytes());
                }
            }
            let r = Record::decode(&old, FORMAT).unwrap();
            prop_assert!(r.plans.is_empty());
            prop_assert_eq!(r.state.budgets.len(), nb.len());
            prop_assert_eq!(r.encode(FORMAT), old);
        }

        /// A format this version does not know is an error that says so.
        #[test]
        fn an_unknown_format_is_named(format in (NEXT as u32 + 1)..1000) {
            let mut bytes = Record::default().encode(FORMAT);
            bytes.extend_from_slice(TRAILER);
            bytes.extend_from_slice(&format.to_le_bytes());
            let e = Record::decode(&bytes, NEXT).unwrap_err().to_string();
            prop_assert!(e.contains(&format!("record format {format}")), "{}", e);
        }

        #[test]
        fn anything_else_is_an_error_not_a_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = Record::decode(&bytes, NEXT);
        }
    }
}
