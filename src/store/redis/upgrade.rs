//! Upgrades that change the record layout, proven on a real redis-server against a format
//! one past the newest (the tests' `NEXT`): an old and a new version of the store side by
//! side count in the same records and admit what one alone would; once the old one is gone
//! the new one writes its own format, and a record written in the old one is read with
//! every counter, budget and permit kept; an old version that meets the new format refuses
//! rather than admits.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::record::tests::NEXT;
use super::record::FORMAT;
use super::RedisStore;
use crate::{Caller, Cost, Limiter, ManualClock, Policy, Store, Timestamp};

/// A redis-server on a free loopback port, killed when dropped.
struct Server {
    port: u16,
    child: Child,
}

impl Server {
    fn start() -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        let server = Server { port, child };
        for _ in 0..250 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return server;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server did not start");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn get(&self, key: &str) -> Vec<u8> {
        let mut c = redis::Client::open(self.url())
            .unwrap()
            .get_connection()
            .unwrap();
        redis::cmd("GET").arg(key).query(&mut c).unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const POLICY: &str = r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 600, per = "1m" }
budgets = [ { period = "hour", max = 40 } ]
lease = "off"
[tool.default_tenant]
ceiling = 30
burst = 12
max_concurrency = 8
"#;

const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

async fn version(
    server: &Server,
    namespace: &str,
    newest: u8,
    clock: &ManualClock,
) -> Limiter<RedisStore, ManualClock> {
    let store = RedisStore::builder(server.url())
        .namespace(namespace)
        .injected_clock()
        .formats(FORMAT, newest)
        .connect()
        .await
        .unwrap();
    Limiter::with_store(Policy::from_toml_str(POLICY).unwrap(), store, clock.clone())
}

/// Removes a replica's entry, as its staleness would after it stopped.
async fn gone(server: &Server, namespace: &str, l: &Limiter<RedisStore, ManualClock>) {
    let mut c = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: i64 = redis::cmd("HDEL")
        .arg(format!("{namespace}fs{{replicas}}@"))
        .arg(&l.store().shared.replicas.id)
        .query_async(&mut c)
        .await
        .unwrap();
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Calls of `acme` through `who(k)` for call `k`, one every 100 ms, until one is refused:
/// how many were admitted.
async fn until_refused(
    clock: &ManualClock,
    who: impl Fn(usize) -> Limiter<RedisStore, ManualClock>,
) -> usize {
    let acme = Caller::new("acme");
    for k in 0.. {
        let l = who(k);
        match l.admit(&acme, "search", Cost(1.0)).await {
            Ok(t) => l.release(&t).await,
            Err(_) => return k,
        }
        clock.advance(Duration::from_millis(100));
    }
    unreachable!()
}

#[test]
fn two_versions_side_by_side_admit_what_one_alone_would() {
    let server = Server::start();
    runtime().block_on(async {
        let clock = ManualClock::new(EPOCH);
        let alone = version(&server, "alone:", FORMAT, &clock).await;
        let one = until_refused(&clock, |_| alone.clone()).await;

        let clock = ManualClock::new(EPOCH);
        let old = version(&server, "both:", FORMAT, &clock).await;
        let new = version(&server, "both:", NEXT, &clock).await;
        old.store().check_replicas().await.unwrap();
        new.store().check_replicas().await.unwrap();
        assert_eq!(
            new.store().shared.replicas.write_format(),
            FORMAT,
            "the old one reads only its own"
        );
        let both = until_refused(
            &clock,
            |k| if k % 2 == 0 { old.clone() } else { new.clone() },
        )
        .await;
        assert_eq!(
            both, one,
            "alternating versions admitted {both}, one alone {one}"
        );
        assert!(one >= 12, "the burst at least: {one}");
    });
}

#[test]
fn after_the_old_version_is_gone_records_are_migrated_with_everything_kept() {
    let server = Server::start();
    runtime().block_on(async {
        let clock = ManualClock::new(EPOCH);
        let old = version(&server, "up:", FORMAT, &clock).await;
        let acme = Caller::new("acme");
        // Some calls done, three still running (holding permits), over the budget's hour.
        let mut running = Vec::new();
        for k in 0..9 {
            let t = old.admit(&acme, "search", Cost(1.0)).await.unwrap();
            if k < 3 {
                running.push(t);
            } else {
                old.release(&t).await;
            }
            clock.advance(Duration::from_millis(250));
        }
        let keys = old.call_keys(&acme, "search").unwrap();
        let before = old.store().inspect(&keys).await.unwrap();
        let tenant_key = format!("up:{}", keys.encoded()[1].as_ref().unwrap());
        assert!(!server.get(&tenant_key).ends_with(b"FSRF\x02\0\0\0"));

        let new = version(&server, "up:", NEXT, &clock).await;
        gone(&server, "up:", &old).await;
        new.store().check_replicas().await.unwrap();
        assert_eq!(new.store().shared.replicas.write_format(), NEXT);
        // Read in the old format, decided, written in the new one.
        let t = new.admit(&acme, "search", Cost(1.0)).await.unwrap();
        assert!(
            server.get(&tenant_key).ends_with(b"FSRF\x02\0\0\0"),
            "rewritten in the new format"
        );
        let after = new.store().inspect(&keys).await.unwrap();
        for (level, (b, a)) in before.iter().zip(after.iter()).enumerate().take(2) {
            let (b, a) = (b.unwrap(), a.unwrap());
            assert_eq!(a.total, b.total + 1.0, "level {level}: its window's count");
            // Only the tenant caps calls in flight.
            let permit = if level == 1 { 1.0 } else { 0.0 };
            assert_eq!(
                a.in_flight,
                b.in_flight + permit,
                "level {level}: permits held"
            );
            assert_eq!(a.template_counted, b.template_counted, "level {level}");
            for (cb, ca) in b.budgets.iter().zip(a.budgets.iter()) {
                assert_eq!(
                    (ca.period, ca.start, ca.used),
                    (cb.period, cb.start, cb.used + 1.0)
                );
            }
            assert_eq!(a.budgets.len(), b.budgets.len());
        }
        assert_eq!(before[1].unwrap().in_flight, 3.0);
        new.release(&t).await;
        for t in &running {
            old.release(t).await;
        }
        assert_eq!(
            new.store().inspect(&keys).await.unwrap()[1]
                .unwrap()
                .in_flight,
            0.0
        );

        // An old version that comes back meets a format it cannot read: it refuses (the
        // tool fails closed), it never admits on a record it cannot count.
        let r = old.admit(&acme, "search", Cost(1.0)).await.unwrap_err();
        assert_eq!(r.reason.as_str(), "store_unavailable", "{r:?}");
    });
}
