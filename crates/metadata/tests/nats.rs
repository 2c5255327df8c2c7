//! The `nats` metadata provider against a real `nats-server` with JetStream: the conformance
//! suite, with the server restarted (gracefully) before the restart case reopens its bucket.
//! `scripts/setup-debian.sh` installs `nats-server`; without it this test fails and says so.

use cairn_metadata::MetadataStore;
use cairn_metadata::nats::{NatsMetadataOptions, NatsMetadataStore};
use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A `nats-server` with JetStream on a loopback port, its data in a folder of its own.
struct NatsServer {
    child: Child,
    port: u16,
    dir: std::path::PathBuf,
}

impl NatsServer {
    /// Starts one on `port` (0: any free port) and waits until it accepts clients.
    fn start(dir: &std::path::Path, port: u16) -> NatsServer {
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

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// SIGTERM, as an operator's restart would, then the same server again.
    fn restart(&mut self) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_provider_conforms_against_a_real_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = Arc::new(Mutex::new(NatsServer::start(dir.path(), 0)));
    let opened = Mutex::new(HashSet::new());
    cairn_metadata::conformance::run_all(&|case| {
        // A case that opens its store again is looking for what survives a restart.
        if !opened.lock().unwrap().insert(case.to_string()) {
            server.lock().unwrap().restart();
        }
        let options = NatsMetadataOptions {
            servers: vec![server.lock().unwrap().url()],
            bucket: format!("cairn-test-{case}"),
            replicas: 1,
        };
        Box::pin(async move {
            // JetStream may take a moment after a restart before it serves its buckets again.
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match NatsMetadataStore::connect(&options).await {
                    Ok(store) => return Arc::new(store) as Arc<dyn MetadataStore>,
                    Err(err) if Instant::now() < deadline => {
                        eprintln!("retrying: {err}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(err) => panic!("{err}"),
                }
            }
        })
    })
    .await;
}
