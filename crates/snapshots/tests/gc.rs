//! Garbage collection scenarios, each run against a local folder, moto's S3 server and
//! object_store's in-memory store: retention frees the space of evicted snapshots at once,
//! orphans go after their grace period, and nothing a retained snapshot needs is ever deleted.

#[macro_use]
mod support;

use cairn_snapshots::{
    Error, GcOptions, PublishOptions, PublishStep, RetainedSnapshot, SnapshotId, snapshot_folder,
};
use cairn_types::{Lsn, PartitionId};
use object_store::ObjectStoreExt;
use std::collections::BTreeMap;
use std::time::Duration;
use support::{Backend, Export, TestRepo, export, objects, random_bytes, repository, usage};

const P: PartitionId = PartitionId(1);
const HOUR: Duration = Duration::from_secs(3600);

scenarios!(
    retention_deletes_the_evicted_snapshot_and_its_unshared_ssts,
    an_orphan_is_swept_only_after_its_grace_period,
    evicted_snapshots_go_at_once_unless_latest_json_retains_them,
    nothing_is_deleted_when_a_retained_metadata_json_is_missing,
);

/// An SST file of a fake export: the same `seed` and `size` give the same bytes, so exports
/// built from the same file share its object.
fn sst(number: u64, size: usize) -> (String, Vec<u8>) {
    (format!("{number:06}.sst"), random_bytes(number, size))
}

fn exported(lsn: u64, files: &[(String, Vec<u8>)]) -> Export {
    let files: Vec<(&str, Vec<u8>)> = files
        .iter()
        .map(|(name, bytes)| (name.as_str(), bytes.clone()))
        .collect();
    export(1, lsn, &files)
}

/// The object key that a file's bytes are stored under.
fn sst_key(file: &(String, Vec<u8>)) -> String {
    format!("ssts/{:032x}.sst", xxhash_rust::xxh3::xxh3_128(&file.1))
}

fn metadata_key(e: &Export) -> String {
    format!(
        "{}/metadata.json",
        snapshot_folder(e.metadata.min_applied_lsn, e.id())
    )
}

/// Publishes and stops after `step`, as a crash there would, leaving an orphan.
async fn publish_orphan(repo: &TestRepo, e: &Export, step: PublishStep) {
    let options = PublishOptions {
        stop_after: Some(step),
        ..PublishOptions::default()
    };
    let err = repo
        .publish_with(e.path(), e.metadata.clone(), options)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::StoppedAfter { .. }), "{err}");
}

/// `before` without the given keys.
fn without(before: &BTreeMap<String, u64>, gone: &[String]) -> BTreeMap<String, u64> {
    let mut expected = before.clone();
    for key in gone {
        assert!(expected.remove(key).is_some(), "{key} was not there");
    }
    expected
}

/// Every file of a retained snapshot is stored and reads back with its checksum.
async fn assert_intact(repo: &TestRepo, e: &Export) {
    let stored = objects(repo, 1).await;
    assert!(stored.contains_key(&metadata_key(e)));
    for file in repo.metadata(P, e.id()).await.unwrap().files {
        let key = file.key.expect("published files have a key");
        assert_eq!(stored.get(&key), Some(&file.size), "{key}");
    }
    repo.verify(e.id()).await.unwrap();
}

async fn retention_deletes_the_evicted_snapshot_and_its_unshared_ssts(backend: Backend) {
    let repo = repository(backend);
    let options = PublishOptions {
        num_retained: Some(2),
        ..PublishOptions::default()
    };
    // 1 is in every snapshot, 2 only in the first, 3 in the first two, 4 in the last two, 5 only
    // in the last.
    let files: Vec<_> = [(1, 10_000), (2, 3_000), (3, 5_000), (4, 7_000), (5, 2_000)]
        .into_iter()
        .map(|(number, size)| sst(number, size))
        .collect();
    let first = exported(10, &[files[0].clone(), files[1].clone(), files[2].clone()]);
    let second = exported(20, &[files[0].clone(), files[2].clone(), files[3].clone()]);
    let third = exported(30, &[files[0].clone(), files[3].clone(), files[4].clone()]);
    for e in [&first, &second] {
        let report = repo
            .publish_with(e.path(), e.metadata.clone(), options.clone())
            .await
            .unwrap();
        assert!(report.evicted.is_empty());
        assert!(report.gc.is_none(), "no eviction, no collection");
    }
    let before = objects(&repo, 1).await;
    let (objects_before, bytes_before) = usage(&repo, 1).await;
    assert_eq!(
        objects_before,
        1 + 2 + 4,
        "latest.json, 2 metadata.json, 4 SSTs"
    );
    let first_metadata_bytes = before[&metadata_key(&first)];

    let report = repo
        .publish_with(third.path(), third.metadata.clone(), options.clone())
        .await
        .unwrap();
    let evicted: Vec<_> = report.evicted.iter().map(|r| r.snapshot_id).collect();
    assert_eq!(evicted, vec![first.id()]);
    let gc = report
        .gc
        .expect("an eviction runs a collection")
        .expect("the collection succeeds");
    assert_eq!(gc.partition_id, P);
    assert_eq!(gc.deleted_snapshots, vec![first.id()]);
    // The first snapshot's metadata.json and the one SST no retained snapshot shares; at once,
    // although everything is far younger than the grace period.
    assert_eq!(gc.deleted_objects, 2);
    assert_eq!(gc.deleted_bytes, first_metadata_bytes + 3_000);
    assert_eq!((gc.kept_young_objects, gc.kept_young_bytes), (0, 0));

    let after = objects(&repo, 1).await;
    let (objects_after, bytes_after) = usage(&repo, 1).await;
    let mut expected: Vec<String> = vec![
        "latest.json".into(),
        metadata_key(&second),
        metadata_key(&third),
    ];
    expected.extend([0, 2, 3, 4].map(|i| sst_key(&files[i])));
    if backend == Backend::Local {
        expected.push("latest.json.lock".into());
    }
    expected.sort();
    assert_eq!(after.keys().cloned().collect::<Vec<_>>(), expected);
    // Two objects gone, two new (the third's metadata.json and SST 5).
    assert_eq!(objects_after, objects_before);
    let added = after[&metadata_key(&third)] + 2_000;
    let latest_growth = after["latest.json"] as i64 - before["latest.json"] as i64;
    assert_eq!(
        bytes_after as i64,
        bytes_before as i64 - gc.deleted_bytes as i64 + added as i64 + latest_growth
    );

    for e in [&second, &third] {
        assert_intact(&repo, e).await;
    }
    let latest = repo.latest(P).await.unwrap().unwrap();
    let retained: Vec<_> = latest.retained.iter().map(|r| r.snapshot_id).collect();
    assert_eq!(retained, vec![third.id(), second.id()]);
    assert_eq!(
        latest.archived_lsn,
        Lsn(20),
        "the oldest retained snapshot's"
    );
    assert!(matches!(
        repo.find(first.id()).await,
        Err(Error::SnapshotNotFound { .. })
    ));
    // No empty folder is left behind (a local repository has directories).
    let folders = repo
        .object_store()
        .list_with_delimiter(Some(&repo.object_path(P, "snapshots")))
        .await
        .unwrap();
    assert_eq!(folders.common_prefixes.len(), 2);
}

async fn an_orphan_is_swept_only_after_its_grace_period(backend: Backend) {
    let repo = repository(backend);
    let files: Vec<_> = (1..=6).map(|n| sst(n, 1_000 * n as usize)).collect();
    let first = exported(10, &[files[0].clone(), files[1].clone()]);
    let second = exported(20, &[files[1].clone(), files[2].clone()]);
    for e in [&first, &second] {
        repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    }
    // A publish that crashed before latest.json: its folder and its new SSTs 4 and 5 are
    // orphans; SST 3 is the second snapshot's. And one that crashed before metadata.json: SST 6.
    let crashed_late = exported(30, &[files[2].clone(), files[3].clone(), files[4].clone()]);
    publish_orphan(&repo, &crashed_late, PublishStep::MetadataWritten).await;
    let crashed_early = exported(40, &[files[5].clone()]);
    publish_orphan(&repo, &crashed_early, PublishStep::SstsUploaded).await;
    let before = objects(&repo, 1).await;
    let orphans = vec![
        metadata_key(&crashed_late),
        sst_key(&files[3]),
        sst_key(&files[4]),
        sst_key(&files[5]),
    ];
    let orphan_bytes: u64 = orphans.iter().map(|key| before[key]).sum();

    // Within the grace period they may be a publish in flight: kept, and reported.
    let kept = repo.sweep_orphans(P, HOUR, None).await.unwrap();
    assert!(kept.deleted_snapshots.is_empty());
    assert_eq!((kept.deleted_objects, kept.deleted_bytes), (0, 0));
    assert_eq!(
        (kept.kept_young_objects, kept.kept_young_bytes),
        (4, orphan_bytes)
    );
    assert_eq!(objects(&repo, 1).await, before);

    // A node that no longer leads the partition deletes nothing: the fence is asked last.
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = asked.clone();
    let deposed: cairn_snapshots::GcFence = std::sync::Arc::new(move |partition| {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            Err(cairn_types::Fenced::new(format!(
                "partition {partition} is led by n2 at epoch 9"
            )))
        })
    });
    let err = repo
        .sweep_orphans(P, Duration::ZERO, Some(deposed))
        .await
        .unwrap_err();
    assert!(
        matches!(err, cairn_snapshots::Error::GcFenced { .. }) && err.to_string().contains("n2"),
        "{err}"
    );
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(objects(&repo, 1).await, before, "nothing deleted");
    let leading: cairn_snapshots::GcFence = std::sync::Arc::new(|_| Box::pin(async { Ok(()) }));
    let swept = repo
        .sweep_orphans(P, Duration::ZERO, Some(leading))
        .await
        .unwrap();
    assert_eq!(swept.deleted_snapshots, vec![crashed_late.id()]);
    assert_eq!(
        (swept.deleted_objects, swept.deleted_bytes),
        (4, orphan_bytes)
    );
    assert_eq!(swept.kept_young_objects, 0);
    assert_eq!(objects(&repo, 1).await, without(&before, &orphans));
    for e in [&first, &second] {
        assert_intact(&repo, e).await;
    }
    let retained: Vec<_> = repo
        .latest(P)
        .await
        .unwrap()
        .unwrap()
        .retained
        .iter()
        .map(|r| r.snapshot_id)
        .collect();
    assert_eq!(retained, vec![second.id(), first.id()]);

    // A second sweep finds nothing, and the swept publish can be retried from the start.
    let again = repo.sweep_orphans(P, Duration::ZERO, None).await.unwrap();
    assert_eq!((again.deleted_objects, again.kept_young_objects), (0, 0));
    let retried = repo
        .publish(crashed_late.path(), crashed_late.metadata.clone())
        .await
        .unwrap();
    assert_eq!(retried.uploaded_files, 2, "SSTs 4 and 5; 3 is shared");
    assert_intact(&repo, &crashed_late).await;
}

async fn evicted_snapshots_go_at_once_unless_latest_json_retains_them(backend: Backend) {
    let repo = repository(backend);
    let files: Vec<_> = (1..=4).map(|n| sst(n, 500 * n as usize)).collect();
    let retained = exported(10, &[files[0].clone(), files[1].clone()]);
    repo.publish(retained.path(), retained.metadata.clone())
        .await
        .unwrap();
    // Two unreferenced snapshots: one whole, one whose metadata.json is gone already (as after a
    // collection that crashed before its last round).
    let whole = exported(20, &[files[1].clone(), files[2].clone()]);
    publish_orphan(&repo, &whole, PublishStep::MetadataWritten).await;
    let headless = exported(30, &[files[3].clone()]);
    publish_orphan(&repo, &headless, PublishStep::MetadataWritten).await;
    repo.object_store()
        .delete(&repo.object_path(P, &metadata_key(&headless)))
        .await
        .unwrap();
    let before = objects(&repo, 1).await;

    let named = |e: &Export| RetainedSnapshot {
        snapshot_id: e.id(),
        min_applied_lsn: e.metadata.min_applied_lsn,
        path: snapshot_folder(e.metadata.min_applied_lsn, e.id()),
        cluster: Some(support::cluster()),
    };
    let options = GcOptions {
        orphan_grace: HOUR,
        // A caller mistaken about the retained one must not make it go.
        evicted: vec![named(&headless), named(&whole), named(&retained)],
        fence: None,
    };
    let gc = repo.collect_garbage(P, &options).await.unwrap();
    assert_eq!(gc.deleted_snapshots, vec![whole.id()]);
    let gone = vec![metadata_key(&whole), sst_key(&files[2])];
    assert_eq!(gc.deleted_objects, 2, "SST 2 is the retained snapshot's");
    assert_eq!(
        gc.deleted_bytes,
        gone.iter().map(|k| before[k]).sum::<u64>()
    );
    // Nothing tells what the headless one referenced: SST 4 waits for the grace period.
    assert_eq!((gc.kept_young_objects, gc.kept_young_bytes), (1, 2_000));
    assert_eq!(objects(&repo, 1).await, without(&before, &gone));
    assert_intact(&repo, &retained).await;
}

async fn nothing_is_deleted_when_a_retained_metadata_json_is_missing(backend: Backend) {
    let repo = repository(backend);
    let first = exported(10, &[sst(1, 100)]);
    let second = exported(20, &[sst(2, 100)]);
    for e in [&first, &second] {
        repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    }
    let orphan = exported(30, &[sst(3, 100)]);
    publish_orphan(&repo, &orphan, PublishStep::MetadataWritten).await;
    // Behind Cairn's back: without it, which SSTs the first snapshot needs is unknown.
    repo.object_store()
        .delete(&repo.object_path(P, &metadata_key(&first)))
        .await
        .unwrap();
    let before = objects(&repo, 1).await;

    let err = repo
        .sweep_orphans(P, Duration::ZERO, None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::MetadataMissing { snapshot_id, .. } if *snapshot_id == first.id()),
        "{err}"
    );
    assert_eq!(objects(&repo, 1).await, before);

    // Once that snapshot falls out of retention, collection goes ahead.
    let third = exported(40, &[sst(4, 100)]);
    let report = repo
        .publish_with(
            third.path(),
            third.metadata.clone(),
            PublishOptions {
                num_retained: Some(2),
                orphan_grace: Some(Duration::ZERO),
                ..PublishOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        report
            .evicted
            .iter()
            .map(|r| r.snapshot_id)
            .collect::<Vec<SnapshotId>>(),
        vec![first.id()]
    );
    let gc = report.gc.expect("an eviction runs a collection").unwrap();
    // The evicted snapshot's metadata.json is gone: its SST waits like any orphan, here for no
    // time at all; the orphan goes too.
    assert_eq!(gc.deleted_snapshots, vec![orphan.id()]);
    let stored = objects(&repo, 1).await;
    assert!(!stored.contains_key(&sst_key(&sst(1, 100))));
    assert!(!stored.contains_key(&sst_key(&sst(3, 100))));
    for e in [&second, &third] {
        assert_intact(&repo, e).await;
    }
}

/// Names of the staged copies (`<object>#<digits>`) in a local partition's `ssts` folder.
fn staged_copies(repo: &TestRepo) -> Vec<(String, u64)> {
    let dir = repo.local_folder().unwrap().join("1").join("ssts");
    let mut staged: Vec<(String, u64)> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| {
                    let e = e.ok()?;
                    let name = e.file_name().to_string_lossy().into_owned();
                    let size = e.metadata().ok()?.len();
                    name.contains('#').then_some((name, size))
                })
                .collect()
        })
        .unwrap_or_default();
    staged.sort();
    staged
}

/// A publish to a local repository interrupted in the middle of copying an SST (its future is
/// dropped, as a crash or a cancelled request would) leaves the staged copy `<object>#<digits>`,
/// which object_store's listing does not show. The orphan sweep deletes it once it is older
/// than the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_staged_copies_of_an_interrupted_publish_are_swept_after_the_grace_period() {
    let repo = repository(Backend::Local);
    let big = exported(10, &[sst(1, 64 * 1024 * 1024)]);
    let publish = repo.publish(big.path(), big.metadata.clone());
    tokio::select! {
        result = publish => panic!("the publish was to be interrupted, but it ended: {result:?}"),
        () = async {
            while staged_copies(&repo).is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        } => {}
    }
    // The copy runs on in its blocking thread; wait until it has written everything.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while staged_copies(&repo).first().map(|(_, size)| *size) != Some(64 * 1024 * 1024) {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            staged_copies(&repo)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        repo.latest(P).await.unwrap().is_none(),
        "nothing became visible"
    );

    // Young: kept, and counted.
    let report = repo.sweep_orphans(P, HOUR, None).await.unwrap();
    assert_eq!(staged_copies(&repo).len(), 1);
    assert!(report.kept_young_bytes >= 64 * 1024 * 1024, "{report:?}");

    let report = repo.sweep_orphans(P, Duration::ZERO, None).await.unwrap();
    assert_eq!(staged_copies(&repo), vec![], "{report:?}");
    assert_eq!(report.deleted_bytes, 64 * 1024 * 1024);

    // Publishing again works as if nothing had happened.
    repo.publish(big.path(), big.metadata.clone())
        .await
        .unwrap();
    repo.verify(big.id()).await.unwrap();
}
