//! What a checker is given: the operations clients performed, each with its call, what came of it
//! and when (on the clients' clock) it was invoked and completed.
//!
//! A [`History`] is a plain list of [`Operation`]s in any order. A [`Recorder`] builds one from
//! real operations: a client calls [`Recorder::invoke`] just before sending a request and
//! [`Pending::complete`] once it has the answer; a [`Pending`] dropped without completing is
//! recorded as [`Outcome::Unknown`], which is what a timeout or a lost connection means.
//!
//! Times are whole milliseconds. The checker takes an operation's effect to lie somewhere in
//! `[invoked_ms, completed_ms]`, so a stamp must never claim more than the clock saw: the
//! recorder rounds invocations down and completions up. A history built by hand must do the same
//! (or widen the intervals through [`crate::CheckOptions::client_clock_skew_ms`]).
//!
//! This module knows nothing of Cairn's wire protocol or processes: a call is one of the five
//! operations of the data model, on one key.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// One operation a client performed on one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Operation {
    /// Who performed it. Only used to describe violations: the checker does not assume that one
    /// client's operations are sequential, their times say what the order was.
    pub client: u64,
    /// The key it was performed on. Every call touches exactly one key.
    pub key: Bytes,
    /// What was asked.
    pub call: Call,
    /// What came of it.
    pub outcome: Outcome,
    /// When the client sent it, in milliseconds on the clients' clock (rounded down).
    pub invoked_ms: u64,
    /// When the client had its answer or gave up, in milliseconds on the clients' clock (rounded
    /// up). For [`Outcome::Unknown`] writes the checker ignores it: such a write may take effect
    /// at any time after its invocation.
    pub completed_ms: u64,
}

/// The operations of the data model, each on one key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Call {
    /// Sets the key's value, replacing any, with a time to live if `ttl_ms` is given. Answers
    /// [`Output::Done`].
    Put {
        /// The value written.
        value: Bytes,
        /// How long the value lives, from when it is written; `None` for ever.
        ttl_ms: Option<u64>,
    },
    /// Reads the key's value. Answers [`Output::Value`]: `None` if the key is absent or expired.
    Get,
    /// Removes the key whether or not it is present. Answers [`Output::Done`].
    Delete,
    /// Asks whether the key is present (and unexpired). Answers [`Output::Bool`].
    Exists,
    /// Writes the value only if the key is absent or expired. Answers [`Output::Bool`]: whether
    /// this call wrote it.
    InsertIfAbsent {
        /// The value written if the key is absent.
        value: Bytes,
        /// How long the value lives, from when it is written; `None` for ever.
        ttl_ms: Option<u64>,
    },
}

impl Call {
    /// Whether the call can change the key (everything but [`Call::Get`] and [`Call::Exists`]).
    pub fn is_write(&self) -> bool {
        !matches!(self, Call::Get | Call::Exists)
    }
}

/// What came of an operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// It took effect, between its invocation and its completion, and answered this.
    Ok(Output),
    /// It certainly did not take effect: the store refused it having done nothing. The checker
    /// drops such operations.
    Failed,
    /// The client cannot tell whether it took effect (a timeout, a connection lost after the
    /// request was sent). A write with this outcome may have taken effect at any time after its
    /// invocation, however late, or never; a read with it constrains nothing and is dropped.
    Unknown,
}

/// What a successful operation answered.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Output {
    /// The answer of [`Call::Put`] and [`Call::Delete`]: nothing but success.
    Done,
    /// The answer of [`Call::Get`]: the value, or `None` if the key is absent or expired.
    Value(Option<Bytes>),
    /// The answer of [`Call::Exists`] and [`Call::InsertIfAbsent`].
    Bool(bool),
}

/// The operations recorded against a store, in any order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    operations: Vec<Operation>,
}

impl History {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    /// A history of these operations.
    pub fn from_operations(operations: Vec<Operation>) -> Self {
        History { operations }
    }

    /// Adds an operation.
    pub fn push(&mut self, operation: Operation) {
        self.operations.push(operation);
    }

    /// How many operations it holds, whatever their outcome.
    pub fn len(&self) -> usize {
        self.operations.len()
    }

    /// Whether it holds no operation.
    pub fn is_empty(&self) -> bool {
        self.operations.is_empty()
    }

    /// The operations, in the order they were added.
    pub fn operations(&self) -> &[Operation] {
        &self.operations
    }

    /// The operations, in the order they were added.
    pub fn into_operations(self) -> Vec<Operation> {
        self.operations
    }

    /// The earliest invocation of any operation (0 for an empty history): what violations show
    /// times relative to.
    pub fn start_ms(&self) -> u64 {
        self.operations
            .iter()
            .map(|operation| operation.invoked_ms)
            .min()
            .unwrap_or(0)
    }
}

impl FromIterator<Operation> for History {
    fn from_iter<I: IntoIterator<Item = Operation>>(operations: I) -> Self {
        History::from_operations(operations.into_iter().collect())
    }
}

impl Extend<Operation> for History {
    fn extend<I: IntoIterator<Item = Operation>>(&mut self, operations: I) {
        self.operations.extend(operations);
    }
}

/// Records operations as clients perform them, stamping them from one clock.
///
/// Cloning is cheap and every clone records into the same history, so each client thread or task
/// can hold its own. The clock is the system's wall clock read once, when the recorder is created,
/// advanced by a monotonic clock: stamps are wall-clock milliseconds (comparable with a store's
/// clock, up to [`crate::CheckOptions::clock_tolerance_ms`]) that never go backwards, even if the
/// system clock is stepped while the test runs. Every operation is stamped by this one clock, so
/// a history recorded through one recorder needs no
/// [`crate::CheckOptions::client_clock_skew_ms`].
#[derive(Debug, Clone)]
pub struct Recorder {
    shared: Arc<RecorderShared>,
}

#[derive(Debug)]
struct RecorderShared {
    /// When the recorder was created, on the monotonic clock...
    origin: Instant,
    /// ...and on the wall clock, in microseconds since the Unix epoch.
    origin_unix_micros: u64,
    /// The operations completed (or abandoned) so far.
    operations: Mutex<Vec<Operation>>,
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new()
    }
}

impl Recorder {
    /// A recorder with no operation, whose clock starts at the system's wall clock.
    pub fn new() -> Self {
        // A system clock set before 1970 is not worth failing for: the stamps then start at 0,
        // which only shifts every time alike.
        let origin_unix_micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|since_epoch| u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Recorder {
            shared: Arc::new(RecorderShared {
                origin: Instant::now(),
                origin_unix_micros,
                operations: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The recorder's clock, in microseconds since the Unix epoch.
    fn now_micros(&self) -> u64 {
        let elapsed = u64::try_from(self.shared.origin.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.shared.origin_unix_micros.saturating_add(elapsed)
    }

    /// The recorder's clock in milliseconds since the Unix epoch, rounded down: what a simulated
    /// store in a test can use as its own clock so that its TTLs agree with the stamps.
    pub fn now_ms(&self) -> u64 {
        self.now_micros() / 1000
    }

    /// Stamps the invocation of `call` on `key` by `client`, to be completed with
    /// [`Pending::complete`] once the answer is in.
    pub fn invoke(&self, client: u64, key: impl Into<Bytes>, call: Call) -> Pending {
        Pending {
            recorder: self.clone(),
            in_flight: Some(InFlight {
                client,
                key: key.into(),
                call,
                invoked_ms: self.now_micros() / 1000,
            }),
        }
    }

    /// The operations completed (or abandoned) so far. Call it once every client is done:
    /// operations still in flight are not in it.
    pub fn history(&self) -> History {
        History::from_operations(self.lock().clone())
    }

    /// How many operations have completed (or been abandoned) so far.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no operation has completed (or been abandoned) yet.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn record(&self, in_flight: InFlight, outcome: Outcome) {
        let completed_ms = self.now_micros().div_ceil(1000);
        let operation = Operation {
            client: in_flight.client,
            key: in_flight.key,
            call: in_flight.call,
            outcome,
            invoked_ms: in_flight.invoked_ms,
            completed_ms,
        };
        self.lock().push(operation);
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Operation>> {
        // A client that panicked while holding the lock left a complete vector behind (pushing is
        // the only thing done under it), so its poison is no reason to lose the history.
        self.shared
            .operations
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[derive(Debug)]
struct InFlight {
    client: u64,
    key: Bytes,
    call: Call,
    invoked_ms: u64,
}

/// An operation invoked through a [`Recorder`] and not completed yet.
///
/// Dropping it without calling [`Pending::complete`] records it as [`Outcome::Unknown`], completed
/// when dropped: a client that gave up on an answer (a timeout, a cancelled task, a panic) does
/// not know what became of its request.
#[derive(Debug)]
#[must_use = "a pending operation dropped at once is recorded as having an unknown outcome"]
pub struct Pending {
    recorder: Recorder,
    in_flight: Option<InFlight>,
}

impl Pending {
    /// Records what came of the operation, stamping its completion.
    pub fn complete(mut self, outcome: Outcome) {
        if let Some(in_flight) = self.in_flight.take() {
            self.recorder.record(in_flight, outcome);
        }
    }

    /// When it was invoked, in milliseconds on the recorder's clock.
    pub fn invoked_ms(&self) -> u64 {
        self.in_flight
            .as_ref()
            .map_or(0, |in_flight| in_flight.invoked_ms)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(in_flight) = self.in_flight.take() {
            self.recorder.record(in_flight, Outcome::Unknown);
        }
    }
}

/// Shows a key or a value readably: as a quoted string if it is short printable UTF-8, else as
/// hexadecimal, cut short past a few dozen bytes.
pub(crate) struct ShowBytes<'a>(pub &'a [u8]);

impl fmt::Display for ShowBytes<'_> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN_MAX: usize = 32;
        let bytes = self.0;
        if let Ok(text) = std::str::from_utf8(bytes)
            && !text.chars().any(char::is_control)
        {
            if text.chars().count() <= SHOWN_MAX {
                return write!(formatter, "{text:?}");
            }
            let head: String = text.chars().take(SHOWN_MAX).collect();
            return write!(formatter, "{head:?}… ({} bytes)", bytes.len());
        }
        write!(formatter, "0x")?;
        for byte in bytes.iter().take(SHOWN_MAX) {
            write!(formatter, "{byte:02x}")?;
        }
        if bytes.len() > SHOWN_MAX {
            write!(formatter, "… ({} bytes)", bytes.len())?;
        }
        Ok(())
    }
}

impl fmt::Display for Call {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show_ttl = |formatter: &mut fmt::Formatter<'_>, ttl_ms: &Option<u64>| match ttl_ms {
            Some(ttl_ms) => write!(formatter, " with ttl {ttl_ms} ms"),
            None => Ok(()),
        };
        match self {
            Call::Put { value, ttl_ms } => {
                write!(formatter, "put {}", ShowBytes(value))?;
                show_ttl(formatter, ttl_ms)
            }
            Call::Get => write!(formatter, "get"),
            Call::Delete => write!(formatter, "delete"),
            Call::Exists => write!(formatter, "exists"),
            Call::InsertIfAbsent { value, ttl_ms } => {
                write!(formatter, "insert-if-absent {}", ShowBytes(value))?;
                show_ttl(formatter, ttl_ms)
            }
        }
    }
}

impl fmt::Display for Output {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Output::Done => write!(formatter, "ok"),
            Output::Value(Some(value)) => write!(formatter, "{}", ShowBytes(value)),
            Output::Value(None) => write!(formatter, "absent"),
            Output::Bool(answer) => write!(formatter, "{answer}"),
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Ok(output) => write!(formatter, "{output}"),
            Outcome::Failed => write!(formatter, "failed"),
            Outcome::Unknown => write!(formatter, "unknown outcome"),
        }
    }
}

/// Shows an operation with its times relative to `origin_ms`:
/// `client 3: put "a" -> ok, invoked +12 ms, completed +15 ms`.
pub(crate) struct ShowOperation<'a> {
    pub operation: &'a Operation,
    pub origin_ms: u64,
}

impl fmt::Display for ShowOperation<'_> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let operation = self.operation;
        let relative = |ms: u64| ms as i128 - self.origin_ms as i128;
        write!(
            formatter,
            "client {}: {} -> {}, invoked {:+} ms, ",
            operation.client,
            operation.call,
            operation.outcome,
            relative(operation.invoked_ms),
        )?;
        if matches!(operation.outcome, Outcome::Unknown) {
            write!(
                formatter,
                "given up {:+} ms",
                relative(operation.completed_ms)
            )
        } else {
            write!(
                formatter,
                "completed {:+} ms",
                relative(operation.completed_ms)
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorder_stamps_invocations_down_and_completions_up_and_records_dropped_operations_as_unknown()
     {
        let recorder = Recorder::new();
        let before = recorder.now_ms();
        recorder
            .invoke(1, "k", Call::Get)
            .complete(Outcome::Ok(Output::Value(None)));
        drop(recorder.invoke(
            2,
            "k",
            Call::Put {
                value: Bytes::from_static(b"v"),
                ttl_ms: None,
            },
        ));
        let after = recorder.now_ms() + 1;
        let history = recorder.history();
        assert_eq!(history.len(), 2);
        let operations = history.operations();
        assert_eq!(operations[0].client, 1);
        assert_eq!(operations[0].outcome, Outcome::Ok(Output::Value(None)));
        assert_eq!(operations[1].outcome, Outcome::Unknown);
        for operation in operations {
            assert!(before <= operation.invoked_ms);
            assert!(operation.invoked_ms <= operation.completed_ms);
            assert!(operation.completed_ms <= after);
        }
    }

    #[test]
    fn a_recorder_shared_between_threads_records_every_operation() {
        let recorder = Recorder::new();
        std::thread::scope(|scope| {
            for client in 0..4 {
                let recorder = recorder.clone();
                scope.spawn(move || {
                    for _ in 0..100 {
                        recorder
                            .invoke(client, "k", Call::Exists)
                            .complete(Outcome::Ok(Output::Bool(false)));
                    }
                });
            }
        });
        assert_eq!(recorder.len(), 400);
    }

    #[test]
    fn bytes_show_as_text_when_printable_and_as_hexadecimal_otherwise() {
        assert_eq!(ShowBytes(b"abc").to_string(), "\"abc\"");
        assert_eq!(ShowBytes(&[0, 255]).to_string(), "0x00ff");
        let long = vec![b'x'; 40];
        assert!(ShowBytes(&long).to_string().ends_with("(40 bytes)"));
    }

    #[test]
    fn a_history_survives_a_round_trip_through_json() {
        let history = History::from_operations(vec![Operation {
            client: 7,
            key: Bytes::from_static(b"k"),
            call: Call::InsertIfAbsent {
                value: Bytes::from_static(b"v"),
                ttl_ms: Some(100),
            },
            outcome: Outcome::Ok(Output::Bool(true)),
            invoked_ms: 10,
            completed_ms: 12,
        }]);
        let encoded = serde_json::to_string(&history).expect("a history encodes");
        let decoded: History = serde_json::from_str(&encoded).expect("and decodes");
        assert_eq!(decoded, history);
    }
}
