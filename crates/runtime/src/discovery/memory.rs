//! In-process discovery for unit tests and the embedded mode (`tandem up`).
//!
//! Same contract as etcd: records keyed by `(role, id)`, a watch that starts with the present
//! workers and never misses a removal. Dropping a [`Registration`] removes the worker at once, or
//! after the lease TTL given to [`MemoryDiscovery::with_lease_ttl`] (mimicking a lapsed lease).
//! [`MemoryDiscovery::expire`] removes a worker as if its lease had lapsed, for fault tests.

use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tandem_protocol::{WorkerId, WorkerRecord, WorkerRole};
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use super::{
    Discovery, DiscoveryEvent, DiscoveryWatch, Registration, RegistrationBackend, WATCH_BUFFER,
    WorkerView,
};
use crate::error::RuntimeError;

/// Capacity of the internal change feed. A watch task that falls this far behind re-lists and
/// emits the difference, so nothing is lost, only coalesced.
const CHANGE_FEED: usize = 256;

/// An in-process worker registry. Cheap to clone; clones share the registry.
#[derive(Clone)]
pub struct MemoryDiscovery {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    changes: broadcast::Sender<DiscoveryEvent>,
    lease_ttl: Duration,
}

#[derive(Default)]
struct State {
    workers: HashMap<(WorkerRole, WorkerId), Entry>,
    next_generation: u64,
}

struct Entry {
    record: WorkerRecord,
    /// Which registration owns the entry: an old handle never removes a newer registration.
    generation: u64,
}

impl MemoryDiscovery {
    /// A registry where dropping a registration removes the worker at once.
    pub fn new() -> Self {
        Self::with_lease_ttl(Duration::ZERO)
    }

    /// A registry where a dropped registration lingers for `ttl` before it is removed, like an
    /// etcd key waiting for its lease to lapse. Needs a tokio runtime when a handle is dropped
    /// (without one the removal is immediate).
    pub fn with_lease_ttl(ttl: Duration) -> Self {
        let (changes, _) = broadcast::channel(CHANGE_FEED);
        MemoryDiscovery {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                changes,
                lease_ttl: ttl,
            }),
        }
    }

    /// Removes every registration of worker `id` as if its lease had lapsed: watchers see
    /// `Removed`. Its [`Registration`] handle stays valid; a later
    /// [`Registration::update`] registers it again. Returns whether anything was removed.
    pub fn expire(&self, id: WorkerId) -> bool {
        let mut state = self.inner.lock();
        let keys: Vec<_> = state
            .workers
            .keys()
            .filter(|(_, i)| *i == id)
            .copied()
            .collect();
        for (role, id) in &keys {
            state.workers.remove(&(*role, *id));
            self.inner.notify(DiscoveryEvent::Removed {
                id: *id,
                role: *role,
            });
        }
        !keys.is_empty()
    }

    /// Number of registered workers.
    pub fn len(&self) -> usize {
        self.inner.lock().workers.len()
    }

    /// Whether no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for MemoryDiscovery {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryDiscovery")
            .field("workers", &self.len())
            .field("lease_ttl", &self.inner.lease_ttl)
            .finish()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map half-updated (every update is one
        // insert or remove), so a poisoned lock is still consistent.
        self.state.lock()
    }

    /// Called with the state lock held, so the feed's order is the state's order.
    fn notify(&self, event: DiscoveryEvent) {
        // No receiver is fine: nobody watches.
        let _ = self.changes.send(event);
    }

    fn snapshot(state: &State) -> Vec<WorkerRecord> {
        state.workers.values().map(|e| e.record.clone()).collect()
    }

    /// Puts `record` owned by `generation`.
    fn put(&self, record: WorkerRecord, generation: u64) {
        let mut state = self.lock();
        let key = (record.role, record.id);
        let changed = state.workers.get(&key).map(|e| &e.record) != Some(&record);
        state.workers.insert(
            key,
            Entry {
                record: record.clone(),
                generation,
            },
        );
        if changed {
            self.notify(DiscoveryEvent::Added(record));
        }
    }

    /// Removes the entry if `generation` still owns it.
    fn remove_owned(&self, role: WorkerRole, id: WorkerId, generation: u64) {
        let mut state = self.lock();
        if state
            .workers
            .get(&(role, id))
            .is_some_and(|e| e.generation == generation)
        {
            state.workers.remove(&(role, id));
            self.notify(DiscoveryEvent::Removed { id, role });
        }
    }
}

#[async_trait]
impl Discovery for MemoryDiscovery {
    async fn register(&self, record: WorkerRecord) -> Result<Registration, RuntimeError> {
        let generation = {
            let mut state = self.inner.lock();
            state.next_generation += 1;
            state.next_generation
        };
        let handle = MemoryRegistration {
            inner: self.inner.clone(),
            role: record.role,
            id: record.id,
            generation,
            deregistered: false,
        };
        self.inner.put(record, generation);
        Ok(Registration::new(Box::new(handle)))
    }

    async fn list(&self) -> Result<Vec<WorkerRecord>, RuntimeError> {
        let mut all = Inner::snapshot(&self.inner.lock());
        all.sort_by_key(|r| r.id);
        Ok(all)
    }

    async fn watch(&self, stop: &CancellationToken) -> Result<DiscoveryWatch, RuntimeError> {
        // Subscribe and snapshot under one lock: the feed then holds exactly what follows.
        let (feed, snapshot) = {
            let state = self.inner.lock();
            (self.inner.changes.subscribe(), Inner::snapshot(&state))
        };
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        let cancel = stop.child_token();
        tokio::spawn(watch_task(
            self.inner.clone(),
            feed,
            snapshot,
            tx,
            cancel.clone(),
        ));
        Ok(DiscoveryWatch::new(rx, Some(cancel.drop_guard())))
    }
}

async fn watch_task(
    inner: Arc<Inner>,
    mut feed: broadcast::Receiver<DiscoveryEvent>,
    snapshot: Vec<WorkerRecord>,
    tx: mpsc::Sender<DiscoveryEvent>,
    cancel: CancellationToken,
) {
    let mut view = WorkerView::new();
    let mut pending = view.resync(snapshot);
    loop {
        for event in pending.drain(..) {
            tokio::select! {
                _ = cancel.cancelled() => return,
                sent = tx.send(event) => if sent.is_err() { return },
            }
        }
        let received = tokio::select! {
            _ = cancel.cancelled() => return,
            received = feed.recv() => received,
        };
        match received {
            Ok(DiscoveryEvent::Added(record)) => pending.extend(view.put(record)),
            Ok(DiscoveryEvent::Removed { id, role }) => pending.extend(view.remove(role, id)),
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                tracing::debug!(missed, "memory discovery watch lagged; resyncing");
                // Re-subscribe and snapshot under one lock, as at the start.
                let snapshot = {
                    let state = inner.lock();
                    feed = inner.changes.subscribe();
                    Inner::snapshot(&state)
                };
                pending = view.resync(snapshot);
            }
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

struct MemoryRegistration {
    inner: Arc<Inner>,
    role: WorkerRole,
    id: WorkerId,
    generation: u64,
    deregistered: bool,
}

#[async_trait]
impl RegistrationBackend for MemoryRegistration {
    fn id(&self) -> WorkerId {
        self.id
    }

    fn role(&self) -> WorkerRole {
        self.role
    }

    fn update(&self, record: WorkerRecord) -> Result<(), RuntimeError> {
        self.inner.put(record, self.generation);
        Ok(())
    }

    async fn deregister(mut self: Box<Self>) {
        self.deregistered = true;
        self.inner.remove_owned(self.role, self.id, self.generation);
    }
}

impl Drop for MemoryRegistration {
    fn drop(&mut self) {
        if self.deregistered {
            return;
        }
        let (inner, role, id, generation) =
            (self.inner.clone(), self.role, self.id, self.generation);
        let ttl = inner.lease_ttl;
        match tokio::runtime::Handle::try_current() {
            Ok(handle) if !ttl.is_zero() => {
                handle.spawn(async move {
                    tokio::time::sleep(ttl).await;
                    inner.remove_owned(role, id, generation);
                });
            }
            _ => inner.remove_owned(role, id, generation),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::tests::record;

    async fn next(watch: &mut DiscoveryWatch) -> DiscoveryEvent {
        tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .expect("event in time")
            .expect("watch open")
    }

    #[tokio::test]
    async fn a_watch_ends_with_its_service() {
        let discovery = MemoryDiscovery::new();
        let stop = CancellationToken::new();
        let mut watch = discovery.watch(&stop).await.expect("watch");
        let _reg = discovery
            .register(record(1, WorkerRole::Decode))
            .await
            .expect("register");
        assert!(matches!(next(&mut watch).await, DiscoveryEvent::Added(_)));
        stop.cancel();
        let end = tokio::time::timeout(Duration::from_secs(5), watch.next()).await;
        assert_eq!(end.expect("ends in time"), None);
    }

    #[tokio::test]
    async fn watch_starts_with_present_workers_then_follows_changes() {
        let discovery = MemoryDiscovery::new();
        let a = record(1, WorkerRole::Decode);
        let reg_a = discovery.register(a.clone()).await.expect("register");
        let mut watch = discovery
            .watch(&CancellationToken::new())
            .await
            .expect("watch");
        assert_eq!(next(&mut watch).await, DiscoveryEvent::Added(a.clone()));

        let b = record(2, WorkerRole::Prefill);
        let reg_b = discovery.register(b.clone()).await.expect("register");
        assert_eq!(next(&mut watch).await, DiscoveryEvent::Added(b.clone()));
        assert_eq!(discovery.list().await.expect("list"), vec![a.clone(), b]);

        let mut a2 = a.clone();
        a2.model = "changed".into();
        reg_a.update(a2.clone()).expect("update");
        assert_eq!(next(&mut watch).await, DiscoveryEvent::Added(a2));

        reg_a.deregister().await;
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Removed {
                id: WorkerId(1),
                role: WorkerRole::Decode
            }
        );
        drop(reg_b);
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Removed {
                id: WorkerId(2),
                role: WorkerRole::Prefill
            }
        );
        assert!(discovery.is_empty());
    }

    #[tokio::test]
    async fn update_cannot_change_identity() {
        let discovery = MemoryDiscovery::new();
        let reg = discovery
            .register(record(1, WorkerRole::Decode))
            .await
            .expect("register");
        let err = reg
            .update(record(1, WorkerRole::Prefill))
            .expect_err("role change refused");
        assert_eq!(err.class(), crate::ErrorClass::InvalidRequest);
    }

    #[tokio::test]
    async fn expire_removes_and_update_revives() {
        let discovery = MemoryDiscovery::new();
        let a = record(7, WorkerRole::Aggregated);
        let reg = discovery.register(a.clone()).await.expect("register");
        let mut watch = discovery
            .watch(&CancellationToken::new())
            .await
            .expect("watch");
        assert_eq!(next(&mut watch).await, DiscoveryEvent::Added(a.clone()));
        assert!(discovery.expire(WorkerId(7)));
        assert!(!discovery.expire(WorkerId(7)));
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Removed {
                id: WorkerId(7),
                role: WorkerRole::Aggregated
            }
        );
        reg.update(a.clone()).expect("update");
        assert_eq!(next(&mut watch).await, DiscoveryEvent::Added(a));
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_registration_lingers_for_the_lease_ttl() {
        let discovery = MemoryDiscovery::with_lease_ttl(Duration::from_secs(10));
        let reg = discovery
            .register(record(3, WorkerRole::Decode))
            .await
            .expect("register");
        let mut watch = discovery
            .watch(&CancellationToken::new())
            .await
            .expect("watch");
        let _ = next(&mut watch).await;
        let dropped_at = tokio::time::Instant::now();
        drop(reg);
        // No timeout helper here: in paused time it would fire before the 10 s lease.
        assert_eq!(
            watch.next().await.expect("watch open"),
            DiscoveryEvent::Removed {
                id: WorkerId(3),
                role: WorkerRole::Decode
            }
        );
        assert!(dropped_at.elapsed() >= Duration::from_secs(10));
    }

    #[tokio::test]
    async fn an_old_handle_does_not_remove_a_newer_registration() {
        let discovery = MemoryDiscovery::new();
        let old = discovery
            .register(record(5, WorkerRole::Decode))
            .await
            .expect("register");
        let mut newer_record = record(5, WorkerRole::Decode);
        newer_record.model = "restarted".into();
        let _newer = discovery
            .register(newer_record.clone())
            .await
            .expect("register");
        drop(old);
        assert_eq!(discovery.list().await.expect("list"), vec![newer_record]);
    }

    #[tokio::test]
    async fn a_lagging_watch_resyncs_without_missing_removals() {
        let discovery = MemoryDiscovery::new();
        let mut watch = discovery
            .watch(&CancellationToken::new())
            .await
            .expect("watch");
        // Far more changes than the feed holds, while the watch task is not being polled much:
        // the task must end up reporting exactly the final set.
        let keep = discovery
            .register(record(1, WorkerRole::Decode))
            .await
            .expect("register");
        for i in 0..(CHANGE_FEED as u64 * 4) {
            let reg = discovery
                .register(record(100 + i, WorkerRole::Prefill))
                .await
                .expect("register");
            drop(reg);
        }
        let mut view = WorkerView::new();
        while view.len() != 1 || !view.contains_id(WorkerId(1)) {
            view.apply(&next(&mut watch).await);
        }
        // Nothing else pending that would contradict the final state.
        let settle = tokio::time::timeout(Duration::from_millis(200), async {
            while let Some(event) = watch.next().await {
                view.apply(&event);
            }
        })
        .await;
        assert!(settle.is_err(), "watch stays open");
        assert_eq!(view.records(), vec![record(1, WorkerRole::Decode)]);
        drop(keep);
    }
}
