//! Runs the real `cairn` and `cairnctl` binaries for the integration tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

/// How long [`Server::stop`] gives a node to exit after its SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// A `cairn` server process on a free loopback port.
pub struct Server {
    child: Child,
    pub address: String,
    pub base_dir: PathBuf,
    output: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `cairn` with its data in `base_dir` and waits until it listens.
    pub fn start(base_dir: &Path) -> Server {
        Self::start_with(base_dir, &[], &[])
    }

    /// Starts `cairn` and waits until it listens and has brought its partitions up.
    pub fn start_with(base_dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        Self::start_until(base_dir, args, env, " partitions serving")
    }

    /// Starts `cairn` and waits until a line of its output contains `wait_for` (for crash tests
    /// that stop it at a pause point before it listens). `address` is empty if it did not listen.
    pub fn start_until(
        base_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        wait_for: &str,
    ) -> Server {
        // A free port unless the test names one (to start a node again where it was).
        let bind = if args.contains(&"--bind-address") {
            &[][..]
        } else {
            &["--bind-address", "127.0.0.1:0"][..]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--base-dir")
            .arg(base_dir)
            .args(bind)
            .args(args)
            // Tests run in parallel: every node gets its own free metrics port.
            .env("CAIRN_METRICS__BIND_ADDRESS", "127.0.0.1:0")
            .env("CAIRN_RESP__BIND_ADDRESS", "127.0.0.1:0")
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn cairn");
        let output = Arc::new(Mutex::new(String::new()));
        let (seen_tx, seen_rx) = mpsc::channel();
        let address = Arc::new(Mutex::new(String::new()));
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let output = output.clone();
            let seen_tx = seen_tx.clone();
            let wait_for = wait_for.to_string();
            let address = address.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if let Some(rest) = line.split("Cairn node").nth(1)
                        && let Some(rest) = rest.split("listening on ").nth(1)
                    {
                        let addr = rest
                            .split(';')
                            .next()
                            .unwrap_or_default()
                            .trim()
                            .to_string();
                        *address.lock().unwrap() = addr;
                    }
                    if line.contains(&wait_for) {
                        let _ = seen_tx.send(());
                    }
                    output.lock().unwrap().push_str(&line);
                    output.lock().unwrap().push('\n');
                }
            });
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            if seen_rx.recv_timeout(Duration::from_millis(100)).is_ok() {
                break;
            }
            let exited = child.try_wait().ok().flatten();
            let no_hooks = output.lock().unwrap().contains("has no crash-test hooks");
            if exited.is_some() || no_hooks || std::time::Instant::now() > deadline {
                let _ = child.kill();
                // Let the readers collect the last lines.
                std::thread::sleep(Duration::from_millis(200));
                panic!(
                    "cairn did not print {wait_for:?} ({}); its output:\n{}",
                    exited.map_or("still running".to_string(), |s| s.to_string()),
                    output.lock().unwrap()
                );
            }
        }
        let addr = address.lock().unwrap().clone();
        Server {
            child,
            address: if addr.is_empty() {
                String::new()
            } else {
                format!("http://{addr}")
            },
            base_dir: base_dir.to_path_buf(),
            output,
        }
    }

    /// The address of the Prometheus metrics port, from the node's log.
    pub fn metrics_address(&self) -> Option<String> {
        self.output().lines().find_map(|line| {
            let rest = line.split("metrics listening on http://").nth(1)?;
            Some(rest.split('/').next()?.to_string())
        })
    }

    /// The address of the Redis-protocol port, from the node's log.
    pub fn resp_address(&self) -> Option<String> {
        self.output().lines().find_map(|line| {
            let rest = line.split("Redis protocol (RESP) listening on ").nth(1)?;
            Some(rest.split_whitespace().next()?.to_string())
        })
    }

    /// The process id, for tests that send it signals (`SIGSTOP` to hold it mid-answer).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill(mut self) {
        self.child.kill().expect("kill cairn");
        self.child.wait().expect("reap cairn");
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(mut self) {
        let pid = self.child.id().to_string();
        let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(status.success());
        // Bounded, so that a node that does not stop fails its test instead of hanging it.
        let deadline = std::time::Instant::now() + STOP_TIMEOUT;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "cairn did not exit within {STOP_TIMEOUT:?} of its SIGTERM:\n{}",
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            status.success(),
            "cairn exited with {status}:\n{}",
            self.output()
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `cairn` with `args` and `env` to completion (for start-up failures).
pub fn run_cairn(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(args)
        .env("CAIRN_METRICS__BIND_ADDRESS", "127.0.0.1:0")
        .env("CAIRN_RESP__BIND_ADDRESS", "127.0.0.1:0")
        .envs(env.iter().copied())
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .expect("run cairn")
}

/// Runs `cairnctl --address <address> args…` to completion.
pub fn cairnctl(address: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairnctl"))
        .args(["--address", address])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run cairnctl")
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts success and returns stdout.
#[track_caller]
pub fn ok(output: Output) -> String {
    assert!(
        output.status.success(),
        "command failed ({}):\nstdout: {}\nstderr: {}",
        output.status,
        stdout(&output),
        stderr(&output)
    );
    stdout(&output)
}

/// Asserts failure and returns stderr.
#[track_caller]
pub fn fails(output: Output) -> String {
    assert!(
        !output.status.success(),
        "command succeeded unexpectedly:\nstdout: {}",
        stdout(&output)
    );
    stderr(&output)
}

/// The id that `cairnctl snapshots create` printed.
#[track_caller]
pub fn created_id(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("Snapshot created: "))
        .unwrap_or_else(|| panic!("no 'Snapshot created:' in {stdout}"))
        .trim()
        .to_string()
}

/// Keys `<prefix>-<i>` that live in partition `partition` of a 16-partition cluster (the
/// default), `count` of them.
pub fn keys_of_partition(prefix: &str, partition: u16, count: usize) -> Vec<String> {
    use cairn_types::keys::partition_for_key;
    use cairn_types::{PartitionId, partition_key};
    (0..)
        .map(|i| format!("{prefix}-{i:07}"))
        .filter(|k| partition_for_key(partition_key(k.as_bytes()), 16) == PartitionId(partition))
        .take(count)
        .collect()
}

/// The value [`put_keys`] writes under `key`.
pub fn value_for(key: &str) -> bytes::Bytes {
    bytes::Bytes::from(format!("value of {key} ").repeat(6))
}

/// Writes `keys` (with [`value_for`]) in batches of `batch` keys, one log record per batch.
pub async fn put_keys(address: &str, keys: &[String], batch: usize) {
    let client = cairn_client::Client::connect(address, &cairn_client::ClientOptions::default())
        .await
        .unwrap();
    for chunk in keys.chunks(batch) {
        let entries = chunk
            .iter()
            .map(|k| cairn_client::PutEntry {
                key: bytes::Bytes::from(k.clone()),
                value: value_for(k),
                ttl: None,
            })
            .collect();
        client.put(entries).await.unwrap();
    }
}

/// What `keys` hold, in order (`None` for a key that is absent).
pub async fn get_keys(address: &str, keys: &[String]) -> Vec<Option<bytes::Bytes>> {
    let client = cairn_client::Client::connect(address, &cairn_client::ClientOptions::default())
        .await
        .unwrap();
    let mut values = Vec::new();
    for chunk in keys.chunks(1000) {
        let wanted = chunk
            .iter()
            .map(|k| bytes::Bytes::from(k.clone()))
            .collect();
        values.extend(client.get(wanted).await.unwrap());
    }
    values
}

/// Asserts that every key of `keys` holds the value [`put_keys`] wrote.
pub async fn assert_keys_there(address: &str, keys: &[String]) {
    for (key, value) in keys.iter().zip(get_keys(address, keys).await) {
        assert_eq!(value, Some(value_for(key)), "key {key}");
    }
}

/// The columns of partition `id`'s row in `partitions list` but FOLLOWERS (which a single node
/// leaves empty): ID, KEY RANGE, LEADER, EPOCH, APPLIED LSN, LOG TRIM POINT, LOG TAIL, ARCHIVED
/// LSN, STATUS.
pub fn partition_columns(address: &str, id: u16) -> Vec<String> {
    let table = ok(cairnctl(address, &["partitions", "list"]));
    let mut columns: Vec<String> = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&id.to_string()))
        .unwrap_or_else(|| panic!("partition {id} not listed:\n{table}"))
        .split_whitespace()
        .map(str::to_string)
        .collect();
    columns.remove(3);
    columns
}

/// Waits (up to a minute) until partition `id` no longer reports itself as starting: a node
/// serves before all of its partitions do, and each one starts on its own.
pub fn wait_until_started(address: &str, id: u16) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let row = partition_columns(address, id);
        if row.last().map(String::as_str) != Some("starting") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "partition {id} still starting after a minute: {row:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The object keys (`ssts/<hash>.sst`) of a snapshot's files, from `snapshots describe`.
pub fn snapshot_object_keys(address: &str, snapshot_id: &str) -> Vec<String> {
    let described = ok(cairnctl(address, &["snapshots", "describe", snapshot_id]));
    let metadata: serde_json::Value = serde_json::from_str(&described).unwrap();
    metadata["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["key"].as_str().unwrap().to_string())
        .collect()
}

/// Runs `cairn drop-partition -p <partition> -y --base-dir <base_dir>` with `env`.
pub fn run_drop_partition(base_dir: &Path, partition: u16, env: &[(&str, &str)]) -> Output {
    run_cairn(
        &[
            "drop-partition",
            "--base-dir",
            base_dir.to_str().unwrap(),
            "-p",
            &partition.to_string(),
            "-y",
        ],
        env,
    )
}

/// GET /metrics on the node's metrics port.
pub fn scrape(server: &Server) -> String {
    use std::io::{Read, Write};
    let address = server.metrics_address().expect("the metrics port is on");
    let mut stream = std::net::TcpStream::connect(&address).unwrap();
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

/// A configuration file in `dir` for one node whose log and metadata are in the NATS server at
/// `nats_url` (one replica), with its snapshot repository in `dir/repository`.
pub fn nats_log_config(dir: &Path, nats_url: &str) -> PathBuf {
    let config = dir.join("cairn.toml");
    std::fs::write(
        &config,
        format!(
            "[log]\nprovider = \"nats\"\n[metadata]\nprovider = \"nats\"\n\
             [nats]\nservers = [\"{nats_url}\"]\nreplicas = 1\n\
             [worker.snapshots]\ndestination = \"{}\"\n",
            dir.join("repository").display()
        ),
    )
    .unwrap();
    config
}
