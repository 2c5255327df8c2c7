//! Crash-test hooks.
//!
//! With `CAIRN_PAUSE_AT=<point>` in its environment, a node logs `paused at <point>` when it
//! reaches that point and waits there forever, so a test can SIGKILL it at exactly that moment.
//! The points: `restore-download` (a restore's files are downloaded into its staging folder,
//! not yet imported), `restore-import` (the snapshot is imported but the import is not yet marked
//! complete), `replay-<pid>` (partition `<pid>`'s processor has applied its first batch of log
//! records) and `snapshot-upload` (a snapshot publish has uploaded its first bytes, its manifest
//! is not yet written). Without the variable these are no-ops, and without the `test-hooks` feature (off in
//! every build but the test suite's) they are not there at all, so no environment can stop a
//! production node.

/// The environment variable that names the point to pause at.
pub const PAUSE_AT_ENV: &str = "CAIRN_PAUSE_AT";

/// Waits forever if the environment asks to pause at `point`.
#[cfg(feature = "test-hooks")]
pub(crate) async fn pause_point(point: &str) {
    if std::env::var(PAUSE_AT_ENV).is_ok_and(|v| v == point) {
        tracing::warn!("paused at {point} ({PAUSE_AT_ENV} is set)");
        std::future::pending::<()>().await;
    }
}

#[cfg(not(feature = "test-hooks"))]
pub(crate) async fn pause_point(_point: &str) {}

/// [`pause_point`] for code that cannot await (a progress callback): the calling thread waits
/// forever, after handing the runtime's other tasks to other threads.
#[cfg(feature = "test-hooks")]
pub(crate) fn pause_point_blocking(point: &str) {
    if std::env::var(PAUSE_AT_ENV).is_ok_and(|v| v == point) {
        tracing::warn!("paused at {point} ({PAUSE_AT_ENV} is set)");
        tokio::task::block_in_place(|| {
            loop {
                std::thread::park();
            }
        });
    }
}

#[cfg(not(feature = "test-hooks"))]
pub(crate) fn pause_point_blocking(_point: &str) {}

/// [`pause_point`] at `<point>-<partition>`. The name is only built when the hooks are there:
/// the processor passes here once per round of records.
pub(crate) async fn pause_point_of(point: &str, partition: cairn_types::PartitionId) {
    if cfg!(feature = "test-hooks") {
        pause_point(&format!("{point}-{partition}")).await;
    }
}

/// Says at start-up whether `CAIRN_PAUSE_AT` can take effect, so a crash test run against a
/// binary built without the hooks fails at once instead of waiting for a pause that never comes.
pub fn announce() {
    let Ok(point) = std::env::var(PAUSE_AT_ENV) else {
        return;
    };
    if cfg!(feature = "test-hooks") {
        tracing::warn!("crash-test hooks: this node pauses at {point}");
    } else {
        tracing::warn!(
            "{PAUSE_AT_ENV}={point} is ignored: this binary has no crash-test hooks (build it with the test-hooks feature)"
        );
    }
}
