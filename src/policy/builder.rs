//! Building a policy in code. The builder writes the same structure a file does and runs
//! the same validation, so a built policy obeys exactly the rules of a loaded one.

use super::raw::{RawBudget, RawLevel, RawPolicy, RawRate, RawTool};
use super::{validate, BudgetPeriod, OnStoreError, Policy, PolicyError, Unit};

/// Builds a [`Policy`] in code.
///
/// ```
/// use tower_fairshare::{Policy, ToolBuilder, TenantBuilder, Unit};
///
/// let policy = Policy::builder()
///     .tool(
///         ToolBuilder::new("web_search", Unit::Calls, 600.0, "1m")
///             .tenant("A", TenantBuilder::new().weight(6.0).floor(100.0))
///             .tenant("B", TenantBuilder::new().weight(2.0).floor(60.0)),
///     )
///     .build()
///     .unwrap();
/// assert_eq!(policy.tool("web_search").unwrap().tenants().len(), 2);
/// ```
#[derive(Clone, Debug, Default)]
pub struct PolicyBuilder {
    raw: RawPolicy,
}

impl PolicyBuilder {
    /// Adds a tool.
    pub fn tool(mut self, tool: ToolBuilder) -> Self {
        self.raw.tool.push(tool.raw);
        self
    }

    /// Validates and returns the policy.
    pub fn build(self) -> Result<Policy, PolicyError> {
        validate::policy(self.raw)
    }
}

/// The setters of what every level has, the tool included: its burst, its cap on calls in
/// flight, its calendar budgets.
macro_rules! limit_setters {
    () => {
        /// The most units taken at one instant above the floors: the depth of the level's
        /// bucket.
        pub fn burst(mut self, burst: f64) -> Self {
            self.raw.burst = Some(burst);
            self
        }
        /// Cap on calls in flight at this level.
        pub fn max_concurrency(mut self, n: u32) -> Self {
            self.raw.max_concurrency = Some(n as f64);
            self
        }
        /// Adds a calendar budget.
        pub fn budget(mut self, period: BudgetPeriod, max: f64) -> Self {
            self.raw.budgets.push(RawBudget { period, max });
            self
        }
    };
}

/// One tool, for [`PolicyBuilder::tool`].
#[derive(Clone, Debug)]
pub struct ToolBuilder {
    raw: RawTool,
}

impl ToolBuilder {
    /// A tool named `name` with capacity `limit` units per `per` (e.g. `"1m"`).
    pub fn new(name: impl Into<String>, unit: Unit, limit: f64, per: impl Into<String>) -> Self {
        ToolBuilder {
            raw: RawTool {
                name: name.into(),
                group: None,
                unit,
                rate: RawRate {
                    limit,
                    per: per.into(),
                },
                burst: None,
                tier: None,
                tiers: None,
                require_tenant: None,
                max_concurrency: None,
                budgets: Vec::new(),
                enforce: None,
                on_store_error: None,
                default_ceiling: None,
                lease: None,
                default_tenant: None,
                plans: Default::default(),
                unknown_plan: None,
                tenants: Default::default(),
            },
        }
    }
    limit_setters!();
    /// Tiers allowed to call (any caller when never called).
    pub fn tiers<I: IntoIterator<Item = S>, S: Into<String>>(mut self, tiers: I) -> Self {
        self.raw.tiers = Some(tiers.into_iter().map(Into::into).collect());
        self
    }
    /// Whether callers without a tenant are refused (default true).
    pub fn require_tenant(mut self, yes: bool) -> Self {
        self.raw.require_tenant = Some(yes);
        self
    }
    /// `false`: shadow mode (decide and record, never refuse).
    pub fn enforce(mut self, yes: bool) -> Self {
        self.raw.enforce = Some(yes);
        self
    }
    /// What to do when the store is unreachable.
    pub fn on_store_error(mut self, mode: OnStoreError) -> Self {
        self.raw.on_store_error = Some(mode);
        self
    }
    /// Callers without a `ceiling` of their own may take everything not reserved for others
    /// (their floor + the whole spare) instead of their nominal allocation (floor + share):
    /// the tool lends all its idle capacity. Floors stay reserved.
    pub fn work_conserving(mut self) -> Self {
        self.raw.default_ceiling = Some(super::raw::DefaultCeiling::Capacity);
        self
    }
    /// Caps what a process may hold of a caller's own allocation at a time (leases: charged
    /// at every level in advance, so most decisions touch no shared state; see the crate's
    /// notes on leases). By default leases size themselves with no cap of their own.
    pub fn lease_max(mut self, max: f64) -> Self {
        self.raw.lease = Some(super::raw::RawLease::Max(max));
        self
    }
    /// Puts the tool in `group` (`group = "..."`): tools one call is charged to together
    /// must share one.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.raw.group = Some(group.into());
        self
    }
    /// Decides every call at the store: no leases (`lease = "off"`).
    pub fn no_leases(mut self) -> Self {
        self.raw.lease = Some(super::raw::RawLease::Word("off".into()));
        self
    }
    /// The template for unlisted tenants.
    pub fn default_tenant(mut self, t: TenantBuilder) -> Self {
        self.raw.default_tenant = Some(t.raw);
        self
    }
    /// Adds a plan: the template for unlisted tenants whose caller carries it
    /// ([`Caller::with_plan`](crate::Caller::with_plan)).
    pub fn plan(mut self, name: impl Into<String>, t: TenantBuilder) -> Self {
        self.raw.plans.0.push((name.into(), t.raw));
        self
    }
    /// What to do with a caller whose plan this tool does not list.
    pub fn unknown_plan(mut self, what: super::UnknownPlan) -> Self {
        self.raw.unknown_plan = Some(what);
        self
    }
    /// Adds a named tenant.
    pub fn tenant(mut self, name: impl Into<String>, t: TenantBuilder) -> Self {
        self.raw.tenants.0.push((name.into(), t.raw));
        self
    }
}

/// A tenant (or the tenant template), for [`ToolBuilder::tenant`].
#[derive(Clone, Debug, Default)]
pub struct TenantBuilder {
    raw: RawLevel,
}

macro_rules! level_setters {
    () => {
        /// Weight for the share of spare capacity (default 1).
        pub fn weight(mut self, w: f64) -> Self {
            self.raw.weight = Some(w);
            self
        }
        /// Guaranteed units per period (default 0).
        pub fn floor(mut self, f: f64) -> Self {
            self.raw.floor = Some(f);
            self
        }
        /// The most units per period (default floor + share).
        pub fn ceiling(mut self, c: f64) -> Self {
            self.raw.ceiling = Some(c);
            self
        }
        limit_setters!();
    };
}

impl TenantBuilder {
    /// A tenant with weight 1 and no floor.
    pub fn new() -> Self {
        Self::default()
    }
    level_setters!();
    /// For the template only: distinct unlisted tenants counted at once (each from its first
    /// call in a period to the end of the next).
    pub fn max_tenants(mut self, n: u64) -> Self {
        self.raw.max_tenants = Some(n as f64);
        self
    }
    /// The template for this tenant's unlisted instances.
    pub fn default_instance(mut self, i: InstanceBuilder) -> Self {
        self.raw.default_instance = Some(Box::new(i.raw));
        self
    }
    /// Adds a named instance.
    pub fn instance(mut self, name: impl Into<String>, i: InstanceBuilder) -> Self {
        self.raw.instances.0.push((name.into(), i.raw));
        self
    }
}

/// An instance (or the instance template), for [`TenantBuilder::instance`].
#[derive(Clone, Debug, Default)]
pub struct InstanceBuilder {
    raw: RawLevel,
}

impl InstanceBuilder {
    /// An instance with weight 1 and no floor.
    pub fn new() -> Self {
        Self::default()
    }
    level_setters!();
    /// For the template only: distinct unlisted instances counted at once (each from its
    /// first call in a period to the end of the next).
    pub fn max_instances(mut self, n: u64) -> Self {
        self.raw.max_instances = Some(n as f64);
        self
    }
}
