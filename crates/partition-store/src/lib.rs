//! The partition store: the state of every partition of a node, a RocksDB per partition.
//!
//! Each partition has its own database (`partition-<pid>.<generation>` in the store's folder) and
//! in it its own column family, `data-<pid>`. In it, every key starts with a table tag
//! and the partition key (big-endian), so the key ranges of SST files line up with partition key
//! ranges:
//!
//! ```text
//!   'd' ++ partition_key(u64 BE) ++ user_key    →  value record (expiry, bytes)
//!   'f' ++ variable id(u8)                      →  partition variable (applied LSN, leader,
//!                                                   partition time)
//! ```
//!
//! The partition's variables live in the same column family as its data, so an export of the
//! column family carries them, and a write batch updates both at once.
//!
//! Architecture invariant: this is the only crate that knows RocksDB. It knows nothing of logs,
//! records or gRPC: callers hand it keys, values and LSNs.
//!
//! # Crash consistency
//! Data and the applied LSN are written in one `WriteBatch`: after any crash the store holds the
//! effects of exactly the records up to its applied LSN.
//!
//! The store keeps no write-ahead log of its own (`disable_wal`): the partition's log is already
//! the durable copy of every write, and a second one would cost a write per batch for nothing.
//! What a crash loses is the memtables, that is, the newest records' effects together with the
//! applied LSN that covers them (both live in the partition's column family, and a column
//! family's flush writes them out together). The store then reopens at the applied LSN of its last
//! flush and the processor replays the rest from the log. That holds as long as the log still has
//! those records, so whoever trims a log first calls [`PartitionStore::flush`] (the worker does,
//! in `Partition::trim_log`): the log is never trimmed past what the store has on disk. Exports
//! flush too, so a snapshot never covers more than its files hold. On a clean shutdown RocksDB
//! flushes every memtable itself.

mod expiry;
mod keys;
mod store;
mod verify;

use std::sync::Arc;

pub use store::{
    ColumnFamilyExport, CompactionStyle, ExportedFile, LeaderState, PartitionStore,
    PartitionStoreManager, PartitionWriteBatch, SizeEstimates, StoreOptions, StoredValue,
    WriteStall,
};

/// Errors of the partition store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("open partition store at {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: rust_rocksdb::Error,
    },
    #[error("partition store: {context}: {source}")]
    RocksDb {
        context: &'static str,
        #[source]
        source: rust_rocksdb::Error,
    },
    #[error("partition {0} already has a store here; drop it before importing")]
    AlreadyExists(cairn_types::PartitionId),
    #[error("partition {0} has no store here")]
    UnknownPartition(cairn_types::PartitionId),
    /// A partition's folder holds table files, but its database's description lists no column
    /// family of the partition: the description is damaged or cut short (RocksDB reads such a
    /// description up to where it breaks, and opening the database would delete the tables it
    /// no longer lists).
    #[error(
        "open partition store at {path}: its description (MANIFEST) lists no column family \
         {column_family} though the folder holds table files: the description is damaged or cut \
         short"
    )]
    NoColumnFamily { path: String, column_family: String },
    /// The partition's store is there but could not be opened; `source` says why.
    #[error("partition {partition}'s store could not be opened: {source}")]
    NotOpened {
        partition: cairn_types::PartitionId,
        #[source]
        source: Arc<Error>,
    },
    /// Two folders hold a store of the same partition: nothing this store writes leaves that
    /// behind, so someone put one there.
    #[error(
        "partition store: partition {partition} has two stores, {first} and {second}; move the \
         one that is not wanted out of the store's folder and start again"
    )]
    TwoStores {
        partition: cairn_types::PartitionId,
        first: String,
        second: String,
    },
    #[error("partition store: corrupt {what} in partition {partition}: {detail}")]
    Corrupt {
        partition: cairn_types::PartitionId,
        what: &'static str,
        detail: String,
    },
    /// RocksDB's manual compaction reports no status of its own; a background error recorded while
    /// it ran (a full disk, an I/O error) is how it fails.
    #[error(
        "partition store: the compaction of partition {0} did not complete: RocksDB recorded a \
         background error while it ran (the LOG file in the store's folder says which); free the \
         disk or fix the error and run it again"
    )]
    CompactionFailed(cairn_types::PartitionId),
    /// A table file of the partition failed RocksDB's checks (a block checksum, its format): the
    /// partition's store is damaged. Found by [`ColumnFamilyExport::verify_tables`].
    #[error("partition store: table file {file} of partition {partition} is damaged: {detail}")]
    DamagedTable {
        partition: cairn_types::PartitionId,
        /// As RocksDB names it in the store's folder (`000123.sst`).
        file: String,
        /// RocksDB's account, naming the file as the store does.
        detail: String,
        #[source]
        source: rust_rocksdb::Error,
    },
    #[error("partition store: {context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Whether RocksDB found a file of the store damaged or missing (a table or its MANIFEST).
    pub fn is_damaged(&self) -> bool {
        match self {
            Error::RocksDb { source, .. } | Error::Open { source, .. } => {
                source.kind() == rust_rocksdb::ErrorKind::Corruption
                    || (source.kind() == rust_rocksdb::ErrorKind::IOError
                        && source.as_ref().contains("No such file or directory"))
            }
            Error::DamagedTable { .. } | Error::NoColumnFamily { .. } => true,
            Error::NotOpened { source, .. } => source.is_damaged(),
            _ => false,
        }
    }

    /// The folder of the database that could not be opened.
    pub fn path(&self) -> Option<&str> {
        match self {
            Error::Open { path, .. } | Error::NoColumnFamily { path, .. } => Some(path),
            Error::NotOpened { source, .. } => source.path(),
            _ => None,
        }
    }

    /// Whether the process ran out of file descriptors (the open-files limit).
    pub fn is_out_of_files(&self) -> bool {
        match self {
            Error::RocksDb { source, .. } | Error::Open { source, .. } => {
                source.as_ref().contains("Too many open files")
            }
            Error::Io { source, .. } => source.to_string().contains("Too many open files"),
            _ => false,
        }
    }

    /// Whether RocksDB refused because the disk holding the store is full. RocksDB then stops
    /// writing to that partition's database and resumes by itself once there is room for a
    /// memtable flush again; reads go on meanwhile.
    pub fn is_disk_full(&self) -> bool {
        match self {
            Error::RocksDb { source, .. } | Error::Open { source, .. } => {
                source.kind() == rust_rocksdb::ErrorKind::IOError
                    && source.as_ref().contains("No space left on device")
            }
            Error::Io { source, .. } => source.kind() == std::io::ErrorKind::StorageFull,
            _ => false,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
