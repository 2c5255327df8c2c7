//! Restore: rebuilds a partition's store from a snapshot in the repository.
//!
//! ```text
//!   latest.json ─▶ retained snapshots, newest first
//!       for each: metadata.json ─▶ validate ─▶ download into <staging>/<pid>/<snapshot_id>/ (checksums)
//!       first that passes: mark <staging>/<pid>.importing ─▶ drop old CF ─▶ import CF (move files)
//!                          ─▶ check applied LSN ─▶ unmark ─▶ remove staging
//! ```
//!
//! The caller then starts the partition processor, which replays the log from the snapshot's
//! `min_applied_lsn + 1`.
//!
//! # Validation
//! Only this cluster's snapshots are candidates: the repository is opened for this cluster and
//! lists no other's. A snapshot is trusted only if its metadata is of a known version and names
//! this cluster (its name and creation time), this partition and this partition's key range, its comparator is RocksDB's bytewise one, and the log
//! still holds every record after it: the log's trim point (the last trimmed LSN) is at most its
//! `min_applied_lsn`. Every downloaded file is checked against its size and checksum. A snapshot
//! that fails is skipped for the next older retained one; when none passes, the error lists each
//! snapshot tried and why it was refused.
//!
//! # Crash consistency
//! Downloads land in a staging folder that [`repair_interrupted_restore`] removes on the next
//! start. RocksDB creates the imported column family before it adds the files, so an import is
//! marked by a synced `<pid>.importing` file first; if a start finds the mark, the column family
//! may be partial and is dropped, and the partition is restored again.

use crate::snapshot::exported_file;
use crate::{BoxError, Error, Result};
use cairn_log::LogState;
use cairn_partition_store::{ExportedFile, PartitionStoreManager};
use cairn_snapshots::{SnapshotId, SnapshotMetadata, SnapshotRepository};
use cairn_types::{KeyRange, LogId, Lsn, PartitionId};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// The comparator every Cairn store uses; a snapshot sorted by another cannot be imported.
const BYTEWISE_COMPARATOR: &str = "leveldb.BytewiseComparator";

/// How often download progress is reported.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(250);

/// A step of a restore, for progress bars and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreStep {
    /// Downloading `snapshot_id`: `bytes` of `total` are in the staging folder.
    Downloading {
        snapshot_id: SnapshotId,
        bytes: u64,
        total: u64,
    },
    /// Importing the downloaded files into the store.
    Importing { snapshot_id: SnapshotId },
    /// The store is restored; the partition replays its log from `from` up to `to`.
    Replaying { from: Lsn, to: Lsn },
    /// A snapshot was refused; the restore goes on with the next older one.
    Skipped {
        snapshot_id: SnapshotId,
        reason: String,
    },
}

pub type RestoreProgressFn = Arc<dyn Fn(RestoreStep) + Send + Sync>;

/// What a restore did.
#[derive(Debug, Clone)]
pub struct Restored {
    pub partition_id: PartitionId,
    pub snapshot_id: SnapshotId,
    pub min_applied_lsn: Lsn,
    pub files: usize,
    pub bytes: u64,
    pub download: Duration,
    pub import: Duration,
    /// Newer snapshots that were refused, with the reason.
    pub skipped: Vec<(SnapshotId, String)>,
}

/// Restores partitions of one node from its snapshot repository. What a crash in the middle
/// leaves, [`repair_interrupted_restore`] repairs.
pub struct Restorer {
    repository: Arc<SnapshotRepository>,
    /// `<base-dir>/restore-staging`: on the store's file system, so imports are hard links.
    staging_root: PathBuf,
    num_partitions: u16,
}

impl Restorer {
    /// A restorer of the snapshots of the repository's cluster, which has `num_partitions`
    /// partitions, staging downloads under `staging_root`.
    pub fn new(
        repository: Arc<SnapshotRepository>,
        staging_root: PathBuf,
        num_partitions: u16,
    ) -> Restorer {
        Restorer {
            repository,
            staging_root,
            num_partitions,
        }
    }

    fn marker(&self, partition: PartitionId) -> PathBuf {
        marker_path(&self.staging_root, partition)
    }

    fn staging_dir(&self, partition: PartitionId) -> PathBuf {
        self.staging_root.join(partition.to_string())
    }

    /// Replaces `partition`'s store (if any) with the newest suitable retained snapshot, or with
    /// `pinned`. `log` is the state of the partition's log: a snapshot older than its trim point
    /// cannot be replayed forward, and one past its tail was taken from another log. The
    /// partition's processor must not be running.
    pub async fn restore(
        &self,
        stores: &Arc<PartitionStoreManager>,
        partition: PartitionId,
        log: LogState,
        pinned: Option<SnapshotId>,
        on_progress: Option<RestoreProgressFn>,
    ) -> Result<Restored> {
        let destination = self.repository.destination();
        let read = self
            .repository
            .read_latest(partition)
            .await
            .map_err(|e| restore_error(partition, "read latest.json", e))?;
        let cluster = self.repository.cluster();
        let Some(latest) = read.latest.as_ref().and_then(|l| l.of_cluster(cluster)) else {
            let others = read
                .latest
                .map(|l| l.of_other_clusters(cluster))
                .unwrap_or_default();
            let others = match others.as_slice() {
                [] => String::new(),
                others => format!(
                    "; it keeps {} of another cluster ({}), which this cluster cannot use",
                    others.len(),
                    others
                        .iter()
                        .map(|o| format!("{} at LSN {}", o.snapshot_id, o.min_applied_lsn))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            return Err(Error::Restore {
                partition,
                failure: RestoreFailure::Unable(format!(
                    "the snapshot repository {destination} has no snapshot of partition {partition} taken by this cluster ({cluster}){others}"
                )),
            });
        };
        let candidates: Vec<SnapshotId> = match pinned {
            None => latest.retained.iter().map(|r| r.snapshot_id).collect(),
            Some(id) if latest.retained.iter().any(|r| r.snapshot_id == id) => vec![id],
            Some(id) => {
                return Err(Error::Restore {
                    partition,
                    failure: RestoreFailure::Unable(format!(
                        "snapshot {id} is not a retained snapshot of partition {partition} in {destination}; `cairnctl snapshots list -p {partition}` shows those that are"
                    )),
                });
            }
        };

        let mut skipped: Vec<(SnapshotId, String)> = Vec::new();
        for snapshot_id in candidates {
            match self
                .try_restore(stores, partition, log, snapshot_id, &on_progress)
                .await
            {
                Ok(Attempt::Restored(mut restored)) => {
                    restored.skipped = skipped;
                    return Ok(restored);
                }
                Ok(Attempt::Refused(Refusal { reason })) => {
                    warn!(%partition, %snapshot_id, "snapshot not used for restore: {reason}");
                    if let Some(progress) = &on_progress {
                        progress(RestoreStep::Skipped {
                            snapshot_id,
                            reason: reason.clone(),
                        });
                    }
                    skipped.push((snapshot_id, reason));
                }
                Err(Error::Restore { failure, .. }) if !skipped.is_empty() => {
                    return Err(Error::Restore {
                        partition,
                        failure: RestoreFailure::AfterSkipping {
                            failure: Box::new(failure),
                            skipped,
                        },
                    });
                }
                Err(err) => return Err(err),
            }
        }
        Err(Error::Restore {
            partition,
            failure: RestoreFailure::Unable(format!(
                "no suitable snapshot in {destination}; tried {}",
                tried(&skipped)
            )),
        })
    }

    /// Restores from one snapshot. A snapshot that is not suitable is `Refused` and the store is
    /// left as it was; an `Err` means the store may have been dropped.
    async fn try_restore(
        &self,
        stores: &Arc<PartitionStoreManager>,
        partition: PartitionId,
        log: LogState,
        snapshot_id: SnapshotId,
        on_progress: &Option<RestoreProgressFn>,
    ) -> Result<Attempt> {
        let metadata = match self.repository.metadata(partition, snapshot_id).await {
            Ok(metadata) => metadata,
            Err(err) => return Ok(Attempt::Refused(Refusal::because(err))),
        };
        if let Err(refusal) = self.validate(partition, log, &metadata) {
            return Ok(Attempt::Refused(refusal));
        }
        let files = match metadata
            .files
            .iter()
            .map(exported_file)
            .collect::<std::result::Result<Vec<_>, _>>()
        {
            Ok(files) => files,
            Err(err) => return Ok(Attempt::Refused(Refusal::because(err))),
        };

        info!(
            partition_id = %partition,
            %snapshot_id,
            lsn = %metadata.min_applied_lsn,
            "Restoring partition from snapshot"
        );
        let staging = self.staging_dir(partition).join(snapshot_id.to_string());
        let _ = tokio::fs::remove_dir_all(&staging).await;
        if let Err(err) = tokio::fs::create_dir_all(&staging).await {
            return Err(restore_error(partition, "create the staging folder", err));
        }
        let started = Instant::now();
        let download = self
            .repository
            .download_files(partition, &metadata, &staging);
        let downloaded = with_progress(
            download,
            &staging,
            snapshot_id,
            metadata.size(),
            on_progress.as_ref(),
        )
        .await;
        if let Err(err) = downloaded {
            let _ = tokio::fs::remove_dir_all(&staging).await;
            return Ok(Attempt::Refused(Refusal::because(err)));
        }
        let download = started.elapsed();

        if let Some(progress) = on_progress {
            progress(RestoreStep::Importing { snapshot_id });
        }
        info!(
            partition_id = %partition,
            min_applied_lsn = %metadata.min_applied_lsn,
            "Initializing partition store from snapshot"
        );
        let started = Instant::now();
        // RocksDB and file-system calls: off the async threads.
        let marker = self.marker(partition);
        let imported = {
            let (stores, marker, staging) = (stores.clone(), marker.clone(), staging.clone());
            let metadata = metadata.clone();
            tokio::task::spawn_blocking(move || {
                import(&stores, &marker, partition, &staging, &metadata, files)
            })
            .await
            .map_err(|e| restore_error(partition, "import the snapshot", e))??
        };
        if let Err(refusal) = imported {
            let _ = tokio::fs::remove_dir_all(&staging).await;
            return Ok(Attempt::Refused(refusal));
        }
        crate::testing::pause_point("restore-import").await;
        tokio::task::spawn_blocking(move || unmark(&marker, partition))
            .await
            .map_err(|e| restore_error(partition, "remove the import mark", e))??;
        let import = started.elapsed();
        let _ = tokio::fs::remove_dir_all(self.staging_dir(partition)).await;
        Ok(Attempt::Restored(Restored {
            partition_id: partition,
            snapshot_id,
            min_applied_lsn: metadata.min_applied_lsn,
            files: metadata.files.len(),
            bytes: metadata.size(),
            download,
            import,
            skipped: Vec::new(),
        }))
    }

    fn validate(
        &self,
        partition: PartitionId,
        log: LogState,
        metadata: &SnapshotMetadata,
    ) -> std::result::Result<(), Refusal> {
        let trim_point = log.trim_point;
        let cluster = self.repository.cluster();
        if metadata.cluster_name != cluster.cluster_name {
            return Err(Refusal::because(format_args!(
                "it belongs to cluster {:?}, this node to cluster {:?}",
                metadata.cluster_name, cluster.cluster_name
            )));
        }
        if metadata.cluster_created_at.as_deref() != Some(cluster.cluster_created_at.as_str()) {
            return Err(Refusal::because(format_args!(
                "it was taken by another cluster named {:?}, created at {}; this one was created at {}",
                cluster.cluster_name,
                metadata
                    .cluster_created_at
                    .as_deref()
                    .unwrap_or("an unrecorded time"),
                cluster.cluster_created_at
            )));
        }
        if metadata.partition_id != partition {
            return Err(Refusal::because(format_args!(
                "it is a snapshot of partition {}",
                metadata.partition_id
            )));
        }
        let range = KeyRange::of_partition(partition, self.num_partitions);
        if metadata.key_range != range {
            return Err(Refusal::because(format_args!(
                "its key range {:?} is not partition {partition}'s range {range:?} in a cluster of {} partitions",
                metadata.key_range, self.num_partitions
            )));
        }
        if metadata.db_comparator_name != BYTEWISE_COMPARATOR {
            return Err(Refusal::because(format_args!(
                "its files are sorted by {:?}, not {BYTEWISE_COMPARATOR:?}",
                metadata.db_comparator_name
            )));
        }
        if metadata.log_id != LogId::from(partition) {
            return Err(Refusal::because(format_args!(
                "it was taken from log {}, not from log {}",
                metadata.log_id,
                LogId::from(partition)
            )));
        }
        if metadata.min_applied_lsn > log.tail {
            return Err(Refusal::because(format_args!(
                "it covers the log up to LSN {}, but this node's log ends at LSN {}: it was taken from another log (a base dir that was reset, or a repository shared with another cluster of the same name), or this log has lost records since",
                metadata.min_applied_lsn, log.tail
            )));
        }
        if trim_point > metadata.min_applied_lsn {
            return Err(Refusal::because(format_args!(
                "it covers the log up to LSN {}, but the log is trimmed up to LSN {trim_point}, so records {}..={trim_point} could not be replayed",
                metadata.min_applied_lsn,
                metadata.min_applied_lsn.0 + 1
            )));
        }
        Ok(())
    }
}

/// Replaces the partition's store with the staged files. `Ok(Err(reason))`: RocksDB refused
/// the files or they do not hold what the metadata says; the partition has no store then, and
/// the caller may try an older snapshot.
fn import(
    stores: &PartitionStoreManager,
    marker: &Path,
    partition: PartitionId,
    staging: &Path,
    metadata: &SnapshotMetadata,
    files: Vec<ExportedFile>,
) -> Result<std::result::Result<(), Refusal>> {
    // Drop first, then mark: the mark must only ever stand for a column family that may be
    // partial, never for the old, complete store.
    if stores.has_store(partition) {
        stores
            .drop_partition(partition)
            .map_err(|e| restore_error(partition, "drop the old store", e))?;
    }
    write_synced(marker, metadata.snapshot_id.to_string().as_bytes())
        .map_err(|e| restore_error(partition, "mark the import", e))?;
    let refused = |reason: String| -> Result<std::result::Result<(), Refusal>> {
        if stores.has_store(partition) {
            stores
                .drop_partition(partition)
                .map_err(|e| restore_error(partition, "drop a refused import", e))?;
        }
        unmark(marker, partition)?;
        Ok(Err(Refusal { reason }))
    };
    let store =
        match stores.import_partition(partition, staging, &metadata.db_comparator_name, &files) {
            Ok(store) => store,
            Err(e) => return refused(format!("RocksDB refused its files: {e}")),
        };
    match store.applied_lsn() {
        Ok(applied) if applied == metadata.min_applied_lsn => Ok(Ok(())),
        Ok(applied) => refused(format!(
            "its metadata says it holds LSN {} but its files hold LSN {applied}",
            metadata.min_applied_lsn
        )),
        Err(e) => refused(format!("its applied LSN cannot be read: {e}")),
    }
}

/// Marks the import of `partition` complete.
fn unmark(marker: &Path, partition: PartitionId) -> Result<()> {
    std::fs::remove_file(marker)
        .map_err(|e| restore_error(partition, "remove the import mark", e))?;
    if let Some(parent) = marker.parent() {
        let _ = std::fs::File::open(parent).and_then(|d| d.sync_all());
    }
    Ok(())
}

enum Attempt {
    Restored(Restored),
    Refused(Refusal),
}

/// Why a snapshot is not used for a restore, a sentence about the snapshot ("it belongs to
/// cluster …") that the operator sees; the restore goes on with an older one.
struct Refusal {
    reason: String,
}

impl Refusal {
    fn because(err: impl std::fmt::Display) -> Refusal {
        Refusal {
            reason: err.to_string(),
        }
    }
}

/// Why a restore failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreFailure {
    /// Nothing can be restored (no suitable snapshot, no repository, no such partition); the
    /// sentence says why and what to do.
    #[error("{0}")]
    Unable(String),
    /// A step failed; its source is what failed: the repository's [`cairn_snapshots::Error`]
    /// (see [`Error::is_repository_unavailable`]), the store's [`cairn_partition_store::Error`],
    /// the log's [`cairn_log::Error`], the file system's [`std::io::Error`], a blocking task, or
    /// the node's attempt to lead the restored partition.
    #[error("{context}: {source}")]
    Failed {
        context: &'static str,
        #[source]
        source: BoxError,
    },
    /// `failure`, after newer snapshots were refused for the reasons in `skipped`.
    #[error("{failure} (after skipping {})", tried(skipped))]
    AfterSkipping {
        #[source]
        failure: Box<RestoreFailure>,
        skipped: Vec<(SnapshotId, String)>,
    },
}

/// Undoes what a crash in the middle of a restore of `partition` left in `staging_root` (the
/// restorer's staging folder): drops a column family whose import may not have completed, and
/// removes the staging folder. Returns whether an import had been interrupted. Needs no
/// repository, so a node runs it at every start whatever its configuration. Blocking (RocksDB and
/// file-system calls): async callers run it with `spawn_blocking`.
pub fn repair_interrupted_restore(
    stores: &PartitionStoreManager,
    staging_root: &Path,
    partition: PartitionId,
) -> Result<bool> {
    let marker = marker_path(staging_root, partition);
    let interrupted = marker.exists();
    if interrupted {
        if stores.has_store(partition) {
            stores
                .drop_partition(partition)
                .map_err(|e| restore_error(partition, "drop a partially imported store", e))?;
        }
        warn!(
            %partition,
            "a restore was interrupted while importing; dropped the partial store"
        );
        std::fs::remove_file(&marker)
            .map_err(|e| restore_error(partition, "remove the import mark", e))?;
    }
    let staging = staging_root.join(partition.to_string());
    match std::fs::remove_dir_all(&staging) {
        Ok(()) => {
            info!(%partition, path = %staging.display(), "removed a leftover restore staging folder")
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(restore_error(partition, "remove the staging folder", e)),
    }
    Ok(interrupted)
}

fn marker_path(staging_root: &Path, partition: PartitionId) -> PathBuf {
    staging_root.join(format!("{partition}.importing"))
}

/// Runs `download`, reporting how many bytes the staging folder holds as it goes.
async fn with_progress<T>(
    download: impl Future<Output = T>,
    staging: &Path,
    snapshot_id: SnapshotId,
    total: u64,
    progress: Option<&RestoreProgressFn>,
) -> T {
    let report = |bytes| {
        if let Some(progress) = progress {
            progress(RestoreStep::Downloading {
                snapshot_id,
                bytes,
                total,
            })
        }
    };
    report(0);
    let mut download = std::pin::pin!(download);
    let mut ticks = tokio::time::interval(PROGRESS_INTERVAL);
    loop {
        tokio::select! {
            result = &mut download => {
                report(total);
                // The files are in the staging folder and nothing is imported yet.
                crate::testing::pause_point("restore-download").await;
                return result;
            }
            _ = ticks.tick() => {
                // Listing the folder is file-system work: off the async threads.
                let dir = staging.to_path_buf();
                let bytes = tokio::task::spawn_blocking(move || dir_bytes(&dir))
                    .await
                    .unwrap_or(0);
                report(bytes.min(total))
            }
        }
    }
}

/// Bytes of the files in `dir` (0 if it cannot be listed). Blocking.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn write_synced(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut file = std::fs::File::create(path)?;
    file.write_all(contents)?;
    file.sync_all()?;
    if let Some(parent) = path.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

fn tried(skipped: &[(SnapshotId, String)]) -> String {
    skipped
        .iter()
        .map(|(id, reason)| format!("{id}: {reason}"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn restore_error(partition: PartitionId, context: &'static str, err: impl Into<BoxError>) -> Error {
    Error::Restore {
        partition,
        failure: RestoreFailure::Failed {
            context,
            source: err.into(),
        },
    }
}
