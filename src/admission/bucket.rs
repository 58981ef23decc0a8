//! Token-bucket arithmetic, pure: refilling, rolling the aligned window, waiting, and when a
//! level's state is equivalent to a fresh one.

use super::state::NodeState;
use crate::clock::Timestamp;
use crate::policy::BudgetPeriod;

/// Tolerance for float comparisons: a draw passes when `have + EPS >= need`.
pub(crate) const EPS: f64 = 1e-9;

/// A token bucket: refilled at `rate` units per period, up to `depth`.
#[derive(Copy, Clone, Default)]
pub(super) struct Bucket {
    pub(super) rate: f64,
    pub(super) depth: f64,
}

/// A level's three buckets: floor, share, ceiling (at the tool, the ceiling bucket is the
/// pool).
pub(super) type Buckets = [Bucket; 3];

/// The aligned window `floor(t / period)` of an instant `t ≥ 0` (µs), by a cast: `f64::floor`
/// is a library call on baseline x86-64, and every decision and every stored state's read
/// works one out. (Through `i64`, one instruction there; `as u64` takes a dozen.)
#[inline]
pub(crate) fn aligned_window(t: f64, period: f64) -> f64 {
    let x = t / period;
    let w = x as i64 as f64;
    if w > x {
        w - 1.0
    } else {
        w
    }
}

/// The calendar window of `period` that holds `at`: (start, end) µs.
pub(super) fn calendar_window(period: BudgetPeriod, at: Timestamp) -> (f64, f64) {
    let (start, end) = period.window(at);
    (start.as_micros() as f64, end.as_micros() as f64)
}

/// Brings a level's buckets up to `now` (a state never seen starts full).
pub(super) fn refill(s: &mut NodeState, [f, h, k]: &Buckets, now: f64, period: f64) {
    if !s.live {
        s.live = true;
        s.t = now;
        s.floor = f.depth;
        s.share = h.depth;
        s.ceiling = k.depth;
        return;
    }
    let dt = (now - s.t).max(0.0);
    s.floor = (s.floor + dt * f.rate / period).min(f.depth);
    s.share = (s.share + dt * h.rate / period).min(h.depth);
    s.ceiling = (s.ceiling + dt * k.rate / period).min(k.depth);
    if now > s.t {
        s.t = now;
    }
}

/// Brings a level's window counters to `window` (cleared when it moved on).
pub(crate) fn roll_window(s: &mut NodeState, window: f64) {
    if s.window != window {
        s.window = window;
        s.total = 0.0;
        s.non_floor = 0.0;
        s.floor_used = 0.0;
    }
}

pub(super) fn bucket(rate: f64, depth: f64) -> Bucket {
    let rate = rate.max(0.0);
    Bucket {
        rate,
        depth: if rate > 0.0 { depth } else { 0.0 },
    }
}

/// Time (µs) until bucket `x` holds `need`, or infinity when it never can.
pub(super) fn wait_for(x: f64, need: f64, b: &Bucket, period: f64) -> f64 {
    if x + EPS >= need {
        0.0
    } else if need > b.depth + EPS || b.rate <= 0.0 {
        f64::INFINITY
    } else {
        (need - x) * period / b.rate
    }
}

/// When a level's state is equivalent to a fresh one: every bucket full, its window and
/// budget counters over. (Permits held keep a state alive regardless: the store checks.)
pub(super) fn expiry(
    s: &NodeState,
    [f, h, k]: &Buckets,
    [now, period, next_window]: [f64; 3],
) -> f64 {
    let mut at = now;
    for (x, b) in [(s.floor, f), (s.share, h), (s.ceiling, k)] {
        if b.rate > 0.0 && x < b.depth {
            at = at.max(now + (b.depth - x) * period / b.rate);
        }
    }
    if s.total > 0.0 {
        at = at.max(next_window);
    }
    for b in s.budgets.iter() {
        if b.used > 0.0 {
            let end = b.period.end_of(Timestamp(b.start as u64));
            at = at.max(end.as_micros() as f64);
        }
    }
    at
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const P: f64 = 60_000_000.0;

    fn live(floor: f64, share: f64, ceiling: f64, t: f64) -> NodeState {
        NodeState {
            live: true,
            t,
            floor,
            share,
            ceiling,
            ..NodeState::default()
        }
    }

    #[test]
    fn a_fresh_state_starts_full_and_a_bucket_without_rate_is_empty() {
        let mut s = NodeState::default();
        let (f, h, k) = (bucket(10.0, 10.0), bucket(5.0, 3.0), bucket(0.0, 7.0));
        refill(&mut s, &[f, h, k], 1_000.0, P);
        assert!(s.live);
        assert_eq!(
            (s.floor, s.share, s.ceiling, s.t),
            (10.0, 3.0, 0.0, 1_000.0)
        );
        assert_eq!(wait_for(0.0, 1.0, &k, P), f64::INFINITY);
    }

    #[test]
    fn rolling_the_window_clears_its_counters_once() {
        let mut s = NodeState {
            window: 4.0,
            total: 9.0,
            non_floor: 5.0,
            floor_used: 4.0,
            ..NodeState::default()
        };
        roll_window(&mut s, 4.0);
        assert_eq!(s.total, 9.0);
        roll_window(&mut s, 5.0);
        assert_eq!(
            (s.window, s.total, s.non_floor, s.floor_used),
            (5.0, 0.0, 0.0, 0.0)
        );
    }

    proptest! {
        /// The window worked out by a cast is `floor(t / period)`, to the bit.
        #[test]
        fn the_aligned_window_is_the_floor(t in 0.0f64..1e16, period in 1.0f64..1e11) {
            prop_assert_eq!(aligned_window(t, period), (t / period).floor());
        }

        /// Refilling never goes above the depth or below where it was, never runs the clock
        /// back, and grows with the time passed.
        #[test]
        fn refill_is_bounded_monotone_and_keeps_the_clock(
            rate in 0.0f64..1e6, depth in 1.0f64..1e4, x in 0.0f64..1e4,
            t in 0.0f64..1e12, dt in -1e9f64..1e9, more in 0.0f64..1e9,
        ) {
            let b = bucket(rate, depth);
            let x = x.min(b.depth);
            let mut s = live(x, x, x, t);
            refill(&mut s, &[b, b, b], t + dt, P);
            prop_assert!(s.floor <= b.depth && s.floor >= x);
            prop_assert!(s.t >= t);
            let mut later = live(x, x, x, t);
            refill(&mut later, &[b, b, b], t + dt.max(0.0) + more, P);
            prop_assert!(later.floor >= s.floor);
        }

        /// Waiting `wait_for` and refilling gives what was needed; waiting less does not
        /// (when it can be had at all).
        #[test]
        fn wait_for_is_the_time_refill_takes(
            rate in 1.0f64..1e6, depth in 1.0f64..1e3, x in 0.0f64..1e3, need in 0.0f64..1e3,
        ) {
            let b = bucket(rate, depth);
            let x = x.min(depth);
            let w = wait_for(x, need, &b, P);
            if need > depth + EPS {
                prop_assert_eq!(w, f64::INFINITY);
            } else {
                let mut s = live(x, x, x, 0.0);
                refill(&mut s, &[b, b, b], w, P);
                prop_assert!(s.floor + 1e-6 >= need, "{} after {} for {}", s.floor, w, need);
                if w > 1.0 {
                    let mut early = live(x, x, x, 0.0);
                    refill(&mut early, &[b, b, b], w * 0.99, P);
                    prop_assert!(early.floor + EPS < need);
                }
            }
        }

        /// At its expiry a state's buckets are full again and its window is over.
        #[test]
        fn at_expiry_the_state_is_fresh(
            rate in 1.0f64..1e5, depth in 1.0f64..1e3, x in 0.0f64..1e3, total in 0.0f64..10.0,
            now in 0.0f64..1e12,
        ) {
            let b = bucket(rate, depth);
            let x = x.min(depth);
            let window = (now / P).floor();
            let mut s = live(x, x, x, now);
            s.window = window;
            s.total = total;
            let at = expiry(&s, &[b, b, b], [now, P, (window + 1.0) * P]);
            prop_assert!(at >= now);
            refill(&mut s, &[b, b, b], at, P);
            prop_assert!(s.floor + 1e-6 >= depth);
            if total > 0.0 {
                prop_assert!((at / P).floor() > window);
            }
        }
    }
}
