//! The replicated log of a partition: the source of truth that partition processors apply.
//!
//! ```text
//!      trimmed (gone)        readable                    not yet written
//!   ───────────────────┤├──────────────────────────┤├────────────────────▶ LSN
//!                 trim_point                      tail
//!                 (0 = never trimmed)             (0 = empty log)
//! ```
//!
//! LSNs start at 1 and are dense. Records `trim_point + 1 ..= tail` are readable. A record is
//! readable, and its append acknowledged, only once it is durable.
//!
//! Architecture invariant: this crate knows nothing of what the records mean (they are opaque
//! bytes) and nothing of RocksDB, gRPC or object stores. Providers: [`local`] (embedded, one node)
//! and [`nats`] (one JetStream stream per log, for a cluster). Every provider must pass
//! [`conformance`].

use async_trait::async_trait;
use bytes::Bytes;
use cairn_types::{LogId, Lsn};
use std::path::PathBuf;
use std::sync::Arc;

#[cfg(any(test, feature = "test-util"))]
pub mod conformance;
pub mod local;
pub mod nats;

/// One record read back from a log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub lsn: Lsn,
    pub payload: Bytes,
}

/// Where a log stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogState {
    /// Highest trimmed LSN; 0 if never trimmed.
    pub trim_point: Lsn,
    /// LSN of the last durable record; 0 if nothing was ever appended.
    pub tail: Lsn,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller asked for records that were trimmed away. Whoever needs them must get the state
    /// from elsewhere (a snapshot).
    #[error("log {log_id}: LSN {requested} was trimmed (trim point is {trim_point})")]
    Trimmed {
        log_id: LogId,
        requested: Lsn,
        trim_point: Lsn,
    },
    #[error("log {log_id}: a record of {size} bytes exceeds the limit of {limit} bytes")]
    RecordTooLarge {
        log_id: LogId,
        size: usize,
        limit: usize,
    },
    #[error("log {log_id} is shut down")]
    Shutdown { log_id: LogId },
    #[error("log {log_id}: {context}: {source}")]
    Io {
        log_id: LogId,
        context: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The disk holding the log is full (or its quota is used up). The append that met it was
    /// not acknowledged and left nothing behind; the log accepts appends again by itself once
    /// there is space, and serves reads meanwhile.
    #[error(
        "log {log_id}: the disk holding {} is full ({source}); free space on it: the log accepts \
         appends again by itself once there is room",
        path.display()
    )]
    DiskFull {
        log_id: LogId,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("log {log_id}: corrupt data in {path}: {detail}")]
    Corrupt {
        log_id: LogId,
        path: String,
        /// Where in `path` the damaged record starts, when the damage is a record (not a
        /// missing or misnamed file, or a bad trim point).
        offset: Option<u64>,
        detail: String,
    },
    /// NATS failed `context`: it is unreachable, JetStream is off, or the log's stream has no
    /// quorum. Nothing else is wrong; the call may succeed once NATS answers again.
    #[error("log {log_id}: {context}: {source}")]
    Nats {
        log_id: LogId,
        context: &'static str,
        #[source]
        source: BoxError,
    },
    /// No NATS server could be reached to open the logs.
    #[error("cannot reach NATS at {servers}: {source}")]
    Connect {
        servers: String,
        #[source]
        source: BoxError,
    },
    /// The append was refused because the log's tail was not where this writer expected it:
    /// another writer appended meanwhile (a leader that lost its leadership, for instance), or
    /// an earlier append of this writer failed. Nothing of it was written; later appends go on.
    #[error(
        "log {log_id}: append refused: the log no longer ends at LSN {expected}, where this \
         writer expected it; nothing of it was written, and a retry may succeed"
    )]
    TailMoved { log_id: LogId, expected: Lsn },
    /// NATS did not say within `waited` whether the append was written: it may or may not be
    /// in the log. Reading the log tells.
    #[error(
        "log {log_id}: NATS did not confirm the append within {waited:?}; it may or may not have \
         been written"
    )]
    OutcomeUnknown {
        log_id: LogId,
        waited: std::time::Duration,
    },
    /// One append held more records than the provider can write atomically.
    #[error(
        "log {log_id}: an append of {records} records exceeds the limit of {limit} records per \
         append"
    )]
    BatchTooLarge {
        log_id: LogId,
        records: usize,
        limit: usize,
    },
    /// The log could not be opened (for instance [`Error::Corrupt`]); every call on it fails
    /// with why. Lets a node keep its other logs serving.
    #[error("{source}")]
    NotOpened {
        log_id: LogId,
        #[source]
        source: Arc<Error>,
    },
}

impl Error {
    /// Whether the error says the disk is full: the caller's request may succeed once space is
    /// freed, and nothing else is wrong.
    pub fn is_disk_full(&self) -> bool {
        match self {
            Error::DiskFull { .. } => true,
            Error::NotOpened { source, .. } => source.is_disk_full(),
            _ => false,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The source of an error that comes from a client library.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// One partition's log.
#[async_trait]
pub trait Loglet: Send + Sync + 'static {
    fn log_id(&self) -> LogId;

    /// The largest record an append takes: a larger one is refused with
    /// [`Error::RecordTooLarge`].
    fn record_bytes_max(&self) -> usize;

    /// Appends `payloads` as consecutive records and returns the LSN of the last one once all of
    /// them are durable. An empty batch returns the current tail and writes nothing. A failed
    /// append leaves none of its records readable, and does not stop reads or later appends.
    async fn append(&self, payloads: Vec<Bytes>) -> Result<Lsn>;

    /// Reads up to `max_records` durable records starting at `from`. Returns an empty vector when
    /// `from` is past the tail. Fails with [`Error::Trimmed`] when `from <= trim_point`.
    async fn read(&self, from: Lsn, max_records: usize) -> Result<Vec<Entry>>;

    /// Waits until the tail is at least `lsn`. Fails only if the log shuts down: a failed append
    /// (a full disk) does not end the wait, since later appends may succeed.
    async fn wait_for_tail(&self, lsn: Lsn) -> Result<()>;

    /// Trims every record up to and including `up_to` (clamped to the tail). The trim point never
    /// moves backwards; trimming below it is a no-op.
    async fn trim(&self, up_to: Lsn) -> Result<()>;

    /// Where the log stands as far as this node has seen: exact for the node that appends to
    /// it, and at most behind by what has not reached this node yet for the others.
    async fn state(&self) -> Result<LogState>;

    /// Where the log stands, asked of whatever keeps it: every append acknowledged anywhere
    /// before the call is counted. Costs a round trip for a provider kept elsewhere.
    async fn find_tail(&self) -> Result<LogState> {
        self.state().await
    }
}

/// Opens the logs of one node.
#[async_trait]
pub trait LogProvider: Send + Sync + 'static {
    /// Opens (creating if needed) the log `log_id`. Opening the same id twice returns the same log.
    async fn open(&self, log_id: LogId) -> Result<Arc<dyn Loglet>>;
}
