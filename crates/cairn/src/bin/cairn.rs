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
    }
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
