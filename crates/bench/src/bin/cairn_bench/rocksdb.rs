//! The baseline: synced batched writes straight into RocksDB from `--clients` threads, the same
//! shape as the batched put, with nothing in between.

use crate::Args;
use crate::drive::{Figures, Recorder};
use anyhow::Context;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Runs for `--seconds` and returns what it achieved.
pub fn synced_batches(args: &Args) -> anyhow::Result<Figures> {
    let dir = tempfile::tempdir().context("create raw RocksDB's temporary folder")?;
    let mut options = rust_rocksdb::Options::default();
    options.create_if_missing(true);
    let db = Arc::new(rust_rocksdb::DB::open(&options, dir.path()).context("open raw RocksDB")?);
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let threads: Vec<_> = (0..args.clients)
        .map(|c| {
            let (db, stop) = (db.clone(), stop.clone());
            let (batch_len, value) = (args.batch, args.value());
            std::thread::spawn(move || -> anyhow::Result<Recorder> {
                let mut write_options = rust_rocksdb::WriteOptions::default();
                write_options.set_sync(true);
                let mut recorder = Recorder::default();
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut batch = rust_rocksdb::WriteBatch::default();
                    for j in 0..batch_len {
                        batch.put(format!("c{c}-{seq}-{j}"), &value);
                    }
                    let sent = Instant::now();
                    db.write_opt(&batch, &write_options)
                        .context("write a synced batch to raw RocksDB")?;
                    recorder.record(batch_len, sent.elapsed());
                    seq += 1;
                }
                Ok(recorder)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    stop.store(true, Ordering::Relaxed);
    let mut recorders = Vec::new();
    for thread in threads {
        let recorder = thread
            .join()
            .map_err(|_| anyhow::anyhow!("a raw RocksDB writer thread panicked"))??;
        recorders.push(recorder);
    }
    Ok(Figures::new(recorders, start.elapsed()))
}
