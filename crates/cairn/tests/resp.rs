//! The Redis-protocol port against a real server process, through the `redis` client library and
//! `redis-cli`: every command's replies and errors (checked against what `redis-server` itself
//! answers, where it is installed), binary keys, long pipelines, many connections, malformed
//! frames, the insert-if-absent race, and SIGKILL under load.

mod support;

use redis::aio::MultiplexedConnection;
use redis::{RedisResult, Value};
use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use support::Server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn connect(address: &str) -> MultiplexedConnection {
    connection(&redis::Client::open(format!("redis://{address}/")).unwrap()).await
}

/// A connection of its own, which waits as long as a busy test machine may need for an answer
/// (the client library's default gives up after 500 ms).
async fn connection(client: &redis::Client) -> MultiplexedConnection {
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(60)));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap()
}

fn start_cairn(dir: &std::path::Path) -> (Server, String) {
    let server = Server::start(dir);
    let address = server.resp_address().expect("the RESP port is on");
    (server, address)
}

/// A reply as text, for comparing: `OK`, `nil`, integers, quoted strings, `[…]` arrays, and
/// errors as `CODE detail`.
fn show(reply: RedisResult<Value>) -> String {
    fn value(v: &Value) -> String {
        match v {
            Value::Nil => "nil".into(),
            Value::Okay => "OK".into(),
            Value::SimpleString(s) => s.clone(),
            Value::Int(n) => n.to_string(),
            Value::BulkString(b) => format!("{:?}", String::from_utf8_lossy(b)),
            Value::Array(items) => format!(
                "[{}]",
                items.iter().map(value).collect::<Vec<_>>().join(", ")
            ),
            Value::ServerError(e) => format!("{} {}", e.code(), e.details().unwrap_or_default()),
            other => format!("{other:?}"),
        }
    }
    match reply {
        Ok(v) => value(&v),
        Err(e) => format!(
            "{} {}",
            e.code().unwrap_or("?"),
            e.detail().unwrap_or_default()
        )
        .trim()
        .to_string(),
    }
}

/// Commands and what Redis 7 answers to each, in order: run against Cairn, and against
/// `redis-server` where it is installed, to check the expectations themselves.
const SCRIPT: &[(&str, &str)] = &[
    ("SET k1 v1", "OK"),
    ("GET k1", "\"v1\""),
    ("GET missing", "nil"),
    ("SET k1 v2 GET", "\"v1\""),
    ("SET k1 v3 NX", "nil"),
    ("SET k1 v3 NX GET", "\"v2\""),
    ("GET k1", "\"v2\""),
    ("SET newk v XX", "nil"),
    ("SET newk v XX GET", "nil"),
    ("EXISTS newk", "0"),
    ("SET k1 v4 XX", "OK"),
    ("SETNX k1 x", "0"),
    ("SETNX k2 x", "1"),
    ("SET k1 v EX 0", "ERR invalid expire time in 'set' command"),
    ("SET k1 v PX -3", "ERR invalid expire time in 'set' command"),
    (
        "SET k1 v EX abc",
        "ERR value is not an integer or out of range",
    ),
    ("SET k1 v NX XX", "ERR syntax error"),
    ("SET k1 v PX 100 EX 100", "ERR syntax error"),
    ("SET k1 v KEEPTTL EX 5", "ERR syntax error"),
    ("SET k1", "ERR wrong number of arguments for 'set' command"),
    ("SETEX k3 100 v", "OK"),
    ("TTL k3", "100"),
    ("SETEX k3 0 v", "ERR invalid expire time in 'setex' command"),
    ("SET k3 v2 KEEPTTL", "OK"),
    ("TTL k3", "100"),
    ("SET k3 v3", "OK"),
    ("TTL k3", "-1"),
    ("TTL missing", "-2"),
    ("PTTL missing", "-2"),
    ("PSETEX k4 100000 v", "OK"),
    ("TTL k4", "100"),
    ("SET k5 v EXAT 4102444800", "OK"),
    (
        "SET k5 v EXAT 18446744073709551",
        "ERR invalid expire time in 'set' command",
    ),
    (
        "EXPIRETIME k5",
        "ERR unknown command 'EXPIRETIME', with args beginning with: 'k5'",
    ),
    ("MSET a 1 b 2 c 3", "OK"),
    ("MGET a b missing c", "[\"1\", \"2\", nil, \"3\"]"),
    ("MSET a", "ERR wrong number of arguments for 'mset' command"),
    ("EXISTS a b missing a", "3"),
    ("DEL a missing a", "1"),
    ("UNLINK b c", "2"),
    ("EXPIRE k1 100", "1"),
    ("EXPIRE missing 100", "0"),
    ("EXPIRE k1 100 NX", "0"),
    ("EXPIRE k1 200 GT", "1"),
    ("EXPIRE k1 50 GT", "0"),
    ("EXPIRE k1 50 LT", "1"),
    ("EXPIRE k1 10 XX", "1"),
    ("TTL k1", "10"),
    ("PERSIST k1", "1"),
    ("PERSIST k1", "0"),
    ("TTL k1", "-1"),
    (
        "EXPIRE k1 5 NX XX",
        "ERR NX and XX, GT or LT options at the same time are not compatible",
    ),
    ("EXPIRE k1 5 SOON", "ERR Unsupported option SOON"),
    ("PEXPIRE k1 100000", "1"),
    ("TTL k1", "100"),
    ("EXPIRE k1 50 XX LT", "1"),
    ("EXPIRE k1 500 XX GT", "1"),
    ("TTL k1", "500"),
    (
        "EXPIRE k1 5 GT LT",
        "ERR GT and LT options at the same time are not compatible",
    ),
    (
        "EXPIRE k1 5 NX GT",
        "ERR NX and XX, GT or LT options at the same time are not compatible",
    ),
    ("EXPIREAT k1 4102444800", "1"),
    ("PEXPIREAT k1 1", "1"),
    ("EXISTS k1", "0"),
    ("SET k1 v", "OK"),
    ("EXPIRE k1 -1", "1"),
    ("GET k1", "nil"),
    ("MSETNX m1 1", "1"),
    ("MSETNX m1 2", "0"),
    ("GET m1", "\"1\""),
    ("GET", "ERR wrong number of arguments for 'get' command"),
    ("PING", "PONG"),
    ("PING hi", "\"hi\""),
    ("ECHO hello", "\"hello\""),
    ("SELECT 0", "OK"),
    ("SELECT 99", "ERR DB index is out of range"),
    ("CLIENT SETNAME conn1", "OK"),
    ("CLIENT GETNAME", "\"conn1\""),
    (
        "CLIENT NOSUCH",
        "ERR unknown subcommand 'NOSUCH'. Try CLIENT HELP.",
    ),
    (
        "NOSUCH x",
        "ERR unknown command 'NOSUCH', with args beginning with: 'x'",
    ),
    (
        "AUTH pw",
        "ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?",
    ),
    ("HELLO 4", "NOPROTO unsupported protocol version"),
];

async fn run_script(connection: &mut MultiplexedConnection) -> Vec<String> {
    let mut replies = Vec::new();
    for (line, _) in SCRIPT {
        let mut command = redis::cmd(line.split(' ').next().unwrap());
        for arg in line.split(' ').skip(1) {
            command.arg(arg);
        }
        replies.push(show(command.query_async::<Value>(connection).await));
    }
    replies
}

/// A `redis-server` of the test's own on a free port, if it is installed.
struct RedisServer {
    child: Child,
    address: String,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    fn start() -> Option<RedisServer> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--dir", dir.path().to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let address = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(&address).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(RedisServer {
            child,
            address,
            _dir: dir,
        })
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_command_answers_as_redis_does() {
    let dir = tempfile::tempdir().unwrap();
    let (server, address) = start_cairn(dir.path());
    let replies = run_script(&mut connect(&address).await).await;
    let expected: Vec<String> = SCRIPT.iter().map(|(_, e)| e.to_string()).collect();
    for ((line, want), got) in SCRIPT.iter().zip(&replies) {
        assert_eq!(got, want, "Cairn's reply to {line:?}");
    }
    match RedisServer::start() {
        Some(redis) => {
            let from_redis = run_script(&mut connect(&redis.address).await).await;
            for ((line, _), (got, want)) in SCRIPT.iter().zip(from_redis.iter().zip(&expected)) {
                // Cairn refuses what it does not implement; Redis knows it.
                if line.starts_with("EXPIRETIME") {
                    continue;
                }
                assert_eq!(got, want, "redis-server's reply to {line:?}");
            }
            eprintln!(
                "redis-server answered the {} commands as Cairn did",
                SCRIPT.len()
            );
        }
        None => eprintln!("redis-server is not installed: replies checked against the script only"),
    }

    // Cairn's own bounds, with the bound in the reply.
    let mut c = connect(&address).await;
    let long_key = vec![b'k'; 4097];
    let big_value = vec![b'v'; (1 << 20) + 1];
    let reply = show(
        redis::cmd("SET")
            .arg(&long_key)
            .arg("v")
            .query_async(&mut c)
            .await,
    );
    assert!(reply.contains("at most 4096 bytes"), "{reply}");
    let reply = show(
        redis::cmd("SET")
            .arg("k")
            .arg(&big_value)
            .query_async(&mut c)
            .await,
    );
    assert!(reply.contains("at most 1048576 bytes"), "{reply}");
    let reply = show(redis::cmd("GET").arg("").query_async(&mut c).await);
    assert!(reply.contains("empty key"), "{reply}");
    // 20 values of 1 MiB: their presence is counted without reading them (the values alone
    // would be past a read's bound), and 2,000 EXPIREs of one of them in one pipeline are quick.
    let mut pipe = redis::pipe();
    for i in 0..20 {
        pipe.cmd("SET")
            .arg(format!("big-{i}"))
            .arg(&big_value[1..])
            .ignore();
    }
    let () = pipe.query_async(&mut c).await.unwrap();
    let present: usize = redis::cmd("EXISTS")
        .arg((0..20).map(|i| format!("big-{i}")).collect::<Vec<_>>())
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(present, 20);
    let mut pipe = redis::pipe();
    for ttl in 0..2000 {
        pipe.cmd("EXPIRE").arg("big-0").arg(1000 + ttl).ignore();
    }
    let () = pipe.query_async(&mut c).await.unwrap();
    let ttl: i64 = redis::cmd("TTL")
        .arg("big-0")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!((2990..=3000).contains(&ttl), "{ttl}");
    // Old values are asked for in shares an answer can hold.
    let mut pipe = redis::pipe();
    for i in 0..20 {
        pipe.cmd("SET")
            .arg(format!("big-{i}"))
            .arg("small")
            .arg("GET");
    }
    let old: Vec<Vec<u8>> = pipe.query_async(&mut c).await.unwrap();
    assert!(old.iter().all(|v| v.len() == 1 << 20));
    // The connection is still usable after every refusal.
    assert_eq!(show(redis::cmd("PING").query_async(&mut c).await), "PONG");
    let info: String = redis::cmd("INFO").query_async(&mut c).await.unwrap();
    for section in ["# Server", "# Clients", "# Persistence", "# Keyspace"] {
        assert!(info.contains(section), "{info}");
    }
    assert!(info.contains("connected_clients:"), "{info}");
    let metrics = support::scrape(&server);
    assert!(
        metrics.contains("cairn_resp_commands_total{command=\"set\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("cairn_resp_command_duration_seconds_bucket{command=\"get\""));
    server.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn resp3_binary_keys_and_a_pipeline_of_ten_thousand() {
    let dir = tempfile::tempdir().unwrap();
    let (server, address) = start_cairn(dir.path());
    // RESP3 after HELLO 3: maps and RESP3 nulls, which the client reads as such.
    let mut c3 =
        connection(&redis::Client::open(format!("redis://{address}/?protocol=resp3")).unwrap())
            .await;
    let hello: Value = redis::cmd("HELLO")
        .arg(3)
        .query_async(&mut c3)
        .await
        .unwrap();
    let Value::Map(fields) = hello else {
        panic!("HELLO 3 answered {hello:?}")
    };
    assert!(fields.contains(&(Value::BulkString(b"proto".to_vec()), Value::Int(3))));
    let missing: Value = redis::cmd("GET")
        .arg("nothing")
        .query_async(&mut c3)
        .await
        .unwrap();
    assert_eq!(missing, Value::Nil);

    // Every byte value in a key, and line breaks and zeros in a value.
    let mut c = connect(&address).await;
    let key: Vec<u8> = (0..=255u8).collect();
    let value = b"\r\n\0binary\r\n$3\r\n".to_vec();
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg(&value)
        .query_async(&mut c)
        .await
        .unwrap();
    let read: Vec<u8> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(read, value);

    // 10,000 writes then 10,000 reads, each in one pipeline; then writes and reads interleaved,
    // which must see each other in order.
    let mut pipe = redis::pipe();
    for i in 0..10_000 {
        pipe.cmd("SET").arg(format!("p:{i}")).arg(format!("v:{i}"));
    }
    let oks: Vec<Value> = pipe.query_async(&mut c).await.unwrap();
    assert!(oks.iter().all(|v| *v == Value::Okay));
    let mut pipe = redis::pipe();
    for i in 0..10_000 {
        pipe.cmd("GET").arg(format!("p:{i}"));
    }
    let values: Vec<String> = pipe.query_async(&mut c).await.unwrap();
    assert!(
        values
            .iter()
            .enumerate()
            .all(|(i, v)| *v == format!("v:{i}"))
    );
    let mut pipe = redis::pipe();
    for i in 0..100 {
        pipe.cmd("SET").arg("order").arg(i).cmd("GET").arg("order");
        pipe.cmd("DEL").arg("order").cmd("EXISTS").arg("order");
    }
    let replies: Vec<Value> = pipe.query_async(&mut c).await.unwrap();
    for (i, step) in replies.chunks(4).enumerate() {
        assert_eq!(step[1], Value::BulkString(i.to_string().into_bytes()));
        assert_eq!(&step[2..], &[Value::Int(1), Value::Int(0)]);
    }
    server.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_connections_and_malformed_frames_leave_the_server_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (server, address) = start_cairn(dir.path());
    let client = redis::Client::open(format!("redis://{address}/")).unwrap();
    let mut tasks = Vec::new();
    for i in 0..100 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            // A connection of its own each, not one shared.
            let mut c = connection(&client).await;
            for j in 0..20 {
                let _: () = redis::cmd("SET")
                    .arg(format!("c:{i}:{j}"))
                    .arg(j)
                    .query_async(&mut c)
                    .await
                    .unwrap();
            }
            let got: Vec<i64> = redis::cmd("MGET")
                .arg((0..20).map(|j| format!("c:{i}:{j}")).collect::<Vec<_>>())
                .query_async(&mut c)
                .await
                .unwrap();
            assert_eq!(got, (0..20).collect::<Vec<i64>>());
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }

    // Malformed frames: an error that says so, then the connection is closed.
    // A million nested arrays: refused at the first nested one (the server may close before the
    // client has sent it all, so the client may see a reset rather than the error).
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    let _ = stream.write_all(&b"*1\r\n".repeat(1_000_000)).await;
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("-ERR Protocol error"),
        "{answer}"
    );
    for garbage in [
        b"*1\r\n*1\r\n$4\r\nPING\r\n",
        &b"*abc\r\n"[..],
        b"SET k \"open quote\r\n",
        b"POST / HTTP/1.1\r\nHost: localhost\r\n\r\nSET k v\r\n",
        b"*1\r\n$4\r\nPINGxx\r\n",
        b"*2\r\n$3\r\nGET\r\n*1\r\n$1\r\nk\r\n",
    ] {
        let answer = send_until_closed(&address, garbage).await;
        // What could be framed before the garbage is answered first.
        assert!(
            answer.contains("-ERR Protocol error"),
            "{garbage:?}: {answer}"
        );
    }
    // Inline commands, as typed into `nc`: a line each, with Redis's quoting; the connection
    // stays open for more, in either form.
    let answer = send_until_closed(
        &address,
        b"PING\r\nSET inline \"hello world\"\nGET inline\r\nNOSUCH a\r\n*2\r\n$3\r\nGET\r\n$6\r\ninline\r\nQUIT\r\n",
    )
    .await;
    assert!(
        answer.starts_with("+PONG\r\n+OK\r\n$11\r\nhello world\r\n-ERR unknown command 'NOSUCH'"),
        "{answer}"
    );
    assert!(
        answer.ends_with("\r\n$11\r\nhello world\r\n+OK\r\n"),
        "{answer}"
    );
    // A HELLO that is refused changes nothing: the connection still speaks RESP2.
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    stream
        .write_all(b"*4\r\n$5\r\nHELLO\r\n$1\r\n3\r\n$7\r\nSETNAME\r\n$3\r\na b\r\n*2\r\n$3\r\nGET\r\n$7\r\nmissing\r\n*1\r\n$4\r\nQUIT\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("-ERR Client names cannot contain"),
        "{answer}"
    );
    assert!(answer.contains("\r\n$-1\r\n+OK\r\n"), "{answer}");
    // A client that sends half a command and goes away.
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    stream
        .write_all(b"*3\r\n$3\r\nSET\r\n$1\r\n")
        .await
        .unwrap();
    drop(stream);
    let mut c = connect(&address).await;
    assert_eq!(show(redis::cmd("PING").query_async(&mut c).await), "PONG");
    server.stop();
}

/// `SET k v NX EX t` is insert-if-absent: raced by many connections, each key is admitted once,
/// and holds the value of the connection that was told it won.
#[tokio::test(flavor = "multi_thread")]
async fn set_nx_raced_by_many_connections_admits_each_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let (server, address) = start_cairn(dir.path());
    let client = redis::Client::open(format!("redis://{address}/")).unwrap();
    let keys = 300;
    let mut tasks = Vec::new();
    for racer in 0..16 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = connection(&client).await;
            let mut pipe = redis::pipe();
            for k in 0..keys {
                pipe.cmd("SET")
                    .arg(format!("race:{k}"))
                    .arg(format!("racer-{racer}"))
                    .arg("NX")
                    .arg("EX")
                    .arg(600);
            }
            let replies: Vec<Value> = pipe.query_async(&mut c).await.unwrap();
            let won: Vec<usize> = (0..keys).filter(|&k| replies[k] == Value::Okay).collect();
            (racer, won)
        }));
    }
    let mut winners: HashMap<usize, usize> = HashMap::new();
    for task in tasks {
        let (racer, won) = task.await.unwrap();
        for k in won {
            assert!(
                winners.insert(k, racer).is_none(),
                "key race:{k} admitted twice"
            );
        }
    }
    assert_eq!(winners.len(), keys, "every key admitted once");
    let mut c = connect(&address).await;
    for (k, racer) in winners {
        let value: String = redis::cmd("GET")
            .arg(format!("race:{k}"))
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(value, format!("racer-{racer}"));
    }
    server.stop();
}

/// A pipeline of `SET k v NX EX t` with one value goes as one insert-if-absent: its replies are
/// still Redis's, for a key that exists, one that expired, and a key given twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_pipeline_of_set_nx_answers_as_redis_does() {
    async fn run(address: &str) -> (Vec<String>, Vec<String>) {
        let mut c = connect(address).await;
        let set = |args: &[&str]| {
            let mut command = redis::cmd("SET");
            for arg in args {
                command.arg(*arg);
            }
            command
        };
        let _: Value = set(&["nx:held", "old"]).query_async(&mut c).await.unwrap();
        let _: Value = set(&["nx:expired", "old", "PX", "1"])
            .query_async(&mut c)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut pipe = redis::pipe();
        for key in ["nx:held", "nx:new", "nx:new", "nx:expired", "nx:other"] {
            pipe.add_command(set(&[key, "v", "NX", "EX", "100"]));
        }
        let replies: Vec<Value> = pipe.query_async(&mut c).await.unwrap();
        let mut after = Vec::new();
        for key in ["nx:held", "nx:new", "nx:expired", "nx:other"] {
            after.push(show(redis::cmd("GET").arg(key).query_async(&mut c).await));
            after.push(show(redis::cmd("TTL").arg(key).query_async(&mut c).await));
        }
        (replies.into_iter().map(|r| show(Ok(r))).collect(), after)
    }
    let dir = tempfile::tempdir().unwrap();
    let (server, address) = start_cairn(dir.path());
    let (replies, after) = run(&address).await;
    assert_eq!(replies, ["nil", "OK", "nil", "OK", "OK"]);
    assert_eq!(
        after,
        [
            "\"old\"", "-1", "\"v\"", "100", "\"v\"", "100", "\"v\"", "100"
        ]
    );
    if let Some(redis) = RedisServer::start() {
        assert_eq!(
            run(&redis.address).await,
            (replies, after),
            "redis-server's replies"
        );
    }
    server.stop();
}

/// Writers on the RESP port while the node is SIGKILLed: every `SET` that was answered `OK` is
/// there after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_sets_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let mut acknowledged: Vec<(String, String)> = Vec::new();
    for round in 0..2 {
        let (server, address) = start_cairn(dir.path());
        let stop = Arc::new(AtomicBool::new(false));
        let mut writers = Vec::new();
        for writer in 0..8 {
            let address = address.clone();
            let stop = stop.clone();
            writers.push(tokio::spawn(async move {
                let mut acked = Vec::new();
                let Ok(client) = redis::Client::open(format!("redis://{address}/")) else {
                    return acked;
                };
                let config = redis::AsyncConnectionConfig::new()
                    .set_response_timeout(Some(Duration::from_secs(60)));
                let Ok(mut c) = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                else {
                    return acked;
                };
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    // Pipelines of 10, so that shared commits are in flight when the kill comes.
                    let mut pipe = redis::pipe();
                    let batch: Vec<(String, String)> = (0..10)
                        .map(|j| {
                            let key = format!("kill:{round}:{writer}:{i}:{j}");
                            let value = format!("{key}-value");
                            (key, value)
                        })
                        .collect();
                    for (k, v) in &batch {
                        pipe.cmd("SET").arg(k).arg(v);
                    }
                    match pipe.query_async::<Vec<Value>>(&mut c).await {
                        Ok(replies) => acked.extend(
                            batch
                                .into_iter()
                                .zip(replies)
                                .filter(|(_, r)| *r == Value::Okay)
                                .map(|(kv, _)| kv),
                        ),
                        Err(_) => break,
                    }
                    i += 1;
                }
                acked
            }));
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        server.kill();
        stop.store(true, Ordering::Relaxed);
        for writer in writers {
            acknowledged.extend(writer.await.unwrap());
        }
    }
    assert!(
        acknowledged.len() > 100,
        "only {} sets acknowledged",
        acknowledged.len()
    );
    let (server, address) = start_cairn(dir.path());
    let mut c = connect(&address).await;
    for chunk in acknowledged.chunks(1000) {
        let keys: Vec<&String> = chunk.iter().map(|(k, _)| k).collect();
        let values: Vec<Option<String>> = redis::cmd("MGET")
            .arg(keys)
            .query_async(&mut c)
            .await
            .unwrap();
        for ((key, want), got) in chunk.iter().zip(values) {
            assert_eq!(got.as_ref(), Some(want), "acknowledged {key} lost");
        }
    }
    eprintln!(
        "{} acknowledged sets survived 2 SIGKILLs",
        acknowledged.len()
    );
    server.stop();
}

/// `redis-cli` itself, where it is installed: commands as arguments and from standard input.
#[tokio::test(flavor = "multi_thread")]
async fn redis_cli_works_against_cairn() {
    if Command::new("redis-cli").arg("--version").output().is_err() {
        eprintln!("redis-cli is not installed: skipped");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (server, address) = start_cairn(dir.path());
    let port = address.rsplit(':').next().unwrap().to_string();
    let cli = |args: &[&str], input: &str| {
        let mut child = Command::new("redis-cli")
            .args(["-p", &port])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    };
    assert_eq!(cli(&["SET", "greeting", "hello"], ""), "OK");
    assert_eq!(cli(&["GET", "greeting"], ""), "hello");
    assert_eq!(cli(&["EXISTS", "greeting", "nope"], ""), "1");
    let piped = cli(&[], "SET n 1\nSET n 2 GET\nNOSUCH\nDEL n\n");
    assert_eq!(
        // redis-cli follows an error with an empty line.
        piped.lines().filter(|l| !l.is_empty()).collect::<Vec<_>>(),
        vec![
            "OK",
            "1",
            "ERR unknown command 'NOSUCH', with args beginning with: ",
            "1"
        ]
    );
    let hello = cli(&["-3", "HELLO", "3"], "");
    assert!(hello.contains("proto") && hello.contains('3'), "{hello}");
    let docs = cli(&["COMMAND", "DOCS", "set"], "");
    assert!(docs.contains("summary"), "{docs}");
    assert!(cli(&["INFO", "keyspace"], "").contains("db0:keys="));
    server.stop();
}

/// With the log in NATS, one partition's share of a write is one JetStream message, bounded by
/// the server's `max_payload` (1 MiB). Two pipelined `SET`s of 600 KiB to one partition do not
/// fit one message together; each fits alone, and each is accepted, as Redis would.
#[tokio::test(flavor = "multi_thread")]
async fn pipelined_large_values_on_a_nats_log_are_written_one_by_one() {
    let nats_dir = tempfile::tempdir().unwrap();
    let nats = cairn_metadata::test_util::NatsServer::start(nats_dir.path(), 0);
    let dir = tempfile::tempdir().unwrap();
    let config = support::nats_log_config(dir.path(), &nats.url());
    let server = Server::start_with(
        &dir.path().join("n1"),
        &["--config", config.to_str().unwrap()],
        &[],
    );
    let address = server.resp_address().expect("the RESP port is on");
    let mut c = connect(&address).await;
    let keys = support::keys_of_partition("large", 1, 2);
    let value = vec![b'x'; 600 * 1024];
    let mut pipe = redis::pipe();
    for key in &keys {
        pipe.cmd("SET").arg(key).arg(&value);
    }
    let replies: Vec<Value> = pipe.query_async(&mut c).await.unwrap();
    assert_eq!(replies, vec![Value::Okay, Value::Okay]);
    let read: Vec<Vec<u8>> = redis::cmd("MGET")
        .arg(&keys)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(read.iter().all(|v| *v == value));
    server.stop();
}

/// Sends `bytes` on a connection of its own and returns all that the server answers until it
/// closes the connection (within 10 s).
async fn send_until_closed(address: &str, bytes: &[u8]) -> String {
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("the server closes the connection")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// What a new connection is told before it sends anything: the refusal, or nothing within
/// 300 ms (it was taken; the connection is returned).
async fn refusal(address: &str) -> Result<String, tokio::net::TcpStream> {
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut answer = Vec::new();
    match tokio::time::timeout(Duration::from_millis(300), stream.read_to_end(&mut answer)).await {
        Ok(read) => {
            read.unwrap();
            Ok(String::from_utf8_lossy(&answer).into_owned())
        }
        Err(_) => Err(stream),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn clients_beyond_max_clients_are_told_and_closed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &[], &[("CAIRN_RESP__MAX_CLIENTS", "2")]);
    let address = server.resp_address().expect("the RESP port is on");
    let mut first = connect(&address).await;
    let mut second = connect(&address).await;
    for c in [&mut first, &mut second] {
        let pong: String = redis::cmd("PING").query_async(c).await.unwrap();
        assert_eq!(pong, "PONG");
    }
    assert_eq!(
        refusal(&address).await.ok().as_deref(),
        Some("-ERR max number of clients reached\r\n")
    );
    drop(first);
    // The server sees the closed connection a moment later.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut third = loop {
        match refusal(&address).await {
            Err(taken) => break taken,
            Ok(refused) => assert_eq!(refused, "-ERR max number of clients reached\r\n"),
        }
        assert!(Instant::now() < deadline, "a freed place is never taken");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    third.write_all(b"PING\r\n").await.unwrap();
    let mut pong = [0u8; 7];
    third.read_exact(&mut pong).await.unwrap();
    assert_eq!(&pong, b"+PONG\r\n");
    let pong: String = redis::cmd("PING").query_async(&mut second).await.unwrap();
    assert_eq!(pong, "PONG");
    server.stop();
}

/// redis-py sends a whole pipeline before it reads a reply: a server that stops reading while
/// its replies wait to be written would wait for ever on a client that waits for it.
#[test]
fn a_pipeline_sent_whole_before_its_replies_are_read_is_answered() {
    use std::io::{BufRead, BufReader, Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let (server, address) = start_cairn(dir.path());
    let value = vec![b'v'; 100 * 1024];
    let commands = 200;
    let mut pipeline = Vec::new();
    for _ in 0..commands {
        pipeline.extend_from_slice(b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$102400\r\n");
        pipeline.extend_from_slice(&value);
        pipeline.extend_from_slice(b"\r\n$3\r\nGET\r\n");
    }
    let mut stream = std::net::TcpStream::connect(&address).unwrap();
    // 20 MB each way, far more than the sockets' buffers hold.
    stream
        .set_write_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    stream
        .write_all(&pipeline)
        .expect("the server reads the pipeline while it writes the replies (the write timed out)");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut replies = BufReader::new(stream);
    let mut line = String::new();
    replies.read_line(&mut line).unwrap();
    assert_eq!(line, "$-1\r\n", "the first SET ... GET finds no old value");
    for _ in 1..commands {
        line.clear();
        replies.read_line(&mut line).unwrap();
        assert_eq!(line, "$102400\r\n");
        let mut old = vec![0; 102400 + 2];
        replies.read_exact(&mut old).unwrap();
        assert_eq!(&old[..102400], &value[..]);
    }
    server.stop();
}
