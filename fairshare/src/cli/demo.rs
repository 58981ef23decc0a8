//! `fairshare demo`: the three-part acceptance test over real loopback HTTP.
//!
//! Starts the `serve` gateway in this process on `127.0.0.1:0` with the policy and keys of
//! `fairshare/demo/`, waits for the start of the limiter's next window (windows are aligned to
//! the clock, so each row of the report is one whole window), then drives it with hyper
//! clients: a heavy tenant at ten times its nominal share, a quiet tenant below its floor, an
//! interactive agent at its floor beside a runaway batch teammate. It prints a progress line a
//! second, the per-caller and per-window tables, and whether each property held.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower_fairshare::policy::ToolAllocation;
use tower_fairshare::Policy;

use super::keys::Keys;
use super::serve;

const POLICY: &str = include_str!("../../demo/policy.toml");
const KEYS: &str = include_str!("../../demo/keys.toml");
const TOOL: &str = "web_search";

/// One simulated client of the gateway.
struct Driver {
    /// `tenant/instance`.
    label: &'static str,
    tenant: &'static str,
    instance: &'static str,
    key: &'static str,
    /// Calls offered per window, evenly spaced.
    per_window: u64,
    /// Why it offers what it offers.
    role: &'static str,
}

const DRIVERS: [Driver; 4] = [
    Driver {
        label: "heavy/crawler",
        tenant: "heavy",
        instance: "crawler",
        key: "sk-demo-heavy",
        per_window: 820,
        role: "10x its nominal share",
    },
    Driver {
        label: "quiet/assistant",
        tenant: "quiet",
        instance: "assistant",
        key: "sk-demo-quiet",
        per_window: 5,
        role: "well below its floor",
    },
    Driver {
        label: "agents/interactive",
        tenant: "agents",
        instance: "interactive",
        key: "sk-demo-interactive",
        per_window: 8,
        role: "exactly its floor",
    },
    Driver {
        label: "agents/batch",
        tenant: "agents",
        instance: "batch",
        key: "sk-demo-batch",
        per_window: 750,
        role: "a runaway loop beside it",
    },
];
const HEAVY: usize = 0;
const QUIET: usize = 1;
const INTERACTIVE: usize = 2;
const BATCH: usize = 3;

/// What the policy owes a caller, per window.
#[derive(Clone, Copy, Debug)]
struct Owed {
    floor: f64,
    nominal: f64,
    ceiling: f64,
    burst: f64,
}

fn owed(alloc: &ToolAllocation, tenant: &str, instance: &str) -> Owed {
    let t = alloc
        .tenants
        .iter()
        .find(|r| r.name == tenant)
        .expect("the demo policy lists every demo tenant");
    match t.instances.iter().find(|r| r.name == instance) {
        Some(i) => Owed {
            floor: i.floor,
            nominal: i.floor + i.share,
            ceiling: i.ceiling,
            burst: i.burst,
        },
        None => Owed {
            floor: t.floor,
            nominal: t.floor + t.share,
            ceiling: t.ceiling,
            burst: t.burst,
        },
    }
}

#[derive(Default)]
struct Progress {
    admitted: AtomicU64,
    refused: AtomicU64,
}

#[derive(Clone, PartialEq)]
enum Outcome {
    Admitted,
    Refused,
    /// Neither: what went wrong (the client's error, or the status answered).
    Failed(String),
}

/// One answered (or failed) call: the window it was sent in, what came back, how long it took.
struct Call {
    window: usize,
    outcome: Outcome,
    latency: Duration,
}

#[derive(Default)]
struct Tally {
    offered: u64,
    admitted: u64,
    refused: u64,
    failed: u64,
    /// What went wrong with the first call that failed.
    first_failure: Option<String>,
    per_window: Vec<u64>,
    latencies: Vec<Duration>,
}

/// The demo's tool as its policy sets it, and what each driver is owed: what the run is read
/// against.
struct Setup {
    alloc: ToolAllocation,
    period: Duration,
    period_text: String,
    capacity: f64,
    windows: usize,
    owed: Vec<Owed>,
}

impl Setup {
    /// The demo policy (with `lease`, its tool leasing up to that many units) and the run's
    /// figures for `duration`.
    fn new(duration: Duration, lease: Option<u32>) -> Result<(Setup, Policy), String> {
        let text = match lease {
            Some(n) => POLICY.replace(
                "[[tool]]\n",
                &format!("[[tool]]\nlease = {{ max = {n} }}\n"),
            ),
            None => POLICY.to_owned(),
        };
        let policy = Policy::from_toml_str(&text).map_err(|e| e.to_string())?;
        let alloc = policy
            .allocation()
            .tools
            .into_iter()
            .find(|t| t.name == TOOL)
            .expect("the demo policy has the demo tool");
        let tool = policy.tool(TOOL).expect("the demo tool");
        let period = Duration::from_micros(tool.period().as_micros());
        let owed = DRIVERS
            .iter()
            .map(|d| owed(&alloc, d.tenant, d.instance))
            .collect();
        let setup = Setup {
            period,
            period_text: tool.period().to_string(),
            capacity: tool.capacity(),
            windows: duration.as_micros().div_ceil(period.as_micros()).max(1) as usize,
            owed,
            alloc,
        };
        Ok((setup, policy))
    }

    /// Says where the gateway listens and what each driver offers.
    fn announce(&self, addr: std::net::SocketAddr) {
        sayln!("fairshare demo: the three-part acceptance test over real HTTP");
        sayln!("  gateway  http://{addr}/tools/{TOOL} (axum + FairShareLayer, in this process; policy fairshare/demo/policy.toml)");
        sayln!(
            "  console  http://{addr}/fairshare/ (live: who is at its floor, its ceiling, why refused)"
        );
        sayln!(
            "  tool     {TOOL}: {} calls per {}, burst {}",
            num(self.capacity),
            self.period_text,
            num(self.alloc.burst)
        );
        for (d, o) in DRIVERS.iter().zip(&self.owed) {
            sayln!(
                "  {:<18} offers {:>3} per window, {} (floor {}, nominal {}, ceiling {})",
                d.label,
                d.per_window,
                d.role,
                num(o.floor),
                num(o.nominal),
                num(o.ceiling)
            );
        }
    }

    /// When the run starts: the start of the limiter's next window. The limiter counts per
    /// window aligned to the clock, so every window of the report is one the limiter counted.
    fn start(&self) -> Instant {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros();
        let p = self.period.as_micros();
        let wait = Duration::from_micros((now.div_ceil(p) * p - now) as u64);
        sayln!(
            "  waiting {:.1}s for the limiter's next {} window, then offering load for {} windows ({}s)",
            wait.as_secs_f64(),
            self.period_text,
            self.windows,
            self.run_for().as_secs()
        );
        Instant::now() + wait
    }

    fn run_for(&self) -> Duration {
        self.period * self.windows as u32
    }

    /// Prints the report (and writes the chart to `svg`): success when every property held.
    fn conclude(&self, tallies: &[Tally], svg: Option<&std::path::Path>) -> ExitCode {
        let burst = self.alloc.burst;
        say!(
            "{}",
            report(tallies, &self.owed, self.capacity, burst, &self.period_text)
        );
        if let Some(out) = svg {
            let chart = fairshare::chart::svg(
                &chart_report(tallies, &self.owed, &self.alloc),
                "fairshare demo: the three-part acceptance over real HTTP",
                self.capacity,
                &self.period_text,
            );
            match std::fs::write(out, chart) {
                Ok(()) => sayln!("chart written to {}", out.display()),
                Err(e) => eprintln!("error: cannot write {}: {e}", out.display()),
            }
        }
        let verdicts = verdicts(tallies, &self.owed, self.capacity, burst);
        if verdicts.iter().all(|v| v.held) {
            sayln!("every property held");
            ExitCode::SUCCESS
        } else {
            sayln!("some property did NOT hold");
            ExitCode::from(1)
        }
    }
}

/// Runs the demo; exit code 0 when every property held.
pub(crate) async fn run(
    duration: Duration,
    svg: Option<&std::path::Path>,
    lease: Option<u32>,
) -> ExitCode {
    let (setup, policy) = match Setup::new(duration, lease) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: the demo policy with --lease: {e}");
            return ExitCode::from(2);
        }
    };
    let listener = match TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on 127.0.0.1: {e}");
            return ExitCode::from(1);
        }
    };
    let addr = listener
        .local_addr()
        .expect("a bound socket has an address");
    let limits = serve::Limits::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let keys = Keys::from_toml_str(KEYS).expect("the demo keys are valid");
    let router = serve::router(
        policy,
        keys,
        serve::Metrics::Off,
        serve::ConsoleAccess::Open,
        limits,
    );
    let server = tokio::spawn(serve::run(listener, router, limits, async move {
        let _ = stopped.await;
    }));

    setup.announce(addr);
    let start = setup.start();
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(64)
        .pool_idle_timeout(client_idle(&limits))
        .build_http();
    let uri: http::Uri = format!("http://{addr}/tools/{TOOL}")
        .parse()
        .expect("a valid URI");
    let progress: Arc<[Progress; 4]> = Arc::default();
    let mut drivers = JoinSet::new();
    let pace = Pace {
        start,
        period: setup.period,
        windows: setup.windows,
    };
    for (i, d) in DRIVERS.iter().enumerate() {
        let (client, progress, uri) = (client.clone(), progress.clone(), uri.clone());
        drivers.spawn(drive((i, d), client, progress, uri, pace));
    }
    let printer = tokio::spawn(print_progress(progress, start, setup.run_for()));
    let tallies = tally(drivers, setup.windows).await;
    let _ = printer.await;
    let _ = stop.send(());
    let _ = server.await;
    setup.conclude(&tallies, svg)
}

/// When a driver's calls are sent: from `start`, `windows` windows of `period`.
#[derive(Clone, Copy)]
struct Pace {
    start: Instant,
    period: Duration,
    windows: usize,
}

type DemoClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

/// Driver `d`'s calls (the `i`th), evenly spaced, each in a task of its own: every call,
/// answered or not.
async fn drive(
    (i, d): (usize, &'static Driver),
    client: DemoClient,
    progress: Arc<[Progress; 4]>,
    uri: http::Uri,
    pace: Pace,
) -> (usize, Vec<Call>) {
    let interval = pace.period / d.per_window as u32;
    let offered = d.per_window * pace.windows as u64;
    let mut calls = Vec::with_capacity(offered as usize);
    let mut in_flight = JoinSet::new();
    for k in 0..offered {
        tokio::time::sleep_until(pace.start + interval * k as u32).await;
        let request = Request::get(uri.clone())
            .header(serve::API_KEY, d.key)
            .body(Empty::new())
            .expect("a valid request");
        let (client, progress) = (client.clone(), progress.clone());
        in_flight.spawn(async move {
            let call = call(&client, request, pace).await;
            match call.outcome {
                Outcome::Admitted => &progress[i].admitted,
                _ => &progress[i].refused,
            }
            .fetch_add(1, Ordering::Relaxed);
            call
        });
        while let Some(done) = in_flight.try_join_next() {
            calls.push(done.expect("a call task does not panic"));
        }
    }
    while let Some(done) = in_flight.join_next().await {
        calls.push(done.expect("a call task does not panic"));
    }
    (i, calls)
}

/// One call sent and its whole body read: what came back, in which window it was sent.
async fn call(client: &DemoClient, request: Request<Empty<Bytes>>, pace: Pace) -> Call {
    let sent = Instant::now();
    let outcome = match client.request(request).await {
        Ok(response) => {
            let status = response.status();
            // Read the whole body: the call is over when its body is.
            match response.into_body().collect().await {
                Ok(_) if status == StatusCode::OK => Outcome::Admitted,
                Ok(_) if status == StatusCode::TOO_MANY_REQUESTS => Outcome::Refused,
                Ok(_) => Outcome::Failed(format!("answered {status}")),
                Err(e) => Outcome::Failed(format!("its body failed: {e}")),
            }
        }
        Err(e) => Outcome::Failed(error_chain(&e)),
    };
    let latency = sent.elapsed();
    let since = sent.saturating_duration_since(pace.start);
    Call {
        window: (since.as_micros() / pace.period.as_micros()) as usize,
        outcome,
        latency,
    }
}

/// A line a second for `run_for` from `start`: each driver's calls admitted and refused so far.
async fn print_progress(progress: Arc<[Progress; 4]>, start: Instant, run_for: Duration) {
    for s in 1..=run_for.as_secs() {
        tokio::time::sleep_until(start + Duration::from_secs(s)).await;
        let mut line = format!("{s:>4}s  admitted/refused");
        for (d, p) in DRIVERS.iter().zip(progress.iter()) {
            let _ = write!(
                line,
                "  {} {}/{}",
                d.label,
                p.admitted.load(Ordering::Relaxed),
                p.refused.load(Ordering::Relaxed)
            );
        }
        sayln!("{line}");
    }
}

/// Every driver's calls counted, once all of them are over.
async fn tally(mut drivers: JoinSet<(usize, Vec<Call>)>, windows: usize) -> Vec<Tally> {
    let mut tallies: Vec<Tally> = (0..DRIVERS.len())
        .map(|_| Tally {
            per_window: vec![0; windows],
            ..Tally::default()
        })
        .collect();
    while let Some(done) = drivers.join_next().await {
        let (i, calls) = done.expect("a driver does not panic");
        let t = &mut tallies[i];
        for c in calls {
            t.offered += 1;
            t.latencies.push(c.latency);
            match c.outcome {
                Outcome::Admitted => {
                    t.admitted += 1;
                    if let Some(w) = t.per_window.get_mut(c.window) {
                        *w += 1;
                    }
                }
                Outcome::Refused => t.refused += 1,
                Outcome::Failed(why) => {
                    t.failed += 1;
                    t.first_failure.get_or_insert(why);
                }
            }
        }
    }
    tallies
}

/// The demo's per-window admissions as a simulation report, for the chart.
fn chart_report(t: &[Tally], owed: &[Owed], alloc: &ToolAllocation) -> fairshare::simulate::Report {
    use fairshare::simulate::{unserved_floors, CallerRow, PeriodRow, Report};
    let windows = t.first().map_or(0, |c| c.per_window.len());
    let row = |i: usize, admitted: u64| {
        let (tenant, instance) = DRIVERS[i]
            .label
            .split_once('/')
            .unwrap_or((DRIVERS[i].label, ""));
        CallerRow {
            tenant: Some(tenant.to_owned()),
            instance: (!instance.is_empty()).then(|| instance.to_owned()),
            offered: DRIVERS[i].per_window,
            admitted,
            refused: DRIVERS[i].per_window.saturating_sub(admitted),
            floor: owed[i].floor,
            ceiling: owed[i].ceiling,
        }
    };
    let periods: Vec<PeriodRow> = (0..windows)
        .map(|w| {
            let callers: Vec<CallerRow> =
                (0..t.len()).map(|i| row(i, t[i].per_window[w])).collect();
            PeriodRow {
                start_ms: 0,
                admitted: callers.iter().map(|c| c.admitted).sum(),
                unserved_floors: unserved_floors(
                    alloc,
                    callers
                        .iter()
                        .filter_map(|c| Some((c.tenant.as_deref()?, c.admitted as f64))),
                ),
                callers,
            }
        })
        .collect();
    let totals = (0..t.len())
        .map(|i| CallerRow {
            offered: t[i].offered,
            refused: t[i].refused,
            ..row(i, t[i].admitted)
        })
        .collect();
    Report { periods, totals }
}

/// How long the demo's client keeps an idle connection for another call: well within the
/// gateway's header timeout, after which the gateway closes an idle keep-alive connection. A
/// client that kept one longer could send a call on it just as the gateway closes it, and that
/// call would fail in transport (the connection closed before the answer came).
fn client_idle(limits: &serve::Limits) -> Duration {
    limits.header_timeout / 2
}

/// A client error with the errors under it, outermost first.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let _ = write!(text, ": {s}");
        source = s.source();
    }
    text
}

/// One property of the acceptance test and whether the run kept it.
struct Verdict {
    held: bool,
    text: String,
}

fn verdicts(t: &[Tally], owed: &[Owed], capacity: f64, tool_burst: f64) -> Vec<Verdict> {
    let windows = t[HEAVY].per_window.len();
    let min = |i: usize| t[i].per_window.iter().copied().min().unwrap_or(0);
    let max = |i: usize| t[i].per_window.iter().copied().max().unwrap_or(0);
    let tool_max = (0..windows)
        .map(|w| t.iter().map(|c| c.per_window[w]).sum::<u64>())
        .max()
        .unwrap_or(0);
    let failed: u64 = t.iter().map(|c| c.failed).sum();
    let answered: u64 = t.iter().map(|c| c.offered - c.failed).sum();
    let first_failure = t
        .iter()
        .find_map(|c| c.first_failure.as_deref())
        .map_or(String::new(), |why| format!(" (one of them: {why})"));
    let (h, b) = (&owed[HEAVY], &owed[BATCH]);
    vec![
        Verdict {
            held: failed == 0,
            text: format!(
                "transport: {answered} calls answered 200 or 429, {failed} failed or answered otherwise{first_failure}"
            ),
        },
        Verdict {
            held: t[QUIET].refused == 0
                && t[INTERACTIVE].refused == 0
                && t[QUIET].failed == 0
                && t[INTERACTIVE].failed == 0,
            text: format!(
                "floors: {} got {} of {} and {} got {} of {} (no refusals beside a heavy tenant and a runaway teammate)",
                DRIVERS[QUIET].label,
                t[QUIET].admitted,
                t[QUIET].offered,
                DRIVERS[INTERACTIVE].label,
                t[INTERACTIVE].admitted,
                t[INTERACTIVE].offered,
            ),
        },
        Verdict {
            held: min(HEAVY) as f64 > h.nominal && max(HEAVY) as f64 <= h.ceiling + h.burst,
            text: format!(
                "borrowing: {} got {}-{} a window, above its nominal {} (it borrowed idle share) and at most its ceiling {} + burst {}",
                DRIVERS[HEAVY].label,
                min(HEAVY),
                max(HEAVY),
                num(h.nominal),
                num(h.ceiling),
                num(h.burst)
            ),
        },
        Verdict {
            held: tool_max as f64 <= capacity + tool_burst,
            text: format!(
                "capacity: the tool admitted at most {tool_max} in a window (capacity {} + burst {})",
                num(capacity),
                num(tool_burst)
            ),
        },
        Verdict {
            held: max(BATCH) as f64 <= b.ceiling + b.burst,
            text: format!(
                "runaway: {} got at most {} a window (its ceiling {} + burst {}); {} refused",
                DRIVERS[BATCH].label,
                max(BATCH),
                num(b.ceiling),
                num(b.burst),
                t[BATCH].refused
            ),
        },
    ]
}

fn report(t: &[Tally], owed: &[Owed], capacity: f64, tool_burst: f64, period: &str) -> String {
    let mut o = String::new();
    let width = DRIVERS.iter().map(|d| d.label.len()).max().unwrap_or(6);
    let _ = writeln!(
        o,
        "\nper caller (floor and ceiling per {period} window; latency is the client's round trip)"
    );
    let _ = writeln!(
        o,
        "  {:<width$} {:>8} {:>8} {:>8} {:>6} {:>8} {:>8} {:>8}",
        "caller", "offered", "admitted", "refused", "floor", "ceiling", "p50 ms", "p99 ms"
    );
    for (i, (d, c)) in DRIVERS.iter().zip(t).enumerate() {
        let mut l = c.latencies.clone();
        l.sort_unstable();
        let _ = writeln!(
            o,
            "  {:<width$} {:>8} {:>8} {:>8} {:>6} {:>8} {:>8.2} {:>8.2}",
            d.label,
            c.offered,
            c.admitted,
            c.refused + c.failed,
            num(owed[i].floor),
            num(owed[i].ceiling),
            percentile(&l, 0.50),
            percentile(&l, 0.99),
        );
    }
    let _ = writeln!(o, "\nadmitted per {period} window");
    let _ = write!(o, "  {:<8} {:>6}", "window", "tool");
    for d in &DRIVERS {
        let _ = write!(o, " {:>w$}", d.label, w = d.label.len().max(6));
    }
    let _ = writeln!(o);
    for w in 0..t[HEAVY].per_window.len() {
        let total: u64 = t.iter().map(|c| c.per_window[w]).sum();
        let _ = write!(o, "  {:<8} {:>6}", w + 1, total);
        for (d, c) in DRIVERS.iter().zip(t) {
            let _ = write!(o, " {:>w$}", c.per_window[w], w = d.label.len().max(6));
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(o, "\nproperties");
    for v in verdicts(t, owed, capacity, tool_burst) {
        let _ = writeln!(
            o,
            "  {}  {}",
            if v.held { "held  " } else { "FAILED" },
            v.text
        );
    }
    o
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let k = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[k].as_secs_f64() * 1000.0
}

fn num(x: f64) -> String {
    if (x - x.round()).abs() < 1e-6 {
        format!("{}", x.round() as i64)
    } else {
        format!("{x:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demo's client lets an idle connection go before the gateway would close it, so it
    /// never sends a call on a connection the gateway is closing (hyper's client keeps idle
    /// connections 90 s unless told otherwise; the gateway closes them after its header
    /// timeout, 10 s).
    #[test]
    fn the_client_lets_idle_connections_go_before_the_gateway_closes_them() {
        let limits = serve::Limits::default();
        assert!(client_idle(&limits) > Duration::ZERO);
        assert!(client_idle(&limits) < limits.header_timeout);
    }

    /// A failed call is reported with every error under the client's.
    #[test]
    fn a_failure_names_the_errors_under_it() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("client error (SendRequest)")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Outer(std::io::Error::other(
            "connection closed before message completed",
        ));
        assert_eq!(
            error_chain(&e),
            "client error (SendRequest): connection closed before message completed"
        );
    }
}
