//! Faults of the object store below the repository: transient failures are retried with backoff,
//! permanent ones reach the caller naming the object, and no error shows credentials.

mod support;

use async_trait::async_trait;
use cairn_snapshots::{Error, GcOptions, PublishOptions, RepositoryOptions, SnapshotRepository};
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use support::{export, random_bytes};

/// An in-memory store whose first `put_failures` puts, `get_failures` gets and `delete_failures`
/// deletes fail as a dropped connection would.
#[derive(Debug, Default)]
struct Flaky {
    inner: InMemory,
    put_failures: AtomicU32,
    get_failures: AtomicU32,
    /// Shared with the delete streams, which outlive the call that makes them.
    delete_failures: Arc<AtomicU32>,
    puts: AtomicU32,
}

impl std::fmt::Display for Flaky {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Flaky")
    }
}

fn take_failure(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

fn connection_reset() -> object_store::Error {
    object_store::Error::Generic {
        store: "Flaky",
        source: "connection reset by peer".into(),
    }
}

#[async_trait]
impl ObjectStore for Flaky {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.puts.fetch_add(1, Ordering::SeqCst);
        if take_failure(&self.put_failures) {
            return Err(connection_reset());
        }
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        if take_failure(&self.get_failures) {
            return Err(connection_reset());
        }
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        let failures = self.delete_failures.clone();
        let locations = locations
            .map(move |location| {
                if take_failure(&failures) {
                    Err(connection_reset())
                } else {
                    location
                }
            })
            .boxed();
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

fn repository(store: Arc<Flaky>, retries: u32) -> SnapshotRepository {
    SnapshotRepository::from_object_store(
        store,
        "flaky://",
        "cluster",
        support::cluster(),
        RepositoryOptions {
            retries,
            ..RepositoryOptions::default()
        },
    )
    .unwrap()
}

#[tokio::test]
async fn transient_failures_are_retried() {
    let store = Arc::new(Flaky::default());
    let repo = repository(store.clone(), 5);
    let e = export(1, 10, &[("000001.sst", random_bytes(1, 5000))]);
    // Fails the SST upload twice (it comes before the other puts) and the first two reads.
    store.put_failures.store(2, Ordering::SeqCst);
    store.get_failures.store(2, Ordering::SeqCst);
    repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    store.get_failures.store(2, Ordering::SeqCst);
    repo.verify(e.id()).await.unwrap();
}

#[tokio::test]
async fn a_permanent_failure_names_the_object_after_the_retries() {
    let store = Arc::new(Flaky::default());
    let repo = repository(store.clone(), 2);
    let e = export(1, 10, &[("000001.sst", random_bytes(1, 5000))]);
    store.put_failures.store(u32::MAX, Ordering::SeqCst);
    let err = repo
        .publish(e.path(), e.metadata.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ObjectStore { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.starts_with("cannot upload flaky://cluster/1/ssts/") && message.contains(".sst"),
        "{message}"
    );
    assert_eq!(
        store.puts.load(Ordering::SeqCst),
        3,
        "one try and two retries"
    );
    // Nothing became visible.
    assert!(
        repo.latest(cairn_types::PartitionId(1))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn a_failed_garbage_collection_does_not_fail_the_publish() {
    let store = Arc::new(Flaky::default());
    let repo = repository(store.clone(), 2);
    let partition = cairn_types::PartitionId(1);
    let options = PublishOptions {
        num_retained: Some(1),
        ..PublishOptions::default()
    };
    let first = export(1, 10, &[("000001.sst", random_bytes(1, 100))]);
    let second = export(1, 20, &[("000002.sst", random_bytes(2, 100))]);
    repo.publish_with(first.path(), first.metadata.clone(), options.clone())
        .await
        .unwrap();
    store.delete_failures.store(u32::MAX, Ordering::SeqCst);
    let report = repo
        .publish_with(second.path(), second.metadata.clone(), options)
        .await
        .expect("the snapshot is visible, whatever the collection does");
    let err = report
        .gc
        .expect("an eviction runs a collection")
        .unwrap_err();
    assert!(
        matches!(
            *err,
            Error::ObjectStore {
                context: "delete",
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with("cannot delete flaky://cluster/1/ssts/"),
        "SSTs go first: {err}"
    );
    let latest = repo.latest(partition).await.unwrap().unwrap();
    assert_eq!(latest.snapshot_id, second.id());
    assert_eq!(latest.retained.len(), 1);

    // The store recovers (with a transient failure left, which is retried); collecting with the
    // evicted list from the report deletes the first snapshot at once.
    store.delete_failures.store(1, Ordering::SeqCst);
    let gc = repo
        .collect_garbage(
            partition,
            &GcOptions {
                evicted: report.evicted.clone(),
                ..GcOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(gc.deleted_snapshots, vec![first.id()]);
    assert_eq!(gc.deleted_objects, 2);
    repo.verify(second.id()).await.unwrap();
}

#[tokio::test]
async fn errors_never_show_credentials() {
    // Nothing listens on port 9 of the loopback interface.
    let repo = SnapshotRepository::open(
        "s3://bucket/prefix",
        support::cluster(),
        RepositoryOptions {
            endpoint_url: Some("http://127.0.0.1:9".into()),
            allow_http: true,
            region: Some("us-east-1".into()),
            access_key_id: Some("AKIDSECRETID".into()),
            secret_access_key: Some("VERYSECRETKEY".into()),
            retries: 0,
            ..RepositoryOptions::default()
        },
    )
    .unwrap();
    let e = export(1, 10, &[("000001.sst", random_bytes(1, 10))]);
    let err = repo
        .publish(e.path(), e.metadata.clone())
        .await
        .unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(shown.contains("bucket"), "{shown}");
    for secret in ["AKIDSECRETID", "VERYSECRETKEY"] {
        assert!(!shown.contains(secret), "{shown}");
    }
}
