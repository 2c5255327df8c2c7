//! Vocabulary shared by every Cairn crate: identifiers, key hashing, key ranges, size limits and the
//! format of the records that partitions write to their logs.
//!
//! Architecture invariant: this crate knows nothing about RocksDB, gRPC, object stores or async
//! runtimes. It is plain data and pure functions, so every other crate can depend on it.

pub mod ids;
pub mod keys;
pub mod limits;
pub mod record;

pub use ids::{Epoch, LogId, Lsn, NodeId, PartitionId};
pub use keys::{KeyRange, PartitionKey, partition_key};
