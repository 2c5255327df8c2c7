//! `cairn-snapshot-bench`: what publishing a partition snapshot costs beside a plain copy of the
//! same SST bytes to the same place, to a local folder and to S3 (moto's server on loopback,
//! started here), and how much an incremental snapshot uploads once a few keys have changed. One
//! run, one table.
//!
//! 1. Builds one partition of `--bytes` of random (incompressible) values through the partition
//!    store, flushes it and lets RocksDB's compactions settle.
//! 2. Exports the column family and publishes it as the node does (same metadata, same
//!    repository code) to a local repository and to an S3 repository.
//! 3. Copies the same files plainly beside each, with the same concurrency as publish: into a
//!    folder on the same file system with `fs::copy` (in the kernel) and with reads and writes of
//!    one multipart part (through user space), each synced as publish syncs; and into the same
//!    bucket with `SnapshotRepository::upload_plain`. Also times the hashing pass publish makes
//!    before uploading.
//! 4. Rewrites `--change-percent` of the keys, flushes, exports and publishes again to both, and
//!    reports what the incremental snapshot uploaded and whether a compaction got in the way.
//!
//! Run: `cargo build --workspace --bins && $CARGO_TARGET_DIR/debug/cairn-snapshot-bench`

use anyhow::Context;
use cairn_bench::copy::{CopyWay, Syncs, copy_files, hash_files};
use cairn_bench::report::{Deciles, MIB, files, progress, secs, size, sync_disks};
use cairn_partition_store::{
    ColumnFamilyExport, PartitionStore, PartitionStoreManager, StoreOptions,
};
use cairn_snapshots::test_util::moto::MotoServer;
use cairn_snapshots::{
    ProgressFn, PublishOptions, PublishReport, RepositoryOptions, SnapshotId, SnapshotRepository,
};
use cairn_types::{KeyRange, Lsn, PartitionId};
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PARTITION: PartitionId = PartitionId(0);
/// The cluster the benchmark's snapshots belong to.
fn cluster() -> cairn_snapshots::ClusterIdentity {
    cairn_snapshots::ClusterIdentity::new("bench", "2026-01-01T00:00:00.000Z")
}
const NODE: &str = "bench";
const BUCKET: &str = "cairn-snapshot-bench";

#[derive(Parser, Debug)]
#[command(name = "cairn-snapshot-bench")]
struct Args {
    /// Bytes of values to write (keys and SST overhead add a few percent): 1GiB, 256MiB, 5000000
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    bytes: u64,
    /// Size of each (random, incompressible) value
    #[arg(long, default_value_t = 1000)]
    value_bytes: usize,
    /// Keys per write batch
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    /// Share of the keys rewritten, with new values, before the incremental snapshot
    #[arg(long, default_value_t = 1.0)]
    change_percent: f64,
    /// Folder under which the benchmark makes its temporary folder (RocksDB, exports, local
    /// repository, plain copy, moto's spill files); default: the system's temporary folder
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Files transferred at once, by publish and by the plain copies
    #[arg(long, default_value_t = RepositoryOptions::default().upload_concurrency)]
    upload_concurrency: usize,
    /// Seed of the values and of the choice of changed keys
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a size such as 1GiB, 512MiB or 1000000"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown unit {other:?}; use B, KiB, MiB, GiB, KB, MB or GB"
            ));
        }
    };
    Ok((number * scale as f64) as u64)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.value_bytes > 0 && args.batch > 0,
        "values and batches must not be empty"
    );
    anyhow::ensure!(
        args.change_percent > 0.0 && args.change_percent <= 100.0,
        "--change-percent must be in (0, 100]"
    );
    let root = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
            tempfile::Builder::new()
                .prefix("cairn-snapshot-bench-")
                .tempdir_in(dir)?
        }
        None => tempfile::Builder::new()
            .prefix("cairn-snapshot-bench-")
            .tempdir()?,
    };
    let result = run(&args, root.path());
    // Explicitly, so that a failure to clean up is seen.
    let path = root.path().to_path_buf();
    if let Err(err) = root.close() {
        eprintln!("could not remove {}: {err}", path.display());
    }
    result
}

fn run(args: &Args, root: &Path) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let repository_options = RepositoryOptions {
        upload_concurrency: args.upload_concurrency,
        ..RepositoryOptions::default()
    };
    let keys = args.bytes.div_ceil(args.value_bytes as u64);
    println!(
        "cairn-snapshot-bench: one partition, {keys} keys x {}-byte random values ({} of values), \
         default partition-store options",
        args.value_bytes,
        size(keys * args.value_bytes as u64)
    );
    println!(
        "transfers: {} files at once; files above {} in {} parts (repository defaults)",
        repository_options.upload_concurrency,
        size(repository_options.multipart_threshold_bytes),
        size(repository_options.multipart_part_bytes)
    );
    println!("work folder: {}", root.display());

    // moto first: a missing moto fails the run before the long build.
    progress("starting moto's S3 server");
    let moto = MotoServer::start_in(root);
    moto.create_named_bucket(BUCKET);
    let s3 = SnapshotRepository::open(
        &format!("s3://{BUCKET}/cairn"),
        cluster(),
        moto.repository_options(repository_options.clone()),
    )?;
    let local_path = root.join("local-repository");
    let local = SnapshotRepository::open(
        local_path.to_str().context("work folder is not UTF-8")?,
        cluster(),
        repository_options.clone(),
    )?;

    // 1. Build.
    let manager = PartitionStoreManager::open(&root.join("db"), &StoreOptions::default())?;
    let store = manager.open_or_create_partition(PARTITION)?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut lsn = 0u64;
    let started = Instant::now();
    let mut build_progress = Deciles::new("build", keys);
    let mut written = 0u64;
    while written < keys {
        let end = (written + args.batch as u64).min(keys);
        lsn += 1;
        write_keys(&store, &mut rng, written..end, args.value_bytes, Lsn(lsn))?;
        written = end;
        build_progress.at(written);
    }
    let write_time = started.elapsed();
    store.flush()?;
    let build_time = started.elapsed();
    progress("waiting for RocksDB's compactions to settle");
    let settle_started = Instant::now();
    manager.wait_for_background_work()?;
    let settle_time = settle_started.elapsed();
    let sst_bytes = sst_bytes_on_disk(&root.join("db"))?;

    println!();
    println!("== build");
    println!(
        "{:<50} {:>9}  ({} batches of {}, applied LSN {lsn})",
        "write batches (not synced, WAL on)",
        secs(write_time),
        lsn,
        args.batch
    );
    println!("{:<50} {:>9}", "write + flush", secs(build_time));
    println!(
        "{:<50} {:>9}  (before the first snapshot)",
        "compactions settling after the flush",
        secs(settle_time)
    );
    println!("{:<50} {:>9}", "SST bytes on disk", size(sst_bytes));

    // 2. + 3. Full snapshot, publish and plain copy to each destination.
    let exports = root.join("exports");
    std::fs::create_dir_all(&exports)?;
    let full = store.export(&exports.join("full"))?;
    let full_bytes: u64 = full.files.iter().map(|f| f.size).sum();
    println!(
        "{:<50} {:>9}  in {}, {} of them above the multipart threshold",
        "exported column family",
        size(full_bytes),
        files(full.files.len()),
        full.files
            .iter()
            .filter(|f| f.size > repository_options.multipart_threshold_bytes)
            .count()
    );
    println!(
        "{:<50} smallest {}, largest {}",
        "  file sizes",
        size(full.files.iter().map(|f| f.size).min().unwrap_or(0)),
        size(full.files.iter().map(|f| f.size).max().unwrap_or(0))
    );
    println!("{:<50} {}", "  levels", levels(&full));
    let full_files = export_paths(&full);

    let local_publish = runtime.block_on(publish(&local, &full, "full snapshot -> local"))?;
    progress("plain copy -> local folder");
    let plain_dir = root.join("plain-copy");
    let local_plain = runtime.block_on(copy_files(
        &named(&full_files),
        &plain_dir,
        args.upload_concurrency,
        CopyWay::FsCopy,
        Syncs::FilesAndFolder,
    ))?;
    std::fs::remove_dir_all(&plain_dir)?;
    progress("plain copy through user space -> local folder");
    let local_plain_user = runtime.block_on(copy_files(
        &named(&full_files),
        &plain_dir,
        args.upload_concurrency,
        CopyWay::UserSpace {
            chunk_bytes: repository_options.multipart_part_bytes as usize,
        },
        Syncs::FilesAndFolder,
    ))?;
    let s3_publish = runtime.block_on(publish(&s3, &full, "full snapshot -> S3 (moto)"))?;
    progress("upload_plain -> S3 (moto)");
    let s3_plain = runtime.block_on(upload_plain(&s3, &full_files, args.upload_concurrency))?;
    progress("hashing the files as publish does first");
    let hash_only = runtime.block_on(hash_files(&full_files, args.upload_concurrency))?;
    progress("checking every block of the tables, as the node does before it publishes");
    let started = Instant::now();
    full.verify_tables(PARTITION)?;
    let block_check = started.elapsed();
    std::fs::remove_dir_all(&full.dir)?;
    std::fs::remove_dir_all(&plain_dir)?;

    println!();
    println!(
        "== full snapshot: {} in {}",
        size(local_publish.0.total_bytes),
        files(local_publish.0.files)
    );
    println!(
        "{:<50} {:>9} {:>9} {:>15}",
        "", "time", "MiB/s", "publish/plain"
    );
    let row = |name: &str, time: Duration, publish: Option<Duration>| {
        let ratio = publish
            .map(|publish| format!("{:.2}x", publish.as_secs_f64() / time.as_secs_f64()))
            .unwrap_or_default();
        println!(
            "{name:<50} {:>9} {:>9.1} {ratio:>15}",
            secs(time),
            full_bytes as f64 / MIB / time.as_secs_f64()
        )
    };
    row("local: publish", local_publish.1, None);
    row(
        "local: plain copy, fs::copy + fsync",
        local_plain,
        Some(local_publish.1),
    );
    row(
        &format!(
            "local: plain copy, {} reads/writes + fsync",
            size(repository_options.multipart_part_bytes)
        ),
        local_plain_user,
        Some(local_publish.1),
    );
    row("S3 (moto): publish", s3_publish.1, None);
    row("S3 (moto): upload_plain", s3_plain, Some(s3_publish.1));
    row(
        "read + xxh3-128 only (publish's first pass)",
        hash_only,
        None,
    );
    row(
        "block checksums of the tables (before publish)",
        block_check,
        None,
    );
    for (name, report) in [("local", &local_publish.0), ("S3", &s3_publish.0)] {
        anyhow::ensure!(
            report.uploaded_bytes == report.total_bytes,
            "the first {name} snapshot uploaded {} of {} bytes",
            report.uploaded_bytes,
            report.total_bytes
        );
    }

    // 4. Incremental snapshot.
    let changed = ((keys as f64 * args.change_percent / 100.0).round() as u64).max(1);
    progress(&format!("rewriting {changed} random keys"));
    let mut chosen: Vec<u64> = rand::seq::index::sample(&mut rng, keys as usize, changed as usize)
        .into_iter()
        .map(|i| i as u64)
        .collect();
    chosen.sort_unstable();
    let started = Instant::now();
    for chunk in chosen.chunks(args.batch) {
        lsn += 1;
        let mut batch = store.write_batch();
        let mut value = vec![0u8; args.value_bytes];
        for i in chunk {
            rng.fill_bytes(&mut value);
            batch.put(key(*i).as_bytes(), &value, None);
        }
        batch.set_applied_lsn(Lsn(lsn));
        store.commit(batch)?;
    }
    store.flush()?;
    let update_time = started.elapsed();
    let incremental = store.export(&exports.join("incremental"))?;
    let compacting_at_export = store.compaction_in_progress()?;
    let local_incremental = runtime.block_on(publish(
        &local,
        &incremental,
        "incremental snapshot -> local",
    ))?;
    let s3_incremental = runtime.block_on(publish(
        &s3,
        &incremental,
        "incremental snapshot -> S3 (moto)",
    ))?;
    std::fs::remove_dir_all(&incremental.dir)?;

    println!();
    println!(
        "== incremental snapshot: {changed} keys ({}%) rewritten with new values and flushed in {}",
        args.change_percent,
        secs(update_time)
    );
    println!(
        "{:<50} {:>9} {:>12} {:>15} {:>9}",
        "", "uploaded", "of snapshot", "uploaded share", "time"
    );
    let incremental_row = |name: &str, (report, time): &(PublishReport, Duration)| {
        println!(
            "{name:<50} {:>9} {:>12} {:>14.2}% {:>9}",
            size(report.uploaded_bytes),
            size(report.total_bytes),
            100.0 * report.uploaded_bytes as f64 / report.total_bytes as f64,
            secs(*time)
        );
        println!(
            "{:<50} {:>9} {:>12}",
            "  files", report.uploaded_files, report.files
        );
    };
    incremental_row("local: publish", &local_incremental);
    incremental_row("S3 (moto): publish", &s3_incremental);
    println!(
        "{:<50} {}",
        "levels of the exported column family",
        levels(&incremental)
    );
    println!("compaction: {}", compaction_between(&full, &incremental));

    if compacting_at_export {
        println!(
            "compaction: RocksDB was compacting (or had a compaction queued) when the incremental \
             snapshot was exported; the next snapshot carries what it rewrites:"
        );
        progress("waiting for RocksDB's compactions to settle");
        let settle_started = Instant::now();
        manager.wait_for_background_work()?;
        let settle_time = settle_started.elapsed();
        let settled = store.export(&exports.join("settled"))?;
        let local_settled = runtime.block_on(publish(
            &local,
            &settled,
            "snapshot after compaction -> local",
        ))?;
        let s3_settled = runtime.block_on(publish(
            &s3,
            &settled,
            "snapshot after compaction -> S3 (moto)",
        ))?;
        std::fs::remove_dir_all(&settled.dir)?;
        println!();
        println!(
            "== next snapshot, no writes, once the compaction settled ({})",
            secs(settle_time)
        );
        incremental_row("local: publish", &local_settled);
        incremental_row("S3 (moto): publish", &s3_settled);
        println!(
            "{:<50} {}",
            "levels of the exported column family",
            levels(&settled)
        );
        println!("compaction: {}", compaction_between(&incremental, &settled));
    } else {
        println!("compaction: none running or queued when the incremental snapshot was exported");
    }

    println!();
    println!("notes:");
    println!(
        "- publish reads each file twice (hash, then upload), checks the repository for it, then \
         writes metadata.json and latest.json; the plain copies move the bytes once"
    );
    println!(
        "- before it publishes, the node reads every block of the exported tables against its \
         checksum (the block checksums row), so that a damaged table file never reaches the \
         repository; the publish rows do not include it"
    );
    println!(
        "- the incremental publish reuses files this process uploaded, so it checks each with a \
         HEAD; a publish in a fresh process also reads every reused file back once to check its \
         bytes, which these figures do not include"
    );
    println!(
        "- local publish syncs each file and its folder (object_store with fsync), so the plain \
         copies sync each file and the folder too; all write to {}; fs::copy uses \
         copy_file_range, which keeps the bytes in the kernel",
        root.display()
    );
    println!(
        "- the SSTs were just written by RocksDB and sit in the page cache for every reader; \
         dirty pages are written back (sync) before each timed transfer"
    );
    println!(
        "- moto is a Python server on loopback that keeps objects in memory and temporary files: \
         its S3 figures measure moto more than a network"
    );
    drop(store);
    drop(manager);
    drop(moto);
    Ok(())
}

fn key(i: u64) -> String {
    format!("key-{i:012}")
}

fn write_keys(
    store: &PartitionStore,
    rng: &mut StdRng,
    keys: std::ops::Range<u64>,
    value_bytes: usize,
    lsn: Lsn,
) -> anyhow::Result<()> {
    let mut batch = store.write_batch();
    let mut value = vec![0u8; value_bytes];
    for i in keys {
        rng.fill_bytes(&mut value);
        batch.put(key(i).as_bytes(), &value, None);
    }
    batch.set_applied_lsn(lsn);
    store.commit(batch)?;
    Ok(())
}

/// Publishes `export` as the node's snapshot producer does; returns the report and the time the
/// call took.
async fn publish(
    repository: &SnapshotRepository,
    export: &ColumnFamilyExport,
    label: &str,
) -> anyhow::Result<(PublishReport, Duration)> {
    let metadata = cairn_worker::snapshot_metadata(
        export,
        SnapshotId::generate(),
        PARTITION,
        KeyRange::of_partition(PARTITION, 1),
        &cluster(),
        NODE,
    );
    let total = metadata.size();
    let deciles = Arc::new(std::sync::Mutex::new(Deciles::new(label, total)));
    let on_progress: ProgressFn = Arc::new(move |done, _total| {
        deciles.lock().unwrap_or_else(|p| p.into_inner()).at(done);
    });
    let options = PublishOptions {
        on_progress: Some(on_progress),
        ..PublishOptions::default()
    };
    progress(label);
    sync_disks().await;
    let started = Instant::now();
    let report = repository
        .publish_with(&export.dir, metadata, options)
        .await
        .with_context(|| format!("{label}: publish"))?;
    Ok((report, started.elapsed()))
}

/// Uploads `files` to `plain/<name>` in the repository with `upload_plain`, `concurrency` at a
/// time.
async fn upload_plain(
    repository: &SnapshotRepository,
    files: &[PathBuf],
    concurrency: usize,
) -> anyhow::Result<Duration> {
    sync_disks().await;
    let started = Instant::now();
    futures::stream::iter(files)
        .map(|file| async move {
            let name = file
                .file_name()
                .and_then(|n| n.to_str())
                .context("a UTF-8 file name")?;
            repository
                .upload_plain(file, &format!("plain/{name}"))
                .await
                .with_context(|| format!("upload_plain {}", file.display()))?;
            anyhow::Ok(())
        })
        .buffer_unordered(concurrency)
        .try_collect::<()>()
        .await?;
    Ok(started.elapsed())
}

/// Each file with its name, which its plain copy keeps.
fn named(files: &[PathBuf]) -> Vec<(PathBuf, String)> {
    files
        .iter()
        .map(|f| {
            let name = f
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            (f.clone(), name)
        })
        .collect()
}

fn export_paths(export: &ColumnFamilyExport) -> Vec<PathBuf> {
    export
        .files
        .iter()
        .map(|f| export.dir.join(f.name.trim_start_matches('/')))
        .collect()
}

/// The bytes of the table files in the store's folder `db` and its partitions' folders in it.
fn sst_bytes_on_disk(db: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(db)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            total += sst_bytes_on_disk(&entry.path())?;
        } else if entry.path().extension().is_some_and(|e| e == "sst") {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}

/// `L0: 2 files (120.3 MiB), L6: 17 files (1.02 GiB)`
fn levels(export: &ColumnFamilyExport) -> String {
    let mut by_level = std::collections::BTreeMap::<i32, (usize, u64)>::new();
    for file in &export.files {
        let entry = by_level.entry(file.level).or_default();
        entry.0 += 1;
        entry.1 += file.size;
    }
    by_level
        .iter()
        .map(|(level, (count, bytes))| format!("L{level}: {} ({})", files(*count), size(*bytes)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether a compaction replaced files of `before` by the time of `after` (file numbers are never
/// reused within a RocksDB, so a file of `before` missing from `after` was compacted away).
fn compaction_between(before: &ColumnFamilyExport, after: &ColumnFamilyExport) -> String {
    let names = |e: &ColumnFamilyExport| -> BTreeSet<String> {
        e.files.iter().map(|f| f.name.clone()).collect()
    };
    let (old, new) = (names(before), names(after));
    let gone: Vec<_> = before
        .files
        .iter()
        .filter(|f| !new.contains(&f.name))
        .collect();
    let added: Vec<_> = after
        .files
        .iter()
        .filter(|f| !old.contains(&f.name))
        .collect();
    let bytes = |files: &[&cairn_partition_store::ExportedFile]| -> u64 {
        files.iter().map(|f| f.size).sum()
    };
    if gone.is_empty() {
        format!(
            "none between the two snapshots: every file of the earlier one is still live; new: {} \
             ({})",
            files(added.len()),
            size(bytes(&added))
        )
    } else {
        format!(
            "ran between the two snapshots: it replaced {} ({}) of the earlier one; new: {} ({})",
            files(gone.len()),
            size(bytes(&gone)),
            files(added.len()),
            size(bytes(&added))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("256MiB"), Ok(256 << 20));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("5000000"), Ok(5_000_000));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("1TiB").is_err());
    }
}
