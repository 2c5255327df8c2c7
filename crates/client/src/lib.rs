//! A client for a Cairn node: the key-value calls and the admin calls.
//!
//! Every error names the address it tried, so "connection refused" is never ambiguous.
//!
//! [`RoutingClient`] talks to a cluster: it sends each key straight to its partition's leader.
//!
//! Architecture invariant: the client knows only the wire protocol (`cairn-api`) and the key →
//! partition mapping (`cairn-types`); it shares no other code with the server.

use bytes::Bytes;
use cairn_api::MESSAGE_BYTES_MAX;
use cairn_api::v1::admin_client::AdminClient;
use cairn_api::v1::key_value_client::KeyValueClient;
use std::time::Duration;
use transport::Connection;

mod routing;
mod transport;

pub use cairn_api::v1;
pub use routing::{RETRY_FOR, RoutingClient, RoutingOptions};
pub use tonic::Code;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("{address} is not a valid node address: {detail}")]
    BadAddress { address: String, detail: String },
    #[error("cannot connect to {address}: {detail}")]
    Connect { address: String, detail: String },
    #[error("{address}: {}", status.message())]
    Rpc {
        address: String,
        status: tonic::Status,
    },
    /// Some keys of the request took effect and some did not: the node answered per key because
    /// the request's partitions fared differently. `failures` lists the others, by position in
    /// the request, with the status of each group.
    #[error(
        "{address}: {} of the request's {keys} keys did not take effect as asked ({}); the \
         others did",
        failures.iter().map(|(indices, _)| indices.len()).sum::<usize>(),
        failures
            .iter()
            .map(|(indices, status)| format!("{} keys: {:?}: {}", indices.len(), status.code(), status.message()))
            .collect::<Vec<_>>()
            .join("; ")
    )]
    Partial {
        address: String,
        keys: usize,
        failures: Vec<(Vec<usize>, tonic::Status)>,
    },
    /// The protocol carries TTLs as 64-bit milliseconds; the request was not sent.
    #[error(
        "a TTL of {} s is out of range: the protocol carries at most {} ms; give a shorter TTL (nodes accept up to 10 years)",
        ttl.as_secs(),
        u64::MAX
    )]
    TtlOutOfRange { ttl: Duration },
}

impl Error {
    /// The gRPC status code, if the node answered.
    pub fn code(&self) -> Option<Code> {
        match self {
            Error::Rpc { status, .. } => Some(status.code()),
            _ => None,
        }
    }

    /// Whether nothing of the request was done, so that sending it again is safe and may
    /// succeed: the node refused it (`UNAVAILABLE`: the partition's leadership is changing, or
    /// its leader cannot be reached), its record was fenced (`ABORTED`), or it was never sent
    /// (no connection could be made).
    pub fn nothing_done(&self) -> bool {
        match self {
            Error::Rpc { status, .. } => {
                matches!(status.code(), Code::Unavailable | Code::Aborted)
            }
            Error::Connect { .. } => true,
            Error::BadAddress { .. } | Error::TtlOutOfRange { .. } | Error::Partial { .. } => false,
        }
    }

    /// Whether the request may or may not have taken effect: it was sent and then no answer
    /// came (a timeout, a connection lost), or the node says it wrote it to the log but could
    /// not tell whether it was applied (`DEADLINE_EXCEEDED`). Read the keys to know; sending it
    /// again is not the same request (an insert-if-absent sent again would answer for the
    /// first one's insert).
    pub fn outcome_unknown(&self) -> bool {
        match self {
            Error::Rpc { status, .. } => {
                matches!(status.code(), Code::DeadlineExceeded | Code::Unknown)
            }
            Error::Partial { failures, .. } => failures
                .iter()
                .any(|(_, status)| matches!(status.code(), Code::DeadlineExceeded | Code::Unknown)),
            _ => false,
        }
    }
}

/// Per key, in request order: its answer, or its partition's failure (a node answers per key
/// when a request's partitions fared differently).
pub type PerKey<T> = Vec<Result<T>>;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_millis(5_000),
            request_timeout: Duration::from_millis(13_000),
        }
    }
}

/// How fresh a read's answer must be.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Consistency {
    /// Linearizable: every key is answered by its partition's leader, and the answer holds
    /// every write acknowledged before the read began.
    #[default]
    Linearizable,
    /// Any replica of a key's partition on the node the request reaches may answer, with what
    /// the partition held at most this long before the request: a follower answers once it has
    /// applied its log up to its leader's read index asked at most this long ago (a small call
    /// shared by the reads within the bound), and within the bound also while the leader cannot
    /// be reached. It gives up recency (a write acknowledged within the bound may be missing)
    /// and order (a later read may see an older value), so it is not linearizable even with
    /// zero (a follower may show a write not yet acknowledged, which the leader does not show
    /// yet); zero asks the read index for every read, so the answer holds every write
    /// acknowledged before the request.
    BoundedStaleness(Duration),
}

impl Consistency {
    /// The request field that asks for it.
    fn max_staleness_ms(self) -> Option<u64> {
        match self {
            Consistency::Linearizable => None,
            Consistency::BoundedStaleness(max) => {
                Some(max.as_millis().try_into().unwrap_or(u64::MAX))
            }
        }
    }
}

/// One entry of a put.
#[derive(Debug, Clone)]
pub struct PutEntry {
    pub key: Bytes,
    pub value: Bytes,
    pub ttl: Option<Duration>,
}

/// A connection to one node. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    address: String,
    kv: KeyValueClient<Connection>,
    admin: AdminClient<Connection>,
    /// Whether its key-value calls say that they come from a client that routes by itself
    /// ([`cairn_api::ROUTED_HEADER`]): the node then refuses what it does not lead instead of
    /// forwarding it.
    routed: bool,
}

impl Client {
    /// Connects to `address` (`http://host:port`, or `host:port`).
    pub async fn connect(address: &str, options: &ClientOptions) -> Result<Client> {
        let address = normalize_address(address);
        let bad = |detail: String| Error::BadAddress {
            address: address.clone(),
            detail,
        };
        let uri: http::Uri = address
            .parse()
            .map_err(|e: http::uri::InvalidUri| bad(e.to_string()))?;
        if uri.scheme() != Some(&http::uri::Scheme::HTTP) {
            return Err(bad(
                "only http:// is served (nodes do not speak TLS); give host:port".into(),
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| bad("no host; give host:port".into()))?;
        let channel =
            Connection::connect(authority, options.connect_timeout, options.request_timeout)
                .await
                .map_err(|e| Error::Connect {
                    address: address.clone(),
                    detail: error_chain(&e),
                })?;
        Ok(Client {
            kv: KeyValueClient::new(channel.clone())
                .max_decoding_message_size(MESSAGE_BYTES_MAX)
                .max_encoding_message_size(MESSAGE_BYTES_MAX),
            admin: AdminClient::new(channel)
                .max_decoding_message_size(MESSAGE_BYTES_MAX)
                .max_encoding_message_size(MESSAGE_BYTES_MAX),
            address,
            routed: false,
        })
    }

    /// This connection, for a client that routes by itself: its key-value calls carry
    /// [`cairn_api::ROUTED_HEADER`].
    pub(crate) fn routed(mut self) -> Client {
        self.routed = true;
        self
    }

    /// A key-value call's request, marked when this client routes by itself.
    fn kv_request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if self.routed {
            request.metadata_mut().insert(
                cairn_api::ROUTED_HEADER,
                tonic::metadata::MetadataValue::from_static("1"),
            );
        }
        request
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    fn rpc(&self, status: tonic::Status) -> Error {
        Error::Rpc {
            address: self.address.clone(),
            status,
        }
    }

    /// Stores every entry. `Err(Error::Partial)` when some took effect and some did not (see
    /// [`Client::put_each`]).
    pub async fn put(&self, entries: Vec<PutEntry>) -> Result<()> {
        let keys = entries.len();
        self.all_or_partial(keys, self.put_each(entries).await?)
            .map(|_| ())
    }

    /// [`Client::put`], answered per key.
    pub async fn put_each(&self, entries: Vec<PutEntry>) -> Result<PerKey<()>> {
        let count = entries.len();
        let request = v1::PutRequest {
            entries: entries
                .into_iter()
                .map(|e| {
                    Ok(v1::Entry {
                        key: e.key,
                        value: e.value,
                        ttl_ms: ttl_ms(e.ttl)?,
                    })
                })
                .collect::<Result<_>>()?,
        };
        let response = self
            .kv
            .clone()
            .put(self.kv_request(request))
            .await
            .map_err(|s| self.rpc(s))?
            .into_inner();
        Ok(self.per_key(vec![(); count], response.failures))
    }

    /// Answers of a call whose `failures` the node listed per key.
    fn per_key<T>(&self, values: Vec<T>, failures: Vec<v1::ShareFailure>) -> PerKey<T> {
        let mut answers: Vec<Result<T>> = values.into_iter().map(Ok).collect();
        for failure in failures {
            let status = tonic::Status::new(Code::from_i32(failure.code), failure.message);
            for index in failure.indices {
                if let Some(answer) = answers.get_mut(index as usize) {
                    *answer = Err(self.rpc(status.clone()));
                }
            }
        }
        answers
    }

    /// Per-key answers as one: all of them, or [`Error::Partial`] naming those that failed.
    fn all_or_partial<T>(&self, keys: usize, answers: PerKey<T>) -> Result<Vec<T>> {
        let mut values = Vec::with_capacity(answers.len());
        let mut failures: Vec<(Vec<usize>, tonic::Status)> = Vec::new();
        for (index, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(value) => values.push(value),
                Err(Error::Rpc { status, .. }) => {
                    match failures
                        .iter_mut()
                        .find(|(_, s)| s.code() == status.code() && s.message() == status.message())
                    {
                        Some((indices, _)) => indices.push(index),
                        None => failures.push((vec![index], status)),
                    }
                }
                Err(other) => return Err(other),
            }
        }
        if failures.is_empty() {
            return Ok(values);
        }
        Err(Error::Partial {
            address: self.address.clone(),
            keys,
            failures,
        })
    }

    /// Values in the order of `keys`; `None` for absent or expired keys.
    pub async fn get(&self, keys: Vec<Bytes>) -> Result<Vec<Option<Bytes>>> {
        self.get_with(keys, Consistency::Linearizable).await
    }

    /// [`Client::get`], as fresh as `consistency` asks.
    pub async fn get_with(
        &self,
        keys: Vec<Bytes>,
        consistency: Consistency,
    ) -> Result<Vec<Option<Bytes>>> {
        Ok(self
            .read(keys, false, consistency)
            .await?
            .into_iter()
            .map(|v| v.value)
            .collect())
    }

    /// Values and when they expire (ms since the Unix epoch, `None`: never), in the order of
    /// `keys`; `None` for absent or expired keys.
    pub async fn get_with_expiry(
        &self,
        keys: Vec<Bytes>,
    ) -> Result<Vec<Option<(Bytes, Option<u64>)>>> {
        Ok(self
            .read(keys, true, Consistency::Linearizable)
            .await?
            .into_iter()
            .map(|v| v.value.map(|value| (value, v.expires_at_ms)))
            .collect())
    }

    async fn read(
        &self,
        keys: Vec<Bytes>,
        with_expiry: bool,
        consistency: Consistency,
    ) -> Result<Vec<v1::MaybeValue>> {
        let response = self
            .kv
            .clone()
            .get(self.kv_request(v1::GetRequest {
                keys,
                with_expiry,
                max_staleness_ms: consistency.max_staleness_ms(),
            }))
            .await
            .map_err(|s| self.rpc(s))?;
        Ok(response.into_inner().values)
    }

    /// Per operation, in order: what it did (see the `Write` call of the key-value service).
    pub async fn write(
        &self,
        ops: Vec<v1::WriteOp>,
        all_or_nothing: bool,
    ) -> Result<Vec<v1::WriteResult>> {
        let count = ops.len();
        let answers = self.write_each(ops, all_or_nothing).await?;
        self.all_or_partial(count, answers)
    }

    /// [`Client::write`], answered per operation.
    pub async fn write_each(
        &self,
        ops: Vec<v1::WriteOp>,
        all_or_nothing: bool,
    ) -> Result<PerKey<v1::WriteResult>> {
        let response = self
            .kv
            .clone()
            .write(self.kv_request(v1::WriteRequest {
                ops,
                all_or_nothing,
            }))
            .await
            .map_err(|s| self.rpc(s))?
            .into_inner();
        Ok(self.per_key(response.results, response.failures))
    }

    pub async fn delete(&self, keys: Vec<Bytes>) -> Result<()> {
        let count = keys.len();
        let answers = self.delete_each(keys).await?;
        self.all_or_partial(count, answers).map(|_| ())
    }

    /// [`Client::delete`], answered per key.
    pub async fn delete_each(&self, keys: Vec<Bytes>) -> Result<PerKey<()>> {
        let count = keys.len();
        let response = self
            .kv
            .clone()
            .delete(self.kv_request(v1::DeleteRequest { keys }))
            .await
            .map_err(|s| self.rpc(s))?
            .into_inner();
        Ok(self.per_key(vec![(); count], response.failures))
    }

    pub async fn exists(&self, keys: Vec<Bytes>) -> Result<Vec<bool>> {
        self.exists_with(keys, Consistency::Linearizable).await
    }

    /// [`Client::exists`], as fresh as `consistency` asks.
    pub async fn exists_with(
        &self,
        keys: Vec<Bytes>,
        consistency: Consistency,
    ) -> Result<Vec<bool>> {
        let response = self
            .kv
            .clone()
            .exists(self.kv_request(v1::ExistsRequest {
                keys,
                max_staleness_ms: consistency.max_staleness_ms(),
            }))
            .await
            .map_err(|s| self.rpc(s))?;
        Ok(response.into_inner().exists)
    }

    /// Per key, in order: whether this call inserted it.
    pub async fn insert_if_absent(
        &self,
        keys: Vec<Bytes>,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Vec<bool>> {
        let count = keys.len();
        let answers = self.insert_if_absent_each(keys, value, ttl).await?;
        self.all_or_partial(count, answers)
    }

    async fn send_insert(
        &self,
        keys: Vec<Bytes>,
        value: Bytes,
        ttl: Option<Duration>,
        partial: bool,
    ) -> Result<v1::InsertIfAbsentResponse> {
        let response = self
            .kv
            .clone()
            .insert_if_absent(self.kv_request(v1::InsertIfAbsentRequest {
                keys,
                value,
                ttl_ms: ttl_ms(ttl)?,
                partial,
            }))
            .await
            .map_err(|s| self.rpc(s))?;
        Ok(response.into_inner())
    }

    /// [`Client::insert_if_absent`], answered per key: whether this call inserted it, or why
    /// its partition failed.
    pub async fn insert_if_absent_each(
        &self,
        keys: Vec<Bytes>,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Vec<Result<bool>>> {
        let count = keys.len();
        let response = self.send_insert(keys, value, ttl, true).await?;
        if response.inserted.len() != count {
            return Err(self.rpc(tonic::Status::internal(format!(
                "the node answered {} keys of {count}",
                response.inserted.len()
            ))));
        }
        let mut answers = self.per_key(response.inserted, response.failures);
        for index in response.refused {
            if let Some(answer) = answers.get_mut(index as usize) {
                *answer =
                    Err(self.rpc(tonic::Status::unavailable(response.refused_reason.clone())));
            }
        }
        Ok(answers)
    }

    /// Every node that joined the cluster.
    pub async fn list_nodes(&self) -> Result<Vec<v1::NodeInfo>> {
        let response = self
            .admin
            .clone()
            .list_nodes(v1::ListNodesRequest {})
            .await
            .map_err(|s| self.rpc(s))?;
        Ok(response.into_inner().nodes)
    }

    /// Has `node` follow `partition_ids`; streams how far each has come, ending with a message
    /// whose `done` is set once all have caught up. The load goes on if the stream is dropped.
    pub async fn load_partitions(
        &self,
        partition_ids: Vec<u32>,
        node: String,
    ) -> Result<tonic::Streaming<v1::LoadPartitionsProgress>> {
        self.admin
            .clone()
            .load_partitions(v1::LoadPartitionsRequest {
                partition_ids,
                node,
            })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    /// Removes a stopped node that leads and follows nothing from the cluster's members.
    pub async fn remove_node(&self, node: String) -> Result<()> {
        self.admin
            .clone()
            .remove_node(v1::RemoveNodeRequest { node })
            .await
            .map(|_| ())
            .map_err(|s| self.rpc(s))
    }

    /// Previews the balanced placement of every partition on `nodes`; changes nothing.
    pub async fn plan_placement(&self, nodes: Vec<String>) -> Result<v1::PlanPlacementResponse> {
        self.admin
            .clone()
            .plan_placement(v1::PlanPlacementRequest { nodes })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    /// Starts a scaling operation placing every partition, balanced, on `nodes`; see
    /// [`v1::StartScaleRequest`].
    pub async fn start_scale(&self, request: v1::StartScaleRequest) -> Result<v1::OperationInfo> {
        self.admin
            .clone()
            .start_scale(request)
            .await
            .map(|r| r.into_inner().operation.unwrap_or_default())
            .map_err(|s| self.rpc(s))
    }

    /// The scaling operations recorded, oldest first.
    pub async fn list_operations(&self) -> Result<Vec<v1::OperationInfo>> {
        self.admin
            .clone()
            .list_operations(v1::ListOperationsRequest {})
            .await
            .map(|r| r.into_inner().operations)
            .map_err(|s| self.rpc(s))
    }

    /// Asks the running operation `id` to stop.
    pub async fn cancel_operation(&self, id: u64) -> Result<v1::OperationInfo> {
        self.admin
            .clone()
            .cancel_operation(v1::CancelOperationRequest { id })
            .await
            .map(|r| r.into_inner().operation.unwrap_or_default())
            .map_err(|s| self.rpc(s))
    }

    pub async fn describe_cluster(&self) -> Result<v1::DescribeClusterResponse> {
        self.admin
            .clone()
            .describe_cluster(v1::DescribeClusterRequest {})
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    pub async fn list_partitions(&self) -> Result<v1::ListPartitionsResponse> {
        self.admin
            .clone()
            .list_partitions(v1::ListPartitionsRequest {})
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    pub async fn describe_partition(
        &self,
        partition_id: u32,
    ) -> Result<v1::DescribePartitionResponse> {
        self.admin
            .clone()
            .describe_partition(v1::DescribePartitionRequest { partition_id })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    /// Compacts a partition's store: a message when it starts, and the last one, with `done`
    /// set, once RocksDB is done, which for a large partition takes a while.
    pub async fn compact_partition(
        &self,
        partition_id: u32,
    ) -> Result<tonic::Streaming<v1::CompactPartitionProgress>> {
        self.admin
            .clone()
            .compact_partition(v1::CompactPartitionRequest { partition_id })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    pub async fn describe_logs(&self, log_id: Option<u32>) -> Result<Vec<v1::LogInfo>> {
        self.admin
            .clone()
            .describe_logs(v1::DescribeLogsRequest { log_id })
            .await
            .map(|r| r.into_inner().logs)
            .map_err(|s| self.rpc(s))
    }

    /// Trims log `log_id` up to `trim_point`. Refused past the archived LSN unless `force`.
    pub async fn trim_log(
        &self,
        log_id: u32,
        trim_point: u64,
        force: bool,
    ) -> Result<v1::TrimLogResponse> {
        self.admin
            .clone()
            .trim_log(v1::TrimLogRequest {
                log_id,
                trim_point,
                force,
            })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }
}

impl Client {
    /// Snapshots partition `partition_id` on its leader; streams the publish's progress, ending
    /// with a message whose `done` holds what was published. If a snapshot already covers
    /// `min_lsn`, it is returned with `created = false`. The publish is the node's: it goes on if
    /// this stream is dropped.
    pub async fn create_snapshot(
        &self,
        partition_id: u32,
        min_lsn: Option<u64>,
        trim_log: bool,
    ) -> Result<tonic::Streaming<v1::CreateSnapshotProgress>> {
        self.create_snapshot_with(v1::CreateSnapshotRequest {
            partition_id,
            min_lsn,
            trim_log,
            full: false,
        })
        .await
    }

    /// [`Client::create_snapshot`] with every option of the request (a full sync among them).
    pub async fn create_snapshot_with(
        &self,
        request: v1::CreateSnapshotRequest,
    ) -> Result<tonic::Streaming<v1::CreateSnapshotProgress>> {
        self.admin
            .clone()
            .create_snapshot(request)
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    pub async fn list_snapshots(
        &self,
        partition_id: Option<u32>,
    ) -> Result<v1::ListSnapshotsResponse> {
        self.admin
            .clone()
            .list_snapshots(v1::ListSnapshotsRequest { partition_id })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    /// The snapshot's metadata.json.
    pub async fn describe_snapshot(&self, snapshot_id: &str) -> Result<String> {
        self.admin
            .clone()
            .describe_snapshot(v1::DescribeSnapshotRequest {
                snapshot_id: id_bytes(snapshot_id),
            })
            .await
            .map(|r| r.into_inner().metadata_json)
            .map_err(|s| self.rpc(s))
    }

    pub async fn verify_snapshot(&self, snapshot_id: &str) -> Result<v1::VerifySnapshotResponse> {
        self.admin
            .clone()
            .verify_snapshot(v1::VerifySnapshotRequest {
                snapshot_id: id_bytes(snapshot_id),
            })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    /// The snapshot as a tar, chunk by chunk; the first chunk carries the total size.
    pub async fn export_snapshot(
        &self,
        snapshot_id: &str,
    ) -> Result<tonic::Streaming<v1::ExportSnapshotChunk>> {
        self.admin
            .clone()
            .export_snapshot(v1::ExportSnapshotRequest {
                snapshot_id: id_bytes(snapshot_id),
            })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    /// Restores a partition from a snapshot (the newest suitable, or `snapshot_id`); streams
    /// progress, ending with a message whose `done` is set.
    pub async fn restore_partition(
        &self,
        partition_id: u32,
        snapshot_id: Option<String>,
    ) -> Result<tonic::Streaming<v1::RestorePartitionProgress>> {
        self.admin
            .clone()
            .restore_partition(v1::RestorePartitionRequest {
                partition_id,
                snapshot_id: snapshot_id.as_deref().map(id_bytes),
            })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| self.rpc(s))
    }

    /// Wraps a status received mid-stream.
    pub fn stream_error(&self, status: tonic::Status) -> Error {
        self.rpc(status)
    }
}

/// `ttl` in the protocol's milliseconds; a TTL that does not fit is refused rather than wrapped.
fn ttl_ms(ttl: Option<Duration>) -> Result<Option<u64>> {
    ttl.map(|ttl| u64::try_from(ttl.as_millis()).map_err(|_| Error::TtlOutOfRange { ttl }))
        .transpose()
}

/// A snapshot id as the requests carry it.
fn id_bytes(snapshot_id: &str) -> Bytes {
    Bytes::copy_from_slice(snapshot_id.as_bytes())
}

pub(crate) fn normalize_address(address: &str) -> String {
    let trimmed = address.trim().trim_end_matches('/');
    if trimmed.contains("://") {
        trimmed.to_string()
    } else {
        format!("http://{trimmed}")
    }
}

/// The error and its causes on one line: transport errors hide the useful part ("connection
/// refused") in their source chain.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_get_a_scheme_and_lose_the_trailing_slash() {
        assert_eq!(normalize_address("localhost:5122"), "http://localhost:5122");
        assert_eq!(
            normalize_address("http://localhost:5122/"),
            "http://localhost:5122"
        );
    }

    #[test]
    fn ttls_past_64_bit_milliseconds_are_refused_not_wrapped() {
        // 2^64 ms + 384 ms: `as u64` made this a TTL of 384 ms.
        let ttl = Duration::from_secs(18_446_744_073_709_552);
        let err = ttl_ms(Some(ttl)).unwrap_err();
        assert!(matches!(err, Error::TtlOutOfRange { .. }), "{err}");
        assert!(err.to_string().contains("shorter TTL"), "{err}");
        let max = Duration::from_millis(u64::MAX);
        assert_eq!(ttl_ms(Some(max)).unwrap(), Some(u64::MAX));
        assert_eq!(ttl_ms(None).unwrap(), None);
    }

    #[tokio::test]
    async fn unreachable_node_names_the_address() {
        // Port 1 on loopback: nothing listens there.
        let err = Client::connect("127.0.0.1:1", &ClientOptions::default())
            .await
            .err()
            .unwrap();
        let text = err.to_string();
        assert!(text.contains("http://127.0.0.1:1"), "{text}");
        assert!(text.to_lowercase().contains("refused"), "{text}");
    }
}
