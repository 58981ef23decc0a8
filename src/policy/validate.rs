//! Raw policy → validated [`Policy`]. Every problem found is reported, each with its path.

use crate::key::Name;
use std::sync::Arc;

use super::raw::{DefaultCeiling, RawBudget, RawLease, RawLevel, RawPolicy, RawTool};
use super::{
    Budget, BudgetPeriod, LevelPolicy, Period, Policy, PolicyError, Problem, ToolPolicy, Violation,
    Warning,
};

/// Template callers counted at once when the policy does not say: enough for real fleets, small
/// enough that an identity flood cannot grow memory without bound.
pub(crate) const DEFAULT_MAX_TENANTS: u64 = 10_000;
/// See [`DEFAULT_MAX_TENANTS`].
pub(crate) const DEFAULT_MAX_INSTANCES: u64 = 1_000;

/// The most units a limit, floor, ceiling, burst or budget may be: far above any real quota,
/// and small enough that every sum the engine forms stays exact in `f64` and prints as written.
pub(crate) const MAX_UNITS: f64 = 1e15;
/// Weights are relative: this range keeps every share finite and meaningful.
const WEIGHTS: std::ops::RangeInclusive<f64> = 1e-6..=1e6;
/// The longest period a rate may be given per (budgets cover calendar months).
const MAX_PERIOD_MICROS: u64 = 366 * 86_400_000_000;

struct Ctx {
    violations: Vec<Violation>,
    warnings: Vec<Warning>,
}

impl Ctx {
    fn err(&mut self, path: impl Into<String>, problem: Problem) {
        self.violations.push(Violation {
            path: path.into(),
            problem,
        });
    }

    fn positive(&mut self, path: &str, x: f64) -> f64 {
        if x.is_finite() && x > 0.0 {
            x
        } else {
            self.err(path, Problem::NotPositive(x));
            1.0
        }
    }

    fn non_negative(&mut self, path: &str, x: f64) -> f64 {
        if x.is_finite() && x >= 0.0 {
            x
        } else {
            self.err(path, Problem::Negative(x));
            0.0
        }
    }

    /// A positive number of units, at most [`MAX_UNITS`].
    fn units(&mut self, path: &str, x: f64) -> f64 {
        let x = self.positive(path, x);
        self.at_most(path, x)
    }

    fn at_most(&mut self, path: &str, x: f64) -> f64 {
        if x > MAX_UNITS {
            self.err(
                path,
                Problem::TooLarge {
                    value: x,
                    max: MAX_UNITS,
                },
            );
            return MAX_UNITS;
        }
        x
    }

    /// A burst: units, at least one.
    fn burst(&mut self, path: &str, x: f64) -> f64 {
        let x = self.units(path, x);
        if x < 1.0 {
            self.err(path, Problem::BurstBelowOne(x));
            return 1.0;
        }
        x
    }

    fn name(&mut self, path: impl Into<String>, name: &str) {
        if name.trim().is_empty() {
            self.err(path, Problem::EmptyName);
        }
    }

    fn count(&mut self, path: &str, x: f64) -> u64 {
        if x.is_finite() && x >= 1.0 && x.fract() == 0.0 && x <= u32::MAX as f64 {
            x as u64
        } else {
            self.err(path, Problem::NotCount(x));
            1
        }
    }

    fn budgets(&mut self, path: &str, raw: &[RawBudget]) -> Vec<Budget> {
        let mut out: Vec<Budget> = Vec::new();
        for (i, b) in raw.iter().enumerate() {
            let p = format!("{path}.budgets[{i}]");
            let max = self.units(&format!("{p}.max"), b.max);
            if out.iter().any(|o| o.period == b.period) {
                self.err(format!("{p}.period"), Problem::DuplicateBudget(b.period));
                continue;
            }
            out.push(Budget {
                period: b.period,
                max,
            });
        }
        out
    }
}

pub(crate) fn policy(raw: RawPolicy) -> Result<Policy, PolicyError> {
    let mut cx = Ctx {
        violations: Vec::new(),
        warnings: Vec::new(),
    };
    let mut tools = Vec::new();
    let mut by_name = super::NameIndex::default();
    if raw.tool.is_empty() {
        cx.err("tool", Problem::NoTools);
    }
    for (i, t) in raw.tool.into_iter().enumerate() {
        let path = format!("tool[{i}]");
        let tp = tool(&mut cx, t, &path);
        if by_name.insert(tp.name.to_string(), i).is_some() {
            cx.err(
                format!("{path}.name"),
                Problem::Duplicate(tp.name.to_string()),
            );
        }
        tools.push(Arc::new(tp));
    }
    groups_apart_from_tools(&mut cx, &tools);
    if cx.violations.is_empty() {
        Ok(Policy {
            tools,
            by_name,
            warnings: cx.warnings,
            version: 0,
        })
    } else {
        Err(PolicyError::Invalid(cx.violations))
    }
}

/// A group may not bear the name of a tool outside it: a store keeps a group's state under
/// its name, as it keeps an ungrouped tool's under the tool's.
fn groups_apart_from_tools(cx: &mut Ctx, tools: &[Arc<ToolPolicy>]) {
    for (i, t) in tools.iter().enumerate() {
        if t.group() == t.name() {
            continue;
        }
        if let Some(other) = tools
            .iter()
            .find(|o| o.name() == t.group() && o.group() != t.group())
        {
            cx.err(
                format!("tool[{i}].group"),
                Problem::GroupNamesATool(other.name.to_string()),
            );
        }
    }
}

fn tool(cx: &mut Ctx, raw: RawTool, path: &str) -> ToolPolicy {
    let mut tp = tool_alone(cx, &raw, path);
    // First pass: each tenant's own numbers.
    for (name, t) in &raw.tenants.0 {
        let tpath = format!("{path}.tenants.{name}");
        cx.name(&tpath, name);
        tp.tenant_index.insert(name.clone(), tp.tenants.len());
        let mut level = tenant(cx, name, t, &tpath, tp.burst, false);
        level.position = tp.tenants.len();
        tp.tenants.push(level);
    }
    let default_path = format!("{path}.default_tenant");
    tp.default_tenant = raw
        .default_tenant
        .as_ref()
        .map(|t| tenant(cx, "*", t, &default_path, tp.burst, true));
    tp.plans = plans_of(cx, &raw.plans, raw.unknown_plan, path, tp.burst);
    if tp.tenants.is_empty() && tp.default_tenant.is_none() && tp.plans.is_empty() {
        cx.warnings.push(Warning {
            path: path.to_owned(),
            message: "admits no caller: it lists no tenant and has no `default_tenant` or plan, so every call is refused; add `[tool.default_tenant]` or list the tenants".into(),
        });
    }
    let open = raw.default_ceiling == Some(DefaultCeiling::Capacity);
    share_out(cx, &mut tp, path, open);
    tp.burst = tool_burst(cx, path, tp.burst, raw.burst.is_some(), banks(&tp));
    floor_within_budgets(cx, path, tp.reserved_floors, tp.period, &tp.budgets);
    budgets_split(cx, path, &tp.budgets, &tp.tenants);
    tp
}

/// The tool's own numbers, before its callers: name, group, capacity, period, burst, tiers,
/// caps, budgets, leases.
fn tool_alone(cx: &mut Ctx, raw: &RawTool, path: &str) -> ToolPolicy {
    cx.name(format!("{path}.name"), &raw.name);
    if let Some(g) = &raw.group {
        cx.name(format!("{path}.group"), g);
    }
    let limit_path = format!("{path}.rate.limit");
    let capacity = cx.units(&limit_path, raw.rate.limit);
    let period = period_of(cx, &raw.rate.per, path);
    if capacity < 1.0 {
        let per = raw.rate.per.clone();
        cx.err(
            &limit_path,
            Problem::BelowOneUnit {
                limit: capacity,
                per,
            },
        );
    }
    let require_tenant = raw.require_tenant.unwrap_or(true);
    if !require_tenant && raw.default_tenant.is_none() {
        let p = format!("{path}.require_tenant");
        cx.err(p, Problem::UntenantedNeedsTemplate);
    }
    let concurrency_path = format!("{path}.max_concurrency");
    let group = raw.group.as_deref().filter(|g| *g != raw.name);
    ToolPolicy {
        name: Arc::from(raw.name.as_str()),
        key: (Name::from(raw.name.as_str()), group.map(Name::from)),
        unit: raw.unit,
        capacity,
        period,
        period_label: Arc::from(period.label()),
        burst: match raw.burst {
            Some(b) => cx.burst(&format!("{path}.burst"), b),
            None => default_burst(capacity),
        },
        tiers: tiers_of(cx, raw.tier.clone(), raw.tiers.clone(), path),
        require_tenant,
        max_concurrency: raw
            .max_concurrency
            .map(|m| cx.count(&concurrency_path, m) as u32),
        budgets: cx.budgets(path, &raw.budgets),
        enforce: raw.enforce.unwrap_or(true),
        on_store_error: raw.on_store_error.unwrap_or_default(),
        lease_max: lease_of(cx, raw.lease.as_ref(), path),
        tenants: Vec::new(),
        tenant_index: super::NameIndex::default(),
        default_tenant: None,
        plans: Vec::new(),
        unknown_plan: raw.unknown_plan.unwrap_or_default(),
        reserved_floors: 0.0,
        configured_weight: 0.0,
        configured_tenant_burst: 0.0,
        fingerprint: fingerprint(raw),
    }
}

/// The tool's callers' floors checked against its capacity, and the spare shared out: each
/// caller's share, ceiling and instances (a caller without a ceiling of its own gets its
/// nominal allocation, or with `open` — `default_ceiling = "capacity"` — everything not
/// reserved for others).
fn share_out(cx: &mut Ctx, tp: &mut ToolPolicy, path: &str, open: bool) {
    let configured_floor: f64 = tp.tenants.iter().map(|t| t.reserved_floor).sum();
    let template_floor: f64 = templates(tp)
        .map(|t| t.reserved_floor * t.max_tracked as f64)
        .sum();
    tp.reserved_floors = configured_floor + template_floor;
    check_reserved_floors(cx, path, tp.reserved_floors, tp.capacity);
    tp.configured_weight = tp.tenants.iter().map(|t| t.weight).sum();
    let template_weight: f64 = templates(tp).map(|t| t.weight).sum();
    let max_weight = tp
        .tenants
        .iter()
        .chain(templates(tp))
        .map(|t| t.weight)
        .fold(0.0, f64::max);
    let shares = Shares {
        max_weight,
        burst: tp.burst,
        weight_once: tp.configured_weight + template_weight,
        period: tp.period,
        spare: (tp.capacity - tp.reserved_floors).max(0.0),
        capacity: tp.capacity,
        open,
    };
    for t in tp.tenants.iter_mut() {
        let tpath = format!("{path}.tenants.{}", t.name);
        finish_tenant(cx, t, &tpath, &shares);
    }
    if let Some(t) = tp.default_tenant.as_mut() {
        finish_tenant(cx, t, &format!("{path}.default_tenant"), &shares);
    }
    for (name, t) in tp.plans.iter_mut() {
        finish_tenant(cx, t, &format!("{path}.plans.{name}"), &shares);
    }
    tp.configured_tenant_burst = tp.tenants.iter().map(|t| t.burst).sum();
}

/// Every caller's share bank at the tool: the listed tenants' bursts and each template's.
fn banks(tp: &ToolPolicy) -> f64 {
    tp.configured_tenant_burst + templates(tp).map(|t| t.burst).sum::<f64>()
}

/// The tool's templates: `default_tenant`, then each plan's.
fn templates(tp: &ToolPolicy) -> impl Iterator<Item = &LevelPolicy> {
    tp.default_tenant
        .iter()
        .chain(tp.plans.iter().map(|(_, t)| t))
}

/// A tool's fingerprint: 64-bit FNV-1a of its policy as written, serialized as JSON (numbers
/// as read, so `600` and `600.0` are alike). The same on every replica and every version of
/// the crate that writes the policy the same way.
fn fingerprint(raw: &RawTool) -> u64 {
    let bytes = serde_json::to_vec(raw).expect("a policy serializes");
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The templates of a tool's plans (`[tool.plans.<name>]`), each in its slot; at most
/// [`MAX_PLANS`](super::MAX_PLANS) of them.
fn plans_of(
    cx: &mut Ctx,
    raw: &super::raw::UniqueMap<RawLevel>,
    unknown: Option<super::UnknownPlan>,
    path: &str,
    burst: f64,
) -> Vec<(Arc<str>, LevelPolicy)> {
    if raw.0.len() > super::MAX_PLANS {
        cx.err(format!("{path}.plans"), Problem::TooManyPlans(raw.0.len()));
    }
    let mut plans = Vec::new();
    for (name, t) in raw.0.iter().take(super::MAX_PLANS) {
        let ppath = format!("{path}.plans.{name}");
        cx.name(&ppath, name);
        let mut level = tenant(cx, "*", t, &ppath, burst, true);
        level.slot = plans.len() + 1;
        plans.push((Arc::from(name.as_str()), level));
    }
    if unknown == Some(super::UnknownPlan::Refuse) && plans.is_empty() {
        cx.err(
            format!("{path}.unknown_plan"),
            Problem::Misplaced {
                field: "unknown_plan",
                place: "a tool with `[tool.plans.<name>]`",
            },
        );
    }
    plans
}

/// Warns when a budget is smaller than what the floor guarantees over its window (the
/// shortest month for a monthly one): once it is spent, calls within the floor are refused.
fn floor_within_budgets(cx: &mut Ctx, path: &str, floor: f64, period: Period, budgets: &[Budget]) {
    if floor <= 0.0 {
        return;
    }
    for (i, b) in budgets.iter().enumerate() {
        let window_hours = match b.period {
            BudgetPeriod::Hour => 1.0,
            BudgetPeriod::Day => 24.0,
            BudgetPeriod::Month => 28.0 * 24.0,
        };
        let owed = floor * window_hours * 3_600_000_000.0 / period.as_micros() as f64;
        if b.max < owed * (1.0 - 1e-12) {
            cx.warnings.push(Warning {
                path: format!("{path}.budgets[{i}].max"),
                message: format!(
                    "budget {} per {} is below what the floor guarantees ({floor} per {period} is {} per {}): once the budget is spent, calls within the floor are refused too; raise the budget or lower the floor",
                    b.max,
                    b.period.as_str(),
                    (owed * 10.0).round() / 10.0,
                    b.period.as_str()
                ),
            });
        }
    }
}

/// The lending room of a tool without an explicit burst: one second's worth of a per-minute
/// rate (1/60 of the capacity), at least two units. Small: a big bucket is a giant burst waiting to happen; the tool's
/// burst is this plus its tenants' bursts.
pub(crate) fn default_burst(capacity: f64) -> f64 {
    (capacity / 60.0).max(2.0)
}

/// A caller's default burst: its weighted portion of its parent's lending room, at least two
/// units (a bank of one loses whatever accrues between two arrivals).
pub(crate) fn portion_of_burst(parent_burst: f64, weight: f64, total_weight: f64) -> f64 {
    if total_weight > 0.0 {
        (parent_burst * weight / total_weight).max(2.0)
    } else {
        parent_burst
    }
}

/// Nominal share of spare capacity: `spare × w / Σw`.
pub(crate) fn share_of(spare: f64, weight: f64, total_weight: f64) -> f64 {
    if total_weight > 0.0 {
        spare * weight / total_weight
    } else {
        0.0
    }
}

/// Highest weight → 0.5 (borrows as soon as the pool is half full), weights near zero → 1.0.
pub(crate) fn borrow_threshold(weight: f64, max_weight: f64) -> f64 {
    if max_weight > 0.0 {
        1.0 - weight / (2.0 * max_weight)
    } else {
        0.5
    }
}

fn check_ceiling(cx: &mut Ctx, path: &str, ceiling: f64, floor: f64, capacity: f64) {
    if ceiling < floor {
        cx.err(
            format!("{path}.ceiling"),
            Problem::CeilingBelowFloor { ceiling, floor },
        );
    } else if ceiling > capacity * (1.0 + 1e-12) {
        cx.err(
            format!("{path}.ceiling"),
            Problem::CeilingAboveCapacity { ceiling, capacity },
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn common(
    cx: &mut Ctx,
    name: &str,
    path: &str,
    template: bool,
    raw: &RawLevel,
    parent_burst: f64,
) -> LevelPolicy {
    let weight_path = format!("{path}.weight");
    let mut weight = cx.positive(&weight_path, raw.weight.unwrap_or(1.0));
    if !WEIGHTS.contains(&weight) {
        cx.err(&weight_path, Problem::WeightOutOfRange(weight));
        weight = 1.0;
    }
    let floor_path = format!("{path}.floor");
    let floor = cx.non_negative(&floor_path, raw.floor.unwrap_or(0.0));
    let floor = cx.at_most(&floor_path, floor);
    let ceiling = raw.ceiling.map(|c| cx.units(&format!("{path}.ceiling"), c));
    let explicit_burst = raw.burst.is_some();
    let burst = match raw.burst {
        Some(b) => cx.burst(&format!("{path}.burst"), b),
        None => parent_burst,
    };
    let max_concurrency = raw
        .max_concurrency
        .map(|m| cx.count(&format!("{path}.max_concurrency"), m) as u32);
    let budgets = cx.budgets(path, &raw.budgets);
    LevelPolicy {
        name: if template { "*".into() } else { name.into() },
        position: usize::MAX,
        template,
        weight,
        floor,
        reserved_floor: floor,
        children_floor: 0.0,
        ceiling,
        burst,
        explicit_burst,
        configured_child_burst: 0.0,
        borrow_threshold: 0.5,
        max_concurrency,
        budgets,
        max_tracked: 0,
        slot: 0,
        children: Vec::new(),
        child_index: super::NameIndex::default(),
        default_child: None,
        configured_child_weight: 0.0,
        max_child_weight: 0.0,
    }
}

/// How many distinct callers a template (`default_tenant` / `default_instance`) tracks at
/// once: the written bound, or the default when it has no floor; the bound is an error
/// anywhere else. `(field, place, default)` name the bound for one kind of template.
fn template_bound(
    cx: &mut Ctx,
    level: &mut LevelPolicy,
    written: Option<f64>,
    path: &str,
    (field, place, default): (&'static str, &'static str, u64),
) {
    match (level.template, written) {
        (true, Some(m)) => level.max_tracked = cx.count(&format!("{path}.{field}"), m),
        (true, None) => {
            if level.floor > 0.0 {
                cx.err(
                    format!("{path}.floor"),
                    Problem::TemplateFloorNeedsMax(field),
                );
            }
            level.max_tracked = default;
        }
        (false, Some(_)) => cx.err(
            format!("{path}.{field}"),
            Problem::Misplaced { field, place },
        ),
        (false, None) => {}
    }
}

/// Reports each field of `fields` that is written (`true`) at `path`, where it has no meaning:
/// it belongs in `place`.
fn reject(cx: &mut Ctx, path: &str, fields: &[(&'static str, bool)], place: &'static str) {
    for &(field, written) in fields {
        if written {
            cx.err(
                format!("{path}.{field}"),
                Problem::Misplaced { field, place },
            );
        }
    }
}

fn tenant(
    cx: &mut Ctx,
    name: &str,
    raw: &RawLevel,
    path: &str,
    tool_burst: f64,
    template: bool,
) -> LevelPolicy {
    let mut t = common(cx, name, path, template, raw, tool_burst);
    let misplaced = [("max_instances", raw.max_instances.is_some())];
    reject(cx, path, &misplaced, "default_instance");
    template_bound(
        cx,
        &mut t,
        raw.max_tenants,
        path,
        (
            "max_tenants",
            "default_tenant or a plan",
            DEFAULT_MAX_TENANTS,
        ),
    );
    for (iname, i) in &raw.instances.0 {
        let ipath = format!("{path}.instances.{iname}");
        cx.name(&ipath, iname);
        t.child_index.insert(iname.clone(), t.children.len());
        let mut inst = instance(cx, iname, i, &ipath, t.burst, false);
        inst.position = t.children.len();
        t.children.push(inst);
    }
    if let Some(d) = &raw.default_instance {
        let inst = instance(
            cx,
            "*",
            d,
            &format!("{path}.default_instance"),
            t.burst,
            true,
        );
        t.default_child = Some(Box::new(inst));
    }
    t.configured_child_weight = t.children.iter().map(|c| c.weight).sum();
    t.max_child_weight = t
        .children
        .iter()
        .map(|c| c.weight)
        .chain(t.default_child.as_ref().map(|c| c.weight))
        .fold(0.0, f64::max);
    t.children_floor = t.children.iter().map(|c| c.floor).sum::<f64>()
        + t.default_child
            .as_ref()
            .map_or(0.0, |c| c.floor * c.max_tracked as f64);
    t.reserved_floor = t.floor.max(t.children_floor);
    t
}

fn instance(
    cx: &mut Ctx,
    name: &str,
    raw: &RawLevel,
    path: &str,
    tenant_burst: f64,
    template: bool,
) -> LevelPolicy {
    let mut i = common(cx, name, path, template, raw, tenant_burst);
    let misplaced = [("max_tenants", raw.max_tenants.is_some())];
    reject(cx, path, &misplaced, "default_tenant or a plan");
    let misplaced = [
        ("default_instance", raw.default_instance.is_some()),
        ("instances", !raw.instances.is_empty()),
    ];
    reject(cx, path, &misplaced, "a tenant");
    template_bound(
        cx,
        &mut i,
        raw.max_instances,
        path,
        ("max_instances", "default_instance", DEFAULT_MAX_INSTANCES),
    );
    i
}

/// A tool's `rate.per`, within the longest period allowed (a bad one is an error, and a
/// minute stands in for it so the rest can still be checked).
fn period_of(cx: &mut Ctx, per: &str, path: &str) -> Period {
    match Period::parse(per) {
        Ok(p) if p.as_micros() > MAX_PERIOD_MICROS => {
            cx.err(
                format!("{path}.rate.per"),
                Problem::PeriodTooLong(per.to_owned()),
            );
            Period::from_micros(MAX_PERIOD_MICROS)
        }
        Ok(p) => p,
        Err(e) => {
            cx.err(format!("{path}.rate.per"), Problem::BadPeriod(e));
            Period::from_micros(60_000_000)
        }
    }
}

/// The tiers a tool admits: `tier` or `tiers`, not both.
fn tiers_of(
    cx: &mut Ctx,
    tier: Option<String>,
    tiers: Option<Vec<String>>,
    path: &str,
) -> Vec<String> {
    match (tier, tiers) {
        (Some(_), Some(_)) => {
            cx.err(format!("{path}.tiers"), Problem::TierAndTiers);
            Vec::new()
        }
        (Some(t), None) => vec![t],
        (None, Some(ts)) => ts,
        (None, None) => Vec::new(),
    }
}

/// A tool's lease `max` (0: off; infinite: `"auto"`, the default, where only the adaptive
/// grant bounds it).
fn lease_of(cx: &mut Ctx, lease: Option<&RawLease>, path: &str) -> f64 {
    match lease {
        None => f64::INFINITY,
        Some(RawLease::Word(w)) if w == "auto" => f64::INFINITY,
        Some(RawLease::Word(w)) if w == "off" => 0.0,
        Some(RawLease::Word(w)) => {
            cx.err(format!("{path}.lease"), Problem::BadLease(w.clone()));
            0.0
        }
        Some(RawLease::Max(m)) => cx.units(&format!("{path}.lease.max"), *m),
    }
}

/// The floors a tool reserves (its template's for every caller it may track) within its
/// capacity, and a warning above 70 % of it.
fn check_reserved_floors(cx: &mut Ctx, path: &str, reserved_floors: f64, capacity: f64) {
    if reserved_floors > capacity * (1.0 + 1e-12) {
        cx.err(
            format!("{path}.tenants"),
            Problem::FloorsExceedCapacity {
                sum: reserved_floors,
                capacity,
            },
        );
    } else if reserved_floors > 0.7 * capacity {
        cx.warnings.push(Warning {
            path: format!("{path}.tenants"),
            message: format!(
                "floors reserve {:.0} % of the capacity: above 70 % one busy caller saturates the tool and there is little left to lend",
                100.0 * reserved_floors / capacity
            ),
        });
    }
}

/// The tool's burst: as written (with a warning when it leaves no lending room above the
/// tenants' `banks`), or by default its own portion plus the banks.
fn tool_burst(cx: &mut Ctx, path: &str, burst: f64, explicit: bool, banks: f64) -> f64 {
    if !explicit {
        return burst + banks;
    }
    if banks + 1.0 > burst {
        cx.warnings.push(Warning {
            path: format!("{path}.burst"),
            message: format!(
                "burst {burst} leaves no lending room above the tenants' bursts ({banks}): idle share cannot be lent; raise it or leave it unset"
            ),
        });
    }
    burst
}

/// A warning for each tool budget its tenants' budgets split with (almost) nothing left
/// unallocated.
fn budgets_split(cx: &mut Ctx, path: &str, budgets: &[Budget], tenants: &[LevelPolicy]) {
    for b in budgets {
        let split: f64 = tenants
            .iter()
            .filter_map(|t| t.budgets.iter().find(|x| x.period == b.period))
            .map(|x| x.max)
            .sum();
        if split > 0.95 * b.max {
            cx.warnings.push(Warning {
                path: format!("{path}.budgets"),
                message: format!(
                    "tenant {} budgets add up to {split} of the tool's {}: leave 5-10 % unallocated so one team's overrun cannot eat another's headroom",
                    b.period, b.max
                ),
            });
        }
    }
}

/// What the second pass over a tool's tenants needs of the tool.
struct Shares {
    /// The heaviest tenant's weight (the borrowing order).
    max_weight: f64,
    /// The tool's burst.
    burst: f64,
    /// Σ weights, the template once.
    weight_once: f64,
    period: Period,
    /// Capacity less the reserved floors.
    spare: f64,
    capacity: f64,
    /// `default_ceiling = "capacity"`.
    open: bool,
}

/// The second pass over tenant `t` (at `tpath`): its bursts and its instances', the checks of
/// its floors and ceiling, then its own and its instances' ceilings.
fn finish_tenant(cx: &mut Ctx, t: &mut LevelPolicy, tpath: &str, sh: &Shares) {
    default_bursts(cx, t, tpath, sh);
    let nominal = check_tenant_floors(cx, t, tpath, sh);
    ceilings(cx, t, tpath, sh, nominal);
}

/// Default bursts, bottom-up, and the borrowing threshold of tenant `t`.
fn default_bursts(cx: &mut Ctx, t: &mut LevelPolicy, tpath: &str, sh: &Shares) {
    t.borrow_threshold = borrow_threshold(t.weight, sh.max_weight);
    // Default bursts, bottom-up: each caller's own portion of its parent's lending room,
    // plus the banks of its children, so a parent can always hold every child's bank.
    let portion = if t.explicit_burst {
        t.burst
    } else {
        portion_of_burst(sh.burst, t.weight, sh.weight_once)
    };
    let inner_weight_once =
        t.configured_child_weight + t.default_child.as_ref().map_or(0.0, |d| d.weight);
    for c in t.children.iter_mut().chain(t.default_child.as_deref_mut()) {
        if !c.explicit_burst {
            c.burst = portion_of_burst(portion, c.weight, inner_weight_once);
        }
    }
    t.configured_child_burst = t.children.iter().map(|c| c.burst).sum();
    let banks = t.configured_child_burst + t.default_child.as_ref().map_or(0.0, |d| d.burst);
    if !t.explicit_burst {
        t.burst = if t.has_instances() {
            portion + banks
        } else {
            portion
        };
    } else if t.has_instances() && t.burst < banks + 1.0 {
        cx.warnings.push(Warning {
            path: format!("{tpath}.burst"),
            message: format!(
                "burst {} leaves no lending room above its instances' bursts ({banks}): instances cannot borrow each other's idle share",
                t.burst
            ),
        });
    }
}

/// The floors of tenant `t` and its instances within their budgets and its nominal
/// allocation, and its ceiling within the tool; its nominal allocation (floor + share).
fn check_tenant_floors(cx: &mut Ctx, t: &LevelPolicy, tpath: &str, sh: &Shares) -> f64 {
    floor_within_budgets(cx, tpath, t.floor, sh.period, &t.budgets);
    for c in t.children.iter().chain(t.default_child.as_deref()) {
        let cpath = if c.template {
            format!("{tpath}.default_instance")
        } else {
            format!("{tpath}.instances.{}", c.name)
        };
        floor_within_budgets(cx, &cpath, c.floor, sh.period, &c.budgets);
    }
    let share = share_of(sh.spare, t.weight, sh.weight_once);
    let nominal = t.floor + share;
    if let Some(c) = t.ceiling {
        check_ceiling(cx, tpath, c, t.reserved_floor, sh.capacity);
    }
    if t.children_floor > nominal * (1.0 + 1e-12) {
        cx.err(
            format!("{tpath}.instances"),
            Problem::FloorsExceedCapacity {
                sum: t.children_floor,
                capacity: nominal,
            },
        );
    } else if t.children_floor > t.floor {
        cx.warnings.push(Warning {
            path: format!("{tpath}.instances"),
            message: format!(
                "instance floors add up to {} above the tenant floor {}: the difference is reserved out of the tenant's share",
                t.children_floor, t.floor
            ),
        });
    }
    nominal
}

/// The ceilings of tenant `t` (with `default_ceiling = "capacity"`) and of its instances,
/// and their borrowing thresholds, given its nominal allocation.
fn ceilings(cx: &mut Ctx, t: &mut LevelPolicy, tpath: &str, sh: &Shares, nominal: f64) {
    if sh.open && t.ceiling.is_none() {
        t.ceiling = Some((t.reserved_floor + sh.spare).min(sh.capacity));
    }
    let tenant_capacity = t.ceiling.unwrap_or(nominal);
    let inner_spare = (tenant_capacity - t.children_floor).max(0.0);
    let max_child = t.max_child_weight;
    let mut kids = std::mem::take(&mut t.children);
    for c in kids.iter_mut() {
        c.borrow_threshold = borrow_threshold(c.weight, max_child);
        if sh.open && c.ceiling.is_none() {
            c.ceiling = Some(c.floor + inner_spare);
        }
        if let Some(ceil) = c.ceiling {
            check_ceiling(
                cx,
                &format!("{tpath}.instances.{}", c.name),
                ceil,
                c.floor,
                tenant_capacity,
            );
        }
    }
    t.children = kids;
    if let Some(d) = t.default_child.as_mut() {
        d.borrow_threshold = borrow_threshold(d.weight, max_child);
        if sh.open && d.ceiling.is_none() {
            d.ceiling = Some(d.floor + inner_spare);
        }
        if let Some(ceil) = d.ceiling {
            check_ceiling(
                cx,
                &format!("{tpath}.default_instance"),
                ceil,
                d.floor,
                tenant_capacity,
            );
        }
    }
}
