//! A tool's decisions, in batches, decided in Rust and written to Redis atomically: the
//! queue, the worker and its round trips, as `docs/redis.md` (*How a call is decided*)
//! describes them. Here, besides:
//!
//! - a batch is at most [`MAX_BATCH`] jobs, decided with [`engine::decide`] and
//!   [`engine::adjust`] one after the other on one snapshot, each seeing the ones before it;
//! - the worker remembers the records it last read and wrote ([`Cache`]), so a batch whose
//!   records only this replica writes needs no read;
//! - writes go one behind the other ([`Worker::pipeline`]): a write expects the versions the
//!   one ahead of it makes, so if that one did not land, the one behind fails its check too;
//! - a caller that went away before its answer is answered nonetheless; when that answer
//!   cannot be delivered and it was an admission, the worker gives it back: its units by a
//!   refund through the queue, its permits released.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Duration;

use redis::Value;
use tokio::sync::{mpsc, oneshot};

use super::builder::TimeSource;
use super::ledger::Ledger;
use super::record::Record;
use super::wire::{self, permits_key};
use super::{lock, Shared};
use crate::admission::engine::{self, NodeState, OwnedPlan, Plan, PlanCounts, Snapshot};
use crate::clock::Timestamp;
use crate::store::{Admission, Admissions, CallKeys, Decision, StoreError};

/// The most jobs one batch decides.
const MAX_BATCH: usize = 64;
/// How many times a batch is read and decided again when another replica wrote first (or
/// held the tool's turn).
const MAX_ATTEMPTS: usize = 64;
/// How long a worker waits before reading again while another replica holds the tool's turn
/// (it gives the turn back with its write, one round trip later).
const TURN_WAIT: Duration = Duration::from_millis(1);

/// Work for a tool's worker (a group's: the tools of a group share one).
pub(super) enum Job {
    /// Decide a call (and commit it if admitted): one part per tool it is charged to, all
    /// admitted or none.
    Decide {
        parts: Vec<QueuedPart>,
        reply: oneshot::Sender<Result<Decision, StoreError>>,
    },
    /// Add `factor` × an admitted call's charge at every level it charged.
    Adjust {
        admission: Arc<Admission>,
        factor: f64,
        now: Timestamp,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    /// Read the tool's state from Redis (nothing decided): a health check found its epoch
    /// marker changed, and the worker heals what the loss took (see `Worker::read_from_redis`).
    /// Answered once that is done.
    Heal { reply: oneshot::Sender<()> },
}

/// One tool's part of a call: its plan, its keys and the store's name for it (what its
/// permits are held under).
pub(super) struct QueuedPart {
    pub(super) plan: OwnedPlan,
    pub(super) keys: CallKeys,
    pub(super) call: u128,
}

impl Job {
    fn now(&self) -> Timestamp {
        match self {
            Job::Decide { parts, .. } => parts[0].plan.now,
            Job::Adjust { now, .. } => *now,
            Job::Heal { .. } => Timestamp(0),
        }
    }

    fn gone(&self) -> bool {
        matches!(self, Job::Decide { reply, .. } if reply.is_closed())
    }

    /// Answers the job with `e`.
    fn fail(self, e: &StoreError) {
        match self {
            Job::Decide { reply, .. } => {
                let _ = reply.send(Err(e.clone()));
            }
            Job::Adjust { reply, .. } => {
                let _ = reply.send(Err(e.clone()));
            }
            Job::Heal { .. } => {}
        }
    }
}

/// Sends `job` to the worker of `tool`, starting it if it has none.
pub(super) fn submit(shared: &Arc<Shared>, tool: &str, job: Job) {
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
    let tool: Arc<str> = Arc::from(tool);
    queues.insert(tool.clone(), tx);
    rt.spawn(work(Arc::downgrade(shared), rx, tool));
}

/// Adds `factor` × an admitted call's charge at every level it charged, through its tool's
/// queue: answered once written.
pub(super) fn adjust(
    sh: &Arc<Shared>,
    admission: Arc<Admission>,
    factor: f64,
    now: Timestamp,
) -> oneshot::Receiver<Result<(), StoreError>> {
    let (reply, answer) = oneshot::channel();
    let slot = admission.keys.slot().clone();
    let job = Job::Adjust {
        admission,
        factor,
        now,
        reply,
    };
    submit(sh, &slot, job);
    answer
}

fn drop_job(job: Job, why: &str) {
    job.fail(&StoreError::Unavailable(why.to_owned()));
}

/// A tool's worker, until the store is gone: one round trip per batch when nothing else
/// writes the tool's records — the script that writes a batch also reads for the next, or the
/// next is decided on the records remembered.
async fn work(shared: Weak<Shared>, rx: mpsc::UnboundedReceiver<Job>, tool: Arc<str>) {
    let Some(mut worker) = Worker::new(shared, &tool) else {
        return;
    };
    let mut queue = Queue {
        rx,
        backlog: std::collections::VecDeque::new(),
        namespace: worker.namespace.clone(),
    };
    // A batch whose read came back with the last write (or comes from the cache).
    let mut carried: Option<(Batch, Read)> = None;
    let mut cache = Cache::default();
    loop {
        let (mut batch, read) = match carried.take() {
            Some(c) => c,
            None => match worker.next_read(&mut queue, &mut cache).await {
                Some(Some(c)) => c,
                Some(None) => continue,
                None => return,
            },
        };
        let Some(sh) = worker.shared.upgrade() else {
            return;
        };
        // Callers that left while their batch was read: not decided.
        batch.retain_waited_for();
        let decided = decide(&sh, &batch, &read);
        if decided.nothing_to_write() {
            batch.answer(&sh, decided.outcomes);
            continue;
        }
        // The next batch rides on this write: its read comes back with it, unless the cache
        // will hold every record it needs once this batch is written.
        let injected = sh.config.time == TimeSource::Injected;
        let next = queue.next_batch(injected, false).await;
        // When the next batch can be decided on the cache once this write is in it (neither
        // counts permits), the writes go one behind the other (see `pipeline`).
        // (Over a pool, a write behind may reach Redis first and fail its check: not worth it.)
        let behind = batch.attempts == 0
            && sh.backend().is_ok_and(|b| b.keeps_order())
            && batch.keys.zsets.is_empty()
            && cache.cool == 0
            && next.as_ref().is_none_or(|n| cache.covers(n, &batch));
        if behind {
            let first = send_write(&sh, (&batch, &decided), &worker).await;
            cache.remember(&batch, &decided);
            let ahead = Ahead {
                batch,
                decided,
                reply: first,
                then: Vec::new(),
            };
            worker
                .pipeline(&sh, &mut queue, &mut cache, injected, ahead, next)
                .await;
            continue;
        }
        carried = worker
            .write(&sh, &mut queue, &mut cache, (batch, decided), next)
            .await;
    }
}

/// A tool's worker: its keys, its turn and what it knows of the tool's epoch.
struct Worker {
    shared: Weak<Shared>,
    tool: Arc<str>,
    namespace: String,
    /// The tool's turn key and epoch marker key, and this replica's name.
    turn_key: String,
    marker_key: String,
    me: String,
    /// Whether this worker's next read claims the tool's turn: after its write lost a race.
    claim: bool,
    /// The tool's epoch marker as this worker last read it (`None` before its first read).
    epoch: Option<Vec<u8>>,
    /// The latest time a batch was decided at (µs), for a restore to count open windows at.
    last_now: u64,
}

impl Worker {
    fn new(shared: Weak<Shared>, tool: &Arc<str>) -> Option<Worker> {
        let (namespace, me) = shared
            .upgrade()
            .map(|s| (s.config.namespace.clone(), format!("{:016x}", s.ids.prefix)))?;
        let tool_key = format!("{namespace}{}", crate::key::tool_key(tool));
        Some(Worker {
            shared,
            tool: tool.clone(),
            namespace,
            turn_key: super::wire::turn_key(&tool_key),
            marker_key: super::wire::epoch_key(&tool_key),
            me,
            claim: false,
            epoch: None,
            last_now: 0,
        })
    }

    /// The next batch and its read, from the cache or from Redis; `Some(None)` when it is to
    /// be tried again (another replica's turn, a failed read, a loss healed), `None` when the
    /// store is gone.
    async fn next_read(
        &mut self,
        queue: &mut Queue,
        cache: &mut Cache,
    ) -> Option<Option<(Batch, Read)>> {
        let time = self.shared.upgrade().map(|s| s.config.time)?;
        let mut batch = queue.next_batch(time == TimeSource::Injected, true).await?;
        if let Some(read) = cache.read(&batch, time) {
            return Some(Some((batch, read)));
        }
        let sh = self.shared.upgrade()?;
        match cycle(&sh, None, Some(&batch), self, self.claim).await {
            Ok(c) if c.others_turn && batch.attempts + 1 < MAX_ATTEMPTS => {
                // Another replica's turn: read again once it has written.
                batch.attempts += 1;
                queue.put_front(batch);
                tokio::time::sleep(TURN_WAIT).await;
                Some(None)
            }
            Ok(c) => {
                self.claim = false;
                cache.clock(c.now);
                let read = c.read.expect("a read was asked for");
                Some(self.read_from_redis(&sh, queue, cache, batch, read).await)
            }
            Err(e) => {
                cache.conflict();
                // A read wrote nothing: after a dropped connection, once more.
                if let Some(again) = batch.again_after(e, true) {
                    queue.put_front(again);
                }
                Some(None)
            }
        }
    }

    /// Writes a decided batch, with the read of `next` when the cache cannot decide it: the
    /// batch to decide next with its read, if there is one. When the batch is to be decided
    /// again (see [`settle`](Self::settle)), it goes back to the queue with `next`.
    async fn write(
        &mut self,
        sh: &Arc<Shared>,
        queue: &mut Queue,
        cache: &mut Cache,
        (batch, decided): (Batch, BatchWrite),
        next: Option<Batch>,
    ) -> Option<(Batch, Read)> {
        let read_next = next.as_ref().filter(|n| !cache.covers(n, &batch));
        let reply = cycle(sh, Some((&batch, &decided)), read_next, self, false).await;
        cache.remember(&batch, &decided);
        let alone = (true, &[][..]);
        let read = match self.settle(sh, cache, batch, decided, reply, alone).await {
            Ok(read) => read,
            Err(again) => {
                queue.again(again.into_iter().chain(next));
                return None;
            }
        };
        match (next?, read) {
            (next, Some(read)) => self.read_from_redis(sh, queue, cache, next, read).await,
            // Taken before the write only to see whether it needed a read: it takes the calls
            // that came in during the round trip too (they would otherwise wait for the next
            // one), and is decided next, on the cache if it can be.
            (next, None) => {
                let next = queue.grow(next, sh.config.time == TimeSource::Injected);
                queue.put_front(next);
                None
            }
        }
    }

    /// What became of `batch`'s write, its answer (`reply`) in. When it landed, the batch is
    /// answered and counted in the ledger, and the read that came with the write returned.
    /// Otherwise the cache is forgotten, and the batch is failed or returned to be decided
    /// again on a fresh read:
    /// - after another replica wrote first, as another attempt whose read claims the tool's
    ///   turn, so the other replica waits for this write (when the conflict is `counted`: a
    ///   write behind one of this worker's that did not land fails its check, and is not);
    /// - after a dropped connection, once more, on the connection made again, unseen by its
    ///   callers; after its answer was not waited for past the worker's bound (a stalled
    ///   Redis), failed — unless, either way, a read of its records finds that it landed (see
    ///   [`landed_unanswered`](Self::landed_unanswered); `writes_behind`: what the writes sent
    ///   behind it on the same connection write): then it is answered as it decided.
    ///   When the read cannot tell, the permits it would have taken are given back first (a
    ///   permit given back twice, or never taken, removes nothing), and if it did land, its
    ///   units are counted twice: under-use, never over-admission.
    async fn settle(
        &mut self,
        sh: &Arc<Shared>,
        cache: &mut Cache,
        mut batch: Batch,
        decided: BatchWrite,
        reply: Result<Cycle, StoreError>,
        (counted, writes_behind): (bool, &[WriteBehind<'_>]),
    ) -> Result<Option<Read>, Option<Batch>> {
        let landed = match &reply {
            Ok(c) => c.written,
            // Its answer lost with the connection, or not waited for past the bound: the
            // write may have run, or may still run before anything sent after it.
            Err(StoreError::Unavailable(_) | StoreError::Timeout(_)) => {
                self.landed_unanswered(sh, &batch, &decided, writes_behind)
                    .await
            }
            Err(_) => false,
        };
        match &reply {
            Ok(c) if landed => cache.clock(c.now),
            _ => cache.conflict(),
        }
        if landed {
            cache.landed(&batch, &decided.outcomes);
            batch.answer(sh, decided.outcomes);
            return Ok(reply.ok().and_then(|c| c.read));
        }
        match reply.err() {
            None if batch.attempts + 1 >= MAX_ATTEMPTS => batch.fail(&conflicted()),
            None => {
                if counted {
                    self.claim = true;
                    batch.attempts += 1;
                }
                return Err(Some(batch));
            }
            Some(e) => {
                let released = release_decided(sh, &decided).await;
                return Err(batch.again_after(e, released));
            }
        }
        Err(None)
    }

    /// Whether the write of `batch` (`decided`) landed although its answer was lost: a read
    /// of its records finds one holding the version the write gave it, or the version a write
    /// sent behind it (`writes_behind`) gave a record after expecting this one's there (that
    /// write could land only on this one). Versions are never the same twice, and a write
    /// lands whole or not at all, so that proves it; records written over since by another
    /// replica, or a read that fails, prove nothing (false).
    async fn landed_unanswered(
        &self,
        sh: &Shared,
        batch: &Batch,
        decided: &BatchWrite,
        writes_behind: &[WriteBehind<'_>],
    ) -> bool {
        let mut proofs: Vec<(&str, u64)> =
            written(batch, decided).map(|(_, k, v)| (k, v)).collect();
        if proofs.is_empty() {
            return false;
        }
        for b in writes_behind {
            if b.expected.is_some_and(|v| proofs.contains(&(b.key, v))) {
                proofs.push((b.key, b.version));
            }
        }
        let Ok(Cycle {
            read: Some(read), ..
        }) = cycle(sh, None, Some(batch), self, false).await
        else {
            return false;
        };
        let held = batch.keys.records.iter().zip(&read.records);
        held.filter_map(|(k, r)| Some((k.as_str(), r.as_ref()?.version)))
            .any(|h| proofs.contains(&h))
    }

    /// `batch` with its `read` from Redis, to decide (and remembered); `None` when the read
    /// found the tool's state lost since this worker's last read (its epoch marker changed).
    /// Then, before anything is decided on it, what the loss took is healed: the refusals
    /// remembered on it forgotten, the permits of this replica's calls still running put back,
    /// and what this replica counted in the windows still open restored (see `Ledger`); the
    /// batch goes back to the queue, to be read again.
    async fn read_from_redis(
        &mut self,
        sh: &Arc<Shared>,
        queue: &mut Queue,
        cache: &mut Cache,
        batch: Batch,
        read: Read,
    ) -> Option<(Batch, Read)> {
        self.last_now = self.last_now.max(read.now).max(batch.now().as_micros());
        let before = self.epoch.replace(read.epoch.clone());
        sh.health.saw_epoch(&self.tool, &read.epoch);
        if before.is_none_or(|b| b == read.epoch) {
            cache.remember(&batch, &BatchWrite::on(&read));
            return Some((batch, read));
        }
        queue.put_front(batch);
        cache.conflict();
        if let Some(refusals) = &sh.cache {
            refusals.forget_slot(&self.tool);
        }
        if let Err(e) = sh.renew(Timestamp(0), Some(&self.tool)).await {
            tracing::warn!(store = "redis", tool = %self.tool, error = %e, "could not put back the permits of calls still running after Redis lost the tool's state");
        }
        let now = Timestamp(self.last_now);
        cache.ledger.forget_closed(now);
        match restore(sh, &cache.ledger, self, now, &read.epoch).await {
            Ok(levels) => {
                tracing::info!(store = "redis", tool = %self.tool, levels, "restored what this replica admitted in the windows still open")
            }
            Err(e) => {
                tracing::warn!(store = "redis", tool = %self.tool, error = %e, "could not restore what this replica admitted after Redis lost the tool's state")
            }
        }
        None
    }
}

/// Gives back the permits of the calls `d` admitted, whose write may or may not have landed;
/// whether every one was (those not are tried again in the background).
async fn release_decided(sh: &Arc<Shared>, d: &BatchWrite) -> bool {
    let mut all = true;
    for o in &d.outcomes {
        if let JobDone::Decided(Decision::Admitted(a)) = o {
            for a in a.iter().filter(|a| a.charge.holds_permits()) {
                all &= sh.release_call(a).await.is_ok();
            }
        }
    }
    all
}

/// After Redis lost a tool's state: adds what this replica counted in the windows open at
/// `now` (its `ledger`) to the records as Redis holds them now, written like any batch (only
/// if no record changed since it was read; read and added again if one did). Returns how many
/// levels it restored.
async fn restore(
    sh: &Arc<Shared>,
    ledger: &Ledger,
    worker: &Worker,
    now: Timestamp,
    epoch: &[u8],
) -> Result<usize, StoreError> {
    let keys = ledger.keys(now);
    for chunk in keys.chunks(MAX_BATCH) {
        let batch = Batch::of_records(chunk);
        let mut attempts = 0;
        loop {
            let c = cycle(sh, None, Some(&batch), worker, false).await?;
            let read = c.read.expect("a read was asked for");
            if read.epoch != epoch {
                return Err(StoreError::Unavailable(
                    "Redis lost the tool's state again while it was being restored".into(),
                ));
            }
            let d = restored(sh, ledger, &batch, &read, now);
            if cycle(sh, Some((&batch, &d)), None, worker, false)
                .await?
                .written
            {
                break;
            }
            attempts += 1;
            if attempts >= MAX_ATTEMPTS {
                return Err(conflicted());
            }
            tokio::time::sleep(TURN_WAIT).await;
        }
    }
    Ok(keys.len())
}

/// The records of `batch` (read as `read`) with what `ledger` counted at them added.
fn restored(
    sh: &Shared,
    ledger: &Ledger,
    batch: &Batch,
    read: &Read,
    now: Timestamp,
) -> BatchWrite {
    let mut d = BatchWrite::on(read);
    for (i, key) in batch.keys.records.iter().enumerate() {
        let held = d.records[i].as_ref().map(|r| (r.state, r.expires, r.plans));
        let Some((state, until)) = ledger.restored(key, held.map(|h| h.0), now) else {
            continue;
        };
        d.records[i] = Some(Record {
            version: sh.ids.version(),
            expires: held.map_or(until, |h| h.1.max(until)),
            state,
            plans: held.map(|h| h.2).unwrap_or_default(),
        });
        d.written[i] = true;
        d.decided[i] = true;
    }
    d
}

/// The records `d` writes for `batch`: each one's place in the batch, its key and the version
/// it gives it.
fn written<'b>(batch: &'b Batch, d: &'b BatchWrite) -> impl Iterator<Item = (usize, &'b str, u64)> {
    let records = batch.keys.records.iter().zip(&d.records).zip(&d.written);
    records
        .enumerate()
        .filter_map(|(i, ((k, r), w))| Some((i, k.as_str(), r.as_ref().filter(|_| *w)?.version)))
}

/// A record a write behind another on the same connection writes: its key, the version it
/// expects there (`None`: none, or absent), the version it gives it.
struct WriteBehind<'a> {
    key: &'a str,
    expected: Option<u64>,
    version: u64,
}

impl<'a> WriteBehind<'a> {
    /// The records the writes in `flight` write, when `reply` (the answer of the write ahead
    /// of them) was lost with its connection; none otherwise (nothing to look for).
    fn of(reply: &Result<Cycle, StoreError>, flight: &'a VecDeque<Ahead>) -> Vec<WriteBehind<'a>> {
        if !matches!(reply, Err(StoreError::Unavailable(_))) {
            return Vec::new();
        }
        let records = flight.iter().flat_map(|a| {
            written(&a.batch, &a.decided).map(|(i, key, version)| {
                let read = a.decided.versions[i]
                    .get(..8)
                    .and_then(|v| v.try_into().ok());
                let expected = read.map(u64::from_le_bytes);
                WriteBehind {
                    key,
                    expected,
                    version,
                }
            })
        });
        records.collect()
    }
}

/// A batch whose write is on its way.
struct Ahead {
    batch: Batch,
    decided: BatchWrite,
    reply: InFlight,
    /// Batches decided on this write (and those ahead of it) with nothing to write: answered
    /// once it landed.
    then: Vec<(Batch, BatchWrite)>,
}

/// How many writes of one worker may be on their way at once.
const IN_FLIGHT: usize = 4;

impl Worker {
    /// Writes batches one behind the other (`docs/redis.md`, *Performance*) while each can be
    /// decided on the cache as the writes ahead of it will leave it: the worker decides the
    /// calls that come in while up to [`IN_FLIGHT`] writes are on their way and sends their
    /// write at once, queued on the connection behind them. A batch with nothing to write
    /// (refusals) is answered once the writes ahead of it landed. Returns when a batch cannot
    /// be decided that way (it goes back to the queue), when nothing is on its way any more,
    /// or when a write did not land (see [`land`](Self::land)).
    async fn pipeline(
        &mut self,
        sh: &Arc<Shared>,
        queue: &mut Queue,
        cache: &mut Cache,
        injected: bool,
        first: Ahead,
        mut behind: Option<Batch>,
    ) {
        let mut flight = VecDeque::from([first]);
        loop {
            // Decide and send what has come in, while there is room.
            while flight.len() < IN_FLIGHT {
                let b = match behind.take() {
                    Some(b) => Some(queue.grow(b, injected)),
                    None => queue.next_batch(injected, false).await,
                };
                let Some(mut b) = b else { break };
                let Some(read) = cache.read(&b, sh.config.time) else {
                    queue.put_front(b);
                    return self.land(sh, queue, cache, flight, None, None).await;
                };
                b.retain_waited_for();
                let d = decide(sh, &b, &read);
                if d.nothing_to_write() {
                    match flight.back_mut() {
                        Some(a) => a.then.push((b, d)),
                        None => b.answer(sh, d.outcomes),
                    }
                    continue;
                }
                let reply = send_write(sh, (&b, &d), self).await;
                cache.remember(&b, &d);
                flight.push_back(Ahead {
                    batch: b,
                    decided: d,
                    reply,
                    then: Vec::new(),
                });
            }
            // The oldest write's answer; or, while there is room, the first call to come in.
            let room = flight.len() < IN_FLIGHT;
            let Some(front) = flight.front_mut() else {
                return;
            };
            let reply = if room {
                tokio::select! {
                    biased;
                    reply = &mut front.reply => reply,
                    job = queue.rx.recv() => match job {
                        Some(j) => {
                            behind = Some(Batch::new(&queue.namespace, vec![j], 0));
                            continue;
                        }
                        None => (&mut front.reply).await,
                    },
                }
            } else {
                (&mut front.reply).await
            };
            let a = flight.pop_front().expect("the front");
            let writes_behind = WriteBehind::of(&reply, &flight);
            let settled = self.settle_ahead(sh, cache, a, reply, (true, &writes_behind));
            if let Err(again) = settled.await {
                return self
                    .land(sh, queue, cache, flight, Some(again), behind)
                    .await;
            }
        }
    }

    /// Waits for every write on its way and settles it. Once one did not land (`again`: the
    /// batches it left to decide again), every write behind it was decided on it and fails its
    /// check too, which is not counted as a conflict (one that lands anyway touched none of the
    /// same records, and is answered). The batches to decide again, then `behind`, go back to
    /// the queue first, as one batch.
    async fn land(
        &mut self,
        sh: &Arc<Shared>,
        queue: &mut Queue,
        cache: &mut Cache,
        mut flight: VecDeque<Ahead>,
        mut again: Option<Vec<Batch>>,
        behind: Option<Batch>,
    ) {
        while let Some(mut a) = flight.pop_front() {
            let reply = (&mut a.reply).await;
            let (counted, writes_behind) = (again.is_none(), WriteBehind::of(&reply, &flight));
            let settled = self.settle_ahead(sh, cache, a, reply, (counted, &writes_behind));
            if let Err(more) = settled.await {
                again.get_or_insert_with(Vec::new).extend(more);
            }
        }
        queue.again(again.into_iter().flatten().chain(behind));
    }

    /// [`Settles`](Self::settle) the write of `a` with the batches waiting on it: they are
    /// answered when it landed; otherwise they are to be decided again, after its own batch
    /// if that is too.
    async fn settle_ahead(
        &mut self,
        sh: &Arc<Shared>,
        cache: &mut Cache,
        a: Ahead,
        reply: Result<Cycle, StoreError>,
        counted_behind: (bool, &[WriteBehind<'_>]),
    ) -> Result<(), Vec<Batch>> {
        match self
            .settle(sh, cache, a.batch, a.decided, reply, counted_behind)
            .await
        {
            Ok(_) => {
                for (b, d) in a.then {
                    b.answer(sh, d.outcomes);
                }
                Ok(())
            }
            Err(again) => Err(again
                .into_iter()
                .chain(a.then.into_iter().map(|(b, _)| b))
                .collect()),
        }
    }
}

/// The records this worker last read or wrote, as Redis holds them unless another replica
/// wrote since. A batch whose records are all here (and that counts no permits: permit counts
/// change without a version) is decided without a read, at Redis's clock as of the last round
/// trip plus the time since its answer came back (never ahead of Redis's clock). Its write
/// checks the versions like any other, so a stale entry costs a retry, never a wrong decision.
#[derive(Default)]
struct Cache {
    /// Record key → the record (`None`: absent) and its version as the write checks it.
    records: HashMap<String, (Option<Record>, Vec<u8>)>,
    /// Redis's clock at the last round trip (µs), and when its answer came back.
    clock: Option<(u64, std::time::Instant)>,
    /// Batches still to read from Redis after a conflict (another replica writes this tool).
    cool: u32,
    /// What this replica's landed writes counted in the windows still open: what it restores
    /// if Redis loses the tool's state (kept through conflicts, which forget the records).
    ledger: Ledger,
}

/// The most records a worker remembers (it forgets them all past this).
const CACHE_MAX: usize = 16 * MAX_BATCH;
/// How many batches read from Redis after a write found a record changed.
const CACHE_COOL: u32 = 16;

impl Cache {
    fn clock(&mut self, now: u64) {
        let at = std::time::Instant::now();
        // Never behind the estimate it replaces (neither is ahead of Redis's clock): an answer
        // read a while after it came in (the worker was deciding the calls behind it) would
        // move the time back, and a batch decided behind one from the next window would see
        // that window's counts as from the last one.
        if let Some((clock, since)) = self.clock {
            if clock + at.duration_since(since).as_micros() as u64 > now {
                return;
            }
        }
        self.clock = Some((now, at));
    }

    /// Forgets every record, and reads the next batches from Redis.
    fn conflict(&mut self) {
        self.records.clear();
        self.cool = CACHE_COOL;
    }

    /// Whether `b` can be decided on the cache once `wrote` (a batch about to be written)
    /// is in it.
    fn covers(&self, b: &Batch, wrote: &Batch) -> bool {
        self.cool == 0
            && b.keys.zsets.is_empty()
            && b.keys
                .records
                .iter()
                .all(|k| wrote.keys.index.contains_key(k) || self.records.contains_key(k))
    }

    /// The read of `b` from the cache, if it holds every record `b` needs.
    fn read(&mut self, b: &Batch, time: TimeSource) -> Option<Read> {
        if self.cool > 0 {
            self.cool -= 1;
            return None;
        }
        if !b.keys.zsets.is_empty() || b.heals {
            return None;
        }
        let now = match time {
            TimeSource::Redis => {
                let (clock, at) = self.clock?;
                clock + at.elapsed().as_micros() as u64
            }
            TimeSource::Injected => b.now().as_micros(),
        };
        let mut records = Vec::with_capacity(b.keys.records.len());
        let mut versions = Vec::with_capacity(b.keys.records.len());
        for k in &b.keys.records {
            let (r, v) = self.records.get(k)?;
            let mut v = v.clone();
            // A record past its expiry is the same as a fresh one, and Redis may have dropped
            // it: the write accepts it there or gone (a correction of a record that is gone
            // writes nothing). (`now` is never ahead of Redis's clock.)
            if r.as_ref().is_some_and(|r| r.expires <= now as f64) && v.len() == 8 {
                v.push(b'*');
            }
            records.push(r.clone());
            versions.push(v);
        }
        Some(Read {
            now,
            records,
            versions,
            counts: Vec::new(),
            epoch: Vec::new(),
        })
    }

    /// Remembers the records of `b` as `d` leaves them: what it writes, and what it read and
    /// left as it was (nothing decided yet: as Redis held them).
    fn remember(&mut self, b: &Batch, d: &BatchWrite) {
        self.make_room(b.keys.records.len());
        for (i, k) in b.keys.records.iter().enumerate() {
            let version = match (&d.records[i], d.written[i]) {
                (Some(r), true) => r.version.to_le_bytes().to_vec(),
                // Unwritten: as read (without a "there or gone" mark: it is set per read).
                _ => d.versions[i][..d.versions[i].len().min(8)].to_vec(),
            };
            self.records
                .insert(k.clone(), (d.records[i].clone(), version));
        }
    }

    /// Counts in the ledger what the landed write of `b` admitted and corrected.
    fn landed(&mut self, b: &Batch, outcomes: &[JobDone]) {
        let mut now = Timestamp(0);
        for ((job, jks), outcome) in b.jobs.iter().zip(&b.job_keys).zip(outcomes) {
            now = now.max(job.now());
            let levels = |jk: &JobKeys| {
                let records = jk.records;
                (0..3).filter_map(move |l| Some((l, records[l]?)))
            };
            match (job, outcome) {
                (Job::Decide { parts, .. }, JobDone::Decided(Decision::Admitted(a))) => {
                    for ((part, jk), a) in parts.iter().zip(jks).zip(a.iter()) {
                        let period = part.plan.tool.period().as_micros() as f64;
                        for (l, i) in levels(jk) {
                            self.ledger
                                .admitted(&b.keys.records[i], &a.charge, l, period);
                        }
                    }
                }
                (
                    Job::Adjust {
                        admission, factor, ..
                    },
                    _,
                ) => {
                    for (l, i) in levels(&jks[0]) {
                        self.ledger
                            .corrected(&b.keys.records[i], &admission.charge, l, *factor);
                    }
                }
                _ => {}
            }
        }
        self.ledger.forget_closed(now);
    }

    fn make_room(&mut self, more: usize) {
        if self.records.len() + more > CACHE_MAX {
            self.records.clear();
        }
    }
}

/// A tool's queue, with what was taken from it and not yet decided.
struct Queue {
    rx: mpsc::UnboundedReceiver<Job>,
    backlog: std::collections::VecDeque<Batch>,
    /// The store's key prefix.
    namespace: String,
}

impl Queue {
    /// The next batch: waits for a job when `wait`, otherwise takes only what is there. With
    /// an injected clock a batch shares one `now` (the counts it reads are at that time).
    async fn next_batch(&mut self, injected: bool, wait: bool) -> Option<Batch> {
        loop {
            if let Some(b) = self.backlog.pop_front() {
                return Some(b);
            }
            let first = if wait {
                self.rx.recv().await?
            } else {
                self.rx.try_recv().ok()?
            };
            let mut jobs = vec![first];
            self.take_queued(&mut jobs, injected);
            jobs.retain(|j| !j.gone());
            if !jobs.is_empty() {
                return Some(Batch::new(&self.namespace, jobs, 0));
            }
            if !wait {
                return None;
            }
        }
    }

    /// `b` with the jobs queued since it was taken, up to [`MAX_BATCH`] (none while older
    /// batches wait; with an injected clock, only jobs of the same `now`).
    fn grow(&mut self, mut b: Batch, injected: bool) -> Batch {
        if !self.backlog.is_empty() {
            return b;
        }
        let had = b.jobs.len();
        self.take_queued(&mut b.jobs, injected);
        if b.jobs.len() == had {
            return b;
        }
        Batch::new(&self.namespace, b.jobs, b.attempts)
    }

    /// Moves the jobs queued now into `jobs`, up to [`MAX_BATCH`], leaving out those whose
    /// caller went away; with an injected clock, only jobs of the first one's `now` (the first
    /// of another waits in the backlog, a batch of its own).
    fn take_queued(&mut self, jobs: &mut Vec<Job>, injected: bool) {
        while jobs.len() < MAX_BATCH {
            let Ok(j) = self.rx.try_recv() else {
                return;
            };
            if injected && jobs.first().is_some_and(|f| j.now() != f.now()) {
                self.backlog
                    .push_back(Batch::new(&self.namespace, vec![j], 0));
                return;
            }
            if !j.gone() {
                jobs.push(j);
            }
        }
    }

    fn put_front(&mut self, b: Batch) {
        self.backlog.push_front(b);
    }

    /// Puts `batches` back first, as one batch to decide again: counted as many attempts as
    /// the most of them made, and not tried once more after a dropped connection if one of
    /// them already was.
    fn again(&mut self, batches: impl IntoIterator<Item = Batch>) {
        let (mut jobs, mut attempts, mut reconnected) = (Vec::new(), 0, false);
        for b in batches {
            jobs.extend(b.jobs);
            attempts = attempts.max(b.attempts);
            reconnected |= b.reconnected;
        }
        if !jobs.is_empty() {
            let mut b = Batch::new(&self.namespace, jobs, attempts);
            b.reconnected = reconnected;
            self.put_front(b);
        }
    }
}

/// The keys one job touches (a part of a call, a correction): its records, and the permits
/// it counts.
struct JobKeys {
    /// Tool, tenant, instance record keys (index into the batch's record list).
    records: [Option<usize>; 3],
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
        place(&mut self.records, &mut self.index, k)
    }

    fn zset(&mut self, k: &str) -> usize {
        place(&mut self.zsets, &mut self.zindex, k)
    }
}

/// The place of key `k` in `list` (added at the end if new), found by `index`.
fn place(list: &mut Vec<String>, index: &mut HashMap<String, usize>, k: &str) -> usize {
    if let Some(&i) = index.get(k) {
        return i;
    }
    list.push(k.to_owned());
    index.insert(k.to_owned(), list.len() - 1);
    list.len() - 1
}

/// Jobs decided together, with the keys they touch.
struct Batch {
    jobs: Vec<Job>,
    keys: Keys,
    /// Each job's keys: one per part of a call, one for a correction, none for a heal.
    job_keys: Vec<Vec<JobKeys>>,
    /// How many times the batch's write found a record changed.
    attempts: usize,
    /// Whether it is to be read from Redis whatever the cache holds (a `Job::Heal`).
    heals: bool,
    /// Whether a round trip of it already failed on a dropped connection (it is tried once
    /// more, on the connection made again, so that callers do not see a reconnect).
    reconnected: bool,
}

impl Batch {
    fn new(namespace: &str, jobs: Vec<Job>, attempts: usize) -> Batch {
        let (keys, job_keys) = Batch::keys_of(namespace, &jobs);
        Batch {
            heals: jobs.iter().any(|j| matches!(j, Job::Heal { .. })),
            jobs,
            keys,
            job_keys,
            attempts,
            reconnected: false,
        }
    }

    /// A batch of no jobs that reads and writes these records (a restore).
    fn of_records(records: &[String]) -> Batch {
        let mut b = Batch::new("", Vec::new(), 0);
        for k in records {
            b.keys.record(k);
        }
        b.heals = true;
        b
    }

    /// Drops the jobs whose callers left (their keys stay: reading them costs nothing).
    fn retain_waited_for(&mut self) {
        let jobs = std::mem::take(&mut self.jobs).into_iter();
        let job_keys = std::mem::take(&mut self.job_keys);
        (self.jobs, self.job_keys) = jobs.zip(job_keys).filter(|(j, _)| !j.gone()).unzip();
    }

    fn now(&self) -> Timestamp {
        self.jobs.first().map_or(Timestamp(0), Job::now)
    }

    /// The keys of `jobs`: each job's records and permits.
    fn keys_of(namespace: &str, jobs: &[Job]) -> (Keys, Vec<Vec<JobKeys>>) {
        let mut keys = Keys::default();
        let job_keys = jobs
            .iter()
            .map(|job| match job {
                Job::Decide { parts, .. } => parts
                    .iter()
                    .map(|p| Batch::part_keys(&mut keys, namespace, &p.keys, Some(&p.plan)))
                    .collect(),
                Job::Adjust { admission, .. } => {
                    vec![Batch::part_keys(
                        &mut keys,
                        namespace,
                        &admission.keys,
                        None,
                    )]
                }
                Job::Heal { .. } => Vec::new(),
            })
            .collect();
        (keys, job_keys)
    }

    /// The records and permits of one call's `call_keys` (of a decision's `plan`, or of a
    /// correction), added to `keys`.
    fn part_keys(
        keys: &mut Keys,
        namespace: &str,
        call_keys: &CallKeys,
        plan: Option<&OwnedPlan>,
    ) -> JobKeys {
        let [tool, tenant, instance] = wire::state_keys(namespace, call_keys);
        let (tool, tenant) = (tool.expect("a tool key"), tenant.expect("a tenant key"));
        let instance = instance.filter(|_| plan.is_none_or(|p| p.plan().instance.is_some()));
        let mut jk = JobKeys {
            records: [Some(keys.record(&tool)), Some(keys.record(&tenant)), None],
            permits: [None, None, None],
        };
        if let Some(i) = &instance {
            jk.records[2] = Some(keys.record(i));
        }
        if let Some(plan) = plan {
            let p = plan.plan();
            let level_keys = [Some(&tool), Some(&tenant), instance.as_ref()];
            for (l, k) in level_keys.into_iter().enumerate() {
                if let (true, Some(k)) = (p.takes_permit(l), k) {
                    jk.permits[l] = Some(keys.zset(&permits_key(k)));
                }
            }
        }
        jk
    }

    /// Every job fails with `e`.
    fn fail(self, e: &StoreError) {
        for job in self.jobs {
            job.fail(e);
        }
    }

    /// After a round trip of it failed with `e`: the batch to try once more when the
    /// connection dropped and it `may` be (on the connection made again, unseen by its
    /// callers), if it was not yet; otherwise none, and every job fails.
    fn again_after(mut self, e: StoreError, may: bool) -> Option<Batch> {
        if may && !self.reconnected && matches!(e, StoreError::Unavailable(_)) {
            self.reconnected = true;
            return Some(self);
        }
        self.fail(&e);
        None
    }

    /// Answers every job; an admission whose caller left is given back.
    fn answer(self, sh: &Arc<Shared>, outcomes: Vec<JobDone>) {
        for (job, outcome) in self.jobs.into_iter().zip(outcomes) {
            match (job, outcome) {
                (Job::Decide { reply, .. }, JobDone::Decided(d)) => {
                    if let Err(Ok(Decision::Admitted(a))) = reply.send(Ok(d)) {
                        a.into_iter().for_each(|a| give_back(sh, a));
                    }
                }
                (Job::Adjust { reply, .. }, JobDone::Adjusted) => {
                    let _ = reply.send(Ok(()));
                }
                (Job::Heal { reply }, JobDone::Read) => {
                    let _ = reply.send(());
                }
                _ => unreachable!("an outcome per job, of its kind"),
            }
        }
    }
}

/// What a job came to.
enum JobDone {
    Decided(Decision),
    Adjusted,
    /// A `Job::Heal`'s read is done.
    Read,
}

fn ttl_ms(until: f64, now: f64) -> u64 {
    (((until - now) / 1000.0).ceil() as i64).max(1) as u64
}

/// A batch that other replicas' writes kept getting in ahead of, [`MAX_ATTEMPTS`] times.
fn conflicted() -> StoreError {
    StoreError::Unavailable(format!(
        "other replicas kept writing this tool's state: {MAX_ATTEMPTS} attempts conflicted"
    ))
}

/// The answer to a decision, as its caller waits for it. Dropped before it was taken (the
/// caller went away, or its timeout fired as the answer came in), an admission in it is given
/// back: whichever way the caller leaves, an admitted call is either handed over or undone.
pub(super) struct Answer {
    shared: Arc<Shared>,
    rx: oneshot::Receiver<Result<Decision, StoreError>>,
}

impl Answer {
    /// A job's reply channel and the answer its caller waits on.
    pub(super) fn channel(
        shared: &Arc<Shared>,
    ) -> (oneshot::Sender<Result<Decision, StoreError>>, Answer) {
        let (tx, rx) = oneshot::channel();
        let shared = shared.clone();
        (tx, Answer { shared, rx })
    }
}

impl std::future::Future for Answer {
    type Output = Result<Result<Decision, StoreError>, oneshot::error::RecvError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.rx).poll(cx)
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        // Closed first, so the worker either fails to send (and gives the admission back
        // itself) or has sent it, and it is here.
        self.rx.close();
        if let Ok(Ok(Decision::Admitted(a))) = self.rx.try_recv() {
            a.into_iter().for_each(|a| give_back(&self.shared, a));
        }
    }
}

/// An admission whose caller went away: its units refunded at every level (through the
/// queue, like any write) and its permits released.
fn give_back(sh: &Arc<Shared>, admission: Arc<Admission>) {
    sh.abandoned
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    crate::telemetry::abandoned(&admission.keys.tool);
    if admission.charge.holds_permits() {
        let (sh2, a) = (sh.clone(), admission.clone());
        tokio::spawn(async move {
            // Tried again until given back (see `release_call`).
            let _ = sh2.release_call(&a).await;
        });
    }
    let now = admission.at;
    let refunded = adjust(sh, admission, -1.0, now);
    // Counted as background work until the refund is written (see `Store::flush`).
    let working = sh.working();
    tokio::spawn(async move {
        let _working = working;
        let _ = refunded.await;
    });
}

/// What one batch's read found.
struct Read {
    now: u64,
    records: Vec<Option<Record>>,
    versions: Vec<Vec<u8>>,
    counts: Vec<f64>,
    /// The tool's epoch marker (empty for a read from the cache).
    epoch: Vec<u8>,
}

/// A zset's changes from one batch.
#[derive(Default)]
struct ZChange {
    /// Members whose score is at most this go (`None`: none).
    prune: Option<f64>,
    /// Members to add (or re-score).
    adds: Vec<(f64, Vec<u8>)>,
    /// Its TTL from now on.
    ttl_ms: Option<u64>,
}

/// What a batch decided, and what to write for it: its records and permit counts as its jobs
/// are decided, one after the other, and what they change.
struct BatchWrite {
    outcomes: Vec<JobDone>,
    /// The records' versions when read: what the write checks.
    versions: Vec<Vec<u8>>,
    records: Vec<Option<Record>>,
    counts: Vec<f64>,
    written: Vec<bool>,
    /// Records decided on (their TTL is set); those only corrected keep theirs.
    decided: Vec<bool>,
    holds: Vec<bool>,
    zsets: Vec<ZChange>,
    now: f64,
}

/// Decides every job of `batch`, one after the other, each on what the ones before it left.
fn decide(sh: &Shared, batch: &Batch, read: &Read) -> BatchWrite {
    let mut d = BatchWrite::on(read);
    for (job, jks) in batch.jobs.iter().zip(&batch.job_keys) {
        let now = match sh.config.time {
            TimeSource::Redis => Timestamp(read.now),
            TimeSource::Injected => job.now(),
        };
        d.now = now.as_micros() as f64;
        let outcome = match job {
            Job::Decide { parts, .. } => JobDone::Decided(d.decide(sh, parts, jks, now)),
            Job::Adjust {
                admission, factor, ..
            } => {
                d.adjust(sh, admission, *factor, &jks[0], now);
                JobDone::Adjusted
            }
            Job::Heal { .. } => JobDone::Read,
        };
        d.outcomes.push(outcome);
    }
    // A record lives at least the permit TTL while calls hold permits at its level.
    for jk in batch.job_keys.iter().flatten() {
        for l in 0..3 {
            if let (Some(i), Some(z)) = (jk.records[l], jk.permits[l]) {
                d.holds[i] |= d.counts[z] > 0.0;
            }
        }
    }
    d
}

impl BatchWrite {
    /// Nothing decided yet, on the records and permit counts of `read`.
    fn on(read: &Read) -> BatchWrite {
        let n = read.records.len();
        BatchWrite {
            outcomes: Vec::new(),
            versions: read.versions.clone(),
            records: read.records.clone(),
            counts: read.counts.clone(),
            written: vec![false; n],
            decided: vec![false; n],
            holds: vec![false; n],
            zsets: (0..read.counts.len()).map(|_| ZChange::default()).collect(),
            now: read.now as f64,
        }
    }

    fn nothing_to_write(&self) -> bool {
        !self.written.iter().any(|w| *w) && self.zsets.iter().all(|z| z.adds.is_empty())
    }

    /// Decides a call's parts on the records as they stand: every part admitted and written,
    /// or the first refusal and nothing written.
    fn decide(
        &mut self,
        sh: &Shared,
        parts: &[QueuedPart],
        jks: &[JobKeys],
        now: Timestamp,
    ) -> Decision {
        let mut admitted = Vec::with_capacity(parts.len());
        for (part, jk) in parts.iter().zip(jks) {
            let p = Plan {
                now,
                ..part.plan.plan()
            };
            let mut snapshot = self.snapshot(jk, p.instance.is_some());
            match engine::decide(&p, &mut snapshot) {
                Ok(a) => admitted.push((a, snapshot)),
                Err(r) => return Decision::Refused(r),
            }
        }
        let mut out = Vec::with_capacity(parts.len());
        for ((part, jk), (a, snapshot)) in parts.iter().zip(jks).zip(admitted) {
            self.write(sh, part, jk, &a, snapshot, now);
            let mut admission = a.admission;
            Arc::make_mut(&mut admission).call = part.call;
            out.push(admission);
        }
        Decision::Admitted(Admissions::of(out).expect("a call has a part"))
    }

    /// The states of a part's levels, with the permits counted at each.
    fn snapshot(&self, jk: &JobKeys, instance: bool) -> Snapshot {
        let state = |l: usize| -> NodeState {
            let mut s = jk.records[l]
                .and_then(|i| self.records[i].as_ref())
                .map(|r| r.state)
                .unwrap_or_default();
            s.in_flight = jk.permits[l].map_or(0.0, |z| self.counts[z]);
            s
        };
        let plans = jk.records[0].and_then(|i| self.records[i].as_ref());
        Snapshot {
            tool: state(0),
            plans: plans.map(|r| r.plans).unwrap_or_default(),
            tenant: state(1),
            instance: if instance {
                state(2)
            } else {
                NodeState::default()
            },
        }
    }

    /// Writes an admitted part's new states, and the permits it takes.
    fn write(
        &mut self,
        sh: &Shared,
        part: &QueuedPart,
        jk: &JobKeys,
        a: &engine::Admitted,
        snapshot: Snapshot,
        now: Timestamp,
    ) {
        let now_f = now.as_micros() as f64;
        let permit_ttl_us = sh.config.permit_ttl.as_micros() as f64;
        let has_instance = part.plan.plan().instance.is_some();
        let new_states = [snapshot.tool, snapshot.tenant, snapshot.instance];
        for (l, new_state) in new_states.into_iter().enumerate() {
            let Some(i) = jk.records[l] else { continue };
            if l == 2 && !has_instance {
                continue;
            }
            self.records[i] = Some(Record {
                version: sh.ids.version(),
                expires: a.expires[l],
                state: new_state,
                plans: if l == 0 {
                    snapshot.plans
                } else {
                    PlanCounts::NONE
                },
            });
            self.written[i] = true;
            self.decided[i] = true;
            if let (true, Some(z)) = (a.admission.charge.levels[l].permit, jk.permits[l]) {
                self.counts[z] += 1.0;
                let zc = &mut self.zsets[z];
                zc.prune = Some(now_f);
                zc.adds
                    .push((now_f + permit_ttl_us, part.call.to_le_bytes().to_vec()));
                zc.ttl_ms = Some((sh.config.permit_ttl.as_millis() as u64).max(sh.least_ttl_ms()));
            }
        }
    }

    /// Adds `factor` × an admission's charge at every level it charged.
    fn adjust(
        &mut self,
        sh: &Shared,
        admission: &Admission,
        factor: f64,
        jk: &JobKeys,
        now: Timestamp,
    ) {
        for l in 0..3 {
            let Some(i) = jk.records[l] else { continue };
            if !admission.charge.levels[l].present {
                continue;
            }
            if let Some(rec) = self.records[i].as_mut() {
                engine::adjust(&mut rec.state, &admission.charge, l, factor, now);
                rec.version = sh.ids.version();
                self.written[i] = true;
            }
        }
    }
}

/// What a round trip came back with.
struct Cycle {
    written: bool,
    /// Another replica holds the tool's turn: this replica's writes are refused until it
    /// writes (or its turn lapses).
    others_turn: bool,
    /// Redis's clock when the script ran (µs; the read's `now` when it read).
    now: u64,
    read: Option<Read>,
}

/// One round trip of `worker`: `write` (the last batch's records, if nothing it read has
/// changed and no other replica holds the tool's turn), then the read for `next`, which
/// claims the tool's turn when `claim` (see the batch script).
async fn cycle(
    sh: &Shared,
    write: Option<(&Batch, &BatchWrite)>,
    next: Option<&Batch>,
    worker: &Worker,
    claim: bool,
) -> Result<Cycle, StoreError> {
    let (keys, args) = cycle_args(sh, write, next, worker, claim);
    run_cycle(sh, &keys, &args, next.is_some()).await
}

/// The batch script run with `keys` and `args`, its answer parsed.
async fn run_cycle(
    sh: &Shared,
    keys: &[String],
    args: &[Vec<u8>],
    read: bool,
) -> Result<Cycle, StoreError> {
    // It may take longer than the callers wait (they count their own timeouts as store
    // errors): it is awaited to the end — callers that left by then get their admissions
    // given back — within a bound.
    let bound = sh.worker_bound();
    let reply: Value = tokio::time::timeout(bound, sh.eval(&sh.scripts.cycle, keys, args))
        .await
        .map_err(|_| StoreError::Timeout(bound))??;
    parse_cycle(reply, read, sh.config.formats[1])
}

/// A round trip that writes `write` and reads nothing, sent on its way: the future holds what
/// it needs (the worker decides the next batch meanwhile), and has been polled once, so the
/// script is queued on the connection before any later one.
async fn send_write(sh: &Arc<Shared>, write: (&Batch, &BatchWrite), worker: &Worker) -> InFlight {
    let (keys, args) = cycle_args(sh, Some(write), None, worker, false);
    let sh = sh.clone();
    let mut reply: InFlight = Box::pin(async move { run_cycle(&sh, &keys, &args, false).await });
    let ready = std::future::poll_fn(|cx| match reply.as_mut().poll(cx) {
        std::task::Poll::Ready(r) => std::task::Poll::Ready(Some(r)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await;
    match ready {
        Some(r) => Box::pin(std::future::ready(r)),
        None => reply,
    }
}

/// A write on its way to Redis.
type InFlight =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Cycle, StoreError>> + Send>>;

/// The keys and arguments of the batch script for [`cycle`].
fn cycle_args(
    sh: &Shared,
    write: Option<(&Batch, &BatchWrite)>,
    next: Option<&Batch>,
    worker: &Worker,
    claim: bool,
) -> (Vec<String>, Vec<Vec<u8>>) {
    let mut keys: Vec<String> = Vec::new();
    let written = write.map(|(b, _)| b);
    for b in written.into_iter().chain(next) {
        keys.extend(b.keys.records.iter().chain(&b.keys.zsets).cloned());
    }
    keys.extend([worker.marker_key.clone(), worker.turn_key.clone()]);
    let records = |b: Option<&Batch>| b.map_or(0, |b| b.keys.records.len());
    let write_keys = written.map_or(0, |b| b.keys.records.len() + b.keys.zsets.len());
    let mut args: Vec<Vec<u8>> = vec![
        write_keys.to_string().into_bytes(),
        records(written).to_string().into_bytes(),
        next.map_or_else(String::new, |b| sh.now_arg(b.now()))
            .into_bytes(),
        records(next).to_string().into_bytes(),
    ];
    if let Some((b, d)) = write {
        args.extend(write_of(sh, b, d));
    }
    args.extend([
        sh.ids.next().to_le_bytes().to_vec(),
        super::wire::MARKER_TTL.as_secs().to_string().into_bytes(),
        worker.me.as_bytes().to_vec(),
        if claim { b"1".to_vec() } else { b"0".to_vec() },
    ]);
    (keys, args)
}

/// The write part of the batch script's arguments: the versions read, then each record
/// written (its key's place, its bytes, its TTL) and each permits zset changed.
fn write_of(sh: &Shared, batch: &Batch, d: &BatchWrite) -> Vec<Vec<u8>> {
    let n = batch.keys.records.len();
    let mut args: Vec<Vec<u8>> = d.versions.clone();
    let writes: Vec<usize> = (0..n).filter(|i| d.written[*i]).collect();
    args.push(writes.len().to_string().into_bytes());
    let permit_ttl_us = sh.config.permit_ttl.as_micros() as f64;
    for &i in &writes {
        let rec = d.records[i].as_ref().expect("a written record");
        args.push((i + 1).to_string().into_bytes());
        args.push(rec.encode(sh.replicas.write_format()));
        args.push(if d.decided[i] {
            let mut keep = rec.expires;
            if d.holds[i] {
                keep = keep.max(d.now + permit_ttl_us);
            }
            let ttl = ttl_ms(keep, d.now).max(sh.least_ttl_ms());
            ttl.to_string().into_bytes()
        } else {
            Vec::new()
        });
    }
    let changed: Vec<usize> = (0..d.zsets.len())
        .filter(|z| !d.zsets[*z].adds.is_empty() || d.zsets[*z].prune.is_some())
        .collect();
    args.push(changed.len().to_string().into_bytes());
    for z in changed {
        let zc = &d.zsets[z];
        args.push((n + z + 1).to_string().into_bytes());
        args.push(zc.prune.map_or_else(Vec::new, |p| score(p).into_bytes()));
        args.push(
            zc.ttl_ms
                .map_or_else(Vec::new, |t| t.to_string().into_bytes()),
        );
        args.push(zc.adds.len().to_string().into_bytes());
        for (s, m) in &zc.adds {
            args.push(score(*s).into_bytes());
            args.push(m.clone());
        }
    }
    args
}

fn score(x: f64) -> String {
    // Whole microseconds: exact in a double, and in Redis's parser.
    format!("{}", x as u64)
}

/// The script's answer; records in formats up to `newest` are read.
fn parse_cycle(reply: Value, read: bool, newest: u8) -> Result<Cycle, StoreError> {
    let bad = |what: &str| StoreError::Protocol(format!("the batch script answered {what}"));
    let Value::Array(items) = reply else {
        return Err(bad("something other than an array"));
    };
    let [written, _changed, now, records, counts, others, epoch]: [Value; 7] = items
        .try_into()
        .map_err(|_| bad("the wrong number of parts"))?;
    let epoch: Vec<u8> =
        redis::from_redis_value(epoch).map_err(|_| bad("an epoch that is not a string"))?;
    let now: u64 = redis::from_redis_value::<String>(now)
        .map_err(|_| bad("no time"))?
        .parse::<f64>()
        .map_err(|_| bad("a time that is not a number"))? as u64;
    let mut cycle = Cycle {
        written: matches!(written, Value::Int(1)),
        others_turn: matches!(others, Value::Int(1)),
        now,
        read: None,
    };
    if !read {
        return Ok(cycle);
    }
    let raw: Vec<Option<Vec<u8>>> =
        redis::from_redis_value(records).map_err(|_| bad("records that are not strings"))?;
    let counts: Vec<u64> =
        redis::from_redis_value(counts).map_err(|_| bad("counts that are not numbers"))?;
    let records: Vec<Option<Record>> = raw
        .into_iter()
        .map(|r| r.map(|bytes| Record::decode(&bytes, newest)).transpose())
        .collect::<Result<_, _>>()?;
    let versions = records
        .iter()
        .map(|r| {
            r.as_ref()
                .map_or_else(Vec::new, |r| r.version.to_le_bytes().to_vec())
        })
        .collect();
    cycle.read = Some(Read {
        now,
        records,
        versions,
        counts: counts.into_iter().map(|c| c as f64).collect(),
        epoch,
    });
    Ok(cycle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redis's clock as the worker counts it never goes back: an answer read a while after it
    /// came in carries a time behind what the worker already counts. (It went back when the
    /// worker decided calls behind writes on their way: a batch decided in the window before
    /// the last one's saw its template callers uncounted, and refused them with a limit of 0.)
    #[test]
    fn the_workers_clock_of_redis_never_goes_back() {
        let mut cache = Cache::default();
        cache.clock(1_000_000);
        cache.clock(999_000);
        assert_eq!(cache.clock.map(|c| c.0), Some(1_000_000));
        cache.clock(2_000_000);
        assert_eq!(cache.clock.map(|c| c.0), Some(2_000_000));
    }
}
