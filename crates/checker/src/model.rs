//! The sequential specification of one key, with TTLs, as a nondeterministic model over symbolic
//! states; and the translation of a key's recorded operations into the compact form the searches
//! use.
//!
//! ## What a state is
//!
//! A concrete execution of one key is a sequence of operations, each at a linearization point
//! (a time on the clients' clock, non-decreasing along the sequence, inside the operation's
//! interval), and for every value written with a TTL an expiry instant: the value is live at
//! points before it and absent from it on. The search does not fix these times; a
//! [`ModelState`] stands for every assignment of them that explains the operations placed so far,
//! by the only facts about them that the rest of the history can depend on:
//!
//! - `now`: the earliest the last placed operation's point can be. Later points are at least it.
//! - the contents: absent, or a value that lives for ever, or a value whose expiry `E` is known to
//!   lie in `[earliest, latest]`, together with `reach`: the current point is at least
//!   `E - reach`.
//!
//! Over these variables every constraint is a difference constraint (`x - y <= c`), and the
//! state is exactly the projection of all constraints so far onto the current point and `E`
//! (later operations only ever add constraints on later points and on `E`). So the search is
//! exact: a step is possible from a state if and only if some assignment of times explains the
//! whole sequence with it.
//!
//! ## When a value expires
//!
//! A write that carries a TTL `d` has its expiry fixed by the store's clock at some instant `a`
//! while the write is processed: after its invocation and no later than its linearization point
//! (Cairn stamps the log record when the leader appends it, before the record commits), so
//! `a ∈ [invoked, min(completed, point)]`. The store then compares its clock at a read against
//! `a + d` on its clock. The store's clock may differ from the clients' by up to the tolerance
//! `t`, and not by the same amount at the write and at the read (a failover to a node whose clock
//! is behind, a clock stepped by NTP), so on the clients' clock the expiry lies within `2t` of
//! `a + d`:
//!
//! `E ∈ [invoked + d - 2t, min(completed, point) + d + 2t]`
//!
//! The upper bound through the write's own point is where `reach = d + 2t` comes from: a value
//! that lives long must have been written late, and the current point is past the write's.
//! Unknown writes have no completion, so only that bound limits their expiry.
//!
//! Every explanation the real store can produce within these assumptions is one of these
//! assignments, so the checker never reports a history that the store could have produced
//! (it is sound); and every assignment is considered, so it reports every history that no
//! assignment explains (it is as precise as the assumptions allow).
//!
//! Times are whole milliseconds. Working in integers loses nothing: every bound is an integer,
//! and the only strict constraint (a value observed live at point `p` has `E >= p + 1`) appears
//! at most once on any cycle of the constraint graph, where the integer and real systems agree.
//!
//! This module knows nothing of Cairn's wire protocol or processes.

use crate::history::{Call, Operation, Outcome, Output};
use bytes::Bytes;
use std::collections::HashMap;

/// A time too late to matter: the completion of an operation whose outcome is unknown.
pub(crate) const NEVER: u64 = u64::MAX;

/// A value of one key's history, by its index in [`KeyHistory::values`]: states and operations
/// compare small integers instead of byte strings.
pub(crate) type ValueId = u32;

/// Stands, in a state, for any value that no read still to place returns: which one it is can
/// no longer matter, only that it is present.
pub(crate) const UNREAD: ValueId = ValueId::MAX;

/// A key's operations, ready for the searches.
#[derive(Debug)]
pub(crate) struct KeyHistory {
    /// The operations that constrain the key, in the order of the history.
    pub operations: Vec<KeyOperation>,
    /// The distinct values written or read, indexed by [`ValueId`].
    pub values: Vec<Bytes>,
}

/// One operation, as the searches see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyOperation {
    /// Index of the operation in the history.
    pub source: usize,
    /// Earliest its effect can be, on the clients' clock (widened by the clients' skew).
    pub invoked: u64,
    /// Latest its effect can be; [`NEVER`] for a write of unknown outcome.
    pub completed: u64,
    /// Whether it must be linearized (it answered); a write of unknown outcome may be left out.
    pub required: bool,
    pub action: Action,
}

/// What an operation does and what it answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// A put.
    Write { value: ValueId, ttl_ms: Option<u64> },
    /// A delete.
    Delete,
    /// A get or exists, with what it saw.
    Observe(Observation),
    /// An insert-if-absent, with its answer if it gave one.
    InsertIfAbsent {
        value: ValueId,
        ttl_ms: Option<u64>,
        inserted: Option<bool>,
    },
}

/// What a read saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Observation {
    /// The key absent or expired (a get answering nothing, exists answering false).
    Absent,
    /// Some live value (exists answering true).
    PresentAny,
    /// This live value (a get answering it).
    Present(ValueId),
}

impl KeyOperation {
    /// Whether it leaves the key as it found it (a get, an exists, an insert-if-absent that
    /// answered false).
    pub fn reads_only(&self) -> bool {
        match self.action {
            Action::Observe(_) => true,
            Action::InsertIfAbsent { inserted, .. } => inserted == Some(false),
            Action::Write { .. } | Action::Delete => false,
        }
    }

    /// The value this operation writes if it writes one.
    pub fn written_value(&self) -> Option<(ValueId, Option<u64>)> {
        match self.action {
            Action::Write { value, ttl_ms } => Some((value, ttl_ms)),
            Action::InsertIfAbsent {
                value,
                ttl_ms,
                inserted: Some(true) | None,
            } => Some((value, ttl_ms)),
            _ => None,
        }
    }
}

/// How the history's operations were sorted out before checking.
#[derive(Debug, Default)]
pub(crate) struct Partition {
    /// The keys, in the order of their first operation, with their operations.
    pub keys: Vec<(Bytes, KeyHistory)>,
    /// Operations that constrain nothing: failed ones, and reads of unknown outcome.
    pub dropped: usize,
    /// Indices of operations whose answer does not fit their call.
    pub malformed: Vec<usize>,
}

/// Splits a history by key and translates each operation, widening every interval by
/// `client_clock_skew_ms` on both sides.
pub(crate) fn partition(operations: &[Operation], client_clock_skew_ms: u64) -> Partition {
    let mut result = Partition::default();
    let mut key_indices: HashMap<&Bytes, usize> = HashMap::new();
    let mut value_indices: Vec<HashMap<Bytes, ValueId>> = Vec::new();
    for (source, operation) in operations.iter().enumerate() {
        let key_index = *key_indices.entry(&operation.key).or_insert_with(|| {
            result.keys.push((
                operation.key.clone(),
                KeyHistory {
                    operations: Vec::new(),
                    values: Vec::new(),
                },
            ));
            value_indices.push(HashMap::new());
            result.keys.len() - 1
        });
        let history = &mut result.keys[key_index].1;
        let mut intern = |value: &Bytes| -> ValueId {
            *value_indices[key_index]
                .entry(value.clone())
                .or_insert_with(|| {
                    history.values.push(value.clone());
                    ValueId::try_from(history.values.len() - 1)
                        .ok()
                        .filter(|&value| value != UNREAD)
                        .expect("fewer than 2^32 - 1 distinct values on one key")
                })
        };
        let answered = match &operation.outcome {
            Outcome::Failed => {
                result.dropped += 1;
                continue;
            }
            Outcome::Unknown if !operation.call.is_write() => {
                result.dropped += 1;
                continue;
            }
            Outcome::Unknown => None,
            Outcome::Ok(output) => Some(output),
        };
        let action = match (&operation.call, answered) {
            (Call::Put { value, ttl_ms }, None | Some(Output::Done)) => Action::Write {
                value: intern(value),
                ttl_ms: *ttl_ms,
            },
            (Call::Delete, None | Some(Output::Done)) => Action::Delete,
            (Call::Get, Some(Output::Value(None))) | (Call::Exists, Some(Output::Bool(false))) => {
                Action::Observe(Observation::Absent)
            }
            (Call::Get, Some(Output::Value(Some(value)))) => {
                Action::Observe(Observation::Present(intern(value)))
            }
            (Call::Exists, Some(Output::Bool(true))) => Action::Observe(Observation::PresentAny),
            (Call::InsertIfAbsent { value, ttl_ms }, None) => Action::InsertIfAbsent {
                value: intern(value),
                ttl_ms: *ttl_ms,
                inserted: None,
            },
            (Call::InsertIfAbsent { value, ttl_ms }, Some(Output::Bool(inserted))) => {
                Action::InsertIfAbsent {
                    value: intern(value),
                    ttl_ms: *ttl_ms,
                    inserted: Some(*inserted),
                }
            }
            _ => {
                result.malformed.push(source);
                continue;
            }
        };
        let required = answered.is_some();
        // A completion recorded before the invocation is a clock's hiccup: the operation took no
        // time rather than negative time.
        let completed = if required {
            operation
                .completed_ms
                .max(operation.invoked_ms)
                .saturating_add(client_clock_skew_ms)
        } else {
            NEVER
        };
        history.operations.push(KeyOperation {
            source,
            invoked: operation.invoked_ms.saturating_sub(client_clock_skew_ms),
            completed,
            required,
            action,
        });
    }
    result
}

/// What one key holds, symbolically (see the module's docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Contents {
    Absent,
    Present { value: ValueId, lifetime: Lifetime },
}

/// How long a present value lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Lifetime {
    /// Written without a TTL.
    Forever,
    /// Expires at some `E` in `[earliest, latest]`, and the current point is at least
    /// `E - reach`.
    Until {
        earliest: u64,
        latest: u64,
        reach: u64,
    },
}

/// A set of executions of the operations placed so far (see the module's docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ModelState {
    /// The earliest the current point can be.
    pub now: u64,
    pub contents: Contents,
}

impl ModelState {
    /// Before the first operation: the key is absent.
    pub const INITIAL: ModelState = ModelState {
        now: 0,
        contents: Contents::Absent,
    };

    /// Whether every execution `other` stands for is also one `self` stands for, so that
    /// whatever can follow `other` can follow `self` and `other` need not be kept beside it.
    pub fn covers(&self, other: &ModelState) -> bool {
        if self.now > other.now {
            return false;
        }
        match (self.contents, other.contents) {
            (Contents::Absent, Contents::Absent) => true,
            (
                Contents::Present {
                    value: value_here,
                    lifetime: lifetime_here,
                },
                Contents::Present {
                    value: value_there,
                    lifetime: lifetime_there,
                },
            ) if value_here == value_there => match (lifetime_here, lifetime_there) {
                (Lifetime::Forever, Lifetime::Forever) => true,
                (
                    Lifetime::Until {
                        earliest: earliest_here,
                        latest: latest_here,
                        reach: reach_here,
                    },
                    Lifetime::Until {
                        earliest: earliest_there,
                        latest: latest_there,
                        reach: reach_there,
                    },
                ) => {
                    earliest_here <= earliest_there
                        && latest_here >= latest_there
                        && reach_here >= reach_there
                }
                _ => false,
            },
            _ => false,
        }
    }
}

/// Where the point of the operation being placed can be: from the later of its invocation and
/// the current point, to the earlier of its completion and the completion of every operation
/// still to be placed (which must come after it).
#[derive(Debug, Clone, Copy)]
struct Window {
    earliest: u64,
    latest: u64,
}

/// Every state that can follow `state` once `operation` is placed next, its point no later than
/// `latest_point`, pushed onto `next`. Nothing is pushed if the operation cannot be placed.
/// `expiry_uncertainty_ms` is twice the store's clock tolerance.
pub(crate) fn step(
    state: &ModelState,
    operation: &KeyOperation,
    latest_point: u64,
    expiry_uncertainty_ms: u64,
    next: &mut Vec<ModelState>,
) {
    let window = Window {
        earliest: state.now.max(operation.invoked),
        latest: operation.completed.min(latest_point),
    };
    if window.earliest > window.latest {
        return;
    }
    let written = |value: ValueId, ttl_ms: Option<u64>| Contents::Present {
        value,
        lifetime: written_lifetime(operation.invoked, ttl_ms, window, expiry_uncertainty_ms),
    };
    match operation.action {
        Action::Write { value, ttl_ms } => {
            if let Some(now) = overwrite(window) {
                next.push(ModelState {
                    now,
                    contents: written(value, ttl_ms),
                });
            }
        }
        Action::Delete => {
            if let Some(now) = overwrite(window) {
                next.push(ModelState {
                    now,
                    contents: Contents::Absent,
                });
            }
        }
        Action::Observe(Observation::Absent) => {
            if let Some(now) = find_absent(state.contents, window) {
                next.push(ModelState {
                    now,
                    contents: Contents::Absent,
                });
            }
        }
        Action::Observe(Observation::PresentAny) => {
            if let Some(live) = find_live(state.contents, None, window) {
                next.push(live);
            }
        }
        Action::Observe(Observation::Present(value)) => {
            if let Some(live) = find_live(state.contents, Some(value), window) {
                next.push(live);
            }
        }
        Action::InsertIfAbsent {
            value,
            ttl_ms,
            inserted,
        } => {
            // An answer says which branch happened; without one (unknown outcome) either may have.
            if inserted != Some(false)
                && let Some(now) = find_absent(state.contents, window)
            {
                next.push(ModelState {
                    now,
                    contents: written(value, ttl_ms),
                });
            }
            if inserted != Some(true)
                && let Some(live) = find_live(state.contents, None, window)
            {
                next.push(live);
            }
        }
    }
}

/// The lifetime of a value written by an operation invoked at `invoked` whose point lies in
/// `window`: its expiry is at least `invoked + d - u` and at most `point + d + u`.
fn written_lifetime(
    invoked: u64,
    ttl_ms: Option<u64>,
    window: Window,
    expiry_uncertainty_ms: u64,
) -> Lifetime {
    match ttl_ms {
        None => Lifetime::Forever,
        Some(ttl_ms) => {
            let reach = ttl_ms.saturating_add(expiry_uncertainty_ms);
            Lifetime::Until {
                earliest: invoked
                    .saturating_add(ttl_ms)
                    .saturating_sub(expiry_uncertainty_ms),
                latest: window.latest.saturating_add(reach),
                reach,
            }
        }
    }
}

/// The earliest point for an operation that replaces the contents without looking at them (a put,
/// a delete), or `None` if there is none in the window. The current value's expiry does not
/// matter: `now` is always at least `earliest - reach` (a write's expiry is at least
/// `invoked + d - u`, its reach `d + u`; observing the value live at `p` raises `earliest` to at
/// most `p + 1` while `now` becomes `p`), so the coupling never pushes the point further.
fn overwrite(window: Window) -> Option<u64> {
    (window.earliest <= window.latest).then_some(window.earliest)
}

/// The earliest point in the window at which the key is absent (never written, deleted or
/// expired), or `None` if there is none. An expiring value is gone at points `p >= E`: the
/// earliest such point takes the earliest expiry.
fn find_absent(contents: Contents, window: Window) -> Option<u64> {
    let earliest = match contents {
        Contents::Absent => window.earliest,
        Contents::Present {
            lifetime: Lifetime::Forever,
            ..
        } => return None,
        Contents::Present {
            lifetime: Lifetime::Until { earliest, .. },
            ..
        } => window.earliest.max(earliest),
    };
    (earliest <= window.latest).then_some(earliest)
}

/// The state after observing the current value live (`expected`, or any value) at a point in the
/// window, or `None` if that cannot be. Observing it at point `p` means `E >= p + 1`; `p` is
/// taken as early as the window and the expiry allow, and `E` narrowed to what remains possible.
fn find_live(contents: Contents, expected: Option<ValueId>, window: Window) -> Option<ModelState> {
    let Contents::Present { value, lifetime } = contents else {
        return None;
    };
    if expected.is_some_and(|expected| expected != value) {
        return None;
    }
    let lifetime = match lifetime {
        Lifetime::Forever => Lifetime::Forever,
        Lifetime::Until {
            earliest,
            latest,
            reach,
        } => {
            // The point is at least `E - reach` and at most `E - 1`: impossible with no reach
            // (a TTL of 0 and no tolerance), where the value is gone as soon as it is written.
            if reach == 0 {
                return None;
            }
            let earliest = earliest.max(window.earliest.saturating_add(1));
            let latest = latest.min(window.latest.saturating_add(reach));
            if earliest > latest {
                return None;
            }
            Lifetime::Until {
                earliest,
                latest,
                reach,
            }
        }
    };
    Some(ModelState {
        now: window.earliest,
        contents: Contents::Present { value, lifetime },
    })
}

/// Sorts the states, removes duplicates and every state another one covers.
pub(crate) fn normalize(states: &mut Vec<ModelState>) {
    states.sort_unstable();
    states.dedup();
    if states.len() < 2 {
        return;
    }
    let mut kept: Vec<ModelState> = Vec::with_capacity(states.len());
    for state in states.iter() {
        if kept.iter().any(|other| other.covers(state)) {
            continue;
        }
        kept.retain(|other| !state.covers(other));
        kept.push(*state);
    }
    kept.sort_unstable();
    *states = kept;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn operation(invoked: u64, completed: u64, action: Action) -> KeyOperation {
        KeyOperation {
            source: 0,
            invoked,
            completed,
            required: completed != NEVER,
            action,
        }
    }

    fn after(state: ModelState, operation: &KeyOperation, uncertainty: u64) -> Vec<ModelState> {
        let mut next = Vec::new();
        step(&state, operation, NEVER, uncertainty, &mut next);
        next
    }

    #[test]
    fn a_value_written_with_a_ttl_expires_within_the_writes_interval_plus_the_ttl() {
        let put = operation(
            10,
            20,
            Action::Write {
                value: 0,
                ttl_ms: Some(100),
            },
        );
        let states = after(ModelState::INITIAL, &put, 0);
        assert_eq!(
            states,
            vec![ModelState {
                now: 10,
                contents: Contents::Present {
                    value: 0,
                    lifetime: Lifetime::Until {
                        earliest: 110,
                        latest: 120,
                        reach: 100
                    }
                }
            }]
        );
        // Live at 115 narrows the expiry to (115, 120]; absent at 111 is possible too.
        let live = after(
            states[0],
            &operation(115, 115, Action::Observe(Observation::Present(0))),
            0,
        );
        assert_eq!(
            live[0].contents,
            Contents::Present {
                value: 0,
                lifetime: Lifetime::Until {
                    earliest: 116,
                    latest: 120,
                    reach: 100
                }
            }
        );
        assert_eq!(
            after(
                states[0],
                &operation(111, 111, Action::Observe(Observation::Absent)),
                0
            )
            .len(),
            1
        );
        // But not absent at 109, nor live at 120.
        assert!(
            after(
                states[0],
                &operation(109, 109, Action::Observe(Observation::Absent)),
                0
            )
            .is_empty()
        );
        assert!(
            after(
                states[0],
                &operation(120, 120, Action::Observe(Observation::Present(0))),
                0
            )
            .is_empty()
        );
    }

    #[test]
    fn an_unknown_insert_if_absent_on_an_expiring_value_may_or_may_not_have_inserted() {
        let put = operation(
            0,
            0,
            Action::Write {
                value: 0,
                ttl_ms: Some(10),
            },
        );
        let states = after(ModelState::INITIAL, &put, 0);
        let insert = operation(
            5,
            NEVER,
            Action::InsertIfAbsent {
                value: 1,
                ttl_ms: None,
                inserted: None,
            },
        );
        let mut next = Vec::new();
        step(&states[0], &insert, 50, 0, &mut next);
        normalize(&mut next);
        assert_eq!(next.len(), 2);
    }

    #[test]
    fn a_state_that_allows_more_executions_covers_one_that_allows_fewer() {
        let wide = ModelState {
            now: 5,
            contents: Contents::Present {
                value: 1,
                lifetime: Lifetime::Until {
                    earliest: 10,
                    latest: 30,
                    reach: 20,
                },
            },
        };
        let narrow = ModelState {
            now: 6,
            contents: Contents::Present {
                value: 1,
                lifetime: Lifetime::Until {
                    earliest: 12,
                    latest: 30,
                    reach: 20,
                },
            },
        };
        assert!(wide.covers(&narrow));
        assert!(!narrow.covers(&wide));
        let mut states = vec![narrow, wide, narrow];
        normalize(&mut states);
        assert_eq!(states, vec![wide]);
    }
}
