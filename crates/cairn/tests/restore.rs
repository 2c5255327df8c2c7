//! Restore end to end with real `cairn` processes: seed 001's scenario (snapshot, trim, drop the
//! partition offline, start with `on-init`), trim gaps with no repository, falling back from a
//! corrupted snapshot, online restores, crashes in the middle of a restore, and the automatic
//! snapshot-and-trim cycle; against the local folder and moto's S3 server.

mod support;

use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry};
use cairn_snapshots::test_util::moto;
use std::path::Path;
use std::time::{Duration, Instant};
use support::{
    Server, assert_keys_there, cairnctl, created_id, fails, keys_of_partition, ok,
    partition_columns, put_keys, run_cairn, scrape, snapshot_object_keys, value_for,
    wait_until_started,
};

async fn client(address: &str) -> Client {
    Client::connect(address, &ClientOptions::default())
        .await
        .unwrap()
}

/// The LSN column of `snapshots create`'s snapshot, read back from `snapshots list`.
fn snapshot_lsn(address: &str, snapshot_id: &str) -> u64 {
    let list = ok(cairnctl(address, &["snapshots", "list"]));
    let row = list
        .lines()
        .find(|l| l.trim_start().starts_with(snapshot_id))
        .unwrap_or_else(|| panic!("{snapshot_id} not listed:\n{list}"));
    row.split_whitespace().nth(2).unwrap().parse().unwrap()
}

fn drop_partition_0(base_dir: &Path) {
    drop_partition_0_with(base_dir, &[], &[]);
}

/// Runs `cairn drop-partition -p 0 -y <flags>` on `base_dir`.
fn run_drop_partition_0(
    base_dir: &Path,
    flags: &[&str],
    env: &[(&str, &str)],
) -> std::process::Output {
    let mut args = vec![
        "drop-partition",
        "--base-dir",
        base_dir.to_str().unwrap(),
        "-p",
        "0",
        "-y",
    ];
    args.extend_from_slice(flags);
    run_cairn(&args, env)
}

fn drop_partition_0_with(base_dir: &Path, flags: &[&str], env: &[(&str, &str)]) {
    let stdout = ok(run_drop_partition_0(base_dir, flags, env));
    assert!(
        stdout.contains("Dropped the store of partition 0"),
        "{stdout}"
    );
}

fn with_on_init<'a>(env: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = env.to_vec();
    env.push(("CAIRN_WORKER__SNAPSHOT_RESTORE_POLICY", "on-init"));
    env
}

/// Seed 001: write, snapshot, trim, stop, drop the partition, start with `on-init`.
async fn seed_001_scenario(env: &[(&str, &str)], trim_with_create: bool) {
    let dir = tempfile::tempdir().unwrap();
    let before = keys_of_partition("before", 0, 3000);
    let after = keys_of_partition("after", 0, 300);
    let server = Server::start_with(dir.path(), &[], env);
    let a = server.address.clone();
    put_keys(&a, &before, 100).await;

    let snapshot_id = if trim_with_create {
        let out = ok(cairnctl(
            &a,
            &["snapshots", "create", "-p", "0", "--trim-log"],
        ));
        assert!(out.contains("Log 0 trimmed up to LSN"), "{out}");
        created_id(&out)
    } else {
        let id = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
        let lsn = snapshot_lsn(&a, &id).to_string();
        ok(cairnctl(&a, &["-y", "logs", "trim", "-l", "0", "-t", &lsn]));
        id
    };
    let lsn = snapshot_lsn(&a, &snapshot_id);
    // Records after the snapshot: the restore must replay them.
    put_keys(&a, &after, 10).await;
    server.stop();

    // Offline, as an operator would with the server stopped: the node holds the base dir lock.
    drop_partition_0_with(dir.path(), &[], env);

    // on-init restores the partition's missing store (the trim gap alone would too).
    let server = Server::start_with(dir.path(), &[], &with_on_init(env));
    let output = server.output();
    assert!(
        output.contains("Restoring partition from snapshot")
            && output.contains(&format!("snapshot_id={snapshot_id}"))
            && output.contains(&format!("lsn={lsn}")),
        "{output}"
    );
    assert!(
        output.contains("Initializing partition store from snapshot"),
        "{output}"
    );
    let a = server.address.clone();
    assert_keys_there(&a, &before).await;
    assert_keys_there(&a, &after).await;
    let row = partition_columns(&a, 0);
    assert_eq!(row.last().map(String::as_str), Some("active"), "{row:?}");
    // Nothing of the restore stays behind.
    assert!(!dir.path().join("restore-staging").join("0").exists());
    server.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn seed_001_restore_on_init_from_the_local_folder() {
    seed_001_scenario(&[], false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn seed_001_restore_on_init_from_an_s3_compatible_server() {
    let moto = moto::server();
    let bucket = moto.create_bucket();
    let destination = format!("s3://{bucket}/restore");
    let endpoint = moto.endpoint();
    seed_001_scenario(
        &[
            ("CAIRN_WORKER__SNAPSHOTS__DESTINATION", destination.as_str()),
            ("CAIRN_WORKER__SNAPSHOTS__ENDPOINT_URL", endpoint.as_str()),
            ("CAIRN_WORKER__SNAPSHOTS__ALLOW_HTTP", "true"),
            ("CAIRN_WORKER__SNAPSHOTS__REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", "cairn-test-key"),
            ("AWS_SECRET_ACCESS_KEY", "cairn-test-secret"),
        ],
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trim_gap_without_a_repository_keeps_the_partition_down_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let env = [("CAIRN_WORKER__SNAPSHOTS__DESTINATION", "none")];
    let keys = keys_of_partition("k", 0, 200);
    let server = Server::start_with(dir.path(), &[], &env);
    let a = server.address.clone();
    put_keys(&a, &keys, 50).await;
    let err = fails(cairnctl(&a, &["snapshots", "create", "-p", "0"]));
    assert!(err.contains("no snapshot repository"), "{err}");
    let tail = partition_columns(&a, 0)[6].clone();
    ok(cairnctl(
        &a,
        &["-y", "logs", "trim", "-l", "0", "-t", &tail, "--force"],
    ));
    // The offline tool refuses while the node runs.
    let err = fails(run_drop_partition_0(dir.path(), &[], &[]));
    assert!(err.contains("the node must be stopped"), "{err}");
    server.stop();
    // Stopped, it still refuses: the store is the only copy of the trimmed records.
    let err = fails(run_drop_partition_0(dir.path(), &[], &env));
    assert!(
        err.contains("only copy") && err.contains("--force"),
        "{err}"
    );
    drop_partition_0_with(dir.path(), &["--force"], &env);

    let server = Server::start_with(dir.path(), &[], &env);
    let a = server.address.clone();
    let client = client(&a).await;
    let err = client
        .get(vec![Bytes::from(keys[0].clone())])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("trimmed up to LSN {tail}"))
            && err.contains("no snapshot repository")
            && err.contains("worker.snapshots.destination"),
        "{err}"
    );
    let table = ok(cairnctl(&a, &["partitions", "list"]));
    assert!(table.contains("missing"), "{table}");
    // The other partitions serve.
    let elsewhere = &keys_of_partition("elsewhere", 1, 1)[0];
    wait_until_started(&a, 1);
    ok(cairnctl(&a, &["kv", "put", elsewhere, "v"]));
}

/// Keys under `ssts/` of partition 0's folder in a local repository.
fn sst_objects(repository: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(repository.join("0").join("ssts"))
        .map(|dir| {
            dir.filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupted_newest_snapshot_falls_back_to_the_older_one() {
    let dir = tempfile::tempdir().unwrap();
    let repository = dir.path().join("pp-snapshots");
    let first_keys = keys_of_partition("first", 0, 1000);
    let second_keys = keys_of_partition("second", 0, 1000);
    let tail_keys = keys_of_partition("tail", 0, 100);
    let server = Server::start(dir.path());
    let a = server.address.clone();
    put_keys(&a, &first_keys, 100).await;
    let older = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    put_keys(&a, &second_keys, 100).await;
    let newer = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    put_keys(&a, &tail_keys, 10).await;

    // Corrupt a file that only the newer snapshot has.
    let older_files = snapshot_object_keys(&a, &older);
    let victim = snapshot_object_keys(&a, &newer)
        .into_iter()
        .find(|k| !older_files.contains(k))
        .expect("the newer snapshot has a file of its own");
    let path = repository.join("0").join(&victim);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x55;
    std::fs::write(&path, bytes).unwrap();

    // Online restore pinned to the corrupted snapshot fails, names the problem, and the
    // partition keeps serving from its own store.
    let err = fails(cairnctl(
        &a,
        &[
            "-y",
            "partitions",
            "restore",
            "-p",
            "0",
            "--snapshot",
            &newer,
        ],
    ));
    assert!(err.contains("checksum") && err.contains(&newer), "{err}");
    assert_keys_there(&a, &second_keys).await;

    // Online restore of the newest suitable snapshot skips the corrupted one.
    let out = ok(cairnctl(&a, &["-y", "partitions", "restore", "-p", "0"]));
    assert!(
        out.contains(&format!("Partition 0 restored from snapshot {older}")),
        "{out}"
    );
    assert_keys_there(&a, &first_keys).await;
    assert_keys_there(&a, &second_keys).await;
    assert_keys_there(&a, &tail_keys).await;
    server.stop();

    // And at start-up, with on-init.
    drop_partition_0(dir.path());
    let server = Server::start_with(dir.path(), &[], &with_on_init(&[]));
    let output = server.output();
    assert!(
        output.contains("snapshot not used for restore")
            && output.contains(&newer)
            && output.contains(&format!("snapshot_id={older}")),
        "{output}"
    );
    let a = server.address.clone();
    assert_keys_there(&a, &first_keys).await;
    assert_keys_there(&a, &second_keys).await;
    assert_keys_there(&a, &tail_keys).await;
}

/// On a node in `dir`: writes `snapshotted` (200 keys per record), snapshots partition 0
/// (`snapshots create -p 0` with `create_args`), writes `tail` (a record per key), and stops.
#[cfg(feature = "test-hooks")]
async fn snapshot_then_tail(
    dir: &Path,
    snapshotted: &[String],
    tail: &[String],
    create_args: &[&str],
) {
    let server = Server::start(dir);
    let a = server.address.clone();
    put_keys(&a, snapshotted, 200).await;
    let mut create = vec!["snapshots", "create", "-p", "0"];
    create.extend_from_slice(create_args);
    ok(cairnctl(&a, &create));
    put_keys(&a, tail, 1).await;
    server.stop();
}

/// Kills `cairn` at each pause point of a restore in turn; the next start must repair whatever
/// was left and end with every acknowledged write. Needs the binaries built with `test-hooks`
/// (`./test.sh` builds with `--all-features`).
#[cfg(feature = "test-hooks")]
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_download_import_and_replay_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let snapshotted = keys_of_partition("snap", 0, 4000);
    // More than one read batch of records after the snapshot, so a replay can be cut short.
    let tail = keys_of_partition("tail", 0, 1500);
    snapshot_then_tail(dir.path(), &snapshotted, &tail, &["--trim-log"]).await;
    drop_partition_0(dir.path());
    let staging = dir.path().join("restore-staging");
    let on_init = with_on_init(&[]);

    let pause = |point: &'static str| {
        let mut env = on_init.clone();
        env.push(("CAIRN_PAUSE_AT", point));
        Server::start_until(dir.path(), &[], &env, &format!("paused at {point}"))
    };

    let paused = pause("restore-download");
    // The node serves while partition 0 is restored: it says so, and the others take writes.
    let a = paused.address.clone();
    assert!(!a.is_empty(), "{}", paused.output());
    let row = partition_columns(&a, 0);
    assert_eq!(row.last().map(String::as_str), Some("starting"), "{row:?}");
    let elsewhere = &keys_of_partition("elsewhere", 1, 1)[0];
    wait_until_started(&a, 1);
    ok(cairnctl(&a, &["kv", "put", elsewhere, "v"]));
    let err = fails(cairnctl(&a, &["kv", "get", &snapshotted[0]]));
    assert!(err.contains("still starting"), "{err}");
    paused.kill();
    assert!(
        staging.join("0").exists(),
        "killed with the download in the staging folder"
    );

    let paused = pause("restore-import");
    let output = paused.output();
    assert!(
        output.contains("removed a leftover restore staging folder"),
        "{output}"
    );
    paused.kill();
    assert!(staging.join("0.importing").exists(), "killed mid-import");

    let paused = pause("replay-0");
    let output = paused.output();
    assert!(
        output.contains("dropped the partial store") && output.contains("Restoring partition"),
        "{output}"
    );
    paused.kill();

    let server = Server::start_with(dir.path(), &[], &on_init);
    let a = server.address.clone();
    assert_keys_there(&a, &snapshotted).await;
    assert_keys_there(&a, &tail).await;
    assert!(!staging.join("0").exists() && !staging.join("0.importing").exists());
}

/// A SIGTERM while an online restore is held at each of its pause points (its download in the
/// staging folder; the snapshot imported, the import not yet marked complete): the node exits
/// cleanly and promptly, and the next start serves every acknowledged write of the partition.
#[cfg(feature = "test-hooks")]
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_during_an_online_restore_stops_cleanly_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let snapshotted = keys_of_partition("snap", 0, 2000);
    let tail = keys_of_partition("tail", 0, 300);
    snapshot_then_tail(dir.path(), &snapshotted, &tail, &[]).await;

    for point in ["restore-download", "restore-import"] {
        // The points hold only restores: this node starts as any other.
        let server = Server::start_with(dir.path(), &[], &[("CAIRN_PAUSE_AT", point)]);
        let a = server.address.clone();
        let restore = {
            let a = a.clone();
            std::thread::spawn(move || cairnctl(&a, &["-y", "partitions", "restore", "-p", "0"]))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !server.output().contains(&format!("paused at {point}")) {
            assert!(
                std::time::Instant::now() < deadline,
                "the restore did not reach {point}:\n{}",
                server.output()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Exits with status 0 within the bound, or the test fails.
        server.stop();
        // The client learns why, rather than seeing its connection drop.
        let err = fails(restore.join().unwrap());
        assert!(
            err.contains("the node is shutting down; the restore did not complete"),
            "{err}"
        );

        let server = Server::start(dir.path());
        let a = server.address.clone();
        wait_until_started(&a, 0);
        assert_keys_there(&a, &snapshotted).await;
        assert_keys_there(&a, &tail).await;
        server.stop();
    }
}

/// The value of the sample `name{partition="0"...}` in a scrape.
fn sample(scrape: &str, name: &str) -> Option<f64> {
    scrape
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{partition=\"0\"")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread")]
async fn automatic_snapshots_and_trimming_keep_the_log_short_and_the_data_restorable() {
    let dir = tempfile::tempdir().unwrap();
    let env = [
        (
            "CAIRN_WORKER__SNAPSHOTS__SNAPSHOT_INTERVAL_NUM_RECORDS",
            "100",
        ),
        ("CAIRN_WORKER__SNAPSHOTS__NUM_RETAINED", "2"),
        ("CAIRN_WORKER__TRIM_LOG_INTERVAL", "1s"),
        ("CAIRN_WORKER__TRIM_LOG_DELAY", "0s"),
    ];
    let keys = keys_of_partition("auto", 0, 600);
    let server = Server::start_with(dir.path(), &[], &env);
    let a = server.address.clone();
    put_keys(&a, &keys, 2).await;

    // The scheduler snapshots partition 0 at least once per 100 records and the trimmer follows
    // the archived LSN.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (trim_point, archived) = loop {
        let row = partition_columns(&a, 0);
        let trim_point: u64 = row[5].parse().unwrap();
        let archived: u64 = row[7].parse().unwrap_or(0);
        if archived >= 100 && trim_point == archived {
            break (trim_point, archived);
        }
        assert!(
            Instant::now() < deadline,
            "no automatic snapshot and trim: {row:?}\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(trim_point > 0 && archived > 0);
    let list = ok(cairnctl(&a, &["snapshots", "list", "-p", "0"]));
    let retained = list
        .lines()
        .filter(|l| l.trim_start().starts_with("snap_"))
        .count();
    assert!((1..=2).contains(&retained), "{list}");

    let metrics = scrape(&server);
    assert!(
        sample(&metrics, "cairn_snapshot_upload_bytes_total").unwrap_or(0.0) > 0.0,
        "{metrics}"
    );
    assert!(sample(&metrics, "cairn_partition_archived_lsn").unwrap_or(0.0) > 0.0);
    assert!(sample(&metrics, "cairn_log_trim_point").unwrap_or(0.0) > 0.0);
    assert!(sample(&metrics, "cairn_snapshot_newest_age_seconds").is_some());
    assert!(sample(&metrics, "cairn_partition_replay_lag_records").is_some());
    server.stop();

    // The trimmed log plus the retained snapshots hold everything.
    drop_partition_0(dir.path());
    let server = Server::start_with(dir.path(), &[], &env);
    assert!(
        server
            .output()
            .contains("Restoring partition from snapshot")
    );
    assert_keys_there(&server.address, &keys).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_deletes_what_only_evicted_snapshots_use() {
    let dir = tempfile::tempdir().unwrap();
    let repository = dir.path().join("pp-snapshots");
    let env = [("CAIRN_WORKER__SNAPSHOTS__NUM_RETAINED", "2")];
    let server = Server::start_with(dir.path(), &[], &env);
    let a = server.address.clone();
    let mut ids = Vec::new();
    for round in 0..3 {
        put_keys(
            &a,
            &keys_of_partition(&format!("round{round}"), 0, 500),
            100,
        )
        .await;
        ids.push(created_id(&ok(cairnctl(
            &a,
            &["snapshots", "create", "-p", "0"],
        ))));
        if round == 1 {
            // Both snapshots are retained; every SST either references is there.
            let mut both: Vec<String> = snapshot_object_keys(&a, &ids[0]);
            both.extend(snapshot_object_keys(&a, &ids[1]));
            let before = sst_objects(&repository);
            assert!(
                both.iter()
                    .all(|k| before.contains(&k.trim_start_matches("ssts/").to_string())),
                "{both:?} / {before:?}"
            );
        }
    }
    let first_files = {
        // The first snapshot's metadata is gone with it; what it alone used is gone too.
        let err = fails(cairnctl(&a, &["snapshots", "describe", &ids[0]]));
        assert!(err.contains("is not in the repository"), "{err}");
        sst_objects(&repository)
    };
    let mut referenced: Vec<String> = ids[1..]
        .iter()
        .flat_map(|id| snapshot_object_keys(&a, id))
        .map(|k| k.trim_start_matches("ssts/").to_string())
        .collect();
    referenced.sort();
    referenced.dedup();
    assert_eq!(
        first_files, referenced,
        "the repository holds exactly the SSTs of the retained snapshots"
    );
    let list = ok(cairnctl(&a, &["snapshots", "list", "-p", "0"]));
    let listed: Vec<&str> = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| w.starts_with("snap_"))
        .collect();
    assert_eq!(listed, vec![ids[2].as_str(), ids[1].as_str()], "{list}");
    for id in &ids[1..] {
        ok(cairnctl(&a, &["snapshots", "verify", id]));
    }
    // The archived LSN follows the oldest retained snapshot.
    let row = partition_columns(&a, 0);
    assert_eq!(row[7], snapshot_lsn(&a, &ids[1]).to_string(), "{row:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_policy_decides_between_replaying_the_whole_log_and_restoring() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of_partition("policy", 0, 500);
    let server = Server::start(dir.path());
    put_keys(&server.address, &keys, 50).await;
    ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "0"],
    ));
    server.stop();

    // policy none: the log is complete, so the partition replays it from the start.
    drop_partition_0(dir.path());
    let server = Server::start(dir.path());
    assert!(
        !server
            .output()
            .contains("Restoring partition from snapshot"),
        "{}",
        server.output()
    );
    assert_keys_there(&server.address, &keys).await;
    server.stop();

    // on-init: the same missing store comes from the snapshot.
    drop_partition_0(dir.path());
    let server = Server::start_with(dir.path(), &[], &with_on_init(&[]));
    assert!(
        server
            .output()
            .contains("Restoring partition from snapshot"),
        "{}",
        server.output()
    );
    assert_keys_there(&server.address, &keys).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_online_restore_under_writes_loses_no_acknowledged_write() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let a = server.address.clone();
    let before = keys_of_partition("before", 0, 2000);
    put_keys(&a, &before, 100).await;
    ok(cairnctl(&a, &["snapshots", "create", "-p", "0"]));

    // Writers keep going through the restore; they keep the keys the node acknowledged.
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let acked_count = std::sync::Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let a = a.clone();
            let (stop, acked_count) = (stop.clone(), acked_count.clone());
            tokio::spawn(async move {
                let client = client(&a).await;
                let mut acked = Vec::new();
                for key in keys_of_partition(&format!("during{w}"), 0, 100_000) {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let entry = PutEntry {
                        key: Bytes::from(key.clone()),
                        value: value_for(&key),
                        ttl: None,
                    };
                    if client.put(vec![entry]).await.is_ok() {
                        acked.push(key);
                        acked_count.fetch_add(1, Ordering::Relaxed);
                    } else {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                acked
            })
        })
        .collect();
    // Writes acknowledged before the restore and after it, however busy the machine is.
    let acked_more = |more: usize| {
        let acked_count = acked_count.clone();
        async move {
            let target = acked_count.load(Ordering::Relaxed) + more;
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while acked_count.load(Ordering::Relaxed) < target {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the writers did not get {more} more writes acknowledged within 60 s"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    acked_more(50).await;
    let restore = {
        let a = a.clone();
        tokio::task::spawn_blocking(move || {
            cairnctl(&a, &["-y", "partitions", "restore", "-p", "0"])
        })
    };
    let out = ok(restore.await.unwrap());
    assert!(out.contains("Partition 0 restored from snapshot"), "{out}");
    acked_more(50).await;
    stop.store(true, Ordering::Relaxed);
    let mut acked = Vec::new();
    for writer in writers {
        acked.extend(writer.await.unwrap());
    }
    assert!(
        acked.len() >= 100,
        "the writers made progress: {}",
        acked.len()
    );
    assert_keys_there(&a, &before).await;
    assert_keys_there(&a, &acked).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_of_another_cluster_of_the_same_name_is_refused() {
    let shared = tempfile::tempdir().unwrap();
    let repository = shared.path().join("repository");
    let destination = repository.to_str().unwrap().to_string();
    let env = [("CAIRN_WORKER__SNAPSHOTS__DESTINATION", destination.as_str())];

    // The first cluster snapshots partition 0 at a low LSN.
    let first = tempfile::tempdir().unwrap();
    let theirs = keys_of_partition("theirs", 0, 100);
    let server = Server::start_with(first.path(), &[], &env);
    put_keys(&server.address, &theirs, 10).await;
    let snapshot = created_id(&ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "0"],
    )));
    server.stop();

    // A new cluster of the same name on a fresh base dir, same repository, and a longer log:
    // the LSNs match up, the records do not.
    let second = tempfile::tempdir().unwrap();
    let ours = keys_of_partition("ours", 0, 300);
    let server = Server::start_with(second.path(), &[], &env);
    put_keys(&server.address, &ours, 10).await;
    server.stop();
    drop_partition_0_with(second.path(), &[], &env);

    let server = Server::start_with(second.path(), &[], &with_on_init(&env));
    let output = server.output();
    assert!(
        output.contains(&snapshot) && output.contains("of another cluster"),
        "{output}"
    );
    // It replayed its own complete log instead.
    assert_keys_there(&server.address, &ours).await;
    let client = client(&server.address).await;
    let values = client
        .get(vec![Bytes::from(theirs[0].clone())])
        .await
        .unwrap();
    assert_eq!(
        values,
        vec![None],
        "the other cluster's data must not appear"
    );
}

/// A trim of the log up to what the partition applied, and an online restore to an older
/// snapshot, at the same moment. The trim checks the old store and then cuts the log; had the
/// restore replaced the store in between, the cut would take the records the restored store must
/// replay, with the old store that held them gone. One of them must wait for the other: whichever
/// wins, the partition serves every acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trim_racing_an_online_restore_to_an_older_snapshot_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let a = server.address.clone();
    let first = keys_of_partition("first", 0, 50);
    put_keys(&a, &first, 10).await;
    let snapshot = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    let client = client(&a).await;
    // Enough in the store's memtable that the flush before the trim takes a while.
    let later = keys_of_partition("later", 0, 3000);
    for chunk in later.chunks(20) {
        let entries = chunk
            .iter()
            .map(|k| PutEntry {
                key: Bytes::from(k.clone()),
                value: Bytes::from(vec![b'x'; 10_000]),
                ttl: None,
            })
            .collect();
        client.put(entries).await.unwrap();
    }
    let applied: u64 = partition_columns(&a, 0)[4].parse().unwrap();
    let trim = tokio::spawn({
        let client = client.clone();
        async move { client.trim_log(0, applied, true).await }
    });
    tokio::time::sleep(Duration::from_millis(2)).await;
    let restored = async {
        let mut stream = client.restore_partition(0, Some(snapshot)).await?;
        while stream
            .message()
            .await
            .map_err(|s| s.to_string())
            .is_ok_and(|m| m.is_some())
        {}
        Ok::<_, cairn_client::Error>(())
    }
    .await;
    let trimmed = trim.await.unwrap();
    let columns = partition_columns(&a, 0);
    assert_eq!(
        columns[8], "active",
        "{columns:?}\ntrim: {trimmed:?}\nrestore: {restored:?}"
    );
    assert_keys_there(&a, &first).await;
    for chunk in later.chunks(500) {
        let values = client
            .get(chunk.iter().map(|k| Bytes::from(k.clone())).collect())
            .await
            .unwrap();
        assert!(
            values
                .iter()
                .all(|v| v.as_ref().is_some_and(|v| v.len() == 10_000)),
            "acknowledged writes lost; trim: {trimmed:?}"
        );
    }
}
