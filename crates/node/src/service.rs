//! The gRPC services: translate requests into partition calls and worker errors into statuses.
//!
//! Work that takes longer than a request timeout runs in tasks of the node's own and streams its
//! progress: a restore and a snapshot publish go on if their caller goes away (stopping halfway
//! would only waste what was done), an export stops (its tar is for that caller alone).

use crate::node::NodeState;
use crate::partitions::Slot;
use crate::validate;
use bytes::Bytes;
use cairn_api::v1;
use cairn_partition_store::{StoredValue, WriteStall};
use cairn_snapshots::SnapshotId;
use cairn_types::keys::partition_for_key;
use cairn_types::limits::{BATCH_BYTES_MAX, VALUE_BYTES_MAX};
use cairn_types::record::{PutEntry, WriteOp};
use cairn_types::{Lsn, PartitionId, partition_key};
use cairn_worker::{Partition, RestoreStep, SnapshotProducer};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tonic::{Request, Response, Status};

/// How long a node keeps sending again a share of a request it took from a client that was
/// refused with nothing done (the partition's leadership is changing): long enough to cover a
/// failover (about the node timeout), and shorter than a client's request timeout (13 s).
const RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(10);
/// The pause before the first retry; it doubles up to [`RETRY_PAUSE_MAX`].
const RETRY_PAUSE_FIRST: std::time::Duration = std::time::Duration::from_millis(50);
const RETRY_PAUSE_MAX: std::time::Duration = std::time::Duration::from_millis(250);

/// Whether a failure with `code` says that nothing of the request was done, so that sending it
/// again is safe: refused (`UNAVAILABLE`: not the leader now, or the log refused the append),
/// or fenced (`ABORTED`: the record was skipped).
pub(crate) fn nothing_done(code: tonic::Code) -> bool {
    matches!(code, tonic::Code::Unavailable | tonic::Code::Aborted)
}

/// Whether a failure with `code` leaves the outcome unknown: the request may have taken effect.
pub(crate) fn outcome_unknown(code: tonic::Code) -> bool {
    matches!(code, tonic::Code::DeadlineExceeded | tonic::Code::Unknown)
}

/// A call's per-key answers as its response: the answers of the keys that took effect, and the
/// others' failures grouped by what happened (same code and message). The whole call fails only
/// when nothing was done (every key refused) or nothing is known (every key's outcome unknown);
/// then with the first key's failure. A key that failed answers `T::default()` in the response.
fn per_key<T: Default>(
    answers: Vec<Result<T, Status>>,
) -> Result<(Vec<T>, Vec<v1::ShareFailure>), Status> {
    let failed = answers.iter().filter(|a| a.is_err()).count();
    if failed == answers.len() && failed > 0 {
        let all_unknown = answers
            .iter()
            .all(|a| a.as_ref().is_err_and(|s| outcome_unknown(s.code())));
        let none_unknown = !answers
            .iter()
            .any(|a| a.as_ref().is_err_and(|s| outcome_unknown(s.code())));
        if all_unknown || none_unknown {
            let first = answers.into_iter().find_map(Result::err);
            return Err(first.unwrap_or_else(|| Status::internal("no answer")));
        }
    }
    let mut values = Vec::with_capacity(answers.len());
    let mut failures: Vec<v1::ShareFailure> = Vec::new();
    for (index, answer) in answers.into_iter().enumerate() {
        match answer {
            Ok(value) => values.push(value),
            Err(status) => {
                values.push(T::default());
                let code = status.code() as i32;
                match failures
                    .iter_mut()
                    .find(|f| f.code == code && f.message == status.message())
                {
                    Some(failure) => failure.indices.push(index as u32),
                    None => failures.push(v1::ShareFailure {
                        indices: vec![index as u32],
                        code,
                        message: status.message().to_string(),
                    }),
                }
            }
        }
    }
    Ok((values, failures))
}

/// A write forwarded to `address` whose partition moved to another leader before it answered:
/// the old leader may have logged it before it lost the leadership, so its outcome is unknown.
fn moved_in_flight(pid: PartitionId, address: &str) -> Status {
    Status::deadline_exceeded(format!(
        "partition {pid}: the outcome is unknown: its leadership moved away from {address} while \
         the write was there; it may or may not take effect: read the keys to know"
    ))
}

fn status_of(err: cairn_worker::Error) -> Status {
    use cairn_worker::Error as E;
    match &err {
        E::NotLeader { .. } | E::Stopped { .. } | E::LeaseLapsed { .. } | E::TooStale { .. } => {
            Status::unavailable(err.to_string())
        }
        // Not worth a blind retry: it may have taken effect.
        E::Undecided { .. } | E::LapsedInFlight { .. } => {
            Status::deadline_exceeded(err.to_string())
        }
        // The record was skipped, so nothing happened: the caller may retry.
        E::Fenced { .. } => Status::aborted(err.to_string()),
        E::TrimRefused { .. } => Status::failed_precondition(err.to_string()),
        // An unreachable repository is worth a retry; anything else needs an operator.
        E::Restore { .. } if err.is_repository_unavailable() => {
            Status::unavailable(err.to_string())
        }
        E::Restore { .. } => Status::failed_precondition(err.to_string()),
        E::Snapshot { .. } if err.is_repository_unavailable() => {
            Status::unavailable(err.to_string())
        }
        E::Snapshot { source, .. } => match source.downcast_ref::<cairn_log::Error>() {
            Some(log) => log_status(log, err.to_string()),
            None => Status::internal(err.to_string()),
        },
        // A full disk under the store (say, while a snapshot flushes it) is worth a retry once
        // space is freed.
        E::Storage { source, .. }
            if source
                .downcast_ref::<cairn_partition_store::Error>()
                .is_some_and(|e| e.is_disk_full()) =>
        {
            Status::resource_exhausted(err.to_string())
        }
        E::Storage { .. } => Status::internal(err.to_string()),
        E::Log { source, .. } => log_status(source, err.to_string()),
        // Needs an operator (restore, or accept the loss); retrying does not help.
        E::StoreAheadOfLog { .. } => Status::failed_precondition(err.to_string()),
        E::TimedOut { .. } => Status::unavailable(err.to_string()),
        E::StoreDiskFull { .. } => Status::resource_exhausted(err.to_string()),
        E::AnswerTooLarge { .. } => Status::invalid_argument(err.to_string()),
        E::StoreDamaged { .. } => Status::data_loss(err.to_string()),
    }
}

/// A log error's status by what the caller can do about it: a full disk is worth a retry once
/// space is freed, trimmed records never come back.
fn log_status(source: &cairn_log::Error, message: String) -> Status {
    use cairn_log::Error as L;
    if source.is_disk_full() {
        return Status::resource_exhausted(message);
    }
    match source {
        L::Trimmed { .. } => Status::failed_precondition(message),
        L::RecordTooLarge { .. } | L::BatchTooLarge { .. } => Status::invalid_argument(message),
        // Worth a retry: NATS answers again, or the next append finds the tail where it is.
        L::Shutdown { .. }
        | L::NotOpened { .. }
        | L::Nats { .. }
        | L::Connect { .. }
        | L::TailMoved { .. } => Status::unavailable(message),
        // Not worth a blind retry: it may have been written.
        L::OutcomeUnknown { .. } => Status::deadline_exceeded(message),
        L::Corrupt { .. } => Status::data_loss(message),
        L::Io { .. } | L::DiskFull { .. } => Status::internal(message),
    }
}

/// An insert-if-absent's answer from each key's, as [`per_key`] gives it; with `partial`, keys
/// refused with `UNAVAILABLE` (nothing was done) are answered apart in `refused`, so that a
/// client that routes by itself sends only them again.
fn insert_answer(
    answers: Vec<Result<bool, Status>>,
    partial: bool,
) -> Result<v1::InsertIfAbsentResponse, Status> {
    let mut response = v1::InsertIfAbsentResponse::default();
    let answers = answers
        .into_iter()
        .enumerate()
        .map(|(index, answer)| match answer {
            Err(status) if partial && status.code() == tonic::Code::Unavailable => {
                if response.refused.is_empty() {
                    response.refused_reason = status.message().to_string();
                }
                response.refused.push(index as u32);
                Ok(false)
            }
            answer => answer,
        })
        .collect();
    let (inserted, failures) = per_key(answers)?;
    response.inserted = inserted;
    response.failures = failures;
    Ok(response)
}

fn snapshot_status(err: cairn_snapshots::Error) -> Status {
    use cairn_snapshots::Error as E;
    match &err {
        E::InvalidSnapshotId { .. } => Status::invalid_argument(err.to_string()),
        E::SnapshotNotFound { .. } | E::SnapshotOfAnotherCluster { .. } => {
            Status::not_found(err.to_string())
        }
        E::BadFile { .. }
        | E::MetadataMissing { .. }
        | E::MalformedMetadata { .. }
        | E::UndecodableMetadata { .. }
        | E::TooLarge { .. }
        | E::SnapshotNotFoundInReadable { .. } => Status::data_loss(err.to_string()),
        E::UnsupportedVersion { .. } => Status::failed_precondition(err.to_string()),
        E::ObjectStore { .. } => Status::unavailable(err.to_string()),
        _ => Status::internal(err.to_string()),
    }
}

/// A snapshot id as a request carries it (bytes, so that one that is not UTF-8 arrives here and
/// is refused as the caller's mistake).
fn parse_snapshot_id(input: impl AsRef<[u8]>) -> Result<SnapshotId, Status> {
    let text = std::str::from_utf8(input.as_ref()).map_err(|_| {
        Status::invalid_argument(format!(
            "snapshot id {:?} is not UTF-8; `cairnctl snapshots list` shows the ids",
            String::from_utf8_lossy(input.as_ref())
        ))
    })?;
    text.trim()
        .parse()
        .map_err(|e: cairn_snapshots::Error| Status::invalid_argument(e.to_string()))
}

/// Passes the messages of a call forwarded to another node on to `send` (which says whether
/// its caller is still there), until either side ends.
async fn relay<T, F, Fut>(mut stream: tonic::Streaming<T>, send: F)
where
    F: Fn(Result<T, Status>) -> Fut,
    Fut: Future<Output = bool>,
{
    loop {
        let message = match stream.message().await {
            Ok(Some(message)) => Ok(message),
            Ok(None) => return,
            Err(status) => Err(status),
        };
        let failed = message.is_err();
        if !send(message).await || failed {
            return;
        }
    }
}

fn rfc3339(time: std::time::SystemTime) -> String {
    humantime::format_rfc3339_millis(time).to_string()
}

/// Indices of the request's keys, grouped by the partition that owns them.
fn group_by_partition<'a>(
    keys: impl Iterator<Item = &'a [u8]>,
    num_partitions: u16,
) -> BTreeMap<PartitionId, Vec<usize>> {
    let mut groups: BTreeMap<PartitionId, Vec<usize>> = BTreeMap::new();
    for (index, key) in keys.enumerate() {
        let pid = partition_for_key(partition_key(key), num_partitions);
        groups.entry(pid).or_default().push(index);
    }
    groups
}

pub(crate) struct KeyValueService {
    state: Arc<NodeState>,
}

/// What a read answers.
#[derive(Clone, Copy)]
enum Answer {
    /// The values (and their expiries, if asked), refused once they add up to more than
    /// `bytes_max` bytes.
    Values { bytes_max: usize, with_expiry: bool },
    /// Only whether each key exists: no bound, and no value crosses between nodes.
    Presence,
}

/// How fresh a read's answer must be (`max_staleness_ms` of the request).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Freshness {
    /// The default: linearizable, each key answered by its leader under its lease.
    Linearizable,
    /// Any replica of a key's partition on this node may answer, if it can show that it holds
    /// every write acknowledged this long ago (see `Partition::bounded_read_share`).
    AtMostStale(std::time::Duration),
}

impl Freshness {
    fn of_request(max_staleness_ms: Option<u64>) -> Freshness {
        match max_staleness_ms {
            None => Freshness::Linearizable,
            Some(ms) => Freshness::AtMostStale(std::time::Duration::from_millis(ms)),
        }
    }

    /// The request field that asks for it, for a forwarded read.
    pub(crate) fn max_staleness_ms(self) -> Option<u64> {
        match self {
            Freshness::Linearizable => None,
            Freshness::AtMostStale(max) => Some(max.as_millis().try_into().unwrap_or(u64::MAX)),
        }
    }
}

impl Answer {
    fn bytes_max(self) -> usize {
        match self {
            Answer::Values { bytes_max, .. } => bytes_max,
            Answer::Presence => usize::MAX,
        }
    }
}

/// Where the routes say a partition is led: the one lookup every call routed in a cluster goes
/// through (the data calls by [`KeyValueService::target`], which also checks that a local leader
/// serves; the admin calls by [`AdminService::leader_elsewhere`]).
enum LeaderRoute {
    Here,
    At {
        node: cairn_types::NodeId,
        address: String,
    },
}

/// [`LeaderRoute`] of `id`, or why no leader can be named (refused: retry shortly).
fn leader_route(state: &NodeState, id: PartitionId) -> Result<LeaderRoute, Status> {
    match state.routes.current().leader(id) {
        Some((leader, _)) if *leader == state.node => Ok(LeaderRoute::Here),
        Some((leader, Some(address))) => Ok(LeaderRoute::At {
            node: leader.clone(),
            address: address.clone(),
        }),
        Some((leader, None)) => Err(Status::unavailable(format!(
            "partition {id} is led by node {leader}, whose address this node does not know yet; retry shortly"
        ))),
        None => Err(Status::unavailable(format!(
            "partition {id} has no leader yet: the cluster is waiting for cluster.initial-nodes nodes to join, or is placing it; retry shortly"
        ))),
    }
}

/// Who serves one partition's share of a request.
enum Target {
    Local(Arc<Partition>),
    /// The leader, on another node at this address.
    Remote(String),
}

impl KeyValueService {
    pub fn new(state: Arc<NodeState>) -> Self {
        KeyValueService { state }
    }

    /// Where `id`'s share of a request goes. Alone, a node serves every partition itself (or
    /// says why it cannot). In a cluster, the partitions it leads are served here and the others
    /// are forwarded to their leaders, unless the request was itself forwarded.
    fn target(&self, id: PartitionId, forwarded: bool) -> Result<Target, Status> {
        let slot = self
            .state
            .partitions
            .slot(id)
            .ok_or_else(|| Status::internal(format!("partition {id} is not on this node")))?;
        let running = slot.running();
        if !self.state.config.cluster_mode() {
            return running.map(Target::Local).map_err(status_of);
        }
        if let Ok(partition) = &running {
            match partition.serving_epoch() {
                Ok(_) => return Ok(Target::Local(partition.clone())),
                // Its leader, unable to serve now (its lease ran out): nobody else serves it
                // either until it renews or the controller moves it.
                Err(err @ cairn_worker::Error::LeaseLapsed { .. }) => {
                    return Err(status_of(err));
                }
                Err(_) => {}
            }
        }
        match leader_route(&self.state, id)? {
            LeaderRoute::Here => Err(match running {
                Ok(_) => Status::unavailable(format!(
                    "partition {id}: this node is taking over its leadership; retry shortly"
                )),
                Err(err) => status_of(err),
            }),
            LeaderRoute::At { address, .. } if !forwarded => Ok(Target::Remote(address)),
            LeaderRoute::At { node, .. } => Err(Status::unavailable(format!(
                "partition {id} is led by node {node}, and the node or routing client that sent this request here took this node for its leader (leadership is changing): read the partition table again and retry"
            ))),
        }
    }

    /// The read index of `id`'s leader (see `Partition::read_index`), or why it cannot be had.
    async fn read_index_of_leader(&self, id: PartitionId) -> Result<cairn_types::Lsn, String> {
        match leader_route(&self.state, id).map_err(|status| status.message().to_string())? {
            LeaderRoute::Here => {
                let partition = self
                    .state
                    .partitions
                    .slot(id)
                    .and_then(|slot| slot.running().ok())
                    .ok_or_else(|| "this node leads it, but does not run it".to_string())?;
                partition.read_index().map_err(|err| err.to_string())
            }
            LeaderRoute::At { address, .. } => self
                .state
                .routes
                .read_index(&address, id, cairn_worker::CATCH_UP_LIMIT)
                .await
                .map_err(|status| status.message().to_string()),
        }
    }

    /// This node's running replica of `id` (leader or follower), in a cluster.
    fn local_replica(&self, id: PartitionId) -> Option<Arc<Partition>> {
        if !self.state.config.cluster_mode() {
            return None;
        }
        self.state.partitions.slot(id)?.running().ok()
    }

    /// The values of `keys`, in request order, refused once they add up to more than `bytes_max`:
    /// a get of 10,000 keys of 1 MiB would otherwise read 10 GiB into memory for an answer that
    /// no gRPC message can hold. Keys are read a few at a time, so no more than one chunk's values
    /// past the bound are ever held; all local partitions' keys in one blocking task, the others'
    /// from their leaders. For [`Answer::Presence`] the others' leaders say only whether each
    /// key exists, and their values stand in as empty.
    async fn read_within(
        &self,
        keys: &[Bytes],
        answer: Answer,
        freshness: Freshness,
        forwarded: bool,
    ) -> Result<Vec<Option<StoredValue>>, Status> {
        let bytes_max = answer.bytes_max();
        /// Keys read between two checks of the total: at most 16 MiB of values.
        const CHUNK: usize = BATCH_BYTES_MAX / VALUE_BYTES_MAX;
        let groups = group_by_partition(keys.iter().map(|k| &k[..]), self.state.num_partitions());
        let mut shares = Vec::with_capacity(groups.len());
        let mut indices = Vec::with_capacity(groups.len());
        let mut remote = Vec::new();
        let mut routed = Vec::with_capacity(groups.len());
        let mut replicas = Vec::new();
        for (pid, mine) in groups {
            let share: Vec<Bytes> = mine.iter().map(|&i| keys[i].clone()).collect();
            match (freshness, self.local_replica(pid)) {
                (Freshness::AtMostStale(max), Some(partition)) => {
                    replicas.push((pid, partition, max, share, mine));
                }
                _ => routed.push((pid, share, mine)),
            }
        }
        // A read that accepts staleness: each local replica (leader or follower) shows it is
        // fresh enough, all at once; the keys of those that cannot go to their leaders.
        let checked = futures::future::join_all(replicas.into_iter().map(
            |(pid, partition, max, share, mine)| async move {
                let read = partition
                    .bounded_read_share(share.clone(), max, || self.read_index_of_leader(pid))
                    .await;
                (pid, read, share, mine)
            },
        ))
        .await;
        for (pid, read, share, mine) in checked {
            match read {
                Ok(read) => {
                    shares.push(read);
                    indices.push(mine);
                }
                Err(err) => {
                    tracing::debug!("a bounded-staleness read goes to the leader: {err}");
                    routed.push((pid, share, mine));
                }
            }
        }
        for (pid, share, mine) in routed {
            match self.target(pid, forwarded)? {
                Target::Local(partition) => {
                    shares.push(partition.read_share(share).map_err(status_of)?);
                    indices.push(mine);
                }
                Target::Remote(address) => remote.push((pid, address, share, mine)),
            }
        }
        let routes = &self.state.routes;
        let remote = futures::future::join_all(remote.into_iter().map(
            |(pid, address, share, mine)| async move {
                let read = async {
                    match answer {
                    Answer::Presence => routes.exists(&address, share, freshness).await.map(|found| {
                        found
                            .into_iter()
                            .map(|there| {
                                there.then(|| StoredValue {
                                    value: Bytes::new(),
                                    expires_at_ms: None,
                                })
                            })
                            .collect()
                    }),
                    Answer::Values { with_expiry, .. } => {
                        routes.get(&address, share, with_expiry, freshness).await
                    }
                    }
                };
                let values = tokio::select! {
                    values = read => values,
                    () = routes.moved_away(pid, &address) => Err(Status::unavailable(format!(
                        "partition {pid}: its leadership moved away from {address} during the read; retry"
                    ))),
                };
                (values, mine)
            },
        ));
        let (values, remote) =
            tokio::join!(cairn_worker::read_shares(shares, CHUNK, bytes_max), remote);
        let values = values.map_err(status_of)?;
        let mut out = vec![None; keys.len()];
        for (mine, values) in indices.into_iter().zip(values) {
            for (index, value) in mine.into_iter().zip(values) {
                out[index] = value;
            }
        }
        let forwarded_shares = !remote.is_empty();
        for (values, mine) in remote {
            for (index, value) in mine.into_iter().zip(values?) {
                out[index] = value;
            }
        }
        // Each node bounded its own share; together they may still be too much.
        if forwarded_shares
            && out.iter().flatten().map(|v| v.value.len()).sum::<usize>() > bytes_max
        {
            return Err(status_of(cairn_worker::Error::AnswerTooLarge {
                keys: keys.len(),
                bytes_max,
            }));
        }
        Ok(out)
    }

    /// Waits before sending a refused share again: `pause`, or until the routes change (the
    /// failover it waits for is decided) or this node starts leading a partition (one it was
    /// taking over), whichever comes first. The next pause doubles, or starts again from the
    /// first after a change.
    async fn wait_to_retry(&self, pause: &mut std::time::Duration) {
        // A share this node refused while taking the partition over is served once it leads.
        let woken = tokio::select! {
            changed = self.state.routes.changed_within(*pause) => changed,
            () = self.state.partitions.led_anew() => true,
        };
        if woken {
            *pause = RETRY_PAUSE_FIRST;
        } else {
            *pause = (*pause * 2).min(RETRY_PAUSE_MAX);
        }
    }

    /// [`Self::read_within`], read again while it is refused with nothing done (a leadership
    /// changing), for up to [`RETRY_FOR`]; a read has no effect, so this is always safe. Not for
    /// a request another node or a routing client sent: they retry themselves.
    async fn read_riding_through(
        &self,
        keys: &[Bytes],
        answer: Answer,
        freshness: Freshness,
        forwarded: bool,
    ) -> Result<Vec<Option<StoredValue>>, Status> {
        let mut pause = RETRY_PAUSE_FIRST;
        let deadline = std::time::Instant::now() + RETRY_FOR;
        loop {
            match self.read_within(keys, answer, freshness, forwarded).await {
                Err(status)
                    if !forwarded
                        && nothing_done(status.code())
                        && std::time::Instant::now() + pause < deadline =>
                {
                    self.wait_to_retry(&mut pause).await;
                }
                read => return read,
            }
        }
    }

    /// Runs `per_partition` on every partition's share of `keys`, concurrently, and puts the
    /// per-key answers back in request order: each key has its partition's answer or error. A
    /// partition that cannot be routed to has an error; the others are still sent.
    async fn scatter_each<T, F, Fut>(
        &self,
        keys: &[Bytes],
        forwarded: bool,
        per_partition: F,
    ) -> Vec<Result<T, Status>>
    where
        F: Fn(Target, Vec<usize>) -> Fut,
        Fut: Future<Output = Result<Vec<T>, Status>>,
    {
        let groups = group_by_partition(keys.iter().map(|k| &k[..]), self.state.num_partitions());
        let per_partition = &per_partition;
        let calls = groups.into_iter().map(|(pid, indices)| async move {
            // A share refused with nothing done (its leader is changing, or cannot be reached)
            // is sent again, routed anew, until the failover is over: unless another node or a
            // client that routes by itself sent it, which then retries itself.
            let mut pause = RETRY_PAUSE_FIRST;
            let deadline = std::time::Instant::now() + RETRY_FOR;
            loop {
                let answers = match self.target(pid, forwarded) {
                    Ok(Target::Remote(address)) => {
                        let call = per_partition(Target::Remote(address.clone()), indices.clone());
                        tokio::select! {
                            answers = call => answers,
                            () = self.state.routes.moved_away(pid, &address) => {
                                Err(moved_in_flight(pid, &address))
                            }
                        }
                    }
                    Ok(target) => per_partition(target, indices.clone()).await,
                    Err(status) => Err(status),
                };
                match answers {
                    Err(status)
                        if !forwarded
                            && nothing_done(status.code())
                            && std::time::Instant::now() + pause < deadline =>
                    {
                        self.wait_to_retry(&mut pause).await;
                    }
                    answers => return (indices, answers),
                }
            }
        });
        // Unordered: a share's answer wakes its own future only. `join_all` polls every share's
        // future whenever one of them is woken, and a put wakes each share twice (once its
        // record is in the log, once it is applied): with 16 partitions, 32 wake-ups of 16 polls
        // each per request.
        let mut answered: FuturesUnordered<_> = calls.collect();
        let mut out: Vec<Option<Result<T, Status>>> = (0..keys.len()).map(|_| None).collect();
        while let Some((indices, answers)) = answered.next().await {
            match answers {
                Ok(answers) => {
                    for (index, answer) in indices.into_iter().zip(answers) {
                        out[index] = Some(Ok(answer));
                    }
                }
                Err(status) => {
                    for index in indices {
                        out[index] = Some(Err(status.clone()));
                    }
                }
            }
        }
        out.into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| Err(Status::internal("a partition answered too few keys")))
            })
            .collect()
    }

    /// A put of entries within the bounds (`validate::entries`), with each entry's answer.
    pub(crate) async fn put_each(
        &self,
        keys: &[Bytes],
        entries: Vec<v1::Entry>,
        forwarded: bool,
    ) -> Vec<Result<(), Status>> {
        let entries = &entries;
        let routes = &self.state.routes;
        self.scatter_each(keys, forwarded, |target, indices| async move {
            match target {
                Target::Local(partition) => {
                    let mine = indices
                        .iter()
                        .map(|&i| PutEntry {
                            key: entries[i].key.clone(),
                            value: entries[i].value.clone(),
                            ttl_ms: entries[i].ttl_ms,
                        })
                        .collect();
                    partition.put(mine).await.map_err(status_of)?;
                }
                Target::Remote(address) => {
                    let mine = indices.iter().map(|&i| entries[i].clone()).collect();
                    routes.put(&address, mine).await?;
                }
            }
            Ok(vec![(); indices.len()])
        })
        .await
    }

    /// An insert-if-absent of keys within the bounds (`validate::keys`, `value_ok`, `ttl_ok`,
    /// `insert_if_absent_bytes`), all with `value` and `ttl_ms`, with whether each was inserted.
    pub(crate) async fn insert_each(
        &self,
        keys: &[Bytes],
        value: &Bytes,
        ttl_ms: Option<u64>,
        forwarded: bool,
    ) -> Vec<Result<bool, Status>> {
        let routes = &self.state.routes;
        self.scatter_each(keys, forwarded, |target, indices| async move {
            let mine: Vec<Bytes> = indices.iter().map(|&i| keys[i].clone()).collect();
            match target {
                Target::Local(partition) => partition
                    .insert_if_absent(mine, value.clone(), ttl_ms)
                    .await
                    .map_err(status_of),
                Target::Remote(address) => {
                    routes
                        .insert_if_absent(
                            &address,
                            v1::InsertIfAbsentRequest {
                                keys: mine,
                                value: value.clone(),
                                ttl_ms,
                                // One partition's keys: refused whole or not at all.
                                partial: false,
                            },
                        )
                        .await
                }
            }
        })
        .await
    }

    /// A conditional write of operations within the bounds (`validate::ops_ok`), with each
    /// operation's result: `Err` only if it was refused before any of it was sent (an
    /// all-or-nothing write across partitions).
    pub(crate) async fn write_each(
        &self,
        ops: Vec<WriteOp>,
        all_or_nothing: bool,
        forwarded: bool,
    ) -> Result<Vec<Result<v1::WriteResult, Status>>, Status> {
        let keys: Vec<Bytes> = ops.iter().map(|op| op.key.clone()).collect();
        if all_or_nothing {
            let groups =
                group_by_partition(keys.iter().map(|k| &k[..]), self.state.num_partitions());
            if groups.len() > 1 {
                return Err(Status::invalid_argument(format!(
                    "an all-or-nothing write must keep its keys in one partition; these {} keys \
                     are in {} partitions, so it cannot be made atomic: send the keys one by one",
                    keys.len(),
                    groups.len()
                )));
            }
        }
        let ops = &ops;
        let routes = &self.state.routes;
        Ok(self
            .scatter_each(&keys, forwarded, |target, indices| async move {
                match target {
                    Target::Local(partition) => {
                        let mine = indices.iter().map(|&i| ops[i].clone()).collect();
                        let results = partition
                            .write(mine, all_or_nothing)
                            .await
                            .map_err(status_of)?;
                        Ok(results
                            .into_iter()
                            .map(|r| v1::WriteResult {
                                applied: r.applied,
                                existed: r.existed,
                                old_value: r.old,
                            })
                            .collect())
                    }
                    Target::Remote(address) => {
                        let request = v1::WriteRequest {
                            ops: indices
                                .iter()
                                .map(|&i| crate::forward::wire_op(&ops[i]))
                                .collect(),
                            all_or_nothing,
                        };
                        routes.write(&address, request).await
                    }
                }
            })
            .await)
    }

    /// Refuses a request whole if any of its partitions cannot be routed to now, before any
    /// share is sent: for a request that is not to wait for routes to change (another node or a
    /// client that routes by itself sent it, and retries itself). The others wait per share.
    fn routable(&self, keys: &[Bytes], forwarded: bool) -> Result<(), Status> {
        if !forwarded {
            return Ok(());
        }
        let groups = group_by_partition(keys.iter().map(|k| &k[..]), self.state.num_partitions());
        for pid in groups.into_keys() {
            self.target(pid, forwarded)?;
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl v1::key_value_server::KeyValue for KeyValueService {
    async fn put(
        &self,
        request: Request<v1::PutRequest>,
    ) -> Result<Response<v1::PutResponse>, Status> {
        let forwarded = crate::forward::not_to_forward(&request);
        let entries = request.into_inner().entries;
        // Out of bounds first, then not routable: both before anything is sent.
        validate::entries(&entries)?;
        let keys: Vec<Bytes> = entries.iter().map(|e| e.key.clone()).collect();
        self.routable(&keys, forwarded)?;
        let (_, failures) = per_key(self.put_each(&keys, entries, forwarded).await)?;
        Ok(Response::new(v1::PutResponse { failures }))
    }

    async fn get(
        &self,
        request: Request<v1::GetRequest>,
    ) -> Result<Response<v1::GetResponse>, Status> {
        let forwarded = crate::forward::not_to_forward(&request);
        let v1::GetRequest {
            keys,
            with_expiry,
            max_staleness_ms,
        } = request.into_inner();
        validate::keys(&keys)?;
        let answer = Answer::Values {
            bytes_max: BATCH_BYTES_MAX,
            with_expiry,
        };
        let freshness = Freshness::of_request(max_staleness_ms);
        let values = self
            .read_riding_through(&keys, answer, freshness, forwarded)
            .await?;
        Ok(Response::new(v1::GetResponse {
            values: values
                .into_iter()
                .map(|value| match value {
                    Some(v) => v1::MaybeValue {
                        value: Some(v.value),
                        expires_at_ms: if with_expiry { v.expires_at_ms } else { None },
                    },
                    None => v1::MaybeValue::default(),
                })
                .collect(),
        }))
    }

    async fn delete(
        &self,
        request: Request<v1::DeleteRequest>,
    ) -> Result<Response<v1::DeleteResponse>, Status> {
        let forwarded = crate::forward::not_to_forward(&request);
        let keys = request.into_inner().keys;
        validate::keys(&keys)?;
        let keys_ref = &keys;
        let routes = &self.state.routes;
        self.routable(&keys, forwarded)?;
        let answers = self
            .scatter_each(&keys, forwarded, |target, indices| async move {
                let mine: Vec<Bytes> = indices.iter().map(|&i| keys_ref[i].clone()).collect();
                match target {
                    Target::Local(partition) => partition.delete(mine).await.map_err(status_of)?,
                    Target::Remote(address) => routes.delete(&address, mine).await?,
                }
                Ok(vec![(); indices.len()])
            })
            .await;
        let (_, failures) = per_key(answers)?;
        Ok(Response::new(v1::DeleteResponse { failures }))
    }

    async fn exists(
        &self,
        request: Request<v1::ExistsRequest>,
    ) -> Result<Response<v1::ExistsResponse>, Status> {
        let forwarded = crate::forward::not_to_forward(&request);
        let v1::ExistsRequest {
            keys,
            max_staleness_ms,
        } = request.into_inner();
        validate::keys(&keys)?;
        let freshness = Freshness::of_request(max_staleness_ms);
        // Only presence is answered, so no bound on the values read.
        let exists = self
            .read_riding_through(&keys, Answer::Presence, freshness, forwarded)
            .await?
            .into_iter()
            .map(|value| value.is_some())
            .collect();
        Ok(Response::new(v1::ExistsResponse { exists }))
    }

    async fn insert_if_absent(
        &self,
        request: Request<v1::InsertIfAbsentRequest>,
    ) -> Result<Response<v1::InsertIfAbsentResponse>, Status> {
        let forwarded = crate::forward::not_to_forward(&request);
        let request = request.into_inner();
        validate::keys(&request.keys)?;
        validate::value_ok(0, &request.value)?;
        validate::ttl_ok(request.ttl_ms)?;
        validate::insert_if_absent_bytes(&request.keys, request.value.len())?;
        self.routable(&request.keys, forwarded)?;
        let answers = self
            .insert_each(&request.keys, &request.value, request.ttl_ms, forwarded)
            .await;
        insert_answer(answers, request.partial).map(Response::new)
    }

    async fn read_index(
        &self,
        request: Request<v1::ReadIndexRequest>,
    ) -> Result<Response<v1::ReadIndexResponse>, Status> {
        let partition_id = request.into_inner().partition_id;
        let id = u16::try_from(partition_id)
            .ok()
            .filter(|&p| p < self.state.num_partitions())
            .map(PartitionId)
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "partition {partition_id} does not exist: the cluster has {} partitions",
                    self.state.num_partitions()
                ))
            })?;
        let partition = self
            .state
            .partitions
            .slot(id)
            .ok_or_else(|| Status::internal(format!("partition {id} is not on this node")))?
            .running()
            .map_err(status_of)?;
        let lsn = partition.read_index().map_err(status_of)?;
        Ok(Response::new(v1::ReadIndexResponse { lsn: lsn.0 }))
    }

    async fn write(
        &self,
        request: Request<v1::WriteRequest>,
    ) -> Result<Response<v1::WriteResponse>, Status> {
        let forwarded = crate::forward::not_to_forward(&request);
        let request = request.into_inner();
        // Out of bounds first, then not routable: both before anything is sent.
        let ops = validate::write_ops(&request.ops)?;
        let keys: Vec<Bytes> = ops.iter().map(|op| op.key.clone()).collect();
        self.routable(&keys, forwarded)?;
        let (results, failures) = per_key(
            self.write_each(ops, request.all_or_nothing, forwarded)
                .await?,
        )?;
        Ok(Response::new(v1::WriteResponse { results, failures }))
    }
}

pub(crate) struct AdminService {
    state: Arc<NodeState>,
}

impl AdminService {
    pub fn new(state: Arc<NodeState>) -> Self {
        AdminService { state }
    }

    /// The members as this node observes them; refused while the metadata store does not answer
    /// (what it last saw would not say who is alive now).
    fn cluster_view(&self) -> Result<cairn_controller::ClusterView, Status> {
        let Some(view) = &self.state.cluster_view else {
            return Ok(Default::default());
        };
        let view = view.borrow().clone();
        if !view.store_answers {
            return Err(Status::unavailable(
                "this node cannot read the metadata store now (NATS does not answer), so it \
                 cannot say which nodes are alive; retry shortly, or ask another node",
            ));
        }
        Ok(view)
    }

    fn slot(&self, partition_id: u32) -> Result<&Slot, Status> {
        self.numbered(partition_id, "partition", "partitions")
    }

    /// The running partition, or why it is not running.
    fn partition(&self, partition_id: u32) -> Result<Arc<Partition>, Status> {
        self.slot(partition_id)?.running().map_err(status_of)
    }

    /// In a cluster, where a call about `partition_id` runs when this node does not lead it:
    /// the leader's address. `None`: here (alone, when this node leads it, or when the call was
    /// forwarded already, in which case this node answers for itself).
    fn leader_elsewhere<T>(
        &self,
        partition_id: u32,
        request: &Request<T>,
    ) -> Result<Option<String>, Status> {
        if !self.state.config.cluster_mode() || crate::forward::not_to_forward(request) {
            return Ok(None);
        }
        let slot = self.slot(partition_id)?;
        if slot.running().is_ok_and(|p| p.leads()) {
            return Ok(None);
        }
        Ok(match leader_route(&self.state, slot.id())? {
            LeaderRoute::Here => None,
            LeaderRoute::At { address, .. } => Some(address),
        })
    }

    fn partition_info(&self, s: cairn_worker::PartitionStatus) -> v1::PartitionInfo {
        let followers = self
            .state
            .routes
            .current()
            .table
            .partitions
            .get(&s.id)
            .map(|p| p.followers.iter().map(|f| f.0.clone()).collect())
            .unwrap_or_default();
        v1::PartitionInfo {
            followers,
            partition_id: u32::from(s.id.0),
            key_range_start: s.key_range.start,
            key_range_end: s.key_range.end,
            leader: s
                .leader
                .as_ref()
                .map(|l| l.node.0.clone())
                .unwrap_or_default(),
            epoch: s.leader.as_ref().map(|l| l.epoch.0).unwrap_or_default(),
            applied_lsn: s.applied_lsn.0,
            log_trim_point: s.log.map(|l| l.trim_point.0).unwrap_or_default(),
            log_tail: s.log.map(|l| l.tail.0).unwrap_or_default(),
            status: s.stopped.unwrap_or_else(|| "active".into()),
            archived_lsn: self.state.archived_lsn(s.id).map(|l| l.0),
        }
    }

    /// Replaces what this node knows of the partitions it does not lead by what their leaders
    /// say. A leader that cannot be asked leaves this node's view, with the leader the placement
    /// names and why it could not be asked.
    async fn leaders_say(&self, partitions: &mut [v1::PartitionInfo]) {
        let routes = self.state.routes.current();
        let mut by_address: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, p) in partitions.iter_mut().enumerate() {
            let id = PartitionId(p.partition_id as u16);
            match routes.leader(id) {
                Some((leader, _)) if *leader == self.state.node => {}
                Some((leader, address)) => {
                    p.leader = leader.0.clone();
                    match address {
                        Some(address) => by_address.entry(address.clone()).or_default().push(i),
                        None => {
                            p.status = format!("led by {leader}, whose address is not known yet")
                        }
                    }
                }
                None => p.status = "not placed yet".into(),
            }
        }
        let asked = futures::future::join_all(by_address.into_iter().map(|(address, wanted)| {
            let admin = self.state.routes.admin(&address);
            async move {
                let answer = match admin {
                    Ok(mut admin) => admin
                        .list_partitions(crate::forward::mark(v1::ListPartitionsRequest {}))
                        .await
                        .map(|r| r.into_inner().partitions),
                    Err(status) => Err(status),
                };
                (address, wanted, answer)
            }
        }))
        .await;
        for (address, wanted, answer) in asked {
            match answer {
                Ok(theirs) => {
                    for i in wanted {
                        let id = partitions[i].partition_id;
                        if let Some(info) = theirs.iter().find(|t| t.partition_id == id) {
                            partitions[i] = info.clone();
                        }
                    }
                }
                Err(status) => {
                    for i in wanted {
                        partitions[i].status = format!(
                            "its leader at {address} cannot be asked: {}",
                            status.message()
                        );
                    }
                }
            }
        }
    }

    /// Every log belongs to the partition with the same number.
    fn log_slot(&self, log_id: u32) -> Result<&Slot, Status> {
        self.numbered(log_id, "log", "logs")
    }

    fn snapshots(&self) -> Result<&SnapshotProducer, Status> {
        self.state.snapshots.as_ref().ok_or_else(|| {
            Status::failed_precondition(
                "this node has no snapshot repository (worker.snapshots.destination = \"none\"); set worker.snapshots.destination and restart it",
            )
        })
    }

    /// Refuses, before anything starts, a snapshot this node cannot take: it must lead the
    /// partition (a follower's store may lag), the partition must run, and `min_lsn` must be in
    /// the log.
    async fn check_snapshot_request(
        &self,
        partition: &Partition,
        min_lsn: Option<u64>,
    ) -> Result<(), Status> {
        let status = partition.status().await;
        match &status.leader {
            Some(leader) if leader.node == self.state.node => {}
            leader => {
                return Err(status_of(cairn_worker::Error::NotLeader {
                    partition: partition.id(),
                    leader: leader.as_ref().map(|l| l.node.clone()),
                }));
            }
        }
        if let Some(reason) = status.stopped {
            return Err(Status::unavailable(format!(
                "partition {} is stopped and cannot be snapshotted: {reason}",
                partition.id()
            )));
        }
        if let Some(min_lsn) = min_lsn {
            let tail = partition
                .log()
                .state()
                .await
                .map_err(|e| {
                    Status::unavailable(format!("read the state of log {}: {e}", partition.id()))
                })?
                .tail;
            if Lsn(min_lsn) > tail {
                return Err(Status::out_of_range(format!(
                    "--min-lsn {min_lsn} is past the log's tail: log {} ends at LSN {tail}, so there is nothing there to snapshot yet; give an LSN up to {tail}, or leave --min-lsn out to snapshot what the partition has applied",
                    partition.id()
                )));
            }
        }
        Ok(())
    }

    fn numbered(&self, id: u32, noun: &str, nouns: &str) -> Result<&Slot, Status> {
        u16::try_from(id)
            .ok()
            .and_then(|id| self.state.partitions.slot(PartitionId(id)))
            .ok_or_else(|| {
                Status::not_found(format!(
                    "{noun} {id} does not exist; this cluster has {nouns} 0 to {}",
                    self.state.num_partitions() - 1
                ))
            })
    }
}

#[tonic::async_trait]
impl v1::admin_server::Admin for AdminService {
    async fn list_nodes(
        &self,
        _request: Request<v1::ListNodesRequest>,
    ) -> Result<Response<v1::ListNodesResponse>, Status> {
        if !self.state.config.cluster_mode() {
            // Alone: this node, which leads every partition it runs.
            let leads = self
                .state
                .partitions
                .slots()
                .iter()
                .filter(|slot| slot.running().is_ok_and(|p| p.leads()))
                .count() as u32;
            return Ok(Response::new(v1::ListNodesResponse {
                nodes: vec![v1::NodeInfo {
                    name: self.state.node.0.clone(),
                    address: self.state.advertised_address.clone(),
                    alive: true,
                    last_seen_ms: crate::cluster::now_ms(),
                    leads,
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }],
            }));
        }
        let view = self.cluster_view()?;
        let counts = crate::cluster::led_and_followed(&self.state.routes.current().table);
        let now = crate::cluster::now_ms();
        let nodes = view
            .nodes
            .into_iter()
            .filter_map(|node| {
                let record = node.record?;
                let (leads, follows) = counts.get(&node.name).copied().unwrap_or_default();
                let ago = node.last_seen_ago.unwrap_or_default().as_millis() as u64;
                let state = crate::cluster::shown_state(node.condition, record.state);
                Some(v1::NodeInfo {
                    alive: matches!(
                        node.condition,
                        cairn_controller::NodeCondition::Serving
                            | cairn_controller::NodeCondition::Starting
                    ),
                    name: record.name.0,
                    address: record.address,
                    last_seen_ms: now.saturating_sub(ago),
                    leads: leads as u32,
                    follows: follows as u32,
                    generation: record.generation,
                    started_at_ms: record.started_at_ms,
                    version: record.version,
                    state: state.into(),
                    last_seen_ago_ms: ago,
                })
            })
            .collect();
        Ok(Response::new(v1::ListNodesResponse { nodes }))
    }

    type LoadPartitionsStream =
        tokio_stream::wrappers::ReceiverStream<Result<v1::LoadPartitionsProgress, Status>>;

    async fn load_partitions(
        &self,
        request: Request<v1::LoadPartitionsRequest>,
    ) -> Result<Response<Self::LoadPartitionsStream>, Status> {
        let request = request.into_inner();
        let partitions = request
            .partition_ids
            .iter()
            .map(|&id| self.slot(id).map(|slot| slot.id()))
            .collect::<Result<_, _>>()?;
        let (tx, rx) = tokio::sync::mpsc::channel(PROGRESS_BUFFER);
        crate::scaling::load_partitions(self.state.clone(), partitions, request.node, tx).await?;
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn remove_node(
        &self,
        request: Request<v1::RemoveNodeRequest>,
    ) -> Result<Response<v1::RemoveNodeResponse>, Status> {
        crate::scaling::remove_node(&self.state, request.into_inner().node).await?;
        Ok(Response::new(v1::RemoveNodeResponse {}))
    }

    async fn start_scale(
        &self,
        request: Request<v1::StartScaleRequest>,
    ) -> Result<Response<v1::StartScaleResponse>, Status> {
        crate::operations::start_scale(&self.state, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn list_operations(
        &self,
        _request: Request<v1::ListOperationsRequest>,
    ) -> Result<Response<v1::ListOperationsResponse>, Status> {
        crate::operations::list_operations(&self.state)
            .await
            .map(Response::new)
    }

    async fn cancel_operation(
        &self,
        request: Request<v1::CancelOperationRequest>,
    ) -> Result<Response<v1::CancelOperationResponse>, Status> {
        crate::operations::cancel_operation(&self.state, request.into_inner().id)
            .await
            .map(Response::new)
    }

    async fn plan_placement(
        &self,
        request: Request<v1::PlanPlacementRequest>,
    ) -> Result<Response<v1::PlanPlacementResponse>, Status> {
        crate::scaling::plan_placement(&self.state, request.into_inner().nodes)
            .await
            .map(Response::new)
    }

    async fn describe_cluster(
        &self,
        _request: Request<v1::DescribeClusterRequest>,
    ) -> Result<Response<v1::DescribeClusterResponse>, Status> {
        let (controller, controller_term, node_timeout_ms) = match &self.state.cluster_view {
            Some(view) => {
                let controller = view.borrow().controller.clone();
                let (holder, term) = controller
                    .map(|(holder, term)| (holder.0, term))
                    .unwrap_or_default();
                (
                    holder,
                    term,
                    self.state.config.cluster.node_timeout.as_millis() as u64,
                )
            }
            None => (String::new(), 0, 0),
        };
        Ok(Response::new(v1::DescribeClusterResponse {
            cluster_name: self.state.cluster.cluster_name.clone(),
            node_name: self.state.node.0.clone(),
            num_partitions: u32::from(self.state.num_partitions()),
            partition_table_version: self.state.partitions.table_version.load(Ordering::Relaxed),
            controller,
            controller_term,
            node_timeout_ms,
        }))
    }

    async fn list_partitions(
        &self,
        _request: Request<v1::ListPartitionsRequest>,
    ) -> Result<Response<v1::ListPartitionsResponse>, Status> {
        let stores = self.state.partitions.stores();
        let statuses = futures::future::join_all(
            self.state
                .partitions
                .slots()
                .iter()
                .map(|slot| slot.status(stores)),
        )
        .await;
        let mut partitions: Vec<v1::PartitionInfo> = statuses
            .into_iter()
            .map(|s| self.partition_info(s))
            .collect();
        if self.state.config.cluster_mode() && !crate::forward::not_to_forward(&_request) {
            self.leaders_say(&mut partitions).await;
        }
        Ok(Response::new(v1::ListPartitionsResponse {
            partitions,
            partition_table_version: self.state.partitions.table_version.load(Ordering::Relaxed),
        }))
    }

    async fn describe_logs(
        &self,
        request: Request<v1::DescribeLogsRequest>,
    ) -> Result<Response<v1::DescribeLogsResponse>, Status> {
        let slots: Vec<&Slot> = match request.into_inner().log_id {
            Some(id) => vec![self.log_slot(id)?],
            None => self.state.partitions.slots().iter().collect(),
        };
        let mut logs = Vec::with_capacity(slots.len());
        for slot in slots {
            let log_id = u32::from(slot.id().0);
            // One log that cannot be read (say, it could not be opened) is reported on its own
            // row: the others are still described.
            logs.push(match slot.log().state().await {
                Ok(state) => v1::LogInfo {
                    log_id,
                    trim_point: state.trim_point.0,
                    tail: state.tail.0,
                    problem: String::new(),
                },
                Err(err) => v1::LogInfo {
                    log_id,
                    trim_point: 0,
                    tail: 0,
                    problem: slot.log_problem(&err),
                },
            });
        }
        Ok(Response::new(v1::DescribeLogsResponse { logs }))
    }

    async fn trim_log(
        &self,
        request: Request<v1::TrimLogRequest>,
    ) -> Result<Response<v1::TrimLogResponse>, Status> {
        if let Some(address) = self.leader_elsewhere(request.get_ref().log_id, &request)? {
            let mut admin = self.state.routes.admin(&address)?;
            return admin
                .trim_log(crate::forward::mark(request.into_inner()))
                .await;
        }
        let request = request.into_inner();
        let slot = self.log_slot(request.log_id)?;
        // Fails at once when the partition is not running, before any check of snapshots.
        slot.running().map_err(status_of)?;
        let requested = Lsn(request.trim_point);
        if !request.force {
            if let Err(err) = self.state.refresh_archived_lsn(slot.id()).await {
                let message = format!(
                    "refusing to trim log {}: what its snapshots cover cannot be read now ({err}), and the snapshots read before may be what is gone. Nothing was trimmed. Once `cairnctl snapshots list -p {}` reads the repository again, trim again, or pass --force to trim anyway",
                    slot.id(),
                    slot.id()
                );
                return Err(match err {
                    cairn_snapshots::Error::ObjectStore { .. } => Status::unavailable(message),
                    _ => Status::failed_precondition(message),
                });
            }
            let archived = self.state.archived_lsn(slot.id());
            let tail = slot
                .log()
                .state()
                .await
                .map_err(|e| log_status(&e, format!("read the state of log {}: {e}", slot.id())))?
                .tail;
            // Snapshots past the log's tail hold records this log does not (its base dir was put
            // back from an older copy): they cover nothing of what the log holds now.
            let ahead = archived.filter(|archived| *archived > tail);
            if ahead.is_some() || archived.is_none_or(|archived| requested > archived) {
                let covered = match (ahead, archived) {
                    (Some(ahead), _) => format!(
                        "this cluster's snapshots of partition {} reach LSN {ahead}, past this log's tail {tail}, so they hold records this log does not (was the base dir put back from an older copy?) and cover none of its records",
                        slot.id()
                    ),
                    (None, Some(archived)) => format!(
                        "snapshots cover log {} only up to LSN {archived} (the archived LSN)",
                        slot.id()
                    ),
                    (None, None) => format!("no snapshot covers log {}", slot.id()),
                };
                let archived = archived.filter(|_| ahead.is_none());
                let first_lost = archived.unwrap_or(Lsn::ZERO).next();
                let remedy = if self.state.snapshots.is_some() {
                    format!(
                        "Snapshot the partition first (`cairnctl snapshots create -p {} --trim-log`)",
                        slot.id()
                    )
                } else {
                    "This node has no snapshot repository: set worker.snapshots.destination and snapshot the partition first".to_string()
                };
                return Err(Status::failed_precondition(format!(
                    "refusing to trim log {} to LSN {requested}: {covered}, so records {first_lost}..={requested} would be lost to any restore from a snapshot. {remedy}, or pass --force to trim anyway",
                    slot.id(),
                )));
            }
        }
        // Through the slot: a restore that replaced the partition meanwhile must not meet a trim
        // checked against the store it replaced.
        let partition = slot.trim_log(requested).await.map_err(status_of)?;
        let state = partition
            .log()
            .state()
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        tracing::info!(log = request.log_id, trim_point = %state.trim_point, forced = request.force, "log trimmed");
        Ok(Response::new(v1::TrimLogResponse {
            trim_point: state.trim_point.0,
            tail: state.tail.0,
        }))
    }

    type CreateSnapshotStream =
        tokio_stream::wrappers::ReceiverStream<Result<v1::CreateSnapshotProgress, Status>>;

    /// Checks the request, then publishes in a task of the node's own: a large partition takes
    /// longer than any request timeout, and a caller that gives up must not cancel a publish
    /// halfway (its uploads would be orphans, and the next caller would start over).
    async fn create_snapshot(
        &self,
        request: Request<v1::CreateSnapshotRequest>,
    ) -> Result<Response<Self::CreateSnapshotStream>, Status> {
        if let Some(address) = self.leader_elsewhere(request.get_ref().partition_id, &request)? {
            let mut admin = self.state.routes.admin(&address)?;
            let stream = admin
                .create_snapshot(crate::forward::mark(request.into_inner()))
                .await?
                .into_inner();
            let (tx, rx) = tokio::sync::mpsc::channel(PROGRESS_BUFFER);
            tokio::spawn(relay(stream, move |m| {
                let tx = tx.clone();
                async move { tx.send(m).await.is_ok() }
            }));
            return Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
                rx,
            )));
        }
        let request = request.into_inner();
        let partition = self.partition(request.partition_id)?;
        tracing::info!(partition = request.partition_id, min_lsn = ?request.min_lsn, "Create snapshot command received");
        self.snapshots()?;
        self.check_snapshot_request(&partition, request.min_lsn)
            .await?;
        let (tx, rx) = tokio::sync::mpsc::channel(PROGRESS_BUFFER);
        if self.state.publishing(partition.id()) {
            let _ = tx.try_send(Ok(v1::CreateSnapshotProgress {
                phase: "waiting".into(),
                message: format!(
                    "waiting for the snapshot of partition {} being published",
                    partition.id()
                ),
                ..Default::default()
            }));
        }
        let progress_tx = tx.clone();
        let on_progress: cairn_snapshots::ProgressFn = Arc::new(move |done, total| {
            // Progress is advisory: a slow reader misses some, never the end.
            let _ = progress_tx.try_send(Ok(v1::CreateSnapshotProgress {
                phase: "upload".into(),
                bytes_done: done,
                bytes_total: total,
                ..Default::default()
            }));
        });
        let state = self.state.clone();
        tokio::spawn(async move {
            let outcome = publish_snapshot(&state, partition, request, on_progress).await;
            let last = outcome.map(|done| v1::CreateSnapshotProgress {
                phase: "done".into(),
                bytes_done: done.total_bytes,
                bytes_total: done.total_bytes,
                done: Some(done),
                ..Default::default()
            });
            // The caller may be gone; the snapshot is published all the same.
            let _ = tx.send(last).await;
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn list_snapshots(
        &self,
        request: Request<v1::ListSnapshotsRequest>,
    ) -> Result<Response<v1::ListSnapshotsResponse>, Status> {
        let partition = match request.into_inner().partition_id {
            Some(id) => Some(self.slot(id)?.id()),
            None => None,
        };
        let repository = self.snapshots()?.repository();
        let listing = repository.list(partition).await.map_err(snapshot_status)?;
        let unreadable = listing
            .unreadable
            .into_iter()
            .map(|bad| {
                tracing::warn!(partition = %bad.partition_id, error = %bad.error, "cannot list a partition's snapshots");
                v1::UnreadablePartition {
                    partition_id: u32::from(bad.partition_id.0),
                    error: bad.error.to_string(),
                }
            })
            .collect();
        let snapshots = listing
            .snapshots
            .into_iter()
            .map(|s| v1::SnapshotSummary {
                snapshot_id: s.snapshot_id.to_string(),
                partition_id: u32::from(s.partition_id.0),
                lsn: s.min_applied_lsn.0,
                created_at: rfc3339(s.created_at),
                node_name: s.node_name,
                size_bytes: s.size,
                files: s.files as u32,
                uploaded_bytes: s.new_bytes,
            })
            .collect();
        Ok(Response::new(v1::ListSnapshotsResponse {
            snapshots,
            destination: repository.destination(),
            unreadable,
        }))
    }

    async fn describe_snapshot(
        &self,
        request: Request<v1::DescribeSnapshotRequest>,
    ) -> Result<Response<v1::DescribeSnapshotResponse>, Status> {
        let id = parse_snapshot_id(&request.into_inner().snapshot_id)?;
        let (_, metadata) = self
            .snapshots()?
            .repository()
            .find(id)
            .await
            .map_err(snapshot_status)?;
        Ok(Response::new(v1::DescribeSnapshotResponse {
            metadata_json: String::from_utf8_lossy(&metadata.to_json_pretty()).into_owned(),
        }))
    }

    async fn verify_snapshot(
        &self,
        request: Request<v1::VerifySnapshotRequest>,
    ) -> Result<Response<v1::VerifySnapshotResponse>, Status> {
        let id = parse_snapshot_id(&request.into_inner().snapshot_id)?;
        let report = self
            .snapshots()?
            .repository()
            .verify(id)
            .await
            .map_err(snapshot_status)?;
        Ok(Response::new(v1::VerifySnapshotResponse {
            files: report.files as u32,
            bytes: report.bytes,
        }))
    }

    async fn describe_partition(
        &self,
        request: Request<v1::DescribePartitionRequest>,
    ) -> Result<Response<v1::DescribePartitionResponse>, Status> {
        if let Some(address) = self.leader_elsewhere(request.get_ref().partition_id, &request)? {
            let mut admin = self.state.routes.admin(&address)?;
            return admin
                .describe_partition(crate::forward::mark(request.into_inner()))
                .await;
        }
        let slot = self.slot(request.into_inner().partition_id)?;
        let status = slot.status(self.state.partitions.stores()).await;
        let mut response = v1::DescribePartitionResponse {
            partition: Some(self.partition_info(status)),
            ..Default::default()
        };
        if let Ok(partition) = slot.running() {
            let store = partition.store_status().await.map_err(status_of)?;
            response.store = Some(store_info(&store));
            let sample = partition
                .sample_expired(EXPIRY_SAMPLE_VALUES)
                .await
                .map_err(status_of)?;
            response.sampled_values = sample.read;
            response.sampled_expired = sample.expired;
        }
        Ok(Response::new(response))
    }

    type CompactPartitionStream = tokio_stream::wrappers::UnboundedReceiverStream<
        Result<v1::CompactPartitionProgress, Status>,
    >;

    async fn compact_partition(
        &self,
        request: Request<v1::CompactPartitionRequest>,
    ) -> Result<Response<Self::CompactPartitionStream>, Status> {
        let id = self.slot(request.into_inner().partition_id)?.id();
        tracing::info!(partition = %id, "Compact partition command received");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let _ = tx.send(Ok(v1::CompactPartitionProgress::default()));
        let state = self.state.clone();
        // A task of the node: a caller that gives up does not stop a compaction half-way (RocksDB
        // could not be stopped anyway); one still there gets the figures.
        tokio::spawn(async move {
            let slot = state.partitions.slot(id).expect("a slot found above");
            let message = slot.compact().await.map_err(status_of).map(|compacted| {
                tracing::info!(partition = %id, expired_dropped = compacted.expired_dropped,
                               sst_bytes_before = compacted.before.estimates.live_sst_bytes,
                               sst_bytes_after = compacted.after.estimates.live_sst_bytes,
                               "partition compacted");
                v1::CompactPartitionProgress {
                    done: true,
                    before: Some(store_info(&compacted.before)),
                    after: Some(store_info(&compacted.after)),
                    expired_dropped: compacted.expired_dropped,
                }
            });
            let _ = tx.send(message);
        });
        Ok(Response::new(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        ))
    }

    type RestorePartitionStream = tokio_stream::wrappers::UnboundedReceiverStream<
        Result<v1::RestorePartitionProgress, Status>,
    >;

    async fn restore_partition(
        &self,
        request: Request<v1::RestorePartitionRequest>,
    ) -> Result<Response<Self::RestorePartitionStream>, Status> {
        if let Some(address) = self.leader_elsewhere(request.get_ref().partition_id, &request)? {
            let mut admin = self.state.routes.admin(&address)?;
            let stream = admin
                .restore_partition(crate::forward::mark(request.into_inner()))
                .await?
                .into_inner();
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(relay(stream, move |m| {
                let sent = tx.send(m).is_ok();
                async move { sent }
            }));
            return Ok(Response::new(
                tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
            ));
        }
        let request = request.into_inner();
        let id = self.slot(request.partition_id)?.id();
        self.snapshots()?;
        let pinned = request
            .snapshot_id
            .as_deref()
            .map(parse_snapshot_id)
            .transpose()?;
        tracing::info!(partition = %id, snapshot_id = ?pinned, "Restore partition command received");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let progress_tx = tx.clone();
        let on_progress: cairn_worker::RestoreProgressFn = Arc::new(move |step| {
            let _ = progress_tx.send(Ok(restore_progress(step)));
        });
        let state = self.state.clone();
        // The restore goes on if the client goes away: stopping halfway would leave the partition
        // down for no reason. It stops when the node shuts down, where a crash would have left
        // it: the next start finishes or discards what it left (a download in the staging folder,
        // an import not marked complete) as it does after a crash.
        tokio::spawn(async move {
            let restore = async {
                let result = state
                    .partitions
                    .restore(id, pinned, Some(on_progress))
                    .await;
                let _ = state.refresh_archived_lsn(id).await;
                result
            };
            let result = tokio::select! {
                result = restore => result,
                () = state.shutdown.cancelled() => Err(cairn_worker::Error::Stopped {
                    partition: id,
                    reason: "the node is shutting down; the restore did not complete. After \
                             the node starts again, the partition serves from its store as it \
                             was before the restore, or from the snapshot if the restore had \
                             already replaced it; run the restore again if it is still wanted"
                        .into(),
                }),
            };
            let message = match result {
                Ok((restored, applied)) => Ok(v1::RestorePartitionProgress {
                    phase: "done".into(),
                    snapshot_id: restored.snapshot_id.to_string(),
                    bytes_done: restored.bytes,
                    bytes_total: restored.bytes,
                    snapshot_lsn: restored.min_applied_lsn.0,
                    applied_lsn: applied.0,
                    done: true,
                    ..Default::default()
                }),
                Err(err) => Err(status_of(err)),
            };
            let _ = tx.send(message);
        });
        Ok(Response::new(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        ))
    }

    type ExportSnapshotStream =
        tokio_stream::wrappers::ReceiverStream<Result<v1::ExportSnapshotChunk, Status>>;

    /// Builds the tar in a file of this export's own, then streams it. The work runs in a task
    /// that stops as soon as the caller goes away; the file is removed in every case.
    async fn export_snapshot(
        &self,
        request: Request<v1::ExportSnapshotRequest>,
    ) -> Result<Response<Self::ExportSnapshotStream>, Status> {
        let id = parse_snapshot_id(&request.into_inner().snapshot_id)?;
        let repository = self.snapshots()?.repository().clone();
        let tar = ScratchFile::new(&self.state.tmp_dir, &format!("{id}.tar"));
        let (tx, rx) = tokio::sync::mpsc::channel(EXPORT_CHUNKS_BUFFERED);
        tokio::spawn(async move {
            tokio::select! {
                () = export_and_send(&repository, id, &tar, &tx) => {}
                () = tx.closed() => abandoned(id),
            }
            drop(tar);
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }
}

/// Values `DescribePartition` reads to estimate how many have expired.
const EXPIRY_SAMPLE_VALUES: usize = 10_000;

fn store_info(status: &cairn_worker::StoreStatus) -> v1::PartitionStoreInfo {
    v1::PartitionStoreInfo {
        estimated_keys: status.estimates.keys,
        live_sst_bytes: status.estimates.live_sst_bytes,
        memtable_bytes: status.estimates.memtable_bytes,
        expired_dropped: status.expired_dropped,
        partition_time_ms: status.partition_time_ms,
        expiry_horizon_ms: status.expiry_horizon_ms,
        write_stall: Some(
            match status.write_stall {
                WriteStall::None => v1::WriteStall::None,
                WriteStall::Slowed => v1::WriteStall::Slowed,
                WriteStall::Stopped => v1::WriteStall::Stopped,
            }
            .into(),
        ),
        background_errors: status.background_errors,
    }
}

/// Progress messages a publish buffers for a slow reader.
const PROGRESS_BUFFER: usize = 16;

/// Chunks of 1 MiB an export reads ahead of its reader.
const EXPORT_CHUNKS_BUFFERED: usize = 4;

/// Publishes a snapshot of `partition` and, if asked, trims its log to it; the summary that
/// `cairnctl snapshots create` prints.
async fn publish_snapshot(
    state: &NodeState,
    partition: Arc<Partition>,
    request: v1::CreateSnapshotRequest,
    on_progress: cairn_snapshots::ProgressFn,
) -> Result<v1::CreateSnapshotResponse, Status> {
    let created = state
        .create_snapshot(
            &partition,
            request.min_lsn.map(Lsn),
            Some(on_progress),
            request.full,
        )
        .await
        .map_err(status_of)?;
    let log_trim_point = if request.trim_log {
        // The trim leaves this snapshot (or a newer one) as the only way back to the records it
        // drops: every object it rests on is read back first, reused ones included, which may
        // have rotted since they were last checked.
        if let Some(snapshots) = &state.snapshots {
            snapshots
                .repository()
                .verify(created.snapshot_id)
                .await
                .map_err(|err| {
                    Status::data_loss(format!(
                        "snapshot {} was published, but the log was not trimmed: reading it back \
                         failed: {err}. Its LSN is archived all the same; run `cairnctl snapshots \
                         verify {}` to see what is wrong and repair or remove the object before \
                         trimming",
                        created.snapshot_id, created.snapshot_id
                    ))
                })?;
        }
        // The partition as it runs now (an online restore may have replaced it meanwhile), and
        // no restore while the trim runs.
        let partition = state
            .partitions
            .slot(created.partition_id)
            .ok_or_else(|| {
                Status::internal(format!("partition {} vanished", created.partition_id))
            })?
            .trim_log(created.lsn)
            .await
            .map_err(status_of)?;
        let log = partition
            .log()
            .state()
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        tracing::info!(partition = %partition.id(), trim_point = %log.trim_point, "log trimmed to the snapshot");
        Some(log.trim_point.0)
    } else {
        None
    };
    Ok(v1::CreateSnapshotResponse {
        log_trim_point,
        snapshot_id: created.snapshot_id.to_string(),
        partition_id: u32::from(created.partition_id.0),
        lsn: created.lsn.0,
        created: created.created,
        total_bytes: created.total_bytes,
        uploaded_bytes: created.uploaded_bytes,
        total_files: created.total_files as u32,
        uploaded_files: created.uploaded_files as u32,
    })
}

fn restore_progress(step: RestoreStep) -> v1::RestorePartitionProgress {
    let mut progress = v1::RestorePartitionProgress::default();
    match step {
        RestoreStep::Downloading {
            snapshot_id,
            bytes,
            total,
        } => {
            progress.phase = "download".into();
            progress.snapshot_id = snapshot_id.to_string();
            progress.bytes_done = bytes;
            progress.bytes_total = total;
        }
        RestoreStep::Importing { snapshot_id } => {
            progress.phase = "import".into();
            progress.snapshot_id = snapshot_id.to_string();
        }
        RestoreStep::Replaying { from, to } => {
            progress.phase = "replay".into();
            progress.message = format!("replaying the log from LSN {from} to {to}");
        }
        RestoreStep::Skipped {
            snapshot_id,
            reason,
        } => {
            progress.phase = "skipped".into();
            progress.snapshot_id = snapshot_id.to_string();
            progress.message = reason;
        }
    }
    progress
}

/// A file in the node's scratch folder with a name no other request uses, removed (with the
/// `.partial` file a writer may have left beside it) when dropped, however its user ends.
struct ScratchFile {
    path: std::path::PathBuf,
}

impl ScratchFile {
    fn new(dir: &std::path::Path, name: &str) -> ScratchFile {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let unique = NEXT.fetch_add(1, Ordering::Relaxed);
        ScratchFile {
            path: dir.join(format!("{unique}-{name}")),
        }
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let path = self.path.clone();
        let mut partial = path.clone().into_os_string();
        partial.push(".partial");
        let remove = move || {
            for path in [path, partial.into()] {
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => tracing::warn!(path = %path.display(), "remove scratch file: {e}"),
                }
            }
        };
        // Off the async threads when there is a runtime; at shut-down, in place.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

/// Writes snapshot `id` as a tar into `tar` and sends it on `tx`; a failure ends the stream with
/// its status.
async fn export_and_send(
    repository: &cairn_snapshots::SnapshotRepository,
    id: SnapshotId,
    tar: &ScratchFile,
    tx: &tokio::sync::mpsc::Sender<Result<v1::ExportSnapshotChunk, Status>>,
) {
    if let Err(err) = repository.export_tar(id, &tar.path).await {
        let _ = tx.send(Err(snapshot_status(err))).await;
        return;
    }
    match send_file(&tar.path, tx).await {
        Ok(true) => {}
        Ok(false) => abandoned(id),
        Err(err) => {
            let _ = tx
                .send(Err(Status::internal(format!("read snapshot tar: {err}"))))
                .await;
        }
    }
}

fn abandoned(id: SnapshotId) {
    tracing::info!(snapshot_id = %id, "export abandoned by its caller");
}

/// Sends the file at `path` in chunks, the first with its size; false if the receiver went away
/// before the end.
async fn send_file(
    path: &std::path::Path,
    tx: &tokio::sync::mpsc::Sender<Result<v1::ExportSnapshotChunk, Status>>,
) -> std::io::Result<bool> {
    use tokio::io::AsyncReadExt;
    const CHUNK_BYTES: usize = 1024 * 1024;
    let mut file = tokio::fs::File::open(path).await?;
    let mut total_bytes = file.metadata().await?.len();
    loop {
        let mut buf = vec![0u8; CHUNK_BYTES];
        let n = file.read(&mut buf).await?;
        if n == 0 {
            return Ok(true);
        }
        buf.truncate(n);
        let chunk = v1::ExportSnapshotChunk {
            data: buf.into(),
            total_bytes: std::mem::take(&mut total_bytes),
        };
        if tx.send(Ok(chunk)).await.is_err() {
            return Ok(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_insert_answers_refused_keys_apart_and_the_rest_per_key() {
        let refused = || Err(Status::unavailable("partition 3 is led by n2"));
        let answers = vec![Ok(true), refused(), Ok(false), refused()];
        let response = insert_answer(answers.clone(), true).unwrap();
        assert_eq!(response.inserted, vec![true, false, false, false]);
        assert_eq!(response.refused, vec![1, 3]);
        assert_eq!(response.refused_reason, "partition 3 is led by n2");
        assert!(response.failures.is_empty());
        // Without `partial`, the refused keys are failures: the call still says that the others
        // took effect.
        let response = insert_answer(answers, false).unwrap();
        assert_eq!(response.inserted, vec![true, false, false, false]);
        assert_eq!(response.failures.len(), 1);
        assert_eq!(response.failures[0].indices, vec![1, 3]);
        assert_eq!(response.failures[0].code, tonic::Code::Unavailable as i32);
        // An outcome that is not known is never answered as a refusal.
        let undecided = vec![
            Ok(true),
            refused(),
            Err(Status::deadline_exceeded("undecided")),
        ];
        let response = insert_answer(undecided, true).unwrap();
        assert_eq!(response.refused, vec![1]);
        assert_eq!(response.failures[0].indices, vec![2]);
        assert_eq!(
            response.failures[0].code,
            tonic::Code::DeadlineExceeded as i32
        );
    }

    #[test]
    fn a_whole_call_fails_only_when_nothing_was_done_or_nothing_is_known() {
        let refused = |p: u16| Err::<(), _>(Status::unavailable(format!("partition {p}")));
        let unknown = || Err::<(), _>(Status::deadline_exceeded("undecided"));
        // Every key refused: nothing done, the first refusal is the answer.
        let err = per_key(vec![refused(1), refused(2)]).unwrap_err();
        assert_eq!(err.message(), "partition 1");
        // Every key's outcome unknown.
        let err = per_key(vec![unknown(), unknown()]).unwrap_err();
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
        // Refused and unknown together: some of it may have been done, so per key.
        let (_, failures) = per_key(vec![refused(1), unknown(), refused(1)]).unwrap();
        assert_eq!(failures.len(), 2);
        assert_eq!(failures[0].indices, vec![0, 2]);
        assert_eq!(failures[1].indices, vec![1]);
        // Some done, one refused: per key.
        let (_, failures) = per_key(vec![Ok(()), refused(4)]).unwrap();
        assert_eq!(failures[0].indices, vec![1]);
        // All done.
        assert!(per_key(vec![Ok(()), Ok(())]).unwrap().1.is_empty());
    }
}
