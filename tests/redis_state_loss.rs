//! Redis restarted without persistence in the middle of a budget's window: the live replicas
//! notice the loss in the round trip that reads the emptied state, forget the refusals they
//! remembered, and put back what they admitted, so the hour's budget holds — exceeded by at
//! most what a replica that went down with Redis had admitted. Each replica logs the loss once.

#![cfg(feature = "redis")]

#[path = "support/logs.rs"]
mod logs;
mod support;

use std::time::{Duration, Instant};

use support::RedisServer;
use tower_fairshare::store::RedisStore;
use tower_fairshare::{Caller, Cost, Limiter, ManualClock, Policy, Reason, Timestamp};

/// Half an hour into 2026-01-01T00:00Z: the hour's budget window is half over.
const MID_HOUR: Timestamp = Timestamp(1_767_225_600_000_000 + 1_800_000_000);

/// A tool with an hourly budget of 500 and plenty of rate.
const POLICY: &str = r#"
[[tool]]
name = "report"
unit = "calls"
rate = { limit = 100000, per = "1m" }
budgets = [ { period = "hour", max = 500 } ]
[tool.default_tenant]
ceiling = 100000
"#;

type Replica = Limiter<RedisStore, ManualClock>;

async fn replica(server: &RedisServer, clock: &ManualClock) -> Replica {
    let store = RedisStore::builder(server.url())
        .injected_clock()
        .connect()
        .await
        .unwrap();
    Limiter::with_store(Policy::from_toml_str(POLICY).unwrap(), store, clock.clone())
}

/// Calls by `n` callers (tenants `t0`, `t1`, …) through `replica` until one is refused;
/// how many were admitted.
async fn spend(replica: &Replica, clock: &ManualClock, n: usize, calls: usize) -> usize {
    let mut admitted = 0;
    for i in 0..calls {
        clock.advance(Duration::from_millis(10));
        let caller = Caller::new(format!("t{}", i % n));
        match replica.admit(&caller, "report", Cost(1.0)).await {
            Ok(_) => admitted += 1,
            Err(r) => {
                assert_eq!(r.reason, Reason::CapExceeded, "{r}");
                break;
            }
        }
    }
    admitted
}

/// One call by `tenant` once Redis answers again: whether it was admitted (store errors while
/// Redis comes back are waited out).
async fn once_back(replica: &Replica, clock: &ManualClock, tenant: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        clock.advance(Duration::from_millis(10));
        match replica
            .admit(&Caller::new(tenant), "report", Cost(1.0))
            .await
        {
            Ok(_) => return true,
            Err(r) if r.reason == Reason::StoreUnavailable => {
                assert!(Instant::now() < deadline, "Redis never came back");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(r) => {
                assert_eq!(r.reason, Reason::CapExceeded, "{r}");
                return false;
            }
        }
    }
}

fn restart_empty(server: &RedisServer) {
    server.kill();
    assert!(server.spawn(), "redis-server restarted");
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Two live replicas spend the hour's budget between them (300 and 200) and Redis restarts
/// empty. One notices the loss by its epoch check (its callers' refusals are remembered, so
/// its calls send nothing), the other in the round trip of its next call: not one call more
/// is admitted in the hour, on either of them or on a replica started after the restart, and
/// each live replica logs the loss once.
#[test]
fn an_empty_restart_mid_hour_admits_nothing_more_with_every_replica_alive() {
    let server = RedisServer::start();
    let clock = ManualClock::new(MID_HOUR);
    let log = logs::logged(|| {
        current_thread().block_on(async {
            let (a, b) = (
                replica(&server, &clock).await,
                replica(&server, &clock).await,
            );
            assert_eq!(spend(&a, &clock, 7, 300).await, 300);
            assert_eq!(spend(&b, &clock, 5, 200).await, 200);
            assert_eq!(spend(&a, &clock, 7, 10).await, 0, "the budget is spent");
            assert_eq!(spend(&b, &clock, 5, 10).await, 0, "the budget is spent");
            restart_empty(&server);
            // b's check finds the marker changed and waits for b's worker to restore its 200.
            let health = b.store().check_health().await.unwrap();
            assert_eq!(health.lost_tools, ["report"]);
            // A caller a has not been refused: its call goes to Redis, reads the emptied
            // state, and a restores its 300 before deciding it.
            assert!(
                !once_back(&a, &clock, "new-on-a").await,
                "a's first call after the restart"
            );
            assert!(
                !once_back(&b, &clock, "new-on-b").await,
                "b's first call after the restart"
            );
            let mut more = spend(&a, &clock, 7, 50).await + spend(&b, &clock, 5, 50).await;
            let c = replica(&server, &clock).await;
            more += spend(&c, &clock, 3, 50).await;
            assert_eq!(more, 0, "admitted in the hour beyond its budget of 500");
            // The next hour is a budget of its own.
            clock.advance(Duration::from_secs(1_800));
            assert_eq!(spend(&c, &clock, 3, 20).await, 20);
        })
    });
    let noticed = log.matches("Redis lost this tool's state").count();
    assert_eq!(noticed, 2, "one line per live replica:\n{log}");
}

/// A replica that went down with Redis takes what it admitted with it: the live one restores
/// its own 300 units, and the hour admits exactly the dead replica's 200 again — the bound
/// the docs state — and no more.
#[test]
fn an_empty_restart_loses_only_what_a_replica_that_died_with_redis_admitted() {
    let server = RedisServer::start();
    let clock = ManualClock::new(MID_HOUR);
    current_thread().block_on(async {
        let a = replica(&server, &clock).await;
        assert_eq!(spend(&a, &clock, 7, 300).await, 300);
        {
            let b = replica(&server, &clock).await;
            assert_eq!(spend(&b, &clock, 5, 200).await, 200);
        }
        restart_empty(&server);
        let mut after = usize::from(once_back(&a, &clock, "new-on-a").await);
        after += spend(&a, &clock, 7, 400).await;
        assert_eq!(
            after, 200,
            "after the restart: the dead replica's part again, no more"
        );
    });
}

/// Redis restarted (here with its state lost, as it happens): the first call once it answers
/// again is decided, not refused with `store_unavailable` on the connection the restart broke
/// — the store makes its connection again and tries once more, unseen by the caller.
#[test]
fn the_first_call_after_redis_is_back_does_not_see_the_broken_connection() {
    let server = RedisServer::start();
    let clock = ManualClock::new(MID_HOUR);
    current_thread().block_on(async {
        // No background checks: nothing else finds the broken connection first.
        let store = RedisStore::builder(server.url())
            .injected_clock()
            .health_checks_every(Duration::ZERO)
            .connect()
            .await
            .unwrap();
        let limiter =
            Limiter::with_store(Policy::from_toml_str(POLICY).unwrap(), store, clock.clone());
        assert_eq!(spend(&limiter, &clock, 3, 10).await, 10);
        restart_empty(&server);
        for i in 0..3 {
            clock.advance(Duration::from_millis(10));
            let caller = Caller::new(format!("after-{i}"));
            if let Err(r) = limiter.admit(&caller, "report", Cost(1.0)).await {
                panic!("call {i} after the restart refused: {r}");
            }
        }
    });
}

/// Two replicas check the tool's epoch marker at the same moment after Redis lost it: one of
/// them sets the new marker and both read that one, so each reports the loss once and neither
/// reports it again at its next checks (a replica that kept a marker of its own would count a
/// loss that never happened).
#[test]
fn replicas_checking_at_once_after_a_loss_agree_on_the_new_marker() {
    let server = RedisServer::start();
    let clock = ManualClock::new(MID_HOUR);
    current_thread().block_on(async {
        let (a, b) = (
            replica(&server, &clock).await,
            replica(&server, &clock).await,
        );
        assert_eq!(spend(&a, &clock, 3, 5).await, 5);
        assert_eq!(spend(&b, &clock, 3, 5).await, 5);
        restart_empty(&server);
        let (ha, hb) = tokio::join!(a.store().check_health(), b.store().check_health());
        assert_eq!(ha.unwrap().lost_tools, ["report"]);
        assert_eq!(hb.unwrap().lost_tools, ["report"]);
        for _ in 0..3 {
            let (ha, hb) = tokio::join!(a.store().check_health(), b.store().check_health());
            let (ha, hb) = (ha.unwrap(), hb.unwrap());
            assert!(ha.lost_tools.is_empty(), "a found a loss again");
            assert!(hb.lost_tools.is_empty(), "b found a loss again");
            assert_eq!((ha.states_lost, hb.states_lost), (1, 1), "losses counted");
        }
    });
}
