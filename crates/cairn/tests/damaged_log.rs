//! A damaged log with real `cairn` processes: a log that lost its end (the store is ahead of it)
//! and a byte flipped inside the newest segment. The damaged partition stays down saying why and
//! what to do, the node's other partitions serve, and no acknowledged record is dropped or
//! replaced by a different one.

mod support;

use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry};
use cairn_types::keys::partition_for_key;
use cairn_types::{PartitionId, partition_key};
use std::path::{Path, PathBuf};
use std::time::Duration;
use support::{Server, cairnctl, created_id, fails, ok, run_cairn};

const PARTITIONS: u16 = 4;
/// The partition whose log the tests damage.
const DAMAGED: PartitionId = PartitionId(2);
/// `[u32 len][u32 crc][u64 log id][u64 lsn]` before every record's payload in a segment.
const RECORD_HEADER_BYTES: usize = 24;

fn start(dir: &Path) -> Server {
    Server::start_with(dir, &[], &[("CAIRN_NUM_PARTITIONS", "4")])
}

/// Starts the node on `dir` and checks that the damaged partition is active again with every one
/// of `keys`.
async fn start_serving_all(dir: &Path, keys: &[String]) -> Server {
    let server = start(dir);
    let (_, _, status) = partition_row(&server.address, DAMAGED).await;
    assert_eq!(status, "active");
    assert_all_there(&server.address, keys).await;
    server
}

/// [`start`], with the log starting a new segment every megabyte.
fn start_with_small_segments(dir: &Path) -> Server {
    Server::start_with(
        dir,
        &[],
        &[
            ("CAIRN_NUM_PARTITIONS", "4"),
            ("CAIRN_LOG__SEGMENT_BYTES", "1048576"),
        ],
    )
}

fn keys_of(partition: PartitionId, prefix: &str, count: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}-{i:05}"))
        .filter(|k| partition_for_key(partition_key(k.as_bytes()), PARTITIONS) == partition)
        .take(count)
        .collect()
}

fn value_of(key: &str) -> Bytes {
    Bytes::from(format!("value of {key}"))
}

async fn client(address: &str) -> Client {
    Client::connect(address, &ClientOptions::default())
        .await
        .unwrap()
}

/// One put (one log record) per key.
async fn put_each(address: &str, keys: &[String]) {
    let client = client(address).await;
    for key in keys {
        let entry = PutEntry {
            key: Bytes::from(key.clone()),
            value: value_of(key),
            ttl: None,
        };
        client.put(vec![entry]).await.unwrap();
    }
}

async fn assert_all_there(address: &str, keys: &[String]) {
    let wanted: Vec<Bytes> = keys.iter().map(|k| Bytes::from(k.clone())).collect();
    let values = client(address).await.get(wanted).await.unwrap();
    for (key, value) in keys.iter().zip(values) {
        assert_eq!(value, Some(value_of(key)), "key {key}");
    }
}

/// The partition's line of `partitions list`: (applied LSN, log tail, status).
async fn partition_row(address: &str, id: PartitionId) -> (u64, u64, String) {
    let list = client(address).await.list_partitions().await.unwrap();
    let p = list
        .partitions
        .into_iter()
        .find(|p| p.partition_id == u32::from(id.0))
        .expect("partition listed");
    (p.applied_lsn, p.log_tail, p.status)
}

/// The newest segment of the node's write-ahead log, which the logs of all partitions share.
fn last_segment(base_dir: &Path) -> PathBuf {
    segments(base_dir).pop().expect("the log has a segment")
}

/// The segments of the node's write-ahead log, oldest first.
fn segments(base_dir: &Path) -> Vec<PathBuf> {
    let wal_dir = base_dir.join("log").join("wal");
    let mut segments: Vec<PathBuf> = std::fs::read_dir(&wal_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wal"))
        .collect();
    segments.sort();
    segments
}

/// Offset, log id and LSN of every record of a segment, walking its framing up to the end of
/// the file or to the zeros of its preallocated space (no record's header is all zeros).
fn records_in(segment: &[u8]) -> Vec<(usize, u64, u64)> {
    let mut records = Vec::new();
    let mut offset = 0;
    while offset + RECORD_HEADER_BYTES <= segment.len()
        && segment[offset..offset + RECORD_HEADER_BYTES]
            .iter()
            .any(|b| *b != 0)
    {
        let u64_at = |i: usize| u64::from_le_bytes(segment[i..i + 8].try_into().unwrap());
        let len = u32::from_le_bytes(segment[offset..offset + 4].try_into().unwrap()) as usize;
        records.push((offset, u64_at(offset + 8), u64_at(offset + 16)));
        offset += RECORD_HEADER_BYTES + len;
    }
    records
}

/// Where the last record of a segment ends.
fn written_end(segment: &[u8]) -> usize {
    let (offset, _, _) = *records_in(segment).last().expect("a record");
    let len = u32::from_le_bytes(segment[offset..offset + 4].try_into().unwrap()) as usize;
    offset + RECORD_HEADER_BYTES + len
}

/// Offset and LSN of the `n`th record (from 0) of partition `id`'s log in a segment.
fn record_at(segment: &[u8], id: PartitionId, n: usize) -> (usize, u64) {
    let (offset, _, lsn) = records_in(segment)
        .into_iter()
        .filter(|(_, log, _)| *log == u64::from(id.0))
        .nth(n)
        .expect("the segment holds that many records of the log");
    (offset, lsn)
}

/// A lost write at the end of the log: cuts a few bytes off the newest segment, whose last
/// record is the damaged partition's.
fn cut_the_last_record(base_dir: &Path) {
    let segment = last_segment(base_dir);
    let bytes = std::fs::read(&segment).unwrap();
    let last = records_in(&bytes).pop().expect("a record");
    assert_eq!(
        last.1,
        u64::from(DAMAGED.0),
        "the newest record is the damaged partition's"
    );
    std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap()
        .set_len((written_end(&bytes) - 5) as u64)
        .unwrap();
}

/// The other partitions serve: a key of each can be written and read.
async fn other_partitions_serve(address: &str) {
    for p in (0..PARTITIONS).map(PartitionId).filter(|p| *p != DAMAGED) {
        let keys = keys_of(p, &format!("still-{}", p.0), 1);
        put_each(address, &keys).await;
        assert_all_there(address, &keys).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_cut_at_its_tail_stops_the_partition_until_restored() {
    let dir = tempfile::tempdir().unwrap();
    let before = keys_of(DAMAGED, "before", 5);
    let after = keys_of(DAMAGED, "after", 5);
    let server = start(dir.path());
    put_each(&server.address, &before).await;
    let snapshot = created_id(&ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "2"],
    )));
    put_each(&server.address, &after).await;
    let (applied, tail, _) = partition_row(&server.address, DAMAGED).await;
    assert_eq!(applied, tail);
    server.stop();

    // A lost write at the end of the log: its last record (the last key) loses a few bytes.
    cut_the_last_record(dir.path());

    // Twice: the partition stays down with both LSNs, and nothing is appended to its log, so a
    // restart never serves a different record at an LSN the store applied.
    for _ in 0..2 {
        let server = start(dir.path());
        let (listed_applied, listed_tail, status) = partition_row(&server.address, DAMAGED).await;
        assert_eq!((listed_applied, listed_tail), (applied, applied - 1));
        for needle in [
            format!("up to LSN {applied}"),
            format!("ends at LSN {}", applied - 1),
            "cairnctl partitions restore -p 2".to_string(),
            "cairn drop-partition -p 2` with the node's base dir".to_string(),
        ] {
            assert!(status.contains(&needle), "{needle:?} missing: {status}");
        }
        let err = fails(cairnctl(&server.address, &["kv", "get", &before[0]]));
        assert!(
            err.contains(&format!("ends at LSN {}", applied - 1)),
            "{err}"
        );
        other_partitions_serve(&server.address).await;
        server.stop();
    }

    // The way out: a restore from the snapshot taken before, then the log after it.
    let server = start(dir.path());
    let out = ok(cairnctl(
        &server.address,
        &["-y", "partitions", "restore", "-p", "2"],
    ));
    assert!(out.contains(&snapshot), "{out}");
    let lost = after.last().unwrap().clone();
    let kept: Vec<String> = before
        .iter()
        .chain(&after[..after.len() - 1])
        .cloned()
        .collect();
    assert_all_there(&server.address, &kept).await;
    let values = client(&server.address)
        .await
        .get(vec![Bytes::from(lost.clone())])
        .await
        .unwrap();
    assert_eq!(values, vec![None], "the cut record is gone from the log");
    server.stop();

    // And it stays consistent across a restart.
    let server = start(dir.path());
    assert_all_there(&server.address, &kept).await;
    let (applied_now, tail_now, status) = partition_row(&server.address, DAMAGED).await;
    assert_eq!(status, "active");
    assert_eq!(applied_now, tail_now);
}

/// Writes `keys` to the damaged partition one record each, stops the node and cuts the last few
/// bytes of the partition's newest segment: the last key's record is lost from the log. Returns
/// the store's applied LSN.
async fn write_then_cut_the_log(dir: &Path, keys: &[String]) -> u64 {
    let server = start(dir);
    put_each(&server.address, keys).await;
    let (applied, _, _) = partition_row(&server.address, DAMAGED).await;
    server.stop();
    cut_the_last_record(dir);
    applied
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_lost_its_end_is_trimmed_to_what_the_store_holds_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of(DAMAGED, "key", 6);
    let applied = write_then_cut_the_log(dir.path(), &keys).await;
    let server = start(dir.path());
    let (_, _, status) = partition_row(&server.address, DAMAGED).await;
    assert!(status.contains("cairn repair-log -p 2"), "{status}");
    server.stop();

    let repaired = repair_log(dir.path());
    for needle in [
        format!("the log lost records {applied}..={applied}, and the store holds them"),
        format!("Moved the trim point of partition 2's log up to LSN {applied}"),
        "No record was given up".to_string(),
    ] {
        assert!(repaired.contains(&needle), "{needle:?} missing: {repaired}");
    }
    let server = start(dir.path());
    let (applied_now, tail, status) = partition_row(&server.address, DAMAGED).await;
    assert_eq!(status, "active");
    // The announcement of the new start follows the store's LSN.
    assert_eq!((applied_now, tail), (applied + 1, applied + 1));
    assert_all_there(&server.address, &keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_cut_at_its_tail_can_be_accepted_by_dropping_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of(DAMAGED, "key", 6);
    let applied = write_then_cut_the_log(dir.path(), &keys).await;

    // The operator accepts the loss the message offers: drop the store, rebuild it from the log.
    let base_dir = dir.path().to_str().unwrap();
    let dropped = ok(run_cairn(
        &["drop-partition", "--base-dir", base_dir, "-p", "2", "-y"],
        &[("CAIRN_NUM_PARTITIONS", "4")],
    ));
    assert!(
        dropped.contains("Dropped the store of partition 2"),
        "{dropped}"
    );
    let server = start(dir.path());
    let (applied_now, tail_now, status) = partition_row(&server.address, DAMAGED).await;
    assert_eq!(status, "active");
    // Replayed to the cut, then one announcement: at the LSN of the lost record, now a new one.
    assert_eq!((applied_now, tail_now), (applied, applied));
    let (lost, kept) = keys.split_last().unwrap();
    assert_all_there(&server.address, kept).await;
    let values = client(&server.address)
        .await
        .get(vec![Bytes::from(lost.clone())])
        .await
        .unwrap();
    assert_eq!(values, vec![None], "only the cut record is lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_inside_the_newest_segment_is_refused_not_cut() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of(DAMAGED, "key", 40);
    let server = start(dir.path());
    put_each(&server.address, &keys).await;
    server.stop();

    // One byte inside the payload of a record in the middle of the newest segment.
    let segment = last_segment(dir.path());
    let mut intact = std::fs::read(&segment).unwrap();
    intact.truncate(written_end(&intact));
    let (offset, lsn) = record_at(&intact, DAMAGED, 20);
    let mut damaged = intact.clone();
    damaged[offset + RECORD_HEADER_BYTES + 3] ^= 0x20;
    std::fs::write(&segment, &damaged).unwrap();

    let server = start(dir.path());
    let (_, _, status) = partition_row(&server.address, DAMAGED).await;
    for needle in [
        segment.display().to_string(),
        format!("offset {offset} (LSN {lsn})"),
        "checksum".to_string(),
        format!("LSN {} follows", lsn + 1),
        "`cairn repair-log -p 2`".to_string(),
    ] {
        assert!(status.contains(&needle), "{needle:?} missing: {status}");
    }
    let err = fails(cairnctl(&server.address, &["kv", "get", &keys[0]]));
    assert!(
        err.contains(&format!("offset {offset} (LSN {lsn})")),
        "{err}"
    );
    other_partitions_serve(&server.address).await;
    server.stop();
    // The segment was left as it was; the other partitions' writes went on after its end (the
    // segment is shared by every partition's log).
    let now = std::fs::read(&segment).unwrap();
    assert!(now.starts_with(&damaged), "the segment was left as it was");

    // Nothing acknowledged was dropped: with the byte repaired, every key is there.
    let mut repaired = now;
    repaired[..intact.len()].copy_from_slice(&intact);
    std::fs::write(&segment, &repaired).unwrap();
    let server = start(dir.path());
    assert_all_there(&server.address, &keys).await;
}

/// Writes `keys` (one record each) and keys of the other partitions, stops the node (SIGKILL
/// when `kill`, so that its stores keep only what they had flushed) and flips a byte inside the
/// payload of the damaged partition's 20th record in the newest segment. Returns the LSN of the
/// damaged record.
async fn write_then_flip_a_byte(base_dir: &Path, keys: &[String], kill: bool) -> u64 {
    let server = start(base_dir);
    put_each(&server.address, keys).await;
    other_partitions_serve(&server.address).await;
    if kill {
        server.kill();
    } else {
        server.stop();
    }
    let segment = last_segment(base_dir);
    let mut bytes = std::fs::read(&segment).unwrap();
    let (offset, lsn) = record_at(&bytes, DAMAGED, 20);
    bytes[offset + RECORD_HEADER_BYTES + 3] ^= 0x20;
    std::fs::write(&segment, &bytes).unwrap();
    lsn
}

/// Writes `keys`, snapshots the damaged partition (which flushes its store), SIGKILLs the node
/// and flips a byte of the partition's 20th record after a restart ([`write_then_flip_a_byte`]).
/// Returns the snapshot's id and the damaged LSN.
async fn snapshot_then_flip_a_byte(base_dir: &Path, keys: &[String]) -> (String, u64) {
    let server = start(base_dir);
    put_each(&server.address, keys).await;
    let snapshot = created_id(&ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "2"],
    )));
    server.kill();
    (snapshot, write_then_flip_a_byte(base_dir, &[], true).await)
}

fn repair_log(base_dir: &Path) -> String {
    let base_dir = base_dir.to_str().unwrap();
    ok(run_cairn(
        &["repair-log", "--base-dir", base_dir, "-p", "2", "-y"],
        &[("CAIRN_NUM_PARTITIONS", "4")],
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_log_cuts_the_damaged_partition_s_log_and_keeps_every_other_partition_s_records() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of(DAMAGED, "key", 40);
    let lsn = write_then_flip_a_byte(dir.path(), &keys, true).await;
    let segment = last_segment(dir.path());
    let damaged = std::fs::read(&segment).unwrap();

    let repaired = repair_log(dir.path());
    for needle in [
        "Neither the partition's store nor a snapshot reaches past the damage".to_string(),
        format!("Cut partition 2's log after LSN {}", lsn - 1),
        format!("{}.before-cut", segment.display()),
        format!("its next write gets LSN {lsn}"),
    ] {
        assert!(repaired.contains(&needle), "{needle:?} missing: {repaired}");
    }
    let copy = PathBuf::from(format!("{}.before-cut", segment.display()));
    assert_eq!(
        std::fs::read(copy).unwrap(),
        damaged,
        "the copy is the file as it was"
    );
    let again = fails(run_cairn(
        &[
            "repair-log",
            "--base-dir",
            dir.path().to_str().unwrap(),
            "-p",
            "2",
            "-y",
        ],
        &[("CAIRN_NUM_PARTITIONS", "4")],
    ));
    assert!(again.contains("opens as it is"), "{again}");

    let server = start(dir.path());
    let (_, _, status) = partition_row(&server.address, DAMAGED).await;
    assert_eq!(status, "active");
    // The partition's records before the damaged one are there; that one and the ones after it
    // are given up. (One announcement at LSN 1, then one record per key.)
    let kept = (lsn - 2) as usize;
    assert_all_there(&server.address, &keys[..kept]).await;
    let wanted: Vec<Bytes> = keys[kept..]
        .iter()
        .map(|k| Bytes::from(k.clone()))
        .collect();
    let values = client(&server.address).await.get(wanted).await.unwrap();
    assert!(values.iter().all(Option::is_none), "{values:?}");
    // Every other partition kept its records, and the repaired one takes writes again.
    for p in (0..PARTITIONS).map(PartitionId).filter(|p| *p != DAMAGED) {
        assert_all_there(&server.address, &keys_of(p, &format!("still-{}", p.0), 1)).await;
    }
    put_each(&server.address, &keys[kept..]).await;
    assert_all_there(&server.address, &keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_log_trims_past_damage_that_the_store_has_applied_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of(DAMAGED, "key", 40);
    // A clean stop: the store flushes what it applied.
    let lsn = write_then_flip_a_byte(dir.path(), &keys, false).await;

    let repaired = repair_log(dir.path());
    for needle in [
        "The partition's store has applied the log up to LSN",
        "Moved the trim point of partition 2's log up to LSN",
        "the partition's store holds everything up to it",
        "No record was given up",
    ] {
        assert!(repaired.contains(needle), "{needle:?} missing: {repaired}");
    }
    let server = start(dir.path());
    let (_, tail, status) = partition_row(&server.address, DAMAGED).await;
    assert_eq!(status, "active");
    assert!(
        tail > lsn,
        "the log went on past the damaged LSN {lsn}: {tail}"
    );
    assert_all_there(&server.address, &keys).await;
    other_partitions_serve(&server.address).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_log_trims_to_the_snapshot_then_to_the_store_past_a_second_damage() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of(DAMAGED, "key", 40);
    let server = start(dir.path());
    put_each(&server.address, &keys[..20]).await;
    ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "2"],
    ));
    put_each(&server.address, &keys[20..]).await;
    server.stop();
    // One damaged record below the snapshot's LSN, one between it and the store's.
    let segment = last_segment(dir.path());
    let mut bytes = std::fs::read(&segment).unwrap();
    for n in [9, 29] {
        let (offset, _) = record_at(&bytes, DAMAGED, n);
        bytes[offset + RECORD_HEADER_BYTES + 3] ^= 0x20;
    }
    std::fs::write(&segment, &bytes).unwrap();

    let repaired = repair_log(dir.path());
    assert_eq!(
        repaired.matches("Move it? (--yes)").count(),
        2,
        "a trim to the snapshot, then one to the store: {repaired}"
    );
    assert!(repaired.contains("No record was given up"), "{repaired}");
    assert!(!repaired.contains("Cut partition"), "{repaired}");
    start_serving_all(dir.path(), &keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_log_does_not_rely_on_a_snapshot_that_does_not_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of(DAMAGED, "key", 40);
    let (snapshot, _) = snapshot_then_flip_a_byte(dir.path(), &keys).await;
    // One byte of a table file of the snapshot, in the repository.
    let ssts = dir.path().join("pp-snapshots").join("2").join("ssts");
    let table = std::fs::read_dir(&ssts)
        .unwrap()
        .map(|e| e.unwrap().path())
        .next()
        .expect("a table file in the repository");
    let mut bytes = std::fs::read(&table).unwrap();
    bytes[10] ^= 0x01;
    std::fs::write(&table, &bytes).unwrap();

    let repaired = repair_log(dir.path());
    for needle in [
        format!("Snapshot {snapshot} at LSN"),
        "does not read back whole, so it is not relied on".to_string(),
        "the partition's store holds everything up to it".to_string(),
        "No record was given up".to_string(),
    ] {
        assert!(repaired.contains(&needle), "{needle:?} missing: {repaired}");
    }
    start_serving_all(dir.path(), &keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_log_trims_past_damage_that_a_snapshot_covers_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of(DAMAGED, "key", 40);
    let (snapshot, lsn) = snapshot_then_flip_a_byte(dir.path(), &keys).await;

    let base_dir = dir.path().to_str().unwrap();
    let output = run_cairn(
        &["repair-log", "--base-dir", base_dir, "-p", "2", "-y"],
        &[("CAIRN_NUM_PARTITIONS", "4")],
    );
    // The snapshot is read back whole before the trim relies on it, and the operator sees that.
    let progress = support::stderr(&output);
    for needle in [
        format!("Reading snapshot {snapshot} ("),
        ") back whole before relying on it".to_string(),
        " read back".to_string(),
    ] {
        assert!(progress.contains(&needle), "{needle:?} missing: {progress}");
    }
    let (last, total) = progress
        .lines()
        .last()
        .and_then(|line| line.trim().strip_suffix(" read back")?.split_once(" of "))
        .expect("the last progress line says how much was read back");
    assert_eq!(last, total, "the snapshot was read back whole: {progress}");
    let repaired = ok(output);
    for needle in [
        format!("Snapshot {snapshot} holds the partition up to LSN"),
        "Moved the trim point of partition 2's log up to LSN".to_string(),
        "No record was given up".to_string(),
    ] {
        assert!(repaired.contains(&needle), "{needle:?} missing: {repaired}");
    }
    assert!(!repaired.contains("Cut partition"), "{repaired}");

    let server = start_serving_all(dir.path(), &keys).await;
    let (_, tail, _) = partition_row(&server.address, DAMAGED).await;
    assert!(
        tail > lsn,
        "the log went on past the damaged LSN {lsn}: {tail}"
    );
}

/// A tmpfs mounted for the life of the value (unmounted lazily on drop).
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` (e.g. "8m") on `dir`; `None` when this process may not mount.
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .ok()?;
        status.success().then(|| Tmpfs(dir.to_path_buf()))
    }

    /// [`Tmpfs::mount`], or `None` with a note that the test is skipped, when this process is
    /// not root. As root a failed mount fails the test: CI runs as root and must not skip it.
    fn mount_or_skip(dir: &Path, size: &str) -> Option<Tmpfs> {
        let mounted = Tmpfs::mount(dir, size);
        if mounted.is_none() {
            assert_ne!(
                effective_uid(),
                0,
                "running as root, yet a tmpfs could not be mounted"
            );
            eprintln!("skipped: mounting a tmpfs needs root");
        }
        mounted
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Puts `key` with a value of `bytes` bytes; the error, if any.
async fn put_large(client: &Client, key: &str, bytes: usize) -> Result<(), cairn_client::Error> {
    let entry = PutEntry {
        key: Bytes::from(key.to_string()),
        value: Bytes::from(vec![b'x'; bytes]),
        ttl: None,
    };
    client.put(vec![entry]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_log_disk_refuses_writes_serves_reads_and_recovers_by_itself() {
    const VALUE_BYTES: usize = 256 * 1024;
    let dir = tempfile::tempdir().unwrap();
    let log_dir = dir.path().join("log");
    // A real full file system under the log: only a privileged run can mount one.
    let Some(_tmpfs) = Tmpfs::mount_or_skip(&log_dir, "8m") else {
        return;
    };
    // Room that the test frees later, as an operator would.
    let filler = log_dir.join("filler");
    std::fs::write(&filler, vec![0u8; 3 << 20]).unwrap();

    let server = start_with_small_segments(dir.path());
    let client = client(&server.address).await;
    let keys = keys_of(DAMAGED, "big", 100);
    let mut acknowledged = Vec::new();
    let mut refusal = None;
    for key in &keys {
        match put_large(&client, key, VALUE_BYTES).await {
            Ok(()) => acknowledged.push(key.clone()),
            Err(err) => {
                refusal = Some(err);
                break;
            }
        }
    }
    let refusal = refusal.expect("8 MiB filled up");
    assert_eq!(
        refusal.code(),
        Some(cairn_client::Code::ResourceExhausted),
        "{refusal}"
    );
    let message = refusal.to_string();
    assert!(
        message.contains(&log_dir.display().to_string()),
        "{message}"
    );
    assert!(message.contains("full"), "{message}");
    assert!(!acknowledged.is_empty());

    // Still full: writes keep being refused the same way, reads are served, nothing is stopped.
    let again = put_large(&client, "one-more", VALUE_BYTES)
        .await
        .expect_err("the disk is still full");
    assert_eq!(again.code(), Some(cairn_client::Code::ResourceExhausted));
    let first = vec![Bytes::from(acknowledged[0].clone())];
    assert_eq!(
        client.get(first).await.unwrap()[0]
            .as_ref()
            .map(|v| v.len()),
        Some(VALUE_BYTES)
    );
    let (_, _, status) = partition_row(&server.address, DAMAGED).await;
    assert_eq!(status, "active");

    // Space is back: writes succeed again without a restart.
    std::fs::remove_file(&filler).unwrap();
    for key in ["after-1", "after-2"] {
        put_large(&client, key, VALUE_BYTES).await.unwrap();
        acknowledged.push(key.to_string());
    }

    // Nothing acknowledged was lost, also across a crash and recovery.
    server.kill();
    let server = start_with_small_segments(dir.path());
    let client = self::client(&server.address).await;
    let wanted: Vec<Bytes> = acknowledged
        .iter()
        .map(|k| Bytes::from(k.clone()))
        .collect();
    let values = client.get(wanted).await.unwrap();
    for (key, value) in acknowledged.iter().zip(values) {
        assert_eq!(value.map(|v| v.len()), Some(VALUE_BYTES), "key {key}");
    }
    server.stop();
}

/// The effective user id, from `/proc/self/status` (no libc dependency in the tests).
fn effective_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_describe_names_a_log_that_cannot_be_opened_and_describes_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let keys = keys_of(DAMAGED, "key", 10);
    let server = start(dir.path());
    put_each(&server.address, &keys).await;
    other_partitions_serve(&server.address).await;
    server.stop();

    // Corruption in the middle of the newest segment: the log cannot be opened.
    let segment = last_segment(dir.path());
    let mut bytes = std::fs::read(&segment).unwrap();
    let (offset, lsn) = record_at(&bytes, DAMAGED, 4);
    bytes[offset + RECORD_HEADER_BYTES + 1] ^= 0x01;
    std::fs::write(&segment, &bytes).unwrap();

    let server = start(dir.path());
    let output = cairnctl(&server.address, &["logs", "describe"]);
    let (out, err) = (support::stdout(&output), support::stderr(&output));
    assert!(!output.status.success(), "{out}{err}");
    // Every other log is described with its tail; the damaged one is named with why.
    let tails = client(&server.address)
        .await
        .list_partitions()
        .await
        .unwrap();
    for p in tails.partitions.iter().filter(|p| p.partition_id != 2) {
        let row = vec![
            p.partition_id.to_string(),
            "0".into(),
            p.log_tail.to_string(),
        ];
        assert!(
            out.lines()
                .any(|l| l.split_whitespace().map(String::from).collect::<Vec<_>>() == row),
            "log {} with tail {} missing:\n{out}",
            p.partition_id,
            p.log_tail
        );
    }
    for needle in [
        "log 2: ".to_string(),
        segment.display().to_string(),
        format!("offset {offset} (LSN {lsn})"),
    ] {
        assert!(err.contains(&needle), "{needle:?} missing: {err}");
    }
    // Asking for that log alone says the same; asking for another one succeeds.
    let alone = fails(cairnctl(&server.address, &["logs", "describe", "-l", "2"]));
    assert!(
        alone.contains(&format!("offset {offset} (LSN {lsn})")),
        "{alone}"
    );
    ok(cairnctl(&server.address, &["logs", "describe", "-l", "1"]));
    // And `partitions list` shows every partition, the damaged one with the same reason.
    let (_, _, status) = partition_row(&server.address, DAMAGED).await;
    assert!(
        status.contains(&format!("offset {offset} (LSN {lsn})")),
        "{status}"
    );
    server.stop();
}

/// Fills the file system holding `path` with a file there, until a write fails.
fn fill_up(path: &Path) {
    use std::io::Write;
    let mut file = std::fs::File::create(path).unwrap();
    let chunk = vec![0u8; 1 << 20];
    while file
        .write_all(&chunk)
        .and_then(|()| file.sync_data())
        .is_ok()
    {}
}

/// Cuts `bytes` off the end of `file`: a log segment that lost its last write, or the file that
/// `fill_up` wrote, giving room back as an operator deleting a file would.
fn shrink(file: &Path, bytes: u64) {
    let len = std::fs::metadata(file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(len.saturating_sub(bytes))
        .unwrap();
}

/// Puts `key` with `bytes` bytes of value, giving up after a few seconds: `Err(None)` then.
async fn put_within(
    client: &Client,
    key: &str,
    bytes: usize,
) -> Result<(), Option<cairn_client::Error>> {
    let entry = PutEntry {
        key: Bytes::from(key.to_string()),
        value: Bytes::from(vec![b'v'; bytes]),
        ttl: None,
    };
    match tokio::time::timeout(Duration::from_secs(3), client.put(vec![entry])).await {
        Ok(result) => result.map_err(Some),
        Err(_) => Err(None),
    }
}

/// Every key of `written` holds a value of its length.
async fn assert_sizes(client: &Client, written: &[(String, usize)]) {
    let keys = written
        .iter()
        .map(|(k, _)| Bytes::from(k.clone()))
        .collect();
    let values = client.get(keys).await.unwrap();
    for ((key, bytes), value) in written.iter().zip(values) {
        assert_eq!(value.map(|v| v.len()), Some(*bytes), "key {key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_disk_keeps_serving_reads_and_recovers_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let base_dir = dir.path().join("data");
    // Log and store on one small file system, as on a single-disk machine; larger than the
    // 64 MiB that RocksDB wants free before it resumes writing. Small log segments, so that the
    // space a segment takes up front is not what fills the disk.
    let Some(_tmpfs) = Tmpfs::mount_or_skip(&base_dir, "128m") else {
        return;
    };
    let server = start_with_small_segments(&base_dir);
    let client = client(&server.address).await;
    let mut acknowledged = Vec::new();
    for key in keys_of(DAMAGED, "key", 20) {
        put_within(&client, &key, 10).await.unwrap();
        acknowledged.push((key, 10));
    }

    // The disk fills up, then gets a little room that appends take until one fails; then a
    // snapshot's flush of the store fails on the full disk. A flush that succeeds instead only
    // means filling up again.
    let filler = base_dir.join("filler");
    let mut fill = keys_of(DAMAGED, "fill", 1000).into_iter();
    let mut flush_failed = false;
    for _ in 0..5 {
        fill_up(&filler);
        shrink(&filler, 4 << 20);
        for key in fill.by_ref() {
            match put_within(&client, &key, 64 * 1024).await {
                Ok(()) => acknowledged.push((key, 64 * 1024)),
                Err(_) => break,
            }
        }
        let snapshot = cairnctl(&server.address, &["snapshots", "create", "-p", "2"]);
        if !snapshot.status.success() {
            flush_failed = true;
            break;
        }
    }
    assert!(flush_failed, "the snapshot never failed on the full disk");
    // Some room comes back: enough for the log, not for RocksDB to resume.
    shrink(&filler, 2 << 20);

    // The store keeps no write-ahead file of its own: while it cannot flush, writes still reach
    // the log (their durable copy) and are applied in memory, until the log runs out of room
    // too. Then they are refused at once as a full disk, not left waiting.
    let mut refused = None;
    for key in keys_of(DAMAGED, "pending", 200) {
        match put_within(&client, &key, 64 * 1024).await {
            Ok(()) => acknowledged.push((key, 64 * 1024)),
            Err(err) => {
                refused = Some(err.expect("refused at once, not left waiting"));
                break;
            }
        }
    }
    let refused = refused.expect("200 writes of 64 KiB fitted in 2 MiB of disk");
    assert_eq!(
        refused.code(),
        Some(cairn_client::Code::ResourceExhausted),
        "{refused}"
    );
    assert!(refused.to_string().contains("full"), "{refused}");
    // Reads go on; the partition is still active.
    assert_sizes(&client, &acknowledged).await;
    let (_, _, status) = partition_row(&server.address, DAMAGED).await;
    assert_eq!(status, "active");

    // Space is back: writes succeed again without a restart, and the waiting record is applied.
    std::fs::remove_file(&filler).unwrap();
    let after = keys_of(DAMAGED, "after", 1).remove(0);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match put_within(&client, &after, 10).await {
            Ok(()) => break,
            Err(err) if std::time::Instant::now() < deadline => {
                if let Some(err) = err {
                    assert_eq!(
                        err.code(),
                        Some(cairn_client::Code::ResourceExhausted),
                        "{err}"
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(err) => panic!("writes did not resume once space was freed: {err:?}"),
        }
    }
    acknowledged.push((after, 10));
    ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "2"],
    ));
    other_partitions_serve(&server.address).await;

    // Nothing acknowledged was lost, also across a crash and recovery.
    server.kill();
    let server = start_with_small_segments(&base_dir);
    assert_sizes(&self::client(&server.address).await, &acknowledged).await;
    server.stop();
}

/// The store's disk fills while the log's has room: the write whose records the store then
/// refuses is in the log, and its client is told at once that its outcome is not known yet,
/// rather than left waiting until the disk has room (an operator's hours). It is applied then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_the_full_store_cannot_apply_is_answered_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let base_dir = dir.path().join("data");
    let db = base_dir.join("db");
    let Some(_tmpfs) = Tmpfs::mount_or_skip(&db, "160m") else {
        return;
    };
    let server = start(&base_dir);
    let client = client(&server.address).await;
    let filler = db.join("filler");
    fill_up(&filler);

    // The memtables take writes until their flush fails; then the store refuses them.
    let mut acknowledged = Vec::new();
    let mut undecided = None;
    for key in keys_of(DAMAGED, "key", 1000) {
        let entry = PutEntry {
            key: Bytes::from(key.clone()),
            value: Bytes::from(vec![b'v'; 64 * 1024]),
            ttl: None,
        };
        match tokio::time::timeout(Duration::from_secs(20), client.put(vec![entry])).await {
            Ok(Ok(())) => acknowledged.push(key),
            Ok(Err(err)) => {
                assert_eq!(
                    err.code(),
                    Some(cairn_client::Code::DeadlineExceeded),
                    "{err}"
                );
                assert!(
                    err.to_string()
                        .contains("is in the log and is applied once there is room"),
                    "{err}"
                );
                undecided = Some(key);
                break;
            }
            Err(_) => panic!("a write waited 20 s for the full store without an answer"),
        }
    }
    let undecided = undecided.expect("1000 writes of 64 KiB never filled the store");
    let refused = put_large(&client, "refused-at-once", 10).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Some(cairn_client::Code::ResourceExhausted),
        "{refused}"
    );

    std::fs::remove_file(&filler).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while put_large(&client, "after", 10).await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "writes did not resume once space was freed"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    acknowledged.push(undecided);
    let values = client
        .get(
            acknowledged
                .iter()
                .map(|k| Bytes::from(k.clone()))
                .collect(),
        )
        .await
        .unwrap();
    assert!(
        values
            .iter()
            .all(|v| v.as_ref().map(|v| v.len()) == Some(64 * 1024)),
        "every acknowledged write, and the undecided one, took effect"
    );
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_a_full_disk_says_so_at_start_and_starts_once_space_is_freed() {
    let dir = tempfile::tempdir().unwrap();
    let base_dir = dir.path().join("data");
    let Some(_tmpfs) = Tmpfs::mount_or_skip(&base_dir, "100m") else {
        return;
    };
    let keys = keys_of(DAMAGED, "key", 20);
    let server = start(&base_dir);
    put_each(&server.address, &keys).await;
    // Killed: the store flushed none of them, and opening it writes files of its own.
    server.kill();
    let filler = base_dir.join("filler");
    fill_up(&filler);

    let base = base_dir.to_str().unwrap();
    let refused = fails(run_cairn(
        &["--base-dir", base, "--bind-address", "127.0.0.1:0"],
        &[
            ("CAIRN_NUM_PARTITIONS", "4"),
            ("CAIRN_METRICS__BIND_ADDRESS", "127.0.0.1:0"),
        ],
    ));
    let db = base_dir.join("db");
    assert!(
        refused.contains(&format!(
            "the disk holding {} is full; free space on it, then start the node again",
            db.display()
        )),
        "{refused}"
    );

    std::fs::remove_file(&filler).unwrap();
    let server = start(&base_dir);
    assert_all_there(&server.address, &keys).await;
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_segment_is_named_without_advice_to_cut_at_an_offset() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_with_small_segments(dir.path());
    let client = client(&server.address).await;
    // Enough for a few segments; past the first, they hold records of the damaged partition only.
    for key in keys_of(DAMAGED, "big", 40) {
        put_large(&client, &key, 64 * 1024).await.unwrap();
    }
    server.stop();
    let segments = segments(dir.path());
    assert!(segments.len() >= 3, "{segments:?}");
    let in_lost = records_in(&std::fs::read(&segments[1]).unwrap());
    assert!(
        in_lost
            .iter()
            .all(|(_, log, _)| *log == u64::from(DAMAGED.0)),
        "only the damaged partition has records in the segment to lose"
    );
    // A segment in the middle is lost (a file-system fault): the log misses records.
    std::fs::remove_file(&segments[1]).unwrap();
    let lost_name = segments[1]
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();

    let server = start(dir.path());
    let (_, _, status) = partition_row(&server.address, DAMAGED).await;
    for needle in [
        segments[2].display().to_string(),
        lost_name,
        "records are missing".to_string(),
        "files this names as gone or damaged back from a backup".to_string(),
    ] {
        assert!(status.contains(&needle), "{needle:?} missing: {status}");
    }
    assert!(!status.contains("truncate -s"), "{status}");
    other_partitions_serve(&server.address).await;
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_records_the_log_lost_is_not_replayed_over_new_ones() {
    let dir = tempfile::tempdir().unwrap();
    let before = keys_of(DAMAGED, "before", 6);
    // A snapshot that covers every record, then the log loses its last one.
    let server = start(dir.path());
    put_each(&server.address, &before).await;
    ok(cairnctl(
        &server.address,
        &["snapshots", "create", "-p", "2"],
    ));
    server.stop();
    cut_the_last_record(dir.path());
    // The operator accepts the loss, as offered, and writes on: the log now holds different
    // records at and after the snapshot's LSN.
    let base_dir = dir.path().to_str().unwrap();
    let drop = ["drop-partition", "--base-dir", base_dir, "-p", "2", "-y"];
    ok(run_cairn(&drop, &[("CAIRN_NUM_PARTITIONS", "4")]));
    let server = start(dir.path());
    let after = keys_of(DAMAGED, "after", 6);
    put_each(&server.address, &after).await;

    // A restore that picks that snapshot must not skip the new records as another epoch's.
    let restore = cairnctl(&server.address, &["-y", "partitions", "restore", "-p", "2"]);
    if restore.status.success() {
        assert_all_there(&server.address, &after).await;
    } else {
        let (_, _, status) = partition_row(&server.address, DAMAGED).await;
        assert!(
            status.contains("whose announcement this store never applied"),
            "{status}"
        );
        server.stop();
        // The way out the message names: rebuild the store from the log.
        ok(run_cairn(&drop, &[("CAIRN_NUM_PARTITIONS", "4")]));
        let server = start(dir.path());
        assert_all_there(&server.address, &before[..before.len() - 1]).await;
        assert_all_there(&server.address, &after).await;
        server.stop();
    }
}
