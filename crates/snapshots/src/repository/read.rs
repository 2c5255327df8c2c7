//! Reading a published snapshot's files back: verifying them, or downloading them into a
//! staging folder. Every file is checked against its declared size and checksum as it streams;
//! an object larger than its declared size is refused without being read (the store reports
//! its size), and reading stops one byte past the declared size in any case, so a wrong object
//! can never fill a disk.

use super::ProgressFn;
use super::SnapshotRepository;
use super::hashing::{Progress, check_read, copy_hashing, io};
use super::rate_limit::LimitedRead;
use crate::error::FileProblem;
use crate::{Checksum, Error, Result, SnapshotFile, SnapshotId, SnapshotMetadata};
use bytes::Bytes;
use cairn_types::PartitionId;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use object_store::path::Path as ObjectPath;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use xxhash_rust::xxh3::Xxh3;

/// Bytes a download gathers before it writes to its file.
const DOWNLOAD_BUFFER_BYTES: usize = 1024 * 1024;

/// What [`SnapshotRepository::verify`] checked.
#[derive(Debug, Clone)]
pub struct VerifyReport {
    pub snapshot_id: SnapshotId,
    pub partition_id: PartitionId,
    pub files: usize,
    pub bytes: u64,
    pub duration: Duration,
}

/// What [`SnapshotRepository::download`] fetched.
#[derive(Debug, Clone)]
pub struct DownloadReport {
    pub snapshot_id: SnapshotId,
    pub partition_id: PartitionId,
    pub files: usize,
    pub bytes: u64,
    pub duration: Duration,
}

impl SnapshotRepository {
    /// The location of a published file and the problem to report if its metadata lacks what
    /// publishing writes.
    fn published_location(
        &self,
        partition: PartitionId,
        snapshot_id: SnapshotId,
        file: &SnapshotFile,
    ) -> Result<(ObjectPath, String, Checksum)> {
        match (&file.key, file.checksum) {
            (Some(key), Some(checksum)) => {
                Ok((self.object_path(partition, key), key.clone(), checksum))
            }
            _ => Err(Error::BadFile {
                snapshot_id,
                name: file.name.clone(),
                key: file.key.clone().unwrap_or_else(|| "<none>".into()),
                problem: FileProblem::NotPublished,
            }),
        }
    }

    /// Opens a published file's object as a stream of chunks.
    async fn open_file(
        &self,
        snapshot_id: SnapshotId,
        file: &SnapshotFile,
        location: &ObjectPath,
        key: &str,
    ) -> Result<BoxStream<'static, object_store::Result<Bytes>>> {
        match self.store.get(location).await {
            // A larger object is not read at all: it could fill the disk of a download.
            Ok(result) if result.meta.size != file.size => Err(Error::BadFile {
                snapshot_id,
                name: file.name.clone(),
                key: key.into(),
                problem: FileProblem::SizeMismatch {
                    expected: file.size,
                    actual: result.meta.size,
                },
            }),
            Ok(result) => Ok(result.into_stream()),
            Err(object_store::Error::NotFound { .. }) => Err(Error::BadFile {
                snapshot_id,
                name: file.name.clone(),
                key: key.into(),
                problem: FileProblem::Missing,
            }),
            Err(e) => Err(self.store_error("read", location, e)),
        }
    }

    /// Streams one published file through `sink`, then checks its size and checksum.
    pub(super) async fn read_file_checked<F, Fut>(
        &self,
        partition: PartitionId,
        snapshot_id: SnapshotId,
        file: &SnapshotFile,
        mut sink: F,
    ) -> Result<u64>
    where
        F: FnMut(Bytes) -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        let (location, key, expected) = self.published_location(partition, snapshot_id, file)?;
        let mut stream = self.open_file(snapshot_id, file, &location, &key).await?;
        let mut hasher = Xxh3::new();
        let mut size = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.store_error("read", &location, e))?;
            hasher.update(&chunk);
            size += chunk.len() as u64;
            if size > file.size {
                // The object grew since it was opened: stop before passing on a byte too many.
                break;
            }
            sink(chunk).await?;
        }
        check_read(
            snapshot_id,
            file,
            &key,
            expected,
            size,
            Checksum::from_xxh3_128(hasher.digest128()),
        )?;
        Ok(size)
    }

    /// Reads every file of a visible snapshot back and checks its size and checksum. Fails on the
    /// first bad file in metadata order, naming it, its object key and what is wrong.
    pub async fn verify(&self, snapshot_id: SnapshotId) -> Result<VerifyReport> {
        self.verify_with_progress(snapshot_id, None).await
    }

    /// [`SnapshotRepository::verify`], telling `on_progress` the bytes read back so far and the
    /// snapshot's size as it goes (a file read again after a failed attempt counts once).
    pub async fn verify_with_progress(
        &self,
        snapshot_id: SnapshotId,
        on_progress: Option<ProgressFn>,
    ) -> Result<VerifyReport> {
        let started = Instant::now();
        let (partition, metadata) = self.find(snapshot_id).await?;
        let progress = Progress::new(metadata.size(), on_progress);
        let progress = &progress;
        let sizes: Vec<u64> = futures::stream::iter(metadata.files)
            .map(|file| async move {
                self.retry
                    .run("verify", || async {
                        let reported = AtomicU64::new(0);
                        let reported = &reported;
                        let result = self
                            .read_file_checked(partition, snapshot_id, &file, |chunk| async move {
                                let bytes = chunk.len() as u64;
                                reported.fetch_add(bytes, Ordering::Relaxed);
                                progress.advance(bytes);
                                Ok(())
                            })
                            .await;
                        if result.is_err() {
                            progress.rewind(reported.load(Ordering::Relaxed));
                        }
                        result
                    })
                    .await
            })
            .buffered(self.transfer_concurrency)
            .try_collect()
            .await?;
        Ok(VerifyReport {
            snapshot_id,
            partition_id: partition,
            files: sizes.len(),
            bytes: sizes.iter().sum(),
            duration: started.elapsed(),
        })
    }

    /// Downloads a visible snapshot's files into `staging_dir/<name>` (created if missing),
    /// checking each; returns the metadata, whose file list a restore imports.
    pub async fn download(
        &self,
        snapshot_id: SnapshotId,
        staging_dir: &Path,
    ) -> Result<(SnapshotMetadata, DownloadReport)> {
        let (partition, metadata) = self.find(snapshot_id).await?;
        let report = self
            .download_files(partition, &metadata, staging_dir)
            .await?;
        Ok((metadata, report))
    }

    /// Downloads the files of `metadata` (a snapshot of `partition`) into
    /// `staging_dir/<name>`. A file appears under its name only once it is complete, checked and
    /// synced; until then it is `<name>.partial`.
    pub async fn download_files(
        &self,
        partition: PartitionId,
        metadata: &SnapshotMetadata,
        staging_dir: &Path,
    ) -> Result<DownloadReport> {
        let started = Instant::now();
        metadata
            .validate()
            .map_err(|problem| Error::MalformedMetadata {
                location: format!("metadata of snapshot {}", metadata.snapshot_id),
                reason: problem.to_string(),
            })?;
        tokio::fs::create_dir_all(staging_dir)
            .await
            .map_err(|source| Error::Io {
                context: "create the staging folder",
                path: staging_dir.to_path_buf(),
                source,
            })?;
        let snapshot_id = metadata.snapshot_id;
        let sizes: Vec<u64> = futures::stream::iter(metadata.files.clone())
            .map(|file| async move {
                self.retry
                    .run("download", || {
                        self.download_file(partition, snapshot_id, &file, staging_dir)
                    })
                    .await
            })
            .buffered(self.transfer_concurrency)
            .try_collect()
            .await?;
        Ok(DownloadReport {
            snapshot_id: metadata.snapshot_id,
            partition_id: partition,
            files: sizes.len(),
            bytes: sizes.iter().sum(),
            duration: started.elapsed(),
        })
    }

    async fn download_file(
        &self,
        partition: PartitionId,
        snapshot_id: SnapshotId,
        file: &SnapshotFile,
        staging_dir: &Path,
    ) -> Result<u64> {
        // Validated with the metadata.
        let name = stored_file_name(snapshot_id, file)?;
        let target = staging_dir.join(name);
        let partial = staging_dir.join(format!("{name}.partial"));
        if let Some(source) = self.local_file(partition, snapshot_id, file)? {
            return self
                .download_local(snapshot_id, file, source, partial, target)
                .await;
        }
        let result = async {
            let out = PartialFile::create(&partial).await?;
            let (writer, limiter) = (&out, self.rate_limiter.as_ref());
            let size = self
                .read_file_checked(partition, snapshot_id, file, |chunk| async move {
                    if let Some(limiter) = limiter {
                        limiter.acquire(chunk.len() as u64).await;
                    }
                    writer.write(chunk).await
                })
                .await?;
            out.finish(&target).await?;
            Ok(size)
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&partial).await;
        }
        result
    }

    /// The file of a published snapshot file in a local repository: `None` for object stores.
    fn local_file(
        &self,
        partition: PartitionId,
        snapshot_id: SnapshotId,
        file: &SnapshotFile,
    ) -> Result<Option<(PathBuf, String, Checksum)>> {
        let super::LatestWriter::LocalLock(fs) = &self.latest_writer else {
            return Ok(None);
        };
        let (location, key, checksum) = self.published_location(partition, snapshot_id, file)?;
        let path = fs
            .path_to_filesystem(&location)
            .map_err(|e| self.store_error("read", &location, e))?;
        Ok(Some((path, key, checksum)))
    }

    /// [`download_file`](Self::download_file) from a local repository: one blocking task copies
    /// and hashes the file in large reads, each paid for first under a rate limit.
    /// object_store's local reads come in 8 KiB chunks, each a round trip through the blocking
    /// pool, which makes a restore several times slower than a plain copy.
    async fn download_local(
        &self,
        snapshot_id: SnapshotId,
        file: &SnapshotFile,
        (source, key, expected): (PathBuf, String, Checksum),
        partial: PathBuf,
        target: PathBuf,
    ) -> Result<u64> {
        let copy_partial = partial.clone();
        let declared = file.size;
        let limiter = self.rate_limiter.clone();
        let copied = tokio::task::spawn_blocking(move || {
            let input = match std::fs::File::open(&source) {
                Ok(input) => input,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
            let mut output = std::fs::File::create(&copy_partial)?;
            // One byte past the declared size is enough to refuse a larger object.
            let mut input = LimitedRead::new(input.take(declared + 1), limiter);
            let copied = copy_hashing(&mut input, Some(&mut output))?;
            output.sync_all()?;
            Ok(Some(copied))
        })
        .await
        .map_err(|e| io("copy", &partial)(std::io::Error::other(e)))?;
        let checked = match copied {
            Err(e) => Err(io("copy", &partial)(e)),
            Ok(None) => Err(Error::BadFile {
                snapshot_id,
                name: file.name.clone(),
                key,
                problem: FileProblem::Missing,
            }),
            Ok(Some((size, actual))) => {
                check_read(snapshot_id, file, &key, expected, size, actual).map(|()| size)
            }
        };
        match checked {
            Ok(size) => {
                tokio::fs::rename(&partial, &target)
                    .await
                    .map_err(io("rename", &partial))?;
                Ok(size)
            }
            Err(err) => {
                let _ = tokio::fs::remove_file(&partial).await;
                Err(err)
            }
        }
    }
}

/// A file written under a temporary name, then flushed, synced and renamed into place once whole.
/// Writes take `&self`, so a read's callback can hand over each chunk as it arrives. On failure
/// the caller removes the temporary file.
pub(super) struct PartialFile {
    path: PathBuf,
    out: tokio::sync::Mutex<tokio::io::BufWriter<tokio::fs::File>>,
}

impl PartialFile {
    pub(super) async fn create(path: &Path) -> Result<PartialFile> {
        let file = tokio::fs::File::create(path)
            .await
            .map_err(io("create", path))?;
        // Object stores hand out small chunks; each write of a tokio file is a trip through the
        // blocking pool, so gather them first.
        Ok(PartialFile {
            path: path.to_path_buf(),
            out: tokio::sync::Mutex::new(tokio::io::BufWriter::with_capacity(
                DOWNLOAD_BUFFER_BYTES,
                file,
            )),
        })
    }

    pub(super) async fn write(&self, bytes: Bytes) -> Result<()> {
        self.out
            .lock()
            .await
            .write_all(&bytes)
            .await
            .map_err(io("write", &self.path))
    }

    /// Makes the file durable under `target`'s name.
    pub(super) async fn finish(self, target: &Path) -> Result<()> {
        let mut out = self.out.into_inner();
        out.flush().await.map_err(io("write", &self.path))?;
        out.get_mut()
            .sync_all()
            .await
            .map_err(io("sync", &self.path))?;
        drop(out);
        tokio::fs::rename(&self.path, target)
            .await
            .map_err(io("rename", &self.path))
    }
}

/// The name under which `file` of snapshot `snapshot_id` is written to disk (checked when its
/// metadata was read; refused here too rather than trusted).
pub(super) fn stored_file_name(snapshot_id: SnapshotId, file: &SnapshotFile) -> Result<&str> {
    file.file_name()
        .map_err(|problem| Error::MalformedMetadata {
            location: format!("metadata of snapshot {snapshot_id}"),
            reason: problem.to_string(),
        })
}
