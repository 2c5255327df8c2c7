//! Cairn's side: a node of its own in a temporary folder (gRPC and the Redis protocol on free
//! loopback ports, no metrics port, so that it runs beside any Cairn node on the machine), started
//! and waited for until every partition serves.

use crate::Args;
use crate::drive::{Connection, Workload};
use anyhow::Context;
use bytes::Bytes;
use cairn_client::{Client, ClientOptions, PutEntry};
use std::time::Duration;

/// The benchmark's node, serving.
pub struct Node {
    node: cairn_node::RunningNode,
    address: String,
    dir: tempfile::TempDir,
}

impl Node {
    /// Starts a node with `--partitions` partitions and returns once every one of them serves.
    pub async fn start(args: &Args) -> anyhow::Result<Node> {
        let dir = tokio::task::spawn_blocking(tempfile::tempdir)
            .await
            .context("create the Cairn node's temporary folder")?
            .context("create the Cairn node's temporary folder")?;
        let mut partition_store = cairn_node::config::PartitionStoreConfig::default();
        if let Some(bytes) = args.write_buffer_bytes {
            partition_store.write_buffer_bytes = bytes;
        }
        if let Some(style) = args.compaction_style {
            partition_store.compaction_style = style.for_node();
        }
        if let Some(bytes) = args.block_bytes {
            partition_store.block_bytes = bytes;
        }
        let config = cairn_node::Config {
            partition_store,
            base_dir: dir.path().to_path_buf(),
            bind_address: "127.0.0.1:0".parse()?,
            num_partitions: args.partitions,
            metrics: cairn_node::config::MetricsConfig { bind_address: None },
            resp: cairn_node::config::RespConfig {
                bind_address: Some("127.0.0.1:0".parse()?),
                ..Default::default()
            },
            ..cairn_node::Config::default()
        };
        let node = cairn_node::start(config)
            .await
            .context("start the benchmark's Cairn node")?;
        let address = format!("http://{}", node.local_addr());
        let serving = async {
            let client = connect(&address).await?;
            cairn_bench::wait_until_serving(&client, Duration::from_secs_f64(args.start_timeout))
                .await
        }
        .await;
        let node = Node { node, address, dir };
        if let Err(err) = serving {
            // Stopped, not dropped: its processors must not be applying records as the process
            // exits.
            let _ = node.shutdown().await;
            return Err(err);
        }
        Ok(node)
    }

    /// One connection per client, as independent clients would have.
    pub async fn connections(&self, clients: usize) -> anyhow::Result<Vec<Connection>> {
        let mut connections = Vec::with_capacity(clients);
        for _ in 0..clients {
            connections.push(Connection::Cairn(Box::new(connect(&self.address).await?)));
        }
        Ok(connections)
    }

    /// One connection per client to the node's Redis port, driven as Redis is.
    pub async fn resp_connections(&self, clients: usize) -> anyhow::Result<Vec<Connection>> {
        let address = self
            .node
            .resp_addr()
            .context("the benchmark's Cairn node has no Redis port")?;
        crate::redis::connections(&format!("redis://{address}/"), clients).await
    }

    /// A client for the node's admin calls.
    pub async fn client(&self) -> anyhow::Result<Client> {
        connect(&self.address).await
    }

    /// Bytes in the partitions' SST files and in their memtables, and the expired values
    /// compactions have dropped, summed over the node's partitions.
    pub async fn store_size(&self, client: &Client, partitions: u16) -> anyhow::Result<StoreSize> {
        let mut size = StoreSize::default();
        for partition in 0..u32::from(partitions) {
            let store = client
                .describe_partition(partition)
                .await
                .context("describe a partition of the benchmark's node")?
                .store
                .with_context(|| format!("partition {partition} has no store"))?;
            size.sst_bytes += store.live_sst_bytes;
            size.memtable_bytes += store.memtable_bytes;
            size.expired_dropped += store.expired_dropped;
        }
        Ok(size)
    }

    /// Stops the node, then removes its folder on a blocking thread.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let stopped = self
            .node
            .shutdown()
            .await
            .context("stop the benchmark's Cairn node");
        let dir = self.dir;
        let _ = tokio::task::spawn_blocking(move || drop(dir)).await;
        stopped
    }
}

/// What [`Node::store_size`] reads.
#[derive(Clone, Copy, Debug, Default)]
pub struct StoreSize {
    pub sst_bytes: u64,
    pub memtable_bytes: u64,
    pub expired_dropped: u64,
}

async fn connect(address: &str) -> anyhow::Result<Client> {
    Client::connect(address, &ClientOptions::default())
        .await
        .with_context(|| format!("connect to the benchmark's Cairn node at {address}"))
}

/// One request of `workload`, checked: every insert inserted, every read key found.
pub async fn send(
    client: &Client,
    args: &Args,
    workload: Workload,
    keys: Vec<Bytes>,
) -> anyhow::Result<()> {
    match workload {
        Workload::PutBatch | Workload::Put => {
            let entries = keys
                .into_iter()
                .map(|key| PutEntry {
                    value: args.value_for(&key),
                    key,
                    ttl: None,
                })
                .collect();
            client.put(entries).await.context("Cairn put")?;
        }
        Workload::InsertBatch | Workload::Insert => {
            let value = args.value_for(&keys[0]);
            let inserted = client
                .insert_if_absent(keys, value, Some(args.ttl()))
                .await
                .context("Cairn insert-if-absent")?;
            anyhow::ensure!(
                inserted.iter().all(|i| *i),
                "Cairn did not insert a fresh key"
            );
        }
        Workload::Get | Workload::GetBatch => {
            let values = client.get(keys).await.context("Cairn get")?;
            anyhow::ensure!(
                values.iter().all(Option::is_some),
                "Cairn did not find a key the benchmark wrote"
            );
        }
    }
    Ok(())
}
