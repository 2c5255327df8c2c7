//! A client of a cluster that sends each key straight to its partition's leader, instead of
//! letting the node it talks to forward the keys it does not lead.
//!
//! It learns the partition table (leader per partition, and the table's version) and the nodes'
//! addresses from one node, keeps a connection per leader, splits every request by leader and
//! merges the answers in request order. Its calls to leaders say that they are routed
//! ([`cairn_api::ROUTED_HEADER`]), so a node that does not lead a share's partitions (it lost
//! them, or the table this client holds is older than the node's) refuses it instead of
//! forwarding it. A share answered `UNAVAILABLE` (such a refusal, or a node taking the partition
//! over: nothing of it was done) is sent again, alone, once the table was read anew, up to
//! [`ATTEMPTS`] times: shares that succeeded are never sent twice. Partitions whose leader it
//! cannot reach go through the seed node, which forwards them.
//! An insert-if-absent asks the node to answer apart the keys of partitions that refused them
//! (`partial`), so that only those are sent again and each key's answer is what its one
//! accepted attempt did; a share that spans partitions is never sent twice for a refusal of one
//! of them. A share whose outcome is unknown (`DEADLINE_EXCEEDED`) is never sent again.

use crate::{Client, ClientOptions, PutEntry, Result};
use bytes::Bytes;
use cairn_types::keys::partition_for_key;
use cairn_types::partition_key;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tonic::Code;

/// Times a share is sent before its error is the answer.
pub const ATTEMPTS: usize = 4;

/// Pause before a share is sent again, doubled each time.
const BACKOFF: Duration = Duration::from_millis(50);

/// Where each partition's leader is.
struct Routes {
    /// The partition table's version these routes were read at.
    version: u64,
    num_partitions: u16,
    /// Per partition, a connection to its leader; `None`: unknown, ask the seed node.
    leaders: Vec<Option<Client>>,
}

/// A cluster client that routes by itself. Cheap to clone.
#[derive(Clone)]
pub struct RoutingClient {
    seed: Client,
    options: ClientOptions,
    routes: Arc<RwLock<Arc<Routes>>>,
}

impl RoutingClient {
    /// Connects to the node at `address` and reads the partition table from it.
    pub async fn connect(address: &str, options: &ClientOptions) -> Result<RoutingClient> {
        let seed = Client::connect(address, options).await?;
        let client = RoutingClient {
            seed,
            options: options.clone(),
            routes: Arc::new(RwLock::new(Arc::new(Routes {
                version: 0,
                num_partitions: 0,
                leaders: Vec::new(),
            }))),
        };
        client.refresh().await?;
        Ok(client)
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

    /// Reads the partition table and the nodes' addresses again from the seed node; connections
    /// to leaders already known are kept.
    pub async fn refresh(&self) -> Result<()> {
        let cluster = self.seed.describe_cluster().await?;
        let table = self.seed.list_partitions().await?;
        let addresses: HashMap<String, String> = self
            .seed
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
    /// the per-key answers back in order; shares, and keys of a share, answered `UNAVAILABLE`
    /// are routed again. A node answers a share that spans partitions with its first error,
    /// though the others may have taken effect: a call that must not run twice
    /// (insert-if-absent) answers its refused keys apart instead.
    async fn scatter<T, F, Fut>(&self, keys: &[Bytes], call: F) -> Result<Vec<T>>
    where
        T: Clone + Default,
        F: Fn(Client, Vec<usize>) -> Fut,
        Fut: Future<Output = Result<Vec<Result<T>>>>,
    {
        let mut out = vec![T::default(); keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let mut backoff = BACKOFF;
        for attempt in 1..=ATTEMPTS {
            let routes = self.current();
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
                    .unwrap_or_else(|| self.seed.clone());
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
            let mut last_error = None;
            let retry =
                |err: &crate::Error| err.code() == Some(Code::Unavailable) && attempt < ATTEMPTS;
            for (indices, answer) in answers {
                match answer {
                    Ok(values) => {
                        for (i, value) in indices.into_iter().zip(values) {
                            match value {
                                Ok(value) => out[i] = value,
                                Err(err) if retry(&err) => {
                                    pending.push(i);
                                    last_error = Some(err);
                                }
                                Err(err) => return Err(err),
                            }
                        }
                    }
                    Err(err) if retry(&err) => {
                        pending.extend(indices);
                        last_error = Some(err);
                    }
                    Err(err) => return Err(err),
                }
            }
            if last_error.is_none() {
                return Ok(out);
            }
            pending.sort_unstable();
            tokio::time::sleep(backoff).await;
            backoff *= 2;
            // A failed refresh keeps the routes known; the next attempt's answers say more.
            let _ = self.refresh().await;
        }
        unreachable!("the last attempt returns")
    }

    pub async fn put(&self, entries: Vec<PutEntry>) -> Result<()> {
        let keys: Vec<Bytes> = entries.iter().map(|e| e.key.clone()).collect();
        let entries = &entries;
        self.scatter(&keys, |client, indices| async move {
            let mine = indices.iter().map(|&i| entries[i].clone()).collect();
            client
                .put(mine)
                .await
                .map(|()| indices.iter().map(|_| Ok(())).collect())
        })
        .await
        .map(|_| ())
    }

    /// Values in the order of `keys`; `None` for absent or expired keys.
    pub async fn get(&self, keys: Vec<Bytes>) -> Result<Vec<Option<Bytes>>> {
        let all = &keys;
        self.scatter(&keys, |client, indices| async move {
            client
                .get(indices.iter().map(|&i| all[i].clone()).collect())
                .await
                .map(each_ok)
        })
        .await
    }

    pub async fn delete(&self, keys: Vec<Bytes>) -> Result<()> {
        let all = &keys;
        self.scatter(&keys, |client, indices| async move {
            client
                .delete(indices.iter().map(|&i| all[i].clone()).collect())
                .await
                .map(|()| indices.iter().map(|_| Ok(())).collect())
        })
        .await
        .map(|_| ())
    }

    pub async fn exists(&self, keys: Vec<Bytes>) -> Result<Vec<bool>> {
        let all = &keys;
        self.scatter(&keys, |client, indices| async move {
            client
                .exists(indices.iter().map(|&i| all[i].clone()).collect())
                .await
                .map(each_ok)
        })
        .await
    }

    /// Per key, in order: whether this call inserted it.
    pub async fn insert_if_absent(
        &self,
        keys: Vec<Bytes>,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Vec<bool>> {
        let all = &keys;
        let value = &value;
        self.scatter(&keys, |client, indices| async move {
            client
                .insert_if_absent_partial(
                    indices.iter().map(|&i| all[i].clone()).collect(),
                    value.clone(),
                    ttl,
                )
                .await
        })
        .await
    }

    /// The admin calls, and anything else, through the seed node.
    pub fn seed(&self) -> &Client {
        &self.seed
    }
}

/// Every key of a share answered.
fn each_ok<T>(values: Vec<T>) -> Vec<Result<T>> {
    values.into_iter().map(Ok).collect()
}

impl std::fmt::Debug for RoutingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutingClient")
            .field("seed", &self.seed.address())
            .field("table_version", &self.table_version())
            .finish()
    }
}
