//! Fault scenarios on a real cluster (three clustered `nats-server`s, moto, three `cairn`
//! nodes), with clients over gRPC (routing and forwarding) and the Redis port running
//! throughout: each scenario injects its fault, heals it, reads every key, and the checker must
//! find the whole history linearizable, no key admitted twice in a TTL window, and no
//! acknowledged write lost. `cairn-jepsen` runs the same with random faults for longer.

use cairn_jepsen::{ClusterOptions, Run, TestCluster, WorkloadOptions};
use std::time::{Duration, Instant};

/// The default node timeout: what failover times are measured against.
const NODE_TIMEOUT: Duration = Duration::from_secs(3);

/// A scenario's folder (NATS, nodes' data and logs), kept after the test when
/// `KEEP_CAIRN_TEST_DIRS` is set, to read the logs of a failure.
fn scenario_dir() -> tempfile::TempDir {
    let keep = std::env::var_os("KEEP_CAIRN_TEST_DIRS").is_some();
    let dir = tempfile::Builder::new()
        .prefix("cairn-faults-")
        .disable_cleanup(keep)
        .tempdir()
        .unwrap();
    if keep {
        eprintln!("this scenario's folder: {}", dir.path().display());
    }
    dir
}

async fn cluster(name: &str, dir: &tempfile::TempDir, extra_config: &str) -> TestCluster {
    cluster_with(name, dir, extra_config, 1, Vec::new()).await
}

/// Snapshots every second, so that a scenario meets publishes and has snapshots to restore.
const FREQUENT_SNAPSHOTS: &str = "snapshot-interval = \"1s\"\n";

async fn cluster_with(
    name: &str,
    dir: &tempfile::TempDir,
    extra_config: &str,
    standbys: usize,
    env: Vec<(usize, String, String)>,
) -> TestCluster {
    TestCluster::start(ClusterOptions {
        cairn_bin: env!("CARGO_BIN_EXE_cairn").into(),
        dir: dir.path().join(name),
        nodes: 3,
        partitions: 8,
        standbys,
        node_timeout: NODE_TIMEOUT,
        extra_config: extra_config.to_string(),
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

/// Finishes `run` and asserts what the checker says, with the nodes' last log lines if not.
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

/// 64 keys, which cover every partition of the test clusters.
fn probe_keys() -> Vec<cairn_client::PutEntry> {
    probe_entries("v")
}

/// [`probe_keys`], each with `value`.
fn probe_entries(value: &'static str) -> Vec<cairn_client::PutEntry> {
    (0..64)
        .map(|i| cairn_client::PutEntry {
            key: format!("probe-{i}").into(),
            value: value.into(),
            ttl: None,
        })
        .collect()
}

/// A client's request timeout: longer than a node rides through a failover (10 s).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

async fn client_of(cluster: &TestCluster, i: usize) -> cairn_client::Client {
    let options = cairn_client::ClientOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: REQUEST_TIMEOUT,
    };
    cairn_client::Client::connect(&cluster.nodes[i].address(), &options)
        .await
        .unwrap()
}

/// Waits until a write to every partition succeeds through a node other than `down`; returns
/// how long that took from `since`.
async fn writes_resume(cluster: &TestCluster, down: usize, since: Instant) -> Duration {
    let client = client_of(cluster, (down + 1) % cluster.nodes.len()).await;
    loop {
        if client.put(probe_keys()).await.is_ok() {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "writes did not resume in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asserts that a write to every partition through node `via` fails, and before the client's
/// request timeout: an unavailable store says so rather than hanging.
async fn writes_fail(cluster: &TestCluster, via: usize, what: &str) -> cairn_client::Error {
    let client = client_of(cluster, via).await;
    let asked = Instant::now();
    let answer = client.put(probe_keys()).await;
    let took = asked.elapsed();
    let err = answer.expect_err(what);
    assert!(took < REQUEST_TIMEOUT, "{what}: the failure took {took:?}");
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_of_the_node_leading_the_most_partitions() {
    let dir = scenario_dir();
    let mut cluster = cluster("leader", &dir, "").await;
    let run = Run::start(&cluster, workload(1));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let victim = cluster.busiest_leader().await.unwrap();
    let killed = Instant::now();
    cluster.kill_node(victim);
    let resumed = writes_resume(&cluster, victim, killed).await;
    eprintln!(
        "writes to every partition resumed {} ms after the SIGKILL",
        resumed.as_millis()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.start_node(victim).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    check("sigkill of the busiest leader", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_of_the_controllers_node() {
    let dir = scenario_dir();
    let mut cluster = cluster("controller", &dir, "").await;
    let run = Run::start(&cluster, workload(2));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let victim = cluster.controller().await.unwrap();
    let killed = Instant::now();
    cluster.kill_node(victim);
    let resumed = writes_resume(&cluster, victim, killed).await;
    eprintln!(
        "writes resumed {} ms after the SIGKILL",
        resumed.as_millis()
    );
    // Another node takes the lease over.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match cluster.controller().await {
            Ok(i) if i != victim => break,
            _ => assert!(
                Instant::now() < deadline,
                "no other node took the controller's lease over"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.start_node(victim).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    check("sigkill of the controller", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_in_the_middle_of_a_snapshot_publish() {
    let dir = scenario_dir();
    let pause = vec![(
        0,
        "CAIRN_PAUSE_AT".to_string(),
        "snapshot-upload".to_string(),
    )];
    let mut cluster = cluster_with("publish", &dir, FREQUENT_SNAPSHOTS, 1, pause).await;
    let run = Run::start(&cluster, workload(3));
    cluster
        .wait_log(0, "paused at snapshot-upload", Duration::from_secs(60))
        .await
        .unwrap();
    let killed = Instant::now();
    cluster.kill_node(0);
    writes_resume(&cluster, 0, killed).await;
    cluster.nodes[0].env.clear();
    cluster.start_node(0).unwrap();
    // Snapshots go on being published, by the new leaders and the restarted node.
    tokio::time::sleep(Duration::from_secs(4)).await;
    check("sigkill in a snapshot publish", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_restarted_without_its_disk_restores_and_rejoins_even_if_killed_in_the_restore() {
    let dir = scenario_dir();
    // Every node holds every partition, so the wiped node gets its partitions back at once.
    let mut cluster = cluster_with("wipe", &dir, FREQUENT_SNAPSHOTS, 2, Vec::new()).await;
    let run = Run::start(&cluster, workload(4));
    tokio::time::sleep(Duration::from_secs(4)).await;
    let victim = 2;
    cluster.kill_node(victim);
    cluster.wipe_node(victim).unwrap();
    cluster.nodes[victim].env = vec![("CAIRN_PAUSE_AT".into(), "restore-download".into())];
    cluster.start_node(victim).unwrap();
    cluster
        .wait_log(
            victim,
            "paused at restore-download",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    cluster.kill_node(victim);
    cluster.nodes[victim].env.clear();
    cluster.start_node(victim).unwrap();
    cluster
        .wait_log(
            victim,
            "Restored partition from snapshot",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    cluster.wait_serving(Duration::from_secs(60)).await.unwrap();
    // It serves again: a write through it reaches every partition.
    let client = client_of(&cluster, victim).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(err) = client.put(probe_keys()).await {
        assert!(
            Instant::now() < deadline,
            "the restored node does not serve: {err}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    check("a wiped node restored", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigstop_of_a_leader_past_the_node_timeout_then_sigcont() {
    let dir = scenario_dir();
    let mut cluster = cluster("pause", &dir, "").await;
    let run = Run::start(&cluster, workload(5));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let victim = cluster.busiest_leader().await.unwrap();
    let paused = Instant::now();
    cluster.pause_node(victim);
    let resumed = writes_resume(&cluster, victim, paused).await;
    eprintln!(
        "writes resumed {} ms after the SIGSTOP",
        resumed.as_millis()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The old leader wakes up with requests of its clients queued at its old epoch: the checker
    // proves it acknowledges none of them wrongly.
    cluster.resume_node(victim);
    tokio::time::sleep(Duration::from_secs(4)).await;
    check("sigstop of a leader", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_cut_off_from_nats_stops_serving_within_the_timeout() {
    let dir = scenario_dir();
    let mut cluster = cluster("cut", &dir, "").await;
    let run = Run::start(&cluster, workload(6));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let victim = cluster.busiest_leader().await.unwrap();
    let cut = Instant::now();
    cluster.cut_node(victim);
    let resumed = writes_resume(&cluster, victim, cut).await;
    eprintln!("writes resumed {} ms after the cut", resumed.as_millis());
    // The cut-off node still takes connections, but serves neither reads nor writes.
    let client = client_of(&cluster, victim).await;
    let keys: Vec<bytes::Bytes> = probe_keys().into_iter().map(|e| e.key).collect();
    let read = client.get(keys).await;
    assert!(
        read.is_err(),
        "a node cut off from NATS answered reads: {read:?}"
    );
    writes_fail(&cluster, victim, "a write through a node cut off from NATS").await;
    cluster.heal_node(victim);
    tokio::time::sleep(Duration::from_secs(4)).await;
    check("a node cut off from NATS", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_servers_killed_one_then_two_and_brought_back() {
    let dir = scenario_dir();
    let mut cluster = cluster("nats", &dir, "").await;
    let run = Run::start(&cluster, workload(7));
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.kill_nats(0);
    // One of three servers down: writes go on (after NATS's own elections).
    let killed = Instant::now();
    let resumed = writes_resume(&cluster, 0, killed).await;
    eprintln!(
        "with one NATS server down, writes went on {} ms after the kill",
        resumed.as_millis()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.kill_nats(1);
    // Two down: no quorum. Once the leaders' leases have run out, writes are refused in time,
    // saying why (a write in flight meanwhile is of unknown outcome, which the checker covers).
    tokio::time::sleep(NODE_TIMEOUT).await;
    let err = writes_fail(&cluster, 2, "a write with two of three NATS servers down").await;
    assert_eq!(
        err.code(),
        Some(cairn_client::Code::Unavailable),
        "the failure is not UNAVAILABLE: {err}"
    );
    assert!(
        err.to_string().contains("NATS"),
        "the failure does not name NATS: {err}"
    );
    cluster.start_nats(1).await.unwrap();
    cluster.start_nats(0).await.unwrap();
    let back = Instant::now();
    let resumed = writes_resume(&cluster, 0, back).await;
    eprintln!(
        "writes resumed {} ms after the servers came back",
        resumed.as_millis()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    check("NATS servers killed", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn all_nats_servers_killed_and_restarted() {
    let dir = scenario_dir();
    let mut cluster = cluster("all-nats", &dir, "").await;
    let run = Run::start(&cluster, workload(8));
    tokio::time::sleep(Duration::from_secs(3)).await;
    for j in 0..3 {
        cluster.kill_nats(j);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    for j in 0..3 {
        cluster.start_nats(j).await.unwrap();
    }
    let back = Instant::now();
    let resumed = writes_resume(&cluster, 0, back).await;
    eprintln!(
        "writes resumed {} ms after the servers came back",
        resumed.as_millis()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    check("all NATS servers restarted", run, &mut cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bounded_staleness_reads_are_answered_by_followers_while_their_leader_is_paused() {
    use cairn_client::Consistency;
    let dir = scenario_dir();
    // Two followers: every node holds every partition.
    let cluster = cluster_with("stale-reads", &dir, "", 2, Vec::new()).await;
    let victim = cluster.busiest_leader().await.unwrap();
    let victim_name = cluster.nodes[victim].name.clone();
    let reader = (victim + 1) % cluster.nodes.len();
    let via_reader = client_of(&cluster, reader).await;
    let keys: Vec<bytes::Bytes> = probe_keys().into_iter().map(|e| e.key).collect();
    let all = |values: &[Option<bytes::Bytes>], value: &str| {
        values.len() == keys.len()
            && values
                .iter()
                .all(|v| v.as_deref() == Some(value.as_bytes()))
    };
    via_reader.put(probe_entries("v1")).await.unwrap();
    // A follower read at the leader's read index holds what was acknowledged.
    let values = via_reader
        .get_with(keys.clone(), Consistency::BoundedStaleness(Duration::ZERO))
        .await
        .unwrap();
    assert!(all(&values, "v1"), "{values:?}");

    // With the leader paused, a read that accepts a minute's staleness is answered by the
    // reader's own replicas, before anything fails over.
    cluster.pause_node(victim);
    let values = via_reader
        .get_with(
            keys.clone(),
            Consistency::BoundedStaleness(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    assert!(all(&values, "v1"), "{values:?}");
    let table = via_reader.list_partitions().await.unwrap();
    assert!(
        table.partitions.iter().any(|p| p.leader == victim_name),
        "the partitions failed over before the read was answered, so it proves nothing: {table:?}"
    );

    // Woken up with its old values, the old leader answers a read at the read index only with
    // what was acknowledged meanwhile.
    let paused = Instant::now();
    writes_resume(&cluster, victim, paused).await;
    via_reader.put(probe_entries("v2")).await.unwrap();
    cluster.resume_node(victim);
    let via_victim = client_of(&cluster, victim).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match via_victim
            .get_with(keys.clone(), Consistency::BoundedStaleness(Duration::ZERO))
            .await
        {
            Ok(values) => {
                assert!(
                    all(&values, "v2"),
                    "the woken node answered old values: {values:?}"
                );
                break;
            }
            Err(err) if err.nothing_done() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("{err}\n{}", cluster.log_tails(30)),
        }
    }
}
