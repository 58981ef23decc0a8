//! What a store keeps per level (a call's levels together: [`Snapshot`]) and what an admitted
//! call charged: the records the engine reads and writes.

use super::plan::CallKeys;
use crate::clock::Timestamp;
use crate::policy::{BudgetPeriod, MAX_PLANS};

/// A budget counter: units used in the window that starts at `start` (µs).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct BudgetCounter {
    /// Which calendar window.
    pub period: BudgetPeriod,
    /// Start of the window counted, µs since the epoch.
    pub start: f64,
    /// Units used in it.
    pub used: f64,
}

/// The stored state of one level (tool, tenant or instance). A handful of numbers.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct NodeState {
    /// False for a level never seen (or expired): its buckets are full.
    pub live: bool,
    /// When the buckets were last brought up to date, µs.
    pub t: f64,
    /// Floor bucket tokens.
    pub floor: f64,
    /// Share bucket tokens.
    pub share: f64,
    /// Ceiling bucket tokens (for the tool: the shared pool).
    pub ceiling: f64,
    /// The aligned window (`floor(now / P)`) the counters below belong to.
    pub window: f64,
    /// Units through this level in the window.
    pub total: f64,
    /// Non-floor units at this level in the window.
    pub non_floor: f64,
    /// Floor units in the window (for the tool: floor units of every caller).
    pub floor_used: f64,
    /// Calls in flight holding a permit at this level.
    pub in_flight: f64,
    /// For a level whose children include template callers: the aligned window the two counts
    /// below belong to.
    pub template_window: f64,
    /// Template children admitted in that window.
    pub template_in_window: f64,
    /// Template children admitted in that window or the one before: the ones counted.
    pub template_counted: f64,
    /// Calendar budget counters.
    pub budgets: Budgets,
}

/// A tool's counts of unlisted tenants per plan, in the policy's plan order: for each,
/// (admitted in the tool's `template_window`, counted), as [`NodeState::template_in_window`]
/// and [`NodeState::template_counted`] are for `default_tenant`. Kept beside the tool's
/// state (a tenant or an instance has none); all zero for a tool without plans.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanCounts([[u32; 2]; MAX_PLANS]);

impl PlanCounts {
    /// No counts: a tenant's (it has no plans).
    pub const NONE: PlanCounts = PlanCounts([[0; 2]; MAX_PLANS]);
    /// Plan `i`'s counts (its place among the tool's plans): (admitted in the window,
    /// counted).
    pub fn get(&self, i: usize) -> (u32, u32) {
        let [a, b] = self.0[i];
        (a, b)
    }
    /// Sets plan `i`'s counts.
    pub fn set(&mut self, i: usize, in_window: u32, counted: u32) {
        self.0[i] = [in_window, counted];
    }
    /// How many plans' counts are held: one past the last plan with a count that is not zero.
    pub fn len(&self) -> usize {
        self.0
            .iter()
            .rposition(|c| *c != [0, 0])
            .map_or(0, |i| i + 1)
    }
    /// Whether every count is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A level's calendar budget counters, held inline: at most one per period (hour, day,
/// month), so a state is a fixed-size value and reading or copying one allocates nothing.
/// Derefs to a slice of the counters held; two lists are equal when they hold the same
/// counters.
#[derive(Copy, Clone)]
pub struct Budgets {
    len: u8,
    items: [BudgetCounter; 3],
}

impl PartialEq for Budgets {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Default for Budgets {
    fn default() -> Self {
        let unused = BudgetCounter {
            period: BudgetPeriod::Hour,
            start: 0.0,
            used: 0.0,
        };
        Budgets {
            len: 0,
            items: [unused; 3],
        }
    }
}

impl std::fmt::Debug for Budgets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Budgets {
    /// Sets the counter of `c.period`: replaces the one held for that period, or adds it.
    pub fn set(&mut self, c: BudgetCounter) {
        if let Some(x) = self.iter_mut().find(|x| x.period == c.period) {
            *x = c;
            return;
        }
        let at = usize::from(self.len);
        assert!(at < 3, "at most one budget counter per period");
        self.items[at] = c;
        self.len += 1;
    }

    /// Units counted in `period`'s window that starts at `start` (µs; 0 when the counter
    /// counts another window, or there is none).
    pub fn used_in(&self, period: BudgetPeriod, start: f64) -> f64 {
        let counter = self.iter().find(|c| c.period == period && c.start == start);
        counter.map_or(0.0, |c| c.used)
    }

    /// The counters `items[..len]` (of distinct periods, as a store wrote them).
    pub(crate) fn of_first(len: usize, items: [BudgetCounter; 3]) -> Self {
        Budgets {
            len: len.min(3) as u8,
            items,
        }
    }

    /// Drops every counter.
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

impl std::ops::Deref for Budgets {
    type Target = [BudgetCounter];
    fn deref(&self) -> &[BudgetCounter] {
        &self.items[..usize::from(self.len)]
    }
}

impl std::ops::DerefMut for Budgets {
    fn deref_mut(&mut self) -> &mut [BudgetCounter] {
        &mut self.items[..usize::from(self.len)]
    }
}

impl FromIterator<BudgetCounter> for Budgets {
    /// Panics past one counter per period.
    fn from_iter<I: IntoIterator<Item = BudgetCounter>>(iter: I) -> Self {
        let mut out = Budgets::default();
        for c in iter {
            out.set(c);
        }
        out
    }
}

impl<'a> IntoIterator for &'a Budgets {
    type Item = &'a BudgetCounter;
    type IntoIter = std::slice::Iter<'a, BudgetCounter>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// What one level charged, so the charge can be corrected or refunded later.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LevelCharge {
    /// Whether the level took part.
    pub present: bool,
    /// Units taken from the floor bucket, its depth.
    pub floor: f64,
    /// Depth of the floor bucket.
    pub floor_depth: f64,
    /// Units taken from the share bucket.
    pub share: f64,
    /// Depth of the share bucket.
    pub share_depth: f64,
    /// Units taken from the ceiling bucket / pool.
    pub ceiling: f64,
    /// Depth of the ceiling bucket / pool.
    pub ceiling_depth: f64,
    /// Whether a concurrency permit was taken here.
    pub permit: bool,
    /// Budget windows charged: (period, window start).
    pub budgets: ChargedBudgets,
}

/// The budget windows a call was charged at one level: the calendar periods, and the instant
/// the call was decided at, which says the windows (`(period, window start µs)`). Small and
/// `Copy`: an answer carries one per level.
#[derive(Copy, Clone, Default, PartialEq, Eq)]
pub struct ChargedBudgets {
    /// One bit per period charged (`BudgetPeriod::index`).
    periods: u8,
    /// When the call was decided (µs).
    at: u64,
}

impl std::fmt::Debug for ChargedBudgets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl ChargedBudgets {
    /// The windows of `periods` that hold the instant `at` (µs).
    pub fn at(at: u64, periods: impl IntoIterator<Item = BudgetPeriod>) -> Self {
        let periods = periods.into_iter().fold(0, |m, p| m | 1 << p.index());
        ChargedBudgets { periods, at }
    }

    /// The windows, as (period, window start µs), hour first.
    pub fn iter(&self) -> impl Iterator<Item = (BudgetPeriod, f64)> + '_ {
        let at = crate::clock::Timestamp(self.at);
        BudgetPeriod::ALL
            .into_iter()
            .filter(|p| self.periods & 1 << p.index() != 0)
            .map(move |p| (p, p.window(at).0.as_micros() as f64))
    }

    /// How many windows.
    pub fn len(&self) -> usize {
        self.periods.count_ones() as usize
    }

    /// Whether none was charged.
    pub fn is_empty(&self) -> bool {
        self.periods == 0
    }
}

/// What an admitted call charged: the input to correction, refund and permit release.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Charge {
    /// The cost charged.
    pub cost: f64,
    /// The aligned window the call was counted in.
    pub window: f64,
    /// Tool, tenant, instance.
    pub levels: [LevelCharge; 3],
}

impl Charge {
    /// Whether any concurrency permit was taken.
    pub fn holds_permits(&self) -> bool {
        self.levels.iter().any(|l| l.permit)
    }
}

/// An admitted call, as the store reports it.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Admission {
    /// Which levels were charged.
    pub keys: CallKeys,
    /// What was charged where.
    pub charge: Charge,
    /// Units of the caller's quota (its ceiling per period, [`quota`](Self::quota)) left in
    /// the current aligned window: the `r` of the `RateLimit` header, stated against `q`.
    pub remaining: f64,
    /// The caller's ceiling per period.
    pub quota: f64,
    /// Microseconds until the aligned window resets.
    pub reset_in: f64,
    /// Pool tokens left at the tool: the slack to lend.
    pub slack: f64,
    /// Tenant and instance numbers at the time of the decision.
    pub views: [LevelView; 2],
    /// When the store decided (its clock, or the caller's).
    pub at: Timestamp,
    /// The store's name for this call, unique across replicas: what its concurrency permits
    /// are held under (0 for a store that needs none, like the
    /// [`MemoryStore`](crate::MemoryStore)).
    pub call: u128,
}

/// The numbers that explain a decision at one level (for logs, headers and disputes).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct LevelView {
    /// Weight.
    pub weight: f64,
    /// Floor per period.
    pub floor: f64,
    /// Nominal share per period (with the template callers counted now).
    pub share: f64,
    /// Ceiling per period.
    pub ceiling: f64,
}

/// What a store holds for a call's levels, as [`Store::inspect`](crate::Store::inspect) reads
/// it: each level's state, tool first (`None` where nothing is stored), and the tool's counts
/// of unlisted tenants per plan. Derefs to the three states.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct Stored {
    /// The tool's, the tenant's and the instance's state.
    pub levels: [Option<NodeState>; 3],
    /// The tool's counts of unlisted tenants per plan.
    pub plans: PlanCounts,
}

impl std::ops::Deref for Stored {
    type Target = [Option<NodeState>; 3];
    fn deref(&self) -> &[Option<NodeState>; 3] {
        &self.levels
    }
}

/// The stored states a decision reads; on an admission, the states to write back.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// The tool's state.
    pub tool: NodeState,
    /// The tenant's state.
    pub tenant: NodeState,
    /// The instance's state (ignored without an instance).
    pub instance: NodeState,
    /// The tool's counts of unlisted tenants per plan, kept beside its state.
    pub plans: PlanCounts,
}

impl Snapshot {
    /// The states: tool, tenant, instance.
    pub(super) fn levels(&self) -> [&NodeState; 3] {
        [&self.tool, &self.tenant, &self.instance]
    }

    /// Level `idx`'s state (0 tool, 1 tenant, 2 instance), mutably.
    pub(super) fn level_mut(&mut self, idx: usize) -> &mut NodeState {
        match idx {
            0 => &mut self.tool,
            1 => &mut self.tenant,
            _ => &mut self.instance,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal counters are equal values, whatever a cleared list held before: a cleared and
    /// refilled list compares by what it holds now.
    #[test]
    fn cleared_lists_compare_by_what_they_hold() {
        let day = BudgetCounter {
            period: BudgetPeriod::Day,
            start: 86_400e6,
            used: 2.0,
        };
        let hour = BudgetCounter {
            period: BudgetPeriod::Hour,
            start: 3_600e6,
            used: 1.0,
        };
        let mut reused: Budgets = [day, hour].into_iter().collect();
        reused.clear();
        reused.set(day);
        let fresh: Budgets = [day].into_iter().collect();
        assert_eq!(reused, fresh);
    }
}
