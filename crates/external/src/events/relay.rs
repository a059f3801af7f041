//! [`KvRelay`]: one task that subscribes to an engine's KV events, mirrors them, numbers the
//! resulting tandem events and publishes each engine batch's events as one envelope on the
//! event plane; and the handle the worker's `KvEvents` handler reads ranges and dumps from.
//!
//! Per subscriber item: a batch's events go through the mirror in order and the changes are
//! numbered together; a `Reset` clears the mirror (`Cleared` for every tier that held
//! blocks). An empty result publishes nothing. A failed publish is not retried: the consumer
//! sees the hole in the ids and asks the worker for the range (`events_since`) or a dump.
//!
//! Divergence: `BlockStored` events with an unknown parent (the relay joined a running engine
//! whose replay buffer no longer starts at 0, or lost batches it could not repair) are dropped
//! by the mirror and counted. The engine offers no dump, so nothing better is possible than to
//! under-announce until the engine evicts and re-stores those prefixes; the relay warns at the
//! 1st, 10th, 100th, ... such event instead of once per event. Under-announcing only costs
//! cache hits; the relay never announces a block the engine does not hold.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tandem_protocol::{BlockSize, Envelope, KvDump, KvEvent, WorkerId};
use tandem_runtime::events::EventPlane;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::log::{DEFAULT_RING_BLOCKS, RelayLog};
use super::mirror::{DEFAULT_MAX_BLOCKS, KvMirror, MirrorStats};
use super::subscriber::{
    EngineSubscriber, SubscriberConfig, SubscriberItem, SubscriberProbe, SubscriberStats,
};

/// What to relay, from where, to where.
#[derive(Clone)]
pub struct RelayConfig {
    /// The worker the tandem events are numbered for.
    pub worker_id: WorkerId,
    /// The engine's block size (a `BlockStored` with another is counted and skipped).
    pub block_size: BlockSize,
    /// The engine's PUB endpoint (vLLM `--kv-events-config` `endpoint`, as a client would
    /// connect: `tcp://engine-host:5557`).
    pub endpoint: String,
    /// Its replay ROUTER endpoint (`replay_endpoint`), if it serves one.
    pub replay_endpoint: Option<String>,
    /// Its `topic` (vLLM's default `""`).
    pub topic: String,
    /// Tandem events kept for range requests.
    pub ring_capacity: usize,
    pub events: Arc<dyn EventPlane>,
    /// Where to publish (`tandem_runtime::events::subjects::kv_events(namespace)`).
    pub subject: String,
}

impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConfig")
            .field("worker_id", &self.worker_id)
            .field("block_size", &self.block_size)
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("topic", &self.topic)
            .field("ring_capacity", &self.ring_capacity)
            .field("subject", &self.subject)
            .finish_non_exhaustive()
    }
}

/// Limits and timeouts; the defaults suit a vLLM engine with its default `buffer_steps`.
#[derive(Clone, Debug)]
pub struct RelayTuning {
    pub replay_timeout: Duration,
    pub connect_timeout: Duration,
    pub max_replay_batches: usize,
    pub max_replay_bytes: usize,
    pub max_payload_bytes: usize,
    /// Bound on mirrored engine blocks.
    pub max_mirror_blocks: usize,
    /// Bound on the blocks the ring's events carry together.
    pub ring_max_blocks: usize,
}

impl Default for RelayTuning {
    fn default() -> Self {
        let sub = SubscriberConfig::new("");
        RelayTuning {
            replay_timeout: sub.replay_timeout,
            connect_timeout: sub.connect_timeout,
            max_replay_batches: sub.max_replay_batches,
            max_replay_bytes: sub.max_replay_bytes,
            max_payload_bytes: sub.max_payload_bytes,
            max_mirror_blocks: DEFAULT_MAX_BLOCKS,
            ring_max_blocks: DEFAULT_RING_BLOCKS,
        }
    }
}

/// Counters of a relay: the main ones flat, the rest in `subscriber` and `mirror`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Engine batches applied.
    pub batches: u64,
    /// Engine events applied.
    pub engine_events: u64,
    /// Tandem events numbered.
    pub events: u64,
    /// Envelopes published (one per engine batch or reset that changed something).
    pub published: u64,
    pub publish_errors: u64,
    pub gaps_repaired: u64,
    /// Resets applied: the subscriber's and [`KvRelay::reset`]'s.
    pub resets: u64,
    pub decode_errors: u64,
    pub unknown_parent: u64,
    pub unknown_removed: u64,
    pub block_size_mismatch: u64,
    /// Engine blocks mirrored now.
    pub blocks: usize,
    pub last_event_id: u64,
    pub connected: bool,
    pub subscriber: SubscriberStats,
    pub mirror: MirrorStats,
}

/// A running relay; cheap to clone. The task stops with the cancellation token.
#[derive(Clone, Debug)]
pub struct KvRelay {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    worker_id: WorkerId,
    state: Mutex<State>,
    probe: SubscriberProbe,
    reset_reason: Mutex<Option<String>>,
    reset_requested: Notify,
    counters: Counters,
}

#[derive(Debug)]
struct State {
    mirror: KvMirror,
    log: RelayLog,
    /// The unknown-parent count at which to warn next (1, 10, 100, ...).
    next_unknown_warning: u64,
}

#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    engine_events: AtomicU64,
    published: AtomicU64,
    publish_errors: AtomicU64,
    resets: AtomicU64,
}

impl KvRelay {
    /// Starts the relay task on `tasks` (needs a tokio runtime) with default tuning.
    pub fn start(config: RelayConfig, tasks: &TaskTracker, cancel: CancellationToken) -> KvRelay {
        Self::start_tuned(config, RelayTuning::default(), tasks, cancel)
    }

    pub fn start_tuned(
        config: RelayConfig,
        tuning: RelayTuning,
        tasks: &TaskTracker,
        cancel: CancellationToken,
    ) -> KvRelay {
        let mut sub_config = SubscriberConfig::new(config.endpoint.clone());
        sub_config.replay_endpoint = config.replay_endpoint.clone();
        sub_config.topic = config.topic.clone();
        sub_config.replay_timeout = tuning.replay_timeout;
        sub_config.connect_timeout = tuning.connect_timeout;
        sub_config.max_replay_batches = tuning.max_replay_batches;
        sub_config.max_replay_bytes = tuning.max_replay_bytes;
        sub_config.max_payload_bytes = tuning.max_payload_bytes;
        let subscriber = EngineSubscriber::new(sub_config);
        let inner = Arc::new(Inner {
            worker_id: config.worker_id,
            state: Mutex::new(State {
                mirror: KvMirror::new(config.worker_id, config.block_size)
                    .with_max_blocks(tuning.max_mirror_blocks),
                log: RelayLog::new(config.worker_id, config.ring_capacity)
                    .with_max_blocks(tuning.ring_max_blocks),
                next_unknown_warning: 1,
            }),
            probe: subscriber.probe(),
            reset_reason: Mutex::new(None),
            reset_requested: Notify::new(),
            counters: Counters::default(),
        });
        tasks.spawn(run(
            inner.clone(),
            subscriber,
            config.events,
            config.subject,
            cancel,
        ));
        KvRelay { inner }
    }

    pub fn worker_id(&self) -> WorkerId {
        self.inner.worker_id
    }

    /// The tandem events after `after`, or `None` when the ring no longer holds them (the
    /// caller dumps). Empty when `after` is the latest or beyond: compare with
    /// [`KvRelay::last_event_id`].
    pub fn events_since(&self, after: u64) -> Option<Vec<KvEvent>> {
        self.inner.state.lock().log.since(after)
    }

    /// Everything mirrored, as of [`KvRelay::last_event_id`].
    pub fn dump(&self) -> KvDump {
        let st = self.inner.state.lock();
        st.log.dump(&st.mirror)
    }

    /// How many leading blocks of `chain` the engine holds on its device, as its events
    /// said: an estimate of the prompt tokens it will find cached (its own count comes with
    /// the answer's usage).
    pub fn device_prefix(&self, chain: &[tandem_protocol::SequenceHash]) -> usize {
        self.inner
            .state
            .lock()
            .mirror
            .prefix_held(tandem_protocol::StorageTier::Device, chain)
    }

    /// Id of the latest tandem event (0 before any).
    pub fn last_event_id(&self) -> u64 {
        self.inner.state.lock().log.last_id()
    }

    /// Whether the engine's PUB socket is connected now.
    pub fn connected(&self) -> bool {
        self.inner.probe.connected()
    }

    /// Waits until the engine's PUB socket is connected (wrap it in a timeout).
    pub async fn wait_connected(&self) {
        self.inner.probe.wait_connected().await;
    }

    /// Forgets the engine's state (`Cleared` for the tiers that held blocks, published in
    /// order with the other events) and rejoins its stream as at start. For a worker that saw
    /// its engine go down: a restarted engine's cache is empty.
    pub fn reset(&self, reason: &str) {
        *self.inner.reset_reason.lock() = Some(reason.to_string());
        self.inner.reset_requested.notify_one();
    }

    pub fn stats(&self) -> RelayStats {
        let sub = self.inner.probe.stats();
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (mirror, last_event_id) = {
            let st = self.inner.state.lock();
            (st.mirror.stats(), st.log.last_id())
        };
        RelayStats {
            batches: get(&c.batches),
            engine_events: get(&c.engine_events),
            events: last_event_id,
            published: get(&c.published),
            publish_errors: get(&c.publish_errors),
            gaps_repaired: sub.gaps_repaired,
            resets: get(&c.resets),
            decode_errors: sub.decode_errors,
            unknown_parent: mirror.unknown_parent,
            unknown_removed: mirror.unknown_removed,
            block_size_mismatch: mirror.block_size_mismatch,
            blocks: mirror.blocks,
            last_event_id,
            connected: self.inner.probe.connected(),
            subscriber: sub,
            mirror,
        }
    }
}

impl Inner {
    /// Applies one subscriber item (or a requested reset) and numbers its changes.
    fn apply(&self, item: SubscriberItem) -> Vec<KvEvent> {
        let mut st = self.state.lock();
        let changes = match item {
            SubscriberItem::Batch { batch, .. } => {
                self.counters.batches.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .engine_events
                    .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
                let mut changes = Vec::new();
                for event in &batch.events {
                    changes.extend(st.mirror.apply(event));
                }
                changes
            }
            SubscriberItem::Reset(reason) => {
                self.counters.resets.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(worker = %self.worker_id, ?reason, "KV relay reset");
                st.mirror.clear()
            }
        };
        let unknown = st.mirror.stats().unknown_parent;
        if unknown >= st.next_unknown_warning {
            tracing::warn!(
                worker = %self.worker_id,
                unknown_parent = unknown,
                "engine stored blocks under parents the relay never saw (joined late or \
                 lost batches); they stay unannounced until the engine re-stores them"
            );
            st.next_unknown_warning = unknown.saturating_mul(10);
        }
        st.log.push(changes)
    }

    fn requested_reset(&self) -> Option<Vec<KvEvent>> {
        let reason = self.reset_reason.lock().take()?;
        tracing::info!(worker = %self.worker_id, reason, "KV relay reset requested");
        self.counters.resets.fetch_add(1, Ordering::Relaxed);
        let mut st = self.state.lock();
        let changes = st.mirror.clear();
        Some(st.log.push(changes))
    }

    async fn publish(&self, events: &dyn EventPlane, subject: &str, batch: Vec<KvEvent>) {
        if batch.is_empty() {
            return;
        }
        let bytes = match batch.encode() {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "encoding relayed KV events failed");
                self.counters.publish_errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        match events.publish(subject, Bytes::from(bytes)).await {
            Ok(()) => {
                self.counters.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                // Not retried: the consumer sees the id gap and asks for the range.
                self.counters.publish_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "publishing relayed KV events failed");
            }
        }
    }
}

async fn run(
    inner: Arc<Inner>,
    mut subscriber: EngineSubscriber,
    events: Arc<dyn EventPlane>,
    subject: String,
    cancel: CancellationToken,
) {
    loop {
        let batch = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            () = inner.reset_requested.notified() => {
                let Some(batch) = inner.requested_reset() else { continue };
                subscriber.rejoin();
                batch
            }
            item = subscriber.next() => inner.apply(item),
        };
        inner.publish(&*events, &subject, batch).await;
    }
    tracing::debug!(worker = %inner.worker_id, "KV relay stopped");
}
