//! A real cluster on loopback for fault tests: three clustered `nats-server`s, moto's S3 server
//! as the shared repository, and `cairn` nodes, each reaching every NATS server through a
//! [`Proxy`] of its own so that a test can cut one node off NATS. Every process can be killed,
//! paused, resumed and started again; a node keeps its ports across restarts, so clients find it
//! where it was.

use crate::proxy::Proxy;
use anyhow::{Context, bail};
use cairn_client::{Client, ClientOptions};
use cairn_metadata::test_util::NatsCluster;
use cairn_snapshots::test_util::moto;
use object_store::{ObjectStore, ObjectStoreExt};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the cluster is made of.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// The `cairn` binary.
    pub cairn_bin: PathBuf,
    /// Where everything's data and logs go.
    pub dir: PathBuf,
    pub nodes: usize,
    pub partitions: u16,
    pub standbys: usize,
    pub node_timeout: Duration,
    /// Extra lines for every node's configuration file (e.g. `[worker.snapshots]` settings).
    pub extra_config: String,
    /// Environment variables of single nodes: (node index, name, value). A test clears a node's
    /// [`Node::env`] before starting it again.
    pub env: Vec<(usize, String, String)>,
}

/// One `cairn` node: its ports stay the same across restarts.
pub struct Node {
    pub name: String,
    pub grpc: SocketAddr,
    pub resp: SocketAddr,
    pub metrics: SocketAddr,
    pub base_dir: PathBuf,
    pub log: PathBuf,
    /// Extra environment of the node's process, from its next start on.
    pub env: Vec<(String, String)>,
    config: PathBuf,
    child: Option<Child>,
    /// It has run: its ports are the ones clients know, and stay.
    has_run: bool,
    /// Per NATS server, the proxy this node reaches it through.
    proxies: Vec<Proxy>,
}

impl Node {
    /// `http://host:port` of its gRPC port.
    pub fn address(&self) -> String {
        format!("http://{}", self.grpc)
    }

    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }
}

pub struct TestCluster {
    pub options: ClusterOptions,
    pub nats: NatsCluster,
    pub nodes: Vec<Node>,
    /// Every node's configuration file, but for `SERVERS` (its proxies to the NATS servers).
    config: String,
    /// The bucket of the shared snapshot repository, in moto.
    repository: Arc<dyn ObjectStore>,
}

/// The `cairn` binary: `given`, or the one beside the running executable.
pub fn cairn_bin(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match given {
        Some(bin) => Ok(bin),
        None => Ok(std::env::current_exe()?
            .parent()
            .context("this binary's folder")?
            .join("cairn")),
    }
}

/// `count` distinct free loopback addresses, none handed out before by this process.
fn free_addresses(count: usize) -> Vec<SocketAddr> {
    cairn_metadata::test_util::free_ports(count)
        .into_iter()
        .map(|port| SocketAddr::from(([127, 0, 0, 1], port)))
        .collect()
}

fn signal(pid: i32, signal: libc::c_int) {
    // SAFETY: sends a signal to a child process of ours; no memory is touched.
    unsafe {
        libc::kill(pid, signal);
    }
}

impl TestCluster {
    /// Starts NATS, moto and every node, and waits until every partition serves.
    pub async fn start(options: ClusterOptions) -> anyhow::Result<TestCluster> {
        std::fs::create_dir_all(&options.dir)?;
        let nats_dir = options.dir.join("nats");
        let nats = tokio::task::spawn_blocking(move || NatsCluster::start(&nats_dir)).await?;
        jetstream_ready(&nats.urls(), Duration::from_secs(120)).await?;
        let moto = moto::server();
        let bucket = tokio::task::spawn_blocking(|| moto::server().create_bucket()).await?;
        let config = format!(
            "num-partitions = {partitions}\n\
             [log]\nprovider = \"nats\"\n[metadata]\nprovider = \"nats\"\n\
             [nats]\nservers = [SERVERS]\nreplicas = 3\n\
             [cluster]\ninitial-nodes = {nodes}\nstandbys = {standbys}\n\
             node-timeout = \"{timeout}ms\"\n\
             [worker.snapshots]\ndestination = \"s3://{bucket}/cluster\"\n\
             endpoint-url = \"{endpoint}\"\nallow-http = true\nregion = \"us-east-1\"\n\
             {extra}\n",
            partitions = options.partitions,
            nodes = options.nodes,
            standbys = options.standbys,
            timeout = options.node_timeout.as_millis(),
            endpoint = moto.endpoint(),
            extra = options.extra_config,
        );
        let repository = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(moto.endpoint())
            .with_bucket_name(&bucket)
            .with_region("us-east-1")
            .with_allow_http(true)
            .with_access_key_id("testing")
            .with_secret_access_key("testing")
            .build()
            .context("open moto's bucket")?;
        let mut cluster = TestCluster {
            options,
            nats,
            nodes: Vec::new(),
            config,
            repository: Arc::new(repository),
        };
        for _ in 0..cluster.options.nodes {
            let node = cluster.new_node().await?;
            cluster.nodes.push(node);
        }
        for i in 0..cluster.nodes.len() {
            cluster.start_node(i)?;
        }
        if let Err(err) = cluster.wait_serving(Duration::from_secs(120)).await {
            bail!("{err:#}\n{}", cluster.log_tails(25));
        }
        Ok(cluster)
    }

    /// The next node, `n{len + 1}`, not started: its proxies to NATS, ports and configuration.
    async fn new_node(&self) -> anyhow::Result<Node> {
        let i = self.nodes.len();
        let name = format!("n{}", i + 1);
        let mut proxies = Vec::new();
        for url in self.nats.urls() {
            let target: SocketAddr = url
                .trim_start_matches("nats://")
                .parse()
                .context("a NATS server's address")?;
            proxies.push(Proxy::start(target).await?);
        }
        let servers = proxies
            .iter()
            .map(|p| format!("\"nats://127.0.0.1:{}\"", p.port()))
            .collect::<Vec<_>>()
            .join(", ");
        let dir = &self.options.dir;
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, self.config.replace("SERVERS", &servers))?;
        let ports = free_addresses(3);
        Ok(Node {
            grpc: ports[0],
            resp: ports[1],
            metrics: ports[2],
            base_dir: dir.join(&name),
            log: dir.join(format!("{name}.log")),
            env: self
                .options
                .env
                .iter()
                .filter(|(n, _, _)| *n == i)
                .map(|(_, k, v)| (k.clone(), v.clone()))
                .collect(),
            name,
            config,
            child: None,
            has_run: false,
            proxies,
        })
    }

    /// Starts one more node (`n{len + 1}`), which joins the running cluster; returns its index.
    /// It gets nothing to run until a scaling operation gives it partitions.
    pub async fn add_node(&mut self) -> anyhow::Result<usize> {
        let node = self.new_node().await?;
        self.nodes.push(node);
        let i = self.nodes.len() - 1;
        self.start_node(i)?;
        Ok(i)
    }

    /// The shared snapshot repository's bucket (in moto).
    pub fn repository(&self) -> &Arc<dyn ObjectStore> {
        &self.repository
    }

    /// Where [`TestCluster::repository`] keeps `key` (a file's key in a snapshot's metadata,
    /// e.g. `ssts/….sst`) of partition `partition`.
    pub fn repository_path(partition: u32, key: &str) -> object_store::path::Path {
        key.split('/').filter(|segment| !segment.is_empty()).fold(
            object_store::path::Path::from("cluster").join(partition.to_string().as_str()),
            |path, segment| path.join(segment),
        )
    }

    /// Flips a byte in the middle of `key` (see [`TestCluster::repository_path`]) in the shared
    /// snapshot repository: damage that only a snapshot's checksums can find.
    pub async fn flip_a_byte_in_repository(&self, partition: u32, key: &str) -> anyhow::Result<()> {
        let location = Self::repository_path(partition, key);
        let stored = self.repository.get(&location).await?.bytes().await?;
        anyhow::ensure!(!stored.is_empty(), "{location} is empty");
        let mut bytes = stored.to_vec();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x55;
        self.repository
            .put(&location, bytes::Bytes::from(bytes).into())
            .await?;
        Ok(())
    }

    /// Every node's gRPC address (`http://…`).
    pub fn addresses(&self) -> Vec<String> {
        self.nodes.iter().map(Node::address).collect()
    }

    /// Every node's Redis-port address (`host:port`).
    pub fn resp_addresses(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.resp.to_string()).collect()
    }

    /// Starts node `i` (again), on its ports and base dir, and waits until it listens.
    pub fn start_node(&mut self, i: usize) -> anyhow::Result<()> {
        // Another process (a test running beside this one) may take a port between the moment
        // it was found free and the node's bind. Before anyone knows the node's ports, it is
        // given new ones and started again.
        let mut attempts = 0;
        loop {
            attempts += 1;
            let logged = std::fs::metadata(&self.nodes[i].log).map_or(0, |m| m.len());
            match self.start_node_once(i) {
                Err(err)
                    if !self.nodes[i].has_run
                        && attempts < 5
                        && log_since(&self.nodes[i].log, logged)
                            .contains("Address already in use") =>
                {
                    let node = &mut self.nodes[i];
                    if let Some(mut child) = node.child.take() {
                        let _ = child.kill();
                        let _ = child.wait();
                    }
                    let ports = free_addresses(3);
                    (node.grpc, node.resp, node.metrics) = (ports[0], ports[1], ports[2]);
                    eprintln!(
                        "{}: a port was taken ({err:#}); starting it on others",
                        node.name
                    );
                }
                Err(err) => return Err(err),
                Ok(()) => {
                    self.nodes[i].has_run = true;
                    return Ok(());
                }
            }
        }
    }

    fn start_node_once(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &mut self.nodes[i];
        if node.running() {
            bail!("{} runs already", node.name);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)?;
        let child = Command::new(&self.options.cairn_bin)
            .arg("--config")
            .arg(&node.config)
            .arg("--node-name")
            .arg(&node.name)
            .arg("--base-dir")
            .arg(&node.base_dir)
            .arg("--bind-address")
            .arg(node.grpc.to_string())
            .env("CAIRN_RESP__BIND_ADDRESS", node.resp.to_string())
            .env("CAIRN_METRICS__BIND_ADDRESS", node.metrics.to_string())
            .env("AWS_ACCESS_KEY_ID", "cairn-test-key")
            .env("AWS_SECRET_ACCESS_KEY", "cairn-test-secret")
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .envs(node.env.iter().map(|(k, v)| (k, v)))
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", self.options.cairn_bin.display()))?;
        node.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(node.grpc).is_err() {
            if !node.running() {
                return Err(exited_at_start(node));
            }
            if Instant::now() > deadline {
                bail!(
                    "{} does not listen after 60 s; see {}",
                    node.name,
                    node.log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Something answers on the port; the node must be what answers (one that could not bind
        // a port of its own exits at once, while another process may hold the port).
        std::thread::sleep(Duration::from_millis(300));
        if !node.running() {
            return Err(exited_at_start(node));
        }
        Ok(())
    }

    /// SIGKILL of node `i`.
    pub fn kill_node(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            // A paused process dies of SIGKILL too.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM of node `i`, and waits for it to exit.
    pub fn stop_node(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            signal(child.id() as i32, libc::SIGCONT);
            signal(child.id() as i32, libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(60);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOP of node `i`: it stays, its sockets open, and answers nothing.
    pub fn pause_node(&self, i: usize) {
        if let Some(pid) = self.nodes[i].pid() {
            signal(pid, libc::SIGSTOP);
        }
    }

    /// SIGCONT of node `i`.
    pub fn resume_node(&self, i: usize) {
        if let Some(pid) = self.nodes[i].pid() {
            signal(pid, libc::SIGCONT);
        }
    }

    /// Cuts node `i` off every NATS server; its clients still reach it.
    pub fn cut_node(&self, i: usize) {
        for proxy in &self.nodes[i].proxies {
            proxy.cut();
        }
    }

    /// Lets node `i` reach NATS again.
    pub fn heal_node(&self, i: usize) {
        for proxy in &self.nodes[i].proxies {
            proxy.heal();
        }
    }

    /// Removes node `i`'s base dir (the node must not run): its machine's disk is lost.
    pub fn wipe_node(&mut self, i: usize) -> anyhow::Result<()> {
        if self.nodes[i].running() {
            bail!("{} still runs", self.nodes[i].name);
        }
        let dir = self.nodes[i].base_dir.clone();
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
        }
        Ok(())
    }

    /// SIGKILL of NATS server `j`.
    pub fn kill_nats(&mut self, j: usize) {
        self.nats.servers[j].kill();
    }

    /// Starts NATS server `j` again, on its port and data.
    pub async fn start_nats(&mut self, j: usize) -> anyhow::Result<()> {
        let server = &mut self.nats.servers[j];
        // Blocking: it waits for the server to listen; the runtime's other threads go on.
        tokio::task::block_in_place(|| server.start_again());
        Ok(())
    }

    /// A client of the first node that answers.
    pub async fn client(&self) -> anyhow::Result<Client> {
        let options = ClientOptions {
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(5),
        };
        let mut last = None;
        for address in self.addresses() {
            match Client::connect(&address, &options).await {
                Ok(client) => match client.list_nodes().await {
                    Ok(_) => return Ok(client),
                    Err(err) => last = Some(err),
                },
                Err(err) => last = Some(err),
            }
        }
        Err(last.map_or_else(|| anyhow::anyhow!("no node"), anyhow::Error::new))
    }

    /// The leader of every partition, by name, as the partition table says.
    pub async fn leaders(&self) -> anyhow::Result<Vec<String>> {
        let table = self.client().await?.list_partitions().await?;
        Ok(table.partitions.into_iter().map(|p| p.leader).collect())
    }

    /// The index of the node leading the most partitions.
    pub async fn busiest_leader(&self) -> anyhow::Result<usize> {
        let leaders = self.leaders().await?;
        let counts: Vec<usize> = self
            .nodes
            .iter()
            .map(|n| leaders.iter().filter(|l| **l == n.name).count())
            .collect();
        Ok((0..counts.len()).max_by_key(|&i| counts[i]).unwrap_or(0))
    }

    /// The index of the node that holds the controller's lease.
    pub async fn controller(&self) -> anyhow::Result<usize> {
        let cluster = self.client().await?.describe_cluster().await?;
        self.nodes
            .iter()
            .position(|n| n.name == cluster.controller)
            .with_context(|| format!("no node holds the controller's lease ({cluster:?})"))
    }

    /// Waits until every partition has a leader on a running node and reports itself active.
    pub async fn wait_serving(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let running: Vec<String> = self
                .nodes
                .iter_mut()
                .filter_map(|n| n.running().then(|| n.name.clone()))
                .collect();
            let last = match self.client().await {
                Ok(client) => match client.list_partitions().await {
                    Ok(table) => {
                        let ready = table.partitions.len() == usize::from(self.options.partitions)
                            && table
                                .partitions
                                .iter()
                                .all(|p| p.status == "active" && running.contains(&p.leader));
                        if ready {
                            return Ok(());
                        }
                        let rows: Vec<String> = table
                            .partitions
                            .iter()
                            .map(|p| format!("{} {} {}", p.partition_id, p.leader, p.status))
                            .collect();
                        rows.join("; ")
                    }
                    Err(err) => err.to_string(),
                },
                Err(err) => err.to_string(),
            };
            if Instant::now() > deadline {
                bail!(
                    "the cluster does not serve every partition after {} s: {last}",
                    within.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until node `i`'s log (over all its starts) has a line containing `needle`.
    pub async fn wait_log(&self, i: usize, needle: &str, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        let path = self.nodes[i].log.clone();
        loop {
            let text = tokio::fs::read_to_string(&path).await.unwrap_or_default();
            if text.contains(needle) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not log {needle:?} within {within:?}; its last lines:\n{}",
                    self.nodes[i].name,
                    self.log_tail(i, 20)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last `lines` lines of every node's log, each under its name.
    pub fn log_tails(&self, lines: usize) -> String {
        (0..self.nodes.len())
            .map(|i| format!("--- {}:\n{}", self.nodes[i].name, self.log_tail(i, lines)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The last lines of node `i`'s log.
    pub fn log_tail(&self, i: usize, lines: usize) -> String {
        tail(&self.nodes[i].log, lines)
    }
}

/// Waits until the NATS cluster's JetStream answers (its servers have elected a meta leader):
/// nodes started before that give up opening their metadata bucket after their own patience.
async fn jetstream_ready(urls: &[String], within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    let client = cairn_nats::connect(urls).await?;
    let jetstream = async_nats::jetstream::new(client);
    loop {
        match jetstream.query_account().await {
            Ok(_) => return Ok(()),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => {
                bail!("the NATS servers' JetStream does not answer after {within:?}: {err}")
            }
        }
    }
}

/// A node that exited while it started, with the end of its log, which says why.
fn exited_at_start(node: &Node) -> anyhow::Error {
    anyhow::anyhow!(
        "{} exited at start; the end of {}:\n{}",
        node.name,
        node.log.display(),
        tail(&node.log, 20)
    )
}

/// What was written to the log at `path` past its first `offset` bytes.
fn log_since(path: &Path, offset: u64) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    String::from_utf8_lossy(&text[(offset as usize).min(text.len())..]).into_owned()
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill_node(i);
        }
    }
}

/// Snapshots `partition` on its leader; returns the snapshot's id.
pub async fn snapshot(client: &Client, partition: u32) -> anyhow::Result<String> {
    let mut progress = client.create_snapshot(partition, None, false).await?;
    while let Some(message) = progress.message().await? {
        if let Some(done) = message.done {
            return Ok(done.snapshot_id);
        }
    }
    bail!("the snapshot of partition {partition} ended without saying what it published")
}

/// The keys of a snapshot's files in its partition's folder of the repository (see
/// [`TestCluster::repository_path`]), from its metadata.
pub async fn snapshot_file_keys(
    client: &Client,
    snapshot_id: &str,
) -> anyhow::Result<std::collections::BTreeSet<String>> {
    let metadata: serde_json::Value =
        serde_json::from_str(&client.describe_snapshot(snapshot_id).await?)?;
    Ok(metadata["files"]
        .as_array()
        .context("a snapshot's files")?
        .iter()
        .filter_map(|f| Some(f["key"].as_str()?.to_string()))
        .collect())
}
