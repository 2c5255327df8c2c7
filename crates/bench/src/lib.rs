//! What the benchmark binaries share: the plain copies they measure against, progress lines on
//! stderr, and the way their reports show sizes and times. moto's S3 server comes from
//! `cairn_snapshots::test_util::moto`, shared with the tests.
//!
//! Architecture invariant: nothing here measures anything; each binary owns its figures. The code
//! under measurement runs on the benchmark's runtime, so the binaries keep RocksDB, file-system and
//! process calls off its threads ([`blocking`]).

pub mod copy;
pub mod report;

use anyhow::Context;

/// Runs `work` (RocksDB, file-system or process calls) on a blocking thread and waits for it: on
/// one of the runtime's threads it would stall the tasks under measurement there.
pub async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .context("join a blocking task")?
}
