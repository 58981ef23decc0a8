//! The decision's entry points: the plan of one call, and the pure decision over a snapshot
//! of the stored states (for stores that read, decide and write atomically; the in-process
//! store runs the same halves around its tool's lock).

use super::bucket::aligned_window;
use super::phases::{above, below, commit_below, figures, Below, Report, Top};
use super::refusal::Refusal;
use super::state::{Charge, LevelView, NodeState};
use super::template;
use std::sync::Arc;

use crate::clock::Timestamp;
use crate::policy::{LevelPolicy, ToolPolicy};

/// A level of the call: its name and the policy that applies (own entry or template).
#[derive(Copy, Clone, Debug)]
pub struct LevelRef<'a> {
    /// Tenant or instance name (for an untenanted caller: its client id), shared with the
    /// caller's keys.
    pub name: &'a Arc<str>,
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
    /// The tool (shared: a store may keep it past the call, to decide it later in a batch).
    pub tool: &'a Arc<ToolPolicy>,
    /// The tenant (or the untenanted caller, governed by the tenant template).
    pub tenant: LevelRef<'a>,
    /// The instance, when the tenant limits instances separately.
    pub instance: Option<LevelRef<'a>>,
    /// True when `tenant` is an untenanted caller.
    pub untenanted: bool,
}

impl Plan<'_> {
    /// The store keys of this call: the tool's, the tenant's and the instance's names it
    /// carries, shared (no string is copied).
    pub fn keys(&self) -> crate::store::CallKeys {
        crate::store::CallKeys::of(
            self.tool,
            &self.tenant,
            self.instance.as_ref(),
            self.untenanted,
        )
    }
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
}

/// The outcome of an admitted call.
#[derive(Clone, Debug, Default)]
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
    /// What was charged where.
    pub charge: Charge,
    /// Units of the caller's quota left in the current aligned window (the `r` of the
    /// `RateLimit` header, against `quota`, its `q`).
    pub remaining: f64,
    /// The caller's ceiling per period (the `q` of `RateLimit-Policy`).
    pub quota: f64,
    /// Microseconds until the aligned window resets.
    pub reset_in: f64,
    /// Pool tokens left at the tool after the call: the slack to lend.
    pub slack: f64,
    /// Tenant and instance numbers.
    pub views: [LevelView; 2],
    /// When the call was decided: the plan's time, or its records' latest if they are later
    /// (see [`decided_at`]).
    pub at: Timestamp,
}

impl Admitted {
    /// The [`Admission`](crate::store::Admission) a store answers for this call: what it
    /// charged, the numbers for headers and logs and when it was decided, under `keys`, with
    /// the store's `call` id (0 when it keeps no per-call entries).
    pub fn into_admission(
        self,
        keys: crate::store::CallKeys,
        call: u128,
    ) -> crate::store::Admission {
        crate::store::Admission {
            keys,
            charge: self.charge,
            remaining: self.remaining,
            quota: self.quota,
            reset_in: self.reset_in,
            slack: self.slack,
            views: self.views,
            at: self.at,
            call,
        }
    }
}

/// The engine's verdict.
#[derive(Clone, Debug)]
pub enum Verdict {
    /// Admit, writing the new state.
    Admit(Box<Admitted>),
    /// Refuse; nothing changes.
    Refuse(Refusal),
}

/// The time a call is decided at: its own, or the latest time any of its levels' states was
/// decided at, if that is later. Calls of one record may reach the store in another order than
/// their clocks were read in (two threads read the clock, then race for the record; replicas'
/// clocks differ): deciding one at a time before its record's would move the record's windows
/// back — clearing their counters, and uncounting its template callers. A call decided a little
/// later than it was made is like a call made a little later.
pub fn decided_at(now: Timestamp, states: &[&NodeState]) -> Timestamp {
    let mut at = now;
    for s in states {
        // Compared as they are stored; cast only when later (the cast is the costly part).
        if s.live && s.t > at.0 as f64 {
            at = at.max(Timestamp(s.t as u64));
        }
    }
    at
}

/// Decides one call. Pure: the same plan and snapshot always give the same verdict.
pub fn decide(plan: &Plan<'_>, snap: &Snapshot) -> Verdict {
    let levels = [&snap.tool, &snap.tenant, &snap.instance];
    let plan = &Plan {
        now: decided_at(
            plan.now,
            &levels[..if plan.instance.is_some() { 3 } else { 2 }],
        ),
        ..*plan
    };
    let mut tool = snap.tool;
    let tenant = snap.tenant;
    let instance = if plan.instance.is_some() {
        snap.instance
    } else {
        NodeState::default()
    };
    let mut b = Below::new();
    below(
        &mut b,
        plan,
        &tenant,
        plan.instance.is_some().then_some(&instance),
        tenants_counted(plan, &tool),
    );
    let mut top = Top::default();
    if let Err(r) = above(plan, &mut b, &mut tool, &mut top) {
        return Verdict::Refuse(r);
    }
    let mut a = Box::new(Admitted {
        tool,
        tenant,
        instance,
        at: plan.now,
        ..Admitted::default()
    });
    let out = &mut *a;
    out.expires = commit_below(
        plan,
        &mut b,
        &top,
        &mut out.tenant,
        plan.instance.is_some().then_some(&mut out.instance),
        Report {
            charge: &mut out.charge,
            remaining: &mut out.remaining,
            quota: &mut out.quota,
            reset_in: &mut out.reset_in,
            slack: &mut out.slack,
            views: &mut out.views,
        },
    );
    Verdict::Admit(a)
}

/// What [`decide`] would answer for `plan` on `snap`, and how each level stands, with
/// nothing written anywhere: for `Limiter::explain`.
pub(crate) struct Explained {
    pub(crate) verdict: Result<(), Refusal>,
    pub(crate) levels: Vec<crate::console::LevelFigures>,
}

/// [`decide`] without its outcome: the verdict and each level's figures (see [`Explained`]).
pub(crate) fn explain(plan: &Plan<'_>, snap: &Snapshot) -> Explained {
    let mut tool = snap.tool;
    let instance = plan.instance.is_some().then_some(&snap.instance);
    let mut b = Below::new();
    below(
        &mut b,
        plan,
        &snap.tenant,
        instance,
        tenants_counted(plan, &tool),
    );
    let levels = figures(plan, &b, &tool);
    let verdict = above(plan, &mut b, &mut tool, &mut Top::default());
    Explained { verdict, levels }
}

/// The unlisted tenants counted at the tool now, per template, from the tool's stored state: what [`below`]
/// takes.
#[inline]
fn tenants_counted(plan: &Plan<'_>, tool_state: &NodeState) -> template::Counted {
    let window = aligned_window(
        plan.now.as_micros() as f64,
        plan.tool.period.as_micros() as f64,
    );
    template::counted_per_slot(tool_state, window, plan.tool.plans.len())
}
