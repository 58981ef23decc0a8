//! `fairshare serve`: a reference axum gateway. The demo auth layer looks the `x-api-key`
//! header up in the keys file and puts the [`Caller`] in the request extensions; the
//! [`FairShareLayer`] behind it admits or refuses every `/tools/{name}` call as tool `name`.

use std::future::Future;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::any;
use axum::{Json, Router};
use tokio::net::TcpListener;
use tower_fairshare::{Caller, Clock, FairShareLayer, Limiter, Policy, Store};

use super::keys::Keys;

/// The header the demo auth layer reads.
pub(crate) const API_KEY: &str = "x-api-key";

/// The gateway with an in-process store and the system clock.
pub(crate) fn router(policy: Policy, keys: Keys) -> Router {
    router_with(Limiter::new(policy), keys)
}

/// The gateway deciding with `limiter`.
pub(crate) fn router_with<S: Store, C: Clock>(limiter: Limiter<S, C>, keys: Keys) -> Router {
    Router::new()
        .route("/tools/{name}", any(tool))
        .layer(
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
