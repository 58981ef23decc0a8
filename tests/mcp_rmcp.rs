//! `examples/mcp.rs` on a loopback port, driven by rmcp's own MCP client over streamable
//! HTTP: per-tool limits, refusals as tool results, unmetered protocol messages, tenants that
//! share an agent, permits held for a whole answer.

#[path = "../examples/mcp.rs"]
#[allow(dead_code)]
mod example;

use std::net::SocketAddr;
use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult, ClientConfig};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt};
use tower_fairshare::{Caller, Limiter, MemoryStore, Policy, Store, SystemClock};

type Client = RunningService<RoleClient, ClientConfig>;

async fn start() -> (SocketAddr, Limiter<MemoryStore, SystemClock>) {
    let limiter = Limiter::new(Policy::from_toml_str(example::POLICY).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = example::app(limiter.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, limiter)
}

async fn connect(addr: SocketAddr, key: &str) -> Client {
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
            .auth_header(key),
    );
    ClientConfig::default()
        .serve(transport)
        .await
        .expect("the MCP client connects")
}

async fn call(client: &Client, tool: &str, args: serde_json::Value) -> CallToolResult {
    let args = serde_json::from_value(args).unwrap();
    client
        .call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(args))
        .await
        .unwrap_or_else(|e| panic!("{tool}: the call did not come back as a result: {e}"))
}

fn refused(r: &CallToolResult) -> Option<&serde_json::Value> {
    (r.is_error == Some(true)).then(|| r.structured_content.as_ref().expect("the refusal"))
}

fn text(r: &CallToolResult) -> String {
    serde_json::to_value(&r.content).unwrap()[0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heavy_tool_is_refused_as_a_tool_result_while_the_cheap_one_answers() {
    let (addr, limiter) = start().await;
    let acme = connect(addr, "sk-acme").await;
    // Connecting (initialize) and listing tools are never charged.
    for _ in 0..20 {
        assert_eq!(acme.list_all_tools().await.unwrap().len(), 2);
    }
    let keys = limiter
        .call_keys(
            &Caller::new("acme").with_instance("report-agent"),
            "generate_report",
        )
        .unwrap();
    assert!(
        limiter.store().inspect(&keys).await.unwrap()[1].is_none(),
        "charged for nothing"
    );
    // The heavy tool: a burst of 2 for the tenant, then a refusal the model can read.
    let mut answered = 0;
    let refusal = loop {
        let r = call(
            &acme,
            "generate_report",
            serde_json::json!({ "topic": "q3", "millis": 1 }),
        )
        .await;
        match refused(&r) {
            None => answered += 1,
            Some(_) => break r,
        }
        assert!(answered < 20, "never refused");
    };
    assert_eq!(answered, 2);
    let why = refused(&refusal).unwrap();
    assert_eq!(why["error"], "rate_limited", "{why}");
    assert_eq!(why["tenant"], "acme");
    let wait = why["retry_after_ms"].as_u64().unwrap();
    assert!(wait > 0);
    let said = text(&refusal);
    assert!(
        said.contains("generate_report") && said.contains("retry in"),
        "{said}"
    );
    // The cheap tool still answers the same tenant.
    let r = call(&acme, "lookup_customer", serde_json::json!({ "id": "c-7" })).await;
    assert_eq!(refused(&r), None);
    assert!(text(&r).contains("c-7"));
    // The other tenant runs the same agent and has its own allowance.
    let globex = connect(addr, "sk-globex").await;
    let r = call(
        &globex,
        "generate_report",
        serde_json::json!({ "topic": "q3", "millis": 1 }),
    )
    .await;
    assert_eq!(refused(&r), None, "{}", text(&r));
    acme.cancel().await.unwrap();
    globex.cancel().await.unwrap();
}

/// Waits (polling the store) until the tenant's calls in flight at `generate_report` are `n`.
async fn in_flight_becomes(limiter: &Limiter<MemoryStore, SystemClock>, n: f64) {
    let keys = limiter
        .call_keys(
            &Caller::new("acme").with_instance("report-agent"),
            "generate_report",
        )
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let states = limiter.store().inspect(&keys).await.unwrap();
        if states[1].as_ref().map_or(0.0, |s| s.in_flight) == n {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "calls in flight never became {n}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_holds_its_permit_until_its_answer_ends_and_a_client_that_leaves_gives_it_back() {
    let (addr, limiter) = start().await;
    let acme = connect(addr, "sk-acme").await;
    // A call that would take a minute, on a client of its own.
    let long = {
        let acme = connect(addr, "sk-acme").await;
        tokio::spawn(async move {
            let _ = call(
                &acme,
                "generate_report",
                serde_json::json!({ "topic": "x", "millis": 60_000 }),
            )
            .await;
        })
    };
    in_flight_becomes(&limiter, 1.0).await;
    // While it runs, the tenant's one permit is held: a second call is refused for it.
    let r = call(
        &acme,
        "generate_report",
        serde_json::json!({ "topic": "y", "millis": 1 }),
    )
    .await;
    assert_eq!(
        refused(&r).map(|w| w["error"].clone()),
        Some("concurrency_exceeded".into())
    );
    // Its client goes away: the connection closes, the answer's stream is dropped, and the
    // permit comes back long before the call's minute.
    long.abort();
    in_flight_becomes(&limiter, 0.0).await;
    let r = call(
        &acme,
        "generate_report",
        serde_json::json!({ "topic": "z", "millis": 1 }),
    )
    .await;
    assert_eq!(refused(&r), None, "{}", text(&r));
    // A call that ends gives its permit back as its answer ends.
    in_flight_becomes(&limiter, 0.0).await;
    acme.cancel().await.unwrap();
}
