//! `cairnctl`: the admin command line. Parses arguments, calls a node through `cairn-client` and
//! prints tables.
//!
//! Architecture invariant: the CLI talks to nodes only through the public gRPC API; it never opens
//! a node's files.

mod args;
mod commands;
mod export;
mod output;
mod scaling;

pub use args::Cli;
pub use output::show_bytes_count;

/// Parses the process arguments, runs the command and returns the process exit code.
pub fn main() -> std::process::ExitCode {
    use clap::Parser;
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
