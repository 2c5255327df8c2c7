//! The conformance suite: what every [`MetadataStore`] provider must do, checked as its users
//! would notice it (versions handed out, writers refused, values read back and watched), never
//! through how a provider stores anything.
//!
//! [`run_all`] runs every case, each on a store of its own, and panics on the first violation
//! with a message that names it.

use crate::{Error, MetadataStore, Precondition, Versioned};
use serde_json::json;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Opens the store of one case, named by its argument: empty the first time a name is given, and
/// the same data again (as after a restart of the provider) every later time.
pub type Open<'a> = &'a (dyn Fn(&str) -> BoxFuture<'static, Arc<dyn MetadataStore>> + Sync);

/// How long a case waits for something that should happen before it gives up.
const PATIENCE: Duration = Duration::from_secs(10);

/// Runs every case in turn.
pub async fn run_all(open: Open<'_>) {
    preconditions_decide_every_put(open).await;
    of_writers_racing_on_one_version_exactly_one_wins(open).await;
    racing_read_modify_writes_each_take_effect_once(open).await;
    a_watch_delivers_every_committed_version_in_order(open).await;
    a_watch_of_a_missing_key_starts_at_its_first_version(open).await;
    values_survive_a_restart(open).await;
}

pub async fn preconditions_decide_every_put(open: Open<'_>) {
    let store = open("preconditions").await;
    assert_eq!(store.get("k").await.unwrap(), None, "a missing key");
    let put = |value, precondition| store.put("k", json!(value), precondition);
    let first = put(1, Precondition::DoesNotExist).await.unwrap();
    assert!(first >= 1, "versions start at 1: {first}");
    for refused in [
        Precondition::DoesNotExist,
        Precondition::MatchesVersion(first + 1000),
    ] {
        match put(2, refused).await {
            Err(Error::PreconditionFailed { current, .. }) => assert_eq!(current, Some(first)),
            other => panic!("a put with {refused:?} on version {first} gave {other:?}"),
        }
    }
    let second = put(2, Precondition::MatchesVersion(first)).await.unwrap();
    let third = put(3, Precondition::None).await.unwrap();
    assert!(
        first < second && second < third,
        "versions go up: {first}, {second}, {third}"
    );
    assert_eq!(
        store.get("k").await.unwrap(),
        Some(Versioned {
            version: third,
            value: json!(3)
        })
    );
}

pub async fn of_writers_racing_on_one_version_exactly_one_wins(open: Open<'_>) {
    const WRITERS: usize = 16;
    let store = open("race").await;
    let first = store
        .put("leader", json!("nobody"), Precondition::DoesNotExist)
        .await
        .unwrap();
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let store = store.clone();
            tokio::spawn(async move {
                let won = store
                    .put("leader", json!(writer), Precondition::MatchesVersion(first))
                    .await;
                (writer, won)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for writer in writers {
        match writer.await.expect("writer task") {
            (writer, Ok(version)) => winners.push((writer, version)),
            (_, Err(Error::PreconditionFailed { .. })) => {}
            (writer, Err(err)) => panic!("writer {writer} failed otherwise: {err}"),
        }
    }
    assert_eq!(winners.len(), 1, "writers that won: {winners:?}");
    let (winner, version) = winners[0];
    assert_eq!(
        store.get("leader").await.unwrap(),
        Some(Versioned {
            version,
            value: json!(winner)
        }),
        "the store holds the winner's value at the version it was told"
    );
}

/// Writers that all add to one counter through [`crate::update_typed`] lose compare-and-swaps
/// to each other, retry, and each add exactly once.
pub async fn racing_read_modify_writes_each_take_effect_once(open: Open<'_>) {
    const WRITERS: u64 = 12;
    let store = open("read-modify-write").await;
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                crate::update_typed::<u64, ()>(store.as_ref(), "counter", "counter", |count| {
                    crate::Change::Write(count.unwrap_or(0) + 1, ())
                })
                .await
            })
        })
        .collect();
    for writer in writers {
        let ((), version) = writer.await.unwrap().expect("a retried compare-and-swap");
        assert!(version.is_some());
    }
    let (_, count) = crate::get_typed::<u64>(store.as_ref(), "counter", "counter")
        .await
        .unwrap()
        .expect("the counter");
    assert_eq!(count, WRITERS, "every writer added once");
    // Keep writes nothing and answers the version read.
    let (seen, version) =
        crate::update_typed::<u64, u64>(store.as_ref(), "counter", "counter", |count| {
            crate::Change::Keep(count.unwrap_or(0))
        })
        .await
        .unwrap();
    assert_eq!(seen, WRITERS);
    assert_eq!(
        store.get("counter").await.unwrap().map(|v| v.version),
        version
    );
}

pub async fn a_watch_delivers_every_committed_version_in_order(open: Open<'_>) {
    const WRITERS: u64 = 4;
    const INCREMENTS: u64 = 10;
    let store = open("watch").await;
    let first = store
        .put("counter", json!(0), Precondition::DoesNotExist)
        .await
        .unwrap();
    let mut watch = store.watch("counter").await.unwrap();
    // Concurrent read-modify-write increments: the n-th version holds n.
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                for _ in 0..INCREMENTS {
                    loop {
                        let current = store.get("counter").await.unwrap().unwrap();
                        let next = json!(current.value.as_u64().unwrap() + 1);
                        match store
                            .put(
                                "counter",
                                next,
                                Precondition::MatchesVersion(current.version),
                            )
                            .await
                        {
                            Ok(_) => break,
                            Err(Error::PreconditionFailed { .. }) => continue,
                            Err(err) => panic!("an increment failed: {err}"),
                        }
                    }
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.expect("writer task");
    }
    let mut last = first - 1;
    for n in 0..=WRITERS * INCREMENTS {
        let seen = tokio::time::timeout(PATIENCE, watch.next())
            .await
            .unwrap_or_else(|_| panic!("the watch did not deliver the version holding {n}"))
            .expect("the watch ended");
        assert_eq!(
            seen.value,
            json!(n),
            "the watch skipped or reordered a version"
        );
        assert!(seen.version > last, "versions go up: {last}, then {seen:?}");
        last = seen.version;
    }
    assert_eq!(
        store.get("counter").await.unwrap().map(|v| v.version),
        Some(last),
        "the last version watched is the current one"
    );
}

pub async fn a_watch_of_a_missing_key_starts_at_its_first_version(open: Open<'_>) {
    let store = open("watch-missing").await;
    let mut watch = store.watch("later").await.unwrap();
    store
        .put("other", json!(0), Precondition::None)
        .await
        .unwrap();
    store
        .put("later", json!("first"), Precondition::DoesNotExist)
        .await
        .unwrap();
    let seen = tokio::time::timeout(PATIENCE, watch.next())
        .await
        .expect("the watch did not deliver the key's first version")
        .expect("the watch ended");
    assert_eq!(
        seen.value,
        json!("first"),
        "only the watched key's versions are delivered"
    );
}

pub async fn values_survive_a_restart(open: Open<'_>) {
    let store = open("restart").await;
    let a = store
        .put("a", json!({"n": 1}), Precondition::None)
        .await
        .unwrap();
    let a = store
        .put("a", json!({"n": 2}), Precondition::MatchesVersion(a))
        .await
        .unwrap();
    let b = store
        .put("b", json!([1, 2, 3]), Precondition::None)
        .await
        .unwrap();
    drop(store);
    let store = open("restart").await;
    assert_eq!(
        store.get("a").await.unwrap(),
        Some(Versioned {
            version: a,
            value: json!({"n": 2})
        })
    );
    assert_eq!(
        store.get("b").await.unwrap(),
        Some(Versioned {
            version: b,
            value: json!([1, 2, 3])
        })
    );
    // Compare-and-swap goes on from the versions that were there.
    let after = store
        .put("b", json!(null), Precondition::MatchesVersion(b))
        .await
        .unwrap();
    assert!(
        after > b,
        "versions go up across a restart: {b}, then {after}"
    );
}
