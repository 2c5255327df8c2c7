//! What the cluster benchmarks share: a load of batched puts whose every answer is recorded,
//! a key of each partition for probes, and the figures read off what was recorded.

use anyhow::Context;
use bytes::Bytes;
use cairn_client::{ClientOptions, PutEntry, RoutingClient, RoutingOptions};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Failed load requests kept, with their errors.
const FAILURES_KEPT: usize = 10_000;

/// When each load request ended, and how long it took (`None`: it failed).
pub type Samples = Arc<Mutex<Vec<(Instant, Option<Duration>)>>>;

/// Load clients putting batches of `batch` keys through routing clients, one batch in flight
/// each, until stopped.
pub struct Load {
    pub samples: Samples,
    /// When a request failed, and why (the first [`FAILURES_KEPT`]).
    pub failures: Arc<Mutex<Vec<(Instant, String)>>>,
    pub batch: usize,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Load {
    /// Starts `clients` clients, each writing its own 10,000 keys over and over with `value`.
    pub async fn start(
        seeds: &[String],
        options: &ClientOptions,
        clients: usize,
        batch: usize,
        value: Bytes,
    ) -> anyhow::Result<Load> {
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        let mut load = Load {
            samples: Arc::default(),
            failures: Arc::default(),
            batch,
            stop: CancellationToken::new(),
            tasks: Vec::new(),
        };
        for c in 0..clients {
            let client = RoutingClient::connect_any(&seeds, options, &RoutingOptions::default())
                .await
                .context("connect a load client")?;
            let (samples, failures, stop) = (
                load.samples.clone(),
                load.failures.clone(),
                load.stop.clone(),
            );
            let value = value.clone();
            load.tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.is_cancelled() {
                    let entries = (0..batch)
                        .map(|i| PutEntry {
                            key: Bytes::from(format!(
                                "load-{c}-{}",
                                (n as usize * batch + i) % 10_000
                            )),
                            value: value.clone(),
                            ttl: None,
                        })
                        .collect();
                    n += 1;
                    let asked = Instant::now();
                    let answer = client.put(entries).await;
                    let ended = Instant::now();
                    if let Err(err) = &answer {
                        let mut seen = failures.lock().unwrap();
                        if seen.len() < FAILURES_KEPT {
                            seen.push((ended, format!("{err}")));
                        }
                    }
                    let took = answer.is_ok().then(|| ended - asked);
                    samples.lock().unwrap().push((ended, took));
                    if took.is_none() {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }));
        }
        Ok(load)
    }

    /// Throughput (keys/s), p99 latency and failures of the requests that ended within `spans`.
    pub fn summary(&self, spans: &[(Instant, Instant)]) -> String {
        let samples = self.samples.lock().unwrap();
        let within = |at: &Instant| spans.iter().any(|(from, to)| at >= from && at < to);
        let mut latencies: Vec<Duration> = samples
            .iter()
            .filter(|(at, _)| within(at))
            .filter_map(|(_, took)| *took)
            .collect();
        let failed = samples
            .iter()
            .filter(|(at, took)| within(at) && took.is_none())
            .count();
        let seconds = span_seconds(spans);
        latencies.sort();
        format!(
            "{:.0} keys/s, p99 {} ms, {} failed requests over {:.1} s",
            latencies.len() as f64 * self.batch as f64 / seconds.max(1e-9),
            percentile(&latencies, 0.99).as_millis(),
            failed,
            seconds
        )
    }

    /// Keys acknowledged per second within `spans`.
    pub fn keys_per_second(&self, spans: &[(Instant, Instant)]) -> f64 {
        let samples = self.samples.lock().unwrap();
        let acknowledged = samples
            .iter()
            .filter(|(at, took)| took.is_some() && spans.iter().any(|(f, t)| at >= f && at < t))
            .count();
        acknowledged as f64 * self.batch as f64 / span_seconds(spans).max(1e-9)
    }

    /// Up to `shown` of the failures within `spans`.
    pub fn failures_within(&self, spans: &[(Instant, Instant)], shown: usize) -> Vec<String> {
        self.failures
            .lock()
            .unwrap()
            .iter()
            .filter(|(at, _)| spans.iter().any(|(from, to)| at >= from && at < to))
            .take(shown)
            .map(|(_, failure)| failure.clone())
            .collect()
    }

    /// Stops the clients and waits for them.
    pub async fn stop(self) {
        self.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

fn span_seconds(spans: &[(Instant, Instant)]) -> f64 {
    spans
        .iter()
        .map(|(from, to)| to.saturating_duration_since(*from).as_secs_f64())
        .sum()
}

/// One key of each partition, named `<prefix>-<n>`.
pub fn keys_per_partition(prefix: &str, partitions: u16) -> Vec<Bytes> {
    let mut keys: Vec<Option<Bytes>> = vec![None; partitions as usize];
    let mut i = 0u64;
    while keys.iter().any(Option::is_none) {
        let key = format!("{prefix}-{i}");
        let partition = cairn_types::keys::partition_for_key(
            cairn_types::partition_key(key.as_bytes()),
            partitions,
        );
        keys[partition.0 as usize].get_or_insert_with(|| Bytes::from(key));
        i += 1;
    }
    keys.into_iter().map(|k| k.unwrap_or_default()).collect()
}

/// The `q` quantile of `sorted`, zero for none.
pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}
