//! What a check found: a [`Report`] of [`Violation`]s and of keys whose search gave up, each
//! readable by a person through `Display`.
//!
//! This module knows nothing of Cairn's wire protocol or processes.

use crate::history::{Operation, ShowBytes, ShowOperation};
use bytes::Bytes;
use std::fmt;
use std::time::Duration;

/// The result of [`crate::check()`].
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// How many keys had at least one operation that constrains them.
    pub keys_checked: usize,
    /// How many operations were taken into account.
    pub operations: usize,
    /// How many operations constrain nothing and were dropped: failed ones, and reads whose
    /// outcome is unknown.
    pub dropped_operations: usize,
    /// Operations whose answer does not fit their call (a put answering a value, a get answering
    /// a bool): a bug in whatever recorded the history. They are left out of the check, and make
    /// [`Report::is_ok`] false since a history with them cannot be trusted.
    pub malformed: Vec<Operation>,
    /// What was found, grouped by key: the keys in the order of their earliest violation, and for
    /// each key its direct diagnoses (double insert, lost write) before the search's.
    pub violations: Vec<Violation>,
    /// Keys whose search gave up at [`crate::CheckOptions::timeout`]: neither passed nor failed.
    /// Their direct checks still ran, and any violation they found is in `violations`.
    pub inconclusive: Vec<Inconclusive>,
    /// The earliest invocation in the history, which the descriptions show times relative to.
    pub history_start_ms: u64,
}

impl Report {
    /// Whether no violation was found (and no operation was malformed). Keys whose search gave up
    /// ([`Report::inconclusive`]) do not make a report fail: a caller that wants every key decided
    /// checks that list too.
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty() && self.malformed.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "checked {} operations on {} keys ({} dropped as failed or unknown reads): ",
            self.operations, self.keys_checked, self.dropped_operations
        )?;
        if self.violations.is_empty() {
            write!(formatter, "no violation")?;
        } else {
            write!(formatter, "{} violation(s)", self.violations.len())?;
        }
        if !self.inconclusive.is_empty() {
            write!(
                formatter,
                ", {} key(s) inconclusive (the search gave up)",
                self.inconclusive.len()
            )?;
        }
        if !self.malformed.is_empty() {
            write!(
                formatter,
                ", {} malformed operation(s), the first: {}",
                self.malformed.len(),
                ShowOperation {
                    operation: &self.malformed[0],
                    origin_ms: self.history_start_ms,
                }
            )?;
        }
        if let Some(first) = self.violations.first() {
            write!(formatter, "\nfirst violation: {first}")?;
        }
        Ok(())
    }
}

/// A key whose search gave up before deciding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inconclusive {
    /// The key.
    pub key: Bytes,
    /// How many of its operations were checked.
    pub operations: usize,
    /// How many distinct (placed operations, states) the search had cached.
    pub states_explored: usize,
    /// How long it searched.
    pub elapsed: Duration,
}

impl fmt::Display for Inconclusive {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "key {}: gave up after {:?} and {} states on {} operations",
            ShowBytes(&self.key),
            self.elapsed,
            self.states_explored,
            self.operations
        )
    }
}

/// Something no legal execution of the store explains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// No order of the key's operations, with their points inside their intervals, explains every
    /// answer.
    NotLinearizable {
        /// The key.
        key: Bytes,
        /// The end of the longest partial order the search found (at most
        /// [`crate::ORDER_TAIL_SHOWN`] operations, in that order), then the operation that
        /// could not be placed after it.
        operations: Vec<Operation>,
        /// What the order reached and why the last operation does not fit it.
        explanation: String,
        /// The earliest invocation in the history, which descriptions show times relative to.
        history_start_ms: u64,
    },
    /// Two insert-if-absent answered true for one key although, whichever went first, its value
    /// was still there when the other looked: no delete or put could come between them and the
    /// value could not have expired.
    DoubleInsert {
        /// The key.
        key: Bytes,
        /// The insert invoked first.
        first: Operation,
        /// The other.
        second: Operation,
        /// The earliest invocation in the history, which descriptions show times relative to.
        history_start_ms: u64,
    },
    /// An acknowledged write (a put, or an insert-if-absent that answered true) missing from a
    /// read invoked after it completed, although no other write or delete could come between
    /// them and the value could not have expired.
    LostWrite {
        /// The key.
        key: Bytes,
        /// The acknowledged write.
        write: Operation,
        /// The read that does not show it.
        read: Operation,
        /// The earliest invocation in the history, which descriptions show times relative to.
        history_start_ms: u64,
    },
}

impl Violation {
    /// The key it concerns.
    pub fn key(&self) -> &Bytes {
        match self {
            Violation::NotLinearizable { key, .. }
            | Violation::DoubleInsert { key, .. }
            | Violation::LostWrite { key, .. } => key,
        }
    }

    /// A short name of its kind: "not linearizable", "double insert" or "lost write".
    pub fn kind(&self) -> &'static str {
        match self {
            Violation::NotLinearizable { .. } => "not linearizable",
            Violation::DoubleInsert { .. } => "double insert",
            Violation::LostWrite { .. } => "lost write",
        }
    }

    /// The operations it involves.
    pub fn operations(&self) -> Vec<&Operation> {
        match self {
            Violation::NotLinearizable { operations, .. } => operations.iter().collect(),
            Violation::DoubleInsert { first, second, .. } => vec![first, second],
            Violation::LostWrite { write, read, .. } => vec![write, read],
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "key {}: {}: ",
            ShowBytes(self.key()),
            self.kind()
        )?;
        match self {
            Violation::NotLinearizable {
                operations,
                explanation,
                history_start_ms,
                ..
            } => {
                write!(formatter, "{explanation}")?;
                if operations.len() > 1 {
                    write!(formatter, " The end of that order: ")?;
                    let order = &operations[..operations.len() - 1];
                    for (position, operation) in order.iter().enumerate() {
                        let separator = if position + 1 == order.len() {
                            "."
                        } else {
                            "; "
                        };
                        write!(
                            formatter,
                            "{}{separator}",
                            ShowOperation {
                                operation,
                                origin_ms: *history_start_ms,
                            }
                        )?;
                    }
                }
                Ok(())
            }
            Violation::DoubleInsert {
                first,
                second,
                history_start_ms,
                ..
            } => write!(
                formatter,
                "two insert-if-absent answered true, but whichever went first, its value was still \
                 there when the other looked (no delete or put could come between them, and the \
                 value could not have expired): {}; and {}.",
                ShowOperation {
                    operation: first,
                    origin_ms: *history_start_ms,
                },
                ShowOperation {
                    operation: second,
                    origin_ms: *history_start_ms,
                },
            ),
            Violation::LostWrite {
                write,
                read,
                history_start_ms,
                ..
            } => write!(
                formatter,
                "an acknowledged write is missing from a read invoked after it completed, with no \
                 other write or delete that could come between them and no expiry possible: {}; \
                 then {}.",
                ShowOperation {
                    operation: write,
                    origin_ms: *history_start_ms,
                },
                ShowOperation {
                    operation: read,
                    origin_ms: *history_start_ms,
                },
            ),
        }
    }
}
