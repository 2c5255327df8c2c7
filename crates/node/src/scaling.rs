//! Scaling a cluster: the preview of where every partition would run on another set of nodes
//! (`cluster plan`), from the controller's pure planner ([`cairn_controller::rebalance`]) and,
//! for every partition a node would copy, what the copy is made of (the newest snapshot in the
//! repository and the log records past it).

use crate::node::NodeState;
use cairn_api::v1;
use cairn_controller::{PlacementOptions, RebalanceError};
use cairn_metadata::{PartitionTable, get_typed};
use cairn_types::{KeyRange, NodeId, PartitionId};
use std::collections::{BTreeMap, BTreeSet};
use tonic::Status;

/// The most nodes one plan may name.
const NODES_MAX: usize = 1024;

/// What moves if every partition is placed, balanced, on `names`; changes nothing.
pub async fn plan_placement(
    state: &NodeState,
    names: Vec<String>,
) -> Result<v1::PlanPlacementResponse, Status> {
    if !state.config.cluster_mode() {
        return Err(Status::failed_precondition(
            "this node runs alone ([log] provider = \"local\"): it has no other nodes to place partitions on; plans are for a cluster",
        ));
    }
    let on = parse_nodes(names)?;
    let (version, table) = placed_table(state).await?;
    let num_partitions = state.num_partitions();
    let options = placement_options(state);
    let plan = cairn_controller::rebalance(&table, &on, &options).map_err(rebalance_refused)?;

    let copied: BTreeSet<PartitionId> = plan
        .moves
        .iter()
        .filter(|m| m.copies)
        .map(|m| m.partition)
        .collect();
    let sizes = copy_sizes(state, &copied).await;
    let moves = plan
        .moves
        .iter()
        .map(|m| {
            let range = KeyRange::of_partition(m.partition, num_partitions);
            let mut planned = v1::PlannedMove {
                partition_id: u32::from(m.partition.0),
                key_range_start: range.start,
                key_range_end: range.end,
                role: match m.role {
                    cairn_controller::plan::Role::Leader => "leader",
                    _ => "follower",
                }
                .into(),
                from: m.from.as_ref().map(|n| n.0.clone()).unwrap_or_default(),
                to: m.to.as_ref().map(|n| n.0.clone()).unwrap_or_default(),
                copies: m.copies,
                ..Default::default()
            };
            if m.copies {
                match sizes.get(&m.partition) {
                    Some(Ok(size)) => {
                        planned.snapshot_id = size.snapshot_id.clone();
                        planned.snapshot_bytes = size.snapshot_bytes;
                        planned.log_records = size.log_records;
                    }
                    Some(Err(why)) => planned.size_unknown = why.clone(),
                    None => {}
                }
            }
            planned
        })
        .collect();

    let before = cairn_controller::plan::led_and_followed(&table);
    let after = cairn_controller::plan::led_and_followed(&plan.table);
    let states = node_states(state);
    let mut names: BTreeSet<NodeId> = on.clone();
    names.extend(before.keys().cloned());
    names.extend(after.keys().cloned());
    let nodes = names
        .into_iter()
        .map(|name| {
            let (leads_before, follows_before) = before.get(&name).copied().unwrap_or_default();
            let (leads_after, follows_after) = after.get(&name).copied().unwrap_or_default();
            v1::PlannedNode {
                state: match states.get(&name) {
                    Some(&"alive") => String::new(),
                    Some(state) => (*state).into(),
                    None => "not joined".into(),
                },
                name: name.0,
                leads_before: leads_before as u32,
                follows_before: follows_before as u32,
                leads_after: leads_after as u32,
                follows_after: follows_after as u32,
            }
        })
        .collect();
    Ok(v1::PlanPlacementResponse {
        num_partitions: u32::from(num_partitions),
        standbys: options.standbys.min(on.len() - 1) as u32,
        moves,
        nodes,
        unmoved: plan.unmoved as u32,
        partition_table_version: version,
    })
}

/// The partition table and its version, once the cluster has placed its partitions.
pub(crate) async fn placed_table(state: &NodeState) -> Result<(u64, PartitionTable), Status> {
    get_typed::<PartitionTable>(
        state.metadata.as_ref(),
        PartitionTable::KEY,
        "the partition table",
    )
    .await
    .map_err(metadata_unavailable)?
    .ok_or_else(|| {
        Status::failed_precondition(
            "the cluster has not placed its partitions yet (it waits for its initial nodes): there is nothing to move",
        )
    })
}

/// How this node's configuration places partitions.
pub(crate) fn placement_options(state: &NodeState) -> PlacementOptions {
    PlacementOptions {
        num_partitions: state.num_partitions(),
        initial_nodes: state.config.cluster.initial_nodes,
        standbys: state.config.cluster.standbys,
    }
}

/// Why the rebalancing planner gives no placement, as an answer to the caller.
pub(crate) fn rebalance_refused(err: RebalanceError) -> Status {
    match err {
        RebalanceError::NoNodes => Status::invalid_argument(
            "name the nodes to place the partitions on, e.g. --nodes n1,n2,n3,n4",
        ),
        RebalanceError::NoPartitions => Status::failed_precondition(err.to_string()),
    }
}

/// The node names of a request: each valid, none twice.
pub(crate) fn parse_nodes(names: Vec<String>) -> Result<BTreeSet<NodeId>, Status> {
    if names.is_empty() {
        return Err(Status::invalid_argument(
            "name the nodes to place the partitions on, e.g. --nodes n1,n2,n3,n4",
        ));
    }
    if names.len() > NODES_MAX {
        return Err(Status::invalid_argument(format!(
            "{} nodes named; a plan places partitions on at most {NODES_MAX}",
            names.len()
        )));
    }
    let mut on = BTreeSet::new();
    for name in names {
        if !crate::config::valid_name(&name) {
            return Err(Status::invalid_argument(format!(
                "{name:?} is not a node name: names are 1 to 64 letters, digits, '-', '_' or '.'"
            )));
        }
        if !on.insert(NodeId(name.clone())) {
            return Err(Status::invalid_argument(format!(
                "node {name} is named twice; name each node once"
            )));
        }
    }
    Ok(on)
}

/// What a node copying a partition loads: the newest snapshot and the log past it.
struct CopySize {
    snapshot_id: String,
    snapshot_bytes: u64,
    log_records: u64,
}

/// Per partition in `partitions`, what a copy of it is made of, or why that is not known.
async fn copy_sizes(
    state: &NodeState,
    partitions: &BTreeSet<PartitionId>,
) -> BTreeMap<PartitionId, Result<CopySize, String>> {
    if partitions.is_empty() {
        return BTreeMap::new();
    }
    // The newest snapshot of each partition, if the repository can be read.
    let newest: Result<BTreeMap<PartitionId, (String, u64, u64)>, String> = match &state.snapshots {
        None => Ok(BTreeMap::new()),
        Some(snapshots) => match snapshots.repository().list(None).await {
            Ok(listing) => {
                let mut newest: BTreeMap<PartitionId, (String, u64, u64)> = BTreeMap::new();
                for s in listing.snapshots {
                    let candidate = (s.snapshot_id.to_string(), s.size, s.min_applied_lsn.0);
                    let entry = newest.entry(s.partition_id).or_insert(candidate.clone());
                    if candidate.2 > entry.2 {
                        *entry = candidate;
                    }
                }
                Ok(newest)
            }
            Err(err) => Err(format!("the snapshot repository cannot be listed: {err}")),
        },
    };
    let tails = futures::future::join_all(partitions.iter().map(|&id| async move {
        let Some(slot) = state.partitions.slot(id) else {
            return (id, Err("no such partition".to_string()));
        };
        // From the log itself: what this node knows of a log it does not run may be nothing.
        let log = slot
            .log()
            .find_tail()
            .await
            .map_err(|err| format!("log {id}: {}", slot.log_problem(&err)));
        (id, log.map(|s| (s.trim_point.0, s.tail.0)))
    }))
    .await;
    tails
        .into_iter()
        .map(|(id, log)| {
            let size = match (&newest, log) {
                (Err(why), _) => Err(why.clone()),
                (_, Err(why)) => Err(why),
                (Ok(newest), Ok((trim_point, tail))) => Ok(match newest.get(&id) {
                    Some((snapshot_id, bytes, lsn)) => CopySize {
                        snapshot_id: snapshot_id.clone(),
                        snapshot_bytes: *bytes,
                        log_records: tail.saturating_sub(*lsn),
                    },
                    None => CopySize {
                        snapshot_id: String::new(),
                        snapshot_bytes: 0,
                        log_records: tail.saturating_sub(trim_point),
                    },
                }),
            };
            (id, size)
        })
        .collect()
}

/// Each member's state as `nodes list` shows it.
pub(crate) fn node_states(state: &NodeState) -> BTreeMap<NodeId, &'static str> {
    let Some(view) = &state.cluster_view else {
        return BTreeMap::new();
    };
    view.borrow()
        .nodes
        .iter()
        .filter_map(|node| {
            let record = node.record.as_ref()?;
            Some((
                node.name.clone(),
                crate::cluster::shown_state(node.condition, record.state),
            ))
        })
        .collect()
}

/// How often a load's progress is read from the node's report.
const LOAD_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// Makes `node` follow `partitions` (each checked to exist; written into the placement), then streams how far each has
/// come on `progress` until all have caught up or the receiver goes away.
pub async fn load_partitions(
    state: std::sync::Arc<NodeState>,
    partitions: BTreeSet<PartitionId>,
    node: String,
    progress: tokio::sync::mpsc::Sender<Result<v1::LoadPartitionsProgress, Status>>,
) -> Result<(), Status> {
    if !state.config.cluster_mode() {
        return Err(Status::failed_precondition(
            "this node runs alone ([log] provider = \"local\"): it has every partition already; loads are for a cluster",
        ));
    }
    let node = parse_nodes(vec![node])?
        .into_iter()
        .next()
        .unwrap_or_else(|| unreachable!("one name parsed"));
    if partitions.is_empty() {
        return Err(Status::invalid_argument(
            "name the partitions to load, e.g. -p 3,7",
        ));
    }
    match node_states(&state).get(&node).copied() {
        Some("alive" | "starting") => {}
        Some(other) => {
            return Err(Status::failed_precondition(format!(
                "node {node} is {other}; start it again before loading partitions on it"
            )));
        }
        None => {
            return Err(Status::failed_precondition(format!(
                "node {node} has not joined the cluster; start it with this cluster's [nats] settings first"
            )));
        }
    }
    follow_in_placement(&state, &partitions, &node).await?;
    // Caught up once applied up to where each log stood now.
    let mut targets = BTreeMap::new();
    for &id in &partitions {
        targets.insert(id, log_tail(&state, id).await?);
    }
    tracing::info!(%node, partitions = ?partitions, "partitions placed on a node to load them");
    tokio::spawn(async move {
        loop {
            // A node that died or left loads nothing more: the controller drops its roles.
            if let Some(gone) = node_states(&state)
                .get(&node)
                .filter(|s| matches!(**s, "dead" | "left"))
            {
                let _ = progress
                    .send(Err(Status::unavailable(format!(
                        "node {node} is {gone}: the load stopped, and the controller gives its roles to other nodes; start it again and load once more"
                    ))))
                    .await;
                return;
            }
            let observed = get_typed::<cairn_metadata::Observed>(
                state.metadata.as_ref(),
                &cairn_metadata::Observed::key(&node),
                "observed",
            )
            .await;
            let report = match observed {
                Ok(report) => report.map(|(_, report)| report).unwrap_or_default(),
                // The store not answering for a moment: said again at the next tick.
                Err(_) => cairn_metadata::Observed::default(),
            };
            let partitions: Vec<v1::LoadProgress> = targets
                .iter()
                .map(|(id, target)| {
                    let running = report.partitions.get(id);
                    let applied = running.map_or(0, |p| p.applied_lsn);
                    let role = running.map(|p| p.role);
                    v1::LoadProgress {
                        partition_id: u32::from(id.0),
                        state: role.map_or("waiting", |r| r.as_str()).into(),
                        applied_lsn: applied,
                        target_lsn: *target,
                        reason: running.and_then(|p| p.reason.clone()).unwrap_or_default(),
                        caught_up: matches!(
                            role,
                            Some(
                                cairn_metadata::ObservedRole::Follower
                                    | cairn_metadata::ObservedRole::Leader
                            )
                        ) && applied >= *target,
                    }
                })
                .collect();
            let done = partitions.iter().all(|p| p.caught_up);
            let message = v1::LoadPartitionsProgress { partitions, done };
            if progress.send(Ok(message)).await.is_err() || done {
                return;
            }
            tokio::time::sleep(LOAD_PROGRESS_EVERY).await;
        }
    });
    Ok(())
}

/// Adds `node` to the followers of `partitions` in the partition table, conditional on the
/// table's version (read and written again over a write that came between).
async fn follow_in_placement(
    state: &NodeState,
    partitions: &BTreeSet<PartitionId>,
    node: &NodeId,
) -> Result<(), Status> {
    use cairn_metadata::Change;
    let (refused, _) = cairn_metadata::update_typed::<PartitionTable, Option<Status>>(
        state.metadata.as_ref(),
        PartitionTable::KEY,
        "the partition table",
        |table| {
            let Some(mut table) = table else {
                return Change::Keep(Some(Status::failed_precondition(
                    "the cluster has not placed its partitions yet (it waits for its initial nodes)",
                )));
            };
            let mut changed = false;
            for id in partitions {
                let Some(placement) = table.partitions.get_mut(id) else {
                    return Change::Keep(Some(Status::failed_precondition(format!(
                        "partition {id} is not placed yet"
                    ))));
                };
                if placement.leader.as_ref() == Some(node) {
                    return Change::Keep(Some(Status::failed_precondition(format!(
                        "node {node} leads partition {id} already: it has its data"
                    ))));
                }
                if !placement.followers.contains(node) {
                    placement.followers.push(node.clone());
                    changed = true;
                }
            }
            match changed {
                true => Change::Write(table, None),
                false => Change::Keep(None),
            }
        },
    )
    .await
    .map_err(metadata_unavailable)?;
    refused.map_or(Ok(()), Err)
}

/// Where partition `id`'s log ends, as the log itself says.
async fn log_tail(state: &NodeState, id: PartitionId) -> Result<u64, Status> {
    let slot = state
        .partitions
        .slot(id)
        .ok_or_else(|| Status::not_found(format!("partition {id} does not exist")))?;
    slot.log()
        .find_tail()
        .await
        .map(|log| log.tail.0)
        .map_err(|err| Status::unavailable(format!("log {id}: {}", slot.log_problem(&err))))
}

/// Removes `name` from the cluster's members: only a node that the placement gives nothing
/// (drained by a scaling operation) and that is stopped (dead or left).
pub async fn remove_node(state: &NodeState, name: String) -> Result<(), Status> {
    use cairn_metadata::{Change, Members, NodeRecord};
    if !state.config.cluster_mode() {
        return Err(Status::failed_precondition(
            "this node runs alone ([log] provider = \"local\"): it has no other nodes to remove",
        ));
    }
    let node = parse_nodes(vec![name])?
        .into_iter()
        .next()
        .unwrap_or_else(|| unreachable!("one name parsed"));
    let metadata = state.metadata.as_ref();
    let members = get_typed::<Members>(metadata, Members::KEY, "member list")
        .await
        .map_err(metadata_unavailable)?
        .map(|(_, m)| m)
        .unwrap_or_default();
    if !members.nodes.contains(&node) {
        return Err(Status::not_found(format!(
            "node {node} is not a member of the cluster; `cairnctl nodes list` shows the members"
        )));
    }
    let (_, table) =
        get_typed::<PartitionTable>(metadata, PartitionTable::KEY, "the partition table")
            .await
            .map_err(metadata_unavailable)?
            .unwrap_or_default();
    let held: Vec<String> = table
        .partitions
        .iter()
        .filter(|(_, p)| p.leader.as_ref() == Some(&node) || p.followers.contains(&node))
        .map(|(id, _)| id.to_string())
        .collect();
    if !held.is_empty() {
        let others: Vec<String> = cairn_controller::plan::led_and_followed(&table)
            .into_keys()
            .filter(|n| *n != node)
            .map(|n| n.0)
            .collect();
        return Err(Status::failed_precondition(format!(
            "node {node} still has a role in partitions {}: drain it first with `cairnctl cluster scale --nodes {}`, and remove it once `cairnctl nodes list` shows it leading and following nothing",
            held.join(", "),
            others.join(",")
        )));
    }
    let record = get_typed::<NodeRecord>(metadata, &NodeRecord::key(&node), "node record")
        .await
        .map_err(metadata_unavailable)?;
    let stopped = record.as_ref().is_none_or(|(_, r)| {
        matches!(
            r.state,
            cairn_metadata::NodeState::Dead | cairn_metadata::NodeState::Left
        )
    });
    if !stopped {
        return Err(Status::failed_precondition(format!(
            "node {node} is not stopped: stop it first (a running node joins again with its next heartbeat), and remove it once `cairnctl nodes list` shows it dead or left"
        )));
    }
    cairn_metadata::update_typed::<Members, ()>(metadata, Members::KEY, "member list", |members| {
        let mut members = members.unwrap_or_default();
        match members.nodes.remove(&node) {
            true => Change::Write(members, ()),
            false => Change::Keep(()),
        }
    })
    .await
    .map_err(metadata_unavailable)?;
    // A node of that name that started meanwhile has joined again: it keeps its membership.
    let now = get_typed::<NodeRecord>(metadata, &NodeRecord::key(&node), "node record")
        .await
        .map_err(metadata_unavailable)?;
    if now.as_ref().map(|(version, _)| *version) != record.as_ref().map(|(version, _)| *version) {
        cairn_metadata::update_typed::<Members, ()>(
            metadata,
            Members::KEY,
            "member list",
            |members| {
                let mut members = members.unwrap_or_default();
                match members.nodes.insert(node.clone()) {
                    true => Change::Write(members, ()),
                    false => Change::Keep(()),
                }
            },
        )
        .await
        .map_err(metadata_unavailable)?;
        return Err(Status::aborted(format!(
            "node {node} started again while it was being removed; it stays a member"
        )));
    }
    tracing::info!(%node, "node removed from the cluster's members");
    Ok(())
}

/// A metadata store that did not answer: nothing was changed, and a retry may succeed.
pub(crate) fn metadata_unavailable(err: cairn_metadata::Error) -> Status {
    Status::unavailable(format!(
        "the metadata store does not answer: {err}; retry shortly"
    ))
}
