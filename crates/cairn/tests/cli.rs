//! `cairnctl` against a real `cairn` process, as an operator would use them.

mod support;

use support::{Server, cairnctl, fails, ok, run_cairn, stderr};

#[test]
fn key_value_commands_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let a = server.address.as_str();

    assert_eq!(
        ok(cairnctl(a, &["kv", "put", "greeting", "hello"])).trim(),
        "OK"
    );
    assert_eq!(ok(cairnctl(a, &["kv", "get", "greeting"])).trim(), "hello");
    let err = fails(cairnctl(a, &["kv", "get", "missing"]));
    assert!(err.contains("key missing not found"), "{err}");

    let table = ok(cairnctl(a, &["kv", "exists", "greeting", "missing"]));
    assert!(row(&table, "greeting").contains("true"), "{table}");
    assert!(row(&table, "missing").contains("false"), "{table}");

    let table = ok(cairnctl(
        a,
        &[
            "kv",
            "insert-if-absent",
            "greeting",
            "fresh",
            "--value",
            "x",
        ],
    ));
    assert!(row(&table, "greeting").contains("false"), "{table}");
    assert!(row(&table, "fresh").contains("true"), "{table}");
    let table = ok(cairnctl(a, &["kv", "insert-if-absent", "fresh"]));
    assert!(row(&table, "fresh").contains("false"), "{table}");

    ok(cairnctl(a, &["kv", "delete", "greeting"]));
    fails(cairnctl(a, &["kv", "get", "greeting"]));
    let table = ok(cairnctl(a, &["kv", "get", "fresh", "greeting"]));
    assert!(row(&table, "fresh").contains('x'), "{table}");
    assert!(row(&table, "greeting").contains("(absent)"), "{table}");

    // A TTL the protocol cannot carry is refused, not wrapped (to 384 ms here).
    let err = fails(cairnctl(
        a,
        &["kv", "put", "wrapped", "v", "--ttl", "18446744073709552s"],
    ));
    assert!(err.contains("out of range"), "{err}");
    fails(cairnctl(a, &["kv", "get", "wrapped"]));

    // A TTL given in human units expires.
    ok(cairnctl(
        a,
        &["kv", "put", "short", "lived", "--ttl", "300ms"],
    ));
    std::thread::sleep(std::time::Duration::from_millis(600));
    fails(cairnctl(a, &["kv", "get", "short"]));
}

#[test]
fn partitions_and_logs_are_listed_and_trim_is_guarded() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let a = server.address.as_str();
    ok(cairnctl(a, &["kv", "put", "k", "v"]));

    let table = ok(cairnctl(a, &["partitions", "list"]));
    let rows: Vec<&str> = table
        .lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(rows.len(), 16, "{table}");
    assert!(rows.iter().all(|r| r.contains("n1")), "{table}");
    // Partition 15 of 16 ends at the top of the key space.
    assert!(
        table.contains("17293822569102704640..=18446744073709551615"),
        "{table}"
    );

    let borders = ok(cairnctl(
        a,
        &["--table-style", "borders", "logs", "describe", "-l", "3"],
    ));
    assert!(borders.contains('│'), "{borders}");

    // Find the log that holds "k": the only one with a tail past its announcement (LSN 1).
    let logs = ok(cairnctl(a, &["logs", "describe"]));
    let (log_id, tail) = logs
        .lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<u64> = l
                .split_whitespace()
                .filter_map(|c| c.parse().ok())
                .collect();
            (cols.len() == 3).then(|| (cols[0], cols[2]))
        })
        .find(|&(_, tail)| tail == 2)
        .expect("one log holds the put");
    assert_eq!(tail, 2, "{logs}");
    let log = log_id.to_string();

    let err = fails(cairnctl(a, &["logs", "trim", "-l", &log, "-t", "2"]));
    assert!(err.contains("pass -y"), "{err}");
    // No snapshot covers the log yet: trimming would lose records to every restore.
    let err = fails(cairnctl(a, &["-y", "logs", "trim", "-l", &log, "-t", "2"]));
    assert!(
        err.contains("no snapshot covers log")
            && err.contains("records 1..=2 would be lost")
            && err.contains("--force"),
        "{err}"
    );
    // --force goes past the archived LSN, but never past what the partition applied.
    let err = fails(cairnctl(
        a,
        &["-y", "logs", "trim", "-l", &log, "-t", "3", "--force"],
    ));
    assert!(err.contains("applied only up to LSN 2"), "{err}");
    let out = ok(cairnctl(
        a,
        &["-y", "logs", "trim", "-l", &log, "-t", "1", "--force"],
    ));
    assert!(out.contains("trim point 1"), "{out}");
    // A snapshot archives the log up to its LSN: trimming to there needs no force, past it does.
    let created = ok(cairnctl(a, &["snapshots", "create", "-p", &log]));
    assert!(created.contains("Snapshot created"), "{created}");
    ok(cairnctl(a, &["kv", "put", "k", "v2"]));
    let err = fails(cairnctl(a, &["-y", "logs", "trim", "-l", &log, "-t", "3"]));
    assert!(
        err.contains("only up to LSN 2 (the archived LSN)") && err.contains("records 3..=3"),
        "{err}"
    );
    let out = ok(cairnctl(a, &["-y", "logs", "trim", "-l", &log, "-t", "2"]));
    assert!(out.contains("trim point 2"), "{out}");
    let err = fails(cairnctl(a, &["-y", "logs", "trim", "-l", "99", "-t", "1"]));
    assert!(err.contains("log 99 does not exist"), "{err}");

    // The data survives the trim and a restart.
    server.stop();
    let server = Server::start(dir.path());
    assert_eq!(
        ok(cairnctl(&server.address, &["kv", "get", "k"])).trim(),
        "v2"
    );
    let logs = ok(cairnctl(&server.address, &["logs", "describe", "-l", &log]));
    assert!(
        logs.lines().nth(1).unwrap().split_whitespace().nth(1) == Some("2"),
        "{logs}"
    );
}

#[test]
fn an_unreachable_node_is_one_line_naming_the_address() {
    let out = cairnctl("127.0.0.1:1", &["partitions", "list"]);
    let err = fails(out);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("cannot connect to http://127.0.0.1:1"),
        "{err}"
    );
}

#[test]
fn bad_configuration_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_str().unwrap();

    let out = run_cairn(&["--base-dir", base], &[("CAIRN_NUM_PARTITIONS", "many")]);
    let err = fails(out);
    assert!(err.contains("num-partitions"), "{err}");

    let out = run_cairn(&["--base-dir", base], &[("CAIRN_NUM_PARTITIONS", "0")]);
    let err = fails(out);
    assert!(err.contains("num-partitions is 0"), "{err}");

    let config = dir.path().join("cairn.toml");
    std::fs::write(&config, "node-name = \"n1\"\nbase-dirr = \"x\"\n").unwrap();
    let err = fails(run_cairn(&["--config", config.to_str().unwrap()], &[]));
    assert!(err.contains("base-dirr"), "{err}");

    std::fs::write(&config, "[worker]\nbogus = 1\n").unwrap();
    let err = fails(run_cairn(&["--config", config.to_str().unwrap()], &[]));
    assert!(err.contains("bogus"), "{err}");

    // A destination's credentials never reach the terminal or the log.
    let out = run_cairn(
        &["--base-dir", base],
        &[(
            "CAIRN_WORKER__SNAPSHOTS__DESTINATION",
            "S3://AKIDEXAMPLE:wJalrXUtnFEMI@bucket/prefix",
        )],
    );
    assert!(!out.status.success());
    let said = format!("{}{}", support::stdout(&out), stderr(&out));
    assert!(said.contains("destination"), "{said}");
    assert!(
        !said.contains("wJalrXUtnFEMI") && !said.contains("AKIDEXAMPLE"),
        "{said}"
    );

    let err = fails(run_cairn(&["--config", "/nonexistent/cairn.toml"], &[]));
    assert!(err.contains("does not exist"), "{err}");

    // The number of partitions is fixed once the cluster exists.
    let server = support::Server::start_with(dir.path(), &[], &[("CAIRN_NUM_PARTITIONS", "4")]);
    server.stop();
    let out = run_cairn(
        &["--base-dir", base, "--bind-address", "127.0.0.1:0"],
        &[("CAIRN_NUM_PARTITIONS", "8")],
    );
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(err.contains("created with 4 partitions"), "{err}");
}

/// The line of a table whose first column is `key`.
fn row<'a>(table: &'a str, key: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("no row {key} in\n{table}"))
}

/// Issue 8, item 9: AWS secret keys hold `/` and `+`, and a password may hold `#` or `?`. A
/// destination with such credentials is refused, at the configuration check or when the
/// repository is opened, without a character of the secret in the message or the log.
#[test]
fn a_destination_secret_with_url_delimiters_is_never_shown() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_str().unwrap();
    for destination in [
        "s3://AKIDEXAMPLE:wJalrXUtn/FEMI+K7MDENG@bucket/prefix",
        "S3://AKIDEXAMPLE:wJalrXUtn/FEMI+K7MDENG@bucket/prefix",
        "s3://AKIDEXAMPLE:wJalrXUtn#FEMIK7MDENG@bucket/prefix",
        "s3://AKIDEXAMPLE:wJalrXUtn?FEMIK7MDENG@bucket/prefix",
        "file://AKIDEXAMPLE:wJalrXUtn/FEMIK7MDENG@localhost/data",
    ] {
        let out = run_cairn(
            &["--base-dir", base, "--bind-address", "127.0.0.1:0"],
            &[("CAIRN_WORKER__SNAPSHOTS__DESTINATION", destination)],
        );
        assert!(!out.status.success(), "{destination} was accepted");
        let said = format!("{}{}", support::stdout(&out), stderr(&out));
        assert!(said.contains("destination"), "{said}");
        for secret in ["AKIDEXAMPLE", "wJalrXUtn", "FEMI", "K7MDENG"] {
            assert!(!said.contains(secret), "{secret} shown:\n{said}");
        }
    }
}

/// TTLs at the edges, as an operator types them: `10y` is within the "10 years" the limit names;
/// a TTL under a millisecond (the protocol's unit) is refused by `cairnctl` for what it is,
/// rather than sent as 0 and refused as "ttl_ms is 0", and one past 10 years names the bound.
#[test]
fn ttls_at_their_edges_through_cairnctl() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let a = server.address.clone();
    for ttl in ["10y", "3652d", "1ms"] {
        let out = ok(cairnctl(
            &a,
            &["kv", "insert-if-absent", &format!("k-{ttl}"), "--ttl", ttl],
        ));
        assert!(row(&out, &format!("k-{ttl}")).contains("true"), "{out}");
        ok(cairnctl(
            &a,
            &["kv", "put", &format!("p-{ttl}"), "v", "--ttl", ttl],
        ));
    }
    for ttl in ["500us", "999999ns"] {
        let out = cairnctl(&a, &["kv", "put", "short", "v", "--ttl", ttl]);
        let err = fails(out);
        assert!(
            err.contains("shorter than 1 millisecond") && !err.contains("ttl_ms"),
            "{ttl}: {err}"
        );
    }
    let err = fails(cairnctl(&a, &["kv", "put", "long", "v", "--ttl", "11y"]));
    assert!(err.contains("10 years"), "{err}");
    let got = fails(cairnctl(&a, &["kv", "get", "short"]));
    assert!(got.contains("not found"), "{got}");
}

/// Runs `cairn` with `env` for at most 30 s; its exit status (`None` if it was still running,
/// then killed) and everything it printed.
fn run_cairn_briefly(
    base: &str,
    env: &[(&str, &str)],
) -> (Option<std::process::ExitStatus>, String) {
    use std::io::Read;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["--base-dir", base, "--bind-address", "127.0.0.1:0"])
        .env("CAIRN_METRICS__BIND_ADDRESS", "127.0.0.1:0")
        .env("CAIRN_RESP__BIND_ADDRESS", "127.0.0.1:0")
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let mut said = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    (status, said)
}

/// An S3 endpoint URL with credentials in it is refused at start-up naming the key, never
/// shown with them (object_store puts the endpoint in every request error it logs), and never
/// a panic (a secret with `/` in it made object_store's signer panic on an "invalid port").
#[test]
fn an_endpoint_url_with_credentials_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_str().unwrap();
    for endpoint in [
        "http://AKIDEXAMPLE:wJalrXUtn/FEMIK7MDENG@127.0.0.1:1",
        "http://AKIDEXAMPLE:wJalrXUtnFEMIK7MDENG@127.0.0.1:1",
        "not a url AKIDEXAMPLE:wJalrXUtnFEMIK7MDENG",
    ] {
        let (status, said) = run_cairn_briefly(
            base,
            &[
                ("CAIRN_WORKER__SNAPSHOTS__DESTINATION", "s3://bucket/prefix"),
                ("CAIRN_WORKER__SNAPSHOTS__ENDPOINT_URL", endpoint),
                ("CAIRN_WORKER__SNAPSHOTS__ALLOW_HTTP", "true"),
                ("CAIRN_WORKER__SNAPSHOT_RESTORE_POLICY", "on-init"),
                ("AWS_ACCESS_KEY_ID", "id"),
                ("AWS_SECRET_ACCESS_KEY", "secret"),
            ],
        );
        let status = status.unwrap_or_else(|| panic!("{endpoint} was accepted:\n{said}"));
        assert_eq!(status.code(), Some(1), "{endpoint}:\n{said}");
        assert!(
            said.contains("worker.snapshots.endpoint-url") && !said.contains("panicked"),
            "{said}"
        );
        for secret in ["AKIDEXAMPLE", "wJalrXUtn", "FEMI", "K7MDENG"] {
            assert!(!said.contains(secret), "{secret} shown:\n{said}");
        }
    }
}

/// A node waiting on an unreachable S3 repository answers nothing within the request timeout;
/// `cairnctl` then says which timeout ran out and how to allow more, not "Timeout expired".
#[test]
fn a_request_timeout_says_which_bound_ran_out() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        dir.path(),
        &[],
        &[
            ("CAIRN_WORKER__SNAPSHOTS__DESTINATION", "s3://bucket/prefix"),
            // Nothing listens on port 1: every request to the repository is retried, then fails.
            (
                "CAIRN_WORKER__SNAPSHOTS__ENDPOINT_URL",
                "http://127.0.0.1:1",
            ),
            ("CAIRN_WORKER__SNAPSHOTS__ALLOW_HTTP", "true"),
            ("AWS_ACCESS_KEY_ID", "id"),
            ("AWS_SECRET_ACCESS_KEY", "secret"),
        ],
    );
    let err = fails(cairnctl(
        &server.address,
        &["--request-timeout", "500", "snapshots", "list", "-p", "0"],
    ));
    assert!(
        err.contains("no answer within 500 ms") && err.contains("--request-timeout"),
        "{err}"
    );
}
