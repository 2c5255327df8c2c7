//! The gRPC port's connections, bounded. Every open connection holds a file descriptor, and the
//! node's own files (tables, log segments, snapshot transfers) come out of the same limit: past
//! it, a memtable flush that cannot create its table file stops its partition. So the port takes
//! at most `max-connections` at once, as the Redis port takes at most `resp.max-clients`, and
//! closes one more as soon as it is accepted. The node's log says so, at most every
//! [`REFUSED_WARNING_INTERVAL`].

use futures::Stream;
use std::io;
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

/// The connections accepted on `listener`, at most `max` open at once: one more is closed.
pub(crate) fn bounded(
    listener: TcpListener,
    max: usize,
) -> impl Stream<Item = io::Result<Counted>> + Send + 'static {
    let accepting = Accepting {
        listener,
        open: Arc::new(AtomicUsize::new(0)),
        max,
        refused: 0,
        warned_at: None,
    };
    futures::stream::unfold(accepting, |mut accepting| async move {
        let connection = accepting.next().await;
        Some((Ok(connection), accepting))
    })
}

struct Accepting {
    listener: TcpListener,
    /// Connections accepted and not yet dropped.
    open: Arc<AtomicUsize>,
    max: usize,
    /// Refused since the last warning.
    refused: u64,
    warned_at: Option<Instant>,
}

impl Accepting {
    async fn next(&mut self) -> Counted {
        loop {
            let stream = match self.listener.accept().await {
                Ok((stream, _)) => stream,
                Err(err) => {
                    warn!("gRPC port: accept: {err}");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            };
            if self.open.load(Ordering::Relaxed) >= self.max {
                drop(stream);
                self.refused += 1;
                if self
                    .warned_at
                    .is_none_or(|at| at.elapsed() >= REFUSED_WARNING_INTERVAL)
                {
                    warn!(
                        "gRPC port: closed {} connection(s) at once: {} are open, the most \
                         max-connections and the open-files limit allow",
                        self.refused, self.max
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
            return Counted {
                stream,
                open: self.open.clone(),
            };
        }
    }
}

/// An accepted connection, counted as open until it is dropped.
pub(crate) struct Counted {
    stream: TcpStream,
    open: Arc<AtomicUsize>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
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
