//! Rebalancing: where every partition should run on a given set of nodes, as a pure function of
//! the current placement ([`rebalance`]). It is what a scaling operation carries out and what
//! `cluster plan` previews.
//!
//! # What the placement it returns holds to
//! - **Balanced.** With `P` partitions on `N` nodes, every node leads `⌊P/N⌋` or `⌈P/N⌉` of them;
//!   each partition has `s = min(standbys, N - 1)` followers, never on its leader's node and
//!   never two on one node, and every node follows `⌊Ps/N⌋` or `⌈Ps/N⌉`.
//! - **Least copied.** A role given to a node that holds none of the partition's data (neither
//!   leads nor follows it now) means copying the partition there (a snapshot and the log past
//!   it); such copies come first in the cost, so the placement copies as few partitions as a
//!   balanced one can, leaders first. Among those, it changes the fewest roles: a leadership
//!   moves to a node that already follows the partition rather than to one that would copy it,
//!   and a placement that is already balanced on the same nodes stays as it is.
//! - **Deterministic.** The same table and nodes give the same placement.
//!
//! It is solved as two minimum-cost flows ([`crate::flow`]): leaders first (source → partition →
//! node → sink, each node's edge to the sink in two parts, `⌊P/N⌋` units priced so that every
//! node gets them and one more at no price), then followers the same way with the leaders fixed.
//! Epochs are not changed: a node made leader raises the epoch itself when it takes over.

use crate::flow::{EdgeId, MinCostFlow};
use crate::plan::{PlacementOptions, Role};
use cairn_metadata::{PartitionPlacement, PartitionTable};
use cairn_types::{Epoch, NodeId, PartitionId};
use std::collections::BTreeSet;

/// One role of one partition that changes node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    pub partition: PartitionId,
    /// [`Role::Leader`] or [`Role::Follower`].
    pub role: Role,
    /// The node that stops holding the role (`None`: a follower added).
    pub from: Option<NodeId>,
    /// The node that takes it (`None`: a follower dropped, with too few nodes for every
    /// standby).
    pub to: Option<NodeId>,
    /// Whether `to` holds none of the partition's data yet, so it must be copied there.
    pub copies: bool,
}

/// What [`rebalance`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rebalance {
    /// The placement to reach.
    pub table: PartitionTable,
    /// Every role that changes node, by partition, the leader's first.
    pub moves: Vec<Move>,
    /// Partitions whose leader and followers all stay.
    pub unmoved: usize,
}

/// Why there is no placement to give.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RebalanceError {
    #[error("no nodes to place the partitions on: name at least one")]
    NoNodes,
    #[error("the cluster has no partitions to place")]
    NoPartitions,
}

/// The placement of `options.num_partitions` partitions on exactly `nodes`; see the module.
pub fn rebalance(
    table: &PartitionTable,
    nodes: &BTreeSet<NodeId>,
    options: &PlacementOptions,
) -> Result<Rebalance, RebalanceError> {
    if nodes.is_empty() {
        return Err(RebalanceError::NoNodes);
    }
    if options.num_partitions == 0 {
        return Err(RebalanceError::NoPartitions);
    }
    let nodes: Vec<&NodeId> = nodes.iter().collect();
    let partitions = usize::from(options.num_partitions);
    let standbys = options.standbys.min(nodes.len() - 1);
    let current: Vec<PartitionPlacement> = (0..options.num_partitions)
        .map(|p| {
            table
                .partitions
                .get(&PartitionId(p))
                .cloned()
                .unwrap_or(PartitionPlacement {
                    leader: None,
                    epoch: Epoch::default(),
                    followers: Vec::new(),
                    handoff: None,
                })
        })
        .collect();
    let holds = |p: usize, node: &NodeId| {
        current[p].leader.as_ref() == Some(node) || current[p].followers.contains(node)
    };
    let problem = Problem {
        partitions,
        nodes: &nodes,
        standbys,
        holds: &holds,
        leads: &|p, node| current[p].leader.as_ref() == Some(node),
        follows: &|p, node| current[p].followers.contains(node),
    };
    // Two ways to it, the better one kept: replica sets first (which can trade a leadership
    // change for a copy saved), or leaders first (which always finds a balanced placement).
    let leaders_first = problem.leaders_first();
    let chosen = match problem.replicas_first() {
        Some(joint) if problem.cost(&joint) < problem.cost(&leaders_first) => joint,
        _ => leaders_first,
    };

    let mut planned = table.clone();
    let mut moves = Vec::new();
    let mut unmoved = 0;
    for (p, now) in current.iter().enumerate() {
        let (leader, followers) = &chosen[p];
        let leader = nodes[*leader].clone();
        let chosen: BTreeSet<&NodeId> = followers.iter().map(|&n| nodes[n]).collect();
        // Followers that stay keep their order (the failover's preference among equals), then
        // the new ones by name.
        let mut new_followers: Vec<NodeId> = now
            .followers
            .iter()
            .filter(|f| chosen.contains(f))
            .cloned()
            .collect();
        for node in &chosen {
            if !new_followers.contains(node) {
                new_followers.push((*node).clone());
            }
        }
        let partition = PartitionId(p as u16);
        let before = moves.len();
        if now.leader.as_ref() != Some(&leader) {
            moves.push(Move {
                partition,
                role: Role::Leader,
                from: now.leader.clone(),
                copies: !holds(p, &leader),
                to: Some(leader.clone()),
            });
        }
        let gone: Vec<&NodeId> = now
            .followers
            .iter()
            .filter(|f| !new_followers.contains(f))
            .collect();
        let came: Vec<&NodeId> = new_followers
            .iter()
            .filter(|f| !now.followers.contains(f))
            .collect();
        for i in 0..gone.len().max(came.len()) {
            let to = came.get(i).map(|n| (*n).clone());
            moves.push(Move {
                partition,
                role: Role::Follower,
                from: gone.get(i).map(|n| (*n).clone()),
                copies: to.as_ref().is_some_and(|to| !holds(p, to)),
                to,
            });
        }
        if moves.len() == before {
            unmoved += 1;
        }
        planned.partitions.insert(
            partition,
            PartitionPlacement {
                leader: Some(leader),
                epoch: now.epoch,
                followers: new_followers,
                handoff: None,
            },
        );
    }
    Ok(Rebalance {
        table: planned,
        moves,
        unmoved,
    })
}

/// A placement by node index: each partition's leader and followers.
type Placement = Vec<(usize, Vec<usize>)>;

/// The prices: a copy outweighs any number of role changes, and a node's share up to its
/// floor outweighs everything else, so that every node gets it.
struct Prices {
    copy: i64,
    floor: i64,
}

/// One rebalancing to solve, by node index.
struct Problem<'a> {
    partitions: usize,
    nodes: &'a [&'a NodeId],
    standbys: usize,
    /// Whether a node holds the partition's data now (leads or follows it).
    holds: &'a dyn Fn(usize, &NodeId) -> bool,
    leads: &'a dyn Fn(usize, &NodeId) -> bool,
    follows: &'a dyn Fn(usize, &NodeId) -> bool,
}

impl Problem<'_> {
    fn prices(&self) -> Prices {
        let units = (self.partitions * (self.standbys + 1) + 1) as i64;
        Prices {
            copy: units,
            floor: -(units * units),
        }
    }

    /// Every partition's leader and followers as balanced shares of `(⌊P/N⌋, ⌈P/N⌉)` and of
    /// `(⌊Ps/N⌋, ⌈Ps/N⌉)`.
    fn shares(&self) -> ((usize, usize), (usize, usize)) {
        let (p, n) = (self.partitions, self.nodes.len());
        let f = p * self.standbys;
        ((p / n, p.div_ceil(n)), (f / n, f.div_ceil(n)))
    }

    /// Copies, then role changes.
    fn cost(&self, placement: &Placement) -> (usize, usize) {
        let mut copies = 0;
        let mut changes = 0;
        for (p, (leader, followers)) in placement.iter().enumerate() {
            let leader = self.nodes[*leader];
            copies += usize::from(!(self.holds)(p, leader));
            changes += usize::from(!(self.leads)(p, leader));
            for &f in followers {
                copies += usize::from(!(self.holds)(p, self.nodes[f]));
                changes += usize::from(!(self.follows)(p, self.nodes[f]));
            }
        }
        (copies, changes)
    }

    /// Leaders first (keeping a leader, else promoting a follower, else copying), then
    /// followers with the leaders fixed.
    fn leaders_first(&self) -> Placement {
        let prices = self.prices();
        let price = |p: usize, node: &NodeId| {
            if (self.leads)(p, node) {
                0
            } else if (self.holds)(p, node) {
                1
            } else {
                prices.copy
            }
        };
        let leaders = assign(self.partitions, self.nodes, 1, prices.floor, |p, node| {
            Some(price(p, node))
        });
        let followers = assign(
            self.partitions,
            self.nodes,
            self.standbys,
            prices.floor,
            |p, node| {
                if self.nodes[leaders[p][0]] == node {
                    None
                } else if (self.follows)(p, node) {
                    Some(0)
                } else {
                    Some(price(p, node))
                }
            },
        );
        leaders
            .into_iter()
            .zip(followers)
            .map(|(leader, followers)| (leader[0], followers))
            .collect()
    }

    /// Replica sets first, as few copies as any balanced placement needs (every balanced
    /// placement's sets have the counts these are held to, so none copies less), then the
    /// leader of each set, kept where it can be. `None` when no balanced choice of leaders fits
    /// the sets.
    fn replicas_first(&self) -> Option<Placement> {
        let prices = self.prices();
        let n = self.nodes.len();
        let ((lead_floor, lead_ceil), (follow_floor, follow_ceil)) = self.shares();
        let (lead_extra, follow_extra) =
            (self.partitions % n, (self.partitions * self.standbys) % n);
        // A node holds `lead_floor + follow_floor` replicas, one more if it has the extra
        // leadership or the extra following, two if both: at most as many nodes as have both.
        let base = lead_floor + follow_floor;
        let per_partition = self.standbys + 1;
        let source = 0;
        let both = 1 + self.partitions + n;
        let sink = both + 1;
        let mut graph = MinCostFlow::new(sink + 1);
        let mut choices: Vec<Vec<(usize, EdgeId)>> = vec![Vec::new(); self.partitions];
        for (p, choice) in choices.iter_mut().enumerate() {
            graph.add_edge(source, 1 + p, per_partition as i64, 0);
            for (i, node) in self.nodes.iter().enumerate() {
                let cost = if (self.holds)(p, node) {
                    0
                } else {
                    prices.copy
                };
                choice.push((i, graph.add_edge(1 + p, 1 + self.partitions + i, 1, cost)));
            }
        }
        for i in 0..n {
            let vertex = 1 + self.partitions + i;
            if base > 0 {
                graph.add_edge(vertex, sink, base as i64, prices.floor);
            }
            if lead_extra + follow_extra > 0 {
                graph.add_edge(vertex, sink, 1, 0);
            }
            if lead_extra > 0 && follow_extra > 0 {
                graph.add_edge(vertex, both, 1, 0);
            }
        }
        if lead_extra > 0 && follow_extra > 0 {
            graph.add_edge(both, sink, lead_extra.min(follow_extra) as i64, 0);
        }
        let total = self.partitions * per_partition;
        if graph.run(source, sink, total as i64) < total as i64 {
            return None;
        }
        let sets = chosen(&graph, choices);
        let mut replicas = vec![0usize; n];
        for set in &sets {
            for &i in set {
                replicas[i] += 1;
            }
        }
        // Leaders within the sets: a node with `r` replicas leads between `r - follow_ceil` and
        // `r - follow_floor` of them, so that what it follows is a balanced share too.
        let bounds: Vec<(usize, usize)> = replicas
            .iter()
            .map(|&r| {
                (
                    lead_floor.max(r.saturating_sub(follow_ceil)),
                    lead_ceil.min(r.saturating_sub(follow_floor)),
                )
            })
            .collect();
        if bounds.iter().any(|(low, high)| low > high) {
            return None;
        }
        let sink = 1 + self.partitions + n;
        let mut graph = MinCostFlow::new(sink + 1);
        let mut choices: Vec<Vec<(usize, EdgeId)>> = vec![Vec::new(); self.partitions];
        for (p, choice) in choices.iter_mut().enumerate() {
            graph.add_edge(source, 1 + p, 1, 0);
            for &i in &sets[p] {
                let cost = i64::from(!(self.leads)(p, self.nodes[i]));
                choice.push((i, graph.add_edge(1 + p, 1 + self.partitions + i, 1, cost)));
            }
        }
        for (i, (low, high)) in bounds.iter().enumerate() {
            let vertex = 1 + self.partitions + i;
            if *low > 0 {
                graph.add_edge(vertex, sink, *low as i64, prices.floor);
            }
            if high > low {
                graph.add_edge(vertex, sink, (high - low) as i64, 0);
            }
        }
        if graph.run(source, sink, self.partitions as i64) < self.partitions as i64 {
            return None;
        }
        let mut placement = Vec::with_capacity(self.partitions);
        let mut leads = vec![0usize; n];
        for (p, leader) in chosen(&graph, choices).into_iter().enumerate() {
            let leader = *leader.first()?;
            leads[leader] += 1;
            let followers = sets[p].iter().copied().filter(|&i| i != leader).collect();
            placement.push((leader, followers));
        }
        // The floors are priced to be met whenever they can be; a choice that misses one is no
        // balanced placement.
        let balanced = leads
            .iter()
            .zip(&bounds)
            .all(|(leads, (low, _))| leads >= low);
        balanced.then_some(placement)
    }
}

/// Gives every partition `per_partition` distinct nodes, each node `⌊total/N⌋` or `⌈total/N⌉`
/// of them, at the least total of `price(partition, node)` (`None`: not allowed). Returns the
/// chosen nodes' indices per partition, in index order.
fn assign(
    partitions: usize,
    nodes: &[&NodeId],
    per_partition: usize,
    floor_price: i64,
    price: impl Fn(usize, &NodeId) -> Option<i64>,
) -> Vec<Vec<usize>> {
    let source = 0;
    let sink = 1 + partitions + nodes.len();
    let node_vertex = |n: usize| 1 + partitions + n;
    let mut graph = MinCostFlow::new(sink + 1);
    let mut choices: Vec<Vec<(usize, EdgeId)>> = vec![Vec::new(); partitions];
    for (p, choice) in choices.iter_mut().enumerate() {
        graph.add_edge(source, 1 + p, per_partition as i64, 0);
        for (n, node) in nodes.iter().enumerate() {
            if let Some(cost) = price(p, node) {
                choice.push((n, graph.add_edge(1 + p, node_vertex(n), 1, cost)));
            }
        }
    }
    let total = partitions * per_partition;
    let (floor, extra) = (total / nodes.len(), total % nodes.len());
    for n in 0..nodes.len() {
        if floor > 0 {
            graph.add_edge(node_vertex(n), sink, floor as i64, floor_price);
        }
        if extra > 0 {
            graph.add_edge(node_vertex(n), sink, 1, 0);
        }
    }
    graph.run(source, sink, total as i64);
    chosen(&graph, choices)
}

/// The nodes each partition's flow went to, by the edges of its choices.
fn chosen(graph: &MinCostFlow, choices: Vec<Vec<(usize, EdgeId)>>) -> Vec<Vec<usize>> {
    choices
        .into_iter()
        .map(|choice| {
            choice
                .into_iter()
                .filter(|(_, edge)| graph.flow(*edge) > 0)
                .map(|(n, _)| n)
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn node(name: &str) -> NodeId {
        NodeId(name.into())
    }

    fn nodes(names: &[&str]) -> BTreeSet<NodeId> {
        names.iter().map(|n| node(n)).collect()
    }

    fn options(num_partitions: u16, standbys: usize) -> PlacementOptions {
        PlacementOptions {
            num_partitions,
            initial_nodes: 1,
            standbys,
        }
    }

    /// Partition `p` led by `names[p % N]` and followed by the next `standbys`, as a new
    /// cluster is placed.
    fn striped(names: &[&str], partitions: u16, standbys: usize) -> PartitionTable {
        let mut table = PartitionTable::default();
        for p in 0..partitions {
            let at = |k: usize| node(names[(usize::from(p) + k) % names.len()]);
            table.partitions.insert(
                PartitionId(p),
                PartitionPlacement {
                    leader: Some(at(0)),
                    epoch: Epoch(3),
                    followers: (1..=standbys).map(at).collect(),
                    handoff: None,
                },
            );
        }
        table
    }

    /// Partitions each node leads and follows.
    fn counts(table: &PartitionTable) -> BTreeMap<NodeId, (usize, usize)> {
        let mut counts: BTreeMap<NodeId, (usize, usize)> = BTreeMap::new();
        for placement in table.partitions.values() {
            counts
                .entry(placement.leader.clone().unwrap())
                .or_default()
                .0 += 1;
            for f in &placement.followers {
                counts.entry(f.clone()).or_default().1 += 1;
            }
        }
        counts
    }

    /// Every rule of a balanced placement of `partitions` on `on`.
    fn check_balanced(
        table: &PartitionTable,
        on: &BTreeSet<NodeId>,
        partitions: u16,
        standbys: usize,
    ) -> Result<(), TestCaseError> {
        let n = on.len();
        let s = standbys.min(n - 1);
        let p = usize::from(partitions);
        prop_assert_eq!(table.partitions.len(), p);
        for (id, placement) in &table.partitions {
            let leader = placement.leader.as_ref().unwrap();
            prop_assert!(on.contains(leader), "{id} led off the nodes");
            prop_assert_eq!(placement.followers.len(), s, "{} followers", id);
            let distinct: BTreeSet<&NodeId> = placement.followers.iter().collect();
            prop_assert_eq!(distinct.len(), s, "{} has a follower twice", id);
            prop_assert!(
                !distinct.contains(leader),
                "{} followed on its leader's node",
                id
            );
            prop_assert!(distinct.iter().all(|f| on.contains(*f)));
        }
        let counts = counts(table);
        for node in on {
            let (leads, follows) = counts.get(node).copied().unwrap_or_default();
            prop_assert!(
                leads == p / n || leads == p.div_ceil(n),
                "{node} leads {leads}"
            );
            prop_assert!(
                follows == p * s / n || follows == (p * s).div_ceil(n),
                "{node} follows {follows}"
            );
        }
        Ok(())
    }

    /// The fewest copies of any balanced placement, found by trying them all.
    fn fewest_copies(
        table: &PartitionTable,
        on: &[NodeId],
        partitions: u16,
        standbys: usize,
    ) -> usize {
        struct Search<'a> {
            table: &'a PartitionTable,
            on: &'a [NodeId],
            s: usize,
            lead_cap: (usize, usize),
            follow_cap: (usize, usize),
            leads: Vec<usize>,
            follows: Vec<usize>,
            best: usize,
        }
        impl Search<'_> {
            fn holds(&self, p: u16, n: usize) -> bool {
                self.table
                    .partitions
                    .get(&PartitionId(p))
                    .is_some_and(|placement| {
                        placement.leader.as_ref() == Some(&self.on[n])
                            || placement.followers.contains(&self.on[n])
                    })
            }
            fn go(&mut self, p: u16, partitions: u16, copies: usize) {
                if copies >= self.best {
                    return;
                }
                if p == partitions {
                    let floors_met = self.leads.iter().all(|&l| l >= self.lead_cap.0)
                        && self.follows.iter().all(|&f| f >= self.follow_cap.0);
                    if floors_met {
                        self.best = copies;
                    }
                    return;
                }
                for leader in 0..self.on.len() {
                    if self.leads[leader] == self.lead_cap.1 {
                        continue;
                    }
                    self.leads[leader] += 1;
                    let copied = usize::from(!self.holds(p, leader));
                    self.followers(p, partitions, leader, 0, self.s, copies + copied);
                    self.leads[leader] -= 1;
                }
            }
            fn followers(
                &mut self,
                p: u16,
                partitions: u16,
                leader: usize,
                from: usize,
                left: usize,
                copies: usize,
            ) {
                if left == 0 {
                    self.go(p + 1, partitions, copies);
                    return;
                }
                for f in from..self.on.len() {
                    if f == leader || self.follows[f] == self.follow_cap.1 {
                        continue;
                    }
                    self.follows[f] += 1;
                    let copied = usize::from(!self.holds(p, f));
                    self.followers(p, partitions, leader, f + 1, left - 1, copies + copied);
                    self.follows[f] -= 1;
                }
            }
        }
        let n = on.len();
        let s = standbys.min(n - 1);
        let p = usize::from(partitions);
        let mut search = Search {
            table,
            on,
            s,
            lead_cap: (p / n, p.div_ceil(n)),
            follow_cap: (p * s / n, (p * s).div_ceil(n)),
            leads: vec![0; n],
            follows: vec![0; n],
            best: usize::MAX,
        };
        search.go(0, partitions, 0);
        search.best
    }

    #[test]
    fn a_fourth_node_takes_its_share_and_only_that_moves() {
        let before = striped(&["n1", "n2", "n3"], 8, 1);
        let four = nodes(&["n1", "n2", "n3", "n4"]);
        let plan = rebalance(&before, &four, &options(8, 1)).unwrap();
        check_balanced(&plan.table, &four, 8, 1).unwrap();
        let counts = counts(&plan.table);
        assert_eq!(counts[&node("n4")], (2, 2));
        // n4 copies the four partitions it now has a role in, and nothing else is copied.
        let copies: Vec<&Move> = plan.moves.iter().filter(|m| m.copies).collect();
        assert_eq!(copies.len(), 4, "{:#?}", plan.moves);
        assert!(copies.iter().all(|m| m.to == Some(node("n4"))));
        assert_eq!(
            plan.unmoved
                + plan
                    .moves
                    .iter()
                    .map(|m| m.partition)
                    .collect::<BTreeSet<_>>()
                    .len(),
            8
        );
        // Epochs are the leaders' to raise.
        assert!(plan.table.partitions.values().all(|p| p.epoch == Epoch(3)));
    }

    #[test]
    fn a_balanced_placement_on_the_same_nodes_stays() {
        let three = nodes(&["n1", "n2", "n3"]);
        for (partitions, standbys) in [(8, 1), (16, 2), (3, 1), (1, 2)] {
            let before = striped(&["n1", "n2", "n3"], partitions, standbys);
            let plan = rebalance(&before, &three, &options(partitions, standbys)).unwrap();
            assert!(plan.moves.is_empty(), "{:#?}", plan.moves);
            assert_eq!(plan.unmoved, usize::from(partitions));
            assert_eq!(plan.table, before);
        }
    }

    #[test]
    fn a_node_removed_hands_its_roles_to_the_others() {
        let before = striped(&["n1", "n2", "n3", "n4"], 8, 1);
        let three = nodes(&["n1", "n2", "n3"]);
        let plan = rebalance(&before, &three, &options(8, 1)).unwrap();
        check_balanced(&plan.table, &three, 8, 1).unwrap();
        assert!(plan.moves.iter().all(|m| m.to != Some(node("n4"))));
        // n4 led two partitions and followed two: no balanced placement copies less.
        assert_eq!(
            plan.moves.iter().filter(|m| m.copies).count(),
            fewest_copies(&before, &three.iter().cloned().collect::<Vec<_>>(), 8, 1)
        );
    }

    #[test]
    fn too_few_nodes_for_every_standby_keeps_as_many_as_fit() {
        let before = striped(&["n1", "n2", "n3"], 4, 2);
        let two = nodes(&["n1", "n2"]);
        let plan = rebalance(&before, &two, &options(4, 2)).unwrap();
        check_balanced(&plan.table, &two, 4, 2).unwrap();
        assert!(
            plan.table
                .partitions
                .values()
                .all(|p| p.followers.len() == 1)
        );
        assert!(
            plan.moves
                .iter()
                .any(|m| m.role == Role::Follower && m.to.is_none())
        );
    }

    #[test]
    fn no_nodes_or_no_partitions_are_refused() {
        let table = striped(&["n1"], 2, 0);
        assert_eq!(
            rebalance(&table, &BTreeSet::new(), &options(2, 0)),
            Err(RebalanceError::NoNodes)
        );
        assert_eq!(
            rebalance(&table, &nodes(&["n1"]), &options(0, 0)),
            Err(RebalanceError::NoPartitions)
        );
    }

    /// A placement as it may be found: some partitions unplaced, leaders and followers anywhere
    /// among six names, followers possibly on removed nodes.
    fn any_table(partitions: u16) -> impl Strategy<Value = PartitionTable> {
        proptest::collection::vec(
            (
                proptest::option::weighted(0.9, 0usize..6),
                proptest::collection::btree_set(0usize..6, 0..3),
            ),
            usize::from(partitions),
        )
        .prop_map(|placements| {
            let mut table = PartitionTable::default();
            for (p, (leader, followers)) in placements.into_iter().enumerate() {
                let Some(leader) = leader else { continue };
                table.partitions.insert(
                    PartitionId(p as u16),
                    PartitionPlacement {
                        leader: Some(node(&format!("n{leader}"))),
                        epoch: Epoch(1),
                        followers: followers
                            .into_iter()
                            .filter(|f| *f != leader)
                            .map(|f| node(&format!("n{f}")))
                            .collect(),
                        handoff: None,
                    },
                );
            }
            table
        })
    }

    fn case() -> impl Strategy<Value = (u16, usize, PartitionTable, BTreeSet<NodeId>)> {
        (1u16..24, 0usize..4).prop_flat_map(|(partitions, standbys)| {
            (
                Just(partitions),
                Just(standbys),
                any_table(partitions),
                proptest::collection::btree_set(
                    (0usize..6).prop_map(|n| node(&format!("n{n}"))),
                    1..6,
                ),
            )
        })
    }

    proptest! {
        /// Balanced, deterministic, and stable: planning the result again on the same nodes
        /// moves nothing.
        #[test]
        fn rebalanced_placements_are_balanced_and_stay_put(
            (partitions, standbys, table, on) in case(),
        ) {
            let plan = rebalance(&table, &on, &options(partitions, standbys)).unwrap();
            check_balanced(&plan.table, &on, partitions, standbys)?;
            prop_assert_eq!(&rebalance(&table, &on, &options(partitions, standbys)).unwrap(), &plan);
            let again = rebalance(&plan.table, &on, &options(partitions, standbys)).unwrap();
            prop_assert!(again.moves.is_empty(), "{:#?}", again.moves);
            // The moves are exactly the difference between the two tables.
            for m in &plan.moves {
                let now = &plan.table.partitions[&m.partition];
                match (m.role, &m.to) {
                    (Role::Leader, to) => prop_assert_eq!(&now.leader, to),
                    (_, Some(to)) => prop_assert!(now.followers.contains(to)),
                    (_, None) => {}
                }
            }
        }

        /// No balanced placement copies fewer partitions' data.
        #[test]
        fn rebalancing_copies_no_more_than_it_must(
            (partitions, standbys, table, on) in (1u16..6, 0usize..3).prop_flat_map(|(partitions, standbys)| (
                Just(partitions),
                Just(standbys),
                any_table(partitions),
                proptest::collection::btree_set((0usize..6).prop_map(|n| node(&format!("n{n}"))), 1..5),
            )),
        ) {
            let plan = rebalance(&table, &on, &options(partitions, standbys)).unwrap();
            let on: Vec<NodeId> = on.into_iter().collect();
            let copies = plan.moves.iter().filter(|m| m.copies).count();
            prop_assert_eq!(copies, fewest_copies(&table, &on, partitions, standbys), "{:#?}", plan.moves);
        }
    }
}
