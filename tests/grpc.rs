//! `FairShareLayer` in front of a real tonic server, called by a real tonic client over
//! loopback HTTP/2. The service is tonic-health's `grpc.health.v1.Health` (generated code
//! shipped by the crate, so no protoc is needed); the caller is named by an `x-tenant`
//! request header, standing in for the app's auth layer.
//!
//! Refusals are trailers-only responses: HTTP 200, `content-type: application/grpc`,
//! `grpc-status`, `grpc-message` (the percent-encoded JSON refusal) and `retry-after`, which
//! tonic's client surfaces as a `Status` with that code, message and metadata.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tower_fairshare::{Caller, FairShareLayer, Limiter, Policy, RequestHead};

/// One tool, `health`; every tenant gets 2 calls at once and 2 a minute.
fn policy() -> Policy {
    Policy::from_toml_str(
        r#"
        [[tool]]
        name = "health"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.default_tenant]
        ceiling = 2
        burst = 2
        "#,
    )
    .expect("valid policy")
}

fn limiter() -> Limiter {
    Limiter::new(policy())
}

/// The demo auth layer: the tenant is the `x-tenant` header.
fn tenant_header(head: &RequestHead<'_>) -> Option<Caller> {
    let tenant = head.headers.get("x-tenant")?.to_str().ok()?;
    Some(Caller::new(tenant))
}

/// A tonic server on a free loopback port: the health service behind `layer`, with a counter
/// of the calls that reach the service.
struct TestServer {
    addr: SocketAddr,
    reached: Arc<AtomicUsize>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl TestServer {
    async fn start(layer: FairShareLayer) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let reached = Arc::new(AtomicUsize::new(0));
        let counter = reached.clone();
        let (_reporter, health) = tonic_health::server::health_reporter();
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(
            Server::builder()
                .layer(layer)
                // Inside the fair-share layer: counts only the calls it lets through.
                .layer(tower::util::MapRequestLayer::new(
                    move |req: http::Request<tonic::body::Body>| {
                        counter.fetch_add(1, Ordering::SeqCst);
                        req
                    },
                ))
                .add_service(health)
                .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                    let _ = stop.await;
                }),
        );
        TestServer {
            addr,
            reached,
            shutdown: Some(shutdown),
            task: Some(task),
        }
    }

    async fn client(&self) -> HealthClient<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .expect("connect to the test server");
        HealthClient::new(channel)
    }

    fn reached(&self) -> usize {
        self.reached.load(Ordering::SeqCst)
    }

    async fn stop(mut self) {
        let _ = self.shutdown.take().unwrap().send(());
        let task = self.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("server stops")
            .expect("server task")
            .expect("server ran without error");
    }
}

async fn check(
    client: &mut HealthClient<Channel>,
    tenant: Option<&str>,
) -> Result<ServingStatus, tonic::Status> {
    let mut req = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    if let Some(t) = tenant {
        req.metadata_mut().insert("x-tenant", t.parse().unwrap());
    }
    let res = client.check(req).await?;
    Ok(res.into_inner().status())
}

fn json(status: &tonic::Status) -> serde_json::Value {
    serde_json::from_str(status.message())
        .unwrap_or_else(|e| panic!("message is not JSON ({e}): {:?}", status.message()))
}

fn retry_after(status: &tonic::Status) -> Option<u64> {
    status
        .metadata()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().expect("whole seconds"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_its_allowance_a_tenant_gets_resource_exhausted_with_retry_after() {
    let server = TestServer::start(
        FairShareLayer::new(limiter())
            .tool("health")
            .identify_with(tenant_header),
    )
    .await;
    let mut client = server.client().await;

    for n in 1..=2 {
        let status = check(&mut client, Some("acme"))
            .await
            .unwrap_or_else(|s| panic!("call {n} of acme refused: {s:?}"));
        assert_eq!(status, ServingStatus::Serving);
    }
    assert_eq!(server.reached(), 2);

    let refused = check(&mut client, Some("acme")).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    let secs = retry_after(&refused).expect("retry-after metadata");
    assert!(secs >= 1, "retry-after {secs}");
    let v = json(&refused);
    assert_eq!(v["error"], "rate_limited");
    assert_eq!(v["tool"], "health");
    assert_eq!(v["tenant"], "acme");
    assert_eq!(v["scope"], "tenant");
    assert_eq!(v["retryable"], true);
    let ms = v["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert!(ms > 0 && ms.div_ceil(1000) == secs, "{ms} ms vs {secs} s");
    assert!(v["reset_at"].is_string(), "{v}");
    // Trailers-only: the status travelled in the response headers of a gRPC response.
    assert_eq!(
        refused.metadata().get("content-type").unwrap(),
        "application/grpc"
    );
    // The refused call never reached the service.
    assert_eq!(server.reached(), 2);

    // Another tenant's allowance is untouched, on the same connection.
    for n in 1..=2 {
        let status = check(&mut client, Some("globex"))
            .await
            .unwrap_or_else(|s| panic!("call {n} of globex refused: {s:?}"));
        assert_eq!(status, ServingStatus::Serving);
    }
    assert_eq!(server.reached(), 4);
    // And acme is still refused.
    assert_eq!(
        check(&mut client, Some("acme")).await.unwrap_err().code(),
        Code::ResourceExhausted
    );

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_identity_is_unauthenticated() {
    let server = TestServer::start(
        FairShareLayer::new(limiter())
            .tool("health")
            .identify_with(tenant_header),
    )
    .await;
    let mut client = server.client().await;

    let refused = check(&mut client, None).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    let v = json(&refused);
    assert_eq!(v["error"], "unidentified_caller");
    assert_eq!(v["tool"], "health");
    assert_eq!(v["tenant"], serde_json::Value::Null);
    assert_eq!(v["retryable"], false);
    // Retrying without an identity can never succeed.
    assert_eq!(retry_after(&refused), None);
    assert_eq!(server.reached(), 0);

    // The same client is served once it says who it is.
    assert_eq!(
        check(&mut client, Some("acme")).await.unwrap(),
        ServingStatus::Serving
    );
    assert_eq!(server.reached(), 1);

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_identity_is_the_caller_extension() {
    // Without `identify_with`, the layer reads a `Caller` extension; nothing upstream puts
    // one there, so every call is unauthenticated — a header alone never charges anyone.
    let server = TestServer::start(FairShareLayer::new(limiter()).tool("health")).await;
    let mut client = server.client().await;
    let refused = check(&mut client, Some("acme")).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert_eq!(server.reached(), 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_the_policy_does_not_know_is_permission_denied() {
    let server = TestServer::start(
        FairShareLayer::new(limiter())
            .tool("not_in_policy")
            .identify_with(tenant_header),
    )
    .await;
    let mut client = server.client().await;
    let refused = check(&mut client, Some("acme")).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let v = json(&refused);
    assert_eq!(v["error"], "permission_denied");
    assert_eq!(v["tool"], "not_in_policy");
    assert_eq!(v["tenant"], "acme");
    assert_eq!(server.reached(), 0);
    server.stop().await;
}

/// A Health service whose `check` calls the limiter itself and returns the refusal with `?`
/// (feature `tonic`: `From<Refusal> for tonic::Status`).
#[cfg(feature = "tonic")]
mod handler {
    use tonic::codegen::tokio_stream;
    use tonic_health::pb::health_server::Health;
    use tonic_health::pb::HealthCheckResponse;
    use tower_fairshare::{Caller, Cost, Limiter, ManualClock, MemoryStore};

    use super::*;

    pub(crate) struct MeteredHealth {
        pub(crate) limiter: Limiter<MemoryStore, ManualClock>,
    }

    #[tonic::async_trait]
    impl Health for MeteredHealth {
        async fn check(
            &self,
            req: tonic::Request<HealthCheckRequest>,
        ) -> Result<tonic::Response<HealthCheckResponse>, tonic::Status> {
            let caller = req
                .metadata()
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .map(Caller::new)
                .unwrap_or_default();
            let _ticket = self
                .limiter
                .admit(&caller, "health", Cost::default())
                .await?;
            Ok(tonic::Response::new(HealthCheckResponse {
                status: ServingStatus::Serving as i32,
            }))
        }

        type WatchStream = tokio_stream::Empty<Result<HealthCheckResponse, tonic::Status>>;

        async fn watch(
            &self,
            _req: tonic::Request<HealthCheckRequest>,
        ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
            Err(tonic::Status::unimplemented("watch"))
        }
    }
}

#[cfg(feature = "tonic")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_returning_the_refusal_gets_the_layers_status() {
    use tonic_health::pb::health_server::HealthServer;
    use tower_fairshare::{ManualClock, MemoryStore, Timestamp};

    // Two limiters on clocks that stand still at the same instant: the same calls earn the
    // same refusal, to the microsecond.
    let at = Timestamp(1_779_462_000_000_000);
    let stopped_limiter =
        || Limiter::with_store(policy(), MemoryStore::new(), ManualClock::new(at));

    let by_layer = TestServer::start(
        FairShareLayer::new(stopped_limiter())
            .tool("health")
            .identify_with(tenant_header),
    )
    .await;

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let service = HealthServer::new(handler::MeteredHealth {
        limiter: stopped_limiter(),
    });
    let by_handler = tokio::spawn(
        Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                let _ = stopped.await;
            }),
    );
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut handler_client = HealthClient::new(channel);
    let mut layer_client = by_layer.client().await;

    for tenant in [Some("acme"), Some("acme"), Some("acme"), None] {
        let from_layer = check(&mut layer_client, tenant).await;
        let from_handler = check(&mut handler_client, tenant).await;
        match (from_layer, from_handler) {
            (Ok(a), Ok(b)) => assert_eq!(a, b),
            (Err(a), Err(b)) => {
                assert_eq!(a.code(), b.code(), "{tenant:?}");
                assert_eq!(a.message(), b.message(), "{tenant:?}");
                assert_eq!(retry_after(&a), retry_after(&b), "{tenant:?}");
            }
            (a, b) => panic!("{tenant:?}: layer {a:?}, handler {b:?}"),
        }
    }

    by_layer.stop().await;
    let _ = stop.send(());
    by_handler.await.unwrap().unwrap();
}
