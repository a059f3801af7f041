//! Keep-alive HTTP/1.1 connections to one plain `http://` engine, kept by one serving thread.
//!
//! hyper's own connections (`hyper::client::conn::http1`) with a list of idle ones, in place
//! of hyper-util's pooled client: that client looks its pool up by a key hashed per request
//! under a lock, parses the authority again, and spawns a task per answer to watch for the
//! connection's return: about 8 % of `tandem frontend --backend-url`'s CPU per request at
//! full load (BENCHMARKS.md, 2026-12-07 07:00 UTC).
//!
//! What it keeps of that client's behaviour:
//! - a connection goes back to the pool only once its answer was read to the end; an answer
//!   dropped before its end takes its connection with it (hyper closes it), which is how an
//!   engine learns that the client left;
//! - a request that a pooled connection could not send (the engine closed it while it sat
//!   idle) is sent again on another one: it never reached the engine;
//! - connections idle longer than [`IDLE_TIMEOUT`] are not reused, and at most [`MAX_IDLE`]
//!   are kept.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::Stream;
use http::uri::Authority;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Incoming};
use hyper::client::conn::http1::SendRequest;
use parking_lot::Mutex;

use super::EngineError;

/// How long a connection to the engine may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle connection is kept for reuse.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Most idle connections one pool keeps.
const MAX_IDLE: usize = 256;

type Sender = SendRequest<Full<Bytes>>;

/// Idle connections to one engine (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct Pool {
    idle: Mutex<Vec<Idle>>,
}

#[derive(Debug)]
struct Idle {
    sender: Sender,
    since: Instant,
}

/// A connection lent to one exchange; [`Lease::give_back`] once its answer was read whole.
pub(crate) struct Lease {
    sender: Sender,
    pool: Arc<Pool>,
}

impl Lease {
    /// Returns the connection to its pool, unless it closed.
    pub(crate) fn give_back(self) {
        if self.sender.is_closed() {
            return;
        }
        let mut idle = self.pool.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push(Idle {
                sender: self.sender,
                since: Instant::now(),
            });
        }
    }
}

impl Pool {
    /// The most recently used idle connection still open and fresh.
    fn take(&self) -> Option<Sender> {
        let mut idle = self.idle.lock();
        while let Some(i) = idle.pop() {
            if !i.sender.is_closed() && i.since.elapsed() < IDLE_TIMEOUT {
                return Some(i.sender);
            }
        }
        None
    }

    /// Sends `req` (origin-form, with its `host`) on an idle connection, else on a new one
    /// to `authority`; the answer's head, and the lease of its connection.
    pub(crate) async fn send(
        self: &Arc<Self>,
        authority: &Authority,
        mut req: http::Request<Full<Bytes>>,
    ) -> Result<(http::Response<Incoming>, Lease), EngineError> {
        loop {
            let (mut sender, reused) = match self.take() {
                Some(s) => (s, true),
                None => (connect(authority).await?, false),
            };
            if let Err(e) = sender.ready().await {
                if reused {
                    continue;
                }
                return Err(unreachable(authority, &e));
            }
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    let lease = Lease {
                        sender,
                        pool: self.clone(),
                    };
                    return Ok((resp, lease));
                }
                Err(mut e) => match e.take_message() {
                    // Never written: the engine closed this idle connection first.
                    Some(unsent) if reused => req = unsent,
                    _ => return Err(unreachable(authority, e.error())),
                },
            }
        }
    }
}

fn unreachable(authority: &Authority, e: &dyn std::fmt::Display) -> EngineError {
    EngineError::Unreachable(format!("http://{authority}: {e}"))
}

/// Opens a connection (TCP_NODELAY) and runs it on the calling runtime.
async fn connect(authority: &Authority) -> Result<Sender, EngineError> {
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(80);
    let tcp = tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect((host, port)),
    )
    .await
    .map_err(|_| unreachable(authority, &"connect timed out after 5 s"))?
    .map_err(|e| unreachable(authority, &e))?;
    tcp.set_nodelay(true)
        .map_err(|e| unreachable(authority, &e))?;
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .map_err(|e| unreachable(authority, &e))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "engine connection ended");
        }
    });
    Ok(sender)
}

/// An answer's body as it arrives, giving its connection back at its end.
pub(crate) struct LeasedBody {
    body: Incoming,
    lease: Option<Lease>,
}

impl LeasedBody {
    pub(crate) fn new(body: Incoming, lease: Lease) -> LeasedBody {
        LeasedBody {
            body,
            lease: Some(lease),
        }
    }

    /// The whole body; the connection goes back once it is read.
    pub(crate) async fn collect(self) -> Result<Bytes, hyper::Error> {
        let bytes = self.body.collect().await?.to_bytes();
        if let Some(lease) = self.lease {
            lease.give_back();
        }
        Ok(bytes)
    }
}

impl Stream for LeasedBody {
    type Item = Result<Bytes, hyper::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            return match std::task::ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => Poll::Ready(Some(Ok(data))),
                    // Trailers carry nothing read here.
                    Err(_) => continue,
                },
                Some(Err(e)) => {
                    // A connection that failed mid-answer is not reused.
                    this.lease = None;
                    Poll::Ready(Some(Err(e)))
                }
                None => {
                    if let Some(lease) = this.lease.take() {
                        lease.give_back();
                    }
                    Poll::Ready(None)
                }
            };
        }
    }
}
