//! [`ZmqPublisher`]: vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`) in Rust,
//! for stand-in engines and tests: a PUB socket sending `[topic, seq (8 bytes big-endian),
//! payload]` with seq from 0, one per batch, and a ROUTER replay socket answering
//! `[identity, b"", start_seq]` with `[identity, b"", seq, payload]` for every buffered batch
//! with `seq >= start_seq`, then `[identity, b"", END_SEQ, b""]` (`_service_replay`).
//!
//! Like vLLM it binds (a `*` host means every interface); unlike vLLM's it publishes inline
//! (no queue thread), and it can drop a batch on purpose ([`ZmqPublisher::drop_next`]).
//! The replay buffer keeps the last `buffer_steps` batches (vLLM's
//! `deque(maxlen=buffer_steps)`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::EventsError;
use super::codec::{EngineBatch, WireShape, encode_batch};
use super::subscriber::END_SEQ;

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// A KV event publisher speaking vLLM's protocol.
pub struct ZmqPublisher {
    state: tokio::sync::Mutex<PubState>,
    buffer: Buffer,
    drop_next: AtomicBool,
    pub_endpoint: String,
    replay_endpoint: Option<String>,
    topic: Bytes,
    shape: WireShape,
    buffer_steps: usize,
    stop: CancellationToken,
    replay_task: Option<tokio::task::JoinHandle<()>>,
}

struct PubState {
    socket: PubSocket,
    next_seq: u64,
}

impl std::fmt::Debug for ZmqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqPublisher")
            .field("pub_endpoint", &self.pub_endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("shape", &self.shape)
            .field("buffer_steps", &self.buffer_steps)
            .finish_non_exhaustive()
    }
}

/// `tcp://*:port` (vLLM's bind form) as zeromq-rs understands it.
fn bind_form(endpoint: &str) -> String {
    endpoint.replacen("://*:", "://0.0.0.0:", 1)
}

impl ZmqPublisher {
    /// Binds the PUB socket on `pub_endpoint` and, if given, the ROUTER replay socket on
    /// `replay_endpoint` (`tcp://127.0.0.1:0` picks a free port: see the endpoint getters).
    /// Needs a tokio runtime (the replay service is a task, ended on drop).
    pub async fn bind(
        pub_endpoint: &str,
        replay_endpoint: Option<&str>,
        topic: &str,
        buffer_steps: usize,
        shape: WireShape,
    ) -> Result<ZmqPublisher, EventsError> {
        let mut socket = PubSocket::new();
        let bound = socket.bind(&bind_form(pub_endpoint)).await?;
        let buffer: Buffer = Arc::default();
        let stop = CancellationToken::new();
        let (replay_endpoint, replay_task) = match replay_endpoint {
            Some(ep) => {
                let mut router = RouterSocket::new();
                let bound = router.bind(&bind_form(ep)).await?;
                let task = tokio::spawn(serve_replay(router, buffer.clone(), stop.clone()));
                (Some(bound.to_string()), Some(task))
            }
            None => (None, None),
        };
        Ok(ZmqPublisher {
            state: tokio::sync::Mutex::new(PubState {
                socket,
                next_seq: 0,
            }),
            buffer,
            drop_next: AtomicBool::new(false),
            pub_endpoint: bound.to_string(),
            replay_endpoint,
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            shape,
            buffer_steps: buffer_steps.max(1),
            stop,
            replay_task,
        })
    }

    /// The bound PUB endpoint, port resolved (`tcp://127.0.0.1:40123`).
    pub fn pub_endpoint(&self) -> &str {
        &self.pub_endpoint
    }

    /// The bound replay endpoint, port resolved.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    pub fn shape(&self) -> WireShape {
        self.shape
    }

    /// The seq the next batch gets.
    pub async fn next_seq(&self) -> u64 {
        self.state.lock().await.next_seq
    }

    /// Fault injection: the next batch gets its seq and goes into the replay buffer, but is
    /// not sent on the PUB socket (what a PUB high-water-mark drop looks like).
    pub fn drop_next(&self) {
        self.drop_next.store(true, Ordering::Release);
    }

    /// Encodes `batch` in this publisher's shape, assigns it the next seq, sends it and keeps
    /// it for replay. Returns its seq. A PUB socket without subscribers drops it, as ZeroMQ's
    /// does.
    pub async fn publish(&self, batch: EngineBatch) -> Result<u64, EventsError> {
        let payload = Bytes::from(encode_batch(&batch, self.shape));
        self.publish_payload(payload).await
    }

    /// Publishes already encoded bytes (tests: garbage, other encoders).
    pub async fn publish_payload(&self, payload: Bytes) -> Result<u64, EventsError> {
        let mut state = self.state.lock().await;
        let seq = state.next_seq;
        state.next_seq += 1;
        {
            let mut buffer = self.buffer.lock();
            buffer.push_back((seq, payload.clone()));
            while buffer.len() > self.buffer_steps {
                buffer.pop_front();
            }
        }
        if self.drop_next.swap(false, Ordering::AcqRel) {
            return Ok(seq);
        }
        let message = ZmqMessage::try_from(vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ])
        .map_err(|e| EventsError::Replay(e.to_string()))?;
        state.socket.send(message).await?;
        Ok(seq)
    }

    /// Unbinds both sockets, waiting until the ports are free.
    pub async fn close(mut self) {
        self.stop.cancel();
        if let Some(task) = self.replay_task.take() {
            // The task closes the ROUTER socket when it sees the stop.
            let _ = task.await;
        }
        let socket = std::mem::replace(&mut self.state.get_mut().socket, PubSocket::new());
        let errors = socket.close().await;
        if !errors.is_empty() {
            tracing::debug!(?errors, "closing the KV event PUB socket");
        }
    }
}

impl Drop for ZmqPublisher {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
    }
}

/// vLLM's `_service_replay`, as a task.
async fn serve_replay(mut router: RouterSocket, buffer: Buffer, stop: CancellationToken) {
    loop {
        let request = tokio::select! {
            () = stop.cancelled() => break,
            r = router.recv() => r,
        };
        let frames = match request {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "replay socket receive failed");
                continue;
            }
        };
        // `[identity, b"", start_seq]`, like vLLM's `len(frame) != 3` check.
        let [identity, _, start] = match <[Bytes; 3]>::try_from(frames) {
            Ok(f) => f,
            Err(f) => {
                tracing::warn!(frames = f.len(), "invalid replay request ignored");
                continue;
            }
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let mut replies: Vec<Vec<Bytes>> = batches
            .into_iter()
            .map(|(seq, payload)| {
                vec![
                    identity.clone(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ]
            })
            .collect();
        replies.push(vec![
            identity.clone(),
            Bytes::new(),
            Bytes::from_static(&END_SEQ),
            Bytes::new(),
        ]);
        for reply in replies {
            let Ok(message) = ZmqMessage::try_from(reply) else {
                break;
            };
            if let Err(e) = router.send(message).await {
                // The requester left; vLLM's ROUTER drops such replies silently too.
                tracing::debug!(error = %e, "replay reply not delivered");
                break;
            }
        }
    }
    let _ = router.close().await;
}
