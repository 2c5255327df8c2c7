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
    ArchivedHistory, ClusterRecord, ControllerLease, Members, MoveStep, NodeRecord, NodeState,
    Observed, ObservedPartition, ObservedRole, Operation, OperationState, Operations,
    PartitionMove, PartitionPlacement, PartitionTable,
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
    /// Every attempt of a compare-and-swap ([`update_typed`]) found another writer's version.
    #[error(
        "metadata key {key}: {attempts} compare-and-swap attempts in a row lost to other \
         writers; retry later"
    )]
    Contended { key: String, attempts: usize },
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

/// What a read-modify-write ([`update_typed`]) makes of the value it read.
pub enum Change<T, R> {
    /// Write this value, conditional on the version read, and answer `R`.
    Write(T, R),
    /// Leave the key as it is and answer `R`.
    Keep(R),
}

/// Attempts of one [`update_typed`] before it gives up with [`Error::Contended`].
pub const UPDATE_ATTEMPTS: usize = 64;
/// The pause after the first lost attempt; it doubles after each, up to [`UPDATE_PAUSE_MAX`].
const UPDATE_PAUSE_FIRST: std::time::Duration = std::time::Duration::from_millis(2);
const UPDATE_PAUSE_MAX: std::time::Duration = std::time::Duration::from_millis(200);

/// Compare-and-swap, retried: reads `key`, asks `change` what to make of its value (`None` when
/// absent), and writes that conditional on the version read. When another writer got there
/// first, it reads again and asks again, after a pause that doubles from 2 ms up to 200 ms with
/// a random part (so that writers racing on one key spread out rather than collide in step), at
/// most [`UPDATE_ATTEMPTS`] times. Returns `change`'s answer and the key's version after the
/// call (the one written, or the one read when nothing was written; `None` for a key that is
/// still absent).
pub async fn update_typed<T, R>(
    store: &dyn MetadataStore,
    key: &str,
    what: &'static str,
    mut change: impl FnMut(Option<T>) -> Change<T, R>,
) -> Result<(R, Option<Version>)>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    let mut pause = UPDATE_PAUSE_FIRST;
    for _ in 0..UPDATE_ATTEMPTS {
        let (version, current) = match get_typed::<T>(store, key, what).await? {
            Some((version, value)) => (Some(version), Some(value)),
            None => (None, None),
        };
        let precondition = version.map_or(Precondition::DoesNotExist, Precondition::MatchesVersion);
        match change(current) {
            Change::Keep(answer) => return Ok((answer, version)),
            Change::Write(value, answer) => {
                match put_typed(store, key, &value, precondition).await {
                    Ok(written) => return Ok((answer, Some(written))),
                    Err(Error::PreconditionFailed { .. }) => {}
                    Err(err) => return Err(err),
                }
            }
        }
        tokio::time::sleep(jittered(pause)).await;
        pause = (pause * 2).min(UPDATE_PAUSE_MAX);
    }
    Err(Error::Contended {
        key: key.to_owned(),
        attempts: UPDATE_ATTEMPTS,
    })
}

/// `pause` plus up to half of it again, by the clock's low bits (good enough to spread out
/// writers; nothing depends on it being random).
fn jittered(pause: std::time::Duration) -> std::time::Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    let half = pause.as_micros() as u64 / 2;
    pause + std::time::Duration::from_micros(u64::from(nanos) % (half + 1))
}
