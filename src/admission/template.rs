//! Template callers counted (`docs/semantics.md`, *Template callers*): a parent keeps, per
//! window, its template children admitted in it and those counted (admitted in it or in the
//! window before), and each child's state says in which window it was last admitted.
//!
//! A tool counts its unlisted tenants per template slot: `default_tenant`'s in its state, each
//! plan's beside it ([`PlanCounts`]); a tenant counts its `default_instance` children only.
//! So the functions below take a parent's state with its plans' counts (none for a tenant).

use super::state::{NodeState, PlanCounts};

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

/// The template children of `slot` counted at the level of `parent` (with its plans'
/// counts) at window `k`: for a tool, the unlisted tenants of `default_tenant` (slot 0) or
/// of a plan; for a tenant (slot 0, no plans), its template instances.
pub(super) fn counted(parent: &NodeState, plans: &PlanCounts, slot: usize, k: f64) -> u64 {
    let (iw, c) = stored(parent, plans, slot);
    counts(parent.template_window, iw, c, k).1 as u64
}

/// Slot `slot`'s counts as stored: (admitted in the parent's template window, counted).
fn stored(parent: &NodeState, plans: &PlanCounts, slot: usize) -> (f64, f64) {
    match slot {
        0 => (parent.template_in_window, parent.template_counted),
        p => {
            let (iw, c) = plans.get(p - 1);
            (f64::from(iw), f64::from(c))
        }
    }
}

fn store(parent: &mut NodeState, plans: &mut PlanCounts, slot: usize, iw: f64, c: f64) {
    match slot {
        0 => {
            parent.template_in_window = iw;
            parent.template_counted = c;
        }
        p => plans.set(p - 1, iw as u32, c as u32),
    }
}

/// Brings every slot's counts to window `k` (they share the parent's window): equal counts
/// are stored alike on every store (the window they are kept for is `k` when any is not
/// zero, else 0).
pub(super) fn roll(parent: &mut NodeState, plans: &mut PlanCounts, k: f64) {
    if parent.template_window == k {
        return;
    }
    let slots = 1 + plans.len();
    let mut any = false;
    for sl in 0..slots {
        let (iw, c) = stored(parent, plans, sl);
        if iw != 0.0 || c != 0.0 {
            let (iw, c) = counts(parent.template_window, iw, c, k);
            store(parent, plans, sl, iw, c);
            any |= iw != 0.0 || c != 0.0;
        }
    }
    parent.template_window = if any { k } else { 0.0 };
}

/// Counts a child of template `slot`, standing as `before`, admitted at window `k`.
pub(super) fn count_child(
    parent: &mut NodeState,
    plans: &mut PlanCounts,
    slot: usize,
    before: Standing,
    k: f64,
) {
    roll(parent, plans, k);
    parent.template_window = k;
    let (was_in_window, was_counted) = stored(parent, plans, slot);
    let (in_window, counted) = match before {
        Standing::ThisWindow => (was_in_window, was_counted),
        Standing::LastWindow => (was_in_window + 1.0, was_counted),
        Standing::NotCounted => (was_in_window + 1.0, was_counted + 1.0),
    };
    // Never fewer counted than admitted in this window, even after one of the two states was
    // lost (an evicted record): the counts heal within two windows.
    let counted = counted.max(in_window);
    // A child counted already in this window (most calls) changes nothing: nothing is
    // written, so the counts read next are not waiting on a write of the same values.
    if (in_window, counted) != (was_in_window, was_counted) {
        store(parent, plans, slot, in_window, counted);
    }
}

/// Until when (µs) a template child admitted at window `k` counts: the end of the next window.
pub(super) fn counted_until(k: f64, period: f64) -> f64 {
    (k + 2.0) * period
}

/// Until when (µs) a parent's counts are not all zero (0: they are).
pub(super) fn counts_until(parent: &NodeState, plans: &PlanCounts, period: f64) -> f64 {
    let slots = 1 + plans.len();
    let (mut any_in_window, mut any_counted) = (false, false);
    for sl in 0..slots {
        let (iw, c) = stored(parent, plans, sl);
        any_in_window |= iw > 0.0;
        any_counted |= c > 0.0;
    }
    if any_in_window {
        counted_until(parent.template_window, period)
    } else if any_counted {
        (parent.template_window + 1.0) * period
    } else {
        0.0
    }
}

/// When (µs) the first template child of `slot` counted at `s`'s level at window `k` stops
/// counting: the end of this window if one was last admitted in the window before, else the
/// end of the next.
pub(super) fn until_one_leaves(
    s: &NodeState,
    plans: &PlanCounts,
    slot: usize,
    k: f64,
    period: f64,
) -> f64 {
    let (iw, c) = stored(s, plans, slot);
    let (in_window, n) = counts(s.template_window, iw, c, k);
    if n > in_window {
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

    /// Counts a child of slot 0 (`default_tenant`), standing as `before`, admitted at window
    /// `k`; no plans counted.
    fn admit(parent: &mut NodeState, before: &NodeState, k: f64) {
        count_child(
            parent,
            &mut PlanCounts::default(),
            0,
            standing(before, k),
            k,
        );
    }

    /// Three children over four windows: each counts from its first call in a window to the
    /// end of the next, exactly once.
    #[test]
    fn a_child_counts_from_its_call_to_the_end_of_the_next_window() {
        let mut parent = NodeState::default();
        // Window 10: a and b are admitted (a twice).
        admit(&mut parent, &NodeState::default(), 10.0);
        admit(&mut parent, &child(10.0), 10.0);
        admit(&mut parent, &NodeState::default(), 10.0);
        let s = parent;
        assert_eq!(counted(&s, &PlanCounts::NONE, 0, 10.0), 2);
        // Window 11: both still count; c joins; a calls again (counted once).
        assert_eq!(counted(&s, &PlanCounts::NONE, 0, 11.0), 2);
        admit(&mut parent, &NodeState::default(), 11.0);
        admit(&mut parent, &child(10.0), 11.0);
        let s = parent;
        assert_eq!(counted(&s, &PlanCounts::NONE, 0, 11.0), 3);
        // Window 12: b (last in 10) no longer counts; a and c (in 11) do.
        assert_eq!(counted(&s, &PlanCounts::NONE, 0, 12.0), 2);
        assert_eq!(standing(&child(10.0), 12.0), Standing::NotCounted);
        // Window 14: nobody.
        assert_eq!(counted(&s, &PlanCounts::NONE, 0, 14.0), 0);
    }
}
