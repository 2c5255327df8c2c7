//! Partition processors and the paths through which a partition's leader serves requests.
//!
//! A [`Partition`] ties together one partition's log and its store. Its processor task reads the
//! log in LSN order and applies every record to the store in one write batch with the applied LSN.
//! The leader proposes commands by appending epoch-stamped records and answers the caller only
//! once its own processor has applied the record, so every answer comes from the state machine.
//!
//! Architecture invariant: the worker does not know how records travel (any [`cairn_log::Loglet`])
//! nor who decides leadership (the caller hands it an epoch). It knows nothing of gRPC.

mod clock;
mod partition;
mod processor;
mod restore;
mod snapshot;
pub mod testing;

pub use clock::{Clock, ManualClock, SystemClock};
pub use partition::{LEAD_STALL_MAX, Partition, PartitionStatus};
pub use processor::Outcome;
pub use restore::{RestoreProgressFn, RestoreStep, Restored, Restorer, repair_interrupted_restore};
pub use snapshot::{CreatedSnapshot, SnapshotProducer, snapshot_metadata};

use cairn_types::{Epoch, Lsn, NodeId, PartitionId};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// This node does not lead the partition; `leader` is who does, if known.
    #[error("partition {partition}: this node is not its leader (leader: {})", leader.as_ref().map_or("unknown".to_string(), |l| l.to_string()))]
    NotLeader {
        partition: PartitionId,
        leader: Option<NodeId>,
    },
    /// The record was appended but skipped: a newer leader had taken over by the time it was
    /// applied. Nothing it asked for happened.
    #[error("partition {partition}: request was fenced by a newer leader epoch {current}")]
    Fenced {
        partition: PartitionId,
        current: Epoch,
    },
    /// The processor stopped and the partition serves nothing until an operator acts.
    #[error("partition {partition} is stopped: {reason}")]
    Stopped {
        partition: PartitionId,
        reason: String,
    },
    #[error("partition {partition}: {context}: {message}")]
    Storage {
        partition: PartitionId,
        context: &'static str,
        message: String,
    },
    #[error("partition {partition}: {context}: {message}")]
    Snapshot {
        partition: PartitionId,
        context: &'static str,
        message: String,
    },
    /// Restoring from the snapshot repository failed; the message says what was tried.
    #[error("partition {partition}: cannot restore from a snapshot: {message}")]
    Restore {
        partition: PartitionId,
        message: String,
    },
    #[error("partition {partition}: cannot trim the log to {requested}: {reason}")]
    TrimRefused {
        partition: PartitionId,
        requested: Lsn,
        reason: String,
    },
    /// The log refused or failed `context`. Its kind tells the caller what to do:
    /// [`cairn_log::Error::is_disk_full`] (free space and retry), [`cairn_log::Error::Trimmed`]
    /// (the records are gone), or a failing device.
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
         those LSNs. Either restore it from a snapshot with `cairnctl partitions restore -p \
         {partition}`, which needs a snapshot at LSN {tail} or earlier and replays the log after \
         it, or accept losing records {}..={applied}: stop the node, run `cairn drop-partition \
         -p {partition} --base-dir <its base dir>` and start it again, which rebuilds the store \
         from the log (and from a snapshot if the log is trimmed) without them",
        tail.next(),
        tail.next()
    )]
    StoreAheadOfLog {
        partition: PartitionId,
        applied: Lsn,
        tail: Lsn,
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

pub type Result<T, E = Error> = std::result::Result<T, E>;
