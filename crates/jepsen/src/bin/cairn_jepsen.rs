//! `cairn-jepsen`: a randomized soak. A real three-node cluster, clients over gRPC and the Redis
//! port, and for `--seconds` a random fault at a time (SIGKILL, SIGSTOP past the node timeout, a
//! node cut off from NATS, one or two NATS servers killed, a node restarted with its base dir
//! deleted), each healed before the next; then every key is read and the history checked.
//! Seeded: the seed is printed, and `--seed` replays the same choices (the timing of a real
//! cluster differs between runs, so a failure may need a few replays).

use cairn_jepsen::{ClusterOptions, Run, TestCluster, WorkloadOptions};
use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Random faults on a real Cairn cluster, every operation checked")]
struct Args {
    /// How long to inject faults.
    #[arg(long, default_value_t = 120)]
    seconds: u64,
    /// The seed of the faults' and the clients' choices (default: random, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    #[arg(long, default_value_t = 8)]
    partitions: u16,
    /// Keys the clients share.
    #[arg(long, default_value_t = 24)]
    keys: usize,
    /// Clients of each kind (routing gRPC, forwarding gRPC, Redis port).
    #[arg(long, default_value_t = 3)]
    clients: usize,
    /// The cluster's node timeout, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    node_timeout_ms: u64,
    /// The `cairn` binary (default: the one beside this binary).
    #[arg(long)]
    cairn_bin: Option<PathBuf>,
    /// Where the cluster's data and logs go (default: a temporary folder, removed at the end
    /// unless the check fails).
    #[arg(long)]
    dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill,
    Pause,
    Cut,
    KillNats,
    KillTwoNats,
    Wipe,
}

const FAULTS: [Fault; 6] = [
    Fault::Kill,
    Fault::Pause,
    Fault::Cut,
    Fault::KillNats,
    Fault::KillTwoNats,
    Fault::Wipe,
];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(rand::random);
    println!("cairn-jepsen: seed {seed} (replay with --seed {seed})");
    let cairn_bin = cairn_jepsen::cairn_bin(args.cairn_bin)?;
    let temporary = tempfile::tempdir()?;
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| temporary.path().to_path_buf());
    let node_timeout = Duration::from_millis(args.node_timeout_ms);
    let mut cluster = TestCluster::start(ClusterOptions {
        cairn_bin,
        dir: dir.clone(),
        nodes: args.nodes,
        partitions: args.partitions,
        standbys: 1,
        node_timeout,
        // Snapshots every few seconds: faults meet publishes, and a wiped node restores.
        extra_config: "snapshot-interval = \"2s\"\n".to_string(),
        env: Vec::new(),
    })
    .await?;
    let run = Run::start(
        &cluster,
        WorkloadOptions {
            keys: args.keys,
            routing_clients: args.clients,
            forwarding_clients: args.clients,
            resp_clients: args.clients,
            seed,
            ..WorkloadOptions::default()
        },
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let mut faults = 0;
    while started.elapsed() < Duration::from_secs(args.seconds) {
        let fault = FAULTS[rng.random_range(0..FAULTS.len())];
        let node = rng.random_range(0..cluster.nodes.len());
        let hold = node_timeout + Duration::from_millis(rng.random_range(0..3000));
        println!(
            "[{:6.1} s] {fault:?} on n{} (nats {}) for {} ms",
            started.elapsed().as_secs_f64(),
            node + 1,
            node % 3,
            hold.as_millis()
        );
        inject(&mut cluster, fault, node, hold).await?;
        faults += 1;
        cluster.wait_serving(Duration::from_secs(90)).await?;
        tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
    }
    let outcome = run.finish(&mut cluster).await?;
    println!(
        "cairn-jepsen: {faults} faults in {:.0} s; {}; {}",
        started.elapsed().as_secs_f64(),
        outcome.counts,
        outcome.report
    );
    if !outcome.report.is_ok() {
        // Keep the data and logs for a look.
        let kept = temporary.keep();
        println!(
            "cairn-jepsen: the cluster's data and logs are in {}",
            kept.display()
        );
        std::process::exit(1);
    }
    Ok(())
}

async fn inject(
    cluster: &mut TestCluster,
    fault: Fault,
    node: usize,
    hold: Duration,
) -> anyhow::Result<()> {
    match fault {
        Fault::Kill => {
            cluster.kill_node(node);
            tokio::time::sleep(hold).await;
            cluster.start_node(node)?;
        }
        Fault::Pause => {
            cluster.pause_node(node);
            tokio::time::sleep(hold).await;
            cluster.resume_node(node);
        }
        Fault::Cut => {
            cluster.cut_node(node);
            tokio::time::sleep(hold).await;
            cluster.heal_node(node);
        }
        Fault::KillNats => {
            let server = node % cluster.nats.servers.len();
            cluster.kill_nats(server);
            tokio::time::sleep(hold).await;
            cluster.start_nats(server).await?;
        }
        Fault::KillTwoNats => {
            let first = node % cluster.nats.servers.len();
            let second = (first + 1) % cluster.nats.servers.len();
            cluster.kill_nats(first);
            cluster.kill_nats(second);
            tokio::time::sleep(hold).await;
            cluster.start_nats(first).await?;
            cluster.start_nats(second).await?;
        }
        Fault::Wipe => {
            cluster.kill_node(node);
            cluster.wipe_node(node)?;
            tokio::time::sleep(hold).await;
            cluster.start_node(node)?;
        }
    }
    Ok(())
}
