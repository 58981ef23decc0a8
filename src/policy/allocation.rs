//! The allocation table: what each tenant and instance is owed per period.

use serde::Serialize;

use super::numbers::{instance_numbers, level_numbers};
use super::{Budget, LevelPolicy, Policy, ToolPolicy};

/// Every tool's allocation.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Allocation {
    /// One entry per tool, in policy order.
    pub tools: Vec<ToolAllocation>,
}

/// One tool's allocation.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct ToolAllocation {
    /// Tool name.
    pub name: String,
    /// Unit of cost.
    pub unit: &'static str,
    /// Capacity C per period.
    pub capacity: f64,
    /// The period, e.g. `1m`.
    pub period: String,
    /// The tool's burst above the floors.
    pub burst: f64,
    /// C − Σ reserved floors: what is split by weight.
    pub spare: f64,
    /// The tool's own budgets as `(period, max)`.
    pub budgets: Vec<(String, f64)>,
    /// Configured tenants, then the template (`*`) if any, then each plan's template (`*`
    /// with its [`plan`](TenantAllocation::plan)).
    pub tenants: Vec<TenantAllocation>,
}

/// One tenant's allocation.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct TenantAllocation {
    /// Tenant name, `*` for a template.
    pub name: String,
    /// For a plan's template, the plan.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    /// Floor per period as written.
    pub floor: f64,
    /// Floor held back at the tool (≥ floor when instance floors add up to more).
    pub reserved_floor: f64,
    /// Weight.
    pub weight: f64,
    /// Nominal share of spare capacity.
    pub share: f64,
    /// Ceiling per period (explicit, or floor + share).
    pub ceiling: f64,
    /// The ceiling when no caller of the template is active (a listed tenant calling alone):
    /// above [`ceiling`](Self::ceiling) when the tool has a template, whose one active caller
    /// the share and ceiling count; the same otherwise, and for the template itself.
    pub alone_ceiling: f64,
    /// Burst above the floor.
    pub burst: f64,
    /// Budgets as `(period, max)`.
    pub budgets: Vec<(String, f64)>,
    /// Instances, then the instance template (`*`) if any.
    pub instances: Vec<InstanceAllocation>,
}

/// One instance's allocation inside its tenant.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct InstanceAllocation {
    /// Instance name, `*` for the template.
    pub name: String,
    /// Floor per period.
    pub floor: f64,
    /// Weight inside the tenant.
    pub weight: f64,
    /// Nominal share of the tenant's spare.
    pub share: f64,
    /// Ceiling per period.
    pub ceiling: f64,
    /// Burst above the floor.
    pub burst: f64,
    /// Budgets as `(period, max)`.
    pub budgets: Vec<(String, f64)>,
}

fn budgets(b: &[Budget]) -> Vec<(String, f64)> {
    b.iter()
        .map(|b| (b.period.as_str().to_owned(), b.max))
        .collect()
}

pub(super) fn compute(policy: &Policy) -> Allocation {
    Allocation {
        tools: policy.tools.iter().map(|t| tool(t)).collect(),
    }
}

fn tool(t: &ToolPolicy) -> ToolAllocation {
    let spare = t.spare();
    // One active caller of each template.
    let templates = t
        .default_tenant
        .iter()
        .chain(t.plans.iter().map(|(_, p)| p));
    let weight = t.configured_weight + templates.map(|d| d.weight).sum::<f64>();
    let listed = t.tenants.iter().map(|l| TenantAllocation {
        alone_ceiling: level_numbers(l, spare, t.configured_weight).ceiling,
        ..tenant(l, spare, weight)
    });
    let template = t.default_tenant.iter().map(|d| tenant(d, spare, weight));
    let plans = t.plans.iter().map(|(name, p)| TenantAllocation {
        plan: Some(name.to_string()),
        ..tenant(p, spare, weight)
    });
    let tenants = listed.chain(template).chain(plans).collect();
    ToolAllocation {
        name: t.name.to_string(),
        unit: t.unit.as_str(),
        capacity: t.capacity,
        period: t.period.to_string(),
        burst: t.burst,
        spare,
        budgets: budgets(&t.budgets),
        tenants,
    }
}

fn tenant(l: &LevelPolicy, spare: f64, weight: f64) -> TenantAllocation {
    let tn = level_numbers(l, spare, weight);
    let (share, ceiling) = (tn.share, tn.ceiling);
    let instances = l
        .children
        .iter()
        .chain(l.default_child.as_deref())
        .map(|i| {
            // With one template instance counted.
            let n = instance_numbers(l, tn, i, 1.0);
            InstanceAllocation {
                name: i.name.to_string(),
                floor: i.floor,
                weight: i.weight,
                share: n.share,
                ceiling: n.ceiling,
                burst: i.burst,
                budgets: budgets(&i.budgets),
            }
        })
        .collect();
    TenantAllocation {
        name: l.name.to_string(),
        plan: None,
        floor: l.floor,
        reserved_floor: l.reserved_floor,
        weight: l.weight,
        share,
        ceiling,
        alone_ceiling: ceiling,
        burst: l.burst,
        budgets: budgets(&l.budgets),
        instances,
    }
}
