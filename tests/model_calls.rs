//! Model calls through real HTTP: an axum server with the model-call layer in front of a
//! stand-in model that streams server-sent events with its usage last (as an
//! OpenAI-compatible API does), read by a streaming HTTP client. Time is the limiter's
//! virtual clock; the HTTP is real.

#[path = "support/logs.rs"]
mod logs;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::Extension;
use axum::routing::post;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tower_fairshare::{
    Caller, FairShareLayer, Limiter, ManualClock, MemoryStore, Policy, Store, Timestamp, Usage,
};

const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

/// Requests and tokens per minute per team, each agent instance at most half its team's
/// tokens.
const POLICY: &str = r#"
[[tool]]
name = "chat.requests"
group = "chat"
unit = "calls"
rate = { limit = 6000, per = "1m" }
lease = "off"
[tool.tenants.team-a]
ceiling = 600
[tool.tenants.team-b]
ceiling = 600

[[tool]]
name = "chat.tokens"
group = "chat"
unit = "tokens"
rate = { limit = 100000, per = "1m" }
lease = "off"
[tool.tenants.team-a]
ceiling = 6000
burst = 2000
[tool.tenants.team-a.default_instance]
ceiling = 3000
burst = 2000
[tool.tenants.team-b]
ceiling = 6000
burst = 2000
"#;

/// A response body fed from a channel: a stream the model writes as it goes.
struct Streamed(mpsc::Receiver<Bytes>);

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|d| d.map(|d| Ok(Frame::data(d))))
    }
}

/// The stand-in model: answers `{"use": N, "chunks": K, "hang": bool}` with K content events
/// and a last event with the usage (which the layer reads) and `[DONE]`; or, told to hang,
/// one event, reported to the usage handle (N / K tokens), and nothing more.
async fn model(Extension(usage): Extension<Usage>, body: Bytes) -> axum::response::Response {
    let ask: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let total = ask["use"].as_f64().unwrap();
    let chunks = ask["chunks"].as_u64().unwrap_or(3);
    let hang = ask["hang"].as_bool().unwrap_or(false);
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        for i in 0..chunks {
            if hang {
                usage.add(total / chunks as f64);
            }
            let event = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"part {i}\"}}}}],\"usage\":null}}\n\n");
            if tx.send(Bytes::from(event)).await.is_err() {
                return;
            }
            if hang {
                // Never finishes: the client goes away.
                std::future::pending::<()>().await;
            }
        }
        let last = format!("data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":20,\"completion_tokens\":{},\"total_tokens\":{total}}}}}\n\ndata: [DONE]\n\n", total - 20.0);
        let _ = tx.send(Bytes::from(last)).await;
    });
    axum::response::Response::builder()
        .header("content-type", "text/event-stream")
        .body(axum::body::Body::new(Streamed(rx)))
        .unwrap()
}

/// The proxy: its callers are teams (`x-team`) and agent instances (`x-agent`).
async fn serve(limiter: Limiter<MemoryStore, ManualClock>) -> SocketAddr {
    let layer = FairShareLayer::new(limiter)
        .headers(true)
        .identify_with(|head: &tower_fairshare::RequestHead<'_>| {
            let h = |k| head.headers.get(k)?.to_str().ok();
            let caller = Caller::new(h("x-team")?);
            Some(match h("x-agent") {
                Some(a) => caller.with_instance(a),
                None => caller,
            })
        })
        .model_calls()
        .requests("chat.requests")
        .tokens("chat.tokens");
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(model))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// What a call came to, as the client saw it.
struct Answer {
    status: u16,
    headers: http::HeaderMap,
    /// The events read (all of them, unless the client stopped after `stop_after`).
    text: String,
}

/// POSTs a chat request and reads its answer as a stream, frame by frame; stops (dropping the
/// connection) after `stop_after` frames if given.
async fn call(
    addr: SocketAddr,
    team: &str,
    agent: &str,
    body: serde_json::Value,
    stop_after: Option<usize>,
) -> Answer {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let req = http::Request::post("/v1/chat/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .header("x-team", team)
        .header("x-agent", agent)
        .body(http_body_util::Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    let (parts, mut body) = res.into_parts();
    let mut text = String::new();
    let mut frames = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            text.push_str(std::str::from_utf8(&data).unwrap());
            frames += 1;
        }
        if stop_after == Some(frames) {
            conn.abort();
            break;
        }
    }
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        text,
    }
}

fn limiter() -> (Limiter<MemoryStore, ManualClock>, ManualClock) {
    let clock = ManualClock::new(EPOCH);
    let limiter = Limiter::with_store(
        Policy::from_toml_str(POLICY).unwrap(),
        MemoryStore::new(),
        clock.clone(),
    );
    (limiter, clock)
}

/// Team A's agents ask for 100 tokens and use 400 (the estimate is a quarter of the truth);
/// team B's ask for 300 and use 150. Over five minutes team A gets what its 6,000 tokens a
/// minute allow — its burst and one call's overshoot at most beyond — because every call is
/// settled to what it used when its stream ends; team B, under its limit, is never refused.
#[tokio::test]
async fn a_team_that_under_estimates_is_held_to_its_tokens_per_minute() {
    let (limiter, clock) = limiter();
    let addr = serve(limiter.clone()).await;
    let under = serde_json::json!({"model": "m", "max_tokens": 100, "use": 400, "messages": [{"role": "user", "content": "hi"}]});
    let fair = serde_json::json!({"model": "m", "max_tokens": 300, "use": 150, "messages": [{"role": "user", "content": "hi"}]});
    let (mut a_tokens, mut a_refused, mut b_admitted, mut b_refused) = (0.0, 0, 0, 0);
    let seconds = 300;
    for s in 0..seconds {
        clock.set(EPOCH.saturating_add(Duration::from_secs(s)));
        for agent in ["a1", "a2"] {
            let r = call(addr, "team-a", agent, under.clone(), None).await;
            match r.status {
                200 => {
                    assert!(r.text.contains("[DONE]"), "a whole stream: {}", r.text);
                    a_tokens += 400.0;
                }
                429 => {
                    a_refused += 1;
                    let v: serde_json::Value = serde_json::from_str(&r.text).unwrap();
                    assert_eq!(v["tool"], "chat.tokens", "{v}");
                    assert_eq!(v["unit"], "tokens", "{v}");
                    let policy = r.headers["ratelimit-policy"].to_str().unwrap();
                    assert!(policy.contains("qu=\"tokens\""), "{policy}");
                }
                other => panic!("status {other}: {}", r.text),
            }
        }
        if s % 2 == 0 {
            let r = call(addr, "team-b", "b1", fair.clone(), None).await;
            match r.status {
                200 => b_admitted += 1,
                _ => b_refused += 1,
            }
        }
    }
    let minutes = seconds as f64 / 60.0;
    let bound = 6000.0 * minutes + 2000.0 + (400.0 - 100.0);
    println!(
        "team A: {a_tokens} tokens in {minutes} minutes ({} a minute; bound {bound}), {a_refused} refused; team B: {b_admitted} admitted, {b_refused} refused",
        a_tokens / minutes
    );
    assert!(
        a_tokens <= bound,
        "team A used {a_tokens} tokens, more than {bound}"
    );
    assert!(
        a_tokens >= 6000.0 * minutes * 0.9,
        "team A gets its share: {a_tokens}"
    );
    assert!(a_refused > 0);
    assert_eq!(b_refused, 0, "team B, under its limit, is never refused");
    assert_eq!(b_admitted, seconds / 2);
}

/// A stream cut off by its client is settled to the usage reported before (the model's
/// handle counted the one event it sent): the rest of the estimate comes back.
#[tokio::test]
async fn a_stream_cut_off_settles_what_was_reported() {
    let (limiter, _clock) = limiter();
    let addr = serve(limiter.clone()).await;
    let ask = serde_json::json!({"max_tokens": 1000, "use": 300, "chunks": 3, "hang": true});
    let keys = limiter
        .call_keys(&Caller::new("team-a").with_instance("a1"), "chat.tokens")
        .unwrap();
    let r = call(addr, "team-a", "a1", ask, Some(1)).await;
    assert_eq!(r.status, 200);
    assert!(r.text.contains("part 0"));
    // The server sees the client gone and drops the body: settled to 100 (a third of 300).
    let mut total = f64::NAN;
    for _ in 0..500 {
        let [_, tenant, _] = limiter.store().inspect(&keys).await.unwrap().levels;
        total = tenant.unwrap().total;
        if (total - 100.0).abs() < 1e-9 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(total, 100.0, "the estimate settled to what was reported");
}

/// An admitted call's RateLimit headers speak of the limit closest to binding, in its unit:
/// tokens here (one call's estimate is a larger part of the tokens limit than one request
/// of the requests limit).
#[tokio::test]
async fn admitted_headers_name_the_binding_limit_in_its_unit() {
    let (limiter, _clock) = limiter();
    let addr = serve(limiter).await;
    let ask = serde_json::json!({"max_tokens": 1500, "use": 10});
    let r = call(addr, "team-b", "b1", ask, None).await;
    assert_eq!(r.status, 200);
    let policy = r.headers["ratelimit-policy"].to_str().unwrap();
    assert_eq!(policy, "\"tenant\";q=6000;w=60;qu=\"tokens\"");
}

/// The decision event of a stream cut off says so, with what was reported before the cut; a
/// stream read to its end settles to its usage and says that.
#[test]
fn a_cut_off_stream_says_so_in_its_decision_event() {
    use tower::{Layer, ServiceExt};
    let (limiter, _clock) = limiter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let layer = FairShareLayer::new(limiter)
        .model_calls()
        .tokens("chat.tokens");
    // The model reports 120 tokens, sends one event, then (told to hang) never ends.
    let model = |req: http::Request<tower_fairshare::BufferedBody>| async move {
        let usage = req.extensions().get::<Usage>().unwrap().clone();
        let hang = req.headers().contains_key("x-hang");
        let (tx, rx) = mpsc::channel(4);
        usage.add(120.0);
        tx.send(Bytes::from_static(b"data: {\"choices\":[]}\n\n"))
            .await
            .unwrap();
        if hang {
            tokio::spawn(async move { tx.closed().await });
        }
        Ok::<_, Infallible>(http::Response::new(Streamed(rx)))
    };
    let ask = |hang: bool| {
        let mut req = http::Request::post("/v1/chat/completions");
        if hang {
            req = req.header("x-hang", "1");
        }
        let mut req = req
            .body(http_body_util::Full::new(Bytes::from_static(
                b"{\"max_tokens\":900}",
            )))
            .unwrap();
        req.extensions_mut()
            .insert(Caller::new("team-a").with_instance("a1"));
        req
    };
    let log = logs::logged(|| {
        rt.block_on(async {
            let svc = layer.layer(tower::service_fn(model));
            // Cut off: one frame read, then the client goes away.
            let res = svc.clone().oneshot(ask(true)).await.unwrap();
            let mut body = res.into_body();
            body.frame().await.unwrap().unwrap();
            drop(body);
            // Whole: read to its end.
            let res = svc.oneshot(ask(false)).await.unwrap();
            res.into_body().collect().await.unwrap();
        })
    });
    let cut: Vec<&str> = log.lines().filter(|l| l.contains("cut_off=true")).collect();
    assert_eq!(cut.len(), 1, "{log}");
    assert!(
        cut[0].contains("model call cut off: settled to the usage reported before"),
        "{log}"
    );
    assert!(
        cut[0].contains("reported=120.0") && cut[0].contains("estimate="),
        "{log}"
    );
    let whole: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cut_off=false"))
        .collect();
    assert_eq!(whole.len(), 1, "{log}");
    assert!(
        whole[0].contains("model call settled to its usage"),
        "{log}"
    );
}
