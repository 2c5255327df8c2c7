//! Snapshot ids: `snap_` + the id-format version digit `1` + a ULID in base62, e.g.
//! `snap_12PclG04SN8eVSKYXCFgXx7`.
//!
//! A ULID is a 128-bit number whose top 48 bits are the creation time in milliseconds since the Unix
//! epoch and whose low 80 bits are random. It is written as exactly 22 base62 digits (zero-padded)
//! from the alphabet `0-9A-Za-z`, which is in ASCII order: comparing two ids as strings therefore
//! compares their creation times first, and the repository can rely on string order.

use crate::Error;
use rand::Rng;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const PREFIX: &str = "snap_";
/// Version of the id format. A future format changes this digit, so old readers can refuse it.
const FORMAT_DIGIT: char = '1';
/// Base62 digits in ASCII order, so that the string order of ids is their numeric order.
const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
/// 62^22 > 2^128 > 62^21: every u128 fits in 22 digits.
const DIGITS: usize = 22;
const RANDOM_BITS: u32 = 80;
const TIMESTAMP_MS_MAX: u64 = (1 << 48) - 1;

/// The unique id of one snapshot of one partition.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SnapshotId(u128);

impl SnapshotId {
    /// A new id for a snapshot created at `now`. The clock and the randomness are passed in so
    /// that tests can control them. Times before 1970 or after the year 10889 are clamped.
    pub fn new(now: SystemTime, rng: &mut impl Rng) -> SnapshotId {
        let timestamp_ms = now
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
            .min(TIMESTAMP_MS_MAX);
        let random = rng.random::<u128>() & ((1u128 << RANDOM_BITS) - 1);
        SnapshotId((u128::from(timestamp_ms) << RANDOM_BITS) | random)
    }

    /// A new id from the system clock and the thread's random number generator.
    pub fn generate() -> SnapshotId {
        SnapshotId::new(SystemTime::now(), &mut rand::rng())
    }

    /// The id whose ULID is `ulid`.
    pub fn from_ulid(ulid: u128) -> SnapshotId {
        SnapshotId(ulid)
    }

    /// The ULID, as a number.
    pub fn ulid(self) -> u128 {
        self.0
    }

    /// When the id was created, to the millisecond.
    pub fn created_at(self) -> SystemTime {
        let timestamp_ms = (self.0 >> RANDOM_BITS) as u64;
        UNIX_EPOCH + Duration::from_millis(timestamp_ms)
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut digits = [b'0'; DIGITS];
        let mut rest = self.0;
        for slot in digits.iter_mut().rev() {
            *slot = ALPHABET[(rest % 62) as usize];
            rest /= 62;
        }
        // The alphabet is ASCII, so the digits are valid UTF-8.
        let digits = std::str::from_utf8(&digits).map_err(|_| fmt::Error)?;
        write!(f, "{PREFIX}{FORMAT_DIGIT}{digits}")
    }
}

impl fmt::Debug for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SnapshotId({self})")
    }
}

impl FromStr for SnapshotId {
    type Err = Error;

    fn from_str(input: &str) -> Result<Self, Error> {
        let invalid = |reason: &'static str| Error::InvalidSnapshotId {
            input: input.into(),
            reason,
        };
        let rest = input
            .strip_prefix(PREFIX)
            .ok_or_else(|| invalid("it does not start with `snap_`"))?;
        let digits = rest
            .strip_prefix(FORMAT_DIGIT)
            .ok_or_else(|| invalid("the id format digit after `snap_` is not 1"))?;
        if digits.len() != DIGITS {
            return Err(invalid(
                "it needs exactly 22 base62 characters after `snap_1`",
            ));
        }
        let mut value: u128 = 0;
        for byte in digits.bytes() {
            let digit = match byte {
                b'0'..=b'9' => byte - b'0',
                b'A'..=b'Z' => byte - b'A' + 10,
                b'a'..=b'z' => byte - b'a' + 36,
                _ => return Err(invalid("it contains a character outside 0-9, A-Z, a-z")),
            };
            value = value
                .checked_mul(62)
                .and_then(|v| v.checked_add(u128::from(digit)))
                .ok_or_else(|| invalid("the number is larger than 128 bits"))?;
        }
        Ok(SnapshotId(value))
    }
}

impl Serialize for SnapshotId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SnapshotId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;

    #[test]
    fn known_values_encode_in_ascii_ordered_base62() {
        assert_eq!(
            SnapshotId::from_ulid(0).to_string(),
            "snap_10000000000000000000000"
        );
        assert_eq!(
            SnapshotId::from_ulid(u128::MAX).to_string(),
            "snap_17n42DGM5Tflk9n8mt7Fhc7"
        );
        // The ULID of seed 002's snap_15YNkGdyO9YatUZwRidwr7j (created 2024-11-12T12:11:46.204Z),
        // written in this crate's form. Restate writes the ULID's bytes swapped and in the
        // alphabet 0-9a-zA-Z, so its ids do not sort by time; Cairn's do.
        let id = SnapshotId::from_ulid(2093150492079866388857063190669787332);
        assert_eq!(id.to_string(), "snap_102yECrOXkf6cbdomozESsW");
        assert_eq!(
            humantime::format_rfc3339_millis(id.created_at()).to_string(),
            "2024-11-12T12:11:46.204Z"
        );
    }

    #[test]
    fn the_ids_of_the_seeds_have_the_same_shape() {
        for seed in [
            "snap_12PclG04SN8eVSKYXCFgXx7",
            "snap_15YNkGdyO9YatUZwRidwr7j",
        ] {
            let id: SnapshotId = seed.parse().unwrap();
            assert_eq!(id.to_string(), seed);
        }
    }

    #[test]
    fn malformed_ids_are_refused_with_the_expected_shape() {
        for bad in [
            "",
            "snap",
            "snap_",
            "12PclG04SN8eVSKYXCFgXx7",
            "snap_22PclG04SN8eVSKYXCFgXx7",
            "snap_12PclG04SN8eVSKYXCFgXx",
            "snap_12PclG04SN8eVSKYXCFgXx77",
            "snap_12PclG04SN8eVSKYXCFg-x7",
            "snap_1zzzzzzzzzzzzzzzzzzzzzz",
        ] {
            let err = bad.parse::<SnapshotId>().unwrap_err().to_string();
            assert!(
                err.starts_with("snapshot id must look like snap_1"),
                "{err}"
            );
        }
    }

    #[test]
    fn serde_uses_the_string_form() {
        let id: SnapshotId = "snap_12PclG04SN8eVSKYXCFgXx7".parse().unwrap();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"snap_12PclG04SN8eVSKYXCFgXx7\"");
        assert_eq!(serde_json::from_str::<SnapshotId>(&json).unwrap(), id);
        assert!(serde_json::from_str::<SnapshotId>("\"snap_x\"").is_err());
    }

    proptest! {
        #[test]
        fn display_and_parse_round_trip(ulid: u128) {
            let id = SnapshotId::from_ulid(ulid);
            let text = id.to_string();
            prop_assert_eq!(text.len(), 5 + 1 + 22);
            prop_assert_eq!(text.parse::<SnapshotId>().unwrap(), id);
        }

        #[test]
        fn ids_sort_as_strings_and_numbers_by_creation_time(
            a_ms in 0u64..TIMESTAMP_MS_MAX,
            b_ms in 0u64..TIMESTAMP_MS_MAX,
            seed: u64,
        ) {
            prop_assume!(a_ms != b_ms);
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let a = SnapshotId::new(UNIX_EPOCH + Duration::from_millis(a_ms), &mut rng);
            let b = SnapshotId::new(UNIX_EPOCH + Duration::from_millis(b_ms), &mut rng);
            prop_assert_eq!(a.cmp(&b), a_ms.cmp(&b_ms));
            prop_assert_eq!(a.to_string().cmp(&b.to_string()), a_ms.cmp(&b_ms));
            prop_assert_eq!(a.created_at(), UNIX_EPOCH + Duration::from_millis(a_ms));
        }
    }
}
