//! Tenants on three plans (their own weights and floors), dozens on each, all offering three
//! times their share: from the second minute each gets its plan's nominal share within ±2 %,
//! computed here from the policy's numbers — its floor plus the spare split by weight over
//! every active tenant, each at its plan's weight. Through the real layer over a virtual
//! clock, with and without leases.

use fairshare::simulate::{simulate, Report, Scenario, ScenarioCaller};
use tower_fairshare::Policy;

const CAPACITY: f64 = 60_000.0;
/// (plan, weight, floor, max_tenants, tenants calling).
const PLANS: [(&str, f64, f64, u64, usize); 3] = [
    ("free", 1.0, 0.0, 200, 40),
    ("pro", 3.0, 100.0, 60, 30),
    ("team", 8.0, 500.0, 20, 20),
];

fn policy(leased: bool) -> Policy {
    let mut toml = format!(
        "[[tool]]\nname = \"generate_report\"\nunit = \"calls\"\nrate = {{ limit = {CAPACITY}, per = \"1m\" }}\n"
    );
    if leased {
        toml += "lease = { max = 64 }\n";
    }
    for (plan, weight, floor, max, _) in PLANS {
        toml += &format!(
            "[tool.plans.{plan}]\nweight = {weight}\nfloor = {floor}\nmax_tenants = {max}\n"
        );
    }
    Policy::from_toml_str(&toml).unwrap()
}

/// What a tenant of plan `p` is owed a minute with every tenant of the scenario active.
fn nominal(p: usize) -> f64 {
    let reserved: f64 = PLANS.iter().map(|p| p.2 * p.3 as f64).sum();
    let weights: f64 = PLANS.iter().map(|p| p.1 * p.4 as f64).sum();
    PLANS[p].2 + (CAPACITY - reserved) * PLANS[p].1 / weights
}

fn scenario() -> Scenario {
    let mut callers = Vec::new();
    for (p, &(plan, _, _, _, n)) in PLANS.iter().enumerate() {
        for i in 0..n {
            callers.push(ScenarioCaller {
                tenant: Some(format!("{plan}-{i:02}")),
                instance: None,
                tier: None,
                plan: Some(plan.into()),
                rate: 3.0 * nominal(p),
                per: "1m".into(),
                start: None,
                stop: None,
                cost: None,
            });
        }
    }
    Scenario {
        tool: "generate_report".into(),
        duration: "4m".into(),
        callers,
    }
}

/// From the second minute, every tenant within ±2 % of its plan's nominal share; prints each
/// plan's least and most, as a share of what it is owed.
fn check(report: &Report, label: &str) {
    for (k, period) in report.periods.iter().enumerate().skip(1) {
        for (p, &(plan, ..)) in PLANS.iter().enumerate() {
            let owed = nominal(p);
            let got: Vec<f64> = period
                .callers
                .iter()
                .filter(|r| r.tenant.as_deref().is_some_and(|t| t.starts_with(plan)))
                .map(|r| r.admitted as f64 / owed)
                .collect();
            assert_eq!(got.len(), PLANS[p].4);
            let (lo, hi) = got
                .iter()
                .fold((f64::MAX, f64::MIN), |(lo, hi), &g| (lo.min(g), hi.max(g)));
            println!(
                "{label} minute {}: plan {plan} owed {owed:.1}, got {lo:.4}-{hi:.4} of it",
                k + 1
            );
            assert!(
                (lo - 1.0).abs() <= 0.02 && (hi - 1.0).abs() <= 0.02,
                "{label} minute {}: a tenant of plan {plan} got {lo:.4}-{hi:.4} of its share",
                k + 1
            );
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn each_tenant_gets_its_plans_share_from_the_second_minute() {
    let report = simulate(&policy(false), &scenario()).await.unwrap();
    check(&report, "unleased");
}

#[tokio::test(flavor = "current_thread")]
async fn the_same_with_leases() {
    let report = simulate(&policy(true), &scenario()).await.unwrap();
    check(&report, "leased");
}
