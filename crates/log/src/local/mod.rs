//! The `local` provider: an embedded, durable log on one node's disk, where all of the node's logs
//! share one physical write-ahead log, so that one write and one `fdatasync` commit the records of
//! every log that arrived meanwhile (a node-wide group commit).
//!
//! Why one file for all logs: a request that touches many partitions appends one record to each of
//! their logs. With a file per log, each of those records paid its own `fdatasync` (on an idle
//! disk, syncing 16 files took as long as 16 syncs of one, in sequence or in parallel, and every
//! call costs CPU). One shared file pays one sync for all of them. (TiKV's raft-engine and
//! RocksDB's own write-ahead log are built the same way.)
//!
//! # Layout
//!
//! ```text
//!   <dir>/LOCK                          held (flock) while the provider is open: one provider per dir
//!   <dir>/wal/00000000000000000001.wal  shared segments, named by a sequence number that only grows
//!   <dir>/wal/00000000000000000002.wal
//!   <dir>/<log_id>/trim-point           [u64 trim point LE][u32 crc32c LE of the u64]; absent = 0
//! ```
//!
//! A segment is a plain sequence of records of any logs, each framed as
//!
//! ```text
//!   [u32 payload len LE][u32 crc32c LE of (len ++ log id ++ lsn ++ payload)][u64 log id LE]
//!   [u64 lsn LE][payload]
//! ```
//!
//! The log id and LSN are stored in every record so that recovery can rebuild each log from the
//! shared file and tell a stale or misplaced record from the one it expects; the checksum covers
//! the header fields too, so that a torn length cannot make garbage look like a record.
//!
//! An earlier layout kept one directory of `*.seg` files per log. A log found in that layout is
//! refused at open (an [`Error::Io`] of kind `InvalidData` saying what to do); this version
//! does not convert it.
//!
//! # Writes: one writer thread for every log
//!
//! Appends and trims of every log go through one bounded queue to one writer thread. The writer
//! takes every request that is queued (up to [`LocalLogOptions::batch_records_max`] records or
//! [`LocalLogOptions::batch_bytes_max`] bytes), hands out each log's next LSNs, encodes them all
//! into one buffer and writes it: one commit. A syncer thread then `fdatasync`s the segment, which
//! makes every commit written before the call durable; only then does the writer publish the new
//! tails and acknowledge the appends, commit by commit in order. The bounded queue pushes back on
//! appenders when the disk cannot keep up.
//!
//! While a sync is in flight the writer goes on writing the commits that arrive. On a fast disk
//! they wait for the next sync, which covers them all (one sync per commit group). On a slow or
//! busy disk, where a flush can take milliseconds and overlapping flushes of one file cost little
//! more than one, the writer starts another sync once the oldest in flight has run for
//! [`LocalLogOptions::sync_overlap_after`] (up to [`LocalLogOptions::syncs_in_flight_max`]). A
//! sync's success counts only once every older sync succeeded too: after a failed writeback the
//! kernel may report the error to one caller only, so a later sync's success does not prove the
//! pages of an earlier commit reached the disk.
//!
//! On a fast disk (the last sync took less than `sync_overlap_after`) and with no sync in flight,
//! the writer syncs by itself instead: handing the sync to a syncer thread and being woken when
//! it is done costs two thread switches, about as much as the sync. The appends that arrive
//! meanwhile wait in the queue and go into the next commit, as they would have anyway.
//!
//! # Reads
//!
//! Only the durable prefix is ever read. In memory, each log keeps where each of its records is
//! (segment, offset, length: 8 bytes per untrimmed record, in runs of consecutive records per
//! segment) and the payloads of its most recent records ([`LocalLogOptions::cache_bytes_max`]),
//! so that the partition processor, which reads each record right after appending it, reads from
//! memory. Other reads run on tokio's blocking pool with positional reads on their own file
//! handles, one read for neighbouring records of one segment, and hold the log's lock only to
//! plan which bytes to read, so they never wait for the writer's disk IO nor it for theirs.
//!
//! # Trimming and space
//!
//! Each log is trimmed on its own: its trim point is written durably, then the records at or
//! below it are forgotten. The writer keeps, per segment, which logs have records in it and the
//! highest LSN of each; a segment other than the newest is deleted once every log's records in it
//! are at or below that log's trim point, in whatever order the logs are trimmed. Deletion comes
//! only after the trim point is durable, and recovery ignores records at or below a log's trim
//! point, so a crash in between leaves a segment that the next recovery deletes. The price of
//! sharing: a log that is never trimmed keeps every segment holding its records alive, with the
//! other logs' trimmed records in them (space amplification). The way out, not built yet, is to
//! rewrite a lagging log's live records forward into the newest segment; the writer's garbage
//! collection (`writer::Writer::collect_garbage`) is where it would go.
//!
//! # Crash consistency
//!
//! The invariant: everything that was acknowledged is in the durable prefix of the segments, and
//! recovery finds exactly that prefix again.
//!
//! - An append is acknowledged only after its bytes were written and `fdatasync`ed, and, if it
//!   created a segment file, after the directory was fsynced too, so the file's name is as durable
//!   as its content. A crash before the acknowledgement may leave any part of the commit on disk
//!   (a prefix, garbage, or, since pages reach the disk in any order, valid records after a hole).
//!   None of it was acknowledged, so keeping a valid prefix of it, or none of it, are both
//!   correct; valid records after a hole are the one case recovery refuses (below).
//! - Before the writer starts a new segment it syncs the previous one. So the only segment that
//!   can hold an unsynced, possibly torn tail is the last one; damage in an older segment cannot
//!   come from a crash, and recovery refuses it as [`Error::Corrupt`].
//! - Recovery reads every segment once, in order, at [`LocalLogProvider::open`]. Per log, records
//!   at or below its trim point are skipped; the others must continue the log densely, the first
//!   at `trim_point + 1`. A missing LSN or a repeated one makes that log corrupt (naming the
//!   missing LSNs and the segment where the log resumes, and the segment files that are gone);
//!   the other logs open.
//! - At a bad spot (a record that is short or fails its checksum), recovery decides between two
//!   causes:
//!   - A torn tail: an incomplete final write, in the last segment, with nothing valid after it,
//!     because nothing was written after the write that tore. Recovery cuts the segment there and
//!     logs a warning with the number of bytes it dropped; every log keeps a prefix.
//!   - Corruption: in an older segment, or a well-formed record follows the bad spot. Recovery
//!     scans every byte offset after it for a header plausible there (a log id that fits, an LSN
//!     that the bytes between allow for that log) whose checksum matches. Finding one means the
//!     bad record was written and later damaged, and cutting would silently drop acknowledged
//!     records after it. The damage is put on the log whose record it was, when the damaged
//!     header still names a log and that log's next LSN, and on every log whose records then
//!     show a gap; those logs are refused, naming the file, the offset, the LSN and where the
//!     valid record follows, and recovery goes on from that record for the others. Damage that
//!     no log can be blamed for refuses every log, since any of them may have lost a record.
//!
//!   The price of that rule: a crash in the middle of a commit whose pages reached the disk out
//!   of order (a hole, then valid records of the same never-acknowledged commit) is also refused,
//!   and needs an operator, where cutting would have been correct. A false alarm that stops one
//!   log is preferred to silently losing acknowledged writes. Random bytes pass the plausibility
//!   check and a 32-bit checksum at one offset with a chance of about 2^-32.
//! - A log that cannot be opened keeps only itself down: opening it fails with why, every other
//!   log serves. Its segments are kept.
//! - The trim point is written to a temporary file, synced, renamed over `trim-point` and the
//!   directory synced: the file holds the old or the new trim point, never a mix. With all of a
//!   log's records trimmed (and their segments gone), recovery takes its tail from the trim point.
//! - If a write or sync fails (a full disk, a failing device), the writer waits for the syncs in
//!   flight and fails every commit not yet durable (never acknowledged, for every log in them),
//!   deletes the segments they created, truncates the last segment back to its durable length
//!   and syncs. After a failed `fsync` the kernel may have dropped dirty pages while calling them
//!   clean, so those bytes are never synced again and acknowledged: they are cut and later
//!   appends write afresh. If the cut fails too, every later
//!   append or trim tries it again first and is refused until it succeeds; nothing needs
//!   reopening to write again. A full disk or quota fails appends with [`Error::DiskFull`],
//!   naming the segments' directory. Reads of the durable prefix go on throughout.
//! - With [`LocalLogOptions::fsync`] off, nothing is synced: acknowledged records survive a
//!   process crash (they are in the page cache) but not a machine crash. Meant for tests.

mod cut;
mod read;
mod record;
mod recovery;
mod sync;
#[cfg(test)]
mod tests;
mod writer;

pub use cut::{
    BEFORE_CUT_SUFFIX, CutError, CutReport, LogInspection, cut_log, inspect_log, trim_log_offline,
};

use crate::{Entry, Error, LogProvider, LogState, Loglet, Result};
use async_trait::async_trait;
use bytes::Bytes;
use cairn_types::{LogId, Lsn};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
#[cfg(any(test, feature = "test-util"))]
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use tokio::sync::{mpsc, oneshot, watch};

const LOCK_FILE: &str = "LOCK";
/// How the refusal of every log for damage no log can be blamed for ends (see
/// [`Error::Corrupt`]): what tells it from the refusal of one log.
pub const EVERY_LOG_REFUSED: &str = "every log is refused";
const WAL_DIR: &str = "wal";

/// Settings of a [`LocalLogProvider`], shared by all of its logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalLogOptions {
    /// A new segment file is started when the current one would grow past this. A single record
    /// larger than this gets a segment of its own. At most `u32::MAX`.
    pub segment_bytes_max: u64,
    /// Largest payload of one record. At most `u32::MAX`.
    pub record_bytes_max: usize,
    /// Whether appends and trims are synced to disk before they are acknowledged. Only turn this
    /// off for tests: without it, a machine crash loses acknowledged records.
    pub fsync: bool,
    /// The writer stops gathering queued appends (of all logs) into one commit (one sync) once it
    /// holds this many records.
    pub batch_records_max: usize,
    /// The writer stops gathering queued appends into one commit once it holds this many payload
    /// bytes.
    pub batch_bytes_max: usize,
    /// How many append or trim requests (of all logs) may wait for the writer before callers are
    /// held back.
    pub queue_depth_max: usize,
    /// How many `fdatasync` calls may be in flight at once, each covering every commit written
    /// before it started. 1 syncs one commit group at a time; more lets a slow or busy disk
    /// overlap them (a second one starts only once the first has run for a while).
    pub syncs_in_flight_max: usize,
    /// A further sync starts only once the oldest one in flight has run this long: a fast disk
    /// then pays one sync per commit group, a slow or busy one overlaps them. Also the bound
    /// under which the last sync counts as fast, so that the writer syncs by itself.
    ///
    /// 2 ms: on two cores with the node CPU-bound (16 partitions, 100-key puts from 32 clients,
    /// syncs of a few hundred µs), 500 µs started overlapping syncs that only cost CPU. Four
    /// alternated 30-s runs of `cairn-bench --workloads put-batch` gave 503k and 510k keys/s
    /// (3.5-3.6 CPU µs per key) at 500 µs against 524k and 630k (2.9-3.4) at 2 ms, and one sync
    /// at a time gave about the same gain. Single-key puts and inserts through gRPC were even
    /// (0.58-0.59 and 0.65-0.67 of Redis's at 500 µs, 0.59-0.64 and 0.67-0.72 at 2 ms, p99
    /// 1.5-2.1 ms either way). A disk whose syncs take milliseconds still overlaps them.
    pub sync_overlap_after: std::time::Duration,
    /// How many payload bytes of its most recent records each log keeps in memory, so that
    /// reading right behind the appends needs no disk read. 0 keeps none.
    pub cache_bytes_max: usize,
    /// Allocate each segment's `segment_bytes_max` bytes when it is started (`fallocate`), so
    /// that a commit writes into blocks the file already has and its `fdatasync` need not also
    /// write the file's new size: on ext4 that took a sync from about 135 to 95 µs. Best effort: a
    /// file system that cannot, or a disk without the room, lets the segment grow as it is
    /// written. A segment is cut to what it holds when the next one starts.
    pub preallocate: bool,
}

impl Default for LocalLogOptions {
    fn default() -> Self {
        LocalLogOptions {
            segment_bytes_max: 64 * 1024 * 1024,
            record_bytes_max: 32 * 1024 * 1024,
            fsync: true,
            batch_records_max: 4096,
            batch_bytes_max: 8 * 1024 * 1024,
            queue_depth_max: 1024,
            syncs_in_flight_max: 4,
            sync_overlap_after: std::time::Duration::from_millis(2),
            cache_bytes_max: 4 * 1024 * 1024,
            preallocate: true,
        }
    }
}

impl LocalLogOptions {
    fn validate(&self) -> io::Result<()> {
        let invalid = |msg: String| Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
        if self.segment_bytes_max == 0 || self.segment_bytes_max > u64::from(u32::MAX) {
            return invalid(format!(
                "segment_bytes_max is {} but must be between 1 and {} (offsets in a segment are \
                 kept in 32 bits)",
                self.segment_bytes_max,
                u32::MAX
            ));
        }
        if self.record_bytes_max > u32::MAX as usize - record::HEADER_BYTES {
            return invalid(format!(
                "record_bytes_max is {} but a record must fit in 32 bits",
                self.record_bytes_max
            ));
        }
        if self.batch_records_max == 0
            || self.batch_bytes_max == 0
            || self.queue_depth_max == 0
            || self.syncs_in_flight_max == 0
        {
            return invalid(
                "batch_records_max, batch_bytes_max, queue_depth_max and syncs_in_flight_max must \
                 be at least 1"
                    .into(),
            );
        }
        Ok(())
    }
}

/// Opens the logs stored under one directory of this node. See the [module docs](self).
pub struct LocalLogProvider {
    core: Arc<Core>,
    /// One handle per log id, so that opening the same id twice returns the same log.
    loglets: Mutex<HashMap<LogId, Arc<LocalLoglet>>>,
}

impl std::fmt::Debug for LocalLogProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLogProvider")
            .field("dir", &self.core.shared.dir)
            .field("options", &self.core.shared.options)
            .finish_non_exhaustive()
    }
}

impl LocalLogProvider {
    /// Creates `dir` if needed, takes its lock, recovers every log in it (reading every segment
    /// once) and starts the writer. Blocking: call it off async threads.
    ///
    /// A log whose records are damaged or missing does not fail this: opening that log fails with
    /// why, and the others open. Fails with [`io::ErrorKind::InvalidInput`] for options out of
    /// range, [`io::ErrorKind::WouldBlock`] if another provider has `dir` open, or with the error
    /// of reading or creating the files. (No log is involved, so there is no log id for an
    /// [`Error`].)
    pub fn open(dir: impl Into<PathBuf>, options: LocalLogOptions) -> io::Result<LocalLogProvider> {
        options.validate()?;
        let dir = dir.into();
        record::create_dir_durably(&dir, options.fsync)?;
        let lock = lock_dir(&dir)?;
        let wal_dir = dir.join(WAL_DIR);
        record::create_dir_durably(&wal_dir, options.fsync)?;
        let recovered = recovery::recover(&dir, &wal_dir, &options)?;

        let shared = Arc::new(CoreShared {
            dir,
            wal_dir,
            options,
            logs: Mutex::new(HashMap::new()),
            #[cfg(any(test, feature = "test-util"))]
            commits: AtomicU64::new(0),
            #[cfg(any(test, feature = "test-util"))]
            overlapped_syncs: AtomicU64::new(0),
            #[cfg(any(test, feature = "test-util"))]
            faults: Arc::default(),
        });
        {
            let mut logs = shared.logs.lock();
            for (log_id, log) in recovered.logs {
                let log_dir = shared.dir.join(log_id.0.to_string());
                logs.insert(
                    log_id,
                    Arc::new(LogShared::new(
                        log_id,
                        log_dir,
                        log.trim_point,
                        log.tail,
                        log.runs,
                    )),
                );
            }
        }
        let (requests, queue) = mpsc::channel(shared.options.queue_depth_max);
        let writer =
            writer::Writer::new(shared.clone(), queue, requests.downgrade(), recovered.disk)?;
        let handle = thread::Builder::new()
            .name("cairn-log-writer".into())
            .spawn(move || writer.run())?;
        Ok(LocalLogProvider {
            core: Arc::new(Core {
                shared,
                refused: recovered.refused,
                refused_all: recovered.refused_all,
                requests: Some(requests),
                writer: Some(handle),
                _lock: lock,
            }),
            loglets: Mutex::new(HashMap::new()),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.core.shared.dir
    }

    pub fn options(&self) -> &LocalLogOptions {
        &self.core.shared.options
    }

    /// Like [`LogProvider::open`], with the concrete type.
    pub async fn open_local(&self, log_id: LogId) -> Result<Arc<LocalLoglet>> {
        if let Some(refusal) = self
            .core
            .refused
            .get(&log_id)
            .or(self.core.refused_all.as_ref())
        {
            return Err(refusal.error(log_id));
        }
        let mut loglets = self.loglets.lock();
        if let Some(loglet) = loglets.get(&log_id) {
            return Ok(loglet.clone());
        }
        let log = self.core.shared.log(log_id);
        let loglet = Arc::new(LocalLoglet {
            core: self.core.clone(),
            log,
        });
        loglets.insert(log_id, loglet.clone());
        Ok(loglet)
    }

    /// How many commits (writes of queued appends) the writer made, for all logs together.
    #[cfg(any(test, feature = "test-util"))]
    pub fn commits(&self) -> u64 {
        self.core.shared.commits.load(Ordering::Relaxed)
    }

    /// How many syncs started while another one was in flight.
    #[cfg(any(test, feature = "test-util"))]
    pub fn overlapped_syncs(&self) -> u64 {
        self.core.shared.overlapped_syncs.load(Ordering::Relaxed)
    }
}

#[async_trait]
impl LogProvider for LocalLogProvider {
    async fn open(&self, log_id: LogId) -> Result<Arc<dyn Loglet>> {
        let loglet: Arc<dyn Loglet> = self.open_local(log_id).await?;
        Ok(loglet)
    }
}

/// Why recovery refused a log; turned into its [`Error`] each time the log is opened.
#[derive(Debug, Clone)]
enum Refusal {
    Corrupt {
        path: String,
        offset: Option<u64>,
        detail: String,
    },
    OldLayout {
        path: PathBuf,
    },
}

impl Refusal {
    fn error(&self, log_id: LogId) -> Error {
        match self.clone() {
            Refusal::Corrupt {
                path,
                offset,
                detail,
            } => Error::Corrupt {
                log_id,
                path,
                offset,
                detail,
            },
            Refusal::OldLayout { path } => Error::Io {
                log_id,
                context: "opening the log",
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{} holds the log in the layout of an earlier Cairn version (a directory \
                         of segment files per log), which this version neither reads nor \
                         converts; keep running the earlier version on this base dir, or start \
                         this version on a new, empty one",
                        path.display()
                    ),
                ),
            },
        }
    }
}

/// What the provider and its logs share; keeps the writer running while any of them is alive.
struct Core {
    shared: Arc<CoreShared>,
    refused: HashMap<LogId, Refusal>,
    /// Damage recovery could not put on any log: every log is refused with it.
    refused_all: Option<Refusal>,
    /// `None` only while dropping: closing the queue is what tells the writer to stop.
    requests: Option<mpsc::Sender<Request>>,
    writer: Option<thread::JoinHandle<()>>,
    /// Held for the flock on it; released after the writer stopped.
    _lock: File,
}

impl Drop for Core {
    fn drop(&mut self) {
        // Closing the queue ends the writer's loop once it has answered what is queued. Waiting
        // for it matters: a provider reopened on the same directory right after must not find a
        // writer of the old one still appending behind its back.
        drop(self.requests.take());
        if let Some(writer) = self.writer.take()
            && writer.join().is_err()
        {
            tracing::error!(dir = %self.shared.dir.display(), "the log writer thread panicked");
        }
    }
}

/// What the writer, the logs and their readers share.
struct CoreShared {
    dir: PathBuf,
    wal_dir: PathBuf,
    options: LocalLogOptions,
    /// Every log the provider knows: recovered or opened since.
    logs: Mutex<HashMap<LogId, Arc<LogShared>>>,
    /// How many commits the writer made, so that tests can see group commit happen.
    #[cfg(any(test, feature = "test-util"))]
    commits: AtomicU64,
    /// How many syncs started while another was in flight.
    #[cfg(any(test, feature = "test-util"))]
    overlapped_syncs: AtomicU64,
    /// Faults the writer's IO meets on purpose, for tests of its error handling.
    #[cfg(any(test, feature = "test-util"))]
    faults: Arc<Faults>,
}

impl CoreShared {
    fn log(&self, log_id: LogId) -> Arc<LogShared> {
        self.logs
            .lock()
            .entry(log_id)
            .or_insert_with(|| {
                let dir = self.dir.join(log_id.0.to_string());
                Arc::new(LogShared::new(log_id, dir, 0, 0, VecDeque::new()))
            })
            .clone()
    }

    /// The error of a failed write: [`Error::DiskFull`] for a full disk or quota, so that callers
    /// can tell it from a failing device.
    fn write_error(&self, log_id: LogId, context: &'static str, source: io::Error) -> Error {
        if matches!(
            source.kind(),
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
        ) {
            Error::DiskFull {
                log_id,
                path: self.wal_dir.clone(),
                source,
            }
        } else {
            Error::Io {
                log_id,
                context,
                source,
            }
        }
    }
}

/// Faults injected into the writer's IO (feature `test-util`): each flag makes the matching call
/// fail, as a full disk or a failing device would, until it is cleared. They are the provider's,
/// shared by all of its logs.
#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
pub struct Faults {
    /// Writes hand half of their bytes to the file, then fail with "no space left on device".
    pub disk_full: std::sync::atomic::AtomicBool,
    /// `fdatasync` of a segment fails with an I/O error.
    pub sync_fails: std::sync::atomic::AtomicBool,
    /// Every `fdatasync` on a syncer thread first sleeps this many milliseconds, as on a slow or
    /// busy disk.
    pub sync_delay_ms: AtomicU64,
}

#[cfg(any(test, feature = "test-util"))]
impl Faults {
    fn check_write(&self) -> io::Result<()> {
        if self.disk_full.load(Ordering::SeqCst) {
            return Err(io::Error::from(io::ErrorKind::StorageFull));
        }
        Ok(())
    }

    fn check_sync(&self) -> io::Result<()> {
        let delay = self.sync_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            thread::sleep(std::time::Duration::from_millis(delay));
        }
        if self.sync_fails.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected fdatasync failure"));
        }
        Ok(())
    }
}

/// A segment file as readers see it.
struct SegmentFile {
    seq: u64,
    path: PathBuf,
    /// A read-only handle of its own, so that readers never share a file position with the writer.
    /// Readers holding it keep reading a segment that was deleted meanwhile.
    file: File,
}

/// Where one record is in its segment.
#[derive(Debug, Clone, Copy)]
struct Loc {
    offset: u32,
    len: u32,
}

/// Consecutive records of one log in one segment.
struct Run {
    segment: Arc<SegmentFile>,
    first_lsn: u64,
    locs: Vec<Loc>,
}

impl Run {
    fn last_lsn(&self) -> u64 {
        self.first_lsn + self.locs.len() as u64 - 1
    }
}

/// One log's state.
struct LogShared {
    log_id: LogId,
    /// Where its trim point is kept.
    dir: PathBuf,
    state: Mutex<LogInner>,
    durable: watch::Sender<Durable>,
}

struct LogInner {
    trim_point: u64,
    /// Last durable LSN. Only records up to it are read.
    tail: u64,
    /// Where records `trim_point + 1 ..= tail` are, in LSN order.
    runs: VecDeque<Run>,
    /// Payloads of records `tail - cache.len() + 1 ..= tail`.
    cache: VecDeque<Bytes>,
    cache_bytes: usize,
}

#[derive(Debug, Clone, Copy)]
struct Durable {
    tail: u64,
    /// False once the writer stopped (the provider was dropped, or the writer panicked); nobody
    /// will move the tail any more.
    writer_running: bool,
}

impl LogShared {
    fn new(log_id: LogId, dir: PathBuf, trim_point: u64, tail: u64, runs: VecDeque<Run>) -> Self {
        let (durable, _) = watch::channel(Durable {
            tail,
            writer_running: true,
        });
        LogShared {
            log_id,
            dir,
            state: Mutex::new(LogInner {
                trim_point,
                tail,
                runs,
                cache: VecDeque::new(),
                cache_bytes: 0,
            }),
            durable,
        }
    }
}

impl LogInner {
    /// Makes records up to `tail` readable: where they are and, within `cache_max`, their
    /// payloads.
    fn publish(
        &mut self,
        records: impl IntoIterator<Item = (Arc<SegmentFile>, Loc, Bytes)>,
        cache_max: usize,
    ) {
        for (segment, loc, payload) in records {
            self.tail += 1;
            match self.runs.back_mut() {
                Some(run) if Arc::ptr_eq(&run.segment, &segment) => run.locs.push(loc),
                _ => self.runs.push_back(Run {
                    segment,
                    first_lsn: self.tail,
                    locs: vec![loc],
                }),
            }
            if cache_max > 0 {
                self.cache_bytes += payload.len();
                self.cache.push_back(payload);
            }
        }
        while self.cache_bytes > cache_max
            && let Some(evicted) = self.cache.pop_front()
        {
            self.cache_bytes -= evicted.len();
        }
    }

    /// Forgets records up to `trim_point`.
    fn trim(&mut self, trim_point: u64) {
        self.trim_point = trim_point;
        while self
            .runs
            .front()
            .is_some_and(|r| r.last_lsn() <= trim_point)
        {
            self.runs.pop_front();
        }
        if let Some(run) = self.runs.front_mut()
            && run.first_lsn <= trim_point
        {
            run.locs.drain(..(trim_point + 1 - run.first_lsn) as usize);
            run.first_lsn = trim_point + 1;
        }
        let cache_first = self.tail + 1 - self.cache.len() as u64;
        let trimmed = (trim_point + 1)
            .saturating_sub(cache_first)
            .min(self.cache.len() as u64);
        for _ in 0..trimmed {
            if let Some(evicted) = self.cache.pop_front() {
                self.cache_bytes -= evicted.len();
            }
        }
    }
}

enum Request {
    Append {
        log: Arc<LogShared>,
        payloads: Vec<Bytes>,
        reply: oneshot::Sender<Result<Lsn>>,
    },
    Trim {
        log: Arc<LogShared>,
        up_to: u64,
        reply: oneshot::Sender<Result<()>>,
    },
    /// A syncer finished: wakes the writer to settle its result.
    Wake,
}

/// One log of a [`LocalLogProvider`]. The provider's writer runs while the provider or any of
/// its logs is alive; dropping the last of them stops it (after the commit it is busy with).
pub struct LocalLoglet {
    core: Arc<Core>,
    log: Arc<LogShared>,
}

impl LocalLoglet {
    async fn submit<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T>>) -> Request,
    ) -> Result<T> {
        let log_id = self.log.log_id;
        let requests = self
            .core
            .requests
            .as_ref()
            .ok_or(Error::Shutdown { log_id })?;
        let (reply, answer) = oneshot::channel();
        requests
            .send(make(reply))
            .await
            .map_err(|_| Error::Shutdown { log_id })?;
        answer.await.map_err(|_| Error::Shutdown { log_id })?
    }

    /// How many commits (syncs) the provider's writer made, for all of its logs together.
    #[cfg(any(test, feature = "test-util"))]
    pub fn batches(&self) -> u64 {
        self.core.shared.commits.load(Ordering::Relaxed)
    }

    /// The faults the provider's writer meets from now on (for all of its logs).
    #[cfg(any(test, feature = "test-util"))]
    pub fn faults(&self) -> Arc<Faults> {
        self.core.shared.faults.clone()
    }
}

#[async_trait]
impl Loglet for LocalLoglet {
    fn log_id(&self) -> LogId {
        self.log.log_id
    }

    fn record_bytes_max(&self) -> usize {
        self.core.shared.options.record_bytes_max
    }

    async fn append(&self, payloads: Vec<Bytes>) -> Result<Lsn> {
        if payloads.is_empty() {
            return Ok(Lsn(self.log.state.lock().tail));
        }
        let limit = self.core.shared.options.record_bytes_max;
        if let Some(too_large) = payloads.iter().find(|p| p.len() > limit) {
            return Err(Error::RecordTooLarge {
                log_id: self.log.log_id,
                size: too_large.len(),
                limit,
            });
        }
        let log = self.log.clone();
        self.submit(|reply| Request::Append {
            log,
            payloads,
            reply,
        })
        .await
    }

    async fn read(&self, from: Lsn, max_records: usize) -> Result<Vec<Entry>> {
        let plan = read::plan(&self.log, from.0, max_records)?;
        if plan.disk.is_empty() {
            return Ok(plan.cached);
        }
        let log_id = self.log.log_id;
        blocking(log_id, move || read::execute(log_id, plan)).await
    }

    async fn wait_for_tail(&self, lsn: Lsn) -> Result<()> {
        let log_id = self.log.log_id;
        let mut durable = self.log.durable.subscribe();
        let reached = durable
            .wait_for(|d| d.tail >= lsn.0 || !d.writer_running)
            .await
            .map_err(|_| Error::Shutdown { log_id })?
            .tail
            >= lsn.0;
        if reached {
            Ok(())
        } else {
            Err(Error::Shutdown { log_id })
        }
    }

    async fn trim(&self, up_to: Lsn) -> Result<()> {
        if up_to.0 <= self.log.state.lock().trim_point {
            return Ok(());
        }
        let log = self.log.clone();
        self.submit(|reply| Request::Trim {
            log,
            up_to: up_to.0,
            reply,
        })
        .await
    }

    async fn state(&self) -> Result<LogState> {
        let state = self.log.state.lock();
        Ok(LogState {
            trim_point: Lsn(state.trim_point),
            tail: Lsn(state.tail),
        })
    }
}

/// Takes the directory's `flock`, so that two providers never write the same logs.
fn lock_dir(dir: &Path) -> io::Result<File> {
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK_FILE))?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(fs::TryLockError::WouldBlock) => Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!(
                "{} is in use by another open log provider (another node process on the same \
                 base dir?); stop it first",
                dir.display()
            ),
        )),
        Err(fs::TryLockError::Error(e)) => Err(e),
    }
}

/// Runs blocking IO on tokio's blocking pool, so that a slow disk does not stall async tasks.
async fn blocking<T: Send + 'static>(
    log_id: LogId,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // The runtime is shutting down.
        Err(_) => Err(Error::Shutdown { log_id }),
    }
}
