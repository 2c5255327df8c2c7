//! The writer thread: one per provider. It gathers the queued appends of every log into one
//! commit (one write), has the syncers make commits durable and publishes them in order, rolls
//! segments, cuts what failed commits left behind, persists trim points and hands the segments no
//! log needs any more to the deleter.

use super::record::{self, HEADER_BYTES, encode_record, preallocate, segment_file_name, sync_dir};
use super::sync::Syncers;
use super::{CoreShared, Loc, LogShared, Request, SegmentFile};
use crate::Result;
use bytes::Bytes;
use cairn_types::{LogId, Lsn};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
#[cfg(any(test, feature = "test-util"))]
use std::sync::atomic::Ordering;
use std::thread;
use tokio::sync::{mpsc, oneshot};

/// The writer hands its buffer to the kernel whenever it holds this much, so that one huge commit
/// does not need a second copy of itself in memory.
pub(super) const WRITE_CHUNK_BYTES: usize = 1024 * 1024;

/// A segment as the writer sees it: which logs have records in it, and the highest LSN of each.
pub(super) struct SegmentMeta {
    pub file: Arc<SegmentFile>,
    pub logs: HashMap<LogId, u64>,
}

/// The segment the writer appends to.
pub(super) struct Active {
    pub seq: u64,
    /// Shared with the syncers.
    pub file: Arc<File>,
    pub segment: Arc<SegmentFile>,
    /// Bytes written to the file so far.
    pub written: u64,
}

/// The files as recovery left them.
pub(super) struct DiskState {
    pub segments: BTreeMap<u64, SegmentMeta>,
    /// The last segment, if there is one; its durable length is `written`.
    pub active: Option<Active>,
    pub next_seq: u64,
}

type Appends = Vec<(Arc<LogShared>, Vec<Bytes>, oneshot::Sender<Result<Lsn>>)>;
/// A failed IO call: what it was doing, and why it failed.
type IoFailure = (&'static str, io::Error);
type Trim = (Arc<LogShared>, u64, oneshot::Sender<Result<()>>);

/// One log's records in the commit being written.
struct Pending {
    log: Arc<LogShared>,
    next: u64,
    records: Vec<(Arc<SegmentFile>, Loc, Bytes)>,
}

/// A commit written to the active segment and waiting for a sync.
struct Written {
    id: u64,
    pending: Vec<Pending>,
    replies: Vec<(LogId, oneshot::Sender<Result<Lsn>>, u64)>,
    /// Where the durable prefix ends once this commit is durable: segment and length.
    end: (u64, u64),
}

/// How many written commits may wait for syncs before the writer stops taking requests.
const WRITTEN_COMMITS_MAX: usize = 64;

/// Owns the write side of every log of a provider; runs on its own thread.
pub(super) struct Writer {
    shared: Arc<CoreShared>,
    /// Dropped before `syncers`, so that a syncer waking the writer never waits on it.
    queue: mpsc::Receiver<Request>,
    segments: BTreeMap<u64, SegmentMeta>,
    active: Option<Active>,
    /// The segment the durable (published) prefix ends in and its length there.
    durable: Option<(u64, u64)>,
    next_seq: u64,
    /// Encoded records not yet handed to the kernel; reused between commits.
    buf: Vec<u8>,
    /// Why the files may hold more than the durable prefix: a write or sync failed and cutting
    /// its leftovers failed too. Every request first tries again to cut them.
    failed: Option<IoFailure>,
    /// Commits written and not yet durable, oldest first.
    written: VecDeque<Written>,
    next_commit: u64,
    /// The last commit a started sync covers.
    covered: Option<u64>,
    /// Each log's last LSN handed out, ahead of its published tail while commits wait for syncs.
    assigned: HashMap<LogId, u64>,
    syncers: Syncers,
    deleter: Deleter,
}

impl Writer {
    pub fn new(
        shared: Arc<CoreShared>,
        queue: mpsc::Receiver<Request>,
        wake: mpsc::WeakSender<Request>,
        disk: DiskState,
    ) -> io::Result<Self> {
        let syncers = if shared.options.fsync {
            shared.options.syncs_in_flight_max
        } else {
            0
        };
        Ok(Writer {
            deleter: Deleter::start()?,
            syncers: Syncers::start(syncers, &shared, wake)?,
            shared,
            queue,
            segments: disk.segments,
            durable: disk.active.as_ref().map(|a| (a.seq, a.written)),
            active: disk.active,
            next_seq: disk.next_seq,
            buf: Vec::new(),
            failed: None,
            written: VecDeque::new(),
            next_commit: 0,
            covered: None,
            assigned: HashMap::new(),
        })
    }

    pub fn run(mut self) {
        loop {
            self.settle();
            if self.written.len() >= WRITTEN_COMMITS_MAX {
                self.syncers.wait();
                continue;
            }
            let Some(first) = self.queue.blocking_recv() else {
                break;
            };
            let (appends, trims) = self.gather(first);
            self.serve_appends(appends);
            for (log, up_to, reply) in trims {
                self.serve_trim(&log, up_to, reply);
            }
        }
        // Every handle is gone: finish the commits in flight before stopping.
        while !self.written.is_empty() {
            self.syncers.wait();
            self.settle();
        }
        // A stopped log's files take the room of what they hold, not of what the newest one was
        // given up front; the next start gives it that room again.
        if self.failed.is_none()
            && let Err(error) = self.cut_active_to_records()
        {
            tracing::warn!(
                dir = %self.shared.wal_dir.display(), %error,
                "cannot cut the newest log segment to its records at shutdown; the next start reads past its zeros"
            );
        }
    }

    /// Cuts the active segment to its records, dropping the zeros of its preallocated space, and
    /// syncs its new size: `sync_all`, since `fdatasync` need not write a size that shrank.
    fn cut_active_to_records(&self) -> io::Result<()> {
        let Some(active) = &self.active else {
            return Ok(());
        };
        active.file.set_len(active.written)?;
        if self.shared.options.fsync {
            active.file.sync_all()?;
        }
        Ok(())
    }

    /// Takes `first` and whatever else is queued, up to the batch limits.
    fn gather(&mut self, first: Request) -> (Appends, Vec<Trim>) {
        let mut appends: Appends = Vec::new();
        let mut trims = Vec::new();
        let (mut records, mut bytes) = (0usize, 0usize);
        let mut next = Some(first);
        while let Some(request) = next.take() {
            match request {
                Request::Append {
                    log,
                    payloads,
                    reply,
                } => {
                    records += payloads.len();
                    bytes += payloads.iter().map(Bytes::len).sum::<usize>();
                    appends.push((log, payloads, reply));
                }
                Request::Trim { log, up_to, reply } => trims.push((log, up_to, reply)),
                // A sync finished: `settle` takes it on the next turn.
                Request::Wake => {}
            }
            if records < self.shared.options.batch_records_max
                && bytes < self.shared.options.batch_bytes_max
            {
                next = self.queue.try_recv().ok();
            }
        }
        (appends, trims)
    }

    fn serve_appends(&mut self, appends: Appends) {
        if appends.is_empty() {
            return;
        }
        let result = self.repair().and_then(|()| self.write_commit(&appends));
        match result {
            Ok((pending, lasts)) => {
                let id = self.next_commit;
                self.next_commit += 1;
                let replies = appends
                    .into_iter()
                    .zip(lasts)
                    .map(|((log, _, reply), last)| (log.log_id, reply, last))
                    .collect();
                let end = self
                    .active
                    .as_ref()
                    .map(|a| (a.seq, a.written))
                    .expect("a written commit has an active segment");
                self.written.push_back(Written {
                    id,
                    pending,
                    replies,
                    end,
                });
                if self.shared.options.fsync {
                    self.start_sync();
                } else {
                    self.publish_through(id);
                }
            }
            Err((context, error)) => self.fail(context, error, appends),
        }
    }

    /// Publishes what the finished syncs made durable, or fails what a failed one left.
    fn settle(&mut self) {
        if self.take_settled() {
            self.start_sync();
        }
    }

    /// Publishes what the finished syncs made durable; `false` if one failed (and what it left
    /// is failed).
    fn take_settled(&mut self) -> bool {
        let settled = self.syncers.settle();
        if let Some(covers) = settled.synced {
            self.publish_through(covers);
        }
        if let Some(error) = settled.failure {
            self.fail("syncing a segment", error, Vec::new());
            return false;
        }
        true
    }

    /// Starts a sync of every written commit that none covers yet, unless enough are in flight
    /// or the oldest in flight is young (a fast disk: waiting for it costs less than a sync).
    fn start_sync(&mut self) {
        let Some(last) = self.written.back().map(|w| w.id) else {
            return;
        };
        if self.covered.is_some_and(|covered| covered >= last) {
            return;
        }
        let in_flight = self.syncers.in_flight();
        if in_flight >= self.shared.options.syncs_in_flight_max
            || (in_flight > 0
                && self.syncers.oldest_age() < Some(self.shared.options.sync_overlap_after))
        {
            return;
        }
        #[cfg(any(test, feature = "test-util"))]
        if in_flight > 0 {
            self.shared.overlapped_syncs.fetch_add(1, Ordering::Relaxed);
        }
        let active = self
            .active
            .as_ref()
            .expect("a written commit has an active segment");
        let file = active.file.clone();
        self.covered = Some(last);
        if self.syncers.start_sync(file, last) {
            self.take_settled();
        }
    }

    /// Makes the written commits up to `id` readable and acknowledges them.
    fn publish_through(&mut self, id: u64) {
        while self.written.front().is_some_and(|w| w.id <= id) {
            let written = self.written.pop_front().expect("checked");
            self.publish(written.pending, written.end);
            for (_, reply, last) in written.replies {
                // The caller may have given up waiting; the records are durable regardless.
                let _ = reply.send(Ok(Lsn(last)));
            }
        }
    }

    /// A write or sync failed: waits for the syncs in flight, cuts every commit not yet durable
    /// from the files and fails them all, with `appends` (not written) too.
    fn fail(&mut self, context: &'static str, error: io::Error, appends: Appends) {
        tracing::error!(
            dir = %self.shared.wal_dir.display(), %error, context,
            "log write failed; the commits not yet durable are refused and cut from the log"
        );
        self.syncers.drain();
        // Cut before answering, so that whoever sees the error finds the log as it was.
        if let Err((context, error)) = self.cut_unpublished() {
            tracing::error!(
                dir = %self.shared.wal_dir.display(), %error, context,
                "cannot cut the bytes of a failed write; appends are refused until it can"
            );
            self.failed = Some((context, error));
        }
        let replies = self
            .written
            .drain(..)
            .flat_map(|w| w.replies.into_iter().map(|(log, reply, _)| (log, reply)))
            .chain(
                appends
                    .into_iter()
                    .map(|(log, _, reply)| (log.log_id, reply)),
            );
        let (kind, message) = (error.kind(), error.to_string());
        let mut source = Some(error);
        for (log_id, reply) in replies {
            let source = source
                .take()
                .unwrap_or_else(|| io::Error::new(kind, message.clone()));
            let _ = reply.send(Err(self.shared.write_error(log_id, context, source)));
        }
        self.assigned.clear();
    }

    /// After a failed write whose leftovers could not be cut: tries again. `Err` is why appends
    /// and trims are refused for now.
    fn repair(&mut self) -> Result<(), IoFailure> {
        if self.failed.is_none() {
            return Ok(());
        }
        self.cut_unpublished()?;
        tracing::info!(dir = %self.shared.wal_dir.display(), "the log accepts appends again");
        self.failed = None;
        Ok(())
    }

    /// Brings the files back to the durable prefix: deletes segments that the failed commit
    /// created, truncates the last one to its durable length and syncs. The durable prefix was
    /// synced before, so nothing acknowledged depends on a failed `fsync`; the failed commit's
    /// bytes are never synced and acknowledged later (after a failed `fsync` the kernel may have
    /// dropped them while calling them clean), they are cut and written anew.
    fn cut_unpublished(&mut self) -> Result<(), IoFailure> {
        self.buf.clear();
        self.active = None;
        let durable_seq = self.durable.map(|(seq, _)| seq);
        // They leave the table only once their files are gone, so that a repair that fails
        // half-way finds them again.
        let created: Vec<(u64, PathBuf)> = self
            .segments
            .iter()
            .filter(|(seq, _)| durable_seq.is_none_or(|d| **seq > d))
            .map(|(seq, meta)| (*seq, meta.file.path.clone()))
            .collect();
        for (seq, path) in &created {
            match fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(("deleting a segment of a failed write", e));
                }
                _ => {}
            }
            self.segments.remove(seq);
        }
        // Numbers of deleted segments may be used again: nothing refers to them.
        self.next_seq = self
            .segments
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0)
            .max(durable_seq.unwrap_or(0))
            + 1;
        if !created.is_empty() && self.shared.options.fsync {
            sync_dir(&self.shared.wal_dir).map_err(|e| ("syncing the segment directory", e))?;
        }
        if let Some((seq, len)) = self.durable {
            let segment = self
                .segments
                .get(&seq)
                .expect("the segment of the durable prefix is never deleted")
                .file
                .clone();
            let file = OpenOptions::new()
                .write(true)
                .open(&segment.path)
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
            preallocate(&file, &self.shared.options);
            self.active = Some(Active {
                seq,
                file: Arc::new(file),
                segment,
                written: len,
            });
        }
        Ok(())
    }

    /// Writes one commit of every queued append (not synced yet). Returns each log's records in
    /// it and the last LSN of each append.
    fn write_commit(&mut self, appends: &Appends) -> Result<(Vec<Pending>, Vec<u64>), IoFailure> {
        let max = self.shared.options.segment_bytes_max;
        let mut pending: Vec<Pending> = Vec::new();
        let mut slots: HashMap<LogId, usize> = HashMap::new();
        let mut lasts = Vec::with_capacity(appends.len());
        for (log, payloads, _) in appends {
            let slot = *slots.entry(log.log_id).or_insert_with(|| {
                let last = match self.assigned.get(&log.log_id) {
                    Some(last) => *last,
                    None => log.state.lock().tail,
                };
                pending.push(Pending {
                    log: log.clone(),
                    next: last + 1,
                    records: Vec::new(),
                });
                pending.len() - 1
            });
            for payload in payloads {
                let record_len = (HEADER_BYTES + payload.len()) as u64;
                let roll = match &self.active {
                    None => true,
                    Some(a) => {
                        let len = a.written + self.buf.len() as u64;
                        len > 0 && len + record_len > max
                    }
                };
                if roll {
                    self.roll()?;
                }
                let active = self
                    .active
                    .as_ref()
                    .expect("roll() leaves an active segment");
                let offset = active.written + self.buf.len() as u64;
                let pending = &mut pending[slot];
                encode_record(
                    &mut self.buf,
                    u64::from(log.log_id.0),
                    pending.next,
                    payload,
                );
                let loc = Loc {
                    // A record starts in a segment only below segment_bytes_max, which fits.
                    offset: u32::try_from(offset).expect("segment_bytes_max fits in 32 bits"),
                    len: u32::try_from(payload.len()).expect("record_bytes_max fits in 32 bits"),
                };
                pending
                    .records
                    .push((active.segment.clone(), loc, payload.clone()));
                pending.next += 1;
                if self.buf.len() >= WRITE_CHUNK_BYTES {
                    self.flush()?;
                }
            }
            lasts.push(pending[slot].next - 1);
        }
        self.flush()?;
        if self.buf.capacity() > 2 * WRITE_CHUNK_BYTES {
            self.buf = Vec::new();
        }
        for p in &pending {
            self.assigned.insert(p.log.log_id, p.next - 1);
        }
        Ok((pending, lasts))
    }

    /// Makes a durable commit readable: each log's record locations, cache and tail, and which
    /// segments hold records of which logs. `end` is where the commit ends.
    fn publish(&mut self, pending: Vec<Pending>, end: (u64, u64)) {
        let cache_max = self.shared.options.cache_bytes_max;
        for Pending { log, next, records } in pending {
            for (segment, _, _) in &records {
                if let Some(meta) = self.segments.get_mut(&segment.seq) {
                    let max = meta.logs.entry(log.log_id).or_insert(0);
                    *max = (*max).max(next - 1);
                }
            }
            log.state.lock().publish(records, cache_max);
            log.durable.send_modify(|d| d.tail = next - 1);
        }
        self.durable = Some(end);
        #[cfg(any(test, feature = "test-util"))]
        self.shared.commits.fetch_add(1, Ordering::Relaxed);
    }

    fn flush(&mut self) -> Result<(), IoFailure> {
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

    fn sync_active(&mut self) -> Result<(), IoFailure> {
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

    /// Starts a new segment.
    fn roll(&mut self) -> Result<(), IoFailure> {
        // Sync the segment being left first: recovery tolerates a torn tail only in the last
        // segment, so no older segment may ever end in unsynced bytes, nor in the zeros of its
        // preallocated space.
        self.flush()?;
        self.cut_active_to_records()
            .map_err(|e| ("cutting a segment to its records", e))?;
        self.sync_active()?;
        let seq = self.next_seq;
        self.next_seq += 1;
        let path = self.shared.wal_dir.join(segment_file_name(seq));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| ("creating a segment", e))?;
        preallocate(&file, &self.shared.options);
        let reader = match File::open(&path) {
            Ok(reader) => reader,
            Err(e) => {
                // Not registered yet, so a repair would not find it to delete.
                let _ = fs::remove_file(&path);
                return Err(("opening a segment for reads", e));
            }
        };
        let segment = Arc::new(SegmentFile {
            seq,
            path,
            file: reader,
        });
        // Registered before anything else can fail, so that a failed commit's repair finds it.
        self.segments.insert(
            seq,
            SegmentMeta {
                file: segment.clone(),
                logs: HashMap::new(),
            },
        );
        self.active = Some(Active {
            seq,
            file: Arc::new(file),
            segment,
            written: 0,
        });
        if self.shared.options.fsync {
            sync_dir(&self.shared.wal_dir).map_err(|e| ("syncing the segment directory", e))?;
        }
        tracing::debug!(seq, "started a new log segment");
        Ok(())
    }

    /// Answers the trim once its trim point is durable and the segments it frees are gone; the
    /// deletions run on the deleter's thread, so that the commits queued behind do not wait.
    fn serve_trim(&mut self, log: &LogShared, up_to: u64, reply: oneshot::Sender<Result<()>>) {
        match self.persist_trim(log, up_to) {
            Ok(()) => {
                let dead = self.collect_garbage();
                self.deleter.delete(dead, reply);
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }

    fn persist_trim(&mut self, log: &LogShared, up_to: u64) -> Result<()> {
        self.repair()
            .map_err(|(context, e)| self.shared.write_error(log.log_id, context, e))?;
        let (current, tail) = {
            let state = log.state.lock();
            (state.trim_point, state.tail)
        };
        let trim_point = up_to.min(tail);
        if trim_point <= current {
            return Ok(());
        }
        record::write_trim_point(&log.dir, trim_point, self.shared.options.fsync).map_err(|e| {
            self.shared
                .write_error(log.log_id, "persisting the trim point", e)
        })?;
        log.state.lock().trim(trim_point);
        Ok(())
    }

    /// Takes out of the table the segments (before the one the durable prefix ends in) whose
    /// records are all at or below their log's trim point, and returns their paths to delete.
    /// This is also where rewriting a lagging log's few live records forward, to free the
    /// segments it alone keeps, would go.
    fn collect_garbage(&mut self) -> Vec<PathBuf> {
        let Some((durable_seq, _)) = self.durable else {
            return Vec::new();
        };
        let dead: Vec<u64> = {
            let logs = self.shared.logs.lock();
            let trim_of = |id: &LogId| logs.get(id).map_or(0, |l| l.state.lock().trim_point);
            self.segments
                .range(..durable_seq)
                .filter(|(_, meta)| meta.logs.iter().all(|(id, max)| *max <= trim_of(id)))
                .map(|(seq, _)| *seq)
                .collect()
        };
        dead.into_iter()
            .filter_map(|seq| self.segments.remove(&seq))
            .map(|meta| meta.file.path.clone())
            .collect()
    }
}

type Deletion = (Vec<PathBuf>, oneshot::Sender<Result<()>>);

/// Deletes trimmed segments on a thread of its own. Joined when the writer stops, so that a
/// provider reopened right after never lists a segment that is being deleted.
struct Deleter {
    jobs: Option<std::sync::mpsc::Sender<Deletion>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Deleter {
    fn start() -> io::Result<Deleter> {
        let (jobs, queue) = std::sync::mpsc::channel::<Deletion>();
        let thread = thread::Builder::new()
            .name("cairn-log-deleter".into())
            .spawn(move || {
                for (paths, reply) in queue {
                    delete_segments(&paths);
                    let _ = reply.send(Ok(()));
                }
            })?;
        Ok(Deleter {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Deletes `paths`, then answers `reply`.
    fn delete(&self, paths: Vec<PathBuf>, reply: oneshot::Sender<Result<()>>) {
        if paths.is_empty() {
            let _ = reply.send(Ok(()));
            return;
        }
        let Some(jobs) = &self.jobs else {
            return;
        };
        if let Err(std::sync::mpsc::SendError((paths, reply))) = jobs.send((paths, reply)) {
            // The deleter thread is gone (it panicked): delete here.
            delete_segments(&paths);
            let _ = reply.send(Ok(()));
        }
    }
}

impl Drop for Deleter {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the log segment deleter thread panicked");
        }
    }
}

fn delete_segments(paths: &[PathBuf]) {
    for path in paths {
        // Readers still holding the file keep reading it; unlinking only frees the name. Not
        // syncing the directory is fine: recovery deletes a trimmed segment that reappears.
        match fs::remove_file(path) {
            Ok(()) => tracing::debug!(path = %path.display(), "deleted a trimmed log segment"),
            Err(error) => tracing::warn!(
                path = %path.display(), %error,
                "could not delete a trimmed log segment; the next recovery will retry"
            ),
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Also runs if the writer panics: whoever waits for a tail must learn that it will not
        // move any more rather than wait forever.
        for log in self.shared.logs.lock().values() {
            log.durable.send_modify(|d| d.writer_running = false);
        }
    }
}
