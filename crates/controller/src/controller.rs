//! The controller: observes the members, holds or watches the controller's lease, and, while it
//! holds it, writes dead nodes dead and carries out [`crate::plan`]'s decisions.
//!
//! Every node runs one. Each reads the members' records and the lease every
//! [`Timing::observe_interval`], so every node knows who is silent (for `nodes list`) and can
//! take the lease over; only the holder decides.
//!
//! # The lease
//! `controller` names the holder and its term. The holder renews it every heartbeat
//! (compare-and-swap). Another node takes it over (the next term) once it has seen the record
//! unchanged for the node timeout on its own clock (see [`crate::silence`]), or at once when the
//! holder released it on a clean stop, or when the holder is this node's own name (its earlier
//! process is gone: it held the base dir's lock).
//!
//! # Fencing a stale controller
//! Everything the controller decides goes into two kinds of write, both conditional:
//! - `dead` over a node's record, conditional on the version it saw silent: it fails if the node
//!   wrote since, whoever attempts it.
//! - the partition table, conditional on the table's version, and stamped with the controller's
//!   term. A new holder's first write stamps its term on the table; no controller writes over a
//!   table stamped with a newer term than its own. So a holder that lost the lease while it was
//!   stalled finds every later write refused, by the table's version or by its stamp.
//!
//! All the controller's state is in the metadata store (the table, the records), so a new holder
//! continues where the last stopped: it reads the same and plans the same.

use crate::clock::MonotonicClock;
use crate::lease::NodeLease;
use crate::operation::{self, MoveLimits, OperationView};
use crate::plan::{self, Change, NodeCondition, PlacementOptions, View};
use crate::silence::Silence;
use crate::{Timing, wall_clock_ms};
use cairn_metadata::{
    ControllerLease, Members, MetadataStore, NodeRecord, NodeState, Observed, ObservedRole,
    Operation, Operations, PartitionTable, Precondition, Version, get_typed, put_typed,
};
use cairn_types::NodeId;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// What the controller needs to run.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    /// This node.
    pub me: NodeId,
    pub timing: Timing,
    pub placement: PlacementOptions,
    /// Whether the controller rebalances by itself: when the nodes that serve change (one
    /// joined, one was drained or died), it runs the scaling operation that places every
    /// partition, balanced, on them.
    pub auto_rebalance: bool,
    /// How long each step of a partition's move may take.
    pub move_limits: MoveLimits,
}

/// Partitions an automatic rebalance moves at once.
const AUTO_CONCURRENT_MOVES: usize = 2;
/// Who an automatic rebalance is requested by, in its record.
pub const AUTO_REBALANCE: &str = "auto-rebalance";
/// How long after an automatic rebalance failed the next may start.
const AUTO_RETRY_AFTER: Duration = Duration::from_secs(60);

fn names(nodes: &BTreeSet<NodeId>) -> String {
    nodes
        .iter()
        .map(|n| n.0.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// Logs every move that changed step.
fn log_steps(before: &Operation, after: &Operation) {
    for (was, now) in before.moves.iter().zip(&after.moves) {
        if was.step != now.step {
            let why = now
                .reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            info!(
                operation = after.id,
                partition = %now.partition,
                "partition {}: {} → {}{why}",
                now.partition,
                was.step.as_str(),
                now.step.as_str()
            );
        }
    }
    if after.state != before.state {
        info!(
            operation = after.id,
            "scaling operation {} {}",
            after.id,
            after.state.as_str()
        );
    }
}

/// Something the controller did, for the node's log and metrics.
#[derive(Debug, Clone)]
pub enum ControllerEvent {
    /// This node took the lease (a new term).
    Took { term: u64 },
    /// This node no longer holds the lease.
    Lost { term: u64 },
    /// This node wrote `node` dead, its record unchanged for `silent_for`.
    MarkedDead { node: NodeId, silent_for: Duration },
    /// A change of the placement was written. For a failover, `detected_after` is how long ago
    /// the old leader's record last changed, as this observer saw it.
    Changed {
        change: Change,
        detected_after: Option<Duration>,
    },
}

/// One member as this node observes it.
#[derive(Debug, Clone)]
pub struct NodeView {
    pub name: NodeId,
    /// Its record as last read; `None` if it has none.
    pub record: Option<NodeRecord>,
    pub condition: NodeCondition,
    /// How long ago its record last changed, by this node's clock.
    pub last_seen_ago: Option<Duration>,
}

/// The cluster as this node observes it: what `nodes list` and `cluster status` show.
#[derive(Debug, Clone, Default)]
pub struct ClusterView {
    pub nodes: Vec<NodeView>,
    /// The controller's lease as last read: holder and term.
    pub controller: Option<(NodeId, u64)>,
    /// Whether the last reads of the metadata store succeeded.
    pub store_answers: bool,
}

/// The lease while this node holds it.
struct Held {
    term: u64,
    version: Version,
    lease: ControllerLease,
    /// When the last renewal was sent, by [`Controller::clock`].
    renewed: Duration,
}

pub struct Controller {
    metadata: Arc<dyn MetadataStore>,
    options: ControllerOptions,
    clock: Arc<dyn MonotonicClock>,
    silence: Silence,
    /// This node's own lease, renewed by its heartbeats: while it does not hold, this node's
    /// writes do not reach the store, so neither may anyone's, and no silence counts.
    own_lease: Option<Arc<NodeLease>>,
    held: Option<Held>,
    view: watch::Sender<ClusterView>,
    on_event: Box<dyn Fn(ControllerEvent) + Send + Sync>,
    /// The number of nodes last said to be awaited, so that it is said once.
    waiting_said: Option<usize>,
}

/// What one read of the members gave.
struct Observation {
    records: BTreeMap<NodeId, Option<(Version, NodeRecord)>>,
    lease: Option<(Version, ControllerLease)>,
}

impl Controller {
    pub fn new(
        metadata: Arc<dyn MetadataStore>,
        options: ControllerOptions,
        clock: Arc<dyn MonotonicClock>,
        on_event: Box<dyn Fn(ControllerEvent) + Send + Sync>,
    ) -> Controller {
        let (view, _) = watch::channel(ClusterView::default());
        Controller {
            silence: Silence::new(options.timing.node_timeout),
            own_lease: None,
            metadata,
            options,
            clock,
            held: None,
            view,
            on_event,
            waiting_said: None,
        }
    }

    /// Judges nobody silent, and decides nothing, while `lease` (this node's own, renewed by
    /// its heartbeats) does not hold; silences count from when it holds again. A metadata store
    /// that answers reads but takes no writes (a NATS stream electing its leader) stops every
    /// node's heartbeats at once: evidence of that time is not evidence of anyone's death.
    pub fn with_own_lease(mut self, lease: Arc<NodeLease>) -> Controller {
        self.own_lease = Some(lease);
        self
    }

    /// The cluster as this node observes it, updated every observation.
    pub fn view(&self) -> watch::Receiver<ClusterView> {
        self.view.subscribe()
    }

    /// Observes and, holding the lease, decides, every [`Timing::observe_interval`] until
    /// `cancel`; then releases the lease if it holds it.
    pub async fn run(mut self, cancel: CancellationToken) {
        loop {
            self.tick().await;
            tokio::select! {
                () = tokio::time::sleep(self.options.timing.observe_interval()) => {}
                () = cancel.cancelled() => break,
            }
        }
        self.release().await;
    }

    /// One round: observe, then take, renew or watch the lease, then decide.
    pub async fn tick(&mut self) {
        let observed = match self.observe().await {
            Ok(observed) => observed,
            Err(err) => {
                self.silence.store_failed();
                self.view.send_modify(|view| view.store_answers = false);
                tracing::debug!("observe the members: {err}");
                return;
            }
        };
        self.publish_view(&observed);
        if let Some(lease) = &self.own_lease
            && !lease.holds()
        {
            self.silence.store_failed();
            return;
        }
        if let Err(err) = self.lease_round(observed.lease.clone()).await {
            warn!("controller lease: {err}");
            return;
        }
        if self.held.is_some()
            && let Err(err) = self.decide(observed).await
        {
            warn!("controller: {err}");
        }
    }

    fn me(&self) -> &NodeId {
        &self.options.me
    }

    async fn observe(&mut self) -> Result<Observation, cairn_metadata::Error> {
        let metadata = self.metadata.as_ref();
        let members = get_typed::<Members>(metadata, Members::KEY, "member list")
            .await?
            .map(|(_, m)| m)
            .unwrap_or_default();
        // All at once: the later a version is first seen, the later its silence is counted from.
        let keys: Vec<String> = members.nodes.iter().map(NodeRecord::key).collect();
        let (records, lease) = futures::future::join(
            futures::future::try_join_all(
                keys.iter()
                    .map(|key| get_typed::<NodeRecord>(metadata, key, "node record")),
            ),
            get_typed::<ControllerLease>(metadata, ControllerLease::KEY, "controller lease"),
        )
        .await;
        let records: BTreeMap<NodeId, _> = members.nodes.into_iter().zip(records?).collect();
        let lease = lease?;
        let now = self.clock.now();
        for (name, record) in &records {
            self.silence
                .saw(&NodeRecord::key(name), record.as_ref().map(|r| r.0), now);
        }
        self.silence
            .saw(ControllerLease::KEY, lease.as_ref().map(|l| l.0), now);
        Ok(Observation { records, lease })
    }

    fn condition(&self, name: &NodeId, record: Option<&NodeRecord>) -> NodeCondition {
        let Some(record) = record else {
            return NodeCondition::Gone;
        };
        match record.state {
            NodeState::Dead | NodeState::Left => NodeCondition::Gone,
            _ if self
                .silence
                .is_silent(&NodeRecord::key(name), self.clock.now()) =>
            {
                NodeCondition::Silent
            }
            NodeState::Starting => NodeCondition::Starting,
            NodeState::Alive => NodeCondition::Serving,
        }
    }

    fn publish_view(&self, observed: &Observation) {
        let now = self.clock.now();
        let nodes = observed
            .records
            .iter()
            .map(|(name, record)| NodeView {
                name: name.clone(),
                record: record.as_ref().map(|r| r.1.clone()),
                condition: self.condition(name, record.as_ref().map(|r| &r.1)),
                last_seen_ago: self.silence.seen_ago(&NodeRecord::key(name), now),
            })
            .collect();
        self.view.send_replace(ClusterView {
            nodes,
            controller: observed
                .lease
                .as_ref()
                .filter(|(_, l)| !l.released)
                .map(|(_, l)| (l.holder.clone(), l.term)),
            store_answers: true,
        });
    }

    /// Renews the lease if this node holds it; takes it if it is free, released, this node's
    /// own name's, or unchanged for the node timeout.
    async fn lease_round(
        &mut self,
        lease: Option<(Version, ControllerLease)>,
    ) -> Result<(), cairn_metadata::Error> {
        let now = self.clock.now();
        if let Some(held) = &self.held {
            if lease.as_ref().map(|l| l.0) != Some(held.version) {
                self.lost();
                return Ok(());
            }
            if now.saturating_sub(held.renewed) < self.options.timing.heartbeat_interval() {
                return Ok(());
            }
            let mut renewed = held.lease.clone();
            renewed.renewals += 1;
            renewed.renewed_at_ms = wall_clock_ms();
            return match put_typed(
                self.metadata.as_ref(),
                ControllerLease::KEY,
                &renewed,
                Precondition::MatchesVersion(held.version),
            )
            .await
            {
                Ok(version) => {
                    self.held = Some(Held {
                        term: held.term,
                        version,
                        lease: renewed,
                        renewed: now,
                    });
                    Ok(())
                }
                Err(cairn_metadata::Error::PreconditionFailed { .. }) => {
                    self.lost();
                    Ok(())
                }
                Err(err) => Err(err),
            };
        }
        let (precondition, term) = match &lease {
            None => (Precondition::DoesNotExist, 1),
            Some((version, current))
                if current.released
                    || current.holder == *self.me()
                    || self.silence.is_silent(ControllerLease::KEY, now) =>
            {
                (Precondition::MatchesVersion(*version), current.term + 1)
            }
            Some(_) => return Ok(()),
        };
        let taken = ControllerLease {
            holder: self.me().clone(),
            term,
            renewals: 0,
            released: false,
            renewed_at_ms: wall_clock_ms(),
        };
        let version = match put_typed(
            self.metadata.as_ref(),
            ControllerLease::KEY,
            &taken,
            precondition,
        )
        .await
        {
            Ok(version) => version,
            Err(cairn_metadata::Error::PreconditionFailed { .. }) => return Ok(()),
            Err(err) => return Err(err),
        };
        info!(node = %self.me(), term, "this node now runs the controller (term {term})");
        self.held = Some(Held {
            term,
            version,
            lease: taken,
            renewed: now,
        });
        (self.on_event)(ControllerEvent::Took { term });
        // The first decision: stamp the table with this term, so that a stalled earlier holder
        // can write nothing more.
        self.write_table(Some).await?;
        Ok(())
    }

    fn lost(&mut self) {
        if let Some(held) = self.held.take() {
            info!(term = held.term, "this node no longer runs the controller");
            (self.on_event)(ControllerEvent::Lost { term: held.term });
        }
    }

    /// Writes `change(table)` over the table, stamped with this holder's term, unless the table
    /// carries a newer term (then the lease is lost) or `change` returns `None`. Returns whether
    /// it wrote.
    async fn write_table(
        &mut self,
        change: impl FnOnce(PartitionTable) -> Option<PartitionTable>,
    ) -> Result<bool, cairn_metadata::Error> {
        let Some(term) = self.held.as_ref().map(|h| h.term) else {
            return Ok(false);
        };
        let (precondition, table) = match get_typed::<PartitionTable>(
            self.metadata.as_ref(),
            PartitionTable::KEY,
            "partition table",
        )
        .await?
        {
            Some((version, table)) => (Precondition::MatchesVersion(version), table),
            None => (Precondition::DoesNotExist, PartitionTable::default()),
        };
        if table.controller_term > term {
            self.lost();
            return Ok(false);
        }
        let stamped = table.controller_term == term;
        let Some(mut next) = change(table.clone()) else {
            return Ok(false);
        };
        next.controller_term = term;
        if stamped && next == table {
            return Ok(false);
        }
        match put_typed(
            self.metadata.as_ref(),
            PartitionTable::KEY,
            &next,
            precondition,
        )
        .await
        {
            Ok(_) => Ok(true),
            // Someone wrote meanwhile (a leader raising its epoch): the next round plans again.
            Err(cairn_metadata::Error::PreconditionFailed { .. }) => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// Writes silent nodes dead, then the placement [`plan`] gives.
    async fn decide(&mut self, observed: Observation) -> Result<(), cairn_metadata::Error> {
        let now = self.clock.now();
        let mut conditions: BTreeMap<NodeId, NodeCondition> = BTreeMap::new();
        for (name, record) in &observed.records {
            let mut condition = self.condition(name, record.as_ref().map(|r| &r.1));
            if condition == NodeCondition::Silent
                && let Some((version, record)) = record
                && self.mark_dead(name, *version, record, now).await?
            {
                condition = NodeCondition::Gone;
            }
            conditions.insert(name.clone(), condition);
        }
        let Some((_, table)) = get_typed::<PartitionTable>(
            self.metadata.as_ref(),
            PartitionTable::KEY,
            "partition table",
        )
        .await?
        else {
            return Ok(());
        };
        let operations = get_typed::<Operations>(
            self.metadata.as_ref(),
            Operations::KEY,
            "the scaling operations",
        )
        .await?;
        let running = operations
            .as_ref()
            .is_some_and(|(_, ops)| ops.running().is_some());
        // What this generation of each node reported running: the followers of partitions
        // that need a new leader, and with an operation under way, every node.
        let mut reports: BTreeMap<NodeId, Observed> = BTreeMap::new();
        let mut wanted: BTreeSet<NodeId> = BTreeSet::new();
        for placement in table.partitions.values() {
            let leader_serves = placement
                .leader
                .as_ref()
                .is_some_and(|l| conditions.get(l) == Some(&NodeCondition::Serving));
            if !leader_serves {
                wanted.extend(placement.followers.iter().cloned());
            }
        }
        if running {
            wanted.extend(observed.records.keys().cloned());
        }
        for node in wanted {
            let generation = observed
                .records
                .get(&node)
                .and_then(|r| r.as_ref())
                .map(|(_, r)| r.generation);
            let report =
                get_typed::<Observed>(self.metadata.as_ref(), &Observed::key(&node), "report")
                    .await?
                    .map(|(_, o)| o);
            if let Some(report) = report
                && Some(report.generation) == generation
            {
                reports.insert(node, report);
            }
        }
        let mut applied = BTreeMap::new();
        for (partition, placement) in &table.partitions {
            for follower in &placement.followers {
                if let Some(running) = reports
                    .get(follower)
                    .and_then(|r| r.partitions.get(partition))
                    && running.role == ObservedRole::Follower
                {
                    applied.insert((*partition, follower.clone()), running.applied_lsn);
                }
            }
        }
        let view = View {
            table,
            nodes: conditions,
            applied,
        };
        let planned = plan::plan(&view, &self.options.placement);
        if let Some(waiting) = planned.waiting_for {
            if self.waiting_said != Some(waiting) {
                info!(
                    "waiting for {waiting} more of cluster.initial-nodes = {} nodes before placing \
                     partitions",
                    self.options.placement.initial_nodes
                );
                self.waiting_said = Some(waiting);
            }
            return Ok(());
        }
        let mut next = planned.table.clone();
        // The scaling operation under way (or one this controller starts), a step further.
        let mut operation = None;
        if let Some((version, mut ops)) = operations.clone().or_else(|| {
            self.options
                .auto_rebalance
                .then(|| (0, Operations::default()))
        }) {
            let op_view = OperationView {
                nodes: view.nodes.clone(),
                reports,
                now_ms: wall_clock_ms(),
            };
            if ops.running().is_none()
                && self.options.auto_rebalance
                && let Some(auto) = self.auto_rebalance(&ops, &next, &op_view)
            {
                info!(
                    "auto-rebalance: {} partitions move to place them on {}",
                    auto.moves.len(),
                    names(&auto.nodes)
                );
                ops.add(auto);
            }
            if let Some(op) = ops.running_mut() {
                let before = op.clone();
                operation::advance(op, &mut next, &op_view, &self.options.move_limits);
                if *op != before {
                    log_steps(&before, op);
                    operation = Some((version, ops));
                }
            }
        }
        if planned.changes.is_empty() && next == view.table && operation.is_none() {
            return Ok(());
        }
        let expected = view.table.clone();
        let written = if next == view.table {
            true
        } else {
            // Only over the table the plan was made from: a table that moved meanwhile is planned
            // again in the next round.
            let to_write = next.clone();
            self.write_table(move |current| {
                let mut comparable = current.clone();
                comparable.controller_term = expected.controller_term;
                (comparable == expected).then_some(to_write)
            })
            .await?
        };
        if !written {
            return Ok(());
        }
        for change in planned.changes {
            let detected_after = match &change {
                Change::Failover { from, .. } => self.silence.seen_ago(&NodeRecord::key(from), now),
                _ => None,
            };
            info!("{change}");
            (self.on_event)(ControllerEvent::Changed {
                change,
                detected_after,
            });
        }
        if let Some((version, ops)) = operation {
            // After the table: a step whose record is lost to a crash is taken again from the
            // table by the next controller, and taking it again changes nothing.
            let precondition = if version == 0 {
                Precondition::DoesNotExist
            } else {
                Precondition::MatchesVersion(version)
            };
            match put_typed(self.metadata.as_ref(), Operations::KEY, &ops, precondition).await {
                Ok(_) | Err(cairn_metadata::Error::PreconditionFailed { .. }) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(())
    }

    /// The operation that places every partition, balanced, on the nodes that serve, when every
    /// member serves (none starting, silent) and the placement is not balanced on them.
    /// After an automatic one that failed, the next waits [`AUTO_RETRY_AFTER`].
    fn auto_rebalance(
        &self,
        ops: &Operations,
        table: &PartitionTable,
        view: &OperationView,
    ) -> Option<Operation> {
        if let Some(last) = ops.operations.last()
            && last.requested_by == AUTO_REBALANCE
            && last.state == cairn_metadata::OperationState::Failed
            && view
                .now_ms
                .saturating_sub(last.finished_at_ms.unwrap_or_default())
                < AUTO_RETRY_AFTER.as_millis() as u64
        {
            return None;
        }
        let serving: BTreeSet<NodeId> = view
            .nodes
            .iter()
            .filter(|(_, c)| **c == NodeCondition::Serving)
            .map(|(n, _)| n.clone())
            .collect();
        let settled = view
            .nodes
            .values()
            .all(|c| matches!(c, NodeCondition::Serving | NodeCondition::Gone));
        if !settled || serving.is_empty() {
            return None;
        }
        let op = operation::new_operation(
            table,
            &serving,
            &self.options.placement,
            AUTO_CONCURRENT_MOVES,
            AUTO_REBALANCE,
            view.now_ms,
        )
        .ok()?;
        (!op.moves.is_empty()).then_some(op)
    }

    /// Writes `dead` over `name`'s record if it is still the version seen silent. Returns whether
    /// it did.
    async fn mark_dead(
        &mut self,
        name: &NodeId,
        version: Version,
        record: &NodeRecord,
        now: Duration,
    ) -> Result<bool, cairn_metadata::Error> {
        let mut dead = record.clone();
        dead.state = NodeState::Dead;
        let silent_for = self
            .silence
            .unchanged_for(&NodeRecord::key(name), now)
            .unwrap_or_default();
        match put_typed(
            self.metadata.as_ref(),
            &NodeRecord::key(name),
            &dead,
            Precondition::MatchesVersion(version),
        )
        .await
        {
            Ok(_) => {
                warn!(
                    node = %name,
                    "node {name} is dead: its record has not changed for {} ms",
                    silent_for.as_millis()
                );
                (self.on_event)(ControllerEvent::MarkedDead {
                    node: name.clone(),
                    silent_for,
                });
                Ok(true)
            }
            Err(cairn_metadata::Error::PreconditionFailed { .. }) => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// Gives the lease up, if this node holds it, so that another node takes it at once.
    async fn release(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        let mut released = held.lease.clone();
        released.released = true;
        released.renewed_at_ms = wall_clock_ms();
        let put = put_typed(
            self.metadata.as_ref(),
            ControllerLease::KEY,
            &released,
            Precondition::MatchesVersion(held.version),
        );
        match tokio::time::timeout(self.options.timing.node_timeout, put).await {
            Ok(Ok(_)) => info!("released the controller's lease"),
            Ok(Err(err)) => warn!("could not release the controller's lease: {err}"),
            Err(_) => warn!("could not release the controller's lease: no answer"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::membership::Member;
    use cairn_metadata::local::LocalMetadataStore;
    use cairn_types::PartitionId;
    use flaky::FlakyStore;
    use std::sync::Mutex;

    /// A metadata store that fails every call while told to.
    mod flaky {
        use cairn_metadata::{MetadataStore, Precondition, Result, Version, Versioned, Watch};
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};

        pub struct FlakyStore {
            pub inner: Arc<dyn MetadataStore>,
            pub failing: AtomicBool,
            /// Reads succeed, writes fail.
            pub writes_failing: AtomicBool,
        }

        impl FlakyStore {
            fn check(&self) -> Result<()> {
                if self.failing.load(Ordering::SeqCst) {
                    return Err(cairn_metadata::Error::Nats {
                        context: "test",
                        source: "the store is down".into(),
                    });
                }
                Ok(())
            }
        }

        #[async_trait::async_trait]
        impl MetadataStore for FlakyStore {
            async fn get(&self, key: &str) -> Result<Option<Versioned>> {
                self.check()?;
                self.inner.get(key).await
            }
            async fn put(
                &self,
                key: &str,
                value: serde_json::Value,
                precondition: Precondition,
            ) -> Result<Version> {
                self.check()?;
                if self.writes_failing.load(Ordering::SeqCst) {
                    return Err(cairn_metadata::Error::Nats {
                        context: "test",
                        source: "the stream has no leader".into(),
                    });
                }
                self.inner.put(key, value, precondition).await
            }
            async fn watch(&self, key: &str) -> Result<Watch> {
                self.inner.watch(key).await
            }
        }
    }

    const T: Duration = Duration::from_secs(3);

    struct Cluster {
        _dir: tempfile::TempDir,
        store: Arc<FlakyStore>,
        clock: Arc<ManualClock>,
        members: Vec<Arc<Member>>,
        events: Arc<Mutex<Vec<ControllerEvent>>>,
        /// Time since the members last heartbeated, kept from one [`Cluster::run`] to the next.
        since_beat: Mutex<Duration>,
    }

    fn record(name: &str) -> NodeRecord {
        NodeRecord {
            name: NodeId(name.into()),
            address: format!("{name}:1"),
            instance: format!("instance-of-{name}"),
            generation: 0,
            started_at_ms: 0,
            heartbeat_ms: 0,
            version: "test".into(),
            state: NodeState::Starting,
            heartbeats: 0,
        }
    }

    impl Cluster {
        async fn new(names: &[&str]) -> Cluster {
            let dir = tempfile::tempdir().unwrap();
            let local: Arc<dyn MetadataStore> =
                Arc::new(LocalMetadataStore::open(&dir.path().join("metadata.json")).unwrap());
            let store = Arc::new(FlakyStore {
                inner: local,
                failing: Default::default(),
                writes_failing: Default::default(),
            });
            let clock = Arc::new(ManualClock::new());
            let mut members = Vec::new();
            for name in names {
                let member =
                    Member::register(store.clone(), record(name), Timing::new(T), clock.clone())
                        .await
                        .unwrap();
                member.set_alive().await.unwrap();
                members.push(member);
            }
            Cluster {
                _dir: dir,
                store,
                clock,
                members,
                events: Arc::default(),
                since_beat: Mutex::new(Duration::ZERO),
            }
        }

        fn controller(&self, me: &str, partitions: u16) -> Controller {
            let events = self.events.clone();
            Controller::new(
                self.store.clone(),
                ControllerOptions {
                    me: NodeId(me.into()),
                    timing: Timing::new(T),
                    placement: PlacementOptions {
                        num_partitions: partitions,
                        initial_nodes: self.members.len(),
                        standbys: 1,
                    },
                    auto_rebalance: false,
                    move_limits: MoveLimits::default(),
                },
                self.clock.clone(),
                Box::new(move |event| events.lock().unwrap().push(event)),
            )
        }

        /// Moves time on by `by` in steps of one observation, the members in `beating`
        /// heartbeating every heartbeat interval (counted over every run) and the controllers
        /// ticking every step.
        async fn run(&self, by: Duration, beating: &[usize], controllers: &mut [&mut Controller]) {
            let step = Timing::new(T).observe_interval();
            let mut elapsed = Duration::ZERO;
            while elapsed < by {
                self.clock.advance(step);
                elapsed += step;
                let beat = {
                    let mut since_beat = self.since_beat.lock().unwrap();
                    *since_beat += step;
                    let due = *since_beat >= Timing::new(T).heartbeat_interval();
                    if due {
                        *since_beat = Duration::ZERO;
                    }
                    due
                };
                if beat {
                    for &i in beating {
                        let _ = self.members[i].heartbeat().await;
                    }
                }
                for controller in controllers.iter_mut() {
                    controller.tick().await;
                }
            }
        }

        async fn table(&self) -> PartitionTable {
            get_typed::<PartitionTable>(self.store.as_ref(), PartitionTable::KEY, "table")
                .await
                .unwrap()
                .unwrap()
                .1
        }

        async fn state(&self, name: &str) -> NodeState {
            get_typed::<NodeRecord>(
                self.store.as_ref(),
                &NodeRecord::key(&NodeId(name.into())),
                "record",
            )
            .await
            .unwrap()
            .unwrap()
            .1
            .state
        }
    }

    fn led_by(table: &PartitionTable, name: &str) -> Vec<PartitionId> {
        table
            .partitions
            .iter()
            .filter(|(_, p)| p.leader == Some(NodeId(name.into())))
            .map(|(id, _)| *id)
            .collect()
    }

    #[tokio::test]
    async fn a_silent_node_is_written_dead_and_its_partitions_move_to_its_followers() {
        let cluster = Cluster::new(&["n1", "n2", "n3"]).await;
        let mut controller = cluster.controller("n1", 6);
        // One heartbeat interval: every member has beaten once when it ends.
        let beat = Timing::new(T).heartbeat_interval();
        cluster.run(beat, &[0, 1, 2], &mut [&mut controller]).await;
        let placed = cluster.table().await;
        assert_eq!(placed.controller_term, 1);
        let of_n2 = led_by(&placed, "n2");
        assert_eq!(of_n2.len(), 2, "{placed:?}");
        let n2_grant = cluster.members[1].lease().grant();
        assert!(n2_grant.check().is_ok());
        let mut generation = cluster.members[1].generation();

        // n2 falls silent. Nothing moves before the timeout...
        cluster
            .run(T - T / 5, &[0, 2], &mut [&mut controller])
            .await;
        assert_eq!(cluster.state("n2").await, NodeState::Alive);
        assert_eq!(cluster.table().await.partitions, placed.partitions);
        // ...and n2 has stopped serving well before it (its lease is two thirds of it).
        assert!(n2_grant.check().is_err());
        // Then it is written dead and its partitions go to their followers.
        cluster.run(T / 3, &[0, 2], &mut [&mut controller]).await;
        assert_eq!(cluster.state("n2").await, NodeState::Dead);
        let moved = cluster.table().await;
        assert!(led_by(&moved, "n2").is_empty(), "{moved:?}");
        for p in &of_n2 {
            assert_eq!(
                moved.partitions[p].leader.as_ref(),
                placed.partitions[p].followers.first(),
                "partition {p} goes to its follower"
            );
            assert_eq!(moved.partitions[p].followers.len(), 1);
        }
        for placement in moved.partitions.values() {
            assert!(!placement.followers.contains(&NodeId("n2".into())));
        }
        let events = cluster.events.lock().unwrap().clone();
        assert!(events.iter().any(|e| matches!(e, ControllerEvent::MarkedDead { node, silent_for } if node.0 == "n2" && *silent_for >= T)));
        let failovers = events
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    ControllerEvent::Changed {
                        change: Change::Failover { .. },
                        detected_after: Some(_)
                    }
                )
            })
            .count();
        assert_eq!(failovers, of_n2.len());

        // n2 comes back: its next heartbeat finds it dead, and it joins as the next generation,
        // its old leaderships given up for good.
        cluster.members[1].heartbeat().await.unwrap();
        assert!(generation.has_changed().unwrap());
        assert_eq!(*generation.borrow_and_update(), 2);
        assert!(n2_grant.revoked());
        assert!(cluster.members[1].lease().grant().check().is_ok());
        assert_eq!(cluster.state("n2").await, NodeState::Alive);
        // Leadership does not move back.
        cluster.run(T, &[0, 1, 2], &mut [&mut controller]).await;
        assert!(led_by(&cluster.table().await, "n2").is_empty());
    }

    #[tokio::test]
    async fn nothing_is_judged_dead_on_evidence_gathered_while_the_store_failed() {
        let cluster = Cluster::new(&["n1", "n2", "n3"]).await;
        let mut controller = cluster.controller("n1", 3);
        cluster.run(T / 3, &[0, 1, 2], &mut [&mut controller]).await;
        let placed = cluster.table().await;
        // The store fails for 10 s: nobody's heartbeat lands, nobody serves as a leader.
        cluster
            .store
            .failing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        cluster
            .run(Duration::from_secs(10), &[0, 1, 2], &mut [&mut controller])
            .await;
        assert!(cluster.members[0].lease().grant().check().is_err());
        cluster
            .store
            .failing
            .store(false, std::sync::atomic::Ordering::SeqCst);
        // Back: n3 never heartbeats again, the others do. Nobody is dead right after...
        cluster.run(T / 2, &[0, 1], &mut [&mut controller]).await;
        assert_eq!(cluster.state("n3").await, NodeState::Alive);
        assert_eq!(cluster.state("n2").await, NodeState::Alive);
        assert_eq!(cluster.table().await.partitions, placed.partitions);
        // ...and n3 is, once silent for the timeout after the store came back.
        cluster.run(T, &[0, 1], &mut [&mut controller]).await;
        assert_eq!(cluster.state("n3").await, NodeState::Dead);
        assert_eq!(cluster.state("n2").await, NodeState::Alive);
        assert_eq!(cluster.state("n1").await, NodeState::Alive);
    }

    #[tokio::test]
    async fn nobody_is_judged_dead_while_the_store_takes_reads_but_no_writes() {
        let cluster = Cluster::new(&["n1", "n2", "n3"]).await;
        let mut controller = cluster
            .controller("n1", 3)
            .with_own_lease(cluster.members[0].lease().clone());
        cluster.run(T / 3, &[0, 1, 2], &mut [&mut controller]).await;
        let placed = cluster.table().await;
        // For 10 s every read succeeds and every write fails (a NATS stream electing its
        // leader): every record looks silent, the controller's own included.
        cluster
            .store
            .writes_failing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        cluster
            .run(Duration::from_secs(10), &[0, 1, 2], &mut [&mut controller])
            .await;
        cluster
            .store
            .writes_failing
            .store(false, std::sync::atomic::Ordering::SeqCst);
        // Back: the heartbeats land within an interval, and nobody was written dead.
        cluster.run(T / 2, &[0, 1], &mut [&mut controller]).await;
        for name in ["n1", "n2", "n3"] {
            assert_eq!(cluster.state(name).await, NodeState::Alive, "{name}");
        }
        assert_eq!(cluster.table().await.partitions, placed.partitions);
        // n3, which never heartbeats again, is dead once silent for the timeout after that.
        cluster.run(T * 2, &[0, 1], &mut [&mut controller]).await;
        assert_eq!(cluster.state("n3").await, NodeState::Dead);
        assert_eq!(cluster.state("n2").await, NodeState::Alive);
    }

    #[tokio::test]
    async fn a_stalled_controller_writes_nothing_once_another_took_the_lease() {
        let cluster = Cluster::new(&["n1", "n2"]).await;
        let mut first = cluster.controller("n1", 4);
        let mut second = cluster.controller("n2", 4);
        cluster
            .run(T / 3, &[0, 1], &mut [&mut first, &mut second])
            .await;
        assert_eq!(cluster.table().await.controller_term, 1);
        // n1's controller stalls; n2's takes the lease over after the timeout, and stamps the
        // table with its term.
        cluster.run(T + T / 5, &[0, 1], &mut [&mut second]).await;
        assert_eq!(cluster.table().await.controller_term, 2);
        assert!(second.held.is_some());
        // The stalled one, still believing it holds the lease, cannot write the table.
        assert!(first.held.is_some());
        let written = first
            .write_table(|mut table| {
                table.partitions.clear();
                Some(table)
            })
            .await
            .unwrap();
        assert!(!written);
        assert!(first.held.is_none(), "it learned it lost the lease");
        assert_eq!(cluster.table().await.partitions.len(), 4);
    }

    #[tokio::test]
    async fn a_node_that_leaves_hands_over_at_once() {
        let cluster = Cluster::new(&["n1", "n2", "n3"]).await;
        let mut first = cluster.controller("n1", 6);
        let mut second = cluster.controller("n2", 6);
        cluster
            .run(T / 3, &[0, 1, 2], &mut [&mut first, &mut second])
            .await;
        assert!(first.held.is_some());
        assert!(!led_by(&cluster.table().await, "n1").is_empty());
        // n1 stops cleanly: it releases the lease and says it left.
        cluster.members[0].leave().await;
        first.release().await;
        assert!(cluster.members[0].lease().grant().check().is_err());
        cluster
            .run(
                Timing::new(T).observe_interval() * 2,
                &[1, 2],
                &mut [&mut second],
            )
            .await;
        assert!(second.held.is_some(), "taken at once");
        assert!(led_by(&cluster.table().await, "n1").is_empty());
    }
}
