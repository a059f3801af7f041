//! Router replica sync (docs/ARCHITECTURE.md §5): this replica's tracker changes go to its
//! peers — the namespace's other frontends and endpoint pickers — on the `router-sync`
//! subject, and theirs are applied to its routing replica.
//!
//! A replica publishes only while it hears a peer. Each says hello on `router-hello` when it
//! starts and every [`HELLO_EVERY`], and answers at once the hello of a replica it has not
//! heard within [`PEER_TTL`]; a peer's hello or sync message keeps it present for that long.
//! A lone frontend, the common deployment, then spends nothing on sync: it used to encode
//! and publish three messages a request that no one read (BENCHMARKS.md, 2026-12-07).
//!
//! A peer misses what was routed before the two heard each other, as a replica that starts
//! later always has: frees for requests it never saw are ignored, and those requests' load
//! is counted by the replica that routed them alone. A replica of an older build says no
//! hello but publishes everything, and any sync message counts as presence.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hashbrown::HashMap;
use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use tandem_protocol::Envelope;
use tandem_router::{Input, RouterId, SyncHello, SyncMessage};
use tandem_runtime::RuntimeError;
use tandem_runtime::events::{EventPlane, subjects};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::view::ClusterView;

/// Sync messages waiting to be published; beyond it they are dropped (peers expire the
/// entries by TTL).
const SYNC_QUEUE: usize = 4096;

/// How often a replica says hello.
pub(crate) const HELLO_EVERY: Duration = Duration::from_secs(2);

/// How long a peer counts as present after it was last heard (a few hellos, so that one
/// lost hello does not stop the sync).
pub(crate) const PEER_TTL: Duration = Duration::from_millis(6_500);

/// Publishes `msg` on `subject`; a failure is logged (`what` names the message), not returned:
/// the next message or hello tries again.
async fn publish<T: Envelope>(events: &dyn EventPlane, subject: &str, msg: &T, what: &str) {
    match msg.encode() {
        Ok(bytes) => {
            if let Err(e) = events.publish(subject, bytes.into()).await {
                tracing::debug!(error = %e, "publishing {what} failed");
            }
        }
        Err(e) => tracing::error!(error = %e, "encoding {what} failed"),
    }
}

/// The peers heard lately.
#[derive(Debug)]
struct Peers {
    any: AtomicBool,
    heard: Mutex<HashMap<RouterId, Instant>>,
    /// Their number, for `/metrics`.
    gauge: Gauge,
}

impl Peers {
    /// Notes `router` heard now; true when it was not heard within [`PEER_TTL`] (a newcomer).
    fn heard(&self, router: RouterId) -> bool {
        let now = Instant::now();
        let mut heard = self.heard.lock();
        let last = heard.insert(router, now);
        self.any.store(true, Ordering::Relaxed);
        self.gauge.set(heard.len() as i64);
        last.is_none_or(|t| now.duration_since(t) > PEER_TTL)
    }

    /// Forgets the peers not heard within [`PEER_TTL`].
    fn expire(&self) {
        let now = Instant::now();
        let mut heard = self.heard.lock();
        heard.retain(|_, t| now.duration_since(*t) <= PEER_TTL);
        self.any.store(!heard.is_empty(), Ordering::Relaxed);
        self.gauge.set(heard.len() as i64);
    }
}

/// One replica's end of the sync. Cheap to share.
#[derive(Debug)]
pub(crate) struct ReplicaSync {
    tx: mpsc::Sender<SyncMessage>,
    peers: Arc<Peers>,
}

impl ReplicaSync {
    /// Starts the sync of replica `me` in `namespace`: publishing, hellos, and the peers'
    /// messages handed to `apply` (those of `me` left out); the number of peers heard lately
    /// kept in `peers_gauge`.
    pub(crate) async fn start(
        me: RouterId,
        namespace: &str,
        events: Arc<dyn EventPlane>,
        apply: impl Fn(&SyncMessage) + Send + 'static,
        peers_gauge: Gauge,
        (tasks, stop): (&TaskTracker, CancellationToken),
    ) -> Result<Self, RuntimeError> {
        let peers = Arc::new(Peers {
            any: AtomicBool::new(false),
            heard: Mutex::new(HashMap::new()),
            gauge: peers_gauge,
        });
        let sync_subject = subjects::router_sync(namespace);
        let hello_subject = subjects::router_hello(namespace);
        // Subscribed before the first hello, so that no answer to it is missed.
        let mut sync_in = events.subscribe(&sync_subject).await?;
        let mut hello_in = events.subscribe(&hello_subject).await?;

        let (tx, mut rx) = mpsc::channel::<SyncMessage>(SYNC_QUEUE);
        let (ev, c) = (events.clone(), stop.clone());
        tasks.spawn(async move {
            loop {
                let msg = tokio::select! {
                    m = rx.recv() => match m { Some(m) => m, None => return },
                    () = c.cancelled() => return,
                };
                publish(&*ev, &sync_subject, &msg, "router sync").await;
            }
        });

        let (p, c) = (peers.clone(), stop.clone());
        tasks.spawn(async move {
            loop {
                let bytes = tokio::select! {
                    m = sync_in.next() => match m { Some(b) => b, None => return },
                    () = c.cancelled() => return,
                };
                let Ok(msg) = SyncMessage::decode(&bytes) else {
                    continue;
                };
                if msg.router() != me {
                    p.heard(msg.router());
                    apply(&msg);
                }
            }
        });

        let p = peers.clone();
        tasks.spawn(async move {
            let (events, subject) = (&*events, &hello_subject);
            let say = |answer: bool| async move {
                let hello = SyncHello { router: me, answer };
                publish(events, subject, &hello, "router hello").await;
            };
            // The first tick is at once: the hello that announces this replica.
            let mut every = tokio::time::interval(HELLO_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = every.tick() => {
                        p.expire();
                        say(false).await;
                    }
                    m = hello_in.next() => {
                        let Some(bytes) = m else { return };
                        let Ok(hello) = SyncHello::decode(&bytes) else {
                            continue;
                        };
                        if hello.router != me && p.heard(hello.router) && !hello.answer {
                            say(true).await;
                        }
                    }
                    () = stop.cancelled() => return,
                }
            }
        });
        Ok(ReplicaSync { tx, peers })
    }

    /// [`ReplicaSync::start`] for the routing replica of `view`, in its namespace: the peers'
    /// messages applied to it.
    pub(crate) async fn on_view(
        me: RouterId,
        view: &Arc<ClusterView>,
        events: Arc<dyn EventPlane>,
        peers_gauge: Gauge,
        (tasks, stop): (&TaskTracker, CancellationToken),
    ) -> Result<Self, RuntimeError> {
        let v = view.clone();
        let apply = move |msg: &SyncMessage| {
            let now = v.now_ms();
            // A sync message never asks for a repair.
            let _ = v.replica().write().apply(Input::PeerSync(msg), now);
        };
        let namespace = &view.config().namespace;
        Self::start(me, namespace, events, apply, peers_gauge, (tasks, stop)).await
    }

    /// Publishes `msg` when a peer is present (dropped when the queue is full).
    pub(crate) fn send(&self, msg: SyncMessage) {
        if self.peers.any.load(Ordering::Relaxed) {
            let _ = self.tx.try_send(msg);
        }
    }

    /// Whether a peer is present: this replica's changes are published.
    #[cfg(test)]
    pub(crate) fn has_peers(&self) -> bool {
        self.peers.any.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
#[path = "sync_tests.rs"]
mod tests;
