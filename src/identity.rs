//! Who is calling, and what a call costs.

use std::sync::Arc;

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
