//! Partition processors and the paths through which a partition's leader serves requests.
//!
//! A [`Partition`] ties together one partition's log and its store. Its processor task reads the
//! log in LSN order and applies every record to the store in one write batch with the applied LSN.
//! The leader proposes commands by appending epoch-stamped records and answers the caller only
//! once its own processor has applied the record, so every answer comes from the state machine.
//! Proposals that meet while an append is in flight share the next record (`append`).
//!
//! Architecture invariant: the worker does not know how records travel (any [`cairn_log::Loglet`])
//! nor who decides leadership (the caller hands it an epoch). It knows nothing of gRPC.

mod append;
mod apply_pool;
mod clock;
mod compaction;
mod partition;
mod processor;
mod restore;
mod snapshot;
pub mod testing;

pub use apply_pool::set_apply_threads;
pub use clock::{Clock, ManualClock, SystemClock};
pub use compaction::{Compacted, ExpirySample, StoreStatus};
pub use partition::{
    CATCH_UP_LIMIT, LEAD_STALL_MAX, Partition, PartitionStatus, ReadShare, read_shares,
};
pub use processor::Outcome;
pub use restore::{
    RestoreFailure, RestoreProgressFn, RestoreStep, Restored, Restorer, repair_interrupted_restore,
};
pub use snapshot::{CreatedSnapshot, SnapshotProducer, snapshot_metadata};

use cairn_types::{Epoch, Lsn, NodeId, PartitionId};
use std::sync::Arc;
use std::time::Duration;

/// An error from one of the layers under a partition (store, log, repository, file system, a
/// blocking task): callers that act on its kind downcast it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// This node does not lead the partition; `leader` is who does, if known.
    #[error("partition {partition}: this node is not its leader (leader: {})", leader.as_ref().map_or("unknown".to_string(), |l| l.to_string()))]
    NotLeader {
        partition: PartitionId,
        leader: Option<NodeId>,
    },
    /// This node leads the partition but may not serve it now: its leader's lease has run out
    /// (it could not renew it in time) or was given up. Nothing was done.
    #[error("partition {partition}: this node may not serve it now: {reason}")]
    LeaseLapsed {
        partition: PartitionId,
        reason: String,
    },
    /// The leader's lease ran out while the request's record was being appended: it may or may
    /// not be in the log, and a later leader decides. Read the keys to know.
    #[error(
        "partition {partition}: the request's outcome is unknown: it was being written to the \
         log when {reason}; a new leader applies it or not: read the keys to know"
    )]
    LapsedInFlight {
        partition: PartitionId,
        reason: String,
    },
    /// The record was appended but skipped: a newer leader had taken over by the time it was
    /// applied. Nothing it asked for happened.
    #[error("partition {partition}: request was fenced by a newer leader epoch {current}")]
    Fenced {
        partition: PartitionId,
        current: Epoch,
    },
    /// The request's record is in the log, but the partition stopped before applying it: a
    /// later leader applies it, so the request may or may not take effect. A retry is not the
    /// same request (an insert-if-absent retried would answer for the first attempt's insert).
    #[error(
        "partition {partition}: the request was written to the log at LSN {lsn}, but it was not \
         applied before this answer ({reason}); it may still take effect: read the keys to know"
    )]
    Undecided {
        partition: PartitionId,
        lsn: Lsn,
        reason: String,
    },
    /// The processor stopped and the partition serves nothing until an operator acts.
    #[error("partition {partition} is stopped: {reason}")]
    Stopped {
        partition: PartitionId,
        reason: String,
    },
    /// The partition store failed `context`: a [`cairn_partition_store::Error`], or the
    /// blocking task that ran it failed.
    #[error("partition {partition}: {context}: {source}")]
    Storage {
        partition: PartitionId,
        context: &'static str,
        #[source]
        source: BoxError,
    },
    /// Creating a snapshot failed at `context`. The source is what failed: the repository
    /// ([`cairn_snapshots::Error`], whose `ObjectStore` kind is worth a retry), the log
    /// ([`cairn_log::Error`]), the file system ([`std::io::Error`]), or a sentence saying why the
    /// request cannot be served.
    #[error("partition {partition}: {context}: {source}")]
    Snapshot {
        partition: PartitionId,
        context: &'static str,
        #[source]
        source: BoxError,
    },
    /// Restoring from the snapshot repository failed; the failure says what was tried.
    #[error("partition {partition}: cannot restore from a snapshot: {failure}")]
    Restore {
        partition: PartitionId,
        #[source]
        failure: RestoreFailure,
    },
    #[error("partition {partition}: cannot trim the log to {requested}: {reason}")]
    TrimRefused {
        partition: PartitionId,
        requested: Lsn,
        reason: String,
    },
    /// The log refused or failed `context`. Its kind tells the caller what to do:
    /// [`cairn_log::Error::is_disk_full`] (free space and retry), [`cairn_log::Error::Trimmed`]
    /// (the records are gone), or a failing device. Shared: the proposals appended together in
    /// one record all fail with the one error of its append.
    #[error("partition {partition}: {context}: {source}")]
    Log {
        partition: PartitionId,
        context: &'static str,
        #[source]
        source: Arc<cairn_log::Error>,
    },
    /// The store has applied records that its log no longer holds (the log lost its end to a
    /// disk or file-system fault). Continuing would apply different records at those LSNs.
    #[error(
        "partition {partition}: its store has applied the log up to LSN {applied}, but the log \
         ends at LSN {tail}: records {}..={applied} were lost from the log (a disk or \
         file-system fault), so the partition is stopped rather than serve different records at \
         those LSNs. To keep what the store holds, stop the node and run `cairn repair-log -p \
         {partition}` with the node's base dir (a local log): it moves the log's trim point up to \
         LSN {applied}, and nothing is lost. Or restore it from a snapshot with `cairnctl \
         partitions restore -p {partition}`, which needs a snapshot at LSN {tail} or earlier and \
         replays the log after \
         it, or accept losing records {}..={applied}: stop the node, run `cairn drop-partition \
         -p {partition}` with the node's base dir (its --base-dir or configuration) and start it \
         again, which rebuilds the store from the log (and from a snapshot if the log is trimmed) without them",
        tail.next(),
        tail.next()
    )]
    StoreAheadOfLog {
        partition: PartitionId,
        applied: Lsn,
        tail: Lsn,
    },
    /// A read's values add up to more than one answer may carry; it stopped there.
    #[error(
        "the values of these {keys} keys add up to more than {bytes_max} bytes, the limit for \
         one answer; split the request and ask for fewer keys at a time"
    )]
    AnswerTooLarge { keys: usize, bytes_max: usize },
    /// The disk holding the partition store is full: the store refuses writes until there is
    /// room again. The partition keeps serving reads, and applies its log and accepts writes
    /// again by itself once RocksDB resumes.
    #[error(
        "partition {partition}: the disk holding the partition store is full ({source}); free \
         space on it: the partition applies its log and accepts writes again by itself once \
         at least 64 MiB are free there (RocksDB's threshold to resume writing); reads are \
         served meanwhile"
    )]
    StoreDiskFull {
        partition: PartitionId,
        #[source]
        source: Arc<cairn_partition_store::Error>,
    },
    /// A table file of the partition's store failed its block checksums when a snapshot was to
    /// be taken: no snapshot was taken (one would carry the damage into the repository, where
    /// its object checksums would vouch for it), and so no trim it would have allowed.
    #[error(
        "partition {partition}: no snapshot was taken, because its store is damaged ({source}). \
         {remedy}, and check the disk under the node's base dir"
    )]
    StoreDamaged {
        partition: PartitionId,
        #[source]
        source: Box<cairn_partition_store::Error>,
        /// How to rebuild the partition: from its snapshots, or from its log alone.
        remedy: String,
    },
    /// A read that accepts a bounded staleness could not be served by this replica: it could
    /// not show, within [`CATCH_UP_LIMIT`], that it holds every write acknowledged more than
    /// `max_staleness` ago (its leader's read index could not be had, or the replica is behind
    /// it). Nothing was done; the partition's leader can serve it.
    #[error(
        "partition {partition}: this replica cannot show it is at most {}ms behind its leader: \
         {reason}",
        max_staleness.as_millis()
    )]
    TooStale {
        partition: PartitionId,
        max_staleness: Duration,
        reason: String,
    },
    /// Waiting for the processor made no progress for `waited`.
    #[error(
        "partition {partition}: {what} made no progress for {}s (applied LSN {applied}, log \
         tail {tail}); its processor is stuck: see the node's log for why, then restart the node \
         or restore the partition with `cairnctl partitions restore -p {partition}`",
        waited.as_secs()
    )]
    TimedOut {
        partition: PartitionId,
        what: &'static str,
        waited: Duration,
        applied: Lsn,
        tail: Lsn,
    },
}

impl Error {
    /// Whether the snapshot repository's object store failed (unreachable, throttling, refusing
    /// credentials) anywhere in this error's chain of sources: worth a retry, unlike a snapshot
    /// the repository holds but that cannot be used.
    pub fn is_repository_unavailable(&self) -> bool {
        std::iter::successors(Some(self as &dyn std::error::Error), |e| e.source()).any(|e| {
            matches!(
                e.downcast_ref::<cairn_snapshots::Error>(),
                Some(cairn_snapshots::Error::ObjectStore { .. })
            )
        })
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Asked just before a log trim or a snapshot garbage collection deletes anything: `Ok` if this
/// node still leads `partition` at `epoch` by whoever decides leadership (in a cluster, the
/// metadata store, read afresh), else why not. A deposed leader therefore never trims records
/// nor deletes snapshot files that its successor needs.
pub type LeadershipFence = Arc<
    dyn Fn(
            PartitionId,
            Epoch,
        )
            -> futures::future::BoxFuture<'static, std::result::Result<(), cairn_types::Fenced>>
        + Send
        + Sync,
>;

/// A leader's right to serve, kept by whoever decides leadership (in a cluster, the node's
/// heartbeats to the metadata store renew it): the worker only asks it, before every request it
/// serves as the leader.
pub trait LeaderLease: Send + Sync + 'static {
    /// `Ok` while this node may serve as the partition's leader; else why not, in a sentence.
    fn check(&self) -> std::result::Result<(), String>;
    /// Whether it can never hold again: the leadership must then be taken anew, at a new epoch.
    fn revoked(&self) -> bool;
}

/// Runs `work` (RocksDB or file-system calls) on a blocking thread: on an async thread it would
/// stall every task that thread runs. A task that panicked or was cancelled by the runtime's
/// shut-down is a storage error of `partition` at `context`.
pub async fn blocking<T: Send + 'static>(
    partition: PartitionId,
    context: &'static str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|err| Error::Storage {
            partition,
            context,
            source: err.into(),
        })
}
