//! Uploading a local file to an object, streaming. Which way depends on the repository and the
//! file's size:
//!
//! - a local repository without a rate limit: one blocking task copies and hashes the file in
//!   1 MiB reads next to the object as `<object>#<digits>`, syncs it and renames it into place
//!   (object_store's local store writes in 8 KiB chunks, each a trip through the blocking pool);
//! - a file up to the multipart threshold: read whole into memory, one `PUT`;
//! - a larger one: a multipart upload, a bounded number of parts in flight.
//!
//! Each way hashes the bytes it sends; with an expected checksum, an upload whose bytes do not
//! hash to it is abandoned before the object appears (an object named by a content hash must hold
//! that content).
//!
//! # Crash consistency
//! The object appears whole or not at all: a rename, a single `PUT`, or a multipart upload's
//! completion. A crash leaves at most a staged `<object>#<digits>` file (local) or an incomplete
//! multipart upload (S3); the garbage collector sweeps the first after the grace period, a
//! bucket lifecycle rule the second.

use super::SnapshotRepository;
use super::hashing::{Progress, copy_hashing, io};
use super::rate_limit::{LimitedRead, RateLimiter};
use crate::{Checksum, Error, Result};
use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::AsyncReadExt;
use xxhash_rust::xxh3::Xxh3;

/// Parts of one multipart upload in flight at once; each holds a part in memory.
const PARTS_IN_FLIGHT: usize = 2;
/// S3 allows at most this many parts per upload.
const PARTS_MAX: u64 = 10_000;

/// What `SnapshotRepository::upload_plain` did.
#[cfg(feature = "test-util")]
#[derive(Debug, Clone)]
pub struct UploadReport {
    /// Where the file went, prefix included.
    pub location: ObjectPath,
    pub bytes: u64,
    pub checksum: Checksum,
    pub duration: std::time::Duration,
}

/// One upload attempt of one file: what it is checked against, and what it has reported.
struct Attempt<'a> {
    path: &'a Path,
    location: &'a ObjectPath,
    /// The file's size when the attempt started.
    size: u64,
    expected: Option<Checksum>,
    progress: &'a Progress,
    reported: &'a AtomicU64,
}

impl Attempt<'_> {
    fn changed(&self, what: String) -> Error {
        Error::BadExport {
            path: self.path.to_path_buf(),
            reason: format!("it changed while being uploaded: {what}"),
        }
    }

    /// Fails if the bytes sent are not the ones the object's name promises.
    fn check(&self, length: u64, actual: Checksum) -> Result<()> {
        if length != self.size {
            return Err(self.changed(format!("its size went from {} to {length}", self.size)));
        }
        match self.expected {
            Some(expected) if expected != actual => {
                Err(self.changed(format!("its checksum went from {expected} to {actual}")))
            }
            _ => Ok(()),
        }
    }

    fn advance(&self, bytes: u64) {
        self.progress.advance(bytes);
        self.reported.fetch_add(bytes, Ordering::Relaxed);
    }
}

impl SnapshotRepository {
    /// Uploads one local file to `key` (relative to the repository's prefix) the way publish
    /// uploads an SST: streaming, multipart above the threshold, retried, rate-limited. For
    /// benchmarks that compare a raw upload with a publish.
    #[cfg(feature = "test-util")]
    pub async fn upload_plain(&self, local_file: &Path, key: &str) -> Result<UploadReport> {
        let started = std::time::Instant::now();
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
    /// `expected`, refuses (and does not complete) an upload whose bytes do not hash to it.
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

    /// One attempt, by the way that fits the repository and the file (see the
    /// [module documentation](self)).
    async fn upload_once(
        &self,
        path: &Path,
        location: &ObjectPath,
        expected: Option<Checksum>,
        progress: &Progress,
        reported: &AtomicU64,
    ) -> Result<(u64, Checksum)> {
        let size = tokio::fs::metadata(path)
            .await
            .map_err(io("read export file", path))?
            .len();
        let attempt = Attempt {
            path,
            location,
            size,
            expected,
            progress,
            reported,
        };
        if let super::LatestWriter::LocalLock(fs) = &self.latest_writer {
            let target = fs
                .path_to_filesystem(location)
                .map_err(|e| self.store_error("upload", location, e))?;
            self.upload_local(&attempt, target).await
        } else if size <= self.multipart_threshold_bytes {
            self.upload_single(&attempt).await
        } else {
            self.upload_multipart(&attempt).await
        }
    }

    /// The local repository's own copy: staged next to the object, checked, renamed into place.
    async fn upload_local(
        &self,
        attempt: &Attempt<'_>,
        target: PathBuf,
    ) -> Result<(u64, Checksum)> {
        let failed = io("write to the local repository", attempt.path);
        let source = attempt.path.to_path_buf();
        let staging_target = target.clone();
        let limiter = self.rate_limiter.clone();
        let copied = tokio::task::spawn_blocking(move || {
            copy_to_local_object(&source, &staging_target, limiter)
        })
        .await
        .map_err(|e| io("write to the local repository", attempt.path)(std::io::Error::other(e)))?;
        let (length, checksum, staged) = copied.map_err(failed)?;
        if let Err(err) = attempt.check(length, checksum) {
            let _ = tokio::fs::remove_file(&staged).await;
            return Err(err);
        }
        tokio::task::spawn_blocking(move || publish_staged(&staged, &target))
            .await
            .map_err(|e| {
                io("write to the local repository", attempt.path)(std::io::Error::other(e))
            })?
            .map_err(io("write to the local repository", attempt.path))?;
        attempt.advance(length);
        Ok((length, checksum))
    }

    /// One `PUT` of the whole file, read into memory (bounded by the multipart threshold).
    async fn upload_single(&self, attempt: &Attempt<'_>) -> Result<(u64, Checksum)> {
        let owned = attempt.path.to_path_buf();
        let read = tokio::task::spawn_blocking(move || {
            std::fs::read(&owned).map(|bytes| {
                let checksum = Checksum::from_xxh3_128(xxhash_rust::xxh3::xxh3_128(&bytes));
                (bytes, checksum)
            })
        })
        .await
        .map_err(|e| io("read export file", attempt.path)(std::io::Error::other(e)))?;
        let (bytes, checksum) = read.map_err(io("read export file", attempt.path))?;
        let length = bytes.len() as u64;
        attempt.check(length, checksum)?;
        if let Some(limiter) = &self.rate_limiter {
            limiter.acquire(length).await;
        }
        self.store
            .put_opts(
                attempt.location,
                PutPayload::from(bytes),
                PutOptions::from(PutMode::Overwrite),
            )
            .await
            .map_err(|e| self.store_error("upload", attempt.location, e))?;
        attempt.advance(length);
        Ok((length, checksum))
    }

    /// A multipart upload, completed only if the parts sent hash to what was expected; aborted
    /// otherwise.
    async fn upload_multipart(&self, attempt: &Attempt<'_>) -> Result<(u64, Checksum)> {
        let location = attempt.location;
        // Keep within S3's part count for very large files.
        let part_bytes = self
            .multipart_part_bytes
            .max(attempt.size.div_ceil(PARTS_MAX));
        let part_bytes = usize::try_from(part_bytes).unwrap_or(usize::MAX);
        let mut file = tokio::fs::File::open(attempt.path)
            .await
            .map_err(io("read export file", attempt.path))?;
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
                    .map_err(io("read export file", attempt.path))?;
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
                attempt.advance(length);
            }
            let checksum = Checksum::from_xxh3_128(hasher.digest128());
            attempt.check(total, checksum)?;
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
}

/// Reads up to `limit` bytes; fewer only at the end of the file.
async fn read_chunk(file: &mut tokio::fs::File, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut chunk = Vec::with_capacity(limit);
    file.take(limit as u64).read_to_end(&mut chunk).await?;
    Ok(chunk)
}

/// Whether a file name is a staged copy, `<object>#<digits>`: the name [`copy_to_local_object`]
/// and object_store's local store give a file before it is renamed into place, and one their
/// listings ignore.
pub(super) fn is_staged_name(name: &str) -> bool {
    match name.rsplit_once('#') {
        Some((object, digits)) => {
            !object.is_empty() && !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
        }
        None => false,
    }
}

/// Copies `source` next to `target` as `<target>#<digits>` (see [`is_staged_name`]), hashing it
/// in 1 MiB reads (each paid for first to `limiter`, if any), and syncs the copy. Returns its
/// size, checksum and path; [`publish_staged`] moves it into place. One pass over the bytes in
/// large reads: object_store's local put goes through 8 KiB writes or whole-file buffers.
fn copy_to_local_object(
    source: &Path,
    target: &Path,
    limiter: Option<Arc<RateLimiter>>,
) -> std::io::Result<(u64, Checksum, PathBuf)> {
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
        .and_then(|input| copy_hashing(&mut LimitedRead::new(input, limiter), Some(&mut output)))
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

#[cfg(test)]
mod tests {
    use super::is_staged_name;

    #[test]
    fn staged_names_are_an_object_then_hash_digits() {
        assert!(is_staged_name("0123abcd.sst#17"));
        assert!(is_staged_name("x.sst#18446744073709551615"));
        for not_staged in ["0123abcd.sst", "x.sst#", "#12", "x.sst#12a", "x#1#b"] {
            assert!(!is_staged_name(not_staged), "{not_staged}");
        }
    }
}
