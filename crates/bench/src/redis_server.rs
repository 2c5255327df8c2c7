//! A `redis-server` process of a benchmark's own: on a free loopback port, in a temporary folder,
//! with every write fsynced before its answer (`--appendonly yes --appendfsync always`, no RDB
//! saves). Killed, and its folder removed, when dropped.

use anyhow::Context;
use std::process::{Child, Command, Stdio};

pub struct RedisProcess {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub port: u16,
}

impl RedisProcess {
    /// Starts `binary`; `None` when it is not installed. Blocking.
    pub fn launch(binary: &str) -> anyhow::Result<Option<RedisProcess>> {
        let dir = tempfile::tempdir().context("create Redis's temporary folder")?;
        let port = free_port()?;
        let spawned = Command::new(binary)
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .arg("--dir")
            .arg(dir.path())
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ])
            .args(["--daemonize", "no", "--logfile"])
            .arg(dir.path().join("redis.log"))
            // Redis's jemalloc reads the same variable as the benchmark's: a setting meant for
            // Cairn's side of a comparison must not change Redis's.
            .env_remove("MALLOC_CONF")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match spawned {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            other => other.with_context(|| format!("start {binary}"))?,
        };
        Ok(Some(RedisProcess { child, dir, port }))
    }

    /// What the server logged.
    pub fn log_path(&self) -> std::path::PathBuf {
        self.dir.path().join("redis.log")
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        // Nothing of this server's data is kept; its folder goes with it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nobody listens on right now.
fn free_port() -> anyhow::Result<u16> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").context("find a free port for Redis")?;
    Ok(listener.local_addr()?.port())
}
