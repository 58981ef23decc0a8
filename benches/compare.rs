//! tower-fairshare against its anchors, in one run on one machine: governor's keyed
//! `check_key`, a bare tower service, `ConcurrencyLimitLayer` and tower_governor. The targets
//! are ratios (see `docs/performance.md`); `scripts/bench-compare` runs this bench and prints
//! them.
//!
//! `cargo bench --bench compare` (quick: `-- --warm-up-time 1 --measurement-time 2`)
//!
//! Criterion ids (the script reads `target/criterion/<group>/<id>/new/estimates.json`):
//!
//! - `decision/governor *` and `decision/fairshare *`: one decision in memory. Threaded cases
//!   report wall time per decision across all threads, so lower is more throughput and
//!   `1 thread / 2 threads` is the throughput gain.
//! - `layer/*`: `ready().call()` of a prepared request through each stack, response dropped; the
//!   added cost of a layer is its time minus `layer/bare`.
//!
//! After criterion, a counting allocator measures the bytes of state the in-memory store keeps
//! per tracked caller and writes `target/criterion/compare-memory.json`. Set
//! `COMPARE_MEMORY_CALLERS` to change the number of callers (default 1,000,000);
//! `COMPARE_MEMORY_CALLERS=0` skips it.
//!
//! With `--features redis` and `COMPARE_REDIS_URL` set (it runs `FLUSHALL` there: give it a
//! Redis of its own, as `scripts/bench-compare` does), it also drives `RedisStore` and a one-key
//! GCRA script at 1, 16 and 64 calls in flight for `COMPARE_REDIS_SECS` (default 3) each,
//! with per-task progress and the worst latency, counts the Redis commands a refused
//! caller's flood costs, and writes `target/criterion/compare-redis.json`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::convert::Infallible;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BatchSize, Criterion};
use governor::{Quota, RateLimiter};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tonic::body::Body;
use tower::limit::ConcurrencyLimitLayer;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_fairshare::{Caller, Cost, FairShareLayer, SystemClock};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::GlobalKeyExtractor;
use tower_governor::GovernorLayer;

// ---------------------------------------------------------------------------------------------
// Counting allocator: live bytes, counted only while `COUNTING` is on so the timed benches pay
// one relaxed load per allocation and nothing else.

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);

fn count(delta: isize) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_add(delta, Ordering::Relaxed);
    }
}

// SAFETY: every call forwards to `System` with the caller's own arguments; the counters are
// plain atomics and never touch the allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[path = "common/mod.rs"]
mod common;
#[path = "sketch/mod.rs"]
mod sketch;
use common::{callers, generous_quota, limiter, now, saturated, Chained};

/// Runs `iters` calls of `f(thread, k)` split over `threads` scoped threads and returns the
/// wall time of all of them: criterion divides by `iters`, so the figure is wall time per call,
/// and two threads that do not contend take half the time of one.
fn threaded(iters: u64, threads: u64, f: impl Fn(usize, usize) + Sync) -> Duration {
    let per_thread = iters.div_ceil(threads) as usize;
    let f = &f;
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads as usize {
            s.spawn(move || {
                for k in 0..per_thread {
                    f(t, k);
                }
            });
        }
    });
    // Not divided by `threads`: the calls are already split between them.
    start.elapsed()
}

// ---------------------------------------------------------------------------------------------
// 1. One decision in memory.

/// A group of benches timed on the wall clock.
type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

fn decisions(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    let quota = generous_quota();
    governor_decisions(&mut g, quota);
    chained_decisions(&mut g, quota);
    fairshare_decisions(&mut g);
    fairshare_threaded(&mut g);
    g.finish();
}

/// governor's keyed limiter: one key, 10,000 keys, and on threads.
fn governor_decisions(g: &mut Group<'_>, quota: Quota) {
    let gov = RateLimiter::keyed(quota);
    g.bench_function("governor 1 key", |b| {
        b.iter(|| gov.check_key(black_box(&0u64)).is_ok())
    });

    let gov = RateLimiter::keyed(quota);
    for k in 0..10_000u64 {
        let _ = gov.check_key(&k);
    }
    let mut i = 0u64;
    g.bench_function("governor 10000 keys", |b| {
        b.iter(|| {
            i = (i + 1) % 10_000;
            gov.check_key(black_box(&i)).is_ok()
        })
    });

    // Threaded: (name, threads, keys per thread, shared key space).
    for (name, threads, keys, shared) in [
        ("governor 1 thread", 1, 1, false),
        ("governor 2 threads one key each", 2, 1, false),
        ("governor 2 threads same key", 2, 1, true),
        ("governor 1 thread 5000 keys", 1, 5_000, false),
        ("governor 2 threads disjoint 5000 keys", 2, 5_000, false),
    ] {
        let gov = RateLimiter::keyed(quota);
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                threaded(iters, threads, |t, k| {
                    let owner = if shared { 0 } else { t as u64 };
                    let key = owner * 1_000_000 + (k as u64 % keys);
                    let _ = black_box(gov.check_key(&key));
                })
            })
        });
    }
}

/// What a user composes instead of a nested limiter: three keyed governors, one per level
/// (the tool, the tenant, the tenant and instance), string keys held by the caller.
fn chained_decisions(g: &mut Group<'_>, quota: Quota) {
    let chained = Chained::new(quota);
    let keys = Chained::keys(&callers("tenant", 1));
    g.bench_function("chained governors 1 caller", |b| {
        b.iter(|| chained.check(black_box(&keys[0])))
    });
    let chained = Chained::new(quota);
    let keys = Chained::keys(&callers("tenant", 10_000));
    for k in &keys {
        chained.check(k);
    }
    let mut i = 0;
    g.bench_function("chained governors 10000 callers", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            chained.check(black_box(&keys[i]))
        })
    });
    // The saturated case's 120 callers, in turn (governor admits them all).
    let chained = Chained::new(quota);
    let keys = Chained::keys(&saturated().1);
    let mut i = 0;
    g.bench_function("chained governors 120 callers", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            chained.check(black_box(&keys[i]))
        })
    });
}

/// The crate's decisions: exact, over 10,000 callers, saturated, leased, two tools.
fn fairshare_decisions(g: &mut Group<'_>) {
    let l = limiter();
    let one = callers("tenant", 1);
    g.bench_function("fairshare 1 caller", |b| {
        b.iter(|| now(l.admit(black_box(&one[0]), "search", Cost(1.0))).is_ok())
    });

    let l = limiter();
    let many = callers("tenant", 10_000);
    for c in &many {
        now(l.admit(c, "search", Cost(1.0))).expect("admitted");
    }
    let mut i = 0;
    g.bench_function("fairshare 10000 callers", |b| {
        b.iter(|| {
            i = (i + 1) % many.len();
            now(l.admit(black_box(&many[i]), "search", Cost(1.0))).is_ok()
        })
    });

    // A saturated, realistic policy: 120 tenants with floors, weights and ceilings on a tool
    // with a daily budget, each tenant's instances limited by a template; the callers cycle
    // over the tenants far faster than the capacity refills, so most calls are refused.
    let (l, crowd) = saturated();
    let mut refused = 0u64;
    let mut calls = 0u64;
    let mut i = 0;
    g.bench_function("fairshare saturated", |b| {
        b.iter(|| {
            i = (i + 1) % crowd.len();
            let ok = now(l.admit(black_box(&crowd[i]), "saturated", Cost(1.0))).is_ok();
            calls += 1;
            refused += u64::from(!ok);
            ok
        })
    });
    // (Not run at all when a filter leaves it out.)
    assert!(
        calls == 0 || refused * 2 > calls,
        "the saturated case must refuse most calls: {refused} of {calls}"
    );

    // The same nested decision on a tool that leases: spent from the caller's lease.
    let l = limiter();
    g.bench_function("fairshare leased 1 caller", |b| {
        b.iter(|| now(l.admit(black_box(&one[0]), "leased", Cost(1.0))).is_ok())
    });

    // A call charged to two tools at once (a request and its tokens), decided at the store
    // and leased: against one tool, above.
    let l = limiter();
    let two = [("chat.requests", Cost(1.0)), ("chat.tokens", Cost(1.0))];
    g.bench_function("fairshare two tools 1 caller", |b| {
        b.iter(|| now(l.admit_all(black_box(&one[0]), black_box(&two))).is_ok())
    });
    let l = limiter();
    let two = [("leased.requests", Cost(1.0)), ("leased.tokens", Cost(1.0))];
    g.bench_function("fairshare leased two tools 1 caller", |b| {
        b.iter(|| now(l.admit_all(black_box(&one[0]), black_box(&two))).is_ok())
    });
}

/// The crate's decisions on threads: each thread cycles over 64 callers, of its own tenants
/// or of one shared tenant.
fn fairshare_threaded(g: &mut Group<'_>) {
    for (name, threads, shared, tool) in [
        ("fairshare 1 thread", 1, false, "search"),
        ("fairshare 2 threads distinct tenants", 2, false, "search"),
        ("fairshare 2 threads shared tenant", 2, true, "search"),
        ("fairshare leased 1 thread", 1, false, "leased"),
        (
            "fairshare leased 2 threads distinct tenants",
            2,
            false,
            "leased",
        ),
    ] {
        let l = limiter();
        let who: Vec<Vec<Caller>> = (0..threads)
            .map(|t| {
                if shared {
                    // One tenant, 64 instances per thread.
                    (0..64)
                        .map(|i| Caller::new("shared").with_instance(format!("t{t}-{i}")))
                        .collect()
                } else {
                    callers(&format!("t{t}-"), 64)
                }
            })
            .collect();
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                threaded(iters, threads, |t, k| {
                    let mine = &who[t];
                    let _ = black_box(now(l.admit(&mine[k % mine.len()], tool, Cost(1.0))));
                })
            })
        });
    }
}

/// What a decision on this machine cannot do without, each measured alone: reading the wall
/// clock the limiter reads (`SystemClock`), taking and releasing one uncontended lock, cloning
/// and dropping one `Arc` (the answer shares its record), loading the policy from its
/// `ArcSwap` (reloads never block a decision). A leased decision does each once at least; an
/// exact one takes two locks and allocates its answer instead (which costs more). Their sum
/// is a floor no implementation of the same guarantees goes under here.
fn floor(c: &mut Criterion) {
    let mut g = c.benchmark_group("floor");
    g.bench_function("wall clock", |b| {
        b.iter(|| black_box(tower_fairshare::Clock::now(black_box(&SystemClock))))
    });
    // The cheapest clock the standard library has, for comparison: no cheaper here.
    g.bench_function("monotonic clock", |b| b.iter(|| black_box(Instant::now())));
    let m = std::sync::Mutex::new(0u64);
    g.bench_function("lock and unlock", |b| {
        b.iter(|| *black_box(&m).lock().expect("not poisoned") += 1)
    });
    let a = std::sync::Arc::new(0u64);
    g.bench_function("arc clone and drop", |b| {
        b.iter(|| black_box(black_box(&a).clone()))
    });
    let s = arc_swap::ArcSwap::from_pointee(0u64);
    g.bench_function("arc-swap load", |b| b.iter(|| **black_box(&s).load()));
    // What an exact decision costs at the least (see `benches/sketch/mod.rs`), as
    // `decision/fairshare 1 caller` decides it.
    let s = sketch::Sketch::default();
    let who = sketch::Who {
        tenant: "tenant0".into(),
        instance: "agent".into(),
    };
    g.bench_function("sketch bare", |b| {
        b.iter(|| {
            s.bare(&who, black_box("search"), 1.0)
                .map(|t| t.answer().remaining())
        })
    });
    g.bench_function("sketch with work", |b| {
        b.iter(|| {
            s.with_work(&who, black_box("search"), 1.0)
                .map(|t| t.answer().remaining())
        })
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------------
// 2. The whole layer.

/// `tonic::body::Body`: tower_governor builds its 429 through `From<GovernorError>`, which it
/// implements for axum's and tonic's bodies only; it is also a body `FairShare` accepts.
fn bare(
) -> impl Service<Request<Body>, Response = Response<Body>, Error = Infallible, Future: Send> + Clone
{
    service_fn(|_req: Request<Body>| async { Ok::<_, Infallible>(Response::new(Body::empty())) })
}

fn request(tool: &'static str) -> Request<Body> {
    let mut req = Request::builder()
        .uri(tool)
        .body(Body::empty())
        .expect("a valid request");
    req.extensions_mut()
        .insert(Caller::new("t").with_instance("a"));
    req
}

/// `ready().call()` once, and the response status (the response is dropped inside the timed
/// routine, as a server would).
fn call<S, B>(svc: &mut S, req: Request<Body>) -> StatusCode
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
{
    let svc = now(svc.ready()).expect("ready");
    now(svc.call(req)).expect("a response").status()
}

fn layers(c: &mut Criterion) {
    let mut g = c.benchmark_group("layer");
    case(&mut g, "bare", bare(), SEARCH, StatusCode::OK);
    case(
        &mut g,
        "concurrency limit",
        ConcurrencyLimitLayer::new(1024).layer(bare()),
        SEARCH,
        StatusCode::OK,
    );

    tower_governor_layers(&mut g);
    fairshare_layers(&mut g);
    g.finish();
}

const SEARCH: &str = "/tools/search";
const EXHAUSTED: &str = "/tools/exhausted";

/// One layer case: `svc` called on `path`, answering `expect`, timed.
fn case<S, B>(g: &mut Group<'_>, name: &str, mut svc: S, path: &'static str, expect: StatusCode)
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
{
    // One call before timing: the refusal cases use it up.
    call(&mut svc, request(path));
    assert_eq!(call(&mut svc, request(path)), expect, "{name}");
    // The request is built outside the timed routine: its allocations are the same for every
    // stack and only add noise to the differences.
    g.bench_function(name, |b| {
        b.iter_batched(
            || request(path),
            |req| call(&mut svc, req),
            BatchSize::SmallInput,
        )
    });
}

/// tower_governor's layer: admitted, with its headers, refused.
fn tower_governor_layers(g: &mut Group<'_>) {
    let admit = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .key_extractor(GlobalKeyExtractor)
        .finish()
        .expect("a valid governor config");
    case(
        g,
        "tower_governor admitted",
        GovernorLayer::new(admit).layer(bare()),
        SEARCH,
        StatusCode::OK,
    );
    let headers = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .key_extractor(GlobalKeyExtractor)
        .use_headers()
        .finish()
        .expect("a valid governor config");
    case(
        g,
        "tower_governor headers",
        GovernorLayer::new(headers).layer(bare()),
        SEARCH,
        StatusCode::OK,
    );
    let refuse = GovernorConfigBuilder::default()
        .period(Duration::from_secs(3600))
        .burst_size(1)
        .key_extractor(GlobalKeyExtractor)
        .finish()
        .expect("a valid governor config");
    // Its `From<GovernorError>` for tonic's body answers gRPC-style (HTTP 200): build the 429
    // an axum user gets (`into_response()`, the text in a boxed body) instead.
    let refuse = GovernorLayer::new(refuse).error_handler(|e: tower_governor::GovernorError| {
        e.into_response()
            .map(|text| Body::new(Full::new(Bytes::from(text))))
    });
    case(
        g,
        "tower_governor refused",
        refuse.layer(bare()),
        SEARCH,
        StatusCode::TOO_MANY_REQUESTS,
    );
}

/// The crate's layer: admitted, with RateLimit headers, refused; and the sketch behind a
/// minimal layer.
fn fairshare_layers(g: &mut Group<'_>) {
    case(
        g,
        "fairshare admitted",
        FairShareLayer::new(limiter()).layer(bare()),
        SEARCH,
        StatusCode::OK,
    );
    case(
        g,
        "fairshare headers",
        FairShareLayer::new(limiter()).headers(true).layer(bare()),
        SEARCH,
        StatusCode::OK,
    );
    case(
        g,
        "fairshare refused",
        FairShareLayer::new(limiter()).layer(bare()),
        EXHAUSTED,
        StatusCode::TOO_MANY_REQUESTS,
    );
    // What an admitted call through a layer costs at the least: the sketch of an exact
    // decision with the crate's per-call work, behind as little as a layer can be.
    case(
        g,
        "sketch admitted",
        sketch::SketchService {
            sketch: std::sync::Arc::new(sketch::Sketch::default()),
            inner: bare(),
        },
        SEARCH,
        StatusCode::OK,
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Memory per tracked caller.

/// Live bytes after running `f`, minus those before; what `f` allocated and dropped nets out.
fn live_bytes_after(f: impl FnOnce()) -> isize {
    LIVE.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    LIVE.load(Ordering::SeqCst)
}

/// Live bytes of a store holding `n` callers, as `tenants` tenants of `n / tenants` instances
/// each, all resident; and how many store entries that is.
fn store_bytes(n: usize, tenants: usize) -> (isize, usize) {
    let mut l = Some(limiter());
    let per_tenant = n / tenants;
    let bytes = live_bytes_after(|| {
        let l = l.as_ref().expect("built above");
        for i in 0..n {
            // Each caller is built and dropped inside the window: only the store's copies of its
            // names stay.
            let (t, a) = (i / per_tenant, i % per_tenant);
            let caller = Caller::new(format!("tenant-{t}")).with_instance(format!("agent-{a}"));
            now(l.admit(&caller, "resident", Cost(1.0))).expect("admitted");
        }
    });
    let entries = l.as_ref().map_or(0, |l| l.store().len());
    // A tenant and each of its instances are one entry each; the tool is one.
    assert_eq!(
        entries,
        n + tenants + 1,
        "every caller must still be resident"
    );
    drop(l.take());
    (bytes, entries)
}

fn memory(n: usize) {
    let start = Instant::now();
    // The worst case: every caller is a tenant of its own (two levels of state per caller).
    let (ours, entries) = store_bytes(n, n);
    // An agent fleet: callers are instances of 1% as many tenants.
    let fleet_tenants = (n / 100).max(1);
    let (fleet, _) = store_bytes(n, fleet_tenants);
    let elapsed = start.elapsed();

    let quota = generous_quota();
    let mut gov = Some(RateLimiter::keyed(quota));
    let governor = live_bytes_after(|| {
        let gov = gov.as_ref().expect("built above");
        for k in 0..n as u64 {
            let _ = gov.check_key(&k);
        }
    });
    drop(gov.take());

    let per_caller = ours as f64 / n as f64;
    let per_fleet_caller = fleet as f64 / n as f64;
    let per_key = governor as f64 / n as f64;
    println!(
        "memory: fairshare {per_caller:.1} bytes per tracked caller, each its own tenant ({n} \
         callers, {entries} store entries, {ours} bytes live); {per_fleet_caller:.1} bytes per \
         caller as instances of {fleet_tenants} tenants ({:.2} s); governor keyed {per_key:.1} \
         bytes per u64 key",
        elapsed.as_secs_f64()
    );
    let json = format!(
        "{{\"callers\":{n},\"store_entries\":{entries},\"live_bytes\":{ours},\
         \"bytes_per_caller\":{per_caller:.1},\"fleet_tenants\":{fleet_tenants},\
         \"bytes_per_fleet_caller\":{per_fleet_caller:.1},\
         \"governor_bytes_per_key\":{per_key:.1}}}\n"
    );
    write_result("compare-memory.json", &json);
}

/// Beside criterion's own results, where `scripts/bench-compare` reads them.
fn write_result(file: &str, json: &str) {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"))
        .join("criterion");
    if std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(file), json))
        .is_err()
    {
        eprintln!("could not write {}", dir.join(file).display());
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Redis: our `RedisStore` against a one-key GCRA script over a multiplexed connection.

#[cfg(feature = "redis")]
mod redis_part {
    use std::time::{Duration, Instant};

    use tower_fairshare::store::RedisStore;
    use tower_fairshare::{Caller, Cost, Limiter, Policy, SystemClock};

    /// One key, one EVALSHA, Redis `TIME`: the shape of go-redis/redis_rate's GCRA.
    const GCRA: &str = r#"
local rate_per_s = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call("TIME")
local now = (tonumber(t[1]) - 1700000000) + tonumber(t[2]) / 1000000
local interval = 1 / rate_per_s
local tat = tonumber(redis.call("GET", KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + interval
if new_tat - interval * burst > now then
  return {0, math.ceil((new_tat - interval * burst - now) * 1000)}
end
redis.call("SET", KEYS[1], tostring(new_tat), "PX", math.ceil((new_tat - now) * 1000) + 1)
return {1, 0}
"#;

    /// Per task: calls made and each call's latency in µs.
    struct Run {
        in_flight: usize,
        secs: f64,
        calls: Vec<usize>,
        latencies_us: Vec<u32>,
        errors: usize,
        /// Redis commands, and µs spent running scripts inside Redis, during the run.
        commands: u64,
        script_us: f64,
    }

    impl Run {
        fn json(&self, name: &str) -> String {
            let mut l = self.latencies_us.clone();
            l.sort_unstable();
            let q = |p: f64| l.get(((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1)));
            let total: usize = self.calls.iter().sum();
            let starved = self.calls.iter().filter(|&&c| c == 0).count();
            let rate = total as f64 / self.secs;
            let (p50, p99, max) = (
                q(0.5).copied().unwrap_or(0),
                q(0.99).copied().unwrap_or(0),
                l.last().copied().unwrap_or(0),
            );
            let min_task = self.calls.iter().min().copied().unwrap_or(0);
            let per_call = |x: f64| if total == 0 { 0.0 } else { x / total as f64 };
            let (commands, script_us) = (per_call(self.commands as f64), per_call(self.script_us));
            println!(
                "redis: {name:<9} {:>2} in flight: {rate:>9.0}/s  p50 {p50:>5} µs  p99 {p99:>6} µs  \
                 worst {max:>7} µs  slowest task {min_task} calls  starved {starved}  errors {}  \
                 {commands:.2} commands and {script_us:.1} µs of script in Redis per call",
                self.in_flight, self.errors
            );
            format!(
                "{{\"impl\":\"{name}\",\"in_flight\":{},\"per_s\":{rate:.1},\"p50_us\":{p50},\
                 \"p99_us\":{p99},\"worst_us\":{max},\"min_task_calls\":{min_task},\
                 \"starved\":{starved},\"errors\":{},\"commands_per_call\":{commands:.3},\
                 \"script_us_per_call\":{script_us:.2}}}",
                self.in_flight, self.errors
            )
        }
    }

    /// `in_flight` tasks, each calling `op(task)` back to back for `secs`.
    async fn drive<F, Fut>(in_flight: usize, secs: f64, op: F) -> Run
    where
        F: Fn(usize) -> Fut + Clone + Send + 'static,
        Fut: std::future::Future<Output = bool> + Send,
    {
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        let tasks: Vec<_> = (0..in_flight)
            .map(|t| {
                let op = op.clone();
                tokio::spawn(async move {
                    let (mut lat, mut errors) = (Vec::new(), 0);
                    while Instant::now() < deadline {
                        let start = Instant::now();
                        errors += usize::from(!op(t).await);
                        lat.push(start.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    }
                    (lat, errors)
                })
            })
            .collect();
        let mut run = Run {
            in_flight,
            secs,
            calls: Vec::new(),
            latencies_us: Vec::new(),
            errors: 0,
            commands: 0,
            script_us: 0.0,
        };
        for t in tasks {
            let (lat, errors) = t.await.expect("a bench task panicked");
            run.calls.push(lat.len());
            run.errors += errors;
            run.latencies_us.extend(lat);
        }
        run
    }

    /// Commands processed so far (this INFO not included), and µs spent in scripts
    /// (`EVALSHA`, `EVAL`, `FCALL`) since the last `CONFIG RESETSTAT`.
    async fn server_stats(con: &mut redis::aio::MultiplexedConnection) -> (u64, f64) {
        let info: String = redis::cmd("INFO")
            .arg("stats")
            .arg("commandstats")
            .query_async(con)
            .await
            .expect("INFO stats commandstats");
        let commands = info
            .lines()
            .find_map(|l| l.strip_prefix("total_commands_processed:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("total_commands_processed in INFO stats");
        let script_us = info
            .lines()
            .filter(|l| {
                ["cmdstat_evalsha:", "cmdstat_eval:", "cmdstat_fcall:"]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .filter_map(|l| l.split(',').find_map(|f| f.strip_prefix("usec=")))
            .filter_map(|v| v.parse::<f64>().ok())
            .sum();
        (commands, script_us)
    }

    /// Commands Redis processed but the stores' own upkeep, which no decision sends (each
    /// store checks its tools' epoch markers every second with plain `SET` / `GET` / `EXPIRE`,
    /// and announces itself to the other replicas every second with `TIME`, `HGETALL`, `HSET`,
    /// `HDEL` and `PEXPIRE`) and this bench's `INFO` and `CONFIG`. Decisions are scripts.
    async fn commands_but_upkeep(con: &mut redis::aio::MultiplexedConnection) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(con)
            .await
            .expect("INFO commandstats");
        let upkeep = [
            "set", "get", "expire", "time", "hgetall", "hset", "hdel", "pexpire", "info", "config",
        ];
        info.lines()
            .filter_map(|l| l.strip_prefix("cmdstat_"))
            .filter_map(|l| l.split_once(':'))
            .filter(|(name, _)| !upkeep.contains(name))
            .filter_map(|(_, stats)| stats.split(',').find_map(|f| f.strip_prefix("calls=")))
            .filter_map(|v| v.parse::<u64>().ok())
            .sum()
    }

    /// Runs `run` between `CONFIG RESETSTAT` and an `INFO`, and records what Redis did.
    async fn measured(
        info: &mut redis::aio::MultiplexedConnection,
        run: impl std::future::Future<Output = Run>,
    ) -> Run {
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(info)
            .await
            .expect("CONFIG RESETSTAT");
        let mut r = run.await;
        let (commands, script_us) = server_stats(info).await;
        // RESETSTAT counts itself once it has run.
        r.commands = commands.saturating_sub(1);
        r.script_us = script_us;
        r
    }

    /// The Redis part: our store against the GCRA script at 1, 16 and 64 calls in flight,
    /// leases over two replicas, and a refused caller's flood; as JSON.
    pub(crate) fn run(url: &str, secs: f64) -> String {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        rt.block_on(async {
            let client = redis::Client::open(url).expect("a redis url");
            let mut info = client
                .get_multiplexed_async_connection()
                .await
                .expect("redis is up");
            let _: () = redis::cmd("FLUSHALL")
                .query_async(&mut info)
                .await
                .expect("FLUSHALL");
            let limiter = limiter_on(url).await;
            let mut rows = Vec::new();
            for in_flight in [1, 16, 64] {
                let gcra = measured(&mut info, gcra(&client, in_flight, secs).await).await;
                rows.push(gcra.json("gcra"));
                let ours = measured(&mut info, ours(&limiter, in_flight, secs)).await;
                rows.push(ours.json("fairshare"));
            }
            let leased = measured(&mut info, leased(url, secs).await).await;
            rows.push(leased.json("leased-2-replicas"));
            let flood = flood(&limiter, &mut info).await;
            format!("{{\"runs\":[{}],{flood}}}\n", rows.join(","))
        })
    }

    /// A limiter on the Redis at `url`, with the bench policy.
    async fn limiter_on(url: &str) -> Limiter<RedisStore, SystemClock> {
        let store = RedisStore::connect(url).await.expect("RedisStore connects");
        let policy =
            Policy::from_toml_str(super::common::POLICY).expect("the bench policy is valid");
        Limiter::with_store(policy, store, SystemClock)
    }

    /// The GCRA script, `in_flight` tasks each on a key of its own.
    async fn gcra(
        client: &redis::Client,
        in_flight: usize,
        secs: f64,
    ) -> impl std::future::Future<Output = Run> {
        let con = client
            .get_connection_manager()
            .await
            .expect("a connection manager");
        let script = std::sync::Arc::new(redis::Script::new(GCRA));
        drive(in_flight, secs, move |t| {
            let (mut con, script) = (con.clone(), script.clone());
            async move {
                script
                    .key(format!("gcra:{t}"))
                    .arg(1_000_000_000u64)
                    .arg(1_000_000_000u64)
                    .invoke_async::<(i64, i64)>(&mut con)
                    .await
                    .is_ok()
            }
        })
    }

    /// Our exact decisions, `in_flight` tasks each a caller of its own.
    fn ours(
        limiter: &Limiter<RedisStore, SystemClock>,
        in_flight: usize,
        secs: f64,
    ) -> impl std::future::Future<Output = Run> {
        let callers: std::sync::Arc<Vec<Caller>> = std::sync::Arc::new(
            (0..in_flight)
                .map(|t| Caller::new(format!("redis-{t}")).with_instance("agent"))
                .collect(),
        );
        let l = limiter.clone();
        drive(in_flight, secs, move |t| {
            let (l, callers) = (l.clone(), callers.clone());
            async move { l.admit(&callers[t], "search", Cost(1.0)).await.is_ok() }
        })
    }

    /// Leases: 64 calls in flight over two replicas (two stores, two limiters) on one Redis,
    /// each task a caller of its own on the leasing tool.
    async fn leased(url: &str, secs: f64) -> impl std::future::Future<Output = Run> {
        let replicas = std::sync::Arc::new([limiter_on(url).await, limiter_on(url).await]);
        let callers: std::sync::Arc<Vec<Caller>> = std::sync::Arc::new(
            (0..64)
                .map(|t| Caller::new(format!("lease-{t}")).with_instance("agent"))
                .collect(),
        );
        drive(64, secs, move |t| {
            let (replicas, callers) = (replicas.clone(), callers.clone());
            async move {
                let decided = replicas[t % 2].admit(&callers[t], "leased", Cost(1.0));
                match decided.await {
                    Ok(_) => true,
                    Err(r) => {
                        static ONCE: std::sync::Once = std::sync::Once::new();
                        ONCE.call_once(|| eprintln!("a leased call was refused: {r:?}"));
                        false
                    }
                }
            }
        })
    }

    /// A runaway caller whose tenant is used up: after its first refusal, no Redis command
    /// until its retry time. Its JSON field.
    async fn flood(
        limiter: &Limiter<RedisStore, SystemClock>,
        info: &mut redis::aio::MultiplexedConnection,
    ) -> String {
        let runaway = Caller::new("runaway").with_instance("agent");
        let _ = limiter.admit(&runaway, "exhausted", Cost(1.0)).await;
        let refused = limiter
            .admit(&runaway, "exhausted", Cost(1.0))
            .await
            .is_err();
        let before = commands_but_upkeep(info).await;
        let flood = 10_000;
        let mut admitted = 0;
        for _ in 0..flood {
            let decided = limiter.admit(&runaway, "exhausted", Cost(1.0)).await;
            admitted += usize::from(decided.is_ok());
        }
        let commands = commands_but_upkeep(info).await - before;
        println!(
            "redis: refused caller's flood of {flood} calls (refused before: {refused}): {admitted} \
             admitted, {commands} Redis commands"
        );
        format!(
            "\"flood\":{{\"calls\":{flood},\"admitted\":{admitted},\"redis_commands\":{commands}}}"
        )
    }
}

/// A model call through `model_calls()`: a chat request's JSON body read for its estimate,
/// the tools decided, the service's JSON answer read to its end and its `usage` settled.
/// Charged to one tool (its tokens) or to two (a request and its tokens), decided at the store
/// or leased: what a second tool adds to a call.
fn model_calls(c: &mut Criterion) {
    use tower_fairshare::BufferedBody;
    let mut g = c.benchmark_group("model call");
    const ASK: &[u8] =
        br#"{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"hello"}]}"#;
    let model = || {
        service_fn(|_req: Request<BufferedBody>| async {
            let mut res = Response::new(Body::new(Full::new(Bytes::from_static(
                br#"{"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":30,"total_tokens":50}}"#,
            ))));
            res.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            Ok::<_, Infallible>(res)
        })
    };
    let ask = || {
        let mut req = Request::post("/v1/chat/completions")
            .body(Body::new(Full::new(Bytes::from_static(ASK))))
            .expect("a valid request");
        req.extensions_mut()
            .insert(Caller::new("t").with_instance("a"));
        req
    };
    for (name, tools) in [
        ("one tool", &["chat.tokens"][..]),
        ("two tools", &["chat.requests", "chat.tokens"][..]),
        ("leased one tool", &["leased.tokens"][..]),
        (
            "leased two tools",
            &["leased.requests", "leased.tokens"][..],
        ),
    ] {
        let mut layer = FairShareLayer::new(limiter()).model_calls();
        for t in tools {
            layer = match t.ends_with(".requests") {
                true => layer.requests(*t),
                false => layer.tokens(*t),
            };
        }
        let mut svc = layer.layer(model());
        g.bench_function(name, |b| {
            b.iter_batched(
                ask,
                |req: Request<Body>| {
                    let svc = now(ServiceExt::<Request<Body>>::ready(&mut svc)).expect("ready");
                    let res = now(svc.call(req)).expect("a response");
                    assert_eq!(res.status(), StatusCode::OK);
                    now(http_body_util::BodyExt::collect(res.into_body())).is_ok()
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    decisions(&mut c);
    floor(&mut c);
    layers(&mut c);
    model_calls(&mut c);
    c.final_summary();

    // `cargo test --benches` runs each bench once: keep the memory part small there too.
    let quick = std::env::args().any(|a| a == "--test" || a == "--list");
    let n = std::env::var("COMPARE_MEMORY_CALLERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 1_000 } else { 1_000_000 });
    if n > 0 && !std::env::args().any(|a| a == "--list") {
        memory(n);
    }

    // Only against a Redis given on purpose (scripts/bench-compare starts its own): FLUSHALL.
    #[cfg(feature = "redis")]
    if let Ok(url) = std::env::var("COMPARE_REDIS_URL") {
        let secs = std::env::var("COMPARE_REDIS_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(if quick { 0.2 } else { 3.0 });
        let json = redis_part::run(&url, secs);
        write_result("compare-redis.json", &json);
    }
}
