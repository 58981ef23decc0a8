//! The policy: which tools exist, and how each tool's capacity is split between tenants and
//! their instances.
//!
//! A policy is loaded from TOML ([`Policy::from_toml_str`], [`Policy::from_path`]), JSON
//! ([`Policy::from_json_str`]) or built in code ([`Policy::builder`]). All three go through one
//! validator, so a [`Policy`] value is always consistent: floors fit their capacity, ceilings
//! sit between floor and capacity, numbers are finite and positive. Errors name the exact
//! field (`tool[0].tenants.team-research.floor`) and say what to change.
//!
//! ```
//! use tower_fairshare::Policy;
//!
//! let policy = Policy::from_toml_str(r#"
//!     [[tool]]
//!     name = "web_search"
//!     unit = "calls"
//!     rate = { limit = 600, per = "1m" }
//!
//!     [tool.tenants.A]
//!     weight = 6
//!     floor = 100
//!
//!     [tool.tenants.B]
//!     weight = 2
//!     floor = 60
//! "#).unwrap();
//! let tool = policy.tool("web_search").unwrap();
//! assert_eq!(tool.capacity(), 600.0);
//! ```

mod allocation;
mod builder;
pub(crate) mod numbers;
mod period;
pub(crate) mod raw;
mod validate;

use crate::key::Name;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use allocation::{Allocation, InstanceAllocation, TenantAllocation, ToolAllocation};
pub use builder::{InstanceBuilder, PolicyBuilder, TenantBuilder, ToolBuilder};
pub use period::{BudgetPeriod, Period};

/// Name → position, read on every decision. A few names are compared in turn (cheaper than
/// hashing the name asked for); more are hashed with a fast seeded hash (the keys come from the
/// policy file, not from callers, so flooding is not a concern).
#[derive(Clone, Debug, Default)]
pub(crate) struct NameIndex {
    few: Vec<(Box<str>, usize)>,
    many: hashbrown::HashTable<(Box<str>, usize)>,
    hasher: foldhash::fast::RandomState,
}

impl NameIndex {
    /// Up to this many names are compared in turn.
    const SCAN: usize = 8;

    /// Sets `name`'s position; the one it replaced, if any.
    pub(crate) fn insert(&mut self, name: String, at: usize) -> Option<usize> {
        if self.many.is_empty() {
            if let Some(e) = self.few.iter_mut().find(|(n, _)| **n == *name) {
                return Some(std::mem::replace(&mut e.1, at));
            }
            if self.few.len() < Self::SCAN {
                self.few.push((name.into_boxed_str(), at));
                return None;
            }
            for (n, i) in std::mem::take(&mut self.few) {
                self.put(n, i);
            }
        }
        self.put(name.into_boxed_str(), at)
    }

    fn put(&mut self, name: Box<str>, at: usize) -> Option<usize> {
        let hasher = &self.hasher;
        let hash = hasher.hash_one(&*name);
        match self
            .many
            .entry(hash, |(n, _)| **n == *name, |(n, _)| hasher.hash_one(&**n))
        {
            hashbrown::hash_table::Entry::Occupied(mut e) => {
                Some(std::mem::replace(&mut e.get_mut().1, at))
            }
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert((name, at));
                None
            }
        }
    }

    /// `name`'s position.
    #[inline]
    pub(crate) fn get(&self, name: &str) -> Option<&usize> {
        if self.many.is_empty() {
            self.few.iter().find(|(n, _)| **n == *name).map(|(_, i)| i)
        } else {
            self.many
                .find(self.hasher.hash_one(name), |(n, _)| **n == *name)
                .map(|(_, i)| i)
        }
    }
}

/// What one unit of cost is for a tool.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Unit {
    /// One call is one unit (the default cost of a request).
    Calls,
    /// Units are tokens (e.g. LLM tokens), usually given per request with a `Cost`.
    Tokens,
    /// Units are seconds of upstream time.
    Seconds,
}

impl Unit {
    /// The name used in files.
    pub const fn as_str(self) -> &'static str {
        match self {
            Unit::Calls => "calls",
            Unit::Tokens => "tokens",
            Unit::Seconds => "seconds",
        }
    }
}

/// What a tool does when its store cannot be reached.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum OnStoreError {
    /// Refuse the call with `store_unavailable` (fail closed). The default.
    #[default]
    Deny,
    /// Let the call through unmetered (fail open), logged and counted.
    Allow,
}

/// What a tool with plans does with a caller whose plan it does not list
/// (`unknown_plan`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum UnknownPlan {
    /// Govern it by `default_tenant` (refused when there is none). The default.
    #[default]
    Default,
    /// Refuse it with `permission_denied` (`unknown_plan`).
    Refuse,
}

/// The most plans one tool may list: a tool keeps a count of the unlisted tenants of each.
pub const MAX_PLANS: usize = 7;

/// A calendar budget: at most `max` units per UTC `period`.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Budget {
    pub(crate) period: BudgetPeriod,
    pub(crate) max: f64,
}

impl Budget {
    /// The calendar window.
    pub fn period(&self) -> BudgetPeriod {
        self.period
    }
    /// The most units the window allows.
    pub fn max(&self) -> f64 {
        self.max
    }
}

/// A validated policy: every tool and how its capacity is shared.
#[derive(Clone, Debug)]
pub struct Policy {
    pub(crate) tools: Vec<Arc<ToolPolicy>>,
    pub(crate) by_name: NameIndex,
    pub(crate) warnings: Vec<Warning>,
    /// Which of a limiter's policies this is (set by the limiter that puts it in force): a
    /// lease is spent without reading the policy while the limiter's version is its own.
    pub(crate) version: u64,
}

/// One tool's limits, validated.
#[derive(Clone, Debug)]
pub struct ToolPolicy {
    pub(crate) name: Arc<str>,
    /// The tool's name and its group (when the policy puts it in one not named after the
    /// tool) as a call's keys hold them, made once.
    pub(crate) key: (Name, Option<Name>),
    pub(crate) unit: Unit,
    pub(crate) capacity: f64,
    pub(crate) period: Period,
    /// The period as a refusal names its window (`1m`), made once.
    pub(crate) period_label: Arc<str>,
    pub(crate) burst: f64,
    pub(crate) tiers: Vec<String>,
    pub(crate) require_tenant: bool,
    pub(crate) max_concurrency: Option<u32>,
    pub(crate) budgets: Vec<Budget>,
    pub(crate) enforce: bool,
    pub(crate) on_store_error: OnStoreError,
    /// The largest lease a process may hold for one caller, in units (≤ 1: no leases).
    pub(crate) lease_max: f64,
    pub(crate) tenants: Vec<LevelPolicy>,
    pub(crate) tenant_index: NameIndex,
    pub(crate) default_tenant: Option<LevelPolicy>,
    /// Templates for unlisted tenants by plan, in file order (a plan's `slot` is its place
    /// here plus one: slot 0 is `default_tenant`).
    pub(crate) plans: Vec<(Arc<str>, LevelPolicy)>,
    pub(crate) unknown_plan: UnknownPlan,
    /// Σ of the tenants' reserved floors (templates counted `max_tenants` times).
    pub(crate) reserved_floors: f64,
    pub(crate) configured_weight: f64,
    /// Σ of the configured tenants' bursts (their share banks).
    pub(crate) configured_tenant_burst: f64,
    /// See [`ToolPolicy::fingerprint`].
    pub(crate) fingerprint: u64,
}

/// A tenant or an instance, validated: its floor, weight, ceiling, burst, caps and, for a
/// tenant, its instances.
#[derive(Clone, Debug)]
pub struct LevelPolicy {
    pub(crate) name: Arc<str>,
    pub(crate) template: bool,
    /// Where the policy lists it among its siblings (templates: `usize::MAX`): the metrics
    /// label only the first few of a tool's tenants by name.
    pub(crate) position: usize,
    pub(crate) weight: f64,
    pub(crate) floor: f64,
    /// The floor this level holds back at its parent: its own floor, or its children's floors
    /// when those add up to more.
    pub(crate) reserved_floor: f64,
    /// Σ of the children's floors (templates counted `max_instances` times).
    pub(crate) children_floor: f64,
    pub(crate) ceiling: Option<f64>,
    pub(crate) burst: f64,
    /// Whether `burst` was written in the policy (otherwise it is a portion of the parent's).
    pub(crate) explicit_burst: bool,
    /// Σ of the configured children's bursts (their share banks).
    pub(crate) configured_child_burst: f64,
    /// Where, between half-full and full, the parent's pool must be before this level may
    /// borrow: higher weights borrow first.
    pub(crate) borrow_threshold: f64,
    pub(crate) max_concurrency: Option<u32>,
    pub(crate) budgets: Vec<Budget>,
    /// For a template: how many distinct callers may count at once.
    pub(crate) max_tracked: u64,
    /// For a tenant template: which of the tool's counts of unlisted tenants it is counted
    /// in (0: `default_tenant`; a plan's place among the plans plus one).
    pub(crate) slot: usize,
    pub(crate) children: Vec<LevelPolicy>,
    pub(crate) child_index: NameIndex,
    pub(crate) default_child: Option<Box<LevelPolicy>>,
    pub(crate) configured_child_weight: f64,
    pub(crate) max_child_weight: f64,
}

impl Policy {
    /// Parses and validates a TOML policy.
    pub fn from_toml_str(text: &str) -> Result<Policy, PolicyError> {
        let de = toml::Deserializer::parse(text).map_err(|e| PolicyError::Syntax {
            path: String::new(),
            message: toml_syntax_message(text, &e),
        })?;
        let raw: raw::RawPolicy =
            serde_path_to_error::deserialize(de).map_err(|e| PolicyError::Syntax {
                path: tidy_path(&e.path().to_string()),
                message: plain_words(e.inner().message().trim()),
            })?;
        validate::policy(raw)
    }

    /// Parses and validates a JSON policy (the same structure as TOML).
    pub fn from_json_str(text: &str) -> Result<Policy, PolicyError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let raw: raw::RawPolicy =
            serde_path_to_error::deserialize(&mut de).map_err(|e| PolicyError::Syntax {
                path: tidy_path(&e.path().to_string()),
                message: plain_words(&e.inner().to_string()),
            })?;
        validate::policy(raw)
    }

    /// Reads a policy file: JSON when the name ends in `.json`, TOML otherwise.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Policy, PolicyError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Io {
            path: path.to_owned(),
            source,
        })?;
        if path.extension().is_some_and(|e| e == "json") {
            Policy::from_json_str(&text).map_err(|e| match e {
                PolicyError::Syntax { path, message } => PolicyError::Syntax {
                    path,
                    message: format!("{message} (read as JSON: the file's name ends in .json)"),
                },
                e => e,
            })
        } else {
            Policy::from_toml_str(&text)
        }
    }

    /// Starts a policy in code. See [`PolicyBuilder`].
    pub fn builder() -> PolicyBuilder {
        PolicyBuilder::default()
    }

    /// The tool named `name`.
    pub fn tool(&self, name: &str) -> Option<&Arc<ToolPolicy>> {
        self.by_name.get(name).map(|&i| &self.tools[i])
    }

    /// Every tool, in file order.
    pub fn tools(&self) -> impl Iterator<Item = &Arc<ToolPolicy>> {
        self.tools.iter()
    }

    /// Things that are allowed but probably unwise (floors above 70 % of capacity, budgets
    /// split with almost nothing left over).
    pub fn warnings(&self) -> &[Warning] {
        &self.warnings
    }

    /// The allocation table: per tool, each tenant's and instance's floor, weight, share,
    /// ceiling, burst and budgets (templates counted once, as for one active caller).
    pub fn allocation(&self) -> Allocation {
        allocation::compute(self)
    }
}

impl ToolPolicy {
    /// The tool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn name_arc(&self) -> &Arc<str> {
        &self.name
    }

    /// The tool's group (`group = "..."`; its own name when it has none). Tools that one call
    /// is charged to together ([`Limiter::admit_all`](crate::Limiter::admit_all)) must share
    /// a group: a store shared by replicas keeps a group's state together (on Redis Cluster,
    /// in one slot) so that such a call is decided atomically.
    pub fn group(&self) -> &str {
        self.key.1.as_deref().unwrap_or(&self.name)
    }

    /// The tool's name as a call's keys hold it.
    pub(crate) fn key_name(&self) -> &Name {
        &self.key.0
    }

    /// The group a store keys the tool's state under: `None` for a tool alone (or in a
    /// group of its own name).
    pub(crate) fn key_group(&self) -> Option<&Name> {
        self.key.1.as_ref()
    }
    /// What a unit of cost is.
    pub fn unit(&self) -> Unit {
        self.unit
    }
    /// Capacity C: units per [`period`](Self::period), shared by every caller.
    pub fn capacity(&self) -> f64 {
        self.capacity
    }
    /// The period P the capacity, floors and ceilings are expressed per.
    pub fn period(&self) -> Period {
        self.period
    }
    /// The most the tool spends at one instant above the floors.
    pub fn burst(&self) -> f64 {
        self.burst
    }
    /// Tiers allowed to call the tool (empty: any caller).
    pub fn tiers(&self) -> &[String] {
        &self.tiers
    }
    /// Whether a caller without a tenant is refused.
    pub fn require_tenant(&self) -> bool {
        self.require_tenant
    }
    /// Cap on calls in flight for the whole tool.
    pub fn max_concurrency(&self) -> Option<u32> {
        self.max_concurrency
    }
    /// The tool's aggregate calendar budgets.
    pub fn budgets(&self) -> &[Budget] {
        &self.budgets
    }
    /// Whether refusals are enforced (`false`: shadow mode, decide and record only).
    pub fn enforce(&self) -> bool {
        self.enforce
    }
    /// What happens when the store is unreachable.
    pub fn on_store_error(&self) -> OnStoreError {
        self.on_store_error
    }
    /// The largest lease one caller's path may hold in a process, in units: infinite for
    /// `lease = "auto"` (the default: only the adaptive grant bounds it), `N` for
    /// `lease = { max = N }`; `None` when every call is decided at the store
    /// (`lease = "off"`).
    pub fn lease_max(&self) -> Option<f64> {
        (self.lease_max > 1.0).then_some(self.lease_max)
    }
    /// A fingerprint of this tool's policy as written: replicas that enforce the same
    /// policy for the tool have the same one. Replicas sharing a Redis store publish theirs
    /// and report a difference (see [`Store::policy_disagreements`](crate::Store::policy_disagreements)).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    /// The configured tenants, in file order.
    pub fn tenants(&self) -> &[LevelPolicy] {
        &self.tenants
    }
    /// The template for unlisted tenants, if any.
    pub fn default_tenant(&self) -> Option<&LevelPolicy> {
        self.default_tenant.as_ref()
    }
    /// The policy that applies to `tenant` when its caller carries no plan: its own entry,
    /// or the template.
    pub fn tenant(&self, tenant: &str) -> Option<&LevelPolicy> {
        self.tenant_on(tenant, None).ok()
    }
    /// The policy that applies to `tenant` whose caller carries `plan`: its own entry, the
    /// plan's template, or `default_tenant` (for a caller without a plan, and for one whose
    /// plan is not listed unless `unknown_plan = "refuse"`). Otherwise why not: what a
    /// refusal names (`unlisted_tenant`, `unknown_plan`).
    pub fn tenant_on(
        &self,
        tenant: &str,
        plan: Option<&str>,
    ) -> Result<&LevelPolicy, &'static str> {
        if let Some(&i) = self.tenant_index.get(tenant) {
            return Ok(&self.tenants[i]);
        }
        match plan {
            Some(p) if !self.plans.is_empty() => match self.plans.iter().find(|(n, _)| &**n == p) {
                Some((_, t)) => return Ok(t),
                None if self.unknown_plan == UnknownPlan::Refuse => return Err("unknown_plan"),
                None => {}
            },
            _ => {}
        }
        self.default_tenant.as_ref().ok_or("unlisted_tenant")
    }
    /// The plans for unlisted tenants (`[tool.plans.<name>]`), in file order.
    pub fn plans(&self) -> impl Iterator<Item = (&str, &LevelPolicy)> {
        self.plans.iter().map(|(n, t)| (&**n, t))
    }
    /// The tenant template counted in `slot` (see [`LevelPolicy`]'s slot): `default_tenant`
    /// for 0, a plan's otherwise.
    pub(crate) fn template(&self, slot: usize) -> Option<&LevelPolicy> {
        match slot {
            0 => self.default_tenant.as_ref(),
            s => self.plans.get(s - 1).map(|(_, t)| t),
        }
    }
    /// Whether the caller's tier may call this tool.
    pub fn allows_tier(&self, tier: Option<&str>) -> bool {
        self.tiers.is_empty() || tier.is_some_and(|t| self.tiers.iter().any(|x| x == t))
    }
    /// The shared capacity above all floors: C − Σ reserved floors.
    pub fn spare(&self) -> f64 {
        (self.capacity - self.reserved_floors).max(0.0)
    }
}

impl LevelPolicy {
    /// The name (`*` for a template).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Whether this is a template (`default_tenant` / `default_instance`).
    pub fn is_template(&self) -> bool {
        self.template
    }
    /// Weight for the share of spare capacity.
    pub fn weight(&self) -> f64 {
        self.weight
    }
    /// Guaranteed units per period, as written.
    pub fn floor(&self) -> f64 {
        self.floor
    }
    /// The floor held back for this level at its parent (≥ [`floor`](Self::floor) when its
    /// instances' floors add up to more).
    pub fn reserved_floor(&self) -> f64 {
        self.reserved_floor
    }
    /// Explicit ceiling, if set (otherwise floor + share).
    pub fn ceiling(&self) -> Option<f64> {
        self.ceiling
    }
    /// The most taken at one instant above the floor.
    pub fn burst(&self) -> f64 {
        self.burst
    }
    /// Cap on calls in flight.
    pub fn max_concurrency(&self) -> Option<u32> {
        self.max_concurrency
    }
    /// Calendar budgets.
    pub fn budgets(&self) -> &[Budget] {
        &self.budgets
    }
    /// For a template: distinct callers counted at once (`max_tenants` / `max_instances`).
    pub fn max_tracked(&self) -> u64 {
        self.max_tracked
    }
    /// Configured instances (for a tenant).
    pub fn instances(&self) -> &[LevelPolicy] {
        &self.children
    }
    /// The template for unlisted instances.
    pub fn default_instance(&self) -> Option<&LevelPolicy> {
        self.default_child.as_deref()
    }
    /// Whether instances of this tenant are limited separately.
    pub fn has_instances(&self) -> bool {
        !self.children.is_empty() || self.default_child.is_some()
    }
    /// The policy that applies to `instance`, if instances are limited separately.
    pub fn instance(&self, instance: &str) -> Option<&LevelPolicy> {
        match self.child_index.get(instance) {
            Some(&i) => Some(&self.children[i]),
            None => self.default_child.as_deref(),
        }
    }
}

/// A policy that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The file could not be read.
    #[error("cannot read policy file `{path}`: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The text is not a policy: bad syntax, an unknown or missing field, a wrong type.
    #[error("{}{message}", if path.is_empty() { String::new() } else { format!("{path}: ") })]
    Syntax {
        /// Where (`tool[0].tenants.A.flor`), empty when the syntax itself is broken.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// The policy parses but breaks a rule; every violation found is listed.
    #[error("{}", Violations(.0))]
    Invalid(Vec<Violation>),
}

impl PolicyError {
    /// Every (path, message) pair, one per problem.
    pub fn problems(&self) -> Vec<(String, String)> {
        match self {
            PolicyError::Invalid(v) => v
                .iter()
                .map(|v| (v.path.clone(), v.problem.to_string()))
                .collect(),
            PolicyError::Syntax { path, message } => vec![(path.clone(), message.clone())],
            PolicyError::Io { path, source } => {
                vec![(path.display().to_string(), source.to_string())]
            }
        }
    }
}

struct Violations<'a>(&'a [Violation]);

impl fmt::Display for Violations<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, v) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{v}")?;
        }
        Ok(())
    }
}

/// One broken rule, at one place in the policy.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Violation {
    /// The field, e.g. `tool[0].tenants.team-research.floor`.
    pub path: String,
    /// What is wrong.
    pub problem: Problem,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.problem)
    }
}

/// A number as a person reads it: as written when it is moderate, in exponent form when it is
/// huge or tiny (so `1e308` does not print as 309 digits).
struct Num(f64);

impl fmt::Display for Num {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let x = self.0;
        if x != 0.0 && x.is_finite() && !(1e-6..1e16).contains(&x.abs()) {
            write!(f, "{x:e}")
        } else {
            write!(f, "{x}")
        }
    }
}

/// What is wrong with a policy field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// A tool's `lease` is a word other than `"auto"` or `"off"`.
    #[error("`lease = \"{0}\"` is not a setting: leave it out (or write `lease = \"auto\"`) for leases sized by themselves, `lease = \"off\"` to decide every call at the store, or `lease = {{ max = 64 }}` to cap what one caller's path may hold in a process")]
    BadLease(String),
    /// A number that must be above zero is not.
    #[error("must be a positive, finite number, not {}", Num(*.0))]
    NotPositive(f64),
    /// A number that may be zero is negative or not finite.
    #[error("must be zero or a positive, finite number, not {}", Num(*.0))]
    Negative(f64),
    /// A count is not a whole number ≥ 1.
    #[error("must be a whole number of at least 1, not {}", Num(*.0))]
    NotCount(f64),
    /// A period does not parse.
    #[error("{0}")]
    BadPeriod(String),
    /// A name is used twice.
    #[error("duplicate name `{0}`: each tool name may appear once")]
    Duplicate(String),
    /// A tool's group bears the name of a tool outside it.
    #[error("the group has the name of the tool `{0}`, which is not in it: rename the group, or put `{0}` in it too")]
    GroupNamesATool(String),
    /// A name is empty, or only whitespace.
    #[error("a name must not be empty or blank: give it a name callers can use")]
    EmptyName,
    /// The policy has no tool: every call would be refused.
    #[error("the policy lists no tool, so every call would be refused: add a `[[tool]]` (an empty or truncated file is never put in force)")]
    NoTools,
    /// A number above what any quota needs (and what stays exact in the arithmetic).
    #[error("{} is more than the largest allowed, {}: use a smaller unit or a shorter period", Num(*.value), Num(*.max))]
    TooLarge {
        /// What was written.
        value: f64,
        /// The largest allowed.
        max: f64,
    },
    /// A weight outside the range the shares are computed in.
    #[error("weight {} is out of range: weights are relative, use numbers between 0.000001 and 1000000", Num(*.0))]
    WeightOutOfRange(f64),
    /// A tool's capacity below one unit per period: no call of one unit could ever pass.
    #[error("{} per {per} is less than one unit per period, so no call could ever be admitted: raise the limit to at least 1 or lengthen the period", Num(*.limit))]
    BelowOneUnit {
        /// The limit written.
        limit: f64,
        /// The period written.
        per: String,
    },
    /// A burst below one unit: no call of one unit could draw from the bucket.
    #[error("burst {} is less than one unit, so no call above the floor could pass: use at least 1 (or leave it unset)", Num(*.0))]
    BurstBelowOne(f64),
    /// A tool's period longer than a year.
    #[error("`{0}` is longer than a year: rates are per period of at most 366 days; use a budget (hour, day, month) for calendar limits")]
    PeriodTooLong(String),
    /// Floors add up to more than the capacity they are carved from.
    #[error("floors add up to {}, more than the {} available: lower the floors or raise the capacity", Num(*.sum), Num(*.capacity))]
    FloorsExceedCapacity {
        /// Σ floors (templates counted at their maximum number).
        sum: f64,
        /// The capacity (the tool's rate, or the tenant's floor + share).
        capacity: f64,
    },
    /// A ceiling below its floor.
    #[error(
        "ceiling {} is below the floor {}: raise the ceiling to at least the floor",
        Num(*.ceiling),
        Num(*.floor)
    )]
    CeilingBelowFloor {
        /// The ceiling.
        ceiling: f64,
        /// The floor.
        floor: f64,
    },
    /// A ceiling above what the level above can ever give.
    #[error("ceiling {} is above the {} the level above can give: lower it to at most {}", Num(*.ceiling), Num(*.capacity), Num(*.capacity))]
    CeilingAboveCapacity {
        /// The ceiling.
        ceiling: f64,
        /// The parent's capacity.
        capacity: f64,
    },
    /// A template with a floor but no bound on how many callers it applies to.
    #[error("a template with a floor needs `{0}` so the floors can be checked against capacity")]
    TemplateFloorNeedsMax(&'static str),
    /// A field in a place where it has no meaning.
    #[error("`{field}` is only valid in `{place}`")]
    Misplaced {
        /// The field.
        field: &'static str,
        /// Where it belongs.
        place: &'static str,
    },
    /// `tier` and `tiers` both set.
    #[error("set `tier` or `tiers`, not both")]
    TierAndTiers,
    /// The same budget period twice at one level.
    #[error("budget period `{0}` appears twice: keep one")]
    DuplicateBudget(BudgetPeriod),
    /// Untenanted callers allowed but nothing says how to limit them.
    #[error("`require_tenant = false` needs a `[tool.default_tenant]` to say how callers without a tenant are limited")]
    UntenantedNeedsTemplate,
    /// More plans than a tool keeps counts for.
    #[error("{0} plans: a tool may list at most 7 (merge plans that share the same numbers)")]
    TooManyPlans(usize),
}

/// Something allowed but probably unwise, with where it is.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Warning {
    /// The field or level.
    pub path: String,
    /// What to consider.
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The TOML parser's message, with a location when it gave none (it gives none when a dotted
/// key nests too deep): the line of the most deeply dotted key.
fn toml_syntax_message(text: &str, e: &toml::de::Error) -> String {
    let message = e.to_string().trim().to_owned();
    if e.span().is_some() {
        return message;
    }
    match deepest_dotted_key(text) {
        Some((line, parts)) if parts > 8 => format!(
            "line {line}: a key of {parts} dotted parts ({message}): a policy nests at most 8 levels deep"
        ),
        _ => format!("{message} (the TOML parser gave no line)"),
    }
}

/// The line (1-based) of the key with the most dotted parts, and how many it has: in a table
/// header, or before `=`. Quoted parts are skipped whole.
fn deepest_dotted_key(text: &str) -> Option<(usize, usize)> {
    let mut deepest: Option<(usize, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_start();
        let key = match line.strip_prefix('[') {
            Some(rest) => rest.trim_start_matches('['),
            None => line,
        };
        let mut parts = 1;
        let mut quote: Option<char> = None;
        for c in key.chars() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '"' | '\'') => quote = Some(c),
                (None, '.') => parts += 1,
                (None, '=' | ']' | '#') => break,
                _ => {}
            }
        }
        if deepest.is_none_or(|(_, d)| parts > d) {
            deepest = Some((i + 1, parts));
        }
    }
    deepest
}

/// A parser's message in the words of a file's author: serde names Rust's types
/// (`expected f64`, `integer … as i128`), which this says as a number or a whole number.
/// The policy's own errors are worded so; a program that reads its own TOML files beside a
/// policy can word its errors the same way.
///
/// ```
/// use tower_fairshare::policy::plain_words;
/// assert_eq!(
///     plain_words("invalid type: string \"10\", expected f64"),
///     "invalid type: string \"10\", expected a number"
/// );
/// ```
pub fn plain_words(message: &str) -> String {
    let mut out = message.replace(" as i128", "");
    for (rust, words) in [
        ("expected f64", "expected a number"),
        ("expected u64", "expected a whole number"),
        ("expected u32", "expected a whole number"),
        ("expected usize", "expected a whole number"),
    ] {
        out = out.replace(rust, words);
    }
    out
}

/// serde_path_to_error prints `tool[0].tenants.A`; keep it, but drop a leading `.`.
fn tidy_path(p: &str) -> String {
    if p == "." {
        String::new()
    } else {
        p.trim_start_matches('.').to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::NameIndex;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// Scanned (a few names) or hashed (more), the index answers as a map would: the last
        /// position set for a name, nothing for a name never set.
        #[test]
        fn a_name_index_answers_as_a_map(
            sets in proptest::collection::vec(("[a-d]{0,3}", 0usize..100), 0..40),
            asks in proptest::collection::vec("[a-d]{0,3}", 0..20),
        ) {
            let (mut index, mut map) = (NameIndex::default(), HashMap::new());
            for (name, at) in sets {
                prop_assert_eq!(index.insert(name.clone(), at), map.insert(name, at));
            }
            for name in map.keys().chain(asks.iter()) {
                prop_assert_eq!(index.get(name), map.get(name));
            }
        }
    }
}
