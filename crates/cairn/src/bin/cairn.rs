//! `cairn`, the server. With no flags and no config file it runs a complete single-node store
//! under `./cairn-data`.

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
    #[arg(short, long)]
    config: Option<PathBuf>,
    /// Overrides `base-dir`
    #[arg(long)]
    base_dir: Option<PathBuf>,
    /// Overrides `node-name`
    #[arg(long)]
    node_name: Option<String>,
    /// Overrides `bind-address`
    #[arg(long)]
    bind_address: Option<SocketAddr>,
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
    match run(args.config, overrides) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
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
        let node = cairn_node::start(config).await?;
        node.run_until(shutdown_signal()).await
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
