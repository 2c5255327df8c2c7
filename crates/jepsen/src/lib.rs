//! Cairn's fault tests, in the way Jepsen and etcd's robustness tests prove a store: a real
//! cluster ([`cluster`]), clients over every path recording every operation ([`workload`]),
//! faults injected while they run, and the history checked by `cairn-checker` for
//! linearizability, single admission per insert-if-absent window, and no lost acknowledged
//! write (final reads after the faults).
//!
//! The scenario tests (`crates/cairn/tests/faults.rs`) and the randomized soak (`cairn-jepsen`)
//! both run [`Run`]s.

pub mod cluster;
pub mod measure;
pub mod proxy;
pub mod workload;

pub use cluster::{ClusterOptions, TestCluster, cairn_bin, snapshot, snapshot_file_keys};
pub use workload::{Workload, WorkloadOptions, final_reads};

use cairn_checker::{CheckOptions, Recorder, Report};
use std::time::Duration;

/// A run under way: its clients and what they record.
pub struct Run {
    pub recorder: Recorder,
    workload: Option<Workload>,
    options: WorkloadOptions,
}

/// What a run found.
pub struct Outcome {
    pub report: Report,
    /// Operations by outcome.
    pub counts: String,
}

impl Run {
    /// Starts the clients against `cluster`.
    pub fn start(cluster: &TestCluster, options: WorkloadOptions) -> Run {
        let recorder = Recorder::new();
        let workload = Workload::start(
            cluster.addresses(),
            cluster.resp_addresses(),
            options.clone(),
            recorder.clone(),
        );
        Run {
            recorder,
            workload: Some(workload),
            options,
        }
    }

    /// Stops the clients, waits until the cluster serves every partition again, reads every
    /// key, and checks the history.
    pub async fn finish(mut self, cluster: &mut TestCluster) -> anyhow::Result<Outcome> {
        let counts = match self.workload.take() {
            Some(workload) => workload.stop().await.summary(),
            None => String::new(),
        };
        cluster.wait_serving(Duration::from_secs(90)).await?;
        final_reads(&cluster.addresses(), self.options.keys, &self.recorder).await?;
        let history = self.recorder.history();
        let report =
            tokio::task::spawn_blocking(move || cairn_checker::check(&history, &check_options()))
                .await?;
        Ok(Outcome { report, counts })
    }
}

/// How histories of a cluster on one machine are checked: its nodes share the clients' clock.
pub fn check_options() -> CheckOptions {
    CheckOptions {
        clock_tolerance_ms: 100,
        timeout: Some(Duration::from_secs(60)),
        ..CheckOptions::default()
    }
}
