//! Leases: most calls of a busy caller are decided from units its process holds, charged at
//! every level in advance; hard bounds stay exact, small limits are decided call by call.

use std::time::Duration;

use tower_fairshare::{Caller, Cost, Limiter, ManualClock, MemoryStore, Policy, Store, Timestamp};

const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

fn limiter(toml: &str) -> (Limiter<MemoryStore, ManualClock>, ManualClock) {
    let clock = ManualClock::new(EPOCH);
    let p = Policy::from_toml_str(toml).expect("valid policy");
    (
        Limiter::with_store(p, MemoryStore::new(), clock.clone()),
        clock,
    )
}

fn now<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    match f
        .as_mut()
        .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("the memory store never waits"),
    }
}

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
    let [_, tenant, _] = now(l.store().inspect(&keys)).unwrap();
    assert_eq!(tenant.unwrap().total, admitted + held);
    now(l.return_leases());
    assert_eq!(l.leased_units(), 0.0);
    let [_, tenant, _] = now(l.store().inspect(&keys)).unwrap();
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
        let (plain, c1) = limiter(&toml);
        let (leased, c2) = limiter(&with_lease(&toml));
        let r = same(&run(&plain, &c1, &who), &run(&leased, &c2, &who));
        proptest::prop_assert!(r.is_ok(), "{}", r.unwrap_err());
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
    let [_, tenant, _] = now(l.store().inspect(&keys)).unwrap();
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
    let [_, tenant, _] = now(store.inspect(&keys)).unwrap();
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
    let (plain, c1) = limiter(toml);
    let (leased, c2) = limiter(&with_lease(toml));
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
