//! `cairn-failover-bench`: how long a failover takes, and what clients see meanwhile.
//!
//! A real three-node cluster (three `nats-server`s, moto, `cairn` nodes) under a load of
//! batched puts from routing clients. `--kills` times: SIGKILL of the node leading the most
//! partitions; for each partition it led, the time from the kill to the first write that its
//! new leader acknowledges (a probe per partition, through a surviving node); the node is
//! started again and the cluster left to settle before the next kill, and the next kill waits a
//! random part of a heartbeat interval (half the node timeout) more. Printed: the failover
//! times' p50 and max over every moved partition of every kill, and the load's throughput and
//! p99 latency before the kills (the settled seconds before each), during (kill to the last
//! partition's recovery) and after (the seconds after it). With `--lose-machine` each kill takes
//! the NATS server beside the node too (same index), so NATS's own elections are in the figures.
//! Build it and `cairn` in release for figures worth reading.

use anyhow::Context;
use bytes::Bytes;
use cairn_client::{ClientOptions, PutEntry};
use cairn_jepsen::measure::{Load, keys_per_partition, percentile};
use cairn_jepsen::{ClusterOptions, TestCluster};
use clap::Parser;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Failover times and the load through them, on a real Cairn cluster")]
struct Args {
    /// How many times the busiest leader is killed.
    #[arg(long, default_value_t = 10)]
    kills: usize,
    #[arg(long, default_value_t = 8)]
    partitions: u16,
    /// The cluster's node timeout, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    node_timeout_ms: u64,
    /// Load clients, each with one batch in flight.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Keys per batched put.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Seconds of settled load measured before and after each kill.
    #[arg(long, default_value_t = 5)]
    window_secs: u64,
    /// Kill the NATS server beside the node as well (a whole machine lost).
    #[arg(long)]
    lose_machine: bool,
    /// The `cairn` binary (default: the one beside this binary).
    #[arg(long)]
    cairn_bin: Option<PathBuf>,
}

/// Failed load requests shown per period, with their errors.
const FAILURES_SHOWN: usize = 3;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cairn_bin = cairn_jepsen::cairn_bin(args.cairn_bin.clone())?;
    let dir = tempfile::tempdir()?;
    let node_timeout = Duration::from_millis(args.node_timeout_ms);
    let mut cluster = TestCluster::start(ClusterOptions {
        cairn_bin,
        dir: dir.path().to_path_buf(),
        nodes: 3,
        partitions: args.partitions,
        standbys: 1,
        node_timeout,
        extra_config: String::new(),
        env: Vec::new(),
    })
    .await?;
    let addresses = cluster.addresses();
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(15),
    };
    let load = Load::start(
        &addresses,
        &options,
        args.clients,
        args.batch,
        Bytes::from_static(b"value-of-the-failover-bench"),
    )
    .await?;
    let probe_keys = keys_per_partition("failover-probe", args.partitions);
    let window = Duration::from_secs(args.window_secs);
    let mut failovers: Vec<Duration> = Vec::new();
    let mut periods = Vec::new();
    for kill in 1..=args.kills {
        // A crash comes at any moment of a heartbeat interval, and how long since the victim's
        // last heartbeat decides most of how long its failover takes: the kill waits a random
        // part of an interval more, so that the schedule of the kills does not pick one.
        let phase = node_timeout.mul_f64(rand::random::<f64>() / 2.0);
        tokio::time::sleep(window + phase).await;
        let leaders = cluster.leaders().await?;
        let victim = cluster.busiest_leader().await?;
        let name = cluster.nodes[victim].name.clone();
        let moved: Vec<usize> = (0..leaders.len()).filter(|&p| leaders[p] == name).collect();
        let via = cluster.nodes[(victim + 1) % cluster.nodes.len()].address();
        let killed = Instant::now();
        cluster.kill_node(victim);
        if args.lose_machine {
            cluster.kill_nats(victim % cluster.nats.servers.len());
        }
        let probes = moved.iter().map(|&p| {
            let (via, key, options) = (via.clone(), probe_keys[p].clone(), options.clone());
            async move { first_acknowledged_write(&via, key, &options, killed).await }
        });
        let times = futures::future::join_all(probes).await;
        let mut slowest = Duration::ZERO;
        for (p, time) in moved.iter().zip(times) {
            let time = time.with_context(|| format!("kill {kill}: partition {p}"))?;
            slowest = slowest.max(time);
            failovers.push(time);
        }
        let recovered = killed + slowest;
        println!(
            "kill {kill}: {name} led {} partitions; each took a write again after {} ms",
            moved.len(),
            failovers[failovers.len() - moved.len()..]
                .iter()
                .map(|t| t.as_millis().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        tokio::time::sleep(window).await;
        periods.push((killed, recovered, recovered + window));
        if args.lose_machine {
            cluster
                .start_nats(victim % cluster.nats.servers.len())
                .await?;
        }
        cluster.start_node(victim)?;
        cluster.wait_serving(Duration::from_secs(60)).await?;
    }
    failovers.sort();
    println!(
        "failover (SIGKILL{} → first acknowledged write per moved partition), {} partitions over {} kills, node timeout {} ms: p50 {} ms, max {} ms",
        if args.lose_machine {
            " of a node and its NATS server"
        } else {
            ""
        },
        failovers.len(),
        args.kills,
        node_timeout.as_millis(),
        percentile(&failovers, 0.5).as_millis(),
        failovers.last().copied().unwrap_or_default().as_millis()
    );
    let before: Vec<_> = periods.iter().map(|&(k, _, _)| (k - window, k)).collect();
    let during: Vec<_> = periods.iter().map(|&(k, r, _)| (k, r)).collect();
    let after: Vec<_> = periods.iter().map(|&(_, r, a)| (r, a)).collect();
    for (label, spans) in [("before", before), ("during", during), ("after", after)] {
        println!(
            "load ({} clients, puts of {} keys) {label:>6}: {}",
            args.clients,
            args.batch,
            load.summary(&spans)
        );
        for failure in load.failures_within(&spans, FAILURES_SHOWN) {
            println!("  failed: {failure}");
        }
    }
    load.stop().await;
    Ok(())
}

/// Writes `key` through the node at `via` until a write is acknowledged; how long after
/// `since` that was.
async fn first_acknowledged_write(
    via: &str,
    key: Bytes,
    options: &ClientOptions,
    since: Instant,
) -> anyhow::Result<Duration> {
    let options = ClientOptions {
        request_timeout: Duration::from_millis(500),
        ..options.clone()
    };
    let client = cairn_client::Client::connect(via, &options).await?;
    loop {
        let entry = PutEntry {
            key: key.clone(),
            value: Bytes::from_static(b"probe"),
            ttl: None,
        };
        if client.put(vec![entry]).await.is_ok() {
            return Ok(since.elapsed());
        }
        anyhow::ensure!(
            since.elapsed() < Duration::from_secs(60),
            "no write acknowledged within 60 s of the kill"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
