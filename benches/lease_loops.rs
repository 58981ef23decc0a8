//! Two loops that criterion's medians blur on a noisy host, for `docs/performance.md`:
//!
//! - `alternate`: 200,000-call chunks of governor's keyed `check_key`, of a leased decision
//!   (`lease = { max = 64 }`, one caller) and of an exact decision (the same tool without a
//!   lease, `search`) in turn, each chunk's ratios printed: when the host's speed changes, every side of
//!   one round sees the same host.
//! - `threads`: one thread, then two threads started together on a barrier, each cycling over
//!   64 callers of its own leasing tenants for a million calls; the throughput gain per round and
//!   its median.
//!
//! `cargo bench --features quanta --bench lease_loops [-- alternate|threads [ROUNDS]]`
//! (both by default). Not a criterion bench: wall time over fixed call counts.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Instant;

use tower_fairshare::{Caller, Cost, Limiter, MemoryStore, SystemClock};

#[path = "common/mod.rs"]
mod common;
use common::{callers, limiter, now};

/// Nanoseconds a call over `calls` calls of `f`.
fn per_call(calls: usize, mut f: impl FnMut(usize)) -> f64 {
    let start = Instant::now();
    for k in 0..calls {
        f(k);
    }
    start.elapsed().as_nanos() as f64 / calls as f64
}

fn alternate(rounds: usize) {
    const CHUNK: usize = 200_000;
    let gov = governor::RateLimiter::keyed(governor::Quota::per_second(
        NonZeroU32::new(1_000_000_000).expect("non-zero"),
    ));
    let l = limiter();
    let who = Caller::new("tenant").with_instance("agent");
    println!("alternate: governor ns, leased ns (ratio), exact ns (ratio), {CHUNK} calls each");
    let (mut ratios, mut exact) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let g = per_call(CHUNK, |_| {
            black_box(gov.check_key(black_box(&0u64)).is_ok());
        });
        let f = per_call(CHUNK, |_| {
            black_box(now(l.admit(black_box(&who), "leased", Cost(1.0))).is_ok());
        });
        let e = per_call(CHUNK, |_| {
            black_box(now(l.admit(black_box(&who), "search", Cost(1.0))).is_ok());
        });
        println!("  {g:6.1}, {f:6.1} ({:.2}), {e:6.1} ({:.2})", f / g, e / g);
        ratios.push(f / g);
        exact.push(e / g);
    }
    println!(
        "  median leased {:.2}, exact {:.2}",
        median(&mut ratios),
        median(&mut exact)
    );
}

fn threads(rounds: usize) {
    const CALLS: usize = 1_000_000;
    let run = |l: &Limiter<MemoryStore, SystemClock>, threads: usize| {
        let who: Vec<Vec<Caller>> = (0..threads)
            .map(|t| callers(&format!("t{t}-"), 64))
            .collect();
        let barrier = std::sync::Barrier::new(threads + 1);
        std::thread::scope(|s| {
            for mine in &who {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    for k in 0..CALLS / threads {
                        let caller = &mine[k % mine.len()];
                        black_box(now(l.admit(caller, "leased", Cost(1.0))).is_ok());
                    }
                });
            }
            barrier.wait();
            let start = Instant::now();
            // The scope ends when both threads have made their calls.
            start
        })
        .elapsed()
        .as_nanos() as f64
            / CALLS as f64
    };
    println!("threads: 1 thread ns / 2 threads ns = gain, {CALLS} calls over 64 callers a thread");
    let mut gains = Vec::new();
    for _ in 0..rounds {
        let l = limiter();
        run(&l, 1); // warm: every caller's lease made
        let one = run(&l, 1);
        let two = run(&l, 2);
        println!("  {one:6.1} / {two:6.1} = {:.2}", one / two);
        gains.push(one / two);
    }
    println!("  median {:.2}", median(&mut gains));
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let rounds = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(12);
    match args.first().map(String::as_str) {
        Some("alternate") => alternate(rounds),
        Some("threads") => threads(rounds),
        _ => {
            alternate(rounds);
            threads(rounds);
        }
    }
}
