//! Snapshot publishes and exports as an operator meets them on a large partition: a publish is
//! the node's task, which no client timeout or disconnect cancels; exports of one snapshot run
//! side by side, each whole, and leave nothing behind.
//!
//! A real `cairn` with one partition; a rate limit on uploads makes a publish of about 1 MB take
//! seconds, as a large partition does on a real link.

mod support;

use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{Server, cairnctl, created_id, ok};

/// Upload rate that makes publishing [`BATCH_BYTES`] take about 5 s.
const RATE_BYTES_PER_SECOND: &str = "200000";
/// Incompressible bytes written before each snapshot.
const BATCH_BYTES: usize = 1024 * 1024;

fn start(dir: &Path, rate_limited: bool) -> Server {
    let mut env = vec![("CAIRN_NUM_PARTITIONS", "1")];
    if rate_limited {
        env.push((
            "CAIRN_WORKER__SNAPSHOTS__RATE_LIMIT_BYTES_PER_SECOND",
            RATE_BYTES_PER_SECOND,
        ));
    }
    Server::start_with(dir, &[], &env)
}

/// Writes `bytes` of random values under keys starting with `prefix`.
fn write_random(address: &str, prefix: &str, bytes: usize) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let client = Client::connect(address, &ClientOptions::default())
            .await
            .unwrap();
        let value_bytes = 256 * 1024;
        let entries = (0..bytes.div_ceil(value_bytes))
            .map(|i| PutEntry {
                key: Bytes::from(format!("{prefix}-{i}")),
                value: Bytes::from(
                    (0..value_bytes)
                        .map(|_| rand::random::<u8>())
                        .collect::<Vec<_>>(),
                ),
                ttl: None,
            })
            .collect();
        client.put(entries).await.unwrap();
    });
}

/// Polls `check` every 100 ms until it holds, for at most `limit`.
#[track_caller]
fn wait_until(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Snapshot ids that `snapshots list -p 0` shows.
fn listed(address: &str) -> Vec<String> {
    ok(cairnctl(address, &["snapshots", "list", "-p", "0"]))
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

#[test]
fn a_publish_outlives_short_timeouts_and_clients_that_go_away() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), true);
    let a = server.address.clone();

    // The request timeout bounds calls that answer at once; a publish of seconds still completes.
    write_random(&a, "first", BATCH_BYTES);
    let started = Instant::now();
    let out = ok(cairnctl(
        &a,
        &[
            "--request-timeout",
            "1000",
            "snapshots",
            "create",
            "-p",
            "0",
        ],
    ));
    assert!(
        started.elapsed() > Duration::from_secs(2),
        "the publish was expected to take seconds ({:?})",
        started.elapsed()
    );
    let first = created_id(&out);
    assert_eq!(listed(&a), vec![first.clone()]);

    // A client killed mid-publish: the snapshot is published all the same.
    write_random(&a, "second", BATCH_BYTES);
    let mut client = Command::new(env!("CARGO_BIN_EXE_cairnctl"))
        .args(["--address", &a, "snapshots", "create", "-p", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until(Duration::from_secs(30), "the second export", || {
        server
            .output()
            .matches("Partition snapshot written")
            .count()
            == 2
    });
    client.kill().unwrap();
    client.wait().unwrap();
    assert_eq!(
        server
            .output()
            .matches("Partition snapshot published")
            .count(),
        1,
        "the client was meant to go away mid-publish"
    );
    wait_until(Duration::from_secs(60), "the abandoned publish", || {
        listed(&a).len() == 2
    });
    let second = listed(&a)
        .into_iter()
        .find(|id| *id != first)
        .expect("a second snapshot");
    ok(cairnctl(&a, &["snapshots", "verify", &second]));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_create_while_one_publishes_says_it_waits_and_then_completes() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), true);
    let a = server.address.clone();
    let writer = a.clone();
    tokio::task::spawn_blocking(move || write_random(&writer, "data", BATCH_BYTES))
        .await
        .unwrap();
    let client = Client::connect(&a, &ClientOptions::default())
        .await
        .unwrap();
    let mut running = client.create_snapshot(0, None, false).await.unwrap();
    // Once the partition is exported, its upload takes seconds.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !server.output().contains("Partition snapshot written") {
        assert!(Instant::now() < deadline, "the publish did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut waiting = client.create_snapshot(0, None, false).await.unwrap();
    let note = waiting.message().await.unwrap().expect("a first message");
    assert_eq!(note.phase, "waiting", "{note:?}");
    assert!(note.message.contains("partition 0"), "{note:?}");

    let mut last = None;
    while let Some(progress) = running.message().await.unwrap() {
        last = progress.done;
    }
    let created = last.expect("the publish ends with what it published");
    assert!(created.created && created.total_bytes >= BATCH_BYTES as u64);
    let mut joined = None;
    while let Some(progress) = waiting.message().await.unwrap() {
        joined = progress.done;
    }
    // Nothing was written in between: the snapshot just published covers the second request.
    let joined = joined.expect("the second call ends with a snapshot");
    assert_eq!(joined.snapshot_id, created.snapshot_id);
    assert!(!joined.created);
}

#[test]
fn concurrent_exports_of_one_snapshot_are_identical_and_whole() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), false);
    let a = server.address.clone();
    write_random(&a, "data", 6 * BATCH_BYTES);
    let id = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));

    let out = tempfile::tempdir().unwrap();
    // A file of someone else's where the old export put its temporary file.
    let unrelated = out.path().join("export-0.partial");
    std::fs::write(&unrelated, b"not cairn's").unwrap();
    let exports: Vec<_> = (0..3)
        .map(|i| {
            let tar = out.path().join(format!("export-{i}.tar"));
            let child = Command::new(env!("CARGO_BIN_EXE_cairnctl"))
                .args(["--address", &a, "snapshots", "export", &id, "-o"])
                .arg(&tar)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            (tar, child)
        })
        .collect();
    let mut tars = Vec::new();
    for (tar, child) in exports {
        let stdout = ok(child.wait_with_output().unwrap());
        assert!(
            stdout.contains("every size and checksum matches"),
            "{stdout}"
        );
        tars.push(std::fs::read(&tar).unwrap());
    }
    assert!(tars.len() == 3 && tars.iter().all(|t| t == &tars[0]));
    assert!(tars[0].len() > 6 * BATCH_BYTES);
    assert_eq!(std::fs::read(&unrelated).unwrap(), b"not cairn's");
    // An export is an ordinary file: the mode any new file gets here, not a private 0600.
    use std::os::unix::fs::PermissionsExt;
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&out.path().join("export-1.tar")), mode(&unrelated));
    // Only the three tars and the unrelated file: no temporary file is left.
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 4);
    assert_eq!(scratch_files(&server), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_export_abandoned_mid_stream_leaves_nothing_on_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), false);
    let a = server.address.clone();
    let writer = a.clone();
    tokio::task::spawn_blocking(move || write_random(&writer, "data", 8 * BATCH_BYTES))
        .await
        .unwrap();
    let id = {
        let a = a.clone();
        tokio::task::spawn_blocking(move || {
            created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])))
        })
        .await
        .unwrap()
    };
    let client = Client::connect(&a, &ClientOptions::default())
        .await
        .unwrap();
    let mut stream = client.export_snapshot(&id).await.unwrap();
    let first = stream.message().await.unwrap().expect("a first chunk");
    assert!(first.total_bytes > 8 * BATCH_BYTES as u64);
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(10);
    // The export stops with its caller (it has more to send than the buffers hold) and its
    // file goes.
    while scratch_files(&server) > 0 || !server.output().contains("export abandoned by its caller")
    {
        assert!(
            Instant::now() < deadline,
            "the export's file stayed on the node ({} files), or it went on without its caller:\n{}",
            scratch_files(&server),
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Files in the node's scratch folder.
fn scratch_files(server: &Server) -> usize {
    std::fs::read_dir(server.base_dir.join("tmp"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Sends `signal` (`-INT`, `-STOP`, …) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Hidden temporary files of `snapshots export` in `folder`.
fn partial_exports(folder: &Path) -> Vec<String> {
    std::fs::read_dir(folder)
        .unwrap()
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .filter(|name| name.ends_with(".partial"))
        .collect()
}

/// An operator who gives up on an export with Ctrl-C (or whose shell sends SIGTERM) is left
/// with neither the output nor a hidden temporary file the size of the snapshot.
#[test]
fn an_export_interrupted_by_its_user_leaves_no_hidden_file() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), false);
    let a = server.address.clone();
    write_random(&a, "data", 4 * BATCH_BYTES);
    let id = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));

    let out = tempfile::tempdir().unwrap();
    let tar = out.path().join("snap.tar");
    for interrupt in ["-INT", "-TERM"] {
        // The node holds still, as over a slow link: the export waits with its file open.
        signal(server.pid(), "-STOP");
        let client = Command::new(env!("CARGO_BIN_EXE_cairnctl"))
            .args(["--address", &a, "snapshots", "export", &id, "-o"])
            .arg(&tar)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_until(Duration::from_secs(30), "the export to start", || {
            !partial_exports(out.path()).is_empty()
        });
        signal(client.id(), interrupt);
        let output = client.wait_with_output().unwrap();
        signal(server.pid(), "-CONT");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{interrupt}: {stderr}");
        assert!(stderr.contains("interrupted"), "{interrupt}: {stderr}");
        assert_eq!(
            partial_exports(out.path()),
            Vec::<String>::new(),
            "{interrupt}"
        );
        assert!(!tar.exists(), "{interrupt}");
    }
}

/// `-o` naming a folder is refused before anything is received, with what to give instead.
#[test]
fn an_export_onto_a_folder_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), false);
    let a = server.address.clone();
    write_random(&a, "data", BATCH_BYTES);
    let id = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    let out = tempfile::tempdir().unwrap();
    let folder = out.path().join("exports");
    std::fs::create_dir(&folder).unwrap();
    for target in [
        folder.to_str().unwrap().to_string(),
        format!("{}/", folder.display()),
    ] {
        let err = support::fails(cairnctl(&a, &["snapshots", "export", &id, "-o", &target]));
        assert!(
            err.contains("is a folder") && err.contains(&format!("{id}.tar")),
            "{err}"
        );
    }
    assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 0);
    assert_eq!(partial_exports(out.path()), Vec::<String>::new());
}

/// A client that starts an export and then stops reading keeps its stream open for good: a
/// SIGTERM still stops the node (its wait for the requests in flight is bounded), with status 0.
/// The export's temporary tar may be left, as after a crash; the next start removes it.
#[test]
fn an_export_whose_client_stopped_reading_does_not_hold_up_a_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), false);
    let a = server.address.clone();
    // Well over what the server's buffers, the stream's flow-control window and the sockets
    // hold, so that the export cannot finish while nobody reads.
    for i in 0..16 {
        write_random(&a, &format!("big{i}"), 3 * BATCH_BYTES / 2);
    }
    let id = created_id(&ok(cairnctl(&a, &["snapshots", "create", "-p", "0"])));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let stalled = runtime.block_on(async {
        let client = Client::connect(&a, &ClientOptions::default())
            .await
            .unwrap();
        let mut stream = client.export_snapshot(&id).await.unwrap();
        assert!(stream.message().await.unwrap().is_some(), "the first chunk");
        (client, stream)
    });
    let tmp = dir.path().join("tmp");
    wait_until(Duration::from_secs(30), "the export's tar", || {
        std::fs::read_dir(&tmp).is_ok_and(|mut d| d.next().is_some())
    });
    // Exits with status 0 within its bound, or the test fails.
    server.stop();
    drop(stalled);
    let server = start(dir.path(), false);
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left in {}: {left:?}", tmp.display());
    server.stop();
}
