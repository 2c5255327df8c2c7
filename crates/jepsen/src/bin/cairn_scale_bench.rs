//! `cairn-scale-bench`: what scaling a loaded cluster from three nodes to four costs.
//!
//! A real three-node cluster (three `nats-server`s, moto as the shared snapshot repository,
//! `cairn` nodes) is filled with `--gib` of incompressible values and every partition is
//! snapshotted; then, under a steady load of batched puts and a probe per partition that writes
//! one key over and over, a fourth node joins and the scaling operation that `cairnctl cluster
//! scale` runs moves its share onto it: the current leaders upload fresh snapshots of what
//! moves (incremental), and the operation is started from the plan. Printed:
//! - the bytes the new holders downloaded ÷ the minimum (the moved partitions' snapshot sizes
//!   in the plan after the upload), and the log records they replayed past them;
//! - the operation's total time, the upload's, and the restores' throughput (bytes ÷ the summed
//!   time of each restore) ÷ a plain GET of the same files from the same bucket, one partition
//!   at a time with the restore's concurrency, run just after under the same load;
//! - per partition whose leader moved, the longest gap between two acknowledged probe writes
//!   during the operation (the cutover's write pause): p50 and max, with the largest gap of the
//!   partitions that did not move beside them;
//! - the load's throughput before, during and after the operation, and during ÷ before.
//!
//! Build it and `cairn` in release for figures worth reading.

use anyhow::{Context, bail};
use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry, RoutingClient, RoutingOptions, v1};
use cairn_jepsen::measure::{Load, keys_per_partition, percentile};
use cairn_jepsen::{ClusterOptions, TestCluster, snapshot, snapshot_file_keys};
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Parser, Debug)]
#[command(about = "Scaling a loaded Cairn cluster from three nodes to four")]
struct Args {
    /// Data written before the scale, in GiB.
    #[arg(long, default_value_t = 1.0)]
    gib: f64,
    /// Bytes per value of the data written before.
    #[arg(long, default_value_t = 1000)]
    value_bytes: usize,
    #[arg(long, default_value_t = 8)]
    partitions: u16,
    /// Load clients during the operation, each with one batch in flight.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Keys per batched put of the load (100-byte values).
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Seconds of load measured before and after the operation.
    #[arg(long, default_value_t = 10)]
    window_secs: u64,
    /// Partitions moved at once.
    #[arg(long, default_value_t = 2)]
    max_concurrent_moves: u32,
    /// The `cairn` binary (default: the one beside this binary).
    #[arg(long)]
    cairn_bin: Option<PathBuf>,
}

/// Concurrent writers of the data written before the scale.
const FILLERS: usize = 8;
/// Keys per put of the data written before.
const FILL_BATCH: u64 = 64;
/// Distinct random values the fill cycles through: enough that no compression block repeats one.
const FILL_VALUES: usize = 1024;
/// Files fetched at once by the plain GET, as a restore fetches them (the repository's default
/// transfer concurrency).
const PLAIN_CONCURRENCY: usize = 8;
/// Failures of the load shown per period.
const FAILURES_SHOWN: usize = 3;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.gib > 0.0, "--gib must be positive");
    let cairn_bin = cairn_jepsen::cairn_bin(args.cairn_bin.clone())?;
    let dir = tempfile::tempdir()?;
    let mut cluster = TestCluster::start(ClusterOptions {
        cairn_bin,
        dir: dir.path().to_path_buf(),
        nodes: 3,
        partitions: args.partitions,
        standbys: 1,
        node_timeout: Duration::from_secs(3),
        extra_config: String::new(),
        env: Vec::new(),
    })
    .await?;
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(30),
    };

    let filled = fill(&cluster.addresses(), &options, &args).await?;
    let admin = cluster.client().await?;
    let started = Instant::now();
    for p in 0..u32::from(args.partitions) {
        snapshot(&admin, p).await?;
    }
    println!(
        "snapshotted all {} partitions in {:.1} s",
        args.partitions,
        started.elapsed().as_secs_f64()
    );

    let load = Load::start(
        &cluster.addresses(),
        &options,
        args.clients,
        args.batch,
        Bytes::from(vec![b'v'; 100]),
    )
    .await?;
    let probes = Probes::start(&cluster.addresses(), &options, args.partitions).await?;
    let window = Duration::from_secs(args.window_secs);
    let before_from = Instant::now();
    tokio::time::sleep(window).await;
    let before = (before_from, Instant::now());

    cluster.add_node().await?;
    wait_alive(&admin, "n4").await?;
    let downloads_before = downloads(&cluster).await?;
    let four: Vec<String> = (1..=4).map(|i| format!("n{i}")).collect();
    let op_started = Instant::now();
    // As `cairnctl cluster scale` does: fresh snapshots of what will be copied, then the plan.
    let plan = admin.plan_placement(four.clone()).await?;
    let copied: BTreeSet<u32> = plan
        .moves
        .iter()
        .filter(|m| m.copies)
        .map(|m| m.partition_id)
        .collect();
    let uploading = Instant::now();
    for &p in &copied {
        snapshot(&admin, p).await?;
    }
    let upload_took = uploading.elapsed();
    let plan = admin.plan_placement(four.clone()).await?;
    let copies: BTreeMap<(u32, String), (String, u64, u64)> = plan
        .moves
        .iter()
        .filter(|m| m.copies)
        .map(|m| {
            (
                (m.partition_id, m.to.clone()),
                (m.snapshot_id.clone(), m.snapshot_bytes, m.log_records),
            )
        })
        .collect();
    let minimum: u64 = copies.values().map(|(_, bytes, _)| bytes).sum();
    let log_records: u64 = copies.values().map(|(_, _, records)| records).sum();
    let leaders_moved: BTreeSet<u32> = plan
        .moves
        .iter()
        .filter(|m| m.role == "leader" && !m.from.is_empty() && !m.to.is_empty())
        .map(|m| m.partition_id)
        .collect();
    let op = admin
        .start_scale(v1::StartScaleRequest {
            nodes: four.clone(),
            max_concurrent_moves: args.max_concurrent_moves,
            partition_table_version: plan.partition_table_version,
        })
        .await
        .context("start the scaling operation")?;
    let done = follow(&cluster, op.id).await?;
    let op_ended = Instant::now();
    if done.state != "succeeded" {
        bail!("the operation ended {}: {done:#?}", done.state);
    }
    let during = (op_started, op_ended);
    let downloaded = downloads(&cluster).await?.since(&downloads_before);

    // The plain GET of the same files, under the same load.
    let plain = plain_get(&cluster, &admin, &copies).await?;
    tokio::time::sleep(window.saturating_sub(plain.1)).await;
    let after = (op_ended, Instant::now());
    let gaps = probes.stop().await;
    let load_before = load.keys_per_second(&[before]);
    let load_during = load.keys_per_second(&[during]);

    println!(
        "data: {} in {} keys written in {:.1} s; {} partitions, 3 → 4 nodes, {} moved at once",
        shown_bytes(filled.0),
        filled.1,
        filled.2.as_secs_f64(),
        args.partitions,
        args.max_concurrent_moves
    );
    println!(
        "moves: {} ({} copies onto nodes that held nothing of them, {} leaderships)",
        done.moves.len(),
        copies.len(),
        leaders_moved.len()
    );
    println!(
        "bytes moved: {} downloaded by the new holders ÷ minimum {} (the copied partitions' newest snapshots) = {:.3}; plus {} log records replayed past them",
        shown_bytes(downloaded.bytes),
        shown_bytes(minimum),
        downloaded.bytes as f64 / minimum.max(1) as f64,
        log_records
    );
    println!(
        "time: {:.1} s in all, of which {:.1} s uploading fresh snapshots",
        (op_ended - op_started).as_secs_f64(),
        upload_took.as_secs_f64()
    );
    let restore_rate = mib_per_sec(downloaded.bytes, downloaded.seconds);
    let plain_rate = mib_per_sec(plain.0, plain.1.as_secs_f64());
    println!(
        "transfer: {} restores at {restore_rate:.1} MiB/s (download, checksums and import, one at a time) ÷ plain GET of the same {} at {plain_rate:.1} MiB/s = {:.2}",
        downloaded.restores,
        shown_bytes(plain.0),
        restore_rate / plain_rate.max(1e-9)
    );
    let mut pauses: Vec<Duration> = leaders_moved
        .iter()
        .map(|&p| gaps.longest(p as usize, during))
        .collect();
    pauses.sort();
    let unmoved = (0..args.partitions as usize)
        .filter(|p| !leaders_moved.contains(&(*p as u32)))
        .map(|p| gaps.longest(p, during))
        .max()
        .unwrap_or_default();
    println!(
        "cutover write pause (longest gap between acknowledged writes) over {} moved leaderships: p50 {} ms, p99 {} ms, max {} ms; partitions whose leader stayed: max {} ms",
        pauses.len(),
        percentile(&pauses, 0.5).as_millis(),
        percentile(&pauses, 0.99).as_millis(),
        pauses.last().copied().unwrap_or_default().as_millis(),
        unmoved.as_millis()
    );
    for (label, span) in [("before", before), ("during", during), ("after", after)] {
        println!(
            "load ({} clients, puts of {} keys) {label:>6}: {}",
            args.clients,
            args.batch,
            load.summary(&[span])
        );
        for failure in load.failures_within(&[span], FAILURES_SHOWN) {
            println!("  failed: {failure}");
        }
    }
    println!(
        "load during ÷ before: {:.2}",
        load_during / load_before.max(1e-9)
    );
    load.stop().await;
    Ok(())
}

/// Writes about `--gib` of values; returns the bytes of values, the keys and the time taken.
async fn fill(
    seeds: &[String],
    options: &ClientOptions,
    args: &Args,
) -> anyhow::Result<(u64, u64, Duration)> {
    let keys = ((args.gib * (1u64 << 30) as f64) / args.value_bytes as f64).ceil() as u64;
    let values: Arc<Vec<Bytes>> = Arc::new(
        (0..FILL_VALUES)
            .map(|_| {
                let mut value = vec![0u8; args.value_bytes];
                rand::Rng::fill(&mut rand::rng(), &mut value[..]);
                Bytes::from(value)
            })
            .collect(),
    );
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let next = Arc::new(AtomicU64::new(0));
    let written = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut fillers = Vec::new();
    for _ in 0..FILLERS {
        let client = RoutingClient::connect_any(&seeds, options, &RoutingOptions::default())
            .await
            .context("connect a client to fill the cluster")?;
        let (next, written, values) = (next.clone(), written.clone(), values.clone());
        fillers.push(tokio::spawn(async move {
            loop {
                let from = next.fetch_add(FILL_BATCH, Ordering::Relaxed);
                if from >= keys {
                    return Ok::<_, anyhow::Error>(());
                }
                let entries: Vec<PutEntry> = (from..(from + FILL_BATCH).min(keys))
                    .map(|i| PutEntry {
                        key: Bytes::from(format!("fill-{i:012}")),
                        value: values[(i as usize).wrapping_mul(7919) % values.len()].clone(),
                        ttl: None,
                    })
                    .collect();
                let n = entries.len() as u64;
                client.put(entries).await.context("fill")?;
                written.fetch_add(n, Ordering::Relaxed);
            }
        }));
    }
    let progress = {
        let written = written.clone();
        tokio::spawn(async move {
            let mut shown = 0;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let tenth = written.load(Ordering::Relaxed) * 10 / keys.max(1);
                if tenth > shown {
                    shown = tenth;
                    eprintln!("filling: {}0% of {keys} keys", tenth);
                }
            }
        })
    };
    for filler in fillers {
        filler.await??;
    }
    progress.abort();
    Ok((keys * args.value_bytes as u64, keys, started.elapsed()))
}

async fn wait_alive(client: &Client, name: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let nodes = client.list_nodes().await.unwrap_or_default();
        if nodes.iter().any(|n| n.name == name && n.state == "alive") {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{name} not alive after 60 s: {nodes:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Follows operation `id` to its end, printing each move's steps as they change.
async fn follow(cluster: &TestCluster, id: u64) -> anyhow::Result<v1::OperationInfo> {
    let deadline = Instant::now() + Duration::from_secs(3600);
    let started = Instant::now();
    let mut steps: BTreeMap<u32, String> = BTreeMap::new();
    loop {
        if let Ok(client) = cluster.client().await
            && let Ok(ops) = client.list_operations().await
            && let Some(op) = ops.into_iter().find(|op| op.id == id)
        {
            for m in &op.moves {
                if steps.get(&m.partition_id) != Some(&m.step) {
                    eprintln!(
                        "{:>6.1} s: partition {} {}",
                        started.elapsed().as_secs_f64(),
                        m.partition_id,
                        m.step
                    );
                    steps.insert(m.partition_id, m.step.clone());
                }
            }
            if matches!(op.state.as_str(), "succeeded" | "failed" | "cancelled") {
                return Ok(op);
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "operation {id} not finished after an hour"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What the nodes' restores downloaded, from their metrics.
#[derive(Default)]
struct Downloads {
    bytes: u64,
    /// Summed over the restores.
    seconds: f64,
    restores: u64,
}

impl Downloads {
    fn since(&self, earlier: &Downloads) -> Downloads {
        Downloads {
            bytes: self.bytes.saturating_sub(earlier.bytes),
            seconds: self.seconds - earlier.seconds,
            restores: self.restores.saturating_sub(earlier.restores),
        }
    }
}

async fn downloads(cluster: &TestCluster) -> anyhow::Result<Downloads> {
    let mut total = Downloads::default();
    for node in &cluster.nodes {
        // A node that has not started yet has downloaded nothing.
        let Ok(scrape) = scrape(node.metrics).await else {
            continue;
        };
        total.bytes += summed(&scrape, "cairn_snapshot_download_bytes_total") as u64;
        total.seconds += summed(&scrape, "cairn_snapshot_restore_duration_seconds_sum");
        total.restores += summed(&scrape, "cairn_snapshot_restore_duration_seconds_count") as u64;
    }
    Ok(total)
}

/// The text of `GET /metrics` on `address`.
async fn scrape(address: SocketAddr) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut response = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        stream.read_to_string(&mut response),
    )
    .await
    .context("metrics did not answer within 10 s")??;
    Ok(response)
}

/// The sum of every sample of metric `name` (any labels).
fn summed(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// GETs every file of each copied partition's snapshot from the bucket into a scratch folder
/// (synced, as a restore syncs), one partition at a time; returns the bytes and the time.
async fn plain_get(
    cluster: &TestCluster,
    admin: &Client,
    copies: &BTreeMap<(u32, String), (String, u64, u64)>,
) -> anyhow::Result<(u64, Duration)> {
    let scratch = tempfile::tempdir()?;
    let (mut bytes, mut took) = (0u64, Duration::ZERO);
    for ((p, to), (snapshot_id, _, _)) in copies {
        if snapshot_id.is_empty() {
            continue;
        }
        let keys = snapshot_file_keys(admin, snapshot_id).await?;
        let target = scratch.path().join(format!("{p}-{to}"));
        tokio::fs::create_dir_all(&target).await?;
        let started = Instant::now();
        let sizes: Vec<u64> = futures::stream::iter(keys.into_iter().enumerate())
            .map(|(i, key)| {
                let store = cluster.repository().clone();
                let path = target.join(format!("{i}.sst"));
                async move {
                    let mut body = store
                        .get(&TestCluster::repository_path(*p, &key))
                        .await?
                        .into_stream();
                    let mut file = tokio::fs::File::create(&path).await?;
                    let mut size = 0u64;
                    while let Some(chunk) = body.try_next().await? {
                        size += chunk.len() as u64;
                        file.write_all(&chunk).await?;
                    }
                    file.sync_all().await?;
                    Ok::<_, anyhow::Error>(size)
                }
            })
            .buffer_unordered(PLAIN_CONCURRENCY)
            .try_collect()
            .await?;
        took += started.elapsed();
        bytes += sizes.iter().sum::<u64>();
    }
    Ok((bytes, took))
}

/// A writer per partition putting one key of it over and over, noting when each write was
/// acknowledged.
struct Probes {
    acknowledged: Arc<Mutex<Vec<Vec<Instant>>>>,
    stop: tokio_util::sync::CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// When each partition's probe writes were acknowledged.
struct Gaps(Vec<Vec<Instant>>);

impl Probes {
    async fn start(
        seeds: &[String],
        options: &ClientOptions,
        partitions: u16,
    ) -> anyhow::Result<Probes> {
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        let acknowledged = Arc::new(Mutex::new(vec![Vec::new(); partitions as usize]));
        let stop = tokio_util::sync::CancellationToken::new();
        let mut tasks = Vec::new();
        for (p, key) in keys_per_partition("scale-probe", partitions)
            .into_iter()
            .enumerate()
        {
            let client = RoutingClient::connect_any(&seeds, options, &RoutingOptions::default())
                .await
                .context("connect a probe")?;
            let (acknowledged, stop) = (acknowledged.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let entry = PutEntry {
                        key: key.clone(),
                        value: Bytes::from_static(b"probe"),
                        ttl: None,
                    };
                    if client.put(vec![entry]).await.is_ok() {
                        acknowledged.lock().unwrap()[p].push(Instant::now());
                    } else {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }));
        }
        Ok(Probes {
            acknowledged,
            stop,
            tasks,
        })
    }

    async fn stop(self) -> Gaps {
        self.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        Gaps(std::mem::take(&mut *self.acknowledged.lock().unwrap()))
    }
}

impl Gaps {
    /// The longest time within `span` without an acknowledged write of partition `p` (from the
    /// span's start to the first, between two, from the last to its end).
    fn longest(&self, p: usize, span: (Instant, Instant)) -> Duration {
        let mut last = span.0;
        let mut longest = Duration::ZERO;
        for &at in self.0[p]
            .iter()
            .filter(|at| **at > span.0 && **at <= span.1)
        {
            longest = longest.max(at - last);
            last = at;
        }
        longest.max(span.1.saturating_duration_since(last))
    }
}

fn mib_per_sec(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64 / seconds.max(1e-9)
}

fn shown_bytes(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}
