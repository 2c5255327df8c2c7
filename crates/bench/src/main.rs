//! `cairn-bench`: durable write throughput of batched puts and insert-if-absent through a Cairn
//! server (gRPC on loopback, local log with fsync, RocksDB apply), beside raw RocksDB doing synced
//! batched writes of the same shape with the same concurrency, in one run.
//!
//! Run: `cargo run --release -p cairn-bench -- [--seconds 10] [--clients 32] [--batch 100]`

use anyhow::Context;
use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry};
use clap::Parser;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Seconds each workload runs
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Concurrent writers
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Keys per batch
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Value size in bytes
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Partitions of the benchmarked cluster
    #[arg(long, default_value_t = 16)]
    partitions: u16,
}

struct Figures {
    keys: u64,
    batches: u64,
    elapsed: Duration,
}

impl Figures {
    fn keys_per_second(&self) -> f64 {
        self.keys as f64 / self.elapsed.as_secs_f64()
    }

    fn line(&self, name: &str) -> String {
        format!(
            "{name:<40} {:>12.0} keys/s {:>10.0} batches/s  ({} keys in {:.1}s)",
            self.keys_per_second(),
            self.batches as f64 / self.elapsed.as_secs_f64(),
            self.keys,
            self.elapsed.as_secs_f64()
        )
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    println!(
        "cairn-bench: {} writers, batches of {} keys, {}-byte values, {}s per workload, {} partitions",
        args.clients, args.batch, args.value_bytes, args.seconds, args.partitions
    );

    let raw = raw_rocksdb(&args)?;
    println!("{}", raw.line("raw RocksDB, synced WriteBatch"));
    let (put, insert) = runtime.block_on(through_server(&args))?;
    println!("{}", put.line("cairn put (gRPC, log fsync, apply)"));
    println!("{}", insert.line("cairn insert-if-absent"));
    println!(
        "ratio cairn/raw: put {:.2}, insert-if-absent {:.2}",
        put.keys_per_second() / raw.keys_per_second(),
        insert.keys_per_second() / raw.keys_per_second()
    );
    Ok(())
}

fn value(args: &Args) -> Bytes {
    Bytes::from(vec![b'v'; args.value_bytes])
}

/// Synced batched writes straight into RocksDB from `clients` threads.
fn raw_rocksdb(args: &Args) -> anyhow::Result<Figures> {
    let dir = tempfile::tempdir()?;
    let mut options = rust_rocksdb::Options::default();
    options.create_if_missing(true);
    let db = Arc::new(rust_rocksdb::DB::open(&options, dir.path()).context("open raw RocksDB")?);
    let stop = Arc::new(AtomicBool::new(false));
    let keys = Arc::new(AtomicU64::new(0));
    let batches = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let threads: Vec<_> = (0..args.clients)
        .map(|c| {
            let (db, stop, keys, batches) =
                (db.clone(), stop.clone(), keys.clone(), batches.clone());
            let (batch_len, value) = (args.batch, value(args));
            std::thread::spawn(move || -> anyhow::Result<()> {
                let mut write_options = rust_rocksdb::WriteOptions::default();
                write_options.set_sync(true);
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut batch = rust_rocksdb::WriteBatch::default();
                    for j in 0..batch_len {
                        batch.put(format!("c{c}-{seq}-{j}"), &value);
                    }
                    db.write_opt(&batch, &write_options)?;
                    seq += 1;
                    keys.fetch_add(batch_len as u64, Ordering::Relaxed);
                    batches.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(args.seconds));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("writer thread")?;
    }
    Ok(Figures {
        keys: keys.load(Ordering::Relaxed),
        batches: batches.load(Ordering::Relaxed),
        elapsed: start.elapsed(),
    })
}

#[derive(Clone, Copy)]
enum Workload {
    Put,
    InsertIfAbsent,
}

async fn through_server(args: &Args) -> anyhow::Result<(Figures, Figures)> {
    let dir = tempfile::tempdir()?;
    let config = cairn_node::Config {
        base_dir: dir.path().to_path_buf(),
        bind_address: "127.0.0.1:0".parse()?,
        num_partitions: args.partitions,
        ..cairn_node::Config::default()
    };
    let node = cairn_node::start(config).await?;
    let address = format!("http://{}", node.local_addr());
    let put = drive(args, &address, Workload::Put).await?;
    let insert = drive(args, &address, Workload::InsertIfAbsent).await?;
    node.shutdown().await?;
    Ok((put, insert))
}

async fn drive(args: &Args, address: &str, workload: Workload) -> anyhow::Result<Figures> {
    let stop = Arc::new(AtomicBool::new(false));
    let keys = Arc::new(AtomicU64::new(0));
    let batches = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        // One connection per writer, as independent clients would have.
        let client = Client::connect(address, &ClientOptions::default()).await?;
        let (stop, keys, batches) = (stop.clone(), keys.clone(), batches.clone());
        let (batch_len, value) = (args.batch, value(args));
        tasks.push(tokio::spawn(async move {
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Each workload writes its own keys, so insert-if-absent always inserts.
                let tag = match workload {
                    Workload::Put => "put",
                    Workload::InsertIfAbsent => "iia",
                };
                let names: Vec<Bytes> = (0..batch_len)
                    .map(|j| Bytes::from(format!("{tag}-c{c}-{seq}-{j}")))
                    .collect();
                match workload {
                    Workload::Put => {
                        let entries = names
                            .into_iter()
                            .map(|key| PutEntry {
                                key,
                                value: value.clone(),
                                ttl: None,
                            })
                            .collect();
                        client.put(entries).await?;
                    }
                    Workload::InsertIfAbsent => {
                        let inserted = client
                            .insert_if_absent(names, value.clone(), Some(Duration::from_secs(3600)))
                            .await?;
                        anyhow::ensure!(inserted.iter().all(|i| *i), "fresh keys must be inserted");
                    }
                }
                seq += 1;
                keys.fetch_add(batch_len as u64, Ordering::Relaxed);
                batches.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for result in futures::future::join_all(tasks).await {
        result??;
    }
    Ok(Figures {
        keys: keys.load(Ordering::Relaxed),
        batches: batches.load(Ordering::Relaxed),
        elapsed: start.elapsed(),
    })
}
