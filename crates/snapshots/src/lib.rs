//! Partition snapshots: their format and the repository that keeps them on an object store.
//!
//! A snapshot is RocksDB's export of one partition's column family (SST files) plus
//! `metadata.json` ([`SnapshotMetadata`]), identified by a [`SnapshotId`]. The
//! [`SnapshotRepository`] publishes snapshots to a local folder or an S3 bucket incrementally (an
//! SST already uploaded by an older snapshot is shared, not uploaded again), lists, verifies,
//! downloads and exports them, and deletes what no retained snapshot needs any more. It is
//! opened for one [`ClusterIdentity`] and counts only that cluster's snapshots, so a cluster
//! re-created under the same name never relies on the old one's. See [`repository`] for the
//! object layout and its guarantees, and [`repository::gc`] for garbage collection.
//!
//! Architecture invariant: this crate knows nothing of RocksDB, logs or gRPC. It takes an export
//! folder and its metadata and gives back files and metadata; producing the export and importing
//! it are the partition store's job. It is the only crate that talks to the object store.

mod cluster;
mod error;
mod id;
mod metadata;
pub mod repository;
#[cfg(feature = "test-util")]
pub mod test_util;

pub use cluster::ClusterIdentity;
pub use error::{Error, FileProblem, Result};
pub use id::SnapshotId;
pub use metadata::{
    Checksum, ChecksumParseError, METADATA_VERSION, MetadataProblem, MetadataVersion, PublishStats,
    SnapshotFile, SnapshotMetadata,
};
pub use repository::{
    DEFAULT_ORPHAN_GRACE, DownloadReport, ExportReport, GcFence, GcOptions, GcReport,
    LATEST_JSON_BYTES_MAX, LatestRead, LatestSnapshot, METADATA_JSON_BYTES_MAX, ProgressFn,
    PublishOptions, PublishReport, RepositoryOptions, RetainedSnapshot, SnapshotListing,
    SnapshotRepository, SnapshotSummary, UnreadablePartition, VerifyReport, redact_destination,
    snapshot_folder,
};
#[cfg(feature = "test-util")]
pub use repository::{PublishStep, UploadReport};
