//! The checker against a brute force on small random histories of one key: both must reach the
//! same verdict, and the direct checks must never report a history the brute force explains.
//!
//! The brute force shares nothing with the checker's search but the assumptions (see the crate's
//! docs): it tries every order of the operations (leaving out any write of unknown outcome), and
//! for each order solves the constraints on the times (every point inside its interval, points
//! non-decreasing, every expiry inside its bounds and on the right side of every read) as a
//! system of difference constraints, by shortest paths. So it tests that the search's symbolic
//! states lose no execution (soundness) and admit no impossible one (precision).

use bytes::Bytes;
use cairn_checker::{Call, CheckOptions, History, Operation, Outcome, Output, Violation, check};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const VALUES: [&str; 3] = ["a", "b", "c"];
const TTLS: [Option<u64>; 5] = [None, Some(0), Some(3), Some(8), Some(15)];

/// A history of one key made by running a random sequential execution (with random expiries
/// within the tolerance), wrapping each operation's point in a random interval, and sometimes
/// corrupting an answer.
fn random_history(random: &mut StdRng, tolerance: u64) -> Vec<Operation> {
    let count = random.random_range(2..=7);
    // Half the histories write a distinct value each time, as tests usually do (and as the
    // search's reductions for values with one writer need), half reuse a few.
    let distinct_values = random.random_bool(0.5);
    let mut points: Vec<u64> = (0..count).map(|_| random.random_range(5..45)).collect();
    points.sort_unstable();
    // The key as the store sees it: value and expiry.
    let mut stored: Option<(Bytes, Option<i64>)> = None;
    let uncertainty = 2 * tolerance as i64;
    let mut operations = Vec::new();
    for (client, &point) in points.iter().enumerate() {
        let invoked_ms = point - random.random_range(0..=5);
        let completed_ms = point + random.random_range(0..=5);
        let live = |stored: &Option<(Bytes, Option<i64>)>| match stored {
            Some((value, expiry)) if expiry.is_none_or(|expiry| (point as i64) < expiry) => {
                Some(value.clone())
            }
            _ => None,
        };
        let value = if distinct_values {
            Bytes::from(format!("v{client}"))
        } else {
            Bytes::from_static(VALUES[random.random_range(0..VALUES.len())].as_bytes())
        };
        let ttl_ms = TTLS[random.random_range(0..TTLS.len())];
        // When the store fixed the expiry: between the invocation and the point.
        let stamp = random.random_range(invoked_ms..=point) as i64;
        let expiry = ttl_ms
            .map(|ttl_ms| stamp + ttl_ms as i64 + random.random_range(-uncertainty..=uncertainty));
        let call = match random.random_range(0..5) {
            0 => Call::Put {
                value: value.clone(),
                ttl_ms,
            },
            1 => Call::Get,
            2 => Call::Delete,
            3 => Call::Exists,
            _ => Call::InsertIfAbsent {
                value: value.clone(),
                ttl_ms,
            },
        };
        let fate = random.random_range(0..20);
        let outcome = if fate == 0 {
            Outcome::Failed
        } else if fate <= 4 && call.is_write() {
            // Unknown: took effect or not.
            if random.random_bool(0.5) {
                match &call {
                    Call::Put { .. } => stored = Some((value, expiry)),
                    Call::Delete => stored = None,
                    _ => {
                        if live(&stored).is_none() {
                            stored = Some((value, expiry));
                        }
                    }
                }
            }
            Outcome::Unknown
        } else {
            let output = match &call {
                Call::Put { .. } => {
                    stored = Some((value, expiry));
                    Output::Done
                }
                Call::Delete => {
                    stored = None;
                    Output::Done
                }
                Call::Get => Output::Value(live(&stored)),
                Call::Exists => Output::Bool(live(&stored).is_some()),
                Call::InsertIfAbsent { .. } => {
                    let inserted = live(&stored).is_none();
                    if inserted {
                        stored = Some((value, expiry));
                    }
                    Output::Bool(inserted)
                }
            };
            Outcome::Ok(output)
        };
        operations.push(Operation {
            client: client as u64,
            key: Bytes::from_static(b"k"),
            call,
            outcome,
            invoked_ms,
            completed_ms,
        });
    }
    if random.random_bool(0.6) {
        let index = random.random_range(0..operations.len());
        if let Outcome::Ok(output) = &mut operations[index].outcome {
            *output = match output {
                Output::Done => Output::Done,
                Output::Bool(answer) => Output::Bool(!*answer),
                Output::Value(_) => {
                    let pick = random.random_range(0..=VALUES.len());
                    Output::Value(if distinct_values {
                        (pick < VALUES.len()).then(|| Bytes::from(format!("v{pick}")))
                    } else {
                        VALUES
                            .get(pick)
                            .map(|value| Bytes::from_static(value.as_bytes()))
                    })
                }
            };
        }
    }
    operations
}

const INFINITY: i64 = i64::MAX / 4;

/// Shortest paths between the times, kept closed: `distance[i][j]` bounds `x_j - x_i`.
#[derive(Clone)]
struct Constraints {
    size: usize,
    distance: Vec<i64>,
}

impl Constraints {
    fn new(size: usize) -> Self {
        let mut distance = vec![INFINITY; size * size];
        for variable in 0..size {
            distance[variable * size + variable] = 0;
        }
        Constraints { size, distance }
    }

    /// Adds `x_to - x_from <= bound`; false if that makes the system infeasible.
    fn add(&mut self, from: usize, to: usize, bound: i64) -> bool {
        let size = self.size;
        if self.distance[to * size + from] < INFINITY && self.distance[to * size + from] + bound < 0
        {
            return false;
        }
        for i in 0..size {
            let to_from = self.distance[i * size + from];
            if to_from >= INFINITY {
                continue;
            }
            for j in 0..size {
                let from_to = self.distance[to * size + j];
                if from_to >= INFINITY {
                    continue;
                }
                let through = to_from + bound + from_to;
                if through < self.distance[i * size + j] {
                    self.distance[i * size + j] = through;
                }
            }
        }
        true
    }
}

/// A key operation as the brute force sees it.
struct Step {
    invoked: i64,
    completed: Option<i64>,
    call: Call,
    /// The answer, if there was one.
    output: Option<Output>,
}

/// What the key holds: the operation that wrote it, its value, and whether it expires.
type Held = Option<(usize, Bytes, bool)>;

struct BruteForce {
    steps: Vec<Step>,
    uncertainty: i64,
}

impl BruteForce {
    fn new(operations: &[Operation], tolerance: u64) -> Self {
        let steps = operations
            .iter()
            .filter_map(|operation| match &operation.outcome {
                Outcome::Failed => None,
                Outcome::Unknown if !operation.call.is_write() => None,
                Outcome::Unknown => Some(Step {
                    invoked: operation.invoked_ms as i64,
                    completed: None,
                    call: operation.call.clone(),
                    output: None,
                }),
                Outcome::Ok(output) => Some(Step {
                    invoked: operation.invoked_ms as i64,
                    completed: Some(operation.completed_ms as i64),
                    call: operation.call.clone(),
                    output: Some(output.clone()),
                }),
            })
            .collect();
        BruteForce {
            steps,
            uncertainty: 2 * tolerance as i64,
        }
    }

    fn point(&self, index: usize) -> usize {
        1 + index
    }

    fn expiry(&self, index: usize) -> usize {
        1 + self.steps.len() + index
    }

    fn explainable(&self) -> bool {
        let constraints = Constraints::new(1 + 2 * self.steps.len());
        let required = self
            .steps
            .iter()
            .filter(|step| step.completed.is_some())
            .count();
        self.search(
            &mut vec![false; self.steps.len()],
            None,
            None,
            required,
            &constraints,
        )
    }

    fn search(
        &self,
        placed: &mut Vec<bool>,
        last: Option<usize>,
        held: Held,
        required_left: usize,
        constraints: &Constraints,
    ) -> bool {
        if required_left == 0 {
            return true;
        }
        for index in 0..self.steps.len() {
            if placed[index] {
                continue;
            }
            let step = &self.steps[index];
            let point = self.point(index);
            let mut timed = constraints.clone();
            let mut feasible = timed.add(point, 0, -step.invoked);
            if let Some(completed) = step.completed {
                feasible &= timed.add(0, point, completed);
            }
            if let Some(last) = last {
                feasible &= timed.add(point, self.point(last), 0);
            }
            if !feasible {
                continue;
            }
            placed[index] = true;
            let left = required_left - usize::from(step.completed.is_some());
            for (next_constraints, next_held) in self.branches(index, &held, &timed) {
                if self.search(placed, Some(index), next_held, left, &next_constraints) {
                    return true;
                }
            }
            placed[index] = false;
        }
        false
    }

    /// Every way `index` can act on `held`, with the constraints each adds.
    fn branches(
        &self,
        index: usize,
        held: &Held,
        constraints: &Constraints,
    ) -> Vec<(Constraints, Held)> {
        let step = &self.steps[index];
        let mut branches = Vec::new();
        let live = |expected: Option<&Bytes>, then: Held, branches: &mut Vec<_>| {
            let Some((writer, value, expires)) = held else {
                return;
            };
            if expected.is_some_and(|expected| expected != value) {
                return;
            }
            let mut constraints = constraints.clone();
            if *expires && !constraints.add(self.expiry(*writer), self.point(index), -1) {
                return;
            }
            branches.push((constraints, then));
        };
        let absent = |then: Held, branches: &mut Vec<_>| {
            let mut constraints = constraints.clone();
            let possible = match held {
                None => true,
                Some((_, _, false)) => false,
                // Expired at the point: the expiry is no later than it.
                Some((writer, _, true)) => {
                    constraints.add(self.point(index), self.expiry(*writer), 0)
                }
            };
            if possible {
                branches.push((constraints, then));
            }
        };
        let write = |value: &Bytes, ttl_ms: &Option<u64>, constraints: &Constraints| {
            let mut constraints = constraints.clone();
            let expiry = self.expiry(index);
            let mut feasible = true;
            if let Some(ttl_ms) = ttl_ms {
                let ttl_ms = *ttl_ms as i64;
                feasible &= constraints.add(expiry, 0, -(step.invoked + ttl_ms - self.uncertainty));
                if let Some(completed) = step.completed {
                    feasible &= constraints.add(0, expiry, completed + ttl_ms + self.uncertainty);
                }
                feasible &= constraints.add(self.point(index), expiry, ttl_ms + self.uncertainty);
            }
            feasible.then(|| (constraints, Some((index, value.clone(), ttl_ms.is_some()))))
        };
        match (&step.call, &step.output) {
            (Call::Put { value, ttl_ms }, _) => branches.extend(write(value, ttl_ms, constraints)),
            (Call::Delete, _) => branches.push((constraints.clone(), None)),
            (Call::Get, Some(Output::Value(None))) | (Call::Exists, Some(Output::Bool(false))) => {
                absent(None, &mut branches)
            }
            (Call::Get, Some(Output::Value(Some(seen)))) => {
                live(Some(seen), held.clone(), &mut branches)
            }
            (Call::Exists, Some(Output::Bool(true))) => live(None, held.clone(), &mut branches),
            (Call::InsertIfAbsent { value, ttl_ms }, output) => {
                if output != &Some(Output::Bool(false)) {
                    let mut inserted = Vec::new();
                    absent(None, &mut inserted);
                    for (constraints, _) in inserted {
                        branches.extend(write(value, ttl_ms, &constraints));
                    }
                }
                if output != &Some(Output::Bool(true)) {
                    live(None, held.clone(), &mut branches);
                }
            }
            (call, output) => panic!("the generator made {call:?} answer {output:?}"),
        }
        branches
    }
}

#[test]
fn the_search_agrees_with_a_brute_force_on_small_random_histories() {
    let mut random = StdRng::seed_from_u64(0x5eed_c4ec);
    let (mut explained, mut unexplained) = (0, 0);
    for case in 0..6000 {
        let tolerance = [0, 1, 3][case % 3];
        let operations = random_history(&mut random, tolerance);
        let expected = BruteForce::new(&operations, tolerance).explainable();
        let options = CheckOptions {
            clock_tolerance_ms: tolerance,
            threads: 1,
            ..CheckOptions::default()
        };
        let history = History::from_operations(operations.clone());
        let report = check(&history, &options);
        let search_rejects = report
            .violations
            .iter()
            .any(|violation| matches!(violation, Violation::NotLinearizable { .. }));
        let direct_rejects = report
            .violations
            .iter()
            .any(|violation| !matches!(violation, Violation::NotLinearizable { .. }));
        assert_eq!(
            !search_rejects, expected,
            "case {case}, tolerance {tolerance}: the search says {report}\nfor {operations:#?}"
        );
        assert!(
            !(direct_rejects && expected),
            "case {case}, tolerance {tolerance}: a direct check rejects an explainable history: \
             {report}\nfor {operations:#?}"
        );
        if expected {
            explained += 1;
        } else {
            unexplained += 1;
        }
    }
    // Both verdicts must be well represented for the comparison to mean anything.
    assert!(
        explained > 2000 && unexplained > 1000,
        "{explained} explained, {unexplained} not"
    );
}
