//! `cairn`, the server. With no flags and no config file it runs a complete single-node store
//! under `./cairn-data`. Its subcommands are offline tools that work on a stopped node's data.

/// jemalloc, for Rust and (unprefixed) for RocksDB's C++: many small allocations per request on
/// every thread, where it is faster than the system allocator and fragments less.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use anyhow::Context;
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "cairn",
    version,
    about = "A partitioned, durable key-value store"
)]
struct Args {
    /// TOML configuration file
    #[arg(short, long, global = true)]
    config: Option<PathBuf>,
    /// Overrides `base-dir`
    #[arg(long, global = true)]
    base_dir: Option<PathBuf>,
    /// Overrides `node-name`
    #[arg(long, global = true)]
    node_name: Option<String>,
    /// Overrides `bind-address`
    #[arg(long, global = true)]
    bind_address: Option<SocketAddr>,
    #[command(subcommand)]
    tool: Option<Tool>,
}

/// Offline tools: the node must be stopped.
#[derive(clap::Subcommand)]
enum Tool {
    /// Drop one partition's local store, so that the next start restores it from a snapshot
    /// (with `snapshot-restore-policy = "on-init"`) or replays its log
    DropPartition {
        #[arg(short = 'p', long = "partition-id")]
        partition_id: u16,
        /// Do not ask for confirmation
        #[arg(short = 'y', long)]
        yes: bool,
        /// Drop it even if nothing could rebuild it (its log is trimmed past every snapshot)
        #[arg(long)]
        force: bool,
    },
    /// Mend one partition's log that the node refuses for damaged or missing records, keeping
    /// every other partition's: move its trim point past the damage when its store or a snapshot
    /// holds the records up to there (nothing lost), or else cut it after its last valid record
    RepairLog {
        #[arg(short = 'p', long = "partition-id")]
        partition_id: u16,
        /// Do not ask for confirmation
        #[arg(short = 'y', long)]
        yes: bool,
    },
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let args = Args::parse();
    let overrides = cairn_node::Overrides {
        base_dir: args.base_dir,
        node_name: args.node_name,
        bind_address: args.bind_address,
    };
    let is_tool = args.tool.is_some();
    let result = match args.tool {
        None => run(args.config, overrides),
        Some(tool) => run_tool(args.config, overrides, tool),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            // The server's log gets the error too; a tool's user reads the terminal only.
            if !is_tool {
                tracing::error!("{err:#}");
            }
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(config: Option<PathBuf>, overrides: cairn_node::Overrides) -> anyhow::Result<()> {
    let config = cairn_node::Config::load(config.as_deref(), &overrides)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(async {
        // Listening before the start: a SIGTERM that arrives while the node starts stops it
        // cleanly once it has, instead of killing it half-way.
        let shutdown = shutdown_signal()?;
        let node = cairn_node::start(config).await?;
        node.run_until(shutdown).await
    })
}

fn run_tool(
    config: Option<PathBuf>,
    overrides: cairn_node::Overrides,
    tool: Tool,
) -> anyhow::Result<()> {
    let config = cairn_node::Config::load(config.as_deref(), &overrides)?;
    match tool {
        Tool::DropPartition {
            partition_id,
            yes,
            force,
        } => {
            if !yes {
                anyhow::ensure!(
                    confirm(&format!(
                        "Drop the local store of partition {partition_id} in {}? Its data is gone from this node until it is restored or replayed.",
                        config.base_dir.display()
                    ))?,
                    "cancelled"
                );
            }
            let dropped = cairn_node::tools::drop_partition(
                &config,
                cairn_node::PartitionId(partition_id),
                force,
            )?;
            match dropped.applied_lsn {
                Some(lsn) => println!(
                    "Dropped the store of partition {} (it had applied the log up to LSN {lsn})",
                    dropped.partition
                ),
                None => println!(
                    "Dropped the store of partition {} (it could not be opened, so how far it had \
                     applied the log is not known)",
                    dropped.partition
                ),
            }
            Ok(())
        }
        Tool::RepairLog { partition_id, yes } => {
            let partition = cairn_node::PartitionId(partition_id);
            let repair = cairn_node::tools::repair_log(
                &config,
                partition,
                |asked| {
                    if yes {
                        println!("{asked} (--yes)");
                        Ok(true)
                    } else {
                        confirm(asked)
                    }
                },
                read_back_progress(),
            )?;
            print_log_repair(&repair);
            Ok(())
        }
    }
}

/// Shows on stderr how far the read-back of a snapshot `repair-log` is about to rely on has come:
/// a line when it starts, then at most one a second, and one when it is read back whole.
fn read_back_progress() -> cairn_node::tools::ReadBackProgress {
    use cairn_cli::show_bytes_count;
    use std::time::{Duration, Instant};
    let last = std::sync::Mutex::new(None::<Instant>);
    std::sync::Arc::new(move |snapshot, done, total| {
        let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match *last {
            None => eprintln!(
                "Reading snapshot {snapshot} ({}) back whole before relying on it",
                show_bytes_count(total)
            ),
            Some(at) if done < total && now.duration_since(at) < Duration::from_secs(1) => return,
            Some(_) => {}
        }
        eprintln!(
            "  {} of {} read back",
            show_bytes_count(done),
            show_bytes_count(total)
        );
        *last = Some(now);
    })
}

/// Asks on the terminal; without one, refuses and says how to proceed.
fn confirm(question: &str) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        anyhow::bail!(
            "{question} This needs confirmation and there is no terminal to ask on; pass -y to confirm"
        );
    }
    print!("{question} [y/N] ");
    std::io::stdout().flush().context("write prompt")?;
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer).context("read answer")?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES"))
}

/// Resolves at the first SIGTERM or SIGINT (Ctrl-C) received from the call on.
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("listen for SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("listen for SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = term.recv() => {}
        }
    })
}

fn print_log_repair(repair: &cairn_node::tools::LogRepair) {
    use cairn_node::tools::Holder;
    let partition = repair.partition;
    if let Some((lsn, holder)) = &repair.trimmed_to {
        let holder = match holder {
            Holder::Store => "the partition's store holds everything up to it".to_string(),
            Holder::Snapshot(snapshot) => {
                format!("snapshot {snapshot} holds everything up to it")
            }
        };
        println!("Moved the trim point of partition {partition}'s log up to LSN {lsn}: {holder}.");
    }
    let Some(cut) = &repair.cut else {
        println!(
            "No record was given up. At the next start the partition continues from its store, or restores from the snapshot if its store is behind it."
        );
        return;
    };
    let last = cut
        .dropped_lsns
        .last()
        .copied()
        .unwrap_or(0)
        .max(cut.tail + 1);
    println!(
        "Cut partition {partition}'s log after LSN {}: gave up LSN {}..={last} ({} damaged byte(s), {} valid record(s) after them). The other partitions' records are as they were.",
        cut.tail,
        cut.tail + 1,
        cut.dropped_damaged_bytes,
        cut.dropped_lsns.len()
    );
    if cut.damage_may_have_held_other_records {
        println!(
            "The damaged bytes were more than one record: another partition's records may have been among them, unreadable (a partition whose newest writes they were shows no gap). The copies below keep them as they were."
        );
    }
    for (segment, copy) in &cut.rewritten {
        println!(
            "Rewrote {}; it was kept as {} (delete it once the partition serves again).",
            segment.display(),
            copy.display()
        );
    }
    match repair.store_ahead {
        Some(applied) => println!(
            "Its store had applied the log up to LSN {applied}, past the cut: at the next start the partition stays down until it is rebuilt, with `cairnctl -y partitions restore -p {partition}` (from a snapshot at or below LSN {}) or, with the node stopped, `cairn drop-partition -p {partition}` (it then replays its log).",
            cut.tail
        ),
        None => println!(
            "At the next start the partition continues from LSN {}; its next write gets LSN {}.",
            cut.tail,
            cut.tail + 1
        ),
    }
}
