//! The `nats` metadata provider against a real `nats-server` with JetStream: the conformance
//! suite, with the server restarted (gracefully) before the restart case reopens its bucket.
//! `scripts/setup-debian.sh` installs `nats-server`; without it this test fails and says so.

use cairn_metadata::MetadataStore;
use cairn_metadata::nats::{NatsMetadataOptions, NatsMetadataStore};
use cairn_metadata::test_util::NatsServer;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
