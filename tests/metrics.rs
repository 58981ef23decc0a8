//! Every documented metric, with the right values, rendered by the Prometheus exporter.
#![cfg(all(feature = "metrics", feature = "cli"))]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use metrics_exporter_prometheus::PrometheusBuilder;
use tower_fairshare::simulate::EPOCH;
use tower_fairshare::telemetry::{
    self, DECISIONS, DECISION_SECONDS, TENANT_HEADROOM, TOOL_HEADROOM,
};
use tower_fairshare::{Caller, Cost, Limiter, ManualClock, MemoryStore, Policy};

fn now<F: Future>(f: F) -> F::Output {
    match pin!(f)
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("memory store answers at once"),
    }
}

fn line<'a>(text: &'a str, name: &str, labels: &[&str]) -> Option<&'a str> {
    text.lines()
        .find(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
}

fn value(text: &str, name: &str, labels: &[&str]) -> f64 {
    let l = line(text, name, labels).unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"));
    l.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn decisions_headroom_and_latency_are_recorded() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        telemetry::describe_metrics();
        let policy = Policy::from_toml_str(
            r#"
            [[tool]]
            name = "web_search"
            unit = "calls"
            rate = { limit = 600, per = "1m" }
            [tool.tenants.acme]
            ceiling = 3
            burst = 3
            "#,
        )
        .unwrap();
        let limiter = Limiter::with_store(policy, MemoryStore::new(), ManualClock::new(EPOCH))
            .instance_labels(true);
        let acme = Caller::new("acme").with_instance("agent-7");
        for _ in 0..5 {
            let _ = now(limiter.admit(&acme, "web_search", Cost(1.0)));
        }
        let _ = now(limiter.admit(&Caller::untenanted(), "web_search", Cost(1.0)));
    });
    let text = handle.render();
    let admitted = [
        "tool=\"web_search\"",
        "tenant=\"acme\"",
        "outcome=\"admitted\"",
        "instance=\"agent-7\"",
    ];
    assert_eq!(value(&text, DECISIONS, &admitted), 3.0);
    let refused = [
        "tenant=\"acme\"",
        "outcome=\"refused\"",
        "reason=\"rate_limited\"",
        "scope=\"tenant\"",
    ];
    assert_eq!(value(&text, DECISIONS, &refused), 2.0);
    assert_eq!(
        value(&text, DECISIONS, &["reason=\"unidentified_caller\""]),
        1.0
    );
    assert_eq!(value(&text, TENANT_HEADROOM, &["tenant=\"acme\""]), 0.0);
    assert!(value(&text, TOOL_HEADROOM, &["tool=\"web_search\""]) >= 0.0);
    assert_eq!(
        value(
            &text,
            &format!("{DECISION_SECONDS}_count"),
            &["store=\"memory\""]
        ),
        5.0
    );
    assert!(
        text.contains("# HELP fairshare_decisions_total"),
        "described:\n{text}"
    );
}
