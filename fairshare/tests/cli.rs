//! The `fairshare` command, run as a user would.

use std::process::Command;

fn fairshare(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fairshare"))
        .args(args)
        // Paths below are the workspace root's (the example policies live there).
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("fairshare runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_prints_the_worked_examples_ceilings() {
    let (code, out, _) = fairshare(&["check", "examples/web_search/policy.toml"]);
    assert_eq!(code, 0);
    for (tenant, ceiling) in [("A", "328"), ("B", "136"), ("C", "68"), ("D", "68")] {
        let row = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(tenant))
            .unwrap_or_else(|| panic!("no row for {tenant} in\n{out}"));
        let cols: Vec<&str> = row.split_whitespace().collect();
        // tenant floor weight share ceiling burst
        assert_eq!(cols[4], ceiling, "{row}");
    }
}

/// `check` says what capacity can go unused and why: floors are kept for their tenants, a
/// tenant alone gets at most its ceiling, and ceilings below the capacity leave the rest idle.
#[test]
fn check_says_what_capacity_can_go_unused_and_why() {
    let (code, out, _) = fairshare(&["check", "fairshare/demo/policy.toml"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("unused capacity: 55 of 150 a period are tenants' floors"),
        "{out}"
    );
    assert!(
        out.contains("a tenant calling alone gets at most its ceiling: heavy 112 (38 unused), quiet 34 (116 unused)"),
        "{out}"
    );
    assert!(!out.contains("even with every tenant busy"), "{out}");

    let dir = std::env::temp_dir().join(format!("fairshare-cli-unused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let capped = dir.join("capped.toml");
    std::fs::write(
        &capped,
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 100, per = \"1m\" }\n\
         [tool.tenants.a]\nfloor = 10\nceiling = 30\n[tool.tenants.b]\nceiling = 20\n",
    )
    .unwrap();
    let (code, out, _) = fairshare(&["check", capped.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(
            "even with every tenant busy, 50 a period go unused: the ceilings add up to 50"
        ),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn check_rejects_floors_above_capacity_naming_the_field() {
    let dir = std::env::temp_dir().join(format!("fairshare-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        r#"
        [[tool]]
        name = "web_search"
        unit = "calls"
        rate = { limit = 100, per = "1m" }
        [tool.tenants.A]
        floor = 80
        [tool.tenants.B]
        floor = 40
        ceiling = 20
        [tool.tenants.C]
        weight = -1
        "#,
    )
    .unwrap();
    let (code, _, err) = fairshare(&["check", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("tool[0].tenants: floors add up to 120"),
        "{err}"
    );
    assert!(
        err.contains("tool[0].tenants.B.ceiling"),
        "every error is listed: {err}"
    );
    assert!(
        err.contains("tool[0].tenants.C.weight"),
        "every error is listed: {err}"
    );
    let typo = dir.join("typo.toml");
    std::fs::write(
        &typo,
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 1, per = \"1m\" }\n[tool.tenants.A]\nflor = 3\n",
    )
    .unwrap();
    let (code, _, err) = fairshare(&["check", typo.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("tool[0].tenants.A") && err.contains("flor"),
        "{err}"
    );
}

#[test]
fn simulate_json_is_deterministic_and_within_capacity() {
    let args = [
        "simulate",
        "--json",
        "--policy",
        "examples/web_search/policy.toml",
        "--scenario",
        "examples/web_search/saturation.toml",
    ];
    let (code, first, _) = fairshare(&args);
    assert_eq!(code, 0);
    let (_, second, _) = fairshare(&args);
    assert_eq!(first, second);
    let v: serde_json::Value = serde_json::from_str(&first).unwrap();
    let periods = v["periods"].as_array().unwrap();
    assert_eq!(periods.len(), 10);
    for p in periods {
        assert!(p["admitted"].as_u64().unwrap() <= 600);
        for c in p["callers"].as_array().unwrap() {
            let got = c["admitted"].as_f64().unwrap();
            let owed = c["ceiling"].as_f64().unwrap();
            assert!((got - owed).abs() <= 0.05 * owed, "{c}");
            for field in ["tenant", "instance", "offered", "refused", "floor"] {
                assert!(c.get(field).is_some(), "missing {field}");
            }
        }
        assert!(p["start_ms"].is_u64());
    }
    assert_eq!(v["totals"].as_array().unwrap().len(), 4);
}

/// With a template tenant, `check` says its shares and ceilings count one template caller
/// active, and gives what a listed tenant gets calling alone: what the limiter admits it.
#[test]
fn check_says_which_callers_its_ceilings_count() {
    use tower_fairshare::{Caller, Cost, Limiter, ManualClock, MemoryStore, Policy, Timestamp};
    const TEMPLATED: &str = "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 150, per = \"5s\" }\n\
        [tool.tenants.heavy]\nweight = 6\nfloor = 25\n[tool.tenants.quiet]\nweight = 2\nfloor = 15\n\
        [tool.default_tenant]\nweight = 1\nmax_tenants = 10\n";
    let dir = std::env::temp_dir().join(format!("fairshare-cli-alone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("templated.toml");
    std::fs::write(&path, TEMPLATED).unwrap();
    let (code, out, _) = fairshare(&["check", path.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(code, 0, "{out}");
    let heavy_row: Vec<&str> = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some("heavy"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(heavy_row[4], "98.3", "{out}");
    assert!(
        out.contains("count one active tenant of each template: (default tenant) (weight 1)")
            && out.contains("with none active the ceilings are heavy 107.5, quiet 42.5"),
        "{out}"
    );
    assert!(
        out.contains("a tenant calling alone gets at most its ceiling: heavy 107.5"),
        "{out}"
    );

    // heavy alone, offered far more than it can get, one call every 10 ms: what one whole
    // aligned period (after the first, which starts with a full burst) admits.
    let clock = ManualClock::new(Timestamp(1_767_225_600_000_000));
    let limiter = Limiter::with_store(
        Policy::from_toml_str(TEMPLATED).unwrap(),
        MemoryStore::new(),
        clock.clone(),
    );
    let heavy = Caller::new("heavy");
    let admitted = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(async {
            let mut in_second = 0;
            for step in 0..1_000 {
                let ok = limiter.admit(&heavy, "t", Cost(1.0)).await.is_ok();
                if ok && (500..1_000).contains(&step) {
                    in_second += 1;
                }
                clock.advance(std::time::Duration::from_millis(10));
            }
            in_second
        });
    assert!(
        (107..=108).contains(&admitted),
        "heavy alone was admitted {admitted} in a period, check says 107.5"
    );
}

/// A reader that goes away (`fairshare check p.toml | head -1`) ends the command quietly: exit
/// 0, nothing on stderr. (It panicked on the closed pipe.)
#[test]
fn a_closed_pipe_ends_the_command_quietly() {
    for args in [
        &["check", "examples/web_search/policy.toml"][..],
        &[
            "simulate",
            "--policy",
            "examples/web_search/policy.toml",
            "--scenario",
            "examples/web_search/saturation.toml",
        ],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_fairshare"))
            .args(args)
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("fairshare runs");
        // The reader goes away before the command writes anything.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
}
