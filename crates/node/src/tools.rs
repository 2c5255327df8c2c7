//! Offline tools for operators: they work on a node's base dir while the node is stopped.

use crate::config::Config;
use crate::node::lock_base_dir;
use anyhow::{Context, bail};
use cairn_partition_store::{PartitionStoreManager, StoreOptions};
use cairn_types::{Lsn, PartitionId};

/// What [`drop_partition`] removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedPartition {
    pub partition: PartitionId,
    /// The last log record the dropped store had applied.
    pub applied_lsn: Lsn,
}

/// Drops one partition's local store (its RocksDB column family) from the base dir of a stopped
/// node. At the next start the partition restores from a snapshot (with
/// `snapshot-restore-policy = "on-init"`, or when its log is trimmed) or replays its whole log.
pub fn drop_partition(config: &Config, partition: PartitionId) -> anyhow::Result<DroppedPartition> {
    let base_dir = &config.base_dir;
    if !base_dir.join("db").join("CURRENT").exists() {
        bail!(
            "{} holds no partition store; pass the node's --base-dir (or its --config)",
            base_dir.display()
        );
    }
    let _lock =
        lock_base_dir(base_dir).context("the node must be stopped to drop a partition's store")?;
    let stores = PartitionStoreManager::open(&base_dir.join("db"), &StoreOptions::default())
        .context("open the partition store")?;
    let Some(store) = stores.partition(partition) else {
        bail!(
            "partition {partition} has no store in {}; nothing to drop",
            base_dir.display()
        );
    };
    let applied_lsn = store.applied_lsn().unwrap_or(Lsn::ZERO);
    drop(store);
    stores
        .drop_partition(partition)
        .with_context(|| format!("drop the store of partition {partition}"))?;
    Ok(DroppedPartition {
        partition,
        applied_lsn,
    })
}
