//! `fairshare`: check a policy, simulate load against it.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tower_fairshare::simulate::{simulate, Scenario};
use tower_fairshare::Policy;

#[derive(Parser)]
#[command(
    name = "fairshare",
    version,
    about = "Fair-share rate limiting: check policies, simulate load"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a policy and print each tool's allocation table.
    Check {
        /// The policy file (TOML, or JSON when it ends in .json).
        policy: PathBuf,
    },
    /// Run a load scenario against a policy over a virtual clock.
    Simulate {
        /// The policy file.
        #[arg(long)]
        policy: PathBuf,
        /// The scenario file (TOML).
        #[arg(long)]
        scenario: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { policy } => check(&policy),
        Command::Simulate {
            policy,
            scenario,
            json,
        } => run_simulation(&policy, &scenario, json),
    }
}

fn load(path: &PathBuf) -> Result<Policy, ExitCode> {
    Policy::from_path(path).map_err(|e| {
        eprintln!("error: {} is not a valid policy:", path.display());
        for (p, m) in e.problems() {
            if p.is_empty() {
                eprintln!("  {m}");
            } else {
                eprintln!("  {p}: {m}");
            }
        }
        ExitCode::from(1)
    })
}

fn num(x: f64) -> String {
    if (x - x.round()).abs() < 1e-6 {
        format!("{}", x.round() as i64)
    } else {
        format!("{x:.1}")
    }
}

fn check(path: &PathBuf) -> ExitCode {
    let policy = match load(path) {
        Ok(p) => p,
        Err(code) => return code,
    };
    for w in policy.warnings() {
        println!("warning: {w}");
    }
    for t in policy.allocation().tools {
        println!(
            "tool {}: {} {} per {}, burst {}, spare {} split by weight{}",
            t.name,
            num(t.capacity),
            t.unit,
            t.period,
            num(t.burst),
            num(t.spare),
            budgets(&t.budgets)
        );
        println!(
            "  {:<28} {:>8} {:>8} {:>8} {:>8} {:>8}  budgets",
            "tenant / instance", "floor", "weight", "share", "ceiling", "burst"
        );
        for r in &t.tenants {
            let name = if r.name == "*" {
                "(default tenant)".to_owned()
            } else {
                r.name.clone()
            };
            println!(
                "  {:<28} {:>8} {:>8} {:>8} {:>8} {:>8} {}",
                name,
                num(r.floor),
                num(r.weight),
                num(r.share),
                num(r.ceiling),
                num(r.burst),
                budgets(&r.budgets)
            );
            for i in &r.instances {
                let name = if i.name == "*" {
                    "(default instance)".to_owned()
                } else {
                    i.name.clone()
                };
                println!(
                    "    {:<26} {:>8} {:>8} {:>8} {:>8} {:>8} {}",
                    name,
                    num(i.floor),
                    num(i.weight),
                    num(i.share),
                    num(i.ceiling),
                    num(i.burst),
                    budgets(&i.budgets)
                );
            }
        }
    }
    println!("ok: {} is valid", path.display());
    ExitCode::SUCCESS
}

fn budgets(b: &[(String, f64)]) -> String {
    if b.is_empty() {
        String::new()
    } else {
        let parts: Vec<String> = b.iter().map(|(p, m)| format!("{}/{p}", num(*m))).collect();
        format!(" {}", parts.join(", "))
    }
}

fn run_simulation(policy_path: &PathBuf, scenario_path: &PathBuf, json: bool) -> ExitCode {
    let policy = match load(policy_path) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let scenario = match Scenario::from_path(scenario_path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a single-threaded runtime");
    let report = match rt.block_on(simulate(&policy, &scenario)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    if json {
        println!(
            "{}",
            serde_json::to_string(&report).expect("report serializes")
        );
    } else {
        let tool = policy.tool(&scenario.tool).expect("checked by simulate");
        print!("{}", report.to_table(tool.capacity(), tool.period()));
    }
    ExitCode::SUCCESS
}
