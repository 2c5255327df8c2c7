//! Routes in a cluster: which node leads each partition, and calls forwarded to it over the same
//! gRPC port clients use. A forwarded call carries [`FORWARDED`], and a node never forwards such
//! a call again: a node that does not lead the partition either answers `UNAVAILABLE`, so routes
//! that disagree for a moment (a leadership change) cost a retry, never a loop. Calls of a client
//! that routes by itself are not forwarded either: refused, it reads the routes again.

use bytes::Bytes;
use cairn_api::MESSAGE_BYTES_MAX;
use cairn_api::v1;
use cairn_api::v1::admin_client::AdminClient;
use cairn_api::v1::key_value_client::KeyValueClient;
use cairn_metadata::PartitionTable;
use cairn_partition_store::StoredValue;
use cairn_types::record::{Action, Condition, Expiry, WriteOp};
use cairn_types::{NodeId, PartitionId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

/// The metadata header a forwarded call carries.
pub const FORWARDED: &str = "cairn-forwarded";

/// How long a forwarded call may take; a little less than a client's default, so that the
/// forwarding node can still say what happened.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(12);

/// Whether `request` is to be served here or refused, never forwarded: another node forwarded it,
/// or a client that routes by itself sent it ([`cairn_api::ROUTED_HEADER`]); refused, such a
/// client reads the partition table again and sends the call to the leader it names.
pub fn not_to_forward<T>(request: &Request<T>) -> bool {
    let metadata = request.metadata();
    metadata.contains_key(FORWARDED) || metadata.contains_key(cairn_api::ROUTED_HEADER)
}

/// The leader of each partition and its address, as this node last learned them.
#[derive(Default)]
pub struct RouteTable {
    pub table: PartitionTable,
    pub addresses: HashMap<NodeId, String>,
}

impl RouteTable {
    /// The leader of `partition` and where to reach it.
    pub fn leader(&self, partition: PartitionId) -> Option<(&NodeId, Option<&String>)> {
        let leader = self.table.partitions.get(&partition)?.leader.as_ref()?;
        Some((leader, self.addresses.get(leader)))
    }
}

pub(crate) struct Routes {
    current: RwLock<Arc<RouteTable>>,
    /// Ticks at every update.
    changed: tokio::sync::watch::Sender<()>,
    peers: Mutex<HashMap<String, Peer>>,
}

#[derive(Clone)]
struct Peer {
    kv: KeyValueClient<Channel>,
    admin: AdminClient<Channel>,
}

impl Routes {
    pub fn new() -> Routes {
        Routes {
            current: RwLock::new(Arc::new(RouteTable::default())),
            changed: tokio::sync::watch::channel(()).0,
            peers: Mutex::new(HashMap::new()),
        }
    }

    pub fn current(&self) -> Arc<RouteTable> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes a new partition table and the nodes' addresses (those known before are kept for
    /// nodes not in `addresses`).
    pub fn update(&self, table: PartitionTable, addresses: HashMap<NodeId, String>) {
        let mut known = self.current().addresses.clone();
        known.extend(addresses);
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(RouteTable {
            table,
            addresses: known,
        });
        self.changed.send_replace(());
    }

    /// Waits for the next update of the routes, for at most `at_most`; whether one came.
    pub async fn changed_within(&self, at_most: Duration) -> bool {
        let mut changed = self.changed.subscribe();
        matches!(
            tokio::time::timeout(at_most, changed.changed()).await,
            Ok(Ok(()))
        )
    }

    /// Ends once `partition` is no longer led from `address` by the routes (a failover moved it
    /// while a call forwarded there was in flight: the old leader, paused or cut off, may never
    /// answer it).
    pub async fn moved_away(&self, partition: PartitionId, address: &str) {
        let mut changed = self.changed.subscribe();
        loop {
            match self.current().leader(partition) {
                Some((_, Some(leader))) if leader == address => {}
                _ => return,
            }
            if changed.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// A connection to the node at `address`, made once and kept.
    fn peer(&self, address: &str) -> Result<Peer, Status> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(peer) = peers.get(address) {
            return Ok(peer.clone());
        }
        let channel = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| Status::internal(format!("node address {address}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .timeout(FORWARD_TIMEOUT)
            .tcp_nodelay(true)
            .connect_lazy();
        let peer = Peer {
            kv: KeyValueClient::new(channel.clone())
                .max_decoding_message_size(MESSAGE_BYTES_MAX)
                .max_encoding_message_size(MESSAGE_BYTES_MAX),
            admin: AdminClient::new(channel)
                .max_decoding_message_size(MESSAGE_BYTES_MAX)
                .max_encoding_message_size(MESSAGE_BYTES_MAX),
        };
        peers.insert(address.to_string(), peer.clone());
        Ok(peer)
    }

    pub async fn put(&self, address: &str, entries: Vec<v1::Entry>) -> Result<(), Status> {
        let mut kv = self.peer(address)?.kv;
        let answer = kv
            .put(mark(v1::PutRequest { entries }))
            .await
            .map_err(|s| from(address, s, Call::Write))?;
        whole(address, &answer.into_inner().failures)
    }

    /// The values of `keys`, with their expiries if `with_expiry`, as fresh as `freshness` asks.
    pub async fn get(
        &self,
        address: &str,
        keys: Vec<Bytes>,
        with_expiry: bool,
        freshness: crate::service::Freshness,
    ) -> Result<Vec<Option<StoredValue>>, Status> {
        let mut kv = self.peer(address)?.kv;
        let answer = kv
            .get(mark(v1::GetRequest {
                keys,
                with_expiry,
                max_staleness_ms: freshness.max_staleness_ms(),
            }))
            .await
            .map_err(|s| from(address, s, Call::Read))?;
        Ok(answer
            .into_inner()
            .values
            .into_iter()
            .map(|v| {
                v.value.map(|value| StoredValue {
                    value,
                    expires_at_ms: v.expires_at_ms,
                })
            })
            .collect())
    }

    pub async fn write(
        &self,
        address: &str,
        request: v1::WriteRequest,
    ) -> Result<Vec<v1::WriteResult>, Status> {
        let mut kv = self.peer(address)?.kv;
        let answer = kv
            .write(mark(request))
            .await
            .map_err(|s| from(address, s, Call::Write))?
            .into_inner();
        whole(address, &answer.failures)?;
        Ok(answer.results)
    }

    pub async fn exists(
        &self,
        address: &str,
        keys: Vec<Bytes>,
        freshness: crate::service::Freshness,
    ) -> Result<Vec<bool>, Status> {
        let mut kv = self.peer(address)?.kv;
        let answer = kv
            .exists(mark(v1::ExistsRequest {
                keys,
                max_staleness_ms: freshness.max_staleness_ms(),
            }))
            .await
            .map_err(|s| from(address, s, Call::Read))?;
        Ok(answer.into_inner().exists)
    }

    /// The read index of `partition` (see the `ReadIndex` call), asked of its leader at
    /// `address`, within `within`.
    pub async fn read_index(
        &self,
        address: &str,
        partition: cairn_types::PartitionId,
        within: Duration,
    ) -> Result<cairn_types::Lsn, Status> {
        let mut kv = self.peer(address)?.kv;
        let mut request = mark(v1::ReadIndexRequest {
            partition_id: u32::from(partition.0),
        });
        request.set_timeout(within);
        let answer = kv
            .read_index(request)
            .await
            .map_err(|s| from(address, s, Call::Read))?;
        Ok(cairn_types::Lsn(answer.into_inner().lsn))
    }

    pub async fn delete(&self, address: &str, keys: Vec<Bytes>) -> Result<(), Status> {
        let mut kv = self.peer(address)?.kv;
        let answer = kv
            .delete(mark(v1::DeleteRequest { keys }))
            .await
            .map_err(|s| from(address, s, Call::Write))?;
        whole(address, &answer.into_inner().failures)
    }

    pub async fn insert_if_absent(
        &self,
        address: &str,
        request: v1::InsertIfAbsentRequest,
    ) -> Result<Vec<bool>, Status> {
        let mut kv = self.peer(address)?.kv;
        let answer = kv
            .insert_if_absent(mark(request))
            .await
            .map_err(|s| from(address, s, Call::Write))?
            .into_inner();
        whole(address, &answer.failures)?;
        Ok(answer.inserted)
    }

    /// An admin client of the node at `address`, whose calls say they were forwarded.
    pub fn admin(&self, address: &str) -> Result<AdminClient<Channel>, Status> {
        Ok(self.peer(address)?.admin)
    }
}

/// `message` as a request that says it was forwarded.
pub fn mark<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
    request
}

/// A status of a call forwarded to the node at `address`, saying where it came from. A status
/// that node answered is kept as it is. One this node's own connection made up (the node could
/// not be reached, or the connection failed, or the call timed out) says nothing was done only
/// when nothing was sent (the connection could not be made) or the call was a read; otherwise
/// the call may have been taken, and its outcome is unknown.
fn from(address: &str, status: Status, call: Call) -> Status {
    // A node's answer carries its response headers; a status made up here has none.
    let answered = status.metadata().get("content-type").is_some();
    let message = format!("(forwarded to {address}) {}", status.message());
    if answered {
        return Status::new(status.code(), message);
    }
    let not_sent = status.code() == tonic::Code::Unavailable
        && (status.message().contains("connect")
            || status.message().contains("Connection refused"));
    match call {
        Call::Read => Status::unavailable(message),
        Call::Write if not_sent => Status::unavailable(message),
        Call::Write => Status::unknown(format!(
            "{message}: the connection to the partition's leader failed after the request was \
             sent, so it may or may not have taken effect; read the keys to know"
        )),
    }
}

/// A forwarded share is one partition's, which fares as a whole: a failure the leader answered
/// per key is the share's.
fn whole(address: &str, failures: &[v1::ShareFailure]) -> Result<(), Status> {
    match failures.first() {
        None => Ok(()),
        Some(failure) => Err(Status::new(
            tonic::Code::from_i32(failure.code),
            format!("(forwarded to {address}) {}", failure.message),
        )),
    }
}

/// What a forwarded call does, for what its failure means.
#[derive(Clone, Copy)]
enum Call {
    Read,
    Write,
}

/// A conditional operation as a forwarded call carries it.
pub fn wire_op(op: &WriteOp) -> v1::WriteOp {
    use v1::expiry_spec::When;
    let spec = |expiry: &Expiry| v1::ExpirySpec {
        when: Some(match *expiry {
            Expiry::Never => When::Never(v1::expiry_spec::Never {}),
            Expiry::After(ms) => When::AfterMs(ms),
            Expiry::At(at) => When::AtMs(at),
            Expiry::Keep => When::Keep(v1::expiry_spec::Keep {}),
        }),
    };
    let action = match &op.action {
        Action::Set { value, expiry } => v1::write_op::Action::Set(v1::SetAction {
            value: value.clone(),
            expiry: Some(spec(expiry)),
        }),
        Action::Expire { expiry } => v1::write_op::Action::Expire(v1::ExpireAction {
            expiry: Some(spec(expiry)),
        }),
        Action::Delete => v1::write_op::Action::Delete(v1::DeleteAction {}),
    };
    let condition = match op.condition {
        Condition::Always => v1::WriteCondition::Always,
        Condition::IfAbsent => v1::WriteCondition::IfAbsent,
        Condition::IfPresent => v1::WriteCondition::IfPresent,
        Condition::IfNoExpiry => v1::WriteCondition::IfNoExpiry,
        Condition::IfHasExpiry => v1::WriteCondition::IfHasExpiry,
        Condition::IfLater => v1::WriteCondition::IfLater,
        Condition::IfEarlier => v1::WriteCondition::IfEarlier,
        Condition::IfHasEarlierExpiry => v1::WriteCondition::IfHasEarlierExpiry,
    };
    v1::WriteOp {
        key: op.key.clone(),
        action: Some(action),
        condition: condition as i32,
        return_old: op.return_old,
    }
}
