//! Smoke tests of the checker's speed on large linearizable histories: they must complete (and
//! pass) in a few seconds even in a debug build. No timing is asserted: a slow machine must not
//! fail them, a search that explodes will.

use bytes::Bytes;
use cairn_checker::{Call, CheckOptions, History, Operation, Outcome, Output, check};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A linearizable history of `clients` clients each running operations back to back on random
/// keys of `keys`, every operation taking effect at a random point of its interval, 1% of writes
/// with an unknown outcome. Generated in virtual time: each client's next operation starts after
/// its previous one completed; the store applies operations in the order of their points.
fn concurrent_history(seed: u64, clients: u64, keys: u64, operations_per_client: u64) -> History {
    let mut random = StdRng::seed_from_u64(seed);
    struct Planned {
        operation: Operation,
        point: u64,
        took_effect: bool,
    }
    let mut planned: Vec<Planned> = Vec::new();
    for client in 0..clients {
        let mut time = random.random_range(0..10u64);
        for _ in 0..operations_per_client {
            let invoked_ms = time + random.random_range(0..3);
            let completed_ms = invoked_ms + random.random_range(0..20);
            let point = random.random_range(invoked_ms..=completed_ms);
            let value = Bytes::from(format!("{client}-{time}"));
            let ttl_ms = random
                .random_bool(0.2)
                .then(|| random.random_range(20..200));
            let call = match random.random_range(0..10) {
                0..=2 => Call::Put { value, ttl_ms },
                3..=5 => Call::Get,
                6 => Call::Delete,
                7 => Call::Exists,
                _ => Call::InsertIfAbsent { value, ttl_ms },
            };
            let unknown = call.is_write() && random.random_bool(0.01);
            planned.push(Planned {
                operation: Operation {
                    client,
                    key: Bytes::from(format!("key-{}", random.random_range(0..keys))),
                    call,
                    outcome: if unknown {
                        Outcome::Unknown
                    } else {
                        Outcome::Ok(Output::Done)
                    },
                    invoked_ms,
                    completed_ms,
                },
                point,
                took_effect: !unknown || random.random_bool(0.5),
            });
            time = completed_ms;
        }
    }
    planned.sort_by_key(|planned| planned.point);
    let mut stored: HashMap<Bytes, (Bytes, Option<u64>)> = HashMap::new();
    for planned in &mut planned {
        let point = planned.point;
        let operation = &mut planned.operation;
        let live = match stored.get(&operation.key) {
            Some((value, expiry)) if expiry.is_none_or(|expiry| point < expiry) => {
                Some(value.clone())
            }
            _ => None,
        };
        if !planned.took_effect {
            continue;
        }
        let output = match &operation.call {
            Call::Put { value, ttl_ms } => {
                stored.insert(
                    operation.key.clone(),
                    (value.clone(), ttl_ms.map(|ttl_ms| point + ttl_ms)),
                );
                Output::Done
            }
            Call::Delete => {
                stored.remove(&operation.key);
                Output::Done
            }
            Call::Get => Output::Value(live),
            Call::Exists => Output::Bool(live.is_some()),
            Call::InsertIfAbsent { value, ttl_ms } => {
                if live.is_none() {
                    stored.insert(
                        operation.key.clone(),
                        (value.clone(), ttl_ms.map(|ttl_ms| point + ttl_ms)),
                    );
                }
                Output::Bool(live.is_none())
            }
        };
        if let Outcome::Ok(recorded) = &mut operation.outcome {
            *recorded = output;
        }
    }
    planned
        .into_iter()
        .map(|planned| planned.operation)
        .collect()
}

fn check_and_time(history: &History, options: &CheckOptions) -> Duration {
    let started = Instant::now();
    let report = check(history, options);
    let elapsed = started.elapsed();
    assert!(report.is_ok(), "{report}");
    assert!(report.inconclusive.is_empty(), "{report}");
    eprintln!(
        "{} operations on {} keys checked in {elapsed:?}",
        report.operations, report.keys_checked
    );
    elapsed
}

#[test]
fn two_hundred_keys_of_five_hundred_operations_from_twenty_clients_check_quickly() {
    let history = concurrent_history(1, 20, 200, 5000);
    assert_eq!(history.len(), 100_000);
    check_and_time(&history, &CheckOptions::default());
}

#[test]
fn thousands_of_operations_on_one_key_from_fifty_clients_check_quickly() {
    let history = concurrent_history(2, 50, 1, 60);
    assert_eq!(history.len(), 3000);
    check_and_time(&history, &CheckOptions::default());
}
