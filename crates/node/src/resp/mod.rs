//! The Redis-protocol front end: a RESP2/RESP3 port beside the gRPC one, over the same
//! partitions, durability and routing.
//!
//! # One request per run of commands
//! A connection reads whatever its client has sent (a pipeline, or one command), parses every
//! complete command in it, and runs them as a few requests to the key-value service this node
//! serves over gRPC: each maximal run of consecutive reads becomes one read, each run of
//! consecutive writes one write. So a pipeline of 100 `SET`s costs what one put of 100 keys does.
//! Replies keep the order of the commands, and every write of a run is applied before the reads
//! after it are made; writes of one run to one partition apply in order, those to different
//! partitions concurrently (as a Redis Cluster pipeline across slots does). The service splits
//! each request by partition and forwards what this node does not lead, as it does for gRPC
//! clients. Each command's reply comes from its own keys' partitions: one whose partitions
//! answered differently says what was applied, and a run is never sent again once any of it was
//! sent.
//!
//! # Decided by the state machine
//! Commands that must read before they write (`SET … NX/XX/GET/KEEPTTL`, `EXPIRE`, `DEL`'s count,
//! `MSETNX`) are conditional operations in the partition's log record; the partition decides them
//! when it applies the record. The front end never reads a key to decide a write.
//!
//! # Bounds
//! A command carries at most one request's worth of keys and bytes; a run is cut into requests
//! of at most [`BATCH_KEYS_MAX`] keys and half of [`BATCH_BYTES_MAX`] bytes. A frame longer than
//! [`FRAME_BYTES_MAX`] closes the connection with a protocol error, as does a malformed one.
//!
//! # Framing
//! Commands come as arrays of bulk strings, the form every client library sends, or as inline
//! commands, a line of text as typed into `telnet` or `nc` (see [`inline`]).

mod command;
mod inline;
mod reply;

use crate::node::NodeState;
use crate::service::KeyValueService;
use bytes::{Bytes, BytesMut};
use cairn_api::v1;
use cairn_api::v1::key_value_server::KeyValue;
use cairn_types::limits::{BATCH_BYTES_MAX, BATCH_KEYS_MAX};
use cairn_types::record::{Action, Condition, Expiry, WriteOp};
use command::{COMMANDS, Command, CommandSpec, Connection, Read, ReadReply, Write, WriteReply};
use reply::Reply;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Status};
use tracing::{debug, info, warn};

/// The longest frame (one command with its arguments) a connection takes: a request's bytes and
/// room for its framing.
pub const FRAME_BYTES_MAX: usize = 2 * BATCH_BYTES_MAX;

/// Commands parsed from what a client sent before they are run: a pipeline longer than this is
/// run in parts.
const COMMANDS_PER_ROUND_MAX: usize = 10_000;

/// Binds the RESP port.
pub(crate) async fn bind(address: SocketAddr) -> anyhow::Result<TcpListener> {
    use anyhow::Context;
    let listener = TcpListener::bind(address).await.with_context(|| {
        format!(
            "cannot listen for Redis clients on {address}: another process (a Redis server?) may \
             use it; set resp.bind-address (or CAIRN_RESP__BIND_ADDRESS) to a free address, or \
             to \"none\" for no Redis port"
        )
    })?;
    info!(
        "Redis protocol (RESP) listening on {}",
        listener.local_addr().unwrap_or(address)
    );
    Ok(listener)
}

/// What the connections of a node share.
struct Server {
    state: Arc<NodeState>,
    kv: KeyValueService,
    port: u16,
    started: Instant,
    next_client_id: AtomicU64,
    /// Clients connected now (the admission's count).
    connected: Arc<AtomicUsize>,
}

/// Serves Redis clients on `listener` until `cancel`.
pub(crate) async fn serve(
    listener: TcpListener,
    state: Arc<NodeState>,
    max_clients: usize,
    cancel: CancellationToken,
) {
    let mut admission =
        crate::connections::Admission::new("RESP port", "resp.max-clients", max_clients);
    let server = Arc::new(Server {
        kv: KeyValueService::new(state.clone()),
        state,
        port: listener.local_addr().map(|a| a.port()).unwrap_or_default(),
        started: Instant::now(),
        next_client_id: AtomicU64::new(1),
        connected: admission.open_count(),
    });
    loop {
        let (stream, peer, open) = tokio::select! {
            // As Redis does, a client beyond the bound is told why, without waiting for it to
            // read it.
            admitted = admission.next(&listener, |stream| {
                let _ = stream.try_write(b"-ERR max number of clients reached\r\n");
            }) => admitted,
            () = cancel.cancelled() => return,
        };
        let server = server.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let id = server.next_client_id.fetch_add(1, Ordering::Relaxed);
            server.state.metrics.resp_connections(1);
            let mut connection = ClientConnection {
                server: server.clone(),
                id,
                name: None,
                resp3: false,
            };
            tokio::select! {
                () = connection.run(stream) => {}
                () = cancel.cancelled() => {}
            }
            drop(open);
            server.state.metrics.resp_connections(-1);
            debug!(%peer, id, "RESP connection closed");
        });
    }
}

struct ClientConnection {
    server: Arc<Server>,
    id: u64,
    name: Option<Bytes>,
    resp3: bool,
}

/// Replies on their way to the client: written out whenever a megabyte has gathered, so that a
/// long pipeline of large values is not held in memory whole.
struct Output<'a> {
    stream: &'a mut TcpStream,
    buffer: BytesMut,
    /// The client went away: what is left to run is not worth running.
    gone: bool,
    /// Where what the client sends while replies are written goes.
    input: &'a mut BytesMut,
    /// The client will send no more (it closed its side, or reading failed).
    input_closed: &'a mut bool,
}

/// Replies gathered before they are written out.
const OUTPUT_FLUSH_BYTES: usize = 1 << 20;

/// What a client may send while it does not read its replies, at most; one that sends more is
/// disconnected (Redis's `client-query-buffer-limit` is 1 GiB).
const INPUT_WHILE_WRITING_BYTES_MAX: usize = 256 << 20;

/// What a connection's input buffer has room for, at least, when it reads.
const INPUT_KEPT_BYTES: usize = 64 * 1024;

/// A connection's input buffer grown beyond this for a large command is given back once that
/// command has run, so that an idle connection does not hold the largest command it ever sent.
const INPUT_SHRINK_ABOVE_BYTES: usize = 1 << 20;

impl Output<'_> {
    fn push(&mut self, reply: Reply, resp3: bool) {
        reply.encode(resp3, &mut self.buffer);
    }

    async fn flush_if_full(&mut self) {
        if self.buffer.len() >= OUTPUT_FLUSH_BYTES {
            self.flush().await;
        }
    }

    async fn flush(&mut self) {
        if !self.buffer.is_empty() && !self.gone {
            self.gone = !self.write_reading().await;
        }
        self.buffer.clear();
    }

    /// Writes the buffer whole, reading what the client sends meanwhile: a client that sends a
    /// whole pipeline before it reads a reply (redis-py's pipelines do) would otherwise wait for
    /// the server to read while the server waits for it to read. Returns whether it was written.
    async fn write_reading(&mut self) -> bool {
        let (mut reader, mut writer) = self.stream.split();
        let mut data = &self.buffer[..];
        while !data.is_empty() {
            let reading = !*self.input_closed;
            if reading {
                if self.input.len() >= INPUT_WHILE_WRITING_BYTES_MAX {
                    warn!(
                        "RESP port: a client sent more than {} MiB of commands without reading \
                         their replies; it is disconnected",
                        INPUT_WHILE_WRITING_BYTES_MAX >> 20
                    );
                    return false;
                }
                self.input.reserve(INPUT_KEPT_BYTES);
            }
            tokio::select! {
                // The write first: it usually takes the whole buffer at once, and then no read
                // is tried (a syscall per reply for nothing).
                biased;
                written = writer.write(data) => match written {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => data = &data[n..],
                },
                read = reader.read_buf(self.input), if reading => {
                    if !matches!(read, Ok(n) if n > 0) {
                        *self.input_closed = true;
                    }
                }
            }
        }
        true
    }
}

impl ClientConnection {
    async fn run(&mut self, mut stream: TcpStream) {
        let mut input = BytesMut::with_capacity(INPUT_KEPT_BYTES);
        let mut input_closed = false;
        let mut scan = FrameScan::default();
        loop {
            let (commands, protocol_error) = decode_resuming(&mut input, &mut scan);
            let ran = !commands.is_empty();
            let mut output = Output {
                stream: &mut stream,
                buffer: BytesMut::new(),
                gone: false,
                input: &mut input,
                input_closed: &mut input_closed,
            };
            let quit = ran && self.run_commands(commands, &mut output).await;
            if protocol_error == Some(ProtocolError::Http) {
                warn!(
                    connection = self.id,
                    "RESP port: a client sent an HTTP request (a web page posting to this port, \
                     perhaps to pass commands through a browser); the connection is closed at its \
                     POST or Host: line, and nothing after that line ran"
                );
            }
            if let Some(details) = &protocol_error {
                // As Redis does: say why, then close, since nothing after it can be framed.
                output.push(
                    Reply::error(format!("ERR Protocol error: {details}")),
                    self.resp3,
                );
            }
            output.flush().await;
            if quit || output.gone || protocol_error.is_some() {
                return;
            }
            if input.capacity() > INPUT_SHRINK_ABOVE_BYTES && input.len() < INPUT_KEPT_BYTES {
                let mut kept = BytesMut::with_capacity(INPUT_KEPT_BYTES);
                kept.extend_from_slice(&input);
                input = kept;
            }
            // A pipeline longer than one round leaves complete commands in the buffer, and so
            // may what came in while replies were written.
            if ran {
                continue;
            }
            if input_closed {
                return;
            }
            input.reserve(INPUT_KEPT_BYTES);
            match stream.read_buf(&mut input).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }

    /// Runs `commands` in order and sends their replies to `output`. Returns whether the client
    /// asked to close the connection.
    async fn run_commands(
        &mut self,
        commands: Vec<(&'static str, Command)>,
        output: &mut Output<'_>,
    ) -> bool {
        let metrics = self.server.state.metrics.clone();
        let mut commands = commands.into_iter().peekable();
        while let Some((label, command)) = commands.next() {
            if output.gone {
                return true;
            }
            let started = Instant::now();
            match command {
                Command::Read(read) => {
                    let mut run = vec![(label, read)];
                    while matches!(commands.peek(), Some((_, Command::Read(_)))) {
                        if let Some((label, Command::Read(read))) = commands.next() {
                            run.push((label, read));
                        }
                    }
                    let (labels, reads): (Vec<_>, Vec<_>) = run.into_iter().unzip();
                    self.reads(&labels, &reads, started, output).await;
                }
                Command::Write(write) if !write.all_or_nothing => {
                    let mut run = vec![(label, write)];
                    while matches!(commands.peek(), Some((_, Command::Write(w))) if !w.all_or_nothing)
                    {
                        if let Some((label, Command::Write(write))) = commands.next() {
                            run.push((label, write));
                        }
                    }
                    let (labels, writes): (Vec<_>, Vec<_>) = run.into_iter().unzip();
                    self.writes(&labels, &writes, started, output).await;
                }
                Command::Write(write) => {
                    self.writes(&[label], std::slice::from_ref(&write), started, output)
                        .await;
                }
                Command::Connection(Connection::Quit) => {
                    self.answer(&[label], vec![Reply::Ok], started, output);
                    return true;
                }
                Command::Connection(connection) => {
                    let reply = self.connection(connection).await;
                    self.answer(&[label], vec![reply], started, output);
                }
                Command::Refused(reply) => {
                    metrics.resp_command(label, started.elapsed());
                    output.push(reply, self.resp3);
                }
            }
            output.flush_if_full().await;
        }
        false
    }

    /// Sends `replies` and counts the commands they answer, each as taking the time since
    /// `started`.
    fn answer(
        &self,
        labels: &[&'static str],
        replies: Vec<Reply>,
        started: Instant,
        output: &mut Output<'_>,
    ) {
        let elapsed = started.elapsed();
        for label in labels {
            self.server.state.metrics.resp_command(label, elapsed);
        }
        for reply in replies {
            output.push(reply, self.resp3);
        }
    }

    /// Answers a run of reads, a request per chunk.
    async fn reads(
        &self,
        labels: &[&'static str],
        run: &[Read],
        started: Instant,
        output: &mut Output<'_>,
    ) {
        let mut done = 0;
        let key_bytes = |r: &Read| r.keys.iter().map(Bytes::len).sum();
        for chunk in chunks(run, |r| r.keys.len(), key_bytes, |_| 0) {
            let labels = &labels[done..done + chunk.len()];
            done += chunk.len();
            match self.read(chunk).await {
                Ok(replies) => self.answer(labels, replies, started, output),
                // One command's failure (an answer too large) must not fail the others'; each
                // reply goes out as it comes, since together they were too large.
                Err(_) if chunk.len() > 1 => {
                    for (read, label) in chunk.iter().zip(labels) {
                        let answer = self.read(std::slice::from_ref(read)).await;
                        let replies = answer.unwrap_or_else(|s| vec![status_reply(&s)]);
                        self.answer(&[label], replies, started, output);
                        output.flush_if_full().await;
                    }
                }
                Err(status) => self.answer(labels, vec![status_reply(&status)], started, output),
            }
            output.flush_if_full().await;
        }
    }

    /// One request for `chunk`: only whether keys exist when that is all it asks, else values
    /// (and expiries, for `TTL`).
    async fn read(&self, chunk: &[Read]) -> Result<Vec<Reply>, Status> {
        let keys: Vec<Bytes> = chunk.iter().flat_map(|r| r.keys.iter().cloned()).collect();
        let values: Vec<v1::MaybeValue> = if chunk.iter().all(|r| r.reply == ReadReply::Count) {
            let exists = self
                .server
                .kv
                .exists(Request::new(v1::ExistsRequest {
                    keys,
                    // Linearizable, as Redis's own reads are.
                    max_staleness_ms: None,
                }))
                .await?
                .into_inner()
                .exists;
            exists
                .into_iter()
                .map(|there| v1::MaybeValue {
                    value: there.then(Bytes::new),
                    expires_at_ms: None,
                })
                .collect()
        } else {
            let with_expiry = chunk
                .iter()
                .any(|r| matches!(r.reply, ReadReply::Ttl { .. }));
            self.server
                .kv
                .get(Request::new(v1::GetRequest {
                    keys,
                    with_expiry,
                    max_staleness_ms: None,
                }))
                .await?
                .into_inner()
                .values
        };
        let now_ms = now_ms();
        let mut values = values.into_iter();
        Ok(chunk
            .iter()
            .map(|read| {
                let mine: Vec<v1::MaybeValue> = values.by_ref().take(read.keys.len()).collect();
                read_reply(read.reply, mine, now_ms)
            })
            .collect())
    }

    /// Answers a run of writes, a request per chunk. A chunk holds at most
    /// [`OLD_VALUES_PER_REQUEST`] operations that return old values, so that no answer outgrows
    /// a message.
    async fn writes(
        &self,
        labels: &[&'static str],
        run: &[Write],
        started: Instant,
        output: &mut Output<'_>,
    ) {
        let op_bytes = |w: &Write| -> usize {
            w.ops
                .iter()
                .map(|op| {
                    let value = match &op.action {
                        Action::Set { value, .. } => value.len(),
                        _ => 0,
                    };
                    op.key.len() + value
                })
                .sum()
        };
        let old_values = |w: &Write| w.ops.iter().filter(|op| op.return_old).count();
        let mut done = 0;
        for chunk in chunks(run, |w| w.ops.len(), op_bytes, old_values) {
            let replies = match self.write(chunk).await {
                Ok(answers) => {
                    let mut replies = Vec::with_capacity(chunk.len());
                    for (write, answers) in chunk.iter().zip(answers) {
                        // Every partition of the command refused its share before writing it
                        // (a record too large for the log, with others' commands in it): the
                        // command alone may fit.
                        let refused = |a: &Result<v1::WriteResult, Status>| {
                            a.as_ref().is_err_and(|s| s.code() == Code::InvalidArgument)
                        };
                        let answers = if chunk.len() > 1 && answers.iter().all(refused) {
                            match self.write(std::slice::from_ref(write)).await {
                                Ok(mut alone) => alone.pop().unwrap_or_default(),
                                Err(status) => vec![Err(status)],
                            }
                        } else {
                            answers
                        };
                        replies.push(command_reply(write.reply, answers));
                    }
                    replies
                }
                // Refused before any of it was sent: each command alone, so that only the one
                // at fault is refused.
                Err(_) if chunk.len() > 1 => {
                    let mut replies = Vec::with_capacity(chunk.len());
                    for write in chunk {
                        replies.push(match self.write(std::slice::from_ref(write)).await {
                            Ok(mut alone) => {
                                command_reply(write.reply, alone.pop().unwrap_or_default())
                            }
                            Err(status) => status_reply(&status),
                        });
                    }
                    replies
                }
                Err(status) => vec![status_reply(&status)],
            };
            self.answer(&labels[done..done + chunk.len()], replies, started, output);
            done += chunk.len();
            output.flush_if_full().await;
        }
    }

    /// One request for `chunk`, with each command's answers (one per key). `Err`: refused before
    /// any of it was sent.
    async fn write(
        &self,
        chunk: &[Write],
    ) -> Result<Vec<Vec<Result<v1::WriteResult, Status>>>, Status> {
        let kv = &self.server.kv;
        if chunk.iter().all(Write::is_plain_set) {
            let entries: Vec<v1::Entry> = chunk
                .iter()
                .flat_map(|w| &w.ops)
                .filter_map(|op| match &op.action {
                    Action::Set { value, expiry } => Some(v1::Entry {
                        key: op.key.clone(),
                        value: value.clone(),
                        ttl_ms: match expiry {
                            Expiry::After(ms) => Some(*ms),
                            _ => None,
                        },
                    }),
                    _ => None,
                })
                .collect();
            crate::validate::entries(&entries)?;
            let keys: Vec<Bytes> = entries.iter().map(|e| e.key.clone()).collect();
            let answers = kv.put_each(&keys, entries, false).await;
            let results = answers.into_iter().map(|answer| {
                answer.map(|()| v1::WriteResult {
                    applied: true,
                    ..Default::default()
                })
            });
            return Ok(per_command(chunk, results));
        }
        let ops: Vec<WriteOp> = chunk.iter().flat_map(|w| w.ops.iter().cloned()).collect();
        crate::validate::ops_ok(&ops)?;
        if let Some((value, ttl_ms)) = one_insert(chunk) {
            // Within the bounds of an insert-if-absent, as those of the operations (checked
            // above) are wider: each operation's value counts towards them.
            let keys: Vec<Bytes> = ops.into_iter().map(|op| op.key).collect();
            let answers = kv.insert_each(&keys, value, ttl_ms, false).await;
            let results = answers.into_iter().map(|answer| {
                answer.map(|inserted| v1::WriteResult {
                    applied: inserted,
                    existed: !inserted,
                    ..Default::default()
                })
            });
            return Ok(per_command(chunk, results));
        }
        let all_or_nothing = chunk.iter().any(|w| w.all_or_nothing);
        let answers = kv.write_each(ops, all_or_nothing, false).await?;
        Ok(per_command(chunk, answers))
    }

    async fn connection(&mut self, connection: Connection) -> Reply {
        match connection {
            Connection::Ping(None) => Reply::Simple("PONG"),
            Connection::Ping(Some(message)) | Connection::Echo(message) => Reply::Bulk(message),
            Connection::Hello {
                version,
                name,
                user,
            } => {
                // No password is configured, so the default user is the only one there is.
                if user.is_some_and(|user| user.as_ref() != b"default") {
                    return Reply::error(
                        "WRONGPASS invalid username-password pair or user is disabled.",
                    );
                }
                // Nothing changes unless all of it is accepted.
                if let Some(name) = name
                    && let Err(reply) = self.set_name(name)
                {
                    return reply;
                }
                if let Some(version) = version {
                    self.resp3 = version == 3;
                }
                Reply::Map(vec![
                    (Reply::bulk("server"), Reply::bulk("cairn")),
                    (
                        Reply::bulk("version"),
                        Reply::bulk(env!("CARGO_PKG_VERSION")),
                    ),
                    (
                        Reply::bulk("proto"),
                        Reply::Int(if self.resp3 { 3 } else { 2 }),
                    ),
                    (Reply::bulk("id"), Reply::Int(self.id as i64)),
                    (Reply::bulk("mode"), Reply::bulk("standalone")),
                    (Reply::bulk("role"), Reply::bulk("master")),
                    (Reply::bulk("modules"), Reply::Array(Vec::new())),
                ])
            }
            Connection::Select(db) => match std::str::from_utf8(&db)
                .ok()
                .and_then(|d| d.parse::<i64>().ok())
            {
                Some(0) => Reply::Ok,
                Some(_) => Reply::error("ERR DB index is out of range"),
                None => Reply::error("ERR value is not an integer or out of range"),
            },
            Connection::ClientSetName(name) => match self.set_name(name) {
                Ok(()) => Reply::Ok,
                Err(reply) => reply,
            },
            Connection::ClientGetName => self.name.clone().map_or(Reply::Nil, Reply::Bulk),
            Connection::ClientId => Reply::Int(self.id as i64),
            Connection::ClientIgnored => Reply::Ok,
            Connection::Command(args) => command_info(&args),
            Connection::ConfigGet => Reply::Map(Vec::new()),
            Connection::Info(sections) => Reply::Text(self.info(&sections).await),
            Connection::Auth(args) => match args.as_slice() {
                [_password] => Reply::error(
                    "ERR AUTH <password> called without any password configured for the \
                     default user. Are you sure your configuration is correct?",
                ),
                [user, _] if user.as_ref() == b"default" => Reply::Ok,
                _ => Reply::error("WRONGPASS invalid username-password pair or user is disabled."),
            },
            Connection::Quit => Reply::Ok,
        }
    }

    fn set_name(&mut self, name: Bytes) -> Result<(), Reply> {
        if name.iter().any(|&b| !(b'!'..=b'~').contains(&b)) {
            return Err(Reply::error(
                "ERR Client names cannot contain spaces, newlines or special characters.",
            ));
        }
        self.name = (!name.is_empty()).then_some(name);
        Ok(())
    }

    /// `INFO`: the server, clients, persistence and keyspace sections (all of them when none is
    /// named), with this node's figures.
    async fn info(&self, sections: &[Bytes]) -> String {
        let wanted = |name: &str| {
            sections.is_empty()
                || sections.iter().any(|s| {
                    let s = s.to_ascii_lowercase();
                    s == name.as_bytes() || s == b"all" || s == b"everything" || s == b"default"
                })
        };
        let state = &self.server.state;
        let mut out = String::new();
        let uptime = self.server.started.elapsed().as_secs();
        if wanted("server") {
            out.push_str(&format!(
                "# Server\r\nredis_version:7.2.0\r\ncairn_version:{}\r\nredis_mode:standalone\r\n\
                 os:{} {}\r\narch_bits:{}\r\nprocess_id:{}\r\ntcp_port:{}\r\n\
                 uptime_in_seconds:{uptime}\r\nuptime_in_days:{}\r\ncairn_node:{}\r\n\
                 cairn_cluster:{}\r\n\r\n",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::OS,
                std::env::consts::ARCH,
                usize::BITS,
                std::process::id(),
                self.server.port,
                uptime / 86_400,
                state.node,
                state.cluster.cluster_name,
            ));
        }
        if wanted("clients") {
            out.push_str(&format!(
                "# Clients\r\nconnected_clients:{}\r\n\r\n",
                self.server.connected.load(Ordering::Relaxed)
            ));
        }
        let led: Vec<_> = state
            .partitions
            .slots()
            .iter()
            .filter_map(|slot| slot.running().ok())
            .filter(|p| p.leads())
            .collect();
        if wanted("persistence") {
            let applied: u64 = led.iter().map(|p| p.applied_lsn().0).sum();
            out.push_str(&format!(
                "# Persistence\r\nloading:0\r\ncairn_log_provider:{}\r\n\
                 cairn_partitions:{}\r\ncairn_partitions_led_here:{}\r\n\
                 cairn_applied_records_of_led_partitions:{applied}\r\n\
                 cairn_snapshot_repository:{}\r\ncairn_newest_snapshot_unix:{}\r\n\r\n",
                if state.config.cluster_mode() {
                    "nats"
                } else {
                    "local"
                },
                state.num_partitions(),
                led.len(),
                if state.snapshots.is_some() {
                    "configured"
                } else {
                    "none"
                },
                state
                    .metrics
                    .newest_snapshot_unix()
                    .map_or(-1, |unix| unix as i64),
            ));
        }
        if wanted("keyspace") {
            let mut keys = 0u64;
            for partition in &led {
                if let Ok(status) = partition.store_status().await {
                    keys += status.estimates.keys;
                }
            }
            // RocksDB's estimate over the partitions this node leads; expired values count
            // until a compaction drops them.
            out.push_str(&format!("# Keyspace\r\ndb0:keys={keys}\r\n"));
        }
        out
    }
}

/// Why the input of a connection cannot be framed into commands; the connection ends after it, as
/// in Redis. The words are Redis's where it has them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum ProtocolError {
    #[error("too big header line")]
    HeaderTooLong,
    #[error("expected an array of bulk strings, got '{}'", char::from(*.0).escape_default())]
    NotAnArray(u8),
    #[error("invalid multibulk length")]
    ArrayLength,
    #[error(
        "a command of {0} arguments; Cairn takes at most {ARGUMENTS_MAX} (a command of at most \
         {BATCH_KEYS_MAX} keys)"
    )]
    TooManyArguments(i64),
    #[error("expected '$', got '{}'", char::from(*.0).escape_default())]
    NotABulkString(u8),
    #[error("invalid bulk length")]
    BulkLength,
    #[error("a bulk string longer than its length")]
    BulkOverrun,
    #[error("expected an array of bulk strings")]
    NotStrings,
    #[error(
        "a command of over {FRAME_BYTES_MAX} bytes; Cairn takes at most {BATCH_BYTES_MAX} bytes \
         of keys and values per command"
    )]
    CommandTooBig,
    /// What the frame decoder said.
    #[error("{0}")]
    Codec(String),
    #[error("too big inline request")]
    InlineTooBig,
    #[error("unbalanced quotes in request")]
    UnbalancedQuotes,
    #[error("this is an HTTP request, not a command; the connection is closed")]
    Http,
}

/// The inline command at the start of `input` (a line of text, which does not start with `*`),
/// once its line is all there: its arguments, and how many bytes it takes with its line end.
fn inline_command(input: &[u8]) -> Result<Option<(Vec<Bytes>, usize)>, ProtocolError> {
    let line_end = input
        .iter()
        .take(inline::INLINE_BYTES_MAX)
        .position(|&b| b == b'\n');
    let Some(line_end) = line_end else {
        return if input.len() >= inline::INLINE_BYTES_MAX {
            Err(ProtocolError::InlineTooBig)
        } else {
            Ok(None)
        };
    };
    let line = &input[..line_end];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let args = inline::split(line).ok_or(ProtocolError::UnbalancedQuotes)?;
    if args.len() > ARGUMENTS_MAX {
        return Err(ProtocolError::TooManyArguments(args.len() as i64));
    }
    Ok(Some((args, line_end + 1)))
}

/// [`decode_resuming`] of input that no earlier call has scanned.
#[cfg(test)]
fn decode(input: &mut BytesMut) -> (Vec<(&'static str, Command)>, Option<ProtocolError>) {
    decode_resuming(input, &mut FrameScan::default())
}

/// Every complete command in `input` (up to [`COMMANDS_PER_ROUND_MAX`]), and the protocol error
/// that ends the connection, if any. `scan` is how far the last call got into the incomplete
/// frame it left at the front of `input`, and it says so again for the next.
fn decode_resuming(
    input: &mut BytesMut,
    scan: &mut FrameScan,
) -> (Vec<(&'static str, Command)>, Option<ProtocolError>) {
    let mut commands = Vec::new();
    while commands.len() < COMMANDS_PER_ROUND_MAX {
        if input.first().is_some_and(|&first| first != b'*') {
            match inline_command(input) {
                Ok(Some((args, len))) => {
                    bytes::Buf::advance(input, len);
                    // What a browser sends when a web page posts to this port: the lines of its
                    // request could be taken for commands. Redis closes the connection then too.
                    if args.first().is_some_and(|name| {
                        name.eq_ignore_ascii_case(b"post") || name.eq_ignore_ascii_case(b"host:")
                    }) {
                        return (commands, Some(ProtocolError::Http));
                    }
                    // An empty or blank line is passed over, as Redis does (`redis-cli --pipe`
                    // sends one before the `ECHO` that tells it every reply has come).
                    if !args.is_empty() {
                        commands.push(command::parse(args));
                    }
                    continue;
                }
                Ok(None) => break,
                Err(err) => return (commands, Some(err)),
            }
        }
        if let Some(len) = empty_array_len(input) {
            // `*0` and `*-1` are passed over, as Redis passes them over.
            bytes::Buf::advance(input, len);
            continue;
        }
        match scan_frame(input, scan) {
            Ok(Some(_)) => *scan = FrameScan::default(),
            Ok(None) => break,
            Err(details) => return (commands, Some(details)),
        }
        match redis_protocol::resp2::decode::decode_bytes_mut(input) {
            Ok(Some((frame, _, _))) => match arguments(frame) {
                Some(args) => commands.push(command::parse(args)),
                None => return (commands, Some(ProtocolError::NotStrings)),
            },
            Ok(None) => break,
            Err(err) => {
                return (
                    commands,
                    Some(ProtocolError::Codec(err.details().to_string())),
                );
            }
        }
    }
    if commands.is_empty() && input.len() > FRAME_BYTES_MAX {
        return (commands, Some(ProtocolError::CommandTooBig));
    }
    (commands, None)
}

/// The length of the header line at the start of `input` if it is that of an empty or null
/// array (`*0`, `*-1`): no command.
fn empty_array_len(input: &[u8]) -> Option<usize> {
    let line = input.strip_prefix(b"*")?;
    let end = line.iter().take(32).position(|&b| b == b'\r')?;
    if line.get(end + 1) != Some(&b'\n') {
        return None;
    }
    let count = command::redis_integer(&line[..end])?;
    (count <= 0).then_some(end + 3)
}

/// Arguments of one command, at most: `MSET` of a request's worth of keys.
const ARGUMENTS_MAX: usize = 2 * BATCH_KEYS_MAX + 8;

/// How far [`scan_frame`] got into the frame at the start of a connection's input, so that a
/// frame that arrives in many reads is read once, not again from its start at each read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct FrameScan {
    /// The frame's arguments, once its header is read (0 before).
    count: i64,
    /// The arguments read whole so far.
    done: i64,
    /// Where the next argument starts.
    at: usize,
}

/// [`scan_frame`] from the start of the frame.
#[cfg(test)]
fn command_frame_len(input: &[u8]) -> Result<Option<usize>, ProtocolError> {
    scan_frame(input, &mut FrameScan::default())
}

/// How long the command frame at the start of `input` is, once it is all there (`None` before;
/// `scan` then says how far it got, and the next call goes on from there). A command is an array
/// of bulk strings, the form every client sends; anything else is refused with Redis's words for
/// it. The codec crate decodes the frame only once it is known to be one: its decoder follows
/// nested arrays without a bound on their depth, so that a frame of a million nested arrays
/// would overflow the stack.
fn scan_frame(input: &[u8], scan: &mut FrameScan) -> Result<Option<usize>, ProtocolError> {
    /// The longest header line (`*N` or `$N`) there is.
    const HEADER_MAX: usize = 32;
    let header = |at: usize| -> Result<Option<(i64, usize)>, ProtocolError> {
        let rest = &input[at.min(input.len())..];
        let searched = &rest[..rest.len().min(HEADER_MAX + 2)];
        match searched.windows(2).position(|w| w == b"\r\n") {
            Some(end) => {
                let number = command::redis_integer(&rest[1..end]);
                Ok(Some((number.unwrap_or(-1), at + end + 2)))
            }
            None if rest.len() > HEADER_MAX => Err(ProtocolError::HeaderTooLong),
            None => Ok(None),
        }
    };
    if scan.count == 0 {
        match input.first() {
            None => return Ok(None),
            Some(b'*') => {}
            Some(&other) => return Err(ProtocolError::NotAnArray(other)),
        }
        let Some((count, at)) = header(0)? else {
            return Ok(None);
        };
        if count < 1 {
            return Err(ProtocolError::ArrayLength);
        }
        if count as u64 > ARGUMENTS_MAX as u64 {
            return Err(ProtocolError::TooManyArguments(count));
        }
        *scan = FrameScan { count, done: 0, at };
    }
    while scan.done < scan.count {
        let at = scan.at;
        match input.get(at) {
            None => return Ok(None),
            Some(b'$') => {}
            Some(&other) => return Err(ProtocolError::NotABulkString(other)),
        }
        let Some((len, data)) = header(at)? else {
            return Ok(None);
        };
        if len < 0 || len as u64 > FRAME_BYTES_MAX as u64 {
            return Err(ProtocolError::BulkLength);
        }
        let end = data + len as usize + 2;
        if end > input.len() {
            return Ok(None);
        }
        if &input[end - 2..end] != b"\r\n" {
            return Err(ProtocolError::BulkOverrun);
        }
        scan.at = end;
        scan.done += 1;
    }
    Ok(Some(scan.at))
}

/// Operations that return their old value in one request: half of what a request may carry, so
/// that with the other commands' values an answer stays within a message.
const OLD_VALUES_PER_REQUEST: usize = crate::validate::RETURN_OLD_MAX / 2;

/// A command's arguments: a frame that is a non-empty array of strings.
fn arguments(frame: redis_protocol::resp2::types::BytesFrame) -> Option<Vec<Bytes>> {
    use redis_protocol::resp2::types::BytesFrame as F;
    let F::Array(items) = frame else {
        return None;
    };
    if items.is_empty() {
        return None;
    }
    items
        .into_iter()
        .map(|item| match item {
            F::BulkString(bytes) | F::SimpleString(bytes) => Some(bytes),
            F::Integer(n) => Some(Bytes::from(n.to_string())),
            _ => None,
        })
        .collect()
}

/// `items` cut into runs of at most one request's keys and half its bytes; an item larger than
/// that is a run of its own (and the service refuses it with the bound).
fn chunks<T>(
    items: &[T],
    keys: impl Fn(&T) -> usize,
    bytes: impl Fn(&T) -> usize,
    old_values: impl Fn(&T) -> usize,
) -> Vec<&[T]> {
    let mut out = Vec::new();
    let (mut start, mut chunk_keys, mut chunk_bytes, mut chunk_olds) = (0, 0, 0, 0);
    for (i, item) in items.iter().enumerate() {
        let (k, b, o) = (keys(item), bytes(item), old_values(item));
        if i > start
            && (chunk_keys + k > BATCH_KEYS_MAX
                || chunk_bytes + b > BATCH_BYTES_MAX / 2
                || chunk_olds + o > OLD_VALUES_PER_REQUEST)
        {
            out.push(&items[start..i]);
            (start, chunk_keys, chunk_bytes, chunk_olds) = (i, 0, 0, 0);
        }
        chunk_keys += k;
        chunk_bytes += b;
        chunk_olds += o;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// The answers to `chunk`'s operations, one after the other, as each command's own.
fn per_command<T>(chunk: &[Write], answers: impl IntoIterator<Item = T>) -> Vec<Vec<T>> {
    let mut answers = answers.into_iter();
    chunk
        .iter()
        .map(|write| answers.by_ref().take(write.ops.len()).collect())
        .collect()
}

/// The value and TTL of `chunk` if it can go as one insert-if-absent: every operation sets a key
/// only if it is absent, with the same value and expiry (`SET k v NX [EX s]`, `SETNX`), without
/// asking for the old value or for all or nothing. Such a record carries the value once and is
/// applied without the general write's bookkeeping.
fn one_insert(chunk: &[Write]) -> Option<(&Bytes, Option<u64>)> {
    if chunk.iter().any(|w| w.all_or_nothing) {
        return None;
    }
    fn insert(op: &WriteOp) -> Option<(&Bytes, Option<u64>)> {
        match &op.action {
            Action::Set { value, expiry }
                if op.condition == Condition::IfAbsent && !op.return_old =>
            {
                match expiry {
                    Expiry::Never => Some((value, None)),
                    Expiry::After(ms) => Some((value, Some(*ms))),
                    _ => None,
                }
            }
            _ => None,
        }
    }
    let mut ops = chunk.iter().flat_map(|w| &w.ops);
    let first = insert(ops.next()?)?;
    ops.all(|op| insert(op) == Some(first)).then_some(first)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn read_reply(kind: ReadReply, values: Vec<v1::MaybeValue>, now_ms: u64) -> Reply {
    let value = |v: v1::MaybeValue| v.value.map_or(Reply::Nil, Reply::Bulk);
    match kind {
        ReadReply::Value => values.into_iter().next().map_or(Reply::Nil, value),
        ReadReply::Values => Reply::Array(values.into_iter().map(value).collect()),
        ReadReply::Count => Reply::Int(values.iter().filter(|v| v.value.is_some()).count() as i64),
        ReadReply::Ttl { millis } => match values.into_iter().next() {
            Some(v1::MaybeValue {
                value: Some(_),
                expires_at_ms: Some(at),
            }) => {
                let left = at.saturating_sub(now_ms);
                // Redis rounds seconds to the nearest.
                let left = if millis {
                    left
                } else {
                    left.saturating_add(500) / 1000
                };
                Reply::Int(i64::try_from(left).unwrap_or(i64::MAX))
            }
            Some(v1::MaybeValue { value: Some(_), .. }) => Reply::Int(-1),
            _ => Reply::Int(-2),
        },
    }
}

fn write_reply(kind: WriteReply, results: &[v1::WriteResult]) -> Reply {
    let all_applied = results.iter().all(|r| r.applied);
    match kind {
        WriteReply::OkOrNil if all_applied => Reply::Ok,
        WriteReply::OkOrNil => Reply::Nil,
        WriteReply::Old => results
            .first()
            .and_then(|r| r.old_value.clone())
            .map_or(Reply::Nil, Reply::Bulk),
        WriteReply::Applied => Reply::Int(i64::from(all_applied)),
        WriteReply::Existed => Reply::Int(results.iter().filter(|r| r.existed).count() as i64),
    }
}

/// One write command's reply from its operations' answers. When some of its keys' partitions
/// failed, the reply is an error that says whether any of it was applied.
fn command_reply(kind: WriteReply, answers: Vec<Result<v1::WriteResult, Status>>) -> Reply {
    let total = answers.len();
    let mut results = Vec::with_capacity(total);
    let mut failed: Option<Status> = None;
    for answer in answers {
        match answer {
            Ok(result) => results.push(result),
            // An unknown outcome outweighs any other failure: it is the one to report.
            Err(status)
                if failed.as_ref().is_none_or(|f| {
                    f.code() != Code::DeadlineExceeded && status.code() == Code::DeadlineExceeded
                }) =>
            {
                failed = Some(status)
            }
            Err(_) => {}
        }
    }
    match failed {
        None => write_reply(kind, &results),
        Some(status) if results.is_empty() => status_reply(&status),
        Some(status) if status.code() == Code::DeadlineExceeded => Reply::error(format!(
            "ERR applied to {} of its {total} keys; for the others the outcome is unknown, read \
             them to know: {}",
            results.len(),
            status.message()
        )),
        Some(status) => Reply::error(format!(
            "ERR applied to {} of its {total} keys; the partitions of the others failed: {}",
            results.len(),
            status.message()
        )),
    }
}

/// A failed request as an error reply: `TRYAGAIN` where nothing was done and a retry may work
/// (a partition changing hands or not up yet), `ERR` otherwise.
fn status_reply(status: &Status) -> Reply {
    let message = status.message();
    match status.code() {
        // Nothing was done: safe to send again.
        Code::Unavailable | Code::Aborted => Reply::error(format!("TRYAGAIN {message}")),
        Code::DeadlineExceeded | Code::Unknown => Reply::error(format!(
            "ERR the outcome is unknown, read the keys to know: {message}"
        )),
        _ => Reply::error(format!("ERR {message}")),
    }
}

/// `COMMAND`, `COMMAND COUNT`, `COMMAND LIST`, `COMMAND INFO` and `COMMAND DOCS`: enough for
/// `redis-cli` and client libraries to know what is here.
fn command_info(args: &[Bytes]) -> Reply {
    let info = |c: &'static CommandSpec| {
        Reply::Array(vec![
            Reply::bulk(c.0),
            Reply::Int(c.1),
            Reply::Array(c.2.iter().map(|f| Reply::Simple(f)).collect()),
            Reply::Int(c.3),
            Reply::Int(c.4),
            Reply::Int(c.5),
        ])
    };
    let named = |names: &[Bytes]| -> Vec<&'static CommandSpec> {
        if names.is_empty() {
            return COMMANDS.iter().collect();
        }
        names
            .iter()
            .filter_map(|n| {
                let n = String::from_utf8_lossy(n).to_ascii_lowercase();
                COMMANDS.iter().find(|c| c.0 == n)
            })
            .collect()
    };
    let Some(sub) = args.first() else {
        return Reply::Array(COMMANDS.iter().map(info).collect());
    };
    match sub.to_ascii_lowercase().as_slice() {
        b"count" => Reply::Int(COMMANDS.len() as i64),
        b"list" => Reply::Array(COMMANDS.iter().map(|c| Reply::bulk(c.0)).collect()),
        b"info" => Reply::Array(
            args[1..]
                .iter()
                .map(|n| {
                    let n = String::from_utf8_lossy(n).to_ascii_lowercase();
                    COMMANDS.iter().find(|c| c.0 == n).map_or(Reply::Nil, info)
                })
                .collect(),
        ),
        b"docs" => Reply::Map(
            named(&args[1..])
                .into_iter()
                .map(|c| {
                    (
                        Reply::bulk(c.0),
                        Reply::Map(vec![
                            (Reply::bulk("summary"), Reply::bulk(c.6)),
                            (Reply::bulk("since"), Reply::bulk("1.0.0")),
                            (
                                Reply::bulk("group"),
                                Reply::bulk(if c.3 > 0 { "string" } else { "connection" }),
                            ),
                        ]),
                    )
                })
                .collect(),
        ),
        _ => Reply::error(format!(
            "ERR unknown subcommand '{}'. Try COMMAND HELP.",
            String::from_utf8_lossy(sub)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(applied: bool) -> Result<v1::WriteResult, Status> {
        Ok(v1::WriteResult {
            applied,
            existed: true,
            old_value: None,
        })
    }

    #[test]
    fn a_command_that_failed_in_part_says_so() {
        let unavailable = || Err(Status::unavailable("partition 3 is moving"));
        let unknown = || Err(Status::deadline_exceeded("partition 4 stopped"));
        assert_eq!(
            command_reply(WriteReply::Existed, vec![ok(true), ok(true)]),
            Reply::Int(2)
        );
        // Nothing of it was done: retry.
        assert_eq!(
            command_reply(WriteReply::OkOrNil, vec![unavailable(), unavailable()]),
            Reply::error("TRYAGAIN partition 3 is moving")
        );
        // An unknown outcome is never reported as "nothing was done".
        assert_eq!(
            command_reply(WriteReply::OkOrNil, vec![unavailable(), unknown()]),
            Reply::error("ERR the outcome is unknown, read the keys to know: partition 4 stopped")
        );
        let Reply::Error(message) =
            command_reply(WriteReply::Existed, vec![ok(true), unavailable()])
        else {
            panic!()
        };
        assert!(
            message.starts_with("ERR applied to 1 of its 2 keys"),
            "{message}"
        );
    }

    #[test]
    fn empty_lines_between_commands_are_passed_over() {
        let mut input =
            BytesMut::from(&b"\r\n*1\r\n$4\r\nPING\r\n\r\n\n*1\r\n$4\r\nPING\r\n\r\n"[..]);
        let (commands, error) = decode(&mut input);
        assert_eq!((commands.len(), error), (2, None));
        assert!(input.is_empty());
    }

    #[test]
    fn empty_and_null_arrays_are_passed_over_and_lengths_are_strict() {
        let mut input = BytesMut::from(&b"*0\r\n*-1\r\n*1\r\n$4\r\nPING\r\n"[..]);
        let (commands, error) = decode(&mut input);
        assert_eq!(error, None);
        assert_eq!(commands.len(), 1);
        assert!(input.is_empty());
        for (frame, error) in [
            (&b"*+1\r\n$4\r\nPING\r\n"[..], ProtocolError::ArrayLength),
            (&b"*01\r\n$4\r\nPING\r\n"[..], ProtocolError::ArrayLength),
            (&b"*1\r\n$04\r\nPING\r\n"[..], ProtocolError::BulkLength),
        ] {
            let mut input = BytesMut::from(frame);
            assert_eq!(decode(&mut input).1, Some(error), "{frame:?}");
        }
    }

    #[test]
    fn a_frame_that_comes_in_pieces_is_scanned_once() {
        let frame = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10\r\n0123456789\r\n";
        let mut scan = FrameScan::default();
        let mut input = BytesMut::new();
        for (i, &byte) in frame.iter().enumerate() {
            input.extend_from_slice(&[byte]);
            let (commands, error) = decode_resuming(&mut input, &mut scan);
            assert_eq!(error, None);
            if i + 1 < frame.len() {
                assert!(commands.is_empty(), "complete at byte {i}");
                assert!(scan.at <= input.len());
            } else {
                assert_eq!(commands.len(), 1);
            }
        }
        assert!(input.is_empty());
        assert_eq!(scan, FrameScan::default(), "ready for the next frame");
        // Mid-way, the arguments already read are not read again.
        let mut scan = FrameScan::default();
        let partial = &frame[..frame.len() - 5];
        assert_eq!(scan_frame(partial, &mut scan), Ok(None));
        assert_eq!((scan.count, scan.done), (3, 2));
    }

    #[test]
    fn resp3_maps_keep_their_order() {
        let map = Reply::Map(vec![
            (Reply::bulk("server"), Reply::bulk("cairn")),
            (Reply::bulk("version"), Reply::bulk("1")),
            (Reply::bulk("proto"), Reply::Int(3)),
        ]);
        let mut out = BytesMut::new();
        map.encode(true, &mut out);
        assert_eq!(
            &out[..],
            b"%3\r\n$6\r\nserver\r\n$5\r\ncairn\r\n$7\r\nversion\r\n$1\r\n1\r\n$5\r\nproto\r\n:3\r\n"
        );
    }

    #[test]
    fn inline_commands_are_lines_of_text() {
        let mut input =
            BytesMut::from(&b"PING\r\n  \r\nSET k \"a b\"\n*1\r\n$4\r\nPING\r\nGET k\r\nGET"[..]);
        let (commands, error) = decode(&mut input);
        let names: Vec<_> = commands.iter().map(|(name, _)| *name).collect();
        assert_eq!((names, error), (vec!["ping", "set", "ping", "get"], None));
        // The last line is not all there yet.
        assert_eq!(&input[..], b"GET");

        let mut input = BytesMut::from(&b"PING\r\nSET k \"a b\r\nPING\r\n"[..]);
        let (commands, error) = decode(&mut input);
        assert_eq!(
            (commands.len(), error),
            (1, Some(ProtocolError::UnbalancedQuotes))
        );

        let mut input = BytesMut::from(&vec![b'a'; inline::INLINE_BYTES_MAX][..]);
        assert_eq!(decode(&mut input).1, Some(ProtocolError::InlineTooBig));

        // An HTTP request's lines are not commands.
        for request in [
            &b"POST / HTTP/1.1\r\nHost: localhost:6380\r\n\r\nSET k v\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: localhost:6380\r\n\r\n",
        ] {
            let mut input = BytesMut::from(request);
            let (commands, error) = decode(&mut input);
            assert_eq!(error, Some(ProtocolError::Http));
            assert!(commands.len() <= 1, "at most the request line, as a GET");
        }
    }

    proptest::proptest! {
        /// Whatever a client sends, framing consumes from the front only, never panics, and
        /// either frames commands, waits for more, or says why it cannot.
        #[test]
        fn any_input_frames_or_is_refused(input in proptest::collection::vec(
            proptest::sample::select(b"*$\r\n 0123456789abPINGSET\"'\\x".to_vec()), 0..96)
        ) {
            let mut buffer = BytesMut::from(&input[..]);
            let (_, error) = decode(&mut buffer);
            proptest::prop_assert!(input.ends_with(&buffer));
            if error.is_none() {
                // What is left is a command not all there yet: framing it again takes nothing.
                let before = buffer.len();
                let (commands, _) = decode(&mut buffer);
                proptest::prop_assert_eq!((commands.len(), buffer.len()), (0, before));
            }
        }

        /// Input that arrives in pieces frames the same commands, and fails the same way, as
        /// the same input all at once.
        #[test]
        fn input_in_pieces_frames_as_input_at_once(
            args in proptest::collection::vec(proptest::collection::vec(
                proptest::sample::select(b"ab\r\n$*0".to_vec()), 0..12), 1..5),
            cuts in proptest::collection::vec(1usize..9, 1..40),
            tail in proptest::collection::vec(proptest::sample::select(b"*$\r\n1x".to_vec()), 0..8),
        ) {
            let mut input = Vec::new();
            for _ in 0..2 {
                input.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
                for arg in &args {
                    input.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
                    input.extend_from_slice(arg);
                    input.extend_from_slice(b"\r\n");
                }
            }
            input.extend_from_slice(&tail);
            let named = |commands: Vec<(&'static str, Command)>| -> Vec<String> {
                commands.into_iter().map(|(label, command)| format!("{label} {command:?}")).collect()
            };
            let mut whole = BytesMut::from(&input[..]);
            let (at_once, error_at_once) = decode(&mut whole);
            let mut pieces = Vec::new();
            let mut error_in_pieces = None;
            let (mut buffer, mut scan, mut from) = (BytesMut::new(), FrameScan::default(), 0);
            for cut in cuts.iter().cycle() {
                let to = (from + cut).min(input.len());
                buffer.extend_from_slice(&input[from..to]);
                from = to;
                let (commands, error) = decode_resuming(&mut buffer, &mut scan);
                pieces.extend(commands);
                if error.is_some() {
                    error_in_pieces = error;
                    break;
                }
                if from == input.len() {
                    break;
                }
            }
            proptest::prop_assert_eq!(named(pieces), named(at_once));
            proptest::prop_assert_eq!(error_in_pieces, error_at_once);
        }
    }

    #[test]
    fn only_flat_arrays_of_bulk_strings_are_commands() {
        assert_eq!(command_frame_len(b"*1\r\n$4\r\nPING\r\n"), Ok(Some(14)));
        assert_eq!(command_frame_len(b"*2\r\n$3\r\nGET\r\n$1\r\n"), Ok(None));
        assert!(command_frame_len(b"*1\r\n*1\r\n$4\r\nPING\r\n").is_err());
        assert!(command_frame_len(b"*1\r\n$4\r\nPINGxx\r\n").is_err());
        assert!(command_frame_len(b"*0\r\n").is_err());
        assert!(command_frame_len(b"*99999999\r\n").is_err());
        assert_eq!(
            command_frame_len(b"$4\r\nPING\r\n"),
            Err(ProtocolError::NotAnArray(b'$'))
        );
        assert_eq!(
            ProtocolError::NotAnArray(b'$').to_string(),
            "expected an array of bulk strings, got '$'"
        );
        assert!(command_frame_len(&[b'*'; 100]).is_err());
    }
}
