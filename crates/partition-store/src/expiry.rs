//! Reclaiming expired values: a compaction filter per partition that drops every value whose
//! expiry is at or before the partition's *horizon*.
//!
//! The horizon is set by the partition's owner ([`PartitionStore::set_expiry_horizon`]) and must
//! be a time at or before every decision the partition can still make, on this store and after any
//! crash of it: then a dropped value is one that every later decision would have treated as absent
//! anyway. The worker's argument for the time it passes is in ARCHITECTURE.md (*Expiry*).
//!
//! A filter reads the horizon once, when RocksDB starts a compaction; a horizon that moves during
//! the compaction applies from the next one. A removed value becomes a tombstone in the
//! compaction's output (RocksDB's `kRemove`), so an older version of the key in a lower level
//! stays hidden until both are gone.
//!
//! [`PartitionStore::set_expiry_horizon`]: crate::PartitionStore::set_expiry_horizon

use crate::keys;
use rust_rocksdb::compaction_filter::{CompactionFilter, Decision};
use rust_rocksdb::compaction_filter_factory::{CompactionFilterContext, CompactionFilterFactory};
use std::ffi::CStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// What one partition's compaction filter reads and reports.
#[derive(Debug, Default)]
pub(crate) struct Expiry {
    /// Values that expire at or before this time (ms since the Unix epoch) may be dropped; 0 drops
    /// nothing.
    horizon_ms: AtomicU64,
    /// Values dropped since the store was opened.
    dropped: AtomicU64,
}

impl Expiry {
    /// Moves the horizon to `horizon_ms` unless it is already later: it never goes back.
    pub(crate) fn advance(&self, horizon_ms: u64) {
        self.horizon_ms.fetch_max(horizon_ms, Ordering::AcqRel);
    }

    pub(crate) fn horizon_ms(&self) -> u64 {
        self.horizon_ms.load(Ordering::Acquire)
    }

    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// Makes one [`ExpiryFilter`] per compaction, with the horizon of that moment.
pub(crate) struct ExpiryFilterFactory(pub(crate) Arc<Expiry>);

impl CompactionFilterFactory for ExpiryFilterFactory {
    type Filter = ExpiryFilter;

    fn create(&mut self, _context: CompactionFilterContext) -> ExpiryFilter {
        ExpiryFilter {
            horizon_ms: self.0.horizon_ms(),
            dropped: 0,
            expiry: self.0.clone(),
        }
    }

    fn name(&self) -> &CStr {
        c"cairn-expiry"
    }
}

pub(crate) struct ExpiryFilter {
    horizon_ms: u64,
    /// Counted here and added to the partition's total when the compaction ends.
    dropped: u64,
    expiry: Arc<Expiry>,
}

impl CompactionFilter for ExpiryFilter {
    fn filter(&mut self, _level: u32, key: &[u8], value: &[u8]) -> Decision {
        // Only data values carry an expiry; the partition's variables are never dropped. A value
        // that does not decode is kept, for the reads to report.
        if self.horizon_ms > 0
            && keys::is_data_key(key)
            && keys::expiry_of(value).is_some_and(|at| at <= self.horizon_ms)
        {
            self.dropped += 1;
            Decision::Remove
        } else {
            Decision::Keep
        }
    }

    fn name(&self) -> &CStr {
        c"cairn-expiry"
    }
}

impl Drop for ExpiryFilter {
    fn drop(&mut self) {
        self.expiry
            .dropped
            .fetch_add(self.dropped, Ordering::Relaxed);
    }
}
