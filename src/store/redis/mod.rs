#![doc = include_str!("../../../docs/redis.md")]

mod batch;
mod builder;
mod cache;
mod ledger;
mod record;
mod replicas;
#[cfg(test)]
mod upgrade;
mod upkeep;
mod wire;

use std::collections::HashMap;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use redis::{ErrorKind, ServerErrorKind};

pub use builder::{Connection, RedisStoreBuilder, TimeSource};
pub use upkeep::StoreHealth;

use self::builder::{map_error, Backend};
use self::cache::RefusalCache;
use super::{Admission, Answer, CallKeys, Decision, Store, StoreError};
use crate::admission::engine::{NodeState, OwnedPlan, Plan, Stored};
use crate::clock::Timestamp;

/// A Lua script, and the hash EVALSHA runs it by.
#[derive(Debug)]
struct Script {
    code: &'static str,
    hash: String,
}

impl Script {
    fn new(code: &'static str) -> Self {
        let hash = redis::Script::new(code).get_hash().to_owned();
        Script { code, hash }
    }
}

#[derive(Debug)]
struct Scripts {
    cycle: Script,
    release: Script,
    renew: Script,
    sweep: Script,
    inspect: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            cycle: Script::new(include_str!("cycle.lua")),
            release: Script::new(include_str!("release.lua")),
            renew: Script::new(include_str!("renew.lua")),
            sweep: Script::new(include_str!("sweep.lua")),
            inspect: Script::new(include_str!("inspect.lua")),
        }
    }
}

/// Names calls uniquely across replicas: a random 64-bit prefix per store, then a counter.
#[derive(Debug)]
struct CallIds {
    prefix: u64,
    next: AtomicU64,
}

impl CallIds {
    fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let here = &seed as *const u128 as usize;
        CallIds {
            // SipHash with keys from the OS's randomness.
            prefix: std::collections::hash_map::RandomState::new().hash_one((
                seed,
                std::process::id(),
                here,
            )),
            next: AtomicU64::new(1),
        }
    }

    fn next(&self) -> u128 {
        (u128::from(self.prefix) << 64) | u128::from(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// A record version: never the same twice from one store, and unlike another store's
    /// (its prefix is random).
    fn version(&self) -> u64 {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.prefix ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

/// Fails fast while Redis does not answer: after [`Breaker::TRIPS`] decisions in a row failed
/// to reach it, calls fail at once (no command, no waiting out the timeout) except one probe
/// every [`Breaker::PROBE_EVERY`]; the first answer closes it. An outage then costs each caller
/// nothing but its tool's `on_store_error`, and no decisions pile up waiting for Redis.
#[derive(Debug)]
struct Breaker {
    started: Instant,
    /// Decisions in a row that could not reach Redis.
    failures: std::sync::atomic::AtomicU32,
    /// While open: µs since `started` before which calls fail at once.
    open_until: AtomicU64,
}

impl Breaker {
    const TRIPS: u32 = 3;
    const PROBE_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

    fn new() -> Self {
        Breaker {
            started: Instant::now(),
            failures: std::sync::atomic::AtomicU32::new(0),
            open_until: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    /// Whether a decision may go to Redis now: always while closed; while open, one probe per
    /// [`Self::PROBE_EVERY`].
    fn admits(&self) -> bool {
        if self.failures.load(Ordering::Relaxed) < Self::TRIPS {
            return true;
        }
        let now = self.now();
        let until = self.open_until.load(Ordering::Relaxed);
        now >= until
            && self
                .open_until
                .compare_exchange(
                    until,
                    now + Self::PROBE_EVERY.as_micros() as u64,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// A decision reached Redis; whether that closed the breaker.
    fn answered(&self) -> bool {
        self.failures.swap(0, Ordering::Relaxed) >= Self::TRIPS
    }

    /// A decision could not reach Redis; whether that opened the breaker.
    fn failed(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n == Self::TRIPS {
            self.open_until.store(
                self.now() + Self::PROBE_EVERY.as_micros() as u64,
                Ordering::Relaxed,
            );
            return true;
        }
        false
    }
}

/// How much background work is under way, and a wake-up for when none is.
#[derive(Debug, Default)]
struct Pending {
    count: AtomicUsize,
    idle: tokio::sync::Notify,
}

/// A piece of background work under way, counted in [`Pending`] until it is dropped.
struct Working(Arc<Shared>);

impl Drop for Working {
    fn drop(&mut self) {
        if self.0.pending.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.pending.idle.notify_waiters();
        }
    }
}

/// The permits a call of this store holds, so they can be renewed while it runs.
#[derive(Debug)]
struct HeldPermits {
    /// The tool's slot (its group, or itself): what one script may touch together.
    slot: crate::key::Name,
    keys: Vec<String>,
}

/// Everything a store and its background tasks share.
#[derive(Debug)]
struct Shared {
    config: RedisStoreBuilder,
    backend: builder::Slot,
    connect_error: Mutex<Option<String>>,
    scripts: Scripts,
    cache: Option<RefusalCache>,
    errors: AtomicU64,
    cached_refusals: AtomicU64,
    abandoned: AtomicU64,
    breaker: Breaker,
    ids: CallIds,
    held: Mutex<HashMap<u128, HeldPermits>>,
    /// Background work under way (permits given back, charges of callers that left
    /// refunded): what [`Store::flush`] waits for.
    pending: Pending,
    /// Each tool's queue of decisions and corrections (see `batch`).
    queues: Mutex<HashMap<Arc<str>, tokio::sync::mpsc::UnboundedSender<batch::Job>>>,
    health: upkeep::HealthState,
    /// What this replica tells the others, and what it last read of theirs.
    replicas: replicas::Replicas,
}

/// Keeps admission state in Redis (or Redis Cluster), shared by every replica. See the
/// [module docs](self) for the script, the key layout and the failure modes. Cheap to clone:
/// clones share the connection.
#[derive(Debug, Clone)]
pub struct RedisStore {
    shared: Arc<Shared>,
}

impl RedisStore {
    /// A builder for a store on the Redis server at `url` (`redis://host:port/db`).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(url.into())
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

    /// A builder for a store over a connection the application already made — its own TLS
    /// setup, credentials, timeouts, DNS — used as it is (it reconnects by itself).
    ///
    /// ```no_run
    /// use tower_fairshare::store::RedisStore;
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://app:secret@127.0.0.1:6379/")?;
    /// let connection = redis::aio::ConnectionManager::new(client).await?;
    /// let store = RedisStore::from_connection(connection).connect().await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn from_connection(connection: redis::aio::ConnectionManager) -> RedisStoreBuilder {
        RedisStoreBuilder::with_backend(Backend::Multiplexed(connection))
    }

    /// A builder for a store over a Redis Cluster connection the application already made.
    pub fn from_cluster_connection(
        connection: redis::cluster_async::ClusterConnection,
    ) -> RedisStoreBuilder {
        RedisStoreBuilder::with_backend(Backend::Cluster(connection))
    }

    /// A store on the Redis server at `url` with the defaults: multiplexed connection, Redis
    /// `TIME`, 250 ms timeout, refusal cache on.
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        RedisStore::builder(url).connect().await
    }

    fn from_parts(config: RedisStoreBuilder, backend: Option<Backend>) -> RedisStore {
        let slot = OnceLock::new();
        if let Some(b) = backend {
            let _ = slot.set(b);
        }
        let ids = CallIds::new();
        let replicas = replicas::Replicas::new(ids.prefix, config.formats, config.policy_grace);
        RedisStore {
            shared: Arc::new(Shared {
                cache: config
                    .refusal_cache
                    .then(|| RefusalCache::new(config.refusal_cache_capacity)),
                config,
                backend: slot,
                connect_error: Mutex::new(None),
                scripts: Scripts::new(),
                errors: AtomicU64::new(0),
                cached_refusals: AtomicU64::new(0),
                abandoned: AtomicU64::new(0),
                breaker: Breaker::new(),
                ids,
                replicas,
                held: Mutex::new(HashMap::new()),
                pending: Pending::default(),
                queues: Mutex::new(HashMap::new()),
                health: upkeep::HealthState::default(),
            }),
        }
    }

    /// Store errors so far (timeouts, unreachable Redis, unexpected answers).
    pub fn errors(&self) -> u64 {
        self.shared.errors.load(Ordering::Relaxed)
    }

    /// Calls refused from the local refusal cache, without a Redis command.
    pub fn cached_refusals(&self) -> u64 {
        self.shared.cached_refusals.load(Ordering::Relaxed)
    }

    /// Decisions whose caller went away (dropped, or cut off by the timeout) that Redis
    /// admitted and this store then gave back: units refunded, permits released.
    pub fn abandoned(&self) -> u64 {
        self.shared.abandoned.load(Ordering::Relaxed)
    }

    /// Calls of this store that hold concurrency permits now (renewed while they run).
    pub fn permits_held(&self) -> usize {
        lock(&self.shared.held).len()
    }

    /// Where the store reads the time.
    pub fn time_source(&self) -> TimeSource {
        self.shared.config.time
    }

    /// Renews the permits of this store's calls still running, until `now` + the permit TTL
    /// (`now` is ignored with Redis `TIME`). The store does this by itself every third of the
    /// permit TTL when it reads Redis `TIME`; with an
    /// [injected clock](RedisStoreBuilder::injected_clock) call it yourself. Returns how many
    /// permits were renewed.
    pub async fn renew_permits(&self, now: Timestamp) -> Result<u64, StoreError> {
        self.shared.renew(now, None).await
    }

    /// Checks Redis now: whether its configuration keeps the store's state (eviction policy,
    /// persistence) and whether the state was lost since the last check (a tool's epoch
    /// marker gone or changed). Logs and counts what it finds (see the module docs); the store
    /// runs this by itself in the background.
    pub async fn check_health(&self) -> Result<StoreHealth, StoreError> {
        self.shared.check_health().await
    }

    /// Announces this replica to the others sharing the store and reads theirs now (the
    /// store does this every second by itself): which record format every live replica reads
    /// (see the module docs, *Upgrades*) and whether they enforce the same policy for each
    /// tool. Returns the tools they disagree on, as [`Store::policy_disagreements`] does.
    pub async fn check_replicas(
        &self,
    ) -> Result<Vec<crate::store::PolicyDisagreement>, StoreError> {
        self.shared.announce().await?;
        Ok(self.shared.replicas.disagreements())
    }

    /// Decides a call in Redis (see the module docs): through its tool's queue (its group's),
    /// answered within the timeout. Owns what it needs, so the caller may wait for it
    /// anywhere.
    async fn decide_remote(
        self,
        parts: Vec<(OwnedPlan, CallKeys)>,
    ) -> Result<Decision, StoreError> {
        let sh = &self.shared;
        if !sh.breaker.admits() {
            return Err(StoreError::Unavailable(
                "Redis has not answered the last decisions: failing fast until it does".into(),
            ));
        }
        let (slot, tool) = (parts[0].1.slot().clone(), parts[0].1.tool.clone());
        let (reply, answer) = batch::Answer::channel(sh);
        let sent = Instant::now();
        let job = batch::Job::Decide {
            parts: parts
                .iter()
                .map(|(plan, keys)| batch::QueuedPart {
                    plan: plan.clone(),
                    keys: keys.clone(),
                    call: sh.ids.next(),
                })
                .collect(),
            reply,
        };
        batch::submit(sh, &slot, job);
        // Timed out or dropped here, the call is still decided; if it is admitted and nobody
        // takes the answer, it is given back (see `batch::Answer`).
        let decided = sh.worker_answer(answer).await;
        let decision = match decided {
            Ok(d) => {
                if sh.breaker.answered() {
                    tracing::info!(store = "redis", "Redis answers again");
                }
                d
            }
            Err(e) => {
                if !matches!(e, StoreError::Protocol(_)) {
                    sh.unreachable(&tool);
                }
                return Err(sh.failed("decide", &tool, e));
            }
        };
        self.decided(&parts, &decision, sent);
        Ok(decision)
    }

    /// Notes a decision: a refusal remembered, the permits of an admission held.
    fn decided(&self, parts: &[(OwnedPlan, CallKeys)], decision: &Decision, sent: Instant) {
        let sh = &self.shared;
        match decision {
            Decision::Refused(r) => {
                let refused = parts.iter().find(|(_, k)| *k.tool == *r.tool());
                if let (Some(cache), Some((plan, keys))) = (&sh.cache, refused) {
                    cache.remember(keys, &plan.plan(), r, sent, sh.config.time);
                }
            }
            Decision::Admitted(admissions) => {
                for a in admissions.iter().filter(|a| a.charge.holds_permits()) {
                    let state = sh.state_keys(&a.keys);
                    let held = HeldPermits {
                        slot: a.keys.slot().clone(),
                        keys: wire::permitted(&state, &a.charge)
                            .map(|k| wire::permits_key(k))
                            .collect(),
                    };
                    lock(&sh.held).insert(a.call, held);
                }
            }
        }
    }

    /// Drops every state that is equivalent to fresh state at `now` (template counts
    /// included) and every permit that has lapsed: Redis's own TTLs do that in real
    /// time; this does it at a virtual `now` (an injected clock). Scans the keys of this
    /// store's namespace on one server: on a cluster, sweep each master through a store
    /// connected to it alone. Returns how many keys were deleted.
    pub async fn sweep(&self, now: Timestamp) -> Result<u64, StoreError> {
        let sh = &self.shared;
        if sh.backend()?.is_cluster() {
            return Err(StoreError::Protocol(
                "sweep scans one server; on a cluster, rely on the keys' TTLs".into(),
            ));
        }
        let pattern = format!(
            "{}{}*",
            glob_escape(&sh.config.namespace),
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
            let (next, keys): (u64, Vec<String>) = sh.guarded("sweep", "", sh.query(&cmd)).await?;
            // One script per hash tag: a cluster node refuses scripts spanning slots.
            let mut by_tag: HashMap<&str, Vec<String>> = HashMap::new();
            for k in &keys {
                by_tag
                    .entry(crate::key::hash_tag(k))
                    .or_default()
                    .push(k.clone());
            }
            let now_s = now.as_micros().to_string().into_bytes();
            for refs in by_tag.values().flat_map(|v| v.chunks(64)) {
                let n: u64 = sh
                    .guarded(
                        "sweep",
                        "",
                        sh.eval(&sh.scripts.sweep, refs, std::slice::from_ref(&now_s)),
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

/// Why a call's parts cannot be decided in one script: tools of different groups (their
/// state lives apart, on Redis Cluster in different slots).
fn apart(parts: &[(OwnedPlan, CallKeys)]) -> Option<StoreError> {
    let slot = parts.first()?.1.slot();
    let other = parts.iter().find(|(_, k)| k.slot() != slot)?;
    Some(StoreError::Protocol(format!(
        "the tools `{}` and `{}` are charged together but are not in one group: give them the same `group` in the policy",
        parts[0].1.tool, other.1.tool
    )))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn backend(&self) -> Result<&Backend, StoreError> {
        self.backend.get().ok_or_else(|| {
            let why = lock(&self.connect_error)
                .clone()
                .unwrap_or_else(|| "connecting".to_owned());
            StoreError::Unavailable(format!("not connected to Redis yet ({why})"))
        })
    }

    /// A decision could not reach Redis.
    fn unreachable(&self, tool: &str) {
        if self.breaker.failed() {
            tracing::warn!(store = "redis", tool, "Redis is not answering: failing fast (each tool's on_store_error applies) and trying again every 100 ms");
        }
    }

    fn note_connect_error(&self, e: &StoreError) {
        let mut last = lock(&self.connect_error);
        if last.is_none() {
            tracing::warn!(store = "redis", error = %e, "cannot reach Redis; every call follows its tool's on_store_error until it answers");
        }
        *last = Some(e.to_string());
    }

    fn state_keys(&self, keys: &CallKeys) -> [Option<String>; 3] {
        wire::state_keys(&self.config.namespace, keys)
    }

    /// The least TTL a record is given, ms. With Redis's clock, 1: a TTL is the time until
    /// the record is as good as fresh. With an injected clock, whose time need not pass at
    /// Redis's pace (a test or a simulation may spend a real second on a virtual
    /// millisecond), ten minutes: a record kept past its expiry is as good as fresh, one
    /// dropped before it is not.
    pub(super) fn least_ttl_ms(&self) -> u64 {
        match self.config.time {
            TimeSource::Redis => 1,
            TimeSource::Injected => 600_000,
        }
    }

    /// How long a worker's Redis call, or work waiting for a worker, may take at most: longer
    /// than a caller waits (callers count their own timeouts as store errors).
    fn worker_bound(&self) -> std::time::Duration {
        (self.config.timeout * 20).max(std::time::Duration::from_secs(5))
    }

    /// A tool's worker's `answer` to a job, within the timeout.
    async fn worker_answer<T>(
        &self,
        answer: impl Future<
            Output = Result<Result<T, StoreError>, tokio::sync::oneshot::error::RecvError>,
        >,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.config.timeout, answer).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(StoreError::Unavailable("the store's worker stopped".into())),
            Err(_) => Err(StoreError::Timeout(self.config.timeout)),
        }
    }

    /// The time a script is to decide or count permits at: Redis's own (`-1`), or `now`.
    pub(super) fn now_arg(&self, now: Timestamp) -> String {
        match self.config.time {
            TimeSource::Redis => "-1".to_owned(),
            TimeSource::Injected => now.as_micros().to_string(),
        }
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        let timeout = self.config.timeout;
        self.backend()?
            .query(cmd)
            .await
            .map_err(|e| map_error(e, timeout))
    }

    /// Runs `script` by EVALSHA, loading it by EVAL when Redis does not know it.
    async fn eval<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        keys: &[String],
        args: &[Vec<u8>],
    ) -> Result<T, StoreError> {
        let backend = self.backend()?;
        let run = |how: &str, script: &str| {
            let mut cmd = redis::cmd(how);
            cmd.arg(script).arg(keys.len()).arg(keys).arg(args);
            cmd
        };
        let mut reply = backend.query(&run("EVALSHA", &script.hash)).await;
        if matches!(&reply, Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)) {
            reply = backend.query(&run("EVAL", script.code)).await;
        }
        reply.map_err(|e| map_error(e, self.config.timeout))
    }

    /// Logs and counts a failed store call.
    fn failed(&self, what: &'static str, tool: &str, err: StoreError) -> StoreError {
        self.errors.fetch_add(1, Ordering::Relaxed);
        if let Some(held_back) = crate::telemetry::let_through(what, tool) {
            tracing::warn!(store = "redis", op = what, tool, error = %err, held_back, "rate-limit store call failed");
        }
        err
    }

    /// Bounds `f` by the timeout; logs and counts its errors.
    async fn guarded<T>(
        &self,
        what: &'static str,
        tool: &str,
        f: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let timeout = self.config.timeout;
        match tokio::time::timeout(timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.failed(what, tool, e)),
            Err(_) => Err(self.failed(what, tool, StoreError::Timeout(timeout))),
        }
    }

    /// Gives back the permits an admitted call took (and stops renewing them). When Redis
    /// cannot be reached, it is tried again in the background until it is given back or the
    /// permits would have lapsed anyway: a live replica never leaves them to the permit TTL.
    async fn release_call(self: &Arc<Self>, admission: &Admission) -> Result<(), StoreError> {
        let _working = self.working();
        let first = self.release_once(admission).await;
        if first.is_err() && admission.charge.holds_permits() {
            let (sh, a) = (self.clone(), admission.clone());
            let working = self.working();
            tokio::spawn(async move {
                let _working = working;
                let until = Instant::now() + sh.config.permit_ttl;
                let mut wait = std::time::Duration::from_millis(100);
                while Instant::now() < until {
                    tokio::time::sleep(wait).await;
                    if sh.release_once(&a).await.is_ok() {
                        return;
                    }
                    wait = (wait * 2).min(std::time::Duration::from_secs(2));
                }
            });
        }
        first
    }

    /// Counts a piece of background work until the guard is dropped.
    fn working(self: &Arc<Self>) -> Working {
        self.pending.count.fetch_add(1, Ordering::AcqRel);
        Working(self.clone())
    }

    /// Waits until no background work is under way (within the bound of a worker's round
    /// trips).
    async fn flush(&self) {
        let bound = self.worker_bound();
        let idle = async {
            loop {
                let woken = self.pending.idle.notified();
                if self.pending.count.load(Ordering::Acquire) == 0 {
                    return;
                }
                woken.await;
            }
        };
        let _ = tokio::time::timeout(bound, idle).await;
    }

    /// One attempt of [`release_call`](Self::release_call).
    async fn release_once(&self, admission: &Admission) -> Result<(), StoreError> {
        lock(&self.held).remove(&admission.call);
        // Pairs of (permits, state) keys, as the release script takes them.
        let state = self.state_keys(&admission.keys);
        let keys: Vec<String> = wire::permitted(&state, &admission.charge)
            .flat_map(|k| [wire::permits_key(k), k.clone()])
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        let args = [
            admission.call.to_le_bytes().to_vec(),
            self.now_arg(admission.at).into_bytes(),
            self.least_ttl_ms().to_string().into_bytes(),
        ];
        let _: i64 = self
            .guarded(
                "release",
                &admission.keys.tool,
                self.eval(&self.scripts.release, &keys, &args),
            )
            .await?;
        Ok(())
    }

    /// Renews the permits of this store's calls still running. With `revive`, only those of
    /// that tool, after Redis lost its state, and those its permits zsets lost are put back:
    /// they count again at once, until the permit TTL (renewed as usual).
    async fn renew(&self, now: Timestamp, revive: Option<&str>) -> Result<u64, StoreError> {
        // Per tool (one slot), per permits key: the ids to renew.
        let mut by_tool: HashMap<crate::key::Name, HashMap<String, Vec<u8>>> = HashMap::new();
        for (call, held) in lock(&self.held).iter() {
            if revive.is_some_and(|t| *t != *held.slot) {
                continue;
            }
            let keys = by_tool.entry(held.slot.clone()).or_default();
            for k in &held.keys {
                keys.entry(k.clone())
                    .or_default()
                    .extend_from_slice(&call.to_le_bytes());
            }
        }
        let mut renewed = 0;
        for (tool, keys) in by_tool {
            let (names, ids): (Vec<String>, Vec<Vec<u8>>) = keys.into_iter().unzip();
            let mut args = Vec::with_capacity(ids.len() + 2);
            args.push(self.now_arg(now).into_bytes());
            args.push(self.config.permit_ttl.as_millis().to_string().into_bytes());
            args.push(if revive.is_some() {
                b"".to_vec()
            } else {
                b"XX".to_vec()
            });
            args.extend(ids);
            let n: u64 = self
                .guarded(
                    "renew",
                    &tool,
                    self.eval(&self.scripts.renew, &names, &args),
                )
                .await?;
            renewed += n;
        }
        Ok(renewed)
    }
}

impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn decide(&self, plans: &[Plan<'_>]) -> Answer<Decision> {
        let parts: Vec<(OwnedPlan, CallKeys)> =
            plans.iter().map(|p| (OwnedPlan::of(p), p.keys())).collect();
        if let Some(cache) = &self.shared.cache {
            for (plan, (_, keys)) in plans.iter().zip(&parts) {
                if let Some(r) = cache.lookup(keys, plan, self.shared.config.time) {
                    self.shared.cached_refusals.fetch_add(1, Ordering::Relaxed);
                    return Answer::Now(Ok(Decision::Refused(r)));
                }
            }
        }
        if let Some(e) = apart(&parts) {
            return Answer::Now(Err(e));
        }
        Answer::later(self.clone().decide_remote(parts))
    }

    fn adjust(&self, admission: &Arc<Admission>, factor: f64, now: Timestamp) -> Answer<()> {
        let (sh, admission) = (self.shared.clone(), admission.clone());
        if factor < 0.0 {
            if let Some(cache) = &sh.cache {
                cache.forget_slot(admission.keys.slot());
            }
        }
        let tool = admission.keys.tool.clone();
        let answer = batch::adjust(&sh, admission, factor, now);
        Answer::later(async move {
            // Not waited for, it is still applied.
            let done = sh.worker_answer(answer).await;
            done.map_err(|e| sh.failed("adjust", &tool, e))
        })
    }

    fn release(&self, admission: &Arc<Admission>) -> Answer<()> {
        let (sh, admission) = (self.shared.clone(), admission.clone());
        Answer::later(async move { sh.release_call(&admission).await })
    }

    fn flush(&self) -> Answer<()> {
        let sh = self.shared.clone();
        Answer::later(async move {
            sh.flush().await;
            Ok(())
        })
    }

    fn inspect(&self, keys: &CallKeys) -> Answer<Stored> {
        // Every permit held, lapsed or not (their scores are when they lapse: all above 0).
        let (sh, keys) = (self.shared.clone(), keys.clone());
        Answer::later(async move { sh.read_states(&keys, b"0".to_vec()).await })
    }

    fn inspect_at(&self, keys: &CallKeys, now: Timestamp) -> Answer<Stored> {
        // The permits that have not lapsed at the decisions' clock.
        let at = self.shared.now_arg(now).into_bytes();
        let (sh, keys) = (self.shared.clone(), keys.clone());
        Answer::later(async move { sh.read_states(&keys, at).await })
    }

    fn policy_in_force(&self, policy: &crate::Policy) {
        self.shared.replicas.policy_in_force(policy);
    }

    fn policy_disagreements(&self) -> Vec<crate::store::PolicyDisagreement> {
        self.shared.replicas.disagreements()
    }
}

impl Shared {
    /// The records of `keys`' levels and the permits they hold that have not lapsed by `at`
    /// (µs; `-1`: Redis `TIME`), through `inspect.lua`, writing nothing.
    async fn read_states(&self, keys: &CallKeys, at: Vec<u8>) -> Result<Stored, StoreError> {
        let encoded = self.state_keys(keys);
        let present: Vec<(usize, &String)> = encoded
            .iter()
            .enumerate()
            .filter_map(|(i, k)| Some((i, k.as_ref()?)))
            .collect();
        let mut script_keys: Vec<String> = present.iter().map(|(_, k)| (*k).clone()).collect();
        script_keys.extend(present.iter().map(|(_, k)| wire::permits_key(k)));
        let at = [at];
        let inspect = self.eval(&self.scripts.inspect, &script_keys, &at);
        let (values, held): (Vec<Option<Vec<u8>>>, Vec<u64>) =
            self.guarded("inspect", &keys.tool, inspect).await?;
        let mut out = Stored::default();
        for (((level, _), value), held) in present.iter().zip(values).zip(held) {
            let newest = self.config.formats[1];
            let record = value
                .map(|bytes| record::Record::decode(&bytes, newest))
                .transpose()?;
            if *level == 0 {
                out.plans = record.as_ref().map(|r| r.plans).unwrap_or_default();
            }
            // Calls in flight: the permits that count (see above).
            let state = record.map(|r| r.state);
            out.levels[*level] = state
                .or_else(|| (held > 0).then(NodeState::default))
                .map(|s| NodeState {
                    in_flight: held as f64,
                    ..s
                });
        }
        Ok(out)
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
