//! A quick measurement, ignored by default: appends per second and records per commit of the
//! `local` provider with 32 concurrent appenders over 16 logs, each append read back right after
//! it (as a partition processor does). Run it with
//!
//! ```text
//! cargo nextest run --workspace --all-features --run-ignored only -E 'binary(throughput)' \
//!     --no-capture
//! ```
//!
//! (`THROUGHPUT_SECS` sets the duration, 3 s by default; `THROUGHPUT_DIR` the directory.) A debug
//! build measures the debug build: compare figures of one build only.
#![cfg(feature = "test-util")]

use bytes::Bytes;
use cairn_log::Loglet;
use cairn_log::local::{LocalLogOptions, LocalLogProvider};
use cairn_types::LogId;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const APPENDERS: u16 = 32;
const LOGS: u16 = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check"]
async fn appends_per_second_with_32_appenders_over_16_logs() {
    let secs = std::env::var("THROUGHPUT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let base = std::env::var("THROUGHPUT_DIR").unwrap_or_else(|_| "/var/tmp".into());
    let dir = tempfile::tempdir_in(base).expect("temporary directory");
    let provider = LocalLogProvider::open(dir.path(), LocalLogOptions::default()).expect("open");
    let appended = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for task in 0..APPENDERS {
        let log = provider
            .open_local(LogId(1 + task % LOGS))
            .await
            .expect("open log");
        let appended = appended.clone();
        tasks.push(tokio::spawn(async move {
            let payload = Bytes::from(vec![7u8; 100]);
            while Instant::now() < deadline {
                let lsn = log.append(vec![payload.clone()]).await.expect("append");
                let read = log.read(lsn, 1).await.expect("read");
                assert_eq!(read[0].lsn, lsn);
                appended.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for task in tasks {
        task.await.expect("appender");
    }
    let appends = appended.load(Ordering::Relaxed);
    let commits = provider.commits();
    println!(
        "{APPENDERS} appenders over {LOGS} logs, 100-byte records: {appends} appends in {secs} s \
         = {:.0} appends/s, {commits} commits ({:.1} records per commit)",
        appends as f64 / secs as f64,
        appends as f64 / commits.max(1) as f64
    );
}
