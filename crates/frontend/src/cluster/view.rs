//! [`ClusterView`]: the I/O around the frontend's [`RoutingReplica`] (or, in the standalone
//! indexer, around only the index: a [`FedIndex`]) — discovery → the workers with a gRPC
//! client each, and the membership; the event plane → KV events and load reports; the repairs
//! the index asks for → `KvEvents` calls to the workers, whose answers go back into it.
//!
//! The rules that keep the index true (dump at join, never past a gap, trailing loss shown by
//! load reports, purge at leave) are the router's ([`FedIndex`], over
//! [`tandem_indexer::IndexFeed`]); this file only moves bytes. Workers of another model are ignored, workers announcing another block
//! size refused, loudly (docs/ARCHITECTURE.md §3).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tandem_indexer::{
    FeedError, FeedStats, IndexFeed, OverlapScores, Repair, RepairReply, StreamHealth,
};
use tandem_protocol::grpc::{KvEventsRequest, kv_events_reply, worker_client::WorkerClient};
use tandem_protocol::{
    BlockSize, Envelope, KvDump, KvEvent, LoadReport, SequenceHash, WorkerId, WorkerRecord,
    WorkerRole,
};
use tandem_router::{FedIndex, Input, KvSource, RoutingReplica};
use tandem_runtime::discovery::{Discovery, DiscoveryEvent};
use tandem_runtime::events::{EventPlane, subjects};
use tandem_runtime::grpc::Transport;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What a [`ClusterView`] accepts and how it connects.
#[derive(Clone, Debug)]
pub struct ViewConfig {
    pub namespace: String,
    /// Workers serving another model are ignored (None: any model, e.g. a shared indexer).
    pub model: Option<String>,
    /// Workers announcing another block size are refused, loudly (docs/ARCHITECTURE.md §3).
    pub block_size: BlockSize,
    pub connect_timeout: Duration,
    /// Keep the replica's index fed from the event plane (false when a standalone indexer is
    /// used).
    pub embedded_index: bool,
}

/// A worker the router may use.
#[derive(Clone, Debug)]
pub struct WorkerEntry {
    pub record: WorkerRecord,
    /// In-process when this process serves the worker (`tandem_runtime::grpc::transport`).
    pub client: WorkerClient<Transport>,
}

/// The decode pool (decode and aggregated workers) and the prefill pool, by id.
#[derive(Debug, Default)]
/// Entries are shared: a routed request holds its workers' while it runs.
pub struct Registry {
    pub decode: BTreeMap<WorkerId, Arc<WorkerEntry>>,
    pub prefill: BTreeMap<WorkerId, Arc<WorkerEntry>>,
}

impl Registry {
    pub fn get(&self, id: WorkerId) -> Option<&Arc<WorkerEntry>> {
        self.decode.get(&id).or_else(|| self.prefill.get(&id))
    }

    fn pool_mut(&mut self, role: WorkerRole) -> &mut BTreeMap<WorkerId, Arc<WorkerEntry>> {
        match role {
            WorkerRole::Prefill => &mut self.prefill,
            WorkerRole::Decode | WorkerRole::Aggregated => &mut self.decode,
        }
    }
}

/// A worker's latest report's arrival, and its rates.
#[derive(Debug)]
struct Seen {
    at: Instant,
    rates: ReportRates,
}

/// Tokens per second a worker computed, from the counters of its load reports.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenRates {
    pub prefill: f64,
    pub decode: f64,
}

/// The worker's clock must move this far between the two reports a rate is taken from: at
/// the load-report period the counters move in steps, and a rate over one period jitters.
const RATE_SPAN_MS: u64 = 1000;

/// Rates from successive load reports' token counters over the worker's own clock: each
/// report at least [`RATE_SPAN_MS`] after the base gives a new rate and becomes the base.
/// Counters or a clock that go back (a restarted worker under the same id) start again.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ReportRates {
    /// (timestamp_ms, prefill_tokens_total, decode_tokens_total) of the base report.
    base: Option<(u64, u64, u64)>,
    rates: Option<TokenRates>,
}

impl ReportRates {
    pub(crate) fn update(&mut self, r: &LoadReport) {
        let now = (
            r.timestamp_ms,
            r.prefill_tokens_total,
            r.decode_tokens_total,
        );
        let Some((t0, p0, d0)) = self.base else {
            self.base = Some(now);
            return;
        };
        if now.0 < t0 || now.1 < p0 || now.2 < d0 {
            *self = ReportRates {
                base: Some(now),
                rates: None,
            };
            return;
        }
        let span = now.0 - t0;
        if span < RATE_SPAN_MS {
            return;
        }
        let seconds = span as f64 / 1000.0;
        self.rates = Some(TokenRates {
            prefill: (now.1 - p0) as f64 / seconds,
            decode: (now.2 - d0) as f64 / seconds,
        });
        self.base = Some(now);
    }
}

/// What a [`ClusterView`] feeds: the frontend's routing replica, or the standalone indexer's
/// index alone.
pub trait Fed: std::fmt::Debug + Send + Sync + 'static {
    /// Applies what the cluster says; returns the repairs the index needs.
    fn apply(&mut self, input: Input<'_>, now_ms: u64) -> Result<Vec<Repair>, FeedError>;
    /// The exact index with its feed rules.
    fn feed(&self) -> &IndexFeed;
    /// A member's latest load report, where it is kept.
    fn report(&self, worker: WorkerId) -> Option<&LoadReport>;
}

impl Fed for RoutingReplica {
    fn apply(&mut self, input: Input<'_>, now_ms: u64) -> Result<Vec<Repair>, FeedError> {
        RoutingReplica::apply(self, input, now_ms)
    }
    fn feed(&self) -> &IndexFeed {
        RoutingReplica::feed(self)
    }
    fn report(&self, worker: WorkerId) -> Option<&LoadReport> {
        RoutingReplica::report(self, worker)
    }
}

impl Fed for FedIndex {
    fn apply(&mut self, input: Input<'_>, _now_ms: u64) -> Result<Vec<Repair>, FeedError> {
        FedIndex::apply(self, input)
    }
    fn feed(&self) -> &IndexFeed {
        FedIndex::feed(self)
    }
    /// An index routes nothing: it keeps no reports (their event ids reach its feed).
    fn report(&self, _: WorkerId) -> Option<&LoadReport> {
        None
    }
}

/// The frontend's (or the indexer's) view of the cluster, feeding `S`. Shared by `Arc`; its
/// tasks stop on the cancel token.
#[derive(Debug)]
pub struct ClusterView<S: Fed = RoutingReplica> {
    cfg: ViewConfig,
    registry: RwLock<Registry>,
    fed: RwLock<S>,
    /// When each registered worker's latest load report arrived (the status page's "last
    /// seen") and its token rates from its reports; entries leave with their worker.
    reported: RwLock<BTreeMap<WorkerId, Seen>>,
    /// Workers refused for announcing another block size, with theirs, until they leave (the
    /// cache health names them).
    refused: RwLock<BTreeMap<WorkerId, u32>>,
    /// Workers whose troubled event stream the log has named (once each, until they leave).
    said_troubled: Mutex<BTreeSet<WorkerId>>,
    started: Instant,
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl<S: Fed> ClusterView<S> {
    /// Starts watching discovery and subscribing to the event plane, feeding `fed`.
    /// Subscriptions are in place when this returns; workers appear as the watch reports them.
    pub async fn start(
        cfg: ViewConfig,
        fed: S,
        discovery: Arc<dyn Discovery>,
        events: Arc<dyn EventPlane>,
        tasks: TaskTracker,
        cancel: CancellationToken,
    ) -> Result<Arc<Self>, tandem_runtime::RuntimeError> {
        let view = Arc::new(ClusterView {
            cfg,
            registry: RwLock::default(),
            fed: RwLock::new(fed),
            reported: RwLock::default(),
            refused: RwLock::default(),
            said_troubled: Mutex::default(),
            started: Instant::now(),
            tasks,
            cancel,
        });
        let ns = view.cfg.namespace.clone();
        let mut loads = events.subscribe(&subjects::load_reports(&ns)).await?;
        let kv = if view.cfg.embedded_index {
            Some(events.subscribe(&subjects::kv_events(&ns)).await?)
        } else {
            None
        };
        let mut watch = discovery.watch(&view.cancel).await?;

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
                            Ok(r) => {
                                v.reported_now(&r);
                                v.feed(Input::LoadReport(&r));
                            }
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
                                Ok(batch) => v.feed(Input::KvEvents(&batch)),
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
        self.fed.read().report(id).cloned()
    }

    /// How long ago the worker's latest load report arrived (`None`: none yet).
    /// Workers refused for another block size than [`ViewConfig::block_size`], with theirs.
    pub fn refused_block_sizes(&self) -> Vec<(WorkerId, u32)> {
        self.refused.read().iter().map(|(w, b)| (*w, *b)).collect()
    }

    /// The block size workers must announce.
    pub fn block_size(&self) -> BlockSize {
        self.cfg.block_size
    }

    pub fn last_report_age(&self, id: WorkerId) -> Option<Duration> {
        self.reported.read().get(&id).map(|s| s.at.elapsed())
    }

    /// The worker's token rates from its load reports (`None` before two reports a second
    /// apart).
    pub fn token_rates(&self, id: WorkerId) -> Option<TokenRates> {
        self.reported.read().get(&id).and_then(|s| s.rates.rates)
    }

    fn reported_now(&self, r: &LoadReport) {
        let id = r.worker_id;
        // Only registered workers: a stray sender cannot grow the map.
        if self.registry.read().get(id).is_some() {
            let mut reported = self.reported.write();
            let seen = reported.entry(id).or_insert_with(|| Seen {
                at: Instant::now(),
                rates: ReportRates::default(),
            });
            seen.at = Instant::now();
            seen.rates.update(r);
        }
    }

    pub fn has_index(&self) -> bool {
        self.cfg.embedded_index
    }

    /// Per worker, the leading blocks of `hashes` it holds, by tier (empty without an
    /// embedded index).
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> OverlapScores {
        self.fed.read().feed().find_matches(hashes)
    }

    pub fn feed_stats(&self) -> FeedStats {
        self.fed.read().feed().stats()
    }

    /// The registered workers whose KV event streams keep losing events (the cache health's
    /// `events_gapped`).
    pub fn troubled_streams(&self) -> Vec<(WorkerId, StreamHealth)> {
        self.fed.read().feed().troubled_streams()
    }

    /// Workers the index tracks (with or without blocks), and (block, worker) entries.
    pub fn index_size(&self) -> (usize, usize) {
        let fed = self.fed.read();
        let index = fed.feed().index();
        (index.workers().len(), index.num_entries())
    }

    /// The id of the last event applied for `worker`, when the index knows it.
    pub fn last_event_id(&self, worker: WorkerId) -> Option<u64> {
        self.fed.read().feed().index().last_event_id(worker)
    }

    /// Hands `input` to what this view feeds and starts the repairs it asks for.
    fn feed(self: &Arc<Self>, input: Input<'_>) {
        let now = self.now_ms();
        let outcome = self.fed.write().apply(input, now);
        match outcome {
            Ok(repairs) => {
                for r in repairs {
                    self.say_if_troubled(r.worker);
                    self.repair(r);
                }
            }
            Err(e) => tracing::warn!(error = %e, "KV index repair answer refused"),
        }
    }

    /// Says once in the log (per worker, until it leaves) that its event stream keeps losing
    /// events: checked when a repair starts, the only time it can have become troubled.
    fn say_if_troubled(&self, worker: WorkerId) {
        let Some(h) = self.fed.read().feed().stream_health(worker) else {
            return;
        };
        if h.troubled() && self.said_troubled.lock().insert(worker) {
            tracing::warn!(
                worker = worker.0,
                cause = "events_gapped",
                gaps = h.gaps,
                behind = h.behind,
                failed_repairs = h.failed_repairs,
                "cache health: its KV events keep getting lost or arriving late; the index \
                 lags its cache until each repair"
            );
        }
    }

    fn on_discovery(self: &Arc<Self>, ev: DiscoveryEvent) {
        match ev {
            DiscoveryEvent::Added(record) => self.on_added(record),
            DiscoveryEvent::Removed { id, role } => {
                self.refused.write().remove(&id);
                let gone = self.registry.write().pool_mut(role).remove(&id).is_some();
                if gone {
                    self.reported.write().remove(&id);
                    self.said_troubled.lock().remove(&id);
                    self.feed(Input::Left { worker: id });
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
            self.refused
                .write()
                .insert(record.id, record.block_size.get());
            return;
        }
        self.refused.write().remove(&record.id);
        let channel =
            match tandem_runtime::grpc::transport(&record.addresses.grpc, self.cfg.connect_timeout)
            {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(worker = record.id.0, error = %e, "unusable worker address");
                    return;
                }
            };
        let (id, role) = (record.id, record.role);
        let device_blocks = record.kv_capacity.device_blocks;
        let placement = record.placement.clone();
        // A worker whose engine's events are not relayed is routed on the router's own
        // decisions (approximate KV).
        let kv = if record.kv_events {
            KvSource::Events
        } else {
            KvSource::Approximate
        };
        let previous = {
            let mut reg = self.registry.write();
            let pool = reg.pool_mut(role);
            if pool.get(&id).is_some_and(|e| e.record == record) {
                // The same worker registering again (e.g. after an etcd restart): keep its
                // client and its index state.
                return;
            }
            pool.insert(
                id,
                Arc::new(WorkerEntry {
                    record,
                    client: WorkerClient::new(channel).max_decoding_message_size(64 << 20),
                }),
            )
        };
        match previous {
            None => tracing::info!(worker = id.0, ?role, "worker joined"),
            // A new record under a known id: most likely a restarted worker (new address,
            // event ids from 1 again) before its old lease lapsed. Its cache is new too.
            Some(_) => tracing::info!(worker = id.0, ?role, "worker re-joined with a new record"),
        }
        self.feed(Input::Joined {
            worker: id,
            role,
            kv,
            device_blocks,
        });
        self.feed(Input::Placed {
            worker: id,
            placement: &placement,
        });
    }

    /// Asks the worker for what `r` names and hands the answer to what this view feeds.
    fn repair(self: &Arc<Self>, r: Repair) {
        if !self.cfg.embedded_index {
            return; // no index to repair: the standalone indexer keeps its own
        }
        let Some(mut client) = self.registry.read().get(r.worker).map(|e| e.client.clone()) else {
            self.feed(Input::RepairFailed { worker: r.worker });
            return;
        };
        let view = self.clone();
        self.tasks.spawn(async move {
            let req = KvEventsRequest {
                after: r.after,
                dump: r.dump,
            };
            let reply = tokio::select! {
                r = tokio::time::timeout(view.cfg.connect_timeout * 2, client.kv_events(req)) => r,
                _ = view.cancel.cancelled() => return,
            };
            let answer = match reply {
                Ok(Ok(reply)) => decode_repair(reply.into_inner().body),
                Ok(Err(status)) => Err(format!("KvEvents failed: {status}")),
                Err(_) => Err("KvEvents timed out".to_string()),
            };
            match answer {
                Ok(reply) => view.feed(Input::Repaired {
                    worker: r.worker,
                    reply,
                }),
                Err(e) => {
                    // Left for the next gap or load report to retry.
                    tracing::warn!(worker = r.worker.0, error = %e, "KV index repair failed");
                    view.feed(Input::RepairFailed { worker: r.worker });
                }
            }
        });
    }
}

impl ClusterView<RoutingReplica> {
    /// The routing replica this view feeds.
    pub fn replica(&self) -> &RwLock<RoutingReplica> {
        &self.fed
    }
}

fn decode_repair(body: Option<kv_events_reply::Body>) -> Result<RepairReply, String> {
    match body {
        Some(kv_events_reply::Body::Events(bytes)) => Vec::<KvEvent>::decode(&bytes)
            .map(RepairReply::Events)
            .map_err(|e| e.to_string()),
        Some(kv_events_reply::Body::Dump(bytes)) => KvDump::decode(&bytes)
            .map(RepairReply::Dump)
            .map_err(|e| e.to_string()),
        None => Err("empty KvEvents reply".into()),
    }
}

#[cfg(test)]
mod rate_tests {
    use super::*;

    fn report(timestamp_ms: u64, prefill: u64, decode: u64) -> LoadReport {
        LoadReport {
            timestamp_ms,
            prefill_tokens_total: prefill,
            decode_tokens_total: decode,
            ..LoadReport::default()
        }
    }

    #[test]
    fn rates_come_from_reports_a_second_apart_and_restart_with_the_counters() {
        let mut r = ReportRates::default();
        r.update(&report(10_000, 0, 0));
        r.update(&report(10_250, 100, 10));
        assert_eq!(r.rates, None, "a quarter second is too short a span");
        r.update(&report(12_000, 600, 120));
        let got = r.rates.unwrap();
        assert_eq!((got.prefill, got.decode), (300.0, 60.0));
        r.update(&report(13_000, 600, 170));
        let got = r.rates.unwrap();
        assert_eq!((got.prefill, got.decode), (0.0, 50.0));
        // A restarted worker: its counters start again, and so do the rates.
        r.update(&report(500, 5, 5));
        assert_eq!(r.rates, None);
        r.update(&report(1_500, 5, 45));
        assert_eq!(r.rates.unwrap().decode, 40.0);
    }
}
