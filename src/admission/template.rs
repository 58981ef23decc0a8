//! Template callers counted: a caller a template (`default_tenant`, `default_instance`)
//! governs counts at its parent from its first admitted call in an aligned window to the end
//! of the next window. Shares are split among the template callers counted, and at most
//! `max_tenants` / `max_instances` of them count at once.
//!
//! The parent keeps two numbers per window — its template children admitted in it, and those
//! admitted in it or in the window before (the ones counted) — and each child's own state
//! already says in which window it was last admitted. So counting is exact, costs no scan and
//! no index, and is the same on every store.

use super::state::{NodeState, Scalars};

/// How a template child stands at window `k`: last admitted in `k`, in `k − 1`, or earlier
/// (or never): not counted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Standing {
    ThisWindow,
    LastWindow,
    NotCounted,
}

impl Standing {
    /// Whether it counts now.
    pub(super) fn counted(self) -> bool {
        self != Standing::NotCounted
    }
}

/// How the child whose stored state is `s` stands at window `k`.
#[inline]
pub(super) fn standing(s: &NodeState, k: f64) -> Standing {
    if !s.live {
        Standing::NotCounted
    } else if s.window == k {
        Standing::ThisWindow
    } else if s.window == k - 1.0 {
        Standing::LastWindow
    } else {
        Standing::NotCounted
    }
}

/// A parent's counts at window `k`: (admitted in `k`, counted).
#[inline]
pub(crate) fn counts(window: f64, in_window: f64, counted: f64, k: f64) -> (f64, f64) {
    if window == k {
        (in_window, counted)
    } else if window == k - 1.0 {
        // Those admitted in the last window still count; none yet in this one.
        (0.0, in_window)
    } else {
        (0.0, 0.0)
    }
}

/// The template children counted at `s`'s level at window `k`.
#[inline]
pub(crate) fn counted_at(s: &NodeState, k: f64) -> u64 {
    counts(
        s.template_window,
        s.template_in_window,
        s.template_counted,
        k,
    )
    .1 as u64
}

/// Counts a child, standing as `before`, admitted at window `k`.
#[inline]
pub(super) fn count_child(parent: &mut Scalars, before: Standing, k: f64) {
    let (mut in_window, mut counted) = counts(
        parent.template_window,
        parent.template_in_window,
        parent.template_counted,
        k,
    );
    match before {
        Standing::ThisWindow => {}
        Standing::LastWindow => in_window += 1.0,
        Standing::NotCounted => {
            in_window += 1.0;
            counted += 1.0;
        }
    }
    parent.template_window = k;
    parent.template_in_window = in_window;
    // Never fewer counted than admitted in this window, even after one of the two states was
    // lost (an evicted record): the counts heal within two windows.
    parent.template_counted = counted.max(in_window);
}

/// Until when (µs) a template child admitted at window `k` counts: the end of the next window.
#[inline]
pub(super) fn counted_until(k: f64, period: f64) -> f64 {
    (k + 2.0) * period
}

/// Until when (µs) a parent's counts are not all zero (0: they are).
#[inline]
pub(super) fn counts_until(parent: &Scalars, period: f64) -> f64 {
    if parent.template_in_window > 0.0 {
        counted_until(parent.template_window, period)
    } else if parent.template_counted > 0.0 {
        (parent.template_window + 1.0) * period
    } else {
        0.0
    }
}

/// When (µs) the first template child counted at `s`'s level at window `k` stops counting:
/// the end of this window if one was last admitted in the window before, else the end of the
/// next.
#[inline]
pub(super) fn until_one_leaves(s: &NodeState, k: f64, period: f64) -> f64 {
    let (in_window, counted) = counts(
        s.template_window,
        s.template_in_window,
        s.template_counted,
        k,
    );
    if counted > in_window {
        (k + 1.0) * period
    } else {
        counted_until(k, period)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn child(window: f64) -> NodeState {
        NodeState {
            live: true,
            window,
            ..NodeState::default()
        }
    }

    /// Three children over four windows: each counts from its first call in a window to the
    /// end of the next, exactly once.
    #[test]
    fn a_child_counts_from_its_call_to_the_end_of_the_next_window() {
        let mut parent = Scalars::default();
        // Window 10: a and b are admitted (a twice).
        count_child(&mut parent, standing(&NodeState::default(), 10.0), 10.0);
        count_child(&mut parent, standing(&child(10.0), 10.0), 10.0);
        count_child(&mut parent, standing(&NodeState::default(), 10.0), 10.0);
        let mut s = NodeState::default();
        parent.write(&mut s);
        assert_eq!(counted_at(&s, 10.0), 2);
        // Window 11: both still count; c joins; a calls again (counted once).
        assert_eq!(counted_at(&s, 11.0), 2);
        count_child(&mut parent, standing(&NodeState::default(), 11.0), 11.0);
        count_child(&mut parent, standing(&child(10.0), 11.0), 11.0);
        parent.write(&mut s);
        assert_eq!(counted_at(&s, 11.0), 3);
        // Window 12: b (last in 10) no longer counts; a and c (in 11) do.
        assert_eq!(counted_at(&s, 12.0), 2);
        assert_eq!(standing(&child(10.0), 12.0), Standing::NotCounted);
        // Window 14: nobody.
        assert_eq!(counted_at(&s, 14.0), 0);
    }
}
