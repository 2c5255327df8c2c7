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
    /// A planned move of the leadership to this follower (a scaling operation's cutover): the
    /// leader stops serving the partition, then names this node leader in its place, in one
    /// conditional write of the table. Nobody takes the leadership while it is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff: Option<NodeId>,
}

/// The scaling operations: the one under way, if any, and the last ones finished, oldest first.
/// Key: [`Operations::KEY`]. Only one runs at a time; the controller carries it out step by step
/// and writes every step here, so that another controller resumes where the last stopped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Operations {
    /// The id the next operation gets.
    pub next_id: u64,
    pub operations: Vec<Operation>,
}

impl Operations {
    pub const KEY: &'static str = "operations";
    /// Finished operations kept for `cluster operations list`.
    pub const FINISHED_KEPT: usize = 16;

    /// The operation that has not finished, if any.
    pub fn running(&self) -> Option<&Operation> {
        self.operations.iter().find(|op| !op.state.finished())
    }

    pub fn running_mut(&mut self) -> Option<&mut Operation> {
        self.operations.iter_mut().find(|op| !op.state.finished())
    }

    pub fn get(&self, id: u64) -> Option<&Operation> {
        self.operations.iter().find(|op| op.id == id)
    }

    /// Adds `op` under the next id (which it returns), forgetting the oldest finished ones
    /// beyond [`Operations::FINISHED_KEPT`].
    pub fn add(&mut self, mut op: Operation) -> u64 {
        self.next_id = self.next_id.max(1);
        op.id = self.next_id;
        self.next_id += 1;
        self.operations.push(op);
        while self
            .operations
            .iter()
            .filter(|op| op.state.finished())
            .count()
            > Self::FINISHED_KEPT
        {
            let oldest = self
                .operations
                .iter()
                .position(|op| op.state.finished())
                .expect("a finished operation");
            self.operations.remove(oldest);
        }
        self.next_id - 1
    }
}

/// One scaling operation: every partition placed, balanced, on `nodes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Operation {
    pub id: u64,
    /// Who asked for it: `cairnctl` (an operator) or `auto-rebalance` (the controller).
    pub requested_by: String,
    /// The nodes the partitions are placed on when it is done.
    pub nodes: BTreeSet<NodeId>,
    /// Partitions moved at once, at most.
    pub max_concurrent_moves: usize,
    pub state: OperationState,
    pub created_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// One per partition whose leader or followers change, by partition.
    pub moves: Vec<PartitionMove>,
}

/// Where an operation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OperationState {
    /// Moving partitions.
    Running,
    /// Asked to stop: moves not cut over yet are reverted, those cut over finish.
    Cancelling,
    /// Every move done.
    Succeeded,
    /// Finished, with some moves reverted (each says why).
    Failed,
    /// Stopped by `cancel`.
    Cancelled,
}

impl OperationState {
    pub fn finished(self) -> bool {
        matches!(
            self,
            OperationState::Succeeded | OperationState::Failed | OperationState::Cancelled
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OperationState::Running => "running",
            OperationState::Cancelling => "cancelling",
            OperationState::Succeeded => "succeeded",
            OperationState::Failed => "failed",
            OperationState::Cancelled => "cancelled",
        }
    }
}

/// One partition's move: from the placement it had when the operation began to the planned one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionMove {
    pub partition: PartitionId,
    pub from_leader: Option<NodeId>,
    #[serde(default)]
    pub from_followers: Vec<NodeId>,
    pub to_leader: NodeId,
    #[serde(default)]
    pub to_followers: Vec<NodeId>,
    pub step: MoveStep,
    /// When the move entered its step, ms since the Unix epoch by the controller's clock: how
    /// long a step may take is judged by it (a bound on waiting, never on safety).
    pub step_since_ms: u64,
    /// Why the move was reverted, or what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A partition move's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MoveStep {
    /// Not started: other moves take the operation's concurrency.
    Waiting,
    /// The nodes that newly hold the partition follow it: they load the newest snapshot and
    /// replay the log until they have caught up with the leader.
    Loading,
    /// The leader was asked to hand the leadership over to the planned leader.
    HandingOff,
    /// The planned leader leads; the nodes that no longer hold the partition are dropped once
    /// it serves.
    Dropping,
    Done,
    /// Undone, with the reason: the placement is as it was for this partition.
    Reverted,
    /// Undone by `cancel` before its cutover.
    Cancelled,
}

impl MoveStep {
    /// Started and not finished: it counts against the operation's concurrency.
    pub fn under_way(self) -> bool {
        matches!(
            self,
            MoveStep::Loading | MoveStep::HandingOff | MoveStep::Dropping
        )
    }

    pub fn finished(self) -> bool {
        matches!(
            self,
            MoveStep::Done | MoveStep::Reverted | MoveStep::Cancelled
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            MoveStep::Waiting => "waiting",
            MoveStep::Loading => "loading",
            MoveStep::HandingOff => "handing-off",
            MoveStep::Dropping => "dropping",
            MoveStep::Done => "done",
            MoveStep::Reverted => "reverted",
            MoveStep::Cancelled => "cancelled",
        }
    }
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
