//! The leader's appends: proposals that arrive while the partition's previous append is in
//! flight are appended together, as one record.
//!
//! # Why
//! A record costs the log and every replica the same whatever it holds: a frame and a checksum
//! in the local log; with the logs in NATS, a JetStream message stored on every replica and
//! delivered to every follower; a decode and a wake-up in each processor. Under load a partition
//! has many proposals at once (a 100-key request brings one to each of 16 partitions, and 32
//! clients send at once), and one record each pays that cost per proposal.
//!
//! # How
//! At most [`APPENDS_IN_FLIGHT_MAX`] appends are in flight per partition, each made by an
//! appender task. A proposal that finds fewer starts a task, which appends it at once: a lone
//! proposal waits for nothing. Proposals that arrive while every task is busy queue; when a
//! task's append returns, it appends everything queued as its next record (up to
//! [`PROPOSALS_PER_RECORD_MAX`], and up to [`RECORD_BYTES_TARGET`] or the log's own bound), and
//! ends once the queue is empty. A record's size thus follows the load, as a group commit's does.
//! Several proposals become one batch record ([`Envelope::encode_record`]); one stays the plain
//! record it always was. Two in flight rather than one: with one, the second of two proposals
//! that meet (32 single-key writers over 16 partitions) waits a whole append for the first; the
//! local log's writer already makes the appends of every partition that meet durable together.
//!
//! # Order
//! A record holds its proposals in the order they were queued. Records of proposals in flight at
//! once may land in either order: nobody waits on one for the other, and a caller that needs
//! one write before another waits for its answer first, as it must with any store.
//!
//! # Cancellation
//! The appender task is nobody's request: a caller that gives up leaves its proposal in the
//! record (as it would have been had it been appended alone), and takes nobody else's with it.
//!
//! # Failure
//! An append that fails fails every proposal of its record with the one error (shared): nothing
//! of the record was written, or, for [`cairn_log::Error::OutcomeUnknown`], maybe all of it.

use bytes::Bytes;
use cairn_log::Loglet;
use cairn_types::Lsn;
use cairn_types::record::{Envelope, record_bytes};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::oneshot;

/// Appends in flight per partition, at most (see the module's docs).
pub(crate) const APPENDS_IN_FLIGHT_MAX: usize = 2;

/// Proposals in one record, at most: bounds the work of applying one record, which answers no
/// proposal of it before the last is applied.
pub(crate) const PROPOSALS_PER_RECORD_MAX: usize = 1024;

/// Bytes of one record that packing aims at: a larger proposal still goes alone (the log's own
/// bound, [`Loglet::record_bytes_max`], is the one that refuses it).
pub(crate) const RECORD_BYTES_TARGET: usize = 1024 * 1024;

type Appended = Result<Lsn, Arc<cairn_log::Error>>;

/// A proposal waiting for its record: the envelope, encoded, and who waits for its LSN.
struct Proposal {
    envelope: Bytes,
    appended: oneshot::Sender<Appended>,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Proposal>,
    /// Appender tasks running (each appends until `waiting` is empty).
    appending: usize,
}

/// The appends of one partition's leader.
pub(crate) struct Appender {
    log: Arc<dyn Loglet>,
    queue: Mutex<Queue>,
}

impl Appender {
    pub fn new(log: Arc<dyn Loglet>) -> Arc<Appender> {
        Arc::new(Appender {
            log,
            queue: Mutex::new(Queue::default()),
        })
    }

    /// Appends `envelope` (from [`Envelope::encode`]) in the next record, alone or with the
    /// proposals queued beside it, and returns that record's LSN once it is durable.
    pub async fn append(self: &Arc<Self>, envelope: Bytes) -> Appended {
        let (appended, answer) = oneshot::channel();
        let start = {
            let mut queue = self.lock();
            queue.waiting.push_back(Proposal { envelope, appended });
            let start = queue.appending < APPENDS_IN_FLIGHT_MAX;
            queue.appending += usize::from(start);
            start
        };
        if start {
            tokio::spawn(self.clone().run());
        }
        answer.await.unwrap_or_else(|_| {
            // Only if the appender task was dropped: the runtime is shutting down.
            Err(Arc::new(cairn_log::Error::Shutdown {
                log_id: self.log.log_id(),
            }))
        })
    }

    /// Appends what is queued, a record at a time, until nothing is.
    async fn run(self: Arc<Self>) {
        // However the task ends (a panic, the runtime's shutdown), the next proposal starts a
        // new one, and those queued then are answered (their senders dropped) unless another
        // task will append them.
        let mut running = Running {
            appender: &self,
            finished: false,
        };
        let bytes_max = self.log.record_bytes_max().min(RECORD_BYTES_TARGET);
        loop {
            let proposals = {
                let mut queue = self.lock();
                if queue.waiting.is_empty() {
                    queue.appending -= 1;
                    // From here on a new proposal starts a new task: this one touches nothing.
                    running.finished = true;
                    return;
                }
                let count = record_len(&queue.waiting, bytes_max);
                queue.waiting.drain(..count).collect::<Vec<_>>()
            };
            let envelopes: Vec<Bytes> = proposals.iter().map(|p| p.envelope.clone()).collect();
            let appended = self
                .log
                .append(vec![Envelope::encode_record(&envelopes)])
                .await
                .map_err(Arc::new);
            for proposal in proposals {
                // The caller may have given up; its proposal is in the log all the same.
                let _ = proposal.appended.send(appended.clone());
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // Every change under this lock leaves the queue consistent.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How many of the first `waiting` proposals go in the next record: at least one, and more only
/// while the record stays within `bytes_max` and [`PROPOSALS_PER_RECORD_MAX`].
fn record_len(waiting: &VecDeque<Proposal>, bytes_max: usize) -> usize {
    let mut envelope_bytes = 0;
    let mut count = 0;
    for proposal in waiting.iter().take(PROPOSALS_PER_RECORD_MAX) {
        let with = envelope_bytes + proposal.envelope.len();
        if count > 0 && record_bytes(count + 1, with) > bytes_max {
            break;
        }
        envelope_bytes = with;
        count += 1;
    }
    count
}

/// The appender task while it runs.
struct Running<'a> {
    appender: &'a Appender,
    /// Set once the task has handed the queue back: it ended as it should.
    finished: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // Ended early: the next proposal starts a new task, and if no other task runs, the
        // proposals still queued are answered by dropping their senders.
        let mut queue = self.appender.lock();
        queue.appending -= 1;
        if queue.appending == 0 {
            queue.waiting.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(sizes: &[usize]) -> VecDeque<Proposal> {
        sizes
            .iter()
            .map(|&size| Proposal {
                envelope: Bytes::from(vec![1u8; size]),
                appended: oneshot::channel().0,
            })
            .collect()
    }

    #[test]
    fn a_record_takes_what_fits_and_never_nothing() {
        // A lone proposal larger than the bound still goes (the log refuses it if it must).
        assert_eq!(record_len(&waiting(&[500]), 100), 1);
        assert_eq!(record_len(&waiting(&[500, 1]), 100), 1);
        // Two of 40 make a batch of 1 + 4 + 2 * 4 + 80 = 93 bytes; a third does not fit.
        assert_eq!(record_len(&waiting(&[40, 40, 40]), 93), 2);
        assert_eq!(record_len(&waiting(&[40, 40, 40]), 92), 1);
        assert_eq!(
            record_len(&waiting(&[1; PROPOSALS_PER_RECORD_MAX + 5]), usize::MAX),
            PROPOSALS_PER_RECORD_MAX
        );
    }
}
