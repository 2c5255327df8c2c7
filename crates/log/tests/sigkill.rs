//! SIGKILL while shared commits are half written, with real processes: a child process appends
//! from many tasks to 16 logs of one provider and prints every acknowledged record. Some commits
//! are larger than one write call, so a kill can stop a commit between its writes, or between its
//! write and its sync (a kill cannot tear a single write call: the kernel finishes it; torn
//! records are covered by the tests that cut segment files in `local::tests`). The parent kills
//! the child at a random moment, reopens the logs, and checks that every acknowledged record is
//! there with its payload and that every log is dense. Between rounds it trims the logs, so that
//! recovery also meets shared segments that trims emptied.

use bytes::Bytes;
use cairn_log::Loglet;
use cairn_log::local::{LocalLogOptions, LocalLogProvider};
use cairn_types::{LogId, Lsn};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

const CHILD_DIR: &str = "CAIRN_LOG_SIGKILL_CHILD_DIR";
/// Set for a child whose syncs overlap; unset, it runs with the default sync settings, under
/// which the writer syncs by itself on a fast disk.
const CHILD_OVERLAPS: &str = "CAIRN_LOG_SIGKILL_CHILD_OVERLAPS";
const TEST_NAME: &str = "acknowledged_records_survive_sigkill_during_shared_commits";
const LOGS: u16 = 16;
const APPENDERS: u64 = 32;
const ROUNDS: usize = 5;

fn options(overlapping: bool) -> LocalLogOptions {
    let defaults = LocalLogOptions::default();
    LocalLogOptions {
        segment_bytes_max: 8 << 20,
        // Overlapping syncs whenever there is something to sync: the kill meets them too.
        sync_overlap_after: if overlapping {
            Duration::ZERO
        } else {
            defaults.sync_overlap_after
        },
        ..defaults
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The payload a seed stands for, different for every seed: mostly 100 bytes to 20 KB, one in 16
/// up to 1.2 MB, so that some commits take more than one write call and a kill can land between
/// them.
fn payload(seed: u64) -> Bytes {
    let random = splitmix(seed);
    let len = if random.is_multiple_of(16) {
        300_000 + (random % 900_000) as usize
    } else {
        100 + (random % 20_000) as usize
    };
    let mut bytes = Vec::with_capacity(len + 8);
    let mut word = seed;
    while bytes.len() < len {
        word = splitmix(word);
        bytes.extend_from_slice(&word.to_le_bytes());
    }
    bytes.truncate(len);
    Bytes::from(bytes)
}

/// The child: appends until it is killed, printing `ack <log> <lsn> <seed>` for every record
/// whose append was acknowledged.
fn child(dir: &str) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let overlapping = std::env::var_os(CHILD_OVERLAPS).is_some();
        let provider = LocalLogProvider::open(dir, options(overlapping)).expect("open provider");
        let pid = u64::from(std::process::id());
        let mut tasks = Vec::new();
        for task in 0..APPENDERS {
            let log = provider
                .open_local(LogId(1 + (task % u64::from(LOGS)) as u16))
                .await
                .expect("open log");
            tasks.push(tokio::spawn(async move {
                for i in 0u64.. {
                    let count = 1 + i % 3;
                    let seeds: Vec<u64> = (0..count)
                        .map(|k| (pid << 40) | (task << 28) | (i * 4 + k))
                        .collect();
                    let last = log
                        .append(seeds.iter().map(|s| payload(*s)).collect())
                        .await
                        .expect("append")
                        .0;
                    let mut lines = String::new();
                    for (k, seed) in seeds.iter().enumerate() {
                        let lsn = last + 1 - count + k as u64;
                        lines.push_str(&format!("ack {} {lsn} {seed}\n", log.log_id().0));
                    }
                    // One write for all lines, under stdout's lock.
                    let mut out = std::io::stdout().lock();
                    out.write_all(lines.as_bytes()).expect("stdout");
                    out.flush().expect("stdout");
                }
            }));
        }
        for task in tasks {
            task.await.expect("appender");
        }
    });
}

/// Kills the child if the parent fails before it did.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs one child, kills it (SIGKILL) a random moment after its first acknowledgement and
/// returns every acknowledged (log, lsn, seed) it printed in full.
fn run_and_kill(dir: &Path, delay: Duration, overlapping: bool) -> Vec<(u16, u64, u64)> {
    let exe = std::env::current_exe().expect("test binary");
    let mut command = Command::new(exe);
    if overlapping {
        command.env(CHILD_OVERLAPS, "1");
    }
    let mut child = Killed(
        command
            .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR, dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the child"),
    );
    let stdout = child.0.stdout.take().expect("piped stdout");
    let (first, first_seen) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut acknowledged = Vec::new();
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        while reader.read_line(&mut line).unwrap_or(0) > 0 {
            // A line cut by the kill has no newline: its record may not have been acknowledged.
            if let Some(fields) = line.strip_prefix("ack ").and_then(|l| l.strip_suffix('\n')) {
                let fields: Vec<u64> = fields
                    .split(' ')
                    .map(|f| f.parse().expect("a number"))
                    .collect();
                acknowledged.push((fields[0] as u16, fields[1], fields[2]));
                let _ = first.send(());
            }
            line.clear();
        }
        acknowledged
    });
    first_seen
        .recv_timeout(Duration::from_secs(60))
        .expect("the child acknowledged an append");
    std::thread::sleep(delay);
    child.0.kill().expect("SIGKILL the child");
    child.0.wait().expect("reap the child");
    reader.join().expect("reader thread")
}

/// Reopens the logs and checks them against what was acknowledged; then trims each log to about
/// two thirds of its tail and forgets what that trimmed. Returns how many records it read.
async fn check_and_trim(dir: &Path, acknowledged: &mut BTreeMap<(u16, u64), u64>) -> usize {
    let provider = LocalLogProvider::open(dir, options(false)).expect("reopen after SIGKILL");
    let mut read = 0;
    for log_id in 1..=LOGS {
        let log = provider.open_local(LogId(log_id)).await.expect("open log");
        let state = log.state().await.expect("state");
        // Dense: every LSN from the trim point to the tail reads back, in order.
        let mut found = BTreeMap::new();
        let mut from = state.trim_point.0 + 1;
        while from <= state.tail.0 {
            let entries = log.read(Lsn(from), 500).await.expect("read");
            assert!(!entries.is_empty(), "log {log_id}: nothing at LSN {from}");
            for entry in entries {
                assert_eq!(entry.lsn, Lsn(from), "log {log_id} is dense");
                found.insert(from, entry.payload);
                from += 1;
            }
        }
        read += found.len();
        for (_, lsn, seed) in acknowledged
            .range((log_id, 0)..=(log_id, u64::MAX))
            .map(|((l, n), s)| (*l, *n, *s))
        {
            if lsn <= state.trim_point.0 {
                continue;
            }
            let payload = found.get(&lsn).unwrap_or_else(|| {
                panic!(
                    "log {log_id}: acknowledged LSN {lsn} is missing (tail {})",
                    state.tail
                )
            });
            assert!(
                *payload == self::payload(seed),
                "log {log_id}: LSN {lsn} holds another payload than was acknowledged"
            );
        }
        let trim_to = state.tail.0 * 2 / 3;
        log.trim(Lsn(trim_to)).await.expect("trim");
        acknowledged.retain(|(l, n), _| *l != log_id || *n > trim_to);
    }
    read
}

#[test]
fn acknowledged_records_survive_sigkill_during_shared_commits() {
    if let Ok(dir) = std::env::var(CHILD_DIR) {
        child(&dir);
        return;
    }
    let dir = tempfile::tempdir().expect("temporary directory");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut random = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as u64;
    let mut acknowledged: BTreeMap<(u16, u64), u64> = BTreeMap::new();
    for round in 0..ROUNDS {
        random = splitmix(random);
        let delay = Duration::from_millis(50 + random % 700);
        // Rounds alternate between the writer syncing by itself and overlapping syncs.
        let overlapping = round % 2 == 1;
        let printed = run_and_kill(dir.path(), delay, overlapping);
        assert!(!printed.is_empty());
        for (log, lsn, seed) in &printed {
            if let Some(earlier) = acknowledged.insert((*log, *lsn), *seed) {
                panic!("log {log}: LSN {lsn} acknowledged twice (seeds {earlier} and {seed})");
            }
        }
        let read = runtime.block_on(check_and_trim(dir.path(), &mut acknowledged));
        eprintln!(
            "round {round} (overlapping syncs: {overlapping}): killed after {delay:?}, {} \
             acknowledged records this round, {read} records read back",
            printed.len()
        );
    }
}
