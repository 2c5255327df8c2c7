//! The `nats` provider: each log is a JetStream stream, replicated by JetStream's Raft, so that a
//! record acknowledged by a node survives the loss of that node.
//!
//! - **One stream per log**, `cairn-<cluster>-log-<id>` on the subject `cairn.<cluster>.log.<id>`,
//!   in files, with `replicas` copies and no limit that would discard anything. An LSN is the
//!   stream's sequence; trimming purges below a sequence, which JetStream keeps across restarts.
//! - **Appends** go through one task per log ([`append`]), which sends them in order without
//!   waiting for the previous acknowledgement: many are in flight at once. Each names the
//!   sequence the stream must end at before it (`Nats-Expected-Last-Sequence`), so appends of
//!   one writer land back to back and in order, an append that meets a second writer's record
//!   (a leader that lost its leadership) fails (appends it already had in flight behind that one
//!   may land after the other's record: the processor skips them by their epoch), and retrying
//!   an append whose acknowledgement was
//!   lost cannot write it twice: the retry names the same sequence, so at most one of the two
//!   lands, and the record found there (by an id in its headers) says which. An append of
//!   several records is a JetStream atomic batch: all of its records land, back to back, or
//!   none.
//! - **Reads** ([`read`]) come from memory when they can: the records this node appended
//!   recently, and those a tailing consumer fetched. A reader that needs older records, and a
//!   node waiting for records another node appends, start the tailer: an ordered pull consumer
//!   that long-polls the stream from where the reader is. It stops by itself once this node's
//!   own appends bring it nothing new.

mod append;
mod read;

use crate::{BoxError, Entry, Error, LogProvider, LogState, Loglet, Result};
use async_nats::jetstream;
use async_trait::async_trait;
use bytes::Bytes;
use cairn_types::{LogId, Lsn};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};

/// Where the streams are and how they are kept.
#[derive(Debug, Clone)]
pub struct NatsLogOptions {
    /// NATS server URLs (`nats://host:port`); any of them will do.
    pub servers: Vec<String>,
    /// Names the streams and their subjects; one cluster's logs never meet another's. Letters,
    /// digits, `-` and `_` only.
    pub cluster: String,
    /// JetStream replicas of each stream: 3 in a cluster of NATS servers, 1 for a single server.
    pub replicas: usize,
    /// Recent records kept in memory per log, for the processor to read without a round trip.
    pub cache_bytes: usize,
    /// How long an append keeps trying after NATS stops answering, before it reports that its
    /// outcome is unknown.
    pub append_deadline: Duration,
}

impl NatsLogOptions {
    pub fn new(servers: Vec<String>, cluster: impl Into<String>) -> NatsLogOptions {
        NatsLogOptions {
            servers,
            cluster: cluster.into(),
            replicas: 3,
            cache_bytes: 4 << 20,
            append_deadline: Duration::from_secs(30),
        }
    }
}

/// The JetStream stream that holds log `log_id` of `cluster`.
pub fn stream_name(cluster: &str, log_id: LogId) -> String {
    format!("cairn-{cluster}-log-{}", log_id.0)
}

/// How long connecting waits for a NATS server to answer.
/// How long one JetStream request (an append's acknowledgement, a lookup) is waited for. A
/// stream whose leader was lost answers nothing until NATS has elected another (seconds): an
/// append unanswered this long is looked up and sent again (it cannot land twice), so a short
/// wait costs a retry, and a long one would hold the append well past that election.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

pub const CONNECT_TIMEOUT: Duration = cairn_nats::CONNECT_TIMEOUT;

/// How long opening a log keeps trying while JetStream does not answer (a cluster of NATS
/// servers that has just started elects its leaders first).
const OPEN_PATIENCE: Duration = Duration::from_secs(30);

/// The most a node waits, at random, before it creates a stream it found missing (see
/// [`NatsLogProvider::open_stream`]).
const CREATE_JITTER_MS: u64 = 500;

/// Records one atomic batch may hold: JetStream's limit for an atomic batch publish.
pub const BATCH_RECORDS_MAX: usize = 1000;

/// Room left in a NATS message for the headers an append adds to its payload.
const HEADER_ALLOWANCE: usize = 256;

/// Appends sent and not yet acknowledged, per log, before the next one waits.
const APPENDS_IN_FLIGHT_MAX: usize = 1024;

/// Acknowledgements the NATS client waits for at once, for all logs: more than any number of
/// partitions times [`APPENDS_IN_FLIGHT_MAX`] can reach.
const ACKS_IN_FLIGHT_MAX: usize = 1 << 24;

pub struct NatsLogProvider {
    client: async_nats::Client,
    jetstream: jetstream::Context,
    options: NatsLogOptions,
    logs: tokio::sync::Mutex<HashMap<LogId, Arc<NatsLoglet>>>,
}

impl NatsLogProvider {
    /// Connects to NATS. Streams are created when their logs are first opened.
    pub async fn connect(options: NatsLogOptions) -> Result<NatsLogProvider> {
        let connect_error = |source: BoxError| Error::Connect {
            servers: options.servers.join(", "),
            source,
        };
        let client = cairn_nats::connect(&options.servers)
            .await
            .map_err(|e| connect_error(e.into()))?;
        // The appenders bound what is in flight (per log); the context's own bound, shared by
        // every log, must not be lower, or appenders waiting for a permit stop polling the
        // acknowledgements that would free one.
        let jetstream = jetstream::context::ContextBuilder::new()
            .max_ack_inflight(ACKS_IN_FLIGHT_MAX)
            .timeout(REQUEST_TIMEOUT)
            .build(client.clone());
        Ok(NatsLogProvider {
            client,
            jetstream,
            options,
            logs: tokio::sync::Mutex::new(HashMap::new()),
        })
    }

    fn stream_name(&self, log_id: LogId) -> String {
        stream_name(&self.options.cluster, log_id)
    }

    fn subject(&self, log_id: LogId) -> String {
        format!("cairn.{}.log.{}", self.options.cluster, log_id.0)
    }

    /// The stream of `config`, created if it does not exist. Several nodes open the same
    /// streams at once, and a JetStream cluster that has just started answers nothing for a
    /// while: looked up first (an update of a stream being created may go unanswered), created
    /// if missing, looked up again if another node created it meanwhile, and all of it retried
    /// for [`OPEN_PATIENCE`]. A stream found missing is looked up once more after a random
    /// pause before it is created: JetStream clusters that take the same stream's creation from
    /// several clients at once have been seen to leave it answering "not found" to every
    /// request for its state for minutes (a new cluster's nodes all start together), so the
    /// pause makes one node create it and the others find it.
    async fn open_stream(
        &self,
        config: jetstream::stream::Config,
    ) -> std::result::Result<jetstream::stream::Stream, BoxError> {
        use async_nats::jetstream::ErrorCode;
        use async_nats::jetstream::context::GetStreamErrorKind;
        let deadline = std::time::Instant::now() + OPEN_PATIENCE;
        loop {
            let attempt: std::result::Result<_, BoxError> =
                match self.jetstream.get_stream(&config.name).await {
                    Ok(stream) => Ok(stream),
                    Err(err)
                        if matches!(err.kind(), GetStreamErrorKind::JetStream(e)
                            if e.error_code() == ErrorCode::STREAM_NOT_FOUND) =>
                    {
                        let pause = rand::random_range(0..CREATE_JITTER_MS);
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                        match self.jetstream.get_stream(&config.name).await {
                            Ok(stream) => Ok(stream),
                            Err(_) => self
                                .jetstream
                                .create_stream(config.clone())
                                .await
                                .map_err(Into::into),
                        }
                    }
                    Err(err) => Err(err.into()),
                };
            match attempt {
                // Streams of an earlier version lack atomic batches.
                Ok(stream) if !stream.cached_info().config.allow_atomic_publish => {
                    self.jetstream.update_stream(config.clone()).await?;
                }
                Ok(stream) => return Ok(stream),
                Err(err) if std::time::Instant::now() < deadline => {
                    tracing::debug!(stream = %config.name, "opening the stream, again: {err}");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(err) => return Err(err),
            }
        }
    }

    async fn create(&self, log_id: LogId) -> Result<NatsLoglet> {
        let nats = |context| {
            move |source: BoxError| Error::Nats {
                log_id,
                context,
                source,
            }
        };
        let subject = self.subject(log_id);
        let name = self.stream_name(log_id);
        let config = jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            storage: jetstream::stream::StorageType::File,
            num_replicas: self.options.replicas,
            retention: jetstream::stream::RetentionPolicy::Limits,
            // Nothing is ever discarded but by a trim.
            max_messages: -1,
            max_bytes: -1,
            max_messages_per_subject: -1,
            max_message_size: -1,
            max_consumers: -1,
            // Records are removed by purging below a sequence, never one by one.
            deny_delete: true,
            allow_atomic_publish: true,
            description: Some(format!("Cairn: the log of partition {}", log_id.0)),
            ..Default::default()
        };
        let stream = self
            .open_stream(config.clone())
            .await
            .map_err(nats("open the log's stream"))?;
        let max_payload = self.client.server_info().max_payload;
        let (closed, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            log_id,
            subject,
            stream,
            config,
            jetstream: self.jetstream.clone(),
            client: self.client.clone(),
            record_bytes_max: max_payload.saturating_sub(HEADER_ALLOWANCE),
            options: self.options.clone(),
            view: parking_lot::Mutex::new(read::View::default()),
            changed: watch::channel(()).0,
            closed,
        });
        let state = shared.fetch_state().await?;
        let (appends, requests) = mpsc::channel(APPENDS_IN_FLIGHT_MAX);
        tokio::spawn(append::run(shared.clone(), requests, state.tail.0));
        Ok(NatsLoglet { shared, appends })
    }
}

#[async_trait]
impl LogProvider for NatsLogProvider {
    async fn open(&self, log_id: LogId) -> Result<Arc<dyn Loglet>> {
        let mut logs = self.logs.lock().await;
        if let Some(log) = logs.get(&log_id) {
            return Ok(log.clone());
        }
        let log = Arc::new(self.create(log_id).await?);
        logs.insert(log_id, log.clone());
        Ok(log)
    }
}

/// What the appender, the readers and the tailer of one log share.
struct Shared {
    log_id: LogId,
    subject: String,
    stream: jetstream::stream::Stream,
    /// The stream's configuration, to declare it again (see [`Shared::fetch_state`]).
    config: jetstream::stream::Config,
    jetstream: jetstream::Context,
    client: async_nats::Client,
    /// The largest payload one NATS message can carry with an append's headers.
    record_bytes_max: usize,
    options: NatsLogOptions,
    view: parking_lot::Mutex<read::View>,
    /// Ticks whenever the view changes: a record arrived, the tail or the trim point moved.
    changed: watch::Sender<()>,
    /// Set once the log's last handle is gone; the tailer stops.
    closed: watch::Sender<bool>,
}

impl Shared {
    fn nats_error(&self, context: &'static str) -> impl FnOnce(BoxError) -> Error + use<> {
        let log_id = self.log_id;
        move |source| Error::Nats {
            log_id,
            context,
            source,
        }
    }

    /// The stream's own idea of where the log stands, merged into the view.
    async fn fetch_state(&self) -> Result<LogState> {
        use async_nats::jetstream::ErrorCode;
        let info = match self.stream.get_info().await {
            Ok(info) => info,
            // A JetStream cluster whose servers created the stream concurrently can be left
            // answering "not found" to the stream's info while the stream itself takes appends
            // and reads: declaring it again (same configuration, so nothing changes if it is
            // there) brings the answer back.
            Err(err)
                if err
                    .to_string()
                    .contains(&format!("error code {}", ErrorCode::STREAM_NOT_FOUND.0)) =>
            {
                tracing::warn!(log = %self.log_id, "the log's stream answers that it is not found ({err}); declaring it again");
                self.jetstream
                    .create_stream(self.config.clone())
                    .await
                    .map_err(|e| self.nats_error("declare the log's stream again")(e.into()))?
                    .info()
                    .await
                    .map_err(|e| self.nats_error("read the log's stream state")(e.into()))?
                    .clone()
            }
            Err(err) => return Err(self.nats_error("read the log's stream state")(err.into())),
        };
        // A stream that never held a message starts at 0; one purged to its end starts one past
        // its last sequence.
        let trim_point = info.state.first_sequence.saturating_sub(1);
        let tail = info.state.last_sequence;
        Ok(self.learned(trim_point, tail))
    }

    /// Notes a trim point and a tail learned from NATS; both only move forward.
    fn learned(&self, trim_point: u64, tail: u64) -> LogState {
        let state = {
            let mut view = self.view.lock();
            view.learned(trim_point, tail);
            view.state()
        };
        self.changed.send_replace(());
        state
    }
}

pub(crate) struct NatsLoglet {
    shared: Arc<Shared>,
    appends: mpsc::Sender<append::Request>,
}

impl Drop for NatsLoglet {
    fn drop(&mut self) {
        self.shared.closed.send_replace(true);
    }
}

#[async_trait]
impl Loglet for NatsLoglet {
    fn log_id(&self) -> LogId {
        self.shared.log_id
    }

    fn record_bytes_max(&self) -> usize {
        self.shared.record_bytes_max
    }

    async fn append(&self, payloads: Vec<Bytes>) -> Result<Lsn> {
        let log_id = self.shared.log_id;
        if payloads.is_empty() {
            return Ok(self.shared.view.lock().state().tail);
        }
        if payloads.len() > BATCH_RECORDS_MAX {
            return Err(Error::BatchTooLarge {
                log_id,
                records: payloads.len(),
                limit: BATCH_RECORDS_MAX,
            });
        }
        if let Some(size) = payloads
            .iter()
            .map(Bytes::len)
            .find(|&size| size > self.shared.record_bytes_max)
        {
            return Err(Error::RecordTooLarge {
                log_id,
                size,
                limit: self.shared.record_bytes_max,
            });
        }
        let (reply, answer) = oneshot::channel();
        self.appends
            .send(append::Request { payloads, reply })
            .await
            .map_err(|_| Error::Shutdown { log_id })?;
        answer.await.map_err(|_| Error::Shutdown { log_id })?
    }

    async fn read(&self, from: Lsn, max_records: usize) -> Result<Vec<Entry>> {
        read::read(&self.shared, from.0, max_records).await
    }

    async fn wait_for_tail(&self, lsn: Lsn) -> Result<()> {
        read::wait_for_tail(&self.shared, lsn.0).await
    }

    async fn trim(&self, up_to: Lsn) -> Result<()> {
        let state = self.shared.fetch_state().await?;
        let up_to = up_to.min(state.tail);
        if up_to <= state.trim_point {
            return Ok(());
        }
        // Purges every message below the sequence given.
        self.shared
            .stream
            .purge()
            .sequence(up_to.0 + 1)
            .await
            .map_err(|e| self.shared.nats_error("trim the log")(e.into()))?;
        self.shared.learned(up_to.0, up_to.0);
        Ok(())
    }

    async fn state(&self) -> Result<LogState> {
        Ok(self.shared.view.lock().state())
    }

    async fn find_tail(&self) -> Result<LogState> {
        self.shared.fetch_state().await
    }
}
