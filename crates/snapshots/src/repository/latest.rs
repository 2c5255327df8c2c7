//! `latest.json`: the one mutable object of a partition, naming the snapshots that are visible.
//!
//! # Consistency
//! `latest.json` changes only by compare-and-swap against the version the publisher read, so two
//! publishers can never both believe they won. On object stores that support conditional writes
//! (S3, and any store built with [`crate::SnapshotRepository::from_object_store`]) the swap is a
//! `PUT` with `If-Match: <etag>`, or `If-None-Match: *` when there was no `latest.json`.
//!
//! object_store's local file system has no conditional overwrite, so the local repository does the
//! swap itself: it takes an exclusive `flock` on `<partition>/latest.json.lock`, reads the current
//! `latest.json`, compares its content hash with the one the publisher read, writes a temporary
//! file, syncs it, renames it over `latest.json` and syncs the folder, then releases the lock.
//! Readers need no lock: a rename is atomic, so they see the old or the new file. The lock works
//! between processes and between tasks of one process, because each swap opens the lock file anew.
//!
//! # Clusters sharing one `latest.json`
//! See [`LatestSnapshot`]: every entry names its cluster, and a publish counts and evicts only
//! its own cluster's.
//!
//! # Size
//! Read whole, so read only up to [`LATEST_JSON_BYTES_MAX`].
//!
//! # Crash consistency
//! A crash before the rename leaves the old `latest.json` (and perhaps a stray temporary file,
//! which the next swap overwrites); after the rename the new one is durable once the folder is
//! synced.

use super::SnapshotRepository;
use crate::metadata::MetadataVersion;
use crate::{ClusterIdentity, Error, Result, SnapshotId};
use cairn_types::{Lsn, PartitionId};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The most a `latest.json` may hold: 1 MiB, room for thousands of retained entries of about
/// 250 bytes. A larger one is refused with [`Error::TooLarge`] before it is read.
pub const LATEST_JSON_BYTES_MAX: u64 = 1024 * 1024;

/// The content of a partition's `latest.json`, or one cluster's view of it
/// ([`LatestSnapshot::of_cluster`]). The top-level fields describe the cluster that published
/// last.
///
/// # Clusters sharing one `latest.json`
/// Two clusters of one name that share a repository (one re-created on a reset base dir) share
/// each partition's `latest.json`. Every retained entry names the [`ClusterIdentity`] that
/// published it, and a publish
///
/// - puts its snapshot first, then its own cluster's older entries, of which it keeps the newest
///   `num_retained` (retention counts a cluster's own snapshots only),
/// - then keeps every entry of any other cluster unchanged and in order: a cluster never evicts,
///   and so never deletes, another cluster's snapshots or the SSTs they reference,
/// - and writes the top-level fields (`snapshot_id`, `min_applied_lsn`, `path`, `archived_lsn`)
///   for its own cluster.
///
/// Readers use [`LatestSnapshot::of_cluster`]: the view of one cluster's entries with its own
/// archived LSN. An entry without an identity (written before entries carried one) belongs to no
/// cluster until the next publish of the cluster its `metadata.json` names, which labels it as
/// its own; one whose `metadata.json` names no creation time counts for none and is kept, like
/// another cluster's, until an operator removes it. Another cluster's entries stay visible to the garbage collector, which keeps what they
/// reference.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatestSnapshot {
    pub version: MetadataVersion,
    /// The newest snapshot; equal to `retained[0]`.
    pub snapshot_id: SnapshotId,
    pub partition_id: PartitionId,
    pub min_applied_lsn: Lsn,
    /// The newest snapshot's folder relative to the partition folder:
    /// `snapshots/<inverse_lsn>_<snapshot_id>`.
    pub path: String,
    /// Every visible snapshot: the publishing cluster's, newest first, then other clusters'.
    /// Snapshots not listed here are orphans.
    pub retained: Vec<RetainedSnapshot>,
    /// `min_applied_lsn` of the publishing cluster's oldest retained snapshot: the log may be
    /// trimmed up to here and every retained snapshot can still be restored and replayed.
    pub archived_lsn: Lsn,
}

/// A snapshot that `latest.json` keeps visible.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetainedSnapshot {
    pub snapshot_id: SnapshotId,
    pub min_applied_lsn: Lsn,
    /// The snapshot's folder relative to the partition folder.
    pub path: String,
    /// The cluster that published it; `None` in entries written before entries carried one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterIdentity>,
}

impl RetainedSnapshot {
    /// Whether `cluster` published this snapshot.
    pub fn is_of(&self, cluster: &ClusterIdentity) -> bool {
        self.cluster.as_ref() == Some(cluster)
    }
}

impl LatestSnapshot {
    /// The `latest.json` that makes `newest` the latest snapshot on top of `previous`, keeping
    /// the newest `num_retained` snapshots of `newest`'s cluster (all when `None`) and every
    /// snapshot of other clusters. Also returns the snapshots that fall out of retention, newest
    /// first, for a garbage collector to delete: only ever `newest`'s cluster's.
    pub fn with_newest(
        previous: Option<&LatestSnapshot>,
        partition_id: PartitionId,
        newest: RetainedSnapshot,
        num_retained: Option<usize>,
    ) -> (LatestSnapshot, Vec<RetainedSnapshot>) {
        let previous = previous.map(|p| p.retained.as_slice()).unwrap_or_default();
        let (older_own, others): (Vec<_>, Vec<_>) = previous
            .iter()
            .cloned()
            .partition(|r| newest.cluster.is_some() && r.cluster == newest.cluster);
        let mut retained = vec![newest.clone()];
        retained.extend(older_own);
        // The newest snapshot is always kept, whatever the bound says.
        let keep = num_retained.unwrap_or(usize::MAX).max(1);
        let evicted = if retained.len() > keep {
            retained.split_off(keep)
        } else {
            Vec::new()
        };
        let archived_lsn = retained
            .last()
            .map(|r| r.min_applied_lsn)
            .unwrap_or(newest.min_applied_lsn);
        retained.extend(others);
        let latest = LatestSnapshot {
            version: MetadataVersion::V1,
            snapshot_id: newest.snapshot_id,
            partition_id,
            min_applied_lsn: newest.min_applied_lsn,
            path: newest.path,
            retained,
            archived_lsn,
        };
        (latest, evicted)
    }

    /// The part of this `latest.json` that `cluster` published, as if it were alone: its
    /// snapshots newest first and its own archived LSN. `None` when it has none.
    pub fn of_cluster(&self, cluster: &ClusterIdentity) -> Option<LatestSnapshot> {
        let own: Vec<RetainedSnapshot> = self
            .retained
            .iter()
            .filter(|r| r.is_of(cluster))
            .cloned()
            .collect();
        let newest = own.first()?.clone();
        let oldest = own.last()?.min_applied_lsn;
        Some(LatestSnapshot {
            version: self.version,
            snapshot_id: newest.snapshot_id,
            partition_id: self.partition_id,
            min_applied_lsn: newest.min_applied_lsn,
            path: newest.path,
            retained: own,
            archived_lsn: oldest,
        })
    }

    /// The retained snapshots that `cluster` did not publish.
    pub fn of_other_clusters(&self, cluster: &ClusterIdentity) -> Vec<RetainedSnapshot> {
        self.retained
            .iter()
            .filter(|r| !r.is_of(cluster))
            .cloned()
            .collect()
    }

    pub(crate) fn from_json_at(bytes: &[u8], location: &str) -> Result<LatestSnapshot> {
        let malformed = |reason: String| Error::MalformedMetadata {
            location: location.into(),
            reason,
        };
        crate::metadata::check_version(bytes, location)?;
        let latest: LatestSnapshot =
            serde_json::from_slice(bytes).map_err(|source| Error::UndecodableMetadata {
                location: location.into(),
                source,
            })?;
        match latest.retained.first() {
            Some(first) if first.snapshot_id == latest.snapshot_id => {}
            _ => {
                return Err(malformed(
                    "its retained list does not start with its latest snapshot".into(),
                ));
            }
        }
        for retained in &latest.retained {
            super::validate_snapshot_path(&retained.path).map_err(|reason| {
                malformed(format!(
                    "snapshot {} has path {:?}: {reason}",
                    retained.snapshot_id, retained.path
                ))
            })?;
        }
        Ok(latest)
    }

    pub(crate) fn to_json_pretty(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("latest.json encodes as JSON")
    }
}

/// `latest.json` as a publisher read it, with the version that its compare-and-swap must find.
#[derive(Debug, Clone)]
pub struct LatestRead {
    pub latest: Option<LatestSnapshot>,
    pub(crate) version: LatestVersion,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum LatestVersion {
    Absent,
    /// Version of the object on a store with conditional writes.
    Object(UpdateVersion),
    /// xxh3-128 of the file's bytes, for the local repository. Two different `latest.json`s never
    /// have the same bytes: each names a different newest snapshot.
    LocalContent(u128),
}

/// How a repository swaps `latest.json`.
#[derive(Clone)]
pub(crate) enum LatestWriter {
    Conditional,
    LocalLock(Arc<LocalFileSystem>),
}

impl SnapshotRepository {
    /// Reads a partition's `latest.json` together with its version, the base for a
    /// compare-and-swap (see [`crate::PublishOptions::based_on`]).
    pub async fn read_latest(&self, partition: PartitionId) -> Result<LatestRead> {
        let location = self.latest_location(partition);
        let (bytes, version) = match &self.latest_writer {
            LatestWriter::LocalLock(fs) => {
                let path = self.local_path(fs, &location)?;
                let read = tokio::task::spawn_blocking(move || read_local(&path));
                match read.await.map_err(|e| self.join_error(&location, e))? {
                    Ok(Some(bytes)) if bytes.len() as u64 > LATEST_JSON_BYTES_MAX => {
                        return Err(self.latest_too_large(&location, bytes.len() as u64));
                    }
                    Ok(Some(bytes)) => {
                        let hash = xxhash_rust::xxh3::xxh3_128(&bytes);
                        (Some(bytes), LatestVersion::LocalContent(hash))
                    }
                    Ok(None) => (None, LatestVersion::Absent),
                    Err((path, source)) => {
                        return Err(Error::Io {
                            context: "read",
                            path,
                            source,
                        });
                    }
                }
            }
            LatestWriter::Conditional => {
                let get = self
                    .retry
                    .run("read latest.json", || async {
                        match self.store.get(&location).await {
                            Ok(result) if result.meta.size > LATEST_JSON_BYTES_MAX => {
                                Err(self.latest_too_large(&location, result.meta.size))
                            }
                            Ok(result) => {
                                let version = UpdateVersion {
                                    e_tag: result.meta.e_tag.clone(),
                                    version: result.meta.version.clone(),
                                };
                                let bytes = result
                                    .bytes()
                                    .await
                                    .map_err(|e| self.store_error("read", &location, e))?;
                                Ok(Some((bytes.to_vec(), version)))
                            }
                            Err(object_store::Error::NotFound { .. }) => Ok(None),
                            Err(e) => Err(self.store_error("read", &location, e)),
                        }
                    })
                    .await?;
                match get {
                    Some((bytes, version)) => {
                        if version.e_tag.is_none() && version.version.is_none() {
                            return Err(Error::InvalidDestination {
                                destination: self.destination(),
                                reason: "the object store returns no ETag or version for \
                                         latest.json, so it cannot be updated safely"
                                    .into(),
                            });
                        }
                        (Some(bytes), LatestVersion::Object(version))
                    }
                    None => (None, LatestVersion::Absent),
                }
            }
        };
        let latest = match bytes {
            Some(bytes) => Some(LatestSnapshot::from_json_at(
                &bytes,
                &self.describe(&location),
            )?),
            None => None,
        };
        if let Some(latest) = &latest
            && latest.partition_id != partition
        {
            return Err(Error::MalformedMetadata {
                location: self.describe(&location),
                reason: format!("it belongs to partition {}", latest.partition_id),
            });
        }
        Ok(LatestRead { latest, version })
    }

    fn latest_too_large(&self, location: &ObjectPath, size: u64) -> Error {
        Error::TooLarge {
            location: self.describe(location),
            size,
            limit: LATEST_JSON_BYTES_MAX,
            what: "a latest.json",
        }
    }

    /// Replaces `latest.json` with `new` if it is still at `expected`; [`Error::Conflict`] if not.
    pub(crate) async fn swap_latest(
        &self,
        partition: PartitionId,
        expected: &LatestVersion,
        new: &LatestSnapshot,
    ) -> Result<()> {
        let location = self.latest_location(partition);
        let bytes = new.to_json_pretty();
        let conflict = || Error::Conflict {
            partition,
            snapshot_id: new.snapshot_id,
        };
        match &self.latest_writer {
            LatestWriter::LocalLock(fs) => {
                let path = self.local_path(fs, &location)?;
                let expected = expected.clone();
                let swap =
                    tokio::task::spawn_blocking(move || swap_local(&path, &expected, &bytes));
                match swap.await.map_err(|e| self.join_error(&location, e))? {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(conflict()),
                    Err((context, path, source)) => Err(Error::Io {
                        context,
                        path,
                        source,
                    }),
                }
            }
            LatestWriter::Conditional => {
                let mode = match expected {
                    LatestVersion::Absent => PutMode::Create,
                    LatestVersion::Object(version) => PutMode::Update(version.clone()),
                    LatestVersion::LocalContent(_) => {
                        // A `LatestRead` from a local repository handed to an object-store one.
                        return Err(conflict());
                    }
                };
                // Not retried: a request whose response was lost may have succeeded, and its
                // retry would then report a conflict with itself.
                let put = self
                    .store
                    .put_opts(&location, PutPayload::from(bytes), PutOptions::from(mode))
                    .await;
                match put {
                    Ok(_) => Ok(()),
                    Err(
                        object_store::Error::Precondition { .. }
                        | object_store::Error::AlreadyExists { .. }
                        | object_store::Error::NotModified { .. },
                    ) => {
                        // The client may have retried a request that had in fact succeeded; then
                        // the "conflict" is with ourselves, and latest.json names our snapshot.
                        let now = self.read_latest(partition).await?;
                        match now.latest {
                            Some(latest) if latest == *new => Ok(()),
                            _ => Err(conflict()),
                        }
                    }
                    Err(e) => Err(self.store_error("update", &location, e)),
                }
            }
        }
    }

    pub(super) fn local_path(
        &self,
        fs: &LocalFileSystem,
        location: &ObjectPath,
    ) -> Result<PathBuf> {
        fs.path_to_filesystem(location)
            .map_err(|e| self.store_error("locate", location, e))
    }
}

/// Reads a local `latest.json`, at most one byte past [`LATEST_JSON_BYTES_MAX`] (enough for the
/// caller to refuse it).
fn read_local(path: &Path) -> Result<Option<Vec<u8>>, (PathBuf, std::io::Error)> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err((path.to_path_buf(), e)),
    };
    let mut bytes = Vec::new();
    file.take(LATEST_JSON_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| (path.to_path_buf(), e))?;
    Ok(Some(bytes))
}

type LocalSwapError = (&'static str, PathBuf, std::io::Error);

/// The local compare-and-swap; `Ok(false)` when `latest.json` is no longer at `expected`.
fn swap_local(path: &Path, expected: &LatestVersion, bytes: &[u8]) -> Result<bool, LocalSwapError> {
    let dir = path
        .parent()
        .ok_or_else(|| {
            (
                "find the folder of",
                path.to_path_buf(),
                std::io::Error::other("no parent folder"),
            )
        })?
        .to_path_buf();
    let err = |context: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| (context, path, source)
    };
    std::fs::create_dir_all(&dir).map_err(err("create", &dir))?;
    let lock_path = dir.join("latest.json.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(err("open", &lock_path))?;
    // Released when `lock` is dropped, on every return path.
    lock.lock().map_err(err("lock", &lock_path))?;

    let current = match read_local(path).map_err(|(p, e)| ("read", p, e))? {
        Some(bytes) => LatestVersion::LocalContent(xxhash_rust::xxh3::xxh3_128(&bytes)),
        None => LatestVersion::Absent,
    };
    if &current != expected {
        return Ok(false);
    }
    let tmp = dir.join("latest.json.tmp");
    let mut file = std::fs::File::create(&tmp).map_err(err("create", &tmp))?;
    file.write_all(bytes).map_err(err("write", &tmp))?;
    file.sync_all().map_err(err("sync", &tmp))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(err("rename over", path))?;
    std::fs::File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(err("sync", &dir))?;
    drop(lock);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours() -> ClusterIdentity {
        ClusterIdentity::new("c", "2026-01-01T00:00:00.000Z")
    }

    fn theirs() -> ClusterIdentity {
        ClusterIdentity::new("c", "2025-01-01T00:00:00.000Z")
    }

    fn retained(lsn: u64) -> RetainedSnapshot {
        retained_of(lsn, Some(ours()))
    }

    fn retained_of(lsn: u64, cluster: Option<ClusterIdentity>) -> RetainedSnapshot {
        RetainedSnapshot {
            snapshot_id: SnapshotId::from_ulid(u128::from(lsn)),
            min_applied_lsn: Lsn(lsn),
            path: format!("snapshots/{lsn}"),
            cluster,
        }
    }

    #[test]
    fn retention_counts_and_evicts_only_the_publishing_clusters_snapshots() {
        let p = PartitionId(3);
        // The old cluster got to LSN 301; one legacy entry carries no identity.
        let (old, _) = LatestSnapshot::with_newest(None, p, retained_of(5, None), None);
        let (old, _) =
            LatestSnapshot::with_newest(Some(&old), p, retained_of(301, Some(theirs())), None);
        assert_eq!(old.of_cluster(&theirs()).unwrap().archived_lsn, Lsn(301));
        assert!(old.of_cluster(&ours()).is_none());

        // The new cluster publishes at LSN 50 and 60, keeping one of its own.
        let (new, evicted) = LatestSnapshot::with_newest(Some(&old), p, retained(50), Some(1));
        assert!(evicted.is_empty());
        let (new, evicted) = LatestSnapshot::with_newest(Some(&new), p, retained(60), Some(1));
        assert_eq!(evicted, vec![retained(50)]);
        assert_eq!(
            new.retained,
            vec![
                retained(60),
                retained_of(301, Some(theirs())),
                retained_of(5, None)
            ]
        );
        assert_eq!(
            (new.snapshot_id, new.archived_lsn),
            (retained(60).snapshot_id, Lsn(60))
        );
        let view = new.of_cluster(&ours()).unwrap();
        assert_eq!(view.retained, vec![retained(60)]);
        assert_eq!(view.archived_lsn, Lsn(60));
        let view = new.of_cluster(&theirs()).unwrap();
        assert_eq!(
            (view.min_applied_lsn, view.archived_lsn),
            (Lsn(301), Lsn(301))
        );
        assert_eq!(new.of_other_clusters(&ours()).len(), 2);
    }

    #[test]
    fn the_newest_goes_first_and_the_archived_lsn_is_the_oldest_retained() {
        let p = PartitionId(3);
        let (first, evicted) = LatestSnapshot::with_newest(None, p, retained(10), None);
        assert!(evicted.is_empty());
        assert_eq!(first.archived_lsn, Lsn(10));
        assert_eq!(first.retained, vec![retained(10)]);
        let (second, _) = LatestSnapshot::with_newest(Some(&first), p, retained(20), None);
        assert_eq!(second.snapshot_id, retained(20).snapshot_id);
        assert_eq!(second.retained, vec![retained(20), retained(10)]);
        assert_eq!(second.archived_lsn, Lsn(10));

        let (third, evicted) = LatestSnapshot::with_newest(Some(&second), p, retained(30), Some(2));
        assert_eq!(third.retained, vec![retained(30), retained(20)]);
        assert_eq!(evicted, vec![retained(10)]);
        assert_eq!(third.archived_lsn, Lsn(20));

        let (fourth, evicted) = LatestSnapshot::with_newest(Some(&third), p, retained(40), Some(0));
        assert_eq!(fourth.retained, vec![retained(40)]);
        assert_eq!(evicted, vec![retained(30), retained(20)]);
    }

    #[test]
    fn local_swap_compares_against_the_content_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("1").join("latest.json");
        assert!(swap_local(&path, &LatestVersion::Absent, b"one").unwrap());
        // A second create loses.
        assert!(!swap_local(&path, &LatestVersion::Absent, b"two").unwrap());
        let one = LatestVersion::LocalContent(xxhash_rust::xxh3::xxh3_128(b"one"));
        assert!(swap_local(&path, &one, b"two").unwrap());
        // The first reader's version is stale now.
        assert!(!swap_local(&path, &one, b"three").unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
    }
}
