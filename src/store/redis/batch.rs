//! A tool's decisions, in batches, decided in Rust and written to Redis atomically.
//!
//! Every call of a tool on this store goes through the tool's queue. A worker takes what is
//! queued (up to [`MAX_BATCH`] jobs), reads in one script everything they touch — the time,
//! the records of every level, how many template callers each tracker and how many permits
//! each capped level counts now — and decides the jobs one after the other on that snapshot
//! with the same engine as the in-process store ([`engine::decide`], [`engine::adjust`]), each
//! seeing the ones before it. Then one more script writes the new records, but only if none
//! of the records it read has changed meanwhile (their 8-byte versions are compared); if one
//! has (another replica wrote it), nothing is written and the batch is read and decided
//! again. So the arithmetic exists once, in Rust, and Redis compares and copies.
//!
//! What the compare does not cover cannot make a decision wrong: permits given back or lapsed
//! and template callers no longer tracked only lower what was counted, and every call that
//! takes a permit or joins a tracker also writes the records of its levels, which are
//! compared. A caller that went away before its answer (dropped, timed out) is answered
//! nonetheless; when that answer cannot be delivered and it was an admission, the worker
//! gives it back: its units by a refund through the queue, its permits released.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use redis::Value;
use tokio::sync::{mpsc, oneshot};

use super::builder::TimeSource;
use super::record::Record;
use super::wire::{permits_key, tracker_key};
use super::{lock, Shared};
use crate::admission::engine::{self, LevelRef, NodeState, Plan, Snapshot, Tracking, Verdict};
use crate::clock::Timestamp;
use crate::policy::{LevelPolicy, ToolPolicy};
use crate::store::{Admission, CallKeys, Decision, StoreError};

/// The most jobs one batch decides.
const MAX_BATCH: usize = 64;
/// How many times a batch is read and decided again when another replica wrote first.
const MAX_ATTEMPTS: usize = 16;

/// Which policy of a tool applies to a level: a listed one, by its position, or the template.
#[derive(Copy, Clone, Debug)]
enum Pick {
    Listed(usize),
    Template,
}

fn pick(p: &LevelPolicy) -> Pick {
    if p.template {
        Pick::Template
    } else {
        Pick::Listed(p.position)
    }
}

/// A [`Plan`] that owns what it refers to, so the worker can decide it later.
#[derive(Clone, Debug)]
pub(super) struct OwnedPlan {
    now: Timestamp,
    cost: f64,
    tool: Arc<ToolPolicy>,
    tenant: Pick,
    instance: Option<Pick>,
    untenanted: bool,
}

impl OwnedPlan {
    pub(super) fn of(plan: &Plan<'_>) -> OwnedPlan {
        OwnedPlan {
            now: plan.now,
            cost: plan.cost,
            tool: plan.tool.clone(),
            tenant: pick(plan.tenant.policy),
            instance: plan.instance.map(|i| pick(i.policy)),
            untenanted: plan.untenanted,
        }
    }

    /// The plan again, at `now`, naming the levels as `keys` does.
    fn plan<'a>(&'a self, keys: &'a CallKeys, now: Timestamp) -> Plan<'a> {
        let tool = &self.tool;
        let tenant = match self.tenant {
            Pick::Listed(i) => &tool.tenants[i],
            Pick::Template => tool.default_tenant.as_ref().expect("a template tenant"),
        };
        let instance = self.instance.map(|p| LevelRef {
            name: keys.instance.as_deref().expect("an instance key"),
            policy: match p {
                Pick::Listed(i) => &tenant.children[i],
                Pick::Template => tenant.default_child.as_deref().expect("a template"),
            },
        });
        Plan {
            now,
            cost: self.cost,
            tool,
            tenant: LevelRef {
                name: &keys.tenant,
                policy: tenant,
            },
            instance,
            untenanted: self.untenanted,
        }
    }
}

/// Work for a tool's worker.
pub(super) enum Job {
    /// Decide a call (and commit it if admitted).
    Decide {
        plan: OwnedPlan,
        keys: CallKeys,
        call: u128,
        reply: oneshot::Sender<Result<Decision, StoreError>>,
    },
    /// Add `factor` × an admitted call's charge at every level it charged.
    Adjust {
        admission: Box<Admission>,
        factor: f64,
        now: Timestamp,
        reply: Option<oneshot::Sender<Result<(), StoreError>>>,
    },
}

impl Job {
    fn now(&self) -> Timestamp {
        match self {
            Job::Decide { plan, .. } => plan.now,
            Job::Adjust { now, .. } => *now,
        }
    }

    fn gone(&self) -> bool {
        matches!(self, Job::Decide { reply, .. } if reply.is_closed())
    }
}

/// Sends `job` to the worker of `tool`, starting it if it has none.
pub(super) fn submit(shared: &Arc<Shared>, tool: &Arc<str>, job: Job) {
    let mut queues = lock(&shared.queues);
    if let Some(q) = queues.get(tool) {
        match q.send(job) {
            Ok(()) => return,
            Err(mpsc::error::SendError(job)) => {
                queues.remove(tool);
                return drop_job(job, "the tool's worker stopped");
            }
        }
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return drop_job(job, "no tokio runtime to decide on");
    };
    let _ = tx.send(job);
    queues.insert(tool.clone(), tx);
    rt.spawn(work(Arc::downgrade(shared), rx));
}

fn drop_job(job: Job, why: &str) {
    let e = || StoreError::Unavailable(why.to_owned());
    match job {
        Job::Decide { reply, .. } => {
            let _ = reply.send(Err(e()));
        }
        Job::Adjust { reply, .. } => {
            if let Some(r) = reply {
                let _ = r.send(Err(e()));
            }
        }
    }
}

/// A tool's worker: batches until the store is gone.
async fn work(shared: Weak<Shared>, mut rx: mpsc::UnboundedReceiver<Job>) {
    let mut held: Option<Job> = None;
    loop {
        let first = match held.take() {
            Some(j) => j,
            None => match rx.recv().await {
                Some(j) => j,
                None => return,
            },
        };
        // With an injected clock a batch shares one `now`: the counts it reads are at that time.
        let injected = shared
            .upgrade()
            .is_some_and(|s| s.config.time == TimeSource::Injected);
        let mut jobs = vec![first];
        while jobs.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(j) if injected && j.now() != jobs[0].now() => {
                    held = Some(j);
                    break;
                }
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        let Some(sh) = shared.upgrade() else { return };
        run(&sh, jobs).await;
    }
}

/// The keys one job touches: its records, and the zsets it counts.
struct JobKeys {
    /// Tool, tenant, instance record keys (index into the batch's record list).
    records: [Option<usize>; 3],
    /// The tool's tracker of template tenants, the tenant's of template instances.
    trackers: [Option<usize>; 2],
    /// The permits zset of each capped level.
    permits: [Option<usize>; 3],
}

/// The batch's keys, each once: records, then zsets.
#[derive(Default)]
struct Keys {
    records: Vec<String>,
    zsets: Vec<String>,
    index: HashMap<String, usize>,
    zindex: HashMap<String, usize>,
}

impl Keys {
    fn record(&mut self, k: &str) -> usize {
        if let Some(&i) = self.index.get(k) {
            return i;
        }
        self.records.push(k.to_owned());
        self.index.insert(k.to_owned(), self.records.len() - 1);
        self.records.len() - 1
    }

    fn zset(&mut self, k: String) -> usize {
        if let Some(&i) = self.zindex.get(&k) {
            return i;
        }
        self.zsets.push(k.clone());
        self.zindex.insert(k, self.zsets.len() - 1);
        self.zsets.len() - 1
    }
}

/// A zset change, in `apply.lua`'s words.
enum ZOp {
    Add {
        key: usize,
        score: f64,
        member: Vec<u8>,
    },
    Prune {
        key: usize,
        upto: f64,
    },
    Expire {
        key: usize,
        ms: u64,
    },
}

/// What a job came to.
enum Outcome {
    Decided(Decision),
    Adjusted,
}

fn fmt_score(x: f64) -> String {
    // Whole microseconds: exact in a double, and in Redis's parser.
    format!("{}", x as u64)
}

fn ttl_ms(until: f64, now: f64) -> u64 {
    (((until - now) / 1000.0).ceil() as i64).max(1) as u64
}

/// Reads, decides and writes one batch, answering every job.
async fn run(sh: &Arc<Shared>, mut jobs: Vec<Job>) {
    // A caller that went away before its call was decided: nothing to decide, nothing to undo.
    jobs.retain(|j| !j.gone());
    if jobs.is_empty() {
        return;
    }
    let mut attempt = 0;
    let outcomes = loop {
        attempt += 1;
        match attempt_batch(sh, &jobs).await {
            Ok(Some(outcomes)) => break Ok(outcomes),
            Ok(None) if attempt < MAX_ATTEMPTS => continue,
            Ok(None) => break Err(StoreError::Unavailable(format!(
                "other replicas kept writing this tool's state: {MAX_ATTEMPTS} attempts conflicted"
            ))),
            Err(e) => break Err(e),
        }
    };
    match outcomes {
        Err(e) => {
            for job in jobs {
                match job {
                    Job::Decide { reply, .. } => {
                        let _ = reply.send(Err(clone_error(&e)));
                    }
                    Job::Adjust { reply, .. } => {
                        if let Some(r) = reply {
                            let _ = r.send(Err(clone_error(&e)));
                        }
                    }
                }
            }
        }
        Ok(outcomes) => {
            for (job, outcome) in jobs.into_iter().zip(outcomes) {
                match (job, outcome) {
                    (Job::Decide { reply, .. }, Outcome::Decided(d)) => {
                        if let Err(Ok(Decision::Admitted(a))) = reply.send(Ok(d)) {
                            // Admitted, and nobody took the answer: give it all back.
                            give_back(sh, a);
                        }
                    }
                    (Job::Adjust { reply, .. }, Outcome::Adjusted) => {
                        if let Some(r) = reply {
                            let _ = r.send(Ok(()));
                        }
                    }
                    _ => unreachable!("an outcome per job, of its kind"),
                }
            }
        }
    }
}

fn clone_error(e: &StoreError) -> StoreError {
    match e {
        StoreError::Timeout(d) => StoreError::Timeout(*d),
        StoreError::Unavailable(s) => StoreError::Unavailable(s.clone()),
        StoreError::Protocol(s) => StoreError::Protocol(s.clone()),
    }
}

/// An admission whose caller went away: its units refunded at every level (through the
/// queue, like any write) and its permits released.
fn give_back(sh: &Arc<Shared>, admission: Box<Admission>) {
    sh.abandoned
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    crate::telemetry::abandoned(&admission.keys.tool);
    let tool = admission.keys.tool.clone();
    if admission.charge.holds_permits() {
        let (sh2, a) = (sh.clone(), admission.clone());
        tokio::spawn(async move {
            if let Err(e) = sh2.release_call(&a).await {
                tracing::warn!(store = "redis", tool = %a.keys.tool, error = %e, "could not release the permits of a decision whose caller went away; they lapse after the permit TTL");
            }
        });
    }
    let now = admission.at;
    submit(
        sh,
        &tool,
        Job::Adjust {
            admission,
            factor: -1.0,
            now,
            reply: None,
        },
    );
}

/// One read–decide–write round. `Ok(None)`: another replica wrote a record first; read again.
async fn attempt_batch(sh: &Arc<Shared>, jobs: &[Job]) -> Result<Option<Vec<Outcome>>, StoreError> {
    let mut keys = Keys::default();
    let mut job_keys = Vec::with_capacity(jobs.len());
    for job in jobs {
        let (call_keys, plan) = match job {
            Job::Decide { keys, plan, .. } => (keys, Some(plan)),
            Job::Adjust { admission, .. } => (&admission.keys, None),
        };
        let [tool, tenant, instance] = sh.state_keys(call_keys);
        let (tool, tenant) = (tool.expect("a tool key"), tenant.expect("a tenant key"));
        let instance = instance.filter(|_| plan.is_none_or(|p| p.instance.is_some()));
        let mut jk = JobKeys {
            records: [Some(keys.record(&tool)), Some(keys.record(&tenant)), None],
            trackers: [None, None],
            permits: [None, None, None],
        };
        if let Some(i) = &instance {
            jk.records[2] = Some(keys.record(i));
        }
        if let Some(plan) = plan {
            let p = plan.plan(call_keys_of(job), plan.now);
            if p.tenant.policy.template {
                jk.trackers[0] = Some(keys.zset(tracker_key(&tool)));
            }
            if p.instance.is_some_and(|i| i.policy.template) {
                jk.trackers[1] = Some(keys.zset(tracker_key(&tenant)));
            }
            let caps = [
                p.tool.max_concurrency.is_some(),
                p.tenant.policy.max_concurrency.is_some(),
                p.instance
                    .is_some_and(|i| i.policy.max_concurrency.is_some()),
            ];
            let level_keys = [Some(&tool), Some(&tenant), instance.as_ref()];
            for (l, (cap, k)) in caps.iter().zip(level_keys).enumerate() {
                if let (true, Some(k)) = (cap, k) {
                    jk.permits[l] = Some(keys.zset(permits_key(k)));
                }
            }
        }
        job_keys.push(jk);
    }

    // 1. Read.
    let now_arg = match sh.config.time {
        TimeSource::Redis => -1.0,
        TimeSource::Injected => jobs[0].now().as_micros() as f64,
    };
    let mut all = keys.records.clone();
    all.extend(keys.zsets.iter().cloned());
    let args = vec![
        format!("{now_arg}").into_bytes(),
        keys.records.len().to_string().into_bytes(),
    ];
    let reply: Value = within(sh, sh.eval(&sh.scripts.read, &all, &args)).await?;
    let (read_now, raw, counts) = parse_read(reply)?;
    let mut records: Vec<Option<Record>> = Vec::with_capacity(raw.len());
    let mut versions: Vec<Vec<u8>> = Vec::with_capacity(raw.len());
    for r in &raw {
        match r {
            Some(bytes) => {
                let rec = Record::decode(bytes)?;
                versions.push(rec.version.to_le_bytes().to_vec());
                records.push(Some(rec));
            }
            None => {
                versions.push(Vec::new());
                records.push(None);
            }
        }
    }
    let mut counts: Vec<f64> = counts.into_iter().map(|c| c as f64).collect();
    let mut written = vec![false; records.len()];
    // Records only corrected (not decided on) keep their TTL: a correction never makes a
    // state live longer, and their permits were not counted here.
    let mut decided = vec![false; records.len()];
    let mut zops: Vec<ZOp> = Vec::new();
    let permit_ttl_us = sh.config.permit_ttl.as_micros() as f64;

    // 2. Decide, one job after the other, each on what the ones before it left.
    let mut outcomes = Vec::with_capacity(jobs.len());
    for (job, jk) in jobs.iter().zip(&job_keys) {
        let now = match sh.config.time {
            TimeSource::Redis => Timestamp(read_now),
            TimeSource::Injected => job.now(),
        };
        let now_f = now.as_micros() as f64;
        match job {
            Job::Decide {
                plan,
                keys: ck,
                call,
                ..
            } => {
                let p = plan.plan(ck, now);
                let state = |l: usize| -> NodeState {
                    let mut s = jk.records[l]
                        .and_then(|i| records[i].as_ref())
                        .map(|r| r.state.clone())
                        .unwrap_or_default();
                    s.in_flight = jk.permits[l].map_or(0.0, |z| counts[z]);
                    s
                };
                let tracked = |l: usize| {
                    jk.records[l]
                        .and_then(|i| records[i].as_ref())
                        .is_some_and(|r| r.track_until > now_f)
                };
                let tracking = |t: usize, l: usize| match jk.trackers[t] {
                    Some(z) => Tracking {
                        count: counts[z] as u64,
                        tracked: tracked(l),
                    },
                    None => Tracking::default(),
                };
                let snapshot = Snapshot {
                    tool: state(0),
                    tenant: state(1),
                    instance: if p.instance.is_some() {
                        state(2)
                    } else {
                        NodeState::default()
                    },
                    tenant_tracking: tracking(0, 1),
                    instance_tracking: tracking(1, 2),
                };
                match engine::decide(&p, &snapshot) {
                    Verdict::Refuse(r) => outcomes.push(Outcome::Decided(Decision::Refused(r))),
                    Verdict::Admit(a) => {
                        let a = *a;
                        let new_states = [a.tool, a.tenant, a.instance];
                        let track = [None, a.track_tenant_until, a.track_instance_until];
                        for l in 0..3 {
                            let Some(i) = jk.records[l] else { continue };
                            if l == 2 && p.instance.is_none() {
                                continue;
                            }
                            let old_until = records[i].as_ref().map_or(0.0, |r| r.track_until);
                            let was_tracked = old_until > now_f;
                            let track_until = track[l].unwrap_or(old_until);
                            records[i] = Some(Record {
                                version: sh.ids.version(),
                                expires: a.expires[l],
                                track_until,
                                state: new_states[l].clone(),
                            });
                            written[i] = true;
                            decided[i] = true;
                            // A tenant is tracked by the tool, an instance by its tenant.
                            let tracker = match l {
                                1 => jk.trackers[0],
                                2 => jk.trackers[1],
                                _ => None,
                            };
                            if let (Some(until), Some(z)) = (track[l], tracker) {
                                if !was_tracked {
                                    counts[z] += 1.0;
                                }
                                zops.push(ZOp::Prune {
                                    key: z,
                                    upto: now_f,
                                });
                                zops.push(ZOp::Add {
                                    key: z,
                                    score: until,
                                    member: keys.records[i].clone().into_bytes(),
                                });
                                zops.push(ZOp::Expire {
                                    key: z,
                                    ms: ttl_ms(until, now_f),
                                });
                            }
                            if a.charge.levels[l].permit {
                                if let Some(z) = jk.permits[l] {
                                    counts[z] += 1.0;
                                    zops.push(ZOp::Prune {
                                        key: z,
                                        upto: now_f,
                                    });
                                    zops.push(ZOp::Add {
                                        key: z,
                                        score: now_f + permit_ttl_us,
                                        member: call.to_le_bytes().to_vec(),
                                    });
                                    zops.push(ZOp::Expire {
                                        key: z,
                                        ms: sh.config.permit_ttl.as_millis() as u64,
                                    });
                                }
                            }
                        }
                        outcomes.push(Outcome::Decided(Decision::Admitted(Box::new(Admission {
                            keys: ck.clone(),
                            charge: a.charge,
                            remaining: a.remaining,
                            quota: a.quota,
                            reset_in: a.reset_in,
                            slack: a.slack,
                            views: a.views,
                            at: now,
                            call: *call,
                        }))));
                    }
                }
            }
            Job::Adjust {
                admission, factor, ..
            } => {
                for l in 0..3 {
                    let Some(i) = jk.records[l] else { continue };
                    if !admission.charge.levels[l].present {
                        continue;
                    }
                    if let Some(rec) = records[i].as_mut() {
                        engine::adjust(&mut rec.state, &admission.charge, l, *factor, now);
                        rec.version = sh.ids.version();
                        written[i] = true;
                    }
                }
                outcomes.push(Outcome::Adjusted);
            }
        }
    }

    // 3. Write, if nothing read has changed.
    if !written.iter().any(|w| *w) && zops.is_empty() {
        return Ok(Some(outcomes));
    }
    let now_f = match sh.config.time {
        TimeSource::Redis => read_now as f64,
        TimeSource::Injected => jobs.last().map_or(0, |j| j.now().as_micros()) as f64,
    };
    // A record lives until it is equivalent to a fresh one and, for a tracked template
    // caller, its tracked time; and at least the permit TTL while calls hold permits there.
    let mut holds = vec![false; records.len()];
    for jk in &job_keys {
        for l in 0..3 {
            if let (Some(i), Some(z)) = (jk.records[l], jk.permits[l]) {
                holds[i] |= counts[z] > 0.0;
            }
        }
    }
    let n = keys.records.len();
    let mut args: Vec<Vec<u8>> = Vec::with_capacity(2 + n + 4 * n + 5 * zops.len());
    args.push(n.to_string().into_bytes());
    args.extend(versions);
    let writes: Vec<usize> = (0..n).filter(|i| written[*i]).collect();
    args.push(writes.len().to_string().into_bytes());
    for &i in &writes {
        let rec = records[i].as_ref().expect("a written record");
        let mut keep = rec.expires.max(rec.track_until);
        if holds[i] {
            keep = keep.max(now_f + permit_ttl_us);
        }
        args.push((i + 1).to_string().into_bytes());
        args.push(rec.encode());
        args.push(if decided[i] {
            ttl_ms(keep, now_f).to_string().into_bytes()
        } else {
            Vec::new()
        });
    }
    args.push(zops.len().to_string().into_bytes());
    for op in &zops {
        match op {
            ZOp::Add { key, score, member } => {
                args.push(b"A".to_vec());
                args.push((n + key + 1).to_string().into_bytes());
                args.push(fmt_score(*score).into_bytes());
                args.push(member.clone());
            }
            ZOp::Prune { key, upto } => {
                args.push(b"P".to_vec());
                args.push((n + key + 1).to_string().into_bytes());
                args.push(fmt_score(*upto).into_bytes());
                args.push(Vec::new());
            }
            ZOp::Expire { key, ms } => {
                args.push(b"E".to_vec());
                args.push((n + key + 1).to_string().into_bytes());
                args.push(ms.to_string().into_bytes());
                args.push(Vec::new());
            }
        }
    }
    let reply: Value = within(sh, sh.eval(&sh.scripts.apply, &all, &args)).await?;
    match reply {
        Value::Int(1) => Ok(Some(outcomes)),
        Value::Array(_) => Ok(None),
        other => Err(StoreError::Protocol(format!(
            "the write script answered {other:?}"
        ))),
    }
}

/// A worker's Redis call. It may take longer than the callers wait (they count their own
/// timeouts as store errors): it is awaited to the end — callers that left by then get their
/// admissions given back — within a bound.
async fn within<T>(
    sh: &Shared,
    f: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let bound = (sh.config.timeout * 20).max(Duration::from_secs(5));
    match tokio::time::timeout(bound, f).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::Timeout(bound)),
    }
}

fn call_keys_of(job: &Job) -> &CallKeys {
    match job {
        Job::Decide { keys, .. } => keys,
        Job::Adjust { admission, .. } => &admission.keys,
    }
}

type ReadReply = (u64, Vec<Option<Vec<u8>>>, Vec<u64>);

fn parse_read(reply: Value) -> Result<ReadReply, StoreError> {
    let bad = |what: &str| StoreError::Protocol(format!("the read script answered {what}"));
    let Value::Array(mut items) = reply else {
        return Err(bad("something other than an array"));
    };
    if items.len() != 3 {
        return Err(bad("the wrong number of parts"));
    }
    let counts = items.pop().expect("3 parts");
    let records = items.pop().expect("3 parts");
    let now = items.pop().expect("3 parts");
    let now: u64 = redis::from_redis_value::<String>(now)
        .map_err(|_| bad("no time"))?
        .parse::<f64>()
        .map_err(|_| bad("a time that is not a number"))? as u64;
    let records: Vec<Option<Vec<u8>>> =
        redis::from_redis_value(records).map_err(|_| bad("records that are not strings"))?;
    let counts: Vec<u64> =
        redis::from_redis_value(counts).map_err(|_| bad("counts that are not numbers"))?;
    Ok((now, records, counts))
}
