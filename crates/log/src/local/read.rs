//! Reads of one log: planned under the log's lock (from memory when the records are cached),
//! then read from the segments without it, one positional read for neighbouring records.

use super::record::{HEADER_BYTES, Header, READ_CHUNK_BYTES};
use super::{Loc, LogShared, SegmentFile};
use crate::{Entry, Error, Result};
use bytes::Bytes;
use cairn_types::{LogId, Lsn};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

/// What a read needs: records to fetch from segments, then records already in memory.
pub(super) struct Plan {
    pub disk: Vec<Span>,
    pub cached: Vec<Entry>,
}

/// Consecutive records of the log in one segment.
pub(super) struct Span {
    segment: Arc<SegmentFile>,
    first_lsn: u64,
    locs: Vec<Loc>,
}

/// Decides under the log's lock which records come from memory and which bytes to read, so that
/// the disk IO itself runs without the lock.
pub(super) fn plan(log: &LogShared, from: u64, max_records: usize) -> Result<Plan> {
    let state = log.state.lock();
    if from <= state.trim_point {
        return Err(Error::Trimmed {
            log_id: log.log_id,
            requested: Lsn(from),
            trim_point: Lsn(state.trim_point),
        });
    }
    let mut plan = Plan {
        disk: Vec::new(),
        cached: Vec::new(),
    };
    if max_records == 0 || from > state.tail {
        return Ok(plan);
    }
    let to = state.tail.min(from.saturating_add(max_records as u64 - 1));
    let cache_first = state.tail + 1 - state.cache.len() as u64;
    let disk_to = to.min(cache_first - 1);
    if from <= disk_to {
        let first = state
            .runs
            .partition_point(|r| r.first_lsn <= from)
            .saturating_sub(1);
        for run in state.runs.range(first..) {
            if run.first_lsn > disk_to {
                break;
            }
            let lo = from.max(run.first_lsn);
            let hi = disk_to.min(run.last_lsn());
            if lo > hi {
                continue;
            }
            let locs =
                run.locs[(lo - run.first_lsn) as usize..=(hi - run.first_lsn) as usize].to_vec();
            plan.disk.push(Span {
                segment: run.segment.clone(),
                first_lsn: lo,
                locs,
            });
        }
    }
    for lsn in from.max(cache_first)..=to {
        plan.cached.push(Entry {
            lsn: Lsn(lsn),
            payload: state.cache[(lsn - cache_first) as usize].clone(),
        });
    }
    Ok(plan)
}

/// Reads what `plan` names from the segments and appends the cached records. Blocking.
pub(super) fn execute(log_id: LogId, plan: Plan) -> Result<Vec<Entry>> {
    let mut entries = Vec::with_capacity(
        plan.disk.iter().map(|s| s.locs.len()).sum::<usize>() + plan.cached.len(),
    );
    for span in plan.disk {
        read_span(log_id, &span, &mut entries)?;
    }
    entries.extend(plan.cached);
    Ok(entries)
}

fn record_end(loc: Loc) -> u64 {
    u64::from(loc.offset) + HEADER_BYTES as u64 + u64::from(loc.len)
}

/// Reads a span in chunks of neighbouring records, each chunk one positional read.
fn read_span(log_id: LogId, span: &Span, entries: &mut Vec<Entry>) -> Result<()> {
    let mut i = 0;
    while i < span.locs.len() {
        let start = u64::from(span.locs[i].offset);
        let mut j = i + 1;
        let mut useful = record_end(span.locs[i]) - start;
        while let Some(&loc) = span.locs.get(j) {
            if record_end(loc) - start > READ_CHUNK_BYTES as u64 {
                break;
            }
            useful += record_end(loc) - u64::from(loc.offset);
            j += 1;
        }
        let end = record_end(span.locs[j - 1]);
        let mut buf = vec![0u8; (end - start) as usize];
        span.segment
            .file
            .read_exact_at(&mut buf, start)
            .map_err(|source| Error::Io {
                log_id,
                context: "reading a segment",
                source,
            })?;
        // Records of other logs in between: copy out the payloads rather than keep the whole
        // chunk alive behind them.
        let share = useful * 2 >= buf.len() as u64;
        let buf = Bytes::from(buf);
        for (k, &loc) in span.locs[i..j].iter().enumerate() {
            let lsn = span.first_lsn + (i + k) as u64;
            let at = (u64::from(loc.offset) - start) as usize;
            let payload = check(log_id, span, lsn, loc, &buf[at..])?;
            let range = at + HEADER_BYTES..at + HEADER_BYTES + payload;
            entries.push(Entry {
                lsn: Lsn(lsn),
                payload: if share {
                    buf.slice(range)
                } else {
                    Bytes::copy_from_slice(&buf[range])
                },
            });
        }
        i = j;
    }
    Ok(())
}

/// Checks that `bytes` start with the record the index says is there. Returns the payload length.
fn check(log_id: LogId, span: &Span, lsn: u64, loc: Loc, bytes: &[u8]) -> Result<usize> {
    let header = Header::parse(bytes);
    let len = loc.len as usize;
    let problem = if header.log_id != u64::from(log_id.0)
        || header.lsn != lsn
        || header.len != loc.len
    {
        Some(format!(
            "expected LSN {lsn} of log {log_id} ({len} bytes), found LSN {} of log {} ({} bytes)",
            header.lsn, header.log_id, header.len
        ))
    } else if !header.matches(&bytes[HEADER_BYTES..HEADER_BYTES + len]) {
        Some(format!("checksum mismatch in the record of LSN {lsn}"))
    } else {
        None
    };
    match problem {
        None => Ok(len),
        Some(detail) => Err(Error::Corrupt {
            log_id,
            path: span.segment.path.display().to_string(),
            offset: Some(u64::from(loc.offset)),
            detail: format!("record at offset {} (LSN {lsn}): {detail}", loc.offset),
        }),
    }
}
