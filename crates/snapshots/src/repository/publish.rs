//! Publishing a snapshot: SSTs that are not in the repository yet, then `metadata.json`, then
//! `latest.json`. See the [repository's documentation](super#crash-consistency) for why this
//! order leaves no visible partial snapshot. When the swap evicts snapshots, publish then
//! [collects the partition's garbage](super::gc); a failure there does not fail the publish.

use super::gc::{DEFAULT_ORPHAN_GRACE, GcOptions, GcReport};
use super::hashing::Progress;
use super::latest::{LatestRead, LatestSnapshot, RetainedSnapshot};
use super::{SnapshotRepository, snapshot_folder};
use crate::metadata::PublishStats;
use crate::{Checksum, Error, Result, SnapshotId, SnapshotMetadata};
use cairn_types::{Lsn, PartitionId};
use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Called with `(bytes_done, bytes_total)` as a publish progresses; files already in the
/// repository count as done at once.
pub type ProgressFn = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// A point in publishing after which `PublishOptions::stop_after` can stop (feature
/// `test-util`).
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishStep {
    /// Every SST file is in `ssts/`.
    SstsUploaded,
    /// `metadata.json` is written; `latest.json` is not updated yet.
    MetadataWritten,
}

/// How to publish.
#[derive(Clone, Default)]
pub struct PublishOptions {
    /// Keep this many of this cluster's snapshots visible (at least the new one); all when
    /// `None`. The ones that fall out are returned in [`PublishReport::evicted`] and deleted right
    /// away, with the SSTs that only they referenced, by a garbage collection
    /// ([`PublishReport::gc`]). Other clusters' snapshots are neither counted nor evicted.
    pub num_retained: Option<usize>,
    /// How old other unreferenced objects of the partition must be for the garbage collection
    /// that follows an eviction to delete them (they may belong to a publish in flight);
    /// [`DEFAULT_ORPHAN_GRACE`] when `None`.
    pub orphan_grace: Option<Duration>,
    /// Swap `latest.json` only if it is still as read here; by default publish reads it when it
    /// starts. Either way, a `latest.json` changed by someone else in the meantime makes the
    /// publish fail with [`Error::Conflict`].
    pub based_on: Option<LatestRead>,
    pub on_progress: Option<ProgressFn>,
    /// Upload every file anew, even one the repository holds a good copy of (a "full sync", for
    /// a repository one no longer trusts): the objects are named by their content, so the new
    /// copy replaces the old one with the same bytes.
    pub full: bool,
    /// Asked before the garbage collection that follows the publish deletes anything (see
    /// [`GcOptions::fence`]).
    pub fence: Option<crate::GcFence>,
    /// Stop with `Error::StoppedAfter` once this step is done, as a crash there would: for
    /// fault tests.
    #[cfg(feature = "test-util")]
    pub stop_after: Option<PublishStep>,
}

/// What a publish did.
#[derive(Debug, Clone)]
pub struct PublishReport {
    pub snapshot_id: SnapshotId,
    pub partition_id: PartitionId,
    pub min_applied_lsn: Lsn,
    /// The snapshot's folder relative to the partition folder.
    pub path: String,
    pub files: usize,
    pub total_bytes: u64,
    pub uploaded_files: usize,
    pub uploaded_bytes: u64,
    /// Names of the files that were uploaded; the others were in the repository already.
    pub uploaded: Vec<String>,
    /// Snapshots no longer retained, newest first.
    pub evicted: Vec<RetainedSnapshot>,
    /// The garbage collection that ran after the swap because it evicted snapshots: `None` when
    /// nothing was evicted. Its failure does not fail the publish (the snapshot is visible
    /// either way) but leaves garbage for a later collection; the caller should log it.
    pub gc: Option<Result<GcReport, Arc<Error>>>,
    /// The metadata as published, with checksums and object keys.
    pub metadata: SnapshotMetadata,
    /// Time until the snapshot became visible; the garbage collection after it is not counted.
    pub duration: Duration,
}

struct PublishedFile {
    checksum: Checksum,
    key: String,
    uploaded: bool,
}

impl SnapshotRepository {
    /// Publishes the export in `export_dir` described by `metadata` (whose files are at
    /// `export_dir/<name>`), retaining every older snapshot.
    pub async fn publish(
        &self,
        export_dir: &Path,
        metadata: SnapshotMetadata,
    ) -> Result<PublishReport> {
        self.publish_with(export_dir, metadata, PublishOptions::default())
            .await
    }

    /// [`SnapshotRepository::publish`] with options. `metadata` must name this repository's
    /// cluster ([`Error::ForeignSnapshot`] if not).
    pub async fn publish_with(
        &self,
        export_dir: &Path,
        mut metadata: SnapshotMetadata,
        options: PublishOptions,
    ) -> Result<PublishReport> {
        let started = Instant::now();
        let partition = metadata.partition_id;
        let snapshot_id = metadata.snapshot_id;
        self.check_publishable(export_dir, &metadata)?;
        // Read latest.json first: refusing an out-of-date snapshot costs nothing now, and the
        // swap at the end must be against what was read here.
        let base = match options.based_on.clone() {
            Some(base) => base,
            None => self.read_latest(partition).await?,
        };
        let previous = self
            .adopt_own_unlabelled(partition, base.latest.clone())
            .await;
        self.check_newer_than_latest(&metadata, previous.as_ref())?;

        // 1. SST files.
        let uploaded = self
            .publish_files(
                export_dir,
                &mut metadata,
                options.on_progress.clone(),
                options.full,
            )
            .await?;
        #[cfg(feature = "test-util")]
        stop_if_asked(&options, PublishStep::SstsUploaded)?;

        // 2. metadata.json.
        let folder = snapshot_folder(metadata.min_applied_lsn, snapshot_id);
        let metadata = self.write_metadata(&folder, metadata).await?;
        #[cfg(feature = "test-util")]
        stop_if_asked(&options, PublishStep::MetadataWritten)?;

        // 3. latest.json: the snapshot becomes visible.
        let newest = RetainedSnapshot {
            snapshot_id,
            min_applied_lsn: metadata.min_applied_lsn,
            path: folder.clone(),
            cluster: Some(self.cluster.clone()),
        };
        let (latest, evicted) =
            LatestSnapshot::with_newest(previous.as_ref(), partition, newest, options.num_retained);
        self.swap_latest(partition, &base.version, &latest).await?;
        let duration = started.elapsed();
        let gc = self.collect_evicted(&metadata, &evicted, &options).await;

        let report = PublishReport {
            snapshot_id,
            partition_id: partition,
            min_applied_lsn: metadata.min_applied_lsn,
            path: folder,
            files: metadata.files.len(),
            total_bytes: metadata.size(),
            uploaded_files: uploaded.len(),
            uploaded_bytes: metadata.stats.map_or(0, |s| s.uploaded_bytes),
            uploaded,
            evicted,
            gc,
            duration,
            metadata,
        };
        // The caller reports the publish to the operator (the worker logs it once per snapshot).
        Ok(report)
    }

    /// Refuses metadata that is malformed or names another cluster than this repository's.
    fn check_publishable(&self, export_dir: &Path, metadata: &SnapshotMetadata) -> Result<()> {
        metadata
            .validate()
            .map_err(|problem| Error::MalformedMetadata {
                location: format!("the metadata of the export in {}", export_dir.display()),
                reason: problem.to_string(),
            })?;
        let ours = metadata.cluster_name == self.cluster.cluster_name
            && metadata.cluster_created_at.as_deref()
                == Some(self.cluster.cluster_created_at.as_str());
        if !ours {
            return Err(Error::ForeignSnapshot {
                snapshot_id: metadata.snapshot_id,
                found_cluster: metadata.cluster_name.clone(),
                found_created_at: metadata.cluster_created_at.clone(),
                repository_cluster: self.cluster.clone(),
            });
        }
        Ok(())
    }

    /// Refuses a snapshot already published, or older than this cluster's latest one (so that
    /// its `latest.json` view never goes back). Other clusters' snapshots do not count.
    fn check_newer_than_latest(
        &self,
        metadata: &SnapshotMetadata,
        previous: Option<&LatestSnapshot>,
    ) -> Result<()> {
        let (partition, snapshot_id) = (metadata.partition_id, metadata.snapshot_id);
        let Some(latest) = previous else {
            return Ok(());
        };
        if latest.retained.iter().any(|r| r.snapshot_id == snapshot_id) {
            return Err(Error::AlreadyPublished {
                partition,
                snapshot_id,
            });
        }
        if let Some(own) = latest.of_cluster(&self.cluster)
            && metadata.min_applied_lsn < own.min_applied_lsn
        {
            return Err(Error::OlderThanLatest {
                partition,
                snapshot_id,
                min_applied_lsn: metadata.min_applied_lsn,
                latest_snapshot_id: own.snapshot_id,
                latest_lsn: own.min_applied_lsn,
            });
        }
        Ok(())
    }

    /// `latest` with its entries that name no cluster (written before entries named one)
    /// labelled as this cluster's where their `metadata.json` says they are: the first publish
    /// after an upgrade adopts its cluster's older snapshots, so retention counts them. An entry
    /// whose `metadata.json` cannot be read or names no creation time stays unlabelled: it counts
    /// for no cluster and is kept.
    async fn adopt_own_unlabelled(
        &self,
        partition: PartitionId,
        latest: Option<LatestSnapshot>,
    ) -> Option<LatestSnapshot> {
        let mut latest = latest?;
        for entry in latest.retained.iter_mut().filter(|r| r.cluster.is_none()) {
            let ours = match self.read_metadata(partition, entry).await {
                Ok((_, metadata)) => {
                    metadata.cluster_name == self.cluster.cluster_name
                        && metadata.cluster_created_at.as_deref()
                            == Some(self.cluster.cluster_created_at.as_str())
                }
                Err(_) => false,
            };
            if ours {
                entry.cluster = Some(self.cluster.clone());
            }
        }
        Some(latest)
    }

    /// Puts every file of the export in `ssts/` (uploading those not there, checking those
    /// that are), and records each file's checksum and key and the upload stats in `metadata`.
    /// Returns the names of the files uploaded.
    async fn publish_files(
        &self,
        export_dir: &Path,
        metadata: &mut SnapshotMetadata,
        on_progress: Option<ProgressFn>,
        full: bool,
    ) -> Result<Vec<String>> {
        let partition = metadata.partition_id;
        let progress = Progress::new(metadata.size(), on_progress);
        // Owned items: a stream over borrowed ones makes the future unusable with tokio::spawn
        // (rust-lang/rust#102211).
        let progress = &progress;
        let published: Vec<PublishedFile> = futures::stream::iter(metadata.files.clone())
            .map(|file| async move {
                self.publish_file(partition, export_dir, &file, progress, full)
                    .await
            })
            .buffered(self.transfer_concurrency)
            .try_collect()
            .await?;
        let mut stats = PublishStats::default();
        let mut uploaded = Vec::new();
        for (file, published) in metadata.files.iter_mut().zip(published) {
            file.checksum = Some(published.checksum);
            file.key = Some(published.key);
            if published.uploaded {
                stats.uploaded_files += 1;
                stats.uploaded_bytes += file.size;
                uploaded.push(file.name.clone());
            }
        }
        metadata.stats = Some(stats);
        Ok(uploaded)
    }

    /// Writes `metadata.json` into `folder`, create-only: an existing one means this id was
    /// published before. A retry of a publish that stopped after this step goes on if it is the
    /// same snapshot, with the stats as first written (they count what the first attempt
    /// uploaded). Returns the metadata as stored.
    async fn write_metadata(
        &self,
        folder: &str,
        metadata: SnapshotMetadata,
    ) -> Result<SnapshotMetadata> {
        let (partition, snapshot_id) = (metadata.partition_id, metadata.snapshot_id);
        let location = self.object_path(partition, &format!("{folder}/metadata.json"));
        let payload = PutPayload::from(metadata.to_json_pretty());
        let created = self
            .retry
            .run("write metadata.json", || async {
                match self
                    .store
                    .put_opts(
                        &location,
                        payload.clone(),
                        PutOptions::from(PutMode::Create),
                    )
                    .await
                {
                    Ok(_) => Ok(true),
                    Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
                    Err(e) => Err(self.store_error("write", &location, e)),
                }
            })
            .await?;
        if created {
            return Ok(metadata);
        }
        self.same_metadata_written_before(&location, metadata)
            .await?
            .ok_or(Error::AlreadyPublished {
                partition,
                snapshot_id,
            })
    }

    /// After a swap that evicted snapshots, deletes them and what only they referenced; a
    /// failure is logged and reported, not returned: the snapshot is visible either way.
    async fn collect_evicted(
        &self,
        metadata: &SnapshotMetadata,
        evicted: &[RetainedSnapshot],
        options: &PublishOptions,
    ) -> Option<Result<GcReport, Arc<Error>>> {
        if evicted.is_empty() {
            return None;
        }
        let (partition, snapshot_id) = (metadata.partition_id, metadata.snapshot_id);
        let gc_options = GcOptions {
            orphan_grace: options.orphan_grace.unwrap_or(DEFAULT_ORPHAN_GRACE),
            evicted: evicted.to_vec(),
            fence: options.fence.clone(),
        };
        let collected = self.collect_garbage(partition, &gc_options).await;
        if let Err(error) = &collected {
            tracing::warn!(
                %snapshot_id,
                %partition,
                %error,
                "published snapshot, but could not collect the snapshots it evicted; a later \
                 collection deletes them"
            );
        }
        Some(collected.map_err(Arc::new))
    }

    /// The `metadata.json` at `location` if it describes the same snapshot as `ours` (ignoring
    /// the stats), else `None`.
    async fn same_metadata_written_before(
        &self,
        location: &object_store::path::Path,
        ours: SnapshotMetadata,
    ) -> Result<Option<SnapshotMetadata>> {
        let bytes = self
            .retry
            .run("read metadata.json", || async {
                let result = self
                    .store
                    .get(location)
                    .await
                    .map_err(|e| self.store_error("read", location, e))?;
                result
                    .bytes()
                    .await
                    .map_err(|e| self.store_error("read", location, e))
            })
            .await?;
        let existing = SnapshotMetadata::from_json_at(&bytes, &self.describe(location))?;
        let without_stats = |m: &SnapshotMetadata| SnapshotMetadata {
            stats: None,
            ..m.clone()
        };
        Ok((without_stats(&existing) == without_stats(&ours)).then_some(existing))
    }

    /// Hashes one export file and uploads it unless the repository holds a good copy already
    /// (and the publish is not `full`).
    async fn publish_file(
        &self,
        partition: PartitionId,
        export_dir: &Path,
        file: &crate::SnapshotFile,
        progress: &Progress,
        full: bool,
    ) -> Result<PublishedFile> {
        let name = file
            .file_name()
            .map_err(|problem| Error::MalformedMetadata {
                location: format!("the metadata of the export in {}", export_dir.display()),
                reason: problem.to_string(),
            })?;
        let path = export_dir.join(name);
        let (size, checksum) = super::hashing::hash_file(&path).await?;
        if size != file.size {
            return Err(Error::BadExport {
                path,
                reason: format!("it has {size} bytes, but the metadata says {}", file.size),
            });
        }
        let key = format!("ssts/{}.sst", checksum.hex());
        let location = self.object_path(partition, &key);
        if !full && self.holds_good_copy(&location, size, checksum).await? {
            tracing::debug!(file = name, key, "sst already in the repository");
            progress.advance(size);
            return Ok(PublishedFile {
                checksum,
                key,
                uploaded: false,
            });
        }
        self.upload_file(&path, &location, Some(checksum), progress)
            .await?;
        self.remember_uploaded(&location).await;
        tracing::debug!(file = name, key, size, "uploaded sst");
        Ok(PublishedFile {
            checksum,
            key,
            uploaded: true,
        })
    }
}

#[cfg(feature = "test-util")]
fn stop_if_asked(options: &PublishOptions, step: PublishStep) -> Result<()> {
    if options.stop_after == Some(step) {
        return Err(Error::StoppedAfter { step });
    }
    Ok(())
}
