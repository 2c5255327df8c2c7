//! The records partitions write to their logs.
//!
//! A record is an [`Envelope`]: a header stamped by the leader that appended it, and a command.
//! Every replica applies the same records in the same order and must reach the same state, so
//! everything a command's outcome depends on (the epoch, the time for TTLs) is inside the record.
//!
//! Encoding: one version byte ([`FORMAT_VERSION`]) followed by the postcard encoding of the
//! envelope. A reader refuses a version it does not know instead of guessing.
//!
//! A leader that has several proposals waiting while its earlier appends are in flight appends
//! them as one record, a batch ([`FORMAT_VERSION_BATCH`]): the version byte, the number of
//! envelopes, then each envelope as it would be encoded alone behind its length (`u32`s,
//! little-endian). A batch is applied as
//! its envelopes one after the other, each answering its own proposer; the record's LSN is the
//! LSN of all of them. One record for many proposals costs the log one append, one frame and,
//! with the logs in NATS, one JetStream message where it would take one per proposal.

use crate::{Epoch, NodeId};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The version of records that every build since the first reads.
pub const FORMAT_VERSION: u8 = 1;
/// The version of records with a [`Command::Write`], which builds before it do not know: they
/// refuse it as "upgrade Cairn" instead of taking it for a damaged record. Every other record
/// keeps version 1, so that nodes of both builds read each other's during an upgrade.
pub const FORMAT_VERSION_WRITE: u8 = 2;
/// The version of a record that holds several envelopes (see the module's docs). Only written
/// when a leader has more than one proposal to append at once, so a lightly loaded partition
/// keeps writing records that builds before batches read.
pub const FORMAT_VERSION_BATCH: u8 = 3;

/// Bytes a batch adds to each envelope it holds: its length.
const BATCH_FRAME_BYTES: usize = 4;
/// Bytes a batch adds once: the version and the number of envelopes.
const BATCH_HEADER_BYTES: usize = 1 + 4;

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
        #[serde(deserialize_with = "shared::bytes_vec")]
        keys: Vec<Bytes>,
    },
    /// For every key: insert it (with `value` and `ttl_ms`) unless it is present and unexpired at
    /// the record's timestamp. The outcome says, per key, whether this record inserted it.
    InsertIfAbsent {
        #[serde(deserialize_with = "shared::bytes_vec")]
        keys: Vec<Bytes>,
        #[serde(deserialize_with = "shared::bytes")]
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
    #[serde(deserialize_with = "shared::bytes")]
    pub key: Bytes,
    pub action: Action,
    pub condition: Condition,
    /// Whether the result carries the value the key held before the operation.
    pub return_old: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    Set {
        #[serde(deserialize_with = "shared::bytes")]
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
    #[serde(deserialize_with = "shared::bytes")]
    pub key: Bytes,
    #[serde(deserialize_with = "shared::bytes")]
    pub value: Bytes,
    pub ttl_ms: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("empty log record")]
    Empty,
    #[error(
        "log record format version {0} is not known to this build (it knows {FORMAT_VERSION} to {FORMAT_VERSION_BATCH}); upgrade Cairn"
    )]
    UnknownVersion(u8),
    #[error("malformed log record: {0}")]
    Malformed(#[from] postcard::Error),
    #[error("malformed batch record: {detail}")]
    MalformedBatch { detail: &'static str },
}

impl Envelope {
    pub fn encode(&self) -> Bytes {
        let version = match self.command {
            Command::Write { .. } => FORMAT_VERSION_WRITE,
            _ => FORMAT_VERSION,
        };
        let mut out = Vec::with_capacity(self.encoded_bytes_hint());
        out.push(version);
        // Serialising plain data into a Vec cannot fail.
        Bytes::from(postcard::to_extend(self, out).expect("encode envelope"))
    }

    /// About the size of its encoding, a little more rather than less: the buffer it is encoded
    /// into is made this large, so that encoding a request of many keys does not grow and copy it
    /// again and again.
    fn encoded_bytes_hint(&self) -> usize {
        /// Bytes of the version, the header, and the command's tag and counts, or more.
        const FIXED: usize = 96;
        /// Bytes of a field's length, a TTL or an expiry: a varint of at most 10 bytes.
        const FIELD: usize = 10;
        let node = self.header.origin.as_ref().map_or(0, |o| o.node.0.len());
        FIXED
            + node
            + match &self.command {
                Command::AnnounceLeader { node, .. } => node.0.len(),
                Command::Put { entries } => entries
                    .iter()
                    .map(|e| e.key.len() + e.value.len() + 3 * FIELD)
                    .sum(),
                Command::Delete { keys } => keys.iter().map(|k| k.len() + FIELD).sum(),
                Command::InsertIfAbsent { keys, value, .. } => {
                    value.len() + keys.iter().map(|k| k.len() + FIELD).sum::<usize>()
                }
                Command::Write { ops, .. } => ops
                    .iter()
                    .map(|op| {
                        let value = match &op.action {
                            Action::Set { value, .. } => value.len(),
                            Action::Expire { .. } | Action::Delete => 0,
                        };
                        op.key.len() + value + 4 * FIELD
                    })
                    .sum(),
            }
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

    /// [`Envelope::decode_record`] of a record held in `record`, whose keys and values share
    /// `record`'s buffer instead of each being copied out of it.
    pub fn decode_record_shared(record: &Bytes) -> Result<Vec<Envelope>, DecodeError> {
        shared::within(record, || Envelope::decode_record(record))
    }

    /// One record holding `encoded` envelopes (each from [`Envelope::encode`]): the envelope
    /// itself if there is one, else a batch of them. Its size is [`record_bytes`] of theirs.
    pub fn encode_record(encoded: &[Bytes]) -> Bytes {
        if let [single] = encoded {
            return single.clone();
        }
        let size = record_bytes(encoded.len(), encoded.iter().map(Bytes::len).sum());
        let mut out = Vec::with_capacity(size);
        out.push(FORMAT_VERSION_BATCH);
        let count = u32::try_from(encoded.len()).expect("a batch holds fewer than 2^32 envelopes");
        out.extend_from_slice(&count.to_le_bytes());
        for envelope in encoded {
            let len =
                u32::try_from(envelope.len()).expect("an envelope in a batch fits in 32 bits");
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(envelope);
        }
        Bytes::from(out)
    }

    /// The envelopes of a record, in order: one, or every one of a batch. A batch that is cut
    /// short or too long, empty, or holds a batch is malformed.
    pub fn decode_record(bytes: &[u8]) -> Result<Vec<Envelope>, DecodeError> {
        let Some((&FORMAT_VERSION_BATCH, rest)) = bytes.split_first() else {
            return Ok(vec![Envelope::decode(bytes)?]);
        };
        let malformed = |detail| DecodeError::MalformedBatch { detail };
        let (count, mut rest) = rest
            .split_first_chunk::<4>()
            .ok_or(malformed("its count of envelopes is cut short"))?;
        let count = u32::from_le_bytes(*count) as usize;
        if count == 0 {
            return Err(malformed("it holds no envelope"));
        }
        // Bounded by what the bytes can hold, not by what the count claims.
        let mut envelopes = Vec::with_capacity(count.min(rest.len() / BATCH_FRAME_BYTES));
        for _ in 0..count {
            let (len, after) = rest
                .split_first_chunk::<BATCH_FRAME_BYTES>()
                .ok_or(malformed("an envelope's length is cut short"))?;
            let len = u32::from_le_bytes(*len) as usize;
            if after.len() < len {
                return Err(malformed("an envelope is cut short"));
            }
            let (envelope, after) = after.split_at(len);
            if envelope.first() == Some(&FORMAT_VERSION_BATCH) {
                return Err(malformed("a batch holds a batch"));
            }
            envelopes.push(Envelope::decode(envelope)?);
            rest = after;
        }
        if !rest.is_empty() {
            return Err(malformed("bytes follow its last envelope"));
        }
        Ok(envelopes)
    }
}

/// The size of the record that [`Envelope::encode_record`] makes of `count` envelopes of
/// `envelope_bytes` in all.
pub fn record_bytes(count: usize, envelope_bytes: usize) -> usize {
    match count {
        1 => envelope_bytes,
        n => BATCH_HEADER_BYTES + n * BATCH_FRAME_BYTES + envelope_bytes,
    }
}

/// Decoding that shares the record's buffer: the keys and values of a record make up most of its
/// bytes, and a processor that applies many records a second would otherwise copy every one of
/// them into an allocation of its own before copying it into the store.
///
/// The byte fields of the records' types deserialize through [`bytes`] and [`bytes_vec`], which
/// borrow the field from the input and, inside [`within`], return a slice of the record that the
/// input is; anywhere else (or for input that is not that record) they copy, as plain `Bytes`
/// fields would. The encoding is the same either way.
mod shared {
    use bytes::Bytes;
    use serde::de::{Deserialize, Deserializer, SeqAccess, Visitor};
    use std::cell::RefCell;

    thread_local! {
        /// The record being decoded by [`within`] on this thread.
        static RECORD: RefCell<Option<Bytes>> = const { RefCell::new(None) };
    }

    /// Runs `decode`, whose byte fields from `record` then share its buffer.
    pub(super) fn within<T>(record: &Bytes, decode: impl FnOnce() -> T) -> T {
        /// Puts the previous record back however `decode` ends.
        struct Restore(Option<Bytes>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0.take();
                RECORD.with(|r| *r.borrow_mut() = previous);
            }
        }
        let _restore = Restore(RECORD.with(|r| r.replace(Some(record.clone()))));
        decode()
    }

    /// `field` as a slice of the record being decoded if it lies inside it, else copied.
    fn share(field: &[u8]) -> Bytes {
        RECORD.with(|r| match &*r.borrow() {
            Some(record) if !field.is_empty() && within_range(record, field) => {
                record.slice_ref(field)
            }
            _ => Bytes::copy_from_slice(field),
        })
    }

    fn within_range(record: &[u8], field: &[u8]) -> bool {
        let outer = record.as_ptr_range();
        let inner = field.as_ptr_range();
        outer.start <= inner.start && inner.end <= outer.end
    }

    /// One byte field, borrowed from the input.
    struct Borrowed(Bytes);

    impl<'de> Deserialize<'de> for Borrowed {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            deserializer.deserialize_bytes(BytesVisitor).map(Borrowed)
        }
    }

    struct BytesVisitor;

    impl<'de> Visitor<'de> for BytesVisitor {
        type Value = Bytes;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("bytes")
        }

        fn visit_borrowed_bytes<E>(self, v: &'de [u8]) -> Result<Bytes, E> {
            Ok(share(v))
        }

        fn visit_bytes<E>(self, v: &[u8]) -> Result<Bytes, E> {
            Ok(Bytes::copy_from_slice(v))
        }

        fn visit_byte_buf<E>(self, v: Vec<u8>) -> Result<Bytes, E> {
            Ok(Bytes::from(v))
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Bytes, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(byte) = seq.next_element::<u8>()? {
                out.push(byte);
            }
            Ok(Bytes::from(out))
        }
    }

    pub(super) fn bytes<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Bytes, D::Error> {
        Borrowed::deserialize(deserializer).map(|b| b.0)
    }

    pub(super) fn bytes_vec<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<Bytes>, D::Error> {
        let all = Vec::<Borrowed>::deserialize(deserializer)?;
        Ok(all.into_iter().map(|b| b.0).collect())
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
            let encoded = envelope.encode();
            prop_assert!(encoded.len() <= envelope.encoded_bytes_hint());
            prop_assert_eq!(Envelope::decode(&encoded).unwrap(), envelope);
        }
    }

    proptest! {
        #[test]
        fn batches_round_trip(commands in proptest::collection::vec(command(), 1..6), ts: u64) {
            let envelopes: Vec<Envelope> = commands
                .into_iter()
                .enumerate()
                .map(|(i, command)| Envelope {
                    header: Header {
                        epoch: Epoch(3),
                        timestamp_ms: ts,
                        origin: Some(Origin { node: NodeId("n1".into()), boot_id: 7, request_id: i as u64 }),
                    },
                    command,
                })
                .collect();
            let encoded: Vec<Bytes> = envelopes.iter().map(Envelope::encode).collect();
            let record = Envelope::encode_record(&encoded);
            let envelope_bytes = encoded.iter().map(Bytes::len).sum();
            prop_assert_eq!(record.len(), record_bytes(encoded.len(), envelope_bytes));
            prop_assert_eq!(Envelope::decode_record(&record).unwrap(), envelopes.clone());
            prop_assert_eq!(Envelope::decode_record_shared(&record).unwrap(), envelopes);
        }
    }

    #[test]
    fn malformed_batches_are_refused() {
        let envelope = Envelope {
            header: Header {
                epoch: Epoch(1),
                timestamp_ms: 1,
                origin: None,
            },
            command: Command::Delete { keys: vec![] },
        }
        .encode();
        let batch = Envelope::encode_record(&[envelope.clone(), envelope.clone()]);
        assert_eq!(batch[0], FORMAT_VERSION_BATCH);
        assert_eq!(Envelope::decode_record(&batch).unwrap().len(), 2);
        // Every cut of it short of its end is refused, none is read as fewer envelopes, and
        // so is a byte too many.
        for cut in 1..batch.len() {
            let err = Envelope::decode_record(&batch[..cut]).unwrap_err();
            assert!(
                matches!(err, DecodeError::MalformedBatch { .. }),
                "cut at {cut}: {err}"
            );
        }
        let mut longer = batch.to_vec();
        longer.push(0);
        assert!(matches!(
            Envelope::decode_record(&longer),
            Err(DecodeError::MalformedBatch { .. })
        ));
        let nested = Envelope::encode_record(&[batch.clone(), envelope.clone()]);
        assert!(matches!(
            Envelope::decode_record(&nested),
            Err(DecodeError::MalformedBatch {
                detail: "a batch holds a batch"
            })
        ));
        // A single envelope stays the record it was, readable by builds before batches.
        assert_eq!(
            Envelope::encode_record(std::slice::from_ref(&envelope)),
            envelope
        );
        assert!(matches!(
            Envelope::decode(&batch),
            Err(DecodeError::UnknownVersion(FORMAT_VERSION_BATCH))
        ));
    }

    /// An envelope of `command` from no one, at epoch 1 and time 1.
    fn envelope(command: Command) -> Envelope {
        Envelope {
            header: Header {
                epoch: Epoch(1),
                timestamp_ms: 1,
                origin: None,
            },
            command,
        }
    }

    #[test]
    fn unknown_version_is_refused() {
        let err = Envelope::decode(&[9, 0, 0]).unwrap_err();
        assert!(matches!(err, DecodeError::UnknownVersion(9)), "{err}");
        assert!(matches!(Envelope::decode(&[]), Err(DecodeError::Empty)));
        // Only records that older builds cannot read carry the newer version.
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

    #[test]
    fn a_shared_decode_slices_the_record_instead_of_copying() {
        let value = Bytes::from(vec![7u8; 100]);
        let record = Envelope::encode_record(&[
            envelope(Command::Put {
                entries: vec![PutEntry {
                    key: Bytes::from_static(b"k1"),
                    value: value.clone(),
                    ttl_ms: None,
                }],
            })
            .encode(),
            envelope(Command::InsertIfAbsent {
                keys: vec![Bytes::from_static(b"k2"), Bytes::from_static(b"k3")],
                value: value.clone(),
                ttl_ms: Some(5),
            })
            .encode(),
        ]);
        let inside = |b: &Bytes| {
            let (outer, inner) = (record.as_ptr_range(), b.as_ptr_range());
            outer.start <= inner.start && inner.end <= outer.end
        };
        let decoded = Envelope::decode_record_shared(&record).unwrap();
        let Command::Put { entries } = &decoded[0].command else {
            panic!("not a put: {:?}", decoded[0]);
        };
        assert!(inside(&entries[0].key) && inside(&entries[0].value));
        assert_eq!(entries[0].value, value);
        let Command::InsertIfAbsent { keys, value: v, .. } = &decoded[1].command else {
            panic!("not an insert: {:?}", decoded[1]);
        };
        assert!(keys.iter().all(inside) && inside(v));
        assert_eq!(keys[1], Bytes::from_static(b"k3"));
        // The plain decode copies: its fields outlive no record.
        let copied = Envelope::decode_record(&record).unwrap();
        let Command::Put { entries } = &copied[0].command else {
            panic!("not a put");
        };
        assert!(!inside(&entries[0].value));
        assert_eq!(copied, decoded);
    }
}
