//! The cluster view's gauges on the frontend's `/metrics`: workers known per pool, each
//! worker's load as it last reported it (requests, pending prefill, KV blocks in use) and its
//! token rates from those reports (`tandem_worker_{prompt,generation}_tokens_per_second`), the KV
//! index's size, and the feed's counters (events applied, gaps, repairs, dumps, purges).
//! Refreshed from the view every [`REFRESH`] by one task, so a scrape never takes the
//! index lock.
//!
//! Each worker's load as this replica's active-sequence tracker counts it
//! (`tandem_router_tracked_*`, docs/ARCHITECTURE.md §5) is read at scrape time instead ([`TrackedLoads`]),
//! all workers under one read of the replica: replicas sharing their deltas should show the
//! same numbers, and comparing two frontends' scrapes is how an operator (or a test) sees
//! whether they do; a refresh period's lag would blur that.
//!
//! Each worker's LoRA adapters as of its last load report ([`AdapterLoads`]:
//! `tandem_worker_lora_slots`, `tandem_worker_lora_adapter{adapter}`) are read at scrape time
//! too, since the set of adapter series changes with every report.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tandem_router::TrackedLoad;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::flow::FlowMetrics;
use super::view::ClusterView;

const REFRESH: Duration = Duration::from_millis(250);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabel {
    role: &'static str,
}

/// One worker's series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: u64,
    role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CounterLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// A remote prefill's prompt tokens as (moved, held): the decode worker's cached prefix
/// (its first chunk's `cached_tokens`) stayed there, the rest came over.
fn transfer_split(first: &tandem_protocol::grpc::GenerateChunk) -> (u64, u64) {
    let prompt = u64::from(first.prompt_tokens);
    let held = u64::from(first.cached_tokens).min(prompt);
    (prompt - held, held)
}

/// What the backend counts per request: how prompts were prefilled (from the decode worker's
/// first chunk), re-routes before the first token, migrations after it; and flow control's
/// series.
#[derive(Debug)]
pub struct RouteCounters {
    prefill: Family<OutcomeLabel, Counter>,
    remote_prefill_tokens: Family<KindLabel, Counter>,
    reroutes: Counter,
    migrations: Counter,
    handovers: Family<OutcomeLabel, Counter>,
    retries: Family<OutcomeLabel, Counter>,
    hedges: Family<OutcomeLabel, Counter>,
    overhead: Family<PhaseLabel, Histogram>,
    /// `overhead`'s series, in [`OVERHEAD_PHASES`]' order: looked up once, not per request.
    overhead_phases: [Histogram; 4],
    /// `prefill`'s series of [`PREFILL_OUTCOMES`], likewise.
    prefill_outcomes: [Counter; 3],
    pub(crate) flow: Arc<FlowMetrics>,
    /// Why workers' caches may not hit (`cache_health.rs`).
    pub(crate) cache: Arc<super::cache_health::CacheHealth>,
    /// Peer replicas heard lately (`sync.rs`).
    pub(crate) sync_peers: Gauge,
}

/// The outcomes of `tandem_prefills` a request may have.
const PREFILL_OUTCOMES: [&str; 3] = ["local", "remote", "fallback"];

/// The phases of `tandem_router_overhead_seconds`.
const OVERHEAD_PHASES: [&str; 4] = ["hash", "index", "score", "total"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

/// The router's time on one request, by phase (`tandem_router_overhead_seconds`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Overhead {
    /// Block hashes of the prompt (and the routing request built from it).
    pub hash: Duration,
    /// The KV index lookup: the standalone indexer's round trip, or the replica's own index.
    pub index: Duration,
    /// Candidates scored and the decision recorded, index lookup excluded.
    pub score: Duration,
}

impl RouteCounters {
    /// How a prompt was prefilled, as its first chunk reports it (`tandem.v1.PrefillOutcome`).
    /// A remote prefill moved the KV of the prompt's tokens past the decode worker's cached
    /// prefix; the prefix it held stayed where it was (the transfer is paged).
    pub fn prefill(&self, first: &tandem_protocol::grpc::GenerateChunk) {
        use tandem_protocol::grpc::PrefillOutcome;
        // The index of the outcome's series in `prefill_outcomes` (`PREFILL_OUTCOMES`).
        let known = match PrefillOutcome::try_from(first.prefill) {
            Ok(PrefillOutcome::Local) => 0,
            Ok(PrefillOutcome::Remote) => {
                let (moved, held) = transfer_split(first);
                self.remote_prefill_tokens(moved, held);
                self.flow.recent.remote_prefill(moved, held);
                1
            }
            Ok(PrefillOutcome::Fallback) => 2,
            _ => {
                let outcome = "unknown";
                self.prefill.get_or_create(&OutcomeLabel { outcome }).inc();
                return;
            }
        };
        self.prefill_outcomes[known].inc();
    }

    fn remote_prefill_tokens(&self, moved: u64, held: u64) {
        for (kind, n) in [("moved", moved), ("held", held)] {
            self.remote_prefill_tokens
                .get_or_create(&KindLabel { kind })
                .inc_by(n);
        }
    }

    pub fn reroute(&self) {
        self.reroutes.inc();
    }

    pub fn migration(&self) {
        self.migrations.inc();
    }

    /// A draining decode worker offered a stream's KV: `moved` (continued elsewhere with
    /// it) or `declined` (it finished on the draining worker).
    pub fn handover(&self, outcome: &'static str) {
        self.handovers
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// A failed attempt: `retried`, or `budget_exhausted` (the retry budget refused).
    pub fn retry(&self, outcome: &'static str) {
        self.retries.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    fn retry_zero(&self, outcome: &'static str) {
        let _ = self.retries.get_or_create(&OutcomeLabel { outcome });
    }

    /// One routed request's overhead, by phase and in total.
    pub(crate) fn overhead(&self, o: Overhead) {
        let total = o.hash + o.index + o.score;
        for (h, d) in self
            .overhead_phases
            .iter()
            .zip([o.hash, o.index, o.score, total])
        {
            h.observe(d.as_secs_f64());
        }
    }

    /// A hedge: `started`, `primary_won`, `hedge_won`, or `budget_exhausted`.
    pub fn hedge(&self, outcome: &'static str) {
        self.hedges.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    pub fn register(registry: &mut Registry) -> Arc<Self> {
        // 1 µs .. 131 ms.
        let overhead = Family::<PhaseLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(1e-6, 2.0, 18))
        });
        let overhead_phases =
            OVERHEAD_PHASES.map(|phase| overhead.get_or_create(&PhaseLabel { phase }).clone());
        let prefill = Family::<OutcomeLabel, Counter>::default();
        let prefill_outcomes = PREFILL_OUTCOMES
            .map(|outcome| prefill.get_or_create(&OutcomeLabel { outcome }).clone());
        let c = Arc::new(RouteCounters {
            prefill,
            prefill_outcomes,
            remote_prefill_tokens: Family::default(),
            reroutes: Counter::default(),
            migrations: Counter::default(),
            handovers: Family::default(),
            retries: Family::default(),
            hedges: Family::default(),
            overhead,
            overhead_phases,
            flow: Arc::new(FlowMetrics::register(registry)),
            cache: Arc::default(),
            sync_peers: Gauge::default(),
        });
        registry.register(
            "tandem_router_overhead_seconds",
            "The router's time per request by phase: hash (the prompt's block hashes), index \
             (KV index lookup), score (candidates scored and the decision recorded), total \
             (their sum; queueing excluded)",
            c.overhead.clone(),
        );
        for outcome in ["retried", "budget_exhausted"] {
            c.retry_zero(outcome);
        }
        for outcome in ["started", "primary_won", "hedge_won", "budget_exhausted"] {
            let _ = c.hedges.get_or_create(&OutcomeLabel { outcome });
        }
        registry.register(
            "tandem_frontend_retries",
            "Requests re-routed after a decode worker failed before the first token \
             (retried), or not re-routed because the retry budget was spent \
             (budget_exhausted)",
            c.retries.clone(),
        );
        registry.register(
            "tandem_frontend_hedges",
            "Hedged requests: started on a second worker after their size's p95 TTFT without \
             a first token, and which attempt streamed first",
            c.hedges.clone(),
        );
        registry.register(
            "tandem_prefills",
            "Requests by how their prompt was prefilled: local, remote, or fallback (a remote \
             prefill that failed and was done locally)",
            c.prefill.clone(),
        );
        c.remote_prefill_tokens(0, 0);
        registry.register(
            "tandem_remote_prefill_tokens",
            "Prompt tokens of remote prefills: moved (their KV came from the prefill worker) \
             and held (the decode worker's cached prefix, not sent)",
            c.remote_prefill_tokens.clone(),
        );
        registry.register(
            "tandem_reroutes",
            "Decode workers that failed a request before its first token (it went elsewhere)",
            c.reroutes.clone(),
        );
        for outcome in ["moved", "declined"] {
            let _ = c.handovers.get_or_create(&OutcomeLabel { outcome });
        }
        registry.register(
            "tandem_handovers",
            "Streams a draining decode worker offered with their KV: moved (continued on \
             another decode worker, the KV sent there) or declined (finished where they were)",
            c.handovers.clone(),
        );
        registry.register(
            "tandem_migrations",
            "Requests moved to another decode worker after their worker failed mid-stream",
            c.migrations.clone(),
        );
        registry.register(
            "tandem_router_sync_peers",
            "Other frontend replicas (and endpoint pickers) heard lately; this replica publishes \
             its router sync only while there is one",
            c.sync_peers.clone(),
        );
        c
    }
}

/// Registers the gauges and starts the task that refreshes them.
pub fn register(
    registry: &mut Registry,
    view: Arc<ClusterView>,
    tasks: &TaskTracker,
    cancel: CancellationToken,
) {
    let workers = Family::<RoleLabel, Gauge>::default();
    let index_workers = Gauge::<i64>::default();
    let index_entries = Gauge::<i64>::default();
    let feed = Family::<CounterLabel, Gauge>::default();
    // Both pools from the first scrape (0 until the first refresh), so that a reader polling
    // for a pool's size never finds the series missing.
    for role in ["decode", "prefill"] {
        let _ = workers.get_or_create(&RoleLabel { role });
    }
    registry.register(
        "tandem_workers",
        "Workers in discovery, by pool",
        workers.clone(),
    );
    registry.register(
        "tandem_index_workers",
        "Workers the KV index tracks (dumped when they join, purged when they leave), with or \
         without blocks",
        index_workers.clone(),
    );
    registry.register(
        "tandem_index_entries",
        "(block, worker) entries in the KV index",
        index_entries.clone(),
    );
    registry.register(
        "tandem_index_feed",
        "KV index feed counters since start: events_applied, gaps, repairs, dumps, purges",
        feed.clone(),
    );
    let per_worker = PerWorker::default();
    for (name, help, family) in [
        (
            "tandem_worker_running_requests",
            "Requests a worker runs, as of its last load report",
            &per_worker.running,
        ),
        (
            "tandem_worker_waiting_requests",
            "Requests queued on a worker, as of its last load report",
            &per_worker.waiting,
        ),
        (
            "tandem_worker_pending_prefill_tokens",
            "Prompt tokens a worker has yet to prefill, as of its last load report",
            &per_worker.pending_prefill,
        ),
        (
            "tandem_worker_kv_active_blocks",
            "Device KV blocks a worker has in use (running requests, transfers in flight or \
             held until fenced, blocks being sent), as of its last load report",
            &per_worker.kv_active,
        ),
        (
            "tandem_worker_kv_total_blocks",
            "Device KV blocks of a worker",
            &per_worker.kv_total,
        ),
        (
            "tandem_worker_breaker_state",
            "A worker's circuit breaker at this frontend: 0 closed, 1 half-open (one probe may \
             go), 2 open (not chosen)",
            &per_worker.breaker,
        ),
        (
            "tandem_worker_breaker_openings",
            "Times a worker's circuit breaker opened at this frontend",
            &per_worker.breaker_openings,
        ),
    ] {
        registry.register(name, help, family.clone());
    }
    registry.register(
        "tandem_worker_prompt_tokens_per_second",
        "Prompt tokens a worker computed per second, from its load reports' counters over \
         at least a second of its clock",
        per_worker.prompt_rate.clone(),
    );
    registry.register(
        "tandem_worker_generation_tokens_per_second",
        "Tokens a worker generated per second, from its load reports' counters over at \
         least a second of its clock",
        per_worker.generation_rate.clone(),
    );
    registry.register_collector(Box::new(TrackedLoads { view: view.clone() }));
    registry.register_collector(Box::new(AdapterLoads { view: view.clone() }));
    let gauges = ViewGauges {
        workers,
        index_workers,
        index_entries,
        feed,
        per_worker,
        shown: parking_lot::Mutex::default(),
    };
    // Once now, so that every series is on `/metrics` from the first scrape.
    gauges.refresh(&view);
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(REFRESH);
        loop {
            tokio::select! {
                _ = tick.tick() => gauges.refresh(&view),
                _ = cancel.cancelled() => return,
            }
        }
    });
}

/// The view's gauges, set from the view on each refresh.
struct ViewGauges {
    workers: Family<RoleLabel, Gauge>,
    index_workers: Gauge<i64>,
    index_entries: Gauge<i64>,
    feed: Family<CounterLabel, Gauge>,
    per_worker: PerWorker,
    /// Worker series set on the last refresh (removed when their worker leaves).
    shown: parking_lot::Mutex<Vec<WorkerLabel>>,
}

/// Per-worker gauges from the workers' load reports.
#[derive(Default)]
struct PerWorker {
    running: Family<WorkerLabel, Gauge>,
    waiting: Family<WorkerLabel, Gauge>,
    pending_prefill: Family<WorkerLabel, Gauge>,
    kv_active: Family<WorkerLabel, Gauge>,
    kv_total: Family<WorkerLabel, Gauge>,
    breaker: Family<WorkerLabel, Gauge>,
    breaker_openings: Family<WorkerLabel, Gauge>,
    prompt_rate: Family<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    generation_rate: Family<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

impl PerWorker {
    fn families(&self) -> [&Family<WorkerLabel, Gauge>; 7] {
        [
            &self.running,
            &self.waiting,
            &self.pending_prefill,
            &self.kv_active,
            &self.kv_total,
            &self.breaker,
            &self.breaker_openings,
        ]
    }

    fn set(&self, label: &WorkerLabel, r: &tandem_protocol::LoadReport) {
        let values = [
            u64::from(r.running_requests),
            u64::from(r.waiting_requests),
            r.pending_prefill_tokens,
            r.kv_active_blocks,
            r.kv_total_blocks,
        ];
        for (family, v) in self.families()[..5].iter().zip(values) {
            family.get_or_create(label).set(v as i64);
        }
    }
}

impl ViewGauges {
    fn refresh(&self, view: &ClusterView) {
        let (d, p, members) = {
            let reg = view.registry();
            let members: Vec<WorkerLabel> = reg
                .decode
                .keys()
                .map(|id| (id, "decode"))
                .chain(reg.prefill.keys().map(|id| (id, "prefill")))
                .map(|(id, role)| WorkerLabel { worker: id.0, role })
                .collect();
            (reg.decode.len(), reg.prefill.len(), members)
        };
        let mut shown = self.shown.lock();
        for gone in shown.iter().filter(|l| !members.contains(l)) {
            for family in self.per_worker.families() {
                family.remove(gone);
            }
            self.per_worker.prompt_rate.remove(gone);
            self.per_worker.generation_rate.remove(gone);
        }
        shown.clear();
        let now = view.now_ms();
        for label in members {
            let id = tandem_protocol::WorkerId(label.worker);
            let (state, openings) = {
                let replica = view.replica().read();
                (
                    replica.breaker(id, now),
                    replica.breakers().times_opened(id),
                )
            };
            self.per_worker
                .breaker
                .get_or_create(&label)
                .set(state.level());
            self.per_worker
                .breaker_openings
                .get_or_create(&label)
                .set(openings as i64);
            if let Some(r) = view.report(id) {
                self.per_worker.set(&label, &r);
            }
            if let Some(r) = view.token_rates(id) {
                self.per_worker
                    .prompt_rate
                    .get_or_create(&label)
                    .set(r.prefill);
                self.per_worker
                    .generation_rate
                    .get_or_create(&label)
                    .set(r.decode);
            }
            shown.push(label);
        }
        drop(shown);
        self.workers
            .get_or_create(&RoleLabel { role: "decode" })
            .set(d as i64);
        self.workers
            .get_or_create(&RoleLabel { role: "prefill" })
            .set(p as i64);
        let (w, e) = view.index_size();
        self.index_workers.set(w as i64);
        self.index_entries.set(e as i64);
        let s = view.feed_stats();
        for (kind, v) in [
            ("events_applied", s.events_applied),
            ("gaps", s.gaps),
            ("repairs", s.repairs),
            ("dumps", s.dumps_applied),
            ("purges", s.workers_purged),
        ] {
            self.feed
                .get_or_create(&CounterLabel { kind })
                .set(v as i64);
        }
    }
}

/// The tracker's per-worker loads (`tandem_router_tracked_*{worker,role}`), read from the
/// replica on every scrape: one series per member of either pool, zero when nothing is in
/// flight there.
#[derive(Debug)]
struct TrackedLoads {
    view: Arc<ClusterView>,
}

/// A tracked-load series: its name, its help, and which part of a [`TrackedLoad`] it shows.
type TrackedSeries = (&'static str, &'static str, fn(&TrackedLoad) -> u64);

impl TrackedLoads {
    const SERIES: [TrackedSeries; 3] = [
        (
            "tandem_router_tracked_requests",
            "Requests in flight on a worker (routed, not finished; queued ones included) as \
             this frontend's router tracks them: its own and, with replica sync, its peers'",
            |l| l.active_requests,
        ),
        (
            "tandem_router_tracked_prefill_tokens",
            "Prompt tokens routed to a worker and not yet prefilled (no first token yet), as \
             this frontend's router tracks them",
            |l| l.active_prefill_tokens,
        ),
        (
            "tandem_router_tracked_decode_blocks",
            "KV blocks a worker's in-flight requests hold or will hold (distinct prompt blocks \
             plus each request's own), as this frontend's router tracks them",
            |l| l.potential_decode_blocks,
        ),
    ];

    /// Every member's tracked load, from one read of the replica.
    fn snapshot(&self) -> Vec<(WorkerLabel, TrackedLoad)> {
        let replica = self.view.replica().read();
        let tracker = replica.tracker();
        replica
            .decode_workers()
            .map(|id| (id, "decode"))
            .chain(replica.prefill_workers().map(|id| (id, "prefill")))
            .map(|(id, role)| (WorkerLabel { worker: id.0, role }, tracker.load(id)))
            .collect()
    }
}

impl Collector for TrackedLoads {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let loads = self.snapshot();
        for (name, help, part) in Self::SERIES {
            let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (label, load) in &loads {
                let value = i64::try_from(part(load)).unwrap_or(i64::MAX);
                ConstGauge::new(value).encode(metric.encode_family(label)?)?;
            }
        }
        Ok(())
    }
}

/// Each member's LoRA adapters as its last load report gives them, read from the replica
/// on every scrape: `tandem_worker_lora_slots{worker,role}` (adapters it can hold at once, 0
/// unknown) for workers that reported LoRA at all, and `tandem_worker_lora_adapter{worker,
/// role,adapter}` 1 for each adapter it holds.
#[derive(Debug)]
struct AdapterLoads {
    view: Arc<ClusterView>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AdapterLabel {
    worker: u64,
    role: &'static str,
    adapter: String,
}

impl AdapterLoads {
    fn snapshot(&self) -> Vec<(WorkerLabel, tandem_protocol::AdapterLoad)> {
        let replica = self.view.replica().read();
        replica
            .decode_workers()
            .map(|id| (id, "decode"))
            .chain(replica.prefill_workers().map(|id| (id, "prefill")))
            .filter_map(|(id, role)| {
                let a = &replica.report(id)?.adapters;
                let any = a.max_loaded > 0 || !a.resident.is_empty();
                any.then(|| (WorkerLabel { worker: id.0, role }, a.clone()))
            })
            .collect()
    }
}

impl Collector for AdapterLoads {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let loads = self.snapshot();
        let mut metric = encoder.encode_descriptor(
            "tandem_worker_lora_slots",
            "LoRA adapters a worker can hold at once (its max_loras; 0: unknown), as of its \
             last load report",
            None,
            MetricType::Gauge,
        )?;
        for (label, load) in &loads {
            ConstGauge::new(i64::from(load.max_loaded)).encode(metric.encode_family(label)?)?;
        }
        let mut metric = encoder.encode_descriptor(
            "tandem_worker_lora_adapter",
            "1 for each LoRA adapter a worker holds (loaded, or being loaded for a waiting \
             request), as of its last load report",
            None,
            MetricType::Gauge,
        )?;
        for (label, load) in &loads {
            for adapter in &load.resident {
                let label = AdapterLabel {
                    worker: label.worker,
                    role: label.role,
                    adapter: adapter.clone(),
                };
                ConstGauge::new(1i64).encode(metric.encode_family(&label)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tandem_protocol::{
        AdapterLoad, BlockSize, LoadReport, RequestId, SequenceHash, WorkerId, WorkerRole,
    };
    use tandem_router::{Input, KvSource, RouterId, RoutingReplica, SyncMessage};
    use tandem_runtime::discovery::memory::MemoryDiscovery;
    use tandem_runtime::events::memory::MemoryEventPlane;
    use tokio_util::sync::CancellationToken;
    use tokio_util::task::TaskTracker;

    use crate::cluster::{BackendConfig, ClusterView, ViewConfig};

    fn scrape(registry: &prometheus_client::registry::Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    /// A peer's add shows on the next scrape (no refresh period), per member, and its free
    /// takes it away again.
    #[tokio::test]
    async fn tracked_loads_and_adapters_are_read_at_scrape_time() {
        let (tasks, cancel) = (TaskTracker::new(), CancellationToken::new());
        let replica =
            RoutingReplica::new(BackendConfig::new(RouterId(1)).replica_config()).unwrap();
        let view = ClusterView::start(
            ViewConfig {
                namespace: "t".into(),
                model: None,
                block_size: BlockSize::DEFAULT,
                connect_timeout: Duration::from_secs(1),
                embedded_index: false,
            },
            replica,
            Arc::new(MemoryDiscovery::new()),
            Arc::new(MemoryEventPlane::new()),
            tasks.clone(),
            cancel.clone(),
        )
        .await
        .unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        super::register(&mut registry, view.clone(), &tasks, cancel.clone());
        let feed = |input: Input<'_>| {
            view.replica().write().apply(input, 0).unwrap();
        };
        for (w, role) in [(11, WorkerRole::Decode), (21, WorkerRole::Prefill)] {
            feed(Input::Joined {
                worker: WorkerId(w),
                role,
                kv: KvSource::Events,
                device_blocks: 0,
            });
        }
        let line = |name: &str, w: u64, role: &str, v: u64| {
            format!("{name}{{worker=\"{w}\",role=\"{role}\"}} {v}\n")
        };
        let text = scrape(&registry);
        assert!(
            text.contains("# TYPE tandem_router_tracked_requests gauge"),
            "{text}"
        );
        for name in [
            "tandem_router_tracked_requests",
            "tandem_router_tracked_prefill_tokens",
            "tandem_router_tracked_decode_blocks",
        ] {
            assert!(text.contains(&line(name, 11, "decode", 0)), "{text}");
            assert!(text.contains(&line(name, 21, "prefill", 0)), "{text}");
        }
        let (router, request) = (RouterId(2), RequestId(7));
        feed(Input::PeerSync(&SyncMessage::Add {
            router,
            request,
            worker: WorkerId(11),
            blocks: vec![SequenceHash(1), SequenceHash(2)],
            prefill_tokens: 40,
            private_blocks: 3,
        }));
        let text = scrape(&registry);
        for (name, v) in [
            ("tandem_router_tracked_requests", 1),
            ("tandem_router_tracked_prefill_tokens", 40),
            ("tandem_router_tracked_decode_blocks", 5),
        ] {
            assert!(
                text.contains(&line(name, 11, "decode", v)),
                "{name}: {text}"
            );
            assert!(
                text.contains(&line(name, 21, "prefill", 0)),
                "{name}: {text}"
            );
        }
        feed(Input::PeerSync(&SyncMessage::Free { router, request }));
        let text = scrape(&registry);
        assert!(
            text.contains(&line("tandem_router_tracked_requests", 11, "decode", 0)),
            "{text}"
        );
        // No LoRA reported yet: no LoRA series.
        assert!(!text.contains("tandem_worker_lora_slots{"), "{text}");
        let report = |adapters: &[&str]| LoadReport {
            worker_id: WorkerId(11),
            adapters: AdapterLoad {
                max_loaded: 2,
                resident: adapters.iter().map(|a| a.to_string()).collect(),
            },
            ..LoadReport::default()
        };
        feed(Input::LoadReport(&report(&["sql-lora", "chat-lora"])));
        let text = scrape(&registry);
        assert!(
            text.contains(&line("tandem_worker_lora_slots", 11, "decode", 2)),
            "{text}"
        );
        let adapter = |a: &str| {
            format!(
                "tandem_worker_lora_adapter{{worker=\"11\",role=\"decode\",adapter=\"{a}\"}} 1\n"
            )
        };
        assert!(text.contains(&adapter("sql-lora")), "{text}");
        assert!(text.contains(&adapter("chat-lora")), "{text}");
        // The next report replaces the set: a dropped adapter's series goes.
        feed(Input::LoadReport(&report(&["chat-lora"])));
        let text = scrape(&registry);
        assert!(!text.contains(&adapter("sql-lora")), "{text}");
        assert!(text.contains(&adapter("chat-lora")), "{text}");
        cancel.cancel();
        tasks.close();
        tasks.wait().await;
    }
}
