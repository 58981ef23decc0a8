//! Where an exact decision's time goes, part by part, against the chained governors.
//!
//! `cargo bench --features quanta --bench parts`
//!
//! One process times, in turn and round after round, five loops of one caller (a tenant and
//! an instance, the policy of `decision/fairshare 1 caller` in `benches/compare.rs`): three
//! keyed governors chained; the crate's decision (`Limiter::admit` on the in-process store);
//! the same decision on a store that keeps the caller's plain states under one lock, written
//! from the public engine API; the engine alone (`engine::decide` on a snapshot of the
//! levels' states, with the snapshot's copy and a clock read); and the clock alone. It prints
//! each loop's median and fastest round, in ns per call, and the ratios to the chained
//! governors. The rounds alternate so that the host's drifts fall on every part alike: on a
//! shared machine the medians repeat within a few per cent, where separate processes differ
//! by ten or more. `FS_ROUNDS` (default 9) and `FS_CALLS` (calls per loop and round, default
//! 1,000,000) change the run's length.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use governor::{Quota, RateLimiter};
use tower_fairshare::admission::engine::{self, LevelRef, Plan, Snapshot};
use tower_fairshare::store::{Admission, Admissions, Answer, CallKeys, Decision, Stored};
use tower_fairshare::{Clock, Cost, Limiter, Policy, Store, SystemClock, Timestamp};

#[path = "common/mod.rs"]
mod common;
use common::now;

/// A store as small as the engine allows for one caller: the levels' states in one snapshot
/// under one lock, decided on a copy and written back when admitted.
struct Plain(Mutex<Snapshot>);

impl Store for Plain {
    fn decide(&self, plans: &[Plan<'_>]) -> Answer<Decision> {
        let mut held = self.0.lock().expect("not poisoned");
        let mut snap = held.clone();
        Answer::Now(Ok(match engine::decide(&plans[0], &mut snap) {
            Ok(a) => {
                *held = snap;
                Decision::Admitted(Admissions::one(a.admission))
            }
            Err(r) => Decision::Refused(r),
        }))
    }
    fn adjust(&self, _: &Arc<Admission>, _: f64, _: Timestamp) -> Answer<()> {
        Answer::Now(Ok(()))
    }
    fn release(&self, _: &Arc<Admission>) -> Answer<()> {
        Answer::Now(Ok(()))
    }
    fn inspect(&self, _: &CallKeys) -> Answer<Stored> {
        Answer::Now(Ok(Stored::default()))
    }
}

/// ns per call of `f` over `n` calls; every call must succeed.
fn time(n: u64, mut f: impl FnMut() -> bool) -> f64 {
    let start = Instant::now();
    let ok = (0..n).filter(|_| f()).count() as u64;
    let ns = start.elapsed().as_nanos() as f64 / n as f64;
    assert_eq!(ok, n, "every call is admitted");
    ns
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `cargo test --benches` runs each bench once: a short run there.
    let quick = std::env::args().any(|a| a == "--test");
    let rounds = env("FS_ROUNDS", if quick { 1 } else { 9 }) as usize;
    let n = env("FS_CALLS", if quick { 1_000 } else { 1_000_000 });
    let policy = Policy::from_toml_str(common::POLICY).expect("the bench policy is valid");
    let caller = &common::callers("tenant", 1)[0];
    let memory = Limiter::new(policy.clone());
    let plain = Limiter::with_store(
        policy.clone(),
        Plain(Mutex::new(Snapshot::default())),
        SystemClock,
    );
    let tool = policy.tool("search").expect("the bench tool");
    let tenant_policy = tool.default_tenant().expect("a tenant template");
    let instance_policy = tenant_policy
        .default_instance()
        .expect("an instance template");
    let names: (Arc<str>, Arc<str>) = (
        caller.tenant().expect("a tenant").into(),
        caller.instance().expect("an instance").into(),
    );
    let mut snap = Snapshot::default();
    let quota = Quota::per_second(NonZeroU32::new(1_000_000_000).expect("not zero"));
    let chained = (
        RateLimiter::keyed(quota),
        RateLimiter::keyed(quota),
        RateLimiter::keyed(quota),
    );
    let keys = (
        "search".to_owned(),
        names.0.to_string(),
        (names.0.to_string(), names.1.to_string()),
    );
    let parts = [
        "three keyed governors chained",
        "Limiter::admit, in-process store",
        "Limiter::admit, plain states under one lock",
        "engine::decide on a snapshot (with its copy and a clock read)",
        "the clock (SystemClock::now)",
    ];
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); parts.len()];
    for _ in 0..rounds {
        ns[0].push(time(n, || {
            chained.0.check_key(black_box(&keys.0)).is_ok()
                && chained.1.check_key(&keys.1).is_ok()
                && chained.2.check_key(&keys.2).is_ok()
        }));
        ns[1].push(time(n, || {
            now(memory.admit(black_box(caller), "search", Cost(1.0))).is_ok()
        }));
        ns[2].push(time(n, || {
            now(plain.admit(black_box(caller), "search", Cost(1.0))).is_ok()
        }));
        ns[3].push(time(n, || {
            let plan = Plan {
                now: SystemClock.now(),
                cost: 1.0,
                tool,
                tenant: LevelRef {
                    name: &names.0,
                    policy: tenant_policy,
                },
                instance: Some(LevelRef {
                    name: &names.1,
                    policy: instance_policy,
                }),
                untenanted: false,
            };
            let mut next = snap.clone();
            let admitted = engine::decide(black_box(&plan), &mut next).is_ok();
            snap = next;
            admitted
        }));
        ns[4].push(time(n, || SystemClock.now().as_micros() > 0));
    }
    print_table(&parts, &mut ns, rounds, n);
}

/// Each part's median and fastest round, and its median over the chained governors' (the
/// first part).
fn print_table(parts: &[&str], ns: &mut [Vec<f64>], rounds: usize, n: u64) {
    let medians: Vec<(f64, f64)> = ns
        .iter_mut()
        .map(|v| {
            v.sort_by(f64::total_cmp);
            (v[v.len() / 2], v[0])
        })
        .collect();
    println!("| part ({rounds} rounds of {n} calls) | median ns | fastest round | / chained |");
    println!("|---|---|---|---|");
    for (part, (median, fastest)) in parts.iter().zip(&medians) {
        let ratio = median / medians[0].0;
        println!("| {part} | {median:.1} | {fastest:.1} | {ratio:.2}x |");
    }
}
