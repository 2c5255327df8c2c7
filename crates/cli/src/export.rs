//! `snapshots export`: receives a snapshot's tar from a node and writes it to a file only once it
//! is known whole.
//!
//! The tar is written to a temporary file of its own in the output's folder (a unique hidden name,
//! so two exports, or an unrelated `FILE.partial`, never meet), then checked: the bytes received
//! must be exactly the total the node announced, and every SST in the tar must have the size and
//! xxh3-128 checksum that its `metadata.json` lists. Only then is it renamed to the output; on any
//! failure, and on Ctrl-C or SIGTERM, it is removed and the output is left as it was. Only a
//! SIGKILL can leave it (`.<FILE>.<random>.partial`, next to `FILE`).

use crate::output::show_bytes_count;
use anyhow::{Context, bail, ensure};
use cairn_client::Client;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use tokio::io::AsyncWriteExt;

/// What the check of a received tar found.
#[derive(Debug)]
struct TarCheck {
    files: usize,
    sst_bytes: u64,
}

pub(crate) async fn export_snapshot(
    client: &Client,
    bar: &indicatif::ProgressBar,
    snapshot_id: &str,
    output: &Path,
) -> anyhow::Result<()> {
    // File-system calls run on blocking threads, off the thread that receives the stream.
    let temp = tokio::task::spawn_blocking({
        let (output, snapshot_id) = (output.to_path_buf(), snapshot_id.to_owned());
        move || {
            if output.is_dir() {
                bail!(
                    "{} is a folder; give -o a file name, such as {}",
                    output.display(),
                    output.join(format!("{snapshot_id}.tar")).display()
                );
            }
            temp_file_beside(&output)
        }
    })
    .await
    .context("create the temporary file")??;
    // An interrupted export must not leave its temporary file behind (hidden, and as large as
    // the snapshot): on Ctrl-C or SIGTERM the receive stops here and `temp` is removed.
    let received = tokio::select! {
        done = receive_and_check(client, bar, snapshot_id, &temp) => done,
        signal = interrupted() => Err(anyhow::anyhow!(
            "interrupted by {signal}; nothing was written to {} and the partial download is removed",
            output.display()
        )),
    };
    let (received, check) = match received {
        Ok(received) => received,
        Err(err) => {
            // Removing a file as large as the snapshot can take a while.
            let _ = tokio::task::spawn_blocking(move || drop(temp)).await;
            return Err(err);
        }
    };
    // Once checked, the temporary file becomes the output in one rename (a failed rename
    // removes it, on the same blocking thread).
    let persisted = tokio::task::spawn_blocking({
        let output = output.to_path_buf();
        move || temp.persist(&output).map_err(|e| e.error)
    })
    .await
    .context("rename the checked tar")?;
    persisted.with_context(|| format!("write {}", output.display()))?;
    bar.finish_and_clear();
    println!(
        "Snapshot {snapshot_id} exported to {} ({}, {} SST files of {}; every size and checksum matches)",
        output.display(),
        show_bytes_count(received),
        check.files,
        show_bytes_count(check.sst_bytes),
    );
    Ok(())
}

/// Receives the tar into `temp` and checks it; returns the bytes received and what the check found.
async fn receive_and_check(
    client: &Client,
    bar: &indicatif::ProgressBar,
    snapshot_id: &str,
    temp: &tempfile::NamedTempFile,
) -> anyhow::Result<(u64, TarCheck)> {
    let received = receive(client, bar, snapshot_id, temp).await?;
    let path = temp.path().to_path_buf();
    let check = tokio::task::spawn_blocking(move || check_tar(&path))
        .await
        .context("check the received tar")??;
    Ok((received, check))
}

/// Waits for Ctrl-C or SIGTERM and names it. If the handlers cannot be installed it never
/// returns: the export then runs as it would without them.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "Ctrl-C",
        _ = term.recv() => "SIGTERM",
    }
}

/// A new, uniquely named file in the folder of `output`, removed when dropped.
fn temp_file_beside(output: &Path) -> anyhow::Result<tempfile::NamedTempFile> {
    let folder = match output.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = output
        .file_name()
        .with_context(|| format!("{} is not a file name; give -o a file", output.display()))?
        .to_string_lossy()
        .into_owned();
    // Created with the mode of any new file (0666 less the umask), not tempfile's private 0600:
    // the output is an ordinary file once renamed.
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".partial")
        .permissions(std::fs::Permissions::from_mode(0o666))
        .tempfile_in(&folder)
        .with_context(|| {
            format!(
                "cannot create a file in {}; give -o a file in a writable folder",
                folder.display()
            )
        })
}

/// Streams the tar into `temp`; returns the bytes received, which are exactly the total the node
/// announced.
async fn receive(
    client: &Client,
    bar: &indicatif::ProgressBar,
    snapshot_id: &str,
    temp: &tempfile::NamedTempFile,
) -> anyhow::Result<u64> {
    let mut stream = client.export_snapshot(snapshot_id).await?;
    let mut file = tokio::fs::File::from_std(
        temp.as_file()
            .try_clone()
            .context("open the temporary file")?,
    );
    let mut announced = None;
    let mut received = 0u64;
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|status| client.stream_error(status))?
    {
        if announced.is_none() {
            ensure!(
                chunk.total_bytes > 0,
                "the node did not announce the size of snapshot {snapshot_id}'s tar; it may run an older version"
            );
            announced = Some(chunk.total_bytes);
            bar.set_length(chunk.total_bytes);
        }
        file.write_all(&chunk.data)
            .await
            .with_context(|| format!("write {}", temp.path().display()))?;
        received += chunk.data.len() as u64;
        bar.set_position(received);
    }
    let Some(announced) = announced else {
        bail!("the node sent nothing for snapshot {snapshot_id}; run the export again");
    };
    if received != announced {
        bail!(
            "received {received} bytes of snapshot {snapshot_id}'s tar but the node announced {announced}: the export is broken and nothing was written; run it again"
        );
    }
    file.flush()
        .await
        .with_context(|| format!("write {}", temp.path().display()))?;
    file.sync_all()
        .await
        .with_context(|| format!("sync {}", temp.path().display()))?;
    Ok(received)
}

/// A file as `metadata.json` lists it.
struct Listed {
    size: u64,
    checksum: String,
}

/// Reads the tar at `path`: `metadata.json` first, then every SST it lists, each with its listed
/// size and checksum, and nothing else.
fn check_tar(path: &Path) -> anyhow::Result<TarCheck> {
    let broken =
        |what: String| anyhow::anyhow!("the received tar is broken: {what}; run the export again");
    let file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut archive = tar::Archive::new(std::io::BufReader::new(file));
    let mut entries = archive
        .entries()
        .map_err(|e| broken(format!("cannot read it as a tar ({e})")))?;
    let mut listed = match entries.next() {
        Some(Ok(mut entry)) if entry.path().is_ok_and(|p| p == Path::new("metadata.json")) => {
            let mut json = Vec::new();
            entry
                .read_to_end(&mut json)
                .map_err(|e| broken(format!("cannot read metadata.json ({e})")))?;
            listed_files(&json).map_err(|e| broken(format!("metadata.json: {e}")))?
        }
        _ => return Err(broken("it does not start with metadata.json".into())),
    };
    let mut check = TarCheck {
        files: 0,
        sst_bytes: 0,
    };
    for entry in entries {
        let mut entry = entry.map_err(|e| broken(format!("cannot read a member ({e})")))?;
        let name = entry
            .path()
            .map_err(|e| broken(format!("a member has no readable name ({e})")))?
            .to_string_lossy()
            .into_owned();
        let expected = listed
            .remove(&name)
            .ok_or_else(|| broken(format!("{name} is not listed in metadata.json")))?;
        let (size, checksum) =
            hash(&mut entry).map_err(|e| broken(format!("cannot read {name} ({e})")))?;
        if size != expected.size || checksum != expected.checksum {
            return Err(broken(format!(
                "{name} has {size} bytes and checksum {checksum}; metadata.json lists {} bytes and {}",
                expected.size, expected.checksum
            )));
        }
        check.files += 1;
        check.sst_bytes += size;
    }
    if let Some(missing) = listed.keys().next() {
        return Err(broken(format!("{missing} is missing")));
    }
    Ok(check)
}

/// The files `metadata.json` lists, by their name in the tar.
fn listed_files(json: &[u8]) -> anyhow::Result<HashMap<String, Listed>> {
    let metadata: serde_json::Value = serde_json::from_slice(json).context("not JSON")?;
    let files = metadata["files"].as_array().context("no `files` list")?;
    let mut listed = HashMap::with_capacity(files.len());
    for file in files {
        let name = file["name"].as_str().context("a file has no name")?;
        let name = name.strip_prefix('/').unwrap_or(name).to_string();
        let size = file["size"]
            .as_u64()
            .with_context(|| format!("{name} has no size"))?;
        let checksum = file["checksum"]
            .as_str()
            .with_context(|| format!("{name} has no checksum"))?
            .to_string();
        listed.insert(name, Listed { size, checksum });
    }
    Ok(listed)
}

/// Size and checksum of what `reader` holds, in the form `metadata.json` writes checksums.
fn hash(reader: &mut impl Read) -> std::io::Result<(u64, String)> {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1024 * 1024];
    let mut size = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, format!("xxh3-128:{:032x}", hasher.digest128())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, data) in members {
            let mut header = tar::Header::new_ustar();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            builder.append_data(&mut header, name, *data).unwrap();
        }
        builder.into_inner().unwrap()
    }

    fn metadata_listing(name: &str, data: &[u8]) -> Vec<u8> {
        let checksum = format!("xxh3-128:{:032x}", xxhash_rust::xxh3::xxh3_128(data));
        format!(
            r#"{{"version":1,"files":[{{"name":"/{name}","size":{},"checksum":"{checksum}"}}]}}"#,
            data.len()
        )
        .into_bytes()
    }

    fn check(tar: &[u8]) -> anyhow::Result<TarCheck> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tar");
        std::fs::write(&path, tar).unwrap();
        check_tar(&path)
    }

    #[test]
    fn a_tar_whose_files_match_metadata_passes() {
        let sst = b"sst bytes".as_slice();
        let metadata = metadata_listing("000001.sst", sst);
        let tar = tar_of(&[("metadata.json", metadata.as_slice()), ("000001.sst", sst)]);
        let found = check(&tar).unwrap();
        assert_eq!((found.files, found.sst_bytes), (1, sst.len() as u64));
    }

    #[test]
    fn zeroed_sst_bytes_and_missing_files_are_caught() {
        let sst = b"sst bytes".as_slice();
        let metadata = metadata_listing("000001.sst", sst);
        let zeroed = tar_of(&[
            ("metadata.json", metadata.as_slice()),
            ("000001.sst", &[0u8; 9][..]),
        ]);
        let err = check(&zeroed).unwrap_err().to_string();
        assert!(
            err.contains("000001.sst") && err.contains("checksum"),
            "{err}"
        );
        let missing = tar_of(&[("metadata.json", metadata.as_slice())]);
        let err = check(&missing).unwrap_err().to_string();
        assert!(err.contains("000001.sst is missing"), "{err}");
        let no_metadata = tar_of(&[("000001.sst", sst)]);
        let err = check(&no_metadata).unwrap_err().to_string();
        assert!(err.contains("metadata.json"), "{err}");
    }

    #[test]
    fn the_temporary_file_never_takes_the_name_file_partial() {
        let dir = tempfile::tempdir().unwrap();
        let output = dir.path().join("snap.tar");
        let unrelated = dir.path().join("snap.partial");
        std::fs::write(&unrelated, b"someone else's").unwrap();
        let a = temp_file_beside(&output).unwrap();
        let b = temp_file_beside(&output).unwrap();
        assert_ne!(a.path(), b.path());
        assert_ne!(a.path(), unrelated.as_path());
        assert_eq!(a.path().parent(), Some(dir.path()));
        drop((a, b));
        assert_eq!(std::fs::read(&unrelated).unwrap(), b"someone else's");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "temporary files are removed when dropped");
    }
}
