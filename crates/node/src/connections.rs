//! The clients' connections, bounded per port. Every open connection holds a file descriptor, and
//! the node's own files (tables, log segments, snapshot transfers) come out of the same limit:
//! past it, a memtable flush that cannot create its table file stops its partition. So the gRPC
//! port takes at most `max-connections` at once and the Redis port at most `resp.max-clients`
//! ([`Admission`]), and one more is closed as soon as it is told why: the Redis port answers it
//! `-ERR max number of clients reached`, as Redis does, and the gRPC port answers its calls
//! `RESOURCE_EXHAUSTED`, naming the setting ([`refuse_grpc`]). The node's log says so too, at most
//! every [`REFUSED_WARNING_INTERVAL`].

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
use tokio::sync::Semaphore;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::warn;

/// How often refused connections are reported in the log, at most.
const REFUSED_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// How long to wait after a failed accept (out of descriptors, usually) before the next one.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Refused gRPC connections being told why at once, at most: each holds its descriptor for up to
/// [`REFUSAL_TIME_MAX`]. Beyond that a refused connection is closed without a word, so that a
/// flood of connections costs the node no more descriptors than the bound plus these.
const REFUSALS_AT_ONCE_MAX: usize = 64;

/// How long a refused gRPC connection is kept to answer its calls, at most.
const REFUSAL_TIME_MAX: Duration = Duration::from_secs(2);

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
    /// to `refuse`, which says why without holding up the next accept, then closes it. Failed
    /// accepts are waited out.
    pub async fn next(
        &mut self,
        listener: &TcpListener,
        mut refuse: impl FnMut(TcpStream),
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
                refuse(stream);
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
    let refusals = Arc::new(Semaphore::new(REFUSALS_AT_ONCE_MAX));
    futures::stream::unfold(
        (listener, admission, refusals),
        move |(listener, mut admission, refusals)| async move {
            let next = admission.next(&listener, |stream| refuse(stream, max, &refusals));
            let (stream, _, open) = next.await;
            let counted = Counted {
                stream,
                _open: open,
            };
            Some((Ok(counted), (listener, admission, refusals)))
        },
    )
}

/// Tells a gRPC connection beyond the bound why on a task of its own ([`refuse_grpc`]), within
/// [`REFUSAL_TIME_MAX`]. With [`REFUSALS_AT_ONCE_MAX`] being told already, drops it unanswered.
fn refuse(stream: TcpStream, max: usize, refusals: &Arc<Semaphore>) {
    let Ok(slot) = refusals.clone().try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let _ = tokio::time::timeout(REFUSAL_TIME_MAX, refuse_grpc(stream, max)).await;
        drop(slot);
    });
}

/// What a call on a refused gRPC connection is answered.
fn refusal_message(max: usize) -> String {
    format!(
        "this node already serves {max} gRPC connections, the most its max-connections setting \
         (lowered to fit the open-files limit) allows: close idle clients, or raise \
         max-connections and the node's open-files limit (ulimit -n, LimitNOFILE=)"
    )
}

/// Answers every call the client sends on a refused connection `RESOURCE_EXHAUSTED` with
/// [`refusal_message`] (a trailers-only response, as gRPC servers answer a call they refuse
/// outright), until the client closes it; the caller bounds how long. The client thus sees why,
/// not a connection reset. The node does not close first on purpose: closing with the client's
/// next frames unread resets the connection, and the client's kernel may then drop the answer
/// before the client reads it.
async fn refuse_grpc(stream: TcpStream, max: usize) {
    let _ = stream.set_nodelay(true);
    let Ok(mut connection) = h2::server::handshake(stream).await else {
        return;
    };
    // Every call gets the same answer: its headers are made once.
    let status = http::HeaderValue::from(tonic::Code::ResourceExhausted as i32);
    let message = http::HeaderValue::try_from(refusal_message(max))
        .expect("the refusal message is printable ASCII");
    // The calls are answered on tasks of their own, since each waits for its request to end while
    // the connection (polled by `accept`) carries the frames; they end with this function.
    let mut calls = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = connection.accept() => {
                let Some(Ok((request, respond))) = accepted else {
                    break;
                };
                calls.spawn(refuse_call(request, respond, status.clone(), message.clone()));
            }
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
        }
    }
}

/// How long a refused call's request may take to arrive whole before it is answered anyway (a
/// streaming call's never ends).
const REFUSED_REQUEST_WAIT_MAX: Duration = Duration::from_millis(500);

/// Answers one call on a refused connection, once its request has arrived whole. Answered earlier,
/// the call's stream ends while the client is still sending on it, and the client may then report
/// that (`h2 protocol error: user error: inactive stream`) instead of the answer.
async fn refuse_call(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    status: http::HeaderValue,
    message: http::HeaderValue,
) {
    let mut body = request.into_body();
    let drained = async {
        while let Some(Ok(chunk)) = body.data().await {
            let _ = body.flow_control().release_capacity(chunk.len());
        }
    };
    let _ = tokio::time::timeout(REFUSED_REQUEST_WAIT_MAX, drained).await;
    let mut response = http::Response::new(());
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", status);
    headers.insert("grpc-message", message);
    let _ = respond.send_response(response, true);
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
