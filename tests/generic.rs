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
    let keys = limiter.call_keys(&Caller::new("acme"), "llm").unwrap();
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

    let out = svc
        .ready()
        .await
        .unwrap()
        .call(Job {
            tenant: Some("acme"),
            tokens: 600.0,
        })
        .await
        .unwrap();
    assert_eq!(out, 600.0);
    let in_flight = limiter.store().inspect(&keys).await.unwrap()[1]
        .as_ref()
        .unwrap()
        .in_flight;
    assert_eq!(in_flight, 0.0, "permit released when the future completed");

    match svc
        .ready()
        .await
        .unwrap()
        .call(Job {
            tenant: Some("acme"),
            tokens: 600.0,
        })
        .await
    {
        Err(FairShareError::Refused(r)) => assert_eq!(r.reason, Reason::RateLimited),
        other => panic!("{other:?}"),
    }
    match svc
        .ready()
        .await
        .unwrap()
        .call(Job {
            tenant: None,
            tokens: 1.0,
        })
        .await
    {
        Err(FairShareError::Refused(r)) => assert_eq!(r.reason, Reason::UnidentifiedCaller),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "refused calls never reach the inner service"
    );

    // Dropped before completion: the permit comes back.
    let pending = service_fn(|_job: Job| std::future::pending::<Result<f64, std::io::Error>>());
    let mut svc = DescribedLayer::new(limiter.clone(), Jobs).layer(pending);
    let mut fut = Box::pin(svc.ready().await.unwrap().call(Job {
        tenant: Some("acme"),
        tokens: 1.0,
    }));
    assert!(fut
        .as_mut()
        .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
        .is_pending());
    assert_eq!(
        limiter.store().inspect(&keys).await.unwrap()[1]
            .as_ref()
            .unwrap()
            .in_flight,
        1.0
    );
    drop(fut);
    assert_eq!(
        limiter.store().inspect(&keys).await.unwrap()[1]
            .as_ref()
            .unwrap()
            .in_flight,
        0.0
    );
}

use std::future::Future as _;
