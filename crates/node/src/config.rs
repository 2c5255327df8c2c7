//! Configuration: built-in defaults, then a TOML file, then `CAIRN_…` environment variables, then
//! command-line flags, each overriding the one before.
//!
//! Keys are kebab-case. An environment variable names a key by its path in upper case, with `__`
//! between sections and `_` for `-`: `[worker] snapshot-restore-policy` is
//! `CAIRN_WORKER__SNAPSHOT_RESTORE_POLICY`, `base-dir` is `CAIRN_BASE_DIR`.

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Config {
    /// Name of the cluster; recorded when the cluster is created and checked on every start.
    pub cluster_name: String,
    /// Name of this node.
    pub node_name: String,
    /// Where the node keeps everything it stores.
    pub base_dir: PathBuf,
    /// Address of the gRPC port (key-value, admin and node-to-node services).
    pub bind_address: SocketAddr,
    /// Number of partitions, fixed when the cluster is created.
    pub num_partitions: u16,
    pub log: LogConfig,
    pub partition_store: PartitionStoreConfig,
    pub worker: WorkerConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct LogConfig {
    /// `local`: an embedded log in the base dir, for a single node.
    pub provider: LogProviderKind,
    /// Size at which the local log starts a new segment file, in bytes.
    pub segment_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogProviderKind {
    Local,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct PartitionStoreConfig {
    /// Block cache shared by all partitions, in bytes.
    pub block_cache_bytes: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct WorkerConfig {
    pub snapshots: SnapshotsConfig,
}

/// Where partition snapshots go and how they get there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct SnapshotsConfig {
    /// `file:///path`, a path, or `s3://bucket/prefix`. Unset: `<base-dir>/pp-snapshots`.
    /// S3 credentials come from the standard AWS chain (environment, profile, instance metadata).
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
    /// Cap on upload bandwidth for snapshots, in bytes per second. Unset: no cap.
    pub rate_limit_bytes_per_second: Option<u64>,
}

impl Default for SnapshotsConfig {
    fn default() -> Self {
        SnapshotsConfig {
            destination: None,
            endpoint_url: None,
            region: None,
            allow_http: false,
            upload_concurrency: 8,
            multipart_threshold_bytes: 64 * 1024 * 1024,
            rate_limit_bytes_per_second: None,
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
            num_partitions: 16,
            log: LogConfig::default(),
            partition_store: PartitionStoreConfig::default(),
            worker: WorkerConfig::default(),
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            provider: LogProviderKind::Local,
            segment_bytes: 64 * 1024 * 1024,
        }
    }
}

impl Default for PartitionStoreConfig {
    fn default() -> Self {
        PartitionStoreConfig {
            block_cache_bytes: 256 * 1024 * 1024,
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
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 64
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        };
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
                || destination.starts_with('/'))
        {
            return Err(ConfigError(format!(
                "worker.snapshots.destination {destination:?} is not supported: use file:///path, an absolute path, or s3://bucket/prefix"
            )));
        }
        if self.log.segment_bytes < 1024 * 1024 {
            return Err(ConfigError(format!(
                "log.segment-bytes is {}: it must be at least 1048576 (1 MiB)",
                self.log.segment_bytes
            )));
        }
        Ok(())
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
    }
}
