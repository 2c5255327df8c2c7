//! What a caller can tell from a worker error: a snapshot or a restore that fails because the
//! repository cannot be reached keeps the repository's error as its source, so the caller can
//! retry instead of calling an operator.

use cairn_log::LogProvider;
use cairn_log::LogState;
use cairn_log::local::{LocalLogOptions, LocalLogProvider};
use cairn_partition_store::{PartitionStoreManager, StoreOptions};
use cairn_snapshots::{ClusterIdentity, RepositoryOptions, SnapshotRepository};
use cairn_types::{KeyRange, LogId, Lsn, NodeId, PartitionId};
use cairn_worker::{Error, Partition, RestoreFailure, Restorer, SnapshotProducer, SystemClock};
use std::sync::Arc;

const PID: PartitionId = PartitionId(0);

/// An S3 repository whose endpoint refuses connections, tried once.
fn unreachable_repository() -> Arc<SnapshotRepository> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let options = RepositoryOptions {
        endpoint_url: Some(format!("http://127.0.0.1:{port}")),
        region: Some("us-east-1".into()),
        allow_http: true,
        access_key_id: Some("test".into()),
        secret_access_key: Some("test".into()),
        retries: 0,
        ..RepositoryOptions::default()
    };
    let cluster = ClusterIdentity::new("errors", "2026-01-01T00:00:00Z");
    Arc::new(SnapshotRepository::open("s3://bucket/cairn", cluster, options).unwrap())
}

#[tokio::test]
async fn a_restore_from_an_unreachable_repository_keeps_the_object_store_error() {
    let dir = tempfile::tempdir().unwrap();
    let stores = Arc::new(
        PartitionStoreManager::open(&dir.path().join("db"), &StoreOptions::default()).unwrap(),
    );
    let restorer = Restorer::new(unreachable_repository(), dir.path().join("staging"), 1);
    let log = LogState {
        trim_point: Lsn::ZERO,
        tail: Lsn::ZERO,
    };

    let err = restorer
        .restore(&stores, PID, log, None, None)
        .await
        .unwrap_err();

    assert!(
        matches!(
            &err,
            Error::Restore {
                failure: RestoreFailure::Failed {
                    context: "read latest.json",
                    ..
                },
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.is_repository_unavailable(), "{err:?}");
    let message = err.to_string();
    assert!(
        message.starts_with("partition 0: cannot restore from a snapshot: read latest.json: "),
        "{message}"
    );
}

#[tokio::test]
async fn a_snapshot_to_an_unreachable_repository_keeps_the_object_store_error() {
    let dir = tempfile::tempdir().unwrap();
    let logs = LocalLogProvider::open(dir.path().join("log"), LocalLogOptions::default()).unwrap();
    let stores =
        PartitionStoreManager::open(&dir.path().join("db"), &StoreOptions::default()).unwrap();
    let partition = Partition::start(
        KeyRange::of_partition(PID, 1),
        NodeId("n1".into()),
        stores.open_or_create_partition(PID).unwrap(),
        logs.open(LogId(0)).await.unwrap(),
        Arc::new(SystemClock),
    )
    .unwrap();
    let producer = SnapshotProducer::new(
        unreachable_repository(),
        dir.path().join("db-snapshots"),
        "n1".into(),
    );

    let err = producer.create(&partition, None, None).await.unwrap_err();

    assert!(
        matches!(
            &err,
            Error::Snapshot {
                context: "read latest.json",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.is_repository_unavailable(), "{err:?}");
    assert!(
        err.to_string()
            .starts_with("partition 0: read latest.json: "),
        "{err}"
    );
    partition.shutdown().await;
}

#[tokio::test]
async fn a_restore_without_a_snapshot_is_not_taken_for_an_unreachable_repository() {
    let dir = tempfile::tempdir().unwrap();
    let stores = Arc::new(
        PartitionStoreManager::open(&dir.path().join("db"), &StoreOptions::default()).unwrap(),
    );
    let cluster = ClusterIdentity::new("errors", "2026-01-01T00:00:00Z");
    let repository = SnapshotRepository::open(
        dir.path().join("repository").to_str().unwrap(),
        cluster,
        RepositoryOptions::default(),
    )
    .unwrap();
    let restorer = Restorer::new(Arc::new(repository), dir.path().join("staging"), 1);
    let log = LogState {
        trim_point: Lsn::ZERO,
        tail: Lsn::ZERO,
    };

    let err = restorer
        .restore(&stores, PID, log, None, None)
        .await
        .unwrap_err();

    assert!(
        matches!(
            &err,
            Error::Restore {
                failure: RestoreFailure::Unable(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!err.is_repository_unavailable(), "{err:?}");
    assert!(
        err.to_string().starts_with(
            "partition 0: cannot restore from a snapshot: the snapshot repository file://"
        ),
        "{err}"
    );
}
