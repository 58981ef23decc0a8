//! `fairshare serve`: a reference axum gateway. The demo auth layer looks the `x-api-key`
//! header up in the keys file and puts the [`Caller`] in the request extensions; the
//! [`FairShareLayer`] behind it admits or refuses every `/tools/{name}` call as tool `name`.
//!
//! It is meant to be exposable: every connection must send its request head within a time
//! limit (a client trickling bytes, or an idle keep-alive connection, is closed), the number
//! of open connections is capped (past it, a new connection closes the oldest one that has
//! not sent a whole request head; when every one has, new ones wait in the listen queue), each
//! request has a time limit, and the metrics — which name tenants — are served only behind a key or
//! on a listener of their own.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;
use tokio::net::TcpListener;
use tower_fairshare::{Caller, Clock, FairShareLayer, Limiter, Policy, Store};

use super::keys::Keys;
use connections::{Connections, Heard};

mod connections;

/// The header the demo auth layer reads.
pub(crate) const API_KEY: &str = "x-api-key";

/// The path prefix of tools: `/tools/{name}`.
const TOOLS: &str = "/tools/";

/// What a connection and a request may take.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Limits {
    /// The most a client may take to send a request head (and the longest an idle keep-alive
    /// connection stays open).
    pub(crate) header_timeout: Duration,
    /// The most connections open at once. Past it, a new connection closes the oldest one
    /// that has not sent a whole request head; when every one has, new ones wait in the listen
    /// queue.
    pub(crate) max_connections: usize,
    /// The most a request may take, head to response.
    pub(crate) request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            max_connections: 1024,
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// How `/metrics` is reached on the gateway's own listener.
#[derive(Clone)]
pub(crate) enum Metrics {
    /// Not there (off, or on a listener of its own: see [`metrics_router`]).
    Off,
    /// There, for requests that carry `Authorization: Bearer <key>`.
    WithKey(PrometheusHandle, Arc<str>),
}

/// Who may open the operator's console (`/fairshare/`: the live page, `state`, `explain`,
/// `refusals`).
#[derive(Clone)]
pub(crate) enum ConsoleAccess {
    /// Not served.
    Off,
    /// Anyone who reaches the listener (the demo, on loopback).
    Open,
    /// Requests with `Authorization: Bearer <key>` or `?key=<key>` (the page passes its own
    /// query string on to what it fetches, so a browser opens `/fairshare/?key=...`).
    WithKey(Arc<str>),
}

/// The gateway with an in-process store and the system clock.
pub(crate) fn router(
    policy: Policy,
    keys: Keys,
    metrics: Metrics,
    console: ConsoleAccess,
    limits: Limits,
) -> Router {
    router_with(Limiter::new(policy), keys, metrics, console, limits)
}

/// The gateway deciding with `limiter`.
pub(crate) fn router_with<S: Store, C: Clock>(
    limiter: Limiter<S, C>,
    keys: Keys,
    metrics: Metrics,
    console: ConsoleAccess,
    limits: Limits,
) -> Router {
    let keys = Arc::new(keys);
    // Only `/tools/{name}` itself is a tool, and only it passes the fair-share layer: the
    // console, `/metrics` and a path the router does not serve (404) are never charged, nor
    // warned about as requests that name no tool.
    let mut app = Router::new().route("/tools/{name}", any(tool)).route_layer(
        FairShareLayer::new(limiter.clone())
            .tool_with(|head| {
                let name = head.uri.path().strip_prefix(TOOLS)?;
                (!name.is_empty() && !name.contains('/')).then(|| Arc::from(name))
            })
            .headers(true),
    );
    // `explain` can be asked by a gateway API key (`api_key=`): the caller it authenticates.
    let explained = keys.clone();
    let console_of = move |limiter: &Limiter<S, C>| {
        let keys = explained.clone();
        limiter
            .console()
            .resolve_keys(move |key| keys.caller(key).cloned())
    };
    match console {
        ConsoleAccess::Off => {}
        ConsoleAccess::Open => app = app.nest_service("/fairshare", console_of(&limiter)),
        ConsoleAccess::WithKey(key) => {
            // `route_layer`: the key guards the console's own paths only, so a path the
            // gateway does not serve stays 404 (and does not tell that a console is there).
            let guarded = Router::new()
                .nest_service("/fairshare", console_of(&limiter))
                .route_layer(middleware::from_fn_with_state(key, console_key));
            app = app.merge(guarded);
        }
    }
    if let Metrics::WithKey(handle, key) = metrics {
        app = app.route(
            "/metrics",
            get(move |req: Request| metrics_with_key(handle.clone(), key.clone(), req)),
        );
    }
    app
        // Outermost: the caller is known before the fair-share layer looks for it.
        .layer(middleware::from_fn_with_state(keys, authenticate))
        .layer(middleware::from_fn_with_state(
            limits.request_timeout,
            time_limit,
        ))
}

/// Lets a request of the console through with the metrics key, sent in its query (`key=`)
/// or as a bearer token; 401 without.
async fn console_key(State(key): State<Arc<str>>, req: Request, next: Next) -> Response {
    let by_query = req.uri().query().is_some_and(|q| {
        q.split('&')
            .filter_map(|kv| kv.strip_prefix("key="))
            .any(|v| percent_decoded(v).is_some_and(|v| same(&v, &key)))
    });
    if by_query || bearer(&req).is_some_and(|k| same(k, &key)) {
        next.run(req).await
    } else {
        (
            StatusCode::UNAUTHORIZED,
            [(WWW_AUTHENTICATE, "Bearer realm=\"fairshare console\"")],
            "send the metrics key as `Authorization: Bearer <key>` or `?key=<key>`\n",
        )
            .into_response()
    }
}

/// The metrics, to a request that sends the metrics key as a bearer token; 401 without.
async fn metrics_with_key(handle: PrometheusHandle, key: Arc<str>, req: Request) -> Response {
    if bearer(&req).is_some_and(|k| same(k, &key)) {
        render(&handle)
    } else {
        (
            StatusCode::UNAUTHORIZED,
            [(WWW_AUTHENTICATE, "Bearer realm=\"fairshare metrics\"")],
            "send the metrics key as `Authorization: Bearer <key>`\n",
        )
            .into_response()
    }
}

/// `a == b`, in a time that does not depend on where they first differ (a key check).
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// A query value with `%XX` and `+` decoded; `None` if it does not decode to UTF-8.
fn percent_decoded(v: &str) -> Option<String> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                if !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
                    return None;
                }
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// `/metrics` alone, for a listener of its own (e.g. one only the scraper can reach).
pub(crate) fn metrics_router(handle: PrometheusHandle, limits: Limits) -> Router {
    Router::new()
        .route("/metrics", get(move || std::future::ready(render(&handle))))
        .layer(middleware::from_fn_with_state(
            limits.request_timeout,
            time_limit,
        ))
}

fn render(handle: &PrometheusHandle) -> Response {
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        handle.render(),
    )
        .into_response()
}

fn bearer(req: &Request) -> Option<&str> {
    req.headers()
        .get(AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// A request that takes longer than its limit is answered 503, and its work dropped.
async fn time_limit(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(response) => response,
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({
                "error": "request_timeout",
                "detail": format!("the request took longer than {} ms", limit.as_millis()),
            })),
        )
            .into_response(),
    }
}

/// The tool itself: every admitted call succeeds.
async fn tool() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "ok": true }))
}

/// The demo auth layer: a known `x-api-key` becomes the request's [`Caller`]. No key, or an
/// unknown one, leaves the request without a caller, and the fair-share layer answers 401.
async fn authenticate(State(keys): State<Arc<Keys>>, mut req: Request, next: Next) -> Response {
    // Only this layer decides who is calling: drop anything an inner-most layer could have
    // put there before (nothing a client sends can become an extension, but be explicit).
    req.extensions_mut().remove::<Caller>();
    let caller = req
        .headers()
        .get(API_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|key| keys.caller(key))
        .cloned();
    if let Some(caller) = caller {
        req.extensions_mut().insert(caller);
    }
    next.run(req).await
}

/// Installs a Prometheus recorder as this process's `metrics` recorder, describes the
/// limiter's metrics and keeps the recorder's histograms drained. `None` (with the reason on
/// stderr) when another recorder is installed already.
pub(crate) fn install_prometheus() -> Option<PrometheusHandle> {
    match prometheus_builder().install_recorder() {
        Ok(handle) => {
            tower_fairshare::telemetry::describe_metrics();
            let upkeep = handle.clone();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(Duration::from_secs(5));
                loop {
                    every.tick().await;
                    upkeep.run_upkeep();
                }
            });
            Some(handle)
        }
        Err(e) => {
            eprintln!("warning: /metrics is off: cannot install the Prometheus recorder: {e}");
            None
        }
    }
}

/// How long a series may go without an update before `/metrics` drops it.
const METRICS_IDLE: Duration = Duration::from_secs(600);

/// The exporter `fairshare serve` installs. The decision latency is a Prometheus histogram
/// (the exporter's default is a summary, which cannot be aggregated over replicas): 1 µs to
/// 1 s. Counters and gauges not updated for [`METRICS_IDLE`] are dropped: a caller named
/// among a tool's busiest for a while, then quiet, leaves `/metrics` instead of staying in it
/// for the life of the process (busy callers that come and go would grow it without bound).
fn prometheus_builder() -> PrometheusBuilder {
    const BUCKETS: [f64; 13] = [
        1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0,
    ];
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(tower_fairshare::telemetry::DECISION_SECONDS.to_owned()),
            &BUCKETS,
        )
        .expect("the buckets are not empty")
        .idle_timeout(
            MetricKindMask::COUNTER | MetricKindMask::GAUGE,
            Some(METRICS_IDLE),
        )
}

/// Serves `app` on `listener` until `shutdown` completes, then lets calls in flight finish
/// (for up to 10 s) and ends the connections still open, so that what they hold (concurrency
/// permits) is given back before this returns. HTTP/1.1, with `limits` on every connection.
pub(crate) async fn run(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Connections::new(limits.max_connections);
    let graceful = GracefulShutdown::new();
    let mut connections = tokio::task::JoinSet::new();
    let mut shutdown = pin!(shutdown);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors, or a connection reset before it was accepted: go on.
                Err(e) => {
                    eprintln!("warning: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Past the cap, the oldest connection that sent no request head makes room; when
        // every one has, this one waits (and the next ones in the listen queue).
        let slot = tokio::select! {
            slot = slots.slot() => slot,
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let id = slots.open();
        let service = TowerToHyperService::new(Heard {
            inner: app.clone(),
            id,
            connections: slots.clone(),
        });
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        let ended = slots.clone();
        let task = connections.spawn(async move {
            // A closed or timed-out connection is the client's business, not the server's.
            let _ = conn.await;
            ended.ended(id);
            drop(slot);
        });
        slots.spawned(id, task);
        // Connections that ended are let go of as the server runs.
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(Duration::from_secs(10)) => {
            eprintln!("warning: connections still open 10 s after shutdown began; closing them");
        }
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The gateway's guards against slow, idle and too many clients, in this process over real
    //! loopback sockets, under tokio's paused clock: the timeouts pass in virtual time.

    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    const POLICY: &str = r#"
        [[tool]]
        name = "t"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.default_tenant]
    "#;

    #[test]
    fn metrics_idle_for_ten_minutes_leave_the_exporter() {
        let shown = format!("{:?}", prometheus_builder());
        assert!(shown.contains("idle_timeout: Some(600s)"), "{shown}");
        let mask = format!("{:?}", MetricKindMask::COUNTER | MetricKindMask::GAUGE);
        assert!(shown.contains(&format!("recency_mask: {mask}")), "{shown}");
    }

    async fn start(limits: Limits, app: Option<Router>) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = app.unwrap_or_else(|| {
            router(
                Policy::from_toml_str(POLICY).unwrap(),
                Keys::from_toml_str("[keys.\"sk-a\"]\ntenant = \"a\"\n").unwrap(),
                Metrics::Off,
                ConsoleAccess::Off,
                limits,
            )
        });
        tokio::spawn(run(listener, app, limits, std::future::pending()));
        addr
    }

    /// Reads until the server closes the connection; what it sent.
    async fn until_closed(stream: &mut TcpStream) -> String {
        let mut out = Vec::new();
        stream.read_to_end(&mut out).await.unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    const REQUEST: &[u8] =
        b"POST /tools/t HTTP/1.1\r\nhost: x\r\nx-api-key: sk-a\r\ncontent-length: 0\r\n\r\n";

    #[tokio::test(start_paused = true)]
    async fn a_client_that_trickles_its_head_is_closed_at_the_header_timeout() {
        let limits = Limits {
            header_timeout: Duration::from_secs(5),
            ..Limits::default()
        };
        let addr = start(limits, None).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        let started = tokio::time::Instant::now();
        // One byte a second: never a whole head.
        let closed = tokio::time::timeout(Duration::from_secs(3600), async {
            for b in REQUEST.iter().take(20) {
                if slow.write_all(&[*b]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            until_closed(&mut slow).await
        })
        .await
        .expect("the server never closed a client that trickles its head");
        assert!(!closed.contains("200 OK"), "{closed}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(5) && took <= Duration::from_secs(6),
            "closed after {took:?}"
        );
    }

    /// One call on a connection of its own: how long the answer took (the limiter's clock is
    /// not the paused one, so a fast run of calls may be answered 429).
    async fn one_call(addr: std::net::SocketAddr) -> Duration {
        let started = tokio::time::Instant::now();
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"POST /tools/t HTTP/1.1\r\nhost: x\r\nx-api-key: sk-a\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        let answer = until_closed(&mut c).await;
        assert!(
            answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.1 429"),
            "{answer}"
        );
        started.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_cap_a_new_connection_closes_the_oldest_that_sent_no_head() {
        let limits = Limits {
            header_timeout: Duration::from_secs(5),
            max_connections: 2,
            ..Limits::default()
        };
        let addr = start(limits, None).await;
        // Two idle connections take both slots.
        let mut oldest = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let mut newer = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let took = one_call(addr).await;
        assert!(took < Duration::from_millis(100), "served after {took:?}");
        // The oldest idle one made room; the newer one is still open until its header timeout.
        let closed = tokio::time::Instant::now();
        assert_eq!(until_closed(&mut oldest).await, "");
        assert!(closed.elapsed() < Duration::from_millis(100));
        assert_eq!(until_closed(&mut newer).await, "");
        assert!(
            closed.elapsed() >= Duration::from_secs(4),
            "{:?}",
            closed.elapsed()
        );
    }

    /// A client that opens a connection, sends a request line and one more header line every
    /// 5 s, and opens another once the server closes it.
    #[tokio::test(start_paused = true)]
    async fn a_request_past_its_time_limit_is_503() {
        let limits = Limits {
            request_timeout: Duration::from_secs(2),
            ..Limits::default()
        };
        let slow = Router::new()
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    "late"
                }),
            )
            .layer(middleware::from_fn_with_state(
                limits.request_timeout,
                time_limit,
            ));
        let addr = start(limits, Some(slow)).await;
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let answer = until_closed(&mut c).await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("request_timeout"), "{answer}");
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}
