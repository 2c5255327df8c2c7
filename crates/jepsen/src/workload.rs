//! Clients that write and read a small set of keys as fast as they can, over every path a user
//! has (a routing gRPC client seeded with every node, a gRPC client of one node that forwards,
//! a Redis-protocol connection to one node), and record every operation, with its outcome as the
//! client knows it, for the checker.
//!
//! Outcomes: an answer is `Ok`; an error that says nothing was done (refused, never sent) is
//! `Failed`; anything else (a timeout, a connection lost after sending, an answer that the
//! outcome is unknown, an error whose meaning is not certain) is `Unknown`, which the checker
//! takes as "may have happened, at any time after the call". So a client never claims more than
//! it knows, and a store that loses or invents a write is caught.

use bytes::Bytes;
use cairn_checker::{Call, Outcome, Output, Recorder};
use cairn_client::{Client, ClientOptions, PutEntry, RoutingClient, RoutingOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What the clients do.
#[derive(Debug, Clone)]
pub struct WorkloadOptions {
    /// Keys `key-0` … `key-<keys - 1>`.
    pub keys: usize,
    /// Routing gRPC clients, seeded with every node.
    pub routing_clients: usize,
    /// gRPC clients of one node each (round robin), which forward what that node does not lead.
    pub forwarding_clients: usize,
    /// Redis-protocol connections to one node each (round robin).
    pub resp_clients: usize,
    /// The TTL of the writes that carry one (about a third of them), in milliseconds.
    pub ttl_ms: u64,
    pub seed: u64,
}

impl Default for WorkloadOptions {
    fn default() -> Self {
        WorkloadOptions {
            keys: 24,
            routing_clients: 3,
            forwarding_clients: 3,
            resp_clients: 3,
            ttl_ms: 2_000,
            seed: 1,
        }
    }
}

/// What the clients did, by outcome.
#[derive(Debug, Default)]
pub struct Counts {
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub unknown: AtomicU64,
}

impl Counts {
    fn count(&self, outcome: &Outcome) {
        match outcome {
            Outcome::Ok(_) => &self.ok,
            Outcome::Failed => &self.failed,
            Outcome::Unknown => &self.unknown,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    pub fn summary(&self) -> String {
        format!(
            "{} ok, {} refused, {} unknown",
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.unknown.load(Ordering::Relaxed)
        )
    }
}

/// Clients running until [`Workload::stop`].
pub struct Workload {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pub counts: Arc<Counts>,
}

pub fn key(i: usize) -> Bytes {
    Bytes::from(format!("key-{i}"))
}

/// A client's options: short enough that a paused node is given up on within the test, long
/// enough for a failover to be ridden through.
fn client_options() -> ClientOptions {
    ClientOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(13),
    }
}

impl Workload {
    /// Starts the clients against the nodes at `grpc` (`http://…`) and `resp` (`host:port`).
    pub fn start(
        grpc: Vec<String>,
        resp: Vec<String>,
        options: WorkloadOptions,
        recorder: Recorder,
    ) -> Workload {
        let stop = CancellationToken::new();
        let counts = Arc::new(Counts::default());
        let mut tasks = Vec::new();
        let mut client_id = 0u64;
        let mut spawn = |kind: Kind| {
            client_id += 1;
            let actor = Actor {
                id: client_id,
                kind,
                options: options.clone(),
                recorder: recorder.clone(),
                counts: counts.clone(),
                rng: StdRng::seed_from_u64(options.seed.wrapping_mul(1_000_003) + client_id),
                sequence: 0,
            };
            tasks.push(tokio::spawn(actor.run(stop.clone())));
        };
        for _ in 0..options.routing_clients {
            spawn(Kind::Routing(grpc.clone()));
        }
        for i in 0..options.forwarding_clients {
            spawn(Kind::Forwarding(grpc[i % grpc.len()].clone()));
        }
        for i in 0..options.resp_clients {
            spawn(Kind::Resp(resp[i % resp.len()].clone()));
        }
        Workload {
            stop,
            tasks,
            counts,
        }
    }

    /// Stops the clients: each finishes the operation it is in (its outcome is recorded).
    pub async fn stop(self) -> Arc<Counts> {
        self.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        self.counts
    }
}

/// Reads every key once through a routing client of every node, recorded as client 0: after
/// the faults, so that a write that was acknowledged and then lost shows.
pub async fn final_reads(grpc: &[String], keys: usize, recorder: &Recorder) -> anyhow::Result<()> {
    let seeds: Vec<&str> = grpc.iter().map(String::as_str).collect();
    let client =
        RoutingClient::connect_any(&seeds, &client_options(), &RoutingOptions::default()).await?;
    for i in 0..keys {
        let pending = recorder.invoke(0, key(i), Call::Get);
        match client.get(vec![key(i)]).await {
            Ok(mut values) => pending.complete(Outcome::Ok(Output::Value(values.remove(0)))),
            Err(err) => {
                pending.complete(Outcome::Unknown);
                anyhow::bail!("the final read of key-{i} failed: {err}");
            }
        }
    }
    Ok(())
}

enum Kind {
    Routing(Vec<String>),
    Forwarding(String),
    Resp(String),
}

/// One client.
struct Actor {
    id: u64,
    kind: Kind,
    options: WorkloadOptions,
    recorder: Recorder,
    counts: Arc<Counts>,
    rng: StdRng,
    sequence: u64,
}

/// One operation, chosen at random.
enum Op {
    Get(usize),
    Exists(usize),
    Put(Vec<usize>, Option<u64>),
    Delete(usize),
    Insert(Vec<usize>, Option<u64>),
}

/// A connection of one of the kinds, made (again) on demand.
enum Connection {
    Routing(RoutingClient),
    Grpc(Client),
    Resp(redis::aio::MultiplexedConnection),
}

impl Actor {
    async fn run(mut self, stop: CancellationToken) {
        let mut connection: Option<Connection> = None;
        while !stop.is_cancelled() {
            if connection.is_none() {
                connection = self.connect().await;
                if connection.is_none() {
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(100)) => {}
                        () = stop.cancelled() => return,
                    }
                    continue;
                }
            }
            let op = self.choose();
            let failed_before = self.counts.failed.load(Ordering::Relaxed);
            let keep = self
                .perform(connection.as_ref().expect("connected"), op)
                .await;
            if !keep {
                connection = None;
            }
            // A refusal (its node is down, or the partition's leader is changing) is not
            // retried at once: a client in a tight loop would only burn the cores the cluster
            // needs to recover.
            if self.counts.failed.load(Ordering::Relaxed) != failed_before {
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                    () = stop.cancelled() => return,
                }
            }
        }
    }

    async fn connect(&self) -> Option<Connection> {
        match &self.kind {
            Kind::Routing(seeds) => {
                let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
                RoutingClient::connect_any(&seeds, &client_options(), &RoutingOptions::default())
                    .await
                    .ok()
                    .map(Connection::Routing)
            }
            Kind::Forwarding(address) => Client::connect(address, &client_options())
                .await
                .ok()
                .map(Connection::Grpc),
            Kind::Resp(address) => {
                let client = redis::Client::open(format!("redis://{address}/")).ok()?;
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(1)))
                    .set_response_timeout(Some(Duration::from_secs(13)));
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .ok()
                    .map(Connection::Resp)
            }
        }
    }

    fn ttl(&mut self) -> Option<u64> {
        self.rng
            .random_bool(1.0 / 3.0)
            .then_some(self.options.ttl_ms)
    }

    fn choose(&mut self) -> Op {
        let keys = self.options.keys;
        let key = |rng: &mut StdRng| rng.random_range(0..keys);
        let several = |rng: &mut StdRng| {
            let n = rng.random_range(2..=4);
            let mut chosen: Vec<usize> = (0..n).map(|_| rng.random_range(0..keys)).collect();
            chosen.sort_unstable();
            chosen.dedup();
            chosen
        };
        let roll = self.rng.random_range(0..100);
        let batch = !matches!(self.kind, Kind::Resp(_)) && self.rng.random_bool(0.2);
        match roll {
            0..30 => Op::Get(key(&mut self.rng)),
            30..40 => Op::Exists(key(&mut self.rng)),
            40..65 => {
                let keys = if batch {
                    several(&mut self.rng)
                } else {
                    vec![key(&mut self.rng)]
                };
                Op::Put(keys, self.ttl())
            }
            65..75 => Op::Delete(key(&mut self.rng)),
            _ => {
                let keys = if batch {
                    several(&mut self.rng)
                } else {
                    vec![key(&mut self.rng)]
                };
                Op::Insert(keys, self.ttl())
            }
        }
    }

    fn value(&mut self) -> Bytes {
        self.sequence += 1;
        Bytes::from(format!("c{}-{}", self.id, self.sequence))
    }

    /// Performs `op` and records it; `false` if the connection should be made again.
    async fn perform(&mut self, connection: &Connection, op: Op) -> bool {
        match connection {
            Connection::Routing(client) => self.grpc(GrpcClient::Routing(client), op).await,
            Connection::Grpc(client) => self.grpc(GrpcClient::One(client), op).await,
            Connection::Resp(connection) => self.resp(connection.clone(), op).await,
        }
    }

    fn record(&self, key: usize, call: Call) -> cairn_checker::Pending {
        self.recorder.invoke(self.id, key_bytes(key), call)
    }

    fn done(&self, pending: cairn_checker::Pending, outcome: Outcome) {
        self.counts.count(&outcome);
        pending.complete(outcome);
    }

    async fn grpc(&mut self, client: GrpcClient<'_>, op: Op) -> bool {
        match op {
            Op::Get(k) => {
                let pending = self.record(k, Call::Get);
                let outcome = match client.get(vec![key(k)]).await {
                    Ok(mut values) => Outcome::Ok(Output::Value(values.remove(0))),
                    Err(err) => read_failure(&err),
                };
                self.done(pending, outcome);
            }
            Op::Exists(k) => {
                let pending = self.record(k, Call::Exists);
                let outcome = match client.exists(vec![key(k)]).await {
                    Ok(found) => Outcome::Ok(Output::Bool(found[0])),
                    Err(err) => read_failure(&err),
                };
                self.done(pending, outcome);
            }
            Op::Delete(k) => {
                let pending = self.record(k, Call::Delete);
                let outcome =
                    per_key_outcome(client.delete_each(vec![key(k)]).await, 0, |()| Output::Done);
                self.done(pending, outcome);
            }
            Op::Put(keys, ttl_ms) => {
                let entries: Vec<PutEntry> = keys
                    .iter()
                    .map(|&k| PutEntry {
                        key: key(k),
                        value: self.value(),
                        ttl: ttl_ms.map(Duration::from_millis),
                    })
                    .collect();
                let pendings: Vec<_> = keys
                    .iter()
                    .zip(&entries)
                    .map(|(&k, e)| {
                        self.record(
                            k,
                            Call::Put {
                                value: e.value.clone(),
                                ttl_ms,
                            },
                        )
                    })
                    .collect();
                let answers = client.put_each(entries).await;
                for (i, pending) in pendings.into_iter().enumerate() {
                    let outcome = per_key_outcome(answers.clone(), i, |()| Output::Done);
                    self.done(pending, outcome);
                }
            }
            Op::Insert(keys, ttl_ms) => {
                let value = self.value();
                let pendings: Vec<_> = keys
                    .iter()
                    .map(|&k| {
                        self.record(
                            k,
                            Call::InsertIfAbsent {
                                value: value.clone(),
                                ttl_ms,
                            },
                        )
                    })
                    .collect();
                let answers = client
                    .insert_if_absent_each(
                        keys.iter().map(|&k| key(k)).collect(),
                        value,
                        ttl_ms.map(Duration::from_millis),
                    )
                    .await;
                for (i, pending) in pendings.into_iter().enumerate() {
                    let outcome = per_key_outcome(answers.clone(), i, Output::Bool);
                    self.done(pending, outcome);
                }
            }
        }
        true
    }

    async fn resp(&mut self, mut connection: redis::aio::MultiplexedConnection, op: Op) -> bool {
        let (k, call, command) = match op {
            Op::Get(k) => (k, Call::Get, redis::cmd("GET").arg(key(k).as_ref()).clone()),
            Op::Exists(k) => (
                k,
                Call::Exists,
                redis::cmd("EXISTS").arg(key(k).as_ref()).clone(),
            ),
            Op::Delete(k) => (
                k,
                Call::Delete,
                redis::cmd("DEL").arg(key(k).as_ref()).clone(),
            ),
            Op::Put(keys, ttl_ms) => {
                let value = self.value();
                let mut command = redis::cmd("SET");
                command.arg(key(keys[0]).as_ref()).arg(value.as_ref());
                if let Some(ms) = ttl_ms {
                    command.arg("PX").arg(ms);
                }
                (keys[0], Call::Put { value, ttl_ms }, command)
            }
            Op::Insert(keys, ttl_ms) => {
                let value = self.value();
                let mut command = redis::cmd("SET");
                command
                    .arg(key(keys[0]).as_ref())
                    .arg(value.as_ref())
                    .arg("NX");
                if let Some(ms) = ttl_ms {
                    command.arg("PX").arg(ms);
                }
                (keys[0], Call::InsertIfAbsent { value, ttl_ms }, command)
            }
        };
        let write = call.is_write();
        let pending = self.record(k, call.clone());
        let answer: redis::RedisResult<redis::Value> = command.query_async(&mut connection).await;
        let (outcome, keep) = match answer {
            Ok(value) => (resp_output(&call, value), true),
            Err(err) => {
                let text = err.to_string();
                let outcome = if err.kind()
                    == redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain)
                    || text.contains("TRYAGAIN")
                {
                    Outcome::Failed
                } else if !write
                    || text.contains("outcome is unknown")
                    || err.is_io_error()
                    || err.is_timeout()
                    || err.is_connection_dropped()
                {
                    // A read that failed tells nothing; a write may have landed.
                    Outcome::Unknown
                } else {
                    // A refusal the node gave with nothing done (a bound, a bad argument).
                    Outcome::Failed
                };
                (outcome, !(err.is_io_error() || err.is_connection_dropped()))
            }
        };
        self.done(pending, outcome);
        keep
    }
}

fn key_bytes(k: usize) -> Bytes {
    key(k)
}

/// A Redis reply as the checker's output of `call`.
fn resp_output(call: &Call, value: redis::Value) -> Outcome {
    use redis::Value as V;
    match (call, value) {
        (Call::Get, V::Nil) => Outcome::Ok(Output::Value(None)),
        (Call::Get, V::BulkString(bytes)) => Outcome::Ok(Output::Value(Some(Bytes::from(bytes)))),
        (Call::Exists, V::Int(n)) => Outcome::Ok(Output::Bool(n > 0)),
        (Call::Delete, V::Int(_)) => Outcome::Ok(Output::Done),
        (Call::Put { .. }, V::Okay) => Outcome::Ok(Output::Done),
        (Call::InsertIfAbsent { .. }, V::Okay) => Outcome::Ok(Output::Bool(true)),
        (Call::InsertIfAbsent { .. }, V::Nil) => Outcome::Ok(Output::Bool(false)),
        // An answer that does not fit the call: nothing can be said of it.
        _ => Outcome::Unknown,
    }
}

/// A failed read: nothing done either way, so only whether it answered matters.
fn read_failure(_err: &cairn_client::Error) -> Outcome {
    Outcome::Failed
}

/// Key `i`'s outcome from a per-key answer.
fn per_key_outcome<T: Clone>(
    answers: cairn_client::Result<cairn_client::PerKey<T>>,
    i: usize,
    output: impl Fn(T) -> Output,
) -> Outcome {
    let answer = match answers {
        Ok(mut each) => {
            if i >= each.len() {
                return Outcome::Unknown;
            }
            each.swap_remove(i)
        }
        Err(err) => Err(err),
    };
    match answer {
        Ok(value) => Outcome::Ok(output(value)),
        Err(err) if err.nothing_done() => Outcome::Failed,
        // Whatever else: it may have been done.
        Err(_) => Outcome::Unknown,
    }
}

/// The two gRPC clients behind one interface, per key.
enum GrpcClient<'a> {
    Routing(&'a RoutingClient),
    One(&'a Client),
}

impl GrpcClient<'_> {
    async fn get(&self, keys: Vec<Bytes>) -> cairn_client::Result<Vec<Option<Bytes>>> {
        match self {
            GrpcClient::Routing(c) => c.get(keys).await,
            GrpcClient::One(c) => c.get(keys).await,
        }
    }

    async fn exists(&self, keys: Vec<Bytes>) -> cairn_client::Result<Vec<bool>> {
        match self {
            GrpcClient::Routing(c) => c.exists(keys).await,
            GrpcClient::One(c) => c.exists(keys).await,
        }
    }

    async fn delete_each(
        &self,
        keys: Vec<Bytes>,
    ) -> cairn_client::Result<cairn_client::PerKey<()>> {
        match self {
            GrpcClient::Routing(c) => Ok(c.delete_each(keys).await),
            GrpcClient::One(c) => c.delete_each(keys).await,
        }
    }

    async fn put_each(
        &self,
        entries: Vec<PutEntry>,
    ) -> cairn_client::Result<cairn_client::PerKey<()>> {
        match self {
            GrpcClient::Routing(c) => Ok(c.put_each(entries).await),
            GrpcClient::One(c) => c.put_each(entries).await,
        }
    }

    async fn insert_if_absent_each(
        &self,
        keys: Vec<Bytes>,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> cairn_client::Result<cairn_client::PerKey<bool>> {
        match self {
            GrpcClient::Routing(c) => Ok(c.insert_if_absent_each(keys, value, ttl).await),
            GrpcClient::One(c) => c.insert_if_absent_each(keys, value, ttl).await,
        }
    }
}
