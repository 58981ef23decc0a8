//! What a decision is about: the call's plan (who is charged what, under which policy, at
//! what time) and the store keys of its levels. The bottom of the engine: it uses nothing
//! else of it.

use std::sync::Arc;

use crate::clock::Timestamp;
use crate::key::Name;
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

/// Everything static about one decision of one tool.
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

impl<'a> Plan<'a> {
    /// The store keys of this call: the tool's, the tenant's and the instance's names it
    /// carries (copied when short, see [`Name`]).
    pub fn keys(&self) -> CallKeys {
        CallKeys {
            tool: self.tool.key_name().clone(),
            group: self.tool.key_group().cloned(),
            tenant: Name::from(self.tenant.name),
            instance: self.instance.map(|i| Name::from(i.name)),
            untenanted: self.untenanted,
        }
    }

    /// The policy of the caller at level `level` (1 tenant, 2 instance); none for the tool
    /// (0), nor for a call without an instance.
    pub(crate) fn policy(&self, level: usize) -> Option<&'a LevelPolicy> {
        match level {
            0 => None,
            1 => Some(self.tenant.policy),
            _ => self.instance.map(|i| i.policy),
        }
    }

    /// Level `level`'s concurrency cap (0 tool, 1 tenant, 2 instance).
    pub(crate) fn cap(&self, level: usize) -> Option<u32> {
        match level {
            0 => self.tool.max_concurrency,
            l => self.policy(l).and_then(|p| p.max_concurrency),
        }
    }

    /// Whether the call takes a concurrency permit at level `level` (0 tool, 1 tenant,
    /// 2 instance).
    pub(crate) fn takes_permit(&self, level: usize) -> bool {
        self.cap(level).is_some()
    }

    /// Whether any level of the call caps calls in flight.
    pub(crate) fn capped(&self) -> bool {
        (0..3).any(|l| self.takes_permit(l))
    }
}

/// A [`Plan`] that owns what it refers to, so that it can be decided later (by a store's
/// worker, or once a store's I/O is done).
#[derive(Clone, Debug)]
pub struct OwnedPlan {
    pub(crate) now: Timestamp,
    cost: f64,
    pub(crate) tool: Arc<ToolPolicy>,
    tenant: (Arc<str>, Pick),
    instance: Option<(Arc<str>, Pick)>,
    untenanted: bool,
}

/// Which policy of a tool applies to a level: a listed one, by its place, or the template.
#[derive(Copy, Clone, Debug)]
enum Pick {
    Listed(usize),
    /// A template, in its slot (a tenant's: `default_tenant` or a plan's).
    Template(usize),
}

impl Pick {
    fn of(p: &LevelPolicy) -> Pick {
        match p.template {
            true => Pick::Template(p.slot),
            false => Pick::Listed(p.position),
        }
    }
}

impl OwnedPlan {
    /// `plan`, owned.
    pub fn of(plan: &Plan<'_>) -> OwnedPlan {
        OwnedPlan {
            now: plan.now,
            cost: plan.cost,
            tool: plan.tool.clone(),
            tenant: (plan.tenant.name.clone(), Pick::of(plan.tenant.policy)),
            instance: plan.instance.map(|i| (i.name.clone(), Pick::of(i.policy))),
            untenanted: plan.untenanted,
        }
    }

    /// The plan again.
    pub fn plan(&self) -> Plan<'_> {
        let tool = &self.tool;
        let tenant = match self.tenant.1 {
            Pick::Listed(i) => &tool.tenants[i],
            Pick::Template(slot) => tool.template(slot).expect("a template tenant"),
        };
        let instance = self.instance.as_ref().map(|(name, p)| LevelRef {
            name,
            policy: match *p {
                Pick::Listed(i) => &tenant.children[i],
                Pick::Template(_) => tenant.default_child.as_deref().expect("a template"),
            },
        });
        Plan {
            now: self.now,
            cost: self.cost,
            tool,
            tenant: LevelRef {
                name: &self.tenant.0,
                policy: tenant,
            },
            instance,
            untenanted: self.untenanted,
        }
    }

    /// The same plan at `now`.
    pub fn at(mut self, now: Timestamp) -> OwnedPlan {
        self.now = now;
        self
    }
}

/// Identifies the levels of one admitted call, so the store can find them again to correct
/// the charge or release permits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CallKeys {
    /// Tool name.
    pub tool: Name,
    /// The tool's [group](crate::policy::ToolPolicy::group), when the policy puts it in one
    /// not named after the tool: a store shared by replicas keeps a group's state together.
    pub group: Option<Name>,
    /// Tenant name, or the untenanted caller's id.
    pub tenant: Name,
    /// Instance name, when instances are limited separately.
    pub instance: Option<Name>,
    /// Whether `tenant` is an untenanted caller.
    pub untenanted: bool,
}

impl CallKeys {
    /// The injective store keys of the tool, tenant and instance levels.
    pub fn encoded(&self) -> [Option<String>; 3] {
        use crate::key::{self, KeyKind};
        let tool = key::Tool {
            name: &self.tool,
            group: self.group.as_deref(),
        };
        let caller = match self.untenanted {
            true => KeyKind::Untenanted,
            false => KeyKind::Tenant,
        };
        [
            Some(key::encode(tool, KeyKind::Tool, &[])),
            Some(key::encode(tool, caller, &[&self.tenant])),
            self.instance
                .as_ref()
                .map(|i| key::encode(tool, KeyKind::Instance, &[&self.tenant, i])),
        ]
    }

    /// Whether these are the keys of `tool`'s caller `tenant` (an untenanted caller's id when
    /// `untenanted`) and its `instance`.
    pub fn are(&self, tool: &str, tenant: &str, instance: Option<&str>, untenanted: bool) -> bool {
        self.untenanted == untenanted
            && self.tenant == *tenant
            && match (&self.instance, instance) {
                (Some(a), Some(b)) => *a == *b,
                (a, b) => a.is_none() && b.is_none(),
            }
            && self.tool == *tool
    }

    /// What a store shared by replicas keeps together: the tool's group, or the tool.
    pub fn slot(&self) -> &Name {
        self.group.as_ref().unwrap_or(&self.tool)
    }
}
