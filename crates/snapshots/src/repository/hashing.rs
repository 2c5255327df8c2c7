//! Hashing file bytes as they stream, checking what was read against what publish wrote, and
//! counting transfer progress. Shared by uploads, read-backs, downloads and tar exports.

use super::publish::ProgressFn;
use crate::error::FileProblem;
use crate::{Checksum, Error, Result, SnapshotFile, SnapshotId};
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use xxhash_rust::xxh3::Xxh3;

/// Chunk size for reading a local file to hash or copy it.
pub(super) const HASH_CHUNK_BYTES: usize = 1024 * 1024;

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
    pub(super) fn rewind(&self, bytes: u64) {
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
pub(super) fn copy_hashing(
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
/// `size` may be one byte past the declared size: readers stop there.
pub(super) fn check_read(
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
    if size > file.size {
        return Err(bad(FileProblem::TooLarge {
            expected: file.size,
        }));
    }
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

/// Maps an IO error on `path` to [`Error::Io`], for `map_err`.
pub(super) fn io(context: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
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
