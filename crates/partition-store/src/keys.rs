//! Encoding of keys and values inside a partition's column family.

use bytes::Bytes;
use cairn_types::{PartitionKey, partition_key};

pub(crate) const TABLE_DATA: u8 = b'd';
pub(crate) const TABLE_FSM: u8 = b'f';

pub(crate) const FSM_APPLIED_LSN: u8 = 1;
pub(crate) const FSM_LEADER: u8 = 2;
pub(crate) const FSM_PARTITION_TIME: u8 = 3;

const VALUE_FORMAT_V1: u8 = 1;

pub(crate) fn data_key(user_key: &[u8]) -> Vec<u8> {
    data_key_with(partition_key(user_key), user_key)
}

pub(crate) fn data_key_with(pk: PartitionKey, user_key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + user_key.len());
    append_data_key_with(&mut out, pk, user_key);
    out
}

/// [`data_key`], appended to `out`.
pub(crate) fn append_data_key(out: &mut Vec<u8>, user_key: &[u8]) {
    append_data_key_with(out, partition_key(user_key), user_key);
}

fn append_data_key_with(out: &mut Vec<u8>, pk: PartitionKey, user_key: &[u8]) {
    out.push(TABLE_DATA);
    out.extend_from_slice(&pk.to_be_bytes());
    out.extend_from_slice(user_key);
}

pub(crate) fn is_data_key(key: &[u8]) -> bool {
    key.first() == Some(&TABLE_DATA)
}

/// The expiry of an encoded value, without copying it: `None` if it never expires or does not
/// decode.
pub(crate) fn expiry_of(raw: &[u8]) -> Option<u64> {
    match raw {
        [VALUE_FORMAT_V1, expiry @ ..] if expiry.len() >= 8 => {
            let at = u64::from_be_bytes(expiry[..8].try_into().expect("8 bytes"));
            (at != 0).then_some(at)
        }
        _ => None,
    }
}

pub(crate) fn fsm_key(variable: u8) -> [u8; 2] {
    [TABLE_FSM, variable]
}

/// A value as the store holds it, appended to `out`:
/// `[version u8][expires_at_ms u64 BE, 0 = never][value]`.
pub(crate) fn append_value(out: &mut Vec<u8>, expires_at_ms: Option<u64>, value: &[u8]) {
    out.push(VALUE_FORMAT_V1);
    out.extend_from_slice(&expires_at_ms.unwrap_or(0).to_be_bytes());
    out.extend_from_slice(value);
}

/// Why a value record the store holds does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ValueError {
    #[error("empty value record")]
    Empty,
    #[error("value record of {0} bytes, shorter than its header")]
    Short(usize),
    #[error("unknown value format {0}")]
    UnknownFormat(u8),
}

pub(crate) fn decode_value(raw: &[u8]) -> Result<(Option<u64>, Bytes), ValueError> {
    match raw.split_first() {
        Some((&VALUE_FORMAT_V1, rest)) if rest.len() >= 8 => {
            let (expiry, value) = rest.split_at(8);
            let expiry = u64::from_be_bytes(expiry.try_into().expect("8 bytes"));
            Ok((
                (expiry != 0).then_some(expiry),
                Bytes::copy_from_slice(value),
            ))
        }
        Some((&VALUE_FORMAT_V1, _)) => Err(ValueError::Short(raw.len())),
        Some((&other, _)) => Err(ValueError::UnknownFormat(other)),
        None => Err(ValueError::Empty),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode_value(expires_at_ms: Option<u64>, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        append_value(&mut out, expires_at_ms, value);
        out
    }

    proptest! {
        #[test]
        fn values_round_trip(expiry in proptest::option::of(1u64..), value: Vec<u8>) {
            let (e, v) = decode_value(&encode_value(expiry, &value)).unwrap();
            prop_assert_eq!(e, expiry);
            prop_assert_eq!(&v[..], &value[..]);
        }

        #[test]
        fn the_expiry_is_read_without_decoding_the_value(expiry in proptest::option::of(1u64..), value: Vec<u8>) {
            prop_assert_eq!(expiry_of(&encode_value(expiry, &value)), expiry);
        }

        #[test]
        fn data_keys_sort_by_partition_key(a: Vec<u8>, b: Vec<u8>) {
            let (pa, pb) = (partition_key(&a), partition_key(&b));
            if pa < pb {
                prop_assert!(data_key(&a) < data_key(&b));
            }
        }
    }

    #[test]
    fn values_that_do_not_decode_say_why() {
        assert_eq!(decode_value(&[]), Err(ValueError::Empty));
        assert_eq!(
            decode_value(&[VALUE_FORMAT_V1, 0, 0]),
            Err(ValueError::Short(3))
        );
        assert_eq!(decode_value(&[9; 12]), Err(ValueError::UnknownFormat(9)));
    }

    #[test]
    fn fsm_keys_sort_after_data() {
        assert!(data_key_with(u64::MAX, &[0xff; 8]).as_slice() < fsm_key(0).as_slice());
    }
}
