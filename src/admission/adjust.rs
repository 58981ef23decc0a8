//! Corrections after a decision: a charge corrected by a factor (settling the actual cost,
//! refunding), and a concurrency permit given back.

use super::bucket::calendar_window;
use super::state::{Charge, NodeState};
use crate::clock::Timestamp;

/// Applies a correction to one level's state: `factor` × what was charged is added to the
/// counters and taken from the buckets (a negative factor gives back, never above a
/// bucket's depth). The counters count it only while the state still counts the charge's
/// window, and the budgets while `now` is in their charged windows: a correction never
/// touches a window that has already closed.
pub fn adjust(s: &mut NodeState, charge: &Charge, level: usize, factor: f64, now: Timestamp) {
    let lc = &charge.levels[level];
    if !lc.present || !s.live {
        return;
    }
    let give = |x: f64, amount: f64, depth: f64| -> f64 {
        let y = x - amount * factor;
        if factor < 0.0 {
            y.min(depth.max(x))
        } else {
            y
        }
    };
    s.floor = give(s.floor, lc.floor, lc.floor_depth);
    s.share = give(s.share, lc.share, lc.share_depth);
    s.ceiling = give(s.ceiling, lc.ceiling, lc.ceiling_depth);
    if s.window == charge.window {
        count_in_window(s, charge, level, factor);
    }
    for (period, start) in lc.budgets.iter() {
        if calendar_window(period, now).0 != start {
            continue;
        }
        if let Some(b) = s
            .budgets
            .iter_mut()
            .find(|b| b.period == period && b.start == start)
        {
            b.used = (b.used + charge.cost * factor).max(0.0);
        }
    }
}

/// Adds `factor` × what a call counted at one level to the window counters of `s` (which
/// count the call's window): the units through the level, those above floors and those
/// within them (at the tool: every caller's floor units).
pub fn count_in_window(s: &mut NodeState, charge: &Charge, level: usize, factor: f64) {
    let lc = &charge.levels[level];
    s.total = (s.total + charge.cost * factor).max(0.0);
    s.non_floor = (s.non_floor + lc.ceiling * factor).max(0.0);
    let floor_delta = if level == 0 {
        (charge.cost - lc.ceiling) * factor
    } else {
        lc.floor * factor
    };
    s.floor_used = (s.floor_used + floor_delta).max(0.0);
}

/// Releases one level's concurrency permit.
pub fn release(s: &mut NodeState) {
    s.in_flight = (s.in_flight - 1.0).max(0.0);
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::admission::state::{BudgetCounter, LevelCharge};
    use crate::policy::BudgetPeriod;

    proptest! {
        /// A refund gives back exactly what a call took at a level (buckets, window counters,
        /// budget), and a correction by `f` charges `f` times it again.
        #[test]
        fn a_refund_undoes_a_charge_and_a_correction_scales_it(
            depth in 1.0f64..100.0, fill in 0.0f64..1.0, take in 0.0f64..1.0,
            cost in 0.1f64..10.0, used in 0.0f64..50.0, factor in 0.0f64..2.0, level in 0usize..3,
        ) {
            let now = Timestamp(1_767_225_600_000_000);
            let day = BudgetPeriod::Day.window(now).0.as_micros() as f64;
            let x = depth * fill;
            let k = x * take;
            let before = NodeState {
                live: true,
                floor: x,
                share: x,
                ceiling: x,
                window: 7.0,
                total: used,
                non_floor: used,
                floor_used: used,
                budgets: [BudgetCounter { period: BudgetPeriod::Day, start: day, used }].into_iter().collect(),
                ..NodeState::default()
            };
            let mut charge = Charge { cost, window: 7.0, levels: Default::default() };
            charge.levels[level] = LevelCharge {
                present: true,
                floor: 0.0,
                floor_depth: depth,
                share: k,
                share_depth: depth,
                ceiling: k,
                ceiling_depth: depth,
                permit: false,
                budgets: crate::admission::engine::ChargedBudgets::at(now.as_micros(), [BudgetPeriod::Day]),
            };
            // What the decision wrote: the takes out, the call counted.
            let mut after = before;
            after.share -= k;
            after.ceiling -= k;
            after.total += cost;
            after.non_floor += k;
            after.floor_used += if level == 0 { cost - k } else { 0.0 };
            after.budgets[0].used += cost;
            let mut refunded = after;
            adjust(&mut refunded, &charge, level, -1.0, now);
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()));
            for (a, b) in [
                (refunded.share, before.share), (refunded.ceiling, before.ceiling),
                (refunded.total, before.total), (refunded.non_floor, before.non_floor),
                (refunded.floor_used, before.floor_used),
                (refunded.budgets[0].used, before.budgets[0].used),
            ] {
                prop_assert!(close(a, b), "{a} vs {b}");
            }
            let mut again = after;
            adjust(&mut again, &charge, level, factor, now);
            prop_assert!(close(again.total, after.total + cost * factor));
            prop_assert!(close(again.ceiling, after.ceiling - k * factor));
            // A closed window is never touched.
            let mut closed = after;
            closed.window = 8.0;
            adjust(&mut closed, &charge, level, -1.0, now);
            prop_assert_eq!(closed.total, after.total);
        }
    }

    #[test]
    fn a_permit_never_goes_below_zero() {
        let mut s = NodeState {
            in_flight: 1.0,
            ..NodeState::default()
        };
        release(&mut s);
        release(&mut s);
        assert_eq!(s.in_flight, 0.0);
    }
}
