//! Recovery at open: reads every log's trim point and every shared segment once, in order,
//! rebuilds each log's record locations, cuts a torn tail, and decides which logs damage or
//! missing records keep from opening. See the crash-consistency rules in the [module docs](super).

use super::record::{
    self, HEADER_BYTES, Header, RecordError, SEGMENT_SUFFIX, SegmentReader, TrimPointError,
    end_of_non_zero, preallocate, read_record, segment_file_name, valid_record_after,
};
use super::writer::{Active, DiskState, SegmentMeta};
use super::{Loc, LocalLogOptions, Refusal, Run, SegmentFile};
use cairn_types::LogId;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What recovery found.
pub(super) struct Recovered {
    pub logs: HashMap<LogId, LogRecovered>,
    pub refused: HashMap<LogId, Refusal>,
    pub refused_all: Option<Refusal>,
    pub disk: DiskState,
}

pub(super) struct LogRecovered {
    pub trim_point: u64,
    pub tail: u64,
    pub runs: VecDeque<Run>,
}

/// Recovers every log under `dir`. Blocking. Fails only if the files cannot be read at all;
/// damage and missing records refuse the logs they concern instead.
pub(super) fn recover(
    dir: &Path,
    wal_dir: &Path,
    options: &LocalLogOptions,
) -> io::Result<Recovered> {
    let mut scan = Scan::default();
    let active = scan.run(dir, wal_dir, options)?;
    let refused_all = scan.unattributed();
    if refused_all.is_none() {
        scan.delete_trimmed_segments(active.as_ref().map(|a| a.seq))?;
    }
    let next_seq = scan.present.last().map_or(1, |last| last + 1);
    let logs = scan.logs();
    tracing::info!(
        logs = logs.len(),
        refused = scan.refused.len(),
        segments = scan.segments.len(),
        "recovered the log"
    );
    Ok(Recovered {
        logs,
        refused: scan.refused,
        refused_all,
        disk: DiskState {
            segments: scan.segments,
            active,
            next_seq,
        },
    })
}

/// Damage that is not a torn tail.
struct BadSpot {
    /// Where: segment and offset, ordered as the log is.
    at: (u64, u64),
    /// Where the next valid record starts (or the segment ends).
    end: u64,
    path: String,
    detail: String,
    /// The logs refused for it.
    blamed: Vec<LogId>,
    /// Whether it is one record: its header's length reaches exactly to `end`. If not, other
    /// records may lie in it.
    alone: bool,
}

/// What a scan for [`cut_plan`] found of the log to cut, and what it leaves the others.
pub(super) struct CutPlan {
    /// Why the log is refused; `None` if it opens.
    pub refusal: Option<Refusal>,
    /// Why every log is refused, if damage cannot be put on one.
    pub refused_all: Option<Refusal>,
    /// The last LSN the log keeps: the end of its valid records (its trim point if none).
    pub keeps_through: u64,
    /// The log's trim point.
    pub trim_point: u64,
    /// The highest LSN of the log found in any record, valid or not.
    pub highest_seen: u64,
    /// Whether the log exists: it has a directory (a trim point) or records.
    pub known: bool,
    /// Whether its trim point file is damaged.
    pub trim_point_damaged: bool,
    /// The damaged spots that are the log's own (segment, offset, end): it owns them, or was
    /// the first log refused for them.
    pub own_spots: Vec<(u64, u64, u64)>,
    /// Byte ranges to leave out, by segment: the log's records past its valid ones and the
    /// damage blamed on it.
    pub drops: BTreeMap<u64, Vec<std::ops::Range<u64>>>,
    /// LSNs of the records left out, in the order found.
    pub dropped_lsns: Vec<u64>,
    /// Bytes of the damage blamed on the log, among `drops`.
    pub damaged_bytes: u64,
    /// Whether some of that damage is longer than the record that names the log: records of
    /// other logs may have been lost in it.
    pub damage_may_hide_records: bool,
    /// Every segment's path and the end of what it holds (a torn tail and preallocated zeros
    /// excluded).
    pub segments: BTreeMap<u64, (PathBuf, u64)>,
    /// Every log's tail and whether it is refused, to check that a cut changes no other log.
    pub logs: BTreeMap<LogId, (u64, bool)>,
}

/// Reads the logs in `dir` as [`recover`] does, but changes nothing (no torn tail is cut, no
/// trimmed segment deleted), and says what cutting `log_id` at the end of its valid records would
/// leave out. Blocking; the caller holds the directory's lock.
pub(super) fn cut_plan(
    dir: &Path,
    wal_dir: &Path,
    options: &LocalLogOptions,
    log_id: LogId,
    assume: Option<Assumed>,
) -> io::Result<CutPlan> {
    let mut scan = Scan {
        dry: true,
        watch: Some(log_id),
        assume,
        ..Scan::default()
    };
    scan.run(dir, wal_dir, options)?;
    let refused_all = scan.unattributed();
    let mut drops: BTreeMap<u64, Vec<std::ops::Range<u64>>> = BTreeMap::new();
    let mut dropped_lsns = Vec::new();
    let mut keeps_through = scan.trims.get(&log_id).copied().unwrap_or(0);
    for w in &scan.watched {
        if w.kept {
            keeps_through = keeps_through.max(w.lsn);
        } else {
            drops.entry(w.seq).or_default().push(w.start..w.end);
            dropped_lsns.push(w.lsn);
        }
    }
    let (mut damaged_bytes, mut damage_may_hide_records) = (0, false);
    // Only the log's own: damage another log owns stays, and keeps refusing that log.
    let own: Vec<&BadSpot> = scan
        .bad_spots
        .iter()
        .filter(|s| s.blamed.first() == Some(&log_id))
        .collect();
    let own_spots = own.iter().map(|s| (s.at.0, s.at.1, s.end)).collect();
    for spot in own {
        drops
            .entry(spot.at.0)
            .or_default()
            .push(spot.at.1..spot.end);
        damaged_bytes += spot.end - spot.at.1;
        damage_may_hide_records |= !spot.alone;
    }
    for ranges in drops.values_mut() {
        ranges.sort_by_key(|r| r.start);
    }
    let segments = scan
        .segments
        .iter()
        .filter_map(|(seq, meta)| {
            let end = scan.ends.get(seq)?;
            Some((*seq, (meta.file.path.clone(), *end)))
        })
        .collect();
    let refusal = scan.refused.get(&log_id).cloned();
    let trim_point = scan.trims.get(&log_id).copied().unwrap_or(0);
    let highest_seen = scan.next.get(&log_id).map_or(trim_point, |n| n - 1);
    let trim_point_damaged = scan.bad_trim_points.contains(&log_id);
    let known = scan.trims.contains_key(&log_id)
        || scan.next.contains_key(&log_id)
        || scan.refused.contains_key(&log_id);
    let refused: HashSet<LogId> = scan.refused.keys().copied().collect();
    let logs = scan
        .logs()
        .into_iter()
        .map(|(id, log)| (id, (log.tail, refused.contains(&id))))
        .collect();
    Ok(CutPlan {
        refusal,
        refused_all,
        keeps_through,
        trim_point,
        highest_seen,
        known,
        trim_point_damaged,
        own_spots,
        drops,
        dropped_lsns,
        damaged_bytes,
        damage_may_hide_records,
        segments,
        logs,
    })
}

/// A record of the log a cut is planned for.
struct Watched {
    seq: u64,
    start: u64,
    end: u64,
    lsn: u64,
    /// Whether the log keeps it: one of its valid records (or a trimmed one).
    kept: bool,
}

#[derive(Default)]
struct Scan {
    trims: HashMap<LogId, u64>,
    /// The LSN each log expects next (for refused logs too: the highest seen plus one).
    next: HashMap<LogId, u64>,
    /// Where each log's last record was (segment, offset).
    last_at: HashMap<LogId, (u64, u64)>,
    runs: HashMap<LogId, VecDeque<Run>>,
    refused: HashMap<LogId, Refusal>,
    bad_spots: Vec<BadSpot>,
    segments: BTreeMap<u64, SegmentMeta>,
    /// Segments with a bad spot: what they hold is not fully known, so they are never deleted.
    damaged: HashSet<u64>,
    /// Every segment that was listed.
    present: BTreeSet<u64>,
    misnamed: Option<Refusal>,
    /// Change nothing on disk (a scan for [`cut_plan`]).
    dry: bool,
    /// The log whose records are noted in `watched`.
    watch: Option<LogId>,
    watched: Vec<Watched>,
    /// Where each segment's records end.
    ends: BTreeMap<u64, u64>,
    /// Damage accepted for a log (segment, offset, end), from its `accepted-damage` file.
    accepted: HashMap<(u64, u64, u64), LogId>,
    /// Logs whose trim point file (or accepted-damage file) is damaged.
    bad_trim_points: HashSet<LogId>,
    /// For a dry scan: the watched log read as if its trim point and accepted damage were
    /// these.
    assume: Option<Assumed>,
}

/// A trim point and accepted damage to read a log with, before they are written.
#[derive(Clone)]
pub(super) struct Assumed {
    pub trim_point: u64,
    pub accepted: Vec<(u64, u64, u64)>,
}

fn io_context<'p>(
    context: &'static str,
    path: &'p Path,
) -> impl FnOnce(io::Error) -> io::Error + 'p {
    move |e| io::Error::new(e.kind(), format!("{context} {}: {e}", path.display()))
}

impl Scan {
    /// Reads every log's trim point and every segment, in order. Returns the segment to append to
    /// (none in a dry scan).
    fn run(
        &mut self,
        dir: &Path,
        wal_dir: &Path,
        options: &LocalLogOptions,
    ) -> io::Result<Option<Active>> {
        self.read_log_dirs(dir)?;
        if let (Some(log_id), Some(assumed)) = (self.watch, self.assume.clone()) {
            self.trims.insert(log_id, assumed.trim_point);
            for spot in assumed.accepted {
                self.accepted.insert(spot, log_id);
            }
        }
        let files = self.list_segments(wal_dir)?;
        let mut active = None;
        let count = files.len();
        for (i, (seq, path)) in files.into_iter().enumerate() {
            active = self.segment(seq, path, i + 1 == count, options)?;
        }
        Ok(active)
    }

    /// Reads the trim point of every log that has a directory, and refuses logs in the old layout.
    fn read_log_dirs(&mut self, dir: &Path) -> io::Result<()> {
        for entry in fs::read_dir(dir).map_err(io_context("listing", dir))? {
            let entry = entry.map_err(io_context("listing", dir))?;
            let Some(log_id) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u16>().ok())
            else {
                continue;
            };
            let log_id = LogId(log_id);
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            let old_layout = fs::read_dir(&path)
                .map_err(io_context("listing", &path))?
                .filter_map(|e| e.ok())
                .any(|e| e.file_name().to_string_lossy().ends_with(".seg"));
            if old_layout {
                self.refused.insert(log_id, Refusal::OldLayout { path });
                continue;
            }
            let accepted = self.read_log_file(
                log_id,
                &path,
                record::ACCEPTED_DAMAGE_FILE,
                "the damage accepted for it",
                record::read_accepted_damage,
            )?;
            for spot in accepted.into_iter().flatten() {
                self.accepted.insert(spot, log_id);
            }
            let trim_point = self.read_log_file(
                log_id,
                &path,
                record::TRIM_POINT_FILE,
                "the trim point",
                record::read_trim_point,
            )?;
            if let Some(trim_point) = trim_point {
                self.trims.insert(log_id, trim_point);
            }
        }
        Ok(())
    }

    /// What `read` makes of `file` (its trim point or its accepted damage) in log `log_id`'s
    /// folder `dir`; `None` when the file is damaged, and the log is then refused, naming the
    /// file and `what` it holds.
    fn read_log_file<T>(
        &mut self,
        log_id: LogId,
        dir: &Path,
        file: &str,
        what: &str,
        read: impl FnOnce(&Path) -> Result<T, TrimPointError>,
    ) -> io::Result<Option<T>> {
        match read(dir) {
            Ok(value) => Ok(Some(value)),
            Err(TrimPointError::Corrupt(detail)) => {
                self.bad_trim_points.insert(log_id);
                self.refused.insert(
                    log_id,
                    Refusal::Corrupt {
                        path: dir.join(file).display().to_string(),
                        offset: None,
                        detail: format!("{what}: {detail}"),
                    },
                );
                Ok(None)
            }
            Err(TrimPointError::Io(context, e)) => Err(io_context(context, dir)(e)),
        }
    }

    /// The segment files, by sequence number.
    fn list_segments(&mut self, wal_dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
        let mut files = Vec::new();
        for entry in fs::read_dir(wal_dir).map_err(io_context("listing", wal_dir))? {
            let entry = entry.map_err(io_context("listing", wal_dir))?;
            let name = entry.file_name();
            let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(SEGMENT_SUFFIX)) else {
                continue;
            };
            match stem.parse::<u64>() {
                Ok(seq) if seq > 0 => files.push((seq, entry.path())),
                _ => {
                    self.misnamed.get_or_insert(Refusal::Corrupt {
                        path: entry.path().display().to_string(),
                        offset: None,
                        detail: "named like a segment, but not numbered as one (20 digits, then \
                                 .wal), so every log may have records in it and none is opened; \
                                 move it out of the directory if it is not a segment, or give it \
                                 back its segment's name"
                            .into(),
                    });
                }
            }
        }
        files.sort_unstable();
        self.present = files.iter().map(|(seq, _)| *seq).collect();
        Ok(files)
    }

    fn expected(&self, log_id: LogId) -> u64 {
        self.next
            .get(&log_id)
            .copied()
            .unwrap_or_else(|| self.trims.get(&log_id).copied().unwrap_or(0) + 1)
    }

    /// Whether a record of `log_id` at `lsn` could be where `most_between` records at most fit
    /// between it and a bad spot: a record below the log's trim point, or one that the bytes
    /// between allow after the log's next expected LSN.
    fn plausible(&self, log_id: u64, lsn: u64, most_between: u64) -> bool {
        let Ok(log_id) = u16::try_from(log_id).map(LogId) else {
            return false;
        };
        let trimmed = self
            .trims
            .get(&log_id)
            .is_some_and(|tp| lsn >= 1 && lsn <= *tp);
        let expected = self.expected(log_id);
        trimmed || (lsn >= expected && lsn - expected <= most_between)
    }

    /// Reads one segment through. Returns the segment to append to, if it is the last.
    fn segment(
        &mut self,
        seq: u64,
        path: PathBuf,
        is_last: bool,
        options: &LocalLogOptions,
    ) -> io::Result<Option<Active>> {
        let file = File::open(&path).map_err(io_context("opening", &path))?;
        let file_len = file
            .metadata()
            .map_err(io_context("reading the size of", &path))?
            .len();
        let segment = Arc::new(SegmentFile { seq, path, file });
        let mut meta = SegmentMeta {
            file: segment.clone(),
            logs: HashMap::new(),
        };
        // The last segment may have been preallocated: zeros after its last write, where no
        // record starts. Older segments were cut to their records when the next one started.
        let content_end = if is_last {
            end_of_non_zero(&segment.file, file_len)
                .map_err(io_context("reading", &segment.path))?
        } else {
            file_len
        };
        let mut reader = SegmentReader::new(&segment.file, file_len);
        let mut offset = 0;
        let mut end = file_len;
        while offset < content_end {
            let detail = match read_record(&mut reader, offset) {
                Ok((header, next)) if offset <= u64::from(u32::MAX) => {
                    match u16::try_from(header.log_id) {
                        Ok(id) => {
                            self.on_record(&segment, offset, LogId(id), header, &mut meta);
                            offset = next;
                            continue;
                        }
                        Err(_) => format!("names log id {}, which no log has", header.log_id),
                    }
                }
                Ok(_) => "lies past 4 GiB, where no segment holds records".to_string(),
                Err(RecordError::Invalid(detail)) => detail,
                Err(RecordError::Io(e)) => return Err(io_context("reading", &segment.path)(e)),
            };
            let followed = valid_record_after(&mut reader, offset, content_end, |id, lsn, most| {
                self.plausible(id, lsn, most)
            })
            .map_err(|e| match e {
                RecordError::Io(e) => io_context("reading", &segment.path)(e),
                RecordError::Invalid(d) => io::Error::other(d),
            })?;
            if is_last && followed.is_none() {
                if !self.dry {
                    cut_torn_tail(&segment.path, offset, content_end, &detail, options)?;
                }
                end = offset;
                break;
            }
            let header = reader.read(offset, HEADER_BYTES).ok().map(Header::parse);
            let spot_end = followed.map_or(content_end, |(at, _)| at);
            self.on_bad_spot(&segment, (offset, spot_end), header, detail, followed);
            match followed {
                Some((at, _)) => offset = at,
                None => break,
            }
        }
        if offset >= content_end {
            // The records end where the zeros of a preallocated tail (or the file) begin.
            end = end.min(offset);
        }
        drop(reader);
        self.segments.insert(seq, meta);
        self.ends.insert(seq, end);
        if !is_last || self.dry {
            return Ok(None);
        }
        let file = OpenOptions::new()
            .write(true)
            .open(&segment.path)
            .map_err(io_context("opening for writing", &segment.path))?;
        preallocate(&file, options);
        Ok(Some(Active {
            seq,
            file: Arc::new(file),
            segment,
            written: end,
        }))
    }

    /// A valid record: continues its log, or shows that the log lost or repeated records.
    fn on_record(
        &mut self,
        segment: &Arc<SegmentFile>,
        offset: u64,
        log_id: LogId,
        header: Header,
        meta: &mut SegmentMeta,
    ) {
        let lsn = header.lsn;
        let max = meta.logs.entry(log_id).or_insert(0);
        *max = (*max).max(lsn);
        if self.watch == Some(log_id) {
            let kept = !self.refused.contains_key(&log_id)
                && (lsn == self.expected(log_id)
                    || lsn <= self.trims.get(&log_id).copied().unwrap_or(0));
            self.watched.push(Watched {
                seq: segment.seq,
                start: offset,
                end: offset + HEADER_BYTES as u64 + u64::from(header.len),
                lsn,
                kept,
            });
        }
        let expected = self.expected(log_id);
        if self.refused.contains_key(&log_id) {
            self.next.insert(log_id, expected.max(lsn + 1));
            return;
        }
        if lsn <= self.trims.get(&log_id).copied().unwrap_or(0) {
            return;
        }
        if lsn == expected {
            let loc = Loc {
                offset: offset as u32,
                len: header.len,
            };
            let runs = self.runs.entry(log_id).or_default();
            match runs.back_mut() {
                Some(run) if Arc::ptr_eq(&run.segment, segment) => run.locs.push(loc),
                _ => runs.push_back(Run {
                    segment: segment.clone(),
                    first_lsn: lsn,
                    locs: vec![loc],
                }),
            }
            self.next.insert(log_id, lsn + 1);
            self.last_at.insert(log_id, (segment.seq, offset));
            return;
        }
        self.next.insert(log_id, expected.max(lsn + 1));
        let path = segment.path.display().to_string();
        let refusal = if lsn < expected {
            Refusal::Corrupt {
                path,
                offset: Some(offset),
                detail: format!(
                    "record at offset {offset} (LSN {lsn}): the log already holds LSN {lsn}; a \
                     record is there twice"
                ),
            }
        } else {
            self.gap_refusal(log_id, segment, offset, expected, lsn)
        };
        self.refused.insert(log_id, refusal);
    }

    /// Why `log_id` misses `expected ..= found - 1`: damage seen since its last record, if any,
    /// else missing records, naming the segment files that are gone.
    fn gap_refusal(
        &mut self,
        log_id: LogId,
        segment: &SegmentFile,
        offset: u64,
        expected: u64,
        found: u64,
    ) -> Refusal {
        let since = self.last_at.get(&log_id).copied().unwrap_or((0, 0));
        let lost = format!("LSN {expected}..={} of this log", found - 1);
        if let Some(spot) = self.bad_spots.iter_mut().find(|s| s.at > since) {
            spot.blamed.push(log_id);
            return Refusal::Corrupt {
                path: spot.path.clone(),
                offset: Some(spot.at.1),
                detail: format!(
                    "{}; {lost} were lost with it (the log resumes at LSN {found} in {} at offset \
                     {offset})",
                    spot.detail,
                    segment.path.display()
                ),
            };
        }
        let gone: Vec<String> = (since.0 + 1..segment.seq)
            .filter(|seq| !self.present.contains(seq))
            .take(5)
            .map(segment_file_name)
            .collect();
        let gone = if gone.is_empty() {
            String::new()
        } else {
            format!(
                " (segment files that would lie between are gone: {})",
                gone.join(", ")
            )
        };
        Refusal::Corrupt {
            path: segment.path.display().to_string(),
            offset: None,
            detail: format!(
                "records are missing: the log resumes at LSN {found} at offset {offset}, but \
                 {lost} are in no segment{gone}"
            ),
        }
    }

    /// Damage that is not a torn tail: refuses the log its header still names, if plausible, and
    /// remembers the spot for logs whose records then show a gap.
    fn on_bad_spot(
        &mut self,
        segment: &SegmentFile,
        (offset, end): (u64, u64),
        header: Option<Header>,
        detail: String,
        followed: Option<(u64, Header)>,
    ) {
        let after = match followed {
            Some((at, h)) => format!(
                "; a valid record of log {}, LSN {} follows at offset {at}, so this is not an \
                 incomplete final write and cutting here would drop acknowledged records",
                h.log_id, h.lsn
            ),
            None => "; it is not in the last segment, so it is no incomplete final write (a \
                     segment is synced before the next one starts)"
                .to_string(),
        };
        let shared = " (the segment holds records of other logs too: cutting it also drops \
                      theirs from that offset on)";
        // A log already refused can own a second damaged record: its next LSN is still known
        // (one past the highest it showed).
        let owner = header.and_then(|h| {
            let log_id = LogId(u16::try_from(h.log_id).ok()?);
            let plausible =
                (self.trims.contains_key(&log_id) || self.next.contains_key(&log_id) || h.lsn == 1)
                    && h.lsn == self.expected(log_id);
            plausible.then_some((log_id, h.lsn))
        });
        let path = segment.path.display().to_string();
        let alone = header.is_some_and(|h| end == offset + HEADER_BYTES as u64 + u64::from(h.len));
        // Damage an operator accepted for a log whose trim point they moved past it
        // (`trim_log_offline`): put on that log, which is not refused for it. Only these exact
        // bytes: damage anywhere else is judged as always.
        let accepted = self
            .accepted
            .get(&(segment.seq, offset, end))
            .copied()
            .filter(|_| owner.is_none());
        match accepted {
            Some(log_id) => tracing::warn!(
                %path, offset, log = log_id.0, %detail,
                "damaged bytes in the log, accepted for a log trimmed past them"
            ),
            // Anything else keeps the segment: what it holds is not fully known.
            None => {
                self.damaged.insert(segment.seq);
            }
        }
        if let Some((log_id, lsn)) = owner {
            self.next.insert(log_id, lsn + 1);
            // The first reason stands.
            self.refused
                .entry(log_id)
                .or_insert_with(|| Refusal::Corrupt {
                    path: path.clone(),
                    offset: Some(offset),
                    detail: format!(
                        "record at offset {offset} (LSN {lsn}): {detail}{after}{shared}"
                    ),
                });
        }
        self.bad_spots.push(BadSpot {
            at: (segment.seq, offset),
            end,
            path,
            detail: format!("damaged record at offset {offset}: {detail}{after}{shared}"),
            blamed: owner
                .map(|(log_id, _)| log_id)
                .or(accepted)
                .into_iter()
                .collect(),
            alone,
        });
    }

    /// Damage no log could be blamed for (or a misnamed segment): refuses every log.
    fn unattributed(&self) -> Option<Refusal> {
        if let Some(misnamed) = &self.misnamed {
            return Some(misnamed.clone());
        }
        let spot = self.bad_spots.iter().find(|s| s.blamed.is_empty())?;
        Some(Refusal::Corrupt {
            path: spot.path.clone(),
            offset: Some(spot.at.1),
            detail: format!(
                "{}; no log can be told from it, so {}",
                spot.detail,
                super::EVERY_LOG_REFUSED
            ),
        })
    }

    /// Deletes segments before `last` whose records are all at or below their logs' trim points:
    /// left by a crash between a trim and its deletions.
    fn delete_trimmed_segments(&mut self, last: Option<u64>) -> io::Result<()> {
        let dead: Vec<u64> = self
            .segments
            .iter()
            .filter(|(seq, meta)| {
                Some(**seq) != last
                    && !self.damaged.contains(seq)
                    && meta
                        .logs
                        .iter()
                        .all(|(id, max)| *max <= self.trims.get(id).copied().unwrap_or(0))
            })
            .map(|(seq, _)| *seq)
            .collect();
        for seq in dead {
            if let Some(meta) = self.segments.remove(&seq) {
                fs::remove_file(&meta.file.path)
                    .map_err(io_context("deleting", &meta.file.path))?;
                tracing::info!(path = %meta.file.path.display(), "deleted a trimmed log segment");
            }
        }
        Ok(())
    }

    /// Every log that has a trim point or records (refused ones too, so that their trim points
    /// keep their segments).
    fn logs(&mut self) -> HashMap<LogId, LogRecovered> {
        let ids: HashSet<LogId> = self.trims.keys().chain(self.next.keys()).copied().collect();
        ids.into_iter()
            .map(|id| {
                let trim_point = self.trims.get(&id).copied().unwrap_or(0);
                let tail = trim_point.max(self.next.get(&id).map_or(0, |n| n - 1));
                let runs = self.runs.remove(&id).unwrap_or_default();
                let runs = if self.refused.contains_key(&id) {
                    VecDeque::new()
                } else {
                    runs
                };
                (
                    id,
                    LogRecovered {
                        trim_point,
                        tail,
                        runs,
                    },
                )
            })
            .collect()
    }
}

/// Cuts an incomplete final write off the last segment.
fn cut_torn_tail(
    path: &Path,
    offset: u64,
    content_end: u64,
    detail: &str,
    options: &LocalLogOptions,
) -> io::Result<()> {
    tracing::warn!(
        path = %path.display(), offset, dropped_bytes = content_end - offset, %detail,
        "cutting the torn tail of the log: an incomplete final write, never acknowledged"
    );
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_context("opening for writing", path))?;
    file.set_len(offset)
        .map_err(io_context("truncating the torn tail of", path))?;
    if options.fsync {
        file.sync_data()
            .map_err(io_context("truncating the torn tail of", path))?;
    }
    Ok(())
}
