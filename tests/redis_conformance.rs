//! The store conformance suite against `RedisStore` on a redis-server this test starts, and a
//! differential test: the same random calls through `MemoryStore` and `RedisStore` must give
//! identical verdicts and identical stored states (both run the one engine: the Redis store decides
//! in Rust, and its script only checks what it read is unchanged and writes).

// Needs the `redis` feature: `cargo test --features redis` (or --all-features).
#![cfg(feature = "redis")]

mod conformance;
mod support;

use std::cell::Cell;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use support::RedisServer;
/// The virtual start of the tests: 2026-01-01T00:00:00Z, aligned to every period and calendar window.
const EPOCH: tower_fairshare::Timestamp = tower_fairshare::Timestamp(1_767_225_600_000_000);
use tower_fairshare::store::RedisStore;
use tower_fairshare::{
    Caller, Cost, Limiter, ManualClock, MemoryStore, Policy, Reason, Refusal, Store, Ticket,
    Timestamp,
};

/// One redis-server per test function; every case starts from an empty key space of its own
/// (a namespace, not a flush: a store of an earlier case whose background work is still
/// running would see a flush as a lost state and put its counts back).
struct Redis {
    server: RedisServer,
    /// Every tool of the suite's policies leases.
    leased: bool,
    /// The namespace of the current case, and how many cases there were.
    case: std::sync::Mutex<(String, u64)>,
}

impl Redis {
    fn new() -> Self {
        Redis {
            server: RedisServer::start(),
            leased: false,
            case: std::sync::Mutex::new((String::new(), 0)),
        }
    }

    fn namespace(&self) -> String {
        self.case.lock().unwrap().0.clone()
    }

    fn leased() -> Self {
        Redis {
            leased: true,
            ..Redis::new()
        }
    }
}

impl conformance::Factory for Redis {
    type S = RedisStore;
    fn store(&self) -> RedisStore {
        unreachable!("a RedisStore is made inside the runtime that drives it: store_in")
    }
    fn store_in(&self, rt: &tokio::runtime::Runtime) -> RedisStore {
        let namespace = {
            let mut case = self.case.lock().unwrap();
            case.1 += 1;
            case.0 = format!("case{}:", case.1);
            case.0.clone()
        };
        rt.block_on(
            RedisStore::builder(self.server.url())
                .injected_clock()
                .namespace(namespace)
                .refusal_cache(std::env::var("FS_NO_CACHE").is_err())
                .timeout(Duration::from_secs(10))
                .connect(),
        )
        .expect("connect")
    }
    fn count_states(&self, _store: &RedisStore) -> usize {
        self.server.state_keys_in(&self.namespace())
    }
    fn expire(&self, _store: &RedisStore, now: Timestamp) {
        // The suite calls this from inside its runtime: sweep from a runtime of our own.
        let url = self.server.url();
        let namespace = self.namespace();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let store = RedisStore::builder(url)
                    .injected_clock()
                    .namespace(namespace)
                    .connect()
                    .await
                    .unwrap();
                store.sweep(now).await.unwrap();
            })
        })
        .join()
        .unwrap();
    }
    fn cases(&self) -> u32 {
        6
    }
    fn leased(&self) -> bool {
        self.leased
    }
}

suite!(Redis::new());

/// The same suite with every tool leasing, on Redis.
mod leased {
    use super::{conformance, Redis};
    use crate::suite;

    suite!(Redis::leased());
}

/// A generated policy for the differential test: two tools with every feature the engine has
/// — floors, weights, ceilings, bursts, budgets of every period, concurrency caps at every
/// level, listed and template tenants and instances, untenanted callers — and rates per
/// second, ten seconds, minute, hour or day. Draws that are not valid policies (floors or
/// ceilings that do not fit) are drawn again: every case runs a valid one.
fn policy() -> impl Strategy<Value = String> {
    (tool("t"), tool("u"))
        .prop_map(|(t, u)| format!("{t}\n{u}"))
        .prop_filter("a valid policy", |text| Policy::from_toml_str(text).is_ok())
}

/// A `budgets = [...]` line of some of hour, day and month, each of up to 40 × `scale`; or
/// nothing.
fn budgets(scale: u32) -> impl Strategy<Value = String> {
    prop::sample::subsequence(vec!["hour", "day", "month"], 0..=3).prop_flat_map(move |ps| {
        let n = ps.len();
        (Just(ps), prop::collection::vec(1u32..40, n)).prop_map(move |(ps, maxes)| {
            if ps.is_empty() {
                return String::new();
            }
            let items: Vec<String> = ps
                .iter()
                .zip(maxes)
                .map(|(p, m)| format!("{{ period = \"{p}\", max = {} }}", m * scale))
                .collect();
            format!("budgets = [{}]\n", items.join(", "))
        })
    })
}

/// `key = v` for a `v` of `values`, or (more often) nothing.
fn opt(key: &'static str, values: std::ops::Range<u32>) -> impl Strategy<Value = String> {
    prop::option::weighted(0.4, values).prop_map(move |v| match v {
        Some(v) => format!("{key} = {v}\n"),
        None => String::new(),
    })
}

/// A tenant's or an instance's settings, its floor and ceiling in proportion to `scale`.
fn level(scale: u32) -> impl Strategy<Value = String> {
    (
        1u32..6,
        prop::option::weighted(0.5, 1u32..4),
        opt("burst", 2..12),
        opt("max_concurrency", 1..4),
        budgets(scale),
        prop::option::weighted(0.4, 0u32..3),
    )
        .prop_map(move |(w, floor, burst, cap, budgets, ceiling)| {
            let floor = floor.map_or(0, |f| f * scale / 10);
            let mut out = format!("weight = {w}\n{burst}{cap}{budgets}");
            if floor > 0 {
                out.push_str(&format!("floor = {floor}\n"));
            }
            if let Some(c) = ceiling {
                out.push_str(&format!("ceiling = {}\n", floor + (c + 1) * scale / 4));
            }
            out
        })
}

/// A level's settings without its floor (a template caller's: a floor needs a bound).
fn without_floor(level: &str) -> String {
    level
        .lines()
        .filter(|l| !l.starts_with("floor"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The tool `name`: listed tenants A (with an instance `x` and template instances) and B,
/// template tenants (maybe with template instances of their own).
fn tool(name: &'static str) -> impl Strategy<Value = String> {
    (
        (10u32..60).prop_map(|l| l * 10),
        prop_oneof![Just("1s"), Just("10s"), Just("1m"), Just("1h"), Just("1d")],
        opt("burst", 20..60),
        opt("max_concurrency", 2..12),
        budgets(400),
        prop::bool::weighted(0.3),
        (level(8), level(8), level(4), level(2), prop::option::of(level(2))),
        (1u32..4, 1u32..4),
    )
        .prop_map(
            move |(limit, per, burst, cap, budgets, untenanted, levels, maxes)| {
                let (a, b, x, default_instance, default_of_default) = levels;
                let mut t = format!(
                    "[[tool]]\nname = \"{name}\"\nunit = \"tokens\"\nlease = \"off\"\nrate = {{ limit = {limit}, per = \"{per}\" }}\n{burst}{cap}{budgets}"
                );
                if untenanted {
                    t.push_str("require_tenant = false\n");
                }
                t.push_str(&format!(
                    "[tool.default_tenant]\nweight = 1\nmax_tenants = {}\n",
                    maxes.0
                ));
                if let Some(d) = default_of_default {
                    let d = without_floor(&d);
                    t.push_str(&format!("[tool.default_tenant.default_instance]\n{d}"));
                }
                t.push_str(&format!("[tool.tenants.A]\n{a}"));
                t.push_str(&format!("[tool.tenants.A.instances.x]\n{x}"));
                let di = without_floor(&default_instance);
                t.push_str(&format!(
                    "[tool.tenants.A.default_instance]\n{di}max_instances = {}\n",
                    maxes.1
                ));
                t.push_str(&format!("[tool.tenants.B]\n{b}"));
                t
            },
        )
}

fn callers() -> Vec<Caller> {
    vec![
        Caller::new("A").with_instance("x"),
        Caller::new("A").with_instance("y"),
        Caller::new("A").with_instance("z"),
        Caller::new("A").with_instance("w"),
        Caller::new("B"),
        Caller::new("B").with_instance("x"),
        Caller::new("guest-1"),
        Caller::new("guest-2"),
        Caller::new("guest-3"),
        Caller::new("guest-4"),
        Caller::untenanted().with_instance("anon"),
    ]
}

#[derive(Clone, Debug)]
enum Op {
    /// caller, µs to wait first, cost, keep the permit, tool
    Admit(usize, u64, u32, bool, bool),
    /// settle the oldest held ticket at this fraction of its cost
    Settle(u32),
    Refund,
    Release,
    /// One caller's flood: this many calls of cost 1, 1 ms apart (the refusal cache engages).
    Flood(usize, u32, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0usize..11, prop_oneof![3 => 0u64..400_000, 1 => 0u64..12_000_000, 1 => Just(3_600_000_000u64), 1 => Just(20 * 86_400_000_000u64)], prop_oneof![3 => Just(1u32), 1 => 1u32..16], prop::bool::weighted(0.4), prop::bool::weighted(0.3))
            .prop_map(|(c, dt, cost, keep, other)| Op::Admit(c, dt, cost, keep, other)),
        1 => (0u32..300).prop_map(Op::Settle),
        1 => Just(Op::Refund),
        2 => Just(Op::Release),
        1 => (0usize..11, 5u32..40, prop::bool::weighted(0.3)).prop_map(|(c, n, o)| Op::Flood(c, n, o)),
    ]
}

/// Longer than any workload's virtual time: up to 250 operations, each at most 20 days after
/// the last, is under 14 years (400 days was not: a workload with 21 twenty-day gaps let a
/// held permit lapse in Redis, which the memory store's permits never do, and the two
/// disagreed).
const PERMITS_NEVER_LAPSE: Duration = Duration::from_secs(100 * 365 * 86_400);

#[test]
fn redis_script_matches_the_engine_call_for_call() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let callers = callers();
    let cases = std::env::var("FS_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let cache_hits = Cell::new(0u64);
    let compared = Compared::default();
    runner
        .run(
            &(policy(), prop::collection::vec(op(), 50..250)),
            |(text, ops)| {
                let policy = Policy::from_toml_str(&text).expect("drawn valid");
                server.flushall();
                // Start an hour before a month ends, so windows of every kind roll over.
                let start = Timestamp(EPOCH.as_micros() + 30 * 86_400_000_000 + 23 * 3_600_000_000);
                let clock = ManualClock::new(start);
                let four = rt.block_on(Four::on(&server, &policy, &clock));
                rt.block_on(four.run(ops, &clock, &callers, &compared))?;
                cache_hits.set(cache_hits.get() + four.cac.store().cached_refusals());
                Ok(())
            },
        )
        .unwrap();
    let [admitted, refused, states] =
        [compared.admitted, compared.refused, compared.states].map(Cell::into_inner);
    eprintln!(
        "{cases} generated policies and workloads: compared {admitted} admissions, {refused} refusals, {states} stored states; {} refusals from the cache",
        cache_hits.get()
    );
    assert!(
        cache_hits.get() > 0,
        "the refusal cache was never exercised"
    );
    assert!(
        admitted > 100 && refused > 20,
        "too few comparisons: {admitted} admissions, {refused} refusals"
    );
}

/// How many admissions, refusals and stored states the workloads compared.
#[derive(Default)]
struct Compared {
    admitted: Cell<usize>,
    refused: Cell<usize>,
    states: Cell<usize>,
}

fn count(c: &Cell<usize>) {
    c.set(c.get() + 1);
}

/// One admitted call's tickets, in the order of [`Four`]'s limiters.
type Held = [Ticket; 4];

/// The four limiters a workload runs through, on one clock.
struct Four {
    /// The engine's answers, every call decided: no refusal remembered.
    mem: Limiter<MemoryStore, ManualClock>,
    /// The in-process store as it comes, remembering refusals: it must never refuse a call the
    /// engine admits, nor admit one it refuses.
    rem: Limiter<MemoryStore, ManualClock>,
    /// Redis, no refusal remembered: the same answers and states as the engine, bit for bit.
    red: Limiter<RedisStore, ManualClock>,
    /// Redis remembering refusals, in a namespace of its own: it must never refuse a call the
    /// engine admits.
    cac: Limiter<RedisStore, ManualClock>,
}

impl Four {
    async fn on(server: &RedisServer, policy: &Policy, clock: &ManualClock) -> Four {
        // The memory store's permits never lapse: nor may Redis's, over the weeks of virtual
        // time the workloads cover.
        let redis = |namespace: Option<&str>, remember: bool| {
            let builder = RedisStore::builder(server.url());
            let builder = match namespace {
                Some(n) => builder.namespace(n),
                None => builder,
            };
            builder
                .injected_clock()
                .refusal_cache(remember)
                .timeout(Duration::from_secs(10))
                .permit_ttl(PERMITS_NEVER_LAPSE)
                .connect()
        };
        let (red, cac) = (redis(None, false).await, redis(Some("cached:"), true).await);
        let limiter = |store| Limiter::with_store(policy.clone(), store, clock.clone());
        Four {
            mem: limiter(MemoryStore::new().refusal_cache(false)),
            rem: limiter(MemoryStore::new()),
            red: Limiter::with_store(policy.clone(), red.unwrap(), clock.clone()),
            cac: Limiter::with_store(policy.clone(), cac.unwrap(), clock.clone()),
        }
    }

    /// Runs `ops` (a flood as its calls), comparing every answer and state.
    async fn run(
        &self,
        ops: Vec<Op>,
        clock: &ManualClock,
        callers: &[Caller],
        compared: &Compared,
    ) -> Result<(), TestCaseError> {
        let mut held: Vec<Held> = Vec::new();
        let ops = ops.into_iter().flat_map(|op| match op {
            Op::Flood(c, n, other) => vec![Op::Admit(c, 1000, 1, false, other); n as usize],
            op => vec![op],
        });
        for (n, op) in ops.enumerate() {
            match op {
                Op::Admit(who, dt, cost, keep, other) => {
                    clock.advance(Duration::from_micros(dt));
                    let (c, tool) = (&callers[who], if other { "u" } else { "t" });
                    if let Some(h) = self.admit(n, c, tool, cost as f64, compared).await? {
                        match keep {
                            true => held.push(h),
                            false => self.release(&h).await,
                        }
                    }
                    self.same_states(n, c, tool, compared).await?;
                }
                Op::Settle(pct) if !held.is_empty() => self.settle(&held[0], pct).await,
                Op::Refund if !held.is_empty() => {
                    let h = held.remove(0);
                    self.refund(&h).await;
                    self.release(&h).await;
                }
                Op::Release if !held.is_empty() => self.release(&held.remove(0)).await,
                _ => {}
            }
        }
        Ok(())
    }

    /// Op `n`: `c` calls `tool` for `cost` through every limiter, whose answers must agree;
    /// the tickets when all four admit.
    async fn admit(
        &self,
        n: usize,
        c: &Caller,
        tool: &str,
        cost: f64,
        compared: &Compared,
    ) -> Result<Option<Held>, TestCaseError> {
        let a = self.mem.admit(c, tool, Cost(cost)).await;
        let m = self.rem.admit(c, tool, Cost(cost)).await;
        prop_assert_eq!(
            a.is_ok(),
            m.is_ok(),
            "op {}: remembering refusals changed the answer: {:?}",
            n,
            m
        );
        let b = self.red.admit(c, tool, Cost(cost)).await;
        let cached_before = self.cac.store().cached_refusals();
        let z = self.cac.admit(c, tool, Cost(cost)).await;
        let from_cache = self.cac.store().cached_refusals() > cached_before;
        cached_agrees(n, &a, &z, from_cache)?;
        redis_agrees(n, &a, &b, compared)?;
        Ok(match (a, m, b, z) {
            (Ok(x), Ok(w), Ok(y), Ok(z)) => Some([x, w, y, z]),
            _ => None,
        })
    }

    /// Every stored state the call of `c` on `tool` touched is the same in memory and in
    /// Redis, bit for bit.
    async fn same_states(
        &self,
        n: usize,
        c: &Caller,
        tool: &str,
        compared: &Compared,
    ) -> Result<(), TestCaseError> {
        let Ok(keys) = self.mem.call_keys(c, tool) else {
            return Ok(());
        };
        let sm = self.mem.store().inspect(&keys).await.unwrap();
        let sr = self.red.store().inspect(&keys).await.unwrap();
        for level in 0..3 {
            match (&sm[level], &sr[level]) {
                (Some(x), Some(y)) => {
                    prop_assert_eq!(x, y, "op {} level {}", n, level);
                    count(&compared.states);
                }
                // Redis's real-time TTL may drop a state that is already equivalent to a fresh
                // one; the memory store keeps it until a sweep. Anything else is a mismatch.
                (None, None) | (Some(_), None) => {}
                (None, Some(y)) => {
                    prop_assert!(false, "op {} level {}: only redis holds {:?}", n, level, y)
                }
            }
        }
        Ok(())
    }

    async fn settle(&self, [x, w, y, z]: &Held, pct: u32) {
        let actual = Cost(x.admission().unwrap().charge.cost * pct as f64 / 100.0);
        self.mem.settle(x, actual).await;
        self.rem.settle(w, actual).await;
        self.red.settle(y, actual).await;
        self.cac.settle(z, actual).await;
    }

    async fn refund(&self, [x, w, y, z]: &Held) {
        self.rem.refund(w).await;
        self.mem.refund(x).await;
        self.red.refund(y).await;
        self.cac.refund(z).await;
    }

    async fn release(&self, [x, w, y, z]: &Held) {
        self.rem.release(w).await;
        self.mem.release(x).await;
        self.red.release(y).await;
        self.cac.release(z).await;
    }
}

/// The Redis store remembering refusals agrees with the engine on op `n`.
fn cached_agrees(
    n: usize,
    a: &Result<Ticket, Refusal>,
    z: &Result<Ticket, Refusal>,
    from_cache: bool,
) -> Result<(), TestCaseError> {
    match (a, z) {
        (Ok(_), Ok(_)) => {}
        // A refusal from the cache repeats the one Redis gave the same call before: a sibling
        // may since have spent what the call needed, so that the engine now names another
        // limit. Refused either way.
        (Err(_), Err(y)) if from_cache => prop_assert!(
            matches!(y.reason, Reason::RateLimited | Reason::CapExceeded),
            "op {}: the cache replayed {:?}",
            n,
            y
        ),
        (Err(x), Err(y)) => prop_assert_eq!(x.reason, y.reason, "op {}", n),
        _ => prop_assert!(
            false,
            "op {}: memory {:?} but the cached store {:?}",
            n,
            a,
            z
        ),
    }
    Ok(())
}

/// Redis answers op `n` as the engine does, bit for bit.
fn redis_agrees(
    n: usize,
    a: &Result<Ticket, Refusal>,
    b: &Result<Ticket, Refusal>,
    compared: &Compared,
) -> Result<(), TestCaseError> {
    match (a, b) {
        (Ok(x), Ok(y)) => {
            let (x, y) = (x.admission().unwrap(), y.admission().unwrap());
            prop_assert_eq!(&x.charge, &y.charge, "op {}", n);
            prop_assert_eq!(
                x.remaining.to_bits(),
                y.remaining.to_bits(),
                "op {} remaining {} vs {}",
                n,
                x.remaining,
                y.remaining
            );
            prop_assert_eq!(x.quota.to_bits(), y.quota.to_bits());
            prop_assert_eq!(x.reset_in.to_bits(), y.reset_in.to_bits());
            prop_assert_eq!(x.slack.to_bits(), y.slack.to_bits());
            prop_assert_eq!(x.views, y.views);
            prop_assert_eq!(x.at, y.at);
            count(&compared.admitted);
        }
        (Err(x), Err(y)) => {
            prop_assert_eq!(x, y, "op {}", n);
            count(&compared.refused);
        }
        _ => prop_assert!(false, "op {}: memory {:?} but redis {:?}", n, a, b),
    }
    Ok(())
}
