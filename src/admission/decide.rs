//! The decision: a call's plan and the stored states of its levels in; the new states and
//! what the call charged out, or a refusal. Pure: the same plan and states always give the
//! same answer.

use std::sync::Arc;
use std::time::Duration;

use super::bucket::{aligned_window, bucket, expiry, refill, roll_window, EPS};
use super::plan::Plan;
use super::refusal::{Reason, Refusal, Scope};
use super::state::{
    Admission, BudgetCounter, Charge, ChargedBudgets, LevelCharge, LevelView, NodeState, PlanCounts,
};
use super::template::{self, Counted, Standing};
use super::walk::{Fail, Label, Level, Walker};
use crate::clock::Timestamp;
use crate::policy::numbers::{level_numbers, LevelNumbers};
use crate::policy::{Budget, BudgetPeriod};

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
pub fn decide(plan: &Plan<'_>, snap: &mut Snapshot) -> Result<Admitted, Refusal> {
    let mut d = Decision::new(plan, snap);
    match d.prepare(snap).and_then(|()| d.check(snap)) {
        Ok(takes) => Ok(d.commit(snap, takes)),
        Err(f) => Err(d.refuse(f)),
    }
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
    let mut d = Decision::new(plan, &snap);
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

/// A call's levels at the decision's instant: their numbers, their states brought up to
/// date, how the caller stands among its parents' template children.
struct Decision<'p, 'a> {
    plan: &'p Plan<'a>,
    /// The instant the call is decided at: its own, or its states' latest.
    at: Timestamp,
    levels: [Level<'a>; 3],
    n: usize,
    banks: [f64; 3],
    now: f64,
    period: f64,
    window: f64,
    next_window: f64,
    /// How the tenant and the instance stood among their parents' template children before
    /// this call (template callers only).
    standing: [Standing; 2],
    /// The calendar windows of this instant, worked out once per period.
    windows: Windows,
}

impl<'p, 'a> Decision<'p, 'a> {
    /// The call at its instant (its own, or its states' latest): the tool's level only.
    fn new(plan: &'p Plan<'a>, snap: &Snapshot) -> Self {
        let n = if plan.instance.is_some() { 3 } else { 2 };
        let at = decided_at(plan.now, &snap.levels()[..n]);
        let now = at.as_micros() as f64;
        let period = plan.tool.period.as_micros() as f64;
        let window = aligned_window(now, period);
        let tool = tool_level(plan);
        Decision {
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
            windows: Windows::default(),
        }
    }

    /// The callers counted, every level's numbers, its state refilled and rolled; or why one
    /// template caller would be too many.
    fn prepare(&mut self, snap: &mut Snapshot) -> Result<(), Fail> {
        let (n_tenants, n_instances) = self.count_callers(snap)?;
        self.level_numbers(n_tenants, n_instances);
        self.bring_up_to_date(snap);
        Ok(())
    }

    /// How the tenant and the instance stand among their parents' template children, and
    /// how many are counted with this call: (tenants per template, instances).
    fn count_callers<'s>(&mut self, snap: &'s Snapshot) -> Result<(Counted<'s>, u64), Fail> {
        let (plan, window) = (&self.plan, self.window);
        let mut n_tenants = Counted::at(&snap.tool, &snap.plans, window);
        let t_pol = plan.tenant.policy;
        if t_pol.template {
            self.standing[0] = template::standing(&snap.tenant, window);
            if !self.standing[0].counted() {
                let n = n_tenants.get(t_pol.slot);
                if n >= t_pol.max_tracked {
                    // Exact from the tool's counts: when one of the counted stops counting.
                    let (tool, plans) = (&snap.tool, &snap.plans);
                    let leaves =
                        template::until_one_leaves(tool, plans, t_pol.slot, window, self.period);
                    let wait = leaves - self.now;
                    return Err(too_many(Scope::Tenant, t_pol.max_tracked, n, wait));
                }
                n_tenants = n_tenants.with_own(t_pol.slot);
            }
        }
        let mut n_instances = template::counted_at(&snap.tenant, window);
        if let Some(i) = plan.instance.filter(|i| i.policy.template) {
            self.standing[1] = template::standing(&snap.instance, window);
            if !self.standing[1].counted() {
                if n_instances >= i.policy.max_tracked {
                    let leaves = template::until_one_leaves(
                        &snap.tenant,
                        &PlanCounts::NONE,
                        0,
                        window,
                        self.period,
                    );
                    let wait = leaves - self.now;
                    return Err(too_many(
                        Scope::Instance,
                        i.policy.max_tracked,
                        n_instances,
                        wait,
                    ));
                }
                n_instances += 1;
            }
        }
        Ok((n_tenants, n_instances))
    }

    /// The tenant's and the instance's numbers at the counts given, and the share banks
    /// their parents hold for their children.
    fn level_numbers(&mut self, n_tenants: Counted<'_>, n_instances: u64) {
        let (tool, t_pol, c) = (self.plan.tool, self.plan.tenant.policy, self.plan.cost);
        // Each template of the tool (`default_tenant`, then each plan's) with its tenants.
        let templates = (0..1 + tool.plans.len())
            .filter_map(|slot| tool.template(slot).map(|p| (p, n_tenants.get(slot))));
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
        let fresh = t_pol.template && !self.standing[0].counted();
        self.levels[1] = caller_level(Scope::Tenant, tn, tenant_bank, t_pol, fresh);
        self.banks[0] = tool_banks;
        let Some(i) = self.plan.instance else {
            return;
        };
        let inner_spare = (tn.ceiling - t_pol.children_floor).max(0.0);
        let template_weight = t_pol.default_child.as_ref().map_or(0.0, |d| d.weight);
        let inner_weight = t_pol.configured_child_weight + template_weight * n_instances as f64;
        let inn = level_numbers(i.policy, inner_spare, inner_weight);
        let template_burst = t_pol.default_child.as_ref().map_or(0.0, |d| d.burst);
        let (instance_banks, instance_bank) = banks(
            t_pol.burst,
            t_pol.configured_child_burst,
            std::iter::once((template_burst, n_instances)),
            i.policy.burst,
            c,
        );
        let fresh = i.policy.template && !self.standing[1].counted();
        self.levels[2] = caller_level(Scope::Instance, inn, instance_bank, i.policy, fresh);
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
    fn check(&mut self, snap: &Snapshot) -> Result<[[f64; 3]; 3], Fail> {
        let states = snap.levels();
        for (idx, s) in states.iter().enumerate().take(self.n) {
            if let Some(cap) = self.cap(idx).filter(|cap| s.in_flight + 1.0 > *cap as f64) {
                return Err(Fail::concurrency(self.levels[idx].scope, cap, s.in_flight));
            }
        }
        let mut worst = None;
        for (idx, s) in states.iter().enumerate().take(self.n) {
            self.budget_fails(idx, s, &mut worst);
        }
        // A budget's wait is exact: the longest one is a sure wait.
        let mut sure_wait = worst.map_or(0.0, |f: Fail| f.wait);
        let walker = self.walker(snap);
        let takes = match walker.walk(true).or_else(|_| walker.walk(false)) {
            Ok(t) => t,
            Err(f) => {
                let fewest = [
                    self.plan.tenant.policy.template,
                    self.plan.instance.is_some_and(|i| i.policy.template),
                ];
                sure_wait = sure_wait.max(walker.sure_wait(&f, self.plan.tool, fewest));
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

    fn walker<'s>(&'s self, snap: &'s Snapshot) -> Walker<'s, 'a> {
        Walker {
            levels: &self.levels[..self.n],
            states: [&snap.tool, &snap.tenant, &snap.instance],
            banks: self.banks,
            cost: self.plan.cost,
            period: self.period,
            now: self.now,
            next_window: self.next_window,
            tool_period: self.plan.tool.period,
        }
    }

    /// Level `idx`'s concurrency cap.
    fn cap(&self, idx: usize) -> Option<u32> {
        match idx {
            0 => self.plan.tool.max_concurrency,
            1 => self.plan.tenant.policy.max_concurrency,
            _ => self.plan.instance.and_then(|i| i.policy.max_concurrency),
        }
    }

    /// Level `idx`'s calendar budgets.
    fn budgets(&self, idx: usize) -> &'a [Budget] {
        match idx {
            0 => &self.plan.tool.budgets,
            1 => &self.plan.tenant.policy.budgets,
            _ => self.plan.instance.map_or(&[], |i| &i.policy.budgets),
        }
    }

    /// The failing budgets of level `idx` (state `s`), kept in `worst` if worse.
    fn budget_fails(&mut self, idx: usize, s: &NodeState, worst: &mut Option<Fail>) {
        let (now, c) = (self.now, self.plan.cost);
        for b in self.budgets(idx) {
            let (start, end) = self.windows.get(b.period, self.at);
            let used = s.budgets.used_in(b.period, start);
            if used + c <= b.max + EPS {
                continue;
            }
            // A calendar window: the wait is exact.
            let wait = if c > b.max + EPS {
                f64::INFINITY
            } else {
                end - now
            };
            let f = Fail {
                reason: Reason::CapExceeded,
                scope: self.levels[idx].scope,
                wait,
                window: Label::Word(b.period.as_str()),
                window_secs: Some(((end - start) / 1e6) as u64),
                limit: b.max,
                used,
                reset_at: Some(end),
                sure_wait: wait,
            };
            Fail::keep_worse(worst, f);
        }
    }

    /// The call admitted: `takes` drawn from every level, counted in its windows, budgets
    /// and template counts; the answer.
    fn commit(&mut self, snap: &mut Snapshot, takes: [[f64; 3]; 3]) -> Admitted {
        let mut expires = [0.0; 3];
        for (idx, take) in takes.into_iter().enumerate().take(self.n) {
            expires[idx] = self.commit_level(idx, take, snap.level_mut(idx));
        }
        // The tool counts every floor unit drawn below it, for the window report.
        let floor_units: f64 = takes[..self.n].iter().map(|t| t[0]).sum();
        snap.tool.floor_used += floor_units - takes[0][0];
        let counts = self.count_children(snap);
        for (e, c) in expires.iter_mut().zip(counts).take(self.n) {
            *e = e.max(c);
        }
        let charged = |idx: usize| {
            if idx < self.n {
                self.charge_of(idx, takes[idx])
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
        if self.plan.tenant.policy.template {
            let slot = self.plan.tenant.policy.slot;
            template::count_child(
                &mut snap.tool,
                &mut snap.plans,
                slot,
                self.standing[0],
                window,
            );
            until[0] = template::counts_until(&snap.tool, &snap.plans, period);
            until[1] = template::counted_until(window, period);
        }
        if self.plan.instance.is_some_and(|i| i.policy.template) {
            template::count_child(
                &mut snap.tenant,
                &mut PlanCounts::default(),
                0,
                self.standing[1],
                window,
            );
            until[1] = until[1].max(template::counts_until(
                &snap.tenant,
                &PlanCounts::NONE,
                period,
            ));
            until[2] = template::counted_until(window, period);
        }
        until
    }

    /// Takes `take` (floor, share, ceiling) from level `idx`'s state `s`, counts the call in
    /// its windows and budgets; when the state may be forgotten (µs).
    fn commit_level(&mut self, idx: usize, [f, h, k]: [f64; 3], s: &mut NodeState) -> f64 {
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
            let start = self.windows.get(b.period, self.at).0;
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
        let l = &self.levels[idx];
        let windows = &self.windows;
        let end = |b: &BudgetCounter| match windows.0[b.period.index()] {
            Some((start, end)) if start == b.start => end,
            _ => b.period.end_of(Timestamp(b.start as u64)).as_micros() as f64,
        };
        expiry(
            s,
            &l.buckets,
            [self.now, self.period, self.next_window],
            end,
        )
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
        refuse(self.plan, self.now, f)
    }

    /// Each level as the decision sees it, nothing charged: its limit per period, units
    /// through it this window, floor, share and the non-floor units it could pass now (the
    /// tool: its pool, within its per-window cap).
    fn figures(&self, snap: &Snapshot) -> Vec<LevelFigures> {
        let states = snap.levels();
        let of = |l: &Level<'_>, s: &NodeState| LevelFigures {
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

impl Snapshot {
    /// The states: tool, tenant, instance.
    fn levels(&self) -> [&NodeState; 3] {
        [&self.tool, &self.tenant, &self.instance]
    }

    /// Level `idx`'s state (0 tool, 1 tenant, 2 instance), mutably.
    fn level_mut(&mut self, idx: usize) -> &mut NodeState {
        match idx {
            0 => &mut self.tool,
            1 => &mut self.tenant,
            _ => &mut self.instance,
        }
    }
}

/// The tool's level: its pool of `S = C − Σ floors`, as deep as the tool's burst.
fn tool_level<'a>(plan: &Plan<'a>) -> Level<'a> {
    let tool = plan.tool;
    let spare = tool.spare();
    Level {
        scope: Scope::Tool,
        numbers: LevelNumbers {
            weight: 0.0,
            floor: 0.0,
            own_floor: 0.0,
            share: spare,
            ceiling: tool.capacity,
            share_rate: 0.0,
            ceiling_rate: spare,
        },
        buckets: [
            bucket(0.0, 0.0),
            bucket(0.0, 0.0),
            bucket(spare, tool.burst),
        ],
        policy: None,
        fresh: false,
    }
}

/// A tenant's or an instance's level from its numbers and its share bank.
fn caller_level<'a>(
    scope: Scope,
    n: LevelNumbers,
    bank: f64,
    policy: &'a crate::policy::LevelPolicy,
    fresh: bool,
) -> Level<'a> {
    Level {
        scope,
        numbers: n,
        buckets: [
            bucket(n.own_floor, n.own_floor),
            bucket(n.share_rate, bank),
            bucket(n.ceiling_rate, policy.burst),
        ],
        policy: Some(policy),
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

/// The refusal for a template caller over `max_tracked`; `wait` is until a counted one stops
/// counting.
fn too_many(scope: Scope, max_tracked: u64, counted: u64, wait: f64) -> Fail {
    Fail {
        reason: Reason::CapExceeded,
        scope,
        wait,
        window: Label::Word("callers"),
        window_secs: None,
        limit: max_tracked as f64,
        used: counted as f64,
        reset_at: None,
        sure_wait: 0.0,
    }
}

/// The calendar windows of one decision's instant, worked out once per period (a division
/// each, and a calendar for months) however many levels have budgets in it: (start, end) µs.
#[derive(Copy, Clone, Default)]
struct Windows([Option<(f64, f64)>; 3]);

impl Windows {
    fn get(&mut self, period: BudgetPeriod, now: Timestamp) -> (f64, f64) {
        *self.0[period.index()].get_or_insert_with(|| {
            let (start, end) = period.window(now);
            (start.as_micros() as f64, end.as_micros() as f64)
        })
    }
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

/// The refusal for `f`, for a call of `plan` at `now`.
fn refuse(plan: &Plan<'_>, now: f64, f: Fail) -> Refusal {
    let tool = plan.tool;
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
