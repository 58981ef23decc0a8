//! ns per admission decision in memory: tool + tenant + instance + one budget.
//!
//! `cargo bench --bench admission`
//!
//! With `FS_DECISIONS=N` it makes N decisions of one caller and exits, for instruction counts:
//! `valgrind --tool=callgrind` at N and 2N, the difference divided by N is one decision's
//! marginal cost (`scripts/callgrind-decision` does this).

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use tower_fairshare::{Caller, Cost, Limiter, MemoryStore, Policy, SystemClock};

const POLICY: &str = r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 1000000000000, per = "1s" }
[tool.default_tenant]
max_tenants = 100000
budgets = [{ period = "day", max = 1e15 }]
[tool.default_tenant.default_instance]
max_instances = 100

# As "search", leasing: `FS_TOOL=leased` counts a decision spent from a lease.
[[tool]]
name = "leased"
unit = "calls"
rate = { limit = 1000000000000, per = "1s" }
lease = { max = 64 }
[tool.default_tenant]
max_tenants = 100000
budgets = [{ period = "day", max = 1e15 }]
[tool.default_tenant.default_instance]
max_instances = 100
"#;

/// The in-memory store answers at once: poll the decision once, no runtime needed.
fn now<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the memory store never waits"),
    }
}

fn limiter() -> Limiter<MemoryStore, SystemClock> {
    Limiter::new(Policy::from_toml_str(POLICY).unwrap())
}

fn callers(prefix: &str, n: usize) -> Vec<Caller> {
    (0..n)
        .map(|i| Caller::new(format!("{prefix}{i}")).with_instance("agent"))
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    g.measurement_time(Duration::from_secs(3));

    let l = limiter();
    let one = callers("tenant", 1);
    g.bench_function("1 caller", |b| {
        b.iter(|| now(l.admit(&one[0], "search", Cost(1.0))).is_ok())
    });

    let l = limiter();
    let many = callers("tenant", 10_000);
    for c in &many {
        now(l.admit(c, "search", Cost(1.0))).unwrap();
    }
    let mut i = 0;
    g.bench_function("10000 callers", |b| {
        b.iter(|| {
            i = (i + 1) % many.len();
            now(l.admit(&many[i], "search", Cost(1.0))).is_ok()
        })
    });

    for (name, shared) in [
        ("2 threads, distinct tenants", false),
        ("2 threads, shared tenant", true),
    ] {
        let l = Arc::new(limiter());
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let per_thread = iters.div_ceil(2);
                let start = Instant::now();
                std::thread::scope(|s| {
                    for t in 0..2 {
                        let l = l.clone();
                        let who = if shared {
                            callers("shared", 1)
                        } else {
                            callers(&format!("t{t}-"), 64)
                        };
                        s.spawn(move || {
                            for k in 0..per_thread as usize {
                                let _ = now(l.admit(&who[k % who.len()], "search", Cost(1.0)));
                            }
                        });
                    }
                });
                // Wall time of all the decisions (split between the threads): criterion divides
                // by `iters`, which gives wall time per decision; lower is more throughput.
                start.elapsed()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);

fn main() {
    if let Some(n) = std::env::var("FS_DECISIONS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        let tool = std::env::var("FS_TOOL").unwrap_or_else(|_| "search".to_owned());
        let l = limiter();
        let one = callers("tenant", 1);
        let mut admitted = 0u64;
        for _ in 0..n {
            admitted += u64::from(now(l.admit(&one[0], &tool, Cost(1.0))).is_ok());
        }
        assert_eq!(admitted, n);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
