//! Start-up and shut-down of a node.

use crate::config::{Config, LogProviderKind};
use crate::metrics::{self, Metrics};
use crate::partitions::{Partitions, PartitionsConfig};
use crate::service::{AdminService, KeyValueService};
use anyhow::{Context, bail};
use cairn_api::MESSAGE_BYTES_MAX;
use cairn_api::v1::admin_server::AdminServer;
use cairn_api::v1::key_value_server::KeyValueServer;
use cairn_log::LogProvider;
use cairn_log::local::{LocalLogOptions, LocalLogProvider};
use cairn_metadata::local::LocalMetadataStore;
use cairn_metadata::{ClusterRecord, MetadataStore, Precondition, get_typed, put_typed};
use cairn_partition_store::{PartitionStoreManager, StoreOptions};
use cairn_snapshots::{ClusterIdentity, ProgressFn, RepositoryOptions, SnapshotRepository};
use cairn_types::{Lsn, NodeId, PartitionId};
use cairn_worker::{Clock, CreatedSnapshot, Partition, Restorer, SnapshotProducer, SystemClock};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

/// What the services need to know about the node.
pub(crate) struct NodeState {
    pub cluster: ClusterRecord,
    pub node: NodeId,
    pub partitions: Partitions,
    /// `None` when the node has no snapshot repository.
    pub snapshots: Option<SnapshotProducer>,
    /// Per partition, the archived LSNs `latest.json` has said it covers, oldest first, each with
    /// when this node first saw it (the delay of automatic trimming counts from there).
    pub archived_lsn: Mutex<HashMap<PartitionId, Vec<(Lsn, Instant)>>>,
    /// Scratch space for files served to clients (snapshot tars).
    pub tmp_dir: PathBuf,
    pub metrics: Arc<Metrics>,
    pub config: Config,
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
            .and_then(|seen| seen.last())
            .map(|(lsn, _)| *lsn)
    }

    /// The newest archived LSN that has been archived for at least `delay`.
    pub fn archived_for(&self, id: PartitionId, delay: std::time::Duration) -> Option<Lsn> {
        self.archived_lsn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)?
            .iter()
            .rev()
            .find(|(_, since)| since.elapsed() >= delay)
            .map(|(lsn, _)| *lsn)
    }

    pub fn set_archived_lsn(&self, id: PartitionId, lsn: Lsn) {
        /// Archived LSNs remembered per partition for the trim delay.
        const HISTORY_MAX: usize = 256;
        let mut archived = self.archived_lsn.lock().unwrap_or_else(|p| p.into_inner());
        let seen = archived.entry(id).or_default();
        if seen.last().map(|(known, _)| *known) != Some(lsn) {
            // A smaller LSN (the repository was rewound) makes the larger ones untrustworthy.
            seen.retain(|(known, _)| *known < lsn);
            seen.push((lsn, Instant::now()));
            if seen.len() > HISTORY_MAX {
                seen.remove(0);
            }
        }
    }

    /// Snapshots `partition` (unless a snapshot already covers `min_lsn`), counting it in the
    /// metrics and refreshing the archived LSN.
    pub async fn create_snapshot(
        &self,
        partition: &Partition,
        min_lsn: Option<Lsn>,
        on_progress: Option<ProgressFn>,
    ) -> cairn_worker::Result<CreatedSnapshot> {
        let id = partition.id();
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
        let result = snapshots.create(partition, min_lsn, on_progress).await;
        match &result {
            Ok(created) if created.created => {
                self.metrics
                    .record_publish(id, created.uploaded_bytes, started.elapsed());
            }
            Ok(_) => {}
            Err(_) => self.metrics.record_failure(id, "create"),
        }
        self.refresh_archived_lsn(id).await;
        result
    }

    /// Re-reads what this cluster's snapshots in the repository cover for `id`.
    pub async fn refresh_archived_lsn(&self, id: PartitionId) {
        let Some(snapshots) = &self.snapshots else {
            return;
        };
        match snapshots.repository().latest(id).await {
            Ok(Some(latest)) => {
                self.set_archived_lsn(id, latest.archived_lsn);
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
            Err(err) => tracing::warn!(partition = %id, "read latest snapshot: {err}"),
        }
    }
}

/// A node that is serving.
pub struct RunningNode {
    local_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
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
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.cancel.cancel();
        let served = self.server.await;
        for task in self.background {
            let _ = task.await;
        }
        self.state.partitions.shutdown().await;
        served
            .context("join the gRPC server")?
            .context("serve gRPC")?;
        Ok(())
    }
}

/// Starts a node with `config` and returns once it serves every partition it could start.
pub async fn start(config: Config) -> anyhow::Result<RunningNode> {
    let listener = tokio::net::TcpListener::bind(config.bind_address)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {}: another process may use it; set bind-address (or CAIRN_BIND_ADDRESS) to a free address",
                config.bind_address
            )
        })?;
    let local_addr = listener
        .local_addr()
        .context("read the listening address")?;

    std::fs::create_dir_all(&config.base_dir).with_context(|| {
        format!(
            "cannot create the base dir {}; set base-dir to a writable folder",
            config.base_dir.display()
        )
    })?;
    let base_dir = config
        .base_dir
        .canonicalize()
        .with_context(|| format!("resolve base dir {}", config.base_dir.display()))?;
    let lock = lock_base_dir(&base_dir)?;
    cairn_worker::testing::announce();

    let metadata: Arc<dyn MetadataStore> =
        Arc::new(LocalMetadataStore::open(&base_dir.join("metadata.json"))?);
    let cluster = ensure_cluster(metadata.as_ref(), &config).await?;
    let node = NodeId(config.node_name.clone());

    let logs: Arc<dyn LogProvider> = match config.log.provider {
        LogProviderKind::Local => Arc::new(
            LocalLogProvider::open(
                base_dir.join("log"),
                LocalLogOptions {
                    segment_bytes_max: config.log.segment_bytes,
                    ..LocalLogOptions::default()
                },
            )
            .context("open the local log")?,
        ),
    };
    let stores = Arc::new(
        PartitionStoreManager::open(
            &base_dir.join("db"),
            &StoreOptions {
                block_cache_bytes: config.partition_store.block_cache_bytes,
                ..StoreOptions::default()
            },
        )
        .context("open the partition store")?,
    );

    let metrics_listener = match config.metrics.bind_address {
        Some(address) => Some(metrics::bind(address).await?),
        None => None,
    };
    let metrics_addr = metrics_listener
        .as_ref()
        .and_then(|listener| listener.local_addr().ok());
    let metrics = Arc::new(Metrics::new());

    let repository = match config.snapshots_enabled() {
        true => Some(Arc::new(open_repository(&config, &base_dir, &cluster)?)),
        false => {
            info!("no snapshot repository (worker.snapshots.destination = \"none\")");
            None
        }
    };
    let snapshots = repository.as_ref().map(|repository| {
        SnapshotProducer::new(
            repository.clone(),
            base_dir.join("db-snapshots"),
            node.0.clone(),
        )
        .with_retention(
            config.worker.snapshots.num_retained,
            config.worker.snapshots.orphan_grace_period,
        )
    });
    let _ = std::fs::remove_dir_all(base_dir.join("db-snapshots"));
    let restorer = repository.as_ref().map(|repository| {
        Restorer::new(
            repository.clone(),
            base_dir.join("restore-staging"),
            cluster.num_partitions,
        )
    });
    let tmp_dir = base_dir.join("tmp");
    let _ = std::fs::remove_dir_all(&tmp_dir);
    std::fs::create_dir_all(&tmp_dir).with_context(|| format!("create {}", tmp_dir.display()))?;

    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let partitions = Partitions::open(
        PartitionsConfig {
            node: node.clone(),
            num_partitions: cluster.num_partitions,
            stores,
            metadata: metadata.clone(),
            restorer,
            clock,
            policy: config.worker.snapshot_restore_policy,
            metrics: metrics.clone(),
            staging_root: base_dir.join("restore-staging"),
        },
        logs.as_ref(),
    )
    .await?;

    let state = Arc::new(NodeState {
        cluster: cluster.clone(),
        node: node.clone(),
        partitions,
        snapshots,
        archived_lsn: Mutex::new(HashMap::new()),
        tmp_dir,
        metrics,
        config: config.clone(),
    });
    for p in 0..cluster.num_partitions {
        state.refresh_archived_lsn(PartitionId(p)).await;
    }
    let cancel = CancellationToken::new();
    let server = tonic::transport::Server::builder()
        .add_service(
            KeyValueServer::new(KeyValueService::new(state.clone()))
                .max_decoding_message_size(MESSAGE_BYTES_MAX)
                .max_encoding_message_size(MESSAGE_BYTES_MAX),
        )
        .add_service(
            AdminServer::new(AdminService::new(state.clone()))
                .max_decoding_message_size(MESSAGE_BYTES_MAX)
                .max_encoding_message_size(MESSAGE_BYTES_MAX),
        )
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            cancel.clone().cancelled_owned(),
        );
    let server = tokio::spawn(server);
    info!(
        cluster = %cluster.cluster_name,
        node = %node,
        partitions = cluster.num_partitions,
        "Cairn node {node} listening on {local_addr}; data in {}",
        base_dir.display()
    );
    let mut background = Vec::new();
    if let Some(listener) = metrics_listener {
        background.push(tokio::spawn(metrics::serve(
            listener,
            state.clone(),
            cancel.clone(),
        )));
    }
    background.extend(crate::background::spawn(state.clone(), cancel.clone()));
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
    Ok(RunningNode {
        local_addr,
        metrics_addr,
        base_dir,
        state,
        cancel,
        server,
        background,
        _lock: lock,
    })
}

/// The snapshot repository of `[worker.snapshots]` (by default `<base-dir>/pp-snapshots`), as
/// `cluster` sees it: every decision it offers counts only this cluster's snapshots.
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
