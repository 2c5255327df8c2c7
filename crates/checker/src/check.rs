//! [`check()`]: splits a history by key, runs the direct checks and the search on every key (on
//! several threads), and gathers what they found into a [`Report`].
//!
//! Checking key by key is exact, not an approximation: every operation touches one key, and a
//! history is linearizable if and only if each key's sub-history is (linearizability is local,
//! Herlihy & Wing's P-compositionality).
//!
//! This module knows nothing of Cairn's wire protocol or processes.

use crate::direct;
use crate::history::{History, Operation, ShowBytes, ShowOperation};
use crate::model::{self, Contents, KeyHistory, Lifetime, ModelState};
use crate::report::{Inconclusive, Report, Violation};
use crate::search::{self, Failure, SearchResult};
use bytes::Bytes;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How many operations of the longest partial order a [`Violation::NotLinearizable`] shows.
pub const ORDER_TAIL_SHOWN: usize = 8;

/// How a history is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOptions {
    /// How far the store's clock, which decides when values expire, may be from the clients'
    /// clock, in milliseconds. Since the store's error may differ between the moment it fixes a
    /// write's expiry and the moment it compares a read against it (two nodes, or a stepped
    /// clock), an expiry may be seen up to twice this early or late. Defaults to 50 ms.
    pub clock_tolerance_ms: u64,
    /// How far apart the clocks that stamped different operations may be, in milliseconds: every
    /// operation's interval is widened by this on both sides. Zero (the default) for a history
    /// stamped by one [`crate::Recorder`], whose operations all read one clock.
    pub client_clock_skew_ms: u64,
    /// How long the search may spend on one key before giving up on it (reported in
    /// [`Report::inconclusive`], not as a failure); `None` for no limit. Defaults to 30 seconds.
    pub timeout: Option<Duration>,
    /// How many threads check keys at once; 0 (the default) for as many as the machine has cores.
    pub threads: usize,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            clock_tolerance_ms: 50,
            client_clock_skew_ms: 0,
            timeout: Some(Duration::from_secs(30)),
            threads: 0,
        }
    }
}

/// Checks that `history` is linearizable for a key-value store, key by key, and runs the direct
/// checks for double inserts and lost writes besides. Failed operations and reads of unknown
/// outcome are dropped; writes of unknown outcome may have taken effect at any time after their
/// invocation, or never.
pub fn check(history: &History, options: &CheckOptions) -> Report {
    let history_start_ms = history.start_ms();
    let partition = model::partition(history.operations(), options.client_clock_skew_ms);
    let context = KeyContext {
        operations: history.operations(),
        expiry_uncertainty_ms: options.clock_tolerance_ms.saturating_mul(2),
        timeout: options.timeout,
        history_start_ms,
    };
    let keys: Vec<&(Bytes, KeyHistory)> = partition
        .keys
        .iter()
        .filter(|(_, key_history)| !key_history.operations.is_empty())
        .collect();
    let threads = match options.threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        threads => threads,
    }
    .clamp(1, keys.len().max(1));

    let mut findings: Vec<(usize, KeyFindings)> = if threads == 1 {
        keys.iter()
            .enumerate()
            .map(|(index, (key, key_history))| (index, context.check_key(key, key_history)))
            .collect()
    } else {
        let next_key = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut found = Vec::new();
                        loop {
                            let index = next_key.fetch_add(1, Ordering::Relaxed);
                            let Some((key, key_history)) = keys.get(index) else {
                                break;
                            };
                            found.push((index, context.check_key(key, key_history)));
                        }
                        found
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|worker| match worker.join() {
                    Ok(found) => found,
                    // A panic in a search is a bug of this crate: pass it on as it was.
                    Err(panic) => std::panic::resume_unwind(panic),
                })
                .collect()
        })
    };
    findings.sort_by_key(|(index, _)| *index);

    let mut report = Report {
        keys_checked: keys.len(),
        operations: keys
            .iter()
            .map(|(_, key_history)| key_history.operations.len())
            .sum(),
        dropped_operations: partition.dropped,
        malformed: partition
            .malformed
            .iter()
            .map(|&source| history.operations()[source].clone())
            .collect(),
        violations: Vec::new(),
        inconclusive: Vec::new(),
        history_start_ms,
    };
    let mut groups: Vec<(u64, Vec<Violation>)> = Vec::new();
    for (_, found) in findings {
        if let Some(inconclusive) = found.inconclusive {
            report.inconclusive.push(inconclusive);
        }
        if let Some(earliest) = found.earliest_ms {
            groups.push((earliest, found.violations));
        }
    }
    // Stable: keys whose earliest violations tie keep the history's order.
    groups.sort_by_key(|(earliest, _)| *earliest);
    report.violations = groups
        .into_iter()
        .flat_map(|(_, violations)| violations)
        .collect();
    report
}

/// What the checks found on one key.
struct KeyFindings {
    /// Direct diagnoses first, then the search's.
    violations: Vec<Violation>,
    /// When the earliest of them happened, to order keys by.
    earliest_ms: Option<u64>,
    inconclusive: Option<Inconclusive>,
}

/// What every key's check needs.
struct KeyContext<'a> {
    operations: &'a [Operation],
    expiry_uncertainty_ms: u64,
    timeout: Option<Duration>,
    history_start_ms: u64,
}

impl KeyContext<'_> {
    fn check_key(&self, key: &Bytes, key_history: &KeyHistory) -> KeyFindings {
        let key_operations = &key_history.operations;
        let source = |index: usize| &self.operations[key_operations[index].source];
        let mut violations = Vec::new();
        let mut earliest_ms: Option<u64> = None;
        let mut note = |at_ms: u64| {
            earliest_ms = Some(earliest_ms.map_or(at_ms, |earliest| earliest.min(at_ms)));
        };

        if let Some((first, second)) =
            direct::find_double_insert(key_operations, self.expiry_uncertainty_ms)
        {
            note(source(second).completed_ms.max(source(first).completed_ms));
            violations.push(Violation::DoubleInsert {
                key: key.clone(),
                first: source(first).clone(),
                second: source(second).clone(),
                history_start_ms: self.history_start_ms,
            });
        }
        if let Some((write, read)) =
            direct::find_lost_write(key_operations, self.expiry_uncertainty_ms)
        {
            note(source(read).invoked_ms);
            violations.push(Violation::LostWrite {
                key: key.clone(),
                write: source(write).clone(),
                read: source(read).clone(),
                history_start_ms: self.history_start_ms,
            });
        }

        let started = Instant::now();
        let deadline = self.timeout.map(|timeout| started + timeout);
        let mut inconclusive = None;
        match search::search(key_operations, self.expiry_uncertainty_ms, deadline) {
            SearchResult::Linearizable => {}
            SearchResult::NotLinearizable(failure) => {
                note(source(failure.blocked).invoked_ms);
                violations.push(self.describe_failure(key, key_history, &failure));
            }
            SearchResult::GaveUp { states_explored } => {
                inconclusive = Some(Inconclusive {
                    key: key.clone(),
                    operations: key_operations.len(),
                    states_explored,
                    elapsed: started.elapsed(),
                });
            }
        }
        KeyFindings {
            violations,
            earliest_ms,
            inconclusive,
        }
    }

    fn describe_failure(
        &self,
        key: &Bytes,
        key_history: &KeyHistory,
        failure: &Failure,
    ) -> Violation {
        let key_operations = &key_history.operations;
        let source = |index: usize| &self.operations[key_operations[index].source];
        let unknown_writes = key_operations.len() - failure.required;
        let mut explanation = format!(
            "no order of the key's {} answered operations",
            failure.required
        );
        if unknown_writes > 0 {
            let _ = write!(
                explanation,
                " (with any of its {unknown_writes} writes of unknown outcome)"
            );
        }
        let _ = write!(
            explanation,
            " explains every answer. The longest explanation found places {} of them",
            failure.placed_required
        );
        let unknown_placed = failure.order.len() - failure.placed_required;
        if unknown_placed > 0 {
            let _ = write!(
                explanation,
                " and {unknown_placed} write(s) of unknown outcome"
            );
        }
        let _ = write!(
            explanation,
            "; after it the key {}, and this operation, which had to come next, does not fit: {}.",
            self.describe_states(key_history, &failure.states),
            ShowOperation {
                operation: source(failure.blocked),
                origin_ms: self.history_start_ms,
            }
        );
        let tail_start = failure.order.len().saturating_sub(ORDER_TAIL_SHOWN);
        let operations = failure.order[tail_start..]
            .iter()
            .chain(std::iter::once(&failure.blocked))
            .map(|&index| source(index).clone())
            .collect();
        Violation::NotLinearizable {
            key: key.clone(),
            operations,
            explanation,
            history_start_ms: self.history_start_ms,
        }
    }

    /// "is absent", "holds "a"", "holds "a" (expiring between +110 ms and +130 ms)", or several
    /// of these joined by "or".
    fn describe_states(&self, key_history: &KeyHistory, states: &[ModelState]) -> String {
        const SHOWN_MAX: usize = 3;
        let relative = |ms: u64| ms as i128 - self.history_start_ms as i128;
        let mut described: Vec<String> = Vec::new();
        for state in states {
            let description = match state.contents {
                Contents::Absent => "is absent".to_owned(),
                Contents::Present { value, lifetime } => {
                    let shown = key_history.values.get(value as usize).map_or_else(
                        || "a value no later get returns".to_owned(),
                        |value| ShowBytes(value).to_string(),
                    );
                    match lifetime {
                        Lifetime::Forever => format!("holds {shown}"),
                        Lifetime::Until {
                            earliest, latest, ..
                        } if latest == model::NEVER => format!(
                            "holds {shown} (expiring no earlier than {:+} ms)",
                            relative(earliest)
                        ),
                        Lifetime::Until {
                            earliest, latest, ..
                        } => format!(
                            "holds {shown} (expiring between {:+} ms and {:+} ms)",
                            relative(earliest),
                            relative(latest)
                        ),
                    }
                }
            };
            if !described.contains(&description) {
                described.push(description);
            }
        }
        let more = described.len().saturating_sub(SHOWN_MAX);
        described.truncate(SHOWN_MAX);
        let mut joined = described.join(", or ");
        if more > 0 {
            let _ = write!(joined, ", or {more} other possibilities");
        }
        joined
    }
}
