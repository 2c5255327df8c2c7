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

/// Runs `request` for every batch of the first `n` keys, [`CONCURRENCY`] at a time, results in
/// key order.
async fn for_keys<T, F, Fut>(n: usize, request: F) -> Vec<T>
where
    F: Fn(Vec<Bytes>) -> Fut,
    Fut: std::future::Future<Output = Vec<T>>,
{
    use futures::StreamExt;
    let batches = (0..n)
        .step_by(BATCH)
        .map(move |from| (from..(from + BATCH).min(n)).map(key).collect());
    futures::stream::iter(batches)
        .map(request)
        .buffered(CONCURRENCY)
        .collect::<Vec<Vec<T>>>()
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Writes the first `n` keys with `ttl`, each with a value of its own so that compression does
/// not hide them.
async fn put_keys_expiring(client: &Client, n: usize, ttl: Option<Duration>) {
    for_keys(n, |keys| {
        let client = client.clone();
        async move {
            let entries = keys
                .into_iter()
                .map(|k| PutEntry {
                    value: Bytes::from(format!("value of {k:?} ").repeat(3)),
                    key: k,
                    ttl,
                })
                .collect();
            client.put(entries).await.unwrap();
            Vec::<()>::new()
        }
    })
    .await;
}

/// Writes 1,000 keys that never expire, each holding itself.
async fn put_kept(client: &Client) -> Vec<Bytes> {
    let kept: Vec<Bytes> = (0..1_000)
        .map(|i| Bytes::from(format!("kept-{i}")))
        .collect();
    let entries = kept
        .iter()
        .map(|k| PutEntry {
            key: k.clone(),
            value: k.clone(),
            ttl: None,
        })
        .collect();
    client.put(entries).await.unwrap();
    kept
}

async fn assert_kept(client: &Client, kept: &[Bytes]) {
    let values = client.get(kept.to_vec()).await.unwrap();
    let lost = kept
        .iter()
        .zip(&values)
        .filter(|(k, v)| v.as_ref() != Some(k));
    assert_eq!(lost.count(), 0, "keys that never expire were lost");
}

/// Asserts that every one of the first `n` keys reads as absent.
async fn assert_all_absent(client: &Client, n: usize) {
    let values = for_keys(n, |keys| {
        let client = client.clone();
        async move { client.get(keys).await.unwrap() }
    })
    .await;
    assert!(
        values.iter().all(Option::is_none),
        "{} expired keys still read as present",
        values.iter().filter(|v| v.is_some()).count()
    );
}

/// Insert-if-absent of the first `n` keys twice: how many each round admitted.
async fn admit_twice(client: &Client, n: usize) -> [usize; 2] {
    let mut admitted = [0; 2];
    for count in &mut admitted {
        let inserted = for_keys(n, |keys| {
            let client = client.clone();
            async move {
                client
                    .insert_if_absent(keys, Bytes::from_static(b"again"), None)
                    .await
                    .unwrap()
            }
        })
        .await;
        *count = inserted.iter().filter(|i| **i).count();
    }
    admitted
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

    // A million keys with a 1 s TTL, and a few that never expire.
    put_keys_expiring(&client, KEYS, Some(Duration::from_secs(1))).await;
    let kept = put_kept(&client).await;
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
    // All but 0.1% of the values have expired, and the sample says so before anything is
    // reclaimed.
    let expired_share: f64 = described
        .lines()
        .find_map(|l| l.split_once("~")?.1.split_once("% not yet reclaimed"))
        .and_then(|(share, _)| share.parse().ok())
        .unwrap_or_else(|| panic!("no share of expired values in:\n{described}"));
    assert!(expired_share >= 99.0, "{described}");
    // Whether RocksDB holds the partition's writes back: keeping up or behind, by the node's word.
    assert!(
        described.lines().any(|l| l.starts_with("compactions ")),
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

    assert_all_absent(&client, KEYS).await;

    assert_kept(&client, &kept).await;

    // Each expired key is free again, for exactly one insert.
    assert_eq!(
        admit_twice(&client, KEYS).await,
        [KEYS, 0],
        "keys admitted by each round"
    );
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_compacting_loses_nothing_and_admits_expired_keys_once() {
    const EXPIRING: usize = 200_000;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();
    put_keys_expiring(&client, EXPIRING, Some(Duration::from_secs(1))).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let kept = put_kept(&client).await;

    // SIGKILL while `partitions compact` runs.
    let mut compact = std::process::Command::new(env!("CARGO_BIN_EXE_cairnctl"))
        .args(["--address", &server.address, "partitions", "compact"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.kill();
    let _ = compact.wait();

    let server = Server::start(dir.path());
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();
    assert_kept(&client, &kept).await;
    assert_all_absent(&client, EXPIRING).await;
    assert_eq!(admit_twice(&client, EXPIRING).await, [EXPIRING, 0]);
    server.stop();
}
