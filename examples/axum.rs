//! An axum app with fair-share rate limiting, composed with other tower middleware.
//!
//! ```text
//! cargo run --example axum --features axum,redis
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example axum --features axum,redis   # state in Redis
//! curl -i -H 'authorization: Bearer research-token' http://127.0.0.1:3000/tools/web_search
//! curl -i http://127.0.0.1:3000/tools/web_search          # no identity: 401
//! curl -i http://127.0.0.1:3000/healthz                   # not a tool: not metered
//! ```
//!
//! The stack, outermost first:
//!
//! 1. tower-http's `TraceLayer`: a span and a log line per request, refusals included;
//! 2. `HandleErrorLayer` + tower's `TimeoutLayer`: a call that takes too long becomes a 504.
//!    The fair-share layer sits inside the timeout, so a timed-out call's response future is
//!    dropped and its concurrency permits come back at once;
//! 3. the app's auth layer: the bearer token becomes a [`Caller`] in the request extensions.
//!    The caller comes from the app's own authentication, never from the request body. It
//!    must run before the fair-share layer (here: listed before it in the `ServiceBuilder`,
//!    which runs its layers top to bottom), or every call is a 401;
//! 4. [`FairShareLayer`]: admits or refuses each `/tools/{name}` call before the handler runs.
//!    Refusals are responses (429 / 403 / 401 / 503 with a JSON body and `Retry-After`), so
//!    the stack stays infallible.

// Needs the `axum` and `redis` features (Cargo.toml says so: `cargo run --example axum
// --features axum,redis`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    app::main()
}

mod app {
    use std::time::Duration;

    use axum::error_handling::HandleErrorLayer;
    use axum::extract::{Path, Request};
    use axum::http::StatusCode;
    use axum::middleware::{self, Next};
    use axum::response::{IntoResponse, Response};
    use axum::routing::{any, get};
    use axum::{BoxError, Json, Router};
    use tower::ServiceBuilder;
    use tower_fairshare::store::RedisStore;
    use tower_fairshare::{Caller, FairShareLayer, Limiter, Policy, SystemClock};
    use tower_http::trace::TraceLayer;

    const POLICY: &str = r#"
    [[tool]]
    name = "web_search"
    unit = "calls"
    rate = { limit = 600, per = "1m" }
    max_concurrency = 64
    # If the store cannot answer (Redis down): let searches through unmetered.
    on_store_error = "allow"

    [tool.tenants.team-research]
    weight = 6
    floor = 100

    [tool.tenants.team-support]
    weight = 2
    floor = 60
    max_concurrency = 4

    [[tool]]
    name = "generate_report"
    unit = "calls"
    rate = { limit = 60, per = "1m" }
    tier = "internal"
    # Reports are expensive: refuse them (503) while the store cannot answer.
    on_store_error = "deny"

    [tool.default_tenant]
    ceiling = 3
    burst = 3
    "#;

    /// The app's own authentication. A real app would verify a signed token or look up a session;
    /// here a fixed table stands in for it.
    async fn authenticate(mut req: Request, next: Next) -> Response {
        let token = req
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let caller = match token {
            Some("research-token") => Some(
                Caller::new("team-research")
                    .with_instance("report-agent")
                    .with_tier("internal"),
            ),
            Some("support-token") => Some(Caller::new("team-support").with_instance("triage-bot")),
            _ => None,
        };
        if let Some(caller) = caller {
            req.extensions_mut().insert(caller);
        }
        next.run(req).await
    }

    async fn tool(Path(name): Path<String>) -> Json<serde_json::Value> {
        // The upstream the limit protects would be called here.
        Json(serde_json::json!({ "ok": true, "tool": name }))
    }

    async fn timed_out(error: BoxError) -> impl IntoResponse {
        if error.is::<tower::timeout::error::Elapsed>() {
            (StatusCode::GATEWAY_TIMEOUT, "the tool took too long")
        } else {
            (StatusCode::INTERNAL_SERVER_ERROR, "unexpected error")
        }
    }

    #[tokio::main]
    pub(crate) async fn main() -> Result<(), Box<dyn std::error::Error>> {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .init();

        let policy = Policy::from_toml_str(POLICY)?;
        for warning in policy.warnings() {
            tracing::warn!("{warning}");
        }
        let limiter = match std::env::var("REDIS_URL") {
            // Every replica shares one exact budget. A replica started while Redis is down
            // connects when it is back; meanwhile each tool's `on_store_error` applies.
            Ok(url) => {
                let store = RedisStore::builder(url).connect_lazy()?;
                FairShareLayer::new(Limiter::with_store(policy, store, SystemClock))
            }
            Err(_) => FairShareLayer::new(Limiter::new(policy)),
        };
        let fair_share = limiter.tool_from_path("/tools/").headers(true);

        let app = Router::new()
            .route("/tools/{name}", any(tool))
            .route("/healthz", get(|| async { "ok" }))
            .layer(
                ServiceBuilder::new()
                    .layer(TraceLayer::new_for_http())
                    .layer(HandleErrorLayer::new(timed_out))
                    .timeout(Duration::from_secs(10))
                    .layer(middleware::from_fn(authenticate))
                    .layer(fair_share),
            );

        let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
        println!("listening on http://{}", listener.local_addr()?);
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
        Ok(())
    }
}
