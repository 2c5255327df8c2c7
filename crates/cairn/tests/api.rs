//! Every key-value and admin call through the Rust client against a real server: what works, and
//! what is refused with INVALID_ARGUMENT and the bound in the message.

mod support;

use bytes::Bytes;
use cairn_client::{Client, ClientOptions, Code, PutEntry};
use std::time::Duration;
use support::Server;

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn entry(key: Bytes, value: Bytes) -> PutEntry {
    PutEntry {
        key,
        value,
        ttl: None,
    }
}

#[track_caller]
fn refused<T: std::fmt::Debug>(result: cairn_client::Result<T>, needle: &str) {
    let err = result.unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
    assert!(err.to_string().contains(needle), "{err:?} lacks {needle:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_call_works_and_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();

    // Batches spanning many partitions come back in request order.
    let keys: Vec<Bytes> = (0..200).map(|i| b(&format!("key-{i}"))).collect();
    let entries = keys
        .iter()
        .map(|k| {
            entry(
                k.clone(),
                Bytes::from(format!("value-of-{}", String::from_utf8_lossy(k))),
            )
        })
        .collect();
    client.put(entries).await.unwrap();
    let mut probe = keys.clone();
    probe.push(b("absent"));
    let values = client.get(probe.clone()).await.unwrap();
    for (k, v) in keys.iter().zip(&values) {
        assert_eq!(
            v.as_deref(),
            Some(format!("value-of-{}", String::from_utf8_lossy(k)).as_bytes())
        );
    }
    assert_eq!(values[200], None);
    let exists = client.exists(probe.clone()).await.unwrap();
    assert_eq!(exists.iter().filter(|e| **e).count(), 200);
    assert!(!exists[200]);

    let inserted = client
        .insert_if_absent(
            vec![b("key-0"), b("new"), b("new")],
            b("w"),
            Some(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    assert_eq!(inserted, vec![false, true, false]);
    client.delete(vec![b("key-0"), b("new")]).await.unwrap();
    assert_eq!(
        client
            .exists(vec![b("key-0"), b("new"), b("key-1")])
            .await
            .unwrap(),
        vec![false, false, true]
    );

    // Values at the bound are accepted; one byte more is refused, naming the bound.
    let max_key = Bytes::from(vec![b'k'; 4096]);
    let max_value = Bytes::from(vec![7u8; 1024 * 1024]);
    client
        .put(vec![entry(max_key.clone(), max_value.clone())])
        .await
        .unwrap();
    assert_eq!(
        client.get(vec![max_key.clone()]).await.unwrap(),
        vec![Some(max_value)]
    );

    let long_key = Bytes::from(vec![b'k'; 4097]);
    let big_value = Bytes::from(vec![0u8; 1024 * 1024 + 1]);
    refused(
        client.put(vec![entry(long_key.clone(), b("v"))]).await,
        "limit is 4096 bytes",
    );
    refused(
        client.put(vec![entry(b("k"), big_value.clone())]).await,
        "limit is 1048576 bytes",
    );
    refused(client.put(vec![entry(Bytes::new(), b("v"))]).await, "empty");
    refused(client.put(vec![]).await, "at least one");
    refused(
        client
            .put(vec![PutEntry {
                key: b("k"),
                value: b("v"),
                ttl: Some(Duration::ZERO),
            }])
            .await,
        "positive TTL",
    );
    let too_many: Vec<Bytes> = (0..10_001).map(|i| b(&format!("k{i}"))).collect();
    refused(client.get(too_many.clone()).await, "limit is 10000 keys");
    // 17 values of 1 MiB: each is fine, the batch is not.
    let heavy = (0..17)
        .map(|i| entry(b(&format!("h{i}")), Bytes::from(vec![1u8; 1024 * 1024])))
        .collect();
    refused(client.put(heavy).await, "limit is 16777216 bytes");

    refused(
        client.get(vec![long_key.clone()]).await,
        "limit is 4096 bytes",
    );
    refused(client.get(vec![]).await, "at least one");
    refused(
        client.exists(vec![long_key.clone()]).await,
        "limit is 4096 bytes",
    );
    refused(client.exists(vec![]).await, "at least one");
    refused(client.delete(vec![Bytes::new()]).await, "empty");
    refused(client.delete(too_many.clone()).await, "limit is 10000 keys");
    refused(
        client
            .insert_if_absent(vec![long_key.clone()], Bytes::new(), None)
            .await,
        "limit is 4096 bytes",
    );
    refused(
        client.insert_if_absent(vec![b("x")], big_value, None).await,
        "limit is 1048576 bytes",
    );
    refused(
        client
            .insert_if_absent(
                vec![b("x")],
                Bytes::new(),
                Some(Duration::from_secs(20 * 365 * 86_400)),
            )
            .await,
        "10 years",
    );
    refused(
        client.insert_if_absent(vec![], Bytes::new(), None).await,
        "at least one",
    );
    // Nothing refused left a trace.
    assert_eq!(
        client.exists(vec![b("x"), b("h0"), b("k")]).await.unwrap(),
        vec![false, false, false]
    );

    // Admin calls.
    let cluster = client.describe_cluster().await.unwrap();
    assert_eq!(
        (
            cluster.cluster_name.as_str(),
            cluster.node_name.as_str(),
            cluster.num_partitions
        ),
        ("cairn", "n1", 16)
    );
    let partitions = client.list_partitions().await.unwrap().partitions;
    assert_eq!(partitions.len(), 16);
    assert!(
        partitions
            .iter()
            .all(|p| p.status == "active" && p.applied_lsn == p.log_tail)
    );
    assert_eq!(client.describe_logs(None).await.unwrap().len(), 16);
    let err = client.describe_logs(Some(16)).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound), "{err}");
    let err = client.trim_log(70_000, 1, false).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound), "{err}");
    let log = &client.describe_logs(Some(0)).await.unwrap()[0];
    let err = client.trim_log(0, log.tail + 1, true).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::FailedPrecondition), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_out_of_range_are_refused_as_the_callers_mistake() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &[], &[("CAIRN_NUM_PARTITIONS", "2")]);
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();

    // Insert-if-absent stores its value under every key: 17 keys of a 1 MiB value is 17 MiB.
    let keys: Vec<Bytes> = (0..17).map(|i| b(&format!("amp{i}"))).collect();
    let value = Bytes::from(vec![1u8; 1024 * 1024]);
    refused(
        client
            .insert_if_absent(keys.clone(), value.clone(), None)
            .await,
        "the limit is 16777216 bytes",
    );
    let err = client
        .insert_if_absent(keys.clone(), value.clone(), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("under each of its 17 keys"), "{err}");
    assert_eq!(client.exists(keys.clone()).await.unwrap(), vec![false; 17]);
    // 15 of them (15 MiB and their keys) are within the bound.
    let inserted = client
        .insert_if_absent(keys[..15].to_vec(), value, None)
        .await
        .unwrap();
    assert_eq!(inserted, vec![true; 15]);

    // 2^64 ms + 384 ms used to wrap to a TTL of 384 ms; the client refuses it before sending.
    let err = client
        .put(vec![PutEntry {
            key: b("wrapped"),
            value: b("v"),
            ttl: Some(Duration::from_secs(18_446_744_073_709_552)),
        }])
        .await
        .unwrap_err();
    assert!(
        matches!(err, cairn_client::Error::TtlOutOfRange { .. }),
        "{err}"
    );
    assert_eq!(client.get(vec![b("wrapped")]).await.unwrap(), vec![None]);

    // A minimum LSN past the log's tail names the tail.
    let tail = client.describe_logs(Some(0)).await.unwrap()[0].tail;
    let Err(err) = client.create_snapshot(0, Some(tail + 1000), false).await else {
        panic!("a minimum LSN past the tail was accepted");
    };
    assert_eq!(err.code(), Some(Code::OutOfRange), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("log 0 ends at LSN {tail}")),
        "{err}"
    );

    // A snapshot id that is not UTF-8 is a bad argument, not a server fault.
    let mut admin = cairn_client::v1::admin_client::AdminClient::connect(server.address.clone())
        .await
        .unwrap();
    let not_utf8 = Bytes::from_static(&[0xff, 0xfe, b'x']);
    let status = admin
        .describe_snapshot(cairn_client::v1::DescribeSnapshotRequest {
            snapshot_id: not_utf8.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("not UTF-8"), "{status:?}");
    let status = admin
        .restore_partition(cairn_client::v1::RestorePartitionRequest {
            partition_id: 0,
            snapshot_id: Some(not_utf8),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
}

/// Requests at the request bound exactly are served, one byte past it refused naming it; and
/// what was written at the bound can be read back in one request.
#[tokio::test(flavor = "multi_thread")]
async fn requests_at_the_byte_bound_are_served_and_read_back() {
    const MAX: usize = cairn_types::limits::BATCH_BYTES_MAX;
    const VALUE_MAX: usize = cairn_types::limits::VALUE_BYTES_MAX;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();

    // 16 one-byte keys, each with a value one byte short of the largest: exactly 16 MiB stored.
    let keys: Vec<Bytes> = (0..16u8).map(|i| Bytes::from(vec![b'a' + i])).collect();
    let value = Bytes::from(vec![7u8; VALUE_MAX - 1]);
    assert_eq!(keys.len() * (1 + value.len()), MAX);
    let inserted = client
        .insert_if_absent(keys.clone(), value.clone(), None)
        .await
        .unwrap();
    assert!(inserted.iter().all(|&i| i), "{inserted:?}");
    // One byte more in one key is past the bound.
    let mut over = keys.clone();
    over[0] = b("zz");
    refused(
        client.insert_if_absent(over, value.clone(), None).await,
        &format!("the limit is {MAX} bytes"),
    );
    // A put of the same bytes, at the bound and one past it.
    let entries = |keys: &[Bytes]| {
        keys.iter()
            .map(|k| entry(k.clone(), value.clone()))
            .collect()
    };
    let put_keys: Vec<Bytes> = (0..16u8).map(|i| Bytes::from(vec![b'A' + i])).collect();
    client.put(entries(&put_keys)).await.unwrap();
    let mut over = put_keys.clone();
    over[0] = b("ZZ");
    refused(
        client.put(entries(&over)).await,
        &format!("the limit is {MAX} bytes"),
    );

    // Everything written in one request at the bound is read back in one request.
    let values = client.get(keys.clone()).await.unwrap();
    assert!(values.iter().all(|v| v.as_ref() == Some(&value)));
    // Both requests' keys at once: twice the bound in values, more than any answer can carry.
    // Refused as the caller's to split, with the bound, not an encoder's error.
    let mut both = keys.clone();
    both.extend(put_keys.clone());
    refused(
        client.get(both).await,
        &format!("more than {MAX} bytes, the limit for one answer; split the request"),
    );
    // Existence needs no values: any number of keys.
    let mut many: Vec<Bytes> = keys.clone();
    many.extend(put_keys);
    assert!(client.exists(many).await.unwrap().iter().all(|&e| e));
}

fn write_op(
    key: &str,
    action: cairn_client::v1::write_op::Action,
    condition: cairn_client::v1::WriteCondition,
    return_old: bool,
) -> cairn_client::v1::WriteOp {
    cairn_client::v1::WriteOp {
        key: b(key),
        action: Some(action),
        condition: condition as i32,
        return_old,
    }
}

/// The conditional writes through gRPC: decided by the partitions, answered per operation in
/// request order across partitions; an all-or-nothing write over several partitions is refused.
#[tokio::test(flavor = "multi_thread")]
async fn conditional_writes_answer_per_operation() {
    use cairn_client::v1::{self, WriteCondition, write_op::Action};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let client = Client::connect(&server.address, &ClientOptions::default())
        .await
        .unwrap();
    let set = |value: &str, after_ms: Option<u64>| {
        Action::Set(v1::SetAction {
            value: b(value),
            expiry: after_ms.map(|ms| v1::ExpirySpec {
                when: Some(v1::expiry_spec::When::AfterMs(ms)),
            }),
        })
    };
    // 100 keys over every partition: set if present does nothing, then set returns no old value,
    // then set if present returns the first value.
    let keys: Vec<String> = (0..100).map(|i| format!("cw-{i}")).collect();
    let round = |keys: &[String], value: &'static str, condition, return_old| {
        keys.iter()
            .map(|k| write_op(k, set(value, Some(60_000)), condition, return_old))
            .collect::<Vec<_>>()
    };
    let results = client
        .write(round(&keys, "x", WriteCondition::IfPresent, false), false)
        .await
        .unwrap();
    assert!(results.iter().all(|r| !r.applied && !r.existed));
    client
        .write(round(&keys, "first", WriteCondition::Always, false), false)
        .await
        .unwrap();
    // Old values come back for as many operations as an answer of largest values can hold.
    refused(
        client
            .write(round(&keys[..17], "y", WriteCondition::Always, true), false)
            .await,
        "17 operations ask for the old value; the limit is 16",
    );
    let mut results = Vec::new();
    for share in keys.chunks(16) {
        results.extend(
            client
                .write(
                    round(share, "second", WriteCondition::IfPresent, true),
                    false,
                )
                .await
                .unwrap(),
        );
    }
    assert_eq!(results.len(), 100);
    assert!(
        results
            .iter()
            .all(|r| r.applied && r.old_value.as_deref() == Some(&b"first"[..]))
    );
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let read = client
        .get_with_expiry(keys.iter().map(|k| b(k)).collect())
        .await
        .unwrap();
    for value in read {
        let (value, expires) = value.unwrap();
        assert_eq!(value, b("second"));
        let expires = expires.unwrap();
        assert!(
            expires > before && expires <= before + 60_000,
            "{expires} vs {before}"
        );
    }
    // Delete says which keys existed.
    let results = client
        .write(
            vec![
                write_op(
                    "cw-1",
                    Action::Delete(v1::DeleteAction {}),
                    WriteCondition::Always,
                    false,
                ),
                write_op(
                    "cw-1",
                    Action::Delete(v1::DeleteAction {}),
                    WriteCondition::Always,
                    false,
                ),
            ],
            false,
        )
        .await
        .unwrap();
    assert_eq!(
        results.iter().map(|r| r.existed).collect::<Vec<_>>(),
        vec![true, false]
    );
    refused(
        client
            .write(round(&keys, "y", WriteCondition::IfAbsent, false), true)
            .await,
        "must keep its keys in one partition",
    );
    refused(
        client
            .write(
                vec![write_op(
                    "k",
                    set("v", Some(0)),
                    WriteCondition::Always,
                    false,
                )],
                false,
            )
            .await,
        "expires after 0 ms",
    );
    server.stop();
}

/// Every connection holds a descriptor that the node's own files need too: the gRPC port takes
/// at most `max-connections` at once, tells one more why (`RESOURCE_EXHAUSTED`, naming the
/// setting) and closes it, and a freed place is taken again.
#[tokio::test(flavor = "multi_thread")]
async fn connections_beyond_max_connections_are_told_and_closed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &[], &[("CAIRN_MAX_CONNECTIONS", "2")]);
    let a = &server.address;
    let first = read_within(a).await;
    let second = read_within(a).await;
    let Err(refused) = try_read(a).await else {
        panic!("a third connection was served");
    };
    assert_eq!(refused.code(), Some(Code::ResourceExhausted), "{refused}");
    assert!(
        refused.to_string().contains("max-connections"),
        "the refusal does not name the setting: {refused}"
    );
    // A client with many calls at once on the refused connection gets the reason on each.
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(5),
    };
    let many = Client::connect(a, &options).await.unwrap();
    let calls = (0..16).map(|i| many.get(vec![b(&format!("k{i}"))]));
    for answer in futures::future::join_all(calls).await {
        let Err(refused) = answer else {
            panic!("a call on a refused connection was served");
        };
        assert_eq!(refused.code(), Some(Code::ResourceExhausted), "{refused}");
    }

    drop(first);
    let third = read_within(a).await;
    second.get(vec![b("k")]).await.unwrap();
    third.get(vec![b("k")]).await.unwrap();
    server.stop();
}

/// A client outlives its node: a call that meets the dead connection fails, and a later call on
/// the same client dials the node again once it is back on its address.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_dials_again_once_its_node_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let address = server.address.clone();
    let client = read_within(&address).await;
    client
        .put(vec![PutEntry {
            key: b("k"),
            value: b("before the kill"),
            ttl: None,
        }])
        .await
        .unwrap();
    server.kill();
    let down = client.get(vec![b("k")]).await;
    assert!(down.is_err(), "a killed node answered: {down:?}");

    let host_port = address.trim_start_matches("http://");
    let server = Server::start_with(dir.path(), &["--bind-address", host_port], &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let values = loop {
        match client.get(vec![b("k")]).await {
            Ok(values) => break values,
            Err(err) => assert!(
                std::time::Instant::now() < deadline,
                "the client never reached the node again: {err}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(values, vec![Some(b("before the kill"))]);
    server.stop();
}

/// A new connection to `address` that answers a read, or the error of the connect or the read.
async fn try_read(address: &str) -> cairn_client::Result<Client> {
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(5),
    };
    let client = Client::connect(address, &options).await?;
    client.get(vec![b("k")]).await?;
    Ok(client)
}

/// [`try_read`] until it works: the server counts a closed connection once it notices.
async fn read_within(address: &str) -> Client {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match try_read(address).await {
            Ok(client) => return client,
            Err(err) => assert!(
                std::time::Instant::now() < deadline,
                "no place was freed: {err}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
