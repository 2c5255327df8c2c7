//! How long a record of the metadata store has gone unchanged, as one observer sees it.
//!
//! An observer reads a record now and then and notes, on its own monotonic clock, when it first
//! saw its current version. The record is *silent* once that is longer ago than the timeout. Two
//! rules keep the judgement sound:
//!
//! - Only the observer's own clock is read: nothing compares its time with a time another
//!   machine wrote.
//! - Evidence gathered while the store was failing does not count. A record cannot change while
//!   the store refuses every write, so every read that fails puts the whole view on hold, and
//!   when the store answers again each record's silence counts from then, not from when it was
//!   first seen. A NATS election or a lost server is therefore never taken for the death of
//!   every node.
//!
//! The silence of a node's record is what the controller acts on, through a compare-and-swap on
//! the version it saw: if the node wrote meanwhile, the write fails. See [`crate::lease`] for why
//! the node has stopped serving by then.

use cairn_metadata::Version;
use std::collections::HashMap;
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
struct Seen {
    version: Option<Version>,
    /// When this observer first saw `version`.
    since: Duration,
}

/// One observer's view of how long each record it follows has gone unchanged.
#[derive(Debug, Clone)]
pub struct Silence {
    timeout: Duration,
    seen: HashMap<String, Seen>,
    /// Since when every read of the store has succeeded; `None` while it fails.
    healthy_since: Option<Duration>,
}

impl Silence {
    pub fn new(timeout: Duration) -> Silence {
        Silence {
            timeout,
            seen: HashMap::new(),
            healthy_since: None,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A read of the store failed: no record is silent until the store answers again.
    pub fn store_failed(&mut self) {
        self.healthy_since = None;
    }

    /// A read of the store succeeded at `now`.
    pub fn store_answered(&mut self, now: Duration) {
        if self.healthy_since.is_none() {
            self.healthy_since = Some(now);
        }
    }

    /// `key` holds `version` (`None`: absent) as read at `now`.
    pub fn saw(&mut self, key: &str, version: Option<Version>, now: Duration) {
        self.store_answered(now);
        match self.seen.get_mut(key) {
            Some(seen) if seen.version == version => {}
            Some(seen) => {
                *seen = Seen {
                    version,
                    since: now,
                }
            }
            None => {
                self.seen.insert(
                    key.to_owned(),
                    Seen {
                        version,
                        since: now,
                    },
                );
            }
        }
    }

    /// How long `key` has gone unchanged as far as it counts at `now`: since its version was
    /// first seen, or since the store last came back, whichever is later. `None` for a key never
    /// seen, or while the store fails.
    pub fn unchanged_for(&self, key: &str, now: Duration) -> Option<Duration> {
        let seen = self.seen.get(key)?;
        let healthy_since = self.healthy_since?;
        Some(now.saturating_sub(seen.since.max(healthy_since)))
    }

    /// How long ago `key`'s current version was first seen, whatever the store did since: what
    /// operators are shown as "last seen".
    pub fn seen_ago(&self, key: &str, now: Duration) -> Option<Duration> {
        self.seen
            .get(key)
            .map(|seen| now.saturating_sub(seen.since))
    }

    /// Whether `key` has gone unchanged for the timeout, as it counts (see
    /// [`Silence::unchanged_for`]).
    pub fn is_silent(&self, key: &str, now: Duration) -> bool {
        self.unchanged_for(key, now)
            .is_some_and(|unchanged| unchanged >= self.timeout)
    }

    /// The version of `key` this observer last saw.
    pub fn version(&self, key: &str) -> Option<Version> {
        self.seen.get(key).and_then(|seen| seen.version)
    }

    /// Forgets `key` (it is no longer followed).
    pub fn forget(&mut self, key: &str) {
        self.seen.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(3);

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    #[test]
    fn a_record_is_silent_once_unchanged_for_the_timeout() {
        let mut silence = Silence::new(T);
        silence.saw("n1", Some(1), s(0.0));
        silence.saw("n1", Some(1), s(2.9));
        assert!(!silence.is_silent("n1", s(2.9)));
        silence.saw("n1", Some(1), s(3.0));
        assert!(silence.is_silent("n1", s(3.0)));
        // A new version starts the count again.
        silence.saw("n1", Some(5), s(3.1));
        assert!(!silence.is_silent("n1", s(6.0)));
        assert!(silence.is_silent("n1", s(6.1)));
        assert!(!silence.is_silent("never-seen", s(100.0)));
    }

    #[test]
    fn nothing_is_silent_on_evidence_gathered_while_the_store_failed() {
        let mut silence = Silence::new(T);
        silence.saw("n1", Some(1), s(0.0));
        silence.saw("n2", Some(7), s(0.0));
        // The store fails from 1 s to 10 s: nobody could write.
        silence.store_failed();
        assert!(
            !silence.is_silent("n1", s(9.0)),
            "no judgement while it fails"
        );
        assert_eq!(silence.unchanged_for("n1", s(9.0)), None);
        // Back at 10 s: both records count from there, not from 0 s.
        silence.saw("n1", Some(1), s(10.0));
        assert!(!silence.is_silent("n2", s(12.9)));
        silence.saw("n2", Some(8), s(11.0));
        assert!(silence.is_silent("n1", s(13.0)));
        assert!(!silence.is_silent("n2", s(13.0)));
        // "Last seen" is still when the version was first seen.
        assert_eq!(silence.seen_ago("n1", s(13.0)), Some(s(13.0)));
    }
}
