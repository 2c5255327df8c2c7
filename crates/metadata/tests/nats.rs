//! The `nats` metadata provider against a real `nats-server` with JetStream, and against three
//! of them in a cluster: the conformance suite, with a server restarted (gracefully) before the
//! restart case reopens its bucket.
//! `scripts/setup-debian.sh` installs `nats-server`; without it this test fails and says so.

use cairn_metadata::MetadataStore;
use cairn_metadata::nats::{NatsMetadataOptions, NatsMetadataStore};
use cairn_metadata::test_util::{NatsCluster, NatsServer};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Runs the conformance suite on buckets of `replicas` replicas on `urls`, calling `restart`
/// before a case reopens its store.
async fn conforms(urls: Vec<String>, replicas: usize, restart: &(dyn Fn() + Sync)) {
    let opened = Mutex::new(HashSet::new());
    cairn_metadata::conformance::run_all(&|case| {
        // A case that opens its store again is looking for what survives a restart.
        if !opened.lock().unwrap().insert(case.to_string()) {
            restart();
        }
        let options = NatsMetadataOptions {
            servers: urls.clone(),
            bucket: format!("cairn-test-{case}"),
            replicas,
        };
        Box::pin(async move {
            // JetStream may take a moment, after a start or a restart, before it serves buckets.
            let deadline = Instant::now() + Duration::from_secs(30);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_provider_conforms_against_a_real_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = Mutex::new(NatsServer::start(dir.path(), 0));
    let urls = vec![server.lock().unwrap().url()];
    conforms(urls, 1, &|| server.lock().unwrap().restart()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_provider_conforms_against_a_three_server_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Mutex::new(NatsCluster::start(dir.path()));
    let urls = cluster.lock().unwrap().urls();
    // Values replicated three times survive a restart of a server.
    conforms(urls, 3, &|| cluster.lock().unwrap().servers[0].restart()).await;
}
