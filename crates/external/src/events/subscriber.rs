//! [`EngineSubscriber`]: reads an engine's KV event PUB socket in sequence order, repairs
//! gaps from its replay socket, and says `Reset` when the stream cannot be trusted.
//!
//! Wire (vLLM `vllm/distributed/kv_events.py`, `ZmqEventPublisher`; SGLang's copy in
//! `python/sglang/srt/disaggregation/kv_events.py`): the PUB socket sends
//! `[topic, seq, payload]` with `seq` 8 bytes big-endian, from 0, one per batch. The replay
//! socket is a ROUTER (`_service_replay`): a DEALER sends `[b"", start_seq]` (8 bytes
//! big-endian; the ROUTER sees `[identity, b"", start_seq]`), and gets one
//! `[b"", seq, payload]` per buffered batch with `seq >= start_seq`, then the end marker
//! `[b"", END_SEQ, b""]` with `END_SEQ = (-1).to_bytes(8, "big", signed=True)`.
//!
//! Sequence rules ([`SeqTracker`]):
//! - The first batch is expected at seq 0: a first seq above 0 is a gap from 0 (the relay
//!   joined a running engine), repaired from the replay buffer when it still starts at 0;
//!   otherwise the subscriber says `Reset(JoinedLate)` (nothing to clear yet) and starts there.
//! - A gap (a PUB drop: slow subscriber, high-water mark, reconnection) is asked of the replay
//!   socket from the first missing seq, with a timeout. Replayed batches are applied in order,
//!   those already seen skipped; if replay is not configured, fails, or does not reach the
//!   batch that revealed the gap, the subscriber says `Reset(Gap)` and continues from there.
//! - A seq not above the last one received live means the engine restarted (its counter is
//!   back at 0): `Reset(Restarted)`, then that batch is handled as a first one.
//! - After the PUB connection dropped and came back, a seq other than the expected one cannot
//!   be told apart from a restarted engine that has published meanwhile: `Reset(Reconnected)`
//!   and rejoin (a replay from 0 rebuilds a young engine's state either way). A connection
//!   down for more than 2 s is dropped and made afresh rather than left to zeromq's own
//!   reconnection, whose backoff grows to 30 s.
//! - A batch that does not decode is counted and logged, and `Reset(Undecodable)`: the mirror
//!   must not go on as if it had applied it.
//!
//! Bounded: payloads by size, a replay by batches and bytes, the pending queue by one replay.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::channel::mpsc;
use tokio::sync::watch;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use super::EventsError;
use super::codec::{EngineBatch, MAX_PAYLOAD_BYTES, decode_batch};

/// vLLM's `ZmqEventPublisher.END_SEQ`: -1 as 8 signed big-endian bytes.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// How long a lost PUB connection is left to zeromq's own reconnection (whose backoff grows
/// to 30 s) before the subscriber drops the socket and connects afresh (backoff up to 2 s).
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(2);

/// Where and how to subscribe.
#[derive(Clone, Debug)]
pub struct SubscriberConfig {
    /// The engine's PUB endpoint (`tcp://host:5557`).
    pub endpoint: String,
    /// The engine's replay ROUTER endpoint, if it serves one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (vLLM's default `""`: everything).
    pub topic: String,
    /// How long a replay may take, from connecting to the last batch needed.
    pub replay_timeout: Duration,
    /// How long one connection attempt to the PUB socket waits for the engine.
    pub connect_timeout: Duration,
    /// Most batches one replay may return (vLLM's default `buffer_steps` is 10 000).
    pub max_replay_batches: usize,
    /// Most payload bytes one replay may return.
    pub max_replay_bytes: usize,
    /// Largest payload decoded; larger ones count as undecodable.
    pub max_payload_bytes: usize,
}

impl SubscriberConfig {
    pub fn new(endpoint: impl Into<String>) -> Self {
        SubscriberConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            replay_timeout: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(5),
            max_replay_batches: 10_000,
            max_replay_bytes: 256 << 20,
            max_payload_bytes: MAX_PAYLOAD_BYTES,
        }
    }
}

/// Why the consumer must forget what it knows of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResetReason {
    /// Batches `expected..got` are lost (no replay, replay failed or did not cover them).
    Gap { expected: u64, got: u64 },
    /// The engine's seq went back: it restarted.
    Restarted { expected: u64, got: u64 },
    /// After a reconnection the seq was not the expected one (see the module doc).
    Reconnected { expected: u64, got: u64 },
    /// The first batch seen was `first`, and replay could not supply the ones before it.
    JoinedLate { first: u64 },
    /// Batch `seq` did not decode.
    Undecodable { seq: u64 },
}

/// What the subscriber yields, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum SubscriberItem {
    /// The next batch of the engine's stream.
    Batch {
        seq: u64,
        batch: EngineBatch,
        /// Came from the replay socket rather than the PUB socket.
        replayed: bool,
    },
    /// Forget everything known of the engine, then go on with the items that follow.
    Reset(ResetReason),
}

/// Counters of a subscriber.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubscriberStats {
    /// Batches yielded (live and replayed).
    pub batches: u64,
    pub replayed_batches: u64,
    /// Gaps closed by replay.
    pub gaps_repaired: u64,
    /// Late joins closed by a replay from seq 0.
    pub joins_repaired: u64,
    /// Resets yielded (gaps, restarts, reconnections, undecodable batches).
    pub resets: u64,
    /// Joins past seq 0 that replay could not cover (nothing to reset yet).
    pub late_joins: u64,
    pub decode_errors: u64,
    /// Messages that are not `[topic, 8-byte seq, payload]`.
    pub malformed_frames: u64,
    /// Live batches already applied from a replay.
    pub duplicates: u64,
    /// Replays that failed (timeout, socket error, out-of-protocol reply, over bounds).
    pub replay_failures: u64,
    /// Replays that answered but no longer held the whole gap.
    pub replay_incomplete: u64,
    /// Times the PUB connection was (re)established.
    pub connects: u64,
}

#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    replayed_batches: AtomicU64,
    gaps_repaired: AtomicU64,
    joins_repaired: AtomicU64,
    resets: AtomicU64,
    late_joins: AtomicU64,
    decode_errors: AtomicU64,
    malformed_frames: AtomicU64,
    duplicates: AtomicU64,
    replay_failures: AtomicU64,
    replay_incomplete: AtomicU64,
    connects: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A cheap handle on a subscriber's counters and connection state, usable from other tasks.
#[derive(Clone, Debug)]
pub struct SubscriberProbe {
    counters: Arc<Counters>,
    connected: watch::Receiver<bool>,
}

impl SubscriberProbe {
    pub fn stats(&self) -> SubscriberStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SubscriberStats {
            batches: get(&c.batches),
            replayed_batches: get(&c.replayed_batches),
            gaps_repaired: get(&c.gaps_repaired),
            joins_repaired: get(&c.joins_repaired),
            resets: get(&c.resets),
            late_joins: get(&c.late_joins),
            decode_errors: get(&c.decode_errors),
            malformed_frames: get(&c.malformed_frames),
            duplicates: get(&c.duplicates),
            replay_failures: get(&c.replay_failures),
            replay_incomplete: get(&c.replay_incomplete),
            connects: get(&c.connects),
        }
    }

    /// Whether the PUB socket is connected (and subscribed) now.
    pub fn connected(&self) -> bool {
        *self.connected.borrow()
    }

    /// Waits until the PUB socket is connected; returns at once if it is.
    pub async fn wait_connected(&self) {
        let mut rx = self.connected.clone();
        // Err only when the subscriber is gone: nothing more to wait for.
        let _ = rx.wait_for(|c| *c).await;
    }
}

/// What the sequence rules make of one live seq.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Accept,
    /// Already applied from a replay.
    Duplicate,
    /// Batches `from..seq` are missing.
    Gap {
        from: u64,
    },
    Restart,
    Rejoin,
}

/// The sans-IO sequence rules of the module doc.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SeqTracker {
    next: u64,
    last_live: Option<u64>,
    joined: bool,
}

impl SeqTracker {
    pub(crate) fn classify(&self, seq: u64, after_reconnect: bool) -> Verdict {
        if self.last_live.is_some_and(|last| seq <= last) {
            return Verdict::Restart;
        }
        if !self.joined {
            return if seq == 0 {
                Verdict::Accept
            } else {
                Verdict::Gap { from: 0 }
            };
        }
        if seq == self.next {
            Verdict::Accept
        } else if after_reconnect {
            Verdict::Rejoin
        } else if seq < self.next {
            Verdict::Duplicate
        } else {
            Verdict::Gap { from: self.next }
        }
    }

    pub(crate) fn accept(&mut self, seq: u64) {
        self.next = seq.saturating_add(1);
        self.last_live = Some(seq);
        self.joined = true;
    }

    pub(crate) fn duplicate(&mut self, seq: u64) {
        self.last_live = Some(seq);
    }

    /// A replay supplied every batch before `next`.
    pub(crate) fn repaired(&mut self, next: u64) {
        self.next = next;
        self.joined = true;
    }

    pub(crate) fn reset(&mut self) {
        *self = SeqTracker::default();
    }

    pub(crate) fn expected(&self) -> u64 {
        self.next
    }

    pub(crate) fn joined(&self) -> bool {
        self.joined
    }
}

/// The subscriber: call [`EngineSubscriber::next`] in a loop. It connects on first use and
/// reconnects by itself.
///
/// Dropping a `next()` future (a `select!` on shutdown) is safe: at worst the batch being
/// repaired is lost, which the following batch shows as a gap, repaired again.
pub struct EngineSubscriber {
    config: SubscriberConfig,
    sub: Option<SubSocket>,
    monitor: Option<mpsc::Receiver<SocketEvent>>,
    tracker: SeqTracker,
    pending: VecDeque<SubscriberItem>,
    /// The PUB connection dropped since the last batch.
    reconnected: bool,
    /// When the PUB connection dropped, while it is down.
    disconnected_at: Option<tokio::time::Instant>,
    counters: Arc<Counters>,
    connected: watch::Sender<bool>,
}

impl std::fmt::Debug for EngineSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSubscriber")
            .field("config", &self.config)
            .field("connected", &self.sub.is_some())
            .field("tracker", &self.tracker)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

enum Incoming {
    Message(Result<ZmqMessage, zeromq::ZmqError>),
    Monitor(Option<SocketEvent>),
    /// The connection has been down for [`RESUBSCRIBE_AFTER`].
    Stale,
}

impl EngineSubscriber {
    pub fn new(config: SubscriberConfig) -> Self {
        EngineSubscriber {
            config,
            sub: None,
            monitor: None,
            tracker: SeqTracker::default(),
            pending: VecDeque::new(),
            reconnected: false,
            disconnected_at: None,
            counters: Arc::default(),
            connected: watch::Sender::new(false),
        }
    }

    pub fn config(&self) -> &SubscriberConfig {
        &self.config
    }

    /// A handle on the counters and the connection state.
    pub fn probe(&self) -> SubscriberProbe {
        SubscriberProbe {
            counters: self.counters.clone(),
            connected: self.connected.subscribe(),
        }
    }

    pub fn stats(&self) -> SubscriberStats {
        self.probe().stats()
    }

    /// Forgets the sequence state, as at start: the next batch is handled as a first one
    /// (a replay from 0 is tried). For a consumer that reset on its own (engine seen down).
    pub fn rejoin(&mut self) {
        self.tracker.reset();
        self.pending.clear();
    }

    /// The next item of the stream. Never ends; errors are counted, logged and recovered.
    pub async fn next(&mut self) -> SubscriberItem {
        let mut errors = 0u32;
        loop {
            if let Some(item) = self.pending.pop_front() {
                return item;
            }
            let Some(sub) = self.sub.as_mut() else {
                self.connect().await;
                continue;
            };
            let monitor = &mut self.monitor;
            let down_since = self.disconnected_at;
            let incoming = tokio::select! {
                // Messages first: a drop's last batches are read before its Disconnected.
                biased;
                msg = sub.recv() => Incoming::Message(msg),
                ev = next_monitor_event(monitor) => Incoming::Monitor(ev),
                () = stale(down_since) => Incoming::Stale,
            };
            match incoming {
                Incoming::Message(Ok(msg)) => {
                    errors = 0;
                    if let Some((seq, payload)) = self.frames(msg) {
                        let after_reconnect = std::mem::take(&mut self.reconnected);
                        self.on_live(seq, payload, after_reconnect).await;
                    }
                }
                Incoming::Message(Err(e)) => {
                    // A peer dropped (the monitor says so too); the socket reconnects itself.
                    errors += 1;
                    tracing::debug!(error = %e, "KV event SUB socket receive failed");
                    if errors > 1 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                Incoming::Monitor(Some(SocketEvent::Connected(..))) => {
                    self.disconnected_at = None;
                    self.connected.send_replace(true);
                }
                Incoming::Monitor(Some(SocketEvent::Disconnected(_))) => {
                    tracing::info!(
                        endpoint = self.config.endpoint,
                        "KV event PUB connection lost"
                    );
                    self.connected.send_replace(false);
                    self.reconnected = true;
                    self.disconnected_at = Some(tokio::time::Instant::now());
                }
                Incoming::Monitor(Some(_)) => {}
                Incoming::Monitor(None) => self.monitor = None,
                Incoming::Stale => {
                    tracing::debug!("KV event PUB connection still down: connecting afresh");
                    self.sub = None;
                    self.monitor = None;
                    self.disconnected_at = None;
                }
            }
        }
    }

    /// Connects and subscribes, retrying with backoff until it works.
    async fn connect(&mut self) {
        let mut delay = Duration::from_millis(50);
        let mut attempts = 0u64;
        loop {
            let mut options = SocketOptions::default();
            options.connect_timeout(self.config.connect_timeout);
            let mut sub = SubSocket::with_options(options);
            let monitor = sub.monitor();
            // Subscribing first: the subscription goes out as part of every (re)connection.
            let result = match sub.subscribe(&self.config.topic).await {
                Ok(()) => sub.connect(&self.config.endpoint).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => {
                    tracing::info!(
                        endpoint = self.config.endpoint,
                        topic = self.config.topic,
                        "subscribed to KV events"
                    );
                    bump(&self.counters.connects);
                    self.sub = Some(sub);
                    self.monitor = Some(monitor);
                    self.connected.send_replace(true);
                    return;
                }
                Err(e) => {
                    attempts += 1;
                    if attempts == 1 || attempts.is_multiple_of(30) {
                        tracing::warn!(
                            endpoint = self.config.endpoint,
                            error = %e,
                            attempts,
                            "cannot connect to the engine's KV event socket; retrying"
                        );
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// `[topic, seq, payload]`, or `None` (counted) for anything else.
    fn frames(&self, msg: ZmqMessage) -> Option<(u64, Bytes)> {
        let mut frames = msg.into_vecdeque();
        let seq = match (frames.len(), frames.get(1)) {
            (3, Some(seq)) => <[u8; 8]>::try_from(seq.as_ref()).ok(),
            _ => None,
        };
        match (seq, frames.pop_back()) {
            (Some(seq), Some(payload)) => Some((u64::from_be_bytes(seq), payload)),
            _ => {
                bump(&self.counters.malformed_frames);
                tracing::debug!(frames = frames.len(), "malformed KV event message ignored");
                None
            }
        }
    }

    async fn on_live(&mut self, seq: u64, payload: Bytes, after_reconnect: bool) {
        let mut after_reconnect = after_reconnect;
        loop {
            match self.tracker.classify(seq, after_reconnect) {
                Verdict::Accept => {
                    self.tracker.accept(seq);
                    self.push_payload(seq, &payload, false);
                    return;
                }
                Verdict::Duplicate => {
                    self.tracker.duplicate(seq);
                    bump(&self.counters.duplicates);
                    return;
                }
                v @ (Verdict::Restart | Verdict::Rejoin) => {
                    let expected = self.tracker.expected();
                    let reason = if v == Verdict::Restart {
                        ResetReason::Restarted { expected, got: seq }
                    } else {
                        ResetReason::Reconnected { expected, got: seq }
                    };
                    tracing::info!(?reason, "KV event stream restarted: resetting");
                    self.push_reset(reason);
                    self.tracker.reset();
                    after_reconnect = false;
                }
                Verdict::Gap { from } => {
                    self.repair(from, seq, payload).await;
                    return;
                }
            }
        }
    }

    /// Batches `from..seq` are missing; `payload` is batch `seq`.
    async fn repair(&mut self, from: u64, seq: u64, payload: Bytes) {
        let joined = self.tracker.joined();
        if let Some(endpoint) = self.config.replay_endpoint.clone() {
            match fetch_replay(&endpoint, from, seq, &self.config).await {
                Ok(batches) => {
                    let mut next = from;
                    let mut items = Vec::with_capacity(batches.len());
                    for (s, p) in batches {
                        match decode_limited(&p, self.config.max_payload_bytes) {
                            Ok(batch) => items.push(SubscriberItem::Batch {
                                seq: s,
                                batch,
                                replayed: true,
                            }),
                            Err(e) => {
                                bump(&self.counters.decode_errors);
                                tracing::warn!(seq = s, error = %e, "undecodable replayed KV event batch");
                                break;
                            }
                        }
                        next = s + 1;
                    }
                    if next >= seq {
                        let c = &self.counters;
                        c.replayed_batches
                            .fetch_add(items.len() as u64, Ordering::Relaxed);
                        c.batches.fetch_add(items.len() as u64, Ordering::Relaxed);
                        bump(if joined {
                            &c.gaps_repaired
                        } else {
                            &c.joins_repaired
                        });
                        if joined {
                            // Rare and worth seeing: the PUB socket lost batches.
                            tracing::info!(
                                from,
                                seq,
                                "KV event gap repaired from the replay socket"
                            );
                        } else {
                            tracing::debug!(from, seq, "joined the KV event stream by replay");
                        }
                        self.pending.extend(items);
                        self.tracker.repaired(next);
                        if seq >= next {
                            self.tracker.accept(seq);
                            self.push_payload(seq, &payload, false);
                        } else {
                            self.tracker.duplicate(seq);
                        }
                        return;
                    }
                    bump(&self.counters.replay_incomplete);
                    tracing::debug!(from, seq, reached = next, "replay does not cover the gap");
                }
                Err(e) => {
                    bump(&self.counters.replay_failures);
                    tracing::warn!(from, seq, error = %e, "KV event replay failed");
                }
            }
        }
        if joined {
            tracing::warn!(
                expected = from,
                got = seq,
                "KV event batches lost: resetting"
            );
            self.push_reset(ResetReason::Gap {
                expected: from,
                got: seq,
            });
        } else {
            bump(&self.counters.late_joins);
            tracing::info!(first = seq, "joined the KV event stream past seq 0");
            self.pending
                .push_back(SubscriberItem::Reset(ResetReason::JoinedLate {
                    first: seq,
                }));
        }
        self.tracker.accept(seq);
        self.push_payload(seq, &payload, false);
    }

    fn push_reset(&mut self, reason: ResetReason) {
        bump(&self.counters.resets);
        self.pending.push_back(SubscriberItem::Reset(reason));
    }

    fn push_payload(&mut self, seq: u64, payload: &[u8], replayed: bool) {
        match decode_limited(payload, self.config.max_payload_bytes) {
            Ok(batch) => {
                bump(&self.counters.batches);
                self.pending.push_back(SubscriberItem::Batch {
                    seq,
                    batch,
                    replayed,
                });
            }
            Err(e) => {
                bump(&self.counters.decode_errors);
                tracing::warn!(seq, error = %e, "undecodable KV event batch: resetting");
                self.push_reset(ResetReason::Undecodable { seq });
            }
        }
    }
}

impl Drop for EngineSubscriber {
    fn drop(&mut self) {
        self.connected.send_replace(false);
    }
}

fn decode_limited(payload: &[u8], limit: usize) -> Result<EngineBatch, EventsError> {
    if payload.len() > limit {
        return Err(EventsError::TooLarge {
            len: payload.len(),
            limit,
        });
    }
    decode_batch(payload)
}

async fn stale(down_since: Option<tokio::time::Instant>) {
    match down_since {
        Some(t) => tokio::time::sleep_until(t + RESUBSCRIBE_AFTER).await,
        None => std::future::pending().await,
    }
}

async fn next_monitor_event(
    monitor: &mut Option<mpsc::Receiver<SocketEvent>>,
) -> Option<SocketEvent> {
    match monitor {
        Some(m) => m.next().await,
        None => std::future::pending().await,
    }
}

/// Asks the replay socket for the batches from `from` on and returns the contiguous run of
/// them before `until` (shorter when the buffer has a hole or starts later).
async fn fetch_replay(
    endpoint: &str,
    from: u64,
    until: u64,
    config: &SubscriberConfig,
) -> Result<Vec<(u64, Bytes)>, EventsError> {
    let work = async {
        let mut options = SocketOptions::default();
        options.connect_timeout(config.replay_timeout);
        let mut dealer = DealerSocket::with_options(options);
        dealer.connect(endpoint).await?;
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .map_err(|e| EventsError::Replay(e.to_string()))?;
        dealer.send(request).await?;
        let mut out = Vec::new();
        let mut next = from;
        let mut bytes = 0usize;
        while next < until {
            let mut frames = dealer.recv().await?.into_vecdeque();
            // `[b"", seq, payload]`; a peer that leaves out the empty delimiter is tolerated.
            if frames.len() == 3 && frames.front().is_some_and(Bytes::is_empty) {
                frames.pop_front();
            }
            let (Some(seq), Some(payload), None) =
                (frames.pop_front(), frames.pop_front(), frames.pop_front())
            else {
                return Err(EventsError::Replay("reply is not [seq, payload]".into()));
            };
            let seq = <[u8; 8]>::try_from(seq.as_ref())
                .map_err(|_| EventsError::Replay("reply seq is not 8 bytes".into()))?;
            if seq == END_SEQ {
                break;
            }
            let seq = u64::from_be_bytes(seq);
            if seq < next {
                continue;
            }
            if seq > next {
                break;
            }
            bytes = bytes.saturating_add(payload.len());
            if out.len() >= config.max_replay_batches || bytes > config.max_replay_bytes {
                return Err(EventsError::Replay(format!(
                    "replay over its bound ({} batches, {bytes} bytes)",
                    out.len()
                )));
            }
            out.push((seq, payload));
            next += 1;
        }
        Ok(out)
    };
    tokio::time::timeout(config.replay_timeout, work)
        .await
        .map_err(|_| EventsError::Replay(format!("no answer in {:?}", config.replay_timeout)))?
}
