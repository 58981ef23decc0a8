//! The decision: a call's plan and the stored states of its levels in; the new states and
//! what the call charged out, or a refusal. Pure: the same plan and states always give the
//! same answer.

use std::sync::Arc;
use std::time::Duration;

use super::bucket::{aligned_window, bucket, calendar_window, expiry, refill, roll_window, EPS};
use super::plan::Plan;
use super::refusal::{Reason, Refusal, Scope};
use super::state::{
    Admission, BudgetCounter, Charge, ChargedBudgets, LevelCharge, LevelView, NodeState,
    PlanCounts, Snapshot,
};
use super::template::{self, Standing};
use super::walk::{Deciding, Fail, Label, Level};
use crate::clock::Timestamp;
use crate::policy::numbers::{instance_numbers, level_numbers, LevelNumbers};
use crate::policy::{Budget, LevelPolicy};

/// An admitted call: its answer, and how long its levels' states must be kept.
#[derive(Clone, Debug, Default)]
pub struct Admitted {
    /// When each level's state may be forgotten without changing any future decision (µs):
    /// tool, tenant, instance, provided it holds no permits.
    pub expires: [f64; 3],
    /// The answer: what was charged where, under the plan's keys, and the figures the caller
    /// is told. Its `call` is 0; a store that holds per-call entries names the call.
    pub admission: Arc<Admission>,
}

/// The time a call is decided at: its own, or the latest time any of its levels' states was
/// decided at, if that is later. Calls of one record may reach the store in another order than
/// their clocks were read in (threads racing for the record, replicas' clocks): deciding one
/// before its record's time would move the record's windows back. A call decided a little
/// later than it was made is like a call made a little later.
pub fn decided_at(now: Timestamp, states: &[&NodeState]) -> Timestamp {
    let mut at = now;
    for s in states {
        if s.live && s.t > at.0 as f64 {
            at = at.max(Timestamp(s.t as u64));
        }
    }
    at
}

/// Decides one call on `snap`, the stored states of its levels. Admitted: `snap` holds the
/// states to write back. Refused: nothing is to be written (`snap` is left half worked on).
/// [`Deciding::commit`] then [`Deciding::answer`].
pub fn decide(plan: &Plan<'_>, snap: &mut Snapshot) -> Result<Admitted, Refusal> {
    let mut d = Deciding::new(plan, snap);
    d.commit(snap)?;
    Ok(d.answer(snap))
}

/// What [`decide`] would answer for `plan` on `snap`, and how each level stands, with
/// nothing written anywhere: for `Limiter::explain`.
pub(crate) struct Explained {
    pub(crate) verdict: Result<(), Refusal>,
    pub(crate) levels: Vec<LevelFigures>,
}

/// [`decide`] without its outcome: the verdict and each level's figures.
pub(crate) fn explain(plan: &Plan<'_>, snap: &Snapshot) -> Explained {
    let mut snap = snap.clone();
    let mut d = Deciding::new(plan, &snap);
    if let Err(f) = d.prepare(&mut snap) {
        return Explained {
            verdict: Err(d.refuse(f)),
            levels: Vec::new(),
        };
    }
    let levels = d.figures(&snap);
    let verdict = d.check(&snap).map(|_| ()).map_err(|f| d.refuse(f));
    Explained { verdict, levels }
}

impl<'p, 'a> Deciding<'p, 'a> {
    /// The call of `plan` at its instant: its own, or, if later, the latest instant any of
    /// the states in `snap` was decided at (see [`decided_at`]).
    #[inline]
    pub fn new(plan: &'p Plan<'a>, snap: &Snapshot) -> Self {
        let n = if plan.instance.is_some() { 3 } else { 2 };
        let at = decided_at(plan.now, &snap.levels()[..n]);
        let now = at.as_micros() as f64;
        let period = plan.tool.period.as_micros() as f64;
        let window = aligned_window(now, period);
        let tool = tool_level(plan);
        Deciding {
            plan,
            at,
            levels: [tool; 3],
            n,
            banks: [0.0; 3],
            now,
            period,
            window,
            next_window: (window + 1.0) * period,
            standing: [Standing::NotCounted; 2],
            takes: [[0.0; 3]; 3],
            counted_until: [0.0; 3],
            tool_expires: 0.0,
        }
    }

    /// Checks the call on `snap`, the stored states of its levels, and, if it passes,
    /// commits it to them: `snap` holds the states to write back. Refused: nothing is to be
    /// written (`snap` is left half worked on).
    #[inline]
    pub fn commit(&mut self, snap: &mut Snapshot) -> Result<(), Refusal> {
        let takes = match self.prepare(snap).and_then(|()| self.check(snap)) {
            Ok(takes) => takes,
            Err(f) => return Err(self.refuse(f)),
        };
        self.takes = takes;
        for (idx, take) in takes.into_iter().enumerate().take(self.n) {
            self.commit_level(idx, take, snap.level_mut(idx));
        }
        // The tool counts every floor unit drawn below it, for the window report.
        let floor_units: f64 = takes[..self.n].iter().map(|t| t[0]).sum();
        snap.tool.floor_used += floor_units - takes[0][0];
        self.counted_until = self.count_children(snap);
        self.tool_expires = self.expiry(snap, 0);
        Ok(())
    }

    /// When the tool's state may be forgotten without changing any future decision (µs),
    /// provided it holds no permits, once the call is [committed](Self::commit): what a
    /// store writes with the tool's state.
    #[inline]
    pub fn tool_expires(&self) -> f64 {
        self.tool_expires
    }

    /// When level `idx`'s state in `snap` may be forgotten (µs): its buckets full, its
    /// windows and budgets over, its template counts done.
    fn expiry(&self, snap: &Snapshot, idx: usize) -> f64 {
        let times = [self.now, self.period, self.next_window];
        let s = snap.levels()[idx];
        expiry(s, &self.levels[idx].buckets, times).max(self.counted_until[idx])
    }

    /// The callers counted, every level's numbers, its state refilled and rolled; or why one
    /// template caller would be too many.
    fn prepare(&mut self, snap: &mut Snapshot) -> Result<(), Fail> {
        self.count_callers(snap)?;
        self.level_numbers(snap);
        self.bring_up_to_date(snap);
        Ok(())
    }

    /// How the tenant and the instance stand among their parents' template children; or why
    /// one not counted yet would be one too many.
    fn count_callers(&mut self, snap: &Snapshot) -> Result<(), Fail> {
        for idx in 1..self.n {
            let Some(p) = self.plan.policy(idx).filter(|p| p.template) else {
                continue;
            };
            let standing = template::standing(snap.levels()[idx], self.window);
            self.standing[idx - 1] = standing;
            let (parent, plans, slot) = self.template_parent(snap, idx);
            let n = template::counted(parent, plans, slot, self.window);
            if !standing.counted() && n >= p.max_tracked {
                // Exact from the parent's counts: when one of the counted stops counting.
                let leaves =
                    template::until_one_leaves(parent, plans, slot, self.window, self.period);
                let scope = [Scope::Tenant, Scope::Instance][idx - 1];
                let (limit, callers) = (p.max_tracked as f64, Label::Word("callers"));
                let wait = leaves - self.now;
                return Err(Fail::new(
                    Reason::CapExceeded,
                    scope,
                    callers,
                    limit,
                    n as f64,
                    wait,
                ));
            }
        }
        Ok(())
    }

    /// Where the caller at level `idx` (1 tenant, 2 instance) counts as a template child:
    /// its parent's state, the parent's plans' counts (a tenant has none) and its slot.
    fn template_parent<'s>(
        &self,
        snap: &'s Snapshot,
        idx: usize,
    ) -> (&'s NodeState, &'s PlanCounts, usize) {
        match idx {
            1 => (&snap.tool, &snap.plans, self.plan.tenant.policy.slot),
            _ => (&snap.tenant, &PlanCounts::NONE, 0),
        }
    }

    /// Whether the caller at level `idx` (1 tenant, 2 instance) is a template caller not
    /// counted yet: counted with this call.
    fn fresh(&self, idx: usize) -> bool {
        let template = self.plan.policy(idx).is_some_and(|p| p.template);
        template && !self.standing[idx - 1].counted()
    }

    /// The tenant's and the instance's numbers with the template callers counted (this call's
    /// own with them), and the share banks their parents hold for their children.
    fn level_numbers(&mut self, snap: &Snapshot) {
        let (tool, t_pol, k) = (self.plan.tool, self.plan.tenant.policy, self.window);
        let c = self.plan.cost;
        let own_slot = self.fresh(1).then_some(t_pol.slot);
        // Each template of the tool (`default_tenant`, then each plan's) with its tenants.
        let templates = (0..1 + tool.plans.len()).filter_map(|slot| {
            let n = || template::counted(&snap.tool, &snap.plans, slot, k);
            tool.template(slot)
                .map(|p| (p, n() + u64::from(own_slot == Some(slot))))
        });
        let weight = templates
            .clone()
            .fold(tool.configured_weight, |w, (p, n)| w + p.weight * n as f64);
        let tn = level_numbers(t_pol, tool.spare(), weight);
        let (tool_banks, tenant_bank) = banks(
            tool.burst,
            tool.configured_tenant_burst,
            templates.map(|(p, n)| (p.burst, n)),
            t_pol.burst,
            c,
        );
        self.levels[1] = caller_level(Scope::Tenant, tn, tenant_bank, t_pol, self.fresh(1));
        self.banks[0] = tool_banks;
        let Some(i) = self.plan.instance else {
            return;
        };
        let n_instances =
            template::counted(&snap.tenant, &PlanCounts::NONE, 0, k) + u64::from(self.fresh(2));
        let inn = instance_numbers(t_pol, tn, i.policy, n_instances as f64);
        let template_burst = t_pol.default_child.as_ref().map_or(0.0, |d| d.burst);
        let (instance_banks, instance_bank) = banks(
            t_pol.burst,
            t_pol.configured_child_burst,
            std::iter::once((template_burst, n_instances)),
            i.policy.burst,
            c,
        );
        self.levels[2] = caller_level(Scope::Instance, inn, instance_bank, i.policy, self.fresh(2));
        self.banks[1] = instance_banks;
    }

    /// Every level's state refilled and rolled to this instant. A template caller not counted
    /// yet starts with no more banked share than its parent's bucket holds beyond the other
    /// children's banks: many of them arriving at once would otherwise bank more share than
    /// the tool can back, and those calling last would be crowded out by the others' bursts.
    fn bring_up_to_date(&self, snap: &mut Snapshot) {
        let parent_depth = [self.plan.tool.burst, self.plan.tenant.policy.burst];
        let (now, period, window) = (self.now, self.period, self.window);
        // The template children's counts of the tool (its plans' with them) and the tenant.
        template::roll(&mut snap.tool, &mut snap.plans, window);
        template::roll(&mut snap.tenant, &mut PlanCounts::default(), window);
        for (idx, l) in self.levels[..self.n].iter().enumerate() {
            let s = snap.level_mut(idx);
            refill(s, &l.buckets, now, period);
            roll_window(s, window);
            if l.fresh {
                let others = self.banks[idx - 1] - l.share_b().depth;
                s.share = s.share.min(parent_depth[idx - 1] - others).max(0.0);
            }
        }
    }

    /// Every check: concurrency, budgets, the walk (share first, else floor first). The
    /// units each level takes, or the worst failure with the time the same call surely
    /// cannot pass before.
    fn check(&self, snap: &Snapshot) -> Result<[[f64; 3]; 3], Fail> {
        let states = snap.levels();
        for (idx, s) in states.iter().enumerate().take(self.n) {
            let Some(cap) = self.plan.cap(idx) else {
                continue;
            };
            if s.in_flight + 1.0 > cap as f64 {
                let (scope, window) = (self.levels[idx].scope, Label::Word("in_flight"));
                let (reason, cap) = (Reason::ConcurrencyExceeded, cap as f64);
                return Err(Fail::new(reason, scope, window, cap, s.in_flight, 1e6));
            }
        }
        let mut worst = None;
        for (idx, s) in states.iter().enumerate().take(self.n) {
            for b in self.budgets(idx) {
                if let Some(f) = self.budget_fail(idx, b, s) {
                    Fail::keep_worse(&mut worst, f);
                }
            }
        }
        // A budget's wait is exact: the longest one is a sure wait.
        let mut sure_wait = worst.map_or(0.0, |f: Fail| f.wait);
        let takes = match self.walk(snap, true).or_else(|_| self.walk(snap, false)) {
            Ok(t) => t,
            Err(f) => {
                sure_wait = sure_wait.max(self.sure_wait(snap, &f));
                Fail::keep_worse(&mut worst, f);
                [[0.0; 3]; 3]
            }
        };
        match worst {
            Some(mut f) => {
                f.sure_wait = sure_wait;
                Err(f)
            }
            None => Ok(takes),
        }
    }

    /// Level `idx`'s calendar budgets.
    fn budgets(&self, idx: usize) -> &'a [Budget] {
        match idx {
            0 => &self.plan.tool.budgets,
            l => self.plan.policy(l).map_or(&[], |p| &p.budgets),
        }
    }

    /// Why budget `b` of level `idx` (state `s`) cannot take the call, if it cannot.
    fn budget_fail(&self, idx: usize, b: &Budget, s: &NodeState) -> Option<Fail> {
        let c = self.plan.cost;
        let (start, end) = calendar_window(b.period, self.at);
        let used = s.budgets.used_in(b.period, start);
        if used + c <= b.max + EPS {
            return None;
        }
        // A calendar window: the wait is exact.
        let wait = if c > b.max + EPS {
            f64::INFINITY
        } else {
            end - self.now
        };
        let (scope, window) = (self.levels[idx].scope, Label::Word(b.period.as_str()));
        Some(Fail {
            window_secs: Some(((end - start) / 1e6) as u64),
            reset_at: Some(end),
            sure_wait: wait,
            ..Fail::new(Reason::CapExceeded, scope, window, b.max, used, wait)
        })
    }

    /// The answer to the call [committed](Self::commit) on `snap` (as it left it): what was
    /// charged where, the figures the caller is told, and when each level's state may be
    /// forgotten. Reads nothing a store must lock.
    #[inline]
    pub fn answer(&self, snap: &Snapshot) -> Admitted {
        let mut expires = [self.tool_expires, 0.0, 0.0];
        for (idx, e) in expires.iter_mut().enumerate().take(self.n).skip(1) {
            *e = self.expiry(snap, idx);
        }
        let charged = |idx: usize| {
            if idx < self.n {
                self.charge_of(idx, self.takes[idx])
            } else {
                LevelCharge::default()
            }
        };
        let view = |idx: usize| {
            if idx < self.n {
                self.levels[idx].view()
            } else {
                LevelView::default()
            }
        };
        Admitted {
            expires,
            admission: Arc::new(Admission {
                keys: self.plan.keys(),
                charge: Charge {
                    cost: self.plan.cost,
                    window: self.window,
                    levels: [charged(0), charged(1), charged(2)],
                },
                remaining: self.remaining(snap),
                quota: self.levels[self.n - 1].numbers.ceiling,
                reset_in: self.next_window - self.now,
                slack: snap.tool.ceiling,
                views: [view(1), view(2)],
                at: self.at,
                call: 0,
            }),
        }
    }

    /// The template children this call counts: its tenant at the tool, its instance at the
    /// tenant. Until when each level's state must be kept for those counts (µs; 0: no bound):
    /// a parent while its counts are not all zero, a template caller while it counts.
    fn count_children(&self, snap: &mut Snapshot) -> [f64; 3] {
        let (window, period) = (self.window, self.period);
        let mut until = [0.0; 3];
        for idx in 1..self.n {
            if !self.plan.policy(idx).is_some_and(|p| p.template) {
                continue;
            }
            let (mut none, slot) = (PlanCounts::NONE, self.plan.tenant.policy.slot);
            let (parent, plans, slot) = match idx {
                1 => (&mut snap.tool, &mut snap.plans, slot),
                _ => (&mut snap.tenant, &mut none, 0),
            };
            template::count_child(parent, plans, slot, self.standing[idx - 1], window);
            let parent_until = template::counts_until(parent, plans, period);
            until[idx - 1] = parent_until.max(until[idx - 1]);
            until[idx] = template::counted_until(window, period);
        }
        until
    }

    /// Takes `take` (floor, share, ceiling) from level `idx`'s state `s`, counts the call in
    /// its windows and budgets.
    fn commit_level(&self, idx: usize, [f, h, k]: [f64; 3], s: &mut NodeState) {
        let c = self.plan.cost;
        s.floor -= f;
        s.share -= h;
        s.ceiling -= k;
        s.total += c;
        s.non_floor += k;
        s.floor_used += f;
        if self.plan.takes_permit(idx) {
            s.in_flight += 1.0;
        }
        for b in self.budgets(idx) {
            let start = calendar_window(b.period, self.at).0;
            match s.budgets.iter_mut().find(|x| x.period == b.period) {
                Some(x) if x.start == start => x.used += c,
                Some(x) => {
                    x.start = start;
                    x.used = c;
                }
                None => s.budgets.set(BudgetCounter {
                    period: b.period,
                    start,
                    used: c,
                }),
            }
        }
    }

    /// What the call took at level `idx`, for corrections later.
    fn charge_of(&self, idx: usize, [f, h, k]: [f64; 3]) -> LevelCharge {
        let [fb, hb, kb] = self.levels[idx].buckets;
        let periods = self.budgets(idx).iter().map(|b| b.period);
        LevelCharge {
            present: true,
            floor: f,
            floor_depth: fb.depth,
            share: h,
            share_depth: hb.depth,
            ceiling: k,
            ceiling_depth: kb.depth,
            permit: self.plan.takes_permit(idx),
            budgets: ChargedBudgets::at(self.at.as_micros(), periods),
        }
    }

    /// What is left of the caller's quota (its ceiling per period) in this window, and of
    /// its tenant's when siblings share it: the `r` a client reads against `q`, counting down
    /// to 0 by the window's end.
    fn remaining(&self, snap: &Snapshot) -> f64 {
        let states = snap.levels();
        let callers = self.levels[1..self.n].iter().zip(&states[1..self.n]);
        let remaining = callers.fold(f64::INFINITY, |r, (l, s)| {
            r.min(l.numbers.ceiling - s.total)
        });
        remaining.max(0.0)
    }

    /// The refusal for `f`.
    fn refuse(&self, f: Fail) -> Refusal {
        let (plan, now, tool) = (self.plan, self.now, self.plan.tool);
        let mut r = Refusal::named(
            f.reason,
            tool.name.clone(),
            (!plan.untenanted).then(|| plan.tenant.name.clone()),
            if plan.untenanted {
                Some(plan.tenant.name.clone())
            } else {
                plan.instance.map(|i| i.name.clone())
            },
            Some(match f.window {
                Label::Period => tool.period_label.clone(),
                Label::Word(w) => Arc::from(w),
            }),
        );
        r.scope = Some(f.scope);
        r.limit = Some(f.limit);
        r.used = Some(f.used);
        r.window_secs = f.window_secs;
        r.unit = match f.window {
            Label::Word("in_flight") => Some(crate::policy::Unit::Calls),
            Label::Word("callers") => None,
            _ => Some(tool.unit()),
        };
        if f.wait.is_finite() {
            let wait = f.wait.max(1.0).ceil();
            r.retry_after = Some(Duration::from_micros(wait as u64));
            r.reset_at = Some(Timestamp(f.reset_at.unwrap_or(now + wait) as u64));
            r.retryable = true;
        }
        if f.sure_wait.is_finite() && f.sure_wait > 0.0 {
            r.not_before = Some(Duration::from_micros(f.sure_wait.floor() as u64));
        }
        r
    }

    /// Each level as the decision sees it, nothing charged: its limit per period, units
    /// through it this window, floor, share and the non-floor units it could pass now (the
    /// tool: its pool, within its per-window cap).
    fn figures(&self, snap: &Snapshot) -> Vec<LevelFigures> {
        let states = snap.levels();
        let of = |l: &Level, s: &NodeState| LevelFigures {
            level: l.scope.as_str(),
            limit: l.numbers.ceiling,
            used: s.total,
            floor: l.numbers.floor,
            share: l.numbers.share,
            slack: match l.scope {
                Scope::Tool => s.ceiling.min(l.numbers.ceiling_rate - s.non_floor),
                _ => s.ceiling,
            }
            .max(0.0),
            budgets: Vec::new(),
        };
        let levels = self.levels[..self.n].iter().zip(states);
        levels.map(|(l, s)| of(l, s)).collect()
    }
}

/// The tool's level: its pool of `S = C − Σ floors`, as deep as the tool's burst.
fn tool_level(plan: &Plan<'_>) -> Level {
    let tool = plan.tool;
    let spare = tool.spare();
    Level {
        scope: Scope::Tool,
        numbers: LevelNumbers {
            share: spare,
            ceiling: tool.capacity,
            ceiling_rate: spare,
            ..LevelNumbers::default()
        },
        buckets: [
            bucket(0.0, 0.0),
            bucket(0.0, 0.0),
            bucket(spare, tool.burst),
        ],
        fresh: false,
    }
}

/// A tenant's or an instance's level from its numbers and its share bank.
fn caller_level(
    scope: Scope,
    n: LevelNumbers,
    bank: f64,
    policy: &LevelPolicy,
    fresh: bool,
) -> Level {
    Level {
        scope,
        numbers: n,
        buckets: [
            bucket(n.own_floor, n.own_floor),
            bucket(n.share_rate, bank),
            bucket(n.ceiling_rate, policy.burst),
        ],
        fresh,
    }
}

/// The share banks under a parent whose lending bucket is `depth` deep: (what its children's
/// banks hold together, the calling child's bank), given the configured children's bursts,
/// each template's child burst with how many of its children are counted, and the calling
/// child's burst.
///
/// While the banks fit in the parent's bucket they are the children's bursts; once more
/// template children are counted than it holds banks for, each bank shrinks in proportion
/// so together they fill it, but never below one call (a bank must hold a call). So the
/// parent holds (nearly) every banked share token, and a caller under its share is not
/// crowded out by the others' banked bursts, whatever the order they call in.
fn banks(
    depth: f64,
    configured: f64,
    templates: impl Iterator<Item = (f64, u64)> + Clone,
    own: f64,
    cost: f64,
) -> (f64, f64) {
    let all = templates
        .clone()
        .fold(configured, |sum, (burst, n)| sum + burst * n as f64);
    if all <= depth || all <= 0.0 {
        return (all, own);
    }
    let scale = depth / all;
    let least = |burst: f64| (burst * scale).max(burst.min(2.0 * cost));
    let held = templates.fold(configured * scale, |sum, (burst, n)| {
        sum + least(burst) * n as f64
    });
    (held, least(own))
}

/// One level of a call as the decision sees it now: for [`Explanation`](crate::console::Explanation).
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
#[non_exhaustive]
pub struct LevelFigures {
    /// `tool`, `tenant` or `instance`.
    pub level: &'static str,
    /// Its limit per period: the tool's capacity, a caller's ceiling.
    pub limit: f64,
    /// Units through it in the current aligned window.
    pub used: f64,
    /// Its floor per period (reserved for it, never lent).
    pub floor: f64,
    /// Its nominal share of its parent's spare capacity, with the template callers counted now.
    pub share: f64,
    /// Units above its floor it could pass now: for the tool, the pool left to lend.
    pub slack: f64,
    /// Its budgets (the tool's own too), each with what was spent of it in its current window.
    pub budgets: Vec<BudgetUse>,
}

/// A budget and what was spent of it in the calendar window that holds now.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
#[non_exhaustive]
pub struct BudgetUse {
    /// Its period: `hour`, `day`, `month`…
    pub period: &'static str,
    /// The most it lets through in a window.
    pub max: f64,
    /// Spent of it in the current window.
    pub used: f64,
}
