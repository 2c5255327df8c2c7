//! A small in-memory store run by real client threads that record through a `Recorder`: correct,
//! its histories must pass; with a bug planted (stale reads from a lagging replica, acknowledged
//! writes dropped, insert-if-absent overwriting a present value), the checker must name it.
//!
//! Threads make the interleavings vary from run to run, so a buggy run is repeated until the bug
//! was both exercised (the store counts it) and caught, up to a bound: a bug exercised many times
//! over several rounds and never caught fails the test.

use bytes::Bytes;
use cairn_checker::{Call, CheckOptions, Outcome, Output, Recorder, Report, Violation, check};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    None,
    /// Reads are served half the time from a copy of the data refreshed every `REPLICA_LAG_MS`.
    StaleReads,
    /// One put in ten is acknowledged and dropped.
    LostWrites,
    /// One insert-if-absent in five on a present key overwrites it and answers true.
    DoubleInserts,
}

const REPLICA_LAG_MS: u64 = 20;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    value: Bytes,
    expires_at_ms: Option<u64>,
}

struct StoreState {
    primary: HashMap<Bytes, Entry>,
    replica: HashMap<Bytes, Entry>,
    replica_synced_ms: u64,
    random: StdRng,
}

/// A linearizable store (one lock around everything, expiry from the recorder's clock) unless a
/// bug is planted.
struct SimulatedStore {
    clock: Recorder,
    bug: Bug,
    state: Mutex<StoreState>,
    /// How many times the planted bug changed an answer or dropped a write.
    exercised: AtomicU64,
}

impl SimulatedStore {
    fn new(clock: Recorder, bug: Bug, seed: u64) -> Self {
        SimulatedStore {
            clock,
            bug,
            state: Mutex::new(StoreState {
                primary: HashMap::new(),
                replica: HashMap::new(),
                replica_synced_ms: 0,
                random: StdRng::seed_from_u64(seed),
            }),
            exercised: AtomicU64::new(0),
        }
    }

    fn execute(&self, key: &Bytes, call: &Call) -> Output {
        let mut state = self
            .state
            .lock()
            .expect("no client panics holding the store");
        let state = &mut *state;
        let now = self.clock.now_ms();
        let live = |map: &HashMap<Bytes, Entry>| {
            map.get(key)
                .filter(|entry| entry.expires_at_ms.is_none_or(|expiry| now < expiry))
                .map(|entry| entry.value.clone())
        };
        let entry = |value: &Bytes, ttl_ms: &Option<u64>| Entry {
            value: value.clone(),
            expires_at_ms: ttl_ms.map(|ttl_ms| now + ttl_ms),
        };
        match call {
            Call::Put { value, ttl_ms } => {
                if self.bug == Bug::LostWrites && state.random.random_bool(0.1) {
                    self.exercised.fetch_add(1, Ordering::Relaxed);
                } else {
                    state.primary.insert(key.clone(), entry(value, ttl_ms));
                }
                Output::Done
            }
            Call::Delete => {
                state.primary.remove(key);
                Output::Done
            }
            Call::Get | Call::Exists => {
                let current = live(&state.primary);
                let mut seen = current.clone();
                if self.bug == Bug::StaleReads {
                    if now >= state.replica_synced_ms + REPLICA_LAG_MS {
                        state.replica = state.primary.clone();
                        state.replica_synced_ms = now;
                    }
                    if state.random.random_bool(0.5) {
                        seen = live(&state.replica);
                        if seen != current {
                            self.exercised.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                match call {
                    Call::Get => Output::Value(seen),
                    _ => Output::Bool(seen.is_some()),
                }
            }
            Call::InsertIfAbsent { value, ttl_ms } => {
                if live(&state.primary).is_none() {
                    state.primary.insert(key.clone(), entry(value, ttl_ms));
                    Output::Bool(true)
                } else if self.bug == Bug::DoubleInserts && state.random.random_bool(0.2) {
                    self.exercised.fetch_add(1, Ordering::Relaxed);
                    state.primary.insert(key.clone(), entry(value, ttl_ms));
                    Output::Bool(true)
                } else {
                    Output::Bool(false)
                }
            }
        }
    }
}

/// Relative weights of the calls clients make.
#[derive(Debug, Clone, Copy)]
struct Mix {
    put: u32,
    put_with_ttl: u32,
    get: u32,
    exists: u32,
    delete: u32,
    insert: u32,
    /// Whether some calls fail (not executed) or end with an unknown outcome (executed or not,
    /// the client giving up).
    with_failures: bool,
}

struct Workload {
    clients: u64,
    operations_per_client: u64,
    keys: u64,
    mix: Mix,
    /// The longest pause of a client between two calls.
    pause_max: Duration,
}

fn random_call(random: &mut StdRng, mix: &Mix, client: u64, sequence: u64) -> Call {
    let value = Bytes::from(format!("{client}:{sequence}"));
    let total = mix.put + mix.put_with_ttl + mix.get + mix.exists + mix.delete + mix.insert;
    let mut pick = random.random_range(0..total);
    let mut take = |weight: u32| {
        let hit = pick < weight;
        pick = pick.saturating_sub(weight);
        hit
    };
    if take(mix.put) {
        Call::Put {
            value,
            ttl_ms: None,
        }
    } else if take(mix.put_with_ttl) {
        Call::Put {
            value,
            ttl_ms: Some(random.random_range(2..40)),
        }
    } else if take(mix.get) {
        Call::Get
    } else if take(mix.exists) {
        Call::Exists
    } else if take(mix.delete) {
        Call::Delete
    } else {
        Call::InsertIfAbsent {
            value,
            ttl_ms: random.random_bool(0.3).then(|| random.random_range(2..40)),
        }
    }
}

/// Runs the workload against a fresh store with `bug`, returning the report of checking its
/// history and how many times the bug was exercised.
fn run(workload: &Workload, bug: Bug, seed: u64) -> (Report, u64) {
    let recorder = Recorder::new();
    let store = SimulatedStore::new(recorder.clone(), bug, seed);
    std::thread::scope(|scope| {
        for client in 0..workload.clients {
            let recorder = recorder.clone();
            let store = &store;
            scope.spawn(move || {
                let mut random = StdRng::seed_from_u64(seed * 1000 + client);
                for sequence in 0..workload.operations_per_client {
                    let key = Bytes::from(format!("key{}", random.random_range(0..workload.keys)));
                    let call = random_call(&mut random, &workload.mix, client, sequence);
                    let pending = recorder.invoke(client, key.clone(), call.clone());
                    let fate = if workload.mix.with_failures {
                        random.random_range(0..50)
                    } else {
                        49
                    };
                    match fate {
                        // Refused before doing anything.
                        0 => pending.complete(Outcome::Failed),
                        // Gave up before the store did it: it never happens.
                        1 => drop(pending),
                        // Done, but the answer was lost.
                        2 => {
                            store.execute(&key, &call);
                            drop(pending);
                        }
                        _ => {
                            let output = store.execute(&key, &call);
                            pending.complete(Outcome::Ok(output));
                        }
                    }
                    std::thread::sleep(random.random_range(Duration::ZERO..workload.pause_max));
                }
            });
        }
    });
    let history = recorder.history();
    assert_eq!(
        history.len() as u64,
        workload.clients * workload.operations_per_client
    );
    // One clock for the clients and the store, read in whole milliseconds by both: no tolerance
    // is needed, and none is given, so that the check is as sharp as it can be.
    let options = CheckOptions {
        clock_tolerance_ms: 0,
        timeout: Some(Duration::from_secs(60)),
        ..CheckOptions::default()
    };
    let report = check(&history, &options);
    (report, store.exercised.load(Ordering::Relaxed))
}

/// Runs a buggy store until the checker reports `expected` after the bug was exercised.
fn assert_caught(workload: &Workload, bug: Bug, expected: fn(&Violation) -> bool) {
    const ROUNDS_MAX: u64 = 10;
    let mut exercised_total = 0;
    for round in 0..ROUNDS_MAX {
        let (report, exercised) = run(workload, bug, 100 + round);
        exercised_total += exercised;
        if report.violations.iter().any(expected) {
            assert!(exercised > 0, "a violation without the bug: {report}");
            eprintln!("{bug:?} caught in round {round}: {report}");
            return;
        }
    }
    panic!("{bug:?} exercised {exercised_total} times in {ROUNDS_MAX} rounds and never caught");
}

const FULL_MIX: Mix = Mix {
    put: 3,
    put_with_ttl: 2,
    get: 4,
    exists: 2,
    delete: 1,
    insert: 3,
    with_failures: true,
};

#[test]
fn histories_of_the_correct_store_pass() {
    let workload = Workload {
        clients: 8,
        operations_per_client: 300,
        keys: 4,
        mix: FULL_MIX,
        pause_max: Duration::from_micros(300),
    };
    for seed in 0..3 {
        let (report, exercised) = run(&workload, Bug::None, seed);
        assert_eq!(exercised, 0);
        assert!(report.is_ok(), "seed {seed}: {report}");
        assert!(report.inconclusive.is_empty(), "seed {seed}: {report}");
        assert!(
            report.dropped_operations > 0,
            "some failed calls were dropped"
        );
    }
}

#[test]
fn stale_reads_from_a_lagging_replica_are_caught() {
    let workload = Workload {
        clients: 6,
        operations_per_client: 200,
        keys: 3,
        mix: Mix {
            put: 1,
            put_with_ttl: 0,
            get: 2,
            exists: 0,
            delete: 0,
            insert: 0,
            with_failures: false,
        },
        pause_max: Duration::from_micros(300),
    };
    assert_caught(&workload, Bug::StaleReads, |violation| {
        matches!(violation, Violation::NotLinearizable { .. })
    });
}

#[test]
fn acknowledged_writes_that_are_dropped_are_caught() {
    let workload = Workload {
        clients: 4,
        operations_per_client: 200,
        keys: 4,
        mix: Mix {
            put: 3,
            put_with_ttl: 0,
            get: 7,
            exists: 0,
            delete: 0,
            insert: 0,
            with_failures: false,
        },
        // Calls far enough apart (on a clock of whole milliseconds) that a read often follows
        // a write with nothing in between, which is what the direct check needs.
        pause_max: Duration::from_millis(4),
    };
    assert_caught(&workload, Bug::LostWrites, |violation| {
        matches!(violation, Violation::LostWrite { .. })
    });
}

#[test]
fn insert_if_absent_overwriting_a_present_value_is_caught() {
    let workload = Workload {
        clients: 4,
        operations_per_client: 200,
        keys: 3,
        mix: Mix {
            put: 0,
            put_with_ttl: 0,
            get: 4,
            exists: 0,
            delete: 1,
            insert: 5,
            with_failures: false,
        },
        pause_max: Duration::from_millis(1),
    };
    assert_caught(&workload, Bug::DoubleInserts, |violation| {
        matches!(violation, Violation::DoubleInsert { .. })
    });
}
