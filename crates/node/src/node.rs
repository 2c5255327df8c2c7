//! Start-up and shut-down of a node.

use crate::config::{Config, LogProviderKind};
use crate::service::{AdminService, KeyValueService};
use anyhow::{Context, bail};
use cairn_api::MESSAGE_BYTES_MAX;
use cairn_api::v1::admin_server::AdminServer;
use cairn_api::v1::key_value_server::KeyValueServer;
use cairn_log::LogProvider;
use cairn_log::local::{LocalLogOptions, LocalLogProvider};
use cairn_metadata::local::LocalMetadataStore;
use cairn_metadata::{
    ClusterRecord, MetadataStore, PartitionPlacement, PartitionTable, Precondition, get_typed,
    put_typed,
};
use cairn_partition_store::{PartitionStoreManager, StoreOptions};
use cairn_snapshots::{RepositoryOptions, SnapshotRepository};
use cairn_types::Lsn;
use cairn_types::{KeyRange, LogId, NodeId, PartitionId};
use cairn_worker::{Clock, Partition, SnapshotProducer, SystemClock};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

/// What the services need to know about the node.
pub(crate) struct NodeState {
    pub cluster: ClusterRecord,
    pub node: NodeId,
    pub partitions: Vec<Arc<Partition>>,
    pub table_version: AtomicU64,
    pub snapshots: SnapshotProducer,
    /// Per partition, what the repository's `latest.json` last said it covers.
    pub archived_lsn: Mutex<HashMap<PartitionId, Lsn>>,
    /// Scratch space for files served to clients (snapshot tars).
    pub tmp_dir: PathBuf,
}

impl NodeState {
    pub fn partition(&self, id: PartitionId) -> Option<&Arc<Partition>> {
        self.partitions.get(usize::from(id.0))
    }

    pub fn num_partitions(&self) -> u16 {
        self.cluster.num_partitions
    }

    pub fn archived_lsn(&self, id: PartitionId) -> Option<Lsn> {
        self.archived_lsn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .copied()
    }

    pub fn set_archived_lsn(&self, id: PartitionId, lsn: Lsn) {
        self.archived_lsn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, lsn);
    }

    /// Re-reads what the repository covers for `id`.
    pub async fn refresh_archived_lsn(&self, id: PartitionId) {
        match self.snapshots.repository().latest(id).await {
            Ok(Some(latest)) => self.set_archived_lsn(id, latest.archived_lsn),
            Ok(None) => {}
            Err(err) => tracing::warn!(partition = %id, "read latest snapshot: {err}"),
        }
    }
}

/// A node that is serving.
pub struct RunningNode {
    local_addr: SocketAddr,
    base_dir: PathBuf,
    state: Arc<NodeState>,
    cancel: CancellationToken,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    _lock: std::fs::File,
}

impl RunningNode {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
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
        for partition in &self.state.partitions {
            partition.shutdown().await;
        }
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

    let repository = Arc::new(open_repository(&config, &base_dir)?);
    let snapshots = SnapshotProducer::new(
        repository.clone(),
        base_dir.join("db-snapshots"),
        cluster.cluster_name.clone(),
        node.0.clone(),
    );
    snapshots
        .remove_leftover_exports()
        .context("remove leftover snapshot exports")?;
    let tmp_dir = base_dir.join("tmp");
    let _ = std::fs::remove_dir_all(&tmp_dir);
    std::fs::create_dir_all(&tmp_dir).with_context(|| format!("create {}", tmp_dir.display()))?;

    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let mut partitions = Vec::with_capacity(usize::from(cluster.num_partitions));
    for p in 0..cluster.num_partitions {
        let id = PartitionId(p);
        let store = stores.open_or_create_partition(id)?;
        let log = logs.open(LogId::from(id)).await?;
        let range = KeyRange::of_partition(id, cluster.num_partitions);
        partitions.push(Partition::start(
            range,
            node.clone(),
            store,
            log,
            clock.clone(),
        )?);
    }

    let (table_version, table) = take_leadership(metadata.as_ref(), &node, &partitions).await?;
    let results = futures::future::join_all(partitions.iter().map(|partition| {
        let epoch = table.partitions[&partition.id()].epoch;
        async move { (partition.id(), partition.become_leader(epoch).await) }
    }))
    .await;
    for (id, result) in results {
        if let Err(err) = result {
            error!(partition = %id, "partition is not serving: {err}");
        }
    }

    let state = Arc::new(NodeState {
        cluster: cluster.clone(),
        node: node.clone(),
        partitions,
        table_version: AtomicU64::new(table_version),
        snapshots,
        archived_lsn: Mutex::new(HashMap::new()),
        tmp_dir,
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
    Ok(RunningNode {
        local_addr,
        base_dir,
        state,
        cancel,
        server,
        _lock: lock,
    })
}

/// The snapshot repository of `[worker.snapshots]`: by default `<base-dir>/pp-snapshots`.
fn open_repository(
    config: &Config,
    base_dir: &std::path::Path,
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
    let repository = SnapshotRepository::open(&destination, options)
        .context("open the snapshot repository (worker.snapshots.destination)")?;
    info!(destination = %repository.destination(), "snapshot repository");
    Ok(repository)
}

/// One process per base dir: a second node on the same data would corrupt it.
fn lock_base_dir(base_dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
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

/// Records this node as leader of every partition at an epoch newer than any the table or the
/// stores have seen, so that records of any earlier incarnation are fenced.
async fn take_leadership(
    metadata: &dyn MetadataStore,
    node: &NodeId,
    partitions: &[Arc<Partition>],
) -> anyhow::Result<(u64, PartitionTable)> {
    let (version, mut table) = match get_typed::<PartitionTable>(
        metadata,
        PartitionTable::KEY,
        "partition table",
    )
    .await?
    {
        Some((version, table)) => (Some(version), table),
        None => (None, PartitionTable::default()),
    };
    for partition in partitions {
        let status = partition.status().await;
        let seen = status.leader.map(|l| l.epoch).unwrap_or_default();
        let placement = table
            .partitions
            .entry(partition.id())
            .or_insert(PartitionPlacement {
                leader: None,
                epoch: Default::default(),
            });
        placement.epoch = cairn_types::Epoch(placement.epoch.max(seen).0 + 1);
        placement.leader = Some(node.clone());
    }
    let precondition = version.map_or(Precondition::DoesNotExist, Precondition::MatchesVersion);
    let version = put_typed(metadata, PartitionTable::KEY, &table, precondition).await?;
    Ok((version, table))
}
