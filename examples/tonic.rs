//! A tonic gRPC server with fair-share admission, and a client that runs into it.
//!
//! The server hosts tonic-health's `grpc.health.v1.Health` service behind a tower stack:
//! tower-http's gRPC trace layer, a timeout, a demo auth layer that turns the `x-api-key`
//! header into a [`Caller`], and [`FairShareLayer`]. Each tenant may call `Health/Check`
//! twice a minute; a refusal is a trailers-only gRPC response (RESOURCE_EXHAUSTED,
//! UNAUTHENTICATED, ...) with the JSON refusal as its message and `retry-after` metadata.
//!
//! ```text
//! cargo run --example tonic --features tonic
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tower::ServiceBuilder;
use tower_fairshare::{Caller, FairShareLayer, Limiter, Policy};
use tower_http::trace::{DefaultMakeSpan, DefaultOnFailure, DefaultOnResponse, TraceLayer};
use tracing::Level;

const POLICY: &str = r#"
[[tool]]
name = "health"
unit = "calls"
rate = { limit = 600, per = "1m" }

# Any tenant: 2 calls a minute, both at once if it likes.
[tool.default_tenant]
ceiling = 2
burst = 2
"#;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_max_level(Level::INFO)
        .with_target(false)
        .init();

    let limiter = Limiter::new(Policy::from_toml_str(POLICY)?);

    // The app's own authentication: API key → caller. The fair-share layer reads the `Caller`
    // extension this puts on the request; nothing the client sends chooses who is charged
    // except through this table.
    let keys: HashMap<&'static str, Caller> = HashMap::from([
        ("sk-acme", Caller::new("acme").with_instance("report-agent")),
        ("sk-globex", Caller::new("globex")),
    ]);
    let authenticate = move |mut req: http::Request<tonic::body::Body>| {
        let caller = req
            .headers()
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .and_then(|key| keys.get(key))
            .cloned();
        if let Some(caller) = caller {
            req.extensions_mut().insert(caller);
        }
        req
    };

    let stack = ServiceBuilder::new()
        .layer(
            TraceLayer::new_for_grpc()
                .make_span_with(DefaultMakeSpan::new().level(Level::INFO))
                .on_response(DefaultOnResponse::new().level(Level::INFO))
                // A refusal is a non-OK gRPC status, so the trace layer classifies it as a
                // failure; it is the limiter doing its job, not an error.
                .on_failure(DefaultOnFailure::new().level(Level::WARN)),
        )
        .timeout(Duration::from_secs(10))
        .map_request(authenticate)
        .layer(FairShareLayer::new(limiter).tool("health"))
        .into_inner();

    let (_reporter, health) = tonic_health::server::health_reporter();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .layer(stack)
            .add_service(health)
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                let _ = stopped.await;
            }),
    );
    println!("serving grpc.health.v1.Health on {addr}");

    client(addr).await?;

    let _ = stop.send(());
    server.await??;
    Ok(())
}

async fn client(addr: SocketAddr) -> Result<(), BoxError> {
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut health = HealthClient::new(channel);
    let calls = [
        ("sk-acme", "acme, call 1"),
        ("sk-acme", "acme, call 2"),
        ("sk-acme", "acme, call 3: over its allowance"),
        ("", "no API key"),
        ("sk-globex", "globex: its own allowance"),
    ];
    for (key, what) in calls {
        let mut req = tonic::Request::new(HealthCheckRequest {
            service: String::new(),
        });
        if !key.is_empty() {
            req.metadata_mut().insert("x-api-key", key.parse()?);
        }
        match health.check(req).await {
            Ok(res) => println!("{what:<36} → OK {:?}", res.into_inner().status()),
            Err(status) => {
                let retry_after = status
                    .metadata()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .map_or_else(|| "-".to_owned(), |s| format!("{s}s"));
                println!(
                    "{what:<36} → {:?}, retry-after {retry_after}\n{:<38} {}",
                    status.code(),
                    "",
                    status.message()
                );
            }
        }
    }
    Ok(())
}
