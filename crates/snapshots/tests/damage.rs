//! A damaged or shared repository, each scenario against a local folder, moto's S3 server and
//! object_store's in-memory store: a re-created cluster of the same name, a corrupt SST that a
//! publish would reuse, an object larger than its metadata says, an unreadable or oversized
//! `latest.json`.

#[macro_use]
mod support;

use cairn_snapshots::{Error, FileProblem, LATEST_JSON_BYTES_MAX, PublishOptions};
use cairn_types::{Lsn, PartitionId};
use object_store::{ObjectStoreExt, PutPayload};
use std::time::Duration;
use support::{
    Backend, cluster, export, export_of, object_bytes, random_bytes, recreated_cluster, repository,
};

const P: PartitionId = PartitionId(1);

scenarios!(
    a_recreated_cluster_counts_only_its_own_snapshots_and_deletes_none_of_the_old,
    a_corrupt_sst_is_uploaded_again_instead_of_reused,
    an_object_larger_than_declared_is_refused_before_it_is_read,
    an_unreadable_latest_json_leaves_the_other_partitions_readable,
    an_oversized_latest_json_is_refused_naming_the_bound,
    unlabelled_entries_are_adopted_by_their_own_clusters_next_publish,
);

async fn a_recreated_cluster_counts_only_its_own_snapshots_and_deletes_none_of_the_old(
    backend: Backend,
) {
    let old = repository(backend);
    let retain_one = PublishOptions {
        num_retained: Some(1),
        orphan_grace: Some(Duration::ZERO),
        ..PublishOptions::default()
    };
    // The old cluster got to LSN 301 before its base dir was deleted.
    let theirs = export(1, 301, &[("000001.sst", random_bytes(1, 2000))]);
    old.publish_with(theirs.path(), theirs.metadata.clone(), retain_one.clone())
        .await
        .unwrap();

    // The new cluster of the same name, on the same repository.
    let new = old.for_cluster(recreated_cluster());
    assert!(new.latest(P).await.unwrap().is_none(), "no archived LSN");
    assert!(new.list(None).await.unwrap().snapshots.is_empty());
    assert!(matches!(
        new.find(theirs.id()).await,
        Err(Error::SnapshotOfAnotherCluster { partition, .. }) if partition == P
    ));

    // Its first snapshot, at LSN 50, is published although the old cluster's is at 301, and a
    // second one evicts only its own first.
    let first = export_of(
        &recreated_cluster(),
        1,
        50,
        &[("000001.sst", random_bytes(50, 1000))],
    );
    let report = new
        .publish_with(first.path(), first.metadata.clone(), retain_one.clone())
        .await
        .unwrap();
    assert!(report.evicted.is_empty(), "{:?}", report.evicted);
    let latest = new.latest(P).await.unwrap().unwrap();
    assert_eq!(
        (latest.snapshot_id, latest.archived_lsn),
        (first.id(), Lsn(50))
    );
    let second = export_of(
        &recreated_cluster(),
        1,
        60,
        &[("000002.sst", random_bytes(60, 1000))],
    );
    let report = new
        .publish_with(second.path(), second.metadata.clone(), retain_one.clone())
        .await
        .unwrap();
    let evicted: Vec<_> = report.evicted.iter().map(|e| e.snapshot_id).collect();
    assert_eq!(evicted, vec![first.id()]);
    assert_eq!(new.latest(P).await.unwrap().unwrap().archived_lsn, Lsn(60));
    let listed: Vec<_> = new
        .list(Some(P))
        .await
        .unwrap()
        .snapshots
        .iter()
        .map(|s| s.snapshot_id)
        .collect();
    assert_eq!(listed, vec![second.id()]);

    // The old cluster's snapshot survived both collections (and a sweep) whole, and it still
    // sees its own view.
    new.sweep_orphans(P, Duration::ZERO, None).await.unwrap();
    old.verify(theirs.id()).await.unwrap();
    assert_eq!(old.latest(P).await.unwrap().unwrap().archived_lsn, Lsn(301));

    // A node of one cluster cannot publish another's snapshot through its repository.
    let stray = export(1, 70, &[("000003.sst", random_bytes(70, 10))]);
    let err = new
        .publish(stray.path(), stray.metadata.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ForeignSnapshot { .. }), "{err}");
}

async fn a_corrupt_sst_is_uploaded_again_instead_of_reused(backend: Backend) {
    let repo = repository(backend);
    let shared = random_bytes(7, 5000);
    let first = export(1, 10, &[("000007.sst", shared.clone())]);
    let report = repo
        .publish(first.path(), first.metadata.clone())
        .await
        .unwrap();
    let key = report.metadata.files[0].key.clone().unwrap();

    // A byte flips in the stored object; its size stays.
    let mut flipped = shared.clone();
    flipped[2500] ^= 0x01;
    repo.object_store()
        .put(&repo.object_path(P, &key), PutPayload::from(flipped))
        .await
        .unwrap();
    assert!(repo.verify(first.id()).await.is_err());

    // The next snapshot shares the file: it uploads it again instead of trusting it.
    let second = export(
        1,
        20,
        &[
            ("000007.sst", shared.clone()),
            ("000008.sst", random_bytes(8, 100)),
        ],
    );
    let report = repo
        .publish(second.path(), second.metadata.clone())
        .await
        .unwrap();
    assert!(
        report.uploaded.contains(&"/000007.sst".to_string()),
        "{:?}",
        report.uploaded
    );
    repo.verify(second.id()).await.unwrap();
    // Content-addressed, so the repair heals the older snapshot too.
    repo.verify(first.id()).await.unwrap();
    let staging = tempfile::tempdir().unwrap();
    repo.download(second.id(), staging.path()).await.unwrap();
    assert_eq!(
        std::fs::read(staging.path().join("000007.sst")).unwrap(),
        shared
    );

    // A fresh handle (another process) reads what it reuses back once, then trusts it.
    let other = repo.for_cluster(cluster());
    let third = export(1, 30, &[("000007.sst", shared.clone())]);
    let report = other
        .publish(third.path(), third.metadata.clone())
        .await
        .unwrap();
    assert!(report.uploaded.is_empty(), "{:?}", report.uploaded);
}

async fn an_object_larger_than_declared_is_refused_before_it_is_read(backend: Backend) {
    let repo = repository(backend);
    let e = export(1, 5, &[("000001.sst", random_bytes(1, 1469))]);
    let report = repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    let key = report.metadata.files[0].key.clone().unwrap();
    repo.object_store()
        .put(
            &repo.object_path(P, &key),
            PutPayload::from(vec![0u8; 3 * 1024 * 1024]),
        )
        .await
        .unwrap();
    let staging = tempfile::tempdir().unwrap();
    let err = repo.download(e.id(), staging.path()).await.unwrap_err();
    assert!(
        matches!(
            &err,
            Error::BadFile {
                problem: FileProblem::SizeMismatch { expected: 1469, .. }
                    | FileProblem::TooLarge { expected: 1469 },
                ..
            }
        ),
        "{err}"
    );
    let left: u64 = std::fs::read_dir(staging.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(left, 0, "nothing of the object stays in the staging folder");
    assert!(matches!(
        repo.verify(e.id()).await,
        Err(Error::BadFile { .. })
    ));
}

async fn an_unreadable_latest_json_leaves_the_other_partitions_readable(backend: Backend) {
    let repo = repository(backend);
    let mut ids = Vec::new();
    for partition in 0..3u16 {
        let e = export(
            partition,
            10,
            &[("000001.sst", random_bytes(u64::from(partition), 100))],
        );
        repo.publish(e.path(), e.metadata.clone()).await.unwrap();
        ids.push(e.id());
    }
    repo.object_store()
        .put(
            &repo.object_path(P, "latest.json"),
            PutPayload::from_static(b"{ not json"),
        )
        .await
        .unwrap();

    let listing = repo.list(None).await.unwrap();
    let listed: Vec<_> = listing.snapshots.iter().map(|s| s.snapshot_id).collect();
    assert_eq!(listed, vec![ids[0], ids[2]]);
    assert_eq!(listing.unreadable.len(), 1, "{listing:?}");
    assert_eq!(listing.unreadable[0].partition_id, P);
    assert!(
        listing.unreadable[0]
            .error
            .to_string()
            .contains("1/latest.json"),
        "{}",
        listing.unreadable[0].error
    );

    // The snapshots of the other partitions verify; one of the bad partition is reported as
    // possibly there.
    repo.verify(ids[2]).await.unwrap();
    repo.verify(ids[0]).await.unwrap();
    let err = repo.verify(ids[1]).await.unwrap_err();
    assert!(
        matches!(&err, Error::SnapshotNotFoundInReadable { partitions, .. } if partitions == &vec![P]),
        "{err}"
    );
}

async fn an_oversized_latest_json_is_refused_naming_the_bound(backend: Backend) {
    let repo = repository(backend);
    let e = export(1, 10, &[("000001.sst", random_bytes(1, 100))]);
    repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    let huge = vec![b' '; LATEST_JSON_BYTES_MAX as usize + 10];
    repo.object_store()
        .put(&repo.object_path(P, "latest.json"), PutPayload::from(huge))
        .await
        .unwrap();
    let err = repo.read_latest(P).await.unwrap_err();
    assert!(matches!(err, Error::TooLarge { .. }), "{err}");
    assert!(
        err.to_string().contains(&LATEST_JSON_BYTES_MAX.to_string()),
        "{err}"
    );
    let listing = repo.list(None).await.unwrap();
    assert!(
        matches!(&listing.unreadable[..], [bad] if matches!(bad.error, Error::TooLarge { .. })),
        "{listing:?}"
    );
}

/// A local object far larger than declared (a sparse file: it takes no disk) is refused at
/// once: a download stops one byte past the declared size instead of copying it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_a_huge_object_is_refused_without_being_copied() {
    let repo = repository(Backend::Local);
    let e = export(1, 5, &[("000001.sst", random_bytes(1, 1469))]);
    let report = repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    let key = report.metadata.files[0].key.clone().unwrap();
    let path = repo.local_folder().unwrap().join("1").join(&key);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(64 * 1024 * 1024 * 1024)
        .unwrap();
    let staging = tempfile::tempdir().unwrap();
    let download = repo.download(e.id(), staging.path());
    let err = tokio::time::timeout(Duration::from_secs(20), download)
        .await
        .expect("refused without copying 64 GiB")
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::BadFile {
                problem: FileProblem::TooLarge { expected: 1469 },
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("1469"), "{err}");
}

/// `latest.json` as a build before cluster-labelled entries wrote it: the next publish of the
/// cluster that took those snapshots (by their `metadata.json`) counts them as its own again;
/// another cluster's publish leaves them alone.
async fn unlabelled_entries_are_adopted_by_their_own_clusters_next_publish(backend: Backend) {
    let repo = repository(backend);
    let old = export(1, 10, &[("000001.sst", random_bytes(1, 100))]);
    repo.publish(old.path(), old.metadata.clone())
        .await
        .unwrap();
    let mut document: serde_json::Value =
        serde_json::from_slice(&object_bytes(&repo, 1, "latest.json").await).unwrap();
    for entry in document["retained"].as_array_mut().unwrap() {
        entry.as_object_mut().unwrap().remove("cluster");
    }
    repo.object_store()
        .put(
            &repo.object_path(P, "latest.json"),
            PutPayload::from(serde_json::to_vec(&document).unwrap()),
        )
        .await
        .unwrap();
    assert!(
        repo.latest(P).await.unwrap().is_none(),
        "unlabelled: no one's"
    );

    let other = repo.for_cluster(recreated_cluster());
    let theirs = export_of(
        &recreated_cluster(),
        1,
        5,
        &[("000002.sst", random_bytes(2, 100))],
    );
    other
        .publish(theirs.path(), theirs.metadata.clone())
        .await
        .unwrap();
    let retained = other.latest(P).await.unwrap().unwrap().retained;
    assert_eq!(retained.len(), 1, "{retained:?}");

    let newer = export(1, 20, &[("000003.sst", random_bytes(3, 100))]);
    repo.publish(newer.path(), newer.metadata.clone())
        .await
        .unwrap();
    let latest = repo.latest(P).await.unwrap().unwrap();
    let ids: Vec<_> = latest.retained.iter().map(|r| r.snapshot_id).collect();
    assert_eq!(ids, vec![newer.id(), old.id()]);
    assert_eq!(latest.archived_lsn, Lsn(10));
    assert_eq!(
        other.latest(P).await.unwrap().unwrap().snapshot_id,
        theirs.id()
    );
}
