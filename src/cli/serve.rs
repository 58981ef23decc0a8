//! `fairshare serve`: a reference axum gateway. The demo auth layer looks the `x-api-key`
//! header up in the keys file and puts the [`Caller`] in the request extensions; the
//! [`FairShareLayer`] behind it admits or refuses every `/tools/{name}` call as tool `name`.
//! `/metrics` serves the limiter's metrics as Prometheus text.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::{Json, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tower_fairshare::{Caller, Clock, FairShareLayer, Limiter, Policy, Store};

use super::keys::Keys;

/// The header the demo auth layer reads.
pub(crate) const API_KEY: &str = "x-api-key";

/// The gateway with an in-process store and the system clock; `/metrics` renders `metrics`
/// (404 without it).
pub(crate) fn router(policy: Policy, keys: Keys, metrics: Option<PrometheusHandle>) -> Router {
    router_with(Limiter::new(policy), keys, metrics)
}

/// The gateway deciding with `limiter`.
pub(crate) fn router_with<S: Store, C: Clock>(
    limiter: Limiter<S, C>,
    keys: Keys,
    metrics: Option<PrometheusHandle>,
) -> Router {
    let mut app = Router::new().route("/tools/{name}", any(tool));
    if let Some(handle) = metrics {
        app = app.route(
            "/metrics",
            get(move || {
                let text = handle.render();
                async move {
                    (
                        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
                        text,
                    )
                        .into_response()
                }
            }),
        );
    }
    // `/metrics` is not under `/tools/`: the fair-share layer lets it through unmetered.
    app.layer(
        FairShareLayer::new(limiter)
            .tool_from_path("/tools/")
            .headers(true),
    )
    // Outermost: the caller is known before the fair-share layer looks for it.
    .layer(middleware::from_fn_with_state(Arc::new(keys), authenticate))
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
    match PrometheusBuilder::new().install_recorder() {
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

/// Serves `app` on `listener` until `shutdown` completes, then lets calls in flight finish.
pub(crate) async fn run(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
