//! `cluster plan`: the preview of a scaling.

use crate::args::{GlobalOptions, OutputFormat};
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
        // Fresh snapshots of exactly what will be copied, each on its leader; one that already
        // covers what the partition applied is kept.
        let mut copied: Vec<u32> = plan
            .moves
            .iter()
            .filter(|m| m.copies)
            .map(|m| m.partition_id)
            .collect();
        copied.dedup();
        if !copied.is_empty() {
            // Scripts reading the JSON on stdout get only the JSON there.
            let say = |line: String| match output {
                OutputFormat::Json => eprintln!("{line}"),
                OutputFormat::Table => println!("{line}"),
            };
            say(format!(
                "uploading fresh snapshots of the {} partitions to be copied",
                copied.len()
            ));
            let requests = copied
                .into_iter()
                .map(|partition_id| v1::CreateSnapshotRequest {
                    partition_id,
                    ..Default::default()
                })
                .collect();
            let to_stderr = output == OutputFormat::Json;
            crate::commands::create_snapshots(client, global, requests, to_stderr).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
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
