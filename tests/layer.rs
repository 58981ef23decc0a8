//! FairShareLayer over a counting inner service: order of operations, refusals, permits held
//! by response bodies, cancel-safety, cost correction, headers, shadow mode.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, Service, ServiceExt};
/// The virtual start of the tests: 2026-01-01T00:00:00Z, aligned to every period and calendar window.
const EPOCH: tower_fairshare::Timestamp = tower_fairshare::Timestamp(1_767_225_600_000_000);
use tower_fairshare::{
    Caller, Cost, FairShareLayer, Limiter, ManualClock, MemoryStore, Policy, Store, RATELIMIT,
    RATELIMIT_POLICY,
};

const POLICY: &str = r#"
[[tool]]
name = "generate_report"
unit = "calls"
rate = { limit = 600, per = "1m" }
tier = "internal"
max_concurrency = 3
[tool.default_tenant]
ceiling = 3
burst = 3
max_concurrency = 2

[[tool]]
name = "llm"
unit = "tokens"
rate = { limit = 1000, per = "1m" }
burst = 1000
[tool.default_tenant]
ceiling = 1000
burst = 1000

[[tool]]
name = "shadowed"
unit = "calls"
rate = { limit = 60, per = "1m" }
enforce = false
[tool.default_tenant]
ceiling = 1
burst = 1
"#;

fn limiter() -> (Limiter<MemoryStore, ManualClock>, ManualClock) {
    let clock = ManualClock::new(EPOCH);
    (
        Limiter::with_store(
            Policy::from_toml_str(POLICY).unwrap(),
            MemoryStore::new(),
            clock.clone(),
        ),
        clock,
    )
}

#[allow(clippy::type_complexity)]
fn counting() -> (
    Arc<AtomicUsize>,
    impl Service<
            Request<Full<Bytes>>,
            Response = Response<Full<Bytes>>,
            Error = Infallible,
            Future: Send,
        > + Clone,
) {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let svc = service_fn(move |req: Request<Full<Bytes>>| {
        let c = c.clone();
        async move {
            c.fetch_add(1, Ordering::SeqCst);
            let mut res = Response::new(Full::new(Bytes::from_static(b"{\"ok\":true}")));
            if let Some(actual) = req.headers().get("x-actual-cost") {
                let v: f64 = actual.to_str().unwrap().parse().unwrap();
                res.extensions_mut().insert(Cost(v));
            }
            Ok::<_, Infallible>(res)
        }
    });
    (calls, svc)
}

fn request(path: &str, caller: Option<Caller>) -> Request<Full<Bytes>> {
    let mut req = Request::get(path).body(Full::new(Bytes::new())).unwrap();
    if let Some(c) = caller {
        req.extensions_mut().insert(c);
    }
    req
}

fn internal(tenant: &str, instance: &str) -> Caller {
    Caller::new(tenant)
        .with_instance(instance)
        .with_tier("internal")
}

async fn json(
    res: Response<impl http_body::Body<Data = Bytes, Error: std::fmt::Debug>>,
) -> serde_json::Value {
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test]
async fn refusals_never_reach_the_inner_service() {
    let (limiter, _clock) = limiter();
    let (calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter).layer(inner);

    // No identity: 401, inner untouched.
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(request("/tools/generate_report", None))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    // HTTP requires a challenge on a 401.
    assert_eq!(res.headers()["www-authenticate"], "Bearer");
    assert_eq!(json(res).await["error"], "unidentified_caller");
    // Wrong tier: 403.
    let outsider = Caller::new("acme").with_instance("a").with_tier("public");
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(request("/tools/generate_report", Some(outsider)))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    // Unknown tool: 403, not retryable.
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(request("/tools/nope", Some(internal("acme", "a"))))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    let body = json(res).await;
    assert_eq!(
        (body["error"].as_str(), body["retryable"].as_bool()),
        (Some("permission_denied"), Some(false))
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    // Paths outside /tools/ pass through unmetered.
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(request("/health", None))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_made_up_tool_name_is_not_echoed_whole() {
    let (limiter, _clock) = limiter();
    let (_, inner) = counting();
    let mut svc = FairShareLayer::new(limiter).layer(inner);
    let name = "x".repeat(16 * 1024);
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(request(
            &format!("/tools/{name}"),
            Some(internal("acme", "a")),
        ))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    let body = json(res).await;
    let tool = body["tool"].as_str().unwrap();
    assert!(
        tool.len() < 200 && tool.starts_with("xxxx"),
        "{} bytes",
        tool.len()
    );
    assert_eq!(body["detail"], "unknown_tool");
}

#[tokio::test]
async fn a_401_carries_the_challenge_the_app_sets() {
    let (limiter, _clock) = limiter();
    let (_calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter)
        .challenge(http::HeaderValue::from_static(
            "ApiKey header=\"x-api-key\"",
        ))
        .layer(inner);
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(request("/tools/generate_report", None))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        res.headers()["www-authenticate"],
        "ApiKey header=\"x-api-key\""
    );
}

/// The app shapes its own refusals (like tower_governor's `error_handler`); the inner
/// service is still never called for them.
#[tokio::test]
async fn refusals_can_be_shaped_by_the_app() {
    let (limiter, _clock) = limiter();
    let (calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter)
        .refusal_response(|r, _grpc| {
            let mut res = Response::new(Bytes::from(format!("slow down: {}", r.reason.as_str())));
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            res.headers_mut().insert("x-shaped", "yes".parse().unwrap());
            res
        })
        .layer(inner);
    let mut shaped = None;
    for _ in 0..10 {
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(request(
                "/tools/generate_report",
                Some(internal("acme", "k")),
            ))
            .await
            .unwrap();
        if res.status() != StatusCode::OK {
            shaped = Some(res);
            break;
        }
    }
    let res = shaped.expect("the tenant's ceiling refuses within 10 calls");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["x-shaped"], "yes");
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"slow down: rate_limited");
    assert_eq!(calls.load(Ordering::SeqCst), 3, "admitted calls only");
}

/// An identity extractor can reject a request with its own response: it is sent as it is,
/// nothing is charged and the inner service is not called.
#[tokio::test]
async fn an_identity_extractor_can_reject_with_its_own_response() {
    let (limiter, _clock) = limiter();
    let (calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter)
        .identify_or_reject(|head| match head.headers.get("x-key") {
            Some(k) if k == "good" => Ok(internal("acme", "k")),
            _ => {
                let mut res = Response::new(Bytes::from_static(b"token expired"));
                *res.status_mut() = StatusCode::UNAUTHORIZED;
                res.headers_mut()
                    .insert("www-authenticate", "Token realm=\"app\"".parse().unwrap());
                Err(Box::new(res))
            }
        })
        .layer(inner);
    for _ in 0..5 {
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(request("/tools/generate_report", None))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(res.headers()["www-authenticate"], "Token realm=\"app\"");
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"token expired");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // Rejected requests charged nothing: the tenant still gets its whole ceiling (3).
    for i in 0..3 {
        let mut req = request("/tools/generate_report", None);
        req.headers_mut().insert("x-key", "good".parse().unwrap());
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "call {i}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn tenants_sharing_an_instance_id_are_independent() {
    let (limiter, _clock) = limiter();
    let (calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter).layer(inner);
    for tenant in ["acme", "globex"] {
        let before = calls.load(Ordering::SeqCst);
        for k in 1..=3 {
            let res = svc
                .ready()
                .await
                .unwrap()
                .call(request(
                    "/tools/generate_report",
                    Some(internal(tenant, "shared-agent")),
                ))
                .await
                .unwrap();
            assert_eq!(res.status(), StatusCode::OK, "{tenant} call {k}");
            drop(res); // the body holds the concurrency permit
        }
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(request(
                "/tools/generate_report",
                Some(internal(tenant, "shared-agent")),
            ))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let retry: u64 = res.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(retry >= 1);
        let policy = res.headers()[RATELIMIT_POLICY].to_str().unwrap().to_owned();
        assert!(policy.starts_with("\"tenant\";q=3;w=60"), "{policy}");
        assert!(res.headers()[RATELIMIT]
            .to_str()
            .unwrap()
            .contains(";r=0;t="));
        let body = json(res).await;
        for field in [
            "error",
            "tool",
            "tenant",
            "instance",
            "scope",
            "window",
            "limit",
            "used",
            "reset_at",
            "retry_after_ms",
            "retryable",
        ] {
            assert!(body.get(field).is_some(), "missing {field} in {body}");
        }
        assert_eq!(body["error"], "rate_limited");
        assert_eq!(body["tenant"], tenant);
        assert_eq!(body["instance"], "shared-agent");
        assert_eq!(body["scope"], "tenant");
        assert_eq!(body["retryable"], true);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            before + 3,
            "the 4th call never reached the tool"
        );
    }
}

type Chunk = Result<http_body::Frame<Bytes>, Infallible>;

/// The permits (tool, tenant) of `caller`'s calls of `generate_report` in flight now.
async fn in_flight(limiter: &Limiter<MemoryStore, ManualClock>, caller: &Caller) -> (f64, f64) {
    let keys = limiter.call_keys(caller, "generate_report").unwrap();
    let s = limiter.store().inspect(&keys).await.unwrap();
    (
        s[0].as_ref().map_or(0.0, |s| s.in_flight),
        s[1].as_ref().map_or(0.0, |s| s.in_flight),
    )
}

/// A streaming response holds its permits until its stream ends.
#[tokio::test]
async fn a_streaming_body_holds_its_permits_until_the_stream_ends() {
    let (limiter, _clock) = limiter();
    let caller = internal("acme", "x");
    let (tx, rx) = tokio::sync::mpsc::channel::<Chunk>(4);
    let rx = Arc::new(tokio::sync::Mutex::new(Some(rx)));
    let inner = service_fn(move |_req: Request<Full<Bytes>>| {
        let rx = rx.clone();
        async move {
            let rx = rx.lock().await.take().expect("one streaming call");
            Ok::<_, Infallible>(Response::new(ChannelBody(rx)))
        }
    });
    let mut svc = FairShareLayer::new(limiter.clone()).layer(inner);
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(request("/tools/generate_report", Some(caller.clone())))
        .await
        .unwrap();
    assert_eq!(
        in_flight(&limiter, &caller).await,
        (1.0, 1.0),
        "the streaming response holds its permits"
    );
    tx.send(Ok(http_body::Frame::data(Bytes::from_static(b"part"))))
        .await
        .unwrap();
    drop(tx);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"part");
    assert_eq!(
        in_flight(&limiter, &caller).await,
        (0.0, 0.0),
        "released when the stream ended"
    );
}

/// A response future dropped mid-flight, or an inner service's error, gives the permits back.
#[tokio::test]
async fn permits_come_back_when_the_call_is_dropped_or_fails() {
    let (limiter, _clock) = limiter();
    let caller = internal("acme", "x");
    let pending = service_fn(|_req: Request<Full<Bytes>>| async {
        std::future::pending::<Result<Response<Full<Bytes>>, Infallible>>().await
    });
    let mut svc = FairShareLayer::new(limiter.clone()).layer(pending);
    let fut = svc
        .ready()
        .await
        .unwrap()
        .call(request("/tools/generate_report", Some(caller.clone())));
    let mut fut = Box::pin(fut);
    assert!(futures_poll_once(fut.as_mut()).is_pending());
    assert_eq!(in_flight(&limiter, &caller).await, (1.0, 1.0));
    drop(fut);
    assert_eq!(
        in_flight(&limiter, &caller).await,
        (0.0, 0.0),
        "released when the response future was dropped"
    );

    let failing = service_fn(|_req: Request<Full<Bytes>>| async {
        Err::<Response<Full<Bytes>>, &str>("boom")
    });
    let mut svc = FairShareLayer::new(limiter.clone()).layer(failing);
    let err = svc
        .ready()
        .await
        .unwrap()
        .call(request("/tools/generate_report", Some(caller.clone())))
        .await
        .unwrap_err();
    assert_eq!(err, "boom");
    assert_eq!(
        in_flight(&limiter, &caller).await,
        (0.0, 0.0),
        "released when the inner service failed"
    );
}

/// The tenant's cap (2 in flight) holds while two responses are held, and their bodies
/// dropped unread give the permits back.
#[tokio::test]
async fn permits_are_held_by_unread_bodies_and_come_back_when_dropped() {
    let (limiter, _clock) = limiter();
    let (_calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter.clone()).layer(inner);
    let beta = internal("beta", "x");
    let mut responses = Vec::new();
    for _ in 0..3 {
        let req = request("/tools/generate_report", Some(beta.clone()));
        responses.push(svc.ready().await.unwrap().call(req).await.unwrap());
    }
    let c = responses.pop().unwrap();
    assert_eq!(c.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(json(c).await["error"], "concurrency_exceeded");
    assert_eq!(in_flight(&limiter, &beta).await.1, 2.0);
    drop(responses);
    assert_eq!(in_flight(&limiter, &beta).await.1, 0.0);
}

/// A body fed by a channel: a streaming response that ends when the sender is dropped.
struct ChannelBody(tokio::sync::mpsc::Receiver<Chunk>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Chunk>> {
        self.0.poll_recv(cx)
    }
}

fn futures_poll_once<F: std::future::Future>(
    f: std::pin::Pin<&mut F>,
) -> std::task::Poll<F::Output> {
    f.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
}

#[tokio::test]
async fn actual_cost_on_the_response_corrects_the_charge() {
    let (limiter, _clock) = limiter();
    let (_calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter).tool("llm").layer(inner);
    let caller = Caller::new("acme");
    let call = |estimate: f64, actual: Option<f64>| {
        let mut req = request("/anything", Some(caller.clone()));
        req.extensions_mut().insert(Cost(estimate));
        if let Some(a) = actual {
            req.headers_mut()
                .insert("x-actual-cost", a.to_string().parse().unwrap());
        }
        req
    };
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(call(900.0, Some(100.0)))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // 800 came back: another 850-token call fits.
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(call(850.0, None))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(call(100.0, None))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn ratelimit_headers_on_admitted_responses_when_asked() {
    let (limiter, _clock) = limiter();
    let (_calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter).headers(true).layer(inner);
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(request(
            "/tools/generate_report",
            Some(internal("acme", "a")),
        ))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()[RATELIMIT_POLICY], "\"tenant\";q=3;w=60");
    assert_eq!(res.headers()[RATELIMIT], "\"tenant\";r=2;t=60");
}

/// `r` is what is left of `q` in the window, counting down call by call to the window's end
/// `t` — not a token-bucket level a client cannot relate to `q` (it used to say `r=121` after
/// each of these five calls: the floor bucket, 100, and what the burst of 22 had left).
#[tokio::test]
async fn ratelimit_r_is_what_is_left_of_q_in_the_window() {
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "search"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.tenants.acme]
        floor = 100
        ceiling = 400
        burst = 22
        "#,
    )
    .unwrap();
    let clock = ManualClock::new(EPOCH);
    let limiter = Limiter::with_store(policy, MemoryStore::new(), clock.clone());
    let (_calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter).headers(true).layer(inner);
    let mut seen = Vec::new();
    for k in 0..5u64 {
        // 10 s apart: the window (a minute from EPOCH) is the same for all five calls.
        clock.set(EPOCH.saturating_add(std::time::Duration::from_secs(10 * k)));
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(request("/tools/search", Some(Caller::new("acme"))))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()[RATELIMIT_POLICY], "\"tenant\";q=400;w=60");
        seen.push(res.headers()[RATELIMIT].to_str().unwrap().to_owned());
    }
    assert_eq!(
        seen,
        [
            "\"tenant\";r=399;t=60",
            "\"tenant\";r=398;t=50",
            "\"tenant\";r=397;t=40",
            "\"tenant\";r=396;t=30",
            "\"tenant\";r=395;t=20",
        ]
    );
}

/// With instances limited separately, `r` is never more than what is left of the tenant's
/// ceiling: siblings draw on it too.
#[tokio::test]
async fn ratelimit_r_counts_what_siblings_used_of_the_tenant() {
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "search"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.tenants.acme]
        ceiling = 10
        burst = 10
        [tool.tenants.acme.default_instance]
        max_instances = 10
        "#,
    )
    .unwrap();
    let limiter = Limiter::with_store(policy, MemoryStore::new(), ManualClock::new(EPOCH));
    let mut left_of_tenant = 10.0;
    let mut checked = 0;
    for k in 0..12 {
        let who = Caller::new("acme").with_instance(if k < 6 { "a" } else { "b" });
        let Ok(ticket) = limiter.admit(&who, "search", Cost(1.0)).await else {
            continue;
        };
        left_of_tenant -= 1.0;
        let a = ticket.admission().expect("metered");
        assert!(
            a.remaining <= left_of_tenant,
            "call {k}: r = {} but the tenant has {left_of_tenant} left",
            a.remaining
        );
        checked += 1;
    }
    assert!(checked >= 8, "{checked}");
}

#[tokio::test]
async fn shadow_mode_decides_but_never_refuses() {
    let (limiter, _clock) = limiter();
    let (calls, inner) = counting();
    // Per tool (`enforce = false` in the policy) ...
    let mut svc = FairShareLayer::new(limiter.clone()).layer(inner.clone());
    for _ in 0..5 {
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(request("/tools/shadowed", Some(Caller::new("a"))))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    // ... and per layer.
    let mut svc = FairShareLayer::new(limiter).enforce(false).layer(inner);
    for _ in 0..5 {
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(request("/tools/generate_report", Some(internal("b", "x"))))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 10);
}

#[tokio::test]
async fn grpc_requests_get_trailers_only_refusals() {
    let (limiter, _clock) = limiter();
    let (_calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter)
        .tool("generate_report")
        .layer(inner);
    let mut req = request("/pkg.Svc/Method", None);
    req.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["grpc-status"], "16");
    let msg = res.headers()["grpc-message"].to_str().unwrap();
    assert!(msg.contains("unidentified_caller"), "{msg}");
    assert!(res
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .is_empty());
}

/// A protobuf message's fields: (field number, varint value or bytes).
fn fields(mut b: &[u8]) -> Vec<(u64, Result<u64, Vec<u8>>)> {
    fn varint(b: &mut &[u8]) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let x = b[0];
            *b = &b[1..];
            v |= u64::from(x & 0x7f) << shift;
            if x < 0x80 {
                return v;
            }
            shift += 7;
        }
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b);
        match key & 7 {
            0 => out.push((key >> 3, Ok(varint(&mut b)))),
            2 => {
                let n = varint(&mut b) as usize;
                out.push((key >> 3, Err(b[..n].to_vec())));
                b = &b[n..];
            }
            w => panic!("wire type {w}"),
        }
    }
    out
}

/// A rate-limited gRPC call carries the retry hints gRPC clients read: the retry policy's
/// `grpc-retry-pushback-ms` and a `google.rpc.RetryInfo` in `grpc-status-details-bin`, both
/// saying what `Retry-After` says.
#[tokio::test]
async fn grpc_refusals_carry_the_standard_retry_hints() {
    let (limiter, _clock) = limiter();
    let (_calls, inner) = counting();
    let mut svc = FairShareLayer::new(limiter)
        .tool("generate_report")
        .layer(inner);
    let mut refused = None;
    for _ in 0..10 {
        let mut req = request("/pkg.Svc/Method", Some(internal("acme", "k")));
        req.headers_mut()
            .insert("content-type", "application/grpc".parse().unwrap());
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        if res.headers().get("grpc-status").is_some_and(|s| s == "8") {
            refused = Some(res);
            break;
        }
    }
    let res = refused.expect("the tenant's ceiling refuses within 10 calls");
    let h = res.headers();
    let retry_after: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    let pushback: u64 = h["grpc-retry-pushback-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        pushback > 0 && pushback <= retry_after * 1000,
        "{pushback} ms, {retry_after} s"
    );
    let status = tonic::Status::from_header_map(h).expect("a gRPC status in the headers");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    // google.rpc.Status { code = 8, message = the JSON, details = [Any(RetryInfo)] }.
    let top = fields(status.details());
    assert_eq!(top[0], (1, Ok(8)));
    assert_eq!(top[1], (2, Err(status.message().as_bytes().to_vec())));
    let (3, Err(any)) = &top[2] else {
        panic!("no details: {top:?}")
    };
    let any = fields(any);
    assert_eq!(
        any[0],
        (1, Err(b"type.googleapis.com/google.rpc.RetryInfo".to_vec()))
    );
    let (2, Err(info)) = &any[1] else {
        panic!("no RetryInfo value")
    };
    let (1, Err(delay)) = &fields(info)[0] else {
        panic!("no retry_delay")
    };
    let delay = fields(delay);
    let secs = delay
        .iter()
        .find(|f| f.0 == 1)
        .map_or(0, |f| *f.1.as_ref().unwrap());
    let nanos = delay
        .iter()
        .find(|f| f.0 == 2)
        .map_or(0, |f| *f.1.as_ref().unwrap());
    assert_eq!(secs * 1000 + nanos / 1_000_000, pushback);
}

#[tokio::test]
async fn clones_share_one_budget_and_infallible_stays_infallible() {
    let (limiter, _clock) = limiter();
    let (_calls, inner) = counting();
    let svc = FairShareLayer::new(limiter).layer(inner);
    // The service's error type is the inner one: Infallible.
    fn assert_infallible<S: Service<Request<Full<Bytes>>, Error = Infallible>>(_: &S) {}
    assert_infallible(&svc);
    let mut a = svc.clone();
    let mut b = svc;
    let c = internal("acme", "k");
    for _ in 0..2 {
        assert_eq!(
            a.ready()
                .await
                .unwrap()
                .call(request("/tools/generate_report", Some(c.clone())))
                .await
                .unwrap()
                .status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        b.ready()
            .await
            .unwrap()
            .call(request("/tools/generate_report", Some(c.clone())))
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        b.ready()
            .await
            .unwrap()
            .call(request("/tools/generate_report", Some(c)))
            .await
            .unwrap()
            .status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}
