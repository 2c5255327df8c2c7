//! Property: a history made from a legal sequential execution (every operation's interval around
//! its real point, overlapping its neighbours at random; expiries anywhere the clock tolerance
//! allows; writes of unknown outcome taking effect late or never) always passes.

use bytes::Bytes;
use cairn_checker::{Call, CheckOptions, History, Operation, Outcome, Output, check};
use proptest::prelude::*;
use std::collections::HashMap;

/// One operation of the sequential execution, as drawn.
#[derive(Debug, Clone)]
struct Drawn {
    key: u8,
    kind: u8,
    value: u8,
    ttl: u8,
    /// How long after the previous operation's point this one's is (0: at the same time).
    gap_ms: u64,
    /// How long before its point it was invoked, and after it completed.
    before_ms: u64,
    after_ms: u64,
    /// 0: failed, 1..=3: unknown outcome, else answered.
    fate: u8,
    /// For an unknown write: whether it took effect.
    took_effect: bool,
    /// Where in [invoked, point] the store fixed the expiry, and how far its clock was off, both
    /// as fractions of their ranges.
    stamp_fraction: f64,
    clock_error_fraction: f64,
}

/// How far an interval reaches from its point: mostly tight, so that reads fall near expiries and
/// real-time order binds, sometimes wide, so that operations overlap.
fn width() -> impl Strategy<Value = u64> {
    prop_oneof![3 => 0u64..2, 1 => 0u64..25]
}

fn drawn() -> impl Strategy<Value = Drawn> {
    (
        (0u8..4, 0u8..5, 0u8..4, 0u8..4),
        (0u64..6, width(), width()),
        (0u8..20, any::<bool>(), 0.0..=1.0f64, -1.0..=1.0f64),
    )
        .prop_map(
            |(
                (key, kind, value, ttl),
                (gap_ms, before_ms, after_ms),
                (fate, took_effect, stamp_fraction, clock_error_fraction),
            )| Drawn {
                key,
                kind,
                value,
                ttl,
                gap_ms,
                before_ms,
                after_ms,
                fate,
                took_effect,
                stamp_fraction,
                clock_error_fraction,
            },
        )
}

/// The history of running `drawn` in order against a correct store whose clock is off by up to
/// `tolerance_ms`.
fn history_of(drawn: &[Drawn], tolerance_ms: u64) -> History {
    let mut stored: HashMap<u8, (Bytes, Option<u64>)> = HashMap::new();
    let mut point: u64 = 1000;
    let mut history = History::new();
    for (client, operation) in drawn.iter().enumerate() {
        point += operation.gap_ms;
        let invoked_ms = point - operation.before_ms;
        let value = Bytes::from(format!("v{}", operation.value));
        let ttl_ms = [None, Some(5), Some(20), Some(60)][operation.ttl as usize];
        let stamp = invoked_ms as f64 + operation.stamp_fraction * operation.before_ms as f64;
        let clock_error = operation.clock_error_fraction * 2.0 * tolerance_ms as f64;
        // The expiry, on the clients' clock, rounded to whole milliseconds as a store's clock
        // would: a value is live at points before it.
        let expiry =
            ttl_ms.map(|ttl_ms| (stamp + ttl_ms as f64 + clock_error).ceil().max(0.0) as u64);
        let live = |stored: &HashMap<u8, (Bytes, Option<u64>)>| match stored.get(&operation.key) {
            Some((value, expiry)) if expiry.is_none_or(|expiry| point < expiry) => {
                Some(value.clone())
            }
            _ => None,
        };
        let call = match operation.kind {
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
        let (outcome, completed_ms) = match operation.fate {
            0 => (Outcome::Failed, point + operation.after_ms),
            1..=3 => {
                if operation.took_effect && call.is_write() {
                    match &call {
                        Call::Put { .. } => {
                            stored.insert(operation.key, (value, expiry));
                        }
                        Call::Delete => {
                            stored.remove(&operation.key);
                        }
                        _ => {
                            if live(&stored).is_none() {
                                stored.insert(operation.key, (value, expiry));
                            }
                        }
                    }
                }
                // The client gave up, possibly before the write took effect.
                (Outcome::Unknown, invoked_ms + operation.after_ms / 4)
            }
            _ => {
                let output = match &call {
                    Call::Put { .. } => {
                        stored.insert(operation.key, (value, expiry));
                        Output::Done
                    }
                    Call::Delete => {
                        stored.remove(&operation.key);
                        Output::Done
                    }
                    Call::Get => Output::Value(live(&stored)),
                    Call::Exists => Output::Bool(live(&stored).is_some()),
                    Call::InsertIfAbsent { .. } => {
                        let inserted = live(&stored).is_none();
                        if inserted {
                            stored.insert(operation.key, (value, expiry));
                        }
                        Output::Bool(inserted)
                    }
                };
                (Outcome::Ok(output), point + operation.after_ms)
            }
        };
        history.push(Operation {
            client: client as u64,
            key: Bytes::from(format!("key{}", operation.key)),
            call,
            outcome,
            invoked_ms,
            completed_ms,
        });
    }
    history
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn histories_of_sequential_executions_are_linearizable(
        drawn in proptest::collection::vec(drawn(), 1..300),
        tolerance_ms in 0u64..4,
    ) {
        let history = history_of(&drawn, tolerance_ms);
        let report = check(
            &history,
            &CheckOptions { clock_tolerance_ms: tolerance_ms, ..CheckOptions::default() },
        );
        prop_assert!(report.is_ok(), "{}", report);
        prop_assert!(report.inconclusive.is_empty(), "{}", report);
    }
}
