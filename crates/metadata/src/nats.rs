//! The `nats` metadata provider: a JetStream key-value bucket, replicated by JetStream's Raft.
//!
//! A key is a subject of the bucket's stream; a version is the revision JetStream gave the put
//! (the stream's sequence, shared by every key of the bucket, so versions of one key go up but
//! skip numbers). Compare-and-swap is JetStream's own check of a subject's last sequence
//! (`Nats-Expected-Last-Subject-Sequence`), so exactly one of several writers racing on one
//! version wins, whichever node they run on.
//!
//! A `watch` is JetStream's key-value watch from the key's newest value on, fed into the
//! [`Watch`] by a task of its own that ends with the watch. It reads the versions from the
//! bucket's stream, which keeps the last [`WATCH_HISTORY`] of each key: a watcher that falls
//! further behind than that misses the versions dropped meanwhile.

use crate::{Error, MetadataStore, Precondition, Result, Version, Versioned, Watch};
use async_nats::jetstream::kv;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_trait::async_trait;
use cairn_nats::wrong_last_sequence;
use futures::StreamExt;

/// How long connecting waits for a NATS server to answer.
pub const CONNECT_TIMEOUT: std::time::Duration = cairn_nats::CONNECT_TIMEOUT;

/// How long opening the bucket keeps trying while JetStream does not answer (a cluster of NATS
/// servers that has just started elects its leaders first).
const OPEN_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

/// Versions of each key the bucket keeps (JetStream's maximum).
pub const WATCH_HISTORY: i64 = 64;

/// Where the bucket is and how it is kept.
#[derive(Debug, Clone)]
pub struct NatsMetadataOptions {
    /// NATS server URLs (`nats://host:port`); any of them will do.
    pub servers: Vec<String>,
    /// The bucket: one per cluster.
    pub bucket: String,
    /// JetStream replicas of the bucket: 3 in a cluster of NATS servers, 1 for a single server.
    pub replicas: usize,
}

pub struct NatsMetadataStore {
    kv: kv::Store,
}

/// For `map_err`: a NATS client error as this crate's, with what was being done.
/// How many times, [`REFUSAL_CHECK_PAUSE`] apart, a refused write's key is read for the write
/// that came first.
const REFUSAL_CHECKS: u32 = 4;
const REFUSAL_CHECK_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

fn nats_error<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
    context: &'static str,
) -> impl FnOnce(E) -> Error {
    move |source| Error::Nats {
        context,
        source: source.into(),
    }
}

impl NatsMetadataStore {
    /// Connects and creates the bucket if it does not exist yet.
    pub async fn connect(options: &NatsMetadataOptions) -> Result<NatsMetadataStore> {
        let client = cairn_nats::connect(&options.servers)
            .await
            .map_err(nats_error("connect to NATS"))?;
        let jetstream = async_nats::jetstream::new(client);
        let config = kv::Config {
            bucket: options.bucket.clone(),
            // A watch reads the versions from the stream: those it has not reached yet must
            // still be there. JetStream keeps at most 64 per key.
            history: WATCH_HISTORY,
            storage: async_nats::jetstream::stream::StorageType::File,
            num_replicas: options.replicas,
            ..Default::default()
        };
        // Several nodes open the bucket at once, and a JetStream cluster that has just started
        // answers nothing for a while: looked up first, created if missing, looked up again if
        // another node created it meanwhile, all of it retried for `OPEN_PATIENCE`.
        let deadline = std::time::Instant::now() + OPEN_PATIENCE;
        let mut attempts = 0u32;
        loop {
            let attempt: std::result::Result<kv::Store, Box<dyn std::error::Error + Send + Sync>> =
                match jetstream.get_key_value(&options.bucket).await {
                    Ok(kv) => Ok(kv),
                    Err(_) => jetstream
                        .create_key_value(config.clone())
                        .await
                        .map_err(Into::into),
                };
            // A new bucket answers reads only once its stream has a leader.
            let attempt = match attempt {
                Ok(kv) => kv.entry("cluster").await.map(|_| kv).map_err(Into::into),
                Err(err) => Err(err),
            };
            match attempt {
                Ok(kv) => return Ok(NatsMetadataStore { kv }),
                Err(err) if std::time::Instant::now() < deadline => {
                    attempts += 1;
                    // Said once a few seconds in: a JetStream cluster starting beside this node
                    // may take a while to elect its leader.
                    if attempts == 20 {
                        tracing::warn!(bucket = %options.bucket, "the metadata bucket cannot be opened yet ({err}); retrying for up to {} s", OPEN_PATIENCE.as_secs());
                    }
                    tracing::debug!(bucket = %options.bucket, "opening the bucket, again: {err}");
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                }
                Err(err) => return Err(nats_error("create the metadata bucket")(err)),
            }
        }
    }

    /// The current version of `key`, for the message of a refused put.
    async fn current_version(&self, key: &str) -> Option<Version> {
        self.get(key).await.ok().flatten().map(|v| v.version)
    }
}

/// A value as stored: JSON, like the `local` provider's; `None` for a delete or a purge.
fn decode(key: &str, put: bool, payload: &[u8], version: Version) -> Result<Option<Versioned>> {
    if !put {
        return Ok(None);
    }
    let value = serde_json::from_slice(payload).map_err(|e| Error::Decode {
        key: key.to_owned(),
        what: "JSON value",
        detail: e.to_string(),
    })?;
    Ok(Some(Versioned { version, value }))
}

/// [`decode`] for a message of the bucket's stream, read from the stream itself: its
/// `KV-Operation` header says whether it deletes or purges its key.
fn decode_message(key: &str, message: &StreamMessage) -> Result<Option<Versioned>> {
    let put = message
        .headers
        .get(KV_OPERATION_HEADER)
        .is_none_or(|op| op.as_str() == "PUT");
    decode(key, put, &message.payload, message.sequence)
}

/// [`decode`] for an entry of a watch.
fn decode_entry(key: &str, entry: &kv::Entry) -> Result<Option<Versioned>> {
    decode(
        key,
        entry.operation == kv::Operation::Put,
        &entry.value,
        entry.revision,
    )
}

/// The header of a key-value bucket's message that says whether it deletes or purges its key.
const KV_OPERATION_HEADER: &str = "KV-Operation";

#[async_trait]
impl MetadataStore for NatsMetadataStore {
    /// Asks the stream's leader, not any replica: the bucket's own read is a direct get, which
    /// every replica answers from what it holds, so a node could miss its own write just made
    /// (an operation it has just started, a table it has just changed).
    async fn get(&self, key: &str) -> Result<Option<Versioned>> {
        let subject = format!("{}{key}", self.kv.prefix);
        match self
            .kv
            .stream
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(message) => decode_message(key, &message),
            Err(err) if err.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(err) => Err(nats_error("read a metadata key")(err)),
        }
    }

    async fn put(
        &self,
        key: &str,
        value: serde_json::Value,
        precondition: Precondition,
    ) -> Result<Version> {
        let raw = bytes::Bytes::from(serde_json::to_vec(&value).expect("encode JSON"));
        let refused = || async {
            // A refusal is for a write that came first, which a read shows once it is committed
            // (at once, but for a few milliseconds). A stream that lost its quorum also refuses
            // for proposals that never commit: then the key stays as expected, and it is the
            // store that failed, not the compare-and-swap.
            for attempt in 0..REFUSAL_CHECKS {
                let current = self.current_version(key).await;
                let holds = match precondition {
                    Precondition::MatchesVersion(expected) => current == Some(expected),
                    Precondition::DoesNotExist => current.is_none(),
                    Precondition::None => false,
                };
                if !holds {
                    return Err(Error::PreconditionFailed {
                        key: key.to_owned(),
                        expected: precondition,
                        current,
                    });
                }
                if attempt + 1 < REFUSAL_CHECKS {
                    tokio::time::sleep(REFUSAL_CHECK_PAUSE).await;
                }
            }
            Err(nats_error("update a metadata key")(format!(
                "JetStream refused the write of {key} for its version, yet the key is still at the \
                 expected version: the NATS servers have no quorum, or are electing a leader"
            )))
        };
        match precondition {
            Precondition::None => self
                .kv
                .put(key, raw)
                .await
                .map_err(nats_error("write a metadata key")),
            Precondition::DoesNotExist => match self.kv.create(key, raw).await {
                Ok(version) => Ok(version),
                Err(e)
                    if e.kind() == kv::CreateErrorKind::AlreadyExists
                        || wrong_last_sequence(&e) =>
                {
                    refused().await
                }
                Err(e) => Err(nats_error("create a metadata key")(e)),
            },
            Precondition::MatchesVersion(version) => {
                match self.kv.update(key, raw, version).await {
                    Ok(version) => Ok(version),
                    Err(e)
                        if e.kind() == kv::UpdateErrorKind::WrongLastRevision
                            || wrong_last_sequence(&e) =>
                    {
                        refused().await
                    }
                    Err(e) => Err(nats_error("update a metadata key")(e)),
                }
            }
        }
    }

    async fn watch(&self, key: &str) -> Result<Watch> {
        let mut entries = self
            .kv
            .watch_with_history(key)
            .await
            .map_err(nats_error("watch a metadata key"))?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let key = key.to_owned();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    entry = entries.next() => {
                        let versioned = match entry {
                            Some(Ok(entry)) => decode_entry(&key, &entry),
                            Some(Err(err)) => Err(nats_error("watch a metadata key")(err)),
                            None => return,
                        };
                        match versioned {
                            Ok(Some(versioned)) => {
                                if tx.send(versioned).is_err() {
                                    return;
                                }
                            }
                            Ok(None) => {}
                            // The watch broke (the connection is gone for good) or a value does
                            // not decode: the caller sees its `Watch` end.
                            Err(err) => {
                                tracing::warn!(%key, "metadata watch ended: {err}");
                                return;
                            }
                        }
                    }
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Watch::new(rx))
    }
}
