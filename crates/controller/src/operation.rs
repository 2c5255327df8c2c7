//! Scaling operations, as pure functions: [`new_operation`] turns a [`crate::rebalance`] into one
//! move per partition whose leader or followers change, and [`advance`] takes every move one
//! step further from the cluster as observed, changing the partition table as it goes. The
//! controller calls `advance` every round while it holds the lease and writes both the table and
//! the operation (in the metadata store) after every step, so that a controller that takes over
//! resumes where the last one stopped. No IO, no clock: the tests drive it with made-up states.
//!
//! # A partition's move
//! 1. **Loading.** Every node that is to hold the partition and does not yet is added as a
//!    follower beside the current leader and followers: it loads the newest snapshot and replays
//!    the log past it, as any follower does. The step ends once each such node reports itself a
//!    follower within [`CATCH_UP_SLACK`] records of what the leader last reported applied.
//! 2. **Handing off** (only when the leader changes). The table asks the leader to hand over
//!    ([`PartitionPlacement::handoff`]). The leader stops serving the partition, then names the
//!    planned leader in its place in one conditional write of the table; that node raises the
//!    epoch, replays the little it lacks and serves. The old leader never serves beside its
//!    successor: it has stopped before it names it, and nobody else may take the leadership
//!    while a handoff is asked. Writes pause only for this step, never for the loading.
//! 3. **Dropping.** Once the planned leader reports that it serves, the followers become the
//!    planned ones: the nodes that no longer hold the partition stop running it.
//!
//! A move that cannot go on is reverted, with the reason: a node that was to load the partition
//! is gone or cannot run it, the loading or the handoff took longer than [`MoveLimits`] allow, or
//! the operation was cancelled before the cutover. Reverting removes the followers the move
//! added and withdraws the handoff, so that the partition is placed as it was. A move whose
//! cutover happened finishes even when the operation is cancelled. A failover during a move
//! (its leader died) changes only where the move starts from: it carries on towards the same
//! placement.

use crate::balance::{RebalanceError, rebalance};
use crate::plan::{NodeCondition, PlacementOptions};
use cairn_metadata::{
    MoveStep, Observed, ObservedRole, Operation, OperationState, PartitionMove, PartitionPlacement,
    PartitionTable,
};
use cairn_types::NodeId;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// How many records behind the leader's last report a new follower may be and count as caught
/// up: the rest it replays when it takes over, and the leader's report is up to a heartbeat
/// interval old anyway.
pub const CATCH_UP_SLACK: u64 = 1_000;

/// How long each step of a move may take before the move is reverted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveLimits {
    /// Loading the snapshot and replaying the log.
    pub loading: Duration,
    /// From asking the leader to hand over to the table naming the new leader.
    pub handoff: Duration,
    /// From the cutover to the new leader reporting that it serves; past it the old holders are
    /// dropped anyway.
    pub settling: Duration,
}

impl Default for MoveLimits {
    fn default() -> Self {
        MoveLimits {
            loading: Duration::from_secs(30 * 60),
            handoff: Duration::from_secs(30),
            settling: Duration::from_secs(60),
        }
    }
}

/// The cluster as observed, for [`advance`].
#[derive(Debug, Clone, Default)]
pub struct OperationView {
    pub nodes: BTreeMap<NodeId, NodeCondition>,
    /// What each node last reported running, of its current generation only.
    pub reports: BTreeMap<NodeId, Observed>,
    /// Milliseconds since the Unix epoch, by the controller's clock.
    pub now_ms: u64,
}

impl OperationView {
    fn condition(&self, node: &NodeId) -> NodeCondition {
        self.nodes.get(node).copied().unwrap_or(NodeCondition::Gone)
    }

    fn report(
        &self,
        node: &NodeId,
        partition: cairn_types::PartitionId,
    ) -> Option<(ObservedRole, u64, Option<&str>)> {
        let running = self.reports.get(node)?.partitions.get(&partition)?;
        Some((running.role, running.applied_lsn, running.reason.as_deref()))
    }
}

/// An operation placing every partition, balanced, on `nodes`: one move per partition whose
/// leader or set of followers changes (a reordering of the same followers is no move).
pub fn new_operation(
    table: &PartitionTable,
    nodes: &BTreeSet<NodeId>,
    options: &PlacementOptions,
    max_concurrent_moves: usize,
    requested_by: &str,
    now_ms: u64,
) -> Result<Operation, RebalanceError> {
    let planned = rebalance(table, nodes, options)?;
    let mut moves = Vec::new();
    for (partition, to) in &planned.table.partitions {
        let from = table.partitions.get(partition);
        let from_leader = from.and_then(|p| p.leader.clone());
        let from_followers = from.map(|p| p.followers.clone()).unwrap_or_default();
        let same_followers = from_followers.iter().collect::<BTreeSet<_>>()
            == to.followers.iter().collect::<BTreeSet<_>>();
        let Some(to_leader) = to.leader.clone() else {
            continue;
        };
        if from_leader.as_ref() == Some(&to_leader) && same_followers {
            continue;
        }
        moves.push(PartitionMove {
            partition: *partition,
            from_leader,
            from_followers,
            to_leader,
            to_followers: to.followers.clone(),
            step: MoveStep::Waiting,
            step_since_ms: now_ms,
            reason: None,
        });
    }
    Ok(Operation {
        id: 0,
        requested_by: requested_by.to_owned(),
        nodes: nodes.clone(),
        max_concurrent_moves: max_concurrent_moves.max(1),
        state: if moves.is_empty() {
            OperationState::Succeeded
        } else {
            OperationState::Running
        },
        created_at_ms: now_ms,
        finished_at_ms: moves.is_empty().then_some(now_ms),
        moves,
    })
}

/// Takes every move of `op` as far as the cluster allows now, changing `table` (the placement
/// to write) as it goes. A call on a table and reports that changed nothing changes nothing, so
/// a controller that lost a write calls it again on what it reads next.
pub fn advance(
    op: &mut Operation,
    table: &mut PartitionTable,
    view: &OperationView,
    limits: &MoveLimits,
) {
    if op.state.finished() {
        return;
    }
    let cancelling = op.state == OperationState::Cancelling;
    let mut active = op.moves.iter().filter(|m| m.step.under_way()).count();
    for m in &mut op.moves {
        if m.step.finished() {
            continue;
        }
        let Some(placement) = table.partitions.get_mut(&m.partition) else {
            finish(
                m,
                MoveStep::Reverted,
                "the partition table no longer places it",
                view,
            );
            continue;
        };
        if m.step == MoveStep::Waiting {
            if cancelling {
                finish(m, MoveStep::Cancelled, "cancelled before it started", view);
                continue;
            }
            if active >= op.max_concurrent_moves {
                continue;
            }
            active += 1;
            enter(m, MoveStep::Loading, view);
        }
        step(m, placement, view, limits, cancelling);
        if m.step.finished() {
            active -= 1;
        }
    }
    if op.moves.iter().all(|m| m.step.finished()) {
        op.state = if cancelling {
            OperationState::Cancelled
        } else if op.moves.iter().any(|m| m.step != MoveStep::Done) {
            OperationState::Failed
        } else {
            OperationState::Succeeded
        };
        op.finished_at_ms = Some(view.now_ms);
    }
}

/// One step of a started move.
fn step(
    m: &mut PartitionMove,
    p: &mut PartitionPlacement,
    view: &OperationView,
    limits: &MoveLimits,
    cancelling: bool,
) {
    let elapsed = Duration::from_millis(view.now_ms.saturating_sub(m.step_since_ms));
    match m.step {
        MoveStep::Loading => {
            if cancelling {
                undo(m, p);
                finish(m, MoveStep::Cancelled, "cancelled before its cutover", view);
                return;
            }
            for target in targets(m) {
                if p.leader.as_ref() != Some(&target) && !p.followers.contains(&target) {
                    p.followers.push(target);
                }
            }
            let leader_applied = p
                .leader
                .as_ref()
                .and_then(|l| view.report(l, m.partition))
                .filter(|(role, _, _)| *role == ObservedRole::Leader)
                .map_or(0, |(_, applied, _)| applied);
            let mut caught_up = true;
            for target in targets(m) {
                if p.leader.as_ref() == Some(&target) {
                    continue;
                }
                if view.condition(&target) == NodeCondition::Gone {
                    let why = format!("node {target} is gone");
                    undo(m, p);
                    finish(m, MoveStep::Reverted, &why, view);
                    return;
                }
                match view.report(&target, m.partition) {
                    Some((ObservedRole::Down, _, reason)) => {
                        let why = format!(
                            "node {target} cannot run it: {}",
                            reason.unwrap_or("it says it is down")
                        );
                        undo(m, p);
                        finish(m, MoveStep::Reverted, &why, view);
                        return;
                    }
                    Some((ObservedRole::Follower, applied, _))
                        if applied + CATCH_UP_SLACK >= leader_applied => {}
                    _ => caught_up = false,
                }
            }
            let leader_serves = p
                .leader
                .as_ref()
                .is_some_and(|l| view.condition(l) == NodeCondition::Serving);
            if caught_up && p.leader.as_ref() == Some(&m.to_leader) {
                enter(m, MoveStep::Dropping, view);
                step(m, p, view, limits, cancelling);
            } else if caught_up && leader_serves {
                p.handoff = Some(m.to_leader.clone());
                enter(m, MoveStep::HandingOff, view);
            } else if elapsed > limits.loading {
                let why = format!(
                    "its new holders did not catch up with the log within {}",
                    shown(limits.loading)
                );
                undo(m, p);
                finish(m, MoveStep::Reverted, &why, view);
            }
        }
        MoveStep::HandingOff => {
            if p.leader.as_ref() == Some(&m.to_leader) {
                enter(m, MoveStep::Dropping, view);
                step(m, p, view, limits, cancelling);
            } else if cancelling {
                undo(m, p);
                finish(m, MoveStep::Cancelled, "cancelled before its cutover", view);
            } else if view.condition(&m.to_leader) != NodeCondition::Serving {
                let why = format!("node {} stopped serving before the cutover", m.to_leader);
                undo(m, p);
                finish(m, MoveStep::Reverted, &why, view);
            } else if p.handoff.as_ref() != Some(&m.to_leader) {
                // Withdrawn by a failover of the leader: load again from wherever it is now.
                enter(m, MoveStep::Loading, view);
            } else if elapsed > limits.handoff {
                let why = format!(
                    "its leader {} did not hand over within {}",
                    p.leader
                        .as_ref()
                        .map_or("(none)".to_string(), |l| l.to_string()),
                    shown(limits.handoff)
                );
                undo(m, p);
                finish(m, MoveStep::Reverted, &why, view);
            }
        }
        MoveStep::Dropping => {
            if p.leader.as_ref() != Some(&m.to_leader) {
                // A failover took the leadership away after the cutover: move it again.
                enter(m, MoveStep::Loading, view);
                return;
            }
            let serves = matches!(
                view.report(&m.to_leader, m.partition),
                Some((ObservedRole::Leader, _, _))
            );
            if serves || elapsed > limits.settling {
                p.handoff = None;
                p.followers = m
                    .to_followers
                    .iter()
                    .filter(|f| **f != m.to_leader)
                    .cloned()
                    .collect();
                let note = (!serves).then(|| {
                    format!(
                        "node {} had not reported serving it {} after the cutover",
                        m.to_leader,
                        shown(limits.settling)
                    )
                });
                m.step = MoveStep::Done;
                m.step_since_ms = view.now_ms;
                m.reason = note;
            }
        }
        MoveStep::Waiting | MoveStep::Done | MoveStep::Reverted | MoveStep::Cancelled => {}
    }
}

/// The nodes that hold the partition when the move is done.
fn targets(m: &PartitionMove) -> Vec<NodeId> {
    std::iter::once(m.to_leader.clone())
        .chain(m.to_followers.iter().cloned())
        .collect()
}

/// Puts the placement back as it was before the move: the followers it added go (unless one
/// leads now), and a handoff it asked is withdrawn.
fn undo(m: &PartitionMove, p: &mut PartitionPlacement) {
    let held: BTreeSet<&NodeId> = m
        .from_leader
        .iter()
        .chain(m.from_followers.iter())
        .collect();
    let added = targets(m);
    p.followers
        .retain(|f| held.contains(f) || !added.contains(f));
    if p.handoff.as_ref() == Some(&m.to_leader) {
        p.handoff = None;
    }
}

fn enter(m: &mut PartitionMove, step: MoveStep, view: &OperationView) {
    m.step = step;
    m.step_since_ms = view.now_ms;
}

fn finish(m: &mut PartitionMove, step: MoveStep, reason: &str, view: &OperationView) {
    m.step = step;
    m.step_since_ms = view.now_ms;
    m.reason = Some(reason.to_owned());
}

fn shown(d: Duration) -> String {
    match d.as_secs() {
        s if s >= 60 && s % 60 == 0 => format!("{} min", s / 60),
        s if s >= 1 => format!("{s} s"),
        _ => format!("{} ms", d.as_millis()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_metadata::ObservedPartition;
    use cairn_types::{Epoch, PartitionId};

    fn node(name: &str) -> NodeId {
        NodeId(name.into())
    }

    fn options(num_partitions: u16) -> PlacementOptions {
        PlacementOptions {
            num_partitions,
            initial_nodes: 3,
            standbys: 1,
        }
    }

    /// `partitions` placed round-robin on `n1..=n{nodes}`, each with one follower.
    fn table(partitions: u16, nodes: usize) -> PartitionTable {
        let mut table = PartitionTable::default();
        for p in 0..partitions {
            let at = |k: usize| node(&format!("n{}", (usize::from(p) + k) % nodes + 1));
            table.partitions.insert(
                PartitionId(p),
                PartitionPlacement {
                    leader: Some(at(0)),
                    epoch: Epoch(1),
                    followers: vec![at(1)],
                    handoff: None,
                },
            );
        }
        table
    }

    fn serving(names: &[&str]) -> BTreeMap<NodeId, NodeCondition> {
        names
            .iter()
            .map(|n| (node(n), NodeCondition::Serving))
            .collect()
    }

    /// What well-behaved nodes do with `table`: every node that is not gone runs what it is
    /// placed to run, caught up; a leader asked to hand over does, in one write.
    fn nodes_act(table: &mut PartitionTable, view: &mut OperationView) {
        for placement in table.partitions.values_mut() {
            if let (Some(from), Some(to)) = (placement.leader.clone(), placement.handoff.clone())
                && view.condition(&from) == NodeCondition::Serving
            {
                placement.followers.retain(|f| *f != to);
                placement.followers.push(from);
                placement.leader = Some(to);
                placement.handoff = None;
                placement.epoch = Epoch(placement.epoch.0 + 1);
            }
        }
        view.reports.clear();
        for (partition, placement) in &table.partitions {
            let runs = placement
                .leader
                .iter()
                .map(|l| (l, ObservedRole::Leader))
                .chain(
                    placement
                        .followers
                        .iter()
                        .map(|f| (f, ObservedRole::Follower)),
                );
            for (name, role) in runs {
                if view.condition(name) == NodeCondition::Gone {
                    continue;
                }
                view.reports
                    .entry(name.clone())
                    .or_default()
                    .partitions
                    .insert(
                        *partition,
                        ObservedPartition {
                            role,
                            epoch: placement.epoch,
                            applied_lsn: 100,
                            reason: None,
                        },
                    );
            }
        }
    }

    fn holders(p: &PartitionPlacement) -> (Option<NodeId>, BTreeSet<NodeId>) {
        (p.leader.clone(), p.followers.iter().cloned().collect())
    }

    /// Advances `op` with nodes acting after every round, checking on the way that a handoff is
    /// only ever asked of a leader by one of its followers and that no more than the allowed
    /// moves run at once; returns the rounds it took.
    fn run(op: &mut Operation, table: &mut PartitionTable, view: &mut OperationView) -> usize {
        let limits = MoveLimits::default();
        for round in 1..=200 {
            advance(op, table, view, &limits);
            let active = op.moves.iter().filter(|m| m.step.under_way()).count();
            assert!(active <= op.max_concurrent_moves, "{active} moves at once");
            for p in table.partitions.values() {
                if let Some(to) = &p.handoff {
                    assert!(
                        p.followers.contains(to),
                        "a handoff to a non-follower: {p:?}"
                    );
                    assert_ne!(p.leader.as_ref(), Some(to));
                }
                assert!(!p.followers.iter().any(|f| Some(f) == p.leader.as_ref()));
            }
            if op.state.finished() {
                return round;
            }
            nodes_act(table, view);
            view.now_ms += 100;
        }
        panic!("the operation did not finish: {op:#?}");
    }

    #[test]
    fn scaling_out_and_in_reaches_the_planned_placement_and_moves_nothing_else() {
        let before = table(12, 3);
        let mut current = before.clone();
        let four: BTreeSet<NodeId> = ["n1", "n2", "n3", "n4"].iter().map(|n| node(n)).collect();
        let planned = rebalance(&current, &four, &options(12)).unwrap();
        let mut op = new_operation(&current, &four, &options(12), 2, "test", 0).unwrap();
        let changed = before
            .partitions
            .iter()
            .filter(|(p, placement)| holders(placement) != holders(&planned.table.partitions[*p]))
            .count();
        assert_eq!(op.moves.len(), changed);
        assert!(!op.moves.is_empty());
        let mut view = OperationView {
            nodes: serving(&["n1", "n2", "n3", "n4"]),
            ..OperationView::default()
        };
        nodes_act(&mut current, &mut view);
        run(&mut op, &mut current, &mut view);
        assert_eq!(op.state, OperationState::Succeeded, "{op:#?}");
        for (p, placement) in &planned.table.partitions {
            assert_eq!(
                holders(&current.partitions[p]),
                holders(placement),
                "partition {p}"
            );
        }
        let counts = crate::plan::led_and_followed(&current);
        assert!(
            counts
                .values()
                .all(|(leads, follows)| *leads == 3 && *follows == 3)
        );

        // And back to three.
        let three: BTreeSet<NodeId> = ["n1", "n2", "n3"].iter().map(|n| node(n)).collect();
        let mut op = new_operation(&current, &three, &options(12), 3, "test", view.now_ms).unwrap();
        run(&mut op, &mut current, &mut view);
        assert_eq!(op.state, OperationState::Succeeded, "{op:#?}");
        assert!(!crate::plan::led_and_followed(&current).contains_key(&node("n4")));
    }

    #[test]
    fn a_target_that_dies_while_loading_has_its_moves_reverted() {
        let before = table(6, 3);
        let mut current = before.clone();
        let four: BTreeSet<NodeId> = ["n1", "n2", "n3", "n4"].iter().map(|n| node(n)).collect();
        let mut op = new_operation(&current, &four, &options(6), 6, "test", 0).unwrap();
        let mut view = OperationView {
            nodes: serving(&["n1", "n2", "n3", "n4"]),
            ..OperationView::default()
        };
        nodes_act(&mut current, &mut view);
        advance(&mut op, &mut current, &view, &MoveLimits::default());
        // n4 is placed as a follower of what it is to hold, then dies before it reports.
        assert!(
            current
                .partitions
                .values()
                .any(|p| p.followers.contains(&node("n4")))
        );
        view.nodes.insert(node("n4"), NodeCondition::Gone);
        nodes_act(&mut current, &mut view);
        run(&mut op, &mut current, &mut view);
        assert_eq!(op.state, OperationState::Failed);
        for m in &op.moves {
            let involves_n4 = m.to_leader == node("n4") || m.to_followers.contains(&node("n4"));
            if involves_n4 {
                assert_eq!(m.step, MoveStep::Reverted, "{m:?}");
                assert!(m.reason.as_deref().unwrap().contains("n4"), "{m:?}");
            }
        }
        assert!(
            !crate::plan::led_and_followed(&current).contains_key(&node("n4")),
            "{current:#?}"
        );
    }

    #[test]
    fn cancelling_reverts_what_has_not_been_cut_over() {
        let before = table(6, 3);
        let mut current = before.clone();
        let four: BTreeSet<NodeId> = ["n1", "n2", "n3", "n4"].iter().map(|n| node(n)).collect();
        let mut op = new_operation(&current, &four, &options(6), 6, "test", 0).unwrap();
        let mut view = OperationView {
            nodes: serving(&["n1", "n2", "n3", "n4"]),
            ..OperationView::default()
        };
        advance(&mut op, &mut current, &view, &MoveLimits::default());
        op.state = OperationState::Cancelling;
        advance(&mut op, &mut current, &view, &MoveLimits::default());
        assert_eq!(op.state, OperationState::Cancelled);
        assert!(op.moves.iter().all(|m| m.step == MoveStep::Cancelled));
        for (p, placement) in &before.partitions {
            assert_eq!(holders(&current.partitions[p]), holders(placement));
            assert_eq!(current.partitions[p].handoff, None);
        }
        view.now_ms += 1;
    }

    #[test]
    fn a_leader_that_does_not_hand_over_in_time_keeps_its_partition() {
        let before = table(8, 3);
        let mut current = before.clone();
        let four: BTreeSet<NodeId> = ["n1", "n2", "n3", "n4"].iter().map(|n| node(n)).collect();
        let mut op = new_operation(&current, &four, &options(8), 8, "test", 0).unwrap();
        let moving = op
            .moves
            .iter()
            .find(|m| Some(&m.to_leader) != m.from_leader.as_ref())
            .map(|m| m.partition)
            .expect("n4 takes a leadership");
        let mut view = OperationView {
            nodes: serving(&["n1", "n2", "n3", "n4"]),
            ..OperationView::default()
        };
        let limits = MoveLimits::default();
        // Every follower caught up, but no leader ever acts on a handoff.
        for _ in 0..3 {
            advance(&mut op, &mut current, &view, &limits);
            let handoffs: Vec<_> = current
                .partitions
                .values_mut()
                .map(|p| p.handoff.take())
                .collect();
            nodes_act(&mut current, &mut view);
            for (p, handoff) in current.partitions.values_mut().zip(handoffs) {
                p.handoff = handoff;
            }
        }
        assert!(current.partitions[&moving].handoff.is_some(), "{op:#?}");
        view.now_ms += limits.handoff.as_millis() as u64 + 1;
        advance(&mut op, &mut current, &view, &limits);
        let m = op.moves.iter().find(|m| m.partition == moving).unwrap();
        assert_eq!(m.step, MoveStep::Reverted);
        assert!(
            m.reason.as_deref().unwrap().contains("did not hand over"),
            "{m:?}"
        );
        assert_eq!(current.partitions[&moving].handoff, None);
        assert_eq!(
            holders(&current.partitions[&moving]),
            holders(&before.partitions[&moving])
        );
    }

    #[test]
    fn a_failover_during_a_handoff_moves_the_partition_from_where_it_is_then() {
        // One partition led by n1 and followed by n2, to be moved to n3 and n4 entirely.
        let mut current = table(1, 2);
        let to: BTreeSet<NodeId> = ["n3", "n4"].iter().map(|n| node(n)).collect();
        let mut op = new_operation(&current, &to, &options(1), 1, "test", 0).unwrap();
        let m = op.moves[0].clone();
        assert_eq!(m.from_leader, Some(node("n1")));
        let mut view = OperationView {
            nodes: serving(&["n1", "n2", "n3", "n4"]),
            ..OperationView::default()
        };
        let limits = MoveLimits::default();
        advance(&mut op, &mut current, &view, &limits);
        nodes_act(&mut current, &mut view);
        advance(&mut op, &mut current, &view, &limits);
        assert_eq!(
            current.partitions[&PartitionId(0)].handoff,
            Some(m.to_leader.clone())
        );
        // The leader dies before it acts on the handoff; the planner fails the partition over
        // to its follower n2 and withdraws the handoff.
        view.nodes.insert(node("n1"), NodeCondition::Gone);
        let p = current.partitions.get_mut(&PartitionId(0)).unwrap();
        p.followers.retain(|f| *f != node("n2"));
        p.leader = Some(node("n2"));
        p.handoff = None;
        p.epoch = Epoch(p.epoch.0 + 1);
        nodes_act(&mut current, &mut view);
        run(&mut op, &mut current, &mut view);
        assert_eq!(op.moves[0].step, MoveStep::Done, "{op:#?}");
        assert_eq!(
            holders(&current.partitions[&PartitionId(0)]),
            (Some(m.to_leader), m.to_followers.into_iter().collect())
        );
    }
}
