//! Reading a NATS log: recent records from memory, older ones and other nodes' through a tailing
//! ordered consumer.

use super::{NatsLogOptions, Shared};
use crate::{Entry, Error, LogState, Result};
use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use bytes::Bytes;
use cairn_types::Lsn;
use futures::{FutureExt, StreamExt};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::warn;

/// Deliveries in a row of records this node had already appended, after which the tailer stops:
/// this node writes the log, and its appends bring the records.
const REDUNDANT_DELIVERIES_MAX: u32 = 256;

/// How long after its last append a node still counts as the log's writer, whose own appends
/// bring every new record: it starts no tailer to wait for the tail meanwhile.
const WRITER_QUIET: Duration = Duration::from_secs(1);

/// Records the tailer stores at most before it wakes the readers.
const BURST_RECORDS_MAX: usize = 1024;

/// What this node knows of one log.
#[derive(Default)]
pub(super) struct View {
    trim_point: u64,
    tail: u64,
    /// Recent records by LSN: appended here or delivered by the tailer.
    records: BTreeMap<u64, Bytes>,
    bytes: usize,
    /// Where the last read started: records below it have been read.
    read_from: u64,
    /// Appends sent and not yet answered.
    pub(super) appending: usize,
    /// When an append of this node last landed.
    last_append: Option<Instant>,
    tailer: Option<Tailer>,
    /// Counts the tailers started, so that a replaced one knows to stop.
    tailers_started: u64,
}

#[derive(Clone, Copy)]
struct Tailer {
    generation: u64,
    /// The LSN it delivers next.
    next: u64,
}

impl View {
    pub(super) fn state(&self) -> LogState {
        LogState {
            trim_point: Lsn(self.trim_point),
            tail: Lsn(self.tail),
        }
    }

    pub(super) fn learned(&mut self, trim_point: u64, tail: u64) {
        self.tail = self.tail.max(tail);
        if trim_point > self.trim_point {
            self.trim_point = trim_point;
            self.records = self.records.split_off(&(trim_point + 1));
            self.bytes = self.records.values().map(Bytes::len).sum();
        }
    }

    pub(super) fn appended(&mut self, first: u64, payloads: &[Bytes], options: &NatsLogOptions) {
        for (i, payload) in payloads.iter().enumerate() {
            self.insert(first + i as u64, payload.clone());
        }
        self.tail = self.tail.max(first + payloads.len() as u64 - 1);
        self.last_append = Some(Instant::now());
        // Appends cannot wait for readers: past twice the budget, unread records go too, and a
        // reader that needs them again starts the tailer.
        self.evict(2 * options.cache_bytes, true);
        self.evict(options.cache_bytes, false);
    }

    /// Whether the record was new here.
    fn insert(&mut self, lsn: u64, payload: Bytes) -> bool {
        if lsn <= self.trim_point {
            return false;
        }
        let size = payload.len();
        match self.records.insert(lsn, payload) {
            Some(old) => {
                self.bytes = self.bytes + size - old.len();
                false
            }
            None => {
                self.bytes += size;
                true
            }
        }
    }

    /// Notes that the reader needs nothing below `lsn` any more: those records may go, and a
    /// tailer waiting for room may go on. Returns whether that changed anything, in which case
    /// the caller ticks `changed` (the tailer waits for it).
    fn consumed_below(&mut self, lsn: u64, budget: usize) -> bool {
        if lsn <= self.read_from {
            return false;
        }
        self.read_from = lsn;
        self.evict(budget, false);
        true
    }

    /// Drops the oldest records until at most `budget` bytes are left; only those already read
    /// unless `unread` too.
    fn evict(&mut self, budget: usize, unread: bool) {
        while self.bytes > budget {
            let Some(entry) = self.records.first_entry() else {
                break;
            };
            if !unread && *entry.key() >= self.read_from {
                break;
            }
            self.bytes -= entry.remove().len();
        }
    }

    fn collect(&self, from: u64, max_records: usize) -> Vec<Entry> {
        // Consecutive LSNs from `from` on: a missing record ends the run.
        (from..)
            .zip(self.records.range(from..=self.tail))
            .take_while(|(next, (lsn, _))| *next == **lsn)
            .take(max_records)
            .map(|(_, (&lsn, payload))| Entry {
                lsn: Lsn(lsn),
                payload: payload.clone(),
            })
            .collect()
    }

    /// Starts a tailer at `from` unless one will deliver it; returns its generation if started.
    fn want(&mut self, from: u64) -> Option<u64> {
        if self.tailer.is_some_and(|t| t.next <= from) {
            return None;
        }
        self.tailers_started += 1;
        self.tailer = Some(Tailer {
            generation: self.tailers_started,
            next: from,
        });
        Some(self.tailers_started)
    }
}

pub(super) async fn read(
    shared: &Arc<Shared>,
    from: u64,
    max_records: usize,
) -> Result<Vec<Entry>> {
    let mut changed = shared.changed.subscribe();
    loop {
        let start = {
            let mut view = shared.view.lock();
            if from <= view.trim_point {
                return Err(Error::Trimmed {
                    log_id: shared.log_id,
                    requested: Lsn(from),
                    trim_point: Lsn(view.trim_point),
                });
            }
            let budget = shared.options.cache_bytes;
            if max_records == 0 || from > view.tail {
                let moved = view.consumed_below(from, budget);
                drop(view);
                if moved {
                    shared.changed.send_replace(());
                }
                return Ok(Vec::new());
            }
            let entries = view.collect(from, max_records);
            if let Some(last) = entries.last() {
                // What is returned is read: it no longer holds up the tailer.
                let moved = view.consumed_below(last.lsn.0 + 1, budget);
                drop(view);
                if moved {
                    shared.changed.send_replace(());
                }
                return Ok(entries);
            }
            if view.consumed_below(from, budget) {
                shared.changed.send_replace(());
            }
            view.want(from)
        };
        if let Some(generation) = start {
            tokio::spawn(tail(shared.clone(), generation, from));
        }
        if changed.changed().await.is_err() || *shared.closed.borrow() {
            return Err(Error::Shutdown {
                log_id: shared.log_id,
            });
        }
    }
}

pub(super) async fn wait_for_tail(shared: &Arc<Shared>, lsn: u64) -> Result<()> {
    let mut changed = shared.changed.subscribe();
    loop {
        let (start, writing_until) = {
            let mut view = shared.view.lock();
            if view.tail >= lsn {
                return Ok(());
            }
            // The reader waits for `lsn`: what is below it is read.
            if view.consumed_below(lsn, shared.options.cache_bytes) {
                shared.changed.send_replace(());
            }
            // Appends of this node move the tail when they land: while it appends, it is the
            // log's writer and needs no tailer. Otherwise only another node can move the tail,
            // and the tailer is how this one hears of it.
            let writing_until = view
                .last_append
                .map(|at| at + WRITER_QUIET)
                .filter(|until| view.appending > 0 || *until > Instant::now());
            let start = match writing_until {
                Some(_) => None,
                None if view.appending > 0 => None,
                None => {
                    let next = view.tail + 1;
                    view.want(next).map(|generation| (generation, next))
                }
            };
            (start, writing_until)
        };
        if let Some((generation, from)) = start {
            tokio::spawn(tail(shared.clone(), generation, from));
        }
        let quiet = async {
            match writing_until {
                Some(until) => tokio::time::sleep_until(until.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = changed.changed() => {
                if changed.is_err() || *shared.closed.borrow() {
                    return Err(Error::Shutdown {
                        log_id: shared.log_id,
                    });
                }
            }
            () = quiet => {}
        }
    }
}

/// The tailer: fetches the log from `from` on with an ordered consumer, which long-polls at the
/// tail, into the view. Stops when replaced, when the log is closed, or when this node's own
/// appends bring everything it delivers.
async fn tail(shared: Arc<Shared>, generation: u64, from: u64) {
    let mut closed = shared.closed.subscribe();
    let mut next = from;
    let mut redundant = 0;
    'consumer: loop {
        if !current(&shared.view.lock(), generation) || *closed.borrow() {
            return;
        }
        if let Err(err) = shared.fetch_state().await {
            warn!(log = %shared.log_id, "tailing the log: {err}");
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        }
        let messages = async {
            let consumer = shared
                .stream
                .create_consumer(OrderedConfig {
                    deliver_policy: DeliverPolicy::ByStartSequence {
                        start_sequence: next.max(1),
                    },
                    ..Default::default()
                })
                .await?;
            Ok::<_, crate::BoxError>(consumer.messages().await?)
        };
        let mut messages = match messages.await {
            Ok(messages) => messages,
            Err(err) => {
                warn!(log = %shared.log_id, "starting to tail the log: {err}");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        // Records stored and not yet announced: a burst that has already arrived is stored
        // whole before readers wake, so that they read it in one go.
        let mut unannounced = 0;
        loop {
            let ready = if unannounced < BURST_RECORDS_MAX {
                messages.next().now_or_never()
            } else {
                None
            };
            let message = match ready {
                Some(message) => message,
                None => {
                    if unannounced > 0 {
                        unannounced = 0;
                        shared.changed.send_replace(());
                    }
                    tokio::select! {
                        message = messages.next() => message,
                        _ = closed.wait_for(|closed| *closed) => return,
                    }
                }
            };
            let message = match message {
                Some(Ok(message)) => message,
                Some(Err(err)) => {
                    warn!(log = %shared.log_id, "tailing the log: {err}");
                    continue 'consumer;
                }
                None => continue 'consumer,
            };
            let Ok(lsn) = message.info().map(|info| info.stream_sequence) else {
                continue;
            };
            let mut changed = shared.changed.subscribe();
            loop {
                let stored = {
                    let mut view = shared.view.lock();
                    if !current(&view, generation) {
                        return;
                    }
                    // A record the reader has read past is not kept. Others wait for room,
                    // unless the reader waits for this very record.
                    let passed = lsn < view.read_from;
                    let room =
                        passed || view.bytes <= shared.options.cache_bytes || lsn == view.read_from;
                    if room {
                        if lsn > next && next > view.trim_point {
                            // The records in between were trimmed before they could be
                            // delivered.
                            view.learned(lsn - 1, lsn - 1);
                        }
                        let new = passed || view.insert(lsn, message.payload.clone());
                        view.tail = view.tail.max(lsn);
                        next = lsn + 1;
                        view.tailer = Some(Tailer { generation, next });
                        redundant = if new { 0 } else { redundant + 1 };
                        if redundant >= REDUNDANT_DELIVERIES_MAX {
                            view.tailer = None;
                        }
                    }
                    room
                };
                if stored {
                    break;
                }
                if unannounced > 0 {
                    unannounced = 0;
                    shared.changed.send_replace(());
                }
                tokio::select! {
                    changed = changed.changed() => if changed.is_err() { return },
                    _ = closed.wait_for(|closed| *closed) => return,
                }
            }
            unannounced += 1;
            if redundant >= REDUNDANT_DELIVERIES_MAX {
                shared.changed.send_replace(());
                return;
            }
        }
    }
}

/// Whether the tailer of `generation` is still the one wanted.
fn current(view: &View, generation: u64) -> bool {
    view.tailer.is_some_and(|t| t.generation == generation)
}
