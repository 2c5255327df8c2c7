//! The bytes on disk: how a record is framed in a segment, positional reads of a segment, the
//! scan for a valid record after a bad spot, and the durable writes of directories and trim points.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// `[u32 len][u32 crc][u64 log id][u64 lsn]`.
pub(super) const HEADER_BYTES: usize = 24;
/// How much a read fetches from a segment at once, so that reading many small records costs a few
/// system calls rather than two per record.
pub(super) const READ_CHUNK_BYTES: usize = 256 * 1024;
pub(super) const SEGMENT_SUFFIX: &str = ".wal";
pub(super) const TRIM_POINT_FILE: &str = "trim-point";
pub(super) const TRIM_POINT_TMP_FILE: &str = "trim-point.tmp";
/// Damaged bytes an operator accepted for a log trimmed past them (see
/// [`read_accepted_damage`]).
pub(super) const ACCEPTED_DAMAGE_FILE: &str = "accepted-damage";

/// A record's header as found on disk (not yet checked against its payload).
#[derive(Debug, Clone, Copy)]
pub(super) struct Header {
    pub len: u32,
    pub crc: u32,
    pub log_id: u64,
    pub lsn: u64,
}

impl Header {
    pub fn parse(bytes: &[u8]) -> Header {
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        Header {
            len: u32_at(0),
            crc: u32_at(4),
            log_id: u64_at(8),
            lsn: u64_at(16),
        }
    }

    /// Whether `payload` is the one this header was written with.
    pub fn matches(&self, payload: &[u8]) -> bool {
        record_crc(self.len, self.log_id, self.lsn, payload) == self.crc
    }
}

pub(super) fn encode_record(buf: &mut Vec<u8>, log_id: u64, lsn: u64, payload: &[u8]) {
    let len =
        u32::try_from(payload.len()).expect("record_bytes_max (checked at append) fits in 32 bits");
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&record_crc(len, log_id, lsn, payload).to_le_bytes());
    buf.extend_from_slice(&log_id.to_le_bytes());
    buf.extend_from_slice(&lsn.to_le_bytes());
    buf.extend_from_slice(payload);
}

/// Covers the length, the log id and the LSN too, so that a torn length or a record of another
/// log cannot pass for the one expected.
fn record_crc(len: u32, log_id: u64, lsn: u64, payload: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&len.to_le_bytes());
    let crc = crc32c::crc32c_append(crc, &log_id.to_le_bytes());
    let crc = crc32c::crc32c_append(crc, &lsn.to_le_bytes());
    crc32c::crc32c_append(crc, payload)
}

pub(super) fn segment_file_name(seq: u64) -> String {
    format!("{seq:020}{SEGMENT_SUFFIX}")
}

/// Why a record could not be read.
pub(super) enum RecordError {
    Io(io::Error),
    /// Short, or fails its checksum.
    Invalid(String),
}

impl From<io::Error> for RecordError {
    fn from(e: io::Error) -> Self {
        RecordError::Io(e)
    }
}

/// Positional reads of a segment's first `end` bytes through a buffer.
pub(super) struct SegmentReader<'f> {
    file: &'f File,
    pub end: u64,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    buf_start: u64,
}

impl<'f> SegmentReader<'f> {
    pub fn new(file: &'f File, end: u64) -> Self {
        SegmentReader {
            file,
            end,
            buf: Vec::new(),
            buf_start: 0,
        }
    }

    pub fn read(&mut self, offset: u64, len: usize) -> Result<&[u8], RecordError> {
        let available = self.end.saturating_sub(offset);
        if (len as u64) > available {
            return Err(RecordError::Invalid(format!(
                "needs {len} bytes but the segment has {available} left"
            )));
        }
        let cached = offset >= self.buf_start
            && offset + len as u64 <= self.buf_start + self.buf.len() as u64;
        if !cached {
            // `available` is at least `len`, so this fits in usize.
            let fetch = (len.max(READ_CHUNK_BYTES) as u64).min(available) as usize;
            self.buf.resize(fetch, 0);
            self.file.read_exact_at(&mut self.buf, offset)?;
            self.buf_start = offset;
        }
        let start = (offset - self.buf_start) as usize;
        Ok(&self.buf[start..start + len])
    }
}

/// Reads and checks the record at `offset`. Returns its header and the offset of the next record.
pub(super) fn read_record(
    reader: &mut SegmentReader<'_>,
    offset: u64,
) -> Result<(Header, u64), RecordError> {
    let header = Header::parse(reader.read(offset, HEADER_BYTES)?);
    let payload_offset = offset + HEADER_BYTES as u64;
    let next = payload_offset + u64::from(header.len);
    if next > reader.end {
        return Err(RecordError::Invalid(format!(
            "a payload of {} bytes runs past the end of the segment ({} bytes)",
            header.len, reader.end
        )));
    }
    let payload = reader.read(payload_offset, header.len as usize)?;
    if !header.matches(payload) {
        return Err(RecordError::Invalid(format!(
            "checksum mismatch in the record of LSN {}",
            header.lsn
        )));
    }
    Ok((header, next))
}

/// Looks, past the bad spot at `bad_offset`, for a well-formed record: a header that
/// `plausible(log id, lsn, most records between)` accepts there and whose checksum matches.
/// Returns its offset and header. Every byte offset below `starts_below` is tried, since the bad
/// record's length cannot be trusted.
pub(super) fn valid_record_after(
    reader: &mut SegmentReader<'_>,
    bad_offset: u64,
    starts_below: u64,
    plausible: impl Fn(u64, u64, u64) -> bool,
) -> Result<Option<(u64, Header)>, RecordError> {
    let end = reader.end;
    let mut offset = bad_offset + 1;
    while offset < starts_below && offset + HEADER_BYTES as u64 <= end {
        let header = Header::parse(reader.read(offset, HEADER_BYTES)?);
        let most_records_between = (offset - bad_offset) / HEADER_BYTES as u64;
        if plausible(header.log_id, header.lsn, most_records_between) {
            match read_record(reader, offset) {
                Ok((header, _)) => return Ok(Some((offset, header))),
                Err(RecordError::Invalid(_)) => {}
                Err(e) => return Err(e),
            }
        }
        offset += 1;
    }
    Ok(None)
}

/// With `options.preallocate`, gives the segment `file` `segment_bytes_max` bytes of allocated
/// space, zeros where nothing was written, so that later writes below that do not change the
/// file's size. (On ext4 and XFS the first write into each allocated block still changes the
/// file's extents, from unwritten to written, which the commit's `fdatasync` also makes durable;
/// writing the zeros ahead of time would spare that, but on this project's test machines it cost
/// about as much as it saved.) Best effort: on failure (a file system without `fallocate`, a full
/// disk) the file grows as it is written, as it would have anyway.
pub(super) fn preallocate(file: &File, options: &super::LocalLogOptions) {
    use std::os::fd::AsRawFd;
    if !options.preallocate {
        return;
    }
    let Ok(len) = libc::off_t::try_from(options.segment_bytes_max) else {
        return;
    };
    // SAFETY: `file` owns a valid descriptor for the duration of the call; mode 0 only allocates
    // (and extends the size), it never changes existing bytes.
    let result = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if result != 0 {
        tracing::debug!(
            error = %io::Error::last_os_error(),
            "cannot preallocate a log segment; it grows as it is written"
        );
    }
}

/// Where the last non-zero byte of the first `len` bytes of `file` ends: a preallocated segment
/// is zeros after its last write, and no record starts in them (its header would be all zero,
/// which no valid record's is).
pub(super) fn end_of_non_zero(file: &File, len: u64) -> io::Result<u64> {
    const CHUNK: u64 = 1024 * 1024;
    let mut buf = vec![0u8; CHUNK as usize];
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(CHUNK);
        let chunk = &mut buf[..(end - start) as usize];
        file.read_exact_at(chunk, start)?;
        if let Some(last) = chunk.iter().rposition(|b| *b != 0) {
            return Ok(start + last as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

pub(super) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir` and its missing ancestors and, with `fsync`, syncs the parent of every directory
/// it created: a file synced into a directory whose own entry never reached the disk would be
/// lost with it.
pub(super) fn create_dir_durably(dir: &Path, fsync: bool) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut ancestor = Some(dir);
    while let Some(path) = ancestor.filter(|p| !p.as_os_str().is_empty() && !p.exists()) {
        missing.push(path);
        ancestor = path.parent();
    }
    fs::create_dir_all(dir)?;
    if fsync {
        for created in missing.iter().rev() {
            match created.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => sync_dir(parent)?,
                _ => sync_dir(Path::new("."))?,
            }
        }
    }
    Ok(())
}

/// Writes `trim_point` to `<dir>/trim-point` so that the file holds the old or the new value,
/// never a mix: a temporary file, synced, renamed over it, the directory synced.
pub(super) fn write_trim_point(dir: &Path, trim_point: u64, fsync: bool) -> io::Result<()> {
    let value = trim_point.to_le_bytes();
    let mut content = value.to_vec();
    content.extend_from_slice(&crc32c::crc32c(&value).to_le_bytes());
    replace_durably(dir, TRIM_POINT_FILE, TRIM_POINT_TMP_FILE, &content, fsync)
}

/// Makes `<dir>/<name>` hold `content`, the old content or the new, never a mix: `<dir>/<tmp>`
/// written and synced, renamed over it, the directory synced (`dir` is created if missing).
fn replace_durably(
    dir: &Path,
    name: &str,
    tmp: &str,
    content: &[u8],
    fsync: bool,
) -> io::Result<()> {
    create_dir_durably(dir, fsync)?;
    let tmp = dir.join(tmp);
    {
        let file = File::create(&tmp)?;
        file.write_all_at(content, 0)?;
        if fsync {
            file.sync_data()?;
        }
    }
    fs::rename(&tmp, dir.join(name))?;
    if fsync {
        sync_dir(dir)?;
    }
    Ok(())
}

/// Why a log's trim point (or its accepted damage) could not be read.
pub(super) enum TrimPointError {
    Io(&'static str, io::Error),
    Corrupt(String),
}

/// The durable trim point kept in `dir` (0 if the log was never trimmed).
pub(super) fn read_trim_point(dir: &Path) -> Result<u64, TrimPointError> {
    // A leftover temporary file is a trim that crashed before its rename: it never happened.
    match fs::remove_file(dir.join(TRIM_POINT_TMP_FILE)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(TrimPointError::Io(
                "removing a stale temporary trim point",
                e,
            ));
        }
        _ => {}
    }
    match fs::read(dir.join(TRIM_POINT_FILE)) {
        Ok(content) => {
            let (value, crc) = content
                .split_first_chunk::<8>()
                .and_then(|(v, rest)| Some((v, <[u8; 4]>::try_from(rest).ok()?)))
                .ok_or_else(|| {
                    TrimPointError::Corrupt(format!("expected 12 bytes, found {}", content.len()))
                })?;
            if crc32c::crc32c(value) != u32::from_le_bytes(crc) {
                return Err(TrimPointError::Corrupt("checksum mismatch".into()));
            }
            Ok(u64::from_le_bytes(*value))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(TrimPointError::Io("reading the trim point", e)),
    }
}

/// The damaged spots (segment, offset, end) accepted for the log kept in `dir`: each as three
/// little-endian `u64`s, then a CRC-32C of them all.
pub(super) fn read_accepted_damage(dir: &Path) -> Result<Vec<(u64, u64, u64)>, TrimPointError> {
    let content = match fs::read(dir.join(ACCEPTED_DAMAGE_FILE)) {
        Ok(content) => content,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(TrimPointError::Io("reading the accepted damage", e)),
    };
    let Some((entries, crc)) = content
        .split_last_chunk::<4>()
        .filter(|(entries, _)| entries.len() % 24 == 0)
    else {
        return Err(TrimPointError::Corrupt(format!(
            "expected 24 bytes per entry and 4 more, found {}",
            content.len()
        )));
    };
    if crc32c::crc32c(entries) != u32::from_le_bytes(*crc) {
        return Err(TrimPointError::Corrupt("checksum mismatch".into()));
    }
    let u64_at = |b: &[u8], i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    Ok(entries
        .chunks_exact(24)
        .map(|e| (u64_at(e, 0), u64_at(e, 8), u64_at(e, 16)))
        .collect())
}

/// Adds `spots` to the damage accepted for the log kept in `dir`, durably: the old or the new
/// list, never a mix.
pub(super) fn accept_damage(dir: &Path, spots: &[(u64, u64, u64)], fsync: bool) -> io::Result<()> {
    let mut all = read_accepted_damage(dir).map_err(|e| match e {
        TrimPointError::Io(_, e) => e,
        TrimPointError::Corrupt(detail) => io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {detail}", dir.join(ACCEPTED_DAMAGE_FILE).display()),
        ),
    })?;
    for spot in spots {
        if !all.contains(spot) {
            all.push(*spot);
        }
    }
    let mut content: Vec<u8> = all
        .iter()
        .flat_map(|(seq, offset, end)| [*seq, *offset, *end])
        .flat_map(u64::to_le_bytes)
        .collect();
    content.extend_from_slice(&crc32c::crc32c(&content).to_le_bytes());
    replace_durably(
        dir,
        ACCEPTED_DAMAGE_FILE,
        &format!("{ACCEPTED_DAMAGE_FILE}.tmp"),
        &content,
        fsync,
    )
}
