//! `fairshare serve` over real HTTP on loopback: the binary, started as a user would, called
//! with a hyper client.

#[path = "../../tests/support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const POLICY: &str = r#"
# A `3/min, burst 3` allowance per tenant on a tool with plenty of capacity.
[[tool]]
name = "generate_report"
unit = "calls"
rate = { limit = 600, per = "1m" }

[tool.default_tenant]
ceiling = 3
burst = 3

# Only callers of tier `admin` may call it.
[[tool]]
name = "admin_export"
unit = "calls"
rate = { limit = 60, per = "1m" }
tier = "admin"

[tool.default_tenant]
"#;

const KEYS: &str = r#"
# Two tenants whose agents present the same instance id.
[keys."sk-acme"]
tenant = "acme"
instance = "shared-agent"
tier = "internal"

[keys."sk-globex"]
tenant = "globex"
instance = "shared-agent"
tier = "internal"

[keys."sk-ops"]
tenant = "ops"
instance = "console"
tier = "admin"
"#;

/// A temporary directory for one test's files, removed when dropped.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let dir =
            std::env::temp_dir().join(format!("fairshare-serve-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }

    fn file(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `fairshare serve`, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
    /// The metrics listener, when it has one.
    metrics: Option<SocketAddr>,
    _stdout: BufReader<ChildStdout>,
    _dir: Dir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(name: &str) -> Server {
    serve_with(name, &[])
}

/// `fairshare serve` with these arguments too.
fn serve_with(name: &str, args: &[&str]) -> Server {
    serve_files(name, KEYS, args)
}

/// `fairshare serve` with this keys file and these arguments.
fn serve_files(name: &str, keys: &str, args: &[&str]) -> Server {
    let dir = Dir::new(name);
    let policy = dir.file("policy.toml", POLICY);
    let keys = dir.file("keys.toml", keys);
    let mut child = Command::new(env!("CARGO_BIN_EXE_fairshare"))
        .args(["serve", "--policy", &policy, "--keys", &keys])
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("fairshare serve starts");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .rsplit_once("http://")
        .and_then(|(_, a)| a.parse().ok())
        .unwrap_or_else(|| panic!("serve prints its address first, not {line:?}"));
    let mut second = String::new();
    stdout.read_line(&mut second).unwrap();
    let metrics = second
        .split("metrics at http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|a| a.parse().ok());
    Server {
        child,
        addr,
        metrics,
        _stdout: stdout,
        _dir: dir,
    }
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    json: serde_json::Value,
}

async fn call(server: &Server, tool: &str, key: Option<&str>) -> Answer {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut request = Request::post(format!("http://{}/tools/{tool}", server.addr));
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    let response = client
        .request(request.body(Empty::new()).unwrap())
        .await
        .expect("the gateway answers");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{status}: body is not JSON ({e}): {body:?}"));
    Answer {
        status,
        headers,
        json,
    }
}

#[tokio::test]
async fn no_identity_is_401() {
    let server = serve("401");
    for key in [None, Some("sk-unknown")] {
        let a = call(&server, "generate_report", key).await;
        assert_eq!(
            a.status,
            StatusCode::UNAUTHORIZED,
            "key {key:?}: {}",
            a.json
        );
        assert_eq!(a.json["error"], "unidentified_caller");
        assert_eq!(a.json["retryable"], false);
    }
    // A known key is let through.
    let a = call(&server, "generate_report", Some("sk-acme")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.json, serde_json::json!({ "ok": true }));
}

/// acme and globex both present instance id `shared-agent`. Acme is refused on its
/// 4th call of a `3/min, burst 3` allowance; globex's allowance is its own, untouched.
#[tokio::test]
async fn tenants_sharing_an_instance_id_have_their_own_allowance() {
    let server = serve("shared-id");
    for n in 1..=3 {
        let a = call(&server, "generate_report", Some("sk-acme")).await;
        assert_eq!(a.status, StatusCode::OK, "acme call {n}: {}", a.json);
        assert!(
            a.headers.contains_key("ratelimit-policy") && a.headers.contains_key("ratelimit"),
            "headers(true): admitted responses carry RateLimit headers: {:?}",
            a.headers
        );
    }
    let refused = call(&server, "generate_report", Some("sk-acme")).await;
    assert_eq!(
        refused.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        refused.json
    );

    let body = refused.json.as_object().expect("a JSON object");
    for field in [
        "error",
        "tool",
        "tenant",
        "instance",
        "scope",
        "window",
        "limit",
        "used",
        "reset_at",
        "retry_after_ms",
        "retryable",
    ] {
        assert!(body.contains_key(field), "no `{field}` in {}", refused.json);
    }
    assert!(
        matches!(
            body["error"].as_str(),
            Some("rate_limited" | "cap_exceeded")
        ),
        "{}",
        refused.json
    );
    assert_eq!(body["tool"], "generate_report");
    assert_eq!(body["tenant"], "acme");
    assert_eq!(body["instance"], "shared-agent");
    assert!(
        matches!(body["scope"].as_str(), Some("tenant" | "instance")),
        "the caller's own level refused, not the tool: {}",
        refused.json
    );
    assert_eq!(body["retryable"], true);
    assert!(
        body["retry_after_ms"].as_u64().unwrap() > 0,
        "{}",
        refused.json
    );
    assert!(body["reset_at"].is_string(), "{}", refused.json);

    let retry_after: u64 = refused.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .expect("Retry-After is whole seconds");
    assert!(retry_after >= 1);
    let policy = refused.headers["ratelimit-policy"].to_str().unwrap();
    assert!(
        policy.contains(";q=") && policy.contains(";w=60"),
        "{policy}"
    );
    assert!(refused.headers.contains_key("ratelimit"));
    assert_eq!(refused.headers["content-type"], "application/json");

    for n in 1..=3 {
        let a = call(&server, "generate_report", Some("sk-globex")).await;
        assert_eq!(a.status, StatusCode::OK, "globex call {n}: {}", a.json);
    }
    let a = call(&server, "generate_report", Some("sk-globex")).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{}", a.json);
}

#[tokio::test]
async fn tier_mismatch_is_403() {
    let server = serve("403");
    let a = call(&server, "admin_export", Some("sk-acme")).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.json);
    assert_eq!(a.json["error"], "permission_denied");
    assert_eq!(a.json["retryable"], false);
    assert!(!a.headers.contains_key("retry-after"));
    let a = call(&server, "admin_export", Some("sk-ops")).await;
    assert_eq!(a.status, StatusCode::OK, "the admin tier may: {}", a.json);
    // A tool the policy does not know is refused too.
    let a = call(&server, "no_such_tool", Some("sk-ops")).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.json);
}

#[test]
fn a_bad_keys_file_is_refused_naming_the_field() {
    let dir = Dir::new("badkeys");
    let policy = dir.file("policy.toml", POLICY);
    for (text, expect) in [
        ("[keys.\"sk-a\"]\ntenant = \"a\"\ntenat = \"b\"\n", "tenat"),
        ("[keys.\"sk-a\"]\ntenant = \"\"\n", "keys.\"sk-a\".tenant"),
        ("[keys.\"sk-a\"]\ntier = \"internal\"\n", "neither a tenant"),
    ] {
        let keys = dir.file("keys.toml", text);
        let out = Command::new(env!("CARGO_BIN_EXE_fairshare"))
            .args(["serve", "--policy", &policy, "--keys", &keys])
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{text}: {err}");
        assert!(err.contains("keys.toml") && err.contains(expect), "{err}");
    }
}

/// GET `url`, with a bearer token: status and body.
async fn get(url: String, bearer: Option<&str>) -> (StatusCode, String) {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut request = Request::get(url);
    if let Some(key) = bearer {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    let response = client
        .request(request.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Calls `/tools/generate_report` once with each key, 32 at a time over pooled
/// connections; the statuses seen.
async fn call_each(server: &Server, keys: impl Iterator<Item = String>) -> Vec<StatusCode> {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("http://{}/tools/generate_report", server.addr);
    let keys: Vec<String> = keys.collect();
    let mut out = Vec::new();
    for chunk in keys.chunks(32) {
        let mut calls = tokio::task::JoinSet::new();
        for key in chunk {
            let request = Request::post(&url).header("x-api-key", key.as_str());
            let call = client.request(request.body(Empty::new()).unwrap());
            calls.spawn(async move {
                let r = call.await.expect("the gateway answers");
                let status = r.status();
                r.into_body().collect().await.unwrap();
                status
            });
        }
        while let Some(status) = calls.join_next().await {
            out.push(status.unwrap());
        }
    }
    out
}

/// The noisy neighbour among a thousand template tenants is named in `/metrics` and on the
/// console within a window, and 100,000 identities later `/metrics` is still small: the
/// busiest unlisted callers are a bounded top-K, everyone else `other`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flooding_tenant_among_a_thousand_is_named_and_metrics_stay_bounded() {
    const IDENTITIES: usize = 100_000;
    let mut keys = String::from("[keys.\"sk-flood\"]\ntenant = \"flood-co\"\n");
    for i in 0..IDENTITIES {
        keys.push_str(&format!("[keys.\"k{i}\"]\ntenant = \"t{i}\"\n"));
    }
    let server = serve_files("busiest", &keys, &["--metrics-key", "s3cret"]);
    // A thousand tenants call twice each; one floods (2,000 calls, nearly all refused).
    let some = (0..2).flat_map(|_| (0..1_000).map(|i| format!("k{i}")));
    let flood = (0..2_000).map(|_| "sk-flood".to_owned());
    let statuses = call_each(&server, some.chain(flood)).await;
    assert!(statuses.iter().filter(|s| s.as_u16() == 429).count() > 1_900);
    let (_, metrics) = get(format!("http://{}/metrics", server.addr), Some("s3cret")).await;
    assert!(
        metrics.contains("tenant=\"flood-co\""),
        "the flooder is named:\n{metrics}"
    );
    assert!(
        !metrics.contains("tenant=\"t1\""),
        "a quiet template tenant is not named"
    );
    let (_, state) = get(
        format!("http://{}/fairshare/state", server.addr),
        Some("s3cret"),
    )
    .await;
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    let busiest = &state["tools"][0]["busiest"]["tenants"];
    assert_eq!(busiest[0]["tenant"], "flood-co", "{busiest}");
    // Nearly 2,000 refusals, counted in steps of 16. The board halves its counts at each
    // minute of the server's clock, and this test takes seconds: at most one halving falls
    // within it, so at least half of them are still counted.
    assert!(
        busiest[0]["refused"].as_f64().unwrap() >= 950.0,
        "{busiest}"
    );
    // Every other identity calls once.
    let statuses = call_each(&server, (1_000..IDENTITIES).map(|i| format!("k{i}"))).await;
    assert_eq!(statuses.len(), IDENTITIES - 1_000);
    let (_, metrics) = get(format!("http://{}/metrics", server.addr), Some("s3cret")).await;
    let named: std::collections::BTreeSet<&str> = metrics
        .split("tenant=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .collect();
    assert!(named.len() <= 12, "tenant label values: {named:?}");
    assert!(
        metrics.len() < 32 * 1024,
        "/metrics is {} bytes:\n{metrics}",
        metrics.len()
    );
    println!(
        "/metrics after {IDENTITIES} identities: {} bytes, tenant labels {named:?}",
        metrics.len()
    );
}

/// The console's `explain` asks about a gateway API key's caller, as a call with that key
/// is decided (its tier included), and says what to add to a question without the tier a
/// tool requires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_by_api_key_agrees_with_the_call() {
    let server = serve_with("explain-key", &["--metrics-key", "s3cret"]);
    let explain = |q: &str| {
        get(
            format!("http://{}/fairshare/explain?{q}", server.addr),
            Some("s3cret"),
        )
    };
    for key in ["sk-ops", "sk-acme"] {
        let (status, body) = explain(&format!("tool=admin_export&api_key={key}")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let e: serde_json::Value = serde_json::from_str(&body).unwrap();
        let called = call(&server, "admin_export", Some(key)).await;
        assert_eq!(
            e["admitted"],
            called.status == StatusCode::OK,
            "{key}: {e} / {}",
            called.json
        );
        if called.status != StatusCode::OK {
            assert_eq!(e["reason"], called.json["error"], "{key}: {e}");
        }
    }
    let (status, body) = explain("tool=admin_export&tenant=ops&instance=console").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("tier `admin`"), "{body}");
    let (status, body) = explain("tool=admin_export&api_key=sk-nobody").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
}

/// `/metrics` names every tenant: it is served only behind a key, or on a listener of its
/// own, never to anyone who asks.
#[tokio::test]
async fn metrics_need_a_key_or_a_listener_of_their_own() {
    let open = serve("metrics-none");
    assert_eq!(
        call(&open, "generate_report", Some("sk-acme")).await.status,
        StatusCode::OK
    );
    let (status, _) = get(format!("http://{}/metrics", open.addr), None).await;
    assert_eq!(
        status,
        StatusCode::NOT_FOUND,
        "no metrics without a key or listener"
    );

    let keyed = serve_with("metrics-key", &["--metrics-key", "s3cret"]);
    assert_eq!(
        call(&keyed, "generate_report", Some("sk-acme"))
            .await
            .status,
        StatusCode::OK
    );
    for wrong in [None, Some("guess")] {
        let (status, body) = get(format!("http://{}/metrics", keyed.addr), wrong).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{wrong:?}: {body}");
        assert!(!body.contains("fairshare_decisions_total"), "{body}");
    }
    let (status, body) = get(format!("http://{}/metrics", keyed.addr), Some("s3cret")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("fairshare_decisions_total"), "{body}");
    // The console names tenants too: the same key, as a header or (for a browser) in the
    // query string the page passes on; nothing without it, and nothing on an open gateway.
    for wrong in [None, Some("guess")] {
        let (status, state) = get(format!("http://{}/fairshare/state", keyed.addr), wrong).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{wrong:?}: {state}");
    }
    let (status, state) = get(
        format!("http://{}/fairshare/state", keyed.addr),
        Some("s3cret"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{state}");
    assert!(
        state.contains("\"tools\"") && state.contains("generate_report"),
        "{state}"
    );
    let (status, page) = get(
        format!("http://{}/fairshare/?key=s%33cret", keyed.addr),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("fairshare console"), "{page}");
    let (status, _) = get(format!("http://{}/fairshare/state", open.addr), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "no console without a key");
    // A path the gateway does not serve is 404 with a key set too: it neither asks for the
    // key nor tells that a console is there.
    for path in ["/nope", "/tools", "/fairshar"] {
        let (status, body) = get(format!("http://{}{path}", keyed.addr), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
        assert!(!body.contains("key"), "{path}: {body}");
    }
    // The decision latency is a histogram, as documented (not a summary).
    assert!(
        body.contains("fairshare_decision_duration_seconds_bucket{"),
        "{body}"
    );
    assert!(!body.contains("quantile="), "{body}");

    let apart = serve_with("metrics-listen", &["--metrics-listen", "127.0.0.1:0"]);
    assert_eq!(
        call(&apart, "generate_report", Some("sk-acme"))
            .await
            .status,
        StatusCode::OK
    );
    let (status, _) = get(format!("http://{}/metrics", apart.addr), None).await;
    assert_eq!(
        status,
        StatusCode::NOT_FOUND,
        "not on the gateway's listener"
    );
    let at = apart.metrics.expect("serve prints the metrics listener");
    let (status, body) = get(format!("http://{at}/metrics"), None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("fairshare_decisions_total"), "{body}");
}

/// Only `/tools/{name}` is a tool: a path below it is not a route of the gateway (404) and
/// is never charged.
#[tokio::test]
async fn a_path_below_a_tool_is_not_charged() {
    let server = serve("subpath");
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    for _ in 0..5 {
        let request = Request::post(format!(
            "http://{}/tools/generate_report/extra",
            server.addr
        ))
        .header("x-api-key", "sk-acme")
        .body(Empty::new())
        .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
    }
    // acme's allowance (3 at once) is whole.
    for _ in 0..3 {
        assert_eq!(
            call(&server, "generate_report", Some("sk-acme"))
                .await
                .status,
            StatusCode::OK
        );
    }
}

/// A replica starts while Redis is down: each tool's `on_store_error` applies (here: deny,
/// 503), and it serves from Redis as soon as Redis answers.
#[tokio::test]
async fn serve_starts_while_redis_is_down_and_connects_when_it_returns() {
    let redis = support::RedisServer::start();
    redis.kill();
    let server = serve_with("redis-down", &["--redis", &redis.url()]);
    let a = call(&server, "generate_report", Some("sk-acme")).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.json);
    assert_eq!(a.json["error"], "store_unavailable");
    assert!(redis.spawn(), "Redis starts");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let a = call(&server, "generate_report", Some("sk-acme")).await;
        if a.status == StatusCode::OK {
            break;
        }
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.json);
        assert!(
            std::time::Instant::now() < deadline,
            "never served from Redis"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn metrics_are_served_as_prometheus_text() {
    let server = serve_with("metrics", &["--metrics-key", "k"]);
    // A scripted mix: acme 3 admitted then 2 refused (ceiling 3), 1 call without identity.
    for k in 0..5 {
        let want = if k < 3 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(
            call(&server, "generate_report", Some("sk-acme"))
                .await
                .status,
            want
        );
    }
    assert_eq!(
        call(&server, "generate_report", None).await.status,
        StatusCode::UNAUTHORIZED
    );
    let (status, text) = get(format!("http://{}/metrics", server.addr), Some("k")).await;
    assert_eq!(status, StatusCode::OK);
    let value = |name: &str, labels: &[&str]| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
            .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    // acme is governed by the tool's default_tenant: labels carry only the policy's own names,
    // so a template's tenants share `other`.
    let d = "fairshare_decisions_total{";
    assert_eq!(value(d, &["tenant=\"other\"", "outcome=\"admitted\""]), 3.0);
    assert_eq!(
        value(
            d,
            &[
                "tenant=\"other\"",
                "outcome=\"refused\"",
                "reason=\"rate_limited\"",
                "scope=\"tenant\""
            ]
        ),
        2.0
    );
    assert_eq!(
        value(
            d,
            &["outcome=\"refused\"", "reason=\"unidentified_caller\""]
        ),
        1.0
    );
    assert!(
        !text.contains("tenant=\"acme\""),
        "a template tenant's own name is not a label"
    );
    assert!(value("fairshare_tool_headroom{", &["tool=\"generate_report\""]) >= 0.0);
    assert_eq!(
        value(
            "fairshare_decision_duration_seconds_count{",
            &["store=\"memory\""]
        ),
        5.0
    );
    for name in [
        "fairshare_decisions_total",
        "fairshare_tool_headroom",
        "fairshare_decision_duration_seconds",
    ] {
        assert!(
            text.contains(&format!("# HELP {name}")),
            "{name} is described"
        );
    }
}

/// Hot reload: the gateway picks up a changed policy file by itself (and on SIGHUP); usage
/// so far still counts; an invalid file is rejected and the policy in force stays.
#[tokio::test]
async fn serve_reloads_its_policy_file_and_rejects_an_invalid_one() {
    let server = serve("reload");
    let policy = server._dir.0.join("policy.toml");
    for _ in 0..3 {
        assert_eq!(
            call(&server, "generate_report", Some("sk-acme"))
                .await
                .status,
            StatusCode::OK
        );
    }
    assert_eq!(
        call(&server, "generate_report", Some("sk-acme"))
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Raise the allowance to 10. The file is polled every second.
    std::thread::sleep(std::time::Duration::from_millis(1100)); // a new modification time
    std::fs::write(
        &policy,
        POLICY.replace("ceiling = 3\nburst = 3", "ceiling = 10\nburst = 10"),
    )
    .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    // globex (untouched so far) now has 10, not 3.
    for k in 0..10 {
        assert_eq!(
            call(&server, "generate_report", Some("sk-globex"))
                .await
                .status,
            StatusCode::OK,
            "call {k}"
        );
    }
    let refused = call(&server, "generate_report", Some("sk-globex")).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.json["limit"], 10);
    // acme's 3 calls still count: its bank is not refilled by the reload.
    assert_eq!(
        call(&server, "generate_report", Some("sk-acme"))
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // An invalid file changes nothing: the limit in force is still 10.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    std::fs::write(&policy, "[[tool]]\nname = \"generate_report\"\nunit = \"calls\"\nrate = { limit = -1, per = \"1m\" }\n").unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let still = call(&server, "generate_report", Some("sk-globex")).await;
    assert_eq!(still.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(still.json["limit"], 10);
}

/// `fairshare simulate --redis` gives the report the in-process store gives, and clears its
/// state when it is done (an injected clock's keys would otherwise outlive the run by minutes).
#[test]
fn simulate_on_redis_matches_memory_and_leaves_no_keys() {
    let redis = support::RedisServer::start();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_fairshare"))
            .current_dir(root)
            .args([
                "simulate",
                "--policy",
                "examples/web_search/policy.toml",
                "--scenario",
                "examples/web_search/saturation.toml",
                "--json",
            ])
            .args(extra)
            .output()
            .expect("fairshare runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let memory = run(&[]);
    let url = redis.url();
    let on_redis = run(&["--redis", &url]);
    assert_eq!(memory, on_redis);
    // No state is left; the store's epoch marker (how a store tells that Redis lost its state)
    // may be, as for any store, with its own day-long TTL.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut redis.conn())
        .unwrap();
    assert!(
        keys.iter().all(|k| k.ends_with('@')),
        "keys left behind: {keys:?}"
    );
}

/// A client that opens a connection, sends a request line and then one more header line every
/// 5 s, never a whole head, and opens another connection once the server closes it.
async fn trickler(addr: SocketAddr, connected: std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = [0u8; 256];
    loop {
        let Ok(mut c) = tokio::net::TcpStream::connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        connected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut line: &[u8] = b"POST /tools/generate_report HTTP/1.1\r\n";
        loop {
            if c.write_all(line).await.is_err() {
                break;
            }
            line = b"x-trickle: 1\r\n";
            tokio::select! {
                read = c.read(&mut buf) => if !matches!(read, Ok(n) if n > 0) { break },
                () = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
        }
    }
}

/// One call on a connection of its own, as a plain HTTP/1.1 client: how long until the whole
/// answer came (`None` past 25 s).
async fn timed_call(addr: SocketAddr) -> Option<Duration> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let started = std::time::Instant::now();
    let call = async {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(
            b"POST /tools/generate_report HTTP/1.1\r\nhost: x\r\nx-api-key: sk-acme\r\n\
              connection: close\r\ncontent-length: 0\r\n\r\n",
        )
        .await
        .unwrap();
        let mut answer = Vec::new();
        c.read_to_end(&mut answer).await.unwrap();
        answer
    };
    let answer = tokio::time::timeout(Duration::from_secs(25), call)
        .await
        .ok()?;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 "), "{answer}");
    Some(started.elapsed())
}

/// 1,500 connections that trickle a header line every 5 s, at every flag's default, while a
/// normal client calls for 12 s, past the moment the first flood connections reach their
/// header timeout and come back. (Real time: the kernel's listen queue is part of what is
/// tried, and it does not run on a test's clock.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_flood_leaves_a_normal_client_served_at_default_flags() {
    let server = serve("flood");
    let connected = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let flood: Vec<_> = (0..1_500)
        .map(|_| tokio::spawn(trickler(server.addr, connected.clone())))
        .collect();
    let began = std::time::Instant::now();
    while connected.load(std::sync::atomic::Ordering::Relaxed) < 1_500
        && began.elapsed() < Duration::from_secs(3)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut took = Vec::new();
    let mut timed_out = 0;
    let calling = std::time::Instant::now();
    while calling.elapsed() < Duration::from_secs(12) {
        match timed_call(server.addr).await {
            Some(t) => took.push(t),
            None => timed_out += 1,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for attacker in flood {
        attacker.abort();
    }
    took.sort();
    let p99 = took[(took.len() * 99).div_ceil(100).saturating_sub(1)];
    eprintln!(
        "flood: {} calls answered, median {:?}, p99 {p99:?}, {timed_out} timed out",
        took.len(),
        took[took.len() / 2]
    );
    assert!(
        timed_out == 0 && p99 < Duration::from_secs(1),
        "{timed_out} calls timed out at 25 s; of {} answered, median {:?}, p99 {p99:?}",
        took.len(),
        took[took.len() / 2],
    );
}
