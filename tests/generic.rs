//! Non-HTTP services: a `Describe` says who calls what; refusals are typed errors; permits
//! come back when the response future completes or is dropped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tower::{service_fn, Layer, Service, ServiceExt};
/// The virtual start of the tests: 2026-01-01T00:00:00Z, aligned to every period and calendar window.
const EPOCH: tower_fairshare::Timestamp = tower_fairshare::Timestamp(1_767_225_600_000_000);
use tower_fairshare::{
    Caller, Cost, Describe, DescribedLayer, FairShareError, Limiter, ManualClock, MemoryStore,
    Policy, Reason, Store,
};

struct Job {
    tenant: Option<&'static str>,
    tokens: f64,
}

struct Jobs;

impl Describe<Job> for Jobs {
    fn caller(&self, job: &Job) -> Option<Caller> {
        job.tenant.map(Caller::new)
    }
    fn tool(&self, _: &Job) -> Option<Arc<str>> {
        Some(Arc::from("llm"))
    }
    fn cost(&self, job: &Job) -> Cost {
        Cost(job.tokens)
    }
}

#[tokio::test]
async fn described_services_are_limited_like_http_ones() {
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "llm"
        unit = "tokens"
        rate = { limit = 1000, per = "1m" }
        burst = 1000
        [tool.tenants.acme]
        ceiling = 1000
        burst = 1000
        max_concurrency = 1
        "#,
    )
    .unwrap();
    let limiter = Limiter::with_store(policy, MemoryStore::new(), ManualClock::new(EPOCH));
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let inner = service_fn(move |job: Job| {
        let c = c.clone();
        async move {
            c.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(job.tokens)
        }
    });
    let mut svc = DescribedLayer::new(limiter.clone(), Jobs).layer(inner);
    let acme = |tokens| Job {
        tenant: Some("acme"),
        tokens,
    };
    let out = svc.ready().await.unwrap().call(acme(600.0)).await.unwrap();
    assert_eq!(out, 600.0);
    assert_eq!(
        acme_in_flight(&limiter).await,
        0.0,
        "permit released when the future completed"
    );
    let refused = |r: Result<f64, FairShareError<std::io::Error>>| match r {
        Err(FairShareError::Refused(r)) => r.reason,
        other => panic!("{other:?}"),
    };
    let over = svc.ready().await.unwrap().call(acme(600.0)).await;
    assert_eq!(refused(over), Reason::RateLimited);
    let nobody = Job {
        tenant: None,
        tokens: 1.0,
    };
    let nobody = svc.ready().await.unwrap().call(nobody).await;
    assert_eq!(refused(nobody), Reason::UnidentifiedCaller);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "refused calls never reach the inner service"
    );

    // Dropped before completion: the permit comes back.
    let pending = service_fn(|_job: Job| std::future::pending::<Result<f64, std::io::Error>>());
    let mut svc = DescribedLayer::new(limiter.clone(), Jobs).layer(pending);
    let mut fut = Box::pin(svc.ready().await.unwrap().call(acme(1.0)));
    assert!(fut
        .as_mut()
        .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
        .is_pending());
    assert_eq!(acme_in_flight(&limiter).await, 1.0);
    drop(fut);
    assert_eq!(acme_in_flight(&limiter).await, 0.0);
}

/// The permits acme's calls of `llm` hold now, at the tenant.
async fn acme_in_flight(limiter: &Limiter<MemoryStore, ManualClock>) -> f64 {
    let keys = limiter.call_keys(&Caller::new("acme"), "llm").unwrap();
    let s = limiter.store().inspect(&keys).await.unwrap();
    s[1].as_ref().unwrap().in_flight
}

use std::future::Future as _;
