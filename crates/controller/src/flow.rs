//! A minimum-cost flow, for [`crate::balance`]: successive shortest paths, each found by
//! Bellman–Ford over the residual graph (a queue of the vertices whose distance fell), so that
//! negative costs are allowed as long as the graph given has no negative cycle.
//!
//! The graphs it solves are small (a source, the partitions, the nodes, a sink) and every unit of
//! flow is one partition's role on one node, so a few thousand augmentations at most. Paths are
//! searched in the order edges were added, so the same graph always gives the same flow.

use std::collections::VecDeque;

/// A directed graph with a capacity and a cost per unit on every edge.
pub(crate) struct MinCostFlow {
    /// Edges leaving each vertex, by index into `edges`.
    adjacency: Vec<Vec<usize>>,
    /// Edge `2k` is the `k`-th edge added, `2k + 1` its residual reverse.
    edges: Vec<Edge>,
}

struct Edge {
    to: usize,
    /// What can still be sent along it.
    capacity: i64,
    cost: i64,
}

/// An edge added by [`MinCostFlow::add_edge`], to read its flow back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EdgeId(usize);

impl MinCostFlow {
    pub(crate) fn new(vertices: usize) -> MinCostFlow {
        MinCostFlow {
            adjacency: vec![Vec::new(); vertices],
            edges: Vec::new(),
        }
    }

    pub(crate) fn add_edge(&mut self, from: usize, to: usize, capacity: i64, cost: i64) -> EdgeId {
        let id = self.edges.len();
        self.edges.push(Edge { to, capacity, cost });
        self.edges.push(Edge {
            to: from,
            capacity: 0,
            cost: -cost,
        });
        self.adjacency[from].push(id);
        self.adjacency[to].push(id + 1);
        EdgeId(id)
    }

    /// What flows along `edge`.
    pub(crate) fn flow(&self, edge: EdgeId) -> i64 {
        self.edges[edge.0 + 1].capacity
    }

    /// Sends up to `limit` units from `source` to `sink` at the least total cost; returns how
    /// many were sent.
    pub(crate) fn run(&mut self, source: usize, sink: usize, limit: i64) -> i64 {
        let vertices = self.adjacency.len();
        let mut sent = 0;
        while sent < limit {
            // Shortest (cheapest) path by residual edges.
            let mut distance = vec![i64::MAX; vertices];
            let mut via: Vec<Option<usize>> = vec![None; vertices];
            let mut queued = vec![false; vertices];
            let mut queue = VecDeque::from([source]);
            distance[source] = 0;
            queued[source] = true;
            while let Some(v) = queue.pop_front() {
                queued[v] = false;
                for &e in &self.adjacency[v] {
                    let edge = &self.edges[e];
                    if edge.capacity > 0 && distance[v] + edge.cost < distance[edge.to] {
                        distance[edge.to] = distance[v] + edge.cost;
                        via[edge.to] = Some(e);
                        if !queued[edge.to] {
                            queued[edge.to] = true;
                            queue.push_back(edge.to);
                        }
                    }
                }
            }
            if distance[sink] == i64::MAX {
                break;
            }
            let mut bottleneck = limit - sent;
            let mut v = sink;
            while let Some(e) = via[v] {
                bottleneck = bottleneck.min(self.edges[e].capacity);
                v = self.edges[e ^ 1].to;
            }
            let mut v = sink;
            while let Some(e) = via[v] {
                self.edges[e].capacity -= bottleneck;
                self.edges[e ^ 1].capacity += bottleneck;
                v = self.edges[e ^ 1].to;
            }
            sent += bottleneck;
        }
        sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_the_cheaper_path_and_then_the_dearer_one() {
        // 0 → 1 → 3 costs 2, 0 → 2 → 3 costs 5; each carries one unit.
        let mut flow = MinCostFlow::new(4);
        let cheap = flow.add_edge(0, 1, 1, 1);
        flow.add_edge(1, 3, 1, 1);
        let dear = flow.add_edge(0, 2, 1, 4);
        flow.add_edge(2, 3, 1, 1);
        assert_eq!(flow.run(0, 3, 1), 1);
        assert_eq!((flow.flow(cheap), flow.flow(dear)), (1, 0));
        assert_eq!(flow.run(0, 3, 5), 1);
        assert_eq!((flow.flow(cheap), flow.flow(dear)), (1, 1));
    }

    #[test]
    fn reroutes_an_earlier_unit_when_that_is_cheaper_overall() {
        // Two sources' units, two sinks' slots: a greedy first choice (0 → a) must be undone so
        // that both units fit.
        let (s, x, y, a, b, t) = (0, 1, 2, 3, 4, 5);
        let mut flow = MinCostFlow::new(6);
        flow.add_edge(s, x, 1, 0);
        flow.add_edge(s, y, 1, 0);
        let xa = flow.add_edge(x, a, 1, 0);
        let xb = flow.add_edge(x, b, 1, 1);
        let ya = flow.add_edge(y, a, 1, 0);
        flow.add_edge(a, t, 1, 0);
        flow.add_edge(b, t, 1, 0);
        assert_eq!(flow.run(s, t, 2), 2);
        assert_eq!((flow.flow(xa), flow.flow(xb), flow.flow(ya)), (0, 1, 1));
    }
}
