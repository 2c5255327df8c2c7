//! Offline tools for operators: they work on a node's base dir while the node is stopped.

use crate::config::{Config, LogProviderKind, MetadataProviderKind};
use crate::node::{
    connect_nats_logs, connect_nats_metadata, local_log_options, lock_base_dir, open_repository,
};
use anyhow::{Context, bail};
use cairn_log::LogProvider;
use cairn_log::local::LocalLogProvider;
use cairn_metadata::local::LocalMetadataStore;
use cairn_metadata::{ClusterRecord, MetadataStore, get_typed};
use cairn_partition_store::{PartitionStoreManager, StoreOptions};
use cairn_types::{Lsn, PartitionId};

/// What [`drop_partition`] removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedPartition {
    pub partition: PartitionId,
    /// The last log record the dropped store had applied; `None` for a store that could not
    /// be opened.
    pub applied_lsn: Option<Lsn>,
}

/// Drops one partition's local store (its RocksDB database) from the base dir of a stopped
/// node. At the next start the partition restores from a snapshot (with
/// `snapshot-restore-policy = "on-init"`, or when its log is trimmed) or replays its whole log.
///
/// Unless `force`, refuses when nothing could bring the data back: the log is trimmed and no
/// snapshot of this cluster in the repository reaches its trim point (another cluster's, of the
/// same name on a reset base dir, holds other records).
pub fn drop_partition(
    config: &Config,
    partition: PartitionId,
    force: bool,
) -> anyhow::Result<DroppedPartition> {
    let base_dir = &config.base_dir;
    if !base_dir.join("db").is_dir() {
        bail!(
            "{} holds no partition store; pass the node's --base-dir (or its --config)",
            base_dir.display()
        );
    }
    let _lock =
        lock_base_dir(base_dir).context("the node must be stopped to drop a partition's store")?;
    let db_dir = base_dir.join("db");
    let stores = PartitionStoreManager::open(&db_dir, &StoreOptions::default()).map_err(|err| {
        let damaged = err.is_damaged();
        let err = anyhow::Error::new(err);
        if damaged {
            err.context(crate::node::store_damaged(&db_dir))
        } else {
            err.context("open the partition store")
        }
    })?;
    if !stores.has_store(partition) {
        bail!(
            "partition {partition} has no store in {}; nothing to drop",
            base_dir.display()
        );
    }
    // A store that cannot be opened (a damaged file) is dropped all the same: that is what
    // rebuilding it from the log takes.
    let applied_lsn = stores
        .partition(partition)
        .and_then(|store| store.applied_lsn().ok());
    if !force {
        recoverable(config, partition)?;
    }
    stores
        .drop_partition(partition)
        .with_context(|| format!("drop the store of partition {partition}"))?;
    Ok(DroppedPartition {
        partition,
        applied_lsn,
    })
}

/// Fails, saying why, if the partition could not be rebuilt after its store is dropped.
///
/// The file-system steps (opening the log's folder, the metadata file, a local repository's
/// folder) run on this thread between the async steps, never inside them.
fn recoverable(config: &Config, partition: PartitionId) -> anyhow::Result<()> {
    let runtime = offline_runtime()?;
    // The runtime's context without running it: what is opened here may spawn tasks on it.
    let _runtime_context = runtime.enter();
    let logs: Box<dyn LogProvider> = match config.log.provider {
        LogProviderKind::Local => Box::new(
            LocalLogProvider::open(config.base_dir.join("log"), local_log_options(config))
                .context("open the local log")?,
        ),
        LogProviderKind::Nats => Box::new(runtime.block_on(connect_nats_logs(config))?),
    };
    let log_state = runtime.block_on(async {
        let log = logs
            .open(cairn_types::LogId::from(partition))
            .await
            .with_context(|| format!("open the log of partition {partition}"))?;
        anyhow::Ok(log.find_tail().await?)
    })?;
    let (trim_point, tail) = (log_state.trim_point, log_state.tail);
    if trim_point == Lsn::ZERO {
        return Ok(()); // the whole log is there to replay
    }
    let force = "pass --force to drop it anyway";
    let repository = match this_clusters_repository(config, &runtime)? {
        Ok(repository) => repository,
        Err(NoRepository::Disabled) => bail!(
            "the log of partition {partition} is trimmed up to LSN {trim_point} and there is no snapshot repository (worker.snapshots.destination = \"none\"): this store is the only copy of those records; {force}"
        ),
        Err(NoRepository::NoClusterRecord(base_dir)) => bail!(
            "{} holds no cluster record, so there is no telling which snapshots are this cluster's; {force}",
            base_dir.display()
        ),
    };
    let latest = runtime
        .block_on(repository.latest(partition))
        .context("read the snapshot repository")?;
    match latest {
        // A snapshot past the log's tail is refused by restore: it holds records this log
        // does not (the base dir was put back from an older copy).
        Some(latest) if latest.min_applied_lsn > tail => bail!(
            "the log of partition {partition} is trimmed up to LSN {trim_point} and its newest snapshot ({}) is at LSN {}, past the log's tail {tail}: it holds records this log does not (was the base dir put back from an older copy?), so a restore cannot use it and this store is the only copy of records up to {trim_point}; snapshot the partition first, or {force}",
            latest.snapshot_id,
            latest.min_applied_lsn
        ),
        Some(latest) if latest.min_applied_lsn >= trim_point => Ok(()),
        Some(latest) => bail!(
            "the log of partition {partition} is trimmed up to LSN {trim_point} but its newest snapshot ({}) covers only up to LSN {}: this store is the only copy of records {}..={trim_point}; snapshot the partition first, or {force}",
            latest.snapshot_id,
            latest.min_applied_lsn,
            latest.min_applied_lsn.next()
        ),
        None => bail!(
            "the log of partition {partition} is trimmed up to LSN {trim_point} and {} holds no snapshot of it taken by this cluster: this store is the only copy of those records; snapshot the partition first, or {force}",
            repository.destination()
        ),
    }
}

/// Why [`this_clusters_repository`] has no repository to look in.
enum NoRepository {
    /// `worker.snapshots.destination = "none"`.
    Disabled,
    /// The base dir (resolved) holds no cluster record.
    NoClusterRecord(std::path::PathBuf),
}

/// The snapshot repository of the cluster whose record the node's metadata holds, as the node
/// opens it (its snapshots are this cluster's only).
fn this_clusters_repository(
    config: &Config,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<Result<cairn_snapshots::SnapshotRepository, NoRepository>> {
    if !config.snapshots_enabled() {
        return Ok(Err(NoRepository::Disabled));
    }
    let base_dir = config
        .base_dir
        .canonicalize()
        .with_context(|| format!("resolve {}", config.base_dir.display()))?;
    let metadata: Box<dyn MetadataStore> = match config.metadata.provider {
        MetadataProviderKind::Local => Box::new(
            LocalMetadataStore::open(&base_dir.join("metadata.json"))
                .context("open the node's metadata")?,
        ),
        MetadataProviderKind::Nats => Box::new(runtime.block_on(connect_nats_metadata(config))?),
    };
    let Some((_, cluster)) = runtime.block_on(get_typed::<ClusterRecord>(
        metadata.as_ref(),
        ClusterRecord::KEY,
        "cluster record",
    ))?
    else {
        return Ok(Err(NoRepository::NoClusterRecord(base_dir)));
    };
    Ok(Ok(open_repository(config, &base_dir, &cluster)?))
}

/// What [`repair_log`] did to a partition's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRepair {
    pub partition: PartitionId,
    /// Why the log was refused.
    pub refused: String,
    /// Where the log's trim point was moved, and what holds the records up to there.
    pub trimmed_to: Option<(Lsn, Holder)>,
    /// The cut of the log after its valid records, when nothing held past the damage.
    pub cut: Option<cairn_log::local::CutReport>,
    /// The store's applied LSN, when it is past where the log now ends.
    pub store_ahead: Option<Lsn>,
}

/// What holds a partition's records up to an LSN besides its log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// The partition's store on this node, which has applied them.
    Store,
    /// A snapshot in this cluster's repository.
    Snapshot(String),
}

/// Mends the local log of `partition` in the base dir of a stopped node when it is refused for
/// damaged or missing records, giving up as little as it can and no other partition's records:
///
/// - When the partition's store has applied past the damage, or its newest snapshot covers it,
///   the log's trim point moves up to that LSN (the lower of the two when both do): the damaged
///   records are then ones the log no longer needs. Nothing is lost; a partition whose store is
///   behind the new trim point restores from the snapshot at the next start.
/// - Otherwise (or when more damage lies past that point), the log is cut at the end of its
///   valid records ([`cairn_log::local::cut_log`]): the records from the first damaged or
///   missing one on are given up, and the segments keep every other log's records.
///
/// `confirm` is asked, with what is about to happen, before each change; `false` stops there.
pub fn repair_log(
    config: &Config,
    partition: PartitionId,
    mut confirm: impl FnMut(&str) -> anyhow::Result<bool>,
    on_read_back: ReadBackProgress,
) -> anyhow::Result<LogRepair> {
    use cairn_log::local::{cut_log, inspect_log, trim_log_offline};
    if !matches!(config.log.provider, LogProviderKind::Local) {
        bail!(
            "log.provider is \"nats\": repair-log mends the node's local log, and a partition's log is a NATS stream here"
        );
    }
    let base_dir = &config.base_dir;
    let log_dir = base_dir.join("log");
    if !log_dir.join("wal").is_dir() {
        bail!(
            "{} holds no log; pass the node's --base-dir (or its --config)",
            base_dir.display()
        );
    }
    let _lock =
        lock_base_dir(base_dir).context("the node must be stopped to repair a partition's log")?;
    let options = local_log_options(config);
    let log_id = cairn_types::LogId::from(partition);
    let mut seen = inspect_log(&log_dir, log_id, &options).context("read the log")?;
    if !seen.known {
        bail!(
            "{} holds no log of partition {partition}: no partition of that number has written to it",
            log_dir.display()
        );
    }
    let applied = store_applied_lsn(base_dir, partition);
    let Some(refused) = seen.refused.clone() else {
        // The log opens, but it may have lost its end: records the store applied.
        let end = seen.highest_seen.max(seen.trim_point);
        let Some(applied) = applied.filter(|applied| applied.0 > end) else {
            bail!("the log of partition {partition} opens as it is; there is nothing to repair");
        };
        let asked = format!(
            "The log of partition {partition} ends at LSN {end}, but its store has applied it up to LSN {applied}: the log lost records {}..={applied}, and the store holds them. Moving the log's trim point up to LSN {applied} gives up nothing; the log goes on after it. Until the partition's next snapshot (`cairnctl snapshots create -p {partition}` once the node serves), the store is the only copy of those records. Move it?",
            end + 1
        );
        if !confirm(&asked)? {
            bail!("cancelled; nothing was changed");
        }
        trim_log_offline(&log_dir, log_id, applied.0, &options)
            .with_context(|| format!("move the trim point of partition {partition}'s log"))?;
        return Ok(LogRepair {
            partition,
            refused: format!("the log ends at LSN {end}, before the store's LSN {applied}"),
            trimmed_to: Some((applied, Holder::Store)),
            cut: None,
            store_ahead: None,
        });
    };
    if seen.trim_point_damaged {
        bail!(
            "{refused}. The damaged file is the log's trim point or its accepted damage, which repair-log does not mend: put it back from a backup"
        );
    }
    if seen.refused_all {
        bail!(
            "{refused}. This is not the damage of one partition's log, so repair-log cannot mend it: put the file back from a backup, or, for damaged bytes, cut the shared segment at their offset (`truncate -s <offset> <segment>`), which gives up every partition's records after it"
        );
    }
    let mut repair = LogRepair {
        partition,
        refused: refused.clone(),
        trimmed_to: None,
        cut: None,
        store_ahead: None,
    };
    // A repository that cannot be read leaves the store and the cut: said in the question.
    let (mut newest, mut unread) = match newest_snapshot(config, partition) {
        Ok(newest) => (newest, String::new()),
        Err(err) => (
            None,
            format!(
                " (The snapshot repository could not be read, and a snapshot there may reach further: {err:#}.)"
            ),
        ),
    };
    // Trims while something holds the log's records past its damage: a second trim when there is
    // more damage past the first. The trim points only move up, so this ends.
    loop {
        // Past the damage. The store may reach past the log's highest record too (the log lost
        // its end: the log then goes on after the store's LSN); a snapshot may not, since one
        // past everything the log holds may be of an earlier history of this base dir.
        let covers = |lsn: Lsn| lsn.0 > seen.valid_through && lsn.0 > seen.trim_point;
        // At the same LSN, the snapshot: the store is then not the records' only copy.
        let covering = [
            newest
                .as_ref()
                .filter(|(_, lsn)| covers(*lsn) && lsn.0 <= seen.highest_seen)
                .map(|(id, lsn)| (*lsn, Holder::Snapshot(id.clone()))),
            applied.filter(|a| covers(*a)).map(|a| (a, Holder::Store)),
        ]
        .into_iter()
        .flatten()
        .min_by_key(|(lsn, _)| *lsn);
        let Some((lsn, holder)) = covering else {
            break;
        };
        // A snapshot is relied on only once its files read back whole: if it could not be
        // restored, the older ones would lie below the new trim point.
        if let Holder::Snapshot(snapshot) = &holder
            && let Err(err) = verify_snapshot(config, snapshot, &on_read_back)
        {
            unread = format!(
                " (Snapshot {snapshot} at LSN {lsn} does not read back whole, so it is not relied on: {err:#}.)"
            );
            newest = None;
            continue;
        }
        let why = match &holder {
            Holder::Store => format!(
                "The partition's store has applied the log up to LSN {lsn}, past the damage: moving the log's trim point up to LSN {lsn} gives up no record that the store does not hold. Until the partition's next snapshot (`cairnctl snapshots create -p {partition}` once the node serves), the store is the only copy of those records."
            ),
            Holder::Snapshot(snapshot) => format!(
                "Snapshot {snapshot} holds the partition up to LSN {lsn}, past the damage: moving the log's trim point up to LSN {lsn} gives up no record that the snapshot does not hold, and the partition restores from the snapshot at the next start if its store is behind it."
            ),
        };
        let now_refused = seen.refused.clone().unwrap_or_else(|| refused.clone());
        let asked = format!(
            "The log of partition {partition} is refused: {now_refused}\n\n{why}{unread} Move it?"
        );
        if !confirm(&asked)? {
            bail!(
                "cancelled; {}",
                if repair.trimmed_to.is_some() {
                    "the trim point was moved once, nothing else was changed"
                } else {
                    "nothing was changed"
                }
            );
        }
        seen = trim_log_offline(&log_dir, log_id, lsn.0, &options)
            .with_context(|| format!("move the trim point of partition {partition}'s log"))?;
        repair.trimmed_to = Some((lsn, holder));
        // Opened, and not behind the store: done. (Behind it, the next turn trims to it.)
        let end = seen.highest_seen.max(seen.trim_point);
        if seen.refused.is_none() && applied.is_none_or(|applied| applied.0 <= end) {
            return Ok(repair);
        }
    }
    if seen.refused.is_none() {
        return Ok(repair);
    }
    // A snapshot past everything the log holds would lie above the cut: a restore could later
    // take its records for the ones the log gives to new writes.
    if let Some((snapshot, lsn)) = newest
        .as_ref()
        .filter(|(_, lsn)| lsn.0 > seen.valid_through)
    {
        bail!(
            "{}. The newest snapshot of partition {partition} ({snapshot}) is at LSN {lsn}, past everything its log holds (LSN {}): either the log lost records that the snapshot holds, or the snapshot is of an earlier history of this base dir. repair-log does not choose between them: restore the partition from a backup of its log, or remove that snapshot from the repository if it is not this history's, and run repair-log again",
            seen.refused.as_deref().unwrap_or(&refused),
            seen.highest_seen
        );
    }
    let given_up = seen.valid_through + 1;
    let held = match (&repair.trimmed_to, &newest) {
        (Some(_), _) => "The log is refused again past its new trim point.".to_string(),
        (None, Some((snapshot, lsn))) => format!(
            "Neither the partition's store nor its newest snapshot ({snapshot}, LSN {lsn}) reaches past the damage."
        ),
        (None, None) => {
            "Neither the partition's store nor a snapshot reaches past the damage.".to_string()
        }
    };
    let asked = format!(
        "The log of partition {partition} is refused: {}\n\n{held}{unread} Cutting the log at the end of its valid records gives up its records LSN {given_up}..={}: writes to partition {partition} that were acknowledged. The other partitions' records are kept, and a copy of each rewritten segment is kept beside it. Cut it?",
        seen.refused.as_deref().unwrap_or(&refused),
        seen.highest_seen.max(given_up)
    );
    if !confirm(&asked)? {
        bail!(
            "cancelled{}",
            if repair.trimmed_to.is_some() {
                "; the trim point was moved, nothing was cut"
            } else {
                "; nothing was changed"
            }
        );
    }
    let cut = cut_log(&log_dir, log_id, &options)
        .with_context(|| format!("cut the log of partition {partition}"))?;
    repair.store_ahead = applied.filter(|applied| applied.0 > cut.tail);
    repair.cut = Some(cut);
    Ok(repair)
}

/// The newest snapshot of `partition` in this cluster's repository, if there is one to look in.
fn newest_snapshot(
    config: &Config,
    partition: PartitionId,
) -> anyhow::Result<Option<(String, Lsn)>> {
    let Some((runtime, repository)) = readable_repository(config)? else {
        return Ok(None);
    };
    let _runtime_context = runtime.enter();
    let latest = runtime
        .block_on(repository.latest(partition))
        .context("read the snapshot repository")?;
    Ok(latest.map(|l| (l.snapshot_id.to_string(), l.min_applied_lsn)))
}

/// A runtime for an offline tool's async steps, driven from the calling thread.
fn offline_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
}

/// This cluster's snapshot repository, with the runtime to read it on; `None` when there is none
/// to read (snapshots are off, or the base dir holds no cluster record).
fn readable_repository(
    config: &Config,
) -> anyhow::Result<Option<(tokio::runtime::Runtime, cairn_snapshots::SnapshotRepository)>> {
    let runtime = offline_runtime()?;
    let repository = {
        // Opening it may spawn tasks on the runtime.
        let _runtime_context = runtime.enter();
        this_clusters_repository(config, &runtime)?
    };
    Ok(repository.ok().map(|repository| (runtime, repository)))
}

/// Told how far the read-back of a snapshot has come: the snapshot, the bytes read back so far and
/// its size. A large snapshot takes a while to read back whole.
pub type ReadBackProgress = std::sync::Arc<dyn Fn(&str, u64, u64) + Send + Sync>;

/// Reads every file of snapshot `id` back from this cluster's repository and checks it, as
/// `cairnctl snapshots verify` does: a snapshot that a trim is about to rely on must restore.
fn verify_snapshot(config: &Config, id: &str, progress: &ReadBackProgress) -> anyhow::Result<()> {
    let Some((runtime, repository)) = readable_repository(config)? else {
        bail!("there is no snapshot repository to read it from");
    };
    let _runtime_context = runtime.enter();
    let snapshot: cairn_snapshots::SnapshotId = id.parse().context("read the snapshot id")?;
    let (progress, id) = (progress.clone(), id.to_string());
    let on_progress: cairn_snapshots::ProgressFn =
        std::sync::Arc::new(move |done, total| progress(&id, done, total));
    runtime.block_on(repository.verify_with_progress(snapshot, Some(on_progress)))?;
    Ok(())
}

/// The LSN up to which the partition's store has applied its log, if the store opens.
fn store_applied_lsn(base_dir: &std::path::Path, partition: PartitionId) -> Option<Lsn> {
    let stores =
        PartitionStoreManager::open(&base_dir.join("db"), &StoreOptions::default()).ok()?;
    stores.partition(partition)?.applied_lsn().ok()
}
