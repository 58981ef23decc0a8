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
//! ([`Store::inspect`]) and `explain` runs the same decision as
//! [`Limiter::admit`] on what it read, without writing it back.
//!
//! Refusals are counted (by tool, tenant and reason) and kept (the last
//! [`RECENT_REFUSALS`] per tenant) from the moment the first console is made, so make it at
//! start-up if its counts should match `fairshare_decisions_total`. Tenants are named as the
//! metrics name them: a tenant the policy lists by its name, every other caller `other` —
//! never by a name a request made up.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use serde::Serialize;
use tower_service::Service;

use crate::admission::{Reason, Refusal};
use crate::clock::{Clock, Timestamp};
use crate::identity::{Caller, Cost};
use crate::limiter::Limiter;
use crate::policy::{LevelPolicy, Policy, ToolPolicy};
use crate::store::{CallKeys, Store};

/// How many recent refusals the console keeps per tenant (per tool).
pub const RECENT_REFUSALS: usize = 64;

/// Every reason, in the order the console counts them.
const REASONS: [Reason; 6] = [
    Reason::RateLimited,
    Reason::CapExceeded,
    Reason::ConcurrencyExceeded,
    Reason::PermissionDenied,
    Reason::UnidentifiedCaller,
    Reason::StoreUnavailable,
];

fn reason_index(r: Reason) -> usize {
    REASONS.iter().position(|x| *x == r).unwrap_or(0)
}

/// The name a tenant or instance goes by on the console: its own if the policy lists it,
/// `other` otherwise.
fn label(p: Option<&LevelPolicy>) -> Arc<str> {
    match p {
        Some(p) if !p.template => p.name.clone(),
        _ => Arc::from("other"),
    }
}

/// One refusal as the console keeps it.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[non_exhaustive]
pub struct RecentRefusal {
    /// When (RFC 3339).
    pub at: String,
    /// The instance, as the console names it (listed name, `other` or `none`).
    pub instance: String,
    /// Why (`rate_limited`, `cap_exceeded`, ...).
    pub reason: &'static str,
    /// The level that refused (`tool`, `tenant`, `instance`), if one did.
    pub scope: Option<&'static str>,
    /// The window of the limit (`1m`, `day`, `in_flight`, ...).
    pub window: Option<String>,
    /// The limit that was reached.
    pub limit: Option<f64>,
    /// What was used of it.
    pub used: Option<f64>,
    /// How long the caller was asked to wait, ms.
    pub retry_after_ms: Option<u64>,
    /// The earliest time the call could have passed (RFC 3339), when it could.
    pub earliest: Option<String>,
}

#[derive(Default)]
struct Tally {
    by_reason: [u64; REASONS.len()],
    recent: VecDeque<RecentRefusal>,
}

/// Tallies by (tool, tenant as the console names it): names from the policy, so as many as
/// it lists (plus `other` per tool).
type Tallies = HashMap<(Arc<str>, Arc<str>), Tally>;

/// Refusals counted and kept for the console (off until a console is made).
#[derive(Default)]
pub(crate) struct Recorder {
    on: AtomicBool,
    tallies: Mutex<Tallies>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("on", &self.on.load(Ordering::Relaxed))
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Recorder {
    pub(crate) fn start(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    /// Counts and keeps a refusal of `caller` calling `tool` at `now` (a tool the policy
    /// does not know is not kept: it has no page).
    #[inline]
    pub(crate) fn refused(
        &self,
        policy: &Policy,
        caller: &Caller,
        tool: &str,
        r: &Refusal,
        now: impl FnOnce() -> Timestamp,
    ) {
        if self.on.load(Ordering::Relaxed) {
            self.keep(policy, caller, tool, r, now());
        }
    }

    fn keep(&self, policy: &Policy, caller: &Caller, tool: &str, r: &Refusal, at: Timestamp) {
        let Some(tp) = policy.tool(tool) else { return };
        let tenant_policy = caller.tenant().and_then(|t| tp.tenant(t));
        let tenant = label(tenant_policy);
        let instance = match (tenant_policy, caller.instance()) {
            (_, None) => "none".to_owned(),
            (Some(p), Some(i)) if p.has_instances() => label(p.instance(i)).to_string(),
            _ => "other".to_owned(),
        };
        let entry = RecentRefusal {
            at: at.to_rfc3339(),
            instance,
            reason: r.reason.as_str(),
            scope: r.scope.map(|s| s.as_str()),
            window: r.window.clone(),
            limit: r.limit,
            used: r.used,
            retry_after_ms: r.retry_after.map(|d| d.as_millis() as u64),
            earliest: r.retry_after.map(|d| at.saturating_add(d).to_rfc3339()),
        };
        let mut tallies = lock(&self.tallies);
        let t = tallies.entry((tp.name_arc().clone(), tenant)).or_default();
        t.by_reason[reason_index(r.reason)] += 1;
        if t.recent.len() == RECENT_REFUSALS {
            t.recent.pop_back();
        }
        t.recent.push_front(entry);
    }

    fn counts(&self, tool: &str, tenant: &str) -> [u64; REASONS.len()] {
        lock(&self.tallies)
            .iter()
            .find(|((tl, tn), _)| &**tl == tool && &**tn == tenant)
            .map_or([0; REASONS.len()], |(_, t)| t.by_reason)
    }

    fn recent(&self, tool: &str, tenant: &str) -> Vec<RecentRefusal> {
        lock(&self.tallies)
            .iter()
            .find(|((tl, tn), _)| &**tl == tool && &**tn == tenant)
            .map_or_else(Vec::new, |(_, t)| t.recent.iter().cloned().collect())
    }
}

/// One level of a call as the decision sees it now: for [`Explanation`].
#[derive(Clone, Debug, Serialize, PartialEq)]
#[non_exhaustive]
pub struct LevelFigures {
    /// `tool`, `tenant` or `instance`.
    pub level: &'static str,
    /// Its limit per period: the tool's capacity, a caller's ceiling.
    pub limit: f64,
    /// Units through it in the current aligned window.
    pub used: f64,
    /// Its floor per period (reserved for it, never lent).
    pub floor: f64,
    /// Its nominal share of its parent's spare capacity, with the template callers counted now.
    pub share: f64,
    /// Units above its floor it could pass now: for the tool, the pool left to lend.
    pub slack: f64,
}

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
    /// Whether the call would be admitted now.
    pub admitted: bool,
    /// Why not (`rate_limited`, `cap_exceeded`, ...).
    pub reason: Option<&'static str>,
    /// The level that would refuse it: the binding limit.
    pub binding: Option<&'static str>,
    /// The limit that binds, its window and what is used of it.
    pub limit: Option<f64>,
    /// What is used of the binding limit.
    pub used: Option<f64>,
    /// The window of the binding limit.
    pub window: Option<String>,
    /// How long until it could pass, ms (0 when admitted now).
    pub retry_after_ms: Option<u64>,
    /// The earliest time it could pass (RFC 3339).
    pub earliest: Option<String>,
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
    pub async fn explain(
        &self,
        caller: &Caller,
        tool: &str,
        cost: Cost,
    ) -> Result<Explanation, crate::StoreError> {
        let policy = self.policy();
        let mut out = Explanation {
            tool: tool.to_owned(),
            tenant: caller.tenant().map(str::to_owned),
            instance: caller.instance().map(str::to_owned),
            cost: cost.0,
            at: String::new(),
            admitted: false,
            reason: None,
            binding: None,
            limit: None,
            used: None,
            window: None,
            retry_after_ms: None,
            earliest: None,
            levels: Vec::new(),
            refusal: None,
        };
        let (now, verdict, levels) = match self.prepared(&policy, caller, tool, cost) {
            Err(r) => (self.clock().now(), Err(r), Vec::new()),
            Ok((plan, keys)) => {
                let states = self.store().inspect(&keys).await?;
                let snap = crate::admission::engine::Snapshot {
                    tool: states[0].unwrap_or_default(),
                    tenant: states[1].unwrap_or_default(),
                    instance: states[2].unwrap_or_default(),
                };
                let e = crate::admission::engine::explain(&plan, &snap);
                (plan.now, e.verdict, e.levels)
            }
        };
        out.at = now.to_rfc3339();
        out.levels = levels;
        match verdict {
            Ok(()) => {
                out.admitted = true;
                out.retry_after_ms = Some(0);
                out.earliest = Some(out.at.clone());
            }
            Err(r) => {
                out.reason = Some(r.reason.as_str());
                out.binding = r.scope.map(|s| s.as_str());
                out.limit = r.limit;
                out.used = r.used;
                out.window = r.window.clone();
                out.retry_after_ms = r.retry_after.map(|d| d.as_millis() as u64);
                out.earliest = r.retry_after.map(|d| now.saturating_add(d).to_rfc3339());
                out.refusal = Some(*r);
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
        }
    }
}

/// The operator's console service ([`Limiter::console`]).
#[derive(Debug)]
pub struct Console<S, C> {
    limiter: Limiter<S, C>,
}

impl<S, C> Clone for Console<S, C> {
    fn clone(&self) -> Self {
        Console {
            limiter: self.limiter.clone(),
        }
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

/// `%XX` and `+` decoded; `None` if it is not UTF-8 afterwards.
fn decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

fn query(uri: &http::Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            Some((decode(k)?, decode(v)?))
        })
        .filter(|(k, _)| !k.is_empty())
        .collect()
}

#[derive(Serialize)]
struct BudgetUse {
    period: &'static str,
    max: f64,
    used: f64,
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

#[derive(Serialize)]
struct ToolView {
    name: String,
    unit: &'static str,
    capacity: f64,
    period: String,
    used: f64,
    window_ends_in_ms: u64,
    tenants: Vec<Row>,
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
    let b = budgets
        .iter()
        .map(|b| {
            let start = b.period.window(now).0.as_micros() as f64;
            BudgetUse {
                period: b.period.as_str(),
                max: b.max,
                used: s
                    .budgets
                    .iter()
                    .find(|c| c.period == b.period && c.start == start)
                    .map_or(0.0, |c| c.used),
            }
        })
        .collect();
    (used, b)
}

impl<S: Store, C: Clock> Console<S, C> {
    async fn state(&self, q: &HashMap<String, String>) -> Result<StateView, crate::StoreError> {
        let limiter = &self.limiter;
        let policy = limiter.policy();
        let now = limiter.clock().now();
        let allocation = policy.allocation();
        let mut tools = Vec::new();
        for tp in policy.tools() {
            if q.get("tool").is_some_and(|t| t != tp.name()) {
                continue;
            }
            let Some(alloc) = allocation.tools.iter().find(|a| a.name == tp.name()) else {
                continue;
            };
            let period = tp.period().as_micros();
            let window = (now.as_micros() / period) as f64;
            let mut tool_used = 0.0;
            let mut tenants = Vec::new();
            for t in tp.tenants() {
                let Some(ta) = alloc.tenants.iter().find(|a| a.name == t.name()) else {
                    continue;
                };
                let keys = keys_of(tp, &t.name, None);
                let states = limiter.store().inspect(&keys).await?;
                if let Some(s) = &states[0] {
                    tool_used = used_now(s, window, now, &tp.budgets).0;
                }
                let s = states[1].unwrap_or_default();
                let (used, budgets) = used_now(&s, window, now, &t.budgets);
                let counts = limiter.recorder().counts(tp.name(), t.name());
                let instances = if q.get("tenant").is_some_and(|x| x == t.name()) {
                    let mut rows = Vec::new();
                    for i in t.instances() {
                        let Some(ia) = ta.instances.iter().find(|a| a.name == i.name()) else {
                            continue;
                        };
                        let keys = keys_of(tp, &t.name, Some(&i.name));
                        let s = limiter.store().inspect(&keys).await?[2].unwrap_or_default();
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
                    Some(rows)
                } else {
                    None
                };
                tenants.push(Row {
                    name: t.name.to_string(),
                    floor: ta.floor,
                    weight: ta.weight,
                    share: ta.share,
                    ceiling: ta.ceiling,
                    used,
                    borrowed: (used - ta.floor - ta.share).max(0.0),
                    in_flight: s.in_flight,
                    budgets,
                    refused: REASONS
                        .iter()
                        .zip(counts)
                        .filter(|(_, n)| *n > 0)
                        .map(|(r, n)| (r.as_str(), n))
                        .collect(),
                    instances,
                });
            }
            // Every caller the policy does not list, refusals only (no state is read for
            // names the policy does not know).
            let counts = limiter.recorder().counts(tp.name(), "other");
            if counts.iter().any(|n| *n > 0) {
                tenants.push(Row {
                    name: "other".to_owned(),
                    floor: 0.0,
                    weight: 0.0,
                    share: 0.0,
                    ceiling: 0.0,
                    used: 0.0,
                    borrowed: 0.0,
                    in_flight: 0.0,
                    budgets: Vec::new(),
                    refused: REASONS
                        .iter()
                        .zip(counts)
                        .filter(|(_, n)| *n > 0)
                        .map(|(r, n)| (r.as_str(), n))
                        .collect(),
                    instances: None,
                });
            }
            if tp.tenants().is_empty() {
                let keys = keys_of(tp, &Arc::from(""), None);
                if let Some(s) = &limiter.store().inspect(&keys).await?[0] {
                    tool_used = used_now(s, window, now, &tp.budgets).0;
                }
            }
            tools.push(ToolView {
                name: tp.name().to_owned(),
                unit: tp.unit().as_str(),
                capacity: tp.capacity(),
                period: tp.period().to_string(),
                used: tool_used,
                window_ends_in_ms: (period - now.as_micros() % period) / 1000,
                tenants,
            });
        }
        Ok(StateView {
            at: now.to_rfc3339(),
            tools,
        })
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
        let q = query(&uri);
        match last {
            "state" => match self.state(&q).await {
                Ok(v) => json(&v),
                Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
            },
            "explain" => {
                let Some(tool) = q.get("tool") else {
                    return problem(
                        StatusCode::BAD_REQUEST,
                        "explain needs ?tool=NAME (and tenant=, instance=, cost=)",
                    );
                };
                let mut caller = match q.get("tenant") {
                    Some(t) => Caller::new(t.as_str()),
                    None => Caller::untenanted(),
                };
                if let Some(i) = q.get("instance") {
                    caller = caller.with_instance(i.as_str());
                }
                if let Some(t) = q.get("tier") {
                    caller = caller.with_tier(t.as_str());
                }
                let cost = match q.get("cost").map(|c| c.parse::<f64>()) {
                    None => Cost::default(),
                    Some(Ok(c)) => Cost(c),
                    Some(Err(_)) => {
                        return problem(StatusCode::BAD_REQUEST, "cost must be a number")
                    }
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
                // Only names the console uses: a listed tenant or `other`.
                let policy = self.limiter.policy();
                let known = policy
                    .tool(tool)
                    .and_then(|tp| tp.tenant(tenant))
                    .is_some_and(|p| !p.template);
                let name = if known { tenant.as_str() } else { "other" };
                json(&self.limiter.recorder().recent(tool, name))
            }
            _ => reply(StatusCode::OK, "text/html; charset=utf-8", PAGE.to_owned()),
        }
    }
}

fn keys_of(tp: &ToolPolicy, tenant: &Arc<str>, instance: Option<&Arc<str>>) -> CallKeys {
    CallKeys {
        tool: tp.name_arc().clone(),
        tenant: tenant.clone(),
        instance: instance.cloned(),
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
