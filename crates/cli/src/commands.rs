//! What each subcommand does.

use crate::args::{
    Cli, ClusterCommand, Command, GlobalOptions, KvCommand, LogsCommand, NodesCommand,
    PartitionsCommand, SnapshotsCommand,
};
use crate::output::{show_bytes, show_bytes_count, show_time, table};
use anyhow::{Context, bail};
use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry, v1};
use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let client = connect(&cli.global).await?;
    let global = &cli.global;
    match cli.command {
        Command::Kv(command) => kv(&client, global, command).await,
        Command::Partitions(PartitionsCommand::List) => partitions_list(&client, global).await,
        Command::Partitions(PartitionsCommand::Describe { partition_id }) => {
            partitions_describe(&client, global, partition_id).await
        }
        Command::Partitions(PartitionsCommand::Compact { partition_id }) => {
            partitions_compact(&client, global, partition_id).await
        }
        Command::Partitions(PartitionsCommand::Restore {
            partition_id,
            snapshot,
        }) => partitions_restore(&client, global, partition_id, snapshot).await,
        Command::Partitions(PartitionsCommand::Load { partition_id, node }) => {
            crate::scaling::partitions_load(&client, global, partition_id, node).await
        }
        Command::Logs(LogsCommand::Describe { log_id }) => {
            logs_describe(&client, global, log_id).await
        }
        Command::Logs(LogsCommand::Trim {
            log_id,
            trim_point,
            force,
        }) => logs_trim(&client, global, log_id, trim_point, force).await,
        Command::Snapshots(command) => snapshots(&client, global, command).await,
        Command::Nodes(NodesCommand::List) => nodes_list(&client, global).await,
        Command::Nodes(NodesCommand::Remove { node }) => {
            if !global.yes {
                confirm(&format!(
                    "Remove node {node} from the cluster? It is no longer listed or placed on."
                ))?;
            }
            client.remove_node(node.clone()).await?;
            println!("Node {node} removed from the cluster");
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster(ClusterCommand::Status) => cluster_status(&client).await,
        Command::Cluster(ClusterCommand::Plan {
            nodes,
            output,
            upload,
        }) => crate::scaling::cluster_plan(&client, global, nodes, output, upload).await,
        Command::Cluster(ClusterCommand::Scale {
            nodes,
            max_concurrent_moves,
            detach,
            no_upload,
        }) => {
            let options = crate::scaling::ScaleOptions {
                max_concurrent_moves,
                detach,
                upload: !no_upload,
            };
            crate::scaling::cluster_scale(&client, global, nodes, options).await
        }
        Command::Cluster(ClusterCommand::Operations(command)) => {
            crate::scaling::operations(&client, global, command).await
        }
    }
}

async fn cluster_status(client: &Client) -> anyhow::Result<ExitCode> {
    let cluster = client.describe_cluster().await?;
    println!("cluster:          {}", cluster.cluster_name);
    println!("partitions:       {}", cluster.num_partitions);
    println!(
        "placement:        version {} (as {} last read it)",
        cluster.partition_table_version, cluster.node_name
    );
    if cluster.node_timeout_ms == 0 {
        println!("controller:       none: {} runs alone", cluster.node_name);
        return Ok(ExitCode::SUCCESS);
    }
    if cluster.controller.is_empty() {
        println!("controller:       nobody holds the lease now");
    } else {
        println!(
            "controller:       {} (term {})",
            cluster.controller, cluster.controller_term
        );
    }
    println!(
        "node timeout:     {} ms (a leader stops serving {} ms after its last heartbeat)",
        cluster.node_timeout_ms,
        cluster.node_timeout_ms * 2 / 3
    );
    let nodes = client.list_nodes().await?;
    let count = |state: &str| nodes.iter().filter(|n| n.state == state).count();
    println!(
        "nodes:            {} alive, {} starting, {} silent, {} dead, {} left",
        count("alive"),
        count("starting"),
        count("silent"),
        count("dead"),
        count("left")
    );
    Ok(ExitCode::SUCCESS)
}

async fn nodes_list(client: &Client, global: &GlobalOptions) -> anyhow::Result<ExitCode> {
    let nodes = client.list_nodes().await?;
    let mut t = table(
        global.table_style,
        &["NODE", "ADDRESS", "STATUS", "LAST SEEN", "LEADS", "FOLLOWS"],
    );
    for n in nodes {
        // How long ago the answering node saw the record change, by its own clock.
        let ago = format!("{:.1} s ago", n.last_seen_ago_ms as f64 / 1000.0);
        let last_seen = match global.time_format {
            _ if n.last_seen_ms == 0 => "-".to_string(),
            crate::args::TimeFormat::Human => ago,
            format => format!("{} ({ago})", show_time_ms(n.last_seen_ms, format)),
        };
        let status = if n.state.is_empty() {
            if n.alive { "alive" } else { "dead" }.to_string()
        } else {
            n.state
        };
        t.add_row(vec![
            n.name,
            n.address,
            status,
            last_seen,
            n.leads.to_string(),
            n.follows.to_string(),
        ]);
    }
    println!("{t}");
    Ok(ExitCode::SUCCESS)
}

async fn snapshots(
    client: &Client,
    global: &GlobalOptions,
    command: SnapshotsCommand,
) -> anyhow::Result<ExitCode> {
    match command {
        SnapshotsCommand::Create {
            partition_id,
            node,
            full,
            min_lsn,
            trim_log,
        } => {
            let request = |partition_id| v1::CreateSnapshotRequest {
                partition_id,
                min_lsn,
                trim_log,
                full,
            };
            let partitions: Vec<u32> = match (partition_id.as_slice(), node) {
                ([partition_id], None) => {
                    let bar = progress_bar(global, 0, "bytes");
                    bar.set_message(format!("partition {partition_id}"));
                    let created = create_snapshot(client, &bar, request(*partition_id)).await;
                    bar.finish_and_clear();
                    print_created(&created?);
                    return Ok(ExitCode::SUCCESS);
                }
                ([], Some(node)) => led_by(client, &node).await?,
                ([], None) => all_partitions(client).await?,
                (chosen, _) => chosen.to_vec(),
            };
            let requests = partitions.into_iter().map(request).collect();
            create_snapshots(client, global, requests, false).await?;
        }
        SnapshotsCommand::List { partition_id } => {
            let response = client.list_snapshots(partition_id).await?;
            let mut t = table(
                global.table_style,
                &[
                    "ID",
                    "PARTITION",
                    "LSN",
                    "CREATED",
                    "NODE",
                    "SIZE",
                    "FILES",
                    "UPLOADED",
                ],
            );
            for s in &response.snapshots {
                t.add_row(vec![
                    s.snapshot_id.clone(),
                    s.partition_id.to_string(),
                    s.lsn.to_string(),
                    show_time(&s.created_at, global.time_format),
                    s.node_name.clone(),
                    show_bytes_count(s.size_bytes),
                    s.files.to_string(),
                    show_bytes_count(s.uploaded_bytes),
                ]);
            }
            println!("{t}");
            if global.verbose > 0 || response.snapshots.is_empty() {
                println!(
                    "{} snapshot(s) in {}",
                    response.snapshots.len(),
                    response.destination
                );
            }
            for bad in &response.unreadable {
                eprintln!(
                    "partition {}: snapshots not listed: {}",
                    bad.partition_id, bad.error
                );
            }
            if !response.unreadable.is_empty() {
                let partitions: std::collections::BTreeSet<u32> = response
                    .unreadable
                    .iter()
                    .map(|bad| bad.partition_id)
                    .collect();
                bail!(
                    "snapshots of {} partition(s) could not be read; see above",
                    partitions.len()
                );
            }
        }
        SnapshotsCommand::Describe { snapshot_id } => {
            println!("{}", client.describe_snapshot(&snapshot_id).await?);
        }
        SnapshotsCommand::Verify { snapshot_id } => {
            let report = client.verify_snapshot(&snapshot_id).await?;
            println!(
                "Snapshot {snapshot_id} verified: {} files, {} ({} bytes), every size and checksum matches",
                report.files,
                show_bytes_count(report.bytes),
                report.bytes
            );
        }
        SnapshotsCommand::Export {
            snapshot_id,
            output,
        } => {
            let bar = progress_bar(global, 0, "bytes");
            bar.set_message(snapshot_id.clone());
            let exported =
                crate::export::export_snapshot(client, &bar, &snapshot_id, &output).await;
            if exported.is_err() {
                bar.abandon();
            }
            exported?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Every partition's id.
async fn all_partitions(client: &Client) -> anyhow::Result<Vec<u32>> {
    let partitions = client.list_partitions().await?.partitions;
    Ok(partitions.iter().map(|p| p.partition_id).collect())
}

/// The partitions `node` leads, by the placement; refused, naming the nodes, when it leads
/// none.
async fn led_by(client: &Client, node: &str) -> anyhow::Result<Vec<u32>> {
    let partitions = client.list_partitions().await?.partitions;
    let led: Vec<u32> = partitions
        .iter()
        .filter(|p| p.leader == node)
        .map(|p| p.partition_id)
        .collect();
    if led.is_empty() {
        let mut leaders: Vec<&str> = partitions.iter().map(|p| p.leader.as_str()).collect();
        leaders.sort_unstable();
        leaders.dedup();
        bail!(
            "node {node} leads no partition; the leaders are {}",
            leaders.join(", ")
        );
    }
    Ok(led)
}

/// Snapshots each request's partition in turn, with a bar over the partitions; every one is
/// tried, and the failed ones are named at the end. What each did goes to stdout, or to stderr
/// when stdout carries something else (a JSON document).
pub(crate) async fn create_snapshots(
    client: &Client,
    global: &GlobalOptions,
    requests: Vec<v1::CreateSnapshotRequest>,
    to_stderr: bool,
) -> anyhow::Result<()> {
    let bar = progress_bar(global, requests.len() as u64, "partitions");
    let mut failed = Vec::new();
    for request in requests {
        let partition_id = request.partition_id;
        bar.set_message(format!("partition {partition_id}"));
        // The partitions' bar stays; a publish's bytes would make it jump back and forth.
        let quiet = indicatif::ProgressBar::hidden();
        match create_snapshot(client, &quiet, request).await {
            Ok(created) => bar.suspend(|| match to_stderr {
                true => eprintln!("{}", created_lines(&created)),
                false => print_created(&created),
            }),
            Err(err) => {
                bar.suspend(|| eprintln!("partition {partition_id}: {err:#}"));
                failed.push(partition_id);
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    if !failed.is_empty() {
        bail!("snapshots of partitions {failed:?} failed; see the errors above");
    }
    Ok(())
}

/// Starts a snapshot and follows its publish on `bar` until the node says it is done. The
/// publish is the node's task: if this process stops, it still completes.
async fn create_snapshot(
    client: &Client,
    bar: &indicatif::ProgressBar,
    request: v1::CreateSnapshotRequest,
) -> anyhow::Result<cairn_client::v1::CreateSnapshotResponse> {
    let partition_id = request.partition_id;
    let mut stream = client.create_snapshot_with(request).await?;
    loop {
        let progress = match stream.message().await {
            Ok(Some(progress)) => progress,
            Ok(None) => bail!(
                "the node ended the snapshot of partition {partition_id} without saying whether it was published; `cairnctl snapshots list -p {partition_id}` shows whether it was"
            ),
            Err(status) => return Err(client.stream_error(status).into()),
        };
        if let Some(done) = progress.done {
            return Ok(done);
        }
        match progress.phase.as_str() {
            "waiting" => bar.set_message(progress.message),
            "upload" => {
                bar.set_message(format!("partition {partition_id}: uploading"));
                bar.set_length(progress.bytes_total);
                bar.set_position(progress.bytes_done);
            }
            _ => {}
        }
    }
}

fn print_created(created: &cairn_client::v1::CreateSnapshotResponse) {
    println!("{}", created_lines(created));
}

/// What a snapshot request did, in words.
fn created_lines(created: &cairn_client::v1::CreateSnapshotResponse) -> String {
    let mut lines = if created.created {
        format!("Snapshot created: {}", created.snapshot_id)
    } else {
        format!(
            "Snapshot exists: {} (partition {} at LSN {} already covers the request)",
            created.snapshot_id, created.partition_id, created.lsn
        )
    };
    if let Some(trim_point) = created.log_trim_point {
        lines.push_str(&format!(
            "\nLog {} trimmed up to LSN {trim_point}",
            created.partition_id
        ));
    }
    lines
}

pub(crate) fn progress_bar(global: &GlobalOptions, len: u64, unit: &str) -> indicatif::ProgressBar {
    if global.quiet > 0 {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    let template = if unit == "bytes" {
        "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})"
    } else {
        "{spinner} {msg} [{bar:30}] {pos}/{len} partitions ({eta})"
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn consistency(freshness: &crate::args::Freshness) -> cairn_client::Consistency {
    match freshness.max_staleness {
        None => cairn_client::Consistency::Linearizable,
        Some(max) => cairn_client::Consistency::BoundedStaleness(max),
    }
}

async fn connect(global: &GlobalOptions) -> anyhow::Result<Client> {
    let options = ClientOptions {
        connect_timeout: Duration::from_millis(global.connect_timeout),
        request_timeout: Duration::from_millis(global.request_timeout),
    };
    // The first node that answers: any node of a cluster answers for all of it.
    let mut last = None;
    for address in &global.address {
        match Client::connect(address, &options).await {
            Ok(client) => return Ok(client),
            Err(err) => last = Some(err),
        }
    }
    match last {
        Some(err) => Err(err.into()),
        None => anyhow::bail!("no node address given; give --address host:port"),
    }
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
        KvCommand::Get {
            keys: names,
            freshness,
        } => {
            let values = client
                .get_with(keys(names.clone()), consistency(&freshness))
                .await?;
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
        KvCommand::Exists {
            keys: names,
            freshness,
        } => {
            let exists = client
                .exists_with(keys(names.clone()), consistency(&freshness))
                .await?;
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
            "FOLLOWERS",
            "EPOCH",
            "APPLIED LSN",
            "LOG TRIM POINT",
            "LOG TAIL",
            "ARCHIVED LSN",
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
            if p.followers.is_empty() {
                "-".into()
            } else {
                p.followers.join(",")
            },
            p.epoch.to_string(),
            p.applied_lsn.to_string(),
            p.log_trim_point.to_string(),
            p.log_tail.to_string(),
            p.archived_lsn.map_or_else(|| "-".into(), |l| l.to_string()),
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
    let mut problems = Vec::new();
    for log in logs {
        if log.problem.is_empty() {
            t.add_row(vec![
                log.log_id.to_string(),
                log.trim_point.to_string(),
                log.tail.to_string(),
            ]);
        } else {
            t.add_row(vec![log.log_id.to_string(), "-".into(), "-".into()]);
            problems.push((log.log_id, log.problem));
        }
    }
    println!("{t}");
    // The readable logs are listed; each unreadable one is named on stderr, and the exit status
    // says that something is wrong.
    for (log_id, problem) in &problems {
        eprintln!("log {log_id}: {problem}");
    }
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

async fn logs_trim(
    client: &Client,
    global: &GlobalOptions,
    log_id: u32,
    trim_point: u64,
    force: bool,
) -> anyhow::Result<ExitCode> {
    if !global.yes {
        let forced = if force {
            " With --force, records that no snapshot covers are lost to every restore."
        } else {
            ""
        };
        confirm(&format!(
            "Trim log {log_id} up to LSN {trim_point}? Records up to it are deleted for good.{forced}"
        ))?;
    }
    let response = client.trim_log(log_id, trim_point, force).await?;
    println!(
        "Log {log_id} trimmed: trim point {}, tail {}",
        response.trim_point, response.tail
    );
    Ok(ExitCode::SUCCESS)
}

async fn partitions_describe(
    client: &Client,
    global: &GlobalOptions,
    partition_id: u32,
) -> anyhow::Result<ExitCode> {
    let response = client.describe_partition(partition_id).await?;
    let p = response.partition.unwrap_or_default();
    println!("partition        {}", p.partition_id);
    println!(
        "key range        {}..={}",
        p.key_range_start, p.key_range_end
    );
    println!("status           {}", p.status);
    println!(
        "leader           {} (epoch {})",
        if p.leader.is_empty() { "-" } else { &p.leader },
        p.epoch
    );
    println!("applied LSN      {}", p.applied_lsn);
    println!(
        "log              trim point {}, tail {}",
        p.log_trim_point, p.log_tail
    );
    let Some(store) = response.store else {
        println!("store            not serving here: no estimates");
        return Ok(ExitCode::SUCCESS);
    };
    let time = |ms| show_time_ms(ms, global.time_format);
    println!("partition time   {}", time(store.partition_time_ms));
    println!("expiry horizon   {}", time(store.expiry_horizon_ms));
    println!(
        "keys             ~{} (live and expired alike)",
        store.estimated_keys
    );
    if response.sampled_values > 0 {
        println!(
            "expired          ~{:.1}% not yet reclaimed ({} of {} values sampled)",
            100.0 * response.sampled_expired as f64 / response.sampled_values as f64,
            response.sampled_expired,
            response.sampled_values
        );
    }
    println!(
        "on disk          {} in SST files, {} in memtables",
        show_bytes_count(store.live_sst_bytes),
        show_bytes_count(store.memtable_bytes)
    );
    println!(
        "reclaimed        {} expired values since the node started",
        store.expired_dropped
    );
    for line in compaction_lines(&store) {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// What `partitions describe` says of a store's compactions: whether RocksDB holds its writes
/// back, and the failed or refused flushes and compactions, with what the operator can do.
fn compaction_lines(store: &cairn_client::v1::PartitionStoreInfo) -> Vec<String> {
    use cairn_client::v1::WriteStall;
    let state = match store.write_stall.map(|_| store.write_stall()) {
        None => "not reported by this node (a version before the report)",
        Some(WriteStall::None) => "keeping up",
        Some(WriteStall::Slowed) => {
            "behind: RocksDB slows this partition's writes until they catch up"
        }
        Some(WriteStall::Stopped) => {
            "behind: RocksDB stops this partition's writes until they catch up"
        }
    };
    let mut lines = vec![format!("compactions      {state}")];
    if store.background_errors > 0 {
        lines.push(format!(
            "                 {} failed or refused since the store was opened (the node's log \
             says why); if for want of disk, a merge of the oldest tables needs about {} free \
             beside them",
            store.background_errors,
            show_bytes_count(store.live_sst_bytes)
        ));
    }
    lines
}

/// A time in ms since the Unix epoch as `--time-format` asks, or `-` for 0 (no record applied
/// yet).
pub(crate) fn show_time_ms(ms: u64, format: crate::args::TimeFormat) -> String {
    if ms == 0 {
        return "-".into();
    }
    let at = std::time::UNIX_EPOCH + Duration::from_millis(ms);
    show_time(&humantime::format_rfc3339_millis(at).to_string(), format)
}

async fn partitions_compact(
    client: &Client,
    global: &GlobalOptions,
    partition_id: Option<u32>,
) -> anyhow::Result<ExitCode> {
    let ids: Vec<u32> = match partition_id {
        Some(id) => vec![id],
        None => all_partitions(client).await?,
    };
    let bar = progress_bar(global, ids.len() as u64, "partitions");
    let (mut before, mut after, mut dropped) = (0u64, 0u64, 0u64);
    let mut failed = Vec::new();
    for id in ids {
        bar.set_message(format!("compacting partition {id}"));
        match compact_one(client, id).await {
            Ok(response) => {
                let size = |info: Option<cairn_client::v1::PartitionStoreInfo>| {
                    info.map(|i| i.live_sst_bytes).unwrap_or_default()
                };
                let (b, a) = (size(response.before), size(response.after));
                before += b;
                after += a;
                dropped += response.expired_dropped;
                if global.verbose > 0 {
                    bar.suspend(|| {
                        println!(
                            "partition {id}: {} -> {}, {} expired values dropped",
                            show_bytes_count(b),
                            show_bytes_count(a),
                            response.expired_dropped
                        )
                    });
                }
            }
            // One partition that cannot be compacted (not running here, being restored) does not
            // stop the others.
            Err(err) => {
                bar.suspend(|| eprintln!("partition {id}: {err}"));
                failed.push(id);
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!(
        "Compacted: {} -> {} in SST files; {dropped} expired values dropped",
        show_bytes_count(before),
        show_bytes_count(after)
    );
    if failed.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "Not compacted: partitions {} (the errors above say why)",
            failed
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(ExitCode::FAILURE)
    }
}

/// Compacts partition `id` and waits for the end, however long the compaction takes.
async fn compact_one(
    client: &Client,
    id: u32,
) -> anyhow::Result<cairn_client::v1::CompactPartitionProgress> {
    let mut stream = client.compact_partition(id).await?;
    loop {
        match stream.message().await {
            Ok(Some(progress)) if progress.done => return Ok(progress),
            Ok(Some(_started)) => {}
            Ok(None) => bail!(
                "the node ended the compaction of partition {id} without saying whether it completed; its log says"
            ),
            Err(status) => return Err(client.stream_error(status).into()),
        }
    }
}

async fn partitions_restore(
    client: &Client,
    global: &GlobalOptions,
    partition_id: u32,
    snapshot: Option<String>,
) -> anyhow::Result<ExitCode> {
    if !global.yes {
        let which = snapshot
            .as_deref()
            .map_or("its newest suitable snapshot".to_string(), |s| {
                format!("snapshot {s}")
            });
        confirm(&format!(
            "Replace partition {partition_id}'s store with {which} and replay its log? The partition serves nothing until it is done."
        ))?;
    }
    let mut stream = client.restore_partition(partition_id, snapshot).await?;
    let bar = progress_bar(global, 0, "bytes");
    let mut snapshot_shown = String::new();
    loop {
        let progress = match stream.message().await {
            Ok(Some(progress)) => progress,
            Ok(None) => {
                bar.abandon();
                bail!(
                    "the node ended the restore of partition {partition_id} without saying whether it succeeded; `cairnctl partitions list` shows its state"
                );
            }
            Err(status) => {
                bar.abandon();
                return Err(client.stream_error(status).into());
            }
        };
        match progress.phase.as_str() {
            "download" => {
                if snapshot_shown != progress.snapshot_id {
                    snapshot_shown = progress.snapshot_id.clone();
                    bar.set_message(format!("downloading {}", progress.snapshot_id));
                }
                bar.set_length(progress.bytes_total);
                bar.set_position(progress.bytes_done);
            }
            "import" => bar.set_message(format!("importing {}", progress.snapshot_id)),
            "replay" => bar.set_message(progress.message.clone()),
            "skipped" => bar.suspend(|| {
                eprintln!(
                    "Skipped snapshot {}: {}",
                    progress.snapshot_id, progress.message
                )
            }),
            _ => {}
        }
        if progress.done {
            bar.finish_and_clear();
            println!(
                "Partition {partition_id} restored from snapshot {} (LSN {}, {}); log replayed up to LSN {}",
                progress.snapshot_id,
                progress.snapshot_lsn,
                show_bytes_count(progress.bytes_total),
                progress.applied_lsn
            );
            return Ok(ExitCode::SUCCESS);
        }
    }
}

/// Asks on the terminal; without one, refuses and says how to proceed.
pub(crate) fn confirm(question: &str) -> anyhow::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_client::v1::{PartitionStoreInfo, WriteStall};

    #[test]
    fn a_store_behind_on_compactions_says_so_and_what_a_merge_needs() {
        let mut store = PartitionStoreInfo {
            live_sst_bytes: 3 << 30,
            ..Default::default()
        };
        assert!(compaction_lines(&store)[0].contains("not reported"));
        store.set_write_stall(WriteStall::None);
        assert_eq!(compaction_lines(&store), ["compactions      keeping up"]);

        store.set_write_stall(WriteStall::Stopped);
        store.background_errors = 114;
        let lines = compaction_lines(&store);
        assert!(
            lines[0].contains("stops this partition's writes"),
            "{lines:?}"
        );
        assert!(lines[1].contains("114 failed or refused"), "{lines:?}");
        assert!(
            lines[1].contains(
                "if for want of disk, a merge of the oldest tables needs about 3.0 GiB free"
            ),
            "{lines:?}"
        );
    }
}
