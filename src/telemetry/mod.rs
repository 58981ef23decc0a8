//! What the limiter reports: metrics (feature `metrics`, through the `metrics` facade) and a
//! `tracing` event for every decision.
//!
//! | metric | type | unit | labels |
//! |---|---|---|---|
//! | [`DECISIONS`] `fairshare_decisions_total` | counter | decisions | `tool`, `tenant` (a listed tenant's name, one of the tool's [`busiest`] unlisted callers', or `other`), `outcome` (`admitted`, `refused`, `shadow`, `unmetered`), `reason` (`none` or the refusal's), `scope` (`none`, `tool`, `tenant`, `instance`); `instance` when enabled |
//! | [`TOOL_HEADROOM`] `fairshare_tool_headroom` | gauge | units | `tool`: pool tokens left to lend after the last admitted call |
//! | [`TENANT_HEADROOM`] `fairshare_tenant_headroom` | gauge | units | `tool`, `tenant`: units of the caller's quota (its ceiling per period) left in the current window after its last admitted call (the `r` of the `RateLimit` header) |
//! | [`DECISION_SECONDS`] `fairshare_decision_duration_seconds` | histogram | seconds | `store` (`memory`, `redis`, ...) |
//! | [`STORE_ERRORS`] `fairshare_store_errors_total` | counter | errors | `tool`, `store` |
//! | [`STORE_FALLBACKS`] `fairshare_store_fallbacks_total` | counter | decisions | `tool`, `mode` (`allow`: let through unmetered, `deny`: refused) |
//! | [`UNMAPPED`] `fairshare_unmapped_requests_total` | counter | requests | none: requests the layer let through because they name no tool (a path outside the tool prefix, no `ToolName`); each is also an event with its path, target `tower_fairshare::unmapped`: `warn` the first time its path's first segment is seen, `debug` after |
//! | [`LEASE_HITS`] `fairshare_lease_hits_total` | counter | decisions | `tool`: calls admitted from a lease this process held, without the store (the lease hit ratio is this over the tool's admitted decisions) |
//! | [`LEASE_GRANTS`] `fairshare_lease_grants_total` | counter | grants | `tool`: grants of more than one call's cost the store charged for a lease |
//! | [`LEASE_GRANTED_UNITS`] `fairshare_lease_granted_units_total` | counter | units | `tool`: units those grants charged |
//! | [`LEASE_RETURNED_UNITS`] `fairshare_lease_returned_units_total` | counter | units | `tool`: units given back to the store unspent (idle callers, ended windows, reloads, shutdown) |
//! | [`LEASE_HELD_UNITS`] `fairshare_lease_held_units` | gauge | units | `tool`: units charged and not yet spent, held in this process's leases |
//! | [`POLICY_MISMATCH`] `fairshare_policy_mismatch` | gauge | 0/1 | `tool`: 1 while the replicas sharing a Redis store enforce different policies for the tool |
//!
//! The `instance` label is off by default: label cardinality is a production hazard, and a
//! tool with a `default_instance` template may see thousands. Turn it on with
//! [`Limiter::instance_labels`](crate::Limiter::instance_labels).
//!
//! Decision events use the target `tower_fairshare::decision`: `debug` for admitted calls;
//! for refusals `info` for a caller's first in each window of the tool's period (with
//! `held_back`: how many of its refusals the window before did not write at `info`), at most
//! five a second per tool, and `debug` for the rest; with the fields that settle a dispute — tool, tenant, instance, cost,
//! outcome, reason, scope, window, limit, used, retry-after, and for admitted calls the
//! weight, floor, share and ceiling the caller was owed, what it has left, and the tool's
//! slack.

pub mod busiest;
pub(crate) mod decisions;
mod gate;
pub(crate) mod recorder;
mod refusals;
pub(crate) use refusals::RefusalLines;

pub(crate) use gate::let_through;

/// Counter of decisions.
pub const DECISIONS: &str = "fairshare_decisions_total";
/// Gauge of the tool's pool tokens left to lend.
pub const TOOL_HEADROOM: &str = "fairshare_tool_headroom";
/// Gauge of what a tenant could still take.
pub const TENANT_HEADROOM: &str = "fairshare_tenant_headroom";
/// Histogram of decision latency, per store.
pub const DECISION_SECONDS: &str = "fairshare_decision_duration_seconds";
/// Counter of store errors.
pub const STORE_ERRORS: &str = "fairshare_store_errors_total";
/// Counter of decisions made without the store (fail open or fail closed).
pub const STORE_FALLBACKS: &str = "fairshare_store_fallbacks_total";
/// Counter of requests a layer let through unmetered because they name no tool.
pub const UNMAPPED: &str = "fairshare_unmapped_requests_total";
/// Counter of calls admitted from a lease, without the store.
pub const LEASE_HITS: &str = "fairshare_lease_hits_total";
/// Counter of grants for leases (more than one call's cost).
pub const LEASE_GRANTS: &str = "fairshare_lease_grants_total";
/// Counter of units granted for leases.
pub const LEASE_GRANTED_UNITS: &str = "fairshare_lease_granted_units_total";
/// Counter of leased units given back unspent.
pub const LEASE_RETURNED_UNITS: &str = "fairshare_lease_returned_units_total";
/// Gauge of units held in this process's leases.
pub const LEASE_HELD_UNITS: &str = "fairshare_lease_held_units";
/// Counter of decisions a store finished after their caller went away (dropped, timed out)
/// and gave back: units refunded, permits released.
pub const ABANDONED: &str = "fairshare_abandoned_decisions_total";
/// Counter of times a store found its state lost (a restart without persistence, a flush,
/// an eviction).
pub const STORE_STATE_LOST: &str = "fairshare_store_state_lost_total";
/// Gauge: 1 while the store's server is configured so that it can lose state (`risk`:
/// `eviction`, `no_persistence`), 0 otherwise.
pub const STORE_RISK: &str = "fairshare_store_risk";

/// Gauge: 1 while the replicas sharing a store enforce different policies for `tool` (their
/// fingerprints differ), 0 once they agree.
pub const POLICY_MISMATCH: &str = "fairshare_policy_mismatch";

/// Registers the descriptions and units of every metric with the installed recorder. Call
/// once after installing it (e.g. a Prometheus exporter).
pub fn describe_metrics() {
    #[cfg(feature = "metrics")]
    {
        use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
        describe_counter!(
            DECISIONS,
            Unit::Count,
            "Admission decisions by tool, tenant, outcome, reason and scope."
        );
        describe_gauge!(
            TOOL_HEADROOM,
            "Pool units the tool can still lend (after the last admitted call)."
        );
        describe_gauge!(
            TENANT_HEADROOM,
            "Units of the caller's quota left in the current window (after its last admitted call)."
        );
        describe_histogram!(
            DECISION_SECONDS,
            Unit::Seconds,
            "Time to decide one call, by store."
        );
        describe_counter!(
            STORE_ERRORS,
            Unit::Count,
            "Store errors (timeouts, unreachable, protocol)."
        );
        describe_counter!(
            UNMAPPED,
            Unit::Count,
            "Requests let through unmetered because they name no tool."
        );
        describe_counter!(
            STORE_FALLBACKS,
            Unit::Count,
            "Decisions made without the store: allow = fail open, deny = fail closed."
        );
        describe_counter!(
            ABANDONED,
            Unit::Count,
            "Decisions finished after their caller went away and given back (units and permits)."
        );
        describe_counter!(
            STORE_STATE_LOST,
            Unit::Count,
            "Times the store found its state lost (restart without persistence, flush, eviction)."
        );
        describe_counter!(
            LEASE_HITS,
            Unit::Count,
            "Calls admitted from a lease this process held, without the store."
        );
        describe_counter!(
            LEASE_GRANTS,
            Unit::Count,
            "Grants of more than one call's cost charged for a lease."
        );
        describe_counter!(LEASE_GRANTED_UNITS, "Units charged by grants for leases.");
        describe_counter!(
            LEASE_RETURNED_UNITS,
            "Leased units given back to the store unspent."
        );
        describe_gauge!(
            LEASE_HELD_UNITS,
            "Units charged and not yet spent, held in this process's leases."
        );
        describe_gauge!(
            STORE_RISK,
            "1 while the store's server can lose state (eviction policy, persistence off)."
        );
        describe_gauge!(
            POLICY_MISMATCH,
            "1 while the replicas sharing the store enforce different policies for the tool."
        );
    }
}

/// A label value: a name the policy lists, or a fixed word (`other`, `unknown`, `none`).
/// Never a name a request made up: label values stay as few as the policy's names.
#[cfg(feature = "metrics")]
#[derive(Clone, Debug)]
pub(crate) enum LabelValue {
    Name(std::sync::Arc<str>),
    Word(&'static str),
}

#[cfg(feature = "metrics")]
impl LabelValue {
    /// A name the policy does not list (a template's caller, or past the label cap).
    pub(crate) const OTHER: LabelValue = LabelValue::Word("other");
    /// A caller or tool the policy does not know.
    pub(crate) const UNKNOWN: LabelValue = LabelValue::Word("unknown");

    fn shared(&self) -> metrics::SharedString {
        match self {
            LabelValue::Name(n) => metrics::SharedString::from(n.clone()),
            LabelValue::Word(w) => metrics::SharedString::const_str(w),
        }
    }

    fn is_name(&self) -> bool {
        matches!(self, LabelValue::Name(_))
    }
}

/// The labels of one decision.
#[cfg(feature = "metrics")]
#[derive(Clone, Debug)]
pub(crate) struct Labels {
    pub(crate) tool: LabelValue,
    pub(crate) tenant: LabelValue,
    pub(crate) instance: Option<LabelValue>,
}

#[cfg(feature = "metrics")]
pub(crate) fn decision(
    l: &Labels,
    outcome: &'static str,
    reason: &'static str,
    scope: &'static str,
) {
    use metrics::Label;
    // The fixed words are static labels; names are shared, not copied.
    let mut labels = Vec::with_capacity(6);
    labels.push(Label::new("tool", l.tool.shared()));
    labels.push(Label::new("tenant", l.tenant.shared()));
    labels.push(Label::from_static_parts("outcome", outcome));
    labels.push(Label::from_static_parts("reason", reason));
    labels.push(Label::from_static_parts("scope", scope));
    if let Some(i) = &l.instance {
        labels.push(Label::new("instance", i.shared()));
    }
    metrics::counter!(DECISIONS, labels).increment(1);
}

/// The tool's slack, and what a tenant the policy names could still take (a template's
/// callers share one `other` label, so a gauge of theirs would mean nothing).
#[cfg(feature = "metrics")]
pub(crate) fn headroom(l: &Labels, tool_slack: f64, tenant_remaining: f64) {
    if !l.tool.is_name() {
        return;
    }
    metrics::gauge!(TOOL_HEADROOM, "tool" => l.tool.shared()).set(tool_slack);
    if l.tenant.is_name() {
        metrics::gauge!(TENANT_HEADROOM, "tool" => l.tool.shared(), "tenant" => l.tenant.shared())
            .set(tenant_remaining);
    }
}

/// When a store call started, for the latency histogram: reads the clock only when metrics
/// are compiled in.
pub(crate) struct Started(#[cfg(feature = "metrics")] std::time::Instant);

impl Started {
    pub(crate) fn now() -> Self {
        Started(
            #[cfg(feature = "metrics")]
            std::time::Instant::now(),
        )
    }

    #[cfg(feature = "metrics")]
    pub(crate) fn record(self, store: &'static str) {
        metrics::histogram!(DECISION_SECONDS, "store" => store)
            .record(self.0.elapsed().as_secs_f64());
    }

    #[cfg(not(feature = "metrics"))]
    pub(crate) fn record(self, _: &'static str) {}
}

/// A call admitted from a lease, spending `cost` of the units it held.
#[cfg(feature = "metrics")]
pub(crate) fn lease_hit(tool: &std::sync::Arc<str>, cost: f64) {
    metrics::counter!(LEASE_HITS, "tool" => tool.clone()).increment(1);
    metrics::gauge!(LEASE_HELD_UNITS, "tool" => tool.clone()).decrement(cost);
}

/// A grant of `units` for a lease, `held` of them kept after its first call.
pub(crate) fn lease_granted(tool: &std::sync::Arc<str>, units: f64, held: f64) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!(LEASE_GRANTS, "tool" => tool.clone()).increment(1);
        metrics::counter!(LEASE_GRANTED_UNITS, "tool" => tool.clone()).increment(units as u64);
        metrics::gauge!(LEASE_HELD_UNITS, "tool" => tool.clone()).increment(held);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (tool, units, held);
}

/// `units` of a lease given back unspent.
pub(crate) fn lease_returned(tool: &str, units: f64) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!(LEASE_RETURNED_UNITS, "tool" => tool.to_owned()).increment(units as u64);
        metrics::gauge!(LEASE_HELD_UNITS, "tool" => tool.to_owned()).decrement(units);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (tool, units);
}

#[cfg(feature = "metrics")]
pub(crate) fn store_error(tool: &std::sync::Arc<str>, store: &'static str, mode: &'static str) {
    metrics::counter!(STORE_ERRORS, "tool" => tool.clone(), "store" => store).increment(1);
    metrics::counter!(STORE_FALLBACKS, "tool" => tool.clone(), "mode" => mode).increment(1);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn store_error(_: &std::sync::Arc<str>, _: &'static str, _: &'static str) {}

/// A request a layer let through because it names no tool: counted, a `warn` line the first
/// time its path's first segment is seen while warnings of the target are on (a misrouted
/// tool is found the day it ships), a `debug` event every time.
pub(crate) fn unmapped(path: &str) {
    let warned = tracing::enabled!(target: "tower_fairshare::unmapped", tracing::Level::WARN);
    if warned && gate::first_of_prefix(path) {
        tracing::warn!(target: "tower_fairshare::unmapped", path, "a request names no tool: passed through unmetered (said once per path prefix; every one at debug)");
    } else {
        tracing::debug!(target: "tower_fairshare::unmapped", path, "the request names no tool: passed through unmetered");
    }
    #[cfg(feature = "metrics")]
    metrics::counter!(UNMAPPED).increment(1);
}

#[cfg(feature = "metrics")]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn abandoned(tool: &str) {
    metrics::counter!(ABANDONED, "tool" => tool.to_owned()).increment(1);
}

#[cfg(not(feature = "metrics"))]
#[allow(dead_code)]
pub(crate) fn abandoned(_: &str) {}

#[cfg(feature = "metrics")]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn state_lost(store: &'static str, tool: &str) {
    metrics::counter!(STORE_STATE_LOST, "store" => store, "tool" => tool.to_owned()).increment(1);
}

#[cfg(not(feature = "metrics"))]
#[allow(dead_code)]
pub(crate) fn state_lost(_: &'static str, _: &str) {}

#[cfg(feature = "metrics")]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn store_risk(store: &'static str, risk: &'static str, at_risk: bool) {
    metrics::gauge!(STORE_RISK, "store" => store, "risk" => risk).set(if at_risk {
        1.0
    } else {
        0.0
    });
}

#[cfg(not(feature = "metrics"))]
#[allow(dead_code)]
pub(crate) fn store_risk(_: &'static str, _: &'static str, _: bool) {}

#[cfg(feature = "metrics")]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn policy_mismatch(tool: &str, mismatch: bool) {
    metrics::gauge!(POLICY_MISMATCH, "tool" => tool.to_owned()).set(if mismatch {
        1.0
    } else {
        0.0
    });
}

#[cfg(not(feature = "metrics"))]
#[allow(dead_code)]
pub(crate) fn policy_mismatch(_: &str, _: bool) {}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    /// What a subscriber listening at `warn` hears while `run` runs on this thread.
    fn warnings(run: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Heard(Arc<Mutex<Vec<u8>>>);
        impl Write for Heard {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let heard = Heard::default();
        let writer = heard.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, run);
        let text = heard.0.lock().unwrap().clone();
        String::from_utf8(text).unwrap()
    }

    /// A path prefix met while nobody listens to warnings is not spent: the first request of
    /// it once someone does is warned about, the next one is not.
    #[test]
    fn an_unmapped_prefix_is_warned_about_once_someone_listens() {
        super::unmapped("/unmapped-test/before");
        let heard = warnings(|| {
            super::unmapped("/unmapped-test/first");
            super::unmapped("/unmapped-test/second");
        });
        assert_eq!(heard.matches("names no tool").count(), 1, "{heard}");
        assert!(heard.contains("/unmapped-test/first"), "{heard}");
    }
}
