//! The syncer threads: `fdatasync` calls that run beside the writer. Each covers every commit
//! written before it started; a slow or busy disk finishes several overlapping syncs of one file
//! in about the time of one, so the writer may start another while one is in flight (up to
//! [`LocalLogOptions::syncs_in_flight_max`](super::LocalLogOptions::syncs_in_flight_max)).
//! Results count only in the order the syncs were started: a sync that succeeds makes nothing
//! durable while an older one has not succeeded, because after a failed writeback the kernel
//! may report the error to only one of the callers.

use super::{CoreShared, Request};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

struct Job {
    id: u64,
    file: Arc<File>,
}

/// Results of finished syncs, in whatever order they finished, with how long each took.
#[derive(Default)]
struct Results {
    done: Mutex<Vec<(u64, io::Result<()>, Duration)>>,
    ready: Condvar,
}

/// A sync that was started and whose result has not been settled yet.
struct Started {
    id: u64,
    /// The last commit it covers.
    covers: u64,
    at: Instant,
    result: Option<io::Result<()>>,
}

/// What the results that arrived mean, in start order.
#[derive(Default)]
pub(super) struct Settled {
    /// The last commit that is durable now, if that moved.
    pub synced: Option<u64>,
    /// The first failure; every commit after `synced` fails with it.
    pub failure: Option<io::Error>,
}

pub(super) struct Syncers {
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    threads: Vec<thread::JoinHandle<()>>,
    results: Arc<Results>,
    started: VecDeque<Started>,
    next_id: u64,
    /// How long the last sync that finished took; `None` before the first.
    last_took: Option<Duration>,
    shared: Arc<CoreShared>,
}

impl Syncers {
    /// Starts `count` syncer threads. Each wakes the writer through `wake` when it finishes (weak,
    /// so that the syncers never keep the writer's queue open).
    pub fn start(
        count: usize,
        shared: &Arc<CoreShared>,
        wake: mpsc::WeakSender<Request>,
    ) -> io::Result<Syncers> {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        let results = Arc::new(Results::default());
        let mut threads = Vec::with_capacity(count);
        for i in 0..count {
            let (queue, results, wake) = (queue.clone(), results.clone(), wake.clone());
            let shared = shared.clone();
            let thread = thread::Builder::new()
                .name(format!("cairn-log-sync-{i}"))
                .spawn(move || {
                    loop {
                        let job = match queue.lock().recv() {
                            Ok(job) => job,
                            Err(_) => return,
                        };
                        let at = Instant::now();
                        let result = sync(&shared, &job.file);
                        results.done.lock().push((job.id, result, at.elapsed()));
                        results.ready.notify_all();
                        // Never waits for room: a full queue wakes the writer anyway, and while
                        // it waits for syncs (too many commits unsynced) it takes no requests,
                        // so a syncer waiting for room would never run the sync it waits for.
                        if let Some(wake) = wake.upgrade() {
                            let _ = wake.try_send(Request::Wake);
                        }
                    }
                })?;
            threads.push(thread);
        }
        Ok(Syncers {
            jobs: Some(jobs),
            threads,
            results,
            started: VecDeque::new(),
            next_id: 0,
            last_took: None,
            shared: shared.clone(),
        })
    }

    pub fn in_flight(&self) -> usize {
        self.started.len()
    }

    /// How long the oldest sync in flight has been running.
    pub fn oldest_age(&self) -> Option<Duration> {
        self.started.front().map(|s| s.at.elapsed())
    }

    /// Starts a sync of `file` covering commits up to `covers`; `true` if it is done already
    /// (settle it now: no syncer wakes the writer for it). On a fast disk, with no sync in
    /// flight, it runs right here: handing it to a syncer thread and being woken by it would cost
    /// two thread switches, more than the sync itself; meanwhile new appends queue up for the
    /// next commit, as they would anyway. Its result is settled like any other.
    pub fn start_sync(&mut self, file: Arc<File>, covers: u64) -> bool {
        let id = self.next_id;
        self.next_id += 1;
        let inline_below = self.shared.options.sync_overlap_after;
        let inline = self.started.is_empty() && self.last_took.is_some_and(|t| t < inline_below);
        if inline {
            let at = Instant::now();
            let result = sync(&self.shared, &file);
            self.results.done.lock().push((id, result, at.elapsed()));
        } else {
            let job = Job { id, file };
            match self.jobs.as_ref().map(|jobs| jobs.send(job)) {
                Some(Ok(())) => {}
                // The syncer threads are gone (one panicked while holding the queue): sync here.
                Some(Err(std::sync::mpsc::SendError(job))) => {
                    let at = Instant::now();
                    let result = job.file.sync_data();
                    self.results
                        .done
                        .lock()
                        .push((job.id, result, at.elapsed()));
                }
                None => return false,
            }
        }
        self.started.push_back(Started {
            id,
            covers,
            at: Instant::now(),
            result: None,
        });
        inline
    }

    /// Takes the results that arrived and settles them in start order.
    pub fn settle(&mut self) -> Settled {
        for (id, result, took) in std::mem::take(&mut *self.results.done.lock()) {
            self.last_took = Some(took);
            let index = self.started.front().and_then(|f| id.checked_sub(f.id));
            if let Some(started) = index.and_then(|i| self.started.get_mut(i as usize)) {
                started.result = Some(result);
            }
        }
        let mut settled = Settled::default();
        while self.started.front().is_some_and(|s| s.result.is_some()) {
            let started = self.started.pop_front().expect("checked");
            match started.result.expect("checked") {
                Ok(()) => settled.synced = Some(started.covers),
                Err(e) => {
                    settled.failure = Some(e);
                    break;
                }
            }
        }
        settled
    }

    /// Blocks until a result arrives, if any sync is in flight.
    pub fn wait(&self) {
        let mut done = self.results.done.lock();
        if done.is_empty() && !self.started.is_empty() {
            self.results.ready.wait(&mut done);
        }
    }

    /// Waits for every sync in flight and forgets their results: after a failure, none of them
    /// can make anything durable.
    pub fn drain(&mut self) {
        // Those whose results arrived (and wait behind an older one) are done already.
        self.started.retain(|s| s.result.is_none());
        while !self.started.is_empty() {
            let mut done = self.results.done.lock();
            if done.is_empty() {
                self.results.ready.wait(&mut done);
            }
            for (id, _, _) in done.drain(..) {
                self.started.retain(|s| s.id != id);
            }
        }
    }
}

impl Drop for Syncers {
    fn drop(&mut self) {
        drop(self.jobs.take());
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("a log syncer thread panicked");
            }
        }
    }
}

fn sync(shared: &CoreShared, file: &File) -> io::Result<()> {
    #[cfg(any(test, feature = "test-util"))]
    shared.faults.check_sync()?;
    let _ = shared;
    file.sync_data()
}
