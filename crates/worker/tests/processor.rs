//! Partition processors over a real local log and a real RocksDB store: epoch fencing, TTL
//! determinism across replay, and restart from the applied LSN.

use bytes::Bytes;
use cairn_log::local::{LocalLogOptions, LocalLogProvider};
use cairn_log::{LogProvider, Loglet};
use cairn_partition_store::{PartitionStoreManager, StoreOptions, StoredValue};
use cairn_types::record::{
    Action, Command, Condition, Envelope, Expiry, Header, PutEntry, WriteOp, WriteResult,
};
use cairn_types::{Epoch, KeyRange, LogId, NodeId, PartitionId};
use cairn_worker::{Clock, Error, ManualClock, Partition};
use std::path::Path;
use std::sync::Arc;

const PID: PartitionId = PartitionId(0);

struct Fixture {
    _dir: tempfile::TempDir,
    log: Arc<dyn Loglet>,
    _logs: LocalLogProvider,
    /// Every partition started, so that [`Fixture::stop`] can wait for their processors: a
    /// processor thread still holding RocksDB while the test process exits makes RocksDB abort.
    /// Weak, so that a partition shut down does not keep its store open: a test that drops a
    /// partition before `stop` shuts it down first, as dropping it only asks its thread to stop.
    started: std::sync::Mutex<Vec<std::sync::Weak<Partition>>>,
}

impl Fixture {
    async fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let logs =
            LocalLogProvider::open(dir.path().join("log"), LocalLogOptions::default()).unwrap();
        let log = logs.open(LogId(0)).await.unwrap();
        Fixture {
            _dir: dir,
            log,
            _logs: logs,
            started: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Stops every partition started and waits for their processors.
    async fn stop(&self) {
        let started = std::mem::take(&mut *self.started.lock().unwrap());
        for partition in started.iter().filter_map(std::sync::Weak::upgrade) {
            partition.shutdown().await;
        }
    }

    fn stores(&self, name: &str) -> PartitionStoreManager {
        PartitionStoreManager::open(&self._dir.path().join(name), &StoreOptions::default()).unwrap()
    }

    fn start(
        &self,
        stores: &PartitionStoreManager,
        node: &str,
        clock: Arc<dyn Clock>,
    ) -> Arc<Partition> {
        let partition = Partition::start(
            KeyRange::of_partition(PID, 1),
            NodeId(node.into()),
            stores.open_or_create_partition(PID).unwrap(),
            self.log.clone(),
            clock,
        )
        .unwrap();
        self.started
            .lock()
            .unwrap()
            .push(Arc::downgrade(&partition));
        partition
    }

    /// Node "n1"'s store and partition, leading at epoch 1 with its clock at `now_ms`.
    async fn leading_n1(&self, now_ms: u64) -> (PartitionStoreManager, Arc<Partition>) {
        let stores = self.stores("n1");
        let n1 = self.start(&stores, "n1", Arc::new(ManualClock::new(now_ms)));
        n1.become_leader(Epoch(1)).await.unwrap();
        (stores, n1)
    }

    /// Appends a record as some other node would, bypassing any partition handle.
    async fn append_foreign(&self, epoch: u64, command: Command) {
        let envelope = Envelope {
            header: Header {
                epoch: Epoch(epoch),
                timestamp_ms: 1,
                origin: None,
            },
            command,
        };
        self.log.append(vec![envelope.encode()]).await.unwrap();
    }

    /// A second replica: a fresh store that replays the whole log.
    async fn replay_into_fresh_store(&self, name: &str) -> (PartitionStoreManager, Arc<Partition>) {
        let stores = self.stores(name);
        let replica = self.start(&stores, "replica", Arc::new(ManualClock::new(u64::MAX / 2)));
        let tail = self.log.state().await.unwrap().tail;
        replica.wait_applied(tail).await.unwrap();
        (stores, replica)
    }
}

fn put(key: &str, value: &str, ttl_ms: Option<u64>) -> Vec<PutEntry> {
    vec![PutEntry {
        key: Bytes::copy_from_slice(key.as_bytes()),
        value: Bytes::copy_from_slice(value.as_bytes()),
        ttl_ms,
    }]
}

/// Appends `commands` as records of epoch 1 at time 10 in one append, so that the processor
/// applies them as one run; returns the LSN of the last.
async fn append_epoch_1(
    log: &Arc<dyn Loglet>,
    commands: impl IntoIterator<Item = Command>,
) -> cairn_types::Lsn {
    let payloads = commands
        .into_iter()
        .map(|command| {
            Envelope {
                header: Header {
                    epoch: Epoch(1),
                    timestamp_ms: 10,
                    origin: None,
                },
                command,
            }
            .encode()
        })
        .collect();
    log.append(payloads).await.unwrap()
}

fn key(k: &str) -> Bytes {
    Bytes::copy_from_slice(k.as_bytes())
}

fn stored(stores: &PartitionStoreManager, k: &str) -> Option<StoredValue> {
    stores.partition(PID).unwrap().get(k.as_bytes()).unwrap()
}

#[tokio::test]
async fn an_old_leader_is_fenced_by_a_newer_announcement() {
    let f = Fixture::new().await;
    let stores = f.stores("n1");
    let clock = Arc::new(ManualClock::new(1_000));
    let n1 = f.start(&stores, "n1", clock.clone());

    // Not a leader until announced.
    assert!(matches!(
        n1.put(put("k", "v0", None)).await,
        Err(Error::NotLeader { .. })
    ));
    n1.become_leader(Epoch(1)).await.unwrap();
    n1.put(put("k", "v1", None)).await.unwrap();

    // n2 takes over at epoch 2; n1 has not noticed yet and keeps proposing at epoch 1.
    f.append_foreign(
        2,
        Command::AnnounceLeader {
            epoch: Epoch(2),
            node: NodeId("n2".into()),
        },
    )
    .await;
    f.append_foreign(
        1,
        Command::Put {
            entries: put("k", "stale", None),
        },
    )
    .await;
    n1.wait_applied(f.log.state().await.unwrap().tail)
        .await
        .unwrap();

    let err = n1.put(put("k", "v2", None)).await.unwrap_err();
    assert!(
        matches!(err, Error::NotLeader { leader: Some(ref l), .. } if l.0 == "n2"),
        "{err}"
    );
    assert_eq!(&stored(&stores, "k").unwrap().value[..], b"v1");

    // The new leader's records apply.
    f.append_foreign(
        2,
        Command::Put {
            entries: put("k", "v3", None),
        },
    )
    .await;
    // An announcement of an older epoch changes nothing.
    f.append_foreign(
        1,
        Command::AnnounceLeader {
            epoch: Epoch(1),
            node: NodeId("n1".into()),
        },
    )
    .await;
    f.append_foreign(
        1,
        Command::Put {
            entries: put("k", "stale-again", None),
        },
    )
    .await;
    n1.wait_applied(f.log.state().await.unwrap().tail)
        .await
        .unwrap();
    assert_eq!(&stored(&stores, "k").unwrap().value[..], b"v3");
    let leader = n1.status().await.leader.unwrap();
    assert_eq!((leader.epoch, leader.node.0.as_str()), (Epoch(2), "n2"));

    // Every replica skips the same records: a replay from scratch ends in the same state.
    let (replica_stores, _replica) = f.replay_into_fresh_store("replica").await;
    assert_eq!(stored(&replica_stores, "k"), stored(&stores, "k"));
    f.stop().await;
}

#[tokio::test]
async fn a_restarted_node_serves_only_after_announcing_again() {
    let f = Fixture::new().await;
    let (stores, n1) = f.leading_n1(5).await;
    n1.shutdown().await;
    // Same node name, new incarnation: the stored leader is "n1" at epoch 1, but this handle has
    // not announced itself, so it must not serve.
    let n1b = f.start(&stores, "n1", Arc::new(ManualClock::new(5)));
    assert!(matches!(
        n1b.get(&[key("k")]).await,
        Err(Error::NotLeader { .. })
    ));
    assert!(matches!(
        n1b.become_leader(Epoch(1)).await,
        Err(Error::Fenced { .. })
    ));
    n1b.become_leader(Epoch(2)).await.unwrap();
    assert_eq!(n1b.get(&[key("k")]).await.unwrap(), vec![None]);
    f.stop().await;
}

#[tokio::test]
async fn ttl_expiry_comes_from_the_record_and_replays_identically() {
    let f = Fixture::new().await;
    let stores = f.stores("n1");
    let clock = Arc::new(ManualClock::new(1_000));
    let n1 = f.start(&stores, "n1", clock.clone());
    n1.become_leader(Epoch(1)).await.unwrap();

    n1.put(put("session", "s", Some(500))).await.unwrap();
    assert_eq!(
        n1.insert_if_absent(vec![key("dedup")], key("x"), Some(100))
            .await
            .unwrap(),
        vec![true]
    );
    clock.set(1_050);
    assert_eq!(
        n1.insert_if_absent(vec![key("dedup")], key("x"), Some(100))
            .await
            .unwrap(),
        vec![false]
    );
    assert_eq!(
        n1.get(&[key("session")]).await.unwrap(),
        vec![Some(key("s"))]
    );

    clock.set(1_200);
    // The first insert expired at 1_100: this one wins again.
    assert_eq!(
        n1.insert_if_absent(vec![key("dedup")], key("y"), Some(100))
            .await
            .unwrap(),
        vec![true]
    );
    clock.set(1_500);
    assert_eq!(n1.get(&[key("session")]).await.unwrap(), vec![None]);

    assert_eq!(
        stored(&stores, "session").unwrap().expires_at_ms,
        Some(1_500)
    );
    assert_eq!(stored(&stores, "dedup").unwrap().expires_at_ms, Some(1_300));

    // A replica whose clock is far in the future computes the same expiries and outcomes.
    let (replica_stores, _replica) = f.replay_into_fresh_store("replica").await;
    for k in ["session", "dedup"] {
        assert_eq!(stored(&replica_stores, k), stored(&stores, k), "key {k}");
    }
    f.stop().await;
}

#[tokio::test]
async fn duplicate_keys_in_one_insert_are_admitted_once() {
    let f = Fixture::new().await;
    let (_stores, n1) = f.leading_n1(10).await;
    let inserted = n1
        .insert_if_absent(vec![key("a"), key("b"), key("a")], Bytes::new(), None)
        .await
        .unwrap();
    assert_eq!(inserted, vec![true, true, false]);
    f.stop().await;
}

/// Records that reach the processor together are applied as one write batch; each one still
/// sees the effects of the ones before it, as if they were applied one by one.
#[tokio::test]
async fn records_applied_together_see_each_others_writes() {
    let f = Fixture::new().await;
    let (_stores, n1) = f.leading_n1(10).await;
    let insert = |keys: &[&str], value: &str| Command::InsertIfAbsent {
        keys: keys.iter().map(|k| key(k)).collect(),
        value: key(value),
        ttl_ms: None,
    };
    let commands = [
        insert(&["a", "b"], "first"),
        Command::Delete {
            keys: vec![key("a")],
        },
        insert(&["a", "b", "c"], "second"),
        Command::Put {
            entries: put("a", "put", None),
        },
        insert(&["a"], "third"),
    ];
    // One append: the processor finds all five records at once.
    let tail = append_epoch_1(&f.log, commands).await;
    n1.wait_applied(tail).await.unwrap();
    assert_eq!(
        n1.get(&[key("a"), key("b"), key("c")]).await.unwrap(),
        vec![Some(key("put")), Some(key("first")), Some(key("second"))]
    );
    f.stop().await;
}

/// Puts of keys that no record of the run reads, beside a conditional write that reads one put
/// before it and a put after it that overrides the write: all in one run, each as if applied alone.
#[tokio::test]
async fn puts_in_a_run_with_conditional_writes_apply_in_record_order() {
    let f = Fixture::new().await;
    let (_stores, n1) = f.leading_n1(10).await;
    let write = |ops: Vec<WriteOp>| Command::Write {
        ops,
        all_or_nothing: false,
    };
    let commands = [
        Command::Put {
            entries: [put("x", "1", None), put("y", "1", None)].concat(),
        },
        // Sees the put of x just before it; z is absent.
        write(vec![
            op("x", set("2", Expiry::Never), Condition::IfPresent, false),
            op("z", set("w", Expiry::Never), Condition::IfAbsent, false),
        ]),
        // Overrides the conditional write of z, which must not be written after it.
        Command::Put {
            entries: put("z", "p", None),
        },
        // Nobody in the run reads u.
        Command::Put {
            entries: put("u", "3", None),
        },
    ];
    let tail = append_epoch_1(&f.log, commands).await;
    n1.wait_applied(tail).await.unwrap();
    assert_eq!(
        n1.get(&[key("x"), key("y"), key("z"), key("u")])
            .await
            .unwrap(),
        vec![
            Some(key("2")),
            Some(key("1")),
            Some(key("p")),
            Some(key("3"))
        ]
    );
    f.stop().await;
}

fn op(k: &str, action: Action, condition: Condition, return_old: bool) -> WriteOp {
    WriteOp {
        key: key(k),
        action,
        condition,
        return_old,
    }
}

fn set(value: &str, expiry: Expiry) -> Action {
    Action::Set {
        value: key(value),
        expiry,
    }
}

fn result(applied: bool, existed: bool, old: Option<&str>) -> WriteResult {
    WriteResult {
        applied,
        existed,
        old: old.map(key),
    }
}

/// The writes that read first (set if present, return the old value, keep or change an expiry,
/// delete and count) are decided by the processor from the record, and a replica that replays
/// the log with another clock reaches the same state.
#[tokio::test]
async fn conditional_writes_are_decided_from_the_record() {
    let f = Fixture::new().await;
    let stores = f.stores("n1");
    let clock = Arc::new(ManualClock::new(1_000));
    let n1 = f.start(&stores, "n1", clock.clone());
    n1.become_leader(Epoch(1)).await.unwrap();

    // Set if present: not on an absent key; then a plain set that returns the old value (none).
    let results = n1
        .write(
            vec![
                op("k", set("x", Expiry::Never), Condition::IfPresent, true),
                op("k", set("v1", Expiry::After(500)), Condition::Always, true),
                op("k", set("v2", Expiry::Keep), Condition::IfPresent, true),
            ],
            false,
        )
        .await
        .unwrap();
    assert_eq!(
        results,
        vec![
            result(false, false, None),
            result(true, false, None),
            result(true, true, Some("v1")),
        ]
    );
    // KEEPTTL kept the expiry of v1: 1_000 + 500.
    assert_eq!(stored(&stores, "k").unwrap().expires_at_ms, Some(1_500));

    clock.set(1_100);
    // GT only moves an expiry later; LT only earlier; NX only when there is none.
    let expire = |expiry, condition| op("k", Action::Expire { expiry }, condition, false);
    let results = n1
        .write(
            vec![
                expire(Expiry::After(100), Condition::IfLater),
                expire(Expiry::After(1_000), Condition::IfLater),
                expire(Expiry::After(2_000), Condition::IfEarlier),
                expire(Expiry::Never, Condition::IfNoExpiry),
                expire(Expiry::After(10), Condition::Always),
                op(
                    "absent",
                    Action::Expire {
                        expiry: Expiry::After(10),
                    },
                    Condition::Always,
                    false,
                ),
            ],
            false,
        )
        .await
        .unwrap();
    let applied: Vec<bool> = results.iter().map(|r| r.applied).collect();
    assert_eq!(applied, vec![false, true, false, false, true, false]);
    assert_eq!(stored(&stores, "k").unwrap().expires_at_ms, Some(1_110));

    // Persist (an expiry of never, only where there is one), then an expiry in the past deletes.
    let results = n1
        .write(
            vec![
                op(
                    "k",
                    Action::Expire {
                        expiry: Expiry::Never,
                    },
                    Condition::IfHasExpiry,
                    false,
                ),
                op(
                    "k",
                    Action::Expire {
                        expiry: Expiry::Never,
                    },
                    Condition::IfHasExpiry,
                    false,
                ),
                op(
                    "k",
                    Action::Expire {
                        expiry: Expiry::At(5),
                    },
                    Condition::Always,
                    false,
                ),
            ],
            false,
        )
        .await
        .unwrap();
    assert_eq!(
        results.iter().map(|r| r.applied).collect::<Vec<_>>(),
        vec![true, false, true]
    );
    assert_eq!(stored(&stores, "k"), None);

    // Delete says whether each key existed; an expired key does not count.
    n1.put(put("a", "1", None)).await.unwrap();
    n1.put(put("gone", "1", Some(10))).await.unwrap();
    clock.set(1_200);
    let results = n1
        .write(
            ["a", "gone", "a", "never"]
                .iter()
                .map(|k| op(k, Action::Delete, Condition::Always, false))
                .collect(),
            false,
        )
        .await
        .unwrap();
    assert_eq!(
        results.iter().map(|r| r.existed).collect::<Vec<_>>(),
        vec![true, false, false, false]
    );

    // All or nothing: one key present, so none is set; then all absent, so all are.
    n1.put(put("taken", "t", None)).await.unwrap();
    let msetnx = |keys: &[&str]| {
        keys.iter()
            .map(|k| op(k, set("n", Expiry::Never), Condition::IfAbsent, false))
            .collect::<Vec<_>>()
    };
    let results = n1
        .write(msetnx(&["m1", "taken", "m2"]), true)
        .await
        .unwrap();
    assert!(results.iter().all(|r| !r.applied), "{results:?}");
    assert_eq!(
        n1.get(&[key("m1"), key("m2")]).await.unwrap(),
        vec![None, None]
    );
    let results = n1.write(msetnx(&["m1", "m2"]), true).await.unwrap();
    assert!(results.iter().all(|r| r.applied), "{results:?}");
    // All or nothing also when one operation undoes what another needs: none applies.
    let results = n1
        .write(
            vec![
                op("m1", Action::Delete, Condition::Always, false),
                op(
                    "m1",
                    Action::Expire {
                        expiry: Expiry::After(10),
                    },
                    Condition::IfPresent,
                    false,
                ),
            ],
            true,
        )
        .await
        .unwrap();
    assert!(results.iter().all(|r| !r.applied), "{results:?}");
    assert_eq!(n1.get(&[key("m1")]).await.unwrap(), vec![Some(key("n"))]);

    let (replica_stores, _replica) = f.replay_into_fresh_store("replica").await;
    for k in ["k", "a", "gone", "taken", "m1", "m2"] {
        assert_eq!(stored(&replica_stores, k), stored(&stores, k), "key {k}");
    }
    f.stop().await;
}

/// The deduplication primitive under contention: of many concurrent inserts of one key, which
/// the processor applies in runs, exactly one is told it inserted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_inserts_of_one_key_admit_exactly_one() {
    let f = Fixture::new().await;
    let (_stores, n1) = f.leading_n1(10).await;
    for round in 0..5 {
        let contested = key(&format!("contested-{round}"));
        let attempts: Vec<_> = (0..64)
            .map(|i| {
                let n1 = n1.clone();
                let contested = contested.clone();
                tokio::spawn(async move {
                    n1.insert_if_absent(vec![contested], key(&i.to_string()), None)
                        .await
                        .unwrap()[0]
                })
            })
            .collect();
        let mut winners = Vec::new();
        for (i, attempt) in attempts.into_iter().enumerate() {
            if attempt.await.unwrap() {
                winners.push(i);
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        assert_eq!(
            n1.get(&[contested]).await.unwrap(),
            vec![Some(key(&winners[0].to_string()))]
        );
    }
    f.stop().await;
}

/// Proposals that meet at a leader share records: each proposer still gets its own answer, and
/// a replica replaying those records reaches the leader's state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proposals_that_meet_share_a_record_and_each_gets_its_own_answer() {
    let f = Fixture::new().await;
    let (stores, n1) = f.leading_n1(10).await;
    let before = f.log.state().await.unwrap().tail;
    // 8 keys, each raced by 16 proposers; every proposer also puts a key of its own.
    let proposers = 128;
    let attempts: Vec<_> = (0..proposers)
        .map(|i| {
            let n1 = n1.clone();
            tokio::spawn(async move {
                let (own, contested) = (key(&format!("own-{i}")), key(&format!("c-{}", i % 8)));
                let put = n1.put(vec![PutEntry {
                    key: own,
                    value: key(&format!("v-{i}")),
                    ttl_ms: None,
                }]);
                let insert = n1.insert_if_absent(vec![contested], key(&i.to_string()), None);
                let (put, insert) = tokio::join!(put, insert);
                put.unwrap();
                insert.unwrap()[0]
            })
        })
        .collect();
    let mut winners = std::collections::BTreeMap::new();
    for (i, attempt) in attempts.into_iter().enumerate() {
        if attempt.await.unwrap() {
            assert!(
                winners.insert(i % 8, i).is_none(),
                "key c-{} was inserted twice",
                i % 8
            );
        }
    }
    assert_eq!(
        winners.len(),
        8,
        "every contested key has one winner: {winners:?}"
    );
    for (k, winner) in &winners {
        assert_eq!(
            n1.get(&[key(&format!("c-{k}"))]).await.unwrap(),
            vec![Some(key(&winner.to_string()))],
            "c-{k} holds its winner's value"
        );
    }
    let records = f.log.state().await.unwrap().tail.0 - before.0;
    assert!(
        records < 2 * proposers as u64,
        "{} proposals took {records} records: none shared one",
        2 * proposers
    );
    // A replica applies the batches as the leader did.
    let (replica_stores, _replica) = f.replay_into_fresh_store("replica").await;
    for i in 0..proposers {
        let k = format!("own-{i}");
        assert_eq!(stored(&replica_stores, &k), stored(&stores, &k));
        assert_eq!(
            &stored(&stores, &k).unwrap().value[..],
            format!("v-{i}").as_bytes()
        );
    }
    for k in 0..8 {
        let k = format!("c-{k}");
        assert_eq!(stored(&replica_stores, &k), stored(&stores, &k));
    }
    f.stop().await;
}

/// A batch record of a deposed leader is skipped whole by every replica, like any of its records.
#[tokio::test]
async fn a_batch_of_an_old_epoch_is_fenced_whole() {
    let f = Fixture::new().await;
    let (stores, n1) = f.leading_n1(10).await;
    f.append_foreign(
        2,
        Command::AnnounceLeader {
            epoch: Epoch(2),
            node: NodeId("n2".into()),
        },
    )
    .await;
    let envelope = |epoch: u64, k: &str| {
        Envelope {
            header: Header {
                epoch: Epoch(epoch),
                timestamp_ms: 10,
                origin: None,
            },
            command: Command::Put {
                entries: put(k, "v", None),
            },
        }
        .encode()
    };
    let stale = Envelope::encode_record(&[envelope(1, "a"), envelope(1, "b")]);
    let current = Envelope::encode_record(&[envelope(2, "c"), envelope(2, "d")]);
    let tail = f.log.append(vec![stale, current]).await.unwrap();
    n1.wait_applied(tail).await.unwrap();
    assert_eq!(stored(&stores, "a"), None);
    assert_eq!(stored(&stores, "b"), None);
    assert!(stored(&stores, "c").is_some() && stored(&stores, "d").is_some());
    // A batch of an epoch never announced: the store is not of this log's history, and the
    // partition stops before applying any of it.
    let unknown = Envelope::encode_record(&[envelope(2, "e"), envelope(3, "f")]);
    f.log.append(vec![unknown]).await.unwrap();
    let err = n1.wait_applied(tail.next()).await.unwrap_err();
    assert!(err.to_string().contains("epoch 3"), "{err}");
    assert_eq!(n1.applied_lsn(), tail);
    assert_eq!(stored(&stores, "e"), None);
    f.stop().await;
}

#[tokio::test]
async fn a_restarted_processor_continues_from_its_applied_lsn() {
    let f = Fixture::new().await;
    let dir = f._dir.path().to_path_buf();
    let clock: Arc<ManualClock> = Arc::new(ManualClock::new(10));
    {
        let stores = f.stores("n1");
        let n1 = f.start(&stores, "n1", clock.clone());
        n1.become_leader(Epoch(1)).await.unwrap();
        for i in 0..20 {
            n1.put(put(&format!("k{i}"), "v", None)).await.unwrap();
        }
        assert_eq!(
            n1.insert_if_absent(vec![key("once")], Bytes::new(), None)
                .await
                .unwrap(),
            vec![true]
        );
        n1.shutdown().await;
    }
    reopen_and_check(&f, &dir, clock).await;
    f.stop().await;
}

async fn reopen_and_check(f: &Fixture, _dir: &Path, clock: Arc<ManualClock>) {
    let stores = f.stores("n1");
    let applied = stores.partition(PID).unwrap().applied_lsn().unwrap();
    assert_eq!(applied, f.log.state().await.unwrap().tail);
    let n1 = f.start(&stores, "n1", clock);
    n1.become_leader(Epoch(2)).await.unwrap();
    assert_eq!(n1.applied_lsn(), cairn_types::Lsn(applied.0 + 1));
    assert_eq!(
        n1.insert_if_absent(vec![key("once")], Bytes::new(), None)
            .await
            .unwrap(),
        vec![false]
    );
    assert_eq!(n1.get(&[key("k19")]).await.unwrap(), vec![Some(key("v"))]);
    n1.shutdown().await;
}

#[tokio::test]
async fn a_trim_gap_stops_the_partition_with_the_reason() {
    let f = Fixture::new().await;
    let stores = f.stores("n1");
    {
        let n1 = f.start(&stores, "n1", Arc::new(ManualClock::new(10)));
        n1.become_leader(Epoch(1)).await.unwrap();
        n1.put(put("a", "1", None)).await.unwrap();
        n1.shutdown().await;
    }
    // Records the store has not applied get trimmed away behind its back.
    f.append_foreign(
        1,
        Command::Put {
            entries: put("b", "2", None),
        },
    )
    .await;
    f.append_foreign(
        1,
        Command::Put {
            entries: put("c", "3", None),
        },
    )
    .await;
    let tail = f.log.state().await.unwrap().tail;
    f.log.trim(tail).await.unwrap();

    let n1 = f.start(&stores, "n1", Arc::new(ManualClock::new(10)));
    let err = n1.wait_applied(tail).await.unwrap_err();
    assert!(err.to_string().contains("snapshot"), "{err}");
    assert!(n1.status().await.stopped.is_some());
    assert!(matches!(
        n1.get(&[key("a")]).await,
        Err(Error::Stopped { .. })
    ));
    f.stop().await;
}

#[tokio::test]
async fn trimming_past_the_applied_lsn_is_refused() {
    let f = Fixture::new().await;
    let (_stores, n1) = f.leading_n1(10).await;
    n1.put(put("a", "1", None)).await.unwrap();
    let applied = n1.applied_lsn();
    let err = n1.trim_log(applied.next()).await.unwrap_err();
    assert!(matches!(err, Error::TrimRefused { .. }), "{err}");
    n1.trim_log(applied).await.unwrap();
    assert_eq!(f.log.state().await.unwrap().trim_point, applied);
    f.stop().await;
}

#[tokio::test]
async fn a_trim_the_leadership_fence_refuses_trims_nothing() {
    let f = Fixture::new().await;
    let (_stores, n1) = f.leading_n1(10).await;
    n1.put(put("a", "1", None)).await.unwrap();
    let applied = n1.applied_lsn();
    let deposed = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let asked = deposed.clone();
    n1.set_fence(Arc::new(move |partition, epoch| {
        let deposed = asked.load(std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            if deposed {
                Err(cairn_types::Fenced::new(format!(
                    "partition {partition}: n2 leads at an epoch after {epoch}"
                )))
            } else {
                Ok(())
            }
        })
    }));
    let before = f.log.state().await.unwrap().trim_point;
    let err = n1.trim_log(applied).await.unwrap_err();
    assert!(
        matches!(err, Error::TrimRefused { .. }) && err.to_string().contains("n2 leads"),
        "{err}"
    );
    assert_eq!(f.log.state().await.unwrap().trim_point, before);
    deposed.store(false, std::sync::atomic::Ordering::SeqCst);
    n1.trim_log(applied).await.unwrap();
    assert_eq!(f.log.state().await.unwrap().trim_point, applied);
    f.stop().await;
}

#[tokio::test]
async fn an_export_reports_the_lsn_it_holds_while_writes_go_on() {
    let f = Fixture::new().await;
    let (_stores, n1) = f.leading_n1(10).await;
    let writer = {
        let n1 = n1.clone();
        tokio::spawn(async move {
            for i in 0..200 {
                n1.put(put(&format!("k{i}"), "v", None)).await.unwrap();
            }
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let target = f._dir.path().join("export");
    let export = n1.export(target.clone()).await.unwrap();
    writer.await.unwrap();
    assert!(export.applied_lsn >= cairn_types::Lsn(1));
    assert!(export.applied_lsn <= n1.applied_lsn());
    let total: u64 = export.files.iter().map(|f| f.size).sum();
    assert!(total > 0);
    assert!(
        target
            .join(export.files[0].name.trim_start_matches('/'))
            .exists()
    );
    f.stop().await;
}

/// A partition of node n1 over a local log (so that tests reach the log's fault switches).
async fn start_on_local_log(
    logs: &LocalLogProvider,
    stores: &PartitionStoreManager,
) -> (Arc<cairn_log::local::LocalLoglet>, Arc<Partition>) {
    let log = logs.open_local(LogId(0)).await.unwrap();
    let partition = Partition::start(
        KeyRange::of_partition(PID, 1),
        NodeId("n1".into()),
        stores.open_or_create_partition(PID).unwrap(),
        log.clone(),
        Arc::new(ManualClock::new(1_000)),
    )
    .unwrap();
    (log, partition)
}

#[tokio::test]
async fn a_store_ahead_of_its_log_stops_before_anything_is_appended() {
    let dir = tempfile::tempdir().unwrap();
    let stores =
        PartitionStoreManager::open(&dir.path().join("db"), &StoreOptions::default()).unwrap();
    {
        let logs =
            LocalLogProvider::open(dir.path().join("long"), LocalLogOptions::default()).unwrap();
        let (_, partition) = start_on_local_log(&logs, &stores).await;
        partition.become_leader(Epoch(1)).await.unwrap();
        for i in 0..4 {
            partition
                .put(put(&format!("k{i}"), "v", None))
                .await
                .unwrap();
        }
        assert_eq!(partition.applied_lsn().0, 5);
        partition.shutdown().await;
    }
    // The same store over a log that holds only its first two records: the log lost its end.
    let logs =
        LocalLogProvider::open(dir.path().join("short"), LocalLogOptions::default()).unwrap();
    logs.open_local(LogId(0))
        .await
        .unwrap()
        .append(vec![Bytes::from_static(b"one"), Bytes::from_static(b"two")])
        .await
        .unwrap();
    let (log, partition) = start_on_local_log(&logs, &stores).await;
    let err = partition.become_leader(Epoch(2)).await.unwrap_err();
    match &err {
        Error::StoreAheadOfLog { applied, tail, .. } => assert_eq!((applied.0, tail.0), (5, 2)),
        other => panic!("expected a store ahead of its log, got {other}"),
    }
    let message = err.to_string();
    for needle in [
        "LSN 5",
        "LSN 2",
        "records 3..=5",
        "cairnctl partitions restore -p 0",
        "cairn drop-partition",
    ] {
        assert!(
            message.contains(needle),
            "{needle:?} missing from: {message}"
        );
    }
    assert_eq!(log.state().await.unwrap().tail.0, 2, "nothing was appended");
    // Stopped with that reason: no request is served from the store.
    let stopped = partition.status().await.stopped.expect("stopped");
    assert!(stopped.contains("records 3..=5"), "{stopped}");
    assert!(matches!(
        partition.get(&[key("k0")]).await,
        Err(Error::Stopped { .. })
    ));
    partition.shutdown().await;
}

#[tokio::test]
async fn a_processor_that_finds_its_log_behind_its_store_stops_instead_of_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let stores =
        PartitionStoreManager::open(&dir.path().join("db"), &StoreOptions::default()).unwrap();
    {
        let logs =
            LocalLogProvider::open(dir.path().join("long"), LocalLogOptions::default()).unwrap();
        let (_, partition) = start_on_local_log(&logs, &stores).await;
        partition.become_leader(Epoch(1)).await.unwrap();
        partition.put(put("k", "v", None)).await.unwrap();
        partition.shutdown().await;
    }
    let logs =
        LocalLogProvider::open(dir.path().join("empty"), LocalLogOptions::default()).unwrap();
    let (_, partition) = start_on_local_log(&logs, &stores).await;
    // The processor reaches the tail, sees it below the applied LSN and stops by itself.
    let err = partition
        .wait_applied(cairn_types::Lsn(3))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("applied the log up to LSN 2, but the log ends at LSN 0"),
        "{err}"
    );
    partition.shutdown().await;
}

#[tokio::test]
async fn a_full_disk_fails_writes_only_and_the_partition_recovers_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let stores =
        PartitionStoreManager::open(&dir.path().join("db"), &StoreOptions::default()).unwrap();
    let logs = LocalLogProvider::open(dir.path().join("log"), LocalLogOptions::default()).unwrap();
    let (log, partition) = start_on_local_log(&logs, &stores).await;
    partition.become_leader(Epoch(1)).await.unwrap();
    partition.put(put("before", "1", None)).await.unwrap();

    log.faults()
        .disk_full
        .store(true, std::sync::atomic::Ordering::SeqCst);
    for _ in 0..3 {
        match partition.put(put("during", "2", None)).await {
            Err(Error::Log { source, .. }) => assert!(source.is_disk_full(), "{source}"),
            other => panic!("expected a full-disk error, got {other:?}"),
        }
        // Reads are served, and the processor is still running.
        assert_eq!(
            partition.get(&[key("before")]).await.unwrap(),
            vec![Some(Bytes::from_static(b"1"))]
        );
        assert!(partition.status().await.stopped.is_none());
    }

    log.faults()
        .disk_full
        .store(false, std::sync::atomic::Ordering::SeqCst);
    partition.put(put("after", "3", None)).await.unwrap();
    assert_eq!(
        partition
            .get(&[key("before"), key("during"), key("after")])
            .await
            .unwrap(),
        vec![
            Some(Bytes::from_static(b"1")),
            None,
            Some(Bytes::from_static(b"3"))
        ]
    );
    partition.shutdown().await;
}

type LogFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = cairn_log::Result<T>> + Send + 'a>>;

/// A real local log whose reads hang once `hung` is set, as on a disk that stopped answering.
/// (Written out by hand: this crate does not depend on `async-trait`.)
/// The log, with reads that can be made to hang (a replica falling behind).
struct HangingReads {
    log: Arc<dyn Loglet>,
    hung: std::sync::atomic::AtomicBool,
}

impl HangingReads {
    fn new(log: Arc<dyn Loglet>) -> Arc<HangingReads> {
        Arc::new(HangingReads {
            log,
            hung: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

impl Loglet for HangingReads {
    fn log_id(&self) -> LogId {
        self.log.log_id()
    }

    fn record_bytes_max(&self) -> usize {
        self.log.record_bytes_max()
    }

    fn append<'s, 'f>(&'s self, payloads: Vec<Bytes>) -> LogFuture<'f, cairn_types::Lsn>
    where
        's: 'f,
        Self: 'f,
    {
        self.log.append(payloads)
    }

    fn read<'s, 'f>(
        &'s self,
        from: cairn_types::Lsn,
        max_records: usize,
    ) -> LogFuture<'f, Vec<cairn_log::Entry>>
    where
        's: 'f,
        Self: 'f,
    {
        // Hangs for as long as `hung` is set.
        Box::pin(async move {
            while self.hung.load(std::sync::atomic::Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            self.log.read(from, max_records).await
        })
    }

    fn wait_for_tail<'s, 'f>(&'s self, lsn: cairn_types::Lsn) -> LogFuture<'f, ()>
    where
        's: 'f,
        Self: 'f,
    {
        self.log.wait_for_tail(lsn)
    }

    fn trim<'s, 'f>(&'s self, up_to: cairn_types::Lsn) -> LogFuture<'f, ()>
    where
        's: 'f,
        Self: 'f,
    {
        self.log.trim(up_to)
    }

    fn state<'s, 'f>(&'s self) -> LogFuture<'f, cairn_log::LogState>
    where
        's: 'f,
        Self: 'f,
    {
        self.log.state()
    }
}

#[tokio::test]
async fn taking_the_leadership_gives_up_when_the_processor_stops_moving() {
    let f = Fixture::new().await;
    let stores = f.stores("n1");
    let log = HangingReads::new(f.log.clone());
    let partition = Partition::start(
        KeyRange::of_partition(PID, 1),
        NodeId("n1".into()),
        stores.open_or_create_partition(PID).unwrap(),
        log.clone(),
        Arc::new(ManualClock::new(1_000)),
    )
    .unwrap();
    partition.become_leader(Epoch(1)).await.unwrap();
    partition.put(put("k", "v", None)).await.unwrap();

    log.hung.store(true, std::sync::atomic::Ordering::SeqCst);
    // The processor's next read hangs; the announcement is appended but never applied.
    let started = std::time::Instant::now();
    let err = partition
        .become_leader_within(Epoch(2), std::time::Duration::from_millis(300), None)
        .await
        .unwrap_err();
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    match &err {
        Error::TimedOut { applied, tail, .. } => assert_eq!((applied.0, tail.0), (2, 3)),
        other => panic!("expected a timeout, got {other}"),
    }
    let message = err.to_string();
    assert!(message.contains("made no progress"), "{message}");
    assert!(
        message.contains("cairnctl partitions restore -p 0"),
        "{message}"
    );
    partition.shutdown().await;
}

#[tokio::test]
async fn a_leader_whose_clock_is_behind_does_not_move_partition_time_back() {
    let f = Fixture::new().await;
    let clock = Arc::new(ManualClock::new(10_000));
    let stores = f.stores("n1");
    let n1 = f.start(&stores, "n1", clock.clone());
    n1.become_leader(Epoch(1)).await.unwrap();
    // Expires at 15_000.
    n1.put(put("k", "old", Some(5_000))).await.unwrap();
    clock.set(20_000);
    n1.put(put("tick", "t", None)).await.unwrap();

    // The next leader's clock is at 12_000: before k's expiry, and 8 s behind the partition.
    let n2_stores = f.stores("n2");
    let n2 = f.start(&n2_stores, "n2", Arc::new(ManualClock::new(12_000)));
    n2.become_leader(Epoch(2)).await.unwrap();
    assert_eq!(
        n2.get(&[key("k")]).await.unwrap(),
        vec![None],
        "a value that expired at the partition's time came back under a slow clock"
    );
    assert_eq!(
        n2.insert_if_absent(vec![key("k")], key("new"), Some(1_000))
            .await
            .unwrap(),
        vec![true]
    );
    // Applied at the partition's time, not at the slow clock's 12_000.
    assert_eq!(stored(&n2_stores, "k").unwrap().expires_at_ms, Some(21_000));
    let time = n2_stores.partition(PID).unwrap().partition_time().unwrap();
    assert!(time >= 20_000, "partition time went back to {time}");

    // A replica replaying the same log computes the same.
    let (replica_stores, _replica) = f.replay_into_fresh_store("replica").await;
    assert_eq!(
        stored(&replica_stores, "k"),
        stored(&n2_stores, "k"),
        "the replica diverged"
    );
    f.stop().await;
}

#[tokio::test]
async fn a_compacted_store_and_a_replayed_one_answer_alike() {
    const T0: u64 = 1_000_000;
    let f = Fixture::new().await;
    let clock = Arc::new(ManualClock::new(T0));
    let stores = f.stores("n1");
    let n1 = f.start(&stores, "n1", clock.clone());
    n1.become_leader(Epoch(1)).await.unwrap();
    // Expiries every 10 ms from T0 + 10 to T0 + 2_000; every fifth key never expires.
    let keys: Vec<Bytes> = (1..=200u64).map(|i| key(&format!("key-{i}"))).collect();
    for (i, k) in keys.iter().enumerate() {
        let ttl = (i % 5 != 4).then_some(10 * (i as u64 + 1));
        n1.put(vec![PutEntry {
            key: k.clone(),
            value: key("first"),
            ttl_ms: ttl,
        }])
        .await
        .unwrap();
    }

    // Compacted at T0 + 1_000: the 80 values that expired by then are dropped.
    clock.set(T0 + 1_000);
    let compacted = n1.compact().await.unwrap();
    assert_eq!(compacted.expired_dropped, 80);

    // A replica that replays the whole log into an empty store and is never compacted follows
    // a run of reads and insert-if-absent over keys around their expiry: after every round it
    // holds the same live values, so it decided every insert the same way.
    let replica_stores = f.stores("replica");
    let replica = f.start(&replica_stores, "replica", clock.clone());
    let live = |v: Option<StoredValue>, at: u64| v.filter(|v| v.is_live_at(at));
    let mut last_read = Vec::new();
    for (round, at) in [T0 + 1_000, T0 + 1_005, T0 + 1_500, T0 + 2_500]
        .into_iter()
        .enumerate()
    {
        clock.set(at);
        let read = n1.get(&keys).await.unwrap();
        let inserted = n1
            .insert_if_absent(keys.clone(), key(&format!("round-{round}")), Some(200))
            .await
            .unwrap();
        // What a user sees: a key reads as present exactly when the insert does not win.
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(read[i].is_none(), inserted[i], "{k:?} at {at}");
        }
        if round == 0 {
            assert_eq!(inserted.iter().filter(|i| **i).count(), 80);
        }
        replica.wait_applied(n1.applied_lsn()).await.unwrap();
        for k in &keys {
            let k = std::str::from_utf8(k).unwrap();
            assert_eq!(
                live(stored(&stores, k), at),
                live(stored(&replica_stores, k), at),
                "{k} after round {round}"
            );
        }
        last_read = n1.get(&keys).await.unwrap();
    }
    replica.become_leader(Epoch(2)).await.unwrap();
    assert_eq!(
        replica.get(&keys).await.unwrap(),
        last_read,
        "the replica reads differently"
    );
    f.stop().await;
}

/// Reads a share as a node would.
async fn read_one(share: cairn_worker::ReadShare) -> Option<Bytes> {
    let mut values = cairn_worker::read_shares(vec![share], 16, usize::MAX)
        .await
        .unwrap();
    values.remove(0).remove(0).map(|v| v.value)
}

#[tokio::test]
async fn a_follower_answers_a_bounded_staleness_read_only_once_it_holds_what_was_acknowledged() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::time::Duration;
    let f = Fixture::new().await;
    let (_n1_stores, n1) = f.leading_n1(1_000).await;
    let stores = f.stores("n2");
    let log = HangingReads::new(f.log.clone());
    let n2 = Partition::start(
        KeyRange::of_partition(PID, 1),
        NodeId("n2".into()),
        stores.open_or_create_partition(PID).unwrap(),
        log.clone(),
        Arc::new(ManualClock::new(1_000)),
    )
    .unwrap();
    f.started.lock().unwrap().push(Arc::downgrade(&n2));
    // The leader's read index, as a node asks it of the leader's node; counted.
    let asked = AtomicUsize::new(0);
    let index = || async {
        asked.fetch_add(1, SeqCst);
        n1.read_index().map_err(|err| err.to_string())
    };
    n1.put(put("k", "v1", None)).await.unwrap();
    // Not its leader: a linearizable read is refused, a follower read at the read index is
    // answered.
    assert!(matches!(
        n2.get(&[key("k")]).await,
        Err(Error::NotLeader { .. })
    ));
    let share = n2
        .bounded_read_share(vec![key("k")], Duration::ZERO, index)
        .await;
    assert_eq!(read_one(share.unwrap()).await.as_deref(), Some(&b"v1"[..]));

    // The follower falls behind: what the leader acknowledges now, it cannot apply.
    log.hung.store(true, SeqCst);
    n1.put(put("k", "v2", None)).await.unwrap();
    // Within a long bound, the check just made still vouches for it: the leader is not asked,
    // and the answer may be old.
    let before = asked.load(SeqCst);
    let share = n2
        .bounded_read_share(vec![key("k")], Duration::from_secs(3600), index)
        .await;
    assert_eq!(read_one(share.unwrap()).await.as_deref(), Some(&b"v1"[..]));
    assert_eq!(asked.load(SeqCst), before, "the check was not reused");
    // At the read index, it cannot show it holds v2, and refuses rather than answer v1.
    let refused = n2
        .bounded_read_share(vec![key("k")], Duration::ZERO, index)
        .await;
    let Err(err @ Error::TooStale { .. }) = refused else {
        panic!("a replica behind its leader answered a read at the read index");
    };
    assert!(err.to_string().contains("did not apply the log"), "{err}");

    // Caught up again, it answers with v2.
    log.hung.store(false, SeqCst);
    let share = n2
        .bounded_read_share(vec![key("k")], Duration::ZERO, index)
        .await;
    assert_eq!(read_one(share.unwrap()).await.as_deref(), Some(&b"v2"[..]));

    // A leader it cannot reach: refused once the last check is older than the bound, with why.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let refused = n2
        .bounded_read_share(vec![key("k")], Duration::from_millis(10), || async {
            Err("no answer from its node".to_string())
        })
        .await;
    let Err(err @ Error::TooStale { .. }) = refused else {
        panic!("a replica that cannot ask its leader answered past its bound");
    };
    assert!(err.to_string().contains("no answer from its node"), "{err}");
    // A replica that is not the leader gives no read index; the leader answers under its lease,
    // without asking anyone.
    assert!(matches!(n2.read_index(), Err(Error::NotLeader { .. })));
    let share = n1
        .bounded_read_share(vec![key("k")], Duration::ZERO, || async {
            Err("not to be asked".to_string())
        })
        .await;
    assert_eq!(read_one(share.unwrap()).await.as_deref(), Some(&b"v2"[..]));
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_steps_down_answers_the_writes_in_flight_and_takes_no_more() {
    let f = Fixture::new().await;
    let (stores, n1) = f.leading_n1(1_000).await;
    // Writes in flight when the step-down begins: each is answered as done, none as "may or may
    // not have taken effect".
    let writes: Vec<_> = (0..50)
        .map(|i| {
            let n1 = n1.clone();
            tokio::spawn(async move { n1.put(put(&format!("k{i}"), "v", None)).await })
        })
        .collect();
    tokio::task::yield_now().await;
    assert!(n1.step_down(std::time::Duration::from_secs(10)).await);
    for (i, write) in writes.into_iter().enumerate() {
        match write.await.unwrap() {
            Ok(()) => assert!(stored(&stores, &format!("k{i}")).is_some(), "k{i}"),
            // Refused before it reached the log: nothing was written.
            Err(Error::NotLeader { leader: None, .. }) => {}
            Err(err) => panic!("write {i} in flight during the step-down: {err}"),
        }
    }
    // After it: refused, naming no leader (this node no longer is one, and no other is known).
    let err = n1.put(put("late", "v", None)).await.unwrap_err();
    assert!(
        matches!(err, Error::NotLeader { leader: None, .. }),
        "{err}"
    );
    assert!(stored(&stores, "late").is_none());
    f.stop().await;
}
