//! A Cairn cluster's membership and its controller.
//!
//! Every node registers itself in the metadata store and rewrites its record every heartbeat
//! ([`membership`]). Every node watches the others' records and the controller's lease on its
//! own monotonic clock ([`silence`]): a record that has not changed for the node timeout, while
//! the store itself answered throughout, belongs to a node that is silent. The node that holds
//! the controller's lease ([`controller`]) then writes `dead` over the silent node's record,
//! conditional on the version it saw, and moves what that node led to its followers: the
//! decisions come from [`plan`], a pure function of the cluster as observed, which the tests
//! drive without processes. A leader serves only while its own heartbeats keep succeeding
//! ([`lease`]): its lease runs out on its own clock strictly before any controller may judge it
//! dead, so a paused or cut-off leader stops answering before anybody else can be made leader.
//!
//! # Timing
//! All of it follows from one setting, the node timeout `T` ([`Timing`]): heartbeats every `T/2`
//! (a failed one again after `T/30`), a leader's lease of `2T/3` from the moment it sent its last
//! successful heartbeat, observations every `T/30` (a node is judged dead at most about that
//! long after its silence reached `T`). The argument that a deposed leader has stopped before
//! its successor serves needs only that every clock runs within 20% of real time; it is written
//! out at [`lease`]. The heartbeat interval plays no part in it: it only sets how long a
//! failover takes and how late a heartbeat may be before the lease has a gap.
//!
//! Architecture invariant: this crate knows the metadata store and its records, and nothing of
//! partitions' logs, stores or gRPC. What a node runs is the node's business; this crate only
//! says who should run what, and whether this node may still serve as a leader.

pub use cairn_types::clock;
pub mod balance;
pub mod controller;
mod flow;
pub mod lease;
pub mod membership;
pub mod operation;
pub mod plan;
pub mod silence;

pub use balance::{Move, Rebalance, RebalanceError, rebalance};
pub use clock::{BootClock, ManualClock, MonotonicClock};
pub use controller::{ClusterView, Controller, ControllerEvent, ControllerOptions, NodeView};
pub use lease::{LeaseGrant, LeaseLapsed, NodeLease};
pub use membership::{HeartbeatError, Member, RegisterError};
pub use operation::{MoveLimits, OperationView, advance, new_operation};
pub use plan::{Change, NodeCondition, PlacementOptions, Plan, View, plan};
pub use silence::Silence;

use std::time::Duration;

/// The cluster's timing, all of it derived from the node timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// A node whose record has not changed for this long (on the observer's clock, while the
    /// metadata store answered) is dead; the controller's lease is taken over after as long.
    pub node_timeout: Duration,
}

impl Timing {
    /// The default node timeout.
    pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_secs(3);

    pub fn new(node_timeout: Duration) -> Timing {
        Timing { node_timeout }
    }

    /// How often a node rewrites its record (and the controller its lease), from the start of
    /// one heartbeat to the start of the next.
    ///
    /// Half the node timeout, not less: a node is judged dead `T` after its last heartbeat was
    /// first seen, so a failover after a crash takes `T` less the time from that heartbeat to the
    /// crash, which is up to one interval and on average half of one. Beating every `T/2`
    /// instead of `T/3` takes a quarter of a second off the average failover at the default
    /// 3 s. What it costs is the lease's margin: a heartbeat must come back within `L - T/2`
    /// (`T/6`, 500 ms at the default) of being sent for the lease to run on without a gap, so a
    /// failed one is sent again after [`Timing::heartbeat_retry`] rather than a whole interval
    /// later. A gap is a pause in serving, never a stale answer.
    pub fn heartbeat_interval(&self) -> Duration {
        self.node_timeout / 2
    }

    /// How soon a heartbeat that failed is sent again.
    pub fn heartbeat_retry(&self) -> Duration {
        self.node_timeout / 30
    }

    /// How long a leader may serve after it sent its last successful heartbeat. See [`lease`]
    /// for why two thirds of the node timeout.
    pub fn leader_lease(&self) -> Duration {
        self.node_timeout * 2 / 3
    }

    /// How often every node reads the others' records and the controller's lease: what a
    /// failover may take past the node timeout, twice (once to see the last heartbeat, once to
    /// see its silence reach the timeout).
    pub fn observe_interval(&self) -> Duration {
        self.node_timeout / 30
    }
}

impl Default for Timing {
    fn default() -> Self {
        Timing::new(Timing::DEFAULT_NODE_TIMEOUT)
    }
}

/// Milliseconds since the Unix epoch, by this machine's wall clock: shown to operators, never
/// compared between machines to decide anything.
pub fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}
