//! Three `cairn` nodes in one cluster: their logs and metadata on three clustered `nats-server`s
//! with JetStream, their snapshots on moto's S3 server. Every process is real.

mod support;

use bytes::Bytes;
use cairn_client::{Client, ClientOptions, RoutingClient};
use cairn_metadata::nats::{NatsMetadataOptions, NatsMetadataStore};
use cairn_metadata::test_util::NatsCluster;
use cairn_metadata::{
    ArchivedHistory, Observed, PartitionTable, Precondition, get_typed, put_typed,
};
use cairn_snapshots::test_util::moto;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use support::{
    Server, assert_keys_there, cairnctl, created_id, fails, keys_of_partition, ok, put_keys,
    run_cairn, value_for,
};

const NODES: usize = 3;
const PARTITIONS: usize = 16;

/// A cluster's configuration file in `dir`: logs and metadata on `nats`, snapshots in a bucket
/// of moto's.
fn cluster_config(dir: &Path, nats: &NatsCluster) -> PathBuf {
    let moto = moto::server();
    let bucket = moto.create_bucket();
    let servers = nats.toml_servers();
    let path = dir.join("cairn.toml");
    std::fs::write(
        &path,
        format!(
            "[log]\nprovider = \"nats\"\n[metadata]\nprovider = \"nats\"\n\
             [nats]\nservers = [{servers}]\nreplicas = 3\n\
             [cluster]\ninitial-nodes = {NODES}\nstandbys = 1\n\
             [worker.snapshots]\ndestination = \"s3://{bucket}/cluster\"\n\
             endpoint-url = \"{}\"\nallow-http = true\nregion = \"us-east-1\"\n",
            moto.endpoint()
        ),
    )
    .unwrap();
    path
}

/// The cluster's metadata store in NATS, as its nodes see it.
async fn cluster_metadata(nats: &NatsCluster) -> NatsMetadataStore {
    NatsMetadataStore::connect(&NatsMetadataOptions {
        servers: nats.urls(),
        bucket: "cairn-cairn".into(),
        replicas: 3,
    })
    .await
    .unwrap()
}

const AWS: [(&str, &str); 2] = [
    ("AWS_ACCESS_KEY_ID", "cairn-test-key"),
    ("AWS_SECRET_ACCESS_KEY", "cairn-test-secret"),
];

/// Starts node `name` of the cluster; it listens at once, and serves once the cluster has placed
/// its partitions.
fn start_node(dir: &Path, config: &Path, name: &str) -> Server {
    Server::start_until(
        &dir.join(name),
        &["--config", config.to_str().unwrap(), "--node-name", name],
        &AWS,
        "Cairn node",
    )
}

/// Waits until `partitions list` through `address` shows every partition active with a leader.
fn wait_until_serving(address: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let out = cairnctl(address, &["partitions", "list"]);
        let table = String::from_utf8_lossy(&out.stdout).to_string();
        let rows: Vec<&str> = table
            .lines()
            .skip(1)
            .filter(|l| !l.trim().is_empty())
            .collect();
        if rows.len() == PARTITIONS && rows.iter().all(|r| r.trim_end().ends_with("active")) {
            return table;
        }
        assert!(
            Instant::now() < deadline,
            "the cluster does not serve every partition after 90 s:\n{table}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// LEADER and FOLLOWERS of every partition, from `partitions list`.
fn placement(table: &str) -> Vec<(String, String)> {
    table
        .lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let columns: Vec<&str> = l.split_whitespace().collect();
            (columns[2].to_string(), columns[3].to_string())
        })
        .collect()
}

/// Writes through one node's Redis port, conditional writes through another's, reads through the
/// third's; then `SET … NX EX` of the same keys raced through all three: one winner per key.
async fn resp_on_every_node(nodes: &[Server]) {
    let mut connections = Vec::new();
    for node in nodes {
        let address = node.resp_address().expect("the RESP port is on");
        let client = redis::Client::open(format!("redis://{address}/")).unwrap();
        // The client library's default gives up on an answer after 500 ms.
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(std::time::Duration::from_secs(60)));
        let connection = client.get_multiplexed_async_connection_with_config(&config);
        connections.push(connection.await.unwrap());
    }
    let keys: Vec<String> = (0..500).map(|i| format!("resp-{i}")).collect();
    let mut pipe = redis::pipe();
    for key in &keys {
        pipe.cmd("SET").arg(key).arg(format!("v-{key}")).ignore();
    }
    let () = pipe.query_async(&mut connections[0]).await.unwrap();
    let mut pipe = redis::pipe();
    for key in &keys {
        pipe.cmd("SET")
            .arg(key)
            .arg(format!("w-{key}"))
            .arg("XX")
            .arg("GET");
    }
    let old: Vec<String> = pipe.query_async(&mut connections[1]).await.unwrap();
    assert!(keys.iter().zip(&old).all(|(k, o)| *o == format!("v-{k}")));
    let values: Vec<String> = redis::cmd("MGET")
        .arg(&keys)
        .query_async(&mut connections[2])
        .await
        .unwrap();
    assert!(
        keys.iter()
            .zip(&values)
            .all(|(k, v)| *v == format!("w-{k}"))
    );
    let deleted: usize = redis::cmd("DEL")
        .arg(&keys[..100])
        .query_async(&mut connections[2])
        .await
        .unwrap();
    assert_eq!(deleted, 100);

    let contested = 300;
    let racers = connections.into_iter().enumerate().map(|(n, mut c)| {
        tokio::spawn(async move {
            let mut pipe = redis::pipe();
            for k in 0..contested {
                pipe.cmd("SET")
                    .arg(format!("resp-race-{k}"))
                    .arg(n)
                    .arg("NX")
                    .arg("EX")
                    .arg(600);
            }
            let replies: Vec<redis::Value> = pipe.query_async(&mut c).await.unwrap();
            (0..contested)
                .filter(|&k| replies[k] == redis::Value::Okay)
                .collect::<Vec<_>>()
        })
    });
    let mut admitted = std::collections::HashSet::new();
    for racer in racers {
        for k in racer.await.unwrap() {
            assert!(admitted.insert(k), "resp-race-{k} admitted twice");
        }
    }
    assert_eq!(admitted.len(), contested);
}

/// `cluster plan` on a placed three-node cluster of 16 partitions with one standby, every
/// partition written to and partition `snapshotted` snapshotted as `snapshot`.
fn scaling_previews(addresses: &[String], snapshotted: usize, snapshot: &str) {
    let before = ok(cairnctl(&addresses[0], &["partitions", "list"]));
    let plan = |nodes: &str| -> serde_json::Value {
        serde_json::from_str(&ok(cairnctl(
            &addresses[1],
            &["cluster", "plan", "--nodes", nodes, "-o", "json"],
        )))
        .unwrap()
    };
    let role_counts = |plan: &serde_json::Value| -> HashMap<String, (u64, u64)> {
        plan["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                let name = n["name"].as_str().unwrap().to_string();
                (
                    name,
                    (
                        n["leads_after"].as_u64().unwrap(),
                        n["follows_after"].as_u64().unwrap(),
                    ),
                )
            })
            .collect()
    };

    // Out: n4 takes 4 leaderships and 4 followings, each a copy to n4 and nothing else copied.
    let out = plan("n1,n2,n3,n4");
    let counts = role_counts(&out);
    for name in ["n1", "n2", "n3", "n4"] {
        assert_eq!(counts[name], (4, 4), "{name}: {out:#}");
    }
    let copies: Vec<&serde_json::Value> = out["moves"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["copies"] == true)
        .collect();
    assert_eq!(copies.len(), 8, "{out:#}");
    for copy in &copies {
        assert_eq!(copy["to"], "n4", "{copy:#}");
        // A copy loads the newest snapshot and replays the log past it, or the whole log.
        if copy["partition_id"] == snapshotted as u64 {
            assert_eq!(copy["snapshot_id"], snapshot, "{copy:#}");
            assert!(copy["snapshot_bytes"].as_u64().unwrap() > 0, "{copy:#}");
        } else {
            assert!(copy["snapshot_id"].is_null(), "{copy:#}");
            assert!(copy["log_records"].as_u64().unwrap() > 0, "{copy:#}");
        }
    }
    let n4 = out["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "n4")
        .unwrap();
    assert_eq!(n4["state"], "not joined");
    let moved: std::collections::HashSet<u64> = out["moves"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["partition_id"].as_u64().unwrap())
        .collect();
    assert_eq!(out["unmoved"].as_u64().unwrap() + moved.len() as u64, 16);

    // In: two nodes lead 8 and follow 8 each, n3's roles gone.
    let two = plan("n2,n1");
    let counts = role_counts(&two);
    assert_eq!(
        (counts["n1"], counts["n2"], counts["n3"]),
        ((8, 8), (8, 8), (0, 0)),
        "{two:#}"
    );

    // The table says the same for people, with what stands in the way.
    let table = ok(cairnctl(
        &addresses[2],
        &["cluster", "plan", "--nodes", "n1,n2,n3,n4"],
    ));
    assert!(table.contains("8 of them copies"), "{table}");
    assert!(table.contains("n4 has not joined the cluster"), "{table}");
    let err = fails(cairnctl(
        &addresses[0],
        &["cluster", "plan", "--nodes", "n1,n1"],
    ));
    assert!(err.contains("node n1 is named twice"), "{err}");
    let err = fails(cairnctl(
        &addresses[0],
        &["cluster", "plan", "--nodes", "n1,bad name"],
    ));
    assert!(err.contains("is not a node name"), "{err}");

    // Asking moved nothing.
    assert_eq!(
        placement(&ok(cairnctl(&addresses[0], &["partitions", "list"]))),
        placement(&before)
    );

    // With --upload, the leaders publish a snapshot of exactly the partitions n4 would copy.
    let copied: std::collections::BTreeSet<u64> = copies
        .iter()
        .map(|m| m["partition_id"].as_u64().unwrap())
        .collect();
    let uploaded = ok(cairnctl(
        &addresses[0],
        &["cluster", "plan", "--nodes", "n1,n2,n3,n4", "--upload"],
    ));
    assert!(
        uploaded.contains(&format!(
            "uploading fresh snapshots of the {} partitions",
            copied.len()
        )),
        "{uploaded}"
    );
    let snapshotted_now = |address: &str| -> std::collections::BTreeSet<u64> {
        ok(cairnctl(address, &["snapshots", "list"]))
            .lines()
            .skip(1)
            .filter_map(|row| row.split_whitespace().nth(1)?.parse().ok())
            .collect()
    };
    let mut expected = copied.clone();
    expected.insert(snapshotted as u64);
    assert_eq!(snapshotted_now(&addresses[1]), expected);

    // A chosen set of partitions, then every partition one node leads.
    let created = ok(cairnctl(
        &addresses[2],
        &["snapshots", "create", "-p", "0,1"],
    ));
    assert_eq!(created.matches("Snapshot ").count(), 2, "{created}");
    expected.extend([0, 1]);
    assert_eq!(snapshotted_now(&addresses[1]), expected);
    let placed = placement(&before);
    let of_n3: Vec<u64> = (0..placed.len() as u64)
        .filter(|&p| placed[p as usize].0 == "n3")
        .collect();
    let created = ok(cairnctl(
        &addresses[0],
        &["snapshots", "create", "--node", "n3"],
    ));
    assert_eq!(
        created.matches("Snapshot ").count(),
        of_n3.len(),
        "{created}"
    );
    expected.extend(of_n3);
    assert_eq!(snapshotted_now(&addresses[1]), expected);
    let err = fails(cairnctl(
        &addresses[0],
        &["snapshots", "create", "--node", "n9"],
    ));
    assert!(
        err.contains("node n9 leads no partition; the leaders are n1, n2, n3"),
        "{err}"
    );

    // A full sync makes a new snapshot even where one covers the partition, every byte uploaded.
    let again = ok(cairnctl(&addresses[0], &["snapshots", "create", "-p", "0"]));
    assert!(again.starts_with("Snapshot exists"), "{again}");
    let full = ok(cairnctl(
        &addresses[0],
        &["snapshots", "create", "-p", "0", "--full"],
    ));
    let id = created_id(&full);
    let listed = ok(cairnctl(&addresses[1], &["snapshots", "list", "-p", "0"]));
    let row: Vec<&str> = listed
        .lines()
        .find(|l| l.contains(&id))
        .unwrap_or_else(|| panic!("{id} not listed:\n{listed}"))
        .split_whitespace()
        .collect();
    // SIZE and UPLOADED are the last columns but FILES, each a number and a unit.
    let (size, uploaded) = (&row[row.len() - 5..row.len() - 3], &row[row.len() - 2..]);
    assert_eq!(size, uploaded, "{listed}");
}

/// A fourth node joins the placed cluster, which gives it nothing; `partitions load` has it follow
/// partitions 3 and 7, and then it holds their data and a scale-out plan copies two partitions
/// less. Returns the node, still running.
async fn load_on_a_new_node(dir: &Path, config: &Path, addresses: &[String]) -> Server {
    let n4 = start_node(dir, config, "n4");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let nodes = ok(cairnctl(&addresses[0], &["nodes", "list"]));
        let row = nodes
            .lines()
            .find(|l| l.split_whitespace().next() == Some("n4"));
        if let Some(row) = row.filter(|r| r.contains(" alive ")) {
            // LEADS and FOLLOWS, the last columns: a node that joins later gets nothing.
            let columns: Vec<&str> = row.split_whitespace().collect();
            assert_eq!(columns[columns.len() - 2..], ["0", "0"], "{nodes}");
            break;
        }
        assert!(Instant::now() < deadline, "n4 never alive:\n{nodes}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let err = fails(cairnctl(
        &addresses[0],
        &["partitions", "load", "-p", "3", "--node", "n9"],
    ));
    assert!(err.contains("node n9 has not joined the cluster"), "{err}");
    let err = fails(cairnctl(
        &addresses[0],
        &["partitions", "load", "-p", "99", "--node", "n4"],
    ));
    assert!(err.contains("partition 99 does not exist"), "{err}");

    // Written before the load: it is in what n4 loads.
    let keys = keys_of_partition("loaded", 3, 50)
        .into_iter()
        .chain(keys_of_partition("loaded", 7, 50))
        .collect::<Vec<_>>();
    put_keys(&addresses[1], &keys, 25).await;
    let loaded = ok(cairnctl(
        &addresses[1],
        &["partitions", "load", "-p", "3,7", "--node", "n4"],
    ));
    assert!(
        loaded.contains("n4 follows 2 partitions, caught up with their logs"),
        "{loaded}"
    );
    let listed = ok(cairnctl(&addresses[0], &["partitions", "list"]));
    for p in [3, 7] {
        let row = listed
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&p.to_string()))
            .unwrap();
        assert!(
            row.contains("n4"),
            "partition {p} followed by n4:\n{listed}"
        );
    }
    // n4 answers them from its own replicas.
    let mut args = vec!["kv", "get", "--max-staleness", "60s"];
    args.extend(keys.iter().map(String::as_str));
    let read = ok(cairnctl(&n4.address, &args));
    assert!(!read.contains("(absent)"), "{read}");
    // A node that leads a partition already has it.
    let leader_of_3 = placement(&listed)[3].0.clone();
    let err = fails(cairnctl(
        &addresses[0],
        &["partitions", "load", "-p", "3", "--node", &leader_of_3],
    ));
    assert!(err.contains("leads partition 3 already"), "{err}");

    // Scaling out to n4 now copies two partitions less than the eight it would have.
    let plan: serde_json::Value = serde_json::from_str(&ok(cairnctl(
        &addresses[2],
        &["cluster", "plan", "--nodes", "n1,n2,n3,n4", "-o", "json"],
    )))
    .unwrap();
    assert_eq!(plan["totals"]["copies"], 6, "{plan:#}");
    let n4_row = plan["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "n4")
        .unwrap();
    assert_eq!(n4_row["state"], "alive");
    n4
}

/// `cluster scale` onto n4 and off it again through cairnctl, the second detached and followed
/// with `cluster operations describe`; `nodes remove` of n4 refused while it has roles, naming
/// the scale that drains it.
async fn scale_with_cairnctl(addresses: &[String]) {
    let out = ok(cairnctl(
        &addresses[0],
        &["-y", "-q", "cluster", "scale", "--nodes", "n1,n2,n3,n4"],
    ));
    assert!(out.contains("operation 1 started"), "{out}");
    assert!(out.contains("operation 1: succeeded"), "{out}");
    let listed: serde_json::Value = serde_json::from_str(&ok(cairnctl(
        &addresses[1],
        &["cluster", "operations", "list", "-o", "json"],
    )))
    .unwrap();
    assert_eq!(listed[0]["state"], "succeeded", "{listed:#}");
    let moves = listed[0]["moves"].as_array().unwrap();
    assert!(
        !moves.is_empty() && moves.iter().all(|m| m["step"] == "done"),
        "{listed:#}"
    );
    let plan: serde_json::Value = serde_json::from_str(&ok(cairnctl(
        &addresses[2],
        &["cluster", "plan", "--nodes", "n1,n2,n3,n4", "-o", "json"],
    )))
    .unwrap();
    assert_eq!(plan["totals"]["moves"], 0, "balanced on the four: {plan:#}");

    let err = fails(cairnctl(&addresses[0], &["-y", "nodes", "remove", "n4"]));
    assert!(
        err.contains("node n4 still has a role in partitions")
            && err.contains("cairnctl cluster scale --nodes n1,n2,n3"),
        "{err}"
    );
    let err = fails(cairnctl(
        &addresses[0],
        &["-y", "cluster", "operations", "cancel", "1"],
    ));
    assert!(
        err.contains("operation 1 has finished (succeeded)"),
        "{err}"
    );

    let out = ok(cairnctl(
        &addresses[2],
        &[
            "-y", "-q", "cluster", "scale", "--nodes", "n1,n2,n3", "--detach",
        ],
    ));
    assert!(out.contains("operation 2 started"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let op: serde_json::Value = serde_json::from_str(&ok(cairnctl(
            &addresses[0],
            &["cluster", "operations", "describe", "2", "-o", "json"],
        )))
        .unwrap();
        if op["state"] == "succeeded" {
            break;
        }
        assert_eq!(op["state"], "running", "{op:#}");
        assert!(Instant::now() < deadline, "operation 2 not done: {op:#}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let described = ok(cairnctl(
        &addresses[1],
        &["cluster", "operations", "describe", "2"],
    ));
    assert!(described.contains("operation 2: succeeded"), "{described}");
}

/// `nodes remove` of n4 (drained): refused while it runs, taken once it is stopped; then it is
/// no longer listed.
async fn remove_a_stopped_node(addresses: &[String], n4: Server) {
    let err = fails(cairnctl(&addresses[0], &["-y", "nodes", "remove", "n4"]));
    assert!(
        err.contains("node n4 is not stopped: stop it first"),
        "{err}"
    );
    let err = fails(cairnctl(&addresses[0], &["-y", "nodes", "remove", "n9"]));
    assert!(
        err.contains("node n9 is not a member of the cluster"),
        "{err}"
    );
    n4.stop();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = cairnctl(&addresses[1], &["-y", "nodes", "remove", "n4"]);
        if out.status.success() {
            break;
        }
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        // It left cleanly: what it followed goes to others in the controller's next rounds.
        assert!(err.contains("still has a role in partitions"), "{err}");
        assert!(Instant::now() < deadline, "n4 never removable: {err}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Each node lists the members as it last read them (every thirtieth of the node timeout).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let nodes = ok(cairnctl(&addresses[2], &["nodes", "list"]));
        if !nodes
            .lines()
            .any(|l| l.split_whitespace().next() == Some("n4"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "n4 still listed:\n{nodes}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_three_node_cluster_spreads_leaders_serves_every_key_from_every_node_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsCluster::start(&dir.path().join("nats"));
    let config = cluster_config(dir.path(), &nats);
    let names: Vec<String> = (1..=NODES).map(|i| format!("n{i}")).collect();
    let mut nodes: Vec<Server> = names
        .iter()
        .map(|name| start_node(dir.path(), &config, name))
        .collect();
    let addresses: Vec<String> = nodes.iter().map(|n| n.address.clone()).collect();

    // Leaders spread over all three nodes, 5 or 6 each, each partition followed elsewhere.
    let table = wait_until_serving(&addresses[0]);
    let placed = placement(&table);
    let mut leads: HashMap<&str, usize> = HashMap::new();
    for (leader, followers) in &placed {
        *leads.entry(leader.as_str()).or_default() += 1;
        assert!(
            names.contains(followers) && followers != leader,
            "one follower on another node:\n{table}"
        );
    }
    assert_eq!(leads.len(), NODES, "{table}");
    assert!(leads.values().all(|&n| n == 5 || n == 6), "{table}");
    let nodes_table = ok(cairnctl(&addresses[1], &["nodes", "list"]));
    for name in &names {
        let row = nodes_table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} not listed:\n{nodes_table}"));
        assert!(row.contains(" alive "), "{nodes_table}");
    }

    // Written through one node, read through every node.
    let keys: Vec<String> = (0..2000).map(|i| format!("key-{i}")).collect();
    put_keys(&addresses[0], &keys, 100).await;
    for address in &addresses {
        assert_keys_there(address, &keys).await;
        // And by cairnctl, from the node's own replicas when it accepts staleness.
        let table = ok(cairnctl(
            address,
            &["kv", "get", "key-1", "key-2", "--max-staleness", "2s"],
        ));
        assert!(
            table.contains("key-1") && table.contains("key-2"),
            "{table}"
        );
        assert!(!table.contains("(absent)"), "{table}");
    }
    let err = fails(cairnctl(
        &addresses[0],
        &["kv", "get", "key-1", "--max-staleness", "soon"],
    ));
    assert!(err.contains("write it like 0s, 500ms or 2s"), "{err}");

    // The Redis port of every node answers every key, and its conditional writes are decided by
    // the partitions' leaders wherever they are sent.
    resp_on_every_node(&nodes).await;

    // Insert-if-absent of the same keys from clients that route by themselves, each seeded by
    // another node (the writes above went through one node, which forwarded): one winner per key.
    let contested: Vec<Bytes> = (0..3000)
        .map(|i| Bytes::from(format!("dedup-{i}")))
        .collect();
    let racers = addresses.iter().enumerate().map(|(n, address)| {
        let contested = contested.clone();
        let address = address.clone();
        tokio::spawn(async move {
            let client = RoutingClient::connect(&address, &ClientOptions::default())
                .await
                .unwrap();
            let mut won = Vec::new();
            // Each node's client goes through the keys in its own order.
            let mut order: Vec<usize> = (0..contested.len()).collect();
            order.rotate_left(n * 1000);
            for chunk in order.chunks(50) {
                let batch: Vec<Bytes> = chunk.iter().map(|&i| contested[i].clone()).collect();
                let inserted = client
                    .insert_if_absent(batch, Bytes::from(format!("n{n}")), None)
                    .await
                    .unwrap();
                won.extend(
                    chunk
                        .iter()
                        .zip(inserted)
                        .filter(|(_, w)| *w)
                        .map(|(&i, _)| i),
                );
            }
            (n, won)
        })
    });
    let mut winners: HashMap<usize, Vec<usize>> = HashMap::new();
    for racer in racers {
        let (n, won) = racer.await.unwrap();
        for key in won {
            winners.entry(key).or_default().push(n);
        }
    }
    assert_eq!(winners.len(), contested.len(), "every key admitted once");
    assert!(
        winners.values().all(|w| w.len() == 1),
        "a key admitted twice"
    );
    let client = Client::connect(&addresses[2], &ClientOptions::default())
        .await
        .unwrap();
    let stored = client.get(contested.clone()).await.unwrap();
    for (i, value) in stored.into_iter().enumerate() {
        assert_eq!(value, Some(Bytes::from(format!("n{}", winners[&i][0]))));
    }

    // A snapshot asked of a node that does not lead the partition is taken by its leader.
    let (partition, (leader, _)) = placed
        .iter()
        .enumerate()
        .find(|(_, (leader, _))| leader != "n1")
        .unwrap();
    let created = ok(cairnctl(
        &addresses[0],
        &["snapshots", "create", "-p", &partition.to_string()],
    ));
    let id = created_id(&created);
    let listed = ok(cairnctl(
        &addresses[1],
        &["snapshots", "list", "-p", &partition.to_string()],
    ));
    let row = listed
        .lines()
        .find(|l| l.contains(&id))
        .unwrap_or_else(|| panic!("{id} not listed:\n{listed}"));
    assert!(row.contains(leader.as_str()), "taken by {leader}: {row}");
    // What the snapshot covers is in the metadata store, for whichever node leads next.
    let metadata = cluster_metadata(&nats).await;
    let (_, history) = get_typed::<ArchivedHistory>(
        &metadata,
        &ArchivedHistory::key(cairn_types::PartitionId(partition as u16)),
        "archived LSN history",
    )
    .await
    .unwrap()
    .expect("the archived LSN is in the metadata store");
    let snapshot_lsn: u64 = row.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert_eq!(history.seen.last().map(|(lsn, _)| *lsn), Some(snapshot_lsn));
    // Beside the intent, each node reports what it runs: together, one leader per partition,
    // the one the table names, and its follower.
    let mut observed_leaders: HashMap<u16, Vec<String>> = HashMap::new();
    for name in &names {
        let (_, observed) = get_typed::<Observed>(
            &metadata,
            &Observed::key(&cairn_types::NodeId(name.clone())),
            "observed",
        )
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{name} reports what it runs"));
        for (partition, running) in observed.partitions {
            if running.role == cairn_metadata::ObservedRole::Leader {
                observed_leaders
                    .entry(partition.0)
                    .or_default()
                    .push(name.clone());
            }
        }
    }
    for (p, (leader, _)) in placed.iter().enumerate() {
        assert_eq!(
            observed_leaders.get(&(p as u16)),
            Some(&vec![leader.clone()]),
            "partition {p}"
        );
    }

    // A preview of scaling out to a fourth node, and in to two: balanced, the least copied, and
    // nothing changed by asking; then the snapshots a scaling wants, uploaded ahead.
    scaling_previews(&addresses, partition, &id);
    let n4 = load_on_a_new_node(dir.path(), &config, &addresses).await;
    scale_with_cairnctl(&addresses).await;
    remove_a_stopped_node(&addresses, n4).await;

    // Every process stopped and started again: all data there.
    for node in nodes.drain(..) {
        node.stop();
    }
    let nodes: Vec<Server> = names
        .iter()
        .map(|name| start_node(dir.path(), &config, name))
        .collect();
    wait_until_serving(&nodes[1].address);
    for node in &nodes {
        assert_keys_there(&node.address, &keys).await;
    }
    let again = Client::connect(&nodes[0].address, &ClientOptions::default())
        .await
        .unwrap();
    let late = again
        .insert_if_absent(contested.clone(), Bytes::from("late"), None)
        .await
        .unwrap();
    assert!(
        late.iter().all(|w| !w),
        "a key admitted again after the restart"
    );
}

#[test]
fn a_node_name_held_by_a_live_node_or_a_cluster_without_a_shared_repository_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsCluster::start(&dir.path().join("nats"));
    let config = cluster_config(dir.path(), &nats);
    let first = start_node(dir.path(), &config, "n1");
    let out = run_cairn(
        &[
            "--base-dir",
            dir.path().join("elsewhere").to_str().unwrap(),
            "--bind-address",
            "127.0.0.1:0",
            "--config",
            config.to_str().unwrap(),
            "--node-name",
            "n1",
        ],
        &AWS,
    );
    let err = fails(out);
    assert!(
        err.contains("node name n1 is held by a live node")
            && err.contains(first.address.trim_start_matches("http://"))
            && err.contains("another node-name"),
        "{err}"
    );

    // The same node restarted on its own base dir is itself, not a second n1.
    first.kill();
    let again = start_node(dir.path(), &config, "n1");
    again.stop();

    let local = dir.path().join("local.toml");
    std::fs::write(
        &local,
        format!(
            "[log]\nprovider = \"nats\"\n[metadata]\nprovider = \"nats\"\n[nats]\nservers = [\"{}\"]\n",
            nats.urls()[0]
        ),
    )
    .unwrap();
    let err = fails(run_cairn(
        &[
            "--base-dir",
            dir.path().join("n4").to_str().unwrap(),
            "--config",
            local.to_str().unwrap(),
        ],
        &[],
    ));
    assert!(
        err.contains("[worker.snapshots] destination") && err.contains("every node"),
        "{err}"
    );
}

/// The value of `metric{partition="p"}` in a node's Prometheus text.
fn partition_metric(text: &str, metric: &str, partition: usize) -> Option<u64> {
    let prefix = format!("{metric}{{partition=\"{partition}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_followers_place_goes_to_a_node_that_restores_the_trimmed_log_from_the_repository() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsCluster::start(&dir.path().join("nats"));
    let config = cluster_config(dir.path(), &nats);
    let names: Vec<String> = (1..=NODES).map(|i| format!("n{i}")).collect();
    let mut nodes: Vec<Option<Server>> = names
        .iter()
        .map(|name| Some(start_node(dir.path(), &config, name)))
        .collect();
    let first = nodes[0].as_ref().unwrap().address.clone();
    let table = wait_until_serving(&first);
    // A partition that n1 leads, its follower, and the third node.
    let placed = placement(&table);
    let partition = placed
        .iter()
        .position(|(leader, _)| leader == "n1")
        .expect("n1 leads a partition");
    let follower = placed[partition].1.clone();
    let f = names.iter().position(|n| *n == follower).unwrap();
    let t = (0..NODES).find(|&i| i != 0 && i != f).unwrap();

    // The partition gets records, a snapshot, and a trim past them.
    let keys = support::keys_of_partition("behind", partition as u16, 300);
    put_keys(&first, &keys, 50).await;
    ok(cairnctl(
        &first,
        &[
            "snapshots",
            "create",
            "-p",
            &partition.to_string(),
            "--trim-log",
        ],
    ));
    let trimmed = ok(cairnctl(
        &first,
        &["logs", "describe", "-l", &partition.to_string()],
    ));
    let trim_point: u64 = trimmed
        .lines()
        .nth(1)
        .and_then(|row| row.split_whitespace().nth(1))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no trim point in:\n{trimmed}"));
    assert!(trim_point > 0, "the log was trimmed:\n{trimmed}");

    // The follower dies. After the node timeout the controller gives its place to the third
    // node, which has no store of the partition and a log trimmed past nothing it holds: it
    // restores from the repository, then follows the log, new records included.
    nodes[f].take().unwrap().kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let table = ok(cairnctl(&first, &["partitions", "list"]));
        if placement(&table)[partition].1 == names[t] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} does not follow partition {partition} 30 s after {follower} died:\n{table}",
            names[t]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let more = support::keys_of_partition("after", partition as u16, 100);
    put_keys(&first, &more, 50).await;
    let leader_tail = {
        let client = Client::connect(&first, &ClientOptions::default())
            .await
            .unwrap();
        client
            .list_partitions()
            .await
            .unwrap()
            .partitions
            .into_iter()
            .find(|p| p.partition_id as usize == partition)
            .unwrap()
            .log_tail
    };
    let replacement = nodes[t].as_ref().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let applied = partition_metric(
            &support::scrape(replacement),
            "cairn_partition_applied_lsn",
            partition,
        );
        if applied == Some(leader_tail) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} applied {applied:?} of partition {partition}, the leader's log ends at {leader_tail}:\n{}",
            names[t],
            replacement.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        replacement
            .output()
            .lines()
            .any(|l| l.contains("Restored partition from snapshot")
                && l.contains(&format!("partition={partition} "))),
        "{} restored partition {partition} from the repository:\n{}",
        names[t],
        replacement.output()
    );
    // The dead follower comes back on its base dir: it rejoins, alive, and the partition's
    // leadership stays where it is.
    let back = start_node(dir.path(), &config, &follower);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let list = ok(cairnctl(&first, &["nodes", "list"]));
        let row = list
            .lines()
            .find(|l| l.split_whitespace().next() == Some(follower.as_str()))
            .unwrap_or_default()
            .to_string();
        if row.contains("alive") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{follower} is not alive again:\n{list}\n{}",
            back.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        placement(&ok(cairnctl(&first, &["partitions", "list"])))[partition].0,
        "n1"
    );
}

/// Puts `keys` (with [`value_for`] values) through a client that routes by itself.
async fn put_routed(client: &RoutingClient, keys: &[String]) {
    let entries = keys
        .iter()
        .map(|key| cairn_client::PutEntry {
            key: Bytes::from(key.clone()),
            value: value_for(key),
            ttl: None,
        })
        .collect();
    client.put(entries).await.unwrap();
}

/// The row of partition `partition` in `partitions list`: (LEADER, STATUS).
fn leader_and_status(table: &str, partition: u16) -> Option<(String, String)> {
    table.lines().skip(1).find_map(|line| {
        let columns: Vec<&str> = line.split_whitespace().collect();
        (columns.first() == Some(&partition.to_string().as_str())).then(|| {
            (
                columns[2].to_string(),
                columns.last().unwrap_or(&"").to_string(),
            )
        })
    })
}

/// A leadership moved by a change of the intent (what failover and scaling will write): a client
/// that routes by itself still sends the partition's keys to the old leader, which refuses them
/// instead of forwarding them; the client reads the table again and they land on the new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_routing_client_follows_a_leader_the_intent_moved() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsCluster::start(&dir.path().join("nats"));
    let config = cluster_config(dir.path(), &nats);
    let nodes: Vec<Server> = (1..=NODES)
        .map(|i| start_node(dir.path(), &config, &format!("n{i}")))
        .collect();
    let address = nodes[0].address.clone();
    wait_until_serving(&address);
    const MOVED: u16 = 3;
    let client = RoutingClient::connect(&address, &ClientOptions::default())
        .await
        .unwrap();
    let before = keys_of_partition("before-the-move", MOVED, 50);
    put_routed(&client, &before).await;
    let routes_before = client.table_version();

    // The intent: partition 3 led by its follower, followed by its old leader.
    let metadata = cluster_metadata(&nats).await;
    let (version, mut table) =
        get_typed::<PartitionTable>(&metadata, PartitionTable::KEY, "partition table")
            .await
            .unwrap()
            .expect("the cluster placed its partitions");
    let placement = table
        .partitions
        .get_mut(&cairn_types::PartitionId(MOVED))
        .unwrap();
    let old = placement.leader.clone().unwrap();
    let new = placement.followers[0].clone();
    placement.leader = Some(new.clone());
    placement.followers = vec![old.clone()];
    put_typed(
        &metadata,
        PartitionTable::KEY,
        &table,
        Precondition::MatchesVersion(version),
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = ok(cairnctl(&address, &["partitions", "list"]));
        if leader_and_status(&listed, MOVED) == Some((new.0.clone(), "active".into())) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{new} does not lead partition {MOVED} 60 s after the intent said so:\n{listed}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The client's routes still name the old leader: it is refused there, reads the table again,
    // and the keys land on the new one.
    let after = keys_of_partition("after-the-move", MOVED, 50);
    put_routed(&client, &after).await;
    assert!(
        client.table_version() > routes_before,
        "the client kept its routes of version {routes_before}: {old} forwarded its keys instead \
         of refusing them"
    );
    for node in &nodes {
        assert_keys_there(&node.address, &before).await;
        assert_keys_there(&node.address, &after).await;
    }
}
