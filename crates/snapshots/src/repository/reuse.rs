//! Whether an SST object that publish would reuse holds the bytes its name promises. See the
//! repository's [rule and its cost](super#reused-objects-are-checked).
//!
//! An object is *known good* once this process has read it back and hashed it, or uploaded it,
//! and it still has the size and ETag it had then. Nothing else is trusted: a flipped byte, a
//! truncated leftover or an object replaced behind Cairn's back is uploaded again. An object
//! whose store reports no ETag is read back at every reuse.

use super::SnapshotRepository;
use super::hashing::copy_hashing;
use crate::{Checksum, Error, Result};
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStoreExt};
use std::io::Read;
use xxhash_rust::xxh3::Xxh3;

impl SnapshotRepository {
    /// Whether the object at `location` exists and holds exactly `size` bytes hashing to
    /// `checksum`: from memory if this process knows it good, else by reading it back.
    pub(super) async fn holds_good_copy(
        &self,
        location: &ObjectPath,
        size: u64,
        checksum: Checksum,
    ) -> Result<bool> {
        let Some(meta) = self.head(location).await? else {
            return Ok(false);
        };
        if meta.size != size {
            // A broken leftover: replaced by the upload.
            return Ok(false);
        }
        if self.known_good(location, &meta) {
            return Ok(true);
        }
        let actual = self
            .retry
            .run("read back sst", || self.hash_object(location, size))
            .await?;
        let good = actual == Some(checksum);
        if good {
            self.remember(location, &meta);
        } else {
            tracing::warn!(
                location = %self.describe(location),
                expected = %checksum,
                actual = ?actual,
                "a stored SST does not hold the bytes its name promises; uploading it again"
            );
        }
        Ok(good)
    }

    /// Remembers an object this process has just uploaded as known good.
    pub(super) async fn remember_uploaded(&self, location: &ObjectPath) {
        // Best effort: an object not remembered is only read back at its next reuse.
        if let Ok(Some(meta)) = self.head(location).await {
            self.remember(location, &meta);
        }
    }

    async fn head(&self, location: &ObjectPath) -> Result<Option<ObjectMeta>> {
        self.retry
            .run("check sst", || async {
                match self.store.head(location).await {
                    Ok(meta) => Ok(Some(meta)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(self.store_error("check", location, e)),
                }
            })
            .await
    }

    fn known_good(&self, location: &ObjectPath, meta: &ObjectMeta) -> bool {
        let Some(e_tag) = &meta.e_tag else {
            return false;
        };
        let verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        verified.get(location) == Some(&(meta.size, Some(e_tag.clone())))
    }

    fn remember(&self, location: &ObjectPath, meta: &ObjectMeta) {
        if meta.e_tag.is_none() {
            return;
        }
        let mut verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        if verified.len() >= super::VERIFIED_OBJECTS_MAX {
            verified.clear();
        }
        verified.insert(location.clone(), (meta.size, meta.e_tag.clone()));
    }

    /// The checksum of the object's bytes, read up to one byte past `size` (a longer object is
    /// not what it should be either way); `None` if it is gone.
    async fn hash_object(&self, location: &ObjectPath, size: u64) -> Result<Option<Checksum>> {
        if let super::LatestWriter::LocalLock(fs) = &self.latest_writer {
            let path = self.local_path(fs, location)?;
            let hashed = tokio::task::spawn_blocking(move || {
                let file = match std::fs::File::open(&path) {
                    Ok(file) => file,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err((path, e)),
                };
                copy_hashing(&mut file.take(size + 1), None)
                    .map(|(_, checksum)| Some(checksum))
                    .map_err(|e| (path, e))
            })
            .await
            .map_err(|e| self.join_error(location, e))?;
            return hashed.map_err(|(path, source)| Error::Io {
                context: "read back",
                path,
                source,
            });
        }
        let mut stream = match self.store.get(location).await {
            Ok(result) => result.into_stream(),
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.store_error("read back", location, e)),
        };
        let mut hasher = Xxh3::new();
        let mut read = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.store_error("read back", location, e))?;
            hasher.update(&chunk);
            read += chunk.len() as u64;
            if read > size {
                break;
            }
        }
        Ok(Some(Checksum::from_xxh3_128(hasher.digest128())))
    }
}
