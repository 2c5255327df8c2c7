//! The workloads, and the loop that drives one against Cairn or Redis: `--clients` connections,
//! each sending one request after the other for `--seconds`, every request's latency recorded.

use crate::Args;
use bytes::Bytes;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One shape of request, run the same way against Cairn and Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// `--batch` keys per request: one Cairn put, `SET`s pipelined `--batch` deep in Redis.
    PutBatch,
    /// `--batch` keys per request: one Cairn insert-if-absent, `SET NX EX`s pipelined in Redis.
    InsertBatch,
    Put,
    Insert,
    Get,
    /// `--batch` keys per request: one Cairn get, one `MGET` in Redis.
    GetBatch,
}

impl Workload {
    pub const ALL: [Workload; 6] = [
        Workload::PutBatch,
        Workload::InsertBatch,
        Workload::Put,
        Workload::Insert,
        Workload::Get,
        Workload::GetBatch,
    ];

    pub fn keys_per_request(self, batch: usize) -> usize {
        match self {
            Workload::PutBatch | Workload::InsertBatch | Workload::GetBatch => batch,
            Workload::Put | Workload::Insert | Workload::Get => 1,
        }
    }

    pub fn name(self, batch: usize) -> String {
        match self {
            Workload::PutBatch => format!("put, {batch} keys per request"),
            Workload::InsertBatch => format!("insert-if-absent, {batch} keys"),
            Workload::Put => "put, 1 key per request".into(),
            Workload::Insert => "insert-if-absent, 1 key".into(),
            Workload::Get => "get, 1 key".into(),
            Workload::GetBatch => format!("get, {batch} keys"),
        }
    }

    pub fn reads(self) -> bool {
        matches!(self, Workload::Get | Workload::GetBatch)
    }

    /// Each writing workload writes keys of its own, so that insert-if-absent always inserts.
    fn tag(self) -> &'static str {
        match self {
            Workload::PutBatch => "put-batch",
            Workload::InsertBatch => "iia-batch",
            Workload::Put => "put",
            Workload::Insert => "iia",
            Workload::Get | Workload::GetBatch => "read",
        }
    }
}

/// The keys of request `seq` of client `client` in pass `pass`. Reads spread over the
/// `--read-keys` keys that [`read_key`] names and the run wrote beforehand; writes never repeat a
/// key across passes (a key insert-if-absent already inserted would not be fresh), so each run
/// against one server (a round, through one front end) is a pass of its own.
pub fn request_keys(
    args: &Args,
    workload: Workload,
    pass: usize,
    client: usize,
    seq: u64,
) -> Vec<Bytes> {
    let n = workload.keys_per_request(args.batch);
    if workload.reads() {
        let first = (client as u64)
            .wrapping_mul(1_000_003)
            .wrapping_add(seq * n as u64);
        return (0..n as u64)
            .map(|j| read_key((first + j) % args.read_keys))
            .collect();
    }
    // `<tag>-p<pass>-c<client>-<seq>-<j>`: what all keys of the request share is formatted once,
    // so that making keys costs the client little beside what it measures.
    let prefix = format!("{}-p{pass}-c{client}-{seq}-", workload.tag());
    let mut digits = itoa::Buffer::new();
    (0..n)
        .map(|j| {
            let j = digits.format(j);
            let mut key = Vec::with_capacity(prefix.len() + j.len());
            key.extend_from_slice(prefix.as_bytes());
            key.extend_from_slice(j.as_bytes());
            Bytes::from(key)
        })
        .collect()
}

/// The `i`th of the keys the read workloads read.
pub fn read_key(i: u64) -> Bytes {
    Bytes::from(format!("read-{i}"))
}

/// What a run of one workload achieved.
pub struct Figures {
    pub keys: u64,
    pub elapsed: Duration,
    /// One per request, sorted.
    latencies: Vec<Duration>,
    /// CPU time the run cost, in seconds, where it was read: this process's (the clients, and the
    /// Cairn node or raw RocksDB, which run in it), plus the Redis server's for Redis.
    pub cpu: Option<f64>,
}

impl Figures {
    pub fn new(recorders: Vec<Recorder>, elapsed: Duration) -> Figures {
        let keys = recorders.iter().map(|r| r.keys).sum();
        let mut latencies: Vec<Duration> =
            recorders.into_iter().flat_map(|r| r.latencies).collect();
        latencies.sort_unstable();
        Figures {
            keys,
            elapsed,
            latencies,
            cpu: None,
        }
    }

    pub fn keys_per_second(&self) -> f64 {
        self.keys as f64 / self.elapsed.as_secs_f64()
    }

    /// CPU time per key written or read, in microseconds, where the run's CPU time was read.
    pub fn cpu_us_per_key(&self) -> Option<f64> {
        self.cpu.map(|cpu| cpu / self.keys.max(1) as f64 * 1e6)
    }

    /// Keys/s and CPU time per key, for a progress line.
    pub fn brief(&self) -> String {
        let cpu = self
            .cpu_us_per_key()
            .map_or(String::new(), |us| format!(", {us:.1} CPU µs/key"));
        format!("{:.0} keys/s{cpu}", self.keys_per_second())
    }

    /// The latency that `quantile` of the requests did not exceed; zero without requests.
    pub fn latency(&self, quantile: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let rank = (quantile * self.latencies.len() as f64).ceil() as usize;
        self.latencies[rank.clamp(1, self.latencies.len()) - 1]
    }
}

/// What one client (task or thread) saw.
#[derive(Default)]
pub struct Recorder {
    keys: u64,
    latencies: Vec<Duration>,
}

impl Recorder {
    pub fn record(&mut self, keys: usize, latency: Duration) {
        self.keys += keys as u64;
        self.latencies.push(latency);
    }
}

/// A connection of one client, to either system. (Cairn's client is the larger: boxed.)
pub enum Connection {
    Cairn(Box<cairn_client::Client>),
    Redis(redis::aio::MultiplexedConnection),
}

impl Connection {
    /// Sends one request of `workload` for `keys` and checks its answer: every insert inserted,
    /// every read key found.
    pub async fn send(
        &mut self,
        args: &Args,
        workload: Workload,
        keys: Vec<Bytes>,
    ) -> anyhow::Result<()> {
        match self {
            Connection::Cairn(client) => crate::cairn::send(client, args, workload, keys).await,
            Connection::Redis(connection) => {
                crate::redis::send(connection, args, workload, keys).await
            }
        }
    }
}

/// Writes the `--read-keys` keys the read workloads read, in batched puts.
pub async fn write_read_keys(args: &Args, connection: &mut Connection) -> anyhow::Result<()> {
    let mut next = 0;
    while next < args.read_keys {
        let end = (next + args.batch as u64).min(args.read_keys);
        let keys = (next..end).map(read_key).collect();
        connection.send(args, Workload::PutBatch, keys).await?;
        next = end;
    }
    Ok(())
}

/// Runs `workload` on every connection for `--seconds`, with the keys of pass `pass`, and hands
/// the connections back. The figures' CPU time is this process's and that of `server_pids` (a
/// server that runs in a process of its own).
pub async fn drive(
    args: &Args,
    workload: Workload,
    pass: usize,
    connections: Vec<Connection>,
    server_pids: Vec<u32>,
) -> anyhow::Result<(Figures, Vec<Connection>)> {
    let stop = Arc::new(AtomicBool::new(false));
    let cpu_before = cairn_bench::CpuTime::read(server_pids.clone()).await?;
    let start = Instant::now();
    let tasks: Vec<_> = connections
        .into_iter()
        .enumerate()
        .map(|(client, mut connection)| {
            let (stop, args) = (stop.clone(), args.clone());
            tokio::spawn(async move {
                let mut recorder = Recorder::default();
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let keys = request_keys(&args, workload, pass, client, seq);
                    let n = keys.len();
                    let sent = Instant::now();
                    connection.send(&args, workload, keys).await?;
                    recorder.record(n, sent.elapsed());
                    seq += 1;
                }
                anyhow::Ok((recorder, connection))
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut recorders = Vec::new();
    let mut connections = Vec::new();
    for result in futures::future::join_all(tasks).await {
        let (recorder, connection) = result??;
        recorders.push(recorder);
        connections.push(connection);
    }
    let mut figures = Figures::new(recorders, start.elapsed());
    let cpu = cairn_bench::CpuTime::read(server_pids)
        .await?
        .since(cpu_before);
    figures.cpu = Some(cpu.total());
    Ok((figures, connections))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn figures(millis: &[u64]) -> Figures {
        let mut recorder = Recorder::default();
        for m in millis {
            recorder.record(1, Duration::from_millis(*m));
        }
        Figures::new(vec![recorder], Duration::from_secs(1))
    }

    #[test]
    fn latency_quantiles_are_the_request_at_that_rank() {
        let f = figures(&(1..=100).rev().collect::<Vec<_>>());
        assert_eq!(f.latency(0.50), Duration::from_millis(50));
        assert_eq!(f.latency(0.99), Duration::from_millis(99));
        assert_eq!(f.latency(1.0), Duration::from_millis(100));
        assert_eq!(figures(&[7]).latency(0.5), Duration::from_millis(7));
        assert_eq!(figures(&[]).latency(0.99), Duration::ZERO);
    }

    #[test]
    fn reads_ask_for_written_keys_and_writes_never_repeat_a_key() {
        let args = Args::parse_from(["cairn-bench", "--batch", "10", "--read-keys", "25"]);
        let written: std::collections::HashSet<Bytes> = (0..25).map(read_key).collect();
        for seq in 0..10 {
            for key in request_keys(&args, Workload::GetBatch, 1, 3, seq) {
                assert!(written.contains(&key), "{key:?} was not written");
            }
        }
        let mut seen = std::collections::HashSet::new();
        for workload in Workload::ALL.into_iter().filter(|w| !w.reads()) {
            for pass in 1..=2 {
                for client in 0..3 {
                    for seq in 0..5 {
                        for key in request_keys(&args, workload, pass, client, seq) {
                            assert!(seen.insert(key.clone()), "{key:?} written twice");
                        }
                    }
                }
            }
        }
    }
}
