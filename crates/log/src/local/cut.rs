//! Mending one log that recovery refuses for damaged or missing records, for an operator, with no
//! provider open, without touching the other logs' records in the segments they share:
//!
//! - [`trim_log_offline`] moves its trim point past the damage, when something else (a snapshot
//!   of its partition, or its store) holds the records up to there: a damaged record at or below
//!   its log's trim point refuses nothing.
//! - [`cut_log`] gives up its records from the first damaged or missing one on. Cutting a segment
//!   file would give up the other logs' records after that point too; this rewrites the segments
//!   that hold what the cut leaves out, without those bytes, and leaves every other log's records
//!   as they were.
//!
//! Each rewritten segment is written whole to a temporary file, synced, and renamed over the old
//! one, which is kept beside it under a name recovery ignores (`<segment>.before-cut`). A crash
//! leaves each segment either as it was or rewritten; a log whose later records are still in a
//! segment not yet rewritten is refused at open, as before, and running the cut again finishes it.

use super::record::{
    READ_CHUNK_BYTES, accept_damage, read_accepted_damage, sync_dir, write_trim_point,
};
use super::recovery::{Assumed, CutPlan, cut_plan};
use super::{LOCK_FILE, LocalLogOptions, Refusal, WAL_DIR, lock_dir};
use cairn_types::LogId;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Suffix of the copy a cut keeps of each segment it rewrites.
pub const BEFORE_CUT_SUFFIX: &str = ".before-cut";
const CUTTING_SUFFIX: &str = ".cutting";

/// What [`cut_log`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CutReport {
    pub log_id: LogId,
    /// The log's last LSN now; the next append gets the one after it.
    pub tail: u64,
    /// LSNs of the records left out, lowest first.
    pub dropped_lsns: Vec<u64>,
    /// Damaged bytes left out.
    pub dropped_damaged_bytes: u64,
    /// Whether some of those bytes were more than the damaged record of this log: records of
    /// other logs may have been in them (and were unreadable already).
    pub damage_may_have_held_other_records: bool,
    /// Each rewritten segment, with the copy kept of it as it was.
    pub rewritten: Vec<(PathBuf, PathBuf)>,
}

/// Why [`cut_log`] cut nothing, or could not finish.
#[derive(Debug, thiserror::Error)]
pub enum CutError {
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The log opens: there is nothing to cut.
    #[error(
        "log {0} opens as it is: none of its records are damaged or missing, so there is nothing to cut"
    )]
    NotRefused(LogId),
    /// The log is refused for something a cut of its records does not mend.
    #[error("log {log_id} cannot be cut: {detail}")]
    NotCuttable { log_id: LogId, detail: String },
    /// The rewrite happened, but a new read of the logs does not show what it should.
    #[error(
        "the segments were rewritten, but reading them again does not show what the cut should \
         have left: {detail}. To undo the cut, move each copy back over its segment: {}",
        undo.iter()
            .map(|(segment, copy)| format!("`mv {} {}`", copy.display(), segment.display()))
            .collect::<Vec<_>>()
            .join(", ")
    )]
    Unverified {
        detail: String,
        /// Each rewritten segment and the copy kept of it as it was.
        undo: Vec<(PathBuf, PathBuf)>,
    },
}

/// What recovery makes of one log, for an operator about to repair it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogInspection {
    pub log_id: LogId,
    /// Why the log is refused at open, if it is (a refusal of every log included).
    pub refused: Option<String>,
    /// Whether the refusal is of every log: damage no log can be blamed for.
    pub refused_all: bool,
    pub trim_point: u64,
    /// The end of its valid records: where [`cut_log`] would cut it.
    pub valid_through: u64,
    /// The highest LSN of it found in any record.
    pub highest_seen: u64,
    /// Whether the log exists at all (a directory or a record).
    pub known: bool,
    /// Whether its trim point file is damaged (which neither a trim nor a cut mends).
    pub trim_point_damaged: bool,
}

impl LogInspection {
    fn of(log_id: LogId, plan: &CutPlan) -> LogInspection {
        let refused_all = plan.refused_all.is_some();
        LogInspection {
            log_id,
            refused: plan
                .refused_all
                .as_ref()
                .or(plan.refusal.as_ref())
                .map(|r| r.error(log_id).to_string()),
            refused_all,
            trim_point: plan.trim_point,
            valid_through: plan.keeps_through,
            highest_seen: plan.highest_seen,
            known: plan.known,
            trim_point_damaged: plan.trim_point_damaged,
        }
    }
}

/// Reads the logs in `dir` (which must not be open) as an open would, changing nothing, and
/// says what it makes of `log_id`. Blocking.
pub fn inspect_log(
    dir: &Path,
    log_id: LogId,
    options: &LocalLogOptions,
) -> Result<LogInspection, CutError> {
    let _lock = lock_existing(dir)?;
    let plan = cut_plan(dir, &dir.join(WAL_DIR), options, log_id, None)?;
    Ok(LogInspection::of(log_id, &plan))
}

/// Moves the trim point of log `log_id` in `dir` (which must not be open) up to `up_to`, as a
/// trim would, for a log that cannot be opened to trim it: its records up to there, damaged or
/// not, are then no longer needed (the caller knows that something else holds them). The damage
/// that is the log's own is accepted for it, by position, so that it refuses nothing any more
/// (damage elsewhere is judged as always). `up_to` may lie past the log's highest record: the
/// next append then gets the LSN after it. Refused, changing nothing, when the log would then
/// meet damage that no log can be blamed for. Returns what the log looks like afterwards.
/// Blocking.
pub fn trim_log_offline(
    dir: &Path,
    log_id: LogId,
    up_to: u64,
    options: &LocalLogOptions,
) -> Result<LogInspection, CutError> {
    let _lock = lock_existing(dir)?;
    let wal_dir = dir.join(WAL_DIR);
    let plan = cut_plan(dir, &wal_dir, options, log_id, None)?;
    check_mendable(log_id, &plan)?;
    if up_to <= plan.trim_point {
        return Err(CutError::NotCuttable {
            log_id,
            detail: format!("LSN {up_to} is not past its trim point {}", plan.trim_point),
        });
    }
    let assumed = Assumed {
        trim_point: up_to,
        accepted: plan.own_spots.clone(),
    };
    let then = cut_plan(dir, &wal_dir, options, log_id, Some(assumed))?;
    if let Some(Refusal::Corrupt { path, detail, .. }) = &then.refused_all {
        return Err(CutError::NotCuttable {
            log_id,
            detail: format!(
                "trimmed to LSN {up_to}, it would meet damage that no log can be blamed for \
                 ({path}: {detail}); nothing was changed"
            ),
        });
    }
    let log_dir = dir.join(log_id.0.to_string());
    accept_damage(&log_dir, &plan.own_spots, options.fsync)?;
    write_trim_point(&log_dir, up_to, options.fsync)?;
    let after = cut_plan(dir, &wal_dir, options, log_id, None)?;
    Ok(LogInspection::of(log_id, &after))
}

/// Locks `dir`, which must hold a log.
fn lock_existing(dir: &Path) -> Result<File, CutError> {
    if !dir.join(LOCK_FILE).exists() || !dir.join(WAL_DIR).is_dir() {
        return Err(CutError::Io(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} holds no log", dir.display()),
        )));
    }
    Ok(lock_dir(dir)?)
}

/// Cuts log `log_id` in `dir` (a [`super::LocalLogProvider`]'s directory, which must not be open)
/// at the end of its valid records: its records after the first damaged or missing one, and the
/// damage blamed on it, are left out of the segments, and the next append continues from the
/// last valid record. Every other log keeps its records and its state; the cut checks that by
/// reading the logs again. Blocking.
pub fn cut_log(
    dir: &Path,
    log_id: LogId,
    options: &LocalLogOptions,
) -> Result<CutReport, CutError> {
    let _lock = lock_existing(dir)?;
    let wal_dir = dir.join(WAL_DIR);
    let plan = cut_plan(dir, &wal_dir, options, log_id, None)?;
    check_cuttable(log_id, &plan)?;
    // Damage accepted for other logs moves with the bytes before it: accepted at its new place
    // too, before any segment is rewritten, so that it matches before and after.
    shift_accepted_damage(dir, &plan.drops, options)?;
    let mut rewritten = Vec::new();
    for (seq, ranges) in &plan.drops {
        let (path, end) = plan
            .segments
            .get(seq)
            .ok_or_else(|| io::Error::other(format!("segment {seq} was read but not listed")))?;
        let backup = rewrite_without(path, *end, ranges, options).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "rewriting {} (which needs about its size free beside it; nothing of it was \
                     changed): {e}",
                    path.display()
                ),
            )
        })?;
        rewritten.push((path.clone(), backup));
    }
    if options.fsync {
        sync_dir(&wal_dir)?;
    }
    let again = cut_plan(dir, &wal_dir, options, log_id, None)?;
    if let Err(detail) = verify(log_id, &plan, &again) {
        return Err(CutError::Unverified {
            detail,
            undo: rewritten,
        });
    }
    let mut dropped_lsns = plan.dropped_lsns.clone();
    dropped_lsns.sort_unstable();
    Ok(CutReport {
        log_id,
        tail: plan.keeps_through,
        dropped_lsns,
        dropped_damaged_bytes: plan.damaged_bytes,
        damage_may_have_held_other_records: plan.damage_may_hide_records,
        rewritten,
    })
}

/// What neither a trim nor a cut mends: a log that does not exist, a damaged trim point or
/// accepted-damage file, a log in an earlier layout.
fn check_mendable(log_id: LogId, plan: &CutPlan) -> Result<(), CutError> {
    if !plan.known {
        return Err(CutError::Io(io::Error::new(
            io::ErrorKind::NotFound,
            format!("there is no log {log_id}: it has neither a directory nor a record"),
        )));
    }
    if plan.trim_point_damaged {
        return Err(CutError::NotCuttable {
            log_id,
            detail: "its trim point or accepted-damage file is damaged, which neither a trim nor \
                     a cut mends; put the file back from a backup"
                .into(),
        });
    }
    if let Some(Refusal::OldLayout { path }) = &plan.refusal {
        return Err(CutError::NotCuttable {
            log_id,
            detail: format!(
                "{} holds it in the layout of an earlier Cairn version, which neither a trim nor \
                 a cut changes",
                path.display()
            ),
        });
    }
    Ok(())
}

fn check_cuttable(log_id: LogId, plan: &CutPlan) -> Result<(), CutError> {
    check_mendable(log_id, plan)?;
    if let Some(Refusal::Corrupt { detail, path, .. }) = &plan.refused_all {
        return Err(CutError::NotCuttable {
            log_id,
            detail: format!(
                "every log is refused ({path}: {detail}), so the damage cannot be put on one log \
                 and cut from it alone"
            ),
        });
    }
    match &plan.refusal {
        None => Err(CutError::NotRefused(log_id)),
        // Refused by `check_mendable`.
        Some(Refusal::OldLayout { .. }) => Ok(()),
        Some(Refusal::Corrupt { .. }) if plan.drops.is_empty() => Err(CutError::NotCuttable {
            log_id,
            detail: "none of its records or damage lies past its valid records, so a cut would \
                     leave out nothing"
                .into(),
        }),
        Some(Refusal::Corrupt { .. }) => Ok(()),
    }
}

/// Writes `path`'s first `end` bytes without `drops` (sorted, disjoint) to a temporary file,
/// syncs it, keeps the old segment as `<path>.before-cut` and renames the new one over it.
/// Returns the copy's path.
fn rewrite_without(
    path: &Path,
    end: u64,
    drops: &[Range<u64>],
    options: &LocalLogOptions,
) -> io::Result<PathBuf> {
    let with_suffix = |suffix: &str| {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    };
    let tmp = with_suffix(CUTTING_SUFFIX);
    let _ = fs::remove_file(&tmp);
    let written = write_kept(path, &tmp, end, drops, options);
    if let Err(e) = written {
        // A full disk, say: leave no half copy to take up its room.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    let backup = with_suffix(BEFORE_CUT_SUFFIX);
    // A copy from an earlier cut of this segment is the older one: keep it, under a name of its
    // own.
    let backup = (1..)
        .map(|n| {
            if n == 1 {
                backup.clone()
            } else {
                with_suffix(&format!("{BEFORE_CUT_SUFFIX}.{n}"))
            }
        })
        .find(|p| !p.exists())
        .expect("some name is free");
    let swapped = fs::hard_link(path, &backup).and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = swapped {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(backup)
}

/// Accepts, for every log that has accepted damage in a segment the cut rewrites, that damage
/// where it will lie once the bytes before it are left out (keeping it where it lies now).
fn shift_accepted_damage(
    dir: &Path,
    drops: &std::collections::BTreeMap<u64, Vec<Range<u64>>>,
    options: &LocalLogOptions,
) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let is_log = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.parse::<u16>().is_ok());
        if !is_log || !entry.path().is_dir() {
            continue;
        }
        // A log whose list does not read is refused already, and stays so.
        let shifted: Vec<(u64, u64, u64)> = read_accepted_damage(&entry.path())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(seq, offset, end)| {
                let ranges = drops.get(&seq)?;
                // Left out itself (the cut log's own damage): nothing to keep.
                if ranges.iter().any(|r| r.start < end && offset < r.end) {
                    return None;
                }
                let before: u64 = ranges
                    .iter()
                    .filter(|r| r.end <= offset)
                    .map(|r| r.end - r.start)
                    .sum();
                (before > 0).then(|| (seq, offset - before, end - before))
            })
            .collect();
        if !shifted.is_empty() {
            accept_damage(&entry.path(), &shifted, options.fsync)?;
        }
    }
    Ok(())
}

/// Writes `path`'s first `end` bytes without `drops` to a new file `to`, synced.
fn write_kept(
    path: &Path,
    to: &Path,
    end: u64,
    drops: &[Range<u64>],
    options: &LocalLogOptions,
) -> io::Result<()> {
    let source = File::open(path)?;
    let mut out = OpenOptions::new().write(true).create_new(true).open(to)?;
    let mut buf = Vec::new();
    for keep in kept_ranges(end, drops) {
        let mut at = keep.start;
        while at < keep.end {
            let len = (keep.end - at).min(READ_CHUNK_BYTES as u64) as usize;
            buf.resize(len, 0);
            source.read_exact_at(&mut buf, at)?;
            out.write_all(&buf)?;
            at += len as u64;
        }
    }
    if options.fsync {
        out.sync_all()?;
    }
    Ok(())
}

/// `0..end` without `drops` (sorted by start; they may touch but not overlap).
fn kept_ranges(end: u64, drops: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut kept = Vec::new();
    let mut from = 0;
    for drop in drops {
        if drop.start > from {
            kept.push(from..drop.start.min(end));
        }
        from = from.max(drop.end);
    }
    if from < end {
        kept.push(from..end);
    }
    kept.retain(|r| r.start < r.end);
    kept
}

/// The logs as read again after the cut: the cut log opens and ends where the plan said, and
/// every other log has the tail and the standing it had.
fn verify(log_id: LogId, before: &CutPlan, after: &CutPlan) -> Result<(), String> {
    let mut problems = Vec::new();
    if let Some(refusal) = &after.refused_all {
        problems.push(format!("every log is refused ({refusal:?})"));
    }
    if let Some(refusal) = &after.refusal {
        problems.push(format!("log {log_id} is still refused ({refusal:?})"));
    }
    let tail = after.logs.get(&log_id).map(|(tail, _)| *tail);
    if tail.is_some_and(|tail| tail != before.keeps_through) {
        problems.push(format!(
            "log {log_id} ends at LSN {}, not {}",
            tail.unwrap_or(0),
            before.keeps_through
        ));
    }
    for (id, was) in before.logs.iter().filter(|(id, _)| **id != log_id) {
        let now = after.logs.get(id);
        if now != Some(was) {
            problems.push(format!(
                "log {id} had tail {} ({}), now {}",
                was.0,
                if was.1 { "refused" } else { "opening" },
                now.map_or("is gone".to_string(), |(tail, refused)| format!(
                    "tail {tail} ({})",
                    if *refused { "refused" } else { "opening" }
                ))
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::kept_ranges;

    #[test]
    fn kept_ranges_leave_out_the_drops() {
        let ranges = |pairs: &[(u64, u64)]| pairs.iter().map(|&(a, b)| a..b).collect::<Vec<_>>();
        assert_eq!(kept_ranges(100, &[]), ranges(&[(0, 100)]));
        assert_eq!(
            kept_ranges(100, &ranges(&[(0, 10), (10, 20), (50, 60)])),
            ranges(&[(20, 50), (60, 100)])
        );
        assert_eq!(kept_ranges(100, &ranges(&[(90, 100)])), ranges(&[(0, 90)]));
        assert_eq!(kept_ranges(0, &[]), ranges(&[]));
    }
}
