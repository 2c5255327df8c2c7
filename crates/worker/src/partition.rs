//! A partition of this node: its processor task and the leader's read and write paths.

use crate::append::Appender;
use crate::processor::{ExportRequest, Outcome, Processor, log_error, store_error};
use crate::{Clock, Error, LeaderLease, Result};
use bytes::Bytes;
use cairn_log::{LogState, Loglet};
use cairn_partition_store::{ColumnFamilyExport, LeaderState, PartitionStore, StoredValue};
use cairn_types::clock::{BootClock, MonotonicClock};
use cairn_types::record::{Command, Envelope, Header, Origin, PutEntry, WriteOp, WriteResult};
use cairn_types::{Epoch, KeyRange, Lsn, NodeId, PartitionId};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::error;

type Waiter = oneshot::Sender<Result<Outcome>>;

/// The epoch a leadership was announced at, and the lease it serves under.
type Led = (Epoch, Option<Arc<dyn LeaderLease>>);

/// State the processor publishes and the request paths read.
pub(crate) struct Shared {
    pub id: PartitionId,
    pub node: NodeId,
    pub boot_id: u64,
    waiters: Mutex<HashMap<u64, Waiter>>,
    pub applied: watch::Sender<Lsn>,
    pub leader: watch::Sender<Option<LeaderState>>,
    stopped: watch::Sender<Option<String>>,
    /// The partition time the processor has applied up to (ms since the Unix epoch).
    time: AtomicU64,
    /// Set while the store refuses writes for a full disk (the processor retries the record it
    /// holds): new writes are refused with it rather than queue up behind that record.
    store_full: Mutex<Option<Arc<cairn_partition_store::Error>>>,
}

impl Shared {
    /// Hands `outcome` to the caller that proposed the record, if it is one of ours and waits.
    pub fn complete(&self, origin: &Origin, outcome: Result<Outcome>) {
        if origin.node != self.node || origin.boot_id != self.boot_id {
            return;
        }
        let waiter = self.lock_waiters().remove(&origin.request_id);
        if let Some(waiter) = waiter {
            // The caller may have given up (timeout, disconnect); nothing to do then.
            let _ = waiter.send(outcome);
        }
    }

    /// Marks the partition stopped and fails every waiting request. The first reason stays: a
    /// later one (the processor's "shut down" after a stop) would hide why it stopped.
    pub fn stop(&self, reason: String) {
        self.stopped.send_if_modified(|stopped| {
            stopped.is_none() && {
                *stopped = Some(reason.clone());
                true
            }
        });
        let reason = self.stopped_reason().unwrap_or(reason);
        self.fail_waiters(|| Error::Stopped {
            partition: self.id,
            reason: reason.clone(),
        });
    }

    /// Answers every waiting request with `error()`.
    fn fail_waiters(&self, error: impl Fn() -> Error) {
        let waiters: Vec<Waiter> = self.lock_waiters().drain().map(|(_, w)| w).collect();
        for waiter in waiters {
            let _ = waiter.send(Err(error()));
        }
    }

    fn lock_waiters(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Waiter>> {
        // A panic while holding this lock leaves the map consistent (single inserts/removes).
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_time(&self, time_ms: u64) {
        self.time.store(time_ms, Ordering::Release);
    }

    fn time(&self) -> u64 {
        self.time.load(Ordering::Acquire)
    }

    /// Sets or clears the full-store state. Setting it answers every waiting request: those
    /// whose records are in the log are applied once there is room, which may be long after their
    /// clients give up, so they learn now that their outcome is not known yet (and new writes are
    /// refused at once meanwhile).
    pub fn set_store_full(&self, full: Option<Arc<cairn_partition_store::Error>>) {
        *self.store_full.lock().unwrap_or_else(|p| p.into_inner()) = full.clone();
        if let Some(source) = full {
            self.fail_waiters(|| Error::StoreDiskFull {
                partition: self.id,
                source: source.clone(),
            });
        }
    }

    fn store_full(&self) -> Option<Arc<cairn_partition_store::Error>> {
        self.store_full
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn stopped_reason(&self) -> Option<String> {
        self.stopped.borrow().clone()
    }
}

/// What `partitions list` shows about a partition.
#[derive(Debug, Clone)]
pub struct PartitionStatus {
    pub id: PartitionId,
    pub key_range: KeyRange,
    pub leader: Option<LeaderState>,
    pub applied_lsn: Lsn,
    pub log: Option<LogState>,
    pub stopped: Option<String>,
}

/// One partition of this node.
pub struct Partition {
    shared: Arc<Shared>,
    store: PartitionStore,
    log: Arc<dyn Loglet>,
    /// Appends this node's proposals, several to a record under load.
    appender: Arc<Appender>,
    clock: Arc<dyn Clock>,
    key_range: KeyRange,
    /// The epoch this node leads with, once it has announced itself, and the lease it serves
    /// under (none: it serves as long as the epoch is current).
    epoch_led: Mutex<Option<Led>>,
    next_request_id: AtomicU64,
    /// The latest timestamp this node stamped on a record of the partition.
    last_stamp: AtomicU64,
    exports: mpsc::Sender<ExportRequest>,
    /// Asked before a trim or a snapshot garbage collection deletes anything; none alone.
    fence: std::sync::OnceLock<crate::LeadershipFence>,
    /// When (nanoseconds on the boot clock; 0: never) the last catch-up check of this replica
    /// began: it holds every write acknowledged before then (see
    /// [`Partition::bounded_read_share`]).
    caught_up_at: AtomicU64,
    /// Set by [`Partition::step_down`]: no write is proposed after it.
    stepped_down: std::sync::atomic::AtomicBool,
    /// Held by the catch-up check under way, which concurrent bounded reads wait for and share.
    catching_up: tokio::sync::Mutex<()>,
    cancel: CancellationToken,
    /// The processor's task on the apply pool. An async lock, held while [`Partition::shutdown`]
    /// waits, so that every caller returns only once the task has ended.
    task: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// How long [`Partition::become_leader`] waits for the applied LSN to move before it gives up.
pub const LEAD_STALL_MAX: Duration = Duration::from_secs(60);

/// How long a replica may take to show that it is fresh enough for a bounded-staleness read
/// (read the log's tail and apply up to it) before the read is refused, to be served by the
/// leader instead.
pub const CATCH_UP_LIMIT: Duration = Duration::from_millis(500);

/// Export requests that may wait for the processor at once.
const EXPORT_QUEUE_MAX: usize = 4;

impl Partition {
    /// Starts the partition's processor, which continues from the store's applied LSN.
    pub fn start(
        key_range: KeyRange,
        node: NodeId,
        store: PartitionStore,
        log: Arc<dyn Loglet>,
        clock: Arc<dyn Clock>,
    ) -> Result<Arc<Partition>> {
        let id = store.id();
        let applied = store
            .applied_lsn()
            .map_err(|err| store_error(id, "read applied LSN", err))?;
        let time = store
            .partition_time()
            .map_err(|err| store_error(id, "read the partition time", err))?;
        let leader = store
            .leader()
            .map_err(|err| store_error(id, "read leader", err))?;
        let shared = Arc::new(Shared {
            id,
            node,
            boot_id: rand::random(),
            waiters: Mutex::new(HashMap::new()),
            applied: watch::Sender::new(applied),
            leader: watch::Sender::new(leader.clone()),
            stopped: watch::Sender::new(None),
            time: AtomicU64::new(time),
            store_full: Mutex::new(None),
        });
        let cancel = CancellationToken::new();
        let (exports, exports_rx) = mpsc::channel(EXPORT_QUEUE_MAX);
        let processor = Processor {
            shared: shared.clone(),
            exports: exports_rx,
            store: store.clone(),
            log: log.clone(),
            leader,
            applied,
            time,
            horizon_refreshed: None,
        };
        // On the apply pool's threads (see `apply_pool`), apart from the runtime that serves.
        let pool = crate::apply_pool::apply_pool().map_err(|err| Error::Storage {
            partition: id,
            context: "start the processors' threads",
            source: err.into(),
        })?;
        let task = pool.spawn(processor.run(cancel.clone()));
        Ok(Arc::new(Partition {
            shared,
            store,
            appender: Appender::new(log.clone()),
            log,
            clock,
            key_range,
            epoch_led: Mutex::new(None),
            next_request_id: AtomicU64::new(1),
            last_stamp: AtomicU64::new(0),
            exports,
            fence: std::sync::OnceLock::new(),
            caught_up_at: AtomicU64::new(0),
            stepped_down: std::sync::atomic::AtomicBool::new(false),
            catching_up: tokio::sync::Mutex::new(()),
            cancel,
            task: tokio::sync::Mutex::new(Some(task)),
        }))
    }

    pub fn id(&self) -> PartitionId {
        self.shared.id
    }

    pub fn key_range(&self) -> KeyRange {
        self.key_range
    }

    pub(crate) fn store(&self) -> &PartitionStore {
        &self.store
    }

    pub fn log(&self) -> &Arc<dyn Loglet> {
        &self.log
    }

    pub fn applied_lsn(&self) -> Lsn {
        *self.shared.applied.borrow()
    }

    /// Makes this node the partition's leader at `epoch`: appends `AnnounceLeader` and returns once
    /// the processor applied it (after replaying the log up to it). Fails with [`Error::Fenced`]
    /// if the partition already saw a newer or equal epoch, with [`Error::StoreAheadOfLog`]
    /// (appending nothing) if the log lost records the store applied, and with
    /// [`Error::TimedOut`] if the processor's applied LSN does not move for [`LEAD_STALL_MAX`].
    pub async fn become_leader(&self, epoch: Epoch) -> Result<()> {
        self.become_leader_within(epoch, LEAD_STALL_MAX, None).await
    }

    /// [`Partition::become_leader`], serving only while `lease` holds (see [`LeaderLease`]).
    pub async fn become_leader_under(
        &self,
        epoch: Epoch,
        lease: Arc<dyn LeaderLease>,
    ) -> Result<()> {
        self.become_leader_within(epoch, LEAD_STALL_MAX, Some(lease))
            .await
    }

    /// [`Partition::become_leader`], failing once the applied LSN has not moved for `stall`. A
    /// bound on progress rather than on the whole call, since replaying a long log may take
    /// long while it moves.
    pub async fn become_leader_within(
        &self,
        epoch: Epoch,
        stall: Duration,
        lease: Option<Arc<dyn LeaderLease>>,
    ) -> Result<()> {
        let tail = self
            .log
            .state()
            .await
            .map_err(|err| log_error(self.id(), "read the log's state", err))?
            .tail;
        let applied = self.applied_lsn();
        if tail < applied {
            let err = Error::StoreAheadOfLog {
                partition: self.id(),
                applied,
                tail,
            };
            self.halt(&err);
            return Err(err);
        }
        // A leadership taken anew after a step-down proposes again.
        self.stepped_down.store(false, Ordering::SeqCst);
        let command = Command::AnnounceLeader {
            epoch,
            node: self.shared.node.clone(),
        };
        let announce = self.propose_at(epoch, command, None);
        tokio::pin!(announce);
        let mut progress = self.shared.applied.subscribe();
        loop {
            tokio::select! {
                outcome = &mut announce => {
                    outcome?;
                    break;
                }
                moved = tokio::time::timeout(stall, progress.changed()) => {
                    if moved.is_err() {
                        let tail = self.log.state().await.map(|s| s.tail).unwrap_or_default();
                        return Err(Error::TimedOut {
                            partition: self.id(),
                            what: "taking the leadership (replaying the log up to the announcement)",
                            waited: stall,
                            applied: self.applied_lsn(),
                            tail,
                        });
                    }
                }
            }
        }
        *self.epoch_led.lock().unwrap_or_else(|p| p.into_inner()) = Some((epoch, lease));
        Ok(())
    }

    /// Stops the partition for good with `err` as the reason.
    fn halt(&self, err: &Error) {
        error!(partition = %self.id(), "partition stopped: {err}");
        self.shared.stop(err.to_string());
        self.cancel.cancel();
    }

    pub async fn put(&self, entries: Vec<PutEntry>) -> Result<()> {
        self.propose(Command::Put { entries }).await.map(|_| ())
    }

    pub async fn delete(&self, keys: Vec<Bytes>) -> Result<()> {
        self.propose(Command::Delete { keys }).await.map(|_| ())
    }

    /// Per key, whether this call inserted it.
    pub async fn insert_if_absent(
        &self,
        keys: Vec<Bytes>,
        value: Bytes,
        ttl_ms: Option<u64>,
    ) -> Result<Vec<bool>> {
        let n = keys.len();
        match self
            .propose(Command::InsertIfAbsent {
                keys,
                value,
                ttl_ms,
            })
            .await?
        {
            Outcome::Inserted(inserted) if inserted.len() == n => Ok(inserted),
            other => unreachable!("insert-if-absent of {n} keys produced {other:?}"),
        }
    }

    /// Applies `ops` as one record (see [`Command::Write`]); per operation, what it did.
    pub async fn write(&self, ops: Vec<WriteOp>, all_or_nothing: bool) -> Result<Vec<WriteResult>> {
        let n = ops.len();
        match self
            .propose(Command::Write {
                ops,
                all_or_nothing,
            })
            .await?
        {
            Outcome::Written(results) if results.len() == n => Ok(results),
            other => unreachable!("a write of {n} operations produced {other:?}"),
        }
    }

    /// Current values of `keys` (`None` for absent or expired), read from the leader's store as
    /// [`read_shares`] reads: from memory on this task when it can, else on a blocking thread.
    pub async fn get(&self, keys: &[Bytes]) -> Result<Vec<Option<Bytes>>> {
        let share = self.read_share(keys.to_vec())?;
        let mut values = read_shares(vec![share], keys.len(), usize::MAX).await?;
        Ok(values
            .pop()
            .unwrap_or_default()
            .into_iter()
            .map(|v| v.map(|v| v.value))
            .collect())
    }

    /// This partition's share of a read of `keys`: checked to be served here now, with the
    /// partition time that decides which values have expired. Read it with [`read_shares`],
    /// together with other partitions' shares.
    pub fn read_share(&self, keys: Vec<Bytes>) -> Result<ReadShare> {
        self.serving_epoch()?;
        Ok(ReadShare {
            partition: self.id(),
            store: self.store.clone(),
            now_ms: self.partition_time(),
            keys,
        })
    }

    /// How far a replica must have applied the log to answer a read that began before this
    /// call as this leader would (the read index): the applied LSN, which holds every write this
    /// leader acknowledged and every record of its predecessors, given only while it serves
    /// under its lease. See [`Partition::bounded_read_share`].
    pub fn read_index(&self) -> Result<Lsn> {
        self.serving()?;
        Ok(self.applied_lsn())
    }

    /// This replica's share of a read that accepts values up to `max_staleness` old: what a read
    /// at some moment at most `max_staleness` before this call would have returned, or later.
    /// The leader serves it as [`Partition::read_share`] does (linearizable). Any other replica
    /// (a follower, a leader whose lease ran out) serves it once it has shown that it holds
    /// every write acknowledged more than `max_staleness` ago: a check asks the leader's
    /// [`Partition::read_index`] through `read_index` and waits until this replica has applied
    /// up to it, so it holds every write acknowledged before the check began. A check serves
    /// every read within `max_staleness` of its start, and concurrent reads share one; a replica
    /// that cannot finish one within [`CATCH_UP_LIMIT`] (the leader unreachable, the replica far
    /// behind) refuses with [`Error::TooStale`]. Ages are measured on this machine's boot clock,
    /// so the bound holds as far as its rate is right.
    ///
    /// What it gives up: two such reads, even on one replica, may see the same key go back in
    /// time (the second served by a replica further behind, or by the leader before the replica
    /// catches up), and a value written after the read began may or may not be seen.
    pub async fn bounded_read_share<F, Fut>(
        &self,
        keys: Vec<Bytes>,
        max_staleness: Duration,
        read_index: F,
    ) -> Result<ReadShare>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<Lsn, String>>,
    {
        if self.serving_epoch().is_ok() {
            return self.read_share(keys);
        }
        if let Some(reason) = self.shared.stopped_reason() {
            return Err(Error::Stopped {
                partition: self.id(),
                reason,
            });
        }
        let arrived = BootClock.now();
        if !self.caught_up_since(arrived, max_staleness) {
            let too_stale = |reason: String| Error::TooStale {
                partition: self.id(),
                max_staleness,
                reason,
            };
            let check = async {
                let _only = self.catching_up.lock().await;
                // The check just finished (the one this read waited for) may do.
                if self.caught_up_since(arrived, max_staleness) {
                    return Ok(());
                }
                self.catch_up(read_index).await
            };
            match tokio::time::timeout(CATCH_UP_LIMIT, check).await {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => return Err(too_stale(reason)),
                Err(_) => {
                    return Err(too_stale(format!(
                        "it did not apply the log up to its leader's read index within {}ms \
                         (applied LSN {})",
                        CATCH_UP_LIMIT.as_millis(),
                        self.applied_lsn()
                    )));
                }
            }
        }
        Ok(ReadShare {
            partition: self.id(),
            store: self.store.clone(),
            now_ms: self.partition_time(),
            keys,
        })
    }

    /// Whether the last catch-up check began at most `max_staleness` before `arrived`.
    fn caught_up_since(&self, arrived: Duration, max_staleness: Duration) -> bool {
        let at = self.caught_up_at.load(Ordering::Acquire);
        at != 0 && Duration::from_nanos(at).saturating_add(max_staleness) >= arrived
    }

    /// Asks the leader's read index and waits until this replica has applied up to it; then it
    /// holds every write acknowledged before this began.
    async fn catch_up<F, Fut>(&self, read_index: F) -> std::result::Result<(), String>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<Lsn, String>>,
    {
        let began = BootClock.now();
        let index = read_index()
            .await
            .map_err(|reason| format!("its leader's read index: {reason}"))?;
        self.wait_applied(index)
            .await
            .map_err(|err| err.to_string())?;
        self.caught_up_at
            .fetch_max((began.as_nanos() as u64).max(1), Ordering::AcqRel);
        Ok(())
    }

    /// Trims the log up to `up_to`. Refuses to trim past what this partition has applied, since
    /// those records would be lost to it.
    pub async fn trim_log(&self, up_to: Lsn) -> Result<()> {
        let applied = self.applied_lsn();
        if up_to > applied {
            return Err(Error::TrimRefused {
                partition: self.id(),
                requested: up_to,
                reason: format!(
                    "the partition has applied only up to LSN {applied}; trimming further would drop records it has not applied"
                ),
            });
        }
        // The store keeps no write-ahead log of its own: what it applied but has not flushed
        // lives only in memory and is replayed from the log after a crash, so those records must
        // stay in the log until they are on disk.
        let store = self.store.clone();
        crate::blocking(self.id(), "flush before trimming the log", move || {
            store.flush()
        })
        .await?
        .map_err(|err| store_error(self.id(), "flush before trimming the log", err))?;
        // Last, right before the records go: only under the current epoch.
        self.check_fence()
            .await
            .map_err(|fenced| Error::TrimRefused {
                partition: self.id(),
                requested: up_to,
                reason: fenced.to_string(),
            })?;
        self.log
            .trim(up_to)
            .await
            .map_err(|err| log_error(self.id(), "trim log", err))
    }

    /// Sets what is asked before a trim or a snapshot garbage collection deletes anything (see
    /// [`crate::LeadershipFence`]); once, when the partition starts.
    pub fn set_fence(&self, fence: crate::LeadershipFence) {
        let _ = self.fence.set(fence);
    }

    /// `Ok` if nothing fences this partition's deletions, or the fence says this node still
    /// leads it at the epoch it serves with; else why not.
    pub(crate) async fn check_fence(&self) -> std::result::Result<(), cairn_types::Fenced> {
        let Some(fence) = self.fence.get() else {
            return Ok(());
        };
        let epoch = self.serving_epoch().map_err(|err| {
            cairn_types::Fenced::new(format!(
                "this node does not serve it as its leader now ({err})"
            ))
        })?;
        fence(self.id(), epoch).await
    }

    /// A snapshot garbage collection's fence for this partition (see [`Partition::set_fence`]):
    /// it holds while this node leads it at the epoch it serves with now.
    pub(crate) fn gc_fence(&self) -> Option<cairn_snapshots::GcFence> {
        let fence = self.fence.get()?.clone();
        let epoch = self.serving_epoch().map_err(|err| err.to_string());
        Some(Arc::new(move |partition| match &epoch {
            Ok(epoch) => fence(partition, *epoch),
            Err(err) => {
                let fenced = cairn_types::Fenced::new(format!(
                    "this node does not serve it as its leader ({err})"
                ));
                Box::pin(async move { Err(fenced) })
            }
        }))
    }

    pub async fn status(&self) -> PartitionStatus {
        let log = self.log.state().await.ok();
        let leader = self.shared.leader.borrow().clone();
        PartitionStatus {
            id: self.id(),
            key_range: self.key_range,
            leader,
            applied_lsn: self.applied_lsn(),
            log,
            stopped: self.shared.stopped_reason(),
        }
    }

    /// Exports the partition's store into `target_dir` between two records, so the export holds
    /// exactly the records up to the applied LSN it reports.
    pub async fn export(&self, target_dir: PathBuf) -> Result<ColumnFamilyExport> {
        let stopped = |reason: &str| Error::Stopped {
            partition: self.id(),
            reason: reason.to_string(),
        };
        let (reply, answer) = oneshot::channel();
        self.exports
            .send(ExportRequest { target_dir, reply })
            .await
            .map_err(|_| stopped("the processor is not running"))?;
        answer
            .await
            .map_err(|_| stopped("the processor ended before exporting"))?
    }

    /// Waits until the processor has applied `lsn`, or stopped.
    pub async fn wait_applied(&self, lsn: Lsn) -> Result<()> {
        let mut applied = self.shared.applied.subscribe();
        let mut stopped = self.shared.stopped.subscribe();
        loop {
            if *applied.borrow_and_update() >= lsn {
                return Ok(());
            }
            if let Some(reason) = stopped.borrow_and_update().clone() {
                return Err(Error::Stopped {
                    partition: self.id(),
                    reason,
                });
            }
            tokio::select! {
                _ = applied.changed() => {}
                _ = stopped.changed() => {}
            }
        }
    }

    /// Stops the processor and waits until its task has ended.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        let mut task = self.task.lock().await;
        if let Some(running) = task.as_mut() {
            // A processor that panicked has ended too; its reason is already recorded.
            let _ = running.await;
            *task = None;
        }
    }

    /// Whether [`Partition::shutdown`] has seen the processor's task end.
    pub fn has_shut_down(&self) -> bool {
        matches!(self.task.try_lock().as_deref(), Ok(None))
    }

    /// Why the processor stopped, if it did (a trim gap, a failed store).
    pub fn stopped(&self) -> Option<String> {
        self.shared.stopped_reason()
    }

    /// Whether this node leads the partition and serves its requests now.
    pub fn leads(&self) -> bool {
        self.serving_epoch().is_ok()
    }

    /// Whether this node holds the partition's leadership, served or not: its announced epoch is
    /// current and its lease was not given up for good. A lapsed lease that may be renewed
    /// still holds it; a revoked one does not, and the leadership must be taken anew.
    pub fn holds_leadership(&self) -> bool {
        let led = self
            .epoch_led
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let current = self.shared.leader.borrow().clone();
        match (led, current) {
            (Some((led, lease)), Some(current)) => {
                self.shared.stopped_reason().is_none()
                    && current.epoch == led
                    && current.node == self.shared.node
                    && !lease.is_some_and(|lease| lease.revoked())
            }
            _ => false,
        }
    }

    /// Stops serving as the leader (new requests are refused as "not the leader", naming no
    /// leader, so that clients look for the new one) and waits until every write proposed
    /// before has been answered, for at most `within`: a planned handoff then fails no write
    /// in flight. Returns whether they all were.
    pub async fn step_down(&self, within: Duration) -> bool {
        self.stepped_down.store(true, Ordering::SeqCst);
        *self.epoch_led.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.shared.lock_waiters().is_empty() {
                return true;
            }
            if self.shared.stopped_reason().is_some() || tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// The epoch this node serves with, if it is the partition's current leader.
    pub fn serving_epoch(&self) -> Result<Epoch> {
        self.serving().map(|(epoch, _)| epoch)
    }

    /// [`Partition::serving_epoch`], with the lease it serves under.
    fn serving(&self) -> Result<(Epoch, Option<Arc<dyn LeaderLease>>)> {
        if let Some(reason) = self.shared.stopped_reason() {
            return Err(Error::Stopped {
                partition: self.id(),
                reason,
            });
        }
        let led = self
            .epoch_led
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let current = self.shared.leader.borrow().clone();
        match (led, current) {
            (Some((led, lease)), Some(current))
                if current.epoch == led && current.node == self.shared.node =>
            {
                // Checked last, after the epoch: a read that passes it is served from a store
                // holding every write acknowledged before it began (see ARCHITECTURE.md,
                // *Linearizable reads*).
                if let Some(lease) = &lease
                    && let Err(reason) = lease.check()
                {
                    return Err(Error::LeaseLapsed {
                        partition: self.id(),
                        reason,
                    });
                }
                Ok((led, lease))
            }
            // A leadership this node gave up (a step-down) is not named: the clients would
            // only come back here.
            (_, current) => Err(Error::NotLeader {
                partition: self.id(),
                leader: current
                    .map(|l| l.node)
                    .filter(|node| *node != self.shared.node),
            }),
        }
    }

    async fn propose(&self, command: Command) -> Result<Outcome> {
        let (epoch, lease) = self.serving()?;
        self.propose_at(epoch, command, lease).await
    }

    /// The partition's time as applied (ms since the Unix epoch), without the clock.
    pub fn applied_time_ms(&self) -> u64 {
        self.shared.time()
    }

    /// The time reads decide expiry by: the clock, or the partition's time if the clock is
    /// behind it, so that nothing the processor already treats as expired is read as live.
    pub(crate) fn partition_time(&self) -> u64 {
        self.clock.now_ms().max(self.shared.time())
    }

    /// The timestamp of a new record: never before the partition's time nor before this node's
    /// previous stamp, so that a leader whose clock is behind its predecessor's does not stamp
    /// records into the past. (The processor enforces the same by itself; stamping so keeps the
    /// records' timestamps what they take effect at.)
    fn stamp(&self) -> u64 {
        let at = self.partition_time();
        self.last_stamp.fetch_max(at, Ordering::AcqRel).max(at)
    }

    /// Appends `command` at `epoch` and waits for the processor's answer. Under a `lease`, a
    /// request still waiting when the lease runs out is answered then, as of unknown outcome
    /// (the leader can no longer vouch for it, and waiting on an unreachable log would hang the
    /// client past the failover that decides it).
    async fn propose_at(
        &self,
        epoch: Epoch,
        command: Command,
        lease: Option<Arc<dyn LeaderLease>>,
    ) -> Result<Outcome> {
        let request_id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.shared.lock_waiters().insert(request_id, tx);
        // Removes the waiter however this call ends, including when the caller drops the future
        // (a timeout or a disconnect), so waiters never pile up.
        let _unregister = Unregister {
            shared: &self.shared,
            request_id,
        };
        // Checked after registering: `stop` marks the partition stopped before it drains the
        // waiters, so either the drain reaches this waiter or this check sees the stop.
        if let Some(reason) = self.shared.stopped_reason() {
            return Err(Error::Stopped {
                partition: self.id(),
                reason,
            });
        }
        // Checked after registering, as the stop is: a step-down sets it before it waits for the
        // registered waiters, so either it waits for this one or this refuses it.
        if self.stepped_down.load(Ordering::SeqCst) {
            return Err(Error::NotLeader {
                partition: self.id(),
                leader: None,
            });
        }
        // A full store refuses new writes at once; checked after registering for the same
        // reason (`set_store_full` sets the state before it answers the waiters).
        if let Some(source) = self.shared.store_full() {
            return Err(Error::StoreDiskFull {
                partition: self.id(),
                source,
            });
        }
        let envelope = Envelope {
            header: Header {
                epoch,
                timestamp_ms: self.stamp(),
                origin: Some(Origin {
                    node: self.shared.node.clone(),
                    boot_id: self.shared.boot_id,
                    request_id,
                }),
            },
            command,
        };
        // Read before appending: the record cannot be applied before it exists, so an LSN at or
        // below this means the log hands out LSNs the store has already applied.
        let applied = self.applied_lsn();
        let lapse = lease_lapse(lease);
        tokio::pin!(lapse);
        let lsn = tokio::select! {
            appended = self.appender.append(envelope.encode()) => {
                appended.map_err(|err| log_error(self.id(), "append to log", err))?
            }
            reason = &mut lapse => {
                return Err(Error::LapsedInFlight {
                    partition: self.id(),
                    reason,
                });
            }
        };
        if lsn <= applied {
            let err = Error::StoreAheadOfLog {
                partition: self.id(),
                applied,
                tail: Lsn(lsn.0.saturating_sub(1)),
            };
            self.halt(&err);
            return Err(err);
        }
        // The record is in the log: a stop from here on leaves its outcome to a later leader.
        let undecided = |reason: String| Error::Undecided {
            partition: self.id(),
            lsn,
            reason,
        };
        let outcome = tokio::select! {
            outcome = rx => outcome,
            reason = &mut lapse => return Err(undecided(reason)),
        };
        match outcome {
            Ok(Err(Error::Stopped { reason, .. })) => Err(undecided(reason)),
            Ok(Err(Error::StoreDiskFull { source, .. })) => Err(undecided(format!(
                "the disk holding the partition store is full ({source}); the write is in the \
                 log and is applied once there is room again"
            ))),
            Ok(outcome) => outcome,
            Err(_) => Err(undecided(
                "the processor ended before applying the request".into(),
            )),
        }
    }
}

/// How often a request in flight checks its leader's lease.
const LEASE_POLL: Duration = Duration::from_millis(50);

/// Ends, with the reason, once `lease` no longer holds; never without a lease.
async fn lease_lapse(lease: Option<Arc<dyn LeaderLease>>) -> String {
    let Some(lease) = lease else {
        return std::future::pending().await;
    };
    loop {
        if let Err(reason) = lease.check() {
            return format!("this node's lease as the partition's leader ran out: {reason}");
        }
        tokio::time::sleep(LEASE_POLL).await;
    }
}

/// One partition's keys of a read, from [`Partition::read_share`].
pub struct ReadShare {
    partition: PartitionId,
    store: PartitionStore,
    now_ms: u64,
    keys: Vec<Bytes>,
}

/// Reads of up to this many keys first try what the store holds in memory, on the caller's task:
/// a trip to a blocking thread costs more than such a lookup.
const CACHED_READ_KEYS_MAX: usize = 128;

/// The values of every share, `chunk` keys per `lookup` call; `None` as soon as `lookup` gives
/// up on a chunk (a cached read that would need the disk).
fn read_with(
    shares: &[ReadShare],
    key_count: usize,
    chunk: usize,
    bytes_max: usize,
    lookup: impl Fn(
        &PartitionStore,
        &[Bytes],
    ) -> cairn_partition_store::Result<Option<Vec<Option<StoredValue>>>>,
) -> Result<Option<Vec<Vec<Option<StoredValue>>>>> {
    let mut total = 0usize;
    let mut all = Vec::with_capacity(shares.len());
    for share in shares {
        let mut values = Vec::with_capacity(share.keys.len());
        for keys in share.keys.chunks(chunk.max(1)) {
            let Some(read) = lookup(&share.store, keys)
                .map_err(|err| store_error(share.partition, "read keys", err))?
            else {
                return Ok(None);
            };
            for value in read {
                let value = value.filter(|v| v.is_live_at(share.now_ms));
                total = total.saturating_add(value.as_ref().map_or(0, |v| v.value.len()));
                values.push(value);
            }
            if total > bytes_max {
                return Err(Error::AnswerTooLarge {
                    keys: key_count,
                    bytes_max,
                });
            }
        }
        all.push(values);
    }
    Ok(Some(all))
}

/// Each share's values with their expiries (`None` for absent or expired), in the order of its
/// keys. Reads them all
/// in one trip to a blocking thread (a request's keys span many partitions; a trip per partition
/// costs more than the lookups), `chunk` keys per lookup, and refuses the read with
/// [`Error::AnswerTooLarge`] once the values add up to more than `bytes_max`: at most one chunk's
/// values past the bound are ever held.
pub async fn read_shares(
    shares: Vec<ReadShare>,
    chunk: usize,
    bytes_max: usize,
) -> Result<Vec<Vec<Option<StoredValue>>>> {
    let Some(first) = shares.first().map(|share| share.partition) else {
        return Ok(Vec::new());
    };
    let key_count: usize = shares.iter().map(|share| share.keys.len()).sum();
    if key_count <= CACHED_READ_KEYS_MAX
        && let Some(values) = read_with(&shares, key_count, chunk, bytes_max, |store, keys| {
            store.multi_get_cached(keys)
        })?
    {
        return Ok(values);
    }
    crate::blocking(first, "read keys", move || {
        read_with(&shares, key_count, chunk, bytes_max, |store, keys| {
            store.multi_get(keys).map(Some)
        })
        .map(|values| values.unwrap_or_default())
    })
    .await?
}

struct Unregister<'a> {
    shared: &'a Shared,
    request_id: u64,
}

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        self.shared.lock_waiters().remove(&self.request_id);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
