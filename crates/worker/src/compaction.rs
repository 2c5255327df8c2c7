//! What an operator sees of a partition's store and can ask of it: size estimates, the expiry
//! horizon, a manual compaction that reclaims expired values now.

use crate::partition::Partition;
use crate::processor::store_error;
use crate::{Result, blocking};
use cairn_partition_store::{PartitionStore, SizeEstimates, WriteStall};
use tracing::warn;

/// How long a compaction waits for the record that brings the partition's time up to the clock.
const TIME_BUMP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Bytes of values a sample reads at most: values may be up to 1 MiB each.
const SAMPLE_BYTES_MAX: usize = 16 * 1024 * 1024;

/// A partition store as RocksDB and the compaction filter see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStatus {
    pub estimates: SizeEstimates,
    /// Expired values compactions dropped since the node started.
    pub expired_dropped: u64,
    /// The partition's time (ms since the Unix epoch): what reads and writes decide expiry by.
    pub partition_time_ms: u64,
    /// Values expiring at or before this time may be dropped by compactions.
    pub expiry_horizon_ms: u64,
    /// Whether RocksDB holds the partition's writes back while its compactions catch up.
    pub write_stall: WriteStall,
    /// Failed flushes and compactions (and compactions refused for want of disk space) since
    /// the store was opened.
    pub background_errors: u64,
}

impl StoreStatus {
    /// Reads it from `store`. Blocking: RocksDB calls.
    pub fn read(store: &PartitionStore) -> Result<StoreStatus> {
        let partition = store.id();
        Ok(StoreStatus {
            estimates: store
                .size_estimates()
                .map_err(|err| store_error(partition, "read size estimates", err))?,
            expired_dropped: store.expired_dropped(),
            partition_time_ms: store
                .partition_time()
                .map_err(|err| store_error(partition, "read the partition time", err))?,
            expiry_horizon_ms: store.expiry_horizon(),
            write_stall: store
                .write_stall()
                .map_err(|err| store_error(partition, "read the write stall", err))?,
            background_errors: store
                .background_errors()
                .map_err(|err| store_error(partition, "read the background errors", err))?,
        })
    }
}

/// What a manual compaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compacted {
    pub before: StoreStatus,
    pub after: StoreStatus,
    /// Expired values this compaction dropped (or others that ran meanwhile).
    pub expired_dropped: u64,
}

/// Values read to estimate how many have expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpirySample {
    pub read: u64,
    pub expired: u64,
    /// The time they were judged by: the partition's.
    pub at_ms: u64,
}

impl Partition {
    /// The store's status, read on a blocking thread.
    pub async fn store_status(&self) -> Result<StoreStatus> {
        let store = self.store().clone();
        blocking(self.id(), "read the store's status", move || {
            StoreStatus::read(&store)
        })
        .await?
    }

    /// Compacts the partition's whole store now: flushes it, lets compactions drop every value
    /// that expired by the partition time now on disk (the horizon, see ARCHITECTURE.md,
    /// *Expiry*), and rewrites every level. Takes as long as RocksDB needs to rewrite the
    /// partition; writes and reads go on meanwhile.
    pub async fn compact(&self) -> Result<Compacted> {
        // An idle partition's time stays at its last record, so only what expired by then could
        // go: a record that changes nothing else (an empty put) brings it up to the clock first.
        // Best effort: on a full disk, with leadership moving or a log that does not answer, the
        // compaction still reclaims what expired by the time already on disk.
        if self.serving_epoch().is_ok() {
            match tokio::time::timeout(TIME_BUMP_TIMEOUT, self.put(Vec::new())).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => warn!(partition = %self.id(), "compacting without bringing the \
                                      partition's time up to the clock first: {err}"),
                Err(_) => warn!(partition = %self.id(), "compacting without bringing the \
                                partition's time up to the clock first: the log did not answer \
                                within {TIME_BUMP_TIMEOUT:?}"),
            }
        }
        let store = self.store().clone();
        blocking(self.id(), "compact", move || {
            let partition = store.id();
            // Measured once everything is on disk, so that before and after compare files.
            store
                .flush()
                .map_err(|err| store_error(partition, "flush before compacting", err))?;
            let before = StoreStatus::read(&store)?;
            let horizon = store
                .persisted_partition_time()
                .map_err(|err| store_error(partition, "read the persisted partition time", err))?;
            store.set_expiry_horizon(horizon);
            store
                .compact()
                .map_err(|err| store_error(partition, "compact", err))?;
            let after = StoreStatus::read(&store)?;
            Ok(Compacted {
                before,
                after,
                expired_dropped: after.expired_dropped.saturating_sub(before.expired_dropped),
            })
        })
        .await?
    }

    /// Expired values that compactions dropped since the store was opened.
    pub fn expired_dropped(&self) -> u64 {
        self.store().expired_dropped()
    }

    /// Reads up to `max` values (at most about 16 MiB of them) from a random point of the
    /// partition and counts those expired at the partition's time.
    pub async fn sample_expired(&self, max: usize) -> Result<ExpirySample> {
        let store = self.store().clone();
        let at_ms = self.partition_time();
        let start = rand::random_range(self.key_range().start..=self.key_range().end);
        blocking(self.id(), "sample values", move || {
            let (read, expired) = store
                .sample_expired(at_ms, start, max, SAMPLE_BYTES_MAX)
                .map_err(|err| store_error(store.id(), "sample values", err))?;
            Ok(ExpirySample {
                read,
                expired,
                at_ms,
            })
        })
        .await?
    }
}
