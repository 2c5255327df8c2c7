//! A `cairn` node whose metadata lives in NATS JetStream (`[metadata] provider = "nats"`),
//! against a real `nats-server`.

mod support;

use cairn_metadata::test_util::NatsServer;
use std::path::{Path, PathBuf};
use support::{Server, cairnctl, fails, ok, run_cairn};

/// A config file in `dir` that keeps the metadata on the NATS server at `url`.
fn nats_config(dir: &Path, url: &str) -> PathBuf {
    let path = dir.join("cairn.toml");
    std::fs::write(
        &path,
        format!("[metadata]\nprovider = \"nats\"\n[nats]\nservers = [\"{url}\"]\nreplicas = 1\n"),
    )
    .unwrap();
    path
}

#[test]
fn a_node_keeps_its_cluster_record_in_nats() {
    let nats_dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(nats_dir.path(), 0);
    let dir = tempfile::tempdir().unwrap();
    let config = nats_config(dir.path(), &nats.url());
    let config = config.to_str().unwrap();

    let server = Server::start_with(&dir.path().join("n1"), &["--config", config], &[]);
    ok(cairnctl(&server.address, &["kv", "put", "k", "v"]));
    server.stop();
    let server = Server::start_with(&dir.path().join("n1"), &["--config", config], &[]);
    assert_eq!(
        ok(cairnctl(&server.address, &["kv", "get", "k"])).trim(),
        "v"
    );
    server.stop();

    // The cluster record is in NATS, not in the node's folder: a node with an empty base dir
    // finds it there, and is held to it.
    let other = dir.path().join("n2");
    let out = run_cairn(
        &["--base-dir", other.to_str().unwrap(), "--config", config],
        &[("CAIRN_NUM_PARTITIONS", "8")],
    );
    let err = fails(out);
    assert!(
        err.contains("this cluster was created with 16 partitions"),
        "{err}"
    );
}

#[test]
fn a_node_that_cannot_reach_nats_says_where_it_looked() {
    let dir = tempfile::tempdir().unwrap();
    // Port 1 on loopback: nothing listens there.
    let config = nats_config(dir.path(), "nats://127.0.0.1:1");
    let out = run_cairn(
        &[
            "--base-dir",
            dir.path().join("n1").to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ],
        &[],
    );
    let err = fails(out);
    assert!(
        err.contains("NATS at nats://127.0.0.1:1") && err.contains("nats-server"),
        "{err}"
    );
}
