//! SIGKILL the server while clients write; after a restart every acknowledged write is there and
//! insert-if-absent never admitted a key twice.

mod support;

use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use support::Server;

const WRITERS: usize = 8;
/// Keys that every writer races to insert.
const CONTESTED_KEYS: usize = 15_000;

#[derive(Default)]
struct Acknowledged {
    /// key → value of every acknowledged put.
    puts: HashMap<Bytes, Bytes>,
    /// contested key → writers told "you inserted it".
    winners: HashMap<Bytes, Vec<usize>>,
}

fn contested(i: usize) -> Bytes {
    Bytes::from(format!("dedup-{i}"))
}

async fn write_until_stopped(
    address: String,
    writer: usize,
    round: usize,
    stop: Arc<AtomicBool>,
) -> Acknowledged {
    let mut acked = Acknowledged::default();
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
    };
    let Ok(client) = Client::connect(&address, &options).await else {
        return acked;
    };
    let mut seq = 0usize;
    while !stop.load(Ordering::Relaxed) {
        seq += 1;
        let batch: Vec<PutEntry> = (0..4)
            .map(|j| PutEntry {
                key: Bytes::from(format!("r{round}-w{writer}-{seq}-{j}")),
                value: Bytes::from(format!("v{seq}-{j}")),
                ttl: None,
            })
            .collect();
        let pairs: Vec<(Bytes, Bytes)> = batch
            .iter()
            .map(|e| (e.key.clone(), e.value.clone()))
            .collect();
        if client.put(batch).await.is_ok() {
            acked.puts.extend(pairs);
        }
        let keys: Vec<Bytes> = (0..5)
            .map(|j| contested((seq * 7 + writer * 13 + j) % CONTESTED_KEYS))
            .collect();
        let value = Bytes::from(format!("w{writer}"));
        if let Ok(inserted) = client.insert_if_absent(keys.clone(), value, None).await {
            for (key, won) in keys.into_iter().zip(inserted) {
                if won {
                    acked.winners.entry(key).or_default().push(writer);
                }
            }
        }
    }
    acked
}

/// `WRITERS` clients of `address` writing round `round`'s keys until `stop` is set.
fn spawn_writers(
    address: &str,
    round: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Acknowledged>> {
    (0..WRITERS)
        .map(|w| {
            tokio::spawn(write_until_stopped(
                address.to_string(),
                w,
                round,
                stop.clone(),
            ))
        })
        .collect()
}

/// Waits for `writers` and adds what they were acknowledged to `all`.
async fn collect(writers: Vec<tokio::task::JoinHandle<Acknowledged>>, all: &mut Acknowledged) {
    for writer in writers {
        let acked = writer.await.unwrap();
        all.puts.extend(acked.puts);
        for (key, ws) in acked.winners {
            all.winners.entry(key).or_default().extend(ws);
        }
    }
}

/// Three rounds of: a server from `start`, `WRITERS` clients writing, SIGKILL mid-write (the
/// writers are still sending). Returns what the clients were acknowledged.
async fn killed_mid_write(start: impl Fn() -> Server) -> Acknowledged {
    let mut all = Acknowledged::default();
    for round in 0..3 {
        let server = start();
        let stop = Arc::new(AtomicBool::new(false));
        let writers = spawn_writers(&server.address, round, &stop);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        server.kill();
        stop.store(true, Ordering::Relaxed);
        collect(writers, &mut all).await;
    }
    assert!(
        all.puts.len() > 100,
        "too few writes acknowledged to mean anything: {}",
        all.puts.len()
    );
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_writes_survive_sigkill_and_dedup_holds() {
    let dir = tempfile::tempdir().unwrap();
    let all = killed_mid_write(|| Server::start(dir.path())).await;
    assert!(!all.winners.is_empty());

    let server = Server::start(dir.path());
    assert_all_acknowledged(&server.address, &all).await;
    eprintln!(
        "checked {} acknowledged puts and {} admitted keys across 3 SIGKILLs",
        all.puts.len(),
        all.winners.len()
    );
}

/// The same with the partitions' logs and the cluster's metadata in NATS: the node is killed
/// mid-write three times, and then a node of the same name on an empty base dir, as on a new
/// machine, serves every acknowledged write, and admits no contested key twice, from what NATS
/// kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_log_in_nats_acknowledged_writes_survive_sigkill_and_the_loss_of_the_node() {
    let nats_dir = tempfile::tempdir().unwrap();
    let nats = cairn_metadata::test_util::NatsServer::start(nats_dir.path(), 0);
    let dir = tempfile::tempdir().unwrap();
    let config = support::nats_log_config(dir.path(), &nats.url());
    let args = ["--config", config.to_str().unwrap()];
    let all = killed_mid_write(|| Server::start_with(&dir.path().join("n1"), &args, &[])).await;

    let server = Server::start_with(&dir.path().join("n1"), &args, &[]);
    assert_all_acknowledged(&server.address, &all).await;
    server.kill();
    // The replacement takes the lost node's name once that one has been silent long enough to
    // count as dead (a node of that name still heartbeating is refused).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let fresh = Server::start_with(&dir.path().join("new-machine"), &args, &[]);
    assert_all_acknowledged(&fresh.address, &all).await;
    eprintln!(
        "checked {} acknowledged puts and {} admitted keys across 3 SIGKILLs and a new machine",
        all.puts.len(),
        all.winners.len()
    );
}

/// A NATS server of three is killed (SIGKILL) while clients write to a node whose logs and
/// metadata are replicated three times across them: the node goes on with the other two, and
/// every acknowledged write is there, no contested key admitted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_log_in_nats_losing_a_nats_server_loses_no_acknowledged_write() {
    let nats_dir = tempfile::tempdir().unwrap();
    let mut nats = cairn_metadata::test_util::NatsCluster::start(nats_dir.path());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cairn.toml");
    let servers = nats.toml_servers();
    std::fs::write(
        &config,
        format!(
            "[log]\nprovider = \"nats\"\n[metadata]\nprovider = \"nats\"\n\
             [nats]\nservers = [{servers}]\nreplicas = 3\n\
             [worker.snapshots]\ndestination = \"{}\"\n",
            dir.path().join("repository").display()
        ),
    )
    .unwrap();
    let args = ["--config", config.to_str().unwrap()];
    let server = Server::start_with(&dir.path().join("n1"), &args, &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&server.address, 0, &stop);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // SIGKILL (the helper's drop) of one server, mid-write.
    drop(nats.servers.remove(0));
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Acknowledged::default();
    collect(writers, &mut all).await;
    assert!(
        all.puts.len() > 100,
        "too few writes acknowledged to mean anything: {}",
        all.puts.len()
    );
    assert_all_acknowledged(&server.address, &all).await;
    // And it still takes writes.
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();
    client
        .put(vec![PutEntry {
            key: Bytes::from("after"),
            value: Bytes::from("the loss"),
            ttl: None,
        }])
        .await
        .unwrap();
    eprintln!(
        "checked {} acknowledged puts and {} admitted keys across the loss of a NATS server",
        all.puts.len(),
        all.winners.len()
    );
}

/// `call`'s answer, sent again while it is `UNAVAILABLE` (which says nothing was done: a log
/// in NATS that just lost a server may refuse an append once, until its writer has found the
/// stream's tail again), for up to 10 s.
async fn until_available<T, F, Fut>(call: F) -> T
where
    F: Fn() -> Fut,
    Fut: Future<Output = cairn_client::Result<T>>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match call().await {
            Ok(answer) => return answer,
            Err(err)
                if err.code() == Some(cairn_client::Code::Unavailable)
                    && std::time::Instant::now() < deadline =>
            {
                eprintln!("retrying: {err}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("{err}"),
        }
    }
}

/// Every acknowledged put reads back, and no contested key was admitted to two writers.
async fn assert_all_acknowledged(address: &str, all: &Acknowledged) {
    let client = Client::connect(address, &ClientOptions::default())
        .await
        .unwrap();

    let keys: Vec<Bytes> = all.puts.keys().cloned().collect();
    for chunk in keys.chunks(1000) {
        let values = client.get(chunk.to_vec()).await.unwrap();
        for (key, value) in chunk.iter().zip(values) {
            assert_eq!(
                value.as_ref(),
                all.puts.get(key),
                "acknowledged put of {key:?} lost"
            );
        }
    }

    for (key, winners) in &all.winners {
        assert_eq!(
            winners.len(),
            1,
            "{key:?} was admitted to writers {winners:?}"
        );
        // The stored value names the one writer that was told it won.
        let stored = client.get(vec![key.clone()]).await.unwrap().remove(0);
        assert_eq!(
            stored,
            Some(Bytes::from(format!("w{}", winners[0]))),
            "{key:?}"
        );
    }
    // Every contested key, won or not yet: a new attempt never wins a key already admitted.
    let contested_keys: Vec<Bytes> = (0..CONTESTED_KEYS).map(contested).collect();
    for chunk in contested_keys.chunks(5_000) {
        let again =
            until_available(|| client.insert_if_absent(chunk.to_vec(), Bytes::from("late"), None))
                .await;
        for (key, won) in chunk.iter().zip(again) {
            if all.winners.contains_key(key) {
                assert!(!won, "{key:?} admitted twice after restart");
            }
        }
    }
}

/// The partition store keeps no write-ahead log: what it applied since its last flush lives in
/// memtables only. A SIGKILL loses them, and the restart rebuilds them from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_lost_its_memtables_to_sigkill_is_rebuilt_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let keys: Vec<String> = (0..3000).map(|i| format!("unflushed-{i}")).collect();
    support::put_keys(&server.address, &keys, 100).await;
    let applied_before = support::partition_columns(&server.address, 0)[4].clone();
    server.kill();

    let server = Server::start(dir.path());
    support::assert_keys_there(&server.address, &keys).await;
    let columns = support::partition_columns(&server.address, 0);
    assert_eq!(columns[8], "active", "{columns:?}");
    // The announcement of the restart comes on top of what was applied before.
    assert!(
        columns[4].parse::<u64>().unwrap() > applied_before.parse::<u64>().unwrap(),
        "{columns:?} (applied before the kill: {applied_before})"
    );
}

/// Trimming a log first flushes what its store applied: a SIGKILL right after the trim loses the
/// memtables, and the records that rebuild them must still be in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trim_followed_by_sigkill_loses_nothing_the_store_had_not_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let keys = support::keys_of_partition("trimmed", 0, 400);
    support::put_keys(&server.address, &keys, 20).await;
    trim_partition_0_to_applied_then_restart(server, dir.path(), &keys, Server::kill).await;
}

/// Trims partition 0's log up to what it applied, stops the server with `stop` (a SIGKILL or a
/// clean stop), starts it again and checks that the partition serves `keys`.
async fn trim_partition_0_to_applied_then_restart(
    server: Server,
    dir: &std::path::Path,
    keys: &[String],
    stop: fn(Server),
) {
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();
    let applied: u64 = support::partition_columns(&server.address, 0)[4]
        .parse()
        .unwrap();
    // No snapshot covers the records, hence `force`.
    client.trim_log(0, applied, true).await.unwrap();
    stop(server);

    let server = Server::start(dir);
    let columns = support::partition_columns(&server.address, 0);
    assert_eq!(columns[8], "active", "{columns:?}");
    support::assert_keys_there(&server.address, keys).await;
}

/// Records that change nothing (insert-if-absent of keys already there) still move the applied
/// LSN the store keeps: a trim up to what the partition applied, then a restart, finds the store
/// at that LSN rather than behind the trim point with a gap no snapshot fills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trim_past_records_that_changed_nothing_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let keys = support::keys_of_partition("present", 0, 20);
    support::put_keys(&server.address, &keys, 20).await;
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();
    for key in &keys {
        let inserted = client
            .insert_if_absent(vec![Bytes::from(key.clone())], Bytes::from("again"), None)
            .await
            .unwrap();
        assert_eq!(inserted, vec![false], "{key} is there already");
    }
    drop(client);
    trim_partition_0_to_applied_then_restart(server, dir.path(), &keys, Server::stop).await;
}

/// SIGKILL while segments roll every megabyte, snapshots follow every few records and the
/// background trimmer trims the logs and deletes their segments: after each restart every
/// partition serves and every acknowledged write is there, whatever the store had flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_amid_rollover_automatic_snapshots_and_trims_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("CAIRN_LOG__SEGMENT_BYTES", "1048576"),
        (
            "CAIRN_WORKER__SNAPSHOTS__SNAPSHOT_INTERVAL_NUM_RECORDS",
            "40",
        ),
        ("CAIRN_WORKER__SNAPSHOTS__NUM_RETAINED", "2"),
        ("CAIRN_WORKER__TRIM_LOG_INTERVAL", "300ms"),
        ("CAIRN_WORKER__TRIM_LOG_DELAY", "0s"),
    ];
    let mut all = Acknowledged::default();
    for (round, run_ms) in [1800u64, 2700, 1300, 3100].into_iter().enumerate() {
        let server = Server::start_with(dir.path(), &[], &env);
        for id in 0..16 {
            let columns = support::partition_columns(&server.address, id);
            assert_eq!(columns[8], "active", "round {round}: {columns:?}");
        }
        assert_all_acknowledged(&server.address, &all).await;
        let stop = Arc::new(AtomicBool::new(false));
        let writers = spawn_writers(&server.address, round, &stop);
        tokio::time::sleep(Duration::from_millis(run_ms)).await;
        server.kill();
        stop.store(true, Ordering::Relaxed);
        collect(writers, &mut all).await;
    }
    let server = Server::start_with(dir.path(), &[], &env);
    for id in 0..16 {
        let columns = support::partition_columns(&server.address, id);
        assert_eq!(columns[8], "active", "{columns:?}");
        assert!(
            columns[5].parse::<u64>().unwrap() > 0,
            "trimmed: {columns:?}"
        );
    }
    assert_all_acknowledged(&server.address, &all).await;
}

/// SIGTERM while clients write: the node stops cleanly and in bounded time (no processor, log
/// writer or syncer left waiting on another), and a restart serves every acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_under_load_stops_cleanly_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut all = Acknowledged::default();
    for round in 0..2 {
        let server = Server::start(dir.path());
        let stop = Arc::new(AtomicBool::new(false));
        let writers = spawn_writers(&server.address, round, &stop);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let stopping = tokio::task::spawn_blocking(move || server.stop());
        tokio::time::timeout(Duration::from_secs(30), stopping)
            .await
            .expect("the node stops within 30 s of SIGTERM")
            .expect("a clean exit");
        stop.store(true, Ordering::Relaxed);
        collect(writers, &mut all).await;
    }
    assert!(all.puts.len() > 100, "{} puts acknowledged", all.puts.len());
    let server = Server::start(dir.path());
    assert_all_acknowledged(&server.address, &all).await;
}

/// Trims of every partition's log up to what it applied, all at once and over and over, while
/// clients write and segments roll; then SIGKILL. Each trim flushed its store first, so after the
/// restart no store is behind its log's trim point: every partition serves everything
/// acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_trims_to_the_applied_lsn_under_load_then_sigkill_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let env = [("CAIRN_LOG__SEGMENT_BYTES", "1048576")];
    let mut all = Acknowledged::default();
    for round in 0..2 {
        let server = Server::start_with(dir.path(), &[], &env);
        let stop = Arc::new(AtomicBool::new(false));
        let writers = spawn_writers(&server.address, round, &stop);
        let trimmers: Vec<_> = (0..16u16)
            .map(|id| {
                let address = server.address.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    let client = Client::connect(&address, &ClientOptions::default())
                        .await
                        .unwrap();
                    let mut trims = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let applied = client
                            .list_partitions()
                            .await
                            .ok()
                            .and_then(|l| {
                                l.partitions
                                    .into_iter()
                                    .find(|p| p.partition_id == u32::from(id))
                            })
                            .map_or(0, |p| p.applied_lsn);
                        if applied > 0 && client.trim_log(id.into(), applied, true).await.is_ok() {
                            trims += 1;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    trims
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        server.kill();
        stop.store(true, Ordering::Relaxed);
        let mut trims = 0;
        for trimmer in trimmers {
            trims += trimmer.await.unwrap();
        }
        assert!(trims > 16, "{trims} trims");
        collect(writers, &mut all).await;
    }
    let server = Server::start_with(dir.path(), &[], &env);
    for id in 0..16 {
        let columns = support::partition_columns(&server.address, id);
        assert_eq!(columns[8], "active", "{columns:?}");
    }
    assert_all_acknowledged(&server.address, &all).await;
}

/// Clients that give up on their requests (a timeout shorter than a commit) while the processors
/// apply them: the node goes on serving, and a key admitted by an abandoned insert-if-absent is
/// never admitted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_giving_up_mid_request_leave_the_node_serving_and_dedup_intact() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let impatient = ClientOptions {
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_micros(300),
    };
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let address = server.address.clone();
            let options = impatient.clone();
            tokio::spawn(async move {
                let client = Client::connect(&address, &options).await.unwrap();
                let mut told_won = Vec::new();
                for i in 0..200usize {
                    let keys: Vec<Bytes> = (0..10).map(|j| contested(i * 10 + j)).collect();
                    if let Ok(inserted) = client
                        .insert_if_absent(keys.clone(), Bytes::from(format!("t{t}")), None)
                        .await
                    {
                        told_won.extend(keys.into_iter().zip(inserted).filter(|(_, w)| *w));
                    }
                }
                told_won
            })
        })
        .collect();
    let mut winners: HashMap<Bytes, usize> = HashMap::new();
    for task in tasks {
        for (key, _) in task.await.unwrap() {
            *winners.entry(key).or_default() += 1;
        }
    }
    assert!(winners.values().all(|n| *n == 1), "a key admitted twice");
    for id in 0..16 {
        let columns = support::partition_columns(&server.address, id);
        assert_eq!(columns[8], "active", "{columns:?}");
    }
    // Every abandoned insert either took effect or not; none is admitted again now.
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();
    let keys: Vec<Bytes> = (0..2000).map(contested).collect();
    let stored = client.get(keys.clone()).await.unwrap();
    let again = client
        .insert_if_absent(keys.clone(), Bytes::from("late"), None)
        .await
        .unwrap();
    let abandoned_but_applied = stored.iter().flatten().count() - winners.len();
    assert!(
        abandoned_but_applied > 0,
        "no abandoned insert reached the processor ({} answered)",
        winners.len()
    );
    for ((key, stored), won) in keys.iter().zip(stored).zip(again) {
        assert_eq!(won, stored.is_none(), "{key:?}");
        if winners.contains_key(key) {
            assert!(stored.is_some(), "{key:?} was admitted but is not stored");
        }
    }
    server.stop();
}

/// SIGTERM while the partitions replay their logs at start-up (the store lost its memtables to a
/// SIGKILL): the node waits for every processor it started, those still replaying too, and exits
/// cleanly; RocksDB aborts the process when one is still applying records as it exits. Nothing
/// is lost for the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_the_replay_at_start_up_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    // One key per partition per request: about 2,500 records per partition to replay, which
    // take each partition's processor a while.
    let keys: Vec<String> = (0..40_000).map(|i| format!("replayed-{i}")).collect();
    support::put_keys(&server.address, &keys, 16).await;
    server.kill();

    for _ in 0..3 {
        let replaying = Server::start_until(dir.path(), &[], &[], "partition processor started");
        // `stop` fails unless the process exits with status 0.
        replaying.stop();
    }
    let server = Server::start(dir.path());
    support::assert_keys_there(&server.address, &keys).await;
    server.stop();
}
