//! [`RedisStoreBuilder`]: configuration, and the connection to Redis.

use std::sync::OnceLock;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError};

use super::{RedisStore, Shared};
use crate::store::StoreError;

/// Where the store reads the time.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TimeSource {
    /// Redis `TIME`, inside the script: every replica agrees (the default).
    #[default]
    Redis,
    /// The `now` of each plan (the limiter's clock): for tests and simulations.
    Injected,
}

/// How the store talks to Redis.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Connection {
    /// One multiplexed connection that reconnects by itself (redis-rs `ConnectionManager`):
    /// the default, measured fastest and starvation-free here (`scripts/bench-compare`).
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
    pub(super) url: String,
    pub(super) connection: Connection,
    pub(super) timeout: Duration,
    pub(super) time: TimeSource,
    pub(super) refusal_cache: bool,
    pub(super) refusal_cache_capacity: usize,
    pub(super) permit_ttl: Duration,
    pub(super) upkeep_every: Duration,
    pub(super) namespace: String,
}

impl RedisStoreBuilder {
    pub(super) fn new(url: String) -> Self {
        RedisStoreBuilder {
            url,
            connection: Connection::Multiplexed,
            timeout: Duration::from_millis(250),
            time: TimeSource::Redis,
            refusal_cache: true,
            refusal_cache_capacity: 10_000,
            permit_ttl: Duration::from_secs(30),
            upkeep_every: Duration::from_secs(10),
            namespace: String::new(),
        }
    }

    /// Per-call timeout (default 250 ms): past it a call fails with [`StoreError::Timeout`].
    /// A decision cut off by the timeout is still finished in the background, and given back
    /// (permits and units) if Redis admitted it.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Use the limiter's clock (the plan's `now`) instead of Redis `TIME`: for tests and
    /// simulations. Such a clock need not pass at Redis's pace, so records are kept in Redis at
    /// least ten minutes of real time (a record kept past its expiry is as good as a fresh one;
    /// one dropped before it would lose what it counts).
    pub fn injected_clock(mut self) -> Self {
        self.time = TimeSource::Injected;
        self
    }

    /// Where the time comes from.
    pub fn time_source(mut self, time: TimeSource) -> Self {
        self.time = time;
        self
    }

    /// Turns the local refusal cache on (the default) or off. After a refusal that names when
    /// the same call could pass at the earliest, this replica refuses that call again until
    /// then without a Redis command. A call refused from the cache gets the refusal Redis gave
    /// before (its reason, and the time left): if another caller of the tenant has since spent
    /// what the call would need, Redis would now name that limit instead. The call is refused
    /// either way; a refund on this replica clears the tool's cached refusals, and a reload
    /// decides afresh (a refusal is remembered with the policy it was decided under).
    pub fn refusal_cache(mut self, on: bool) -> Self {
        self.refusal_cache = on;
        self
    }

    /// How many callers' refusals the local cache holds at most (default 10,000).
    pub fn refusal_cache_capacity(mut self, capacity: usize) -> Self {
        self.refusal_cache_capacity = capacity;
        self
    }

    /// How long a concurrency permit lasts without being renewed (default 30 s, at least
    /// 1 s). While this store is alive it renews the permits of its calls still running
    /// (every third of this), so long calls keep theirs; the permits of a replica that died
    /// lapse by themselves within this time, however busy the tool is.
    pub fn permit_ttl(mut self, ttl: Duration) -> Self {
        self.permit_ttl = ttl.max(Duration::from_secs(1));
        self
    }

    /// How often the store checks Redis in the background (default 10 s; zero turns the
    /// checks off): whether its state was lost (a restart without persistence, a flush, an
    /// eviction) and whether the server is configured to keep it (see
    /// [`RedisStore::check_health`]).
    pub fn health_checks_every(mut self, every: Duration) -> Self {
        self.upkeep_every = every;
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

    fn check(&self) -> Result<(), StoreError> {
        if self.namespace.contains(['{', '}']) {
            return Err(StoreError::Protocol(format!(
                "namespace `{}` must not contain `{{` or `}}`: they would change the hash tag",
                self.namespace
            )));
        }
        Ok(())
    }

    /// Connects, and fails if Redis cannot be reached now. Must run inside the tokio runtime
    /// that will drive the store. Warns (in the log and the metrics) when the server's
    /// configuration can lose the store's state (see [`RedisStore::check_health`]).
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        self.check()?;
        let backend = connect_now(&self).await?;
        let store = RedisStore::from_parts(self, Some(backend));
        store.shared.spawn_upkeep(true);
        Ok(store)
    }

    /// Returns at once and connects in the background, so a replica can start while Redis is
    /// down: until Redis answers, every call fails with [`StoreError::Unavailable`] (or
    /// [`StoreError::Timeout`]) and each tool's `on_store_error` applies; once it answers,
    /// decisions go to Redis. Must run inside the tokio runtime that will drive the store.
    pub fn connect_lazy(self) -> Result<RedisStore, StoreError> {
        self.check()?;
        let unavailable = |e: RedisError| StoreError::Unavailable(e.to_string());
        let backend = match &self.connection {
            Connection::Multiplexed => {
                let client = redis::Client::open(self.url.as_str()).map_err(unavailable)?;
                Some(Backend::Multiplexed(
                    ConnectionManager::new_lazy_with_config(client, manager_config(&self))
                        .map_err(unavailable)?,
                ))
            }
            #[cfg(feature = "redis-bb8")]
            Connection::Pool(size) => {
                let manager = bb8_redis::RedisConnectionManager::new(self.url.as_str())
                    .map_err(unavailable)?;
                Some(Backend::Pool(
                    bb8::Pool::builder()
                        .max_size(*size)
                        .test_on_check_out(false)
                        .connection_timeout(self.timeout.max(Duration::from_millis(100)))
                        .build_unchecked(manager),
                ))
            }
            // The cluster client connects eagerly: keep trying in the background.
            Connection::Cluster(_) => None,
        };
        let store = RedisStore::from_parts(self, backend);
        store.shared.spawn_upkeep(false);
        Ok(store)
    }
}

fn manager_config(b: &RedisStoreBuilder) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_min_delay(Duration::from_millis(20))
        .set_max_delay(Duration::from_millis(200))
        .set_number_of_retries(8)
        .set_connection_timeout(Some(b.timeout.max(Duration::from_millis(100))))
        .set_response_timeout(None)
}

/// Opens the connection now (or fails).
pub(super) async fn connect_now(b: &RedisStoreBuilder) -> Result<Backend, StoreError> {
    let unavailable = |e: RedisError| StoreError::Unavailable(e.to_string());
    let within = b.timeout.max(Duration::from_secs(2));
    Ok(match &b.connection {
        Connection::Multiplexed => {
            let client = redis::Client::open(b.url.as_str()).map_err(unavailable)?;
            let manager = tokio::time::timeout(
                within,
                ConnectionManager::new_with_config(client, manager_config(b)),
            )
            .await
            .map_err(|_| StoreError::Timeout(within))?
            .map_err(unavailable)?;
            Backend::Multiplexed(manager)
        }
        Connection::Cluster(nodes) => {
            let client = redis::cluster::ClusterClient::builder(nodes.clone())
                .connection_timeout(b.timeout.max(Duration::from_millis(100)))
                .response_timeout(b.timeout.max(Duration::from_millis(100)))
                .retries(2)
                .min_retry_wait(10)
                .max_retry_wait(200)
                .build()
                .map_err(unavailable)?;
            let conn = tokio::time::timeout(within, client.get_async_connection())
                .await
                .map_err(|_| StoreError::Timeout(within))?
                .map_err(unavailable)?;
            Backend::Cluster(conn)
        }
        #[cfg(feature = "redis-bb8")]
        Connection::Pool(size) => {
            let manager =
                bb8_redis::RedisConnectionManager::new(b.url.as_str()).map_err(unavailable)?;
            let pool = bb8::Pool::builder()
                .max_size(*size)
                .test_on_check_out(false)
                .connection_timeout(b.timeout.max(Duration::from_millis(100)))
                .build(manager)
                .await
                .map_err(unavailable)?;
            Backend::Pool(pool)
        }
    })
}

/// The connection, once there is one.
#[derive(Clone)]
pub(super) enum Backend {
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
    pub(super) async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        match self {
            Backend::Multiplexed(c) => cmd.query_async(&mut c.clone()).await,
            Backend::Cluster(c) => cmd.query_async(&mut c.clone()).await,
            #[cfg(feature = "redis-bb8")]
            Backend::Pool(p) => {
                let mut c = p.get().await.map_err(pool_error)?;
                cmd.query_async(&mut *c).await
            }
        }
    }

    /// Whether commands sent one after the other reach Redis in that order (one connection
    /// per node); a pool's connections do not keep it.
    pub(super) fn keeps_order(&self) -> bool {
        match self {
            Backend::Multiplexed(_) | Backend::Cluster(_) => true,
            #[cfg(feature = "redis-bb8")]
            Backend::Pool(_) => false,
        }
    }

    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Backend::Cluster(_))
    }
}

#[cfg(feature = "redis-bb8")]
fn pool_error(e: bb8::RunError<RedisError>) -> RedisError {
    match e {
        bb8::RunError::User(e) => e,
        bb8::RunError::TimedOut => {
            RedisError::from((ErrorKind::Io, "timed out waiting for a pooled connection"))
        }
    }
}

/// The connection slot of a store: set at once, or by the background connector.
pub(super) type Slot = OnceLock<Backend>;

/// Keeps trying to connect (for a cluster started lazily) until it succeeds or the store is
/// gone. Returns whether it connected.
pub(super) async fn connect_in_background(shared: &std::sync::Weak<Shared>) -> bool {
    let mut wait = Duration::from_millis(100);
    loop {
        let Some(s) = shared.upgrade() else {
            return false;
        };
        if s.backend.get().is_some() {
            return true;
        }
        match connect_now(&s.config).await {
            Ok(b) => {
                let _ = s.backend.set(b);
                // The calls failed while it connected say nothing of the connection made:
                // the next call goes to Redis, not to the fail-fast answer.
                s.breaker.answered();
                tracing::info!(store = "redis", "connected to Redis");
                return true;
            }
            Err(e) => {
                s.note_connect_error(&e);
                drop(s);
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
        }
    }
}

pub(super) fn map_error(e: RedisError, timeout: Duration) -> StoreError {
    if e.is_timeout() {
        return StoreError::Timeout(timeout);
    }
    match e.kind() {
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => StoreError::Protocol(e.to_string()),
        ErrorKind::Server(redis::ServerErrorKind::ResponseError)
            if !e.is_io_error() && !e.is_connection_dropped() =>
        {
            StoreError::Protocol(e.to_string())
        }
        _ => StoreError::Unavailable(e.to_string()),
    }
}
