//! Scenario simulation over a virtual clock: offered load in, per-period admitted / refused
//! out. Deterministic — the same policy and scenario always give the same report — and
//! instant: time is a [`ManualClock`], nobody sleeps. Each offered call goes through the real
//! [`FairShareLayer`], exactly as a request to a service behind it would.
//!
//! ```
//! use fairshare::simulate::{simulate, Scenario};
//! use tower_fairshare::Policy;
//!
//! let policy = Policy::from_toml_str(r#"
//!     [[tool]]
//!     name = "t"
//!     unit = "calls"
//!     rate = { limit = 60, per = "1m" }
//!     [tool.tenants.A]
//!     floor = 10
//! "#).unwrap();
//! let scenario = Scenario::from_toml_str(r#"
//!     tool = "t"
//!     duration = "2m"
//!     [[caller]]
//!     tenant = "A"
//!     rate = 600
//!     per = "1m"
//! "#).unwrap();
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let report = simulate(&policy, &scenario).await.unwrap();
//! assert_eq!(report.periods.len(), 2);
//! assert!(report.periods.iter().all(|p| p.admitted <= 60));
//! # });
//! ```

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use http::{Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

use tower_fairshare::admission::engine::{LevelView, Plan};
use tower_fairshare::policy::{plain_words, ToolAllocation};
use tower_fairshare::store::{
    Admission, Answer, CallKeys, Decision, MemoryStore, Store, StoreError, Stored,
};
use tower_fairshare::{
    Caller, Clock, Cost, FairShareLayer, Limiter, ManualClock, Period, Policy, Timestamp,
};

/// The virtual start: 2026-01-01T00:00:00Z, aligned to every period and calendar window.
pub const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

/// A load scenario: who offers how many calls of which tool, when.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The tool called.
    pub tool: String,
    /// How long the scenario runs, e.g. `"10m"`.
    pub duration: String,
    /// The callers.
    #[serde(rename = "caller", default)]
    pub callers: Vec<ScenarioCaller>,
}

/// One caller of a scenario: offers `rate` calls per `per`, evenly spaced.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScenarioCaller {
    /// Tenant (absent: an untenanted caller).
    #[serde(default)]
    pub tenant: Option<String>,
    /// Instance.
    #[serde(default)]
    pub instance: Option<String>,
    /// Tier.
    #[serde(default)]
    pub tier: Option<String>,
    /// Plan: an unlisted tenant is governed by the tool's template for it.
    #[serde(default)]
    pub plan: Option<String>,
    /// Calls offered per `per`.
    pub rate: f64,
    /// The period of `rate`, e.g. `"1m"`.
    pub per: String,
    /// When it starts offering (default `"0s"`).
    #[serde(default)]
    pub start: Option<String>,
    /// When it stops (default: the end of the scenario).
    #[serde(default)]
    pub stop: Option<String>,
    /// Cost of each call (default 1).
    #[serde(default)]
    pub cost: Option<f64>,
}

impl ScenarioCaller {
    /// The caller its calls are made as: its tenant (or none), instance, tier and plan.
    pub fn caller(&self) -> Caller {
        let mut caller = match &self.tenant {
            Some(t) => Caller::new(t.as_str()),
            None => Caller::untenanted(),
        };
        if let Some(inst) = &self.instance {
            caller = caller.with_instance(inst.as_str());
        }
        if let Some(tier) = &self.tier {
            caller = caller.with_tier(tier.as_str());
        }
        if let Some(plan) = &self.plan {
            caller = caller.with_plan(plan.as_str());
        }
        caller
    }

    /// The cost of each of its calls: as written, or 1.
    pub fn cost(&self) -> f64 {
        self.cost.unwrap_or(1.0)
    }
}

/// A scenario that cannot run, and why.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("cannot read scenario file `{path}`: {source}")]
    Io {
        /// The file.
        path: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The text is not a scenario.
    #[error("{}", located(path, message))]
    Syntax {
        /// Where.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A field has a bad value.
    #[error("{}", located(path, message))]
    Invalid {
        /// Where (`caller[2].rate`).
        path: String,
        /// What is wrong and how to fix it.
        message: String,
    },
}

/// `message` at `path` (`caller[2].rate`); the message alone where the path names nothing (the
/// whole file).
fn located(path: &str, message: &str) -> String {
    match path {
        "" | "." => message.to_owned(),
        path => format!("{path}: {message}"),
    }
}

/// The most rows (periods × callers) a report may hold: a scenario past it is refused before
/// anything is allocated for it.
pub const MAX_ROWS: u64 = 1_000_000;

/// The most calls a scenario may offer in all: each is a request through the layer.
pub const MAX_CALLS: f64 = 20_000_000.0;

impl Scenario {
    /// Parses a TOML scenario.
    pub fn from_toml_str(text: &str) -> Result<Scenario, ScenarioError> {
        let de = toml::Deserializer::parse(text).map_err(|e| ScenarioError::Syntax {
            path: String::new(),
            message: e.to_string(),
        })?;
        serde_path_to_error::deserialize(de).map_err(|e| ScenarioError::Syntax {
            path: e.path().to_string(),
            message: plain_words(e.inner().message().trim()),
        })
    }

    /// Reads a TOML scenario file.
    pub fn from_path(path: impl AsRef<std::path::Path>) -> Result<Scenario, ScenarioError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Scenario::from_toml_str(&text)
    }
}

/// One caller's numbers for one period (or, in totals, the whole run).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CallerRow {
    /// Tenant.
    pub tenant: Option<String>,
    /// Instance.
    pub instance: Option<String>,
    /// Calls offered.
    pub offered: u64,
    /// Calls admitted.
    pub admitted: u64,
    /// Calls refused.
    pub refused: u64,
    /// The floor it was owed.
    pub floor: f64,
    /// The ceiling it was owed.
    pub ceiling: f64,
}

/// One period of the report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PeriodRow {
    /// Milliseconds since the start of the scenario.
    pub start_ms: u64,
    /// Per caller.
    pub callers: Vec<CallerRow>,
    /// Calls admitted in the period, all callers.
    pub admitted: u64,
    /// Units of reserved floors the period left unused (see [`unserved_floors`]): capacity
    /// kept for tenants that did not call, never lent to those that did.
    pub unserved_floors: f64,
}

/// Units of a tool's reserved floors that one period left unused, given the units each
/// caller's tenant was admitted in it (`(tenant, units)`, a tenant may come more than once):
/// each listed tenant's reserved floor less what its callers were admitted (never below 0),
/// whether it called or not, and the same for each template tenant that called. A floor is
/// kept for its tenant and never lent, so this much of the capacity goes unused while its
/// tenants are idle — the gap between what a saturated tool admits and its capacity that
/// `fairshare check` announces. (Counted per tenant: an instance's own floor left unused
/// while its siblings use the tenant's is not in it.)
///
/// ```
/// use fairshare::simulate::unserved_floors;
/// use tower_fairshare::Policy;
///
/// let policy = Policy::from_toml_str(r#"
///     [[tool]]
///     name = "llm"
///     unit = "tokens"
///     rate = { limit = 1000, per = "1m" }
///     [tool.tenants.A]
///     floor = 100
///     [tool.tenants.B]
///     floor = 50
/// "#).unwrap();
/// let alloc = &policy.allocation().tools[0];
/// // A was admitted three calls of 20 tokens (40 of its floor unused), B nothing (all 50).
/// assert_eq!(unserved_floors(alloc, [("A", 60.0)]), 90.0);
/// ```
pub fn unserved_floors<'a>(
    alloc: &ToolAllocation,
    admitted: impl IntoIterator<Item = (&'a str, f64)>,
) -> f64 {
    let mut used: Vec<(&str, f64)> = Vec::new();
    for (t, units) in admitted {
        match used.iter_mut().find(|(n, _)| *n == t) {
            Some(e) => e.1 += units,
            None => used.push((t, units)),
        }
    }
    let admitted = |t: &str| used.iter().find(|(n, _)| *n == t).map_or(0.0, |e| e.1);
    let listed = alloc.tenants.iter().filter(|t| t.name != "*");
    let mut total: f64 = listed
        .map(|t| (t.reserved_floor - admitted(&t.name)).max(0.0))
        .sum();
    if let Some(template) = alloc.tenants.iter().find(|t| t.name == "*") {
        for (name, n) in &used {
            if !alloc.tenants.iter().any(|t| t.name == *name) {
                total += (template.reserved_floor - *n).max(0.0);
            }
        }
    }
    total
}

/// A simulation's result: the `--json` contract of `fairshare simulate`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Report {
    /// Per period of the tool.
    pub periods: Vec<PeriodRow>,
    /// Per caller, over the whole run (owed floors and ceilings summed over periods).
    pub totals: Vec<CallerRow>,
}

/// One caller of a scenario as it is run: who, how often, from when to when, at what cost,
/// when it calls next, and (floor, ceiling) as the allocation table owes it.
struct Source {
    caller: Caller,
    interval: f64,
    start: u64,
    stop: u64,
    cost: f64,
    next: u64,
    owed: (f64, f64),
}

impl Source {
    /// When its call `k` (from 0) is made (µs from the start), if before it stops.
    fn call_at(&self, k: u64) -> Option<u64> {
        let t = self.start + (k as f64 * self.interval) as u64;
        (t < self.stop).then_some(t)
    }

    /// Its row of a report, nothing counted yet.
    fn row(&self) -> CallerRow {
        CallerRow {
            tenant: self.caller.tenant().map(str::to_owned),
            instance: self.caller.instance().map(str::to_owned),
            offered: 0,
            admitted: 0,
            refused: 0,
            floor: self.owed.0,
            ceiling: self.owed.1,
        }
    }
}

/// The scenario's callers as they are run (`duration`: the scenario's, µs), or the first that
/// cannot be, or why they would offer more calls than [`MAX_CALLS`].
fn sources(
    scenario: &Scenario,
    duration: u64,
    alloc: &ToolAllocation,
) -> Result<Vec<Source>, ScenarioError> {
    let sources = (scenario.callers.iter().enumerate())
        .map(|(i, c)| source(i, c, (duration, &scenario.duration), alloc))
        .collect::<Result<Vec<_>, _>>()?;
    let offered: f64 = sources
        .iter()
        .map(|s| (s.stop - s.start) as f64 / s.interval)
        .sum();
    if offered > MAX_CALLS {
        return Err(ScenarioError::Invalid {
            path: "caller".into(),
            message: format!(
                "the callers offer {offered:.0} calls in all; at most {MAX_CALLS} are simulated \
                 (each is a request through the layer): lower a rate or shorten `duration`"
            ),
        });
    }
    Ok(sources)
}

/// Caller `i` of a scenario as it is run (`duration`: the scenario's, µs and as written), or
/// which of its fields is wrong and why.
fn source(
    i: usize,
    c: &ScenarioCaller,
    duration: (u64, &str),
    alloc: &ToolAllocation,
) -> Result<Source, ScenarioError> {
    let at = |f: &str| format!("caller[{i}].{f}");
    if !(c.rate.is_finite() && c.rate > 0.0) {
        return Err(ScenarioError::Invalid {
            path: at("rate"),
            message: format!("must be a positive number of calls, not {}", c.rate),
        });
    }
    for (field, name) in [("tenant", &c.tenant), ("instance", &c.instance)] {
        if name.as_deref().is_some_and(|n| n.trim().is_empty()) {
            return Err(ScenarioError::Invalid {
                path: at(field),
                message: "must not be blank: name it, or leave the field out".into(),
            });
        }
    }
    let per = period(at("per"), &c.per)?;
    let (start, stop) = span(c, duration, at)?;
    let cost = c.cost();
    if !(cost.is_finite() && cost >= 0.0) {
        return Err(ScenarioError::Invalid {
            path: at("cost"),
            message: format!("must be zero or a positive number, not {cost}"),
        });
    }
    Ok(Source {
        caller: c.caller(),
        interval: per as f64 / c.rate,
        start,
        stop,
        cost,
        next: 0,
        owed: owed(c, alloc),
    })
}

/// When caller `c` offers calls (µs from the start: from, until), within the scenario's
/// `duration` (µs and as written); `at` names its fields.
fn span(
    c: &ScenarioCaller,
    (duration, written): (u64, &str),
    at: impl Fn(&str) -> String,
) -> Result<(u64, u64), ScenarioError> {
    let start = match &c.start {
        Some(s) if s.trim_start_matches('0').is_empty() || s == "0s" => 0,
        Some(s) => period(at("start"), s)?,
        None => 0,
    };
    if start >= duration {
        return Err(ScenarioError::Invalid {
            path: at("start"),
            message: format!(
                "`{}` is not before the scenario's end (`duration` = `{written}`)",
                c.start.as_deref().unwrap_or_default(),
            ),
        });
    }
    let stop = match &c.stop {
        Some(s) => period(at("stop"), s)?.min(duration),
        None => duration,
    };
    if stop <= start {
        return Err(ScenarioError::Invalid {
            path: at("stop"),
            message: format!(
                "`{}` is not after the caller's start (`{}`)",
                c.stop.as_deref().unwrap_or_default(),
                c.start.as_deref().unwrap_or("0s")
            ),
        });
    }
    Ok((start, stop))
}

/// What the allocation table says caller `c` is owed, (floor, ceiling): its own row, or its
/// template's with one active caller; nothing for a caller the policy does not govern.
fn owed(c: &ScenarioCaller, alloc: &ToolAllocation) -> (f64, f64) {
    let template = |plan: Option<&String>| {
        let mut rows = alloc.tenants.iter();
        rows.find(|r| r.name == "*" && r.plan.as_ref() == plan)
    };
    let tenant = c.tenant.as_deref().and_then(|t| {
        alloc.tenants.iter().find(|r| r.name == t).or_else(|| {
            c.plan
                .as_ref()
                .and_then(|p| template(Some(p)))
                .or_else(|| template(None))
        })
    });
    let Some(t) = tenant else {
        return (0.0, 0.0);
    };
    let inst = c.instance.as_deref().and_then(|i| {
        t.instances
            .iter()
            .find(|r| r.name == i)
            .or_else(|| t.instances.iter().find(|r| r.name == "*"))
    });
    match inst {
        Some(i) => (i.floor, i.ceiling),
        None => (t.floor, t.ceiling),
    }
}

/// How many periods a scenario of `periods` periods and `callers` callers reports, or why it
/// cannot run: no caller, or more rows than [`MAX_ROWS`] (`duration`: the scenario's, as
/// written).
fn rows_of(periods: u64, callers: usize, duration: &str) -> Result<usize, ScenarioError> {
    if callers == 0 {
        return Err(ScenarioError::Invalid {
            path: "caller".into(),
            message: "the scenario has no [[caller]]: add at least one".into(),
        });
    }
    let rows = periods.saturating_mul(callers as u64);
    if rows > MAX_ROWS {
        return Err(ScenarioError::Invalid {
            path: "duration".into(),
            message: format!(
                "`{duration}` is {periods} periods of the tool, {rows} rows of report for \
                 {callers} callers; at most {MAX_ROWS}: shorten the scenario"
            ),
        });
    }
    Ok(periods as usize)
}

fn period(path: String, text: &str) -> Result<u64, ScenarioError> {
    Period::parse(text)
        .map(|p| p.as_micros())
        .map_err(|message| ScenarioError::Invalid { path, message })
}

/// Runs `scenario` against `policy` with an in-process store.
pub async fn simulate(policy: &Policy, scenario: &Scenario) -> Result<Report, ScenarioError> {
    simulate_with(
        policy,
        MemoryStore::new(),
        &ManualClock::new(EPOCH),
        scenario,
    )
    .await
}

/// Runs `scenario` against `policy` with state in `store`, moving `clock` from its current
/// reading.
///
/// Every offered call is a request through the real [`FairShareLayer`] (the caller in its
/// extensions, the cost as a [`Cost`] extension) in front of a service that answers 200: a
/// refusal is whatever the layer answers instead.
pub async fn simulate_with<S: Store>(
    policy: &Policy,
    store: S,
    clock: &ManualClock,
    scenario: &Scenario,
) -> Result<Report, ScenarioError> {
    let recorder = Recorder {
        store,
        last: Arc::default(),
    };
    let last = recorder.last.clone();
    let limiter = Limiter::with_store(policy.clone(), recorder, clock.clone());
    let mut service = FairShareLayer::new(limiter)
        .tool(scenario.tool.as_str())
        .layer(Answer200);
    let p = period_of(policy, scenario)?;
    let duration = period("duration".into(), &scenario.duration)?;
    let n_periods = rows_of(
        duration.div_ceil(p),
        scenario.callers.len(),
        &scenario.duration,
    )?;
    let allocation = policy.allocation();
    let alloc = allocation
        .tools
        .iter()
        .find(|t| t.name == scenario.tool)
        .expect("tool exists");

    let mut sources = sources(scenario, duration, alloc)?;
    let mut periods: Vec<PeriodRow> = (0..n_periods)
        .map(|k| PeriodRow {
            start_ms: k as u64 * p / 1000,
            callers: sources.iter().map(Source::row).collect(),
            admitted: 0,
            unserved_floors: 0.0,
        })
        .collect();

    // Events in time order; ties by caller order, so runs are reproducible.
    let mut heap = BinaryHeap::new();
    for (i, s) in sources.iter().enumerate() {
        if let Some(t) = s.call_at(0) {
            heap.push(Reverse((t, i)));
        }
    }
    let origin = clock.now();
    while let Some(Reverse((t, i))) = heap.pop() {
        clock.set(origin.saturating_add(Duration::from_micros(t)));
        let cell = &mut periods[(t / p) as usize].callers[i];
        offer(&mut service, &last, &sources[i], cell).await;
        let s = &mut sources[i];
        s.next += 1;
        if let Some(nt) = s.call_at(s.next) {
            heap.push(Reverse((nt, i)));
        }
    }
    Ok(report(periods, &sources, alloc))
}

/// The period of the scenario's tool in `policy` (µs), or an error naming the tools it has.
fn period_of(policy: &Policy, scenario: &Scenario) -> Result<u64, ScenarioError> {
    policy
        .tool(&scenario.tool)
        .map(|t| t.period().as_micros())
        .ok_or_else(|| ScenarioError::Invalid {
            path: "tool".into(),
            message: format!(
                "the policy has no tool `{}`: use one of {:?}",
                scenario.tool,
                policy
                    .tools()
                    .map(|t| t.name().to_owned())
                    .collect::<Vec<_>>()
            ),
        })
}

/// One call of `s` through `service`, counted in `cell`: offered, and admitted (with the
/// floor and ceiling its decision owed the caller) or refused.
async fn offer<T, B>(
    service: &mut T,
    last: &Mutex<Option<LevelView>>,
    s: &Source,
    cell: &mut CallerRow,
) where
    T: Service<Request<()>, Response = Response<B>, Error = Infallible>,
{
    let mut request = Request::new(());
    request.extensions_mut().insert(s.caller.clone());
    request.extensions_mut().insert(Cost(s.cost));
    *last.lock().unwrap_or_else(|e| e.into_inner()) = None;
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .unwrap_or_else(|never| match never {});
    let response = service
        .call(request)
        .await
        .unwrap_or_else(|never| match never {});
    cell.offered += 1;
    if response.status() == StatusCode::OK {
        cell.admitted += 1;
        if let Some(v) = last.lock().unwrap_or_else(|e| e.into_inner()).take() {
            cell.floor = v.floor;
            cell.ceiling = v.ceiling;
        }
    } else {
        cell.refused += 1;
    }
    // Dropping the response ends the call: its concurrency permits come back.
    drop(response);
}

/// The report of a run's `periods`: each period's total and floors left unused, and each
/// caller's totals over the run.
fn report(mut periods: Vec<PeriodRow>, sources: &[Source], alloc: &ToolAllocation) -> Report {
    for p in periods.iter_mut() {
        p.admitted = p.callers.iter().map(|c| c.admitted).sum();
        p.unserved_floors = unserved_floors(
            alloc,
            p.callers
                .iter()
                .zip(sources)
                .filter_map(|(c, s)| Some((c.tenant.as_deref()?, c.admitted as f64 * s.cost))),
        );
    }
    let totals = (0..sources.len())
        .map(|i| {
            let mut r = sources[i].row();
            r.floor = 0.0;
            r.ceiling = 0.0;
            for p in &periods {
                let c = &p.callers[i];
                r.offered += c.offered;
                r.admitted += c.admitted;
                r.refused += c.refused;
                r.floor += c.floor;
                r.ceiling += c.ceiling;
            }
            r
        })
        .collect();
    Report { periods, totals }
}

/// `tenant/instance`, as tables and charts name a caller.
pub(crate) fn label(r: &CallerRow) -> String {
    match (&r.tenant, &r.instance) {
        (Some(t), Some(i)) => format!("{t}/{i}"),
        (Some(t), None) => t.clone(),
        (None, Some(i)) => format!("(untenanted)/{i}"),
        (None, None) => "(untenanted)".into(),
    }
}

impl Report {
    /// A readable table: one block per period, then totals.
    pub fn to_table(&self, capacity: f64, period: Period) -> String {
        let mut o = String::new();
        let width = self
            .totals
            .iter()
            .map(|r| label(r).len())
            .max()
            .unwrap_or(6)
            .max(6);
        let header = |o: &mut String| {
            let _ = writeln!(
                o,
                "  {:<width$} {:>9} {:>9} {:>9} {:>8} {:>8}",
                "caller", "offered", "admitted", "refused", "floor", "ceiling"
            );
        };
        let line = |o: &mut String, r: &CallerRow| {
            let _ = writeln!(
                o,
                "  {:<width$} {:>9} {:>9} {:>9} {:>8.0} {:>8.0}",
                label(r),
                r.offered,
                r.admitted,
                r.refused,
                r.floor,
                r.ceiling
            );
        };
        for (k, p) in self.periods.iter().enumerate() {
            let _ = writeln!(
                o,
                "period {} (from {}s), admitted {} of capacity {} per {}",
                k + 1,
                p.start_ms / 1000,
                p.admitted,
                capacity,
                period
            );
            header(&mut o);
            for r in &p.callers {
                line(&mut o, r);
            }
        }
        let _ = writeln!(o, "totals over {} periods", self.periods.len());
        header(&mut o);
        for r in &self.totals {
            line(&mut o, r);
        }
        o
    }
}

/// The service behind the layer in a simulation: every call it sees succeeds.
#[derive(Clone, Copy, Debug)]
struct Answer200;

impl Service<Request<()>> for Answer200 {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = Ready<Result<Response<String>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<()>) -> Self::Future {
        ready(Ok(Response::new(String::from("{\"ok\":true}"))))
    }
}

/// A store that remembers the numbers the caller was owed at its last admission, so the
/// report can show the floor and ceiling in force (template callers change them as they come
/// and go) while the call itself goes through the layer.
#[derive(Debug)]
struct Recorder<S> {
    store: S,
    last: Arc<Mutex<Option<LevelView>>>,
}

impl<S: Store> Store for Recorder<S> {
    fn decide(&self, plans: &[Plan<'_>]) -> Answer<Decision> {
        let last = self.last.clone();
        let note = move |d: Result<Decision, StoreError>| {
            if let Ok(Decision::Admitted(a)) = &d {
                let a = a.first();
                let view = a.views[usize::from(a.keys.instance.is_some())];
                *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(view);
            }
            d
        };
        match self.store.decide(plans) {
            Answer::Now(d) => Answer::Now(note(d)),
            Answer::Later(f) => Answer::later(async move { note(f.await) }),
        }
    }

    fn adjust(&self, admission: &Arc<Admission>, factor: f64, now: Timestamp) -> Answer<()> {
        self.store.adjust(admission, factor, now)
    }

    fn release(&self, admission: &Arc<Admission>) -> Answer<()> {
        self.store.release(admission)
    }

    fn inspect(&self, keys: &CallKeys) -> Answer<Stored> {
        self.store.inspect(keys)
    }

    fn inspect_at(&self, keys: &CallKeys, now: Timestamp) -> Answer<Stored> {
        self.store.inspect_at(keys, now)
    }
}
