//! Expired keys through a real `cairn` process: `cairnctl partitions compact` gives their space
//! back, every read finds them absent, and insert-if-absent admits each of them again once.

mod support;

use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry};
use std::time::Duration;
use support::{Server, cairnctl, created_id, ok, scrape};

const KEYS: usize = 1_000_000;
const BATCH: usize = 10_000;
/// Requests in flight at once.
const CONCURRENCY: usize = 4;

fn key(i: usize) -> Bytes {
    Bytes::from(format!("dedup-{i:08}"))
}

/// Runs `request` for every batch of [`KEYS`], [`CONCURRENCY`] at a time, results in key order.
async fn for_all_keys<T, F, Fut>(request: F) -> Vec<T>
where
    F: Fn(Vec<Bytes>) -> Fut,
    Fut: std::future::Future<Output = Vec<T>>,
{
    use futures::StreamExt;
    let batches = (0..KEYS)
        .step_by(BATCH)
        .map(|from| (from..(from + BATCH).min(KEYS)).map(key).collect());
    futures::stream::iter(batches)
        .map(request)
        .buffered(CONCURRENCY)
        .collect::<Vec<Vec<T>>>()
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The partitions' store sizes, summed: (bytes in SST files, bytes in memtables).
async fn store_bytes(client: &Client) -> (u64, u64) {
    let mut total = (0, 0);
    for id in 0..16 {
        let store = client.describe_partition(id).await.unwrap().store.unwrap();
        total.0 += store.live_sst_bytes;
        total.1 += store.memtable_bytes;
    }
    total
}

/// Bytes of the SST files a snapshot lists in its metadata.
fn snapshot_bytes(address: &str, id: &str) -> u64 {
    let metadata: serde_json::Value =
        serde_json::from_str(&ok(cairnctl(address, &["snapshots", "describe", id]))).unwrap();
    metadata["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["size"].as_u64().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_keys_are_reclaimed_by_compaction_and_admitted_again_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let a = server.address.clone();
    let client = Client::connect(&a, &ClientOptions::default())
        .await
        .unwrap();

    // A million keys with a 1 s TTL, each with a value of its own so that compression does not
    // hide them.
    for_all_keys(|keys| {
        let client = client.clone();
        async move {
            let entries = keys
                .into_iter()
                .map(|k| PutEntry {
                    value: Bytes::from(format!("value of {k:?} ").repeat(3)),
                    key: k,
                    ttl: Some(Duration::from_secs(1)),
                })
                .collect();
            client.put(entries).await.unwrap();
            Vec::<()>::new()
        }
    })
    .await;
    let (sst_before, memtables_before) = store_bytes(&client).await;
    let before = sst_before + memtables_before;
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    let (described, out, snapshots) = tokio::task::spawn_blocking({
        let a = a.clone();
        move || {
            let described = ok(cairnctl(&a, &["partitions", "describe", "-p", "0"]));
            let before = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
            let out = ok(cairnctl(&a, &["partitions", "compact"]));
            let after = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
            (described, out, [before, after])
        }
    })
    .await
    .unwrap();
    // Every value has expired, and the sample says so before anything is reclaimed.
    assert!(
        described.contains("~100.0% not yet reclaimed"),
        "{described}"
    );
    assert!(out.contains("expired values dropped"), "{out}");
    let (after, _) = store_bytes(&client).await;
    assert!(
        after * 20 < before,
        "compacting {KEYS} expired keys left {after} bytes of SST files out of {before} \
         ({sst_before} in SST files and {memtables_before} in memtables before); output: {out}"
    );
    eprintln!("{KEYS} expired keys: {before} bytes before compaction, {after} after");
    let dropped: u64 = {
        let mut total = 0;
        for id in 0..16 {
            total += client
                .describe_partition(id)
                .await
                .unwrap()
                .store
                .unwrap()
                .expired_dropped;
        }
        total
    };
    assert_eq!(dropped, KEYS as u64, "values the compaction filter dropped");
    let metrics = scrape(&server);
    let counted: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("cairn_partition_expired_values_dropped_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(
        counted, KEYS as f64,
        "the metric of dropped values:\n{metrics}"
    );

    // A snapshot carries what compaction left.
    let [before, after] = snapshots.clone().map(|id| snapshot_bytes(&a, &id));
    assert!(
        after * 20 < before,
        "partition 0's snapshot after compaction holds {after} bytes, before {before}"
    );
    // Restored from it, partition 0 replays its log and its keys behave as everywhere else below.
    tokio::task::spawn_blocking({
        let (a, id) = (a.clone(), snapshots[1].clone());
        move || {
            ok(cairnctl(
                &a,
                &[
                    "--yes",
                    "partitions",
                    "restore",
                    "-p",
                    "0",
                    "--snapshot",
                    &id,
                ],
            ))
        }
    })
    .await
    .unwrap();

    let values = for_all_keys(|keys| {
        let client = client.clone();
        async move { client.get(keys).await.unwrap() }
    })
    .await;
    assert!(
        values.iter().all(Option::is_none),
        "{} expired keys still read as present",
        values.iter().filter(|v| v.is_some()).count()
    );

    // Each expired key is free again, for exactly one insert.
    for round in 0..2 {
        let inserted = for_all_keys(|keys| {
            let client = client.clone();
            async move {
                client
                    .insert_if_absent(keys, Bytes::from_static(b"again"), None)
                    .await
                    .unwrap()
            }
        })
        .await;
        let admitted = inserted.iter().filter(|i| **i).count();
        let expected = if round == 0 { KEYS } else { 0 };
        assert_eq!(admitted, expected, "keys admitted in round {round}");
    }
    server.stop();
}
