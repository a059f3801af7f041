//! Discovery: which workers exist and how to reach them.
//!
//! A worker [`Discovery::register`]s its [`WorkerRecord`] and keeps the returned [`Registration`]
//! for as long as it serves; the frontend (and the indexer) [`Discovery::watch`] the set.
//!
//! Two implementations: [`EtcdDiscovery`] (keys under a lease, see [`etcd`]) and
//! [`MemoryDiscovery`] (in-process, for unit tests and the embedded mode). Both follow the same
//! contract:
//! - a registration stays visible until it is deregistered, dropped (after the lease TTL for
//!   etcd, at once or after the configured TTL in memory) or expired by the backend;
//! - a watch first yields [`DiscoveryEvent::Added`] for every worker present, then the changes,
//!   in order; a worker whose record changes is reported as `Added` again (an upsert);
//! - a watch never silently misses a removal: whenever it loses track (etcd restart, lagging
//!   in-memory subscriber) it re-lists and emits the difference against what it had reported.

pub mod etcd;
pub mod memory;

use std::collections::HashMap;
use std::pin::Pin;
use std::task::{Context, Poll};

use async_trait::async_trait;
use futures::Stream;
use tandem_protocol::{WorkerId, WorkerRecord, WorkerRole};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::sync::DropGuard;

use crate::error::RuntimeError;

pub use etcd::{EtcdConfig, EtcdDiscovery};
pub use memory::MemoryDiscovery;

/// Capacity of the channel between a watch's background task and its consumer. A slow consumer
/// back-pressures the task (and, for etcd, the watch stream); nothing is dropped.
pub(crate) const WATCH_BUFFER: usize = 256;

/// A change in the set of registered workers.
// Events are as rare as workers joining and leaving: the record's size is not worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiscoveryEvent {
    /// A worker appeared or its record changed (treat as an upsert).
    Added(WorkerRecord),
    /// A worker is gone (deregistered, lease lapsed, or no longer present after a resync).
    Removed { id: WorkerId, role: WorkerRole },
}

/// A registry of workers.
#[async_trait]
pub trait Discovery: Send + Sync + 'static {
    /// Registers `record` and keeps it registered until the returned handle is deregistered or
    /// dropped. Re-registering the same `(role, id)` replaces the previous record.
    async fn register(&self, record: WorkerRecord) -> Result<Registration, RuntimeError>;

    /// The workers registered now.
    async fn list(&self) -> Result<Vec<WorkerRecord>, RuntimeError>;

    /// A stream of changes, starting with `Added` for every worker present. Its task ends
    /// when the watch is dropped or `stop` (the service's token) is cancelled.
    async fn watch(&self, stop: &CancellationToken) -> Result<DiscoveryWatch, RuntimeError>;
}

/// What a [`Registration`] delegates to: one implementation per discovery backend.
#[async_trait]
pub trait RegistrationBackend: Send + Sync + 'static {
    /// The registered worker.
    fn id(&self) -> WorkerId;
    /// The registered worker's role.
    fn role(&self) -> WorkerRole;
    /// Replaces the registered record (same id and role).
    fn update(&self, record: WorkerRecord) -> Result<(), RuntimeError>;
    /// Removes the registration now; best effort (logs on failure, the lease lapses anyway).
    async fn deregister(self: Box<Self>);
}

/// A live registration. Dropping it stops keeping the worker registered (with etcd, the key then
/// expires with its lease); [`Registration::deregister`] removes it at once.
pub struct Registration {
    inner: Box<dyn RegistrationBackend>,
}

impl Registration {
    /// Wraps a backend-specific registration.
    pub fn new(inner: Box<dyn RegistrationBackend>) -> Self {
        Registration { inner }
    }

    /// The registered worker.
    pub fn id(&self) -> WorkerId {
        self.inner.id()
    }

    /// The registered worker's role.
    pub fn role(&self) -> WorkerRole {
        self.inner.role()
    }

    /// Replaces the registered record. The id and role must not change (they name the key):
    /// [`RuntimeError::InvalidRequest`] otherwise. With etcd the write happens in the background
    /// and is retried with the registration.
    pub fn update(&self, record: WorkerRecord) -> Result<(), RuntimeError> {
        if record.id != self.id() || record.role != self.role() {
            return Err(RuntimeError::InvalidRequest(format!(
                "registration update must keep id and role ({} {:?}), got {} {:?}",
                self.id(),
                self.role(),
                record.id,
                record.role
            )));
        }
        self.inner.update(record)
    }

    /// Removes the worker from discovery now (delete the key, revoke the lease). Best effort:
    /// failures are logged, and the lease lapses on its own anyway.
    pub async fn deregister(self) {
        self.inner.deregister().await
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.id())
            .field("role", &self.role())
            .finish()
    }
}

/// A stream of [`DiscoveryEvent`]s fed by a background task, which stops when this is dropped.
///
/// Use it as a [`futures::Stream`] (it is `Unpin`) or call [`DiscoveryWatch::next`]. It ends
/// (`None`) only when the backend is gone; etcd watches reconnect forever instead of ending.
pub struct DiscoveryWatch {
    rx: mpsc::Receiver<DiscoveryEvent>,
    _guard: Option<DropGuard>,
}

impl DiscoveryWatch {
    /// A watch over `rx`; `guard` (if any) cancels the producing task when the watch is dropped.
    pub fn new(rx: mpsc::Receiver<DiscoveryEvent>, guard: Option<DropGuard>) -> Self {
        DiscoveryWatch { rx, _guard: guard }
    }

    /// The next event; `None` when the watch has ended.
    pub async fn next(&mut self) -> Option<DiscoveryEvent> {
        self.rx.recv().await
    }
}

impl Stream for DiscoveryWatch {
    type Item = DiscoveryEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

impl std::fmt::Debug for DiscoveryWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiscoveryWatch").finish_non_exhaustive()
    }
}

/// The set of workers as seen through a stream of events. Watch implementations use it to turn
/// a fresh listing into the difference against what they reported; consumers may use it to fold
/// a [`DiscoveryWatch`] into the current set.
#[derive(Clone, Debug, Default)]
pub struct WorkerView {
    workers: HashMap<(WorkerRole, WorkerId), WorkerRecord>,
}

impl WorkerView {
    /// An empty view.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event; returns whether the view changed.
    pub fn apply(&mut self, event: &DiscoveryEvent) -> bool {
        match event {
            DiscoveryEvent::Added(record) => self.put(record.clone()).is_some(),
            DiscoveryEvent::Removed { id, role } => self.remove(*role, *id).is_some(),
        }
    }

    /// Records `record`; returns the event to report, or `None` when nothing changed.
    pub fn put(&mut self, record: WorkerRecord) -> Option<DiscoveryEvent> {
        let key = (record.role, record.id);
        if self.workers.get(&key) == Some(&record) {
            return None;
        }
        self.workers.insert(key, record.clone());
        Some(DiscoveryEvent::Added(record))
    }

    /// Forgets a worker; returns the event to report, or `None` when it was unknown.
    pub fn remove(&mut self, role: WorkerRole, id: WorkerId) -> Option<DiscoveryEvent> {
        self.workers
            .remove(&(role, id))
            .map(|_| DiscoveryEvent::Removed { id, role })
    }

    /// Replaces the view by `snapshot`; returns the events that turn the old view into it:
    /// `Removed` first (for workers gone), then `Added` (new or changed), each in id order.
    pub fn resync(&mut self, snapshot: Vec<WorkerRecord>) -> Vec<DiscoveryEvent> {
        let fresh: HashMap<_, _> = snapshot.into_iter().map(|r| ((r.role, r.id), r)).collect();
        let mut gone: Vec<_> = self
            .workers
            .keys()
            .filter(|k| !fresh.contains_key(k))
            .copied()
            .collect();
        gone.sort_by_key(|(_, id)| *id);
        let mut events: Vec<_> = gone
            .into_iter()
            .filter_map(|(role, id)| self.remove(role, id))
            .collect();
        let mut fresh: Vec<_> = fresh.into_values().collect();
        fresh.sort_by_key(|r| r.id);
        events.extend(fresh.into_iter().filter_map(|r| self.put(r)));
        events
    }

    /// The record of a worker, if present.
    pub fn get(&self, role: WorkerRole, id: WorkerId) -> Option<&WorkerRecord> {
        self.workers.get(&(role, id))
    }

    /// Whether a worker with this id is present, in any role.
    pub fn contains_id(&self, id: WorkerId) -> bool {
        self.workers.keys().any(|(_, i)| *i == id)
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// All records, in id order.
    pub fn records(&self) -> Vec<WorkerRecord> {
        let mut all: Vec<_> = self.workers.values().cloned().collect();
        all.sort_by_key(|r| (r.id, role_name(r.role)));
        all
    }
}

/// The lowercase name of a role as it appears in discovery keys.
pub fn role_name(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Prefill => "prefill",
        WorkerRole::Decode => "decode",
        WorkerRole::Aggregated => "aggregated",
    }
}

/// Inverse of [`role_name`].
pub fn parse_role(name: &str) -> Option<WorkerRole> {
    match name {
        "prefill" => Some(WorkerRole::Prefill),
        "decode" => Some(WorkerRole::Decode),
        "aggregated" => Some(WorkerRole::Aggregated),
        _ => None,
    }
}

/// Exponential backoff for reconnect loops: doubles from `initial` up to `max`.
#[derive(Clone, Debug)]
pub(crate) struct Backoff {
    initial: std::time::Duration,
    max: std::time::Duration,
    next: std::time::Duration,
}

impl Backoff {
    pub(crate) fn new(initial: std::time::Duration, max: std::time::Duration) -> Self {
        Backoff {
            initial,
            max,
            next: initial.min(max),
        }
    }

    pub(crate) fn next_delay(&mut self) -> std::time::Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.initial.min(self.max);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tandem_protocol::{BlockSize, TierCapacity, WorkerAddresses};

    pub(crate) fn record(id: u64, role: WorkerRole) -> WorkerRecord {
        WorkerRecord {
            id: WorkerId(id),
            role,
            model: "test-model".into(),
            block_size: BlockSize::new(16).expect("valid block size"),
            kv_capacity: TierCapacity {
                device_blocks: 100,
                host_blocks: 0,
                disk_blocks: 0,
            },
            addresses: WorkerAddresses {
                grpc: format!("127.0.0.1:{}", 9000 + id),
                kv_transfer: None,
                metrics: None,
                http: None,
            },
            kv_events: true,
            placement: Default::default(),
            takes_text: false,
        }
    }

    #[test]
    fn resync_emits_removed_then_added_for_the_difference() {
        let mut view = WorkerView::new();
        let a = record(1, WorkerRole::Decode);
        let b = record(2, WorkerRole::Prefill);
        assert_eq!(
            view.resync(vec![a.clone(), b.clone()]),
            vec![
                DiscoveryEvent::Added(a.clone()),
                DiscoveryEvent::Added(b.clone())
            ]
        );
        // Same listing again: nothing to say.
        assert!(view.resync(vec![a.clone(), b.clone()]).is_empty());
        let mut a2 = a.clone();
        a2.model = "other".into();
        let c = record(3, WorkerRole::Decode);
        assert_eq!(
            view.resync(vec![a2.clone(), c.clone()]),
            vec![
                DiscoveryEvent::Removed {
                    id: WorkerId(2),
                    role: WorkerRole::Prefill
                },
                DiscoveryEvent::Added(a2),
                DiscoveryEvent::Added(c),
            ]
        );
        assert_eq!(view.len(), 2);
    }

    #[test]
    fn put_of_an_identical_record_is_silent() {
        let mut view = WorkerView::new();
        let a = record(1, WorkerRole::Decode);
        assert!(view.put(a.clone()).is_some());
        assert!(view.put(a).is_none());
        assert!(view.remove(WorkerRole::Decode, WorkerId(1)).is_some());
        assert!(view.remove(WorkerRole::Decode, WorkerId(1)).is_none());
    }

    #[test]
    fn handles_are_send_and_the_watch_is_an_unpin_stream() {
        fn stream<S: Stream<Item = DiscoveryEvent> + Unpin + Send + 'static>() {}
        fn send_sync<T: Send + Sync + 'static>() {}
        stream::<DiscoveryWatch>();
        send_sync::<Registration>();
        send_sync::<std::sync::Arc<dyn Discovery>>();
    }

    #[test]
    fn role_names_roundtrip() {
        for role in [
            WorkerRole::Prefill,
            WorkerRole::Decode,
            WorkerRole::Aggregated,
        ] {
            assert_eq!(parse_role(role_name(role)), Some(role));
        }
        assert_eq!(parse_role("Decode"), None);
    }

    #[test]
    fn backoff_doubles_up_to_max_and_resets() {
        let ms = std::time::Duration::from_millis;
        let mut b = Backoff::new(ms(100), ms(350));
        assert_eq!(b.next_delay(), ms(100));
        assert_eq!(b.next_delay(), ms(200));
        assert_eq!(b.next_delay(), ms(350));
        assert_eq!(b.next_delay(), ms(350));
        b.reset();
        assert_eq!(b.next_delay(), ms(100));
    }
}
