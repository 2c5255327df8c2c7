//! Two direct checks on one key that name a violation in the store's own terms, besides the
//! search's "no order explains this": a double insert and a lost write.
//!
//! Each looks for a pattern that no execution explains, so each is sound on its own: it reports
//! nothing that some legal execution could produce. Each is deliberately narrow (the pattern must
//! leave no room for another write, a delete or an expiry to explain it) and leaves every subtler
//! case to the search. Both use the same assumptions as the model (see [`crate::model`]):
//! an operation's point lies in its interval, and a value written with TTL `d` at invocation
//! `invoked` cannot expire before `invoked + d - 2 × tolerance` on the clients' clock.
//!
//! Two operations' points can be ordered `x` before `y` whenever `x.invoked <= y.completed`;
//! an operation `z` can lie between them whenever its interval meets `[x.invoked, y.completed]`.
//!
//! This module knows nothing of Cairn's wire protocol or processes.

use crate::model::{Action, KeyOperation, Observation};

/// Two insert-if-absent that both answered true although the first's value was certainly still
/// there when the second looked: indices into the key's operations (first invoked first).
pub(crate) fn find_double_insert(
    operations: &[KeyOperation],
    expiry_uncertainty_ms: u64,
) -> Option<(usize, usize)> {
    let mut inserts: Vec<usize> = (0..operations.len())
        .filter(|&index| {
            matches!(
                operations[index].action,
                Action::InsertIfAbsent {
                    inserted: Some(true),
                    ..
                }
            )
        })
        .collect();
    if inserts.len() < 2 {
        return None;
    }
    inserts.sort_by_key(|&index| (operations[index].invoked, operations[index].completed));
    // Only a delete, or a put (whose value may expire), can make the key absent again once an
    // insert put its value there: other inserts cannot write over a present value.
    let removers = Intervals::new(
        operations.iter().enumerate().filter_map(|(index, op)| {
            matches!(op.action, Action::Write { .. } | Action::Delete).then_some(index)
        }),
        operations,
    );
    // The reported pair is the one whose second insert completes first.
    let mut by_completion = inserts.clone();
    by_completion.sort_by_key(|&index| (operations[index].completed, operations[index].invoked));
    for &second in &by_completion {
        for &first in &inserts {
            if first == second {
                continue;
            }
            let (first, second) = if operations[first].invoked <= operations[second].invoked {
                (first, second)
            } else {
                (second, first)
            };
            let (a, b) = (&operations[first], &operations[second]);
            let window_start = a.invoked.min(b.invoked);
            let window_end = a.completed.max(b.completed);
            if removers.any_meets(window_start, window_end, None) {
                continue;
            }
            // Whichever went first, its value must still have been live when the other looked.
            let a_first_explains =
                a.invoked <= b.completed && !still_live(a, b, expiry_uncertainty_ms);
            let b_first_explains =
                b.invoked <= a.completed && !still_live(b, a, expiry_uncertainty_ms);
            if !a_first_explains && !b_first_explains {
                return Some((first, second));
            }
        }
    }
    None
}

/// Whether the value `writer` wrote is certainly still live at any point of `reader`: it has no
/// TTL, or the reader completed before the earliest expiry.
fn still_live(writer: &KeyOperation, reader: &KeyOperation, expiry_uncertainty_ms: u64) -> bool {
    match writer.written_value() {
        Some((_, None)) => true,
        Some((_, Some(ttl_ms))) => {
            let earliest_expiry = writer
                .invoked
                .saturating_add(ttl_ms)
                .saturating_sub(expiry_uncertainty_ms);
            reader.completed < earliest_expiry
        }
        None => false,
    }
}

/// An acknowledged write and a later read that does not see its value although nothing could have
/// replaced, removed or expired it in between: indices into the key's operations.
pub(crate) fn find_lost_write(
    operations: &[KeyOperation],
    expiry_uncertainty_ms: u64,
) -> Option<(usize, usize)> {
    // Acknowledged writes, by completion, with the running latest invocation.
    let mut acknowledged: Vec<usize> = (0..operations.len())
        .filter(|&index| {
            let operation = &operations[index];
            operation.required && operation.written_value().is_some()
        })
        .collect();
    if acknowledged.is_empty() {
        return None;
    }
    acknowledged.sort_by_key(|&index| operations[index].completed);
    let mut latest_invoked_so_far: Vec<usize> = Vec::with_capacity(acknowledged.len());
    for &index in &acknowledged {
        let latest = match latest_invoked_so_far.last() {
            Some(&previous) if operations[previous].invoked >= operations[index].invoked => {
                previous
            }
            _ => index,
        };
        latest_invoked_so_far.push(latest);
    }
    // Everything that could change the key: every write but an insert that answered false.
    let writers = Intervals::new(
        operations.iter().enumerate().filter_map(|(index, op)| {
            let changes = match op.action {
                Action::Write { .. } | Action::Delete => true,
                Action::InsertIfAbsent { inserted, .. } => inserted != Some(false),
                Action::Observe(_) => false,
            };
            changes.then_some(index)
        }),
        operations,
    );
    let mut reads: Vec<usize> = (0..operations.len())
        .filter(|&index| operations[index].required)
        .filter(|&index| {
            matches!(
                operations[index].action,
                Action::Observe(Observation::Absent | Observation::Present(_))
            )
        })
        .collect();
    reads.sort_by_key(|&index| (operations[index].invoked, operations[index].completed));
    for read_index in reads {
        let read = &operations[read_index];
        // Of the acknowledged writes completed before the read, only the one invoked last can
        // qualify: any earlier one has it (or another write) inside its window.
        let completed_before =
            acknowledged.partition_point(|&index| operations[index].completed < read.invoked);
        if completed_before == 0 {
            continue;
        }
        let write_index = latest_invoked_so_far[completed_before - 1];
        let write = &operations[write_index];
        let Some((value, _)) = write.written_value() else {
            continue;
        };
        let shows_another = match read.action {
            Action::Observe(Observation::Absent) => true,
            Action::Observe(Observation::Present(seen)) => seen != value,
            _ => false,
        };
        if !shows_another || !still_live(write, read, expiry_uncertainty_ms) {
            continue;
        }
        if writers.any_meets(write.invoked, read.completed, Some(write_index)) {
            continue;
        }
        return Some((write_index, read_index));
    }
    None
}

/// Intervals sorted by start, with the running latest ends, to ask whether any meets a window.
struct Intervals {
    /// (start, end, operation index), by start.
    sorted: Vec<(u64, u64, usize)>,
    /// For each prefix of `sorted`, its latest end and the operation that has it...
    latest_end: Vec<(u64, usize)>,
    /// ...and the latest end of any other operation of the prefix.
    second_latest_end: Vec<Option<u64>>,
}

impl Intervals {
    fn new(indices: impl Iterator<Item = usize>, operations: &[KeyOperation]) -> Self {
        let mut sorted: Vec<(u64, u64, usize)> = indices
            .map(|index| {
                (
                    operations[index].invoked,
                    operations[index].completed,
                    index,
                )
            })
            .collect();
        sorted.sort_unstable();
        let mut latest_end = Vec::with_capacity(sorted.len());
        let mut second_latest_end = Vec::with_capacity(sorted.len());
        let mut latest: Option<(u64, usize)> = None;
        let mut second: Option<u64> = None;
        for &(_, end, index) in &sorted {
            let (new_latest, new_second) = match latest {
                Some((latest_so_far, holder)) if end <= latest_so_far => (
                    (latest_so_far, holder),
                    Some(second.map_or(end, |s| s.max(end))),
                ),
                Some((latest_so_far, _)) => (
                    (end, index),
                    Some(second.map_or(latest_so_far, |s| s.max(latest_so_far))),
                ),
                None => ((end, index), None),
            };
            latest = Some(new_latest);
            second = new_second;
            latest_end.push(new_latest);
            second_latest_end.push(new_second);
        }
        Intervals {
            sorted,
            latest_end,
            second_latest_end,
        }
    }

    /// Whether an interval other than `except`'s meets `[start, end]`.
    fn any_meets(&self, start: u64, end: u64, except: Option<usize>) -> bool {
        let starting_in_time = self.sorted.partition_point(|&(begin, _, _)| begin <= end);
        if starting_in_time == 0 {
            return false;
        }
        let (latest, holder) = self.latest_end[starting_in_time - 1];
        if Some(holder) != except {
            return latest >= start;
        }
        // The latest end is `except`'s own: ask the next latest, if there is one.
        self.second_latest_end[starting_in_time - 1].is_some_and(|second| second >= start)
    }
}
