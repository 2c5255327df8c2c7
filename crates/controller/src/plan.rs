//! The controller's decisions, as a pure function of the cluster as observed: [`plan`] takes the
//! partition table (the intent), what each node's record says and how the observer judges it,
//! and what followers reported they applied, and returns the table it should become with the
//! changes spelled out. It does no IO and reads no clock, so tests drive it with every state
//! they can make up.
//!
//! # Rules, per partition, each on its own
//! 1. **Placement.** A cluster whose partitions have no leader yet waits for
//!    [`PlacementOptions::initial_nodes`] serving nodes, then gives partition `p` the nodes
//!    `p, p+1, …` (mod N, in name order) as leader and followers, so every node leads ⌊P/N⌋ or
//!    ⌈P/N⌉. A partition without a leader in a placed cluster goes to the serving node that
//!    carries least.
//! 2. **Failover.** A leader whose node is gone (dead, left, or no record) or restarting
//!    (`starting`: a new process that holds no leadership) is replaced by its most caught-up
//!    serving follower (highest applied LSN reported; then fewest leaderships; then name). With
//!    no serving follower, a gone leader is replaced by the serving node that carries least,
//!    which restores the partition from the repository and replays its log; a restarting one is
//!    kept (it comes back with its store). A restarted leader replaced so follows the partition.
//!    A leader whose node is only *silent* is left alone: the controller first writes `dead`
//!    over its record, and plans again once that write has succeeded.
//! 3. **Followers.** Followers on gone nodes are dropped; then followers are added on serving or
//!    starting nodes (those carrying least first) until the partition has
//!    [`PlacementOptions::standbys`] of them, or every other such node follows it.
//!
//! Epochs are never changed here: a node the table makes leader raises the epoch itself when it
//! takes the partition over, which fences every record of its predecessor. Leadership never
//! moves away from a serving leader (that is rebalancing, which is the scaling operations' job).

use cairn_metadata::{PartitionPlacement, PartitionTable};
use cairn_types::{Epoch, NodeId, PartitionId};
use std::collections::{BTreeMap, BTreeSet};

/// What the controller needs to place partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementOptions {
    pub num_partitions: u16,
    /// Serving nodes a new cluster waits for before it places its partitions.
    pub initial_nodes: usize,
    /// Followers per partition, on nodes other than its leader's.
    pub standbys: usize,
}

/// A node as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum NodeCondition {
    /// Registered and heartbeating: it may lead and follow.
    Serving,
    /// Heartbeating, still opening its stores (a process that has just started): it may be given
    /// partitions to follow, and leads none.
    Starting,
    /// Its record has not changed for the node timeout, but nobody has written it dead yet: its
    /// leaderships may not move until that write succeeds.
    Silent,
    /// Dead (written so by a controller), left (stopped cleanly), or unknown (no record).
    Gone,
}

/// The cluster as observed, for [`plan`].
#[derive(Debug, Clone, Default)]
pub struct View {
    pub table: PartitionTable,
    /// Every member's condition. A node the table names that is missing here is gone.
    pub nodes: BTreeMap<NodeId, NodeCondition>,
    /// The applied LSN each node last reported for each partition it follows.
    pub applied: BTreeMap<(PartitionId, NodeId), u64>,
}

impl View {
    fn condition(&self, node: &NodeId) -> NodeCondition {
        self.nodes.get(node).copied().unwrap_or(NodeCondition::Gone)
    }
}

/// One change [`plan`] made, for the controller's log and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A new cluster's partition, placed.
    Placed {
        partition: PartitionId,
        leader: NodeId,
    },
    /// A partition's leadership moved off a node that no longer serves it.
    Failover {
        partition: PartitionId,
        from: NodeId,
        /// Why `from` no longer leads.
        from_condition: NodeCondition,
        to: NodeId,
        /// Whether `to` followed the partition (else it restores it from the repository).
        to_was_follower: bool,
    },
    FollowerAdded {
        partition: PartitionId,
        node: NodeId,
    },
    FollowerRemoved {
        partition: PartitionId,
        node: NodeId,
    },
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::Placed { partition, leader } => {
                write!(f, "partition {partition}: placed, led by {leader}")
            }
            Change::Failover {
                partition,
                from,
                from_condition,
                to,
                to_was_follower,
            } => write!(
                f,
                "partition {partition}: leadership moves from {from} ({}) to {to}{}",
                match from_condition {
                    NodeCondition::Starting => "restarted",
                    _ => "gone",
                },
                if *to_was_follower {
                    ", its most caught-up follower"
                } else {
                    ", which restores it from the repository (no serving follower)"
                }
            ),
            Change::FollowerAdded { partition, node } => {
                write!(f, "partition {partition}: {node} follows it")
            }
            Change::FollowerRemoved { partition, node } => {
                write!(f, "partition {partition}: {node} no longer follows it")
            }
        }
    }
}

/// What [`plan`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub table: PartitionTable,
    pub changes: Vec<Change>,
    /// A new cluster still waits for this many serving nodes before it places anything.
    pub waiting_for: Option<usize>,
}

/// Partitions each node leads and follows in `table`.
fn load(table: &PartitionTable) -> BTreeMap<NodeId, (usize, usize)> {
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

/// Decides what the table should become; see the module's rules.
pub fn plan(view: &View, options: &PlacementOptions) -> Plan {
    let mut table = view.table.clone();
    let mut changes = Vec::new();
    let serving: Vec<NodeId> = view
        .nodes
        .iter()
        .filter(|(_, c)| **c == NodeCondition::Serving)
        .map(|(n, _)| n.clone())
        .collect();
    let placed = table.partitions.values().any(|p| p.leader.is_some());
    if !placed {
        if serving.len() < options.initial_nodes || serving.is_empty() {
            return Plan {
                table,
                changes,
                waiting_for: Some(options.initial_nodes.saturating_sub(serving.len()).max(1)),
            };
        }
        place_new_cluster(&mut table, &serving, options, &mut changes);
        return Plan {
            table,
            changes,
            waiting_for: None,
        };
    }
    let mut counts = load(&table);
    for p in 0..options.num_partitions {
        let partition = PartitionId(p);
        let mut placement =
            table
                .partitions
                .get(&partition)
                .cloned()
                .unwrap_or(PartitionPlacement {
                    leader: None,
                    epoch: Epoch::default(),
                    followers: Vec::new(),
                    handoff: None,
                });
        choose_leader(view, partition, &mut placement, &mut counts, &mut changes);
        choose_followers(
            view,
            options,
            partition,
            &mut placement,
            &mut counts,
            &mut changes,
        );
        table.partitions.insert(partition, placement);
    }
    Plan {
        table,
        changes,
        waiting_for: None,
    }
}

/// Leader and followers of every partition of a cluster placed for the first time, the nodes
/// `p, p+1, …` (mod N) in name order.
fn place_new_cluster(
    table: &mut PartitionTable,
    serving: &[NodeId],
    options: &PlacementOptions,
    changes: &mut Vec<Change>,
) {
    let standbys = options.standbys.min(serving.len() - 1);
    for p in 0..options.num_partitions {
        let first = usize::from(p) % serving.len();
        let leader = serving[first].clone();
        let placement = table
            .partitions
            .entry(PartitionId(p))
            .or_insert(PartitionPlacement {
                leader: None,
                epoch: Epoch::default(),
                followers: Vec::new(),
                handoff: None,
            });
        placement.leader = Some(leader.clone());
        placement.followers = (1..=standbys)
            .map(|k| serving[(first + k) % serving.len()].clone())
            .collect();
        changes.push(Change::Placed {
            partition: PartitionId(p),
            leader,
        });
    }
}

/// The node among `candidates` that carries least (leaderships first, then followings), by
/// name among equals.
fn least_loaded<'a>(
    candidates: impl Iterator<Item = &'a NodeId>,
    counts: &BTreeMap<NodeId, (usize, usize)>,
) -> Option<NodeId> {
    candidates
        .min_by_key(|node| {
            let (leads, follows) = counts.get(*node).copied().unwrap_or_default();
            (leads + follows, leads, (*node).clone())
        })
        .cloned()
}

fn choose_leader(
    view: &View,
    partition: PartitionId,
    placement: &mut PartitionPlacement,
    counts: &mut BTreeMap<NodeId, (usize, usize)>,
    changes: &mut Vec<Change>,
) {
    let serving_elsewhere = |placement: &PartitionPlacement| {
        view.nodes
            .iter()
            .filter(|(node, c)| {
                **c == NodeCondition::Serving
                    && placement.leader.as_ref() != Some(*node)
                    && !placement.followers.contains(node)
            })
            .map(|(node, _)| node.clone())
            .collect::<Vec<_>>()
    };
    let Some(leader) = placement.leader.clone() else {
        // Unplaced in a placed cluster: the serving node that carries least.
        if let Some(node) = least_loaded(serving_elsewhere(placement).iter(), counts) {
            counts.entry(node.clone()).or_default().0 += 1;
            placement.leader = Some(node.clone());
            changes.push(Change::Placed {
                partition,
                leader: node,
            });
        }
        return;
    };
    let condition = view.condition(&leader);
    if matches!(condition, NodeCondition::Serving | NodeCondition::Silent) {
        // A handoff to a node that is gone, or no longer follows, can never complete.
        if let Some(to) = &placement.handoff
            && (view.condition(to) == NodeCondition::Gone || !placement.followers.contains(to))
        {
            placement.handoff = None;
        }
        return;
    }
    // Its most caught-up serving follower. A restarted leader hands over only to a follower that
    // has reported what it applied (it runs the partition): one placed moments ago would have to
    // catch up first, which the restarted leader, holding the store, does sooner.
    let follower = placement
        .followers
        .iter()
        .filter(|f| view.condition(f) == NodeCondition::Serving)
        .filter(|f| {
            condition != NodeCondition::Starting
                || view.applied.contains_key(&(partition, (*f).clone()))
        })
        .max_by_key(|f| {
            let applied = view
                .applied
                .get(&(partition, (*f).clone()))
                .copied()
                .unwrap_or(0);
            let leads = counts.get(*f).map_or(0, |c| c.0);
            // Highest applied; among equals fewest leaderships, then the first name.
            (
                applied,
                std::cmp::Reverse(leads),
                std::cmp::Reverse((*f).clone()),
            )
        })
        .cloned();
    let (to, to_was_follower) = match follower {
        Some(follower) => (follower, true),
        // A restarted leader with nobody to take over keeps it: it comes back with its store.
        None if condition == NodeCondition::Starting => return,
        None => match least_loaded(serving_elsewhere(placement).iter(), counts) {
            Some(node) => (node, false),
            None => return,
        },
    };
    if let Some(c) = counts.get_mut(&leader) {
        c.0 = c.0.saturating_sub(1);
    }
    let entry = counts.entry(to.clone()).or_default();
    entry.0 += 1;
    if to_was_follower {
        entry.1 = entry.1.saturating_sub(1);
    }
    placement.followers.retain(|f| *f != to);
    if condition == NodeCondition::Starting {
        // A restarted node follows what it led: it holds the store, so catching up is short.
        placement.followers.push(leader.clone());
        counts.entry(leader.clone()).or_default().1 += 1;
    }
    placement.leader = Some(to.clone());
    // A cutover under way ends with the leader it was leaving.
    placement.handoff = None;
    changes.push(Change::Failover {
        partition,
        from: leader,
        from_condition: condition,
        to,
        to_was_follower,
    });
}

fn choose_followers(
    view: &View,
    options: &PlacementOptions,
    partition: PartitionId,
    placement: &mut PartitionPlacement,
    counts: &mut BTreeMap<NodeId, (usize, usize)>,
    changes: &mut Vec<Change>,
) {
    let mut kept = Vec::with_capacity(placement.followers.len());
    let mut seen = BTreeSet::new();
    for follower in std::mem::take(&mut placement.followers) {
        let duplicate =
            !seen.insert(follower.clone()) || placement.leader.as_ref() == Some(&follower);
        if duplicate || view.condition(&follower) == NodeCondition::Gone {
            if let Some(c) = counts.get_mut(&follower) {
                c.1 = c.1.saturating_sub(1);
            }
            if !duplicate {
                changes.push(Change::FollowerRemoved {
                    partition,
                    node: follower,
                });
            }
            continue;
        }
        kept.push(follower);
    }
    placement.followers = kept;
    if placement.leader.is_none() {
        return;
    }
    while placement.followers.len() < options.standbys {
        let candidates: Vec<NodeId> = view
            .nodes
            .iter()
            .filter(|(node, c)| {
                matches!(c, NodeCondition::Serving | NodeCondition::Starting)
                    && placement.leader.as_ref() != Some(*node)
                    && !placement.followers.contains(node)
            })
            .map(|(node, _)| node.clone())
            .collect();
        let Some(node) = least_loaded(candidates.iter(), counts) else {
            break;
        };
        counts.entry(node.clone()).or_default().1 += 1;
        placement.followers.push(node.clone());
        changes.push(Change::FollowerAdded { partition, node });
    }
}

/// Partitions each node leads and follows, for `nodes list`.
pub fn led_and_followed(table: &PartitionTable) -> BTreeMap<NodeId, (usize, usize)> {
    load(table)
}

/// What `node` runs of `partition` by the intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Leader,
    Follower,
    /// Another node's, or not placed yet.
    None,
}

/// A leader asked to hand its leadership over ([`PartitionPlacement::handoff`]) runs the
/// partition as a follower: it stops serving before it names its successor.
pub fn role(table: &PartitionTable, partition: PartitionId, node: &NodeId) -> Role {
    match table.partitions.get(&partition) {
        Some(p) if p.leader.as_ref() == Some(node) && p.handoff.is_some() => Role::Follower,
        Some(p) if p.leader.as_ref() == Some(node) => Role::Leader,
        Some(p) if p.followers.contains(node) => Role::Follower,
        _ => Role::None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(name: &str) -> NodeId {
        NodeId(name.into())
    }

    fn options(num_partitions: u16, standbys: usize) -> PlacementOptions {
        PlacementOptions {
            num_partitions,
            initial_nodes: 3,
            standbys,
        }
    }

    fn serving(names: &[&str]) -> BTreeMap<NodeId, NodeCondition> {
        names
            .iter()
            .map(|n| (node(n), NodeCondition::Serving))
            .collect()
    }

    fn placed(names: &[&str], partitions: u16, standbys: usize) -> PartitionTable {
        let view = View {
            nodes: serving(names),
            ..View::default()
        };
        let options = PlacementOptions {
            initial_nodes: names.len(),
            ..options(partitions, standbys)
        };
        plan(&view, &options).table
    }

    #[test]
    fn a_new_cluster_waits_for_its_initial_nodes_then_spreads_leaders() {
        let view = View {
            nodes: serving(&["a", "b"]),
            ..View::default()
        };
        let waiting = plan(&view, &options(16, 1));
        assert_eq!(waiting.waiting_for, Some(1));
        assert!(waiting.changes.is_empty());
        let table = placed(&["c", "a", "b"], 16, 1);
        let counts = led_and_followed(&table);
        let leads: Vec<usize> = counts.values().map(|(l, _)| *l).collect();
        assert_eq!(leads.iter().sum::<usize>(), 16);
        assert!(leads.iter().all(|&l| l == 5 || l == 6), "{counts:?}");
        for placement in table.partitions.values() {
            assert_eq!(placement.followers.len(), 1);
            assert_ne!(Some(&placement.followers[0]), placement.leader.as_ref());
        }
    }

    #[test]
    fn a_dead_leaders_partitions_go_to_their_most_caught_up_followers() {
        let mut table = placed(&["a", "b", "c"], 6, 2);
        for placement in table.partitions.values_mut() {
            placement.epoch = Epoch(4);
        }
        let mut nodes = serving(&["a", "b", "c"]);
        nodes.insert(node("b"), NodeCondition::Gone);
        let mut applied = BTreeMap::new();
        // Partition 1 is led by b, followed by c and a: a is further ahead.
        applied.insert((PartitionId(1), node("a")), 90);
        applied.insert((PartitionId(1), node("c")), 70);
        let view = View {
            table: table.clone(),
            nodes,
            applied,
        };
        let plan = plan(&view, &options(6, 2));
        for (p, placement) in &plan.table.partitions {
            assert_ne!(placement.leader, Some(node("b")), "partition {p}");
            assert!(!placement.followers.contains(&node("b")), "partition {p}");
            assert_eq!(
                placement.epoch,
                Epoch(4),
                "epochs are the new leader's to raise"
            );
            let before = &table.partitions[p];
            if before.leader != Some(node("b")) {
                assert_eq!(placement.leader, before.leader, "serving leaders stay");
            }
            // Two nodes are left: every partition keeps one follower.
            assert_eq!(placement.followers.len(), 1, "partition {p}: {placement:?}");
        }
        assert_eq!(
            plan.table.partitions[&PartitionId(1)].leader,
            Some(node("a"))
        );
        assert!(plan.changes.contains(&Change::Failover {
            partition: PartitionId(1),
            from: node("b"),
            from_condition: NodeCondition::Gone,
            to: node("a"),
            to_was_follower: true,
        }));
    }

    #[test]
    fn a_silent_leader_keeps_its_partitions_until_it_is_written_dead() {
        let table = placed(&["a", "b", "c"], 6, 1);
        let mut nodes = serving(&["a", "b", "c"]);
        nodes.insert(node("b"), NodeCondition::Silent);
        let view = View {
            table: table.clone(),
            nodes,
            ..View::default()
        };
        let plan = plan(&view, &options(6, 1));
        assert_eq!(plan.table, table);
        assert!(plan.changes.is_empty());
    }

    #[test]
    fn with_no_serving_follower_another_node_restores_the_partition() {
        let table = placed(&["a", "b", "c"], 3, 1);
        // Partition 0: a leads, b follows. Both gone.
        let mut nodes = serving(&["a", "b", "c"]);
        nodes.insert(node("a"), NodeCondition::Gone);
        nodes.insert(node("b"), NodeCondition::Gone);
        let view = View {
            table,
            nodes,
            ..View::default()
        };
        let plan = plan(&view, &options(3, 1));
        for placement in plan.table.partitions.values() {
            assert_eq!(placement.leader, Some(node("c")));
            assert!(placement.followers.is_empty(), "no other node serves");
        }
        assert!(plan.changes.iter().any(|c| matches!(
            c,
            Change::Failover {
                to_was_follower: false,
                ..
            }
        )));
    }

    #[test]
    fn a_restarted_leader_hands_over_to_a_follower_and_follows() {
        let table = placed(&["a", "b", "c"], 3, 1);
        let mut nodes = serving(&["a", "b", "c"]);
        nodes.insert(node("a"), NodeCondition::Starting);
        let view = View {
            table: table.clone(),
            nodes,
            // b runs partition 0 as follower.
            applied: [((PartitionId(0), node("b")), 12)].into(),
        };
        let plan = plan(&view, &options(3, 1));
        let zero = &plan.table.partitions[&PartitionId(0)];
        assert_eq!(zero.leader, Some(node("b")));
        assert_eq!(zero.followers, vec![node("a")]);
        // With no follower at all, the restarted leader keeps its partition.
        let table = placed(&["a"], 2, 1);
        let view = View {
            table: table.clone(),
            nodes: [(node("a"), NodeCondition::Starting)].into(),
            ..View::default()
        };
        assert_eq!(plan_of(&view, 2, 1), table);
    }

    fn plan_of(view: &View, partitions: u16, standbys: usize) -> PartitionTable {
        plan(view, &options(partitions, standbys)).table
    }

    fn condition() -> impl Strategy<Value = NodeCondition> {
        prop_oneof![
            4 => Just(NodeCondition::Serving),
            1 => Just(NodeCondition::Starting),
            1 => Just(NodeCondition::Silent),
            2 => Just(NodeCondition::Gone),
        ]
    }

    proptest! {
        /// Whatever the nodes' conditions: every leader that can be replaced is, serving leaders
        /// stay, followers are distinct, never the leader and never gone, and planning again
        /// changes nothing.
        #[test]
        fn plans_keep_the_invariants(
            conditions in proptest::collection::vec(condition(), 1..6),
            later in proptest::collection::vec(condition(), 1..6),
            standbys in 0usize..3,
            partitions in 1u16..20,
            applied in proptest::collection::vec(0u64..100, 0..40),
        ) {
            let names: Vec<String> = (0..conditions.len()).map(|i| format!("n{i}")).collect();
            let all: Vec<&str> = names.iter().map(String::as_str).collect();
            let table = placed(&all, partitions, standbys);
            let nodes: BTreeMap<NodeId, NodeCondition> = names
                .iter()
                .zip(later.iter().chain(std::iter::repeat(&NodeCondition::Serving)))
                .map(|(n, c)| (node(n), *c))
                .collect();
            // Reports come from the followers the table had.
            let applied: BTreeMap<(PartitionId, NodeId), u64> = applied
                .iter()
                .enumerate()
                .filter_map(|(i, lsn)| {
                    let p = PartitionId((i % usize::from(partitions)) as u16);
                    let followers = &table.partitions[&p].followers;
                    let f = followers.get(i % followers.len().max(1))?;
                    Some(((p, f.clone()), *lsn))
                })
                .collect();
            let view = View { table: table.clone(), nodes: nodes.clone(), applied: applied.clone() };
            let planned = plan(&view, &options(partitions, standbys));
            let serving_count = nodes.values().filter(|c| **c == NodeCondition::Serving).count();
            for (p, placement) in &planned.table.partitions {
                let before = &table.partitions[p];
                let leader = placement.leader.clone().expect("placed partitions keep a leader");
                let condition = nodes[&leader];
                if nodes[before.leader.as_ref().unwrap()] == NodeCondition::Serving
                    || nodes[before.leader.as_ref().unwrap()] == NodeCondition::Silent
                {
                    prop_assert_eq!(&placement.leader, &before.leader);
                }
                if condition == NodeCondition::Gone {
                    prop_assert_eq!(serving_count, 0, "a gone leader stays only with nobody serving");
                }
                let distinct: BTreeSet<&NodeId> = placement.followers.iter().collect();
                prop_assert_eq!(distinct.len(), placement.followers.len());
                prop_assert!(!placement.followers.contains(&leader));
                for f in &placement.followers {
                    prop_assert_ne!(nodes[f], NodeCondition::Gone);
                }
                prop_assert_eq!(placement.epoch, before.epoch);
            }
            let again = View { table: planned.table.clone(), nodes, applied };
            let replanned = plan(&again, &options(partitions, standbys));
            prop_assert_eq!(replanned.table, planned.table);
            prop_assert!(replanned.changes.is_empty(), "{:?}", replanned.changes);
        }
    }
}
