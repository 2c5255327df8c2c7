//! Scenarios of the snapshot repository, each run against a local folder, moto's S3 server and
//! object_store's in-memory store: what an operator or a restore would notice.

#[macro_use]
mod support;

use cairn_snapshots::{
    Error, FileProblem, PublishOptions, PublishStep, RepositoryOptions, SnapshotMetadata,
};
use cairn_types::{Lsn, PartitionId};
use object_store::{ObjectStoreExt, PutPayload};
use std::sync::{Arc, Mutex};
use support::{
    Backend, Export, export, object_bytes, random_bytes, repository, repository_with, sst_keys,
};

const P: PartitionId = PartitionId(1);

scenarios!(
    publish_and_list_newest_first,
    describe_round_trips_the_metadata,
    export_tar_holds_metadata_and_identical_ssts_and_verify_passes,
    download_fetches_checked_files,
    a_download_keeps_to_the_rate_limit,
    a_publish_keeps_to_the_rate_limit,
    a_concurrent_latest_update_loses_cleanly,
    a_crash_after_the_ssts_leaves_no_visible_snapshot,
    a_crash_after_metadata_json_leaves_no_visible_snapshot,
    a_second_snapshot_uploads_only_new_ssts,
    a_corrupted_object_fails_verify_naming_the_file,
    a_missing_object_fails_verify_naming_the_file,
    an_unknown_metadata_version_is_refused,
    multipart_uploads_round_trip,
    an_older_snapshot_is_not_published_over_a_newer_one,
    retention_keeps_the_newest_and_reports_the_evicted,
    progress_reaches_the_total,
);

async fn publish_and_list_newest_first(backend: Backend) {
    let repo = repository(backend);
    assert!(repo.list(None).await.unwrap().snapshots.is_empty());
    assert!(repo.latest(P).await.unwrap().is_none());

    let first = export(1, 10, &[("000001.sst", random_bytes(1, 3000))]);
    let second = export(
        1,
        20,
        &[
            ("000001.sst", random_bytes(1, 3000)),
            ("000002.sst", random_bytes(2, 500)),
        ],
    );
    let third = export(1, 30, &[("000003.sst", random_bytes(3, 700))]);
    let other_partition = export(0, 5, &[("000009.sst", random_bytes(9, 100))]);
    for e in [&first, &second, &third, &other_partition] {
        repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    }

    let listed = repo.list(Some(P)).await.unwrap().snapshots;
    let ids: Vec<_> = listed.iter().map(|s| s.snapshot_id).collect();
    assert_eq!(ids, vec![third.id(), second.id(), first.id()]);
    let lsns: Vec<_> = listed.iter().map(|s| s.min_applied_lsn).collect();
    assert_eq!(lsns, vec![Lsn(30), Lsn(20), Lsn(10)]);
    let second_summary = &listed[1];
    assert_eq!(second_summary.partition_id, P);
    assert_eq!(second_summary.node_name, "n1");
    assert_eq!(second_summary.files, 2);
    assert_eq!(second_summary.size, 3500);
    assert_eq!(
        second_summary.new_bytes, 500,
        "000001.sst came with the first"
    );
    assert_eq!(second_summary.created_at, second.metadata.created_at);
    assert!(second_summary.path.starts_with("snapshots/"));

    let all = repo.list(None).await.unwrap().snapshots;
    let all_ids: Vec<_> = all.iter().map(|s| s.snapshot_id).collect();
    assert_eq!(
        all_ids,
        vec![other_partition.id(), third.id(), second.id(), first.id()]
    );
    assert_eq!(
        repo.partitions().await.unwrap(),
        vec![PartitionId(0), PartitionId(1)]
    );

    let latest = repo.latest(P).await.unwrap().unwrap();
    assert_eq!(latest.snapshot_id, third.id());
    assert_eq!(latest.min_applied_lsn, Lsn(30));
    assert_eq!(latest.archived_lsn, Lsn(10));
    assert_eq!(latest.retained.len(), 3);
    assert_eq!(latest.path, listed[0].path);
}

async fn describe_round_trips_the_metadata(backend: Backend) {
    let repo = repository(backend);
    let e = export(
        1,
        42,
        &[
            ("000011.sst", random_bytes(11, 2048)),
            ("000012.sst", random_bytes(12, 0)),
        ],
    );
    let report = repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    assert_eq!(report.snapshot_id, e.id());
    assert_eq!((report.files, report.total_bytes), (2, 2048));
    assert_eq!((report.uploaded_files, report.uploaded_bytes), (2, 2048));

    let described = repo.metadata(P, e.id()).await.unwrap();
    assert_eq!(described, report.metadata);
    let (partition, found) = repo.find(e.id()).await.unwrap();
    assert_eq!(partition, P);
    assert_eq!(found, described);

    // Exactly the export's metadata, plus what publishing adds.
    let mut expected = e.metadata.clone();
    for (file, published) in expected.files.iter_mut().zip(&described.files) {
        let checksum = published.checksum.expect("publish sets a checksum");
        let hash = xxhash_rust::xxh3::xxh3_128(&e.contents[file.name.trim_start_matches('/')]);
        assert_eq!(checksum.xxh3_128(), hash);
        assert_eq!(
            published.key.as_deref(),
            Some(format!("ssts/{hash:032x}.sst").as_str())
        );
        file.checksum = published.checksum;
        file.key = published.key.clone();
    }
    expected.stats = described.stats;
    assert_eq!(described, expected);

    // metadata.json is where the layout says, and decodes on its own.
    let raw = object_bytes(&repo, 1, &format!("{}/metadata.json", report.path)).await;
    assert_eq!(SnapshotMetadata::from_json(&raw).unwrap(), described);
    assert_eq!(
        report.path,
        format!("snapshots/{:016x}_{}", u64::MAX - 42, e.id())
    );

    let unknown = cairn_snapshots::SnapshotId::generate();
    assert!(matches!(
        repo.find(unknown).await,
        Err(Error::SnapshotNotFound { .. })
    ));
    assert!(matches!(
        repo.metadata(PartitionId(3), e.id()).await,
        Err(Error::SnapshotNotFound { .. })
    ));
}

async fn export_tar_holds_metadata_and_identical_ssts_and_verify_passes(backend: Backend) {
    let repo = repository(backend);
    let e = export(
        1,
        7,
        &[
            ("000030.sst", random_bytes(30, 1267)),
            ("000029.sst", random_bytes(29, 1142)),
            ("000031.sst", random_bytes(31, 512)),
        ],
    );
    repo.publish(e.path(), e.metadata.clone()).await.unwrap();

    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let on_progress: cairn_snapshots::ProgressFn = {
        let seen = seen.clone();
        std::sync::Arc::new(move |done, total| seen.lock().unwrap().push((done, total)))
    };
    let verified = repo
        .verify_with_progress(e.id(), Some(on_progress))
        .await
        .unwrap();
    assert_eq!(verified.files, 3);
    assert_eq!(verified.bytes, 1267 + 1142 + 512);
    assert_eq!(verified.partition_id, P);
    // The read-back is reported as it goes, up to the whole snapshot.
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.windows(2).all(|w| w[0].0 < w[1].0),
        "progress only grows: {seen:?}"
    );
    assert_eq!(
        seen.last(),
        Some(&(verified.bytes, verified.bytes)),
        "{seen:?}"
    );

    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("snapshot.tar");
    let exported = repo.export_tar(e.id(), &out).await.unwrap();
    assert_eq!(exported.files, 3);

    let mut archive = tar::Archive::new(std::fs::File::open(&out).unwrap());
    let mut entries = Vec::new();
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().display().to_string();
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
        entries.push((name, bytes));
    }
    let names: Vec<_> = entries.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        vec!["metadata.json", "000030.sst", "000029.sst", "000031.sst"]
    );
    let metadata = SnapshotMetadata::from_json(&entries[0].1).unwrap();
    assert_eq!(metadata, repo.metadata(P, e.id()).await.unwrap());
    for (name, bytes) in &entries[1..] {
        assert_eq!(bytes, &e.contents[name], "{name} differs in the tar");
    }
    assert!(!out_dir.path().join("snapshot.tar.partial").exists());
}

async fn download_fetches_checked_files(backend: Backend) {
    let repo = repository(backend);
    let e = export(
        1,
        3,
        &[
            ("000001.sst", random_bytes(1, 10_000)),
            ("000002.sst", random_bytes(2, 1)),
        ],
    );
    repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    let staging = tempfile::tempdir().unwrap();
    let target = staging.path().join("restore");
    let (metadata, report) = repo.download(e.id(), &target).await.unwrap();
    assert_eq!(metadata.snapshot_id, e.id());
    assert_eq!((report.files, report.bytes), (2, 10_001));
    let mut names: Vec<_> = std::fs::read_dir(&target)
        .unwrap()
        .map(|d| d.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, vec!["000001.sst", "000002.sst"]);
    for (name, bytes) in &e.contents {
        assert_eq!(&std::fs::read(target.join(name)).unwrap(), bytes);
    }
}

/// What the rate-limit scenarios transfer: 600 kB in two files, at least 2 s at 200 kB/s (the
/// first second's 200 kB at once).
const LIMIT_BYTES_PER_SECOND: u64 = 200_000;

fn six_hundred_kb() -> Export {
    export(
        1,
        3,
        &[
            ("000001.sst", random_bytes(1, 400_000)),
            ("000002.sst", random_bytes(2, 200_000)),
        ],
    )
}

/// A restore or a move's load must not take the link from the node's own traffic: downloads pay
/// into the same bucket as uploads, in a local repository too.
async fn a_download_keeps_to_the_rate_limit(backend: Backend) {
    let repo = repository(backend);
    let e = six_hundred_kb();
    repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    let limited = repo.rate_limited(LIMIT_BYTES_PER_SECOND);
    let staging = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let (_, report) = limited
        .download(e.id(), &staging.path().join("restore"))
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(report.bytes, 600_000);
    assert!(
        took >= std::time::Duration::from_millis(1900),
        "600 kB came down in {took:?} under a limit of 200 kB/s"
    );
    for (name, bytes) in &e.contents {
        assert_eq!(
            &std::fs::read(staging.path().join("restore").join(name)).unwrap(),
            bytes
        );
    }
}

/// Uploads pay into the bucket too, to a local repository as to an object store.
async fn a_publish_keeps_to_the_rate_limit(backend: Backend) {
    let repo = repository(backend);
    let limited = repo.rate_limited(LIMIT_BYTES_PER_SECOND);
    let e = six_hundred_kb();
    let started = std::time::Instant::now();
    limited.publish(e.path(), e.metadata.clone()).await.unwrap();
    let took = started.elapsed();
    assert!(
        took >= std::time::Duration::from_millis(1900),
        "600 kB went up in {took:?} under a limit of 200 kB/s"
    );
    // What went up is whole.
    repo.verify(e.id()).await.unwrap();
}

async fn a_concurrent_latest_update_loses_cleanly(backend: Backend) {
    let repo = repository(backend);
    let base_snapshot = export(1, 10, &[("000001.sst", random_bytes(1, 100))]);
    repo.publish(base_snapshot.path(), base_snapshot.metadata.clone())
        .await
        .unwrap();

    // Two publishers read the same latest.json.
    let read = repo.read_latest(P).await.unwrap();
    let winner = export(1, 20, &[("000002.sst", random_bytes(2, 100))]);
    let loser = export(1, 21, &[("000003.sst", random_bytes(3, 100))]);
    let based_on = |read: &cairn_snapshots::LatestRead| PublishOptions {
        based_on: Some(read.clone()),
        ..PublishOptions::default()
    };
    repo.publish_with(winner.path(), winner.metadata.clone(), based_on(&read))
        .await
        .unwrap();
    let lost = repo
        .publish_with(loser.path(), loser.metadata.clone(), based_on(&read))
        .await
        .unwrap_err();
    assert!(
        matches!(lost, Error::Conflict { partition, snapshot_id } if partition == P && snapshot_id == loser.id()),
        "{lost}"
    );

    // latest.json is the winner's; the loser is invisible, its metadata.json an orphan.
    let latest = repo.latest(P).await.unwrap().unwrap();
    assert_eq!(latest.snapshot_id, winner.id());
    let retained: Vec<_> = latest.retained.iter().map(|r| r.snapshot_id).collect();
    assert_eq!(retained, vec![winner.id(), base_snapshot.id()]);
    let listed: Vec<_> = repo
        .list(Some(P))
        .await
        .unwrap()
        .snapshots
        .iter()
        .map(|s| s.snapshot_id)
        .collect();
    assert_eq!(listed, vec![winner.id(), base_snapshot.id()]);
    assert!(matches!(
        repo.find(loser.id()).await,
        Err(Error::SnapshotNotFound { .. })
    ));
    let orphan = repo.object_path(
        P,
        &format!(
            "{}/metadata.json",
            cairn_snapshots::snapshot_folder(Lsn(21), loser.id())
        ),
    );
    repo.object_store().head(&orphan).await.unwrap();

    // The first publish to an empty partition is a create; a second create loses too.
    let empty = repo.read_latest(PartitionId(2)).await.unwrap();
    assert!(empty.latest.is_none());
    let a = export(2, 1, &[("000001.sst", random_bytes(4, 10))]);
    let b = export(2, 1, &[("000001.sst", random_bytes(5, 10))]);
    repo.publish_with(a.path(), a.metadata.clone(), based_on(&empty))
        .await
        .unwrap();
    let lost = repo
        .publish_with(b.path(), b.metadata.clone(), based_on(&empty))
        .await
        .unwrap_err();
    assert!(matches!(lost, Error::Conflict { .. }), "{lost}");
    let latest = repo.latest(PartitionId(2)).await.unwrap().unwrap();
    assert_eq!(latest.snapshot_id, a.id());
    assert_eq!(latest.retained.len(), 1);
}

async fn a_crash_after_the_ssts_leaves_no_visible_snapshot(backend: Backend) {
    let repo = repository(backend);
    let e = export(1, 10, &[("000001.sst", random_bytes(1, 4096))]);
    crash_then_publish(&repo, &e, PublishStep::SstsUploaded).await;
}

async fn a_crash_after_metadata_json_leaves_no_visible_snapshot(backend: Backend) {
    let repo = repository(backend);
    let e = export(1, 10, &[("000001.sst", random_bytes(1, 4096))]);
    crash_then_publish(&repo, &e, PublishStep::MetadataWritten).await;
}

async fn crash_then_publish(repo: &support::TestRepo, e: &support::Export, step: PublishStep) {
    let stopped = repo
        .publish_with(
            e.path(),
            e.metadata.clone(),
            PublishOptions {
                stop_after: Some(step),
                ..PublishOptions::default()
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(stopped, Error::StoppedAfter { step: s } if s == step));
    // The SSTs are there, but nothing refers to them.
    assert_eq!(sst_keys(repo, 1).await.len(), 1);
    assert!(repo.latest(P).await.unwrap().is_none());
    assert!(repo.list(None).await.unwrap().snapshots.is_empty());
    assert!(matches!(
        repo.find(e.id()).await,
        Err(Error::SnapshotNotFound { .. })
    ));
    assert!(matches!(
        repo.verify(e.id()).await,
        Err(Error::SnapshotNotFound { .. })
    ));

    // Publishing again (the same snapshot) completes it and uploads nothing twice.
    let report = repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    assert_eq!(report.uploaded_files, 0);
    let listed = repo.list(None).await.unwrap().snapshots;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].snapshot_id, e.id());
    // Counted by the attempt that wrote metadata.json; one that found the SSTs there from a
    // crashed attempt uploaded nothing.
    let new_bytes = match step {
        PublishStep::SstsUploaded => 0,
        PublishStep::MetadataWritten => 4096,
    };
    assert_eq!(listed[0].new_bytes, new_bytes);
    repo.verify(e.id()).await.unwrap();
}

async fn a_second_snapshot_uploads_only_new_ssts(backend: Backend) {
    let repo = repository(backend);
    let first = export(
        1,
        100,
        &[
            ("000010.sst", random_bytes(10, 20_000)),
            ("000011.sst", random_bytes(11, 30_000)),
            ("000012.sst", random_bytes(12, 5_000)),
        ],
    );
    let first_report = repo
        .publish(first.path(), first.metadata.clone())
        .await
        .unwrap();
    assert_eq!(first_report.uploaded_bytes, 55_000);

    // A small change: one SST was compacted away, one is new; two are unchanged.
    let second = export(
        1,
        150,
        &[
            ("000010.sst", random_bytes(10, 20_000)),
            ("000011.sst", random_bytes(11, 30_000)),
            ("000013.sst", random_bytes(13, 1_234)),
        ],
    );
    let report = repo
        .publish(second.path(), second.metadata.clone())
        .await
        .unwrap();
    assert_eq!(report.uploaded, vec!["/000013.sst".to_string()]);
    assert_eq!(report.uploaded_files, 1);
    assert_eq!(report.uploaded_bytes, second.size_of(&["000013.sst"]));
    assert_eq!(report.total_bytes, 51_234);
    assert_eq!(
        sst_keys(&repo, 1).await.len(),
        4,
        "shared SSTs are stored once"
    );

    let listed = repo.list(Some(P)).await.unwrap().snapshots;
    assert_eq!(listed[0].new_bytes, 1_234);
    assert_eq!(listed[1].new_bytes, 55_000);
    // Both snapshots are whole.
    repo.verify(first.id()).await.unwrap();
    repo.verify(second.id()).await.unwrap();
    let shared = &repo.metadata(P, second.id()).await.unwrap().files[0];
    assert_eq!(shared.key, first_report.metadata.files[0].key);
}

/// Publishes a three-file snapshot and returns it with the object key of its second file.
async fn published_with_three_files(repo: &support::TestRepo) -> (support::Export, String) {
    let e = export(
        1,
        9,
        &[
            ("000001.sst", random_bytes(1, 1000)),
            ("000002.sst", random_bytes(2, 2000)),
            ("000003.sst", random_bytes(3, 3000)),
        ],
    );
    let report = repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    let key = report.metadata.files[1].key.clone().unwrap();
    (e, key)
}

async fn a_corrupted_object_fails_verify_naming_the_file(backend: Backend) {
    let repo = repository(backend);
    let (e, key) = published_with_three_files(&repo).await;
    let location = repo.object_path(P, &key);

    // Same size, different bytes.
    let mut bytes = e.contents["000002.sst"].clone();
    bytes[1234] ^= 0xff;
    repo.object_store()
        .put(&location, PutPayload::from(bytes))
        .await
        .unwrap();
    let err = repo.verify(e.id()).await.unwrap_err();
    assert!(
        matches!(&err, Error::BadFile { name, key: k, problem: FileProblem::ChecksumMismatch { .. }, .. }
            if name == "/000002.sst" && *k == key),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("000002.sst") && message.contains(&key) && message.contains("checksum"),
        "{message}"
    );
    let staging = tempfile::tempdir().unwrap();
    let err = repo.download(e.id(), staging.path()).await.unwrap_err();
    assert!(
        matches!(&err, Error::BadFile { name, problem: FileProblem::ChecksumMismatch { .. }, .. }
            if name == "/000002.sst"),
        "{err}"
    );
    assert!(!staging.path().join("000002.sst").exists());
    assert!(!staging.path().join("000002.sst.partial").exists());

    // Different size.
    repo.object_store()
        .put(&location, PutPayload::from(vec![7u8; 10]))
        .await
        .unwrap();
    let err = repo.verify(e.id()).await.unwrap_err();
    assert!(
        matches!(
            &err,
            Error::BadFile {
                problem: FileProblem::SizeMismatch {
                    expected: 2000,
                    actual: 10
                },
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("size 10, expected 2000"), "{err}");

    // Download and export refuse it too, and leave nothing that looks complete.
    let staging = tempfile::tempdir().unwrap();
    assert!(matches!(
        repo.download(e.id(), staging.path()).await,
        Err(Error::BadFile { .. })
    ));
    assert!(!staging.path().join("000002.sst").exists());
    assert!(!staging.path().join("000002.sst.partial").exists());
    let out = staging.path().join("out.tar");
    assert!(matches!(
        repo.export_tar(e.id(), &out).await,
        Err(Error::BadFile { .. })
    ));
    assert!(!out.exists());
}

async fn a_missing_object_fails_verify_naming_the_file(backend: Backend) {
    let repo = repository(backend);
    let (e, key) = published_with_three_files(&repo).await;
    repo.object_store()
        .delete(&repo.object_path(P, &key))
        .await
        .unwrap();
    let err = repo.verify(e.id()).await.unwrap_err();
    assert!(
        matches!(&err, Error::BadFile { name, problem: FileProblem::Missing, .. } if name == "/000002.sst"),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("000002.sst") && message.contains(&key) && message.contains("missing"),
        "{message}"
    );
    let staging = tempfile::tempdir().unwrap();
    let err = repo.download(e.id(), staging.path()).await.unwrap_err();
    assert!(
        matches!(&err, Error::BadFile { name, problem: FileProblem::Missing, .. } if name == "/000002.sst"),
        "{err}"
    );
    assert!(!staging.path().join("000002.sst").exists());
}

async fn an_unknown_metadata_version_is_refused(backend: Backend) {
    let repo = repository(backend);
    let e = export(1, 5, &[("000001.sst", random_bytes(1, 10))]);
    let report = repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    let location = repo.object_path(P, &format!("{}/metadata.json", report.path));
    let mut document: serde_json::Value =
        serde_json::from_slice(&report.metadata.to_json_pretty()).unwrap();
    document["version"] = "V2".into();
    repo.object_store()
        .put(
            &location,
            PutPayload::from(serde_json::to_vec(&document).unwrap()),
        )
        .await
        .unwrap();

    let err = repo.metadata(P, e.id()).await.unwrap_err();
    assert!(
        matches!(&err, Error::UnsupportedVersion { found, .. } if found == "V2"),
        "{err}"
    );
    assert!(err.to_string().contains("V2"), "{err}");
    assert!(matches!(
        repo.find(e.id()).await,
        Err(Error::UnsupportedVersion { .. })
    ));
    // Listing reports the partition as unreadable instead of failing.
    let listing = repo.list(Some(P)).await.unwrap();
    assert!(listing.snapshots.is_empty());
    assert!(
        matches!(&listing.unreadable[..], [bad] if bad.partition_id == P
            && matches!(bad.error, Error::UnsupportedVersion { .. })),
        "{listing:?}"
    );
}

async fn multipart_uploads_round_trip(backend: Backend) {
    const MIB: usize = 1024 * 1024;
    let repo = repository_with(
        backend,
        RepositoryOptions {
            multipart_threshold_bytes: 5 * MIB as u64,
            multipart_part_bytes: 5 * MIB as u64,
            ..RepositoryOptions::default()
        },
    );
    // Three parts: 5 + 5 + 2 MiB (S3 needs every part but the last to be at least 5 MiB).
    let big = random_bytes(77, 12 * MIB + 3);
    let e = export(
        1,
        8,
        &[
            ("000100.sst", big.clone()),
            ("000101.sst", random_bytes(78, 1000)),
        ],
    );
    let report = repo.publish(e.path(), e.metadata.clone()).await.unwrap();
    assert_eq!(report.uploaded_bytes, (12 * MIB + 3 + 1000) as u64);
    let key = report.metadata.files[0].key.clone().unwrap();
    assert!(object_bytes(&repo, 1, &key).await == big);
    repo.verify(e.id()).await.unwrap();

    // The plain upload that benchmarks compare against.
    let plain = repo
        .upload_plain(&e.path().join("000100.sst"), "bench/raw.bin")
        .await
        .unwrap();
    assert_eq!(plain.bytes, big.len() as u64);
    assert_eq!(plain.checksum.xxh3_128(), xxhash_rust::xxh3::xxh3_128(&big));
    assert!(plain.location.as_ref().ends_with("bench/raw.bin"));
    let uploaded = repo
        .object_store()
        .get(&plain.location)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(uploaded.as_ref() == big.as_slice());
}

async fn an_older_snapshot_is_not_published_over_a_newer_one(backend: Backend) {
    let repo = repository(backend);
    let newer = export(1, 20, &[("000001.sst", random_bytes(1, 10))]);
    let older = export(1, 19, &[("000002.sst", random_bytes(2, 10))]);
    repo.publish(newer.path(), newer.metadata.clone())
        .await
        .unwrap();
    let err = repo
        .publish(older.path(), older.metadata.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::OlderThanLatest { .. }), "{err}");
    // Refused before uploading anything.
    assert_eq!(sst_keys(&repo, 1).await.len(), 1);
    // Republishing a published snapshot is refused too.
    let err = repo
        .publish(newer.path(), newer.metadata.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::AlreadyPublished { .. }), "{err}");
}

async fn retention_keeps_the_newest_and_reports_the_evicted(backend: Backend) {
    let repo = repository(backend);
    let options = PublishOptions {
        num_retained: Some(2),
        ..PublishOptions::default()
    };
    let exports: Vec<_> = (1..=3u64)
        .map(|i| export(1, i * 10, &[("000001.sst", random_bytes(i, 10))]))
        .collect();
    let mut reports = Vec::new();
    for e in &exports {
        reports.push(
            repo.publish_with(e.path(), e.metadata.clone(), options.clone())
                .await
                .unwrap(),
        );
    }
    assert!(reports[1].evicted.is_empty());
    let evicted: Vec<_> = reports[2].evicted.iter().map(|r| r.snapshot_id).collect();
    assert_eq!(evicted, vec![exports[0].id()]);
    let latest = repo.latest(P).await.unwrap().unwrap();
    assert_eq!(latest.archived_lsn, Lsn(20));
    let listed: Vec<_> = repo
        .list(Some(P))
        .await
        .unwrap()
        .snapshots
        .iter()
        .map(|s| s.snapshot_id)
        .collect();
    assert_eq!(listed, vec![exports[2].id(), exports[1].id()]);
}

async fn progress_reaches_the_total(backend: Backend) {
    let repo = repository(backend);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorder = seen.clone();
    let e = export(
        1,
        1,
        &[
            ("000001.sst", random_bytes(1, 1000)),
            ("000002.sst", random_bytes(2, 3000)),
        ],
    );
    repo.publish_with(
        e.path(),
        e.metadata.clone(),
        PublishOptions {
            on_progress: Some(Arc::new(move |done, total| {
                recorder.lock().unwrap().push((done, total));
            })),
            ..PublishOptions::default()
        },
    )
    .await
    .unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.last(), Some(&(4000, 4000)));
    assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0));
}

/// Many publishers that read the same latest.json race to swap it: exactly one wins. Local only:
/// this exercises the lock of the local compare-and-swap, while moto checks conditions without
/// one, so it cannot be raced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_racing_publishers_have_exactly_one_winner() {
    let repo = Arc::new(repository(Backend::Local));
    let read = repo.read_latest(P).await.unwrap();
    let exports: Vec<_> = (0..8u64)
        .map(|i| Arc::new(export(1, 5, &[("000001.sst", random_bytes(i, 64 * 1024))])))
        .collect();
    let tasks: Vec<_> = exports
        .iter()
        .map(|e| {
            let repo = repo.clone();
            let e = e.clone();
            let options = PublishOptions {
                based_on: Some(read.clone()),
                ..PublishOptions::default()
            };
            tokio::spawn(async move {
                repo.publish_with(e.path(), e.metadata.clone(), options)
                    .await
            })
        })
        .collect();
    let mut winners = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Ok(report) => winners.push(report.snapshot_id),
            Err(Error::Conflict { .. }) => {}
            Err(other) => panic!("unexpected error: {other}"),
        }
    }
    assert_eq!(winners.len(), 1);
    let latest = repo.latest(P).await.unwrap().unwrap();
    assert_eq!(latest.snapshot_id, winners[0]);
    assert_eq!(latest.retained.len(), 1);
}
