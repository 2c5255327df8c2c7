//! The snapshot repository: partition snapshots on an object store (a local folder or S3).
//!
//! # Layout
//! ```text
//! [<prefix>/]
//! ├── 0/                                       one folder per partition
//! │   ├── latest.json                          mutable; compare-and-swap only
//! │   ├── snapshots/
//! │   │   ├── fffffffffffffff5_snap_1…/        LSN 10: u64::MAX - 10 in hex sorts first
//! │   │   │   └── metadata.json                immutable
//! │   │   └── fffffffffffffffa_snap_1…/        LSN 5
//! │   │       └── metadata.json                immutable
//! │   └── ssts/
//! │       ├── 3f2a…e1.sst                      immutable; named by the xxh3-128 of its bytes,
//! │       └── 9c04…7b.sst                      shared by every snapshot that holds the file
//! └── 1/
//!     └── …
//! ```
//! A snapshot's folder is `<inverse_lsn>_<snapshot_id>`, where `inverse_lsn` is
//! `u64::MAX - min_applied_lsn` as 16 lower-case hex digits, so that a plain listing (object stores
//! list in ascending order) shows the newest snapshot first. Each `metadata.json` names its SST
//! files by their object key (`ssts/<hash>.sst`, relative to the partition folder).
//!
//! A snapshot is *visible* when the partition's `latest.json` retains it; everything else under
//! `snapshots/` and `ssts/` that no visible snapshot references is garbage. Readers ([`list`],
//! [`find`], [`verify`], [`download`], [`export_tar`]) see visible snapshots only.
//!
//! # One cluster's view
//! A repository is opened for one [`ClusterIdentity`] (cluster name and creation time), and
//! everything it offers for decisions counts only that cluster's snapshots: [`latest`] (hence the
//! archived LSN, the trim guard, the covering-snapshot check and the drop guard of its callers),
//! [`list`], [`find`], and so restore, verify and export; retention evicts only its own
//! snapshots. Another cluster that shares the repository (one of the same name re-created on a
//! reset base dir) keeps its entries in the shared `latest.json`, and nothing of it is ever
//! deleted; see [`LatestSnapshot`] for the rule.
//!
//! # Reused objects are checked
//! Publish reuses an SST object already stored under its content hash instead of uploading it.
//! The first time this process reuses an object it reads it back and hashes it; a object whose
//! bytes do not match (a byte flipped in the store, a truncated leftover) is uploaded again,
//! which is safe because the name says what the bytes must be. An object checked or uploaded by
//! this process is remembered by its key, size and ETag, so later publishes reuse it for a `HEAD`
//! (a changed object has another ETag and is read again). The cost: the first publish after a
//! start reads back every file it does not upload, once; later ones cost one `HEAD` per file as
//! before. A snapshot therefore becomes visible, and counts towards the archived LSN, only once
//! every object it names has been known good at publish time.
//!
//! # Bounds on what is read
//! `latest.json` is read only up to [`LATEST_JSON_BYTES_MAX`] and `metadata.json` up to
//! [`METADATA_JSON_BYTES_MAX`]; larger ones are refused with [`Error::TooLarge`]. An SST object
//! is read only up to its declared size plus one byte: a larger one is refused
//! ([`FileProblem::TooLarge`](crate::FileProblem::TooLarge)) before it can fill a disk.
//!
//! # Garbage collection
//! [`SnapshotRepository::collect_garbage`] deletes a partition's garbage: the folders and
//! unshared SSTs of snapshots that a publish just evicted at once, any other garbage (leftovers of
//! crashed or conflicting publishes) only once it is older than a grace period, so that a publish
//! in flight keeps what it uploaded. It never deletes what a retained snapshot references, and
//! deletes nothing when it cannot read every retained `metadata.json`. A publish whose swap
//! evicts snapshots runs it ([`PublishReport::gc`]); [`SnapshotRepository::sweep_orphans`] runs
//! the grace rule alone. See [`gc`] for the rule, its crash consistency and its known limit.
//!
//! # Crash consistency
//! Publishing writes in this order: the SST files that are not in `ssts/` yet (each appears
//! atomically: a single `PUT`, or a multipart upload that appears on completion), then
//! `metadata.json` (create-only), then `latest.json` by compare-and-swap. Until the last step
//! succeeds nothing refers to the new objects, so a crash at any point leaves no visible partial
//! snapshot, only orphans. Objects are never modified after they are written, except
//! `latest.json`.
//!
//! # Consistency
//! `latest.json` changes only by compare-and-swap against the version the publisher read when it
//! started (or the one given in [`PublishOptions::based_on`]). Of two publishers that read the
//! same `latest.json`, the first to swap wins; the other gets [`Error::Conflict`], `latest.json`
//! stays as the winner wrote it, and the loser's `metadata.json` stays an unreferenced orphan.
//!
//! - On S3 (and any store given to [`SnapshotRepository::from_object_store`]) the swap is a
//!   conditional `PUT`: `If-Match: <etag read>`, or `If-None-Match: *` when there was none.
//! - object_store's local file system cannot overwrite conditionally, so a local repository
//!   holds an exclusive `flock` on `<partition>/latest.json.lock` while it reads the current
//!   `latest.json`, compares its content hash with the one the publisher read, writes and syncs
//!   a temporary file, renames it over `latest.json` and syncs the folder. The lock works between
//!   processes and between tasks of one process; readers take no lock, as a rename is atomic.
//!
//! An SST object is only ever (re)written with the bytes whose hash names it (an upload whose
//! bytes changed under it is abandoned), so two publishers uploading the same file at once are
//! harmless. A snapshot whose LSN is below the latest one's is refused
//! ([`Error::OlderThanLatest`]) so that `latest.json` never goes back.
//!
//! # Cancellation
//! Dropping a publish or garbage collection future stops it between requests, with the same
//! effect as a crash. On S3 an interrupted multipart upload is not aborted and keeps its parts
//! until the bucket's lifecycle rule `AbortIncompleteMultipartUpload` removes them; configure one.
//!
//! [`list`]: SnapshotRepository::list
//! [`find`]: SnapshotRepository::find
//! [`verify`]: SnapshotRepository::verify
//! [`download`]: SnapshotRepository::download
//! [`export_tar`]: SnapshotRepository::export_tar
//! [`latest`]: SnapshotRepository::latest

pub mod gc;
mod hashing;
mod latest;
mod publish;
mod rate_limit;
mod read;
mod retry;
mod reuse;
mod tar;
mod upload;

pub use gc::{DEFAULT_ORPHAN_GRACE, GcFence, GcOptions, GcReport};
pub use latest::{LATEST_JSON_BYTES_MAX, LatestRead, LatestSnapshot, RetainedSnapshot};
#[cfg(feature = "test-util")]
pub use publish::PublishStep;
pub use publish::{ProgressFn, PublishOptions, PublishReport};
pub use read::{DownloadReport, VerifyReport};
pub use tar::ExportReport;
#[cfg(feature = "test-util")]
pub use upload::UploadReport;

use crate::{ClusterIdentity, Error, Result, SnapshotId, SnapshotMetadata};
use bytes::Bytes;
use cairn_types::{Lsn, PartitionId};
use futures::StreamExt;
use latest::LatestWriter;
use object_store::aws::{AmazonS3Builder, S3ConditionalPut};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreExt, RetryConfig};
use rate_limit::RateLimiter;
use retry::RetryPolicy;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

const MIB: u64 = 1024 * 1024;
/// The most a `metadata.json` may hold: about 2,000 bytes per file, so room for tens of
/// thousands of SST files.
pub const METADATA_JSON_BYTES_MAX: u64 = 64 * MIB;
/// Objects this process has read back or uploaded and found to hold the bytes their name
/// promises; past this many the memory is cleared (the next publishes read their objects again).
const VERIFIED_OBJECTS_MAX: usize = 1_000_000;
/// S3 refuses multipart parts below 5 MiB (except the last) and above 5 GiB.
const S3_PART_BYTES_MIN: u64 = 5 * MIB;
const S3_PART_BYTES_MAX: u64 = 5 * 1024 * MIB;

/// How to reach a repository and how hard to push it.
#[derive(Clone)]
pub struct RepositoryOptions {
    /// S3 only: a custom endpoint (MinIO, moto, …) instead of AWS's.
    pub endpoint_url: Option<String>,
    /// S3 only: the region; by default from `AWS_REGION`/`AWS_DEFAULT_REGION`, else `us-east-1`.
    pub region: Option<String>,
    /// S3 only: allow `http://` endpoints.
    pub allow_http: bool,
    /// S3 only: static credentials, overriding the environment's credential chain (`AWS_*`
    /// variables, web identity, ECS and instance metadata). Never logged or printed.
    pub access_key_id: Option<String>,
    /// See `access_key_id`.
    pub secret_access_key: Option<String>,
    /// How many files are uploaded, downloaded or verified at once.
    pub upload_concurrency: usize,
    /// Files larger than this are uploaded in parts; smaller ones in one request, read whole
    /// into memory, so memory use is bounded by `upload_concurrency` times this.
    pub multipart_threshold_bytes: u64,
    /// Size of one part of a multipart upload (raised for huge files to stay within S3's 10 000
    /// parts); S3 needs at least 5 MiB.
    pub multipart_part_bytes: u64,
    /// How often a transiently failed request or transfer is retried, with exponential backoff
    /// and jitter starting at 100 ms.
    pub retries: u32,
    /// Upper bound on the rate of every transfer of this repository together, uploads and
    /// downloads.
    pub rate_limit_bytes_per_second: Option<u64>,
}

impl Default for RepositoryOptions {
    fn default() -> Self {
        RepositoryOptions {
            endpoint_url: None,
            region: None,
            allow_http: false,
            access_key_id: None,
            secret_access_key: None,
            upload_concurrency: 8,
            multipart_threshold_bytes: 64 * MIB,
            multipart_part_bytes: 16 * MIB,
            retries: 5,
            rate_limit_bytes_per_second: None,
        }
    }
}

impl fmt::Debug for RepositoryOptions {
    /// Shows whether credentials are set, never their values.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let redacted = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("RepositoryOptions")
            .field("endpoint_url", &self.endpoint_url)
            .field("region", &self.region)
            .field("allow_http", &self.allow_http)
            .field("access_key_id", &redacted(&self.access_key_id))
            .field("secret_access_key", &redacted(&self.secret_access_key))
            .field("upload_concurrency", &self.upload_concurrency)
            .field("multipart_threshold_bytes", &self.multipart_threshold_bytes)
            .field("multipart_part_bytes", &self.multipart_part_bytes)
            .field("retries", &self.retries)
            .field(
                "rate_limit_bytes_per_second",
                &self.rate_limit_bytes_per_second,
            )
            .finish()
    }
}

/// One visible snapshot, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotSummary {
    pub snapshot_id: SnapshotId,
    pub partition_id: PartitionId,
    pub min_applied_lsn: Lsn,
    pub created_at: SystemTime,
    pub node_name: String,
    /// Total size of the snapshot's files.
    pub size: u64,
    pub files: usize,
    /// Bytes that publishing this snapshot uploaded (the attempt that wrote its
    /// `metadata.json`); the rest it shares with older snapshots or found left by an attempt that
    /// crashed.
    pub new_bytes: u64,
    /// The snapshot's folder relative to the partition folder.
    pub path: String,
}

/// The snapshots of one partition, as [`SnapshotRepository::list`] lists them, with the
/// partitions whose snapshots could not be read.
#[derive(Debug, Default)]
pub struct SnapshotListing {
    /// Newest first within each partition, partitions in ascending order.
    pub snapshots: Vec<SnapshotSummary>,
    /// Partitions left out because their `latest.json` could not be read, and snapshots left
    /// out because their `metadata.json` could not be (one entry each, naming it); everything
    /// else is listed all the same.
    pub unreadable: Vec<UnreadablePartition>,
}

/// A partition whose snapshots could not be listed, and why.
#[derive(Debug)]
pub struct UnreadablePartition {
    pub partition_id: PartitionId,
    pub error: Error,
}

/// Partition snapshots on an object store, as one cluster sees them. See the
/// [module documentation](self) for the layout and the guarantees.
pub struct SnapshotRepository {
    /// Whose snapshots count; see [one cluster's view](self#one-clusters-view).
    cluster: ClusterIdentity,
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    /// The store's address without the prefix (`s3://bucket`, `file:///data/snapshots`);
    /// object locations are shown relative to it.
    store_root: String,
    latest_writer: LatestWriter,
    transfer_concurrency: usize,
    multipart_threshold_bytes: u64,
    multipart_part_bytes: u64,
    retry: RetryPolicy,
    rate_limiter: Option<Arc<RateLimiter>>,
    /// SST objects known to hold their bytes: location → (size, ETag) when checked.
    verified: std::sync::Mutex<std::collections::HashMap<ObjectPath, (u64, Option<String>)>>,
}

impl fmt::Debug for SnapshotRepository {
    /// The destination only: the store's own `Debug` may show its configuration, credentials
    /// included.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SnapshotRepository")
            .field("destination", &self.destination())
            .field("cluster", &self.cluster)
            .finish_non_exhaustive()
    }
}

enum Destination {
    Local(PathBuf),
    S3 { bucket: String, prefix: String },
}

impl SnapshotRepository {
    /// Opens the repository at `destination` for `cluster`: `file:///absolute/path` or an
    /// absolute path (the folder is created if missing), or `s3://bucket[/prefix]` (credentials
    /// from the standard AWS environment chain unless `options` gives them).
    ///
    /// Blocking for a local destination (it creates and resolves the folder): async callers run
    /// it with `spawn_blocking`. Every other call of the repository is async and keeps its file
    /// work on blocking threads.
    pub fn open(
        destination: &str,
        cluster: ClusterIdentity,
        options: RepositoryOptions,
    ) -> Result<SnapshotRepository> {
        let invalid = |reason: String| Error::InvalidDestination {
            destination: redact_destination(destination),
            reason,
        };
        let unusable = |source: object_store::Error| Error::UnusableStore {
            destination: redact_destination(destination),
            source,
        };
        match parse_destination(destination)? {
            Destination::Local(path) => {
                std::fs::create_dir_all(&path).map_err(|source| Error::Io {
                    context: "create the snapshot folder",
                    path: path.clone(),
                    source,
                })?;
                // fsync on: a local repository must survive power loss like S3 does.
                let fs = LocalFileSystem::new_with_prefix(&path)
                    .map_err(unusable)?
                    .with_fsync(true);
                let fs = Arc::new(fs);
                let root = std::fs::canonicalize(&path).unwrap_or(path);
                Self::build(
                    cluster,
                    fs.clone(),
                    ObjectPath::default(),
                    format!("file://{}", root.display()),
                    LatestWriter::LocalLock(fs),
                    &options,
                    false,
                )
            }
            Destination::S3 { bucket, prefix } => {
                let mut builder = AmazonS3Builder::from_env()
                    .with_bucket_name(&bucket)
                    .with_conditional_put(S3ConditionalPut::ETagMatch)
                    .with_retry(RetryConfig {
                        backoff: BackoffConfig {
                            init_backoff: Duration::from_millis(100),
                            max_backoff: Duration::from_secs(10),
                            base: 2.0,
                        },
                        max_retries: options.retries as usize,
                        retry_timeout: Duration::from_secs(180),
                    });
                if let Some(endpoint) = &options.endpoint_url {
                    builder = builder.with_endpoint(endpoint);
                }
                if let Some(region) = &options.region {
                    builder = builder.with_region(region);
                }
                if options.allow_http {
                    builder = builder.with_allow_http(true);
                }
                match (&options.access_key_id, &options.secret_access_key) {
                    (Some(id), Some(secret)) => {
                        builder = builder
                            .with_access_key_id(id)
                            .with_secret_access_key(secret);
                    }
                    (None, None) => {}
                    _ => {
                        return Err(Error::InvalidOptions {
                            reason: "give both access_key_id and secret_access_key, or neither \
                                     to use the environment's credentials"
                                .into(),
                        });
                    }
                }
                let store = builder.build().map_err(unusable)?;
                let prefix =
                    ObjectPath::parse(&prefix).map_err(|e| invalid(format!("bad prefix: {e}")))?;
                Self::build(
                    cluster,
                    Arc::new(store),
                    prefix,
                    format!("s3://{bucket}"),
                    LatestWriter::Conditional,
                    &options,
                    true,
                )
            }
        }
    }

    /// A repository on any object store, under `prefix`. The store must support conditional
    /// writes (`PutMode::Create` and `PutMode::Update`), as S3, GCS, Azure and the in-memory store
    /// do; `name` identifies it in messages (e.g. `memory://`).
    pub fn from_object_store(
        store: Arc<dyn ObjectStore>,
        name: &str,
        prefix: &str,
        cluster: ClusterIdentity,
        options: RepositoryOptions,
    ) -> Result<SnapshotRepository> {
        let prefix = ObjectPath::parse(prefix).map_err(|e| Error::InvalidDestination {
            destination: format!("{name}/{prefix}"),
            reason: format!("bad prefix: {e}"),
        })?;
        Self::build(
            cluster,
            store,
            prefix,
            name.to_owned(),
            LatestWriter::Conditional,
            &options,
            false,
        )
    }

    fn build(
        cluster: ClusterIdentity,
        store: Arc<dyn ObjectStore>,
        prefix: ObjectPath,
        store_root: String,
        latest_writer: LatestWriter,
        options: &RepositoryOptions,
        is_s3: bool,
    ) -> Result<SnapshotRepository> {
        let invalid = |reason: String| Err(Error::InvalidOptions { reason });
        if options.upload_concurrency == 0 {
            return invalid("upload_concurrency must be at least 1".into());
        }
        if options.multipart_part_bytes == 0 {
            return invalid("multipart_part_bytes must be at least 1".into());
        }
        if is_s3 && !(S3_PART_BYTES_MIN..=S3_PART_BYTES_MAX).contains(&options.multipart_part_bytes)
        {
            return invalid(format!(
                "multipart_part_bytes is {}, but S3 needs parts of 5 MiB to 5 GiB",
                options.multipart_part_bytes
            ));
        }
        if usize::try_from(options.multipart_part_bytes).is_err()
            || usize::try_from(options.multipart_threshold_bytes).is_err()
        {
            return invalid("multipart sizes do not fit in memory on this machine".into());
        }
        if options.rate_limit_bytes_per_second == Some(0) {
            return invalid(
                "rate_limit_bytes_per_second must be positive; leave it unset for no limit".into(),
            );
        }
        Ok(SnapshotRepository {
            cluster,
            store,
            prefix,
            store_root,
            latest_writer,
            transfer_concurrency: options.upload_concurrency,
            multipart_threshold_bytes: options.multipart_threshold_bytes,
            multipart_part_bytes: options.multipart_part_bytes,
            retry: RetryPolicy::new(options.retries),
            rate_limiter: options
                .rate_limit_bytes_per_second
                .map(|rate| Arc::new(RateLimiter::new(rate))),
            verified: Default::default(),
        })
    }

    /// The cluster whose snapshots this repository counts.
    pub fn cluster(&self) -> &ClusterIdentity {
        &self.cluster
    }

    /// Where the repository is, e.g. `s3://bucket/prefix` or `file:///data/snapshots`.
    pub fn destination(&self) -> String {
        if self.prefix.as_ref().is_empty() {
            self.store_root.clone()
        } else {
            join_address(&self.store_root, self.prefix.as_ref())
        }
    }

    /// The object store below the repository, for tests and benchmarks. Writing to it directly
    /// bypasses every guarantee of the repository.
    #[cfg(feature = "test-util")]
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// The location of `relative` (e.g. `latest.json`, `ssts/<hash>.sst`, a file's `key`) in the
    /// folder of `partition`.
    pub fn object_path(&self, partition: PartitionId, relative: &str) -> ObjectPath {
        relative
            .split('/')
            .filter(|segment| !segment.is_empty())
            .fold(self.partition_folder(partition), |path, segment| {
                path.join(segment)
            })
    }

    fn partition_folder(&self, partition: PartitionId) -> ObjectPath {
        self.prefix.clone().join(partition.to_string().as_str())
    }

    fn latest_location(&self, partition: PartitionId) -> ObjectPath {
        self.object_path(partition, "latest.json")
    }

    /// An object's full address for messages.
    fn describe(&self, location: &ObjectPath) -> String {
        join_address(&self.store_root, location.as_ref())
    }

    fn store_error(
        &self,
        context: &'static str,
        location: &ObjectPath,
        source: object_store::Error,
    ) -> Error {
        Error::ObjectStore {
            context,
            location: self.describe(location),
            source,
        }
    }

    fn join_error(&self, location: &ObjectPath, source: tokio::task::JoinError) -> Error {
        self.store_error(
            "access",
            location,
            object_store::Error::JoinError { source },
        )
    }

    /// The partitions that have a folder in the repository, in ascending order.
    pub async fn partitions(&self) -> Result<Vec<PartitionId>> {
        let prefix = (!self.prefix.as_ref().is_empty()).then_some(&self.prefix);
        let listing = self
            .retry
            .run("list partitions", || async {
                self.store
                    .list_with_delimiter(prefix)
                    .await
                    .map_err(|e| self.store_error("list", &self.prefix, e))
            })
            .await?;
        let mut partitions: Vec<PartitionId> = listing
            .common_prefixes
            .iter()
            .filter_map(|folder| folder.filename()?.parse().ok().map(PartitionId))
            .collect();
        partitions.sort();
        Ok(partitions)
    }

    /// This cluster's view of the partition's `latest.json` ([`LatestSnapshot::of_cluster`]), or
    /// `None` if this cluster has no published snapshot of it.
    pub async fn latest(&self, partition: PartitionId) -> Result<Option<LatestSnapshot>> {
        Ok(self
            .read_latest(partition)
            .await?
            .latest
            .and_then(|latest| latest.of_cluster(&self.cluster)))
    }

    /// This cluster's visible snapshots of one partition, or of all, newest first within each
    /// partition and partitions in ascending order. A partition whose `latest.json` cannot be
    /// read, and each snapshot whose `metadata.json` cannot be, is reported in
    /// [`SnapshotListing::unreadable`]; everything else is listed. Only failing to list the
    /// partitions fails the call.
    pub async fn list(&self, partition: Option<PartitionId>) -> Result<SnapshotListing> {
        let partitions = match partition {
            Some(partition) => vec![partition],
            None => self.partitions().await?,
        };
        let mut listing = SnapshotListing::default();
        for partition in partitions {
            self.list_partition_snapshots(partition, &mut listing).await;
        }
        Ok(listing)
    }

    /// Adds `partition`'s snapshots to `listing`: one unreadable `metadata.json` hides its own
    /// snapshot only, not the partition's others.
    async fn list_partition_snapshots(
        &self,
        partition: PartitionId,
        listing: &mut SnapshotListing,
    ) {
        let unreadable = |error| UnreadablePartition {
            partition_id: partition,
            error,
        };
        let latest = match self.latest(partition).await {
            Ok(Some(latest)) => latest,
            Ok(None) => return,
            Err(error) => return listing.unreadable.push(unreadable(error)),
        };
        let summaries: Vec<Result<SnapshotSummary>> = futures::stream::iter(latest.retained)
            .map(|retained| async move {
                let (_, metadata) = self.read_metadata(partition, &retained).await?;
                Ok(SnapshotSummary {
                    snapshot_id: metadata.snapshot_id,
                    partition_id: partition,
                    min_applied_lsn: metadata.min_applied_lsn,
                    created_at: metadata.created_at,
                    node_name: metadata.node_name.clone(),
                    size: metadata.size(),
                    files: metadata.files.len(),
                    new_bytes: metadata.stats.map(|s| s.uploaded_bytes).unwrap_or(0),
                    path: retained.path.clone(),
                })
            })
            .buffered(self.transfer_concurrency)
            .collect()
            .await;
        for summary in summaries {
            match summary {
                Ok(summary) => listing.snapshots.push(summary),
                Err(error) => listing.unreadable.push(unreadable(error)),
            }
        }
    }

    /// The metadata of a visible snapshot of `partition`.
    pub async fn metadata(
        &self,
        partition: PartitionId,
        snapshot_id: SnapshotId,
    ) -> Result<SnapshotMetadata> {
        let retained = self
            .latest(partition)
            .await?
            .and_then(|latest| {
                latest
                    .retained
                    .into_iter()
                    .find(|r| r.snapshot_id == snapshot_id)
            })
            .ok_or_else(|| Error::SnapshotNotFound {
                snapshot_id,
                destination: self.destination(),
            })?;
        Ok(self.read_metadata(partition, &retained).await?.1)
    }

    /// Finds a visible snapshot of this cluster in any partition. Partitions whose `latest.json`
    /// cannot be read are skipped; if the snapshot is in none of the others, the error names
    /// them ([`Error::SnapshotNotFoundInReadable`]).
    pub async fn find(&self, snapshot_id: SnapshotId) -> Result<(PartitionId, SnapshotMetadata)> {
        let (partition, retained) = self.find_retained(snapshot_id).await?;
        let (_, metadata) = self.read_metadata(partition, &retained).await?;
        Ok((partition, metadata))
    }

    async fn find_retained(
        &self,
        snapshot_id: SnapshotId,
    ) -> Result<(PartitionId, RetainedSnapshot)> {
        let partitions = self.partitions().await?;
        let mut latests = futures::stream::iter(partitions)
            .map(|partition| async move { (partition, self.read_latest(partition).await) })
            .buffered(self.transfer_concurrency);
        let mut unreadable: Vec<(PartitionId, Error)> = Vec::new();
        let mut of_another_cluster = None;
        while let Some((partition, read)) = latests.next().await {
            let Some(latest) = (match read {
                Ok(read) => read.latest,
                Err(error) => {
                    tracing::warn!(%partition, %error, "cannot read latest.json; searching the other partitions");
                    unreadable.push((partition, error));
                    continue;
                }
            }) else {
                continue;
            };
            let found = latest
                .retained
                .iter()
                .find(|r| r.snapshot_id == snapshot_id);
            match found {
                Some(retained) if retained.is_of(&self.cluster) => {
                    return Ok((partition, retained.clone()));
                }
                Some(retained) => of_another_cluster = Some((partition, retained.cluster.clone())),
                None => {}
            }
        }
        let destination = self.destination();
        if let Some((partition, theirs)) = of_another_cluster {
            return Err(Error::SnapshotOfAnotherCluster {
                snapshot_id,
                partition,
                destination,
                theirs: Box::new(theirs),
                ours: Box::new(self.cluster.clone()),
            });
        }
        let mut unreadable = unreadable.into_iter();
        match unreadable.next() {
            None => Err(Error::SnapshotNotFound {
                snapshot_id,
                destination,
            }),
            Some((first_partition, first_error)) => Err(Error::SnapshotNotFoundInReadable {
                snapshot_id,
                destination,
                partitions: std::iter::once(first_partition)
                    .chain(unreadable.map(|(partition, _)| partition))
                    .collect(),
                source: Box::new(first_error),
            }),
        }
    }

    /// Reads and checks a retained snapshot's `metadata.json`; returns its bytes as stored too.
    async fn read_metadata(
        &self,
        partition: PartitionId,
        retained: &RetainedSnapshot,
    ) -> Result<(Bytes, SnapshotMetadata)> {
        let location = self.object_path(partition, &format!("{}/metadata.json", retained.path));
        let bytes = self
            .retry
            .run("read metadata.json", || async {
                match self.store.get(&location).await {
                    Ok(result) if result.meta.size > METADATA_JSON_BYTES_MAX => {
                        Err(Error::TooLarge {
                            location: self.describe(&location),
                            size: result.meta.size,
                            limit: METADATA_JSON_BYTES_MAX,
                            what: "a metadata.json",
                        })
                    }
                    Ok(result) => result
                        .bytes()
                        .await
                        .map(Some)
                        .map_err(|e| self.store_error("read", &location, e)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(self.store_error("read", &location, e)),
                }
            })
            .await?
            .ok_or_else(|| Error::MetadataMissing {
                location: self.describe(&location),
                snapshot_id: retained.snapshot_id,
            })?;
        let described = self.describe(&location);
        let metadata = SnapshotMetadata::from_json_at(&bytes, &described)?;
        if metadata.snapshot_id != retained.snapshot_id || metadata.partition_id != partition {
            return Err(Error::MalformedMetadata {
                location: described,
                reason: format!(
                    "it describes snapshot {} of partition {}, but latest.json expects snapshot \
                     {} of partition {partition} there",
                    metadata.snapshot_id, metadata.partition_id, retained.snapshot_id
                ),
            });
        }
        Ok((bytes, metadata))
    }
}

fn join_address(root: &str, path: &str) -> String {
    if root.ends_with('/') {
        format!("{root}{path}")
    } else {
        format!("{root}/{path}")
    }
}

/// A snapshot's folder relative to its partition folder: `snapshots/<inverse_lsn>_<id>`.
pub fn snapshot_folder(min_applied_lsn: Lsn, snapshot_id: SnapshotId) -> String {
    format!(
        "snapshots/{:016x}_{snapshot_id}",
        u64::MAX - min_applied_lsn.0
    )
}

/// A snapshot folder named in `latest.json` must be inside `snapshots/`.
fn validate_snapshot_path(path: &str) -> std::result::Result<(), &'static str> {
    crate::metadata::validate_object_key(path)?;
    if !path.starts_with("snapshots/") {
        return Err("it must be inside snapshots/");
    }
    Ok(())
}

/// Where `destination` points; [`Error::InvalidDestination`] (the destination redacted) says why
/// it points nowhere Cairn can use.
fn parse_destination(destination: &str) -> Result<Destination> {
    const EXPECTED: &str = "use file:///absolute/path, an absolute path, or s3://bucket/prefix";
    let invalid = |reason: String| Error::InvalidDestination {
        destination: redact_destination(destination),
        reason,
    };
    if destination.starts_with('/') {
        return Ok(Destination::Local(PathBuf::from(destination)));
    }
    let url = url::Url::parse(destination).map_err(|e| invalid(format!("{e}; {EXPECTED}")))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(
            "credentials do not belong in the URL; use the AWS environment \
                    (AWS_ACCESS_KEY_ID, AWS_PROFILE, …) or the repository options"
                .into(),
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid(format!(
            "a query or fragment is not supported; {EXPECTED}"
        )));
    }
    match url.scheme() {
        "file" => url
            .to_file_path()
            .map(Destination::Local)
            .map_err(|()| invalid(format!("not an absolute local path; {EXPECTED}"))),
        "s3" => {
            let bucket = url
                .host_str()
                .filter(|b| !b.is_empty())
                .ok_or_else(|| invalid(format!("no bucket; {EXPECTED}")))?
                .to_owned();
            let prefix = url.path().trim_matches('/').to_owned();
            Ok(Destination::S3 { bucket, prefix })
        }
        other => Err(invalid(format!(
            "scheme {other}:// is not supported; {EXPECTED}"
        ))),
    }
}

/// `destination` with anything that may be a secret replaced by `***`, for messages and logs:
/// the user info (`id:secret@`) and the query or fragment of a URL.
///
/// It works on the text, not on a parsed URL: credentials are what make a destination
/// unparsable (AWS secret keys hold `/` and `+`, passwords `#` or `?`), and an unparsable one must
/// not be echoed whole. Text up to the first `@` after the scheme is user info when it holds a
/// `:` or no `/`; it ends at the last `@` of the authority that follows, so a secret with `/`,
/// `#`, `?` or `@` in it goes whole. An `@` in a path (`s3://bucket/a@b`, `/data/a@b`) is kept.
pub fn redact_destination(destination: &str) -> String {
    let Some((scheme, rest)) = destination.split_once("://") else {
        // An absolute path holds no credentials; anything else with an `@` might.
        return match destination.rfind('@') {
            Some(at) if !destination.starts_with('/') => {
                format!("***@{}", cut_query(&destination[at + 1..]))
            }
            _ => destination.to_owned(),
        };
    };
    let after_user_info = match rest.find('@') {
        Some(first) if rest[..first].contains(':') || !rest[..first].contains('/') => {
            let authority_end = rest[first..]
                .find('/')
                .map_or(rest.len(), |slash| first + slash);
            let last = rest[..authority_end].rfind('@').unwrap_or(first);
            Some(&rest[last + 1..])
        }
        _ => None,
    };
    match after_user_info {
        Some(host) => format!("{scheme}://***@{}", cut_query(host)),
        None => format!("{scheme}://{}", cut_query(rest)),
    }
}

/// `text` with its query or fragment, if any, replaced by `?***`.
fn cut_query(text: &str) -> String {
    match text.split_once(['?', '#']) {
        Some((before, _)) => format!("{before}?***"),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn cluster() -> ClusterIdentity {
        ClusterIdentity::new("test-cluster", "2026-01-01T00:00:00.000Z")
    }

    #[test]
    fn destinations_parse_into_local_folders_and_buckets() {
        assert!(matches!(
            parse_destination("/data/snapshots"),
            Ok(Destination::Local(p)) if p == Path::new("/data/snapshots")
        ));
        assert!(matches!(
            parse_destination("file:///data/snapshots"),
            Ok(Destination::Local(p)) if p == Path::new("/data/snapshots")
        ));
        assert!(matches!(
            parse_destination("s3://bucket/some/prefix/"),
            Ok(Destination::S3 { bucket, prefix }) if bucket == "bucket" && prefix == "some/prefix"
        ));
        assert!(matches!(
            parse_destination("s3://bucket"),
            Ok(Destination::S3 { bucket, prefix }) if bucket == "bucket" && prefix.is_empty()
        ));
        for bad in [
            "relative/path",
            "gs://bucket",
            "s3:///prefix",
            "file://host/x",
        ] {
            assert!(parse_destination(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn secrets_in_a_destination_are_never_repeated() {
        let err = SnapshotRepository::open(
            "s3://AKIDEXAMPLE:wJalrXUtnFEMI@bucket/prefix?token=SECRETTOKEN",
            cluster(),
            RepositoryOptions::default(),
        )
        .unwrap_err()
        .to_string();
        for secret in ["AKIDEXAMPLE", "wJalrXUtnFEMI", "SECRETTOKEN"] {
            assert!(!err.contains(secret), "{err}");
        }
        assert!(err.contains("bucket"), "{err}");
    }

    #[test]
    fn options_never_show_credentials() {
        let options = RepositoryOptions {
            access_key_id: Some("AKIDEXAMPLE".into()),
            secret_access_key: Some("wJalrXUtnFEMI".into()),
            ..RepositoryOptions::default()
        };
        let shown = format!("{options:?}");
        assert!(!shown.contains("AKIDEXAMPLE") && !shown.contains("wJalrXUtnFEMI"));
        let repo = SnapshotRepository::open("s3://bucket/prefix", cluster(), options).unwrap();
        let shown = format!("{repo:?}");
        assert!(!shown.contains("AKIDEXAMPLE") && !shown.contains("wJalrXUtnFEMI"));
        assert!(shown.contains("s3://bucket/prefix"), "{shown}");
    }

    #[test]
    fn bad_options_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap();
        let cases = [
            RepositoryOptions {
                upload_concurrency: 0,
                ..RepositoryOptions::default()
            },
            RepositoryOptions {
                rate_limit_bytes_per_second: Some(0),
                ..RepositoryOptions::default()
            },
            RepositoryOptions {
                multipart_part_bytes: 0,
                ..RepositoryOptions::default()
            },
        ];
        for options in cases {
            let err = SnapshotRepository::open(path, cluster(), options).unwrap_err();
            assert!(matches!(err, Error::InvalidOptions { .. }), "{err}");
        }
        let small_parts = RepositoryOptions {
            multipart_part_bytes: MIB,
            ..RepositoryOptions::default()
        };
        assert!(SnapshotRepository::open(path, cluster(), small_parts.clone()).is_ok());
        let err = SnapshotRepository::open("s3://bucket", cluster(), small_parts).unwrap_err();
        assert!(err.to_string().contains("5 MiB"), "{err}");
        let half_credentials = RepositoryOptions {
            access_key_id: Some("id".into()),
            ..RepositoryOptions::default()
        };
        assert!(SnapshotRepository::open("s3://bucket", cluster(), half_credentials).is_err());
    }

    #[test]
    fn snapshot_folders_sort_newest_first() {
        let id = SnapshotId::from_ulid(1);
        assert_eq!(
            snapshot_folder(Lsn(10), id),
            format!("snapshots/fffffffffffffff5_{id}")
        );
        let mut folders: Vec<_> = [3u64, 700, 12, 0, u64::MAX]
            .into_iter()
            .map(|lsn| (snapshot_folder(Lsn(lsn), id), lsn))
            .collect();
        folders.sort();
        let lsns: Vec<_> = folders.into_iter().map(|(_, lsn)| lsn).collect();
        assert_eq!(lsns, vec![u64::MAX, 700, 12, 3, 0]);
    }

    #[test]
    fn object_paths_sit_under_the_prefix_and_partition() {
        let repo = SnapshotRepository::from_object_store(
            Arc::new(object_store::memory::InMemory::new()),
            "memory://",
            "cluster/a",
            cluster(),
            RepositoryOptions::default(),
        )
        .unwrap();
        assert_eq!(
            repo.object_path(PartitionId(7), "ssts/abc.sst").as_ref(),
            "cluster/a/7/ssts/abc.sst"
        );
        assert_eq!(repo.destination(), "memory://cluster/a");
    }
}
