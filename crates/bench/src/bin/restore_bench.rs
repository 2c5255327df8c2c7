//! `cairn-restore-bench`: what restoring a partition from a snapshot costs beside a plain copy of
//! the same bytes from the same repository, and how much sooner a partition is back from a
//! snapshot plus the log's tail than from its whole log. One run, one table.
//!
//! 1. Builds one partition (id 0 of 1, so its key range is everything) as a node does: a local
//!    log, a RocksDB store, leadership at epoch 1, and puts of `--batch` keys per record through
//!    the log until all but `--tail-percent` of the `--keys` keys are written. Snapshots it with
//!    the node's snapshot producer to a local repository and to S3 (moto's server on loopback,
//!    started here), then writes the tail through the log.
//! 2. Restores the snapshot from each repository into a fresh, empty RocksDB with the node's
//!    restorer, beside a plain copy of the same objects from the same repository into a folder on
//!    the same file system, with the same concurrency, each file synced as the restore syncs it.
//! 3. Recovers the partition twice from the same, never trimmed log: (A) restore from the local
//!    repository, then replay the tail; (B) replay the whole log into an empty store.
//!
//! Every restore and recovery is checked against a sample of keys (from before and after the
//! snapshot) and a key that was never written; a wrong or missing value fails the run.
//!
//! Run: `cargo build --workspace --bins && $CARGO_TARGET_DIR/debug/cairn-restore-bench`

use anyhow::{Context, bail};
use bytes::Bytes;
use cairn_bench::blocking;
use cairn_bench::copy::{CopyWay, Syncs, copy_files, hash_files};
use cairn_bench::report::{Deciles, files, mib_per_sec, progress, secs, size, sync_disks};
use cairn_log::local::{LocalLogOptions, LocalLogProvider};
use cairn_log::{LogProvider, LogState, Loglet};
use cairn_partition_store::{PartitionStore, PartitionStoreManager, StoreOptions};
use cairn_snapshots::test_util::moto::MotoServer;
use cairn_snapshots::{ProgressFn, RepositoryOptions, SnapshotMetadata, SnapshotRepository};
use cairn_types::record::PutEntry;
use cairn_types::{Epoch, KeyRange, LogId, Lsn, NodeId, PartitionId};
use cairn_worker::{
    CreatedSnapshot, Partition, RestoreProgressFn, RestoreStep, Restored, Restorer,
    SnapshotProducer, SystemClock,
};
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

const PARTITION: PartitionId = PartitionId(0);
const NUM_PARTITIONS: u16 = 1;
/// The cluster the benchmark's snapshots belong to.
fn cluster() -> cairn_snapshots::ClusterIdentity {
    cairn_snapshots::ClusterIdentity::new("bench", "2026-01-01T00:00:00.000Z")
}
const NODE: &str = "bench";
const BUCKET: &str = "cairn-restore-bench";
/// object_store reads a local file in chunks of this size (`GetResult::into_stream`); the second
/// plain local copy moves bytes in the same steps.
const OBJECT_STORE_LOCAL_CHUNK_BYTES: usize = 8 * 1024;
/// Room per key in a log record beyond its value: the key and postcard's lengths and tags.
const RECORD_BYTES_PER_KEY_OVERHEAD: usize = 64;

#[derive(Parser, Debug)]
#[command(name = "cairn-restore-bench")]
struct Args {
    /// Keys to write, each once
    #[arg(long, default_value_t = 1_100_000)]
    keys: u64,
    /// Size of each (random, incompressible) value
    #[arg(long, default_value_t = 1000)]
    value_bytes: usize,
    /// Keys per log record (one put)
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    /// Share of the keys written after the snapshot: the log's tail that a restore replays
    #[arg(long, default_value_t = 5.0)]
    tail_percent: f64,
    /// Folder under which the benchmark makes its temporary folder (log, RocksDB stores, local
    /// repository, staging, plain copies, moto's spill files); default: the system's temporary
    /// folder
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Files transferred at once, by the restore and by the plain copies
    #[arg(long, default_value_t = RepositoryOptions::default().upload_concurrency)]
    transfer_concurrency: usize,
    /// How often each restore, plain copy and recovery runs; the report shows the median and the
    /// range
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Keys checked after each restore and recovery (half from the snapshot, half from the tail)
    #[arg(long, default_value_t = 1000)]
    verify_keys: usize,
    /// Seed of the values and of the sample of checked keys
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// The keys of the run: `0..snapshot_keys` before the snapshot, `snapshot_keys..keys` after it.
#[derive(Debug, Clone, Copy)]
struct Keys {
    keys: u64,
    snapshot_keys: u64,
    value_bytes: usize,
    seed: u64,
}

impl Keys {
    fn tail_keys(&self) -> u64 {
        self.keys - self.snapshot_keys
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.keys > 0 && args.value_bytes > 0 && args.batch > 0,
        "--keys, --value-bytes and --batch must be at least 1"
    );
    anyhow::ensure!(
        (0.0..100.0).contains(&args.tail_percent),
        "--tail-percent must be in [0, 100): the snapshot must hold some keys"
    );
    anyhow::ensure!(
        args.transfer_concurrency > 0 && args.repeat > 0,
        "--transfer-concurrency and --repeat must be at least 1"
    );
    let record_bytes = args.batch * (args.value_bytes + RECORD_BYTES_PER_KEY_OVERHEAD);
    let record_bytes_max = LocalLogOptions::default().record_bytes_max;
    anyhow::ensure!(
        record_bytes <= record_bytes_max,
        "a put of --batch {} keys of --value-bytes {} makes log records of about {}, above the \
         log's limit of {}; lower --batch",
        args.batch,
        args.value_bytes,
        size(record_bytes as u64),
        size(record_bytes_max as u64)
    );
    let root = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
            tempfile::Builder::new()
                .prefix("cairn-restore-bench-")
                .tempdir_in(dir)?
        }
        None => tempfile::Builder::new()
            .prefix("cairn-restore-bench-")
            .tempdir()?,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(run(&args, root.path()));
    drop(runtime);
    // Explicitly, so that a failure to clean up is seen.
    let path = root.path().to_path_buf();
    if let Err(err) = root.close() {
        eprintln!("could not remove {}: {err}", path.display());
    }
    result
}

async fn run(args: &Args, root: &Path) -> anyhow::Result<()> {
    let tail_keys = (args.keys as f64 * args.tail_percent / 100.0).round() as u64;
    let keys = Keys {
        keys: args.keys,
        snapshot_keys: args.keys - tail_keys.min(args.keys - 1),
        value_bytes: args.value_bytes,
        seed: args.seed,
    };
    let repository_options = RepositoryOptions {
        upload_concurrency: args.transfer_concurrency,
        ..RepositoryOptions::default()
    };
    println!(
        "cairn-restore-bench: one partition ({PARTITION} of {NUM_PARTITIONS}), {} keys x {}-byte \
         random values ({} of values), {} keys per log record",
        keys.keys,
        keys.value_bytes,
        size(keys.keys * keys.value_bytes as u64),
        args.batch
    );
    println!(
        "snapshot after {} keys; the log's tail after it: {} keys ({}%)",
        keys.snapshot_keys,
        keys.tail_keys(),
        args.tail_percent
    );
    println!(
        "transfers: {} files at once (restore and plain copies); local log and partition store \
         with default options",
        args.transfer_concurrency
    );
    println!("work folder: {}", root.display());

    // moto first: a missing moto fails the run before the long build.
    progress("starting moto's S3 server");
    let local_path = root.join("local-repository");
    // Starting moto waits for it, and opening the local repository creates its folder.
    let (moto, s3, local) = blocking({
        let (root, local_path) = (root.to_path_buf(), local_path.clone());
        move || {
            let moto = MotoServer::start_in(&root);
            moto.create_named_bucket(BUCKET);
            let s3 = Arc::new(SnapshotRepository::open(
                &format!("s3://{BUCKET}/cairn"),
                cluster(),
                moto.repository_options(repository_options.clone()),
            )?);
            let local = Arc::new(SnapshotRepository::open(
                local_path.to_str().context("work folder is not UTF-8")?,
                cluster(),
                repository_options,
            )?);
            Ok((moto, s3, local))
        }
    })
    .await?;

    let mut rng = StdRng::seed_from_u64(args.seed);
    let sample = sample_keys(&mut rng, keys, args.verify_keys);

    // 1. Build.
    let log_dir = root.join("log");
    let build = build(args, keys, root, &log_dir, &local, &s3).await?;
    let snapshot_lsn = build.snapshot.lsn;
    let tail_lsn = build.tail_lsn;

    println!();
    println!("== build: through the log (Partition::put, local log syncing every append)");
    println!(
        "{:<60} {:>9}  ({} records, LSN {}..={snapshot_lsn}, {:.1} MiB/s of values)",
        format!("write {} keys", keys.snapshot_keys),
        secs(build.write_time),
        build.snapshot_records,
        snapshot_lsn.0 + 1 - build.snapshot_records,
        mib_per_sec(
            keys.snapshot_keys * keys.value_bytes as u64,
            build.write_time
        )
    );
    println!(
        "{:<60} {:>9}  (so that both snapshots hold the same files)",
        "flush + RocksDB's compactions settling",
        secs(build.settle_time)
    );
    println!(
        "{:<60} {:>9}  {} in {}, LSN {snapshot_lsn}",
        "snapshot -> local (SnapshotProducer::create)",
        secs(build.local_snapshot_time),
        size(build.snapshot.total_bytes),
        files(build.snapshot.total_files)
    );
    println!(
        "{:<60} {:>9}  {}",
        "snapshot -> S3 (moto) (SnapshotProducer::create)",
        secs(build.s3_snapshot_time),
        build.same_files
    );
    println!(
        "{:<60} {:>9}  ({} records, LSN {}..={tail_lsn})",
        format!("write the tail: {} keys", keys.tail_keys()),
        secs(build.tail_time),
        tail_lsn.0 - snapshot_lsn.0,
        snapshot_lsn.0 + 1
    );
    println!(
        "{:<60} {} in {}, LSN 1..={tail_lsn}, never trimmed",
        "log on disk",
        size(build.log_bytes),
        segments(build.log_segments)
    );
    println!(
        "{:<60} {}",
        "SST bytes of the written store (flushed, settled)",
        size(build.sst_bytes)
    );
    println!(
        "{:<60} {snapshot_lsn} / {tail_lsn}",
        "snapshot LSN / tail LSN"
    );

    // 2. Restore throughput, beside plain copies of the same objects. Every measurement runs
    // `--repeat` times, round-robin, so that a slow spell of the disk hits all of them alike.
    let metadata = local
        .metadata(PARTITION, build.snapshot.snapshot_id)
        .await
        .context("read the local snapshot's metadata")?;
    let objects = snapshot_objects(&metadata)?;
    let snapshot_bytes = metadata.size();
    let local_files: Vec<(PathBuf, String)> = objects
        .iter()
        .map(|o| {
            (
                local_path.join(local.object_path(PARTITION, &o.key).as_ref()),
                o.name.clone(),
            )
        })
        .collect();
    let local_paths: Vec<PathBuf> = local_files.iter().map(|(path, _)| path.clone()).collect();
    let expected = Expected {
        keys,
        sample,
        snapshot_lsn,
        tail_lsn,
        snapshot_bytes,
    };

    let mut local_restores = Vec::new();
    let mut local_fs_copy = Samples::default();
    let mut local_chunked_copy = Samples::default();
    let mut local_get = Samples::default();
    let mut local_hash = Samples::default();
    let mut s3_restores = Vec::new();
    let mut s3_get = Samples::default();
    let plain_dir = root.join("plain-copy");
    for round in 1..=args.repeat {
        let label = |what: &str| format!("{what} ({round}/{})", args.repeat);
        // Each restore goes first in odd rounds and after its plain copies in even ones: the
        // step after a round's deletions of whole copies runs on a busier file system.
        let restore_first = round % 2 == 1;
        let restore_from = |repository: &Arc<SnapshotRepository>, folder: &str, what: String| {
            let (dir, expected) = (root.join(folder), &expected);
            let repository = repository.clone();
            async move { restore_timed(&repository, &what, &dir, expected).await }
        };
        let local_restore = |what| restore_from(&local, "restore-local", what);
        let s3_restore = |what| restore_from(&s3, "restore-s3", what);
        if restore_first {
            local_restores.push(local_restore(label("restore from local")).await?);
        }
        progress(&label("plain copy from local: fs::copy"));
        local_fs_copy.push(
            copy_files(
                &local_files,
                &plain_dir,
                args.transfer_concurrency,
                CopyWay::FsCopy,
                Syncs::Files,
            )
            .await?,
        );
        check_copied(&plain_dir, snapshot_bytes).await?;
        progress(&label("plain copy from local: 8 KiB reads and writes"));
        local_chunked_copy.push(
            copy_files(
                &local_files,
                &plain_dir,
                args.transfer_concurrency,
                CopyWay::UserSpace {
                    chunk_bytes: OBJECT_STORE_LOCAL_CHUNK_BYTES,
                },
                Syncs::Files,
            )
            .await?,
        );
        check_copied(&plain_dir, snapshot_bytes).await?;
        progress(&label("plain GET from local through object_store"));
        local_get.push(get_plain(&local, &objects, &plain_dir, args.transfer_concurrency).await?);
        check_copied(&plain_dir, snapshot_bytes).await?;
        progress(&label("read + xxh3-128 of the local repository's files"));
        local_hash.push(hash_files(&local_paths, args.transfer_concurrency).await?);
        if !restore_first {
            local_restores.push(local_restore(label("restore from local")).await?);
        }
        if restore_first {
            s3_restores.push(s3_restore(label("restore from S3 (moto)")).await?);
        }
        progress(&label("plain GET from S3 (moto)"));
        s3_get.push(get_plain(&s3, &objects, &plain_dir, args.transfer_concurrency).await?);
        check_copied(&plain_dir, snapshot_bytes).await?;
        if !restore_first {
            s3_restores.push(s3_restore(label("restore from S3 (moto)")).await?);
        }
    }

    println!();
    println!(
        "== restore into a fresh, empty RocksDB: {} in {} from each repository; median of {}",
        size(snapshot_bytes),
        files(objects.len()),
        runs(args.repeat)
    );
    println!(
        "{:<60} {:>9} {:>9} {:>15} {:>15}",
        "", "time", "MiB/s", "restore/plain", "range"
    );
    let row = |name: &str, samples: &Samples, restore: Option<Duration>| {
        let time = samples.median();
        let ratio = restore
            .map(|restore| format!("{:.2}x", restore.as_secs_f64() / time.as_secs_f64()))
            .unwrap_or_default();
        println!(
            "{name:<60} {:>9} {:>9.1} {ratio:>15} {:>15}",
            secs(time),
            mib_per_sec(snapshot_bytes, time),
            samples.range()
        );
    };
    let restore_rows = |name: &str, restores: &[(Restored, Duration)]| -> Duration {
        let totals = Samples(restores.iter().map(|(_, time)| *time).collect());
        let median = totals.median();
        let (restored, _) = restores
            .iter()
            .find(|(_, time)| *time == median)
            .expect("the median is one of the samples");
        row(&format!("{name}: Restorer::restore"), &totals, None);
        println!(
            "{:<60} {:>9} {:>9.1}",
            "  download (checked, synced, renamed)",
            secs(restored.download),
            mib_per_sec(snapshot_bytes, restored.download)
        );
        println!(
            "{:<60} {:>9}",
            "  import into RocksDB (hard links)",
            secs(restored.import)
        );
        median
    };
    let local_restore = restore_rows("local", &local_restores);
    row(
        "local: plain copy, fs::copy + fsync",
        &local_fs_copy,
        Some(local_restore),
    );
    row(
        "local: plain copy, 8 KiB reads/writes + fsync",
        &local_chunked_copy,
        Some(local_restore),
    );
    row(
        "local: plain GET (object_store), chunks to file + fsync",
        &local_get,
        Some(local_restore),
    );
    row(
        "local: read + xxh3-128 only (restore's check)",
        &local_hash,
        None,
    );
    let s3_restore = restore_rows("S3 (moto)", &s3_restores);
    row(
        "S3 (moto): plain GET (object_store), chunks to file + fsync",
        &s3_get,
        Some(s3_restore),
    );

    // 3. Recovery: (A) snapshot + tail, (B) the whole log. The writer's log provider is gone, so
    // this one holds the log alone; both recoveries read it.
    sync_disks().await;
    let started = Instant::now();
    let logs = blocking({
        let log_dir = log_dir.clone();
        move || {
            LocalLogProvider::open(&log_dir, LocalLogOptions::default())
                .context("reopen the log folder")
        }
    })
    .await?;
    let log = logs
        .open(LogId::from(PARTITION))
        .await
        .context("reopen the log")?;
    let log_open_time = started.elapsed();
    let state = log.state().await?;
    anyhow::ensure!(
        state.tail == tail_lsn && state.trim_point == Lsn::ZERO,
        "the reopened log ends at LSN {} with trim point {}, not at {tail_lsn} untrimmed",
        state.tail,
        state.trim_point
    );

    let mut from_snapshot = Vec::new();
    let mut from_log = Vec::new();
    for round in 1..=args.repeat {
        let label = |what: &str| format!("{what} ({round}/{})", args.repeat);
        from_snapshot.push(
            recover_from_snapshot(
                &local,
                &log,
                &root.join("recover-snapshot"),
                &expected,
                &label("(A)"),
            )
            .await?,
        );
        from_log.push(
            recover_from_log(&log, &root.join("recover-log"), &expected, &label("(B)")).await?,
        );
    }
    drop(log);
    drop(logs);

    let a_totals = Samples(from_snapshot.iter().map(|a| a.total()).collect());
    let a_median = a_totals.median();
    let a = from_snapshot
        .iter()
        .find(|a| a.total() == a_median)
        .expect("the median is one of the samples");
    let b_totals = Samples(from_log.iter().map(|b| b.replay_time).collect());
    let b_median = b_totals.median();
    // The highest peak of the runs, and how far above its start it was: the peak includes what
    // earlier steps left allocated, the growth is the recovery's own.
    let peak = |peaks: Vec<Option<(u64, u64)>>| -> String {
        peaks
            .into_iter()
            .collect::<Option<Vec<(u64, u64)>>>()
            .and_then(|peaks| peaks.into_iter().max_by_key(|&(_, peak)| peak))
            .map(|(start, peak)| format!("{} (+{})", size(peak), size(peak.saturating_sub(start))))
            .unwrap_or_else(|| "n/a".into())
    };

    println!();
    println!(
        "== recovery from the same log ({tail_lsn} records, never trimmed): (A) snapshot + tail, \
         (B) whole log; median of {}",
        runs(args.repeat)
    );
    println!(
        "{:<60} {:>9}  (once, before all of them; not in the totals)",
        format!(
            "open the log (recovery scan of {})",
            segments(build.log_segments)
        ),
        secs(log_open_time)
    );
    println!(
        "{:<60} {:>9} {:>22} {:>15}",
        "", "time", "peak RSS", "range"
    );
    println!(
        "{:<60} {:>9}  download {}, import {}",
        "(A) restore from the local repository",
        secs(a.restore_time),
        secs(a.restored.download),
        secs(a.restored.import)
    );
    println!(
        "{:<60} {:>9}",
        format!(
            "(A) replay LSN {}..={tail_lsn} ({} keys)",
            snapshot_lsn.0 + 1,
            keys.tail_keys()
        ),
        secs(a.replay_time)
    );
    println!(
        "{:<60} {:>9} {:>22} {:>15}",
        "(A) total",
        secs(a_median),
        peak(from_snapshot.iter().map(|a| a.peak_rss).collect()),
        a_totals.range()
    );
    println!(
        "{:<60} {:>9} {:>22} {:>15}",
        format!("(B) replay LSN 1..={tail_lsn} ({} keys)", keys.keys),
        secs(b_median),
        peak(from_log.iter().map(|b| b.peak_rss).collect()),
        b_totals.range()
    );
    let replay_rate = keys.keys as f64 / b_median.as_secs_f64();
    let write_rate = keys.snapshot_keys as f64 / build.write_time.as_secs_f64();
    println!(
        "{:<60} {:>9.0}  keys/s, beside {:.0} keys/s writing the same records through the log \
         (build above): replay / writes {:.2}",
        "(B) replay rate",
        replay_rate,
        write_rate,
        replay_rate / write_rate
    );
    println!(
        "{:<60} {:>8.1}x",
        "speed-up of A over B (B total / A total)",
        b_median.as_secs_f64() / a_median.as_secs_f64()
    );
    let written_sample = || expected.sample.iter().filter(|&&i| i < keys.keys);
    println!(
        "verified: after every restore and recovery, {} sampled keys ({} of them from the tail) \
         hold the values written and a key never written is absent; restores hold LSN \
         {snapshot_lsn} and none of the tail, recoveries LSN {tail_lsn}",
        written_sample().count(),
        written_sample()
            .filter(|&&i| i >= keys.snapshot_keys)
            .count()
    );

    println!();
    println!("notes:");
    println!(
        "- the log, the repository's files and moto's objects were just written and sit in the \
         page cache, so every read is served from memory; dirty pages are written back (sync) \
         before each timed step"
    );
    println!(
        "- each restore runs first in odd rounds and after its plain copies in even ones, so \
         that neither always follows the previous round's deletions of whole copies"
    );
    println!(
        "- restore downloads each file to <name>.partial, checks its size and xxh3-128, syncs \
         it and renames it (the staging folder is not synced); the plain copies sync each file \
         the same way; all write to {}",
        root.display()
    );
    println!(
        "- restore copies and hashes each file of a local repository in 1 MiB reads on one \
         blocking task; the plain GETs go through object_store, which reads local files in 8 KiB \
         chunks, each on tokio's blocking pool; fs::copy (copy_file_range) keeps the bytes in \
         the kernel"
    );
    println!(
        "- moto is a Python server on loopback that keeps objects in memory and temporary files: \
         its S3 figures measure moto more than a network"
    );
    if cfg!(debug_assertions) {
        println!(
            "- debug build: Cairn's crates unoptimised, dependencies at opt-level 1, RocksDB's \
             C++ at -O3; replay applies records in Cairn's code, so it gains most from a release \
             build (cargo build --release)"
        );
    } else {
        println!("- release build: Cairn's crates and their dependencies optimised");
    }
    println!(
        "- peak RSS: this process's resident high-water mark during a recovery (reset before \
         each, so it includes what earlier steps left allocated), the highest of the runs, and \
         in brackets how far it rose above the resident size the recovery started from; a \
         partition processor behind its log reads about 64 MiB of records per round, within a \
         budget of 256 MiB for all partitions"
    );
    // Stopping moto waits for its process.
    blocking(move || {
        drop(moto);
        Ok(())
    })
    .await
}

fn key(i: u64) -> String {
    format!("key-{i:012}")
}

/// The value of key `i`: random bytes that only `(seed, i)` determine, so a check can recompute
/// it without keeping a gigabyte of values.
fn value(seed: u64, i: u64, len: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i);
    let mut value = vec![0u8; len];
    rng.fill_bytes(&mut value);
    value
}

/// Indices of the keys checked after each restore and recovery: half drawn from before the
/// snapshot and half from the tail, the keys at both edges of the snapshot, and `keys.keys`,
/// which is never written.
fn sample_keys(rng: &mut StdRng, keys: Keys, n: usize) -> Vec<u64> {
    let draw = |rng: &mut StdRng, range: Range<u64>, n: usize| -> Vec<u64> {
        let len = (range.end - range.start) as usize;
        rand::seq::index::sample(rng, len, n.min(len))
            .into_iter()
            .map(|i| range.start + i as u64)
            .collect()
    };
    let mut sample = BTreeSet::new();
    let tail = n / 2;
    sample.extend(draw(rng, 0..keys.snapshot_keys, n - tail));
    sample.extend(draw(rng, keys.snapshot_keys..keys.keys, tail));
    sample.extend([0, keys.snapshot_keys - 1, keys.keys - 1, keys.keys]);
    if keys.snapshot_keys < keys.keys {
        sample.insert(keys.snapshot_keys);
    }
    sample.into_iter().collect()
}

/// What a restored or recovered store must hold.
struct Expected {
    keys: Keys,
    /// Indices of the keys checked.
    sample: Vec<u64>,
    snapshot_lsn: Lsn,
    tail_lsn: Lsn,
    snapshot_bytes: u64,
}

impl Expected {
    /// A restored store: the keys before the snapshot, none of the tail.
    async fn verify_snapshot(&self, store: &PartitionStore, what: &str) -> anyhow::Result<()> {
        verify_blocking(
            store,
            what,
            self.keys,
            &self.sample,
            self.keys.snapshot_keys,
            self.snapshot_lsn,
        )
        .await
    }

    /// A recovered store: every key.
    async fn verify_tail(&self, store: &PartitionStore, what: &str) -> anyhow::Result<()> {
        verify_blocking(
            store,
            what,
            self.keys,
            &self.sample,
            self.keys.keys,
            self.tail_lsn,
        )
        .await
    }
}

/// [`verify`] on a blocking thread: it reads the store.
async fn verify_blocking(
    store: &PartitionStore,
    what: &str,
    keys: Keys,
    sample: &[u64],
    written: u64,
    lsn: Lsn,
) -> anyhow::Result<()> {
    let (store, what, sample) = (store.clone(), what.to_owned(), sample.to_vec());
    blocking(move || verify(&store, &what, keys, &sample, written, lsn)).await
}

/// Checks that `store` holds exactly keys `0..written` of the sample, with their values, and has
/// applied `lsn`.
fn verify(
    store: &PartitionStore,
    what: &str,
    keys: Keys,
    sample: &[u64],
    written: u64,
    lsn: Lsn,
) -> anyhow::Result<()> {
    let applied = store.applied_lsn()?;
    anyhow::ensure!(
        applied == lsn,
        "{what}: the store has applied LSN {applied}, expected {lsn}"
    );
    for &i in sample {
        let stored = store
            .get(key(i).as_bytes())
            .with_context(|| format!("{what}: read {}", key(i)))?;
        match stored {
            Some(stored) if i < written => {
                let expected = value(keys.seed, i, keys.value_bytes);
                if stored.value[..] != expected[..] || stored.expires_at_ms.is_some() {
                    bail!(
                        "{what}: {} holds a wrong value ({} bytes, expiry {:?}; expected the \
                         {} bytes written, no expiry)",
                        key(i),
                        stored.value.len(),
                        stored.expires_at_ms,
                        expected.len()
                    );
                }
            }
            Some(_) => bail!(
                "{what}: {} is present, but it was {}",
                key(i),
                if i < keys.keys {
                    "written after this store's LSN"
                } else {
                    "never written"
                }
            ),
            None if i < written => bail!("{what}: {} is missing", key(i)),
            None => {}
        }
    }
    Ok(())
}

/// What building the partition produced.
struct Build {
    snapshot: CreatedSnapshot,
    snapshot_records: u64,
    tail_lsn: Lsn,
    write_time: Duration,
    settle_time: Duration,
    local_snapshot_time: Duration,
    s3_snapshot_time: Duration,
    /// Whether both repositories hold the same SST objects, as a sentence.
    same_files: String,
    tail_time: Duration,
    log_bytes: u64,
    log_segments: usize,
    sst_bytes: u64,
}

/// Writes the keys through the log, snapshots to both repositories, writes the tail, then shuts
/// the partition down and closes its log, so that the log folder is free for the recoveries.
async fn build(
    args: &Args,
    keys: Keys,
    root: &Path,
    log_dir: &Path,
    local: &Arc<SnapshotRepository>,
    s3: &Arc<SnapshotRepository>,
) -> anyhow::Result<Build> {
    let db = root.join("written-db");
    let (logs, stores, store) = blocking({
        let (log_dir, db) = (log_dir.to_path_buf(), db.clone());
        move || {
            let logs = LocalLogProvider::open(&log_dir, LocalLogOptions::default())
                .context("open the log folder")?;
            let stores = Arc::new(PartitionStoreManager::open(&db, &StoreOptions::default())?);
            let store = stores.open_or_create_partition(PARTITION)?;
            Ok((logs, stores, store))
        }
    })
    .await?;
    let log = logs
        .open(LogId::from(PARTITION))
        .await
        .context("open the log")?;
    let partition = start_partition(store.clone(), &log).await?;
    partition
        .become_leader(Epoch(1))
        .await
        .context("become the partition's leader")?;

    let started = Instant::now();
    write_through_log(&partition, 0..keys.snapshot_keys, args, keys, "build").await?;
    let write_time = started.elapsed();
    let snapshot_records = keys.snapshot_keys.div_ceil(args.batch as u64);

    // The export flushes anyway; flushing first and letting compactions finish means no
    // compaction runs between the two snapshots, so both repositories get the same files.
    progress("flushing and waiting for RocksDB's compactions to settle");
    let started = Instant::now();
    blocking({
        let (store, stores) = (store.clone(), stores.clone());
        move || {
            store.flush()?;
            stores.wait_for_background_work()?;
            Ok(())
        }
    })
    .await?;
    let settle_time = started.elapsed();

    let export_root = root.join("db-snapshots");
    let (snapshot, local_snapshot_time) =
        snapshot_to(local, &export_root, &partition, "snapshot -> local").await?;
    let (s3_snapshot, s3_snapshot_time) =
        snapshot_to(s3, &export_root, &partition, "snapshot -> S3 (moto)").await?;
    anyhow::ensure!(
        s3_snapshot.lsn == snapshot.lsn,
        "the snapshots are at LSN {} (local) and {} (S3)",
        snapshot.lsn,
        s3_snapshot.lsn
    );
    let object_keys = |metadata: SnapshotMetadata| -> BTreeSet<Option<String>> {
        metadata.files.into_iter().map(|f| f.key).collect()
    };
    let local_keys = object_keys(local.metadata(PARTITION, snapshot.snapshot_id).await?);
    let s3_keys = object_keys(s3.metadata(PARTITION, s3_snapshot.snapshot_id).await?);
    let same_files = if local_keys == s3_keys {
        format!("the same {} as the local one", files(local_keys.len()))
    } else {
        format!(
            "NOT the same files as the local one ({} shared of {} and {}): a compaction ran \
             between the two",
            local_keys.intersection(&s3_keys).count(),
            local_keys.len(),
            s3_keys.len()
        )
    };

    let started = Instant::now();
    write_through_log(
        &partition,
        keys.snapshot_keys..keys.keys,
        args,
        keys,
        "tail",
    )
    .await?;
    let tail_time = started.elapsed();
    let tail_lsn = log.state().await?.tail;
    anyhow::ensure!(
        partition.applied_lsn() == tail_lsn,
        "the partition applied LSN {} of the log's {tail_lsn}",
        partition.applied_lsn()
    );
    verify_blocking(
        &store,
        "the written store",
        keys,
        &[0, keys.keys - 1],
        keys.keys,
        tail_lsn,
    )
    .await?;

    partition.shutdown().await;
    drop(partition);
    drop(log);
    progress("flushing the written store and letting its compactions settle");
    // The node's logs share one write-ahead log; the benchmark's node has one partition, so all
    // of it is that partition's log.
    let log_dir = log_dir.join("wal");
    let (sst_bytes, log_bytes, log_segments) = blocking(move || {
        drop(logs);
        store.flush()?;
        stores.wait_for_background_work()?;
        let sst_bytes = sst_bytes_on_disk(&db)?;
        drop(store);
        drop(stores);
        std::fs::remove_dir_all(&db)?;
        let (log_bytes, log_segments) = log_on_disk(&log_dir)?;
        Ok((sst_bytes, log_bytes, log_segments))
    })
    .await?;

    Ok(Build {
        snapshot,
        snapshot_records,
        tail_lsn,
        write_time,
        settle_time,
        local_snapshot_time,
        s3_snapshot_time,
        same_files,
        tail_time,
        log_bytes,
        log_segments,
        sst_bytes,
    })
}

/// Starts the partition's processor on `store`, on a blocking thread: starting reads the store.
async fn start_partition(
    store: PartitionStore,
    log: &Arc<dyn Loglet>,
) -> anyhow::Result<Arc<Partition>> {
    let log = log.clone();
    blocking(move || {
        Ok(Partition::start(
            KeyRange::of_partition(PARTITION, NUM_PARTITIONS),
            NodeId(NODE.into()),
            store,
            log,
            Arc::new(SystemClock),
        )?)
    })
    .await
}

/// Puts keys `range` through the partition's log, `--batch` keys per record, one record at a time.
async fn write_through_log(
    partition: &Partition,
    range: Range<u64>,
    args: &Args,
    keys: Keys,
    label: &str,
) -> anyhow::Result<()> {
    let mut deciles = Deciles::new(label, range.end - range.start);
    let mut start = range.start;
    while start < range.end {
        let end = (start + args.batch as u64).min(range.end);
        let entries = (start..end)
            .map(|i| PutEntry {
                key: Bytes::from(key(i)),
                value: Bytes::from(value(keys.seed, i, keys.value_bytes)),
                ttl_ms: None,
            })
            .collect();
        partition
            .put(entries)
            .await
            .with_context(|| format!("put keys {start}..{end} through the log"))?;
        start = end;
        deciles.at(start - range.start);
    }
    Ok(())
}

/// Snapshots `partition` to `repository` as the node's producer does; returns the snapshot and the
/// time the call took.
async fn snapshot_to(
    repository: &Arc<SnapshotRepository>,
    export_root: &Path,
    partition: &Partition,
    label: &str,
) -> anyhow::Result<(CreatedSnapshot, Duration)> {
    let producer =
        SnapshotProducer::new(repository.clone(), export_root.to_path_buf(), NODE.into());
    // In hundredths: the total is known only once the export is made.
    let deciles = Mutex::new(Deciles::new(label, 100));
    let on_progress: ProgressFn = Arc::new(move |done, total| {
        deciles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .at(done * 100 / total.max(1));
    });
    progress(label);
    sync_disks().await;
    let started = Instant::now();
    let created = producer
        .create(partition, None, Some(on_progress))
        .await
        .with_context(|| format!("{label}: create the snapshot"))?;
    let time = started.elapsed();
    anyhow::ensure!(
        created.created,
        "{label}: the repository already had a snapshot"
    );
    Ok((created, time))
}

/// One SST object of the snapshot: its file name in a staging folder and its key in the
/// partition's folder of the repository.
struct SnapshotObject {
    name: String,
    key: String,
}

fn snapshot_objects(metadata: &SnapshotMetadata) -> anyhow::Result<Vec<SnapshotObject>> {
    metadata
        .files
        .iter()
        .map(|file| {
            let name = file
                .file_name()
                .map_err(anyhow::Error::msg)
                .context("a snapshot file's name")?
                .to_owned();
            let key = file
                .key
                .clone()
                .with_context(|| format!("snapshot file {name} has no object key"))?;
            Ok(SnapshotObject { name, key })
        })
        .collect()
}

/// Reports a restore's steps as progress lines.
fn restore_progress(label: &str, total: u64) -> RestoreProgressFn {
    let deciles = Mutex::new(Deciles::new(label, total));
    let label = label.to_owned();
    Arc::new(move |step| match step {
        RestoreStep::Downloading { bytes, .. } => {
            deciles.lock().unwrap_or_else(|p| p.into_inner()).at(bytes)
        }
        RestoreStep::Importing { .. } => progress(&format!("{label}: importing")),
        RestoreStep::Replaying { .. } => {}
        RestoreStep::Skipped {
            snapshot_id,
            reason,
        } => progress(&format!(
            "{label}: snapshot {snapshot_id} refused: {reason}"
        )),
    })
}

/// Restores the latest snapshot from `repository` into a fresh, empty RocksDB under `dir` with
/// the node's restorer, for the benchmark's untrimmed log. Returns the store, what the restorer
/// reported and the time its call took (opening the empty RocksDB is not timed).
async fn restore_into_fresh_store(
    repository: &Arc<SnapshotRepository>,
    label: &str,
    dir: &Path,
    expected: &Expected,
) -> anyhow::Result<(Arc<PartitionStoreManager>, Restored, Duration)> {
    let snapshot_bytes = expected.snapshot_bytes;
    let log = LogState {
        trim_point: Lsn::ZERO,
        tail: expected.tail_lsn,
    };
    let db = dir.join("db");
    let stores = Arc::new(
        blocking(move || Ok(PartitionStoreManager::open(&db, &StoreOptions::default())?)).await?,
    );
    let restorer = Restorer::new(
        repository.clone(),
        dir.join("restore-staging"),
        NUM_PARTITIONS,
    );
    progress(label);
    sync_disks().await;
    let started = Instant::now();
    let restored = restorer
        .restore(
            &stores,
            PARTITION,
            log,
            None,
            Some(restore_progress(label, snapshot_bytes)),
        )
        .await
        .with_context(|| format!("{label}: Restorer::restore"))?;
    let time = started.elapsed();
    anyhow::ensure!(
        restored.skipped.is_empty(),
        "{label}: the restore refused {:?}",
        restored.skipped
    );
    Ok((stores, restored, time))
}

/// [`restore_into_fresh_store`], checked against the keys written before the snapshot, then
/// removed.
async fn restore_timed(
    repository: &Arc<SnapshotRepository>,
    label: &str,
    dir: &Path,
    expected: &Expected,
) -> anyhow::Result<(Restored, Duration)> {
    let (stores, restored, time) =
        restore_into_fresh_store(repository, label, dir, expected).await?;
    let store = stores
        .partition(PARTITION)
        .context("no store after the restore")?;
    expected.verify_snapshot(&store, label).await?;
    remove_store(store, stores, dir).await?;
    Ok((restored, time))
}

/// GETs each object of the snapshot from `repository`'s object store into `target/<name>`
/// (created), `concurrency` at a time, writing each chunk as it arrives and syncing each file, as
/// a restore's download does without its checks.
async fn get_plain(
    repository: &SnapshotRepository,
    objects: &[SnapshotObject],
    target: &Path,
    concurrency: usize,
) -> anyhow::Result<Duration> {
    tokio::fs::create_dir_all(target).await?;
    sync_disks().await;
    let started = Instant::now();
    futures::stream::iter(objects)
        .map(|object| async move {
            let location = repository.object_path(PARTITION, &object.key);
            let mut chunks = repository
                .object_store()
                .get(&location)
                .await
                .with_context(|| format!("GET {location}"))?
                .into_stream();
            let path = target.join(&object.name);
            let mut out = tokio::fs::File::create(&path).await?;
            while let Some(chunk) = chunks.next().await {
                let chunk = chunk.with_context(|| format!("read {location}"))?;
                out.write_all(&chunk).await?;
            }
            out.flush().await?;
            out.sync_all().await?;
            anyhow::Ok(())
        })
        .buffer_unordered(concurrency)
        .try_collect::<()>()
        .await?;
    Ok(started.elapsed())
}

/// Checks that `dir` holds `bytes` in all, then removes it (on a blocking thread).
async fn check_copied(dir: &Path, bytes: u64) -> anyhow::Result<()> {
    let dir = dir.to_path_buf();
    blocking(move || {
        let mut copied = 0;
        for entry in std::fs::read_dir(&dir)? {
            copied += entry?.metadata()?.len();
        }
        anyhow::ensure!(
            copied == bytes,
            "the plain copy into {} holds {copied} bytes, not {bytes}",
            dir.display()
        );
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    })
    .await
}

/// Closes a restored or recovered store and removes its folder `dir`, on a blocking thread
/// (closing flushes its memtables).
async fn remove_store(
    store: PartitionStore,
    stores: Arc<PartitionStoreManager>,
    dir: &Path,
) -> anyhow::Result<()> {
    let dir = dir.to_path_buf();
    blocking(move || {
        drop(store);
        drop(stores);
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    })
    .await
}

/// Recovery (A).
struct FromSnapshot {
    restored: Restored,
    restore_time: Duration,
    replay_time: Duration,
    /// Resident bytes when the recovery started, and the high-water mark during it.
    peak_rss: Option<(u64, u64)>,
}

/// Recovery (A): restores the latest snapshot from `repository` into a fresh store, then starts
/// the partition on it and waits until it has applied the log up to `tail_lsn`. The checks
/// between the two steps and after them are not timed.
async fn recover_from_snapshot(
    repository: &Arc<SnapshotRepository>,
    log: &Arc<dyn Loglet>,
    dir: &Path,
    expected: &Expected,
    label: &str,
) -> anyhow::Result<FromSnapshot> {
    let (snapshot_lsn, tail_lsn) = (expected.snapshot_lsn, expected.tail_lsn);
    let rss_start = reset_peak_rss();
    let restore_label = format!("{label} restore from local");
    let (stores, restored, restore_time) =
        restore_into_fresh_store(repository, &restore_label, dir, expected).await?;
    let store = stores
        .partition(PARTITION)
        .context("no store after the restore")?;
    expected.verify_snapshot(&store, &restore_label).await?;

    progress(&format!(
        "{label} replaying LSN {}..={tail_lsn}",
        snapshot_lsn.0 + 1
    ));
    let started = Instant::now();
    let partition = start_partition(store.clone(), log).await?;
    wait_replayed(
        &partition,
        &format!("{label} replay"),
        snapshot_lsn,
        tail_lsn,
    )
    .await?;
    let replay_time = started.elapsed();
    let peak_rss = rss_start.zip(peak_rss());
    partition.shutdown().await;
    drop(partition);
    expected
        .verify_tail(&store, &format!("{label} snapshot + tail"))
        .await?;
    remove_store(store, stores, dir).await?;
    Ok(FromSnapshot {
        restored,
        restore_time,
        replay_time,
        peak_rss,
    })
}

impl FromSnapshot {
    fn total(&self) -> Duration {
        self.restore_time + self.replay_time
    }
}

/// Recovery (B).
struct FromLog {
    replay_time: Duration,
    /// Resident bytes when the recovery started, and the high-water mark during it.
    peak_rss: Option<(u64, u64)>,
}

/// Recovery (B): starts the partition on a fresh, empty store and waits until it has applied the
/// whole log.
async fn recover_from_log(
    log: &Arc<dyn Loglet>,
    dir: &Path,
    expected: &Expected,
    label: &str,
) -> anyhow::Result<FromLog> {
    let tail_lsn = expected.tail_lsn;
    let db = dir.join("db");
    let (stores, store) = blocking(move || {
        let stores = Arc::new(PartitionStoreManager::open(&db, &StoreOptions::default())?);
        let store = stores.open_or_create_partition(PARTITION)?;
        Ok((stores, store))
    })
    .await?;
    let rss_start = reset_peak_rss();
    progress(&format!("{label} replaying LSN 1..={tail_lsn}"));
    sync_disks().await;
    let started = Instant::now();
    let partition = start_partition(store.clone(), log).await?;
    wait_replayed(&partition, &format!("{label} replay"), Lsn::ZERO, tail_lsn).await?;
    let replay_time = started.elapsed();
    let peak_rss = rss_start.zip(peak_rss());
    partition.shutdown().await;
    drop(partition);
    expected
        .verify_tail(&store, &format!("{label} whole log"))
        .await?;
    remove_store(store, stores, dir).await?;
    Ok(FromLog {
        replay_time,
        peak_rss,
    })
}

/// Waits until `partition` has applied `to`, reporting progress from `from`.
async fn wait_replayed(
    partition: &Partition,
    label: &str,
    from: Lsn,
    to: Lsn,
) -> anyhow::Result<()> {
    let mut deciles = Deciles::new(label, to.0.saturating_sub(from.0));
    loop {
        match tokio::time::timeout(Duration::from_millis(250), partition.wait_applied(to)).await {
            Ok(applied) => return Ok(applied?),
            Err(_) => deciles.at(partition.applied_lsn().0.saturating_sub(from.0)),
        }
    }
}

/// The times of one measurement, one per round.
#[derive(Debug, Default)]
struct Samples(Vec<Duration>);

impl Samples {
    fn push(&mut self, time: Duration) {
        self.0.push(time);
    }

    fn sorted(&self) -> Vec<Duration> {
        let mut sorted = self.0.clone();
        sorted.sort();
        sorted
    }

    /// The middle time (the upper one of the two middle ones for an even count).
    fn median(&self) -> Duration {
        let sorted = self.sorted();
        sorted[sorted.len() / 2]
    }

    /// `1.23-1.45 s`; just the time for one sample.
    fn range(&self) -> String {
        let sorted = self.sorted();
        match (sorted.first(), sorted.last()) {
            (Some(min), Some(max)) if sorted.len() > 1 => {
                format!("{:.2}-{:.2} s", min.as_secs_f64(), max.as_secs_f64())
            }
            _ => String::new(),
        }
    }
}

/// `1 run`, `3 runs`.
fn runs(n: usize) -> String {
    if n == 1 {
        "1 run".into()
    } else {
        format!("{n} runs")
    }
}

fn sst_bytes_on_disk(db: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(db)? {
        let entry = entry?;
        if entry.path().extension().is_some_and(|e| e == "sst") {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}

/// `1 segment`, `17 segments`.
fn segments(n: usize) -> String {
    if n == 1 {
        "1 segment".into()
    } else {
        format!("{n} segments")
    }
}

/// Bytes and number of the segment files of the shared write-ahead log in `dir`.
fn log_on_disk(dir: &Path) -> anyhow::Result<(u64, usize)> {
    let mut bytes = 0;
    let mut segments = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("list {}", dir.display()))? {
        let entry = entry?;
        if entry.path().extension().is_some_and(|e| e == "wal") {
            bytes += entry.metadata()?.len();
            segments += 1;
        }
    }
    Ok((bytes, segments))
}

/// Resets this process's resident-memory high-water mark (Linux) and returns the resident bytes
/// it starts from; `None` where that is not possible. A write to procfs, which touches no disk:
/// fine on a runtime thread.
fn reset_peak_rss() -> Option<u64> {
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    proc_status_bytes("VmRSS:")
}

/// This process's resident-memory high-water mark (`VmHWM`), on Linux.
fn peak_rss() -> Option<u64> {
    proc_status_bytes("VmHWM:")
}

/// A `kB` figure of `/proc/self/status`, in bytes.
fn proc_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line
        .trim_start_matches(field)
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_depend_only_on_seed_and_key() {
        assert_eq!(value(1, 7, 100), value(1, 7, 100));
        assert_ne!(value(1, 7, 100), value(1, 8, 100));
        assert_ne!(value(1, 7, 100), value(2, 7, 100));
    }

    #[test]
    fn the_sample_covers_both_sides_of_the_snapshot_and_a_key_never_written() {
        let keys = Keys {
            keys: 1000,
            snapshot_keys: 950,
            value_bytes: 10,
            seed: 1,
        };
        let sample = sample_keys(&mut StdRng::seed_from_u64(1), keys, 100);
        assert!(sample.contains(&0) && sample.contains(&949) && sample.contains(&950));
        assert!(sample.contains(&999) && sample.contains(&1000));
        assert!(sample.iter().filter(|&&i| i >= 950).count() >= 50);
        assert!(sample.iter().filter(|&&i| i < 950).count() >= 50);
    }
}
