//! ns per admission decision in memory: tool + tenant + instance + one budget.
//!
//! `cargo bench --bench admission`
//!
//! With `FS_DECISIONS=N` it makes N decisions of one caller and exits, for instruction counts:
//! `valgrind --tool=callgrind` at N and 2N, the difference divided by N is one decision's
//! marginal cost (`scripts/callgrind-decision` does this). `FS_TOOL=leased` decides on the
//! leasing tool instead, `FS_TOOL=flat` on a tool of two levels (no budget, no instance level);
//! `FS_TOOL=two` (`leased-two`) charges each call to two tools at once (leasing);
//! `FS_TOOL=saturated` cycles over the saturated policy's 120 tenants,
//! most calls refused; `FS_CALLERS=N` cycles over N callers, each a tenant of its own;
//! `FS_TOOL=sketch` and `FS_TOOL=sketch-bare` decide with the sketch of an exact decision
//! (`benches/sketch/mod.rs`) instead of the crate; `FS_TOOL=governor` (`chained`) checks
//! governor's keyed limiter on one key (three chained, on one caller), the baselines.
//! `FS_LAYER=bare|admitted|headers` makes N calls through a bare service or through
//! `FairShareLayer` over it (without or with RateLimit headers) instead, each request built
//! and its response dropped; `FS_LAYER=unmatched` (and `bare-unmatched`) the same for a path no
//! tool matches; `FS_LAYER=refused` through the layer, each call refused (429);
//! `FS_LAYER=model` makes N model calls through `model_calls()` (one tool; `model-two`: charged
//! to two, a request and its tokens).

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use tower_fairshare::Cost;

#[path = "common/mod.rs"]
mod common;
#[path = "sketch/mod.rs"]
mod sketch;
use common::{callers, generous_quota, limiter, now, saturated, Chained};

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    g.measurement_time(Duration::from_secs(3));

    let l = limiter();
    let one = callers("tenant", 1);
    g.bench_function("1 caller", |b| {
        b.iter(|| now(l.admit(&one[0], "search", Cost(1.0))).is_ok())
    });

    let l = limiter();
    let many = callers("tenant", 10_000);
    for c in &many {
        now(l.admit(c, "search", Cost(1.0))).unwrap();
    }
    let mut i = 0;
    g.bench_function("10000 callers", |b| {
        b.iter(|| {
            i = (i + 1) % many.len();
            now(l.admit(&many[i], "search", Cost(1.0))).is_ok()
        })
    });

    for (name, shared) in [
        ("2 threads, distinct tenants", false),
        ("2 threads, shared tenant", true),
    ] {
        let l = Arc::new(limiter());
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let per_thread = iters.div_ceil(2);
                let start = Instant::now();
                std::thread::scope(|s| {
                    for t in 0..2 {
                        let l = l.clone();
                        let who = if shared {
                            callers("shared", 1)
                        } else {
                            callers(&format!("t{t}-"), 64)
                        };
                        s.spawn(move || {
                            for k in 0..per_thread as usize {
                                let _ = now(l.admit(&who[k % who.len()], "search", Cost(1.0)));
                            }
                        });
                    }
                });
                // Wall time of all the decisions (split between the threads): criterion divides
                // by `iters`, which gives wall time per decision; lower is more throughput.
                start.elapsed()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);

/// `FS_LAYER=bare|admitted|headers`: `n` calls through a bare service, or through
/// `FairShareLayer` over it without or with RateLimit headers, each request built and its
/// response dropped (the bare case's count is what the layer's are measured from);
/// `unmatched` and `bare-unmatched`: the same for `/health`, a path no tool matches;
/// `refused`: through the layer, each call refused (429).
fn layered(mode: &str, n: u64) {
    use tower::{Layer, Service};
    use tower_fairshare::{Caller, FairShareLayer};

    let bare = || {
        tower::service_fn(|_req: http::Request<tonic::body::Body>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(tonic::body::Body::empty()))
        })
    };
    let uri = match mode {
        "unmatched" | "bare-unmatched" => "/health",
        // Its caller's ceiling is one call a minute: every call after the first is refused.
        "refused" => "/tools/exhausted",
        _ => "/tools/search",
    };
    let answered = |r: &http::Response<_>| match mode {
        "refused" => r.status() == http::StatusCode::TOO_MANY_REQUESTS,
        _ => r.status().is_success(),
    };
    let request = || {
        let mut req = http::Request::builder()
            .uri(uri)
            .body(tonic::body::Body::empty())
            .expect("a valid request");
        req.extensions_mut()
            .insert(Caller::new("tenant0").with_instance("agent"));
        req
    };
    let mut ok = 0u64;
    if mode.starts_with("bare") {
        let mut s = bare();
        for _ in 0..n {
            ok += u64::from(now(s.call(request())).is_ok_and(|r| r.status().is_success()));
        }
    } else {
        let mut s = FairShareLayer::new(limiter())
            .headers(mode == "headers")
            .layer(bare());
        if mode == "refused" {
            now(s.call(request())).expect("the first call, admitted");
        }
        for _ in 0..n {
            now(std::future::poll_fn(|cx| s.poll_ready(cx))).expect("ready");
            ok += u64::from(now(s.call(request())).is_ok_and(|r| answered(&r)));
        }
    }
    assert_eq!(ok, n);
}

/// `FS_LAYER=model`: `n` model calls through `FairShareLayer::model_calls()` charged to the
/// tokens tool `chat.tokens`, as the compare bench's `model call/one tool` (`FS_LAYER=model-two`,
/// `two`: also one request of `chat.requests`, as its `model call/two tools`): the request's
/// JSON read for its estimate, the call decided, the answer's JSON read to its end and its
/// `usage` settled.
fn model_calls(n: u64, two: bool) {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use tonic::body::Body;
    use tower::{Layer, Service, ServiceExt};
    use tower_fairshare::{BufferedBody, Caller, FairShareLayer};

    const ASK: &[u8] =
        br#"{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"hello"}]}"#;
    const ANSWER: &[u8] =
        br#"{"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":30,"total_tokens":50}}"#;
    let model = tower::service_fn(|_req: http::Request<BufferedBody>| async {
        let mut res = http::Response::new(Body::new(Full::new(Bytes::from_static(ANSWER))));
        let json = http::HeaderValue::from_static("application/json");
        res.headers_mut().insert(http::header::CONTENT_TYPE, json);
        Ok::<_, std::convert::Infallible>(res)
    });
    let mut layer = FairShareLayer::new(limiter()).model_calls();
    if two {
        layer = layer.requests("chat.requests");
    }
    let layer = layer.tokens("chat.tokens");
    let mut svc = layer.layer(model);
    let mut ok = 0u64;
    for _ in 0..n {
        let mut req = http::Request::post("/v1/chat/completions")
            .body(Body::new(Full::new(Bytes::from_static(ASK))))
            .expect("a valid request");
        req.extensions_mut()
            .insert(Caller::new("t").with_instance("a"));
        let svc = now(ServiceExt::<http::Request<Body>>::ready(&mut svc)).expect("ready");
        let res = now(svc.call(req)).expect("a response");
        ok += u64::from(res.status().is_success() && now(res.into_body().collect()).is_ok());
    }
    assert_eq!(ok, n);
}

fn main() {
    if let Some(n) = std::env::var("FS_DECISIONS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        if let Ok(layer) = std::env::var("FS_LAYER") {
            match layer.as_str() {
                "model" => model_calls(n, false),
                "model-two" => model_calls(n, true),
                _ => layered(&layer, n),
            }
            return;
        }
        let tool = std::env::var("FS_TOOL").unwrap_or_else(|_| "search".to_owned());
        if baseline(&tool, n) {
            return;
        }
        if let Some(work) = match tool.as_str() {
            "sketch" => Some(true),
            "sketch-bare" => Some(false),
            _ => None,
        } {
            // The sketch of an exact decision (`benches/sketch/mod.rs`), on one caller.
            let s = sketch::Sketch::default();
            let who = sketch::Who {
                tenant: "tenant0".into(),
                instance: "agent".into(),
            };
            let mut admitted = 0u64;
            for _ in 0..n {
                let t = if work {
                    s.with_work(&who, std::hint::black_box("search"), 1.0)
                } else {
                    s.bare(&who, std::hint::black_box("search"), 1.0)
                };
                admitted += u64::from(t.is_some());
            }
            assert_eq!(admitted, n);
            return;
        }
        if let Some(two) = match tool.as_str() {
            "two" => Some(["chat.requests", "chat.tokens"]),
            "leased-two" => Some(["leased.requests", "leased.tokens"]),
            _ => None,
        } {
            // A call charged to two tools at once (`Limiter::admit_all`).
            let l = limiter();
            let who = callers("tenant", 1);
            let charges = [(two[0], Cost(1.0)), (two[1], Cost(1.0))];
            let mut admitted = 0u64;
            for _ in 0..n {
                admitted += u64::from(now(l.admit_all(&who[0], &charges)).is_ok());
            }
            assert_eq!(admitted, n);
            return;
        }
        if tool == "saturated" {
            // The saturated policy's 120 tenants in turn, most calls refused (as in
            // `benches/compare.rs`).
            let (l, crowd) = saturated();
            let mut refused = 0u64;
            for k in 0..n as usize {
                refused += u64::from(now(l.admit(&crowd[k % 120], &tool, Cost(1.0))).is_err());
            }
            assert!(refused * 2 > n, "most calls refused: {refused} of {n}");
            return;
        }
        // `FS_CALLERS=N`: N callers in turn (each a tenant of its own), as the 10k-callers case.
        let count = std::env::var("FS_CALLERS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(1);
        let l = limiter();
        let who = callers("tenant", count);
        let mut admitted = 0u64;
        for k in 0..n as usize {
            admitted += u64::from(now(l.admit(&who[k % count], &tool, Cost(1.0))).is_ok());
        }
        assert_eq!(admitted, n);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}

/// `FS_TOOL=governor` (`chained`): `n` checks of governor's keyed limiter on one key (of the
/// three chained governors on one caller), the baselines of `benches/compare.rs`, counted as
/// the crate's decisions are: on std's monotonic clock, as the crate's `SystemClock` reads it
/// in this bench (quanta's clock calibrates itself at start for a time that varies, which
/// N and 2N runs would not cancel). Whether `tool` names one.
fn baseline(tool: &str, n: u64) -> bool {
    use governor::clock::MonotonicClock;
    let mut admitted = 0u64;
    match tool {
        "governor" => {
            let gov: common::Keyed<u64, MonotonicClock> =
                governor::RateLimiter::dashmap_with_clock(generous_quota(), MonotonicClock);
            for _ in 0..n {
                admitted += u64::from(gov.check_key(std::hint::black_box(&0u64)).is_ok());
            }
        }
        "chained" => {
            let chained = Chained::with_clock(generous_quota(), MonotonicClock);
            let keys = Chained::keys(&callers("tenant", 1));
            for _ in 0..n {
                admitted += u64::from(chained.check(std::hint::black_box(&keys[0])));
            }
        }
        _ => return false,
    }
    assert_eq!(admitted, n);
    true
}
