//! A client of a cluster that sends each key straight to its partition's leader, instead of
//! letting the node it talks to forward the keys it does not lead, and that rides through a
//! failover.
//!
//! It learns the partition table (leader per partition, and the table's version) and the nodes'
//! addresses from any of its seed nodes, keeps a connection per leader, splits every request by
//! leader and merges the answers in request order. Its calls to leaders say that they are routed
//! ([`cairn_api::ROUTED_HEADER`]), so a node that does not lead a share's partitions (it lost
//! them, or the table this client holds is older than the node's) refuses it instead of
//! forwarding it.
//!
//! # Riding through a failover
//! A key whose share was refused with nothing done ([`Error::nothing_done`]: `UNAVAILABLE`,
//! `ABORTED`, or a node that cannot be reached) is sent again, alone with the other refused keys,
//! once the table was read anew, with a pause that doubles from 50 ms up to 250 ms, for up to
//! [`RoutingOptions::retry_for`] (10 s by default: longer than a failover, which takes about the
//! node timeout, 3 s). A key whose outcome is unknown (the request was sent, then the connection
//! failed or no answer came; or the node wrote it to the log but cannot say whether it was
//! applied) is never sent again: its answer is that error, so the caller knows it may have taken
//! effect. A key that took effect is never sent twice. Reads, which change nothing, are sent
//! again after an unknown outcome too. Partitions whose leader it cannot reach go through a seed
//! node, which forwards them (and itself waits out a failover).

use crate::{Client, ClientOptions, Consistency, Error, PerKey, PutEntry, Result};
use bytes::Bytes;
use cairn_types::keys::partition_for_key;
use cairn_types::partition_key;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// How long a key refused with nothing done is sent again, by default.
pub const RETRY_FOR: Duration = Duration::from_secs(10);

/// The pause before a key is sent again, doubled each time up to [`BACKOFF_MAX`].
const BACKOFF: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_millis(250);

/// How a [`RoutingClient`] rides through a failover.
#[derive(Debug, Clone)]
pub struct RoutingOptions {
    /// How long a key refused with nothing done is sent again before its refusal is the answer.
    pub retry_for: Duration,
}

impl Default for RoutingOptions {
    fn default() -> Self {
        RoutingOptions {
            retry_for: RETRY_FOR,
        }
    }
}

/// Where each partition's leader is.
struct Routes {
    /// The partition table's version these routes were read at.
    version: u64,
    num_partitions: u16,
    /// Per partition, a connection to its leader; `None`: unknown, ask a seed node.
    leaders: Vec<Option<Client>>,
}

/// A cluster client that routes by itself. Cheap to clone.
#[derive(Clone)]
pub struct RoutingClient {
    /// The nodes it was given; the first that answers serves the table and the keys of
    /// partitions with no known leader.
    seeds: Vec<String>,
    /// The seed that answered last.
    seed: Arc<RwLock<Client>>,
    options: ClientOptions,
    routing: RoutingOptions,
    routes: Arc<RwLock<Arc<Routes>>>,
}

/// What a call does, for whether a key whose outcome is unknown may be sent again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Effect {
    Read,
    Write,
}

impl RoutingClient {
    /// Connects to the node at `address` and reads the partition table from it.
    pub async fn connect(address: &str, options: &ClientOptions) -> Result<RoutingClient> {
        RoutingClient::connect_any(&[address], options, &RoutingOptions::default()).await
    }

    /// Connects to the first of `seeds` that answers (each `host:port` or `http://host:port`)
    /// and reads the partition table from it; the others stand in when it does not answer.
    pub async fn connect_any(
        seeds: &[&str],
        options: &ClientOptions,
        routing: &RoutingOptions,
    ) -> Result<RoutingClient> {
        let mut last = None;
        for seed in seeds {
            match Client::connect(seed, options).await {
                Ok(seed) => {
                    let client = RoutingClient {
                        seeds: seeds.iter().map(|s| s.to_string()).collect(),
                        seed: Arc::new(RwLock::new(seed)),
                        options: options.clone(),
                        routing: routing.clone(),
                        routes: Arc::new(RwLock::new(Arc::new(Routes {
                            version: 0,
                            num_partitions: 0,
                            leaders: Vec::new(),
                        }))),
                    };
                    match client.refresh().await {
                        Ok(()) => return Ok(client),
                        Err(err) => last = Some(err),
                    }
                }
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or_else(|| Error::BadAddress {
            address: String::new(),
            detail: "no seed node given; give at least one host:port".into(),
        }))
    }

    /// The version of the partition table the routes come from.
    pub fn table_version(&self) -> u64 {
        self.current().version
    }

    fn current(&self) -> Arc<Routes> {
        self.routes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The admin calls, and anything else, through the seed node that answered last.
    pub fn seed(&self) -> Client {
        self.seed.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Reads the partition table and the nodes' addresses again, from the seed that answered
    /// last or else from the others in turn; connections to leaders already known are kept.
    pub async fn refresh(&self) -> Result<()> {
        let current = self.seed();
        match self.refresh_from(&current).await {
            Ok(()) => return Ok(()),
            Err(err) if self.seeds.len() <= 1 => return Err(err),
            Err(_) => {}
        }
        let mut last = None;
        for address in &self.seeds {
            if crate::normalize_address(address) == current.address() {
                continue;
            }
            let seed = match Client::connect(address, &self.options).await {
                Ok(seed) => seed,
                Err(err) => {
                    last = Some(err);
                    continue;
                }
            };
            match self.refresh_from(&seed).await {
                Ok(()) => {
                    *self.seed.write().unwrap_or_else(|p| p.into_inner()) = seed;
                    return Ok(());
                }
                Err(err) => last = Some(err),
            }
        }
        Err(last.expect("a seed other than the current one was tried"))
    }

    async fn refresh_from(&self, seed: &Client) -> Result<()> {
        let cluster = seed.describe_cluster().await?;
        let table = seed.list_partitions().await?;
        let addresses: HashMap<String, String> = seed
            .list_nodes()
            .await?
            .into_iter()
            .filter(|n| n.alive)
            .map(|n| (n.name, n.address))
            .collect();
        let known: HashMap<String, Client> = self
            .current()
            .leaders
            .iter()
            .flatten()
            .map(|c| (c.address().to_string(), c.clone()))
            .collect();
        let mut connected: HashMap<String, Option<Client>> = HashMap::new();
        let mut leaders = vec![None; cluster.num_partitions as usize];
        for partition in table.partitions {
            let Some(address) = addresses.get(&partition.leader) else {
                continue;
            };
            let normalized = crate::normalize_address(address);
            let client = match connected.get(&normalized) {
                Some(client) => client.clone(),
                None => {
                    let client = match known.get(&normalized) {
                        Some(client) => Some(client.clone()),
                        // A leader that cannot be reached now is reached through the seed.
                        None => Client::connect(address, &self.options)
                            .await
                            .ok()
                            .map(Client::routed),
                    };
                    connected.insert(normalized, client.clone());
                    client
                }
            };
            if let Some(slot) = leaders.get_mut(partition.partition_id as usize) {
                *slot = client;
            }
        }
        *self.routes.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(Routes {
            version: table.partition_table_version,
            num_partitions: cluster.num_partitions as u16,
            leaders,
        });
        Ok(())
    }

    /// Runs `call` on each leader's share of `keys` (their indices in request order) and puts
    /// the per-key answers back in order. Keys refused with nothing done are routed again and
    /// sent again until [`RoutingOptions::retry_for`] has passed; see the module's docs.
    async fn scatter<T, F, Fut>(&self, keys: &[Bytes], effect: Effect, call: F) -> PerKey<T>
    where
        F: Fn(Client, Vec<usize>) -> Fut,
        Fut: Future<Output = Result<PerKey<T>>>,
    {
        let mut out: Vec<Option<Result<T>>> = (0..keys.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let mut backoff = BACKOFF;
        let deadline = Instant::now() + self.routing.retry_for;
        loop {
            let routes = self.current();
            let seed = self.seed();
            let mut shares: BTreeMap<String, (Client, Vec<usize>)> = BTreeMap::new();
            for &i in &pending {
                let partition = if routes.num_partitions == 0 {
                    0
                } else {
                    partition_for_key(partition_key(&keys[i]), routes.num_partitions).0 as usize
                };
                let client = routes
                    .leaders
                    .get(partition)
                    .cloned()
                    .flatten()
                    .unwrap_or_else(|| seed.clone());
                shares
                    .entry(client.address().to_string())
                    .or_insert_with(|| (client, Vec::new()))
                    .1
                    .push(i);
            }
            let answers =
                futures::future::join_all(shares.into_values().map(|(client, indices)| {
                    let call = call(client, indices.clone());
                    async move { (indices, call.await) }
                }))
                .await;
            pending.clear();
            let retry_time = Instant::now() + backoff < deadline;
            let again = |err: &Error| {
                retry_time
                    && (err.nothing_done() || (effect == Effect::Read && err.outcome_unknown()))
            };
            for (indices, answer) in answers {
                match answer {
                    Ok(values) => {
                        for (i, value) in indices.into_iter().zip(values) {
                            match value {
                                Err(err) if again(&err) => pending.push(i),
                                value => out[i] = Some(value),
                            }
                        }
                    }
                    Err(err) if again(&err) => pending.extend(indices),
                    Err(err) => {
                        // The whole share failed the same way: each key has the error.
                        for i in indices {
                            out[i] = Some(Err(err.clone()));
                        }
                    }
                }
            }
            if pending.is_empty() {
                break;
            }
            pending.sort_unstable();
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
            // A failed refresh keeps the routes known; the next attempt's answers say more.
            let _ = self.refresh().await;
        }
        out.into_iter()
            .map(|answer| answer.expect("every key is answered"))
            .collect()
    }

    pub async fn put(&self, entries: Vec<PutEntry>) -> Result<()> {
        all_or_partial(self.put_each(entries).await).map(|_| ())
    }

    /// [`RoutingClient::put`], answered per key.
    pub async fn put_each(&self, entries: Vec<PutEntry>) -> PerKey<()> {
        let keys: Vec<Bytes> = entries.iter().map(|e| e.key.clone()).collect();
        let entries = &entries;
        self.scatter(&keys, Effect::Write, |client, indices| async move {
            client
                .put_each(indices.iter().map(|&i| entries[i].clone()).collect())
                .await
        })
        .await
    }

    /// Values in the order of `keys`; `None` for absent or expired keys.
    pub async fn get(&self, keys: Vec<Bytes>) -> Result<Vec<Option<Bytes>>> {
        self.get_with(keys, Consistency::Linearizable).await
    }

    /// [`RoutingClient::get`], as fresh as `consistency` asks. Keys still go to their leaders
    /// (this client knows no other replica), which answer as they would a linearizable read;
    /// the keys of a leader this client could not connect to go to its seed node, which may
    /// then answer from its own replica.
    pub async fn get_with(
        &self,
        keys: Vec<Bytes>,
        consistency: Consistency,
    ) -> Result<Vec<Option<Bytes>>> {
        let all = &keys;
        all_or_partial(
            self.scatter(&keys, Effect::Read, |client, indices| async move {
                client
                    .get_with(
                        indices.iter().map(|&i| all[i].clone()).collect(),
                        consistency,
                    )
                    .await
                    .map(each_ok)
            })
            .await,
        )
    }

    pub async fn delete(&self, keys: Vec<Bytes>) -> Result<()> {
        all_or_partial(self.delete_each(keys).await).map(|_| ())
    }

    /// [`RoutingClient::delete`], answered per key.
    pub async fn delete_each(&self, keys: Vec<Bytes>) -> PerKey<()> {
        let all = &keys;
        self.scatter(&keys, Effect::Write, |client, indices| async move {
            client
                .delete_each(indices.iter().map(|&i| all[i].clone()).collect())
                .await
        })
        .await
    }

    pub async fn exists(&self, keys: Vec<Bytes>) -> Result<Vec<bool>> {
        self.exists_with(keys, Consistency::Linearizable).await
    }

    /// [`RoutingClient::exists`], as fresh as `consistency` asks (see
    /// [`RoutingClient::get_with`]).
    pub async fn exists_with(
        &self,
        keys: Vec<Bytes>,
        consistency: Consistency,
    ) -> Result<Vec<bool>> {
        let all = &keys;
        all_or_partial(
            self.scatter(&keys, Effect::Read, |client, indices| async move {
                client
                    .exists_with(
                        indices.iter().map(|&i| all[i].clone()).collect(),
                        consistency,
                    )
                    .await
                    .map(each_ok)
            })
            .await,
        )
    }

    /// Per key, in order: whether this call inserted it.
    pub async fn insert_if_absent(
        &self,
        keys: Vec<Bytes>,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Vec<bool>> {
        all_or_partial(self.insert_if_absent_each(keys, value, ttl).await)
    }

    /// [`RoutingClient::insert_if_absent`], answered per key.
    pub async fn insert_if_absent_each(
        &self,
        keys: Vec<Bytes>,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> PerKey<bool> {
        let all = &keys;
        let value = &value;
        self.scatter(&keys, Effect::Write, |client, indices| async move {
            client
                .insert_if_absent_each(
                    indices.iter().map(|&i| all[i].clone()).collect(),
                    value.clone(),
                    ttl,
                )
                .await
        })
        .await
    }
}

/// Every key of a share answered.
fn each_ok<T>(values: Vec<T>) -> PerKey<T> {
    values.into_iter().map(Ok).collect()
}

/// Per-key answers as one: all of them; the one error when every key failed alike and nothing
/// took effect; else [`Error::Partial`].
fn all_or_partial<T>(answers: PerKey<T>) -> Result<Vec<T>> {
    let keys = answers.len();
    let mut values = Vec::with_capacity(keys);
    let mut failures: Vec<(Vec<usize>, tonic::Status)> = Vec::new();
    let mut first = None;
    let mut address = String::new();
    for (index, answer) in answers.into_iter().enumerate() {
        match answer {
            Ok(value) => values.push(value),
            Err(err) => {
                let status = match &err {
                    Error::Rpc {
                        address: at,
                        status,
                    } => {
                        address.clone_from(at);
                        status.clone()
                    }
                    other => tonic::Status::unknown(other.to_string()),
                };
                match failures
                    .iter_mut()
                    .find(|(_, s)| s.code() == status.code() && s.message() == status.message())
                {
                    Some((indices, _)) => indices.push(index),
                    None => failures.push((vec![index], status)),
                }
                first.get_or_insert(err);
            }
        }
    }
    match first {
        None => Ok(values),
        Some(err) if values.is_empty() && failures.len() == 1 => Err(err),
        Some(_) => Err(Error::Partial {
            address,
            keys,
            failures,
        }),
    }
}

impl std::fmt::Debug for RoutingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutingClient")
            .field("seeds", &self.seeds)
            .field("table_version", &self.table_version())
            .finish()
    }
}
