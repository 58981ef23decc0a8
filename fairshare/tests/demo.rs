//! `fairshare demo`: the acceptance test over real loopback HTTP, run as a user would.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn demo_holds_every_property() {
    let started = Instant::now();
    let chart = std::env::temp_dir().join(format!("fairshare-demo-{}.svg", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_fairshare"))
        .args(["demo", "--duration", "10s", "--svg"])
        .arg(&chart)
        .output()
        .expect("fairshare demo runs");
    let took = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("every property held"), "{stdout}");
    let svg = std::fs::read_to_string(&chart).expect("--svg writes the chart");
    let _ = std::fs::remove_file(&chart);
    assert!(
        svg.starts_with("<svg") && svg.contains("heavy/crawler"),
        "{svg}"
    );
    for property in [
        "transport:",
        "floors:",
        "borrowing:",
        "capacity:",
        "runaway:",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.contains(property))
            .unwrap_or_else(|| panic!("no `{property}` line in\n{stdout}"));
        assert!(line.trim_start().starts_with("held"), "{line}");
    }
    // A progress line a second, then the per-caller table.
    let progress = stdout
        .lines()
        .filter(|l| l.contains("admitted/refused"))
        .count();
    assert_eq!(progress, 10, "{stdout}");
    for caller in [
        "heavy/crawler",
        "quiet/assistant",
        "agents/interactive",
        "agents/batch",
    ] {
        assert!(
            stdout.lines().any(|l| l.trim_start().starts_with(caller)),
            "{stdout}"
        );
    }
    // Ten seconds of load, at most one window (5 s) of waiting for the limiter's next window.
    assert!(took < Duration::from_secs(30), "took {took:?}");
}
