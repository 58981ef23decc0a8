//! What a store does in the background: renew the permits of its calls still running, and
//! check that Redis keeps its state (configuration, epoch markers).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::builder::{connect_in_background, TimeSource};
use super::{lock, wire, Shared};
use crate::clock::Timestamp;
use crate::store::StoreError;

/// How often a store reads the epoch markers of the tools it decides for, so that a loss is
/// noticed (and healed) on a tool this replica is not calling.
const EPOCH_CHECK_EVERY: Duration = Duration::from_secs(1);

/// What [`RedisStore::check_health`](super::RedisStore::check_health) found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreHealth {
    /// Redis's `maxmemory-policy` (`None` when it would not say, e.g. `CONFIG` is disabled).
    pub eviction_policy: Option<String>,
    /// Whether Redis persists its data, by AOF or RDB snapshots (`None` when it would not say).
    pub persistence: Option<bool>,
    /// Tools whose state this check found lost: their epoch marker was gone or had changed
    /// since the store last saw it (a restart without persistence, a flush, an eviction).
    pub lost_tools: Vec<String>,
    /// How many times this store has found a tool's state lost, in all.
    pub states_lost: u64,
    /// What is at risk and what to change, in words (empty when all is well).
    pub warnings: Vec<String>,
}

/// The tools a store decides for, and the epoch marker it last saw for each.
#[derive(Debug, Default)]
pub(super) struct HealthState {
    epochs: Mutex<HashMap<Arc<str>, Vec<u8>>>,
    lost: AtomicU64,
    /// The warnings last logged, so a check logs only what changed.
    reported: Mutex<Option<Vec<String>>>,
}

impl HealthState {
    /// Notes the epoch marker of `tool` as read now; when it differs from the one last seen,
    /// Redis lost the tool's state: logged (once per change, whoever reads it first) and
    /// counted. Whether it differed.
    pub(super) fn saw_epoch(&self, tool: &Arc<str>, now: &[u8]) -> bool {
        let mut epochs = lock(&self.epochs);
        let seen = epochs.insert(tool.clone(), now.to_vec());
        drop(epochs);
        let lost = seen.is_some_and(|before| before != now);
        if lost {
            let n = self.lost.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::error!(
                store = "redis",
                tool = %tool,
                times = n,
                "Redis lost this tool's state (a restart without persistence, a flush or an eviction); this replica puts back what it admitted in the windows still open, but what replicas that went down with Redis admitted is lost: keep persistence on and maxmemory-policy noeviction"
            );
            crate::telemetry::state_lost("redis", tool);
        }
        lost
    }
}

impl Shared {
    /// Starts the store's background work: connecting (when it started without a
    /// connection), permit renewal and health checks, until the store is dropped.
    pub(super) fn spawn_upkeep(self: &Arc<Self>, connected: bool) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                store = "redis",
                "no tokio runtime: the store cannot renew permits or check Redis in the background"
            );
            return;
        };
        let weak = Arc::downgrade(self);
        rt.spawn(async move {
            if !connected && !connect_in_background(&weak).await {
                return;
            }
            let mut last_check: Option<Instant> = None;
            let mut last_epochs = Instant::now();
            let mut last_announced: Option<Instant> = None;
            loop {
                let Some(sh) = weak.upgrade() else { return };
                if last_announced.is_none_or(|t| t.elapsed() >= super::replicas::ANNOUNCE_EVERY) {
                    last_announced = Some(Instant::now());
                    if let Err(e) = sh.announce().await {
                        tracing::debug!(store = "redis", error = %e, "could not announce this replica");
                    }
                }
                let every = sh.config.upkeep_every;
                if !every.is_zero() && last_check.is_none_or(|t| t.elapsed() >= every) {
                    last_check = Some(Instant::now());
                    last_epochs = Instant::now();
                    if let Err(e) = sh.check_health().await {
                        tracing::debug!(store = "redis", error = %e, "health check failed");
                    }
                } else if !every.is_zero() && last_epochs.elapsed() >= EPOCH_CHECK_EVERY {
                    last_epochs = Instant::now();
                    if let Err(e) = sh.check_epochs().await {
                        tracing::debug!(store = "redis", error = %e, "epoch check failed");
                    }
                }
                if let Some(cache) = &sh.cache {
                    cache.sweep();
                }
                // With an injected clock the store does not know the time: the caller renews.
                if sh.config.time == TimeSource::Redis && !lock(&sh.held).is_empty() {
                    if let Err(e) = sh.renew(Timestamp(0), None).await {
                        tracing::warn!(store = "redis", error = %e, "could not renew permits; they lapse after the permit TTL unless renewed");
                    }
                }
                let mut tick = (sh.config.permit_ttl / 3).min(super::replicas::ANNOUNCE_EVERY);
                if !every.is_zero() {
                    tick = tick.min(every).min(EPOCH_CHECK_EVERY);
                }
                drop(sh);
                tokio::time::sleep(tick.max(Duration::from_millis(100))).await;
            }
        });
    }

    /// Reads one `CONFIG GET` value; `None` when Redis will not say.
    async fn config_value(&self, name: &str) -> Option<String> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg(name);
        let pairs: Vec<String> = self.query(&cmd).await.ok()?;
        pairs.into_iter().nth(1)
    }

    /// Sets `tool`'s epoch marker if it is missing; whether the state was lost since the
    /// marker was last seen (it was gone, or another replica had set a new one).
    async fn check_epoch(&self, tool: &Arc<str>) -> Result<bool, StoreError> {
        let mut key = self.config.namespace.clone();
        key.push_str(&wire::epoch_key(&crate::key::tool_key(tool)));
        let mine = self.ids.next().to_le_bytes().to_vec();
        let ttl = wire::MARKER_TTL.as_secs();
        // Set if missing, then read: whichever replica's `SET NX` won, every replica reads the
        // same marker, on every Redis version. Plain commands, not a script: a check never
        // shows up as a decision in Redis's command statistics.
        let mut set = redis::cmd("SET");
        set.arg(&key).arg(&mine).arg("NX").arg("EX").arg(ttl);
        let set: Option<String> = self.query(&set).await?;
        let found: Option<Vec<u8>> = self.query(redis::cmd("GET").arg(&key)).await?;
        if set.is_none() {
            // Seen: it lives its TTL (32 days) past this check.
            let _: i64 = self.query(redis::cmd("EXPIRE").arg(&key).arg(ttl)).await?;
        }
        let now = found.unwrap_or(mine);
        let lost = self.health.saw_epoch(tool, &now);
        Ok(lost)
    }

    /// Checks the epoch marker of every tool this store decides for; a tool whose state was
    /// lost is healed by its worker (see `batch::Job::Heal`), which this waits for (within
    /// the timeout of a worker's round trips). The tools found lost.
    async fn check_epochs(self: &Arc<Self>) -> Result<Vec<String>, StoreError> {
        let tools: Vec<Arc<str>> = lock(&self.health.epochs).keys().cloned().collect();
        let mut lost = Vec::new();
        let mut healed = Vec::new();
        for tool in tools {
            if self.check_epoch(&tool).await? {
                let (reply, done) = tokio::sync::oneshot::channel();
                super::batch::submit(self, &tool, super::batch::Job::Heal { reply });
                healed.push(done);
                lost.push(tool.to_string());
            }
        }
        let bound = self.worker_bound();
        for done in healed {
            let _ = tokio::time::timeout(bound, done).await;
        }
        Ok(lost)
    }

    pub(super) async fn check_health(self: &Arc<Self>) -> Result<StoreHealth, StoreError> {
        self.backend()?;
        let mut health = StoreHealth {
            eviction_policy: self.config_value("maxmemory-policy").await,
            ..StoreHealth::default()
        };
        let appendonly = self.config_value("appendonly").await;
        let save = self.config_value("save").await;
        health.persistence = match (appendonly.as_deref(), save.as_deref()) {
            (Some("yes"), _) => Some(true),
            (_, Some(s)) if !s.trim().is_empty() => Some(true),
            (Some(_), Some(_)) => Some(false),
            _ => None,
        };
        health.lost_tools = self.check_epochs().await?;
        health.states_lost = self.health.lost.load(Ordering::Relaxed);
        let evicts = health
            .eviction_policy
            .as_deref()
            .is_some_and(|p| p != "noeviction");
        if evicts {
            health.warnings.push(format!(
                "Redis's maxmemory-policy is {}: at its memory limit Redis evicts keys, and an evicted counter admits as if fresh; set maxmemory-policy noeviction",
                health.eviction_policy.as_deref().unwrap_or_default()
            ));
        }
        let unpersisted = health.persistence == Some(false);
        if unpersisted {
            health.warnings.push(
                "Redis persistence is off (appendonly no, save \"\"): a restart loses every counter and budget; turn on AOF (appendonly yes, appendfsync everysec)".to_owned(),
            );
        }
        crate::telemetry::store_risk("redis", "eviction", evicts);
        crate::telemetry::store_risk("redis", "no_persistence", unpersisted);
        let mut reported = lock(&self.health.reported);
        if reported.as_ref() != Some(&health.warnings) {
            for w in &health.warnings {
                tracing::warn!(store = "redis", "{w}");
            }
            *reported = Some(health.warnings.clone());
        }
        Ok(health)
    }
}
