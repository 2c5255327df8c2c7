//! Prometheus metrics, served as text at `http://<metrics.bind-address>/metrics`.
//!
//! Counters and histograms are updated where the work happens; the per-partition LSN gauges and
//! the age of the newest snapshot are read from the node when Prometheus scrapes.

use crate::node::NodeState;
use anyhow::Context;
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Buckets for snapshot and restore durations, in seconds.
const DURATION_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
];

pub(crate) struct Metrics {
    registry: Registry,
    upload_bytes: IntCounterVec,
    upload_seconds: HistogramVec,
    download_bytes: IntCounterVec,
    restore_seconds: HistogramVec,
    failures: IntCounterVec,
    newest_snapshot_unix: GaugeVec,
    newest_snapshot_age: GaugeVec,
    /// Unix time of the newest snapshot per partition that has one.
    newest_created: std::sync::Mutex<std::collections::HashMap<String, f64>>,
    applied_lsn: IntGaugeVec,
    archived_lsn: IntGaugeVec,
    trim_point: IntGaugeVec,
    log_tail: IntGaugeVec,
    replay_lag: IntGaugeVec,
    expired_dropped: IntCounterVec,
    time_ahead: GaugeVec,
    write_stall: IntGaugeVec,
    resp_commands: IntCounterVec,
    resp_duration: HistogramVec,
    resp_connections: IntGauge,
    failovers: IntCounterVec,
    failover_detection: prometheus::Histogram,
    takeover: prometheus::Histogram,
    nodes_marked_dead: prometheus::IntCounter,
}

/// Buckets for failover times, in seconds: around the node timeout (3 s by default).
const FAILOVER_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 10.0, 30.0, 60.0,
];

/// Buckets for the time to answer a Redis command, in seconds.
const COMMAND_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new_custom(Some("cairn".into()), None).expect("valid prefix");
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(metric.clone()))
                .expect("registered once");
            metric
        };
        let gauge = |name: &str, help: &str| {
            let metric =
                IntGaugeVec::new(Opts::new(name, help), &["partition"]).expect("valid metric");
            registry
                .register(Box::new(metric.clone()))
                .expect("registered once");
            metric
        };
        let float_gauge = |name: &str, help: &str| {
            let metric =
                GaugeVec::new(Opts::new(name, help), &["partition"]).expect("valid metric");
            registry
                .register(Box::new(metric.clone()))
                .expect("registered once");
            metric
        };
        let histogram = |name: &str, help: &str| {
            let metric = HistogramVec::new(
                HistogramOpts::new(name, help).buckets(DURATION_BUCKETS.to_vec()),
                &["partition"],
            )
            .expect("valid metric");
            registry
                .register(Box::new(metric.clone()))
                .expect("registered once");
            metric
        };
        Metrics {
            upload_bytes: counter(
                "snapshot_upload_bytes_total",
                "Bytes of SST files uploaded to the snapshot repository.",
                &["partition"],
            ),
            upload_seconds: histogram(
                "snapshot_publish_duration_seconds",
                "Time to export and publish a snapshot.",
            ),
            download_bytes: counter(
                "snapshot_download_bytes_total",
                "Bytes of SST files downloaded from the snapshot repository by restores.",
                &["partition"],
            ),
            restore_seconds: histogram(
                "snapshot_restore_duration_seconds",
                "Time to download, verify and import a snapshot.",
            ),
            failures: counter(
                "snapshot_failures_total",
                "Snapshot operations that failed, by operation (create, restore, trim).",
                &["partition", "operation"],
            ),
            newest_snapshot_unix: float_gauge(
                "snapshot_newest_created_seconds",
                "Unix time at which the newest snapshot of the partition was created.",
            ),
            newest_snapshot_age: float_gauge(
                "snapshot_newest_age_seconds",
                "Age of the newest snapshot of the partition.",
            ),
            applied_lsn: gauge(
                "partition_applied_lsn",
                "Last log record applied to the partition's store.",
            ),
            archived_lsn: gauge(
                "partition_archived_lsn",
                "LSN covered by the oldest retained snapshot: the log may be trimmed up to here.",
            ),
            trim_point: gauge("log_trim_point", "Last trimmed LSN of the partition's log."),
            log_tail: gauge("log_tail_lsn", "Last LSN appended to the partition's log."),
            replay_lag: gauge(
                "partition_replay_lag_records",
                "Records in the log that the partition has not applied yet.",
            ),
            expired_dropped: counter(
                "partition_expired_values_dropped_total",
                "Expired values that compactions removed from the partition's store.",
                &["partition"],
            ),
            time_ahead: float_gauge(
                "partition_time_ahead_seconds",
                "How far the partition's time is ahead of this node's clock. It never goes back, \
                 so a leader whose clock ran ahead moves it, and TTLs then run out early until \
                 the clocks catch up: alert on it.",
            ),
            write_stall: gauge(
                "partition_store_write_stall",
                "1 while RocksDB slows the partition's writes, 2 while it stops them, because its \
                 compactions are behind (0 otherwise). A compaction that cannot get the disk \
                 space it needs keeps it up: alert on it.",
            ),
            resp_commands: counter(
                "resp_commands_total",
                "Commands answered on the Redis port, by command (`unknown` for the others).",
                &["command"],
            ),
            resp_duration: {
                let metric = HistogramVec::new(
                    HistogramOpts::new(
                        "resp_command_duration_seconds",
                        "Time from reading a command on the Redis port to its reply, by command. \
                         Commands pipelined together are answered together and count the time \
                         of their whole run.",
                    )
                    .buckets(COMMAND_BUCKETS.to_vec()),
                    &["command"],
                )
                .expect("valid metric");
                registry
                    .register(Box::new(metric.clone()))
                    .expect("registered once");
                metric
            },
            resp_connections: {
                let metric =
                    IntGauge::new("resp_connections", "Clients connected to the Redis port.")
                        .expect("valid metric");
                registry
                    .register(Box::new(metric.clone()))
                    .expect("registered once");
                metric
            },
            failovers: counter(
                "failovers_total",
                "Partition leaderships the controller on this node moved off a node that was gone \
                 (`gone`: dead or left) or had restarted (`restarted`).",
                &["reason"],
            ),
            failover_detection: {
                let metric = prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "failover_detection_seconds",
                        "For each failover the controller on this node wrote: time from the last \
                         change it saw of the old leader's record to the new placement's write.",
                    )
                    .buckets(FAILOVER_BUCKETS.to_vec()),
                )
                .expect("valid metric");
                registry
                    .register(Box::new(metric.clone()))
                    .expect("registered once");
                metric
            },
            takeover: {
                let metric = prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "leadership_takeover_seconds",
                        "Time this node took to lead a partition the placement gave it while it \
                         ran it as a follower: from reading the placement to serving.",
                    )
                    .buckets(FAILOVER_BUCKETS.to_vec()),
                )
                .expect("valid metric");
                registry
                    .register(Box::new(metric.clone()))
                    .expect("registered once");
                metric
            },
            nodes_marked_dead: {
                let metric = prometheus::IntCounter::new(
                    "nodes_marked_dead_total",
                    "Nodes the controller on this node wrote dead after their records stayed \
                     unchanged for the node timeout.",
                )
                .expect("valid metric");
                registry
                    .register(Box::new(metric.clone()))
                    .expect("registered once");
                metric
            },
            newest_created: Default::default(),
            registry,
        }
    }

    /// A controller's event: counts dead nodes and failovers.
    pub fn controller_event(&self, event: &cairn_controller::ControllerEvent) {
        use cairn_controller::{Change, ControllerEvent, NodeCondition};
        match event {
            ControllerEvent::MarkedDead { .. } => self.nodes_marked_dead.inc(),
            ControllerEvent::Changed {
                change: Change::Failover { from_condition, .. },
                detected_after,
            } => {
                let reason = if *from_condition == NodeCondition::Starting {
                    "restarted"
                } else {
                    "gone"
                };
                self.failovers.with_label_values(&[reason]).inc();
                if let Some(after) = detected_after {
                    self.failover_detection.observe(after.as_secs_f64());
                }
            }
            _ => {}
        }
    }

    /// This node took over a partition it followed, in `took`.
    pub fn record_takeover(&self, took: Duration) {
        self.takeover.observe(took.as_secs_f64());
    }

    pub fn record_publish(&self, partition: impl ToString, uploaded_bytes: u64, took: Duration) {
        let partition = partition.to_string();
        self.upload_bytes
            .with_label_values(&[&partition])
            .inc_by(uploaded_bytes);
        self.upload_seconds
            .with_label_values(&[&partition])
            .observe(took.as_secs_f64());
    }

    pub fn record_restore(&self, partition: impl ToString, bytes: u64, took: Duration) {
        let partition = partition.to_string();
        self.download_bytes
            .with_label_values(&[&partition])
            .inc_by(bytes);
        self.restore_seconds
            .with_label_values(&[&partition])
            .observe(took.as_secs_f64());
    }

    pub fn record_failure(&self, partition: impl ToString, operation: &str) {
        self.failures
            .with_label_values(&[&partition.to_string(), operation])
            .inc();
    }

    pub fn resp_command(&self, command: &str, took: Duration) {
        self.resp_commands.with_label_values(&[command]).inc();
        self.resp_duration
            .with_label_values(&[command])
            .observe(took.as_secs_f64());
    }

    pub fn resp_connections(&self, delta: i64) {
        self.resp_connections.add(delta);
    }

    /// Unix time of the newest snapshot this node has seen published, of any partition.
    pub fn newest_snapshot_unix(&self) -> Option<f64> {
        self.newest_created
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .copied()
            .reduce(f64::max)
    }

    pub fn set_newest_snapshot(&self, partition: impl ToString, created_at: SystemTime) {
        let unix = created_at
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let partition = partition.to_string();
        self.newest_snapshot_unix
            .with_label_values(&[&partition])
            .set(unix);
        self.newest_created
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(partition, unix);
    }

    /// The text exposition of every metric, after reading the node's current state.
    pub async fn render(&self, state: &NodeState) -> String {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        for slot in state.partitions.slots() {
            let label = slot.id().to_string();
            let status = slot.status(state.partitions.stores()).await;
            let applied = status.applied_lsn.0 as i64;
            self.applied_lsn.with_label_values(&[&label]).set(applied);
            if let Some(log) = status.log {
                self.trim_point
                    .with_label_values(&[&label])
                    .set(log.trim_point.0 as i64);
                self.log_tail
                    .with_label_values(&[&label])
                    .set(log.tail.0 as i64);
                self.replay_lag
                    .with_label_values(&[&label])
                    .set((log.tail.0 as i64 - applied).max(0));
            }
            if let Ok(partition) = slot.running() {
                // Counted by the store since it was opened: a restore starts a new count, which
                // Prometheus takes for a counter reset.
                let dropped = partition.expired_dropped();
                let counter = self.expired_dropped.with_label_values(&[&label]);
                if dropped < counter.get() {
                    counter.reset();
                }
                counter.inc_by(dropped - counter.get());
                let ahead_ms = partition.applied_time_ms() as f64 - now * 1000.0;
                self.time_ahead
                    .with_label_values(&[&label])
                    .set((ahead_ms / 1000.0).max(0.0));
                if let Ok(store) = partition.store_status().await {
                    self.write_stall
                        .with_label_values(&[&label])
                        .set(store.write_stall as i64);
                }
            }
            if let Some(archived) = state.archived_lsn(slot.id()) {
                self.archived_lsn
                    .with_label_values(&[&label])
                    .set(archived.0 as i64);
            }
            if let Ok(created) = self
                .newest_snapshot_unix
                .get_metric_with_label_values(&[&label])
                && created.get() > 0.0
            {
                self.newest_snapshot_age
                    .with_label_values(&[&label])
                    .set((now - created.get()).max(0.0));
            }
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding into memory");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

/// How long a client may take to send its request head.
const REQUEST_HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `GET /metrics` on `listener` over HTTP/1.1 (hyper, the HTTP stack under tonic) until
/// `cancel`.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<NodeState>,
    cancel: CancellationToken,
) {
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    warn!("metrics port: accept: {err}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = cancel.cancelled() => return,
        };
        let state = state.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<_>| {
            let state = state.clone();
            let get = request.method() == hyper::Method::GET;
            let metrics = request.uri().path() == "/metrics";
            async move { Ok::<_, std::convert::Infallible>(respond(&state, get, metrics).await) }
        });
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(REQUEST_HEAD_TIMEOUT)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                debug!("metrics port: {err}");
            }
        });
    }
}

/// The answer to a request with method GET (`get`) or another, for `/metrics` (`metrics`) or
/// another path.
async fn respond(
    state: &NodeState,
    get: bool,
    metrics: bool,
) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
    let (status, content_type, body) = match (get, metrics) {
        (true, true) => (
            hyper::StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            state.metrics.render(state).await,
        ),
        (false, true) => (
            hyper::StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "Cairn serves its metrics at GET /metrics\n".to_string(),
        ),
        _ => (
            hyper::StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "Cairn serves its metrics at GET /metrics\n".to_string(),
        ),
    };
    let mut response = hyper::Response::new(http_body_util::Full::new(bytes::Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

/// Binds the metrics port.
pub(crate) async fn bind(address: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    let listener = tokio::net::TcpListener::bind(address).await.with_context(|| {
        format!(
            "cannot listen for metrics on {address}: another process may use it; set metrics.bind-address (or CAIRN_METRICS__BIND_ADDRESS) to a free address"
        )
    })?;
    info!(
        "metrics listening on http://{}/metrics",
        listener.local_addr().unwrap_or(address)
    );
    Ok(listener)
}
