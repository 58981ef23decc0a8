//! What an exact in-memory decision costs at the least, for the targets to be read against:
//! a sketch of one, written for speed and nothing else, timed beside governor and the crate in
//! `benches/compare.rs` (`floor/sketch *`, and `layer/sketch admitted` behind a minimal layer,
//! [`SketchService`]).
//!
//! The sketch decides a call of one caller (a tenant and an instance) on a tool with three
//! levels and a daily budget, as `decision/fairshare 1 caller` does: one hash of the call's
//! names finds its state in a sharded table; each level has a floor, a share and a ceiling
//! bucket refilled by multiplications; the walk from the instance up to the tool draws the
//! call (share first); the tool's part is done under the tool's lock; the answer is a new
//! record shared with the ticket. That is [`Sketch::bare`].
//!
//! [`Sketch::with_work`] adds what the crate does for every admitted call besides: the
//! tool found by name and the tenant's policy among listed tenants; template tenants and
//! instances counted per window; concurrency caps checked; the levels' numbers (cached, with
//! their reciprocals, as if computed only when a template count changed); the charge of each
//! level kept for settling and refunding; the figures the RateLimit headers show; when each
//! state may be forgotten, worked out exactly; the call's names kept in the answer.
//!
//! Neither does what the crate also does: the future `admit` returns, remembered refusals,
//! the floor-first walk when share first fails, borrowing banks, budgets of other periods,
//! tracing, packing states to their non-zero numbers (the memory target), reloading policies.
//! The sketch is not the crate's engine and shares no code with it: it measures what the
//! product's arithmetic costs when nothing else is in the way.

// Each bench that includes it uses a part of it.
#![allow(dead_code)]

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};

use tower_fairshare::{Clock, SystemClock};

const EPS: f64 = 1e-9;
const SHARDS: usize = 16;
const DAY_US: u64 = 86_400_000_000;

/// A bucket: its rate per µs, depth, and µs per unit (the reciprocal, for expiries).
#[derive(Clone, Copy, Default)]
struct Bucket {
    per_us: f64,
    depth: f64,
    us_per: f64,
}

impl Bucket {
    fn new(rate: f64, depth: f64, period: f64) -> Self {
        let rate = rate.max(0.0);
        Bucket {
            per_us: rate / period,
            depth: if rate > 0.0 { depth } else { 0.0 },
            us_per: if rate > 0.0 { period / rate } else { 0.0 },
        }
    }
}

/// A level's numbers: its three buckets, floor, ceiling and borrowing bar.
#[derive(Clone, Copy, Default)]
struct Numbers {
    floor_b: Bucket,
    share_b: Bucket,
    ceil_b: Bucket,
    floor: f64,
    share: f64,
    ceiling: f64,
    ceiling_rate: f64,
    threshold: f64,
}

/// A level's policy.
#[derive(Clone, Copy)]
struct LevelPolicy {
    weight: f64,
    floor: f64,
    burst: f64,
    max_concurrency: Option<u32>,
}

impl LevelPolicy {
    /// Its numbers with `spare` shared by `total_weight`.
    fn numbers(&self, spare: f64, total_weight: f64, period: f64) -> Numbers {
        let share = if total_weight > 0.0 {
            spare * self.weight / total_weight
        } else {
            0.0
        };
        let ceiling = self.floor + share;
        let ceiling_rate = (ceiling - self.floor).max(0.0);
        Numbers {
            floor_b: Bucket::new(self.floor, self.floor, period),
            share_b: Bucket::new(share, self.burst, period),
            ceil_b: Bucket::new(ceiling_rate, self.burst, period),
            floor: self.floor,
            share,
            ceiling,
            ceiling_rate,
            threshold: 0.5,
        }
    }
}

/// A level's state.
#[derive(Clone, Copy, Default)]
struct State {
    live: bool,
    t: f64,
    floor: f64,
    share: f64,
    ceiling: f64,
    window: f64,
    total: f64,
    non_floor: f64,
    floor_used: f64,
    in_flight: f64,
    /// Template children: the window counted, admitted in it, counted.
    children_window: f64,
    children_in_window: f64,
    children_counted: f64,
    budget_start: f64,
    budget_used: f64,
}

impl State {
    #[inline(always)]
    fn refill(&mut self, n: &Numbers, now: f64, window: f64) {
        if !self.live {
            self.live = true;
            self.t = now;
            self.floor = n.floor_b.depth;
            self.share = n.share_b.depth;
            self.ceiling = n.ceil_b.depth;
        } else {
            let dt = (now - self.t).max(0.0);
            self.floor = (self.floor + dt * n.floor_b.per_us).min(n.floor_b.depth);
            self.share = (self.share + dt * n.share_b.per_us).min(n.share_b.depth);
            self.ceiling = (self.ceiling + dt * n.ceil_b.per_us).min(n.ceil_b.depth);
            self.t = self.t.max(now);
        }
        if self.window != window {
            self.window = window;
            self.total = 0.0;
            self.non_floor = 0.0;
            self.floor_used = 0.0;
        }
    }

    /// This level's part of the walk for `rem` units: (floor, share, ceiling), or `None`.
    #[inline(always)]
    fn draw(
        &self,
        n: &Numbers,
        rem: &mut f64,
        own: &mut bool,
        bar: f64,
        tool: bool,
    ) -> Option<[f64; 3]> {
        let mut take = [0.0; 3];
        if n.floor > 0.0 {
            let covered = self.share.min(self.ceiling).min(*rem).max(0.0);
            let x = (*rem - covered)
                .min(self.floor)
                .min(n.floor - self.floor_used)
                .max(0.0);
            take[0] = x;
            *rem -= x;
            if *rem <= EPS {
                return Some(take);
            }
        }
        let need = *rem + if *own { 0.0 } else { bar };
        let cap = if tool { n.ceiling_rate } else { f64::INFINITY };
        if !(self.ceiling + EPS >= need && self.non_floor + *rem <= cap + EPS) {
            return None;
        }
        take[2] = *rem;
        if self.share + EPS >= *rem {
            take[1] = *rem;
        } else {
            *own = false;
        }
        *rem = 0.0;
        Some(take)
    }

    #[inline(always)]
    fn commit(&mut self, take: [f64; 3], cost: f64) {
        self.floor -= take[0];
        self.share -= take[1];
        self.ceiling -= take[2];
        self.total += cost;
        self.non_floor += take[2];
        self.floor_used += take[0];
    }

    /// When the state is a fresh one again (µs).
    #[inline(always)]
    fn expiry(&self, n: &Numbers, now: f64, period: f64, next_window: f64) -> f64 {
        let mut at = now;
        for (x, b) in [
            (self.floor, &n.floor_b),
            (self.share, &n.share_b),
            (self.ceiling, &n.ceil_b),
        ] {
            if b.per_us > 0.0 && x < b.depth {
                at = at.max(now + (b.depth - x) * b.us_per);
            }
        }
        if self.total > 0.0 {
            at = at.max(next_window);
        }
        if self.budget_used > 0.0 {
            at = at.max(self.budget_start + DAY_US as f64);
        }
        if self.children_in_window > 0.0 {
            at = at.max((self.children_window + 2.0) * period);
        }
        at
    }

    /// Counts a template child last admitted in `child_window` at window `k`.
    #[inline(always)]
    fn count_child(&mut self, child_window: f64, k: f64) {
        if self.children_window != k {
            let carried = if self.children_window == k - 1.0 {
                self.children_in_window
            } else {
                0.0
            };
            self.children_window = k;
            self.children_in_window = 0.0;
            self.children_counted = carried;
        }
        if child_window != k {
            self.children_in_window += 1.0;
            if child_window != k - 1.0 {
                self.children_counted += 1.0;
            }
        }
    }
}

fn micros_ceil(x: f64) -> u64 {
    let t = x.max(0.0) as i64;
    (t + i64::from((t as f64) < x)) as u64
}

struct Entry {
    tool: usize,
    tenant: Box<str>,
    instance: Box<str>,
    levels: [State; 2],
    expires: [u64; 2],
}

struct ToolCell {
    state: State,
    expires: u64,
}

struct Tool {
    name: Arc<str>,
    period: f64,
    numbers: Numbers,
    max_concurrency: Option<u32>,
    default_tenant: LevelPolicy,
    default_instance: LevelPolicy,
    listed: hashbrown::HashMap<Box<str>, LevelPolicy, foldhash::fast::FixedState>,
    budget: f64,
    /// The tenant's and the instance's numbers for the template counts they were worked out
    /// for.
    cached: [Numbers; 2],
    cell: Mutex<ToolCell>,
}

/// What an admitted call's charge records at one level.
#[derive(Clone, Copy, Default)]
struct LevelCharge {
    take: [f64; 3],
    depth: [f64; 3],
    permit: bool,
    budget_start: Option<f64>,
}

/// An admitted call's answer.
#[derive(Clone, Default)]
pub struct Answer {
    tool: Option<Arc<str>>,
    tenant: Option<Arc<str>>,
    instance: Option<Arc<str>>,
    at: f64,
    cost: f64,
    charge: [LevelCharge; 3],
    remaining: f64,
    quota: f64,
    reset_in: f64,
    slack: f64,
    views: [[f64; 4]; 2],
}

impl Answer {
    /// A number of the answer, so a bench can keep it from being optimized away.
    pub fn remaining(&self) -> f64 {
        self.remaining + self.charge[2].take[2] + self.views[1][3] + self.slack
    }
}

/// An admitted call: its answer.
pub struct Ticket(Option<Arc<Answer>>);

impl Ticket {
    pub fn answer(&self) -> &Answer {
        self.0.as_deref().expect("held until dropped")
    }
}

/// A caller: a tenant and an instance.
pub struct Who {
    pub tenant: Arc<str>,
    pub instance: Arc<str>,
}

/// A call's names, borrowed.
struct Names<'a> {
    tenant: &'a str,
    instance: &'a str,
}

/// The sketch's limiter: one tool (`search`), generous enough that every call is admitted.
pub struct Sketch {
    tools: hashbrown::HashMap<Box<str>, usize, foldhash::fast::FixedState>,
    list: Vec<Tool>,
    hasher: foldhash::fast::FixedState,
    shards: Vec<Mutex<hashbrown::HashTable<Box<Entry>>>>,
}

impl Default for Sketch {
    fn default() -> Self {
        let period = 1e6;
        let capacity = 1e12;
        let hasher = foldhash::fast::FixedState::with_seed(7);
        let template = LevelPolicy {
            weight: 1.0,
            floor: 0.0,
            burst: capacity,
            max_concurrency: None,
        };
        let mut listed = hashbrown::HashMap::with_hasher(hasher.clone());
        for k in 0..3 {
            listed.insert(format!("listed-{k}").into_boxed_str(), template);
        }
        let tenant = template.numbers(capacity, 1.0, period);
        let instance = template.numbers(tenant.ceiling, 1.0, period);
        let tool = |name: &str| Tool {
            name: name.into(),
            period,
            numbers: Numbers {
                ceil_b: Bucket::new(capacity, capacity, period),
                ceiling: capacity,
                ceiling_rate: capacity,
                ..Numbers::default()
            },
            max_concurrency: None,
            default_tenant: template,
            default_instance: template,
            listed: listed.clone(),
            budget: 1e15,
            cached: [tenant, instance],
            cell: Mutex::new(ToolCell {
                state: State::default(),
                expires: 0,
            }),
        };
        let mut tools = hashbrown::HashMap::with_hasher(hasher.clone());
        tools.insert("search".into(), 0);
        tools.insert("other".into(), 1);
        Sketch {
            tools,
            list: vec![tool("search"), tool("other")],
            hasher,
            shards: (0..SHARDS)
                .map(|_| Mutex::new(hashbrown::HashTable::new()))
                .collect(),
        }
    }
}

impl Sketch {
    /// The bare decision (see the module's notes).
    pub fn bare(&self, who: &Who, tool: &str, cost: f64) -> Option<Ticket> {
        self.decide::<false>(who, tool, cost)
    }

    /// The decision with the crate's other work on an admitted call (see the module's notes).
    pub fn with_work(&self, who: &Who, tool: &str, cost: f64) -> Option<Ticket> {
        self.decide::<true>(who, tool, cost)
    }

    #[inline(always)]
    fn decide<const WORK: bool>(&self, caller: &Who, tool: &str, cost: f64) -> Option<Ticket> {
        let who = Names {
            tenant: &caller.tenant,
            instance: &caller.instance,
        };
        let ti = if WORK {
            *self.tools.get(tool)?
        } else {
            self.list.iter().position(|t| *t.name == *tool)?
        };
        let p = &self.list[ti];
        let (t_pol, i_pol) = if WORK {
            if !(cost.is_finite() && cost >= 0.0) {
                return None;
            }
            (
                p.listed.get(who.tenant).unwrap_or(&p.default_tenant),
                &p.default_instance,
            )
        } else {
            (&p.default_tenant, &p.default_instance)
        };
        let now_us = SystemClock.now().as_micros();
        let now = now_us as f64;
        let hash_of = |tool: usize, tenant: &str, instance: &str| {
            let mut h = self.hasher.build_hasher();
            tool.hash(&mut h);
            tenant.hash(&mut h);
            instance.hash(&mut h);
            h.finish()
        };
        let hash = hash_of(ti, who.tenant, who.instance);
        let mut shard = self.shards[(hash >> 58) as usize % SHARDS]
            .lock()
            .expect("not poisoned");
        let entry = shard
            .entry(
                hash,
                |e| e.tool == ti && *e.tenant == *who.tenant && *e.instance == *who.instance,
                |e| hash_of(e.tool, &e.tenant, &e.instance),
            )
            .or_insert_with(|| {
                Box::new(Entry {
                    tool: ti,
                    tenant: who.tenant.into(),
                    instance: who.instance.into(),
                    levels: [State::default(); 2],
                    expires: [0; 2],
                })
            })
            .into_mut();
        let period = p.period;
        let window = (now / period) as i64 as f64;
        let next_window = (window + 1.0) * period;
        let [mut t, mut i] = entry.levels;
        let [tn, inn] = &p.cached;
        let window_of = |s: &State| if s.live { s.window } else { -9.0 };
        let (t_before, i_before) = (window_of(&t), window_of(&i));
        if WORK {
            t.count_child(i_before, window);
        }
        t.refill(tn, now, window);
        i.refill(inn, now, window);
        if WORK {
            for (s, cap) in [(&t, t_pol.max_concurrency), (&i, i_pol.max_concurrency)] {
                if cap.is_some_and(|c| s.in_flight + 1.0 > c as f64) {
                    return None;
                }
            }
        }
        let start = (now_us - now_us % DAY_US) as f64;
        let used = if t.budget_start == start {
            t.budget_used
        } else {
            0.0
        };
        if used + cost > p.budget + EPS {
            return None;
        }
        let (mut rem, mut own) = (cost, true);
        let i_take = i.draw(inn, &mut rem, &mut own, 0.0, false)?;
        let t_take = if rem > EPS {
            t.draw(tn, &mut rem, &mut own, inn.threshold, false)?
        } else {
            [0.0; 3]
        };
        let mut cell = p.cell.lock().expect("not poisoned");
        let mut top = cell.state;
        top.refill(&p.numbers, now, window);
        if WORK {
            if p.max_concurrency
                .is_some_and(|c| top.in_flight + 1.0 > c as f64)
            {
                return None;
            }
            top.count_child(t_before, window);
        }
        let tool_take = if rem > EPS {
            top.draw(&p.numbers, &mut rem, &mut own, tn.threshold, true)?
        } else {
            [0.0; 3]
        };
        top.commit(tool_take, cost);
        cell.expires = if WORK {
            micros_ceil(top.expiry(&p.numbers, now, period, next_window))
        } else {
            micros_ceil(next_window)
        };
        let slack = top.ceiling;
        cell.state = top;
        drop(cell);
        t.commit(t_take, cost);
        i.commit(i_take, cost);
        t.budget_start = start;
        t.budget_used = used + cost;
        entry.expires = if WORK {
            [
                micros_ceil(t.expiry(tn, now, period, next_window)),
                micros_ceil(i.expiry(inn, now, period, next_window)),
            ]
        } else {
            [micros_ceil(next_window); 2]
        };
        entry.levels = [t, i];
        drop(shard);

        let mut w = Answer {
            tool: WORK.then(|| p.name.clone()),
            tenant: Some(caller.tenant.clone()),
            instance: Some(caller.instance.clone()),
            ..Answer::default()
        };
        w.at = now;
        w.remaining = (tn.ceiling - t.total).min(inn.ceiling - i.total).max(0.0);
        w.reset_in = next_window - now;
        if WORK {
            w.cost = cost;
            let charge = |take: [f64; 3], n: &Numbers, permit: bool, budget: bool| LevelCharge {
                take,
                depth: [n.floor_b.depth, n.share_b.depth, n.ceil_b.depth],
                permit,
                budget_start: budget.then_some(start),
            };
            w.charge = [
                charge(tool_take, &p.numbers, p.max_concurrency.is_some(), false),
                charge(t_take, tn, t_pol.max_concurrency.is_some(), true),
                charge(i_take, inn, i_pol.max_concurrency.is_some(), false),
            ];
            w.quota = inn.ceiling;
            w.slack = slack;
            w.views = [
                [t_pol.weight, tn.floor, tn.share, tn.ceiling],
                [i_pol.weight, inn.floor, inn.share, inn.ceiling],
            ];
        } else {
            w.charge[2].take = i_take;
        }
        Some(Ticket(Some(Arc::new(w))))
    }
}

/// The sketch with its per-call work as a tower layer's service, as little as a layer can be:
/// the caller from the request's extensions, the tool from the path's last segment, decided
/// before the inner service runs; the ticket held until the inner service answers; a refusal
/// is an empty 429.
pub struct SketchService<S> {
    pub sketch: Arc<Sketch>,
    pub inner: S,
}

pin_project_lite::pin_project! {
    /// The inner service's future and the call's ticket.
    pub struct SketchFuture<F> {
        #[pin]
        inner: Option<F>,
        ticket: Option<Ticket>,
    }
}

impl<F, B, E> std::future::Future for SketchFuture<F>
where
    F: std::future::Future<Output = Result<http::Response<B>, E>>,
    B: Default,
{
    type Output = Result<http::Response<B>, E>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        match this.inner.as_pin_mut() {
            Some(f) => {
                let out = std::task::ready!(f.poll(cx));
                this.ticket.take();
                std::task::Poll::Ready(out)
            }
            None => {
                let mut refused = http::Response::new(B::default());
                *refused.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
                std::task::Poll::Ready(Ok(refused))
            }
        }
    }
}

impl<S, ReqB, B> tower::Service<http::Request<ReqB>> for SketchService<S>
where
    S: tower::Service<http::Request<ReqB>, Response = http::Response<B>>,
    B: Default,
{
    type Response = http::Response<B>;
    type Error = S::Error;
    type Future = SketchFuture<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqB>) -> Self::Future {
        let path = req.uri().path();
        let tool = path.rsplit('/').next().unwrap_or(path);
        let caller = req.extensions().get::<tower_fairshare::Caller>();
        // The crate's caller keeps its names behind references this sketch cannot take: a
        // copy of each (two small allocations the crate does not make).
        let ticket = caller.and_then(|c| match (c.tenant(), c.instance()) {
            (Some(t), Some(i)) => {
                let who = Who {
                    tenant: t.into(),
                    instance: i.into(),
                };
                self.sketch.decide::<true>(&who, tool, 1.0)
            }
            _ => None,
        });
        match ticket {
            Some(t) => SketchFuture {
                inner: Some(self.inner.call(req)),
                ticket: Some(t),
            },
            None => SketchFuture {
                inner: None,
                ticket: None,
            },
        }
    }
}
