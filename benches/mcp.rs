//! An rmcp server's `tools/call` throughput with the layer in MCP mode (memory store, a policy
//! that never refuses) and without it, side by side: rounds alternate between the two servers
//! under the same load (rmcp clients on loopback, each calling a cheap tool in a loop).
//!
//! `cargo bench --bench mcp [-- ROUNDS SECONDS CLIENTS]` (default 6 rounds of 2 s, 8 clients):
//! prints calls a second per round and the median ratio, layer / bare.

#[path = "../examples/mcp.rs"]
#[allow(dead_code)]
mod example;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use rmcp::model::{CallToolRequestParams, ClientConfig};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ServiceExt;
use tower_fairshare::{Limiter, Policy};

/// Room for everything the load offers: nothing is refused.
const GENEROUS: &str = r#"
[[tool]]
name = "lookup_customer"
unit = "calls"
rate = { limit = 1000000000, per = "1m" }
[tool.default_tenant]
ceiling = 1000000000
burst = 1000000000
"#;

fn bare() -> Router {
    let mcp = StreamableHttpService::new(
        || Ok(example::Tools::default()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    Router::new()
        .nest_service("/mcp", mcp)
        .layer(axum::middleware::from_fn(example::authenticate))
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Calls a second over `seconds` with `clients` rmcp clients calling `lookup_customer`.
async fn round(addr: SocketAddr, clients: usize, seconds: f64) -> f64 {
    let calls = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for i in 0..clients {
        let calls = calls.clone();
        let key = example::KEYS[i % 2].0;
        tasks.push(tokio::spawn(async move {
            let transport = StreamableHttpClientTransport::from_config(
                StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
                    .auth_header(key),
            );
            let client = ClientConfig::default().serve(transport).await.unwrap();
            let args: serde_json::Map<String, serde_json::Value> =
                serde_json::from_value(serde_json::json!({ "id": "c-1" })).unwrap();
            let started = Instant::now();
            let mut n = 0;
            while Instant::now() < until {
                let r = client
                    .call_tool(
                        CallToolRequestParams::new("lookup_customer").with_arguments(args.clone()),
                    )
                    .await
                    .unwrap();
                assert_ne!(r.is_error, Some(true), "refused under a generous policy");
                n += 1;
            }
            calls.fetch_add(n, Ordering::Relaxed);
            let _ = client.cancel().await;
            started.elapsed().as_secs_f64()
        }));
    }
    let mut longest: f64 = 0.0;
    for t in tasks {
        longest = longest.max(t.await.unwrap());
    }
    calls.load(Ordering::Relaxed) as f64 / longest
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let rounds: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(6);
    let seconds: f64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let clients: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(8);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let limiter = Limiter::new(Policy::from_toml_str(GENEROUS).unwrap());
        let layered = serve(example::app(limiter)).await;
        let plain = serve(bare()).await;
        // Warm both up.
        round(plain, clients, 0.5).await;
        round(layered, clients, 0.5).await;
        let (mut b, mut l, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..rounds {
            // Alternate which goes first.
            let (x, y) = if i % 2 == 0 {
                let x = round(plain, clients, seconds).await;
                (x, round(layered, clients, seconds).await)
            } else {
                let y = round(layered, clients, seconds).await;
                (round(plain, clients, seconds).await, y)
            };
            println!("round {i}: bare {x:.0} calls/s, with the layer {y:.0} calls/s ({:.3}x)", y / x);
            b.push(x);
            l.push(y);
            ratios.push(y / x);
        }
        println!(
            "median: bare {:.0} calls/s, with the layer {:.0} calls/s; ratio (median of rounds) {:.3}x",
            median(b),
            median(l),
            median(ratios)
        );
    });
}
