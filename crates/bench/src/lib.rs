//! What the benchmark binaries share: the plain copies they measure against, their ratios taken
//! round by round, progress lines on stderr, and the way their reports show sizes and times.
//! moto's S3 server comes from `cairn_snapshots::test_util::moto`, shared with the tests.
//!
//! Architecture invariant: nothing here measures anything; each binary owns its figures. The code
//! under measurement runs on the benchmark's runtime, so the binaries keep RocksDB, file-system and
//! process calls off its threads ([`blocking`]).

pub mod copy;
pub mod ratio;
pub mod redis_server;
pub mod report;

use anyhow::Context;

/// Runs `work` (RocksDB, file-system or process calls) on a blocking thread and waits for it: on
/// one of the runtime's threads it would stall the tasks under measurement there.
pub async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .context("join a blocking task")?
}

/// User and system CPU time of process `pid` (or `self`) so far, in seconds, from `/proc`.
/// Blocking.
pub fn cpu_seconds(pid: &str) -> anyhow::Result<f64> {
    // Kernel clock ticks per second as `/proc` counts them (USER_HZ): 100 on every Linux
    // architecture Cairn builds for.
    const TICKS_PER_SECOND: f64 = 100.0;
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    // The command name, in parentheses, may hold spaces: count fields after its end. utime and
    // stime are the 14th and 15th fields, the 12th and 13th after it.
    let after_name = stat
        .rsplit_once(')')
        .with_context(|| format!("{path} has no command name"))?
        .1;
    let mut fields = after_name.split_whitespace().skip(11);
    let mut ticks = 0.0;
    for _ in 0..2 {
        let field = fields
            .next()
            .with_context(|| format!("{path} is too short"))?;
        ticks += field
            .parse::<f64>()
            .with_context(|| format!("{path}: {field} is no count of clock ticks"))?;
    }
    Ok(ticks / TICKS_PER_SECOND)
}

/// CPU time so far, in seconds: this process's, and that of other processes together.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuTime {
    pub own: f64,
    pub others: f64,
}

impl CpuTime {
    /// Reads this process's and `others`' from `/proc`, on a blocking thread.
    pub async fn read(others: Vec<u32>) -> anyhow::Result<CpuTime> {
        blocking(move || {
            let mut time = CpuTime {
                own: cpu_seconds("self")?,
                others: 0.0,
            };
            for pid in others {
                time.others += cpu_seconds(&pid.to_string())?;
            }
            Ok(time)
        })
        .await
    }

    /// The CPU time spent since `earlier`.
    pub fn since(self, earlier: CpuTime) -> CpuTime {
        CpuTime {
            own: self.own - earlier.own,
            others: self.others - earlier.others,
        }
    }

    pub fn total(self) -> f64 {
        self.own + self.others
    }
}

/// The machine's busy and total CPU time so far, in clock ticks of all cores, from `/proc/stat`.
fn machine_ticks() -> anyhow::Result<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").context("read /proc/stat")?;
    let line = stat.lines().next().context("/proc/stat is empty")?;
    let ticks = line
        .split_whitespace()
        .skip(1)
        .map(|field| field.parse::<u64>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("/proc/stat: {line:?} is no line of clock ticks"))?;
    // user nice system idle iowait irq softirq steal: idle and iowait are the time nobody ran.
    anyhow::ensure!(ticks.len() >= 5, "/proc/stat: {line:?} is too short");
    let total: u64 = ticks.iter().take(8).sum();
    Ok((total - ticks[3] - ticks[4], total))
}

/// The machine counts as idle below this share of its CPU busy, above what it was when the
/// benchmark started.
const IDLE_SHARE_MAX: f64 = 0.15;

/// The share of the machine's CPU that was busy between two [`machine_ticks`] readings.
fn busy_between((busy_before, total_before): (u64, u64), (busy, total): (u64, u64)) -> f64 {
    (busy - busy_before) as f64 / (total - total_before).max(1) as f64
}

/// The share of the machine's CPU that was busy over the next quarter of a second.
pub async fn busy_share() -> anyhow::Result<f64> {
    let before = blocking(machine_ticks).await?;
    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    Ok(busy_between(before, blocking(machine_ticks).await?))
}

/// Waits, for at most `max`, until the machine's CPU is idle: less than 15% more of it busy
/// over a quarter of a second than `baseline` (its [`busy_share`] before the benchmark started
/// anything, so that a machine busy with something else does not make every wait run out). What
/// a run left behind (a store's flushes and compactions of the keys it wrote) would otherwise
/// count towards the next run, of whichever system. Returns how long it waited, and whether the
/// machine did become idle.
pub async fn settle(
    max: std::time::Duration,
    baseline: f64,
) -> anyhow::Result<(std::time::Duration, bool)> {
    let started = std::time::Instant::now();
    loop {
        if busy_share().await? < baseline + IDLE_SHARE_MAX {
            return Ok((started.elapsed(), true));
        }
        if started.elapsed() >= max {
            return Ok((started.elapsed(), false));
        }
    }
}

/// The partition status that says a partition serves (`cairnctl partitions list`).
const SERVING: &str = "active";
/// The status of a partition the node is still bringing up; the benchmarks wait for these.
const STARTING: &str = "starting";

/// `cairn_node::start` returns while the partitions are still coming up (a request to one says
/// "the node is still starting it"): polls the partition list until every partition serves, for
/// at most `timeout`. A partition that is down, not starting, fails at once with its reason.
pub async fn wait_until_serving(
    client: &cairn_client::Client,
    timeout: std::time::Duration,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let partitions = client
            .list_partitions()
            .await
            .context("list the benchmark node's partitions")?
            .partitions;
        let starting: Vec<String> = partitions
            .iter()
            .filter(|p| p.status != SERVING)
            .map(|p| {
                anyhow::ensure!(
                    p.status == STARTING,
                    "partition {} of the benchmark's Cairn node is not serving: {}",
                    p.partition_id,
                    p.status
                );
                Ok(p.partition_id.to_string())
            })
            .collect::<anyhow::Result<_>>()?;
        if starting.is_empty() {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the benchmark's Cairn node did not bring up partitions {} within {timeout:?}; \
             on a busy machine, allow longer with --start-timeout",
            starting.join(", ")
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_grows_with_work_done() {
        let before = cpu_seconds("self").unwrap();
        let wall = std::time::Instant::now();
        let mut spin = 0u64;
        let mut now = before;
        // Busy until the reading moves (a few clock ticks), or for long enough that it must have.
        while now - before < 0.05 && wall.elapsed() < std::time::Duration::from_secs(10) {
            for i in 0..100_000u64 {
                spin = std::hint::black_box(spin.wrapping_mul(31).wrapping_add(i));
            }
            now = cpu_seconds("self").unwrap();
        }
        assert!(
            now - before >= 0.05,
            "10 s of spinning read as {} s of CPU time",
            now - before
        );
        // The same process, named by its id as another process would be.
        let other = cpu_seconds(&std::process::id().to_string()).unwrap();
        assert!(other >= now);
    }

    #[test]
    fn the_machine_counts_as_busy_while_this_process_spins() {
        let before = machine_ticks().unwrap();
        let wall = std::time::Instant::now();
        let mut spin = 0u64;
        while wall.elapsed() < std::time::Duration::from_millis(300) {
            spin = std::hint::black_box(spin.wrapping_mul(31).wrapping_add(1));
        }
        let after = machine_ticks().unwrap();
        let ((busy_before, total_before), (busy, total)) = (before, after);
        assert!(busy <= total && busy_before <= busy && total_before < total);
        // One core of the machine's busy the whole time, at least.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let share = busy_between(before, after);
        assert!(share > 0.8 / cores, "{share} busy while one core spun");
    }
}
