//! `cairn-bench`: what a user who needs a durable key-value store would compare, in one run on one
//! machine. Six workloads (batched put, batched insert-if-absent, single-key put and
//! insert-if-absent, get of 1 key and of `--batch` keys) through a Cairn node of its own (gRPC on
//! loopback, log fsync, RocksDB apply) and, when `redis-server` is installed, through a Redis of
//! its own that fsyncs every write (`appendfsync always`), with the same clients and shapes; beside
//! raw RocksDB doing synced batched writes. Prints keys/s and p50/p99 latency per request for each,
//! and the ratios Cairn/Redis and batched put Cairn/raw RocksDB.
//!
//! Run: `cargo build --release --workspace && $CARGO_TARGET_DIR/release/cairn-bench
//! [--seconds 10] [--clients 32] [--batch 100]`

mod cairn;
mod drive;
mod redis;
mod rocksdb;

use bytes::Bytes;
use cairn_bench::report::progress;
use clap::Parser;
use drive::{Connection, Figures, Workload};
use std::time::Duration;

#[derive(Parser, Debug, Clone)]
#[command(name = "cairn-bench")]
struct Args {
    /// Seconds each workload runs
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Concurrent clients, each with its own connection
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Keys per request of the batched workloads (Redis: pipeline depth, keys per MGET)
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Value size in bytes
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Partitions of the benchmarked Cairn node
    #[arg(long, default_value_t = 16)]
    partitions: u16,
    /// Keys written before the reads, which read them
    #[arg(long, default_value_t = 10_000)]
    read_keys: u64,
    /// Expiry of the keys insert-if-absent writes, in seconds
    #[arg(long, default_value_t = 3600)]
    ttl_secs: u64,
    /// Seconds the Cairn node may take to bring up its partitions
    #[arg(long, default_value_t = 60.0)]
    start_timeout: f64,
    /// The Redis server to compare with; skipped when it is not installed
    #[arg(long, default_value = "redis-server")]
    redis_server: String,
}

impl Args {
    fn value(&self) -> Bytes {
        Bytes::from(vec![b'v'; self.value_bytes])
    }

    fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs)
    }

    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.seconds > 0.0 && self.start_timeout > 0.0,
            "--seconds and --start-timeout must be more than 0"
        );
        anyhow::ensure!(
            self.clients > 0 && self.batch > 0 && self.read_keys > 0 && self.partitions > 0,
            "--clients, --batch, --read-keys and --partitions must be at least 1"
        );
        anyhow::ensure!(self.ttl_secs > 0, "--ttl-secs must be at least 1");
        Ok(())
    }
}

/// What Redis achieved, or why it did not run.
enum RedisRun {
    Ran {
        version: String,
        figures: Vec<Figures>,
    },
    Skipped(String),
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.check()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    println!(
        "cairn-bench: {} clients, batches of {} keys, {}-byte values, {}s per workload, {} Cairn partitions",
        args.clients, args.batch, args.value_bytes, args.seconds, args.partitions
    );
    progress("raw RocksDB, synced batches");
    let raw = rocksdb::synced_batches(&args)?;
    let cairn = runtime.block_on(run_cairn(&args))?;
    let redis = runtime.block_on(run_redis(&args))?;
    print_report(&args, &cairn, &redis, &raw);
    Ok(())
}

async fn run_cairn(args: &Args) -> anyhow::Result<Vec<Figures>> {
    progress("Cairn: starting a node");
    let node = cairn::Node::start(args).await?;
    let figures =
        async { run_workloads(args, "Cairn", node.connections(args.clients).await?).await }.await;
    node.shutdown().await?;
    figures
}

async fn run_redis(args: &Args) -> anyhow::Result<RedisRun> {
    progress("Redis: starting a server");
    let Some(server) = redis::Server::start(&args.redis_server).await? else {
        return Ok(RedisRun::Skipped(format!(
            "Redis skipped: {} is not installed (scripts/setup-debian.sh installs it; \
             --redis-server names another)",
            args.redis_server
        )));
    };
    let figures =
        async { run_workloads(args, "Redis", server.connections(args.clients).await?).await }.await;
    let version = server.version.clone();
    server.stop().await;
    Ok(RedisRun::Ran {
        version,
        figures: figures?,
    })
}

/// Every workload of [`Workload::ALL`] in turn, on the same connections; the keys the reads read
/// are written just before the first read.
async fn run_workloads(
    args: &Args,
    system: &str,
    mut connections: Vec<Connection>,
) -> anyhow::Result<Vec<Figures>> {
    let mut figures = Vec::new();
    let mut read_keys_written = false;
    for workload in Workload::ALL {
        if workload.reads() && !read_keys_written {
            progress(&format!(
                "{system}: writing {} keys to read",
                args.read_keys
            ));
            drive::write_read_keys(args, &mut connections[0]).await?;
            read_keys_written = true;
        }
        progress(&format!("{system}: {}", workload.name(args.batch)));
        let (ran, back) = drive::drive(args, workload, connections).await?;
        figures.push(ran);
        connections = back;
    }
    Ok(figures)
}

/// `keys/s p50 p99` of one run, in fixed columns.
fn columns(figures: &Figures) -> String {
    format!(
        "{:>12.0} {:>8.2} {:>8.2}",
        figures.keys_per_second(),
        millis(figures.latency(0.50)),
        millis(figures.latency(0.99))
    )
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn print_report(args: &Args, cairn: &[Figures], redis: &RedisRun, raw: &Figures) {
    match redis {
        RedisRun::Ran { version, .. } => println!(
            "Redis {version}: its own server on loopback, appendonly yes, appendfsync always; \
             batches pipelined, reads with GET and MGET"
        ),
        RedisRun::Skipped(why) => println!("{why}"),
    }
    println!();
    println!(
        "{:<34} {:>12} {:>8} {:>8} | {:>12} {:>8} {:>8} | {:>11}",
        "workload",
        "Cairn keys/s",
        "p50 ms",
        "p99 ms",
        "Redis keys/s",
        "p50 ms",
        "p99 ms",
        "Cairn/Redis"
    );
    for (i, workload) in Workload::ALL.iter().enumerate() {
        let (redis_columns, ratio) = match redis {
            RedisRun::Ran { figures, .. } => (
                columns(&figures[i]),
                format!(
                    "{:.2}",
                    cairn[i].keys_per_second() / figures[i].keys_per_second()
                ),
            ),
            RedisRun::Skipped(_) => (format!("{:>12} {:>8} {:>8}", "-", "-", "-"), "-".into()),
        };
        println!(
            "{:<34} {} | {redis_columns} | {ratio:>11}",
            workload.name(args.batch),
            columns(&cairn[i])
        );
    }
    println!(
        "{:<34} {}",
        format!("raw RocksDB, synced batches of {}", args.batch),
        columns(raw)
    );
    println!();
    println!(
        "batched put, Cairn/raw RocksDB: {:.2}",
        cairn[0].keys_per_second() / raw.keys_per_second()
    );
}
