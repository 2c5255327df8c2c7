//! The partition processor: applies a partition's log, in LSN order, to its store.
//!
//! # Consistency
//! Every replica applies the same records in the same order with the same result: a record's
//! effect depends only on the store before it and on the record itself (its epoch and its
//! timestamp), never on the applying node's clock or role.
//!
//! # Runs of records
//! The processor applies what one read of the log returns (up to [`READ_BATCH_RECORDS_MAX`]
//! records) as one run: one RocksDB write batch and one commit. The keys
//! every insert-if-absent of the run asks about are looked up in one batched read first; a write
//! earlier in the same run is seen through an overlay of the batch, so each record's answer is
//! what it would be had the records been applied one by one. Callers are answered only once the
//! run is committed. A batch record (several proposals a leader appended together) is applied
//! as its envelopes in order, each answering its own proposer; the record is checked whole
//! before any of it is applied, so a batch is never applied in part.
//!
//! # Records in memory
//! A processor behind its log reads rounds of about 64 MiB (up to 1024 records), taking that
//! much from a budget shared by every processor of the process ([`READ_BUDGET_MIB`], 256 MiB)
//! before it reads and giving it back once the round is applied; at the tail it reads rounds of
//! about 1 MiB outside the budget. A node that replays many partitions at once (after a start, a
//! move's loads) holds at most the budget plus about 1 MiB (or one record) per partition of
//! records, whatever the number of partitions.
//!
//! # Threads of their own
//! Processors run on the apply pool (`apply_pool`): a runtime of their own, apart from the one
//! that serves requests, with a fixed number of threads however many partitions the node holds.
//! RocksDB calls (the commits, the lookups, exports) block one of those threads without holding
//! up any request, and no run pays a hop to a blocking pool and back. The log wakes the
//! processor directly when records arrive.
//!
//! # Crash consistency
//! A run's effects and the new applied LSN go into one write batch. After a crash the store
//! reflects exactly the records up to its applied LSN, and the processor continues from the next.
//!
//! # A log that lost records
//! The processor stops rather than diverge when the log's tail is below its applied LSN (the log
//! lost its end) or the log hands it an LSN other than the next one: applying on would give
//! LSNs it already applied to different records. A failed append (a full disk) is the proposer's
//! error only; the processor keeps waiting at the tail.
//!
//! # Epoch fencing
//! `AnnounceLeader { epoch }` with an epoch newer than the current one makes it current. Any other
//! record stamped with an epoch that is not the current one is skipped (its LSN still counts as
//! applied), so an old leader's late appends have no effect anywhere.

use crate::partition::Shared;
use crate::{Error, Result};
use bytes::Bytes;
use cairn_log::{Entry, Loglet};
use cairn_partition_store::{
    ColumnFamilyExport, LeaderState, PartitionStore, PartitionWriteBatch, StoredValue,
};
use cairn_types::Lsn;
use cairn_types::record::{
    Action, Command, Condition, DecodeError, Envelope, Expiry, Origin, WriteOp, WriteResult,
};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// What applying a record produced, handed to the caller that proposed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// Per key of an insert-if-absent: whether this record inserted it.
    Inserted(Vec<bool>),
    /// Per operation of a conditional write: what it did.
    Written(Vec<WriteResult>),
    Announced,
}

/// How often the processor moves the compaction filter's horizon up, at most.
const HORIZON_REFRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// Records read from the log per round, at most.
const READ_BATCH_RECORDS_MAX: usize = 1024;

/// How often a record that the full store refused is tried again. RocksDB checks for room to
/// resume every few seconds itself; this only bounds how late the partition notices.
const STORE_FULL_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Bytes of records a round of a processor that is behind the log aims to hold in memory: rounds
/// of large records read fewer of them, so a replay of 16 MiB records does not hold 1024 of them
/// at once.
const READ_BATCH_BYTES_TARGET: usize = 64 * 1024 * 1024;

/// Bytes of records a round at the log's tail aims to hold: what a processor may read without
/// taking from [`READ_BUDGET`].
const TAIL_ROUND_BYTES: usize = 1024 * 1024;

/// The unit of [`READ_BUDGET`].
const MIB: usize = 1024 * 1024;

/// Records, in MiB, that the processors of the process that are behind their logs (replaying
/// after a start, a follower catching up, a move's new holder) may hold at once, whatever the
/// number of partitions: each takes what its round is expected to hold before reading and gives
/// it back once the round is applied, and waits for its turn beyond this. Processors at the tail
/// read rounds of [`TAIL_ROUND_BYTES`] (or one record) without taking from it, so live writes
/// never wait behind a replay. A node's records in memory are thus at most this much plus
/// about 1 MiB (or one record) per partition.
const READ_BUDGET_MIB: usize = 256;

static READ_BUDGET: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(READ_BUDGET_MIB);

/// The size of the next read of the log, from what the last one returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RoundSize {
    /// Average payload bytes of the records last read; 0 before any were.
    average: usize,
    /// Whether the last read returned all it asked for: more likely waits behind it. A processor
    /// starts as behind, since it may have a long log to replay.
    behind: bool,
}

impl RoundSize {
    fn start() -> RoundSize {
        RoundSize {
            average: 0,
            behind: true,
        }
    }

    /// The bytes the next round aims for.
    fn target_bytes(self) -> usize {
        if self.behind {
            READ_BATCH_BYTES_TARGET
        } else {
            TAIL_ROUND_BYTES
        }
    }

    /// Records to ask the log for.
    fn records(self) -> usize {
        if self.average == 0 {
            return READ_BATCH_RECORDS_MAX;
        }
        (self.target_bytes() / self.average).clamp(1, READ_BATCH_RECORDS_MAX)
    }

    /// MiB of [`READ_BUDGET`] to take before reading: what the round is expected to hold, none
    /// at the tail.
    fn budget_mib(self) -> u32 {
        if !self.behind {
            return 0;
        }
        let expected = if self.average == 0 {
            READ_BATCH_BYTES_TARGET
        } else {
            (self.average * self.records()).min(READ_BATCH_BYTES_TARGET)
        };
        expected.div_ceil(MIB).clamp(1, READ_BUDGET_MIB) as u32
    }

    /// After a read that asked for `asked` records and got `entries`.
    fn after(self, asked: usize, entries: &[Entry]) -> RoundSize {
        let average = match entries.len() {
            0 => self.average,
            n => (entries.iter().map(|e| e.payload.len()).sum::<usize>() / n).max(1),
        };
        RoundSize {
            average,
            behind: entries.len() >= asked,
        }
    }
}

/// Asks the processor to export its store between two records, so that the export holds exactly
/// the effects of the records up to the applied LSN it reports.
pub(crate) struct ExportRequest {
    pub target_dir: PathBuf,
    pub reply: oneshot::Sender<Result<ColumnFamilyExport>>,
}

pub(crate) struct Processor {
    pub shared: Arc<Shared>,
    pub exports: mpsc::Receiver<ExportRequest>,
    pub store: PartitionStore,
    pub log: Arc<dyn Loglet>,
    pub leader: Option<LeaderState>,
    pub applied: Lsn,
    /// The partition's time: the latest effective timestamp of the records applied.
    pub time: u64,
    /// When the compaction filter's horizon was last moved up to the store's persisted time.
    pub horizon_refreshed: Option<std::time::Instant>,
}

impl Processor {
    pub async fn run(mut self, cancel: CancellationToken) {
        let partition = self.shared.id;
        info!(%partition, applied_lsn = %self.applied, "partition processor started");
        self.refresh_expiry_horizon();
        let result = self.apply_loop(&cancel).await;
        let reason = match result {
            Ok(()) => "shut down".to_string(),
            Err(err) => {
                error!(%partition, applied_lsn = %self.applied, "partition processor stopped: {err}");
                err.to_string()
            }
        };
        self.shared.stop(reason);
    }

    /// Applies the log until it fails or `cancel` fires. Cancellation is looked at only where the
    /// loop waits (for the log, for room, for a test's pause), never while a run is being
    /// applied (a run is applied synchronously, in one poll), so whoever cancels (a restore about
    /// to replace the store) and then waits for the processor finds it done.
    async fn apply_loop(&mut self, cancel: &CancellationToken) -> Result<()> {
        let partition = self.shared.id;
        let mut round = RoundSize::start();
        loop {
            while let Ok(request) = self.exports.try_recv() {
                self.export(request).await;
            }
            let from = self.applied.next();
            // Held until the round is applied.
            let budget = match round.budget_mib() {
                0 => None,
                mib => tokio::select! {
                    permit = READ_BUDGET.acquire_many(mib) => {
                        Some(permit.expect("the read budget is never closed"))
                    }
                    () = cancel.cancelled() => return Ok(()),
                },
            };
            let asked = round.records();
            let read = tokio::select! {
                read = self.log.read(from, asked) => read,
                () = cancel.cancelled() => return Ok(()),
            };
            let entries = match read {
                Ok(entries) => entries,
                Err(cairn_log::Error::Trimmed { trim_point, .. }) => {
                    return Err(Error::Stopped {
                        partition,
                        reason: format!(
                            "the log was trimmed to LSN {trim_point} but this store has applied only LSN {}; \
                             records {from}..={trim_point} are gone and must come from a snapshot",
                            self.applied
                        ),
                    });
                }
                Err(err) => return Err(log_error(partition, "read log", err)),
            };
            round = round.after(asked, &entries);
            if entries.is_empty() {
                drop(budget);
                self.check_log_reaches_applied().await?;
                tokio::select! {
                    waited = self.log.wait_for_tail(from) => {
                        waited.map_err(|err| log_error(partition, "wait for log", err))?;
                    }
                    Some(request) = self.exports.recv() => self.export(request).await,
                    () = cancel.cancelled() => return Ok(()),
                }
                continue;
            }
            if !self.apply_when_room(entries, cancel).await? {
                return Ok(());
            }
            tokio::select! {
                () = crate::testing::pause_point_of("replay", partition) => {}
                () = cancel.cancelled() => return Ok(()),
            }
        }
    }

    /// At the tail: the log must still hold every record applied. A tail below the applied LSN
    /// means the log lost its end; the next appends would get LSNs already applied and the
    /// processor would take them for new ones.
    async fn check_log_reaches_applied(&self) -> Result<()> {
        let tail = self
            .log
            .state()
            .await
            .map_err(|err| log_error(self.shared.id, "read the log's state", err))?
            .tail;
        if tail < self.applied {
            return Err(Error::StoreAheadOfLog {
                partition: self.shared.id,
                applied: self.applied,
                tail,
            });
        }
        Ok(())
    }

    /// Applies a run of records in one write batch; while the store's disk
    /// is full, retries until RocksDB resumes writing (it does so by itself once there is room)
    /// instead of stopping the partition. The partition says meanwhile that its store is full, so
    /// that new writes are refused at once and reads go on; exports asked for meanwhile are
    /// answered (they fail on the full disk).
    ///
    /// Returns whether the run was applied: `false` if `cancel` fired while the store was full.
    async fn apply_when_room(
        &mut self,
        entries: Vec<Entry>,
        cancel: &CancellationToken,
    ) -> Result<bool> {
        let partition = self.shared.id;
        let mut full_since = None;
        loop {
            let run = Run {
                shared: self.shared.clone(),
                store: self.store.clone(),
                leader: self.leader.clone(),
                applied: self.applied,
                time: self.time,
            };
            // On an apply-pool thread (see `apply_pool`): blocking here holds up
            // no other task.
            match run.apply(&entries) {
                Err(Error::StoreDiskFull { source, .. }) => {
                    if full_since.is_none() {
                        warn!(%partition, from = %self.applied.next(), "the partition store's disk \
                              is full; applying the log waits until there is room again: {source}");
                        full_since = Some(std::time::Instant::now());
                    }
                    self.shared.set_store_full(Some(source));
                    tokio::select! {
                        () = tokio::time::sleep(STORE_FULL_RETRY) => {}
                        Some(request) = self.exports.recv() => self.export(request).await,
                        () = cancel.cancelled() => return Ok(false),
                    }
                }
                Err(err) => return Err(err),
                Ok(applied) => {
                    if let Some(since) = full_since {
                        info!(%partition, lsn = %applied.lsn, waited_ms = since.elapsed().as_millis() as u64,
                              "the partition store accepts writes again; applying the log resumes");
                        self.shared.set_store_full(None);
                    }
                    self.applied = applied.lsn;
                    self.leader = applied.leader;
                    self.time = applied.time;
                    self.refresh_expiry_horizon();
                    // Records the run did not reach (it stopped at a bad one) are not applied.
                    return match applied.stopped {
                        Some(err) => Err(err),
                        None => Ok(true),
                    };
                }
            }
            // Only a full disk loops, and it applied nothing: the same records again.
        }
    }

    /// Moves the compaction filter's horizon up to the partition time of what the store has on
    /// disk (see ARCHITECTURE.md, *Expiry*), at most every [`HORIZON_REFRESH`] (the first call
    /// always). A failed read only leaves the horizon where it is: expired values then wait
    /// longer.
    fn refresh_expiry_horizon(&mut self) {
        if self
            .horizon_refreshed
            .is_some_and(|at| at.elapsed() < HORIZON_REFRESH)
        {
            return;
        }
        self.horizon_refreshed = Some(std::time::Instant::now());
        match self.store.persisted_partition_time() {
            Ok(time) => self.store.set_expiry_horizon(time),
            Err(err) => {
                warn!(partition = %self.shared.id, "cannot read the persisted partition \
                      time; expired values are not reclaimed meanwhile: {err}")
            }
        }
    }

    async fn export(&mut self, request: ExportRequest) {
        let partition = self.shared.id;
        // On an apply-pool thread, like the runs.
        let exported = self
            .store
            .export(&request.target_dir)
            .map_err(|err| store_error(partition, "export column family", err));
        // The requester may have given up; the export folder is then cleaned up at next start.
        let _ = request.reply.send(exported);
    }
}

/// Where a run of records left the partition.
struct Applied {
    lsn: Lsn,
    leader: Option<LeaderState>,
    time: u64,
    /// Why the run stopped before its last record, if it did: the records before that one are
    /// applied, it and the ones after it are not.
    stopped: Option<Error>,
}

/// A run of records to apply together, with the state the processor is in before the first.
struct Run {
    shared: Arc<Shared>,
    store: PartitionStore,
    leader: Option<LeaderState>,
    applied: Lsn,
    time: u64,
}

/// Writes of the run so far, by key (`None`: deleted): what a later record of the same run that
/// reads a key must see, since the store itself only sees them once the whole batch commits.
#[derive(Default)]
struct Overlay {
    values: HashMap<Bytes, Option<StoredValue>>,
    /// Keys whose latest write in the run was a conditional one: written to the batch once, at
    /// the end of the run, so that many operations on one key (10,000 `EXPIRE`s of a 1 MiB value)
    /// write its value once rather than once each.
    deferred: HashSet<Bytes>,
}

impl Overlay {
    /// A write that went to the batch as it was applied. Only keys that some record of the run
    /// decides by (those in `stored`) are kept: no other record of the run reads the rest, and a
    /// deferred write is only ever of such a key. So a run of plain puts keeps nothing here.
    fn written(
        &mut self,
        key: Bytes,
        state: Option<StoredValue>,
        stored: &HashMap<Bytes, Option<StoredValue>>,
    ) {
        if !stored.contains_key(&key) {
            return;
        }
        self.deferred.remove(&key);
        self.values.insert(key, state);
    }

    /// A write that goes to the batch at the end of the run.
    fn defer(&mut self, key: Bytes, state: Option<StoredValue>) {
        self.deferred.insert(key.clone());
        self.values.insert(key, state);
    }

    /// Adds the deferred writes to `batch`, after everything else the run wrote.
    fn write_deferred(&mut self, batch: &mut PartitionWriteBatch) {
        for key in self.deferred.drain() {
            match self.values.get(&key).cloned().flatten() {
                Some(value) => batch.put(&key, &value.value, value.expires_at_ms),
                None => batch.delete(&key),
            }
        }
    }
}

/// The value `key` holds at `now_ms` as the run has left it so far: the run's own writes first,
/// then what the store held before the run.
fn live_value(
    key: &Bytes,
    overlay: &Overlay,
    stored: &HashMap<Bytes, Option<StoredValue>>,
    now_ms: u64,
) -> Option<StoredValue> {
    overlay
        .values
        .get(key)
        .or_else(|| stored.get(key))
        .cloned()
        .flatten()
        .filter(|v| v.is_live_at(now_ms))
}

/// The expiry `expiry` asks for, for a record applied at `now` over `current`.
fn expiry_at(expiry: Expiry, now: u64, current: Option<&StoredValue>) -> Option<u64> {
    match expiry {
        Expiry::Never => None,
        Expiry::After(ms) => Some(now.saturating_add(ms)),
        Expiry::At(at) => Some(at),
        Expiry::Keep => current.and_then(|v| v.expires_at_ms),
    }
}

/// Whether `op`'s condition holds over `current` (the key's live value, if any).
fn condition_holds(op: &WriteOp, current: Option<&StoredValue>, now: u64) -> bool {
    let new_expiry = || match &op.action {
        Action::Set { expiry, .. } | Action::Expire { expiry } => expiry_at(*expiry, now, current),
        Action::Delete => None,
    };
    // No expiry is later than any expiry.
    let later = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (None, None) => false,
        (None, Some(_)) => true,
        (Some(_), None) => false,
        (Some(a), Some(b)) => a > b,
    };
    match (op.condition, current) {
        (Condition::Always, _) => true,
        (Condition::IfAbsent, current) => current.is_none(),
        (_, None) => false,
        (Condition::IfPresent, Some(_)) => true,
        (Condition::IfNoExpiry, Some(v)) => v.expires_at_ms.is_none(),
        (Condition::IfHasExpiry, Some(v)) => v.expires_at_ms.is_some(),
        (Condition::IfLater, Some(v)) => later(new_expiry(), v.expires_at_ms),
        (Condition::IfEarlier, Some(v)) => later(v.expires_at_ms, new_expiry()),
        (Condition::IfHasEarlierExpiry, Some(v)) => {
            v.expires_at_ms.is_some() && later(v.expires_at_ms, new_expiry())
        }
    }
}

/// What `op` leaves of the key over `current`: `None` if it does nothing (changing the expiry of
/// an absent key), else the key's new state (`Some(None)`: deleted). An expiry at or before `now`
/// deletes the key.
fn effect(op: &WriteOp, current: Option<&StoredValue>, now: u64) -> Option<Option<StoredValue>> {
    let value = match &op.action {
        Action::Set { value, expiry } => Some(StoredValue {
            value: value.clone(),
            expires_at_ms: expiry_at(*expiry, now, current),
        }),
        Action::Expire { expiry } => Some(StoredValue {
            value: current?.value.clone(),
            expires_at_ms: expiry_at(*expiry, now, current),
        }),
        Action::Delete => None,
    };
    Some(value.filter(|v| v.is_live_at(now)))
}

/// Applies the operations of a [`Command::Write`] at `now` over what the run has left so far.
/// With `all_or_nothing`, the conditions are checked against the state before the record and
/// the operations are tried on a scratch copy of the keys they touch first: all of them apply,
/// or none does.
fn apply_write(
    ops: &[WriteOp],
    all_or_nothing: bool,
    now: u64,
    overlay: &mut Overlay,
    stored: &HashMap<Bytes, Option<StoredValue>>,
) -> Vec<WriteResult> {
    if all_or_nothing {
        let mut scratch: HashMap<&Bytes, Option<StoredValue>> = HashMap::new();
        let all_apply = ops.iter().all(|op| {
            let before = live_value(&op.key, overlay, stored, now);
            let current = match scratch.get(&op.key) {
                Some(state) => state.clone(),
                None => before.clone(),
            };
            match effect(op, current.as_ref(), now) {
                Some(state) if condition_holds(op, before.as_ref(), now) => {
                    scratch.insert(&op.key, state);
                    true
                }
                _ => false,
            }
        });
        if !all_apply {
            return ops
                .iter()
                .map(|op| {
                    let current = live_value(&op.key, overlay, stored, now);
                    WriteResult {
                        applied: false,
                        existed: current.is_some(),
                        old: current.filter(|_| op.return_old).map(|v| v.value),
                    }
                })
                .collect();
        }
    }
    ops.iter()
        .map(|op| {
            let current = live_value(&op.key, overlay, stored, now);
            let holds = all_or_nothing || condition_holds(op, current.as_ref(), now);
            let applied = match effect(op, current.as_ref(), now) {
                Some(state) if holds => {
                    overlay.defer(op.key.clone(), state);
                    true
                }
                _ => false,
            };
            WriteResult {
                applied,
                existed: current.is_some(),
                old: current.filter(|_| op.return_old).map(|v| v.value),
            }
        })
        .collect()
}

impl Run {
    /// Applies `entries` (which start right after the applied LSN) in one write batch: their
    /// effects and the new applied LSN are committed together, then their callers are answered.
    /// Stops at the first record that cannot be applied without diverging, committing the ones
    /// before it. Fails with [`Error::StoreDiskFull`] having applied nothing.
    fn apply(mut self, entries: &[Entry]) -> Result<Applied> {
        let partition = self.shared.id;
        let (applied_before, time_before) = (self.applied, self.time);
        let mut batch = self.store.write_batch();
        let mut overlay = Overlay::default();
        // Decoded once: for the lookups ahead of the run and for applying.
        let decoded: Vec<Result<Vec<Envelope>, DecodeError>> = entries
            .iter()
            .map(|entry| Envelope::decode_record_shared(&entry.payload))
            .collect();
        let stored = self.read_keys_to_decide(&decoded)?;
        let mut answers = Vec::with_capacity(entries.len());
        let mut announced = false;
        let mut stopped = None;
        for (entry, envelopes) in entries.iter().zip(decoded) {
            match self.check_record(entry.lsn, envelopes) {
                Ok(envelopes) => {
                    for envelope in envelopes {
                        let (origin, outcome) =
                            self.apply_one(entry.lsn, envelope, &mut batch, &mut overlay, &stored);
                        announced |= matches!(outcome, Ok(Outcome::Announced));
                        if let Some(origin) = origin {
                            answers.push((origin, outcome));
                        }
                    }
                    self.applied = entry.lsn;
                }
                Err(err) => {
                    stopped = Some(err);
                    break;
                }
            }
        }
        // Also when the records changed nothing (insert-if-absent of keys already there, fenced
        // records): the applied LSN must move in the store too, or a trim up to what the
        // partition applied would leave the store behind the log's trim point after a restart.
        overlay.write_deferred(&mut batch);
        if self.applied > applied_before {
            batch.set_applied_lsn(self.applied);
            if self.time != time_before {
                batch.set_partition_time(self.time);
            }
            self.store.commit(batch).map_err(|err| {
                if err.is_disk_full() {
                    Error::StoreDiskFull {
                        partition,
                        source: Arc::new(err),
                    }
                } else {
                    store_error(partition, "apply records", err)
                }
            })?;
        }
        if announced {
            self.shared.leader.send_replace(self.leader.clone());
        }
        self.shared.set_time(self.time);
        self.shared.applied.send_replace(self.applied);
        for (origin, outcome) in answers {
            self.shared.complete(&origin, outcome);
        }
        Ok(Applied {
            lsn: self.applied,
            leader: self.leader,
            time: self.time,
            stopped,
        })
    }

    /// What the store holds for every key whose outcome a record of the run decides by its
    /// current value (insert-if-absent, conditional writes), in one batched lookup before
    /// anything is applied.
    fn read_keys_to_decide(
        &self,
        records: &[Result<Vec<Envelope>, DecodeError>],
    ) -> Result<HashMap<Bytes, Option<StoredValue>>> {
        let mut keys: Vec<Bytes> = Vec::new();
        let mut asked = HashSet::new();
        let mut ask = |key: &Bytes| {
            if asked.insert(key.clone()) {
                keys.push(key.clone());
            }
        };
        // A record that does not decode is reported where the run reaches it.
        for envelope in records.iter().flatten().flatten() {
            match &envelope.command {
                Command::InsertIfAbsent { keys, .. } => keys.iter().for_each(&mut ask),
                Command::Write { ops, .. } => ops.iter().for_each(|op| ask(&op.key)),
                _ => {}
            }
        }
        if keys.is_empty() {
            return Ok(HashMap::new());
        }
        let values = self
            .store
            .multi_get(&keys)
            .map_err(|err| store_error(self.shared.id, "read keys", err))?;
        Ok(keys.into_iter().zip(values).collect())
    }

    /// The envelopes of the record at `lsn`, once it is known that applying them continues
    /// this store's history; else why the partition must stop before this record.
    fn check_record(
        &self,
        lsn: Lsn,
        envelopes: Result<Vec<Envelope>, DecodeError>,
    ) -> Result<Vec<Envelope>> {
        let partition = self.shared.id;
        if lsn != self.applied.next() {
            // Applying it would diverge: at best a record applied twice, at worst different
            // records at LSNs already applied.
            return Err(Error::Stopped {
                partition,
                reason: format!(
                    "the log returned LSN {lsn} where {} was expected (the store has applied up \
                     to LSN {}); restart the node, and if this repeats restore the partition \
                     from a snapshot",
                    self.applied.next(),
                    self.applied
                ),
            });
        }
        let envelopes = envelopes.map_err(|err| Error::Stopped {
            partition,
            reason: format!("record at LSN {lsn} cannot be decoded: {err}"),
        })?;
        // Every epoch's records follow its announcement in the log, so a record of a newer
        // epoch than any this store applied means the store does not continue this log's
        // history (restored from a snapshot of records the log has since lost). Skipping it
        // as fenced would silently drop acknowledged writes. Checked for every envelope of a
        // batch before any of them is applied, so a batch is applied whole or not at all.
        let mut epoch = self.leader.as_ref().map(|l| l.epoch);
        for envelope in &envelopes {
            match envelope.command {
                Command::AnnounceLeader {
                    epoch: announced, ..
                } if epoch.is_none_or(|current| announced > current) => epoch = Some(announced),
                Command::AnnounceLeader { .. } => {}
                _ if epoch.is_none_or(|current| envelope.header.epoch > current) => {
                    return Err(self.not_this_history(lsn, envelope.header.epoch));
                }
                _ => {}
            }
        }
        Ok(envelopes)
    }

    /// Adds one envelope's effects to `batch` (its record checked by [`Run::check_record`]).
    /// Returns who proposed it (if anyone) and what to answer them.
    fn apply_one(
        &mut self,
        lsn: Lsn,
        envelope: Envelope,
        batch: &mut PartitionWriteBatch,
        overlay: &mut Overlay,
        stored: &HashMap<Bytes, Option<StoredValue>>,
    ) -> (Option<Origin>, Result<Outcome>) {
        let partition = self.shared.id;
        let header = envelope.header;
        // The partition's time never goes back, whatever the clock of the leader that stamped
        // the record: every replica computes the same from the same records, and a value that
        // expired before it stays expired for every later record (see ARCHITECTURE.md, *Expiry*).
        let now = header.timestamp_ms.max(self.time);
        let outcome = match envelope.command {
            Command::AnnounceLeader { epoch, node } => {
                if self.leader.as_ref().is_none_or(|l| epoch > l.epoch) {
                    info!(%partition, %lsn, %epoch, %node, "leader announced");
                    let leader = LeaderState { epoch, node };
                    batch.set_leader(&leader);
                    self.leader = Some(leader);
                    self.time = now;
                    Ok(Outcome::Announced)
                } else {
                    Err(self.fenced())
                }
            }
            // A newer epoch than the current one was refused by `check_record`.
            _ if self.leader.as_ref().map(|l| l.epoch) != Some(header.epoch) => {
                debug!(%partition, %lsn, epoch = %header.epoch, "skipping record of another epoch");
                Err(self.fenced())
            }
            Command::Put { entries } => {
                self.time = now;
                for entry in entries {
                    let expiry = entry.ttl_ms.map(|t| now.saturating_add(t));
                    batch.put(&entry.key, &entry.value, expiry);
                    overlay.written(
                        entry.key,
                        Some(StoredValue {
                            value: entry.value,
                            expires_at_ms: expiry,
                        }),
                        stored,
                    );
                }
                Ok(Outcome::Done)
            }
            Command::Delete { keys } => {
                self.time = now;
                for key in keys {
                    batch.delete(&key);
                    overlay.written(key, None, stored);
                }
                Ok(Outcome::Done)
            }
            Command::InsertIfAbsent {
                keys,
                value,
                ttl_ms,
            } => {
                self.time = now;
                let expiry = ttl_ms.map(|t| now.saturating_add(t));
                let mut seen = HashSet::with_capacity(keys.len());
                let mut inserted = Vec::with_capacity(keys.len());
                for key in keys {
                    let absent = seen.insert(key.clone())
                        && live_value(&key, overlay, stored, now).is_none();
                    if absent {
                        batch.put(&key, &value, expiry);
                        overlay.written(
                            key,
                            Some(StoredValue {
                                value: value.clone(),
                                expires_at_ms: expiry,
                            }),
                            stored,
                        );
                    }
                    inserted.push(absent);
                }
                Ok(Outcome::Inserted(inserted))
            }
            Command::Write {
                ops,
                all_or_nothing,
            } => {
                self.time = now;
                let results = apply_write(&ops, all_or_nothing, now, overlay, stored);
                Ok(Outcome::Written(results))
            }
        };
        (header.origin, outcome)
    }

    fn not_this_history(&self, lsn: Lsn, epoch: cairn_types::Epoch) -> Error {
        let partition = self.shared.id;
        Error::Stopped {
            partition,
            reason: format!(
                "the record at LSN {lsn} is of epoch {epoch}, whose announcement this store \
                 never applied (its leader epoch is {}): the store does not continue this log's \
                 history, as when it was restored from a snapshot of records the log has since \
                 lost. Nothing was skipped. Restore the partition from an older snapshot \
                 (`cairnctl partitions restore -p {partition} --snapshot <id>`), or stop the \
                 node, run `cairn drop-partition -p {partition}` and start it to rebuild the \
                 store from the log",
                self.leader
                    .as_ref()
                    .map_or_else(|| "none".to_string(), |l| l.epoch.to_string()),
            ),
        }
    }

    fn fenced(&self) -> Error {
        Error::Fenced {
            partition: self.shared.id,
            current: self.leader.as_ref().map(|l| l.epoch).unwrap_or_default(),
        }
    }
}

pub(crate) fn store_error(
    partition: cairn_types::PartitionId,
    context: &'static str,
    err: cairn_partition_store::Error,
) -> Error {
    Error::Storage {
        partition,
        context,
        source: err.into(),
    }
}

pub(crate) fn log_error(
    partition: cairn_types::PartitionId,
    context: &'static str,
    err: impl Into<Arc<cairn_log::Error>>,
) -> Error {
    Error::Log {
        partition,
        context,
        source: err.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_of_large_records_read_fewer_records() {
        let behind = |average| RoundSize {
            average,
            behind: true,
        };
        assert_eq!(RoundSize::start().records(), READ_BATCH_RECORDS_MAX);
        assert_eq!(behind(100).records(), READ_BATCH_RECORDS_MAX);
        // 1 MiB records: 64 per round.
        assert_eq!(behind(1 << 20).records(), 64);
        // Records larger than the target: one at a time.
        assert_eq!(behind(100 << 20).records(), 1);
    }

    #[test]
    fn only_rounds_behind_the_log_take_from_the_budget_what_they_may_hold() {
        let round = |average, behind| RoundSize { average, behind };
        // Nothing known yet: a full round's worth.
        assert_eq!(RoundSize::start().budget_mib(), 64);
        // 1024 records of 10 KiB: 10 MiB.
        assert_eq!(round(10 << 10, true).budget_mib(), 10);
        // Small records: at least 1 MiB.
        assert_eq!(round(100, true).budget_mib(), 1);
        assert_eq!(round(1 << 20, true).budget_mib(), 64);
        // At the tail: nothing, and rounds of about 1 MiB.
        assert_eq!(round(10 << 10, false).budget_mib(), 0);
        assert_eq!(round(10 << 10, false).records(), 102);
        assert_eq!(round(4 << 20, false).records(), 1);
    }

    #[test]
    fn a_round_that_got_all_it_asked_for_is_behind() {
        let entry = |bytes: usize| Entry {
            lsn: Lsn(1),
            payload: Bytes::from(vec![0u8; bytes]),
        };
        let tail = RoundSize::start().after(1024, &[entry(100), entry(300)]);
        assert_eq!(
            tail,
            RoundSize {
                average: 200,
                behind: false
            }
        );
        let behind = tail.after(2, &[entry(100), entry(100)]);
        assert!(behind.behind);
        // An empty read keeps what was known of the records' sizes.
        assert_eq!(behind.after(5, &[]).average, 100);
        assert!(!behind.after(5, &[]).behind);
    }
}
