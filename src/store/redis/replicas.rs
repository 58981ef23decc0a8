//! What the replicas sharing a Redis store tell each other: which record formats each can
//! read and write, and a fingerprint of the policy each enforces per tool.
//!
//! Every replica writes an entry in one hash (`fs{replicas}@` behind the namespace, a key no
//! version of the store ever renames) every second and reads the others': an entry is the
//! Redis time it was written and a JSON object. An entry not renewed for
//! [`STALE`] belongs to a replica that is gone, and whoever reads it deletes it.
//!
//! **Formats.** A replica writes records in the newest format every live replica can read
//! (and, until it has read the entries once, in the oldest it knows), and reads every format
//! it knows: `docs/redis.md` (*Upgrades*) says what that means for a rolling upgrade.
//!
//! **Policies.** A tool whose fingerprints differ among the live replicas is reported: a
//! warning naming the tool when it is first seen, the `fairshare_policy_mismatch` gauge, the
//! console's `policy` field, and, once it outlasts the grace time (a rolling reload that
//! should have finished), an error every grace time until they agree.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::record::{FORMAT, OLDEST_FORMAT};
use super::{lock, Shared};
use crate::store::{PolicyDisagreement, StoreError};

/// How often a replica writes its entry and reads the others'.
pub(super) const ANNOUNCE_EVERY: Duration = Duration::from_secs(1);
/// An entry not renewed for this long is a replica that is gone.
const STALE: Duration = Duration::from_secs(5);
/// The hash of entries lives this long past the last write.
const KEY_TTL: Duration = Duration::from_secs(60);

/// What one replica says of itself.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
struct Entry {
    /// The oldest and newest record formats it reads and writes.
    formats: [u8; 2],
    /// Its policy's fingerprint per tool, in hex; `None` before a limiter has told the store
    /// its policy (such a replica is left out of the comparison).
    #[serde(default)]
    tools: Option<BTreeMap<String, String>>,
}

/// A tool the replicas disagree on, as this replica has followed it.
#[derive(Debug)]
struct Disagreeing {
    since: Instant,
    /// When the last error past the grace time was said.
    said_loudly: Option<Instant>,
    latest: PolicyDisagreement,
}

/// This replica's entry and what it last read of the others'.
#[derive(Debug)]
pub(super) struct Replicas {
    pub(super) id: String,
    formats: [u8; 2],
    grace: Duration,
    mine: Mutex<Entry>,
    /// The format records are written in now (see the module docs).
    write_format: std::sync::atomic::AtomicU8,
    disagreeing: Mutex<HashMap<String, Disagreeing>>,
}

impl Replicas {
    pub(super) fn new(id: u64, formats: [u8; 2], grace: Duration) -> Self {
        Replicas {
            id: format!("{id:016x}"),
            formats,
            grace,
            mine: Mutex::new(Entry {
                formats,
                tools: None,
            }),
            write_format: std::sync::atomic::AtomicU8::new(formats[0]),
            disagreeing: Mutex::new(HashMap::new()),
        }
    }

    /// The record format to write now.
    pub(super) fn write_format(&self) -> u8 {
        self.write_format.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Notes the policy this replica enforces: announced with the next entry.
    pub(super) fn policy_in_force(&self, policy: &crate::Policy) {
        lock(&self.mine).tools = Some(
            policy
                .tools()
                .map(|t| (t.name().to_owned(), format!("{:016x}", t.fingerprint())))
                .collect(),
        );
    }

    /// The tools the live replicas disagree on, as last read.
    pub(super) fn disagreements(&self) -> Vec<PolicyDisagreement> {
        let mut out: Vec<PolicyDisagreement> = lock(&self.disagreeing)
            .values()
            .map(|d| PolicyDisagreement {
                for_how_long: d.since.elapsed(),
                past_grace: d.since.elapsed() >= self.grace,
                ..d.latest.clone()
            })
            .collect();
        out.sort_by(|a, b| a.tool.cmp(&b.tool));
        out
    }

    /// The format to write given the live replicas' entries: the newest every one of them
    /// reads, never older than the oldest this replica writes.
    fn choose_format(&self, others: &[Entry]) -> u8 {
        let newest = others
            .iter()
            .map(|e| e.formats[1])
            .fold(self.formats[1], u8::min);
        if newest < self.formats[0] {
            tracing::error!(
                store = "redis",
                oldest_here = self.formats[0],
                newest_there = newest,
                "a replica sharing this Redis cannot read any record format this one writes: upgrade it (or stop it) before this one decides"
            );
        }
        newest.max(self.formats[0])
    }

    /// The tools whose fingerprints differ among this replica and `others` (those that
    /// announced a policy; none when this one has not).
    fn compare(&self, others: &[Entry]) -> Vec<PolicyDisagreement> {
        let Some(mine) = lock(&self.mine).tools.clone() else {
            return Vec::new();
        };
        let others: Vec<&BTreeMap<String, String>> =
            others.iter().filter_map(|e| e.tools.as_ref()).collect();
        let parse = |hex: Option<&String>| hex.and_then(|h| u64::from_str_radix(h, 16).ok());
        let mut tools: Vec<&String> = mine.keys().collect();
        for e in &others {
            tools.extend(e.keys());
        }
        tools.sort();
        tools.dedup();
        let mut out = Vec::new();
        for tool in tools {
            let here = parse(mine.get(tool));
            let mut counts: BTreeMap<Option<u64>, usize> = BTreeMap::new();
            *counts.entry(here).or_default() += 1;
            for e in &others {
                *counts.entry(parse(e.get(tool))).or_default() += 1;
            }
            if counts.len() > 1 {
                out.push(PolicyDisagreement {
                    tool: tool.clone(),
                    fingerprint: here,
                    replicas: counts.into_iter().collect(),
                    for_how_long: Duration::ZERO,
                    past_grace: false,
                });
            }
        }
        out
    }

    /// Follows what `found` says against what was said before: a warning for a new
    /// disagreement, an error once one outlasts the grace time (and every grace time after),
    /// a line when the replicas agree again; the gauge of each tool found, set at every check.
    fn follow(&self, found: Vec<PolicyDisagreement>) {
        let mut following = lock(&self.disagreeing);
        let now = Instant::now();
        for tool in following.keys().cloned().collect::<Vec<_>>() {
            if !found.iter().any(|d| d.tool == tool) {
                following.remove(&tool);
                tracing::info!(store = "redis", tool = %tool, "the replicas enforce the same policy for this tool again");
                crate::telemetry::policy_mismatch(&tool, false);
            }
        }
        for d in found {
            let entry = following.entry(d.tool.clone()).or_insert_with(|| {
                tracing::warn!(
                    store = "redis",
                    tool = %d.tool,
                    fingerprints = %described(&d),
                    "replicas sharing this Redis enforce different policies for this tool (a rolling reload in progress?); each decides by its own until they agree"
                );
                Disagreeing {
                    since: now,
                    said_loudly: None,
                    latest: d.clone(),
                }
            });
            // Set at every check while it lasts: an exporter that drops series not updated
            // for a while keeps this one.
            crate::telemetry::policy_mismatch(&d.tool, true);
            entry.latest = d;
            let due = entry
                .said_loudly
                .is_none_or(|t| now.duration_since(t) >= self.grace);
            if now.duration_since(entry.since) >= self.grace && due {
                entry.said_loudly = Some(now);
                tracing::error!(
                    store = "redis",
                    tool = %entry.latest.tool,
                    fingerprints = %described(&entry.latest),
                    for_secs = now.duration_since(entry.since).as_secs(),
                    "replicas sharing this Redis still enforce different policies for this tool, past the grace time of a rolling reload: give every replica the same policy file"
                );
            }
        }
    }
}

/// `fingerprint ×replicas, …` for a log line.
fn described(d: &PolicyDisagreement) -> String {
    d.replicas
        .iter()
        .map(|(f, n)| match f {
            Some(f) => format!("{f:016x} ×{n}"),
            None => format!("(no such tool) ×{n}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

impl Shared {
    /// The key of the replicas' entries.
    fn replicas_key(&self) -> String {
        format!("{}fs{{replicas}}@", self.config.namespace)
    }

    /// Writes this replica's entry, reads the others' (deleting those gone stale) and acts on
    /// them: the record format to write, the policies to report.
    pub(super) async fn announce(&self) -> Result<(), StoreError> {
        let key = self.replicas_key();
        let (secs, micros): (u64, u64) = self.query(&redis::cmd("TIME")).await?;
        let now_ms = secs * 1_000 + micros / 1_000;
        let all: HashMap<String, String> = self.query(redis::cmd("HGETALL").arg(&key)).await?;
        let mut others = Vec::new();
        let mut stale = Vec::new();
        for (id, value) in all {
            if id == self.replicas.id {
                continue;
            }
            let parsed = value.split_once(' ').and_then(|(seen, json)| {
                Some((
                    seen.parse::<u64>().ok()?,
                    serde_json::from_str::<Entry>(json).ok()?,
                ))
            });
            match parsed {
                Some((seen, entry)) if now_ms.saturating_sub(seen) < STALE.as_millis() as u64 => {
                    others.push(entry)
                }
                _ => stale.push(id),
            }
        }
        let mine = serde_json::to_string(&*lock(&self.replicas.mine)).expect("an entry serializes");
        let mut set = redis::cmd("HSET");
        set.arg(&key)
            .arg(&self.replicas.id)
            .arg(format!("{now_ms} {mine}"));
        let _: i64 = self.query(&set).await?;
        if !stale.is_empty() {
            let _: i64 = self.query(redis::cmd("HDEL").arg(&key).arg(&stale)).await?;
        }
        let _: i64 = self
            .query(
                redis::cmd("PEXPIRE")
                    .arg(&key)
                    .arg(KEY_TTL.as_millis() as u64),
            )
            .await?;
        let format = self.replicas.choose_format(&others);
        self.replicas
            .write_format
            .store(format, std::sync::atomic::Ordering::Relaxed);
        self.replicas.follow(self.replicas.compare(&others));
        Ok(())
    }
}

/// The formats this version reads and writes.
pub(super) const FORMATS: [u8; 2] = [OLDEST_FORMAT, FORMAT];

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use std::sync::Arc;

    use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};

    use super::*;

    /// A recorder that counts how often `fairshare_policy_mismatch` is set.
    struct MismatchSets(Arc<AtomicUsize>);

    impl metrics::GaugeFn for MismatchSets {
        fn increment(&self, _: f64) {}
        fn decrement(&self, _: f64) {}
        fn set(&self, _: f64) {
            self.0.fetch_add(1, Relaxed);
        }
    }

    impl metrics::Recorder for MismatchSets {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            match key.name() == crate::telemetry::POLICY_MISMATCH {
                true => Gauge::from_arc(Arc::new(MismatchSets(self.0.clone()))),
                false => Gauge::noop(),
            }
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    /// An exporter that drops series not updated for a while (as `fairshare serve`'s does)
    /// must not drop the gauge of a disagreement that lasts: every check that still finds it
    /// sets the gauge again.
    #[test]
    fn a_lasting_disagreement_sets_its_gauge_at_every_check() {
        let replicas = Replicas::new(1, FORMATS, Duration::from_secs(30));
        let found = PolicyDisagreement {
            tool: "search".into(),
            fingerprint: Some(1),
            replicas: vec![(Some(1), 1), (Some(2), 1)],
            for_how_long: Duration::ZERO,
            past_grace: false,
        };
        let sets = Arc::new(AtomicUsize::new(0));
        let recorder = MismatchSets(sets.clone());
        metrics::with_local_recorder(&recorder, || {
            for _ in 0..3 {
                replicas.follow(vec![found.clone()]);
            }
        });
        assert_eq!(
            sets.load(Relaxed),
            3,
            "the gauge set at each of three checks"
        );
    }
}
