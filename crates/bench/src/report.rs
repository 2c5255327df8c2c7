//! How the benchmarks report: the figures on stdout, progress lines on stderr, sizes and times in
//! one format.

use std::time::{Duration, Instant};

pub const MIB: f64 = 1024.0 * 1024.0;

/// `1 file`, `17 files`.
pub fn files(n: usize) -> String {
    if n == 1 {
        "1 file".into()
    } else {
        format!("{n} files")
    }
}

/// `812 B`, `3.4 KiB`, `120.3 MiB`, `1.02 GiB`.
pub fn size(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1024.0 * MIB {
        format!("{:.2} GiB", b / (1024.0 * MIB))
    } else if b >= MIB {
        format!("{:.1} MiB", b / MIB)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

/// `12.34 s`.
pub fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// MiB per second of `bytes` moved in `time`.
pub fn mib_per_sec(bytes: u64, time: Duration) -> f64 {
    bytes as f64 / MIB / time.as_secs_f64()
}

/// Progress goes to stderr so that stdout is the report.
pub fn progress(what: &str) {
    eprintln!("[{}] {what}", since_start());
}

/// Seconds since the first call, for progress lines.
fn since_start() -> String {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(Instant::now);
    format!("{:7.1}s", start.elapsed().as_secs_f64())
}

/// Prints a progress line at every tenth of `total`.
pub struct Deciles {
    label: String,
    total: u64,
    printed: u64,
}

impl Deciles {
    pub fn new(label: &str, total: u64) -> Deciles {
        Deciles {
            label: label.to_owned(),
            total: total.max(1),
            printed: 0,
        }
    }

    pub fn at(&mut self, done: u64) {
        let decile = (done.min(self.total) * 10 / self.total).min(10);
        if decile > self.printed {
            self.printed = decile;
            progress(&format!("{}: {}%", self.label, decile * 10));
        }
    }
}

/// Writes back every dirty page of the machine, so that a timed transfer does not pay for the
/// writes of the step before it. Waits for `sync` without holding a runtime thread.
pub async fn sync_disks() {
    match tokio::process::Command::new("sync").status().await {
        Ok(status) if status.success() => {}
        other => eprintln!("sync failed ({other:?}); timings may include earlier writes"),
    }
}
