//! This node as a member of the cluster: its registration, its heartbeats, and the lease they
//! renew.
//!
//! `members` lists every node name that ever joined; `nodes/<name>` is that node's record, which
//! its heartbeat rewrites (compare-and-swap on the version it wrote last) every
//! [`Timing::heartbeat_interval`]. A node registers as `starting` while it opens its stores and
//! says `alive` once it can take partitions; one that stops cleanly says `left`, so what it led
//! moves at once. Each successful heartbeat renews the node's [`NodeLease`].
//!
//! A heartbeat refused because the record changed under it means one of two things: the
//! controller wrote `dead` over it (the node was silent for the node timeout: paused, or cut off
//! from the metadata store), or another process took the name. In the first case the node gives
//! up every leadership for good ([`NodeLease::revoke`]) and registers again as the next
//! generation; in the second it stops.

use crate::clock::MonotonicClock;
use crate::lease::NodeLease;
use crate::silence::Silence;
use crate::{Timing, wall_clock_ms};
use cairn_metadata::{
    Change, Members, MetadataStore, NodeRecord, NodeState, Precondition, Version, get_typed,
    put_typed, update_typed,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, watch};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Why a node cannot join.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(
        "node name {name} is held by a live node at {address} (its record changed within the \
         last {} s): give this node another node-name (CAIRN_NODE_NAME), or stop the other one \
         and start this one again",
        timeout.as_secs_f64()
    )]
    NameTaken {
        name: String,
        address: String,
        timeout: Duration,
    },
    #[error("register this node in the metadata store: {0}")]
    Metadata(#[from] cairn_metadata::Error),
}

/// This node's membership; shared by its heartbeat task and whoever changes its state.
pub struct Member {
    metadata: Arc<dyn MetadataStore>,
    timing: Timing,
    lease: Arc<NodeLease>,
    /// The record as last written, with its version. Held across a write, so that heartbeats and
    /// state changes never race each other.
    record: Mutex<(Version, NodeRecord)>,
    /// The current generation, for those that must act when it changes (a new generation holds
    /// none of the leaderships of the last).
    generation: watch::Sender<u64>,
}

impl Member {
    /// Registers this node as `starting`: a new generation of its name, refused if a live node
    /// of another base dir (`record.instance`) holds the name. A record of another instance
    /// that says it is starting or alive is watched for the node timeout: taken over if it does
    /// not change (its node is gone), refused if it does.
    pub async fn register(
        metadata: Arc<dyn MetadataStore>,
        mut record: NodeRecord,
        timing: Timing,
        clock: Arc<dyn MonotonicClock>,
    ) -> Result<Arc<Member>, RegisterError> {
        let key = NodeRecord::key(&record.name);
        let mut silence = Silence::new(timing.node_timeout);
        let (version, sent) = loop {
            let existing = get_typed::<NodeRecord>(metadata.as_ref(), &key, "node record").await?;
            let precondition = match &existing {
                None => {
                    record.generation = 1;
                    Precondition::DoesNotExist
                }
                Some((version, other)) => {
                    let live = matches!(other.state, NodeState::Starting | NodeState::Alive);
                    if other.instance != record.instance && live {
                        let now = clock.now();
                        let changed = silence.version(&key).is_some_and(|seen| seen != *version);
                        if changed {
                            return Err(RegisterError::NameTaken {
                                name: record.name.0.clone(),
                                address: other.address.clone(),
                                timeout: timing.node_timeout,
                            });
                        }
                        silence.saw(&key, Some(*version), now);
                        if !silence.is_silent(&key, now) {
                            if silence.unchanged_for(&key, now) == Some(Duration::ZERO) {
                                info!(
                                    node = %record.name,
                                    "node name {} was last registered from another base dir \
                                     (at {}); waiting up to {:?} to see whether that node is \
                                     still alive",
                                    record.name, other.address, timing.node_timeout
                                );
                            }
                            tokio::time::sleep(timing.observe_interval()).await;
                            continue;
                        }
                    }
                    record.generation = other.generation + 1;
                    Precondition::MatchesVersion(*version)
                }
            };
            record.state = NodeState::Starting;
            record.heartbeats = 0;
            record.started_at_ms = wall_clock_ms();
            record.heartbeat_ms = record.started_at_ms;
            let sent = clock.now();
            match put_typed(metadata.as_ref(), &key, &record, precondition).await {
                Ok(version) => break (version, sent),
                Err(cairn_metadata::Error::PreconditionFailed { .. }) => continue,
                Err(err) => return Err(err.into()),
            }
        };
        let name = record.name.clone();
        update_typed::<Members, ()>(metadata.as_ref(), Members::KEY, "member list", |members| {
            let mut members = members.unwrap_or_default();
            if members.nodes.insert(name.clone()) {
                Change::Write(members, ())
            } else {
                Change::Keep(())
            }
        })
        .await?;
        let lease = Arc::new(NodeLease::new(
            clock,
            timing.leader_lease(),
            record.generation,
        ));
        lease.renewed(record.generation, sent);
        let (generation, _) = watch::channel(record.generation);
        Ok(Arc::new(Member {
            metadata,
            timing,
            lease,
            record: Mutex::new((version, record)),
            generation,
        }))
    }

    /// The lease this node's heartbeats renew.
    pub fn lease(&self) -> &Arc<NodeLease> {
        &self.lease
    }

    /// The generation this node runs as; it changes when the node was judged dead and registered
    /// again.
    pub fn generation(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// The record as last written.
    pub async fn record(&self) -> NodeRecord {
        self.record.lock().await.1.clone()
    }

    /// Heartbeats every [`Timing::heartbeat_interval`] (counted from when the last one was sent,
    /// so that the time a write takes does not stretch the interval), and again after
    /// [`Timing::heartbeat_retry`] when one failed, until `cancel` fires. Returns early, having
    /// cancelled `cancel`, if another process took this node's name: two nodes of one name would
    /// both lead what the table gives that name.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        let mut failing_since: Option<u64> = None;
        let mut next = tokio::time::Instant::now() + self.timing.heartbeat_interval();
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                () = cancel.cancelled() => return,
            }
            let sent = tokio::time::Instant::now();
            let beat = self.heartbeat().await;
            next = match &beat {
                Ok(()) => sent + self.timing.heartbeat_interval(),
                Err(_) => tokio::time::Instant::now() + self.timing.heartbeat_retry(),
            };
            match beat {
                Ok(()) => {
                    if let Some(since) = failing_since.take() {
                        info!(
                            "heartbeats succeed again (they failed for {} ms)",
                            wall_clock_ms().saturating_sub(since)
                        );
                    }
                }
                Err(HeartbeatError::Taken(address)) => {
                    error!(
                        "another node took this node's name (it runs at {address}); this node \
                         stops: start it again once the other is gone, or give it another \
                         node-name"
                    );
                    self.lease.close();
                    cancel.cancel();
                    return;
                }
                Err(HeartbeatError::Failed(err)) => {
                    self.lease.failed(err.to_string());
                    if failing_since.is_none() {
                        failing_since = Some(wall_clock_ms());
                        warn!(
                            "heartbeat failed ({err}); this node stops serving as a leader once \
                             none has succeeded for {} ms",
                            self.timing.leader_lease().as_millis()
                        );
                    }
                }
            }
        }
    }

    /// One heartbeat now (the task of [`Member::run`] sends one every interval).
    pub async fn heartbeat(&self) -> Result<(), HeartbeatError> {
        self.write(None).await
    }

    /// Says that this node can take partitions now (it has opened its stores).
    pub async fn set_alive(&self) -> Result<(), cairn_metadata::Error> {
        match self.write(Some(NodeState::Alive)).await {
            Ok(()) => Ok(()),
            Err(HeartbeatError::Failed(err)) => Err(err),
            // The heartbeat task finds the same and stops the node.
            Err(HeartbeatError::Taken(_)) => Ok(()),
        }
    }

    /// Gives up every leadership at once and says that this node left, so that what it led moves
    /// at once rather than after the node timeout. Best effort: a node that cannot say so is
    /// judged dead after the timeout instead.
    pub async fn leave(&self) {
        self.lease.close();
        let write = self.write(Some(NodeState::Left));
        match tokio::time::timeout(self.timing.node_timeout, write).await {
            Ok(Ok(())) => info!("this node left the cluster"),
            Ok(Err(HeartbeatError::Failed(err))) => {
                warn!("could not say that this node left: {err}")
            }
            Ok(Err(HeartbeatError::Taken(_))) => {}
            Err(_) => warn!("could not say that this node left: the metadata store did not answer"),
        }
    }

    /// One heartbeat, changing the state to `state` if given. Registers again as the next
    /// generation if the controller wrote this node dead.
    async fn write(&self, state: Option<NodeState>) -> Result<(), HeartbeatError> {
        let mut current = self.record.lock().await;
        let (version, record) = &mut *current;
        let key = NodeRecord::key(&record.name);
        let mut next = record.clone();
        next.heartbeats += 1;
        next.heartbeat_ms = wall_clock_ms();
        if let Some(state) = state {
            next.state = state;
        }
        let sent = self.lease.clock().now();
        let put = put_typed(
            self.metadata.as_ref(),
            &key,
            &next,
            Precondition::MatchesVersion(*version),
        );
        // A put that never answers must not hold up the next heartbeat; if it lands later, the
        // next one finds the version moved and reads it (below).
        let written = tokio::time::timeout(self.timing.node_timeout, put)
            .await
            .unwrap_or_else(|_| {
                Err(cairn_metadata::Error::Nats {
                    context: "write this node's heartbeat",
                    source: format!(
                        "no answer within {} ms",
                        self.timing.node_timeout.as_millis()
                    )
                    .into(),
                })
            });
        match written {
            Ok(new) => {
                *version = new;
                *record = next;
                self.lease.renewed(record.generation, sent);
                return Ok(());
            }
            Err(cairn_metadata::Error::PreconditionFailed { .. }) => {}
            Err(err) => return Err(HeartbeatError::Failed(err)),
        }
        let stored = get_typed::<NodeRecord>(self.metadata.as_ref(), &key, "node record")
            .await
            .map_err(HeartbeatError::Failed)?;
        match stored {
            Some((stored_version, stored))
                if stored.instance == record.instance
                    && stored.generation == record.generation
                    && stored.state == NodeState::Dead =>
            {
                // Judged dead: every leadership of this generation is given up before the next
                // one can renew anything.
                let generation = record.generation + 1;
                self.lease.revoke(generation);
                warn!(
                    "the controller judged this node dead (its heartbeats did not change its \
                     record for {} ms: it was paused, or could not reach the metadata store); it \
                     gave up every leadership and joins again as generation {generation}",
                    self.timing.node_timeout.as_millis()
                );
                next = record.clone();
                next.generation = generation;
                next.heartbeats = 0;
                next.heartbeat_ms = wall_clock_ms();
                next.started_at_ms = next.heartbeat_ms;
                if let Some(state) = state {
                    next.state = state;
                }
                let sent = self.lease.clock().now();
                let new = put_typed(
                    self.metadata.as_ref(),
                    &key,
                    &next,
                    Precondition::MatchesVersion(stored_version),
                )
                .await
                .map_err(HeartbeatError::Failed)?;
                *version = new;
                *record = next;
                self.lease.renewed(generation, sent);
                self.generation.send_replace(generation);
                Ok(())
            }
            // Our own write whose answer was lost landed after all: carry on from it.
            Some((stored_version, stored))
                if stored.instance == record.instance && stored.generation == record.generation =>
            {
                *version = stored_version;
                Err(HeartbeatError::Failed(
                    cairn_metadata::Error::PreconditionFailed {
                        key,
                        expected: Precondition::MatchesVersion(stored_version),
                        current: Some(stored_version),
                    },
                ))
            }
            Some((_, other)) => Err(HeartbeatError::Taken(other.address)),
            None => Err(HeartbeatError::Taken(
                "an unknown address (its record was deleted)".into(),
            )),
        }
    }
}

/// Why a heartbeat did not renew the lease.
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    #[error("{0}")]
    Failed(cairn_metadata::Error),
    /// Another process registered this node's name (from another base dir).
    #[error("another node took this node's name; it runs at {0}")]
    Taken(String),
}
