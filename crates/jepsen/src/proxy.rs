//! A TCP proxy between a node and one NATS server, which a test can cut: the node then loses
//! NATS (its connections are closed, new ones refused) while its own clients still reach it, as
//! when a machine's link to the NATS servers fails but not to its clients.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
    /// Bumped by every cut: connections open then close.
    cuts: watch::Sender<u64>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// A proxy to `target` on a free loopback port.
    pub async fn start(target: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut = Arc::new(AtomicBool::new(false));
        let (cuts, _) = watch::channel(0u64);
        let accept = tokio::spawn(accept_loop(listener, target, cut.clone(), cuts.clone()));
        Ok(Proxy {
            port,
            cut,
            cuts,
            accept,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every connection through the proxy and refuses new ones until [`Proxy::heal`].
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.cuts.send_modify(|n| *n += 1);
    }

    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cuts.send_modify(|n| *n += 1);
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    cut: Arc<AtomicBool>,
    cuts: watch::Sender<u64>,
) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            continue;
        };
        if cut.load(Ordering::SeqCst) {
            drop(inbound);
            continue;
        }
        let mut cuts = cuts.subscribe();
        cuts.mark_unchanged();
        tokio::spawn(async move {
            let Ok(mut outbound) = TcpStream::connect(target).await else {
                return;
            };
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                _ = cuts.changed() => {}
            }
        });
    }
}
