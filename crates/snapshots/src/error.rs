//! The crate's error type. Every variant says what went wrong with which snapshot, file or object,
//! so the message alone tells an operator what to look at. Messages name buckets, prefixes and
//! object keys, never credentials.

use crate::{ClusterIdentity, SnapshotId};
use cairn_types::{Lsn, PartitionId};
use std::fmt;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("snapshot id must look like snap_1…: {input:?}: {reason}")]
    InvalidSnapshotId { input: String, reason: &'static str },

    #[error("snapshot destination {destination:?} cannot be used: {reason}")]
    InvalidDestination { destination: String, reason: String },

    #[error("snapshot destination {destination:?} cannot be used: {source}")]
    UnusableStore {
        destination: String,
        #[source]
        source: object_store::Error,
    },

    #[error("snapshot repository options are invalid: {reason}")]
    InvalidOptions { reason: String },

    #[error(
        "{location} has version {found}, but this build reads V1 only: upgrade Cairn to read it"
    )]
    UnsupportedVersion { location: String, found: String },

    #[error("{location} is malformed: {reason}")]
    MalformedMetadata { location: String, reason: String },

    #[error("{location} is malformed: {source}")]
    UndecodableMetadata {
        location: String,
        #[source]
        source: serde_json::Error,
    },

    #[error(
        "snapshot {snapshot_id} is not in the repository at {destination}: no partition's \
         latest.json retains it"
    )]
    SnapshotNotFound {
        snapshot_id: SnapshotId,
        destination: String,
    },

    /// The snapshot is retained, but by another cluster sharing the repository (one of the same
    /// name re-created on a reset base dir): its LSNs name other records, so this cluster does
    /// not use it.
    #[error(
        "snapshot {snapshot_id} (partition {partition}) in the repository at {destination} was \
         taken by another cluster sharing it ({}), not by this one ({ours}); a cluster never \
         verifies, exports or restores another's snapshots: `cairnctl snapshots list` shows this \
         cluster's",
        .theirs.as_ref().as_ref().map_or_else(|| "one that did not record its identity".to_string(), |c| c.to_string())
    )]
    SnapshotOfAnotherCluster {
        snapshot_id: SnapshotId,
        partition: PartitionId,
        destination: String,
        /// Boxed, as they are rare and would make every `Result` of this crate larger.
        theirs: Box<Option<crate::ClusterIdentity>>,
        ours: Box<crate::ClusterIdentity>,
    },

    /// `find` did not find the snapshot, but some partitions could not be searched.
    #[error(
        "snapshot {snapshot_id} is not in any readable partition of the repository at \
         {destination}; the latest.json of partition(s) {} could not be read (it may be \
         there): {source}", comma_separated(.partitions)
    )]
    SnapshotNotFoundInReadable {
        snapshot_id: SnapshotId,
        destination: String,
        partitions: Vec<PartitionId>,
        /// Why the first of them could not be read.
        #[source]
        source: Box<Error>,
    },

    #[error(
        "{location} is larger than the {limit} bytes Cairn reads for {what} (at least {size} \
         bytes): Cairn did not write it; put back the one Cairn wrote, from a backup (removing \
         it would hide the snapshots it names)"
    )]
    TooLarge {
        location: String,
        size: u64,
        limit: u64,
        what: &'static str,
    },

    #[error(
        "snapshot {snapshot_id} was made by cluster {found_cluster:?} created at \
         {found_created_at:?}, but this repository is opened for {repository_cluster}: a node \
         publishes only its own cluster's snapshots"
    )]
    ForeignSnapshot {
        snapshot_id: SnapshotId,
        found_cluster: String,
        found_created_at: Option<String>,
        repository_cluster: ClusterIdentity,
    },

    #[error(
        "partition {partition}'s latest.json changed while snapshot {snapshot_id} was being \
         published: another publisher won, and this snapshot stays invisible; take a new snapshot \
         to publish again"
    )]
    Conflict {
        partition: PartitionId,
        snapshot_id: SnapshotId,
    },

    #[error(
        "snapshot {snapshot_id} of partition {partition} covers LSN {min_applied_lsn}, older than \
         the latest snapshot {latest_snapshot_id} at LSN {latest_lsn}: refusing to publish it \
         over a newer one"
    )]
    OlderThanLatest {
        partition: PartitionId,
        snapshot_id: SnapshotId,
        min_applied_lsn: Lsn,
        latest_snapshot_id: SnapshotId,
        latest_lsn: Lsn,
    },

    #[error("snapshot {snapshot_id} of partition {partition} is already published")]
    AlreadyPublished {
        partition: PartitionId,
        snapshot_id: SnapshotId,
    },

    #[error("export file {path} cannot be published: {reason}")]
    BadExport { path: PathBuf, reason: String },

    #[error("snapshot {snapshot_id}: file {name} (object {key}) {problem}")]
    BadFile {
        snapshot_id: SnapshotId,
        name: String,
        key: String,
        problem: FileProblem,
    },

    #[error("cannot {context} {path}: {source}")]
    Io {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot {context} {location}: {source}")]
    ObjectStore {
        context: &'static str,
        /// The object's full address, e.g. `s3://bucket/prefix/1/latest.json`.
        location: String,
        #[source]
        source: object_store::Error,
    },

    #[error(
        "{location} is missing, although latest.json retains snapshot {snapshot_id}: the \
         repository was changed behind Cairn's back"
    )]
    MetadataMissing {
        location: String,
        snapshot_id: SnapshotId,
    },

    #[error(
        "partition {partition}'s latest.json changed while its snapshot garbage was being \
         collected, so nothing was deleted: another publisher is at work; collect again later"
    )]
    LatestChangedDuringGc { partition: PartitionId },

    /// The fence ([`crate::GcFence`]) said, just before a collection would have deleted
    /// anything, that this node may no longer delete the partition's objects (it no longer leads
    /// the partition at the epoch it published under): nothing was deleted.
    #[error(
        "partition {partition}: snapshot garbage collection stopped before deleting anything: \
         {source}"
    )]
    GcFenced {
        partition: PartitionId,
        source: cairn_types::Fenced,
    },

    /// Publish stopped on purpose after `step` because `PublishOptions::stop_after` asked it to:
    /// fault tests use it to stand for a crash at that point.
    #[cfg(feature = "test-util")]
    #[error("publishing stopped after step {step:?} as asked")]
    StoppedAfter {
        step: crate::repository::PublishStep,
    },
}

/// What is wrong with one file of a snapshot in the repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileProblem {
    Missing,
    SizeMismatch {
        expected: u64,
        actual: u64,
    },
    ChecksumMismatch {
        expected: String,
        actual: String,
    },
    /// The object holds more bytes than the file's declared size; reading stopped one byte past
    /// it.
    TooLarge {
        expected: u64,
    },
    /// metadata.json lacks the checksum or object key that publishing writes.
    NotPublished,
}

impl fmt::Display for FileProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FileProblem::Missing => write!(f, "is missing from the repository"),
            FileProblem::SizeMismatch { expected, actual } => {
                write!(f, "has size {actual}, expected {expected}")
            }
            FileProblem::ChecksumMismatch { expected, actual } => {
                write!(
                    f,
                    "has checksum {actual}, expected {expected} (checksum mismatch)"
                )
            }
            FileProblem::TooLarge { expected } => {
                write!(
                    f,
                    "is larger than its declared size of {expected} bytes (reading stopped there)"
                )
            }
            FileProblem::NotPublished => {
                write!(f, "has no checksum or object key in metadata.json")
            }
        }
    }
}

impl Error {
    /// Whether trying the same operation again may succeed: network and server trouble, not a
    /// missing object, a failed precondition or refused credentials.
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            Error::ObjectStore { source, .. } => matches!(
                source,
                object_store::Error::Generic { .. } | object_store::Error::JoinError { .. }
            ),
            _ => false,
        }
    }
}

fn comma_separated(partitions: &[PartitionId]) -> String {
    partitions
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
