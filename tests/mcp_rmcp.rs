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

/// A client that follows the protocol (streamable HTTP, revision 2025-06-18) and nothing
/// else: plain HTTP/1.1 requests, answers read as JSON or as an SSE stream.
struct PlainClient {
    addr: SocketAddr,
    key: &'static str,
    session: Option<String>,
}

impl PlainClient {
    /// POSTs one message; the HTTP status and the JSON-RPC answer (`Null` for none).
    async fn post(&mut self, message: serde_json::Value) -> (u16, serde_json::Value) {
        self.post_text(message.to_string()).await
    }

    /// POSTs `body` as it is.
    async fn post_text(&mut self, body: String) -> (u16, serde_json::Value) {
        let stream = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let mut req = http::Request::post("/mcp")
            .header("host", self.addr.to_string())
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("authorization", format!("Bearer {}", self.key))
            .header("mcp-protocol-version", "2025-06-18");
        if let Some(s) = &self.session {
            req = req.header("mcp-session-id", s);
        }
        let body = http_body_util::Full::new(bytes::Bytes::from(body));
        let res = send.send_request(req.body(body).unwrap()).await.unwrap();
        let status = res.status().as_u16();
        if let Some(s) = res.headers().get("mcp-session-id") {
            self.session = Some(s.to_str().unwrap().to_owned());
        }
        let sse = res
            .headers()
            .get("content-type")
            .is_some_and(|v| v.to_str().unwrap().starts_with("text/event-stream"));
        let mut body = res.into_body();
        let mut text = String::new();
        // An SSE answer is read up to its first message with an id; a JSON one whole.
        while let Some(frame) = http_body_util::BodyExt::frame(&mut body).await {
            if let Ok(data) = frame.unwrap().into_data() {
                text.push_str(std::str::from_utf8(&data).unwrap());
            }
            if sse {
                if let Some(v) = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .filter_map(|d| serde_json::from_str::<serde_json::Value>(d.trim()).ok())
                    .find(|v| v.get("id").is_some())
                {
                    return (status, v);
                }
            }
        }
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_follows_the_protocol_gets_the_same_answers() {
    let (addr, limiter) = start().await;
    let mut c = PlainClient {
        addr,
        key: "sk-acme",
        session: None,
    };
    let (status, init) = c
        .post(serde_json::json!({
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": { "name": "plain", "version": "1" }
            }
        }))
        .await;
    assert_eq!(status, 200, "{init}");
    assert!(
        init["result"]["capabilities"]["tools"].is_object(),
        "{init}"
    );
    let (status, _) = c
        .post(serde_json::json!({ "jsonrpc": "2.0", "method": "notifications/initialized" }))
        .await;
    assert_eq!(status, 202);
    let call = |id: u32| {
        serde_json::json!({
            "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": { "name": "generate_report", "arguments": { "topic": "q3", "millis": 1 } }
        })
    };
    for id in 2..=3 {
        let (status, v) = c.post(call(id)).await;
        assert_eq!((status, v["id"].as_u64()), (200, Some(id.into())), "{v}");
        assert_ne!(v["result"]["isError"], true, "{v}");
    }
    let (status, v) = c.post(call(4)).await;
    assert_eq!(status, 200);
    assert_eq!(v["id"], 4);
    assert_eq!(v["result"]["isError"], true, "{v}");
    assert_eq!(
        v["result"]["structuredContent"]["error"], "rate_limited",
        "{v}"
    );
    // Not JSON: the JSON-RPC parse error, with nothing run.
    let (status, v) = c.post_text("{oops".to_owned()).await;
    assert_eq!(
        (status, v["error"]["code"].as_i64()),
        (400, Some(-32700)),
        "{v}"
    );
    // Past the body limit (4 MiB by default): 413 with the JSON-RPC error, nothing run.
    let huge = format!(
        r#"{{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{{"name":"generate_report","arguments":{{"topic":"{}"}}}}}}"#,
        "x".repeat(5 << 20)
    );
    let (status, v) = c.post_text(huge).await;
    assert_eq!(
        (status, v["error"]["code"].as_i64()),
        (413, Some(-32600)),
        "{v}"
    );
    // Neither was charged: the two admitted calls are all the tenant used.
    let keys = limiter
        .call_keys(
            &Caller::new("acme").with_instance("report-agent"),
            "generate_report",
        )
        .unwrap();
    let used = limiter.store().inspect(&keys).await.unwrap()[1]
        .as_ref()
        .unwrap()
        .total;
    assert!(used <= 2.0, "{used} charged");
    // No key: HTTP 401 with a challenge, as the transport's auth says.
    let mut anonymous = PlainClient {
        addr,
        key: "sk-nobody",
        session: c.session.clone(),
    };
    let (status, _) = anonymous.post(call(5)).await;
    assert_eq!(status, 401);
}
