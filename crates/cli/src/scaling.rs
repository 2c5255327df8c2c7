//! `cluster plan` (the preview of a scaling), `cluster scale` and `cluster operations`.

use crate::args::{GlobalOptions, OperationsCommand, OutputFormat};
use crate::output::{show_bytes_count, table};
use cairn_client::Client;
use cairn_client::v1;
use std::process::ExitCode;

pub async fn cluster_plan(
    client: &Client,
    global: &GlobalOptions,
    nodes: Vec<String>,
    output: OutputFormat,
    upload: bool,
) -> anyhow::Result<ExitCode> {
    let plan = client.plan_placement(nodes.clone()).await?;
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&plan_json(&plan))?),
        OutputFormat::Table => print_plan(global, &nodes, &plan),
    }
    if upload {
        upload_copied(client, global, &plan, output == OutputFormat::Json).await?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Fresh snapshots of every partition a plan copies, each on its leader; one that already
/// covers what the partition applied is kept.
async fn upload_copied(
    client: &Client,
    global: &GlobalOptions,
    plan: &v1::PlanPlacementResponse,
    to_stderr: bool,
) -> anyhow::Result<()> {
    let mut copied: Vec<u32> = plan
        .moves
        .iter()
        .filter(|m| m.copies)
        .map(|m| m.partition_id)
        .collect();
    copied.dedup();
    if copied.is_empty() {
        return Ok(());
    }
    // Scripts reading the JSON on stdout get only the JSON there.
    let line = format!(
        "uploading fresh snapshots of the {} partitions to be copied",
        copied.len()
    );
    match to_stderr {
        true => eprintln!("{line}"),
        false => println!("{line}"),
    }
    let requests = copied
        .into_iter()
        .map(|partition_id| v1::CreateSnapshotRequest {
            partition_id,
            ..Default::default()
        })
        .collect();
    crate::commands::create_snapshots(client, global, requests, to_stderr).await
}

/// What `cluster scale` was asked beside the nodes.
pub struct ScaleOptions {
    pub max_concurrent_moves: u32,
    pub detach: bool,
    pub upload: bool,
}

/// How often `cluster scale` reads the operation's progress.
const SCALE_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// `cluster scale`: the plan, a confirmation, fresh snapshots of what is copied, then the
/// operation, followed to its end unless `--detach`.
pub async fn cluster_scale(
    client: &Client,
    global: &GlobalOptions,
    nodes: Vec<String>,
    options: ScaleOptions,
) -> anyhow::Result<ExitCode> {
    let plan = client.plan_placement(nodes.clone()).await?;
    print_plan(global, &nodes, &plan);
    if plan.moves.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    let not_alive: Vec<&str> = plan
        .nodes
        .iter()
        .filter(|n| nodes.contains(&n.name) && !n.state.is_empty())
        .map(|n| n.name.as_str())
        .collect();
    if !not_alive.is_empty() {
        anyhow::bail!(
            "{} not alive: every node named must be alive before partitions move to it",
            not_alive.join(", ")
        );
    }
    if !global.yes {
        crate::commands::confirm(&format!(
            "Move {} partition roles to place every partition on {}?",
            plan.moves.len(),
            nodes.join(", ")
        ))?;
    }
    if options.upload {
        upload_copied(client, global, &plan, false).await?;
    }
    let op = client
        .start_scale(v1::StartScaleRequest {
            nodes: nodes.clone(),
            max_concurrent_moves: options.max_concurrent_moves,
            // The uploads do not change the placement; anything else that did is refused.
            partition_table_version: plan.partition_table_version,
        })
        .await?;
    if op.id == 0 {
        println!("nothing moves: the placement is already balanced on these nodes");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "operation {} started: {} partitions move, {} at a time",
        op.id,
        op.moves.len(),
        op.max_concurrent_moves
    );
    if options.detach {
        println!(
            "follow it with `cairnctl cluster operations describe {}`",
            op.id
        );
        return Ok(ExitCode::SUCCESS);
    }
    let op = follow(client, global, op.id, op.moves.len() as u64).await?;
    print_operation(global, &op);
    Ok(operation_exit(&op))
}

/// Shows the operation's progress until it finishes; returns it as it finished.
async fn follow(
    client: &Client,
    global: &GlobalOptions,
    id: u64,
    moves: u64,
) -> anyhow::Result<v1::OperationInfo> {
    let bar = crate::commands::progress_bar(global, moves, "partitions");
    let mut failures = 0;
    loop {
        let listed = match client.list_operations().await {
            Ok(listed) => {
                failures = 0;
                listed
            }
            // A node restarting, a controller changing hands: the operation goes on.
            Err(err) if failures < 60 => {
                failures += 1;
                bar.set_message(format!("(no answer: {err}; asking again)"));
                tokio::time::sleep(SCALE_PROGRESS_EVERY).await;
                continue;
            }
            Err(err) => {
                bar.finish_and_clear();
                return Err(anyhow::Error::new(err).context(format!(
                    "operation {id} goes on in the cluster; `cairnctl cluster operations describe {id}` follows it"
                )));
            }
        };
        let Some(op) = listed.into_iter().find(|op| op.id == id) else {
            bar.finish_and_clear();
            anyhow::bail!("operation {id} is no longer recorded");
        };
        let finished = op.moves.iter().filter(|m| move_finished(&m.step)).count();
        bar.set_position(finished as u64);
        bar.set_message(moving_message(&op));
        if matches!(op.state.as_str(), "succeeded" | "failed" | "cancelled") {
            bar.finish_and_clear();
            return Ok(op);
        }
        tokio::time::sleep(SCALE_PROGRESS_EVERY).await;
    }
}

fn move_finished(step: &str) -> bool {
    matches!(step, "done" | "reverted" | "cancelled")
}

/// The moves under way, for the progress bar.
fn moving_message(op: &v1::OperationInfo) -> String {
    let moving: Vec<String> = op
        .moves
        .iter()
        .filter(|m| !move_finished(&m.step) && m.step != "waiting")
        .map(|m| format!("{}: {}", m.partition_id, m.step))
        .collect();
    format!("{} {}", op.state, moving.join(", "))
}

/// 0 when every move was done, 1 otherwise.
fn operation_exit(op: &v1::OperationInfo) -> ExitCode {
    match op.state.as_str() {
        "succeeded" => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

fn holders(leader: &str, followers: &[String]) -> String {
    let mut shown = or_dash(leader);
    if !followers.is_empty() {
        shown.push_str(&format!(" + {}", followers.join(",")));
    }
    shown
}

fn print_operation(global: &GlobalOptions, op: &v1::OperationInfo) {
    println!(
        "operation {}: {} ({}), placing the partitions on {}, {} at a time",
        op.id,
        op.state,
        op.requested_by,
        op.nodes.join(", "),
        op.max_concurrent_moves
    );
    println!(
        "started {}{}",
        crate::commands::show_time_ms(op.created_at_ms, global.time_format),
        if op.finished_at_ms == 0 {
            String::new()
        } else {
            format!(
                ", finished {}",
                crate::commands::show_time_ms(op.finished_at_ms, global.time_format)
            )
        }
    );
    let mut t = table(
        global.table_style,
        &[
            "PARTITION",
            "FROM (LEADER + FOLLOWERS)",
            "TO",
            "STEP",
            "SINCE",
            "REASON",
        ],
    );
    for m in &op.moves {
        t.add_row(vec![
            m.partition_id.to_string(),
            holders(&m.from_leader, &m.from_followers),
            holders(&m.to_leader, &m.to_followers),
            m.step.clone(),
            crate::commands::show_time_ms(m.step_since_ms, global.time_format),
            or_dash(&m.reason),
        ]);
    }
    println!("{t}");
    let count = |step: &str| op.moves.iter().filter(|m| m.step == step).count();
    println!(
        "{} moves: {} done, {} reverted, {} cancelled, {} under way or waiting",
        op.moves.len(),
        count("done"),
        count("reverted"),
        count("cancelled"),
        op.moves.iter().filter(|m| !move_finished(&m.step)).count()
    );
}

fn operation_json(op: &v1::OperationInfo) -> serde_json::Value {
    let name = |n: &str| (!n.is_empty()).then(|| n.to_string());
    serde_json::json!({
        "id": op.id,
        "state": op.state,
        "requested_by": op.requested_by,
        "nodes": op.nodes,
        "max_concurrent_moves": op.max_concurrent_moves,
        "created_at_ms": op.created_at_ms,
        "finished_at_ms": (op.finished_at_ms != 0).then_some(op.finished_at_ms),
        "moves": op.moves.iter().map(|m| serde_json::json!({
            "partition_id": m.partition_id,
            "from_leader": name(&m.from_leader),
            "from_followers": m.from_followers,
            "to_leader": m.to_leader,
            "to_followers": m.to_followers,
            "step": m.step,
            "step_since_ms": m.step_since_ms,
            "reason": name(&m.reason),
        })).collect::<Vec<_>>(),
    })
}

/// `cluster operations list|describe|cancel`.
pub async fn operations(
    client: &Client,
    global: &GlobalOptions,
    command: OperationsCommand,
) -> anyhow::Result<ExitCode> {
    match command {
        OperationsCommand::List { output } => {
            let ops = client.list_operations().await?;
            match output {
                OutputFormat::Json => {
                    let all: Vec<_> = ops.iter().map(operation_json).collect();
                    println!("{}", serde_json::to_string_pretty(&all)?);
                }
                OutputFormat::Table => {
                    if ops.is_empty() {
                        println!("no scaling operations recorded");
                        return Ok(ExitCode::SUCCESS);
                    }
                    let mut t = table(
                        global.table_style,
                        &[
                            "ID", "STATE", "BY", "NODES", "MOVES", "DONE", "REVERTED", "STARTED",
                        ],
                    );
                    for op in &ops {
                        let count = |step: &str| op.moves.iter().filter(|m| m.step == step).count();
                        t.add_row(vec![
                            op.id.to_string(),
                            op.state.clone(),
                            op.requested_by.clone(),
                            op.nodes.join(","),
                            op.moves.len().to_string(),
                            count("done").to_string(),
                            (count("reverted") + count("cancelled")).to_string(),
                            crate::commands::show_time_ms(op.created_at_ms, global.time_format),
                        ]);
                    }
                    println!("{t}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        OperationsCommand::Describe { id, output } => {
            let ops = client.list_operations().await?;
            let Some(op) = ops.into_iter().find(|op| op.id == id) else {
                anyhow::bail!("no operation {id}; `cairnctl cluster operations list` shows them");
            };
            match output {
                OutputFormat::Json => {
                    println!("{}", serde_json::to_string_pretty(&operation_json(&op))?)
                }
                OutputFormat::Table => print_operation(global, &op),
            }
            Ok(ExitCode::SUCCESS)
        }
        OperationsCommand::Cancel { id } => {
            if !global.yes {
                crate::commands::confirm(&format!(
                    "Cancel operation {id}? Moves not cut over yet are reverted."
                ))?;
            }
            let op = client.cancel_operation(id).await?;
            println!(
                "operation {} is {}: moves not cut over yet are being reverted",
                op.id, op.state
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `partitions load`: places the partitions on `node` as a follower and follows the load.
pub async fn partitions_load(
    client: &Client,
    global: &GlobalOptions,
    partitions: Vec<u32>,
    node: String,
) -> anyhow::Result<ExitCode> {
    let mut stream = client
        .load_partitions(partitions.clone(), node.clone())
        .await?;
    let bar = crate::commands::progress_bar(global, partitions.len() as u64, "partitions");
    let mut last = None;
    loop {
        let progress = match stream.message().await {
            Ok(Some(progress)) => progress,
            Ok(None) => break,
            Err(status) => {
                bar.finish_and_clear();
                return Err(client.stream_error(status).into());
            }
        };
        let caught_up = progress.partitions.iter().filter(|p| p.caught_up).count();
        bar.set_position(caught_up as u64);
        bar.set_message(load_message(&progress.partitions));
        let done = progress.done;
        last = Some(progress);
        if done {
            break;
        }
    }
    bar.finish_and_clear();
    let Some(last) = last.filter(|p| p.done) else {
        anyhow::bail!(
            "the node stopped reporting before every partition caught up; {node} goes on loading them: `cairnctl partitions list` shows its followers"
        );
    };
    let mut t = table(
        global.table_style,
        &["PARTITION", "NODE", "STATE", "APPLIED LSN"],
    );
    for p in &last.partitions {
        t.add_row(vec![
            p.partition_id.to_string(),
            node.clone(),
            p.state.clone(),
            p.applied_lsn.to_string(),
        ]);
    }
    println!("{t}");
    println!(
        "{node} follows {} partition{}, caught up with their logs",
        last.partitions.len(),
        if last.partitions.len() == 1 { "" } else { "s" }
    );
    Ok(ExitCode::SUCCESS)
}

/// The partitions still on their way, for the progress bar.
fn load_message(partitions: &[v1::LoadProgress]) -> String {
    partitions
        .iter()
        .filter(|p| !p.caught_up)
        .map(|p| match p.state.as_str() {
            "down" => format!("{}: down ({})", p.partition_id, p.reason),
            "follower" | "leader" => {
                format!("{}: {}/{}", p.partition_id, p.applied_lsn, p.target_lsn)
            }
            state => format!("{}: {state}", p.partition_id),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the copies of a plan add up to.
#[derive(Debug, Default, PartialEq, Eq)]
struct Totals {
    copies: usize,
    snapshot_bytes: u64,
    log_records: u64,
    /// Copies whose size could not be read.
    unknown: usize,
}

fn totals(plan: &v1::PlanPlacementResponse) -> Totals {
    let mut totals = Totals::default();
    for m in plan.moves.iter().filter(|m| m.copies) {
        totals.copies += 1;
        if m.size_unknown.is_empty() {
            totals.snapshot_bytes += m.snapshot_bytes;
            totals.log_records += m.log_records;
        } else {
            totals.unknown += 1;
        }
    }
    totals
}

/// What a move costs, for the table.
fn copy_cell(m: &v1::PlannedMove) -> String {
    if !m.copies {
        return match m.to.is_empty() {
            true => "-".into(),
            false => "none (holds it)".into(),
        };
    }
    if !m.size_unknown.is_empty() {
        return format!("unknown: {}", m.size_unknown);
    }
    if m.snapshot_id.is_empty() {
        return format!("no snapshot: {} log records", m.log_records);
    }
    format!(
        "{} + {} log records",
        show_bytes_count(m.snapshot_bytes),
        m.log_records
    )
}

fn or_dash(name: &str) -> String {
    if name.is_empty() {
        "-".into()
    } else {
        name.to_string()
    }
}

fn print_plan(global: &GlobalOptions, named: &[String], plan: &v1::PlanPlacementResponse) {
    println!(
        "{} partitions on {} ({} follower{} each), from placement version {}",
        plan.num_partitions,
        named.join(", "),
        plan.standbys,
        if plan.standbys == 1 { "" } else { "s" },
        plan.partition_table_version
    );
    if plan.moves.is_empty() {
        println!("nothing moves: the placement is already balanced on these nodes");
    } else {
        let mut t = table(
            global.table_style,
            &["PARTITION", "KEY RANGE", "ROLE", "FROM", "TO", "COPY"],
        );
        for m in &plan.moves {
            t.add_row(vec![
                m.partition_id.to_string(),
                format!("{}..={}", m.key_range_start, m.key_range_end),
                m.role.clone(),
                or_dash(&m.from),
                or_dash(&m.to),
                copy_cell(m),
            ]);
        }
        println!("\n{t}");
    }
    let mut t = table(global.table_style, &["NODE", "STATE", "LEADS", "FOLLOWS"]);
    for n in &plan.nodes {
        t.add_row(vec![
            n.name.clone(),
            if n.state.is_empty() {
                "alive".into()
            } else {
                n.state.clone()
            },
            format!("{} -> {}", n.leads_before, n.leads_after),
            format!("{} -> {}", n.follows_before, n.follows_after),
        ]);
    }
    println!("\n{t}\n");
    let totals = totals(plan);
    let mut summary = format!(
        "{} role{} move, {} of them copies",
        plan.moves.len(),
        if plan.moves.len() == 1 { "" } else { "s" },
        totals.copies
    );
    if totals.copies > 0 {
        summary.push_str(&format!(
            " ({} of snapshots and {} log records",
            show_bytes_count(totals.snapshot_bytes),
            totals.log_records
        ));
        if totals.unknown > 0 {
            summary.push_str(&format!(", and {} of unknown size", totals.unknown));
        }
        summary.push(')');
    }
    println!(
        "{summary}; {} of {} partitions stay put",
        plan.unmoved, plan.num_partitions
    );
    for n in &plan.nodes {
        let named = named.contains(&n.name);
        match n.state.as_str() {
            "" => {}
            "not joined" if named => println!(
                "note: {} has not joined the cluster; start it with this cluster's [nats] settings before it can take its roles",
                n.name
            ),
            state if named => println!(
                "note: {} is {state}; it cannot take its roles until it is alive",
                n.name
            ),
            _ => {}
        }
    }
}

/// The plan as one JSON document: names as strings (`null` for none), sizes in bytes.
fn plan_json(plan: &v1::PlanPlacementResponse) -> serde_json::Value {
    let name = |n: &str| (!n.is_empty()).then(|| n.to_string());
    let totals = totals(plan);
    serde_json::json!({
        "num_partitions": plan.num_partitions,
        "standbys": plan.standbys,
        "partition_table_version": plan.partition_table_version,
        "moves": plan.moves.iter().map(|m| serde_json::json!({
            "partition_id": m.partition_id,
            "key_range": { "start": m.key_range_start, "end": m.key_range_end },
            "role": m.role,
            "from": name(&m.from),
            "to": name(&m.to),
            "copies": m.copies,
            "snapshot_id": name(&m.snapshot_id),
            "snapshot_bytes": m.snapshot_bytes,
            "log_records": m.log_records,
            "size_unknown": name(&m.size_unknown),
        })).collect::<Vec<_>>(),
        "nodes": plan.nodes.iter().map(|n| serde_json::json!({
            "name": n.name,
            "state": if n.state.is_empty() { "alive" } else { n.state.as_str() },
            "leads_before": n.leads_before,
            "follows_before": n.follows_before,
            "leads_after": n.leads_after,
            "follows_after": n.follows_after,
        })).collect::<Vec<_>>(),
        "unmoved": plan.unmoved,
        "totals": {
            "moves": plan.moves.len(),
            "copies": totals.copies,
            "snapshot_bytes": totals.snapshot_bytes,
            "log_records": totals.log_records,
            "copies_of_unknown_size": totals.unknown,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(partition: u32, bytes: u64, records: u64) -> v1::PlannedMove {
        v1::PlannedMove {
            partition_id: partition,
            role: "leader".into(),
            from: "n1".into(),
            to: "n4".into(),
            copies: true,
            snapshot_id: format!("snap-{partition}"),
            snapshot_bytes: bytes,
            log_records: records,
            ..Default::default()
        }
    }

    #[test]
    fn totals_count_only_copies_of_known_size() {
        let promotion = v1::PlannedMove {
            copies: false,
            ..copy(2, 0, 0)
        };
        let unknown = v1::PlannedMove {
            size_unknown: "the repository cannot be listed".into(),
            ..copy(3, 0, 0)
        };
        let plan = v1::PlanPlacementResponse {
            moves: vec![copy(0, 1024, 5), copy(1, 2048, 7), promotion, unknown],
            ..Default::default()
        };
        assert_eq!(
            totals(&plan),
            Totals {
                copies: 3,
                snapshot_bytes: 3072,
                log_records: 12,
                unknown: 1
            }
        );
        assert_eq!(copy_cell(&plan.moves[0]), "1.0 KiB + 5 log records");
        assert_eq!(copy_cell(&plan.moves[2]), "none (holds it)");
        assert!(copy_cell(&plan.moves[3]).starts_with("unknown: "));
    }

    #[test]
    fn the_json_names_nobody_as_null_and_sizes_in_bytes() {
        let added = v1::PlannedMove {
            role: "follower".into(),
            from: String::new(),
            snapshot_id: String::new(),
            ..copy(1, 0, 9)
        };
        let plan = v1::PlanPlacementResponse {
            num_partitions: 2,
            moves: vec![copy(0, 4096, 1), added],
            unmoved: 0,
            ..Default::default()
        };
        let json = plan_json(&plan);
        assert_eq!(json["moves"][0]["snapshot_bytes"], 4096);
        assert!(json["moves"][1]["from"].is_null());
        assert!(json["moves"][1]["snapshot_id"].is_null());
        assert_eq!(json["totals"]["log_records"], 10);
        assert_eq!(json["totals"]["copies"], 2);
    }
}
