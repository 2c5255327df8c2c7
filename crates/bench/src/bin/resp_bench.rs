//! `redis-benchmark` against Cairn's Redis-protocol port and against `redis-server --appendonly
//! yes --appendfsync always`, in the same run with the same flags: `SET`, `GET` and `SET … NX EX`
//! (Cairn's insert-if-absent), pipelined and one command at a time. Prints requests per second,
//! p50/p99 latency per workload, the medians of `--rounds` rounds that alternate between the two
//! servers, and the ratio Cairn ÷ Redis of each round: their median and range.
//!
//! ```text
//! cargo build --release --workspace --all-features --bins
//! target/release/cairn-resp-bench                 # the figures of the closing notes
//! target/release/cairn-resp-bench --requests 2000 --rounds 1   # seconds, to see that it runs
//! ```

use anyhow::{Context, bail};
use cairn_bench::ratio::Rounds;
use cairn_bench::redis_server::RedisProcess;
use cairn_bench::report;
use clap::Parser;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "cairn-resp-bench",
    about = "redis-benchmark against Cairn's Redis port and Redis with appendfsync always"
)]
struct Args {
    /// Requests of each pipelined workload (`-n`); one-at-a-time workloads run a twentieth
    #[arg(long, default_value_t = 1_000_000)]
    requests: u64,
    /// Concurrent connections (`-c`)
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Commands per pipeline of the pipelined workloads (`-P`)
    #[arg(long, default_value_t = 100)]
    pipeline: usize,
    /// Value size in bytes (`-d`)
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Random keys drawn from this many (`-r`)
    #[arg(long, default_value_t = 10_000_000)]
    keyspace: u64,
    /// Times each workload runs on each server; the report shows the medians
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Partitions of the Cairn node
    #[arg(long, default_value_t = 16)]
    partitions: u16,
    /// The `redis-server` binary
    #[arg(long, default_value = "redis-server")]
    redis_server: String,
    /// The `redis-benchmark` binary
    #[arg(long, default_value = "redis-benchmark")]
    redis_benchmark: String,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Workload {
    Set,
    Get,
    SetNxEx,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Set => "SET",
            Workload::Get => "GET",
            Workload::SetNxEx => "SET NX EX (insert-if-absent)",
        }
    }

    /// `redis-benchmark`'s arguments for the workload.
    fn arguments(self, value_bytes: usize) -> Vec<String> {
        match self {
            Workload::Set => vec!["-t".into(), "set".into()],
            Workload::Get => vec!["-t".into(), "get".into()],
            Workload::SetNxEx => vec![
                "SET".into(),
                "key:__rand_int__".into(),
                "v".repeat(value_bytes),
                "NX".into(),
                "EX".into(),
                "3600".into(),
            ],
        }
    }
}

/// One run's figures, as `redis-benchmark --csv` prints them.
#[derive(Clone, Copy, Debug, Default)]
struct Figures {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Runs `redis-benchmark` once against `port`. Blocking.
fn run(args: &Args, port: u16, workload: Workload, pipeline: usize) -> anyhow::Result<Figures> {
    let requests = if pipeline > 1 {
        args.requests
    } else {
        (args.requests / 20).max(1)
    };
    let output = Command::new(&args.redis_benchmark)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", &args.clients.to_string(), "-P", &pipeline.to_string()])
        .args(["-d", &args.value_bytes.to_string()])
        .args([
            "-r",
            &args.keyspace.to_string(),
            "-n",
            &requests.to_string(),
        ])
        .arg("--csv")
        .args(workload.arguments(args.value_bytes))
        .stdin(Stdio::null())
        .output();
    let output = match output {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "{} is not installed: run scripts/setup-debian.sh, which installs redis-tools",
            args.redis_benchmark
        ),
        other => other.with_context(|| format!("run {}", args.redis_benchmark))?,
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    // The header line, then one line per test: "test","rps","avg_latency_ms","min_latency_ms",
    // "p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms".
    let line = stdout
        .lines()
        .find(|l| !l.starts_with("\"test\"") && l.starts_with('"'))
        .with_context(|| {
            format!(
                "{} printed no figures ({}); its output:\n{stdout}{}",
                args.redis_benchmark,
                output.status,
                String::from_utf8_lossy(&output.stderr)
            )
        })?;
    let fields: Vec<f64> = line
        .split("\",\"")
        .skip(1)
        .map(|f| f.trim_matches('"').parse().unwrap_or(f64::NAN))
        .collect();
    if fields.len() < 6 || fields[0].is_nan() {
        bail!("cannot read redis-benchmark's line {line:?}");
    }
    Ok(Figures {
        rps: fields[0],
        p50_ms: fields[3],
        p99_ms: fields[5],
    })
}

/// Waits until `port` answers `SET` with `OK`: a Cairn node accepts connections before every
/// partition serves, and answers `TRYAGAIN` meanwhile.
fn wait_until_writable(port: u16, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let answer = Command::new("redis-cli")
            .args([
                "-p",
                &port.to_string(),
                "SET",
                "cairn-resp-bench:ready",
                "1",
            ])
            .stdin(Stdio::null())
            .output();
        match answer {
            Ok(out) if String::from_utf8_lossy(&out.stdout).trim() == "OK" => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("redis-cli is not installed: run scripts/setup-debian.sh")
            }
            _ if Instant::now() > deadline => {
                bail!("the server on port {port} did not take a SET within {timeout:?}")
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    let dir =
        cairn_bench::blocking(|| tempfile::tempdir().context("create a temporary folder")).await?;
    let config = cairn_node::Config {
        base_dir: dir.path().to_path_buf(),
        bind_address: "127.0.0.1:0".parse()?,
        num_partitions: args.partitions,
        metrics: cairn_node::config::MetricsConfig { bind_address: None },
        resp: cairn_node::config::RespConfig {
            bind_address: Some("127.0.0.1:0".parse()?),
            ..Default::default()
        },
        ..cairn_node::Config::default()
    };
    let node = cairn_node::start(config)
        .await
        .context("start the benchmark's Cairn node")?;
    // The node is stopped however the runs end: its processors must not be applying records
    // when the process exits.
    let measured = measure(&args, &node).await;
    let stopped = node.shutdown().await.context("stop the Cairn node");
    let (redis, measured) = match measured {
        Ok(redis) => (Some(redis), Ok(())),
        Err(err) => (None, Err(err)),
    };
    // Killing Redis waits for it, and removing the folders blocks.
    let _ = cairn_bench::blocking(move || {
        drop(redis);
        drop(dir);
        Ok(())
    })
    .await;
    measured?;
    stopped
}

/// Every round against `node` and a Redis of its own, then the report. Returns the Redis, for the
/// caller to stop.
async fn measure(args: &Args, node: &cairn_node::RunningNode) -> anyhow::Result<RedisProcess> {
    let client = cairn_client::Client::connect(
        &format!("http://{}", node.local_addr()),
        &cairn_client::ClientOptions::default(),
    )
    .await
    .context("connect to the benchmark's Cairn node")?;
    cairn_bench::wait_until_serving(&client, Duration::from_secs(90)).await?;
    let cairn_port = node
        .resp_addr()
        .context("the node has no RESP port")?
        .port();
    let binary = args.redis_server.clone();
    let redis = cairn_bench::blocking(move || RedisProcess::launch(&binary))
        .await?
        .with_context(|| {
            format!(
                "{} is not installed: run scripts/setup-debian.sh, which installs redis-server",
                args.redis_server
            )
        })?;
    let redis_port = redis.port;
    cairn_bench::blocking(move || {
        wait_until_writable(cairn_port, Duration::from_secs(90))?;
        wait_until_writable(redis_port, Duration::from_secs(10))
    })
    .await?;

    let shapes: Vec<(Workload, usize)> = [args.pipeline, 1]
        .into_iter()
        .flat_map(|p| {
            [Workload::Set, Workload::Get, Workload::SetNxEx]
                .into_iter()
                .map(move |w| (w, p))
        })
        .collect();
    let mut cairn: Vec<Vec<Figures>> = vec![Vec::new(); shapes.len()];
    let mut redis_figures: Vec<Vec<Figures>> = vec![Vec::new(); shapes.len()];
    for round in 1..=args.rounds {
        for (i, &(workload, pipeline)) in shapes.iter().enumerate() {
            report::progress(&format!(
                "round {round}/{}: {} -P {pipeline}",
                args.rounds,
                workload.name()
            ));
            // Alternating, so that both see the machine in the same state.
            let a = args.clone();
            cairn[i].push(
                cairn_bench::blocking(move || run(&a, cairn_port, workload, pipeline)).await?,
            );
            let a = args.clone();
            redis_figures[i].push(
                cairn_bench::blocking(move || run(&a, redis_port, workload, pipeline)).await?,
            );
        }
    }

    println!(
        "\nredis-benchmark -c {} -d {} -r {} -n {} (one at a time: -n {}), medians of {} rounds; the ratio of each round, their median and range",
        args.clients,
        args.value_bytes,
        args.keyspace,
        args.requests,
        (args.requests / 20).max(1),
        args.rounds
    );
    println!(
        "Cairn: one node, {} partitions, local log. Redis: appendonly yes, appendfsync always.\n",
        args.partitions
    );
    println!(
        "{:<32} {:>4} {:>12} {:>9} {:>9} {:>12} {:>9} {:>9} {:>17}",
        "workload", "-P", "Cairn rps", "p50 ms", "p99 ms", "Redis rps", "p50 ms", "p99 ms", "ratio"
    );
    for (i, &(workload, pipeline)) in shapes.iter().enumerate() {
        let cairn_rounds = Rounds::of(cairn[i].clone(), |f| f.rps);
        let redis_rounds = Rounds::of(redis_figures[i].clone(), |f| f.rps);
        // Round by round: each round ran both servers one right after the other.
        let ratio = cairn_rounds.ratio_to(&redis_rounds);
        let (c, r) = (cairn_rounds.median, redis_rounds.median);
        println!(
            "{:<32} {:>4} {:>12.0} {:>9.2} {:>9.2} {:>12.0} {:>9.2} {:>9.2} {:>17}",
            workload.name(),
            pipeline,
            c.rps,
            c.p50_ms,
            c.p99_ms,
            r.rps,
            r.p50_ms,
            r.p99_ms,
            ratio
        );
    }
    Ok(redis)
}
