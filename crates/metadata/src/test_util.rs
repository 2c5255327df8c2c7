//! A real `nats-server` for tests (feature `test-util`): `scripts/setup-debian.sh` installs it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `nats-server` with JetStream on a loopback port, its data in a folder of its own.
pub struct NatsServer {
    child: Child,
    port: u16,
    dir: std::path::PathBuf,
}

impl NatsServer {
    /// Starts one on `port` (0: any free port) and waits until it accepts clients.
    pub fn start(dir: &std::path::Path, port: u16) -> NatsServer {
        let port_arg = if port == 0 {
            "-1".to_string()
        } else {
            port.to_string()
        };
        let mut child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p", &port_arg, "-sd"])
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
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
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
        *self = NatsServer::start(&self.dir.clone(), self.port);
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
