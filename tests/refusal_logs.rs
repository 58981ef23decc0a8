//! Logs an operator can keep on: a runaway refused a thousand times a second writes one
//! `info` line per window (the rest at `debug`), a flood of identities a few a second, and a
//! request no tool matches is warned once per path prefix.

#[path = "support/logs.rs"]
mod logs;

use std::time::Duration;

use tower::{Service, ServiceExt};
use tower_fairshare::store::MemoryStore;
use tower_fairshare::{Caller, Cost, FairShareLayer, Limiter, ManualClock, Policy, Timestamp};

const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

const POLICY: &str = r#"
[[tool]]
name = "generate_report"
unit = "calls"
rate = { limit = 60, per = "10s" }
[tool.default_tenant]
ceiling = 6
"#;

fn info_refusals(log: &str) -> usize {
    log.lines()
        .filter(|l| l.contains(" INFO ") && l.contains("outcome=\"refused\""))
        .count()
}

/// A limiter on [`POLICY`] over a manual clock, and a runtime to drive it.
fn harness() -> (
    Limiter<MemoryStore, ManualClock>,
    ManualClock,
    tokio::runtime::Runtime,
) {
    let clock = ManualClock::new(EPOCH);
    let policy = Policy::from_toml_str(POLICY).unwrap();
    let limiter = Limiter::with_store(policy, MemoryStore::new(), clock.clone());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    (limiter, clock, rt)
}

#[test]
fn a_runaway_at_a_thousand_refusals_a_second_writes_a_line_a_window() {
    let (limiter, clock, rt) = harness();
    let runaway = Caller::new("runaway");
    let mut refused = 0;
    // 20 s at 1,000 calls a second: two windows of the tool's 10 s period.
    let log = logs::logged(|| {
        rt.block_on(async {
            for _ in 0..20_000 {
                clock.advance(Duration::from_millis(1));
                if limiter
                    .admit(&runaway, "generate_report", Cost(1.0))
                    .await
                    .is_err()
                {
                    refused += 1;
                }
            }
        })
    });
    assert!(refused > 19_000, "{refused}");
    let lines = info_refusals(&log);
    assert!(
        (2..=3).contains(&lines),
        "{lines} info lines for {refused} refusals:\n{log}"
    );
    assert!(
        log.contains("held_back="),
        "the next window's line counts the rest: {log}"
    );
}

#[test]
fn a_flood_of_identities_writes_a_few_lines_a_second() {
    let (limiter, clock, rt) = harness();
    // 5 s, each millisecond a new identity's eighth call (past its ceiling of 6 + burst).
    let log = logs::logged(|| {
        rt.block_on(async {
            for k in 0..5_000 {
                clock.advance(Duration::from_millis(1));
                let who = Caller::new(format!("id-{k}"));
                for _ in 0..8 {
                    let _ = limiter.admit(&who, "generate_report", Cost(1.0)).await;
                }
            }
        })
    });
    let lines = info_refusals(&log);
    assert!(lines <= 5 * 6, "{lines} info lines in 5 s");
    assert!(lines >= 5, "{lines}: refusals are still said");
}

#[test]
fn a_request_no_tool_matches_is_warned_once_per_path_prefix() {
    let policy = Policy::from_toml_str(POLICY).unwrap();
    let limiter = Limiter::new(policy);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let log = logs::logged(|| {
        rt.block_on(async {
            let mut svc = tower::ServiceBuilder::new()
                .layer(FairShareLayer::new(limiter).tool_from_path("/tools/"))
                .service_fn(|_req: http::Request<String>| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
                });
            for path in [
                "/healthz",
                "/healthz",
                "/unknown-route/a",
                "/unknown-route/b",
            ] {
                let req = http::Request::get(path).body(String::new()).unwrap();
                svc.ready().await.unwrap().call(req).await.unwrap();
            }
        })
    });
    let warned = log
        .lines()
        .filter(|l| l.contains(" WARN ") && l.contains("names no tool"))
        .count();
    assert_eq!(warned, 2, "{log}");
}
