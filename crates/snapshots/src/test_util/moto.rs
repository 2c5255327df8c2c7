//! moto's S3 server on a free loopback port: shared by the tests of one binary (`server()`), or
//! started by a benchmark for its run (`MotoServer::start_in`).
//!
//! The server runs in a `python3` child whose stdin is a pipe from this process. It exits when
//! that pipe closes, which the operating system does when the test binary exits however it exits
//! (a static is never dropped, and a crashed test runner runs no destructors). Dropping a
//! [`MotoServer`] kills it too. Install moto with `scripts/setup-debian.sh`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Starts moto in a thread of its own, reports the port it bound, then serves until stdin closes.
const SERVER: &str = r#"
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("ready", server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"#;

pub struct MotoServer {
    child: Child,
    /// Held open for the server's lifetime; closing it stops the server.
    _stdin: ChildStdin,
    port: u16,
}

static MOTO: OnceLock<MotoServer> = OnceLock::new();
static BUCKETS: AtomicU32 = AtomicU32::new(0);

/// The shared server of this test binary.
pub fn server() -> &'static MotoServer {
    MOTO.get_or_init(MotoServer::start)
}

impl MotoServer {
    pub fn start() -> MotoServer {
        Self::start_in(&std::env::temp_dir())
    }

    /// Starts a server whose log and spilled objects (moto keeps large ones in temporary files)
    /// go under `tmp`.
    pub fn start_in(tmp: &Path) -> MotoServer {
        let log = tmp.join(format!("cairn-moto-{}.log", std::process::id()));
        let log_file = std::fs::File::create(&log).expect("create moto's log file");
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(SERVER)
            .env("TMPDIR", tmp)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .expect("start python3 for moto's S3 server (run scripts/setup-debian.sh)");
        let stdin = child.stdin.take().expect("moto's stdin is piped");
        let stdout = child.stdout.take().expect("moto's stdout is piped");
        let mut first_line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut first_line);
        let port = first_line
            .strip_prefix("ready ")
            .and_then(|p| p.trim().parse::<u16>().ok())
            .unwrap_or_else(|| {
                let _ = child.kill();
                panic!(
                    "moto's S3 server did not start (is moto installed? run \
                     scripts/setup-debian.sh); its output:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            });
        // The server keeps writing its request log to the unlinked file; nothing piles up in /tmp.
        let _ = std::fs::remove_file(&log);
        let server = MotoServer {
            child,
            _stdin: stdin,
            port,
        };
        server.wait_until_it_answers();
        server
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `base` pointed at this server, with the fixed credentials moto accepts.
    pub fn repository_options(&self, base: crate::RepositoryOptions) -> crate::RepositoryOptions {
        crate::RepositoryOptions {
            endpoint_url: Some(self.endpoint()),
            region: Some("us-east-1".into()),
            allow_http: true,
            access_key_id: Some("testing".into()),
            secret_access_key: Some("testing".into()),
            ..base
        }
    }

    fn wait_until_it_answers(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(response) = self.request("GET", "/")
                && (response.starts_with("HTTP/1.1 200") || response.starts_with("HTTP/1.0 200"))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "moto does not answer on {}",
                self.endpoint()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Creates a bucket no other test uses. object_store cannot create buckets, so this speaks
    /// HTTP itself; moto does not check signatures.
    pub fn create_bucket(&self) -> String {
        let bucket = format!(
            "cairn-test-{}-{}",
            std::process::id(),
            BUCKETS.fetch_add(1, Ordering::SeqCst)
        );
        self.create_named_bucket(&bucket);
        bucket
    }

    /// Creates `bucket`.
    pub fn create_named_bucket(&self, bucket: &str) {
        let response = self
            .request("PUT", &format!("/{bucket}"))
            .expect("create a bucket in moto");
        assert!(
            response.starts_with("HTTP/1.1 200") || response.starts_with("HTTP/1.0 200"),
            "creating bucket {bucket} failed: {response}"
        );
    }

    fn request(&self, method: &str, path: &str) -> std::io::Result<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\n\
             Connection: close\r\n\r\n",
            self.port
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response)
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
