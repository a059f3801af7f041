//! The cluster view's gauges on the frontend's `/metrics`: workers known per pool, each
//! worker's load as it last reported it (requests, pending prefill, KV blocks in use), the KV
//! index's size, and the feed's counters (events applied, gaps, repairs, dumps, purges).
//! Refreshed from the view every [`REFRESH`] by one task, so a scrape never takes the
//! index lock.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
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

/// What the backend counts per request: how prompts were prefilled (from the decode worker's
/// first chunk), re-routes before the first token, migrations after it; and flow control's
/// series.
#[derive(Debug)]
pub struct RouteCounters {
    prefill: Family<OutcomeLabel, Counter>,
    reroutes: Counter,
    migrations: Counter,
    retries: Family<OutcomeLabel, Counter>,
    hedges: Family<OutcomeLabel, Counter>,
    pub(crate) flow: Arc<FlowMetrics>,
}

impl RouteCounters {
    /// `prefill` as reported on a first chunk (`tandem.v1.PrefillOutcome`).
    pub fn prefill(&self, outcome: i32) {
        use tandem_protocol::grpc::PrefillOutcome;
        let outcome = match PrefillOutcome::try_from(outcome) {
            Ok(PrefillOutcome::Local) => "local",
            Ok(PrefillOutcome::Remote) => "remote",
            Ok(PrefillOutcome::Fallback) => "fallback",
            _ => "unknown",
        };
        self.prefill.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    pub fn reroute(&self) {
        self.reroutes.inc();
    }

    pub fn migration(&self) {
        self.migrations.inc();
    }

    /// A failed attempt: `retried`, or `budget_exhausted` (the retry budget refused).
    pub fn retry(&self, outcome: &'static str) {
        self.retries.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    fn retry_zero(&self, outcome: &'static str) {
        let _ = self.retries.get_or_create(&OutcomeLabel { outcome });
    }

    /// A hedge: `started`, `primary_won`, `hedge_won`, or `budget_exhausted`.
    pub fn hedge(&self, outcome: &'static str) {
        self.hedges.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    pub fn register(registry: &mut Registry) -> Arc<Self> {
        let c = Arc::new(RouteCounters {
            prefill: Family::default(),
            reroutes: Counter::default(),
            migrations: Counter::default(),
            retries: Family::default(),
            hedges: Family::default(),
            flow: Arc::new(FlowMetrics::register(registry)),
        });
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
        registry.register(
            "tandem_reroutes",
            "Decode workers that failed a request before its first token (it went elsewhere)",
            c.reroutes.clone(),
        );
        registry.register(
            "tandem_migrations",
            "Requests moved to another decode worker after their worker failed mid-stream",
            c.migrations.clone(),
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
