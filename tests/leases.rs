//! Leases: most calls of a busy caller are decided from units its process holds, charged at
//! every level in advance; hard bounds stay exact, small limits are decided call by call.

use std::time::Duration;

use tower_fairshare::admission::engine;
use tower_fairshare::store::{self, Answer};
use tower_fairshare::{Caller, Cost, Limiter, ManualClock, MemoryStore, Policy, Store, Timestamp};

const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

fn limiter(toml: &str) -> (Limiter<MemoryStore, ManualClock>, ManualClock) {
    on_store(toml, MemoryStore::new())
}

fn on_store(toml: &str, store: MemoryStore) -> (Limiter<MemoryStore, ManualClock>, ManualClock) {
    let clock = ManualClock::new(EPOCH);
    let p = Policy::from_toml_str(toml).expect("valid policy");
    (Limiter::with_store(p, store, clock.clone()), clock)
}

mod ready;
use ready::now;

const BUSY: &str = r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 100000, per = "1m" }
lease = { max = 64 }
[tool.default_tenant]
max_tenants = 100
"#;

#[test]
fn a_busy_caller_spends_from_its_lease_and_the_store_is_charged_exactly() {
    let (l, clock) = limiter(BUSY);
    let acme = Caller::new("acme");
    let mut admitted = 0.0;
    for _ in 0..1000 {
        clock.advance(Duration::from_micros(10));
        if now(l.admit(&acme, "search", Cost(1.0))).is_ok() {
            admitted += 1.0;
        }
    }
    assert_eq!(admitted, 1000.0);
    let held = l.leased_units();
    assert!(held > 0.0 && held <= 64.0, "held {held}");
    let keys = l.call_keys(&acme, "search").unwrap();
    let [_, tenant, _] = now(l.store().inspect(&keys)).unwrap().levels;
    assert_eq!(tenant.unwrap().total, admitted + held);
    now(l.return_leases());
    assert_eq!(l.leased_units(), 0.0);
    let [_, tenant, _] = now(l.store().inspect(&keys)).unwrap().levels;
    assert_eq!(tenant.unwrap().total, admitted);
}

/// Calls of `caller` on `tool` at the given gaps (µs); what each got: admitted, or the
/// refusal's reason and scope, and its retry-after (µs).
fn run(
    l: &Limiter<MemoryStore, ManualClock>,
    clock: &ManualClock,
    who: &[(Caller, u64)],
) -> Vec<(String, u64)> {
    who.iter()
        .map(|(c, gap)| {
            clock.advance(Duration::from_micros(*gap));
            match now(l.admit(c, "t", Cost(1.0))) {
                Ok(_) => ("ok".to_owned(), 0),
                Err(r) => (
                    format!("{} {:?}", r.reason.as_str(), r.scope),
                    r.retry_after.map_or(0, |d| d.as_micros() as u64),
                ),
            }
        })
        .collect()
}

/// The same answers call by call; retry-afters within a microsecond (a lease spends a grant
/// in one subtraction where calls one by one make several, and floats round each).
fn same(x: &[(String, u64)], y: &[(String, u64)]) -> Result<(), String> {
    match (0..x.len()).find(|&i| x[i].0 != y[i].0 || x[i].1.abs_diff(y[i].1) > 1) {
        None => Ok(()),
        Some(i) => Err(format!(
            "call {i}: without leases {:?}, with {:?}",
            x[i], y[i]
        )),
    }
}

fn with_lease(toml: &str) -> String {
    toml.replace("[[tool]]\n", "[[tool]]\nlease = { max = 64 }\n")
}

/// Every call decided at the store: leases off.
fn without_lease(toml: &str) -> String {
    toml.replace("[[tool]]\n", "[[tool]]\nlease = \"off\"\n")
}

/// The policies the lease properties hold for: a lease capped at 64 units, and the default
/// (`lease` left out: sized by itself, no cap of its own), with that cap.
fn leased_variants(toml: &str) -> [(String, f64); 2] {
    [(with_lease(toml), 64.0), (toml.to_owned(), f64::INFINITY)]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, failure_persistence: None, ..Default::default() })]

    /// A small limit (`3 per minute`, a burst of a few units) is decided call by call: the
    /// same calls get the same answers, refusals included, with leases on or off.
    #[test]
    fn small_limits_are_decided_call_by_call(
        limit in 1u32..40, burst in 1u32..8, fast in proptest::collection::vec((0usize..3, 0u64..2_000_000), 1..300),
    ) {
        let toml = format!(
            "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = {{ limit = {limit}, per = \"1m\" }}\nburst = {}\n\
             [tool.default_tenant]\nburst = {burst}\nmax_tenants = 10\n",
            burst * 4
        );
        let callers = [Caller::new("a"), Caller::new("b"), Caller::new("c")];
        let who: Vec<(Caller, u64)> = fast.iter().map(|(i, g)| (callers[*i].clone(), *g)).collect();
        // Refusals decided every time: a remembered one carries the figures of the first, and
        // leases change which calls are remembered (a grant asks for more than one unit).
        let (plain, c1) = on_store(&without_lease(&toml), MemoryStore::new().refusal_cache(false));
        let expected = run(&plain, &c1, &who);
        for (leased_toml, _) in leased_variants(&toml) {
            let (leased, c2) = on_store(&leased_toml, MemoryStore::new().refusal_cache(false));
            let r = same(&expected, &run(&leased, &c2, &who));
            proptest::prop_assert!(r.is_ok(), "{}", r.unwrap_err());
        }
    }
}

/// Four processes (four limiters over one store, each with its own leases) hammer one tenant:
/// every aligned minute admits at most its ceiling + burst (nothing admitted that was not
/// charged), at least 95 % of it (what leases leave unused is bounded), and a quiet tenant
/// beside them gets every call up to its floor.
#[test]
fn four_processes_on_one_tenant_stay_exact_and_lose_little() {
    let toml = r#"
[[tool]]
name = "t"
unit = "calls"
rate = { limit = 60000, per = "1m" }
burst = 4000
lease = { max = 64 }
[tool.tenants.busy]
ceiling = 30000
burst = 1000
[tool.tenants.quiet]
floor = 600
"#;
    let policy = Policy::from_toml_str(toml).unwrap();
    let store = std::sync::Arc::new(MemoryStore::new());
    let clock = ManualClock::new(EPOCH);
    let replicas: Vec<_> = (0..4)
        .map(|_| Limiter::with_store(policy.clone(), store.clone(), clock.clone()))
        .collect();
    let busy = Caller::new("busy");
    let quiet = Caller::new("quiet");
    let minute = 60_000_000u64;
    let mut per_window = [0u64; 3];
    let mut quiet_refused = 0;
    // 3 minutes; every 100 µs each replica sends one busy call (40,000 a second offered,
    // against 500 a second allowed); every 100 ms the quiet tenant sends one (its floor is
    // 10 a second).
    let mut t = 0u64;
    while t < 3 * minute {
        clock.set(Timestamp(EPOCH.as_micros() + t));
        for r in &replicas {
            if now(r.admit(&busy, "t", Cost(1.0))).is_ok() {
                per_window[(t / minute) as usize] += 1;
            }
        }
        if t.is_multiple_of(100_000)
            && now(replicas[(t / 100_000) as usize % 4].admit(&quiet, "t", Cost(1.0))).is_err()
        {
            quiet_refused += 1;
        }
        t += 100;
    }
    for (w, got) in per_window.iter().enumerate() {
        assert!(
            *got <= 30_000 + 1_000,
            "window {w}: {got} admitted, above ceiling + burst"
        );
        assert!(
            *got as f64 >= 0.95 * 30_000.0,
            "window {w}: only {got} admitted of 30,000"
        );
    }
    assert_eq!(
        quiet_refused, 0,
        "the quiet tenant was refused within its floor"
    );
}

/// Spends `n` calls of `who` 10 µs apart.
fn hammer(
    l: &Limiter<MemoryStore, ManualClock>,
    clock: &ManualClock,
    who: &Caller,
    tool: &str,
    n: usize,
) -> usize {
    (0..n)
        .filter(|_| {
            clock.advance(Duration::from_micros(10));
            now(l.admit(who, tool, Cost(1.0))).is_ok()
        })
        .count()
}

fn tenant_total(l: &Limiter<MemoryStore, ManualClock>, who: &Caller, tool: &str) -> f64 {
    let keys = l.call_keys(who, tool).unwrap();
    let [_, tenant, _] = now(l.store().inspect(&keys)).unwrap().levels;
    tenant.map_or(0.0, |t| t.total)
}

/// What a lease holds goes back when the policy is reloaded, when its caller is idle (with
/// any other traffic), and when the limiter is dropped: the store then counts exactly the
/// calls admitted.
#[test]
fn unused_units_go_back_on_reload_idle_and_drop() {
    let (l, clock) = limiter(BUSY);
    let (a, b) = (Caller::new("a"), Caller::new("b"));
    let got = hammer(&l, &clock, &a, "search", 500) as f64;
    assert!(l.leased_units() > 0.0);
    l.set_policy(Policy::from_toml_str(BUSY).unwrap());
    assert_eq!(l.leased_units(), 0.0, "a reload ends every lease");
    assert_eq!(tenant_total(&l, &a, "search"), got);

    // Idle: `a` stops; `b`'s traffic 150 ms later sweeps `a`'s lease back.
    let got = got + hammer(&l, &clock, &a, "search", 500) as f64;
    assert!(tenant_total(&l, &a, "search") > got);
    clock.advance(Duration::from_millis(150));
    hammer(&l, &clock, &b, "search", 1);
    assert_eq!(
        tenant_total(&l, &a, "search"),
        got,
        "an idle caller's lease went back"
    );

    // Drop: the limiter's last clone gives everything back to the store.
    let store = std::sync::Arc::new(MemoryStore::new());
    let l = Limiter::with_store(
        Policy::from_toml_str(BUSY).unwrap(),
        store.clone(),
        clock.clone(),
    );
    let got = (0..500)
        .filter(|_| {
            clock.advance(Duration::from_micros(10));
            now(l.admit(&a, "search", Cost(1.0))).is_ok()
        })
        .count() as f64;
    let keys = l.call_keys(&a, "search").unwrap();
    assert!(l.leased_units() > 0.0);
    drop(l);
    let [_, tenant, _] = now(store.inspect(&keys)).unwrap().levels;
    assert_eq!(
        tenant.unwrap().total,
        got,
        "dropping the limiter gave its leases back"
    );
}

/// A caller that borrows idle capacity beyond its own share is decided call by call: no lease
/// ever holds units lent by others. `a` asks for 750 a second, 1.5 times its own share and
/// within its ceiling (the tool's capacity); `b` is idle: once `a`'s bank is spent, a grant
/// that would pass draws on `b`'s idle share, so no lease keeps it, and every call gets the
/// answer it gets without leases.
#[test]
fn borrowed_units_are_never_leased() {
    // A deep pool (a burst of 30,000) lends much: a borrower's grants would pass.
    let toml = r#"
[[tool]]
name = "t"
unit = "calls"
rate = { limit = 60000, per = "1m" }
burst = 30000
default_ceiling = "capacity"
[tool.tenants.a]
burst = 100
[tool.tenants.b]
burst = 100
"#;
    let a = Caller::new("a");
    let who: Vec<(Caller, u64)> = (0..6_000).map(|_| (a.clone(), 1_333)).collect();
    let (plain, c1) = limiter(&without_lease(toml));
    let (leased, c2) = limiter(toml);
    let x = run(&plain, &c1, &who);
    let mut y = Vec::new();
    for w in who.chunks(1) {
        y.extend(run(&leased, &c2, w));
        // Its bank (100 units of its own share, full at first) is spent within 500 calls.
        if y.len() > 500 {
            assert_eq!(
                leased.leased_units(),
                0.0,
                "a lease holds borrowed units after call {}",
                y.len()
            );
        }
    }
    let admitted = x.iter().filter(|s| s.0 == "ok").count();
    // Every call, 8 s at 750 a second (its share: 500 a second, 4,000 in 8 s).
    assert!(admitted > 5_900, "a borrowed only {admitted}");
    same(&x, &y).unwrap();
}

/// A busy tool with 2–4 tenants (floors, weights, some ceilings, bursts deep enough for leases
/// to grow), each offering a multiple of its nominal share: (TOML, capacity per minute, tool
/// burst, each tenant's burst, floors, per-minute offers).
fn busy_tool() -> impl proptest::strategy::Strategy<Value = (String, f64, Vec<f64>, Vec<f64>)> {
    use proptest::prelude::*;
    (
        60u32..600,
        proptest::collection::vec((1u32..6, 0u32..100, proptest::bool::weighted(0.3), 0.2f64..3.0), 2..5),
    )
        .prop_map(|(per_s, tenants)| {
            let cap = per_s as f64 * 60.0;
            let frac: f64 = tenants.iter().map(|t| t.1 as f64).sum::<f64>().max(1.0);
            let wsum: f64 = tenants.iter().map(|t| t.0 as f64).sum();
            let mut toml = format!(
                "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = {{ limit = {cap}, per = \"1m\" }}\nburst = {}\n",
                cap / 10.0
            );
            let (mut floors, mut offers) = (Vec::new(), Vec::new());
            for (i, (w, f, ceiled, mult)) in tenants.iter().enumerate() {
                let floor = ((*f as f64 / frac) * 0.5 * cap).floor();
                let nominal = floor + (cap - 0.5 * cap) * *w as f64 / wsum;
                toml += &format!(
                    "[tool.tenants.T{i}]\nweight = {w}\nfloor = {floor}\nburst = {}\n",
                    cap / 40.0
                );
                if *ceiled {
                    toml += &format!("ceiling = {}\n", (nominal * 1.5).min(cap).floor().max(floor));
                }
                floors.push(floor);
                offers.push(nominal * mult);
            }
            (toml, cap, floors, offers)
        })
}

/// Every call of `offers` (calls per minute per tenant, evenly spaced, `minutes` long) in time
/// order through `l`; admitted calls per tenant per aligned minute.
fn drive(
    l: &Limiter<MemoryStore, ManualClock>,
    clock: &ManualClock,
    offers: &[f64],
    minutes: u64,
) -> Vec<Vec<u64>> {
    let minute = 60_000_000u64;
    let mut calls: Vec<(u64, usize)> = Vec::new();
    for (i, per_min) in offers.iter().enumerate() {
        let gap = (minute as f64 / per_min.max(1.0)) as u64;
        let mut t = (i as u64 * 7) % gap.max(1);
        while t < minutes * minute {
            calls.push((t, i));
            t += gap.max(1);
        }
    }
    calls.sort_unstable();
    let callers: Vec<Caller> = (0..offers.len())
        .map(|i| Caller::new(format!("T{i}")))
        .collect();
    let mut got = vec![vec![0u64; minutes as usize]; offers.len()];
    for (t, i) in calls {
        clock.set(Timestamp(EPOCH.as_micros() + t));
        if now(l.admit(&callers[i], "t", Cost(1.0))).is_ok() {
            got[i][(t / minute) as usize] += 1;
        }
    }
    got
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, failure_persistence: None, ..Default::default() })]

    /// The same random workloads with leases off and on: with leases, every tenant still gets
    /// at most its ceiling + burst and the tool at most its capacity in every aligned minute,
    /// every floor is served, and what each tenant gets differs from the unleased run by at
    /// most what the leases can hold at once (each caller path at most `max`, and a quarter of
    /// the smallest burst on its path): the bound the README states.
    #[test]
    fn leased_and_unleased_runs_differ_by_at_most_the_stated_bound((toml, cap, floors, offers) in busy_tool()) {
        let minutes = 2;
        // Refusals decided every time: a remembered one carries the figures of the first, and
        // leases change which calls are remembered (a grant asks for more than one unit).
        let (plain, c1) = on_store(&without_lease(&toml), MemoryStore::new().refusal_cache(false));
        let a = drive(&plain, &c1, &offers, minutes);
        for (leased_toml, max) in leased_variants(&toml) {
        let (leased, c2) = on_store(&leased_toml, MemoryStore::new().refusal_cache(false));
        let b = drive(&leased, &c2, &offers, minutes);
        let policy = Policy::from_toml_str(&toml).unwrap();
        let tool = policy.tool("t").unwrap();
        let alloc = policy.allocation();
        let held_at_most: f64 = alloc.tools[0]
            .tenants
            .iter()
            .map(|t| max.min((t.burst.min(tool.burst()) * 0.25).floor()))
            .sum();
        for w in 0..minutes as usize {
            let total: u64 = b.iter().map(|x| x[w]).sum();
            proptest::prop_assert!(total as f64 <= cap + 1e-6, "minute {w}: {total} > C {cap}");
            for (i, t) in alloc.tools[0].tenants.iter().enumerate() {
                proptest::prop_assert!(
                    b[i][w] as f64 <= t.ceiling + t.burst + 1e-6,
                    "T{i} got {} in minute {w}, above ceiling {} + burst {}", b[i][w], t.ceiling, t.burst
                );
                let floor_offered = offers[i].min(floors[i]);
                proptest::prop_assert!(
                    b[i][w] as f64 + 1.0 >= floor_offered.min(a[i][w] as f64),
                    "T{i} got {} in minute {w}, below its floor {} (unleased: {})", b[i][w], floors[i], a[i][w]
                );
                let diff = (a[i][w] as f64 - b[i][w] as f64).abs();
                proptest::prop_assert!(
                    diff <= held_at_most + 1.0,
                    "T{i} minute {w}: {} unleased, {} leased: {diff} apart, bound {held_at_most}", a[i][w], b[i][w]
                );
            }
        }
        }
    }
}

/// A lease ends with the aligned window it was charged in: units granted in one window are
/// never spent in the next, where they would come on top of that window's own capacity. A
/// caller below capacity holds a lease when the first minute ends; then it floods: the second
/// minute still admits at most the tool's capacity. (The calls are timed so that no sweep of
/// ended leases runs between the last call of the first minute and the first of the second:
/// only the lease's own end stops it.)
#[test]
fn a_lease_never_outlives_its_window() {
    let toml = r#"
[[tool]]
name = "t"
unit = "calls"
rate = { limit = 8000, per = "1m" }
burst = 2000
lease = { max = 64 }
default_ceiling = "capacity"
[tool.tenants.a]
burst = 1000
"#;
    let (l, clock) = limiter(toml);
    let a = Caller::new("a");
    let minute = 60_000_000u64;
    // Minute 0: a call every 10 ms from 5 ms on (6,000 a minute, below the capacity of 8,000).
    let mut t = 5_000;
    while t < minute {
        clock.set(Timestamp(EPOCH.as_micros() + t));
        now(l.admit(&a, "t", Cost(1.0))).unwrap();
        t += 10_000;
    }
    assert!(
        l.leased_units() >= 1.0,
        "a lease is held as the minute ends"
    );
    // Minute 1: a call every 100 µs (600,000 offered).
    let mut admitted = 0;
    let mut t = minute;
    while t < 2 * minute {
        clock.set(Timestamp(EPOCH.as_micros() + t));
        admitted += usize::from(now(l.admit(&a, "t", Cost(1.0))).is_ok());
        t += 100;
    }
    assert!(
        admitted <= 8_000,
        "minute 1 admitted {admitted}, above the capacity of 8,000"
    );
}

/// The memory store behind a store that waits, as a remote one does, counting the decisions
/// it makes, and those made while a call waited for them.
#[cfg(feature = "tokio")]
#[derive(Default)]
struct Counting {
    inner: std::sync::Arc<MemoryStore>,
    decisions: std::sync::Arc<std::sync::atomic::AtomicU64>,
    waited: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

thread_local! {
    /// Set while the test's own call is being decided (not a task fetching ahead).
    static IN_CALL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(feature = "tokio")]
impl Store for Counting {
    fn decide(&self, plans: &[engine::Plan<'_>]) -> Answer<store::Decision> {
        use std::sync::atomic::Ordering::Relaxed;
        let (inner, decisions, waited) = (
            self.inner.clone(),
            self.decisions.clone(),
            self.waited.clone(),
        );
        // Decided when waited for, as a remote store's decision is.
        let plans: Vec<_> = plans.iter().map(engine::OwnedPlan::of).collect();
        Answer::later(async move {
            decisions.fetch_add(1, Relaxed);
            if IN_CALL.get() {
                waited.fetch_add(1, Relaxed);
            }
            let plans: Vec<_> = plans.iter().map(|p| p.plan()).collect();
            inner.decide(&plans).await
        })
    }
    fn adjust(
        &self,
        admission: &std::sync::Arc<store::Admission>,
        factor: f64,
        now: Timestamp,
    ) -> Answer<()> {
        self.inner.adjust(admission, factor, now)
    }
    fn release(&self, admission: &std::sync::Arc<store::Admission>) -> Answer<()> {
        self.inner.release(admission)
    }
    fn inspect(&self, keys: &store::CallKeys) -> Answer<store::Stored> {
        self.inner.inspect(keys)
    }
}

/// On a tokio runtime the next grant is fetched ahead, in a task of its own, once half of the
/// current one is spent: a busy caller's calls seldom wait for the store, at most two grants
/// are held per caller path, and the store still counts exactly the calls admitted once the
/// leases are given back. (Fetching ahead takes the `tokio` feature.)
#[cfg(feature = "tokio")]
#[test]
fn the_next_grant_is_fetched_ahead_and_held_within_two_grants() {
    fetched_ahead(false)
}

/// The same through `try_admit`, which the layer tries first: it fetches ahead too.
#[cfg(feature = "tokio")]
#[test]
fn a_call_decided_without_waiting_fetches_the_next_grant_ahead_too() {
    fetched_ahead(true)
}

#[cfg(feature = "tokio")]
fn fetched_ahead(without_waiting: bool) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let clock = ManualClock::new(EPOCH);
    let store = std::sync::Arc::new(Counting::default());
    let plenty = BUSY.replace("limit = 100000,", "limit = 1000000000,");
    let l = Limiter::with_store(
        Policy::from_toml_str(&plenty).unwrap(),
        store.clone(),
        clock.clone(),
    );
    let acme = Caller::new("acme");
    let calls = 20_000u64;
    rt.block_on(async {
        for _ in 0..calls {
            clock.advance(Duration::from_micros(10));
            IN_CALL.set(true);
            // As the layer does: without waiting if it can, waiting for the store if not.
            let decided = match without_waiting {
                true => l.try_admit(&acme, "search", Cost(1.0)),
                false => None,
            };
            match decided {
                Some(d) => drop(d.unwrap()),
                None => drop(l.admit(&acme, "search", Cost(1.0)).await.unwrap()),
            }
            IN_CALL.set(false);
            assert!(l.leased_units() <= 2.0 * 64.0, "held {}", l.leased_units());
            // What a server does between two requests: lets other tasks run.
            tokio::task::yield_now().await;
        }
        let decisions = store.decisions.load(std::sync::atomic::Ordering::Relaxed);
        let waited = store.waited.load(std::sync::atomic::Ordering::Relaxed);
        // Grants grow to 64 within a few calls: a few hundred decisions at the store, and
        // once they are fetched ahead, hardly a call waits for one.
        assert!(
            decisions * 40 < calls,
            "{decisions} store decisions for {calls} calls"
        );
        assert!(
            waited <= 20,
            "{waited} calls waited for the store ({decisions} decisions)"
        );
        l.return_leases().await;
        let keys = l.call_keys(&acme, "search").unwrap();
        let [_, tenant, _] = store.inspect(&keys).await.unwrap().levels;
        assert_eq!(tenant.unwrap().total, calls as f64);
    });
}

/// A call spent from a lease holds its part of the grant: its ticket says what it cost and
/// what is left, and settling or refunding it corrects the store by exactly its own charge
/// (not the grant's).
#[test]
fn a_leased_call_settles_and_refunds_its_own_part_of_the_grant() {
    let (l, clock) = limiter(
        r#"
[[tool]]
name = "llm"
unit = "tokens"
rate = { limit = 100000, per = "1m" }
lease = { max = 64 }
[tool.tenants.acme]
ceiling = 100000
budgets = [{ period = "day", max = 1000000 }]
"#,
    );
    let acme = Caller::new("acme");
    let keys = l.call_keys(&acme, "llm").unwrap();
    let used = || {
        let [_, tenant, _] = now(l.store().inspect(&keys)).unwrap().levels;
        tenant.unwrap().budgets[0].used
    };
    // Busy enough for grants above one call.
    let mut tickets = Vec::new();
    for _ in 0..200 {
        clock.advance(Duration::from_micros(100));
        tickets.push(now(l.admit(&acme, "llm", Cost(2.0))).expect("admitted"));
    }
    let leased: Vec<_> = tickets.iter().filter(|t| t.part() < 1.0).collect();
    assert!(
        leased.len() > 100,
        "most calls spent from a lease: {}",
        leased.len()
    );
    for t in &leased {
        assert_eq!(t.cost(), Some(2.0));
        assert!(
            t.admission().unwrap().charge.cost > 2.0,
            "the grant is larger"
        );
        assert!(t.remaining().unwrap() <= t.quota().unwrap());
        assert!(t.reset_in().unwrap() <= Duration::from_secs(60));
    }
    let before = used();
    now(l.settle(leased[0], Cost(5.0)));
    assert!(
        (used() - (before + 3.0)).abs() < 1e-9,
        "settled by its own 3 more units"
    );
    now(l.refund(leased[1]));
    assert!(
        (used() - (before + 1.0)).abs() < 1e-9,
        "refunded its own 2 units"
    );
}

/// A call is spent from a lease without being resolved against the policy only when it would
/// resolve to the lease's path: a caller of another tier, or an instance its tenant limits
/// separately, is decided the whole way.
#[test]
fn a_lease_is_spent_only_by_calls_that_resolve_to_it() {
    let (l, clock) = limiter(
        r#"
[[tool]]
name = "gold"
unit = "calls"
rate = { limit = 100000, per = "1m" }
lease = { max = 64 }
tiers = ["gold"]
[tool.default_tenant]
max_tenants = 100

[[tool]]
name = "agents"
unit = "calls"
rate = { limit = 100000, per = "1m" }
lease = { max = 64 }
[tool.default_tenant]
max_tenants = 100
[tool.default_tenant.default_instance]
max_instances = 10
ceiling = 1
burst = 1
"#,
    );
    let acme_gold = Caller::new("acme").with_tier("gold");
    let acme = Caller::new("acme");
    for _ in 0..200 {
        clock.advance(Duration::from_micros(10));
        now(l.admit(&acme_gold, "gold", Cost(1.0))).expect("a gold caller");
        now(l.admit(&acme, "agents", Cost(1.0))).expect("the tenant itself");
    }
    assert!(l.leased_units() > 2.0, "both callers hold leases");
    // The same tenant without the tier: refused, not spent from the gold caller's lease.
    let r = now(l.admit(&acme, "gold", Cost(1.0))).expect_err("no tier");
    assert_eq!(r.detail, Some("tier"), "{r:?}");
    // An instance of the tenant: charged at its own instance (1 call, burst 1), not spent
    // from the tenant's lease.
    let agent = Caller::new("acme").with_instance("agent-1");
    clock.advance(Duration::from_micros(10));
    now(l.admit(&agent, "agents", Cost(1.0))).expect("the instance's first call");
    clock.advance(Duration::from_micros(10));
    let r = now(l.admit(&agent, "agents", Cost(1.0))).expect_err("its ceiling is 1");
    assert_eq!(r.reason.as_str(), "rate_limited", "{r:?}");
    assert_eq!(r.scope.map(|s| s.as_str()), Some("instance"), "{r:?}");
}

/// A task that loops on decisions spent from its lease never waits for the store, so it must
/// yield to the runtime by itself: it spends tokio's cooperative budget now and then, and the
/// other tasks on its thread still run. (If it never yielded, the runtime's thread would spin
/// in it for ever; the test fails after a minute instead of hanging.) Without the `tokio`
/// feature the limiter knows no runtime to yield to.
#[cfg(feature = "tokio")]
#[test]
fn a_task_looping_on_leased_decisions_lets_the_runtime_run_its_other_tasks() {
    let calls = calls_before_a_looping_task_yields("lease = { max = 64 }", ONE);
    assert!(
        calls > 64,
        "more calls than one lease holds before it yielded: {calls}"
    );
}

/// The same for decisions made in memory one by one (no lease): they wait for nothing either.
#[cfg(feature = "tokio")]
#[test]
fn a_task_looping_on_decisions_in_memory_lets_the_runtime_run_its_other_tasks() {
    let calls = calls_before_a_looping_task_yields(r#"lease = "off""#, ONE);
    assert!(calls > 0, "it decided before it yielded: {calls}");
}

/// The same for calls charged to two tools at once (`Limiter::admit_all`), leased or not.
#[cfg(feature = "tokio")]
#[test]
fn a_task_looping_on_calls_of_two_tools_lets_the_runtime_run_its_other_tasks() {
    for lease in [r#"lease = "off""#, "lease = { max = 64 }"] {
        let calls = calls_before_a_looping_task_yields(lease, TWO);
        assert!(calls > 0, "{lease}: it decided before it yielded: {calls}");
    }
}

/// A call of the looping task's tool; a call of it and of its twin.
#[cfg(feature = "tokio")]
const ONE: &[(&str, Cost)] = &[("search", Cost(1.0))];
#[cfg(feature = "tokio")]
const TWO: &[(&str, Cost)] = &[("search", Cost(1.0)), ("search.twin", Cost(1.0))];

/// How many calls a task looping on `charges` (`Limiter::admit` for one tool, `admit_all`
/// for two; tools with a huge limit and `lease`) makes on a current-thread runtime before the
/// runtime runs another task; fails after a minute if it never yields.
#[cfg(feature = "tokio")]
fn calls_before_a_looping_task_yields(lease: &str, charges: &'static [(&str, Cost)]) -> u64 {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;

    let tool = |name: &str| {
        format!(
            r#"
[[tool]]
name = "{name}"
group = "search"
unit = "calls"
rate = {{ limit = 1000000000000, per = "1s" }}
{lease}
[tool.default_tenant]
"#
        )
    };
    let huge = tool("search") + &tool("search.twin");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let calls = rt.block_on(async {
            let l = Arc::new(limiter(&huge).0);
            let (calls, stop) = (
                Arc::new(AtomicU64::new(0)),
                Arc::new(AtomicBool::new(false)),
            );
            let looping = tokio::spawn({
                let (l, calls, stop) = (l.clone(), calls.clone(), stop.clone());
                async move {
                    let acme = Caller::new("acme");
                    while !stop.load(Relaxed) {
                        match charges {
                            [(tool, cost)] => l.admit(&acme, tool, *cost).await.map(|_| ()),
                            _ => l.admit_all(&acme, charges).await.map(|_| ()),
                        }
                        .expect("admitted");
                        calls.fetch_add(1, Relaxed);
                    }
                }
            });
            // Runs the looping task: this one is polled again only once that one yields.
            tokio::task::yield_now().await;
            stop.store(true, Relaxed);
            looping.await.expect("the loop ends");
            calls.load(Relaxed)
        });
        let _ = tx.send(calls);
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the task looping on decisions that wait for nothing never yielded")
}

/// The memory store, whose corrections never finish: as a remote store whose answers to
/// them are slow.
#[derive(Default)]
struct SlowReturns {
    inner: MemoryStore,
}

impl Store for SlowReturns {
    fn decide(&self, plans: &[engine::Plan<'_>]) -> Answer<store::Decision> {
        self.inner.decide(plans)
    }
    fn adjust(&self, _: &std::sync::Arc<store::Admission>, _: f64, _: Timestamp) -> Answer<()> {
        Answer::later(std::future::pending())
    }
    fn release(&self, admission: &std::sync::Arc<store::Admission>) -> Answer<()> {
        self.inner.release(admission)
    }
    fn inspect(&self, keys: &store::CallKeys) -> Answer<store::Stored> {
        self.inner.inspect(keys)
    }
}

/// A leasing caller never waits longer than an unleased one: a call that finds its lease
/// ended is answered once its own decision is, while what the lease held goes back to the
/// store in the background. (It waited for the store to take the units back first: on a
/// store slow to answer corrections, for as long as that took.)
#[test]
fn a_call_does_not_wait_for_a_lease_to_go_back() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let clock = ManualClock::new(EPOCH);
    let l = Limiter::with_store(
        Policy::from_toml_str(BUSY).unwrap(),
        SlowReturns::default(),
        clock.clone(),
    );
    let acme = Caller::new("acme");
    rt.block_on(async {
        while l.leased_units() < 8.0 {
            clock.advance(Duration::from_micros(100));
            l.admit(&acme, "search", Cost(1.0)).await.unwrap();
        }
        // The caller idles past its lease's life: its next call gives the lease back.
        clock.advance(Duration::from_secs(2));
        let answered =
            tokio::time::timeout(Duration::from_secs(5), l.admit(&acme, "search", Cost(1.0))).await;
        assert!(
            matches!(answered, Ok(Ok(_))),
            "the call waited for its lease to go back: {answered:?}"
        );
        assert_eq!(l.leased_units(), 0.0, "the old lease is no longer held");
    });
}
