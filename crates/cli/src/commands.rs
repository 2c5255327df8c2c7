//! What each subcommand does.

use crate::args::{Cli, Command, GlobalOptions, KvCommand, LogsCommand, PartitionsCommand};
use crate::output::{show_bytes, table};
use anyhow::{Context, bail};
use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry};
use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let client = connect(&cli.global).await?;
    let global = &cli.global;
    match cli.command {
        Command::Kv(command) => kv(&client, global, command).await,
        Command::Partitions(PartitionsCommand::List) => partitions_list(&client, global).await,
        Command::Logs(LogsCommand::Describe { log_id }) => {
            logs_describe(&client, global, log_id).await
        }
        Command::Logs(LogsCommand::Trim { log_id, trim_point }) => {
            logs_trim(&client, global, log_id, trim_point).await
        }
    }
}

async fn connect(global: &GlobalOptions) -> anyhow::Result<Client> {
    let options = ClientOptions {
        connect_timeout: Duration::from_millis(global.connect_timeout),
        request_timeout: Duration::from_millis(global.request_timeout),
    };
    Ok(Client::connect(&global.address, &options).await?)
}

fn keys(keys: Vec<String>) -> Vec<Bytes> {
    keys.into_iter().map(Bytes::from).collect()
}

async fn kv(
    client: &Client,
    global: &GlobalOptions,
    command: KvCommand,
) -> anyhow::Result<ExitCode> {
    match command {
        KvCommand::Put { key, value, ttl } => {
            client
                .put(vec![PutEntry {
                    key: key.into(),
                    value: value.into(),
                    ttl,
                }])
                .await?;
            println!("OK");
        }
        KvCommand::Get { keys: names } => {
            let values = client.get(keys(names.clone())).await?;
            if let [value] = values.as_slice() {
                // One key: the bare value, so scripts can use it; absence is an error.
                match value {
                    Some(v) => println!("{}", show_bytes(v)),
                    None => {
                        eprintln!("key {} not found", names[0]);
                        return Ok(ExitCode::FAILURE);
                    }
                }
            } else {
                let mut t = table(global.table_style, &["KEY", "VALUE"]);
                for (name, value) in names.iter().zip(values) {
                    t.add_row(vec![
                        name.clone(),
                        value.map_or_else(|| "(absent)".to_string(), |v| show_bytes(&v)),
                    ]);
                }
                println!("{t}");
            }
        }
        KvCommand::Delete { keys: names } => {
            client.delete(keys(names)).await?;
            println!("OK");
        }
        KvCommand::Exists { keys: names } => {
            let exists = client.exists(keys(names.clone())).await?;
            let mut t = table(global.table_style, &["KEY", "EXISTS"]);
            for (name, exists) in names.iter().zip(exists) {
                t.add_row(vec![name.clone(), exists.to_string()]);
            }
            println!("{t}");
        }
        KvCommand::InsertIfAbsent {
            keys: names,
            value,
            ttl,
        } => {
            let inserted = client
                .insert_if_absent(keys(names.clone()), value.into(), ttl)
                .await?;
            let mut t = table(global.table_style, &["KEY", "INSERTED"]);
            for (name, inserted) in names.iter().zip(inserted) {
                t.add_row(vec![name.clone(), inserted.to_string()]);
            }
            println!("{t}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn partitions_list(client: &Client, global: &GlobalOptions) -> anyhow::Result<ExitCode> {
    let response = client.list_partitions().await?;
    let mut t = table(
        global.table_style,
        &[
            "ID",
            "KEY RANGE",
            "LEADER",
            "EPOCH",
            "APPLIED LSN",
            "LOG TRIM POINT",
            "LOG TAIL",
            "STATUS",
        ],
    );
    for p in response.partitions {
        t.add_row(vec![
            p.partition_id.to_string(),
            format!("{}..={}", p.key_range_start, p.key_range_end),
            if p.leader.is_empty() {
                "-".into()
            } else {
                p.leader
            },
            p.epoch.to_string(),
            p.applied_lsn.to_string(),
            p.log_trim_point.to_string(),
            p.log_tail.to_string(),
            p.status,
        ]);
    }
    println!("{t}");
    if global.verbose > 0 {
        println!(
            "partition table version {}",
            response.partition_table_version
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn logs_describe(
    client: &Client,
    global: &GlobalOptions,
    log_id: Option<u32>,
) -> anyhow::Result<ExitCode> {
    let logs = client.describe_logs(log_id).await?;
    let mut t = table(global.table_style, &["LOG", "TRIM POINT", "TAIL"]);
    for log in logs {
        t.add_row(vec![
            log.log_id.to_string(),
            log.trim_point.to_string(),
            log.tail.to_string(),
        ]);
    }
    println!("{t}");
    Ok(ExitCode::SUCCESS)
}

async fn logs_trim(
    client: &Client,
    global: &GlobalOptions,
    log_id: u32,
    trim_point: u64,
) -> anyhow::Result<ExitCode> {
    if !global.yes {
        confirm(&format!(
            "Trim log {log_id} up to LSN {trim_point}? Records up to it are deleted for good."
        ))?;
    }
    let response = client.trim_log(log_id, trim_point).await?;
    println!(
        "Log {log_id} trimmed: trim point {}, tail {}",
        response.trim_point, response.tail
    );
    Ok(ExitCode::SUCCESS)
}

/// Asks on the terminal; without one, refuses and says how to proceed.
fn confirm(question: &str) -> anyhow::Result<()> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        bail!(
            "{question} This needs confirmation and there is no terminal to ask on; pass -y to confirm"
        );
    }
    print!("{question} [y/N] ");
    std::io::stdout().flush().context("write prompt")?;
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer).context("read answer")?;
    if matches!(answer.trim(), "y" | "Y" | "yes" | "YES") {
        Ok(())
    } else {
        bail!("cancelled")
    }
}
