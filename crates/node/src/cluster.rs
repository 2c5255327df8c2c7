//! A node among others (`[log] provider = "nats"`): its registration and heartbeats, the
//! controller that places partitions, and the routes to other nodes.
//!
//! Everything here goes through the metadata store, whose compare-and-swap orders the writers:
//!
//! - `members` lists every node name that ever joined; `nodes/<name>` is that node's record,
//!   rewritten by its heartbeat every [`HEARTBEAT_INTERVAL`]. A node whose heartbeat is older
//!   than [`DEAD_AFTER`] is dead. Liveness compares wall clocks, so the nodes' clocks must agree
//!   to well within that.
//! - `controller` is a lease: the node holding it places partitions, and renews it every
//!   heartbeat; another node takes it over once it has expired.
//! - `partition-table` is the intent: leader, followers and epoch per partition. The controller
//!   writes leaders and followers; a leader raises the epoch when it takes a partition over.
//!   Nodes reconcile what they run against it (`Partitions::reconcile`) and report what they run
//!   in `observed/<name>`.

use anyhow::{Context, bail};
use cairn_metadata::{
    ControllerLease, Members, MetadataStore, NodeRecord, PartitionPlacement, PartitionTable,
    Precondition, Version, get_typed, put_typed,
};
use cairn_types::{Epoch, NodeId, PartitionId};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// How often a node renews its record and, if it holds it, the controller's lease.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// A node silent for this long is dead; the controller's lease lasts as long.
pub const DEAD_AFTER: Duration = Duration::from_secs(5);

/// Milliseconds since the Unix epoch, by this node's clock.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

/// Whether `record`'s node is alive at `now_ms`.
pub fn alive(record: &NodeRecord, now_ms: u64) -> bool {
    now_ms.saturating_sub(record.heartbeat_ms) < DEAD_AFTER.as_millis() as u64
}

/// Registers this node: refuses if a live node of another base dir holds its name, and returns
/// the record written (its generation one past the last) with its version.
pub async fn register(
    metadata: &dyn MetadataStore,
    mut record: NodeRecord,
) -> anyhow::Result<(Version, NodeRecord)> {
    let key = NodeRecord::key(&record.name);
    let version = loop {
        let now = now_ms();
        let existing = get_typed::<NodeRecord>(metadata, &key, "node record").await?;
        let precondition = match &existing {
            None => {
                record.generation = 1;
                Precondition::DoesNotExist
            }
            Some((version, other)) => {
                if other.instance != record.instance && alive(other, now) {
                    bail!(
                        "node name {} is held by a live node at {} (its last heartbeat was {} ms \
                         ago): give this node another node-name (CAIRN_NODE_NAME), or stop the \
                         other one and start this one once it has been silent for {} s",
                        record.name,
                        other.address,
                        now.saturating_sub(other.heartbeat_ms),
                        DEAD_AFTER.as_secs()
                    );
                }
                record.generation = other.generation + 1;
                Precondition::MatchesVersion(*version)
            }
        };
        record.started_at_ms = now;
        record.heartbeat_ms = now;
        match put_typed(metadata, &key, &record, precondition).await {
            Ok(version) => break version,
            Err(cairn_metadata::Error::PreconditionFailed { .. }) => continue,
            Err(err) => return Err(err).context("register this node"),
        }
    };
    loop {
        let (version, mut members) =
            match get_typed::<Members>(metadata, Members::KEY, "member list").await? {
                Some((version, members)) => (Precondition::MatchesVersion(version), members),
                None => (Precondition::DoesNotExist, Members::default()),
            };
        if !members.nodes.insert(record.name.clone()) {
            break;
        }
        match put_typed(metadata, Members::KEY, &members, version).await {
            Ok(_) => break,
            Err(cairn_metadata::Error::PreconditionFailed { .. }) => continue,
            Err(err) => return Err(err).context("add this node to the member list"),
        }
    }
    Ok((version, record))
}

/// Every node that ever joined, with its record (`None` if it cannot be read).
pub async fn nodes(metadata: &dyn MetadataStore) -> anyhow::Result<Vec<NodeRecord>> {
    let members = get_typed::<Members>(metadata, Members::KEY, "member list")
        .await?
        .map(|(_, members)| members)
        .unwrap_or_default();
    let mut records = Vec::with_capacity(members.nodes.len());
    for name in &members.nodes {
        if let Some((_, record)) =
            get_typed::<NodeRecord>(metadata, &NodeRecord::key(name), "node record").await?
        {
            records.push(record);
        }
    }
    Ok(records)
}

/// This node's heartbeat and, when it holds the lease, the controller: every
/// [`HEARTBEAT_INTERVAL`] until `cancel` fires. At the end the record says the node stopped.
pub async fn run(
    metadata: Arc<dyn MetadataStore>,
    mut record: NodeRecord,
    mut version: Version,
    placement: PlacementOptions,
    cancel: CancellationToken,
) {
    let key = NodeRecord::key(&record.name);
    let mut waiting_logged = None;
    loop {
        tokio::select! {
            () = tokio::time::sleep(HEARTBEAT_INTERVAL) => {}
            () = cancel.cancelled() => break,
        }
        record.heartbeat_ms = now_ms();
        match put_typed(
            metadata.as_ref(),
            &key,
            &record,
            Precondition::MatchesVersion(version),
        )
        .await
        {
            Ok(new) => version = new,
            Err(cairn_metadata::Error::PreconditionFailed { .. }) => {
                match get_typed::<NodeRecord>(metadata.as_ref(), &key, "node record").await {
                    Ok(Some((current, other))) if other.instance == record.instance => {
                        version = current;
                    }
                    Ok(other) => {
                        // Two nodes of one name would both lead what the table gives that name.
                        error!(
                            node = %record.name,
                            "another node took this node's name ({:?}) while this one was silent; this node stops: start it again once the other is gone, or give it another node-name",
                            other.map(|(_, o)| o.address)
                        );
                        cancel.cancel();
                        return;
                    }
                    Err(err) => warn!("heartbeat: {err}"),
                }
                continue;
            }
            Err(err) => {
                warn!("heartbeat: {err}");
                continue;
            }
        }
        if let Err(err) = control(
            metadata.as_ref(),
            &record.name,
            &placement,
            &mut waiting_logged,
        )
        .await
        {
            warn!("controller: {err:#}");
        }
    }
    // Stopped cleanly: dead at once, not after DEAD_AFTER.
    record.heartbeat_ms = 0;
    let _ = put_typed(
        metadata.as_ref(),
        &key,
        &record,
        Precondition::MatchesVersion(version),
    )
    .await;
}

/// What the controller needs to place partitions.
#[derive(Debug, Clone)]
pub struct PlacementOptions {
    pub num_partitions: u16,
    pub initial_nodes: usize,
    pub standbys: usize,
}

/// One round of the controller: take or renew the lease; while holding it, place the partitions
/// that have no leader yet once enough nodes are alive.
async fn control(
    metadata: &dyn MetadataStore,
    me: &NodeId,
    options: &PlacementOptions,
    waiting_logged: &mut Option<usize>,
) -> anyhow::Result<()> {
    let now = now_ms();
    let lease =
        get_typed::<ControllerLease>(metadata, ControllerLease::KEY, "controller lease").await?;
    let precondition = match &lease {
        None => Precondition::DoesNotExist,
        Some((version, lease)) if lease.holder == *me || lease.expires_ms <= now => {
            Precondition::MatchesVersion(*version)
        }
        Some(_) => return Ok(()),
    };
    let renewed = ControllerLease {
        holder: me.clone(),
        expires_ms: now + DEAD_AFTER.as_millis() as u64,
    };
    match put_typed(metadata, ControllerLease::KEY, &renewed, precondition).await {
        Ok(_) => {}
        Err(cairn_metadata::Error::PreconditionFailed { .. }) => return Ok(()),
        Err(err) => return Err(err.into()),
    }
    if lease.is_none_or(|(_, l)| l.holder != *me) {
        info!(node = %me, "this node now runs the controller");
    }

    let (version, table) = match get_typed::<PartitionTable>(
        metadata,
        PartitionTable::KEY,
        "partition table",
    )
    .await?
    {
        Some((version, table)) => (Precondition::MatchesVersion(version), table),
        None => (Precondition::DoesNotExist, PartitionTable::default()),
    };
    let unplaced = (0..options.num_partitions)
        .map(PartitionId)
        .filter(|p| table.partitions.get(p).is_none_or(|pl| pl.leader.is_none()))
        .count();
    if unplaced == 0 {
        return Ok(());
    }
    let now = now_ms();
    let alive: Vec<NodeId> = nodes(metadata)
        .await?
        .into_iter()
        .filter(|n| alive(n, now))
        .map(|n| n.name)
        .collect();
    if alive.len() < options.initial_nodes {
        if *waiting_logged != Some(alive.len()) {
            info!(
                "waiting for {} of cluster.initial-nodes = {} nodes before placing partitions; alive: {:?}",
                options.initial_nodes - alive.len(),
                options.initial_nodes,
                alive
            );
            *waiting_logged = Some(alive.len());
        }
        return Ok(());
    }
    let table = place(table, &alive, options);
    match put_typed(metadata, PartitionTable::KEY, &table, version).await {
        Ok(_) => {
            info!(nodes = ?alive, "placed {unplaced} partitions");
            Ok(())
        }
        // A leader raised an epoch meanwhile: the next round tries again.
        Err(cairn_metadata::Error::PreconditionFailed { .. }) => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// Gives every partition without a leader one, and `standbys` followers on other nodes: the
/// leaders of partition `p` and its followers are the nodes `p, p+1, …` (mod N) in name order,
/// so each node leads ⌊P/N⌋ or ⌈P/N⌉ partitions. Epochs and placed partitions are kept.
pub fn place(
    mut table: PartitionTable,
    nodes: &[NodeId],
    options: &PlacementOptions,
) -> PartitionTable {
    let mut nodes = nodes.to_vec();
    nodes.sort();
    nodes.dedup();
    if nodes.is_empty() {
        return table;
    }
    let standbys = options.standbys.min(nodes.len() - 1);
    for p in 0..options.num_partitions {
        let placement = table
            .partitions
            .entry(PartitionId(p))
            .or_insert(PartitionPlacement {
                leader: None,
                epoch: Epoch::default(),
                followers: Vec::new(),
            });
        if placement.leader.is_some() {
            continue;
        }
        let first = usize::from(p) % nodes.len();
        placement.leader = Some(nodes[first].clone());
        placement.followers = (1..=standbys)
            .map(|k| nodes[(first + k) % nodes.len()].clone())
            .collect();
    }
    table
}

/// What this node should run of each partition, by the intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Leader,
    Follower,
    /// Another node's, or not placed yet.
    None,
}

pub fn role(table: &PartitionTable, partition: PartitionId, me: &NodeId) -> Role {
    match table.partitions.get(&partition) {
        Some(p) if p.leader.as_ref() == Some(me) => Role::Leader,
        Some(p) if p.followers.contains(me) => Role::Follower,
        _ => Role::None,
    }
}

/// Leaders per node, for `nodes list`.
pub fn led_and_followed(table: &PartitionTable) -> BTreeMap<NodeId, (usize, usize)> {
    let mut counts: BTreeMap<NodeId, (usize, usize)> = BTreeMap::new();
    for placement in table.partitions.values() {
        if let Some(leader) = &placement.leader {
            counts.entry(leader.clone()).or_default().0 += 1;
        }
        for follower in &placement.followers {
            counts.entry(follower.clone()).or_default().1 += 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeId {
        NodeId(name.into())
    }

    #[test]
    fn placement_is_balanced_and_followers_are_elsewhere() {
        let options = PlacementOptions {
            num_partitions: 16,
            initial_nodes: 3,
            standbys: 1,
        };
        let nodes = [node("c"), node("a"), node("b")];
        let table = place(PartitionTable::default(), &nodes, &options);
        let counts = led_and_followed(&table);
        let leads: Vec<usize> = counts.values().map(|(l, _)| *l).collect();
        assert_eq!(leads.iter().sum::<usize>(), 16);
        assert!(leads.iter().all(|&l| l == 5 || l == 6), "{counts:?}");
        for placement in table.partitions.values() {
            assert_eq!(placement.followers.len(), 1);
            assert_ne!(Some(&placement.followers[0]), placement.leader.as_ref());
        }
        // Placed partitions keep their leader, followers and epoch.
        let mut moved = table.clone();
        moved.partitions.get_mut(&PartitionId(3)).unwrap().epoch = Epoch(7);
        moved.partitions.get_mut(&PartitionId(4)).unwrap().leader = None;
        let again = place(moved.clone(), &[node("z")], &options);
        assert_eq!(
            again.partitions[&PartitionId(3)],
            moved.partitions[&PartitionId(3)]
        );
        assert_eq!(again.partitions[&PartitionId(4)].leader, Some(node("z")));
        assert!(again.partitions[&PartitionId(4)].followers.is_empty());
    }

    #[test]
    fn one_node_leads_everything_with_no_followers() {
        let options = PlacementOptions {
            num_partitions: 4,
            initial_nodes: 1,
            standbys: 2,
        };
        let table = place(PartitionTable::default(), &[node("a")], &options);
        assert_eq!(led_and_followed(&table)[&node("a")], (4, 0));
    }
}
