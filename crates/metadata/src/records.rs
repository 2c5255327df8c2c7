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
    /// The term of the controller that wrote the table last ([`ControllerLease::term`]). A
    /// controller that takes the lease over stamps its term here before it decides anything, and
    /// no controller writes a table stamped with a term newer than its own: so a controller that
    /// lost its lease while it was stalled finds its next write refused, by this stamp or by the
    /// table's version having moved.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub controller_term: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
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
    /// Wall clock of the node at its last heartbeat, in milliseconds since the Unix epoch. Shown
    /// to operators only: liveness is judged by whether the record changes, on the observer's
    /// own clock, never by comparing this with another machine's clock.
    pub heartbeat_ms: u64,
    /// The Cairn version it runs.
    pub version: String,
    /// What the node is doing, as it last said (or, for [`NodeState::Dead`], as the controller
    /// judged it).
    #[serde(default)]
    pub state: NodeState,
    /// Heartbeats of this generation so far: every heartbeat changes the record.
    #[serde(default)]
    pub heartbeats: u64,
}

/// A node's state in its record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeState {
    /// Registered, opening its stores: it leads nothing yet, and may be given partitions to
    /// follow.
    Starting,
    /// Serving: it may lead and follow partitions.
    #[default]
    Alive,
    /// It stopped cleanly: what it led may be moved at once.
    Left,
    /// The controller saw its record unchanged for the node timeout and wrote this over it
    /// (conditional on the version it saw). The node's own next heartbeat then fails, and it
    /// registers again as a new generation, having given up every leadership.
    Dead,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Starting => "starting",
            NodeState::Alive => "alive",
            NodeState::Left => "left",
            NodeState::Dead => "dead",
        }
    }
}

impl NodeRecord {
    pub fn key(name: &NodeId) -> String {
        format!("nodes/{name}")
    }
}

/// Who runs the controller. Key: [`ControllerLease::KEY`]. The holder renews it by rewriting
/// it (compare-and-swap) every heartbeat; another node takes it over once it has seen the record
/// unchanged for the node timeout on its own clock, or at once when the holder released it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerLease {
    pub holder: NodeId,
    /// Counts the takeovers: each new holder has a higher term than every earlier one, and
    /// stamps it on the partition table ([`PartitionTable::controller_term`]).
    #[serde(default)]
    pub term: u64,
    /// Renewals by this holder in this term: every renewal changes the record.
    #[serde(default)]
    pub renewals: u64,
    /// The holder stopped cleanly and gave the lease up: any node may take it at once.
    #[serde(default)]
    pub released: bool,
    /// The holder's wall clock at its last renewal, in milliseconds since the Unix epoch; shown
    /// to operators only.
    #[serde(default)]
    pub renewed_at_ms: u64,
}

impl ControllerLease {
    pub const KEY: &'static str = "controller";
}

/// What one node runs, as it last reported it. Key: [`Observed::key`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observed {
    pub partitions: BTreeMap<PartitionId, ObservedPartition>,
    /// The generation of the node that reported it ([`NodeRecord::generation`]): a report of an
    /// earlier generation says nothing of what the node runs now.
    #[serde(default)]
    pub generation: u64,
}

impl Observed {
    pub fn key(node: &NodeId) -> String {
        format!("observed/{node}")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedPartition {
    pub role: ObservedRole,
    pub epoch: Epoch,
    pub applied_lsn: u64,
    /// Why it is down, if it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What a node runs of a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ObservedRole {
    /// It leads the partition and serves its requests.
    Leader,
    /// It tails and applies the partition's log, ready to take over.
    Follower,
    /// It is bringing the partition up (repair, maybe a restore, replay).
    Starting,
    /// It is restoring the partition from a snapshot.
    Restoring,
    /// It cannot run the partition until an operator acts: the reason says why.
    Down,
}

impl ObservedRole {
    pub fn as_str(self) -> &'static str {
        match self {
            ObservedRole::Leader => "leader",
            ObservedRole::Follower => "follower",
            ObservedRole::Starting => "starting",
            ObservedRole::Restoring => "restoring",
            ObservedRole::Down => "down",
        }
    }
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
