//! Scaling operations as an operator starts, lists and cancels them (`cairnctl cluster scale`,
//! `cluster operations`). The operation is a record in the metadata store ([`Operations`]);
//! the controller, wherever it runs, carries it out ([`cairn_controller::operation`]). This
//! node only checks the request and writes the record.

use crate::node::NodeState;
use crate::scaling::{
    metadata_unavailable, node_states, parse_nodes, placed_table, placement_options,
    rebalance_refused,
};
use cairn_api::v1;
use cairn_metadata::{Change, Operation, OperationState, Operations, get_typed, update_typed};
use tonic::Status;

/// Partitions an operation moves at once unless asked otherwise.
pub const DEFAULT_CONCURRENT_MOVES: usize = 2;
/// The most an operation may move at once.
const CONCURRENT_MOVES_MAX: usize = 64;

fn cluster_only(state: &NodeState) -> Result<(), Status> {
    if state.config.cluster_mode() {
        return Ok(());
    }
    Err(Status::failed_precondition(
        "this node runs alone ([log] provider = \"local\"): it has no other nodes to move partitions to; scaling is for a cluster",
    ))
}

/// Records an operation placing every partition, balanced, on `names`.
pub async fn start_scale(
    state: &NodeState,
    request: v1::StartScaleRequest,
) -> Result<v1::StartScaleResponse, Status> {
    cluster_only(state)?;
    let nodes = parse_nodes(request.nodes)?;
    let concurrent = match request.max_concurrent_moves as usize {
        0 => DEFAULT_CONCURRENT_MOVES,
        n if n > CONCURRENT_MOVES_MAX => {
            return Err(Status::invalid_argument(format!(
                "--max-concurrent-moves {n} is more than {CONCURRENT_MOVES_MAX}; give 1 to {CONCURRENT_MOVES_MAX}"
            )));
        }
        n => n,
    };
    let states = node_states(state);
    for node in &nodes {
        match states.get(node).copied() {
            Some("alive") => {}
            Some(other) => {
                return Err(Status::failed_precondition(format!(
                    "node {node} is {other}: only nodes that are alive take partitions; start it (or wait until `cairnctl nodes list` shows it alive), or leave it out of --nodes"
                )));
            }
            None => {
                return Err(Status::failed_precondition(format!(
                    "node {node} has not joined the cluster: start it with this cluster's [nats] settings first, then scale"
                )));
            }
        }
    }
    let recorded = get_typed::<Operations>(
        state.metadata.as_ref(),
        Operations::KEY,
        "the scaling operations",
    )
    .await
    .map_err(metadata_unavailable)?;
    if let Some(running) = recorded.as_ref().and_then(|(_, ops)| ops.running()) {
        return Err(one_at_a_time(running));
    }
    let (version, table) = placed_table(state).await?;
    if request.partition_table_version != 0 && request.partition_table_version != version {
        return Err(Status::aborted(format!(
            "the placement changed since the plan was made (partition table version {} then, {version} now): run the command again to see the plan as it is now",
            request.partition_table_version
        )));
    }
    let options = placement_options(state);
    let op = cairn_controller::new_operation(
        &table,
        &nodes,
        &options,
        concurrent,
        "cairnctl",
        crate::cluster::now_ms(),
    )
    .map_err(rebalance_refused)?;
    if op.moves.is_empty() {
        return Ok(v1::StartScaleResponse {
            operation: Some(info(&op)),
        });
    }
    let (started, _) = update_typed::<Operations, Result<Operation, Status>>(
        state.metadata.as_ref(),
        Operations::KEY,
        "the scaling operations",
        |ops| {
            let mut ops = ops.unwrap_or_default();
            if let Some(running) = ops.running() {
                return Change::Keep(Err(one_at_a_time(running)));
            }
            let mut op = op.clone();
            op.id = ops.add(op.clone());
            Change::Write(ops, Ok(op))
        },
    )
    .await
    .map_err(metadata_unavailable)?;
    let op = started?;
    tracing::info!(
        operation = op.id,
        "scaling operation {} recorded: {} partitions move to place them on {}",
        op.id,
        op.moves.len(),
        names(&op.nodes)
    );
    Ok(v1::StartScaleResponse {
        operation: Some(info(&op)),
    })
}

/// The operations recorded, oldest first.
pub async fn list_operations(state: &NodeState) -> Result<v1::ListOperationsResponse, Status> {
    cluster_only(state)?;
    let ops = get_typed::<Operations>(
        state.metadata.as_ref(),
        Operations::KEY,
        "the scaling operations",
    )
    .await
    .map_err(metadata_unavailable)?
    .map(|(_, ops)| ops)
    .unwrap_or_default();
    Ok(v1::ListOperationsResponse {
        operations: ops.operations.iter().map(info).collect(),
    })
}

/// Asks the running operation `id` to stop.
pub async fn cancel_operation(
    state: &NodeState,
    id: u64,
) -> Result<v1::CancelOperationResponse, Status> {
    cluster_only(state)?;
    let (answer, _) = update_typed::<Operations, Result<Operation, Status>>(
        state.metadata.as_ref(),
        Operations::KEY,
        "the scaling operations",
        |ops| {
            let mut ops = ops.unwrap_or_default();
            let Some(op) = ops.operations.iter_mut().find(|op| op.id == id) else {
                return Change::Keep(Err(Status::not_found(format!(
                    "no operation {id}; `cairnctl cluster operations list` shows them"
                ))));
            };
            match op.state {
                OperationState::Running => {
                    op.state = OperationState::Cancelling;
                    let op = op.clone();
                    Change::Write(ops, Ok(op))
                }
                OperationState::Cancelling => Change::Keep(Ok(op.clone())),
                finished => Change::Keep(Err(Status::failed_precondition(format!(
                    "operation {id} has finished ({}): there is nothing to cancel",
                    finished.as_str()
                )))),
            }
        },
    )
    .await
    .map_err(metadata_unavailable)?;
    let op = answer?;
    tracing::info!(operation = id, "scaling operation {id} asked to stop");
    Ok(v1::CancelOperationResponse {
        operation: Some(info(&op)),
    })
}

/// The refusal of a second operation while `running` runs.
fn one_at_a_time(running: &Operation) -> Status {
    Status::failed_precondition(format!(
        "operation {} ({}, placing the partitions on {}) is {}: one operation runs at a time; wait for it (`cairnctl cluster operations describe {}`) or cancel it (`cairnctl cluster operations cancel {}`)",
        running.id,
        running.requested_by,
        names(&running.nodes),
        running.state.as_str(),
        running.id,
        running.id
    ))
}

fn names(nodes: &std::collections::BTreeSet<cairn_types::NodeId>) -> String {
    nodes
        .iter()
        .map(|n| n.0.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

fn info(op: &Operation) -> v1::OperationInfo {
    let name = |n: &cairn_types::NodeId| n.0.clone();
    v1::OperationInfo {
        id: op.id,
        state: op.state.as_str().into(),
        requested_by: op.requested_by.clone(),
        nodes: op.nodes.iter().map(name).collect(),
        max_concurrent_moves: op.max_concurrent_moves as u32,
        created_at_ms: op.created_at_ms,
        finished_at_ms: op.finished_at_ms.unwrap_or_default(),
        moves: op
            .moves
            .iter()
            .map(|m| v1::MoveInfo {
                partition_id: u32::from(m.partition.0),
                from_leader: m.from_leader.as_ref().map(name).unwrap_or_default(),
                from_followers: m.from_followers.iter().map(name).collect(),
                to_leader: name(&m.to_leader),
                to_followers: m.to_followers.iter().map(name).collect(),
                step: m.step.as_str().into(),
                step_since_ms: m.step_since_ms,
                reason: m.reason.clone().unwrap_or_default(),
            })
            .collect(),
    }
}
