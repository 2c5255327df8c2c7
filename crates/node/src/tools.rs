//! Offline tools for operators: they work on a node's base dir while the node is stopped.

use crate::config::{Config, LogProviderKind, MetadataProviderKind};
use crate::node::{connect_nats_logs, connect_nats_metadata, lock_base_dir, open_repository};
use anyhow::{Context, bail};
use cairn_log::LogProvider;
use cairn_log::local::{LocalLogOptions, LocalLogProvider};
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
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    // The runtime's context without running it: what is opened here may spawn tasks on it.
    let _runtime_context = runtime.enter();
    let logs: Box<dyn LogProvider> = match config.log.provider {
        LogProviderKind::Local => Box::new(
            LocalLogProvider::open(config.base_dir.join("log"), LocalLogOptions::default())
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
    if !config.snapshots_enabled() {
        bail!(
            "the log of partition {partition} is trimmed up to LSN {trim_point} and there is no snapshot repository (worker.snapshots.destination = \"none\"): this store is the only copy of those records; {force}"
        );
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
        bail!(
            "{} holds no cluster record, so there is no telling which snapshots are this cluster's; {force}",
            base_dir.display()
        );
    };
    let repository = open_repository(config, &base_dir, &cluster)?;
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
