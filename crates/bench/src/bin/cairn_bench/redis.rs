//! Redis's side: a `redis-server` of its own on a free loopback port, in a temporary folder, with
//! every write fsynced before its answer (`--appendonly yes --appendfsync always`, no RDB saves),
//! driven with the same shapes as Cairn: batches as pipelines, reads as `GET` and `MGET`. The same
//! requests drive Cairn's Redis port, so that both servers meet one client.

use crate::Args;
use crate::drive::{Connection, Workload};
use anyhow::Context;
use bytes::Bytes;
use cairn_bench::redis_server::RedisProcess;
use redis::aio::MultiplexedConnection;
use std::time::{Duration, Instant};

/// How long `redis-server` may take to answer after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// Bounds one answer, so that a Redis that stops answering ends the run with an error.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// A `redis-server` the benchmark started; killed when dropped (see [`Server::stop`]).
pub struct Server {
    process: RedisProcess,
    url: String,
    pub version: String,
}

impl Server {
    /// Starts `binary`; `None` when it is not installed.
    pub async fn start(binary: &str) -> anyhow::Result<Option<Server>> {
        // Creating the folder and starting the process block: off the async threads.
        let binary = binary.to_owned();
        let launched = tokio::task::spawn_blocking(move || RedisProcess::launch(&binary))
            .await
            .context("start redis-server")??;
        let Some(process) = launched else {
            return Ok(None);
        };
        let mut server = Server {
            url: format!("redis://127.0.0.1:{}/", process.port),
            process,
            version: String::new(),
        };
        server.version = server.wait_until_ready().await?;
        Ok(Some(server))
    }

    /// The server's process id, whose CPU time the runs against it count.
    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }

    /// Kills the server and removes its folder, on a blocking thread (the kill is waited for).
    pub async fn stop(self) {
        let _ = tokio::task::spawn_blocking(move || drop(self)).await;
    }

    /// Waits until the server answers, checks that it fsyncs every write, and returns its version.
    async fn wait_until_ready(&mut self) -> anyhow::Result<String> {
        let deadline = Instant::now() + START_TIMEOUT;
        let mut connection = loop {
            if let Some(status) = self
                .process
                .child
                .try_wait()
                .context("watch redis-server")?
            {
                anyhow::bail!(
                    "redis-server exited ({status}) before it served; its log:\n{}",
                    self.log().await
                );
            }
            match self.connect().await {
                Ok(connection) => break connection,
                Err(e) if Instant::now() >= deadline => {
                    return Err(e.context(format!(
                        "redis-server did not answer within {START_TIMEOUT:?}; its log:\n{}",
                        self.log().await
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let fsync: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("appendfsync")
            .query_async(&mut connection)
            .await
            .context("ask Redis for its appendfsync setting")?;
        anyhow::ensure!(
            fsync.get(1).map(String::as_str) == Some("always"),
            "Redis runs with appendfsync {fsync:?}, not always: its figures would not be comparable"
        );
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut connection)
            .await
            .context("ask Redis for its version")?;
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .unwrap_or("(unknown version)")
            .trim()
            .to_owned())
    }

    async fn connect(&self) -> anyhow::Result<MultiplexedConnection> {
        connect(&self.url).await
    }

    /// One connection per client, as independent clients would have.
    pub async fn connections(&self, clients: usize) -> anyhow::Result<Vec<Connection>> {
        connections(&self.url, clients).await
    }

    async fn log(&self) -> String {
        tokio::fs::read_to_string(self.process.log_path())
            .await
            .unwrap_or_else(|e| format!("(no log: {e})"))
    }
}

/// A connection to the server that speaks the Redis protocol at `url` (Redis, or Cairn's Redis
/// port).
async fn connect(url: &str) -> anyhow::Result<MultiplexedConnection> {
    let client = redis::Client::open(url).context("parse a Redis-protocol address")?;
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .with_context(|| format!("connect to the Redis protocol at {url}"))
}

/// `clients` connections to the Redis-protocol server at `url`, one per client, as independent
/// clients would have.
pub async fn connections(url: &str, clients: usize) -> anyhow::Result<Vec<Connection>> {
    let mut connections = Vec::with_capacity(clients);
    for _ in 0..clients {
        connections.push(Connection::Redis(connect(url).await?));
    }
    Ok(connections)
}

/// One request of `workload`, checked: every insert inserted, every read key found.
pub async fn send(
    connection: &mut MultiplexedConnection,
    args: &Args,
    workload: Workload,
    keys: Vec<Bytes>,
) -> anyhow::Result<()> {
    // An insert-if-absent request writes one value under all its keys, as Cairn's does.
    let value = args.value_for(&keys[0]);
    let ttl = args.ttl().as_secs();
    match workload {
        Workload::PutBatch => {
            let mut pipe = redis::pipe();
            for key in &keys {
                pipe.set(key.as_ref(), args.value_for(key).as_ref())
                    .ignore();
            }
            pipe.query_async::<()>(connection)
                .await
                .context("Redis pipelined SET")?;
        }
        Workload::InsertBatch => {
            let mut pipe = redis::pipe();
            for key in &keys {
                pipe.add_command(set_nx(key, &value, ttl));
            }
            let answers: Vec<Option<String>> = pipe
                .query_async(connection)
                .await
                .context("Redis pipelined SET NX EX")?;
            anyhow::ensure!(
                answers.iter().all(Option::is_some),
                "Redis did not insert a fresh key"
            );
        }
        Workload::Put => {
            redis::cmd("SET")
                .arg(keys[0].as_ref())
                .arg(value.as_ref())
                .query_async::<()>(connection)
                .await
                .context("Redis SET")?;
        }
        Workload::Insert => {
            let answer: Option<String> = set_nx(&keys[0], &value, ttl)
                .query_async(connection)
                .await
                .context("Redis SET NX EX")?;
            anyhow::ensure!(answer.is_some(), "Redis did not insert a fresh key");
        }
        Workload::Get => {
            let answer: Option<Vec<u8>> = redis::cmd("GET")
                .arg(keys[0].as_ref())
                .query_async(connection)
                .await
                .context("Redis GET")?;
            anyhow::ensure!(
                answer.is_some(),
                "Redis did not find a key the benchmark wrote"
            );
        }
        Workload::GetBatch => {
            let keys: Vec<&[u8]> = keys.iter().map(Bytes::as_ref).collect();
            let answers: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
                .arg(keys)
                .query_async(connection)
                .await
                .context("Redis MGET")?;
            anyhow::ensure!(
                answers.iter().all(Option::is_some),
                "Redis did not find a key the benchmark wrote"
            );
        }
    }
    Ok(())
}

/// `SET key value NX EX ttl`: Redis's insert-if-absent with an expiry.
fn set_nx(key: &Bytes, value: &Bytes, ttl_secs: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("SET");
    cmd.arg(key.as_ref())
        .arg(value.as_ref())
        .arg("NX")
        .arg("EX")
        .arg(ttl_secs);
    cmd
}
