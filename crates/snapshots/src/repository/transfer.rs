//! Moving file bytes between local disk and the object store, streaming: hashing an export file,
//! uploading it (one request or multipart), and reading a snapshot's files back to verify them,
//! download them into a staging folder, or pack them into a tar. Nothing here holds more than a
//! bounded number of chunks of a file in memory.

use super::SnapshotRepository;
use super::publish::ProgressFn;
use crate::error::FileProblem;
use crate::{Checksum, Error, Result, SnapshotFile, SnapshotId, SnapshotMetadata};
use bytes::Bytes;
use cairn_types::PartitionId;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use xxhash_rust::xxh3::Xxh3;

/// Chunk size for reading a local file to hash it.
const HASH_CHUNK_BYTES: usize = 1024 * 1024;
/// Parts of one multipart upload in flight at once; each holds a part in memory.
const PARTS_IN_FLIGHT: usize = 2;
/// S3 allows at most this many parts per upload.
const PARTS_MAX: u64 = 10_000;
const TAR_BLOCK: usize = 512;

/// What [`SnapshotRepository::upload_plain`] did.
#[derive(Debug, Clone)]
pub struct UploadReport {
    /// Where the file went, prefix included.
    pub location: ObjectPath,
    pub bytes: u64,
    pub checksum: Checksum,
    pub duration: Duration,
}

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

/// What [`SnapshotRepository::export_tar`] wrote.
#[derive(Debug, Clone)]
pub struct ExportReport {
    pub snapshot_id: SnapshotId,
    pub partition_id: PartitionId,
    pub path: PathBuf,
    pub files: usize,
    /// Bytes of SST files in the tar (the tar itself is slightly larger).
    pub bytes: u64,
    pub duration: Duration,
}

/// Bytes done of a transfer, reported to an optional callback.
pub(crate) struct Progress {
    done: AtomicU64,
    total: u64,
    callback: Option<ProgressFn>,
}

impl Progress {
    pub(crate) fn new(total: u64, callback: Option<ProgressFn>) -> Progress {
        Progress {
            done: AtomicU64::new(0),
            total,
            callback,
        }
    }

    pub(crate) fn advance(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if let Some(callback) = &self.callback {
            callback(done, self.total);
        }
    }

    /// Takes back what a failed attempt reported, before it is retried.
    fn rewind(&self, bytes: u64) {
        if bytes > 0 {
            let done = self.done.fetch_sub(bytes, Ordering::Relaxed) - bytes;
            if let Some(callback) = &self.callback {
                callback(done, self.total);
            }
        }
    }
}

/// Size and checksum of a local file, read in chunks on a blocking thread.
pub(crate) async fn hash_file(path: &Path) -> Result<(u64, Checksum)> {
    let owned = path.to_path_buf();
    let hashed =
        tokio::task::spawn_blocking(move || copy_hashing(&mut std::fs::File::open(&owned)?, None))
            .await;
    match hashed {
        Ok(Ok(hashed)) => Ok(hashed),
        Ok(Err(source)) => Err(Error::Io {
            context: "read export file",
            path: path.to_path_buf(),
            source,
        }),
        Err(join) => Err(Error::Io {
            context: "read export file",
            path: path.to_path_buf(),
            source: std::io::Error::other(join),
        }),
    }
}

/// Reads `input` to its end in large reads, hashing it and, with `output`, copying it there.
/// Returns its size and checksum.
fn copy_hashing(
    input: &mut impl Read,
    mut output: Option<&mut std::fs::File>,
) -> std::io::Result<(u64, Checksum)> {
    use std::io::Write;
    let mut hasher = Xxh3::new();
    let mut buffer = vec![0u8; HASH_CHUNK_BYTES];
    let mut size = 0u64;
    loop {
        let read = match input.read(&mut buffer) {
            Ok(0) => break,
            Ok(read) => read,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buffer[..read]);
        if let Some(output) = output.as_deref_mut() {
            output.write_all(&buffer[..read])?;
        }
        size += read as u64;
    }
    Ok((size, Checksum::from_xxh3_128(hasher.digest128())))
}

/// Fails, naming the file and its object, if what was read back is not what publish wrote.
fn check_read(
    snapshot_id: SnapshotId,
    file: &SnapshotFile,
    key: &str,
    expected: Checksum,
    size: u64,
    actual: Checksum,
) -> Result<()> {
    let bad = |problem| Error::BadFile {
        snapshot_id,
        name: file.name.clone(),
        key: key.to_string(),
        problem,
    };
    if size != file.size {
        return Err(bad(FileProblem::SizeMismatch {
            expected: file.size,
            actual: size,
        }));
    }
    if actual != expected {
        return Err(bad(FileProblem::ChecksumMismatch {
            expected: expected.to_string(),
            actual: actual.to_string(),
        }));
    }
    Ok(())
}

/// Reads up to `limit` bytes; fewer only at the end of the file.
async fn read_chunk(file: &mut tokio::fs::File, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut chunk = Vec::with_capacity(limit);
    file.take(limit as u64).read_to_end(&mut chunk).await?;
    Ok(chunk)
}

impl SnapshotRepository {
    /// Uploads one local file to `key` (relative to the repository's prefix) the way publish
    /// uploads an SST: streaming, multipart above the threshold, retried, rate-limited. For
    /// benchmarks that compare a raw upload with a publish.
    pub async fn upload_plain(&self, local_file: &Path, key: &str) -> Result<UploadReport> {
        let started = Instant::now();
        let location = key
            .split('/')
            .filter(|segment| !segment.is_empty())
            .fold(self.prefix.clone(), |path, segment| path.join(segment));
        let progress = Progress::new(0, None);
        let (bytes, checksum) = self
            .upload_file(local_file, &location, None, &progress)
            .await?;
        Ok(UploadReport {
            location,
            bytes,
            checksum,
            duration: started.elapsed(),
        })
    }

    /// Uploads `path` to `location`, retrying transient failures from the start. With
    /// `expected`, refuses (and does not complete) an upload whose bytes do not hash to it: an
    /// object named by a content hash must hold that content.
    pub(crate) async fn upload_file(
        &self,
        path: &Path,
        location: &ObjectPath,
        expected: Option<Checksum>,
        progress: &Progress,
    ) -> Result<(u64, Checksum)> {
        self.retry
            .run("upload", || async {
                let reported = AtomicU64::new(0);
                let result = self
                    .upload_once(path, location, expected, progress, &reported)
                    .await;
                if result.is_err() {
                    progress.rewind(reported.load(Ordering::Relaxed));
                }
                result
            })
            .await
    }

    async fn upload_once(
        &self,
        path: &Path,
        location: &ObjectPath,
        expected: Option<Checksum>,
        progress: &Progress,
        reported: &AtomicU64,
    ) -> Result<(u64, Checksum)> {
        let io = |context: &'static str| {
            move |source| Error::Io {
                context,
                path: path.to_path_buf(),
                source,
            }
        };
        let size = tokio::fs::metadata(path)
            .await
            .map_err(io("read export file"))?
            .len();
        let changed = |what: String| Error::BadExport {
            path: path.to_path_buf(),
            reason: format!("it changed while being uploaded: {what}"),
        };
        let check = |actual: Checksum| match expected {
            Some(expected) if expected != actual => Err(changed(format!(
                "its checksum went from {expected} to {actual}"
            ))),
            _ => Ok(()),
        };

        if let (None, super::LatestWriter::LocalLock(fs)) =
            (&self.rate_limiter, &self.latest_writer)
        {
            let target = fs
                .path_to_filesystem(location)
                .map_err(|e| self.store_error("upload", location, e))?;
            let source = path.to_path_buf();
            let copied =
                tokio::task::spawn_blocking(move || copy_to_local_object(&source, &target))
                    .await
                    .map_err(|e| io("write to the local repository")(std::io::Error::other(e)))?;
            let (length, checksum, staged) = copied.map_err(io("write to the local repository"))?;
            if length != size {
                let _ = std::fs::remove_file(&staged);
                return Err(changed(format!("its size went from {size} to {length}")));
            }
            if let Err(err) = check(checksum) {
                let _ = std::fs::remove_file(&staged);
                return Err(err);
            }
            let target = fs
                .path_to_filesystem(location)
                .map_err(|e| self.store_error("upload", location, e))?;
            tokio::task::spawn_blocking(move || publish_staged(&staged, &target))
                .await
                .map_err(|e| io("write to the local repository")(std::io::Error::other(e)))?
                .map_err(io("write to the local repository"))?;
            progress.advance(length);
            reported.fetch_add(length, Ordering::Relaxed);
            return Ok((length, checksum));
        }

        if size <= self.multipart_threshold_bytes {
            // Bounded by the threshold, so reading the file whole is fine.
            let owned = path.to_path_buf();
            let read = tokio::task::spawn_blocking(move || {
                std::fs::read(&owned).map(|bytes| {
                    let checksum = Checksum::from_xxh3_128(xxhash_rust::xxh3::xxh3_128(&bytes));
                    (bytes, checksum)
                })
            })
            .await
            .map_err(|e| io("read export file")(std::io::Error::other(e)))?;
            let (bytes, checksum) = read.map_err(io("read export file"))?;
            check(checksum)?;
            let length = bytes.len() as u64;
            if let Some(limiter) = &self.rate_limiter {
                limiter.acquire(length).await;
            }
            self.store
                .put_opts(
                    location,
                    PutPayload::from(bytes),
                    PutOptions::from(PutMode::Overwrite),
                )
                .await
                .map_err(|e| self.store_error("upload", location, e))?;
            progress.advance(length);
            reported.fetch_add(length, Ordering::Relaxed);
            return Ok((length, checksum));
        }

        // Keep within S3's part count for very large files.
        let part_bytes = self.multipart_part_bytes.max(size.div_ceil(PARTS_MAX));
        let part_bytes = usize::try_from(part_bytes).unwrap_or(usize::MAX);
        let mut file = tokio::fs::File::open(path)
            .await
            .map_err(io("read export file"))?;
        let upload = self
            .store
            .put_multipart(location)
            .await
            .map_err(|e| self.store_error("start multipart upload", location, e))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, part_bytes);
        let parts = async {
            let mut hasher = Xxh3::new();
            let mut total = 0u64;
            loop {
                let chunk = read_chunk(&mut file, part_bytes)
                    .await
                    .map_err(io("read export file"))?;
                if chunk.is_empty() {
                    break;
                }
                hasher.update(&chunk);
                let length = chunk.len() as u64;
                total += length;
                if let Some(limiter) = &self.rate_limiter {
                    limiter.acquire(length).await;
                }
                writer
                    .wait_for_capacity(PARTS_IN_FLIGHT)
                    .await
                    .map_err(|e| self.store_error("upload a part to", location, e))?;
                writer.put(Bytes::from(chunk));
                progress.advance(length);
                reported.fetch_add(length, Ordering::Relaxed);
            }
            let checksum = Checksum::from_xxh3_128(hasher.digest128());
            if total != size {
                return Err(changed(format!("its size went from {size} to {total}")));
            }
            check(checksum)?;
            Ok((total, checksum))
        }
        .await;
        match parts {
            Ok(done) => {
                writer
                    .finish()
                    .await
                    .map_err(|e| self.store_error("complete multipart upload of", location, e))?;
                Ok(done)
            }
            Err(err) => {
                if let Err(abort) = writer.abort().await {
                    tracing::warn!(
                        location = %self.describe(location),
                        error = %abort,
                        "could not abort a failed multipart upload; its parts stay until the \
                         bucket's lifecycle rule removes them"
                    );
                }
                Err(err)
            }
        }
    }

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
    async fn read_file_checked<F, Fut>(
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
        let started = Instant::now();
        let (partition, metadata) = self.find(snapshot_id).await?;
        let sizes: Vec<u64> = futures::stream::iter(metadata.files)
            .map(|file| async move {
                self.retry
                    .run("verify", || {
                        self.read_file_checked(partition, snapshot_id, &file, |_| async { Ok(()) })
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
            .map_err(|reason| Error::MalformedMetadata {
                location: format!("metadata of snapshot {}", metadata.snapshot_id),
                reason,
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
        let name = file
            .file_name()
            .map_err(|reason| Error::MalformedMetadata {
                location: format!("metadata of snapshot {snapshot_id}"),
                reason,
            })?;
        let target = staging_dir.join(name);
        let partial = staging_dir.join(format!("{name}.partial"));
        if let Some(source) = self.local_file(partition, snapshot_id, file)? {
            return self
                .download_local(snapshot_id, file, source, partial, target)
                .await;
        }
        let result = async {
            let out = tokio::fs::File::create(&partial)
                .await
                .map_err(io("create", &partial))?;
            // Object stores hand out small chunks; each write of a tokio file is a trip through
            // the blocking pool, so gather them first.
            let out = tokio::sync::Mutex::new(tokio::io::BufWriter::with_capacity(
                DOWNLOAD_BUFFER_BYTES,
                out,
            ));
            let size = self
                .read_file_checked(partition, snapshot_id, file, |chunk| {
                    let out = &out;
                    let partial = &partial;
                    async move {
                        out.lock()
                            .await
                            .write_all(&chunk)
                            .await
                            .map_err(io("write", partial))
                    }
                })
                .await?;
            let mut out = out.into_inner();
            out.flush().await.map_err(io("write", &partial))?;
            let out = out.into_inner();
            out.sync_all().await.map_err(io("sync", &partial))?;
            drop(out);
            tokio::fs::rename(&partial, &target)
                .await
                .map_err(io("rename", &partial))?;
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
    /// and hashes the file in large reads. object_store's local reads come in 8 KiB chunks, each
    /// a round trip through the blocking pool, which makes a restore several times slower than
    /// a plain copy.
    async fn download_local(
        &self,
        snapshot_id: SnapshotId,
        file: &SnapshotFile,
        (source, key, expected): (PathBuf, String, Checksum),
        partial: PathBuf,
        target: PathBuf,
    ) -> Result<u64> {
        let copy_partial = partial.clone();
        let copied = tokio::task::spawn_blocking(move || {
            let mut input = match std::fs::File::open(&source) {
                Ok(input) => input,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
            let mut output = std::fs::File::create(&copy_partial)?;
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

    /// Writes a visible snapshot as one portable tar at `out`: `metadata.json` as stored, then
    /// every file under its name (`000030.sst`), each checked while it streams through. The tar
    /// is written to `<out>.partial` and renamed when complete.
    pub async fn export_tar(&self, snapshot_id: SnapshotId, out: &Path) -> Result<ExportReport> {
        let started = Instant::now();
        let (partition, retained) = self.find_retained(snapshot_id).await?;
        let (raw_metadata, metadata) = self.read_metadata(partition, &retained).await?;
        let mtime = metadata
            .created_at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);

        let mut partial_name = out.as_os_str().to_owned();
        partial_name.push(".partial");
        let partial = PathBuf::from(partial_name);
        let result = async {
            let file = tokio::fs::File::create(&partial)
                .await
                .map_err(io("create", &partial))?;
            let tar = tokio::sync::Mutex::new(tokio::io::BufWriter::new(file));
            let write = |bytes: Bytes| {
                let tar = &tar;
                let partial = &partial;
                async move {
                    tar.lock()
                        .await
                        .write_all(&bytes)
                        .await
                        .map_err(io("write", partial))
                }
            };

            write(
                tar_header("metadata.json", raw_metadata.len() as u64, mtime)
                    .map_err(io("write", &partial))?,
            )
            .await?;
            write(raw_metadata.clone()).await?;
            write(tar_padding_after(raw_metadata.len() as u64)).await?;

            let mut bytes = 0;
            for file in &metadata.files {
                let name = file
                    .file_name()
                    .map_err(|reason| Error::MalformedMetadata {
                        location: format!("metadata of snapshot {snapshot_id}"),
                        reason,
                    })?;
                write(tar_header(name, file.size, mtime).map_err(io("write", &partial))?).await?;
                let size = self
                    .read_file_checked(partition, snapshot_id, file, write)
                    .await?;
                write(tar_padding_after(size)).await?;
                bytes += size;
            }
            // A tar ends with two empty blocks.
            write(Bytes::from_static(&[0u8; 2 * TAR_BLOCK])).await?;
            let mut tar = tar.into_inner();
            tar.flush().await.map_err(io("write", &partial))?;
            tar.get_mut()
                .sync_all()
                .await
                .map_err(io("sync", &partial))?;
            drop(tar);
            tokio::fs::rename(&partial, out)
                .await
                .map_err(io("rename", &partial))?;
            Ok(bytes)
        }
        .await;
        match result {
            Ok(bytes) => Ok(ExportReport {
                snapshot_id,
                partition_id: partition,
                path: out.to_path_buf(),
                files: metadata.files.len(),
                bytes,
                duration: started.elapsed(),
            }),
            Err(err) => {
                let _ = tokio::fs::remove_file(&partial).await;
                Err(err)
            }
        }
    }
}

/// A ustar header for a regular file; tar needs the size before the content, and the metadata
/// has it.
fn tar_header(name: &str, size: u64, mtime: u64) -> std::io::Result<Bytes> {
    let mut header = tar::Header::new_ustar();
    header.set_path(name)?;
    header.set_size(size);
    header.set_mode(0o644);
    header.set_mtime(mtime);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    Ok(Bytes::copy_from_slice(header.as_bytes()))
}

/// Zeros that fill an entry's content up to a whole block.
fn tar_padding_after(size: u64) -> Bytes {
    let remainder = (size % TAR_BLOCK as u64) as usize;
    if remainder == 0 {
        Bytes::new()
    } else {
        Bytes::from(vec![0u8; TAR_BLOCK - remainder])
    }
}

/// Maps an IO error on `path` to [`Error::Io`], for `map_err`.
/// Copies `source` next to `target` as `<target>#<digits>` (a name object_store's local listing
/// ignores, as it does its own staged uploads), hashing it in 1 MiB reads, and syncs the copy.
/// Returns its size, checksum and path; [`publish_staged`] moves it into place. One pass over
/// the bytes in large reads: object_store's local put goes through 8 KiB writes or whole-file
/// buffers.
fn copy_to_local_object(source: &Path, target: &Path) -> std::io::Result<(u64, Checksum, PathBuf)> {
    let parent = target
        .parent()
        .ok_or_else(|| std::io::Error::other("an object path has a folder"))?;
    std::fs::create_dir_all(parent)?;
    let (mut output, staged) = loop {
        let mut staged = target.as_os_str().to_owned();
        staged.push(format!("#{}", rand::random::<u64>()));
        let staged = PathBuf::from(staged);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&staged)
        {
            Ok(file) => break (file, staged),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    };
    let result = std::fs::File::open(source)
        .and_then(|mut input| copy_hashing(&mut input, Some(&mut output)))
        .and_then(|copied| output.sync_all().map(|()| copied));
    match result {
        Ok((size, checksum)) => Ok((size, checksum, staged)),
        Err(e) => {
            let _ = std::fs::remove_file(&staged);
            Err(e)
        }
    }
}

/// Renames a copy made by [`copy_to_local_object`] to `target` and syncs the folders on the way,
/// so the object survives a power loss once this returns.
fn publish_staged(staged: &Path, target: &Path) -> std::io::Result<()> {
    std::fs::rename(staged, target)?;
    let mut folder = target.parent();
    // The object's folder and the one above it, which may have just been created.
    for _ in 0..2 {
        if let Some(dir) = folder {
            std::fs::File::open(dir)?.sync_all()?;
            folder = dir.parent();
        }
    }
    Ok(())
}

/// Bytes a download gathers before it writes to its file.
const DOWNLOAD_BUFFER_BYTES: usize = 1024 * 1024;

fn io(context: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::Io {
        context,
        path,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tar_entries_fill_whole_blocks() {
        assert_eq!(tar_padding_after(0).len(), 0);
        assert_eq!(tar_padding_after(1).len(), 511);
        assert_eq!(tar_padding_after(512).len(), 0);
        assert_eq!(tar_padding_after(1267).len(), 3 * 512 - 1267);
        assert_eq!(tar_header("000030.sst", 1267, 0).unwrap().len(), 512);
    }

    #[tokio::test]
    async fn hashing_a_file_matches_hashing_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..3 * HASH_CHUNK_BYTES + 17).map(|i| i as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let (size, checksum) = hash_file(&path).await.unwrap();
        assert_eq!(size, bytes.len() as u64);
        assert_eq!(checksum.xxh3_128(), xxhash_rust::xxh3::xxh3_128(&bytes));
        assert!(matches!(
            hash_file(&dir.path().join("missing")).await,
            Err(Error::Io { .. })
        ));
    }
}
