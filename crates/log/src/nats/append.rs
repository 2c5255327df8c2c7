//! The appender: one task per log that sends appends in order, many in flight, and answers each
//! once JetStream has stored it (or has certainly not).

use super::{APPENDS_IN_FLIGHT_MAX, Shared};
use crate::{Error, Result};
use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use cairn_nats::wrong_last_sequence;
use cairn_types::Lsn;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

/// How long one lookup of an unanswered append waits.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);

/// The header naming the append a record's message starts: the writer and its count of
/// appends. Read back to tell whether an append whose answer was lost was written.
const APPEND_ID: &str = "Cairn-Append";

type Reply = oneshot::Sender<Result<Lsn>>;

pub(super) struct Request {
    pub(super) payloads: Vec<Bytes>,
    pub(super) reply: Reply,
}

/// Runs until every handle of the log is gone and the appends in flight are answered.
/// `expected` is the stream's last sequence when the log was opened.
pub(super) async fn run(shared: Arc<Shared>, mut requests: mpsc::Receiver<Request>, tail: u64) {
    let writer: u64 = rand::random();
    let mut count = 0u64;
    // Where the stream will end once every append sent so far lands.
    let mut expected = tail;
    let mut in_flight: FuturesOrdered<BoxFuture<'static, (Result<Lsn>, Reply)>> =
        FuturesOrdered::new();
    // An append failed, so `expected` counts records that are not in the stream: learn the
    // tail again once the appends in flight are answered (they will fail too).
    let mut lost_track = false;
    loop {
        if lost_track && in_flight.is_empty() {
            match shared.fetch_state().await {
                Ok(state) => {
                    expected = state.tail.0;
                    lost_track = false;
                }
                Err(err) => {
                    // Appends cannot be placed until NATS answers again: refuse them meanwhile.
                    warn!(log = %shared.log_id, "cannot learn where the log ends: {err}");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(200)) => {}
                        request = requests.recv() => match request {
                            Some(request) => {
                                let _ = request.reply.send(Err(err));
                            }
                            None => return,
                        },
                    }
                    continue;
                }
            }
        }
        tokio::select! {
            biased;
            Some((outcome, reply)) = in_flight.next(), if !in_flight.is_empty() => {
                if outcome.is_err() {
                    lost_track = true;
                }
                shared.view.lock().appending -= 1;
                shared.changed.send_replace(());
                let _ = reply.send(outcome);
            }
            request = requests.recv(), if !lost_track && in_flight.len() < APPENDS_IN_FLIGHT_MAX => {
                let Some(Request { payloads, reply }) = request else { break };
                if in_flight.is_empty() {
                    // Records another writer appended that this node has seen since (a follower
                    // that now leads): the next append follows them.
                    expected = expected.max(shared.view.lock().state().tail.0);
                }
                count += 1;
                let append = Append {
                    shared: shared.clone(),
                    id: format!("{writer:016x}-{count}"),
                    expected,
                    payloads,
                };
                match append.send().await {
                    Ok(ack) => {
                        expected += append.payloads.len() as u64;
                        shared.view.lock().appending += 1;
                        in_flight.push_back(Box::pin(async move { (append.outcome(ack).await, reply) }));
                    }
                    // Nothing reached NATS (or only a batch's uncommitted part, which it drops).
                    Err(err) => {
                        let _ = reply.send(Err(err));
                    }
                }
            }
        }
    }
    while let Some((outcome, reply)) = in_flight.next().await {
        let _ = reply.send(outcome);
    }
}

/// One append: its records, the id its first message carries, and the sequence the stream must
/// end at before it.
struct Append {
    shared: Arc<Shared>,
    id: String,
    expected: u64,
    payloads: Vec<Bytes>,
}

enum Found {
    /// The stream holds this append at `expected + 1`.
    Ours,
    /// Another append is there.
    Other,
    /// Nothing is there yet.
    Nothing,
}

impl Append {
    fn last(&self) -> u64 {
        self.expected + self.payloads.len() as u64
    }

    /// Hands the append's messages to the NATS client, in order; returns the acknowledgement
    /// to wait for. A batch's messages are JetStream's atomic batch: the last one commits it.
    async fn send(&self) -> Result<PublishAckFuture> {
        let shared = &self.shared;
        let count = self.payloads.len();
        let batched = count > 1;
        for (i, payload) in self.payloads.iter().enumerate() {
            let mut headers = HeaderMap::new();
            if i == 0 {
                headers.insert(
                    async_nats::header::NATS_EXPECTED_LAST_SEQUENCE,
                    self.expected.to_string().as_str(),
                );
                headers.insert(APPEND_ID, self.id.as_str());
            }
            if batched {
                headers.insert("Nats-Batch-Id", self.id.as_str());
                headers.insert("Nats-Batch-Sequence", (i + 1).to_string().as_str());
            }
            if i + 1 < count {
                shared
                    .client
                    .publish_with_headers(shared.subject.clone(), headers, payload.clone())
                    .await
                    .map_err(|e| shared.nats_error("append")(e.into()))?;
                continue;
            }
            if batched {
                headers.insert("Nats-Batch-Commit", "1");
            }
            return shared
                .jetstream
                .send_publish(
                    shared.subject.clone(),
                    PublishMessage::build()
                        .payload(payload.clone())
                        .headers(headers),
                )
                .await
                .map_err(|e| shared.nats_error("append")(e.into()));
        }
        unreachable!("an append has at least one record")
    }

    /// Waits for the acknowledgement. When NATS refuses the append for where the stream ends,
    /// or stops answering, the record at `expected + 1` decides: this append is there (its
    /// answer was lost, or a retry found it), or it is not and never will be (another append
    /// took its place). Silence is answered by sending the append again, which cannot write it
    /// twice: both copies expect the stream to end at `expected`.
    async fn outcome(&self, mut ack: PublishAckFuture) -> Result<Lsn> {
        let log_id = self.shared.log_id;
        let started = Instant::now();
        // Once one attempt went unanswered, its append may still land: from then on only the
        // record at `expected + 1` (or the deadline) decides, never a refusal of a later attempt.
        let mut unanswered = false;
        loop {
            let error = match ack.await {
                Ok(ack) if ack.sequence == self.last() => return Ok(self.stored()),
                Ok(ack) => {
                    return Err(self.shared.nats_error("append")(
                        format!(
                            "JetStream stored the append at sequence {}, not at {}",
                            ack.sequence,
                            self.last()
                        )
                        .into(),
                    ));
                }
                Err(error) => error,
            };
            // No stream answered on the subject: one just created, or moving between servers,
            // is not reachable from this server yet. Nothing was written; send it again.
            if error.kind() == PublishErrorKind::StreamNotFound
                && started.elapsed() < self.shared.options.append_deadline
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
                match self.send().await {
                    Ok(again) => {
                        ack = again;
                        continue;
                    }
                    Err(err) if !unanswered => return Err(err),
                    Err(err) => warn!(log = %log_id, "sending an append again: {err}"),
                }
            }
            unanswered |= matches!(
                error.kind(),
                PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe
            );
            if !unanswered && !wrong_last_sequence(&error) {
                // JetStream refused it for another reason: nothing was written.
                return Err(self.shared.nats_error("append")(error.into()));
            }
            loop {
                if started.elapsed() > self.shared.options.append_deadline {
                    return Err(Error::OutcomeUnknown {
                        log_id,
                        waited: started.elapsed(),
                    });
                }
                match self.find().await {
                    Ok(Found::Ours) => return Ok(self.stored()),
                    Ok(Found::Other) => {
                        return Err(Error::TailMoved {
                            log_id,
                            expected: Lsn(self.expected),
                        });
                    }
                    Ok(Found::Nothing) if !unanswered => {
                        return Err(Error::TailMoved {
                            log_id,
                            expected: Lsn(self.expected),
                        });
                    }
                    Ok(Found::Nothing) => match self.send().await {
                        Ok(again) => {
                            ack = again;
                            break;
                        }
                        Err(err) => warn!(log = %log_id, "sending an append again: {err}"),
                    },
                    Err(err) => warn!(log = %log_id, "looking for an unanswered append: {err}"),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// What is at `expected + 1`, if the stream answers within [`LOOKUP_TIMEOUT`]: one without a
    /// leader answers nothing, and the lookup is sent again until it has one.
    async fn find(&self) -> Result<Found> {
        use async_nats::jetstream::stream::RawMessageErrorKind;
        let lookup = self.shared.stream.get_raw_message(self.expected + 1);
        let Ok(found) = tokio::time::timeout(LOOKUP_TIMEOUT, lookup).await else {
            return Err(self.shared.nats_error("find an unanswered append")(
                format!("no answer within {LOOKUP_TIMEOUT:?}").into(),
            ));
        };
        match found {
            Ok(message) => {
                let ours = message
                    .headers
                    .get(APPEND_ID)
                    .is_some_and(|id| id.as_str() == self.id);
                Ok(if ours { Found::Ours } else { Found::Other })
            }
            Err(err) if err.kind() == RawMessageErrorKind::NoMessageFound => {
                // Gone to a trim is not nothing: something was there.
                let state = self.shared.fetch_state().await?;
                if state.trim_point.0 > self.expected {
                    return Err(self.shared.nats_error("find an unanswered append")(
                        format!(
                            "the log was trimmed to LSN {} past the append at LSN {}",
                            state.trim_point,
                            self.expected + 1
                        )
                        .into(),
                    ));
                }
                Ok(Found::Nothing)
            }
            Err(err) => Err(self.shared.nats_error("find an unanswered append")(
                err.into(),
            )),
        }
    }

    /// Notes the stored records for readers and returns the LSN of the last.
    fn stored(&self) -> Lsn {
        {
            let mut view = self.shared.view.lock();
            view.appended(self.expected + 1, &self.payloads, &self.shared.options);
        }
        self.shared.changed.send_replace(());
        Lsn(self.last())
    }
}
