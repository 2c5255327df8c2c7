//! Cluster metadata: which cluster this is, how many partitions it has, and who leads each.
//!
//! [`MetadataStore`] is a small versioned key-value store with compare-and-swap. Every change goes
//! through [`Precondition`], so two writers can never both believe they won, and a [`Watch`]
//! follows every version of a key. Providers: [`local`] (a file in the base dir, for a single
//! node) and [`nats`] (a JetStream key-value bucket, for a cluster). [`conformance`] (feature `test-util`) is what every provider must pass.
//!
//! Architecture invariant: metadata is small and changes rarely. Nothing on the write path of a
//! key reads it.

#[cfg(any(test, feature = "test-util"))]
pub mod conformance;
pub mod local;
pub mod nats;
mod records;
#[cfg(feature = "test-util")]
pub mod test_util;

pub use records::{
    ArchivedHistory, ClusterRecord, ControllerLease, Members, NodeRecord, Observed,
    ObservedPartition, PartitionPlacement, PartitionTable,
};

use async_trait::async_trait;

/// Version of a stored value: at least 1, and higher with every successful put of the key. The
/// `local` provider counts 1, 2, 3…; a replicated one may skip numbers (a JetStream key-value
/// bucket's revisions are its stream's sequence, shared by all keys), so callers compare versions
/// and never count on the next one.
pub type Version = u64;

#[derive(Debug, Clone, PartialEq)]
pub struct Versioned {
    pub version: Version,
    pub value: serde_json::Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precondition {
    None,
    DoesNotExist,
    MatchesVersion(Version),
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "metadata key {key}: precondition {expected:?} failed; the current version is {current:?}"
    )]
    PreconditionFailed {
        key: String,
        expected: Precondition,
        current: Option<Version>,
    },
    #[error("metadata store at {path}: {context}: {source}")]
    Io {
        path: String,
        context: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("metadata store at {path} is corrupt: {detail}")]
    Corrupt { path: String, detail: String },
    #[error("metadata store (NATS): {context}: {source}")]
    Nats {
        context: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("metadata key {key} does not hold a valid {what}: {detail}")]
    Decode {
        key: String,
        what: &'static str,
        detail: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[async_trait]
pub trait MetadataStore: Send + Sync + 'static {
    async fn get(&self, key: &str) -> Result<Option<Versioned>>;

    /// Stores `value` under `key` if `precondition` holds and returns the new version.
    async fn put(
        &self,
        key: &str,
        value: serde_json::Value,
        precondition: Precondition,
    ) -> Result<Version>;

    /// Every version of `key` from its current one (if it has one) on, in the order they were
    /// committed, none skipped, for as long as the [`Watch`] is kept and read. (A replicated
    /// provider may bound how far a watcher can fall behind: `nats` by
    /// [`nats::WATCH_HISTORY`] versions.)
    async fn watch(&self, key: &str) -> Result<Watch>;
}

/// The versions of one key, as [`MetadataStore::watch`] delivers them.
pub struct Watch {
    versions: tokio::sync::mpsc::UnboundedReceiver<Versioned>,
}

impl Watch {
    /// A watch fed by a provider through `versions`.
    pub fn new(versions: tokio::sync::mpsc::UnboundedReceiver<Versioned>) -> Watch {
        Watch { versions }
    }

    /// The next version; `None` once the store is gone.
    pub async fn next(&mut self) -> Option<Versioned> {
        self.versions.recv().await
    }
}

/// Reads and decodes a typed record.
pub async fn get_typed<T: serde::de::DeserializeOwned>(
    store: &dyn MetadataStore,
    key: &str,
    what: &'static str,
) -> Result<Option<(Version, T)>> {
    match store.get(key).await? {
        None => Ok(None),
        Some(v) => serde_json::from_value(v.value)
            .map(|t| Some((v.version, t)))
            .map_err(|e| Error::Decode {
                key: key.into(),
                what,
                detail: e.to_string(),
            }),
    }
}

/// Encodes and stores a typed record.
pub async fn put_typed<T: serde::Serialize>(
    store: &dyn MetadataStore,
    key: &str,
    value: &T,
    precondition: Precondition,
) -> Result<Version> {
    // Serialising plain data structures to a JSON value cannot fail.
    let value = serde_json::to_value(value).expect("encode metadata record");
    store.put(key, value, precondition).await
}
