//! The decision in two halves, so a store can hold the tool's lock for the tool's part only:
//! [`below`] works out everything below the tool (the caller's tenant and instance) from their
//! states, [`above`] does the tool's checks and draw under the tool's lock, and
//! [`commit_below`] writes the tenant's and instance's states once the call is admitted.

use std::time::Duration;

use super::bucket::{aligned_window, bucket, expiry, refill, roll_window, EPS};
use super::decide::Plan;
use super::refusal::{Reason, Refusal, Scope};
use super::state::{BudgetCounter, Charge, LevelCharge, LevelView, NodeState, Scalars};
use super::template::{self, Counted, Standing};
use super::walk::{Fail, Label, Level, PathCtx, Walk};
use crate::clock::Timestamp;
use crate::policy::numbers::{level_numbers, LevelNumbers};

/// A decision's first half: everything below the tool (the caller's tenant and instance),
/// worked out from their states and the number of template tenants counted at the tool (which
/// the store passes in). Reads no tool state, so a store can compute it before it locks the
/// tool; [`above`] finishes the decision.
pub(crate) struct Below<'a> {
    levels: [Level<'a>; 3],
    n: usize,
    banks: [f64; 3],
    now: f64,
    period: f64,
    window: f64,
    next_window: f64,
    /// How the tenant and the instance stood among their parent's template children before
    /// this call (for template callers only).
    standing: [Standing; 2],
    /// The unlisted tenants counted at the tool per template, as assumed.
    tenants_counted: Counted,
    /// A refusal for too many template callers (decided before anything else).
    callers: Option<Fail>,
    /// The first of the tenant's and the instance's concurrency caps that is full.
    concurrency: Option<Fail>,
    /// The worst failing budget of the tenant and the instance.
    budgets: Option<Fail>,
    /// The walk up to the tool, share first (floor first is walked only if needed), and why
    /// it cannot pass below the tool, if it cannot.
    walk: Walk,
    walk_failed: Option<Fail>,
    /// The budgets' windows at this instant.
    windows: Windows,
}

/// The calendar windows of one decision's instant, worked out once per period (a division
/// each, and a calendar for months) however many levels have budgets in it: (start, end) µs.
#[derive(Copy, Clone, Default)]
struct Windows([Option<(f64, f64)>; 3]);

impl Windows {
    #[inline]
    fn get(&mut self, period: crate::policy::BudgetPeriod, now: Timestamp) -> (f64, f64) {
        *self.0[period.index()].get_or_insert_with(|| {
            let (start, end) = period.window(now);
            (start.as_micros() as f64, end.as_micros() as f64)
        })
    }
}

/// The worst failure so far: the longest wait, the first one on a tie.
fn worse(worst: &mut Option<Fail>, f: Fail) {
    match worst {
        Some(w) if f.wait <= w.wait => {}
        _ => *worst = Some(f),
    }
}

fn placeholder<'a>() -> Level<'a> {
    let none = bucket(0.0, 0.0);
    Level {
        scope: Scope::Tool,
        numbers: LevelNumbers::default(),
        floor_b: none,
        share_b: none,
        ceil_b: none,
        state: Scalars::default(),
        policy: None,
        fresh: false,
    }
}

impl Below<'_> {
    /// An empty first half, for [`below`] to fill.
    pub(crate) fn new() -> Self {
        Below {
            levels: [placeholder(), placeholder(), placeholder()],
            n: 2,
            banks: [0.0; 3],
            now: 0.0,
            period: 1.0,
            window: 0.0,
            next_window: 0.0,
            standing: [Standing::NotCounted; 2],
            tenants_counted: Counted::default(),
            callers: None,
            concurrency: None,
            budgets: None,
            walk: Walk::default(),
            walk_failed: None,
            windows: Windows::default(),
        }
    }
}

/// The first half of a decision (see [`Below`]), into `b` (filled in place: it is large).
#[inline(always)]
pub(crate) fn below<'a>(
    b: &mut Below<'a>,
    plan: &Plan<'a>,
    tenant_state: &NodeState,
    instance_state: Option<&NodeState>,
    tenants_counted: Counted,
) {
    let tool = plan.tool;
    let now = plan.now.as_micros() as f64;
    let period = tool.period.as_micros() as f64;
    let window = aligned_window(now, period);
    let next_window = (window + 1.0) * period;
    let c = plan.cost;
    b.n = 2;
    b.now = now;
    b.period = period;
    b.window = window;
    b.next_window = next_window;
    b.callers = None;
    b.concurrency = None;
    b.budgets = None;
    b.windows = Windows::default();

    // 1. Template callers counted: a flood of new identities stops here.
    let Some((n_tenants, n_instances)) =
        count_callers(b, plan, tenant_state, instance_state, tenants_counted)
    else {
        return;
    };

    // 2. The numbers each level is owed right now, and its state brought up to now.
    levels(
        b,
        plan,
        tenant_state,
        instance_state,
        n_tenants,
        n_instances,
    );
    let n = b.n;

    // 3. Concurrency (the tool's cap is checked first, in `above`).
    b.concurrency = full_cap(b, plan);
    if b.concurrency.is_some() {
        return;
    }

    // 4. Budgets: every matching calendar window must have room.
    let states = [None, Some(tenant_state), instance_state];
    for (idx, s) in states.iter().enumerate().take(n).skip(1) {
        if let Some(s) = s {
            budget_fails(
                plan,
                budget_list(plan, idx),
                s,
                b.levels[idx].scope,
                &mut b.budgets,
                &mut b.windows,
            );
        }
    }

    // 5. The walk from the caller up to the tool: share first (a floor bucket left full loses
    // nothing the caller is owed, a full share bank would), the floor for the rest. (Floor
    // first, for when that path is blocked, is walked in `above` only then.)
    let ctx = PathCtx {
        levels: &b.levels[..n],
        banks: b.banks,
        cost: c,
        period,
        now,
        next_window,
        tool_period: tool.period,
    };
    b.walk_failed = ctx.below_into(true, &mut b.walk).err();
}

/// Step 1 of [`below`]: how the tenant and the instance stand among their parents' template
/// children, and how many are counted with this call ((tenants, instances)), or `None` with
/// the refusal in `b` when one more would be too many.
fn count_callers(
    b: &mut Below<'_>,
    plan: &Plan<'_>,
    tenant_state: &NodeState,
    instance_state: Option<&NodeState>,
    tenants_counted: Counted,
) -> Option<(Counted, u64)> {
    let (now, period, window, next_window) = (b.now, b.period, b.window, b.next_window);
    b.standing = [Standing::NotCounted; 2];
    b.tenants_counted = tenants_counted;
    let t_pol = plan.tenant.policy;
    let mut n_tenants = tenants_counted;
    if t_pol.template {
        b.standing[0] = template::standing(tenant_state, window);
        if !b.standing[0].counted() {
            let n = n_tenants.get(t_pol.slot);
            if n >= t_pol.max_tracked {
                b.callers = Some(too_many(
                    Scope::Tenant,
                    t_pol.max_tracked,
                    n,
                    next_window - now,
                ));
                return None;
            }
            n_tenants.bump(t_pol.slot);
        }
    }
    let mut n_instances = template::counted_at(tenant_state, window);
    if let (Some(i), Some(s)) = (plan.instance, instance_state) {
        if i.policy.template {
            b.standing[1] = template::standing(s, window);
            if !b.standing[1].counted() {
                if n_instances >= i.policy.max_tracked {
                    let wait = template::until_one_leaves(tenant_state, 0, window, period) - now;
                    b.callers = Some(too_many(
                        Scope::Instance,
                        i.policy.max_tracked,
                        n_instances,
                        wait,
                    ));
                    return None;
                }
                n_instances += 1;
            }
        }
    }
    Some((n_tenants, n_instances))
}

/// Step 3 of [`below`]: the first of the tenant's and the instance's concurrency caps that
/// is full, if any.
fn full_cap(b: &Below<'_>, plan: &Plan<'_>) -> Option<Fail> {
    let caps = [
        None,
        plan.tenant.policy.max_concurrency,
        plan.instance.and_then(|i| i.policy.max_concurrency),
    ];
    for (l, cap) in b.levels[..b.n].iter().zip(caps) {
        let Some(cap) = cap else { continue };
        if l.state.in_flight + 1.0 > cap as f64 {
            return Some(Fail {
                reason: Reason::ConcurrencyExceeded,
                scope: l.scope,
                wait: 1_000_000.0,
                window: Label::Word("in_flight"),
                window_secs: None,
                limit: cap as f64,
                used: l.state.in_flight,
                reset_at: None,
                sure_wait: 0.0,
            });
        }
    }
    None
}

/// Step 2 of [`below`]: the tenant's and the instance's numbers at the counts given, the
/// share banks their parents hold for their children (see [`banks`]), and their states
/// refilled and rolled to `b`'s instant.
fn levels<'a>(
    b: &mut Below<'a>,
    plan: &Plan<'a>,
    tenant_state: &NodeState,
    instance_state: Option<&NodeState>,
    n_tenants: Counted,
    n_instances: u64,
) {
    let tool = plan.tool;
    let t_pol = plan.tenant.policy;
    let (c, now, period, window) = (plan.cost, b.now, b.period, b.window);
    let spare = tool.spare();
    // The unlisted tenants counted, by template: (its burst, how many) for `banks`.
    let mut templates = [(0.0, 0u64); 1 + crate::policy::MAX_PLANS];
    let mut weight = tool.configured_weight;
    for (slot, t) in templates.iter_mut().enumerate().take(1 + tool.plans.len()) {
        if let Some(p) = tool.template(slot) {
            let n = n_tenants.get(slot);
            weight += p.weight * n as f64;
            *t = (p.burst, n);
        }
    }
    let tn = level_numbers(t_pol, spare, weight);
    let (tool_banks, tenant_bank) = banks(
        tool.burst,
        tool.configured_tenant_burst,
        &templates[..1 + tool.plans.len()],
        t_pol.burst,
        c,
    );
    b.levels[1] = Level {
        scope: Scope::Tenant,
        floor_b: bucket(tn.own_floor, tn.own_floor),
        share_b: bucket(tn.share_rate, tenant_bank),
        ceil_b: bucket(tn.ceiling_rate, t_pol.burst),
        numbers: tn,
        state: Scalars::of(tenant_state),
        policy: Some(t_pol),
        fresh: t_pol.template && !b.standing[0].counted(),
    };
    b.banks = [tool_banks, 0.0, 0.0];
    if let (Some(i), Some(s)) = (plan.instance, instance_state) {
        let inner_spare = (tn.ceiling - t_pol.children_floor).max(0.0);
        let inner_weight = t_pol.configured_child_weight
            + t_pol.default_child.as_ref().map_or(0.0, |d| d.weight) * n_instances as f64;
        let inn = level_numbers(i.policy, inner_spare, inner_weight);
        let (instance_banks, instance_bank) = banks(
            t_pol.burst,
            t_pol.configured_child_burst,
            &[(
                t_pol.default_child.as_ref().map_or(0.0, |d| d.burst),
                n_instances,
            )],
            i.policy.burst,
            c,
        );
        b.levels[2] = Level {
            scope: Scope::Instance,
            floor_b: bucket(inn.own_floor, inn.own_floor),
            share_b: bucket(inn.share_rate, instance_bank),
            ceil_b: bucket(inn.ceiling_rate, i.policy.burst),
            numbers: inn,
            state: Scalars::of(s),
            policy: Some(i.policy),
            fresh: i.policy.template && !b.standing[1].counted(),
        };
        b.banks[1] = instance_banks;
        b.n = 3;
    }
    let n = b.n;
    // A template caller not counted yet starts with no more banked share than its parent's
    // bucket holds beyond the other children's banks: many of them arriving at once would
    // otherwise bank more share than the tool can back, and those calling last would be
    // crowded out by the others' bursts (see `Level::fresh`).
    let parent_depth = [tool.burst, t_pol.burst];
    for (idx, l) in b.levels[1..n].iter_mut().enumerate() {
        refill(&mut l.state, &l.floor_b, &l.share_b, &l.ceil_b, now, period);
        roll_window(&mut l.state, window);
        if l.fresh {
            let others = b.banks[idx] - l.share_b.depth;
            l.state.share = l.state.share.min(parent_depth[idx] - others).max(0.0);
        }
    }
}

/// The share banks under a parent whose lending bucket is `depth` deep: (what its children's
/// banks hold together, the calling child's bank), given the configured children's bursts,
/// each template's child burst with how many of its children are counted, and the calling
/// child's burst.
///
/// While the banks fit in the parent's bucket they are the children's bursts; once more
/// template children are counted than it holds banks for, each bank shrinks in proportion
/// so together they fill it, but never below one unit (a bank must hold a call). A caller
/// not counted yet starts with only what is left beyond the others' banks (see `below`).
/// So the parent holds (nearly) every banked share token, and a caller under its share is
/// not crowded out by the others' banked bursts, whatever the order they call in.
fn banks(depth: f64, configured: f64, templates: &[(f64, u64)], own: f64, cost: f64) -> (f64, f64) {
    let all = templates
        .iter()
        .fold(configured, |sum, &(burst, n)| sum + burst * n as f64);
    if all <= depth || all <= 0.0 {
        return (all, own);
    }
    let scale = depth / all;
    let least = |burst: f64| (burst * scale).max(burst.min(2.0 * cost));
    let held = templates
        .iter()
        .fold(configured * scale, |sum, &(burst, n)| {
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

fn budget_list<'a>(plan: &Plan<'a>, idx: usize) -> &'a [crate::policy::Budget] {
    match idx {
        0 => &plan.tool.budgets[..],
        1 => &plan.tenant.policy.budgets[..],
        _ => plan.instance.map_or(&[][..], |i| &i.policy.budgets[..]),
    }
}

#[inline(always)]
fn budget_fails(
    plan: &Plan<'_>,
    list: &[crate::policy::Budget],
    s: &NodeState,
    scope: Scope,
    worst: &mut Option<Fail>,
    windows: &mut Windows,
) {
    let now = plan.now.as_micros() as f64;
    let c = plan.cost;
    for b in list {
        let (start, end) = windows.get(b.period, plan.now);
        let used = s
            .budgets
            .iter()
            .find(|x| x.period == b.period && x.start == start)
            .map_or(0.0, |x| x.used);
        if used + c > b.max + EPS {
            worse(
                worst,
                Fail {
                    reason: Reason::CapExceeded,
                    scope,
                    wait: if c > b.max + EPS {
                        f64::INFINITY
                    } else {
                        end - now
                    },
                    window: Label::Word(b.period.as_str()),
                    window_secs: Some(((end - start) / 1e6) as u64),
                    limit: b.max,
                    used,
                    reset_at: Some(end),
                    // A calendar window: the wait is exact.
                    sure_wait: if c > b.max + EPS {
                        f64::INFINITY
                    } else {
                        end - now
                    },
                },
            );
        }
    }
}

/// The tool's half of an admitted decision, already written to the tool's state.
#[derive(Default)]
pub(crate) struct Top {
    takes: [[f64; 3]; 3],
    expires: f64,
    slack: f64,
}

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
            Label::Word(w) => super::refusal::word(w),
        }),
    );
    r.scope = Some(f.scope);
    r.limit = Some(f.limit);
    r.used = Some(f.used);
    r.window_secs = f.window_secs;
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

/// The tool's level at `b`'s instant: its numbers, and its state brought up to date (refilled,
/// its window rolled), nothing drawn.
#[inline(always)]
fn tool_level(plan: &Plan<'_>, b: &Below<'_>, tool_state: &NodeState) -> Level<'static> {
    let tool = plan.tool;
    let spare = tool.spare();
    let mut t = Level {
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
        floor_b: bucket(0.0, 0.0),
        share_b: bucket(0.0, 0.0),
        ceil_b: bucket(spare, tool.burst),
        state: Scalars::of(tool_state),
        policy: None,
        fresh: false,
    };
    refill(
        &mut t.state,
        &t.floor_b,
        &t.share_b,
        &t.ceil_b,
        b.now,
        b.period,
    );
    roll_window(&mut t.state, b.window);
    t
}

/// Each level of a call as the decision sees it at `b`'s instant, nothing charged: its limit
/// per period, units through it this window, floor, share and the non-floor units it could
/// pass now (the tool: its pool). Empty when the call was refused for too many template
/// callers before its levels were worked out.
pub(crate) fn figures(
    plan: &Plan<'_>,
    b: &Below<'_>,
    tool_state: &NodeState,
) -> Vec<crate::console::LevelFigures> {
    if b.callers.is_some() {
        return Vec::new();
    }
    let of = |l: &Level<'_>| crate::console::LevelFigures {
        level: l.scope.as_str(),
        limit: l.numbers.ceiling,
        used: l.state.total,
        floor: l.numbers.floor,
        share: l.numbers.share,
        // What its ceiling bucket holds; at the tool, no more than its per-window cap on
        // non-floor units leaves (callers have no such cap).
        slack: if l.scope == Scope::Tool {
            l.state
                .ceiling
                .min(l.numbers.ceiling_rate - l.state.non_floor)
        } else {
            l.state.ceiling
        }
        .max(0.0),
        // Filled in by the console, which holds each level's stored state.
        budgets: Vec::new(),
    };
    let mut out = vec![of(&tool_level(plan, b, tool_state))];
    out.extend(b.levels[1..b.n].iter().map(of));
    out
}

/// A decision's second half: the tool's checks and draw, with the tool's state (locked by the
/// store for just this). Admitted: the tool's state is written and the rest is for
/// [`commit_below`]. Refused: nothing is written anywhere.
#[inline(always)]
pub(crate) fn above(
    plan: &Plan<'_>,
    b: &mut Below<'_>,
    tool_state: &mut NodeState,
    top: &mut Top,
) -> Result<(), Refusal> {
    let (now, period) = (b.now, b.period);
    if let Some(mut f) = b.callers {
        if f.scope == Scope::Tenant {
            // Exact now that the tool's counts are at hand.
            let slot = plan.tenant.policy.slot;
            f.wait = template::until_one_leaves(tool_state, slot, b.window, period) - now;
        }
        return Err(refuse(plan, now, f));
    }
    let t = tool_level(plan, b, tool_state);
    b.levels[0] = t;

    // 3. Concurrency, before any rate is looked at: the tool's cap, then the caller's.
    if let Some(f) = tool_cap_full(plan, &t).or(b.concurrency) {
        return Err(refuse(plan, now, f));
    }
    // 4. Budgets, the tool's first; 5. the tool's part of the walk.
    let takes = tool_draw(plan, b, tool_state).map_err(|f| refuse(plan, now, f))?;
    // 6. Commit the tool.
    commit_tool(plan, b, takes, tool_state, top);
    Ok(())
}

/// Step 3 of [`above`]: the tool's concurrency cap, if it is full.
fn tool_cap_full(plan: &Plan<'_>, t: &Level<'_>) -> Option<Fail> {
    let cap = plan.tool.max_concurrency?;
    (t.state.in_flight + 1.0 > cap as f64).then_some(Fail {
        reason: Reason::ConcurrencyExceeded,
        scope: Scope::Tool,
        wait: 1_000_000.0,
        window: Label::Word("in_flight"),
        window_secs: None,
        limit: cap as f64,
        used: t.state.in_flight,
        reset_at: None,
        sure_wait: 0.0,
    })
}

/// Steps 4 and 5 of [`above`]: every budget (the tool's first), then the tool's part of the
/// walk (share first, else floor first): the units each level takes, or the worst failure
/// with the time the call surely cannot pass before.
fn tool_draw(
    plan: &Plan<'_>,
    b: &mut Below<'_>,
    tool_state: &NodeState,
) -> Result<[[f64; 3]; 3], Fail> {
    let tool = plan.tool;
    let mut worst = None;
    budget_fails(
        plan,
        &tool.budgets,
        tool_state,
        Scope::Tool,
        &mut worst,
        &mut b.windows,
    );
    if let Some(f) = b.budgets {
        worse(&mut worst, f);
    }
    // A budget's wait is exact: the longest one is a sure wait.
    let mut sure_wait = worst.map_or(0.0, |f: Fail| f.wait);
    let ctx = PathCtx {
        levels: &b.levels[..b.n],
        banks: b.banks,
        cost: plan.cost,
        period: b.period,
        now: b.now,
        next_window: b.next_window,
        tool_period: tool.period,
    };
    let walked = match b.walk_failed {
        Some(f) => Err(f),
        None => Ok(b.walk),
    };
    let takes = match walked.and_then(|w| ctx.at_tool(w, true)) {
        Ok(t) => t,
        Err(_) => match ctx.below(false).and_then(|w| ctx.at_tool(w, false)) {
            Ok(t) => t,
            Err(f) => {
                let fewest = [
                    plan.tenant.policy.template,
                    plan.instance.is_some_and(|i| i.policy.template),
                ];
                sure_wait = sure_wait.max(ctx.sure_wait(&f, tool, fewest));
                worse(&mut worst, f);
                [[0.0; 3]; 3]
            }
        },
    };
    match worst {
        Some(mut f) => {
            f.sure_wait = sure_wait;
            Err(f)
        }
        None => Ok(takes),
    }
}

/// Step 6 of [`above`]: the tool's draw written to its state, and what the answer needs of it
/// (its charge record is written by [`commit_below`], where the answer holds it).
fn commit_tool(
    plan: &Plan<'_>,
    b: &mut Below<'_>,
    takes: [[f64; 3]; 3],
    tool_state: &mut NodeState,
    top: &mut Top,
) {
    let mut expires = commit_level(plan, b, 0, takes[0], tool_state);
    // The tool counts every floor unit drawn below it, for the window report.
    let mut floor_units = 0.0;
    for take in &takes[..b.n] {
        floor_units += take[0];
    }
    let s = &mut b.levels[0].state;
    s.floor_used += floor_units - takes[0][0];
    if plan.tenant.policy.template {
        template::count_child(s, plan.tenant.policy.slot, b.standing[0], b.window);
        expires = expires.max(template::counts_until(s, b.period));
    }
    s.write(tool_state);
    // Written where the store keeps it (not returned: a moved record is read back by wide
    // loads before its narrow stores land).
    top.takes = takes;
    top.expires = expires;
    top.slack = b.levels[0].state.ceiling;
}

impl Top {
    /// When the tool's state may be forgotten (µs).
    pub(crate) fn expires(&self) -> f64 {
        self.expires
    }
}

impl Below<'_> {
    /// The unlisted tenants counted at the tool this half was worked out for.
    pub(crate) fn tenants_counted(&self) -> Counted {
        self.tenants_counted
    }

    /// The unlisted tenants counted in `tool_state` in this half's window, for `plan`'s tool.
    #[inline]
    pub(crate) fn tenants_counted_in(&self, plan: &Plan<'_>, tool_state: &NodeState) -> Counted {
        template::counted_per_slot(tool_state, self.window, plan.tool.plans.len())
    }
}

/// Whether the call takes a concurrency permit at level `idx`.
#[inline]
fn takes_permit(plan: &Plan<'_>, idx: usize) -> bool {
    match idx {
        0 => plan.tool.max_concurrency.is_some(),
        1 => plan.tenant.policy.max_concurrency.is_some(),
        _ => plan
            .instance
            .is_some_and(|i| i.policy.max_concurrency.is_some()),
    }
}

/// Takes `take` (floor, share, ceiling) from level `idx`, counts the call in its windows and
/// budgets, and writes the budgets to `target` (the bucket numbers stay in `b` until written).
/// What it took is described by [`charge_of`].
#[inline(always)]
fn commit_level(
    plan: &Plan<'_>,
    b: &mut Below<'_>,
    idx: usize,
    take: [f64; 3],
    target: &mut NodeState,
) -> f64 {
    let c = plan.cost;
    let l = &mut b.levels[idx];
    let [f, h, k] = take;
    let s = &mut l.state;
    s.floor -= f;
    s.share -= h;
    s.ceiling -= k;
    s.total += c;
    s.non_floor += k;
    s.floor_used += f;
    if takes_permit(plan, idx) {
        s.in_flight += 1.0;
    }
    let list = budget_list(plan, idx);
    for bud in list {
        let start = b.windows.get(bud.period, plan.now).0;
        match target.budgets.iter_mut().find(|x| x.period == bud.period) {
            Some(x) if x.start == start => x.used += c,
            Some(x) => {
                x.start = start;
                x.used = c;
            }
            None => target.budgets.set(BudgetCounter {
                period: bud.period,
                start,
                used: c,
            }),
        }
    }
    expiry(
        &l.state,
        &target.budgets,
        &l.floor_b,
        &l.share_b,
        &l.ceil_b,
        b.now,
        b.period,
        b.next_window,
    )
}

/// Writes what [`commit_level`] took at level `idx` into `out`, field by field where the
/// answer holds it (a record built aside and copied in would be read back by wide loads
/// before its narrow stores land: a stall per level).
#[inline(always)]
fn charge_of(
    plan: &Plan<'_>,
    b: &mut Below<'_>,
    idx: usize,
    take: [f64; 3],
    out: &mut LevelCharge,
) {
    let l = &b.levels[idx];
    let [f, h, k] = take;
    out.present = true;
    out.floor = f;
    out.floor_depth = l.floor_b.depth;
    out.share = h;
    out.share_depth = l.share_b.depth;
    out.ceiling = k;
    out.ceiling_depth = l.ceil_b.depth;
    out.permit = takes_permit(plan, idx);
    out.budgets.clear();
    for bud in budget_list(plan, idx) {
        let start = b.windows.get(bud.period, plan.now).0;
        out.budgets.push(bud.period, start);
    }
}

/// Where an admitted call's answer is written: fields of the store's own answer, filled in
/// place (a summary returned and copied over would be read back by wide loads before its
/// narrow stores land).
pub(crate) struct Report<'x> {
    pub(crate) charge: &'x mut Charge,
    pub(crate) remaining: &'x mut f64,
    pub(crate) quota: &'x mut f64,
    pub(crate) reset_in: &'x mut f64,
    pub(crate) slack: &'x mut f64,
    pub(crate) views: &'x mut [LevelView; 2],
}

/// A decision's last part, once [`above`] admitted it: writes the tenant's and the
/// instance's states, and what the call charged and what its answer says into `out`; answers
/// when each level's state (tool, tenant, instance) may be forgotten (µs). Needs no tool
/// state.
#[inline(always)]
pub(crate) fn commit_below(
    plan: &Plan<'_>,
    b: &mut Below<'_>,
    top: &Top,
    tenant_state: &mut NodeState,
    instance_state: Option<&mut NodeState>,
    out: Report<'_>,
) -> [f64; 3] {
    let n = b.n;
    let charge = out.charge;
    charge.cost = plan.cost;
    charge.window = b.window;
    let mut expires = [b.now; 3];
    charge_of(plan, b, 0, top.takes[0], &mut charge.levels[0]);
    expires[0] = top.expires;
    let mut e1 = commit_level(plan, b, 1, top.takes[1], tenant_state);
    charge_of(plan, b, 1, top.takes[1], &mut charge.levels[1]);
    let instance_template = n == 3 && plan.instance.is_some_and(|i| i.policy.template);
    if instance_template {
        let s = &mut b.levels[1].state;
        template::count_child(s, 0, b.standing[1], b.window);
        e1 = e1.max(template::counts_until(s, b.period));
    }
    if plan.tenant.policy.template {
        e1 = e1.max(template::counted_until(b.window, b.period));
    }
    expires[1] = e1;
    b.levels[1].state.write(tenant_state);
    if let (3, Some(s)) = (n, instance_state) {
        let mut e2 = commit_level(plan, b, 2, top.takes[2], s);
        charge_of(plan, b, 2, top.takes[2], &mut charge.levels[2]);
        if instance_template {
            e2 = e2.max(template::counted_until(b.window, b.period));
        }
        expires[2] = e2;
        b.levels[2].state.write(s);
    } else {
        charge.levels[2] = LevelCharge::default();
    }

    let leaf = n - 1;
    // What is left of the caller's quota (its ceiling per period) in this aligned window, and
    // of its tenant's when siblings share it: the `r` a client reads against `q`, counting
    // down to 0 by the window's end (`t`). A burst limit or a busy tool can still make a call
    // wait inside the window; the refusal says how long.
    let mut remaining = f64::INFINITY;
    for l in &b.levels[1..n] {
        remaining = remaining.min(l.numbers.ceiling - l.state.total);
    }
    *out.remaining = remaining.max(0.0);
    *out.quota = b.levels[leaf].numbers.ceiling;
    *out.reset_in = b.next_window - b.now;
    *out.slack = top.slack;
    let view = |l: &Level<'_>, v: &mut LevelView| {
        v.weight = l.numbers.weight;
        v.floor = l.numbers.floor;
        v.share = l.numbers.share;
        v.ceiling = l.numbers.ceiling;
    };
    view(&b.levels[1], &mut out.views[0]);
    if n == 3 {
        view(&b.levels[2], &mut out.views[1]);
    } else {
        out.views[1] = LevelView::default();
    }
    expires
}
