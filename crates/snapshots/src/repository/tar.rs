//! Exporting a visible snapshot as one portable tar: `metadata.json` as stored, then every file
//! under its name, each checked as it streams through.

use super::SnapshotRepository;
use super::hashing::io;
use super::read::{PartialFile, stored_file_name};
use crate::{Result, SnapshotId};
use bytes::Bytes;
use cairn_types::PartitionId;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const TAR_BLOCK: usize = 512;

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

impl SnapshotRepository {
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
            let tar = PartialFile::create(&partial).await?;
            let write = |bytes: Bytes| tar.write(bytes);

            write(
                tar_header("metadata.json", raw_metadata.len() as u64, mtime)
                    .map_err(io("write", &partial))?,
            )
            .await?;
            write(raw_metadata.clone()).await?;
            write(tar_padding_after(raw_metadata.len() as u64)).await?;

            let mut bytes = 0;
            for file in &metadata.files {
                let name = stored_file_name(snapshot_id, file)?;
                write(tar_header(name, file.size, mtime).map_err(io("write", &partial))?).await?;
                let size = self
                    .read_file_checked(partition, snapshot_id, file, write)
                    .await?;
                write(tar_padding_after(size)).await?;
                bytes += size;
            }
            // A tar ends with two empty blocks.
            write(Bytes::from_static(&[0u8; 2 * TAR_BLOCK])).await?;
            tar.finish(out).await?;
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
}
