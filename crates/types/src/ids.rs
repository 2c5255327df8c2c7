//! Identifiers. Each is a newtype so that an LSN can never be passed where an epoch is expected.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Index of a partition, `0 .. num_partitions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PartitionId(pub u16);

/// A log's id. Every partition has exactly one log and the two share their number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LogId(pub u16);

impl From<PartitionId> for LogId {
    fn from(id: PartitionId) -> Self {
        LogId(id.0)
    }
}

impl From<LogId> for PartitionId {
    fn from(id: LogId) -> Self {
        PartitionId(id.0)
    }
}

/// Log sequence number. LSNs start at 1 and are dense; 0 means "nothing" (an empty log's tail, a
/// partition that has applied nothing, a log that was never trimmed).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);

    pub fn next(self) -> Lsn {
        Lsn(self.0 + 1)
    }
}

/// Leadership epoch of a partition. Every record carries the epoch of the leader that appended it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Epoch(pub u64);

/// A node's name, as configured by `node-name`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub String);

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    )*};
}
display_inner!(PartitionId, LogId, Lsn, Epoch, NodeId);
