//! A leader's lease: the time for which this node may serve the partitions it leads.
//!
//! # The rule
//! Before it sends a heartbeat, the node reads its clock (`t0`). When the heartbeat's
//! compare-and-swap succeeds, the node may serve until `t0 + L` on that clock, `L` being
//! [`crate::Timing::leader_lease`] (two thirds of the node timeout `T`). A heartbeat that fails or
//! goes unanswered renews nothing, so a node that is paused, or cannot reach the metadata
//! store, stops serving by itself at most `L` after the last heartbeat it sent that succeeded.
//!
//! # Why no successor serves before then
//! A controller moves a node's leaderships only after writing `dead` over the node's record,
//! conditional on the version it saw, and only once it saw that version unchanged for `T` on
//! its own clock (while the store answered; see [`crate::silence`]). Let `v` be that version,
//! written by the heartbeat the node sent at `t0`. The controller first read `v` at some `o`,
//! and `v` was committed before `o`, so `o` is after `t0`. It acts no earlier than `T` after `o`
//! by its clock. The node stopped `L` after `t0` by its own. Safety needs `L` on the node's clock
//! to end, in real time, before `T` on the controller's: with clocks that each run within a
//! fraction `r` of real time, `L / (1 - r) < T / (1 + r)`, which for `L = 2T/3` holds for every
//! `r` below 20%. At 10% the node stops at `0.74 T` of real time and the controller acts at
//! `0.91 T` at the earliest, half a second apart at the default 3 s. Quartz clocks drift by
//! parts per million, so the bound is loose on purpose. Had the node written since `v`, the
//! controller's compare-and-swap fails and it moves nothing.
//!
//! # Generations
//! Once the controller has written `dead`, the node's next heartbeat fails; it then gives up every
//! leadership it holds for good ([`NodeLease::revoke`]) before it registers again as a new
//! generation. A grant ([`LeaseGrant`]) is of one generation: a partition led under an earlier
//! one never serves again under a later one's heartbeats, and must be taken again (at a new
//! epoch, which fences whatever the old leadership wrote).

use crate::clock::MonotonicClock;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Why a leader may not serve now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseLapsed {
    /// No heartbeat has succeeded for longer than the lease: the metadata store may be
    /// unreachable, or the node was paused.
    #[error(
        "this node has not renewed its leader's lease for {} ms ({}); it serves again once a \
         heartbeat succeeds",
        silent_for.as_millis(),
        cause.as_ref().map_or_else(
            || "its heartbeats to the metadata store are failing, or it was paused".to_string(),
            |cause| format!("its last heartbeat to the metadata store failed: {cause}")
        )
    )]
    Expired {
        silent_for: Duration,
        /// Why the last heartbeat failed, if it did (rather than not being sent at all).
        cause: Option<String>,
    },
    /// The leadership was taken under an earlier generation of this node, which was judged dead
    /// or stopped: it must be taken again.
    #[error(
        "this node gave up the leadership it took as generation {granted} (it was judged dead \
         or is stopping); it takes it again if the placement still gives it"
    )]
    Revoked { granted: u64 },
}

#[derive(Debug)]
struct State {
    /// The generation whose heartbeats renew the lease; grants of others are revoked.
    generation: u64,
    /// The lease holds until this time on [`NodeLease::clock`]; `None`: never renewed.
    valid_until: Option<Duration>,
    /// No grant holds any more (the node is stopping).
    closed: bool,
    /// Why the last heartbeat failed, until one succeeds.
    failure: Option<String>,
}

/// This node's lease (one for all the partitions it leads). Cheap to share.
pub struct NodeLease {
    clock: Arc<dyn MonotonicClock>,
    duration: Duration,
    state: Mutex<State>,
}

impl NodeLease {
    /// A lease of `duration` per renewal, for `generation`, not renewed yet.
    pub fn new(clock: Arc<dyn MonotonicClock>, duration: Duration, generation: u64) -> NodeLease {
        NodeLease {
            clock,
            duration,
            state: Mutex::new(State {
                generation,
                valid_until: None,
                closed: false,
                failure: None,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The clock the lease is measured on.
    pub fn clock(&self) -> &Arc<dyn MonotonicClock> {
        &self.clock
    }

    /// A heartbeat of `generation` that was sent at `sent` (read from [`NodeLease::clock`]
    /// before sending) succeeded.
    pub fn renewed(&self, generation: u64, sent: Duration) {
        let mut state = self.state();
        if state.generation != generation || state.closed {
            return;
        }
        state.failure = None;
        let until = sent + self.duration;
        state.valid_until = Some(state.valid_until.map_or(until, |known| known.max(until)));
    }

    /// A heartbeat failed for `cause` (said to requests refused once the lease runs out).
    pub fn failed(&self, cause: String) {
        self.state().failure = Some(cause);
    }

    /// Gives up every grant made so far: from now on only grants of `next_generation`, renewed by
    /// its heartbeats, hold.
    pub fn revoke(&self, next_generation: u64) {
        let mut state = self.state();
        state.generation = next_generation;
        state.valid_until = None;
    }

    /// No grant holds any more, for good: the node is stopping.
    pub fn close(&self) {
        let mut state = self.state();
        state.closed = true;
        state.valid_until = None;
    }

    /// Whether the last heartbeat that succeeded was sent less than the lease's duration ago:
    /// this node's writes reach the metadata store.
    pub fn holds(&self) -> bool {
        let now = self.clock.now();
        let state = self.state();
        !state.closed && state.valid_until.is_some_and(|until| now < until)
    }

    /// The generation new grants are of.
    pub fn generation(&self) -> u64 {
        self.state().generation
    }

    /// The right to serve as a leader under this generation's heartbeats.
    pub fn grant(self: &Arc<Self>) -> LeaseGrant {
        LeaseGrant {
            lease: self.clone(),
            generation: self.generation(),
        }
    }

    fn check(&self, generation: u64) -> Result<(), LeaseLapsed> {
        let now = self.clock.now();
        let state = self.state();
        if state.closed || state.generation != generation {
            return Err(LeaseLapsed::Revoked {
                granted: generation,
            });
        }
        match state.valid_until {
            Some(until) if now < until => Ok(()),
            Some(until) => Err(LeaseLapsed::Expired {
                silent_for: now.saturating_sub(until) + self.duration,
                cause: state.failure.clone(),
            }),
            None => Err(LeaseLapsed::Expired {
                silent_for: self.duration,
                cause: state.failure.clone(),
            }),
        }
    }
}

/// A leadership's right to serve: holds while the lease of the generation it was granted under
/// is renewed.
#[derive(Clone)]
pub struct LeaseGrant {
    lease: Arc<NodeLease>,
    generation: u64,
}

impl LeaseGrant {
    /// `Ok` while the holder may serve.
    pub fn check(&self) -> Result<(), LeaseLapsed> {
        self.lease.check(self.generation)
    }

    /// Whether this grant can never hold again.
    pub fn revoked(&self) -> bool {
        matches!(self.check(), Err(LeaseLapsed::Revoked { .. }))
    }
}

impl std::fmt::Debug for LeaseGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGrant")
            .field("generation", &self.generation)
            .field("check", &self.check())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn lease(clock: &Arc<ManualClock>) -> Arc<NodeLease> {
        Arc::new(NodeLease::new(clock.clone(), Duration::from_secs(2), 1))
    }

    #[test]
    fn a_grant_holds_for_the_lease_after_the_heartbeat_was_sent() {
        let clock = Arc::new(ManualClock::new());
        let lease = lease(&clock);
        let grant = lease.grant();
        assert!(grant.check().is_err(), "never renewed");
        let sent = clock.now();
        clock.advance(Duration::from_millis(700)); // the heartbeat took this long
        lease.renewed(1, sent);
        assert!(grant.check().is_ok());
        clock.advance(Duration::from_millis(1299));
        assert!(grant.check().is_ok());
        clock.advance(Duration::from_millis(1));
        assert!(matches!(grant.check(), Err(LeaseLapsed::Expired { .. })));
        // An older heartbeat's late answer does not shorten it; a newer one extends it.
        lease.renewed(1, clock.now());
        assert!(grant.check().is_ok());
        lease.renewed(1, Duration::ZERO);
        assert!(grant.check().is_ok());
    }

    #[test]
    fn a_revoked_generation_never_serves_again() {
        let clock = Arc::new(ManualClock::new());
        let lease = lease(&clock);
        let old = lease.grant();
        lease.renewed(1, clock.now());
        lease.revoke(2);
        assert!(old.revoked());
        lease.renewed(1, clock.now());
        assert!(
            old.check().is_err(),
            "the old generation's heartbeat renews nothing"
        );
        let new = lease.grant();
        lease.renewed(2, clock.now());
        assert!(new.check().is_ok());
        assert!(old.revoked(), "nor does the new one's");
        lease.close();
        assert!(new.revoked());
    }
}
