//! The operator's console (`Limiter::console`): the live page in headless Chromium, the
//! `state`, `explain` and `refusals` answers, and the bound on what it keeps.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_fairshare::{Caller, Cost, Limiter, ManualClock, MemoryStore, Policy, Store};

/// The virtual start of the tests: 2026-01-01T00:00:00Z.
const EPOCH: tower_fairshare::Timestamp = tower_fairshare::Timestamp(1_767_225_600_000_000);

const POLICY: &str = r#"
[[tool]]
name = "generate_report"
unit = "calls"
rate = { limit = 600, per = "1m" }
[tool.tenants.heavy]
weight = 1
floor = 100
ceiling = 300
[tool.tenants.quiet]
weight = 2
floor = 60
[tool.tenants.quiet.instances.assistant]
floor = 30
[tool.tenants.quiet.default_instance]
[tool.default_tenant]
max_tenants = 1000

[[tool]]
name = "internal_report"
unit = "calls"
rate = { limit = 60, per = "1m" }
tier = "internal"
[tool.default_tenant]
"#;

fn limiter() -> (Limiter<MemoryStore, ManualClock>, ManualClock) {
    let clock = ManualClock::new(EPOCH);
    let policy = Policy::from_toml_str(POLICY).unwrap();
    (
        Limiter::with_store(policy, MemoryStore::new(), clock.clone()),
        clock,
    )
}

async fn get(app: &Router, uri: &str) -> (StatusCode, serde_json::Value) {
    let res = app
        .clone()
        .oneshot(Request::get(uri).body(axum::body::Body::empty()).unwrap())
        .await
        .unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    )
}

fn tenant<'a>(state: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    state["tools"][0]["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("{name} not on the console: {state}"))
}

/// A flood of a million refused calls under made-up names keeps at most the ring's worth per
/// name the policy knows, and never lists a made-up name.
#[tokio::test]
async fn the_ring_of_refusals_is_bounded_and_names_only_what_the_policy_knows() {
    let (limiter, _clock) = limiter();
    let app = Router::new().nest_service("/fairshare", limiter.console());
    let mut refused = 0u64;
    for k in 0..1_000_000u64 {
        // Made-up tenants (template callers, at most 1,000 counted) and a listed one.
        let caller = if k % 2 == 0 {
            Caller::new(format!("made-up-{k}"))
        } else {
            Caller::new("heavy").with_instance(format!("agent-{k}"))
        };
        if let Some(Err(_)) = limiter.try_admit(&caller, "generate_report", Cost(1.0)) {
            refused += 1;
        }
    }
    assert!(refused > 900_000, "{refused} refused");
    let (status, state) = get(&app, "/fairshare/state").await;
    assert_eq!(status, StatusCode::OK);
    let text = state.to_string();
    assert!(
        !text.contains("made-up-"),
        "a made-up name is listed: {text}"
    );
    assert!(!text.contains("agent-"), "a made-up name is listed: {text}");
    let names: Vec<&str> = state["tools"][0]["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["heavy", "quiet", "other"]);
    let counted: u64 = ["heavy", "other"]
        .iter()
        .map(|n| {
            tenant(&state, n)["refused"]["rate_limited"]
                .as_u64()
                .unwrap_or(0)
                + tenant(&state, n)["refused"]["cap_exceeded"]
                    .as_u64()
                    .unwrap_or(0)
        })
        .sum();
    assert_eq!(counted, refused, "every refusal counted once: {state}");
    for (who, expect) in [
        ("heavy", "heavy"),
        ("made-up-4", "other"),
        ("other", "other"),
    ] {
        let (status, recent) = get(
            &app,
            &format!("/fairshare/refusals?tool=generate_report&tenant={who}"),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let recent = recent.as_array().unwrap();
        assert_eq!(
            recent.len(),
            tower_fairshare::console::RECENT_REFUSALS,
            "{expect}"
        );
        let text = serde_json::to_string(recent).unwrap();
        assert!(
            !text.contains("made-up-") && !text.contains("agent-"),
            "{text}"
        );
        let newest = &recent[0];
        assert!(
            newest["reason"].is_string() && newest["at"].is_string(),
            "{newest}"
        );
        if newest["retry_after_ms"].is_u64() {
            assert!(newest["earliest"].is_string(), "{newest}");
        }
    }
}

/// `explain` answers what `admit` then does, with each level's numbers; `state` reads the
/// store; nothing on the console charges anything.
#[tokio::test]
async fn explain_and_state_read_without_charging() {
    let (limiter, clock) = limiter();
    let app = Router::new().nest_service("/fairshare", limiter.console());
    let heavy = Caller::new("heavy");
    let mut admitted = 0;
    while limiter
        .admit(&heavy, "generate_report", Cost(1.0))
        .await
        .is_ok()
    {
        admitted += 1;
    }
    let uri = "/fairshare/explain?tool=generate_report&tenant=heavy";
    let (status, e) = get(&app, uri).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(e["admitted"], false, "{e}");
    assert_eq!(e["reason"], "rate_limited", "{e}");
    assert_eq!(e["binding"], "tenant", "{e}");
    assert_eq!(e["levels"][1]["used"], admitted as f64, "{e}");
    assert_eq!(e["levels"][1]["floor"], 100.0, "{e}");
    let wait = e["retry_after_ms"].as_u64().unwrap();
    assert!(wait > 0);
    // Asking again, and reading the state, changed nothing: the same answer.
    let (_, state) = get(&app, "/fairshare/state").await;
    assert_eq!(tenant(&state, "heavy")["used"], admitted as f64);
    let (_, again) = get(&app, uri).await;
    assert_eq!(again, e);
    // At the time it named, the call passes, as explain now says.
    clock.advance(Duration::from_millis(wait));
    let (_, later) = get(&app, uri).await;
    assert_eq!(later["admitted"], true, "{later}");
    assert!(limiter
        .admit(&heavy, "generate_report", Cost(1.0))
        .await
        .is_ok());
    // A quiet tenant is explained at its floor.
    let (_, q) = get(
        &app,
        "/fairshare/explain?tool=generate_report&tenant=quiet&instance=assistant",
    )
    .await;
    assert_eq!(q["admitted"], true, "{q}");
    assert_eq!(q["levels"].as_array().unwrap().len(), 3, "{q}");
    assert_eq!(q["levels"][2]["floor"], 30.0, "{q}");
    // Bad questions get a clear answer, never one about somebody else.
    let (status, err) = get(&app, "/fairshare/explain?tenant=heavy").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(err["error"].as_str().unwrap().contains("tool="));
    for bad in ["ac%zzme", "ac%e", "%ff%fe", "a%+5"] {
        let uri = format!("/fairshare/explain?tool=generate_report&tenant={bad}");
        let (status, err) = get(&app, &uri).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {err}");
        assert!(err["error"].as_str().unwrap().contains(bad), "{err}");
    }
    let (_, spaced) = get(
        &app,
        "/fairshare/explain?tool=generate_report&tenant=he%61vy",
    )
    .await;
    assert_eq!(spaced["tenant"], "heavy", "percent-decoded: {spaced}");
}

/// `explain` resolves the caller as a call does: the tier is part of the question (or the
/// API key, through the console's key resolver), and a question without the tier a tool
/// requires says so instead of answering for a caller without one.
#[tokio::test]
async fn explain_asks_for_the_tier_a_tool_depends_on() {
    let (limiter, _clock) = limiter();
    let app = Router::new().nest_service(
        "/fairshare",
        limiter.console().resolve_keys(|key| {
            (key == "sk-heavy").then(|| Caller::new("heavy").with_tier("internal"))
        }),
    );
    let (status, e) = get(&app, "/fairshare/explain?tool=internal_report&tenant=heavy").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{e}");
    let msg = e["error"].as_str().unwrap();
    assert!(
        msg.contains("tier `internal`") && msg.contains("tier="),
        "{msg}"
    );
    for (tier, admitted) in [("internal", true), ("free", false)] {
        let uri = format!("/fairshare/explain?tool=internal_report&tenant=heavy&tier={tier}");
        let (status, e) = get(&app, &uri).await;
        assert_eq!(status, StatusCode::OK, "{e}");
        let caller = Caller::new("heavy").with_tier(tier);
        let got = limiter.admit(&caller, "internal_report", Cost(1.0)).await;
        assert_eq!(e["admitted"], got.is_ok(), "{tier}: {e} / {got:?}");
        assert_eq!(got.is_ok(), admitted, "{tier}: {got:?}");
        if let Err(r) = got {
            assert_eq!(e["reason"], r.reason.as_str(), "{e}");
        }
    }
    // By API key: the caller the key authenticates, tier included.
    let (status, e) = get(
        &app,
        "/fairshare/explain?tool=internal_report&api_key=sk-heavy",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{e}");
    assert_eq!(
        (e["admitted"].clone(), e["tenant"].clone()),
        (true.into(), "heavy".into()),
        "{e}"
    );
    let (status, e) = get(
        &app,
        "/fairshare/explain?tool=internal_report&api_key=sk-nobody",
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{e}");
    assert!(
        !e.to_string().contains("sk-nobody"),
        "the key is not echoed: {e}"
    );
    // A console that resolves no keys says so.
    let plain = Router::new().nest_service("/fairshare", limiter.console());
    let (status, e) = get(
        &plain,
        "/fairshare/explain?tool=internal_report&api_key=sk-heavy",
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{e}");
    assert!(e["error"].as_str().unwrap().contains("tier="), "{e}");
}

/// A tool's own budget, as a tenant's, is in the state and in `explain`, with what was spent.
#[tokio::test]
async fn the_tools_own_budget_is_shown_and_explained() {
    const BUDGETED: &str = r#"
        [[tool]]
        name = "t"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        budgets = [{ period = "hour", max = 5 }]
        [tool.tenants.a]
        budgets = [{ period = "day", max = 50 }]
    "#;
    let clock = ManualClock::new(EPOCH);
    let policy = Policy::from_toml_str(BUDGETED).unwrap();
    let limiter = Limiter::with_store(policy, MemoryStore::new(), clock.clone());
    let app = Router::new().nest_service("/fairshare", limiter.console());
    let a = Caller::new("a");
    for _ in 0..5 {
        limiter.admit(&a, "t", Cost(1.0)).await.unwrap();
    }
    let (_, state) = get(&app, "/fairshare/state").await;
    let tool = &state["tools"][0];
    assert_eq!(
        tool["budgets"],
        serde_json::json!([{ "period": "hour", "max": 5.0, "used": 5.0 }]),
        "{state}"
    );
    assert_eq!(tenant(&state, "a")["budgets"][0]["used"], 5.0, "{state}");
    let (_, e) = get(&app, "/fairshare/explain?tool=t&tenant=a").await;
    assert_eq!(e["admitted"], false, "{e}");
    assert_eq!(e["reason"], "cap_exceeded", "{e}");
    assert_eq!(e["levels"][0]["level"], "tool", "{e}");
    assert_eq!(
        e["levels"][0]["budgets"],
        serde_json::json!([{ "period": "hour", "max": 5.0, "used": 5.0 }]),
        "{e}"
    );
    assert_eq!(e["levels"][1]["budgets"][0]["max"], 50.0, "{e}");
    // The next hour, the tool's budget is fresh again; the tenant's day budget is not.
    clock.advance(Duration::from_secs(3600));
    let (_, e) = get(&app, "/fairshare/explain?tool=t&tenant=a").await;
    assert_eq!(e["levels"][0]["budgets"][0]["used"], 0.0, "{e}");
    assert_eq!(e["levels"][1]["budgets"][0]["used"], 5.0, "{e}");
}

/// In shadow mode (`enforce = false`) `admit` lets a refused call through and logs the
/// refusal: `explain` says the same.
#[tokio::test]
async fn explain_follows_shadow_mode() {
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "shadowed"
        unit = "calls"
        rate = { limit = 60, per = "1m" }
        enforce = false
        [tool.default_tenant]
        ceiling = 1
        burst = 1
        "#,
    )
    .unwrap();
    let limiter = Limiter::with_store(policy, MemoryStore::new(), ManualClock::new(EPOCH));
    let acme = Caller::new("acme");
    let first = limiter.admit(&acme, "shadowed", Cost(1.0)).await.unwrap();
    assert!(first.shadow_refusal().is_none());
    let e = limiter.explain(&acme, "shadowed", Cost(1.0)).await.unwrap();
    assert!(e.admitted, "{e:?}");
    assert_eq!(e.why.reason, Some("rate_limited"), "{e:?}");
    let second = limiter.admit(&acme, "shadowed", Cost(1.0)).await.unwrap();
    assert!(second.shadow_refusal().is_some());
    // A refusal before the store (an unknown tool) is never shadowed.
    let e = limiter.explain(&acme, "nope", Cost(1.0)).await.unwrap();
    assert!(
        !e.admitted && e.why.reason == Some("permission_denied"),
        "{e:?}"
    );
}

fn chromium() -> PathBuf {
    for c in ["/usr/bin/chromium", "/usr/bin/chromium-browser"] {
        if Path::new(c).exists() {
            return PathBuf::from(c);
        }
    }
    panic!("Chromium is not installed: scripts/test installs it (Debian's chromium package)");
}

fn headless(args: &[&str]) -> std::process::Output {
    let profile = tempdir();
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,720",
            "--virtual-time-budget=4000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .output()
        .expect("chromium runs");
    let _ = std::fs::remove_dir_all(profile);
    out
}

fn tempdir() -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "fairshare-console-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The figure the page shows in `field` of `tenant`'s row.
fn figure(dom: &str, tenant: &str, field: &str) -> f64 {
    let row_at = dom
        .find(&format!("data-tenant=\"{tenant}\""))
        .unwrap_or_else(|| panic!("no row for {tenant} in the page:\n{dom}"));
    let row = &dom[row_at
        ..dom[row_at..]
            .find("</tr>")
            .map_or(dom.len(), |e| row_at + e)];
    let cell = format!("data-field=\"{field}\">");
    let at = row
        .find(&cell)
        .unwrap_or_else(|| panic!("no {field} for {tenant}: {row}"))
        + cell.len();
    row[at..row[at..].find('<').unwrap() + at].parse().unwrap()
}

/// The live page in headless Chromium: a heavy tenant floods and shows at its ceiling, a quiet
/// tenant at its floor, the page's figures equal the store's, and the bars move between two
/// screenshots (written to `target/console-1.png` and `target/console-2.png`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_in_headless_chromium() {
    let (limiter, clock) = limiter();
    let app = Router::new().nest_service("/fairshare", limiter.console());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let url = format!("http://{addr}/fairshare");
    let heavy = Caller::new("heavy").with_instance("crawler");
    let quiet = Caller::new("quiet").with_instance("assistant");

    // Over most of a minute, heavy floods (50 calls a second, ten times its ceiling) and
    // quiet's assistant calls 60 times: quiet's floor.
    for ms in (0..59_000u64).step_by(20) {
        clock.set(EPOCH.saturating_add(Duration::from_millis(ms)));
        let _ = limiter.admit(&heavy, "generate_report", Cost(1.0)).await;
        if ms % 500 == 0 && ms < 30_000 {
            limiter
                .admit(&quiet, "generate_report", Cost(1.0))
                .await
                .unwrap();
        }
    }
    let dom = String::from_utf8(headless(&["--dump-dom", &url]).stdout).unwrap();
    let h_used = figure(&dom, "heavy", "used");
    assert_eq!(
        h_used,
        used(&limiter, "heavy").await,
        "the page's figure is the store's"
    );
    let q_used = figure(&dom, "quiet", "used");
    assert_eq!(
        q_used,
        used(&limiter, "quiet").await,
        "the page's figure is the store's"
    );
    assert_eq!(figure(&dom, "heavy", "ceiling"), 300.0);
    assert!(h_used >= 0.97 * 300.0, "heavy at its ceiling: {h_used}");
    assert!(figure(&dom, "heavy", "borrowed") > 0.0);
    assert_eq!(figure(&dom, "quiet", "floor"), 60.0);
    assert_eq!(q_used, 60.0, "quiet at its floor");
    assert!(
        dom.contains("rate_limited"),
        "heavy's refusals by reason are shown"
    );

    let first = screenshot(&url, "console-1.png");
    // The next window: heavy floods again and gets its banked floor and a burst at once,
    // quiet calls ten times. Every bar moves.
    clock.set(EPOCH.saturating_add(Duration::from_secs(61)));
    for _ in 0..2_000 {
        let _ = limiter.admit(&heavy, "generate_report", Cost(1.0)).await;
    }
    for _ in 0..10 {
        limiter
            .admit(&quiet, "generate_report", Cost(1.0))
            .await
            .unwrap();
    }
    the_explain_form_answers_from_a_link(&url);
    let second = screenshot(&url, "console-2.png");
    assert_ne!(
        first, second,
        "the bars did not move between the two screenshots"
    );
    let dom = String::from_utf8(headless(&["--dump-dom", &url]).stdout).unwrap();
    assert_eq!(figure(&dom, "heavy", "used"), used(&limiter, "heavy").await);
    assert_eq!(figure(&dom, "quiet", "used"), used(&limiter, "quiet").await);
    assert_eq!(figure(&dom, "quiet", "used"), 10.0);
    assert!(figure(&dom, "heavy", "used") < h_used / 2.0, "a new window");
}

/// Units through `tenant` of `generate_report` in the window, as the store holds them.
async fn used(limiter: &Limiter<MemoryStore, ManualClock>, tenant: &str) -> f64 {
    let keys = limiter
        .call_keys(&Caller::new(tenant), "generate_report")
        .unwrap();
    limiter.store().inspect(&keys).await.unwrap()[1]
        .unwrap()
        .total
}

/// A screenshot of the page at `url`, written to `target/{name}`: its bytes.
fn screenshot(url: &str, name: &str) -> Vec<u8> {
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    std::fs::create_dir_all(&target).unwrap();
    let to = target.join(name);
    // Not an earlier run's.
    let _ = std::fs::remove_file(&to);
    let out = headless(&[&format!("--screenshot={}", to.display()), url]);
    assert!(
        to.exists(),
        "no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(to).unwrap()
}

/// The explain form, from a link: with the tier the tool requires, the caller is admitted;
/// without it, the page says what to add.
fn the_explain_form_answers_from_a_link(url: &str) {
    let asked = |q: &str| {
        let page = format!("{url}#explain?{q}");
        String::from_utf8(headless(&["--dump-dom", &page]).stdout).unwrap()
    };
    let dom = asked("tool=internal_report&tenant=heavy&tier=internal");
    assert!(dom.contains("\"admitted\": true"), "{dom}");
    let dom = asked("tool=internal_report&tenant=heavy");
    assert!(dom.contains("depends on the caller's tier"), "{dom}");
}
