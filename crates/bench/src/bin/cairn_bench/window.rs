//! The windowed deduplication workload: batched insert-if-absent of fresh keys at full speed, each
//! with a TTL of one window (`--dedup-window-secs`), for `--dedup-windows` windows, on a Cairn node
//! of its own (so that the other workloads' keys do not count). At the end of each window it
//! records keys/s and the store's size: with expired keys reclaimed by compactions, the size stops
//! growing after the first windows instead of growing with the run.

use crate::Args;
use crate::cairn::Node;
use crate::drive::{self, Figures, Workload};
use cairn_bench::report::progress;

/// One window of the run.
pub struct Window {
    pub figures: Figures,
    /// Bytes in the partitions' SST files and in their memtables, at the window's end.
    pub sst_bytes: u64,
    pub memtable_bytes: u64,
    /// Expired values compactions dropped so far.
    pub dropped: u64,
}

pub async fn run(args: &Args) -> anyhow::Result<Vec<Window>> {
    progress("windowed dedup: starting a node of its own");
    let node = Node::start(args).await?;
    let windows = drive_windows(args, &node).await;
    node.shutdown().await?;
    windows
}

async fn drive_windows(args: &Args, node: &Node) -> anyhow::Result<Vec<Window>> {
    let window_args = Args {
        seconds: args.dedup_window_secs as f64,
        ttl_secs: args.dedup_window_secs,
        ..args.clone()
    };
    let client = node.client().await?;
    let mut connections = node.connections(args.clients).await?;
    let mut windows = Vec::new();
    for window in 1..=args.dedup_windows {
        progress(&format!(
            "windowed dedup: window {window}/{}",
            args.dedup_windows
        ));
        // Each window is a round of its own: its keys are fresh.
        let (figures, back) = drive::drive(
            &window_args,
            Workload::InsertBatch,
            window,
            connections,
            Vec::new(),
        )
        .await?;
        connections = back;
        let size = node.store_size(&client, args.partitions).await?;
        windows.push(Window {
            figures,
            sst_bytes: size.sst_bytes,
            memtable_bytes: size.memtable_bytes,
            dropped: size.expired_dropped,
        });
    }
    Ok(windows)
}

/// The table of windows, and how the store's size at the end compares with its peak.
pub fn print(args: &Args, windows: &[Window]) {
    println!();
    println!(
        "windowed dedup: insert-if-absent of fresh keys, {} per request, TTL {} s, {} windows",
        args.batch, args.dedup_window_secs, args.dedup_windows
    );
    println!(
        "{:>6} {:>12} {:>8} {:>14} {:>14} {:>14} {:>15}",
        "window",
        "keys/s",
        "p99 ms",
        "keys written",
        "SST bytes",
        "memtable bytes",
        "expired dropped"
    );
    let mut written = 0;
    for (i, window) in windows.iter().enumerate() {
        written += window.figures.keys;
        println!(
            "{:>6} {:>12.0} {:>8.2} {:>14} {:>14} {:>14} {:>15}",
            i + 1,
            window.figures.keys_per_second(),
            window.figures.latency(0.99).as_secs_f64() * 1000.0,
            written,
            window.sst_bytes,
            window.memtable_bytes,
            window.dropped
        );
    }
    let size = |w: &Window| w.sst_bytes + w.memtable_bytes;
    if let (Some(last), Some(peak)) = (windows.last(), windows.iter().map(size).max()) {
        println!(
            "store size at the end: {:.2} of its peak, after {} keys of which one window's worth \
             is live",
            size(last) as f64 / peak.max(1) as f64,
            written
        );
    }
}
