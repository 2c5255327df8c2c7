//! Runs the real `cairn` and `cairnctl` binaries for the integration tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

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

    pub fn start_with(base_dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--base-dir")
            .arg(base_dir)
            .args(["--bind-address", "127.0.0.1:0"])
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn cairn");
        let output = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let output = output.clone();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if let Some(rest) = line.split("listening on ").nth(1) {
                        let addr = rest
                            .split(';')
                            .next()
                            .unwrap_or_default()
                            .trim()
                            .to_string();
                        let _ = tx.send(addr);
                    }
                    output.lock().unwrap().push_str(&line);
                    output.lock().unwrap().push('\n');
                }
            });
        }
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "cairn did not start listening; its output:\n{}",
                    output.lock().unwrap()
                );
            }
        };
        Server {
            child,
            address: format!("http://{addr}"),
            base_dir: base_dir.to_path_buf(),
            output,
        }
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
        let status = self.child.wait().unwrap();
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
