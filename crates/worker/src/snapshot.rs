//! The snapshot producer: exports a partition's store and publishes it to the repository.
//!
//! ```text
//!   processor (between two records)          producer                         repository
//!   export CF ──▶ <base>/db-snapshots/<pid>/<snapshot_id>/ ──▶ metadata V1 ──▶ SSTs → metadata.json → latest.json
//!                                                             └─ export folder removed once published
//! ```
//!
//! # Consistency
//! The export is made by the processor between two records, so its `min_applied_lsn` is exactly
//! what its files hold. Snapshots of one partition are produced one at a time on a node, so two
//! requests never race each other for `latest.json`. Every snapshot is stamped with the cluster
//! the repository was opened for, and only that cluster's snapshots can cover a request.
//!
//! # Crash consistency
//! A crash leaves at most an export folder under the export root (the node empties it at start)
//! and objects that no `latest.json` references (orphans, never visible, swept by the garbage
//! collection after the grace period).

use crate::{BoxError, Error, Partition, Result};
use cairn_partition_store::{ColumnFamilyExport, ExportedFile};
use cairn_snapshots::{
    ClusterIdentity, DEFAULT_ORPHAN_GRACE, GcReport, MetadataProblem, MetadataVersion, ProgressFn,
    PublishOptions, SnapshotFile, SnapshotId, SnapshotMetadata, SnapshotRepository,
};
use cairn_types::{KeyRange, LogId, Lsn, PartitionId};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tracing::{debug, error, info, warn};

/// What `CreateSnapshot` answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatedSnapshot {
    pub snapshot_id: SnapshotId,
    pub partition_id: PartitionId,
    pub lsn: Lsn,
    /// False when an existing snapshot already covered the requested LSN.
    pub created: bool,
    pub total_files: usize,
    pub total_bytes: u64,
    pub uploaded_files: usize,
    pub uploaded_bytes: u64,
}

pub struct SnapshotProducer {
    repository: Arc<SnapshotRepository>,
    /// `<base-dir>/db-snapshots`
    export_root: PathBuf,
    node_name: String,
    /// One snapshot at a time per partition.
    in_progress: Mutex<HashMap<PartitionId, Arc<tokio::sync::Mutex<()>>>>,
    /// Snapshots kept per partition; `None` keeps all.
    num_retained: Option<usize>,
    /// Age after which unreferenced objects in the repository are deleted.
    orphan_grace: Option<Duration>,
}

impl SnapshotProducer {
    /// A producer that exports into `export_root` and publishes to `repository`, stamping every
    /// snapshot with the repository's cluster and `node_name`.
    pub fn new(
        repository: Arc<SnapshotRepository>,
        export_root: PathBuf,
        node_name: String,
    ) -> SnapshotProducer {
        SnapshotProducer {
            repository,
            export_root,
            node_name,
            in_progress: Mutex::new(HashMap::new()),
            num_retained: None,
            orphan_grace: None,
        }
    }

    /// Keeps the newest `num_retained` snapshots of each partition; older ones, the files only
    /// they use, and orphans older than `orphan_grace` are deleted after each publish.
    pub fn with_retention(mut self, num_retained: usize, orphan_grace: Duration) -> Self {
        self.num_retained = Some(num_retained);
        self.orphan_grace = Some(orphan_grace);
        self
    }

    pub fn repository(&self) -> &Arc<SnapshotRepository> {
        &self.repository
    }

    /// Snapshots `partition` and publishes it, unless the latest snapshot already covers
    /// `min_lsn` (default: the partition's applied LSN), which is then returned instead.
    pub async fn create(
        &self,
        partition: &Partition,
        min_lsn: Option<Lsn>,
        on_progress: Option<ProgressFn>,
    ) -> Result<CreatedSnapshot> {
        self.create_with(partition, min_lsn, on_progress, false)
            .await
    }

    /// [`SnapshotProducer::create`]; `full`: always a new snapshot, every file of it uploaded
    /// anew (see [`PublishOptions::full`]).
    pub async fn create_with(
        &self,
        partition: &Partition,
        min_lsn: Option<Lsn>,
        on_progress: Option<ProgressFn>,
        full: bool,
    ) -> Result<CreatedSnapshot> {
        let id = partition.id();
        let lock = self
            .in_progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id)
            .or_default()
            .clone();
        let _one_at_a_time = lock.lock().await;

        let wanted = min_lsn.unwrap_or_else(|| partition.applied_lsn());
        let tail = partition
            .log()
            .state()
            .await
            .map_err(|e| snapshot_error(id, "read log state", e))?
            .tail;
        if let Some(existing) = self.covering(id, wanted, tail).await?
            && !full
        {
            info!(partition = %id, snapshot_id = %existing.snapshot_id, lsn = %existing.lsn, "latest snapshot already covers LSN {wanted}");
            return Ok(existing);
        }
        if wanted > tail {
            return Err(Error::Snapshot {
                partition: id,
                context: "create snapshot",
                source: format!("minimum LSN {wanted} is past the log's tail {tail}").into(),
            });
        }
        partition.wait_applied(wanted).await?;

        let snapshot_id = SnapshotId::generate();
        let partition_dir = self.export_root.join(id.to_string());
        tokio::fs::create_dir_all(&partition_dir)
            .await
            .map_err(|e| snapshot_error(id, "create export folder", e))?;
        let export_dir = partition_dir.join(snapshot_id.to_string());
        let export = partition.export(export_dir.clone()).await?;
        let result = async {
            self.verify_tables(id, &export).await?;
            self.publish(partition, snapshot_id, &export, on_progress, full)
                .await
        }
        .await;
        if let Err(err) = tokio::fs::remove_dir_all(&export_dir).await {
            warn!(partition = %id, path = %export_dir.display(), "remove export folder: {err}");
        }
        result
    }

    /// Reads every block of the export's table files (see
    /// [`ColumnFamilyExport::verify_tables`]) on a blocking thread, before anything of it leaves
    /// the node.
    async fn verify_tables(&self, id: PartitionId, export: &ColumnFamilyExport) -> Result<()> {
        let (checking, started) = (export.clone(), std::time::Instant::now());
        let checked = crate::blocking(id, "check the exported table files", move || {
            checking.verify_tables(id)
        })
        .await?;
        match checked {
            Ok(()) => {
                debug!(partition = %id, duration_ms = started.elapsed().as_millis() as u64, "exported table files checked");
                Ok(())
            }
            Err(source) if source.is_damaged() => {
                let err = Error::StoreDamaged {
                    partition: id,
                    source: Box::new(source),
                    remedy: self.rebuild_remedy(id).await,
                };
                error!(partition = %id, "{err}");
                Err(err)
            }
            // The check itself could not run (a full disk, say).
            Err(source) => {
                let err = Error::Storage {
                    partition: id,
                    context: "check the exported table files (no snapshot was taken)",
                    source: Box::new(source),
                };
                warn!(partition = %id, "{err}");
                Err(err)
            }
        }
    }

    /// How to rebuild partition `id` from what the repository and the log hold.
    async fn rebuild_remedy(&self, id: PartitionId) -> String {
        match self.repository.latest(id).await {
            Ok(Some(_)) => format!(
                "The snapshots taken before are sound and the log still holds what followed \
                 them: rebuild the partition from them with `cairnctl -y partitions restore -p \
                 {id}` (if the node's partitions have stopped on the damage meanwhile, restart \
                 the node first)"
            ),
            _ => format!(
                "This cluster has no snapshot of it, so the log holds all of it: stop the node, \
                 run `cairn drop-partition -p {id}` with the node's base dir and start it again, \
                 which rebuilds the store from the log"
            ),
        }
    }

    async fn publish(
        &self,
        partition: &Partition,
        snapshot_id: SnapshotId,
        export: &ColumnFamilyExport,
        on_progress: Option<ProgressFn>,
        full: bool,
    ) -> Result<CreatedSnapshot> {
        let id = partition.id();
        let metadata = snapshot_metadata(
            export,
            snapshot_id,
            id,
            partition.key_range(),
            self.repository.cluster(),
            &self.node_name,
        );
        info!(
            partition = %id,
            %snapshot_id,
            lsn = %export.applied_lsn,
            export = %export.dir.display(),
            "Partition snapshot written"
        );
        let fence = partition.gc_fence();
        let on_progress = if cfg!(feature = "test-hooks") {
            Some(with_upload_pause(on_progress))
        } else {
            on_progress
        };
        let options = PublishOptions {
            on_progress,
            num_retained: self.num_retained,
            orphan_grace: self.orphan_grace,
            fence: fence.clone(),
            full,
            ..PublishOptions::default()
        };
        let report = self
            .repository
            .publish_with(&export.dir, metadata, options)
            .await
            .map_err(|e| snapshot_error(id, "publish snapshot", e))?;
        info!(
            partition = %id,
            %snapshot_id,
            lsn = %report.min_applied_lsn,
            files = report.files,
            bytes = report.total_bytes,
            uploaded_files = report.uploaded_files,
            uploaded_bytes = report.uploaded_bytes,
            destination = %self.repository.destination(),
            duration_ms = report.duration.as_millis() as u64,
            "Partition snapshot published"
        );
        self.collect_garbage(id, report.gc.clone(), fence).await;
        Ok(CreatedSnapshot {
            snapshot_id,
            partition_id: id,
            lsn: report.min_applied_lsn,
            created: true,
            total_files: report.files,
            total_bytes: report.total_bytes,
            uploaded_files: report.uploaded_files,
            uploaded_bytes: report.uploaded_bytes,
        })
    }

    /// Logs what the publish's garbage collection did; when the publish evicted nothing, sweeps
    /// the partition's orphans (objects left by crashed publishes) past the grace period instead.
    async fn collect_garbage(
        &self,
        partition: PartitionId,
        gc: Option<std::result::Result<GcReport, Arc<cairn_snapshots::Error>>>,
        fence: Option<cairn_snapshots::GcFence>,
    ) {
        let gc = match gc {
            Some(gc) => gc,
            None => self
                .repository
                .sweep_orphans(
                    partition,
                    self.orphan_grace.unwrap_or(DEFAULT_ORPHAN_GRACE),
                    fence,
                )
                .await
                .map_err(Arc::new),
        };
        match gc {
            Ok(report) if report.deleted_objects > 0 => info!(
                %partition,
                deleted_snapshots = ?report.deleted_snapshots.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                deleted_objects = report.deleted_objects,
                deleted_bytes = report.deleted_bytes,
                kept_young_objects = report.kept_young_objects,
                "deleted snapshots out of retention and unreferenced files"
            ),
            Ok(_) => {}
            Err(err) => {
                warn!(%partition, "snapshot garbage collection failed (retried after the next snapshot): {err}")
            }
        }
    }

    /// This cluster's latest snapshot of `partition` if it covers `lsn`. Refuses when that
    /// snapshot reaches past the log's `tail`: it is of records this log no longer has.
    async fn covering(
        &self,
        partition: PartitionId,
        lsn: Lsn,
        tail: Lsn,
    ) -> Result<Option<CreatedSnapshot>> {
        let Some(latest) = self
            .repository
            .latest(partition)
            .await
            .map_err(|e| snapshot_error(partition, "read latest.json", e))?
        else {
            return Ok(None);
        };
        if latest.min_applied_lsn < lsn {
            return Ok(None);
        }
        if latest.min_applied_lsn > tail {
            // The snapshot holds records this log does not: the base dir was put back from an
            // older copy, and the log goes on with other records at those LSNs. It covers nothing
            // of this log, and a snapshot of this log would be older than it, which the
            // repository refuses (it only moves forward): an operator must decide.
            return Err(Error::Snapshot {
                partition,
                context: "create snapshot",
                source: format!(
                    "this cluster's newest snapshot of the partition ({}) is at LSN {}, past this \
                     log's tail {tail}: it holds records this log does not (was the base dir put \
                     back from an older copy?). A snapshot of this log would be older than it; \
                     remove the partition's snapshots from the repository, or point \
                     worker.snapshots.destination elsewhere, to snapshot this log",
                    latest.snapshot_id, latest.min_applied_lsn
                )
                .into(),
            });
        }
        let metadata = self
            .repository
            .metadata(partition, latest.snapshot_id)
            .await
            .map_err(|e| snapshot_error(partition, "read snapshot metadata", e))?;
        Ok(Some(CreatedSnapshot {
            snapshot_id: latest.snapshot_id,
            partition_id: partition,
            lsn: latest.min_applied_lsn,
            created: false,
            total_files: metadata.files.len(),
            total_bytes: metadata.size(),
            uploaded_files: 0,
            uploaded_bytes: 0,
        }))
    }
}

/// `on_progress`, and the `snapshot-upload` pause point once some bytes are uploaded.
fn with_upload_pause(on_progress: Option<ProgressFn>) -> ProgressFn {
    Arc::new(move |done, total| {
        if let Some(progress) = &on_progress {
            progress(done, total);
        }
        if done > 0 {
            crate::testing::pause_point_blocking("snapshot-upload");
        }
    })
}

/// The metadata with which the producer publishes `export`, a snapshot of partition
/// `partition_id` (whose key range is `key_range`) made on node `node_name` of `cluster`:
/// RocksDB's description of each exported file, the export's applied LSN, no checksums or object
/// keys yet (publishing adds them).
pub fn snapshot_metadata(
    export: &ColumnFamilyExport,
    snapshot_id: SnapshotId,
    partition_id: PartitionId,
    key_range: KeyRange,
    cluster: &ClusterIdentity,
    node_name: &str,
) -> SnapshotMetadata {
    SnapshotMetadata {
        version: MetadataVersion::V1,
        cluster_name: cluster.cluster_name.clone(),
        partition_id,
        node_name: node_name.to_owned(),
        created_at: SystemTime::now(),
        snapshot_id,
        key_range,
        min_applied_lsn: export.applied_lsn,
        db_comparator_name: export.comparator_name.clone(),
        files: export.files.iter().map(snapshot_file).collect(),
        log_id: LogId::from(partition_id),
        cluster_created_at: Some(cluster.cluster_created_at.clone()),
        stats: None,
    }
}

/// RocksDB's description of an exported file as `metadata.json` keeps it (keys in hex), without
/// the checksum and object key that publishing adds. [`exported_file`] is the way back.
pub(crate) fn snapshot_file(file: &ExportedFile) -> SnapshotFile {
    SnapshotFile {
        column_family_name: file.column_family_name.clone(),
        name: file.name.clone(),
        directory: file.directory.clone(),
        size: file.size,
        level: file.level,
        start_key: hex(&file.start_key),
        end_key: hex(&file.end_key),
        smallest_seqno: file.smallest_seqno,
        largest_seqno: file.largest_seqno,
        num_entries: file.num_entries,
        num_deletions: file.num_deletions,
        checksum: None,
        key: None,
    }
}

/// The import description of a snapshot file, found in a staging folder under its name: the
/// way back from [`snapshot_file`]. Fails on a name that is not a plain file name or keys that
/// are not hex.
pub(crate) fn exported_file(
    file: &SnapshotFile,
) -> std::result::Result<ExportedFile, UnimportableFile> {
    let name = file.file_name()?;
    Ok(ExportedFile {
        column_family_name: file.column_family_name.clone(),
        name: format!("/{name}"),
        directory: String::new(),
        size: file.size,
        level: file.level,
        start_key: unhex(&file.start_key).ok_or_else(|| UnimportableFile::StartKeyNotHex {
            name: name.to_owned(),
        })?,
        end_key: unhex(&file.end_key).ok_or_else(|| UnimportableFile::EndKeyNotHex {
            name: name.to_owned(),
        })?,
        smallest_seqno: file.smallest_seqno,
        largest_seqno: file.largest_seqno,
        num_entries: file.num_entries,
        num_deletions: file.num_deletions,
    })
}

/// Why a file that a snapshot's metadata lists cannot be imported.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UnimportableFile {
    #[error(transparent)]
    Metadata(#[from] MetadataProblem),
    #[error("file {name} has a start key that is not hex")]
    StartKeyNotHex { name: String },
    #[error("file {name} has an end key that is not hex")]
    EndKeyNotHex { name: String },
}

fn snapshot_error(
    partition: PartitionId,
    context: &'static str,
    err: impl Into<BoxError>,
) -> Error {
    Error::Snapshot {
        partition,
        context,
        source: err.into(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_keys_decode() {
        assert_eq!(unhex("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(unhex(""), Some(vec![]));
        assert_eq!(unhex("0"), None);
        assert_eq!(unhex("zz"), None);
    }

    #[test]
    fn a_file_description_survives_the_way_to_metadata_json_and_back() {
        let file = ExportedFile {
            column_family_name: "data-3".into(),
            name: "/000030.sst".into(),
            directory: String::new(),
            size: 1469,
            level: 6,
            start_key: vec![b'd', 0, 0xff],
            end_key: vec![b'f', 1],
            smallest_seqno: 1,
            largest_seqno: 77,
            num_entries: 40,
            num_deletions: 2,
        };
        assert_eq!(
            exported_file(&snapshot_file(&file)).expect("a file Cairn exported imports"),
            file
        );
    }
}
