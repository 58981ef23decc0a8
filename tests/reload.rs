//! Changing the policy under load: usage so far still counts, the new limits apply from the
//! next decision, permits in flight survive, an invalid file changes nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The virtual start of the tests: 2026-01-01T00:00:00Z, aligned to every period and calendar window.
const EPOCH: tower_fairshare::Timestamp = tower_fairshare::Timestamp(1_767_225_600_000_000);
use tower_fairshare::{Caller, Cost, Limiter, ManualClock, MemoryStore, Policy, Reason};

fn policy(ceiling: u32, max_concurrency: u32) -> String {
    format!(
        r#"
        [[tool]]
        name = "t"
        unit = "calls"
        rate = {{ limit = 600, per = "1m" }}
        [tool.tenants.acme]
        ceiling = {ceiling}
        burst = {ceiling}
        max_concurrency = {max_concurrency}
        "#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_changes_under_load() {
    let dir = std::env::temp_dir().join(format!("fairshare-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("policy.toml");
    std::fs::write(&file, policy(10, 4)).unwrap();

    let clock = ManualClock::new(EPOCH);
    let limiter = Limiter::with_store(
        Policy::from_path(&file).unwrap(),
        MemoryStore::new(),
        clock.clone(),
    );
    let acme = Caller::new("acme");

    // Load from several tasks: 6 calls admitted, one still in flight.
    let admitted = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (l, c, a) = (limiter.clone(), acme.clone(), admitted.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..2 {
                let t = l.admit(&c, "t", Cost(1.0)).await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                l.release(&t).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let held = limiter.admit(&acme, "t", Cost(1.0)).await.unwrap();
    assert_eq!(admitted.load(Ordering::SeqCst), 6);

    // An invalid file is rejected and changes nothing.
    std::fs::write(
        &file,
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = -5, per = \"1m\" }\n",
    )
    .unwrap();
    assert!(limiter.reload_from_path(&file).is_err());
    let second = limiter
        .admit(&acme, "t", Cost(1.0))
        .await
        .expect("old policy still in force (8 of 10)");

    // Tighter limits apply from the next decision, and the 8 calls so far still count.
    std::fs::write(&file, policy(8, 1)).unwrap();
    limiter.reload_from_path(&file).unwrap();
    let r = limiter.admit(&acme, "t", Cost(1.0)).await.unwrap_err();
    // The permit taken before the reload is still held: concurrency 1 is already used.
    assert_eq!(r.reason, Reason::ConcurrencyExceeded);
    limiter.release(&held).await;
    limiter.release(&second).await;
    // 8 of the old bank of 10 are spent: only 2 are left under the new ceiling of 8, not a
    // fresh 8.
    for k in 0..2 {
        let t = limiter
            .admit(&acme, "t", Cost(1.0))
            .await
            .unwrap_or_else(|r| panic!("call {k}: {r}"));
        limiter.release(&t).await;
    }
    let r = limiter.admit(&acme, "t", Cost(1.0)).await.unwrap_err();
    assert_eq!(
        r.reason,
        Reason::RateLimited,
        "usage so far counts against the new ceiling"
    );
    assert_eq!(r.limit, Some(8.0));

    // Looser limits apply at once as well.
    std::fs::write(&file, policy(100, 4)).unwrap();
    limiter.reload_from_path(&file).unwrap();
    clock.advance(Duration::from_secs(1));
    assert!(limiter.admit(&acme, "t", Cost(1.0)).await.is_ok());
}
