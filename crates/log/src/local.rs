//! The `local` provider: an embedded, durable log on one node's disk.
//!
//! Each log lives in its own directory, `<dir>/<log_id>/`:
//!
//! ```text
//!   LOCK                        held (flock) while the log is open, so two providers never share it
//!   trim-point                  [u64 trim point LE][u32 crc32c LE of the u64]; absent = never trimmed
//!   00000000000000000001.seg    segment files, named by the LSN of their first record
//!   00000000000000004711.seg
//! ```
//!
//! A segment is a plain sequence of records, each framed as
//!
//! ```text
//!   [u32 payload len LE][u32 crc32c LE of (len bytes ++ lsn bytes ++ payload)][u64 lsn LE][payload]
//! ```
//!
//! The LSN is stored in every record (not only implied by its position) so that recovery can tell
//! a stale or misplaced record from the one it expects, and the checksum covers the length so that
//! a torn length cannot make garbage look like a record.
//!
//! # Writes: one writer per log, group commit
//!
//! Appends and trims go through a bounded queue to one writer thread per log. The writer takes
//! every request that is queued (up to [`LocalLogOptions::batch_records_max`] records or
//! [`LocalLogOptions::batch_bytes_max`] bytes), writes them all, syncs once, and only then
//! publishes the new tail and acknowledges them. One fsync is paid per batch rather than per
//! append, so throughput grows with the number of concurrent appenders. The bounded queue pushes
//! back on appenders when the disk cannot keep up instead of buffering without limit.
//!
//! # Reads
//!
//! Only the durable prefix is ever read: the writer publishes a record's length and LSN to readers
//! after it was synced. Memory stays bounded by the log's size only through a sparse index (the
//! file offset of every [`INDEX_INTERVAL`]th record of each segment); a read seeks to the nearest
//! indexed record and walks forward. Reads run on tokio's blocking pool, use positional reads on
//! their own file handles, and hold the state lock only to plan which bytes to read, so they never
//! wait for the writer's disk IO and the writer never waits for theirs.
//!
//! # Crash consistency
//!
//! The invariant: everything that was acknowledged is in the durable prefix of the segments, and
//! recovery finds exactly that prefix again.
//!
//! - An append is acknowledged only after its bytes were written and `fdatasync`ed, and, if it
//!   created a segment file, after the directory was fsynced too, so the file's name is as durable
//!   as its content (the same goes for the log's directory and the provider's). A crash before
//!   the acknowledgement may leave any part of the batch on disk (a prefix, garbage, or, since
//!   pages reach the disk in any order, valid records after a hole). Such an append was never
//!   acknowledged, so keeping a valid prefix of it, or none of it, are both correct outcomes;
//!   valid records after a hole are the one case recovery refuses (below).
//! - Before the writer starts a new segment it syncs the previous one. So the only segment that
//!   can hold an unsynced, possibly torn tail is the last one; damage in an older segment cannot
//!   come from a crash, and recovery refuses it as [`Error::Corrupt`].
//! - In the last segment, recovery reads records until the first one that is short, fails its
//!   checksum or carries an unexpected LSN (the bad spot), then decides between two causes:
//!   - A torn tail: an incomplete final write. It has nothing valid after the bad spot, because
//!     nothing was written after the write that tore. Recovery cuts the segment at the bad spot
//!     and logs a warning with the number of bytes it dropped; those records were never
//!     acknowledged.
//!   - Corruption: a well-formed record follows the bad spot. Recovery scans every byte offset
//!     after it for a header whose LSN is plausible there (at least the bad record's LSN, and no
//!     further ahead than the bytes between could hold records of at least a header each) and
//!     whose checksum over length, LSN and payload matches. Finding one means the bad record was
//!     written and later damaged (a bit flip, a bad sector), and cutting there would silently
//!     drop acknowledged records after it. Recovery refuses to open the log, naming the file,
//!     the offset and the LSN of the bad record and where the valid one follows.
//!
//!   The price of that rule: a crash in the middle of a batch whose pages reached the disk out
//!   of order (a hole, then valid records of the same never-acknowledged batch) is also refused,
//!   and needs an operator (who, knowing no write was acknowledged past that offset, cuts the
//!   file there), where cutting would have been correct. A false alarm that stops one log is
//!   preferred to silently losing acknowledged writes. Random bytes pass the plausibility check
//!   and a 32-bit checksum at one offset with a chance of about 2^-32, so garbage alone does not
//!   make a torn tail look like corruption; the scan costs one pass over the rest of the
//!   segment, only when recovery finds damage.
//! - The trim point is written to a temporary file, synced, renamed over `trim-point` and the
//!   directory synced. Rename is atomic, so the file holds the old or the new trim point, never a
//!   mix. Segments are deleted only after the new trim point is durable; a crash between the two
//!   leaves segments that recovery recognises as wholly trimmed and deletes. That ordering is also
//!   why the tail survives trimming everything: with no segment left, recovery takes the tail from
//!   the trim point and the next segment starts at `trim_point + 1`.
//! - If a write or sync fails (a full disk, a failing device), the writer fails that batch (never
//!   acknowledged), deletes the segments it created, truncates the last segment back to its
//!   durable length and syncs. Its bytes are never synced again and acknowledged: after a failed
//!   `fsync` the kernel may have dropped dirty pages while calling them clean, so they are cut
//!   and later appends write afresh. The durable prefix was synced before and does not depend on
//!   the failed call. If the cut fails too, every later append or trim tries it again first and
//!   is refused until it succeeds; the log never needs reopening to write again. A full disk or
//!   quota fails appends with [`Error::DiskFull`], naming the log's directory. Reads of the
//!   durable prefix go on throughout.
//! - With [`LocalLogOptions::fsync`] off, nothing is synced: acknowledged records survive a
//!   process crash (they are in the page cache) but not a machine crash. Meant for tests.

use crate::{Entry, Error, LogProvider, LogState, Loglet, Result};
use async_trait::async_trait;
use bytes::Bytes;
use cairn_types::{LogId, Lsn};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use tokio::sync::{OnceCell, mpsc, oneshot, watch};

/// Every how many records of a segment the sparse index keeps a file offset. A read walks past at
/// most `INDEX_INTERVAL - 1` record headers to find its first record; the index costs 8 bytes per
/// `INDEX_INTERVAL` records.
pub const INDEX_INTERVAL: u64 = 64;

/// `[u32 len][u32 crc][u64 lsn]`.
const HEADER_BYTES: usize = 16;
/// How much a read fetches from a segment at once, so that reading many small records costs a few
/// system calls rather than two per record.
const READ_CHUNK_BYTES: usize = 256 * 1024;
/// The writer hands its buffer to the kernel whenever it holds this much, so that one huge append
/// does not need a second copy of itself in memory.
const WRITE_CHUNK_BYTES: usize = 1024 * 1024;
const SEGMENT_SUFFIX: &str = ".seg";
const TRIM_POINT_FILE: &str = "trim-point";
const TRIM_POINT_TMP_FILE: &str = "trim-point.tmp";
const LOCK_FILE: &str = "LOCK";

/// Settings of a [`LocalLogProvider`], shared by all of its logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalLogOptions {
    /// A new segment file is started when the current one would grow past this. A single record
    /// larger than this gets a segment of its own.
    pub segment_bytes_max: u64,
    /// Largest payload of one record. At most `u32::MAX`.
    pub record_bytes_max: usize,
    /// Whether appends and trims are synced to disk before they are acknowledged. Only turn this
    /// off for tests: without it, a machine crash loses acknowledged records.
    pub fsync: bool,
    /// The writer stops gathering queued appends into one batch (one sync) once it holds this many
    /// records.
    pub batch_records_max: usize,
    /// The writer stops gathering queued appends into one batch once it holds this many payload
    /// bytes.
    pub batch_bytes_max: usize,
    /// How many append or trim requests may wait for the writer before callers are held back.
    pub queue_depth_max: usize,
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
        }
    }
}

impl LocalLogOptions {
    fn validate(&self) -> io::Result<()> {
        let invalid = |msg: String| Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
        if self.segment_bytes_max == 0 {
            return invalid("segment_bytes_max must be at least 1".into());
        }
        if self.record_bytes_max > u32::MAX as usize {
            return invalid(format!(
                "record_bytes_max is {} but a record's length must fit in 32 bits",
                self.record_bytes_max
            ));
        }
        if self.batch_records_max == 0 || self.batch_bytes_max == 0 || self.queue_depth_max == 0 {
            return invalid(
                "batch_records_max, batch_bytes_max and queue_depth_max must be at least 1".into(),
            );
        }
        Ok(())
    }
}

/// Opens the logs stored under one directory of this node. See the [module docs](self).
pub struct LocalLogProvider {
    dir: PathBuf,
    options: LocalLogOptions,
    /// One cell per log id, so that concurrent opens of the same id share one recovery and two
    /// different ids recover in parallel.
    logs: Mutex<HashMap<LogId, Arc<OnceCell<Arc<LocalLoglet>>>>>,
}

impl std::fmt::Debug for LocalLogProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLogProvider")
            .field("dir", &self.dir)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl LocalLogProvider {
    /// Creates `dir` if needed. Logs are opened (and recovered) lazily by [`LogProvider::open`].
    ///
    /// Fails with [`io::ErrorKind::InvalidInput`] for options out of range, or with the error of
    /// creating `dir`. (No log is involved yet, so there is no log id for an [`Error`].)
    pub fn open(dir: impl Into<PathBuf>, options: LocalLogOptions) -> io::Result<LocalLogProvider> {
        options.validate()?;
        let dir = dir.into();
        create_dir_durably(&dir, options.fsync)?;
        Ok(LocalLogProvider {
            dir,
            options,
            logs: Mutex::new(HashMap::new()),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn options(&self) -> &LocalLogOptions {
        &self.options
    }

    /// Like [`LogProvider::open`], with the concrete type.
    pub async fn open_local(&self, log_id: LogId) -> Result<Arc<LocalLoglet>> {
        let cell = self.logs.lock().entry(log_id).or_default().clone();
        let loglet = cell
            .get_or_try_init(|| {
                let dir = self.dir.join(log_id.0.to_string());
                let options = self.options.clone();
                blocking(log_id, move || LocalLoglet::open(log_id, dir, options))
            })
            .await?;
        Ok(loglet.clone())
    }
}

#[async_trait]
impl LogProvider for LocalLogProvider {
    async fn open(&self, log_id: LogId) -> Result<Arc<dyn Loglet>> {
        let loglet: Arc<dyn Loglet> = self.open_local(log_id).await?;
        Ok(loglet)
    }
}

/// One log of a [`LocalLogProvider`]. Dropping the last handle stops its writer thread; that
/// waits for the batch the writer is busy with (at most one sync).
pub struct LocalLoglet {
    shared: Arc<Shared>,
    /// `None` only while dropping: closing the queue is what tells the writer to stop.
    requests: Option<mpsc::Sender<Request>>,
    writer: Option<thread::JoinHandle<()>>,
    /// Held for the flock on it; released when the log is dropped, after the writer stopped.
    _lock: File,
}

/// What the writer and the readers share.
struct Shared {
    log_id: LogId,
    dir: PathBuf,
    options: LocalLogOptions,
    state: Mutex<State>,
    durable: watch::Sender<Durable>,
    /// How many batches the writer committed, so that tests can see group commit happen.
    #[cfg(any(test, feature = "test-util"))]
    batches: AtomicU64,
    /// Faults the writer's IO meets on purpose, for tests of its error handling.
    #[cfg(any(test, feature = "test-util"))]
    faults: Arc<Faults>,
}

/// Faults injected into a log writer's IO (feature `test-util`): each flag makes the matching
/// call fail, as a full disk or a failing device would, until it is cleared.
#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
pub struct Faults {
    /// Writes hand half of their bytes to the file, then fail with "no space left on device".
    pub disk_full: std::sync::atomic::AtomicBool,
    /// `fdatasync` of a segment fails with an I/O error.
    pub sync_fails: std::sync::atomic::AtomicBool,
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
        if self.sync_fails.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected fdatasync failure"));
        }
        Ok(())
    }
}

struct State {
    trim_point: u64,
    /// Last durable LSN. Only records up to it are read.
    tail: u64,
    /// Ordered by LSN and contiguous. May contain records at or below the trim point (in the
    /// first segment, which also holds records above it).
    segments: VecDeque<Segment>,
}

/// A segment as readers see it: only its durable part.
struct Segment {
    first_lsn: u64,
    /// `first_lsn - 1` while empty.
    last_lsn: u64,
    /// Durable length in bytes.
    len: u64,
    /// `index[i]` is the offset of record `first_lsn + i * INDEX_INTERVAL`.
    index: Vec<u64>,
    path: PathBuf,
    /// A read-only handle of its own, so that readers never share a file position with the writer.
    file: Arc<File>,
}

#[derive(Debug, Clone, Copy)]
struct Durable {
    tail: u64,
    /// False once the writer stopped (the log was dropped, or the writer panicked); nobody will
    /// move the tail any more.
    writer_running: bool,
}

enum Request {
    Append {
        payloads: Vec<Bytes>,
        reply: oneshot::Sender<Result<Lsn>>,
    },
    Trim {
        up_to: u64,
        reply: oneshot::Sender<Result<()>>,
    },
}

impl LocalLoglet {
    /// Recovers the log in `dir` and starts its writer. Blocking.
    fn open(log_id: LogId, dir: PathBuf, options: LocalLogOptions) -> Result<Arc<LocalLoglet>> {
        let recovered = recover(log_id, &dir, &options)?;
        let (durable, _) = watch::channel(Durable {
            tail: recovered.tail,
            writer_running: true,
        });
        let shared = Arc::new(Shared {
            log_id,
            dir,
            state: Mutex::new(State {
                trim_point: recovered.trim_point,
                tail: recovered.tail,
                segments: recovered.segments,
            }),
            durable,
            #[cfg(any(test, feature = "test-util"))]
            batches: AtomicU64::new(0),
            #[cfg(any(test, feature = "test-util"))]
            faults: Arc::default(),
            options,
        });
        let (requests, queue) = mpsc::channel(shared.options.queue_depth_max);
        let writer = Writer {
            shared: shared.clone(),
            queue,
            active: recovered.active,
            tail: recovered.tail,
            buf: Vec::new(),
            failed: None,
        };
        let handle = thread::Builder::new()
            .name(format!("cairn-log-{log_id}"))
            .spawn(move || writer.run())
            .map_err(|source| Error::Io {
                log_id,
                context: "starting the writer thread",
                source,
            })?;
        Ok(Arc::new(LocalLoglet {
            shared,
            requests: Some(requests),
            writer: Some(handle),
            _lock: recovered.lock,
        }))
    }

    async fn submit<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T>>) -> Request,
    ) -> Result<T> {
        let log_id = self.shared.log_id;
        let requests = self.requests.as_ref().ok_or(Error::Shutdown { log_id })?;
        let (reply, answer) = oneshot::channel();
        requests
            .send(make(reply))
            .await
            .map_err(|_| Error::Shutdown { log_id })?;
        answer.await.map_err(|_| Error::Shutdown { log_id })?
    }

    /// How many batches (syncs) the writer committed.
    #[cfg(any(test, feature = "test-util"))]
    pub fn batches(&self) -> u64 {
        self.shared.batches.load(Ordering::Relaxed)
    }

    /// The faults its writer's IO meets from now on.
    #[cfg(any(test, feature = "test-util"))]
    pub fn faults(&self) -> Arc<Faults> {
        self.shared.faults.clone()
    }
}

impl Drop for LocalLoglet {
    fn drop(&mut self) {
        // Closing the queue ends the writer's loop once it has answered what is queued. Waiting
        // for it matters: a provider reopened on the same directory right after must not find a
        // writer of the old one still appending behind its back.
        drop(self.requests.take());
        if let Some(writer) = self.writer.take()
            && writer.join().is_err()
        {
            tracing::error!(log_id = %self.shared.log_id, "the log writer thread panicked");
        }
    }
}

#[async_trait]
impl Loglet for LocalLoglet {
    fn log_id(&self) -> LogId {
        self.shared.log_id
    }

    async fn append(&self, payloads: Vec<Bytes>) -> Result<Lsn> {
        if payloads.is_empty() {
            return Ok(Lsn(self.shared.state.lock().tail));
        }
        let limit = self.shared.options.record_bytes_max;
        if let Some(too_large) = payloads.iter().find(|p| p.len() > limit) {
            return Err(Error::RecordTooLarge {
                log_id: self.shared.log_id,
                size: too_large.len(),
                limit,
            });
        }
        self.submit(|reply| Request::Append { payloads, reply })
            .await
    }

    async fn read(&self, from: Lsn, max_records: usize) -> Result<Vec<Entry>> {
        let plan = self.shared.plan_read(from.0, max_records)?;
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        let shared = self.shared.clone();
        blocking(self.shared.log_id, move || shared.read_planned(plan)).await
    }

    async fn wait_for_tail(&self, lsn: Lsn) -> Result<()> {
        let mut durable = self.shared.durable.subscribe();
        let reached = durable
            .wait_for(|d| d.tail >= lsn.0 || !d.writer_running)
            .await
            .map_err(|_| Error::Shutdown {
                log_id: self.shared.log_id,
            })?
            .tail
            >= lsn.0;
        if reached {
            Ok(())
        } else {
            Err(self.shared.stopped_error())
        }
    }

    async fn trim(&self, up_to: Lsn) -> Result<()> {
        if up_to.0 <= self.shared.state.lock().trim_point {
            return Ok(());
        }
        self.submit(|reply| Request::Trim {
            up_to: up_to.0,
            reply,
        })
        .await
    }

    async fn state(&self) -> Result<LogState> {
        let state = self.shared.state.lock();
        Ok(LogState {
            trim_point: Lsn(state.trim_point),
            tail: Lsn(state.tail),
        })
    }
}

/// The part of one segment that a read needs.
struct ReadSpan {
    file: Arc<File>,
    path: PathBuf,
    /// The indexed record the walk starts at.
    start_lsn: u64,
    start_offset: u64,
    /// The records to return.
    from: u64,
    to: u64,
    /// Durable length of the segment when the read was planned; nothing past it is looked at.
    end_offset: u64,
}

impl Shared {
    /// The error for a request that the writer will not serve any more: it only stops when the
    /// log is dropped (or it panicked).
    fn stopped_error(&self) -> Error {
        Error::Shutdown {
            log_id: self.log_id,
        }
    }

    /// The error of a failed write: [`Error::DiskFull`] for a full disk or quota, so that callers
    /// can tell it from a failing device.
    fn write_error(&self, context: &'static str, source: io::Error) -> Error {
        if matches!(
            source.kind(),
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
        ) {
            Error::DiskFull {
                log_id: self.log_id,
                path: self.dir.clone(),
                source,
            }
        } else {
            Error::Io {
                log_id: self.log_id,
                context,
                source,
            }
        }
    }

    /// Decides under the state lock which bytes a read needs, so that the disk IO itself runs
    /// without the lock.
    fn plan_read(&self, from: u64, max_records: usize) -> Result<Vec<ReadSpan>> {
        let state = self.state.lock();
        if from <= state.trim_point {
            return Err(Error::Trimmed {
                log_id: self.log_id,
                requested: Lsn(from),
                trim_point: Lsn(state.trim_point),
            });
        }
        if max_records == 0 || from > state.tail {
            return Ok(Vec::new());
        }
        let to = state.tail.min(from.saturating_add(max_records as u64 - 1));
        let first = state
            .segments
            .partition_point(|s| s.first_lsn <= from)
            .saturating_sub(1);
        let mut plan = Vec::new();
        for segment in state.segments.range(first..) {
            if segment.first_lsn > to {
                break;
            }
            let lo = from.max(segment.first_lsn);
            let hi = to.min(segment.last_lsn);
            if lo > hi {
                continue;
            }
            let slot = (lo - segment.first_lsn) / INDEX_INTERVAL;
            let start_offset = *segment
                .index
                .get(slot as usize)
                .expect("the index has an entry for every INDEX_INTERVAL-th durable record");
            plan.push(ReadSpan {
                file: segment.file.clone(),
                path: segment.path.clone(),
                start_lsn: segment.first_lsn + slot * INDEX_INTERVAL,
                start_offset,
                from: lo,
                to: hi,
                end_offset: segment.len,
            });
        }
        Ok(plan)
    }

    /// Blocking.
    fn read_planned(&self, plan: Vec<ReadSpan>) -> Result<Vec<Entry>> {
        let mut entries = Vec::new();
        for span in plan {
            let mut reader = SegmentReader::new(&span.file, span.end_offset);
            let mut pos = span.start_offset;
            for lsn in span.start_lsn..=span.to {
                let wanted = lsn >= span.from;
                let (next, payload) = read_record(&mut reader, pos, lsn, wanted)
                    .map_err(|e| e.into_error(self.log_id, &span.path, pos, "reading a segment"))?;
                if let Some(payload) = payload {
                    entries.push(Entry {
                        lsn: Lsn(lsn),
                        payload: Bytes::copy_from_slice(payload),
                    });
                }
                pos = next;
            }
        }
        Ok(entries)
    }
}

/// The segment the writer appends to.
struct Active {
    file: File,
    first_lsn: u64,
    /// Bytes written to the file so far.
    written: u64,
}

/// What a batch changed in one segment, published to readers once the batch is durable.
struct SegmentUpdate {
    first_lsn: u64,
    last_lsn: u64,
    len: u64,
    new_index: Vec<u64>,
}

/// Owns the write side of one log; runs on its own thread.
struct Writer {
    shared: Arc<Shared>,
    queue: mpsc::Receiver<Request>,
    active: Option<Active>,
    /// Last durable LSN; the writer is the only one that moves it.
    tail: u64,
    /// Encoded records not yet handed to the kernel; reused between batches.
    buf: Vec<u8>,
    /// Why the files may hold more than the durable prefix: a write or sync failed and cutting
    /// its leftovers failed too. Every request first tries again to cut them.
    failed: Option<(&'static str, io::Error)>,
}

impl Writer {
    fn run(mut self) {
        while let Some(first) = self.queue.blocking_recv() {
            let mut appends = Vec::new();
            let mut trims = Vec::new();
            let (mut records, mut bytes) = (0usize, 0usize);
            let mut next = Some(first);
            while let Some(request) = next.take() {
                match request {
                    Request::Append { payloads, reply } => {
                        records += payloads.len();
                        bytes += payloads.iter().map(Bytes::len).sum::<usize>();
                        appends.push((payloads, reply));
                    }
                    Request::Trim { up_to, reply } => trims.push((up_to, reply)),
                }
                if records < self.shared.options.batch_records_max
                    && bytes < self.shared.options.batch_bytes_max
                {
                    next = self.queue.try_recv().ok();
                }
            }
            self.serve_appends(appends);
            for (up_to, reply) in trims {
                let _ = reply.send(self.serve_trim(up_to));
            }
        }
    }

    fn serve_appends(&mut self, appends: Vec<(Vec<Bytes>, oneshot::Sender<Result<Lsn>>)>) {
        if appends.is_empty() {
            return;
        }
        let result = match self.repair() {
            Ok(()) => {
                let batch: Vec<&[Bytes]> = appends.iter().map(|(p, _)| p.as_slice()).collect();
                self.write_batch(&batch)
            }
            Err(failure) => Err(failure),
        };
        match result {
            Ok(lasts) => {
                for ((_, reply), last) in appends.into_iter().zip(lasts) {
                    // The caller may have given up waiting; the records are durable regardless.
                    let _ = reply.send(Ok(Lsn(last)));
                }
            }
            Err((context, error)) => {
                tracing::error!(
                    log_id = %self.shared.log_id, %error, context,
                    "log write failed; the batch is refused and its bytes are cut from the log"
                );
                // Cut before answering, so that whoever sees the error finds the log as it was.
                if let Err((context, error)) = self.cut_unpublished() {
                    tracing::error!(
                        log_id = %self.shared.log_id, %error, context,
                        "cannot cut the bytes of a failed write; appends are refused until it can"
                    );
                    self.failed = Some((context, error));
                }
                let (kind, message) = (error.kind(), error.to_string());
                let mut source = Some(error);
                for (_, reply) in appends {
                    let source = source
                        .take()
                        .unwrap_or_else(|| io::Error::new(kind, message.clone()));
                    let _ = reply.send(Err(self.shared.write_error(context, source)));
                }
            }
        }
    }

    /// After a failed write whose leftovers could not be cut: tries again. `Err` is why appends
    /// and trims are refused for now.
    fn repair(&mut self) -> Result<(), (&'static str, io::Error)> {
        if self.failed.is_none() {
            return Ok(());
        }
        self.cut_unpublished()?;
        tracing::info!(log_id = %self.shared.log_id, "the log accepts appends again");
        self.failed = None;
        Ok(())
    }

    /// Brings the files back to what readers see (the durable prefix): deletes segments that
    /// the failed batch created, truncates the last one to its published length and syncs. The
    /// published prefix was synced before, so nothing acknowledged depends on a failed `fsync`;
    /// the failed batch's bytes are never synced and acknowledged later (after a failed `fsync`
    /// the kernel may have dropped them while calling them clean), they are cut and written anew.
    fn cut_unpublished(&mut self) -> Result<(), (&'static str, io::Error)> {
        self.buf.clear();
        self.active = None;
        // Segments past the tail hold nothing published. They leave the state only once their
        // files are gone, so that a repair that fails half-way finds them again.
        let (unpublished, last) = {
            let state = self.shared.state.lock();
            let tail = state.tail;
            let unpublished: Vec<PathBuf> = state
                .segments
                .iter()
                .filter(|s| s.first_lsn > tail)
                .map(|s| s.path.clone())
                .collect();
            let last = state
                .segments
                .iter()
                .rev()
                .find(|s| s.first_lsn <= tail)
                .map(|s| (s.first_lsn, s.len, s.path.clone()));
            (unpublished, last)
        };
        for path in &unpublished {
            match fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(("deleting a segment of a failed write", e));
                }
                _ => {}
            }
        }
        if !unpublished.is_empty() {
            let mut state = self.shared.state.lock();
            let tail = state.tail;
            while state.segments.back().is_some_and(|s| s.first_lsn > tail) {
                state.segments.pop_back();
            }
            drop(state);
            if self.shared.options.fsync {
                sync_dir(&self.shared.dir).map_err(|e| ("syncing the log directory", e))?;
            }
        }
        if let Some((first_lsn, len, path)) = last {
            let file = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| ("reopening the last segment", e))?;
            file.set_len(len)
                .map_err(|e| ("cutting a failed write from a segment", e))?;
            if self.shared.options.fsync {
                #[cfg(any(test, feature = "test-util"))]
                self.shared
                    .faults
                    .check_sync()
                    .map_err(|e| ("cutting a failed write from a segment", e))?;
                file.sync_data()
                    .map_err(|e| ("cutting a failed write from a segment", e))?;
            }
            self.active = Some(Active {
                file,
                first_lsn,
                written: len,
            });
        }
        Ok(())
    }

    /// Writes and syncs the batch, then publishes it. Returns the last LSN of each append.
    fn write_batch(&mut self, batch: &[&[Bytes]]) -> Result<Vec<u64>, (&'static str, io::Error)> {
        let max = self.shared.options.segment_bytes_max;
        let mut next = self.tail + 1;
        let mut updates: Vec<SegmentUpdate> = Vec::new();
        let mut lasts = Vec::with_capacity(batch.len());
        for payloads in batch {
            for payload in *payloads {
                let record_len = (HEADER_BYTES + payload.len()) as u64;
                let active_len = self
                    .active
                    .as_ref()
                    .map(|a| a.written + self.buf.len() as u64);
                let roll = match active_len {
                    None => true,
                    Some(len) => len > 0 && len + record_len > max,
                };
                if roll {
                    self.roll(next)?;
                }
                let active = self
                    .active
                    .as_ref()
                    .expect("roll() leaves an active segment");
                let offset = active.written + self.buf.len() as u64;
                if updates.last().map(|u| u.first_lsn) != Some(active.first_lsn) {
                    updates.push(SegmentUpdate {
                        first_lsn: active.first_lsn,
                        last_lsn: 0,
                        len: 0,
                        new_index: Vec::new(),
                    });
                }
                let update = updates.last_mut().expect("pushed above");
                if (next - active.first_lsn).is_multiple_of(INDEX_INTERVAL) {
                    update.new_index.push(offset);
                }
                update.last_lsn = next;
                update.len = offset + record_len;
                encode_record(&mut self.buf, next, payload);
                if self.buf.len() >= WRITE_CHUNK_BYTES {
                    self.flush()?;
                }
                next += 1;
            }
            lasts.push(next - 1);
        }
        self.flush()?;
        self.sync_active()?;
        if self.buf.capacity() > 2 * WRITE_CHUNK_BYTES {
            self.buf = Vec::new();
        }

        self.publish(updates, next - 1);
        Ok(lasts)
    }

    /// Makes a durable batch readable: its segments' new lengths and index entries, and the tail.
    fn publish(&mut self, updates: Vec<SegmentUpdate>, tail: u64) {
        {
            let mut state = self.shared.state.lock();
            for update in updates {
                let segment = state
                    .segments
                    .iter_mut()
                    .rev()
                    .find(|s| s.first_lsn == update.first_lsn)
                    .expect("the writer registers a segment before writing to it");
                segment.last_lsn = update.last_lsn;
                segment.len = update.len;
                segment.index.extend(update.new_index);
            }
            state.tail = tail;
        }
        self.tail = tail;
        self.shared.durable.send_modify(|d| d.tail = tail);
        #[cfg(any(test, feature = "test-util"))]
        self.shared.batches.fetch_add(1, Ordering::Relaxed);
    }

    fn flush(&mut self) -> Result<(), (&'static str, io::Error)> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let active = self
            .active
            .as_mut()
            .expect("records are only buffered for an active segment");
        #[cfg(any(test, feature = "test-util"))]
        if let Err(e) = self.shared.faults.check_write() {
            // A full disk takes part of a write before it refuses the rest.
            let half = &self.buf[..self.buf.len() / 2];
            let _ = active.file.write_all_at(half, active.written);
            return Err(("writing a segment", e));
        }
        active
            .file
            .write_all_at(&self.buf, active.written)
            .map_err(|e| ("writing a segment", e))?;
        active.written += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }

    fn sync_active(&mut self) -> Result<(), (&'static str, io::Error)> {
        match &self.active {
            Some(active) if self.shared.options.fsync => {
                #[cfg(any(test, feature = "test-util"))]
                self.shared
                    .faults
                    .check_sync()
                    .map_err(|e| ("syncing a segment", e))?;
                active
                    .file
                    .sync_data()
                    .map_err(|e| ("syncing a segment", e))
            }
            _ => Ok(()),
        }
    }

    /// Starts a new segment whose first record will be `first_lsn`.
    fn roll(&mut self, first_lsn: u64) -> Result<(), (&'static str, io::Error)> {
        // Sync the segment being left first: recovery tolerates a torn tail only in the last
        // segment, so no older segment may ever end in unsynced bytes.
        self.flush()?;
        self.sync_active()?;
        let path = self.shared.dir.join(segment_file_name(first_lsn));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| ("creating a segment", e))?;
        let reader = match File::open(&path) {
            Ok(reader) => reader,
            Err(e) => {
                // Not registered yet, so a repair would not find it to delete.
                let _ = fs::remove_file(&path);
                return Err(("opening a segment for reads", e));
            }
        };
        // Registered before anything else can fail, so that a failed batch's repair finds it.
        self.shared.state.lock().segments.push_back(Segment {
            first_lsn,
            last_lsn: first_lsn - 1,
            len: 0,
            index: Vec::new(),
            path,
            file: Arc::new(reader),
        });
        self.active = Some(Active {
            file,
            first_lsn,
            written: 0,
        });
        if self.shared.options.fsync {
            sync_dir(&self.shared.dir).map_err(|e| ("syncing the log directory", e))?;
        }
        tracing::debug!(log_id = %self.shared.log_id, first_lsn, "started a new log segment");
        Ok(())
    }

    fn serve_trim(&mut self, up_to: u64) -> Result<()> {
        self.repair()
            .map_err(|(context, e)| self.shared.write_error(context, e))?;
        let current = self.shared.state.lock().trim_point;
        let trim_point = up_to.min(self.tail);
        if trim_point <= current {
            return Ok(());
        }
        write_trim_point(&self.shared.dir, trim_point, self.shared.options.fsync)
            .map_err(|e| self.shared.write_error("persisting the trim point", e))?;
        let removed: Vec<Segment> = {
            let mut state = self.shared.state.lock();
            state.trim_point = trim_point;
            let mut removed = Vec::new();
            while state
                .segments
                .front()
                .is_some_and(|s| s.last_lsn <= trim_point)
            {
                removed.extend(state.segments.pop_front());
            }
            removed
        };
        for segment in removed {
            if self
                .active
                .as_ref()
                .is_some_and(|a| a.first_lsn == segment.first_lsn)
            {
                // Everything was trimmed; the next append starts a segment at `tail + 1`.
                self.active = None;
            }
            // Readers still holding the file keep reading it; unlinking only frees the name.
            // Not syncing the directory is fine: recovery deletes a segment that reappears.
            if let Err(error) = fs::remove_file(&segment.path) {
                tracing::warn!(
                    log_id = %self.shared.log_id, path = %segment.path.display(), %error,
                    "could not delete a trimmed log segment; the next recovery will retry"
                );
            }
        }
        Ok(())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Also runs if the writer panics: whoever waits for the tail must learn that it will not
        // move any more rather than wait forever.
        self.shared
            .durable
            .send_modify(|d| d.writer_running = false);
    }
}

fn encode_record(buf: &mut Vec<u8>, lsn: u64, payload: &[u8]) {
    let len = u32::try_from(payload.len())
        .expect("record_bytes_max (checked at append) fits in 32 bits")
        .to_le_bytes();
    let lsn = lsn.to_le_bytes();
    buf.extend_from_slice(&len);
    buf.extend_from_slice(&record_crc(len, lsn, payload).to_le_bytes());
    buf.extend_from_slice(&lsn);
    buf.extend_from_slice(payload);
}

fn record_crc(len: [u8; 4], lsn: [u8; 8], payload: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&len);
    let crc = crc32c::crc32c_append(crc, &lsn);
    crc32c::crc32c_append(crc, payload)
}

fn segment_file_name(first_lsn: u64) -> String {
    format!("{first_lsn:020}{SEGMENT_SUFFIX}")
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir` and its missing ancestors and, with `fsync`, syncs the parent of every directory
/// it created: a segment synced into a directory whose own entry never reached the disk would be
/// lost with it.
fn create_dir_durably(dir: &Path, fsync: bool) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut ancestor = Some(dir);
    while let Some(path) = ancestor.filter(|p| !p.as_os_str().is_empty() && !p.exists()) {
        missing.push(path);
        ancestor = path.parent();
    }
    fs::create_dir_all(dir)?;
    if fsync {
        for created in missing.iter().rev() {
            match created.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => sync_dir(parent)?,
                _ => sync_dir(Path::new("."))?,
            }
        }
    }
    Ok(())
}

fn write_trim_point(dir: &Path, trim_point: u64, fsync: bool) -> io::Result<()> {
    let tmp = dir.join(TRIM_POINT_TMP_FILE);
    let value = trim_point.to_le_bytes();
    let mut content = value.to_vec();
    content.extend_from_slice(&crc32c::crc32c(&value).to_le_bytes());
    {
        let file = File::create(&tmp)?;
        file.write_all_at(&content, 0)?;
        if fsync {
            file.sync_data()?;
        }
    }
    fs::rename(&tmp, dir.join(TRIM_POINT_FILE))?;
    if fsync {
        sync_dir(dir)?;
    }
    Ok(())
}

/// Why a record could not be read.
enum RecordError {
    Io(io::Error),
    /// Short, fails its checksum or is not the record expected there.
    Invalid(String),
}

impl From<io::Error> for RecordError {
    fn from(e: io::Error) -> Self {
        RecordError::Io(e)
    }
}

impl RecordError {
    fn into_error(self, log_id: LogId, path: &Path, offset: u64, context: &'static str) -> Error {
        match self {
            RecordError::Io(source) => Error::Io {
                log_id,
                context,
                source,
            },
            RecordError::Invalid(detail) => Error::Corrupt {
                log_id,
                path: path.display().to_string(),
                offset: Some(offset),
                detail: format!("record at offset {offset}: {detail}"),
            },
        }
    }
}

/// Positional reads of a segment's first `end` bytes through a buffer.
struct SegmentReader<'f> {
    file: &'f File,
    end: u64,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    buf_start: u64,
}

impl<'f> SegmentReader<'f> {
    fn new(file: &'f File, end: u64) -> Self {
        SegmentReader {
            file,
            end,
            buf: Vec::new(),
            buf_start: 0,
        }
    }

    fn read(&mut self, offset: u64, len: usize) -> Result<&[u8], RecordError> {
        let available = self.end.saturating_sub(offset);
        if (len as u64) > available {
            return Err(RecordError::Invalid(format!(
                "needs {len} bytes but the segment has {available} left"
            )));
        }
        let cached = offset >= self.buf_start
            && offset + len as u64 <= self.buf_start + self.buf.len() as u64;
        if !cached {
            // `available` is at least `len`, so this fits in usize.
            let fetch = (len.max(READ_CHUNK_BYTES) as u64).min(available) as usize;
            self.buf.resize(fetch, 0);
            self.file.read_exact_at(&mut self.buf, offset)?;
            self.buf_start = offset;
        }
        let start = (offset - self.buf_start) as usize;
        Ok(&self.buf[start..start + len])
    }
}

/// Reads the record at `offset`, which must be `expected_lsn`. Returns the offset of the next
/// record and, if `payload` is set, the payload after checking its checksum.
fn read_record<'r>(
    reader: &'r mut SegmentReader<'_>,
    offset: u64,
    expected_lsn: u64,
    payload: bool,
) -> Result<(u64, Option<&'r [u8]>), RecordError> {
    let header: [u8; HEADER_BYTES] = reader
        .read(offset, HEADER_BYTES)?
        .try_into()
        .expect("read returns exactly the requested length");
    let len_bytes: [u8; 4] = header[0..4].try_into().expect("4 bytes");
    let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
    let lsn_bytes: [u8; 8] = header[8..16].try_into().expect("8 bytes");
    let len = u32::from_le_bytes(len_bytes) as usize;
    let lsn = u64::from_le_bytes(lsn_bytes);
    if lsn != expected_lsn {
        return Err(RecordError::Invalid(format!(
            "expected LSN {expected_lsn}, found {lsn}"
        )));
    }
    let payload_offset = offset + HEADER_BYTES as u64;
    let next = payload_offset + len as u64;
    if next > reader.end {
        return Err(RecordError::Invalid(format!(
            "a payload of {len} bytes runs past the end of the segment ({} bytes)",
            reader.end
        )));
    }
    if !payload {
        return Ok((next, None));
    }
    let bytes = reader.read(payload_offset, len)?;
    if record_crc(len_bytes, lsn_bytes, bytes) != crc {
        return Err(RecordError::Invalid(format!(
            "checksum mismatch in the record of LSN {lsn}"
        )));
    }
    Ok((next, Some(bytes)))
}

/// What recovery found.
struct Recovered {
    trim_point: u64,
    tail: u64,
    segments: VecDeque<Segment>,
    active: Option<Active>,
    lock: File,
}

/// Brings a log directory back to a consistent state and loads what readers and the writer need.
/// Blocking.
fn recover(log_id: LogId, dir: &Path, options: &LocalLogOptions) -> Result<Recovered> {
    create_dir_durably(dir, options.fsync).map_err(io_err(log_id, "creating the log directory"))?;
    let lock = lock_dir(log_id, dir)?;
    let trim_point = read_trim_point(log_id, dir)?;
    let files = segments_to_recover(log_id, dir, trim_point)?;

    let mut segments: VecDeque<Segment> = VecDeque::new();
    let mut last_file = None;
    let count = files.len();
    for (i, (first_lsn, path)) in files.into_iter().enumerate() {
        if let Some(previous) = segments.back()
            && first_lsn != previous.last_lsn + 1
        {
            return Err(corrupt(
                log_id,
                &path,
                format!(
                    "the previous segment ends at LSN {}, but this one starts at LSN {first_lsn}",
                    previous.last_lsn
                ),
            ));
        }
        let is_last = i + 1 == count;
        let (segment, file) = recover_segment(log_id, path, first_lsn, is_last, options)?;
        segments.push_back(segment);
        if is_last {
            last_file = Some(file);
        }
    }

    drop_trimmed_segments(log_id, &mut segments, trim_point)?;
    if segments.is_empty() {
        last_file = None;
    }

    let active = match (segments.back(), last_file) {
        (Some(segment), Some(file)) => Some(Active {
            file,
            first_lsn: segment.first_lsn,
            written: segment.len,
        }),
        _ => None,
    };
    // With no segment left, the trim point is the tail: everything up to it existed.
    let tail = segments.back().map_or(trim_point, |s| s.last_lsn);
    tracing::info!(log_id = %log_id, trim_point, tail, segments = segments.len(), "recovered the log");
    Ok(Recovered {
        trim_point,
        tail,
        segments,
        active,
        lock,
    })
}

/// Deletes the wholly trimmed segments left over from a crashed trim, and checks that the rest
/// continues right after the trim point.
fn drop_trimmed_segments(
    log_id: LogId,
    segments: &mut VecDeque<Segment>,
    trim_point: u64,
) -> Result<()> {
    // Segments are contiguous, so their last LSNs only grow and these are all at the front.
    while let Some(segment) = segments.front()
        && segment.last_lsn <= trim_point
    {
        let segment = segments.pop_front().expect("checked");
        remove_trimmed(log_id, &segment.path)?;
    }
    if let Some(first) = segments.front()
        && first.first_lsn > trim_point + 1
    {
        return Err(corrupt(
            log_id,
            &first.path,
            format!(
                "the log continues after the trim point {trim_point}, but its first segment \
                 starts at LSN {}: records are missing",
                first.first_lsn
            ),
        ));
    }
    Ok(())
}

fn io_err(log_id: LogId, context: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io {
        log_id,
        context,
        source,
    }
}

fn corrupt(log_id: LogId, path: &Path, detail: String) -> Error {
    Error::Corrupt {
        log_id,
        path: path.display().to_string(),
        offset: None,
        detail,
    }
}

/// Takes the directory's `flock`, so that two providers never write one log.
fn lock_dir(log_id: LogId, dir: &Path) -> Result<File> {
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK_FILE))
        .map_err(io_err(log_id, "opening the lock file"))?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(fs::TryLockError::WouldBlock) => Err(Error::Io {
            log_id,
            context: "locking the log directory",
            source: io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{} is in use by another open log provider", dir.display()),
            ),
        }),
        Err(fs::TryLockError::Error(e)) => Err(io_err(log_id, "locking the log directory")(e)),
    }
}

/// The durable trim point (0 if the log was never trimmed).
fn read_trim_point(log_id: LogId, dir: &Path) -> Result<u64> {
    // A leftover temporary file is a trim that crashed before its rename: it never happened.
    match fs::remove_file(dir.join(TRIM_POINT_TMP_FILE)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err(log_id, "removing a stale temporary trim point")(e));
        }
        _ => {}
    }
    let trim_path = dir.join(TRIM_POINT_FILE);
    match fs::read(&trim_path) {
        Ok(content) => {
            let (value, crc) = content
                .split_first_chunk::<8>()
                .and_then(|(v, rest)| Some((v, <[u8; 4]>::try_from(rest).ok()?)))
                .ok_or_else(|| {
                    corrupt(
                        log_id,
                        &trim_path,
                        format!("expected 12 bytes, found {}", content.len()),
                    )
                })?;
            if crc32c::crc32c(value) != u32::from_le_bytes(crc) {
                return Err(corrupt(log_id, &trim_path, "checksum mismatch".into()));
            }
            Ok(u64::from_le_bytes(*value))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(io_err(log_id, "reading the trim point")(e)),
    }
}

/// The segment files to read, by first LSN. Deletes those that hold only trimmed records.
fn segments_to_recover(log_id: LogId, dir: &Path, trim_point: u64) -> Result<Vec<(u64, PathBuf)>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(log_id, "listing the log directory"))? {
        let entry = entry.map_err(io_err(log_id, "listing the log directory"))?;
        let name = entry.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(SEGMENT_SUFFIX)) else {
            continue;
        };
        let path = entry.path();
        match stem.parse::<u64>() {
            Ok(first_lsn) if first_lsn > 0 => files.push((first_lsn, path)),
            _ => {
                return Err(corrupt(
                    log_id,
                    &path,
                    "not a valid segment file name".into(),
                ));
            }
        }
    }
    files.sort_unstable_by_key(|(first_lsn, _)| *first_lsn);

    // A segment followed by one that starts at or below `trim_point + 1` holds only trimmed
    // records: a trim crashed before deleting it. Deleting it without reading it also means that
    // damage in data nobody can read any more does not stop the log from opening.
    let mut kept = Vec::with_capacity(files.len());
    for (i, (first_lsn, path)) in files.iter().enumerate() {
        match files.get(i + 1) {
            Some((next_first, _)) if *next_first <= trim_point + 1 => {
                remove_trimmed(log_id, path)?;
            }
            _ => kept.push((*first_lsn, path.clone())),
        }
    }
    Ok(kept)
}

fn remove_trimmed(log_id: LogId, path: &Path) -> Result<()> {
    fs::remove_file(path).map_err(io_err(log_id, "deleting a trimmed segment"))?;
    tracing::info!(log_id = %log_id, path = %path.display(), "deleted a trimmed log segment");
    Ok(())
}

/// Reads one segment through, building its index. Decides what damage means: in the last
/// segment, a torn tail (cut) or corruption (refused); anywhere else, corruption. Returns the
/// segment as readers see it and the file, opened for writing if it is the last.
fn recover_segment(
    log_id: LogId,
    path: PathBuf,
    first_lsn: u64,
    is_last: bool,
    options: &LocalLogOptions,
) -> Result<(Segment, File)> {
    let file = OpenOptions::new()
        .read(true)
        .write(is_last)
        .open(&path)
        .map_err(io_err(log_id, "opening a segment"))?;
    let file_len = file
        .metadata()
        .map_err(io_err(log_id, "reading the size of a segment"))?
        .len();
    let mut reader = SegmentReader::new(&file, file_len);
    let mut index = Vec::new();
    let mut lsn = first_lsn;
    let mut offset = 0;
    while offset < file_len {
        let detail = match read_record(&mut reader, offset, lsn, true) {
            Ok((next, _)) => {
                if (lsn - first_lsn).is_multiple_of(INDEX_INTERVAL) {
                    index.push(offset);
                }
                offset = next;
                lsn += 1;
                continue;
            }
            Err(RecordError::Invalid(detail)) => detail,
            Err(e) => return Err(e.into_error(log_id, &path, offset, "recovering a segment")),
        };
        // Only the last segment can end in bytes that were never synced (the writer syncs a
        // segment before starting the next), and only bytes with nothing valid after them can
        // be an incomplete final write: see the module docs.
        let followed_by = valid_record_after(&mut reader, offset, lsn)
            .map_err(|e| e.into_error(log_id, &path, offset, "recovering a segment"))?;
        if !is_last || followed_by.is_some() {
            let after = match followed_by {
                Some((at, found)) => format!(
                    "; a valid record of LSN {found} follows at offset {at}, so this is not an \
                     incomplete final write and cutting here would drop acknowledged records"
                ),
                None => String::new(),
            };
            return Err(Error::Corrupt {
                log_id,
                path: path.display().to_string(),
                offset: Some(offset),
                detail: format!("record at offset {offset} (LSN {lsn}): {detail}{after}"),
            });
        }
        tracing::warn!(
            log_id = %log_id, path = %path.display(), offset, lsn,
            dropped_bytes = file_len - offset, %detail,
            "cutting the torn tail of the log: an incomplete final write, never acknowledged"
        );
        file.set_len(offset)
            .map_err(io_err(log_id, "truncating the torn tail of a segment"))?;
        if options.fsync {
            file.sync_data()
                .map_err(io_err(log_id, "truncating the torn tail of a segment"))?;
        }
        break;
    }
    drop(reader);
    let reader = File::open(&path).map_err(io_err(log_id, "opening a segment for reads"))?;
    let segment = Segment {
        first_lsn,
        last_lsn: lsn - 1,
        len: offset,
        index,
        path,
        file: Arc::new(reader),
    };
    Ok((segment, file))
}

/// Looks, past the bad record at `bad_offset` (which should have been `expected_lsn`), for a
/// well-formed record: a header whose LSN is plausible there (at least `expected_lsn`, and no
/// more records ahead of it than the bytes between could hold) and whose checksum matches.
/// Returns its offset and LSN. Every byte offset is tried, since the bad record's length cannot
/// be trusted.
fn valid_record_after(
    reader: &mut SegmentReader<'_>,
    bad_offset: u64,
    expected_lsn: u64,
) -> Result<Option<(u64, u64)>, RecordError> {
    let end = reader.end;
    let mut offset = bad_offset + 1;
    while offset + HEADER_BYTES as u64 <= end {
        let header = reader.read(offset, HEADER_BYTES)?;
        let lsn = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        let most_records_between = (offset - bad_offset) / HEADER_BYTES as u64;
        let plausible = lsn >= expected_lsn && lsn - expected_lsn <= most_records_between;
        if plausible {
            match read_record(reader, offset, lsn, true) {
                Ok(_) => return Ok(Some((offset, lsn))),
                Err(RecordError::Invalid(_)) => {}
                Err(e) => return Err(e),
            }
        }
        offset += 1;
    }
    Ok(None)
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

#[cfg(test)]
mod tests {
    use super::*;
    use tempfile::TempDir;

    /// A provider that owns its temporary directory, so that the conformance cases can hold it as
    /// a plain `Arc<dyn LogProvider>`. Fields drop in order: the logs stop before the directory
    /// goes.
    struct TempProvider {
        provider: LocalLogProvider,
        _dir: TempDir,
    }

    #[async_trait]
    impl LogProvider for TempProvider {
        async fn open(&self, log_id: LogId) -> Result<Arc<dyn Loglet>> {
            self.provider.open(log_id).await
        }
    }

    async fn fresh_provider() -> Arc<dyn LogProvider> {
        let dir = TempDir::new().expect("temporary directory");
        let provider =
            LocalLogProvider::open(dir.path(), LocalLogOptions::default()).expect("open provider");
        Arc::new(TempProvider {
            provider,
            _dir: dir,
        })
    }

    mod conformance {
        use super::fresh_provider;

        crate::conformance_tests!(fresh_provider);

        #[tokio::test]
        async fn run_all_passes_with_tiny_segments() {
            // Every case again, with segments so small that most reads and trims cross segment
            // boundaries, and every record is in a segment of its own or shares one with a few.
            crate::conformance::run_all(|| async {
                let dir = tempfile::TempDir::new().expect("temporary directory");
                let options = super::LocalLogOptions {
                    segment_bytes_max: 100,
                    ..Default::default()
                };
                let provider =
                    super::LocalLogProvider::open(dir.path(), options).expect("open provider");
                std::sync::Arc::new(super::TempProvider {
                    provider,
                    _dir: dir,
                }) as std::sync::Arc<dyn crate::LogProvider>
            })
            .await;
        }
    }

    #[tokio::test]
    async fn conformance_a_full_disk_stops_neither_reads_nor_later_appends() {
        let dir = TempDir::new().expect("temporary directory");
        let provider = provider(dir.path(), tiny_segments());
        let log = provider.open_local(LogId(1)).await.expect("open");
        let faults = log.faults();
        crate::conformance::a_failed_append_stops_neither_reads_nor_later_appends(
            log,
            &move |on| faults.disk_full.store(on, Ordering::SeqCst),
        )
        .await;
    }

    #[tokio::test]
    async fn conformance_a_failed_sync_stops_neither_reads_nor_later_appends() {
        let dir = TempDir::new().expect("temporary directory");
        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("open");
        let faults = log.faults();
        crate::conformance::a_failed_append_stops_neither_reads_nor_later_appends(
            log,
            &move |on| faults.sync_fails.store(on, Ordering::SeqCst),
        )
        .await;
    }

    fn provider(dir: &Path, options: LocalLogOptions) -> LocalLogProvider {
        LocalLogProvider::open(dir, options).expect("open provider")
    }

    fn tiny_segments() -> LocalLogOptions {
        // 16 header bytes + 34 payload bytes = 50 bytes per record: 4 records per segment.
        LocalLogOptions {
            segment_bytes_max: 200,
            ..Default::default()
        }
    }

    /// A 34-byte payload naming its LSN.
    fn record(lsn: u64) -> Bytes {
        Bytes::from(format!("record-{lsn:027}"))
    }

    fn records(first: u64, last: u64) -> Vec<Entry> {
        (first..=last)
            .map(|lsn| Entry {
                lsn: Lsn(lsn),
                payload: record(lsn),
            })
            .collect()
    }

    async fn append_records(log: &LocalLoglet, first: u64, last: u64) {
        for lsn in first..=last {
            assert_eq!(
                log.append(vec![record(lsn)]).await.expect("append"),
                Lsn(lsn)
            );
        }
    }

    fn segment_names(log_dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(log_dir)
            .expect("list log directory")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(SEGMENT_SUFFIX))
            .collect();
        names.sort();
        names
    }

    fn state_of(trim_point: u64, tail: u64) -> LogState {
        LogState {
            trim_point: Lsn(trim_point),
            tail: Lsn(tail),
        }
    }

    #[tokio::test]
    async fn reopening_keeps_records_tail_and_trim_point() {
        let dir = TempDir::new().expect("temporary directory");
        {
            let provider = provider(dir.path(), LocalLogOptions::default());
            let log = provider.open_local(LogId(1)).await.expect("open");
            let batch: Vec<Bytes> = (1..=300).map(record).collect();
            assert_eq!(log.append(batch).await.expect("append"), Lsn(300));
            log.trim(Lsn(10)).await.expect("trim");
        }
        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        assert_eq!(log.state().await.expect("state"), state_of(10, 300));
        assert_eq!(
            log.read(Lsn(11), 1000).await.expect("read"),
            records(11, 300)
        );
        // From the middle of an index interval, after recovery rebuilt the index.
        assert_eq!(
            log.read(Lsn(150), 3).await.expect("read"),
            records(150, 152)
        );
        assert!(matches!(
            log.read(Lsn(10), 1).await,
            Err(Error::Trimmed { .. })
        ));
        assert_eq!(
            log.append(vec![record(301)]).await.expect("append"),
            Lsn(301)
        );
    }

    #[tokio::test]
    async fn a_torn_tail_is_cut_and_appends_continue_after_it() {
        let dir = TempDir::new().expect("temporary directory");
        let log_dir = dir.path().join("1");
        let segment = log_dir.join(segment_file_name(1));
        {
            let provider = provider(dir.path(), LocalLogOptions::default());
            let log = provider.open_local(LogId(1)).await.expect("open");
            append_records(&log, 1, 5).await;
        }
        let intact_len = fs::metadata(&segment).expect("segment").len();

        // A crash in the middle of writing record 6: a complete header, half of the payload.
        let mut torn = Vec::new();
        encode_record(&mut torn, 6, &record(6));
        torn.truncate(HEADER_BYTES + 10);
        let file = OpenOptions::new()
            .append(true)
            .open(&segment)
            .expect("segment");
        std::io::Write::write_all(&mut &file, &torn).expect("write torn record");
        drop(file);

        {
            let provider = provider(dir.path(), LocalLogOptions::default());
            let log = provider.open_local(LogId(1)).await.expect("reopen");
            assert_eq!(log.state().await.expect("state"), state_of(0, 5));
            assert_eq!(fs::metadata(&segment).expect("segment").len(), intact_len);
            append_records(&log, 6, 7).await;
            assert_eq!(log.read(Lsn(1), 100).await.expect("read"), records(1, 7));
        }

        // Garbage after the last record, and a bit flip inside the (new) last record.
        let mut bytes = fs::read(&segment).expect("segment");
        let last = bytes.len() - 3;
        bytes[last] ^= 0x40;
        bytes.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef, 1, 2, 3]);
        fs::write(&segment, &bytes).expect("damage segment");

        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        assert_eq!(log.state().await.expect("state"), state_of(0, 6));
        assert_eq!(log.read(Lsn(1), 100).await.expect("read"), records(1, 6));
        append_records(&log, 7, 8).await;
        assert_eq!(log.read(Lsn(5), 100).await.expect("read"), records(5, 8));
    }

    #[tokio::test]
    async fn damage_in_an_older_segment_is_corruption() {
        let dir = TempDir::new().expect("temporary directory");
        {
            let provider = provider(dir.path(), tiny_segments());
            let log = provider.open_local(LogId(1)).await.expect("open");
            append_records(&log, 1, 10).await;
        }
        let first = dir.path().join("1").join(segment_file_name(1));
        let mut bytes = fs::read(&first).expect("segment");
        bytes[HEADER_BYTES + 3] ^= 0x01;
        fs::write(&first, &bytes).expect("damage segment");

        let provider = provider(dir.path(), tiny_segments());
        match provider.open(LogId(1)).await {
            Err(Error::Corrupt { path, detail, .. }) => {
                assert!(path.ends_with("00000000000000000001.seg"), "{path}");
                assert!(detail.contains("checksum"), "{detail}");
            }
            Err(other) => panic!("expected corruption, got {other}"),
            Ok(_) => panic!("expected corruption, the log opened"),
        }
    }

    /// Appends records 1..=10 in one segment, stops the log, lets `damage` change the segment's
    /// bytes (given each record's offset) and reopens it.
    async fn reopen_after_damage(damage: impl FnOnce(&mut Vec<u8>, &[usize])) -> (Result<()>, u64) {
        let dir = TempDir::new().expect("temporary directory");
        let segment = dir.path().join("1").join(segment_file_name(1));
        {
            let provider = provider(dir.path(), LocalLogOptions::default());
            let log = provider.open_local(LogId(1)).await.expect("open");
            append_records(&log, 1, 10).await;
        }
        let mut bytes = fs::read(&segment).expect("segment");
        let offsets: Vec<usize> = (0..10).map(|i| i * (HEADER_BYTES + 34)).collect();
        damage(&mut bytes, &offsets);
        fs::write(&segment, &bytes).expect("damage segment");
        let provider = provider(dir.path(), LocalLogOptions::default());
        let opened = provider.open_local(LogId(1)).await.map(|_| ());
        (opened, fs::metadata(&segment).expect("segment").len())
    }

    #[tokio::test]
    async fn a_bad_record_followed_by_valid_ones_in_the_last_segment_is_corruption() {
        let (opened, len) = reopen_after_damage(|bytes, offsets| {
            bytes[offsets[3] + HEADER_BYTES + 5] ^= 0x01; // the payload of LSN 4
        })
        .await;
        match opened {
            Err(Error::Corrupt { path, detail, .. }) => {
                assert!(path.ends_with("00000000000000000001.seg"), "{path}");
                assert!(detail.contains("offset 150 (LSN 4)"), "{detail}");
                assert!(detail.contains("checksum"), "{detail}");
                assert!(
                    detail.contains("valid record of LSN 5 follows at offset 200"),
                    "{detail}"
                );
            }
            other => panic!("expected corruption, got {other:?}"),
        }
        assert_eq!(len, 10 * 50, "nothing of the segment was cut");
    }

    #[tokio::test]
    async fn a_bad_length_followed_by_valid_records_is_corruption() {
        // The length of LSN 7 now points far past the end of the segment.
        let (opened, len) =
            reopen_after_damage(|bytes, offsets| bytes[offsets[6] + 2] ^= 0x10).await;
        match opened {
            Err(Error::Corrupt { detail, .. }) => {
                assert!(detail.contains("offset 300 (LSN 7)"), "{detail}");
                assert!(detail.contains("LSN 8 follows at offset 350"), "{detail}");
            }
            other => panic!("expected corruption, got {other:?}"),
        }
        assert_eq!(len, 10 * 50);
    }

    #[tokio::test]
    async fn a_bad_last_record_with_garbage_after_it_is_a_torn_tail() {
        // Nothing valid after the bad spot: an incomplete final write, cut.
        let (opened, len) = reopen_after_damage(|bytes, offsets| {
            bytes[offsets[9] + HEADER_BYTES + 1] ^= 0x01;
            bytes.extend_from_slice(&[0u8; 40]);
            bytes.extend_from_slice(b"garbage that is no record at all");
        })
        .await;
        opened.expect("a torn tail opens");
        assert_eq!(len, 9 * 50);
    }

    /// Reads every record and checks it is record(lsn), the tail and the segment files.
    async fn assert_log_holds(log: &LocalLoglet, tail: u64) {
        assert_eq!(log.state().await.expect("state"), state_of(0, tail));
        assert_eq!(
            log.read(Lsn(1), 1000).await.expect("read"),
            records(1, tail)
        );
    }

    #[tokio::test]
    async fn a_full_disk_fails_the_batch_and_appends_resume_once_there_is_room() {
        let dir = TempDir::new().expect("temporary directory");
        let log_dir = dir.path().join("1");
        {
            let provider = provider(dir.path(), tiny_segments());
            let log = provider.open_local(LogId(1)).await.expect("open");
            append_records(&log, 1, 4).await;
            let faults = log.faults();
            faults.disk_full.store(true, Ordering::SeqCst);
            // 1.seg is full: the batch starts a segment (5.seg) and fails writing to it.
            let batch: Vec<Bytes> = (5..=9).map(record).collect();
            match log.append(batch).await {
                Err(error @ Error::DiskFull { .. }) => {
                    assert!(error.is_disk_full());
                    let message = error.to_string();
                    assert!(
                        message.contains(&log_dir.display().to_string()),
                        "{message}"
                    );
                    assert!(message.contains("full"), "{message}");
                }
                other => panic!("expected a full disk, got {other:?}"),
            }
            // Still full: refused again, reads go on, and a tail wait does not fail.
            assert!(matches!(
                log.append(vec![record(5)]).await,
                Err(Error::DiskFull { .. })
            ));
            assert_log_holds(&log, 4).await;
            assert_eq!(segment_names(&log_dir), [segment_file_name(1)]);
            let waiting = log.wait_for_tail(Lsn(5));
            tokio::pin!(waiting);
            assert!(
                tokio::time::timeout(std::time::Duration::from_millis(50), &mut waiting)
                    .await
                    .is_err(),
                "waiting for the tail ended while the disk was full"
            );

            faults.disk_full.store(false, Ordering::SeqCst);
            let batch: Vec<Bytes> = (5..=9).map(record).collect();
            assert_eq!(log.append(batch).await.expect("append"), Lsn(9));
            waiting.await.expect("the tail reached 5");
            assert_log_holds(&log, 9).await;
            assert_eq!(segment_names(&log_dir), [1, 5, 9].map(segment_file_name));
            // A failed write in the middle of a segment is cut too.
            faults.disk_full.store(true, Ordering::SeqCst);
            assert!(log.append(vec![record(10), record(11)]).await.is_err());
            faults.disk_full.store(false, Ordering::SeqCst);
            append_records(&log, 10, 11).await;
        }
        // What recovery finds is exactly what was acknowledged, no leftovers of the failures.
        let provider = provider(dir.path(), tiny_segments());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        assert_log_holds(&log, 11).await;
    }

    #[tokio::test]
    async fn a_failed_sync_is_cut_and_appends_wait_until_the_cut_is_durable() {
        let dir = TempDir::new().expect("temporary directory");
        {
            let provider = provider(dir.path(), LocalLogOptions::default());
            let log = provider.open_local(LogId(1)).await.expect("open");
            append_records(&log, 1, 3).await;
            let faults = log.faults();
            faults.sync_fails.store(true, Ordering::SeqCst);
            match log
                .append(vec![Bytes::from_static(b"never acknowledged")])
                .await
            {
                Err(Error::Io { source, .. }) => {
                    assert!(source.to_string().contains("injected"), "{source}")
                }
                other => panic!("expected an I/O error, got {other:?}"),
            }
            assert_log_holds(&log, 3).await;
            // The cut of the failed batch could not be synced either: every append first tries
            // it again and is refused while it fails; reads go on.
            for _ in 0..2 {
                match log.append(vec![record(4)]).await {
                    Err(Error::Io { context, .. }) => {
                        assert_eq!(context, "cutting a failed write from a segment")
                    }
                    other => panic!("expected the cut to fail again, got {other:?}"),
                }
                assert_log_holds(&log, 3).await;
            }
            faults.sync_fails.store(false, Ordering::SeqCst);
            append_records(&log, 4, 5).await;
            assert_log_holds(&log, 5).await;
        }
        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        assert_log_holds(&log, 5).await;
    }

    #[tokio::test]
    async fn segments_roll_and_trimming_deletes_whole_segments() {
        let dir = TempDir::new().expect("temporary directory");
        let log_dir = dir.path().join("1");
        {
            let provider = provider(dir.path(), tiny_segments());
            let log = provider.open_local(LogId(1)).await.expect("open");
            append_records(&log, 1, 10).await;
            // One batch that crosses segment boundaries.
            let batch = (11..=20).map(record).collect();
            assert_eq!(log.append(batch).await.expect("append"), Lsn(20));
            assert_eq!(
                segment_names(&log_dir),
                [1, 5, 9, 13, 17].map(segment_file_name)
            );

            log.trim(Lsn(10)).await.expect("trim");
            // 9.seg holds 9..=12, so it stays; the two before it hold only trimmed records.
            assert_eq!(segment_names(&log_dir), [9, 13, 17].map(segment_file_name));
            assert_eq!(log.read(Lsn(11), 100).await.expect("read"), records(11, 20));
            assert!(matches!(
                log.read(Lsn(9), 1).await,
                Err(Error::Trimmed { .. })
            ));
        }
        {
            let provider = provider(dir.path(), tiny_segments());
            let log = provider.open_local(LogId(1)).await.expect("reopen");
            assert_eq!(log.state().await.expect("state"), state_of(10, 20));
            assert_eq!(log.read(Lsn(11), 100).await.expect("read"), records(11, 20));
            log.trim(Lsn(20)).await.expect("trim");
            assert_eq!(segment_names(&log_dir), Vec::<String>::new());
        }
        let provider = provider(dir.path(), tiny_segments());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        assert_eq!(log.state().await.expect("state"), state_of(20, 20));
        append_records(&log, 21, 21).await;
        assert_eq!(segment_names(&log_dir), [segment_file_name(21)]);
        assert_eq!(log.read(Lsn(21), 10).await.expect("read"), records(21, 21));
    }

    #[tokio::test]
    async fn recovery_finishes_a_trim_that_crashed_before_deleting() {
        let dir = TempDir::new().expect("temporary directory");
        let log_dir = dir.path().join("1");
        {
            let provider = provider(dir.path(), tiny_segments());
            let log = provider.open_local(LogId(1)).await.expect("open");
            append_records(&log, 1, 20).await;
        }
        // The trim point reached the disk, the deletions did not.
        write_trim_point(&log_dir, 13, true).expect("write trim point");
        fs::write(log_dir.join(TRIM_POINT_TMP_FILE), b"half").expect("stale temporary file");

        let provider = provider(dir.path(), tiny_segments());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        assert_eq!(log.state().await.expect("state"), state_of(13, 20));
        assert_eq!(segment_names(&log_dir), [13, 17].map(segment_file_name));
        assert!(!log_dir.join(TRIM_POINT_TMP_FILE).exists());
        assert_eq!(log.read(Lsn(14), 100).await.expect("read"), records(14, 20));
    }

    #[tokio::test]
    async fn records_over_the_limit_are_refused_whole() {
        let dir = TempDir::new().expect("temporary directory");
        let options = LocalLogOptions {
            record_bytes_max: 16,
            ..Default::default()
        };
        let provider = provider(dir.path(), options);
        let log = provider.open_local(LogId(1)).await.expect("open");
        let fits = Bytes::from(vec![7u8; 16]);
        let too_large = Bytes::from(vec![7u8; 17]);
        assert_eq!(
            log.append(vec![fits.clone()]).await.expect("append"),
            Lsn(1)
        );
        match log.append(vec![fits.clone(), too_large]).await {
            Err(Error::RecordTooLarge { size, limit, .. }) => assert_eq!((size, limit), (17, 16)),
            other => panic!("expected RecordTooLarge, got {other:?}"),
        }
        // Nothing of the refused batch was written.
        assert_eq!(log.state().await.expect("state"), state_of(0, 1));
        assert_eq!(log.append(vec![fits]).await.expect("append"), Lsn(2));
    }

    #[tokio::test]
    async fn large_records_round_trip() {
        let dir = TempDir::new().expect("temporary directory");
        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("open");
        // Larger than a read chunk and a write chunk, between small records.
        let large = Bytes::from(
            (0..3 * WRITE_CHUNK_BYTES)
                .map(|i| i as u8)
                .collect::<Vec<_>>(),
        );
        let batch = vec![record(1), large.clone(), record(3)];
        assert_eq!(log.append(batch).await.expect("append"), Lsn(3));
        let entries = log.read(Lsn(1), 10).await.expect("read");
        let payloads: Vec<Bytes> = entries.into_iter().map(|e| e.payload).collect();
        assert_eq!(payloads, vec![record(1), large.clone(), record(3)]);
        drop(log);
        drop(provider);

        let provider = self::provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        assert_eq!(log.read(Lsn(2), 1).await.expect("read")[0].payload, large);
    }

    #[tokio::test]
    async fn opening_twice_returns_the_same_arc() {
        let dir = TempDir::new().expect("temporary directory");
        let provider = provider(dir.path(), LocalLogOptions::default());
        let a = provider.open(LogId(3)).await.expect("open");
        let b = provider.open(LogId(3)).await.expect("open");
        assert!(std::ptr::addr_eq(Arc::as_ptr(&a), Arc::as_ptr(&b)));
    }

    #[tokio::test]
    async fn a_second_provider_cannot_open_a_log_in_use() {
        let dir = TempDir::new().expect("temporary directory");
        let first = provider(dir.path(), LocalLogOptions::default());
        let log = first.open(LogId(1)).await.expect("open");
        let second = provider(dir.path(), LocalLogOptions::default());
        match second.open(LogId(1)).await {
            Err(Error::Io { source, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::WouldBlock);
            }
            Err(other) => panic!("expected a lock conflict, got {other}"),
            Ok(_) => panic!("two providers opened the same log"),
        }
        // Once the first provider and its handles are gone, the log is free again.
        drop(log);
        drop(first);
        second
            .open(LogId(1))
            .await
            .expect("open after the first let go");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_appends_share_syncs() {
        const APPENDS: usize = 200;
        let dir = TempDir::new().expect("temporary directory");
        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("open");
        let tasks: Vec<_> = (0..APPENDS)
            .map(|i| {
                let log = log.clone();
                tokio::spawn(async move { log.append(vec![record(i as u64)]).await })
            })
            .collect();
        for task in tasks {
            task.await.expect("task").expect("append");
        }
        assert_eq!(log.state().await.expect("state").tail, Lsn(APPENDS as u64));
        let batches = log.batches();
        assert!(
            batches < APPENDS as u64,
            "{APPENDS} concurrent appends took {batches} syncs"
        );
    }

    #[test]
    fn invalid_options_are_refused() {
        let dir = TempDir::new().expect("temporary directory");
        for options in [
            LocalLogOptions {
                queue_depth_max: 0,
                ..Default::default()
            },
            LocalLogOptions {
                segment_bytes_max: 0,
                ..Default::default()
            },
            LocalLogOptions {
                record_bytes_max: u32::MAX as usize + 1,
                ..Default::default()
            },
        ] {
            let error = LocalLogProvider::open(dir.path(), options).expect_err("invalid options");
            assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
        }
    }
}
