//! Partition keys and key ranges.
//!
//! A user key is hashed with xxh3-64 into a [`PartitionKey`]. A cluster of P partitions splits the
//! u64 space into P contiguous inclusive ranges of (almost) equal width; partition `i` owns range
//! `i`. Partition 1 of 2 therefore owns `2^63 ..= 2^64-1`.

use crate::PartitionId;
use serde::{Deserialize, Serialize};

pub type PartitionKey = u64;

/// The stable 64-bit hash that decides which partition owns a key. Never change it: stored data
/// and snapshots are laid out by it.
pub fn partition_key(key: &[u8]) -> PartitionKey {
    xxhash_rust::xxh3::xxh3_64(key)
}

/// An inclusive range of partition keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KeyRange {
    pub start: u64,
    pub end: u64,
}

impl KeyRange {
    pub fn contains(&self, key: PartitionKey) -> bool {
        self.start <= key && key <= self.end
    }

    /// The range that partition `partition` owns in a cluster of `num_partitions` partitions.
    ///
    /// Panics if `partition` is not below `num_partitions`: that is a programmer error.
    pub fn of_partition(partition: PartitionId, num_partitions: u16) -> KeyRange {
        assert!(num_partitions > 0, "a cluster has at least one partition");
        assert!(
            partition.0 < num_partitions,
            "partition {partition} of {num_partitions}"
        );
        let width = (1u128 << 64) / u128::from(num_partitions);
        let start = width * u128::from(partition.0);
        let end = if partition.0 + 1 == num_partitions {
            u128::from(u64::MAX)
        } else {
            start + width - 1
        };
        KeyRange {
            start: start as u64,
            end: end as u64,
        }
    }
}

/// The partition that owns `key` in a cluster of `num_partitions` partitions.
pub fn partition_for_key(key: PartitionKey, num_partitions: u16) -> PartitionId {
    assert!(num_partitions > 0, "a cluster has at least one partition");
    let width = (1u128 << 64) / u128::from(num_partitions);
    let index = (u128::from(key) / width).min(u128::from(num_partitions) - 1);
    PartitionId(index as u16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn two_partitions_split_the_space_in_halves() {
        assert_eq!(
            KeyRange::of_partition(PartitionId(1), 2),
            KeyRange {
                start: 9223372036854775808,
                end: u64::MAX
            }
        );
        assert_eq!(
            KeyRange::of_partition(PartitionId(0), 2),
            KeyRange {
                start: 0,
                end: 9223372036854775807
            }
        );
    }

    proptest! {
        #[test]
        fn ranges_tile_the_key_space(n in 1u16..=1024) {
            let mut next = 0u128;
            for p in 0..n {
                let r = KeyRange::of_partition(PartitionId(p), n);
                prop_assert_eq!(u128::from(r.start), next);
                prop_assert!(r.start <= r.end);
                next = u128::from(r.end) + 1;
            }
            prop_assert_eq!(next, 1u128 << 64);
        }

        #[test]
        fn every_key_lands_in_the_range_of_its_partition(key: u64, n in 1u16..=1024) {
            let p = partition_for_key(key, n);
            prop_assert!(KeyRange::of_partition(p, n).contains(key));
        }
    }
}
