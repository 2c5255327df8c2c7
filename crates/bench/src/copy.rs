//! Plain copies and reads of files: the baselines beside which the benchmarks put publishing and
//! restoring snapshots.

use anyhow::Context;
use futures::{StreamExt, TryStreamExt};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::report::sync_disks;

/// How a plain copy moves bytes.
#[derive(Debug, Clone, Copy)]
pub enum CopyWay {
    /// `std::fs::copy`: `copy_file_range` on Linux, the bytes never reach user space.
    FsCopy,
    /// Reads of up to `chunk_bytes` into a buffer, each written out.
    UserSpace { chunk_bytes: usize },
}

/// What a plain copy syncs, to match what the operation it stands beside syncs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syncs {
    /// Each copied file.
    Files,
    /// Each copied file and, after each, the target folder.
    FilesAndFolder,
}

/// Copies each `(source, name)` to `target/<name>` (`target` is created), `concurrency` at a
/// time; returns the time the copies took, after writing back the machine's dirty pages first.
pub async fn copy_files(
    files: &[(PathBuf, String)],
    target: &Path,
    concurrency: usize,
    way: CopyWay,
    syncs: Syncs,
) -> anyhow::Result<Duration> {
    tokio::fs::create_dir_all(target).await?;
    sync_disks().await;
    let started = Instant::now();
    futures::stream::iter(files.iter().cloned())
        .map(|(source, name)| {
            let target = target.to_path_buf();
            async move {
                tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                    let copy = target.join(name);
                    match way {
                        CopyWay::FsCopy => {
                            std::fs::copy(&source, &copy)
                                .with_context(|| format!("copy {}", source.display()))?;
                            std::fs::File::open(&copy)?.sync_all()?;
                        }
                        CopyWay::UserSpace { chunk_bytes } => {
                            let mut input = std::fs::File::open(&source)?;
                            let mut output = std::fs::File::create(&copy)?;
                            let mut buffer = vec![0u8; chunk_bytes];
                            loop {
                                let mut filled = 0;
                                while filled < buffer.len() {
                                    match input.read(&mut buffer[filled..])? {
                                        0 => break,
                                        read => filled += read,
                                    }
                                }
                                if filled == 0 {
                                    break;
                                }
                                output.write_all(&buffer[..filled])?;
                            }
                            output.sync_all()?;
                        }
                    }
                    if syncs == Syncs::FilesAndFolder {
                        std::fs::File::open(&target)?.sync_all()?;
                    }
                    Ok(())
                })
                .await?
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<()>()
        .await?;
    Ok(started.elapsed())
}

/// Reads and hashes `files` as publish and restore do (xxh3-128 in 1 MiB chunks), `concurrency`
/// at a time; returns the time it took.
pub async fn hash_files(files: &[PathBuf], concurrency: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    futures::stream::iter(files.iter().cloned())
        .map(|path| async move {
            tokio::task::spawn_blocking(move || -> anyhow::Result<u128> {
                let mut file = std::fs::File::open(&path)?;
                let mut hasher = xxhash_rust::xxh3::Xxh3::new();
                let mut buffer = vec![0u8; 1024 * 1024];
                loop {
                    match file.read(&mut buffer)? {
                        0 => break,
                        read => hasher.update(&buffer[..read]),
                    }
                }
                Ok(hasher.digest128())
            })
            .await?
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(started.elapsed())
}
