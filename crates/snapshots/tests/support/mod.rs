//! Test support: repositories on each backend (a local folder, moto's S3 server, object_store's
//! in-memory store) and fake RocksDB exports (folders of random files with matching metadata).

#![allow(dead_code)]

pub use cairn_snapshots::test_util::moto;

use cairn_snapshots::{
    ClusterIdentity, MetadataVersion, RepositoryOptions, SnapshotFile, SnapshotId,
    SnapshotMetadata, SnapshotRepository,
};
use cairn_types::{KeyRange, LogId, Lsn, PartitionId};
use rand::{RngCore, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;
use tempfile::TempDir;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Local,
    S3,
    Memory,
}

/// A repository and whatever must live as long as it.
pub struct TestRepo {
    pub repo: SnapshotRepository,
    _dir: Option<Arc<TempDir>>,
    /// How to open another handle on the same storage.
    reopen: Reopen,
}

#[derive(Clone)]
enum Reopen {
    Destination(String, RepositoryOptions),
    Memory(Arc<object_store::memory::InMemory>, RepositoryOptions),
}

impl Reopen {
    fn open(&self, cluster: ClusterIdentity) -> SnapshotRepository {
        match self {
            Reopen::Destination(destination, options) => {
                SnapshotRepository::open(destination, cluster, options.clone()).unwrap()
            }
            Reopen::Memory(store, options) => SnapshotRepository::from_object_store(
                store.clone(),
                "memory://",
                "cluster",
                cluster,
                options.clone(),
            )
            .unwrap(),
        }
    }
}

impl TestRepo {
    /// Another handle on the same storage, opened for `cluster`: what another node or a
    /// re-created cluster sharing the repository sees.
    pub fn for_cluster(&self, cluster: ClusterIdentity) -> TestRepo {
        TestRepo {
            repo: self.reopen.open(cluster),
            _dir: self._dir.clone(),
            reopen: self.reopen.clone(),
        }
    }

    /// Another handle on the same storage whose transfers share a limit of `bytes_per_second`.
    pub fn rate_limited(&self, bytes_per_second: u64) -> TestRepo {
        let limited = |options: &RepositoryOptions| RepositoryOptions {
            rate_limit_bytes_per_second: Some(bytes_per_second),
            ..options.clone()
        };
        let reopen = match &self.reopen {
            Reopen::Destination(destination, options) => {
                Reopen::Destination(destination.clone(), limited(options))
            }
            Reopen::Memory(store, options) => Reopen::Memory(store.clone(), limited(options)),
        };
        TestRepo {
            repo: reopen.open(self.repo.cluster().clone()),
            _dir: self._dir.clone(),
            reopen,
        }
    }

    /// The local repository's folder; `None` for the other backends.
    pub fn local_folder(&self) -> Option<std::path::PathBuf> {
        match &self.reopen {
            Reopen::Destination(destination, _) => destination
                .strip_prefix("file://")
                .map(std::path::PathBuf::from),
            Reopen::Memory(..) => None,
        }
    }
}

impl std::ops::Deref for TestRepo {
    type Target = SnapshotRepository;
    fn deref(&self) -> &SnapshotRepository {
        &self.repo
    }
}

/// The cluster the tests' repositories and exports belong to.
pub fn cluster() -> ClusterIdentity {
    ClusterIdentity::new("test-cluster", "2026-01-01T00:00:00.000Z")
}

/// Another cluster of the same name: one re-created on a reset base dir.
pub fn recreated_cluster() -> ClusterIdentity {
    ClusterIdentity::new("test-cluster", "2026-06-01T00:00:00.000Z")
}

pub fn repository(backend: Backend) -> TestRepo {
    repository_with(backend, RepositoryOptions::default())
}

pub fn repository_with(backend: Backend, options: RepositoryOptions) -> TestRepo {
    repository_for(backend, cluster(), options)
}

/// A repository opened for `cluster`.
pub fn repository_for(
    backend: Backend,
    cluster: ClusterIdentity,
    options: RepositoryOptions,
) -> TestRepo {
    match backend {
        Backend::Local => {
            let dir = tempfile::tempdir().unwrap();
            let destination = format!("file://{}/snapshots", dir.path().display());
            let repo = SnapshotRepository::open(&destination, cluster, options.clone()).unwrap();
            TestRepo {
                repo,
                _dir: Some(Arc::new(dir)),
                reopen: Reopen::Destination(destination, options),
            }
        }
        Backend::S3 => {
            let server = moto::server();
            let bucket = server.create_bucket();
            let options = server.repository_options(options);
            let destination = format!("s3://{bucket}/cluster/one");
            let repo = SnapshotRepository::open(&destination, cluster, options.clone()).unwrap();
            TestRepo {
                repo,
                _dir: None,
                reopen: Reopen::Destination(destination, options),
            }
        }
        Backend::Memory => {
            let store = Arc::new(object_store::memory::InMemory::new());
            let repo = SnapshotRepository::from_object_store(
                store.clone(),
                "memory://",
                "cluster",
                cluster,
                options.clone(),
            )
            .unwrap();
            TestRepo {
                repo,
                _dir: None,
                reopen: Reopen::Memory(store, options),
            }
        }
    }
}

pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
    bytes
}

/// A fake column family export: files in a folder and the metadata RocksDB would report.
pub struct Export {
    pub dir: TempDir,
    pub metadata: SnapshotMetadata,
    /// File name (without the leading slash) → content.
    pub contents: BTreeMap<String, Vec<u8>>,
}

impl Export {
    pub fn id(&self) -> SnapshotId {
        self.metadata.snapshot_id
    }

    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    pub fn size_of(&self, names: &[&str]) -> u64 {
        names.iter().map(|n| self.contents[*n].len() as u64).sum()
    }
}

/// An export of partition `partition` at `lsn` with the given files (`("000001.sst", bytes)`),
/// taken by [`cluster`].
pub fn export(partition: u16, lsn: u64, files: &[(&str, Vec<u8>)]) -> Export {
    export_of(&cluster(), partition, lsn, files)
}

/// [`export`] taken by `cluster`.
pub fn export_of(
    cluster: &ClusterIdentity,
    partition: u16,
    lsn: u64,
    files: &[(&str, Vec<u8>)],
) -> Export {
    let dir = tempfile::tempdir().unwrap();
    let snapshot_id = SnapshotId::generate();
    let mut metadata_files = Vec::new();
    let mut contents = BTreeMap::new();
    for (level, (name, bytes)) in files.iter().enumerate() {
        std::fs::write(dir.path().join(name), bytes).unwrap();
        contents.insert(name.to_string(), bytes.clone());
        metadata_files.push(SnapshotFile {
            column_family_name: format!("data-{partition}"),
            name: format!("/{name}"),
            directory: dir.path().display().to_string(),
            size: bytes.len() as u64,
            level: level as i32,
            start_key: "64650000000000000001".into(),
            end_key: "6473ffffffffffffffff".into(),
            smallest_seqno: 1,
            largest_seqno: lsn,
            num_entries: 10,
            num_deletions: 1,
            checksum: None,
            key: None,
        });
    }
    let metadata = SnapshotMetadata {
        version: MetadataVersion::V1,
        cluster_name: cluster.cluster_name.clone(),
        partition_id: PartitionId(partition),
        node_name: "n1".into(),
        created_at: SystemTime::now(),
        snapshot_id,
        key_range: KeyRange::of_partition(PartitionId(partition), 4),
        min_applied_lsn: Lsn(lsn),
        db_comparator_name: "leveldb.BytewiseComparator".into(),
        files: metadata_files,
        log_id: LogId(partition),
        cluster_created_at: Some(cluster.cluster_created_at.clone()),
        stats: None,
    };
    Export {
        dir,
        metadata,
        contents,
    }
}

/// The whole content of an object.
pub async fn object_bytes(repo: &SnapshotRepository, partition: u16, key: &str) -> Vec<u8> {
    use object_store::ObjectStoreExt;
    let location = repo.object_path(PartitionId(partition), key);
    repo.object_store()
        .get(&location)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec()
}

/// Keys of every object in a partition's `ssts/` folder.
pub async fn sst_keys(repo: &SnapshotRepository, partition: u16) -> Vec<String> {
    use futures::TryStreamExt;
    let folder = repo.object_path(PartitionId(partition), "ssts");
    let mut keys: Vec<String> = repo
        .object_store()
        .list(Some(&folder))
        .map_ok(|meta| meta.location.to_string())
        .try_collect()
        .await
        .unwrap();
    keys.sort();
    keys
}

/// Every object under a partition's folder: key relative to it → size.
pub async fn objects(repo: &SnapshotRepository, partition: u16) -> BTreeMap<String, u64> {
    use futures::TryStreamExt;
    let folder = repo.object_path(PartitionId(partition), "");
    repo.object_store()
        .list(Some(&folder))
        .map_ok(|meta| {
            let key = meta
                .location
                .prefix_match(&folder)
                .expect("listed under the folder")
                .map(|part| part.as_ref().to_owned())
                .collect::<Vec<_>>()
                .join("/");
            (key, meta.size)
        })
        .try_collect()
        .await
        .unwrap()
}

/// Objects and bytes under a partition's folder, leaving out the local repository's
/// `latest.json.lock`, which the other backends do not have.
pub async fn usage(repo: &SnapshotRepository, partition: u16) -> (usize, u64) {
    let objects = objects(repo, partition).await;
    let counted = objects.iter().filter(|(key, _)| *key != "latest.json.lock");
    (counted.clone().count(), counted.map(|(_, size)| size).sum())
}

#[allow(unused_macros)]
/// Runs each scenario once per backend, as `<backend>::<scenario>`.
macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        mod local {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Local).await })*
        }
        mod s3 {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::S3).await })*
        }
        mod memory {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Memory).await })*
        }
    };
}
