//! The `local` metadata provider: every key in one JSON file.
//!
//! # Crash consistency
//! A put writes the whole file to a temporary sibling, syncs it, renames it over the old one and
//! syncs the directory: after a crash the file holds either the old or the new state, never a mix.
//!
//! # Blocking
//! A put writes and syncs files, so it runs on a blocking thread, holding the lock on the
//! contents until the file is written: a caller that gives up does not cut it short, and memory
//! and file never disagree.

use crate::{Error, MetadataStore, Precondition, Result, Version, Versioned, Watch};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::Mutex;

#[derive(Default, Serialize, Deserialize)]
struct Contents {
    entries: BTreeMap<String, Entry>,
    /// Watchers by key; those whose watch was dropped are removed at the next put of the key.
    #[serde(skip)]
    watchers: BTreeMap<String, Vec<tokio::sync::mpsc::UnboundedSender<Versioned>>>,
}

#[derive(Clone, Serialize, Deserialize)]
struct Entry {
    version: Version,
    value: serde_json::Value,
}

pub struct LocalMetadataStore {
    path: PathBuf,
    /// Shared with the blocking thread that persists a put.
    contents: Arc<Mutex<Contents>>,
}

impl LocalMetadataStore {
    /// Opens the store kept in `path` (a file), creating an empty one if missing. Blocking: it
    /// reads the file.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |context, source| Error::Io {
            path: path.display().to_string(),
            context,
            source,
        };
        let contents = match std::fs::read(path) {
            Ok(raw) => serde_json::from_slice(&raw).map_err(|e| Error::Corrupt {
                path: path.display().to_string(),
                detail: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Contents::default(),
            Err(e) => return Err(io("read", e)),
        };
        Ok(LocalMetadataStore {
            path: path.to_path_buf(),
            contents: Arc::new(Mutex::new(contents)),
        })
    }

    /// Applies a put to `contents` and writes them to `path`; on a failed write `contents` are
    /// left as they were. Blocking.
    fn put_and_persist(
        path: &Path,
        contents: &mut Contents,
        key: &str,
        value: serde_json::Value,
        precondition: Precondition,
    ) -> Result<Version> {
        let current = contents.entries.get(key).map(|e| e.version);
        let holds = match precondition {
            Precondition::None => true,
            Precondition::DoesNotExist => current.is_none(),
            Precondition::MatchesVersion(v) => current == Some(v),
        };
        if !holds {
            return Err(Error::PreconditionFailed {
                key: key.into(),
                expected: precondition,
                current,
            });
        }
        let version = current.unwrap_or(0) + 1;
        let previous = contents
            .entries
            .insert(key.into(), Entry { version, value });
        if let Err(err) = Self::persist(path, contents) {
            // Keep memory equal to disk: undo the change that did not persist.
            match previous {
                Some(p) => contents.entries.insert(key.into(), p),
                None => contents.entries.remove(key),
            };
            return Err(err);
        }
        // Under the lock that orders the puts: watchers see the versions in commit order.
        let committed = Versioned {
            version,
            value: contents.entries[key].value.clone(),
        };
        if let Some(watchers) = contents.watchers.get_mut(key) {
            watchers.retain(|watcher| watcher.send(committed.clone()).is_ok());
        }
        Ok(version)
    }

    fn persist(path: &Path, contents: &Contents) -> Result<()> {
        let io = |context, source| Error::Io {
            path: path.display().to_string(),
            context,
            source,
        };
        let tmp = path.with_extension("tmp");
        let raw = serde_json::to_vec_pretty(contents).expect("encode metadata");
        let mut file = std::fs::File::create(&tmp).map_err(|e| io("create temporary file", e))?;
        file.write_all(&raw).map_err(|e| io("write", e))?;
        file.sync_all().map_err(|e| io("sync", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io("rename", e))?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io("sync directory", e))?;
        }
        Ok(())
    }
}

#[async_trait]
impl MetadataStore for LocalMetadataStore {
    async fn get(&self, key: &str) -> Result<Option<Versioned>> {
        let contents = self.contents.lock().await;
        Ok(contents.entries.get(key).map(|e| Versioned {
            version: e.version,
            value: e.value.clone(),
        }))
    }

    async fn watch(&self, key: &str) -> Result<Watch> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut contents = self.contents.lock().await;
        // The current version and the registration under one lock: no put falls in between.
        if let Some(entry) = contents.entries.get(key) {
            let _ = tx.send(Versioned {
                version: entry.version,
                value: entry.value.clone(),
            });
        }
        contents
            .watchers
            .entry(key.to_owned())
            .or_default()
            .push(tx);
        Ok(Watch::new(rx))
    }

    async fn put(
        &self,
        key: &str,
        value: serde_json::Value,
        precondition: Precondition,
    ) -> Result<Version> {
        let mut contents = self.contents.clone().lock_owned().await;
        let (path, key) = (self.path.clone(), key.to_owned());
        tokio::task::spawn_blocking(move || {
            Self::put_and_persist(&path, &mut contents, &key, value, precondition)
        })
        .await
        .map_err(|err| Error::Io {
            path: self.path.display().to_string(),
            context: "write on a blocking thread",
            source: std::io::Error::other(err),
        })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[tokio::test]
    async fn compare_and_swap_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        let store = LocalMetadataStore::open(&path).unwrap();
        assert_eq!(store.get("k").await.unwrap(), None);
        assert_eq!(
            store
                .put("k", json!(1), Precondition::DoesNotExist)
                .await
                .unwrap(),
            1
        );
        let err = store
            .put("k", json!(2), Precondition::DoesNotExist)
            .await
            .unwrap_err();
        assert!(matches!(
            err,
            Error::PreconditionFailed {
                current: Some(1),
                ..
            }
        ));
        let err = store
            .put("k", json!(2), Precondition::MatchesVersion(7))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::PreconditionFailed { .. }));
        assert_eq!(
            store
                .put("k", json!(2), Precondition::MatchesVersion(1))
                .await
                .unwrap(),
            2
        );
        drop(store);
        let store = LocalMetadataStore::open(&path).unwrap();
        assert_eq!(
            store.get("k").await.unwrap(),
            Some(Versioned {
                version: 2,
                value: json!(2)
            })
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_local_provider_conforms() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        crate::conformance::run_all(&|case| {
            let path = path.with_extension(format!("{case}.json"));
            Box::pin(async move {
                let store = tokio::task::spawn_blocking(move || LocalMetadataStore::open(&path))
                    .await
                    .unwrap()
                    .unwrap();
                std::sync::Arc::new(store) as std::sync::Arc<dyn MetadataStore>
            })
        })
        .await;
    }

    #[test]
    fn a_corrupt_file_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        std::fs::write(&path, b"{not json").unwrap();
        let err = LocalMetadataStore::open(&path).err().unwrap();
        assert!(err.to_string().contains("metadata.json"), "{err}");
    }
}
