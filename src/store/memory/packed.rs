//! A tenant's or an instance's state as the memory store keeps it: one allocation holding the
//! numbers that are not zero, when the state expires, and the level's name.
//!
//! A [`NodeState`] is some two hundred bytes, most of them zeros for most levels: no floor,
//! no permits held, no template children, one budget or none. Packed, a level keeps a header,
//! its expiry, its buckets and window counters, the groups of numbers that are not all zero
//! (floor, permits, template counts, each budget counter), and its name; the aligned window is not kept but
//! worked out from `t` (a state is written only by an admitted call, which brings `t` and the
//! window to the same instant), and a parent's template counts are kept as of that window (the
//! engine keeps them so too).

use crate::admission::engine::{self, BudgetCounter, Budgets, NodeState};
use crate::policy::BudgetPeriod;

/// Header bits: which optional groups of numbers are held (absent: zero), the number of
/// budget counters and their periods, and whether the level is an untenanted caller.
const FLOORS: u64 = 1; // floor, floor_used
const FLIGHT: u64 = 1 << 1; // in_flight
const TEMPLATE: u64 = 1 << 2; // template children: admitted in the window, counted (u32 each)
const BUDGETS_SHIFT: u32 = 3; // 2 bits: how many counters (start, used each)
const PERIODS_SHIFT: u32 = 5; // 2 bits per counter
const UNTENANTED: u64 = 1 << 11;
/// The bits that say where the numbers lie: equal layouts can be written over in place.
const LAYOUT: u64 = UNTENANTED - 1;

/// Header, expiry (µs), then `t`, `share`, `ceiling`, `total`, `non_floor` (always held),
/// then the groups present in header order, 8 bytes each, then the name.
const HEADER: usize = 16;
const CORE: usize = 5;

/// A level's state in one allocation; see the module's notes.
pub(super) struct Packed(Box<[u8]>);

fn word(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn put(bytes: &mut [u8], at: usize, x: u64) {
    bytes[at..at + 8].copy_from_slice(&x.to_le_bytes());
}

fn period_bits(p: BudgetPeriod) -> u64 {
    p.index() as u64
}

fn period_of(bits: u64) -> BudgetPeriod {
    BudgetPeriod::ALL[((bits & 3) as usize).min(BudgetPeriod::ALL.len() - 1)]
}

/// How many numbers a header's layout holds.
fn numbers_in(header: u64) -> usize {
    CORE + 2 * usize::from(header & FLOORS != 0)
        + usize::from(header & FLIGHT != 0)
        + usize::from(header & TEMPLATE != 0)
        + 2 * ((header >> BUDGETS_SHIFT) & 3) as usize
}

/// The layout `s` needs, and its template counts as of its own window, packed.
fn layout(s: &NodeState, period: f64) -> (u64, u64) {
    let mut h = 0;
    if s.floor != 0.0 || s.floor_used != 0.0 {
        h |= FLOORS;
    }
    if s.in_flight != 0.0 {
        h |= FLIGHT;
    }
    let mut template = 0;
    if s.template_counted != 0.0 || s.template_in_window != 0.0 {
        let (in_window, counted) = engine::template_counts(
            s.template_window,
            s.template_in_window,
            s.template_counted,
            engine::aligned_window(s.t, period),
        );
        template = (in_window as u32 as u64) | ((counted as u32 as u64) << 32);
        if template != 0 {
            h |= TEMPLATE;
        }
    }
    h |= (s.budgets.len() as u64) << BUDGETS_SHIFT;
    for (k, b) in s.budgets.iter().enumerate() {
        h |= period_bits(b.period) << (PERIODS_SHIFT + 2 * k as u32);
    }
    (h, template)
}

/// Writes the numbers of `s` at `HEADER` in the layout of `header`.
fn write(b: &mut [u8], header: u64, expires: u64, s: &NodeState, template: u64) {
    put(b, 0, header);
    put(b, 8, expires);
    let mut at = HEADER;
    for x in [s.t, s.share, s.ceiling, s.total, s.non_floor] {
        put(b, at, x.to_bits());
        at += 8;
    }
    if header & FLOORS != 0 {
        put(b, at, s.floor.to_bits());
        put(b, at + 8, s.floor_used.to_bits());
        at += 16;
    }
    if header & FLIGHT != 0 {
        put(b, at, s.in_flight.to_bits());
        at += 8;
    }
    if header & TEMPLATE != 0 {
        put(b, at, template);
        at += 8;
    }
    for c in s.budgets.iter() {
        put(b, at, c.start.to_bits());
        put(b, at + 8, c.used.to_bits());
        at += 16;
    }
}

impl Packed {
    /// A level named `name` in state `s` (period: the tool's, µs), forgettable after
    /// `expires`.
    pub(super) fn new(
        name: &str,
        untenanted: bool,
        s: &NodeState,
        expires: u64,
        period: f64,
    ) -> Self {
        let (mut header, template) = layout(s, period);
        if untenanted {
            header |= UNTENANTED;
        }
        Packed(Self::build(header, expires, s, template, name.as_bytes()))
    }

    fn build(header: u64, expires: u64, s: &NodeState, template: u64, name: &[u8]) -> Box<[u8]> {
        let at = HEADER + 8 * numbers_in(header);
        let mut out = vec![0u8; at + name.len()].into_boxed_slice();
        write(&mut out, header, expires, s, template);
        out[at..].copy_from_slice(name);
        out
    }

    fn header(&self) -> u64 {
        word(&self.0, 0)
    }

    /// When the state may be forgotten (µs), unless it holds permits.
    pub(super) fn expires(&self) -> u64 {
        word(&self.0, 8)
    }

    /// The level's name, as bytes.
    pub(super) fn name(&self) -> &[u8] {
        &self.0[HEADER + 8 * numbers_in(self.header())..]
    }

    /// Whether the level is an untenanted caller.
    pub(super) fn untenanted(&self) -> bool {
        self.header() & UNTENANTED != 0
    }

    /// Permits held.
    pub(super) fn in_flight(&self) -> f64 {
        let h = self.header();
        if h & FLIGHT == 0 {
            return 0.0;
        }
        let at = HEADER + 8 * (CORE + 2 * usize::from(h & FLOORS != 0));
        f64::from_bits(word(&self.0, at))
    }

    /// The state `p` holds (fresh when there is none), for the tool's `period` (µs).
    pub(super) fn state_of(p: Option<&Packed>, period: f64) -> NodeState {
        match p {
            Some(p) => p.state(period),
            None => NodeState::default(),
        }
    }

    /// The state, for the tool's `period` (µs).
    pub(super) fn state(&self, period: f64) -> NodeState {
        let b = &self.0;
        let h = word(b, 0);
        let f = |at: usize| f64::from_bits(word(b, at));
        let t = f(HEADER);
        let window = engine::aligned_window(t, period);
        // The optional numbers follow the core ones, in this order, each only when present.
        let mut at = HEADER + 8 * CORE;
        let (floor, floor_used) = match h & FLOORS != 0 {
            true => (f(at), f(at + 8)),
            false => (0.0, 0.0),
        };
        at += 16 * usize::from(h & FLOORS != 0);
        let in_flight = if h & FLIGHT != 0 { f(at) } else { 0.0 };
        at += 8 * usize::from(h & FLIGHT != 0);
        let counts = if h & TEMPLATE != 0 { word(b, at) } else { 0 };
        at += 8 * usize::from(h & TEMPLATE != 0);
        let nb = ((h >> BUDGETS_SHIFT) & 3) as usize;
        let counter = |k: usize| BudgetCounter {
            period: period_of(h >> (PERIODS_SHIFT + 2 * k as u32)),
            start: if k < nb { f(at + 16 * k) } else { 0.0 },
            used: if k < nb { f(at + 16 * k + 8) } else { 0.0 },
        };
        NodeState {
            live: true,
            t,
            floor,
            share: f(HEADER + 8),
            ceiling: f(HEADER + 16),
            window,
            total: f(HEADER + 24),
            non_floor: f(HEADER + 32),
            floor_used,
            in_flight,
            template_window: if h & TEMPLATE != 0 { window } else { 0.0 },
            template_in_window: f64::from(counts as u32),
            template_counted: f64::from((counts >> 32) as u32),
            budgets: Budgets::of_first(nb, [counter(0), counter(1), counter(2)]),
        }
    }

    /// Stores `s` (period: the tool's, µs) and its expiry; in place when its numbers take the
    /// same room as before.
    pub(super) fn store(&mut self, s: &NodeState, expires: u64, period: f64) {
        let (layout, template) = layout(s, period);
        let old = self.header();
        let header = layout | (old & UNTENANTED);
        if old & LAYOUT == layout {
            write(&mut self.0, header, expires, s, template);
        } else {
            let name = self.name().to_vec();
            self.0 = Self::build(header, expires, s, template, &name);
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const P: f64 = 60_000_000.0;

    fn arb_state() -> impl Strategy<Value = NodeState> {
        let num = prop_oneof![Just(0.0f64), 0.0f64..1e6, Just(-0.0f64)];
        (
            (
                0.0f64..1e15,
                num.clone(),
                num.clone(),
                num.clone(),
                num.clone(),
            ),
            (
                num.clone(),
                num.clone(),
                0u32..5,
                0u32..1000,
                0u32..1000,
                0i64..3,
            ),
            prop::collection::vec((0usize..3, 0.0f64..1e15, num), 0..4),
        )
            .prop_map(
                |(
                    (t, floor, share, ceiling, total),
                    (non_floor, floor_used, in_flight, a, b, back),
                    budgets,
                )| {
                    let window = (t / P).floor();
                    let periods = [BudgetPeriod::Hour, BudgetPeriod::Day, BudgetPeriod::Month];
                    let mut s = NodeState {
                        live: true,
                        t,
                        floor,
                        share,
                        ceiling,
                        window,
                        total,
                        non_floor,
                        floor_used,
                        in_flight: f64::from(in_flight),
                        template_window: window - back as f64,
                        template_in_window: f64::from(a.min(b)),
                        template_counted: f64::from(a.max(b)),
                        ..NodeState::default()
                    };
                    for (p, start, used) in budgets {
                        s.budgets.set(BudgetCounter {
                            period: periods[p],
                            start,
                            used,
                        });
                    }
                    s
                },
            )
    }

    proptest! {
        /// Unpacking gives back every number the engine reads, the template counts as of the
        /// state's window; storing again in place or not, the name stays.
        #[test]
        fn a_packed_state_unpacks_to_the_same_decision_inputs(
            s in arb_state(), next in arb_state(), expires in any::<u64>(), untenanted in any::<bool>(),
            name in "[a-z0-9-]{0,40}",
        ) {
            let check = |p: &Packed, s: &NodeState, expires: u64| -> Result<(), TestCaseError> {
                let u = p.state(P);
                let k = s.window;
                let (iw, c) = engine::template_counts(s.template_window, s.template_in_window, s.template_counted, k);
                let mut want = *s;
                // Template counts as of the state's window (0 when there are none).
                want.template_window = if iw == 0.0 && c == 0.0 { 0.0 } else { k };
                want.template_in_window = iw;
                want.template_counted = c;
                prop_assert_eq!(u, want);
                prop_assert_eq!(p.expires(), expires);
                prop_assert_eq!(p.in_flight(), s.in_flight);
                prop_assert_eq!(p.name(), name.as_bytes());
                prop_assert_eq!(p.untenanted(), untenanted);
                Ok(())
            };
            let mut p = Packed::new(&name, untenanted, &s, expires, P);
            check(&p, &s, expires)?;
            p.store(&next, expires ^ 1, P);
            check(&p, &next, expires ^ 1)?;
        }
    }

    #[test]
    fn zeros_are_not_kept() {
        let s = NodeState {
            live: true,
            t: 1e12,
            share: 3.0,
            ceiling: 4.0,
            window: (1e12 / P).floor(),
            total: 1.0,
            ..NodeState::default()
        };
        let p = Packed::new("agent-0", false, &s, 5, P);
        assert_eq!(p.0.len(), HEADER + CORE * 8 + "agent-0".len());
    }
}
