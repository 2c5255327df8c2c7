//! `cairn-cluster-bench`: Cairn as a three-node cluster on NATS JetStream, beside one Cairn node
//! on its local log, and beside plain JetStream publishing the same bytes with the same
//! concurrency and replicas, in one run on one machine.
//!
//! It starts three clustered `nats-server`s (`scripts/setup-debian.sh` installs `nats-server`),
//! three Cairn nodes in this process (logs and metadata in NATS, snapshots in a shared temporary
//! folder) and a single node with the local log. Every workload runs `--rounds` times, the three
//! sides one after the other in each round; the report shows each side's median round, and the
//! ratios of each round: their median and range.
//!
//! - **put** and **insert-if-absent**: `--batch` fresh keys per request, `--clients` clients
//!   spread over the nodes (a node forwards the keys of partitions it does not lead).
//! - **plain JetStream**: per request, the same keys and values grouped by partition as Cairn
//!   groups them, one message per partition to that partition's stream (`--replicas` copies,
//!   files), all acknowledgements awaited: the log traffic of a Cairn request without Cairn.
//!
//! - **get**, 1 and `--read-batch` keys per request, over `--read-keys` keys written first, in
//!   three modes: linearizable through a client that routes each key to its leader;
//!   linearizable through plain clients spread over the nodes (a node forwards the keys of
//!   partitions it does not lead); and with a bounded staleness (`--max-staleness-ms`) through
//!   the same plain clients, which a node answers from its own replicas, followers included.
//!   Reads have no peer here: the ratio is each mode's cost against the others'.
//!
//! Beside keys/s and latency it prints what explains them: the JetStream messages a request
//! became, and the CPU time per key of the NATS servers and of this process, which runs the
//! clients and the Cairn nodes. Every side shares the one machine's cores.

use anyhow::Context;
use bytes::{BufMut, Bytes, BytesMut};
use cairn_bench::CpuTime;
use cairn_bench::ratio::Rounds;
use cairn_bench::report::progress;
use cairn_client::{Client, ClientOptions, Consistency, PutEntry, RoutingClient};
use cairn_metadata::test_util::NatsCluster;
use cairn_types::keys::partition_for_key;
use cairn_types::partition_key;
use clap::Parser;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "cairn-cluster-bench",
    about = "Cairn on three nodes over NATS JetStream, beside one node and beside plain JetStream"
)]
struct Args {
    /// Seconds each workload runs
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Concurrent clients, each with its own connection
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Times each workload runs; the report shows the median run
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Keys per request
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Value size in bytes
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Partitions of the cluster and of the single node
    #[arg(long, default_value_t = 16)]
    partitions: u16,
    /// JetStream replicas of every stream, Cairn's and the plain ones
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Cairn nodes in the cluster
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Followers of each partition in the cluster (`[cluster] standbys`)
    #[arg(long, default_value_t = 1)]
    standbys: usize,
    /// Bytes each partition of every Cairn node holds in memory before a flush
    /// (`[partition-store] write-buffer-bytes`); its default when not given
    #[arg(long)]
    write_buffer_bytes: Option<usize>,
    /// Seconds the nodes may take to serve every partition
    #[arg(long, default_value_t = 90.0)]
    start_timeout: f64,
    /// Keys written before the reads, which read them
    #[arg(long, default_value_t = 10_000)]
    read_keys: usize,
    /// Keys per request of the batched reads
    #[arg(long, default_value_t = 100)]
    read_batch: usize,
    /// The staleness the bounded reads accept, in milliseconds
    #[arg(long, default_value_t = 1_000)]
    max_staleness_ms: u64,
}

/// The cluster's name, which names its streams.
const CLUSTER: &str = "bench";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Cluster,
    Single,
    JetStream,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Workload {
    Put,
    Insert,
}

impl Workload {
    fn name(self, batch: usize) -> String {
        match self {
            Workload::Put => format!("put, {batch} keys per request"),
            Workload::Insert => format!("insert-if-absent, {batch} keys"),
        }
    }
}

/// What a run achieved: keys, time, every request's latency, sorted, the JetStream messages its
/// streams took, and the CPU time it cost.
struct Figures {
    keys: u64,
    elapsed: Duration,
    latencies: Vec<Duration>,
    messages: Option<u64>,
    /// CPU time of this process (the clients of every side, and the Cairn nodes, which run in
    /// it) and of the NATS servers.
    cpu: CpuTime,
}

impl Figures {
    fn keys_per_second(&self) -> f64 {
        self.keys as f64 / self.elapsed.as_secs_f64()
    }

    /// CPU time per key, in microseconds: the NATS servers' and this process's.
    fn cpu_per_key_us(&self) -> (f64, f64) {
        let keys = self.keys.max(1) as f64;
        (self.cpu.others / keys * 1e6, self.cpu.own / keys * 1e6)
    }

    /// JetStream messages per request, where the run counted them.
    fn messages_per_request(&self) -> Option<f64> {
        let requests = self.latencies.len().max(1) as f64;
        self.messages.map(|m| m as f64 / requests)
    }

    fn latency_ms(&self, quantile: f64) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        let rank = (quantile * self.latencies.len() as f64).ceil() as usize;
        self.latencies[rank.clamp(1, self.latencies.len()) - 1].as_secs_f64() * 1000.0
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.seconds > 0.0
            && args.clients > 0
            && args.batch > 0
            && args.rounds > 0
            && args.read_keys > 0
            && args.read_batch > 0,
        "--seconds, --clients, --batch, --rounds, --read-keys and --read-batch must be more than 0"
    );
    anyhow::ensure!(
        (1..=3).contains(&args.replicas) && args.nodes > 0,
        "--replicas must be 1 to 3 (the benchmark runs three NATS servers), --nodes at least 1"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    println!(
        "cairn-cluster-bench: {} clients, batches of {} keys, {}-byte values, {}s per workload, {} round(s), {} partitions, {} JetStream replicas",
        args.clients,
        args.batch,
        args.value_bytes,
        args.seconds,
        args.rounds,
        args.partitions,
        args.replicas
    );
    let dir = tempfile::tempdir().context("create the benchmark's temporary folder")?;
    progress("NATS: starting three clustered servers");
    let nats = NatsCluster::start(&dir.path().join("nats"));
    let results = runtime.block_on(run(&args, dir.path(), &nats));
    drop(nats);
    let (results, reads) = results?;
    print_report(&args, &results);
    print_read_report(&args, &reads);
    Ok(())
}

type Results = BTreeMap<(Workload, &'static str), Rounds<Figures>>;

/// Read workloads: keys per request.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum ReadWorkload {
    Single,
    Batch,
}

/// How a read is sent, and how fresh it must be.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum ReadMode {
    /// Linearizable, each key sent to its leader by a routing client.
    Routed,
    /// Linearizable, through a plain client of one node, which forwards.
    ViaNode,
    /// At most `--max-staleness-ms` old, through a plain client of one node.
    BoundedViaNode,
}

impl ReadMode {
    const ALL: [ReadMode; 3] = [
        ReadMode::Routed,
        ReadMode::ViaNode,
        ReadMode::BoundedViaNode,
    ];

    fn label(self) -> &'static str {
        match self {
            ReadMode::Routed => "routed, linearizable",
            ReadMode::ViaNode => "via a node, linearizable",
            ReadMode::BoundedViaNode => "via a node, bounded",
        }
    }
}

type ReadResults = BTreeMap<(ReadWorkload, ReadMode), Rounds<Figures>>;

/// How long stopping one Cairn node may take before the benchmark gives up on it.
const NODE_STOP_LIMIT: Duration = Duration::from_secs(30);

/// Starts the Cairn nodes, measures, and stops every node it started, also when something failed
/// on the way: nodes left running would still be writing to RocksDB as the process exits.
async fn run(
    args: &Args,
    dir: &std::path::Path,
    nats: &NatsCluster,
) -> anyhow::Result<(Results, ReadResults)> {
    let mut nodes = Vec::new();
    let measured = measure(args, dir, nats, &mut nodes).await;
    if measured.is_err() {
        progress("stopping the Cairn nodes after the error below");
    }
    let mut stopped = Ok(());
    for (name, node) in nodes {
        let result = match tokio::time::timeout(NODE_STOP_LIMIT, node.shutdown()).await {
            Ok(result) => result.with_context(|| format!("stop Cairn node {name}")),
            Err(_) => Err(anyhow::anyhow!(
                "Cairn node {name} did not stop within {} s",
                NODE_STOP_LIMIT.as_secs()
            )),
        };
        if let Err(err) = result {
            progress(&format!("{err:#}"));
            stopped = stopped.and(Err(err));
        }
    }
    // The measurement's error is the one that explains the run.
    let results = measured?;
    stopped?;
    Ok(results)
}

/// The nodes started so far, by name, for [`run`] to stop.
type Nodes = Vec<(String, cairn_node::RunningNode)>;

async fn measure(
    args: &Args,
    dir: &std::path::Path,
    nats: &NatsCluster,
    nodes: &mut Nodes,
) -> anyhow::Result<(Results, ReadResults)> {
    progress(&format!("Cairn: starting {} cluster nodes", args.nodes));
    let mut addresses = Vec::new();
    for i in 1..=args.nodes {
        let node = start_cluster_node(args, dir, nats, i).await?;
        addresses.push(format!("http://{}", node.local_addr()));
        nodes.push((format!("n{i}"), node));
    }
    wait_until_serving(&addresses[0], args).await?;
    progress("Cairn: starting a single node on its local log");
    let single = cairn_node::start(cairn_node::Config {
        partition_store: partition_store(args),
        base_dir: dir.join("single"),
        bind_address: "127.0.0.1:0".parse()?,
        num_partitions: args.partitions,
        metrics: cairn_node::config::MetricsConfig { bind_address: None },
        resp: cairn_node::config::RespConfig {
            bind_address: None,
            ..Default::default()
        },
        ..cairn_node::Config::default()
    })
    .await
    .context("start the single node")?;
    let single_address = format!("http://{}", single.local_addr());
    nodes.push(("single".into(), single));
    wait_until_serving(&single_address, args).await?;
    let plain = PlainJetStream::start(args, nats).await?;
    let nats_pids: Vec<u32> = nats.servers.iter().map(|s| s.pid()).collect();

    let mut runs: BTreeMap<(Workload, &'static str), Vec<Figures>> = BTreeMap::new();
    for round in 1..=args.rounds {
        for workload in [Workload::Put, Workload::Insert] {
            for side in [Side::Cluster, Side::Single, Side::JetStream] {
                // Plain JetStream publishes the same bytes for both workloads: once a round.
                if side == Side::JetStream && workload == Workload::Insert {
                    continue;
                }
                let label = label(side);
                progress(&format!(
                    "round {round}/{}: {label}: {}",
                    args.rounds,
                    workload.name(args.batch)
                ));
                let streams = match side {
                    Side::Cluster => (0..args.partitions)
                        .map(|p| cairn_log::nats::stream_name(CLUSTER, cairn_types::LogId(p)))
                        .collect(),
                    Side::Single => Vec::new(),
                    Side::JetStream => (0..args.partitions)
                        .map(|p| format!("plain-p{p}"))
                        .collect(),
                };
                let before = plain.last_sequences(&streams).await?;
                let cpu_before = CpuTime::read(nats_pids.clone()).await?;
                let mut figures = match side {
                    Side::Cluster => drive_cairn(args, &addresses, workload, round).await?,
                    Side::Single => {
                        drive_cairn(args, std::slice::from_ref(&single_address), workload, round)
                            .await?
                    }
                    Side::JetStream => plain.drive(args, round).await?,
                };
                figures.cpu = CpuTime::read(nats_pids.clone()).await?.since(cpu_before);
                if !streams.is_empty() {
                    figures.messages = Some(plain.last_sequences(&streams).await? - before);
                }
                runs.entry((workload, label)).or_default().push(figures);
            }
        }
    }
    let reads = measure_reads(args, &addresses, &nats_pids).await?;
    let writes = runs
        .into_iter()
        .map(|(key, runs)| (key, Rounds::of(runs, Figures::keys_per_second)))
        .collect();
    Ok((writes, reads))
}

/// Writes `--read-keys` keys through the cluster, then reads them in every mode, round after
/// round.
async fn measure_reads(
    args: &Args,
    addresses: &[String],
    nats_pids: &[u32],
) -> anyhow::Result<ReadResults> {
    progress(&format!(
        "cluster: writing {} keys for the reads",
        args.read_keys
    ));
    let writer = RoutingClient::connect(&addresses[0], &ClientOptions::default()).await?;
    let value = Bytes::from(vec![b'v'; args.value_bytes]);
    for chunk in (0..args.read_keys).collect::<Vec<_>>().chunks(100) {
        let entries = chunk
            .iter()
            .map(|&i| PutEntry {
                key: read_key(i),
                value: value.clone(),
                ttl: None,
            })
            .collect();
        writer
            .put(entries)
            .await
            .context("write the keys to read")?;
    }
    // Past the bound, a bounded read must see every one of them.
    tokio::time::sleep(Duration::from_millis(args.max_staleness_ms)).await;
    let mut runs: BTreeMap<(ReadWorkload, ReadMode), Vec<Figures>> = BTreeMap::new();
    for round in 1..=args.rounds {
        for workload in [ReadWorkload::Single, ReadWorkload::Batch] {
            for mode in ReadMode::ALL {
                progress(&format!(
                    "round {round}/{}: cluster: {}, {}",
                    args.rounds,
                    read_name(args, workload),
                    mode.label()
                ));
                let cpu_before = CpuTime::read(nats_pids.to_vec()).await?;
                let mut figures = drive_reads(args, addresses, workload, mode).await?;
                figures.cpu = CpuTime::read(nats_pids.to_vec()).await?.since(cpu_before);
                runs.entry((workload, mode)).or_default().push(figures);
            }
        }
    }
    Ok(runs
        .into_iter()
        .map(|(key, runs)| (key, Rounds::of(runs, Figures::keys_per_second)))
        .collect())
}

fn read_key(i: usize) -> Bytes {
    Bytes::from(format!("read-{i}"))
}

fn read_name(args: &Args, workload: ReadWorkload) -> String {
    match workload {
        ReadWorkload::Single => "get, 1 key per request".to_string(),
        ReadWorkload::Batch => format!("get, {} keys per request", args.read_batch),
    }
}

/// A connection that reads: routing, or one node's.
#[derive(Clone)]
enum Reader {
    Routed(RoutingClient),
    Node(Arc<Client>, Consistency),
}

/// Runs one read workload for `--seconds` with `--clients` clients spread over `addresses`;
/// every key read must be there.
async fn drive_reads(
    args: &Args,
    addresses: &[String],
    workload: ReadWorkload,
    mode: ReadMode,
) -> anyhow::Result<Figures> {
    let mut readers = Vec::with_capacity(args.clients);
    for c in 0..args.clients {
        let address = &addresses[c % addresses.len()];
        let options = ClientOptions::default();
        readers.push(match mode {
            ReadMode::Routed => Reader::Routed(RoutingClient::connect(address, &options).await?),
            ReadMode::ViaNode => Reader::Node(
                Arc::new(Client::connect(address, &options).await?),
                Consistency::Linearizable,
            ),
            ReadMode::BoundedViaNode => Reader::Node(
                Arc::new(Client::connect(address, &options).await?),
                Consistency::BoundedStaleness(Duration::from_millis(args.max_staleness_ms)),
            ),
        });
    }
    let per_request = match workload {
        ReadWorkload::Single => 1,
        ReadWorkload::Batch => args.read_batch,
    };
    let key_count = args.read_keys;
    let mut figures = drive(args, readers, move |reader, c, seq| {
        // Spread over the keys, differently per client and request.
        let start = (c * 7919 + seq as usize * 104_729) % key_count;
        let keys: Vec<Bytes> = (0..per_request)
            .map(|j| read_key((start + j * 31) % key_count))
            .collect();
        async move {
            let values = match reader {
                Reader::Routed(client) => client.get(keys).await,
                Reader::Node(client, consistency) => client.get_with(keys, consistency).await,
            }
            .context("Cairn get")?;
            anyhow::ensure!(
                values.iter().all(Option::is_some),
                "a key written before the reads is missing"
            );
            Ok(())
        }
    })
    .await?;
    // `drive` counts `--batch` keys per request.
    figures.keys = figures.latencies.len() as u64 * per_request as u64;
    Ok(figures)
}

fn label(side: Side) -> &'static str {
    match side {
        Side::Cluster => "cluster",
        Side::Single => "single node",
        Side::JetStream => "plain JetStream",
    }
}

/// Every node's partition store: the default, but for `--write-buffer-bytes`.
fn partition_store(args: &Args) -> cairn_node::config::PartitionStoreConfig {
    let mut config = cairn_node::config::PartitionStoreConfig::default();
    if let Some(bytes) = args.write_buffer_bytes {
        config.write_buffer_bytes = bytes;
    }
    config
}

async fn start_cluster_node(
    args: &Args,
    dir: &std::path::Path,
    nats: &NatsCluster,
    i: usize,
) -> anyhow::Result<cairn_node::RunningNode> {
    use cairn_node::config::{LogProviderKind, MetadataProviderKind};
    let mut config = cairn_node::Config {
        partition_store: partition_store(args),
        cluster_name: CLUSTER.into(),
        node_name: format!("n{i}"),
        base_dir: dir.join(format!("n{i}")),
        bind_address: "127.0.0.1:0".parse()?,
        num_partitions: args.partitions,
        metrics: cairn_node::config::MetricsConfig { bind_address: None },
        resp: cairn_node::config::RespConfig {
            bind_address: None,
            ..Default::default()
        },
        ..cairn_node::Config::default()
    };
    config.log.provider = LogProviderKind::Nats;
    config.metadata.provider = MetadataProviderKind::Nats;
    config.nats.servers = nats.urls();
    config.nats.replicas = args.replicas;
    config.cluster.initial_nodes = args.nodes;
    config.cluster.standbys = args.standbys;
    config.worker.snapshots.destination = Some(dir.join("repository").display().to_string());
    cairn_node::start(config)
        .await
        .with_context(|| format!("start cluster node n{i}"))
}

/// Polls `partitions list` until every partition is active.
async fn wait_until_serving(address: &str, args: &Args) -> anyhow::Result<()> {
    let client = Client::connect(address, &ClientOptions::default()).await?;
    let deadline = Instant::now() + Duration::from_secs_f64(args.start_timeout);
    loop {
        let partitions = client.list_partitions().await?.partitions;
        let waiting: Vec<String> = partitions
            .iter()
            .filter(|p| p.status != "active")
            .map(|p| format!("{}: {}", p.partition_id, p.status))
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "partitions not serving after {}s at {address}: {}; allow longer with --start-timeout",
            args.start_timeout,
            waiting.join(", ")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Fresh keys for request `seq` of `client` in `round`.
fn keys(args: &Args, tag: &str, round: usize, client: usize, seq: u64) -> Vec<Bytes> {
    (0..args.batch)
        .map(|j| Bytes::from(format!("{tag}-r{round}-c{client}-{seq}-{j}")))
        .collect()
}

/// Runs one workload for `--seconds` with `--clients` clients spread over `addresses`.
async fn drive_cairn(
    args: &Args,
    addresses: &[String],
    workload: Workload,
    round: usize,
) -> anyhow::Result<Figures> {
    // Clients of the cluster route by themselves, each key straight to its leader.
    let mut clients = Vec::with_capacity(args.clients);
    for c in 0..args.clients {
        let address = &addresses[c % addresses.len()];
        clients.push(RoutingClient::connect(address, &ClientOptions::default()).await?);
    }
    let value = Bytes::from(vec![b'v'; args.value_bytes]);
    let tag = match workload {
        Workload::Put => format!("put-{}", addresses.len()),
        Workload::Insert => format!("iia-{}", addresses.len()),
    };
    let owned = args.clone();
    drive(args, clients, move |client, c, seq| {
        let keys = keys(&owned, &tag, round, c, seq);
        let value = value.clone();
        async move {
            match workload {
                Workload::Put => {
                    let entries = keys
                        .into_iter()
                        .map(|key| PutEntry {
                            key,
                            value: value.clone(),
                            ttl: None,
                        })
                        .collect();
                    client.put(entries).await.context("Cairn put")?;
                }
                Workload::Insert => {
                    let inserted = client
                        .insert_if_absent(keys, value, Some(Duration::from_secs(3600)))
                        .await
                        .context("Cairn insert-if-absent")?;
                    anyhow::ensure!(inserted.iter().all(|i| *i), "a fresh key was not inserted");
                }
            }
            Ok(())
        }
    })
    .await
}

/// Every client sends one request after the other for `--seconds`; `request(connection, client,
/// seq)` sends one.
async fn drive<C, F, Fut>(args: &Args, connections: Vec<C>, request: F) -> anyhow::Result<Figures>
where
    C: Clone + Send + 'static,
    F: Fn(C, usize, u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let batch = args.batch as u64;
    let tasks: Vec<_> = connections
        .into_iter()
        .enumerate()
        .map(|(c, connection)| {
            let (stop, request) = (stop.clone(), request.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut seq = 0;
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    request(connection.clone(), c, seq).await?;
                    latencies.push(sent.elapsed());
                    seq += 1;
                }
                anyhow::Ok(latencies)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for task in futures::future::join_all(tasks).await {
        latencies.extend(task??);
    }
    latencies.sort_unstable();
    Ok(Figures {
        keys: latencies.len() as u64 * batch,
        elapsed: start.elapsed(),
        latencies,
        messages: None,
        cpu: CpuTime::default(),
    })
}

/// Plain JetStream: one stream per partition, as Cairn's, published to directly.
struct PlainJetStream {
    /// One connection per NATS server, as each Cairn node has one.
    contexts: Vec<async_nats::jetstream::Context>,
}

impl PlainJetStream {
    async fn start(args: &Args, nats: &NatsCluster) -> anyhow::Result<PlainJetStream> {
        let mut contexts = Vec::new();
        for url in nats.urls() {
            let client = async_nats::connect(url.as_str())
                .await
                .with_context(|| format!("connect to NATS at {url}"))?;
            // As patient as Cairn's own appends: on a saturated machine an acknowledgement
            // may take longer than the client's default 5 s.
            contexts.push(
                async_nats::jetstream::context::ContextBuilder::new()
                    .timeout(Duration::from_secs(30))
                    .build(client),
            );
        }
        for p in 0..args.partitions {
            let config = async_nats::jetstream::stream::Config {
                name: format!("plain-p{p}"),
                subjects: vec![format!("plain.p{p}")],
                storage: async_nats::jetstream::stream::StorageType::File,
                num_replicas: args.replicas,
                ..Default::default()
            };
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match contexts[0].get_or_create_stream(config.clone()).await {
                    Ok(_) => break,
                    Err(err) if Instant::now() < deadline => {
                        progress(&format!(
                            "plain JetStream: creating stream {p} again: {err}"
                        ));
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    Err(err) => return Err(err).context("create a plain JetStream stream"),
                }
            }
        }
        Ok(PlainJetStream { contexts })
    }

    /// The sum of the streams' last sequences: how many messages they have ever taken.
    async fn last_sequences(&self, streams: &[String]) -> anyhow::Result<u64> {
        let mut sum = 0;
        for name in streams {
            let mut stream = self.contexts[0]
                .get_stream(name)
                .await
                .with_context(|| format!("look up stream {name}"))?;
            sum += stream
                .info()
                .await
                .context("stream info")?
                .state
                .last_sequence;
        }
        Ok(sum)
    }

    async fn drive(&self, args: &Args, round: usize) -> anyhow::Result<Figures> {
        let connections: Vec<_> = (0..args.clients)
            .map(|c| self.contexts[c % self.contexts.len()].clone())
            .collect();
        let value = Bytes::from(vec![b'v'; args.value_bytes]);
        let partitions = args.partitions;
        let args_owned = args.clone();
        drive(args, connections, move |jetstream, c, seq| {
            // Each partition's share of the request as one message, key and value as Cairn
            // puts them in its record.
            let mut shares: BTreeMap<u16, BytesMut> = BTreeMap::new();
            for key in keys(&args_owned, "plain", round, c, seq) {
                let p = partition_for_key(partition_key(&key), partitions).0;
                let share = shares.entry(p).or_default();
                share.put_u32(key.len() as u32);
                share.put_slice(&key);
                share.put_u32(value.len() as u32);
                share.put_slice(&value);
            }
            async move {
                let mut acks = Vec::with_capacity(shares.len());
                for (p, share) in shares {
                    acks.push(
                        jetstream
                            .publish(format!("plain.p{p}"), share.freeze())
                            .await
                            .context("publish to JetStream")?,
                    );
                }
                for ack in acks {
                    ack.await.context("JetStream acknowledgement")?;
                }
                Ok(())
            }
        })
        .await
    }
}

fn print_read_report(args: &Args, reads: &ReadResults) {
    println!();
    println!(
        "reads: {} keys, bounded = at most {} ms stale; {} follower(s) per partition, so a node \
         holds a replica of {} of the {} partitions",
        args.read_keys,
        args.max_staleness_ms,
        args.standbys,
        format_args!("{}/{}", (1 + args.standbys).min(args.nodes), args.nodes),
        args.partitions
    );
    println!(
        "{:<34} {:<26} {:>10} {:>8} {:>8} {:>14} {:>14}",
        "workload", "", "keys/s", "p50 ms", "p99 ms", "NATS µs/key", "process µs/key"
    );
    for workload in [ReadWorkload::Single, ReadWorkload::Batch] {
        for mode in ReadMode::ALL {
            let figures = &reads[&(workload, mode)].median;
            let (nats_cpu, process_cpu) = figures.cpu_per_key_us();
            println!(
                "{:<34} {:<26} {:>10.0} {:>8.2} {:>8.2} {:>14.1} {:>14.1}",
                read_name(args, workload),
                mode.label(),
                figures.keys_per_second(),
                figures.latency_ms(0.50),
                figures.latency_ms(0.99),
                nats_cpu,
                process_cpu
            );
        }
    }
    println!();
    for workload in [ReadWorkload::Single, ReadWorkload::Batch] {
        let bounded = &reads[&(workload, ReadMode::BoundedViaNode)];
        println!(
            "{}: bounded/linearizable via a node {}, bounded via a node/routed linearizable {}",
            read_name(args, workload),
            bounded.ratio_to(&reads[&(workload, ReadMode::ViaNode)]),
            bounded.ratio_to(&reads[&(workload, ReadMode::Routed)])
        );
    }
}

fn print_report(args: &Args, results: &Results) {
    println!();
    println!(
        "{:<34} {:<16} {:>10} {:>8} {:>8} {:>13} {:>14} {:>14}",
        "workload",
        "",
        "keys/s",
        "p50 ms",
        "p99 ms",
        "messages/req",
        "NATS µs/key",
        "process µs/key"
    );
    let plain = &results[&(Workload::Put, label(Side::JetStream))];
    for workload in [Workload::Put, Workload::Insert] {
        for side in [Side::Cluster, Side::Single, Side::JetStream] {
            let figures = match side {
                Side::JetStream => &plain.median,
                _ => &results[&(workload, label(side))].median,
            };
            let messages = figures
                .messages_per_request()
                .map_or_else(|| "-".to_string(), |m| format!("{m:.2}"));
            let (nats_cpu, process_cpu) = figures.cpu_per_key_us();
            println!(
                "{:<34} {:<16} {:>10.0} {:>8.2} {:>8.2} {:>13} {:>14.1} {:>14.1}",
                workload.name(args.batch),
                label(side),
                figures.keys_per_second(),
                figures.latency_ms(0.50),
                figures.latency_ms(0.99),
                messages,
                nats_cpu,
                process_cpu
            );
        }
    }
    println!(
        "messages/req: JetStream messages per request. µs/key: CPU time per key written, of the \
         NATS servers and of this process (the clients and the Cairn nodes); they share the \
         machine's {} cores.",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
    for workload in [Workload::Put, Workload::Insert] {
        let cluster = &results[&(workload, label(Side::Cluster))];
        let single = &results[&(workload, label(Side::Single))];
        println!(
            "{}: cluster/plain JetStream {}, cluster/single node {}",
            workload.name(args.batch),
            cluster.ratio_to(plain),
            cluster.ratio_to(single)
        );
    }
}
