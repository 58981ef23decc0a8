//! The fair-share decision, pure: state and time in, verdict and new state out.
//!
//! # The algorithm
//!
//! Each caller (a tenant, or an instance inside a tenant) owns three token buckets, refilled
//! continuously per period P of its tool:
//!
//! * **floor** `F` — rate and depth = its own floor. Private: nobody else ever draws it, and
//!   the tool's shared pool is sized `C − Σ floors`, so floors are reserved, never lent.
//! * **share** `H` — rate = its nominal share `S × w / Σw`. It marks which of its non-floor
//!   draws are within its share (they have priority over borrowing).
//! * **ceiling** `K` — rate = ceiling − floor, depth = burst. Every non-floor draw takes it.
//!
//! The tool owns the **pool**: rate `S = C − Σ floors`, depth = the tool's burst. A call of
//! cost `c` takes from the caller's share first (with its `K` and the pool), its floor for
//! what the share cannot cover, and retries floor-first if that path is blocked. Above the
//! caller, the non-floor part passes its tenant (residual floor, then `K`) and the pool.
//!
//! A draw beyond the share of any level is *borrowing*. It may only take pool tokens above the
//! sum of the other children's share banks (their bursts; the borrower's own bank is its own to
//! spend), so the pool always holds every other child's banked share token and an own-share
//! draw never fails for a borrower's sake; inside that lending room a
//! weight-ranked threshold (half the room for the heaviest, nearly all of it for the lightest)
//! lets heavier borrowers draw first. The tool also counts units per aligned window of length
//! P: floors at most the floor, non-floor at most `S` (borrowers leave the banks' worth), which
//! makes "at most C per period" exact even from a cold start with every bucket full. Budgets
//! (calendar windows) and concurrency caps are counters checked alongside. Nothing is written
//! unless every check passes.
//!
//! Every number is an `f64` and every step is written so the Redis script can repeat it
//! operation for operation.

use std::time::Duration;

use super::refusal::{Reason, Refusal, Scope};
use crate::clock::Timestamp;
use crate::policy::numbers::{level_numbers, LevelNumbers};
use crate::policy::{BudgetPeriod, LevelPolicy, ToolPolicy};

/// Tolerance for float comparisons: a draw passes when `have + EPS >= need`.
pub(crate) const EPS: f64 = 1e-9;

/// A budget counter: units used in the window that starts at `start` (µs).
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetCounter {
    /// Which calendar window.
    pub period: BudgetPeriod,
    /// Start of the window counted, µs since the epoch.
    pub start: f64,
    /// Units used in it.
    pub used: f64,
}

/// The stored state of one level (tool, tenant or instance). A handful of numbers.
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// Calendar budget counters.
    pub budgets: Vec<BudgetCounter>,
}

/// Whether a template caller is already tracked, and how many are.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Tracking {
    /// Template callers tracked now (expired ones excluded).
    pub count: u64,
    /// Whether this caller is one of them.
    pub tracked: bool,
}

/// A level of the call: its name and the policy that applies (own entry or template).
#[derive(Copy, Clone, Debug)]
pub struct LevelRef<'a> {
    /// Tenant or instance name (for an untenanted caller: its client id).
    pub name: &'a str,
    /// The applicable policy.
    pub policy: &'a LevelPolicy,
}

/// Everything static about one decision.
#[derive(Copy, Clone, Debug)]
pub struct Plan<'a> {
    /// Now, µs since the epoch.
    pub now: Timestamp,
    /// Cost in the tool's unit.
    pub cost: f64,
    /// The tool.
    pub tool: &'a ToolPolicy,
    /// The tenant (or the untenanted caller, governed by the tenant template).
    pub tenant: LevelRef<'a>,
    /// The instance, when the tenant limits instances separately.
    pub instance: Option<LevelRef<'a>>,
    /// True when `tenant` is an untenanted caller.
    pub untenanted: bool,
}

/// The stored state a decision reads.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// The tool's state.
    pub tool: NodeState,
    /// The tenant's state.
    pub tenant: NodeState,
    /// The instance's state (ignored without an instance).
    pub instance: NodeState,
    /// The tenant among the tool's template tenants.
    pub tenant_tracking: Tracking,
    /// The instance among the tenant's template instances.
    pub instance_tracking: Tracking,
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
    pub budgets: Vec<(BudgetPeriod, f64)>,
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

/// The numbers that explain a decision at one level (for logs, headers and disputes).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct LevelView {
    /// Weight.
    pub weight: f64,
    /// Floor per period.
    pub floor: f64,
    /// Nominal share per period (with the template callers tracked now).
    pub share: f64,
    /// Ceiling per period.
    pub ceiling: f64,
}

/// The outcome of an admitted call.
#[derive(Clone, Debug)]
pub struct Admitted {
    /// New tool state.
    pub tool: NodeState,
    /// New tenant state.
    pub tenant: NodeState,
    /// New instance state (meaningless without an instance).
    pub instance: NodeState,
    /// When each level's state may be forgotten without changing any future decision (µs):
    /// tool, tenant, instance, provided it holds no permits.
    pub expires: [f64; 3],
    /// Track the tenant (a template tenant) until this time (µs), if it is one.
    pub track_tenant_until: Option<f64>,
    /// Track the instance (a template instance) until this time (µs), if it is one.
    pub track_instance_until: Option<f64>,
    /// What was charged where.
    pub charge: Charge,
    /// Units the caller could still take now (for the `RateLimit` header).
    pub remaining: f64,
    /// The caller's ceiling per period (the `q` of `RateLimit-Policy`).
    pub quota: f64,
    /// Microseconds until the aligned window resets.
    pub reset_in: f64,
    /// Pool tokens left at the tool after the call: the slack to lend.
    pub slack: f64,
    /// Tenant and instance numbers.
    pub views: [LevelView; 2],
}

/// The engine's verdict.
#[derive(Clone, Debug)]
pub enum Verdict {
    /// Admit, writing the new state.
    Admit(Box<Admitted>),
    /// Refuse; nothing changes.
    Refuse(Box<Refusal>),
}

#[derive(Copy, Clone)]
struct Bucket {
    rate: f64,
    depth: f64,
}

/// The numbers of a level's state, copied out of the store's `NodeState`, brought up to date
/// and drawn on; written back only when the call is admitted. Copying these few doubles is
/// cheaper than cloning a `NodeState` (its budget list lives on the heap).
#[derive(Copy, Clone, Default)]
struct Scalars {
    live: bool,
    t: f64,
    floor: f64,
    share: f64,
    ceiling: f64,
    window: f64,
    total: f64,
    non_floor: f64,
    floor_used: f64,
    in_flight: f64,
}

impl Scalars {
    fn of(s: &NodeState) -> Self {
        Scalars {
            live: s.live,
            t: s.t,
            floor: s.floor,
            share: s.share,
            ceiling: s.ceiling,
            window: s.window,
            total: s.total,
            non_floor: s.non_floor,
            floor_used: s.floor_used,
            in_flight: s.in_flight,
        }
    }

    fn write(&self, s: &mut NodeState) {
        s.live = self.live;
        s.t = self.t;
        s.floor = self.floor;
        s.share = self.share;
        s.ceiling = self.ceiling;
        s.window = self.window;
        s.total = self.total;
        s.non_floor = self.non_floor;
        s.floor_used = self.floor_used;
        s.in_flight = self.in_flight;
    }
}

#[derive(Copy, Clone)]
struct Level<'a> {
    scope: Scope,
    numbers: LevelNumbers,
    floor_b: Bucket,
    share_b: Bucket,
    ceil_b: Bucket,
    state: Scalars,
    policy: Option<&'a LevelPolicy>,
}

fn refill(s: &mut Scalars, f: &Bucket, h: &Bucket, k: &Bucket, now: f64, period: f64) {
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

fn roll_window(s: &mut Scalars, window: f64) {
    if s.window != window {
        s.window = window;
        s.total = 0.0;
        s.non_floor = 0.0;
        s.floor_used = 0.0;
    }
}

fn bucket(rate: f64, depth: f64) -> Bucket {
    let rate = rate.max(0.0);
    Bucket {
        rate,
        depth: if rate > 0.0 { depth } else { 0.0 },
    }
}

/// Time (µs) until bucket `x` holds `need`, or infinity when it never can.
fn wait_for(x: f64, need: f64, b: &Bucket, period: f64) -> f64 {
    if x + EPS >= need {
        0.0
    } else if need > b.depth + EPS || b.rate <= 0.0 {
        f64::INFINITY
    } else {
        (need - x) * period / b.rate
    }
}

/// The window a refusal names: the tool's period, or a fixed word. Rendered only when the
/// refusal is built, so a draw that fails and is retried allocates nothing.
#[derive(Copy, Clone)]
enum Label {
    Period,
    Word(&'static str),
}

#[derive(Copy, Clone)]
struct Fail {
    reason: Reason,
    scope: Scope,
    wait: f64,
    window: Label,
    window_secs: Option<u64>,
    limit: f64,
    used: f64,
    reset_at: Option<f64>,
}

struct PathCtx<'l, 'a> {
    levels: &'l [Level<'a>],
    banks: [f64; 3],
    cost: f64,
    period: f64,
    now: f64,
    next_window: f64,
    period_secs: u64,
}

/// Where a walk from the caller up stands: what each level takes so far, what is left to
/// place higher up, and whether everything so far was within its share.
#[derive(Copy, Clone)]
struct Walk {
    takes: [[f64; 3]; 3],
    rem: f64,
    own_chain: bool,
    child_threshold: f64,
}

impl PathCtx<'_, '_> {
    /// The walk from the caller up to (not including) the tool: share first (or floor first),
    /// or why the call cannot pass below the tool. Needs no tool state.
    fn below(&self, share_first: bool) -> Result<Walk, Fail> {
        let mut w = Walk {
            takes: [[0.0f64; 3]; 3],
            rem: self.cost,
            own_chain: true,
            child_threshold: 0.5,
        };
        for idx in (1..self.levels.len()).rev() {
            if w.rem <= EPS {
                break;
            }
            self.step(idx, share_first, &mut w)?;
        }
        Ok(w)
    }

    /// The tool's part of a walk: units per level (floor, share, ceiling), or why not.
    fn at_tool(&self, mut w: Walk, share_first: bool) -> Result<[[f64; 3]; 3], Fail> {
        if w.rem > EPS {
            self.step(0, share_first, &mut w)?;
        }
        Ok(w.takes)
    }

    /// One level of the walk.
    fn step(&self, idx: usize, share_first: bool, w: &mut Walk) -> Result<(), Fail> {
        let leaf = self.levels.len() - 1;
        let l = &self.levels[idx];
        let s = &l.state;
        // The level's own floor (a caller's floor, a tenant's residual floor), for what its
        // share cannot cover.
        let own_floor = l.numbers.own_floor;
        if own_floor > 0.0 {
            let covered = if share_first && idx > 0 {
                s.share.min(s.ceiling).min(w.rem).max(0.0)
            } else {
                0.0
            };
            let x = (w.rem - covered)
                .min(s.floor)
                .min(own_floor - s.floor_used)
                .max(0.0);
            w.takes[idx][0] = x;
            w.rem -= x;
            if w.rem <= EPS {
                return Ok(());
            }
        }
        // Then non-floor: the level's ceiling bucket (the pool, at the tool). A borrow may
        // only take what lies above every child's share bank, so the pool always holds at
        // least the share tokens its children have banked and an own-share draw never fails
        // for a borrower's sake; inside the lending room, heavier borrowers see a lower bar
        // than lighter ones.
        let rem = w.rem;
        // The borrower's own bank is its own to spend: only the other children's banks are
        // held back from it.
        let banks = if idx < leaf {
            self.banks[idx] - self.levels[idx + 1].share_b.depth
        } else {
            0.0
        };
        let threshold = if idx < leaf && !w.own_chain {
            banks + w.child_threshold * (l.ceil_b.depth - banks - rem).max(0.0)
        } else {
            0.0
        };
        let need = rem + threshold;
        // Only the tool counts non-floor units per aligned window (at most `C − Σ floors`, so
        // never more than C a period); a caller's ceiling is its bucket's business, and a
        // per-window cap there would round a fractional allowance down every period.
        // Borrowers also leave the banks' worth of the window to own-share draws.
        let window_cap = if idx > 0 {
            f64::INFINITY
        } else if threshold > 0.0 {
            l.numbers.ceiling_rate - banks
        } else {
            l.numbers.ceiling_rate
        };
        let bucket_ok = s.ceiling + EPS >= need;
        let window_ok = s.non_floor + rem <= window_cap + EPS;
        if !(bucket_ok && window_ok) {
            return Err(self.fail(l, need, rem, window_ok, window_cap));
        }
        w.takes[idx][2] = rem;
        if idx > 0 {
            if s.share + EPS >= rem {
                w.takes[idx][1] = rem;
            } else {
                w.own_chain = false;
            }
            w.child_threshold = l.policy.map_or(0.5, |p| p.borrow_threshold);
        }
        Ok(())
    }

    fn fail(&self, l: &Level<'_>, need: f64, rem: f64, window_ok: bool, window_cap: f64) -> Fail {
        let s = &l.state;
        let mut wait = wait_for(s.ceiling, need, &l.ceil_b, self.period);
        if !window_ok {
            wait = wait.max(if rem > window_cap + EPS {
                f64::INFINITY
            } else {
                self.next_window - self.now
            });
        }
        // Could the whole call be served by the caller's floor later instead?
        let lf = &self.levels[self.levels.len() - 1];
        let c = self.cost;
        if lf.numbers.own_floor + EPS >= c {
            let mut fw = wait_for(lf.state.floor, c, &lf.floor_b, self.period);
            if lf.state.floor_used + c > lf.numbers.own_floor + EPS {
                fw = fw.max(self.next_window - self.now);
            }
            wait = wait.min(fw);
        }
        Fail {
            reason: Reason::RateLimited,
            scope: l.scope,
            wait,
            window: Label::Period,
            window_secs: Some(self.period_secs),
            limit: l.numbers.ceiling,
            used: s.total,
            reset_at: None,
        }
    }
}

/// Decides one call. Pure: the same plan and snapshot always give the same verdict.
pub fn decide(plan: &Plan<'_>, snap: &Snapshot) -> Verdict {
    let mut tool = snap.tool.clone();
    let mut tenant = snap.tenant.clone();
    let mut instance = if plan.instance.is_some() {
        snap.instance.clone()
    } else {
        NodeState::default()
    };
    let tracking = [snap.tenant_tracking, snap.instance_tracking];
    let inst = plan.instance.is_some().then_some(&mut instance);
    match decide_in_place(plan, &mut tool, &mut tenant, inst, tracking) {
        Err(r) => Verdict::Refuse(r),
        Ok(o) => Verdict::Admit(Box::new(Admitted {
            tool,
            tenant,
            instance,
            expires: o.expires,
            track_tenant_until: o.track_tenant_until,
            track_instance_until: o.track_instance_until,
            charge: o.charge,
            remaining: o.remaining,
            quota: o.quota,
            reset_in: o.reset_in,
            slack: o.slack,
            views: o.views,
        })),
    }
}

/// What an admitted call changed besides the states: [`Admitted`] without them.
#[derive(Clone, Debug)]
pub(crate) struct Outcome {
    pub(crate) expires: [f64; 3],
    pub(crate) track_tenant_until: Option<f64>,
    pub(crate) track_instance_until: Option<f64>,
    pub(crate) charge: Charge,
    pub(crate) remaining: f64,
    pub(crate) quota: f64,
    pub(crate) reset_in: f64,
    pub(crate) slack: f64,
    pub(crate) views: [LevelView; 2],
}

/// [`decide`] over the stored states themselves: they are read, and written only when the call
/// is admitted (a refusal leaves them untouched). `instance` is `Some` exactly when the plan
/// has an instance; `tracking` is the tenant's and the instance's template tracking.
pub(crate) fn decide_in_place(
    plan: &Plan<'_>,
    tool_state: &mut NodeState,
    tenant_state: &mut NodeState,
    instance_state: Option<&mut NodeState>,
    tracking: [Tracking; 2],
) -> Result<Outcome, Box<Refusal>> {
    let mut b = Below::new();
    below(
        &mut b,
        plan,
        tenant_state,
        instance_state.as_deref(),
        tracking,
    );
    let mut top = above(plan, &mut b, tool_state)?;
    Ok(commit_below(
        plan,
        &mut b,
        &mut top,
        tenant_state,
        instance_state,
    ))
}

/// A decision's first half: everything below the tool (the caller's tenant and instance),
/// worked out from their states and the template tracking assumed. Reads no tool state, so a
/// store can compute it before it locks the tool; [`above`] finishes the decision.
pub(crate) struct Below<'a> {
    levels: [Level<'a>; 3],
    n: usize,
    banks: [f64; 3],
    now: f64,
    period: f64,
    window: f64,
    next_window: f64,
    /// A refusal for too many template callers (decided before anything else).
    callers: Option<Fail>,
    /// The first of the tenant's and the instance's concurrency caps that is full.
    concurrency: Option<Fail>,
    /// The worst failing budget of the tenant and the instance.
    budgets: Option<Fail>,
    /// The walk up to the tool, share first (floor first is walked only if needed).
    walk: Result<Walk, Fail>,
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
    }
}

impl Below<'_> {
    /// An empty first half, for [`below`] to fill.
    pub(crate) fn new() -> Self {
        let walk = Walk {
            takes: [[0.0; 3]; 3],
            rem: 0.0,
            own_chain: true,
            child_threshold: 0.5,
        };
        Below {
            levels: [placeholder(), placeholder(), placeholder()],
            n: 2,
            banks: [0.0; 3],
            now: 0.0,
            period: 1.0,
            window: 0.0,
            next_window: 0.0,
            callers: None,
            concurrency: None,
            budgets: None,
            walk: Ok(walk),
        }
    }
}

/// The first half of a decision (see [`Below`]), into `b` (filled in place: it is large).
pub(crate) fn below<'a>(
    b: &mut Below<'a>,
    plan: &Plan<'a>,
    tenant_state: &NodeState,
    instance_state: Option<&NodeState>,
    tracking: [Tracking; 2],
) {
    let tool = plan.tool;
    let now = plan.now.as_micros() as f64;
    let period = tool.period.as_micros() as f64;
    let window = (now / period).floor();
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

    // 1. Tracked template callers: a flood of new identities stops here.
    let t_pol = plan.tenant.policy;
    let mut n_tenants = tracking[0].count;
    if t_pol.template && !tracking[0].tracked {
        if n_tenants >= t_pol.max_tracked {
            b.callers = Some(Fail {
                reason: Reason::CapExceeded,
                scope: Scope::Tenant,
                wait: period,
                window: Label::Word("callers"),
                window_secs: None,
                limit: t_pol.max_tracked as f64,
                used: n_tenants as f64,
                reset_at: None,
            });
            return;
        }
        n_tenants += 1;
    }
    let mut n_instances = tracking[1].count;
    if let Some(i) = plan.instance {
        if i.policy.template && !tracking[1].tracked {
            if n_instances >= i.policy.max_tracked {
                b.callers = Some(Fail {
                    reason: Reason::CapExceeded,
                    scope: Scope::Instance,
                    wait: period,
                    window: Label::Word("callers"),
                    window_secs: None,
                    limit: i.policy.max_tracked as f64,
                    used: n_instances as f64,
                    reset_at: None,
                });
                return;
            }
            n_instances += 1;
        }
    }

    // 2. The numbers each level is owed right now.
    let spare = tool.spare();
    let tn = level_numbers(
        t_pol,
        spare,
        tool.configured_weight
            + tool.default_tenant.as_ref().map_or(0.0, |d| d.weight) * n_tenants as f64,
    );
    b.levels[1] = Level {
        scope: Scope::Tenant,
        floor_b: bucket(tn.own_floor, tn.own_floor),
        share_b: bucket(tn.share_rate, t_pol.burst),
        ceil_b: bucket(tn.ceiling_rate, t_pol.burst),
        numbers: tn,
        state: Scalars::of(tenant_state),
        policy: Some(t_pol),
    };
    if let (Some(i), Some(s)) = (plan.instance, instance_state) {
        let inner_spare = (tn.ceiling - t_pol.children_floor).max(0.0);
        let inner_weight = t_pol.configured_child_weight
            + t_pol.default_child.as_ref().map_or(0.0, |d| d.weight) * n_instances as f64;
        let inn = level_numbers(i.policy, inner_spare, inner_weight);
        b.levels[2] = Level {
            scope: Scope::Instance,
            floor_b: bucket(inn.own_floor, inn.own_floor),
            share_b: bucket(inn.share_rate, i.policy.burst),
            ceil_b: bucket(inn.ceiling_rate, i.policy.burst),
            numbers: inn,
            state: Scalars::of(s),
            policy: Some(i.policy),
        };
        b.n = 3;
    }
    // What the children of the tool and of the tenant can hold in their share banks.
    b.banks = [
        tool.configured_tenant_burst
            + tool.default_tenant.as_ref().map_or(0.0, |d| d.burst) * n_tenants as f64,
        t_pol.configured_child_burst
            + t_pol.default_child.as_ref().map_or(0.0, |d| d.burst) * n_instances as f64,
        0.0,
    ];
    let n = b.n;
    for l in b.levels[1..n].iter_mut() {
        refill(&mut l.state, &l.floor_b, &l.share_b, &l.ceil_b, now, period);
        roll_window(&mut l.state, window);
    }

    // 3. Concurrency (the tool's cap is checked first, in `above`).
    let caps = [
        None,
        t_pol.max_concurrency,
        plan.instance.and_then(|i| i.policy.max_concurrency),
    ];
    for (l, cap) in b.levels[..n].iter().zip(caps) {
        if let Some(cap) = cap {
            if l.state.in_flight + 1.0 > cap as f64 {
                b.concurrency = Some(Fail {
                    reason: Reason::ConcurrencyExceeded,
                    scope: l.scope,
                    wait: 1_000_000.0,
                    window: Label::Word("in_flight"),
                    window_secs: None,
                    limit: cap as f64,
                    used: l.state.in_flight,
                    reset_at: None,
                });
                return;
            }
        }
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
        period_secs: tool.period.as_secs_ceil(),
    };
    b.walk = ctx.below(true);
}

fn budget_list<'a>(plan: &Plan<'a>, idx: usize) -> &'a [crate::policy::Budget] {
    match idx {
        0 => &plan.tool.budgets[..],
        1 => &plan.tenant.policy.budgets[..],
        _ => plan.instance.map_or(&[][..], |i| &i.policy.budgets[..]),
    }
}

fn budget_fails(
    plan: &Plan<'_>,
    list: &[crate::policy::Budget],
    s: &NodeState,
    scope: Scope,
    worst: &mut Option<Fail>,
) {
    let now = plan.now.as_micros() as f64;
    let c = plan.cost;
    for b in list {
        let (start, end) = b.period.window(plan.now);
        let start = start.as_micros() as f64;
        let used = s
            .budgets
            .iter()
            .find(|x| x.period == b.period && x.start == start)
            .map_or(0.0, |x| x.used);
        if used + c > b.max + EPS {
            let end = end.as_micros() as f64;
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
                },
            );
        }
    }
}

/// The tool's half of an admitted decision, already written to the tool's state.
pub(crate) struct Top {
    takes: [[f64; 3]; 3],
    charge: LevelCharge,
    expires: f64,
    room: f64,
    slack: f64,
}

fn refuse(plan: &Plan<'_>, now: f64, f: Fail) -> Box<Refusal> {
    let tool = plan.tool;
    let mut r = Refusal::new(f.reason, &tool.name);
    r.tenant = (!plan.untenanted).then(|| plan.tenant.name.to_owned());
    r.instance = if plan.untenanted {
        Some(plan.tenant.name.to_owned())
    } else {
        plan.instance.map(|i| i.name.to_owned())
    };
    r.scope = Some(f.scope);
    r.window = Some(match f.window {
        Label::Period => tool.period.label(),
        Label::Word(w) => w.to_owned(),
    });
    r.limit = Some(f.limit);
    r.used = Some(f.used);
    r.window_secs = f.window_secs;
    if f.wait.is_finite() {
        let wait = f.wait.max(1.0).ceil();
        r.retry_after = Some(Duration::from_micros(wait as u64));
        r.reset_at = Some(Timestamp(f.reset_at.unwrap_or(now + wait) as u64));
        r.retryable = true;
    }
    Box::new(r)
}

/// A decision's second half: the tool's checks and draw, with the tool's state (locked by the
/// store for just this). Admitted: the tool's state is written and the rest is for
/// [`commit_below`]. Refused: nothing is written anywhere.
pub(crate) fn above(
    plan: &Plan<'_>,
    b: &mut Below<'_>,
    tool_state: &mut NodeState,
) -> Result<Top, Box<Refusal>> {
    let (now, period) = (b.now, b.period);
    if let Some(f) = b.callers {
        return Err(refuse(plan, now, f));
    }
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
    };
    refill(&mut t.state, &t.floor_b, &t.share_b, &t.ceil_b, now, period);
    roll_window(&mut t.state, b.window);
    b.levels[0] = t;

    // 3. Concurrency, before any rate is looked at: the tool's cap, then the caller's.
    if let Some(cap) = tool.max_concurrency {
        if t.state.in_flight + 1.0 > cap as f64 {
            return Err(refuse(
                plan,
                now,
                Fail {
                    reason: Reason::ConcurrencyExceeded,
                    scope: Scope::Tool,
                    wait: 1_000_000.0,
                    window: Label::Word("in_flight"),
                    window_secs: None,
                    limit: cap as f64,
                    used: t.state.in_flight,
                    reset_at: None,
                },
            ));
        }
    }
    if let Some(f) = b.concurrency {
        return Err(refuse(plan, now, f));
    }

    // 4. Budgets, the tool's first; 5. the tool's part of the walk.
    let mut worst = None;
    budget_fails(plan, &tool.budgets, tool_state, Scope::Tool, &mut worst);
    if let Some(f) = b.budgets {
        worse(&mut worst, f);
    }
    let ctx = PathCtx {
        levels: &b.levels[..b.n],
        banks: b.banks,
        cost: plan.cost,
        period,
        now,
        next_window: b.next_window,
        period_secs: tool.period.as_secs_ceil(),
    };
    let takes = match b.walk.and_then(|w| ctx.at_tool(w, true)) {
        Ok(t) => t,
        Err(_) => match ctx.below(false).and_then(|w| ctx.at_tool(w, false)) {
            Ok(t) => t,
            Err(f) => {
                worse(&mut worst, f);
                [[0.0; 3]; 3]
            }
        },
    };
    if let Some(f) = worst {
        return Err(refuse(plan, now, f));
    }

    // 6. Commit the tool.
    let (charge, expires) = commit_level(plan, b, 0, takes[0], tool_state);
    // The tool counts every floor unit drawn below it, for the window report.
    let mut floor_units = 0.0;
    for take in &takes[..b.n] {
        floor_units += take[0];
    }
    let s = &mut b.levels[0].state;
    s.floor_used += floor_units - takes[0][0];
    s.write(tool_state);
    let l = &b.levels[0];
    Ok(Top {
        takes,
        charge,
        expires,
        room: room(l),
        slack: l.state.ceiling,
    })
}

impl Top {
    /// When the tool's state may be forgotten (µs).
    pub(crate) fn expires(&self) -> f64 {
        self.expires
    }
}

impl Below<'_> {
    /// Until when an admitted template caller counts as tracked (µs).
    pub(crate) fn track_until(&self) -> f64 {
        self.now + self.period
    }
}

/// Non-floor units a level could still pass now.
fn room(l: &Level<'_>) -> f64 {
    l.state
        .ceiling
        .min(l.numbers.ceiling_rate - l.state.non_floor)
        .max(0.0)
}

/// Takes `take` (floor, share, ceiling) from level `idx`, counts the call in its windows and
/// budgets, and writes the budgets to `target` (the bucket numbers stay in `b` until written).
fn commit_level(
    plan: &Plan<'_>,
    b: &mut Below<'_>,
    idx: usize,
    take: [f64; 3],
    target: &mut NodeState,
) -> (LevelCharge, f64) {
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
    let permit = match idx {
        0 => plan.tool.max_concurrency.is_some(),
        1 => plan.tenant.policy.max_concurrency.is_some(),
        _ => plan
            .instance
            .is_some_and(|i| i.policy.max_concurrency.is_some()),
    };
    if permit {
        s.in_flight += 1.0;
    }
    let list = budget_list(plan, idx);
    let mut charged = Vec::new();
    if !list.is_empty() {
        charged.reserve_exact(list.len());
        if target.budgets.capacity() < list.len() {
            target
                .budgets
                .reserve_exact(list.len() - target.budgets.len());
        }
    }
    for bud in list {
        let start = bud.period.window(plan.now).0.as_micros() as f64;
        match target.budgets.iter_mut().find(|x| x.period == bud.period) {
            Some(x) if x.start == start => x.used += c,
            Some(x) => {
                x.start = start;
                x.used = c;
            }
            None => target.budgets.push(BudgetCounter {
                period: bud.period,
                start,
                used: c,
            }),
        }
        charged.push((bud.period, start));
    }
    let charge = LevelCharge {
        present: true,
        floor: f,
        floor_depth: l.floor_b.depth,
        share: h,
        share_depth: l.share_b.depth,
        ceiling: k,
        ceiling_depth: l.ceil_b.depth,
        permit,
        budgets: charged,
    };
    let expires = expiry(
        &l.state,
        &target.budgets,
        &l.floor_b,
        &l.share_b,
        &l.ceil_b,
        b.now,
        b.period,
        b.next_window,
    );
    (charge, expires)
}

/// A decision's last part, once [`above`] admitted it: writes the tenant's and the
/// instance's states. Needs no tool state.
pub(crate) fn commit_below(
    plan: &Plan<'_>,
    b: &mut Below<'_>,
    top: &mut Top,
    tenant_state: &mut NodeState,
    instance_state: Option<&mut NodeState>,
) -> Outcome {
    let n = b.n;
    let mut charge = Charge {
        cost: plan.cost,
        window: b.window,
        levels: Default::default(),
    };
    let mut expires = [b.now; 3];
    charge.levels[0] = std::mem::take(&mut top.charge);
    expires[0] = top.expires;
    let (c1, e1) = commit_level(plan, b, 1, top.takes[1], tenant_state);
    charge.levels[1] = c1;
    expires[1] = e1;
    b.levels[1].state.write(tenant_state);
    if let (3, Some(s)) = (n, instance_state) {
        let (c2, e2) = commit_level(plan, b, 2, top.takes[2], s);
        charge.levels[2] = c2;
        expires[2] = e2;
        b.levels[2].state.write(s);
    }

    let leaf = n - 1;
    let lf = &b.levels[leaf];
    let mut remaining = (lf.numbers.own_floor - lf.state.floor_used)
        .min(lf.state.floor)
        .max(0.0);
    let mut non_floor_room = f64::INFINITY.min(top.room);
    for l in &b.levels[1..n] {
        non_floor_room = non_floor_room.min(room(l));
    }
    remaining += non_floor_room;

    let view = |l: &Level<'_>| LevelView {
        weight: l.numbers.weight,
        floor: l.numbers.floor,
        share: l.numbers.share,
        ceiling: l.numbers.ceiling,
    };
    let views = [
        view(&b.levels[1]),
        if n == 3 {
            view(&b.levels[2])
        } else {
            LevelView::default()
        },
    ];
    let track_until = b.now + b.period;
    Outcome {
        expires,
        track_tenant_until: plan.tenant.policy.template.then_some(track_until),
        track_instance_until: plan
            .instance
            .and_then(|i| i.policy.template.then_some(track_until)),
        charge,
        remaining,
        quota: b.levels[leaf].numbers.ceiling,
        reset_in: b.next_window - b.now,
        slack: top.slack,
        views,
    }
}

/// When a level's state is equivalent to a fresh one: every bucket full, its window and
/// budget counters over. (Permits held keep a state alive regardless: the store checks.)
#[allow(clippy::too_many_arguments)]
fn expiry(
    s: &Scalars,
    budgets: &[BudgetCounter],
    f: &Bucket,
    h: &Bucket,
    k: &Bucket,
    now: f64,
    period: f64,
    next_window: f64,
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
    for b in budgets {
        if b.used > 0.0 {
            let (_, end) = b.period.window(Timestamp(b.start as u64));
            at = at.max(end.as_micros() as f64);
        }
    }
    at
}

/// Applies a correction to one level's state: `factor` × what was charged is added to the
/// counters and taken from the buckets (a negative factor gives back, never above a
/// bucket's depth). `now_window`/`now` say which window and budget windows are current, so
/// a correction never touches a window that has already closed.
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
        let delta = charge.cost * factor;
        s.total = (s.total + delta).max(0.0);
        s.non_floor = (s.non_floor + lc.ceiling * factor).max(0.0);
        let floor_delta = if level == 0 {
            (charge.cost - lc.ceiling) * factor
        } else {
            lc.floor * factor
        };
        s.floor_used = (s.floor_used + floor_delta).max(0.0);
    }
    for (period, start) in &lc.budgets {
        if period.window(now).0.as_micros() as f64 != *start {
            continue;
        }
        if let Some(b) = s
            .budgets
            .iter_mut()
            .find(|b| b.period == *period && b.start == *start)
        {
            b.used = (b.used + charge.cost * factor).max(0.0);
        }
    }
}

/// Releases one level's concurrency permit.
pub fn release(s: &mut NodeState) {
    s.in_flight = (s.in_flight - 1.0).max(0.0);
}
