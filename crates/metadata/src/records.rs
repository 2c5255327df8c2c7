//! The records kept in the metadata store.

use cairn_types::{Epoch, NodeId, PartitionId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionPlacement {
    pub leader: Option<NodeId>,
    pub epoch: Epoch,
}
