//! Tests of the `local` provider against real files: recovery, damage, trimming across logs
//! that share segments, and the writer's failures.

use super::record::{
    HEADER_BYTES, SEGMENT_SUFFIX, TRIM_POINT_TMP_FILE, encode_record, segment_file_name,
    write_trim_point,
};
use super::*;
use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use tempfile::TempDir;

/// A provider that owns its temporary directory, so that the conformance cases can hold it as a
/// plain `Arc<dyn LogProvider>`. Fields drop in order: the logs stop before the directory goes.
struct TempProvider {
    provider: LocalLogProvider,
    _dir: TempDir,
}

#[async_trait]
impl LogProvider for TempProvider {
    async fn open(&self, log_id: LogId) -> Result<Arc<dyn Loglet>> {
        self.provider.open(log_id).await
    }
}

async fn fresh_provider() -> Arc<dyn LogProvider> {
    let dir = TempDir::new().expect("temporary directory");
    let provider =
        LocalLogProvider::open(dir.path(), LocalLogOptions::default()).expect("open provider");
    Arc::new(TempProvider {
        provider,
        _dir: dir,
    })
}

mod conformance {
    use super::fresh_provider;

    crate::conformance_tests!(fresh_provider);

    /// Every case again with `options`.
    async fn run_all_with(options: super::LocalLogOptions) {
        crate::conformance::run_all(move || {
            let options = options.clone();
            async move {
                let dir = tempfile::TempDir::new().expect("temporary directory");
                let provider =
                    super::LocalLogProvider::open(dir.path(), options).expect("open provider");
                std::sync::Arc::new(super::TempProvider {
                    provider,
                    _dir: dir,
                }) as std::sync::Arc<dyn crate::LogProvider>
            }
        })
        .await;
    }

    #[tokio::test]
    async fn run_all_passes_with_tiny_segments() {
        // Segments so small that most reads and trims cross segment boundaries.
        run_all_with(super::LocalLogOptions {
            segment_bytes_max: 100,
            ..Default::default()
        })
        .await;
    }

    #[tokio::test]
    async fn run_all_passes_reading_everything_from_disk() {
        // No cache: every read goes to the segments.
        run_all_with(super::LocalLogOptions {
            segment_bytes_max: 300,
            cache_bytes_max: 0,
            ..Default::default()
        })
        .await;
    }
}

#[tokio::test]
async fn conformance_a_full_disk_stops_neither_reads_nor_later_appends() {
    let dir = TempDir::new().expect("temporary directory");
    let provider = provider(dir.path(), tiny_segments());
    let log = provider.open_local(LogId(1)).await.expect("open");
    let faults = log.faults();
    crate::conformance::a_failed_append_stops_neither_reads_nor_later_appends(log, &move |on| {
        faults.disk_full.store(on, Ordering::SeqCst)
    })
    .await;
}

#[tokio::test]
async fn conformance_a_failed_sync_stops_neither_reads_nor_later_appends() {
    let dir = TempDir::new().expect("temporary directory");
    let provider = provider(dir.path(), LocalLogOptions::default());
    let log = provider.open_local(LogId(1)).await.expect("open");
    let faults = log.faults();
    crate::conformance::a_failed_append_stops_neither_reads_nor_later_appends(log, &move |on| {
        faults.sync_fails.store(on, Ordering::SeqCst)
    })
    .await;
}

fn provider(dir: &Path, options: LocalLogOptions) -> LocalLogProvider {
    LocalLogProvider::open(dir, options).expect("open provider")
}

/// Bytes of one test record in a segment: header and a 34-byte payload.
const RECORD_BYTES: usize = HEADER_BYTES + 34;

fn tiny_segments() -> LocalLogOptions {
    // 4 records per segment.
    LocalLogOptions {
        segment_bytes_max: 4 * RECORD_BYTES as u64,
        ..Default::default()
    }
}

/// A 34-byte payload naming its log and LSN.
fn record_of(log: u16, lsn: u64) -> Bytes {
    Bytes::from(format!("r{log:05}-{lsn:027}"))
}

fn record(lsn: u64) -> Bytes {
    record_of(1, lsn)
}

fn records_of(log: u16, first: u64, last: u64) -> Vec<Entry> {
    (first..=last)
        .map(|lsn| Entry {
            lsn: Lsn(lsn),
            payload: record_of(log, lsn),
        })
        .collect()
}

fn records(first: u64, last: u64) -> Vec<Entry> {
    records_of(1, first, last)
}

async fn append_records_of(log: &LocalLoglet, first: u64, last: u64) {
    for lsn in first..=last {
        assert_eq!(
            log.append(vec![record_of(log.log_id().0, lsn)])
                .await
                .expect("append"),
            Lsn(lsn)
        );
    }
}

async fn append_records(log: &LocalLoglet, first: u64, last: u64) {
    append_records_of(log, first, last).await
}

/// Opens the logs in `dir`, appends records 1..=`last` to log 1 and closes them.
async fn write_log_1(dir: &Path, options: LocalLogOptions, last: u64) {
    let provider = provider(dir, options);
    let log = provider.open_local(LogId(1)).await.expect("open");
    append_records(&log, 1, last).await;
}

/// A segment's bytes up to the end of its last record, without the zeros of the space it was
/// given up front. (Test records never end in a zero byte.)
fn written_bytes(segment: &Path) -> Vec<u8> {
    let mut bytes = fs::read(segment).expect("segment");
    let end = bytes
        .iter()
        .rposition(|b| *b != 0)
        .map_or(0, |last| last + 1);
    bytes.truncate(end);
    bytes
}

fn written_len(segment: &Path) -> u64 {
    written_bytes(segment).len() as u64
}

fn wal_dir(dir: &Path) -> PathBuf {
    dir.join(WAL_DIR)
}

fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    wal_dir(dir).join(segment_file_name(seq))
}

fn segment_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(wal_dir(dir))
        .expect("list segment directory")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(SEGMENT_SUFFIX))
        .collect();
    names.sort();
    names
}

fn names(seqs: &[u64]) -> Vec<String> {
    seqs.iter().copied().map(segment_file_name).collect()
}

fn state_of(trim_point: u64, tail: u64) -> LogState {
    LogState {
        trim_point: Lsn(trim_point),
        tail: Lsn(tail),
    }
}

/// Offset, log id and LSN of every record of a segment's bytes, walking its framing.
fn walk(bytes: &[u8]) -> Vec<(usize, u16, u64)> {
    let mut found = Vec::new();
    let mut offset = 0;
    while offset + HEADER_BYTES <= bytes.len() {
        let header = record::Header::parse(&bytes[offset..]);
        found.push((offset, header.log_id as u16, header.lsn));
        offset += HEADER_BYTES + header.len as usize;
    }
    found
}

fn expect_corrupt(opened: Result<Arc<LocalLoglet>>) -> (String, Option<u64>, String) {
    match opened {
        Err(Error::Corrupt {
            path,
            offset,
            detail,
            ..
        }) => (path, offset, detail),
        Err(other) => panic!("expected corruption, got {other}"),
        Ok(_) => panic!("expected corruption, the log opened"),
    }
}

#[tokio::test]
async fn reopening_keeps_records_tail_and_trim_point() {
    let dir = TempDir::new().expect("temporary directory");
    {
        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("open");
        let batch: Vec<Bytes> = (1..=300).map(record).collect();
        assert_eq!(log.append(batch).await.expect("append"), Lsn(300));
        log.trim(Lsn(10)).await.expect("trim");
    }
    let provider = provider(dir.path(), LocalLogOptions::default());
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_eq!(log.state().await.expect("state"), state_of(10, 300));
    assert_eq!(
        log.read(Lsn(11), 1000).await.expect("read"),
        records(11, 300)
    );
    assert_eq!(
        log.read(Lsn(150), 3).await.expect("read"),
        records(150, 152)
    );
    assert!(matches!(
        log.read(Lsn(10), 1).await,
        Err(Error::Trimmed { .. })
    ));
    assert_eq!(
        log.append(vec![record(301)]).await.expect("append"),
        Lsn(301)
    );
}

#[tokio::test]
async fn a_torn_tail_is_cut_and_appends_continue_after_it() {
    let dir = TempDir::new().expect("temporary directory");
    let segment = segment_path(dir.path(), 1);
    write_log_1(dir.path(), LocalLogOptions::default(), 5).await;
    let intact_len = written_len(&segment);

    // A crash in the middle of writing record 6: a complete header, half of the payload.
    let mut torn = Vec::new();
    encode_record(&mut torn, 1, 6, &record(6));
    torn.truncate(HEADER_BYTES + 10);
    let mut bytes = written_bytes(&segment);
    bytes.extend_from_slice(&torn);
    fs::write(&segment, &bytes).expect("write torn record");

    {
        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        assert_eq!(log.state().await.expect("state"), state_of(0, 5));
        assert_eq!(written_len(&segment), intact_len);
        append_records(&log, 6, 7).await;
        assert_eq!(log.read(Lsn(1), 100).await.expect("read"), records(1, 7));
    }

    // Garbage after the last record, and a bit flip inside the (new) last record.
    let mut bytes = written_bytes(&segment);
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    bytes.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef, 1, 2, 3]);
    fs::write(&segment, &bytes).expect("damage segment");

    let provider = provider(dir.path(), LocalLogOptions::default());
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_eq!(log.state().await.expect("state"), state_of(0, 6));
    assert_eq!(log.read(Lsn(1), 100).await.expect("read"), records(1, 6));
    append_records(&log, 7, 8).await;
    assert_eq!(log.read(Lsn(5), 100).await.expect("read"), records(5, 8));
}

#[tokio::test]
async fn a_preallocated_segment_reopens_at_its_last_record() {
    let dir = TempDir::new().expect("temporary directory");
    let segment = segment_path(dir.path(), 1);
    let options = LocalLogOptions::default();
    {
        let provider = provider(dir.path(), options.clone());
        let log = provider.open_local(LogId(1)).await.expect("open");
        append_records(&log, 1, 5).await;
        assert_eq!(
            fs::metadata(&segment).expect("segment").len(),
            options.segment_bytes_max,
            "the segment's space is allocated up front"
        );
        assert_eq!(written_len(&segment), 5 * RECORD_BYTES as u64);
    }
    assert_eq!(
        fs::metadata(&segment).expect("segment").len(),
        5 * RECORD_BYTES as u64,
        "a stopped log takes the room of its records"
    );
    // As a crash leaves it: the zeros of the preallocated space after the last record.
    OpenOptions::new()
        .write(true)
        .open(&segment)
        .expect("segment")
        .set_len(options.segment_bytes_max)
        .expect("extend with zeros");
    for round in 0..2u64 {
        let provider = provider(dir.path(), options.clone());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        let tail = 5 + round * 2;
        assert_log_holds(&log, tail).await;
        append_records(&log, tail + 1, tail + 2).await;
        assert_eq!(written_len(&segment), (tail + 2) * RECORD_BYTES as u64);
    }
}

#[tokio::test]
async fn a_torn_write_into_preallocated_space_is_cut() {
    let dir = TempDir::new().expect("temporary directory");
    let segment = segment_path(dir.path(), 1);
    write_log_1(dir.path(), LocalLogOptions::default(), 5).await;
    // Half of record 6 reached the disk; the zeros of the preallocated space follow it.
    let mut torn = Vec::new();
    encode_record(&mut torn, 1, 6, &record(6));
    torn.truncate(HEADER_BYTES + 10);
    OpenOptions::new()
        .write(true)
        .open(&segment)
        .expect("segment")
        .write_all_at(&torn, 5 * RECORD_BYTES as u64)
        .expect("write torn record");

    let provider = provider(dir.path(), LocalLogOptions::default());
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_log_holds(&log, 5).await;
    append_records(&log, 6, 8).await;
    assert_log_holds(&log, 8).await;
    assert_eq!(written_len(&segment), 8 * RECORD_BYTES as u64);
}

#[tokio::test]
async fn a_last_record_ending_in_zero_bytes_is_kept_whole() {
    let dir = TempDir::new().expect("temporary directory");
    let payloads = [
        Bytes::from_static(b"ends in zeros\0\0\0\0"),
        Bytes::from(vec![0u8; 100]),
    ];
    for (round, payload) in payloads.iter().enumerate() {
        {
            let provider = provider(dir.path(), LocalLogOptions::default());
            let log = provider.open_local(LogId(1)).await.expect("open");
            let lsn = log.append(vec![payload.clone()]).await.expect("append");
            assert_eq!(lsn, Lsn(round as u64 + 1));
        }
        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        let read = log.read(Lsn(1), 10).await.expect("read");
        let expected: Vec<Entry> = payloads[..=round]
            .iter()
            .enumerate()
            .map(|(i, payload)| Entry {
                lsn: Lsn(i as u64 + 1),
                payload: payload.clone(),
            })
            .collect();
        assert_eq!(read, expected, "reopened after record {}", round + 1);
    }
}

#[tokio::test]
async fn a_finished_segment_is_cut_to_its_records() {
    let dir = TempDir::new().expect("temporary directory");
    let options = tiny_segments();
    {
        let provider = provider(dir.path(), options.clone());
        let log = provider.open_local(LogId(1)).await.expect("open");
        append_records(&log, 1, 10).await;
        assert_eq!(segment_names(dir.path()), names(&[1, 2, 3]));
        for seq in [1, 2] {
            assert_eq!(
                fs::metadata(segment_path(dir.path(), seq))
                    .expect("segment")
                    .len(),
                4 * RECORD_BYTES as u64,
                "segment {seq} ends with its last record"
            );
        }
        let last = segment_path(dir.path(), 3);
        assert_eq!(
            fs::metadata(&last).expect("segment").len(),
            options.segment_bytes_max
        );
        assert_eq!(written_len(&last), 2 * RECORD_BYTES as u64);
    }
    let provider = provider(dir.path(), options);
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_log_holds(&log, 10).await;
}

#[tokio::test]
async fn damage_in_an_older_segment_is_corruption() {
    let dir = TempDir::new().expect("temporary directory");
    write_log_1(dir.path(), tiny_segments(), 10).await;
    let first = segment_path(dir.path(), 1);
    let mut bytes = written_bytes(&first);
    // The payload of the segment's last record (LSN 4): nothing valid follows in the segment.
    bytes[3 * RECORD_BYTES + HEADER_BYTES + 3] ^= 0x01;
    fs::write(&first, &bytes).expect("damage segment");

    let provider = provider(dir.path(), tiny_segments());
    let (path, offset, detail) = expect_corrupt(provider.open_local(LogId(1)).await);
    assert!(path.ends_with("00000000000000000001.wal"), "{path}");
    assert_eq!(offset, Some(3 * RECORD_BYTES as u64));
    assert!(detail.contains("(LSN 4)"), "{detail}");
    assert!(detail.contains("checksum"), "{detail}");
    assert!(detail.contains("not in the last segment"), "{detail}");
}

/// Appends records 1..=10 of log 1 in one segment, stops, lets `damage` change the segment's
/// bytes (given each record's offset) and reopens.
async fn reopen_after_damage(
    damage: impl FnOnce(&mut Vec<u8>, &[usize]),
) -> (Result<Arc<LocalLoglet>>, u64) {
    let dir = TempDir::new().expect("temporary directory");
    let segment = segment_path(dir.path(), 1);
    write_log_1(dir.path(), LocalLogOptions::default(), 10).await;
    let mut bytes = written_bytes(&segment);
    let offsets: Vec<usize> = (0..10).map(|i| i * RECORD_BYTES).collect();
    damage(&mut bytes, &offsets);
    fs::write(&segment, &bytes).expect("damage segment");
    let provider = provider(dir.path(), LocalLogOptions::default());
    let opened = provider.open_local(LogId(1)).await;
    (opened, written_len(&segment))
}

#[tokio::test]
async fn a_bad_record_followed_by_valid_ones_in_the_last_segment_is_corruption() {
    let (opened, len) = reopen_after_damage(|bytes, offsets| {
        bytes[offsets[3] + HEADER_BYTES + 5] ^= 0x01; // the payload of LSN 4
    })
    .await;
    let (path, offset, detail) = expect_corrupt(opened);
    assert!(path.ends_with("00000000000000000001.wal"), "{path}");
    assert_eq!(offset, Some(3 * RECORD_BYTES as u64));
    assert!(detail.contains("offset 174 (LSN 4)"), "{detail}");
    assert!(detail.contains("checksum"), "{detail}");
    assert!(
        detail.contains("log 1, LSN 5 follows at offset 232"),
        "{detail}"
    );
    assert_eq!(
        len,
        10 * RECORD_BYTES as u64,
        "nothing of the segment was cut"
    );
}

#[tokio::test]
async fn a_bad_length_followed_by_valid_records_is_corruption() {
    // The length of LSN 7 now points far past the end of the segment.
    let (opened, len) = reopen_after_damage(|bytes, offsets| bytes[offsets[6] + 2] ^= 0x10).await;
    let (_, _, detail) = expect_corrupt(opened);
    assert!(detail.contains("offset 348 (LSN 7)"), "{detail}");
    assert!(detail.contains("LSN 8 follows at offset 406"), "{detail}");
    assert_eq!(len, 10 * RECORD_BYTES as u64);
}

#[tokio::test]
async fn a_bad_last_record_with_garbage_after_it_is_a_torn_tail() {
    // Nothing valid after the bad spot: an incomplete final write, cut.
    let (opened, len) = reopen_after_damage(|bytes, offsets| {
        bytes[offsets[9] + HEADER_BYTES + 1] ^= 0x01;
        bytes.extend_from_slice(&[0u8; 40]);
        bytes.extend_from_slice(b"garbage that is no record at all");
    })
    .await;
    opened.expect("a torn tail opens");
    assert_eq!(len, 9 * RECORD_BYTES as u64);
}

/// Reads every record and checks it is record(lsn), and the tail.
async fn assert_log_holds(log: &LocalLoglet, tail: u64) {
    assert_eq!(log.state().await.expect("state"), state_of(0, tail));
    assert_eq!(
        log.read(Lsn(1), 1000).await.expect("read"),
        records_of(log.log_id().0, 1, tail)
    );
}

/// Each `(log, tail)`: that log, opened on `provider`, holds records 1..=tail
/// ([`assert_log_holds`]).
async fn assert_logs_hold(provider: &LocalLogProvider, logs: &[(u16, u64)]) {
    for &(log_id, tail) in logs {
        let log = provider.open_local(LogId(log_id)).await.expect("open");
        assert_log_holds(&log, tail).await;
    }
}

#[tokio::test]
async fn a_full_disk_fails_the_batch_and_appends_resume_once_there_is_room() {
    let dir = TempDir::new().expect("temporary directory");
    {
        let provider = provider(dir.path(), tiny_segments());
        let log = provider.open_local(LogId(1)).await.expect("open");
        append_records(&log, 1, 4).await;
        let faults = log.faults();
        faults.disk_full.store(true, Ordering::SeqCst);
        // Segment 1 is full: the batch starts segment 2 and fails writing to it.
        let batch: Vec<Bytes> = (5..=9).map(record).collect();
        match log.append(batch).await {
            Err(error @ Error::DiskFull { .. }) => {
                assert!(error.is_disk_full());
                let message = error.to_string();
                let wal = wal_dir(dir.path()).display().to_string();
                assert!(message.contains(&wal), "{message}");
                assert!(message.contains("full"), "{message}");
            }
            other => panic!("expected a full disk, got {other:?}"),
        }
        // Still full: refused again, reads go on, and a tail wait does not fail.
        assert!(matches!(
            log.append(vec![record(5)]).await,
            Err(Error::DiskFull { .. })
        ));
        assert_log_holds(&log, 4).await;
        assert_eq!(segment_names(dir.path()), names(&[1]));
        let waiting = log.wait_for_tail(Lsn(5));
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), &mut waiting)
                .await
                .is_err(),
            "waiting for the tail ended while the disk was full"
        );

        faults.disk_full.store(false, Ordering::SeqCst);
        let batch: Vec<Bytes> = (5..=9).map(record).collect();
        assert_eq!(log.append(batch).await.expect("append"), Lsn(9));
        waiting.await.expect("the tail reached 5");
        assert_log_holds(&log, 9).await;
        assert_eq!(segment_names(dir.path()), names(&[1, 2, 3]));
        // A failed write in the middle of a segment is cut too.
        faults.disk_full.store(true, Ordering::SeqCst);
        assert!(log.append(vec![record(10), record(11)]).await.is_err());
        faults.disk_full.store(false, Ordering::SeqCst);
        append_records(&log, 10, 11).await;
    }
    // What recovery finds is exactly what was acknowledged, no leftovers of the failures.
    let provider = provider(dir.path(), tiny_segments());
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_log_holds(&log, 11).await;
}

#[tokio::test]
async fn a_failed_commit_fails_every_log_in_it_and_none_keeps_a_record_of_it() {
    let dir = TempDir::new().expect("temporary directory");
    {
        let provider = provider(dir.path(), LocalLogOptions::default());
        let logs = [
            provider.open_local(LogId(1)).await.expect("open"),
            provider.open_local(LogId(2)).await.expect("open"),
        ];
        append_records_of(&logs[0], 1, 2).await;
        append_records_of(&logs[1], 1, 3).await;
        let faults = logs[0].faults();
        faults.sync_fails.store(true, Ordering::SeqCst);
        for log in &logs {
            assert!(log.append(vec![Bytes::from_static(b"lost")]).await.is_err());
        }
        faults.sync_fails.store(false, Ordering::SeqCst);
        append_records_of(&logs[1], 4, 4).await;
        append_records_of(&logs[0], 3, 3).await;
        assert_log_holds(&logs[0], 3).await;
        assert_log_holds(&logs[1], 4).await;
    }
    let provider = provider(dir.path(), LocalLogOptions::default());
    assert_logs_hold(&provider, &[(1, 3), (2, 4)]).await;
}

#[tokio::test]
async fn a_failed_sync_is_cut_and_appends_wait_until_the_cut_is_durable() {
    let dir = TempDir::new().expect("temporary directory");
    {
        let provider = provider(dir.path(), LocalLogOptions::default());
        let log = provider.open_local(LogId(1)).await.expect("open");
        append_records(&log, 1, 3).await;
        let faults = log.faults();
        faults.sync_fails.store(true, Ordering::SeqCst);
        match log
            .append(vec![Bytes::from_static(b"never acknowledged")])
            .await
        {
            Err(Error::Io { source, .. }) => {
                assert!(source.to_string().contains("injected"), "{source}")
            }
            other => panic!("expected an I/O error, got {other:?}"),
        }
        assert_log_holds(&log, 3).await;
        // The cut of the failed batch could not be synced either: every append first tries
        // it again and is refused while it fails; reads go on.
        for _ in 0..2 {
            match log.append(vec![record(4)]).await {
                Err(Error::Io { context, .. }) => {
                    assert_eq!(context, "cutting a failed write from a segment")
                }
                other => panic!("expected the cut to fail again, got {other:?}"),
            }
            assert_log_holds(&log, 3).await;
        }
        faults.sync_fails.store(false, Ordering::SeqCst);
        append_records(&log, 4, 5).await;
        assert_log_holds(&log, 5).await;
    }
    let provider = provider(dir.path(), LocalLogOptions::default());
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_log_holds(&log, 5).await;
}

#[tokio::test]
async fn segments_roll_and_trimming_deletes_whole_segments() {
    let dir = TempDir::new().expect("temporary directory");
    {
        let provider = provider(dir.path(), tiny_segments());
        let log = provider.open_local(LogId(1)).await.expect("open");
        append_records(&log, 1, 10).await;
        // One batch that crosses segment boundaries.
        let batch = (11..=20).map(record).collect();
        assert_eq!(log.append(batch).await.expect("append"), Lsn(20));
        assert_eq!(segment_names(dir.path()), names(&[1, 2, 3, 4, 5]));

        log.trim(Lsn(10)).await.expect("trim");
        // Segment 3 holds 9..=12, so it stays; the two before it hold only trimmed records.
        assert_eq!(segment_names(dir.path()), names(&[3, 4, 5]));
        assert_eq!(log.read(Lsn(11), 100).await.expect("read"), records(11, 20));
        assert!(matches!(
            log.read(Lsn(9), 1).await,
            Err(Error::Trimmed { .. })
        ));
    }
    {
        let provider = provider(dir.path(), tiny_segments());
        let log = provider.open_local(LogId(1)).await.expect("reopen");
        assert_eq!(log.state().await.expect("state"), state_of(10, 20));
        assert_eq!(log.read(Lsn(11), 100).await.expect("read"), records(11, 20));
        log.trim(Lsn(20)).await.expect("trim");
        // The newest segment is where the next append goes: it stays.
        assert_eq!(segment_names(dir.path()), names(&[5]));
    }
    let provider = provider(dir.path(), tiny_segments());
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_eq!(log.state().await.expect("state"), state_of(20, 20));
    append_records(&log, 21, 21).await;
    assert_eq!(log.read(Lsn(21), 10).await.expect("read"), records(21, 21));
    drop(log);
    drop(provider);
    let provider = self::provider(dir.path(), tiny_segments());
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_eq!(log.state().await.expect("state"), state_of(20, 21));
}

#[tokio::test]
async fn recovery_finishes_a_trim_that_crashed_before_deleting() {
    let dir = TempDir::new().expect("temporary directory");
    write_log_1(dir.path(), tiny_segments(), 20).await;
    // The trim point reached the disk, the deletions did not.
    let log_dir = dir.path().join("1");
    write_trim_point(&log_dir, 13, true).expect("write trim point");
    fs::write(log_dir.join(TRIM_POINT_TMP_FILE), b"half").expect("stale temporary file");

    let provider = provider(dir.path(), tiny_segments());
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_eq!(log.state().await.expect("state"), state_of(13, 20));
    assert_eq!(segment_names(dir.path()), names(&[4, 5]));
    assert!(!log_dir.join(TRIM_POINT_TMP_FILE).exists());
    assert_eq!(log.read(Lsn(14), 100).await.expect("read"), records(14, 20));
}

#[tokio::test]
async fn records_over_the_limit_are_refused_whole() {
    let dir = TempDir::new().expect("temporary directory");
    let options = LocalLogOptions {
        record_bytes_max: 16,
        ..Default::default()
    };
    let provider = provider(dir.path(), options);
    let log = provider.open_local(LogId(1)).await.expect("open");
    let fits = Bytes::from(vec![7u8; 16]);
    let too_large = Bytes::from(vec![7u8; 17]);
    assert_eq!(
        log.append(vec![fits.clone()]).await.expect("append"),
        Lsn(1)
    );
    match log.append(vec![fits.clone(), too_large]).await {
        Err(Error::RecordTooLarge { size, limit, .. }) => assert_eq!((size, limit), (17, 16)),
        other => panic!("expected RecordTooLarge, got {other:?}"),
    }
    // Nothing of the refused batch was written.
    assert_eq!(log.state().await.expect("state"), state_of(0, 1));
    assert_eq!(log.append(vec![fits]).await.expect("append"), Lsn(2));
}

#[tokio::test]
async fn large_records_round_trip() {
    let dir = TempDir::new().expect("temporary directory");
    let options = LocalLogOptions {
        cache_bytes_max: 0,
        ..Default::default()
    };
    let provider = provider(dir.path(), options.clone());
    let log = provider.open_local(LogId(1)).await.expect("open");
    // Larger than a read chunk and a write chunk, between small records.
    let large = Bytes::from(
        (0..3 * writer::WRITE_CHUNK_BYTES)
            .map(|i| i as u8)
            .collect::<Vec<_>>(),
    );
    let batch = vec![record(1), large.clone(), record(3)];
    assert_eq!(log.append(batch).await.expect("append"), Lsn(3));
    let entries = log.read(Lsn(1), 10).await.expect("read");
    let payloads: Vec<Bytes> = entries.into_iter().map(|e| e.payload).collect();
    assert_eq!(payloads, vec![record(1), large.clone(), record(3)]);
    drop(log);
    drop(provider);

    let provider = self::provider(dir.path(), options);
    let log = provider.open_local(LogId(1)).await.expect("reopen");
    assert_eq!(log.read(Lsn(2), 1).await.expect("read")[0].payload, large);
}

#[tokio::test]
async fn opening_twice_returns_the_same_arc() {
    let dir = TempDir::new().expect("temporary directory");
    let provider = provider(dir.path(), LocalLogOptions::default());
    let a = provider.open(LogId(3)).await.expect("open");
    let b = provider.open(LogId(3)).await.expect("open");
    assert!(std::ptr::addr_eq(Arc::as_ptr(&a), Arc::as_ptr(&b)));
}

#[tokio::test]
async fn a_second_provider_cannot_open_a_directory_in_use() {
    let dir = TempDir::new().expect("temporary directory");
    let first = provider(dir.path(), LocalLogOptions::default());
    let log = first.open(LogId(1)).await.expect("open");
    match LocalLogProvider::open(dir.path(), LocalLogOptions::default()) {
        Err(error) => {
            assert_eq!(error.kind(), io::ErrorKind::WouldBlock);
            assert!(error.to_string().contains("in use"), "{error}");
        }
        Ok(_) => panic!("two providers opened the same directory"),
    }
    // Once the first provider and its logs are gone, the directory is free again.
    drop(first);
    drop(log);
    let second = provider(dir.path(), LocalLogOptions::default());
    second
        .open(LogId(1))
        .await
        .expect("open after the first let go");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_appends_share_syncs() {
    const APPENDS: usize = 200;
    let dir = TempDir::new().expect("temporary directory");
    let provider = provider(dir.path(), LocalLogOptions::default());
    let log = provider.open_local(LogId(1)).await.expect("open");
    let tasks: Vec<_> = (0..APPENDS)
        .map(|i| {
            let log = log.clone();
            tokio::spawn(async move { log.append(vec![record(i as u64)]).await })
        })
        .collect();
    for task in tasks {
        task.await.expect("task").expect("append");
    }
    assert_eq!(log.state().await.expect("state").tail, Lsn(APPENDS as u64));
    let batches = log.batches();
    assert!(
        batches < APPENDS as u64,
        "{APPENDS} concurrent appends took {batches} syncs"
    );
}

/// Appends from `tasks` tasks to `logs` logs, `per_task` appends each, of one or two records.
/// Returns every acknowledged record, per log, by LSN.
async fn append_concurrently(
    provider: &LocalLogProvider,
    logs: u16,
    tasks: usize,
    per_task: usize,
) -> HashMap<u16, std::collections::BTreeMap<u64, Bytes>> {
    let mut handles = Vec::new();
    for task in 0..tasks {
        let log = provider
            .open_local(LogId(1 + (task % logs as usize) as u16))
            .await
            .expect("open");
        handles.push(tokio::spawn(async move {
            let mut acknowledged = Vec::new();
            for i in 0..per_task {
                let payloads: Vec<Bytes> = (0..1 + i % 2)
                    .map(|k| Bytes::from(format!("task {task} append {i} record {k}")))
                    .collect();
                let last = log.append(payloads.clone()).await.expect("append").0;
                let first = last + 1 - payloads.len() as u64;
                acknowledged.extend((first..=last).zip(payloads));
            }
            (log.log_id().0, acknowledged)
        }));
    }
    let mut all: HashMap<u16, std::collections::BTreeMap<u64, Bytes>> = HashMap::new();
    for handle in handles {
        let (log, acknowledged) = handle.await.expect("task");
        let records = all.entry(log).or_default();
        for (lsn, payload) in acknowledged {
            assert!(
                records.insert(lsn, payload).is_none(),
                "LSN {lsn} handed out twice"
            );
        }
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_logs_appended_concurrently_share_commits_and_survive_reopening() {
    let dir = TempDir::new().expect("temporary directory");
    let options = LocalLogOptions {
        segment_bytes_max: 4096,
        cache_bytes_max: 1024,
        ..Default::default()
    };
    let (acknowledged, appends) = {
        let provider = provider(dir.path(), options.clone());
        let acknowledged = append_concurrently(&provider, 16, 32, 40).await;
        let appends = 32 * 40;
        let commits = provider.commits();
        assert!(
            commits * 3 < appends,
            "{appends} concurrent appends to 16 logs took {commits} commits"
        );
        (acknowledged, appends)
    };
    assert_eq!(acknowledged.len(), 16);
    assert!(segment_names(dir.path()).len() > 10, "segments rolled");
    let provider = provider(dir.path(), options);
    let mut records = 0;
    for (log_id, expected) in &acknowledged {
        let log = provider.open_local(LogId(*log_id)).await.expect("reopen");
        let tail = expected.len() as u64;
        assert_eq!(log.state().await.expect("state"), state_of(0, tail));
        let read = log.read(Lsn(1), 10_000).await.expect("read");
        let read: Vec<(u64, Bytes)> = read.into_iter().map(|e| (e.lsn.0, e.payload)).collect();
        let expected: Vec<(u64, Bytes)> = expected.clone().into_iter().collect();
        assert_eq!(read, expected, "log {log_id}");
        records += read.len();
    }
    assert!(records > appends as usize);
}

/// Appends one record at a time to logs 1 and 2 by turns, so that each segment (tiny) holds
/// records of both.
async fn interleave(provider: &LocalLogProvider, count: u64) {
    let one = provider.open_local(LogId(1)).await.expect("open");
    let two = provider.open_local(LogId(2)).await.expect("open");
    for lsn in 1..=count {
        append_records_of(&one, lsn, lsn).await;
        append_records_of(&two, lsn, lsn).await;
    }
}

fn wal_bytes(dir: &Path) -> u64 {
    fs::read_dir(wal_dir(dir))
        .expect("list")
        .map(|e| e.expect("entry").metadata().expect("metadata").len())
        .sum()
}

#[tokio::test]
async fn trimming_one_log_keeps_the_segments_another_log_still_needs() {
    let dir = TempDir::new().expect("temporary directory");
    {
        let provider = provider(dir.path(), tiny_segments());
        // 40 records, 2 of each log per segment: segments 1..=10.
        interleave(&provider, 20).await;
        assert_eq!(segment_names(dir.path()).len(), 10);
        let before = wal_bytes(dir.path());
        let one = provider.open_local(LogId(1)).await.expect("open");
        let two = provider.open_local(LogId(2)).await.expect("open");

        one.trim(Lsn(20)).await.expect("trim");
        assert_eq!(
            segment_names(dir.path()).len(),
            10,
            "log 2 still needs every segment"
        );
        assert_eq!(
            two.read(Lsn(1), 100).await.expect("read"),
            records_of(2, 1, 20)
        );

        two.trim(Lsn(10)).await.expect("trim");
        // Segments 1..=5 hold log 2's records 1..=10 only (besides trimmed ones of log 1).
        assert_eq!(segment_names(dir.path()), names(&[6, 7, 8, 9, 10]));
        assert!(wal_bytes(dir.path()) * 2 <= before, "space is reclaimed");
        assert_eq!(
            two.read(Lsn(11), 100).await.expect("read"),
            records_of(2, 11, 20)
        );
        append_records_of(&one, 21, 22).await;
    }
    let provider = provider(dir.path(), tiny_segments());
    let one = provider.open_local(LogId(1)).await.expect("reopen");
    let two = provider.open_local(LogId(2)).await.expect("reopen");
    assert_eq!(one.state().await.expect("state"), state_of(20, 22));
    assert_eq!(two.state().await.expect("state"), state_of(10, 20));
    assert_eq!(
        one.read(Lsn(21), 100).await.expect("read"),
        records_of(1, 21, 22)
    );
    assert_eq!(
        two.read(Lsn(11), 100).await.expect("read"),
        records_of(2, 11, 20)
    );
    two.trim(Lsn(20)).await.expect("trim");
    // Only the segment holding log 1's records 21 and 22 stays.
    assert_eq!(segment_names(dir.path()).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_commit_spanning_several_logs_leaves_each_log_a_prefix() {
    let dir = TempDir::new().expect("temporary directory");
    let options = LocalLogOptions::default();
    let acknowledged = {
        let provider = provider(dir.path(), options.clone());
        append_concurrently(&provider, 4, 16, 10).await
    };
    let segment = segment_path(dir.path(), 1);
    let bytes = written_bytes(&segment);
    let found = walk(&bytes);
    // Cut in the middle of the 8th record from the end: the last commits are torn.
    let (cut_record, _, _) = found[found.len() - 8];
    let cut = cut_record + HEADER_BYTES / 2 + 3;
    let kept: Vec<(u16, u64)> = found
        .iter()
        .filter(|(offset, _, _)| *offset < cut_record)
        .map(|(_, log, lsn)| (*log, *lsn))
        .collect();
    let logs_cut: HashSet<u16> = found[found.len() - 8..].iter().map(|r| r.1).collect();
    assert!(logs_cut.len() > 1, "the cut spans records of several logs");
    OpenOptions::new()
        .write(true)
        .open(&segment)
        .expect("segment")
        .set_len(cut as u64)
        .expect("cut");

    let provider = provider(dir.path(), options);
    for (log_id, expected) in &acknowledged {
        let log = provider.open_local(LogId(*log_id)).await.expect("reopen");
        let tail = kept.iter().filter(|(l, _)| l == log_id).count() as u64;
        assert_eq!(log.state().await.expect("state"), state_of(0, tail));
        let read = log.read(Lsn(1), 10_000).await.expect("read");
        let prefix: Vec<Entry> = expected
            .iter()
            .take(tail as usize)
            .map(|(lsn, payload)| Entry {
                lsn: Lsn(*lsn),
                payload: payload.clone(),
            })
            .collect();
        assert_eq!(read, prefix, "log {log_id} keeps exactly a prefix");
        assert_eq!(
            log.append(vec![Bytes::from_static(b"next")])
                .await
                .expect("append"),
            Lsn(tail + 1)
        );
    }
    assert_eq!(
        written_len(&segment),
        cut_record as u64 + 4 * (HEADER_BYTES as u64 + 4),
        "cut at the torn record, then the four new appends"
    );
}

#[tokio::test]
async fn a_flipped_byte_refuses_only_the_log_whose_record_it_is() {
    let dir = TempDir::new().expect("temporary directory");
    let (segment, offset) = damage_log_2_of_three(dir.path()).await;
    let bytes = written_bytes(&segment);

    let provider = provider(dir.path(), LocalLogOptions::default());
    let (path, at, detail) = expect_corrupt(provider.open_local(LogId(2)).await);
    assert_eq!(path, segment.display().to_string());
    assert_eq!(at, Some(offset as u64));
    assert!(
        detail.contains(&format!("offset {offset} (LSN 5)")),
        "{detail}"
    );
    assert!(detail.contains("log 3, LSN 5 follows"), "{detail}");
    for log_id in [1, 3] {
        let log = provider.open_local(LogId(log_id)).await.expect("open");
        assert_log_holds(&log, 10).await;
        append_records_of(&log, 11, 11).await;
    }
    drop(provider);
    // Refused again, the same way, after the others wrote on; the file was left as it was.
    let provider = self::provider(dir.path(), LocalLogOptions::default());
    let (_, again, _) = expect_corrupt(provider.open_local(LogId(2)).await);
    assert_eq!(again, Some(offset as u64));
    assert_eq!(written_bytes(&segment)[..bytes.len()], bytes[..]);
    let log = provider.open_local(LogId(3)).await.expect("open");
    assert_log_holds(&log, 11).await;
}

#[tokio::test]
async fn a_second_damaged_record_of_a_refused_log_refuses_only_that_log() {
    let dir = TempDir::new().expect("temporary directory");
    let (segment, offset) = damage_log_2_of_three(dir.path()).await;
    let mut bytes = fs::read(&segment).expect("segment");
    let second = 22 * RECORD_BYTES;
    assert_eq!(walk(&written_bytes(&segment))[22], (second, 2, 8));
    bytes[second + HEADER_BYTES + 7] ^= 0x08;
    fs::write(&segment, &bytes).expect("damage");

    let provider = provider(dir.path(), LocalLogOptions::default());
    let (_, at, _) = expect_corrupt(provider.open_local(LogId(2)).await);
    assert_eq!(
        at,
        Some(offset as u64),
        "the first damage is the reason given"
    );
    for log_id in [1, 3] {
        let log = provider.open_local(LogId(log_id)).await.expect("open");
        assert_log_holds(&log, 10).await;
    }
}

#[tokio::test]
async fn damage_no_log_can_be_blamed_for_refuses_every_log() {
    let dir = TempDir::new().expect("temporary directory");
    {
        let provider = provider(dir.path(), LocalLogOptions::default());
        interleave(&provider, 3).await;
    }
    let segment = segment_path(dir.path(), 1);
    let mut bytes = written_bytes(&segment);
    // The LSN in the header of log 1's last record: it names no log's next record any more, and
    // log 1 shows no gap after it (it was its last).
    let offset = 4 * RECORD_BYTES;
    assert_eq!(walk(&bytes)[4], (offset, 1, 3));
    bytes[offset + 16 + 5] ^= 0x01;
    fs::write(&segment, &bytes).expect("damage");

    let provider = provider(dir.path(), LocalLogOptions::default());
    for log_id in [1, 2, 9] {
        let (_, at, detail) = expect_corrupt(provider.open_local(LogId(log_id)).await);
        assert_eq!(at, Some(offset as u64));
        assert!(detail.contains("every log is refused"), "{detail}");
    }
}

/// Writes logs 1 and 2 in segments of 4 records (log 1: LSN 1..=8 in segments 1 and 2, 9..=12 in
/// segment 4; log 2: 1..=4 in segment 3, 5..=8 in segment 5), then deletes segment 2.
async fn lose_a_middle_segment(dir: &Path) {
    {
        let provider = provider(dir, tiny_segments());
        let one = provider.open_local(LogId(1)).await.expect("open");
        let two = provider.open_local(LogId(2)).await.expect("open");
        append_records_of(&one, 1, 8).await;
        append_records_of(&two, 1, 4).await;
        append_records_of(&one, 9, 12).await;
        append_records_of(&two, 5, 8).await;
    }
    fs::remove_file(segment_path(dir, 2)).expect("lose a segment");
}

#[tokio::test]
async fn a_lost_middle_segment_refuses_the_logs_that_had_records_in_it() {
    let dir = TempDir::new().expect("temporary directory");
    lose_a_middle_segment(dir.path()).await;

    let provider = provider(dir.path(), tiny_segments());
    let (path, offset, detail) = expect_corrupt(provider.open_local(LogId(1)).await);
    assert_eq!(path, segment_path(dir.path(), 4).display().to_string());
    assert_eq!(offset, None, "no offset to cut at");
    assert!(detail.contains("records are missing"), "{detail}");
    assert!(detail.contains("LSN 5..=8"), "{detail}");
    assert!(detail.contains(&segment_file_name(2)), "{detail}");
    let two = provider.open_local(LogId(2)).await.expect("open");
    assert_log_holds(&two, 8).await;
    append_records_of(&two, 9, 9).await;
}

/// Appends LSN 1..=10 to logs 1, 2 and 3, one record of each in turn.
async fn three_logs_of_ten(provider: &LocalLogProvider) {
    for lsn in 1..=10 {
        for log in 1..=3 {
            let log = provider.open_local(LogId(log)).await.expect("open");
            append_records_of(&log, lsn, lsn).await;
        }
    }
}

/// Appends LSN 1..=10 to logs 1, 2 and 3, one record of each in turn, and flips a byte in the
/// payload of log 2's LSN 5. Returns the damaged segment's path and the damaged record's offset.
async fn damage_log_2_of_three(dir: &Path) -> (PathBuf, usize) {
    three_logs_of_ten(&provider(dir, LocalLogOptions::default())).await;
    let segment = segment_path(dir, 1);
    let mut bytes = written_bytes(&segment);
    let offset = 13 * RECORD_BYTES;
    assert_eq!(walk(&bytes)[13], (offset, 2, 5));
    bytes[offset + HEADER_BYTES + 7] ^= 0x08;
    fs::write(&segment, &bytes).expect("damage");
    (segment, offset)
}

#[tokio::test]
async fn cutting_a_damaged_log_gives_up_its_records_from_the_damage_on_and_no_other_log_s() {
    let dir = TempDir::new().expect("temporary directory");
    let (segment, _) = damage_log_2_of_three(dir.path()).await;
    let damaged = fs::read(&segment).expect("segment");

    let report = cut_log(dir.path(), LogId(2), &LocalLogOptions::default()).expect("cut");
    assert_eq!(report.tail, 4);
    assert_eq!(report.dropped_lsns, vec![6, 7, 8, 9, 10]);
    assert_eq!(report.dropped_damaged_bytes, RECORD_BYTES as u64);
    assert!(!report.damage_may_have_held_other_records);
    let backup = PathBuf::from(format!("{}{BEFORE_CUT_SUFFIX}", segment.display()));
    assert_eq!(report.rewritten, vec![(segment.clone(), backup.clone())]);
    assert_eq!(
        fs::read(&backup).expect("backup"),
        damaged,
        "kept as it was"
    );
    assert_eq!(
        segment_names(dir.path()),
        names(&[1]),
        "the copy is no segment"
    );

    let provider = provider(dir.path(), LocalLogOptions::default());
    let two = provider.open_local(LogId(2)).await.expect("log 2 opens");
    assert_log_holds(&two, 4).await;
    append_records_of(&two, 5, 6).await;
    for log_id in [1, 3] {
        let log = provider.open_local(LogId(log_id)).await.expect("open");
        assert_log_holds(&log, 10).await;
        append_records_of(&log, 11, 11).await;
    }
    drop((two, provider));
    // The new LSN 5 and 6 of log 2 are the ones read after a restart, not the old ones.
    let provider = self::provider(dir.path(), LocalLogOptions::default());
    assert_logs_hold(&provider, &[(2, 6), (1, 11), (3, 11)]).await;
}

#[tokio::test]
async fn a_cut_is_refused_for_a_sound_log_an_open_log_and_damage_no_log_is_blamed_for() {
    let dir = TempDir::new().expect("temporary directory");
    let (segment, _) = damage_log_2_of_three(dir.path()).await;
    let options = LocalLogOptions::default();
    assert!(matches!(
        cut_log(dir.path(), LogId(1), &options),
        Err(CutError::NotRefused(LogId(1)))
    ));
    {
        let _open = provider(dir.path(), LocalLogOptions::default());
        match cut_log(dir.path(), LogId(2), &options) {
            Err(CutError::Io(e)) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "{e}"),
            other => panic!("expected the lock to be refused, got {other:?}"),
        }
    }
    // The LSN in the header of log 1's last record: no log can be blamed for it.
    let mut bytes = fs::read(&segment).expect("segment");
    let last_of_1 = 27 * RECORD_BYTES;
    assert_eq!(walk(&written_bytes(&segment))[27], (last_of_1, 1, 10));
    bytes[last_of_1 + 16 + 5] ^= 0x01;
    fs::write(&segment, &bytes).expect("damage");
    match cut_log(dir.path(), LogId(2), &options) {
        Err(CutError::NotCuttable { detail, .. }) => {
            assert!(detail.contains("every log is refused"), "{detail}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(
        fs::read(&segment).expect("segment"),
        bytes,
        "nothing was changed"
    );
    assert!(cut_log(&dir.path().join("nothing"), LogId(2), &options).is_err());
    assert!(
        !inspect_log(dir.path(), LogId(7), &options)
            .expect("inspect")
            .known
    );
    assert!(matches!(
        cut_log(dir.path(), LogId(7), &options),
        Err(CutError::Io(e)) if e.kind() == io::ErrorKind::NotFound
    ));
}

#[tokio::test]
async fn trimming_a_damaged_log_past_its_damage_offline_loses_no_record_after_it() {
    let dir = TempDir::new().expect("temporary directory");
    damage_log_2_of_three(dir.path()).await;
    let options = LocalLogOptions::default();
    let seen = inspect_log(dir.path(), LogId(2), &options).expect("inspect");
    assert!(
        seen.refused
            .as_deref()
            .is_some_and(|r| r.contains("(LSN 5)")),
        "{seen:?}"
    );
    assert!(!seen.refused_all);
    assert_eq!(
        (seen.trim_point, seen.valid_through, seen.highest_seen),
        (0, 4, 10)
    );
    // Below the damage, the log stays refused.
    let below = trim_log_offline(dir.path(), LogId(2), 3, &options).expect("trim");
    assert!(below.refused.is_some(), "{below:?}");
    let past = trim_log_offline(dir.path(), LogId(2), 5, &options).expect("trim");
    assert_eq!(past.refused, None);
    assert_eq!((past.trim_point, past.valid_through), (5, 10));
    assert!(matches!(
        trim_log_offline(dir.path(), LogId(2), 5, &options),
        Err(CutError::NotCuttable { .. })
    ));

    {
        let provider = provider(dir.path(), options.clone());
        let two = provider.open_local(LogId(2)).await.expect("log 2 opens");
        assert_eq!(two.state().await.expect("state"), state_of(5, 10));
        assert_eq!(
            two.read(Lsn(6), 100).await.expect("read"),
            records_of(2, 6, 10)
        );
        for log_id in [1, 3] {
            let log = provider.open_local(LogId(log_id)).await.expect("open");
            assert_log_holds(&log, 10).await;
        }
    }

    // A damaged list of accepted damage is named as such, and neither a trim nor a cut goes on.
    let accepted = dir.path().join("2").join("accepted-damage");
    let mut list = fs::read(&accepted).expect("accepted damage");
    list[3] ^= 0x01;
    fs::write(&accepted, &list).expect("damage");
    let provider = provider(dir.path(), options.clone());
    let (path, _, detail) = expect_corrupt(provider.open_local(LogId(2)).await);
    assert_eq!(path, accepted.display().to_string());
    assert!(detail.contains("checksum mismatch"), "{detail}");
    drop(provider);
    assert!(
        inspect_log(dir.path(), LogId(2), &options)
            .expect("inspect")
            .trim_point_damaged
    );
    assert!(matches!(
        cut_log(dir.path(), LogId(2), &options),
        Err(CutError::NotCuttable { .. })
    ));
}

#[tokio::test]
async fn damage_that_names_a_trimmed_record_refuses_every_log_unless_accepted_for_it() {
    let dir = TempDir::new().expect("temporary directory");
    {
        let provider = provider(dir.path(), LocalLogOptions::default());
        three_logs_of_ten(&provider).await;
        let one = provider.open_local(LogId(1)).await.expect("open");
        append_records_of(&one, 11, 12).await;
        let two = provider.open_local(LogId(2)).await.expect("open");
        two.trim(Lsn(10)).await.expect("trim");
    }
    // One bit of the header of log 3's last record: it now names log 2's LSN 10, which log 2 has
    // trimmed. Were that taken at its word, log 3 would lose its last record without a trace.
    let segment = segment_path(dir.path(), 1);
    let mut bytes = written_bytes(&segment);
    let found = walk(&bytes);
    assert_eq!((found[29].1, found[29].2), (3, 10));
    bytes[found[29].0 + 8] ^= 0x01;
    fs::write(&segment, &bytes).expect("damage");

    let provider = provider(dir.path(), LocalLogOptions::default());
    for log_id in [1, 2, 3] {
        let (_, _, detail) = expect_corrupt(provider.open_local(LogId(log_id)).await);
        assert!(detail.contains("every log is refused"), "{detail}");
    }
    drop(provider);
    // Log 2 cannot take it as its own: it is not the log's damage (no log owns it).
    assert!(matches!(
        trim_log_offline(dir.path(), LogId(2), 11, &LocalLogOptions::default()),
        Err(CutError::NotCuttable { detail, .. }) if detail.contains("no log can be blamed")
    ));
}

#[tokio::test]
async fn cutting_one_log_out_of_damage_that_spans_two_logs_records_leaves_the_other_refused() {
    let dir = TempDir::new().expect("temporary directory");
    let (segment, offset) = damage_log_2_of_three(dir.path()).await;
    // Log 3's LSN 5, right after log 2's damaged LSN 5, is damaged too.
    let mut bytes = fs::read(&segment).expect("segment");
    bytes[offset + RECORD_BYTES + 4] ^= 0x10;
    fs::write(&segment, &bytes).expect("damage");
    let options = LocalLogOptions::default();

    let report = cut_log(dir.path(), LogId(2), &options).expect("cut");
    assert_eq!(report.tail, 4);
    assert_eq!(report.dropped_damaged_bytes, 2 * RECORD_BYTES as u64);
    assert!(report.damage_may_have_held_other_records);
    let seen = inspect_log(dir.path(), LogId(3), &options).expect("inspect");
    assert!(
        seen.refused
            .as_deref()
            .is_some_and(|r| r.contains("records are missing")),
        "log 3 still misses its LSN 5: {seen:?}"
    );
    assert_eq!(
        cut_log(dir.path(), LogId(3), &options).expect("cut").tail,
        4
    );

    let provider = provider(dir.path(), options);
    assert_logs_hold(&provider, &[(1, 10), (2, 4), (3, 4)]).await;
}

#[tokio::test]
async fn a_cut_moves_the_damage_accepted_for_another_log_with_the_bytes_before_it() {
    let dir = TempDir::new().expect("temporary directory");
    let (segment, _) = damage_log_2_of_three(dir.path()).await;
    // Log 3's LSN 8, after log 2's damaged LSN 5 and some of log 2's records after it.
    let mut bytes = fs::read(&segment).expect("segment");
    let of_3 = 23 * RECORD_BYTES;
    assert_eq!(walk(&written_bytes(&segment))[23], (of_3, 3, 8));
    bytes[of_3 + HEADER_BYTES + 7] ^= 0x08;
    fs::write(&segment, &bytes).expect("damage");
    let options = LocalLogOptions::default();

    // Log 3 is trimmed past its damage, which is accepted for it where it lies...
    let three = trim_log_offline(dir.path(), LogId(3), 8, &options).expect("trim");
    assert_eq!(three.refused, None);
    // ...then log 2 is cut: the bytes before log 3's damage shrink.
    let report = cut_log(dir.path(), LogId(2), &options).expect("cut");
    assert_eq!(report.tail, 4);

    let provider = provider(dir.path(), options);
    assert_logs_hold(&provider, &[(1, 10), (2, 4)]).await;
    let three = provider.open_local(LogId(3)).await.expect("log 3 opens");
    assert_eq!(three.state().await.expect("state"), state_of(8, 10));
    assert_eq!(
        three.read(Lsn(9), 10).await.expect("read"),
        records_of(3, 9, 10)
    );
}

#[tokio::test]
async fn cutting_a_log_with_a_lost_segment_gives_up_its_records_after_the_gap() {
    let dir = TempDir::new().expect("temporary directory");
    lose_a_middle_segment(dir.path()).await;

    let report = cut_log(dir.path(), LogId(1), &tiny_segments()).expect("cut");
    assert_eq!(report.tail, 4);
    assert_eq!(report.dropped_lsns, vec![9, 10, 11, 12]);
    assert_eq!(report.dropped_damaged_bytes, 0);
    assert_eq!(report.rewritten.len(), 1);
    assert_eq!(report.rewritten[0].0, segment_path(dir.path(), 4));

    let provider = provider(dir.path(), tiny_segments());
    let one = provider.open_local(LogId(1)).await.expect("log 1 opens");
    assert_log_holds(&one, 4).await;
    append_records_of(&one, 5, 5).await;
    let two = provider.open_local(LogId(2)).await.expect("open");
    assert_log_holds(&two, 8).await;
}

#[tokio::test]
async fn a_log_in_the_old_layout_is_refused_saying_what_to_do() {
    let dir = TempDir::new().expect("temporary directory");
    let old = dir.path().join("5");
    fs::create_dir_all(&old).expect("old log directory");
    fs::write(old.join("00000000000000000001.seg"), b"old records").expect("old segment");
    let provider = provider(dir.path(), LocalLogOptions::default());
    match provider.open_local(LogId(5)).await {
        Err(error @ Error::Io { .. }) => {
            let message = error.to_string();
            assert!(message.contains(&old.display().to_string()), "{message}");
            assert!(message.contains("earlier Cairn version"), "{message}");
            assert!(message.contains("new, empty one"), "{message}");
        }
        Err(other) => panic!("expected an old-layout error, got {other}"),
        Ok(_) => panic!("a log in the old layout opened"),
    }
    let log = provider
        .open_local(LogId(1))
        .await
        .expect("other logs open");
    append_records(&log, 1, 1).await;
    assert!(
        old.join("00000000000000000001.seg").exists(),
        "nothing was deleted"
    );
}

#[test]
fn invalid_options_are_refused() {
    let dir = TempDir::new().expect("temporary directory");
    for options in [
        LocalLogOptions {
            queue_depth_max: 0,
            ..Default::default()
        },
        LocalLogOptions {
            segment_bytes_max: 0,
            ..Default::default()
        },
        LocalLogOptions {
            segment_bytes_max: u64::from(u32::MAX) + 1,
            ..Default::default()
        },
        LocalLogOptions {
            record_bytes_max: u32::MAX as usize,
            ..Default::default()
        },
    ] {
        let error = LocalLogProvider::open(dir.path(), options).expect_err("invalid options");
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_syncs_among_overlapping_ones_keep_exactly_what_was_acknowledged() {
    let dir = TempDir::new().expect("temporary directory");
    let options = LocalLogOptions {
        segment_bytes_max: 2048,
        syncs_in_flight_max: 4,
        sync_overlap_after: std::time::Duration::ZERO,
        ..Default::default()
    };
    let acknowledged = {
        let provider = provider(dir.path(), options.clone());
        let faults = provider.open_local(LogId(1)).await.expect("open").faults();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let toggler = tokio::spawn({
            let stop = stop.clone();
            async move {
                // Syncs fail now and then for as long as the appenders run.
                while !stop.load(Ordering::SeqCst) {
                    faults.sync_fails.store(true, Ordering::SeqCst);
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    faults.sync_fails.store(false, Ordering::SeqCst);
                    tokio::time::sleep(std::time::Duration::from_millis(3)).await;
                }
            }
        });
        let mut all: HashMap<u16, std::collections::BTreeMap<Lsn, Bytes>> = HashMap::new();
        let mut failures = 0;
        // Rounds of appends until syncs have overlapped and some have failed: on a busy machine
        // one round may see neither.
        for round in 0..20 {
            if round > 0 && failures > 0 && provider.overlapped_syncs() > 0 {
                break;
            }
            let mut tasks = Vec::new();
            for task in 0..16u16 {
                let log = provider
                    .open_local(LogId(1 + task % 4))
                    .await
                    .expect("open");
                tasks.push(tokio::spawn(async move {
                    let mut acknowledged = Vec::new();
                    let mut failed = 0;
                    for i in 0..60 {
                        let payload = Bytes::from(format!("round {round} task {task} record {i}"));
                        match log.append(vec![payload.clone()]).await {
                            Ok(lsn) => acknowledged.push((lsn, payload)),
                            Err(_) => failed += 1,
                        }
                    }
                    (log.log_id().0, acknowledged, failed)
                }));
            }
            for task in tasks {
                let (log, acknowledged, failed) = task.await.expect("task");
                all.entry(log).or_default().extend(acknowledged);
                failures += failed;
            }
        }
        stop.store(true, Ordering::SeqCst);
        toggler.await.expect("toggler");
        assert!(failures > 0, "some syncs failed");
        assert!(provider.overlapped_syncs() > 0, "syncs overlapped");
        // Exactly the acknowledged records, dense, while the provider runs...
        for (log_id, expected) in &all {
            let log = provider.open_local(LogId(*log_id)).await.expect("open");
            let read = log.read(Lsn(1), 10_000).await.expect("read");
            let read: std::collections::BTreeMap<Lsn, Bytes> =
                read.into_iter().map(|e| (e.lsn, e.payload)).collect();
            assert_eq!(&read, expected, "log {log_id}");
        }
        all
    };
    // ...and after reopening.
    let provider = provider(dir.path(), options);
    for (log_id, expected) in &acknowledged {
        let log = provider.open_local(LogId(*log_id)).await.expect("reopen");
        let tail = expected.keys().next_back().copied().unwrap_or(Lsn(0));
        assert_eq!(log.state().await.expect("state"), state_of(0, tail.0));
        assert_eq!(expected.len() as u64, tail.0, "log {log_id} is dense");
        let read = log.read(Lsn(1), 10_000).await.expect("read");
        let read: std::collections::BTreeMap<Lsn, Bytes> =
            read.into_iter().map(|e| (e.lsn, e.payload)).collect();
        assert_eq!(&read, expected, "log {log_id}");
    }
}

#[tokio::test]
async fn recent_records_are_read_from_memory_and_older_ones_from_the_segments() {
    let dir = TempDir::new().expect("temporary directory");
    let options = LocalLogOptions {
        // Room for the payloads of the last 5 test records.
        cache_bytes_max: 5 * 34,
        ..Default::default()
    };
    let provider = provider(dir.path(), options);
    let log = provider.open_local(LogId(1)).await.expect("open");
    append_records(&log, 1, 10).await;
    // The segment loses its content behind the provider's back: only what is in memory reads.
    OpenOptions::new()
        .write(true)
        .open(segment_path(dir.path(), 1))
        .expect("segment")
        .set_len(0)
        .expect("empty the segment");
    assert_eq!(log.read(Lsn(6), 100).await.expect("read"), records(6, 10));
    assert!(
        log.read(Lsn(5), 100).await.is_err(),
        "LSN 5 is not in memory, so it is read from the (now empty) segment"
    );
}

/// A slow disk with many appenders: the writer stops taking requests while many commits wait for
/// syncs, and a syncer that finished must never wait for room in the request queue to say so,
/// or writer and syncers wait for each other forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_appenders_on_a_slow_disk_never_stall_the_writer() {
    let dir = TempDir::new().expect("temporary directory");
    let options = LocalLogOptions {
        syncs_in_flight_max: 1,
        queue_depth_max: 1,
        ..Default::default()
    };
    let provider = provider(dir.path(), options);
    let mut logs = Vec::new();
    for id in 1..=4 {
        logs.push(provider.open_local(LogId(id)).await.expect("open"));
    }
    logs[0].faults().sync_delay_ms.store(20, Ordering::SeqCst);
    let appenders: Vec<_> = (0..300u64)
        .map(|i| {
            let log = logs[(i % 4) as usize].clone();
            tokio::spawn(async move { log.append(vec![Bytes::from(format!("{i}"))]).await })
        })
        .collect();
    let all = async {
        let mut results = Vec::new();
        for appender in appenders {
            results.push(appender.await);
        }
        results
    };
    let Ok(results) = tokio::time::timeout(std::time::Duration::from_secs(30), all).await else {
        // Dropping a stalled provider would wait for its writer forever.
        std::mem::forget(provider);
        std::mem::forget(logs);
        panic!("appends stalled: the writer and its syncers wait for each other");
    };
    for result in results {
        result.expect("task").expect("append");
    }
    logs[0].faults().sync_delay_ms.store(0, Ordering::SeqCst);
    let mut total = 0;
    for log in &logs {
        total += log.state().await.expect("state").tail.0;
    }
    assert_eq!(total, 300);
}

/// A crash right after a rollover leaves an empty newest segment; other files an operator left in
/// the segment directory are ignored, unless their name claims to be a segment's.
#[tokio::test]
async fn an_empty_newest_segment_and_stray_files_are_handled() {
    let dir = TempDir::new().expect("temporary directory");
    write_log_1(dir.path(), tiny_segments(), 6).await;
    let segments = segment_names(dir.path());
    assert_eq!(segments, names(&[1, 2]));
    // As a crash right after starting segment 3 leaves them: segment 2 cut to its records (and
    // synced) first, then segment 3 created.
    let second = segment_path(dir.path(), 2);
    OpenOptions::new()
        .write(true)
        .open(&second)
        .expect("segment")
        .set_len(written_len(&second))
        .expect("cut");
    File::create(segment_path(dir.path(), 3)).expect("create an empty segment");
    fs::write(wal_dir(dir.path()).join("notes.txt"), b"not a segment").expect("stray file");
    fs::copy(
        segment_path(dir.path(), 1),
        wal_dir(dir.path()).join(format!("{}.bak", segment_file_name(1))),
    )
    .expect("stray copy");
    {
        let provider = provider(dir.path(), tiny_segments());
        let log = provider.open_local(LogId(1)).await.expect("open");
        assert_eq!(log.state().await.expect("state"), state_of(0, 6));
        assert_eq!(log.read(Lsn(1), 100).await.expect("read"), records(1, 6));
        append_records(&log, 7, 7).await;
    }
    {
        let provider = provider(dir.path(), tiny_segments());
        let log = provider.open_local(LogId(1)).await.expect("open");
        assert_eq!(log.read(Lsn(1), 100).await.expect("read"), records(1, 7));
    }
    // A file named like a segment but not numbered as one: no log is opened, and the error says
    // which file and what to do with it.
    let stray = wal_dir(dir.path()).join("copy.wal");
    fs::write(&stray, b"").expect("stray segment");
    let provider = provider(dir.path(), tiny_segments());
    let (path, _, detail) = expect_corrupt(provider.open_local(LogId(1)).await);
    assert_eq!(path, stray.display().to_string());
    assert!(detail.contains("move it out"), "{detail}");
}
