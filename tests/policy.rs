//! Policy loading and validation: strict, every error with its exact path.

use tower_fairshare::policy::Problem;
use tower_fairshare::{
    BudgetPeriod, InstanceBuilder, Policy, PolicyError, TenantBuilder, ToolBuilder, Unit,
};

const SPEC_EXAMPLE: &str = r#"
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
    let p = Policy::from_toml_str(SPEC_EXAMPLE).unwrap();
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
    let loaded = Policy::from_toml_str(SPEC_EXAMPLE).unwrap();
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
fn seed_000_allocation() {
    let p = Policy::from_toml_str(include_str!("../examples/seed000/policy.toml")).unwrap();
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
