//! Scaling operations on a real cluster (three clustered `nats-server`s, moto, `cairn` nodes)
//! with clients over gRPC (routing and forwarding) and the Redis port running throughout: a
//! node joins and the partitions are moved onto it, then off it again, or a node dies in the
//! middle; the checker must find the whole history linearizable, no key admitted twice in a TTL
//! window, and no acknowledged write lost, and the operation must end as it says it did.

use cairn_client::{Client, v1};
use cairn_jepsen::{
    ClusterOptions, Run, TestCluster, WorkloadOptions, snapshot, snapshot_file_keys,
};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// A scenario's folder, kept after the test when `KEEP_CAIRN_TEST_DIRS` is set.
fn scenario_dir() -> tempfile::TempDir {
    let keep = std::env::var_os("KEEP_CAIRN_TEST_DIRS").is_some();
    let dir = tempfile::Builder::new()
        .prefix("cairn-scaling-")
        .disable_cleanup(keep)
        .tempdir()
        .unwrap();
    if keep {
        eprintln!("this scenario's folder: {}", dir.path().display());
    }
    dir
}

/// Three nodes, eight partitions with a follower each, a snapshot every second (so that a
/// node that loads a partition loads a snapshot and replays the log past it).
async fn three_nodes(name: &str, dir: &tempfile::TempDir) -> TestCluster {
    three_nodes_with(name, dir, Vec::new()).await
}

async fn three_nodes_with(
    name: &str,
    dir: &tempfile::TempDir,
    env: Vec<(usize, String, String)>,
) -> TestCluster {
    three_nodes_configured(name, dir, env, "snapshot-interval = \"1s\"\n").await
}

/// Three nodes as [`three_nodes`] has them, with `snapshots` as their `[worker.snapshots]`
/// settings.
async fn three_nodes_configured(
    name: &str,
    dir: &tempfile::TempDir,
    env: Vec<(usize, String, String)>,
    snapshots: &str,
) -> TestCluster {
    TestCluster::start(ClusterOptions {
        cairn_bin: env!("CARGO_BIN_EXE_cairn").into(),
        dir: dir.path().join(name),
        nodes: 3,
        partitions: 8,
        standbys: 1,
        node_timeout: Duration::from_secs(3),
        extra_config: snapshots.into(),
        env,
    })
    .await
    .unwrap_or_else(|err| panic!("{name}: start the cluster: {err:#}"))
}

fn workload(seed: u64) -> WorkloadOptions {
    WorkloadOptions {
        seed,
        ..WorkloadOptions::default()
    }
}

/// Finishes `run` and asserts what the checker says.
async fn check(name: &str, run: Run, cluster: &mut TestCluster) {
    let outcome = match run.finish(cluster).await {
        Ok(outcome) => outcome,
        Err(err) => panic!("{name}: {err:#}\n{}", cluster.log_tails(30)),
    };
    eprintln!("{name}: {}; {}", outcome.counts, outcome.report);
    assert!(
        outcome.report.is_ok(),
        "{name}: the history is not what a linearizable store gives:\n{}",
        outcome.report
    );
    assert!(
        outcome.report.operations > 200,
        "{name}: too few operations to mean anything: {}",
        outcome.report
    );
}

fn names(range: std::ops::RangeInclusive<usize>) -> Vec<String> {
    range.map(|i| format!("n{i}")).collect()
}

/// Adds a fourth node and waits until the cluster lists it alive.
async fn add_fourth(cluster: &mut TestCluster, client: &Client) {
    cluster.add_node().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let nodes = client.list_nodes().await.unwrap_or_default();
        if nodes.iter().any(|n| n.name == "n4" && n.state == "alive") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "n4 not alive after 60 s: {nodes:?}\n{}",
            cluster.log_tail(3, 30)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Starts an operation placing every partition on `nodes` from the plan the cluster gives now;
/// returns it and the partitions the plan moves.
async fn scale(client: &Client, nodes: &[String]) -> (v1::OperationInfo, BTreeSet<u32>) {
    let plan = client.plan_placement(nodes.to_vec()).await.unwrap();
    let planned: BTreeSet<u32> = plan.moves.iter().map(|m| m.partition_id).collect();
    assert!(!planned.is_empty(), "nothing to move: {plan:?}");
    (start_planned(client, nodes, &plan).await, planned)
}

/// Starts the operation `plan` (for `nodes`) shows, two moves at a time.
async fn start_planned(
    client: &Client,
    nodes: &[String],
    plan: &v1::PlanPlacementResponse,
) -> v1::OperationInfo {
    let op = client
        .start_scale(v1::StartScaleRequest {
            nodes: nodes.to_vec(),
            max_concurrent_moves: 2,
            partition_table_version: plan.partition_table_version,
        })
        .await
        .unwrap();
    assert_ne!(op.id, 0, "{op:?}");
    op
}

/// Waits until operation `id` has finished; returns it as it finished.
async fn finished(cluster: &TestCluster, id: u64, within: Duration) -> v1::OperationInfo {
    let deadline = Instant::now() + within;
    let mut last = None;
    loop {
        // Any node answers; one that is down or restarting is skipped.
        if let Ok(client) = cluster.client().await
            && let Ok(ops) = client.list_operations().await
            && let Some(op) = ops.into_iter().find(|op| op.id == id)
        {
            if matches!(op.state.as_str(), "succeeded" | "failed" | "cancelled") {
                return op;
            }
            last = Some(op);
        }
        assert!(
            Instant::now() < deadline,
            "operation {id} not finished after {} s: {last:#?}\n{}",
            within.as_secs(),
            cluster.log_tails(20)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits until some move of operation `id` is in `step` and has `node` among its new holders;
/// returns the partition.
async fn a_move_in(cluster: &TestCluster, id: u64, step: &str, node: &str) -> u32 {
    a_move_where(cluster, id, |m| {
        m.step == step && (m.to_leader == node || m.to_followers.iter().any(|f| f == node))
    })
    .await
    .partition_id
}

/// Waits until some move of operation `id` is as `wanted`; returns it.
async fn a_move_where(
    cluster: &TestCluster,
    id: u64,
    wanted: impl Fn(&v1::MoveInfo) -> bool,
) -> v1::MoveInfo {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = None;
    loop {
        if let Ok(client) = cluster.client().await
            && let Ok(ops) = client.list_operations().await
            && let Some(op) = ops.into_iter().find(|op| op.id == id)
        {
            if let Some(m) = op.moves.iter().find(|m| wanted(m)) {
                return m.clone();
            }
            last = Some(op);
        }
        assert!(
            Instant::now() < deadline,
            "no move of operation {id} as wanted after 90 s: {last:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Asserts that the placement is balanced on `nodes` (the plan for them moves nothing) and that
/// every other node that is listed holds nothing.
async fn balanced_on(client: &Client, nodes: &[String]) {
    let plan = client.plan_placement(nodes.to_vec()).await.unwrap();
    assert!(
        plan.moves.is_empty(),
        "not balanced on {nodes:?}: {:#?}",
        plan.moves
    );
    for n in &plan.nodes {
        if !nodes.contains(&n.name) {
            assert_eq!(
                (n.leads_before, n.follows_before),
                (0, 0),
                "{} still holds partitions",
                n.name
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_to_four_nodes_and_back_to_three_under_load() {
    let dir = scenario_dir();
    // Stores of partitions moved away are deleted two seconds after.
    let grace: Vec<(usize, String, String)> = (0..4)
        .map(|i| (i, "CAIRN_CLUSTER__DROP_MOVED_AFTER".into(), "2s".into()))
        .collect();
    let mut cluster = three_nodes_with("out-and-in", &dir, grace).await;
    let run = Run::start(&cluster, workload(21));
    let client = cluster.client().await.unwrap();
    add_fourth(&mut cluster, &client).await;

    let four = names(1..=4);
    let (op, planned) = scale(&client, &four).await;
    // One at a time: a second is refused, naming the first.
    let err = client
        .start_scale(v1::StartScaleRequest {
            nodes: names(1..=3),
            ..Default::default()
        })
        .await
        .expect_err("a second operation while one runs");
    assert!(
        err.to_string()
            .contains(&format!("operation {} (cairnctl", op.id)),
        "{err}"
    );
    let done = finished(&cluster, op.id, Duration::from_secs(180)).await;
    assert_eq!(done.state, "succeeded", "{done:#?}");
    let moved: BTreeSet<u32> = done.moves.iter().map(|m| m.partition_id).collect();
    assert_eq!(moved, planned, "the partitions moved are the ones planned");
    balanced_on(&client, &four).await;
    let listed = client.list_nodes().await.unwrap();
    let n4 = listed.iter().find(|n| n.name == "n4").unwrap();
    assert_eq!((n4.leads, n4.follows), (2, 2), "{n4:?}");
    assert_eq!(
        store_folders(&cluster.nodes[3].base_dir).len(),
        4,
        "n4 keeps a store for each partition it holds"
    );

    let three = names(1..=3);
    let (op, planned) = scale(&client, &three).await;
    let done = finished(&cluster, op.id, Duration::from_secs(180)).await;
    assert_eq!(done.state, "succeeded", "{done:#?}");
    let moved: BTreeSet<u32> = done.moves.iter().map(|m| m.partition_id).collect();
    assert_eq!(moved, planned);
    balanced_on(&client, &three).await;
    // n4 holds nothing any more, and deletes what it held.
    let n4 = cluster.nodes[3].base_dir.clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !store_folders(&n4).is_empty() {
        assert!(
            Instant::now() < deadline,
            "n4 still has partition stores 30 s after it was drained: {:?}\n{}",
            store_folders(&n4),
            cluster.log_tail(3, 30)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    check("3 → 4 → 3 nodes", run, &mut cluster).await;
}

/// The partition stores' folders (`partition-<id>.<generation>`) anywhere under `dir`.
fn store_folders(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with("partition-")
            {
                found.push(path);
            } else {
                pending.push(path);
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_target_killed_while_it_loads_has_its_moves_reverted() {
    let dir = scenario_dir();
    let mut cluster = three_nodes("target-killed", &dir).await;
    let run = Run::start(&cluster, workload(22));
    let client = cluster.client().await.unwrap();
    add_fourth(&mut cluster, &client).await;
    let (op, _) = scale(&client, &names(1..=4)).await;
    a_move_in(&cluster, op.id, "loading", "n4").await;
    cluster.kill_node(3);
    let done = finished(&cluster, op.id, Duration::from_secs(120)).await;
    assert_eq!(done.state, "failed", "{done:#?}");
    for m in &done.moves {
        let to_n4 = m.to_leader == "n4" || m.to_followers.iter().any(|f| f == "n4");
        if to_n4 && m.step != "done" {
            assert_eq!(m.step, "reverted", "{m:?}");
            assert!(m.reason.contains("n4"), "{m:?}");
        }
    }
    // The partitions are where they were, on the three nodes left.
    let listed = client.list_nodes().await.unwrap();
    let n4 = listed.iter().find(|n| n.name == "n4").unwrap();
    assert_eq!((n4.leads, n4.follows), (0, 0), "{n4:?}");
    check("target killed while it loads", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_controllers_node_killed_in_the_middle_of_an_operation() {
    let dir = scenario_dir();
    let mut cluster = three_nodes("controller-killed", &dir).await;
    let run = Run::start(&cluster, workload(23));
    let client = cluster.client().await.unwrap();
    add_fourth(&mut cluster, &client).await;
    let (op, _) = scale(&client, &names(1..=4)).await;
    a_move_in(&cluster, op.id, "done", "n4").await;
    let controller = cluster.controller().await.unwrap();
    cluster.kill_node(controller);
    // Another node's controller takes the operation over and finishes it: moves that needed
    // the killed node are reverted, the rest done.
    let done = finished(&cluster, op.id, Duration::from_secs(180)).await;
    each_move_ended(&done);
    cluster.start_node(controller).unwrap();
    // Once the node is back, the same scale completes what was reverted.
    finish_scaling_onto(&cluster, &names(1..=4)).await;
    check("controller killed mid-operation", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_new_leader_killed_just_after_its_cutover() {
    let dir = scenario_dir();
    let mut cluster = three_nodes("after-cutover", &dir).await;
    let run = Run::start(&cluster, workload(24));
    let client = cluster.client().await.unwrap();
    add_fourth(&mut cluster, &client).await;
    let (op, _) = scale(&client, &names(1..=4)).await;
    a_move_where(&cluster, op.id, |m| {
        m.to_leader == "n4" && (m.step == "dropping" || m.step == "done")
    })
    .await;
    cluster.kill_node(3);
    // What n4 took over fails over to its followers; the moves still to come revert.
    let done = finished(&cluster, op.id, Duration::from_secs(120)).await;
    assert_eq!(done.state, "failed", "{done:#?}");
    let listed = client.list_nodes().await.unwrap();
    let n4 = listed.iter().find(|n| n.name == "n4").unwrap();
    assert_eq!(n4.leads, 0, "{n4:?}");
    check("new leader killed after its cutover", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_leader_killed_in_the_middle_of_its_move() {
    let dir = scenario_dir();
    let mut cluster = three_nodes("source-killed", &dir).await;
    let run = Run::start(&cluster, workload(25));
    let client = cluster.client().await.unwrap();
    add_fourth(&mut cluster, &client).await;
    let (op, _) = scale(&client, &names(1..=4)).await;
    let m = a_move_where(&cluster, op.id, |m| {
        m.step == "loading" && m.to_leader == "n4" && !m.from_leader.is_empty()
    })
    .await;
    let source = node_index(&m.from_leader);
    cluster.kill_node(source);
    let done = finished(&cluster, op.id, Duration::from_secs(120)).await;
    // The killed node's partitions fail over; the move goes on from its new leader, or is
    // reverted if it needed the killed node.
    let after = done
        .moves
        .iter()
        .find(|x| x.partition_id == m.partition_id)
        .unwrap();
    assert!(
        after.step == "done" || after.step == "reverted",
        "{after:?}"
    );
    cluster.start_node(source).unwrap();
    check("source leader killed mid-move", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_auto_rebalance_a_node_that_joins_gets_its_share() {
    let dir = scenario_dir();
    let auto: Vec<(usize, String, String)> = (0..4)
        .map(|i| (i, "CAIRN_CLUSTER__AUTO_REBALANCE".into(), "true".into()))
        .collect();
    let mut cluster = three_nodes_with("auto", &dir, auto).await;
    let run = Run::start(&cluster, workload(26));
    let client = cluster.client().await.unwrap();
    add_fourth(&mut cluster, &client).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let id = loop {
        let ops = client.list_operations().await.unwrap_or_default();
        if let Some(op) = ops.iter().find(|op| op.requested_by == "auto-rebalance") {
            break op.id;
        }
        assert!(Instant::now() < deadline, "no automatic operation: {ops:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let done = finished(&cluster, id, Duration::from_secs(180)).await;
    assert_eq!(done.state, "succeeded", "{done:#?}");
    balanced_on(&client, &names(1..=4)).await;
    check("auto-rebalance onto a new node", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupt_newest_snapshot_of_a_moving_partition_is_never_loaded() {
    let dir = scenario_dir();
    // No automatic snapshots: the corrupt one stays the newest.
    let mut cluster = three_nodes_configured("corrupt-snapshot", &dir, Vec::new(), "").await;
    let run = Run::start(&cluster, workload(27));
    let client = cluster.client().await.unwrap();
    add_fourth(&mut cluster, &client).await;
    let four = names(1..=4);
    let plan = client.plan_placement(four.clone()).await.unwrap();
    let onto_n4: BTreeSet<u32> = plan
        .moves
        .iter()
        .filter(|m| m.to == "n4")
        .map(|m| m.partition_id)
        .collect();
    assert!(!onto_n4.is_empty(), "nothing moves onto n4: {plan:?}");

    // Per partition that moves onto n4: an older snapshot, writes, a newer one with a byte
    // flipped in a file that only it has.
    let mut snapshots = Vec::new();
    for &p in &onto_n4 {
        let older = snapshot(&client, p).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let newer = snapshot(&client, p).await.unwrap();
        assert_ne!(
            older, newer,
            "partition {p} had no writes between its snapshots"
        );
        let older_files = snapshot_file_keys(&client, &older).await.unwrap();
        let victim = snapshot_file_keys(&client, &newer)
            .await
            .unwrap()
            .into_iter()
            .find(|k| !older_files.contains(k))
            .unwrap_or_else(|| panic!("snapshot {newer} has no file of its own"));
        cluster.flip_a_byte_in_repository(p, &victim).await.unwrap();
        snapshots.push((p, older, newer));
    }

    let op = start_planned(&client, &four, &plan).await;
    let done = finished(&cluster, op.id, Duration::from_secs(180)).await;
    // Nothing trims the log here, so n4 refuses every corrupt snapshot, loads the older one of its
    // partition and replays the log past it; every move is made.
    let log = std::fs::read_to_string(&cluster.nodes[3].log).unwrap();
    for (p, older, newer) in &snapshots {
        let m = done.moves.iter().find(|m| m.partition_id == *p).unwrap();
        assert_eq!(m.step, "done", "partition {p}: {m:?}");
        assert!(
            log.lines()
                .any(|l| l.contains("snapshot not used for restore") && l.contains(newer.as_str())),
            "n4 does not say it refused snapshot {newer} of partition {p}:\n{}",
            cluster.log_tail(3, 60)
        );
        assert!(
            !log.lines()
                .any(|l| l.contains("Restored partition from snapshot")
                    && l.contains(&format!("snapshot_id={newer}"))),
            "n4 restored the corrupt snapshot {newer}"
        );
        assert!(
            log.lines()
                .any(|l| l.contains("Restored partition from snapshot")
                    && l.contains(&format!("snapshot_id={older}"))),
            "partition {p} moved, but n4 does not say it restored snapshot {older}:\n{}",
            cluster.log_tail(3, 60)
        );
    }
    assert_eq!(done.state, "succeeded", "{done:#?}");
    balanced_on(&client, &four).await;
    check(
        "corrupt newest snapshot of a moving partition",
        run,
        &mut cluster,
    )
    .await;
}

/// Waits until every listed node is alive again.
async fn all_alive(cluster: &TestCluster) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let nodes = match cluster.client().await {
            Ok(client) => client.list_nodes().await.unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        if !nodes.is_empty() && nodes.iter().all(|n| n.state == "alive") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not every node alive again after 60 s: {nodes:?}\n{}",
            cluster.log_tails(20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Asserts that every move of a finished operation was either made or reverted.
fn each_move_ended(op: &v1::OperationInfo) {
    for m in &op.moves {
        assert!(m.step == "done" || m.step == "reverted", "{m:?}");
    }
}

/// Once every node is alive again, scales onto `nodes` whatever is still placed elsewhere (moves
/// an earlier operation reverted), which must succeed, and checks that the placement is balanced
/// on them.
async fn finish_scaling_onto(cluster: &TestCluster, nodes: &[String]) {
    all_alive(cluster).await;
    let client = cluster.client().await.unwrap();
    let plan = client.plan_placement(nodes.to_vec()).await.unwrap();
    if !plan.moves.is_empty() {
        let op = start_planned(&client, nodes, &plan).await;
        let done = finished(cluster, op.id, Duration::from_secs(180)).await;
        assert_eq!(done.state, "succeeded", "{done:#?}");
    }
    balanced_on(&client, nodes).await;
}

/// `n3` → 2, the index [`TestCluster`] knows node `n3` by.
fn node_index(name: &str) -> usize {
    let n: usize = name
        .trim_start_matches('n')
        .parse()
        .unwrap_or_else(|_| panic!("{name:?} is not a node of the test cluster"));
    n - 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_leader_paused_while_its_partition_moves_then_resumed() {
    let dir = scenario_dir();
    let mut cluster = three_nodes("source-paused", &dir).await;
    let run = Run::start(&cluster, workload(28));
    let client = cluster.client().await.unwrap();
    add_fourth(&mut cluster, &client).await;
    let (op, _) = scale(&client, &names(1..=4)).await;
    let m = a_move_where(&cluster, op.id, |m| {
        m.step == "loading" && m.to_leader == "n4" && !m.from_leader.is_empty()
    })
    .await;
    let source = node_index(&m.from_leader);
    // Past the node timeout (3 s): the others take the paused node for dead and fail its
    // partitions over while it still believes it leads them, with its clients' requests queued
    // at its old epoch; the operation goes on from the new leaders. The checker proves the
    // node acknowledges none of its queued requests wrongly once it wakes up.
    cluster.pause_node(source);
    tokio::time::sleep(Duration::from_secs(8)).await;
    cluster.resume_node(source);
    let done = finished(&cluster, op.id, Duration::from_secs(180)).await;
    each_move_ended(&done);
    // Whatever was reverted, the same scale can finish now that every node is back.
    finish_scaling_onto(&cluster, &names(1..=4)).await;
    check("source leader paused mid-move", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_target_cut_off_from_nats_while_it_loads_and_a_nats_server_killed() {
    let dir = scenario_dir();
    let mut cluster = three_nodes("target-cut", &dir).await;
    let run = Run::start(&cluster, workload(29));
    let client = cluster.client().await.unwrap();
    add_fourth(&mut cluster, &client).await;
    let (op, _) = scale(&client, &names(1..=4)).await;
    a_move_in(&cluster, op.id, "loading", "n4").await;
    // n4 loses NATS past the node timeout: it stops serving, and the moves onto it end one way
    // or the other, never with two leaders.
    cluster.cut_node(3);
    tokio::time::sleep(Duration::from_secs(8)).await;
    cluster.heal_node(3);
    let done = finished(&cluster, op.id, Duration::from_secs(180)).await;
    each_move_ended(&done);
    for m in done.moves.iter().filter(|m| m.step == "reverted") {
        assert!(
            m.reason.contains("n4"),
            "the reason does not name n4: {m:?}"
        );
    }
    // The scale again, with one of the three NATS servers killed while it runs: JetStream keeps
    // a majority, so the moves go on. Under the whole suite's load a handoff has been seen to
    // time out meanwhile (its leader did not write it within 30 s) and its move was reverted:
    // a safe end, but not the one wanted, so it is printed. Once the server is back, a scale
    // finishes whatever is left.
    all_alive(&cluster).await;
    let plan = client.plan_placement(names(1..=4)).await.unwrap();
    if !plan.moves.is_empty() {
        let again = start_planned(&client, &names(1..=4), &plan).await;
        cluster.kill_nats(0);
        let done = finished(&cluster, again.id, Duration::from_secs(180)).await;
        each_move_ended(&done);
        for m in done.moves.iter().filter(|m| m.step == "reverted") {
            eprintln!(
                "with a NATS server down, partition {} was reverted: {}",
                m.partition_id, m.reason
            );
        }
        cluster.start_nats(0).await.unwrap();
    }
    finish_scaling_onto(&cluster, &names(1..=4)).await;
    check(
        "target cut off from NATS, then a NATS server killed",
        run,
        &mut cluster,
    )
    .await;
}
