//! The process's limit on open files. Client sockets and the node's own files (RocksDB's tables,
//! log segments, snapshot downloads) come out of one budget: once it is spent, a memtable flush
//! that cannot create its table file stops its partition.

use tracing::{info, warn};

/// Descriptors left to the node's own files when the ports' clients are counted (half of the
/// limit, if that is less), besides [`PER_PARTITION_DATABASE`] for each partition.
const RESERVED_FOR_FILES: u64 = 1024;

/// Descriptors each partition's RocksDB holds whatever it stores (its lock, manifest, info log,
/// write-ahead file and folder, with room to spare): an empty store of 256 partitions holds about
/// 1,800.
const PER_PARTITION_DATABASE: u64 = 8;

/// Raises the soft limit on open files to the hard one, as Redis and most servers do: a shell's
/// default of 1024 is soon spent on clients and tables. A failure only leaves the limit as it was.
pub(crate) fn raise_limit() {
    let Some((soft, hard)) = limits() else {
        return;
    };
    if soft >= hard {
        return;
    }
    let raised = libc::rlimit {
        rlim_cur: hard,
        rlim_max: hard,
    };
    // SAFETY: `setrlimit` only reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        info!("raised the open-files limit from {soft} to {hard}");
    } else {
        warn!(
            "cannot raise the open-files limit from {soft} to {hard}: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The soft and hard limits on open files, if they can be read.
fn limits() -> Option<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes the struct it is given and nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        warn!(
            "cannot read the open-files limit: {}",
            std::io::Error::last_os_error()
        );
        return None;
    }
    Some((limit.rlim_cur, limit.rlim_max))
}

/// How many clients each port may have connected at once: the configured bounds (`max-connections`
/// for gRPC, `resp.max-clients` for the Redis port, `None` for a port that is off), or less if
/// together they would not leave the node room for its own files. The room is then shared in the
/// proportion of the configured bounds.
pub(crate) fn client_bounds(
    grpc: usize,
    resp: Option<usize>,
    partitions: u16,
) -> (usize, Option<usize>) {
    let Some((soft, _)) = limits() else {
        return (grpc, resp);
    };
    let (allowed_grpc, allowed_resp) = bounds_within(soft, grpc, resp, partitions);
    if allowed_grpc < grpc || allowed_resp < resp {
        let wanted = grpc as u64 + resp.unwrap_or(0) as u64;
        warn!(
            "the node takes at most {allowed_grpc} gRPC connections (max-connections = {grpc}){}: \
             the open-files limit is {soft} and the node keeps {} of it for its own files; raise \
             the limit (`ulimit -n`, or LimitNOFILE= in a systemd unit) to at least {}",
            match (allowed_resp, resp) {
                (Some(allowed), Some(configured)) =>
                    format!(" and {allowed} Redis clients (resp.max-clients = {configured})"),
                _ => String::new(),
            },
            reserved(soft, partitions),
            wanted + for_files(partitions)
        );
    }
    (allowed_grpc, allowed_resp)
}

/// Descriptors the node's own files want, with `partitions` partitions.
fn for_files(partitions: u16) -> u64 {
    RESERVED_FOR_FILES + PER_PARTITION_DATABASE * u64::from(partitions)
}

/// Descriptors kept for the node's own files in a limit of `soft`.
fn reserved(soft: u64, partitions: u16) -> u64 {
    for_files(partitions).min(soft / 2)
}

/// The bounds of [`client_bounds`] in a limit of `soft` open files: at most what is configured,
/// and at least one per port that is on.
fn bounds_within(
    soft: u64,
    grpc: usize,
    resp: Option<usize>,
    partitions: u16,
) -> (usize, Option<usize>) {
    let room = soft.saturating_sub(reserved(soft, partitions)).max(2);
    let wanted = grpc as u64 + resp.unwrap_or(0) as u64;
    if wanted <= room {
        return (grpc, resp);
    }
    let grpc_share = (u128::from(room) * grpc as u128 / u128::from(wanted)) as u64;
    let grpc_share = grpc_share.clamp(1, room - u64::from(resp.is_some()));
    let resp_share = resp.map(|_| {
        usize::try_from(room - grpc_share)
            .unwrap_or(usize::MAX)
            .max(1)
    });
    (
        usize::try_from(grpc_share).unwrap_or(usize::MAX),
        resp_share,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_leave_room_for_the_nodes_files() {
        let defaults = (10_000, Some(10_000));
        assert_eq!(bounds_within(1_048_576, 10_000, Some(10_000), 0), defaults);
        assert_eq!(
            bounds_within(libc::RLIM_INFINITY, 10_000, Some(10_000), 0),
            defaults
        );
        // Shared in the proportion configured, and adding up to what the node's files leave.
        assert_eq!(
            bounds_within(20_000, 10_000, Some(10_000), 0),
            (9_488, Some(9_488))
        );
        assert_eq!(
            bounds_within(20_000, 30_000, Some(10_000), 0),
            (14_232, Some(4_744))
        );
        assert_eq!(
            bounds_within(1024, 10_000, Some(10_000), 0),
            (256, Some(256))
        );
        // A port that is off leaves the whole room to the other.
        assert_eq!(
            bounds_within(10_000, 10_000, None, 0),
            (10_000 - 1024, None)
        );
        assert_eq!(bounds_within(20_000, 5, Some(7), 0), (5, Some(7)));
        // Never less than one each.
        assert_eq!(bounds_within(1, 10_000, Some(10_000), 0), (1, Some(1)));
        assert_eq!(bounds_within(3, 1, Some(10_000), 0), (1, Some(1)));
        // Each partition's database keeps descriptors of its own.
        assert_eq!(
            bounds_within(20_000, 10_000, Some(10_000), 16),
            (9_424, Some(9_424))
        );
        assert_eq!(
            bounds_within(4_096, 10_000, Some(10_000), 256),
            (1_024, Some(1_024))
        );
    }
}
