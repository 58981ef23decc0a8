//! RedisStore behaviour beyond the conformance suite: exactness across replicas, faults, the
//! refusal cache, and expiry. Every test starts its own redis-server on a free loopback port.

// Needs the `redis` feature: `cargo test --features redis` (or --all-features).
#![cfg(feature = "redis")]

mod support;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use support::{command_calls, RedisServer};
use tower_fairshare::admission::engine::{LevelRef, NodeState, Plan, Stored};
/// The virtual start of the tests: 2026-01-01T00:00:00Z, aligned to every period and calendar window.
const EPOCH: tower_fairshare::Timestamp = tower_fairshare::Timestamp(1_767_225_600_000_000);
use tower_fairshare::store::{CallKeys, RedisStore};
use tower_fairshare::{
    Caller, Cost, Limiter, ManualClock, Policy, Reason, Store, StoreError, SystemClock, Timestamp,
};

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Largest excess of admitted calls over `rate × τ / P + allowance` over every interval
/// between two admitted calls (times in µs, sorted). Positive means the bound was broken.
fn worst_excess(times: &[u64], rate: f64, period_us: f64, allowance: f64) -> f64 {
    let mut worst = f64::NEG_INFINITY;
    for i in 0..times.len() {
        for j in i..times.len() {
            let n = (j - i + 1) as f64;
            let tau = (times[j] - times[i]) as f64;
            worst = worst.max(n - (rate * tau / period_us + allowance));
        }
    }
    worst
}

const SHARED: &str = r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 300, per = "1s" }
burst = 20

[tool.tenants.heavy]
weight = 4
floor = 30
ceiling = 300
burst = 20

[tool.tenants.quiet]
weight = 1
floor = 40

[tool.default_tenant]
weight = 1
max_tenants = 50
"#;

/// The capacity bound across replicas: 4 stores ("replicas") on one Redis, 64 tasks each, flooding,
/// with the policy's default settings (leases on); the admitted calls (timed by Redis: a call
/// spent from a lease at its grant's time, when Redis charged it) never exceed
/// C τ/P + burst + Σ floors over any interval, and the quiet tenant, offering half its floor,
/// gets every call.
#[test]
fn four_replicas_with_64_tasks_each_share_one_exact_budget() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(SHARED).unwrap();
    let rt = multi_thread();
    let run = SharedRun::default();
    rt.block_on(async {
        let mut handles = Vec::new();
        for r in 0..4 {
            let store = RedisStore::builder(server.url())
                .timeout(Duration::from_secs(2))
                .connect()
                .await
                .unwrap();
            let limiter = Limiter::with_store(policy.clone(), store, SystemClock);
            for k in 0..64 {
                let caller = match k % 4 {
                    0 => Caller::new(format!("guest-{r}-{k}")),
                    _ => Caller::new("heavy").with_instance(format!("agent-{k}")),
                };
                handles.push(tokio::spawn(run.clone().busy(limiter.clone(), caller)));
            }
            handles.push(tokio::spawn(run.clone().quiet(limiter, r)));
        }
        tokio::time::sleep(Duration::from_millis(2500)).await;
        run.stop.store(true, Ordering::Relaxed);
        for h in handles {
            h.await.unwrap();
        }
    });
    let mut times = run.admitted.lock().unwrap().clone();
    times.sort_unstable();
    let n = times.len();
    let span = (times[n - 1] - times[0]) as f64 / 1e6;
    let (quiet_admitted, quiet_refused) = (
        run.quiet_admitted.load(Ordering::Relaxed),
        run.quiet_refused.load(Ordering::Relaxed),
    );
    eprintln!(
        "admitted {n} calls over {span:.2} s; quiet {quiet_admitted} admitted, {quiet_refused} refused"
    );
    assert!(
        n as f64 > 300.0 * span * 0.8,
        "the tool was not saturated: {n} in {span} s"
    );
    // C = 300 per second, burst 20, floors 30 + 40.
    let excess = worst_excess(&times, 300.0, 1e6, 20.0 + 70.0 + 1e-6);
    assert!(excess <= 0.0, "capacity bound broken by {excess} calls");
    assert_eq!(quiet_refused, 0, "the quiet tenant lost its floor");
    assert!(quiet_admitted >= 40);
    assert_eq!(
        run.progressed.load(Ordering::Relaxed),
        256,
        "some task never got an answer"
    );
}

/// The four replicas' run: when to stop, when each admitted call was charged (µs, by Redis),
/// the quiet tenant's answers and how many busy tasks got one.
#[derive(Clone, Default)]
struct SharedRun {
    stop: Arc<AtomicBool>,
    admitted: Arc<Mutex<Vec<u64>>>,
    quiet_admitted: Arc<AtomicU64>,
    quiet_refused: Arc<AtomicU64>,
    progressed: Arc<AtomicU64>,
}

impl SharedRun {
    /// `caller` calls `search` in a loop until told to stop, backing off 1 ms after a refusal
    /// (the cache answers most of those); the store never fails.
    async fn busy(self, limiter: Limiter<RedisStore, SystemClock>, caller: Caller) {
        let mut any = false;
        while !self.stop.load(Ordering::Relaxed) {
            match limiter.admit(&caller, "search", Cost(1.0)).await {
                Ok(t) => {
                    let a = t.admission().expect("metered");
                    self.admitted.lock().unwrap().push(a.at.as_micros());
                }
                Err(e) => {
                    assert_ne!(e.reason, Reason::StoreUnavailable, "{e}");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            if !any {
                any = true;
                self.progressed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The quiet tenant on replica `r`: 5 calls a second from each replica, 20/s in all, its
    /// floor 40/s.
    async fn quiet(self, limiter: Limiter<RedisStore, SystemClock>, r: u64) {
        tokio::time::sleep(Duration::from_millis(50 * r)).await;
        let quiet = Caller::new("quiet");
        while !self.stop.load(Ordering::Relaxed) {
            match limiter.admit(&quiet, "search", Cost(1.0)).await {
                Ok(t) => {
                    self.quiet_admitted.fetch_add(1, Ordering::Relaxed);
                    let at = t.admission().unwrap().at.as_micros();
                    self.admitted.lock().unwrap().push(at);
                }
                Err(e) => {
                    eprintln!("quiet refused: {e}");
                    self.quiet_refused.fetch_add(1, Ordering::Relaxed);
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The busy tenant's calls of `t`, each 10 µs of virtual time after the last, until `until`
/// (µs after the epoch); the time each admitted one was charged at.
async fn busy_until(
    limiter: Limiter<RedisStore, ManualClock>,
    clock: ManualClock,
    until: u64,
    busy_at: Arc<Mutex<Vec<u64>>>,
) {
    let busy = Caller::new("busy");
    while tower_fairshare::Clock::now(&clock).as_micros() - EPOCH.as_micros() < until {
        if let Ok(ticket) = limiter.admit(&busy, "t", Cost(1.0)).await {
            let at = ticket.admission().unwrap().at.as_micros();
            busy_at.lock().unwrap().push(at);
        }
        clock.advance(Duration::from_micros(10));
    }
}

/// The quiet tenant's calls of `t`, one every 100 ms of virtual time from `first` until `end`
/// (µs after the epoch): how many were admitted, and each refusal.
async fn quiet_every_100ms(
    limiter: Limiter<RedisStore, ManualClock>,
    clock: ManualClock,
    first: u64,
    end: u64,
    quiet: Arc<Mutex<(u64, Vec<String>)>>,
) {
    let caller = Caller::new("quiet");
    let mut next = first;
    while next < end {
        if tower_fairshare::Clock::now(&clock).as_micros() - EPOCH.as_micros() < next {
            tokio::task::yield_now().await;
            continue;
        }
        match limiter.admit(&caller, "t", Cost(1.0)).await {
            Ok(_) => quiet.lock().unwrap().0 += 1,
            Err(e) => quiet.lock().unwrap().1.push(e.to_string()),
        }
        next += 100_000;
    }
}

/// `n` calls of `caller` on `t` whose callers go away while the decision is in flight: each
/// future is polled once (the script is on its way) and dropped.
async fn leave_in_flight(a: &Limiter<RedisStore, ManualClock>, caller: &Caller, n: usize) {
    for _ in 0..n {
        let mut fut = std::pin::pin!(a.admit(caller, "t", Cost(1.0)));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Almost always pending: the decision is on its way to Redis. On a busy machine the
        // test thread can be descheduled between sending the call and this first poll, long
        // enough for the answer to arrive first: then this caller did not leave, and gives its
        // call back itself, as any caller that is done would.
        if let std::task::Poll::Ready(Ok(ticket)) = fut.as_mut().poll(&mut cx) {
            a.refund(&ticket).await;
            a.release(&ticket).await;
        }
    }
}

/// The states of `keys` once the background has finished what the callers left (real I/O,
/// no virtual time passes): nothing charged at the tool, or 10 s gone.
async fn settled(a: &Limiter<RedisStore, ManualClock>, keys: &CallKeys) -> Stored {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = a.store().inspect(keys).await.unwrap();
        // Nothing stored for the tool means nothing was ever charged there.
        let done = s[0]
            .as_ref()
            .is_none_or(|t| t.in_flight == 0.0 && t.total == 0.0);
        if done || Instant::now() > deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// No permit, unit or budget left charged at the tool, no unit at the tenant. Nothing stored
/// means nothing was ever charged there: nothing to leak.
fn nothing_charged(state: [Option<NodeState>; 3]) {
    if let Some(tool) = &state[0] {
        assert_eq!(tool.in_flight, 0.0, "permits leaked: {tool:?}");
        assert_eq!(tool.total, 0.0, "units leaked: {tool:?}");
        assert!(
            tool.budgets.iter().all(|b| b.used == 0.0),
            "budget leaked: {tool:?}"
        );
    }
    if let Some(tenant) = &state[1] {
        assert_eq!(tenant.total, 0.0, "the parasite's units leaked: {tenant:?}");
    }
}

/// One call of the outage test.
#[derive(Clone, Copy)]
struct Outcome {
    started: Instant,
    ended: Instant,
    tool: &'static str,
    passed: bool,
    /// When the store charged what the call was admitted under (µs since the epoch): its own
    /// decision, or the grant of the lease it was spent from.
    charged_at: Option<u64>,
}

const FAULTS: &str = r#"
[[tool]]
name = "strict"
unit = "calls"
rate = { limit = 100000, per = "1s" }
[tool.tenants.A]

[[tool]]
name = "lenient"
unit = "calls"
rate = { limit = 100000, per = "1s" }
on_store_error = "allow"
[tool.tenants.A]
"#;

/// Redis killed mid-load: every call answers within the timeout, by the tool's
/// `on_store_error` (deny: `store_unavailable`; allow: through, unmetered); restarted on the
/// same port, calls succeed again within a second.
#[test]
fn killed_redis_applies_on_store_error_within_the_timeout_then_recovers() {
    let server = Arc::new(RedisServer::start());
    let policy = Policy::from_toml_str(FAULTS).unwrap();
    let rt = multi_thread();
    let timeout = Duration::from_millis(200);
    rt.block_on(async {
        let store = RedisStore::builder(server.url())
            .timeout(timeout)
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::with_store(policy, store, SystemClock);
        let load = Load::default();
        let handles: Vec<_> = (0..16)
            .map(|k| {
                let tool = if k % 2 == 0 { "strict" } else { "lenient" };
                tokio::spawn(load.clone().call_until_stopped(limiter.clone(), tool))
            })
            .collect();
        // Gone once `kill` returns (it waits for the process): Redis admits nothing after.
        server.kill();
        let killed_at = Instant::now();
        let killed_us = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        tokio::time::sleep(Duration::from_millis(800)).await;
        let s = server.clone();
        let restarted_at = tokio::task::spawn_blocking(move || {
            assert!(s.spawn(), "restart on the same port");
            Instant::now()
        })
        .await
        .unwrap();
        // Calls succeed again within a second of Redis answering.
        load.wait_for_a_strict_call_after(restarted_at).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        load.stop.store(true, Ordering::Relaxed);
        for h in handles {
            h.await.unwrap();
        }
        let recovery = load.first_strict_call_after(restarted_at).unwrap() - restarted_at;
        let slowest = Duration::from_micros(load.slowest.load(Ordering::Relaxed));
        let outage: Vec<_> = load
            .outcomes
            .lock()
            .unwrap()
            .iter()
            // Started once Redis was gone (a call started before may have been admitted by
            // Redis, and end late on a loaded machine).
            .filter(|o| o.started > killed_at && o.ended < restarted_at)
            .copied()
            .collect();
        eprintln!(
            "slowest call {slowest:?}; {} calls during the outage ({} under charges made before it: leases); recovered {recovery:?} after the restart; {} store errors",
            outage.len(),
            outage.iter().filter(|o| o.charged_at.is_some()).count(),
            limiter.store().errors()
        );
        assert!(slowest < timeout + Duration::from_millis(150), "a call hung for {slowest:?}");
        assert!(recovery < Duration::from_secs(1), "recovery took {recovery:?}");
        each_answered_by_on_store_error(&outage, killed_us);
        assert!(limiter.store().errors() > 0);
    });
}

/// The outage test's callers: told when to stop, the slowest answer (µs) and every call.
#[derive(Clone, Default)]
struct Load {
    stop: Arc<AtomicBool>,
    slowest: Arc<AtomicU64>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
}

impl Load {
    /// A's calls of `tool` every 2 ms until told to stop, each kept; a refusal must be
    /// `store_unavailable`, retryable.
    async fn call_until_stopped(
        self,
        limiter: Limiter<RedisStore, SystemClock>,
        tool: &'static str,
    ) {
        let a = Caller::new("A");
        while !self.stop.load(Ordering::Relaxed) {
            let t0 = Instant::now();
            let r = limiter.admit(&a, tool, Cost(1.0)).await;
            self.slowest
                .fetch_max(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
            let (passed, charged_at) = match &r {
                Ok(t) => (true, t.admission().map(|a| a.at.as_micros())),
                Err(e) => {
                    assert_eq!(e.reason, Reason::StoreUnavailable, "{e}");
                    assert!(e.retryable);
                    (false, None)
                }
            };
            self.outcomes.lock().unwrap().push(Outcome {
                started: t0,
                ended: Instant::now(),
                tool,
                passed,
                charged_at,
            });
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// When the first `strict` call that ended after `t` passed.
    fn first_strict_call_after(&self, t: Instant) -> Option<Instant> {
        let outcomes = self.outcomes.lock().unwrap();
        let mut after = outcomes.iter().filter(|o| o.ended > t);
        after
            .find(|o| o.tool == "strict" && o.passed)
            .map(|o| o.ended)
    }

    /// Waits for a `strict` call that ends after `t` to pass: at most 3 s.
    async fn wait_for_a_strict_call_after(&self, t: Instant) {
        while self.first_strict_call_after(t).is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "no call succeeded within 3 s of the restart"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Each call of the outage (Redis gone at `killed_us`) answered by its tool's
/// `on_store_error`, with some of each kind seen. A call spent from its lease passes,
/// metered, either way: its grant was charged at Redis before Redis went away (a lease may
/// outlive the timeout). Nothing is charged after.
fn each_answered_by_on_store_error(outage: &[Outcome], killed_us: u64) {
    let before_the_kill = |o: &Outcome| o.charged_at.is_some_and(|at| at <= killed_us);
    assert!(outage.iter().any(|o| o.tool == "strict" && !o.passed));
    assert!(outage
        .iter()
        .any(|o| o.tool == "lenient" && o.passed && o.charged_at.is_none()));
    for o in outage {
        assert!(
            o.charged_at.is_none() || before_the_kill(o),
            "a {} call was charged at {:?} after Redis went away at {killed_us}",
            o.tool,
            o.charged_at
        );
        match o.tool {
            "strict" => assert!(
                !o.passed || before_the_kill(o),
                "a strict call passed while Redis was down"
            ),
            _ => assert!(o.passed, "a lenient call was not let through"),
        }
    }
}

fn plan_for<'p>(policy: &'p Policy, tenant: &'p Arc<str>, now: Timestamp) -> Plan<'p> {
    let tool = policy.tool("strict").unwrap();
    Plan {
        now,
        cost: 1.0,
        tool,
        tenant: LevelRef {
            name: tenant,
            policy: tool.tenant(tenant).unwrap(),
        },
        instance: None,
        untenanted: false,
    }
}

/// A slow Redis (`DEBUG SLEEP`) hits the timeout path, and calls succeed once it answers.
#[test]
fn a_slow_redis_hits_the_timeout() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(FAULTS).unwrap();
    let rt = current_thread();
    let timeout = Duration::from_millis(150);
    rt.block_on(async {
        let store = RedisStore::builder(server.url())
            .timeout(timeout)
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::with_store(policy.clone(), store, SystemClock);
        let a = Caller::new("A");

        assert!(limiter.admit(&a, "strict", Cost(1.0)).await.is_ok());
        let mut conn = server.conn();
        let sleeper = std::thread::spawn(move || {
            let _: () = redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("0.6")
                .query(&mut conn)
                .unwrap();
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let name = Arc::from("A");
        let plan = plan_for(&policy, &name, EPOCH);
        let t0 = Instant::now();
        let r = limiter.store().decide(std::slice::from_ref(&plan)).await;
        let took = t0.elapsed();
        assert!(
            matches!(r, Err(StoreError::Timeout(d)) if d == timeout),
            "{r:?}"
        );
        assert!(took < timeout + Duration::from_millis(100), "took {took:?}");
        // Through the limiter: the tool's mode (deny) applies.
        let refusal = limiter.admit(&a, "strict", Cost(1.0)).await.unwrap_err();
        assert_eq!(refusal.reason, Reason::StoreUnavailable);
        assert_eq!(limiter.store().errors(), 2);
        sleeper.join().unwrap();
        let t0 = Instant::now();
        loop {
            if limiter.admit(&a, "strict", Cost(1.0)).await.is_ok() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(1),
                "no recovery after the sleep"
            );
        }
    });
}

/// One tenant on a tool whose every call is decided at the store (no lease charges ahead).
const STRICT: &str = r#"
[[tool]]
name = "strict"
unit = "calls"
rate = { limit = 100000, per = "1s" }
lease = "off"
[tool.tenants.A]
"#;

/// A call decided on the records the worker remembers has its write sent without a read,
/// behind any other on its way (`batch::pipeline`). When the connection drops under that
/// write (here: held by `CLIENT PAUSE WRITE`, so it has surely not run, then the store's
/// connection killed), the call is decided again on the connection made again, unseen by the
/// caller, as a write of any other batch is — and counted once.
#[test]
fn a_write_sent_behind_others_that_meets_a_dropped_connection_is_tried_again() {
    let server = RedisServer::start();
    multi_thread().block_on(async {
        let (limiter, a, call, mut admin) =
            second_call_held(&server, Duration::from_secs(5), 10_000).await;
        wait_for_a_held_write(&mut admin).await;
        let killed: u64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .arg("SKIPME")
            .arg("yes")
            .query(&mut admin)
            .unwrap();
        assert!(killed >= 1);
        let _: () = redis::cmd("CLIENT")
            .arg("UNPAUSE")
            .query(&mut admin)
            .unwrap();
        let answer = call.await.unwrap();
        assert!(answer.is_ok(), "{answer:?}");
        assert_eq!(
            tenant_total(&limiter, &a, "strict").await,
            2.0,
            "both calls, each once"
        );
    });
}

/// A's second call on `strict`, on its way: after A's first call was admitted (the worker
/// remembers A's records, and sends the second call's write alone), with Redis holding every
/// write for `pause_ms` (`CLIENT PAUSE … WRITE`) from just before it. The store's timeout is
/// `timeout`. Returns the limiter, A, the call, and the connection that paused Redis.
async fn second_call_held(
    server: &RedisServer,
    timeout: Duration,
    pause_ms: u64,
) -> (
    Limiter<RedisStore, ManualClock>,
    Caller,
    tokio::task::JoinHandle<Result<(), tower_fairshare::Refusal>>,
    redis::Connection,
) {
    let clock = ManualClock::new(EPOCH);
    let store = RedisStore::builder(server.url())
        .injected_clock()
        .timeout(timeout)
        .health_checks_every(Duration::ZERO)
        .connect()
        .await
        .unwrap();
    let policy = Policy::from_toml_str(STRICT).unwrap();
    let limiter = Limiter::with_store(policy, store, clock.clone());
    let a = Caller::new("A");
    assert!(limiter.admit(&a, "strict", Cost(1.0)).await.is_ok());
    let mut admin = server.conn();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(pause_ms)
        .arg("WRITE")
        .query(&mut admin)
        .unwrap();
    clock.advance(Duration::from_millis(1));
    let call = tokio::spawn({
        let (limiter, a) = (limiter.clone(), a.clone());
        async move { limiter.admit(&a, "strict", Cost(1.0)).await.map(|_| ()) }
    });
    (limiter, a, call, admin)
}

/// Until the store's connection waits in a paused Redis: the call's write held there, or a
/// write of the store's own upkeep (its announcement every second) that the call's write,
/// sent on the same connection, waits behind.
async fn wait_for_a_held_write(admin: &mut redis::Connection) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let clients: String = redis::cmd("CLIENT").arg("LIST").query(admin).unwrap();
        if clients.lines().any(|l| l.contains("flags=b")) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the write never reached Redis: {clients}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A write that ran in Redis but whose answer never came back (the connection cut as Redis
/// answered) is found to have landed on the connection made again: its calls are answered as
/// it decided them, counted once, not decided and counted a second time.
#[test]
fn a_write_that_landed_but_whose_answer_was_lost_counts_once() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(STRICT).unwrap();
    multi_thread().block_on(async {
        let (proxy, limiter, clock) = behind_cut_proxy(&server, policy).await;
        let a = Caller::new("A");
        // Read once: A's next call is decided on the records the worker remembers, and its
        // round trip is the write alone.
        let first = limiter.admit(&a, "strict", Cost(1.0)).await.map(|_| ());
        assert!(first.is_ok(), "{first:?}");
        proxy.cut_answer_of(0);
        clock.advance(Duration::from_millis(1));
        let answer = limiter.admit(&a, "strict", Cost(1.0)).await.map(|_| ());
        assert_eq!(proxy.cuts(), 1, "the write's answer was cut off");
        assert!(answer.is_ok(), "{answer:?}");
        assert_eq!(
            tenant_total(&limiter, &a, "strict").await,
            2.0,
            "both calls, each once"
        );
    });
}

/// Two calls of one tenant whose writes both landed unanswered: the second, decided on the
/// records the first wrote and sent behind it on the same connection, wrote over every record
/// the first wrote; that it landed proves the first did (it expected the first's versions).
/// Each call is counted once.
#[test]
fn a_write_sent_behind_a_landed_one_proves_it_landed() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(STRICT).unwrap();
    multi_thread().block_on(async {
        let (proxy, limiter, clock) = behind_cut_proxy(&server, policy).await;
        let a = Caller::new("A");
        let first = limiter.admit(&a, "strict", Cost(1.0)).await.map(|_| ());
        assert!(first.is_ok(), "{first:?}");
        // The first write's answer is held a while, then the connection closed: the second
        // call's write goes out behind it meanwhile, runs, and its answer is lost too.
        proxy.hold(300);
        proxy.cut_answer_of(0);
        clock.advance(Duration::from_millis(1));
        let call = |limiter: &Limiter<RedisStore, ManualClock>| {
            let (limiter, a) = (limiter.clone(), a.clone());
            tokio::spawn(async move { limiter.admit(&a, "strict", Cost(1.0)).await.map(|_| ()) })
        };
        let second = call(&limiter);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !proxy.cut_call_sent() {
            assert!(Instant::now() < deadline, "the write never went out");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let third = call(&limiter);
        let (second, third) = (second.await.unwrap(), third.await.unwrap());
        assert_eq!(proxy.cuts(), 1, "the answers were cut off");
        assert!(second.is_ok() && third.is_ok(), "{second:?} {third:?}");
        assert_eq!(
            tenant_total(&limiter, &a, "strict").await,
            3.0,
            "three calls, each once"
        );
    });
}

/// The same on a tool that caps calls in flight: the call whose write landed unanswered holds
/// the permit that write took (it is not given back and taken again), and gives it back when
/// its call is released.
#[test]
fn a_capped_call_whose_write_landed_unanswered_holds_one_permit() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(
        r#"
[[tool]]
name = "capped"
unit = "calls"
rate = { limit = 100000, per = "1s" }
max_concurrency = 2
lease = "off"
[tool.tenants.A]
"#,
    )
    .unwrap();
    multi_thread().block_on(async {
        let (proxy, limiter, clock) = behind_cut_proxy(&server, policy).await;
        let a = Caller::new("A");
        let first = limiter.admit(&a, "capped", Cost(1.0)).await.unwrap();
        // A call counting permits is read from Redis: its read, then its write.
        proxy.cut_answer_of(1);
        clock.advance(Duration::from_millis(1));
        let second = limiter.admit(&a, "capped", Cost(1.0)).await.unwrap();
        assert_eq!(proxy.cuts(), 1, "the write's answer was cut off");
        assert_eq!(
            tenant_total(&limiter, &a, "capped").await,
            2.0,
            "both calls, each once"
        );
        let keys = limiter.call_keys(&a, "capped").unwrap();
        let state = limiter.store().inspect(&keys).await.unwrap();
        assert_eq!(state[0].unwrap().in_flight, 2.0, "one permit a call");
        let third = limiter.admit(&a, "capped", Cost(1.0)).await;
        let refused = third.expect_err("both permits are held");
        assert_eq!(refused.reason, Reason::ConcurrencyExceeded);
        limiter.release(&first).await;
        limiter.release(&second).await;
        let state = limiter.store().inspect(&keys).await.unwrap();
        assert_eq!(state[0].unwrap().in_flight, 0.0, "every permit back");
    });
}

/// Units through `caller`'s tenant on `tool` in the current window, as Redis holds them.
async fn tenant_total<C: tower_fairshare::Clock>(
    limiter: &Limiter<RedisStore, C>,
    caller: &Caller,
    tool: &str,
) -> f64 {
    let keys = limiter.call_keys(caller, tool).unwrap();
    let state = limiter.store().inspect(&keys).await.unwrap();
    state[1].unwrap().total
}

/// A limiter deciding `policy` on `server` through a [`CutProxy`], its clock injected at
/// `EPOCH`.
async fn behind_cut_proxy(
    server: &RedisServer,
    policy: Policy,
) -> (CutProxy, Limiter<RedisStore, ManualClock>, ManualClock) {
    let proxy = CutProxy::start(server).await;
    let clock = ManualClock::new(EPOCH);
    let store = RedisStore::builder(proxy.url())
        .injected_clock()
        .timeout(Duration::from_secs(5))
        .health_checks_every(Duration::ZERO)
        .connect()
        .await
        .unwrap();
    let limiter = Limiter::with_store(policy, store, clock.clone());
    (proxy, limiter, clock)
}

/// A loopback proxy to a Redis server that, once armed, lets a batch-script call through and
/// closes its connection when Redis answers it: the script ran, its answer is lost.
/// Connections made after that are relayed whole.
struct CutProxy {
    port: u16,
    /// Batch-script calls to relay before the one whose answer is cut (-1: none is).
    armed: Arc<AtomicI64>,
    /// How long the cut answer is held (ms) before the connection is closed: what the
    /// client sends meanwhile still reaches Redis, and nothing comes back.
    hold_ms: Arc<AtomicU64>,
    cuts: Arc<AtomicU64>,
}

impl CutProxy {
    async fn start(server: &RedisServer) -> CutProxy {
        let upstream = server.url();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = CutProxy {
            port: listener.local_addr().unwrap().port(),
            armed: Arc::new(AtomicI64::new(-1)),
            hold_ms: Arc::new(AtomicU64::new(0)),
            cuts: Arc::new(AtomicU64::new(0)),
        };
        let (armed, hold, cuts) = (
            proxy.armed.clone(),
            proxy.hold_ms.clone(),
            proxy.cuts.clone(),
        );
        let to = upstream
            .trim_start_matches("redis://")
            .trim_end_matches('/')
            .to_owned();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&to).await.unwrap();
                let (armed, hold, cuts) = (armed.clone(), hold.clone(), cuts.clone());
                tokio::spawn(relay(client, server, armed, hold, cuts));
            }
        });
        proxy
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Cuts the answer of the batch-script call that comes after `skip` more.
    fn cut_answer_of(&self, skip: i64) {
        self.armed.store(skip, Ordering::SeqCst);
    }

    /// Holds the cut answer `ms` before closing the connection.
    fn hold(&self, ms: u64) {
        self.hold_ms.store(ms, Ordering::SeqCst);
    }

    /// Whether the call whose answer is to be cut has been sent.
    fn cut_call_sent(&self) -> bool {
        self.armed.load(Ordering::SeqCst) < 0
    }

    fn cuts(&self) -> u64 {
        self.cuts.load(Ordering::SeqCst)
    }
}

/// Relays one connection both ways until either side closes, or until Redis answers the
/// batch-script call sent while the proxy was armed (that answer is not relayed).
async fn relay(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    armed: Arc<AtomicI64>,
    hold_ms: Arc<AtomicU64>,
    cuts: Arc<AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let script = redis::Script::new(include_str!("../src/store/redis/cycle.lua"));
    let sha = script.get_hash().as_bytes().to_vec();
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let sent = Arc::new(AtomicBool::new(false));
    let up = {
        let sent = sent.clone();
        async move {
            let mut buf = vec![0u8; 1 << 16];
            while let Ok(n @ 1..) = from_client.read(&mut buf).await {
                let call = buf[..n].windows(sha.len()).any(|w| w == sha);
                if call && armed.fetch_sub(1, Ordering::SeqCst) == 0 {
                    sent.store(true, Ordering::SeqCst);
                }
                if to_server.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n @ 1..) = from_server.read(&mut buf).await {
            if sent.load(Ordering::SeqCst) {
                let hold = hold_ms.load(Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(hold)).await;
                cuts.fetch_add(1, Ordering::SeqCst);
                return;
            }
            if to_client.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// A limiter on `server` with the injected clock at `EPOCH`, and the caller `parasite`, whose
/// ceiling of 3 a minute (burst 3) its first three calls have spent.
async fn parasite_at_its_ceiling(
    server: &RedisServer,
    policy: Policy,
) -> (Limiter<RedisStore, ManualClock>, ManualClock, Caller) {
    let store = RedisStore::builder(server.url())
        .injected_clock()
        .connect()
        .await
        .unwrap();
    let clock = ManualClock::new(EPOCH);
    let limiter = Limiter::with_store(policy, store, clock.clone());
    let parasite = Caller::new("parasite");
    for _ in 0..3 {
        limiter.admit(&parasite, "report", Cost(1.0)).await.unwrap();
    }
    (limiter, clock, parasite)
}

/// After a refusal with retry time t, the same caller's calls on this replica cost no Redis
/// command until t (INFO commandstats), other callers still reach Redis, and at t the caller
/// is decided by Redis again.
#[test]
fn the_refusal_cache_sends_nothing_to_redis_until_the_retry_time() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "report"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.tenants.parasite]
        ceiling = 3
        burst = 3
        [tool.tenants.other]
        "#,
    )
    .unwrap();
    let rt = current_thread();
    let mut info = server.conn();
    rt.block_on(async {
        let (limiter, clock, parasite) = parasite_at_its_ceiling(&server, policy).await;
        let first = limiter
            .admit(&parasite, "report", Cost(1.0))
            .await
            .unwrap_err();
        assert_eq!(first.reason, Reason::RateLimited);
        let reset = first.reset_at.unwrap();
        let scripts =
            |c: &mut redis::Connection| command_calls(c, "evalsha") + command_calls(c, "eval");
        let before = scripts(&mut info);
        // A flood of 10,000 calls spread over the time until the retry time.
        let span = reset.as_micros() - EPOCH.as_micros();
        for i in 0..10_000u64 {
            clock.set(Timestamp(EPOCH.as_micros() + span * i / 10_000));
            let r = limiter
                .admit(&parasite, "report", Cost(1.0))
                .await
                .unwrap_err();
            assert_eq!(r.reason, Reason::RateLimited);
            let left = reset.as_micros() - clock.now_micros();
            assert_eq!(r.retry_after, Some(Duration::from_micros(left)));
        }
        assert_eq!(scripts(&mut info), before, "the flood reached Redis");
        assert_eq!(limiter.store().cached_refusals(), 10_000);
        // Another caller is decided by Redis as usual.
        limiter
            .admit(&Caller::new("other"), "report", Cost(1.0))
            .await
            .unwrap();
        // (a read and a write)
        assert_eq!(scripts(&mut info), before + 2);
        // At the retry time the parasite is decided again, and admitted: on the records the
        // store last read and wrote (nobody else wrote them), so one script, the write.
        clock.set(reset);
        limiter.admit(&parasite, "report", Cost(1.0)).await.unwrap();
        assert_eq!(scripts(&mut info), before + 3);
    });
}

/// A reload decides afresh: a refusal cached under the old policy does not refuse a call the
/// new one admits.
#[test]
fn a_reload_forgets_the_cached_refusals() {
    let server = RedisServer::start();
    let policy = |ceiling: u32| {
        Policy::from_toml_str(&format!(
            "[[tool]]\nname = \"report\"\nunit = \"calls\"\nrate = {{ limit = 600, per = \"1m\" }}\n\
             [tool.tenants.parasite]\nceiling = {ceiling}\nburst = 3\n"
        ))
        .unwrap()
    };
    let rt = current_thread();
    rt.block_on(async {
        let (limiter, clock, parasite) = parasite_at_its_ceiling(&server, policy(3)).await;
        let first = limiter.admit(&parasite, "report", Cost(1.0)).await;
        assert_eq!(first.unwrap_err().reason, Reason::RateLimited);
        assert!(limiter.admit(&parasite, "report", Cost(1.0)).await.is_err());
        assert!(
            limiter.store().cached_refusals() > 0,
            "the refusal was cached"
        );
        // The refusal stands 20 s under a ceiling of 3 a minute; under 300 a minute the tenant
        // has a unit again after 200 ms.
        limiter.set_policy(policy(300));
        clock.advance(Duration::from_millis(250));
        limiter
            .admit(&parasite, "report", Cost(1.0))
            .await
            .expect("the new policy has room: decided afresh, not refused from the cache");
    });
}

trait NowMicros {
    fn now_micros(&self) -> u64;
}

impl NowMicros for ManualClock {
    fn now_micros(&self) -> u64 {
        tower_fairshare::Clock::now(self).as_micros()
    }
}

/// Every key carries a TTL, and once idle callers expire their keys are gone from Redis.
#[test]
fn idle_callers_keys_expire_from_redis() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "t"
        unit = "calls"
        rate = { limit = 20, per = "1s" }
        max_concurrency = 10
        [tool.tenants.A]
        floor = 5
        [tool.tenants.A.default_instance]
        max_instances = 5
        [tool.default_tenant]
        max_tenants = 10
        "#,
    )
    .unwrap();
    let rt = current_thread();
    let mut conn = server.conn();
    rt.block_on(async {
        // Redis's own clock: the TTLs are what a deployment gets (an injected clock's records
        // are kept at least ten minutes, whatever their expiry).
        let store = RedisStore::builder(server.url()).connect().await.unwrap();
        let clock = ManualClock::new(EPOCH);
        let limiter = Limiter::with_store(policy, store, clock.clone());
        let callers = [
            Caller::new("A").with_instance("i1"),
            Caller::new("A").with_instance("i2"),
            Caller::new("g1"),
            Caller::new("g2"),
        ];
        for c in &callers {
            let t = limiter.admit(c, "t", Cost(1.0)).await.unwrap();
            limiter.release(&t).await;
        }
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
        // tool + epoch marker, A + 2 instances, 2 guests: template callers are counted in their
        // parents' records, with no key of their own. (The replicas' entries aside.)
        let keys: Vec<String> = keys
            .into_iter()
            .filter(|k| !k.ends_with("fs{replicas}@"))
            .collect();
        assert_eq!(keys.len(), 7, "{keys:?}");
        // Every key Redis holds for them expires on its own within two periods of idleness (a
        // template caller counts to the end of the next window; Redis's own TTLs, so nothing
        // is left behind; no waiting for it here); the tool's epoch marker 32 days after the
        // last store that read it (longer than any record lives: a month's budget).
        for k in &keys {
            let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut conn).unwrap();
            if k.ends_with('@') {
                assert!(ttl > 0 && ttl <= 32 * 86_400_000, "{k}: PTTL {ttl}");
            } else {
                assert!(ttl > 0 && ttl <= 2000, "{k}: PTTL {ttl}");
            }
        }
    });
}

/// NOSCRIPT (a restarted or flushed script cache) reloads the script transparently, and a
/// permit released twice never drives in-flight below zero.
#[test]
fn noscript_reloads_and_release_never_goes_below_zero() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "t"
        unit = "calls"
        rate = { limit = 1000, per = "1m" }
        max_concurrency = 3
        [tool.tenants.A]
        max_concurrency = 2
        "#,
    )
    .unwrap();
    let rt = current_thread();
    let mut conn = server.conn();
    rt.block_on(async {
        let store = RedisStore::builder(server.url()).connect().await.unwrap();
        let limiter = Limiter::with_store(policy, store, SystemClock);
        let a = Caller::new("A");
        let keys = limiter.call_keys(&a, "t").unwrap();
        let t1 = limiter.admit(&a, "t", Cost(1.0)).await.unwrap();
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
        let t2 = limiter.admit(&a, "t", Cost(1.0)).await.unwrap();
        assert_eq!(limiter.store().errors(), 0);
        for _ in 0..3 {
            limiter.release(&t1).await;
            limiter.release(&t2).await;
        }
        let state = limiter.store().inspect(&keys).await.unwrap();
        // (A state whose last permit came back may already be gone: fresh means 0 in flight.)
        assert_eq!(state[0].as_ref().map_or(0.0, |s| s.in_flight), 0.0);
        assert_eq!(state[1].as_ref().map_or(0.0, |s| s.in_flight), 0.0);
        // Both permits are free again.
        let _x = limiter.admit(&a, "t", Cost(1.0)).await.unwrap();
        let _y = limiter.admit(&a, "t", Cost(1.0)).await.unwrap();
        assert_eq!(
            limiter.admit(&a, "t", Cost(1.0)).await.unwrap_err().reason,
            Reason::ConcurrencyExceeded
        );
    });
}

const CANCEL: &str = r#"
[[tool]]
name = "t"
unit = "calls"
rate = { limit = 100000, per = "1s" }
max_concurrency = 8
budgets = [ { period = "day", max = 1000000 } ]
on_store_error = "allow"
[tool.tenants.parasite]
[tool.default_tenant]
"#;

/// Cancellation: one tenant's 1,000 decisions dropped while in flight (clients that
/// disconnect), and more cut off by the store's timeout while Redis is stalled, leave nothing
/// behind. A call whose caller left before it was decided is never decided; one decided after
/// its caller left (it took a permit, it was charged) is given back in the background
/// (`RedisStore::abandoned` counts those; the soak sees hundreds). Afterwards the tool holds no
/// permit, its counters and budget are back to zero, and every other tenant is admitted at
/// once.
#[test]
fn dropped_and_timed_out_decisions_give_back_every_permit_and_unit() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(CANCEL).unwrap();
    let rt = multi_thread();
    rt.block_on(async {
        let clock = ManualClock::new(EPOCH);
        let patient = RedisStore::builder(server.url())
            .injected_clock()
            .refusal_cache(false)
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .unwrap();
        let hasty = RedisStore::builder(server.url())
            .injected_clock()
            .refusal_cache(false)
            .timeout(Duration::from_millis(50))
            .connect()
            .await
            .unwrap();
        let a = Limiter::with_store(policy.clone(), patient, clock.clone());
        let b = Limiter::with_store(policy, hasty, clock.clone());
        let parasite = Caller::new("parasite");
        leave_in_flight(&a, &parasite, 1000).await;
        let keys = a.call_keys(&parasite, "t").unwrap();
        // (A caller gone before its call was decided is never decided: only those decided
        // first had anything to give back.)
        nothing_charged(settled(&a, &keys).await.levels);
        // Redis stalls: 20 decisions sent meanwhile hit the 50 ms timeout, and run once it
        // answers again. The tool fails open, so each of those calls runs unmetered.
        let mut conn = server.conn();
        let sleeper = std::thread::spawn(move || {
            let _: () = redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("0.5")
                .query(&mut conn)
                .unwrap();
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut cut_off = tokio::task::JoinSet::new();
        for _ in 0..20 {
            let (b, parasite) = (b.clone(), parasite.clone());
            cut_off.spawn(async move { b.admit(&parasite, "t", Cost(1.0)).await });
        }
        while let Some(t) = cut_off.join_next().await {
            let t = t.unwrap().unwrap();
            assert!(t.admission().is_none(), "cut off by the timeout: unmetered");
        }
        sleeper.join().unwrap();
        // Once Redis answers, calls whose callers left before they were decided are dropped;
        // any decided after its caller left is given back. Either way nothing stays charged.
        tokio::time::sleep(Duration::from_millis(50)).await;
        nothing_charged(settled(&a, &keys).await.levels);
        // Every other tenant is admitted at once: all 8 permits of the tool are free.
        let mut held = Vec::new();
        for i in 0..8 {
            let t = a
                .admit(&Caller::new(format!("other-{i}")), "t", Cost(1.0))
                .await
                .unwrap_or_else(|r| panic!("other-{i} refused: {r}"));
            held.push(t);
        }
        for t in &held {
            a.release(t).await;
        }
    });
}

/// A write held in Redis past the worker's bound (20× the timeout, at least 5 s; here by
/// `CLIENT PAUSE WRITE`) lands when Redis lets it run, after the worker stopped waiting for it
/// and its caller was refused (the store timed out). It is looked for there, as a write whose
/// connection broke is: it landed, so its call, whose caller has left, is given back. Nothing
/// stays charged for a call no caller was admitted by.
#[test]
fn a_write_that_lands_after_the_worker_stopped_waiting_is_given_back() {
    let server = RedisServer::start();
    multi_thread().block_on(async {
        let (limiter, a, call, mut admin) =
            second_call_held(&server, Duration::from_millis(250), 6_500).await;
        wait_for_a_held_write(&mut admin).await;
        let refused = call.await.unwrap().unwrap_err();
        assert_eq!(refused.reason, Reason::StoreUnavailable);
        // The pause ends after the worker's bound: the write lands, and the worker finds it.
        // (Reads of the state time out until then.)
        let keys = limiter.call_keys(&a, "strict").unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        let total = loop {
            let total = match limiter.store().inspect(&keys).await {
                Ok(s) => s[1].map(|t| t.total),
                Err(_) => None,
            };
            if total == Some(1.0) || Instant::now() > deadline {
                break total;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(total, Some(1.0), "only the admitted call stays counted");
    });
}

const BUSY: &str = r#"
[[tool]]
name = "t"
unit = "calls"
rate = { limit = 100000, per = "1s" }
max_concurrency = 5
[tool.default_tenant]
"#;

/// A replica killed while its calls held permits: its permits stop counting within the permit
/// TTL by themselves, although the tool stays busy (another replica admits and releases calls
/// all along); a live replica that renews its permits keeps them past the TTL.
/// A replica on `url` with an injected clock, no refusal cache and permits that lapse after
/// `ttl`.
async fn short_lived_permits(
    url: String,
    policy: &Policy,
    clock: &ManualClock,
    ttl: Duration,
) -> Limiter<RedisStore, ManualClock> {
    let store = RedisStore::builder(url)
        .injected_clock()
        .refusal_cache(false)
        .permit_ttl(ttl)
        .connect()
        .await
        .unwrap();
    Limiter::with_store(policy.clone(), store, clock.clone())
}

#[test]
fn a_dead_replicas_permits_lapse_within_the_permit_ttl_while_the_tool_stays_busy() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(BUSY).unwrap();
    let rt = current_thread();
    let ttl = Duration::from_secs(5);
    rt.block_on(async {
        let clock = ManualClock::new(EPOCH);
        let replica = || short_lived_permits(server.url(), &policy, &clock, ttl);
        let doomed = replica().await;
        for i in 0..4 {
            doomed
                .admit(&Caller::new(format!("d{i}")), "t", Cost(1.0))
                .await
                .unwrap();
        }
        // Killed: its tickets are never released, nothing renews its permits.
        drop(doomed);
        let live = replica().await;
        // `x` holds a call all along (renewed); `y` comes and goes every 100 ms.
        let x = Caller::new("x");
        let long = live.admit(&x, "t", Cost(1.0)).await.unwrap();
        let freed_at = when_dead_permits_lapse(&live, &clock).await;
        let freed_at = freed_at.expect("the dead replica's permits never lapsed");
        assert!(
            freed_at >= ttl && freed_at <= ttl + Duration::from_millis(100),
            "freed at {freed_at:?}, permit TTL {ttl:?}"
        );
        // `x`'s call, 8 s old, still holds its permit: renewed, it counts.
        assert_eq!(live.store().permits_held(), 1);
        let mut held = Vec::new();
        for i in 0..4 {
            let t = live
                .admit(&Caller::new(format!("n{i}")), "t", Cost(1.0))
                .await;
            held.push(t.unwrap());
        }
        let fifth = live.admit(&Caller::new("n4"), "t", Cost(1.0)).await;
        assert_eq!(
            fifth.unwrap_err().reason,
            Reason::ConcurrencyExceeded,
            "the renewed permit stopped counting"
        );
        live.release(&long).await;
        for t in &held {
            live.release(t).await;
        }
        assert_eq!(live.store().permits_held(), 0);
        let keys = live.call_keys(&x, "t").unwrap();
        let state = live.store().inspect(&keys).await.unwrap();
        assert_eq!(state[0].as_ref().map_or(0.0, |s| s.in_flight), 0.0);
    });
}

/// Eight seconds of `y` calling every 100 ms on `live` (its permits renewed every second),
/// beside one call held and four dead permits of the cap of 5: when a second call beside
/// `y`'s first fits, i.e. the dead permits have lapsed.
async fn when_dead_permits_lapse(
    live: &Limiter<RedisStore, ManualClock>,
    clock: &ManualClock,
) -> Option<Duration> {
    let y = Caller::new("y");
    let mut freed_at = None;
    for step in 1..=80u64 {
        clock.set(EPOCH.saturating_add(Duration::from_millis(100 * step)));
        if step % 10 == 0 {
            let now = tower_fairshare::Clock::now(live.clock());
            live.store().renew_permits(now).await.unwrap();
        }
        let t = match live.admit(&y, "t", Cost(1.0)).await {
            Ok(t) => t,
            Err(r) => {
                assert_eq!(r.reason, Reason::ConcurrencyExceeded);
                continue;
            }
        };
        if freed_at.is_none() {
            // 1 + 4 dead permits: the 6th call fits only once the dead ones lapse.
            if let Ok(t2) = live.admit(&Caller::new("z"), "t", Cost(1.0)).await {
                freed_at = Some(Duration::from_millis(100 * step));
                live.release(&t2).await;
            }
        }
        live.release(&t).await;
    }
    freed_at
}

/// A replica starts while Redis is down: every call follows its tool's `on_store_error`
/// (deny: `store_unavailable`; allow: through, unmetered), and decisions go to Redis as soon as
/// it answers.
#[test]
fn a_store_started_while_redis_is_down_connects_when_it_returns() {
    let server = Arc::new(RedisServer::start());
    server.kill();
    let policy = Policy::from_toml_str(FAULTS).unwrap();
    let rt = multi_thread();
    rt.block_on(async {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_millis(100))
            .connect_lazy()
            .unwrap();
        let limiter = Limiter::with_store(policy, store, SystemClock);
        let a = Caller::new("A");
        let refusal = limiter.admit(&a, "strict", Cost(1.0)).await.unwrap_err();
        assert_eq!(refusal.reason, Reason::StoreUnavailable);
        let through = limiter.admit(&a, "lenient", Cost(1.0)).await.unwrap();
        assert!(through.admission().is_none(), "fail open: unmetered");
        let s = server.clone();
        tokio::task::spawn_blocking(move || assert!(s.spawn(), "Redis starts"))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match limiter.admit(&a, "strict", Cost(1.0)).await {
                Ok(t) => {
                    assert!(t.admission().is_some(), "decided by Redis");
                    break;
                }
                Err(r) => assert_eq!(r.reason, Reason::StoreUnavailable),
            }
            assert!(Instant::now() < deadline, "never connected");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// State loss is visible: the store warns when the server can evict its keys or keeps
/// nothing on disk, and notices when a tool's state is gone (a flush, a restart without
/// persistence): logged, counted, and in the metrics.
#[cfg(feature = "metrics")]
#[test]
fn lost_state_and_a_risky_configuration_are_reported() {
    use metrics_exporter_prometheus::PrometheusBuilder;
    let server = RedisServer::start();
    let mut conn = server.conn();
    let config = |conn: &mut redis::Connection, name: &str, value: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(conn)
            .unwrap();
    };
    config(&mut conn, "maxmemory-policy", "allkeys-lru");
    let policy = Policy::from_toml_str(FAULTS).unwrap();
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        current_thread().block_on(async {
            // No background checks: this test checks by hand.
            let store = RedisStore::builder(server.url())
                .health_checks_every(Duration::ZERO)
                .connect()
                .await
                .unwrap();
            let limiter = Limiter::with_store(policy, store, SystemClock);
            let a = Caller::new("A");
            limiter.admit(&a, "strict", Cost(1.0)).await.unwrap();
            let h = limiter.store().check_health().await.unwrap();
            assert_eq!(h.eviction_policy.as_deref(), Some("allkeys-lru"));
            assert_eq!(h.persistence, Some(false));
            assert_eq!(h.warnings.len(), 2, "{:?}", h.warnings);
            assert!(h.lost_tools.is_empty());
            let _: () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
            let h = limiter.store().check_health().await.unwrap();
            assert_eq!(h.lost_tools, ["strict"]);
            assert_eq!(h.states_lost, 1);
            // Noticed once: the marker is set again.
            let h = limiter.store().check_health().await.unwrap();
            assert!(h.lost_tools.is_empty());
            // A restart without persistence loses it again; this one keeps it from now on.
            server.kill();
            assert!(server.spawn());
            let mut conn = server.conn();
            config(&mut conn, "appendonly", "yes");
            let deadline = Instant::now() + Duration::from_secs(5);
            while limiter.admit(&a, "strict", Cost(1.0)).await.is_err() {
                assert!(Instant::now() < deadline, "no reconnection");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // The decision that read the emptied state noticed the loss itself, in its own
            // round trip: the check after it finds nothing new.
            let h = limiter.store().check_health().await.unwrap();
            assert!(h.lost_tools.is_empty(), "{:?}", h.lost_tools);
            assert_eq!(h.states_lost, 2);
            assert_eq!(h.eviction_policy.as_deref(), Some("noeviction"));
            assert_eq!(h.persistence, Some(true));
            assert!(h.warnings.is_empty(), "{:?}", h.warnings);
        })
    });
    let text = handle.render();
    let find = |name: &str, labels: &[&str]| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
            .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    use tower_fairshare::telemetry::{STORE_RISK, STORE_STATE_LOST};
    assert_eq!(find(STORE_STATE_LOST, &["tool=\"strict\""]), 2.0);
    assert_eq!(find(STORE_RISK, &["risk=\"eviction\""]), 0.0);
    assert_eq!(find(STORE_RISK, &["risk=\"no_persistence\""]), 0.0);
}

/// While Redis is down the store fails fast: after three decisions in a row could not reach
/// it, calls get the tool's `on_store_error` at once (no waiting out the timeout, nothing left
/// waiting for Redis) and only one probe per 100 ms goes out; the first answer closes it.
#[test]
fn an_outage_fails_fast_with_one_probe_per_100_ms() {
    let server = Arc::new(RedisServer::start());
    let policy = Policy::from_toml_str(FAULTS).unwrap();
    let rt = current_thread();
    rt.block_on(async {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_millis(100))
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::with_store(policy, store, SystemClock);
        let a = Caller::new("A");
        limiter.admit(&a, "strict", Cost(1.0)).await.unwrap();
        server.kill();
        let started = Instant::now();
        for _ in 0..2000 {
            let r = limiter.admit(&a, "strict", Cost(1.0)).await.unwrap_err();
            assert_eq!(r.reason, Reason::StoreUnavailable);
        }
        let took = started.elapsed();
        // Three attempts opened it, then at most one probe per 100 ms started.
        let attempts = limiter.store().errors();
        let probes = took.as_millis() as u64 / 100 + 1;
        assert!(
            attempts <= 3 + probes,
            "{attempts} calls reached for Redis in {took:?}"
        );
        assert!(server.spawn());
        let deadline = Instant::now() + Duration::from_secs(5);
        while limiter.admit(&a, "strict", Cost(1.0)).await.is_err() {
            assert!(Instant::now() < deadline, "never closed again");
        }
    });
}

/// Reading a state as a decision would (`inspect_at`: the console, `Limiter::explain`) counts
/// a caller's calls in flight as the decision does: a dead replica's permits that have lapsed
/// do not count, although nothing has pruned them yet; and `explain` agrees with the call that
/// follows. (`inspect` still shows every permit held.)
#[test]
fn reading_a_state_counts_only_permits_that_have_not_lapsed() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "t"
        unit = "calls"
        rate = { limit = 100000, per = "1s" }
        [tool.default_tenant]
        max_concurrency = 1
        "#,
    )
    .unwrap();
    let rt = current_thread();
    let ttl = Duration::from_secs(5);
    rt.block_on(async {
        let clock = ManualClock::new(EPOCH);
        let replica = || short_lived_permits(server.url(), &policy, &clock, ttl);
        let d = Caller::new("d");
        let doomed = replica().await;
        doomed.admit(&d, "t", Cost(1.0)).await.unwrap();
        drop(doomed);
        let live = replica().await;
        let keys = live.call_keys(&d, "t").unwrap();
        clock.set(EPOCH.saturating_add(Duration::from_secs(1)));
        live.admit(&Caller::new("other"), "t", Cost(1.0))
            .await
            .unwrap();
        let held = live
            .store()
            .inspect_at(&keys, tower_fairshare::Clock::now(&clock))
            .await
            .unwrap()[1]
            .unwrap();
        assert_eq!(
            held.in_flight, 1.0,
            "the dead replica's permit, not lapsed yet"
        );
        let e = live.explain(&d, "t", Cost(1.0)).await.unwrap();
        assert_eq!(e.why.reason, Some("concurrency_exceeded"), "{e:?}");
        // Past the permit TTL: lapsed, though still in Redis (nobody wrote `d` since).
        clock.set(EPOCH.saturating_add(ttl + Duration::from_secs(1)));
        live.admit(&Caller::new("other"), "t", Cost(1.0))
            .await
            .unwrap();
        let held = live
            .store()
            .inspect_at(&keys, tower_fairshare::Clock::now(&clock))
            .await
            .unwrap()[1]
            .unwrap();
        assert_eq!(held.in_flight, 0.0, "a lapsed permit counted");
        let raw = live.store().inspect(&keys).await.unwrap()[1].unwrap();
        assert_eq!(raw.in_flight, 1.0, "still held in Redis");
        let e = live.explain(&d, "t", Cost(1.0)).await.unwrap();
        assert!(e.admitted, "{e:?}");
        assert!(live.admit(&d, "t", Cost(1.0)).await.is_ok());
    });
}

/// An injected clock need not pass at Redis's pace (the differential test spends real
/// milliseconds on virtual ones): its records are kept at least ten minutes of real time, so
/// Redis does not drop one its virtual expiry still needs within ten real minutes (a record
/// kept past its expiry is as good as fresh).
#[test]
fn with_an_injected_clock_records_outlive_a_slow_virtual_clock() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "t"
        unit = "calls"
        rate = { limit = 10, per = "1s" }
        max_concurrency = 2
        [tool.default_tenant]
        "#,
    )
    .unwrap();
    let rt = current_thread();
    let mut conn = server.conn();
    rt.block_on(async {
        let store = RedisStore::builder(server.url())
            .injected_clock()
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::with_store(policy, store, ManualClock::new(EPOCH));
        let t = limiter
            .admit(&Caller::new("g"), "t", Cost(1.0))
            .await
            .unwrap();
        // While the call holds its permit, renewing it keeps its zset's TTL (never shortens it
        // to the permit TTL).
        limiter.store().renew_permits(EPOCH).await.unwrap();
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
        assert!(
            keys.iter().any(|k| k.ends_with('!')),
            "a permit zset: {keys:?}"
        );
        for k in keys.iter().filter(|k| !k.ends_with('@')) {
            let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut conn).unwrap();
            assert!(ttl > 590_000, "{k}: PTTL {ttl} while a permit is held");
        }
        limiter.release(&t).await;
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
        assert!(keys.len() >= 2, "{keys:?}");
        for k in keys.iter().filter(|k| !k.ends_with('@')) {
            let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut conn).unwrap();
            // A virtual second's expiry; at least ten real minutes (less what has passed).
            assert!(ttl > 590_000, "{k}: PTTL {ttl}");
        }
    });
}

/// Two replicas deciding back to back for one tool: every write of the tool's records races
/// the other replica's. A replica whose reads ride on its writes used to win every race, and
/// the other's decisions failed after 16 lost races ("other replicas kept writing"), which
/// also tripped its breaker: every call of it then failed as `store_unavailable`. The turn
/// (a replica that lost a race claims the next write) lets both progress: no call fails.
#[test]
fn two_replicas_racing_for_one_tool_both_progress() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(
        r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 1000000000, per = "1s" }
[tool.default_tenant]
max_tenants = 1000
"#,
    )
    .unwrap();
    let clock = ManualClock::new(EPOCH);
    let (ok, failed) = race(&server, &policy, &clock, 1500, |r, k| {
        Caller::new(format!("t-{r}-{k}"))
    });
    assert!(
        failed.is_empty(),
        "{} of {} calls failed, first: {}",
        failed.len(),
        64 * 1500,
        failed[0]
    );
    assert_eq!(ok, 64 * 1500);
}

/// Two replicas, 32 calls in flight each, all for one tenant on a clock that stands still: the
/// calls race for the same two records, so writes conflict, and each replica's worker writes
/// batches one behind the other (a batch decided on the write ahead of it). Redis admits
/// exactly what one in-process limiter admits for the same calls: a batch decided on a write
/// that did not land never lands itself.
#[test]
fn racing_replicas_admit_exactly_what_one_process_admits() {
    let policy = Policy::from_toml_str(
        r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 7000, per = "1h" }
[tool.tenants.acme]
ceiling = 6000
"#,
    )
    .unwrap();
    let calls = 2 * 32 * 120;
    let clock = ManualClock::new(EPOCH);
    let alone = Limiter::with_store(
        policy.clone(),
        tower_fairshare::MemoryStore::new(),
        clock.clone(),
    );
    let acme = Caller::new("acme");
    let rt = current_thread();
    let expected = (0..calls)
        .filter(|_| rt.block_on(alone.admit(&acme, "search", Cost(1.0))).is_ok())
        .count();
    assert!(
        expected > 0 && expected < calls,
        "the limit binds: {expected}"
    );

    let server = RedisServer::start();
    let (ok, refused) = race(&server, &policy, &clock, 120, |_, _| Caller::new("acme"));
    let failed: Vec<String> = refused
        .iter()
        .filter(|r| r.reason.as_str() != "rate_limited")
        .map(|r| r.to_string())
        .collect();
    assert!(
        failed.is_empty(),
        "{} calls failed: {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(ok, expected, "admitted on Redis vs in process");
}

/// Two replicas (stores on `server` with the injected `clock`, 5 s timeouts), 32 tasks each,
/// every task making `calls` calls of `search` as `caller(replica, task)`: how many were
/// admitted, and every refusal.
fn race(
    server: &RedisServer,
    policy: &Policy,
    clock: &ManualClock,
    calls: usize,
    caller: impl Fn(usize, usize) -> Caller,
) -> (usize, Vec<tower_fairshare::Refusal>) {
    multi_thread().block_on(async {
        let mut handles = Vec::new();
        for r in 0..2 {
            let store = RedisStore::builder(server.url())
                .injected_clock()
                .timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap();
            let limiter = Limiter::with_store(policy.clone(), store, clock.clone());
            for k in 0..32 {
                let (limiter, caller) = (limiter.clone(), caller(r, k));
                handles.push(tokio::spawn(async move {
                    let (mut ok, mut refused) = (0, Vec::new());
                    for _ in 0..calls {
                        match limiter.admit(&caller, "search", Cost(1.0)).await {
                            Ok(_) => ok += 1,
                            Err(e) => refused.push(e),
                        }
                    }
                    (ok, refused)
                }));
            }
        }
        let (mut ok, mut refused) = (0, Vec::new());
        for h in handles {
            let (o, f) = h.await.unwrap();
            ok += o;
            refused.extend(f);
        }
        (ok, refused)
    })
}

/// Four replicas (four stores on one Redis, each limiter with its own leases) × 64 tasks flood
/// one tenant on a tool with the default (self-sized) leases, on a virtual clock each call moves on: every aligned second
/// admits at most the tenant's ceiling + burst (nothing admitted that Redis did not charge)
/// and at least 95 % of it (what leases leave unused is bounded), a quiet tenant beside it
/// gets every call within its floor, and a replica that dies holding a lease (its units never
/// given back) over-admits nothing; its units count as spent only in the window they were
/// granted in (its lease ends with it), so the second after it died admits ≥ 95 % again.
#[test]
fn four_leasing_replicas_on_one_tenant_stay_exact_and_lose_little() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(
        r#"
[[tool]]
name = "t"
unit = "calls"
rate = { limit = 10000, per = "1s" }
burst = 1000
[tool.tenants.busy]
ceiling = 3000
burst = 400
[tool.tenants.quiet]
floor = 50
"#,
    )
    .unwrap();
    let rt = multi_thread();
    let clock = ManualClock::new(EPOCH);
    let second = 1_000_000u64;
    let end = 4 * second;
    let busy_at: Arc<Mutex<Vec<u64>>> = Arc::default();
    let quiet = Arc::new(Mutex::new((0u64, Vec::<String>::new())));
    rt.block_on(async {
        let mut handles = Vec::new();
        for r in 0..4 {
            let store = RedisStore::builder(server.url())
                .injected_clock()
                .timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap();
            let limiter = Limiter::with_store(policy.clone(), store, clock.clone());
            for _ in 0..64 {
                let (limiter, clock, busy_at) = (limiter.clone(), clock.clone(), busy_at.clone());
                // Replica 0 dies halfway through the third second, holding its lease.
                let until = if r == 0 { 2 * second + second / 2 } else { end };
                handles.push(tokio::spawn(busy_until(limiter, clock, until, busy_at)));
            }
            if r == 0 {
                // Its leases are never given back: as if the process died.
                std::mem::forget(limiter.clone());
            }
            // The quiet tenant: a call every 25 ms of virtual time (40 a second; floor 50),
            // from each replica in turn.
            let (clock, quiet) = (clock.clone(), quiet.clone());
            handles.push(tokio::spawn(quiet_every_100ms(
                limiter,
                clock,
                r * 25_000,
                end,
                quiet,
            )));
        }
        for h in handles {
            h.await.unwrap();
        }
    });
    // A grant is decided at its records' latest time, which another replica's call may have
    // moved past the end: such admissions count in a fifth, partial second.
    let mut per_second = [0u64; 5];
    for at in busy_at.lock().unwrap().iter() {
        per_second[((at - EPOCH.as_micros()) / second) as usize] += 1;
    }
    eprintln!("busy admitted per second: {per_second:?}");
    for (s, got) in per_second.iter().enumerate() {
        assert!(
            *got <= 3_000 + 400,
            "second {s}: {got} admitted, above ceiling + burst"
        );
        assert!(
            s == 4 || *got as f64 >= 0.95 * 3_000.0,
            "second {s}: only {got} admitted of 3,000"
        );
    }
    let (ok, refused) = std::mem::take(&mut *quiet.lock().unwrap());
    assert!(
        refused.is_empty(),
        "the quiet tenant was refused within its floor: {refused:?}"
    );
    assert!(ok >= 150, "the quiet tenant got only {ok} calls");
}

/// Redis down under a leasing caller: the replica keeps spending what its lease holds, at
/// most that, then follows the tool's `on_store_error` (here deny: `store_unavailable`).
#[test]
fn with_redis_down_a_replica_spends_what_it_holds_then_follows_on_store_error() {
    let server = RedisServer::start();
    let policy = Policy::from_toml_str(
        r#"
[[tool]]
name = "t"
unit = "calls"
rate = { limit = 1000000, per = "1s" }
burst = 100000
lease = { max = 64 }
on_store_error = "deny"
[tool.default_tenant]
max_tenants = 10
"#,
    )
    .unwrap();
    let rt = multi_thread();
    rt.block_on(async {
        let clock = ManualClock::new(EPOCH);
        let store = RedisStore::builder(server.url())
            .injected_clock()
            .timeout(Duration::from_millis(200))
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::with_store(policy, store, clock.clone());
        let busy = Caller::new("busy");
        // Busy until its lease holds a good part of a grant.
        let mut calls = 0;
        while limiter.leased_units() < 16.0 {
            clock.advance(Duration::from_micros(100));
            limiter
                .admit(&busy, "t", Cost(1.0))
                .await
                .expect("admitted");
            calls += 1;
            assert!(calls < 10_000, "never leased");
            tokio::task::yield_now().await;
        }
        let held = limiter.leased_units();
        server.kill();
        let mut spent = 0.0;
        let refusal = loop {
            clock.advance(Duration::from_micros(100));
            match limiter.admit(&busy, "t", Cost(1.0)).await {
                Ok(t) => {
                    assert!(t.part() < 1.0, "admitted only from the lease");
                    spent += 1.0;
                }
                Err(r) => break r,
            }
            assert!(spent <= held, "spent {spent}, more than the {held} it held");
        };
        eprintln!("held {held} units when Redis went down; spent {spent} of them");
        assert!(spent >= 1.0, "kept spending what it held ({held})");
        assert_eq!(refusal.reason, Reason::StoreUnavailable);
        let again = limiter.admit(&busy, "t", Cost(1.0)).await.unwrap_err();
        assert_eq!(again.reason, Reason::StoreUnavailable);
    });
}
