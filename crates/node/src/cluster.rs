//! A node among others (`[log] provider = "nats"`): the wiring of `cairn-controller` into the
//! node. Membership (registration, heartbeats, the leader's lease), the controller and its pure
//! planner live there; here the node joins, runs them as tasks, and hands the lease to the
//! partitions it leads.

use crate::config::Config;
use crate::metrics::Metrics;
use anyhow::Context;
use cairn_controller::{
    BootClock, ClusterView, Controller, ControllerOptions, LeaseGrant, Member, MonotonicClock,
    PlacementOptions, Timing,
};
use cairn_metadata::{MetadataStore, NodeRecord, NodeState};
use cairn_types::NodeId;
use std::sync::Arc;
use tokio::sync::watch;

pub use cairn_controller::plan::{Role, led_and_followed, role};

/// Milliseconds since the Unix epoch, by this node's clock.
pub fn now_ms() -> u64 {
    cairn_controller::wall_clock_ms()
}

/// The cluster's timing, from `[cluster] node-timeout`.
pub fn timing(config: &Config) -> Timing {
    Timing::new(config.cluster.node_timeout)
}

/// Registers this node as `starting` (a new generation of its name).
pub async fn join(
    metadata: Arc<dyn MetadataStore>,
    config: &Config,
    address: String,
    instance: String,
) -> anyhow::Result<Arc<Member>> {
    let record = NodeRecord {
        name: NodeId(config.node_name.clone()),
        address,
        instance,
        generation: 0,
        started_at_ms: 0,
        heartbeat_ms: 0,
        version: env!("CARGO_PKG_VERSION").to_string(),
        state: NodeState::Starting,
        heartbeats: 0,
    };
    let clock: Arc<dyn MonotonicClock> = Arc::new(BootClock);
    Ok(Member::register(metadata, record, timing(config), clock).await?)
}

/// This node's controller (it decides only while it holds the lease) and the cluster as it
/// observes it.
pub fn controller(
    metadata: Arc<dyn MetadataStore>,
    config: &Config,
    num_partitions: u16,
    metrics: Arc<Metrics>,
    member: &Member,
) -> (Controller, watch::Receiver<ClusterView>) {
    let options = ControllerOptions {
        me: NodeId(config.node_name.clone()),
        timing: timing(config),
        placement: PlacementOptions {
            num_partitions,
            initial_nodes: config.cluster.initial_nodes,
            standbys: config.cluster.standbys,
        },
        auto_rebalance: config.cluster.auto_rebalance,
        move_limits: cairn_controller::MoveLimits::default(),
    };
    let controller = Controller::new(
        metadata,
        options,
        Arc::new(BootClock),
        Box::new(move |event| metrics.controller_event(&event)),
    )
    .with_own_lease(member.lease().clone());
    let view = controller.view();
    (controller, view)
}

/// Says `alive` once the node has opened its stores, retrying every heartbeat interval until the
/// metadata store takes it.
pub async fn announce_alive(member: Arc<Member>, timing: Timing) -> anyhow::Result<()> {
    let mut attempts = 0u32;
    loop {
        match member.set_alive().await {
            Ok(()) => return Ok(()),
            Err(err) => {
                attempts += 1;
                if attempts == 1 {
                    tracing::warn!("cannot say that this node is alive yet: {err}; retrying");
                }
                tokio::time::sleep(timing.heartbeat_interval()).await;
            }
        }
        if attempts > 10_000 {
            return Err(anyhow::anyhow!(
                "the metadata store never took this node's state"
            ))
            .context("say that this node is alive");
        }
    }
}

/// A leadership's lease as the worker asks it.
pub(crate) struct Lease(pub LeaseGrant);

impl cairn_worker::LeaderLease for Lease {
    fn check(&self) -> Result<(), String> {
        self.0.check().map_err(|lapsed| lapsed.to_string())
    }

    fn revoked(&self) -> bool {
        self.0.revoked()
    }
}

/// A member's state as `nodes list` shows it: its record's (`starting`, `alive`, `dead`,
/// `left`), or `silent` for a record that has not changed for the node timeout.
pub fn shown_state(condition: cairn_controller::NodeCondition, state: NodeState) -> &'static str {
    match condition {
        cairn_controller::NodeCondition::Silent => "silent",
        _ => state.as_str(),
    }
}
