//! Replicas sharing a Redis store report when they enforce different policies: two replicas
//! given different policy files find it within seconds (each announces itself every second),
//! name the tool, say how many replicas hold each fingerprint, and agree again once the
//! files agree; past the grace time the report is an error.

#![cfg(feature = "redis")]

#[path = "support/logs.rs"]
mod logs;
mod support;

use std::time::{Duration, Instant};

use support::RedisServer;
use tower_fairshare::store::RedisStore;
use tower_fairshare::{Limiter, Policy, Store, SystemClock};

fn policy(search_limit: u32) -> Policy {
    Policy::from_toml_str(&format!(
        r#"
[[tool]]
name = "search"
unit = "calls"
rate = {{ limit = {search_limit}, per = "1m" }}
[tool.default_tenant]
weight = 1

[[tool]]
name = "report"
unit = "calls"
rate = {{ limit = 60, per = "1m" }}
[tool.default_tenant]
weight = 1
"#
    ))
    .unwrap()
}

async fn replica(server: &RedisServer, policy: Policy, grace: Duration) -> Limiter<RedisStore> {
    let store = RedisStore::builder(server.url())
        .namespace("replicas:")
        .policy_grace(grace)
        .connect()
        .await
        .unwrap();
    Limiter::with_store(policy, store, SystemClock)
}

/// The console's state, as JSON.
async fn console_state(l: &Limiter<RedisStore>) -> serde_json::Value {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let res = l
        .console()
        .oneshot(
            http::Request::get("/state")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

#[test]
fn different_policy_files_are_reported_within_seconds_and_agree_again() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let a = replica(&server, policy(600), Duration::from_secs(60)).await;
        let b = replica(&server, policy(900), Duration::from_secs(60)).await;
        // Found by the stores' own announcements, every second.
        let started = Instant::now();
        let found = loop {
            let (da, db) = (
                a.store().policy_disagreements(),
                b.store().policy_disagreements(),
            );
            if !da.is_empty() && !db.is_empty() {
                break (da, db);
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "never reported"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        println!("reported after {:?}: {:?}", started.elapsed(), found.0);
        for d in [&found.0, &found.1] {
            assert_eq!(d.len(), 1, "only `search` differs: {d:?}");
            assert_eq!(d[0].tool, "search");
            assert_eq!(d[0].replicas.len(), 2, "two fingerprints, one replica each");
            assert!(d[0].replicas.iter().all(|(_, n)| *n == 1));
            assert!(!d[0].past_grace);
        }
        let fa = a.policy().tool("search").unwrap().fingerprint();
        assert_eq!(found.0[0].fingerprint, Some(fa));
        assert_ne!(found.1[0].fingerprint, Some(fa));
        // The console says so, for that tool only.
        let state = console_state(&a).await;
        let tools = state["tools"].as_array().unwrap();
        let search = tools.iter().find(|t| t["name"] == "search").unwrap();
        assert_eq!(search["policy"]["fingerprint"], format!("{fa:016x}"));
        assert_eq!(
            search["policy"]["disagreement"]["replicas"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        let report = tools.iter().find(|t| t["name"] == "report").unwrap();
        assert!(report["policy"].get("disagreement").is_none(), "{report}");

        // The reload that makes b's file a's: they agree again.
        b.set_policy(policy(600));
        b.store().check_replicas().await.unwrap();
        assert!(a.store().check_replicas().await.unwrap().is_empty());
        assert!(b.store().check_replicas().await.unwrap().is_empty());
    });
}

#[test]
fn a_tool_only_one_replica_knows_is_a_disagreement_too() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let a = replica(&server, policy(600), Duration::from_secs(60)).await;
        let only_search = Policy::from_toml_str(
            "[[tool]]\nname = \"search\"\nunit = \"calls\"\nrate = { limit = 600, per = \"1m\" }\n[tool.default_tenant]\nweight = 1\n",
        )
        .unwrap();
        let b = replica(&server, only_search, Duration::from_secs(60)).await;
        // A store no limiter has told its policy yet (a replica starting up) is no
        // disagreement.
        let starting = RedisStore::builder(server.url())
            .namespace("replicas:")
            .connect()
            .await
            .unwrap();
        starting.check_replicas().await.unwrap();
        a.store().check_replicas().await.unwrap();
        let d = b.store().check_replicas().await.unwrap();
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].tool, "report");
        assert_eq!(d[0].fingerprint, None, "b has no such tool");
    });
}

/// Past the grace time the report is an error, naming the tool and the fingerprints; the
/// first report, within it, a warning.
#[test]
fn past_the_grace_time_it_is_an_error() {
    let server = RedisServer::start();
    let log = logs::logged(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let a = replica(&server, policy(600), Duration::from_secs(3_600)).await;
            let b = replica(&server, policy(900), Duration::ZERO).await;
            a.store().check_replicas().await.unwrap();
            let d = b.store().check_replicas().await.unwrap();
            assert!(d[0].past_grace, "{d:?}");
            let d = a.store().check_replicas().await.unwrap();
            assert!(!d[0].past_grace, "{d:?}");
        })
    });
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("different policies"))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("WARN") && l.contains("tool=search")),
        "{log}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("ERROR") && l.contains("tool=search") && l.contains("×1")),
        "{log}"
    );
}
