//! The threads that run every partition's processor.
//!
//! A processor applies a run of records synchronously, in one poll: RocksDB's commit and lookups
//! block the thread that polls it. Processors therefore run on a runtime of their own, apart from
//! the one that serves requests, whose worker threads do nothing else. It is multi-threaded and
//! work-stealing, so a processor that blocks in RocksDB holds up no other: the others' wakes (log
//! deliveries, which come from outside the pool) wait in the shared queue for the next free
//! thread. Its size is set once per process, before the first partition starts
//! ([`set_apply_threads`]), and does not grow with the partitions a node holds: a node of 1,024
//! partitions runs them on the same few threads as one of 16.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::runtime::{Builder, Handle};

/// The threads asked for (0: [`default_apply_threads`]), and the pool's runtime once the first
/// partition has started it; the runtime then lives as long as the process.
static POOL: Mutex<(usize, Option<Handle>)> = Mutex::new((0, None));

/// The apply threads a process starts when none were asked for: twice the CPUs it may use, and at
/// least 4, so that while some processors block in RocksDB (a commit, a stall behind a flush)
/// others still apply.
fn default_apply_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    (2 * cpus).max(4)
}

/// Sets how many threads run the processors, 0 for twice the CPUs (at least 4). Takes effect only
/// before the first partition of the process starts; returns the number the pool has or will have.
pub fn set_apply_threads(threads: usize) -> usize {
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if pool.1.is_none() {
        pool.0 = threads;
    }
    threads_of(pool.0)
}

fn threads_of(asked: usize) -> usize {
    match asked {
        0 => default_apply_threads(),
        n => n,
    }
}

/// The pool's runtime, started on first use.
pub(crate) fn apply_pool() -> std::io::Result<Handle> {
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(handle) = pool.1.as_ref() {
        return Ok(handle.clone());
    }
    let next = AtomicUsize::new(0);
    let runtime = Builder::new_multi_thread()
        .worker_threads(threads_of(pool.0))
        .thread_name_fn(move || format!("cairn-apply-{}", next.fetch_add(1, Ordering::Relaxed)))
        .enable_all()
        .build()?;
    let handle = runtime.handle().clone();
    // Never dropped: a runtime dropped from within an async context panics, and the processors of
    // a process may run until it exits.
    Box::leak(Box::new(runtime));
    pool.1 = Some(handle.clone());
    Ok(handle)
}
