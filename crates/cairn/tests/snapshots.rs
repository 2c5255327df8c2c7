//! Snapshots end to end through `cairnctl` and a real `cairn`: create (seed 000's command and
//! output), list, describe, export, verify, the archived LSN, incremental uploads; against the
//! local folder and against moto's S3 server.

mod support;

use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry};
use cairn_snapshots::test_util::moto;
use std::path::Path;
use std::process::Command;
use support::{Server, cairnctl, created_id, fails, ok};

/// Writes `n` keys starting at `from` and returns the partitions they landed in.
async fn write_keys(address: &str, from: usize, n: usize) {
    let client = Client::connect(address, &ClientOptions::default())
        .await
        .unwrap();
    let entries = (from..from + n)
        .map(|i| PutEntry {
            key: Bytes::from(format!("user-{i:06}")),
            value: Bytes::from(format!("profile of user {i} ").repeat(8)),
            ttl: None,
        })
        .collect();
    client.put(entries).await.unwrap();
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

async fn scenario(server: &Server) {
    let a = server.address.as_str();
    write_keys(a, 0, 2000).await;

    // Seed 000: `snapshots create -p 1` prints the id.
    let first = created_id(&ok(cairnctl(a, &["snapshots", "create", "-p", "1"])));
    assert!(first.starts_with("snap_1") && first.len() == 28, "{first}");
    // The export folder is gone once the snapshot is published.
    let exports = server.base_dir.join("db-snapshots").join("1");
    let leftovers = std::fs::read_dir(&exports).map(|d| d.count()).unwrap_or(0);
    assert_eq!(leftovers, 0, "export folder left in {}", exports.display());

    // Nothing new: the existing snapshot covers the partition's LSN, and any older LSN.
    let again = ok(cairnctl(a, &["snapshots", "create", "-p", "1"]));
    assert!(
        again.contains(&format!("Snapshot exists: {first}")),
        "{again}"
    );
    let again = ok(cairnctl(
        a,
        &["snapshots", "create", "-p", "1", "--min-lsn", "2"],
    ));
    assert!(again.contains(&first), "{again}");
    let err = fails(cairnctl(
        a,
        &["snapshots", "create", "-p", "1", "--min-lsn", "999999"],
    ));
    assert!(err.contains("past the log's tail"), "{err}");

    let metadata = json(&ok(cairnctl(a, &["snapshots", "describe", &first])));
    for field in [
        "version",
        "cluster_name",
        "partition_id",
        "node_name",
        "created_at",
        "snapshot_id",
        "key_range",
        "min_applied_lsn",
        "db_comparator_name",
        "files",
        "log_id",
    ] {
        assert!(
            metadata.get(field).is_some(),
            "metadata lacks {field}: {metadata}"
        );
    }
    assert_eq!(metadata["version"], "V1");
    assert_eq!(metadata["partition_id"], 1);
    assert_eq!(metadata["log_id"], 1);
    assert_eq!(metadata["snapshot_id"], first.as_str());
    assert_eq!(
        metadata["key_range"]["start"].as_u64(),
        Some(1152921504606846976)
    );
    assert_eq!(
        metadata["key_range"]["end"].as_u64(),
        Some(2305843009213693951)
    );
    let files = metadata["files"].as_array().unwrap();
    assert!(!files.is_empty());
    for file in files {
        for field in [
            "column_family_name",
            "name",
            "directory",
            "size",
            "level",
            "start_key",
            "end_key",
            "smallest_seqno",
            "largest_seqno",
            "num_entries",
            "num_deletions",
            "checksum",
        ] {
            assert!(file.get(field).is_some(), "file lacks {field}: {file}");
        }
    }
    let first_lsn = metadata["min_applied_lsn"].as_u64().unwrap();

    // A small change: the second snapshot uploads only the new SST.
    write_keys(a, 2000, 20).await;
    let second = created_id(&ok(cairnctl(a, &["snapshots", "create", "-p", "1"])));
    assert_ne!(first, second);
    assert!(second > first, "ids sort by time");
    let second_meta = json(&ok(cairnctl(a, &["snapshots", "describe", &second])));
    let first_sizes: u64 = files.iter().map(|f| f["size"].as_u64().unwrap()).sum();
    let uploaded = second_meta["stats"]["uploaded_bytes"].as_u64().unwrap();
    let total: u64 = second_meta["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["size"].as_u64().unwrap())
        .sum();
    assert!(
        uploaded > 0 && uploaded < total,
        "uploaded {uploaded} of {total}"
    );
    assert_eq!(
        total - uploaded,
        first_sizes,
        "the first snapshot's SSTs are shared, not re-uploaded"
    );

    // Listing: newest first.
    let list = ok(cairnctl(a, &["snapshots", "list", "-p", "1"]));
    let ids: Vec<&str> = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| w.starts_with("snap_"))
        .collect();
    assert_eq!(ids, vec![second.as_str(), first.as_str()], "{list}");

    // The archived LSN is what the oldest retained snapshot covers.
    let partitions = ok(cairnctl(a, &["partitions", "list"]));
    let row = partitions
        .lines()
        .find(|l| l.split_whitespace().next() == Some("1"))
        .unwrap();
    assert!(
        row.split_whitespace().any(|c| c == first_lsn.to_string()),
        "{partitions}"
    );

    // Export as tar; Debian's sst_dump reads every SST in it.
    let out = tempfile::tempdir().unwrap();
    let tar = out.path().join("snap.tar");
    ok(cairnctl(
        a,
        &["snapshots", "export", &second, "-o", tar.to_str().unwrap()],
    ));
    let status = Command::new("tar")
        .arg("-xf")
        .arg(&tar)
        .arg("-C")
        .arg(out.path())
        .status()
        .unwrap();
    assert!(status.success());
    let exported = json(&std::fs::read_to_string(out.path().join("metadata.json")).unwrap());
    assert_eq!(exported["snapshot_id"], second.as_str());
    for file in exported["files"].as_array().unwrap() {
        let name = file["name"].as_str().unwrap().trim_start_matches('/');
        let path = out.path().join(name);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            file["size"].as_u64().unwrap()
        );
        sst_dump_reads(&path);
    }

    let verified = ok(cairnctl(a, &["snapshots", "verify", &second]));
    assert!(verified.contains("verified"), "{verified}");

    // Every partition, with progress.
    let all = ok(cairnctl(a, &["snapshots", "create"]));
    let lines = all.lines().filter(|l| l.starts_with("Snapshot ")).count();
    assert_eq!(lines, 16, "{all}");

    let err = fails(cairnctl(a, &["snapshots", "describe", "snap_bogus"]));
    assert!(err.contains("snapshot id must look like"), "{err}");
    let err = fails(cairnctl(a, &["snapshots", "create", "-p", "16"]));
    assert!(err.contains("partition 16 does not exist"), "{err}");
}

fn sst_dump_reads(path: &Path) {
    let output = Command::new("sst_dump")
        .arg(format!("--file={}", path.display()))
        .arg("--command=check")
        .output()
        .expect("sst_dump (Debian's rocksdb-tools) must be installed: run scripts/setup-debian.sh");
    assert!(
        output.status.success(),
        "sst_dump cannot read {}: {}",
        path.display(),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshots_in_the_local_folder() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    scenario(&server).await;

    // A corrupted object makes verify fail and name the file.
    let a = server.address.as_str();
    let list = ok(cairnctl(a, &["snapshots", "list", "-p", "1"]));
    let newest = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .find(|w| w.starts_with("snap_"))
        .unwrap()
        .to_string();
    let metadata = json(&ok(cairnctl(a, &["snapshots", "describe", &newest])));
    let victim = &metadata["files"][0];
    let object = dir
        .path()
        .join("pp-snapshots")
        .join("1")
        .join(victim["key"].as_str().unwrap());
    let mut bytes = std::fs::read(&object).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&object, bytes).unwrap();
    let err = fails(cairnctl(a, &["snapshots", "verify", &newest]));
    let name = victim["name"].as_str().unwrap().trim_start_matches('/');
    assert!(err.contains(name) && err.contains("checksum"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshots_on_an_s3_compatible_server() {
    let moto = moto::server();
    let bucket = moto.create_bucket();
    let destination = format!("s3://{bucket}/cairn-test");
    let endpoint = moto.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        dir.path(),
        &[],
        &[
            ("CAIRN_WORKER__SNAPSHOTS__DESTINATION", destination.as_str()),
            ("CAIRN_WORKER__SNAPSHOTS__ENDPOINT_URL", endpoint.as_str()),
            ("CAIRN_WORKER__SNAPSHOTS__ALLOW_HTTP", "true"),
            ("CAIRN_WORKER__SNAPSHOTS__REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", "cairn-test-key"),
            ("AWS_SECRET_ACCESS_KEY", "cairn-test-secret-never-logged"),
        ],
    );
    scenario(&server).await;
    let list = ok(cairnctl(&server.address, &["-v", "snapshots", "list"]));
    assert!(
        list.contains(&format!("s3://{bucket}/cairn-test")),
        "{list}"
    );
    assert!(!server.output().contains("cairn-test-secret-never-logged"));
    assert!(
        !dir.path().join("pp-snapshots").exists(),
        "S3 destination must not write locally"
    );
}
