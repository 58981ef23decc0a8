//! Fuzzing, briefly, in every test run (`FS_FUZZ_CASES` runs more): the policy parser over
//! arbitrary bytes and over generated TOML trees with hostile numbers and names, and the
//! layer's request handling over hostile request shapes. Nothing may panic; what is accepted
//! must be usable (every derived number finite, every decision well-formed); every request
//! gets one of the documented answers, and the inner service runs exactly when it should.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tower::{service_fn, Layer, Service, ServiceExt};
/// The virtual start of the tests: 2026-01-01T00:00:00Z, aligned to every period and calendar window.
const EPOCH: tower_fairshare::Timestamp = tower_fairshare::Timestamp(1_767_225_600_000_000);
use tower_fairshare::{
    Caller, Cost, FairShareLayer, Limiter, ManualClock, MemoryStore, Policy, RATELIMIT,
    RATELIMIT_POLICY,
};

fn cases(default: u32) -> u32 {
    std::env::var("FS_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// What an accepted policy must be: usable by the engine.
fn check_usable(policy: &Policy) -> Result<(), TestCaseError> {
    prop_assert!(policy.tools().count() > 0, "an empty policy was accepted");
    for t in policy.allocation().tools {
        prop_assert!(t.capacity.is_finite() && t.capacity >= 1.0, "{t:?}");
        prop_assert!(t.burst.is_finite() && t.spare.is_finite(), "{t:?}");
        for r in &t.tenants {
            for x in [r.floor, r.weight, r.share, r.ceiling, r.burst] {
                prop_assert!(x.is_finite() && x >= 0.0, "{}: {r:?}", t.name);
            }
            for i in &r.instances {
                for x in [i.floor, i.weight, i.share, i.ceiling, i.burst] {
                    prop_assert!(x.is_finite() && x >= 0.0, "{}: {i:?}", t.name);
                }
            }
        }
    }
    // A decision for a listed and a template caller of every tool is well-formed.
    let limiter = Limiter::with_store(policy.clone(), MemoryStore::new(), ManualClock::new(EPOCH));
    for tool in policy.tools() {
        let mut callers = vec![Caller::new("fuzz-template").with_instance("i")];
        if let Some(t) = tool.tenants().first() {
            callers.push(Caller::new(t.name()).with_instance("i"));
        }
        for c in callers {
            match limiter.try_admit(&c, tool.name(), Cost(1.0)) {
                Some(Ok(t)) => {
                    if let Some(a) = &t.admission() {
                        prop_assert!(a.remaining.is_finite() && a.quota.is_finite(), "{a:?}");
                    }
                }
                Some(Err(r)) => {
                    for x in [r.limit, r.used].into_iter().flatten() {
                        prop_assert!(x.is_finite(), "{r:?}");
                    }
                    let _ = r.to_json();
                }
                None => prop_assert!(false, "the memory store answers at once"),
            }
        }
    }
    Ok(())
}

/// Arbitrary bytes (as text, lossily) and byte-level mutations of a valid policy.
#[test]
fn the_policy_parser_takes_any_bytes() {
    const BASE: &str = "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 600, per = \"1m\" }\nburst = 20\n[tool.tenants.a]\nfloor = 100\nweight = 2\nbudgets = [{ period = \"hour\", max = 5000 }]\n[tool.tenants.a.default_instance]\nmax_instances = 5\n[tool.default_tenant]\n";
    let strategy = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        // A valid file with a few bytes overwritten, inserted or cut.
        prop::collection::vec((0usize..BASE.len(), any::<u8>(), 0u8..3), 1..8).prop_map(|edits| {
            let mut b = BASE.as_bytes().to_vec();
            for (at, byte, kind) in edits {
                if b.is_empty() {
                    break;
                }
                let at = at.min(b.len() - 1);
                match kind {
                    0 => b[at] = byte,
                    1 => b.insert(at, byte),
                    _ => {
                        b.truncate(at);
                    }
                }
            }
            b
        }),
    ];
    runner(cases(3000))
        .run(&strategy, |bytes| {
            let text = String::from_utf8_lossy(&bytes);
            for parsed in [Policy::from_toml_str(&text), Policy::from_json_str(&text)] {
                match parsed {
                    Ok(p) => check_usable(&p)?,
                    Err(e) => {
                        let problems = e.problems();
                        prop_assert!(!problems.is_empty());
                        prop_assert!(problems.iter().all(|(_, m)| !m.is_empty()));
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A number for a policy field: sane ones only, or hostile ones among them.
fn number(hostile: bool) -> impl Strategy<Value = String> {
    let sane = prop_oneof![
        (1u32..2000).prop_map(|n| n.to_string()),
        (1.0f64..100.0).prop_map(|x| format!("{x:?}")),
    ];
    if !hostile {
        return sane.boxed();
    }
    prop_oneof![
        4 => sane,
        1 => Just("0".to_owned()),
        1 => Just("-1".to_owned()),
        1 => Just("nan".to_owned()),
        1 => Just("inf".to_owned()),
        1 => Just("1e308".to_owned()),
        1 => Just("1e-300".to_owned()),
        1 => Just("0.001".to_owned()),
        1 => Just("4294967296".to_owned()),
        1 => (0.0f64..1e6).prop_map(|x| format!("{x:?}")),
    ]
    .boxed()
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z]{1,6}",
        1 => Just(" ".to_owned()),
        1 => Just(String::new()),
        1 => "[\\PC]{1,8}",
    ]
}

fn period() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop_oneof![Just("1s"), Just("1m"), Just("1h"), Just("1d"), Just("500ms")].prop_map(str::to_owned),
        1 => Just("0s".to_owned()),
        1 => Just("400d".to_owned()),
        1 => Just("99999999999999999999d".to_owned()),
        1 => "[0-9a-z]{0,5}",
    ]
}

fn field(key: &'static str, hostile: bool) -> impl Strategy<Value = String> {
    // Counts are whole numbers unless hostile.
    let value = if key.starts_with("max_") && !hostile {
        (1u32..100).prop_map(|n| n.to_string()).boxed()
    } else {
        number(hostile).boxed()
    };
    prop::option::weighted(0.4, value).prop_map(move |v| match v {
        Some(v) => format!("{key} = {v}\n"),
        None => String::new(),
    })
}

fn budgets(hostile: bool) -> impl Strategy<Value = String> {
    (
        prop::sample::subsequence(vec!["hour", "day", "month"], 0..=3),
        prop::collection::vec(number(hostile).prop_map(|n| format!("{n}000000")), 3),
    )
        .prop_map(|(periods, maxes)| periods.into_iter().zip(maxes).collect::<Vec<_>>())
        .prop_map(|b| {
            if b.is_empty() {
                return String::new();
            }
            let items: Vec<String> = b
                .into_iter()
                .map(|(p, m)| format!("{{ period = \"{p}\", max = {m} }}"))
                .collect();
            format!("budgets = [{}]\n", items.join(", "))
        })
}

fn level(hostile: bool) -> impl Strategy<Value = String> {
    (
        field("weight", hostile),
        prop::option::weighted(0.2, (1u32..5).prop_map(|n| format!("floor = {n}\n")))
            .prop_map(Option::unwrap_or_default),
        field("ceiling", hostile),
        field("burst", hostile),
        field("max_concurrency", hostile),
        budgets(hostile),
    )
        .prop_map(|(a, b, c, d, e, f)| format!("{a}{b}{c}{d}{e}{f}"))
}

fn tool(hostile: bool) -> impl Strategy<Value = String> {
    let name = move || {
        if hostile {
            name().boxed()
        } else {
            "[a-z]{1,6}".boxed()
        }
    };
    (
        name(),
        number(hostile).prop_map(|n| format!("{n}000")),
        if hostile { period().boxed() } else { Just("1m".to_owned()).boxed() },
        field("burst", hostile),
        Just(()),
        prop::option::of((level(hostile), field("max_tenants", hostile))),
        prop::collection::vec(
            (
                name(),
                level(hostile),
                prop::collection::vec((name(), level(hostile)), 0..3),
                prop::option::of((level(hostile), field("max_instances", hostile))),
            ),
            0..4,
        ),
    )
        .prop_map(|(name, limit, per, burst, _, default, tenants)| {
            let mut t = format!(
                "[[tool]]\nname = {name:?}\nunit = \"tokens\"\nrate = {{ limit = {limit}, per = {per:?} }}\n{burst}"
            );
            if let Some((d, max)) = default {
                t.push_str(&format!("[tool.default_tenant]\n{d}{max}"));
            }
            for (tn, tl, instances, default_instance) in tenants {
                t.push_str(&format!("[tool.tenants.{tn:?}]\n{tl}"));
                if let Some((d, max)) = default_instance {
                    t.push_str(&format!("[tool.tenants.{tn:?}.default_instance]\n{d}{max}"));
                }
                for (iname, il) in instances {
                    t.push_str(&format!("[tool.tenants.{tn:?}.instances.{iname:?}]\n{il}"));
                }
            }
            t
        })
}

/// Generated policies: the shape of a real file with hostile numbers, periods and names.
/// Whatever is accepted is usable; whatever is refused says what and where.
#[test]
fn generated_policies_are_usable_or_refused_with_a_path() {
    let accepted = std::cell::Cell::new(0u32);
    runner(cases(1000))
        .run(
            &prop_oneof![
                prop::collection::vec(tool(false), 1..3),
                prop::collection::vec(tool(true), 1..3),
            ],
            |tools| {
                let text = tools.concat();
                match Policy::from_toml_str(&text) {
                    Ok(p) => {
                        accepted.set(accepted.get() + 1);
                        check_usable(&p)?
                    }
                    Err(e) => {
                        for (path, message) in e.problems() {
                            prop_assert!(!message.is_empty(), "{text}");
                            prop_assert!(
                                !path.is_empty() || message.contains("line"),
                                "no location for {message:?} in\n{text}"
                            );
                        }
                    }
                }
                Ok(())
            },
        )
        .unwrap();
    eprintln!("{} generated policies accepted", accepted.get());
    assert!(accepted.get() > 0, "no generated policy was ever accepted");
}

/// A request, as a hostile client (or a careless auth layer) might shape it.
#[derive(Debug, Clone)]
struct Shape {
    method: &'static str,
    path: String,
    grpc: bool,
    caller: Option<(Option<String>, Option<String>, Option<String>)>,
    cost: Option<f64>,
}

fn shape() -> impl Strategy<Value = Shape> {
    let text = || {
        prop_oneof![
            3 => prop_oneof![Just("acme"), Just("globex"), Just("internal"), Just("agent-1")].prop_map(str::to_owned),
            1 => Just(String::new()),
            1 => "[\\PC]{0,12}",
            1 => "[a-z:{}|]{200,400}",
        ]
    };
    let path = prop_oneof![
        3 => prop_oneof![Just("report"), Just("llm"), Just("unknown"), Just("")]
            .prop_map(|t| format!("/tools/{t}")),
        1 => "/tools/[a-z%0-9/.]{0,20}",
        1 => "/[a-zA-Z0-9/%._~-]{0,40}",
        1 => Just("/tools/report/../llm".to_owned()),
        1 => Just(format!("/tools/{}", "x".repeat(3000))),
    ];
    let cost = prop_oneof![
        3 => Just(None),
        1 => prop_oneof![
            Just(f64::NAN), Just(f64::INFINITY), Just(-1.0), Just(0.0), Just(1e300), Just(1e-300)
        ].prop_map(Some),
        1 => (0.0f64..2000.0).prop_map(Some),
    ];
    (
        prop_oneof![Just("GET"), Just("POST"), Just("DELETE"), Just("OPTIONS")],
        path,
        prop::bool::weighted(0.2),
        prop::option::weighted(
            0.8,
            (
                prop::option::weighted(0.9, text()),
                prop::option::of(text()),
                prop::option::of(text()),
            ),
        ),
        cost,
    )
        .prop_map(|(method, path, grpc, caller, cost)| Shape {
            method,
            path,
            grpc,
            caller,
            cost,
        })
}

const SHAPES_POLICY: &str = r#"
[[tool]]
name = "report"
unit = "calls"
rate = { limit = 600, per = "1m" }
tier = "internal"
max_concurrency = 4
[tool.tenants.acme]
floor = 10
[tool.tenants.acme.default_instance]
max_instances = 3
[tool.default_tenant]
ceiling = 5
burst = 5
max_tenants = 50

[[tool]]
name = "llm"
unit = "tokens"
rate = { limit = 1000, per = "1m" }
require_tenant = false
[tool.default_tenant]
max_tenants = 20
"#;

/// The layer over every request shape: an answer from the documented set, never a panic; the
/// inner service runs for admitted and unmapped requests only; refusals carry well-formed
/// JSON (HTTP) or a gRPC status, and ASCII RateLimit headers.
#[test]
fn the_layer_answers_any_request_shape() {
    let policy = Policy::from_toml_str(SHAPES_POLICY).unwrap();
    let clock = ManualClock::new(EPOCH);
    let limiter = Limiter::with_store(policy, MemoryStore::new(), clock.clone());
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = ran.clone();
    let inner = service_fn(move |_req: Request<Full<Bytes>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
    });
    let svc = FairShareLayer::new(limiter)
        .tool_from_path("/tools/")
        .headers(true)
        .layer(inner);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runner(cases(2000))
        .run(&shape(), |s| {
            clock.advance(std::time::Duration::from_millis(7));
            // A path that is no URI is not a request any server would hand over.
            let Some(req) = request_of(&s) else {
                return Ok(());
            };
            let before = ran.load(Ordering::SeqCst);
            let (status, headers, body) = rt.block_on(async {
                let mut svc = svc.clone();
                let res = svc.ready().await.unwrap().call(req).await.unwrap();
                let status = res.status();
                let headers = res.headers().clone();
                let body = res.into_body().collect().await.unwrap().to_bytes();
                (status, headers, body)
            });
            let ran_inner = ran.load(Ordering::SeqCst) > before;
            well_answered(&s, status, &headers, &body, ran_inner)
        })
        .unwrap();
}

/// The request of shape `s`, its caller and cost in its extensions; `None` when its path is
/// no URI.
fn request_of(s: &Shape) -> Option<Request<Full<Bytes>>> {
    let mut req = Request::builder()
        .method(s.method)
        .uri(s.path.parse::<http::Uri>().ok()?);
    if s.grpc {
        req = req.header("content-type", "application/grpc");
    }
    let mut req = req.body(Full::new(Bytes::new())).unwrap();
    if let Some((tenant, instance, tier)) = &s.caller {
        let mut c = match tenant {
            Some(t) => Caller::new(t.as_str()),
            None => Caller::untenanted(),
        };
        if let Some(i) = instance {
            c = c.with_instance(i.as_str());
        }
        if let Some(t) = tier {
            c = c.with_tier(t.as_str());
        }
        req.extensions_mut().insert(c);
    }
    if let Some(c) = s.cost {
        req.extensions_mut().insert(Cost(c));
    }
    Some(req)
}

/// The answer to shape `s` is one the layer documents: a known status, ASCII RateLimit
/// headers, the inner service run only for what passed, a refusal with its JSON or gRPC status.
fn well_answered(
    s: &Shape,
    status: StatusCode,
    headers: &http::HeaderMap,
    body: &Bytes,
    ran_inner: bool,
) -> Result<(), TestCaseError> {
    prop_assert!(
        [200, 401, 403, 429, 503].contains(&status.as_u16()),
        "{s:?}: {status}"
    );
    for name in [RATELIMIT, RATELIMIT_POLICY] {
        if let Some(v) = headers.get(&name) {
            prop_assert!(v.to_str().is_ok(), "{s:?}: {name} {v:?}");
        }
    }
    if status == StatusCode::OK && body.as_ref() == b"ok" {
        prop_assert!(ran_inner, "{s:?}");
        return Ok(());
    }
    prop_assert!(!ran_inner, "{s:?}: refused, yet the inner service ran");
    if s.grpc {
        prop_assert!(headers.contains_key("grpc-status"), "{s:?}");
        return Ok(());
    }
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| TestCaseError::fail(format!("{s:?}: {e}: {body:?}")))?;
    prop_assert!(v["error"].is_string(), "{s:?}: {v}");
    prop_assert!(
        v["retry_after_ms"].is_null() || v["retry_after_ms"].is_u64(),
        "{s:?}: {v}"
    );
    Ok(())
}
