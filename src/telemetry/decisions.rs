//! What the limiter records of each decision: the decision event, the metrics, the refusals
//! the console keeps, and the tool's busiest unlisted callers.

use std::sync::Arc;

use super::busiest::{Busiest, BusyCaller, Kind, STEP};
use super::recorder::Recorder;
use super::RefusalLines;
use crate::admission::Refusal;
use crate::clock::Timestamp;
use crate::identity::{Caller, Cost};
use crate::policy::Policy;
use crate::ticket::Ticket;

/// How many of a tool's tenants the metrics label by name unless told otherwise.
pub(crate) const DEFAULT_TENANT_LABELS: usize = 1_000;

/// A decision as the limiter answers it.
pub(crate) type Outcome = Result<Ticket, Refusal>;

/// Everything the limiter records of its decisions, and how.
#[derive(Debug)]
pub(crate) struct Decisions {
    pub(crate) instance_labels: bool,
    pub(crate) tenant_labels: usize,
    /// Refusals counted and kept for the console (off until one is made).
    pub(crate) recorder: Recorder,
    /// Which refusals get an `info` line (one per caller per window).
    refusal_lines: RefusalLines,
    /// The busiest unlisted callers of each tool, named in metrics and the console.
    busiest: Busiest,
}

impl Default for Decisions {
    fn default() -> Self {
        Decisions {
            instance_labels: false,
            tenant_labels: DEFAULT_TENANT_LABELS,
            recorder: Recorder::default(),
            refusal_lines: RefusalLines::default(),
            busiest: Busiest::default(),
        }
    }
}

impl Decisions {
    /// Drops what was kept for tools and tenants `policy` no longer lists.
    pub(crate) fn retain(&self, policy: &Policy) {
        self.recorder.retain(policy);
        self.busiest.retain(|tool| policy.tool(tool).is_some());
    }

    /// Records the decision `outcome` of `caller` calling `tool` at `now`.
    pub(crate) fn record(
        &self,
        policy: &Policy,
        caller: &Caller,
        tool: &str,
        cost: Cost,
        outcome: &Outcome,
        now: Timestamp,
    ) {
        let names = [
            tool,
            caller.tenant().unwrap_or(""),
            caller.instance().unwrap_or(""),
        ];
        let mut refusals_in_window = 0;
        match outcome {
            Ok(t) => match (t.admission(), &t.shadow_refusal) {
                (Some(_), _) => trace_admitted(caller, tool, cost, t),
                (None, Some(r)) => {
                    self.event(policy, r, names, cost, "shadow", now);
                }
                (None, None) => {}
            },
            Err(r) => {
                refusals_in_window = self.event(policy, r, names, cost, "refused", now);
                self.recorder.refused(policy, caller, tool, r, || now);
            }
        }
        self.report_busy(policy, caller, tool, cost, outcome, refusals_in_window, now);
        #[cfg(feature = "metrics")]
        let _ = self.count(policy, caller, tool, outcome);
    }

    /// Records a call admitted from its lease (a lease hit: the units it spent are no longer
    /// held): the policy is loaded only when someone reads what it would record.
    pub(crate) fn record_leased(
        &self,
        policy: impl FnOnce() -> arc_swap::Guard<Arc<Policy>>,
        caller: &Caller,
        tool: &str,
        cost: Cost,
        ticket: &Ticket,
        now: Timestamp,
    ) {
        trace_admitted(caller, tool, cost, ticket);
        if self.counts_busiest() {
            let policy = policy();
            let outcome = Ok(ticket.clone());
            self.report_busy(&policy, caller, tool, cost, &outcome, 0, now);
            #[cfg(feature = "metrics")]
            {
                let labels = self.count(&policy, caller, tool, &outcome);
                if let super::LabelValue::Name(tool) = &labels.tool {
                    super::lease_hit(tool, cost.0);
                }
            }
        }
    }

    /// Whether anyone reads the busiest callers: metrics compiled in, or a console made.
    fn counts_busiest(&self) -> bool {
        cfg!(feature = "metrics") || self.recorder.is_on()
    }

    /// Reports a decision of a caller a template governs to the tool's busiest when it
    /// crosses a step: its use in the window a multiple of `STEP` units, or its
    /// `refusals_in_window` (this one included) a multiple of `STEP`.
    #[allow(clippy::too_many_arguments)]
    fn report_busy(
        &self,
        policy: &Policy,
        caller: &Caller,
        tool: &str,
        cost: Cost,
        outcome: &Outcome,
        refusals_in_window: u64,
        now: Timestamp,
    ) {
        if !self.counts_busiest() {
            return;
        }
        let weight = match outcome {
            Err(_) if refusals_in_window > 0 && refusals_in_window.is_multiple_of(STEP as u64) => {
                [STEP, STEP]
            }
            Ok(t) => {
                let (Some(quota), Some(left)) = (t.quota(), t.remaining()) else {
                    return;
                };
                // Its use before this call is never below 0: a caller whose quota is under
                // one call would otherwise cross a step with every call.
                let used = (quota - left).max(0.0);
                let before = (used - cost.0).max(0.0);
                if (used / STEP).floor() <= (before / STEP).floor() {
                    return;
                }
                [STEP, 0.0]
            }
            Err(_) => return,
        };
        let (Some(tp), Some(tenant)) = (policy.tool(tool), caller.tenant_arc()) else {
            return;
        };
        let Ok(tenant_policy) = tp.tenant_on(tenant, caller.plan()) else {
            return;
        };
        let secs = now.as_micros() / 1_000_000;
        if tenant_policy.template {
            let key = (tenant, None);
            self.busiest
                .report(tp.name_arc(), Kind::Tenant, key, weight, secs);
        }
        if let Some(i) = caller.instance_arc() {
            if tenant_policy.instance(i).is_some_and(|ip| ip.template) {
                let key = (tenant, Some(i));
                self.busiest
                    .report(tp.name_arc(), Kind::Instance, key, weight, secs);
            }
        }
    }

    /// The busiest unlisted callers of `tool` at `now`: template tenants, then template
    /// instances.
    pub(crate) fn busiest(&self, tool: &str, now: Timestamp) -> [Vec<BusyCaller>; 2] {
        let secs = now.as_micros() / 1_000_000;
        [
            self.busiest.named(tool, Kind::Tenant, secs),
            self.busiest.named(tool, Kind::Instance, secs),
        ]
    }

    /// The decision event of a refusal (or a shadow refusal); the caller's refusals in the
    /// window so far.
    fn event(
        &self,
        policy: &Policy,
        r: &Refusal,
        names: [&str; 3],
        cost: Cost,
        outcome: &'static str,
        now: Timestamp,
    ) -> u64 {
        // Nothing to keep when nobody reads the lines nor the busiest callers.
        let logged = tracing::enabled!(target: "tower_fairshare::decision", tracing::Level::INFO);
        if !logged && !self.counts_busiest() {
            return 0;
        }
        let now = now.as_micros();
        let period = policy
            .tool(names[0])
            .map_or(1, |tp| tp.period().as_micros().max(1));
        let windows = [now / period, now / 1_000_000];
        self.refusal_lines.event(r, names, cost.0, outcome, windows)
    }

    /// The decision's metrics; the labels they were counted under.
    #[cfg(feature = "metrics")]
    fn count(
        &self,
        policy: &Policy,
        caller: &Caller,
        tool: &str,
        outcome: &Outcome,
    ) -> super::Labels {
        let labels = self.labels(policy, caller, tool);
        let scope = |r: &Refusal| r.scope.map_or("none", |s| s.as_str());
        match outcome {
            Ok(t) => match (t.admission(), &t.shadow_refusal) {
                (Some(a), _) => {
                    super::decision(&labels, "admitted", "none", "none");
                    super::headroom(&labels, a.slack, t.remaining().unwrap_or(a.remaining));
                }
                (None, Some(r)) => super::decision(&labels, "shadow", r.reason.as_str(), scope(r)),
                (None, None) => super::decision(&labels, "unmetered", "store_unavailable", "none"),
            },
            Err(r) => super::decision(&labels, "refused", r.reason.as_str(), scope(r)),
        }
        labels
    }

    /// The metric labels of `caller` calling `tool`: names the policy lists (listed callers,
    /// the first `tenant_labels`; unlisted ones while they are among the busiest), or words.
    #[cfg(feature = "metrics")]
    fn labels(&self, policy: &Policy, caller: &Caller, tool: &str) -> super::Labels {
        use super::LabelValue;
        let cap = self.tenant_labels;
        let named = |p: &crate::policy::LevelPolicy, busy: bool, claimed: Option<&Arc<str>>| match (
            p.template, claimed,
        ) {
            (false, _) if p.position < cap => LabelValue::Name(p.name.clone()),
            (true, Some(name)) if busy => LabelValue::Name(name.clone()),
            _ => LabelValue::OTHER,
        };
        let Some(tp) = policy.tool(tool) else {
            return super::Labels {
                tool: LabelValue::UNKNOWN,
                tenant: LabelValue::UNKNOWN,
                instance: self.instance_labels.then_some(LabelValue::UNKNOWN),
            };
        };
        let tenant_policy = match caller.tenant() {
            Some(t) => tp.tenant_on(t, caller.plan()).ok(),
            None if !tp.require_tenant() => tp.default_tenant(),
            None => None,
        };
        let key = |i| (caller.tenant().unwrap_or(""), i);
        let tenant = tenant_policy.map_or(LabelValue::UNKNOWN, |p| {
            let busy = p.template && self.busiest.is_named(tool, Kind::Tenant, key(None));
            named(p, busy, caller.tenant_arc())
        });
        let instance = self
            .instance_labels
            .then(|| match (tenant_policy, caller.instance()) {
                (_, None) => LabelValue::Word("none"),
                (Some(p), Some(i)) if p.has_instances() => {
                    p.instance(i).map_or(LabelValue::UNKNOWN, |ip| {
                        let busy = ip.template
                            && self.busiest.is_named(tool, Kind::Instance, key(Some(i)));
                        named(ip, busy, caller.instance_arc())
                    })
                }
                // Instances the policy does not limit separately have no names of their own.
                (Some(_), Some(_)) => LabelValue::OTHER,
                (None, Some(_)) => LabelValue::UNKNOWN,
            });
        super::Labels {
            tool: LabelValue::Name(tp.name_arc().clone()),
            tenant,
            instance,
        }
    }
}

/// The decision event of an admitted call (the check that anyone listens, inline; the event,
/// not).
fn trace_admitted(caller: &Caller, tool: &str, cost: Cost, t: &Ticket) {
    if tracing::enabled!(target: "tower_fairshare::decision", tracing::Level::DEBUG) {
        trace_admitted_event(caller, tool, cost, t);
    }
}

#[cold]
#[inline(never)]
fn trace_admitted_event(caller: &Caller, tool: &str, cost: Cost, t: &Ticket) {
    let Some(a) = t.admission() else {
        return;
    };
    let v = a.views[usize::from(a.keys.instance.is_some())];
    tracing::debug!(
        target: "tower_fairshare::decision",
        tool,
        tenant = caller.tenant().unwrap_or(""),
        instance = caller.instance().unwrap_or(""),
        cost = cost.0, outcome = "admitted",
        weight = v.weight, floor = v.floor, share = v.share, ceiling = v.ceiling,
        remaining = t.remaining().unwrap_or(a.remaining), slack = a.slack,
        at_us = a.at.as_micros(), leased = t.leased_part().is_some(),
    );
}
