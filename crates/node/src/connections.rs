//! The clients' connections, bounded per port. Every open connection holds a file descriptor, and
//! the node's own files (tables, log segments, snapshot transfers) come out of the same limit:
//! past it, a memtable flush that cannot create its table file stops its partition. So the gRPC
//! port takes at most `max-connections` at once and the Redis port at most `resp.max-clients`
//! ([`Admission`]), and one more is closed as soon as it is accepted. The node's log says so, at
//! most every [`REFUSED_WARNING_INTERVAL`].

use futures::Stream;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::warn;

/// How often refused connections are reported in the log, at most.
const REFUSED_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// How long to wait after a failed accept (out of descriptors, usually) before the next one.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// One port's open connections against its bound.
pub(crate) struct Admission {
    /// The port, as the log names it (`gRPC port`).
    port: &'static str,
    /// The setting that bounds it (`max-connections`).
    setting: &'static str,
    /// Connections admitted and not yet dropped.
    open: Arc<AtomicUsize>,
    max: usize,
    /// Refused since the last warning.
    refused: u64,
    warned_at: Option<Instant>,
}

impl Admission {
    pub fn new(port: &'static str, setting: &'static str, max: usize) -> Admission {
        Admission {
            port,
            setting,
            open: Arc::new(AtomicUsize::new(0)),
            max,
            refused: 0,
            warned_at: None,
        }
    }

    /// Connections open now, as long as the port serves.
    pub fn open_count(&self) -> Arc<AtomicUsize> {
        self.open.clone()
    }

    /// The next connection accepted on `listener` that has a place. One beyond the bound is given
    /// to `refuse` (to say why, without waiting) and closed. Failed accepts are waited out.
    pub async fn next(
        &mut self,
        listener: &TcpListener,
        refuse: impl Fn(&TcpStream),
    ) -> (TcpStream, SocketAddr, Open) {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(err) => {
                    warn!("{}: accept: {err}", self.port);
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            };
            if self.open.load(Ordering::Relaxed) >= self.max {
                refuse(&stream);
                self.refused += 1;
                if self
                    .warned_at
                    .is_none_or(|at| at.elapsed() >= REFUSED_WARNING_INTERVAL)
                {
                    warn!(
                        "{}: refused {} connection(s): {} are open, the most {} and the \
                         open-files limit allow",
                        self.port, self.refused, self.max, self.setting
                    );
                    self.warned_at = Some(Instant::now());
                    self.refused = 0;
                }
                continue;
            }
            // Answers go out as soon as they are written: with Nagle's algorithm on, a small
            // answer that follows a large one waits for the client's delayed ACK (about 40 ms per
            // request on Linux).
            let _ = stream.set_nodelay(true);
            self.open.fetch_add(1, Ordering::Relaxed);
            return (stream, peer, Open(self.open.clone()));
        }
    }
}

/// A connection's place among its port's open ones, given back when dropped.
pub(crate) struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The gRPC connections accepted on `listener`, at most `max` open at once.
pub(crate) fn bounded(
    listener: TcpListener,
    max: usize,
) -> impl Stream<Item = io::Result<Counted>> + Send + 'static {
    let admission = Admission::new("gRPC port", "max-connections", max);
    futures::stream::unfold(
        (listener, admission),
        |(listener, mut admission)| async move {
            let (stream, _, open) = admission.next(&listener, |_| {}).await;
            Some((
                Ok(Counted {
                    stream,
                    _open: open,
                }),
                (listener, admission),
            ))
        },
    )
}

/// An accepted gRPC connection, counted as open until it is dropped.
pub(crate) struct Counted {
    stream: TcpStream,
    _open: Open,
}

impl Connected for Counted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
