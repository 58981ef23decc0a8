//! The operator's view: why was this caller throttled, live.
//!
//! [`Limiter::console`] gives a read-only tower service to mount where the app likes (behind
//! its own auth: the page names every listed tenant). It answers, under whatever prefix it is
//! mounted at:
//!
//! | path | what |
//! |---|---|
//! | `…/` | a page (a few KB of HTML, CSS and JS, no build step, no CDN) that polls `state` every second and draws, per tool, each listed tenant's floor, share, ceiling, what it used this period, what it borrowed, refusals by reason, calls in flight and budgets used |
//! | `…/state` | that data as JSON; `?tool=T&tenant=A` adds A's listed instances |
//! | `…/explain?tool=T&tenant=A&instance=I&cost=1` | what the next call of that caller would get and why ([`Explanation`]), as JSON |
//! | `…/refusals?tool=T&tenant=A` | the last refusals of that tenant (a bounded ring), newest first: when, which instance, reason, binding level, window, limit, used, the wait asked and the earliest time it could pass (the tenant's floor, share and ceiling are on its `state` row) |
//!
//! Nothing on it changes the policy or any counter: `state` and `explain` read the store
//! ([`Store::inspect_at`]) and `explain` runs the same decision as
//! [`Limiter::admit`] on what it read, without writing it back.
//!
//! Refusals are counted (by tool, tenant and reason) and kept (the last
//! [`RECENT_REFUSALS`] per tenant) from the moment the first console is made, so make it at
//! start-up if its counts should match `fairshare_decisions_total`. A tenant the policy lists
//! goes by its name, every other caller (template callers, unlisted or unidentified ones) by
//! `other` — never by a name a request made up. (The metrics name the same way, except that
//! they call only the first [`tenant_labels`](Limiter::tenant_labels) listed tenants by name
//! and an unidentified caller `unknown`.) What is kept is bounded by the policy: one tally per
//! listed tenant and one per tool for the rest, pruned when a reload drops a tenant.
//!
//! The console takes one short lock per refusal (off until a console is made: then the
//! refusal path pays one relaxed load), and `state` reads the store once per listed tenant:
//! with thousands of tenants on a remote store, poll it less often than the page does.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use serde::Serialize;
use tower_service::Service;

pub use crate::admission::engine::{BudgetUse, LevelFigures};
use crate::admission::Refusal;
use crate::clock::{Clock, Timestamp};
use crate::identity::{Caller, Cost};
use crate::limiter::Limiter;
use crate::policy::ToolPolicy;
use crate::store::{CallKeys, Store};
use crate::telemetry::recorder::{by_reason, listed};
pub use crate::telemetry::recorder::{RecentRefusal, Why, RECENT_REFUSALS};

/// What the next call of a caller would get and why, from the same decision as
/// [`Limiter::admit`], with nothing charged ([`Limiter::explain`]).
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Explanation {
    /// The tool.
    pub tool: String,
    /// The tenant asked about.
    pub tenant: Option<String>,
    /// The instance asked about.
    pub instance: Option<String>,
    /// The cost asked about.
    pub cost: f64,
    /// When (RFC 3339).
    pub at: String,
    /// Whether the call would be admitted now (also when the tool does not enforce its
    /// limits, `enforce = false`: then [`why`](Self::why) is the refusal shadow mode logs).
    pub admitted: bool,
    /// Why not: the refusal's reason, binding level and limit, and when it could pass. Empty
    /// when the call would be admitted (`earliest` is then now).
    #[serde(flatten)]
    pub why: Why,
    /// Tool, tenant and instance (those the call has), as they stand now.
    pub levels: Vec<LevelFigures>,
    /// The refusal the call would get.
    #[serde(skip)]
    pub refusal: Option<Refusal>,
}

impl<S: Store, C: Clock> Limiter<S, C> {
    /// What the next call of `caller` to `tool` costing `cost` would get now, and why: each
    /// level's limit, use, floor, share and slack, the binding level and the earliest time
    /// it could pass. Runs the same decision as [`admit`](Self::admit) on the states the store
    /// holds, and writes nothing.
    ///
    /// It decides at this limiter's clock. A Redis store decides at Redis's clock by default:
    /// near a window's edge, with the two clocks apart, the answer can differ from the call
    /// that follows. (With the memory store, or an injected time source, they agree: the
    /// conformance suite checks it.) Calls in flight count as the decision counts them:
    /// permits a dead replica held stop counting once they lapse.
    pub async fn explain(
        &self,
        caller: &Caller,
        tool: &str,
        cost: Cost,
    ) -> Result<Explanation, crate::StoreError> {
        let policy = self.policy();
        // Identity, tool and tier refusals come before the store, and shadow mode does not
        // apply to them (as in `admit`).
        let (now, verdict, levels, decided) = match self.plan(&policy, caller, tool, cost) {
            Err(r) => (self.clock().now(), Err(r), Vec::new(), false),
            Ok(plan) => {
                let keys = plan.keys();
                let states = self.store().inspect_at(&keys, plan.now).await?;
                let snap = crate::admission::engine::Snapshot {
                    tool: states[0].unwrap_or_default(),
                    tenant: states[1].unwrap_or_default(),
                    instance: states[2].unwrap_or_default(),
                    plans: states.plans,
                };
                let mut e = crate::admission::engine::explain(&plan, &snap);
                for l in &mut e.levels {
                    let (state, budgets) = match l.level {
                        "tool" => (&snap.tool, &plan.tool.budgets),
                        "tenant" => (&snap.tenant, &plan.tenant.policy.budgets),
                        _ => match plan.instance {
                            Some(i) => (&snap.instance, &i.policy.budgets),
                            None => continue,
                        },
                    };
                    l.budgets = budget_use(state, plan.now, budgets);
                }
                (plan.now, e.verdict, e.levels, true)
            }
        };
        // As `admit` concludes: a tool in shadow mode lets a call its limits refuse through.
        let shadow = decided && policy.tool(tool).is_some_and(|tp| !tp.enforce());
        let mut out = Explanation {
            tool: tool.to_owned(),
            tenant: caller.tenant().map(str::to_owned),
            instance: caller.instance().map(str::to_owned),
            cost: cost.0,
            at: now.to_rfc3339(),
            admitted: true,
            why: Why::default(),
            levels,
            refusal: None,
        };
        match verdict {
            Ok(()) => out.why.earliest = Some(out.at.clone()),
            Err(r) => {
                out.admitted = shadow;
                out.why = Why::of(&r, now);
                out.refusal = Some(r);
            }
        }
        Ok(out)
    }

    /// The operator's console: a read-only service to mount behind the app's own auth (see
    /// the [module](crate::console) for what it serves). Refusals are counted and kept from
    /// now on.
    ///
    /// ```
    /// use tower_fairshare::{Limiter, Policy};
    /// # let policy = Policy::from_toml_str("[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 60, per = \"1m\" }").unwrap();
    /// let limiter = Limiter::new(policy);
    /// let console = limiter.console();
    /// // axum: Router::new().nest_service("/fairshare", console)
    /// # drop(console);
    /// ```
    pub fn console(&self) -> Console<S, C> {
        self.recorder().start();
        Console {
            limiter: self.clone(),
            keys: None,
        }
    }
}

/// The operator's console service ([`Limiter::console`]).
pub struct Console<S, C> {
    limiter: Limiter<S, C>,
    keys: Option<KeyResolver>,
}

/// How a console turns an API key into the caller it authenticates (see
/// [`Console::resolve_keys`]).
type KeyResolver = Arc<dyn Fn(&str) -> Option<Caller> + Send + Sync>;

impl<S: std::fmt::Debug, C: std::fmt::Debug> std::fmt::Debug for Console<S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("limiter", &self.limiter)
            .field("resolves_keys", &self.keys.is_some())
            .finish()
    }
}

impl<S, C> Clone for Console<S, C> {
    fn clone(&self) -> Self {
        Console {
            limiter: self.limiter.clone(),
            keys: self.keys.clone(),
        }
    }
}

impl<S, C> Console<S, C> {
    /// Lets `explain` be asked by API key (`?tool=T&api_key=K`): `resolve` returns the caller
    /// that key authenticates, as your auth layer builds it (tenant, instance, tier), or
    /// `None` for an unknown key. The key is never echoed back.
    ///
    /// ```
    /// use tower_fairshare::{Caller, Limiter, Policy};
    /// # let policy = Policy::from_toml_str("[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 60, per = \"1m\" }").unwrap();
    /// let console = Limiter::new(policy)
    ///     .console()
    ///     .resolve_keys(|key| (key == "sk-acme").then(|| Caller::new("acme").with_tier("pro")));
    /// # drop(console);
    /// ```
    pub fn resolve_keys(
        mut self,
        resolve: impl Fn(&str) -> Option<Caller> + Send + Sync + 'static,
    ) -> Self {
        self.keys = Some(Arc::new(resolve));
        self
    }
}

type Reply = Response<String>;

fn reply(status: StatusCode, kind: &'static str, body: String) -> Reply {
    let mut res = Response::new(body);
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, http::HeaderValue::from_static(kind));
    res.headers_mut()
        .insert(CACHE_CONTROL, http::HeaderValue::from_static("no-store"));
    res
}

fn json(value: &impl Serialize) -> Reply {
    match serde_json::to_string(value) {
        Ok(body) => reply(StatusCode::OK, "application/json", body),
        Err(e) => problem(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

fn problem(status: StatusCode, message: &str) -> Reply {
    reply(
        status,
        "application/json",
        serde_json::json!({ "error": message }).to_string(),
    )
}

/// `%XX` and `+` decoded; `None` for a `%` not followed by two hex digits, or for bytes that
/// are not UTF-8 afterwards.
fn decode(s: &str) -> Option<String> {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).map(|d| d as u8)
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hi = hex(*bytes.get(i + 1)?)?;
                let lo = hex(*bytes.get(i + 2)?)?;
                out.push(hi << 4 | lo);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// The query's parameters, or the first one that does not decode (a question about another
/// caller than the one asked about would be worse than none).
fn query(uri: &http::Uri) -> Result<HashMap<String, String>, String> {
    let mut out = HashMap::new();
    for kv in uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
    {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        match (decode(k), decode(v)) {
            (Some(k), Some(v)) => {
                out.insert(k, v);
            }
            _ => return Err(kv.to_owned()),
        }
    }
    Ok(out)
}

#[derive(Serialize)]
struct Row {
    name: String,
    floor: f64,
    weight: f64,
    share: f64,
    ceiling: f64,
    used: f64,
    borrowed: f64,
    in_flight: f64,
    budgets: Vec<BudgetUse>,
    refused: HashMap<&'static str, u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    instances: Option<Vec<Row>>,
}

impl Row {
    /// Every caller the policy does not list: their refusals only.
    fn others(refused: HashMap<&'static str, u64>) -> Row {
        Row {
            name: "other".to_owned(),
            floor: 0.0,
            weight: 0.0,
            share: 0.0,
            ceiling: 0.0,
            used: 0.0,
            borrowed: 0.0,
            in_flight: 0.0,
            budgets: Vec::new(),
            refused,
            instances: None,
        }
    }
}

#[derive(Serialize)]
struct ToolView {
    name: String,
    unit: &'static str,
    capacity: f64,
    period: String,
    used: f64,
    in_flight: f64,
    budgets: Vec<BudgetUse>,
    window_ends_in_ms: u64,
    tenants: Vec<Row>,
    /// The busiest unlisted tenants and instances (a bounded top-K; see `telemetry::busiest`).
    busiest: Busy,
    /// The policy this replica enforces for the tool, and whether the replicas sharing its
    /// store agree.
    policy: PolicyView,
}

#[derive(Serialize)]
struct PolicyView {
    /// This replica's fingerprint of the tool's policy, in hex.
    fingerprint: String,
    /// When the replicas sharing the store enforce different policies for the tool: each
    /// fingerprint (`null`: replicas without the tool) with how many replicas, for how long
    /// (s), and whether that is past the grace time of a rolling reload.
    #[serde(skip_serializing_if = "Option::is_none")]
    disagreement: Option<DisagreementView>,
}

#[derive(Serialize)]
struct DisagreementView {
    replicas: Vec<(Option<String>, usize)>,
    for_secs: u64,
    past_grace: bool,
}

impl PolicyView {
    fn of(tp: &ToolPolicy, disagreements: &[crate::store::PolicyDisagreement]) -> Self {
        PolicyView {
            fingerprint: format!("{:016x}", tp.fingerprint()),
            disagreement: disagreements.iter().find(|d| d.tool == tp.name()).map(|d| {
                DisagreementView {
                    replicas: d
                        .replicas
                        .iter()
                        .map(|(f, n)| (f.map(|f| format!("{f:016x}")), *n))
                        .collect(),
                    for_secs: d.for_how_long.as_secs(),
                    past_grace: d.past_grace,
                }
            }),
        }
    }
}

#[derive(Serialize)]
struct Busy {
    tenants: Vec<crate::telemetry::busiest::BusyCaller>,
    instances: Vec<crate::telemetry::busiest::BusyCaller>,
}

#[derive(Serialize)]
struct StateView {
    at: String,
    tools: Vec<ToolView>,
}

/// What a stored state says was used in the window that holds `now`, and of each budget.
fn used_now(
    s: &crate::admission::engine::NodeState,
    window: f64,
    now: Timestamp,
    budgets: &[crate::policy::Budget],
) -> (f64, Vec<BudgetUse>) {
    let used = if s.live && s.window == window {
        s.total
    } else {
        0.0
    };
    (used, budget_use(s, now, budgets))
}

/// What a stored state says was spent of each budget in its window that holds `now`.
fn budget_use(
    s: &crate::admission::engine::NodeState,
    now: Timestamp,
    budgets: &[crate::policy::Budget],
) -> Vec<BudgetUse> {
    budgets
        .iter()
        .map(|b| {
            let start = b.period.window(now).0.as_micros() as f64;
            BudgetUse {
                period: b.period.as_str(),
                max: b.max,
                used: s.budgets.used_in(b.period, start),
            }
        })
        .collect()
}

impl<S: Store, C: Clock> Console<S, C> {
    /// The refusals kept for `tenant` of `tool`, newest first (at most [`RECENT_REFUSALS`]).
    /// A tenant the policy lists is asked by its name; any other name gives those of every
    /// caller the policy does not list (`other`), never one caller's by its own name.
    pub fn recent_refusals(&self, tool: &str, tenant: &str) -> Vec<RecentRefusal> {
        let policy = self.limiter.policy();
        let known = policy
            .tool(tool)
            .and_then(|tp| listed(tp.tenant(tenant)))
            .is_some();
        self.limiter
            .recorder()
            .recent(tool, known.then_some(tenant))
    }

    async fn state(&self, q: &HashMap<String, String>) -> Result<StateView, crate::StoreError> {
        let policy = self.limiter.policy();
        let now = self.limiter.clock().now();
        let allocation = policy.allocation();
        let mut tools = Vec::new();
        for tp in policy.tools() {
            if q.get("tool").is_some_and(|t| t != tp.name()) {
                continue;
            }
            let Some(alloc) = allocation.tools.iter().find(|a| a.name == tp.name()) else {
                continue;
            };
            tools.push(self.tool_view(tp, alloc, q, now).await?);
        }
        Ok(StateView {
            at: now.to_rfc3339(),
            tools,
        })
    }

    /// One tool of the state: its use, each listed tenant's row (with its instances when the
    /// query opens it), `other`'s refusals, and its busiest unlisted callers.
    async fn tool_view(
        &self,
        tp: &ToolPolicy,
        alloc: &crate::policy::ToolAllocation,
        q: &HashMap<String, String>,
        now: Timestamp,
    ) -> Result<ToolView, crate::StoreError> {
        let limiter = &self.limiter;
        let period = tp.period().as_micros();
        let window =
            crate::admission::engine::aligned_window(now.as_micros() as f64, period as f64);
        let mut tool_state = None;
        let mut tenants = Vec::new();
        for t in tp.tenants() {
            let Some(ta) = alloc.tenants.iter().find(|a| a.name == t.name()) else {
                continue;
            };
            let (row, tool) = self.tenant_row(tp, t, ta, q, window, now).await?;
            tool_state = tool.or(tool_state);
            tenants.push(row);
        }
        // Every caller the policy does not list, refusals only (no state is read for
        // names the policy does not know).
        let counts = limiter.recorder().counts(tp.name(), None);
        if counts.iter().any(|n| *n > 0) {
            tenants.push(Row::others(by_reason(counts)));
        }
        if tp.tenants().is_empty() {
            let keys = keys_of(tp, &Arc::from(""), None);
            tool_state = limiter.store().inspect_at(&keys, now).await?[0];
        }
        let tool_state = tool_state.unwrap_or_default();
        let (used, budgets) = used_now(&tool_state, window, now, &tp.budgets);
        let [busy_tenants, busy_instances] = limiter.busiest(tp.name());
        Ok(ToolView {
            name: tp.name().to_owned(),
            unit: tp.unit().as_str(),
            capacity: tp.capacity(),
            period: tp.period().to_string(),
            used,
            in_flight: tool_state.in_flight,
            budgets,
            window_ends_in_ms: (period - now.as_micros() % period) / 1000,
            tenants,
            busiest: Busy {
                tenants: busy_tenants,
                instances: busy_instances,
            },
            policy: PolicyView::of(tp, &limiter.store().policy_disagreements()),
        })
    }

    /// The row of listed tenant `t` (its instances too when the query names it), and the
    /// tool's state as read with it.
    async fn tenant_row(
        &self,
        tp: &ToolPolicy,
        t: &crate::policy::LevelPolicy,
        ta: &crate::policy::TenantAllocation,
        q: &HashMap<String, String>,
        window: f64,
        now: Timestamp,
    ) -> Result<(Row, Option<crate::admission::engine::NodeState>), crate::StoreError> {
        let limiter = &self.limiter;
        let keys = keys_of(tp, &t.name, None);
        let states = limiter.store().inspect_at(&keys, now).await?;
        let s = states[1].unwrap_or_default();
        let (used, budgets) = used_now(&s, window, now, &t.budgets);
        let counts = limiter.recorder().counts(tp.name(), Some(t.name()));
        let instances = match q.get("tenant").is_some_and(|x| x == t.name()) {
            true => Some(self.instance_rows(tp, t, ta, window, now).await?),
            false => None,
        };
        let row = Row {
            name: t.name.to_string(),
            floor: ta.floor,
            weight: ta.weight,
            share: ta.share,
            ceiling: ta.ceiling,
            used,
            borrowed: (used - ta.floor - ta.share).max(0.0),
            in_flight: s.in_flight,
            budgets,
            refused: by_reason(counts),
            instances,
        };
        Ok((row, states[0]))
    }

    /// The rows of tenant `t`'s listed instances.
    async fn instance_rows(
        &self,
        tp: &ToolPolicy,
        t: &crate::policy::LevelPolicy,
        ta: &crate::policy::TenantAllocation,
        window: f64,
        now: Timestamp,
    ) -> Result<Vec<Row>, crate::StoreError> {
        let mut rows = Vec::new();
        for i in t.instances() {
            let Some(ia) = ta.instances.iter().find(|a| a.name == i.name()) else {
                continue;
            };
            let keys = keys_of(tp, &t.name, Some(&i.name));
            let s = self.limiter.store().inspect_at(&keys, now).await?[2].unwrap_or_default();
            let (used, budgets) = used_now(&s, window, now, &i.budgets);
            rows.push(Row {
                name: i.name.to_string(),
                floor: ia.floor,
                weight: ia.weight,
                share: ia.share,
                ceiling: ia.ceiling,
                used,
                borrowed: (used - ia.floor - ia.share).max(0.0),
                in_flight: s.in_flight,
                budgets,
                refused: HashMap::new(),
                instances: None,
            });
        }
        Ok(rows)
    }

    /// The caller, tool and cost an `explain` query asks about, resolved as a call would be:
    /// from `api_key=` through the key resolver, or from `tenant=`, `instance=`, `tier=` and
    /// `plan=`. A question that leaves out what the answer depends on (the tier of a tool that
    /// admits only some tiers, the plan of an unlisted tenant of a tool with plans) is
    /// answered with what to add, not for a different caller.
    fn question<'q>(
        &self,
        q: &'q HashMap<String, String>,
    ) -> Result<(Caller, &'q str, Cost), Reply> {
        let Some(tool) = q.get("tool") else {
            return Err(problem(
                StatusCode::BAD_REQUEST,
                "explain needs ?tool=NAME (and api_key=, or tenant=, instance=, tier=; cost=)",
            ));
        };
        let cost = match q.get("cost").map(|c| c.parse::<f64>()) {
            None => Cost::default(),
            Some(Ok(c)) => Cost(c),
            Some(Err(_)) => return Err(problem(StatusCode::BAD_REQUEST, "cost must be a number")),
        };
        if let Some(key) = q.get("api_key") {
            let Some(resolve) = &self.keys else {
                return Err(problem(
                    StatusCode::BAD_REQUEST,
                    "this console does not resolve API keys: ask with tenant=, instance= and tier=",
                ));
            };
            return match resolve(key) {
                Some(caller) => Ok((caller, tool, cost)),
                None => Err(problem(StatusCode::NOT_FOUND, "no caller has this API key")),
            };
        }
        let mut caller = match q.get("tenant") {
            Some(t) => Caller::new(t.as_str()),
            None => Caller::untenanted(),
        };
        if let Some(i) = q.get("instance") {
            caller = caller.with_instance(i.as_str());
        }
        let policy = self.limiter.policy();
        let tp = policy.tool(tool);
        match q.get("tier") {
            Some(t) => caller = caller.with_tier(t.as_str()),
            None => {
                if let Some(tiers) = tp.map(|tp| tp.tiers()).filter(|t| !t.is_empty()) {
                    return Err(problem(
                        StatusCode::BAD_REQUEST,
                        &format!(
                            "tool `{}` admits only callers of tier {}: the answer depends on the caller's tier; add tier= (or api_key=)",
                            crate::admission::echoed(tool),
                            tiers.iter().map(|t| format!("`{t}`")).collect::<Vec<_>>().join(" or ")
                        ),
                    ));
                }
            }
        }
        match q.get("plan") {
            Some(p) => caller = caller.with_plan(p.as_str()),
            None => {
                // An unlisted tenant's template is its plan's (an untenanted caller has none).
                let unlisted = |tp: &crate::policy::ToolPolicy| {
                    caller
                        .tenant()
                        .and_then(|t| tp.tenant(t))
                        .is_some_and(|p| p.template)
                };
                if let Some(tp) = tp.filter(|tp| tp.plans().next().is_some() && unlisted(tp)) {
                    let plans: Vec<String> = tp.plans().map(|(n, _)| format!("`{n}`")).collect();
                    return Err(problem(
                        StatusCode::BAD_REQUEST,
                        &format!(
                            "tool `{}` governs unlisted tenants by plan ({}): the answer depends on the caller's plan; add plan= (or api_key=)",
                            crate::admission::echoed(tool),
                            plans.join(", ")
                        ),
                    ));
                }
            }
        }
        Ok((caller, tool, cost))
    }

    async fn answer(self, method: Method, uri: http::Uri) -> Reply {
        if method != Method::GET && method != Method::HEAD {
            return problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "the console is read-only: GET",
            );
        }
        let path = uri.path().trim_end_matches('/');
        let last = path.rsplit('/').next().unwrap_or("");
        let q = match query(&uri) {
            Ok(q) => q,
            Err(bad) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    &format!("the query parameter `{bad}` is not valid percent-encoded UTF-8"),
                )
            }
        };
        match last {
            "state" => match self.state(&q).await {
                Ok(v) => json(&v),
                Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
            },
            "explain" => {
                let (caller, tool, cost) = match self.question(&q) {
                    Ok(question) => question,
                    Err(reply) => return reply,
                };
                match self.limiter.explain(&caller, tool, cost).await {
                    Ok(e) => json(&e),
                    Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
                }
            }
            "refusals" => {
                let (Some(tool), Some(tenant)) = (q.get("tool"), q.get("tenant")) else {
                    return problem(
                        StatusCode::BAD_REQUEST,
                        "refusals needs ?tool=NAME&tenant=NAME",
                    );
                };
                json(&self.recent_refusals(tool, tenant))
            }
            _ => reply(StatusCode::OK, "text/html; charset=utf-8", PAGE.to_owned()),
        }
    }
}

fn keys_of(tp: &ToolPolicy, tenant: &Arc<str>, instance: Option<&Arc<str>>) -> CallKeys {
    CallKeys {
        tool: tp.name_arc().into(),
        group: tp.key_group().cloned(),
        tenant: tenant.into(),
        instance: instance.map(Into::into),
        untenanted: false,
    }
}

impl<S, C, B> Service<Request<B>> for Console<S, C>
where
    S: Store,
    C: Clock,
{
    type Response = Response<String>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Reply, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let this = self.clone();
        let (method, uri) = (req.method().clone(), req.uri().clone());
        Box::pin(async move { Ok(this.answer(method, uri).await) })
    }
}

/// The page: polls `state` (relative to where the console is mounted) every second.
const PAGE: &str = include_str!("console.html");
