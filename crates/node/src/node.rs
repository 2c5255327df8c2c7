//! Start-up and shut-down of a node.

use crate::cluster;
use crate::config::{Config, LogProviderKind, MetadataProviderKind};
use crate::forward::Routes;
use crate::metrics::{self, Metrics};
use crate::partitions::{Partitions, PartitionsConfig};
use crate::service::{AdminService, KeyValueService};
use anyhow::{Context, bail};
use cairn_api::MESSAGE_BYTES_MAX;
use cairn_api::v1::admin_server::AdminServer;
use cairn_api::v1::key_value_server::KeyValueServer;
use cairn_log::LogProvider;
use cairn_log::local::{LocalLogOptions, LocalLogProvider};
use cairn_log::nats::{NatsLogOptions, NatsLogProvider};
use cairn_metadata::local::LocalMetadataStore;
use cairn_metadata::nats::{NatsMetadataOptions, NatsMetadataStore};
use cairn_metadata::{
    ArchivedHistory, Change, ClusterRecord, MetadataStore, Observed, PartitionTable, Precondition,
    get_typed, put_typed, update_typed,
};
use cairn_partition_store::{PartitionStoreManager, StoreOptions};
use cairn_snapshots::{ClusterIdentity, ProgressFn, RepositoryOptions, SnapshotRepository};
use cairn_types::{Lsn, NodeId, PartitionId};
use cairn_worker::{Clock, CreatedSnapshot, Partition, Restorer, SnapshotProducer, SystemClock};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How long a shutdown waits for the gRPC requests in flight before it closes their connections.
const GRPC_DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

/// What the services need to know about the node.
pub(crate) struct NodeState {
    pub cluster: ClusterRecord,
    pub node: NodeId,
    pub partitions: Partitions,
    /// `None` when the node has no snapshot repository.
    pub snapshots: Option<SnapshotProducer>,
    /// Per partition, the archived LSNs `latest.json` has said it covers, oldest first, each with
    /// when it was first seen (the delay of automatic trimming counts from there): this node's,
    /// or in a cluster the metadata store's as this node last read it.
    pub archived_lsn: Mutex<HashMap<PartitionId, ArchivedHistory>>,
    /// Per partition, how many snapshot publishes run or wait (requested or automatic).
    pub publishing: Mutex<HashMap<PartitionId, usize>>,
    /// Scratch space for files served to clients (snapshot tars).
    pub tmp_dir: PathBuf,
    pub metrics: Arc<Metrics>,
    pub config: Config,
    pub metadata: Arc<dyn MetadataStore>,
    /// In a cluster, where each partition's leader is.
    pub routes: Routes,
    /// Where clients and other nodes reach this node: `advertised-address`, or the address it
    /// listens on.
    pub advertised_address: String,
    /// Cancelled when the node starts shutting down: work that outlives the request that began
    /// it (an online restore) stops there.
    pub shutdown: CancellationToken,
    /// In a cluster: this node's membership (its heartbeats and the lease they renew).
    pub member: Option<Arc<cairn_controller::Member>>,
    /// In a cluster: the members and the controller's lease, as this node observes them.
    pub cluster_view: Option<tokio::sync::watch::Receiver<cairn_controller::ClusterView>>,
}

impl NodeState {
    pub fn num_partitions(&self) -> u16 {
        self.cluster.num_partitions
    }

    /// The archived LSN `latest.json` last said.
    pub fn archived_lsn(&self, id: PartitionId) -> Option<Lsn> {
        self.archived_lsn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .and_then(|history| history.seen.last())
            .map(|(lsn, _)| Lsn(*lsn))
    }

    /// The newest archived LSN that has been archived for at least `delay` (by the wall clock).
    pub fn archived_for(&self, id: PartitionId, delay: std::time::Duration) -> Option<Lsn> {
        let now = cluster::now_ms();
        self.archived_lsn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)?
            .seen
            .iter()
            .rev()
            .find(|(_, since)| now.saturating_sub(*since) >= delay.as_millis() as u64)
            .map(|(lsn, _)| Lsn(*lsn))
    }

    /// Notes `lsn` as `id`'s archived LSN. In a cluster the history is the metadata store's, so
    /// that the trim delay counts from when any node first saw an LSN, whichever node leads the
    /// partition next; this node's copy is what it last read or wrote there.
    async fn note_archived_lsn(&self, id: PartitionId, lsn: Lsn) {
        if self.config.cluster_mode() {
            match self.share_archived_lsn(id, lsn).await {
                Ok(history) => {
                    self.archived_lsn
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(id, history);
                    return;
                }
                Err(err) => tracing::warn!(
                    partition = %id,
                    "cannot keep the archived LSN in the metadata store (this node keeps it meanwhile): {err}"
                ),
            }
        }
        self.archived_lsn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id)
            .or_default()
            .remember(lsn.0, cluster::now_ms());
    }

    /// Adds `lsn` to the history in the metadata store (compare-and-swap) and returns it.
    async fn share_archived_lsn(
        &self,
        id: PartitionId,
        lsn: Lsn,
    ) -> cairn_metadata::Result<ArchivedHistory> {
        let now = cluster::now_ms();
        let (history, _) = update_typed::<ArchivedHistory, ArchivedHistory>(
            self.metadata.as_ref(),
            &ArchivedHistory::key(id),
            "archived LSN history",
            |history| {
                let mut history = history.unwrap_or_default();
                if history.remember(lsn.0, now) {
                    Change::Write(history.clone(), history)
                } else {
                    Change::Keep(history)
                }
            },
        )
        .await?;
        Ok(history)
    }

    /// Whether a snapshot of `id` is being published (a new one waits for it).
    pub fn publishing(&self, id: PartitionId) -> bool {
        self.publishing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .is_some_and(|n| *n > 0)
    }

    /// Snapshots `partition` (unless a snapshot already covers `min_lsn`), counting it in the
    /// metrics and refreshing the archived LSN.
    pub async fn create_snapshot(
        &self,
        partition: &Partition,
        min_lsn: Option<Lsn>,
        on_progress: Option<ProgressFn>,
        full: bool,
    ) -> cairn_worker::Result<CreatedSnapshot> {
        let id = partition.id();
        let _counted = Publishing::start(&self.publishing, id);
        let snapshots = self
            .snapshots
            .as_ref()
            .ok_or_else(|| cairn_worker::Error::Snapshot {
                partition: id,
                context: "create snapshot",
                source:
                    "this node has no snapshot repository (worker.snapshots.destination = \"none\")"
                        .into(),
            })?;
        let started = Instant::now();
        let result = snapshots
            .create_with(partition, min_lsn, on_progress, full)
            .await;
        match &result {
            Ok(created) if created.created => {
                self.metrics
                    .record_publish(id, created.uploaded_bytes, started.elapsed());
            }
            Ok(_) => {}
            Err(_) => self.metrics.record_failure(id, "create"),
        }
        let _ = self.refresh_archived_lsn(id).await;
        result
    }

    /// Re-reads what this cluster's snapshots in the repository cover for `id`. On failure the
    /// LSN read before stays: it is what the metrics show, but a trim must not go by it (the
    /// snapshots it stood for may be what can no longer be read).
    pub async fn refresh_archived_lsn(
        &self,
        id: PartitionId,
    ) -> Result<(), cairn_snapshots::Error> {
        let Some(snapshots) = &self.snapshots else {
            return Ok(());
        };
        match snapshots.repository().latest(id).await {
            Ok(Some(latest)) => {
                self.note_archived_lsn(id, latest.archived_lsn).await;
                if let Ok(metadata) = snapshots
                    .repository()
                    .metadata(id, latest.snapshot_id)
                    .await
                {
                    self.metrics.set_newest_snapshot(id, metadata.created_at);
                }
            }
            Ok(None) => {
                self.archived_lsn
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
            }
            Err(err) => {
                tracing::warn!(partition = %id, "read latest snapshot: {err}");
                return Err(err);
            }
        }
        Ok(())
    }
}

/// Counts a publish of one partition in [`NodeState::publishing`] while it lives.
struct Publishing<'a> {
    counts: &'a Mutex<HashMap<PartitionId, usize>>,
    partition: PartitionId,
}

impl<'a> Publishing<'a> {
    fn start(counts: &'a Mutex<HashMap<PartitionId, usize>>, partition: PartitionId) -> Self {
        *counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(partition)
            .or_default() += 1;
        Publishing { counts, partition }
    }
}

impl Drop for Publishing<'_> {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = counts.get_mut(&self.partition) {
            *n = n.saturating_sub(1);
        }
    }
}

/// A node that is serving.
pub struct RunningNode {
    local_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    resp_addr: Option<SocketAddr>,
    base_dir: PathBuf,
    state: Arc<NodeState>,
    cancel: CancellationToken,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    background: Vec<JoinHandle<()>>,
    _lock: std::fs::File,
}

impl RunningNode {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Address of the Redis-protocol port, if it is enabled.
    pub fn resp_addr(&self) -> Option<SocketAddr> {
        self.resp_addr
    }

    /// Address of the Prometheus metrics port, if it is enabled.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    pub fn base_dir(&self) -> &std::path::Path {
        &self.base_dir
    }

    /// Serves until `shutdown` resolves, then stops.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        tokio::select! {
            () = shutdown => {
                info!("shutting down");
                self.shutdown().await
            }
            () = self.cancel.cancelled() => self.shutdown().await,
        }
    }

    /// Stops serving and stops every partition processor.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        // In a cluster: stop serving as a leader first, then say so, so that what this node led
        // moves at once (and never while it still serves it).
        if let Some(member) = &self.state.member {
            member.leave().await;
        }
        self.cancel.cancel();
        // The server stops taking requests and waits for those in flight; a stream that does not
        // end by itself (an export to a client that stopped reading) must not hold the node up.
        let served = match tokio::time::timeout(GRPC_DRAIN, &mut self.server).await {
            Ok(served) => Some(served),
            Err(_) => {
                warn!(
                    "gRPC requests still in flight {} s after the shutdown began; their \
                     connections are closed",
                    GRPC_DRAIN.as_secs()
                );
                self.server.abort();
                None
            }
        };
        for task in self.background {
            let _ = task.await;
        }
        self.state.partitions.shutdown().await;
        // Closing the partition store flushes every memtable (it keeps no WAL of its own): when
        // this is the node's last reference, that happens on a blocking thread. A task still
        // holding one (a publish outliving its caller) closes it when it ends.
        let state = self.state;
        let _ = tokio::task::spawn_blocking(move || drop(state)).await;
        if let Some(served) = served {
            served
                .context("join the gRPC server")?
                .context("serve gRPC")?;
        }
        Ok(())
    }
}

/// Starts a node with `config`. It returns once the node serves; its partitions come up in the
/// background (a request to one not up yet says so).
pub async fn start(config: Config) -> anyhow::Result<RunningNode> {
    crate::open_files::raise_limit();
    let listener = listen(config.bind_address).await?;
    let local_addr = listener
        .local_addr()
        .context("read the listening address")?;
    let (base_dir, lock) = claim_base_dir(config.base_dir.clone()).await?;
    cairn_worker::testing::announce();

    let (metadata, cluster) = open_cluster(&config, &base_dir).await?;
    let node = NodeId(config.node_name.clone());
    let advertised_address = config
        .advertised_address
        .clone()
        .unwrap_or_else(|| local_addr.to_string());
    let cancel = CancellationToken::new();
    let mut background = Vec::new();
    // In a cluster the node registers as `starting` and heartbeats from here on, so that a long
    // opening of its stores is not taken for its death.
    let member = if config.cluster_mode() {
        let instance = instance_id(base_dir.clone()).await?;
        let member = cluster::join(
            metadata.clone(),
            &config,
            advertised_address.clone(),
            instance,
        )
        .await?;
        background.push(tokio::spawn(member.clone().run(cancel.clone())));
        Some(member)
    } else {
        None
    };
    let (logs, stores) = open_storage(&config, &base_dir).await?;

    let metrics_listener = match config.metrics.bind_address {
        Some(address) => Some(metrics::bind(address).await?),
        None => None,
    };
    let resp_listener = match config.resp.bind_address {
        Some(address) => Some(crate::resp::bind(address).await?),
        None => None,
    };
    let metrics = Arc::new(Metrics::new());

    let (snapshots, restorer, tmp_dir) =
        open_snapshots_and_scratch(&config, &base_dir, &cluster, &node).await?;
    let apply_threads = cairn_worker::set_apply_threads(config.worker.apply_threads);
    info!("partition processors run on {apply_threads} apply threads");
    let partitions = Partitions::open(
        PartitionsConfig {
            node: node.clone(),
            num_partitions: cluster.num_partitions,
            stores,
            metadata: metadata.clone(),
            restorer,
            clock: Arc::new(SystemClock) as Arc<dyn Clock>,
            policy: config.worker.snapshot_restore_policy,
            metrics: metrics.clone(),
            staging_root: base_dir.join("restore-staging"),
            cluster: config.cluster_mode(),
            lease: member.as_ref().map(|m| m.lease().clone()),
        },
        logs.as_ref(),
    )
    .await?;

    let cluster_view = match &member {
        Some(member) => {
            let (controller, view) = cluster::controller(
                metadata.clone(),
                &config,
                cluster.num_partitions,
                metrics.clone(),
                member,
            );
            background.push(tokio::spawn(controller.run(cancel.clone())));
            Some(view)
        }
        None => None,
    };
    let state = Arc::new(NodeState {
        cluster: cluster.clone(),
        node: node.clone(),
        partitions,
        snapshots,
        archived_lsn: Mutex::new(HashMap::new()),
        publishing: Mutex::new(HashMap::new()),
        tmp_dir,
        metrics,
        config,
        metadata: metadata.clone(),
        routes: Routes::new(),
        advertised_address: advertised_address.clone(),
        shutdown: cancel.clone(),
        member: member.clone(),
        cluster_view,
    });
    load_archived_lsns(&state).await;
    let (max_connections, max_clients) = crate::open_files::client_bounds(
        state.config.max_connections,
        resp_listener
            .as_ref()
            .map(|_| state.config.resp.max_clients),
        cluster.num_partitions,
    );
    let server = serve_grpc(state.clone(), listener, max_connections, cancel.clone());
    info!(
        cluster = %cluster.cluster_name,
        node = %node,
        partitions = cluster.num_partitions,
        "Cairn node {node} listening on {local_addr}; data in {}",
        base_dir.display()
    );
    let metrics_addr = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());
    let resp_addr = resp_listener.as_ref().and_then(|l| l.local_addr().ok());
    background.extend(spawn_background(
        &state,
        metrics_listener,
        &cancel,
        member.is_none(),
    ));
    if let (Some(listener), Some(max_clients)) = (resp_listener, max_clients) {
        background.push(tokio::spawn(crate::resp::serve(
            listener,
            state.clone(),
            max_clients,
            cancel.clone(),
        )));
    }
    if let Some(member) = member {
        let timing = cluster::timing(&state.config);
        let following = state.clone();
        let follow_cancel = cancel.clone();
        background.push(tokio::spawn(async move {
            // Partitions are taken on only once this node says it can take them.
            tokio::select! {
                alive = cluster::announce_alive(member, timing) => {
                    if let Err(err) = alive {
                        tracing::error!("{err:#}");
                        follow_cancel.cancel();
                        return;
                    }
                }
                () = follow_cancel.cancelled() => return,
            }
            follow_placement(following, follow_cancel).await;
        }));
    }
    Ok(RunningNode {
        local_addr,
        metrics_addr,
        resp_addr,
        base_dir,
        state,
        cancel,
        server,
        background,
        _lock: lock,
    })
}

/// How long start-up waits for the repository to say what each partition's snapshots cover.
const ARCHIVED_LSN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// Partitions whose `latest.json` is read at once at start-up.
const ARCHIVED_LSN_READS: usize = 8;

/// Reads every partition's archived LSN, for at most [`ARCHIVED_LSN_WAIT`]: an unreachable
/// repository retries every read for seconds, and key-value service must not wait minutes for
/// it. What is not read by then goes on in the background; until then that partition has no
/// archived LSN, which only makes trims ask for `--force`.
async fn load_archived_lsns(state: &Arc<NodeState>) {
    let reading = state.clone();
    let task = tokio::spawn(async move {
        use futures::StreamExt;
        let partitions = 0..reading.cluster.num_partitions;
        futures::stream::iter(partitions)
            .for_each_concurrent(ARCHIVED_LSN_READS, |p| {
                let reading = reading.clone();
                async move {
                    let _ = reading.refresh_archived_lsn(PartitionId(p)).await;
                }
            })
            .await;
    });
    if tokio::time::timeout(ARCHIVED_LSN_WAIT, task).await.is_err() {
        tracing::warn!(
            "the snapshot repository did not say within {ARCHIVED_LSN_WAIT:?} what every partition's snapshots cover; serving meanwhile (trims past an unknown archived LSN need --force) and reading on in the background"
        );
    }
}

/// Binds the gRPC port first: a node that cannot serve should fail before it touches its data.
async fn listen(address: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {address}: another process may use it; set bind-address (or CAIRN_BIND_ADDRESS) to a free address"
            )
        })
}

/// Opens the metadata store and the cluster record in it (created on the first start).
async fn open_cluster(
    config: &Config,
    base_dir: &std::path::Path,
) -> anyhow::Result<(Arc<dyn MetadataStore>, ClusterRecord)> {
    let metadata: Arc<dyn MetadataStore> = match config.metadata.provider {
        MetadataProviderKind::Local => {
            let path = base_dir.join("metadata.json");
            Arc::new(
                tokio::task::spawn_blocking(move || LocalMetadataStore::open(&path))
                    .await
                    .context("open the metadata store")??,
            )
        }
        MetadataProviderKind::Nats => Arc::new(connect_nats_metadata(config).await?),
    };
    let cluster = ensure_cluster(metadata.as_ref(), config).await?;
    Ok((metadata, cluster))
}

/// What a node that cannot reach NATS says to do.
const NATS_REMEDY: &str = "start nats-server with JetStream (-js), or set [nats] servers \
                           (CAIRN_NATS__SERVERS) to where it runs";

/// The cluster's metadata bucket on NATS: `cairn-<cluster name>`, with the `.` a bucket name may
/// not hold written `__`.
pub(crate) async fn connect_nats_metadata(config: &Config) -> anyhow::Result<NatsMetadataStore> {
    let options = NatsMetadataOptions {
        servers: config.nats.servers.clone(),
        bucket: format!("cairn-{}", nats_name(config)),
        replicas: config.nats.replicas,
    };
    let servers = options.servers.join(", ");
    NatsMetadataStore::connect(&options).await.map_err(|err| {
        let reached = !matches!(
            &err,
            cairn_metadata::Error::Nats {
                context: "connect to NATS",
                ..
            }
        );
        let err = anyhow::Error::new(err);
        if reached {
            err.context(format!(
                "cannot open the metadata bucket {} on NATS at {servers}; nats-server must run \
                 with JetStream (-js), and nats.replicas ({}) must not exceed its servers",
                options.bucket, options.replicas
            ))
        } else {
            err.context(format!("cannot reach NATS at {servers}; {NATS_REMEDY}"))
        }
    })
}

/// The partitions' logs on NATS: one stream per partition, named after the cluster.
pub(crate) async fn connect_nats_logs(config: &Config) -> anyhow::Result<NatsLogProvider> {
    let mut options = NatsLogOptions::new(config.nats.servers.clone(), nats_name(config));
    options.replicas = config.nats.replicas;
    NatsLogProvider::connect(options)
        .await
        .with_context(|| format!("open the partitions' logs on NATS; {NATS_REMEDY}"))
}

/// The cluster's name where NATS allows no `.` (bucket and stream names, subject tokens).
fn nats_name(config: &Config) -> String {
    config.cluster_name.replace('.', "__")
}

/// Creates the base dir if needed and locks it; returns its canonical path and the lock.
async fn claim_base_dir(base_dir: PathBuf) -> anyhow::Result<(PathBuf, std::fs::File)> {
    tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&base_dir).with_context(|| {
            format!(
                "cannot create the base dir {}; set base-dir to a writable folder",
                base_dir.display()
            )
        })?;
        let base_dir = base_dir
            .canonicalize()
            .with_context(|| format!("resolve base dir {}", base_dir.display()))?;
        let lock = lock_base_dir(&base_dir)?;
        Ok((base_dir, lock))
    })
    .await
    .context("claim the base dir")?
}

/// The local log's options the configuration sets.
pub(crate) fn local_log_options(config: &Config) -> LocalLogOptions {
    LocalLogOptions {
        segment_bytes_max: config.log.segment_bytes,
        ..LocalLogOptions::default()
    }
}

/// The log provider `log.provider` names, and the partition store.
async fn open_storage(
    config: &Config,
    base_dir: &std::path::Path,
) -> anyhow::Result<(Arc<dyn LogProvider>, Arc<PartitionStoreManager>)> {
    let log_dir = base_dir.join("log");
    let db_dir = base_dir.join("db");
    let log_options = local_log_options(config);
    let store_options = StoreOptions {
        block_cache_bytes: config.partition_store.block_cache_bytes,
        write_buffer_bytes: config.partition_store.write_buffer_bytes,
        write_buffer_budget_bytes: config.partition_store.write_buffer_budget_bytes,
        compaction_style: config.partition_store.compaction_style.for_store(),
        block_bytes: config.partition_store.block_bytes,
        ..StoreOptions::default()
    };
    let nats_logs: Option<Arc<dyn LogProvider>> = match config.log.provider {
        LogProviderKind::Local => None,
        LogProviderKind::Nats => Some(Arc::new(connect_nats_logs(config).await?)),
    };
    // Opening both reads and recovers files: off the async threads.
    tokio::task::spawn_blocking(move || {
        let logs: Arc<dyn LogProvider> = match nats_logs {
            Some(logs) => logs,
            None => Arc::new(
                LocalLogProvider::open(log_dir, log_options).context("open the local log")?,
            ),
        };
        let stores = Arc::new(
            PartitionStoreManager::open(&db_dir, &store_options).map_err(|err| {
                // RocksDB writes at open (it recovers its write-ahead file into a table).
                let full = err.is_disk_full();
                let out_of_files = err.is_out_of_files();
                let damaged = err.is_damaged();
                let err = anyhow::Error::new(err);
                if out_of_files {
                    err.context(
                        "cannot open the partition store: the open-files limit is spent (each \
                         partition has a RocksDB of its own, which keeps every table file open); \
                         raise the limit (`ulimit -n`, or LimitNOFILE= in a systemd unit), then \
                         start the node again",
                    )
                } else if full {
                    err.context(format!(
                        "cannot open the partition store: the disk holding {} is full; free \
                         space on it, then start the node again",
                        db_dir.display()
                    ))
                } else if damaged {
                    err.context(store_damaged(&db_dir))
                } else {
                    err.context("open the partition store")
                }
            })?,
        );
        Ok((logs, stores))
    })
    .await
    .context("open the log and the partition store")?
}

/// What to do about a partition store that RocksDB cannot open because a file of it is damaged
/// or gone. (A partition's own database that cannot be opened keeps only that partition down;
/// this is the one database an older store keeps every partition in.)
pub(crate) fn store_damaged(db_dir: &Path) -> String {
    format!(
        "cannot open the partition store: a file of it is damaged or missing (see below). The \
         store is rebuilt from the snapshots and the logs: move {} away (keep it until the node \
         serves again) and start the node; each partition then restores its newest snapshot \
         (with snapshot-restore-policy = \"on-init\", or where its log was trimmed) and replays \
         its log. A partition whose log was trimmed past every snapshot it has cannot be \
         rebuilt so: put the folder back from a backup instead",
        db_dir.display()
    )
}

/// The snapshot producer and the restorer over the repository of `[worker.snapshots]`; neither
/// when the node has no repository. Blocking (see [`open_repository`]).
fn snapshot_parts(
    config: &Config,
    base_dir: &std::path::Path,
    cluster: &ClusterRecord,
    node: &NodeId,
) -> anyhow::Result<(Option<SnapshotProducer>, Option<Restorer>)> {
    if !config.snapshots_enabled() {
        info!("no snapshot repository (worker.snapshots.destination = \"none\")");
        return Ok((None, None));
    }
    let repository = Arc::new(open_repository(config, base_dir, cluster)?);
    let producer = SnapshotProducer::new(
        repository.clone(),
        base_dir.join("db-snapshots"),
        node.0.clone(),
    )
    .with_retention(
        config.worker.snapshots.num_retained,
        config.worker.snapshots.orphan_grace_period,
    );
    let restorer = Restorer::new(
        repository,
        base_dir.join("restore-staging"),
        cluster.num_partitions,
    );
    Ok((Some(producer), Some(restorer)))
}

/// The snapshot producer and restorer ([`snapshot_parts`]) and the emptied scratch folder
/// ([`clear_scratch_folders`]). Both touch the file system (a local repository's folder is
/// created when it is opened), so they run together on a blocking thread.
async fn open_snapshots_and_scratch(
    config: &Config,
    base_dir: &std::path::Path,
    cluster: &ClusterRecord,
    node: &NodeId,
) -> anyhow::Result<(Option<SnapshotProducer>, Option<Restorer>, PathBuf)> {
    let (config, base_dir, cluster, node) = (
        config.clone(),
        base_dir.to_path_buf(),
        cluster.clone(),
        node.clone(),
    );
    tokio::task::spawn_blocking(move || {
        let (snapshots, restorer) = snapshot_parts(&config, &base_dir, &cluster, &node)?;
        let tmp_dir = clear_scratch_folders(&base_dir)?;
        Ok((snapshots, restorer, tmp_dir))
    })
    .await
    .context("open the snapshot repository and clear the scratch folders")?
}

/// Removes what a previous run left in the node's scratch folders (snapshot exports it never
/// published, tars it never finished serving) and returns the empty scratch folder for files
/// served to clients. Blocking.
fn clear_scratch_folders(base_dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    let exports = base_dir.join("db-snapshots");
    let tmp_dir = base_dir.join("tmp");
    let _ = std::fs::remove_dir_all(&exports);
    let _ = std::fs::remove_dir_all(&tmp_dir);
    std::fs::create_dir_all(&tmp_dir).with_context(|| format!("create {}", tmp_dir.display()))?;
    Ok(tmp_dir)
}

/// Serves the key-value and admin services on `listener` until `cancel`, with at most
/// `max_connections` connections open at once.
fn serve_grpc(
    state: Arc<NodeState>,
    listener: tokio::net::TcpListener,
    max_connections: usize,
    cancel: CancellationToken,
) -> JoinHandle<Result<(), tonic::transport::Error>> {
    let server = tonic::transport::Server::builder()
        .add_service(
            KeyValueServer::new(KeyValueService::new(state.clone()))
                .max_decoding_message_size(MESSAGE_BYTES_MAX)
                .max_encoding_message_size(MESSAGE_BYTES_MAX),
        )
        .add_service(
            AdminServer::new(AdminService::new(state))
                .max_decoding_message_size(MESSAGE_BYTES_MAX)
                .max_encoding_message_size(MESSAGE_BYTES_MAX),
        )
        .serve_with_incoming_shutdown(
            crate::connections::bounded(listener, max_connections),
            cancel.cancelled_owned(),
        );
    tokio::spawn(server)
}

/// In a cluster: follows the partition table (the intent) and keeps the routes to the leaders,
/// and has each partition brought in line with it by a task of its own, so that a partition that
/// takes long (a restore of minutes, a replay) holds up no other partition's failover or route.
async fn follow_placement(state: Arc<NodeState>, cancel: CancellationToken) {
    let (tables, _) = tokio::sync::watch::channel(Arc::new(PartitionTable::default()));
    let mut tasks: Vec<JoinHandle<()>> = state
        .partitions
        .slots()
        .iter()
        .map(|slot| {
            tokio::spawn(reconcile_partition(
                state.clone(),
                slot.id(),
                tables.subscribe(),
                cancel.clone(),
            ))
        })
        .collect();
    tasks.push(tokio::spawn(report_observed(state.clone(), cancel.clone())));
    watch_placement(&state, &tables, &cancel).await;
    for task in tasks {
        let _ = task.await;
    }
}

/// Follows every version of the partition table until `cancel`: keeps the routes and hands the
/// table to the partitions' tasks.
async fn watch_placement(
    state: &NodeState,
    tables: &tokio::sync::watch::Sender<Arc<PartitionTable>>,
    cancel: &CancellationToken,
) {
    let mut watch = None;
    let mut table = PartitionTable::default();
    loop {
        // A watch that ended (its connection to NATS broke) is made again; it starts with the
        // table's current version, so nothing committed meanwhile is missed.
        let current = match &mut watch {
            Some(current) => current,
            None => match state.metadata.watch(PartitionTable::KEY).await {
                Ok(new) => watch.insert(new),
                Err(err) => {
                    tracing::warn!("watch the partition table: {err}");
                    tokio::select! {
                        () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                        () = cancel.cancelled() => return,
                    }
                    continue;
                }
            },
        };
        let next = tokio::select! {
            version = current.next() => match version {
                Some(mut latest) => {
                    // Only the newest version matters: skip those already superseded.
                    while let Some(Some(newer)) = futures::FutureExt::now_or_never(current.next()) {
                        latest = newer;
                    }
                    Some(latest)
                }
                None => {
                    watch = None;
                    continue;
                }
            },
            // Again now and then: node addresses refreshed.
            () = tokio::time::sleep(RECONCILE_INTERVAL) => None,
            () = cancel.cancelled() => return,
        };
        if let Some(latest) = next {
            match serde_json::from_value::<PartitionTable>(latest.value) {
                Ok(newest) => {
                    table = newest;
                    state
                        .partitions
                        .table_version
                        .store(latest.version, std::sync::atomic::Ordering::Relaxed);
                    state.routes.update(table.clone(), node_addresses(state));
                    // Only a change of the placement wakes the partitions: a version that only
                    // stamps a controller's term changes nothing they run.
                    tables.send_if_modified(|known| {
                        let changed = known.partitions != table.partitions;
                        if changed {
                            *known = Arc::new(table.clone());
                        }
                        changed
                    });
                }
                Err(err) => {
                    tracing::error!(
                        "the partition table in the metadata store cannot be read: {err}"
                    );
                }
            }
        } else {
            state.routes.update(table.clone(), node_addresses(state));
        }
    }
}

/// The nodes' addresses, as this node last read their records.
fn node_addresses(state: &NodeState) -> HashMap<NodeId, String> {
    let Some(view) = &state.cluster_view else {
        return HashMap::new();
    };
    view.borrow()
        .nodes
        .iter()
        .filter_map(|node| {
            let record = node.record.as_ref()?;
            Some((node.name.clone(), record.address.clone()))
        })
        .collect()
}

/// Brings partition `id` in line with each new table, with this node's new generation (it
/// leads nothing it led before it), and every [`RECONCILE_INTERVAL`] (a partition that stopped
/// or could not start is started again), until `cancel`.
async fn reconcile_partition(
    state: Arc<NodeState>,
    id: PartitionId,
    mut tables: tokio::sync::watch::Receiver<Arc<PartitionTable>>,
    cancel: CancellationToken,
) {
    let Some(slot) = state.partitions.slot(id) else {
        return;
    };
    let mut generation = state.member.as_ref().map(|member| member.generation());
    loop {
        let table = tables.borrow_and_update().clone();
        if table.partitions.values().any(|p| p.leader.is_some()) {
            let role = cluster::role(&table, id, &state.node);
            tokio::select! {
                () = state.partitions.reconcile_one(slot, role) => {}
                () = cancel.cancelled() => return,
            }
            if let Some(placement) = table.partitions.get(&id)
                && placement.leader.as_ref() == Some(&state.node)
                && let Some(to) = &placement.handoff
            {
                let handed = tokio::select! {
                    handed = state.partitions.hand_off(slot, placement.epoch, to) => handed,
                    () = cancel.cancelled() => return,
                };
                match handed {
                    Ok(true) => info!(partition = %id, "handed its leadership over to node {to}"),
                    Ok(false) => {}
                    Err(err) => tracing::warn!(
                        partition = %id,
                        "cannot hand its leadership over to node {to} yet: {err:#}"
                    ),
                }
            }
            state.partitions.reconciled.notify_one();
            if role == cluster::Role::None {
                let grace = state.config.cluster.drop_moved_after;
                let dropped = tokio::select! {
                    dropped = state.partitions.drop_moved_away(slot, grace) => dropped,
                    () = cancel.cancelled() => return,
                };
                if let Err(err) = dropped {
                    tracing::warn!(partition = %id, "cannot delete its local store: {err}");
                }
            }
        }
        let new_generation = async {
            match &mut generation {
                Some(generation) => {
                    if generation.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            changed = tables.changed() => if changed.is_err() { return },
            () = new_generation => {}
            () = tokio::time::sleep(RECONCILE_INTERVAL) => {}
            () = cancel.cancelled() => return,
        }
    }
}

/// Writes what this node runs (`observed/<node>`) beside the intent: every heartbeat interval
/// when anything changed, and soon after a partition changed its role (a scaling operation
/// waits on it). Operators compare the two, and the controller picks the most caught-up
/// follower by it. Only this node writes its key.
async fn report_observed(state: Arc<NodeState>, cancel: CancellationToken) {
    let interval = cluster::timing(&state.config).heartbeat_interval();
    let mut written: Option<Observed> = None;
    let mut serving = None;
    loop {
        // Prompted by a partition that may have changed what it runs: written soon, but only if
        // a role or an epoch changed (applied LSNs alone go out every interval).
        let prompted = tokio::select! {
            () = tokio::time::sleep(interval) => false,
            () = state.partitions.reconciled.notified() => {
                tokio::time::sleep(REPORT_GATHER).await;
                true
            }
            () = cancel.cancelled() => return,
        };
        let mut observed = Observed {
            generation: match &state.member {
                Some(member) => *member.generation().borrow(),
                None => 0,
            },
            ..Observed::default()
        };
        for slot in state.partitions.slots() {
            if let Some(partition) = slot.observed().await {
                observed.partitions.insert(slot.id(), partition);
            }
        }
        let roles = observed.partitions.values().map(|p| p.role);
        let now = (
            roles
                .clone()
                .filter(|r| *r == cairn_metadata::ObservedRole::Leader)
                .count(),
            roles
                .filter(|r| *r == cairn_metadata::ObservedRole::Follower)
                .count(),
        );
        // Said once every partition placed here has come up (or is down for a reason), and
        // again when that changes.
        let settled = !observed.partitions.values().any(|p| {
            matches!(
                p.role,
                cairn_metadata::ObservedRole::Starting | cairn_metadata::ObservedRole::Restoring
            )
        });
        if settled && serving != Some(now) {
            info!(
                "{} of {} partitions serving on this node as leader, {} as follower",
                now.0,
                state.partitions.slots().len(),
                now.1
            );
            serving = Some(now);
        }
        if written.as_ref() == Some(&observed) {
            continue;
        }
        let roles = |o: &Observed| -> Vec<_> {
            o.partitions
                .iter()
                .map(|(id, p)| (*id, p.role, p.epoch))
                .collect()
        };
        if prompted && written.as_ref().map(roles) == Some(roles(&observed)) {
            continue;
        }
        match put_typed(
            state.metadata.as_ref(),
            &Observed::key(&state.node),
            &observed,
            Precondition::None,
        )
        .await
        {
            Ok(_) => written = Some(observed),
            Err(err) => tracing::debug!("report what this node runs: {err}"),
        }
    }
}

/// How long a report prompted by a change waits for the changes that come with it.
const REPORT_GATHER: std::time::Duration = std::time::Duration::from_millis(50);

/// How often a node reconciles what it runs with an unchanged partition table.
const RECONCILE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// The random id of this base dir (`<base-dir>/node-instance`, made at its first start): a node
/// restarted on it is the same node, one on another base dir with the same name is not.
async fn instance_id(base_dir: PathBuf) -> anyhow::Result<String> {
    tokio::task::spawn_blocking(move || {
        let path = base_dir.join("node-instance");
        match std::fs::read_to_string(&path) {
            Ok(id) => return Ok(id.trim().to_string()),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => return Err(err).with_context(|| format!("read {}", path.display())),
        }
        let id = format!("{:032x}", rand::random::<u128>());
        let staged = base_dir.join("node-instance.tmp");
        std::fs::write(&staged, &id)
            .and_then(|()| std::fs::File::open(&staged)?.sync_all())
            .and_then(|()| std::fs::rename(&staged, &path))
            .and_then(|()| std::fs::File::open(&base_dir)?.sync_all())
            .with_context(|| format!("write {}", path.display()))?;
        Ok(id)
    })
    .await
    .context("read this node's instance id")?
}

/// The metrics port, automatic snapshots and trimming, and (alone) the bring-up of the
/// partitions; in a cluster the placement brings them up.
fn spawn_background(
    state: &Arc<NodeState>,
    metrics_listener: Option<tokio::net::TcpListener>,
    cancel: &CancellationToken,
    bring_up_all: bool,
) -> Vec<JoinHandle<()>> {
    let mut background = Vec::new();
    if let Some(listener) = metrics_listener {
        background.push(tokio::spawn(metrics::serve(
            listener,
            state.clone(),
            cancel.clone(),
        )));
    }
    background.extend(crate::background::spawn(state.clone(), cancel.clone()));
    if !bring_up_all {
        return background;
    }
    // Partitions come up while the node serves: a long restore leaves admin calls, metrics and
    // the other partitions available, and requests to a partition not up yet say so.
    let bring_up = state.clone();
    let bring_up_cancel = cancel.clone();
    background.push(tokio::spawn(async move {
        let total = bring_up.partitions.slots().len();
        tokio::select! {
            serving = bring_up.partitions.bring_up() => {
                info!("{serving} of {total} partitions serving");
            }
            () = bring_up_cancel.cancelled() => {}
        }
    }));
    background
}

/// The snapshot repository of `[worker.snapshots]` (by default `<base-dir>/pp-snapshots`), as
/// `cluster` sees it: every decision it offers counts only this cluster's snapshots. Blocking: a
/// local repository's folder is created.
pub(crate) fn open_repository(
    config: &Config,
    base_dir: &std::path::Path,
    cluster: &ClusterRecord,
) -> anyhow::Result<SnapshotRepository> {
    let settings = &config.worker.snapshots;
    let destination = match &settings.destination {
        Some(destination) => destination.clone(),
        None => base_dir.join("pp-snapshots").display().to_string(),
    };
    let options = RepositoryOptions {
        endpoint_url: settings.endpoint_url.clone(),
        region: settings.region.clone(),
        allow_http: settings.allow_http,
        upload_concurrency: settings.upload_concurrency,
        multipart_threshold_bytes: settings.multipart_threshold_bytes,
        rate_limit_bytes_per_second: settings.rate_limit_bytes_per_second,
        ..RepositoryOptions::default()
    };
    let identity = ClusterIdentity::new(cluster.cluster_name.clone(), cluster.created_at.clone());
    let repository = SnapshotRepository::open(&destination, identity, options)
        .context("open the snapshot repository (worker.snapshots.destination)")?;
    info!(destination = %repository.destination(), "snapshot repository");
    Ok(repository)
}

/// One process per base dir: a second node on the same data would corrupt it.
pub(crate) fn lock_base_dir(base_dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    let path = base_dir.join("LOCK");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    if file.try_lock().is_err() {
        bail!(
            "another Cairn node is using {}; stop it or set base-dir to another folder",
            base_dir.display()
        );
    }
    Ok(file)
}

/// Creates the cluster record on first start; afterwards checks that the config still matches it.
async fn ensure_cluster(
    metadata: &dyn MetadataStore,
    config: &Config,
) -> anyhow::Result<ClusterRecord> {
    // Nodes of a new cluster start together: the one whose creation lands makes the record, and
    // the others, refused, read it as any later node does.
    let mut attempts = 0;
    loop {
        attempts += 1;
        match create_or_check_cluster(metadata, config).await {
            Err(err)
                if attempts < 5
                    && matches!(
                        err.downcast_ref::<cairn_metadata::Error>(),
                        Some(cairn_metadata::Error::PreconditionFailed { .. })
                    ) => {}
            answer => return answer,
        }
    }
}

async fn create_or_check_cluster(
    metadata: &dyn MetadataStore,
    config: &Config,
) -> anyhow::Result<ClusterRecord> {
    if let Some((_, existing)) =
        get_typed::<ClusterRecord>(metadata, ClusterRecord::KEY, "cluster record").await?
    {
        if existing.cluster_name != config.cluster_name {
            bail!(
                "cluster-name is {:?} but the data in base-dir belongs to cluster {:?}; set cluster-name to {:?} or use another base-dir",
                config.cluster_name,
                existing.cluster_name,
                existing.cluster_name
            );
        }
        if existing.num_partitions != config.num_partitions {
            bail!(
                "num-partitions is {} but this cluster was created with {} partitions, and the number is fixed at creation; set num-partitions to {}",
                config.num_partitions,
                existing.num_partitions,
                existing.num_partitions
            );
        }
        return Ok(existing);
    }
    let record = ClusterRecord {
        cluster_name: config.cluster_name.clone(),
        num_partitions: config.num_partitions,
        created_at: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
    };
    put_typed(
        metadata,
        ClusterRecord::KEY,
        &record,
        Precondition::DoesNotExist,
    )
    .await?;
    info!(
        cluster = %record.cluster_name,
        partitions = record.num_partitions,
        "created a new cluster"
    );
    Ok(record)
}
