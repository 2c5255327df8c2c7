//! Which cluster a snapshot belongs to: its name and when it was created.
//!
//! Two clusters can share a name and a repository (a cluster re-created on a reset base dir, or
//! two started with the same configuration). Their LSNs name different records, so a snapshot of
//! one is worthless to the other: it must not count towards the other's archived LSN, cover its
//! snapshot requests, guard its trims or be restored by it. The repository is opened for one
//! [`ClusterIdentity`] and every decision it offers counts only that cluster's snapshots.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A cluster's identity: its name and the time it was created (as the cluster record holds it).
/// The same names as in `metadata.json`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ClusterIdentity {
    pub cluster_name: String,
    pub cluster_created_at: String,
}

impl ClusterIdentity {
    pub fn new(cluster_name: impl Into<String>, cluster_created_at: impl Into<String>) -> Self {
        ClusterIdentity {
            cluster_name: cluster_name.into(),
            cluster_created_at: cluster_created_at.into(),
        }
    }
}

impl fmt::Display for ClusterIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cluster {:?} created at {}",
            self.cluster_name, self.cluster_created_at
        )
    }
}
