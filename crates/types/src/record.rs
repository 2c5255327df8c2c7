//! The records partitions write to their logs.
//!
//! A record is an [`Envelope`]: a header stamped by the leader that appended it, and a command.
//! Every replica applies the same records in the same order and must reach the same state, so
//! everything a command's outcome depends on (the epoch, the time for TTLs) is inside the record.
//!
//! Encoding: one version byte ([`FORMAT_VERSION`]) followed by the postcard encoding of the
//! envelope. A reader refuses a version it does not know instead of guessing.

use crate::{Epoch, NodeId};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The version of records that every build since the first reads.
pub const FORMAT_VERSION: u8 = 1;
/// The version of records with a [`Command::Write`], which builds before it do not know: they
/// refuse it as "upgrade Cairn" instead of taking it for a damaged record. Every other record
/// keeps version 1, so that nodes of both builds read each other's during an upgrade.
pub const FORMAT_VERSION_WRITE: u8 = 2;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    pub header: Header,
    pub command: Command,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// Epoch of the leader that appended the record. A record whose epoch is not the partition's
    /// current epoch is skipped (except `AnnounceLeader`, which changes the epoch).
    pub epoch: Epoch,
    /// The leader's wall clock when it appended the record, in milliseconds since the Unix epoch.
    /// TTL expiry is computed from this, never from the clock of the node that applies it.
    pub timestamp_ms: u64,
    /// Who is waiting for the outcome, if anyone.
    pub origin: Option<Origin>,
}

/// Identifies the request that proposed a record so that the node that proposed it can hand the
/// outcome to the waiting caller. `boot_id` changes on every start, so a replayed record from an
/// earlier run never reaches a caller of this run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    pub node: NodeId,
    pub boot_id: u64,
    pub request_id: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// `node` leads the partition from `epoch` on. Applied only if `epoch` is newer than the
    /// partition's current epoch.
    AnnounceLeader {
        epoch: Epoch,
        node: NodeId,
    },
    Put {
        entries: Vec<PutEntry>,
    },
    Delete {
        keys: Vec<Bytes>,
    },
    /// For every key: insert it (with `value` and `ttl_ms`) unless it is present and unexpired at
    /// the record's timestamp. The outcome says, per key, whether this record inserted it.
    InsertIfAbsent {
        keys: Vec<Bytes>,
        value: Bytes,
        ttl_ms: Option<u64>,
    },
    /// Per key, an operation decided against the key's state when the record is applied: the
    /// writes that must read first (set only if present, set and return the old value, keep the
    /// expiry, change or drop an expiry, delete and say whether it existed). The operations apply
    /// in order, each seeing the ones before it. With `all_or_nothing`, every condition is
    /// checked against the state before the record, and either all operations apply or none.
    Write {
        ops: Vec<WriteOp>,
        all_or_nothing: bool,
    },
}

/// One key's operation in a [`Command::Write`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteOp {
    pub key: Bytes,
    pub action: Action,
    pub condition: Condition,
    /// Whether the result carries the value the key held before the operation.
    pub return_old: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    Set {
        value: Bytes,
        expiry: Expiry,
    },
    /// Changes the expiry of a key that exists; an expiry at or before the record's time deletes
    /// the key.
    Expire {
        expiry: Expiry,
    },
    Delete,
}

/// When a written value expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Expiry {
    Never,
    /// This many milliseconds after the record's timestamp.
    After(u64),
    /// At this time, in milliseconds since the Unix epoch.
    At(u64),
    /// As the key's current value expires (never, if the key is absent).
    Keep,
}

/// What must hold of the key (live at the record's time) for its operation to apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Condition {
    Always,
    IfAbsent,
    IfPresent,
    /// Present, without an expiry.
    IfNoExpiry,
    /// Present, with an expiry.
    IfHasExpiry,
    /// Present, and the new expiry is later than the current one (none counts as infinite).
    IfLater,
    /// Present, and the new expiry is earlier than the current one (none counts as infinite).
    IfEarlier,
    /// Present, with an expiry, and the new expiry is earlier than it.
    IfHasEarlierExpiry,
}

/// What one [`WriteOp`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteResult {
    /// Whether its condition held and it took effect.
    pub applied: bool,
    /// Whether the key held a live value before it.
    pub existed: bool,
    /// That value, if the operation asked for it.
    pub old: Option<Bytes>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutEntry {
    pub key: Bytes,
    pub value: Bytes,
    pub ttl_ms: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("empty log record")]
    Empty,
    #[error(
        "log record format version {0} is not known to this build (it knows {FORMAT_VERSION} and {FORMAT_VERSION_WRITE}); upgrade Cairn"
    )]
    UnknownVersion(u8),
    #[error("malformed log record: {0}")]
    Malformed(#[from] postcard::Error),
}

impl Envelope {
    pub fn encode(&self) -> Bytes {
        let version = match self.command {
            Command::Write { .. } => FORMAT_VERSION_WRITE,
            _ => FORMAT_VERSION,
        };
        let mut out = vec![version];
        // Serialising plain data into a Vec cannot fail.
        let body = postcard::to_allocvec(self).expect("encode envelope");
        out.extend_from_slice(&body);
        Bytes::from(out)
    }

    pub fn decode(bytes: &[u8]) -> Result<Envelope, DecodeError> {
        match bytes.split_first() {
            None => Err(DecodeError::Empty),
            Some((&(FORMAT_VERSION | FORMAT_VERSION_WRITE), body)) => {
                Ok(postcard::from_bytes(body)?)
            }
            Some((&other, _)) => Err(DecodeError::UnknownVersion(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes() -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(Bytes::from)
    }

    fn command() -> impl Strategy<Value = Command> {
        prop_oneof![
            (any::<u64>(), "[a-z0-9]{1,8}").prop_map(|(e, n)| Command::AnnounceLeader {
                epoch: Epoch(e),
                node: NodeId(n)
            }),
            proptest::collection::vec((bytes(), bytes(), proptest::option::of(any::<u64>())), 0..8)
                .prop_map(|v| Command::Put {
                    entries: v
                        .into_iter()
                        .map(|(key, value, ttl_ms)| PutEntry { key, value, ttl_ms })
                        .collect()
                }),
            proptest::collection::vec(bytes(), 0..8).prop_map(|keys| Command::Delete { keys }),
            (
                proptest::collection::vec(bytes(), 0..8),
                bytes(),
                proptest::option::of(any::<u64>())
            )
                .prop_map(|(keys, value, ttl_ms)| Command::InsertIfAbsent {
                    keys,
                    value,
                    ttl_ms
                }),
            (
                proptest::collection::vec((bytes(), bytes(), any::<u64>(), any::<bool>()), 0..8),
                any::<bool>()
            )
                .prop_map(|(ops, all_or_nothing)| Command::Write {
                    ops: ops
                        .into_iter()
                        .map(|(key, value, at, flag)| WriteOp {
                            key,
                            action: if flag {
                                Action::Set {
                                    value,
                                    expiry: Expiry::At(at),
                                }
                            } else {
                                Action::Expire {
                                    expiry: Expiry::After(at),
                                }
                            },
                            condition: if flag {
                                Condition::IfPresent
                            } else {
                                Condition::IfLater
                            },
                            return_old: flag,
                        })
                        .collect(),
                    all_or_nothing
                }),
        ]
    }

    proptest! {
        #[test]
        fn envelopes_round_trip(epoch: u64, ts: u64, origin: Option<(u64, u64)>, command in command()) {
            let envelope = Envelope {
                header: Header {
                    epoch: Epoch(epoch),
                    timestamp_ms: ts,
                    origin: origin.map(|(boot_id, request_id)| Origin {
                        node: NodeId("n1".into()),
                        boot_id,
                        request_id,
                    }),
                },
                command,
            };
            prop_assert_eq!(Envelope::decode(&envelope.encode()).unwrap(), envelope);
        }
    }

    #[test]
    fn unknown_version_is_refused() {
        let err = Envelope::decode(&[9, 0, 0]).unwrap_err();
        assert!(matches!(err, DecodeError::UnknownVersion(9)), "{err}");
        assert!(matches!(Envelope::decode(&[]), Err(DecodeError::Empty)));
        // Only records that older builds cannot read carry the newer version.
        let envelope = |command| Envelope {
            header: Header {
                epoch: Epoch(1),
                timestamp_ms: 1,
                origin: None,
            },
            command,
        };
        let put = envelope(Command::Delete { keys: vec![] }).encode();
        assert_eq!(put[0], FORMAT_VERSION);
        let write = envelope(Command::Write {
            ops: vec![],
            all_or_nothing: false,
        })
        .encode();
        assert_eq!(write[0], FORMAT_VERSION_WRITE);
        assert!(Envelope::decode(&write).is_ok());
    }
}
