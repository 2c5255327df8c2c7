//! The baseline: synced batched writes straight into RocksDB from `--clients` threads, the same
//! shape and the same keys as the batched put, with nothing in between. Twice: with each
//! client's keys in sequence (the ceiling a user would compare with), and with every key behind
//! the hash of itself, as Cairn's partition store keeps them (`'d' ++ partition_key ++ key`),
//! which its memtables insert in no particular order. Each order keeps one database for all the
//! rounds, as Cairn's node keeps its store: every round adds keys of its own, so that both hold
//! what the earlier rounds wrote and pay for compacting it.

use crate::Args;
use crate::drive::{Figures, Recorder, Workload, request_keys};
use anyhow::Context;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The order in which the baseline's keys reach RocksDB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyOrder {
    /// The batched put's own keys (`put-batch-p0-c<client>-<seq>-<j>`): each client's keys close
    /// together.
    Client,
    /// The same keys behind their partition key, as in Cairn's store: in hash order.
    Hashed,
}

/// A raw RocksDB database of one key order, in a temporary folder, for every round.
pub struct RawDb {
    order: KeyOrder,
    db: Arc<rust_rocksdb::DB>,
    // Dropped after the database, which closes first.
    _dir: tempfile::TempDir,
}

impl RawDb {
    /// Creates it with RocksDB's default options. Blocking.
    pub fn create(order: KeyOrder) -> anyhow::Result<RawDb> {
        let dir = tempfile::tempdir().context("create raw RocksDB's temporary folder")?;
        let mut options = rust_rocksdb::Options::default();
        options.create_if_missing(true);
        let db = rust_rocksdb::DB::open(&options, dir.path()).context("open raw RocksDB")?;
        Ok(RawDb {
            order,
            db: Arc::new(db),
            _dir: dir,
        })
    }

    pub fn order(&self) -> KeyOrder {
        self.order
    }
}

/// Runs round `round` for `--seconds` and returns what it achieved, with the CPU time of this
/// process meanwhile (the writers and RocksDB's own threads). Blocking.
pub fn synced_batches(args: &Args, raw: &RawDb, round: usize) -> anyhow::Result<Figures> {
    let (db, order) = (&raw.db, raw.order);
    let stop = Arc::new(AtomicBool::new(false));
    let cpu_before = cairn_bench::cpu_seconds("self")?;
    let start = Instant::now();
    let threads: Vec<_> = (0..args.clients)
        .map(|c| {
            let (db, stop, args) = (db.clone(), stop.clone(), args.clone());
            let batch_len = args.batch;
            std::thread::spawn(move || -> anyhow::Result<Recorder> {
                let mut write_options = rust_rocksdb::WriteOptions::default();
                write_options.set_sync(true);
                let mut recorder = Recorder::default();
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut batch = rust_rocksdb::WriteBatch::default();
                    for key in request_keys(&args, Workload::PutBatch, round, c, seq) {
                        let value = args.value_for(&key);
                        match order {
                            KeyOrder::Client => batch.put(key, &value),
                            KeyOrder::Hashed => {
                                let mut hashed = Vec::with_capacity(9 + key.len());
                                hashed.push(b'd');
                                hashed.extend_from_slice(
                                    &cairn_types::partition_key(&key).to_be_bytes(),
                                );
                                hashed.extend_from_slice(&key);
                                batch.put(hashed, &value);
                            }
                        }
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
    let mut figures = Figures::new(recorders, start.elapsed());
    figures.cpu = Some(cairn_bench::cpu_seconds("self")? - cpu_before);
    Ok(figures)
}
