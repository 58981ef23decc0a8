//! Redis down for a few seconds under load: the log says so a few times a second per tool,
//! not once per call (the metrics count every call), and once Redis is back callers are
//! decided again without seeing the reconnect.

#![cfg(all(feature = "redis", feature = "metrics"))]

#[path = "support/logs.rs"]
mod logs;
mod support;

use std::time::{Duration, Instant};

use metrics_exporter_prometheus::PrometheusBuilder;
use support::RedisServer;
use tower_fairshare::store::RedisStore;
use tower_fairshare::{Caller, Cost, Limiter, ManualClock, Policy, Reason, Timestamp};

/// Two tools, one refusing calls when the store cannot answer and one letting them through.
const POLICY: &str = r#"
[[tool]]
name = "strict"
unit = "calls"
rate = { limit = 1000000, per = "1m" }
on_store_error = "deny"
[tool.default_tenant]
ceiling = 1000000

[[tool]]
name = "lenient"
unit = "calls"
rate = { limit = 1000000, per = "1m" }
on_store_error = "allow"
[tool.default_tenant]
ceiling = 1000000
"#;

const OUTAGE: Duration = Duration::from_secs(3);

/// Lines of one kind a second per tool, at most (the store's own and the limiter's are two
/// kinds), and the seconds the outage can touch.
const BOUND: usize = 2 * 2 * 2 * (OUTAGE.as_secs() as usize + 2);

#[test]
fn an_outage_logs_a_few_lines_a_second_per_tool_and_counts_every_call() {
    let server = RedisServer::start();
    let clock = ManualClock::new(Timestamp(1_767_225_600_000_000));
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let (mut calls, mut refused, mut let_through) = (0, 0, 0);
    let log = logs::logged(|| {
        metrics::with_local_recorder(&recorder, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let store = RedisStore::builder(server.url())
                    .injected_clock()
                    .connect()
                    .await
                    .unwrap();
                let limiter = Limiter::with_store(
                    Policy::from_toml_str(POLICY).unwrap(),
                    store,
                    clock.clone(),
                );
                for tool in ["strict", "lenient"] {
                    assert!(limiter
                        .admit(&Caller::new("t0"), tool, Cost(1.0))
                        .await
                        .is_ok());
                }
                server.kill();
                (calls, refused, let_through) = call_through_the_outage(&limiter, &clock).await;
                assert!(server.spawn(), "redis-server restarted");
                // Back: the next calls are decided, the first one too.
                for i in 0..3 {
                    clock.advance(Duration::from_millis(1));
                    let caller = Caller::new(format!("after-{i}"));
                    if let Err(r) = limiter.admit(&caller, "strict", Cost(1.0)).await {
                        panic!("call {i} once Redis is back refused: {r}");
                    }
                }
            });
        });
    });
    let lines = log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"));
    let written = lines.count();
    eprintln!(
        "outage: {calls} calls ({refused} refused, {let_through} let through), {written} lines"
    );
    assert!(
        calls > 10 * BOUND,
        "only {calls} calls in the outage: too few to tell"
    );
    assert!(
        written <= BOUND,
        "{written} lines for {calls} calls (at most {BOUND}):\n{log}"
    );
    assert!(written >= 2, "the outage is not logged at all:\n{log}");
    assert!(log.contains("held_back="), "{log}");
    // Every failed call is counted, each tool by its own line.
    let text = handle.render();
    let counted: f64 = text
        .lines()
        .filter(|l| l.starts_with("fairshare_store_errors_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert!(
        counted >= (refused + let_through) as f64,
        "store errors counted {counted}, calls that met one {}:\n{text}",
        refused + let_through
    );
    assert!(refused > 0 && let_through > 0, "{refused} {let_through}");
}

/// Calls for [`OUTAGE`] of real time, a virtual millisecond apart, of 50 tenants on both
/// tools, while Redis is down: each refused `store_unavailable` or let through. How many calls,
/// refused, let through.
async fn call_through_the_outage(
    limiter: &Limiter<RedisStore, ManualClock>,
    clock: &ManualClock,
) -> (usize, usize, usize) {
    let (mut calls, mut refused, mut let_through) = (0, 0, 0);
    let began = Instant::now();
    while began.elapsed() < OUTAGE {
        calls += 1;
        clock.advance(Duration::from_millis(1));
        let caller = Caller::new(format!("t{}", calls % 50));
        let tool = if calls % 2 == 0 { "strict" } else { "lenient" };
        match limiter.admit(&caller, tool, Cost(1.0)).await {
            Ok(_) => let_through += 1,
            Err(r) => {
                assert_eq!(r.reason, Reason::StoreUnavailable, "{r}");
                refused += 1;
            }
        }
    }
    (calls, refused, let_through)
}
