//! A real `nats-server` for tests (feature `test-util`): `scripts/setup-debian.sh` installs it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `nats-server` with JetStream on a loopback port, its data in a folder of its own.
pub struct NatsServer {
    child: Child,
    port: u16,
    dir: std::path::PathBuf,
    /// More arguments, kept for a restart (a cluster member's name and routes).
    args: Vec<String>,
}

impl NatsServer {
    /// Starts one on `port` (0: any free port) and waits until it accepts clients.
    pub fn start(dir: &std::path::Path, port: u16) -> NatsServer {
        Self::start_with(dir, port, Vec::new())
    }

    fn start_with(dir: &std::path::Path, port: u16, args: Vec<String>) -> NatsServer {
        let port_arg = if port == 0 {
            "-1".to_string()
        } else {
            port.to_string()
        };
        let mut child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p", &port_arg])
            .args(&args)
            .arg("-sd")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start nats-server (scripts/setup-debian.sh installs it)");
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                if let Some(address) = line.split("Listening for client connections on ").nth(1) {
                    let _ = tx.send(address.rsplit(':').next().unwrap().trim().to_string());
                }
            }
        });
        let port = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("nats-server did not start listening")
            .parse()
            .unwrap();
        NatsServer {
            child,
            port,
            dir: dir.to_path_buf(),
            args,
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// SIGKILL: the server is gone, mid-write, with whatever it had not synced.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the server process runs.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    /// Starts the same server again (same port, data and cluster) after [`NatsServer::kill`].
    pub fn start_again(&mut self) {
        self.kill();
        *self = NatsServer::start_with(&self.dir.clone(), self.port, self.args.clone());
    }

    /// SIGTERM, as an operator's restart would, then the same server again.
    pub fn restart(&mut self) {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "nats-server did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
        *self = NatsServer::start_with(&self.dir.clone(), self.port, self.args.clone());
    }
}

/// Three `nats-server`s with JetStream routed into one cluster on loopback, each with its data in
/// a folder of its own under `dir`.
pub struct NatsCluster {
    pub servers: Vec<NatsServer>,
}

impl NatsCluster {
    pub fn start(dir: &std::path::Path) -> NatsCluster {
        const SERVERS: usize = 3;
        let ports = free_ports(2 * SERVERS);
        let client_ports: Vec<u16> = ports[..SERVERS].to_vec();
        let route_ports: Vec<u16> = ports[SERVERS..].to_vec();
        let routes = route_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let servers = (0..SERVERS)
            .map(|i| {
                let args = vec![
                    "--server_name".into(),
                    format!("n{i}"),
                    "--cluster_name".into(),
                    "cairn-test".into(),
                    "--cluster".into(),
                    format!("nats://127.0.0.1:{}", route_ports[i]),
                    "--routes".into(),
                    routes.clone(),
                    // Clients reach only the addresses they are given: a test that puts a
                    // proxy between a node and the servers must not see it go around.
                    "--no_advertise".into(),
                ];
                let server_dir = dir.join(format!("n{i}"));
                NatsServer::start_with(&server_dir, client_ports[i], args)
            })
            .collect();
        NatsCluster { servers }
    }

    /// Every server's client URL.
    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(NatsServer::url).collect()
    }

    /// Every server's client URL as the items of a TOML array (`"nats://…", "nats://…"`), for a
    /// node's `[nats] servers`.
    pub fn toml_servers(&self) -> String {
        self.urls()
            .iter()
            .map(|url| format!("\"{url}\""))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `count` free loopback ports, none handed out before by this process: a port found free and
/// let go may be found free again by a test running beside (they bind later), and two servers
/// given one port leave one of them unable to start. They lie below the kernel's range of
/// ephemeral ports: a port in it, free while its server is down (a node killed and started
/// again), may meanwhile become the local end of some outgoing connection, and the server could
/// not bind it again.
pub fn free_ports(count: usize) -> Vec<u16> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let (low, high) = fixed_port_range();
    // Processes running beside each other start at different places in the range.
    let span = u32::from(high - low);
    let seed = std::process::id()
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    let start = seed % span;
    // Every listener is held until all ports are taken, so that no two are the same.
    let mut listeners = Vec::new();
    let mut ports = Vec::new();
    for offset in 0..span {
        if ports.len() == count {
            break;
        }
        let port = low + ((start + offset) % span) as u16;
        if given.contains(&port) {
            continue;
        }
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            given.push(port);
            ports.push(port);
            listeners.push(listener);
        }
    }
    assert_eq!(ports.len(), count, "free loopback ports in {low}..{high}");
    ports
}

/// Ports for test servers: from 10000 up to the first ephemeral port.
fn fixed_port_range() -> (u16, u16) {
    let first_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    (10_000, first_ephemeral.max(20_000))
}
