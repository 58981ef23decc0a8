//! The Redis store: one exact budget shared by every replica, on Redis and Redis Cluster.
//!
//! Every decision is **one Lua script run by `EVALSHA`** (reloaded by `EVAL` when the server
//! answers `NOSCRIPT`): one round trip that reads every level, runs the same decision as
//! [`engine::decide`](crate::admission::engine::decide) — operation for operation, in the same
//! `f64` arithmetic — and writes the result back, atomically. Nothing a replica holds locally
//! takes part in the decision, so any number of replicas share one exact budget: SPEC §3.2's
//! capacity bound holds with no overshoot from races.
//!
//! # Time
//!
//! By default the script reads Redis `TIME`, so replicas with skewed clocks still agree (Redis 7
//! replicates scripts by their effects, so reading the time is allowed).
//! [`RedisStoreBuilder::injected_clock`] makes the store use the limiter's clock (the `now` of
//! the plan) instead: for tests and `fairshare simulate --redis` over a virtual clock. TTLs
//! always run on Redis's own clock; with an injected clock that runs faster than real time, call
//! [`RedisStore::sweep`] to drop what is idle in virtual time.
//!
//! # Key layout
//!
//! Keys come from [`crate::key`] (injective, versioned, length-prefixed), behind an optional
//! [namespace](RedisStoreBuilder::namespace):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `fs2{<tool>}T` | string | the tool: shared pool, window counters, budgets, in flight |
//! | `fs2{<tool>}T#` | zset | template tenants tracked now (member: tenant key, score: a lower bound of its tracked-until time, µs) |
//! | `fs2{<tool>}t<tenant>` / `u<client>` | string | a tenant / an untenanted caller |
//! | `fs2{<tool>}t<tenant>#` | zset | the tenant's template instances tracked now (same scoring) |
//! | `fs2{<tool>}i<tenant><instance>` | string | an instance |
//!
//! A level's string is a handful of little-endian doubles (layout version mark, its
//! `NodeState`, its tracked-until time as a template caller, the count and least score of its
//! own tracker, the bucket rates and depths it was charged with, and its budget counters; the
//! exact layout is described at the top of `admit.lua`). A string without the mark (an older
//! layout) reads as absent. Numbers travel between Rust and Lua as packed doubles too, so
//! nothing is rounded through text. Every key carries a TTL: for a state, until the engine's
//! expiry (the moment the state is equivalent to a fresh one) and, for a template caller, its
//! tracked-until time; for a tracker, until its latest member's time is over; and at least
//! [`permit_ttl`](RedisStoreBuilder::permit_ttl) while calls hold concurrency permits at a
//! level, so a replica that dies holding permits cannot shrink a concurrency cap forever.
//! A TTL is only re-set when it must grow, and then up to 1/16 of a period ahead (setting a
//! TTL on every call costs as much as a read), so a busy key may outlive its state by that
//! much. With an injected clock, TTLs assume the virtual time runs at least as fast as real
//! time (tests and simulations do).
//!
//! ## Template trackers
//!
//! A template caller counts as tracked until `now + period` after each admitted call, and a
//! level's count excludes expired members (the engine's rule, which the memory store keeps
//! exactly). Here the exact tracked-until time lives in the member's own state (read by the
//! decision anyway); the zset holds a lower bound of it per member, and the parent's state
//! holds the zset's size and least score. Only when `now` reaches that least score does a
//! decision look at the members whose score has passed: re-scored to their exact time if it is
//! later, removed if it is over. So a decision costs no tracker command unless a caller is new
//! or a tracked time has passed (each member at most once per period), and the count is exact.
//!
//! ## What it means on Redis Cluster
//!
//! The hash tag `{<tool>}` is the tool's name only, so **every key of one tool lives in one
//! slot**, on one master: the script runs unchanged on a cluster (no `CROSSSLOT`), and one
//! tool's whole budget is exact. The flip side: one tool's traffic is served by one master.
//! Load spreads over a cluster **by tool**, not by tenant; a single very hot tool is bounded by
//! what one Redis core does (≈ the script's cost inside Redis per decision). Split a hot tool
//! into several tools (e.g. per region) if one master is not enough.
//!
//! # Faults
//!
//! Each call has a timeout ([`RedisStoreBuilder::timeout`], default 250 ms) mapped to
//! [`StoreError::Timeout`]; connection failures map to [`StoreError::Unavailable`]. The
//! limiter then applies the tool's `on_store_error` (`deny` by default). Every store error is
//! logged (`tracing`) and counted ([`RedisStore::errors`]). The default connection, redis-rs's
//! multiplexed [`ConnectionManager`], reconnects by itself when Redis returns; this store sets
//! its reconnect backoff to at most 200 ms so calls succeed again promptly.
//!
//! # Refusal cache
//!
//! After a refusal that names a retry time *t* (a rate or a budget), the same caller's calls
//! (same [`CallKeys`], same cost) on this replica are refused locally until *t*,
//! without a Redis command: a parasite's flood costs no round trips. Refusals whose retry time
//! is a guess (concurrency, too many tracked callers) are not cached, nor are any refusals of
//! a call that passes a concurrency cap (a slot taken meanwhile would make the true answer
//! `concurrency_exceeded`, which is checked first); a local refund or a downward correction
//! at a tool forgets that tool's cached refusals.
//!
//! # Performance
//!
//! One decision is one round trip, but the script does a nested decision's work (three
//! levels, trackers, budgets). The script is written for Redis's Lua: one `MGET` for the
//! states, a `SET … KEEPTTL` per level (the TTL only when it must grow), no tracker command
//! on the common path, flat arrays instead of records, min/max written out, literal `struct`
//! formats. A nested decision with template tenant and instance and a daily budget costs 6
//! Redis commands (`EVALSHA`, `TIME`, `MGET`, three `SET`s; the previous script ran 18) and
//! about 240k CPU instructions inside Redis (callgrind; the previous script: about 650k)
//! against about 42k for a one-key GCRA script: the script's own work, not the round trip,
//! bounds what one Redis core serves (measured ratios: `scripts/bench-compare`). Packed doubles are the cheapest encoding
//! we found in Redis's Lua (`%.17g` text is ≈ 15× slower, `cmsgpack` no faster than
//! `struct`); most of what remains is the fixed cost of `redis.call` (≈ 4–7k instructions
//! each) and of `struct.pack`/`unpack` (≈ 350 per double). The multiplexed connection is the
//! default: a bb8 pool of 16 was no faster and, at 64 tasks in flight, left one task with a
//! single call in 3 s (starved), while every multiplexed task progressed.
//!
//! ```no_run
//! use tower_fairshare::store::RedisStore;
//! use tower_fairshare::{Limiter, Policy, SystemClock};
//! # async fn run(policy: Policy) -> Result<(), tower_fairshare::StoreError> {
//! let store = RedisStore::builder("redis://127.0.0.1:6379").connect().await?;
//! let limiter = Limiter::with_store(policy, store, SystemClock);
//! # let _ = limiter; Ok(()) }
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use super::{Admission, CallKeys, Decision, Store, StoreError};
use crate::admission::engine::{BudgetCounter, Charge, LevelCharge, LevelView, NodeState};
use crate::admission::{Plan, Reason, Refusal, Scope};
use crate::clock::Timestamp;
use crate::policy::numbers::{level_numbers, LevelNumbers};
use crate::policy::{Budget, BudgetPeriod, LevelPolicy};

const COMMON: &str = include_str!("common.lua");

/// The Lua sources, each with the shared helpers in front.
fn source(body: &str) -> String {
    let mut s = String::with_capacity(COMMON.len() + body.len() + 1);
    s.push_str(COMMON);
    s.push('\n');
    s.push_str(body);
    s
}

#[derive(Debug)]
struct Script {
    code: String,
    hash: String,
}

impl Script {
    /// A script with the shared helpers of `common.lua` in front.
    fn new(body: &str) -> Self {
        Script::standalone(source(body))
    }

    fn standalone(code: String) -> Self {
        let hash = redis::Script::new(&code).get_hash().to_owned();
        Script { code, hash }
    }
}

#[derive(Debug)]
struct Scripts {
    admit: Script,
    adjust: Script,
    release: Script,
    sweep: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            admit: Script::standalone(include_str!("admit.lua").to_owned()),
            adjust: Script::new(include_str!("adjust.lua")),
            release: Script::new(include_str!("release.lua")),
            sweep: Script::new(include_str!("sweep.lua")),
        }
    }
}

/// Where the store reads the time.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum TimeSource {
    /// Redis `TIME`, inside the script: every replica agrees (the default).
    #[default]
    Redis,
    /// The `now` of each plan (the limiter's clock): for tests and simulations.
    Injected,
}

/// How the store talks to Redis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Connection {
    /// One multiplexed connection that reconnects by itself (redis-rs `ConnectionManager`):
    /// the default, measured fastest and starvation-free here (see `benches/redis.rs`).
    Multiplexed,
    /// A Redis Cluster (redis-rs async cluster connection), from these seed nodes.
    Cluster(Vec<String>),
    /// A bb8 pool of this many multiplexed connections.
    #[cfg(feature = "redis-bb8")]
    Pool(u32),
}

/// Configures and connects a [`RedisStore`].
#[derive(Clone, Debug)]
pub struct RedisStoreBuilder {
    url: String,
    connection: Connection,
    timeout: Duration,
    time: TimeSource,
    refusal_cache: bool,
    refusal_cache_capacity: usize,
    permit_ttl: Duration,
    namespace: String,
}

impl RedisStoreBuilder {
    /// Per-call timeout (default 250 ms): past it a call fails with [`StoreError::Timeout`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Use the limiter's clock (the plan's `now`) instead of Redis `TIME`.
    pub fn injected_clock(mut self) -> Self {
        self.time = TimeSource::Injected;
        self
    }

    /// Where the time comes from.
    pub fn time_source(mut self, time: TimeSource) -> Self {
        self.time = time;
        self
    }

    /// Turns the local refusal cache on (the default) or off.
    pub fn refusal_cache(mut self, on: bool) -> Self {
        self.refusal_cache = on;
        self
    }

    /// How many callers' refusals the local cache holds at most (default 10,000).
    pub fn refusal_cache_capacity(mut self, capacity: usize) -> Self {
        self.refusal_cache_capacity = capacity;
        self
    }

    /// The least TTL of a level while calls hold concurrency permits there (default 10 min).
    /// A call holding a permit longer than this, at a level that sees no other call, may lose
    /// its count; a replica that died holding permits gives them back after it.
    pub fn permit_ttl(mut self, ttl: Duration) -> Self {
        self.permit_ttl = ttl;
        self
    }

    /// A prefix for every key (no `{` or `}`, so the hash tag stays the tool's): lets several
    /// deployments or test runs share one Redis.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// Use a bb8 pool of `size` connections instead of the multiplexed connection.
    #[cfg(feature = "redis-bb8")]
    pub fn pool(mut self, size: u32) -> Self {
        self.connection = Connection::Pool(size.max(1));
        self
    }

    /// Connects. Must run inside the tokio runtime that will drive the store.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        if self.namespace.contains(['{', '}']) {
            return Err(StoreError::Protocol(format!(
                "namespace `{}` must not contain `{{` or `}}`: they would change the hash tag",
                self.namespace
            )));
        }
        let unavailable = |e: RedisError| StoreError::Unavailable(e.to_string());
        let backend = match &self.connection {
            Connection::Multiplexed => {
                let client = redis::Client::open(self.url.as_str()).map_err(unavailable)?;
                let config = ConnectionManagerConfig::new()
                    .set_min_delay(Duration::from_millis(20))
                    .set_max_delay(Duration::from_millis(200))
                    .set_number_of_retries(8)
                    .set_connection_timeout(Some(self.timeout.max(Duration::from_millis(100))))
                    .set_response_timeout(None);
                let manager = tokio::time::timeout(
                    self.timeout.max(Duration::from_secs(2)),
                    ConnectionManager::new_with_config(client, config),
                )
                .await
                .map_err(|_| StoreError::Timeout(self.timeout))?
                .map_err(unavailable)?;
                Backend::Multiplexed(manager)
            }
            Connection::Cluster(nodes) => {
                let client = redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(self.timeout.max(Duration::from_millis(100)))
                    .response_timeout(self.timeout.max(Duration::from_millis(100)))
                    .retries(2)
                    .min_retry_wait(10)
                    .max_retry_wait(200)
                    .build()
                    .map_err(unavailable)?;
                let conn = tokio::time::timeout(
                    self.timeout.max(Duration::from_secs(2)),
                    client.get_async_connection(),
                )
                .await
                .map_err(|_| StoreError::Timeout(self.timeout))?
                .map_err(unavailable)?;
                Backend::Cluster(conn)
            }
            #[cfg(feature = "redis-bb8")]
            Connection::Pool(size) => {
                let manager = bb8_redis::RedisConnectionManager::new(self.url.as_str())
                    .map_err(unavailable)?;
                let pool = bb8::Pool::builder()
                    .max_size(*size)
                    .test_on_check_out(false)
                    .connection_timeout(self.timeout.max(Duration::from_millis(100)))
                    .build(manager)
                    .await
                    .map_err(unavailable)?;
                Backend::Pool(pool)
            }
        };
        Ok(RedisStore {
            backend,
            scripts: Scripts::new(),
            timeout: self.timeout,
            time: self.time,
            permit_ttl_ms: self.permit_ttl.as_millis() as f64,
            namespace: self.namespace,
            cache: self.refusal_cache.then(|| RefusalCache {
                map: Mutex::new(HashMap::new()),
                capacity: self.refusal_cache_capacity.max(1),
            }),
            errors: AtomicU64::new(0),
            cached_refusals: AtomicU64::new(0),
        })
    }
}

enum Backend {
    Multiplexed(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
    #[cfg(feature = "redis-bb8")]
    Pool(bb8::Pool<bb8_redis::RedisConnectionManager>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Multiplexed(_) => "Multiplexed",
            Backend::Cluster(_) => "Cluster",
            #[cfg(feature = "redis-bb8")]
            Backend::Pool(_) => "Pool",
        })
    }
}

impl Backend {
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        match self {
            Backend::Multiplexed(c) => cmd.query_async(&mut c.clone()).await,
            Backend::Cluster(c) => cmd.query_async(&mut c.clone()).await,
            #[cfg(feature = "redis-bb8")]
            Backend::Pool(p) => {
                let mut c = p.get().await.map_err(|e| match e {
                    bb8::RunError::User(e) => e,
                    bb8::RunError::TimedOut => RedisError::from((
                        ErrorKind::Io,
                        "timed out waiting for a pooled connection",
                    )),
                })?;
                cmd.query_async(&mut *c).await
            }
        }
    }
}

/// Keeps admission state in Redis (or Redis Cluster), shared by every replica. See the
/// [module docs](self) for the script, the key layout and the failure modes.
#[derive(Debug)]
pub struct RedisStore {
    backend: Backend,
    scripts: Scripts,
    timeout: Duration,
    time: TimeSource,
    permit_ttl_ms: f64,
    namespace: String,
    cache: Option<RefusalCache>,
    errors: AtomicU64,
    cached_refusals: AtomicU64,
}

impl RedisStore {
    /// A builder for a store on the Redis server at `url` (`redis://host:port/db`).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            connection: Connection::Multiplexed,
            timeout: Duration::from_millis(250),
            time: TimeSource::Redis,
            refusal_cache: true,
            refusal_cache_capacity: 10_000,
            permit_ttl: Duration::from_secs(600),
            namespace: String::new(),
        }
    }

    /// A builder for a store on the Redis Cluster reachable through these seed nodes.
    pub fn cluster_builder<I, S>(nodes: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let nodes: Vec<String> = nodes.into_iter().map(Into::into).collect();
        let mut b = RedisStore::builder(nodes.first().cloned().unwrap_or_default());
        b.connection = Connection::Cluster(nodes);
        b
    }

    /// A store on the Redis server at `url` with the defaults: multiplexed connection, Redis
    /// `TIME`, 250 ms timeout, refusal cache on.
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        RedisStore::builder(url).connect().await
    }

    /// Store errors so far (timeouts, unreachable Redis, unexpected answers).
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Calls refused from the local refusal cache, without a Redis command.
    pub fn cached_refusals(&self) -> u64 {
        self.cached_refusals.load(Ordering::Relaxed)
    }

    /// Where the store reads the time.
    pub fn time_source(&self) -> TimeSource {
        self.time
    }

    fn state_keys(&self, keys: &CallKeys) -> [Option<String>; 3] {
        let mut encoded = keys.encoded();
        if !self.namespace.is_empty() {
            for k in encoded.iter_mut().flatten() {
                k.insert_str(0, &self.namespace);
            }
        }
        encoded
    }

    fn now_arg(&self, now: Timestamp) -> f64 {
        match self.time {
            TimeSource::Redis => -1.0,
            TimeSource::Injected => now.as_micros() as f64,
        }
    }

    /// Runs `script` by EVALSHA, loading it by EVAL when Redis does not know it.
    async fn eval<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> redis::RedisResult<T> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&script.hash).arg(keys.len()).arg(keys).arg(args);
        match self.backend.query(&cmd).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(&script.code).arg(keys.len()).arg(keys).arg(args);
                self.backend.query(&cmd).await
            }
            r => r,
        }
    }

    /// Bounds `f` by the timeout; maps, logs and counts its errors.
    async fn guarded<T>(
        &self,
        what: &'static str,
        tool: &str,
        f: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        let err = match tokio::time::timeout(self.timeout, f).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => map_error(e, self.timeout),
            Err(_) => StoreError::Timeout(self.timeout),
        };
        self.errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(store = "redis", op = what, tool, error = %err, "rate-limit store call failed");
        Err(err)
    }

    async fn decide_remote(
        &self,
        plan: &Plan<'_>,
        keys: &CallKeys,
    ) -> Result<Decision, StoreError> {
        let [tool_key, tenant_key, instance_key] = self.state_keys(keys);
        let tool_key = tool_key.unwrap_or_default();
        let tenant_key = tenant_key.unwrap_or_default();
        let tool_tracker = tracker_key(&tool_key);
        let tenant_tracker = tracker_key(&tenant_key);
        let instance_key = instance_key.filter(|_| plan.instance.is_some());
        let mut key_list: Vec<&str> = vec![&tool_key, &tool_tracker, &tenant_key, &tenant_tracker];
        if let Some(k) = &instance_key {
            key_list.push(k);
        }
        let blob = encode_plan(plan, self.now_arg(plan.now), self.permit_ttl_ms);
        let sent = Instant::now();
        let reply: Value = self
            .guarded(
                "decide",
                &keys.tool,
                self.eval(&self.scripts.admit, &key_list, &[&blob]),
            )
            .await?;
        let (decision, sure_wait) = parse_decision(reply, plan, keys).map_err(|e| {
            self.errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(store = "redis", tool = %keys.tool, error = %e, "unexpected answer from the admission script");
            e
        })?;
        if let (Decision::Refused(r), Some(cache)) = (&decision, &self.cache) {
            cache.remember(keys, plan, r, sure_wait, sent, self.time);
        }
        Ok(decision)
    }

    /// Drops every state that is equivalent to fresh state at `now` and every tracker entry
    /// whose time is over: Redis's own TTLs do that in real time; this does it at a virtual
    /// `now` (an injected clock). Scans the keys of this store's namespace on one server: on a
    /// cluster, sweep each master through a store connected to it alone. Returns how many keys
    /// were deleted.
    pub async fn sweep(&self, now: Timestamp) -> Result<u64, StoreError> {
        if matches!(self.backend, Backend::Cluster(_)) {
            return Err(StoreError::Protocol(
                "sweep scans one server; on a cluster, rely on the keys' TTLs".into(),
            ));
        }
        let pattern = format!(
            "{}{}*",
            glob_escape(&self.namespace),
            crate::key::KEY_PREFIX
        );
        let mut cursor: u64 = 0;
        let mut deleted = 0u64;
        loop {
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(500);
            let (next, keys): (u64, Vec<String>) =
                self.guarded("sweep", "", self.backend.query(&cmd)).await?;
            // One script per hash tag: a cluster node refuses scripts spanning slots.
            let mut by_tag: HashMap<&str, Vec<&str>> = HashMap::new();
            for k in &keys {
                by_tag.entry(crate::key::hash_tag(k)).or_default().push(k);
            }
            for refs in by_tag.values().flat_map(|v| v.chunks(64)) {
                let now_s = now.as_micros().to_string();
                let n: u64 = self
                    .guarded(
                        "sweep",
                        "",
                        self.eval(&self.scripts.sweep, refs, &[now_s.as_bytes()]),
                    )
                    .await?;
                deleted += n;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }
}

fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The key of the tracker of a level's template children: its state key and `#`. Never a key
/// [`crate::key`] builds (a complete key followed by a byte that cannot start a part), so the
/// two spaces never meet, and it keeps the tool's hash tag.
fn tracker_key(state_key: &str) -> String {
    let mut k = String::with_capacity(state_key.len() + 1);
    k.push_str(state_key);
    k.push('#');
    k
}

fn map_error(e: RedisError, timeout: Duration) -> StoreError {
    if e.is_timeout() {
        return StoreError::Timeout(timeout);
    }
    match e.kind() {
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => StoreError::Protocol(e.to_string()),
        ErrorKind::Server(ServerErrorKind::ResponseError)
            if !e.is_io_error() && !e.is_connection_dropped() =>
        {
            StoreError::Protocol(e.to_string())
        }
        _ => StoreError::Unavailable(e.to_string()),
    }
}

// --- Refusal cache ---------------------------------------------------------------------------

#[derive(Debug)]
struct RefusalCache {
    map: Mutex<HashMap<CallKeys, Cached>>,
    capacity: usize,
}

#[derive(Debug)]
struct Cached {
    refusal: Refusal,
    cost: f64,
    /// Injected clock: valid from `from` until `until` (µs of the plan's clock).
    from: u64,
    until: u64,
    /// Redis clock: valid until this local instant.
    until_instant: Instant,
}

impl RefusalCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<CallKeys, Cached>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers a refusal for `sure_wait` µs: the script's lower bound of when the same call
    /// could pass (the refusal's own retry time is the engine's estimate, which may be later).
    fn remember(
        &self,
        keys: &CallKeys,
        plan: &Plan<'_>,
        r: &Refusal,
        sure_wait: f64,
        sent: Instant,
        time: TimeSource,
    ) {
        // Only waits the script can bound: a concurrency slot or a tracked-caller slot can free
        // up at any moment.
        let cacheable = match r.reason {
            Reason::RateLimited => true,
            Reason::CapExceeded => r.window.as_deref() != Some("callers"),
            _ => false,
        };
        if !(cacheable && r.retryable && sure_wait.is_finite() && sure_wait >= 1000.0) {
            return;
        }
        // Concurrency is checked before rates: where a cap applies, a slot taken meanwhile
        // changes the answer, and only Redis knows.
        let capped = plan.tool.max_concurrency.is_some()
            || plan.tenant.policy.max_concurrency.is_some()
            || plan
                .instance
                .is_some_and(|i| i.policy.max_concurrency.is_some());
        if capped {
            return;
        }
        let wait = Duration::from_micros(sure_wait.floor() as u64);
        let now = plan.now.as_micros();
        let until = now.saturating_add(wait.as_micros() as u64);
        // Redis decided after `sent`, so `sent + wait` is never later than the true time.
        let until_instant = sent + wait;
        let mut map = self.lock();
        if map.len() >= self.capacity && !map.contains_key(keys) {
            let now_i = Instant::now();
            map.retain(|_, c| {
                c.until_instant > now_i && (time == TimeSource::Redis || c.until > now)
            });
            if map.len() >= self.capacity {
                return;
            }
        }
        map.insert(
            keys.clone(),
            Cached {
                refusal: r.clone(),
                cost: plan.cost,
                from: now,
                until,
                until_instant,
            },
        );
    }

    fn lookup(&self, keys: &CallKeys, plan: &Plan<'_>, time: TimeSource) -> Option<Refusal> {
        let mut map = self.lock();
        let c = map.get(keys)?;
        let left = match time {
            TimeSource::Injected => {
                let now = plan.now.as_micros();
                (now >= c.from && now < c.until).then(|| Duration::from_micros(c.until - now))
            }
            TimeSource::Redis => c.until_instant.checked_duration_since(Instant::now()),
        };
        match left {
            Some(left) if !left.is_zero() => {
                // The same call: a different cost may pass, or never pass.
                if (plan.cost - c.cost).abs() > crate::admission::engine::EPS {
                    return None;
                }
                let mut r = c.refusal.clone();
                r.retry_after = Some(left);
                Some(r)
            }
            _ => {
                map.remove(keys);
                None
            }
        }
    }

    fn forget_tool(&self, tool: &str) {
        self.lock().retain(|k, _| &*k.tool != tool);
    }
}

// --- Encoding --------------------------------------------------------------------------------

fn period_code(p: BudgetPeriod) -> f64 {
    match p {
        BudgetPeriod::Hour => 1.0,
        BudgetPeriod::Day => 2.0,
        BudgetPeriod::Month => 3.0,
    }
}

fn period_of(code: f64) -> Option<BudgetPeriod> {
    match code as i64 {
        1 => Some(BudgetPeriod::Hour),
        2 => Some(BudgetPeriod::Day),
        3 => Some(BudgetPeriod::Month),
        _ => None,
    }
}

fn cap(c: Option<u32>) -> f64 {
    c.map_or(-1.0, f64::from)
}

/// Packs doubles, little-endian, straight into the argument bytes.
struct Packer(Vec<u8>);

impl Packer {
    fn put(&mut self, values: &[f64]) {
        for x in values {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }

    fn level(&mut self, p: &LevelPolicy) {
        self.put(&[
            f64::from(u8::from(p.template)),
            p.max_tracked as f64,
            p.weight,
            p.floor,
            f64::from(u8::from(p.ceiling.is_some())),
            p.ceiling.unwrap_or(0.0),
            p.reserved_floor,
            p.children_floor,
            p.burst,
            p.borrow_threshold,
            cap(p.max_concurrency),
            p.configured_child_weight,
            p.default_child.as_ref().map_or(0.0, |d| d.weight),
            p.configured_child_burst,
            p.default_child.as_ref().map_or(0.0, |d| d.burst),
        ]);
    }

    fn budgets(&mut self, list: &[Budget]) {
        self.put(&[list.len() as f64]);
        for b in list {
            self.put(&[period_code(b.period), b.max]);
        }
    }
}

fn pack(v: &[f64]) -> Vec<u8> {
    let mut p = Packer(Vec::with_capacity(v.len() * 8));
    p.put(v);
    p.0
}

/// The plan, as the admission script reads it (see the top of `admit.lua`).
fn encode_plan(plan: &Plan<'_>, now: f64, permit_ttl_ms: f64) -> Vec<u8> {
    let tool = plan.tool;
    let budgets = tool.budgets.len()
        + plan.tenant.policy.budgets.len()
        + plan.instance.map_or(0, |i| i.policy.budgets.len());
    let mut p = Packer(Vec::with_capacity(8 * (13 + 2 * 15 + 3 + 2 * budgets)));
    p.put(&[
        now,
        plan.cost,
        tool.period.as_micros() as f64,
        tool.spare(),
        tool.capacity,
        tool.burst,
        tool.configured_weight,
        tool.default_tenant.as_ref().map_or(0.0, |d| d.weight),
        tool.configured_tenant_burst,
        tool.default_tenant.as_ref().map_or(0.0, |d| d.burst),
        cap(tool.max_concurrency),
        permit_ttl_ms,
        f64::from(u8::from(plan.instance.is_some())),
    ]);
    p.level(plan.tenant.policy);
    if let Some(i) = plan.instance {
        p.level(i.policy);
    }
    p.budgets(&tool.budgets);
    p.budgets(&plan.tenant.policy.budgets);
    if let Some(i) = plan.instance {
        p.budgets(&i.policy.budgets);
    }
    p.0
}

fn unpack(bytes: &[u8]) -> Result<Vec<f64>, StoreError> {
    if bytes.len() % 8 != 0 {
        return Err(StoreError::Protocol(format!(
            "a packed value of {} bytes is not whole doubles",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

struct Reader<'a> {
    v: &'a [f64],
    at: usize,
}

impl Reader<'_> {
    fn next(&mut self) -> Result<f64, StoreError> {
        let x = self.v.get(self.at).copied().ok_or_else(|| {
            StoreError::Protocol("the script's answer is shorter than expected".into())
        })?;
        self.at += 1;
        Ok(x)
    }
}

fn bad(what: &str) -> StoreError {
    StoreError::Protocol(format!("the script answered {what}"))
}

/// The decision, and for a refusal the least time before the same call could pass (what the
/// refusal cache may rely on).
fn parse_decision(
    reply: Value,
    plan: &Plan<'_>,
    keys: &CallKeys,
) -> Result<(Decision, f64), StoreError> {
    let Value::Array(items) = reply else {
        return Err(bad("something other than an array"));
    };
    let mut it = items.into_iter();
    let kind = match it.next() {
        Some(Value::Int(k)) => k,
        _ => return Err(bad("no verdict")),
    };
    let blob = match it.next() {
        Some(Value::BulkString(b)) => b,
        _ => return Err(bad("no numbers")),
    };
    let v = unpack(&blob)?;
    let mut r = Reader { v: &v, at: 0 };
    let now = r.next()?;
    if kind == 0 {
        let label = match it.next() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
            Some(Value::SimpleString(s)) => s,
            _ => String::new(),
        };
        let reason = match r.next()? as i64 {
            1 => Reason::RateLimited,
            2 => Reason::CapExceeded,
            3 => Reason::ConcurrencyExceeded,
            _ => return Err(bad("an unknown refusal reason")),
        };
        let scope = match r.next()? as i64 {
            0 => Scope::Tool,
            1 => Scope::Tenant,
            _ => Scope::Instance,
        };
        let wait = r.next()?;
        let limit = r.next()?;
        let used = r.next()?;
        let has_reset = r.next()? == 1.0;
        let reset_at = r.next()?;
        let window_secs = r.next()?;
        let sure_wait = r.next()?;
        let mut refusal = Refusal::new(reason, &plan.tool.name);
        refusal.tenant = (!plan.untenanted).then(|| plan.tenant.name.to_owned());
        refusal.instance = if plan.untenanted {
            Some(plan.tenant.name.to_owned())
        } else {
            plan.instance.map(|i| i.name.to_owned())
        };
        refusal.scope = Some(scope);
        refusal.window_secs = if label.is_empty() {
            Some(plan.tool.period.as_secs_ceil())
        } else {
            (window_secs >= 0.0).then_some(window_secs as u64)
        };
        refusal.window = Some(if label.is_empty() {
            plan.tool.period.to_string()
        } else {
            label
        });
        refusal.limit = Some(limit);
        refusal.used = Some(used);
        if wait.is_finite() {
            let wait = wait.max(1.0).ceil();
            refusal.retry_after = Some(Duration::from_micros(wait as u64));
            let reset = if has_reset { reset_at } else { now + wait };
            refusal.reset_at = Some(Timestamp(reset as u64));
            refusal.retryable = true;
        }
        return Ok((Decision::Refused(Box::new(refusal)), sure_wait));
    }
    let remaining = r.next()?;
    let slack = r.next()?;
    let n_tenants = r.next()?;
    let n_instances = r.next()?;
    let mut takes = [[0.0f64; 3]; 3];
    for x in takes.iter_mut().flatten() {
        *x = r.next()?;
    }
    // Everything else follows from the policy, `now` and the tracked counts, exactly as the
    // engine computes it (same functions, same f64 operations): the script need not send it.
    let tool = plan.tool;
    let period = tool.period.as_micros() as f64;
    let window = (now / period).floor();
    let next_window = (window + 1.0) * period;
    let at = Timestamp(now as u64);
    let t_pol = plan.tenant.policy;
    let tn = level_numbers(
        t_pol,
        tool.spare(),
        tool.configured_weight + tool.default_tenant.as_ref().map_or(0.0, |d| d.weight) * n_tenants,
    );
    let inn = plan.instance.map(|i| {
        let inner_spare = (tn.ceiling - t_pol.children_floor).max(0.0);
        let inner_weight = t_pol.configured_child_weight
            + t_pol.default_child.as_ref().map_or(0.0, |d| d.weight) * n_instances;
        level_numbers(i.policy, inner_spare, inner_weight)
    });
    // A bucket's depth as the engine's `bucket` sets it: none without a positive rate.
    let depth = |rate: f64, depth: f64| if rate.max(0.0) > 0.0 { depth } else { 0.0 };
    let charged = |list: &[Budget]| -> Vec<(BudgetPeriod, f64)> {
        list.iter()
            .map(|b| (b.period, b.period.window(at).0.as_micros() as f64))
            .collect()
    };
    let level = |takes: [f64; 3], depths: [f64; 3], permit: bool, budgets: &[Budget]| LevelCharge {
        present: true,
        floor: takes[0],
        floor_depth: depths[0],
        share: takes[1],
        share_depth: depths[1],
        ceiling: takes[2],
        ceiling_depth: depths[2],
        permit,
        budgets: charged(budgets),
    };
    let mut charge = Charge {
        cost: plan.cost,
        window,
        levels: Default::default(),
    };
    charge.levels[0] = level(
        takes[0],
        [0.0, 0.0, depth(tool.spare(), tool.burst)],
        tool.max_concurrency.is_some(),
        &tool.budgets,
    );
    charge.levels[1] = level(
        takes[1],
        [
            depth(tn.own_floor, tn.own_floor),
            depth(tn.share_rate, t_pol.burst),
            depth(tn.ceiling_rate, t_pol.burst),
        ],
        t_pol.max_concurrency.is_some(),
        &t_pol.budgets,
    );
    let view = |n: &LevelNumbers| LevelView {
        weight: n.weight,
        floor: n.floor,
        share: n.share,
        ceiling: n.ceiling,
    };
    let mut views = [view(&tn), LevelView::default()];
    let mut quota = tn.ceiling;
    if let (Some(i), Some(inn)) = (plan.instance, inn) {
        charge.levels[2] = level(
            takes[2],
            [
                depth(inn.own_floor, inn.own_floor),
                depth(inn.share_rate, i.policy.burst),
                depth(inn.ceiling_rate, i.policy.burst),
            ],
            i.policy.max_concurrency.is_some(),
            &i.policy.budgets,
        );
        views[1] = view(&inn);
        quota = inn.ceiling;
    }
    let reset_in = next_window - now;
    let admission = Admission {
        keys: keys.clone(),
        charge,
        remaining,
        quota,
        reset_in,
        slack,
        views,
        at: Timestamp(now as u64),
    };
    Ok((Decision::Admitted(Box::new(admission)), 0.0))
}

/// The mark that opens a state of the current layout (see `admit.lua`).
const STATE_MARK: f64 = -2.0;

fn decode_state(bytes: &[u8]) -> Result<Option<NodeState>, StoreError> {
    let v = unpack(bytes)?;
    let mut r = Reader { v: &v, at: 0 };
    if r.next()? != STATE_MARK {
        // Another layout's state: the scripts read it as absent, and so do we.
        return Ok(None);
    }
    let mut s = NodeState {
        live: true,
        t: r.next()?,
        floor: r.next()?,
        share: r.next()?,
        ceiling: r.next()?,
        window: r.next()?,
        total: r.next()?,
        non_floor: r.next()?,
        floor_used: r.next()?,
        in_flight: r.next()?,
        budgets: Vec::new(),
    };
    // until, key_until, and its tracker's count, least score and expiry.
    for _ in 0..5 {
        r.next()?;
    }
    let nb = r.next()? as usize;
    // expires, deadline, three rates, three depths, period.
    for _ in 0..9 {
        r.next()?;
    }
    for _ in 0..nb {
        let period = period_of(r.next()?).ok_or_else(|| bad("an unknown budget period"))?;
        s.budgets.push(BudgetCounter {
            period,
            start: r.next()?,
            used: r.next()?,
        });
    }
    Ok(Some(s))
}

impl Store for RedisStore {
    async fn decide<'a>(
        &'a self,
        plan: &'a Plan<'a>,
        keys: &'a CallKeys,
    ) -> Result<Decision, StoreError> {
        if let Some(cache) = &self.cache {
            if let Some(r) = cache.lookup(keys, plan, self.time) {
                self.cached_refusals.fetch_add(1, Ordering::Relaxed);
                return Ok(Decision::Refused(Box::new(r)));
            }
        }
        self.decide_remote(plan, keys).await
    }

    async fn adjust<'a>(
        &'a self,
        admission: &'a Admission,
        factor: f64,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        if factor < 0.0 {
            if let Some(cache) = &self.cache {
                cache.forget_tool(&admission.keys.tool);
            }
        }
        let encoded = self.state_keys(&admission.keys);
        let charge = &admission.charge;
        let mut v = vec![
            self.now_arg(now),
            factor,
            charge.cost,
            charge.window,
            self.permit_ttl_ms,
        ];
        let mut key_list: Vec<&str> = Vec::with_capacity(3);
        for (level, key) in encoded.iter().enumerate() {
            let lc = &charge.levels[level];
            let Some(key) = key else { continue };
            if !lc.present {
                continue;
            }
            key_list.push(key);
            v.extend_from_slice(&[
                level as f64,
                lc.floor,
                lc.floor_depth,
                lc.share,
                lc.share_depth,
                lc.ceiling,
                lc.ceiling_depth,
                lc.budgets.len() as f64,
            ]);
            for (p, start) in &lc.budgets {
                v.push(period_code(*p));
                v.push(*start);
            }
        }
        if key_list.is_empty() {
            return Ok(());
        }
        let blob = pack(&v);
        let _: i64 = self
            .guarded(
                "adjust",
                &admission.keys.tool,
                self.eval(&self.scripts.adjust, &key_list, &[&blob]),
            )
            .await?;
        Ok(())
    }

    async fn release<'a>(&'a self, admission: &'a Admission) -> Result<(), StoreError> {
        let encoded = self.state_keys(&admission.keys);
        let key_list: Vec<&str> = encoded
            .iter()
            .enumerate()
            .filter(|(level, _)| admission.charge.levels[*level].permit)
            .filter_map(|(_, k)| k.as_deref())
            .collect();
        if key_list.is_empty() {
            return Ok(());
        }
        let _: i64 = self
            .guarded(
                "release",
                &admission.keys.tool,
                self.eval(&self.scripts.release, &key_list, &[]),
            )
            .await?;
        Ok(())
    }

    async fn inspect<'a>(
        &'a self,
        keys: &'a CallKeys,
    ) -> Result<[Option<NodeState>; 3], StoreError> {
        let encoded = self.state_keys(keys);
        let present: Vec<(usize, &str)> = encoded
            .iter()
            .enumerate()
            .filter_map(|(i, k)| k.as_deref().map(|k| (i, k)))
            .collect();
        let mut cmd = redis::cmd("MGET");
        for (_, k) in &present {
            cmd.arg(*k);
        }
        let values: Vec<Option<Vec<u8>>> = self
            .guarded("inspect", &keys.tool, self.backend.query(&cmd))
            .await?;
        let mut out: [Option<NodeState>; 3] = Default::default();
        for ((level, _), value) in present.iter().zip(values) {
            if let Some(bytes) = value {
                out[*level] = decode_state(&bytes)?;
            }
        }
        Ok(out)
    }
}
