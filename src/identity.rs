//! Who is calling, what a call costs, and who is charged for it under a policy.

use std::sync::Arc;

use crate::admission::engine::{LevelRef, Plan};
use crate::admission::{Reason, Refusal};
use crate::clock::Timestamp;
use crate::policy::Policy;

/// The caller of a tool, as established by the application's own authentication.
///
/// Put it in the request extensions from your auth layer (or return it from an
/// [`Identify`](crate::Identify) implementation). Never build it from anything a client or a
/// model can write into the request body: whoever sets the caller chooses who gets charged.
///
/// ```
/// use tower_fairshare::Caller;
/// let caller = Caller::new("acme").with_instance("report-agent").with_tier("internal");
/// assert_eq!(caller.tenant(), Some("acme"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Caller {
    tenant: Option<Arc<str>>,
    instance: Option<Arc<str>>,
    tier: Option<Arc<str>>,
    plan: Option<Arc<str>>,
}

impl Caller {
    /// A caller belonging to `tenant`.
    pub fn new(tenant: impl Into<Arc<str>>) -> Self {
        Caller {
            tenant: Some(tenant.into()),
            instance: None,
            tier: None,
            plan: None,
        }
    }

    /// A caller without a tenant (allowed only by tools with `require_tenant = false`).
    pub fn untenanted() -> Self {
        Caller::default()
    }

    /// Sets the agent instance / session pool within the tenant (or, for an untenanted
    /// caller, its client id).
    pub fn with_instance(mut self, instance: impl Into<Arc<str>>) -> Self {
        self.instance = Some(instance.into());
        self
    }

    /// Sets the caller's tier, checked against a tool's `tier` / `tiers`.
    pub fn with_tier(mut self, tier: impl Into<Arc<str>>) -> Self {
        self.tier = Some(tier.into());
        self
    }

    /// Sets the caller's plan (e.g. from its token): an unlisted tenant is governed by the
    /// tool's `[tool.plans.<plan>]` template. A tenant the policy lists is governed by its
    /// own entry whatever its plan.
    pub fn with_plan(mut self, plan: impl Into<Arc<str>>) -> Self {
        self.plan = Some(plan.into());
        self
    }

    /// The plan, if any.
    pub fn plan(&self) -> Option<&str> {
        self.plan.as_deref()
    }

    /// The tenant, if any.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// The instance, if any.
    pub fn instance(&self) -> Option<&str> {
        self.instance.as_deref()
    }

    /// The tier, if any.
    pub fn tier(&self) -> Option<&str> {
        self.tier.as_deref()
    }

    pub(crate) fn tier_arc(&self) -> Option<&Arc<str>> {
        self.tier.as_ref()
    }

    pub(crate) fn plan_arc(&self) -> Option<&Arc<str>> {
        self.plan.as_ref()
    }

    pub(crate) fn tenant_arc(&self) -> Option<&Arc<str>> {
        self.tenant.as_ref()
    }

    pub(crate) fn instance_arc(&self) -> Option<&Arc<str>> {
        self.instance.as_ref()
    }
}

/// What a call costs, in the tool's unit. Without it a call costs 1.
///
/// Put it in the request extensions (e.g. estimated LLM tokens); put it in the response
/// extensions to correct the charge with the actual cost once known.
#[derive(Copy, Clone, Debug, PartialEq, PartialOrd)]
pub struct Cost(pub f64);

impl Default for Cost {
    fn default() -> Self {
        Cost(1.0)
    }
}

/// The name of an untenanted caller that gave no client id.
static NO_NAME: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(""));

impl Caller {
    /// Who is charged for this caller calling `tool` at `now` under `policy`, costing `cost`:
    /// the identity and tool checks of the order of operations, before any counter is
    /// touched (unknown tool, missing tenant, tier, plan, unlisted instance, invalid cost).
    pub(crate) fn charged_as<'p>(
        &'p self,
        policy: &'p Policy,
        tool: &str,
        cost: Cost,
        now: Timestamp,
    ) -> Result<Plan<'p>, Refusal> {
        let Some(tp) = policy.tool(tool) else {
            // The name comes from the caller (a URL path, a tool call): echoed cut short.
            let mut r = Refusal::new(Reason::PermissionDenied, crate::admission::echoed(tool));
            r.detail = Some("unknown_tool");
            r.set_caller(self.tenant.clone(), self.instance.clone());
            return Err(r);
        };
        let deny = |reason, what| Err(self.denial(reason, tool, what));
        // Identity before permission: a caller without one is 401 whatever the tool's tier.
        if self.tenant.is_none() && (tp.require_tenant() || tp.default_tenant().is_none()) {
            return deny(Reason::UnidentifiedCaller, "missing_tenant");
        }
        if !tp.allows_tier(self.tier()) {
            return deny(Reason::PermissionDenied, "tier");
        }
        let tenant = match &self.tenant {
            Some(t) => match tp.tenant_on(t, self.plan()) {
                Ok(p) => LevelRef { name: t, policy: p },
                Err(why) => return deny(Reason::PermissionDenied, why),
            },
            None => LevelRef {
                name: self.instance.as_ref().unwrap_or(&NO_NAME),
                policy: tp.default_tenant().expect("checked above"),
            },
        };
        let untenanted = self.tenant.is_none();
        let instance = match (&self.instance, untenanted) {
            (Some(i), false) if tenant.policy.has_instances() => match tenant.policy.instance(i) {
                Some(p) => Some(LevelRef { name: i, policy: p }),
                None => return deny(Reason::PermissionDenied, "unlisted_instance"),
            },
            _ => None,
        };
        if !(cost.0.is_finite() && cost.0 >= 0.0) {
            let mut r = self.denial(Reason::PermissionDenied, tool, "invalid_cost");
            r.retryable = false;
            return Err(r);
        }
        let (tool, cost) = (tp, cost.0);
        Ok(Plan {
            now,
            cost,
            tool,
            tenant,
            instance,
            untenanted,
        })
    }

    /// A refusal of this caller's call of `tool` for `what` (a `detail`), at the tool.
    pub(crate) fn denial(&self, reason: Reason, tool: &str, what: &'static str) -> Refusal {
        let mut r = Refusal::new(reason, tool);
        r.set_caller(self.tenant.clone(), self.instance.clone());
        r.scope = Some(crate::Scope::Tool);
        r.detail = Some(what);
        r
    }
}
