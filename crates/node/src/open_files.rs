//! The process's limit on open files. Client sockets and the node's own files (RocksDB's tables,
//! log segments, snapshot downloads) come out of one budget: once it is spent, a memtable flush
//! that cannot create its table file stops its partition.

use tracing::{info, warn};

/// Descriptors left to the node's own files when the Redis port's clients are counted (half of
/// the limit, if that is less).
const RESERVED_FOR_FILES: u64 = 1024;

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

/// How many Redis clients may be connected at once: `configured`, or fewer if the open-files
/// limit would not leave the node room for its own files with that many.
pub(crate) fn max_clients(configured: usize) -> usize {
    let Some((soft, _)) = limits() else {
        return configured;
    };
    let allowed = clients_within(soft, configured);
    if allowed < configured {
        warn!(
            "the Redis port takes at most {allowed} clients, not resp.max-clients = {configured}: \
             the open-files limit is {soft} and the node keeps {} of it for its own files; raise \
             the limit (`ulimit -n`, or LimitNOFILE= in a systemd unit) to at least {}",
            soft - allowed as u64,
            configured as u64 + RESERVED_FOR_FILES
        );
    }
    allowed
}

/// Clients that fit in a limit of `soft` open files, at most `configured` and at least one.
fn clients_within(soft: u64, configured: usize) -> usize {
    let room = soft.saturating_sub(RESERVED_FOR_FILES.min(soft / 2)).max(1);
    configured.min(usize::try_from(room).unwrap_or(usize::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_leave_room_for_the_nodes_files() {
        assert_eq!(clients_within(1_048_576, 10_000), 10_000);
        assert_eq!(clients_within(10_000, 10_000), 10_000 - 1024);
        assert_eq!(clients_within(1024, 10_000), 512);
        assert_eq!(clients_within(1, 10_000), 1);
        assert_eq!(clients_within(20_000, 5), 5);
        assert_eq!(clients_within(libc::RLIM_INFINITY, 10_000), 10_000);
    }
}
