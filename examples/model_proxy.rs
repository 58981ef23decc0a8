//! A model proxy: an axum server in front of a model API, with requests and tokens per
//! minute per team and per agent instance and a monthly token budget per team
//! (`examples/model_proxy/policy.toml`). The model here is a stand-in that streams
//! OpenAI-style server-sent events with its usage last; nothing goes to the network.
//!
//! ```text
//! cargo run --example model_proxy
//! ```
//!
//! It serves `POST /v1/chat/completions` on 127.0.0.1:8091 (callers: `x-team`, `x-agent`
//! headers) and drives it for ten seconds with two teams: `research`, whose two agents send
//! no `max_tokens` and get long answers (the proxy reserves 256 tokens and each call uses
//! about 800), and `support`, whose agent bounds its answers and calls once a second. Each
//! call reserves its estimate and is settled to the usage in the stream's last event, so
//! `research` is held to its tokens per minute however wrong its estimates are, and
//! `support` is never refused. Pass `--serve` to keep serving afterwards (try it with
//! `curl -N`).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::routing::post;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tower_fairshare::{Caller, FairShareLayer, Limiter, Policy, RequestHead};

/// The policy beside this example.
pub const POLICY: &str = include_str!("model_proxy/policy.toml");
const ADDR: &str = "127.0.0.1:8091";

/// A response body the stand-in model writes as it goes.
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

/// The stand-in model: an answer of `max_tokens` tokens (800 when the request does not bound
/// it), streamed in four events 20 ms apart, then the usage and `[DONE]`.
async fn model(body: Bytes) -> axum::response::Response {
    let ask: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let prompt = (body.len() / 4) as u64;
    let answer = ask["max_tokens"].as_u64().unwrap_or(800);
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        for i in 0..4 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let event =
                format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"part {i} \"}}}}]}}\n\n");
            if tx.send(Bytes::from(event)).await.is_err() {
                return;
            }
        }
        let usage = format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{answer},\"total_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
            prompt + answer
        );
        let _ = tx.send(Bytes::from(usage)).await;
    });
    axum::response::Response::builder()
        .header("content-type", "text/event-stream")
        .body(axum::body::Body::new(Streamed(rx)))
        .expect("a response")
}

/// The caller: the team and the agent instance, from the headers an API gateway set.
fn caller(head: &RequestHead<'_>) -> Option<Caller> {
    let h = |k| head.headers.get(k)?.to_str().ok();
    let team = Caller::new(h("x-team")?);
    Some(match h("x-agent") {
        Some(agent) => team.with_instance(agent),
        None => team,
    })
}

/// What one team's calls came to.
#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    refused: AtomicU64,
    tokens: AtomicU64,
}

/// One call: its status, its `Retry-After` and the tokens its stream's last usage reports.
async fn call(team: &str, agent: &str, ask: &serde_json::Value) -> (u16, u64, u64) {
    let stream = tokio::net::TcpStream::connect(ADDR)
        .await
        .expect("the proxy listens");
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("HTTP/1.1");
    tokio::spawn(conn);
    let req = http::Request::post("/v1/chat/completions")
        .header("host", ADDR)
        .header("content-type", "application/json")
        .header("x-team", team)
        .header("x-agent", agent)
        .body(http_body_util::Full::new(Bytes::from(ask.to_string())))
        .expect("a request");
    let res = send.send_request(req).await.expect("an answer");
    let status = res.status().as_u16();
    let retry = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(1);
    let body = res
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let used = String::from_utf8_lossy(&body)
        .lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find_map(|v| v["usage"]["total_tokens"].as_u64())
        .unwrap_or(0);
    (status, retry, used)
}

/// One agent: calls (`pause` between calls) until `until`, waiting as long as a refusal
/// says.
async fn agent(
    team: &'static str,
    name: &'static str,
    max_tokens: Option<u64>,
    pause: Duration,
    until: Instant,
    tally: Arc<Tally>,
) {
    let mut ask = serde_json::json!({"model": "stand-in", "stream": true,
        "messages": [{"role": "user", "content": "Summarise the quarter's incidents."}]});
    if let Some(m) = max_tokens {
        ask["max_tokens"] = m.into();
    }
    while Instant::now() < until {
        let (status, retry, used) = call(team, name, &ask).await;
        let wait = if status == 200 {
            tally.admitted.fetch_add(1, Relaxed);
            tally.tokens.fetch_add(used, Relaxed);
            pause
        } else {
            tally.refused.fetch_add(1, Relaxed);
            Duration::from_secs(retry)
        };
        tokio::time::sleep(wait.min(until.saturating_duration_since(Instant::now()))).await;
    }
}

#[tokio::main]
async fn main() {
    let policy = Policy::from_toml_str(POLICY).expect("the example's policy is valid");
    let limits = FairShareLayer::new(Limiter::new(policy))
        .headers(true)
        .identify_with(caller)
        .model_calls()
        .requests("chat.requests")
        .tokens("chat.tokens")
        // The proxy's guess: the prompt, and 256 tokens of answer unless the request says.
        .estimate_tokens(|_head, body| {
            let prompt = body.map_or(0, |b| b["messages"].to_string().len() / 4) as f64;
            prompt + body.and_then(|b| b["max_tokens"].as_f64()).unwrap_or(256.0)
        });
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(model))
        .layer(limits);
    let listener = tokio::net::TcpListener::bind(ADDR)
        .await
        .expect("127.0.0.1:8091 is free");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    println!("model proxy on http://{ADDR}/v1/chat/completions (headers x-team, x-agent)");

    let seconds = 10;
    let until = Instant::now() + Duration::from_secs(seconds);
    let (research, support) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let agents = [
        tokio::spawn(agent(
            "research",
            "r1",
            None,
            Duration::ZERO,
            until,
            research.clone(),
        )),
        tokio::spawn(agent(
            "research",
            "r2",
            None,
            Duration::ZERO,
            until,
            research.clone(),
        )),
        tokio::spawn(agent(
            "support",
            "s1",
            Some(100),
            Duration::from_secs(1),
            until,
            support.clone(),
        )),
    ];
    for a in agents {
        a.await.expect("an agent");
    }
    println!("\nin {seconds} s (each team: 6,000 tokens a minute, a burst of 3,000):");
    println!(
        "{:<10} {:>9} {:>8} {:>8}",
        "team", "admitted", "refused", "tokens"
    );
    for (team, t) in [("research", &research), ("support", &support)] {
        println!(
            "{team:<10} {:>9} {:>8} {:>8}",
            t.admitted.load(Relaxed),
            t.refused.load(Relaxed),
            t.tokens.load(Relaxed)
        );
    }
    println!("research is held to its 3,000 + 6,000 × {seconds}/60 = 4,000 tokens (and one call's overshoot), support is never refused");
    if std::env::args().any(|a| a == "--serve") {
        println!("serving until interrupted");
        let _ = server.await;
    }
}
