//! The SST files Cairn writes are readable by Debian 12's RocksDB tools (`rocksdb-tools`, RocksDB
//! 7.8), so operators can inspect them with `sst_dump` without a Cairn build.

use cairn_partition_store::{PartitionStoreManager, StoreOptions};
use cairn_types::{Lsn, PartitionId};
use std::process::Command;

#[test]
fn sst_dump_from_debian_reads_our_sst_files() {
    let dir = tempfile::tempdir().unwrap();
    let manager = PartitionStoreManager::open(dir.path(), &StoreOptions::default()).unwrap();
    let store = manager.open_or_create_partition(PartitionId(1)).unwrap();
    let mut batch = store.write_batch();
    for i in 0..1000 {
        batch.put(
            format!("key-{i}").as_bytes(),
            b"some value that compresses well well well",
            None,
        );
    }
    batch.set_applied_lsn(Lsn(42));
    store.commit(batch).unwrap();
    store.flush().unwrap();

    let ssts: Vec<_> = std::fs::read_dir(manager.partition_dir(PartitionId(1)).unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sst"))
        .collect();
    assert!(!ssts.is_empty(), "flush wrote no SST file");
    for sst in ssts {
        let output = Command::new("sst_dump")
            .arg(format!("--file={}", sst.display()))
            .args(["--command=scan", "--output_hex"])
            .output()
            .expect(
                "sst_dump not found: install Debian's rocksdb-tools (scripts/setup-debian.sh does)",
            );
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "sst_dump failed on {}:\n{stdout}\n{stderr}",
            sst.display()
        );
        // 1000 data keys and the applied LSN, each printed as `'<hex key>' seq:..., type:... => <hex value>`.
        let entries = stdout.lines().filter(|l| l.contains("=>")).count();
        assert_eq!(entries, 1001, "{stdout}\n{stderr}");
        // The applied LSN variable: key 'f' 0x01, value 42 big-endian.
        assert!(
            stdout.contains("6601") && stdout.contains("000000000000002A"),
            "{stdout}"
        );
    }
}
