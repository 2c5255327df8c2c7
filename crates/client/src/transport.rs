//! The client's HTTP/2 connection to a node, carrying the generated gRPC clients' calls.
//!
//! Every call the node serves takes a single request message, so a request here is sent whole:
//! its HEADERS frame and its one DATA frame are queued together and reach the socket in one
//! write, and the node reads them in one go. tonic's own channel (hyper's client) sends the body
//! from a task of its own once the new stream has been given send capacity, which costs a second
//! write, a second read on the node and two more task wake-ups per call: a third of a one-key
//! put's cost on two cores. Answers stream as they come (the admin calls' progress).
//!
//! A connection that fails is dropped, and the next call dials again; the call that met the
//! failure gets its error, as with tonic's channel.

use bytes::Bytes;
use http_body_util::BodyExt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::net::TcpStream;

/// A stream's receive window: what the node may send on one call before the client has read
/// any of it (hyper's client default).
const STREAM_WINDOW_BYTES: u32 = 2 * 1024 * 1024;
/// The connection's receive window, shared by its calls (hyper's client default).
const CONNECTION_WINDOW_BYTES: u32 = 5 * 1024 * 1024;

/// Why a connection could not be made or a call not be sent.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialError {
    #[error("connect timed out after {} ms", timeout.as_millis())]
    Timeout { timeout: Duration },
    #[error("tcp connect error")]
    Tcp(#[source] std::io::Error),
    #[error("HTTP/2 handshake failed")]
    Handshake(#[source] h2::Error),
}

/// A clonable handle on the connection to one node; clones share it.
#[derive(Clone)]
pub(crate) struct Connection {
    shared: Arc<Shared>,
}

struct Shared {
    /// `host:port`, dialled and sent as each request's authority.
    authority: http::uri::Authority,
    connect_timeout: Duration,
    request_timeout: Duration,
    /// The live connection's sender and its number; `None` after a failure, until the next
    /// call dials again.
    sender: Mutex<Option<(u64, h2::client::SendRequest<Bytes>)>>,
    /// How many connections were dialled: numbers them.
    dialled: AtomicU64,
}

impl Connection {
    /// Dials `authority` now, so that an unreachable node is reported at connect time.
    pub(crate) async fn connect(
        authority: http::uri::Authority,
        connect_timeout: Duration,
        request_timeout: Duration,
    ) -> Result<Connection, DialError> {
        let sender = dial(&authority, connect_timeout).await?;
        Ok(Connection {
            shared: Arc::new(Shared {
                authority,
                connect_timeout,
                request_timeout,
                sender: Mutex::new(Some((0, sender))),
                dialled: AtomicU64::new(1),
            }),
        })
    }

    /// The live connection's sender and its number, dialling again if the last one failed.
    /// Calls that find none at once each dial; the last to finish is kept.
    async fn sender(&self) -> Result<(u64, h2::client::SendRequest<Bytes>), tonic::Status> {
        if let Some(sender) = self.shared.sender.lock().expect("not poisoned").clone() {
            return Ok(sender);
        }
        let sender = dial(&self.shared.authority, self.shared.connect_timeout)
            .await
            .map_err(|err| {
                tonic::Status::unavailable(format!(
                    "cannot connect to {}: {}",
                    self.shared.authority,
                    crate::error_chain(&err)
                ))
            })?;
        let number = self.shared.dialled.fetch_add(1, Ordering::Relaxed);
        *self.shared.sender.lock().expect("not poisoned") = Some((number, sender.clone()));
        Ok((number, sender))
    }

    /// Forgets connection `number` if it is still the one in use, so that the next call dials.
    fn forget(&self, number: u64) {
        let mut sender = self.shared.sender.lock().expect("not poisoned");
        if sender.as_ref().is_some_and(|(live, _)| *live == number) {
            *sender = None;
        }
    }

    async fn call(
        self,
        request: http::Request<tonic::body::Body>,
    ) -> Result<http::Response<ResponseBody>, tonic::Status> {
        let (mut parts, body) = request.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        parts.uri = http::Uri::builder()
            .scheme(http::uri::Scheme::HTTP)
            .authority(self.shared.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|err| tonic::Status::internal(format!("request URI: {err}")))?;
        // The generated clients' request bodies are encoded in memory: this does not wait.
        let message = body.collect().await?.to_bytes();
        let request = http::Request::from_parts(parts, ());
        let timeout = self.shared.request_timeout;
        match tokio::time::timeout(timeout, self.send(request, message)).await {
            Ok(answer) => answer,
            Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                "no answer within {} ms, the request timeout; the node may be waiting on its \
                 snapshot repository or its disk (see its log): allow longer with \
                 --request-timeout (ClientOptions::request_timeout)",
                timeout.as_millis()
            ))),
        }
    }

    async fn send(
        &self,
        request: http::Request<()>,
        message: Bytes,
    ) -> Result<http::Response<ResponseBody>, tonic::Status> {
        let (number, sender) = self.sender().await?;
        // Until the request is handed to the connection, a failure means it was never sent: the
        // caller may send it again. After, the node may have taken it, unless it refused the
        // stream (which HTTP/2 guarantees it did not process).
        let handed = async {
            let mut ready = sender.ready().await?;
            let (response, mut stream) = ready.send_request(request, message.is_empty())?;
            if !message.is_empty() {
                // Queued with the HEADERS frame; h2 sends it as the window allows.
                stream.send_data(message, true)?;
            }
            Ok::<_, h2::Error>(response)
        };
        let failed = |err: h2::Error, sent: bool| {
            // A stream's own reset leaves the connection usable; anything else ends it.
            if err.reason().is_none() || err.is_go_away() {
                self.forget(number);
            }
            let refused = err.reason() == Some(h2::Reason::REFUSED_STREAM);
            if !sent || refused {
                tonic::Status::unavailable(format!(
                    "the connection to {} failed before the request was taken ({}); nothing was \
                     done",
                    self.shared.authority,
                    crate::error_chain(&err)
                ))
            } else if err.reason().is_some() && !err.is_go_away() && !err.is_io() {
                // The node reset the stream with a reason of its own: its answer.
                tonic::Status::from(err)
            } else {
                tonic::Status::unknown(format!(
                    "the connection to {} failed after the request was sent ({}), so it may or \
                     may not have taken effect; read the keys to know",
                    self.shared.authority,
                    crate::error_chain(&err)
                ))
            }
        };
        let response = match handed.await {
            Ok(response) => response,
            Err(err) => return Err(failed(err, false)),
        };
        match response.await {
            Ok(response) => Ok(response.map(|recv| ResponseBody {
                recv,
                data_done: false,
            })),
            Err(err) => Err(failed(err, true)),
        }
    }
}

async fn dial(
    authority: &http::uri::Authority,
    timeout: Duration,
) -> Result<h2::client::SendRequest<Bytes>, DialError> {
    let address = format!(
        "{}:{}",
        authority.host(),
        authority.port_u16().unwrap_or(80)
    );
    let tcp = tokio::time::timeout(timeout, TcpStream::connect(address))
        .await
        .map_err(|_| DialError::Timeout { timeout })?
        .map_err(DialError::Tcp)?;
    tcp.set_nodelay(true).map_err(DialError::Tcp)?;
    let (sender, connection) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .handshake(tcp)
        .await
        .map_err(DialError::Handshake)?;
    tokio::spawn(async move {
        // Its end is seen by the calls on it, which report it.
        let _ = connection.await;
    });
    Ok(sender)
}

impl tower_service::Service<http::Request<tonic::body::Body>> for Connection {
    type Response = http::Response<ResponseBody>;
    type Error = tonic::Status;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness (the node's bound on concurrent streams) is waited for within the call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(self.clone().call(request))
    }
}

/// An answer's body: its DATA frames as they arrive, then its trailers (the gRPC status).
pub(crate) struct ResponseBody {
    recv: h2::RecvStream,
    data_done: bool,
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // What was read no longer counts against the windows.
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(http_body::Frame::data(data))));
                }
                Some(Err(err)) => return Poll::Ready(Some(Err(err))),
                None => self.data_done = true,
            }
        }
        match ready!(self.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(err) => Poll::Ready(Some(Err(err))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}
