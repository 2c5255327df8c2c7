//! The conformance suite: what every [`LogProvider`] must do, written as checks of what a user of
//! the log would notice (LSNs handed out, records read back, errors seen), never of how a provider
//! stores anything.
//!
//! Every case is a `pub async fn` taking a fresh provider and panicking on the first violation.
//! Two ways to run them:
//!
//! - [`conformance_tests!`](crate::conformance_tests) expands to one `#[tokio::test]` per case,
//!   so that a failure names its case. It needs `tokio` (with the `macros` and `rt-multi-thread`
//!   features) among the calling crate's dependencies:
//!
//!   ```no_run
//!   use cairn_log::LogProvider;
//!   use cairn_log::local::{LocalLogOptions, LocalLogProvider};
//!   use std::sync::Arc;
//!
//!   /// A provider with no logs yet. (This one leaves its directory behind.)
//!   async fn fresh_provider() -> Arc<dyn LogProvider> {
//!       let dir = tempfile::TempDir::new().unwrap().keep();
//!       Arc::new(LocalLogProvider::open(dir, LocalLogOptions::default()).unwrap())
//!   }
//!
//!   cairn_log::conformance_tests!(fresh_provider);
//!   # fn main() {}
//!   ```
//!
//! - [`run_all`] runs every case in turn, each with a provider of its own, and names the case
//!   that failed in its panic.
//!
//! Cases use small log ids (1, 2, 7, 8) and expect the provider to hold no logs yet.

use crate::{Entry, Error, LogProvider, LogState, Loglet};
use bytes::Bytes;
use cairn_types::{LogId, Lsn};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// How long a case waits before it concludes that something that should not happen did not.
const STILL_PENDING: Duration = Duration::from_millis(200);
/// How long a case waits for something that should happen before it gives up.
const PATIENCE: Duration = Duration::from_secs(10);

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
/// One case, boxed so that cases can be listed.
pub type Case = for<'a> fn(&'a dyn LogProvider) -> BoxFuture<'a, ()>;

/// Expands to one `#[tokio::test]` per conformance case. `$make` is called once per case and must
/// return a future of an `Arc<dyn LogProvider>` that holds no logs yet (an `async fn` or a
/// closure returning an `async` block).
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@expand tests ($make));
    };

    // The one list of cases; every other rule is handed it.
    (@expand $mode:ident $args:tt) => {
        $crate::conformance_tests!(@$mode $args
            empty_log_state,
            appends_are_dense_and_start_at_one,
            batch_append_returns_last_lsn,
            read_from_the_middle,
            read_past_the_tail_is_empty,
            read_respects_max_records,
            wait_for_tail_wakes_when_the_append_lands,
            trim_clamps_to_the_tail_and_never_moves_back,
            read_at_or_below_the_trim_point_is_trimmed,
            appends_continue_after_trimming_everything,
            concurrent_appenders_get_distinct_dense_lsns,
            logs_with_different_ids_are_independent,
            opening_twice_returns_the_same_log,
            records_up_to_the_announced_size_are_taken,
        );
    };

    (@tests ($make:expr) $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let provider: ::std::sync::Arc<dyn $crate::LogProvider> = ($make)().await;
                $crate::conformance::$case(&*provider).await;
            }
        )*
    };

    (@cases () $($case:ident),* $(,)?) => {
        mod boxed {
            $(
                pub fn $case(
                    provider: &dyn $crate::LogProvider,
                ) -> $crate::conformance::BoxFuture<'_, ()> {
                    ::std::boxed::Box::pin(super::$case(provider))
                }
            )*
        }

        /// Every case, by name.
        pub const CASES: &[(&str, $crate::conformance::Case)] = &[
            $((stringify!($case), boxed::$case as $crate::conformance::Case)),*
        ];
    };
}

crate::conformance_tests!(@expand cases ());

/// Runs every case, each against a fresh provider from `make`. Panics naming the first case that
/// fails.
pub async fn run_all<F, Fut>(mut make: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Arc<dyn LogProvider>>,
{
    for (name, case) in CASES {
        let provider = make().await;
        // A task of its own turns the case's panic into a value that can be labelled.
        let outcome = tokio::spawn(async move { case(&*provider).await }).await;
        if let Err(error) = outcome {
            panic!("conformance case `{name}` failed: {error}");
        }
    }
}

fn payload(text: impl std::fmt::Display) -> Bytes {
    Bytes::from(text.to_string())
}

async fn open(provider: &dyn LogProvider, id: u16) -> Arc<dyn Loglet> {
    provider
        .open(LogId(id))
        .await
        .unwrap_or_else(|e| panic!("opening log {id}: {e}"))
}

async fn append(log: &Arc<dyn Loglet>, payloads: Vec<Bytes>) -> Lsn {
    log.append(payloads)
        .await
        .unwrap_or_else(|e| panic!("append: {e}"))
}

async fn read(log: &Arc<dyn Loglet>, from: u64, max_records: usize) -> Vec<Entry> {
    log.read(Lsn(from), max_records)
        .await
        .unwrap_or_else(|e| panic!("read from {from}: {e}"))
}

async fn state(log: &Arc<dyn Loglet>) -> LogState {
    log.state().await.unwrap_or_else(|e| panic!("state: {e}"))
}

async fn trim(log: &Arc<dyn Loglet>, up_to: u64) {
    log.trim(Lsn(up_to))
        .await
        .unwrap_or_else(|e| panic!("trim to {up_to}: {e}"))
}

fn log_state(trim_point: u64, tail: u64) -> LogState {
    LogState {
        trim_point: Lsn(trim_point),
        tail: Lsn(tail),
    }
}

/// The entries `first..=last` whose payloads are `"{prefix}{lsn}"`.
fn numbered(prefix: &str, first: u64, last: u64) -> Vec<Entry> {
    (first..=last)
        .map(|lsn| Entry {
            lsn: Lsn(lsn),
            payload: payload(format!("{prefix}{lsn}")),
        })
        .collect()
}

/// Appends `"{prefix}{lsn}"` for the LSNs `first..=last`, one append each, checking the LSNs.
async fn append_numbered(log: &Arc<dyn Loglet>, prefix: &str, first: u64, last: u64) {
    for lsn in first..=last {
        assert_eq!(
            append(log, vec![payload(format!("{prefix}{lsn}"))]).await,
            Lsn(lsn)
        );
    }
}

async fn assert_pending<F: Future>(what: &str, future: F) {
    assert!(
        tokio::time::timeout(STILL_PENDING, future).await.is_err(),
        "{what} should still be waiting"
    );
}

fn assert_trimmed<T: std::fmt::Debug>(result: crate::Result<T>, requested: u64, trim_point: u64) {
    match result {
        Err(Error::Trimmed {
            requested: r,
            trim_point: t,
            ..
        }) => {
            assert_eq!((r, t), (Lsn(requested), Lsn(trim_point)));
        }
        other => panic!(
            "reading from {requested} with trim point {trim_point} should fail as trimmed, got {other:?}"
        ),
    }
}

pub async fn empty_log_state(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    assert_eq!(log.log_id(), LogId(1));
    assert_eq!(state(&log).await, log_state(0, 0));
    assert_eq!(read(&log, 1, 10).await, vec![]);
    // An empty batch writes nothing and answers the tail.
    assert_eq!(append(&log, vec![]).await, Lsn(0));
    assert_eq!(state(&log).await, log_state(0, 0));
    tokio::time::timeout(PATIENCE, log.wait_for_tail(Lsn(0)))
        .await
        .expect("the tail is always at least 0")
        .expect("wait_for_tail(0)");
    // LSN 0 names no record; it counts as trimmed (`from <= trim_point`).
    assert_trimmed(log.read(Lsn(0), 10).await, 0, 0);
}

pub async fn appends_are_dense_and_start_at_one(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    append_numbered(&log, "r", 1, 5).await;
    assert_eq!(state(&log).await, log_state(0, 5));
    assert_eq!(read(&log, 1, 100).await, numbered("r", 1, 5));

    // Payloads are opaque bytes: empty and binary ones come back as they went in.
    let binary = Bytes::from((0..=255u8).rev().collect::<Vec<_>>());
    assert_eq!(append(&log, vec![Bytes::new()]).await, Lsn(6));
    assert_eq!(append(&log, vec![binary.clone()]).await, Lsn(7));
    let tail = read(&log, 6, 100).await;
    assert_eq!(
        tail,
        vec![
            Entry {
                lsn: Lsn(6),
                payload: Bytes::new()
            },
            Entry {
                lsn: Lsn(7),
                payload: binary
            },
        ]
    );
}

pub async fn batch_append_returns_last_lsn(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    let batch = |range: std::ops::RangeInclusive<u64>| range.map(|i| payload(format!("b{i}")));
    assert_eq!(append(&log, batch(1..=3).collect()).await, Lsn(3));
    assert_eq!(append(&log, batch(4..=4).collect()).await, Lsn(4));
    assert_eq!(append(&log, batch(5..=9).collect()).await, Lsn(9));
    assert_eq!(append(&log, vec![]).await, Lsn(9));
    assert_eq!(state(&log).await, log_state(0, 9));
    assert_eq!(read(&log, 1, 100).await, numbered("b", 1, 9));
}

pub async fn read_from_the_middle(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    append_numbered(&log, "m", 1, 300).await;
    assert_eq!(read(&log, 8, 5).await, numbered("m", 8, 12));
    assert_eq!(read(&log, 150, 3).await, numbered("m", 150, 152));
    assert_eq!(read(&log, 290, 100).await, numbered("m", 290, 300));
    assert_eq!(read(&log, 300, 100).await, numbered("m", 300, 300));
}

pub async fn read_past_the_tail_is_empty(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    assert_eq!(read(&log, 1, 10).await, vec![]);
    assert_eq!(read(&log, 100, 10).await, vec![]);
    append_numbered(&log, "p", 1, 3).await;
    assert_eq!(read(&log, 4, 10).await, vec![]);
    assert_eq!(read(&log, 1000, 10).await, vec![]);
    assert_eq!(read(&log, u64::MAX, usize::MAX).await, vec![]);
}

pub async fn read_respects_max_records(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    assert_eq!(
        append(&log, (1..=10).map(|i| payload(format!("x{i}"))).collect()).await,
        Lsn(10)
    );
    assert_eq!(read(&log, 1, 0).await, vec![]);
    assert_eq!(read(&log, 1, 1).await, numbered("x", 1, 1));
    assert_eq!(read(&log, 1, 3).await, numbered("x", 1, 3));
    assert_eq!(read(&log, 9, 5).await, numbered("x", 9, 10));
    assert_eq!(read(&log, 1, usize::MAX).await, numbered("x", 1, 10));
}

pub async fn wait_for_tail_wakes_when_the_append_lands(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    let waiter = tokio::spawn({
        let log = log.clone();
        async move { log.wait_for_tail(Lsn(2)).await }
    });
    assert_pending(
        "wait_for_tail(2) on an empty log",
        log.wait_for_tail(Lsn(2)),
    )
    .await;
    assert!(!waiter.is_finished());

    append_numbered(&log, "w", 1, 1).await;
    assert_pending("wait_for_tail(2) at tail 1", log.wait_for_tail(Lsn(2))).await;
    assert!(!waiter.is_finished(), "woke up before its LSN was appended");

    append_numbered(&log, "w", 2, 2).await;
    tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("wait_for_tail(2) should wake once LSN 2 is appended")
        .expect("the waiting task")
        .expect("wait_for_tail(2)");
    // Once the tail passed an LSN, waiting for it returns at once, and the record is readable.
    tokio::time::timeout(PATIENCE, log.wait_for_tail(Lsn(1)))
        .await
        .expect("wait_for_tail(1) at tail 2 should not wait")
        .expect("wait_for_tail(1)");
    assert_eq!(read(&log, 2, 10).await, numbered("w", 2, 2));
}

pub async fn trim_clamps_to_the_tail_and_never_moves_back(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    // Trimming an empty log trims nothing: there is nothing to clamp to but 0.
    trim(&log, 10).await;
    assert_eq!(state(&log).await, log_state(0, 0));

    append_numbered(&log, "t", 1, 5).await;
    trim(&log, 3).await;
    assert_eq!(state(&log).await, log_state(3, 5));
    trim(&log, 1).await;
    assert_eq!(state(&log).await, log_state(3, 5));
    trim(&log, 3).await;
    assert_eq!(state(&log).await, log_state(3, 5));
    assert_eq!(read(&log, 4, 10).await, numbered("t", 4, 5));

    trim(&log, 100).await;
    assert_eq!(state(&log).await, log_state(5, 5));
    // The clamped trim did not reserve LSNs up to 100: the next append is 6.
    append_numbered(&log, "t", 6, 6).await;
    assert_eq!(state(&log).await, log_state(5, 6));
    assert_eq!(read(&log, 6, 10).await, numbered("t", 6, 6));
    trim(&log, 0).await;
    assert_eq!(state(&log).await, log_state(5, 6));
}

pub async fn read_at_or_below_the_trim_point_is_trimmed(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    append_numbered(&log, "r", 1, 10).await;
    trim(&log, 4).await;
    assert_trimmed(log.read(Lsn(4), 10).await, 4, 4);
    assert_trimmed(log.read(Lsn(1), 10).await, 1, 4);
    assert_trimmed(log.read(Lsn(0), 10).await, 0, 4);
    assert_eq!(read(&log, 5, 100).await, numbered("r", 5, 10));
    trim(&log, 7).await;
    assert_trimmed(log.read(Lsn(5), 100).await, 5, 7);
    assert_eq!(read(&log, 8, 100).await, numbered("r", 8, 10));
}

pub async fn appends_continue_after_trimming_everything(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    append_numbered(&log, "e", 1, 3).await;
    trim(&log, 3).await;
    assert_eq!(state(&log).await, log_state(3, 3));
    assert_eq!(read(&log, 4, 10).await, vec![]);
    assert_trimmed(log.read(Lsn(3), 10).await, 3, 3);

    assert_eq!(
        append(&log, vec![payload("e4"), payload("e5")]).await,
        Lsn(5)
    );
    assert_eq!(state(&log).await, log_state(3, 5));
    assert_eq!(read(&log, 4, 10).await, numbered("e", 4, 5));

    trim(&log, 5).await;
    append_numbered(&log, "e", 6, 6).await;
    assert_eq!(state(&log).await, log_state(5, 6));
    assert_eq!(read(&log, 6, 10).await, numbered("e", 6, 6));
}

pub async fn concurrent_appenders_get_distinct_dense_lsns(provider: &dyn LogProvider) {
    const TASKS: usize = 16;
    const APPENDS_PER_TASK: usize = 25;
    let log = open(provider, 1).await;

    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let log = log.clone();
            tokio::spawn(async move {
                let mut appended = Vec::new();
                for i in 0..APPENDS_PER_TASK {
                    // Every fifth append is a batch, which must land on consecutive LSNs.
                    let size = if i % 5 == 0 { 3 } else { 1 };
                    let payloads: Vec<Bytes> = (0..size)
                        .map(|k| payload(format!("task{task}-append{i}-record{k}")))
                        .collect();
                    let last = append(&log, payloads.clone()).await;
                    appended.push((last, payloads));
                }
                appended
            })
        })
        .collect();
    let mut appends = Vec::new();
    for task in tasks {
        let appended = task.await.expect("appending task");
        // One appender's appends are ordered: each waited for the previous one.
        let lasts: Vec<Lsn> = appended.iter().map(|(last, _)| *last).collect();
        assert!(
            lasts.windows(2).all(|w| w[0] < w[1]),
            "one appender's LSNs go up: {lasts:?}"
        );
        appends.extend(appended);
    }

    let total: usize = appends.iter().map(|(_, payloads)| payloads.len()).sum();
    assert_eq!(state(&log).await, log_state(0, total as u64));

    let mut entries = Vec::new();
    while entries.len() < total {
        let chunk = read(&log, entries.len() as u64 + 1, 64).await;
        assert!(!chunk.is_empty(), "records below the tail must be readable");
        entries.extend(chunk);
    }
    assert_eq!(entries.len(), total);
    let mut lsn_of = HashMap::new();
    for (i, entry) in entries.iter().enumerate() {
        assert_eq!(entry.lsn, Lsn(i as u64 + 1), "LSNs are dense");
        assert!(
            lsn_of.insert(entry.payload.clone(), entry.lsn).is_none(),
            "payload {:?} was read back twice",
            entry.payload
        );
    }
    for (last, payloads) in &appends {
        let first = last.0 + 1 - payloads.len() as u64;
        for (k, p) in payloads.iter().enumerate() {
            assert_eq!(
                lsn_of.get(p),
                Some(&Lsn(first + k as u64)),
                "the batch ending at {last} is on consecutive LSNs in order"
            );
        }
    }
}

pub async fn logs_with_different_ids_are_independent(provider: &dyn LogProvider) {
    let a = open(provider, 1).await;
    let b = open(provider, 2).await;
    assert_eq!((a.log_id(), b.log_id()), (LogId(1), LogId(2)));
    append_numbered(&a, "a", 1, 3).await;
    assert_eq!(state(&b).await, log_state(0, 0));
    assert_eq!(read(&b, 1, 10).await, vec![]);

    append_numbered(&b, "b", 1, 1).await;
    trim(&a, 3).await;
    assert_eq!(state(&a).await, log_state(3, 3));
    assert_eq!(state(&b).await, log_state(0, 1));
    assert_eq!(read(&b, 1, 10).await, numbered("b", 1, 1));
    append_numbered(&a, "a", 4, 4).await;
    assert_eq!(read(&a, 4, 10).await, numbered("a", 4, 4));
    assert_eq!(state(&b).await, log_state(0, 1));
}

pub async fn opening_twice_returns_the_same_log(provider: &dyn LogProvider) {
    let first = open(provider, 7).await;
    let second = open(provider, 7).await;
    append_numbered(&first, "s", 1, 1).await;
    assert_eq!(state(&second).await, log_state(0, 1));
    assert_eq!(read(&second, 1, 10).await, numbered("s", 1, 1));
    append_numbered(&second, "s", 2, 2).await;
    assert_eq!(read(&first, 1, 10).await, numbered("s", 1, 2));
    trim(&second, 1).await;
    assert_eq!(state(&first).await, log_state(1, 2));

    // Even when both opens race, they get one log: their appends take distinct LSNs.
    let (x, y) = tokio::join!(provider.open(LogId(8)), provider.open(LogId(8)));
    let (x, y) = (x.expect("open log 8"), y.expect("open log 8"));
    let (lx, ly) = tokio::join!(
        append(&x, vec![payload("x")]),
        append(&y, vec![payload("y")])
    );
    let mut lsns = [lx, ly];
    lsns.sort();
    assert_eq!(lsns, [Lsn(1), Lsn(2)]);
    assert_eq!(state(&x).await, log_state(0, 2));
}

/// Callers size what they append by `record_bytes_max` (a leader packs its waiting proposals
/// into records of at most that size): a record of exactly that size must be taken, one byte
/// more refused as too large, leaving nothing behind.
pub async fn records_up_to_the_announced_size_are_taken(provider: &dyn LogProvider) {
    let log = open(provider, 1).await;
    let max = log.record_bytes_max();
    let refused = log.append(vec![Bytes::from(vec![b'x'; max + 1])]).await;
    match refused {
        Err(crate::Error::RecordTooLarge { size, limit, .. }) => {
            assert_eq!((size, limit), (max + 1, max))
        }
        other => panic!(
            "a record of {} bytes should be refused as too large: {other:?}",
            max + 1
        ),
    }
    assert_eq!(state(&log).await, log_state(0, 0));
    let largest = Bytes::from(vec![b'y'; max]);
    assert_eq!(append(&log, vec![largest.clone()]).await, Lsn(1));
    assert_eq!(
        read(&log, 1, 10).await,
        vec![Entry {
            lsn: Lsn(1),
            payload: largest
        }]
    );
}

/// Not one of [`CASES`]: it needs `log`'s provider to fail appends on demand (`fail(true)` until
/// `fail(false)`), as a full disk or a failing device would, which only the provider's own tests
/// can arrange. Every provider that can fail an append runs it with its own way of failing.
///
/// A failed append is the caller's error only: nothing of it becomes readable, reads and tail
/// waits go on meanwhile, and appends succeed again, densely, once the cause is gone.
pub async fn a_failed_append_stops_neither_reads_nor_later_appends(
    log: Arc<dyn Loglet>,
    fail: &(dyn Fn(bool) + Send + Sync),
) {
    append_numbered(&log, "x", 1, 3).await;
    let waiter = tokio::spawn({
        let log = log.clone();
        async move { log.wait_for_tail(Lsn(4)).await }
    });

    fail(true);
    for _ in 0..2 {
        let failed = log.append(vec![payload("lost")]).await;
        assert!(failed.is_err(), "the append should have failed: {failed:?}");
        assert_eq!(read(&log, 1, 10).await, numbered("x", 1, 3));
        assert_eq!(state(&log).await, log_state(0, 3));
    }
    assert_pending(
        "wait_for_tail(4) while appends fail",
        log.wait_for_tail(Lsn(4)),
    )
    .await;
    assert!(!waiter.is_finished(), "a failed append ended a tail wait");

    fail(false);
    append_numbered(&log, "x", 4, 5).await;
    tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("wait_for_tail(4) should wake once LSN 4 is appended")
        .expect("the waiting task")
        .expect("wait_for_tail(4)");
    assert_eq!(read(&log, 1, 10).await, numbered("x", 1, 5));
}
