//! What the benchmark binaries share: the plain copies they measure against, progress lines on
//! stderr, and the way their reports show sizes and times. moto's S3 server comes from
//! `cairn_snapshots::test_util::moto`, shared with the tests.
//!
//! Architecture invariant: nothing here measures anything; each binary owns its figures. The code
//! under measurement runs on the benchmark's runtime, so the binaries keep RocksDB, file-system and
//! process calls off its threads ([`blocking`]).

pub mod copy;
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
