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
    /// ACL user (or none: `default`) and password, over what the URL says.
    pub(super) credentials: Option<(Option<String>, String)>,
    /// Certificates for `rediss://`: a CA to trust instead of the system's, a client's.
    #[cfg(feature = "redis-tls")]
    pub(super) tls: Tls,
    /// A connection the application made itself, used as it is.
    pub(super) given: Option<Backend>,
    /// How long replicas may enforce different policies for a tool before it is an error.
    pub(super) policy_grace: Duration,
    /// The record formats this store reads and writes (oldest, newest).
    pub(super) formats: [u8; 2],
}

/// The certificates a TLS connection uses (PEM), when given.
#[cfg(feature = "redis-tls")]
#[derive(Clone, Debug, Default)]
pub(super) struct Tls {
    ca: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

#[cfg(feature = "redis-tls")]
impl Tls {
    fn given(&self) -> bool {
        self.ca.is_some() || self.client.is_some()
    }

    fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca.clone(),
        }
    }
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
            credentials: None,
            #[cfg(feature = "redis-tls")]
            tls: Tls::default(),
            given: None,
            policy_grace: Duration::from_secs(60),
            formats: super::replicas::FORMATS,
        }
    }

    /// How long the replicas sharing this store may enforce different policies for a tool
    /// (each replica's fingerprint of it, published every second) before it is logged as an
    /// error rather than a warning (default 60 s: a rolling reload is over by then).
    pub fn policy_grace(mut self, grace: Duration) -> Self {
        self.policy_grace = grace;
        self
    }

    /// A store that reads and writes the record formats `oldest..=newest`: what the migration
    /// tests make an older and a newer version of this store with.
    #[cfg(test)]
    pub(super) fn formats(mut self, oldest: u8, newest: u8) -> Self {
        self.formats = [oldest, newest];
        self
    }

    /// A builder over a connection the application already made (its own TLS, credentials,
    /// timeouts, DNS): the store uses it as it is and reconnects through it. See
    /// [`RedisStore::from_connection`].
    pub(super) fn with_backend(backend: Backend) -> Self {
        let mut b = RedisStoreBuilder::new(String::new());
        if backend.is_cluster() {
            b.connection = Connection::Cluster(Vec::new());
        }
        b.given = Some(backend);
        b
    }

    /// Authenticates as ACL `username` with `password` (Redis 6 and later), over anything
    /// the URL says. `username` `None` authenticates the `default` user with a password
    /// (`requirepass`). The URL can carry them too: `redis://user:password@host:6379`.
    pub fn credentials(mut self, username: Option<&str>, password: &str) -> Self {
        self.credentials = Some((username.map(str::to_owned), password.to_owned()));
        self
    }

    /// Trusts the certificate authority in `pem` (PEM, one or more certificates) for a
    /// `rediss://` connection, instead of the system's roots: a managed Redis whose CA is
    /// not public, or a server with a self-signed certificate.
    #[cfg(feature = "redis-tls")]
    pub fn ca_certificate_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.ca = Some(pem.into());
        self
    }

    /// Presents this client certificate and its private key (PEM) on a `rediss://`
    /// connection, for a server that authenticates clients (`tls-auth-clients yes`).
    #[cfg(feature = "redis-tls")]
    pub fn client_certificate_pem(
        mut self,
        certificate: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls.client = Some((certificate.into(), key.into()));
        self
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
        if self.given.is_some() {
            return Ok(());
        }
        let urls = match &self.connection {
            Connection::Cluster(nodes) => nodes.clone(),
            _ => vec![self.url.clone()],
        };
        for url in &urls {
            let tls = url.starts_with("rediss://");
            if tls && !cfg!(feature = "redis-tls") {
                return Err(StoreError::Unavailable(format!(
                    "`{}` asks for TLS: enable tower-fairshare's `redis-tls` feature",
                    redacted(url)
                )));
            }
            #[cfg(feature = "redis-tls")]
            if !tls && self.tls.given() {
                return Err(StoreError::Unavailable(format!(
                    "TLS certificates were given but `{}` is not a TLS address: use `rediss://`",
                    redacted(url)
                )));
            }
        }
        #[cfg(feature = "redis-bb8")]
        if matches!(self.connection, Connection::Pool(_))
            && (self.credentials.is_some() || cfg!(feature = "redis-tls") && self.tls_given())
        {
            return Err(StoreError::Unavailable(
                "the bb8 pool takes credentials and TLS from its URL only: put them in the URL, or use the multiplexed connection".into(),
            ));
        }
        Ok(())
    }

    #[cfg(feature = "redis-bb8")]
    fn tls_given(&self) -> bool {
        #[cfg(feature = "redis-tls")]
        return self.tls.given();
        #[cfg(not(feature = "redis-tls"))]
        false
    }

    /// The client of the single server at the URL, with the credentials and certificates
    /// given.
    fn client(&self) -> Result<redis::Client, StoreError> {
        use redis::IntoConnectionInfo;
        let mut info = self
            .url
            .as_str()
            .into_connection_info()
            .map_err(connect_error)?;
        if let Some((user, password)) = &self.credentials {
            let mut settings = info.redis_settings().clone().set_password(password);
            if let Some(user) = user {
                settings = settings.set_username(user);
            }
            info = info.set_redis_settings(settings);
        }
        #[cfg(feature = "redis-tls")]
        if self.tls.given() {
            return redis::Client::build_with_tls(info, self.tls.certificates())
                .map_err(connect_error);
        }
        redis::Client::open(info).map_err(connect_error)
    }

    /// The client of the cluster reachable through `nodes`, likewise.
    fn cluster_client(
        &self,
        nodes: &[String],
    ) -> Result<redis::cluster::ClusterClient, RedisError> {
        let mut b = redis::cluster::ClusterClient::builder(nodes.to_vec())
            .connection_timeout(self.connect_timeout())
            .response_timeout(self.connect_timeout())
            .retries(2)
            .min_retry_wait(10)
            .max_retry_wait(200);
        if let Some((user, password)) = &self.credentials {
            b = b.password(password);
            if let Some(user) = user {
                b = b.username(user);
            }
        }
        #[cfg(feature = "redis-tls")]
        if self.tls.given() {
            b = b.certs(self.tls.certificates());
        }
        b.build()
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
        let backend = match &self.connection {
            _ if self.given.is_some() => self.given.clone(),
            Connection::Multiplexed => Some(Backend::Multiplexed(
                ConnectionManager::new_lazy_with_config(self.client()?, manager_config(&self))
                    .map_err(connect_error)?,
            )),
            #[cfg(feature = "redis-bb8")]
            Connection::Pool(size) => Some(Backend::Pool(
                pool_builder(&self, *size).build_unchecked(pool_manager(&self)?),
            )),
            // The cluster client connects eagerly: keep trying in the background.
            Connection::Cluster(_) => None,
        };
        let store = RedisStore::from_parts(self, backend);
        store.shared.spawn_upkeep(false);
        Ok(store)
    }

    /// How long opening a connection may take: the timeout, at least 100 ms.
    fn connect_timeout(&self) -> Duration {
        self.timeout.max(Duration::from_millis(100))
    }
}

fn manager_config(b: &RedisStoreBuilder) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_min_delay(Duration::from_millis(20))
        .set_max_delay(Duration::from_millis(200))
        .set_number_of_retries(8)
        .set_connection_timeout(Some(b.connect_timeout()))
        .set_response_timeout(None)
}

#[cfg(feature = "redis-bb8")]
fn pool_manager(b: &RedisStoreBuilder) -> Result<bb8_redis::RedisConnectionManager, StoreError> {
    bb8_redis::RedisConnectionManager::new(b.url.as_str()).map_err(connect_error)
}

#[cfg(feature = "redis-bb8")]
fn pool_builder(
    b: &RedisStoreBuilder,
    size: u32,
) -> bb8::Builder<bb8_redis::RedisConnectionManager> {
    bb8::Pool::builder()
        .max_size(size)
        .test_on_check_out(false)
        .connection_timeout(b.connect_timeout())
}

/// Opens the connection now (or fails).
pub(super) async fn connect_now(b: &RedisStoreBuilder) -> Result<Backend, StoreError> {
    let within = b.timeout.max(Duration::from_secs(2));
    let timed_out = |_| StoreError::Timeout(within);
    if let Some(given) = &b.given {
        return Ok(given.clone());
    }
    Ok(match &b.connection {
        Connection::Multiplexed => {
            let connecting = ConnectionManager::new_with_config(b.client()?, manager_config(b));
            let manager = tokio::time::timeout(within, connecting)
                .await
                .map_err(timed_out)?;
            Backend::Multiplexed(manager.map_err(connect_error)?)
        }
        Connection::Cluster(nodes) => {
            let client = b.cluster_client(nodes).map_err(connect_error)?;
            let connecting = client.get_async_connection();
            let conn = tokio::time::timeout(within, connecting)
                .await
                .map_err(timed_out)?;
            Backend::Cluster(conn.map_err(connect_error)?)
        }
        #[cfg(feature = "redis-bb8")]
        Connection::Pool(size) => {
            let pool = pool_builder(b, *size).build(pool_manager(b)?).await;
            Backend::Pool(pool.map_err(connect_error)?)
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

/// `url` with its password, if any, left out: for error messages.
fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://…@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// A failed connection, said so that a user knows what to change: TLS and authentication
/// failures name their cause.
pub(super) fn connect_error(e: RedisError) -> StoreError {
    let text = e.to_string();
    let lower = text.to_lowercase();
    let hint = if lower.contains("certificaterequired") {
        Some("Redis asks for a client certificate: give one with its key (`RedisStoreBuilder::client_certificate_pem`)")
    } else if lower.contains("unknownissuer") || lower.contains("invalid peer certificate") {
        Some("Redis's TLS certificate is not signed by a trusted authority: give the CA that signed it (`RedisStoreBuilder::ca_certificate_pem`), or check the host name in the URL")
    } else if lower.contains("wrongpass")
        || lower.contains("noauth")
        || lower.contains("authentication")
    {
        Some("Redis refused the credentials: check the ACL user and password (`RedisStoreBuilder::credentials`, or `redis://user:password@host` in the URL)")
    } else if lower.contains("certificate") || lower.contains("tls") || lower.contains("handshake")
    {
        Some("the TLS handshake with Redis failed: check the certificates, that the server speaks TLS on this port, and that the URL is `rediss://`")
    } else {
        None
    };
    StoreError::Unavailable(match hint {
        Some(hint) => format!("{hint} ({text})"),
        None => text,
    })
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
