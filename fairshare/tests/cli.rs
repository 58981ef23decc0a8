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

/// A folder of its own under the system's temp folder, with `files` written in it.
fn scratch(name: &str, files: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("fairshare-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (file, text) in files {
        std::fs::write(dir.join(file), text).unwrap();
    }
    dir
}

/// `fairshare simulate` of the `policy` and `scenario` files, with `more` flags.
fn simulate(
    policy: &std::path::Path,
    scenario: &std::path::Path,
    more: &[&str],
) -> (i32, String, String) {
    let (p, s) = (policy.to_str().unwrap(), scenario.to_str().unwrap());
    let mut args = vec!["simulate", "--policy", p, "--scenario", s];
    args.extend(more);
    fairshare(&args)
}

const ONE_TOOL: &str = r#"
[[tool]]
name = "t"
unit = "calls"
rate = { limit = 60, per = "1m" }
[tool.default_tenant]
"#;

/// A scenario `simulate` cannot run is refused before it runs, naming the scenario file and
/// the field, with what to do: one far too long (it aborted allocating gigabytes), one that
/// offers too many calls (it ran for minutes), a caller that stops before it starts or starts
/// after the end (every period read "offered 0"), a blank tenant, no caller at all; a file that
/// is not TOML names its file and no empty field; a value of the wrong type is named in the
/// author's words (a number, not `f64`).
#[test]
fn simulate_refuses_a_scenario_it_cannot_run_naming_the_file_and_the_field() {
    let caller = "[[caller]]\ntenant = \"A\"\nrate = 10\nper = \"1m\"\n";
    let cases = [
        ("long", format!("tool = \"t\"\nduration = \"99999d\"\n{caller}"), "duration: "),
        ("busy", "tool = \"t\"\nduration = \"10m\"\n[[caller]]\ntenant = \"A\"\nrate = 1e12\nper = \"1ms\"\n".to_owned(), "caller: the callers offer"),
        ("stop", format!("tool = \"t\"\nduration = \"10m\"\n{caller}start = \"2m\"\nstop = \"1m\"\n"), "caller[0].stop: "),
        ("late", format!("tool = \"t\"\nduration = \"10m\"\n{caller}start = \"20m\"\n"), "caller[0].start: "),
        ("blank", "tool = \"t\"\nduration = \"10m\"\n[[caller]]\ntenant = \" \"\nrate = 10\nper = \"1m\"\n".to_owned(), "caller[0].tenant: must not be blank"),
        ("none", "tool = \"t\"\nduration = \"10m\"\n".to_owned(), "caller: the scenario has no [[caller]]"),
        ("syntax", "tool = \n".to_owned(), "TOML parse error"),
        ("type", format!("tool = \"t\"\nduration = \"10m\"\n{}", caller.replace("10", "\"10\"")), "caller[0].rate: invalid type: string \"10\", expected a number"),
    ];
    let dir = scratch("refused", &[("p.toml", ONE_TOOL)]);
    for (name, text, says) in cases {
        let scenario = dir.join(format!("{name}.toml"));
        std::fs::write(&scenario, text).unwrap();
        let (code, out, err) = simulate(&dir.join("p.toml"), &scenario, &[]);
        assert_eq!(code, 1, "{name}: {err}");
        assert!(out.is_empty(), "{name}: {out}");
        let named = format!("error: {}: ", scenario.display());
        assert!(err.starts_with(&named), "{name}: {err}");
        assert!(err.contains(says), "{name}: {err}");
        // In the author's words, not Rust's types.
        assert!(
            !err.contains("f64") && !err.contains("u64"),
            "{name}: {err}"
        );
        assert!(
            !err.contains(": :") && !err.contains(": .:"),
            "{name}: {err}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// `--svg` never writes its chart over the policy or the scenario it reads, and a chart that
/// cannot be written (no such folder) is refused before the run, not after it.
#[test]
fn simulate_writes_no_chart_over_its_inputs_nor_runs_for_a_chart_it_cannot_write() {
    let scenario =
        "tool = \"t\"\nduration = \"2m\"\n[[caller]]\ntenant = \"A\"\nrate = 10\nper = \"1m\"\n";
    let dir = scratch("svg", &[("p.toml", ONE_TOOL), ("s.toml", scenario)]);
    let (p, s) = (dir.join("p.toml"), dir.join("s.toml"));
    let missing = dir.join("no-such-folder").join("chart.svg");
    for (out, says) in [
        (&p, "is the input file"),
        (&s, "is the input file"),
        (&missing, "does not exist"),
    ] {
        let (code, stdout, err) = simulate(&p, &s, &["--svg", out.to_str().unwrap()]);
        assert_eq!(code, 1, "{err}");
        assert!(stdout.is_empty(), "{stdout}");
        assert!(err.contains("--svg") && err.contains(says), "{err}");
    }
    assert_eq!(std::fs::read_to_string(&p).unwrap(), ONE_TOOL);
    assert_eq!(std::fs::read_to_string(&s).unwrap(), scenario);
    // A chart beside them is written, and the report printed.
    let chart = dir.join("chart.svg");
    let (code, stdout, err) = simulate(&p, &s, &["--svg", chart.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains('A'), "{stdout}");
    assert!(std::fs::read_to_string(&chart).unwrap().starts_with("<svg"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// `serve` refuses flags that cannot work before it listens: no connection allowed at all, a
/// negative count, an empty metrics key (it meant no /metrics), a CA without Redis, a CA file
/// that holds no certificate.
#[test]
fn serve_refuses_flags_that_cannot_work_before_it_listens() {
    let dir = scratch(
        "serve-flags",
        &[
            ("p.toml", ONE_TOOL),
            ("k.toml", "[keys.\"sk-a\"]\ntenant = \"A\"\n"),
            ("ca.pem", "not a certificate\n"),
        ],
    );
    let path = |f: &str| dir.join(f).to_str().unwrap().to_owned();
    let base = ["serve", "--listen", "127.0.0.1:0", "--policy"];
    let cases: [(&[&str], &str); 5] = [
        (&["--max-connections", "0"], "--max-connections"),
        (&["--max-connections", "-1"], "--max-connections"),
        (&["--metrics-key", ""], "--metrics-key"),
        (&["--redis-ca", &path("ca.pem")], "need --redis"),
        (
            &[
                "--redis",
                "rediss://127.0.0.1:1/",
                "--redis-ca",
                &path("ca.pem"),
            ],
            "holds no PEM certificate",
        ),
    ];
    for (flags, says) in cases {
        let (policy, keys) = (path("p.toml"), path("k.toml"));
        let mut args: Vec<&str> = base.to_vec();
        args.extend([policy.as_str(), "--keys", keys.as_str()]);
        args.extend(flags);
        let mut child = Command::new(env!("CARGO_BIN_EXE_fairshare"))
            .args(&args)
            .env_remove("FAIRSHARE_REDIS_URL")
            .env_remove("FAIRSHARE_METRICS_KEY")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("fairshare runs");
        // It must end by itself; one that listens is stopped and fails the test.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                panic!("{flags:?}: serve started");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A tool that lists no tenant and has no `default_tenant` or plan admits no caller: `check`
/// warns so, and prints no line about lending among tenants it does not have (it printed
/// "a tenant calling alone gets at most its ceiling: ;").
#[test]
fn check_warns_of_a_tool_that_admits_no_caller() {
    let dir = scratch(
        "no-caller",
        &[(
            "p.toml",
            "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 60, per = \"1m\" }\n",
        )],
    );
    let policy = dir.join("p.toml");
    let (code, out, err) = fairshare(&["check", policy.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let all = format!("{out}{err}");
    assert!(all.contains("admits no caller"), "{all}");
    assert!(!all.contains("calling alone"), "{all}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A scenario's caller the policy refuses whoever it is (a tenant it does not know, with no
/// template to govern it), or whose every call costs more than the tool's capacity, is
/// simulated as it would be served — every call refused — and `simulate` says so and why,
/// naming the caller.
#[test]
fn simulate_warns_of_a_caller_the_policy_refuses_whoever_it_is() {
    let scenario = "tool = \"t\"\nduration = \"2m\"\n[[caller]]\ntenant = \"A\"\nrate = 10\nper = \"1m\"\n[[caller]]\ntenant = \"Z\"\nrate = 10\nper = \"1m\"\n[[caller]]\ntenant = \"A\"\nrate = 10\nper = \"1m\"\ncost = 1e300\n";
    let policy = "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 60, per = \"1m\" }\n[tool.tenants.A]\n";
    let dir = scratch(
        "refused-caller",
        &[("p.toml", policy), ("s.toml", scenario)],
    );
    let s = dir.join("s.toml");
    let (code, out, err) = simulate(&dir.join("p.toml"), &s, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains('Z'), "{out}");
    let warning = format!(
        "warning: {}: caller[1]: every call is refused: ",
        s.display()
    );
    assert!(err.contains(&warning), "{err}");
    assert!(
        err.contains("permission_denied") && err.contains("(unlisted"),
        "{err}"
    );
    assert!(
        err.contains("caller[2]: every call is refused: its cost"),
        "{err}"
    );
    assert!(!err.contains("caller[0]"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
