//! Work the node does on its own: automatic snapshots, automatic log trimming, and watching each
//! partition's store for writes that RocksDB holds back.
//!
//! - Snapshots: a partition is snapshotted once `worker.snapshots.snapshot-interval` has passed
//!   since its last one (plus up to a tenth of it at random, so partitions spread out), or once
//!   `snapshot-interval-num-records` records were applied since. At most
//!   `max-concurrent-snapshots` run at once.
//! - Trimming: every `worker.trim-log-interval`, each partition's log is trimmed to its archived
//!   LSN once that LSN has been archived for `worker.trim-log-delay`. The archived LSN is what the
//!   oldest retained snapshot covers, so every retained snapshot stays restorable.
//! - Write stalls: every few seconds, each running partition's store says whether RocksDB slows
//!   or stops its writes while compactions catch up; the node warns when that starts, with why
//!   it may be, and says when it ends. Under universal compaction it also warns, ahead of that,
//!   when the store's disk has less free than the largest partition's tables: what a merge of
//!   that partition's oldest tables needs.

use crate::config::CompactionStyle;
use crate::node::NodeState;
use cairn_partition_store::WriteStall;
use cairn_types::{Lsn, PartitionId};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the snapshot scheduler looks at the partitions.
const SNAPSHOT_CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// How often each partition's store is asked whether its writes are held back.
const STALL_CHECK_INTERVAL: Duration = Duration::from_secs(5);

pub(crate) fn spawn(state: Arc<NodeState>, cancel: CancellationToken) -> Vec<JoinHandle<()>> {
    let mut tasks = vec![tokio::spawn(stall_watch(state.clone(), cancel.clone()))];
    let snapshots = &state.config.worker.snapshots;
    if state.snapshots.is_some()
        && (snapshots.snapshot_interval.is_some()
            || snapshots.snapshot_interval_num_records.is_some())
    {
        tasks.push(tokio::spawn(snapshot_scheduler(
            state.clone(),
            cancel.clone(),
        )));
    }
    if let (Some(_), Some(interval)) = (&state.snapshots, state.config.worker.trim_log_interval) {
        tasks.push(tokio::spawn(trimmer(state.clone(), interval, cancel)));
    }
    tasks
}

struct LastSnapshot {
    at: Instant,
    lsn: Lsn,
    /// Extra wait on top of the interval for this partition.
    jitter: Duration,
    in_flight: bool,
    /// After a failure, no new attempt before this.
    retry_after: Option<Instant>,
}

/// Wait after a failed automatic snapshot before the next attempt.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(30);

async fn snapshot_scheduler(state: Arc<NodeState>, cancel: CancellationToken) {
    let settings = state.config.worker.snapshots.clone();
    let permits = Arc::new(tokio::sync::Semaphore::new(
        settings.max_concurrent_snapshots,
    ));
    let jitter = |interval: Option<Duration>| {
        interval
            .map(|i| i.mul_f64(rand::random::<f64>() / 10.0))
            .unwrap_or_default()
    };
    let last: Arc<std::sync::Mutex<HashMap<PartitionId, LastSnapshot>>> = Arc::default();
    for slot in state.partitions.slots() {
        // Counted from the newest snapshot, so a restart does not snapshot everything at once.
        let newest = match &state.snapshots {
            Some(snapshots) => snapshots
                .repository()
                .latest(slot.id())
                .await
                .ok()
                .flatten()
                .map(|latest| latest.min_applied_lsn),
            None => None,
        };
        last.lock().unwrap_or_else(|p| p.into_inner()).insert(
            slot.id(),
            LastSnapshot {
                at: Instant::now(),
                lsn: newest.unwrap_or(Lsn::ZERO),
                jitter: jitter(settings.snapshot_interval),
                in_flight: false,
                retry_after: None,
            },
        );
    }
    info!(
        interval = ?settings.snapshot_interval,
        num_records = ?settings.snapshot_interval_num_records,
        concurrency = settings.max_concurrent_snapshots,
        "automatic snapshots are on"
    );
    loop {
        tokio::select! {
            () = tokio::time::sleep(SNAPSHOT_CHECK_INTERVAL) => {}
            () = cancel.cancelled() => return,
        }
        for slot in state.partitions.slots() {
            // Only a partition's leader snapshots it (a follower's store may lag).
            let Some(partition) = slot.running().ok().filter(|p| p.leads()) else {
                continue;
            };
            let applied = partition.applied_lsn();
            let due = {
                let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
                let Some(entry) = last.get_mut(&slot.id()) else {
                    continue;
                };
                let by_time = settings
                    .snapshot_interval
                    .is_some_and(|i| entry.at.elapsed() >= i + entry.jitter);
                let by_records = settings
                    .snapshot_interval_num_records
                    .is_some_and(|n| applied.0.saturating_sub(entry.lsn.0) >= n);
                let waiting = entry.retry_after.is_some_and(|t| Instant::now() < t);
                let due =
                    !entry.in_flight && !waiting && applied > entry.lsn && (by_time || by_records);
                if due {
                    entry.in_flight = true;
                }
                due
            };
            if !due {
                continue;
            }
            let state = state.clone();
            let last = last.clone();
            let permits = permits.clone();
            let interval = settings.snapshot_interval;
            tokio::spawn(async move {
                let Ok(_permit) = permits.acquire_owned().await else {
                    return;
                };
                let id = partition.id();
                // In a task of its own, so that even a panic ends in the bookkeeping below.
                let result = tokio::spawn(async move {
                    state.create_snapshot(&partition, None, None, false).await
                })
                .await;
                let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
                let Some(entry) = last.get_mut(&id) else {
                    return;
                };
                entry.in_flight = false;
                entry.at = Instant::now();
                entry.jitter = jitter(interval);
                match result {
                    Ok(Ok(created)) => {
                        entry.lsn = created.lsn;
                        entry.retry_after = None;
                        info!(partition = %id, snapshot_id = %created.snapshot_id, lsn = %created.lsn, "automatic snapshot done");
                    }
                    Ok(Err(err)) => {
                        entry.retry_after = Some(Instant::now() + RETRY_AFTER_FAILURE);
                        warn!(partition = %id, "automatic snapshot failed, next attempt in {RETRY_AFTER_FAILURE:?}: {err}");
                    }
                    Err(panicked) => {
                        entry.retry_after = Some(Instant::now() + RETRY_AFTER_FAILURE);
                        warn!(partition = %id, "automatic snapshot failed: {panicked}");
                    }
                }
            });
        }
    }
}

async fn trimmer(state: Arc<NodeState>, interval: Duration, cancel: CancellationToken) {
    let delay = state.config.worker.trim_log_delay;
    info!(
        ?interval,
        ?delay,
        "automatic log trimming to the archived LSN is on"
    );
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = cancel.cancelled() => return,
        }
        for slot in state.partitions.slots() {
            // Only a partition's leader trims its log.
            if !slot.running().is_ok_and(|p| p.leads()) {
                continue;
            }
            // What was read before may stand for snapshots that can no longer be read: trimming
            // by it could leave the log with no snapshot to restore before it.
            if state.refresh_archived_lsn(slot.id()).await.is_err() {
                continue;
            }
            let Some(archived) = state.archived_for(slot.id(), delay) else {
                continue;
            };
            let Ok(log) = slot.log().state().await else {
                continue;
            };
            if archived <= log.trim_point {
                continue;
            }
            match slot.trim_log(archived).await {
                Ok(_) => {
                    info!(partition = %slot.id(), trim_point = %archived, "trimmed the log to the archived LSN")
                }
                Err(err) => {
                    state.metrics.record_failure(slot.id(), "trim");
                    warn!(partition = %slot.id(), "automatic log trim failed: {err}");
                }
            }
        }
    }
}

/// Warns when RocksDB starts to slow or stop a partition's writes, and says when that ends. Its
/// compactions are behind then: under a burst of writes that passes by itself, but a compaction
/// refused for want of disk space (a background error every second) keeps it so until there is
/// room, and the warning says how much.
async fn stall_watch(state: Arc<NodeState>, cancel: CancellationToken) {
    // Each partition's stall and background error count when last looked at.
    let mut last: HashMap<PartitionId, (WriteStall, u64)> = HashMap::new();
    let mut headroom = Headroom {
        store_dir: state.config.base_dir.join("db"),
        short: false,
        unreadable: false,
    };
    loop {
        tokio::select! {
            () = tokio::time::sleep(STALL_CHECK_INTERVAL) => {}
            () = cancel.cancelled() => return,
        }
        // The partition with the most bytes of tables, and how many.
        let mut largest: Option<(PartitionId, u64)> = None;
        for slot in state.partitions.slots() {
            let Ok(partition) = slot.running() else {
                continue;
            };
            let Ok(status) = partition.store_status().await else {
                continue;
            };
            let id = slot.id();
            let tables = status.estimates.live_sst_bytes;
            if largest.is_none_or(|(_, most)| tables > most) {
                largest = Some((id, tables));
            }
            let (stall, errors) = (status.write_stall, status.background_errors);
            let (stall_before, errors_before) =
                last.insert(id, (stall, errors)).unwrap_or_default();
            if stall == stall_before {
                continue;
            }
            let how = match stall {
                WriteStall::None => {
                    info!(partition = %id, "the partition store's compactions caught up: its writes go through at full speed again");
                    continue;
                }
                WriteStall::Slowed => "slows",
                WriteStall::Stopped => "stops",
            };
            if errors > errors_before {
                warn!(partition = %id, background_errors = errors, "RocksDB {how} the partition's writes: its compactions are behind, and some failed or were refused; if its log (LOG in the partition's store folder) says \"Compaction too large\" or \"No space left\", a merge needs as much free disk as the partition's tables take ({tables} bytes): free that much on the store's disk, or set [partition-store] compaction-style = \"leveled\", whose merges need less");
            } else {
                warn!(partition = %id, "RocksDB {how} the partition's writes while its compactions catch up with the writes ({tables} bytes of tables)");
            }
        }
        if state.config.partition_store.compaction_style == CompactionStyle::Universal
            && let Some(largest) = largest
        {
            headroom.check(largest).await;
        }
    }
}

/// Whether the store's disk has room for a merge of the largest partition's oldest tables, which
/// universal compaction writes anew before it removes them. Short of that, RocksDB refuses the
/// merge and, as tables pile up, slows and then stops the partition's writes: the warning comes
/// before that, once per time the free space falls short.
struct Headroom {
    store_dir: PathBuf,
    /// Whether the free space was short of the largest partition at the last check.
    short: bool,
    /// Whether the last check could not read the free space.
    unreadable: bool,
}

impl Headroom {
    async fn check(&mut self, (partition, tables): (PartitionId, u64)) {
        let dir = self.store_dir.clone();
        let free = match tokio::task::spawn_blocking(move || free_bytes(&dir)).await {
            Ok(Ok(free)) => {
                self.unreadable = false;
                free
            }
            Ok(Err(err)) => {
                // Said once, not every few seconds.
                if !self.unreadable {
                    warn!(store_dir = %self.store_dir.display(), "cannot read the free space of the partition store's disk, so the node cannot warn before a merge lacks room: {err}");
                }
                self.unreadable = true;
                return;
            }
            Err(_) => return,
        };
        let short = free < tables;
        if short == self.short {
            return;
        }
        self.short = short;
        if short {
            warn!(%partition, free_bytes = free, tables_bytes = tables, "the partition store's disk has less free ({free} bytes) than partition {partition}'s tables take ({tables} bytes): a merge of its oldest tables writes them anew before it removes them, so RocksDB would refuse it, and then slow and stop the partition's writes as its tables pile up; free that much on the store's disk, or set [partition-store] compaction-style = \"leveled\", whose merges need less");
        } else {
            info!(
                free_bytes = free,
                "the partition store's disk has room again for a merge of its largest partition's tables"
            );
        }
    }
}

/// Bytes an unprivileged writer may still use on the filesystem that holds `path`. Blocking.
fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|err| std::io::Error::new(std::io::ErrorKind::InvalidInput, err))?;
    // SAFETY: all-zero bytes are a valid `statvfs`, which the call then fills in.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and outlives the call; `stat` is a valid place to write.
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // The fields' widths differ between targets.
    Ok(stat.f_bavail as u64 * stat.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_free_space_of_a_folder_is_read_and_of_a_missing_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(free_bytes(dir.path()).unwrap() > 0);
        let missing = free_bytes(&dir.path().join("missing")).unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    }

    #[tokio::test]
    async fn a_disk_short_of_the_largest_partition_is_told_once_and_its_recovery_too() {
        let dir = tempfile::tempdir().unwrap();
        let mut headroom = Headroom {
            store_dir: dir.path().to_path_buf(),
            short: false,
            unreadable: false,
        };
        // No disk has that much free.
        headroom.check((PartitionId(3), u64::MAX)).await;
        assert!(headroom.short);
        headroom.check((PartitionId(3), u64::MAX)).await;
        assert!(headroom.short);
        headroom.check((PartitionId(3), 1)).await;
        assert!(!headroom.short);

        // A store folder that went away is said once, and a later reading clears that.
        headroom.store_dir = dir.path().join("gone");
        headroom.check((PartitionId(3), 1)).await;
        assert!(headroom.unreadable && !headroom.short);
        headroom.store_dir = dir.path().to_path_buf();
        headroom.check((PartitionId(3), 1)).await;
        assert!(!headroom.unreadable);
    }
}
