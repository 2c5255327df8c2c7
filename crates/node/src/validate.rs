//! Checks of client requests against the documented bounds, before anything reaches a log.
//! Every refusal is INVALID_ARGUMENT with the bound in the message.

use bytes::Bytes;
use cairn_api::v1;
use cairn_types::limits::{
    BATCH_BYTES_MAX, BATCH_KEYS_MAX, KEY_BYTES_MAX, TTL_MS_MAX, VALUE_BYTES_MAX,
};
use cairn_types::record::{Action, Condition, Expiry, WriteOp};
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

/// The entries of a put.
pub fn entries(entries: &[v1::Entry]) -> Result<(), Status> {
    batch_len(entries.len())?;
    let mut total = 0;
    for (i, e) in entries.iter().enumerate() {
        key_ok(i, &e.key)?;
        value_ok(i, &e.value)?;
        ttl_ok(e.ttl_ms)?;
        total += e.key.len() + e.value.len();
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

/// Operations of one conditional write that may ask for the old value: as many largest values as
/// fit one answer.
pub const RETURN_OLD_MAX: usize = BATCH_BYTES_MAX / VALUE_BYTES_MAX;

/// The operations of a conditional write, checked and in the form the log records them.
pub fn write_ops(ops: &[v1::WriteOp]) -> Result<Vec<WriteOp>, Status> {
    let mut out = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        let expiry = |spec: &Option<v1::ExpirySpec>| {
            use v1::expiry_spec::When;
            match spec.as_ref().and_then(|s| s.when.as_ref()) {
                None | Some(When::Never(_)) => Expiry::Never,
                Some(When::Keep(_)) => Expiry::Keep,
                Some(When::AtMs(at)) => Expiry::At(*at),
                Some(When::AfterMs(ms)) => Expiry::After(*ms),
            }
        };
        let action = match &op.action {
            Some(v1::write_op::Action::Set(set)) => Action::Set {
                value: set.value.clone(),
                expiry: expiry(&set.expiry),
            },
            Some(v1::write_op::Action::Expire(expire)) => Action::Expire {
                expiry: expiry(&expire.expiry),
            },
            Some(v1::write_op::Action::Delete(_)) => Action::Delete,
            None => {
                return Err(Status::invalid_argument(format!(
                    "operation #{i} has no action; give set, expire or delete"
                )));
            }
        };
        let condition = match v1::WriteCondition::try_from(op.condition) {
            Ok(v1::WriteCondition::Always) => Condition::Always,
            Ok(v1::WriteCondition::IfAbsent) => Condition::IfAbsent,
            Ok(v1::WriteCondition::IfPresent) => Condition::IfPresent,
            Ok(v1::WriteCondition::IfNoExpiry) => Condition::IfNoExpiry,
            Ok(v1::WriteCondition::IfHasExpiry) => Condition::IfHasExpiry,
            Ok(v1::WriteCondition::IfLater) => Condition::IfLater,
            Ok(v1::WriteCondition::IfEarlier) => Condition::IfEarlier,
            Ok(v1::WriteCondition::IfHasEarlierExpiry) => Condition::IfHasEarlierExpiry,
            Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "operation #{i} has condition {}, which this server does not know; upgrade it",
                    op.condition
                )));
            }
        };
        out.push(WriteOp {
            key: op.key.clone(),
            action,
            condition,
            return_old: op.return_old,
        });
    }
    ops_ok(&out)?;
    Ok(out)
}

/// The bounds of a conditional write's operations, whichever front end they came from.
pub fn ops_ok(ops: &[WriteOp]) -> Result<(), Status> {
    batch_len(ops.len())?;
    let returning = ops.iter().filter(|op| op.return_old).count();
    if returning > RETURN_OLD_MAX {
        return Err(Status::invalid_argument(format!(
            "{returning} operations ask for the old value; the limit is {RETURN_OLD_MAX} per \
             request (each may be {VALUE_BYTES_MAX} bytes, and the answer must stay within \
             {BATCH_BYTES_MAX} bytes), split it"
        )));
    }
    let mut total = 0usize;
    for (i, op) in ops.iter().enumerate() {
        key_ok(i, &op.key)?;
        total += op.key.len();
        let (expiry, set) = match &op.action {
            Action::Set { value, expiry } => {
                value_ok(i, value)?;
                total += value.len();
                (*expiry, true)
            }
            Action::Expire { expiry } => (*expiry, false),
            Action::Delete => continue,
        };
        match expiry {
            // A set whose value expires as it is written is almost certainly a mistake; an
            // expire of 0 ms is how a key is made to expire now.
            Expiry::After(0) if set => {
                return Err(Status::invalid_argument(format!(
                    "operation #{i} sets a value that expires after 0 ms; give a positive \
                     after_ms, or none for no expiry"
                )));
            }
            Expiry::After(ms) if ms > TTL_MS_MAX => {
                return Err(Status::invalid_argument(format!(
                    "operation #{i} expires after {ms} ms; the limit is {TTL_MS_MAX} ms (10 years)"
                )));
            }
            _ => {}
        }
    }
    batch_bytes(total)
}
