//! The node's partitions: starting each one (restoring it from a snapshot first when its store is
//! missing or behind its log's trim point), and restoring one on an operator's request.
//!
//! # Start-up decision, per partition
//! ```text
//!   repair an interrupted restore (drop a partial import, remove staging)
//!   store present, log trim point ≤ applied LSN   → start, replay the log from applied + 1
//!   store present, trim point > applied (a gap)   → restore, whatever the policy
//!   no store, policy on-init                       → restore; none suitable and no gap → empty
//!   no store, policy none, trim point = 0          → empty store, replay the whole log
//!   no store, trim point > 0 (a gap)               → restore
//!   restore impossible across a gap                → the partition stays down, saying why
//!   store applied past the log's tail              → down, naming both LSNs and the ways out
//!   log cannot be opened (corrupt)                 → down, naming file, offset and LSN
//! ```
//! A partition never starts with a gap between its store and its log: it would serve data with
//! records missing. Nor does it start with its store ahead of its log (the log lost its end to a
//! disk fault): its next records would get LSNs the store already applied, and a restart would
//! serve different records at them. Nothing in a bring-up waits without a bound.

use crate::cluster::Role;
use crate::config::RestorePolicy;
use crate::metrics::Metrics;
use cairn_log::Loglet;
use cairn_metadata::{
    Change, MetadataStore, ObservedPartition, ObservedRole, PartitionPlacement, PartitionTable,
    get_typed, update_typed,
};
use cairn_partition_store::{PartitionStore, PartitionStoreManager};
use cairn_snapshots::SnapshotId;
use cairn_types::{Epoch, KeyRange, Lsn, NodeId, PartitionId};
use cairn_worker::{
    Clock, Error, Partition, PartitionStatus, RestoreFailure, RestoreProgressFn, RestoreStep,
    Restored, Restorer, Result, blocking, repair_interrupted_restore,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;
use tracing::{error, info, warn};

/// How long a leader that steps down waits for the writes it has in flight to be answered.
const STEP_DOWN_DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// Partitions brought up at once at start: a long restore of one leaves the others coming up.
const BRING_UP_CONCURRENCY: usize = 4;

/// What a partition of this node is doing.
#[derive(Clone)]
enum SlotState {
    Running(Arc<Partition>),
    /// Not serving until an operator acts; the reason says why and what to do.
    Down(String),
    Restoring,
    /// The node is bringing it up (repair, maybe a restore, replay).
    Starting,
    /// In a cluster: placed on other nodes only, or not placed yet.
    Elsewhere,
}

/// Why a partition cannot start: the sentence its slot shows while it is down.
#[derive(Debug, thiserror::Error)]
enum NotStarted {
    #[error(transparent)]
    Worker(#[from] Error),
    #[error("read the log's state: {0}")]
    LogState(#[source] cairn_log::Error),
    #[error(transparent)]
    Store(#[from] cairn_partition_store::Error),
    #[error("partition {0} has no store after its restore")]
    NoStoreAfterRestore(PartitionId),
    /// The partition has a store that RocksDB cannot open.
    #[error("{}", unopened_store_reason(*partition, source))]
    StoreNotOpened {
        partition: PartitionId,
        source: Arc<cairn_partition_store::Error>,
    },
    /// The log no longer holds records the store lacks, and no snapshot could fill the gap.
    #[error(
        "the log is trimmed up to LSN {trim_point} but the store has applied only up to LSN \
         {applied}, so records {}..={trim_point} are missing, and {source}. Point \
         worker.snapshots.destination at a repository holding a snapshot of partition {partition} \
         at LSN {trim_point} or later and restart the node (if the repository is already right \
         but was unreachable, `cairnctl partitions restore -p {partition}` retries without a \
         restart)",
        applied.0 + 1
    )]
    Gap {
        partition: PartitionId,
        trim_point: Lsn,
        applied: Lsn,
        source: Error,
    },
}

/// Why this node does not lead a partition it started.
#[derive(Debug, thiserror::Error)]
enum NotLeading {
    #[error("cannot record this node as its leader: {0:#}; restart the node")]
    Record(#[source] anyhow::Error),
    #[error(transparent)]
    Worker(Error),
}

/// One partition of this node, whatever its state.
pub(crate) struct Slot {
    id: PartitionId,
    key_range: KeyRange,
    log: Arc<dyn Loglet>,
    state: RwLock<SlotState>,
    /// One restore at a time.
    restoring: tokio::sync::Mutex<()>,
    /// One compaction at a time. A restore takes it too (first), so that it waits for a
    /// compaction under way; trims do not, so a long compaction holds up no trim.
    compacting: tokio::sync::Mutex<()>,
    /// In a cluster: since when the partition table has placed the partition on other nodes only
    /// (as the last reconcile found it); `None` while this node leads or follows it.
    placed_elsewhere_since: std::sync::Mutex<Option<Instant>>,
}

impl Slot {
    pub fn id(&self) -> PartitionId {
        self.id
    }

    pub fn log(&self) -> &Arc<dyn Loglet> {
        &self.log
    }

    /// Why this slot's log cannot be read (`err`, from one of its calls), in the words its
    /// partition shows when the log could not be opened.
    pub fn log_problem(&self, err: &cairn_log::Error) -> String {
        match err {
            cairn_log::Error::NotOpened { source, .. } => unopened_log_reason(self.id, source),
            _ => format!("its state cannot be read: {err}"),
        }
    }

    fn state(&self) -> SlotState {
        self.state.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, state: SlotState) {
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = state;
    }

    /// Notes the role the partition table gives this node: the clock of
    /// [`Partitions::drop_moved_away`] starts when it first gives none.
    fn note_role(&self, role: Role) {
        let mut since = self
            .placed_elsewhere_since
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match role {
            Role::None => {
                since.get_or_insert_with(Instant::now);
            }
            Role::Leader | Role::Follower => *since = None,
        }
    }

    /// Whether the partition table has placed the partition on other nodes only for `grace`.
    fn placed_elsewhere_for(&self, grace: std::time::Duration) -> bool {
        self.placed_elsewhere_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|since| since.elapsed() >= grace)
    }

    /// The running partition, or why there is none.
    pub fn running(&self) -> Result<Arc<Partition>> {
        match self.state() {
            SlotState::Running(partition) => Ok(partition),
            SlotState::Down(reason) => Err(Error::Stopped {
                partition: self.id,
                reason,
            }),
            SlotState::Restoring => Err(Error::Stopped {
                partition: self.id,
                reason: "it is being restored from a snapshot; retry once the restore is done"
                    .into(),
            }),
            SlotState::Starting => Err(Error::Stopped {
                partition: self.id,
                reason:
                    "the node is still starting it (restoring or replaying its log); retry shortly"
                        .into(),
            }),
            SlotState::Elsewhere => Err(Error::NotLeader {
                partition: self.id,
                leader: None,
            }),
        }
    }

    /// Compacts the running partition's store (see [`Partition::compact`]), after any other
    /// compaction of it; a restore asked for meanwhile waits for it. Refused while a restore or a
    /// start-up is under way, which replace the store.
    pub async fn compact(&self) -> Result<cairn_worker::Compacted> {
        let _one_at_a_time = self.compacting.lock().await;
        self.running()?.compact().await
    }

    /// Trims the running partition's log up to `up_to` (see [`Partition::trim_log`]) and returns
    /// that partition; never while a restore or a start-up is under way. A trim checks the store's
    /// applied LSN and then trims: had a restore replaced the store in between (it checks the
    /// log's trim point before it imports), the trim would cut records that the restored store
    /// still needs, with the old store that held them gone.
    pub async fn trim_log(&self, up_to: Lsn) -> Result<Arc<Partition>> {
        let Ok(_no_restore) = self.restoring.try_lock() else {
            return Err(Error::Stopped {
                partition: self.id,
                reason: "it is being restored from a snapshot or started; retry once that is done"
                    .into(),
            });
        };
        let partition = self.running()?;
        partition.trim_log(up_to).await?;
        Ok(partition)
    }

    /// What this node runs of the partition, as it reports it in `observed/<node>`; `None` when
    /// it runs nothing of it.
    pub async fn observed(&self) -> Option<ObservedPartition> {
        let (role, partition, reason) = match self.state() {
            SlotState::Running(partition) => {
                let role = if partition.holds_leadership() {
                    ObservedRole::Leader
                } else {
                    ObservedRole::Follower
                };
                let reason = partition.stopped();
                (role, Some(partition), reason)
            }
            SlotState::Starting => (ObservedRole::Starting, None, None),
            SlotState::Restoring => (ObservedRole::Restoring, None, None),
            SlotState::Down(reason) => (ObservedRole::Down, None, Some(reason)),
            SlotState::Elsewhere => return None,
        };
        let (epoch, applied_lsn) = match partition {
            Some(partition) => {
                let status = partition.status().await;
                (
                    status.leader.map(|l| l.epoch).unwrap_or_default(),
                    status.applied_lsn.0,
                )
            }
            None => (Epoch::default(), 0),
        };
        Some(ObservedPartition {
            role,
            epoch,
            applied_lsn,
            reason,
        })
    }

    pub async fn status(&self, stores: &Arc<PartitionStoreManager>) -> PartitionStatus {
        match self.state() {
            SlotState::Running(partition) => partition.status().await,
            other => {
                let (stores, id) = (stores.clone(), self.id);
                let applied_lsn = blocking(id, "read the applied LSN", move || {
                    stores.partition(id).map(|s| s.applied_lsn())
                })
                .await
                .ok()
                .flatten()
                .and_then(|applied| applied.ok())
                .unwrap_or(Lsn::ZERO);
                PartitionStatus {
                    id: self.id,
                    key_range: self.key_range,
                    leader: None,
                    applied_lsn,
                    log: self.log.state().await.ok(),
                    stopped: Some(match other {
                        SlotState::Down(reason) => reason,
                        SlotState::Starting => "starting".into(),
                        SlotState::Elsewhere => "not on this node".into(),
                        _ => "restoring from a snapshot".into(),
                    }),
                }
            }
        }
    }
}

/// Everything needed to start, stop and restore partitions.
pub(crate) struct Partitions {
    slots: Vec<Slot>,
    node: NodeId,
    stores: Arc<PartitionStoreManager>,
    metadata: Arc<dyn MetadataStore>,
    restorer: Option<Restorer>,
    clock: Arc<dyn Clock>,
    policy: RestorePolicy,
    metrics: Arc<Metrics>,
    /// Where restores stage their downloads; repaired at every start.
    staging_root: std::path::PathBuf,
    /// In a cluster, the controller decides who leads: a node leads only the partitions the
    /// partition table places on it. Alone, a node leads every partition.
    cluster: bool,
    /// In a cluster: this node's lease, which every leadership it takes serves under.
    lease: Option<Arc<cairn_controller::NodeLease>>,
    pub table_version: AtomicU64,
    /// Takes the leaderships asked at once in one write of the table.
    epochs: EpochRaiser,
    /// Ticks whenever this node starts serving a partition as its leader.
    led: tokio::sync::watch::Sender<()>,
    /// Woken when a partition may have changed what it runs, so that the report of what this
    /// node runs goes out soon rather than at the next heartbeat.
    pub reconciled: tokio::sync::Notify,
    /// Every processor this node started, whichever slot state it got to: a bring-up, reconcile
    /// or restore cut short by shutdown leaves one that no slot holds, and shutdown waits for it
    /// all the same (a processor thread still in RocksDB when the process exits makes RocksDB
    /// abort).
    started: Arc<std::sync::Mutex<Started>>,
}

/// The processors started, and whether shutdown has begun (then none starts any more).
#[derive(Default)]
struct Started {
    partitions: Vec<Arc<Partition>>,
    closed: bool,
}

pub(crate) struct PartitionsConfig {
    pub node: NodeId,
    pub num_partitions: u16,
    pub stores: Arc<PartitionStoreManager>,
    pub metadata: Arc<dyn MetadataStore>,
    pub restorer: Option<Restorer>,
    pub clock: Arc<dyn Clock>,
    pub policy: RestorePolicy,
    pub metrics: Arc<Metrics>,
    pub staging_root: std::path::PathBuf,
    pub cluster: bool,
    pub lease: Option<Arc<cairn_controller::NodeLease>>,
}

impl Partitions {
    /// Opens every partition's log (a partition whose log cannot be opened is down from the
    /// start, saying why); the partitions serve once [`Partitions::bring_up`] has run.
    pub async fn open(
        config: PartitionsConfig,
        logs: &dyn cairn_log::LogProvider,
    ) -> anyhow::Result<Partitions> {
        let mut slots = Vec::with_capacity(usize::from(config.num_partitions));
        for p in 0..config.num_partitions {
            let id = PartitionId(p);
            let log_id = cairn_types::LogId::from(id);
            // A log that cannot be opened keeps its partition down, not the node: the other
            // partitions serve.
            let (log, state) = match logs.open(log_id).await {
                Ok(log) => (log, SlotState::Starting),
                Err(err) => {
                    let reason = unopened_log_reason(id, &err);
                    error!(partition = %id, "partition is not serving: {reason}");
                    let log: Arc<dyn Loglet> = Arc::new(UnopenedLog {
                        log_id,
                        error: Arc::new(err),
                    });
                    (log, SlotState::Down(reason))
                }
            };
            slots.push(Slot {
                id,
                key_range: KeyRange::of_partition(id, config.num_partitions),
                log,
                state: RwLock::new(state),
                restoring: tokio::sync::Mutex::new(()),
                compacting: tokio::sync::Mutex::new(()),
                placed_elsewhere_since: std::sync::Mutex::new(None),
            });
        }
        Ok(Partitions {
            slots,
            node: config.node,
            stores: config.stores,
            metadata: config.metadata,
            restorer: config.restorer,
            clock: config.clock,
            policy: config.policy,
            metrics: config.metrics,
            staging_root: config.staging_root,
            cluster: config.cluster,
            lease: config.lease,
            table_version: AtomicU64::new(0),
            epochs: EpochRaiser::default(),
            led: tokio::sync::watch::channel(()).0,
            reconciled: tokio::sync::Notify::new(),
            started: Arc::default(),
        })
    }

    /// Brings every partition up, a few at a time: repairs, restores where needed, starts the
    /// processor and leads it once it replayed its log. Each partition serves as soon as it is up;
    /// one that cannot start stays down with the reason. The node serves (admin calls, metrics,
    /// the partitions already up) meanwhile. Returns how many partitions serve.
    pub async fn bring_up(&self) -> usize {
        let permits = tokio::sync::Semaphore::new(BRING_UP_CONCURRENCY);
        let permits = &permits;
        let serving = futures::future::join_all(self.slots.iter().map(|slot| async move {
            let _permit = permits
                .acquire()
                .await
                .expect("the semaphore is never closed");
            self.bring_up_one(slot).await
        }))
        .await;
        serving.into_iter().filter(|serving| *serving).count()
    }

    async fn bring_up_one(&self, slot: &Slot) -> bool {
        // Held throughout, so an online restore cannot start on a partition half brought up.
        // Every step below is bounded (the lead step by `LEAD_STALL_MAX` without progress), so
        // a restore waits for a bring-up that fails, never for one that hangs.
        let _one_at_a_time = slot.restoring.lock().await;
        if let SlotState::Down(_) = slot.state() {
            return false; // its log could not be opened
        }
        let store = match self.prepare(slot).await {
            Ok(store) => store,
            Err(reason) => {
                error!(partition = %slot.id, "partition is not serving: {reason}");
                slot.set(SlotState::Down(reason.to_string()));
                return false;
            }
        };
        let partition = match self.start_processor(slot, store).await {
            Ok(partition) => partition,
            Err(err) => {
                slot.set(SlotState::Down(err.to_string()));
                return false;
            }
        };
        match self.lead(&partition).await {
            Ok(()) => {
                slot.set(SlotState::Running(partition));
                true
            }
            Err(reason) => {
                partition.shutdown().await;
                slot.set(SlotState::Down(reason.to_string()));
                false
            }
        }
    }

    /// Brings what this node runs of `slot`'s partition in line with `role`, its role in the
    /// partition table (in a cluster): it leads the partition if placed on it as leader, follows
    /// it (tailing and applying its log, ready to take over) if placed as follower, and stops it
    /// otherwise. A partition that cannot start stays down with the reason and is tried again at
    /// the next call.
    pub async fn reconcile_one(&self, slot: &Slot, role: Role) {
        let _one_at_a_time = slot.restoring.lock().await;
        slot.note_role(role);
        let running = match slot.state() {
            // A processor that stopped (its log was trimmed past its store, say) starts again,
            // restoring first if it must.
            SlotState::Running(partition) => match partition.stopped() {
                None => Some(partition),
                Some(reason) => {
                    warn!(partition = %slot.id, "starting it again: {reason}");
                    partition.shutdown().await;
                    None
                }
            },
            SlotState::Restoring => return,
            _ => None,
        };
        if let Some(partition) = running {
            match role {
                Role::Leader if partition.holds_leadership() => return,
                Role::Follower if !partition.holds_leadership() => return,
                Role::Leader => {
                    // A follower the controller made leader, or a leadership this node gave up
                    // (it was judged dead meanwhile): taken at a new epoch.
                    let started = Instant::now();
                    match self.lead(&partition).await {
                        Ok(()) => {
                            self.led.send_replace(());
                            self.metrics.record_takeover(started.elapsed());
                            info!(
                                partition = %slot.id,
                                took_ms = started.elapsed().as_millis() as u64,
                                "this node now leads it"
                            );
                        }
                        Err(err) => warn!(partition = %slot.id, "cannot lead it: {err}"),
                    }
                    return;
                }
                // Led here, now placed elsewhere (or this node stops following it): stop,
                // and follow again below if it should.
                Role::Follower | Role::None => {
                    if !partition.step_down(STEP_DOWN_DRAIN).await {
                        warn!(
                            partition = %slot.id,
                            "stepped down with writes still unanswered after {} ms: their \
                             callers are told they may or may not have taken effect",
                            STEP_DOWN_DRAIN.as_millis()
                        );
                    }
                    partition.shutdown().await;
                    slot.set(SlotState::Elsewhere);
                }
            }
        }
        if role == Role::None {
            if !matches!(slot.state(), SlotState::Down(_)) {
                slot.set(SlotState::Elsewhere);
            }
            return;
        }
        slot.set(SlotState::Starting);
        let store = match self.prepare(slot).await {
            Ok(store) => store,
            Err(reason) => {
                error!(partition = %slot.id, "partition is not serving: {reason}");
                slot.set(SlotState::Down(reason.to_string()));
                return;
            }
        };
        let partition = match self.start_processor(slot, store).await {
            Ok(partition) => partition,
            Err(err) => {
                slot.set(SlotState::Down(err.to_string()));
                return;
            }
        };
        if role == Role::Leader {
            if let Err(reason) = self.lead(&partition).await {
                partition.shutdown().await;
                slot.set(SlotState::Down(reason.to_string()));
                return;
            }
            info!(partition = %slot.id, "leading");
        }
        slot.set(SlotState::Running(partition));
        if role == Role::Leader {
            self.led.send_replace(());
        }
    }

    /// Hands the leadership of `slot`'s partition, led here at `epoch`, over to `to`, as the
    /// table's handoff asks: once this node no longer leads it (the table's handoff makes its
    /// role a follower's, so [`Partitions::reconcile_one`] stopped it), in one conditional write
    /// naming `to` leader and this node a follower. Returns whether it wrote; `false` while this
    /// node still leads, or when the table no longer asks it.
    ///
    /// Holding the slot's lock, no reconcile is under way that could take the leadership again
    /// between the check and the write; and once the handoff is in the table nobody may take
    /// the leadership, so no leader serves beside `to` once it is named.
    pub async fn hand_off(&self, slot: &Slot, epoch: Epoch, to: &NodeId) -> anyhow::Result<bool> {
        let _one_at_a_time = slot.restoring.lock().await;
        if let SlotState::Running(partition) = slot.state()
            && partition.stopped().is_none()
            && partition.holds_leadership()
        {
            return Ok(false);
        }
        let node = self.node.clone();
        let (written, version) = update_typed::<PartitionTable, bool>(
            self.metadata.as_ref(),
            PartitionTable::KEY,
            "partition table",
            |table| {
                let Some(mut table) = table else {
                    return Change::Keep(false);
                };
                let Some(placement) = table.partitions.get_mut(&slot.id) else {
                    return Change::Keep(false);
                };
                if placement.leader.as_ref() != Some(&node)
                    || placement.handoff.as_ref() != Some(to)
                    || placement.epoch != epoch
                {
                    return Change::Keep(false);
                }
                placement.leader = Some(to.clone());
                placement.handoff = None;
                placement.followers.retain(|f| f != to);
                if !placement.followers.contains(&node) {
                    placement.followers.push(node.clone());
                }
                Change::Write(table, true)
            },
        )
        .await?;
        if written {
            self.table_version
                .store(version.unwrap_or_default(), Ordering::Relaxed);
        }
        Ok(written)
    }

    /// Deletes the local store of `slot`'s partition once the partition table has placed it on
    /// other nodes only for `grace` (a scaling operation moved it away, or others took it over
    /// while this node was judged dead): its data lives on in the log and the snapshots, and
    /// on the nodes that hold it now. A move reverted within `grace` finds the store still here,
    /// and catches up from it. Returns whether it deleted a store.
    pub async fn drop_moved_away(&self, slot: &Slot, grace: std::time::Duration) -> Result<bool> {
        if !slot.placed_elsewhere_for(grace) {
            return Ok(false);
        }
        // As a restore takes them: no compaction and no reconcile runs meanwhile.
        let _no_compaction = slot.compacting.lock().await;
        let _one_at_a_time = slot.restoring.lock().await;
        if !matches!(slot.state(), SlotState::Elsewhere) || !slot.placed_elsewhere_for(grace) {
            return Ok(false);
        }
        let (stores, id) = (self.stores.clone(), slot.id);
        let dropped = blocking(
            id,
            "drop the store of a partition placed elsewhere",
            move || {
                if stores.partition(id).is_none() {
                    return Ok(false);
                }
                stores.drop_partition(id).map(|()| true)
            },
        )
        .await?
        .map_err(|source| Error::Storage {
            partition: id,
            context: "drop the store of a partition placed elsewhere",
            source: source.into(),
        })?;
        if dropped {
            info!(
                partition = %id,
                grace_s = grace.as_secs(),
                "deleted the local store of a partition placed on other nodes only"
            );
        }
        Ok(dropped)
    }

    /// Ends when this node next starts serving a partition as its leader.
    pub async fn led_anew(&self) {
        let mut led = self.led.subscribe();
        if led.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    pub fn slot(&self, id: PartitionId) -> Option<&Slot> {
        self.slots.get(usize::from(id.0))
    }

    pub fn stores(&self) -> &Arc<PartitionStoreManager> {
        &self.stores
    }

    /// Stops every processor this node started, and starts none after.
    pub async fn shutdown(&self) {
        let started = self.started.clone();
        // A start in progress holds the lock for its `Partition::start`: a blocking wait.
        let partitions = tokio::task::spawn_blocking(move || {
            let mut started = started.lock().unwrap_or_else(|p| p.into_inner());
            started.closed = true;
            std::mem::take(&mut started.partitions)
        })
        .await
        .unwrap_or_default();
        for partition in partitions {
            partition.shutdown().await;
        }
    }

    /// Decides how `slot` starts and gets its store ready; `Err` is why it cannot start.
    async fn prepare(&self, slot: &Slot) -> std::result::Result<PartitionStore, NotStarted> {
        let id = slot.id;
        // The repair drops column families and removes folders, and the applied LSN is a RocksDB
        // read: one step on a blocking thread. Nothing appends to the log meanwhile (the processor
        // is not running), so its state may be read after.
        let (stores, staging_root) = (self.stores.clone(), self.staging_root.clone());
        let (existing, applied) = blocking(id, "repair and read the store", move || {
            repair_interrupted_restore(&stores, &staging_root, id)?;
            if let Some(source) = stores.unopened(id) {
                return Err(NotStarted::StoreNotOpened {
                    partition: id,
                    source,
                });
            }
            let existing = stores.partition(id);
            let applied = match &existing {
                Some(store) => store.applied_lsn()?,
                None => Lsn::ZERO,
            };
            Ok::<_, NotStarted>((existing, applied))
        })
        .await??;
        // Asked of the log itself: what this node has seen of a log it has not read lately (a
        // partition it starts to follow) may be far behind, and a snapshot past that would look
        // taken from another log, and a store past it ahead of the log.
        // If the log cannot say (a stream that JetStream answers for only once it has settled),
        // what this node has seen will do: it is never ahead of the log.
        let log = match slot.log.find_tail().await {
            Ok(log) => log,
            Err(err) => {
                warn!(partition = %id, "ask the log where it ends: {err}; going by what this node has seen of it");
                slot.log.state().await.map_err(NotStarted::LogState)?
            }
        };
        let trim_point = log.trim_point;
        if log.tail < applied {
            // Checked before the processor starts and anything is appended: the next append
            // would get an LSN the store already applied, with a different record.
            return Err(Error::StoreAheadOfLog {
                partition: id,
                applied,
                tail: log.tail,
            }
            .into());
        }
        let gap = trim_point > applied;
        if let (Some(store), false) = (&existing, gap) {
            return Ok(store.clone());
        }
        if gap {
            warn!(
                partition = %id,
                %applied,
                %trim_point,
                "the log is trimmed past what the store holds: restoring from a snapshot"
            );
        }
        if gap || self.policy.restores_on_init(self.cluster) {
            match self.restore_store(slot, log, None, None).await {
                Ok(_) => {
                    return self
                        .stores
                        .partition(id)
                        .ok_or(NotStarted::NoStoreAfterRestore(id));
                }
                Err(err) if gap => {
                    return Err(NotStarted::Gap {
                        partition: id,
                        trim_point,
                        applied,
                        source: err,
                    });
                }
                Err(err) => {
                    warn!(partition = %id, "no snapshot restored ({err}); the log is complete, so the partition replays it from the start");
                }
            }
        }
        let stores = self.stores.clone();
        Ok(blocking(id, "create the store", move || {
            stores.open_or_create_partition(id)
        })
        .await??)
    }

    /// Restores `slot`'s store from the repository; the processor must not be running.
    async fn restore_store(
        &self,
        slot: &Slot,
        log: cairn_log::LogState,
        pinned: Option<SnapshotId>,
        on_progress: Option<RestoreProgressFn>,
    ) -> Result<Restored> {
        let restorer = self.restorer.as_ref().ok_or_else(|| Error::Restore {
            partition: slot.id,
            failure: RestoreFailure::Unable(
                "this node has no snapshot repository (worker.snapshots.destination = \"none\")"
                    .into(),
            ),
        })?;
        let started = Instant::now();
        let result = restorer
            .restore(&self.stores, slot.id, log, pinned, on_progress)
            .await;
        match &result {
            Ok(restored) => {
                self.metrics
                    .record_restore(slot.id, restored.bytes, started.elapsed());
                info!(
                    partition = %slot.id,
                    snapshot_id = %restored.snapshot_id,
                    lsn = %restored.min_applied_lsn,
                    files = restored.files,
                    bytes = restored.bytes,
                    download_ms = restored.download.as_millis() as u64,
                    import_ms = restored.import.as_millis() as u64,
                    "Restored partition from snapshot; replaying the log from LSN {}",
                    restored.min_applied_lsn.next()
                );
            }
            Err(_) => self.metrics.record_failure(slot.id, "restore"),
        }
        result
    }

    /// Starts `slot`'s processor on `store`, unless the node is shutting down. Starting reads the
    /// store's applied LSN and leader, so it runs on a blocking thread (which hands the
    /// processor to the apply pool), and records the processor for [`Partitions::shutdown`] there, so
    /// that a caller that gives up meanwhile leaves none unrecorded.
    async fn start_processor(&self, slot: &Slot, store: PartitionStore) -> Result<Arc<Partition>> {
        let (id, key_range, node, log, clock) = (
            slot.id,
            slot.key_range,
            self.node.clone(),
            slot.log.clone(),
            self.clock.clone(),
        );
        let started = self.started.clone();
        blocking(id, "start the processor", move || {
            let mut started = started.lock().unwrap_or_else(|p| p.into_inner());
            if started.closed {
                return Err(Error::Stopped {
                    partition: id,
                    reason: "the node is shutting down".into(),
                });
            }
            let partition = Partition::start(key_range, node, store, log, clock)?;
            // Those shut down since (a restore, a move elsewhere) need no waiting for.
            started.partitions.retain(|p| !p.has_shut_down());
            started.partitions.push(partition.clone());
            Ok(partition)
        })
        .await
        .and_then(|partition| partition)
        .inspect(|partition| {
            if self.cluster {
                partition.set_fence(leadership_fence(self.metadata.clone(), self.node.clone()));
            }
        })
    }

    /// Makes this node the leader of `partition` at an epoch newer than any seen, and waits until
    /// it has replayed its log up to the announcement. `Err` says why it does not lead.
    async fn lead(&self, partition: &Partition) -> std::result::Result<(), NotLeading> {
        let seen = partition
            .status()
            .await
            .leader
            .map(|l| l.epoch)
            .unwrap_or_default();
        // Granted before the table names this epoch: if this node is judged dead in between,
        // the grant is already given up and the leadership never serves.
        let lease = self.lease.as_ref().map(|lease| {
            Arc::new(crate::cluster::Lease(lease.grant())) as Arc<dyn cairn_worker::LeaderLease>
        });
        let epoch = self
            .epochs
            .take(
                self.metadata.as_ref(),
                &self.node,
                partition.id(),
                seen,
                self.cluster,
            )
            .await
            .map(|(version, epoch)| {
                self.table_version.store(version, Ordering::Relaxed);
                epoch
            })
            .map_err(NotLeading::Record)?;
        let started = Instant::now();
        let from = partition.applied_lsn();
        let led = match lease {
            Some(lease) => partition.become_leader_under(epoch, lease).await,
            None => partition.become_leader(epoch).await,
        };
        if let Err(err) = led {
            error!(partition = %partition.id(), "partition is not serving: {err}");
            return Err(NotLeading::Worker(err));
        }
        let to = partition.applied_lsn();
        if to.0 > from.0 + 1 {
            info!(
                partition = %partition.id(),
                records = to.0 - from.0,
                replay_ms = started.elapsed().as_millis() as u64,
                "caught up with the log: applied LSN {from} → {to}"
            );
        }
        Ok(())
    }

    /// Rebuilds `id`'s store from a snapshot (the newest suitable, or `pinned`) while it serves
    /// nothing, then replays its log and leads it again. If no snapshot can be restored, the
    /// partition goes back to its old store when it still has one that the log can continue.
    pub async fn restore(
        &self,
        id: PartitionId,
        pinned: Option<SnapshotId>,
        on_progress: Option<RestoreProgressFn>,
    ) -> Result<(Restored, Lsn)> {
        let slot = self.slot(id).ok_or_else(|| Error::Restore {
            partition: id,
            failure: RestoreFailure::Unable("no such partition".into()),
        })?;
        let _no_compaction = slot.compacting.lock().await;
        let _one_at_a_time = slot.restoring.lock().await;
        // A partition in the one database that an older store shares among all its partitions
        // cannot be replaced once RocksDB stopped that database: it would refuse the column
        // family's drop and the import, and the restore would only take down a partition that
        // still serves reads. (A partition with a database of its own always can: the restore
        // replaces that database whole.)
        let stores = self.stores.clone();
        if let Err(err) = blocking(id, "check the store takes writes", move || {
            stores.check_writable(id)
        })
        .await?
        {
            return Err(Error::Restore {
                partition: id,
                failure: RestoreFailure::Unable(format!(
                    "the partition's store is in the one database that a store written by an \
                     older Cairn shares among its partitions, and that database refuses every \
                     write ({err}): RocksDB stopped it on that error, so a restore could not \
                     import its snapshot. Nothing was changed. Restart the node (each partition \
                     replays its log over what the store lost), then restore the partition; \
                     the restore gives it a database of its own"
                )),
            });
        }
        let previous = slot.state();
        slot.set(SlotState::Restoring);
        if let SlotState::Running(partition) = &previous {
            partition.shutdown().await;
        }
        let log = match slot.log.find_tail().await {
            Ok(state) => state,
            Err(err) => {
                let err = Error::Restore {
                    partition: id,
                    failure: RestoreFailure::Failed {
                        context: "read the log's state",
                        source: err.into(),
                    },
                };
                self.resume_after_failed_restore(slot, previous, &err).await;
                return Err(err);
            }
        };
        let restored = match self
            .restore_store(slot, log, pinned, on_progress.clone())
            .await
        {
            Ok(restored) => restored,
            Err(err) => {
                self.resume_after_failed_restore(slot, previous, &err).await;
                return Err(err);
            }
        };
        let Some(store) = self.stores.partition(id) else {
            let reason = "the store vanished after its restore; restart the node".to_string();
            slot.set(SlotState::Down(reason.clone()));
            return Err(Error::Restore {
                partition: id,
                failure: RestoreFailure::Unable(reason),
            });
        };
        let partition = match self.start_processor(slot, store).await {
            Ok(partition) => partition,
            Err(err) => {
                slot.set(SlotState::Down(err.to_string()));
                return Err(err);
            }
        };
        // The slot stays `Restoring` through the replay: until the partition leads again its
        // requests would only meet "not the leader".
        if let Some(progress) = &on_progress {
            let to = slot.log.state().await.map(|l| l.tail).unwrap_or_default();
            progress(RestoreStep::Replaying {
                from: restored.min_applied_lsn.next(),
                to,
            });
        }
        if let Err(err) = self.lead(&partition).await {
            let reason = format!("restored, but could not take the partition's leadership: {err}");
            partition.shutdown().await;
            slot.set(SlotState::Down(reason));
            return Err(Error::Restore {
                partition: id,
                failure: RestoreFailure::Failed {
                    context: "restored, but could not take the partition's leadership",
                    source: err.into(),
                },
            });
        }
        slot.set(SlotState::Running(partition.clone()));
        let applied = partition.applied_lsn();
        Ok((restored, applied))
    }

    /// After a failed online restore: the old store, if there is one without a gap, serves again;
    /// otherwise the partition is down with the error.
    async fn resume_after_failed_restore(&self, slot: &Slot, previous: SlotState, err: &Error) {
        let store = self.stores.partition(slot.id);
        let resumable = match (&previous, &store) {
            (SlotState::Running(_), Some(store)) => match slot.log.state().await {
                Ok(log) => {
                    let store = store.clone();
                    blocking(slot.id, "read the applied LSN", move || store.applied_lsn())
                        .await
                        .is_ok_and(|applied| applied.is_ok_and(|a| log.trim_point <= a))
                }
                Err(_) => false,
            },
            _ => false,
        };
        if let (true, Some(store)) = (resumable, store) {
            match self.start_processor(slot, store).await {
                Ok(partition) => {
                    match self.lead(&partition).await {
                        Ok(()) => slot.set(SlotState::Running(partition)),
                        Err(e) => {
                            warn!(partition = %slot.id, "resume after a failed restore: {e}");
                            partition.shutdown().await;
                            slot.set(SlotState::Down(format!(
                                "{err}; resuming the old store failed too: {e}; restart the node"
                            )));
                        }
                    }
                    return;
                }
                Err(e) => {
                    slot.set(SlotState::Down(e.to_string()));
                    return;
                }
            }
        }
        match previous {
            SlotState::Down(reason) => slot.set(SlotState::Down(reason)),
            _ => slot.set(SlotState::Down(err.to_string())),
        }
    }
}

/// Why a partition whose store could not be opened (a file of it is damaged or missing) is down,
/// and what to do.
fn unopened_store_reason(id: PartitionId, err: &cairn_partition_store::Error) -> String {
    let folder = err.path().unwrap_or("its folder");
    format!(
        "its store cannot be opened: a file of it is damaged or missing ({err}). Nothing was \
         deleted, and the partition stays down while the node's other partitions serve. \
         `cairnctl -y partitions restore -p {id}` replaces the store with the newest sound \
         snapshot and the log after it (to keep the damaged files, move {folder} out of the \
         store's folder first); with no snapshot, stop the node, run `cairn drop-partition -p \
         {id}` and start it again: the partition replays its log"
    )
}

/// Why a partition whose log could not be opened is down, and what to do.
fn unopened_log_reason(id: PartitionId, err: &cairn_log::Error) -> String {
    match err {
        cairn_log::Error::Corrupt {
            path,
            offset: Some(offset),
            ..
        } if !err
            .to_string()
            .contains(cairn_log::local::EVERY_LOG_REFUSED) =>
        {
            format!(
                "its log cannot be opened: {err}. The records from that offset on are kept, not \
             dropped, and the partition stays down while the node's other partitions serve. To \
             mend this log alone, stop the node and run `cairn repair-log -p {id}`: it moves the \
             log's trim point past the damage when a snapshot covers it (nothing is lost), or \
             else cuts this log after its last valid record, giving up its records from there on \
             and none of the other partitions' (a copy of the file is kept)"
            )
        }
        cairn_log::Error::Corrupt {
            path,
            offset: Some(offset),
            ..
        } => format!(
            "its log cannot be opened: {err}. The records from that offset on are kept, not \
             dropped, and the partition stays down while the node's other partitions serve. Keep \
             a copy of {path}; to give up the records from that offset on, cut the file there \
             (`truncate -s {offset} {path}`) and restart the node (if the store had applied \
             records past the cut, it then asks for `cairnctl partitions restore -p {id}`). The \
             file is shared by every partition's log: cutting it also gives up the other \
             partitions' records after that offset in it, and those partitions then ask for a \
             restore too"
        ),
        // A missing or misnamed segment, or a bad trim point: no offset to cut at.
        // (`path` is where the log resumes when records are missing: not the file to put back.)
        cairn_log::Error::Corrupt { .. } => format!(
            "its log cannot be opened: {err}. Nothing was deleted, and the partition stays down \
             while the node's other partitions serve. Put the files this names as gone or \
             damaged back from a backup and restart the node; the segment files are shared by \
             every partition's log, so moving them away would take records from the other \
             partitions too. With no backup, and for records that are missing, stop the node \
             and run `cairn repair-log -p {id}` to give up this log's records from the first \
             missing one on (or fewer, when a snapshot covers them), keeping the other \
             partitions'"
        ),
        _ => format!(
            "its log cannot be opened: {err}; fix the cause and restart the node (the other \
             partitions serve meanwhile)"
        ),
    }
}

/// Stands in for a log that could not be opened: every call fails with why, so its partition
/// stays down and reports the reason while the node's other partitions serve.
struct UnopenedLog {
    log_id: cairn_types::LogId,
    error: Arc<cairn_log::Error>,
}

impl UnopenedLog {
    fn error(&self) -> cairn_log::Error {
        cairn_log::Error::NotOpened {
            log_id: self.log_id,
            source: self.error.clone(),
        }
    }
}

#[tonic::async_trait]
impl Loglet for UnopenedLog {
    fn log_id(&self) -> cairn_types::LogId {
        self.log_id
    }

    /// Every append fails with why the log is not open, whatever its size.
    fn record_bytes_max(&self) -> usize {
        usize::MAX
    }

    async fn append(&self, _payloads: Vec<bytes::Bytes>) -> cairn_log::Result<Lsn> {
        Err(self.error())
    }

    async fn read(
        &self,
        _from: Lsn,
        _max_records: usize,
    ) -> cairn_log::Result<Vec<cairn_log::Entry>> {
        Err(self.error())
    }

    async fn wait_for_tail(&self, _lsn: Lsn) -> cairn_log::Result<()> {
        Err(self.error())
    }

    async fn trim(&self, _up_to: Lsn) -> cairn_log::Result<()> {
        Err(self.error())
    }

    async fn state(&self) -> cairn_log::Result<cairn_log::LogState> {
        Err(self.error())
    }
}

/// Records this node as leader of `partition` at an epoch newer than any the table or its store
/// (`seen`) know, so that records of any earlier incarnation are fenced. Returns the table's new
/// version and the epoch. In a `cluster`, only if the table places the partition's leadership on
/// this node.
/// A cluster node's fence on deletions (see [`cairn_worker::LeadershipFence`]): the partition
/// table, read afresh from the metadata store, must still name this node the leader at the epoch
/// the deletion acts under. A table that cannot be read fences too.
fn leadership_fence(
    metadata: Arc<dyn MetadataStore>,
    node: NodeId,
) -> cairn_worker::LeadershipFence {
    Arc::new(move |partition, epoch| {
        let (metadata, node) = (metadata.clone(), node.clone());
        Box::pin(async move {
            let table =
                get_typed::<PartitionTable>(&*metadata, PartitionTable::KEY, "partition table")
                    .await
                    .map_err(|err| {
                        cairn_types::Fenced::new(format!(
                            "the partition table could not be read to confirm the leadership: {err}"
                        ))
                    })?;
            let placement = table.and_then(|(_, table)| table.partitions.get(&partition).cloned());
            match placement {
                Some(p) if p.leader.as_ref() == Some(&node) && p.epoch == epoch => Ok(()),
                Some(p) => Err(cairn_types::Fenced::new(format!(
                    "node {node} acts at epoch {epoch}, but the partition table names {} at epoch {}",
                    p.leader
                        .map_or("no leader".to_string(), |n| format!("node {n}")),
                    p.epoch
                ))),
                None => Err(cairn_types::Fenced::new(
                    "the partition table does not place the partition",
                )),
            }
        })
    })
}

/// One partition's ask to lead it: the epoch its processor has seen, and where the answer goes.
struct LeadAsk {
    partition: PartitionId,
    seen: Epoch,
    answer: tokio::sync::oneshot::Sender<anyhow::Result<(u64, Epoch)>>,
}

/// Raises the epochs of the partitions this node is to lead, in one write of the partition
/// table for all the asks that meet: a failover hands a node every partition of a dead leader at
/// once, and a compare-and-swap each on the one table key would collide and back off in turn
/// (the last of 8 took its leadership some 150 ms after the first).
#[derive(Default)]
struct EpochRaiser {
    asks: std::sync::Mutex<Vec<LeadAsk>>,
    /// Held by the one write under way; the asks that arrive meanwhile go in the next.
    writing: tokio::sync::Mutex<()>,
}

impl EpochRaiser {
    /// Names this node leader of `partition` in the table at an epoch past both the table's and
    /// `seen`; the table's version after the write, and the epoch. In a cluster, refused unless
    /// the controller placed the leadership here.
    async fn take(
        &self,
        metadata: &dyn MetadataStore,
        node: &NodeId,
        partition: PartitionId,
        seen: Epoch,
        cluster: bool,
    ) -> anyhow::Result<(u64, Epoch)> {
        let (answer, mut answered) = tokio::sync::oneshot::channel();
        self.asks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(LeadAsk {
                partition,
                seen,
                answer,
            });
        let _writing = self.writing.lock().await;
        // The write before may have carried this ask: it answers before it lets go.
        if let Ok(answer) = answered.try_recv() {
            return answer;
        }
        let asks = std::mem::take(&mut *self.asks.lock().unwrap_or_else(|p| p.into_inner()));
        let wanted: Vec<(PartitionId, Epoch)> =
            asks.iter().map(|ask| (ask.partition, ask.seen)).collect();
        match take_leaderships(metadata, node, &wanted, cluster).await {
            Ok(answers) => {
                for (ask, taken) in asks.into_iter().zip(answers) {
                    let _ = ask.answer.send(taken);
                }
            }
            Err(err) => {
                let err = Arc::new(err);
                for ask in asks {
                    let _ = ask.answer.send(Err(anyhow::Error::new(err.clone())));
                }
            }
        }
        answered.await.unwrap_or_else(|_| {
            Err(anyhow::anyhow!(
                "the table write that carried the ask ended"
            ))
        })
    }
}

/// One compare-and-swap of the table that names this node leader of each of `wanted` (a
/// partition, and the epoch its processor has seen) at a new epoch; per partition, the table's
/// version after the write and its epoch, or why not.
async fn take_leaderships(
    metadata: &dyn MetadataStore,
    node: &NodeId,
    wanted: &[(PartitionId, Epoch)],
    cluster: bool,
) -> Result<Vec<anyhow::Result<(u64, Epoch)>>, cairn_metadata::Error> {
    let (taken, version) = update_typed::<PartitionTable, Vec<anyhow::Result<Epoch>>>(
        metadata,
        PartitionTable::KEY,
        "partition table",
        |table| {
            let mut table = table.unwrap_or_default();
            let mut changed = false;
            let answers = wanted
                .iter()
                .map(|&(partition, seen)| {
                    let placement =
                        table
                            .partitions
                            .entry(partition)
                            .or_insert(PartitionPlacement {
                                leader: None,
                                epoch: Default::default(),
                                followers: Vec::new(),
                                handoff: None,
                            });
                    if let Some(to) = &placement.handoff
                        && cluster
                    {
                        return Err(anyhow::anyhow!(
                            "its leader is handing it over to node {to}"
                        ));
                    }
                    if cluster && placement.leader.as_ref() != Some(node) {
                        return Err(anyhow::anyhow!(
                            "the controller placed its leadership on {}",
                            placement
                                .leader
                                .as_ref()
                                .map_or("no node yet".to_string(), |n| format!("node {n}"))
                        ));
                    }
                    let epoch = Epoch(placement.epoch.max(seen).0 + 1);
                    placement.epoch = epoch;
                    placement.leader = Some(node.clone());
                    changed = true;
                    Ok(epoch)
                })
                .collect();
            if changed {
                Change::Write(table, answers)
            } else {
                Change::Keep(answers)
            }
        },
    )
    .await?;
    let version = version.unwrap_or_default();
    Ok(taken
        .into_iter()
        .map(|epoch| epoch.map(|epoch| (version, epoch)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_metadata::local::LocalMetadataStore;

    fn store(dir: &tempfile::TempDir) -> Arc<dyn MetadataStore> {
        Arc::new(LocalMetadataStore::open(&dir.path().join("metadata")).unwrap())
    }

    /// Asks `partitions` of `raiser` at once, as a failover does, and returns the answers.
    async fn ask_together(
        raiser: &Arc<EpochRaiser>,
        metadata: &Arc<dyn MetadataStore>,
        partitions: &[u16],
        cluster: bool,
    ) -> Vec<anyhow::Result<(u64, Epoch)>> {
        // Held, so that every ask is queued before a write starts.
        let writing = raiser.writing.lock().await;
        let asks: Vec<_> = partitions
            .iter()
            .map(|&p| {
                let (raiser, metadata) = (raiser.clone(), metadata.clone());
                tokio::spawn(async move {
                    let node = NodeId("n1".into());
                    raiser
                        .take(metadata.as_ref(), &node, PartitionId(p), Epoch(0), cluster)
                        .await
                })
            })
            .collect();
        while raiser.asks.lock().unwrap().len() < partitions.len() {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        drop(writing);
        let mut answers = Vec::new();
        for ask in asks {
            answers.push(ask.await.unwrap());
        }
        answers
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leaderships_asked_together_are_taken_in_one_table_write() {
        let dir = tempfile::tempdir().unwrap();
        let metadata = store(&dir);
        let raiser = Arc::new(EpochRaiser::default());
        let answers = ask_together(&raiser, &metadata, &[0, 1, 2, 3, 4, 5, 6, 7], false).await;
        let taken: Vec<(u64, Epoch)> = answers.into_iter().map(Result::unwrap).collect();
        assert!(
            taken.iter().all(|&(_, epoch)| epoch == Epoch(1)),
            "{taken:?}"
        );
        assert!(
            taken.iter().all(|&(version, _)| version == taken[0].0),
            "not one write: {taken:?}"
        );
        let (version, table) =
            get_typed::<PartitionTable>(metadata.as_ref(), PartitionTable::KEY, "partition table")
                .await
                .unwrap()
                .unwrap();
        assert_eq!(version, taken[0].0);
        for p in 0..8 {
            let placement = &table.partitions[&PartitionId(p)];
            assert_eq!(placement.leader, Some(NodeId("n1".into())));
            assert_eq!(placement.epoch, Epoch(1));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_leadership_does_not_hold_back_the_others_taken_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let metadata = store(&dir);
        let placed = |node: &str| PartitionPlacement {
            leader: Some(NodeId(node.into())),
            epoch: Epoch(4),
            followers: Vec::new(),
            handoff: None,
        };
        let mut table = PartitionTable::default();
        table.partitions.insert(PartitionId(0), placed("n2"));
        table.partitions.insert(PartitionId(1), placed("n1"));
        cairn_metadata::put_typed(
            metadata.as_ref(),
            PartitionTable::KEY,
            &table,
            cairn_metadata::Precondition::DoesNotExist,
        )
        .await
        .unwrap();
        let raiser = Arc::new(EpochRaiser::default());
        let mut answers = ask_together(&raiser, &metadata, &[0, 1], true).await;
        let (_, epoch) = answers.pop().unwrap().unwrap();
        assert_eq!(epoch, Epoch(5));
        let refused = answers.pop().unwrap().unwrap_err().to_string();
        assert!(
            refused.contains("placed its leadership on node n2"),
            "{refused}"
        );
    }
}
