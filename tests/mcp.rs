//! The layer's MCP mode, as the protocol's messages meet it over HTTP: a fair share per tool
//! of `tools/call`, every other message unmetered, refusals as tool results the model reads,
//! bad bodies answered in JSON-RPC, and the body handed on byte for byte.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_fairshare::{
    BufferedBody, Caller, FairShareLayer, Limiter, ManualClock, McpRefusals, MemoryStore, Policy,
    Store, Timestamp, MCP_REFUSED,
};

const POLICY: &str = r#"
[[tool]]
name = "generate_report"
unit = "calls"
rate = { limit = 600, per = "1m" }
[tool.default_tenant]
ceiling = 2
burst = 2
max_concurrency = 1

[[tool]]
name = "lookup_customer"
unit = "calls"
rate = { limit = 600, per = "1m" }
[tool.default_tenant]
ceiling = 100
burst = 100
"#;

type Seen = Arc<Mutex<Vec<Bytes>>>;

fn limiter() -> Limiter<MemoryStore, ManualClock> {
    Limiter::with_store(
        Policy::from_toml_str(POLICY).unwrap(),
        MemoryStore::new(),
        ManualClock::new(Timestamp(1_767_225_600_000_000)),
    )
}

/// An MCP server stand-in: answers every message with a JSON-RPC result and keeps the bodies
/// it was handed.
fn server() -> (
    Seen,
    impl Service<
            Request<BufferedBody>,
            Response = Response<Full<Bytes>>,
            Error = Infallible,
            Future: Send,
        > + Clone
        + Send
        + 'static,
) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let svc = service_fn(move |req: Request<BufferedBody>| {
        let s = s.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            s.lock().unwrap().push(body);
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(
                br#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#,
            ))))
        }
    });
    (seen, svc)
}

fn call(id: u32, tool: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}","arguments":{{"q":"x y"}}}}}}"#
    )
}

fn post(body: impl Into<Bytes>, caller: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::post("/mcp")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(Full::new(body.into()))
        .unwrap();
    if let Some(c) = caller {
        req.extensions_mut()
            .insert(Caller::new(c).with_instance("shared-agent"));
    }
    req
}

async fn send<S, B>(svc: &mut S, req: Request<Full<Bytes>>) -> (StatusCode, serde_json::Value)
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let res = ServiceExt::<Request<Full<Bytes>>>::ready(svc)
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{status}: not JSON ({e}): {body:?}"));
    (status, json)
}

#[tokio::test]
async fn each_tool_has_its_share_and_a_refusal_is_a_tool_result_the_model_reads() {
    let (seen, inner) = server();
    let mut svc = FairShareLayer::new(limiter()).mcp().layer(inner);
    for id in 1..=2 {
        let (status, v) = send(&mut svc, post(call(id, "generate_report"), Some("acme"))).await;
        assert_eq!(
            (status, v["result"]["content"].is_array()),
            (StatusCode::OK, true),
            "{v}"
        );
    }
    // The heavy tool's ceiling of 2 is spent: the third call is refused in the protocol's
    // terms, HTTP 200, with the request's id.
    let (status, v) = send(&mut svc, post(call(3, "generate_report"), Some("acme"))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["jsonrpc"], "2.0");
    assert_eq!(v["id"], 3);
    assert_eq!(v["result"]["isError"], true, "{v}");
    let text = v["result"]["content"][0]["text"].as_str().unwrap();
    assert!(
        text.contains("generate_report") && text.contains("acme") && text.contains("retry in"),
        "{text}"
    );
    let refusal = &v["result"]["structuredContent"];
    assert_eq!(refusal["error"], "rate_limited", "{v}");
    assert!(refusal["retry_after_ms"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(refusal["tenant"], "acme");
    // The cheap tool still answers the same tenant; another tenant with the same agent
    // credential has its own allowance.
    let (_, v) = send(&mut svc, post(call(4, "lookup_customer"), Some("acme"))).await;
    assert!(v["result"]["isError"].is_null(), "{v}");
    let (_, v) = send(&mut svc, post(call(5, "generate_report"), Some("globex"))).await;
    assert!(v["result"]["isError"].is_null(), "{v}");
    // What reached the server is what was sent, byte for byte.
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 4, "the refused call never reached the server");
    assert_eq!(seen[0], call(1, "generate_report").as_bytes());
}

#[tokio::test]
async fn every_other_message_passes_unmetered() {
    let (seen, inner) = server();
    let limiter = limiter();
    let mut svc = FairShareLayer::new(limiter.clone()).mcp().layer(inner);
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#,
        r#"{"jsonrpc":"2.0","id":3,"method":"ping"}"#,
    ] {
        // Without a caller too: nothing here is decided.
        let (status, _) = send(&mut svc, post(body, None)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    assert_eq!(seen.lock().unwrap().len(), 4);
    let keys = limiter
        .call_keys(
            &Caller::new("acme").with_instance("shared-agent"),
            "generate_report",
        )
        .unwrap();
    let states = limiter.store().inspect(&keys).await.unwrap();
    assert!(states.iter().all(Option::is_none), "something was charged");
}

#[tokio::test]
async fn bad_bodies_get_json_rpc_errors_and_reach_nothing() {
    let (seen, inner) = server();
    let mut svc = FairShareLayer::new(limiter())
        .mcp()
        .max_body(1024)
        .layer(inner);
    let big = call(1, &"x".repeat(2048));
    let cases: [(&str, StatusCode, i64); 5] = [
        ("{oops", StatusCode::BAD_REQUEST, -32700),
        (
            r#"{"id":1,"method":"tools/call","params":{"name":"generate_report"}}"#,
            StatusCode::BAD_REQUEST,
            -32600,
        ),
        (
            r#"{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{}}"#,
            StatusCode::BAD_REQUEST,
            -32602,
        ),
        (
            r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"generate_report"}}]"#,
            StatusCode::BAD_REQUEST,
            -32600,
        ),
        (&big, StatusCode::PAYLOAD_TOO_LARGE, -32600),
    ];
    for (body, want, code) in cases {
        let (status, v) = send(&mut svc, post(body.to_owned(), Some("acme"))).await;
        assert_eq!(
            (status, v["error"]["code"].as_i64()),
            (want, Some(code)),
            "{body}: {v}"
        );
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    assert_eq!(seen.lock().unwrap().len(), 0);
    // The id is echoed when there is one.
    let (_, v) = send(
        &mut svc,
        post(
            r#"{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{}}"#,
            Some("acme"),
        ),
    )
    .await;
    assert_eq!(v["id"], 9);
    // And nothing was charged: the tenant still has its whole allowance.
    for id in 1..=2 {
        let (_, v) = send(&mut svc, post(call(id, "generate_report"), Some("acme"))).await;
        assert!(v["result"]["isError"].is_null(), "{v}");
    }
}

#[tokio::test]
async fn no_identity_keeps_the_http_401_and_a_refusal_can_be_a_json_rpc_error() {
    let (_, inner) = server();
    let layer = FairShareLayer::new(limiter()).mcp();
    let mut svc = layer.clone().layer(inner.clone());
    let res = ServiceExt::<Request<Full<Bytes>>>::ready(&mut svc)
        .await
        .unwrap()
        .call(post(call(1, "generate_report"), None))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert!(res.headers().contains_key("www-authenticate"));

    let mut svc = layer.refusals(McpRefusals::Error).layer(inner);
    let (_, v) = send(&mut svc, post(call(7, "no_such_tool"), Some("acme"))).await;
    assert_eq!(v["id"], 7);
    assert_eq!(v["error"]["code"], MCP_REFUSED);
    assert_eq!(v["error"]["data"]["error"], "permission_denied", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("retrying will not help"));
}

#[tokio::test]
async fn a_streamed_answer_holds_its_permit_until_it_ends() {
    let limiter = limiter();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, Infallible>>(4);
    let rx = Arc::new(Mutex::new(Some(rx)));
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    // The first call streams (SSE) until the sender is dropped; later ones answer at once.
    let inner = service_fn(move |_req: Request<BufferedBody>| {
        let rx = rx.lock().unwrap().take();
        c.fetch_add(1, Ordering::SeqCst);
        async move {
            let body = match rx {
                Some(rx) => http_body_util::Either::Left(Stream(rx)),
                None => http_body_util::Either::Right(Full::new(Bytes::from_static(b"{}"))),
            };
            Ok::<_, Infallible>(Response::new(body))
        }
    });
    let mut svc = FairShareLayer::new(limiter.clone()).mcp().layer(inner);
    let streaming = ServiceExt::<Request<Full<Bytes>>>::ready(&mut svc)
        .await
        .unwrap()
        .call(post(call(1, "generate_report"), Some("acme")))
        .await
        .unwrap();
    tx.send(Ok(http_body::Frame::data(Bytes::from_static(
        b"data: {}\n\n",
    ))))
    .await
    .unwrap();
    // While it streams, the tenant's one permit is held: the next call is refused.
    let next = ServiceExt::<Request<Full<Bytes>>>::ready(&mut svc)
        .await
        .unwrap()
        .call(post(call(2, "generate_report"), Some("acme")))
        .await
        .unwrap();
    let body = next.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v["result"]["structuredContent"]["error"], "concurrency_exceeded",
        "{v}"
    );
    // The client goes away mid-stream: the permit comes back.
    drop(streaming);
    let after = ServiceExt::<Request<Full<Bytes>>>::ready(&mut svc)
        .await
        .unwrap()
        .call(post(call(3, "generate_report"), Some("acme")))
        .await
        .unwrap();
    let body = after.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"{}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A response body whose frames come from a channel until its sender is dropped (an SSE
/// stream, as a server sends it).
struct Stream(tokio::sync::mpsc::Receiver<Result<http_body::Frame<Bytes>, Infallible>>);

impl http_body::Body for Stream {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx)
    }
}

#[tokio::test]
async fn tools_map_by_prefix_or_function_and_other_messages_can_be_metered() {
    const PREFIXED: &str = r#"
        [[tool]]
        name = "crm.lookup"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.default_tenant]
        ceiling = 1
        burst = 1

        [[tool]]
        name = "mcp"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.default_tenant]
        ceiling = 1
        burst = 1
    "#;
    let limiter = || {
        Limiter::with_store(
            Policy::from_toml_str(PREFIXED).unwrap(),
            MemoryStore::new(),
            ManualClock::new(Timestamp(1_767_225_600_000_000)),
        )
    };
    let (seen, inner) = server();
    let mut svc = FairShareLayer::new(limiter())
        .mcp()
        .tool_prefix("crm.")
        .meter_others("mcp")
        .layer(inner.clone());
    let (_, v) = send(&mut svc, post(call(1, "lookup"), Some("acme"))).await;
    assert_ne!(v["result"]["isError"], true, "{v}");
    let (_, v) = send(&mut svc, post(call(2, "lookup"), Some("acme"))).await;
    assert_eq!(
        v["result"]["structuredContent"]["tool"], "crm.lookup",
        "{v}"
    );
    // `tools/list` counts as the tool `mcp`: one, then refused (with its id).
    let list = r#"{"jsonrpc":"2.0","id":3,"method":"tools/list"}"#;
    let (_, v) = send(&mut svc, post(list, Some("acme"))).await;
    assert!(v["result"].is_object(), "{v}");
    let (status, _) = send(&mut svc, post(list, Some("acme"))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(seen.lock().unwrap().len(), 2);

    // A function: a tool it does not name passes unmetered.
    let mut svc = FairShareLayer::new(limiter())
        .mcp()
        .map_tool(|name| (name == "lookup").then(|| "crm.lookup".into()))
        .layer(inner);
    for id in 10..13 {
        let (_, v) = send(&mut svc, post(call(id, "free_tool"), Some("acme"))).await;
        assert_ne!(v["result"]["isError"], true, "{v}");
    }
}

#[tokio::test]
async fn a_cost_hook_prices_each_call_from_its_arguments() {
    let (_, inner) = server();
    let mut svc = FairShareLayer::new(limiter())
        .mcp()
        .cost_with(|c| {
            let args: serde_json::Value = c
                .arguments
                .and_then(|a| serde_json::from_str(a).ok())
                .unwrap_or_default();
            tower_fairshare::Cost(args["pages"].as_f64().unwrap_or(1.0))
        })
        .layer(inner);
    // The tenant's ceiling is 2 calls' worth: one call of 2 pages spends it.
    let priced = |id: u32, pages: u32| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"generate_report","arguments":{{"pages":{pages}}}}}}}"#
        )
    };
    let (_, v) = send(&mut svc, post(priced(1, 2), Some("acme"))).await;
    assert_ne!(v["result"]["isError"], true, "{v}");
    let (_, v) = send(&mut svc, post(priced(2, 1), Some("acme"))).await;
    assert_eq!(
        v["result"]["structuredContent"]["error"], "rate_limited",
        "{v}"
    );
}
