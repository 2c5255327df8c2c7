//! Checks of client requests against the documented bounds, before anything reaches a log.
//! Every refusal is INVALID_ARGUMENT with the bound in the message.

use bytes::Bytes;
use cairn_types::limits::{
    BATCH_BYTES_MAX, BATCH_KEYS_MAX, KEY_BYTES_MAX, TTL_MS_MAX, VALUE_BYTES_MAX,
};
use tonic::Status;

pub fn keys(keys: &[Bytes]) -> Result<(), Status> {
    batch_len(keys.len())?;
    let mut total = 0;
    for (i, key) in keys.iter().enumerate() {
        key_ok(i, key)?;
        total += key.len();
    }
    batch_bytes(total)
}

pub fn batch_len(n: usize) -> Result<(), Status> {
    if n == 0 {
        return Err(Status::invalid_argument(
            "the request has no keys; send at least one",
        ));
    }
    if n > BATCH_KEYS_MAX {
        return Err(Status::invalid_argument(format!(
            "the request has {n} keys; the limit is {BATCH_KEYS_MAX} keys per request, split it"
        )));
    }
    Ok(())
}

pub fn key_ok(index: usize, key: &[u8]) -> Result<(), Status> {
    if key.is_empty() {
        return Err(Status::invalid_argument(format!(
            "key #{index} is empty; keys must have 1 to {KEY_BYTES_MAX} bytes"
        )));
    }
    if key.len() > KEY_BYTES_MAX {
        return Err(Status::invalid_argument(format!(
            "key #{index} has {} bytes; the limit is {KEY_BYTES_MAX} bytes",
            key.len()
        )));
    }
    Ok(())
}

pub fn value_ok(index: usize, value: &[u8]) -> Result<(), Status> {
    if value.len() > VALUE_BYTES_MAX {
        return Err(Status::invalid_argument(format!(
            "value #{index} has {} bytes; the limit is {VALUE_BYTES_MAX} bytes",
            value.len()
        )));
    }
    Ok(())
}

pub fn batch_bytes(total: usize) -> Result<(), Status> {
    if total > BATCH_BYTES_MAX {
        return Err(Status::invalid_argument(format!(
            "the request carries {total} bytes of keys and values; the limit is {BATCH_BYTES_MAX} bytes per request, split it"
        )));
    }
    Ok(())
}

/// Insert-if-absent stores its one value under every key, so the bound counts it once per key.
pub fn insert_if_absent_bytes(keys: &[Bytes], value_len: usize) -> Result<(), Status> {
    let key_bytes: usize = keys.iter().map(|k| k.len()).sum();
    let stored = value_len
        .saturating_mul(keys.len())
        .saturating_add(key_bytes);
    if stored > BATCH_BYTES_MAX {
        return Err(Status::invalid_argument(format!(
            "the request would store {stored} bytes (its {value_len}-byte value under each of its {} keys, plus {key_bytes} bytes of keys); the limit is {BATCH_BYTES_MAX} bytes per request, split it or send a smaller value",
            keys.len()
        )));
    }
    Ok(())
}

pub fn ttl_ok(ttl_ms: Option<u64>) -> Result<(), Status> {
    match ttl_ms {
        Some(0) => Err(Status::invalid_argument(
            "ttl_ms is 0; give a positive TTL, or leave it unset for no expiry",
        )),
        Some(t) if t > TTL_MS_MAX => Err(Status::invalid_argument(format!(
            "ttl_ms is {t}; the limit is {TTL_MS_MAX} ms (10 years)"
        ))),
        _ => Ok(()),
    }
}
