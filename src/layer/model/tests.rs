//! The model-call layer's options, one request at a time through the layer (no network): where
//! the estimate comes from, where the usage comes from, and a body past the limit.

use std::convert::Infallible;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceExt};

use super::{BufferedBody, ModelCallLayer};
use crate::{Caller, FairShareLayer, Limiter, ManualClock, MemoryStore, Policy, Store, Timestamp};

const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

const POLICY: &str = r#"
    [[tool]]
    name = "chat.tokens"
    unit = "tokens"
    rate = { limit = 100000, per = "1m" }
    lease = "off"
    [tool.default_tenant]
    ceiling = 10000
    burst = 10000
"#;

type Model = Limiter<MemoryStore, ManualClock>;

fn limiter() -> Model {
    let policy = Policy::from_toml_str(POLICY).unwrap();
    Limiter::with_store(policy, MemoryStore::new(), ManualClock::new(EPOCH))
}

fn layer(limiter: &Model) -> ModelCallLayer {
    FairShareLayer::new(limiter.clone())
        .model_calls()
        .tokens("chat.tokens")
}

fn ask(body: &str) -> Request<Full<Bytes>> {
    let mut req = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    req.extensions_mut().insert(Caller::new("acme"));
    req
}

/// A JSON answer that reports `tokens` as an OpenAI-compatible API does.
fn json_usage(tokens: u32) -> Response<Full<Bytes>> {
    let body = format!(r#"{{"choices":[],"usage":{{"total_tokens":{tokens}}}}}"#);
    Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// A body of the given frames, data and trailers.
struct Frames(std::collections::VecDeque<Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        std::task::Poll::Ready(self.0.pop_front().map(Ok))
    }
}

/// The tokens the caller's tenant has been charged, once the call's settlement landed.
async fn charged(limiter: &Model) -> f64 {
    let keys = limiter
        .call_keys(&Caller::new("acme"), "chat.tokens")
        .unwrap();
    let [_, tenant, _] = limiter.store().inspect(&keys).await.unwrap().levels;
    tenant.map_or(0.0, |s| s.total)
}

/// Sends `req` through `layer` over `model`, reads the answer to its end; its status.
async fn through<F, Fut, B>(layer: ModelCallLayer, model: F, req: Request<Full<Bytes>>) -> u16
where
    F: FnMut(Request<BufferedBody>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::fmt::Debug,
{
    let res = layer.layer(service_fn(model)).oneshot(req).await.unwrap();
    let status = res.status().as_u16();
    res.into_body().collect().await.unwrap();
    status
}

#[tokio::test]
async fn the_openai_usage_of_a_json_answer_settles_the_call() {
    let limiter = limiter();
    let model = |_req| async { Ok::<_, Infallible>(json_usage(50)) };
    let status = through(layer(&limiter), model, ask(r#"{"max_tokens":300}"#)).await;
    assert_eq!(status, 200);
    assert_eq!(charged(&limiter).await, 50.0);
}

#[tokio::test]
async fn without_openai_usage_the_estimate_stands() {
    let limiter = limiter();
    let body = r#"{"max_tokens":300}"#;
    let model = |_req| async { Ok::<_, Infallible>(json_usage(50)) };
    let layer = layer(&limiter).openai_usage(false);
    assert_eq!(through(layer, model, ask(body)).await, 200);
    // The default estimate: a quarter of the body's bytes and the request's max_tokens.
    let estimate = (body.len() as f64 / 4.0).ceil() + 300.0;
    assert_eq!(charged(&limiter).await, estimate);
}

#[tokio::test]
async fn a_request_without_a_bound_is_estimated_at_1024_output_tokens() {
    let limiter = limiter();
    let body = r#"{"messages":[]}"#;
    let model = |_req| async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) };
    assert_eq!(through(layer(&limiter), model, ask(body)).await, 200);
    let estimate = (body.len() as f64 / 4.0).ceil() + 1024.0;
    assert_eq!(charged(&limiter).await, estimate);
}

#[tokio::test]
async fn the_estimator_sets_the_reservation_and_a_refusal_names_tokens() {
    let limiter = limiter();
    let model = |_req| async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) };
    let layer = layer(&limiter)
        .estimate_tokens(|_head, body| body.and_then(|b| b["ask"].as_f64()).unwrap_or(0.0));
    assert_eq!(
        through(layer.clone(), model, ask(r#"{"ask":6000}"#)).await,
        200
    );
    assert_eq!(charged(&limiter).await, 6000.0);
    // 4,000 tokens left of the tenant's ceiling: 5,000 more is refused, nothing charged.
    let res = layer
        .layer(service_fn(model))
        .oneshot(ask(r#"{"ask":5000}"#))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (v["tool"].as_str(), v["unit"].as_str()),
        (Some("chat.tokens"), Some("tokens"))
    );
    assert_eq!(charged(&limiter).await, 6000.0);
}

#[tokio::test]
async fn a_handler_reports_through_the_usage_handle() {
    let limiter = limiter();
    let model = |req: Request<BufferedBody>| async move {
        let usage = req.extensions().get::<super::Usage>().unwrap().clone();
        usage.report(77.0);
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
    };
    assert_eq!(
        through(layer(&limiter), model, ask(r#"{"max_tokens":900}"#)).await,
        200
    );
    assert_eq!(charged(&limiter).await, 77.0);
}

#[tokio::test]
async fn a_usage_trailer_settles_the_call() {
    let limiter = limiter();
    let model = |_req| async {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-usage", " 42 ".parse().unwrap());
        let frames = [
            Frame::data(Bytes::from_static(b"tokens...")),
            Frame::trailers(trailers),
        ];
        Ok::<_, Infallible>(Response::new(Frames(frames.into())))
    };
    let layer = layer(&limiter).usage_trailer(HeaderName::from_static("x-usage"));
    assert_eq!(
        through(layer, model, ask(r#"{"max_tokens":900}"#)).await,
        200
    );
    assert_eq!(charged(&limiter).await, 42.0);
}

#[tokio::test]
async fn a_body_past_max_body_is_refused_unread_and_charges_nothing() {
    let limiter = limiter();
    let called = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = called.clone();
    let model = move |_req| {
        seen.store(true, std::sync::atomic::Ordering::SeqCst);
        async { Ok::<_, Infallible>(json_usage(1)) }
    };
    let layer = layer(&limiter).max_body(16);
    let res = layer
        .layer(service_fn(model))
        .oneshot(ask(r#"{"max_tokens":100,"messages":[]}"#))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("16"),
        "names the limit"
    );
    assert!(!called.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(charged(&limiter).await, 0.0);
}
