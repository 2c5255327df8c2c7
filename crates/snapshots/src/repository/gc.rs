//! Garbage collection of a partition folder: deleting the snapshot folders that `latest.json` no
//! longer retains and the SSTs that no retained snapshot references.
//!
//! # The rule
//! An object under `snapshots/` or `ssts/` is *garbage* when `latest.json` does not retain its
//! snapshot folder and no retained snapshot's `metadata.json` names it. Garbage is deleted
//!
//! - at once if it belongs to a snapshot named in [`GcOptions::evicted`]: the folder of a snapshot
//!   that our own `latest.json` swap just evicted, and the SSTs its `metadata.json` referenced.
//!   Those were published (and referenced) before, so no publish in flight can be writing them;
//! - otherwise only once it is at least [`GcOptions::orphan_grace`] old (by the store's
//!   `last_modified`): a publish in flight uploads its SSTs and writes its `metadata.json` before
//!   it swaps `latest.json`, and until then its objects look exactly like garbage.
//!
//! A local repository's staged copies (`ssts/<object>#<digits>`, left by an upload that was
//! interrupted before its rename) are garbage too, by the grace rule; object_store's listing
//! does not show them, so the collection lists the `ssts` folder itself.
//!
//! A snapshot folder goes whole or not at all, judged by its newest object. `latest.json`,
//! `latest.json.lock` and anything else outside `snapshots/` and `ssts/` is never touched.
//!
//! **Invariant:** nothing that a snapshot retained by `latest.json` (as read at the start of the
//! collection) references is ever deleted, whichever cluster retains it: the snapshots of another
//! cluster sharing the repository are references like this cluster's. When that set cannot be known for sure (a retained
//! `metadata.json` is missing or unreadable, or `latest.json` is malformed) the collection stops
//! before deleting anything.
//!
//! # Crash consistency
//! Deleting happens in three rounds: the garbage SSTs, then the objects of garbage folders other
//! than `metadata.json`, then the garbage folders' `metadata.json`. None of them is referenced by a
//! retained snapshot, so a crash anywhere loses nothing a restore needs; what is left is garbage
//! that a later collection sweeps. `metadata.json` goes last because it is the record of what an
//! evicted snapshot referenced: a collection retried with the same `evicted` list still finds the
//! SSTs to delete at once. A later collection without that list sweeps them by the grace rule.
//! Dropping a collection's future has the same effect as a crash.
//!
//! # Consistency
//! Publishes of one partition are assumed to run one at a time (its leader publishes), and
//! [`SnapshotRepository::publish_with`] collects right after its own swap. Just before deleting,
//! the collection reads `latest.json` again and stops with [`Error::LatestChangedDuringGc`] if it
//! changed. That narrows, but cannot close, the window of a known race that the object store gives
//! no way to prevent: a publish on another node that finds an SST already stored (by content hash),
//! reuses it instead of uploading it, and swaps `latest.json` while a collection on this node
//! deletes that SST as garbage. The new snapshot then lacks a file; restore verifies every file's
//! checksum, refuses it and falls back to the next older retained snapshot.
//!
//! The grace rule relies on clocks: set the grace well above the longest publish plus the skew
//! between this node's clock and the store's.

use super::SnapshotRepository;
use super::latest::RetainedSnapshot;
use crate::{Error, Result, SnapshotId};
use cairn_types::PartitionId;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use object_store::path::Path as ObjectPath;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

/// Asked before a garbage collection of a partition deletes anything: `Err(reason)` stops it.
pub type GcFence = std::sync::Arc<
    dyn Fn(
            PartitionId,
        )
            -> futures::future::BoxFuture<'static, std::result::Result<(), cairn_types::Fenced>>
        + Send
        + Sync,
>;

/// How old an unreferenced object must be before a collection deletes it, unless it belongs to a
/// snapshot just evicted: one hour, far longer than a publish takes, so that a publish in flight
/// never loses the SSTs and `metadata.json` it wrote before swapping `latest.json`.
pub const DEFAULT_ORPHAN_GRACE: Duration = Duration::from_secs(60 * 60);

/// The folder of a partition holding the snapshot folders.
const SNAPSHOTS_FOLDER: &str = "snapshots";
/// The folder of a partition holding the SSTs, shared by its snapshots.
const SSTS_FOLDER: &str = "ssts";
const METADATA_FILE: &str = "metadata.json";

/// How to collect garbage; see the [module documentation](self) for the rule.
#[derive(Clone)]
pub struct GcOptions {
    /// Unreferenced objects younger than this are kept: they may belong to a publish in flight.
    pub orphan_grace: Duration,
    /// Asked right before anything is deleted (after `latest.json` was read again): a collection
    /// that it refuses deletes nothing. A cluster's node checks that it still leads the partition
    /// at its epoch by the metadata store, so that a deposed leader never deletes what its
    /// successor's snapshots use.
    pub fence: Option<GcFence>,
    /// Snapshots that a `latest.json` swap has just evicted ([`crate::PublishReport::evicted`]).
    /// Their folders and the SSTs only they referenced are deleted without waiting for the grace
    /// period. A snapshot that `latest.json` retains again is never deleted, whatever this says.
    pub evicted: Vec<RetainedSnapshot>,
}

impl std::fmt::Debug for GcOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GcOptions")
            .field("orphan_grace", &self.orphan_grace)
            .field("evicted", &self.evicted)
            .field("fence", &self.fence.is_some())
            .finish()
    }
}

impl Default for GcOptions {
    /// The orphan sweep: nothing evicted, the default grace period.
    fn default() -> Self {
        GcOptions {
            orphan_grace: DEFAULT_ORPHAN_GRACE,
            evicted: Vec::new(),
            fence: None,
        }
    }
}

/// What a garbage collection of one partition did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcReport {
    pub partition_id: PartitionId,
    /// Snapshots whose folders were deleted, in folder order (newest first). A folder whose name
    /// holds no snapshot id is deleted too but not listed here.
    pub deleted_snapshots: Vec<SnapshotId>,
    /// Objects deleted: SSTs, `metadata.json`s and anything else in deleted folders.
    pub deleted_objects: usize,
    pub deleted_bytes: u64,
    /// Unreferenced objects kept because they are younger than the grace period; a later
    /// collection deletes them unless a publish makes them visible.
    pub kept_young_objects: usize,
    pub kept_young_bytes: u64,
    pub duration: Duration,
}

impl SnapshotRepository {
    /// Deletes the garbage of `partition`: snapshot folders that `latest.json` does not retain
    /// and SSTs that no retained snapshot references, at once for the snapshots in
    /// `options.evicted` and after `options.orphan_grace` for the rest. See the
    /// [rule and its invariant](super::gc).
    ///
    /// Fails without deleting anything if `latest.json` or a retained snapshot's `metadata.json`
    /// cannot be read, or if `latest.json` changes during the collection. A failure while
    /// deleting leaves only garbage behind, which the next collection sweeps.
    pub async fn collect_garbage(
        &self,
        partition: PartitionId,
        options: &GcOptions,
    ) -> Result<GcReport> {
        let started = Instant::now();
        // Taken before listing, so ages are never overestimated.
        let now = SystemTime::now();

        let read = self.read_latest(partition).await?;
        let references = self
            .references(partition, read.latest.as_ref(), &options.evicted)
            .await?;
        let mut objects = self.list_partition(partition).await?;
        objects.extend(self.list_staged_local(partition).await?);
        let plan = plan_deletions(objects, &references, now, options.orphan_grace);

        let mut report = GcReport {
            partition_id: partition,
            deleted_snapshots: Vec::new(),
            deleted_objects: 0,
            deleted_bytes: 0,
            kept_young_objects: plan.kept_young.len(),
            kept_young_bytes: plan.kept_young.iter().map(|o| o.size).sum(),
            duration: Duration::ZERO,
        };
        if !plan.is_empty() {
            // A latest.json swapped since it was read may reference what we are about to delete.
            let again = self.read_latest(partition).await?;
            if again.latest != read.latest {
                return Err(Error::LatestChangedDuringGc { partition });
            }
            if let Some(fence) = &options.fence
                && let Err(fenced) = fence(partition).await
            {
                return Err(Error::GcFenced {
                    partition,
                    source: fenced,
                });
            }
            self.execute(partition, plan, &mut report).await?;
        }
        report.duration = started.elapsed();
        tracing::info!(
            %partition,
            deleted_snapshots = report.deleted_snapshots.len(),
            deleted_objects = report.deleted_objects,
            deleted_bytes = report.deleted_bytes,
            kept_young_objects = report.kept_young_objects,
            duration = ?report.duration,
            destination = %self.destination(),
            "collected snapshot garbage"
        );
        Ok(report)
    }

    /// The orphan sweep: [`SnapshotRepository::collect_garbage`] with nothing evicted, deleting
    /// unreferenced objects at least `orphan_grace` old, such as the leftovers of a crashed or
    /// conflicting publish.
    pub async fn sweep_orphans(
        &self,
        partition: PartitionId,
        orphan_grace: Duration,
        fence: Option<GcFence>,
    ) -> Result<GcReport> {
        let options = GcOptions {
            orphan_grace,
            evicted: Vec::new(),
            fence,
        };
        self.collect_garbage(partition, &options).await
    }

    /// What the retained snapshots reference (every `metadata.json` must be read) and what the
    /// evicted ones did (best effort: an unreadable one falls back to the grace rule).
    async fn references(
        &self,
        partition: PartitionId,
        latest: Option<&super::LatestSnapshot>,
        evicted: &[RetainedSnapshot],
    ) -> Result<References> {
        let retained = latest.map(|l| l.retained.clone()).unwrap_or_default();
        let retained_metadata: Vec<_> = futures::stream::iter(retained.clone())
            .map(|snapshot| async move { self.read_metadata(partition, &snapshot).await })
            .buffered(self.transfer_concurrency)
            .try_collect()
            .await?;
        let mut references = References::default();
        for (snapshot, (_, metadata)) in retained.iter().zip(&retained_metadata) {
            references.retained_folders.insert(snapshot.path.clone());
            for file in &metadata.files {
                // Publishing writes a key for every file; without one there is no telling which
                // object the file is, so nothing may be deleted.
                let key = file.key.clone().ok_or_else(|| Error::BadFile {
                    snapshot_id: snapshot.snapshot_id,
                    name: file.name.clone(),
                    key: "<none>".into(),
                    problem: crate::FileProblem::NotPublished,
                })?;
                references.live_keys.insert(key);
            }
        }

        let evicted: Vec<RetainedSnapshot> = evicted
            .iter()
            .filter(|e| !references.retained_folders.contains(&e.path))
            .filter(|e| super::validate_snapshot_path(&e.path).is_ok())
            .cloned()
            .collect();
        let evicted_metadata: Vec<_> = futures::stream::iter(evicted.clone())
            .map(|snapshot| async move { self.read_metadata(partition, &snapshot).await })
            .buffered(self.transfer_concurrency)
            .collect()
            .await;
        for (snapshot, metadata) in evicted.into_iter().zip(evicted_metadata) {
            match metadata {
                Ok((_, metadata)) => references.evicted_keys.extend(
                    metadata
                        .files
                        .into_iter()
                        .filter_map(|f| f.key)
                        .filter(|key| !references.live_keys.contains(key)),
                ),
                Err(error) => tracing::info!(
                    %partition,
                    snapshot_id = %snapshot.snapshot_id,
                    %error,
                    "cannot read an evicted snapshot's metadata.json; its SSTs wait for the \
                     grace period"
                ),
            }
            references
                .evicted_folders
                .insert(snapshot.path, snapshot.snapshot_id);
        }
        Ok(references)
    }

    /// Every object under the partition folder, with its key relative to that folder.
    async fn list_partition(&self, partition: PartitionId) -> Result<Vec<ListedObject>> {
        let folder = self.partition_folder(partition);
        let listed: Vec<object_store::ObjectMeta> = self
            .retry
            .run("list partition", || async {
                self.store
                    .list(Some(&folder))
                    .try_collect()
                    .await
                    .map_err(|e| self.store_error("list", &folder, e))
            })
            .await?;
        Ok(listed
            .into_iter()
            .filter_map(|meta| {
                let key = meta
                    .location
                    .prefix_match(&folder)?
                    .map(|part| part.as_ref().to_owned())
                    .collect::<Vec<_>>()
                    .join("/");
                Some(ListedObject {
                    key,
                    size: meta.size,
                    last_modified: SystemTime::from(meta.last_modified),
                    location: meta.location,
                    staged_path: None,
                })
            })
            .collect())
    }

    /// A local repository's staged copies in the partition's `ssts` folder (see
    /// [`super::upload`]), which object_store's listing leaves out. Empty for other stores.
    async fn list_staged_local(&self, partition: PartitionId) -> Result<Vec<ListedObject>> {
        let super::LatestWriter::LocalLock(fs) = &self.latest_writer else {
            return Ok(Vec::new());
        };
        let folder = self.object_path(partition, SSTS_FOLDER);
        let dir = self.local_path(fs, &folder)?;
        let listed = tokio::task::spawn_blocking(move || list_staged(&dir))
            .await
            .map_err(|e| self.join_error(&folder, e))?
            .map_err(|(path, source)| Error::Io {
                context: "list",
                path,
                source,
            })?;
        Ok(listed
            .into_iter()
            .map(|staged| ListedObject {
                location: folder.clone().join(staged.name.as_str()),
                key: format!("{SSTS_FOLDER}/{}", staged.name),
                size: staged.size,
                last_modified: staged.modified,
                staged_path: Some(staged.path),
            })
            .collect())
    }

    /// Deletes what `plan` says, in the crash-safe order, adding to `report` as it goes.
    async fn execute(
        &self,
        partition: PartitionId,
        plan: DeletionPlan,
        report: &mut GcReport,
    ) -> Result<()> {
        self.delete_all(plan.ssts, report).await?;
        let (metadata, others): (Vec<_>, Vec<_>) = plan
            .folders
            .iter()
            .flat_map(|folder| folder.objects.iter().cloned())
            .partition(|object| object.key.ends_with(&format!("/{METADATA_FILE}")));
        self.delete_all(others, report).await?;
        self.delete_all(metadata, report).await?;
        for folder in plan.folders {
            self.remove_empty_local_folder(partition, &folder.path)
                .await;
            report.deleted_snapshots.extend(folder.snapshot_id);
        }
        Ok(())
    }

    /// Deletes objects in parallel (bounded), each retried; stops at the first failure.
    async fn delete_all(&self, objects: Vec<ListedObject>, report: &mut GcReport) -> Result<()> {
        let mut deletions = futures::stream::iter(objects)
            .map(|object| async move {
                let deleted = match &object.staged_path {
                    Some(path) => delete_staged(path).await?,
                    None => self.delete_object(&object.location).await?,
                };
                Ok::<_, Error>(deleted.then_some(object.size))
            })
            .buffer_unordered(self.transfer_concurrency);
        while let Some(deleted) = deletions.next().await {
            if let Some(size) = deleted? {
                report.deleted_objects += 1;
                report.deleted_bytes += size;
            }
        }
        Ok(())
    }

    /// Deletes one object; `false` if it was gone already (another collection got there first).
    async fn delete_object(&self, location: &ObjectPath) -> Result<bool> {
        self.retry
            .run("delete", || async {
                match self.store.delete(location).await {
                    Ok(()) => Ok(true),
                    Err(object_store::Error::NotFound { .. }) => Ok(false),
                    Err(e) => Err(self.store_error("delete", location, e)),
                }
            })
            .await
    }

    /// A local repository keeps a directory per snapshot folder, which object_store leaves behind
    /// when the folder's last file goes. Best effort: a directory that is not empty stays.
    async fn remove_empty_local_folder(&self, partition: PartitionId, folder: &str) {
        if let super::LatestWriter::LocalLock(fs) = &self.latest_writer
            && let Ok(path) = self.local_path(fs, &self.object_path(partition, folder))
        {
            let _ = tokio::fs::remove_dir(path).await;
        }
    }
}

/// A staged copy found in a local `ssts` folder.
struct StagedFile {
    name: String,
    size: u64,
    modified: SystemTime,
    path: PathBuf,
}

/// Staged copies in a local `ssts` folder.
fn list_staged(
    dir: &std::path::Path,
) -> std::result::Result<Vec<StagedFile>, (PathBuf, std::io::Error)> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err((dir.to_path_buf(), e)),
    };
    let mut staged = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| (dir.to_path_buf(), e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !super::upload::is_staged_name(&name) {
            continue;
        }
        let path = entry.path();
        match entry.metadata() {
            Ok(meta) => staged.push(StagedFile {
                name,
                size: meta.len(),
                modified: meta.modified().unwrap_or_else(|_| SystemTime::now()),
                path,
            }),
            // Renamed into place or deleted since the listing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err((path, e)),
        }
    }
    Ok(staged)
}

/// Deletes a staged copy; `false` if it was gone already.
async fn delete_staged(path: &std::path::Path) -> Result<bool> {
    match tokio::fs::remove_file(path).await {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(Error::Io {
            context: "delete",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// An object under a partition folder, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ListedObject {
    location: ObjectPath,
    /// A local repository's staged copy, which object_store cannot address: deleted by path.
    staged_path: Option<PathBuf>,
    /// Relative to the partition folder: `ssts/<hash>.sst`, `snapshots/<folder>/metadata.json`.
    key: String,
    size: u64,
    last_modified: SystemTime,
}

/// What must stay and what may go at once, known before listing.
#[derive(Debug, Default)]
struct References {
    /// Folders (`snapshots/<inverse_lsn>_<id>`) of the snapshots that `latest.json` retains.
    retained_folders: HashSet<String>,
    /// Keys of the objects that retained snapshots reference: never deleted.
    live_keys: HashSet<String>,
    /// Folders of evicted snapshots that `latest.json` does not retain, with their ids.
    evicted_folders: HashMap<String, SnapshotId>,
    /// Keys that evicted snapshots referenced and no retained one does.
    evicted_keys: HashSet<String>,
}

/// What a collection deletes, in the order it deletes it.
#[derive(Debug, Default)]
struct DeletionPlan {
    /// Garbage SSTs, deleted first.
    ssts: Vec<ListedObject>,
    /// Garbage snapshot folders, each deleted whole, `metadata.json` last.
    folders: Vec<FolderDeletion>,
    /// Garbage younger than the grace period, kept.
    kept_young: Vec<ListedObject>,
}

#[derive(Debug)]
struct FolderDeletion {
    /// `snapshots/<name>`, relative to the partition folder.
    path: String,
    snapshot_id: Option<SnapshotId>,
    objects: Vec<ListedObject>,
}

impl DeletionPlan {
    fn is_empty(&self) -> bool {
        self.ssts.is_empty() && self.folders.is_empty()
    }
}

/// Decides what to delete; no IO, so every case can be tested. See the [module documentation](self)
/// for the rule.
fn plan_deletions(
    objects: Vec<ListedObject>,
    references: &References,
    now: SystemTime,
    orphan_grace: Duration,
) -> DeletionPlan {
    let old_enough = |object: &ListedObject| {
        // A last_modified ahead of our clock counts as brand new.
        now.duration_since(object.last_modified)
            .unwrap_or(Duration::ZERO)
            >= orphan_grace
    };
    let mut plan = DeletionPlan::default();
    // Ordered, so that folders are deleted and reported newest first.
    let mut folders: BTreeMap<String, Vec<ListedObject>> = BTreeMap::new();
    for object in objects {
        let mut segments = object.key.splitn(3, '/');
        match (segments.next(), segments.next()) {
            (Some(SSTS_FOLDER), Some(_)) => {
                if references.live_keys.contains(&object.key) {
                    continue;
                }
                if references.evicted_keys.contains(&object.key) || old_enough(&object) {
                    plan.ssts.push(object);
                } else {
                    plan.kept_young.push(object);
                }
            }
            (Some(SNAPSHOTS_FOLDER), Some(name)) => {
                let folder = format!("{SNAPSHOTS_FOLDER}/{name}");
                folders.entry(folder).or_default().push(object);
            }
            // latest.json, latest.json.lock and whatever else is not ours to delete.
            _ => {}
        }
    }
    for (path, objects) in folders {
        // A retained snapshot referencing an object in another folder is odd, but it wins.
        let holds_live = objects
            .iter()
            .any(|o| references.live_keys.contains(&o.key));
        if references.retained_folders.contains(&path) || holds_live {
            continue;
        }
        let evicted = references.evicted_folders.get(&path).copied();
        if evicted.is_some() || objects.iter().all(old_enough) {
            let snapshot_id = evicted.or_else(|| snapshot_id_of_folder(&path));
            plan.folders.push(FolderDeletion {
                path,
                snapshot_id,
                objects,
            });
        } else {
            plan.kept_young.extend(objects);
        }
    }
    plan
}

/// The snapshot id in a folder name `snapshots/<inverse_lsn>_<snapshot_id>`.
fn snapshot_id_of_folder(path: &str) -> Option<SnapshotId> {
    let name = path.strip_prefix("snapshots/")?;
    let (_inverse_lsn, id) = name.split_once('_')?;
    id.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot_folder;
    use cairn_types::Lsn;

    const HOUR: Duration = Duration::from_secs(3600);

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000)
    }

    /// An object of `size` bytes written `age` before [`now`].
    fn object(key: &str, size: u64, age: Duration) -> ListedObject {
        ListedObject {
            location: ObjectPath::from(format!("prefix/1/{key}")),
            key: key.into(),
            size,
            last_modified: now() - age,
            staged_path: None,
        }
    }

    fn folder(lsn: u64) -> (String, SnapshotId) {
        let id = SnapshotId::from_ulid(u128::from(lsn));
        (snapshot_folder(Lsn(lsn), id), id)
    }

    fn keys(objects: &[ListedObject]) -> Vec<&str> {
        let mut keys: Vec<_> = objects.iter().map(|o| o.key.as_str()).collect();
        keys.sort();
        keys
    }

    /// Snapshot 30 retained (referencing a and b), 20 evicted (referenced b and c), 10 an old
    /// orphan, 40 a young orphan (a publish in flight, referencing d).
    fn scenario() -> (Vec<ListedObject>, References) {
        let (retained, _) = folder(30);
        let (evicted, evicted_id) = folder(20);
        let (old_orphan, _) = folder(10);
        let (young_orphan, _) = folder(40);
        let minute = Duration::from_secs(60);
        let objects = vec![
            object("latest.json", 10, 2 * HOUR),
            object("latest.json.lock", 0, 2 * HOUR),
            object("latest.json.tmp", 10, 2 * HOUR),
            object(&format!("{retained}/metadata.json"), 100, 2 * HOUR),
            object(&format!("{evicted}/metadata.json"), 100, minute),
            object(&format!("{old_orphan}/metadata.json"), 100, 3 * HOUR),
            object(&format!("{young_orphan}/metadata.json"), 100, minute),
            object("ssts/a.sst", 1000, 2 * HOUR),
            object("ssts/b.sst", 2000, 2 * HOUR),
            object("ssts/c.sst", 3000, minute),
            object("ssts/d.sst", 4000, minute),
            object("ssts/old.sst", 5000, 3 * HOUR),
        ];
        let references = References {
            retained_folders: [retained].into(),
            live_keys: ["ssts/a.sst".to_string(), "ssts/b.sst".to_string()].into(),
            evicted_folders: [(evicted, evicted_id)].into(),
            evicted_keys: ["ssts/c.sst".to_string()].into(),
        };
        (objects, references)
    }

    #[test]
    fn evicted_snapshots_go_at_once_and_orphans_after_the_grace_period() {
        let (objects, references) = scenario();
        let plan = plan_deletions(objects, &references, now(), HOUR);
        assert_eq!(keys(&plan.ssts), vec!["ssts/c.sst", "ssts/old.sst"]);
        let deleted: Vec<_> = plan.folders.iter().map(|f| f.path.clone()).collect();
        assert_eq!(deleted, vec![folder(20).0, folder(10).0], "newest first");
        assert_eq!(plan.folders[0].snapshot_id, Some(folder(20).1));
        assert_eq!(plan.folders[1].snapshot_id, Some(folder(10).1));
        let young = format!("{}/metadata.json", folder(40).0);
        assert_eq!(keys(&plan.kept_young), vec![young.as_str(), "ssts/d.sst"]);
    }

    #[test]
    fn with_no_grace_every_unreferenced_object_goes_and_the_rest_stays() {
        let (objects, references) = scenario();
        let plan = plan_deletions(objects.clone(), &references, now(), Duration::ZERO);
        assert!(plan.kept_young.is_empty());
        assert_eq!(
            keys(&plan.ssts),
            vec!["ssts/c.sst", "ssts/d.sst", "ssts/old.sst"]
        );
        let deleted: Vec<_> = plan.folders.iter().map(|f| f.path.clone()).collect();
        assert_eq!(deleted, vec![folder(40).0, folder(20).0, folder(10).0]);
        // Never latest.json and its companions, never what a retained snapshot references.
        let planned: Vec<&ListedObject> = plan
            .ssts
            .iter()
            .chain(plan.folders.iter().flat_map(|f| &f.objects))
            .collect();
        for kept in [
            "latest.json",
            "latest.json.lock",
            "latest.json.tmp",
            "ssts/a.sst",
            "ssts/b.sst",
        ] {
            assert!(planned.iter().all(|o| o.key != kept), "{kept}");
        }
        let retained = format!("{}/metadata.json", folder(30).0);
        assert!(planned.iter().all(|o| o.key != retained));
    }

    #[test]
    fn a_referenced_object_is_kept_even_if_evicted_or_ancient() {
        let (objects, mut references) = scenario();
        // The caller names a retained snapshot and a live SST as evicted.
        let (retained, retained_id) = folder(30);
        references.evicted_folders.insert(retained, retained_id);
        references.evicted_keys.insert("ssts/a.sst".into());
        let plan = plan_deletions(objects, &references, now(), Duration::ZERO);
        let planned: Vec<_> = plan
            .ssts
            .iter()
            .chain(plan.folders.iter().flat_map(|f| &f.objects))
            .map(|o| o.key.clone())
            .collect();
        assert!(!planned.iter().any(|k| k == "ssts/a.sst"));
        assert!(!planned.iter().any(|k| k.starts_with(&folder(30).0)));

        // An orphan folder holding an object that a retained snapshot names stays whole.
        let (orphan, _) = folder(60);
        let live = format!("{orphan}/000001.sst");
        let objects = vec![
            object(&format!("{orphan}/metadata.json"), 100, 3 * HOUR),
            object(&live, 10, 3 * HOUR),
        ];
        let references = References {
            live_keys: [live].into(),
            ..References::default()
        };
        let plan = plan_deletions(objects, &references, now(), Duration::ZERO);
        assert!(plan.is_empty() && plan.kept_young.is_empty());
    }

    #[test]
    fn a_folder_goes_whole_judged_by_its_newest_object() {
        let (path, id) = folder(50);
        let objects = vec![
            object(&format!("{path}/metadata.json"), 100, 2 * HOUR),
            object(&format!("{path}/stray"), 7, Duration::from_secs(5)),
        ];
        let plan = plan_deletions(objects.clone(), &References::default(), now(), HOUR);
        assert!(plan.folders.is_empty());
        assert_eq!(plan.kept_young.len(), 2);

        let plan = plan_deletions(objects, &References::default(), now() + HOUR, HOUR);
        assert_eq!(plan.folders.len(), 1);
        assert_eq!(plan.folders[0].snapshot_id, Some(id));
        assert_eq!(plan.folders[0].objects.len(), 2);
    }

    #[test]
    fn an_object_from_the_future_counts_as_new() {
        let objects = vec![object("ssts/x.sst", 1, Duration::ZERO)];
        let plan = plan_deletions(objects, &References::default(), now() - HOUR, HOUR);
        assert!(plan.ssts.is_empty());
        assert_eq!(plan.kept_young.len(), 1);
    }

    #[test]
    fn folder_names_give_their_snapshot_id() {
        let (path, id) = folder(7);
        assert_eq!(snapshot_id_of_folder(&path), Some(id));
        assert_eq!(snapshot_id_of_folder("snapshots/not-a-snapshot"), None);
        assert_eq!(snapshot_id_of_folder("snapshots/0_snap_2"), None);
    }
}
