//! Reading an export's table files block by block before they leave the node.
//!
//! # Why
//! RocksDB checks a block's checksum when it reads the block, and not before: a flipped bit in a
//! table file goes unnoticed until a read or a compaction reaches it. An export links the live
//! files as they are, and the snapshot's object checksums are computed over the bytes found, so a
//! snapshot of a damaged file would pass every later check of the repository, fail when it is
//! restored, and could let a log trim drop the records that were the only good copy.
//!
//! # How
//! RocksDB's C interface reads single table files only through a database, so the check opens a
//! scratch one in the export folder, imports each file (hard links: nothing is copied where the
//! file system allows links) into a column family of its own, and asks RocksDB to verify every
//! block of every table. One column family per file lets a failure name the exported file: the
//! import gives each file a new number. The scratch database is removed afterwards; a crash
//! leaves it in the export folder, which the node empties at start.

use crate::store::ColumnFamilyExport;
use crate::{Error, Result};
use cairn_types::PartitionId;
use rust_rocksdb::{
    DB, ErrorKind, ExportImportFilesMetaData, ImportColumnFamilyOptions, Options, ReadOptions,
};
use std::path::Path;

/// The scratch folder, inside the export folder.
const CHECK_DIR: &str = "check";

impl ColumnFamilyExport {
    /// Reads every block of every exported table file and checks it against its checksum.
    /// Fails with [`Error::DamagedTable`] naming the first damaged file. Blocking: reads the
    /// whole export.
    pub fn verify_tables(&self, partition: PartitionId) -> Result<()> {
        let root = self.dir.join(CHECK_DIR);
        let result = self.verify_in(&root, partition);
        if let Err(error) = std::fs::remove_dir_all(&root) {
            tracing::warn!(path = %root.display(), %error, "remove the folder of the table check");
        }
        result
    }

    fn verify_in(&self, root: &Path, partition: PartitionId) -> Result<()> {
        let files_dir = root.join("files");
        std::fs::create_dir_all(&files_dir).map_err(|source| Error::Io {
            context: "create the folder of the table check",
            source,
        })?;
        for file in &self.files {
            let name = file.name.trim_start_matches('/');
            let (from, to) = (self.dir.join(name), files_dir.join(name));
            if std::fs::hard_link(&from, &to).is_err() {
                std::fs::copy(&from, &to).map_err(|source| Error::Io {
                    context: "copy a table file to check",
                    source,
                })?;
            }
        }
        let mut options = Options::default();
        options.create_if_missing(true);
        let db = DB::open(&options, root.join("db")).map_err(|source| Error::RocksDb {
            context: "open the database of the table check",
            source,
        })?;
        let mut cf_options = Options::default();
        // Nothing is written; a compaction would only read the files a second time.
        cf_options.set_disable_auto_compactions(true);
        let mut import = ImportColumnFamilyOptions::default();
        import.set_move_files(true);
        let directory = files_dir.display().to_string();
        for (index, file) in self.files.iter().enumerate() {
            let cf = format!("t{index}");
            let mut metadata = ExportImportFilesMetaData::default();
            metadata.set_db_comparator_name(&self.comparator_name);
            metadata
                .set_files(&[file.to_live_file(cf.clone(), directory.clone())])
                .map_err(|source| Error::RocksDb {
                    context: "describe a table file to check",
                    source,
                })?;
            // The import reads the file's footer, index and properties.
            db.create_column_family_with_import(&cf_options, &cf, &import, &metadata)
                .map_err(|source| {
                    let name = file.name.trim_start_matches('/');
                    // RocksDB may name the linked file, with or without a doubled slash.
                    let linked = [
                        format!("{directory}//{name}"),
                        format!("{directory}/{name}"),
                    ];
                    damaged_or(
                        partition,
                        name,
                        "import a table file to check",
                        source,
                        &linked,
                    )
                })?;
        }
        let mut read = ReadOptions::default();
        read.fill_cache(false);
        db.verify_checksum_opt(&read).map_err(|source| {
            // RocksDB names the file it failed on by its path in the scratch database.
            let message = source.as_ref().to_string();
            let found = db.live_files().ok().and_then(|live| {
                live.into_iter().find_map(|scratch| {
                    let index: usize =
                        scratch.column_family_name.strip_prefix('t')?.parse().ok()?;
                    let path = format!(
                        "{}/{}",
                        scratch.directory,
                        scratch.name.trim_start_matches('/')
                    );
                    let exported = self.files.get(index)?;
                    message.contains(&path).then_some((path, exported))
                })
            });
            match found {
                Some((path, exported)) => damaged_or(
                    partition,
                    exported.name.trim_start_matches('/'),
                    "check the table files",
                    source,
                    &[path],
                ),
                _ => damaged_or(
                    partition,
                    "(one of its table files)",
                    "check the table files",
                    source,
                    &[],
                ),
            }
        })
    }
}

/// [`Error::DamagedTable`] when RocksDB found `file` corrupt, else the error as it is. RocksDB's
/// account names the file by a path of the scratch database (one of `scratch`): it is named as
/// the store names it instead.
fn damaged_or(
    partition: PartitionId,
    file: &str,
    context: &'static str,
    source: rust_rocksdb::Error,
    scratch: &[String],
) -> Error {
    if source.kind() == ErrorKind::Corruption {
        let detail = scratch
            .iter()
            .fold(source.as_ref().to_string(), |detail, path| {
                detail.replace(path, file)
            });
        Error::DamagedTable {
            partition,
            file: file.to_string(),
            detail,
            source,
        }
    } else {
        Error::RocksDb { context, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PartitionStoreManager, StoreOptions};
    use cairn_types::Lsn;
    use std::os::unix::fs::FileExt;

    /// An export of partition 2 with three table files.
    fn export(dir: &Path) -> ColumnFamilyExport {
        let manager =
            PartitionStoreManager::open(&dir.join("db"), &StoreOptions::default()).unwrap();
        let store = manager.open_or_create_partition(PartitionId(2)).unwrap();
        for round in 0..3u8 {
            let mut batch = store.write_batch();
            for i in 0..200u32 {
                batch.put(format!("k{round}-{i}").as_bytes(), &[round; 50], None);
            }
            batch.set_applied_lsn(Lsn(u64::from(round) + 1));
            store.commit(batch).unwrap();
            store.flush().unwrap();
        }
        store.export(&dir.join("export")).unwrap()
    }

    #[test]
    fn a_sound_export_passes_and_keeps_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let export = export(dir.path());
        assert!(export.files.len() >= 3, "{export:?}");
        export.verify_tables(PartitionId(2)).unwrap();
        assert!(!export.dir.join(CHECK_DIR).exists());
        // The files are still there to be published, and still import.
        let target =
            PartitionStoreManager::open(&dir.path().join("b"), &StoreOptions::default()).unwrap();
        let imported =
            crate::store::tests::import_export(&target, PartitionId(2), &export).unwrap();
        assert_eq!(
            &imported.get(b"k1-42").unwrap().unwrap().value[..],
            &[1; 50]
        );
    }

    #[test]
    fn a_flipped_byte_in_a_data_block_names_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let export = export(dir.path());
        let damaged = export.files[1].name.trim_start_matches('/').to_string();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(export.dir.join(&damaged))
            .unwrap();
        // Data blocks come first in a table file.
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, 20).unwrap();
        file.write_all_at(&[byte[0] ^ 0x10], 20).unwrap();
        drop(file);

        match export.verify_tables(PartitionId(2)) {
            Err(err @ Error::DamagedTable { .. }) => {
                let Error::DamagedTable {
                    partition, file, ..
                } = &err
                else {
                    unreachable!()
                };
                assert_eq!(
                    (*partition, file.as_str()),
                    (PartitionId(2), damaged.as_str())
                );
                assert!(err.is_damaged());
            }
            other => panic!("expected a damaged table, got {other:?}"),
        }
        assert!(!export.dir.join(CHECK_DIR).exists());
    }

    #[test]
    fn damage_found_as_a_file_is_imported_names_it_too() {
        let dir = tempfile::tempdir().unwrap();
        let export = export(dir.path());
        let damaged = export.files[0].name.trim_start_matches('/').to_string();
        let path = export.dir.join(&damaged);
        // The footer's magic number, read as the file is opened.
        let len = std::fs::metadata(&path).unwrap().len();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[0xff, 0x00, 0xff], len - 3).unwrap();
        drop(file);
        match export.verify_tables(PartitionId(2)) {
            Err(Error::DamagedTable { file, detail, .. }) => {
                assert_eq!(file, damaged);
                assert!(detail.contains(&damaged), "{detail}");
                assert!(!detail.contains(CHECK_DIR), "{detail}");
            }
            other => panic!("expected a damaged table, got {other:?}"),
        }
    }
}
