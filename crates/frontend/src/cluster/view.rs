//! [`ClusterView`]: what the frontend (and the standalone indexer) knows of the cluster —
//! the workers in discovery with a gRPC client each, their latest load reports, and, when
//! the index is embedded, the global KV index fed from the event plane.
//!
//! # Keeping the index true (DESIGN.md §4)
//! - A worker that joins is dumped (`KvEvents{dump}`), and its index entries replaced.
//! - Events are applied in id order per worker. A gap (a lost batch, a restarted NATS) is
//!   never applied past: the worker is asked for the missing range (`KvEvents{after}`), or
//!   sends a dump when its ring no longer holds it. Events that arrive for a worker while it
//!   is being repaired are dropped: the repair answer covers them or a later gap shows them.
//! - A lost *trailing* batch shows no gap by itself: each load report carries the worker's
//!   last event id, and when the index is still behind the id of the *previous* report (one
//!   report of slack for events still in flight), the worker is repaired.
//! - A worker that leaves discovery (deregistered, lease lapsed) is purged.
//! - Events of workers not in discovery are dropped: the dump at join covers them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::{HashMap, HashSet};
use parking_lot::{Mutex, RwLock};
use tandem_indexer::{ApplyOutcome, KvIndex, OverlapScores};
use tandem_protocol::grpc::{KvEventsRequest, kv_events_reply, worker_client::WorkerClient};
use tandem_protocol::{
    BlockSize, Envelope, KvDump, KvEvent, LoadReport, SequenceHash, WorkerId, WorkerRecord,
    WorkerRole,
};
use tandem_runtime::discovery::{Discovery, DiscoveryEvent};
use tandem_runtime::events::{EventPlane, subjects};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;

/// What a [`ClusterView`] accepts and how it connects.
#[derive(Clone, Debug)]
pub struct ViewConfig {
    pub namespace: String,
    /// Workers serving another model are ignored (None: any model, e.g. a shared indexer).
    pub model: Option<String>,
    /// Workers announcing another block size are refused, loudly (DESIGN.md §3).
    pub block_size: BlockSize,
    pub connect_timeout: Duration,
    /// Keep an index fed from the event plane (false when a standalone indexer is used).
    pub embedded_index: bool,
}

/// A worker the router may use.
#[derive(Clone, Debug)]
pub struct WorkerEntry {
    pub record: WorkerRecord,
    pub client: WorkerClient<Channel>,
    /// Milliseconds since the view started, when the worker appeared (for warm-up).
    pub joined_ms: u64,
}

/// The decode pool (decode and aggregated workers) and the prefill pool, by id.
#[derive(Debug, Default)]
pub struct Registry {
    pub decode: BTreeMap<WorkerId, WorkerEntry>,
    pub prefill: BTreeMap<WorkerId, WorkerEntry>,
}

impl Registry {
    pub fn get(&self, id: WorkerId) -> Option<&WorkerEntry> {
        self.decode.get(&id).or_else(|| self.prefill.get(&id))
    }

    fn pool_mut(&mut self, role: WorkerRole) -> &mut BTreeMap<WorkerId, WorkerEntry> {
        match role {
            WorkerRole::Prefill => &mut self.prefill,
            WorkerRole::Decode | WorkerRole::Aggregated => &mut self.decode,
        }
    }
}

/// Counters of the index feed, for `/metrics` and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeedStats {
    pub events_applied: u64,
    pub gaps: u64,
    pub repairs: u64,
    pub dumps_applied: u64,
    pub workers_purged: u64,
}

#[derive(Debug, Default)]
struct Feed {
    index: RwLock<KvIndex>,
    repairing: Mutex<HashSet<WorkerId>>,
    /// `last_kv_event_id` of each worker's previous load report.
    reported: Mutex<HashMap<WorkerId, u64>>,
    stats: Mutex<FeedStats>,
}

/// The frontend's view of the cluster. Shared by `Arc`; its tasks stop on the cancel token.
#[derive(Debug)]
pub struct ClusterView {
    cfg: ViewConfig,
    registry: RwLock<Registry>,
    reports: Mutex<HashMap<WorkerId, LoadReport>>,
    feed: Option<Feed>,
    started: Instant,
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl ClusterView {
    /// Starts watching discovery and subscribing to the event plane. Subscriptions are in
    /// place when this returns; workers appear as the watch reports them.
    pub async fn start(
        cfg: ViewConfig,
        discovery: Arc<dyn Discovery>,
        events: Arc<dyn EventPlane>,
        tasks: TaskTracker,
        cancel: CancellationToken,
    ) -> Result<Arc<Self>, tandem_runtime::RuntimeError> {
        let feed = cfg.embedded_index.then(Feed::default);
        let view = Arc::new(ClusterView {
            cfg,
            registry: RwLock::default(),
            reports: Mutex::default(),
            feed,
            started: Instant::now(),
            tasks,
            cancel,
        });
        let ns = view.cfg.namespace.clone();
        let mut loads = events.subscribe(&subjects::load_reports(&ns)).await?;
        let kv = if view.feed.is_some() {
            Some(events.subscribe(&subjects::kv_events(&ns)).await?)
        } else {
            None
        };
        let mut watch = discovery.watch().await?;

        let v = view.clone();
        view.tasks.spawn(async move {
            loop {
                tokio::select! {
                    ev = watch.next() => match ev {
                        Some(ev) => v.on_discovery(ev),
                        None => {
                            tracing::error!("discovery watch ended");
                            return;
                        }
                    },
                    _ = v.cancel.cancelled() => return,
                }
            }
        });
        let v = view.clone();
        view.tasks.spawn(async move {
            loop {
                tokio::select! {
                    msg = loads.next() => match msg {
                        Some(bytes) => match LoadReport::decode(&bytes) {
                            Ok(r) => v.on_report(r),
                            Err(e) => tracing::debug!(error = %e, "undecodable load report"),
                        },
                        None => return,
                    },
                    _ = v.cancel.cancelled() => return,
                }
            }
        });
        if let Some(mut kv) = kv {
            let v = view.clone();
            view.tasks.spawn(async move {
                loop {
                    tokio::select! {
                        msg = kv.next() => match msg {
                            Some(bytes) => match Vec::<KvEvent>::decode(&bytes) {
                                Ok(batch) => v.on_events(&batch),
                                Err(e) => tracing::debug!(error = %e, "undecodable KV events"),
                            },
                            None => return,
                        },
                        _ = v.cancel.cancelled() => return,
                    }
                }
            });
        }
        Ok(view)
    }

    pub fn config(&self) -> &ViewConfig {
        &self.cfg
    }

    /// Milliseconds since the view started: the router's clock.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    pub fn registry(&self) -> parking_lot::RwLockReadGuard<'_, Registry> {
        self.registry.read()
    }

    pub fn report(&self, id: WorkerId) -> Option<LoadReport> {
        self.reports.lock().get(&id).copied()
    }

    pub fn has_index(&self) -> bool {
        self.feed.is_some()
    }

    /// Per worker, the leading blocks of `hashes` it holds, by tier (empty without an
    /// embedded index).
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> OverlapScores {
        match &self.feed {
            Some(f) => f.index.read().find_matches(hashes),
            None => OverlapScores::default(),
        }
    }

    pub fn feed_stats(&self) -> FeedStats {
        self.feed
            .as_ref()
            .map(|f| *f.stats.lock())
            .unwrap_or_default()
    }

    /// Workers the index tracks (with or without blocks), and (block, worker) entries.
    pub fn index_size(&self) -> (usize, usize) {
        self.feed.as_ref().map_or((0, 0), |f| {
            let index = f.index.read();
            (index.workers().len(), index.num_entries())
        })
    }

    /// The id of the last event applied for `worker`, when the index knows it.
    pub fn last_event_id(&self, worker: WorkerId) -> Option<u64> {
        self.feed
            .as_ref()
            .and_then(|f| f.index.read().last_event_id(worker))
    }

    fn on_discovery(self: &Arc<Self>, ev: DiscoveryEvent) {
        match ev {
            DiscoveryEvent::Added(record) => self.on_added(record),
            DiscoveryEvent::Removed { id, role } => {
                let gone = self.registry.write().pool_mut(role).remove(&id).is_some();
                self.reports.lock().remove(&id);
                if let Some(f) = &self.feed {
                    f.index.write().remove_worker(id);
                    f.reported.lock().remove(&id);
                    if gone {
                        f.stats.lock().workers_purged += 1;
                    }
                }
                if gone {
                    tracing::info!(worker = id.0, ?role, "worker left");
                }
            }
        }
    }

    fn on_added(self: &Arc<Self>, record: WorkerRecord) {
        if let Some(model) = &self.cfg.model
            && &record.model != model
        {
            tracing::warn!(worker = record.id.0, model = %record.model, "ignoring a worker of another model");
            return;
        }
        if record.block_size != self.cfg.block_size {
            tracing::error!(
                worker = record.id.0,
                theirs = record.block_size.get(),
                ours = self.cfg.block_size.get(),
                "REFUSING worker: its KV block size differs from the frontend's; its cache \
                 can never match our block hashes"
            );
            return;
        }
        let channel = match tandem_runtime::grpc::lazy_channel(
            &record.addresses.grpc,
            self.cfg.connect_timeout,
        ) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(worker = record.id.0, error = %e, "unusable worker address");
                return;
            }
        };
        let id = record.id;
        let role = record.role;
        let previous = {
            let mut reg = self.registry.write();
            let pool = reg.pool_mut(role);
            if pool.get(&id).is_some_and(|e| e.record == record) {
                // The same worker registering again (e.g. after an etcd restart): keep its
                // client and its index state.
                return;
            }
            let joined_ms = pool.get(&id).map_or_else(|| self.now_ms(), |e| e.joined_ms);
            pool.insert(
                id,
                WorkerEntry {
                    record,
                    client: WorkerClient::new(channel).max_decoding_message_size(64 << 20),
                    joined_ms,
                },
            )
        };
        match previous {
            None => tracing::info!(worker = id.0, ?role, "worker joined"),
            // A new record under a known id: most likely a restarted worker (new address,
            // event ids from 1 again) before its old lease lapsed. Its cache is new too.
            Some(_) => tracing::info!(worker = id.0, ?role, "worker re-joined with a new record"),
        }
        self.repair(id, true);
    }

    fn on_events(self: &Arc<Self>, batch: &[KvEvent]) {
        let Some(f) = &self.feed else { return };
        let mut to_repair = Vec::new();
        {
            let known = self.registry.read();
            let repairing = f.repairing.lock();
            let mut index = f.index.write();
            let mut stats = f.stats.lock();
            for ev in batch {
                if known.get(ev.worker_id).is_none()
                    || repairing.contains(&ev.worker_id)
                    || to_repair.iter().any(|(w, _)| *w == ev.worker_id)
                {
                    continue;
                }
                match index.apply(ev) {
                    ApplyOutcome::Applied => stats.events_applied += 1,
                    // A worker numbering from 1 again has restarted under the same id: its
                    // old blocks are gone; take a dump.
                    ApplyOutcome::Duplicate if ev.event_id == 1 => {
                        stats.gaps += 1;
                        to_repair.push((ev.worker_id, true));
                    }
                    ApplyOutcome::Duplicate => {}
                    ApplyOutcome::Gap { .. } => {
                        stats.gaps += 1;
                        to_repair.push((ev.worker_id, false));
                    }
                }
            }
        }
        for (w, dump) in to_repair {
            self.repair(w, dump);
        }
    }

    fn on_report(self: &Arc<Self>, r: LoadReport) {
        let w = r.worker_id;
        if self.registry.read().get(w).is_none() {
            return;
        }
        self.reports.lock().insert(w, r);
        let Some(f) = &self.feed else { return };
        let previous = f.reported.lock().insert(w, r.last_kv_event_id);
        let applied = f.index.read().last_event_id(w).unwrap_or(0);
        if previous.is_some_and(|p| p > applied) {
            f.stats.lock().gaps += 1;
            self.repair(w, false);
        }
    }

    /// Asks `worker` for the events after the index's last one, or for a dump, and applies
    /// the answer. At most one repair per worker at a time.
    fn repair(self: &Arc<Self>, worker: WorkerId, dump: bool) {
        let Some(f) = &self.feed else { return };
        if !f.repairing.lock().insert(worker) {
            return;
        }
        let Some(mut client) = self.registry.read().get(worker).map(|e| e.client.clone()) else {
            f.repairing.lock().remove(&worker);
            return;
        };
        let after = f.index.read().last_event_id(worker).unwrap_or(0);
        let view = self.clone();
        self.tasks.spawn(async move {
            let req = KvEventsRequest {
                after,
                dump: dump || after == 0,
            };
            let reply = tokio::select! {
                r = tokio::time::timeout(view.cfg.connect_timeout * 2, client.kv_events(req)) => r,
                _ = view.cancel.cancelled() => return,
            };
            let Some(f) = &view.feed else { return };
            let outcome = match reply {
                Ok(Ok(reply)) => view.apply_repair(worker, reply.into_inner().body),
                Ok(Err(status)) => Err(format!("KvEvents failed: {status}")),
                Err(_) => Err("KvEvents timed out".to_string()),
            };
            f.repairing.lock().remove(&worker);
            match outcome {
                Ok(()) => f.stats.lock().repairs += 1,
                // Left for the next gap or load report to retry.
                Err(e) => tracing::warn!(worker = worker.0, error = %e, "KV index repair failed"),
            }
        });
    }

    fn apply_repair(
        &self,
        worker: WorkerId,
        body: Option<kv_events_reply::Body>,
    ) -> Result<(), String> {
        let Some(f) = &self.feed else { return Ok(()) };
        if self.registry.read().get(worker).is_none() {
            return Ok(()); // left meanwhile: nothing to keep
        }
        match body {
            Some(kv_events_reply::Body::Events(bytes)) => {
                let events = Vec::<KvEvent>::decode(&bytes).map_err(|e| e.to_string())?;
                let mut index = f.index.write();
                for ev in events.iter().filter(|e| e.worker_id == worker) {
                    if let ApplyOutcome::Gap { .. } = index.apply(ev) {
                        return Err("the repair range has a gap".into());
                    }
                    f.stats.lock().events_applied += 1;
                }
                Ok(())
            }
            Some(kv_events_reply::Body::Dump(bytes)) => {
                let dump = KvDump::decode(&bytes).map_err(|e| e.to_string())?;
                if dump.worker_id != worker {
                    return Err(format!("dump of worker {} instead", dump.worker_id.0));
                }
                f.index
                    .write()
                    .replace_worker(&dump)
                    .map_err(|e| e.to_string())?;
                f.stats.lock().dumps_applied += 1;
                Ok(())
            }
            None => Err("empty KvEvents reply".into()),
        }
    }
}
