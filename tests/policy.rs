//! Policy loading and validation: strict, every error with its exact path.

use tower_fairshare::policy::Problem;
use tower_fairshare::{
    BudgetPeriod, Caller, Cost, InstanceBuilder, Limiter, ManualClock, MemoryStore, Policy,
    PolicyError, TenantBuilder, Timestamp, ToolBuilder, Unit,
};

const FULL_EXAMPLE: &str = r#"
[[tool]]
name = "web_search"
unit = "calls"
rate = { limit = 600, per = "1m" }
burst = 60
tier = "internal"
require_tenant = true
max_concurrency = 64
budgets = [ { period = "hour", max = 300 }, { period = "month", max = 15000 } ]

[tool.default_tenant]
weight = 1
floor = 0
max_tenants = 100

[tool.tenants.team-research]
weight = 6
floor = 100
ceiling = 400
burst = 20
max_concurrency = 8
budgets = [ { period = "hour", max = 400 }, { period = "month", max = 15000 } ]

[tool.tenants.team-research.default_instance]
weight = 1
floor = 0
max_instances = 50

[tool.tenants.team-research.instances.interactive]
weight = 3
floor = 20
max_concurrency = 2
"#;

fn problems(text: &str) -> Vec<(String, String)> {
    Policy::from_toml_str(text)
        .expect_err("must be refused")
        .problems()
}

fn one_tool(body: &str) -> String {
    format!(
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = {{ limit = 100, per = \"1m\" }}\n{body}"
    )
}

#[test]
fn the_spec_example_loads() {
    let p = Policy::from_toml_str(FULL_EXAMPLE).unwrap();
    let t = p.tool("web_search").unwrap();
    assert_eq!(t.capacity(), 600.0);
    assert_eq!(t.period().as_micros(), 60_000_000);
    assert_eq!(t.burst(), 60.0);
    assert_eq!(t.tiers(), ["internal".to_string()]);
    assert_eq!(t.max_concurrency(), Some(64));
    let r = t.tenant("team-research").unwrap();
    assert_eq!(
        (r.weight(), r.floor(), r.ceiling(), r.burst()),
        (6.0, 100.0, Some(400.0), 20.0)
    );
    assert_eq!(r.instance("interactive").unwrap().floor(), 20.0);
    assert_eq!(r.instance("someone-else").unwrap().max_tracked(), 50);
    assert!(t.tenant("unlisted").unwrap().is_template());
    assert_eq!(t.budgets()[1].period(), BudgetPeriod::Month);
}

#[test]
fn json_loads_the_same_structure() {
    let json = r#"{"tool":[{"name":"t","unit":"tokens","rate":{"limit":1000,"per":"1h"},
        "tenants":{"A":{"weight":3,"floor":100},"B":{"floor":50}},
        "budgets":[{"period":"day","max":5000}]}]}"#;
    let p = Policy::from_json_str(json).unwrap();
    let q = Policy::from_toml_str(
        "[[tool]]\nname=\"t\"\nunit=\"tokens\"\nrate={limit=1000,per=\"1h\"}\nbudgets=[{period=\"day\",max=5000}]\n[tool.tenants.A]\nweight=3\nfloor=100\n[tool.tenants.B]\nfloor=50\n",
    )
    .unwrap();
    assert_eq!(
        serde_json::to_value(p.allocation()).unwrap(),
        serde_json::to_value(q.allocation()).unwrap()
    );
    // Duplicate keys in JSON are an error, not "last one wins".
    let dup = r#"{"tool":[{"name":"t","unit":"calls","rate":{"limit":10,"per":"1m"},
        "tenants":{"A":{"floor":1},"A":{"floor":9}}}]}"#;
    let err = Policy::from_json_str(dup).unwrap_err().to_string();
    assert!(err.contains("duplicate name `A`"), "{err}");
}

#[test]
fn the_builder_agrees_with_the_file() {
    let built = Policy::builder()
        .tool(
            ToolBuilder::new("web_search", Unit::Calls, 600.0, "1m")
                .burst(60.0)
                .tiers(["internal"])
                .max_concurrency(64)
                .budget(BudgetPeriod::Hour, 300.0)
                .budget(BudgetPeriod::Month, 15000.0)
                .default_tenant(TenantBuilder::new().weight(1.0).floor(0.0).max_tenants(100))
                .tenant(
                    "team-research",
                    TenantBuilder::new()
                        .weight(6.0)
                        .floor(100.0)
                        .ceiling(400.0)
                        .burst(20.0)
                        .max_concurrency(8)
                        .budget(BudgetPeriod::Hour, 400.0)
                        .budget(BudgetPeriod::Month, 15000.0)
                        .default_instance(InstanceBuilder::new().weight(1.0).max_instances(50))
                        .instance(
                            "interactive",
                            InstanceBuilder::new()
                                .weight(3.0)
                                .floor(20.0)
                                .max_concurrency(2),
                        ),
                ),
        )
        .build()
        .unwrap();
    let loaded = Policy::from_toml_str(FULL_EXAMPLE).unwrap();
    assert_eq!(
        serde_json::to_value(built.allocation()).unwrap(),
        serde_json::to_value(loaded.allocation()).unwrap()
    );
    // And it refuses what the file would refuse, with the same paths.
    let err = Policy::builder()
        .tool(
            ToolBuilder::new("t", Unit::Calls, 10.0, "1m")
                .tenant("A", TenantBuilder::new().floor(20.0)),
        )
        .build()
        .unwrap_err();
    assert_eq!(err.problems()[0].0, "tool[0].tenants");
}

#[test]
fn worked_example_allocation() {
    let p = Policy::from_toml_str(include_str!("../examples/web_search/policy.toml")).unwrap();
    let a = p.allocation();
    let rows: Vec<(String, f64, f64)> = a.tools[0]
        .tenants
        .iter()
        .map(|t| (t.name.clone(), t.share, t.ceiling))
        .collect();
    assert_eq!(
        rows,
        vec![
            ("A".into(), 228.0, 328.0),
            ("B".into(), 76.0, 136.0),
            ("C".into(), 38.0, 68.0),
            ("D".into(), 38.0, 68.0)
        ]
    );
}

#[test]
fn every_bad_field_is_named() {
    let cases: &[(&str, &str)] = &[
        ("[tool.tenants.A]\nweight = 0\n", "tool[0].tenants.A.weight"),
        ("[tool.tenants.A]\nweight = -2\n", "tool[0].tenants.A.weight"),
        ("[tool.tenants.A]\nfloor = nan\n", "tool[0].tenants.A.floor"),
        ("[tool.tenants.A]\nfloor = -1\n", "tool[0].tenants.A.floor"),
        ("[tool.tenants.A]\nfloor = 10\nceiling = 5\n", "tool[0].tenants.A.ceiling"),
        ("[tool.tenants.A]\nceiling = 500\n", "tool[0].tenants.A.ceiling"),
        ("[tool.tenants.A]\nburst = 0\n", "tool[0].tenants.A.burst"),
        ("[tool.tenants.A]\nmax_concurrency = 1.5\n", "tool[0].tenants.A.max_concurrency"),
        ("[tool.tenants.A]\nmax_tenants = 3\n", "tool[0].tenants.A.max_tenants"),
        ("[tool.default_tenant]\nfloor = 1\n", "tool[0].default_tenant.floor"),
        ("[tool.tenants.A]\nfloor = 60\n[tool.tenants.B]\nfloor = 50\n", "tool[0].tenants"),
        ("[tool.tenants.A]\nfloor = 10\n[tool.tenants.A.instances.x]\nfloor = 200\n", "tool[0].tenants.A.instances"),
        ("[tool.tenants.A]\nbudgets = [{ period = \"hour\", max = 0 }]\n", "tool[0].tenants.A.budgets[0].max"),
        ("[tool.tenants.A]\nbudgets = [{ period = \"hour\", max = 1 }, { period = \"hour\", max = 2 }]\n", "tool[0].tenants.A.budgets[1].period"),
        ("require_tenant = false\n", "tool[0].require_tenant"),
    ];
    for (body, path) in cases {
        let got = problems(&one_tool(body));
        assert!(
            got.iter().any(|(p, _)| p == path),
            "{body:?}: expected {path}, got {got:?}"
        );
    }
}

#[test]
fn syntax_errors_name_the_field() {
    for (text, path, words) in [
        ("[[tool]]\nname = \"t\"\nrate = { limit = 1, per = \"1m\" }\n", "tool[0]", "unit"),
        ("[[tool]]\nname = \"t\"\nunit = \"bytes\"\nrate = { limit = 1, per = \"1m\" }\n", "tool[0].unit", "calls"),
        ("[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 1, per = \"1m\" }\ncolour = 1\n", "tool[0]", "colour"),
        ("[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 1, per = \"1m\" }\nbudgets = [{ period = \"week\", max = 1 }]\n", "tool[0].budgets[0].period", "week"),
    ] {
        match Policy::from_toml_str(text) {
            Err(PolicyError::Syntax { path: p, message }) => {
                assert!(p.starts_with(path), "{text}: path {p}");
                assert!(message.contains(words), "{text}: {message}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
    let bad_period = problems(
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 1, per = \"fortnight\" }\n",
    );
    assert_eq!(bad_period[0].0, "tool[0].rate.per");
    assert!(bad_period[0].1.contains("e.g. \"1m\""));
    let dup = problems("[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 1, per = \"1m\" }\n[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 1, per = \"1m\" }\n");
    assert_eq!(dup[0].0, "tool[1].name");
    // In the words of the policy's author, not Rust's type names.
    for limit in ["\"600\"", "18446744073709551616"] {
        let text = format!("[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = {{ limit = {limit}, per = \"1m\" }}\n");
        match Policy::from_toml_str(&text) {
            Err(PolicyError::Syntax { path, message }) => {
                assert_eq!(path, "tool[0].rate.limit", "{message}");
                assert!(message.contains("expected a number"), "{message}");
                assert!(
                    !message.contains("f64") && !message.contains("i128"),
                    "{message}"
                );
            }
            other => panic!("{limit}: {other:?}"),
        }
    }
}

/// A policy file named `*.json` is read as JSON, and its syntax error says so (a TOML file
/// named so read "expected ident at line 1 column 4" and no more).
#[test]
fn a_json_named_file_says_it_was_read_as_json() {
    let file = std::env::temp_dir().join(format!("fairshare-policy-{}.json", std::process::id()));
    std::fs::write(&file, "[[tool]]\nname = \"t\"\n").unwrap();
    let e = Policy::from_path(&file).unwrap_err();
    std::fs::remove_file(&file).unwrap();
    assert!(e.to_string().contains("read as JSON"), "{e}");
}

#[test]
fn typed_problems() {
    match Policy::from_toml_str(&one_tool("[tool.tenants.A]\nfloor = 150\n")) {
        Err(PolicyError::Invalid(v)) => {
            assert_eq!(
                v[0].problem,
                Problem::FloorsExceedCapacity {
                    sum: 150.0,
                    capacity: 100.0
                }
            );
            assert!(v[0]
                .to_string()
                .contains("lower the floors or raise the capacity"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn warnings_are_returned_not_fatal() {
    let p = Policy::from_toml_str(&one_tool(
        "budgets = [{ period = \"month\", max = 1000 }]\n[tool.tenants.A]\nfloor = 80\nbudgets = [{ period = \"month\", max = 600 }]\n[tool.tenants.B]\nbudgets = [{ period = \"month\", max = 390 }]\n",
    ))
    .unwrap();
    let w: Vec<String> = p.warnings().iter().map(|w| w.to_string()).collect();
    assert!(
        w.iter().any(|w| w.contains("80 % of the capacity")),
        "{w:?}"
    );
    assert!(
        w.iter().any(|w| w.contains("leave 5-10 % unallocated")),
        "{w:?}"
    );
}

/// An empty (or truncated-to-nothing) policy would refuse every call: it is never valid, so a
/// reload can never put it in force.
#[test]
fn an_empty_policy_is_refused() {
    for text in ["", "\n\n# nothing here\n"] {
        let got = problems(text);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0, "tool");
        assert!(got[0].1.contains("no tool"), "{got:?}");
    }
    assert!(Policy::from_json_str("{}").is_err());
    assert!(Policy::from_json_str(r#"{"tool": []}"#).is_err());
    // Hot reload: the file is truncated; the policy in force stays.
    let path = std::env::temp_dir().join(format!("fairshare-empty-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        one_tool(
            "[tool.default_tenant]
",
        ),
    )
    .unwrap();
    let limiter = tower_fairshare::Limiter::new(Policy::from_path(&path).unwrap());
    std::fs::write(&path, "").unwrap();
    assert!(limiter.reload_from_path(&path).is_err());
    std::fs::remove_file(&path).unwrap();
    assert!(
        limiter.policy().tool("t").is_some(),
        "the policy in force stays"
    );
}

/// Every number the engine derives stays finite and in range: weights that would overflow
/// their sum, limits past what f64 keeps exact, a capacity below one unit per period, a burst
/// below one unit and periods over a year are refused with their path, and numbers print
/// readably.
#[test]
fn numbers_that_would_break_the_arithmetic_are_refused() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "[tool.tenants.a]\nweight = 1e308\n[tool.tenants.b]\nweight = 1e308\n",
            "tool[0].tenants.a.weight",
            "weight 1e308 is out of range",
        ),
        (
            "[tool.tenants.a]\nweight = 1e-9\n",
            "tool[0].tenants.a.weight",
            "out of range",
        ),
        (
            "[tool.tenants.a]\nceiling = 1e300\n",
            "tool[0].tenants.a.ceiling",
            "1e300 is more than",
        ),
        (
            "[tool.tenants.a]\nfloor = 1e20\n",
            "tool[0].tenants.a.floor",
            "more than the largest",
        ),
        (
            "[tool.tenants.a]\nburst = 0.5\n",
            "tool[0].tenants.a.burst",
            "less than one unit",
        ),
        ("burst = 0.25\n", "tool[0].burst", "less than one unit"),
        (
            "budgets = [{ period = \"day\", max = 1e300 }]\n",
            "tool[0].budgets[0].max",
            "more than the largest",
        ),
    ];
    for (body, path, words) in cases {
        let got = problems(&one_tool(body));
        assert!(
            got.iter().any(|(p, m)| p == path && m.contains(words)),
            "{body:?}: expected {path} with {words:?}, got {got:?}"
        );
    }
    let tiny = problems(
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 0.001, per = \"1d\" }\n[tool.default_tenant]\n",
    );
    assert_eq!(tiny[0].0, "tool[0].rate.limit");
    assert!(
        tiny[0].1.contains("less than one unit per period"),
        "{tiny:?}"
    );
    let huge = problems(
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 1e308, per = \"1m\" }\n[tool.default_tenant]\n",
    );
    assert_eq!(huge[0].0, "tool[0].rate.limit");
    assert!(huge[0].1.contains("1e308 is more than"), "{huge:?}");
    let long = problems(
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 10, per = \"400d\" }\n[tool.default_tenant]\n",
    );
    assert_eq!(long[0].0, "tool[0].rate.per");
    // At the edges of the ranges, everything the allocation shows is finite.
    let p = Policy::from_toml_str(
        "[[tool]]\nname = \"t\"\nunit = \"tokens\"\nrate = { limit = 1e15, per = \"366d\" }\n[tool.tenants.a]\nweight = 1e6\n[tool.tenants.b]\nweight = 1e-6\n[tool.default_tenant]\nweight = 1e6\nmax_tenants = 4294967295\n",
    )
    .unwrap();
    for t in &p.allocation().tools[0].tenants {
        for x in [t.share, t.ceiling, t.burst, t.floor] {
            assert!(x.is_finite() && x >= 0.0, "{t:?}");
        }
    }
}

/// Names: a blank name (only whitespace) is refused like an empty one, for tools, tenants and
/// instances.
#[test]
fn blank_names_are_refused() {
    let got = problems(
        "[[tool]]\nname = \"  \"\nunit = \"calls\"\nrate = { limit = 10, per = \"1m\" }\n[tool.tenants.\" \"]\n[tool.tenants.a.instances.\"\t\"]\n",
    );
    let paths: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
    assert!(paths.contains(&"tool[0].name"), "{got:?}");
    assert!(paths.contains(&"tool[0].tenants. "), "{got:?}");
    assert!(paths.contains(&"tool[0].tenants.a.instances.\t"), "{got:?}");
}

/// A budget smaller than what the floor guarantees over its window is allowed, with a warning
/// naming it: once the budget is spent, calls within the floor are refused.
#[test]
fn a_budget_below_the_floor_is_warned() {
    let p = Policy::from_toml_str(&one_tool(
        "[tool.tenants.A]\nfloor = 10\nbudgets = [{ period = \"hour\", max = 300 }, { period = \"day\", max = 100000 }]\n",
    ))
    .unwrap();
    let w: Vec<String> = p.warnings().iter().map(|w| w.to_string()).collect();
    let hourly: Vec<&String> = w.iter().filter(|w| w.contains("budgets[")).collect();
    assert_eq!(hourly.len(), 1, "{w:?}");
    assert!(
        hourly[0].starts_with("tool[0].tenants.A.budgets[0].max: budget 300 per hour is below what the floor guarantees (10 per 1m is 600 per hour)"),
        "{w:?}"
    );
}

/// A dotted key nested past the TOML parser's limit is refused with the line it is on (the
/// parser itself gives none).
#[test]
fn a_key_nested_too_deep_is_located() {
    let text = format!("{}{} = 1\n", one_tool(""), "a.".repeat(200) + "b");
    match Policy::from_toml_str(&text) {
        Err(PolicyError::Syntax { message, .. }) => {
            assert!(
                message.starts_with("line 5: a key of 201 dotted parts"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// Loading is linear in the number of names: 200,000 tenants load (and duplicates are still
/// found) in well under the time a per-name scan of every earlier name takes (it took minutes
/// for 178,000). The bound here is a generous guard against that, not a speed target.
#[test]
fn a_policy_with_200k_tenants_loads_in_linear_time() {
    let mut text = one_tool("");
    text = text.replace("limit = 100,", "limit = 1000000,");
    for i in 0..200_000 {
        text.push_str(&format!(
            "[tool.tenants.tenant-{i}]\nweight = {}\n",
            1 + i % 7
        ));
    }
    let started = std::time::Instant::now();
    let p = Policy::from_toml_str(&text).unwrap();
    let took = started.elapsed();
    assert_eq!(p.tool("t").unwrap().tenants().len(), 200_000);
    assert!(took < std::time::Duration::from_secs(60), "took {took:?}");
    text.push_str("[tool.tenants.tenant-7]\n");
    let dup = problems(&text);
    assert!(dup[0].1.contains("duplicate"), "{dup:?}");
}

/// `default_ceiling = "capacity"`: callers without a ceiling of their own may take everything
/// not reserved for others, so a tenant alone gets the whole tool but the others' floors — and
/// nothing else changes (explicit ceilings, floors).
#[test]
fn a_work_conserving_tool_lends_all_its_idle_capacity() {
    let text = |mode: &str| {
        format!(
            "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = {{ limit = 600, per = \"1m\" }}\n{mode}\n\
             [tool.tenants.A]\nweight = 6\nfloor = 100\n\
             [tool.tenants.B]\nweight = 2\nfloor = 60\n[tool.tenants.B.instances.x]\nfloor = 10\n[tool.tenants.B.instances.y]\n\
             [tool.tenants.C]\nfloor = 30\nceiling = 50\n"
        )
    };
    let open = Policy::from_toml_str(&text("default_ceiling = \"capacity\"")).unwrap();
    let nominal = Policy::from_toml_str(&text("default_ceiling = \"nominal\"")).unwrap();
    let unset = Policy::from_toml_str(&text("")).unwrap();
    let a = |p: &Policy| p.allocation().tools[0].tenants[0].clone();
    let b = |p: &Policy| p.allocation().tools[0].tenants[1].clone();
    let c = |p: &Policy| p.allocation().tools[0].tenants[2].clone();
    // Spare 600 - 190 = 410: A may take 100 + 410, B 60 + 410 (its instances x 10 + 460, y 460).
    assert_eq!(a(&open).ceiling, 510.0);
    assert_eq!(b(&open).ceiling, 470.0);
    assert_eq!(b(&open).instances[0].ceiling, 470.0);
    assert_eq!(b(&open).instances[1].ceiling, 460.0);
    assert_eq!(c(&open).ceiling, 50.0, "an explicit ceiling stays");
    assert_eq!(a(&nominal).ceiling, a(&unset).ceiling);
    assert_eq!(a(&unset).ceiling, a(&unset).floor + a(&unset).share);
    let e = Policy::from_toml_str(&text("default_ceiling = \"everything\"")).unwrap_err();
    assert!(e.to_string().contains("default_ceiling"), "{e}");

    // A alone, offering twice the capacity: it gets the whole tool but the others' floors
    // (less the others' share banks, which are never lent), far above its nominal 373.
    let admitted = |p: Policy| {
        let epoch = tower_fairshare::Timestamp(1_767_225_600_000_000); // 2026-01-01T00:00:00Z
        let clock = ManualClock::new(epoch);
        let l = Limiter::with_store(p, MemoryStore::new(), clock.clone());
        let caller = Caller::new("A");
        let start = epoch.as_micros();
        let mut in_third_minute = 0;
        for k in 0..3 * 1200u64 {
            clock.set(Timestamp(start + k * 50_000));
            let ok = matches!(l.try_admit(&caller, "t", Cost(1.0)), Some(Ok(_)));
            if ok && k >= 2 * 1200 {
                in_third_minute += 1;
            }
        }
        in_third_minute
    };
    let open_got = admitted(open);
    let nominal_got = admitted(unset);
    assert!(
        (495..=510).contains(&open_got),
        "work-conserving: {open_got} of 510"
    );
    assert!(nominal_got <= 380, "nominal: {nominal_got}");
}

/// A field of one kind of level written in another is named with where it belongs, every
/// one of them, instead of the first stopping the parse.
#[test]
fn fields_of_another_level_are_named_with_where_they_belong() {
    let err = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "t"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.tenants.a]
        max_instances = 5
        [tool.tenants.a.instances.x]
        max_tenants = 3
        [tool.tenants.a.instances.x.instances.y]
        [tool.tenants.a.default_instance]
        default_instance = {}
        "#,
    )
    .unwrap_err();
    let mut problems = err.problems();
    problems.sort();
    assert_eq!(
        problems,
        [
            (
                "tool[0].tenants.a.default_instance.default_instance".to_string(),
                "`default_instance` is only valid in `a tenant`".to_string()
            ),
            (
                "tool[0].tenants.a.instances.x.instances".into(),
                "`instances` is only valid in `a tenant`".into()
            ),
            (
                "tool[0].tenants.a.instances.x.max_tenants".into(),
                "`max_tenants` is only valid in `default_tenant or a plan`".into()
            ),
            (
                "tool[0].tenants.a.max_instances".into(),
                "`max_instances` is only valid in `default_instance`".into()
            ),
        ]
    );
}
