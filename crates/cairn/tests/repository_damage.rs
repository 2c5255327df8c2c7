//! A damaged or shared snapshot repository, with real `cairn` processes: a cluster re-created on
//! a deleted base dir next to the old cluster's snapshots, a byte flipped in a stored SST, a
//! publish killed in the middle of an upload, a `latest.json` that cannot be read, a store that
//! lost a table file, and one with a damaged table file.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};
use support::{
    Server, assert_keys_there, cairnctl, created_id, fails, get_keys, keys_of_partition, ok,
    partition_columns, put_keys, run_drop_partition, snapshot_object_keys,
};

/// Column of `partitions list` with the archived LSN.
const ARCHIVED: usize = 7;
const TAIL: usize = 6;
const TRIM_POINT: usize = 5;

fn on_init<'a>(env: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = env.to_vec();
    env.push(("CAIRN_WORKER__SNAPSHOT_RESTORE_POLICY", "on-init"));
    env
}

/// The snapshot ids that partition 0's `latest.json` retains, whichever cluster took them.
fn retained_in_latest_json(repository: &Path) -> Vec<String> {
    let latest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repository.join("0").join("latest.json")).unwrap())
            .unwrap();
    latest["retained"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["snapshot_id"].as_str().unwrap().to_string())
        .collect()
}

/// Issue 8, item 3: delete the base dir, start again with the same cluster name and repository,
/// write 50 keys. Nothing of the old cluster's snapshots may count for the new one.
#[tokio::test(flavor = "multi_thread")]
async fn a_recreated_cluster_does_not_trust_the_old_clusters_snapshots() {
    let shared = tempfile::tempdir().unwrap();
    let repository = shared.path().join("repository");
    let destination = repository.to_str().unwrap().to_string();
    let env = [("CAIRN_WORKER__SNAPSHOTS__DESTINATION", destination.as_str())];
    let base = tempfile::tempdir().unwrap();

    // The old cluster: 300 records in partition 0, snapshotted.
    let theirs = keys_of_partition("theirs", 0, 300);
    let server = Server::start_with(base.path(), &[], &env);
    put_keys(&server.address, &theirs, 1).await;
    let old_snapshot = created_id(&ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "0"],
    )));
    let old_archived: u64 = partition_columns(&server.address, 0)[ARCHIVED]
        .parse()
        .unwrap();
    assert!(old_archived >= 300);
    server.stop();

    // The base dir is deleted; the same cluster name starts on it with the same repository.
    std::fs::remove_dir_all(base.path()).unwrap();
    std::fs::create_dir_all(base.path()).unwrap();
    let ours = keys_of_partition("ours", 0, 50);
    let server = Server::start_with(base.path(), &[], &env);
    let a = server.address.clone();
    put_keys(&a, &ours, 1).await;

    // No archived LSN: the old cluster's snapshot covers none of the new cluster's records.
    let row = partition_columns(&a, 0);
    assert_eq!(row[ARCHIVED], "-", "{row:?}");
    let tail = row[TAIL].clone();
    assert!(tail.parse::<u64>().unwrap() < old_archived, "{row:?}");

    // Trimming past what this cluster archived is refused without --force.
    let err = fails(cairnctl(
        &a,
        &["-y", "logs", "trim", "-l", "0", "-t", &tail],
    ));
    assert!(
        err.contains("no snapshot covers log 0") && err.contains("--force"),
        "{err}"
    );
    ok(cairnctl(
        &a,
        &["-y", "logs", "trim", "-l", "0", "-t", &tail, "--force"],
    ));
    server.stop();

    // The store is the only copy of the trimmed records: dropping it is refused, whatever the
    // old cluster's snapshot claims to cover.
    let err = fails(run_drop_partition(base.path(), 0, &env));
    assert!(
        err.contains("only copy") && err.contains("--force"),
        "{err}"
    );

    // A snapshot request makes a new snapshot instead of pointing at the old one.
    let server = Server::start_with(base.path(), &[], &env);
    let a = server.address.clone();
    let out = ok(cairnctl(&a, &["snapshots", "create", "-p", "0"]));
    let new_snapshot = created_id(&out);
    assert_ne!(new_snapshot, old_snapshot);
    let row = partition_columns(&a, 0);
    let archived: u64 = row[ARCHIVED].parse().unwrap();
    assert!(
        archived >= tail.parse().unwrap() && archived < old_archived,
        "the new snapshot's LSN: {row:?}"
    );
    let list = ok(cairnctl(&a, &["snapshots", "list", "-p", "0"]));
    assert!(
        list.contains(&new_snapshot) && !list.contains(&old_snapshot),
        "{list}"
    );
    assert_keys_there(&a, &ours).await;
    // The old snapshot is refused by name, as the other cluster's, not as missing.
    let err = fails(cairnctl(&a, &["snapshots", "verify", &old_snapshot]));
    assert!(
        err.contains("taken by another cluster sharing it") && err.contains("partition 0"),
        "{err}"
    );
    server.stop();

    // Nothing is lost after a restart, nor after dropping the store and restoring it; the old
    // cluster's data never appears.
    let dropped = ok(run_drop_partition(base.path(), 0, &env));
    assert!(
        dropped.contains("Dropped the store of partition 0"),
        "{dropped}"
    );
    let server = Server::start_with(base.path(), &[], &on_init(&env));
    assert!(
        server
            .output()
            .contains(&format!("snapshot_id={new_snapshot}")),
        "{}",
        server.output()
    );
    assert_keys_there(&server.address, &ours).await;
    let leaked = get_keys(&server.address, &theirs[..10]).await;
    assert!(leaked.iter().all(Option::is_none), "{leaked:?}");
    server.stop();

    // The old cluster's snapshot is still kept in the shared latest.json, and whole.
    let retained = retained_in_latest_json(&repository);
    assert!(
        retained.contains(&old_snapshot) && retained.contains(&new_snapshot),
        "{retained:?}"
    );
}

/// Issue 8, item 4: a byte flips in a stored SST; the next snapshot, which shares the file,
/// must upload it again rather than be "created" unreadable while the archived LSN advances.
#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_stored_sst_is_uploaded_again_by_the_next_snapshot() {
    let base = tempfile::tempdir().unwrap();
    let repository = base.path().join("pp-snapshots");
    let first_keys = keys_of_partition("first", 0, 1000);
    let second_keys = keys_of_partition("second", 0, 300);
    let server = Server::start(base.path());
    let a = server.address.clone();
    put_keys(&a, &first_keys, 100).await;
    let first = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    put_keys(&a, &second_keys, 100).await;

    // Flip a byte in the middle of one of the first snapshot's objects, in place.
    let victim = snapshot_object_keys(&a, &first)[0].clone();
    flip_middle_byte(&repository.join("0").join(&victim));
    assert!(fails(cairnctl(&a, &["snapshots", "verify", &first])).contains("checksum"));

    let second = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    assert!(
        snapshot_object_keys(&a, &second).contains(&victim),
        "the second snapshot shares the file"
    );
    ok(cairnctl(&a, &["snapshots", "verify", &second]));
    // The object is whole again, for the first snapshot too.
    ok(cairnctl(&a, &["snapshots", "verify", &first]));
    server.stop();

    let dropped = ok(run_drop_partition(base.path(), 0, &[]));
    assert!(dropped.contains("Dropped"), "{dropped}");
    let server = Server::start_with(base.path(), &[], &on_init(&[]));
    let output = server.output();
    assert!(
        output.contains(&format!("snapshot_id={second}"))
            && !output.contains("snapshot not used for restore"),
        "{output}"
    );
    assert_keys_there(&server.address, &first_keys).await;
    assert_keys_there(&server.address, &second_keys).await;
}

/// An object checked when a snapshot first reused it can rot after: a create with `--trim-log`
/// reads the whole new snapshot back before it gives up the log, and trims nothing if that fails.
#[tokio::test(flavor = "multi_thread")]
async fn a_trim_with_create_reads_the_snapshot_back_first() {
    let base = tempfile::tempdir().unwrap();
    let repository = base.path().join("pp-snapshots");
    let first_keys = keys_of_partition("first", 0, 1000);
    let server = Server::start(base.path());
    let a = server.address.clone();
    put_keys(&a, &first_keys, 100).await;
    let first = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    put_keys(&a, &keys_of_partition("second", 0, 300), 100).await;
    // Reuses the first snapshot's objects, and checks them once.
    let second = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    let victim = snapshot_object_keys(&a, &first)[0].clone();
    assert!(snapshot_object_keys(&a, &second).contains(&victim));

    // Rot: same size, same modification time, so nothing but its bytes shows it.
    let path = repository.join("0").join(&victim);
    let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
    flip_middle_byte(&path);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(modified)
        .unwrap();
    put_keys(&a, &keys_of_partition("third", 0, 300), 100).await;
    let trim_point = partition_columns(&a, 0)[TRIM_POINT].clone();

    let refused = fails(cairnctl(
        &a,
        &["snapshots", "create", "-p", "0", "--trim-log"],
    ));
    assert!(refused.contains("the log was not trimmed"), "{refused}");
    assert!(refused.contains("checksum"), "{refused}");
    assert!(refused.contains(&victim), "names the object: {refused}");
    assert_eq!(partition_columns(&a, 0)[TRIM_POINT], trim_point);
    server.stop();
}

/// Flips a bit of the byte in the middle of `path`, in place: the file keeps its size.
fn flip_middle_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

/// Staged copies (`<object>#<digits>`) in a local repository's `ssts` folder.
fn staged_copies(repository: &Path) -> Vec<String> {
    std::fs::read_dir(repository.join("0").join("ssts"))
        .map(|entries| {
            entries
                .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .filter(|name| name.contains('#'))
                .collect()
        })
        .unwrap_or_default()
}

/// Issue 8, item 6: a node killed in the middle of uploading an SST to a local repository
/// leaves its staged copy; the next publish's garbage collection sweeps it once it is older
/// than the grace period.
#[tokio::test(flavor = "multi_thread")]
async fn staged_uploads_of_a_killed_publish_are_swept() {
    let base = tempfile::tempdir().unwrap();
    let repository = base.path().join("pp-snapshots");
    // A slow upload in parts: the staged copy stays in place for seconds.
    let slow = [
        (
            "CAIRN_WORKER__SNAPSHOTS__RATE_LIMIT_BYTES_PER_SECOND",
            "1000000",
        ),
        (
            "CAIRN_WORKER__SNAPSHOTS__MULTIPART_THRESHOLD_BYTES",
            "5242880",
        ),
    ];
    let server = Server::start_with(base.path(), &[], &slow);
    let a = server.address.clone();
    let keys = keys_of_partition("big", 0, 12);
    {
        use rand::RngCore;
        let client = cairn_client::Client::connect(&a, &cairn_client::ClientOptions::default())
            .await
            .unwrap();
        for key in &keys {
            let mut value = vec![0u8; 1024 * 1024];
            rand::rng().fill_bytes(&mut value);
            client
                .put(vec![cairn_client::PutEntry {
                    key: bytes::Bytes::from(key.clone()),
                    value: bytes::Bytes::from(value),
                    ttl: None,
                }])
                .await
                .unwrap();
        }
    }
    let create = {
        let a = a.clone();
        std::thread::spawn(move || cairnctl(&a, &["snapshots", "create", "-p", "0"]))
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while staged_copies(&repository).is_empty() {
        assert!(
            Instant::now() < deadline,
            "no upload started:\n{}",
            server.output()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    server.kill();
    let _ = create.join();
    let leftovers = staged_copies(&repository);
    assert!(!leftovers.is_empty());

    // Restarted with no grace period: the next publish sweeps what the killed one left.
    let env = [("CAIRN_WORKER__SNAPSHOTS__ORPHAN_GRACE_PERIOD", "0s")];
    let server = Server::start_with(base.path(), &[], &env);
    let a = server.address.clone();
    let snapshot = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    assert_eq!(
        staged_copies(&repository),
        Vec::<String>::new(),
        "{leftovers:?}"
    );
    ok(cairnctl(&a, &["snapshots", "verify", &snapshot]));
    let values = get_keys(&a, &keys).await;
    assert!(
        values
            .iter()
            .all(|v| v.as_ref().is_some_and(|v| v.len() == 1024 * 1024))
    );
}

/// Issue 8, item 9: one partition's unreadable `latest.json` must not hide the snapshots of the
/// others, nor stop their verification.
#[tokio::test(flavor = "multi_thread")]
async fn an_unreadable_latest_json_spoils_only_its_own_partition() {
    let base = tempfile::tempdir().unwrap();
    let repository = base.path().join("pp-snapshots");
    let server = Server::start(base.path());
    let a = server.address.clone();
    let mut ids = Vec::new();
    for partition in [0u16, 1, 2] {
        put_keys(&a, &keys_of_partition("k", partition, 20), 10).await;
        ids.push(created_id(&ok(cairnctl(
            &a,
            &["snapshots", "create", "-p", &partition.to_string()],
        ))));
    }
    let archived = partition_columns(&a, 1)[ARCHIVED].clone();
    let trim_point = partition_columns(&a, 1)[TRIM_POINT].clone();
    std::fs::write(repository.join("1").join("latest.json"), b"{ not json").unwrap();

    // The archived LSN read before the damage stands for snapshots that cannot be read now: a
    // trim must not go by it.
    let refused = fails(cairnctl(
        &a,
        &["-y", "logs", "trim", "-l", "1", "-t", &archived],
    ));
    assert!(
        refused.contains("what its snapshots cover cannot be read now")
            && refused.contains("Nothing was trimmed"),
        "{refused}"
    );
    assert_eq!(partition_columns(&a, 1)[TRIM_POINT], trim_point);

    let listed = cairnctl(&a, &["snapshots", "list"]);
    let stdout = support::stdout(&listed);
    let stderr = support::stderr(&listed);
    assert!(
        stdout.contains(&ids[0]) && stdout.contains(&ids[2]) && !stdout.contains(&ids[1]),
        "{stdout}"
    );
    assert!(
        stderr.contains("partition 1") && stderr.contains("1/latest.json"),
        "{stderr}"
    );
    assert!(!listed.status.success(), "a damaged partition is an error");
    ok(cairnctl(&a, &["snapshots", "verify", &ids[2]]));
    let err = fails(cairnctl(&a, &["snapshots", "verify", &ids[1]]));
    assert!(err.contains("partition(s) 1 could not be read"), "{err}");

    // A latest.json past the size bound is refused naming it, not read.
    let huge = vec![b' '; 2 * 1024 * 1024];
    std::fs::write(repository.join("2").join("latest.json"), huge).unwrap();
    let err = fails(cairnctl(&a, &["snapshots", "list", "-p", "2"]));
    assert!(err.contains("1048576 bytes"), "{err}");
}

/// Issue 8, item 9: a stored SST far larger than its metadata says (here a sparse file of
/// 64 GiB, which takes no disk) is refused by a restore at once: nothing is copied past the
/// declared size, and the partition keeps serving from its own store.
#[tokio::test(flavor = "multi_thread")]
async fn a_restore_refuses_an_object_larger_than_declared_without_copying_it() {
    let base = tempfile::tempdir().unwrap();
    let repository = base.path().join("pp-snapshots");
    let keys = keys_of_partition("k", 0, 200);
    let server = Server::start(base.path());
    let a = server.address.clone();
    put_keys(&a, &keys, 20).await;
    let snapshot = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    let victim = snapshot_object_keys(&a, &snapshot)[0].clone();
    let path = repository.join("0").join(&victim);
    let declared = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(64 * 1024 * 1024 * 1024)
        .unwrap();

    let started = Instant::now();
    let err = fails(cairnctl(&a, &["-y", "partitions", "restore", "-p", "0"]));
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(
        err.contains(&format!(
            "larger than its declared size of {declared} bytes"
        )),
        "{err}"
    );
    let staged: u64 = std::fs::read_dir(base.path().join("restore-staging"))
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);
    assert!(staged <= declared + 1, "{staged} bytes staged");
    assert_keys_there(&a, &keys).await;
}

/// One retained snapshot whose `metadata.json` is gone must not hide the partition's other
/// snapshots, including the ones published after it: `snapshots list` shows them, names the bad
/// one on stderr and exits non-zero.
#[tokio::test(flavor = "multi_thread")]
async fn a_missing_metadata_json_hides_only_its_own_snapshot() {
    let base = tempfile::tempdir().unwrap();
    let repository = base.path().join("pp-snapshots");
    let server = Server::start(base.path());
    let a = server.address.clone();
    let mut ids = Vec::new();
    for round in 0..3 {
        put_keys(&a, &keys_of_partition(&format!("r{round}"), 0, 20), 10).await;
        ids.push(created_id(&ok(cairnctl(
            &a,
            &["snapshots", "create", "-p", "0"],
        ))));
    }
    let folders = repository.join("0").join("snapshots");
    let damaged = std::fs::read_dir(&folders)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(&ids[1]))
        .unwrap();
    std::fs::remove_file(damaged.join("metadata.json")).unwrap();

    put_keys(&a, &keys_of_partition("after", 0, 20), 10).await;
    let after = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    let listed = cairnctl(&a, &["snapshots", "list", "-p", "0"]);
    let stdout = support::stdout(&listed);
    let stderr = support::stderr(&listed);
    for id in [&ids[0], &ids[2], &after] {
        assert!(stdout.contains(id.as_str()), "{id} not listed:\n{stdout}");
    }
    assert!(!stdout.contains(&ids[1]), "{stdout}");
    assert!(
        stderr.contains(&ids[1]) && stderr.contains("metadata.json is missing"),
        "{stderr}"
    );
    assert!(!listed.status.success());
    ok(cairnctl(&a, &["snapshots", "verify", &after]));
}

/// A base dir put back from an older copy of itself (same cluster): the repository holds this
/// cluster's snapshots of records the log no longer has, and the log goes on with other records
/// at those LSNs. Those snapshots cover nothing of it: no "already covered", no trim or drop on
/// their strength.
#[tokio::test(flavor = "multi_thread")]
async fn a_base_dir_put_back_from_an_older_copy_does_not_trust_newer_snapshots() {
    let shared = tempfile::tempdir().unwrap();
    let repository = shared.path().join("repository");
    let destination = repository.to_str().unwrap().to_string();
    let env = [("CAIRN_WORKER__SNAPSHOTS__DESTINATION", destination.as_str())];
    let base = tempfile::tempdir().unwrap();
    let copy = shared.path().join("copy");

    let before = keys_of_partition("before", 0, 5);
    let server = Server::start_with(base.path(), &[], &env);
    put_keys(&server.address, &before, 1).await;
    server.stop();
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(base.path())
        .arg(&copy)
        .status()
        .unwrap();
    assert!(copied.success());

    // The lost future: 30 more records, snapshotted.
    let lost = keys_of_partition("lost", 0, 30);
    let server = Server::start_with(base.path(), &[], &env);
    put_keys(&server.address, &lost, 1).await;
    let newer = created_id(&ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "0"],
    )));
    let newer_lsn: u64 = partition_columns(&server.address, 0)[ARCHIVED]
        .parse()
        .unwrap();
    server.stop();

    // The old copy is put back, and the node goes on from it.
    std::fs::remove_dir_all(base.path()).unwrap();
    let put_back = std::process::Command::new("cp")
        .arg("-a")
        .arg(&copy)
        .arg(base.path())
        .status()
        .unwrap();
    assert!(put_back.success());
    let after = keys_of_partition("after", 0, 2);
    let server = Server::start_with(base.path(), &[], &env);
    let a = server.address.clone();
    put_keys(&a, &after, 1).await;
    let tail: u64 = partition_columns(&a, 0)[TAIL].parse().unwrap();
    assert!(tail < newer_lsn, "tail {tail}, snapshot at {newer_lsn}");

    // Trimming on the strength of the newer snapshot is refused.
    let err = fails(cairnctl(
        &a,
        &["-y", "logs", "trim", "-l", "0", "-t", &tail.to_string()],
    ));
    assert!(
        err.contains("past this log's tail") && err.contains("--force"),
        "{err}"
    );

    // A snapshot request neither answers that the newer snapshot covers it nor publishes an
    // older one over it: it says what happened and what to do.
    let err = fails(cairnctl(&a, &["snapshots", "create", "-p", "0"]));
    assert!(
        err.contains("past this log's tail") && err.contains(&newer),
        "{err}"
    );
    // Trimmed anyway: the store is now the only copy of those records. Dropping it is refused,
    // since a restore would refuse the only snapshot, which is past the log's tail.
    ok(cairnctl(
        &a,
        &[
            "-y",
            "logs",
            "trim",
            "-l",
            "0",
            "-t",
            &tail.to_string(),
            "--force",
        ],
    ));
    server.stop();
    let err = fails(run_drop_partition(base.path(), 0, &env));
    assert!(
        err.contains("past the log's tail") && err.contains("--force"),
        "{err}"
    );
    let server = Server::start_with(base.path(), &[], &env);
    let a = server.address.clone();
    assert_keys_there(&a, &before).await;
    assert_keys_there(&a, &after).await;
    server.stop();
}

/// A table file of a partition's store is lost (a file-system fault): the node starts and the
/// other partitions serve, while that partition stays down saying what is wrong and how to rebuild
/// it; the restore it names brings back every key.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_missing_a_table_file_keeps_only_its_partition_down() {
    let base = tempfile::tempdir().unwrap();
    let keys = keys_of_partition("kept", 0, 1000);
    let later = keys_of_partition("later", 0, 100);
    snapshot_between(base.path(), &keys, &later).await;
    let folder = partition_folder(base.path(), 0);
    let table = std::fs::read_dir(&folder)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.extension().is_some_and(|e| e == "sst"))
        .expect("a table file");
    std::fs::remove_file(&table).unwrap();

    let server = Server::start(base.path());
    let a = server.address.clone();
    let listed = ok(cairnctl(&a, &["partitions", "list"]));
    assert!(listed.contains("damaged or missing"), "{listed}");
    assert!(
        listed.contains("cairnctl -y partitions restore -p 0"),
        "{listed}"
    );
    assert!(listed.contains(&folder.display().to_string()), "{listed}");
    let others = keys_of_partition("other", 1, 100);
    put_keys(&a, &others, 100).await;
    assert_keys_there(&a, &others).await;

    ok(cairnctl(&a, &["-y", "partitions", "restore", "-p", "0"]));
    assert_keys_there(&a, &keys).await;
    assert_keys_there(&a, &later).await;
    assert!(!folder.exists(), "the damaged store was replaced");
    server.stop();
}

/// Starts a node on `base`, writes `first`, snapshots partition 0, writes `later` and stops the
/// node, which flushes its memtables: the store is all in table files. Returns the snapshot's id.
async fn snapshot_between(base: &Path, first: &[String], later: &[String]) -> String {
    let server = Server::start(base);
    put_keys(&server.address, first, 100).await;
    let id = created_id(&ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "0"],
    )));
    put_keys(&server.address, later, 100).await;
    server.stop();
    id
}

/// The folder of partition `id`'s database in the store of `base`.
fn partition_folder(base: &Path, id: u16) -> std::path::PathBuf {
    std::fs::read_dir(base.join("db"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| {
            let name = path.file_name().unwrap().to_string_lossy();
            name.strip_prefix(&format!("partition-{id}."))
                .is_some_and(|generation| generation.parse::<u64>().is_ok())
        })
        .expect("the partition's folder")
}

/// Flips a bit in the middle of the largest table file of partition 0's store in `base` (the
/// server stopped). Returns the file's name.
fn damage_the_largest_table(base: &Path) -> String {
    let table = std::fs::read_dir(partition_folder(base, 0))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "sst"))
        .max_by_key(|path| std::fs::metadata(path).unwrap().len())
        .expect("a table file");
    flip_middle_byte(&table);
    table.file_name().unwrap().to_str().unwrap().to_string()
}

/// A bit flipped in a table file of the store, where nothing has read it yet: a snapshot would
/// carry it into the repository under checksums computed over the damage, and a trim could then
/// drop the only good copy from the log. The snapshot is refused instead, naming the file, and
/// the restore it names rebuilds the partition with every key.
#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_of_a_damaged_table_file_is_refused() {
    let base = tempfile::tempdir().unwrap();
    let repository = base.path().join("pp-snapshots");
    let (first, later) = (
        keys_of_partition("first", 0, 1000),
        keys_of_partition("later", 0, 200),
    );
    let sound = snapshot_between(base.path(), &first, &later).await;
    let name = damage_the_largest_table(base.path());

    let server = Server::start(base.path());
    let a = server.address.clone();
    let refused = fails(cairnctl(
        &a,
        &["snapshots", "create", "-p", "0", "--trim-log"],
    ));
    assert!(refused.contains("no snapshot was taken"), "{refused}");
    assert!(
        refused.contains(&format!("table file {name} of partition 0 is damaged")),
        "names the file: {refused}"
    );
    assert!(
        refused.contains("cairnctl -y partitions restore -p 0"),
        "{refused}"
    );
    assert_eq!(retained_in_latest_json(&repository), vec![sound.clone()]);

    ok(cairnctl(&a, &["-y", "partitions", "restore", "-p", "0"]));
    assert_keys_there(&a, &first).await;
    assert_keys_there(&a, &later).await;
    let next = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    assert_ne!(next, sound);
    server.stop();
}

/// With no snapshot to restore, the refusal names the rebuild from the log, and that works.
#[tokio::test(flavor = "multi_thread")]
async fn a_damaged_table_file_with_no_snapshot_names_the_rebuild_from_the_log() {
    let base = tempfile::tempdir().unwrap();
    let keys = keys_of_partition("only", 0, 1000);
    let server = Server::start(base.path());
    put_keys(&server.address, &keys, 100).await;
    server.stop();
    damage_the_largest_table(base.path());

    let server = Server::start(base.path());
    let refused = fails(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "0"],
    ));
    assert!(refused.contains("no snapshot was taken"), "{refused}");
    assert!(refused.contains("cairn drop-partition -p 0"), "{refused}");
    assert!(!refused.contains("partitions restore"), "{refused}");
    server.stop();

    ok(run_drop_partition(base.path(), 0, &[]));
    let server = Server::start(base.path());
    assert_keys_there(&server.address, &keys).await;
    ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "0"],
    ));
    server.stop();
}

/// A compaction that meets the damaged block stops the partition's database (RocksDB's
/// background error), and only that one: the other partitions go on taking writes. A restore
/// replaces the stopped database without a restart and brings back every key.
#[tokio::test(flavor = "multi_thread")]
async fn a_damaged_block_stops_one_partition_and_a_restore_brings_it_back() {
    let base = tempfile::tempdir().unwrap();
    let keys = keys_of_partition("kept", 0, 1000);
    snapshot_between(base.path(), &keys, &keys_of_partition("more", 0, 100)).await;
    damage_the_largest_table(base.path());

    let server = Server::start(base.path());
    let a = server.address.clone();
    fails(cairnctl(&a, &["partitions", "compact", "-p", "0"]));
    let others = keys_of_partition("other", 1, 200);
    put_keys(&a, &others, 100).await;
    assert_keys_there(&a, &others).await;

    ok(cairnctl(&a, &["-y", "partitions", "restore", "-p", "0"]));
    assert_keys_there(&a, &keys).await;
    assert_keys_there(&a, &keys_of_partition("more", 0, 100)).await;
    let after = keys_of_partition("after", 0, 100);
    put_keys(&a, &after, 100).await;
    assert_keys_there(&a, &after).await;
    server.stop();

    let server = Server::start(base.path());
    assert_keys_there(&server.address, &after).await;
    assert_keys_there(&server.address, &others).await;
    server.stop();
}
