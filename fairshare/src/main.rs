//! `fairshare`: check a policy, simulate load against it, serve a reference gateway, run the
//! acceptance demo over loopback HTTP.

// A function reads whole: at most 80 lines of code (`clippy.toml`).
#![warn(clippy::too_many_lines)]

/// Writes to stdout like `print!`; a reader that went away (`fairshare check p.toml | head -1`)
/// ends the command quietly, as it ends any Unix tool.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = write!(std::io::stdout().lock(), $($arg)*) {
            $crate::output_failed(e);
        }
    }};
}

/// `say!` with a newline, like `println!`.
macro_rules! sayln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::output_failed(e);
        }
    }};
}

mod cli;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fairshare::simulate::{simulate, Scenario, ScenarioError};
use tower_fairshare::{Period, Policy};

use cli::keys::Keys;

#[derive(Parser)]
#[command(
    name = "fairshare",
    version,
    about = "Fair-share rate limiting: check policies, simulate load, serve a gateway, run the demo"
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
        /// Also write an SVG chart of admitted calls per caller per period, against the floor
        /// and ceiling each was owed.
        #[arg(long, value_name = "OUT")]
        svg: Option<PathBuf>,
        /// Run against a Redis store at this URL (e.g. redis://127.0.0.1:6379/) instead of the
        /// in-process store; the virtual clock is injected, keys go under a fresh namespace.
        #[arg(long, value_name = "URL")]
        redis: Option<String>,
    },
    /// Serve a reference HTTP gateway: `/tools/{name}` calls tool `name`, callers are the
    /// `x-api-key` header looked up in the keys file.
    Serve {
        /// The policy file.
        #[arg(long)]
        policy: PathBuf,
        /// The keys file: `[keys."sk-acme"] tenant = "acme" instance = "..." tier = "..."`.
        #[arg(long)]
        keys: PathBuf,
        /// Where to listen (port 0: any free port; the bound address is printed).
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Keep state in Redis at this URL (shared by every replica) instead of in process:
        /// `redis://host:6379/`, `rediss://` for TLS, `redis://user:password@host` for ACL
        /// credentials (also read from FAIRSHARE_REDIS_URL). The gateway starts even while Redis
        /// is down: each tool's `on_store_error` applies until Redis answers.
        #[arg(long, value_name = "URL", value_parser = clap::builder::NonEmptyStringValueParser::new())]
        redis: Option<String>,
        /// With `rediss://`: trust this CA certificate (PEM) instead of the system's roots.
        #[arg(long, value_name = "FILE")]
        redis_ca: Option<PathBuf>,
        /// With `rediss://`: present this client certificate (PEM; needs --redis-key).
        #[arg(long, value_name = "FILE", requires = "redis_key")]
        redis_cert: Option<PathBuf>,
        /// The private key (PEM) of --redis-cert.
        #[arg(long, value_name = "FILE", requires = "redis_cert")]
        redis_key: Option<PathBuf>,
        /// Serve `/metrics` on a listener of its own (e.g. one only the scraper can reach),
        /// not on the gateway's.
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<SocketAddr>,
        /// Serve `/metrics` on the gateway's listener to requests with
        /// `Authorization: Bearer <KEY>` (also read from FAIRSHARE_METRICS_KEY). Without this
        /// or --metrics-listen there is no /metrics: it names every tenant.
        #[arg(long, value_name = "KEY", value_parser = clap::builder::NonEmptyStringValueParser::new())]
        metrics_key: Option<String>,
        /// The most a client may take to send a request head; idle keep-alive connections
        /// are closed after it too.
        #[arg(long, default_value = "10s", value_parser = parse_duration, allow_hyphen_values = true)]
        header_timeout: Duration,
        /// The most a request may take (answered 503 past it).
        #[arg(long, default_value = "30s", value_parser = parse_duration, allow_hyphen_values = true)]
        request_timeout: Duration,
        /// The most connections open at once. Past it, a new connection closes the oldest one
        /// that has not sent a whole request head; when every one has, new ones wait in the
        /// listen queue.
        #[arg(
            long,
            default_value_t = 1024,
            allow_negative_numbers = true,
            value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
        )]
        max_connections: usize,
        /// Also log every decision (tracing target `tower_fairshare::decision`) on stderr.
        #[arg(long)]
        log_decisions: bool,
    },
    /// Run the acceptance test over loopback HTTP: a heavy tenant at 10x its share, a quiet
    /// tenant, an interactive agent beside a runaway teammate. Exits 1 if a property fails.
    Demo {
        /// How long to offer load, e.g. `30s` (whole periods of the demo policy's 5s).
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        duration: Duration,
        /// Also write an SVG chart of admitted calls per caller per window.
        #[arg(long, value_name = "OUT")]
        svg: Option<PathBuf>,
        /// Let the demo tool lease up to this many calls per caller (`lease = { max = N }`):
        /// the same properties must hold.
        #[arg(long, value_name = "N")]
        lease: Option<u32>,
    },
}

/// The certificate files `fairshare serve` gives a `rediss://` connection.
struct RedisTls {
    ca: Option<PathBuf>,
    cert: Option<(PathBuf, PathBuf)>,
}

impl RedisTls {
    /// Why these files cannot serve a Redis connection (`redis`: whether there is one), checked
    /// before the gateway starts: no Redis to use them with, a file that cannot be read, or one
    /// that holds no PEM certificate (or key).
    fn check(&self, redis: bool) -> Result<(), String> {
        if !redis && (self.ca.is_some() || self.cert.is_some()) {
            return Err("--redis-ca and --redis-cert need --redis (or FAIRSHARE_REDIS_URL)".into());
        }
        let pem = |path: &PathBuf, what: &str, marker: &str| {
            let text =
                std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            match text.windows(marker.len()).any(|w| w == marker.as_bytes()) {
                true => Ok(()),
                false => Err(format!(
                    "{} holds no PEM {what} (`{marker}`)",
                    path.display()
                )),
            }
        };
        if let Some(ca) = &self.ca {
            pem(ca, "certificate", "-----BEGIN CERTIFICATE-----")?;
        }
        if let Some((cert, key)) = &self.cert {
            pem(cert, "certificate", "-----BEGIN CERTIFICATE-----")?;
            pem(key, "private key", "PRIVATE KEY-----")?;
        }
        Ok(())
    }

    /// `builder` with the certificates read from their files, or which file could not be read.
    fn apply(
        &self,
        mut builder: tower_fairshare::store::redis::RedisStoreBuilder,
    ) -> Result<tower_fairshare::store::redis::RedisStoreBuilder, String> {
        let read =
            |p: &PathBuf| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
        if let Some(ca) = &self.ca {
            builder = builder.ca_certificate_pem(read(ca)?);
        }
        if let Some((cert, key)) = &self.cert {
            builder = builder.client_certificate_pem(read(cert)?, read(key)?);
        }
        Ok(builder)
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    Period::parse(text).map(|p| Duration::from_micros(p.as_micros()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { policy } => check(&policy),
        Command::Simulate {
            policy,
            scenario,
            json,
            svg,
            redis,
        } => run_simulation(&policy, &scenario, json, svg.as_deref(), redis.as_deref()),
        Command::Serve {
            policy,
            keys,
            listen,
            redis,
            redis_ca,
            redis_cert,
            redis_key,
            metrics_listen,
            metrics_key,
            header_timeout,
            request_timeout,
            max_connections,
            log_decisions,
        } => {
            init_logging(log_decisions);
            let options = ServeOptions {
                listen,
                redis: redis
                    .or_else(|| std::env::var("FAIRSHARE_REDIS_URL").ok())
                    .filter(|u| !u.trim().is_empty()),
                redis_tls: RedisTls {
                    ca: redis_ca,
                    cert: redis_cert.zip(redis_key),
                },
                metrics_listen,
                metrics_key: metrics_key
                    .or_else(|| std::env::var("FAIRSHARE_METRICS_KEY").ok())
                    .filter(|k| !k.trim().is_empty()),
                limits: cli::serve::Limits {
                    header_timeout,
                    max_connections,
                    request_timeout,
                },
            };
            if let Err(e) = options.redis_tls.check(options.redis.is_some()) {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
            serve(&policy, &keys, options)
        }
        Command::Demo {
            duration,
            svg,
            lease,
        } => runtime().block_on(cli::demo::run(duration, svg.as_deref(), lease)),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Warnings and errors on stderr (store faults, lost Redis state, rejected reloads); every
/// decision too with `--log-decisions`.
fn init_logging(decisions: bool) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::prelude::*;
    let decision_level = if decisions {
        LevelFilter::DEBUG
    } else {
        LevelFilter::OFF
    };
    let filter = Targets::new()
        .with_default(LevelFilter::INFO)
        .with_target("tower_fairshare::decision", decision_level);
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .with_filter(filter),
        )
        .try_init();
}

struct ServeOptions {
    listen: SocketAddr,
    redis: Option<String>,
    redis_tls: RedisTls,
    metrics_listen: Option<SocketAddr>,
    metrics_key: Option<String>,
    limits: cli::serve::Limits,
}

/// The listen queue asked of the kernel (which caps it at `net.core.somaxconn`): deep enough
/// that the connections a flood brings back at once do not push a normal client's out.
const LISTEN_QUEUE: u32 = 4096;

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, ExitCode> {
    let listen = || {
        let socket = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(LISTEN_QUEUE)
    };
    listen().map_err(|e| {
        eprintln!("error: cannot listen on {addr}: {e}");
        ExitCode::from(1)
    })
}

fn serve(policy_path: &Path, keys_path: &Path, o: ServeOptions) -> ExitCode {
    let policy = match load(policy_path) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let keys = match Keys::from_path(keys_path) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    for w in policy.warnings() {
        eprintln!("warning: {w}");
    }
    for w in keys.warnings(&policy) {
        eprintln!("warning: {w}");
    }
    let policy_file = policy_path.to_owned();
    runtime().block_on(async move {
        match serve_gateway(policy, keys, policy_file, o).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(code) => code,
        }
    })
}

/// What the gateway runs once it has stopped: the limiter's shutdown (leases and permits
/// given back).
type Finish = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Serves the gateway (and its metrics listener) until a shutdown signal, then shuts the
/// limiter down.
async fn serve_gateway(
    policy: tower_fairshare::Policy,
    keys: Keys,
    policy_file: PathBuf,
    o: ServeOptions,
) -> Result<(), ExitCode> {
    let tools: Vec<String> = policy.tools().map(|t| t.name().to_owned()).collect();
    let n_keys = keys.len();
    let handle = if o.metrics_listen.is_some() || o.metrics_key.is_some() {
        cli::serve::install_prometheus()
    } else {
        None
    };
    let on_gateway = match (&handle, &o.metrics_key, o.metrics_listen) {
        (Some(h), Some(key), None) => cli::serve::Metrics::WithKey(h.clone(), key.as_str().into()),
        _ => cli::serve::Metrics::Off,
    };
    // The console names every listed tenant: only with the metrics key.
    let console = match &o.metrics_key {
        Some(key) => cli::serve::ConsoleAccess::WithKey(key.as_str().into()),
        None => cli::serve::ConsoleAccess::Off,
    };
    let (app, finish) = match &o.redis {
        None => {
            let limiter = tower_fairshare::Limiter::new(policy);
            gateway(limiter, keys, on_gateway, console, o.limits, policy_file)
        }
        Some(url) => {
            let limiter = on_redis(policy, url, &o.redis_tls).await?;
            gateway(limiter, keys, on_gateway, console, o.limits, policy_file)
        }
    };
    let listener = bind(o.listen).await?;
    let metrics_listener = match (o.metrics_listen, &handle) {
        (Some(a), Some(_)) => Some(bind(a).await?),
        _ => None,
    };
    let addr = listener
        .local_addr()
        .expect("a bound socket has an address");
    // Scripts and tests read this line to learn the port.
    sayln!("fairshare serve: listening on http://{addr}");
    let metrics_note = match (&metrics_listener, &o.metrics_key) {
        (Some(l), _) => {
            let a = l.local_addr().expect("a bound socket has an address");
            format!("metrics at http://{a}/metrics")
        }
        (None, Some(_)) if handle.is_some() => {
            "metrics at /metrics with `Authorization: Bearer <key>`".to_owned()
        }
        _ => "no /metrics (--metrics-listen or --metrics-key)".to_owned(),
    };
    sayln!(
        "  tools: {} (call /tools/{{name}}, any method); {n_keys} keys, sent in header {}; {metrics_note}",
        tools.join(", "),
        cli::serve::API_KEY
    );
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    if let (Some(l), Some(h)) = (metrics_listener, handle) {
        let app = cli::serve::metrics_router(h, o.limits);
        tokio::spawn(cli::serve::run(l, app, o.limits, std::future::pending()));
    }
    let served = cli::serve::run(listener, app, o.limits, shutdown_signal()).await;
    finish.await;
    served.map_err(|e| {
        eprintln!("error: the server stopped: {e}");
        ExitCode::from(1)
    })
}

/// The gateway deciding with `limiter`, which reloads the policy file when it changes, and
/// the limiter's shutdown.
fn gateway<S: tower_fairshare::Store, C: tower_fairshare::Clock>(
    limiter: tower_fairshare::Limiter<S, C>,
    keys: Keys,
    metrics: cli::serve::Metrics,
    console: cli::serve::ConsoleAccess,
    limits: cli::serve::Limits,
    policy_file: PathBuf,
) -> (axum::Router, Finish) {
    watch_policy(limiter.clone(), policy_file);
    let finish = finish_with(limiter.clone());
    let router = cli::serve::router_with(limiter, keys, metrics, console, limits);
    (router, finish)
}

/// A limiter on the Redis at `url`, connected lazily: a replica starts while Redis is down,
/// and connects when it is back.
async fn on_redis(
    policy: tower_fairshare::Policy,
    url: &str,
    tls: &RedisTls,
) -> Result<tower_fairshare::Limiter<tower_fairshare::store::RedisStore>, ExitCode> {
    let builder = tls
        .apply(tower_fairshare::store::RedisStore::builder(url))
        .map_err(|e| {
            eprintln!("error: {e}");
            ExitCode::from(1)
        })?;
    let store = builder.connect_lazy().map_err(|e| {
        eprintln!("error: cannot use Redis at {url}: {e}");
        ExitCode::from(1)
    })?;
    if let Err(e) = store.check_health().await {
        eprintln!("warning: Redis at {url} does not answer ({e}): each tool's on_store_error applies until it does");
    }
    let clock = tower_fairshare::SystemClock;
    Ok(tower_fairshare::Limiter::with_store(policy, store, clock))
}

/// The limiter's shutdown, to run once the gateway has stopped.
fn finish_with<S: tower_fairshare::Store, C: tower_fairshare::Clock>(
    limiter: tower_fairshare::Limiter<S, C>,
) -> Finish {
    Box::pin(async move { limiter.shutdown().await })
}

/// Reloads the policy file on SIGHUP and whenever it changes (checked every second). An
/// invalid file is rejected with the error logged, and the policy in force stays.
fn watch_policy<S: tower_fairshare::Store, C: tower_fairshare::Clock>(
    limiter: tower_fairshare::Limiter<S, C>,
    path: PathBuf,
) {
    tokio::spawn(async move {
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let mut seen = modified(&path);
        #[cfg(unix)]
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut every = tokio::time::interval(Duration::from_secs(1));
        loop {
            #[cfg(unix)]
            let signalled = {
                let hup_recv = async {
                    match hup.as_mut() {
                        Some(h) => {
                            h.recv().await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                };
                tokio::select! {
                    _ = every.tick() => false,
                    _ = hup_recv => true,
                }
            };
            #[cfg(not(unix))]
            let signalled = {
                every.tick().await;
                false
            };
            let now = modified(&path);
            if signalled || now != seen {
                seen = now;
                // The limiter logs the outcome (the reload, or why the file was rejected).
                let _ = limiter.reload_from_path(&path);
            }
        }
    });
}

/// Ctrl-C, or SIGTERM (what container runtimes send) on Unix.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn load(path: &Path) -> Result<Policy, ExitCode> {
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

fn check(path: &Path) -> ExitCode {
    let policy = match load(path) {
        Ok(p) => p,
        Err(code) => return code,
    };
    for w in policy.warnings() {
        sayln!("warning: {w}");
    }
    for t in policy.allocation().tools {
        sayln!(
            "tool {}: {} {} per {}, burst {}, spare {} split by weight{}",
            t.name,
            num(t.capacity),
            t.unit,
            t.period,
            num(t.burst),
            num(t.spare),
            budgets(&t.budgets)
        );
        sayln!(
            "  {:<28} {:>8} {:>8} {:>8} {:>8} {:>8}  budgets",
            "tenant / instance",
            "floor",
            "weight",
            "share",
            "ceiling",
            "burst"
        );
        for r in &t.tenants {
            let name = tenant_label(r);
            sayln!(
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
                sayln!(
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
        lending(&t);
    }
    sayln!("ok: {} is valid", path.display());
    ExitCode::SUCCESS
}

/// What capacity can go unused, and why: floors are kept for their tenants (never lent), and a
/// tenant calling alone gets at most its ceiling (floor + share unless raised).
fn lending(t: &tower_fairshare::policy::ToolAllocation) {
    let listed = || t.tenants.iter().filter(|r| r.name != "*");
    let floors: f64 = listed().map(|r| r.floor).sum();
    sayln!(
        "  unused capacity: {} of {} a period are tenants' floors, kept for them (not lent while they are idle)",
        num(floors),
        num(t.capacity)
    );
    if t.tenants.is_empty() {
        // No caller is admitted: the policy's warning says so; nothing to lend or leave idle.
        return;
    }
    let alone: Vec<String> = t
        .tenants
        .iter()
        .map(|r| {
            format!(
                "{} {} ({} unused)",
                tenant_label(r),
                num(r.alone_ceiling),
                num((t.capacity - r.alone_ceiling).max(0.0))
            )
        })
        .collect();
    let templates: Vec<String> = t
        .tenants
        .iter()
        .filter(|r| r.name == "*")
        .map(|r| format!("{} (weight {})", tenant_label(r), num(r.weight)))
        .collect();
    if !templates.is_empty() {
        let without: Vec<String> = listed()
            .filter(|r| r.alone_ceiling != r.ceiling)
            .map(|r| format!("{} {}", r.name, num(r.alone_ceiling)))
            .collect();
        if !without.is_empty() {
            sayln!(
                "  shares and ceilings above count one active tenant of each template: {}; each one more lowers the listed tenants' shares, and with none active the ceilings are {}",
                templates.join(", "),
                without.join(", ")
            );
        }
    }
    sayln!(
        "  a tenant calling alone gets at most its ceiling: {}; to lend it more, raise its `ceiling` or set the tool's `default_ceiling = \"capacity\"`",
        alone.join(", ")
    );
    let ceilings: f64 = listed().map(|r| r.ceiling).sum();
    if t.tenants.iter().all(|r| r.name != "*") && ceilings < t.capacity {
        sayln!(
            "  even with every tenant busy, {} a period go unused: the ceilings add up to {}",
            num(t.capacity - ceilings),
            num(ceilings)
        );
    }
}

/// How `check` names a row of the allocation table: a listed tenant by name, a template by
/// what it governs.
fn tenant_label(r: &tower_fairshare::policy::TenantAllocation) -> String {
    match (&*r.name, &r.plan) {
        ("*", Some(plan)) => format!("(plan {plan})"),
        ("*", None) => "(default tenant)".to_owned(),
        (name, _) => name.to_owned(),
    }
}

fn budgets(b: &[(String, f64)]) -> String {
    if b.is_empty() {
        String::new()
    } else {
        let parts: Vec<String> = b.iter().map(|(p, m)| format!("{}/{p}", num(*m))).collect();
        format!(" {}", parts.join(", "))
    }
}

fn run_simulation(
    policy_path: &Path,
    scenario_path: &Path,
    json: bool,
    svg: Option<&Path>,
    redis: Option<&str>,
) -> ExitCode {
    let policy = match load(policy_path) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let scenario = match Scenario::from_path(scenario_path) {
        Ok(s) => s,
        Err(e) => return scenario_failed(scenario_path, &e),
    };
    warn_of_refused_callers(&policy, &scenario, scenario_path);
    if let Some(out) = svg {
        if let Err(e) = svg_target(out, &[policy_path, scenario_path]) {
            eprintln!("error: --svg {}: {e}", out.display());
            return ExitCode::from(1);
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a single-threaded runtime");
    let run = async {
        match redis {
            None => Ok(simulate(&policy, &scenario).await),
            Some(url) => simulate_on_redis(&policy, &scenario, url).await,
        }
    };
    let report = match rt.block_on(run) {
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
        Ok(r) => r,
    };
    let report = match report {
        Ok(r) => r,
        Err(e) => return scenario_failed(scenario_path, &e),
    };
    let tool = policy.tool(&scenario.tool).expect("checked by simulate");
    // The report first: a chart that cannot be written loses nothing of the run.
    if json {
        sayln!(
            "{}",
            serde_json::to_string(&report).expect("report serializes")
        );
    } else {
        say!("{}", report.to_table(tool.capacity(), tool.period()));
    }
    if let Some(out) = svg {
        let name = scenario_path.file_name().unwrap_or_default();
        let title = format!("{} — {}", scenario.tool, name.to_string_lossy());
        let chart =
            fairshare::chart::svg(&report, &title, tool.capacity(), &tool.period().to_string());
        if let Err(e) = std::fs::write(out, chart) {
            eprintln!("error: cannot write {}: {e}", out.display());
            return ExitCode::from(1);
        }
    }
    ExitCode::SUCCESS
}

/// Warns of every scenario caller the policy refuses whoever it is, or whose every call costs
/// more than the tool's capacity: its calls will all be refused.
fn warn_of_refused_callers(policy: &tower_fairshare::Policy, scenario: &Scenario, path: &Path) {
    let Some(tool) = policy.tool(&scenario.tool) else {
        return;
    };
    let limiter = tower_fairshare::Limiter::new(policy.clone());
    for (i, c) in scenario.callers.iter().enumerate() {
        let why = match limiter.call_keys(&c.caller(), &scenario.tool) {
            Err(r) => r.to_string(),
            Ok(_) if c.cost() > tool.capacity() => format!(
                "its cost {} is more than the tool's capacity ({} a period)",
                num(c.cost()),
                num(tool.capacity())
            ),
            Ok(_) => continue,
        };
        let file = path.display();
        eprintln!("warning: {file}: caller[{i}]: every call is refused: {why}");
    }
}

/// The scenario run on the Redis at `url`, in a namespace of its own (runs never see each
/// other's state), cleared after.
async fn simulate_on_redis(
    policy: &tower_fairshare::Policy,
    scenario: &Scenario,
    url: &str,
) -> Result<Result<fairshare::simulate::Report, ScenarioError>, String> {
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let namespace = format!(
        "simulate-{}-{}",
        std::process::id(),
        since_epoch.map_or(0, |d| d.as_micros())
    );
    let store = tower_fairshare::store::RedisStore::builder(url)
        .injected_clock()
        .namespace(namespace)
        .connect()
        .await
        .map_err(|e| format!("cannot use Redis at {url}: {e}"))?;
    let clock = tower_fairshare::ManualClock::new(fairshare::simulate::EPOCH);
    let sweeper = store.clone();
    let report = fairshare::simulate::simulate_with(policy, store, &clock, scenario).await;
    // An injected clock's keys outlive their virtual expiry by ten real minutes: clear this
    // run's namespace now (far past every expiry; one server only).
    let _ = sweeper
        .sweep(tower_fairshare::Timestamp::from_micros(u64::MAX / 4))
        .await;
    Ok(report)
}

/// A scenario that cannot run: the error, naming the file (a read error names it already).
fn scenario_failed(path: &Path, e: &ScenarioError) -> ExitCode {
    match e {
        ScenarioError::Io { .. } => eprintln!("error: {e}"),
        _ => eprintln!("error: {}: {e}", path.display()),
    }
    ExitCode::from(1)
}

/// Why `out` cannot take the chart, checked before the run: it is one of the `inputs`, or its
/// folder does not exist.
fn svg_target(out: &Path, inputs: &[&Path]) -> Result<(), String> {
    let same = |a: &Path, b: &Path| matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b);
    if let Some(input) = inputs.iter().find(|i| same(out, i)) {
        return Err(format!(
            "is the input file {}: write the chart to another file",
            input.display()
        ));
    }
    match out.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) if !dir.is_dir() => Err(format!("the folder {} does not exist", dir.display())),
        _ => Ok(()),
    }
}

/// Stdout failed: a closed pipe ends the command quietly (exit 0), anything else is an error.
fn output_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("error: cannot write the output: {e}");
    std::process::exit(1);
}
