//! `cairn-bench`: what a user who needs a durable key-value store would compare, in one run on one
//! machine. Six workloads (batched put, batched insert-if-absent, single-key put and
//! insert-if-absent, get of 1 key and of `--batch` keys) through a Cairn node of its own (log
//! fsync, RocksDB apply), once through its gRPC port with the Rust client and once through its
//! Redis port with the Redis client and requests that Redis gets, and, when `redis-server` is
//! installed, through a Redis of its own that fsyncs every write (`appendfsync always`), with the
//! same clients and shapes; beside
//! the batched put, raw RocksDB doing synced batched writes (keys in client order and in hash
//! order). Prints keys/s and p50/p99 latency per request for each, and the ratios Cairn/Redis and
//! batched put Cairn/raw RocksDB. Then a windowed deduplication run on a node of its own
//! (`window.rs`), which shows the store's size window after window.
//!
//! Run: `cargo build --release --workspace && $CARGO_TARGET_DIR/release/cairn-bench
//! [--seconds 10] [--rounds 3] [--clients 32] [--batch 100] [--dedup-windows 8]`

/// jemalloc, for Rust and (unprefixed) for RocksDB's C++: many small allocations per request on
/// every thread, where it is faster than the system allocator and fragments less.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod cairn;
mod drive;
mod redis;
mod rocksdb;
mod window;

use rocksdb::KeyOrder;

use bytes::Bytes;
use cairn_bench::ratio;
use cairn_bench::report::{progress, size};
use clap::Parser;
use drive::{Figures, Workload};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// What values are cut from ([`Args::value_for`]): set once at start, before any run times
/// anything, and never freed, so that a value is a slice that costs no allocation or reference
/// count.
static VALUES: OnceLock<&'static [u8]> = OnceLock::new();

/// Random bytes that `--random-values` cuts values from, at offsets picked by key.
const RANDOM_POOL_BYTES: usize = 16 * 1024 * 1024;

#[derive(Parser, Debug, Clone)]
#[command(name = "cairn-bench")]
struct Args {
    /// Seconds each workload runs
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Concurrent clients, each with its own connection
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Workloads to run, comma-separated (all by default)
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Workload::ALL)]
    workloads: Vec<Workload>,
    /// Times each workload runs, interleaved with the others; the report shows the median run
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Keys per request of the batched workloads (Redis: pipeline depth, keys per MGET)
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Value size in bytes
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Values of random bytes, which do not compress, each key its own (an insert-if-absent
    /// request writes one value under all its keys); by default every value is one byte repeated
    #[arg(long)]
    random_values: bool,
    /// Partitions of the benchmarked Cairn node
    #[arg(long, default_value_t = 16)]
    partitions: u16,
    /// Bytes each of the Cairn node's partitions holds in memory before a flush (the node's
    /// `[partition-store] write-buffer-bytes`); its default when not given
    #[arg(long)]
    write_buffer_bytes: Option<usize>,
    /// How the Cairn node's partitions merge their tables (the node's `[partition-store]
    /// compaction-style`); its default when not given
    #[arg(long, value_enum)]
    compaction_style: Option<CompactionStyle>,
    /// Size of the Cairn node's table blocks (the node's `[partition-store] block-bytes`); its
    /// default when not given
    #[arg(long)]
    block_bytes: Option<usize>,
    /// Keys written before the reads, which read them
    #[arg(long, default_value_t = 10_000)]
    read_keys: u64,
    /// Expiry of the keys insert-if-absent writes, in seconds
    #[arg(long, default_value_t = 3600)]
    ttl_secs: u64,
    /// Seconds the Cairn node may take to bring up its partitions
    #[arg(long, default_value_t = 60.0)]
    start_timeout: f64,
    /// Before each run, wait up to this many seconds until the machine's CPU is idle, so that
    /// what the previous run left (a store's flushes and compactions) does not count towards
    /// this one (0: do not wait)
    #[arg(long, default_value_t = 30.0)]
    settle_secs: f64,
    /// Windows of the windowed dedup run, after the other workloads (0: skip it)
    #[arg(long, default_value_t = 8)]
    dedup_windows: usize,
    /// Length of one window of the windowed dedup run, which is also its keys' TTL
    #[arg(long, default_value_t = 2)]
    dedup_window_secs: u64,
    /// The Redis server to compare with; skipped when it is not installed
    #[arg(long, default_value = "redis-server")]
    redis_server: String,
    /// Cairn's front ends to drive, comma-separated: `grpc` (the Rust client) and `resp` (its
    /// Redis port, with the same client and requests as Redis)
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = FrontEnd::ALL)]
    front_ends: Vec<FrontEnd>,
}

/// `--compaction-style`: the node's `[partition-store] compaction-style`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum CompactionStyle {
    Universal,
    Leveled,
}

impl CompactionStyle {
    fn for_node(self) -> cairn_node::config::CompactionStyle {
        match self {
            CompactionStyle::Universal => cairn_node::config::CompactionStyle::Universal,
            CompactionStyle::Leveled => cairn_node::config::CompactionStyle::Leveled,
        }
    }
}

/// A way into Cairn that the workloads are driven through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum FrontEnd {
    Grpc,
    Resp,
}

impl FrontEnd {
    const ALL: [FrontEnd; 2] = [FrontEnd::Grpc, FrontEnd::Resp];

    fn name(self) -> &'static str {
        match self {
            FrontEnd::Grpc => "gRPC",
            FrontEnd::Resp => "Redis port",
        }
    }
}

impl Args {
    /// What [`Args::value_for`] cuts values from.
    fn values(&self) -> Vec<u8> {
        if self.random_values {
            let mut pool = vec![0; RANDOM_POOL_BYTES.max(2 * self.value_bytes)];
            rand::RngCore::fill_bytes(&mut rand::rng(), &mut pool);
            pool
        } else {
            vec![b'v'; self.value_bytes]
        }
    }

    /// The value written under `key`: `--value-bytes` of one byte repeated, or of random bytes
    /// chosen by the key's hash with `--random-values`.
    fn value_for(&self, key: &[u8]) -> Bytes {
        let pool = VALUES.get().expect("main sets the values before any run");
        let starts = (pool.len() - self.value_bytes + 1) as u64;
        let start = (cairn_types::partition_key(key) % starts) as usize;
        Bytes::from_static(&pool[start..start + self.value_bytes])
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
            self.settle_secs >= 0.0 && self.settle_secs.is_finite(),
            "--settle-secs must be 0 or more"
        );
        anyhow::ensure!(
            self.clients > 0
                && self.batch > 0
                && self.read_keys > 0
                && self.partitions > 0
                && self.rounds > 0,
            "--clients, --batch, --read-keys, --partitions and --rounds must be at least 1"
        );
        anyhow::ensure!(
            self.ttl_secs > 0 && self.dedup_window_secs > 0,
            "--ttl-secs and --dedup-window-secs must be at least 1"
        );
        anyhow::ensure!(
            !self.front_ends.is_empty(),
            "--front-ends must name at least one of grpc, resp"
        );
        Ok(())
    }
}

/// What Redis achieved, or why it did not run.
enum RedisRun {
    Ran {
        version: String,
        figures: Vec<Summary>,
    },
    Skipped(String),
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.check()?;
    VALUES.get_or_init(|| args.values().leak());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    println!(
        "cairn-bench: {} clients, batches of {} keys, {}-byte values{}, {}s per workload, {} \
         round(s), {} Cairn partitions",
        args.clients,
        args.batch,
        args.value_bytes,
        if args.random_values {
            " of random bytes"
        } else {
            ""
        },
        args.seconds,
        args.rounds,
        args.partitions
    );
    let (cairn, redis, raw) = runtime.block_on(run_rounds(&args))?;
    let windows = if args.dedup_windows > 0 {
        runtime.block_on(window::run(&args))?
    } else {
        Vec::new()
    };
    print_report(&args, &cairn, &redis, raw.as_ref());
    if !windows.is_empty() {
        window::print(&args, &windows);
    }
    Ok(())
}

/// Runs every workload `--rounds` times, interleaved (raw RocksDB if the batched put runs, then
/// each workload on Cairn through each front end and right after on Redis), so that a noisy moment
/// of the machine hits every side alike.
/// Returns, per workload, each side's rounds.
async fn run_rounds(args: &Args) -> anyhow::Result<(Vec<Side>, RedisRun, Option<[Summary; 2]>)> {
    // What the machine is busy with before the benchmark starts anything: the runs wait for it
    // to be back to about this.
    let baseline = cairn_bench::busy_share().await?;
    progress("Cairn: starting a node");
    let node = cairn::Node::start(args).await?;
    progress("Redis: starting a server");
    let redis_server = match redis::Server::start(&args.redis_server).await {
        Ok(server) => server,
        Err(err) => {
            node.shutdown().await?;
            return Err(err);
        }
    };
    // Both are stopped whatever the rounds end with.
    let rounds = interleave(args, baseline, &node, redis_server.as_ref()).await;
    node.shutdown().await?;
    let version = redis_server.as_ref().map(|server| server.version.clone());
    if let Some(server) = redis_server {
        server.stop().await;
    }
    let (cairn, redis, raw) = rounds?;
    let redis = match version {
        Some(version) => RedisRun::Ran {
            version,
            figures: redis.into_iter().map(summary).collect(),
        },
        None => RedisRun::Skipped(format!(
            "Redis skipped: {} is not installed (scripts/setup-debian.sh installs it; \
             --redis-server names another)",
            args.redis_server
        )),
    };
    let [client_order, hash_order] = raw;
    let raw = (!client_order.is_empty()).then(|| [summary(client_order), summary(hash_order)]);
    let cairn = cairn
        .into_iter()
        .map(|(front_end, runs)| Side {
            front_end,
            figures: runs.into_iter().map(summary).collect(),
        })
        .collect();
    Ok((cairn, redis, raw))
}

/// What Cairn achieved through one front end, per workload.
struct Side {
    front_end: FrontEnd,
    figures: Vec<Summary>,
}

/// Every round of one workload on one side.
type Summary = ratio::Rounds<Figures>;

/// Keeps `runs` (in round order) for the report.
fn summary(runs: Vec<Figures>) -> Summary {
    ratio::Rounds::of(runs, Figures::keys_per_second)
}

/// Per front end of Cairn and per workload, every round's figures; the same of Redis (none
/// without Redis); and raw RocksDB's rounds, in client order and in hash order.
type Rounds = (
    Vec<(FrontEnd, Vec<Vec<Figures>>)>,
    Vec<Vec<Figures>>,
    [Vec<Figures>; 2],
);

async fn interleave(
    args: &Args,
    baseline: f64,
    node: &cairn::Node,
    redis_server: Option<&redis::Server>,
) -> anyhow::Result<Rounds> {
    let per_workload =
        || -> Vec<Vec<Figures>> { args.workloads.iter().map(|_| Vec::new()).collect() };
    let mut cairn = Vec::new();
    for &front_end in &args.front_ends {
        let connections = match front_end {
            FrontEnd::Grpc => node.connections(args.clients).await?,
            FrontEnd::Resp => node.resp_connections(args.clients).await?,
        };
        cairn.push(Driven {
            front_end,
            connections,
            runs: per_workload(),
        });
    }
    let admin = node.client().await?;
    progress(&format!("Cairn: writing {} keys to read", args.read_keys));
    drive::write_read_keys(args, &mut cairn[0].connections[0]).await?;
    let mut redis_connections = match redis_server {
        Some(server) => {
            let mut connections = server.connections(args.clients).await?;
            progress(&format!("Redis: writing {} keys to read", args.read_keys));
            drive::write_read_keys(args, &mut connections[0]).await?;
            Some(connections)
        }
        None => None,
    };

    // Raw RocksDB is the batched put's baseline: it runs only beside that workload.
    let with_raw = args.workloads.contains(&Workload::PutBatch);
    let mut raw: [Vec<Figures>; 2] = [Vec::new(), Vec::new()];
    let raw_dbs = if with_raw {
        tokio::task::spawn_blocking(|| -> anyhow::Result<Vec<Arc<rocksdb::RawDb>>> {
            [KeyOrder::Client, KeyOrder::Hashed]
                .into_iter()
                .map(|order| rocksdb::RawDb::create(order).map(Arc::new))
                .collect()
        })
        .await??
    } else {
        Vec::new()
    };
    let mut redis = per_workload();
    for round in 1..=args.rounds {
        let of = format!("round {round}/{}", args.rounds);
        for (db, runs) in raw_dbs.iter().zip(&mut raw) {
            let what = format!(
                "{of}: raw RocksDB, synced batches, {}",
                raw_name(db.order())
            );
            settle(args, baseline, &what).await?;
            progress(&what);
            let (raw_args, db) = (args.clone(), db.clone());
            let ran =
                tokio::task::spawn_blocking(move || rocksdb::synced_batches(&raw_args, &db, round))
                    .await??;
            progress(&format!("{what}: {}", ran.brief()));
            runs.push(ran);
        }
        for (i, &workload) in args.workloads.iter().enumerate() {
            let sides = cairn.len();
            for (side, driven) in cairn.iter_mut().enumerate() {
                let what = format!(
                    "{of}: Cairn ({}): {}",
                    driven.front_end.name(),
                    workload.name(args.batch)
                );
                settle(args, baseline, &what).await?;
                progress(&what);
                // Both front ends write to the one node: each run writes keys of its own.
                let pass = (round - 1) * sides + side + 1;
                let sent = std::mem::take(&mut driven.connections);
                let (ran, back) = drive::drive(args, workload, pass, sent, Vec::new()).await?;
                // What the node holds after it: its compactions' work grows with it.
                let store = node.store_size(&admin, args.partitions).await?;
                progress(&format!(
                    "{what}: {}; the node holds {} in tables, {} in memtables",
                    ran.brief(),
                    size(store.sst_bytes),
                    size(store.memtable_bytes)
                ));
                driven.runs[i].push(ran);
                driven.connections = back;
            }
            if let (Some(connections), Some(server)) = (redis_connections.take(), redis_server) {
                let what = format!("{of}: Redis: {}", workload.name(args.batch));
                settle(args, baseline, &what).await?;
                progress(&what);
                let (ran, back) =
                    drive::drive(args, workload, round, connections, vec![server.pid()]).await?;
                progress(&format!("{what}: {}", ran.brief()));
                redis[i].push(ran);
                redis_connections = Some(back);
            }
        }
    }
    // Closing the databases and removing their folders blocks.
    let _ = tokio::task::spawn_blocking(move || drop(raw_dbs)).await;
    if redis_server.is_none() {
        redis.clear();
    }
    let cairn = cairn.into_iter().map(|d| (d.front_end, d.runs)).collect();
    Ok((cairn, redis, raw))
}

/// Waits (up to `--settle-secs`) until the machine is as idle as it was at `baseline` before the
/// run `what`, and says so when that took a while.
async fn settle(args: &Args, baseline: f64, what: &str) -> anyhow::Result<()> {
    if args.settle_secs == 0.0 {
        return Ok(());
    }
    let max = Duration::from_secs_f64(args.settle_secs);
    let (waited, idle) = cairn_bench::settle(max, baseline).await?;
    if !idle {
        progress(&format!(
            "the machine is still busy after {:.1}s (--settle-secs); {what} starts anyway",
            waited.as_secs_f64()
        ));
    } else if waited > Duration::from_millis(500) {
        progress(&format!(
            "waited {:.1}s for the machine to be idle (what the last run left behind)",
            waited.as_secs_f64()
        ));
    }
    Ok(())
}

/// One of Cairn's front ends during the rounds: its clients' connections, and per workload the
/// figures of every round so far.
struct Driven {
    front_end: FrontEnd,
    connections: Vec<drive::Connection>,
    runs: Vec<Vec<Figures>>,
}

/// `keys/s p50 p99 CPU-per-key` of one run, in fixed columns.
fn columns(figures: &Figures) -> String {
    let cpu = figures
        .cpu_us_per_key()
        .map_or_else(|| "-".to_string(), |us| format!("{us:.1}"));
    format!(
        "{:>12.0} {:>8.2} {:>8.2} {cpu:>10}",
        figures.keys_per_second(),
        millis(figures.latency(0.50)),
        millis(figures.latency(0.99))
    )
}

/// The header of the CPU column: microseconds of CPU time per key.
const CPU_HEADER: &str = "CPU µs/key";

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn print_report(args: &Args, cairn: &[Side], redis: &RedisRun, raw: Option<&[Summary; 2]>) {
    match redis {
        RedisRun::Ran { version, .. } => println!(
            "Redis {version}: its own server on loopback, appendonly yes, appendfsync always; \
             batches pipelined, reads with GET and MGET; Cairn's Redis port gets the same requests \
             from the same client"
        ),
        RedisRun::Skipped(why) => println!("{why}"),
    }
    println!();
    let mut header = format!("{:<34}", "workload");
    for side in cairn {
        let name = format!("Cairn {}", side.front_end.name());
        header += &format!(
            " | {:>23} {:>8} {:>8} {:>10}",
            format!("{name} keys/s"),
            "p50 ms",
            "p99 ms",
            CPU_HEADER
        );
    }
    header += &format!(
        " | {:>12} {:>8} {:>8} {:>10}",
        "Redis keys/s", "p50 ms", "p99 ms", CPU_HEADER
    );
    for side in cairn {
        header += &format!(" | {:>20}", format!("{}/Redis", side.front_end.name()));
    }
    println!("{header}");
    for (i, workload) in args.workloads.iter().enumerate() {
        let mut line = format!("{:<34}", workload.name(args.batch));
        for side in cairn {
            line += &format!(" | {:>11}{}", "", columns(&side.figures[i].median));
        }
        match redis {
            RedisRun::Ran { figures, .. } => {
                line += &format!(" | {}", columns(&figures[i].median));
                for side in cairn {
                    line += &format!(" | {:>20}", side.figures[i].ratio_to(&figures[i]));
                }
            }
            RedisRun::Skipped(_) => {
                line += &format!(" | {:>12} {:>8} {:>8} {:>10}", "-", "-", "-", "-");
                for _ in cairn {
                    line += &format!(" | {:>20}", "-");
                }
            }
        }
        println!("{line}");
    }
    let Some(raw) = raw else {
        return;
    };
    for (order, figures) in [KeyOrder::Client, KeyOrder::Hashed].into_iter().zip(raw) {
        println!(
            "{:<34}   {:>11}{}",
            format!("raw RocksDB, batches, {}", raw_name(order)),
            "",
            columns(&figures.median)
        );
    }
    if let Some(i) = args.workloads.iter().position(|w| *w == Workload::PutBatch) {
        println!();
        for side in cairn {
            let put = &side.figures[i];
            println!(
                "batched put through Cairn's {}, Cairn/raw RocksDB: {} (keys in hash order, \
                 as Cairn stores them: {})",
                side.front_end.name(),
                put.ratio_to(&raw[0]),
                put.ratio_to(&raw[1])
            );
        }
    }
}

/// How the report names a raw RocksDB run.
fn raw_name(order: KeyOrder) -> &'static str {
    match order {
        KeyOrder::Client => "client order",
        KeyOrder::Hashed => "hash order",
    }
}
