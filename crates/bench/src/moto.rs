//! moto's S3 server on loopback, started by a benchmark for its own run.

use anyhow::{Context, bail};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts moto in a thread of its own, reports the port it bound, then serves until stdin closes.
const MOTO_SERVER: &str = r#"
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("ready", server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"#;

/// moto's S3 server in a `python3` child. It exits when its stdin (a pipe from this process)
/// closes, which happens however this process ends; dropping it kills it at once.
pub struct Moto {
    child: Child,
    _stdin: ChildStdin,
    port: u16,
}

impl Moto {
    /// Starts the server; objects it spills to temporary files go under `tmp`.
    pub fn start(tmp: &Path) -> anyhow::Result<Moto> {
        let log = tmp.join("moto.log");
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(MOTO_SERVER)
            .env("TMPDIR", tmp)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context(
                "start python3 for moto's S3 server (install moto: scripts/setup-debian.sh)",
            )?;
        let stdin = child.stdin.take().context("moto's stdin")?;
        let stdout = child.stdout.take().context("moto's stdout")?;
        let mut first_line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut first_line);
        let Some(port) = first_line
            .strip_prefix("ready ")
            .and_then(|p| p.trim().parse::<u16>().ok())
        else {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "moto's S3 server did not start (is moto installed? see scripts/setup-debian.sh); \
                 its output:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        };
        let moto = Moto {
            child,
            _stdin: stdin,
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !moto
            .request("GET", "/")
            .is_ok_and(|response| is_ok(&response))
        {
            anyhow::ensure!(
                Instant::now() < deadline,
                "moto does not answer on {}",
                moto.endpoint()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(moto)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// object_store cannot create buckets, so this speaks HTTP itself; moto checks no signature.
    pub fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        let response = self.request("PUT", &format!("/{bucket}"))?;
        anyhow::ensure!(is_ok(&response), "create bucket {bucket}: {response}");
        Ok(())
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

fn is_ok(response: &str) -> bool {
    response.starts_with("HTTP/1.1 200") || response.starts_with("HTTP/1.0 200")
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
