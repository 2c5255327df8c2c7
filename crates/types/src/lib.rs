//! Vocabulary shared by every Cairn crate: identifiers, key hashing, key ranges, size limits and the
//! format of the records that partitions write to their logs.
//!
//! Architecture invariant: this crate knows nothing about RocksDB, gRPC, object stores or async
//! runtimes. It is plain data and pure functions (and the monotonic clock every timeout is measured
//! by), so every other crate can depend on it.

pub mod clock;
pub mod ids;
pub mod keys;
pub mod limits;
pub mod record;

pub use ids::{Epoch, LogId, Lsn, NodeId, PartitionId};
pub use keys::{KeyRange, PartitionKey, partition_key};

/// Why a deletion (a log trim, a snapshot garbage collection) was fenced off: this node no longer
/// leads the partition at the epoch it acts under, by whoever decides leadership.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct Fenced {
    /// What the fence found instead (a newer leader or epoch, or that it could not tell).
    pub reason: String,
}

impl Fenced {
    pub fn new(reason: impl Into<String>) -> Self {
        Fenced {
            reason: reason.into(),
        }
    }
}
