//! Calls that end early, through real HTTP, on a Redis store (a server and a local 3-master
//! Cluster the test starts): thousands of connection resets while the decision is on its
//! way, while the inner service runs and while the body streams, calls cut off by a timeout,
//! across several tenants, and a replica that shuts down with calls in flight. Once they are
//! over, no permit is left in Redis but those of calls still running, and every tenant's calls
//! go through: a live replica never leaves its permits to the permit TTL.

#![cfg(feature = "redis")]

mod support;

use std::convert::Infallible;
use std::future::Future;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use axum::routing::any;
use axum::Router;
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_fairshare::store::RedisStore;
use tower_fairshare::{Caller, FairShareLayer, Limiter, Policy, SystemClock};

use support::{RedisCluster, RedisServer};

/// A tool capped at 10 calls in flight, 3 for each tenant: a few leaked permits switch it off.
const POLICY: &str = r#"
[[tool]]
name = "t"
unit = "calls"
rate = { limit = 1000000, per = "1s" }
max_concurrency = 10
[tool.default_tenant]
max_concurrency = 3
max_tenants = 100
"#;

/// Where a client goes away.
#[derive(Copy, Clone, Debug)]
enum Stage {
    /// Right after sending its request (0–2 ms): while the decision is on its way.
    Deciding,
    /// While the handler runs (it takes 30 ms).
    Running,
    /// After the first chunk of a body that streams for 100 ms.
    Streaming,
    /// Never: the app's timeout (100 ms) cuts the call off while the handler runs (300 ms).
    TimedOut,
}

impl Stage {
    fn header(self) -> &'static str {
        match self {
            Stage::Deciding => "deciding",
            Stage::Running => "running",
            Stage::Streaming => "streaming",
            Stage::TimedOut => "timed-out",
        }
    }
}

async fn handler(req: Request) -> Result<Response, Infallible> {
    let stage = req.headers().get("x-stage").and_then(|v| v.to_str().ok());
    match stage {
        Some("running") => {
            tokio::time::sleep(Duration::from_millis(30)).await;
            Ok(Response::new(Body::from("ok")))
        }
        Some("streaming") => Ok(Response::new(Body::new(Chunks {
            left: 5,
            next: Box::pin(tokio::time::sleep(Duration::ZERO)),
        }))),
        Some("timed-out") => {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok(Response::new(Body::from("too late")))
        }
        Some("long") => Ok(Response::new(Body::new(Chunks {
            left: 1_000,
            next: Box::pin(tokio::time::sleep(Duration::ZERO)),
        }))),
        _ => Ok(Response::new(Body::from("ok"))),
    }
}

/// A body of `left` chunks, 20 ms apart.
struct Chunks {
    left: usize,
    next: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return std::task::Poll::Ready(None);
        }
        std::task::ready!(self.next.as_mut().poll(cx));
        self.left -= 1;
        let at = tokio::time::Instant::now() + Duration::from_millis(20);
        self.next.as_mut().reset(at);
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
            b"chunk\n",
        )))))
    }
}

/// The caller from the `x-tenant` header (the test's stand-in for an auth layer).
async fn identify(mut req: Request, next: axum::middleware::Next) -> Response {
    if let Some(t) = req.headers().get("x-tenant").and_then(|v| v.to_str().ok()) {
        let caller = Caller::new(t.to_owned()).with_instance("agent");
        req.extensions_mut().insert(caller);
    }
    next.run(req).await
}

fn app(limiter: Limiter<RedisStore>) -> Router {
    Router::new()
        .route("/tools/{name}", any(handler))
        .layer(FairShareLayer::new(limiter).tool_from_path("/tools/"))
        .layer(axum::middleware::from_fn(identify))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            http::StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(100),
        ))
}

fn limiter(store: RedisStore) -> Limiter<RedisStore> {
    Limiter::with_store(Policy::from_toml_str(POLICY).unwrap(), store, SystemClock)
}

async fn serve(store: RedisStore) -> std::net::SocketAddr {
    let app = app(limiter(store));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn request(tenant: &str, stage: Stage) -> Vec<u8> {
    format!(
        "GET /tools/t HTTP/1.1\r\nhost: x\r\nx-tenant: {tenant}\r\nx-stage: {}\r\n\r\n",
        stage.header()
    )
    .into_bytes()
}

/// One client that sends its request and resets the connection at `stage`.
async fn reset_at(addr: std::net::SocketAddr, tenant: String, stage: Stage, seed: u64) {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return;
    };
    if s.write_all(&request(&tenant, stage)).await.is_err() {
        return;
    }
    match stage {
        Stage::Deciding => {
            // Some at once, some after 1 or 2 ms.
            let ms = seed % 3;
            if ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
        }
        Stage::Running => tokio::time::sleep(Duration::from_millis(5 + seed % 10)).await,
        Stage::Streaming => {
            // Until the first bytes of the answer (a refusal ends there too).
            let mut buf = [0u8; 256];
            let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await;
        }
        Stage::TimedOut => {
            // The whole answer (408, or a refusal), then a normal close.
            let mut buf = [0u8; 1024];
            let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await;
            return;
        }
    }
    let _ = s.set_zero_linger();
    drop(s);
}

/// The status of one whole call by `tenant`.
async fn call(addr: std::net::SocketAddr, tenant: &str) -> u16 {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&request(tenant, Stage::Deciding))
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    head.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// Permits held in Redis now, over every permits zset (`…!` keys) of these connections.
fn permits_in_redis(conns: &mut [redis::Connection]) -> u64 {
    let mut held = 0;
    for conn in conns.iter_mut() {
        let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*!").query(conn).unwrap();
        for k in keys {
            let n: u64 = redis::cmd("ZCARD").arg(&k).query(conn).unwrap();
            held += n;
        }
    }
    held
}

/// A store from `store`, once it has connected.
async fn connected(store: &impl Fn() -> RedisStore) -> RedisStore {
    let store = store();
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.check_health().await.is_err() {
        assert!(Instant::now() < deadline, "the store never connected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    store
}

fn flood_then_check(store: impl Fn() -> RedisStore, conns: &mut [redis::Connection]) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let replica = &store;
    let store = rt.block_on(connected(&store));
    let addr = rt.block_on(serve(store.clone()));
    let tenants: Vec<String> = (0..4).map(|i| format!("flooder-{i}")).collect();
    for stage in [
        Stage::Deciding,
        Stage::Running,
        Stage::Streaming,
        Stage::TimedOut,
    ] {
        rt.block_on(async {
            // 4 tenants × 1,000 connections each, 50 at a time.
            let mut seed = 0u64;
            for _ in 0..(4 * 1000 / 50) {
                let mut wave = tokio::task::JoinSet::new();
                for _ in 0..50 {
                    seed += 1;
                    let tenant = tenants[(seed % 4) as usize].clone();
                    wave.spawn(reset_at(addr, tenant, stage, seed));
                }
                while wave.join_next().await.is_some() {}
            }
        });
        // Within a second of the last reset, nothing is held: no call is in flight.
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut held = permits_in_redis(conns);
        while held > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            held = permits_in_redis(conns);
        }
        assert_eq!(
            held,
            0,
            "{stage:?}: {held} permits still held in Redis 1 s after the resets (abandoned: {})",
            store.abandoned()
        );
        assert_eq!(
            store.permits_held(),
            0,
            "{stage:?}: permits renewed for no call"
        );
        rt.block_on(async {
            for t in tenants.iter().map(String::as_str).chain(["innocent"]) {
                assert_eq!(
                    call(addr, t).await,
                    200,
                    "{stage:?}: {t} refused after the resets"
                );
            }
        });
    }
    a_replica_shuts_down_with_calls_in_flight(&rt, replica, addr, conns);
}

/// A second replica takes long streaming calls that hold permits, then shuts down the way
/// `fairshare serve` does: it stops, ends the connections still open, and waits for
/// `Limiter::shutdown` before its runtime goes. Its permits are back in Redis at once: the
/// first replica admits every tenant.
fn a_replica_shuts_down_with_calls_in_flight(
    rt: &tokio::runtime::Runtime,
    store: impl Fn() -> RedisStore,
    first: std::net::SocketAddr,
    conns: &mut [redis::Connection],
) {
    // One thread: nothing runs on it but inside `block_on`, as in a process about to exit.
    let replica = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let limiter = limiter(replica.block_on(connected(&store)));
    let (mut connections, clients) = replica.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = app(limiter.clone());
        let mut connections = tokio::task::JoinSet::new();
        // Long calls by three tenants: nine permits held at the tool.
        let mut clients = Vec::new();
        for i in 0..9 {
            let mut c = TcpStream::connect(addr).await.unwrap();
            let req = format!(
                "GET /tools/t HTTP/1.1\r\nhost: x\r\nx-tenant: long-{}\r\nx-stage: long\r\n\r\n",
                i % 3
            );
            c.write_all(req.as_bytes()).await.unwrap();
            clients.push(c);
        }
        for _ in 0..9 {
            let (stream, _) = listener.accept().await.unwrap();
            let service = hyper_util::service::TowerToHyperService::new(app.clone());
            connections.spawn(async move {
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
        for c in &mut clients {
            let mut buf = [0u8; 64];
            let n = c.read(&mut buf).await.unwrap();
            assert!(
                buf[..n].starts_with(b"HTTP/1.1 200"),
                "a long call admitted"
            );
        }
        (connections, clients)
    });
    assert!(
        permits_in_redis(conns) >= 9,
        "the long calls hold their permits"
    );
    replica.block_on(async {
        connections.abort_all();
        while connections.join_next().await.is_some() {}
        limiter.shutdown().await;
    });
    drop(replica);
    assert_eq!(
        permits_in_redis(conns),
        0,
        "a replica that shut down left permits behind"
    );
    drop(clients);
    rt.block_on(async {
        for t in ["long-0", "long-1", "long-2", "innocent"] {
            assert_eq!(
                call(first, t).await,
                200,
                "{t} refused after the replica shut down"
            );
        }
    });
}

#[test]
fn resets_at_every_stage_leave_no_permit_behind() {
    let server = RedisServer::start();
    let url = server.url();
    flood_then_check(
        || RedisStore::builder(url.as_str()).connect_lazy().unwrap(),
        &mut [server.conn()],
    );
}

#[test]
fn resets_at_every_stage_leave_no_permit_behind_on_a_cluster() {
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let mut conns: Vec<redis::Connection> = cluster.nodes.iter().map(|n| n.conn()).collect();
    flood_then_check(
        || {
            RedisStore::cluster_builder(urls.clone())
                .connect_lazy()
                .unwrap()
        },
        &mut conns,
    );
}
