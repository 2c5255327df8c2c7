//! Configuration: built-in defaults, then a TOML file, then `CAIRN_…` environment variables, then
//! command-line flags, each overriding the one before.
//!
//! Keys are kebab-case. An environment variable names a key by its path in upper case, with `__`
//! between sections and `_` for `-`: `[worker] snapshot-restore-policy` is
//! `CAIRN_WORKER__SNAPSHOT_RESTORE_POLICY`, `base-dir` is `CAIRN_BASE_DIR`.
//!
//! A setting that a library crate also has (the log's segment size, the block cache, the
//! repository's transfer settings, the orphan grace period) takes its default from that crate's
//! `Default`, so the two never diverge; only the node's own settings have defaults here.

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Config {
    /// Name of the cluster; recorded when the cluster is created and checked on every start.
    pub cluster_name: String,
    /// Name of this node.
    pub node_name: String,
    /// Where the node keeps everything it stores.
    pub base_dir: PathBuf,
    /// Address of the gRPC port (the key-value and admin services).
    pub bind_address: SocketAddr,
    /// gRPC connections open at once, at most; one more is closed as soon as it is accepted.
    /// Lowered at start, with `resp.max-clients`, to what the open-files limit leaves after the
    /// node's own files.
    pub max_connections: usize,
    /// Where other nodes and clients reach this node's gRPC port (`host:port`), in a cluster.
    /// Unset: `bind-address`, which must then not be a wildcard address.
    pub advertised_address: Option<String>,
    pub cluster: ClusterConfig,
    /// Number of partitions, fixed when the cluster is created.
    pub num_partitions: u16,
    pub log: LogConfig,
    pub metadata: MetadataConfig,
    pub nats: NatsConfig,
    pub partition_store: PartitionStoreConfig,
    pub worker: WorkerConfig,
    pub metrics: MetricsConfig,
    pub resp: RespConfig,
}

/// The Redis-protocol port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct RespConfig {
    /// Address of the port that speaks the Redis protocol (RESP2 and RESP3); `"none"`: no port.
    #[serde(with = "address_or_none")]
    pub bind_address: Option<SocketAddr>,
    /// Clients connected at once, at most; one more is told `-ERR max number of clients reached`.
    /// Lowered at start, with `max-connections`, to what the open-files limit leaves after the
    /// node's own files, as Redis lowers its `maxclients`.
    pub max_clients: usize,
}

impl Default for RespConfig {
    fn default() -> Self {
        RespConfig {
            bind_address: Some(SocketAddr::from(([127, 0, 0, 1], 6380))),
            max_clients: 10_000,
        }
    }
}

/// An address, or the word `none` for no port.
mod address_or_none {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::net::SocketAddr;

    pub fn serialize<S: Serializer>(address: &Option<SocketAddr>, s: S) -> Result<S::Ok, S::Error> {
        match address {
            Some(address) => s.serialize_str(&address.to_string()),
            None => s.serialize_str("none"),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
        let text = String::deserialize(d)?;
        if text.eq_ignore_ascii_case("none") {
            return Ok(None);
        }
        text.parse().map(Some).map_err(|_| {
            serde::de::Error::custom(format!(
                "{text:?} is not an address; give host:port with an IP address (e.g. \
                 127.0.0.1:6380), or \"none\" for no such port"
            ))
        })
    }
}

/// How a cluster places its partitions (`[log] provider = "nats"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Nodes a new cluster waits for before it places its partitions.
    pub initial_nodes: usize,
    /// Followers of each partition, on nodes other than its leader's, ready to take over.
    pub standbys: usize,
    /// A node whose heartbeats have not changed its record for this long, as another node's
    /// clock measures it, is dead and its partitions move to their followers; a leader stops
    /// serving two thirds of it after its last successful heartbeat.
    #[serde(with = "humantime_req")]
    pub node_timeout: Duration,
    /// Whether the controller rebalances by itself when the nodes that serve change (a node
    /// joined, or one died and its leaderships went to others): it runs the scaling operation
    /// that `cairnctl cluster scale` runs, on every serving node. Off: a node that joins gets
    /// nothing until an operator scales.
    pub auto_rebalance: bool,
    /// How long a node keeps the local store of a partition that the placement has put on other
    /// nodes only (a scaling operation moved it away, or others took it over while this node
    /// was judged dead) before it deletes it. A move reverted within it catches up from the
    /// store instead of loading a snapshot.
    #[serde(with = "humantime_req")]
    pub drop_moved_after: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            initial_nodes: 1,
            standbys: 1,
            node_timeout: cairn_controller::Timing::DEFAULT_NODE_TIMEOUT,
            auto_rebalance: false,
            drop_moved_after: Duration::from_secs(600),
        }
    }
}

/// The node timeout's bounds: below a second, a busy machine's heartbeat would miss it; above a
/// minute, a dead node's partitions would wait that long.
const NODE_TIMEOUT_MIN: Duration = Duration::from_millis(600);
const NODE_TIMEOUT_MAX: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct MetadataConfig {
    /// `local`: one file in the base dir, for a single node. `nats`: a JetStream key-value bucket
    /// named after the cluster, on the servers of `[nats]`.
    pub provider: MetadataProviderKind,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MetadataProviderKind {
    #[default]
    Local,
    Nats,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct NatsConfig {
    /// NATS servers with JetStream, `nats://host:port`; any of them will do.
    pub servers: Vec<String>,
    /// JetStream replicas of what Cairn keeps there: 3 on a cluster of NATS servers, 1 on one.
    pub replicas: usize,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            servers: vec!["nats://127.0.0.1:4222".into()],
            replicas: 3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address of the HTTP port that serves Prometheus metrics at `/metrics`; `"none"`: no port.
    #[serde(with = "address_or_none")]
    pub bind_address: Option<SocketAddr>,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            bind_address: Some(SocketAddr::from(([127, 0, 0, 1], 5123))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct LogConfig {
    /// `local`: an embedded log in the base dir, for a single node. `nats`: one JetStream
    /// stream per partition on the servers of `[nats]`, for a cluster.
    pub provider: LogProviderKind,
    /// Size at which the local log starts a new segment file, in bytes.
    pub segment_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogProviderKind {
    Local,
    Nats,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct PartitionStoreConfig {
    /// Block cache shared by all partitions, in bytes.
    pub block_cache_bytes: usize,
    /// How much of each partition's newest writes is held in memory before it is flushed to one
    /// file, in bytes; it fills sixteen memtables of a sixteenth of it, and up to twice as much
    /// is in memory while a flush runs.
    pub write_buffer_bytes: usize,
    /// What every partition's memtables may hold in all, in bytes: past seven eighths of it a
    /// partition that writes flushes early. 0: no bound beyond each partition's own.
    pub write_buffer_budget_bytes: usize,
    /// How each partition's tables are merged as they accumulate; a store written under one
    /// style opens under the other.
    pub compaction_style: CompactionStyle,
    /// Size of the tables' data blocks before compression, in bytes; tables already written
    /// keep theirs.
    pub block_bytes: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CompactionStyle {
    /// Sorted runs of about the same size merged together: less rewriting under steady writes;
    /// a merge that takes in a partition's oldest data needs as much free disk again as that
    /// partition holds.
    Universal,
    /// Levels each ten times the one above: less disk held while a merge runs.
    Leveled,
}

impl CompactionStyle {
    /// The partition store's equivalent.
    pub fn for_store(self) -> cairn_partition_store::CompactionStyle {
        match self {
            CompactionStyle::Universal => cairn_partition_store::CompactionStyle::Universal,
            CompactionStyle::Leveled => cairn_partition_store::CompactionStyle::Leveled,
        }
    }

    /// The style the partition store defaults to.
    fn store_default() -> CompactionStyle {
        match cairn_partition_store::StoreOptions::default().compaction_style {
            cairn_partition_store::CompactionStyle::Universal => CompactionStyle::Universal,
            cairn_partition_store::CompactionStyle::Leveled => CompactionStyle::Leveled,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// What a partition with no local store does at start: `none` replays its log from the
    /// start; `on-init` restores the latest suitable snapshot first, then replays the rest. A
    /// partition whose log is trimmed past its store restores whatever this says.
    pub snapshot_restore_policy: RestorePolicy,
    /// How often each partition's log is trimmed to its archived LSN (what the oldest retained
    /// snapshot covers), e.g. `"10m"`. Unset: the log is trimmed only on request.
    #[serde(with = "humantime_opt")]
    pub trim_log_interval: Option<Duration>,
    /// How long an archived LSN must have been archived before automatic trimming uses it, so a
    /// lagging reader of the log has time to catch up, e.g. `"1h"`.
    #[serde(with = "humantime_req")]
    pub trim_log_delay: Duration,
    /// Threads that apply the partitions' logs to their stores, shared by every partition the
    /// node holds; 0: twice the CPUs, at least 4.
    pub apply_threads: usize,
    pub snapshots: SnapshotsConfig,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            snapshot_restore_policy: RestorePolicy::Auto,
            trim_log_interval: None,
            trim_log_delay: Duration::ZERO,
            apply_threads: 0,
            snapshots: SnapshotsConfig::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestorePolicy {
    /// `on-init` in a cluster (a node that gets a partition it has no store of restores the
    /// newest snapshot rather than replay the whole log), `none` alone.
    Auto,
    None,
    OnInit,
}

impl RestorePolicy {
    /// Whether a partition with no store restores a snapshot first.
    pub fn restores_on_init(self, cluster: bool) -> bool {
        match self {
            RestorePolicy::Auto => cluster,
            RestorePolicy::None => false,
            RestorePolicy::OnInit => true,
        }
    }
}

/// The value of `worker.snapshots.destination` that turns snapshots off.
pub const NO_DESTINATION: &str = "none";

/// Where partition snapshots go and how they get there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct SnapshotsConfig {
    /// `file:///path`, a path, or `s3://bucket/prefix`. Unset: `<base-dir>/pp-snapshots`.
    /// `"none"`: no snapshots (nor restores). S3 credentials come from the standard AWS chain
    /// (environment, profile, instance metadata).
    pub destination: Option<String>,
    /// S3-compatible servers: the endpoint URL, e.g. `http://127.0.0.1:9000`.
    pub endpoint_url: Option<String>,
    pub region: Option<String>,
    /// Allow `http://` endpoints.
    pub allow_http: bool,
    /// Files uploaded at once.
    pub upload_concurrency: usize,
    /// Files larger than this are uploaded in parts.
    pub multipart_threshold_bytes: u64,
    /// Cap on the bandwidth of snapshot transfers, uploads and downloads (a restore, a load, a
    /// move's catch-up from a snapshot) together, in bytes per second. Unset: no cap.
    pub rate_limit_bytes_per_second: Option<u64>,
    /// Snapshots kept per partition; older ones and the files only they use are deleted.
    pub num_retained: usize,
    /// Objects in the repository that no snapshot references (left by a crash mid-publish) are
    /// deleted once they are this old, e.g. `"1h"`.
    #[serde(with = "humantime_req")]
    pub orphan_grace_period: Duration,
    /// Snapshot every partition this often, e.g. `"30m"`. Unset: only on request.
    #[serde(with = "humantime_opt")]
    pub snapshot_interval: Option<Duration>,
    /// Snapshot a partition once this many records were applied since its last snapshot.
    pub snapshot_interval_num_records: Option<u64>,
    /// Automatic snapshots that may run at once on this node.
    pub max_concurrent_snapshots: usize,
}

impl Default for SnapshotsConfig {
    fn default() -> Self {
        let repository = cairn_snapshots::RepositoryOptions::default();
        SnapshotsConfig {
            destination: None,
            endpoint_url: repository.endpoint_url,
            region: repository.region,
            allow_http: repository.allow_http,
            upload_concurrency: repository.upload_concurrency,
            multipart_threshold_bytes: repository.multipart_threshold_bytes,
            rate_limit_bytes_per_second: repository.rate_limit_bytes_per_second,
            num_retained: 5,
            orphan_grace_period: cairn_snapshots::DEFAULT_ORPHAN_GRACE,
            snapshot_interval: None,
            snapshot_interval_num_records: None,
            max_concurrent_snapshots: 2,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            cluster_name: "cairn".into(),
            node_name: "n1".into(),
            base_dir: PathBuf::from("cairn-data"),
            bind_address: SocketAddr::from(([127, 0, 0, 1], 5122)),
            max_connections: 10_000,
            advertised_address: None,
            cluster: ClusterConfig::default(),
            num_partitions: 16,
            log: LogConfig::default(),
            metadata: MetadataConfig::default(),
            nats: NatsConfig::default(),
            partition_store: PartitionStoreConfig::default(),
            worker: WorkerConfig::default(),
            metrics: MetricsConfig::default(),
            resp: RespConfig::default(),
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            provider: LogProviderKind::Local,
            segment_bytes: cairn_log::local::LocalLogOptions::default().segment_bytes_max,
        }
    }
}

/// The bounds of `partition-store.block-bytes`: below 1 KiB, a block's index entry and checksum
/// outweigh what it holds; above 1 MiB, a point lookup that misses the cache reads and
/// decompresses all of it.
const BLOCK_BYTES_MIN: usize = 1024;
const BLOCK_BYTES_MAX: usize = 1024 * 1024;

impl Default for PartitionStoreConfig {
    fn default() -> Self {
        PartitionStoreConfig {
            block_cache_bytes: cairn_partition_store::StoreOptions::default().block_cache_bytes,
            write_buffer_bytes: cairn_partition_store::StoreOptions::default().write_buffer_bytes,
            write_buffer_budget_bytes: cairn_partition_store::StoreOptions::default()
                .write_buffer_budget_bytes,
            compaction_style: CompactionStyle::store_default(),
            block_bytes: cairn_partition_store::StoreOptions::default().block_bytes,
        }
    }
}

/// Settings given as command-line flags; they override everything else.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct Overrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_dir: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bind_address: Option<SocketAddr>,
}

/// A configuration the node refuses to start with. The message names the key and the fix.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);

impl Config {
    /// Loads the configuration from defaults, `file` (if given), the environment and `overrides`.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        Self::load_from_env(file, overrides, Env::prefixed("CAIRN_"))
    }

    fn load_from_env(
        file: Option<&Path>,
        overrides: &Overrides,
        env: Env,
    ) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(file) = file {
            if !file.is_file() {
                return Err(ConfigError(format!(
                    "config file {} does not exist; pass an existing TOML file to --config",
                    file.display()
                )));
            }
            figment = figment.merge(Toml::file_exact(file));
        }
        let env = env
            // A crash-test hook read by the worker, not a setting.
            .ignore(&["pause_at"])
            .split("__")
            .map(|key| key.as_str().replace('_', "-").into());
        let config: Config = figment
            .merge(env)
            .merge(Serialized::defaults(overrides))
            .extract()
            .map_err(|err| ConfigError(describe_figment_error(err)))?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let name_ok = valid_name;
        if !name_ok(&self.node_name) {
            return Err(ConfigError(format!(
                "node-name {:?} is invalid: use 1 to 64 letters, digits, '-', '_' or '.'",
                self.node_name
            )));
        }
        if !name_ok(&self.cluster_name) {
            return Err(ConfigError(format!(
                "cluster-name {:?} is invalid: use 1 to 64 letters, digits, '-', '_' or '.'",
                self.cluster_name
            )));
        }
        if self.num_partitions == 0 || self.num_partitions > 4096 {
            return Err(ConfigError(format!(
                "num-partitions is {}: it must be between 1 and 4096",
                self.num_partitions
            )));
        }
        if self.worker.apply_threads > 1024 {
            return Err(ConfigError(format!(
                "worker.apply-threads is {}: it must be at most 1024 (0: twice the CPUs)",
                self.worker.apply_threads
            )));
        }
        let snapshots = &self.worker.snapshots;
        if snapshots.upload_concurrency == 0 || snapshots.upload_concurrency > 256 {
            return Err(ConfigError(format!(
                "worker.snapshots.upload-concurrency is {}: it must be between 1 and 256",
                snapshots.upload_concurrency
            )));
        }
        if snapshots.multipart_threshold_bytes < 5 * 1024 * 1024 {
            return Err(ConfigError(format!(
                "worker.snapshots.multipart-threshold-bytes is {}: it must be at least 5242880 (5 MiB, the smallest S3 part)",
                snapshots.multipart_threshold_bytes
            )));
        }
        if snapshots.rate_limit_bytes_per_second == Some(0) {
            return Err(ConfigError(
                "worker.snapshots.rate-limit-bytes-per-second is 0: give a positive rate, or leave it unset for no limit".into(),
            ));
        }
        if let Some(destination) = &snapshots.destination
            && !(destination.starts_with("file://")
                || destination.starts_with("s3://")
                || destination.starts_with('/')
                || destination == NO_DESTINATION)
        {
            return Err(ConfigError(format!(
                "worker.snapshots.destination {:?} is not supported: use file:///path, an absolute path, s3://bucket/prefix, or \"none\" for no snapshots",
                redact_credentials(destination)
            )));
        }
        if let Some(endpoint) = &snapshots.endpoint_url {
            check_endpoint_url(endpoint)?;
        }
        if snapshots.num_retained == 0 {
            return Err(ConfigError(
                "worker.snapshots.num-retained is 0: keep at least 1 snapshot per partition".into(),
            ));
        }
        if snapshots.max_concurrent_snapshots == 0 {
            return Err(ConfigError(
                "worker.snapshots.max-concurrent-snapshots is 0: allow at least 1".into(),
            ));
        }
        if snapshots.snapshot_interval == Some(Duration::ZERO)
            || snapshots.snapshot_interval_num_records == Some(0)
            || self.worker.trim_log_interval == Some(Duration::ZERO)
        {
            return Err(ConfigError(
                "worker.snapshots.snapshot-interval, worker.snapshots.snapshot-interval-num-records and worker.trim-log-interval must be positive; leave them unset to turn them off".into(),
            ));
        }
        if !self.snapshots_enabled() {
            let automatic = [
                (
                    "worker.snapshots.snapshot-interval",
                    snapshots.snapshot_interval.is_some(),
                ),
                (
                    "worker.snapshots.snapshot-interval-num-records",
                    snapshots.snapshot_interval_num_records.is_some(),
                ),
                (
                    "worker.trim-log-interval",
                    self.worker.trim_log_interval.is_some(),
                ),
            ];
            if let Some((key, _)) = automatic.iter().find(|(_, set)| *set) {
                return Err(ConfigError(format!(
                    "{key} is set but there is no snapshot repository (worker.snapshots.destination = \"none\"): set a destination, or remove {key}"
                )));
            }
        }
        if self.log.segment_bytes < 1024 * 1024 {
            return Err(ConfigError(format!(
                "log.segment-bytes is {}: it must be at least 1048576 (1 MiB)",
                self.log.segment_bytes
            )));
        }
        if self.log.provider == LogProviderKind::Nats {
            if self.metadata.provider != MetadataProviderKind::Nats {
                return Err(ConfigError(
                    "log.provider is \"nats\" but metadata.provider is not: a cluster keeps its logs and its metadata in NATS, set [metadata] provider = \"nats\" too".into(),
                ));
            }
            if self.advertised_address.is_none() && self.bind_address.ip().is_unspecified() {
                return Err(ConfigError(format!(
                    "bind-address {} listens on every interface, so it says nothing about where the other nodes reach this one: set advertised-address (CAIRN_ADVERTISED_ADDRESS) to this node's host:port",
                    self.bind_address
                )));
            }
            let timeout = self.cluster.node_timeout;
            if !(NODE_TIMEOUT_MIN..=NODE_TIMEOUT_MAX).contains(&timeout) {
                return Err(ConfigError(format!(
                    "cluster.node-timeout is {}: it must be from {} to {} (the default is {})",
                    humantime::format_duration(timeout),
                    humantime::format_duration(NODE_TIMEOUT_MIN),
                    humantime::format_duration(NODE_TIMEOUT_MAX),
                    humantime::format_duration(cairn_controller::Timing::DEFAULT_NODE_TIMEOUT)
                )));
            }
            if self.cluster.initial_nodes == 0 {
                return Err(ConfigError(
                    "cluster.initial-nodes is 0: a cluster waits for at least 1 node before it places its partitions".into(),
                ));
            }
            if self.worker.snapshots.destination.is_none() {
                return Err(ConfigError(format!(
                    "log.provider is \"nats\" (a cluster) but worker.snapshots.destination is unset, so each node would keep its snapshots in its own base dir ({}) where the others cannot restore them: set [worker.snapshots] destination to a repository every node reaches (\"s3://bucket/prefix\", or a folder they all see), or to \"none\"",
                    self.base_dir.join("pp-snapshots").display()
                )));
            }
        }
        if self.metadata.provider == MetadataProviderKind::Nats {
            if self.nats.servers.is_empty() {
                return Err(ConfigError(
                    "metadata.provider is \"nats\" but nats.servers is empty: list the NATS servers, e.g. servers = [\"nats://127.0.0.1:4222\"]".into(),
                ));
            }
            if !(1..=5).contains(&self.nats.replicas) {
                return Err(ConfigError(format!(
                    "nats.replicas is {}: JetStream keeps 1 to 5 replicas (1 for a single NATS server, 3 for a cluster of them)",
                    self.nats.replicas
                )));
            }
        }
        if self.max_connections == 0 {
            return Err(ConfigError(
                "max-connections is 0: the gRPC port must take at least 1 connection (the default \
                 is 10000)"
                    .into(),
            ));
        }
        if self.resp.max_clients == 0 {
            return Err(ConfigError(
                "resp.max-clients is 0: it must be at least 1 (Redis's default is 10000); set \
                 resp.bind-address = \"none\" for no Redis port"
                    .into(),
            ));
        }
        if self.partition_store.write_buffer_bytes < 1024 * 1024 {
            return Err(ConfigError(format!(
                "partition-store.write-buffer-bytes is {}: it must be at least 1048576 (1 MiB)",
                self.partition_store.write_buffer_bytes
            )));
        }
        let block_bytes = self.partition_store.block_bytes;
        if !(BLOCK_BYTES_MIN..=BLOCK_BYTES_MAX).contains(&block_bytes) {
            return Err(ConfigError(format!(
                "partition-store.block-bytes is {block_bytes}: it must be from {BLOCK_BYTES_MIN} \
                 (1 KiB) to {BLOCK_BYTES_MAX} (1 MiB); the default is {}",
                cairn_partition_store::StoreOptions::default().block_bytes
            )));
        }
        Ok(())
    }
}

impl Config {
    /// Whether this node is one of a cluster: its logs and metadata in NATS, its partitions
    /// placed by the controller.
    pub fn cluster_mode(&self) -> bool {
        self.log.provider == LogProviderKind::Nats
    }

    /// Whether the node has a snapshot repository.
    pub fn snapshots_enabled(&self) -> bool {
        self.worker.snapshots.destination.as_deref() != Some(NO_DESTINATION)
    }
}

/// `worker.snapshots.endpoint-url` must be a plain `http(s)://host[:port][/path]`. Credentials
/// in it would be shown in every request error that object_store reports (and one with a `/`
/// makes its request signer panic), so they are refused, redacted, like a destination's.
fn check_endpoint_url(endpoint: &str) -> Result<(), ConfigError> {
    let refused = |reason: &str| {
        ConfigError(format!(
            "worker.snapshots.endpoint-url {:?} {reason}",
            redact_credentials(endpoint)
        ))
    };
    let Some((_, rest)) = endpoint.split_once("://") else {
        // Not shown: what is not a URL cannot be told apart from a pasted secret.
        return Err(ConfigError(
            "worker.snapshots.endpoint-url is not a URL; write it like http://127.0.0.1:9000"
                .into(),
        ));
    };
    if redact_credentials(endpoint).contains("***") || rest.contains('@') {
        return Err(refused(
            "holds credentials or a query; give the bare URL (http://host:port) and the \
             credentials in the AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE)",
        ));
    }
    match url::Url::parse(endpoint) {
        Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => Ok(()),
        Ok(_) => Err(refused(
            "is not an http:// or https:// URL with a host; write it like http://127.0.0.1:9000",
        )),
        Err(e) => Err(refused(&format!(
            "is not a URL ({e}); write it like http://127.0.0.1:9000"
        ))),
    }
}

/// `destination` with the user info (`id:secret@`) and the query of its URL replaced by `***`,
/// for messages and logs: a destination is never echoed with credentials. The repository's own
/// rule, so that the configuration check and the repository redact alike.
pub fn redact_credentials(destination: &str) -> String {
    cairn_snapshots::redact_destination(destination)
}

/// Durations written as `"90s"`, `"10m"`, `"1h 30m"`.
mod humantime_req {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(value: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*value).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        parse(&String::deserialize(d)?)
    }

    pub fn parse<E: serde::de::Error>(text: &str) -> Result<Duration, E> {
        humantime::parse_duration(text).map_err(|e| {
            E::custom(format!(
                "{text:?} is not a duration ({e}); write it like \"90s\", \"10m\" or \"1h\""
            ))
        })
    }
}

/// Like [`humantime_req`], for settings that may be unset.
mod humantime_opt {
    use serde::{Deserializer, Serializer};

    use std::time::Duration;

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(value) => super::humantime_req::serialize(value, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        use serde::Deserialize;
        Option::<String>::deserialize(d)?
            .map(|text| super::humantime_req::parse::<D::Error>(&text))
            .transpose()
    }
}

/// One sentence per problem, naming the key and where its value came from.
fn describe_figment_error(err: figment::Error) -> String {
    err.into_iter()
        .map(|e| {
            let key = if e.path.is_empty() {
                String::new()
            } else {
                format!("key `{}`: ", e.path.join("."))
            };
            let source = e
                .metadata
                .as_ref()
                .map(|m| match &m.source {
                    Some(src) => format!(" (from {src})"),
                    None => format!(" (from {})", m.name),
                })
                .unwrap_or_default();
            format!("invalid configuration: {key}{}{source}", e.kind)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether `name` may name a node or a cluster: 1 to 64 letters, digits, '-', '_' or '.'.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
}

#[cfg(test)]
// `Jail`'s closures return figment's own large error type.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use figment::Jail;

    fn load(file: Option<&str>) -> Result<Config, ConfigError> {
        Config::load(file.map(Path::new), &Overrides::default())
    }

    #[test]
    fn defaults_run_a_single_node_under_cairn_data() {
        Jail::expect_with(|_| {
            let config = load(None).unwrap();
            assert_eq!(config, Config::default());
            assert_eq!(config.base_dir, PathBuf::from("cairn-data"));
            assert!(config.num_partitions >= 16);
            assert!(config.bind_address.ip().is_loopback());
            Ok(())
        });
    }

    #[test]
    fn file_then_env_then_flags_override() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "cairn.toml",
                "cluster-name = \"prod\"\nnode-name = \"a\"\nnum-partitions = 8\n[log]\nsegment-bytes = 2097152\n",
            )?;
            jail.set_env("CAIRN_NODE_NAME", "b");
            jail.set_env("CAIRN_LOG__SEGMENT_BYTES", "4194304");
            let config = load(Some("cairn.toml")).unwrap();
            assert_eq!(config.cluster_name, "prod");
            assert_eq!(config.node_name, "b");
            assert_eq!(config.num_partitions, 8);
            assert_eq!(config.log.segment_bytes, 4 * 1024 * 1024);
            let overrides = Overrides {
                node_name: Some("c".into()),
                ..Overrides::default()
            };
            let config = Config::load(Some(Path::new("cairn.toml")), &overrides).unwrap();
            assert_eq!(config.node_name, "c");
            Ok(())
        });
    }

    #[test]
    fn durations_and_the_restore_policy_parse() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "cairn.toml",
                "[worker]\nsnapshot-restore-policy = \"on-init\"\ntrim-log-interval = \"10m\"\n[worker.snapshots]\nsnapshot-interval = \"1h 30m\"\n",
            )?;
            let config = load(Some("cairn.toml")).unwrap();
            assert_eq!(config.worker.snapshot_restore_policy, RestorePolicy::OnInit);
            assert_eq!(
                config.worker.trim_log_interval,
                Some(Duration::from_secs(600))
            );
            assert_eq!(
                config.worker.snapshots.snapshot_interval,
                Some(Duration::from_secs(5400))
            );
            jail.set_env("CAIRN_WORKER__TRIM_LOG_DELAY", "soon");
            let err = load(Some("cairn.toml")).unwrap_err().to_string();
            assert!(
                err.contains("trim-log-delay") && err.contains("soon"),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    fn the_compaction_style_parses_and_a_wrong_one_names_the_choices() {
        Jail::expect_with(|jail| {
            let config = load(None).unwrap();
            assert_eq!(
                config.partition_store.compaction_style,
                CompactionStyle::Universal
            );
            jail.create_file(
                "cairn.toml",
                "[partition-store]\ncompaction-style = \"leveled\"\n",
            )?;
            let config = load(Some("cairn.toml")).unwrap();
            assert_eq!(
                config.partition_store.compaction_style.for_store(),
                cairn_partition_store::CompactionStyle::Leveled
            );
            jail.set_env("CAIRN_PARTITION_STORE__COMPACTION_STYLE", "tiered");
            let err = load(Some("cairn.toml")).unwrap_err().to_string();
            assert!(
                err.contains("compaction-style")
                    && err.contains("tiered")
                    && err.contains("universal")
                    && err.contains("leveled"),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    fn the_block_size_is_taken_within_its_bounds() {
        Jail::expect_with(|jail| {
            assert_eq!(load(None).unwrap().partition_store.block_bytes, 16 * 1024);
            jail.create_file("cairn.toml", "[partition-store]\nblock-bytes = 4096\n")?;
            let config = load(Some("cairn.toml")).unwrap();
            assert_eq!(config.partition_store.block_bytes, 4096);
            jail.set_env("CAIRN_PARTITION_STORE__BLOCK_BYTES", "512");
            let err = load(Some("cairn.toml")).unwrap_err().to_string();
            assert!(
                err.contains("partition-store.block-bytes is 512")
                    && err.contains("1024")
                    && err.contains("1048576")
                    && err.contains("16384"),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    fn automatic_snapshots_need_a_repository() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "cairn.toml",
                "[worker.snapshots]\ndestination = \"none\"\nsnapshot-interval-num-records = 1000\n",
            )?;
            let err = load(Some("cairn.toml")).unwrap_err().to_string();
            assert!(
                err.contains("snapshot-interval-num-records") && err.contains("destination"),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    fn a_refused_destination_is_echoed_without_its_credentials() {
        Jail::expect_with(|jail| {
            jail.set_env(
                "CAIRN_WORKER__SNAPSHOTS__DESTINATION",
                "S3://AKIAEXAMPLE:very-secret@bucket/prefix",
            );
            let err = load(None).unwrap_err().to_string();
            assert!(
                !err.contains("very-secret") && !err.contains("AKIAEXAMPLE"),
                "{err}"
            );
            assert!(err.contains("S3://***@bucket/prefix"), "{err}");
            Ok(())
        });
        assert_eq!(
            redact_credentials("s3://id@bucket/a@b"),
            "s3://***@bucket/a@b"
        );
        assert_eq!(redact_credentials("/data/a@b"), "/data/a@b");
        assert_eq!(redact_credentials("s3://bucket/p"), "s3://bucket/p");
        assert_eq!(
            redact_credentials("s3://bucket/p?secret=x"),
            "s3://bucket/p?***"
        );
        // Secrets with URL delimiters in them go whole.
        for (given, shown) in [
            ("s3://id:se/cr+et@bucket/p", "s3://***@bucket/p"),
            ("S3://id:se#cret@bucket/p", "S3://***@bucket/p"),
            ("s3://id:se?cret@bucket/p?q", "s3://***@bucket/p?***"),
            ("s3://id:se@cret@bucket/p@q", "s3://***@bucket/p@q"),
            ("s3:id:secret@bucket", "***@bucket"),
            ("file:///data/a@b", "file:///data/a@b"),
        ] {
            assert_eq!(redact_credentials(given), shown, "{given}");
        }
    }

    #[test]
    fn a_port_can_be_turned_off_with_none() {
        Jail::expect_with(|jail| {
            jail.set_env("CAIRN_METRICS__BIND_ADDRESS", "none");
            jail.create_file("cairn.toml", "[resp]\nbind-address = \"none\"\n")?;
            let config = load(Some("cairn.toml")).expect("none is no port");
            assert_eq!(config.metrics.bind_address, None);
            assert_eq!(config.resp.bind_address, None);
            jail.set_env("CAIRN_METRICS__BIND_ADDRESS", "localhost:5123");
            let refused = load(None).unwrap_err().to_string();
            assert!(refused.contains("metrics.bind-address"), "{refused}");
            assert!(refused.contains("\"none\" for no such port"), "{refused}");
            Ok(())
        });
    }

    #[test]
    fn client_bounds_of_zero_are_refused() {
        Jail::expect_with(|jail| {
            jail.set_env("CAIRN_MAX_CONNECTIONS", "0");
            let refused = load(None).unwrap_err().to_string();
            assert!(refused.contains("max-connections is 0"), "{refused}");
            jail.set_env("CAIRN_MAX_CONNECTIONS", "5");
            jail.set_env("CAIRN_RESP__MAX_CLIENTS", "0");
            let refused = load(None).unwrap_err().to_string();
            assert!(refused.contains("resp.max-clients is 0"), "{refused}");
            jail.set_env("CAIRN_RESP__MAX_CLIENTS", "7");
            let config = load(None).unwrap();
            assert_eq!((config.max_connections, config.resp.max_clients), (5, 7));
            Ok(())
        });
    }

    #[test]
    fn nats_servers_come_from_the_environment_as_a_list() {
        Jail::expect_with(|jail| {
            jail.set_env(
                "CAIRN_NATS__SERVERS",
                "[\"nats://10.0.0.1:4222\", \"nats://10.0.0.2:4222\"]",
            );
            let config = load(None).expect("a list of servers");
            assert_eq!(
                config.nats.servers,
                vec!["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]
            );
            Ok(())
        });
    }

    #[test]
    fn mistakes_name_the_key() {
        Jail::expect_with(|jail| {
            jail.create_file("typo.toml", "[log]\nsegment-byte = 1\n")?;
            let err = load(Some("typo.toml")).unwrap_err().to_string();
            assert!(err.contains("segment-byte"), "{err}");

            jail.create_file("type.toml", "num-partitions = \"lots\"\n")?;
            let err = load(Some("type.toml")).unwrap_err().to_string();
            assert!(err.contains("num-partitions"), "{err}");

            jail.set_env("CAIRN_LOG__PROVIDER", "kafka");
            let err = load(None).unwrap_err().to_string();
            assert!(
                err.contains("log.provider") && err.contains("kafka"),
                "{err}"
            );
            Ok(())
        });
        Jail::expect_with(|jail| {
            jail.set_env("CAIRN_NODE_NAME", "bad name");
            let err = load(None).unwrap_err().to_string();
            assert!(err.contains("node-name"), "{err}");
            Ok(())
        });
        Jail::expect_with(|jail| {
            jail.create_file(
                "nats.toml",
                "[metadata]\nprovider = \"nats\"\n[nats]\nservers = []\n",
            )?;
            let err = load(Some("nats.toml")).unwrap_err().to_string();
            assert!(err.contains("nats.servers is empty"), "{err}");
            jail.create_file(
                "nats.toml",
                "[metadata]\nprovider = \"nats\"\n[nats]\nreplicas = 0\n",
            )?;
            let err = load(Some("nats.toml")).unwrap_err().to_string();
            assert!(err.contains("nats.replicas is 0"), "{err}");
            // A cluster: logs in NATS need the metadata there and a repository every node sees.
            jail.create_file("cluster.toml", "[log]\nprovider = \"nats\"\n")?;
            let err = load(Some("cluster.toml")).unwrap_err().to_string();
            assert!(err.contains("[metadata] provider = \"nats\""), "{err}");
            jail.create_file(
                "cluster.toml",
                "[log]\nprovider = \"nats\"\n[metadata]\nprovider = \"nats\"\n",
            )?;
            let err = load(Some("cluster.toml")).unwrap_err().to_string();
            assert!(
                err.contains("[worker.snapshots] destination") && err.contains("pp-snapshots"),
                "{err}"
            );
            jail.create_file(
                "cluster.toml",
                "[log]\nprovider = \"nats\"\n[metadata]\nprovider = \"nats\"\n\
                 [worker.snapshots]\ndestination = \"s3://bucket/cairn\"\n",
            )?;
            let config = load(Some("cluster.toml")).expect("a cluster's configuration");
            assert_eq!(config.cluster.node_timeout, Duration::from_secs(3));
            assert_eq!(config.worker.snapshot_restore_policy, RestorePolicy::Auto);
            assert!(config.worker.snapshot_restore_policy.restores_on_init(true));
            assert!(
                !config
                    .worker
                    .snapshot_restore_policy
                    .restores_on_init(false)
            );
            jail.set_env("CAIRN_CLUSTER__NODE_TIMEOUT", "5s");
            assert_eq!(
                load(Some("cluster.toml")).unwrap().cluster.node_timeout,
                Duration::from_secs(5)
            );
            jail.set_env("CAIRN_CLUSTER__NODE_TIMEOUT", "100ms");
            let err = load(Some("cluster.toml")).unwrap_err().to_string();
            assert!(
                err.contains("cluster.node-timeout is 100ms") && err.contains("the default is 3s"),
                "{err}"
            );
            Ok(())
        });
        Jail::expect_with(|jail| {
            jail.set_env("CAIRN_PARTITION_STORE__WRITE_BUFFER_BYTES", "4096");
            let err = load(None).unwrap_err().to_string();
            assert!(
                err.contains("partition-store.write-buffer-bytes") && err.contains("1048576"),
                "{err}"
            );
            Ok(())
        });
    }
}
