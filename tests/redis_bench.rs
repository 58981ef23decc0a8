//! Throughput and latency of `RedisStore` against a trivial EVALSHA, measured in the same run
//! on a redis-server this test starts (the Redis targets in docs/performance.md). Ignored by default:
//!
//! ```text
//! cargo test --release --all-features --test redis_bench -- --ignored --nocapture
//! ```
//!
//! Each case runs N tasks in flight for a few seconds and reports decisions/s, p50, p99, the
//! worst latency, and the least progress of any task (0 means a task starved).

// Needs the `redis` feature: `cargo test --features redis` (or --all-features).
#![cfg(feature = "redis")]

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::RedisServer;
use tower_fairshare::admission::engine::{LevelRef, Plan};
use tower_fairshare::store::{Decision, RedisStore};
use tower_fairshare::{Policy, Store, Timestamp};

const CASE: Duration = Duration::from_secs(3);

/// A one-key GCRA, as go-redis/redis_rate does it: the anchor.
const GCRA: &str = r#"
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
tat = math.max(tat, now)
if tat - now > tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], tat + interval, 'PX', 60000)
return 1
"#;

const POLICY: &str = r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 100000000, per = "1m" }
budgets = [{ period = "day", max = 1000000000 }]
[tool.tenants.acme]
weight = 2
floor = 1000
[tool.tenants.acme.default_instance]
weight = 1
[tool.default_tenant]
weight = 1
"#;

struct Report {
    per_sec: f64,
    p50: Duration,
    p99: Duration,
    max: Duration,
    least_task: usize,
}

async fn run<F, Fut>(in_flight: usize, op: F) -> Report
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    let start = Instant::now();
    for task in 0..in_flight {
        let (op, stop) = (op.clone(), stop.clone());
        handles.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(100_000);
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                op(task).await;
                lat.push(t0.elapsed());
            }
            lat
        }));
    }
    tokio::time::sleep(CASE).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut least = usize::MAX;
    for h in handles {
        let lat = h.await.unwrap();
        least = least.min(lat.len());
        all.extend(lat);
    }
    let secs = start.elapsed().as_secs_f64();
    all.sort_unstable();
    let q = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)];
    Report {
        per_sec: all.len() as f64 / secs,
        p50: q(0.5),
        p99: q(0.99),
        max: *all.last().unwrap(),
        least_task: least,
    }
}

fn print(name: &str, n: usize, r: &Report, server: &RedisServer) {
    // What one script costs inside Redis, from INFO commandstats (reset before each case).
    let mut conn = server.conn();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .unwrap();
    let inside = info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("usec_per_call=")))
        .unwrap_or("?")
        .to_owned();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut conn)
        .unwrap();
    println!(
        "{name:<34} {n:>3} in flight: {:>8.0}/s  p50 {:>7.0?}  p99 {:>7.0?}  max {:>7.0?}  least task {:>6}  in Redis {inside} µs/call",
        r.per_sec, r.p50, r.p99, r.max, r.least_task
    );
}

async fn decisions(store: Arc<RedisStore>, policy: Arc<Policy>, n: usize) -> Report {
    run(n, move |task| {
        let (store, policy) = (store.clone(), policy.clone());
        async move {
            let tool = policy.tool("search").unwrap();
            let tenant = tool.tenant("acme").unwrap();
            let instance: Arc<str> = Arc::from(format!("agent-{task}"));
            let acme = Arc::from("acme");
            let plan = Plan {
                now: Timestamp(0),
                cost: 1.0,
                tool,
                tenant: LevelRef {
                    name: &acme,
                    policy: tenant,
                },
                instance: Some(LevelRef {
                    name: &instance,
                    policy: tenant.instance(&instance).unwrap(),
                }),
                untenanted: false,
            };
            match store.decide(std::slice::from_ref(&plan)).await {
                Ok(Decision::Admitted(_)) => {}
                other => panic!("{other:?}"),
            }
        }
    })
    .await
}

#[test]
#[ignore = "a measurement, not a test: run with --ignored --nocapture, in --release"]
fn redis_store_against_a_trivial_evalsha() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let policy = Arc::new(Policy::from_toml_str(POLICY).unwrap());
    rt.block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let manager = client.get_connection_manager().await.unwrap();
        let gcra = redis::Script::new(GCRA);
        let _: i64 = gcra
            .key("warm")
            .arg(1000)
            .arg(1_000_000_000)
            .invoke_async(&mut manager.clone())
            .await
            .unwrap();
        for n in [1, 16, 64] {
            let (m, s) = (manager.clone(), gcra.get_hash().to_owned());
            let r = run(n, move |task| {
                let mut m = m.clone();
                let s = s.clone();
                async move {
                    let _: i64 = redis::cmd("EVALSHA")
                        .arg(&s)
                        .arg(1)
                        .arg(format!("gcra:{task}"))
                        .arg(1000)
                        .arg(1_000_000_000)
                        .query_async(&mut m)
                        .await
                        .unwrap();
                }
            })
            .await;
            print("trivial EVALSHA (GCRA), multiplexed", n, &r, &server);

            let store = Arc::new(
                RedisStore::builder(server.url())
                    .timeout(Duration::from_secs(5))
                    .connect()
                    .await
                    .unwrap(),
            );
            let r = decisions(store, policy.clone(), n).await;
            print("RedisStore, multiplexed (default)", n, &r, &server);

            #[cfg(feature = "redis-bb8")]
            {
                let store = Arc::new(
                    RedisStore::builder(server.url())
                        .pool(16)
                        .timeout(Duration::from_secs(5))
                        .connect()
                        .await
                        .unwrap(),
                );
                let r = decisions(store, policy.clone(), n).await;
                print("RedisStore, bb8 pool of 16", n, &r, &server);
            }
        }
    });
}
