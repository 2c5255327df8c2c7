//! The `nats` log provider against a real `nats-server` with JetStream, and against three of them
//! in a cluster: the conformance suite, and what only a log kept outside the node shows (a second
//! node reading what the first appends, two writers on one log, restarts of NATS).
//! `scripts/setup-debian.sh` installs `nats-server`; without it this test fails and says so.

use bytes::Bytes;
use cairn_log::nats::{NatsLogOptions, NatsLogProvider};
use cairn_log::{Entry, Error, LogProvider, LogState, Loglet};
use cairn_metadata::test_util::{NatsCluster, NatsServer};
use cairn_types::{LogId, Lsn};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static CLUSTERS: AtomicUsize = AtomicUsize::new(0);

/// A cluster name no other provider of this test process uses: its streams start empty.
fn fresh_cluster() -> String {
    format!(
        "t{}-{}",
        std::process::id(),
        CLUSTERS.fetch_add(1, Ordering::Relaxed)
    )
}

fn options(urls: &[String], cluster: &str, replicas: usize) -> NatsLogOptions {
    let mut options = NatsLogOptions::new(urls.to_vec(), cluster);
    options.replicas = replicas;
    options
}

/// Connects, retrying while JetStream comes up after a start or a restart.
async fn provider(options: NatsLogOptions) -> NatsLogProvider {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match NatsLogProvider::connect(options.clone()).await {
            Ok(provider) => return provider,
            Err(err) if Instant::now() < deadline => {
                eprintln!("retrying: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("{err}"),
        }
    }
}

/// Opens a log, retrying while JetStream elects the stream's leader.
async fn open(provider: &dyn LogProvider, id: u16) -> Arc<dyn Loglet> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match provider.open(LogId(id)).await {
            Ok(log) => return log,
            Err(err) if Instant::now() < deadline => {
                eprintln!("retrying: {err}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("{err}"),
        }
    }
}

async fn conforms(urls: Vec<String>, replicas: usize) {
    // The cases open their logs once: wait until JetStream creates streams at all.
    let warm_up = provider(options(&urls, &fresh_cluster(), replicas)).await;
    open(&warm_up, 1).await;
    cairn_log::conformance::run_all(|| {
        let options = options(&urls, &fresh_cluster(), replicas);
        async move { Arc::new(provider(options).await) as Arc<dyn LogProvider> }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_provider_conforms_against_a_real_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start(dir.path(), 0);
    conforms(vec![server.url()], 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_provider_conforms_against_a_three_server_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = NatsCluster::start(dir.path());
    conforms(cluster.urls(), 3).await;
}

fn payload(text: impl std::fmt::Display) -> Bytes {
    Bytes::from(text.to_string())
}

/// Every record of `log` from `from` to its tail, as this node reads them.
async fn read_all(log: &Arc<dyn Loglet>, from: u64, tail: u64) -> Vec<Entry> {
    let mut entries = Vec::new();
    while (entries.len() as u64) < tail + 1 - from {
        let next = from + entries.len() as u64;
        tokio::time::timeout(Duration::from_secs(10), log.wait_for_tail(Lsn(next)))
            .await
            .expect("the tail reaches what was appended")
            .unwrap();
        let chunk = log.read(Lsn(next), 100).await.unwrap();
        assert!(!chunk.is_empty(), "LSN {next} is below the tail");
        entries.extend(chunk);
    }
    entries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_reads_what_the_first_appends_and_sees_its_trims() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = NatsCluster::start(dir.path());
    let name = fresh_cluster();
    let writer = provider(options(&cluster.urls()[..1], &name, 3)).await;
    let reader = provider(options(&cluster.urls()[2..], &name, 3)).await;
    let written = open(&writer, 1).await;
    let read = open(&reader, 1).await;

    // The reader waits at the tail; the writer's appends wake it.
    let waiting = tokio::spawn({
        let read = read.clone();
        async move { read_all(&read, 1, 500).await }
    });
    for i in 1..=500u64 {
        assert_eq!(
            written
                .append(vec![payload(format!("r{i}"))])
                .await
                .unwrap(),
            Lsn(i)
        );
    }
    let entries = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the reader sees every record")
        .unwrap();
    let expected: Vec<Entry> = (1..=500)
        .map(|i| Entry {
            lsn: Lsn(i),
            payload: payload(format!("r{i}")),
        })
        .collect();
    assert_eq!(entries, expected);
    assert_eq!(
        read.find_tail().await.unwrap(),
        LogState {
            trim_point: Lsn(0),
            tail: Lsn(500)
        }
    );

    // A trim by the writer is a gap for the reader, from memory or not.
    written.trim(Lsn(300)).await.unwrap();
    assert_eq!(read.find_tail().await.unwrap().trim_point, Lsn(300));
    assert!(matches!(
        read.read(Lsn(1), 10).await,
        Err(Error::Trimmed {
            trim_point: Lsn(300),
            ..
        })
    ));
    assert_eq!(read.read(Lsn(301), 1).await.unwrap(), expected[300..301]);
    // A third node that never saw the records reads them from the stream.
    let late = provider(options(&cluster.urls()[1..2], &name, 3)).await;
    let late = open(&late, 1).await;
    assert_eq!(read_all(&late, 301, 500).await, expected[300..]);
    assert!(matches!(
        late.read(Lsn(300), 10).await,
        Err(Error::Trimmed {
            trim_point: Lsn(300),
            ..
        })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_on_one_log_lose_nothing_acknowledged_and_store_nothing_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start(dir.path(), 0);
    let name = fresh_cluster();
    let mut logs = Vec::new();
    for _ in 0..2 {
        let provider = provider(options(&[server.url()], &name, 1)).await;
        logs.push((open(&provider, 1).await, provider));
    }
    // Each writer appends from 8 tasks at once, batches among single records.
    let mut tasks = Vec::new();
    for (w, (log, _)) in logs.iter().enumerate() {
        for t in 0..8 {
            let log = log.clone();
            tasks.push(tokio::spawn(async move {
                let mut acknowledged = Vec::new();
                let mut refused = 0;
                for i in 0..40 {
                    let size = if i % 4 == 0 { 3 } else { 1 };
                    let payloads: Vec<Bytes> = (0..size)
                        .map(|k| payload(format!("w{w}-t{t}-a{i}-r{k}")))
                        .collect();
                    match log.append(payloads.clone()).await {
                        Ok(last) => acknowledged.push((last, payloads)),
                        Err(Error::TailMoved { .. }) => refused += 1,
                        Err(err) => panic!("append: {err}"),
                    }
                }
                (acknowledged, refused)
            }));
        }
    }
    let mut acknowledged = Vec::new();
    let mut refused = 0;
    for task in tasks {
        let (a, r) = task.await.unwrap();
        acknowledged.extend(a);
        refused += r;
    }
    eprintln!(
        "{} appends acknowledged, {refused} refused",
        acknowledged.len()
    );
    let (log, _) = &logs[0];
    let tail = log.find_tail().await.unwrap().tail.0;
    let entries = read_all(log, 1, tail).await;
    // Exactly the acknowledged records, each batch back to back at the LSNs it was given.
    let stored: HashMap<Bytes, Lsn> = entries.iter().map(|e| (e.payload.clone(), e.lsn)).collect();
    assert_eq!(stored.len(), entries.len(), "no record is stored twice");
    let mut count = 0;
    for (last, payloads) in &acknowledged {
        let first = last.0 + 1 - payloads.len() as u64;
        for (k, p) in payloads.iter().enumerate() {
            assert_eq!(stored.get(p), Some(&Lsn(first + k as u64)), "{p:?}");
            count += 1;
        }
    }
    assert_eq!(count, entries.len(), "every stored record was acknowledged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_and_the_trim_point_survive_restarts_of_nats_and_of_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = NatsServer::start(dir.path(), 0);
    let name = fresh_cluster();
    let urls = vec![server.url()];
    {
        let provider = provider(options(&urls, &name, 1)).await;
        let log = open(&provider, 1).await;
        let batch: Vec<Bytes> = (1..=10).map(|i| payload(format!("s{i}"))).collect();
        assert_eq!(log.append(batch).await.unwrap(), Lsn(10));
        log.trim(Lsn(4)).await.unwrap();
        // A second log trimmed to its end: the stream is empty, its trim point must stay.
        let empty = open(&provider, 2).await;
        empty
            .append(vec![payload("a"), payload("b")])
            .await
            .unwrap();
        empty.trim(Lsn(2)).await.unwrap();
    }
    server.restart();
    let provider = provider(options(&urls, &name, 1)).await;
    let log = open(&provider, 1).await;
    assert_eq!(
        log.state().await.unwrap(),
        LogState {
            trim_point: Lsn(4),
            tail: Lsn(10)
        }
    );
    let entries = read_all(&log, 5, 10).await;
    assert_eq!(
        entries.iter().map(|e| e.lsn.0).collect::<Vec<_>>(),
        (5..=10).collect::<Vec<_>>()
    );
    assert_eq!(entries[0].payload, payload("s5"));
    let empty = open(&provider, 2).await;
    assert_eq!(
        empty.state().await.unwrap(),
        LogState {
            trim_point: Lsn(2),
            tail: Lsn(2)
        }
    );
    assert_eq!(empty.append(vec![payload("c")]).await.unwrap(), Lsn(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_append_stops_neither_reads_nor_later_appends() {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start(dir.path(), 0);
    let name = fresh_cluster();
    let provider = provider(options(&[server.url()], &name, 1)).await;
    let log = open(&provider, 1).await;
    // JetStream refuses every message while the stream's largest message is one byte.
    let client = async_nats::connect(server.url()).await.unwrap();
    let jetstream = async_nats::jetstream::new(client);
    let stream_name = cairn_log::nats::stream_name(&name, LogId(1));
    let fail = move |failing: bool| {
        let jetstream = jetstream.clone();
        let stream_name = stream_name.clone();
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async move {
                let mut stream = jetstream.get_stream(&stream_name).await.unwrap();
                let mut config = stream.info().await.unwrap().config.clone();
                config.max_message_size = if failing { 1 } else { -1 };
                jetstream.update_stream(config).await.unwrap();
            })
        })
    };
    cairn_log::conformance::a_failed_append_stops_neither_reads_nor_later_appends(log, &fail).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_larger_than_a_nats_message_is_refused_saying_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start(dir.path(), 0);
    let provider = provider(options(&[server.url()], &fresh_cluster(), 1)).await;
    let log = open(&provider, 1).await;
    let err = log
        .append(vec![Bytes::from(vec![7u8; 2 << 20])])
        .await
        .unwrap_err();
    match &err {
        Error::RecordTooLarge { size, limit, .. } => {
            assert_eq!(*size, 2 << 20);
            assert!(*limit < 1 << 20, "NATS's default max_payload is 1 MiB");
        }
        other => panic!("expected RecordTooLarge, got {other}"),
    }
    assert_eq!(log.append(vec![payload("fits")]).await.unwrap(), Lsn(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_far_behind_reads_everything_through_a_small_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start(dir.path(), 0);
    let name = fresh_cluster();
    let writer = provider(options(&[server.url()], &name, 1)).await;
    let written = open(&writer, 1).await;
    // 2 MiB of 4 KiB records, read by another node whose buffer holds 64 KiB: its tailer must
    // wait for room and go on as the reader reads, never stall.
    let records: Vec<Bytes> = (0..512u32)
        .map(|i| Bytes::from(vec![(i % 251) as u8; 4096]))
        .collect();
    for chunk in records.chunks(16) {
        written.append(chunk.to_vec()).await.unwrap();
    }
    let mut small = options(&[server.url()], &name, 1);
    small.cache_bytes = 64 << 10;
    let reader = provider(small).await;
    let read = open(&reader, 1).await;
    let entries = tokio::time::timeout(Duration::from_secs(60), read_all(&read, 1, 512))
        .await
        .expect("the reader gets every record");
    assert_eq!(
        entries.into_iter().map(|e| e.payload).collect::<Vec<_>>(),
        records
    );
}
