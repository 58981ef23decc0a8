//! Every documented metric, with the right values, rendered by the Prometheus exporter.
#![cfg(feature = "metrics")]

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusBuilder;
use tower_fairshare::admission::engine;
use tower_fairshare::store::{self, Answer};
/// The virtual start of the tests: 2026-01-01T00:00:00Z, aligned to every period and calendar window.
const EPOCH: tower_fairshare::Timestamp = tower_fairshare::Timestamp(1_767_225_600_000_000);
use tower_fairshare::telemetry::{
    self, DECISIONS, DECISION_SECONDS, TENANT_HEADROOM, TOOL_HEADROOM,
};
use tower_fairshare::{Caller, Cost, Limiter, ManualClock, MemoryStore, Policy};

mod ready;
use ready::now;

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
    // acme does not limit instances separately: its instances have no names of their own.
    let admitted = [
        "tool=\"web_search\"",
        "tenant=\"acme\"",
        "outcome=\"admitted\"",
        "instance=\"other\"",
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

/// A store that is always down: the tool's `on_store_error` applies, and both the store error
/// and the fallback are counted.
struct Down;

impl tower_fairshare::Store for Down {
    fn kind(&self) -> &'static str {
        "down"
    }
    fn decide(&self, _: &[engine::Plan<'_>]) -> Answer<store::Decision> {
        let down = tower_fairshare::StoreError::Unavailable("down for the test".into());
        Answer::Now(Err(down))
    }
    fn adjust(
        &self,
        _: &Arc<store::Admission>,
        _: f64,
        _: tower_fairshare::Timestamp,
    ) -> Answer<()> {
        Answer::Now(Ok(()))
    }
    fn release(&self, _: &Arc<store::Admission>) -> Answer<()> {
        Answer::Now(Ok(()))
    }
    fn inspect(&self, _: &store::CallKeys) -> Answer<store::Stored> {
        Answer::Now(Ok(Default::default()))
    }
}

#[test]
fn store_errors_and_fallbacks_are_counted() {
    use tower_fairshare::telemetry::{STORE_ERRORS, STORE_FALLBACKS};
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let policy = Policy::from_toml_str(
            r#"
            [[tool]]
            name = "closed"
            unit = "calls"
            rate = { limit = 60, per = "1m" }
            [tool.default_tenant]
            [[tool]]
            name = "open"
            unit = "calls"
            rate = { limit = 60, per = "1m" }
            on_store_error = "allow"
            [tool.default_tenant]
            "#,
        )
        .unwrap();
        let limiter = Limiter::with_store(policy, Down, ManualClock::new(EPOCH));
        let c = Caller::new("acme");
        let r = now(limiter.admit(&c, "closed", Cost(1.0))).unwrap_err();
        assert_eq!(r.reason.as_str(), "store_unavailable");
        for _ in 0..2 {
            let t = now(limiter.admit(&c, "open", Cost(1.0))).unwrap();
            assert!(t.admission().is_none(), "fail open: unmetered");
        }
    });
    let text = handle.render();
    assert_eq!(
        value(&text, STORE_ERRORS, &["tool=\"closed\"", "store=\"down\""]),
        1.0
    );
    assert_eq!(value(&text, STORE_ERRORS, &["tool=\"open\""]), 2.0);
    assert_eq!(
        value(
            &text,
            STORE_FALLBACKS,
            &["tool=\"closed\"", "mode=\"deny\""]
        ),
        1.0
    );
    assert_eq!(
        value(&text, STORE_FALLBACKS, &["tool=\"open\"", "mode=\"allow\""]),
        2.0
    );
    assert_eq!(
        value(
            &text,
            DECISIONS,
            &["tool=\"open\"", "outcome=\"unmetered\""]
        ),
        2.0
    );
}

/// Label values come only from the policy's own names: a flood of made-up tool names, template
/// tenants, unlisted tenants and instances adds no series. Listed tenants and instances are
/// labelled by name up to the cap, in policy order; the rest are `other`.
#[test]
fn labels_are_the_policys_names_whatever_requests_claim() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let policy = Policy::from_toml_str(
            r#"
            [[tool]]
            name = "web_search"
            unit = "calls"
            rate = { limit = 1000000, per = "1m" }
            [tool.tenants.acme]
            [tool.tenants.acme.instances.agent-7]
            [tool.tenants.acme.default_instance]
            max_instances = 100000
            [tool.tenants.globex]
            [tool.default_tenant]
            max_tenants = 100000
            [[tool]]
            name = "closed"
            unit = "calls"
            rate = { limit = 60, per = "1m" }
            [tool.tenants.initech]
            "#,
        )
        .unwrap();
        let limiter = Limiter::with_store(policy, MemoryStore::new(), ManualClock::new(EPOCH))
            .instance_labels(true)
            .tenant_labels(1);
        for i in 0..2000 {
            let junk = format!("made-up-{i}-{}", "x".repeat(200));
            // An unknown tool, a template tenant, an unlisted tenant (no template), an unlisted
            // and a template instance, no identity at all.
            let _ = now(limiter.admit(&Caller::new("acme"), &junk, Cost(1.0)));
            let _ = now(limiter.admit(&Caller::new(junk.as_str()), "web_search", Cost(1.0)));
            let _ = now(limiter.admit(&Caller::new(junk.as_str()), "closed", Cost(1.0)));
            let _ = now(limiter.admit(
                &Caller::new("acme").with_instance(junk.as_str()),
                "web_search",
                Cost(1.0),
            ));
            let _ = now(limiter.admit(&Caller::untenanted(), &junk, Cost(1.0)));
        }
        for c in [
            Caller::new("acme").with_instance("agent-7"),
            Caller::new("globex"),
            Caller::new("initech").with_instance("whoever"),
        ] {
            let _ = now(limiter.admit(&c, "web_search", Cost(1.0)));
            let _ = now(limiter.admit(&c, "closed", Cost(1.0)));
        }
    });
    let text = handle.render();
    assert!(!text.contains("made-up"), "a request's name became a label");
    let series = text
        .lines()
        .filter(|l| l.starts_with(DECISIONS) || l.starts_with(TENANT_HEADROOM))
        .count();
    assert!(series <= 16, "{series} series:\n{text}");
    let label_values = |label: &str| -> std::collections::BTreeSet<String> {
        text.lines()
            .filter(|l| l.starts_with(DECISIONS))
            .filter_map(|l| l.split(&format!("{label}=\"")).nth(1))
            .map(|rest| rest.split('"').next().unwrap().to_owned())
            .collect()
    };
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        label_values("tool"),
        set(&["closed", "unknown", "web_search"])
    );
    // Cap 1: acme (listed first) by name; globex past the cap, template tenants: `other`.
    assert_eq!(
        label_values("tenant"),
        set(&["acme", "initech", "other", "unknown"])
    );
    assert_eq!(
        label_values("instance"),
        set(&["agent-7", "none", "other", "unknown"])
    );
    // Headroom only for tenants labelled by name.
    assert!(line(&text, TENANT_HEADROOM, &["tenant=\"other\""]).is_none());
    assert!(line(&text, TENANT_HEADROOM, &["tenant=\"acme\""]).is_some());
}

/// A request that names no tool passes through unmetered, and says so: a counter (no labels,
/// so no growth) and a `debug` event with its path.
#[test]
fn requests_that_name_no_tool_are_counted() {
    use std::convert::Infallible;
    use tower::{Layer, Service};

    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        telemetry::describe_metrics();
        let policy = Policy::from_toml_str(
            "[[tool]]\nname = \"web_search\"\nunit = \"calls\"\nrate = { limit = 600, per = \"1m\" }\n[tool.default_tenant]\n",
        )
        .unwrap();
        let inner = tower::service_fn(|_req: http::Request<String>| async {
            Ok::<_, Infallible>(http::Response::new(String::new()))
        });
        let mut svc = tower_fairshare::FairShareLayer::new(Limiter::new(policy)).layer(inner);
        for path in [
            "/healthz",
            "/tools/web_search",
            "/api/tools/web_search",
            "/",
        ] {
            let mut req = http::Request::builder()
                .uri(path)
                .body(String::new())
                .unwrap();
            req.extensions_mut().insert(Caller::new("acme"));
            let res = now(svc.call(req)).unwrap();
            assert_eq!(res.status(), http::StatusCode::OK, "{path}");
        }
    });
    let text = handle.render();
    assert_eq!(value(&text, telemetry::UNMAPPED, &[]), 3.0, "{text}");
}

/// The console's refusal counts are the decision metrics' (the same labels: listed tenants by
/// name, every other caller `other`), for the same traffic.
#[test]
fn the_console_counts_refusals_as_the_metrics_do() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let state = metrics::with_local_recorder(&recorder, || {
        let policy = Policy::from_toml_str(
            r#"
            [[tool]]
            name = "web_search"
            unit = "calls"
            rate = { limit = 600, per = "1m" }
            max_concurrency = 40
            [tool.tenants.acme]
            ceiling = 3
            burst = 3
            [tool.default_tenant]
            ceiling = 2
            burst = 2
            budgets = [{ period = "day", max = 4 }]
            max_tenants = 3
            "#,
        )
        .unwrap();
        let limiter = Limiter::with_store(policy, MemoryStore::new(), ManualClock::new(EPOCH));
        let console = limiter.console();
        let mut held = Vec::new();
        // made-up-1 calls past 32 refusals: two reports of 16, so it is among the busiest.
        for k in 0..120u64 {
            let caller = match k % 3 {
                0 => Caller::new("acme"),
                1 => Caller::new(format!("made-up-{}", k % 7)),
                _ => Caller::new("made-up-1"),
            };
            if let Ok(t) = now(limiter.admit(&caller, "web_search", Cost(1.0))) {
                held.push(t);
            }
        }
        console_state(console)
    });
    let text = handle.render();
    let compared = refusals_counted_alike(&state, &text);
    assert!(
        compared >= 3,
        "refusals of acme and of `other`, by reason: {state}"
    );
    // Raw names of unlisted callers appear only among the busiest (here the one refused
    // more than 32 times), never as rows.
    assert!(
        !state["tools"][0]["tenants"].to_string().contains("made-up"),
        "{state}"
    );
    assert_eq!(
        state["tools"][0]["busiest"]["tenants"][0]["tenant"], "made-up-1",
        "{state}"
    );
    assert!(text.contains("tenant=\"made-up-1\""), "{text}");
    assert!(!text.contains("tenant=\"made-up-2\""), "{text}");
}

/// What the console's `/fairshare/state` answers now.
fn console_state(console: tower_fairshare::Console<MemoryStore, ManualClock>) -> serde_json::Value {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let get = http::Request::get("/fairshare/state")
        .body(String::new())
        .unwrap();
    let res = now(console.oneshot(get)).unwrap();
    let body = now(res.into_body().collect()).unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

/// Each tenant's refusals by reason in the console's `state` are the decision metrics' in
/// `text` (the console's `other` is every unlisted caller; the metrics name the busiest of
/// them apart): how many were compared.
fn refusals_counted_alike(state: &serde_json::Value, text: &str) -> usize {
    let tenants = state["tools"][0]["tenants"].as_array().unwrap();
    let mut compared = 0;
    for t in tenants {
        let name = t["name"].as_str().unwrap();
        for (reason, n) in t["refused"].as_object().unwrap() {
            let labels = [
                "outcome=\"refused\"".to_owned(),
                format!("reason=\"{reason}\""),
            ];
            let tenant_is = |l: &str| match name {
                "other" => !l.contains("tenant=\"acme\""),
                _ => l.contains(&format!("tenant=\"{name}\"")),
            };
            let metric: f64 = text
                .lines()
                .filter(|l| {
                    l.starts_with(DECISIONS) && labels.iter().all(|x| l.contains(x.as_str()))
                })
                .filter(|l| tenant_is(l))
                .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
                .sum();
            assert_eq!(n.as_f64().unwrap(), metric, "{name} {reason}:\n{text}");
            compared += 1;
        }
    }
    compared
}

/// Makes 1,000 calls of `acme` with `call` on `toml`'s policy, 10 µs apart, gives the leases
/// back, and checks that every leasing tool's metrics add up: every unit granted for a lease
/// is a grant's first call, a call spent from the lease (a hit) or a unit given back; once the
/// leases are given back, none is held.
fn lease_metrics_add_up(
    toml: &str,
    tools: &[&str],
    call: impl Fn(&Limiter<MemoryStore, ManualClock>, &Caller),
) {
    use tower_fairshare::telemetry::{
        LEASE_GRANTED_UNITS, LEASE_GRANTS, LEASE_HELD_UNITS, LEASE_HITS, LEASE_RETURNED_UNITS,
    };
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let clock = ManualClock::new(EPOCH);
    let calls = 1_000;
    metrics::with_local_recorder(&recorder, || {
        let policy = Policy::from_toml_str(toml).unwrap();
        let limiter = Limiter::with_store(policy, MemoryStore::new(), clock.clone());
        let acme = Caller::new("acme");
        for _ in 0..calls {
            clock.advance(std::time::Duration::from_micros(10));
            call(&limiter, &acme);
        }
        assert!(limiter.leased_units() > 0.0);
        now(limiter.return_leases());
    });
    let text = handle.render();
    for name in tools {
        let label = format!("tool=\"{name}\"");
        let tool = [label.as_str()];
        let hits = value(&text, LEASE_HITS, &tool);
        let grants = value(&text, LEASE_GRANTS, &tool);
        let granted = value(&text, LEASE_GRANTED_UNITS, &tool);
        let returned = value(&text, LEASE_RETURNED_UNITS, &tool);
        assert!(
            hits > 0.9 * calls as f64,
            "{name}: {hits} of {calls} calls from leases"
        );
        assert!(returned > 0.0, "{name}: the last lease was given back");
        assert_eq!(granted, grants + hits + returned, "{name}: granted units");
        assert_eq!(
            value(&text, LEASE_HELD_UNITS, &tool),
            0.0,
            "{name}: units held"
        );
    }
}

/// A call charged to a leasing tool and to one that does not lease: its part spent from the
/// lease goes back to it before the call goes to the store, and the units held still add up
/// to zero once the leases are given back.
#[test]
fn a_lease_part_put_back_is_held_again() {
    use tower_fairshare::telemetry::LEASE_HELD_UNITS;
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let clock = ManualClock::new(EPOCH);
    metrics::with_local_recorder(&recorder, || {
        let toml = leasing_tool("chat.requests")
            + &leasing_tool("chat.tokens").replace("lease = { max = 64 }", "lease = \"off\"");
        let policy = Policy::from_toml_str(&toml).unwrap();
        let limiter = Limiter::with_store(policy, MemoryStore::new(), clock.clone());
        let acme = Caller::new("acme");
        let call = [("chat.requests", Cost(1.0)), ("chat.tokens", Cost(1.0))];
        for _ in 0..1_000 {
            clock.advance(std::time::Duration::from_micros(10));
            now(limiter.admit_all(&acme, &call)).unwrap();
        }
        now(limiter.return_leases());
        assert_eq!(limiter.leased_units(), 0.0);
    });
    let text = handle.render();
    let held = value(&text, LEASE_HELD_UNITS, &["tool=\"chat.requests\""]);
    assert_eq!(held, 0.0, "units held once every lease is given back");
}

/// On a tokio runtime a lease fetches its next grant ahead, and calls move on to it: each call
/// spent from either grant is a hit and lowers the units held, so the counts still add up.
#[test]
fn lease_metrics_add_up_when_grants_are_fetched_ahead() {
    use tower_fairshare::telemetry::{LEASE_GRANTED_UNITS, LEASE_GRANTS, LEASE_HITS};
    use tower_fairshare::telemetry::{LEASE_HELD_UNITS, LEASE_RETURNED_UNITS};
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let clock = ManualClock::new(EPOCH);
    let calls = 1_000;
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let policy = Policy::from_toml_str(&leasing_tool("search")).unwrap();
            let limiter = Limiter::with_store(policy, MemoryStore::new(), clock.clone());
            let acme = Caller::new("acme");
            for _ in 0..calls {
                clock.advance(std::time::Duration::from_micros(10));
                limiter.admit(&acme, "search", Cost(1.0)).await.unwrap();
                // The grant fetched ahead arrives before the next call.
                tokio::task::yield_now().await;
            }
            limiter.return_leases().await;
        });
    });
    let text = handle.render();
    let tool = ["tool=\"search\""];
    let grants = value(&text, LEASE_GRANTS, &tool);
    let granted = value(&text, LEASE_GRANTED_UNITS, &tool);
    let hits = value(&text, LEASE_HITS, &tool);
    let returned = value(&text, LEASE_RETURNED_UNITS, &tool);
    assert!(
        grants > 2.0,
        "{grants} grants: the lease moved on to grants fetched ahead"
    );
    assert!(
        hits > 0.9 * calls as f64,
        "{hits} of {calls} calls from leases"
    );
    assert!(
        granted >= hits + returned,
        "{granted} granted: {hits} spent, {returned} back"
    );
    assert_eq!(value(&text, LEASE_HELD_UNITS, &tool), 0.0, "units held");
}

/// A leasing tool's tool section of a policy, in group `chat`.
fn leasing_tool(name: &str) -> String {
    format!(
        "[[tool]]\nname = \"{name}\"\ngroup = \"chat\"\nunit = \"calls\"\n\
         rate = {{ limit = 1000000, per = \"1m\" }}\nlease = {{ max = 64 }}\n\
         [tool.tenants.acme]\nburst = 1000\n"
    )
}

#[test]
fn lease_grants_hits_returns_and_held_units_add_up() {
    lease_metrics_add_up(&leasing_tool("search"), &["search"], |l, acme| {
        now(l.admit(acme, "search", Cost(1.0))).unwrap();
    });
}

/// The same for a call charged to two tools at once (`admit_all`): its grants are counted
/// like a call of one tool's, so the units held go back to zero.
#[test]
fn lease_metrics_add_up_for_a_call_charged_to_two_tools() {
    let toml = leasing_tool("chat.requests") + &leasing_tool("chat.tokens");
    let call = [("chat.requests", Cost(1.0)), ("chat.tokens", Cost(1.0))];
    lease_metrics_add_up(&toml, &["chat.requests", "chat.tokens"], |l, acme| {
        now(l.admit_all(acme, &call)).unwrap();
    });
}

/// Callers whose quota is less than one call (many template tenants beside a heavy listed
/// one) and who call a few times each are never named among the busiest: only a caller that
/// is busy is, and the metrics get no label value for the others. (Each of their admitted
/// calls used to be counted as 16 decisions, naming whoever called twice.)
#[test]
fn callers_with_a_quota_under_one_call_are_not_named_for_calling_twice() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let state = metrics::with_local_recorder(&recorder, || {
        let policy = Policy::from_toml_str(
            r#"
            [[tool]]
            name = "web_search"
            unit = "calls"
            rate = { limit = 600, per = "1m" }
            burst = 600
            [tool.tenants.big]
            weight = 1000
            [tool.default_tenant]
            burst = 5
            max_tenants = 100
            "#,
        )
        .unwrap();
        let limiter = Limiter::with_store(policy, MemoryStore::new(), ManualClock::new(EPOCH));
        let console = limiter.console();
        let mut quotas = Vec::new();
        for _ in 0..3 {
            for k in 0..30 {
                let caller = Caller::new(format!("guest-{k}"));
                if let Ok(t) = now(limiter.admit(&caller, "web_search", Cost(1.0))) {
                    quotas.extend(t.quota());
                }
            }
        }
        // A quota under one call, admitted from the caller's burst.
        assert!(
            quotas.len() == 90 && quotas.iter().all(|q| *q < 1.0),
            "{quotas:?}"
        );
        // Refused past its burst: two reports of 16 refusals, so it is among the busiest.
        let loud = Caller::new("loud");
        for _ in 0..40 {
            let _ = now(limiter.admit(&loud, "web_search", Cost(1.0)));
        }
        console_state(console)
    });
    let busy: Vec<&str> = state["tools"][0]["busiest"]["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(busy, ["loud"], "{state}");
    let text = handle.render();
    assert!(text.contains("tenant=\"loud\""), "{text}");
    assert!(!text.contains("tenant=\"guest-"), "{text}");
}
