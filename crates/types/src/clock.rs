//! Monotonic clocks: what every timeout of the cluster is measured by.
//!
//! [`BootClock`] reads `CLOCK_BOOTTIME`, which goes on counting while the machine is suspended
//! (a laptop's lid, a virtual machine paused by its host), where `CLOCK_MONOTONIC` (Rust's
//! `Instant`) stops. A leader's lease must count that time: a leader suspended for a minute has
//! been replaced meanwhile, and must find its lease run out when it wakes. Both count the time a
//! process is stopped (SIGSTOP).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A clock that never goes back; its origin is arbitrary.
pub trait MonotonicClock: Send + Sync + 'static {
    fn now(&self) -> Duration;
}

/// `CLOCK_BOOTTIME`: time since the machine booted, suspensions included.
#[derive(Debug, Default, Clone, Copy)]
pub struct BootClock;

impl MonotonicClock for BootClock {
    fn now(&self) -> Duration {
        let mut spec = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `spec` is a valid, writable timespec; CLOCK_BOOTTIME exists on every Linux
        // since 2.6.39. The call cannot fail with these arguments.
        let result = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut spec) };
        assert_eq!(result, 0, "clock_gettime(CLOCK_BOOTTIME) failed");
        Duration::new(spec.tv_sec as u64, spec.tv_nsec as u32)
    }
}

/// A clock that moves only when told: for tests.
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    pub fn advance(&self, by: Duration) {
        self.nanos.fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
    }
}

impl MonotonicClock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_boot_clock_never_goes_back() {
        let clock = BootClock;
        let mut last = clock.now();
        for _ in 0..1000 {
            let now = clock.now();
            assert!(now >= last);
            last = now;
        }
        std::thread::sleep(Duration::from_millis(5));
        assert!(clock.now() >= last + Duration::from_millis(5));
    }
}
