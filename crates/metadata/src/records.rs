//! The records kept in the metadata store.

use cairn_types::{Epoch, NodeId, PartitionId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Identity of the cluster, written once when it is created. Key: [`ClusterRecord::KEY`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterRecord {
    pub cluster_name: String,
    pub num_partitions: u16,
    pub created_at: String,
}

impl ClusterRecord {
    pub const KEY: &'static str = "cluster";
}

/// Who leads each partition, and at which epoch. Key: [`PartitionTable::KEY`]; its metadata
/// version is the table version that clients cache.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionTable {
    pub partitions: BTreeMap<PartitionId, PartitionPlacement>,
}

impl PartitionTable {
    pub const KEY: &'static str = "partition-table";
}

/// Where a partition runs. In a cluster the controller writes `leader` and `followers` (the
/// intent); the leader raises `epoch` when it takes the partition over, so that every record of
/// an earlier leader is fenced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionPlacement {
    pub leader: Option<NodeId>,
    pub epoch: Epoch,
    /// Nodes that tail and apply the log, ready to take over.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub followers: Vec<NodeId>,
}

/// The names of every node that ever joined the cluster. Key: [`Members::KEY`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Members {
    pub nodes: BTreeSet<NodeId>,
}

impl Members {
    pub const KEY: &'static str = "members";
}

/// A node as it registered itself, renewed by its heartbeats. Key: [`NodeRecord::key`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: NodeId,
    /// Where the other nodes and clients reach its gRPC port (`host:port`).
    pub address: String,
    /// Random id of the node's base dir: a restart of the same node on the same base dir has
    /// the same, a second node that took the same name has another.
    pub instance: String,
    /// Counts the starts of this node name.
    pub generation: u64,
    /// When this generation started, in milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// Wall clock of the node at its last heartbeat, in milliseconds since the Unix epoch.
    pub heartbeat_ms: u64,
    /// The Cairn version it runs.
    pub version: String,
}

impl NodeRecord {
    pub fn key(name: &NodeId) -> String {
        format!("nodes/{name}")
    }
}

/// Who runs the controller, until when. Key: [`ControllerLease::KEY`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerLease {
    pub holder: NodeId,
    /// The lease is the holder's until this wall-clock time, in milliseconds since the Unix
    /// epoch, unless it renews it.
    pub expires_ms: u64,
}

impl ControllerLease {
    pub const KEY: &'static str = "controller";
}

/// What one node runs, as it last reported it. Key: [`Observed::key`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observed {
    pub partitions: BTreeMap<PartitionId, ObservedPartition>,
}

impl Observed {
    pub fn key(node: &NodeId) -> String {
        format!("observed/{node}")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedPartition {
    /// `leader`, `follower`, `starting` or `down`.
    pub role: String,
    pub epoch: Epoch,
    pub applied_lsn: u64,
    /// Why it is down, if it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The archived LSNs of one partition (what its retained snapshots cover), each with when a node
/// first saw it, oldest first: automatic trimming waits `trim-log-delay` from there, whichever
/// node leads the partition by then. Key: [`ArchivedHistory::key`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchivedHistory {
    /// `(archived LSN, first seen in milliseconds since the Unix epoch)`.
    pub seen: Vec<(u64, u64)>,
}

impl ArchivedHistory {
    pub fn key(partition: PartitionId) -> String {
        format!("archived/{partition}")
    }

    /// Archived LSNs remembered per partition.
    pub const LEN_MAX: usize = 256;

    /// Notes `lsn` as the archived LSN at `now_ms`; returns whether anything changed. A smaller
    /// LSN than those known (the repository was rewound) makes the larger ones untrustworthy.
    pub fn remember(&mut self, lsn: u64, now_ms: u64) -> bool {
        if self.seen.last().map(|(known, _)| *known) == Some(lsn) {
            return false;
        }
        self.seen.retain(|(known, _)| *known < lsn);
        self.seen.push((lsn, now_ms));
        if self.seen.len() > Self::LEN_MAX {
            self.seen.remove(0);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_archived_history_keeps_when_each_lsn_was_first_seen() {
        let mut history = ArchivedHistory::default();
        assert!(history.remember(10, 1_000));
        assert!(
            !history.remember(10, 2_000),
            "seen already: its first sighting stays"
        );
        assert!(history.remember(20, 3_000));
        assert_eq!(history.seen, vec![(10, 1_000), (20, 3_000)]);
        // A rewound repository: the larger LSN is forgotten.
        assert!(history.remember(15, 4_000));
        assert_eq!(history.seen, vec![(10, 1_000), (15, 4_000)]);
        for lsn in 100..100 + ArchivedHistory::LEN_MAX as u64 {
            history.remember(lsn, lsn);
        }
        assert_eq!(history.seen.len(), ArchivedHistory::LEN_MAX);
        assert_eq!(history.seen[0].0, 100);
    }
}
