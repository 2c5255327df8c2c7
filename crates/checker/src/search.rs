//! The linearizability search over one key's operations: Wing & Gong's search with Lowe's
//! memoisation, as Porcupine implements it, over the symbolic states of [`crate::model`].
//!
//! The operations' invocations and completions form a list of events in time order (at equal
//! times invocations first, since intervals are closed). An operation can be placed next if its
//! invocation comes before the first completion still in the list: it cannot be placed after an
//! operation that had completed before it was invoked. Placing it removes its events from the
//! list (in O(1), as dancing links do) and pushes a node on an explicit stack; when no candidate
//! of a node leads anywhere, the search pops it, puts its operation's events back and tries the
//! parent's next candidate. Each (set of placed operations, set of states) reached is cached in
//! a hash set, the set of operations as a bitset, and a step that reaches one already seen is not
//! explored again (Lowe's memoisation).
//!
//! The model is nondeterministic (an insert-if-absent whose outcome is unknown may or may not have
//! inserted), so the search runs over sets of states, as Porcupine does for nondeterministic
//! models: a step maps every state of the set to its successors, and fails if none has any.
//!
//! Writes of unknown outcome have no completion event: they never force anything to come after
//! them, and they need not be placed at all (a write placed after every answered operation changes
//! nothing that was observed, which is the same as never taking effect). The search is done as
//! soon as every answered operation is placed. A point reached with the same answered operations
//! and states as an earlier one, plus some unknown writes, is not explored either: whatever
//! follows it could follow the earlier one.
//!
//! Plain depth-first search in invocation order is hopeless with many concurrent clients on one
//! key: a write placed too early is found out many places later, and everything in between is
//! tried again. So the search adds (none of which changes what it decides):
//!
//! - an order of candidates that follows how linearizations usually look (see [`Search::node`]);
//! - a read that fits now is placed without trying anything else first where that provably
//!   loses nothing (see [`Search::placing_now_is_safe`]);
//! - two exact cuts: a value that gets still to place returned cannot be overwritten or expire
//!   while no other write of it remains, and a write of such a value cannot be placed while an
//!   operation that changes the key and must come before one of those gets is still to place;
//! - values that no get still to place returned are merged into one, so that the orders of writes
//!   nobody reads any more lead to the same cached states.
//!
//! When no order exists, the search reports the longest partial order it found (by answered
//! operations placed) and the answered operation that could not be placed after it, as
//! Porcupine's partial linearizations do. The cuts stop a failing search early, at a point that
//! is hard to read, so a second, bounded search without them looks for that explanation.
//!
//! This module knows nothing of Cairn's wire protocol or processes.

use crate::model::{
    self, Action, Contents, KeyOperation, Lifetime, ModelState, NEVER, Observation, ValueId,
};
use std::collections::HashMap;
use std::time::Instant;

/// How many steps pass between two looks at the clock.
const STEPS_BETWEEN_DEADLINE_CHECKS: u32 = 1024;

/// What the search found for one key.
#[derive(Debug)]
pub(crate) enum SearchResult {
    /// Some order of the operations explains every answer.
    Linearizable,
    /// None does.
    NotLinearizable(Box<Failure>),
    /// The deadline passed first.
    GaveUp { states_explored: usize },
}

/// The furthest the search got on a key that is not linearizable.
#[derive(Debug)]
pub(crate) struct Failure {
    /// The operations placed, in order (indices into the key's operations).
    pub order: Vec<usize>,
    /// What the key could hold after them.
    pub states: Vec<ModelState>,
    /// The answered operation that could not be placed next, although it had to be: it is the
    /// first completion still to come.
    pub blocked: usize,
    /// How many answered operations the order holds, of how many.
    pub placed_required: usize,
    pub required: usize,
}

/// How many points the second search, which only looks for a clearer explanation of a failure
/// already found, may explore.
const EXPLANATION_STATES_MAX: usize = 200_000;

/// Searches for an order of `operations` that explains them all, giving up at `deadline`.
///
/// When there is none, a second search without the reductions that cut hopeless orders short
/// (see [`Search::step_all`]) looks for a longer partial order to show, which is easier to read:
/// it reaches the operation that does not fit instead of stopping where the reductions saw it
/// coming. It is bounded, and if it gives up the first search's partial order is shown.
pub(crate) fn search(
    operations: &[KeyOperation],
    expiry_uncertainty_ms: u64,
    deadline: Option<Instant>,
) -> SearchResult {
    let decided = run(operations, expiry_uncertainty_ms, deadline, None, true);
    let SearchResult::NotLinearizable(failure) = decided else {
        return decided;
    };
    match run(
        operations,
        expiry_uncertainty_ms,
        deadline,
        Some(EXPLANATION_STATES_MAX),
        false,
    ) {
        SearchResult::NotLinearizable(explained) => SearchResult::NotLinearizable(explained),
        // Both searches are exact, so the second cannot find an order; if it gave up, the
        // first one's explanation stands.
        SearchResult::Linearizable | SearchResult::GaveUp { .. } => {
            SearchResult::NotLinearizable(failure)
        }
    }
}

/// One search; `lookahead` enables the reductions of [`Search::step_all`] and
/// [`Search::overwritten_before_read`].
fn run(
    operations: &[KeyOperation],
    expiry_uncertainty_ms: u64,
    deadline: Option<Instant>,
    states_max: Option<usize>,
    lookahead: bool,
) -> SearchResult {
    let required = operations
        .iter()
        .filter(|operation| operation.required)
        .count();
    if required == 0 {
        return SearchResult::Linearizable;
    }
    let mut search = Search {
        operations,
        expiry_uncertainty_ms,
        events: Events::new(operations),
        unplaced: Unplaced::new(operations),
        lookahead,
        readers: Readers::new(operations),
        has_ttl_writes: operations.iter().any(|operation| {
            operation
                .written_value()
                .is_some_and(|(_, ttl_ms)| ttl_ms.is_some())
        }),
    };
    let mut placed = Bitset::new(operations.len());
    let mut optional = Bitset::new(operations.len());
    for (index, operation) in operations.iter().enumerate() {
        if !operation.required {
            optional.set(index);
        }
    }
    let mut cache = Cache::default();
    let mut required_left = required;
    let root_states = vec![ModelState::INITIAL];
    let mut best = Failure {
        order: Vec::new(),
        states: root_states.clone(),
        blocked: search.events.first_completing_operation().unwrap_or(0),
        placed_required: 0,
        required,
    };
    let mut stack = vec![search.node(None, &root_states)];
    let mut steps_until_deadline_check = STEPS_BETWEEN_DEADLINE_CHECKS;
    loop {
        steps_until_deadline_check -= 1;
        if steps_until_deadline_check == 0 {
            steps_until_deadline_check = STEPS_BETWEEN_DEADLINE_CHECKS;
            if deadline.is_some_and(|deadline| Instant::now() >= deadline)
                || states_max.is_some_and(|states_max| cache.len() >= states_max)
            {
                return SearchResult::GaveUp {
                    states_explored: cache.len(),
                };
            }
        }
        let Some(node) = stack.last_mut() else {
            return SearchResult::NotLinearizable(Box::new(best));
        };
        let Some((index, next_states)) = node.candidates.pop() else {
            // Every candidate of this node failed: take back the operation that led here.
            if let Some(index) = node.reached_by {
                placed.clear(index);
                search.unplace(index);
                if operations[index].required {
                    required_left += 1;
                }
            }
            stack.pop();
            continue;
        };
        placed.set(index);
        if !cache.insert_unless_covered(&placed, &optional, &next_states) {
            placed.clear(index);
            continue;
        }
        search.place(index);
        if operations[index].required {
            required_left -= 1;
        }
        if required_left == 0 {
            return SearchResult::Linearizable;
        }
        let placed_required = required - required_left;
        if placed_required > best.placed_required {
            best = Failure {
                order: stack
                    .iter()
                    .filter_map(|node| node.reached_by)
                    .chain(std::iter::once(index))
                    .collect(),
                states: next_states.clone(),
                blocked: search.events.first_completing_operation().unwrap_or(index),
                placed_required,
                required,
            };
        }
        let node = search.node(Some(index), &next_states);
        stack.push(node);
    }
}

/// The operations and what the search knows of those not placed yet.
struct Search<'a> {
    operations: &'a [KeyOperation],
    expiry_uncertainty_ms: u64,
    events: Events,
    unplaced: Unplaced,
    /// Whether to cut hopeless orders short and merge values nobody reads any more.
    lookahead: bool,
    readers: Readers,
    /// Whether any write of the key has a TTL.
    has_ttl_writes: bool,
}

impl Search<'_> {
    fn place(&mut self, index: usize) {
        let operation = &self.operations[index];
        self.events.lift(index, operation.required);
        self.unplaced.place(operation);
    }

    fn unplace(&mut self, index: usize) {
        let operation = &self.operations[index];
        self.events.unlift(index, operation.required);
        self.unplaced.unplace(operation);
    }

    /// The node reached with `states`, its candidates computed and ordered.
    ///
    /// The order only decides how fast an order is found, never whether one is (every candidate
    /// is tried before the node is left), except that a read placed at once where
    /// [`Search::placing_now_is_safe`] allows is the node's only candidate. The order follows how
    /// a linearization usually looks, where the blocking operation is the one whose completion
    /// comes first (it must come before everything invoked after that):
    ///
    /// 1. reads that fit now (a get, an exists, an insert-if-absent that answered false), by
    ///    completion: they change nothing, and later they may no longer fit;
    /// 2. if the blocking operation is a read that does not fit, the writes after which it does
    ///    (the put of the value it returned): answered ones whose effect no read invoked later
    ///    can see first, then other answered ones, then writes of unknown outcome;
    /// 3. if it is a write: first the other answered writes whose effect no read invoked later
    ///    can see (their value is best overwritten at once, and the blocking write comes before
    ///    every later read), then the blocking write;
    /// 4. the other answered writes, by completion; then the other writes of unknown outcome, by
    ///    invocation, which are only placed where something needs them.
    fn node(&self, reached_by: Option<usize>, states: &[ModelState]) -> Node {
        let operations = self.operations;
        let latest_point = self.events.first_completion();
        let blocking = self.events.first_completing_operation();
        let blocking_is_write = blocking.is_some_and(|blocking| !operations[blocking].reads_only());
        let blocking_fits_after = |states_after: &[ModelState]| -> bool {
            let Some(blocking) = blocking else {
                return false;
            };
            let mut next = Vec::new();
            states_after.iter().any(|state| {
                next.clear();
                model::step(
                    state,
                    &operations[blocking],
                    latest_point,
                    self.expiry_uncertainty_ms,
                    &mut next,
                );
                !next.is_empty()
            })
        };
        // Whether a write's effect is still to be seen by reads not invoked yet: such a write is
        // best placed late, after the writes whose effect nobody will see any more.
        let seen_later = |operation: &KeyOperation| -> bool {
            match operation.action {
                Action::Delete => self.readers.absent_after(latest_point),
                _ => operation
                    .written_value()
                    .is_some_and(|(value, _)| self.readers.value_after(value, latest_point)),
            }
        };
        // (rank, time, index, states after)
        let mut ranked: Vec<(u8, u64, usize, Vec<ModelState>)> = Vec::new();
        let changers = self.first_changers();
        for index in self.events.candidates(latest_point) {
            let operation = &operations[index];
            if self.lookahead && self.overwritten_before_read(index, &changers) {
                continue;
            }
            let next_states = self.step_all(states, operation, latest_point);
            if next_states.is_empty() {
                continue;
            }
            if operation.reads_only() && self.placing_now_is_safe(states, operation, latest_point) {
                return Node {
                    reached_by,
                    candidates: vec![(index, next_states)],
                };
            }
            let is_blocking = Some(index) == blocking;
            let rank = if operation.reads_only() {
                0
            } else if blocking_is_write {
                if is_blocking {
                    2
                } else if operation.required && !seen_later(operation) {
                    1
                } else if operation.required {
                    4
                } else {
                    5
                }
            } else if blocking_fits_after(&next_states) {
                match (operation.required, seen_later(operation)) {
                    (true, false) => 1,
                    (true, true) => 2,
                    (false, _) => 3,
                }
            } else if operation.required {
                4
            } else {
                5
            };
            let time = if operation.required {
                operation.completed
            } else {
                operation.invoked
            };
            ranked.push((rank, time, index, next_states));
        }
        // Tried from the end: the best candidate goes last.
        ranked
            .sort_unstable_by_key(|&(rank, time, index, _)| std::cmp::Reverse((rank, time, index)));
        Node {
            reached_by,
            candidates: ranked
                .into_iter()
                .map(|(_, _, index, next_states)| (index, next_states))
                .collect(),
        }
    }

    /// Whether the read `operation` (which changes nothing) can be placed next without trying
    /// anything else first: if any order explains the rest from here, one that starts with it
    /// does. That holds when it fits every state and no expiry is involved: move it to the front
    /// of an order that works, and every other operation sees the same contents; their points
    /// may have to move up to its invocation, still within their intervals (it is a candidate, so
    /// invoked before every completion still to come), which only matters to expiries. So: no
    /// state's value expires, and either its invocation does not move the current point or no
    /// write of the key has a TTL.
    fn placing_now_is_safe(
        &self,
        states: &[ModelState],
        operation: &KeyOperation,
        latest_point: u64,
    ) -> bool {
        let mut next = Vec::new();
        states.iter().all(|state| {
            let no_expiry = matches!(
                state.contents,
                Contents::Absent
                    | Contents::Present {
                        lifetime: Lifetime::Forever,
                        ..
                    }
            );
            let time_stays = operation.invoked <= state.now || !self.has_ttl_writes;
            next.clear();
            model::step(
                state,
                operation,
                latest_point,
                self.expiry_uncertainty_ms,
                &mut next,
            );
            no_expiry && time_stays && !next.is_empty()
        })
    }

    /// The states after placing `operation` from any of `states`, normalized.
    ///
    /// Two exact reductions apply. A state whose value some get still to place returned, and
    /// that no operation still to place can write again, cannot be left for a state without it:
    /// that get could never be placed. And every value that no get still to place returned is
    /// replaced by [`model::UNREAD`], so that the orders of writes nobody reads lead to the same
    /// states.
    fn step_all(
        &self,
        states: &[ModelState],
        operation: &KeyOperation,
        latest_point: u64,
    ) -> Vec<ModelState> {
        let read_now = match operation.action {
            Action::Observe(Observation::Present(value)) => Some(value),
            _ => None,
        };
        let written_now = operation.written_value().map(|(value, _)| value);
        let reads_left =
            |value: ValueId| self.unplaced.reads(value) - u32::from(read_now == Some(value));
        let writers_left =
            |value: ValueId| self.unplaced.writers(value) - u32::from(written_now == Some(value));
        let mut next: Vec<ModelState> = Vec::new();
        let mut successors: Vec<ModelState> = Vec::new();
        for state in states {
            successors.clear();
            model::step(
                state,
                operation,
                latest_point,
                self.expiry_uncertainty_ms,
                &mut successors,
            );
            let still_needed = match state.contents {
                Contents::Present { value, .. } if self.lookahead && value != model::UNREAD => {
                    (reads_left(value) > 0 && writers_left(value) == 0).then_some(value)
                }
                _ => None,
            };
            next.extend(successors.iter().copied().filter(|successor| {
                still_needed.is_none_or(|needed| {
                    matches!(successor.contents, Contents::Present { value, .. } if value == needed)
                })
            }));
        }
        for state in &mut next {
            if let Contents::Present { value, .. } = &mut state.contents
                && self.lookahead
                && *value != model::UNREAD
                && reads_left(*value) == 0
            {
                *value = model::UNREAD;
            }
        }
        model::normalize(&mut next);
        next
    }

    /// Whether placing `operation` next, writing a value that gets still to place returned, is
    /// hopeless: one of those gets was invoked after an operation still to place that changes
    /// the key completed, so that operation would come between the write and the get (no other
    /// operation writes the value, or this does not apply). Writes of unknown outcome are not
    /// counted as changing the key: they may never take effect.
    fn overwritten_before_read(&self, index: usize, changers: &[(usize, u64); 2]) -> bool {
        let operation = &self.operations[index];
        let Some((value, _)) = operation.written_value() else {
            return false;
        };
        if self.unplaced.writers(value) != 1 {
            return false;
        }
        let Some(&(_, completed)) = changers.iter().find(|&&(changer, _)| changer != index) else {
            return false;
        };
        self.readers.value_after(value, completed)
    }

    /// The two answered operations still to place that change the key (puts, deletes,
    /// insert-if-absent that answered true) and complete first, with their completions;
    /// `(usize::MAX, NEVER)` where there are fewer.
    fn first_changers(&self) -> [(usize, u64); 2] {
        let mut found = [(usize::MAX, NEVER); 2];
        let mut count = 0;
        for (index, completed) in self.events.completions() {
            let changes = match self.operations[index].action {
                Action::Write { .. } | Action::Delete => true,
                Action::InsertIfAbsent { inserted, .. } => inserted == Some(true),
                Action::Observe(_) => false,
            };
            if changes {
                found[count] = (index, completed);
                count += 1;
                if count == found.len() {
                    break;
                }
            }
        }
        found
    }
}

/// By value: how many gets not placed yet returned it, and how many operations not placed yet
/// may write it.
struct Unplaced {
    reads: Vec<u32>,
    writers: Vec<u32>,
}

impl Unplaced {
    fn new(operations: &[KeyOperation]) -> Self {
        let mut unplaced = Unplaced {
            reads: Vec::new(),
            writers: Vec::new(),
        };
        for operation in operations {
            unplaced.unplace(operation);
        }
        unplaced
    }

    fn reads(&self, value: ValueId) -> u32 {
        self.reads.get(value as usize).copied().unwrap_or(0)
    }

    fn writers(&self, value: ValueId) -> u32 {
        self.writers.get(value as usize).copied().unwrap_or(0)
    }

    fn place(&mut self, operation: &KeyOperation) {
        if let Action::Observe(Observation::Present(value)) = operation.action {
            self.reads[value as usize] -= 1;
        }
        if let Some((value, _)) = operation.written_value() {
            self.writers[value as usize] -= 1;
        }
    }

    fn unplace(&mut self, operation: &KeyOperation) {
        let count = |counts: &mut Vec<u32>, value: ValueId| {
            let value = value as usize;
            if counts.len() <= value {
                counts.resize(value + 1, 0);
            }
            counts[value] += 1;
        };
        if let Action::Observe(Observation::Present(value)) = operation.action {
            count(&mut self.reads, value);
        }
        if let Some((value, _)) = operation.written_value() {
            count(&mut self.writers, value);
        }
    }
}

/// When the reads of each value, and the reads that saw the key absent, were invoked.
struct Readers {
    /// By value: the invocations of the gets that returned it, in order.
    of_value: Vec<Vec<u64>>,
    /// The invocations of the reads that saw the key absent, in order.
    of_absence: Vec<u64>,
}

impl Readers {
    fn new(operations: &[KeyOperation]) -> Self {
        let mut readers = Readers {
            of_value: Vec::new(),
            of_absence: Vec::new(),
        };
        for operation in operations.iter().filter(|operation| operation.required) {
            match operation.action {
                Action::Observe(Observation::Present(value)) => {
                    let value = value as usize;
                    if readers.of_value.len() <= value {
                        readers.of_value.resize_with(value + 1, Vec::new);
                    }
                    readers.of_value[value].push(operation.invoked);
                }
                Action::Observe(Observation::Absent)
                | Action::InsertIfAbsent {
                    inserted: Some(true),
                    ..
                } => readers.of_absence.push(operation.invoked),
                _ => {}
            }
        }
        for invocations in &mut readers.of_value {
            invocations.sort_unstable();
        }
        readers.of_absence.sort_unstable();
        readers
    }

    /// Whether a get of `value` was invoked after `time`.
    fn value_after(&self, value: ValueId, time: u64) -> bool {
        self.of_value
            .get(value as usize)
            .and_then(|invocations| invocations.last())
            .is_some_and(|&last| last > time)
    }

    /// Whether a read that saw the key absent was invoked after `time`.
    fn absent_after(&self, time: u64) -> bool {
        self.of_absence.last().is_some_and(|&last| last > time)
    }
}

/// A point of the search: the operations placed so far (those of the nodes below it on the
/// stack) and the candidates for the next place still to try.
#[derive(Debug)]
struct Node {
    /// The operation placed last, to take back when leaving the node.
    reached_by: Option<usize>,
    /// The candidates still to try, each with the states it leads to, the next one last.
    candidates: Vec<(usize, Vec<ModelState>)>,
}

/// The (placed operations, states) reached so far. A point whose states were reached before
/// with the same answered operations placed and a subset of its writes of unknown outcome needs
/// no exploring: whatever follows it could follow the earlier one (the extra unknown writes can
/// always be left out there), which has been or is being explored.
/// The answered operations placed (a bitset) and the states reached.
type CacheKey = (Box<[u64]>, Box<[ModelState]>);

#[derive(Debug, Default)]
struct Cache {
    /// By (answered operations placed, states): the sets of unknown writes placed with them.
    reached: HashMap<CacheKey, Vec<Box<[u64]>>>,
    len: usize,
}

impl Cache {
    fn len(&self) -> usize {
        self.len
    }

    /// Records the point unless an earlier one covers it; whether it was recorded.
    fn insert_unless_covered(
        &mut self,
        placed: &Bitset,
        optional: &Bitset,
        states: &[ModelState],
    ) -> bool {
        let required_part: Box<[u64]> = placed
            .words
            .iter()
            .zip(&optional.words)
            .map(|(placed, optional)| placed & !optional)
            .collect();
        let optional_part: Box<[u64]> = placed
            .words
            .iter()
            .zip(&optional.words)
            .map(|(placed, optional)| placed & optional)
            .collect();
        let subsets = self
            .reached
            .entry((required_part, states.into()))
            .or_default();
        let covered = subsets.iter().any(|earlier| {
            earlier
                .iter()
                .zip(optional_part.iter())
                .all(|(earlier, now)| earlier & !now == 0)
        });
        if covered {
            return false;
        }
        subsets.push(optional_part);
        self.len += 1;
        true
    }
}

/// A fixed-size set of operation indices.
#[derive(Debug)]
struct Bitset {
    words: Vec<u64>,
}

impl Bitset {
    fn new(bits: usize) -> Self {
        Bitset {
            words: vec![0; bits.div_ceil(64)],
        }
    }

    fn set(&mut self, bit: usize) {
        self.words[bit / 64] |= 1 << (bit % 64);
    }

    fn clear(&mut self, bit: usize) {
        self.words[bit / 64] &= !(1 << (bit % 64));
    }
}

const NIL: u32 = u32::MAX;
/// The list of invocations and completions of answered operations, in time order.
const REQUIRED_HEAD: u32 = 0;
/// The list of invocations of writes of unknown outcome, in time order.
const OPTIONAL_HEAD: u32 = 1;

/// Two doubly linked lists of events over arrays. Entry `2 + i` is the invocation of operation
/// `i`; entry `2 + n + i` its completion (answered operations only).
#[derive(Debug)]
struct Events {
    operation_count: usize,
    next: Vec<u32>,
    previous: Vec<u32>,
    time: Vec<u64>,
}

impl Events {
    fn new(operations: &[KeyOperation]) -> Self {
        let count = operations.len();
        let entries = 2 + 2 * count;
        assert!(
            entries < NIL as usize,
            "too many operations on one key for the event list"
        );
        let mut events = Events {
            operation_count: count,
            next: vec![NIL; entries],
            previous: vec![NIL; entries],
            time: vec![0; entries],
        };
        // (time, completion after invocation at equal times, entry)
        let mut required: Vec<(u64, bool, u32)> = Vec::new();
        let mut optional: Vec<(u64, u32)> = Vec::new();
        for (index, operation) in operations.iter().enumerate() {
            let invocation = events.invocation_entry(index);
            events.time[invocation as usize] = operation.invoked;
            if operation.required {
                let completion = events.completion_entry(index);
                events.time[completion as usize] = operation.completed;
                required.push((operation.invoked, false, invocation));
                required.push((operation.completed, true, completion));
            } else {
                optional.push((operation.invoked, invocation));
            }
        }
        required.sort_unstable();
        optional.sort_unstable();
        events.link(REQUIRED_HEAD, required.iter().map(|&(_, _, entry)| entry));
        events.link(OPTIONAL_HEAD, optional.iter().map(|&(_, entry)| entry));
        events
    }

    fn link(&mut self, head: u32, entries: impl Iterator<Item = u32>) {
        let mut last = head;
        for entry in entries {
            self.next[last as usize] = entry;
            self.previous[entry as usize] = last;
            last = entry;
        }
    }

    fn invocation_entry(&self, operation: usize) -> u32 {
        (2 + operation) as u32
    }

    fn completion_entry(&self, operation: usize) -> u32 {
        (2 + self.operation_count + operation) as u32
    }

    fn is_completion(&self, entry: u32) -> bool {
        entry as usize >= 2 + self.operation_count
    }

    fn operation_of(&self, entry: u32) -> usize {
        let index = entry as usize - 2;
        if index >= self.operation_count {
            index - self.operation_count
        } else {
            index
        }
    }

    /// The first completion still in the list: no operation placed next can have its point later.
    fn first_completion(&self) -> u64 {
        let mut entry = self.next[REQUIRED_HEAD as usize];
        while entry != NIL {
            if self.is_completion(entry) {
                return self.time[entry as usize];
            }
            entry = self.next[entry as usize];
        }
        NEVER
    }

    /// The operation of the first completion still in the list.
    fn first_completing_operation(&self) -> Option<usize> {
        let mut entry = self.next[REQUIRED_HEAD as usize];
        while entry != NIL {
            if self.is_completion(entry) {
                return Some(self.operation_of(entry));
            }
            entry = self.next[entry as usize];
        }
        None
    }

    /// The completions still in the list, in order: (operation, time).
    fn completions(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        let mut entry = self.next[REQUIRED_HEAD as usize];
        std::iter::from_fn(move || {
            while entry != NIL {
                let current = entry;
                entry = self.next[entry as usize];
                if self.is_completion(current) {
                    return Some((self.operation_of(current), self.time[current as usize]));
                }
            }
            None
        })
    }

    /// The operations that can be placed next: the answered ones invoked before the first
    /// completion still in the list, and the writes of unknown outcome invoked no later than it.
    fn candidates(&self, latest_point: u64) -> Vec<usize> {
        let mut candidates = Vec::new();
        let mut entry = self.next[REQUIRED_HEAD as usize];
        while entry != NIL && !self.is_completion(entry) {
            candidates.push(self.operation_of(entry));
            entry = self.next[entry as usize];
        }
        let mut entry = self.next[OPTIONAL_HEAD as usize];
        while entry != NIL && self.time[entry as usize] <= latest_point {
            candidates.push(self.operation_of(entry));
            entry = self.next[entry as usize];
        }
        candidates
    }

    fn remove(&mut self, entry: u32) {
        let previous = self.previous[entry as usize];
        let next = self.next[entry as usize];
        self.next[previous as usize] = next;
        if next != NIL {
            self.previous[next as usize] = previous;
        }
    }

    /// Puts back an entry removed last, in reverse order of removal (its own links still say
    /// where it was).
    fn restore(&mut self, entry: u32) {
        let previous = self.previous[entry as usize];
        let next = self.next[entry as usize];
        self.next[previous as usize] = entry;
        if next != NIL {
            self.previous[next as usize] = entry;
        }
    }

    fn lift(&mut self, operation: usize, required: bool) {
        self.remove(self.invocation_entry(operation));
        if required {
            self.remove(self.completion_entry(operation));
        }
    }

    fn unlift(&mut self, operation: usize, required: bool) {
        if required {
            self.restore(self.completion_entry(operation));
        }
        self.restore(self.invocation_entry(operation));
    }
}
