//! The axum app `scripts/bench-app` loads with wrk: what a user's service feels of the layer.
//!
//! `app --store bare|nothing|memory|redis [--redis URL] [--hammer] [--lease-off] [--listen ADDR]`
//! serves, on a current-thread runtime (one core), `POST /tools/{name}` (a tool: the layer
//! decides it) and `GET /health` (no tool: the layer passes it unmetered), behind an auth layer
//! that makes the caller from the `x-api-key` header. `bare` is the same app without the
//! fair-share layer; `nothing` has, in its place, a layer that does nothing but what every layer
//! does in axum (wrap each route, be cloned for each request, with an `Arc` of its settings).
//! The policy is generous (nothing is refused) and sets nothing about leases. With
//! `--hammer`, a task on the same runtime calls `Limiter::admit` in a tight loop for a caller
//! of its own, as a runaway agent in the same process would; with `--lease-off` the policy
//! says `lease = "off"` (every call decided at the store), for comparison. Prints `listening on ADDR`, then
//! serves until it is killed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use tower_fairshare::store::RedisStore;
use tower_fairshare::{Caller, Cost, FairShareLayer, Limiter, Policy, Store, SystemClock};

/// Generous: room for everything wrk offers, and nothing said about leases.
const POLICY: &str = r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 1000000000, per = "1s" }
[tool.default_tenant]
weight = 1
"#;

/// The app's own auth layer: the caller is the tenant named by `x-api-key`.
async fn auth(mut req: Request, next: Next) -> Response {
    if let Some(key) = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()) {
        let caller = Caller::new(key.to_owned()).with_instance("agent");
        req.extensions_mut().insert(caller);
    }
    next.run(req).await
}

fn routes() -> Router {
    Router::new()
        .route("/tools/{name}", post(|| async { "ok" }))
        .route("/health", get(|| async { "ok" }))
}

/// A layer that does nothing: what any layer costs an axum app, for comparison.
#[derive(Clone)]
struct Nothing<S = ()> {
    inner: S,
    settings: Arc<()>,
}

impl<S> tower::Layer<S> for Nothing {
    type Service = Nothing<S>;

    fn layer(&self, inner: S) -> Nothing<S> {
        let settings = self.settings.clone();
        Nothing { inner, settings }
    }
}

impl<S: tower::Service<Request>> tower::Service<Request> for Nothing<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> S::Future {
        self.inner.call(req)
    }
}

fn with_layer<S: Store, C: tower_fairshare::Clock>(limiter: Limiter<S, C>, hammer: bool) -> Router {
    if hammer {
        let l = limiter.clone();
        tokio::spawn(async move {
            let runaway = Caller::new("runaway").with_instance("loop");
            loop {
                let _ = l.admit(&runaway, "search", Cost(1.0)).await;
            }
        });
    }
    routes()
        .layer(FairShareLayer::new(limiter).tool_from_path("/tools/"))
        .layer(middleware::from_fn(auth))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let store = arg("--store").unwrap_or_else(|| "memory".into());
    let listen: SocketAddr = arg("--listen")
        .unwrap_or_else(|| "127.0.0.1:0".into())
        .parse()
        .expect("--listen ADDR");
    let hammer = args.iter().any(|a| a == "--hammer");
    // For comparison: every call decided at the store.
    let unleased = args.iter().any(|a| a == "--lease-off");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async move {
        let text = match unleased {
            true => POLICY.replace("[[tool]]\n", "[[tool]]\nlease = \"off\"\n"),
            false => POLICY.to_owned(),
        };
        let policy = Policy::from_toml_str(&text).expect("the bench policy");
        let app = match store.as_str() {
            "bare" => routes().layer(middleware::from_fn(auth)),
            "nothing" => {
                let nothing = Nothing {
                    inner: (),
                    settings: Arc::new(()),
                };
                routes().layer(nothing).layer(middleware::from_fn(auth))
            }
            "memory" => with_layer(Limiter::new(policy), hammer),
            "redis" => {
                let url = arg("--redis").expect("--redis URL");
                let store = RedisStore::builder(url).connect().await.expect("Redis");
                with_layer(Limiter::with_store(policy, store, SystemClock), hammer)
            }
            other => panic!("--store bare|nothing|memory|redis, not {other}"),
        };
        let listener = tokio::net::TcpListener::bind(listen).await.expect("bind");
        println!("listening on {}", listener.local_addr().unwrap());
        axum::serve(listener, app).await.expect("serve");
    });
}
